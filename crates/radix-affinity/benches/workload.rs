//! Criterion benches over the normative workload (`shared/workloads/radix-affinity.md`):
//! lookups, inserts and the route loop against a warm tree, for text and for
//! the synthetic token ids. The full measurement protocol (on-CPU time,
//! medians of five, eviction, removal, memory) is the `workload` example.

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use radix_affinity::workload::{self, Variant, Workload};
use radix_affinity::{TenantId, TextTree, TokenTree};

const ITEMS: usize = 4_000;

fn warm_text(w: &Workload) -> (TextTree, Vec<TenantId>) {
    let tree = TextTree::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tree.intern(&workload::tenant_name(i)))
        .collect();
    for r in &w.warm {
        tree.insert(&r.text, ids[workload::owner(r.sp)]);
    }
    (tree, ids)
}

fn bench_variant(c: &mut Criterion, variant: Variant) {
    let w = Workload::new(variant);
    let lookups = w.lookups(ITEMS);
    let inserts = w.inserts(ITEMS);
    let routes = w.routes(ITEMS);
    let name = variant.name();
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));

    let (tree, ids) = warm_text(&w);
    let mut i = 0;
    group.bench_function("prefix_match", |b| {
        b.iter(|| {
            i = (i + 1) % lookups.len();
            tree.prefix_match(&lookups[i].text)
        })
    });
    group.bench_function("memcmp_limit", |b| {
        let copies: Vec<String> = lookups.iter().map(|l| l.text.clone()).collect();
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % lookups.len();
            std::hint::black_box(lookups[i].text.as_bytes())
                == std::hint::black_box(copies[i].as_bytes())
        })
    });
    drop((tree, ids));

    // Inserts and routes change the tree: each measured batch starts from a
    // fresh warm tree (built outside the timing) and walks the set in order.
    group.bench_function("insert", |b| {
        b.iter_custom(|iters| {
            let (tree, ids) = warm_text(&w);
            let start = Instant::now();
            for k in 0..iters as usize {
                let r = &inserts[k % inserts.len()];
                tree.insert(&r.text, ids[workload::owner(r.sp)]);
            }
            start.elapsed()
        })
    });
    group.bench_function("route", |b| {
        b.iter_custom(|iters| {
            let (tree, ids) = warm_text(&w);
            let mut rr = 0;
            let start = Instant::now();
            for k in 0..iters as usize {
                let text = &routes[k % routes.len()].text;
                let m = tree.prefix_match(text);
                let chosen = match m.tenant {
                    Some(t) if 2 * m.matched > m.input => t,
                    _ => {
                        rr += 1;
                        ids[rr % ids.len()]
                    }
                };
                tree.insert(text, chosen);
            }
            start.elapsed()
        })
    });

    // The same lookups on a token tree (4-char synthetic tokens).
    let tokens_tree = TokenTree::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tokens_tree.intern(&workload::tenant_name(i)))
        .collect();
    let mut buf = Vec::new();
    for r in &w.warm {
        workload::tokenize(&r.text, &mut buf);
        tokens_tree.insert_symbols(&buf, ids[workload::owner(r.sp)]);
    }
    let token_lookups: Vec<Vec<u32>> = lookups
        .iter()
        .map(|l| {
            let mut t = Vec::new();
            workload::tokenize(&l.text, &mut t);
            t
        })
        .collect();
    let mut i = 0;
    group.bench_function("token_prefix_match", |b| {
        b.iter(|| {
            i = (i + 1) % token_lookups.len();
            tokens_tree.prefix_match_symbols(&token_lookups[i])
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    bench_variant(c, Variant::Ascii);
    bench_variant(c, Variant::Unicode);
    bench_variant(c, Variant::Chat);
}

criterion_group!(radix, benches);
criterion_main!(radix);
