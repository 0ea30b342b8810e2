//! Finding a rendering's added (special) tokens, as `tokenizers` cuts a
//! text at them: leftmost-longest, non-overlapping matches of the tokens'
//! exact strings.
//!
//! A chat rendering holds a few dozen special tokens in a kilobyte of
//! text, and a vocabulary may add a thousand of them (gpt-oss reserves
//! 1,075 ids). A general multi-pattern search walks its automaton over
//! every byte of the text. Here `memchr` jumps to the bytes a token can
//! start with (one to three distinct bytes in every family we know:
//! `<`, `[`), and the automaton, run anchored, only reads the few bytes
//! after each: on a 1 KB harmony rendering this is about a seventh of the
//! instructions. The matches are those of `aho_corasick`'s own
//! leftmost-longest search (a property test checks it): the leftmost
//! position where some token starts, the longest token there, then on from
//! its end.

use aho_corasick::automaton::Automaton;
use aho_corasick::dfa::DFA;
use aho_corasick::{Anchored, MatchKind, StartKind};

/// The bytes an added token may start with, searched for with the fastest
/// means their number allows.
#[derive(Debug, Clone)]
enum FirstBytes {
    One(u8),
    Two(u8, u8),
    Three(u8, u8, u8),
    /// More than three: a table, one byte at a time.
    Many(Box<[bool; 256]>),
}

impl FirstBytes {
    fn of(patterns: &[&str]) -> Self {
        let mut table = [false; 256];
        for pattern in patterns {
            if let Some(&first) = pattern.as_bytes().first() {
                table[usize::from(first)] = true;
            }
        }
        let distinct: Vec<u8> = (0..=255u8).filter(|b| table[usize::from(*b)]).collect();
        match *distinct.as_slice() {
            [a] => Self::One(a),
            [a, b] => Self::Two(a, b),
            [a, b, c] => Self::Three(a, b, c),
            _ => Self::Many(Box::new(table)),
        }
    }

    /// The first position at or after `from` holding a first byte.
    fn find(&self, haystack: &[u8], from: usize) -> Option<usize> {
        let rest = haystack.get(from..)?;
        let offset = match self {
            Self::One(a) => memchr::memchr(*a, rest),
            Self::Two(a, b) => memchr::memchr2(*a, *b, rest),
            Self::Three(a, b, c) => memchr::memchr3(*a, *b, *c, rest),
            Self::Many(table) => rest.iter().position(|b| table[usize::from(*b)]),
        };
        offset.map(|offset| from + offset)
    }
}

/// The added tokens of a vocabulary: their strings and ids.
#[derive(Debug, Clone)]
pub(crate) struct AddedTokens {
    dfa: DFA,
    ids: Vec<u32>,
    first: FirstBytes,
    /// Each pattern's bytes, by pattern index.
    patterns: Vec<Box<[u8]>>,
    /// Whether no other pattern starts with this one and is longer: where
    /// such a pattern matches, it is the longest match there, so a match
    /// found by comparing its bytes is the automaton's (see
    /// [`AddedTokens::find_iter`]).
    maximal: Vec<bool>,
    /// The longest pattern's length in bytes.
    longest: usize,
}

/// How many recently matched tokens [`AddedTokens::find_iter`] tries by
/// comparison before it runs the automaton: a chat rendering repeats
/// two or three tokens (a turn's header, its end) dozens of times.
const RECENT: usize = 4;

/// One added token found in a text: `text[start..end]` is its string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) id: u32,
}

impl AddedTokens {
    /// A matcher of `tokens` (string and id; empty strings are never
    /// matched). `None` when no token is left to find.
    pub(crate) fn new(tokens: &[(String, u32)]) -> Result<Option<Self>, String> {
        let (patterns, ids): (Vec<&str>, Vec<u32>) = tokens
            .iter()
            .filter(|(text, _)| !text.is_empty())
            .map(|(text, id)| (text.as_str(), *id))
            .unzip();
        if patterns.is_empty() {
            return Ok(None);
        }
        let dfa = DFA::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .start_kind(StartKind::Anchored)
            .prefilter(false)
            .build(&patterns)
            .map_err(|e| e.to_string())?;
        let maximal = maximal_patterns(&patterns);
        let longest = patterns.iter().map(|p| p.len()).max().unwrap_or(0);
        Ok(Some(Self {
            dfa,
            ids,
            first: FirstBytes::of(&patterns),
            patterns: patterns.iter().map(|p| p.as_bytes().into()).collect(),
            maximal,
            longest,
        }))
    }

    /// The longest token's length in bytes: how far past a place the
    /// cutting reads to decide what starts there.
    pub(crate) fn longest(&self) -> usize {
        self.longest
    }

    /// The longest token that starts at `at`, if any, with its pattern
    /// index.
    fn longest_at(&self, haystack: &[u8], at: usize) -> Option<(Found, usize)> {
        let mut state = self.dfa.start_state(Anchored::Yes).ok()?;
        let mut longest = None;
        for (offset, &byte) in haystack[at..].iter().enumerate() {
            state = self.dfa.next_state(Anchored::Yes, state, byte);
            if !self.dfa.is_special(state) {
                continue;
            }
            if self.dfa.is_dead(state) {
                break;
            }
            if self.dfa.is_match(state) {
                let pattern = self.dfa.match_pattern(state, 0);
                // Anchored, the match ends here and starts at `at`.
                if self.dfa.pattern_len(pattern) == offset + 1 {
                    longest = Some((
                        Found {
                            start: at,
                            end: at + offset + 1,
                            id: self.ids[pattern.as_usize()],
                        },
                        pattern.as_usize(),
                    ));
                }
            }
        }
        longest
    }

    /// The tokens in `text`, in order, non-overlapping: the leftmost, the
    /// longest there, then on from its end.
    ///
    /// At each place a token may start, the [`RECENT`] tokens matched last
    /// whose patterns no longer pattern extends (`maximal`) are
    /// compared first: one that is there is the longest match there (a
    /// longer match would be a pattern it is a proper prefix of), so it is
    /// exactly what the automaton would find, for a `memcmp` of its bytes.
    pub(crate) fn find_iter<'t>(&'t self, text: &'t str) -> impl Iterator<Item = Found> + 't {
        self.find_iter_from(text, 0)
    }

    /// [`find_iter`](Self::find_iter) from byte `from` on: the tokens a
    /// search of the whole text finds after `from` when one of them ends
    /// at `from` (a search never looks behind where it starts).
    pub(crate) fn find_iter_from<'t>(
        &'t self,
        text: &'t str,
        from: usize,
    ) -> impl Iterator<Item = Found> + 't {
        let haystack = text.as_bytes();
        let mut from = from;
        // Pattern indices, most recent first; `usize::MAX` is empty.
        let mut recent = [usize::MAX; RECENT];
        std::iter::from_fn(move || {
            while let Some(at) = self.first.find(haystack, from) {
                let rest = &haystack[at..];
                let hit = recent.iter().position(|&p| {
                    self.patterns
                        .get(p)
                        .is_some_and(|bytes| rest.starts_with(bytes))
                });
                let found = match hit {
                    Some(slot) => {
                        let pattern = recent[slot];
                        recent[..=slot].rotate_right(1);
                        Some(Found {
                            start: at,
                            end: at + self.patterns[pattern].len(),
                            id: self.ids[pattern],
                        })
                    }
                    None => self.longest_at(haystack, at).map(|(found, pattern)| {
                        if self.maximal[pattern] {
                            recent.rotate_right(1);
                            recent[0] = pattern;
                        }
                        found
                    }),
                };
                if let Some(found) = found {
                    from = found.end;
                    return Some(found);
                }
                from = at + 1;
            }
            from = haystack.len();
            None
        })
    }
}

/// For each of `patterns`, whether no other pattern is longer and starts
/// with it. The patterns sorted, a pattern is a proper prefix of another
/// exactly when it is one of the next longer pattern in that order that
/// differs from it: anything starting with it sorts right after it.
fn maximal_patterns(patterns: &[&str]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..patterns.len()).collect();
    order.sort_unstable_by_key(|&i| patterns[i].as_bytes());
    let mut maximal = vec![true; patterns.len()];
    for (at, &i) in order.iter().enumerate() {
        let pattern = patterns[i].as_bytes();
        let next = order[at + 1..]
            .iter()
            .map(|&j| patterns[j].as_bytes())
            .find(|other| *other != pattern);
        if next.is_some_and(|other| other.starts_with(pattern)) {
            maximal[i] = false;
        }
    }
    maximal
}

#[cfg(test)]
mod tests {
    use super::*;
    use aho_corasick::AhoCorasick;
    use proptest::prelude::*;

    fn reference(tokens: &[(String, u32)], text: &str) -> Vec<Found> {
        let tokens: Vec<&(String, u32)> = tokens.iter().filter(|(t, _)| !t.is_empty()).collect();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(t, _)| t.as_str()))
            .unwrap();
        matcher
            .find_iter(text)
            .map(|m| Found {
                start: m.start(),
                end: m.end(),
                id: tokens[m.pattern().as_usize()].1,
            })
            .collect()
    }

    fn ours(tokens: &[(String, u32)], text: &str) -> Vec<Found> {
        match AddedTokens::new(tokens).unwrap() {
            Some(matcher) => matcher.find_iter(text).collect(),
            None => Vec::new(),
        }
    }

    fn owned(tokens: &[(&str, u32)]) -> Vec<(String, u32)> {
        tokens
            .iter()
            .map(|(t, id)| ((*t).to_owned(), *id))
            .collect()
    }

    #[test]
    fn finds_the_longest_token_at_the_leftmost_start() {
        let tokens = owned(&[
            ("<|end|>", 1),
            ("<|endoftext|>", 2),
            ("<|e", 3),
            ("[INST]", 4),
        ]);
        let text = "a<|endoftext|>b<|end|><|en[INST]<|e";
        let found = ours(&tokens, text);
        let spans: Vec<(&str, u32)> = found
            .iter()
            .map(|f| (&text[f.start..f.end], f.id))
            .collect();
        assert_eq!(
            spans,
            [
                ("<|endoftext|>", 2),
                ("<|end|>", 1),
                ("<|e", 3),
                ("[INST]", 4),
                ("<|e", 3)
            ]
        );
        assert_eq!(found, reference(&tokens, text));
    }

    #[test]
    fn no_tokens_and_empty_tokens_find_nothing() {
        assert!(AddedTokens::new(&[]).unwrap().is_none());
        assert!(AddedTokens::new(&owned(&[("", 7)])).unwrap().is_none());
        assert!(ours(&owned(&[("", 7), ("x", 8)]), "").is_empty());
        assert_eq!(ours(&owned(&[("", 7), ("x", 8)]), "axb")[0].id, 8);
    }

    #[test]
    fn many_first_bytes_use_the_table() {
        let tokens = owned(&[("<a>", 1), ("[b]", 2), ("{c}", 3), ("é!", 4)]);
        let text = "x<a>[b]{c}é!é<a";
        assert!(matches!(
            FirstBytes::of(&["<a>", "[b]", "{c}", "é!"]),
            FirstBytes::Many(_)
        ));
        assert_eq!(ours(&tokens, text).len(), 4);
        assert_eq!(ours(&tokens, text), reference(&tokens, text));
    }

    /// Tokens and texts over a small alphabet, so that tokens overlap,
    /// nest and share prefixes, and texts hold them and their fragments.
    fn tokens_and_text() -> impl Strategy<Value = (Vec<(String, u32)>, String)> {
        let piece = prop::sample::select(vec!["<", "|", ">", "a", "b", "é", "[", "]", "<|", "|>"]);
        let token = prop::collection::vec(piece.clone(), 0..5).prop_map(|p| p.concat());
        let tokens = prop::collection::vec(token, 0..12).prop_map(|tokens| {
            tokens
                .into_iter()
                .enumerate()
                .map(|(i, t)| (t, 1000 + i as u32))
                .collect::<Vec<_>>()
        });
        (tokens, prop::collection::vec(piece, 0..40)).prop_map(|(tokens, text)| {
            // Some of the tokens themselves, so that matches are common.
            let mut text = text.concat();
            for (t, _) in tokens.iter().step_by(2) {
                text.push_str(t);
                text.push('a');
            }
            (tokens, text)
        })
    }

    #[test]
    fn a_pattern_is_maximal_unless_a_longer_one_starts_with_it() {
        let patterns = ["<|e", "<|end|>", "<|end|>x", "<|e", "[b]", "<|eot|>", "<"];
        assert_eq!(
            maximal_patterns(&patterns),
            [false, false, true, false, true, true, false]
        );
    }

    #[test]
    fn repeated_tokens_found_by_comparison_equal_the_automatons() {
        // A chat rendering's shape: the same few tokens again and again,
        // one of them a prefix of a longer one that appears only later.
        let tokens = owned(&[
            ("<|start|>", 1),
            ("<|end|>", 2),
            ("<|end|>!", 3),
            ("<|eot|>", 4),
            ("<|", 5),
        ]);
        let turn = "<|start|>user<|end|>\n\nhello<|eot|>";
        let text = format!("{}<|end|>!<|end|><|<|start|", turn.repeat(50));
        let found = ours(&tokens, &text);
        assert_eq!(found.len(), 50 * 3 + 4);
        assert_eq!(found, reference(&tokens, &text));
    }

    proptest! {
        #[test]
        fn matches_equal_aho_corasicks_leftmost_longest((tokens, text) in tokens_and_text()) {
            // A repeated token string keeps its first id in both (the
            // automaton reports the lowest pattern id).
            prop_assert_eq!(ours(&tokens, &text), reference(&tokens, &text));
        }
    }
}
