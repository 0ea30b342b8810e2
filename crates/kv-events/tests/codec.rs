//! The codec against byte sequences written out by hand from msgspec's
//! rules, plus round trips and hostile payloads.
//!
//! msgspec's MessagePack rules used below (msgspec `Encoder`): a Python
//! float is always `float 64` (`cb` + 8 bytes big-endian); an int takes the
//! smallest form (`00..7f` positive fixint, `cc` uint 8, `cd` uint 16, `ce`
//! uint 32, `cf` uint 64; negatives `e0..ff`, `d0`..`d3`); a str under 32
//! bytes is a fixstr `a0 | len`; `bytes` is `bin 8` (`c4 len`); `None` is
//! `c0`; a list is a fixarray `90 | len` (up to 15) or `dc` + 16-bit
//! length. A struct with `array_like=True` is an array of its fields in
//! declaration order; `tag=True` puts the class name first (as the first
//! element, or as the `"type"` key of a map); `omit_defaults=True` leaves
//! out fields equal to their default (at the end of an array, anywhere in a
//! map).
#![cfg(not(loom))]

use kv_events::{
    BlockHash, BlockRemoved, BlockStored, DecodeError, DecodeLimits, EventBatch, KvEvent, Value,
    WireFormat, decode_batch, decode_batch_with, encode_batch, encode_batch_as,
};
use proptest::prelude::*;

/// Bytes from hex chunks (spaces ignored), so each chunk can carry its
/// comment.
fn hex(chunks: &[&str]) -> Vec<u8> {
    let digits: String = chunks
        .concat()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap())
        .collect()
}

/// A batch as a vLLM release after pull request #42892 sends it (captured
/// from vLLM 0.26 in kthena issue #1535): the batch positional, the event a
/// tagged map with the fields of the current `BlockStored`.
fn vllm_map_event_bytes() -> Vec<u8> {
    hex(&[
        "93",                                    // EventBatch, array_like: [ts, events, rank]
        "cb 41daa8dbe0359fe7",                   // ts = 1789095808.8378847 as float 64
        "91",                                    // events: one
        "8b",                                    // map of 11: the tag and 10 fields
        "a4 74797065",                           // "type"
        "ab 426c6f636b53746f726564",             // "BlockStored"
        "ac 626c6f636b5f686173686573",           // "block_hashes"
        "91 cf dab89baa7b5857c0",                // [15760518052499183552] (uint 64)
        "b1 706172656e745f626c6f636b5f68617368", // "parent_block_hash"
        "c0",                                    // None
        "a9 746f6b656e5f696473",                 // "token_ids"
        "dc 0010",                               // array 16 (more than a fixarray holds)
        "ce 0002505c cd 0368 cc c6 cd 2368 cd 0176 cd 0117 cd 1a42 cd 013b",
        "cd 15f0 1e ce 0002505d cc c6 ce 0002505c ce 00012d23 cc c6 ce 00025073",
        "aa 626c6f636b5f73697a65",                 // "block_size"
        "10",                                      // 16
        "a7 6c6f72615f6964 c0",                    // "lora_id": None (no default: written)
        "a6 6d656469756d a3 475055",               // "medium": "GPU"
        "a9 6c6f72615f6e616d65 c0",                // "lora_name": None
        "aa 65787472615f6b657973 91 c0",           // "extra_keys": [None] (not the default)
        "a9 67726f75705f696478 00",                // "group_idx": 0
        "b2 6b765f63616368655f737065635f6b696e64", // "kv_cache_spec_kind"
        "ae 66756c6c5f617474656e74696f6e",         // "full_attention"
        // kv_cache_spec_sliding_window is None = its default: omitted.
        "00", // data_parallel_rank = 0
    ])
}

fn vllm_map_event_batch() -> EventBatch {
    let mut stored = BlockStored::new(
        vec![BlockHash::Int(15_760_518_052_499_183_552)],
        None,
        vec![
            151_644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151_645, 198, 151_644, 77091,
            198, 151_667,
        ],
        16,
    );
    stored.medium = Some("GPU".into());
    stored.extra_keys = Some(vec![None]);
    stored.group_idx = Some(0);
    stored.kv_cache_spec_kind = Some("full_attention".into());
    EventBatch {
        ts: 1_789_095_808.837_884_7,
        events: vec![KvEvent::BlockStored(stored)],
        data_parallel_rank: Some(0),
    }
}

#[test]
fn decodes_a_vllm_batch_with_map_events() {
    let decoded = decode_batch(&vllm_map_event_bytes()).unwrap();
    assert_eq!(decoded.batch, vllm_map_event_batch());
    assert_eq!(decoded.unknown_events, 0);
}

#[test]
fn encodes_the_same_bytes_as_msgspec_for_map_events() {
    assert_eq!(
        encode_batch_as(&vllm_map_event_batch(), WireFormat::NAMED_EVENTS),
        vllm_map_event_bytes()
    );
    // NAMED_EVENTS is the default.
    assert_eq!(
        encode_batch(&vllm_map_event_batch()),
        vllm_map_event_bytes()
    );
}

/// The positional shape (vLLM before #42892, `array_like=True` events).
fn vllm_positional_bytes() -> Vec<u8> {
    hex(&[
        "93",                  // [ts, events, rank]
        "cb 3ff8000000000000", // 1.5
        "93",                  // three events
        // BlockStored: tag + the seven fields without default; the four
        // fields with a None default are all None, so all omitted.
        "98",
        "ab 426c6f636b53746f726564", // "BlockStored"
        "92 07 cd 012c",             // block_hashes [7, 300]
        "05",                        // parent_block_hash 5
        "94 01 02 03 04",            // token_ids
        "02",                        // block_size 2
        "c0",                        // lora_id None
        "a3 475055",                 // medium "GPU"
        "a5 6164617074",             // lora_name "adapt"
        // BlockRemoved: [tag, block_hashes, medium]; group_idx omitted.
        "93",
        "ac 426c6f636b52656d6f766564", // "BlockRemoved"
        "91 07",                       // [7]
        "a3 475055",                   // "GPU"
        // AllBlocksCleared: just the tag.
        "91",
        "b0 416c6c426c6f636b73436c6561726564", // "AllBlocksCleared"
        "02",                                  // data_parallel_rank 2
    ])
}

fn positional_batch() -> EventBatch {
    let mut stored = BlockStored::new(
        vec![BlockHash::Int(7), BlockHash::Int(300)],
        Some(BlockHash::Int(5)),
        vec![1, 2, 3, 4],
        2,
    );
    stored.medium = Some("GPU".into());
    stored.lora_name = Some("adapt".into());
    let mut removed = BlockRemoved::new(vec![BlockHash::Int(7)]);
    removed.medium = Some("GPU".into());
    EventBatch {
        ts: 1.5,
        events: vec![
            KvEvent::BlockStored(stored),
            KvEvent::BlockRemoved(removed),
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(2),
    }
}

#[test]
fn positional_shape_decodes_and_encodes_byte_for_byte() {
    let bytes = vllm_positional_bytes();
    let decoded = decode_batch(&bytes).unwrap();
    assert_eq!(decoded.batch, positional_batch());
    assert_eq!(
        encode_batch_as(&positional_batch(), WireFormat::POSITIONAL),
        bytes
    );
}

#[test]
fn older_engines_send_shorter_arrays() {
    // The first vLLM version: [ts, events] without rank; BlockStored ending
    // at lora_id, BlockRemoved without medium.
    let bytes = hex(&[
        "92 cb 3ff0000000000000",
        "92",
        "96 ab 426c6f636b53746f726564 91 2a c0 92 01 02 02 c0",
        "92 ac 426c6f636b52656d6f766564 91 2a",
    ]);
    let decoded = decode_batch(&bytes).unwrap();
    let stored = BlockStored::new(vec![BlockHash::Int(42)], None, vec![1, 2], 2);
    assert_eq!(
        decoded.batch,
        EventBatch {
            ts: 1.0,
            events: vec![
                KvEvent::BlockStored(stored),
                KvEvent::BlockRemoved(BlockRemoved::new(vec![BlockHash::Int(42)])),
            ],
            data_parallel_rank: None,
        }
    );
}

#[test]
fn unknown_tags_and_added_fields_are_skipped() {
    let bytes = hex(&[
        "94 cb 3ff0000000000000", // a batch with a fourth, unknown element
        "94",
        // An unknown positional event with nested content.
        "93 ab 426c6f636b50696e6e6564 92 01 92 02 03 81 a1 6b c0",
        // BlockRemoved with medium, group_idx and two fields from the future.
        "95 ac 426c6f636b52656d6f766564 91 07 c0 03 a1 78",
        // An unknown map event.
        "82 a4 74797065 a4 4e657874 a1 78 93 01 02 03",
        // AllBlocksCleared as a map with an unknown key before the tag.
        "82 a1 7a c3 a4 74797065 b0 416c6c426c6f636b73436c6561726564",
        "01",
        "c0", // the unknown fourth batch element
    ]);
    let bytes: Vec<u8> = bytes;
    let decoded = decode_batch(&bytes).unwrap();
    assert_eq!(decoded.unknown_events, 2);
    let mut removed = BlockRemoved::new(vec![BlockHash::Int(7)]);
    removed.group_idx = Some(3);
    assert_eq!(
        decoded.batch.events,
        vec![KvEvent::BlockRemoved(removed), KvEvent::AllBlocksCleared]
    );
    assert_eq!(decoded.batch.data_parallel_rank, Some(1));
}

#[test]
fn bytes_and_negative_hashes() {
    let digest: Vec<u8> = (0..32).collect();
    let mut chunks = vec![
        "92 cb 3ff0000000000000 91".to_owned(),
        // BlockStored with a 32-byte bin hash, a negative parent (Python's
        // hash), then the tag key last: field order is free in a map.
        "85".to_owned(),
        "ac 626c6f636b5f686173686573 91 c4 20".to_owned(),
    ];
    chunks.push(digest.iter().map(|b| format!("{b:02x}")).collect());
    chunks.push("b1 706172656e745f626c6f636b5f68617368 fb".to_owned()); // -5
    chunks.push("a9 746f6b656e5f696473 90 aa 626c6f636b5f73697a65 10".to_owned());
    chunks.push("a4 74797065 ab 426c6f636b53746f726564".to_owned());
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let decoded = decode_batch(&hex(&refs)).unwrap();
    let KvEvent::BlockStored(stored) = &decoded.batch.events[0] else {
        panic!("expected BlockStored, got {:?}", decoded.batch.events);
    };
    assert_eq!(stored.block_hashes, vec![BlockHash::Bytes(digest.into())]);
    assert_eq!(
        stored.parent_block_hash,
        Some(BlockHash::Int((-5i64) as u64))
    );
    assert!(stored.token_ids.is_empty());
    assert_eq!(stored.block_size, 16);
}

#[test]
fn named_batch_shape_decodes() {
    // The batch as a map, as the latest `EventBatch` declaration reads.
    let batch = positional_batch();
    let bytes = encode_batch_as(&batch, WireFormat::NAMED);
    assert_eq!(bytes[0], 0x83, "a map of ts, events, data_parallel_rank");
    assert_eq!(decode_batch(&bytes).unwrap().batch, batch);
}

/// What an expected error must look like.
type Check = fn(&DecodeError) -> bool;

#[test]
fn malformed_payloads_are_typed_errors() {
    let cases: Vec<(Vec<u8>, Check)> = vec![
        (vec![], |e| {
            matches!(e, DecodeError::Truncated { offset: 0 })
        }),
        (hex(&["92 cb 3ff0"]), |e| {
            matches!(e, DecodeError::Truncated { .. })
        }),
        (hex(&["c1"]), |e| {
            matches!(e, DecodeError::UnsupportedMarker { marker: 0xc1, .. })
        }),
        (hex(&["2a"]), |e| {
            matches!(e, DecodeError::UnexpectedType { field: "batch", .. })
        }),
        (hex(&["91 cb 3ff0000000000000"]), |e| {
            matches!(
                e,
                DecodeError::MissingField {
                    field: "events",
                    ..
                }
            )
        }),
        // An array declaring 4 billion events in 5 bytes: refused before
        // any allocation.
        (hex(&["92 00 dd ffffffff"]), |e| {
            matches!(e, DecodeError::Truncated { .. })
        }),
        // A negative token id.
        (
            hex(&["92 00 91 95 ab 426c6f636b53746f726564 90 c0 91 ff 01"]),
            |e| {
                matches!(
                    e,
                    DecodeError::OutOfRange {
                        field: "token_ids",
                        ..
                    }
                )
            },
        ),
        // block_size above u32.
        (
            hex(&["92 00 91 95 ab 426c6f636b53746f726564 90 c0 90 cf 0000000100000000"]),
            |e| {
                matches!(
                    e,
                    DecodeError::OutOfRange {
                        field: "block_size",
                        ..
                    }
                )
            },
        ),
        // A BlockStored without token_ids.
        (hex(&["92 00 91 93 ab 426c6f636b53746f726564 90 c0"]), |e| {
            matches!(
                e,
                DecodeError::MissingField {
                    field: "token_ids",
                    ..
                }
            )
        }),
        // A string hash.
        (
            hex(&["92 00 91 92 ac 426c6f636b52656d6f766564 91 a1 78"]),
            |e| {
                matches!(
                    e,
                    DecodeError::UnexpectedType {
                        field: "block_hashes",
                        ..
                    }
                )
            },
        ),
        // Invalid UTF-8 in medium.
        (
            hex(&["92 00 91 93 ac 426c6f636b52656d6f766564 90 a1 ff"]),
            |e| {
                matches!(
                    e,
                    DecodeError::InvalidUtf8 {
                        field: "medium",
                        ..
                    }
                )
            },
        ),
        // A map event without a tag.
        (hex(&["92 00 91 81 a1 78 00"]), |e| {
            matches!(e, DecodeError::MissingField { field: "type", .. })
        }),
        (hex(&["92 00 90 00"]), |e| {
            matches!(e, DecodeError::TrailingBytes { count: 1 })
        }),
    ];
    for (i, (bytes, check)) in cases.iter().enumerate() {
        let err = decode_batch(bytes).expect_err(&format!("case {i} should fail"));
        assert!(check(&err), "case {i}: unexpected error {err:?}");
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn limits_are_enforced() {
    let mut limits = DecodeLimits::default();
    limits.max_block_hashes = 2;
    let bytes = hex(&["92 00 91 92 ac 426c6f636b52656d6f766564 93 01 02 03"]);
    assert_eq!(
        decode_batch_with(&bytes, &limits),
        Err(DecodeError::LimitExceeded {
            what: "block_hashes",
            len: 3,
            limit: 2
        })
    );
    let mut limits = DecodeLimits::default();
    limits.max_payload_bytes = 4;
    assert!(matches!(
        decode_batch_with(&bytes, &limits),
        Err(DecodeError::LimitExceeded {
            what: "payload bytes",
            ..
        })
    ));
    // Deeply nested extra keys stop at the depth limit.
    let mut deep = hex(&[
        "92 00 91 99 ab 426c6f636b53746f726564 90 c0 90 01 c0 c0 c0",
        "91", // extra_keys: one entry
    ]);
    deep.extend(std::iter::repeat_n(0x91, 40));
    deep.push(0xc0);
    let err = decode_batch(&deep).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::LimitExceeded {
                what: "extra key nesting",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_deep_nest_inside_an_unknown_event_is_skipped_without_recursion() {
    let mut bytes = hex(&["92 00 91 92 a1 51"]);
    bytes.extend(std::iter::repeat_n(0x91, 200_000));
    bytes.push(0xc0);
    let decoded = decode_batch(&bytes).unwrap();
    assert_eq!(decoded.unknown_events, 1);
    assert!(decoded.batch.events.is_empty());
}

fn hash_strategy() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        any::<u64>().prop_map(BlockHash::Int),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(|b| BlockHash::Bytes(b.into())),
    ]
}

fn value_strategy() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::UInt),
        (i64::MIN..0).prop_map(Value::Int),
        (-1e9f64..1e9).prop_map(Value::Float),
        "[a-z]{0,40}".prop_map(Value::Str),
        prop::collection::vec(any::<u8>(), 0..8).prop_map(Value::Bytes),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

fn opt_string() -> impl Strategy<Value = Option<String>> {
    prop::option::of("[A-Za-z_]{0,40}")
}

fn event_strategy() -> impl Strategy<Value = KvEvent> {
    let stored = (
        prop::collection::vec(hash_strategy(), 0..5),
        prop::option::of(hash_strategy()),
        prop::collection::vec(any::<u32>(), 0..40),
        any::<u32>(),
        (prop::option::of(any::<u64>()), opt_string(), opt_string()),
        // `extra_keys: list[tuple | None] | None`: each entry a tuple or None.
        prop::option::of(prop::collection::vec(
            prop::option::of(prop::collection::vec(value_strategy(), 0..3).prop_map(Value::Array)),
            0..3,
        )),
        (
            prop::option::of(any::<u32>()),
            opt_string(),
            prop::option::of(any::<u64>()),
        ),
    )
        .prop_map(
            |(
                hashes,
                parent,
                tokens,
                size,
                (lora_id, medium, lora_name),
                extra,
                (group, kind, window),
            )| {
                let mut ev = BlockStored::new(hashes, parent, tokens, size);
                ev.lora_id = lora_id;
                ev.medium = medium;
                ev.lora_name = lora_name;
                ev.extra_keys = extra;
                ev.group_idx = group;
                ev.kv_cache_spec_kind = kind;
                ev.kv_cache_spec_sliding_window = window;
                KvEvent::BlockStored(ev)
            },
        );
    let removed = (
        prop::collection::vec(hash_strategy(), 0..5),
        opt_string(),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(hashes, medium, group)| {
            let mut ev = BlockRemoved::new(hashes);
            ev.medium = medium;
            ev.group_idx = group;
            KvEvent::BlockRemoved(ev)
        });
    prop_oneof![4 => stored, 3 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

fn batch_strategy() -> impl Strategy<Value = EventBatch> {
    (
        -1e12f64..1e12,
        prop::collection::vec(event_strategy(), 0..20),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

proptest! {
    #[test]
    fn every_shape_round_trips(batch in batch_strategy()) {
        for format in [WireFormat::POSITIONAL, WireFormat::NAMED_EVENTS, WireFormat::NAMED] {
            let bytes = encode_batch_as(&batch, format);
            let decoded = decode_batch(&bytes).unwrap();
            prop_assert_eq!(&decoded.batch, &batch);
            prop_assert_eq!(decoded.unknown_events, 0);
        }
    }

    #[test]
    fn truncations_and_flips_never_panic(batch in batch_strategy(), cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>()) {
        let bytes = encode_batch(&batch);
        let cut = cut.index(bytes.len());
        prop_assert!(decode_batch(&bytes[..cut]).is_err());
        let mut flipped = bytes.clone();
        let at = flip.0.index(flipped.len());
        flipped[at] ^= flip.1;
        kv_events::fuzzing::decode_roundtrip(&flipped);
    }
}
