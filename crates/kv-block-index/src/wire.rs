//! The one conversion from vLLM's KV event wire format (the `kv-events`
//! crate) to the index's [`KvEvent`] (feature `wire`).
//!
//! A router converts the events its subscribers receive with it
//! (kv-event-bridge re-exports it), and the routing simulator the events
//! its simulated engines record, so that both feed an index the same
//! events the same way. The feature takes kv-events without its sockets:
//! the wire types only, no libzmq, no tokio.

use kv_events::{BlockHash as WireHash, KvEvent as WireEvent};

use crate::{EngineHash, KvEvent, Tier};

/// Why [`to_index_event`] did not convert an event: it describes another
/// cache than the one the index mirrors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Skipped {
    /// Another medium than the GPU cache (CPU offload, a connector's
    /// store).
    OtherMedium,
    /// Another KV-cache group than group 0 (a hybrid model's other
    /// layers).
    OtherGroup,
}

/// The block index's form of one wire event: the one conversion between
/// vLLM's event format and the index. Events for the GPU cache (medium
/// `"GPU"`, any case, or none) of KV-cache group 0 (or none) convert;
/// engine block hashes stay opaque ([`EngineHash`]), ints and bytes alike.
/// [`to_tiered_event`] converts the other media too.
///
/// ```
/// use kv_block_index::wire::{Skipped, to_index_event};
/// use kv_events::{BlockHash, BlockStored, KvEvent};
///
/// let mut stored = BlockStored::new(vec![BlockHash::Int(7)], None, vec![1, 2, 3, 4], 4);
/// assert!(matches!(
///     to_index_event(KvEvent::BlockStored(stored.clone())),
///     Ok(kv_block_index::KvEvent::BlockStored { block_size: 4, .. })
/// ));
/// stored.medium = Some("CPU".to_owned());
/// assert_eq!(
///     to_index_event(KvEvent::BlockStored(stored)).err(),
///     Some(Skipped::OtherMedium)
/// );
/// ```
///
/// # Errors
///
/// [`Skipped`] for an event about another medium or KV-cache group.
pub fn to_index_event(event: WireEvent) -> Result<KvEvent, Skipped> {
    match to_tiered_event(event)? {
        (Tier::Device, event) => Ok(event),
        _ => Err(Skipped::OtherMedium),
    }
}

/// The index's form of one wire event and the cache [`Tier`] it is about
/// (from its `medium`, see [`Tier::of_medium`]), for a host that credits
/// blocks held in lower tiers: it applies a lower tier's events to the
/// stream of [`Holder::tiered`](crate::Holder::tiered). `AllBlocksCleared`
/// carries no medium and comes back as [`Tier::Device`]; a host decides
/// which tiers it clears (vLLM sends it when the engine's prefix cache is
/// reset).
///
/// ```
/// use kv_block_index::Tier;
/// use kv_block_index::wire::to_tiered_event;
/// use kv_events::{BlockHash, BlockStored, KvEvent};
///
/// let mut stored = BlockStored::new(vec![BlockHash::Int(7)], None, vec![1, 2, 3, 4], 4);
/// stored.medium = Some("CPU".to_owned());
/// let (tier, _) = to_tiered_event(KvEvent::BlockStored(stored)).unwrap();
/// assert_eq!(tier, Tier::Host);
/// ```
///
/// # Errors
///
/// [`Skipped::OtherGroup`] for an event about another KV-cache group.
pub fn to_tiered_event(event: WireEvent) -> Result<(Tier, KvEvent), Skipped> {
    let (medium, group) = match &event {
        WireEvent::BlockStored(e) => (e.medium.as_deref(), e.group_idx),
        WireEvent::BlockRemoved(e) => (e.medium.as_deref(), e.group_idx),
        WireEvent::AllBlocksCleared => (None, None),
    };
    if group.is_some_and(|g| g != 0) {
        return Err(Skipped::OtherGroup);
    }
    let tier = Tier::of_medium(medium);
    let event = match event {
        WireEvent::BlockStored(e) => KvEvent::BlockStored {
            block_hashes: e.block_hashes.iter().map(engine_hash).collect(),
            parent_block_hash: e.parent_block_hash.as_ref().map(engine_hash),
            token_ids: e.token_ids,
            block_size: e.block_size as usize,
            lora_id: e.lora_id,
        },
        WireEvent::BlockRemoved(e) => KvEvent::BlockRemoved {
            block_hashes: e.block_hashes.iter().map(engine_hash).collect(),
        },
        WireEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    };
    Ok((tier, event))
}

fn engine_hash(hash: &WireHash) -> EngineHash {
    match hash {
        WireHash::Int(value) => EngineHash::from_int(*value as i64),
        WireHash::Bytes(bytes) => EngineHash::from_bytes(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{BlockRemoved, BlockStored};

    #[test]
    fn gpu_events_of_group_zero_convert_with_opaque_hashes() {
        let mut stored = BlockStored::new(
            vec![
                WireHash::Int(u64::MAX),
                WireHash::Bytes(b"digest".as_slice().into()),
            ],
            Some(WireHash::Int(3)),
            (0..8).collect(),
            4,
        );
        stored.medium = Some("gpu".to_owned());
        stored.group_idx = Some(0);
        stored.lora_id = Some(9);
        assert_eq!(
            to_index_event(WireEvent::BlockStored(stored)),
            Ok(KvEvent::BlockStored {
                // A negative Python hash and the uint 64 of the same bits
                // are one block.
                block_hashes: vec![EngineHash::from_int(-1), EngineHash::from_bytes(b"digest")],
                parent_block_hash: Some(EngineHash::from_int(3)),
                token_ids: (0..8).collect(),
                block_size: 4,
                lora_id: Some(9),
            })
        );
        assert_eq!(
            to_index_event(WireEvent::BlockRemoved(BlockRemoved::new(vec![
                WireHash::Int(3)
            ]))),
            Ok(KvEvent::BlockRemoved {
                block_hashes: vec![EngineHash::from_int(3)]
            })
        );
        assert_eq!(
            to_index_event(WireEvent::AllBlocksCleared),
            Ok(KvEvent::AllBlocksCleared)
        );
    }

    #[test]
    fn other_media_and_groups_are_skipped() {
        let mut removed = BlockRemoved::new(vec![WireHash::Int(1)]);
        removed.medium = Some("CPU".to_owned());
        assert_eq!(
            to_index_event(WireEvent::BlockRemoved(removed.clone())),
            Err(Skipped::OtherMedium)
        );
        // The tiered form keeps it, named by its tier.
        for (medium, tier) in [
            ("CPU", Tier::Host),
            ("cpu_pinned", Tier::Host),
            ("Disk", Tier::Disk),
            ("MooncakeStore", Tier::External),
            ("gpu", Tier::Device),
        ] {
            removed.medium = Some(medium.to_owned());
            let (got, event) = to_tiered_event(WireEvent::BlockRemoved(removed.clone())).unwrap();
            assert_eq!(got, tier, "{medium}");
            assert_eq!(
                event,
                KvEvent::BlockRemoved {
                    block_hashes: vec![EngineHash::from_int(1)]
                }
            );
        }
        removed.medium = None;
        removed.group_idx = Some(1);
        assert_eq!(
            to_tiered_event(WireEvent::BlockRemoved(removed.clone())),
            Err(Skipped::OtherGroup)
        );
        assert_eq!(
            to_index_event(WireEvent::BlockRemoved(removed)),
            Err(Skipped::OtherGroup)
        );
    }
}
