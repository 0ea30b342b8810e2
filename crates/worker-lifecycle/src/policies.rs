//! `Worker` as an `lb_policies::Backend` (feature `lb-policies`).
//!
//! Policies see exactly what the router's own accounting sees: the live
//! in-flight load counted by guards, the processed count, and availability
//! (ready, healthy, breaker admitting). The key is the worker's stable key,
//! which includes its role and registration generation, so a re-registered
//! endpoint is a new member to the policies and its old affinity goes with
//! the old generation.

use crate::Worker;

impl lb_policies::Backend for Worker {
    fn key(&self) -> &str {
        Worker::key(self)
    }

    fn load(&self) -> usize {
        Worker::load(self)
    }

    fn processed(&self) -> u64 {
        Worker::processed(self)
    }

    fn is_available(&self) -> bool {
        Worker::is_available(self)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Endpoint, RoleKind, StaticWorkerSet, WorkerOptions, WorkerRole, WorkerSpec};
    use lb_policies::{Backend, Policy, RequestContext, RoundRobin};

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
