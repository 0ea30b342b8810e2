//! The API keys: which route needs which credential, and a comparison that
//! does not leak a key through response timing.

use super::Router;
use crate::error::ApiError;
use crate::routes::Route;
use http::header;

impl Router {
    /// Checks the credential `route` needs: the inference key for proxied
    /// routes, the admin key (or the inference key when no admin key is
    /// set) for admin routes and admin reads, nothing for probes and
    /// metrics (`/metrics` checks the admin key in its own handler, unless
    /// [`RouterConfig::metrics_open`]). Hosts that serve a route of their own next to
    /// [`Router::handle`] call this rather than parse keys themselves.
    ///
    /// [`RouterConfig::metrics_open`]: crate::RouterConfig::metrics_open
    pub fn authorize(&self, route: Route, headers: &http::HeaderMap) -> Result<(), ApiError> {
        let config = &self.shared.config;
        // Admin reads reveal worker URLs: they need the admin credential
        // exactly like the admin writes.
        let required = if route.is_admin() || route.is_admin_read() {
            config
                .admin_api_key
                .as_deref()
                .or(config.api_key.as_deref())
        } else if route.needs_api_key() {
            config.api_key.as_deref()
        } else {
            None
        };
        match required {
            None => Ok(()),
            Some(key) if bearer(headers).is_some_and(|presented| same_key(presented, key)) => {
                Ok(())
            }
            Some(_) => Err(ApiError::Unauthorized),
        }
    }
}

/// Compares a presented key with the configured one in time that depends
/// only on their lengths, so response timing does not reveal how many
/// leading characters of a guess were right.
fn same_key(presented: &str, key: &str) -> bool {
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

fn bearer(headers: &http::HeaderMap) -> Option<&str> {
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
