//! Membership events: how stateful policies stay in step with the fleet.

/// A change in the fleet a policy serves, naming the worker by its
/// [`Backend::key`](crate::Backend::key).
///
/// The host delivers these from its discovery / reconciliation step, before
/// the new membership is used for routing (invariant 5 of docs/architecture.md: membership drives
/// policy state). Events are idempotent: adding a present key or removing
/// an absent one changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MembershipEvent<'a> {
    /// A worker joined.
    Added {
        /// The worker's key.
        key: &'a str,
    },
    /// A worker left; policies forget everything they knew about it
    /// (cache-aware drops its prefix affinity).
    Removed {
        /// The worker's key.
        key: &'a str,
    },
    /// The same key now names a new worker lifetime (it expired and
    /// registered again): it stays a member, but state learned from the old
    /// lifetime, such as cache affinity, is dropped.
    Replaced {
        /// The worker's key.
        key: &'a str,
    },
}

impl<'a> MembershipEvent<'a> {
    /// The key the event is about.
    pub fn key(&self) -> &'a str {
        match *self {
            MembershipEvent::Added { key }
            | MembershipEvent::Removed { key }
            | MembershipEvent::Replaced { key } => key,
        }
    }
}
