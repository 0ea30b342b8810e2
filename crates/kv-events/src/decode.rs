//! Decoding a payload: a pull reader over the bytes, written for this
//! format rather than through serde, so that every length is checked
//! against the bytes actually left and against [`DecodeLimits`] before
//! anything is reserved, errors say which field was wrong, and values we do
//! not know are skipped without recursion.

use crate::value::Value;
use crate::wire::{
    BlockHash, BlockRemoved, BlockStored, DecodeLimits, EventBatch, KvEvent,
    TAG_ALL_BLOCKS_CLEARED, TAG_BLOCK_REMOVED, TAG_BLOCK_STORED,
};

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload ended inside a value (or declared more elements or bytes
    /// than it has).
    #[error("payload truncated at byte {offset}")]
    Truncated {
        /// Where the incomplete value starts.
        offset: usize,
    },
    /// A byte that starts no value this format uses (`0xc1`, or a
    /// MessagePack extension where a field was expected).
    #[error("unsupported MessagePack marker 0x{marker:02x} at byte {offset}")]
    UnsupportedMarker {
        /// The marker byte.
        marker: u8,
        /// Its position.
        offset: usize,
    },
    /// A field holds a value of the wrong type.
    #[error("{field}: expected {expected} at byte {offset}")]
    UnexpectedType {
        /// The field (or element) being read.
        field: &'static str,
        /// What it should have been.
        expected: &'static str,
        /// Where the value starts.
        offset: usize,
    },
    /// An integer does not fit the field (a negative token id, a block size
    /// above `u32::MAX`, ...).
    #[error("{field}: integer out of range at byte {offset}")]
    OutOfRange {
        /// The field being read.
        field: &'static str,
        /// Where the value starts.
        offset: usize,
    },
    /// A required field is absent.
    #[error("{record}: missing field {field}")]
    MissingField {
        /// The batch or event type.
        record: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A string field is not UTF-8.
    #[error("{field}: invalid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        /// The field being read.
        field: &'static str,
        /// Where the value starts.
        offset: usize,
    },
    /// A size is above one of the [`DecodeLimits`].
    #[error("{what}: {len} exceeds the limit of {limit}")]
    LimitExceeded {
        /// What was too large.
        what: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Bytes follow the batch.
    #[error("{count} unexpected bytes after the batch")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
}

/// A decoded batch and how many of its events were skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The batch, without the skipped events.
    pub batch: EventBatch,
    /// Events whose tag this crate does not know (a newer vLLM), skipped.
    pub unknown_events: usize,
}

/// Decodes one payload (the third frame of a message) with the default
/// [`DecodeLimits`]. Accepts both shapes of [`WireFormat`](crate::WireFormat).
///
/// # Errors
///
/// A [`DecodeError`] naming what was wrong; never panics.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    decode_batch_with(payload, &DecodeLimits::default())
}

/// Decodes one payload under the given limits.
///
/// # Errors
///
/// A [`DecodeError`] naming what was wrong; never panics.
pub fn decode_batch_with(
    payload: &[u8],
    limits: &DecodeLimits,
) -> Result<DecodedBatch, DecodeError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::LimitExceeded {
            what: "payload bytes",
            len: payload.len(),
            limit: limits.max_payload_bytes,
        });
    }
    let mut reader = Reader {
        buf: payload,
        pos: 0,
        limits,
        items: 0,
    };
    let decoded = reader.batch()?;
    let count = payload.len() - reader.pos;
    if count != 0 {
        return Err(DecodeError::TrailingBytes { count });
    }
    Ok(decoded)
}

/// The head of one value: scalars complete, containers with their length.
enum Head<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

struct Reader<'a, 'l> {
    buf: &'a [u8],
    pos: usize,
    limits: &'l DecodeLimits,
    /// Hashes, token ids and extra-key values decoded so far in the batch.
    items: usize,
}

/// Which event fields the map reader knows, with the tag they belong to.
#[derive(Default)]
struct StoredFields {
    block_hashes: Option<Vec<BlockHash>>,
    parent_block_hash: Option<Option<BlockHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
}

impl<'a> Reader<'a, '_> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(DecodeError::Truncated { offset: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize, start: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.left() {
            return Err(DecodeError::Truncated { offset: start });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize, start: usize) -> Result<u64, DecodeError> {
        let bytes = self.take(n, start)?;
        Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    /// A container of `n` elements (`per` values each) must fit in the bytes
    /// left: every value takes at least one byte. This is what keeps a
    /// declared length from reserving memory the payload does not back.
    fn container(&self, n: u64, per: u64, start: usize) -> Result<usize, DecodeError> {
        if n.saturating_mul(per) > self.left() as u64 {
            return Err(DecodeError::Truncated { offset: start });
        }
        usize::try_from(n).map_err(|_| DecodeError::Truncated { offset: start })
    }

    fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let start = self.pos;
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Head::UInt(u64::from(m)),
            0x80..=0x8f => Head::Map(self.container(u64::from(m & 0x0f), 2, start)?),
            0x90..=0x9f => Head::Array(self.container(u64::from(m & 0x0f), 1, start)?),
            0xa0..=0xbf => Head::Str(self.take(usize::from(m & 0x1f), start)?),
            0xc0 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4..=0xc6 => {
                let n = self.be(1 << (m - 0xc4), start)?;
                Head::Bin(self.take(self.container(n, 1, start)?, start)?)
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (m - 0xc7), start)?;
                let n = self.container(n.saturating_add(1), 1, start)?;
                self.take(n, start)?;
                Head::Ext
            }
            0xca => Head::Float(f64::from(f32::from_bits(self.be(4, start)? as u32))),
            0xcb => Head::Float(f64::from_bits(self.be(8, start)?)),
            0xcc..=0xcf => Head::UInt(self.be(1 << (m - 0xcc), start)?),
            0xd0 => Head::Int(i64::from(self.be(1, start)? as u8 as i8)),
            0xd1 => Head::Int(i64::from(self.be(2, start)? as u16 as i16)),
            0xd2 => Head::Int(i64::from(self.be(4, start)? as u32 as i32)),
            0xd3 => Head::Int(self.be(8, start)? as i64),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (m - 0xd4)), start)?;
                Head::Ext
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (m - 0xd9), start)?;
                Head::Str(self.take(self.container(n, 1, start)?, start)?)
            }
            0xdc | 0xdd => {
                let n = self.be(2 << (m - 0xdc), start)?;
                Head::Array(self.container(n, 1, start)?)
            }
            0xde | 0xdf => {
                let n = self.be(2 << (m - 0xde), start)?;
                Head::Map(self.container(n, 2, start)?)
            }
            0xe0..=0xff => Head::Int(i64::from(m as i8)),
            0xc1 => {
                return Err(DecodeError::UnsupportedMarker {
                    marker: m,
                    offset: start,
                });
            }
        })
    }

    /// Skips one value of any type, nested ones included, with a counter
    /// instead of recursion (a deep nest cannot overflow the stack).
    fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.head()? {
                Head::Array(n) => pending += n as u64,
                Head::Map(n) => pending += 2 * n as u64,
                _ => {}
            }
        }
        Ok(())
    }

    fn count_items(&mut self, n: usize) -> Result<(), DecodeError> {
        self.items += n;
        if self.items > self.limits.max_batch_items {
            return Err(DecodeError::LimitExceeded {
                what: "items in the batch",
                len: self.items,
                limit: self.limits.max_batch_items,
            });
        }
        Ok(())
    }

    fn type_error(field: &'static str, expected: &'static str, offset: usize) -> DecodeError {
        DecodeError::UnexpectedType {
            field,
            expected,
            offset,
        }
    }

    fn uint(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::UInt(v) => Ok(v),
            // A non-negative value in a signed form is still that value.
            Head::Int(v) if v >= 0 => Ok(v as u64),
            Head::Int(_) => Err(DecodeError::OutOfRange {
                field,
                offset: start,
            }),
            _ => Err(Self::type_error(field, "integer", start)),
        }
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        let start = self.pos;
        u32::try_from(self.uint(field)?).map_err(|_| DecodeError::OutOfRange {
            field,
            offset: start,
        })
    }

    fn is_nil(&mut self) -> Result<bool, DecodeError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    fn opt_uint(&mut self, field: &'static str) -> Result<Option<u64>, DecodeError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.uint(field).map(Some)
    }

    fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>, DecodeError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.u32(field).map(Some)
    }

    fn float(&mut self, field: &'static str) -> Result<f64, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::Float(v) => Ok(v),
            // msgspec writes floats as floats; an integer is still a time.
            Head::UInt(v) => Ok(v as f64),
            Head::Int(v) => Ok(v as f64),
            _ => Err(Self::type_error(field, "float", start)),
        }
    }

    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::Str(s) => {
                if s.len() > self.limits.max_string_bytes {
                    return Err(DecodeError::LimitExceeded {
                        what: field,
                        len: s.len(),
                        limit: self.limits.max_string_bytes,
                    });
                }
                std::str::from_utf8(s)
                    .map(str::to_owned)
                    .map_err(|_| DecodeError::InvalidUtf8 {
                        field,
                        offset: start,
                    })
            }
            _ => Err(Self::type_error(field, "string", start)),
        }
    }

    fn opt_string(&mut self, field: &'static str) -> Result<Option<String>, DecodeError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.string(field).map(Some)
    }

    fn hash(&mut self, field: &'static str) -> Result<BlockHash, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::UInt(v) => Ok(BlockHash::Int(v)),
            // Two's complement: the same 64 bits as the unsigned form.
            Head::Int(v) => Ok(BlockHash::Int(v as u64)),
            Head::Bin(b) => {
                if b.len() > self.limits.max_hash_bytes {
                    return Err(DecodeError::LimitExceeded {
                        what: "block hash bytes",
                        len: b.len(),
                        limit: self.limits.max_hash_bytes,
                    });
                }
                Ok(BlockHash::Bytes(b.into()))
            }
            _ => Err(Self::type_error(field, "integer or bytes", start)),
        }
    }

    fn opt_hash(&mut self, field: &'static str) -> Result<Option<BlockHash>, DecodeError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.hash(field).map(Some)
    }

    fn array_len(&mut self, field: &'static str, limit: usize) -> Result<usize, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::Array(n) if n > limit => Err(DecodeError::LimitExceeded {
                what: field,
                len: n,
                limit,
            }),
            Head::Array(n) => Ok(n),
            _ => Err(Self::type_error(field, "array", start)),
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash>, DecodeError> {
        let n = self.array_len("block_hashes", self.limits.max_block_hashes)?;
        self.count_items(n)?;
        (0..n).map(|_| self.hash("block_hashes")).collect()
    }

    fn tokens(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.array_len("token_ids", self.limits.max_token_ids)?;
        self.count_items(n)?;
        (0..n).map(|_| self.u32("token_ids")).collect()
    }

    fn value(&mut self, depth: usize) -> Result<Value, DecodeError> {
        let start = self.pos;
        if depth > self.limits.max_value_depth {
            return Err(DecodeError::LimitExceeded {
                what: "extra key nesting",
                len: depth,
                limit: self.limits.max_value_depth,
            });
        }
        self.count_items(1)?;
        Ok(match self.head()? {
            Head::Nil => Value::Nil,
            Head::Bool(b) => Value::Bool(b),
            Head::UInt(v) => Value::UInt(v),
            Head::Int(v) => Value::Int(v),
            Head::Float(v) => Value::Float(v),
            Head::Str(s) => {
                if s.len() > self.limits.max_string_bytes {
                    return Err(DecodeError::LimitExceeded {
                        what: "extra key string",
                        len: s.len(),
                        limit: self.limits.max_string_bytes,
                    });
                }
                Value::Str(
                    std::str::from_utf8(s)
                        .map_err(|_| DecodeError::InvalidUtf8 {
                            field: "extra_keys",
                            offset: start,
                        })?
                        .to_owned(),
                )
            }
            Head::Bin(b) => {
                if b.len() > self.limits.max_string_bytes {
                    return Err(DecodeError::LimitExceeded {
                        what: "extra key bytes",
                        len: b.len(),
                        limit: self.limits.max_string_bytes,
                    });
                }
                Value::Bytes(b.to_vec())
            }
            Head::Array(n) => Value::Array(
                (0..n)
                    .map(|_| self.value(depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
            Head::Map(n) => Value::Map(
                (0..n)
                    .map(|_| Ok((self.value(depth + 1)?, self.value(depth + 1)?)))
                    .collect::<Result<_, DecodeError>>()?,
            ),
            Head::Ext => {
                return Err(DecodeError::UnsupportedMarker {
                    marker: self.buf[start],
                    offset: start,
                });
            }
        })
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Value>>>, DecodeError> {
        if self.is_nil()? {
            return Ok(None);
        }
        let n = self.array_len("extra_keys", self.limits.max_block_hashes)?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            if self.is_nil()? {
                keys.push(None);
            } else {
                keys.push(Some(self.value(1)?));
            }
        }
        Ok(Some(keys))
    }

    fn batch(&mut self) -> Result<DecodedBatch, DecodeError> {
        let start = self.pos;
        let mut ts = None;
        let mut events = None;
        let mut rank = None;
        match self.head()? {
            Head::Array(n) => {
                let mut left = n;
                if take(&mut left) {
                    ts = Some(self.float("ts")?);
                }
                if take(&mut left) {
                    events = Some(self.events()?);
                }
                if take(&mut left) {
                    rank = self.opt_u32("data_parallel_rank")?;
                }
                self.skip_n(left)?;
            }
            Head::Map(n) => {
                for _ in 0..n {
                    match self.key()? {
                        Some(b"ts") => ts = Some(self.float("ts")?),
                        Some(b"events") => events = Some(self.events()?),
                        Some(b"data_parallel_rank") => {
                            rank = self.opt_u32("data_parallel_rank")?;
                        }
                        _ => self.skip()?,
                    }
                }
            }
            _ => return Err(Self::type_error("batch", "array or map", start)),
        }
        let ts = ts.ok_or(DecodeError::MissingField {
            record: "EventBatch",
            field: "ts",
        })?;
        let (events, unknown_events) = events.ok_or(DecodeError::MissingField {
            record: "EventBatch",
            field: "events",
        })?;
        Ok(DecodedBatch {
            batch: EventBatch {
                ts,
                events,
                data_parallel_rank: rank,
            },
            unknown_events,
        })
    }

    fn skip_n(&mut self, n: usize) -> Result<(), DecodeError> {
        for _ in 0..n {
            self.skip()?;
        }
        Ok(())
    }

    /// A map key: `Some(bytes)` for a string key, `None` (already skipped)
    /// for any other type.
    fn key(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::Str(s) => Ok(Some(s)),
            Head::Array(_) | Head::Map(_) => {
                self.pos = start;
                self.skip()?;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    fn events(&mut self) -> Result<(Vec<KvEvent>, usize), DecodeError> {
        let n = self.array_len("events", self.limits.max_events)?;
        let mut events = Vec::with_capacity(n);
        let mut unknown = 0;
        for _ in 0..n {
            match self.event()? {
                Some(event) => events.push(event),
                None => unknown += 1,
            }
        }
        Ok((events, unknown))
    }

    /// One event, or `None` when its tag is unknown (it is then skipped).
    fn event(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        let start = self.pos;
        match self.head()? {
            Head::Array(n) => {
                let mut left = n;
                if !take(&mut left) {
                    return Err(DecodeError::MissingField {
                        record: "event",
                        field: "type",
                    });
                }
                let tag_at = self.pos;
                let tag = match self.head()? {
                    Head::Str(s) => s,
                    _ => return Err(Self::type_error("event tag", "string", tag_at)),
                };
                let event = match tag {
                    t if t == TAG_BLOCK_STORED.as_bytes() => {
                        Some(KvEvent::BlockStored(self.stored_positional(&mut left)?))
                    }
                    t if t == TAG_BLOCK_REMOVED.as_bytes() => {
                        Some(KvEvent::BlockRemoved(self.removed_positional(&mut left)?))
                    }
                    t if t == TAG_ALL_BLOCKS_CLEARED.as_bytes() => Some(KvEvent::AllBlocksCleared),
                    _ => None,
                };
                self.skip_n(left)?;
                Ok(event)
            }
            Head::Map(n) => {
                let fields_at = self.pos;
                let tag = self.find_tag(n)?;
                match tag {
                    Some(t) if t == TAG_BLOCK_STORED.as_bytes() => {
                        self.pos = fields_at;
                        Ok(Some(KvEvent::BlockStored(self.stored_named(n)?)))
                    }
                    Some(t) if t == TAG_BLOCK_REMOVED.as_bytes() => {
                        self.pos = fields_at;
                        Ok(Some(KvEvent::BlockRemoved(self.removed_named(n)?)))
                    }
                    Some(t) if t == TAG_ALL_BLOCKS_CLEARED.as_bytes() => {
                        Ok(Some(KvEvent::AllBlocksCleared))
                    }
                    Some(_) => Ok(None),
                    None => Err(DecodeError::MissingField {
                        record: "event",
                        field: "type",
                    }),
                }
            }
            _ => Err(Self::type_error("event", "array or map", start)),
        }
    }

    /// Reads a whole event map (leaving the reader after it) and returns
    /// the value of its `"type"` key. msgspec writes the tag first, but
    /// field order is not part of the format.
    fn find_tag(&mut self, n: usize) -> Result<Option<&'a [u8]>, DecodeError> {
        let mut tag = None;
        for _ in 0..n {
            if self.key()? == Some(b"type") {
                let at = self.pos;
                match self.head()? {
                    Head::Str(s) => tag = Some(s),
                    _ => return Err(Self::type_error("event tag", "string", at)),
                }
            } else {
                self.skip()?;
            }
        }
        Ok(tag)
    }

    fn stored_positional(&mut self, left: &mut usize) -> Result<BlockStored, DecodeError> {
        let missing = |field| DecodeError::MissingField {
            record: TAG_BLOCK_STORED,
            field,
        };
        if !take(left) {
            return Err(missing("block_hashes"));
        }
        let block_hashes = self.hashes()?;
        if !take(left) {
            return Err(missing("parent_block_hash"));
        }
        let parent = self.opt_hash("parent_block_hash")?;
        if !take(left) {
            return Err(missing("token_ids"));
        }
        let token_ids = self.tokens()?;
        if !take(left) {
            return Err(missing("block_size"));
        }
        let block_size = self.u32("block_size")?;
        let mut ev = BlockStored::new(block_hashes, parent, token_ids, block_size);
        if take(left) {
            ev.lora_id = self.opt_uint("lora_id")?;
        }
        if take(left) {
            ev.medium = self.opt_string("medium")?;
        }
        if take(left) {
            ev.lora_name = self.opt_string("lora_name")?;
        }
        if take(left) {
            ev.extra_keys = self.extra_keys()?;
        }
        if take(left) {
            ev.group_idx = self.opt_u32("group_idx")?;
        }
        if take(left) {
            ev.kv_cache_spec_kind = self.opt_string("kv_cache_spec_kind")?;
        }
        if take(left) {
            ev.kv_cache_spec_sliding_window = self.opt_uint("kv_cache_spec_sliding_window")?;
        }
        Ok(ev)
    }

    fn removed_positional(&mut self, left: &mut usize) -> Result<BlockRemoved, DecodeError> {
        if !take(left) {
            return Err(DecodeError::MissingField {
                record: TAG_BLOCK_REMOVED,
                field: "block_hashes",
            });
        }
        let mut ev = BlockRemoved::new(self.hashes()?);
        if take(left) {
            ev.medium = self.opt_string("medium")?;
        }
        if take(left) {
            ev.group_idx = self.opt_u32("group_idx")?;
        }
        Ok(ev)
    }

    fn stored_named(&mut self, n: usize) -> Result<BlockStored, DecodeError> {
        let mut req = StoredFields::default();
        let mut ev = BlockStored::new(Vec::new(), None, Vec::new(), 0);
        for _ in 0..n {
            match self.key()? {
                Some(b"block_hashes") => req.block_hashes = Some(self.hashes()?),
                Some(b"parent_block_hash") => {
                    req.parent_block_hash = Some(self.opt_hash("parent_block_hash")?);
                }
                Some(b"token_ids") => req.token_ids = Some(self.tokens()?),
                Some(b"block_size") => req.block_size = Some(self.u32("block_size")?),
                Some(b"lora_id") => ev.lora_id = self.opt_uint("lora_id")?,
                Some(b"medium") => ev.medium = self.opt_string("medium")?,
                Some(b"lora_name") => ev.lora_name = self.opt_string("lora_name")?,
                Some(b"extra_keys") => ev.extra_keys = self.extra_keys()?,
                Some(b"group_idx") => ev.group_idx = self.opt_u32("group_idx")?,
                Some(b"kv_cache_spec_kind") => {
                    ev.kv_cache_spec_kind = self.opt_string("kv_cache_spec_kind")?;
                }
                Some(b"kv_cache_spec_sliding_window") => {
                    ev.kv_cache_spec_sliding_window =
                        self.opt_uint("kv_cache_spec_sliding_window")?;
                }
                // `type` (already read) and fields of newer versions.
                _ => self.skip()?,
            }
        }
        let missing = |field| DecodeError::MissingField {
            record: TAG_BLOCK_STORED,
            field,
        };
        ev.block_hashes = req.block_hashes.ok_or(missing("block_hashes"))?;
        // Required in vLLM's declaration but nullable: absent reads as None.
        ev.parent_block_hash = req.parent_block_hash.flatten();
        ev.token_ids = req.token_ids.ok_or(missing("token_ids"))?;
        ev.block_size = req.block_size.ok_or(missing("block_size"))?;
        Ok(ev)
    }

    fn removed_named(&mut self, n: usize) -> Result<BlockRemoved, DecodeError> {
        let mut hashes = None;
        let mut ev = BlockRemoved::new(Vec::new());
        for _ in 0..n {
            match self.key()? {
                Some(b"block_hashes") => hashes = Some(self.hashes()?),
                Some(b"medium") => ev.medium = self.opt_string("medium")?,
                Some(b"group_idx") => ev.group_idx = self.opt_u32("group_idx")?,
                _ => self.skip()?,
            }
        }
        ev.block_hashes = hashes.ok_or(DecodeError::MissingField {
            record: TAG_BLOCK_REMOVED,
            field: "block_hashes",
        })?;
        Ok(ev)
    }
}

/// Takes one element from a positional record's remaining count.
fn take(left: &mut usize) -> bool {
    if *left == 0 {
        false
    } else {
        *left -= 1;
        true
    }
}
