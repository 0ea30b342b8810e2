//! What a policy knows about the request it places.

/// The prefix a cache-aware policy matches: request text or token ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutingInput<'a> {
    /// No routing text was extracted (cache-aware treats this as a miss).
    #[default]
    None,
    /// The request's routing text (e.g. the concatenated prompt).
    Text(&'a str),
    /// The request's token ids, when the host tokenizes.
    Tokens(&'a [u32]),
}

/// Where a hash key came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashKeySource {
    /// An explicit session header (e.g. `x-session-id`).
    Session,
    /// The OpenAI `user` field of the request body.
    User,
    /// The value of a header the operator configured.
    Header,
}

/// Keys hash policies place a request by.
///
/// Precedence: [`session`](Self::session), then [`user`](Self::user), then
/// [`header`](Self::header). An empty string counts as absent. A request
/// with none of them is placed by a load-aware fallback (and the decision
/// says so), so keyless traffic does not pile onto one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashKeys<'a> {
    /// Explicit session id header value.
    pub session: Option<&'a str>,
    /// The request's `user` field.
    pub user: Option<&'a str>,
    /// The value of the operator-configured header.
    pub header: Option<&'a str>,
}

impl<'a> HashKeys<'a> {
    /// The key that decides placement, by the documented precedence.
    pub fn first(&self) -> Option<(HashKeySource, &'a str)> {
        let present = |k: Option<&'a str>| k.filter(|s| !s.is_empty());
        present(self.session)
            .map(|k| (HashKeySource::Session, k))
            .or_else(|| present(self.user).map(|k| (HashKeySource::User, k)))
            .or_else(|| present(self.header).map(|k| (HashKeySource::Header, k)))
    }
}

/// Everything a policy may look at about one request. Borrowed from the
/// host's request; building one allocates nothing.
///
/// ```
/// use lb_policies::{HashKeySource, RequestContext};
///
/// let ctx = RequestContext::new("llama-3-8b")
///     .with_text("You are a helpful assistant. Hi!")
///     .with_user("alice")
///     .with_request_id("req-1");
/// assert_eq!(ctx.keys.first(), Some((HashKeySource::User, "alice")));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestContext<'a> {
    /// The model the request names (policies are kept per model).
    pub model: &'a str,
    /// The text or tokens cache-aware routing matches.
    pub routing: RoutingInput<'a>,
    /// Keys for hash policies.
    pub keys: HashKeys<'a>,
    /// The request id, for the host's logs; policies do not route by it.
    pub request_id: Option<&'a str>,
}

impl<'a> RequestContext<'a> {
    /// A context for `model` with no routing input and no keys.
    pub fn new(model: &'a str) -> Self {
        RequestContext {
            model,
            ..RequestContext::default()
        }
    }

    /// Sets the routing text.
    #[must_use]
    pub fn with_text(mut self, text: &'a str) -> Self {
        self.routing = RoutingInput::Text(text);
        self
    }

    /// Sets the routing token ids.
    #[must_use]
    pub fn with_tokens(mut self, tokens: &'a [u32]) -> Self {
        self.routing = RoutingInput::Tokens(tokens);
        self
    }

    /// Sets the session id (highest hash-key precedence).
    #[must_use]
    pub fn with_session(mut self, session: &'a str) -> Self {
        self.keys.session = Some(session);
        self
    }

    /// Sets the `user` field (second hash-key precedence).
    #[must_use]
    pub fn with_user(mut self, user: &'a str) -> Self {
        self.keys.user = Some(user);
        self
    }

    /// Sets the configured header's value (lowest hash-key precedence).
    #[must_use]
    pub fn with_header_key(mut self, value: &'a str) -> Self {
        self.keys.header = Some(value);
        self
    }

    /// Sets the request id.
    #[must_use]
    pub fn with_request_id(mut self, id: &'a str) -> Self {
        self.request_id = Some(id);
        self
    }
}

/// The owned form of [`RoutingInput`], for a host that keeps a request's
/// routing input across several selections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RoutingInputBuf {
    /// No routing text could be derived (the policy routes without affinity).
    #[default]
    None,
    /// Text, as the cache-aware tree keys it.
    Text(String),
    /// Token ids, when the host tokenizes or the client sent them.
    Tokens(Vec<u32>),
}

impl RoutingInputBuf {
    /// The borrowed form a [`RequestContext`] carries.
    pub fn as_input(&self) -> RoutingInput<'_> {
        match self {
            Self::None => RoutingInput::None,
            Self::Text(text) => RoutingInput::Text(text),
            Self::Tokens(tokens) => RoutingInput::Tokens(tokens),
        }
    }

    /// The text, when the input is text.
    pub fn text(&self) -> Option<&str> {
        match self {
            Self::Text(text) => Some(text),
            _ => None,
        }
    }

    /// The token ids, when the input is tokens.
    pub fn tokens(&self) -> Option<&[u32]> {
        match self {
            Self::Tokens(tokens) => Some(tokens),
            _ => None,
        }
    }
}

/// The owned form of [`RequestContext`]: what a host keeps about one request
/// when it selects more than once for it (a retry, a second role), so every
/// selection sees the same context.
///
/// ```
/// use lb_policies::{HashKeySource, OwnedContext, RoutingInputBuf};
///
/// let request = OwnedContext {
///     model: "llama".into(),
///     routing: RoutingInputBuf::Text("You are a helpful assistant.".into()),
///     user: Some("alice".into()),
///     ..OwnedContext::default()
/// };
/// let ctx = request.context();
/// assert_eq!(ctx.model, "llama");
/// assert_eq!(ctx.keys.first(), Some((HashKeySource::User, "alice")));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedContext {
    /// The model the request names (empty: any).
    pub model: String,
    /// What cache-aware routing matches.
    pub routing: RoutingInputBuf,
    /// Explicit session id (highest hash-key precedence).
    pub session: Option<String>,
    /// The request's `user` field.
    pub user: Option<String>,
    /// The value of the operator-configured hash header.
    pub header: Option<String>,
    /// The request id, for logs.
    pub request_id: Option<String>,
}

impl OwnedContext {
    /// The context a policy reads, borrowed from this request.
    pub fn context(&self) -> RequestContext<'_> {
        RequestContext {
            model: &self.model,
            routing: self.routing.as_input(),
            keys: HashKeys {
                session: self.session.as_deref(),
                user: self.user.as_deref(),
                header: self.header.as_deref(),
            },
            request_id: self.request_id.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_key_precedence_is_session_user_header() {
        let all = RequestContext::new("m")
            .with_header_key("h")
            .with_user("u")
            .with_session("s");
        assert_eq!(all.keys.first(), Some((HashKeySource::Session, "s")));
        let no_session = RequestContext::new("m").with_header_key("h").with_user("u");
        assert_eq!(no_session.keys.first(), Some((HashKeySource::User, "u")));
        let header_only = RequestContext::new("m").with_header_key("h");
        assert_eq!(header_only.keys.first(), Some((HashKeySource::Header, "h")));
        assert_eq!(RequestContext::new("m").keys.first(), None);
    }

    #[test]
    fn empty_keys_count_as_absent() {
        let ctx = RequestContext::new("m").with_session("").with_user("u");
        assert_eq!(ctx.keys.first(), Some((HashKeySource::User, "u")));
        let ctx = RequestContext::new("m").with_session("").with_user("");
        assert_eq!(ctx.keys.first(), None);
    }
}
