//! Encoding a batch the way msgspec does: the smallest integer and string
//! forms, floats as float 64, and `omit_defaults` (fields whose default is
//! `None` are left out when `None`: from a map, or from the end of an
//! array).

use crate::value::Value;
use crate::wire::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, TAG_BLOCK_REMOVED, TAG_BLOCK_STORED,
    WireFormat,
};

/// Encodes `batch` in the default [`WireFormat`].
#[must_use]
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    encode_batch_as(batch, WireFormat::default())
}

/// Encodes `batch` in the given shape.
#[must_use]
pub fn encode_batch_as(batch: &EventBatch, format: WireFormat) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    let rank = batch.data_parallel_rank;
    if format.batch_as_map {
        w.map_len(2 + usize::from(rank.is_some()));
        w.str("ts");
        w.f64(batch.ts);
        w.str("events");
        w.events(&batch.events, format);
        if let Some(rank) = rank {
            w.str("data_parallel_rank");
            w.uint(u64::from(rank));
        }
    } else {
        w.array_len(2 + usize::from(rank.is_some()));
        w.f64(batch.ts);
        w.events(&batch.events, format);
        if let Some(rank) = rank {
            w.uint(u64::from(rank));
        }
    }
    w.0
}

struct Writer(Vec<u8>);

impl Writer {
    fn marker_len(
        &mut self,
        len: usize,
        fix: u8,
        fix_max: usize,
        m8: Option<u8>,
        m16: u8,
        m32: u8,
    ) {
        if len <= fix_max {
            self.0.push(fix | len as u8);
        } else if let (Some(m8), true) = (m8, len <= 0xff) {
            self.0.push(m8);
            self.0.push(len as u8);
        } else if len <= 0xffff {
            self.0.push(m16);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            // Lengths above u32::MAX cannot come from a decoded batch (the
            // decoder's limits are far below) and are clamped here.
            self.0.push(m32);
            let len = u32::try_from(len).unwrap_or(u32::MAX);
            self.0.extend_from_slice(&len.to_be_bytes());
        }
    }

    fn array_len(&mut self, len: usize) {
        self.marker_len(len, 0x90, 15, None, 0xdc, 0xdd);
    }

    fn map_len(&mut self, len: usize) {
        self.marker_len(len, 0x80, 15, None, 0xde, 0xdf);
    }

    fn str(&mut self, s: &str) {
        self.marker_len(s.len(), 0xa0, 31, Some(0xd9), 0xda, 0xdb);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn bin(&mut self, b: &[u8]) {
        if b.len() <= 0xff {
            self.0.push(0xc4);
            self.0.push(b.len() as u8);
        } else if b.len() <= 0xffff {
            self.0.push(0xc5);
            self.0.extend_from_slice(&(b.len() as u16).to_be_bytes());
        } else {
            self.0.push(0xc6);
            let len = u32::try_from(b.len()).unwrap_or(u32::MAX);
            self.0.extend_from_slice(&len.to_be_bytes());
        }
        self.0.extend_from_slice(b);
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if v <= 0xff {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.0.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }

    fn hash(&mut self, h: &BlockHash) {
        match h {
            BlockHash::Int(v) => self.uint(*v),
            BlockHash::Bytes(b) => self.bin(b),
        }
    }

    fn opt_hash(&mut self, h: Option<&BlockHash>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }

    fn hashes(&mut self, hashes: &[BlockHash]) {
        self.array_len(hashes.len());
        for h in hashes {
            self.hash(h);
        }
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.nil(),
            Value::Bool(b) => self.0.push(if *b { 0xc3 } else { 0xc2 }),
            Value::UInt(v) => self.uint(*v),
            Value::Int(v) => self.int(*v),
            Value::Float(v) => self.f64(*v),
            Value::Str(s) => self.str(s),
            Value::Bytes(b) => self.bin(b),
            Value::Array(items) => {
                self.array_len(items.len());
                for item in items {
                    self.value(item);
                }
            }
            Value::Map(entries) => {
                self.map_len(entries.len());
                for (k, v) in entries {
                    self.value(k);
                    self.value(v);
                }
            }
        }
    }

    fn extra_keys(&mut self, keys: Option<&[Option<Value>]>) {
        let Some(keys) = keys else {
            self.nil();
            return;
        };
        self.array_len(keys.len());
        for key in keys {
            match key {
                Some(v) => self.value(v),
                None => self.nil(),
            }
        }
    }

    fn events(&mut self, events: &[KvEvent], format: WireFormat) {
        self.array_len(events.len());
        for event in events {
            match event {
                KvEvent::BlockStored(ev) => self.stored(ev, format.events_as_maps),
                KvEvent::BlockRemoved(ev) => self.removed(ev, format.events_as_maps),
                KvEvent::AllBlocksCleared => {
                    if format.events_as_maps {
                        self.map_len(1);
                        self.str("type");
                    } else {
                        self.array_len(1);
                    }
                    self.str(event.tag());
                }
            }
        }
    }

    /// A field name, in the map shape only.
    fn key(&mut self, as_map: bool, name: &str) {
        if as_map {
            self.str(name);
        }
    }

    fn stored(&mut self, ev: &BlockStored, as_map: bool) {
        // The fields with a `None` default, in declaration order; msgspec
        // leaves them out when `None`.
        let set = [
            ev.extra_keys.is_some(),
            ev.group_idx.is_some(),
            ev.kv_cache_spec_kind.is_some(),
            ev.kv_cache_spec_sliding_window.is_some(),
        ];
        // In a map every set one is written; in an array only a run of
        // unset ones at the end can be left out, so every field up to the
        // last set one is written (`nil` for the unset ones before it).
        let last_set = set.iter().rposition(|s| *s).map_or(0, |i| i + 1);
        let write = |i: usize| if as_map { set[i] } else { i < last_set };
        let optional = (0..set.len()).filter(|i| write(*i)).count();
        // The tag and the seven fields without a default.
        if as_map {
            self.map_len(8 + optional);
            self.str("type");
        } else {
            self.array_len(8 + optional);
        }
        self.str(TAG_BLOCK_STORED);
        self.key(as_map, "block_hashes");
        self.hashes(&ev.block_hashes);
        self.key(as_map, "parent_block_hash");
        self.opt_hash(ev.parent_block_hash.as_ref());
        self.key(as_map, "token_ids");
        self.array_len(ev.token_ids.len());
        for t in &ev.token_ids {
            self.uint(u64::from(*t));
        }
        self.key(as_map, "block_size");
        self.uint(u64::from(ev.block_size));
        self.key(as_map, "lora_id");
        self.opt_uint(ev.lora_id);
        self.key(as_map, "medium");
        self.opt_str(ev.medium.as_deref());
        self.key(as_map, "lora_name");
        self.opt_str(ev.lora_name.as_deref());
        if write(0) {
            self.key(as_map, "extra_keys");
            self.extra_keys(ev.extra_keys.as_deref());
        }
        if write(1) {
            self.key(as_map, "group_idx");
            self.opt_uint(ev.group_idx.map(u64::from));
        }
        if write(2) {
            self.key(as_map, "kv_cache_spec_kind");
            self.opt_str(ev.kv_cache_spec_kind.as_deref());
        }
        if write(3) {
            self.key(as_map, "kv_cache_spec_sliding_window");
            self.opt_uint(ev.kv_cache_spec_sliding_window);
        }
    }

    fn removed(&mut self, ev: &BlockRemoved, as_map: bool) {
        let with_group = ev.group_idx.is_some();
        // Tag, hashes, medium, and `group_idx` when set.
        let len = 3 + usize::from(with_group);
        if as_map {
            self.map_len(len);
            self.str("type");
        } else {
            self.array_len(len);
        }
        self.str(TAG_BLOCK_REMOVED);
        self.key(as_map, "block_hashes");
        self.hashes(&ev.block_hashes);
        self.key(as_map, "medium");
        self.opt_str(ev.medium.as_deref());
        if with_group {
            self.key(as_map, "group_idx");
            self.opt_uint(ev.group_idx.map(u64::from));
        }
    }
}
