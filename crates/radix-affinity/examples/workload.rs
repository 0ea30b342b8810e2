//! Runs the normative workload (`shared/workloads/radix-affinity.md`) against
//! [`TextTree`] and prints the measurements (a)-(g) and the physical limit.
//!
//! ```sh
//! cargo run --release -p radix-affinity --example workload -- --json
//! ```
//!
//! Options: `--json` (one JSON line on stdout; otherwise a table per
//! variant), `--reps N` (default 5), `--variant ascii|unicode|chat`
//! (default all three; `chat` is this workspace's chat-shaped extension of
//! the spec, every text beginning with `system: `, so without roots all of
//! them fall in one first-symbol shard; its trees are told the roots
//! `system: ` and `user: ` unless `--no-roots` is given). Progress and the
//! checksum verification go to stderr.
//!
//! Single-threaded phases are timed on the thread's on-CPU time
//! (`/proc/thread-self/schedstat`), with wall time as secondary; the
//! 2-thread route loops report wall time. Every figure is the median over
//! the repetitions, with its minimum and maximum (`min_max` in JSON). The
//! 2-thread route loop on one shared tree and its control on two unshared
//! trees are also reported as ratios to the 1-thread loop of the same
//! repetition (`route_2t_over_1t_*`, `route_2t_unshared_over_1t_*`), with
//! each repetition's value: a single run's median hides how much they vary.
//!
//! Memory (f) is measured in child processes, one per tree (`--memory-of
//! text|token --variant V`, used internally); the `memory` function says why.

use std::process::Command;
use std::time::Instant;

use radix_affinity::workload::{
    self, Lookup, Request, SPEC_CHECKSUMS, SPEC_WARM_TOKENS, Variant, Workload, checksum,
};
use radix_affinity::{RadixTree, Symbol, TenantId, TextTree};

/// Resident bytes of this process: resident pages (`/proc/self/statm` field
/// 2) times 4096, as the spec says (so it assumes 4 KiB pages).
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

/// Whether `--no-roots` was given: the chat variant's trees get no roots.
static NO_ROOTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// An empty text tree for `variant`: the chat variant's is told the roles
/// that begin its texts (as the router's `cache_aware` does), unless
/// `--no-roots`.
fn new_tree(variant: Variant) -> TextTree {
    if variant == Variant::Chat && !NO_ROOTS.get().copied().unwrap_or(false) {
        TextTree::new()
            .with_text_roots(&["system: ", "user: "])
            .expect("valid roots")
    } else {
        TextTree::new()
    }
}

fn warm_tree(w: &Workload) -> Setup {
    let tree = new_tree(w.variant);
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
        let tree = new_tree(w.variant);
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

/// Median, minimum and maximum of `values` (the upper median for an even
/// count).
fn spread(mut values: Vec<f64>) -> Spread {
    values.sort_by(f64::total_cmp);
    Spread {
        median: values[values.len() / 2],
        min: values[0],
        max: values[values.len() - 1],
    }
}

/// A figure over the repetitions of one run.
#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    /// A figure measured once.
    fn single(value: f64) -> Self {
        Self {
            median: value,
            min: value,
            max: value,
        }
    }
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
        // The chat variant is this workspace's extension: no published sum.
        let good = want.is_none_or(|want| want == got);
        ok &= good;
        eprintln!(
            "checksum {} {name}: n={} chars={} bytes={} fnv={:016x} {}",
            w.variant.name(),
            got.n,
            got.chars,
            got.bytes,
            got.fnv,
            match (want, good) {
                (None, _) => "(not in the spec)",
                (_, true) => "OK",
                (_, false) => "MISMATCH",
            }
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
    let good = want.is_none_or(|want| want == count);
    eprintln!(
        "tokens {} W: {count} {}",
        w.variant.name(),
        match (want, good) {
            (None, _) => "(not in the spec)",
            (_, true) => "OK",
            (_, false) => "MISMATCH",
        }
    );
    ok && good
}

/// The tree a memory child builds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TreeKind {
    /// [`TextTree`] over the W texts.
    Text,
    /// [`TokenTree`] over the W texts' synthetic tokens.
    Token,
}

impl TreeKind {
    fn name(self) -> &'static str {
        match self {
            TreeKind::Text => "text",
            TreeKind::Token => "token",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        [TreeKind::Text, TreeKind::Token]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// RSS growth of building a tree: the tree is created, its tenants interned
/// and `insert_all` run between two readings.
fn rss_growth<S: Symbol>(insert_all: impl FnOnce(&RadixTree<S>, &[TenantId])) -> (u64, usize) {
    let before = rss_bytes();
    let tree = RadixTree::<S>::new();
    let ids: Vec<TenantId> = (0..workload::TENANT_COUNT)
        .map(|i| tree.intern(&workload::tenant_name(i)))
        .collect();
    insert_all(&tree, &ids);
    let after = rss_bytes();
    (after.saturating_sub(before), tree.total_size())
}

/// (f), run in a child process (`--memory-of KIND --variant V`): generates W,
/// inserts it into a new tree of `kind` and prints one line, `<RSS growth in
/// bytes> <chars of W> <tenant-attributed units>`.
fn memory_child(kind: TreeKind, variant: Variant) {
    let w = Workload::new(variant);
    let chars: usize = w.warm.iter().map(|r| r.text.chars().count()).sum();
    let (growth, units) = match kind {
        TreeKind::Text => rss_growth::<char>(|tree, ids| {
            for r in &w.warm {
                tree.insert(&r.text, ids[workload::owner(r.sp)]);
            }
        }),
        TreeKind::Token => {
            // Tokenise every text once beforehand so the one reused buffer
            // has its final size before the first reading.
            let mut tokens = Vec::new();
            for r in &w.warm {
                workload::tokenize(&r.text, &mut tokens);
            }
            rss_growth::<u32>(|tree, ids| {
                for r in &w.warm {
                    workload::tokenize(&r.text, &mut tokens);
                    tree.insert_symbols(&tokens, ids[workload::owner(r.sp)]);
                }
            })
        }
    };
    println!("{growth} {chars} {units}");
}

/// Memory of one tree, as read from a child's line.
struct Memory {
    /// RSS growth per character of W.
    bytes_per_char: f64,
    /// RSS growth per tenant-attributed unit (char or token; a node held by
    /// k tenants counts k times), as the spec's (f) reports it.
    bytes_per_unit: f64,
}

/// Runs (f) for `kind` in a child process: this executable again, with
/// `--memory-of`.
///
/// A child, because RSS growth measured in a process that has already built
/// and dropped other trees counts only the pages the allocator could not
/// take from its free lists: the token tree measured right after the text
/// tree was dropped in one process grew by a tenth of what it grows by
/// alone. Each tree is therefore measured in its own fresh process, the
/// text tree too, so the two figures are comparable.
fn memory(kind: TreeKind, variant: Variant) -> Option<Memory> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe)
        .args(["--memory-of", kind.name(), "--variant", variant.name()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "memory child ({} {}) failed: {}",
            kind.name(),
            variant.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let line = String::from_utf8(out.stdout).ok()?;
    let numbers: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let [growth, chars, units] = numbers[..] else {
        return None;
    };
    Some(Memory {
        bytes_per_char: growth / chars,
        bytes_per_unit: growth / units,
    })
}

/// The figures of one variant.
struct Report {
    variant: Variant,
    reps: usize,
    checksums_ok: bool,
    /// Named figures, median and range over the repetitions.
    fields: Vec<(&'static str, Spread)>,
    /// The two-thread ratios of each repetition, in order.
    ratios: Vec<(&'static str, Vec<f64>)>,
}

/// Per-repetition ratio of the 2-thread route loop's throughput (wall time,
/// as (d) is specified) to the 1-thread loop's (on-CPU time, (c)'s primary
/// figure) of the same repetition. One thread's on-CPU time leaves out what
/// other processes take from it, so on a busy machine the ratio errs low.
fn over_one_thread(rep: &Rep, two_thread_wall: u64) -> f64 {
    rep.route_cpu as f64 / two_thread_wall as f64
}

fn run_variant(variant: Variant, reps: usize) -> Report {
    eprintln!("generating {} ...", variant.name());
    let w = Workload::new(variant);
    let lookups = w.lookups(workload::LOOKUPS);
    let mut sets = Sets {
        inserts: w.inserts(workload::WARM_REQUESTS),
        lookup_copies: lookups.iter().map(|l| l.text.clone()).collect(),
        lookups,
        routes: w.routes(workload::LOOKUPS),
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
    let per_rep = |f: &dyn Fn(&Rep) -> f64| -> Vec<f64> { results.iter().map(f).collect() };
    let stat = |f: &dyn Fn(&Rep) -> f64| spread(per_rep(f));
    let n_ins = sets.inserts.len() as f64;
    let n_l = sets.lookups.len() as f64;
    let n_r = sets.routes.len() as f64;
    let shared_ratios = per_rep(&|r| over_one_thread(r, r.route2_wall));
    let unshared_ratios = per_rep(&|r| over_one_thread(r, r.independent2_wall));
    let mut fields: Vec<(&'static str, Spread)> = vec![
        (
            "insert_ops_per_s",
            stat(&|r| n_ins / (r.insert_cpu as f64 / 1e9)),
        ),
        (
            "insert_mb_per_s",
            stat(&|r| insert_bytes as f64 / 1e6 / (r.insert_cpu as f64 / 1e9)),
        ),
        (
            "insert_wall_ops_per_s",
            stat(&|r| n_ins / (r.insert_wall as f64 / 1e9)),
        ),
        ("match_ns_per_op", stat(&|r| r.match_cpu as f64 / n_l)),
        ("match_wall_ns_per_op", stat(&|r| r.match_wall as f64 / n_l)),
        ("memcmp_ns_per_op", stat(&|r| r.memcmp_cpu as f64 / n_l)),
        ("char_count_ns_per_op", stat(&|r| r.count_cpu as f64 / n_l)),
        (
            "route_ops_per_s",
            stat(&|r| n_r / (r.route_cpu as f64 / 1e9)),
        ),
        (
            "route_wall_ops_per_s",
            stat(&|r| n_r / (r.route_wall as f64 / 1e9)),
        ),
        (
            "route_2t_ops_per_s",
            stat(&|r| n_r / (r.route2_wall as f64 / 1e9)),
        ),
        ("route_2t_over_1t", spread(shared_ratios.clone())),
        (
            "route_2t_cpu_ns_per_op",
            stat(&|r| r.route2_cpu as f64 / n_r),
        ),
        (
            "route_2t_lock_waits_per_op",
            stat(&|r| r.route2_waits as f64 / (2.0 * n_r)),
        ),
        (
            "route_2t_unshared_ops_per_s",
            stat(&|r| n_r / (r.independent2_wall as f64 / 1e9)),
        ),
        ("route_2t_unshared_over_1t", spread(unshared_ratios.clone())),
        (
            "templated_route_ops_per_s",
            stat(&|r| TEMPLATED_ROUTES as f64 / (r.templated_cpu as f64 / 1e9)),
        ),
        (
            "templated_route_2t_ops_per_s",
            stat(&|r| TEMPLATED_ROUTES as f64 / (r.templated2_wall as f64 / 1e9)),
        ),
        (
            "templated_route_2t_lock_waits_per_op",
            stat(&|r| r.templated2_waits as f64 / (2.0 * TEMPLATED_ROUTES as f64)),
        ),
        ("evict_ms", stat(&|r| r.evict_cpu as f64 / 1e6)),
        (
            "evict_tenant_ms",
            stat(&|r| r.evict_tenant_cpu as f64 / 1e6),
        ),
        ("remove_tenant_ms", stat(&|r| r.remove_cpu as f64 / 1e6)),
        ("hot_owner_ratio", stat(&|r| r.hot_owner)),
        ("matched_ratio", stat(&|r| r.matched_ratio)),
    ];
    eprintln!("{} memory (children) ...", variant.name());
    if let Some(m) = memory(TreeKind::Text, variant) {
        fields.push(("bytes_per_char", Spread::single(m.bytes_per_char)));
        fields.push(("bytes_per_unit", Spread::single(m.bytes_per_unit)));
    }
    if let Some(m) = memory(TreeKind::Token, variant) {
        fields.push((
            "token_tree_bytes_per_char",
            Spread::single(m.bytes_per_char),
        ));
        fields.push((
            "token_tree_bytes_per_unit",
            Spread::single(m.bytes_per_unit),
        ));
    }
    Report {
        variant,
        reps,
        checksums_ok,
        fields,
        ratios: vec![
            ("route_2t_over_1t", shared_ratios),
            ("route_2t_unshared_over_1t", unshared_ratios),
        ],
    }
}

impl Report {
    /// The report's JSON members, without braces: every field's median under
    /// its name; the two-thread ratios also as `<name>_median`, `_min`,
    /// `_max` and `_per_rep` (in repetition order); `min_max` holds every
    /// field's range.
    fn json_members(&self) -> String {
        let mut members: Vec<String> = self
            .fields
            .iter()
            .map(|(name, s)| format!("\"{name}\":{:.4}", s.median))
            .collect();
        for (name, values) in &self.ratios {
            let s = spread(values.clone());
            let list: Vec<String> = values.iter().map(|v| format!("{v:.4}")).collect();
            members.push(format!(
                "\"{name}_median\":{:.4},\"{name}_min\":{:.4},\"{name}_max\":{:.4},\"{name}_per_rep\":[{}]",
                s.median,
                s.min,
                s.max,
                list.join(",")
            ));
        }
        let ranges: Vec<String> = self
            .fields
            .iter()
            .map(|(name, s)| format!("\"{name}\":[{:.4},{:.4}]", s.min, s.max))
            .collect();
        members.push(format!(
            "\"checksums_ok\":{},\"reps\":{},\"min_max\":{{{}}}",
            self.checksums_ok,
            self.reps,
            ranges.join(",")
        ));
        members.join(",")
    }

    /// The report as a table: one row per field (median, min, max over the
    /// repetitions), then the two-thread ratios of each repetition.
    fn table(&self) -> String {
        let mut out = format!(
            "{} ({} repetitions, checksums {})\n{:<38} {:>14} {:>14} {:>14}\n",
            self.variant.name(),
            self.reps,
            if self.checksums_ok { "OK" } else { "MISMATCH" },
            "measurement",
            "median",
            "min",
            "max"
        );
        for (name, s) in &self.fields {
            out.push_str(&format!(
                "{name:<38} {:>14} {:>14} {:>14}\n",
                readable(s.median),
                readable(s.min),
                readable(s.max)
            ));
        }
        for (name, values) in &self.ratios {
            let list: Vec<String> = values.iter().map(|v| format!("{v:.2}")).collect();
            out.push_str(&format!("{name} per repetition: {}\n", list.join(" ")));
        }
        out
    }
}

/// A figure with about four significant digits, for the table.
fn readable(value: f64) -> String {
    match value.abs() {
        v if v >= 1000.0 => format!("{value:.0}"),
        v if v >= 10.0 => format!("{value:.2}"),
        _ => format!("{value:.4}"),
    }
}

fn usage_error(message: &str) -> ! {
    eprintln!("workload: {message}");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value_of = |flag: &str| {
        let i = args.iter().position(|a| a == flag)?;
        match args.get(i + 1) {
            Some(v) => Some(v.clone()),
            None => usage_error(&format!("{flag} needs a value")),
        }
    };
    let only = value_of("--variant").map(|name| {
        Variant::ALL
            .into_iter()
            .find(|v| v.name() == name)
            .unwrap_or_else(|| usage_error(&format!("unknown variant {name:?}")))
    });
    if let Some(kind) = value_of("--memory-of") {
        let kind = TreeKind::parse(&kind)
            .unwrap_or_else(|| usage_error(&format!("unknown tree {kind:?} (text|token)")));
        let variant = only.unwrap_or_else(|| usage_error("--memory-of needs --variant"));
        memory_child(kind, variant);
        return;
    }
    let json = args.iter().any(|a| a == "--json");
    NO_ROOTS
        .set(args.iter().any(|a| a == "--no-roots"))
        .expect("set once");
    let reps = value_of("--reps")
        .map(|n| {
            n.parse::<usize>()
                .unwrap_or_else(|_| usage_error(&format!("--reps {n:?} is not a count")))
        })
        .unwrap_or(5)
        .max(1);
    let reports: Vec<Report> = Variant::ALL
        .into_iter()
        .filter(|v| only.is_none_or(|o| o == *v))
        .map(|v| run_variant(v, reps))
        .collect();
    if json {
        // The ascii members at top level, the others under their name.
        let members: Vec<String> = reports
            .iter()
            .map(|r| match r.variant {
                Variant::Ascii => r.json_members(),
                _ => format!("\"{}\":{{{}}}", r.variant.name(), r.json_members()),
            })
            .collect();
        println!("{{{}}}", members.join(","));
    } else {
        for r in &reports {
            println!("{}", r.table());
        }
    }
}
