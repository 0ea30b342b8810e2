//! Errors from building policies.

/// Why a policy could not be created.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// No built-in policy or registered factory has this name.
    #[error("unknown policy `{name}` (known: {known})")]
    UnknownPolicy {
        /// The name asked for.
        name: String,
        /// The names that are known, comma separated.
        known: String,
    },
    /// A knob is out of its valid range.
    #[error("invalid policy configuration: `{field}` {reason}")]
    InvalidConfig {
        /// The knob's name.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
}
