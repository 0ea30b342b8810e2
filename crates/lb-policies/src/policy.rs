//! The policy trait and a counting wrapper.

use std::sync::Arc;

use crate::backend::Backend;
use crate::context::{RequestContext, RoutingInput};
use crate::decision::{Decision, DecisionCounters, DecisionCounts};
use crate::membership::MembershipEvent;

/// The part of a policy that does not depend on the backend type: its name
/// and the hooks that keep its state in step with the fleet.
///
/// Split from [`Policy`] so that `policy.on_membership(..)` on a concrete
/// policy needs no backend type annotation.
pub trait PolicyState: Send + Sync {
    /// The policy's name, as on the command line (e.g. `"cache_aware"`).
    fn name(&self) -> &str;

    /// Keeps the policy's state in step with the fleet. Stateless policies
    /// ignore it (the default).
    fn on_membership(&self, event: MembershipEvent<'_>) {
        let _ = event;
    }

    /// Learns a choice another router replica made: it sent `input`, a
    /// request for `model`, to `worker` (a member key). Prefix policies
    /// record it as they record their own choices, so replicas that share
    /// their choices keep one memory of where each prefix went. A worker
    /// that is not a live member is ignored: a peer never adds members
    /// ([`PolicyRegistry::learn_choice`](crate::PolicyRegistry::learn_choice)
    /// also ignores a model without an instance). Returns whether
    /// the choice was recorded; the default (stateless policies) records
    /// nothing.
    fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
        let _ = (model, input, worker);
        false
    }

    /// Periodic upkeep the host calls from its own timer (cache-aware evicts
    /// its trees to their budget here). The default does nothing.
    fn maintain(&self) {}

    /// For policies that keep prefix trees: their size, one entry per kind
    /// of tree (summed over models), for the host's metrics. The default,
    /// for stateless policies, is empty.
    fn tree_stats(&self) -> Vec<TreeStats> {
        Vec::new()
    }

    /// For policies that keep prefix trees: the memory budget they charge.
    fn tree_budget(&self) -> Option<Arc<radix_affinity::MemoryBudget>> {
        None
    }

    /// For policies that keep prefix affinity: how many symbols each member
    /// (by key) holds in the policy's trees, for the host's metrics. The
    /// default, for stateless policies, is empty.
    fn affinity_sizes(&self) -> Vec<(Arc<str>, usize)> {
        Vec::new()
    }
}

/// The size of a policy's prefix trees of one kind, summed over its models.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TreeStats {
    /// `"text"` or `"tokens"`.
    pub kind: &'static str,
    /// Accounted bytes ([`RadixTree::bytes`](radix_affinity::RadixTree::bytes)).
    pub bytes: u64,
    /// Entries: one per worker per node it holds.
    pub entries: u64,
    /// Entries evicted by the limits since the trees were made.
    pub evicted: u64,
}

impl TreeStats {
    /// Zero stats of `kind`.
    pub fn new(kind: &'static str) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }

    /// Adds `tree`'s figures.
    pub fn add<S: radix_affinity::Symbol>(&mut self, tree: &radix_affinity::RadixTree<S>) {
        self.bytes += tree.bytes();
        self.entries += tree.entries();
        self.evicted += tree.evicted();
    }
}

/// A load-balancing policy over candidates of type `B`.
///
/// Built-in policies implement `Policy<B>` for every `B: Backend`. The trait
/// is object safe (`Arc<dyn Policy<B>>`), takes `&self` everywhere and must
/// be `Send + Sync`: one instance serves concurrent requests.
pub trait Policy<B: Backend>: PolicyState {
    /// Chooses one of `candidates` for the request, or `None` when no
    /// candidate is available. The returned index is always that of an
    /// available candidate.
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision>;
}

macro_rules! forward_policy {
    ($wrapper:ident) => {
        impl<P: PolicyState + ?Sized> PolicyState for $wrapper<P> {
            fn name(&self) -> &str {
                (**self).name()
            }
            fn on_membership(&self, event: MembershipEvent<'_>) {
                (**self).on_membership(event)
            }
            fn maintain(&self) {
                (**self).maintain()
            }
            fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
                (**self).learn_choice(model, input, worker)
            }
            fn affinity_sizes(&self) -> Vec<(Arc<str>, usize)> {
                (**self).affinity_sizes()
            }
            fn tree_stats(&self) -> Vec<TreeStats> {
                (**self).tree_stats()
            }
            fn tree_budget(&self) -> Option<Arc<radix_affinity::MemoryBudget>> {
                (**self).tree_budget()
            }
        }

        impl<B: Backend, P: Policy<B> + ?Sized> Policy<B> for $wrapper<P> {
            fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
                (**self).select(candidates, ctx)
            }
        }
    };
}

forward_policy!(Box);
forward_policy!(Arc);

/// Wraps a policy and counts its decisions by reason.
///
/// The registry wraps every instance it creates this way, custom policies
/// included, so the host exports one set of counters per model.
#[derive(Debug, Default)]
pub struct Counted<P: ?Sized> {
    counters: DecisionCounters,
    inner: P,
}

impl<P> Counted<P> {
    /// Wraps `inner` with all counters at zero.
    pub fn new(inner: P) -> Self {
        Counted {
            counters: DecisionCounters::new(),
            inner,
        }
    }

    /// Unwraps the policy.
    pub fn into_inner(self) -> P {
        self.inner
    }
}

impl<P: ?Sized> Counted<P> {
    /// The wrapped policy.
    pub fn get_ref(&self) -> &P {
        &self.inner
    }

    /// The counts so far.
    pub fn counts(&self) -> DecisionCounts {
        self.counters.snapshot()
    }
}

impl<P: PolicyState + ?Sized> PolicyState for Counted<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn on_membership(&self, event: MembershipEvent<'_>) {
        self.inner.on_membership(event)
    }
    fn maintain(&self) {
        self.inner.maintain()
    }
    fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
        self.inner.learn_choice(model, input, worker)
    }
    fn affinity_sizes(&self) -> Vec<(Arc<str>, usize)> {
        self.inner.affinity_sizes()
    }
    fn tree_stats(&self) -> Vec<TreeStats> {
        self.inner.tree_stats()
    }
    fn tree_budget(&self) -> Option<Arc<radix_affinity::MemoryBudget>> {
        self.inner.tree_budget()
    }
}

impl<B: Backend, P: Policy<B> + ?Sized> Policy<B> for Counted<P> {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let decision = self.inner.select(candidates, ctx);
        self.counters.record(decision.as_ref());
        decision
    }
}
