//! The render memo: a conversation's next turn renders only its new
//! messages.
//!
//! A chat's next request repeats every earlier message, and the template's
//! loop over the messages prints each of them again. The memo keeps, for
//! the top-level loop over the request's `messages` (or a slice of them),
//! the state a rendering reached after its first `k` iterations: the text
//! they printed, the namespace attributes they set, the steps they took.
//! A later rendering whose loop starts in the same state resumes there and
//! runs only the iterations after `k`.
//!
//! Why it is exact. An iteration's effects (its output, its namespace
//! writes, whether it declines) are a function of what it reads:
//!
//! - the loop's items (the message, `loop.previtem`, `loop.nextitem`): the
//!   key holds the canonical encoding of items `0..=k`, compared byte for
//!   byte on a hit, never by hash alone;
//! - `loop.index`, `index0`, `first`: the iteration's number, the same on
//!   both sides; `loop.last` is false in every iteration before `k` on both
//!   sides, because a state is stored, and used, only for `k` below the
//!   item count; `loop.length` and `revindex` make a rendering store
//!   nothing;
//! - every variable and context value read from outside the iterations:
//!   the renderer records each name the iterations look up past the loop's
//!   own frame; the entry keeps those names with the canonical encoding of
//!   their values at the loop's start (a namespace with its attributes as
//!   they were then), and a hit needs each to encode the same now. A name
//!   bound to the messages list itself (or a slice of it) cannot be
//!   compared cheaply, and makes the rendering store nothing;
//! - the clock (`strftime_now`): makes the rendering store nothing.
//!
//! Nothing else reaches an iteration (the template is the same: the memo
//! belongs to one compiled template; macros read only their arguments and
//! the context). The output cap is in the key; the fuel is replayed (the
//! resumed rendering declines exactly where the full one would run out).
//!
//! The store is a few shards, each a map from a key's hash to its entry
//! behind a short mutex, bounded in bytes with a second-chance FIFO: a
//! router's threads touch different shards, and hold a lock for a map
//! lookup or insert, never for a rendering.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use minijinja::value::{Value, ValueKind};
use parking_lot::Mutex;

use super::Name;
use super::value::{int, vec_items};
use crate::request::small_map_entries;

/// The default bound of a template's memo, in bytes of stored text and
/// keys (about two entries per conversation, each about twice the
/// conversation's rendered size).
pub const DEFAULT_RENDER_MEMO_BYTES: usize = 32 << 20;

const SHARDS: usize = 16;

/// Values nested deeper than this are not encoded (the memo stores
/// nothing for such a rendering).
const MAX_ENCODE_DEPTH: usize = 32;

/// A namespace attribute's value as a stored state holds it: a plain
/// scalar (none, boolean, number, string), or another namespace.
#[derive(Clone)]
pub(super) enum Stored {
    Value(Value),
    Ns(usize),
}

/// A namespace's attributes as a stored state holds them.
pub(super) type StoredFields = Vec<(Box<str>, Stored)>;

/// The state after the first `k` iterations.
pub(super) struct Point {
    pub(super) k: usize,
    /// The length of the key's item bytes (items `0..=k`).
    pub(super) items_len: usize,
    /// The length of the iterations' output.
    pub(super) text_len: usize,
    /// The renderer's steps the `k` iterations took.
    pub(super) steps: u64,
    /// How many of them passed the loop's filter.
    pub(super) ran: usize,
    /// The namespaces the iterations could have changed (those reachable
    /// from what they read, and the ones they made), by index.
    pub(super) namespaces: Vec<(usize, StoredFields)>,
}

/// One rendering's stored states of one loop.
pub(super) struct Entry {
    pub(super) loop_id: usize,
    pub(super) max_output: usize,
    /// The canonical encoding of the items, through the last point's.
    pub(super) items: Box<[u8]>,
    /// The iterations' output, through the last point.
    pub(super) text: Box<str>,
    /// Each name read from outside the iterations, with the encoding of
    /// its value at the loop's start.
    pub(super) reads: Vec<(Name, Box<[u8]>)>,
    /// How many namespaces existed at the loop's start.
    pub(super) ns_count: usize,
    pub(super) points: Vec<Point>,
    referenced: AtomicBool,
}

impl Entry {
    #[allow(clippy::too_many_arguments)] // reason: one constructor, named fields at its only call
    pub(super) fn new(
        loop_id: usize,
        max_output: usize,
        items: Box<[u8]>,
        text: Box<str>,
        reads: Vec<(Name, Box<[u8]>)>,
        ns_count: usize,
        points: Vec<Point>,
    ) -> Self {
        Self {
            loop_id,
            max_output,
            items,
            text,
            reads,
            ns_count,
            points,
            referenced: AtomicBool::new(false),
        }
    }

    /// What the entry costs the budget (an estimate of its heap bytes).
    fn charge(&self) -> usize {
        let reads: usize = self.reads.iter().map(|(_, b)| b.len() + 32).sum();
        let points: usize = self
            .points
            .iter()
            .map(|p| {
                64 + p
                    .namespaces
                    .iter()
                    .map(|(_, f)| 32 + f.iter().map(|(k, _)| k.len() + 48).sum::<usize>())
                    .sum::<usize>()
            })
            .sum();
        256 + self.items.len() + self.text.len() + reads + points
    }
}

struct Shard {
    map: ahash::AHashMap<u64, Arc<Entry>>,
    /// The map's keys, oldest first (each once).
    order: VecDeque<u64>,
    bytes: usize,
}

/// A template's memo of loop states (see the module docs).
pub(super) struct Memo {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    lookups: AtomicU64,
    hits: AtomicU64,
}

/// How a template's render memo has served (see
/// [`ChatTemplate::render_memo_stats`](crate::ChatTemplate::render_memo_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenderMemoStats {
    /// Renderings whose message loop looked for a stored state.
    pub lookups: u64,
    /// Of them, those that found one and resumed from it.
    pub hits: u64,
    /// The bytes the memo holds now (its estimate, against its bound).
    pub bytes: usize,
}

impl Memo {
    /// A memo of at most `bytes` (split evenly over its shards); `None`
    /// for 0 (no memo).
    pub(super) fn new(bytes: usize) -> Option<Self> {
        if bytes == 0 {
            return None;
        }
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: ahash::AHashMap::new(),
                    order: VecDeque::new(),
                    bytes: 0,
                })
            })
            .collect();
        Some(Self {
            shards,
            shard_budget: (bytes / SHARDS).max(1),
            lookups: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        })
    }

    /// Counts a loop's search for a stored state, and whether it found one.
    pub(super) fn count(&self, hit: bool) {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn stats(&self) -> RenderMemoStats {
        RenderMemoStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            bytes: self.shards.iter().map(|s| s.lock().bytes).sum(),
        }
    }

    /// A key's shard, by the key itself: conversations that share a
    /// system prompt (most of an application's) spread over every shard.
    fn shard(&self, key: u64) -> &Mutex<Shard> {
        // The high bits: the map hashes the key again for its own buckets.
        &self.shards[(key >> 60) as usize % SHARDS]
    }

    /// The entry stored under `key`, if any (a candidate: the caller
    /// compares its bytes).
    pub(super) fn get(&self, key: u64) -> Option<Arc<Entry>> {
        let shard = self.shard(key).lock();
        let entry = shard.map.get(&key)?;
        entry.referenced.store(true, Ordering::Relaxed);
        Some(entry.clone())
    }

    /// Stores `entry` under each of `keys` (each in its key's shard,
    /// charged there in full), evicting in each the oldest entries not
    /// used since they were last passed over, down to the budget.
    pub(super) fn insert(&self, keys: &[u64], entry: Entry) {
        let entry = Arc::new(entry);
        let charge = entry.charge();
        if charge > self.shard_budget {
            return;
        }
        for &key in keys {
            let mut shard = self.shard(key).lock();
            match shard.map.insert(key, entry.clone()) {
                Some(old) => shard.bytes -= old.charge(),
                None => shard.order.push_back(key),
            }
            shard.bytes += charge;
            shard.evict(self.shard_budget);
        }
    }
}

impl Shard {
    fn evict(&mut self, budget: usize) {
        let shard = self;
        // Each key is passed over at most twice (its mark is cleared the
        // first time), so this ends.
        while shard.bytes > budget {
            let Some(key) = shard.order.pop_front() else {
                break;
            };
            let Some(found) = shard.map.get(&key) else {
                continue;
            };
            if found.referenced.swap(false, Ordering::Relaxed) {
                shard.order.push_back(key);
                continue;
            }
            if let Some(old) = shard.map.remove(&key) {
                shard.bytes -= old.charge();
            }
        }
    }
}

/// The hasher of keys: fixed seeds, so a key means the same in every
/// thread (the bytes are compared on a hit in any case).
pub(super) fn key_hasher() -> ahash::AHasher {
    ahash::RandomState::with_seeds(
        0x243f_6a88_85a3_08d3,
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
    )
    .build_hasher()
}

/// Appends `value`'s canonical encoding to `out`: two values encode the
/// same only if the direct renderer cannot tell them apart (kind, number
/// representation, string safety, a sequence's and a map's items in
/// order, the crate's own map type). `false` for a value outside those
/// kinds (`out` then holds a partial encoding, to be discarded).
pub(super) fn encode(out: &mut Vec<u8>, value: &Value) -> bool {
    encode_at(out, value, 0)
}

fn encode_at(out: &mut Vec<u8>, value: &Value, depth: usize) -> bool {
    if depth > MAX_ENCODE_DEPTH {
        return false;
    }
    match value.kind() {
        ValueKind::Undefined => out.push(0),
        ValueKind::None => out.push(1),
        ValueKind::Bool => out.extend_from_slice(&[2, u8::from(value.is_true())]),
        ValueKind::Number => {
            if let Some(n) = int(value) {
                out.push(3);
                out.extend_from_slice(&n.to_le_bytes());
            } else if !value.is_integer()
                && let Ok(x) = f64::try_from(value.clone())
            {
                out.push(4);
                out.extend_from_slice(&x.to_bits().to_le_bytes());
            } else {
                // A wide integer: its digits.
                out.push(5);
                text(out, &value.to_string());
            }
        }
        ValueKind::String => {
            let Some(s) = value.as_str() else {
                return false;
            };
            out.push(if value.is_safe() { 7 } else { 6 });
            text(out, s);
        }
        ValueKind::Seq => {
            let Some(items) = vec_items(value) else {
                return false;
            };
            out.push(8);
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                if !encode_at(out, item, depth + 1) {
                    return false;
                }
            }
        }
        ValueKind::Map => {
            let Some(entries) = small_map_entries(value) else {
                return false;
            };
            out.push(9);
            out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
            for (k, v) in entries {
                if !encode_at(out, k, depth + 1) || !encode_at(out, v, depth + 1) {
                    return false;
                }
            }
        }
        _ => return false,
    }
    true
}

fn text(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        encode(&mut out, v).then_some(out)
    }

    #[test]
    fn values_the_renderer_tells_apart_encode_apart() {
        let pairs = [
            (Value::from(1), Value::from(1.0)),
            (Value::from(1), Value::from(true)),
            (Value::from(()), Value::UNDEFINED),
            (Value::from("a"), Value::from_safe_string("a".into())),
            (Value::from("ab"), Value::from(vec![Value::from("ab")])),
            (
                Value::from(vec![Value::from("a"), Value::from("b")]),
                Value::from(vec![Value::from("ab")]),
            ),
        ];
        for (a, b) in pairs {
            assert_ne!(enc(&a), enc(&b), "{a:?} and {b:?}");
        }
        assert_eq!(enc(&Value::from("x")), enc(&Value::from("x".to_owned())));
    }

    #[test]
    fn the_store_stays_within_its_budget() {
        let memo = Memo::new(SHARDS * 8192).expect("a memo");
        for i in 0..200u64 {
            let entry = Entry::new(
                1,
                1 << 20,
                vec![0u8; 1000].into(),
                "x".repeat(1000).into(),
                Vec::new(),
                0,
                Vec::new(),
            );
            memo.insert(&[i << 58, (i + 1_000_000) << 58], entry);
            assert!(memo.stats().bytes <= SHARDS * 8192);
        }
        assert!(memo.get(199 << 58).is_some());
    }
}
