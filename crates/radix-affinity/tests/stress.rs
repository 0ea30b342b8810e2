//! Multi-threaded stress: racing inserts, lookups, evictions and removals on
//! shared prefixes, while a checker thread keeps verifying that every shard's
//! counters equal a recount of its nodes. Bounded by iteration counts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use radix_affinity::{TenantId, TextTree};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Few stems and a tiny alphabet so threads constantly split the same edges.
fn text(rng: &mut Rng) -> String {
    const STEMS: [&str; 4] = [
        "system: you are helpful. ",
        "system: you are terse. ",
        "一丁😀",
        "s",
    ];
    const TAIL: [char; 5] = ['a', 'b', 'é', '一', '丁'];
    let mut s = String::from(STEMS[rng.below(4) as usize]);
    for _ in 0..rng.below(12) {
        s.push(TAIL[rng.below(5) as usize]);
    }
    s
}

#[test]
fn racing_writers_keep_counters_exact() {
    let tree = Arc::new(TextTree::new());
    let tenants: Vec<TenantId> = (0..6).map(|i| tree.intern(&format!("w{i}"))).collect();
    let done = Arc::new(AtomicBool::new(false));

    let checker = {
        let tree = Arc::clone(&tree);
        let done = Arc::clone(&done);
        thread::spawn(move || {
            let mut checks = 0u32;
            while !done.load(Ordering::Acquire) || checks == 0 {
                // Each shard is checked under its read lock: counters must
                // equal the recount at every instant, not only at the end.
                tree.validate().unwrap();
                checks += 1;
            }
            checks
        })
    };

    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let tree = Arc::clone(&tree);
            let tenants = tenants.clone();
            thread::spawn(move || {
                let mut rng = Rng(w * 7919 + 1);
                for _ in 0..10_000 {
                    let t = tenants[rng.below(tenants.len() as u64) as usize];
                    match rng.below(100) {
                        0..=49 => tree.insert(&text(&mut rng), t),
                        50..=84 => {
                            let s = text(&mut rng);
                            let m = tree.prefix_match(&s);
                            assert!(m.matched <= m.input);
                            assert_eq!(m.input, s.chars().count());
                            assert_eq!(m.tenant.is_some(), m.matched > 0);
                        }
                        85..=92 => {
                            let s = text(&mut rng);
                            assert!(tree.prefix_match_tenant(&s, t) <= s.chars().count());
                        }
                        93..=95 => tree.evict_tenant_by_size(rng.below(60) as usize),
                        96..=97 => tree.evict_to_total(rng.below(200) as usize),
                        _ => tree.remove_tenant(t),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Release);
    assert!(checker.join().unwrap() > 0);

    tree.validate().unwrap();
    // Four writers on a handful of shared prefixes do contend; the counters
    // see it (the exact number depends on scheduling).
    let waits = tree.lock_waits();
    eprintln!("lock waits: {waits:?}");
    for (id, recounted) in tree.recount() {
        assert_eq!(tree.tenant_size(id), recounted, "tenant {id:?}");
    }
    let total: usize = tree.recount().iter().map(|&(_, s)| s).sum();
    assert_eq!(tree.total_size(), total);

    // Quiescent eviction and removal leave exact, bounded results.
    tree.evict_tenant_by_size(10);
    for &t in &tenants {
        assert!(tree.tenant_size(t) <= 10);
    }
    tree.evict_to_total(15);
    assert!(tree.total_size() <= 15);
    for &t in &tenants {
        tree.remove_tenant(t);
    }
    assert_eq!(tree.total_size(), 0);
    assert!(tree.tenants().is_empty());
    tree.validate().unwrap();
}

/// The same races on a token tree, mixing in the `&[char]` entry points of a
/// text tree fed the same sequences.
#[test]
fn racing_writers_on_token_and_char_slices() {
    let tokens = Arc::new(radix_affinity::TokenTree::new());
    let chars = Arc::new(TextTree::new());
    let ids: Vec<(TenantId, TenantId)> = (0..4)
        .map(|i| {
            let name = format!("w{i}");
            (tokens.intern(&name), chars.intern(&name))
        })
        .collect();
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let (tokens, chars, ids) = (Arc::clone(&tokens), Arc::clone(&chars), ids.clone());
            thread::spawn(move || {
                let mut rng = Rng(w * 104_729 + 7);
                for _ in 0..4_000 {
                    // Shared leading tokens 1, 2 so that edges split constantly.
                    let len = 2 + rng.below(10) as usize;
                    let seq: Vec<u32> = (0..len)
                        .map(|i| {
                            if i < 2 {
                                i as u32 + 1
                            } else {
                                rng.below(4) as u32
                            }
                        })
                        .collect();
                    let text: Vec<char> = seq.iter().map(|&t| char::from(b'a' + t as u8)).collect();
                    let (tt, ct) = ids[rng.below(4) as usize];
                    match rng.below(10) {
                        0..=4 => {
                            tokens.insert_symbols(&seq, tt);
                            chars.insert_symbols(&text, ct);
                        }
                        5..=7 => {
                            let (m, c) = (
                                tokens.prefix_match_symbols(&seq),
                                chars.prefix_match_symbols(&text),
                            );
                            assert!(m.matched <= len && c.matched <= len);
                            assert_eq!((m.input, c.input), (len, len));
                        }
                        8 => {
                            tokens.evict_tenant_by_size(8);
                            chars.evict_to_total(20);
                        }
                        _ => {
                            tokens.remove_tenant(tt);
                            chars.remove_tenant(ct);
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    tokens.validate().unwrap();
    chars.validate().unwrap();
    for ((id, recounted), (cid, crecounted)) in tokens.recount().into_iter().zip(chars.recount()) {
        assert_eq!(tokens.tenant_size(id), recounted);
        assert_eq!(chars.tenant_size(cid), crecounted);
    }
}

/// Lookups racing splits of the labels they walk never miss a text that is
/// held: two writers insert texts with long random tails over a three-letter
/// alphabet (so each new text cuts some earlier text's label at a random
/// depth) and publish how many they inserted; readers keep checking random
/// published texts, which their writer's tenant holds in full for good.
#[test]
fn lookups_never_miss_a_held_text_while_its_labels_split() {
    use std::sync::atomic::AtomicUsize;
    const WRITERS: usize = 2;
    const READERS: usize = 2;
    const TEXTS: usize = 3_000;
    let texts: Vec<Vec<String>> = (0..WRITERS)
        .map(|w| {
            let mut rng = Rng(w as u64 + 101);
            (0..TEXTS)
                .map(|_| {
                    let mut t = String::from(["system: ", "sys一丁: "][rng.below(2) as usize]);
                    for _ in 0..20 + rng.below(40) {
                        t.push(['a', 'b', 'é'][rng.below(3) as usize]);
                    }
                    t
                })
                .collect()
        })
        .collect();
    let texts = Arc::new(texts);
    let tree = Arc::new(TextTree::new());
    let tenants: Vec<TenantId> = (0..WRITERS)
        .map(|i| tree.intern(&format!("w{i}")))
        .collect();
    let published: Arc<Vec<AtomicUsize>> =
        Arc::new((0..WRITERS).map(|_| AtomicUsize::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (tree, texts, published, done, tenants) = (
                Arc::clone(&tree),
                Arc::clone(&texts),
                Arc::clone(&published),
                Arc::clone(&done),
                tenants.clone(),
            );
            thread::spawn(move || {
                let mut rng = Rng(r as u64 + 7);
                let mut checks = 0u64;
                while !done.load(Ordering::Acquire) || checks == 0 {
                    let w = rng.below(WRITERS as u64) as usize;
                    let n = published[w].load(Ordering::Acquire);
                    if n == 0 {
                        continue;
                    }
                    let text = &texts[w][rng.below(n as u64) as usize];
                    let chars = text.chars().count();
                    assert_eq!(tree.prefix_match_tenant(text, tenants[w]), chars, "{text}");
                    let m = tree.prefix_match(text);
                    assert_eq!((m.matched, m.input), (chars, chars), "{text}");
                    checks += 1;
                }
                checks
            })
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (tree, texts, published, t) = (
                Arc::clone(&tree),
                Arc::clone(&texts),
                Arc::clone(&published),
                tenants[w],
            );
            thread::spawn(move || {
                for (i, text) in texts[w].iter().enumerate() {
                    tree.insert(text, t);
                    published[w].store(i + 1, Ordering::Release);
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Release);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    tree.validate().unwrap();
    assert_eq!(tree.recount(), tree.tenant_sizes());
    // Each writer's size is the number of distinct prefixes of its texts.
    for (w, list) in texts.iter().enumerate() {
        let prefixes: std::collections::HashSet<&str> = list
            .iter()
            .flat_map(|t| t.char_indices().map(move |(i, c)| &t[..i + c.len_utf8()]))
            .collect();
        assert_eq!(tree.tenant_size(tenants[w]), prefixes.len());
    }
}

/// Racing writers on a tree told roots (the router's chat roles): inserts
/// under a root write two shards, evictions by a budget must not take a
/// tenant's hold on a root while it holds texts under it, and removal goes
/// over the head shards before the rooted ones. Once the threads are done,
/// every tenant that holds a text under a root holds the root
/// (`validate`), and the counters equal a recount.
#[test]
fn racing_writers_under_roots_keep_every_roots_hold() {
    let budget = radix_affinity::MemoryBudget::new(8 << 10);
    let tree = Arc::new(
        TextTree::with_budget(radix_affinity::Clock::Coarse, Arc::clone(&budget))
            .with_text_roots(&["system: ", "一丁"])
            .unwrap(),
    );
    let tenants: Vec<TenantId> = (0..6).map(|i| tree.intern(&format!("w{i}"))).collect();
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let tree = Arc::clone(&tree);
            let tenants = tenants.clone();
            thread::spawn(move || {
                let mut rng = Rng(w * 104_729 + 3);
                for _ in 0..20_000 {
                    let t = tenants[rng.below(tenants.len() as u64) as usize];
                    match rng.below(100) {
                        0..=59 => tree.insert(&text(&mut rng), t),
                        60..=89 => {
                            let s = text(&mut rng);
                            let m = tree.prefix_match(&s);
                            assert!(m.matched <= m.input);
                            assert_eq!(m.input, s.chars().count());
                            assert_eq!(m.tenant.is_some(), m.matched > 0);
                        }
                        90..=95 => {
                            let s = text(&mut rng);
                            assert!(tree.prefix_match_tenant(&s, t) <= s.chars().count());
                        }
                        96..=97 => tree.evict_tenant_by_size(rng.below(2000) as usize),
                        _ => tree.remove_tenant(t),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    tree.validate().unwrap();
    assert!(tree.evicted() > 0, "the budget made inserts evict");
    // A lower limit, met by sampled eviction alone: holds on roots and the
    // texts under them often share a stamp (a millisecond clock), and the
    // roots' shards sort first, so only the pin keeps them.
    budget.set_limit(budget.used() / 3);
    for _ in 0..64 {
        tree.enforce_limits();
    }
    tree.validate().unwrap();
    assert!(budget.used() <= budget.limit() + (4 << 10));
    for (id, recounted) in tree.recount() {
        assert_eq!(tree.tenant_size(id), recounted, "tenant {id:?}");
    }
    for &t in &tenants {
        tree.remove_tenant(t);
    }
    assert_eq!(tree.total_size(), 0);
    tree.validate().unwrap();
}
