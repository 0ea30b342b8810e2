//! The API keys: which route needs which credential, and a comparison that
//! does not leak a key through response timing.

use super::Router;
use crate::bearer::{bearer, same_key};
use crate::error::ApiError;
use crate::routes::Route;

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
