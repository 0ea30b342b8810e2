//! Bearer credentials: reading one from a request, and comparing it with
//! a configured key in time that does not leak the key (the API keys and
//! the peer replicas' token).

use http::header;

/// Compares a presented key with the configured one in time that depends
/// only on their lengths, so response timing does not reveal how many
/// leading characters of a guess were right.
pub(crate) fn same_key(presented: &str, key: &str) -> bool {
    let (presented, key) = (presented.as_bytes(), key.as_bytes());
    if presented.len() != key.len() {
        return false;
    }
    let difference = presented
        .iter()
        .zip(key)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    // Keep the optimizer from turning the fold into an early exit.
    std::hint::black_box(difference) == 0
}

pub(crate) fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::HeaderValue;

    #[test]
    fn keys_match_only_when_equal() {
        assert!(same_key("secret-key", "secret-key"));
        assert!(!same_key("secret-kez", "secret-key"));
        assert!(!same_key("secret", "secret-key"));
        assert!(!same_key("", "k"));
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  k1"),
        );
        assert_eq!(bearer(&headers), Some("k1"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k1"));
        assert_eq!(bearer(&headers), None);
    }
}
