//! The one conversion between vLLM's event format (kv-events) and the
//! block index's (kv-block-index).

use kv_block_index::{EngineHash, KvEvent};
use kv_events::{BlockHash as WireHash, KvEvent as WireEvent};

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
///
/// ```
/// use kv_event_bridge::{Skipped, to_index_event};
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
pub fn to_index_event(event: WireEvent) -> Result<KvEvent, Skipped> {
    let (medium, group) = match &event {
        WireEvent::BlockStored(e) => (e.medium.as_deref(), e.group_idx),
        WireEvent::BlockRemoved(e) => (e.medium.as_deref(), e.group_idx),
        WireEvent::AllBlocksCleared => (None, None),
    };
    if medium.is_some_and(|m| !m.eq_ignore_ascii_case("GPU")) {
        return Err(Skipped::OtherMedium);
    }
    if group.is_some_and(|g| g != 0) {
        return Err(Skipped::OtherGroup);
    }
    Ok(match event {
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
    })
}

fn engine_hash(hash: &WireHash) -> EngineHash {
    match hash {
        WireHash::Int(value) => EngineHash::from_int(*value as i64),
        WireHash::Bytes(bytes) => EngineHash::from_bytes(bytes),
    }
}
