//! Entry points for fuzzing (see `fuzz/fuzz_targets/policy_ops.rs`). Not
//! part of the stable API.

use crate::backend::{Backend, BasicBackend};
use crate::context::RequestContext;
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
                for p in &policies {
                    match p.select(&fleet, &ctx) {
                        Some(d) => {
                            assert!(d.index < workers, "{}: index out of range", p.name());
                            assert!(
                                fleet[d.index].is_available(),
                                "{}: chose an unavailable worker",
                                p.name()
                            );
                            fleet[d.index].begin_request();
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
