//! The flow's limits and switches.

/// Limits and switches of the flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowConfig {
    /// Prefill attempts in sequential mode, including the first. Default 3.
    pub max_prefill_attempts: u32,
    /// Largest prefill response read. Default 16 MiB (block id lists of
    /// long prompts are large).
    pub max_prefill_response_bytes: usize,
    /// Largest non-streaming decode response read for merging. Default
    /// 64 MiB.
    pub max_decode_response_bytes: usize,
    /// Largest error body kept for the client. Default 64 KiB.
    pub max_error_body_bytes: usize,
    /// Merge usage and prompt logprobs of the prefill response into
    /// non-streaming decode responses. Default true.
    pub merge_non_streaming: bool,
    /// Rewrite the usage events of streaming responses whose client asked
    /// for usage (`stream_options.include_usage` or
    /// `continuous_usage_stats`) with the prefill's prompt accounting.
    /// Default true.
    pub rewrite_streaming_usage: bool,
    /// Largest partial SSE event buffered while rewriting usage; a larger
    /// one is passed through unrewritten. Default 1 MiB.
    pub max_sse_event_bytes: usize,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            max_prefill_attempts: 3,
            max_prefill_response_bytes: 16 << 20,
            max_decode_response_bytes: 64 << 20,
            max_error_body_bytes: 64 << 10,
            merge_non_streaming: true,
            rewrite_streaming_usage: true,
            max_sse_event_bytes: 1 << 20,
        }
    }
}
