//! Roots: common beginnings whose texts are spread over shards of their own.
//!
//! Every chat routing text begins with a role (`system: `, `user: `), so with
//! shards chosen by the first symbol all chat traffic would share one or two
//! shards, and one eviction's exclusive hold would stop all of it. A tree
//! told its *roots* stores a text that begins with a root and goes on past
//! it in two parts:
//!
//! - the root itself, as a text of its own, in the shard of its first symbol
//!   (the *head* shard), where texts that do not begin with a root live too;
//! - the rest, after the root, in one of the root's own *rooted* shards,
//!   chosen by the symbol that follows the root.
//!
//! # What it splits, and what it cannot
//!
//! Texts under a root are spread by the one symbol after the root: chat
//! texts whose first message begins with different words land in different
//! shards, up to the root's share of the 64 rooted shards (12 each with the
//! router's five roles). Texts that share more than the root (one system
//! prompt for many users) still share a shard, and no key can split them
//! while a lookup stays one walk per shard: whatever decides the shard, all
//! texts that share the beginning the lookup matches must be found by the
//! same walk. That traffic shares its long prefix's nodes anyway, and what
//! it shares is read, not locked (see the crate docs, "Concurrency").
//!
//! # Why lookups stay exact
//!
//! Write `r` for the root a lookup's input begins with and `k` for the
//! symbol after it.
//!
//! - A match longer than `r` can only come from texts that begin with `r`
//!   and then `k`; all of them are in the rooted shard of `(r, k)`, which
//!   holds nothing but the rests of `r`'s texts. So a walk there that
//!   matches anything gives the answer, and its deepest node is the same
//!   node, with the same owners and stamps, as in a tree without roots that
//!   has a node boundary at the end of `r`.
//! - Otherwise the answer is at most `r` long, and it is in the head shard:
//!   no text there goes on past `r` (those are all in rooted shards), and a
//!   tenant that holds anything under `r` holds the text `r` there (see
//!   below), with a stamp refreshed by every use of its texts under `r`.
//!
//! # The root's hold
//!
//! A tenant's hold on the root text `r` in the head shard stands for its
//! hold on `r` as the prefix of all its texts under `r`: an insert under `r`
//! inserts the rest into the rooted shard first, then `r` into the head
//! shard with the same stamp, and a lookup that routes to a tenant through a
//! rooted shard refreshes that tenant's stamp on `r` too. Eviction treats
//! that hold as a leaf only when the tenant holds nothing in `r`'s rooted
//! shards (its shard bitmap says so): exactly when the tree without roots
//! would find no held child below `r`. When an eviction takes a tenant's
//! last hold under `r`, the tenant's hold on `r` becomes a leaf and joins the
//! candidates at once, so evictions happen in the same order as there.
//!
//! Sizes are unchanged as well: the rests are counted in the rooted shards
//! and `r` once, in the head shard.
//!
//! # Racing writers
//!
//! An insert marks the rooted shard in the tenant's bitmap before it
//! refreshes `r`, and an eviction of `r` checks the bitmap under the head
//! shard's exclusive lock, which the insert's second step waits for. So an
//! eviction racing an insert may take `r` just before the insert puts it
//! back, never after the insert returned. Until then a lookup may report
//! that tenant at most `r` long where it holds more, as any insert not yet
//! finished may be reported short (see the crate docs).
//!
//! `remove_tenant` ignores the pin: it takes everything. It goes over the
//! head shards before the rooted ones (their indices come after), so an
//! insert racing it can leave the root behind without the rest, a state the
//! tree without roots has too, but never the rest without the root.
//!
//! Under loom (`cfg(loom)`) there are two rooted shards, so a tree takes at
//! most two roots there ([`RootsError::Unsupported`] beyond);
//! `tests/loom_roots.rs` runs an insert under a root against the root's
//! eviction and against the tenant's removal.

use std::ops::Range;

use super::{FIRST_SHARDS, ROOTED_SHARDS};
use crate::budget::SHARD_WORDS;
use crate::symbol::{Probe, Symbol, Unit};
use crate::sync::{AtomicU64, Ordering};

/// Most roots one tree may have: each gets at least
/// `ROOTED_SHARDS / MAX_ROOTS` shards of its own.
pub const MAX_ROOTS: usize = 8;

/// Why [`RadixTree::with_roots`](crate::RadixTree::with_roots) refused a set
/// of roots.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RootsError {
    /// More roots than [`MAX_ROOTS`].
    #[error("{0} roots given, at most {MAX_ROOTS} are supported")]
    TooMany(usize),
    /// An empty root.
    #[error("root {0} is empty")]
    Empty(usize),
    /// One root begins with another, so a text under the longer one would
    /// belong to both.
    #[error("root {longer} begins with root {shorter}")]
    Nested {
        /// Index of the root that begins with the other.
        shorter: usize,
        /// Index of the root that the other begins.
        longer: usize,
    },
    /// The tree already holds something: roots decide where texts live, so
    /// they are set on an empty tree.
    #[error("the tree is not empty")]
    NotEmpty,
    /// This build has too few shards for this many roots (the crate's
    /// loom models have two).
    #[error("this build has too few rooted shards for this many roots")]
    Unsupported,
}

/// Checks a set of roots without building a tree: at most [`MAX_ROOTS`],
/// none empty, none beginning with another. (Whether this build has shards
/// for them is a tree's own matter, [`RootsError::Unsupported`].)
pub(crate) fn check<S: Symbol>(roots: &[impl AsRef<[S]>]) -> Result<(), RootsError> {
    if roots.len() > MAX_ROOTS {
        return Err(RootsError::TooMany(roots.len()));
    }
    for (i, root) in roots.iter().enumerate() {
        if root.as_ref().is_empty() {
            return Err(RootsError::Empty(i));
        }
    }
    for (a, ra) in roots.iter().enumerate() {
        for (b, rb) in roots.iter().enumerate() {
            if a != b && rb.as_ref().starts_with(ra.as_ref()) {
                return Err(RootsError::Nested {
                    shorter: a,
                    longer: b,
                });
            }
        }
    }
    Ok(())
}

/// One root and where its texts live.
#[derive(Debug)]
pub(crate) struct Root<U> {
    /// The root's units.
    pub(crate) units: Box<[U]>,
    /// Its length in symbols.
    pub(crate) symbols: usize,
    /// The head shard: where the root text itself lives.
    pub(crate) head: u32,
    /// Its rooted shards.
    pub(crate) shards: Range<u32>,
    /// The last stamp a lookup refreshed some tenants' holds on the root
    /// with, by tenant modulo [`TOUCH_SLOTS`] (see [`Root::touch_due`]).
    touched: Box<[AtomicU64]>,
}

/// Slots of [`Root`]'s lookup refresh record.
#[cfg(not(loom))]
const TOUCH_SLOTS: usize = 256;
/// Few under loom, whose atomics are each part of the model.
#[cfg(loom)]
const TOUCH_SLOTS: usize = 2;

/// Bits of a stamp kept in a refresh record's slot; the tenant id takes
/// the others.
const TOUCH_STAMP_BITS: u32 = 40;

impl<U: Unit> Root<U> {
    /// The rooted shard of a rest whose first symbol is `key`.
    #[inline]
    pub(crate) fn shard_for(&self, key: u32) -> u32 {
        let width = self.shards.end - self.shards.start;
        self.shards.start + (key.wrapping_mul(0x9E37_79B1) >> 16) % width
    }

    /// Whether a lookup that routed to `tenant` through this root's shards
    /// at stamp `now` still has to refresh the tenant's hold on the root:
    /// false when an earlier lookup did so at the same stamp. A lookup's
    /// refresh only raises the stamp to `now` where the hold exists, so
    /// skipping a second one at the same stamp changes nothing; with
    /// [`Clock::Coarse`](crate::Clock::Coarse) most lookups are skipped
    /// (one refresh per tenant and millisecond), with
    /// [`Clock::Logical`](crate::Clock::Logical) none is. The record is
    /// read before it is written, so lookups on several threads share its
    /// cache line instead of passing it between them.
    #[inline]
    pub(crate) fn touch_due(&self, tenant: u32, now: u64) -> bool {
        if u64::from(tenant) >= (1 << (64 - TOUCH_STAMP_BITS)) - 1 {
            return true;
        }
        let mark = (u64::from(tenant) << TOUCH_STAMP_BITS) | (now & ((1 << TOUCH_STAMP_BITS) - 1));
        let slot = &self.touched[tenant as usize % TOUCH_SLOTS];
        if slot.load(Ordering::Relaxed) == mark {
            return false;
        }
        slot.store(mark, Ordering::Relaxed);
        true
    }

    /// Whether `tenant`'s shard bitmap marks any of this root's shards.
    #[inline]
    pub(crate) fn marked(&self, map: &[u64; SHARD_WORDS]) -> bool {
        self.shards
            .clone()
            .any(|s| map[s as usize / 64] & (1 << (s % 64)) != 0)
    }
}

/// A tree's roots, in the order given.
#[derive(Debug)]
pub(crate) struct Roots<U> {
    roots: Box<[Root<U>]>,
}

impl<U: Unit> Default for Roots<U> {
    fn default() -> Self {
        Self {
            roots: Box::new([]),
        }
    }
}

impl<U: Unit> Roots<U> {
    /// Checks `roots` (see [`check`]) and gives each its range of rooted
    /// shards.
    pub(crate) fn new<S: Symbol<Unit = U>>(
        roots: &[impl AsRef<[S]>],
        head: impl Fn(u32) -> u32,
    ) -> Result<Self, RootsError> {
        check(roots)?;
        if roots.is_empty() {
            return Ok(Self::default());
        }
        if roots.len() > ROOTED_SHARDS {
            return Err(RootsError::Unsupported);
        }
        let width = (ROOTED_SHARDS / roots.len()) as u32;
        let mut built = Vec::with_capacity(roots.len());
        for (i, root) in roots.iter().enumerate() {
            let symbols = root.as_ref();
            let mut units = Vec::new();
            let mut buf = [U::ZERO; 4];
            for &symbol in symbols {
                let n = symbol.encode(&mut buf);
                units.extend_from_slice(&buf[..n]);
            }
            let start = FIRST_SHARDS as u32 + i as u32 * width;
            built.push(Root {
                units: units.into_boxed_slice(),
                symbols: symbols.len(),
                head: head(symbols[0].key()),
                shards: start..start + width,
                // u64::MAX is no tenant's mark: the first lookup refreshes.
                touched: (0..TOUCH_SLOTS).map(|_| AtomicU64::new(u64::MAX)).collect(),
            });
        }
        Ok(Self {
            roots: built.into_boxed_slice(),
        })
    }

    /// Whether there are no roots.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The roots.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Root<U>> {
        self.roots.iter()
    }

    /// The root `probe` begins with and goes on past, and the probe of the
    /// rest after it.
    #[inline]
    pub(crate) fn split<'p, P: Probe<U>>(&'p self, probe: &P) -> Option<(&'p Root<U>, P)> {
        if self.roots.is_empty() || probe.at_end(0) {
            return None;
        }
        self.roots.iter().find_map(|root| {
            probe
                .after(&root.units, root.symbols)
                .map(|rest| (root, rest))
        })
    }

    /// The root whose rooted shards include `shard`.
    #[inline]
    pub(crate) fn owning(&self, shard: u32) -> Option<&Root<U>> {
        self.roots.iter().find(|r| r.shards.contains(&shard))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn roots(list: &[&str]) -> Result<Roots<u8>, RootsError> {
        let chars: Vec<Vec<char>> = list.iter().map(|r| r.chars().collect()).collect();
        Roots::new(&chars, |key| key % 128)
    }

    #[test]
    fn a_lookups_refresh_is_skipped_only_at_the_same_stamp_for_the_same_tenant() {
        let roots = roots(&["user: "]).unwrap();
        let root = roots.iter().next().unwrap();
        assert!(root.touch_due(3, 1000), "the first lookup refreshes");
        assert!(
            !root.touch_due(3, 1000),
            "the same tenant at the same stamp"
        );
        assert!(root.touch_due(3, 1001), "a later stamp");
        assert!(
            root.touch_due(3 + TOUCH_SLOTS as u32, 1001),
            "another tenant in the slot"
        );
        assert!(root.touch_due(3, 1001), "which took the slot");
        let too_large = (1u32 << (64 - TOUCH_STAMP_BITS)) - 1;
        assert!(root.touch_due(too_large, 7) && root.touch_due(too_large, 7));
    }

    /// Issue 38's "chat traffic spreads": a thousand distinct chat texts,
    /// all beginning with the same role, share one shard without roots and
    /// spread over all of the role's shards with them, answering the same.
    #[test]
    fn chat_texts_under_one_role_spread_over_the_roles_shards() {
        let plain = crate::TextTree::new();
        let rooted = crate::TextTree::new()
            .with_text_roots(&["system: ", "user: "])
            .unwrap();
        // Each text's first word after the role is a random one of 52
        // letters (lower and upper case), then a random number.
        let texts: Vec<String> = (0..1000u64)
            .map(|i| {
                let n = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
                let letter =
                    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[(n % 52) as usize];
                format!(
                    "user: {}{n} tell me about item {i}\nassistant: ",
                    letter as char
                )
            })
            .collect();
        for tree in [&plain, &rooted] {
            let w = tree.intern("w");
            for text in &texts {
                tree.insert(text, w);
            }
        }
        let shards_used = |tree: &crate::TextTree| {
            tree.shards
                .iter()
                .filter(|s| s.0.read().sizes().any(|size| size > 0))
                .count()
        };
        assert_eq!(shards_used(&plain), 1);
        // The rests in the shards of `user: ` that the 52 letters map to,
        // and the root in the shard of `u`.
        let user = rooted.roots.iter().nth(1).unwrap();
        let spread: std::collections::HashSet<u32> = texts
            .iter()
            .map(|t| user.shard_for(t[6..].chars().next().unwrap() as u32))
            .collect();
        assert!(spread.len() >= ROOTED_SHARDS / 4, "{} shards", spread.len());
        assert_eq!(shards_used(&rooted), spread.len() + 1);
        let w = (
            plain.tenant_id("w").unwrap(),
            rooted.tenant_id("w").unwrap(),
        );
        assert_eq!(plain.tenant_size(w.0), rooted.tenant_size(w.1));
        for text in &texts {
            let probe = format!("{}and more", &text[..text.len() - 4]);
            let (a, b) = (plain.prefix_match(&probe), rooted.prefix_match(&probe));
            assert_eq!((a.matched, a.input), (b.matched, b.input), "{probe:?}");
        }
        rooted.validate().unwrap();
    }

    #[test]
    fn bad_roots_are_refused_and_good_ones_get_disjoint_shards() {
        assert_eq!(roots(&["a", ""]).unwrap_err(), RootsError::Empty(1));
        assert_eq!(
            roots(&["user", "user: "]).unwrap_err(),
            RootsError::Nested {
                shorter: 0,
                longer: 1
            }
        );
        assert_eq!(
            roots(&["x"; MAX_ROOTS + 1]).unwrap_err(),
            RootsError::TooMany(MAX_ROOTS + 1)
        );
        let five = roots(&["system: ", "developer: ", "user: ", "assistant: ", "tool: "]).unwrap();
        let mut seen = std::collections::HashSet::new();
        for root in five.iter() {
            assert_eq!(root.shards.len(), ROOTED_SHARDS / 5);
            assert!(root.shards.start as usize >= FIRST_SHARDS);
            assert!((root.shards.end as usize) <= FIRST_SHARDS + ROOTED_SHARDS);
            for key in 0..1000 {
                assert!(root.shards.contains(&root.shard_for(key)));
            }
            assert!(root.shards.clone().all(|s| seen.insert(s)), "disjoint");
            assert_eq!(
                five.owning(root.shards.start).map(|r| r.head),
                Some(root.head)
            );
        }
        assert!(five.owning(0).is_none());
    }
}
