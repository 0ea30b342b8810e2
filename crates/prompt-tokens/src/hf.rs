//! `tokenizer.json` tokenization, whole or by segments.
//!
//! # Why segments give the same ids
//!
//! `tokenizers` first cuts the text at every *added token* whose
//! `normalized` flag is false (one leftmost-longest Aho-Corasick pass over
//! their contents; [`AddedTokens`] finds the same matches), then
//! normalizes, pre-tokenizes and runs the model on each piece between
//! them, piece by piece. Cutting the rendered prompt at
//! the same matches ourselves (same pattern set, same match kind) and
//! encoding each piece alone therefore gives the same ids — with three
//! exceptions, which turn the segment path off for that tokenizer
//! ([`SegmentMode`]):
//!
//! * a `Metaspace` pre-tokenizer with `prepend_scheme: "first"` adds `▁` only
//!   to the piece at offset 0 of the whole text, so a piece encoded alone
//!   would gain one;
//! * an added token with `lstrip`, `rstrip` or `single_word` moves or drops
//!   matches depending on the neighbouring text;
//! * (with special tokens requested) the post-processor adds BOS/EOS to the
//!   whole sequence — chat tokenizes with `add_special_tokens = false` as
//!   vLLM does, and text prompts are encoded whole.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::added::AddedTokens;
use crate::cache::{SegmentCache, SegmentUse};
use crate::error::{Error, Result};
use crate::interrupt::Interrupt;
use crate::prefix::{Cut, PrefixMemo};

/// How a chat rendering is tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentMode {
    /// Split at added tokens, tokenize pieces through the segment cache.
    Segments,
    /// Tokenize the whole rendering each time; the reason is given.
    Whole(String),
}

/// A `tokenizer.json` (or tiktoken) vocabulary with its segment cache.
pub(crate) struct HfTokenizer {
    tokenizer: Tokenizer,
    /// Non-normalized added tokens, with the id of each pattern.
    splitter: Option<AddedTokens>,
    mode: SegmentMode,
    pub(crate) cache: SegmentCache,
    /// Earlier renderings and their ids, for the next turn of each
    /// conversation (see [`crate::prefix`]).
    pub(crate) prefix: PrefixMemo,
    pub(crate) path: PathBuf,
    format: Format,
    /// The encoder that runs instead of `tokenizer`'s pipeline, when there
    /// is one; see [`TextEncoder`].
    direct: Option<Direct>,
    encoder: TextEncoder,
    /// The ids the post-processor puts before and after every text when
    /// special tokens are asked for, when they are the same whatever the
    /// text ([`fixed_wrap`]): the direct encoder then serves those calls too.
    special_wrap: Option<(Vec<u32>, Vec<u32>)>,
}

/// Which code computes the ids of the text between special tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TextEncoder {
    /// The crate's own encoder: tiktoken's algorithm on a tiktoken
    /// vocabulary's ranks, or byte-level BPE on a `tokenizer.json`'s merges
    /// (the same ids as `tokenizers`, several times faster; see the crate
    /// docs, "Encoders").
    Direct,
    /// The `tokenizers` pipeline, with the reason the direct encoder does
    /// not serve this file (or that it was turned off).
    Tokenizers(String),
}

/// The direct encoders.
enum Direct {
    /// tiktoken's encoding on the ranks; the `tokenizer`'s BPE model then
    /// has the vocabulary but no merges (see `tiktoken::load`).
    Tiktoken(Box<crate::tiktoken::Encoder>),
    /// Byte-level BPE on a `tokenizer.json`'s merges.
    Bpe(Box<crate::bpe::Encoder>),
}

impl Direct {
    /// Appends the ids of `text` to `out`; false (nothing appended) when
    /// this text needs `tokenizers` (see `bpe::Encoder::encode`).
    fn encode(&self, text: &str, out: &mut Vec<u32>) -> bool {
        match self {
            Self::Tiktoken(encoder) => {
                encoder.encode(text, out);
                true
            }
            Self::Bpe(encoder) => encoder.encode(text, out),
        }
    }
}

/// The file a tokenizer was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    TokenizerJson,
    Tiktoken,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("mode", &self.mode)
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .finish_non_exhaustive()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`, or a tiktoken vocabulary when the file name
    /// ends in `.tiktoken` (see [`crate::tiktoken`]).
    /// `direct` as for [`Self::from_bytes`].
    pub(crate) fn from_file(path: &Path, cache: SegmentCache, direct: bool) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingFile {
                    path: path.to_owned(),
                }
            } else {
                Error::Io {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
        if crate::tiktoken::is_tiktoken_path(path) {
            let text = std::str::from_utf8(&bytes).map_err(|_| Error::InvalidTokenizer {
                path: path.to_owned(),
                reason: "a .tiktoken file is ASCII text".to_owned(),
            })?;
            return Self::from_tiktoken(text, path, cache);
        }
        Self::from_bytes(&bytes, path, cache, direct)
    }

    /// A tiktoken vocabulary's text (see [`crate::tiktoken`]); `path` names
    /// it in errors and `describe`.
    pub(crate) fn from_tiktoken(text: &str, path: &Path, cache: SegmentCache) -> Result<Self> {
        let (tokenizer, direct) =
            crate::tiktoken::load(text, false).map_err(|reason| Error::InvalidTokenizer {
                path: path.to_owned(),
                reason,
            })?;
        let mut loaded = Self::from_tokenizer(tokenizer, path, cache, Format::Tiktoken)?;
        loaded.direct = Some(Direct::Tiktoken(Box::new(direct)));
        loaded.encoder = TextEncoder::Direct;
        Ok(loaded)
    }

    /// A `tokenizer.json`'s bytes; `direct` asks for the crate's own
    /// byte-level BPE encoder where it gives the same ids.
    pub(crate) fn from_bytes(
        bytes: &[u8],
        path: &Path,
        cache: SegmentCache,
        direct: bool,
    ) -> Result<Self> {
        let tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| Error::InvalidTokenizer {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        let mut loaded = Self::from_tokenizer(tokenizer, path, cache, Format::TokenizerJson)?;
        let encoder = if !direct {
            Err("turned off".to_owned())
        } else if let SegmentMode::Whole(reason) = &loaded.mode {
            // The direct encoder runs on the text between added tokens;
            // whole-text mode exists because those cuts do not hold.
            Err(format!("whole-text mode: {reason}"))
        } else {
            crate::bpe::Encoder::for_tokenizer(&loaded.tokenizer)
        };
        match encoder {
            Ok(encoder) => {
                loaded.direct = Some(Direct::Bpe(Box::new(encoder)));
                loaded.encoder = TextEncoder::Direct;
                loaded.special_wrap = fixed_wrap(&loaded.tokenizer);
            }
            Err(reason) => loaded.encoder = TextEncoder::Tokenizers(reason),
        }
        Ok(loaded)
    }

    fn from_tokenizer(
        mut tokenizer: Tokenizer,
        path: &Path,
        cache: SegmentCache,
        format: Format,
    ) -> Result<Self> {
        // transformers turns these off unless a call asks for them; vLLM's
        // prompt path does not.
        tokenizer.with_truncation(None).ok();
        tokenizer.with_padding(None);
        let (splitter, mode) = analyse(&tokenizer, path)?;
        Ok(Self {
            tokenizer,
            splitter,
            mode,
            cache,
            prefix: PrefixMemo::new(crate::prefix::DEFAULT_PREFIX_MEMO_BYTES),
            path: path.to_owned(),
            format,
            direct: None,
            encoder: TextEncoder::Tokenizers("not loaded yet".to_owned()),
            special_wrap: None,
        })
    }

    /// `"tokenizer.json"` or `"tiktoken"`, for `describe`.
    pub(crate) fn format_name(&self) -> &'static str {
        match self.format {
            Format::TokenizerJson => "tokenizer.json",
            Format::Tiktoken => "tiktoken",
        }
    }

    pub(crate) fn mode(&self) -> &SegmentMode {
        &self.mode
    }

    pub(crate) fn encoder(&self) -> &TextEncoder {
        &self.encoder
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The whole text in one `encode` call.
    pub(crate) fn encode_whole(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // A tiktoken vocabulary has no post-processor (`add_special_tokens`
        // adds nothing); a `tokenizer.json`'s may add tokens, which only
        // `tokenizers` knows how to.
        let wrap = match (&self.direct, add_special_tokens) {
            (Some(Direct::Bpe(_)), true) => self.special_wrap.as_ref(),
            _ => None,
        };
        if let Some(direct) = &self.direct
            && (!add_special_tokens || matches!(direct, Direct::Tiktoken(_)) || wrap.is_some())
        {
            // Cut at the special tokens as `tokenizers` does, encode the
            // text between them.
            let mut out = Vec::with_capacity(text.len() / 3);
            if let Some((before, _)) = wrap {
                out.extend_from_slice(before);
            }
            let mut at = 0;
            if let Some(added) = &self.splitter {
                for found in added.find_iter(text) {
                    self.encode_between(direct, &text[at..found.start], &mut out)?;
                    out.push(found.id);
                    at = found.end;
                }
            }
            self.encode_between(direct, &text[at..], &mut out)?;
            if let Some((_, after)) = wrap {
                out.extend_from_slice(after);
            }
            return Ok(out);
        }
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Tokenize(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Appends the ids of `text` (between two special tokens) by `direct`,
    /// or by `tokenizers` when `direct` declines this text.
    fn encode_between(&self, direct: &Direct, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if !direct.encode(text, out) {
            let encoding = self
                .tokenizer
                .encode_fast(text, false)
                .map_err(|e| Error::Tokenize(e.to_string()))?;
            out.extend_from_slice(encoding.get_ids());
        }
        Ok(())
    }

    /// The ids of a chat rendering (no special tokens added), through the
    /// segment cache when the tokenizer allows it; `interrupt` is checked
    /// before each segment the cache misses. A rendering that begins as
    /// an earlier one did takes that one's ids for what they share, from
    /// the prefix memo (see [`crate::prefix`]), and is kept there for the
    /// next.
    pub(crate) fn encode_chat(
        &self,
        text: String,
        interrupt: Option<&Interrupt>,
        uses: &mut SegmentUse,
    ) -> Result<Vec<u32>> {
        if self.mode != SegmentMode::Segments {
            return self.encode_whole(&text, false);
        }
        let Some(added) = &self.splitter else {
            let mut out = Vec::with_capacity(text.len() / 3 + 16);
            self.push_segment(&text, &mut out, interrupt, uses)?;
            return Ok(out);
        };
        let memo = self.prefix.takes(&text);
        let reuse = if memo {
            self.prefix.find(&text, added.longest())
        } else {
            None
        };
        // About a token per three or four bytes of prose and markup; the
        // output grows past that only for unusual text.
        let mut out = Vec::with_capacity(text.len() / 3 + 16);
        let mut cuts = Vec::new();
        let mut at = 0;
        if let Some(reuse) = &reuse {
            out.extend_from_slice(reuse.ids());
            cuts.extend_from_slice(reuse.cuts());
            uses.cache_hits += reuse.segments();
            match reuse.cut() {
                Some(cut) => at = cut.end as usize,
                None => {
                    self.prefix
                        .store(text, &out, cuts, reuse.segments(), Some(reuse));
                    return Ok(out);
                }
            }
        }
        for found in added.find_iter_from(&text, at) {
            self.push_segment(&text[at..found.start], &mut out, interrupt, uses)?;
            out.push(found.id);
            at = found.end;
            if memo {
                cuts.push(Cut {
                    end: u32::try_from(at).unwrap_or(u32::MAX),
                    ids: u32::try_from(out.len()).unwrap_or(u32::MAX),
                    segments: uses.cache_hits + uses.cache_misses,
                });
            }
        }
        self.push_segment(&text[at..], &mut out, interrupt, uses)?;
        if memo && u32::try_from(text.len()).is_ok() {
            self.prefix.store(
                text,
                &out,
                cuts,
                uses.cache_hits + uses.cache_misses,
                reuse.as_ref(),
            );
        }
        Ok(out)
    }

    /// Appends the ids of `segment` (text between two added tokens): a
    /// short one encoded directly when the vocabulary is tiktoken's (no
    /// dearer than a cache lookup: role names, channel names, separators;
    /// see [`DIRECT_SEGMENT_BYTES`]), any other from the segment cache, encoded and
    /// remembered on a miss (after `interrupt`'s checkpoint: a miss is
    /// where the work is).
    fn push_segment(
        &self,
        segment: &str,
        out: &mut Vec<u32>,
        interrupt: Option<&Interrupt>,
        uses: &mut SegmentUse,
    ) -> Result<()> {
        if segment.is_empty() {
            return Ok(());
        }
        if segment.len() <= DIRECT_SEGMENT_BYTES
            && let Some(direct @ Direct::Tiktoken(_)) = &self.direct
            && direct.encode(segment, out)
        {
            return Ok(());
        }
        match self.cache.get(segment) {
            Some(ids) => {
                uses.cache_hits += 1;
                out.extend_from_slice(&ids);
            }
            None => {
                uses.cache_misses += 1;
                crate::interrupt::check(interrupt)?;
                let ids = self.encode_whole(segment, false)?;
                out.extend_from_slice(&ids);
                self.cache.insert(segment, ids.into());
            }
        }
        Ok(())
    }
}

/// The ids `tokenizer`'s post-processor adds before and after a text's
/// when special tokens are asked for, if they are fixed: every step of it
/// one that adds fixed tokens around the sequence (byte-level offsets,
/// template, BERT / RoBERTa markers; no truncation, which the loader turns
/// off), and probes of several texts agree. `None` otherwise, and then
/// those calls stay on `tokenizers`.
fn fixed_wrap(tokenizer: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    fn fixed(step: &serde_json::Value) -> bool {
        match step["type"].as_str() {
            Some("ByteLevel" | "TemplateProcessing" | "RobertaProcessing" | "BertProcessing") => {
                true
            }
            Some("Sequence") => step["processors"]
                .as_array()
                .is_some_and(|steps| steps.iter().all(fixed)),
            _ => false,
        }
    }
    if let Some(post) = tokenizer.get_post_processor()
        && !fixed(&serde_json::to_value(post).ok()?)
    {
        return None;
    }
    let mut wrap: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["a", "Hello, world!\n", " 12 x\t"] {
        let plain = tokenizer.encode_fast(probe, false).ok()?.get_ids().to_vec();
        let special = tokenizer.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let at = (0..=special.len().checked_sub(plain.len())?)
            .find(|&i| special[i..i + plain.len()] == plain[..])?;
        let this = (special[..at].to_vec(), special[at + plain.len()..].to_vec());
        match &wrap {
            None => wrap = Some(this),
            Some(seen) if *seen == this => {}
            Some(_) => return None,
        }
    }
    wrap
}

/// Segments up to this many bytes skip the segment cache when the tiktoken
/// encoder serves the vocabulary: encoding a role name or a separator
/// costs about what looking it up does (callgrind, `examples/chat_phases`:
/// about 340 instructions either way). The byte-level BPE encoder's
/// pre-tokenizer costs about 1,200 for such a piece, so its short
/// segments are looked up like the others.
const DIRECT_SEGMENT_BYTES: usize = 16;

fn analyse(tokenizer: &Tokenizer, path: &Path) -> Result<(Option<AddedTokens>, SegmentMode)> {
    let mut patterns: Vec<(String, u32)> = Vec::new();
    let mut whole: Option<String> = None;
    let mut added: Vec<_> = tokenizer.get_added_tokens_decoder().into_iter().collect();
    added.sort_by_key(|(id, _)| *id);
    for (id, token) in added {
        if token.normalized {
            continue;
        }
        if token.lstrip || token.rstrip || token.single_word {
            whole.get_or_insert_with(|| {
                format!(
                    "added token {:?} has lstrip/rstrip/single_word",
                    token.content
                )
            });
        }
        if !token.content.is_empty() {
            patterns.push((token.content, id));
        }
    }
    if let Some(pre) = tokenizer.get_pre_tokenizer() {
        let json = serde_json::to_value(pre).unwrap_or_default();
        if mentions_first_prepend(&json) {
            whole.get_or_insert_with(|| {
                "Metaspace pre-tokenizer with prepend_scheme \"first\"".to_owned()
            });
        }
    }
    let splitter = AddedTokens::new(&patterns).map_err(|e| Error::InvalidTokenizer {
        path: path.to_owned(),
        reason: format!("added tokens: {e}"),
    })?;
    let mode = match whole {
        Some(reason) => SegmentMode::Whole(reason),
        None => SegmentMode::Segments,
    };
    Ok((splitter, mode))
}

fn mentions_first_prepend(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Object(map) => {
            let metaspace_first = map.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                && map
                    .get("prepend_scheme")
                    .and_then(|p| p.as_str())
                    .is_none_or(|p| p == "first");
            metaspace_first || map.values().any(mentions_first_prepend)
        }
        serde_json::Value::Array(items) => items.iter().any(mentions_first_prepend),
        _ => false,
    }
}
