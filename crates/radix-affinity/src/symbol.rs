//! Symbols (what a tree is keyed by) and their compact storage units.
//!
//! Labels are stored as *units*: UTF-8 bytes for `char` (so ASCII text costs one
//! byte per character, not four) and the values themselves for `u32` token ids.
//! Every edge label starts and ends on a symbol boundary, so matching never
//! splits a Unicode scalar value.

use std::fmt::Debug;

pub(crate) mod sealed {
    use std::fmt::Debug;

    /// Storage unit of a label. Implemented for `u8` (UTF-8) and `u32`.
    pub trait Unit: Copy + Eq + Debug + Send + Sync + 'static {
        /// Some value, to initialize scratch buffers.
        const ZERO: Self;
        /// Key (the first symbol, as a number) of a non-empty unit sequence that
        /// starts on a symbol boundary.
        fn key(units: &[Self]) -> u32;
        /// The largest symbol boundary `<= n` in `units`.
        fn floor_boundary(units: &[Self], n: usize) -> usize;
        /// Number of symbols in `units`.
        fn count_symbols(units: &[Self]) -> usize;
        /// Length of the common prefix of `a` and `b`, in units.
        fn common_prefix(a: &[Self], b: &[Self]) -> usize;
        /// The symbols of `units` (which start and end on symbol
        /// boundaries) as numbers.
        fn symbols(units: &[Self]) -> Vec<u32>;
    }

    /// Prevents implementations of [`Symbol`](super::Symbol) outside this crate.
    pub trait Sealed {}
}

pub(crate) use sealed::Unit;

/// A symbol type a [`RadixTree`](crate::RadixTree) can be keyed by: `char` for
/// text and `u32` for token ids.
///
/// The trait is sealed: its methods describe the compact storage of labels,
/// which the tree relies on for correctness.
pub trait Symbol: sealed::Sealed + Copy + Eq + Debug + Send + Sync + 'static {
    /// Storage unit of labels made of this symbol.
    #[doc(hidden)]
    type Unit: Unit;

    /// The symbols viewed directly as storage units, when they are the same.
    #[doc(hidden)]
    fn as_units(symbols: &[Self]) -> Option<&[Self::Unit]>;

    /// Encodes one symbol into `buf`, returning the number of units written.
    #[doc(hidden)]
    fn encode(self, buf: &mut [Self::Unit; 4]) -> usize;

    /// The symbol as a number (its child key).
    #[doc(hidden)]
    fn key(self) -> u32;
}

impl sealed::Sealed for char {}
impl sealed::Sealed for u32 {}

impl Symbol for char {
    type Unit = u8;

    fn as_units(_symbols: &[Self]) -> Option<&[u8]> {
        None
    }

    fn encode(self, buf: &mut [u8; 4]) -> usize {
        self.encode_utf8(buf).len()
    }

    fn key(self) -> u32 {
        self as u32
    }
}

impl Symbol for u32 {
    type Unit = u32;

    fn as_units(symbols: &[Self]) -> Option<&[u32]> {
        Some(symbols)
    }

    fn encode(self, buf: &mut [u32; 4]) -> usize {
        buf[0] = self;
        1
    }

    fn key(self) -> u32 {
        self
    }
}

#[inline]
fn is_utf8_continuation(byte: u8) -> bool {
    (byte as i8) < -64
}

impl Unit for u8 {
    const ZERO: u8 = 0;

    fn symbols(units: &[u8]) -> Vec<u32> {
        String::from_utf8_lossy(units)
            .chars()
            .map(u32::from)
            .collect()
    }

    #[inline]
    fn key(units: &[u8]) -> u32 {
        // Decodes the first scalar value of valid UTF-8 (labels are only ever
        // cut on boundaries of valid text).
        let b0 = units[0] as u32;
        let cont = |i: usize| units.get(i).map_or(0, |b| (*b as u32) & 0x3F);
        if b0 < 0x80 {
            b0
        } else if b0 < 0xE0 {
            ((b0 & 0x1F) << 6) | cont(1)
        } else if b0 < 0xF0 {
            ((b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2)
        } else {
            ((b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3)
        }
    }

    #[inline]
    fn floor_boundary(units: &[u8], mut n: usize) -> usize {
        while n > 0 && n < units.len() && is_utf8_continuation(units[n]) {
            n -= 1;
        }
        n
    }

    #[inline]
    fn count_symbols(units: &[u8]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if units.len() >= 256 && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above; the check is
            // a cached load).
            return unsafe { count_utf8_avx2(units) };
        }
        count_utf8(units)
    }

    #[inline]
    fn common_prefix(a: &[u8], b: &[u8]) -> usize {
        let len = a.len().min(b.len());
        let (a, b) = (&a[..len], &b[..len]);
        // Fast path: the whole shorter side matches (one bcmp), the common case
        // for a long label such as a system prompt.
        if a == b {
            return len;
        }
        let mut i = 0;
        while i + 8 <= len {
            let x = u64::from_le_bytes(a[i..i + 8].try_into().unwrap_or([0; 8]));
            let y = u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
            let diff = x ^ y;
            if diff != 0 {
                return i + (diff.trailing_zeros() / 8) as usize;
            }
            i += 8;
        }
        while i < len && a[i] == b[i] {
            i += 1;
        }
        i
    }
}

impl Unit for u32 {
    const ZERO: u32 = 0;

    fn symbols(units: &[u32]) -> Vec<u32> {
        units.to_vec()
    }

    #[inline]
    fn key(units: &[u32]) -> u32 {
        units[0]
    }

    #[inline]
    fn floor_boundary(_units: &[u32], n: usize) -> usize {
        n
    }

    #[inline]
    fn count_symbols(units: &[u32]) -> usize {
        units.len()
    }

    #[inline]
    fn common_prefix(a: &[u32], b: &[u32]) -> usize {
        let len = a.len().min(b.len());
        if a[..len] == b[..len] {
            return len;
        }
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }
}

/// Scalar values in valid UTF-8: every byte that is not a continuation byte
/// starts one. Blocks of 128 are summed in u8 lanes (no overflow), which LLVM
/// turns into compare + subtract per vector and one horizontal add per block.
#[inline(always)]
fn count_utf8(units: &[u8]) -> usize {
    units
        .chunks(128)
        .map(|block| {
            let starts = block
                .iter()
                .map(|&b| u8::from(!is_utf8_continuation(b)))
                .fold(0u8, u8::wrapping_add);
            usize::from(starts)
        })
        .sum()
}

/// [`count_utf8`] compiled for 32-byte vectors (about 20 % faster on long
/// inputs; lookups count the unmatched tail of every request).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn count_utf8_avx2(units: &[u8]) -> usize {
    count_utf8(units)
}

/// One step of a walk: how far the probe advanced along one edge label.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    /// Positions consumed in the probe's own indexing.
    pub(crate) advance: usize,
    /// Units of the label matched (a symbol boundary).
    pub(crate) label_units: usize,
    /// Symbols matched.
    pub(crate) symbols: usize,
}

/// The input of a walk: either already-encoded units (`&str` bytes, token ids)
/// or symbols that are encoded on the fly (`&[char]`), so lookups never
/// allocate.
pub(crate) trait Probe<U: Unit> {
    fn at_end(&self, pos: usize) -> bool;
    fn key_at(&self, pos: usize) -> u32;
    fn match_label(&self, pos: usize, label: &[U], label_symbols: usize) -> Step;
    /// Appends the rest of the input from `pos` (at most about `max_units`
    /// units, cut on a symbol boundary) to `out`.
    fn take_rest(&self, pos: usize, max_units: usize, out: &mut Vec<U>) -> Step;
    /// Symbols from `pos` to the end.
    fn count_rest(&self, pos: usize) -> usize;
    /// The rest of the input after `units` (`symbols` symbols), when the
    /// input begins with them and goes on past them.
    fn after(&self, units: &[U], symbols: usize) -> Option<Self>
    where
        Self: Sized;
}

/// A probe over encoded units.
pub(crate) struct UnitProbe<'a, U>(pub(crate) &'a [U]);

impl<U: Unit> Probe<U> for UnitProbe<'_, U> {
    #[inline]
    fn at_end(&self, pos: usize) -> bool {
        pos >= self.0.len()
    }

    #[inline]
    fn key_at(&self, pos: usize) -> u32 {
        U::key(&self.0[pos..])
    }

    #[inline]
    fn match_label(&self, pos: usize, label: &[U], label_symbols: usize) -> Step {
        let rest = &self.0[pos..];
        let n = U::common_prefix(label, rest);
        if n == label.len() {
            return Step {
                advance: n,
                label_units: n,
                symbols: label_symbols,
            };
        }
        // When the input ended inside the label, `n` is the end of a whole
        // input symbol, hence a boundary; otherwise back up to one.
        let n = if n == rest.len() {
            n
        } else {
            U::floor_boundary(label, n)
        };
        Step {
            advance: n,
            label_units: n,
            symbols: U::count_symbols(&label[..n]),
        }
    }

    #[inline]
    fn count_rest(&self, pos: usize) -> usize {
        U::count_symbols(self.0.get(pos..).unwrap_or(&[]))
    }

    fn take_rest(&self, pos: usize, max_units: usize, out: &mut Vec<U>) -> Step {
        let rest = &self.0[pos..];
        let n = if rest.len() <= max_units {
            rest.len()
        } else {
            U::floor_boundary(rest, max_units)
        };
        out.extend_from_slice(&rest[..n]);
        Step {
            advance: n,
            label_units: n,
            symbols: U::count_symbols(&rest[..n]),
        }
    }

    #[inline]
    fn after(&self, units: &[U], _symbols: usize) -> Option<Self> {
        (self.0.len() > units.len() && self.0.starts_with(units))
            .then(|| UnitProbe(&self.0[units.len()..]))
    }
}

/// A probe over symbols that are not stored as themselves (`char`).
pub(crate) struct SymbolProbe<'a, S>(pub(crate) &'a [S]);

impl<S: Symbol> Probe<S::Unit> for SymbolProbe<'_, S> {
    #[inline]
    fn at_end(&self, pos: usize) -> bool {
        pos >= self.0.len()
    }

    #[inline]
    fn key_at(&self, pos: usize) -> u32 {
        self.0[pos].key()
    }

    fn match_label(&self, pos: usize, label: &[S::Unit], _label_symbols: usize) -> Step {
        let mut buf = [<S::Unit as Unit>::ZERO; 4];
        let mut label_pos = 0;
        let mut i = pos;
        while i < self.0.len() && label_pos < label.len() {
            let len = self.0[i].encode(&mut buf);
            if label[label_pos..].starts_with(&buf[..len]) {
                label_pos += len;
                i += 1;
            } else {
                break;
            }
        }
        Step {
            advance: i - pos,
            label_units: label_pos,
            symbols: i - pos,
        }
    }

    #[inline]
    fn count_rest(&self, pos: usize) -> usize {
        self.0.len().saturating_sub(pos)
    }

    fn take_rest(&self, pos: usize, max_units: usize, out: &mut Vec<S::Unit>) -> Step {
        let mut buf = [<S::Unit as Unit>::ZERO; 4];
        let start = out.len();
        let mut i = pos;
        while i < self.0.len() && out.len() - start < max_units.max(1) {
            let len = self.0[i].encode(&mut buf);
            out.extend_from_slice(&buf[..len]);
            i += 1;
        }
        Step {
            advance: i - pos,
            label_units: out.len() - start,
            symbols: i - pos,
        }
    }

    fn after(&self, units: &[S::Unit], symbols: usize) -> Option<Self> {
        if self.0.len() <= symbols {
            return None;
        }
        let step = self.match_label(0, units, symbols);
        (step.label_units == units.len() && step.advance == symbols)
            .then(|| SymbolProbe(&self.0[symbols..]))
    }
}

impl<S: Debug> Debug for SymbolProbe<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SymbolProbe").field(&self.0).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts() -> Vec<String> {
        let pieces = ["a", "é", "一", "😀", "bc", "丁"];
        let mut out = vec![String::new()];
        let mut state = 7u64;
        for len in [1usize, 7, 8, 9, 63, 64, 65, 130, 300] {
            let mut s = String::new();
            while s.chars().count() < len {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                s.push_str(pieces[(state >> 33) as usize % pieces.len()]);
            }
            out.push(s);
        }
        out
    }

    #[test]
    fn utf8_count_matches_std() {
        for s in texts() {
            for start in s.char_indices().map(|(i, _)| i).take(9) {
                let tail = &s[start..];
                assert_eq!(
                    u8::count_symbols(tail.as_bytes()),
                    tail.chars().count(),
                    "{tail:?}"
                );
            }
        }
    }

    #[test]
    fn utf8_common_prefix_and_boundary() {
        for a in texts() {
            for b in texts() {
                let naive = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
                assert_eq!(u8::common_prefix(a.as_bytes(), b.as_bytes()), naive);
                let boundary = u8::floor_boundary(a.as_bytes(), naive);
                assert!(a.is_char_boundary(boundary), "{a:?} {naive}");
                assert!(boundary <= naive && naive - boundary < 4);
            }
        }
        let a = "x一y".as_bytes();
        let b = "x丁y".as_bytes();
        assert_eq!(u8::common_prefix(a, b), 3);
        assert_eq!(u8::floor_boundary(a, 3), 1);
    }

    #[test]
    fn utf8_key_decodes_first_scalar() {
        for c in ['a', 'é', '一', '😀', '\u{10FFFF}'] {
            let mut buf = [0; 4];
            assert_eq!(u8::key(c.encode_utf8(&mut buf).as_bytes()), c as u32);
        }
    }

    #[test]
    fn token_common_prefix() {
        assert_eq!(u32::common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(u32::common_prefix(&[1, 2], &[1, 2, 4]), 2);
        assert_eq!(u32::count_symbols(&[9, 9, 9]), 3);
    }
}
