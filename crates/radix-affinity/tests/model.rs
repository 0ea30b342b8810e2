//! proptest: random operation sequences against the naive reference model
//! (`radix_affinity::fuzzing::Model`), on ASCII and on multi-byte text.

use proptest::prelude::*;
use radix_affinity::fuzzing::{
    Op, check_budget_ops, check_budget_ops_rooted, check_ops, check_ops_rooted,
};
use radix_affinity::{Clock, TenantMatches, TextTree, TokenTree};

/// Texts over a small alphabet so that prefixes are shared often; built from a
/// few stems so that long shared prefixes (system prompts) occur too.
fn text(alphabet: &'static [char]) -> impl Strategy<Value = String> {
    let stems = prop::sample::select(vec!["", "ab", "abcab", "ba", "ccc"]);
    (
        stems,
        prop::collection::vec(prop::sample::select(alphabet), 0..8),
    )
        .prop_map(|(stem, tail)| {
            let mut s: String = stem
                .chars()
                .map(|c| alphabet[(c as usize - 'a' as usize) % alphabet.len()])
                .collect();
            s.extend(tail);
            s
        })
}

fn op(alphabet: &'static [char]) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (text(alphabet), 0u8..4, any::<bool>()).prop_map(|(text, tenant, via_symbols)| Op::Insert { text, tenant, via_symbols }),
        3 => (text(alphabet), any::<bool>()).prop_map(|(text, via_symbols)| Op::Match { text, via_symbols }),
        2 => (text(alphabet), 0u8..4).prop_map(|(text, tenant)| Op::MatchTenant { text, tenant }),
        1 => (0usize..20).prop_map(Op::EvictTenants),
        1 => (0usize..40).prop_map(Op::EvictTotal),
        1 => (0u8..4).prop_map(Op::Remove),
    ]
}

const ASCII: &[char] = &['a', 'b', 'c', 'd'];
/// Pairs that share every UTF-8 byte but the last, plus 2-byte and ASCII.
const MULTIBYTE: &[char] = &['a', 'é', '一', '丁', '😀', '😁'];

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn ascii_text_matches_model(ops in prop::collection::vec(op(ASCII), 1..60)) {
        check_ops(&ops);
    }

    #[test]
    fn multibyte_text_matches_model(ops in prop::collection::vec(op(MULTIBYTE), 1..60)) {
        check_ops(&ops);
    }

    /// Every tenant's match in one walk (`prefix_match_tenants*`, checked at
    /// each `MatchTenant` step by `check_ops`) equals one model walk per
    /// tenant, through inserts that split shared prefixes, evictions and
    /// removals: sequences weighted towards those lookups.
    #[test]
    fn every_tenants_match_equals_a_walk_per_tenant(
        ops in prop::collection::vec(prop_oneof![
            3 => op(MULTIBYTE),
            2 => (text(MULTIBYTE), 0u8..4).prop_map(|(text, tenant)| Op::MatchTenant { text, tenant }),
        ], 1..80)
    ) {
        check_ops(&ops);
    }

    /// A byte budget and a per-tenant limit enforced by every insert: the
    /// trees stay within both after every operation, evict exactly the
    /// model's least recently used leaves, and match like the model.
    #[test]
    fn limits_hold_after_every_operation(
        ops in prop::collection::vec(op(MULTIBYTE), 1..60),
        limit in 0u64..6000,
        tenant_limit in prop::option::of(0usize..40),
    ) {
        check_budget_ops(&ops, limit, tenant_limit);
    }
}

/// Roots for the ASCII alphabet: the stems "ab" and "abcab" begin with the
/// first, "ccc" with the second.
const ASCII_ROOTS: &[&str] = &["ab", "c"];
/// Roots for the multi-byte alphabet: the stems as the strategy maps them
/// ("aé", "aé一aé", "一一一") begin with them.
const MULTIBYTE_ROOTS: &[&str] = &["aé", "一"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Trees told roots (chat roles, in the router) answer as the model of
    /// such a tree, and as a model without roots until the first explicit
    /// eviction (`check_ops_rooted`).
    #[test]
    fn rooted_ascii_text_matches_model(ops in prop::collection::vec(op(ASCII), 1..60)) {
        check_ops_rooted(&ops, ASCII_ROOTS);
    }

    #[test]
    fn rooted_multibyte_text_matches_model(ops in prop::collection::vec(op(MULTIBYTE), 1..60)) {
        check_ops_rooted(&ops, MULTIBYTE_ROOTS);
    }

    /// With roots, the limits still evict exactly the model's least
    /// recently used leaves (a hold on a root is a leaf only once the tenant
    /// holds nothing under it) and hold after every operation.
    #[test]
    fn rooted_limits_hold_after_every_operation(
        ops in prop::collection::vec(op(MULTIBYTE), 1..60),
        limit in 0u64..6000,
        tenant_limit in prop::option::of(0usize..40),
    ) {
        check_budget_ops_rooted(&ops, limit, tenant_limit, MULTIBYTE_ROOTS);
    }
}

/// A hand-written sequence with known answers, so the model itself is checked.
#[test]
fn known_answers() {
    let tree = radix_affinity::TextTree::with_clock(radix_affinity::Clock::Logical);
    let a = tree.intern("a");
    let b = tree.intern("b");
    tree.insert("hello world", a);
    tree.insert("hello there", b);
    assert_eq!(tree.tenant_size(a), 11);
    assert_eq!(tree.tenant_size(b), 11);
    assert_eq!(tree.total_size(), 22);
    // "hello " is shared; the deepest node of "hello" is that shared node, most
    // recently used by b.
    let m = tree.prefix_match("hello");
    assert_eq!((m.tenant, m.matched, m.input), (Some(b), 5, 5));
    let m = tree.prefix_match("hello wo!");
    assert_eq!((m.tenant, m.matched, m.input), (Some(a), 8, 9));
    assert_eq!(tree.prefix_match_tenant("hello world!", b), 6);
    // The lookup above made a the most recent user of "hello ".
    assert_eq!(tree.prefix_match("hello").tenant, Some(a));
    // b's leaf "there" is its LRU entry: evicting b down to 6 drops it.
    tree.evict_tenant_by_size(6);
    assert_eq!(tree.tenant_size(b), 6);
    assert_eq!(
        tree.tenant_size(a),
        6,
        "a held 11 > 6, so its leaf goes too"
    );
    tree.remove_tenant(a);
    assert_eq!(tree.prefix_match("hello").tenant, Some(b));
    assert_eq!(tree.tenants().len(), 1);
    tree.validate().unwrap();
}

#[test]
fn multibyte_never_splits_a_scalar() {
    let tree = radix_affinity::TextTree::new();
    let a = tree.intern("a");
    // U+4E00 and U+4E01 share their first two UTF-8 bytes.
    tree.insert("x一y", a);
    let m = tree.prefix_match("x丁y");
    assert_eq!((m.matched, m.input), (1, 3));
    tree.insert("x丁z", a);
    assert_eq!(tree.tenant_size(a), 5, "x + 一y + 丁z");
    assert_eq!(tree.prefix_match("x丁z").matched, 3);
    assert_eq!(tree.prefix_match("😀").matched, 0);
    tree.validate().unwrap();
}

#[test]
fn trees_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<radix_affinity::TextTree>();
    assert_send_sync::<radix_affinity::TokenTree>();
    // Ids from another tree (or never interned) are ignored, not a panic.
    let tree = radix_affinity::TextTree::new();
    let other = radix_affinity::TextTree::new();
    for i in 0..3 {
        other.intern(&format!("w{i}"));
    }
    let foreign = other.intern("w2");
    tree.insert("abc", foreign);
    assert_eq!(tree.total_size(), 0);
    assert_eq!(tree.prefix_match_tenant("abc", foreign), 0);
    tree.remove_tenant(foreign);
    assert_eq!(tree.tenant_name(foreign), None);
    assert_eq!(tree.prefix_match("").input, 0);
}

/// An insert that crosses a limit evicts on to a 64th below it, oldest
/// first, so the next inserts find room without evicting.
#[test]
fn crossing_a_limit_evicts_down_to_the_low_water_mark() {
    let tree = TextTree::with_clock(Clock::Logical);
    let w = tree.intern("http://worker-0:8000");
    // Every hold sampled: exact LRU order.
    tree.set_eviction_samples(1 << 16);
    assert_eq!(radix_affinity::LOW_WATER_DIVISOR, 64);
    // "z" and then 99 chars of which the first differs: one shared node of
    // 1 char and one leaf of 99 per text.
    let texts: Vec<String> = (0..66)
        .map(|i| {
            let own = char::from_u32(0x4E00 + i).unwrap();
            ['z', own]
                .into_iter()
                .chain(std::iter::repeat_n('a', 98))
                .collect()
        })
        .collect();
    let limit = 1 + 64 * 99;
    tree.set_tenant_limit(Some(limit));
    for text in &texts[..64] {
        tree.insert(text, w);
    }
    assert_eq!(tree.tenant_size(w), limit, "at the limit, nothing evicted");
    assert_eq!(tree.evicted(), 0);

    tree.insert(&texts[64], w);
    // Over by one leaf: evicted down to limit - limit / 64 = limit - 99,
    // two leaves.
    assert_eq!(tree.tenant_size(w), limit - 99);
    assert_eq!(tree.evicted(), 2);
    assert_eq!(tree.prefix_match_tenant(&texts[0], w), 1, "oldest evicted");
    assert_eq!(
        tree.prefix_match_tenant(&texts[1], w),
        1,
        "second oldest evicted"
    );
    assert_eq!(tree.prefix_match_tenant(&texts[2], w), 100, "third kept");
    assert_eq!(
        tree.prefix_match_tenant(&texts[64], w),
        100,
        "the new text kept"
    );

    // The next insert fits without evicting anything.
    tree.insert(&texts[65], w);
    assert_eq!(tree.tenant_size(w), limit);
    assert_eq!(tree.evicted(), 2);
    tree.validate().unwrap();
}

/// A template header every tenant holds, then each tenant's own turns: each
/// is credited with its own match, not the best holder's.
#[test]
fn every_tenant_gets_its_own_match_of_a_shared_header() {
    let tree = TextTree::with_clock(Clock::Logical);
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|n| tree.intern(n));
    tree.insert("sys:hello there", a);
    tree.insert("sys:help me", b);
    tree.insert("sys:", c);
    let mut found = TenantMatches::new();
    tree.prefix_match_tenants("sys:hello world", &mut found);
    assert_eq!(
        [a, b, c, d].map(|t| found.get(t)),
        [10, 7, 4, 0],
        "a holds `sys:hello `, b `sys:hel`, c the header, d nothing"
    );
    assert_eq!(found.len(), 3);
    assert_eq!(found.input(), 15);
    assert_eq!(found.longest(), 10);
    // The best-match lookup names only a: the others' matches are what it
    // cannot say.
    assert_eq!(tree.prefix_match("sys:hello world").tenant, Some(a));

    // Reused for an input nobody holds: the earlier matches are gone.
    tree.prefix_match_tenants("zzz", &mut found);
    assert!(found.is_empty());
    assert_eq!([a, b, c].map(|t| found.get(t)), [0, 0, 0]);
    assert_eq!(found.input(), 3);
    tree.prefix_match_tenants("", &mut found);
    assert_eq!((found.len(), found.input()), (0, 0));
}

/// Token trees, a tenant interned after the buffer was sized, and a
/// removed tenant: all answered as one walk per tenant would.
#[test]
fn every_tenants_token_match_follows_membership() {
    let tree = TokenTree::with_clock(Clock::Logical);
    let a = tree.intern("a");
    tree.insert_symbols(&[1, 2, 3, 4], a);
    let mut found = TenantMatches::new();
    tree.prefix_match_tenants_symbols(&[1, 2, 3, 9], &mut found);
    assert_eq!(found.iter().collect::<Vec<_>>(), vec![(a, 3)]);
    let late = tree.intern("late");
    tree.insert_symbols(&[1, 2], late);
    tree.prefix_match_tenants_symbols(&[1, 2, 3, 9], &mut found);
    assert_eq!((found.get(a), found.get(late)), (3, 2));
    tree.remove_tenant(a);
    tree.prefix_match_tenants_symbols(&[1, 2, 3, 9], &mut found);
    assert_eq!((found.get(a), found.get(late)), (0, 2));
    for t in [a, late] {
        assert_eq!(
            found.get(t),
            tree.prefix_match_tenant_symbols(&[1, 2, 3, 9], t)
        );
    }
}
