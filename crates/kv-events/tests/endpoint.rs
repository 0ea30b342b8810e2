//! `ZmqEndpoint` as a property: every well-formed endpoint parses to its
//! host and port and displays as the same text; no input panics, and what
//! parses displays as text that parses back to it; a character no address
//! has, anywhere, is refused.
#![cfg(not(loom))]

use std::net::{Ipv4Addr, Ipv6Addr};

use kv_events::{ZmqEndpoint, ZmqEndpointError};
use proptest::prelude::*;

/// A host as a router is given one, and the host `ZmqEndpoint::host`
/// returns for it (IPv6 without its brackets).
fn host() -> impl Strategy<Value = (String, String)> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|octets| {
            let host = Ipv4Addr::from(octets).to_string();
            (host.clone(), host)
        }),
        any::<[u16; 8]>().prop_map(|groups| {
            let host = Ipv6Addr::from(groups).to_string();
            (format!("[{host}]"), host)
        }),
        "[a-zA-Z0-9][a-zA-Z0-9_.-]{0,80}".prop_map(|name| (name.clone(), name)),
    ]
}

/// Text made of the characters the parser cares about, to reach its
/// branches more often than arbitrary strings do.
fn near_miss() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("tcp://"),
            Just(":"),
            Just("["),
            Just("]"),
            Just("/"),
            Just("."),
            Just("@"),
            Just("*"),
            Just("%"),
            Just("\r\n"),
            Just(" "),
            Just("0"),
            Just("5557"),
            Just("65536"),
            Just("::1"),
            Just("10.0.0.1"),
            Just("engine-a"),
            Just("é"),
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
}

fn assert_round_trips(text: &str) -> Result<(), TestCaseError> {
    if let Ok(endpoint) = ZmqEndpoint::parse(text) {
        let shown = endpoint.to_string();
        prop_assert!(shown.len() <= text.len(), "{shown} longer than {text}");
        prop_assert_eq!(ZmqEndpoint::parse(&shown), Ok(endpoint.clone()));
        prop_assert_eq!(
            ZmqEndpoint::new(endpoint.host(), endpoint.port()),
            Ok(endpoint)
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn well_formed_endpoints_parse_and_display_as_written(
        (written, bare) in host(),
        port in 1u16..,
    ) {
        let text = format!("tcp://{written}:{port}");
        let endpoint = ZmqEndpoint::parse(&text)
            .map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        prop_assert_eq!(endpoint.host(), bare.as_str());
        prop_assert_eq!(endpoint.port(), port);
        prop_assert_eq!(endpoint.to_string(), text.clone());
        prop_assert_eq!(endpoint.host_port(), format!("{written}:{port}"));
        prop_assert_eq!(ZmqEndpoint::parse_address(&endpoint.host_port()), Ok(endpoint.clone()));
        let is_ip = bare.parse::<std::net::IpAddr>().is_ok();
        prop_assert_eq!(endpoint.socket_addr().is_some(), is_ip);
    }

    #[test]
    fn no_input_panics_and_what_parses_round_trips(text in any::<String>()) {
        assert_round_trips(&text)?;
        let _ = ZmqEndpoint::parse_address(&text);
    }

    #[test]
    fn near_misses_do_not_panic_and_round_trip(text in near_miss()) {
        assert_round_trips(&text)?;
        let _ = ZmqEndpoint::parse_address(&text);
    }

    /// Whatever the endpoint, one control character or space anywhere in
    /// it is refused, and named.
    #[test]
    fn a_control_character_anywhere_is_refused(
        (written, _) in host(),
        port in 1u16..,
        at in any::<prop::sample::Index>(),
        bad in prop_oneof![Just('\r'), Just('\n'), Just('\0'), Just(' '), Just('\t')],
    ) {
        let mut text = format!("tcp://{written}:{port}");
        let at = at.index(text.len() + 1);
        text.insert(at, bad);
        prop_assert_eq!(ZmqEndpoint::parse(&text), Err(ZmqEndpointError::Whitespace(bad)));
    }
}
