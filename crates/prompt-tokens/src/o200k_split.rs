//! The o200k pre-tokenizer split ([`O200K_PATTERN`]): where each piece of
//! a text ends.
//!
//! Two ways to the same answer. The pattern itself runs on
//! `regex-automata`'s meta regex (a lazy DFA), without its one look-ahead
//! branch, which is applied by hand. Before it, a hand-written matcher
//! decides pieces made of ASCII alone — most of English prose, code and
//! JSON — by the pattern's own rules (below), and hands every piece whose
//! extent depends on a non-ASCII character to the regex. The regex's DFA
//! walks a state table per byte, and inside a busy router that table is
//! rarely in cache; the matcher classifies a byte with a `match`.
//!
//! # The pattern's branches, for ASCII
//!
//! The first branch that matches at a position wins, each with greedy
//! quantifiers and backtracking (the regex crate's leftmost-first
//! semantics, and fancy-regex's in tiktoken). With `U` = `A-Z`, `L` =
//! `a-z`, `N` = `0-9`, whitespace = `\t \n \x0b \x0c \r` and space (the
//! ASCII members of Unicode's `White_Space`, which `\s` is), and *other*
//! = every other ASCII character:
//!
//! 1. and 2. `[^\r\n\p{L}\p{N}]?` then letters: one optional character that
//!    is whitespace other than a newline or *other*, then `U*L+` (branch 1)
//!    or `U+L*` (branch 2). In ASCII the two sets are disjoint, so both
//!    come to: the run of uppercase letters then the run of lowercase ones,
//!    if there is at least one letter; then an optional contraction
//!    `'s 't 're 've 'm 'll 'd`, case-insensitive.
//! 3. `\p{N}{1,3}`: up to three digits.
//! 4. ` ?[^\s\p{L}\p{N}]+[\r\n/]*`: an optional space, a run of *other*,
//!    then any run of newlines and `/`.
//! 5. `\s*[\r\n]+`: a whitespace run up to and including its last newline.
//! 6. and 7. `\s+(?!\S)|\s+`: the whole whitespace run, shortened by its
//!    last character when that is not a newline, more text follows and the
//!    run is longer than one character (the look-ahead's effect, see
//!    [`O200kSplit::piece_end`]).
//!
//! Whenever one of these decisions needs the class of a non-ASCII
//! character (a letter run followed by `é`, digits followed by `٣`, an
//! apostrophe followed by `ſ`, which case-folds to `s`), the matcher
//! declines and the regex decides the piece. The unit tests compare both
//! ways on random texts mixing ASCII with such characters, and
//! `tests/o200k.rs` compares the ids with tiktoken's own encoder.

use regex_automata::util::pool::Pool;
use regex_automata::{Anchored, Input, meta};

use crate::tiktoken::O200K_PATTERN;

/// The branch of [`O200K_PATTERN`] that a finite automaton cannot run.
const LOOKAHEAD_BRANCH: &str = r"|\s+(?!\S)";

/// Makes a search cache for [`O200kSplit::regex`].
type CacheFn = Box<dyn Fn() -> meta::Cache + Send + Sync>;

/// The o200k split: the ASCII matcher, then the pattern's regex.
pub(crate) struct O200kSplit {
    /// [`O200K_PATTERN`] without [`LOOKAHEAD_BRANCH`], anchored.
    regex: meta::Regex,
    /// Search caches for `regex`: one is taken per text ([`Self::cache`]),
    /// not per piece (`regex::Regex::find` takes one from its pool on
    /// every call, and a thread other than the pool's first user pays for
    /// a lock each time).
    caches: Pool<meta::Cache, CacheFn>,
}

/// A search cache held for the pieces of one text.
pub(crate) type SplitCache<'a> = regex_automata::util::pool::PoolGuard<'a, meta::Cache, CacheFn>;

impl O200kSplit {
    pub(crate) fn new() -> Result<Self, String> {
        let pattern = O200K_PATTERN.replacen(LOOKAHEAD_BRANCH, "", 1);
        if pattern.len() == O200K_PATTERN.len() {
            return Err("o200k pattern: no look-ahead branch to take out".to_owned());
        }
        // Anchored, and searched from each piece's start on the rest of
        // the text: one forward scan per piece, no reverse scan to find
        // where a match starts (there is no text between pieces).
        let regex = meta::Regex::new(&format!("^(?:{pattern})"))
            .map_err(|e| format!("o200k pattern: {e}"))?;
        let for_caches = regex.clone();
        let caches: Pool<meta::Cache, CacheFn> =
            Pool::new(Box::new(move || for_caches.create_cache()));
        Ok(Self { regex, caches })
    }

    /// A search cache for the pieces of one text.
    pub(crate) fn cache(&self) -> SplitCache<'_> {
        self.caches.get()
    }

    /// Where the piece that starts at `at` (a character boundary before
    /// the end of `text`) ends.
    ///
    /// Without `\s+(?!\S)` a run of whitespace that no earlier branch
    /// takes is matched whole by the last branch, `\s+`; with it, such a
    /// run of two or more characters that is followed by more text stops
    /// one character short (that last space then starts the next piece, as
    /// in `" word"`). Such a match is the only one that ends in whitespace
    /// other than `\r` / `\n` (the newline branch ends in a newline, the
    /// others in non-space), so it is recognised by its last character and
    /// shortened here.
    ///
    /// The search cache is taken from the pool only when a piece needs the
    /// regex: a text of ASCII pieces (most prompts' segments) never touches
    /// the pool, which costs a lock for a thread other than its first user.
    pub(crate) fn piece_end<'a>(
        &'a self,
        cache: &mut Option<SplitCache<'a>>,
        text: &str,
        at: usize,
    ) -> usize {
        let end = match ascii_match_end(text.as_bytes(), at) {
            Some(end) => end,
            None => {
                let cache = cache.get_or_insert_with(|| self.cache());
                self.regex_match_end(cache, text, at)
            }
        };
        shorten_whitespace_run(text, at, end)
    }

    /// The regex's match at `at` alone (no ASCII matcher, no shortening).
    fn regex_match_end(&self, cache: &mut meta::Cache, text: &str, at: usize) -> usize {
        let rest = Input::new(&text[at..]).anchored(Anchored::Yes);
        let end = at + self.regex.search_with(cache, &rest).map_or(0, |m| m.end());
        if end > at {
            end
        } else {
            // Unreachable (no branch matches empty text, and every
            // character starts a match); one character then, rather than
            // a loop.
            at + text[at..].chars().next().map_or(1, char::len_utf8)
        }
    }
}

/// The look-ahead branch's effect on a match `at..end` (see
/// [`O200kSplit::piece_end`]).
fn shorten_whitespace_run(text: &str, at: usize, end: usize) -> usize {
    if end < text.len()
        && let Some(last) = text[at..end].chars().next_back()
        && last.is_whitespace()
        && last != '\r'
        && last != '\n'
        && end - at > last.len_utf8()
    {
        end - last.len_utf8()
    } else {
        end
    }
}

/// What the pattern's classes make of one byte.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Upper,
    Lower,
    Digit,
    /// `\r` or `\n`.
    Newline,
    /// Whitespace other than a newline.
    Space,
    /// Any other ASCII character.
    Other,
    /// A byte of a non-ASCII character: the matcher declines.
    NonAscii,
}

fn class(byte: u8) -> Class {
    match byte {
        b'A'..=b'Z' => Class::Upper,
        b'a'..=b'z' => Class::Lower,
        b'0'..=b'9' => Class::Digit,
        b'\r' | b'\n' => Class::Newline,
        b'\t' | 0x0b | 0x0c | b' ' => Class::Space,
        0x80.. => Class::NonAscii,
        _ => Class::Other,
    }
}

/// Why the matcher stopped: it decided (the match's end), or it declined.
type Decided = Option<usize>;

/// The end of the pattern's match at `at` (before the whitespace run's
/// shortening), or `None` when that depends on a non-ASCII character.
fn ascii_match_end(bytes: &[u8], at: usize) -> Decided {
    let class_at = |i: usize| bytes.get(i).map(|&b| class(b));
    let first = class_at(at)?;
    match first {
        Class::NonAscii => None,
        Class::Upper | Class::Lower => letters(bytes, at)?.or(Some(at + 1)),
        Class::Digit => {
            // Branch 3: up to three digits.
            let mut end = at;
            while end < at + 3 {
                match class_at(end) {
                    Some(Class::Digit) => end += 1,
                    Some(Class::NonAscii) => return None,
                    _ => break,
                }
            }
            Some(end)
        }
        Class::Other | Class::Space => {
            // Branches 1 and 2 with the optional first character.
            if let Some(end) = letters(bytes, at + 1)? {
                return Some(end);
            }
            // Branch 4: an optional space, then a run of other characters.
            let run_start = if bytes[at] == b' ' { at + 1 } else { at };
            let mut end = run_start;
            loop {
                match class_at(end) {
                    Some(Class::Other) => end += 1,
                    Some(Class::NonAscii) => return None,
                    _ => break,
                }
            }
            if end > run_start {
                // `[\r\n/]*`: a `/` after a newline belongs here too.
                while matches!(bytes.get(end), Some(b'\r' | b'\n' | b'/')) {
                    end += 1;
                }
                return Some(end);
            }
            whitespace(bytes, at)
        }
        Class::Newline => whitespace(bytes, at),
    }
}

/// Branches 1 and 2 from `start`: `Some(None)` when no letter is there,
/// `None` when a non-ASCII character decides.
fn letters(bytes: &[u8], start: usize) -> Option<Option<usize>> {
    let class_at = |i: usize| bytes.get(i).map(|&b| class(b));
    let mut end = start;
    while class_at(end) == Some(Class::Upper) {
        end += 1;
    }
    while class_at(end) == Some(Class::Lower) {
        end += 1;
    }
    if class_at(end) == Some(Class::NonAscii) {
        // A letter or a mark would extend the run.
        return None;
    }
    if end == start {
        return Some(None);
    }
    if bytes.get(end) != Some(&b'\'') {
        return Some(Some(end));
    }
    // The contraction, case-insensitive: 's 't 'm 'd, then 're 've 'll.
    let folded = |i: usize| match bytes.get(i) {
        Some(&b) if b >= 0x80 => Err(()),
        Some(&b) => Ok(Some(b.to_ascii_lowercase())),
        None => Ok(None),
    };
    let Ok(second) = folded(end + 1) else {
        // `ſ` folds to `s`: the regex decides.
        return None;
    };
    let third = match second {
        Some(b's' | b't' | b'm' | b'd') => return Some(Some(end + 2)),
        Some(b'r' | b'v') => b'e',
        Some(b'l') => b'l',
        _ => return Some(Some(end)),
    };
    match folded(end + 2) {
        Err(()) => None,
        Ok(Some(b)) if b == third => Some(Some(end + 3)),
        Ok(_) => Some(Some(end)),
    }
}

/// Branches 5 to 7 at `at` (whitespace): up to the run's last newline,
/// else the whole run.
fn whitespace(bytes: &[u8], at: usize) -> Decided {
    let mut end = at;
    let mut after_last_newline = None;
    loop {
        match bytes.get(end).map(|&b| class(b)) {
            Some(Class::Newline) => {
                end += 1;
                after_last_newline = Some(end);
            }
            Some(Class::Space) => end += 1,
            // Perhaps more whitespace (U+00A0, U+2028, …).
            Some(Class::NonAscii) => return None,
            _ => break,
        }
    }
    after_last_newline.or(Some(end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every piece's end, by the matcher where it decides (or by the regex
    /// alone with `ascii` false).
    fn split(text: &str, ascii: bool) -> Vec<usize> {
        static SPLIT: std::sync::OnceLock<O200kSplit> = std::sync::OnceLock::new();
        let split = SPLIT.get_or_init(|| O200kSplit::new().expect("pattern"));
        let mut cache = split.cache();
        let mut lazy = None;
        let mut ends = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let end = if ascii {
                split.piece_end(&mut lazy, text, at)
            } else {
                let end = split.regex_match_end(&mut cache, text, at);
                shorten_whitespace_run(text, at, end)
            };
            ends.push(end);
            at = end;
        }
        ends
    }

    #[test]
    fn the_matcher_and_the_regex_cut_known_texts_alike() {
        for text in [
            "Hello, world! I'm here; they'll say WE'RE DON'T can'T it's",
            "  two spaces, \t\ttabs\r\n\r\nlines  \n  \nend   ",
            "x = [1, 22, 333, 4444, 55555]; // done?!\n\n",
            "'s 'S 't 're 'RE 've 'm 'll 'LL 'd 'x ' '",
            "ABCdefGHI abc123def ___init___ a/b//c\n/",
            "\u{0}\u{1}\u{7f}\u{1c}\u{1d} \u{b}\u{c}",
            "café naïve Ærø ſ's it'ſ 12٣ ½ \u{a0}x \u{2028}y e\u{301}",
        ] {
            assert_eq!(split(text, true), split(text, false), "{text:?}");
        }
    }

    #[test]
    fn the_matcher_decides_plain_ascii_alone() {
        let text = "The router's 3 engines hold 1,024 blocks each.\n";
        let bytes = text.as_bytes();
        let mut at = 0;
        while at < text.len() {
            let end = ascii_match_end(bytes, at).expect("ASCII is decided");
            at = shorten_whitespace_run(text, at, end);
        }
    }

    /// Characters at the classes' edges, ASCII and not.
    fn texts() -> impl Strategy<Value = String> {
        let alphabet: Vec<char> =
            "aZq ' \t\n\r\u{b}\u{c}\u{1c}09!/_-.,é\u{301}ſ٣½\u{a0}\u{2028}日KÅ"
                .chars()
                .collect();
        prop::collection::vec(prop::sample::select(alphabet), 0..40)
            .prop_map(|chars| chars.into_iter().collect())
    }

    proptest! {
        #[test]
        fn the_matcher_and_the_regex_cut_random_texts_alike(text in texts()) {
            prop_assert_eq!(split(&text, true), split(&text, false));
        }
    }
}
