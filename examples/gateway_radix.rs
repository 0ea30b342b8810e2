//! Another gateway using `radix-affinity` alone: cache-aware placement
//! without any other crate of this workspace.
//!
//! The gateway keeps **one tree per model** (prefix caches are per model on
//! the engines, so affinity is too). For every request it asks the model's
//! tree for the best owner of the prompt; when more than
//! `MATCH_THRESHOLD` of the prompt is already held by a live backend, the
//! request goes there, otherwise to the backend that has been given the
//! least work. Either way the prompt is then inserted for the chosen
//! backend, because that backend's KV cache now holds it. A background
//! thread **evicts on a timer**, keeping every backend within a budget of
//! cached characters, and when a backend **leaves** the gateway forgets it
//! in every tree, so no later request is sent to a cache that is gone.
//!
//! The backends here are names, not servers: the example shows the
//! decisions, not the forwarding (see `custom_proxy.rs` for that). It runs
//! a few hundred requests of multi-turn conversations over two models,
//! removes one backend half-way, prints a short report, checks what it
//! claims, and exits with an error if a check fails.
//!
//! Run: `cargo run --release --example gateway_radix`
use std::collections::HashMap;
use std::error::Error;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use radix_affinity::{TenantId, TextTree};

/// Route by affinity only when more than this fraction of the prompt is
/// cached somewhere; below it the cache saves too little to matter.
const MATCH_THRESHOLD: f64 = 0.5;
/// Cached characters each backend may hold per model before the timer
/// evicts its least recently used entries.
const BUDGET_PER_BACKEND: usize = 10_000;
const EVICTION_PERIOD: Duration = Duration::from_millis(20);
const MODELS: [&str; 2] = ["llama-3.1-8b", "qwen-2.5-7b"];
const BACKENDS: [&str; 4] = [
    "http://10.0.0.1:8000",
    "http://10.0.0.2:8000",
    "http://10.0.0.3:8000",
    "http://10.0.0.4:8000",
];
/// The backend that leaves half-way through.
const LEAVING: usize = 2;
const CONVERSATIONS_PER_MODEL: usize = 24;
const TURNS: usize = 6;

/// The gateway's own view of one backend.
struct Backend {
    name: &'static str,
    live: bool,
    routed: u64,
}

/// One model's tree and the tenant id of each backend in it (ids are per
/// tree, interned once when the backend joins, never on the request path).
struct ModelTree {
    tree: Arc<TextTree>,
    tenants: Vec<TenantId>,
}

#[derive(Default)]
struct Tally {
    affinity: u64,
    placed: u64,
}

struct Gateway {
    backends: Vec<Backend>,
    models: HashMap<&'static str, ModelTree>,
    tally: HashMap<&'static str, Tally>,
}

impl Gateway {
    fn new() -> Self {
        let backends = BACKENDS
            .iter()
            .map(|&name| Backend {
                name,
                live: true,
                routed: 0,
            })
            .collect::<Vec<_>>();
        let models = MODELS
            .iter()
            .map(|&model| {
                let tree = Arc::new(TextTree::new());
                let tenants = backends.iter().map(|b| tree.intern(b.name)).collect();
                (model, ModelTree { tree, tenants })
            })
            .collect();
        Gateway {
            backends,
            models,
            tally: HashMap::new(),
        }
    }

    /// Chooses a backend for `prompt` on `model` and records the prompt for
    /// it. Returns the backend's index, or `None` if the model is unknown or
    /// no backend is live.
    fn route(&mut self, model: &'static str, prompt: &str) -> Option<usize> {
        let entry = self.models.get(model)?;
        let found = entry.tree.prefix_match(prompt);
        let rate = found.matched as f64 / found.input.max(1) as f64;
        let owner = found
            .tenant
            .filter(|_| rate > MATCH_THRESHOLD)
            .and_then(|tenant| entry.tenants.iter().position(|&t| t == tenant))
            .filter(|&i| self.backends[i].live);
        let tally = self.tally.entry(model).or_default();
        let chosen = match owner {
            Some(i) => {
                tally.affinity += 1;
                i
            }
            None => {
                tally.placed += 1;
                // Fallback: the live backend given the least work so far.
                (0..self.backends.len())
                    .filter(|&i| self.backends[i].live)
                    .min_by_key(|&i| self.backends[i].routed)?
            }
        };
        entry.tree.insert(prompt, entry.tenants[chosen]);
        self.backends[chosen].routed += 1;
        Some(chosen)
    }

    /// Backend `i` left the fleet: stop choosing it and forget its caches.
    fn leave(&mut self, i: usize) {
        self.backends[i].live = false;
        for entry in self.models.values() {
            entry.tree.remove_tenant(entry.tenants[i]);
        }
    }

    fn trees(&self) -> Vec<Arc<TextTree>> {
        self.models.values().map(|m| Arc::clone(&m.tree)).collect()
    }
}

/// Evicts every tree to the per-backend budget each period until the
/// returned sender is dropped; the handle says how many rounds ran.
fn spawn_evictor(trees: Vec<Arc<TextTree>>) -> (mpsc::Sender<()>, thread::JoinHandle<u32>) {
    let (stop, stopped) = mpsc::channel::<()>();
    let handle = thread::spawn(move || {
        let mut rounds = 0;
        // The channel doubles as the timer: a timeout is a tick, a
        // disconnect is the stop signal.
        while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(EVICTION_PERIOD) {
            for tree in &trees {
                tree.evict_tenant_by_size(BUDGET_PER_BACKEND);
            }
            rounds += 1;
        }
        rounds
    });
    (stop, handle)
}

/// A tiny deterministic generator, so every run sends the same
/// conversations (when the timer evicts still varies a little).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

const WORDS: [&str; 16] = [
    "cache", "prefix", "token", "routing", "latency", "decode", "report", "summary", "budget",
    "worker", "request", "answer", "careful", "engine", "memory", "context",
];

fn sentence(rng: &mut Rng, words: usize) -> String {
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push(' ');
    }
    s
}

/// A conversation: a system prompt shared with other conversations, then
/// turns; turn `n + 1`'s prompt extends turn `n`'s, as chat prompts do.
struct Conversation {
    model: &'static str,
    prompt: String,
    rng: Rng,
    last_backend: Option<usize>,
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut gateway = Gateway::new();
    let (stop_evictor, evictor) = spawn_evictor(gateway.trees());

    let mut rng = Rng(42);
    let systems: Vec<String> = (0..4)
        .map(|i| format!("<system {i}> {}", sentence(&mut rng, 12)))
        .collect();
    let mut conversations: Vec<Conversation> = (0..CONVERSATIONS_PER_MODEL * MODELS.len())
        .map(|c| Conversation {
            model: MODELS[c % MODELS.len()],
            prompt: systems[c % systems.len()].clone(),
            rng: Rng(1000 + c as u64),
            last_backend: None,
        })
        .collect();

    let mut requests = 0u64;
    let mut stayed = 0u64;
    let mut moved_after_leave = 0u64;
    let mut chosen_after_leave = 0u64;
    for turn in 0..TURNS {
        if turn == TURNS / 2 {
            gateway.leave(LEAVING);
            println!(
                "backend {} left after {requests} requests",
                BACKENDS[LEAVING]
            );
        }
        for conversation in &mut conversations {
            let said = sentence(&mut conversation.rng, 24);
            conversation
                .prompt
                .push_str(&format!("\n<user> {said}\n<assistant> "));
            let Some(chosen) = gateway.route(conversation.model, &conversation.prompt) else {
                return Err("no live backend".into());
            };
            requests += 1;
            if turn >= TURNS / 2 && chosen == LEAVING {
                chosen_after_leave += 1;
            }
            match conversation.last_backend {
                Some(last) if last == chosen => stayed += 1,
                Some(last) if last == LEAVING && turn == TURNS / 2 => moved_after_leave += 1,
                _ => {}
            }
            conversation.last_backend = Some(chosen);
            let answer = sentence(&mut conversation.rng, 8);
            conversation.prompt.push_str(&answer);
            // Requests arrive over time, so the eviction timer runs in between.
            thread::sleep(Duration::from_millis(1));
        }
    }

    drop(stop_evictor);
    let rounds = evictor.join().map_err(|_| "the evictor thread panicked")?;
    // A last pass with no writers running brings every backend within budget
    // (racing inserts may have pushed one above it since the last tick).
    for tree in gateway.trees() {
        tree.evict_tenant_by_size(BUDGET_PER_BACKEND);
    }

    println!(
        "routed {requests} requests over {} models, {} backends",
        MODELS.len(),
        BACKENDS.len()
    );
    for model in MODELS {
        let tally = gateway
            .tally
            .get(model)
            .map_or((0, 0), |t| (t.affinity, t.placed));
        let entry = &gateway.models[model];
        let largest = entry
            .tenants
            .iter()
            .map(|&t| entry.tree.tenant_size(t))
            .max()
            .unwrap_or(0);
        println!(
            "  {model}: {} by affinity, {} placed by load; tree holds {} chars, \
             largest backend {largest} (budget {BUDGET_PER_BACKEND})",
            tally.0,
            tally.1,
            entry.tree.total_size()
        );
    }
    for backend in &gateway.backends {
        println!(
            "  {}: {} requests{}",
            backend.name,
            backend.routed,
            if backend.live { "" } else { " (left)" }
        );
    }
    println!("follow-up turns that stayed on their backend: {stayed}");
    println!("conversations moved off the departed backend: {moved_after_leave}");
    println!("eviction rounds on the timer: {rounds}");

    // What the report claims, checked.
    let follow_ups = (conversations.len() * (TURNS - 1)) as u64;
    check(
        chosen_after_leave == 0,
        "the departed backend was chosen after it left",
    )?;
    check(
        moved_after_leave > 0,
        "no conversation was on the departed backend",
    )?;
    check(
        stayed * 2 > follow_ups,
        "most follow-up turns should keep their backend",
    )?;
    check(rounds > 0, "the eviction timer never ran")?;
    for (model, entry) in &gateway.models {
        check(
            entry.tree.tenant_size(entry.tenants[LEAVING]) == 0,
            "the departed backend still holds cache entries",
        )?;
        for &tenant in &entry.tenants {
            let size = entry.tree.tenant_size(tenant);
            if size > BUDGET_PER_BACKEND {
                return Err(format!("{model}: a backend holds {size} chars, over budget").into());
            }
        }
        entry.tree.validate()?;
    }
    println!("ok: every check passed");
    Ok(())
}

fn check(condition: bool, failure: &str) -> Result<(), Box<dyn Error>> {
    if condition {
        Ok(())
    } else {
        Err(failure.into())
    }
}
