//! Last-use timestamps.
//!
//! # LRU stamps without contended writes
//!
//! A lookup must refresh the stamp of every node on its path, and the top
//! nodes of a popular system prompt are on every path. With the default
//! [`Clock::Coarse`], stamps are ticks of about one millisecond of the
//! monotonic clock (each thread re-reads the clock only every ~0.1 ms of
//! time-stamp counter, so a lookup pays a few nanoseconds for it), and a
//! node's stamp is stored (a relaxed store) only when the stored value is
//! older than the current tick (`Owner::touch` in `shard/owner.rs`); so a
//! hot node's owner line is written at most about once per millisecond per
//! tenant instead of on every lookup, and reads stay reads. Two racing
//! stores may leave the older of two values from neighbouring ticks, and a
//! stamp stored into an owner array just as a writer copies it to a larger
//! one is lost; both only blur LRU order within a millisecond.
//! [`Clock::Logical`] gives every operation its own tick (exact order, one
//! shared increment per operation) for tests and simulations.

#[cfg(not(loom))]
use std::cell::Cell;
#[cfg(not(loom))]
use std::sync::OnceLock;
#[cfg(not(loom))]
use std::time::Instant;

use crate::sync::{AtomicU64, Ordering};

/// How a tree stamps the last use of a node by a tenant.
///
/// Stamps order eviction (least recently used first) and decide which tenant a
/// lookup returns (the most recently used owner of the deepest matching node).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Clock {
    /// Ticks of about one millisecond (2^20 ns) of the monotonic clock.
    ///
    /// A lookup stores a stamp only when the stored one is from an older tick,
    /// so hot shared nodes are written at most about once per millisecond per
    /// tenant instead of on every lookup. Uses within one tick are unordered
    /// between themselves. Reading the clock is amortized: each thread caches
    /// its last tick and re-reads the monotonic clock only when the CPU's
    /// time-stamp counter says about 0.1 ms may have passed (every call on
    /// targets other than x86-64).
    #[default]
    Coarse,
    /// A counter incremented by every operation: exact order of uses, at the
    /// price of one shared atomic increment per operation. For tests,
    /// simulations and reference comparisons.
    Logical,
}

#[derive(Debug)]
pub(crate) struct Ticker {
    kind: Clock,
    counter: AtomicU64,
}

impl Ticker {
    pub(crate) fn new(kind: Clock) -> Self {
        Self {
            kind,
            counter: AtomicU64::new(1),
        }
    }

    /// The current stamp; never 0.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        match self.kind {
            #[cfg(not(loom))]
            Clock::Coarse => coarse_tick(),
            // Under loom the stamp must be a function of the schedule alone.
            _ => self.counter.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }
}

/// Time-stamp counter cycles after which a thread re-reads the clock: about
/// 0.1 ms at 2-3 GHz, a tenth of a tick.
#[cfg(all(not(loom), target_arch = "x86_64"))]
const REFRESH_CYCLES: u64 = 1 << 18;

/// The current coarse tick (never 0), process-wide.
#[cfg(not(loom))]
#[inline]
fn coarse_tick() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        thread_local! {
            /// (time-stamp counter at the last clock read, tick it gave)
            static LAST: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        }
        // SAFETY: `rdtsc` only reads the time-stamp counter; it has no
        // preconditions. Its value only decides when to re-read the real
        // clock: a counter that jumps either way triggers a re-read (the
        // difference wraps to a large value), and ticks always come from the
        // monotonic clock.
        let tsc = unsafe { core::arch::x86_64::_rdtsc() };
        let (at, tick) = LAST.get();
        if tick != 0 && tsc.wrapping_sub(at) < REFRESH_CYCLES {
            return tick;
        }
        let tick = read_tick();
        LAST.set((tsc, tick));
        tick
    }
    #[cfg(not(target_arch = "x86_64"))]
    read_tick()
}

#[cfg(not(loom))]
fn read_tick() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = EPOCH.get_or_init(Instant::now);
    (epoch.elapsed().as_nanos() >> 20) as u64 + 1
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn coarse_ticks_advance_about_once_per_millisecond() {
        let ticker = Ticker::new(Clock::Coarse);
        let first = ticker.now();
        assert!(first >= 1);
        std::thread::sleep(std::time::Duration::from_millis(5));
        let later = ticker.now();
        // 5 ms is about 4.8 ticks of 2^20 ns; the cached tick may lag by a
        // fraction of one.
        assert!(later >= first + 3, "{first} -> {later}");
        assert!(ticker.now() >= later);
    }

    #[test]
    fn logical_ticks_are_unique_and_increasing() {
        let ticker = Ticker::new(Clock::Logical);
        let (a, b) = (ticker.now(), ticker.now());
        assert!(a >= 1 && b == a + 1);
    }
}
