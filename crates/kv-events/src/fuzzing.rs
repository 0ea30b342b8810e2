//! Fuzzing entry points (the cargo-fuzz target `kv_events_decode` and the
//! crate's seed-corpus test call them).

use crate::{DecodeLimits, WireFormat, decode_batch, decode_batch_with, encode_batch_as};

/// Decodes arbitrary bytes as a payload; whatever decodes must encode, in
/// every [`WireFormat`], to bytes that decode again to a batch that
/// encodes to the same bytes (compared as bytes, so a NaN time is fine).
///
/// # Panics
///
/// When that property fails: this is what the fuzzer looks for.
pub fn decode_roundtrip(data: &[u8]) {
    let Ok(decoded) = decode_batch(data) else {
        return;
    };
    // The re-encoding may be longer than the input (float 32 times become
    // float 64), so only the payload size limit is lifted.
    let limits = DecodeLimits {
        max_payload_bytes: usize::MAX,
        ..DecodeLimits::default()
    };
    for format in [
        WireFormat::POSITIONAL,
        WireFormat::NAMED_EVENTS,
        WireFormat::NAMED,
    ] {
        let bytes = encode_batch_as(&decoded.batch, format);
        let again = match decode_batch_with(&bytes, &limits) {
            Ok(again) => again,
            Err(e) => panic!("re-encoded batch does not decode ({format:?}): {e}"),
        };
        assert_eq!(
            again.unknown_events, 0,
            "re-encoding wrote an unknown event"
        );
        assert_eq!(
            again.batch.events.len(),
            decoded.batch.events.len(),
            "event count changed"
        );
        assert_eq!(
            encode_batch_as(&again.batch, format),
            bytes,
            "encoding is not stable ({format:?})"
        );
    }
}
