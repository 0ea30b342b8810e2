//! A stable 64-bit hash for placing keys. Stable across processes and
//! platforms (unlike `std`'s randomly seeded hasher), so every router
//! instance places a session on the same worker.

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xbf58_476d_1ce4_e5b9;
const K2: u64 = 0x94d0_49bb_1331_11eb;

fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The SplitMix64 finalizer: a bijective avalanche mix.
///
/// A copy on purpose: radix-affinity's `workload::SplitMix64` (the
/// generator this is the output step of) exposes no finalizer, and the
/// placement of every key rests on these exact constants, so they stay
/// here beside the hash that every router replica must compute alike.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(K1);
    z = (z ^ (z >> 27)).wrapping_mul(K2);
    z ^ (z >> 31)
}

/// Hashes `bytes` with `seed`, eight bytes per multiply.
pub(crate) fn stable_hash(bytes: &[u8], seed: u64) -> u64 {
    let mut h = seed ^ K0.wrapping_mul(bytes.len() as u64 + 1);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        h = fold_mul(h ^ u64::from_le_bytes(word), K1);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut word = [0u8; 8];
        word[..tail.len()].copy_from_slice(tail);
        h = fold_mul(h ^ u64::from_le_bytes(word), K2);
    }
    mix64(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_inputs_and_seeds_give_distinct_hashes() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..2000u32 {
            let key = format!("http://worker-{i}:8000");
            assert!(seen.insert(stable_hash(key.as_bytes(), 0)));
            assert!(seen.insert(stable_hash(key.as_bytes(), 1)));
        }
        // Length is part of the hash: zero padding does not collide.
        assert_ne!(stable_hash(b"a", 0), stable_hash(b"a\0", 0));
    }

    #[test]
    fn hash_is_stable_across_releases() {
        // Pinned: changing the function would move every session between
        // router versions (and between routers of different versions).
        assert_eq!(stable_hash(b"", 0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(stable_hash(b"session-42", 0), 0x7c67_1a74_b229_f8c5);
        assert_eq!(
            stable_hash(b"http://worker-3:8000", 7),
            0xde66_759e_99d0_f6a0
        );
    }
}
