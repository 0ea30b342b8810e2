//! Entry points for fuzzing (see `fuzz/fuzz_targets/policy_ops.rs`). Not
//! part of the stable API.

use crate::backend::{Backend, BasicBackend};
use crate::context::{RequestContext, RoutingInput};
use crate::membership::MembershipEvent;
use crate::policy::Policy;
use crate::registry::{BUILTIN_POLICIES, PolicyConfig, build_builtin};

/// Interprets `data` as a fleet and a sequence of operations (load and
/// availability changes, membership events, selections with text, tokens
/// and hash keys) applied to every built-in policy at once, and checks that
/// every decision names an available candidate and that `None` means none
/// was available. Panics only if a policy breaks that contract; never on
/// the input itself.
pub fn policy_ops(data: &[u8]) {
    let mut bytes = data.iter().copied();
    let workers = usize::from(bytes.next().unwrap_or(3) % 16) + 1;
    let fleet: Vec<BasicBackend> = (0..workers)
        .map(|i| BasicBackend::new(format!("w{i}")))
        .collect();
    let mut config = PolicyConfig::named("").with_seed(u64::from(workers as u32));
    config.consistent_hash.virtual_nodes = 8;
    config.consistent_hash.bounded_load = Some(1.25);
    let policies: Vec<Box<dyn Policy<BasicBackend>>> = BUILTIN_POLICIES
        .iter()
        .filter_map(|name| {
            config.name = (*name).to_owned();
            build_builtin(&config).ok()
        })
        .collect();
    assert_eq!(
        policies.len(),
        BUILTIN_POLICIES.len(),
        "every built-in builds"
    );
    // kv_aware over an index the operations feed (even workers' streams
    // live), when the feature is on.
    #[cfg(feature = "kv-block-index")]
    let kv = kv_fixture(&fleet, &mut config);
    #[cfg(feature = "kv-block-index")]
    let policies = {
        let mut policies = policies;
        policies.push(build_builtin(&config).expect("kv_aware builds with its sources"));
        policies
    };
    // Workers a membership event removed: kv_aware never chooses them.
    let mut removed = vec![false; workers];
    // Keys for membership events: the fleet's plus one that is never a
    // candidate.
    let key_of = |b: u8| -> String {
        match usize::from(b) % (workers + 1) {
            i if i < workers => format!("w{i}"),
            _ => "stranger".to_owned(),
        }
    };
    let mut text = String::new();
    let mut tokens: Vec<u32> = Vec::new();
    while let Some(op) = bytes.next() {
        let arg = bytes.next().unwrap_or(0);
        let target = usize::from(arg) % workers;
        match op % 8 {
            0 => fleet[target].set_load(usize::from(bytes.next().unwrap_or(0))),
            1 => fleet[target].set_available(!fleet[target].is_available()),
            2 | 3 => {
                let key = key_of(arg);
                let event = match bytes.next().unwrap_or(0) % 3 {
                    0 => MembershipEvent::Added { key: &key },
                    1 => MembershipEvent::Removed { key: &key },
                    _ => MembershipEvent::Replaced { key: &key },
                };
                if let Some(r) = removed.get_mut(usize::from(arg) % (workers + 1)) {
                    *r = matches!(event, MembershipEvent::Removed { .. });
                }
                for p in &policies {
                    p.on_membership(event);
                }
            }
            4 => {
                // Grow the text with a few characters from a small alphabet
                // (including multi-byte ones), so prefixes repeat.
                const ALPHABET: [char; 6] = ['a', 'b', 'c', 'é', '猫', '🙂'];
                for _ in 0..(arg % 8) {
                    text.push(ALPHABET[usize::from(bytes.next().unwrap_or(0)) % ALPHABET.len()]);
                }
                tokens.push(u32::from(arg));
                #[cfg(feature = "kv-block-index")]
                kv.store(target, &tokens);
            }
            5 => {
                text.clear();
                tokens.clear();
            }
            6 => {
                for p in &policies {
                    p.maintain();
                }
            }
            _ => {
                let session = format!("s{}", arg % 7);
                let model = if arg & 0x80 == 0 { "m" } else { "other" };
                let ctx = match arg % 4 {
                    0 => RequestContext::new(model).with_text(&text),
                    1 => RequestContext::new(model).with_tokens(&tokens),
                    2 => RequestContext::new(model)
                        .with_text(&text)
                        .with_session(&session),
                    _ => RequestContext::new(model).with_user(&session),
                };
                let any_available = fleet.iter().any(Backend::is_available);
                let any_member = (0..workers).any(|i| fleet[i].is_available() && !removed[i]);
                for p in &policies {
                    match p.select(&fleet, &ctx) {
                        Some(d) => {
                            assert!(d.index < workers, "{}: index out of range", p.name());
                            assert!(
                                fleet[d.index].is_available(),
                                "{}: chose an unavailable worker",
                                p.name()
                            );
                            let kv_tokens = p.name() == "kv_aware"
                                && matches!(ctx.routing, RoutingInput::Tokens(t) if !t.is_empty());
                            assert!(
                                !(kv_tokens && removed[d.index]),
                                "kv_aware chose a removed worker"
                            );
                            fleet[d.index].begin_request();
                        }
                        None if p.name() == "kv_aware" => {
                            assert!(!any_member, "kv_aware: None with a member available")
                        }
                        None => {
                            assert!(!any_available, "{}: None with a worker available", p.name())
                        }
                    }
                }
            }
        }
    }
}

/// The index, liveness and worker ids the `kv_aware` instance reads.
#[cfg(feature = "kv-block-index")]
struct KvFixture {
    index: std::sync::Arc<kv_block_index::KvIndex>,
    ids: Vec<kv_block_index::WorkerId>,
}

#[cfg(feature = "kv-block-index")]
fn kv_fixture(fleet: &[BasicBackend], config: &mut PolicyConfig) -> KvFixture {
    use std::sync::Arc;

    use crate::policies::kv_aware::{KvSources, KvStreams};

    const BLOCK: usize = 2;
    let index = Arc::new(kv_block_index::KvIndex::new(kv_block_index::IndexConfig {
        block_size: BLOCK,
        ..kv_block_index::IndexConfig::default()
    }));
    let streams = Arc::new(KvStreams::with_capacity(64));
    let ids: Vec<_> = fleet
        .iter()
        .map(|b| index.register_worker(b.key().to_owned()))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        streams.set_live(*id, i % 2 == 0);
    }
    config.name = "kv_aware".to_owned();
    config.cache_aware.block_size = BLOCK;
    *config = config
        .clone()
        .with_kv(KvSources::new(Arc::clone(&index), streams));
    KvFixture { index, ids }
}

#[cfg(feature = "kv-block-index")]
impl KvFixture {
    /// Worker `target`'s engine reports holding every full block of
    /// `tokens` (engine hashes: our own, so a repeat is idempotent).
    fn store(&self, target: usize, tokens: &[u32]) {
        let hasher = self.index.hasher();
        let hashes = hasher.hash_blocks(tokens);
        let event = kv_block_index::KvEvent::BlockStored {
            block_hashes: hashes
                .iter()
                .map(|h| kv_block_index::EngineHash::from_int(h.0 as i64))
                .collect(),
            parent_block_hash: None,
            token_ids: tokens[..hashes.len() * hasher.block_size()].to_vec(),
            block_size: hasher.block_size(),
            lora_id: None,
        };
        // Registered above and never unregistered: cannot fail.
        let _ = self.index.apply(self.ids[target], 0, &event);
    }
}
