//! The route loop of the workload spec (measurements (c) and (d)) alone, for
//! studying how two threads sharing one tree scale.
//!
//! ```sh
//! cargo run --release -p radix-affinity --example route_threads -- --reps 5
//! ```
//!
//! Per repetition it prints, on fresh warm trees: the 1-thread route loop, the
//! 2-thread loop sharing one tree, the 2-thread loop on two unshared trees
//! (the machine's own ceiling), their ratios to 1 thread, the lock waits per
//! operation of the shared run, and the 1-thread split of an operation into
//! lookup and insert. Options: `--reps N` (default 3), `--unicode`,
//! `--template` (every text behind one fixed prefix, so one shard), `--ops N`
//! (route items, default 100,000).
//!
//! Diagnostic modes instead of the above: `--shards` (how the route texts
//! spread over the shards), `--shared-only` (only the shared 2-thread loop,
//! for profilers), `--disjoint` (one tree, but each thread takes the texts of
//! its own shards, against the same split on two trees: what sharing a shard
//! costs), `--prompt-disjoint` (the same, but each thread takes the texts of
//! the system prompts of its parity: the threads share shards and the top
//! nodes, but no prompt's branch), `--lookups-only` (the loop's lookups
//! alone, shared and unshared: what sharing the read locks costs). Timings
//! are wall and on-CPU time; on a shared machine compare runs taken close
//! together.

use std::time::Instant;

use radix_affinity::workload::{self, Request, Variant, Workload};
use radix_affinity::{TenantId, TextTree};

struct Setup {
    tree: TextTree,
    ids: Vec<TenantId>,
}

fn warm_tree(warm: &[Request]) -> Setup {
    let tree = TextTree::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tree.intern(&workload::tenant_name(i)))
        .collect();
    for r in warm {
        tree.insert(&r.text, ids[workload::owner(r.sp)]);
    }
    Setup { tree, ids }
}

/// The spec's route rule; returns (lookup ns, insert ns) when `split_time`.
fn route(
    setup: &Setup,
    items: impl Iterator<Item = usize>,
    reqs: &[Request],
    mut rr: usize,
    split_time: bool,
) -> (u64, u64) {
    let (mut in_match, mut in_insert) = (0u64, 0u64);
    for i in items {
        let text = &reqs[i].text;
        let t0 = split_time.then(Instant::now);
        let m = setup.tree.prefix_match(text);
        let t1 = split_time.then(Instant::now);
        let chosen = match m.tenant {
            Some(t) if 2 * m.matched > m.input && (t.index() as usize) < setup.ids.len() => t,
            _ => {
                let t = setup.ids[rr % setup.ids.len()];
                rr += 1;
                t
            }
        };
        setup.tree.insert(text, chosen);
        if let (Some(t0), Some(t1)) = (t0, t1) {
            in_match += (t1 - t0).as_nanos() as u64;
            in_insert += t1.elapsed().as_nanos() as u64;
        }
    }
    (in_match, in_insert)
}

/// Wall nanoseconds and summed on-CPU nanoseconds of two route threads.
fn two_threads(setups: [&Setup; 2], routes: &[Request]) -> (u64, u64) {
    let items: [Vec<usize>; 2] = [
        (0..routes.len()).step_by(2).collect(),
        (1..routes.len()).step_by(2).collect(),
    ];
    two_threads_on(setups, routes, &items)
}

/// Wall and summed on-CPU nanoseconds of two route threads, thread t taking
/// `items[t]` in order.
fn two_threads_on(setups: [&Setup; 2], routes: &[Request], items: &[Vec<usize>; 2]) -> (u64, u64) {
    let pair = workload::run_pair(|t| {
        route(setups[t], items[t].iter().copied(), routes, 32 * t, false);
    });
    (pair.wall_ns, pair.cpu_ns.iter().sum())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok())
    };
    let reps = value("--reps").unwrap_or(3);
    let ops = value("--ops").unwrap_or(workload::LOOKUPS);
    let variant = if args.iter().any(|a| a == "--unicode") {
        Variant::Unicode
    } else {
        Variant::Ascii
    };
    let template = args.iter().any(|a| a == "--template");
    let w = Workload::new(variant);
    let prefix = |r: &Request| Request {
        text: format!("<|im_start|>system\n{}", r.text),
        sp: r.sp,
    };
    let (warm, routes): (Vec<Request>, Vec<Request>) = if template {
        (
            w.warm.iter().map(prefix).collect(),
            w.routes(ops).iter().map(prefix).collect(),
        )
    } else {
        (w.warm.clone(), w.routes(ops))
    };
    let n = routes.len() as f64;
    if args.iter().any(|a| a == "--shards") {
        // How concentrated the route loop is on the shards (first byte).
        let mut counts = [0usize; 256];
        for r in &routes {
            counts[usize::from(r.text.as_bytes()[0])] += 1;
        }
        let mut shares: Vec<f64> = counts.iter().map(|&c| c as f64 / n).collect();
        shares.sort_by(|a, b| b.total_cmp(a));
        let collide: f64 = shares.iter().map(|p| p * p).sum();
        println!(
            "top shard shares {:.3?}; P(two ops share a shard) {collide:.3}",
            &shares[..8]
        );
        return;
    }
    if args.iter().any(|a| a == "--lookups-only") {
        // Diagnosis: the route loop's lookups alone (no writes), on one
        // shared tree and on two unshared trees.
        let lookups = |setup: &Setup, t: usize| {
            let c0 = workload::thread_cpu_ns();
            for i in (t..routes.len()).step_by(2) {
                std::hint::black_box(setup.tree.prefix_match(&routes[i].text));
            }
            workload::thread_cpu_ns() - c0
        };
        for _ in 0..reps {
            let pair = [warm_tree(&warm), warm_tree(&warm)];
            let start = Instant::now();
            let c1 = lookups(&pair[0], 0) + lookups(&pair[0], 1);
            let one = start.elapsed().as_nanos() as f64;
            for shared in [true, false] {
                let timing = workload::run_pair(|t| {
                    lookups(&pair[if shared { 0 } else { t }], t);
                });
                let (wall, cpu) = (timing.wall_ns as f64, timing.cpu_ns.iter().sum::<u64>());
                println!(
                    "lookups only, {}: 1t {:.0} ns/op ({:.0} cpu), 2t {:.2}x, {:.0} cpu ns/op",
                    if shared { "shared" } else { "unshared" },
                    one / n,
                    c1 as f64 / n,
                    one / wall,
                    cpu as f64 / n
                );
            }
        }
        return;
    }
    if args.iter().any(|a| a == "--prompt-disjoint") {
        // Diagnosis: one shared tree, each thread taking the texts of the
        // system prompts of its parity (and their continuations), against
        // the same split on two trees: what sharing a prompt's branch costs.
        let items: [Vec<usize>; 2] = [0, 1].map(|t| {
            (0..routes.len())
                .filter(|&i| routes[i].sp % 2 == t)
                .collect()
        });
        for _ in 0..reps {
            let setup = warm_tree(&warm);
            let (wall, cpu) = two_threads_on([&setup, &setup], &routes, &items);
            drop(setup);
            let pair = [warm_tree(&warm), warm_tree(&warm)];
            let (uwall, ucpu) = two_threads_on([&pair[0], &pair[1]], &routes, &items);
            println!(
                "prompt-disjoint ({} / {} items): shared tree {:.0} ns/op wall, {:.0} cpu ns/op | \
                 unshared {:.0} ns/op wall, {:.0} cpu ns/op",
                items[0].len(),
                items[1].len(),
                wall as f64 / n,
                cpu as f64 / n,
                uwall as f64 / n,
                ucpu as f64 / n
            );
        }
        return;
    }
    if args.iter().any(|a| a == "--disjoint") {
        // Diagnosis: one shared tree, but each thread takes only texts of
        // its own shards (first byte parity), so the threads share no shard
        // lock and no node; compared with the same split on unshared trees.
        let items: [Vec<usize>; 2] = [0, 1].map(|t| {
            (0..routes.len())
                .filter(|&i| usize::from(routes[i].text.as_bytes()[0] & 1) == t)
                .collect()
        });
        for _ in 0..reps {
            let setup = warm_tree(&warm);
            let (wall, cpu) = two_threads_on([&setup, &setup], &routes, &items);
            drop(setup);
            let pair = [warm_tree(&warm), warm_tree(&warm)];
            let (uwall, ucpu) = two_threads_on([&pair[0], &pair[1]], &routes, &items);
            println!(
                "disjoint shards ({} / {} items): shared tree {:.0} ns/op wall, {:.0} cpu ns/op | \
                 unshared {:.0} ns/op wall, {:.0} cpu ns/op",
                items[0].len(),
                items[1].len(),
                wall as f64 / n,
                cpu as f64 / n,
                uwall as f64 / n,
                ucpu as f64 / n
            );
        }
        return;
    }
    if args.iter().any(|a| a == "--shared-only") {
        // For profilers: only the shared 2-thread loop, repeated.
        for _ in 0..reps {
            let setup = warm_tree(&warm);
            let (wall, cpu) = two_threads([&setup, &setup], &routes);
            let waits = setup.tree.lock_waits();
            println!(
                "2t shared {:.0} ns/op wall, {:.0} cpu ns/op, waits/op {:.4}",
                wall as f64 / n,
                cpu as f64 / n,
                (waits.reads + waits.writes) as f64 / n
            );
        }
        return;
    }
    for rep in 0..reps {
        let setup = warm_tree(&warm);
        let (start, c0) = (Instant::now(), workload::thread_cpu_ns());
        route(&setup, 0..routes.len(), &routes, 0, false);
        let one = start.elapsed().as_nanos() as f64;
        let one_cpu = (workload::thread_cpu_ns() - c0) as f64;
        drop(setup);

        let setup = warm_tree(&warm);
        let (lookup, insert) = route(&setup, 0..routes.len(), &routes, 0, true);
        drop(setup);

        let setup = warm_tree(&warm);
        let (shared, shared_cpu) = two_threads([&setup, &setup], &routes);
        let (shared, shared_cpu) = (shared as f64, shared_cpu as f64);
        let waits = setup.tree.lock_waits();
        drop(setup);

        let pair = [warm_tree(&warm), warm_tree(&warm)];
        let (unshared, unshared_cpu) = two_threads([&pair[0], &pair[1]], &routes);
        let (unshared, unshared_cpu) = (unshared as f64, unshared_cpu as f64);
        drop(pair);

        println!(
            "rep {rep}: 1t {:.0} ns/op wall, {:.0} cpu [lookup {:.0} + insert {:.0} ns] | \
             2t shared {:.2}x wall, {:.0} cpu ns/op, waits/op r {:.4} w {:.4} retries {:.4} | \
             2t unshared {:.2}x wall, {:.0} cpu ns/op",
            one / n,
            one_cpu / n,
            lookup as f64 / n,
            insert as f64 / n,
            one / shared,
            shared_cpu / n,
            waits.reads as f64 / n,
            waits.writes as f64 / n,
            waits.retries as f64 / n,
            one / unshared,
            unshared_cpu / n,
        );
    }
}
