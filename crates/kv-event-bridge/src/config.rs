//! Where the engines publish and how the hub follows them: the
//! configuration, and the (rank, publisher, replay) sockets of a worker.

use std::collections::HashMap;
use std::time::Duration;

use worker_lifecycle::Worker;

/// vLLM's example publisher port.
pub const DEFAULT_PORT: u16 = 5557;
/// vLLM's example replay port.
pub const DEFAULT_REPLAY_PORT: u16 = 5558;

/// Where one worker publishes, when it is not at the default ports of its
/// host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEndpoints {
    /// The PUB socket, e.g. `tcp://10.0.0.5:5557` (rank 0's, with data
    /// parallelism: rank `r` is at the port plus `r`).
    pub endpoint: String,
    /// The replay (ROUTER) socket, or `None` for no replay (gaps then
    /// reset the stream).
    pub replay_endpoint: Option<String>,
}

/// How the router follows the engines' KV events.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct KvEventsConfig {
    /// The publisher's port on each worker's host. Default 5557.
    pub port: u16,
    /// The replay port on each worker's host; `None` turns replay off.
    /// Default 5558.
    pub replay_port: Option<u16>,
    /// The topic prefix to subscribe to (vLLM's `topic`; empty, the
    /// default, takes every topic).
    pub topic: String,
    /// Ranks behind a worker registered without a data-parallel rank:
    /// ranks `0..n` publish at `port + r`. Default 1.
    pub data_parallel_size: u16,
    /// Per worker URL (as the worker was added, e.g.
    /// `http://10.0.0.5:8000`): its own endpoints, instead of the defaults.
    pub endpoints: HashMap<String, KvEndpoints>,
    /// How often membership and stream liveness are re-read. Default
    /// 200 ms.
    pub sync_interval: Duration,
    /// The largest KV event payload (one ZMQ frame) accepted from a
    /// publisher, in bytes; libzmq refuses a larger frame before buffering
    /// it (`ZMQ_MAXMSGSIZE`) and the stream reconnects. Default 16 MiB
    /// ([`kv_events::DecodeLimits`]' `max_payload_bytes`): one scheduler
    /// step's batch is a few KB to a few hundred KB (a 128k-token prefill's
    /// `BlockStored` carries its token ids, about 5 bytes each in
    /// MessagePack, so ~650 KB), and 16 MiB leaves twenty times that.
    pub max_message_size: usize,
    /// The most blocks the router's block index keeps for each
    /// data-parallel rank of a worker (default
    /// [`kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER`]); a rank that reports
    /// more loses its oldest blocks from the index, counted in
    /// `router_kv_index_blocks_total{outcome="evicted_over_cap"}`. An
    /// engine never holds more than its cache (vLLM's `num_gpu_blocks`),
    /// so a publisher that reports more is flooding the index.
    pub max_blocks_per_worker: std::num::NonZeroUsize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            port: DEFAULT_PORT,
            replay_port: Some(DEFAULT_REPLAY_PORT),
            topic: String::new(),
            data_parallel_size: 1,
            endpoints: HashMap::new(),
            sync_interval: Duration::from_millis(200),
            max_message_size: kv_events::DecodeLimits::default().max_payload_bytes,
            max_blocks_per_worker: kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER,
        }
    }
}

impl KvEventsConfig {
    /// Sets one worker's endpoints.
    #[must_use]
    pub fn with_endpoints(mut self, worker_url: impl Into<String>, endpoints: KvEndpoints) -> Self {
        self.endpoints.insert(worker_url.into(), endpoints);
        self
    }

    /// The (rank, publisher, replay) sockets to follow for `worker`.
    /// Empty when an address cannot be formed (a rank whose port would
    /// overflow).
    ///
    /// Where a worker publishes, first found: its URL in
    /// [`endpoints`](Self::endpoints); the addresses its registration
    /// announced (worker-lifecycle's `labels::KV_EVENTS_ENDPOINT` and
    /// `labels::KV_EVENTS_REPLAY_ENDPOINT`); the configured ports on its
    /// host.
    pub fn streams_of(&self, worker: &Worker) -> Vec<(u32, String, Option<String>)> {
        self.streams_with(worker, self.endpoints.get(worker.endpoint().url()))
    }

    /// The endpoints a worker's registration announced, if any.
    fn announced(worker: &Worker) -> Option<KvEndpoints> {
        let labels = worker.labels();
        Some(KvEndpoints {
            endpoint: labels
                .get(worker_lifecycle::labels::KV_EVENTS_ENDPOINT)?
                .clone(),
            replay_endpoint: labels
                .get(worker_lifecycle::labels::KV_EVENTS_REPLAY_ENDPOINT)
                .cloned(),
        })
    }

    /// As [`streams_of`](Self::streams_of), with `own` endpoints instead of
    /// the configured ones.
    pub(crate) fn streams_with(
        &self,
        worker: &Worker,
        own: Option<&KvEndpoints>,
    ) -> Vec<(u32, String, Option<String>)> {
        let endpoint = worker.endpoint();
        let announced = Self::announced(worker);
        let (base, replay) = match own.or(announced.as_ref()) {
            Some(own) => (own.endpoint.clone(), own.replay_endpoint.clone()),
            None => {
                let url = endpoint.worker_url();
                let at = |port: u16| format!("tcp://{}", url.with_port(port).host_port());
                (at(self.port), self.replay_port.map(at))
            }
        };
        let ranks: Vec<u32> = match endpoint.dp_rank() {
            Some(rank) => vec![rank],
            None => (0..u32::from(self.data_parallel_size.max(1))).collect(),
        };
        let mut streams = Vec::with_capacity(ranks.len());
        for rank in ranks {
            let Ok(offset) = u16::try_from(rank) else {
                return Vec::new();
            };
            let Some(pub_at) = kv_events::endpoint_for_rank(&base, offset) else {
                return Vec::new();
            };
            let replay_at = match &replay {
                Some(r) => match kv_events::endpoint_for_rank(r, offset) {
                    Some(at) => Some(at),
                    None => return Vec::new(),
                },
                None => None,
            };
            streams.push((rank, pub_at, replay_at));
        }
        streams
    }
}
