//! Fuzzing and model-testing entry points.
//!
//! [`Model`] is a deliberately naive single-threaded reference tree (char
//! labels, ordered maps, recounted sizes, linear scans for every eviction
//! step) with the semantics the real tree documents. [`check_ops`] runs an
//! operation sequence against a [`TextTree`], a [`TokenTree`] and the model
//! with [`Clock::Logical`] (so "least/most recently used" is exact) and panics
//! on the first disagreement. [`radix_ops`] decodes arbitrary bytes into such a
//! sequence; the cargo-fuzz target `radix_ops` and the crate's tests call it.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::{Clock, MemoryBudget, RadixTree, Symbol, TenantId, TenantMatches, TextTree, TokenTree};

/// One operation of a model test. Tenants are small indices into a fixed set
/// of names interned up front.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `insert(text, tenant)`; `via_symbols` uses `insert_symbols(&[char])`.
    Insert {
        /// Text to insert.
        text: String,
        /// Tenant index.
        tenant: u8,
        /// Use the `&[char]` entry point instead of `&str`.
        via_symbols: bool,
    },
    /// `prefix_match(text)`; `via_symbols` uses `prefix_match_symbols`.
    Match {
        /// Text to look up.
        text: String,
        /// Use the `&[char]` entry point instead of `&str`.
        via_symbols: bool,
    },
    /// `prefix_match_tenant(text, tenant)`, and every tenant's match at
    /// once (`prefix_match_tenants`, `prefix_match_tenants_symbols`).
    MatchTenant {
        /// Text to look up.
        text: String,
        /// Tenant index.
        tenant: u8,
    },
    /// `evict_tenant_by_size(max)`.
    EvictTenants(usize),
    /// `evict_to_total(budget)`.
    EvictTotal(usize),
    /// `remove_tenant(tenant)`.
    Remove(u8),
}

/// Number of tenants the harness interns.
pub const TENANTS: u8 = 4;

#[derive(Debug, Clone)]
struct MNode {
    label: Vec<char>,
    children: BTreeMap<char, usize>,
    /// tenant -> last use
    owners: BTreeMap<u8, u64>,
    parent: usize,
    alive: bool,
}

/// Naive reference tree with the documented semantics.
#[derive(Debug, Clone)]
pub struct Model {
    nodes: Vec<MNode>,
    clock: u64,
    /// Roots: a text that begins with one and goes on past it has a node
    /// boundary at the root's end, as in a tree told these roots.
    roots: Vec<Vec<char>>,
}

impl Default for Model {
    fn default() -> Self {
        Self::new()
    }
}

impl Model {
    /// An empty model.
    pub fn new() -> Self {
        Self {
            nodes: vec![MNode {
                label: Vec::new(),
                children: BTreeMap::new(),
                owners: BTreeMap::new(),
                parent: 0,
                alive: true,
            }],
            clock: 0,
            roots: Vec::new(),
        }
    }

    /// An empty model of a tree told `roots` (see
    /// [`RadixTree::with_roots`]): its texts under a root have a node
    /// boundary at the root's end, which changes eviction's granularity and
    /// nothing else.
    pub fn with_roots(roots: &[&str]) -> Self {
        Self {
            roots: roots.iter().map(|r| r.chars().collect()).collect(),
            ..Self::new()
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Inserts `text` for `tenant`.
    pub fn insert(&mut self, text: &[char], tenant: u8) {
        let now = self.tick();
        let root = self
            .roots
            .iter()
            .find(|r| text.len() > r.len() && text.starts_with(r))
            .cloned();
        if let Some(root) = root {
            self.insert_at(&root, tenant, now);
        }
        self.insert_at(text, tenant, now);
    }

    fn insert_at(&mut self, text: &[char], tenant: u8, now: u64) {
        let mut node = 0;
        let mut pos = 0;
        while pos < text.len() {
            let next = match self.nodes[node].children.get(&text[pos]).copied() {
                None => {
                    let leaf = self.nodes.len();
                    self.nodes.push(MNode {
                        label: text[pos..].to_vec(),
                        children: BTreeMap::new(),
                        owners: BTreeMap::new(),
                        parent: node,
                        alive: true,
                    });
                    self.nodes[node].children.insert(text[pos], leaf);
                    leaf
                }
                Some(child) => {
                    let label = &self.nodes[child].label;
                    let common = label
                        .iter()
                        .zip(&text[pos..])
                        .take_while(|(a, b)| a == b)
                        .count();
                    if common < label.len() {
                        // Split: a new upper node takes the first `common` chars.
                        let upper = self.nodes.len();
                        let lower_label = label[common..].to_vec();
                        let upper_label = label[..common].to_vec();
                        let owners = self.nodes[child].owners.clone();
                        self.nodes.push(MNode {
                            label: upper_label,
                            children: BTreeMap::from([(lower_label[0], child)]),
                            owners,
                            parent: node,
                            alive: true,
                        });
                        self.nodes[child].label = lower_label;
                        self.nodes[child].parent = upper;
                        self.nodes[node].children.insert(text[pos], upper);
                        upper
                    } else {
                        child
                    }
                }
            };
            let stamp = self.nodes[next].owners.entry(tenant).or_insert(now);
            *stamp = (*stamp).max(now);
            pos += self.nodes[next].label.len();
            node = next;
        }
    }

    /// Walks `text`; returns the deepest node (0 if none) and matched chars,
    /// following only nodes that `follow` accepts.
    fn walk(&self, text: &[char], follow: impl Fn(&MNode) -> bool) -> (usize, usize) {
        let mut node = 0;
        let mut pos = 0;
        while pos < text.len() {
            let Some(&child) = self.nodes[node].children.get(&text[pos]) else {
                break;
            };
            if !follow(&self.nodes[child]) {
                break;
            }
            let label = &self.nodes[child].label;
            let common = label
                .iter()
                .zip(&text[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            node = child;
            pos += common;
            if common < label.len() {
                break;
            }
        }
        (node, pos)
    }

    /// Longest-prefix lookup: (most recent owner of the deepest node, matched).
    pub fn prefix_match(&mut self, text: &[char]) -> (Option<u8>, usize) {
        let now = self.tick();
        let (node, matched) = self.walk(text, |_| true);
        if node == 0 {
            return (None, 0);
        }
        let tenant = self.nodes[node]
            .owners
            .iter()
            .max_by_key(|&(_, &stamp)| stamp)
            .map(|(&t, _)| t);
        if let Some(t) = tenant {
            let mut n = node;
            while n != 0 {
                if let Some(stamp) = self.nodes[n].owners.get_mut(&t) {
                    *stamp = (*stamp).max(now);
                }
                n = self.nodes[n].parent;
            }
        }
        (tenant, matched)
    }

    /// Chars of `text` that `tenant` holds.
    pub fn prefix_match_tenant(&self, text: &[char], tenant: u8) -> usize {
        self.walk(text, |n| n.owners.contains_key(&tenant)).1
    }

    /// Chars of `text` that each tenant holds, by tenant index: one
    /// [`prefix_match_tenant`](Self::prefix_match_tenant) per tenant.
    pub fn prefix_match_tenants(&self, text: &[char]) -> Vec<usize> {
        (0..TENANTS)
            .map(|t| self.prefix_match_tenant(text, t))
            .collect()
    }

    /// Recounted size of `tenant`.
    pub fn size(&self, tenant: u8) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.alive && n.owners.contains_key(&tenant))
            .map(|n| n.label.len())
            .sum()
    }

    /// Sum of all tenant sizes.
    pub fn total(&self) -> usize {
        (0..TENANTS).map(|t| self.size(t)).sum()
    }

    /// The least recently used (stamp, node, tenant) leaf hold, optionally of
    /// one tenant.
    fn oldest_leaf(&self, only: Option<u8>) -> Option<(u64, usize, u8)> {
        let mut best = None;
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.alive || i == 0 {
                continue;
            }
            for (&t, &stamp) in &n.owners {
                if only.is_some_and(|o| o != t) {
                    continue;
                }
                let is_leaf = n
                    .children
                    .values()
                    .all(|&c| !self.nodes[c].owners.contains_key(&t));
                if is_leaf && best.is_none_or(|(s, _, _)| stamp < s) {
                    best = Some((stamp, i, t));
                }
            }
        }
        best
    }

    fn drop_hold(&mut self, node: usize, tenant: u8) {
        self.nodes[node].owners.remove(&tenant);
        if self.nodes[node].owners.is_empty() {
            self.nodes[node].alive = false;
            let first = self.nodes[node].label[0];
            let parent = self.nodes[node].parent;
            self.nodes[parent].children.remove(&first);
        }
    }

    /// Evicts each tenant's LRU leaves until it holds at most `max`.
    pub fn evict_tenants(&mut self, max: usize) {
        for t in 0..TENANTS {
            while self.size(t) > max {
                let Some((_, node, _)) = self.oldest_leaf(Some(t)) else {
                    break;
                };
                self.drop_hold(node, t);
            }
        }
    }

    /// Evicts LRU leaf holds of any tenant until the total is at most `budget`.
    pub fn evict_total(&mut self, budget: usize) {
        while self.total() > budget {
            let Some((_, node, t)) = self.oldest_leaf(None) else {
                break;
            };
            self.drop_hold(node, t);
        }
    }

    /// Drops `tenant`'s hold on the node that ends at `path`, after checking
    /// that it is a least recently used leaf hold: of `tenant` when `only`,
    /// else of anyone. Panics (with `what`) if it is not.
    pub fn evict_checked(&mut self, tenant: u8, path: &[char], only: bool, what: &str) {
        let (node, depth) = self.walk(path, |_| true);
        let ends_here = depth == path.len() && node != 0 && self.depth_of(node) == path.len();
        assert!(
            ends_here,
            "{what}: evicted {path:?}, which the model has no node for"
        );
        let Some(&stamp) = self.nodes[node].owners.get(&tenant) else {
            panic!("{what}: evicted {path:?} of tenant {tenant}, who does not hold it");
        };
        let oldest = self.oldest_leaf(only.then_some(tenant));
        assert_eq!(
            oldest.map(|(s, _, _)| s),
            Some(stamp),
            "{what}: evicted {path:?} of tenant {tenant} (stamp {stamp}), not the least recently used leaf"
        );
        let is_leaf = self.nodes[node]
            .children
            .values()
            .all(|&c| !self.nodes[c].owners.contains_key(&tenant));
        assert!(
            is_leaf,
            "{what}: evicted {path:?}, not a leaf of tenant {tenant}"
        );
        self.drop_hold(node, tenant);
    }

    /// Chars from the root to the end of `node`.
    fn depth_of(&self, mut node: usize) -> usize {
        let mut depth = 0;
        while node != 0 {
            depth += self.nodes[node].label.len();
            node = self.nodes[node].parent;
        }
        depth
    }

    /// Whether any tenant holds anything.
    pub fn is_empty(&self) -> bool {
        self.oldest_leaf(None).is_none()
    }

    /// Forgets `tenant`.
    pub fn remove(&mut self, tenant: u8) {
        // Leaves first, so parents are emptied after their children.
        while let Some((_, node, _)) = self.oldest_leaf(Some(tenant)) {
            self.drop_hold(node, tenant);
        }
    }
}

/// Runs `ops` against a [`TextTree`], a [`TokenTree`] (chars as token ids) and
/// the [`Model`], panicking on the first disagreement or broken invariant.
pub fn check_ops(ops: &[Op]) {
    check_ops_rooted(ops, &[]);
}

/// [`check_ops`] with trees told `roots` and a model of them; besides, until
/// the first explicit eviction, every lookup and size must equal those of a
/// model without roots (roots change where texts live, not what the tree
/// answers; evictions differ only in granularity, since a root ends a node).
pub fn check_ops_rooted(ops: &[Op], roots: &[&str]) {
    let root_chars: Vec<Vec<char>> = roots.iter().map(|r| r.chars().collect()).collect();
    let root_tokens: Vec<Vec<u32>> = root_chars.iter().map(|r| to_tokens(r)).collect();
    let text = TextTree::with_clock(Clock::Logical)
        .with_text_roots(roots)
        .expect("valid roots");
    let tokens = TokenTree::with_clock(Clock::Logical)
        .with_roots(&root_tokens)
        .expect("valid roots");
    let mut model = Model::with_roots(roots);
    let mut plain = Some(Model::new());
    let names: Vec<String> = (0..TENANTS)
        .map(|i| format!("http://worker-{i}:8000"))
        .collect();
    let text_ids: Vec<TenantId> = names.iter().map(|n| text.intern(n)).collect();
    let token_ids: Vec<TenantId> = names.iter().map(|n| tokens.intern(n)).collect();
    let tenant_index = |id: TenantId| id.index() as u8;
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Insert {
                text: s,
                tenant,
                via_symbols,
            } => {
                let t = tenant % TENANTS;
                let chars: Vec<char> = s.chars().collect();
                if *via_symbols {
                    text.insert_symbols(&chars, text_ids[t as usize]);
                } else {
                    text.insert(s, text_ids[t as usize]);
                }
                tokens.insert_symbols(&to_tokens(&chars), token_ids[t as usize]);
                model.insert(&chars, t);
                if let Some(plain) = &mut plain {
                    plain.insert(&chars, t);
                }
            }
            Op::Match {
                text: s,
                via_symbols,
            } => {
                let chars: Vec<char> = s.chars().collect();
                let got = if *via_symbols {
                    text.prefix_match_symbols(&chars)
                } else {
                    text.prefix_match(s)
                };
                let got_tokens = tokens.prefix_match_symbols(&to_tokens(&chars));
                let (want_tenant, want_matched) = model.prefix_match(&chars);
                if let Some(plain) = &mut plain {
                    assert_eq!(
                        plain.prefix_match(&chars),
                        (want_tenant, want_matched),
                        "step {step}: the model with roots and the one without disagree on {s:?}"
                    );
                }
                let got_pair = (got.tenant.map(tenant_index), got.matched, got.input);
                let want = (want_tenant, want_matched, chars.len());
                assert_eq!(got_pair, want, "step {step}: text tree prefix_match({s:?})");
                let got_tokens = (
                    got_tokens.tenant.map(tenant_index),
                    got_tokens.matched,
                    got_tokens.input,
                );
                assert_eq!(
                    got_tokens, want,
                    "step {step}: token tree prefix_match({s:?})"
                );
            }
            Op::MatchTenant { text: s, tenant } => {
                let t = tenant % TENANTS;
                let chars: Vec<char> = s.chars().collect();
                let want = model.prefix_match_tenant(&chars, t);
                assert_eq!(
                    text.prefix_match_tenant(s, text_ids[t as usize]),
                    want,
                    "step {step}: text prefix_match_tenant({s:?}, {t})"
                );
                assert_eq!(
                    text.prefix_match_tenant_symbols(&chars, text_ids[t as usize]),
                    want,
                    "step {step}: text prefix_match_tenant_symbols({s:?}, {t})"
                );
                assert_eq!(
                    tokens.prefix_match_tenant_symbols(&to_tokens(&chars), token_ids[t as usize]),
                    want,
                    "step {step}: token prefix_match_tenant({s:?}, {t})"
                );
                let want_all = model.prefix_match_tenants(&chars);
                let mut found = TenantMatches::new();
                text.prefix_match_tenants(s, &mut found);
                assert_eq!(
                    every_tenant(&found, &text_ids),
                    (want_all.clone(), chars.len()),
                    "step {step}: text prefix_match_tenants({s:?})"
                );
                text.prefix_match_tenants_symbols(&chars, &mut found);
                assert_eq!(
                    every_tenant(&found, &text_ids),
                    (want_all.clone(), chars.len()),
                    "step {step}: text prefix_match_tenants_symbols({s:?})"
                );
                // Reused buffer: the text lookups' matches must not linger.
                tokens.prefix_match_tenants_symbols(&to_tokens(&chars), &mut found);
                assert_eq!(
                    every_tenant(&found, &token_ids),
                    (want_all, chars.len()),
                    "step {step}: token prefix_match_tenants_symbols({s:?})"
                );
            }
            Op::EvictTenants(max) => {
                text.evict_tenant_by_size(*max);
                tokens.evict_tenant_by_size(*max);
                model.evict_tenants(*max);
                plain = None;
            }
            Op::EvictTotal(budget) => {
                text.evict_to_total(*budget);
                tokens.evict_to_total(*budget);
                model.evict_total(*budget);
                plain = None;
            }
            Op::Remove(tenant) => {
                let t = tenant % TENANTS;
                text.remove_tenant(text_ids[t as usize]);
                tokens.remove_tenant(token_ids[t as usize]);
                model.remove(t);
                if let Some(plain) = &mut plain {
                    plain.remove(t);
                }
            }
        }
        let want: Vec<usize> = (0..TENANTS).map(|t| model.size(t)).collect();
        if let Some(plain) = &plain {
            let unrooted: Vec<usize> = (0..TENANTS).map(|t| plain.size(t)).collect();
            assert_eq!(unrooted, want, "step {step}: sizes with and without roots");
        }
        let sizes = |sizes: Vec<(TenantId, usize)>| -> Vec<usize> {
            sizes.into_iter().map(|(_, s)| s).collect()
        };
        assert_eq!(
            sizes(text.tenant_sizes()),
            want,
            "step {step} {op:?}: text sizes"
        );
        assert_eq!(
            sizes(tokens.tenant_sizes()),
            want,
            "step {step} {op:?}: token sizes"
        );
        let t = step % TENANTS as usize;
        assert_eq!(
            text.tenant_size(text_ids[t]),
            want[t],
            "step {step}: tenant_size"
        );
        assert_eq!(text.total_size(), model.total(), "step {step}: total size");
        if let Err(e) = text.validate() {
            panic!("step {step} {op:?}: text tree: {e}");
        }
        if let Err(e) = tokens.validate() {
            panic!("step {step} {op:?}: token tree: {e}");
        }
    }
    let listed: Vec<u8> = text
        .tenants()
        .iter()
        .map(|(id, _)| tenant_index(*id))
        .collect();
    let want: Vec<u8> = (0..TENANTS).filter(|&t| model.size(t) > 0).collect();
    assert_eq!(listed, want, "tenants()");
}

/// Runs `ops` against a tree of each kind whose bytes count against a budget
/// of `limit` bytes and whose tenants are limited to `tenant_limit` symbols,
/// beside a [`Model`] each. The trees sample every candidate (exact LRU) and
/// record what their limits evict; each recorded eviction must be a least
/// recently used leaf hold of the model, which then drops it too. After every
/// operation the budget's `used` must be within `limit` (or nothing be left
/// to evict), every tenant within `tenant_limit`, prefix matches and sizes
/// equal the model's, and the accounted bytes equal a recount
/// (`validate`).
pub fn check_budget_ops(ops: &[Op], limit: u64, tenant_limit: Option<usize>) {
    check_budget_ops_rooted(ops, limit, tenant_limit, &[]);
}

/// [`check_budget_ops`] with trees told `roots` and a model of them.
pub fn check_budget_ops_rooted(
    ops: &[Op],
    limit: u64,
    tenant_limit: Option<usize>,
    roots: &[&str],
) {
    budgeted::<char>(ops, limit, tenant_limit, roots, |c| c);
    budgeted::<u32>(ops, limit, tenant_limit, roots, |c| c as u32);
}

fn budgeted<S: Symbol>(
    ops: &[Op],
    limit: u64,
    tenant_limit: Option<usize>,
    roots: &[&str],
    symbol: impl Fn(char) -> S,
) {
    let budget = MemoryBudget::new(limit);
    let root_symbols: Vec<Vec<S>> = roots
        .iter()
        .map(|r| r.chars().map(&symbol).collect())
        .collect();
    let tree: RadixTree<S> =
        RadixTree::with_eviction_log(Clock::Logical, Some(Arc::clone(&budget)))
            .with_roots(&root_symbols)
            .expect("valid roots");
    tree.set_tenant_limit(tenant_limit);
    tree.set_eviction_samples(1 << 16);
    tree.sample_every_shard(true);
    let mut model = Model::with_roots(roots);
    let ids: Vec<TenantId> = (0..TENANTS)
        .map(|i| tree.intern(&format!("http://worker-{i}:8000")))
        .collect();
    let kind = std::any::type_name::<S>();
    for (step, op) in ops.iter().enumerate() {
        let what = format!("{kind} step {step} {op:?}");
        let symbols = |s: &str| -> Vec<S> { s.chars().map(&symbol).collect() };
        match op {
            Op::Insert { text, tenant, .. } => {
                let t = tenant % TENANTS;
                tree.insert_symbols(&symbols(text), ids[t as usize]);
                let chars: Vec<char> = text.chars().collect();
                model.insert(&chars, t);
                for record in tree.take_eviction_log() {
                    let path: Vec<char> = record
                        .path
                        .iter()
                        .map(|&u| char::from_u32(u).unwrap_or('\u{fffd}'))
                        .collect();
                    let evicted = record.tenant.index() as u8;
                    model.evict_checked(evicted, &path, record.by_tenant_limit, &what);
                }
            }
            Op::Match { text, .. } => {
                let chars: Vec<char> = text.chars().collect();
                let got = tree.prefix_match_symbols(&symbols(text));
                let (tenant, matched) = model.prefix_match(&chars);
                assert_eq!(
                    (got.tenant.map(|id| id.index() as u8), got.matched),
                    (tenant, matched),
                    "{what}: prefix_match"
                );
            }
            Op::MatchTenant { text, tenant } => {
                let t = tenant % TENANTS;
                let chars: Vec<char> = text.chars().collect();
                assert_eq!(
                    tree.prefix_match_tenant_symbols(&symbols(text), ids[t as usize]),
                    model.prefix_match_tenant(&chars, t),
                    "{what}: prefix_match_tenant"
                );
            }
            Op::EvictTenants(max) => {
                tree.evict_tenant_by_size(*max);
                model.evict_tenants(*max);
            }
            Op::EvictTotal(total) => {
                tree.evict_to_total(*total);
                model.evict_total(*total);
            }
            Op::Remove(tenant) => {
                let t = tenant % TENANTS;
                tree.remove_tenant(ids[t as usize]);
                model.remove(t);
            }
        }
        assert!(
            budget.used() <= limit || model.is_empty(),
            "{what}: {} bytes used over the budget of {limit}",
            budget.used()
        );
        assert_eq!(budget.used(), tree.bytes(), "{what}: one tree, one budget");
        for (t, &id) in ids.iter().enumerate() {
            let size = tree.tenant_size(id);
            assert_eq!(size, model.size(t as u8), "{what}: size of tenant {t}");
            if let Some(max) = tenant_limit {
                assert!(size <= max, "{what}: tenant {t} holds {size} > {max}");
            }
        }
        if let Err(e) = tree.validate() {
            panic!("{what}: {e}");
        }
    }
    drop(tree);
    assert_eq!(budget.used(), 0, "a dropped tree gives its bytes back");
}

/// `found` as one match per harness tenant (by index), and its input
/// length; panics if it lists a tenant twice, lists one with nothing
/// matched, or disagrees between `get` and `iter`.
fn every_tenant(found: &TenantMatches, ids: &[TenantId]) -> (Vec<usize>, usize) {
    let mut listed = vec![0; ids.len()];
    for (id, matched) in found.iter() {
        let t = ids.iter().position(|&i| i == id).expect("a harness tenant");
        assert_eq!(listed[t], 0, "tenant {t} listed twice");
        assert!(matched > 0, "tenant {t} listed with nothing matched");
        assert_eq!(
            found.get(id),
            matched,
            "get and iter disagree on tenant {t}"
        );
        listed[t] = matched;
    }
    let by_get: Vec<usize> = ids.iter().map(|&id| found.get(id)).collect();
    assert_eq!(by_get, listed, "get reports a tenant iter does not list");
    assert_eq!(found.longest(), listed.iter().copied().max().unwrap_or(0));
    (listed, found.input())
}

fn to_tokens(chars: &[char]) -> Vec<u32> {
    chars.iter().map(|&c| c as u32).collect()
}

/// Characters the byte decoder draws from: ASCII, 2-byte, and 3- and 4-byte
/// pairs that share all but their last UTF-8 byte (a matcher that compared
/// bytes without respecting scalar boundaries would split them).
pub const ALPHABET: [char; 8] = ['a', 'b', 'c', 'é', '一', '丁', '😀', '😁'];

/// Decodes arbitrary bytes into operations and runs [`check_ops`]. Never
/// panics unless the tree disagrees with the model (a bug).
pub fn radix_ops(data: &[u8]) {
    let ops = decode_ops(data);
    check_ops(&ops);
    check_ops_rooted(&ops, &FUZZ_ROOTS);
}

/// Roots of the rooted run of [`radix_ops`]: texts over [`ALPHABET`] begin
/// with them often, and two share a first byte with other symbols.
pub const FUZZ_ROOTS: [&str; 3] = ["ab", "é", "😀丁"];

/// The operation sequence [`radix_ops`] runs for `data` (at most 64 ops).
pub fn decode_ops(data: &[u8]) -> Vec<Op> {
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next();
    let mut ops = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    while let Some(code) = next() {
        if ops.len() >= 64 {
            break;
        }
        let arg = next().unwrap_or(0);
        let mut text = || {
            let len = next().unwrap_or(0);
            // High bit: extend an earlier text, so prefixes are shared.
            let mut s = if len & 0x80 != 0 && !texts.is_empty() {
                let base = &texts[(len as usize >> 4) % texts.len()];
                let keep = (len as usize & 0x7) % (base.chars().count() + 1);
                base.chars().take(keep).collect()
            } else {
                String::new()
            };
            for _ in 0..(len & 0x0F) % 9 {
                let c = next().unwrap_or(0);
                s.push(ALPHABET[c as usize % ALPHABET.len()]);
            }
            texts.push(s.clone());
            s
        };
        let op = match code % 10 {
            0..=3 => Op::Insert {
                text: text(),
                tenant: arg % TENANTS,
                via_symbols: arg & 0x80 != 0,
            },
            4 | 5 => Op::Match {
                text: text(),
                via_symbols: arg & 0x80 != 0,
            },
            6 => Op::MatchTenant {
                text: text(),
                tenant: arg % TENANTS,
            },
            7 => Op::EvictTenants(arg as usize % 24),
            8 => Op::EvictTotal(arg as usize % 48),
            _ => Op::Remove(arg % TENANTS),
        };
        ops.push(op);
    }
    ops
}
