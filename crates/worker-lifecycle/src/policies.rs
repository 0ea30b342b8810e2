//! `Worker` as an `lb_policies::Backend` (feature `lb-policies`).
//!
//! Policies see exactly what the router's own accounting sees: the live
//! in-flight load counted by guards, the processed count, and availability
//! (ready, healthy, breaker admitting). The key is the worker's stable key,
//! which includes its role and registration generation, so a re-registered
//! endpoint is a new member to the policies and its old affinity goes with
//! the old generation.

use crate::{MembershipEvent, Worker};

impl MembershipEvent {
    /// This event as the policies see it, the one translation between the
    /// two membership types: worker keys carry the registration generation,
    /// so a replaced worker is the old lifetime's key leaving (its affinity
    /// goes with it) and the new lifetime's key joining.
    pub fn for_policies(&self) -> impl Iterator<Item = lb_policies::MembershipEvent<'_>> {
        let removed = self
            .removed()
            .map(|old| lb_policies::MembershipEvent::Removed { key: old.key() });
        let added = self
            .added()
            .map(|new| lb_policies::MembershipEvent::Added { key: new.key() });
        removed.into_iter().chain(added)
    }
}

impl lb_policies::Backend for Worker {
    fn key(&self) -> &str {
        Worker::key(self)
    }

    /// The estimate of the engine's whole load
    /// ([`Worker::estimated_load`]): this router's own in-flight requests
    /// plus the other routers' from the engine's last report.
    fn load(&self) -> usize {
        Worker::estimated_load(self)
    }

    fn processed(&self) -> u64 {
        Worker::processed(self)
    }

    fn is_available(&self) -> bool {
        Worker::is_available(self)
    }

    /// The engine's last reported KV-cache usage
    /// ([`Worker::engine_cache_usage`]), 0 without one.
    fn cache_usage(&self) -> f64 {
        Worker::engine_cache_usage(self).unwrap_or(0.0)
    }

    /// The engine's last reported waiting count
    /// ([`Worker::engine_waiting`]), 0 without one.
    fn waiting(&self) -> usize {
        Worker::engine_waiting(self).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Endpoint, RoleKind, StaticWorkerSet, WorkerOptions, WorkerRole, WorkerSpec};
    use lb_policies::{Backend, Policy, RequestContext, RoundRobin};

    #[test]
    fn a_replacement_reaches_the_policies_as_the_old_key_leaving_and_the_new_joining() {
        let set = StaticWorkerSet::new(RoleKind::Regular, WorkerOptions::default()).unwrap();
        let endpoint = Endpoint::new("http://127.0.0.1:8001", None).unwrap();
        let spec = WorkerSpec::new(WorkerRole::Regular, endpoint);
        let added = set.add(spec.clone()).unwrap();
        let first = added.added().unwrap().key().to_owned();
        assert_eq!(
            added.for_policies().collect::<Vec<_>>(),
            [lb_policies::MembershipEvent::Added { key: &first }]
        );
        let replaced = set.replace(spec).unwrap();
        let second = replaced.added().unwrap().key().to_owned();
        assert_ne!(first, second, "a new lifetime has a new key");
        assert_eq!(
            replaced.for_policies().collect::<Vec<_>>(),
            [
                lb_policies::MembershipEvent::Removed { key: &first },
                lb_policies::MembershipEvent::Added { key: &second },
            ]
        );
    }

    #[test]
    fn policies_select_workers_and_see_their_live_load() {
        let set = StaticWorkerSet::new(RoleKind::Regular, WorkerOptions::default()).unwrap();
        for port in [8001, 8002] {
            let endpoint = Endpoint::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
            set.add(WorkerSpec::new(WorkerRole::Regular, endpoint))
                .unwrap();
        }
        let workers = set.workers();
        let guard = workers[0].reserve();
        assert_eq!(Backend::load(&workers[0]), 1);
        assert!(Backend::is_available(&workers[1]));

        let policy = RoundRobin::new();
        let ctx = RequestContext::new("m");
        let first = policy.select(&workers, &ctx).unwrap().index;
        let second = policy.select(&workers, &ctx).unwrap().index;
        assert_ne!(first, second, "round robin visits both workers");
        drop(guard);
        assert_eq!(Backend::load(&workers[0]), 0);
    }
}
