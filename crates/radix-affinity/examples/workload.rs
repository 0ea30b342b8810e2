//! Runs the normative workload (`shared/workloads/radix-affinity.md`) against
//! [`TextTree`] and prints the measurements (a)-(g) and the physical limit.
//!
//! ```sh
//! cargo run --release -p radix-affinity --example workload -- --json
//! ```
//!
//! Options: `--json` (one JSON line on stdout; otherwise a table), `--reps N`
//! (default 5), `--variant ascii|unicode` (default both). Progress and the
//! checksum verification go to stderr. Single-threaded phases are timed on the
//! thread's on-CPU time (`/proc/thread-self/schedstat`), with wall time as
//! secondary; the 2-thread route loop reports wall time.

use std::io::Write;
use std::process::Command;
use std::time::Instant;

use radix_affinity::workload::{
    self, Lookup, Request, SPEC_CHECKSUMS, SPEC_WARM_TOKENS, Variant, Workload, checksum,
};
use radix_affinity::{TenantId, TextTree, TokenTree};

/// Resident bytes of this process.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|f| f.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// On-CPU and wall nanoseconds of `f`.
fn timed<T>(f: impl FnOnce() -> T) -> (T, u64, u64) {
    let (c0, w0) = (workload::thread_cpu_ns(), Instant::now());
    let out = f();
    let (c1, w1) = (workload::thread_cpu_ns(), w0.elapsed());
    (out, c1 - c0, w1.as_nanos() as u64)
}

struct Setup {
    tree: TextTree,
    ids: Vec<TenantId>,
}

fn warm_tree(w: &Workload) -> Setup {
    let tree = TextTree::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tree.intern(&workload::tenant_name(i)))
        .collect();
    for r in &w.warm {
        tree.insert(&r.text, ids[workload::owner(r.sp)]);
    }
    Setup { tree, ids }
}

fn route(
    tree: &TextTree,
    ids: &[TenantId],
    items: impl Iterator<Item = usize>,
    reqs: &[Request],
    mut rr: usize,
) {
    for i in items {
        let text = &reqs[i].text;
        let m = tree.prefix_match(text);
        let chosen = match m.tenant {
            Some(t) if 2 * m.matched > m.input && (t.index() as usize) < ids.len() => t,
            _ => {
                let t = ids[rr % ids.len()];
                rr += 1;
                t
            }
        };
        tree.insert(text, chosen);
    }
}

#[derive(Default, Clone)]
struct Rep {
    insert_cpu: u64,
    insert_wall: u64,
    match_cpu: u64,
    match_wall: u64,
    hot_owner: f64,
    matched_ratio: f64,
    route_cpu: u64,
    route_wall: u64,
    route2_wall: u64,
    route2_cpu: u64,
    route2_waits: u64,
    independent2_wall: u64,
    templated_cpu: u64,
    templated2_wall: u64,
    templated2_waits: u64,
    evict_cpu: u64,
    evict_tenant_cpu: u64,
    remove_cpu: u64,
    memcmp_cpu: u64,
    count_cpu: u64,
}

struct Sets {
    inserts: Vec<Request>,
    lookups: Vec<Lookup>,
    lookup_copies: Vec<String>,
    routes: Vec<Request>,
    insert_bytes: usize,
    /// W and the first R items behind one fixed chat-template prefix, for
    /// the worst case of this design (every text in one shard).
    templated_warm: Vec<Request>,
    templated_routes: Vec<Request>,
}

/// A fixed prefix in front of every text: what a chat template does.
const TEMPLATE: &str = "<|im_start|>system\n";
/// R items used for the templated 2-thread route loop.
const TEMPLATED_ROUTES: usize = 20_000;

fn templated(requests: &[Request]) -> Vec<Request> {
    requests
        .iter()
        .map(|r| Request {
            text: format!("{TEMPLATE}{}", r.text),
            sp: r.sp,
        })
        .collect()
}

fn one_rep(w: &Workload, s: &Sets) -> Rep {
    let mut rep = Rep::default();
    // (a) insert I into a warm tree.
    let setup = warm_tree(w);
    let ((), c, wall) = timed(|| {
        for r in &s.inserts {
            setup.tree.insert(&r.text, setup.ids[workload::owner(r.sp)]);
        }
    });
    (rep.insert_cpu, rep.insert_wall) = (c, wall);
    drop(setup);

    // (b) prefix_match L on a warm tree.
    let setup = warm_tree(w);
    let ((hits, hot, matched, input), c, wall) = timed(|| {
        let (mut hits, mut hot, mut matched, mut input) = (0usize, 0usize, 0usize, 0usize);
        for l in &s.lookups {
            let m = setup.tree.prefix_match(&l.text);
            matched += m.matched;
            input += m.input;
            if l.hot {
                hot += 1;
                hits += usize::from(m.tenant == Some(setup.ids[workload::owner(l.sp)]));
            }
        }
        (hits, hot, matched, input)
    });
    (rep.match_cpu, rep.match_wall) = (c, wall);
    rep.hot_owner = hits as f64 / hot.max(1) as f64;
    rep.matched_ratio = matched as f64 / input.max(1) as f64;
    drop(setup);

    // (c) route loop, one thread.
    let setup = warm_tree(w);
    let ((), c, wall) = timed(|| route(&setup.tree, &setup.ids, 0..s.routes.len(), &s.routes, 0));
    (rep.route_cpu, rep.route_wall) = (c, wall);
    drop(setup);

    // (d) route loop, two threads sharing one warm tree.
    let setup = warm_tree(w);
    let routes = &s.routes;
    let pair = workload::run_pair(|t| {
        route(
            &setup.tree,
            &setup.ids,
            (t..routes.len()).step_by(2),
            routes,
            32 * t,
        );
    });
    rep.route2_wall = pair.wall_ns;
    rep.route2_cpu = pair.cpu_ns.iter().sum();
    let waits = setup.tree.lock_waits();
    rep.route2_waits = waits.reads + waits.writes;
    drop(setup);

    // Control for (d): the same two threads, each on its own warm tree, so
    // nothing is shared. What this reaches is the machine's own 2-thread
    // scaling (shared cores, memory bandwidth, other load), the ceiling (d)
    // can be compared with.
    let trees = [warm_tree(w), warm_tree(w)];
    let pair = workload::run_pair(|t| {
        route(
            &trees[t].tree,
            &trees[t].ids,
            (t..routes.len()).step_by(2),
            routes,
            32 * t,
        );
    });
    rep.independent2_wall = pair.wall_ns;
    drop(trees);

    // Worst case for shard locking, outside the spec: every text starts with
    // the same template, so every text lives in one shard and every insert
    // takes the same write lock. One thread, then two, each on a fresh tree.
    let routes = &s.templated_routes;
    let templated_tree = || {
        let tree = TextTree::new();
        let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
            .map(|i| tree.intern(&workload::tenant_name(i)))
            .collect();
        for r in &s.templated_warm {
            tree.insert(&r.text, ids[workload::owner(r.sp)]);
        }
        Setup { tree, ids }
    };
    let setup = templated_tree();
    let ((), c, _) = timed(|| route(&setup.tree, &setup.ids, 0..routes.len(), routes, 0));
    rep.templated_cpu = c;
    drop(setup);
    let setup = templated_tree();
    let pair = workload::run_pair(|t| {
        route(
            &setup.tree,
            &setup.ids,
            (t..routes.len()).step_by(2),
            routes,
            32 * t,
        );
    });
    rep.templated2_wall = pair.wall_ns;
    let waits = setup.tree.lock_waits();
    rep.templated2_waits = waits.reads + waits.writes;
    drop(setup);

    // (e) eviction to 10 % of the tenant-attributed units, tree-wide LRU ...
    let setup = warm_tree(w);
    let budget = setup.tree.total_size() / 10;
    let ((), c, _) = timed(|| setup.tree.evict_to_total(budget));
    assert!(setup.tree.total_size() <= budget);
    rep.evict_cpu = c;
    drop(setup);
    // ... and with the per-tenant API at the water level.
    let setup = warm_tree(w);
    let budget = setup.tree.total_size() / 10;
    let ((), c, _) = timed(|| {
        let mut sizes: Vec<usize> = setup
            .tree
            .tenant_sizes()
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        sizes.sort_unstable();
        let level = water_level(&sizes, budget);
        setup.tree.evict_tenant_by_size(level);
    });
    assert!(setup.tree.total_size() <= budget);
    rep.evict_tenant_cpu = c;
    drop(setup);

    // (g) remove the owner of the most popular prompt.
    let setup = warm_tree(w);
    let victim = setup.ids[workload::owner(0)];
    let ((), c, _) = timed(|| setup.tree.remove_tenant(victim));
    assert_eq!(setup.tree.tenant_size(victim), 0);
    rep.remove_cpu = c;
    drop(setup);

    // Physical limit: compare each L text with an equal copy; count chars.
    let (eq, c, _) = timed(|| {
        s.lookups
            .iter()
            .zip(&s.lookup_copies)
            .filter(|(l, copy)| {
                std::hint::black_box(l.text.as_bytes()) == std::hint::black_box(copy.as_bytes())
            })
            .count()
    });
    assert_eq!(eq, s.lookups.len());
    rep.memcmp_cpu = c;
    let (chars, c, _) = timed(|| {
        s.lookups
            .iter()
            .map(|l| std::hint::black_box(l.text.as_str()).chars().count())
            .sum::<usize>()
    });
    std::hint::black_box(chars);
    rep.count_cpu = c;
    let _ = s.insert_bytes;
    rep
}

/// Largest per-tenant limit `m` with `sum(min(size, m)) <= budget` (sizes sorted).
fn water_level(sorted: &[usize], budget: usize) -> usize {
    let mut used = 0usize;
    for (i, &size) in sorted.iter().enumerate() {
        let rest = sorted.len() - i;
        if used + size * rest > budget {
            return (budget - used) / rest;
        }
        used += size;
    }
    usize::MAX
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn verify_checksums(w: &Workload, s: &Sets) -> bool {
    let sets: [(&str, Vec<&str>); 4] = [
        ("W", w.warm.iter().map(|r| r.text.as_str()).collect()),
        ("I", s.inserts.iter().map(|r| r.text.as_str()).collect()),
        ("L", s.lookups.iter().map(|r| r.text.as_str()).collect()),
        ("R", s.routes.iter().map(|r| r.text.as_str()).collect()),
    ];
    let mut ok = true;
    for (name, texts) in sets {
        let got = checksum(texts.iter().copied());
        let want = SPEC_CHECKSUMS
            .iter()
            .find(|(v, n, _)| *v == w.variant && *n == name)
            .map(|(_, _, c)| *c);
        let good = want == Some(got);
        ok &= good;
        eprintln!(
            "checksum {} {name}: n={} chars={} bytes={} fnv={:016x} {}",
            w.variant.name(),
            got.n,
            got.chars,
            got.bytes,
            got.fnv,
            if good { "OK" } else { "MISMATCH" }
        );
    }
    let mut tokens = Vec::new();
    let count: usize = w
        .warm
        .iter()
        .map(|r| {
            workload::tokenize(&r.text, &mut tokens);
            tokens.len()
        })
        .sum();
    let want = SPEC_WARM_TOKENS
        .iter()
        .find(|(v, _)| *v == w.variant)
        .map(|(_, n)| *n);
    eprintln!(
        "tokens {} W: {count} {}",
        w.variant.name(),
        if want == Some(count) {
            "OK"
        } else {
            "MISMATCH"
        }
    );
    ok && want == Some(count)
}

/// (f) in a fresh process: RSS growth of inserting W into a new tree.
fn memory_child(variant: Variant) {
    let w = Workload::new(variant);
    let chars: usize = w.warm.iter().map(|r| r.text.chars().count()).sum();
    let before = rss_bytes();
    let setup = warm_tree(&w);
    let after = rss_bytes();
    let units = setup.tree.total_size();
    // A token tree over the same texts, for comparison (separate measurement).
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{} {} {}", after.saturating_sub(before), chars, units);
    drop(setup);
    let mut tokens = Vec::new();
    let tree = TokenTree::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tree.intern(&workload::tenant_name(i)))
        .collect();
    let before = rss_bytes();
    for r in &w.warm {
        workload::tokenize(&r.text, &mut tokens);
        tree.insert_symbols(&tokens, ids[workload::owner(r.sp)]);
    }
    let after = rss_bytes();
    let _ = writeln!(
        out,
        "{} {}",
        after.saturating_sub(before),
        tree.total_size()
    );
}

fn memory(variant: Variant) -> Option<(f64, f64, f64)> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe)
        .arg("--memory-child")
        .arg(variant.name())
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let f: Vec<f64> = lines
        .next()?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let t: Vec<f64> = lines
        .next()?
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let (grow, chars, units) = (*f.first()?, *f.get(1)?, *f.get(2)?);
    let (token_grow, _tokens) = (*t.first()?, *t.get(1)?);
    Some((grow / chars, grow / units, token_grow / chars))
}

fn run_variant(variant: Variant, reps: usize) -> String {
    eprintln!("generating {} ...", variant.name());
    let w = Workload::new(variant);
    let lookups = w.lookups(workload::LOOKUPS);
    let mut sets = Sets {
        inserts: w.inserts(workload::WARM_REQUESTS),
        lookup_copies: lookups.iter().map(|l| l.text.clone()).collect(),
        lookups,
        routes: w.routes(workload::LOOKUPS),
        insert_bytes: 0,
        templated_warm: Vec::new(),
        templated_routes: Vec::new(),
    };
    let checksums_ok = verify_checksums(&w, &sets);
    sets.templated_warm = templated(&w.warm);
    sets.templated_routes = templated(&sets.routes[..TEMPLATED_ROUTES]);
    let insert_bytes: usize = sets.inserts.iter().map(|r| r.text.len()).sum();
    let mut results = Vec::new();
    for r in 0..reps {
        eprintln!("{} repetition {}/{reps}", variant.name(), r + 1);
        results.push(one_rep(&w, &sets));
    }
    let stat = |f: &dyn Fn(&Rep) -> f64| median(results.iter().map(f).collect());
    let n_ins = sets.inserts.len() as f64;
    let n_l = sets.lookups.len() as f64;
    let n_r = sets.routes.len() as f64;
    let mut fields: Vec<(String, (f64, f64, f64))> = vec![
        (
            "insert_ops_per_s".into(),
            stat(&|r| n_ins / (r.insert_cpu as f64 / 1e9)),
        ),
        (
            "insert_mb_per_s".into(),
            stat(&|r| insert_bytes as f64 / 1e6 / (r.insert_cpu as f64 / 1e9)),
        ),
        (
            "insert_wall_ops_per_s".into(),
            stat(&|r| n_ins / (r.insert_wall as f64 / 1e9)),
        ),
        (
            "match_ns_per_op".into(),
            stat(&|r| r.match_cpu as f64 / n_l),
        ),
        (
            "match_wall_ns_per_op".into(),
            stat(&|r| r.match_wall as f64 / n_l),
        ),
        (
            "memcmp_ns_per_op".into(),
            stat(&|r| r.memcmp_cpu as f64 / n_l),
        ),
        (
            "char_count_ns_per_op".into(),
            stat(&|r| r.count_cpu as f64 / n_l),
        ),
        (
            "route_ops_per_s".into(),
            stat(&|r| n_r / (r.route_cpu as f64 / 1e9)),
        ),
        (
            "route_wall_ops_per_s".into(),
            stat(&|r| n_r / (r.route_wall as f64 / 1e9)),
        ),
        (
            "route_2t_ops_per_s".into(),
            stat(&|r| n_r / (r.route2_wall as f64 / 1e9)),
        ),
        (
            "route_2t_cpu_ns_per_op".into(),
            stat(&|r| r.route2_cpu as f64 / n_r),
        ),
        (
            "route_2t_lock_waits_per_op".into(),
            stat(&|r| r.route2_waits as f64 / (2.0 * n_r)),
        ),
        (
            "templated_route_ops_per_s".into(),
            stat(&|r| TEMPLATED_ROUTES as f64 / (r.templated_cpu as f64 / 1e9)),
        ),
        (
            "templated_route_2t_ops_per_s".into(),
            stat(&|r| TEMPLATED_ROUTES as f64 / (r.templated2_wall as f64 / 1e9)),
        ),
        (
            "templated_route_2t_lock_waits_per_op".into(),
            stat(&|r| r.templated2_waits as f64 / (2.0 * TEMPLATED_ROUTES as f64)),
        ),
        (
            "route_2t_unshared_ops_per_s".into(),
            stat(&|r| n_r / (r.independent2_wall as f64 / 1e9)),
        ),
        ("evict_ms".into(), stat(&|r| r.evict_cpu as f64 / 1e6)),
        (
            "evict_tenant_ms".into(),
            stat(&|r| r.evict_tenant_cpu as f64 / 1e6),
        ),
        (
            "remove_tenant_ms".into(),
            stat(&|r| r.remove_cpu as f64 / 1e6),
        ),
        ("hot_owner_ratio".into(), stat(&|r| r.hot_owner)),
        ("matched_ratio".into(), stat(&|r| r.matched_ratio)),
    ];
    if let Some((per_char, per_unit, token_per_char)) = memory(variant) {
        fields.push(("bytes_per_char".into(), (per_char, per_char, per_char)));
        fields.push(("bytes_per_unit".into(), (per_unit, per_unit, per_unit)));
        fields.push((
            "token_tree_bytes_per_char".into(),
            (token_per_char, token_per_char, token_per_char),
        ));
    }
    let body: Vec<String> = fields
        .iter()
        .map(|(k, (m, _, _))| format!("\"{k}\":{m:.4}"))
        .collect();
    let range: Vec<String> = fields
        .iter()
        .map(|(k, (_, lo, hi))| format!("\"{k}\":[{lo:.4},{hi:.4}]"))
        .collect();
    format!(
        "{{{},\"checksums_ok\":{checksums_ok},\"reps\":{reps},\"min_max\":{{{}}}}}",
        body.join(","),
        range.join(",")
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--memory-child") {
        let variant = if args.get(i + 1).map(String::as_str) == Some("unicode") {
            Variant::Unicode
        } else {
            Variant::Ascii
        };
        memory_child(variant);
        return;
    }
    let json = args.iter().any(|a| a == "--json");
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(5usize)
        .max(1);
    let only = args
        .iter()
        .position(|a| a == "--variant")
        .and_then(|i| args.get(i + 1).cloned());
    let mut parts = Vec::new();
    for variant in [Variant::Ascii, Variant::Unicode] {
        if only.as_deref().is_some_and(|o| o != variant.name()) {
            continue;
        }
        parts.push((variant.name(), run_variant(variant, reps)));
    }
    if json {
        // The ascii keys at top level, the unicode ones under "unicode".
        let mut out = String::from("{");
        for (i, (name, obj)) in parts.iter().enumerate() {
            if *name == "ascii" {
                out.push_str(&obj[1..obj.len() - 1]);
            } else {
                out.push_str(&format!("\"{name}\":{obj}"));
            }
            if i + 1 < parts.len() {
                out.push(',');
            }
        }
        out.push('}');
        println!("{out}");
    } else {
        for (name, obj) in parts {
            println!("{name}: {obj}");
        }
    }
}
