//! `.tiktoken` vocabularies: a small one is trained here (no downloads),
//! written in the tiktoken format, loaded through `PromptTokenizer::from_path`,
//! and its ids are checked against a direct implementation of tiktoken's
//! encoding (lowest-rank adjacent merge first, leftmost on ties; a piece
//! that is itself a token is taken whole; special tokens cut the text).

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use prompt_tokens::tiktoken::{
    HARMONY_LAST_SPECIAL_ID, HARMONY_SPECIAL_TOKENS, O200K_FIRST_SPECIAL_ID, O200K_PATTERN,
    harmony_special_id,
};
use prompt_tokens::{ChatRequest, Error, PromptTokenizer, SegmentMode, templates};
use proptest::prelude::*;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

const CORPUS: &str = "\
The router sends each request to the worker that already holds its prompt.
A cache hit saves the prefill: the engine skips the tokens it has seen before.
You're a helpful assistant; answer briefly, and cite sources when you can!
Numbers 0 1 2 3 42 100 2024 3.14159 -17; code: fn main() { println!(\"hi\"); }
aaaa abab ababab ---- ==== .... Grüße aus München, ça va très bien. 日本語のテキスト
";

/// The o200k pieces of `text` (the same pattern the loader uses).
fn pieces(text: &str) -> Vec<String> {
    static SPLIT: OnceLock<Split> = OnceLock::new();
    let split = SPLIT.get_or_init(|| {
        Split::new(
            SplitPattern::Regex(O200K_PATTERN.to_owned()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("pattern")
    });
    let mut pre = PreTokenizedString::from(text);
    split.pre_tokenize(&mut pre).expect("split");
    pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(piece, _, _)| piece.to_owned())
        .collect()
}

/// tiktoken's merge loop over one piece.
fn encode_piece(piece: &[u8], ranks: &HashMap<Vec<u8>, u32>) -> Vec<u32> {
    if let Some(&rank) = ranks.get(piece) {
        return vec![rank];
    }
    let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
            if let Some(&rank) = ranks.get(&joined)
                && best.is_none_or(|(r, _)| rank < r)
            {
                best = Some((rank, i));
            }
        }
        let Some((_, i)) = best else { break };
        let right = parts.remove(i + 1);
        parts[i].extend(right);
    }
    parts.iter().map(|p| ranks[p]).collect()
}

/// A small BPE trained on `CORPUS` the way tiktoken vocabularies are:
/// the 256 bytes (in a scrambled order), then the most frequent adjacent
/// pair merged into a new rank, again and again.
fn train(merges: usize) -> HashMap<Vec<u8>, u32> {
    let mut ranks: HashMap<Vec<u8>, u32> = (0..=255u8)
        .map(|b| (vec![b], (u32::from(b) * 167) % 256))
        .collect();
    let mut words: Vec<Vec<Vec<u8>>> = pieces(CORPUS)
        .iter()
        .map(|p| p.bytes().map(|b| vec![b]).collect())
        .collect();
    for _ in 0..merges {
        let mut counts: HashMap<(Vec<u8>, Vec<u8>), usize> = HashMap::new();
        for word in &words {
            for pair in word.windows(2) {
                *counts
                    .entry((pair[0].clone(), pair[1].clone()))
                    .or_default() += 1;
            }
        }
        let Some(((left, right), _)) = counts
            .into_iter()
            .max_by_key(|((l, r), n)| (*n, std::cmp::Reverse((ranks[l], ranks[r]))))
        else {
            break;
        };
        let joined = [left.as_slice(), right.as_slice()].concat();
        let next = u32::try_from(ranks.len()).expect("small");
        ranks.entry(joined.clone()).or_insert(next);
        for word in &mut words {
            let mut i = 0;
            while i + 1 < word.len() {
                if word[i] == left && word[i + 1] == right {
                    word[i] = joined.clone();
                    word.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    ranks
}

struct Fixture {
    _dir: tempfile::TempDir,
    tokenizer: PromptTokenizer,
    file: std::path::PathBuf,
    template: std::path::PathBuf,
    ranks: HashMap<Vec<u8>, u32>,
    n: u32,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let ranks = train(300);
        let mut lines: Vec<(u32, String)> = ranks
            .iter()
            .map(|(bytes, rank)| (*rank, format!("{} {rank}", STANDARD.encode(bytes))))
            .collect();
        lines.sort();
        let text: String = lines.into_iter().map(|(_, l)| l + "\n").collect();
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("tiny.tiktoken");
        std::fs::write(&file, text).expect("write");
        let template = dir.path().join("harmony.jinja");
        std::fs::write(&template, templates::HARMONY).expect("write");
        let n = u32::try_from(ranks.len()).expect("small");
        let tokenizer = PromptTokenizer::from_path(&file, None).expect("load");
        Fixture {
            _dir: dir,
            tokenizer,
            file,
            template,
            ranks,
            n,
        }
    })
}

/// The reference: cut at the harmony special tokens, encode the rest.
fn reference(text: &str, fx: &Fixture) -> Vec<u32> {
    let specials: Vec<(String, u32)> = (O200K_FIRST_SPECIAL_ID..=HARMONY_LAST_SPECIAL_ID)
        .map(|id| {
            let name = HARMONY_SPECIAL_TOKENS
                .iter()
                .find(|(_, i)| *i == id)
                .map_or_else(|| format!("<|reserved_{id}|>"), |(s, _)| (*s).to_owned());
            (name, harmony_special_id(id, fx.n).expect("harmony id"))
        })
        .collect();
    let mut ids = Vec::new();
    let mut rest = text;
    loop {
        let next = specials
            .iter()
            .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
            .min_by_key(|(at, len, _)| (*at, std::cmp::Reverse(*len)));
        let (plain, after) = match next {
            Some((at, len, id)) => (&rest[..at], Some((at + len, id))),
            None => (rest, None),
        };
        for piece in pieces(plain) {
            ids.extend(encode_piece(piece.as_bytes(), &fx.ranks));
        }
        match after {
            Some((end, id)) => {
                ids.push(id);
                rest = &rest[end..];
            }
            None => break,
        }
    }
    ids
}

fn decode(ids: &[u32], fx: &Fixture) -> Vec<u8> {
    let by_rank: HashMap<u32, &Vec<u8>> = fx.ranks.iter().map(|(b, r)| (*r, b)).collect();
    ids.iter()
        .flat_map(|id| by_rank.get(id).map(|b| b.to_vec()).unwrap_or_default())
        .collect()
}

fn text_strategy() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        prop::sample::select(
            CORPUS
                .split_inclusive([' ', '\n'])
                .map(str::to_owned)
                .collect::<Vec<_>>()
        ),
        "[a-z]{1,8}",
        "[A-Z][a-z]{0,6}",
        "[0-9]{1,6}",
        "[ \t\n]{1,4}",
        "[-=.!?,;:(){}]{1,5}",
        "(ab){1,4}a?",
        "\\PC{1,4}",
        Just("'s".to_owned()),
        Just("'LL ".to_owned()),
        Just("\r\n".to_owned()),
    ];
    prop::collection::vec(word, 0..24).prop_map(|w| w.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ids_equal_tiktokens_merge_rule(text in text_strategy()) {
        let fx = fixture();
        let ids = fx.tokenizer.text_tokens(&text, false).unwrap();
        let expected = reference(&text, fx);
        prop_assert_eq!(&ids, &expected, "text {:?}", text);
        prop_assert_eq!(decode(&ids, fx), text.as_bytes());
    }

    #[test]
    fn special_tokens_cut_the_text(
        a in text_strategy(),
        b in text_strategy(),
        special in prop::sample::select(vec!["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|reserved_200100|>"]),
    ) {
        let fx = fixture();
        let text = format!("{a}{special}{b}");
        prop_assert_eq!(fx.tokenizer.text_tokens(&text, false).unwrap(), reference(&text, fx));
    }
}

proptest! {
    // Each case loads the vocabulary file: fewer cases than above.
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Harmony chats of random messages (short ones included: segments of
    /// up to 16 bytes are encoded directly, longer ones go through the
    /// segment cache) give the ids of tokenizing the whole rendering, on
    /// a cold and then a warm cache.
    #[test]
    fn harmony_chats_by_segments_equal_the_whole_rendering(
        contents in prop::collection::vec(
            prop_oneof![text_strategy(), "[a-z ]{0,20}", Just(String::new())],
            1..6,
        ),
        system in prop::option::of("[A-Za-z .]{0,40}"),
    ) {
        let fx = fixture();
        let tokenizer = PromptTokenizer::from_path(&fx.file, Some(&fx.template)).unwrap();
        let mut messages = Vec::new();
        if let Some(system) = system {
            messages.push(serde_json::json!({"role": "system", "content": system}));
        }
        for (i, content) in contents.iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(serde_json::json!({"role": role, "content": content}));
        }
        let request = ChatRequest::new(&serde_json::Value::Array(messages)).unwrap();
        let whole = tokenizer.chat_tokens_uncached(&request).unwrap();
        prop_assert_eq!(&whole, &reference(&tokenizer.chat_text(&request).unwrap(), fx));
        prop_assert_eq!(&tokenizer.chat_tokens(&request).unwrap(), &whole, "cold");
        prop_assert_eq!(&tokenizer.chat_tokens(&request).unwrap(), &whole, "warm");
    }
}

#[test]
fn the_special_ids_follow_the_ranks_at_their_published_offsets() {
    let fx = fixture();
    let tokenizer = PromptTokenizer::from_path(&fx.file, None).unwrap();
    let ids = tokenizer
        .text_tokens(
            "<|startoftext|><|start|><|message|><|end|><|call|><|reserved_201087|>",
            false,
        )
        .unwrap();
    let n = fx.n;
    assert_eq!(ids, [n, n + 8, n + 10, n + 9, n + 14, n + 1089]);
    assert_eq!(harmony_special_id(200_006, 199_998), Some(200_006));
    assert_eq!(harmony_special_id(100, 199_998), None);
    assert!(
        tokenizer.describe().contains("tiktoken"),
        "{}",
        tokenizer.describe()
    );
}

#[test]
fn harmony_chats_on_a_tiktoken_file_use_the_segment_cache_exactly() {
    let fx = fixture();
    let tokenizer = PromptTokenizer::from_path(&fx.file, Some(&fx.template)).unwrap();
    assert_eq!(tokenizer.segment_mode(), Some(&SegmentMode::Segments));
    let body = br#"{"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Where is shipment 1042?"},
        {"role": "assistant", "content": "It left Marseille at 09:00."},
        {"role": "user", "content": "And 2042 -- is it on time?"}
    ]}"#;
    let request = ChatRequest::from_json(body).unwrap();
    let text = tokenizer.chat_text(&request).unwrap();
    let cached = tokenizer.chat_tokens(&request).unwrap();
    assert_eq!(cached, tokenizer.chat_tokens_uncached(&request).unwrap());
    assert_eq!(cached, reference(&text, fx));
    let start = harmony_special_id(200_006, fx.n).expect("harmony id");
    let starts = cached.iter().filter(|&&id| id == start).count();
    assert_eq!(starts, text.matches("<|start|>").count());
    // Warm: the same ids again, now from the cache.
    assert_eq!(tokenizer.chat_tokens(&request).unwrap(), cached);
    assert!(tokenizer.cache_stats().hits > 0);
}

#[test]
fn malformed_tiktoken_files_are_typed_errors_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    // All 256 bytes, then a rank whose bytes are a special token's text.
    let mut clashing: String = (0..=255u8)
        .map(|b| format!("{} {b}\n", STANDARD.encode([b])))
        .collect();
    clashing.push_str(&format!("{} 256\n", STANDARD.encode("<|start|>")));
    for (name, text) in [
        ("empty.tiktoken", ""),
        ("nobytes.tiktoken", "YQ== 0\n"),
        ("garbage.tiktoken", "not base64 at all\n"),
        ("clash.tiktoken", &clashing),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        match PromptTokenizer::from_path(&path, None) {
            Err(Error::InvalidTokenizer { path: p, reason }) => {
                assert_eq!(p, path);
                assert!(!reason.is_empty());
            }
            other => panic!("{name}: expected InvalidTokenizer, got {other:?}"),
        }
    }
    let missing = Path::new("/nonexistent/o200k_base.tiktoken");
    assert!(matches!(
        PromptTokenizer::from_path(missing, None),
        Err(Error::MissingFile { .. })
    ));
}

#[test]
fn the_fuzz_entry_point_survives_its_seeds() {
    let fx = fixture();
    let good = std::fs::read(&fx.file).unwrap();
    for seed in [
        &good[..],
        &good[..good.len() / 2],
        b"",
        b"YQ== 0\n",
        b"\xff\xfe 1\n",
        b"AA== 199997\n",
        b"AA== 4294967295\n",
    ] {
        prompt_tokens::fuzzing::tiktoken(seed);
    }
}
