//! The index's public vocabulary: worker and holder ids, settings, the
//! events a stream applies, errors, and what applying and accounting
//! report.
//!
//! These are the types a caller names; they hold no shared memory and no
//! unsafe code, so they live apart from the writer and reader that carry
//! the concurrency protocol, and read as the crate's interface at a glance.

use std::num::NonZeroUsize;

use crate::hash::EngineHash;

// Only the docs name the index itself.
#[cfg(doc)]
use super::KvIndex;

/// A worker as the index knows it: a small integer handed out by
/// [`KvIndex::register_worker`]. Ids are not reused within one index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub(super) u32);

impl WorkerId {
    /// The id as an integer (dense, from zero).
    pub fn get(self) -> u32 {
        self.0
    }
}

/// Who holds a block: a worker's data-parallel rank (0 without data
/// parallelism). Each (worker, rank) has its own KV cache and event stream.
///
/// A rank's blocks in a lower cache tier (host memory, disk, an external
/// store: vLLM's `medium` other than `"GPU"`) are a holder of their own,
/// whose `rank` carries the tier in its top bits ([`Holder::tiered`]):
/// the index keeps them apart from the device cache without knowing tiers,
/// and a lookup reports each tier's prefix separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank, with the [`Tier`] in the top bits for a
    /// lower tier (see [`Holder::tiered`]).
    pub rank: u32,
}

/// Where a holder's blocks live: the engine's device cache, or a lower
/// tier it can load them back from instead of computing them (vLLM's
/// `medium` field of `BlockStored` / `BlockRemoved`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// The device (GPU) cache: medium `"GPU"` or none.
    Device = 0,
    /// Host memory: medium `"CPU"`, `"CPU_PINNED"` or `"HOST"` (vLLM's
    /// offloading connector, LMCache's local CPU backend).
    Host = 1,
    /// Local disk: medium `"DISK"`, `"LOCAL_DISK"`, `"SSD"` or `"NVME"`.
    Disk = 2,
    /// Any other medium: a store outside the engine (a connector's remote
    /// or shared store).
    External = 3,
}

impl Tier {
    /// The lower tiers, cheapest to load from first.
    pub const LOWER: [Tier; 3] = [Tier::Host, Tier::Disk, Tier::External];

    /// The tier of an event's `medium` (case-insensitive; none is the
    /// device).
    pub fn of_medium(medium: Option<&str>) -> Tier {
        let Some(medium) = medium else {
            return Tier::Device;
        };
        let is = |name: &str| medium.eq_ignore_ascii_case(name);
        if is("GPU") {
            Tier::Device
        } else if is("CPU") || is("CPU_PINNED") || is("HOST") {
            Tier::Host
        } else if is("DISK") || is("LOCAL_DISK") || is("SSD") || is("NVME") {
            Tier::Disk
        } else {
            Tier::External
        }
    }
}

/// Bits of [`Holder::rank`] below the tier.
const TIER_SHIFT: u32 = 30;

impl Holder {
    /// The holder of `rank`'s blocks in `tier`: the rank itself for the
    /// device cache, the rank with the tier in its top two bits otherwise.
    /// Ranks must be below 2^30 (data-parallel sizes are far smaller).
    pub fn tiered(worker: WorkerId, rank: u32, tier: Tier) -> Holder {
        Holder {
            worker,
            rank: Holder::tiered_rank(rank, tier),
        }
    }

    /// The `rank` a stream of `rank`'s blocks in `tier` is opened with
    /// ([`KvIndex::stream`]).
    pub fn tiered_rank(rank: u32, tier: Tier) -> u32 {
        (rank & ((1 << TIER_SHIFT) - 1)) | ((tier as u32) << TIER_SHIFT)
    }

    /// The cache tier of this holder's blocks.
    pub fn tier(&self) -> Tier {
        match self.rank >> TIER_SHIFT {
            0 => Tier::Device,
            1 => Tier::Host,
            2 => Tier::Disk,
            _ => Tier::External,
        }
    }

    /// The data-parallel rank, without the tier.
    pub fn data_parallel_rank(&self) -> u32 {
        self.rank & ((1 << TIER_SHIFT) - 1)
    }
}

/// Settings of a [`KvIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block; must match the engines' `block_size`. Default 16.
    pub block_size: usize,
    /// Most (worker, rank) streams that may hold blocks at once. Default
    /// 65,536. Lookups keep a bitset of this many bits at most.
    pub max_holders: u32,
    /// Most blocks one (worker, rank) stream may hold in the index unless
    /// [`KvIndex::set_worker_capacity`] sets its worker's own cap; beyond
    /// it the stream's oldest blocks are dropped (see the [module
    /// docs](crate::index#bounds-a-cap-per-holder)). Default
    /// [`DEFAULT_MAX_BLOCKS_PER_HOLDER`].
    pub max_blocks_per_holder: NonZeroUsize,
}

/// The default [`IndexConfig::max_blocks_per_holder`]: 2^20 = 1,048,576
/// blocks, more than an H100 (80 GB) holds of the smallest common models.
/// Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 dims x 2 (K and V) x 2 bytes
/// = 12 KiB per token, 192 KiB per 16-token block; vLLM's default 90% of
/// 80 GiB, less about 2 GiB of weights and activations, leaves about 70
/// GiB: some 380,000 blocks, 760,000 with an 8-bit KV cache. Larger models
/// hold far fewer (Llama-3.1-8B: 128 KiB per token, about 28,000 blocks).
/// A GPU with more memory can exceed it with a tiny model: an engine whose
/// `num_gpu_blocks` is known should get exactly that
/// ([`KvIndex::set_worker_capacity`]).
pub const DEFAULT_MAX_BLOCKS_PER_HOLDER: NonZeroUsize = match NonZeroUsize::new(1 << 20) {
    Some(n) => n,
    None => unreachable!(),
};

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            max_holders: 1 << 16,
            max_blocks_per_holder: DEFAULT_MAX_BLOCKS_PER_HOLDER,
        }
    }
}

/// A KV-cache event of one (worker, rank) stream, as the engine sent it,
/// with engine hashes made opaque ([`EngineHash`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// vLLM's `BlockStored`: new full blocks, in order, each the child of
    /// the one before; the first is the child of `parent_block_hash`.
    BlockStored {
        /// The engine's hashes of the stored blocks.
        block_hashes: Vec<EngineHash>,
        /// The engine's hash of the first block's parent (`None`: the
        /// blocks start a prompt).
        parent_block_hash: Option<EngineHash>,
        /// The blocks' token ids: `block_hashes.len() * block_size` of them.
        token_ids: Vec<u32>,
        /// Tokens per block, as the engine reports it.
        block_size: usize,
        /// The LoRA adapter the blocks were computed with (`None`: none).
        lora_id: Option<u64>,
    },
    /// vLLM's `BlockRemoved`: blocks evicted from the cache.
    BlockRemoved {
        /// The engine's hashes of the removed blocks.
        block_hashes: Vec<EngineHash>,
    },
    /// vLLM's `AllBlocksCleared`: the stream's cache was reset.
    AllBlocksCleared,
}

/// Errors of the index's write side.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvIndexError {
    /// The worker id was never registered with this index, or was
    /// unregistered.
    #[error("worker {0:?} is not registered with this index")]
    UnknownWorker(WorkerId),
    /// Every holder slot ([`IndexConfig::max_holders`]) is taken by a live
    /// (worker, rank) stream.
    #[error("all {max} holder slots are in use")]
    HolderCapacity {
        /// The configured limit.
        max: u32,
    },
}

/// What applying one event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks recorded as held.
    pub stored: u64,
    /// Blocks no longer held.
    pub removed: u64,
    /// Stored blocks skipped because their parent is unknown to the stream.
    pub unknown_parent: u64,
    /// Removed engine hashes the stream did not know.
    pub unknown_removed: u64,
    /// Stored blocks skipped because the block size or token count did not
    /// match.
    pub malformed: u64,
    /// Engine blocks the stream held that were dropped because it held
    /// more than its cap (its oldest; their (block, holder) pairs are also
    /// in `removed`).
    pub evicted: u64,
}

/// Cumulative event counters of an index, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Events applied.
    pub events: u64,
    /// Blocks recorded as held.
    pub stored_blocks: u64,
    /// Blocks no longer held (removed, cleared or evicted over a cap).
    pub removed_blocks: u64,
    /// Stored blocks skipped: parent unknown to the stream.
    pub unknown_parent_blocks: u64,
    /// Removed engine hashes unknown to the stream.
    pub unknown_removed_blocks: u64,
    /// Stored blocks skipped: block size or token count mismatch.
    pub malformed_blocks: u64,
    /// `AllBlocksCleared` events and [`KvIndex::clear_worker`] calls.
    pub clears: u64,
    /// Engine blocks dropped because their stream held more than its cap
    /// (the stream's oldest; see [`KvIndex::set_worker_capacity`]).
    pub evicted_blocks: u64,
}

/// Memory and entries of one (worker, rank) stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderStats {
    /// The stream.
    pub holder: Holder,
    /// Engine blocks it holds (entries of its translation map).
    pub blocks: usize,
    /// Bytes of its translation map and eviction order (the shared index
    /// is counted once, in [`IndexStats::index_bytes`]).
    pub bytes: usize,
    /// Most engine blocks it may hold (its worker's cap).
    pub capacity: usize,
    /// Engine blocks dropped because it held more than its cap.
    pub evicted: u64,
}

/// Memory accounting of an index: a plain struct for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks (our hashes) held by at least one stream.
    pub blocks: usize,
    /// (block, holder) pairs.
    pub pairs: usize,
    /// Bytes of the shared index: chains (hash buffers, segments, holder
    /// sets), the head table, the chain directory and the writer's copies
    /// of them, and the holder slot table.
    pub index_bytes: usize,
    /// Bytes of all streams' translation maps and eviction orders.
    pub translation_bytes: usize,
    /// Per stream, ordered by holder.
    pub holders: Vec<HolderStats>,
    /// Event counters.
    pub counters: EventCounters,
}

impl IndexStats {
    /// All bytes: index plus translation maps.
    pub fn total_bytes(&self) -> usize {
        self.index_bytes + self.translation_bytes
    }

    /// Total bytes per (block, holder) pair (0 when empty).
    pub fn bytes_per_pair(&self) -> f64 {
        if self.pairs == 0 {
            0.0
        } else {
            self.total_bytes() as f64 / self.pairs as f64
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_tiered_holder_keeps_its_rank_and_tier_apart_from_the_device_one() {
        let worker = WorkerId(3);
        let device = Holder { worker, rank: 5 };
        assert_eq!(device.tier(), Tier::Device);
        assert_eq!(Holder::tiered(worker, 5, Tier::Device), device);
        for tier in Tier::LOWER {
            let holder = Holder::tiered(worker, 5, tier);
            assert_ne!(holder, device);
            assert_eq!(holder.tier(), tier);
            assert_eq!(holder.data_parallel_rank(), 5);
            assert_eq!(holder.worker, worker);
        }
        let high = Holder::tiered(worker, (1 << 30) - 1, Tier::External);
        assert_eq!(high.data_parallel_rank(), (1 << 30) - 1);
        assert_eq!(high.tier(), Tier::External);
    }

    #[test]
    fn media_map_to_tiers_case_insensitively() {
        for (medium, tier) in [
            (None, Tier::Device),
            (Some("GPU"), Tier::Device),
            (Some("gpu"), Tier::Device),
            (Some("CPU"), Tier::Host),
            (Some("Cpu_Pinned"), Tier::Host),
            (Some("host"), Tier::Host),
            (Some("DISK"), Tier::Disk),
            (Some("local_disk"), Tier::Disk),
            (Some("nvme"), Tier::Disk),
            (Some("LMCACHE_REMOTE"), Tier::External),
            (Some(""), Tier::External),
        ] {
            assert_eq!(Tier::of_medium(medium), tier, "{medium:?}");
        }
    }
}
