//! The index's own block hash, and the opaque engine hash.
//!
//! # Our block hash (stable)
//!
//! A block is `block_size` consecutive token ids; only full blocks are
//! hashed. Block `i` of a prompt hashes to `H(hash_{i-1}, tokens of block
//! i)`, where `hash_{-1}` is the chain's root (from the block size and an
//! optional LoRA id, see [`BlockHasher::with_lora`]). Equal hashes therefore
//! mean equal prefixes, not just equal blocks.
//!
//! `H` feeds the block's token ids, two per 64-bit word, through two
//! independent lanes of folded multiplies (a 64×64→128-bit multiply whose
//! halves are xored, the mixing step of foldhash and wyhash), then folds the
//! lanes together with the parent hash and the block length. Two lanes keep
//! the multiplier busy: a 16-token block costs about three multiply
//! latencies. The function uses only integer arithmetic on the token
//! *values* (never their byte order), so every process on every machine and
//! every router replica computes the same hashes; the router does not depend
//! on the engine's hash function or on its `PYTHONHASHSEED`.
//!
//! **Stability:** the output of [`BlockHasher::hash_blocks`] for a given
//! block size, LoRA id and token ids is part of this crate's public contract
//! and changes only with a new major version. It is a fast non-cryptographic
//! hash: collisions are astronomically unlikely for real prompts, but a
//! client that picks token ids adversarially could aim for one; the only
//! effect would be a misjudged cache hit for routing.
//!
//! Hashes are never zero (the index uses zero as its empty-slot marker).

/// Our hash of a block and the whole prefix before it (see the module docs).
/// Never zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct BlockHash(pub u64);

/// An engine's own hash of a block, as its KV events name it.
///
/// vLLM's `ExternalBlockHash` is `bytes | int` (bytes with its `sha256`
/// hash functions, an int with the builtin one). The index treats it as an
/// opaque 64-bit token: [`EngineHash::from_int`] mixes an integer through a
/// bijection (distinct ints stay distinct), [`EngineHash::from_bytes`] folds
/// any byte string to 64 bits. The value is only compared with other hashes
/// of the same worker stream, so a fold collision would need two live
/// blocks of one engine to collide in 64 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// The hash an engine sent as an integer (vLLM's builtin hash; Python
    /// ints beyond 64 bits should be passed as their little-endian bytes to
    /// [`EngineHash::from_bytes`]). Distinct integers give distinct hashes.
    pub fn from_int(value: i64) -> Self {
        Self(mix64(value as u64))
    }

    /// The hash an engine sent as bytes (vLLM's `sha256` block hashes),
    /// folded to 64 bits.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut acc = K[4] ^ bytes.len() as u64;
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            acc = folded_multiply(acc ^ u64::from_le_bytes(word), K[5]);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            acc = folded_multiply(acc ^ u64::from_le_bytes(word), K[5]);
        }
        Self(mix64(acc))
    }
}

/// Mixing constants: odd 64-bit values whose 32-bit halves are all far above
/// any vocabulary's token ids (digits of pi).
const K: [u64; 8] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
    0x4528_21e6_38d0_1377,
    0xbe54_66cf_34e9_0c6c,
    0xc0ac_29b7_c97c_50dd,
    0x3f84_d5b5_b547_0917,
];

#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

/// A bijective 64-bit finalizer (SplitMix64's).
///
/// A copy on purpose: this crate depends on neither crate that has a
/// SplitMix64 (radix-affinity's `workload`, worker-lifecycle's `rng`), and
/// one mix step is no reason for a dependency edge.
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[inline(always)]
fn word(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// `H(parent, tokens)`: the hash of one block given its parent's hash.
#[inline]
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut a = parent ^ K[0];
    let mut b = parent.rotate_left(32) ^ K[1];
    let mut eights = tokens.chunks_exact(8);
    for t in &mut eights {
        a = folded_multiply(a ^ word(t[0], t[1]), word(t[2], t[3]) ^ K[2]);
        b = folded_multiply(b ^ word(t[4], t[5]), word(t[6], t[7]) ^ K[3]);
    }
    let rest = eights.remainder();
    if !rest.is_empty() {
        let mut t = [0u32; 8];
        t[..rest.len()].copy_from_slice(rest);
        a = folded_multiply(a ^ word(t[0], t[1]), word(t[2], t[3]) ^ K[2]);
        b = folded_multiply(b ^ word(t[4], t[5]), word(t[6], t[7]) ^ K[3]);
    }
    let h = folded_multiply(a ^ K[6] ^ tokens.len() as u64, b ^ K[7]);
    // Zero marks an empty slot of the index.
    h.max(1)
}

/// Computes our block hashes of token ids, for one block size and LoRA
/// adapter. Cheap to copy; the index hands out one with its block size
/// ([`crate::KvIndex::hasher`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    root: u64,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens (vLLM's default is 16),
    /// without a LoRA adapter. A block size of zero is treated as one.
    pub fn new(block_size: usize) -> Self {
        let block_size = block_size.max(1);
        Self {
            block_size,
            root: Self::root_of(block_size, None),
        }
    }

    /// The same hasher for prompts run with LoRA adapter `lora_id` (`None`:
    /// the base model). KV computed under an adapter differs from the base
    /// model's, so the adapter seeds the chain: the same tokens under two
    /// adapters never share blocks. Engines and the router must agree on the
    /// ids (vLLM's `lora_int_id`).
    pub fn with_lora(self, lora_id: Option<u64>) -> Self {
        Self {
            block_size: self.block_size,
            root: Self::root_of(self.block_size, lora_id),
        }
    }

    fn root_of(block_size: usize, lora_id: Option<u64>) -> u64 {
        let lora = lora_id.map_or(0, |id| mix64(id ^ K[6]) | 1);
        mix64(folded_multiply(K[4] ^ block_size as u64, K[5] ^ lora))
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The parent hash of a prompt's first block.
    pub fn root(&self) -> BlockHash {
        BlockHash(self.root)
    }

    /// The hash of the block of `tokens` that follows `parent`
    /// ([`BlockHasher::root`] for the first block). `tokens` is normally
    /// exactly one block.
    #[inline]
    pub fn next(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        BlockHash(block_hash(parent.0, tokens))
    }

    /// The hashes of every full block of `tokens`, in order, appended to
    /// `out` (cleared first). A trailing partial block is not hashed. This is
    /// the request path's call: about 1 µs per 100 blocks on one core.
    pub fn hash_blocks_into(&self, tokens: &[u32], out: &mut Vec<BlockHash>) {
        out.clear();
        self.chain_into(self.root(), tokens, out);
    }

    /// The hashes of every full block of `tokens`, in order.
    pub fn hash_blocks(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.chain_into(self.root(), tokens, &mut out);
        out
    }

    /// Chains from `parent` over the full blocks of `tokens`, appending to
    /// `out` without clearing it.
    pub(crate) fn chain_into(&self, parent: BlockHash, tokens: &[u32], out: &mut Vec<BlockHash>) {
        let mut h = parent.0;
        out.reserve(tokens.len() / self.block_size);
        for block in tokens.chunks_exact(self.block_size) {
            h = block_hash(h, block);
            out.push(BlockHash(h));
        }
    }
}

impl Default for BlockHasher {
    /// Blocks of 16 tokens, no LoRA adapter.
    fn default() -> Self {
        Self::new(16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_the_whole_prefix() {
        let h = BlockHasher::new(4);
        let a = h.hash_blocks(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let b = h.hash_blocks(&[9, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        // Same second block, different first block: different second hash.
        assert_ne!(a[1], b[1]);
        // A prefix hashes to a prefix of the hashes; a partial block is ignored.
        assert_eq!(h.hash_blocks(&[1, 2, 3, 4, 5, 6]), a[..1].to_vec());
        assert_eq!(h.next(h.root(), &[1, 2, 3, 4]), a[0]);
        assert_eq!(h.next(a[0], &[5, 6, 7, 8]), a[1]);
    }

    #[test]
    fn order_within_a_block_matters() {
        let h = BlockHasher::new(16);
        let tokens: Vec<u32> = (0..16).collect();
        let mut swapped = tokens.clone();
        swapped.swap(0, 15);
        let mut lanes = tokens.clone();
        // Swap the two lanes' words.
        lanes.swap(0, 4);
        lanes.swap(1, 5);
        assert_ne!(h.hash_blocks(&tokens), h.hash_blocks(&swapped));
        assert_ne!(h.hash_blocks(&tokens), h.hash_blocks(&lanes));
    }

    #[test]
    fn lora_and_block_size_seed_the_chain() {
        let tokens: Vec<u32> = (100..132).collect();
        let base = BlockHasher::new(16);
        assert_ne!(
            base.hash_blocks(&tokens),
            base.with_lora(Some(1)).hash_blocks(&tokens)
        );
        assert_ne!(
            base.with_lora(Some(1)).hash_blocks(&tokens),
            base.with_lora(Some(2)).hash_blocks(&tokens)
        );
        assert_eq!(base.with_lora(None), base);
        assert_ne!(BlockHasher::new(8).root(), base.root());
    }

    #[test]
    fn hashes_are_distinct_over_many_blocks() {
        let h = BlockHasher::new(16);
        let tokens: Vec<u32> = (0..16 * 4096).map(|i| (i % 7) as u32).collect();
        let hashes = h.hash_blocks(&tokens);
        let distinct: std::collections::HashSet<_> = hashes.iter().collect();
        assert_eq!(distinct.len(), hashes.len());
        assert!(hashes.iter().all(|b| b.0 != 0));
    }

    #[test]
    fn engine_hash_from_bytes_and_ints() {
        assert_ne!(EngineHash::from_int(1), EngineHash::from_int(2));
        assert_eq!(EngineHash::from_int(-7), EngineHash::from_int(-7));
        let a = EngineHash::from_bytes(&[1; 32]);
        let mut other = [1u8; 32];
        other[31] = 2;
        assert_ne!(a, EngineHash::from_bytes(&other));
        assert_ne!(
            EngineHash::from_bytes(&[0]),
            EngineHash::from_bytes(&[0, 0])
        );
    }
}
