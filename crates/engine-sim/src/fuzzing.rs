//! Fuzz entry points (see the workspace's fuzz convention). Each function
//! must never panic, whatever the input.

use crate::api::{Endpoint, parse_request};
use crate::fault::parse_fault_header;
use crate::transfer::KvTransferParams;

/// Parses `data` as a chat and as a completions body, and reads any
/// `kv_transfer_params` it carries; then parses it as a fault header.
pub fn parse_request_body(data: &[u8]) {
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        if let Ok(request) = parse_request(endpoint, data)
            && let Some(params) = &request.kv_transfer_params
        {
            let _ = KvTransferParams::from_json(params);
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = parse_fault_header(text);
    }
}
