//! The message memo: a chat message's template value, kept by its JSON
//! text, so that a conversation's next request parses only its new
//! messages.
//!
//! A multi-turn request repeats every earlier message byte for byte, and
//! parsing them into template values was the largest part of a warm 8 KB
//! request after the render and prefix memos (about 150k instructions,
//! most of it allocating the strings and maps again). With a memo,
//! [`ChatRequest::from_json_with`](crate::ChatRequest::from_json_with)
//! and [`ChatFields::with_message_memo`](crate::ChatFields::with_message_memo)
//! read each element of `messages` as its raw JSON text (serde_json skips
//! over it, checking it is JSON, without building anything), look the text
//! up, and parse only a text not found — with the same visitor as a
//! whole-body parse, so the value is the one it would have built. The same
//! bytes always parse to the same value, and a hit compares the stored
//! text with the new one byte for byte (the hash only finds the
//! candidate), so the memo is exact by construction. Values are shared:
//! template values are immutable.
//!
//! One difference a whole-body parse would show is kept: serde_json
//! refuses more than 127 nested arrays and objects in a body, and an
//! element of `messages` sits two levels down. A text parsed on its own
//! would be allowed two more; a parsed element nested deeper than a
//! whole-body parse allows is refused as that parse would refuse it.
//!
//! Bounded by bytes (each entry is charged three times its text, an
//! estimate of its value's allocations, plus a fixed overhead) over 16
//! shards by hash, each evicting its oldest entries first; a shard's
//! `parking_lot::Mutex` is held for one map lookup or insert. Elements
//! under [`MIN_BYTES`] are parsed without it: their parse costs less than
//! the lookup, and bodies under [`MIN_BODY_BYTES`] are parsed as before.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};

use minijinja::Value;
use parking_lot::Mutex;

use crate::cache::KeyHasher;

/// The default bound of a message memo in bytes.
pub const DEFAULT_MESSAGE_MEMO_BYTES: usize = 16 * 1024 * 1024;

/// Elements of `messages` shorter than this are parsed without the memo.
pub(crate) const MIN_BYTES: usize = 48;

/// Bodies shorter than this are parsed without the memo: a few messages
/// parse in about the time their lookups take (measured: a 1 KB chat of
/// six messages costs 2-3 % more instructions through the memo).
pub const MIN_BODY_BYTES: usize = 2048;

const SHARDS: usize = 16;

/// Bytes charged per entry on top of three times its text.
const ENTRY_OVERHEAD_BYTES: usize = 96;

/// The most arrays and objects serde_json lets a body nest, and how deep
/// an element of `messages` sits in a body (the body's object, the array).
const BODY_DEPTH_LIMIT: usize = 127;
const ELEMENT_DEPTH: usize = 2;

/// Counters of a [`MessageMemo`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageMemoStats {
    /// Elements looked up.
    pub lookups: u64,
    /// Lookups that found the element's value.
    pub hits: u64,
    /// Entries held.
    pub entries: u64,
    /// Bytes charged.
    pub bytes: u64,
}

struct Entry {
    text: Box<str>,
    value: Value,
    /// Whether some object in the value repeated a key.
    repeated: bool,
    serial: u64,
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.len() * 3 + ENTRY_OVERHEAD_BYTES
    }
}

#[derive(Default)]
struct Shard {
    /// Keyed by the text's seeded hash, which the map uses as it is.
    map: HashMap<u64, Entry, BuildHasherDefault<KeyHasher>>,
    order: VecDeque<(u64, u64)>,
    bytes: usize,
    next_serial: u64,
}

/// Messages' template values by their JSON text (see the module docs).
/// Share one among the requests of every model: parsing does not depend
/// on the model.
pub struct MessageMemo {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    hasher: ahash::RandomState,
    lookups: AtomicU64,
    hits: AtomicU64,
}

impl std::fmt::Debug for MessageMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageMemo")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for MessageMemo {
    fn default() -> Self {
        Self::new(DEFAULT_MESSAGE_MEMO_BYTES)
    }
}

impl MessageMemo {
    /// A memo of at most `bytes` (0: every element is parsed).
    pub fn new(bytes: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: bytes / SHARDS,
            hasher: ahash::RandomState::new(),
            lookups: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// The memo's counters.
    pub fn stats(&self) -> MessageMemoStats {
        let mut stats = MessageMemoStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            ..MessageMemoStats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.entries += shard.map.len() as u64;
            stats.bytes += shard.bytes as u64;
        }
        stats
    }

    /// The template value of the JSON `text` (one element of `messages`),
    /// and whether an object in it repeated a key: from the memo when it
    /// holds `text`, else parsed (and kept).
    pub(crate) fn value_of(&self, text: &str) -> Result<(Value, bool), String> {
        if self.shard_budget == 0 || text.len() < MIN_BYTES {
            return parse_element(text);
        }
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let key = self.hasher.hash_one(text.as_bytes());
        let shard = &self.shards[(key >> 60) as usize % SHARDS];
        if let Some(entry) = shard.lock().map.get(&key)
            && *entry.text == *text
        {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((entry.value.clone(), entry.repeated));
        }
        let (value, repeated) = parse_element(text)?;
        let entry = Entry {
            text: text.into(),
            value: value.clone(),
            repeated,
            serial: 0,
        };
        let cost = entry.cost();
        if cost <= self.shard_budget {
            let mut shard = shard.lock();
            let serial = shard.next_serial;
            shard.next_serial += 1;
            let entry = Entry { serial, ..entry };
            if let Some(old) = shard.map.insert(key, entry) {
                shard.bytes -= old.cost();
            }
            shard.bytes += cost;
            shard.order.push_back((key, serial));
            while shard.bytes > self.shard_budget {
                let Some((key, serial)) = shard.order.pop_front() else {
                    break;
                };
                if shard.map.get(&key).is_some_and(|e| e.serial == serial)
                    && let Some(gone) = shard.map.remove(&key)
                {
                    shard.bytes -= gone.cost();
                }
            }
            if shard.order.len() > 2 * shard.map.len() + 32 {
                let Shard { map, order, .. } = &mut *shard;
                order.retain(|(key, serial)| map.get(key).is_some_and(|e| e.serial == *serial));
            }
        }
        Ok((value, repeated))
    }
}

/// Parses one element of `messages` as a whole-body parse would have.
fn parse_element(text: &str) -> Result<(Value, bool), String> {
    if nesting(text.as_bytes()) + ELEMENT_DEPTH > BODY_DEPTH_LIMIT {
        return Err("recursion limit exceeded".to_owned());
    }
    let repeated = std::cell::Cell::new(false);
    let mut de = serde_json::Deserializer::from_str(text);
    let value =
        serde::de::DeserializeSeed::deserialize(crate::request::JsonSeed(&repeated), &mut de)
            .map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok((value, repeated.get()))
}

/// The deepest nesting of arrays and objects in the JSON `text` (brackets
/// inside strings do not count).
fn nesting(text: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &byte in text {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bodies over [`MIN_BODY_BYTES`] read through a memo (twice: misses,
    /// then hits) give `from_json`'s request, or fail where it fails.
    #[test]
    fn from_json_with_reads_what_from_json_reads() {
        use crate::ChatRequest;
        let long = "the tides of the North Sea ".repeat(90);
        let deep = format!("{}{}", "[".repeat(126), "]".repeat(126));
        let bodies = [
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"hi","role":"user"}}],"tools":[{{"type":"function","function":{{"name":"f"}}}}]}}"#
            ),
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"{long}"}}]}}, 7, "x", null],"add_generation_prompt":false}}"#
            ),
            format!(r#"{{"messages":{{"role":"user","content":"{long}"}}}}"#),
            format!(r#"{{"messages":"{long}"}}"#),
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}}]}}"#),
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}}],"messages":[]}}"#),
            format!(r#"{{"model":"{long}"}}"#),
            format!(
                r#"{{"messages":[{{"role":"user","content":"{long}"}}],"add_generation_prompt":"yes"}}"#
            ),
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}},{deep}]}}"#),
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}}]"#),
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}}]}} trailing"#),
        ];
        let memo = MessageMemo::default();
        for body in &bodies {
            assert!(body.len() >= MIN_BODY_BYTES);
            let plain = ChatRequest::from_json(body.as_bytes());
            for round in 0..2 {
                let with = ChatRequest::from_json_with(body.as_bytes(), &memo);
                match (&plain, &with) {
                    (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}"), "{body}"),
                    (Err(_), Err(_)) => {}
                    _ => panic!("round {round}: {plain:?} against {with:?} for {body}"),
                }
            }
        }
        assert!(memo.stats().hits > 0);
    }

    #[test]
    fn nesting_skips_brackets_in_strings() {
        assert_eq!(nesting(br#"{"a": [1, {"b": "[[[{"}]]}"#), 3);
        assert_eq!(nesting(br#""\"[""#), 0);
        assert_eq!(nesting(b"1"), 0);
    }

    #[test]
    fn a_hit_is_the_value_a_parse_gives_and_the_bound_holds() {
        let memo = MessageMemo::new(SHARDS * 4096);
        let text = r#"{"role": "user", "content": "What do the tides of the North Sea do?", "name": "a", "name": "b"}"#;
        let (parsed, repeated) = memo.value_of(text).unwrap();
        let (again, repeated_again) = memo.value_of(text).unwrap();
        assert_eq!(parsed, again);
        assert!(repeated && repeated_again);
        assert_eq!(parsed.get_attr("name").unwrap().as_str(), Some("b"));
        assert_eq!(memo.stats().hits, 1);
        for n in 0..2000 {
            let text = format!(r#"{{"role": "user", "content": "message number {n:08} of many"}}"#);
            memo.value_of(&text).unwrap();
            assert!(memo.stats().bytes as usize <= SHARDS * 4096);
        }
        // Too deep for a body (two levels are the body's), and not JSON.
        let deep = format!("{}{}", "[".repeat(126), "]".repeat(126));
        assert!(memo.value_of(&deep).is_err());
        let fits = format!("{}{}", "[".repeat(125), "]".repeat(125));
        assert!(memo.value_of(&fits).is_ok());
        assert!(
            memo.value_of(r#"{"role": "user", "content": "no end""#)
                .is_err()
        );
        let off = MessageMemo::new(0);
        off.value_of(text).unwrap();
        assert_eq!(off.stats().lookups, 0);
    }
}
