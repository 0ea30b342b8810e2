//! The built-in policies.

pub mod cache_aware;
pub mod consistent_hash;
pub mod cost;
#[cfg(feature = "kv-block-index")]
pub mod kv_aware;
pub mod least_loaded;
pub mod power_of_two;
pub mod random;
pub mod rendezvous;
pub mod round_robin;
#[cfg(feature = "kv-block-index")]
pub mod session;

use std::sync::atomic::{AtomicUsize as HintCell, Ordering as HintOrdering};

use crate::backend::Backend;

/// Finds the candidate whose key is `key`, trying `hint` (where it was last
/// found) first so that a stable slice costs one string comparison, then
/// scanning and remembering the new position.
pub(crate) fn find_candidate<B: Backend>(
    key: &str,
    hint: &HintCell,
    candidates: &[B],
) -> Option<usize> {
    let guess = hint.load(HintOrdering::Relaxed);
    if candidates.get(guess).is_some_and(|c| c.key() == key) {
        return Some(guess);
    }
    let found = candidates.iter().position(|c| c.key() == key)?;
    hint.store(found, HintOrdering::Relaxed);
    Some(found)
}

/// The fair least-loaded choice among available candidates: smallest
/// `(load, processed)`, and among exact ties the first met when scanning
/// from `start` (wrapping). Callers rotate or hash `start`, so equal-load
/// traffic never lands on "index 0 every time" (invariant 12 of docs/architecture.md).
///
/// Returns the index and its load.
pub(crate) fn fair_least_loaded<B: Backend>(
    candidates: &[B],
    start: usize,
) -> Option<(usize, usize)> {
    fair_least_loaded_where(candidates, start, |_| true)
}

/// The least loaded available candidate over all `candidates` (0 when none
/// is available): the reference point of the per-request load gate
/// (invariant 11). A candidate that is down or draining is not a place the
/// request could go, so it never lowers the minimum.
pub(crate) fn min_available_load<B: Backend>(candidates: &[B]) -> usize {
    candidates
        .iter()
        .filter(|c| c.is_available())
        .map(|c| c.load())
        .min()
        .unwrap_or(0)
}

/// [`fair_least_loaded`] over the candidates for which `eligible(index)`
/// also holds (kv-aware leaves out workers a membership event removed).
pub(crate) fn fair_least_loaded_where<B: Backend>(
    candidates: &[B],
    start: usize,
    eligible: impl Fn(usize) -> bool,
) -> Option<(usize, usize)> {
    let n = candidates.len();
    if n == 0 {
        return None;
    }
    let start = start % n;
    // (index, load, processed); `processed` is read only when loads tie,
    // which saves one atomic load per candidate on the common path.
    let mut best: Option<(usize, usize, u64)> = None;
    let mut consider = |i: usize| {
        let c = &candidates[i];
        if !c.is_available() || !eligible(i) {
            return;
        }
        let load = c.load();
        match best {
            Some((_, best_load, _)) if load > best_load => {}
            Some((_, best_load, best_processed)) if load == best_load => {
                let processed = c.processed();
                if processed < best_processed {
                    best = Some((i, load, processed));
                }
            }
            _ => best = Some((i, load, c.processed())),
        }
    };
    for i in start..n {
        consider(i);
    }
    for i in 0..start {
        consider(i);
    }
    best.map(|(i, load, _)| (i, load))
}

/// Uniformly random available candidate: a few rejection draws (exactly
/// uniform), then an exact count-and-pick when most candidates are down.
pub(crate) fn random_available<B: Backend>(
    candidates: &[B],
    rng: &crate::rng::SharedRng,
    exclude: Option<usize>,
) -> Option<usize> {
    let n = candidates.len();
    let pool = n - usize::from(exclude.is_some_and(|e| e < n));
    if pool == 0 {
        return None;
    }
    // Map a draw in 0..pool onto 0..n, skipping `exclude`.
    let nth = |k: usize| match exclude {
        Some(e) if k >= e => k + 1,
        _ => k,
    };
    for _ in 0..4 {
        let i = nth(rng.below(pool));
        if candidates[i].is_available() {
            return Some(i);
        }
    }
    let eligible = |i: &usize| Some(*i) != exclude && candidates[*i].is_available();
    let available = (0..n).filter(eligible).count();
    if available == 0 {
        return None;
    }
    (0..n).filter(eligible).nth(rng.below(available))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::BasicBackend;

    #[test]
    fn least_loaded_breaks_ties_by_processed_then_start() {
        let c = [
            BasicBackend::new("a").with_load(2),
            BasicBackend::new("b").with_load(1),
            BasicBackend::new("c").with_load(1),
            BasicBackend::new("d").with_load(0).with_available(false),
        ];
        assert_eq!(fair_least_loaded(&c, 0), Some((1, 1)));
        assert_eq!(fair_least_loaded(&c, 2), Some((2, 1)));
        c[2].set_processed(5);
        assert_eq!(fair_least_loaded(&c, 2), Some((1, 1)));
        for x in &c {
            x.set_available(false);
        }
        assert_eq!(fair_least_loaded(&c, 0), None);
        assert_eq!(fair_least_loaded::<BasicBackend>(&[], 3), None);
    }

    #[test]
    fn random_available_respects_exclusion_and_availability() {
        let rng = crate::rng::SharedRng::new(1);
        let c: Vec<_> = (0..5)
            .map(|i| BasicBackend::new(format!("w{i}")).with_available(i % 2 == 0))
            .collect();
        for _ in 0..500 {
            let i = random_available(&c, &rng, Some(2)).expect("0 and 4 are up");
            assert!(i == 0 || i == 4, "{i}");
        }
        let one = [BasicBackend::new("x")];
        assert_eq!(random_available(&one, &rng, Some(0)), None);
        assert_eq!(random_available(&one, &rng, None), Some(0));
    }
}
