//! Bitsets over plain `u64` words, the two the index keeps.
//!
//! - **Holders by slot**: a lookup's live holders, one bit per holder slot,
//!   so entering a chain intersects the live set with the chain's first
//!   holder set a word at a time, and a holder that leaves costs one bit.
//!   The words are the lookup's own scratch (all zero between lookups),
//!   never shared, so they need no atomics.
//! - **Heads by hash**: the writer's filter in front of the head table, a
//!   bit per possible first block of a chain: a clear bit answers "no chain
//!   starts here" without a probe. The writer's alone, under its lock.
//!
//! They are apart from the reader and the writer because both are plain
//! word arithmetic with no part in the memory protocol.

/// Sets `slot`'s bit, growing the set to hold it.
#[inline]
pub(super) fn bit_set(bits: &mut Vec<u64>, slot: u32) {
    let w = (slot / 64) as usize;
    if w >= bits.len() {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (slot % 64);
}

/// Clears `slot`'s bit (a slot past the set is already clear).
#[inline]
pub(super) fn bit_clear(bits: &mut [u64], slot: u32) {
    if let Some(w) = bits.get_mut((slot / 64) as usize) {
        *w &= !(1 << (slot % 64));
    }
}

/// Whether `slot`'s bit is set.
#[inline]
pub(super) fn bit_get(bits: &[u64], slot: u32) -> bool {
    bits.get((slot / 64) as usize)
        .is_some_and(|w| w & (1 << (slot % 64)) != 0)
}

/// Words of the head bitset for a head table of `capacity` slots: eight
/// bits per slot, so at most 3/32 of the bits are set.
pub(super) fn head_bits_words(capacity: usize) -> usize {
    (capacity / 8).max(1)
}

/// The word and mask of `key`'s bit.
#[inline]
fn head_bit_index(bits: &[u64], key: u64) -> (usize, u64) {
    // The table probes from the low bits; take the high ones here.
    let bit = (key >> 32) as usize % (bits.len() * 64);
    (bit / 64, 1 << (bit % 64))
}

/// Marks `key` as a possible head.
#[inline]
pub(super) fn set_head_bit(bits: &mut [u64], key: u64) {
    let (word, mask) = head_bit_index(bits, key);
    bits[word] |= mask;
}

/// Whether `key` may be a head (clear: it is not).
#[inline]
pub(super) fn head_bit(bits: &[u64], key: u64) -> bool {
    let (word, mask) = head_bit_index(bits, key);
    bits[word] & mask != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_bits_grow_on_set_and_ignore_slots_past_the_end() {
        let mut bits = Vec::new();
        bit_set(&mut bits, 130);
        assert_eq!(bits.len(), 3);
        assert!(bit_get(&bits, 130));
        assert!(!bit_get(&bits, 129));
        assert!(!bit_get(&bits, 4_000));
        bit_clear(&mut bits, 4_000);
        bit_clear(&mut bits, 130);
        assert!(bits.iter().all(|&w| w == 0));
    }

    #[test]
    fn head_bits_keep_every_key_set() {
        let mut bits = vec![0; head_bits_words(64)];
        let keys: Vec<u64> = (1..=40u64)
            .map(|k| k.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        for &key in &keys {
            set_head_bit(&mut bits, key);
        }
        assert!(keys.iter().all(|&key| head_bit(&bits, key)));
    }
}
