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
///
/// Each list (the publishers, the replay sockets) is one of:
///
/// * **one endpoint**: rank 0's, with data-parallel rank `r` at its port
///   plus `r` (vLLM's `offset_endpoint_port`), as at the default ports;
/// * **one endpoint per rank**, in rank order: rank `r` is at the `r`-th.
///   A worker registered with a rank beyond the list has no socket there:
///   it is not followed (it stays cold, scored from the approximate tree),
///   and the hub logs it and counts it in `router_kv_unplaced_ranks_total`.
///   A worker registered without a rank follows every rank of the longest
///   per-rank list (one API server in front of that many engines).
///
/// An empty replay list means no replay (a gap then resets the stream); an
/// empty publisher list places no rank at all.
///
/// ```
/// use kv_event_bridge::KvEndpoints;
///
/// // One publisher: rank r at port 6000 + r; replay likewise at 6100 + r.
/// let offset = KvEndpoints::new("tcp://10.0.0.5:6000").with_replay("tcp://10.0.0.5:6100");
/// let (publisher, replay) = offset.sockets(2).unwrap();
/// assert_eq!(publisher, "tcp://10.0.0.5:6002");
/// assert_eq!(replay.as_deref(), Some("tcp://10.0.0.5:6102"));
/// assert_eq!(offset.listed_ranks(), None);
///
/// // One publisher per rank, anywhere: no rank 2.
/// let listed = KvEndpoints::per_rank(["tcp://10.0.0.5:6000", "tcp://10.0.0.6:7000"]);
/// assert_eq!(listed.sockets(1), Some(("tcp://10.0.0.6:7000".to_owned(), None)));
/// assert_eq!(listed.sockets(2), None);
/// assert_eq!(listed.listed_ranks(), Some(2));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvEndpoints {
    /// The PUB sockets, e.g. `tcp://10.0.0.5:5557`: one (rank 0's, rank
    /// `r` at its port plus `r`) or one per rank.
    pub publishers: Vec<String>,
    /// The replay (ROUTER) sockets, same shape; empty for no replay (gaps
    /// then reset the stream).
    pub replays: Vec<String>,
}

impl KvEndpoints {
    /// One publisher, rank 0's (rank `r` at its port plus `r`), and no
    /// replay.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            publishers: vec![endpoint.into()],
            replays: Vec::new(),
        }
    }

    /// One publisher per data-parallel rank, in rank order, and no replay
    /// (a list of one is [`new`](Self::new)'s).
    pub fn per_rank<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            publishers: endpoints.into_iter().map(Into::into).collect(),
            replays: Vec::new(),
        }
    }

    /// With one replay socket, rank 0's (rank `r` at its port plus `r`).
    #[must_use]
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replays = vec![endpoint.into()];
        self
    }

    /// With one replay socket per rank, in rank order (empty: no replay).
    #[must_use]
    pub fn with_replays<S: Into<String>>(mut self, endpoints: impl IntoIterator<Item = S>) -> Self {
        self.replays = endpoints.into_iter().map(Into::into).collect();
        self
    }

    /// The ranks a per-rank list names (the longest such list's length),
    /// or `None` when every list is one endpoint (or none): the ranks a
    /// worker registered without a rank follows.
    pub fn listed_ranks(&self) -> Option<u32> {
        [&self.publishers, &self.replays]
            .into_iter()
            .map(Vec::len)
            .filter(|&n| n > 1)
            .max()
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Rank `rank`'s publisher and replay socket (`None` without
    /// replay), or `None` when a list cannot place the rank (a rank beyond
    /// a per-rank list, a port past 65535, no publisher).
    pub fn sockets(&self, rank: u32) -> Option<(String, Option<String>)> {
        let publisher = at_rank(&self.publishers, rank)?;
        let replay = match self.replays.as_slice() {
            [] => None,
            replays => Some(at_rank(replays, rank)?),
        };
        Some((publisher, replay))
    }
}

/// Rank `rank`'s socket of `list`: the `rank`-th of a per-rank list, the
/// one endpoint's port plus `rank` otherwise.
fn at_rank(list: &[String], rank: u32) -> Option<String> {
    match list {
        [] => None,
        [base] => kv_events::endpoint_for_rank(base, u16::try_from(rank).ok()?),
        several => several.get(usize::try_from(rank).ok()?).cloned(),
    }
}

/// The sockets of one worker's ranks, or the ranks none could be formed
/// for (then the worker is not followed at all: a worker is live only
/// when every rank is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StreamPlan {
    /// (rank, publisher, replay) of each rank placed.
    pub(crate) streams: Vec<(u32, String, Option<String>)>,
    /// The ranks with no socket.
    pub(crate) unplaced: Vec<u32>,
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
    /// ranks `0..n` publish at `port + r`. Default 1. A worker whose own
    /// [`KvEndpoints`] list one endpoint per rank follows that many.
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
    /// The one model whose requests the `kv_aware` policies score on the
    /// index (default `None`: every model's). Read by the host that builds
    /// the policies, not by the hub: router-http gives the index-reading
    /// policy to this model alone and `cache_aware` with the same knobs to
    /// every other model (what `kv_aware` does for a worker without a
    /// live stream). For a fleet whose engines serve one model while the
    /// router also forwards others: the index's hashes are that model's
    /// token ids.
    pub model: Option<String>,
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
            model: None,
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
    /// Empty when some rank's address cannot be formed (a rank beyond its
    /// worker's per-rank list, a port that would overflow): the worker is
    /// then not followed.
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
        let endpoints = KvEndpoints::new(
            labels
                .get(worker_lifecycle::labels::KV_EVENTS_ENDPOINT)?
                .clone(),
        );
        Some(
            match labels.get(worker_lifecycle::labels::KV_EVENTS_REPLAY_ENDPOINT) {
                Some(replay) => endpoints.with_replay(replay.clone()),
                None => endpoints,
            },
        )
    }

    /// As [`streams_of`](Self::streams_of), with `own` endpoints instead of
    /// the configured ones.
    pub(crate) fn streams_with(
        &self,
        worker: &Worker,
        own: Option<&KvEndpoints>,
    ) -> Vec<(u32, String, Option<String>)> {
        let plan = self.plan(worker, own);
        if plan.unplaced.is_empty() {
            plan.streams
        } else {
            Vec::new()
        }
    }

    /// Every rank's sockets for `worker` (with `own` endpoints instead of
    /// the configured ones), and the ranks none could be formed for.
    pub(crate) fn plan(&self, worker: &Worker, own: Option<&KvEndpoints>) -> StreamPlan {
        let endpoint = worker.endpoint();
        let announced = Self::announced(worker);
        let endpoints = match own.or(announced.as_ref()) {
            Some(own) => own.clone(),
            None => {
                let url = endpoint.worker_url();
                let at = |port: u16| format!("tcp://{}", url.with_port(port).host_port());
                KvEndpoints::new(at(self.port)).with_replays(self.replay_port.map(at))
            }
        };
        let ranks: Vec<u32> = match endpoint.dp_rank() {
            Some(rank) => vec![rank],
            None => {
                let n = endpoints
                    .listed_ranks()
                    .unwrap_or_else(|| u32::from(self.data_parallel_size.max(1)));
                (0..n).collect()
            }
        };
        let mut plan = StreamPlan {
            streams: Vec::with_capacity(ranks.len()),
            unplaced: Vec::new(),
        };
        for rank in ranks {
            match endpoints.sockets(rank) {
                Some((publisher, replay)) => plan.streams.push((rank, publisher, replay)),
                None => plan.unplaced.push(rank),
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::{KvEndpoints, KvEventsConfig, StreamPlan};
    use std::sync::Arc;
    use worker_lifecycle::{Endpoint, Worker, WorkerOptions, WorkerRole, WorkerSpec};

    fn worker(url: &str, rank: Option<u32>) -> Arc<Worker> {
        let spec = WorkerSpec::new(WorkerRole::Regular, Endpoint::new(url, rank).unwrap());
        Worker::new(spec, 1, &WorkerOptions::default())
    }

    fn own(url: &str, endpoints: KvEndpoints) -> KvEventsConfig {
        KvEventsConfig::default().with_endpoints(url, endpoints)
    }

    #[test]
    fn one_endpoint_keeps_the_port_plus_rank_rule() {
        let config = own(
            "http://10.0.0.5:8000",
            KvEndpoints::new("tcp://10.0.0.9:6000").with_replay("tcp://10.0.0.9:6100"),
        );
        assert_eq!(
            config.streams_of(&worker("http://10.0.0.5:8000", Some(3))),
            vec![(
                3,
                "tcp://10.0.0.9:6003".to_owned(),
                Some("tcp://10.0.0.9:6103".to_owned())
            )]
        );
        let mut dp = config.clone();
        dp.data_parallel_size = 2;
        assert_eq!(
            dp.streams_of(&worker("http://10.0.0.5:8000", None)).len(),
            2,
            "a worker without a rank follows data_parallel_size ranks"
        );
    }

    #[test]
    fn a_per_rank_list_places_each_rank_at_its_own_endpoint() {
        let config = own(
            "http://10.0.0.5:8000",
            KvEndpoints::per_rank(["tcp://a:6000", "tcp://b:7000"])
                .with_replays(["tcp://a:6100", "tcp://b:7100"]),
        );
        assert_eq!(
            config.streams_of(&worker("http://10.0.0.5:8000", Some(1))),
            vec![(
                1,
                "tcp://b:7000".to_owned(),
                Some("tcp://b:7100".to_owned())
            )]
        );
        // Without a rank: every listed rank, whatever data_parallel_size says.
        assert_eq!(
            config.streams_of(&worker("http://10.0.0.5:8000", None)),
            vec![
                (
                    0,
                    "tcp://a:6000".to_owned(),
                    Some("tcp://a:6100".to_owned())
                ),
                (
                    1,
                    "tcp://b:7000".to_owned(),
                    Some("tcp://b:7100".to_owned())
                ),
            ]
        );
        // One publisher list, one replay base: the replay is offset per rank.
        let mixed = own(
            "http://10.0.0.5:8000",
            KvEndpoints::per_rank(["tcp://a:6000", "tcp://b:7000"]).with_replay("tcp://r:9000"),
        );
        assert_eq!(
            mixed.streams_of(&worker("http://10.0.0.5:8000", Some(1))),
            vec![(
                1,
                "tcp://b:7000".to_owned(),
                Some("tcp://r:9001".to_owned())
            )]
        );
    }

    #[test]
    fn a_rank_beyond_the_list_is_unplaced_and_the_worker_not_followed() {
        let config = own(
            "http://10.0.0.5:8000",
            KvEndpoints::per_rank(["tcp://a:6000", "tcp://b:7000"]),
        );
        let beyond = worker("http://10.0.0.5:8000", Some(2));
        assert!(config.streams_of(&beyond).is_empty());
        assert_eq!(
            config.plan(&beyond, config.endpoints.get("http://10.0.0.5:8000")),
            StreamPlan {
                streams: Vec::new(),
                unplaced: vec![2]
            }
        );
        // A replay list shorter than the publishers' leaves a rank unplaced
        // too: every rank of a worker has the same shape of stream.
        let short = own(
            "http://10.0.0.5:8000",
            KvEndpoints::per_rank(["tcp://a:6000", "tcp://b:7000", "tcp://c:8000"])
                .with_replays(["tcp://a:6100", "tcp://b:7100"]),
        );
        let plan = short.plan(
            &worker("http://10.0.0.5:8000", None),
            short.endpoints.get("http://10.0.0.5:8000"),
        );
        assert_eq!(plan.unplaced, vec![2]);
        assert!(
            short
                .streams_of(&worker("http://10.0.0.5:8000", None))
                .is_empty()
        );
    }

    #[test]
    fn the_hub_counts_unplaced_ranks_and_shows_replay_sockets() {
        use kv_block_index::{IndexConfig, KvIndex};
        use lb_policies::{KvSources, KvStreams};

        let config = own(
            "http://10.0.0.5:8000",
            KvEndpoints::per_rank(["tcp://a:6000", "tcp://b:7000"]),
        );
        let sources = KvSources::new(
            Arc::new(KvIndex::new(IndexConfig::default())),
            Arc::new(KvStreams::new()),
        );
        let hub = crate::KvEvents::new(config, sources, vec![worker_lifecycle::RoleKind::Regular]);
        let beyond = worker("http://10.0.0.5:8000", Some(5));
        // No socket to open, so no runtime is needed.
        hub.sync(&[Arc::clone(&beyond)]);
        let status = hub.worker_status(beyond.key()).expect("followed, cold");
        assert_eq!((status.state, status.streams.len()), ("cold", 0));
        let mut text = String::new();
        hub.render(&mut prom_text::Exposition::new(&mut text));
        assert!(
            text.contains("router_kv_unplaced_ranks_total 1\n"),
            "{text}"
        );
    }
}
