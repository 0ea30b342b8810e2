//! Injected randomness for jitter.
//!
//! Backoff jitter takes its randomness from a [`RandomSource`] handed in by
//! the caller, so that a test fixes the seed and asserts exact delays, and a
//! production caller can use any generator it likes (a closure returning
//! `u64` is one).

/// A source of uniformly distributed 64-bit values.
pub trait RandomSource {
    /// The next value.
    fn next_u64(&mut self) -> u64;

    /// A value uniformly distributed in `[0, 1)`.
    fn next_unit(&mut self) -> f64 {
        // The top 53 bits fill an f64 mantissa exactly.
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

impl<F: FnMut() -> u64> RandomSource for F {
    fn next_u64(&mut self) -> u64 {
        self()
    }
}

/// SplitMix64: a tiny, fast, seedable generator with good statistical
/// quality for jitter (not for cryptography).
///
/// The generator that the tests, benches and examples of the crates above
/// this one use for reproducible inputs. radix-affinity's
/// `workload::SplitMix64` is the same generator, kept there because the
/// benchmark's workload is specified on it and radix-affinity depends on
/// no other crate; for equal seeds the two give equal sequences.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`; equal seeds give equal sequences.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator seeded from the process's hasher randomness and the
    /// clock, for callers that want different jitter in every process.
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        Self::new(hasher.finish())
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_values_stay_in_range_and_seeds_repeat() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..1000 {
            let x = a.next_unit();
            assert!((0.0..1.0).contains(&x));
            assert_eq!(x, b.next_unit());
        }
        let mut zero = || 0u64;
        assert_eq!(zero.next_unit(), 0.0);
        let mut max = || u64::MAX;
        assert!(max.next_unit() < 1.0);
    }

    /// The first outputs for seed 1234567 of the reference implementation
    /// (Vigna's `splitmix64.c`): the copies elsewhere in the workspace are
    /// the same generator only while this holds.
    #[test]
    fn matches_the_reference_sequence() {
        let mut rng = SplitMix64::new(1_234_567);
        let first: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
        assert_eq!(
            first,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }
}
