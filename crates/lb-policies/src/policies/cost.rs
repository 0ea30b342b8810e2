//! The expected-cost choice: place a request where the work it adds plus
//! the work already waiting there is least.
//!
//! For a request of `n` full KV blocks, a worker that holds the first `h`
//! of them costs
//!
//! ```text
//! cost = (n − h) + load_weight × load
//! ```
//!
//! in KV blocks of prefill work: the blocks the worker would have to
//! compute for this request, plus `load_weight` blocks for every request
//! already in flight there (its [`Backend::load`], which a host with
//! several router replicas makes the engine's whole load, not its own
//! share). The least cost wins; among equal costs, the longer cached
//! prefix, then the fair order (load, processed count, rotating start).
//!
//! Unlike the threshold gate there is no cliff: a prefix hit is worth
//! exactly its blocks, so a short hit on a busy worker loses to a miss on
//! an idle one, and a long hit stays preferred until the queue in front of
//! it outweighs it. `load_weight` says how many blocks of prefill one
//! queued request is worth; docs/policies.md gives the measurements that
//! chose its default.
//!
//! Blocks a worker holds only in a lower cache tier (host memory, disk, an
//! external store: vLLM's `medium` of its KV events) save part of their
//! prefill: loading one back costs its tier's penalty, a fraction of
//! computing it ([`TierPenalties`], vllm-router's `--kv-penalty-host`,
//! `--kv-penalty-external`, `--kv-penalty-disk`). Past the device prefix,
//! each block is charged the penalty of the cheapest tier whose prefix
//! reaches it, or 1 when none does, so the `h` above becomes the credit
//!
//! ```text
//! credit = h + Σ over blocks past h held in a lower tier of (1 − penalty)
//! ```
//!
//! With a `temperature` above zero the choice is a softmax draw instead:
//! a worker is drawn with probability proportional to
//! `exp(−(cost − least) / (temperature × n))`, so the temperature is in
//! units of one whole prefill of this request.

use crate::backend::Backend;
use crate::decision::DecisionReason;
use crate::error::PolicyError;
use crate::rng::SharedRng;
use crate::sync::{AtomicUsize, Ordering};

/// Knobs of the expected-cost choice (`kv_aware`, and `cache_aware` on
/// token input).
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
#[non_exhaustive]
pub struct CostModel {
    /// KV blocks of prefill work one in-flight request is worth. Higher
    /// spreads load sooner; 0 ignores load (longest prefix always wins).
    /// Finite and non-negative. Default [`DEFAULT_LOAD_WEIGHT`].
    pub load_weight: f64,
    /// Softmax temperature, in units of one whole prefill of the request;
    /// 0 (the default) always takes the least cost. vllm-router's and
    /// Dynamo's `--router-temperature`. Finite and non-negative.
    pub temperature: f64,
    /// What loading a block back from each lower cache tier costs, as a
    /// fraction of computing it.
    pub penalties: TierPenalties,
    /// How much less load counts when the fleet's KV caches are nearly
    /// full of their running requests' blocks: the load weight is divided
    /// by `1 + eviction_weight × pressure`, the pressure being the mean
    /// over the available candidates of how far each engine's cache usage
    /// ([`Backend::cache_usage`]) is past [`PRESSURE_FROM`] (0 there, 1
    /// full). With caches full, a session moved off the engine that holds
    /// its prefix costs its prefill and evicts other sessions' prefixes on
    /// the engine it lands on, which they compute again later; and every
    /// engine has a queue, so a queue shorter by a few requests is worth
    /// less than it is on an idle fleet. 0 ignores cache usage. Finite and
    /// non-negative. Default [`DEFAULT_EVICTION_WEIGHT`].
    pub eviction_weight: f64,
    /// The overload state's entry level: the mean over the available
    /// candidates of the engines' reported waiting counts
    /// ([`Backend::waiting`]) at which `kv_aware` enters its overload
    /// state. Under it a decision is the threshold gate's (as
    /// `kv_aware_gate`), with the worker the fallback tree last sent the
    /// request's longest prefix to credited with that prefix: when every
    /// engine has a queue, a session sent back where its history went
    /// waits no longer than elsewhere and computes less. 0 never enters
    /// (always the least cost). Finite and non-negative. Default
    /// [`DEFAULT_OVERLOAD_ENTER`].
    pub overload_enter: f64,
    /// The overload state's exit level: it is left when the mean waiting
    /// count falls to this. At most [`overload_enter`](Self::overload_enter)
    /// (hysteresis: a burst does not flip the state back and forth).
    /// Default [`DEFAULT_OVERLOAD_LEAVE`].
    pub overload_leave: f64,
}

/// Default [`CostModel::overload_enter`]: a mean of 16 waiting requests
/// per engine (docs/policies.md gives the measurements).
pub const DEFAULT_OVERLOAD_ENTER: f64 = 16.0;

/// Default [`CostModel::overload_leave`].
pub const DEFAULT_OVERLOAD_LEAVE: f64 = 4.0;

/// Default [`CostModel::eviction_weight`].
pub const DEFAULT_EVICTION_WEIGHT: f64 = 0.0;

/// The KV-cache usage from which a block costs extra
/// ([`CostModel::eviction_weight`]).
pub const PRESSURE_FROM: f64 = 0.8;

/// Default [`CostModel::load_weight`].
pub const DEFAULT_LOAD_WEIGHT: f64 = 2.0;

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            load_weight: DEFAULT_LOAD_WEIGHT,
            temperature: 0.0,
            penalties: TierPenalties::default(),
            eviction_weight: DEFAULT_EVICTION_WEIGHT,
            overload_enter: DEFAULT_OVERLOAD_ENTER,
            overload_leave: DEFAULT_OVERLOAD_LEAVE,
        }
    }
}

/// The cost of loading one KV block back from a lower cache tier instead
/// of computing it, as a fraction of computing it: 0 is as good as a
/// device hit, 1 is no better than a miss. Each in `[0, 1]`.
///
/// The defaults are reasoned, not measured (the simulator has no lower
/// tiers): a block crosses PCIe from pinned host memory at tens of GB/s,
/// a small fraction of the time its attention and MLP work takes, but
/// loading is not free and is queued with the rest of the step, so host
/// is 0.25; disk and a remote store add their own reads and a network
/// hop, 0.5.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
#[non_exhaustive]
pub struct TierPenalties {
    /// Host memory (medium `CPU`): vllm-router's `--kv-penalty-host`.
    pub host: f64,
    /// Local disk (medium `DISK`): `--kv-penalty-disk`.
    pub disk: f64,
    /// A store outside the engine (any other medium):
    /// `--kv-penalty-external`.
    pub external: f64,
}

/// Default [`TierPenalties::host`].
pub const DEFAULT_HOST_PENALTY: f64 = 0.25;
/// Default [`TierPenalties::disk`] and [`TierPenalties::external`].
pub const DEFAULT_LOWER_PENALTY: f64 = 0.5;

impl Default for TierPenalties {
    fn default() -> Self {
        TierPenalties {
            host: DEFAULT_HOST_PENALTY,
            disk: DEFAULT_LOWER_PENALTY,
            external: DEFAULT_LOWER_PENALTY,
        }
    }
}

impl TierPenalties {
    /// Penalties of the given values (host, disk, external).
    pub fn new(host: f64, disk: f64, external: f64) -> Self {
        TierPenalties {
            host,
            disk,
            external,
        }
    }

    /// No credit for any lower tier (every penalty 1): only the device
    /// cache counts.
    pub fn none() -> Self {
        TierPenalties::new(1.0, 1.0, 1.0)
    }

    /// The penalties in [`LowerPrefix`] order (host, disk, external).
    fn in_order(&self) -> [f64; 3] {
        [self.host, self.disk, self.external]
    }

    /// The effective cached blocks of a worker whose device cache holds
    /// the first `device` blocks of the request and whose lower tiers hold
    /// the prefixes `lower`: `device`, plus `1 − penalty` for each block
    /// past it that a lower tier holds, charged at the cheapest tier whose
    /// prefix reaches it.
    pub fn credit(&self, device: usize, lower: &LowerPrefix) -> f64 {
        let mut credit = device as f64;
        if lower.is_empty() {
            return credit;
        }
        let penalties = self.in_order();
        let mut order = [0usize, 1, 2];
        order.sort_by(|&a, &b| penalties[a].total_cmp(&penalties[b]));
        let mut covered = device;
        for tier in order {
            let reach = lower.0[tier] as usize;
            if reach > covered {
                credit += (1.0 - penalties[tier]) * (reach - covered) as f64;
                covered = reach;
            }
        }
        credit
    }
}

/// How many leading blocks of a request a worker holds in each lower tier
/// (host, disk, external), as the block index reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerPrefix(pub [u32; 3]);

impl LowerPrefix {
    /// True when no lower tier holds even the first block.
    pub fn is_empty(&self) -> bool {
        self.0 == [0; 3]
    }
}

impl CostModel {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (field, value) in [
            ("cost.load_weight", self.load_weight),
            ("cost.temperature", self.temperature),
            ("cost.eviction_weight", self.eviction_weight),
            ("cost.overload_enter", self.overload_enter),
            ("cost.overload_leave", self.overload_leave),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PolicyError::InvalidConfig {
                    field,
                    reason: format!("must be a finite number >= 0, got {value}"),
                });
            }
        }
        if self.overload_enter > 0.0 && self.overload_leave > self.overload_enter {
            return Err(PolicyError::InvalidConfig {
                field: "cost.overload_leave",
                reason: format!(
                    "must be at most cost.overload_enter ({}), got {}",
                    self.overload_enter, self.overload_leave
                ),
            });
        }
        for (field, value) in [
            ("cost.penalties.host", self.penalties.host),
            ("cost.penalties.disk", self.penalties.disk),
            ("cost.penalties.external", self.penalties.external),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(PolicyError::InvalidConfig {
                    field,
                    reason: format!("must be a number from 0 to 1, got {value}"),
                });
            }
        }
        Ok(())
    }

    /// The cost of a worker holding `cached` of the request's `blocks`
    /// full blocks, with `load` requests in flight.
    pub fn cost(&self, blocks: usize, cached: usize, load: usize) -> f64 {
        self.cost_with_credit(blocks, cached as f64, load)
    }

    /// The cost of a worker whose cache saves `credit` of the request's
    /// `blocks` full blocks of prefill ([`TierPenalties::credit`]), with
    /// `load` requests in flight.
    pub fn cost_with_credit(&self, blocks: usize, credit: f64, load: usize) -> f64 {
        (blocks as f64 - credit).max(0.0) + self.load_weight * load as f64
    }

    /// This model with its load weight lowered for a fleet whose mean
    /// cache pressure ([`pressure`]) is `fleet_pressure`, as
    /// [`eviction_weight`](Self::eviction_weight) says.
    pub fn under_pressure(&self, fleet_pressure: f64) -> CostModel {
        let mut model = *self;
        model.load_weight /= 1.0 + self.eviction_weight * fleet_pressure.clamp(0.0, 1.0);
        model
    }

    /// The model a decision over `candidates` uses: [`under_pressure`]
    /// of their mean cache pressure, or this model itself when
    /// [`eviction_weight`](Self::eviction_weight) is 0. The mean is over
    /// the available candidates among at most [`PRESSURE_SAMPLE`] evenly
    /// spaced ones: the fleet's pressure is a property of the fleet, and
    /// reading every worker of a thousand would add half the decision's
    /// cost.
    ///
    /// [`under_pressure`]: Self::under_pressure
    pub(crate) fn for_fleet<B: Backend>(&self, candidates: &[B]) -> CostModel {
        if self.eviction_weight == 0.0 || candidates.is_empty() {
            return *self;
        }
        match fleet_mean(candidates, |c| pressure(c.cache_usage())) {
            None => *self,
            Some(mean) => self.under_pressure(mean),
        }
    }
}

/// The mean of `read` over the available candidates among at most
/// [`PRESSURE_SAMPLE`] evenly spaced ones (`None` when none of those is
/// available): a property of the fleet read at a bounded cost, however
/// many workers it has.
pub(crate) fn fleet_mean<B: Backend>(candidates: &[B], read: impl Fn(&B) -> f64) -> Option<f64> {
    let stride = candidates.len().div_ceil(PRESSURE_SAMPLE).max(1);
    let (mut sum, mut count) = (0.0, 0usize);
    for c in candidates.iter().step_by(stride) {
        if c.is_available() {
            sum += read(c);
            count += 1;
        }
    }
    (count > 0).then(|| sum / count as f64)
}

/// How many candidates at most [`CostModel::for_fleet`] reads for the
/// fleet's mean cache pressure (and `kv_aware` for its mean waiting
/// count, [`fleet_mean`]).
pub(crate) const PRESSURE_SAMPLE: usize = 64;

/// How close a cache `usage` (0 to 1) is to full, for
/// [`CostModel::eviction_weight`]: 0 up to [`PRESSURE_FROM`], then rising
/// linearly to 1 at a full cache; 0 for NaN.
pub fn pressure(usage: f64) -> f64 {
    if usage.is_nan() {
        return 0.0;
    }
    ((usage - PRESSURE_FROM) / (1.0 - PRESSURE_FROM)).clamp(0.0, 1.0)
}

/// A candidate the policy scored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scored {
    /// Its index among the candidates.
    pub(crate) index: usize,
    /// Leading blocks of the request its device cache holds.
    pub(crate) blocks: usize,
    /// Scored from the block index (else from the approximate tree).
    pub(crate) exact: bool,
    /// Blocks of prefill its caches save, lower tiers included
    /// ([`TierPenalties::credit`]); at least `blocks`.
    pub(crate) credit: f64,
}

impl Scored {
    /// A candidate holding `blocks` in its device cache and nothing more.
    pub(crate) fn new(index: usize, blocks: usize, exact: bool) -> Self {
        Scored {
            index,
            blocks,
            exact,
            credit: blocks as f64,
        }
    }
}

/// The choice both cost-placing policies make (`kv_aware`, and
/// `cache_aware_cost` on tokens): a [`softmax`] draw from `rng` when the
/// model's temperature is above 0 (over the model as the fleet's cache
/// pressure scales it), else the [`least_cost`] candidate with the fair
/// order starting at the next value of `rotation`; with its reason.
///
/// Reasons: `cache_overloaded` when an available candidate's caches save
/// more than the winner's (its load outweighed it), `cache_low_match` when
/// the winner's save nothing, else a hit: `kv_hit` when the winner was
/// scored from the block index, `cache_hit` when from the tree. (A
/// removed worker in a stale slice may count as the reference; only the
/// reason could differ.)
pub(crate) fn choose<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    scores: &[Scored],
    rng: &SharedRng,
    rotation: &AtomicUsize,
    eligible: impl Fn(usize) -> bool,
) -> Option<(Scored, DecisionReason)> {
    let chosen = if model.temperature > 0.0 {
        let draw = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        softmax(
            &model.for_fleet(candidates),
            candidates,
            blocks,
            scores,
            draw,
            eligible,
        )?
    } else {
        let start = rotation.fetch_add(1, Ordering::Relaxed);
        least_cost(model, candidates, blocks, scores, start, eligible)?
    };
    let most = scores
        .iter()
        .filter(|s| candidates[s.index].is_available())
        .map(|s| s.credit)
        .max_by(f64::total_cmp)
        .unwrap_or(0.0);
    let reason = if chosen.credit < most {
        DecisionReason::CacheOverloaded
    } else if chosen.credit <= 0.0 {
        DecisionReason::CacheLowMatch
    } else if chosen.exact {
        DecisionReason::KvHit
    } else {
        DecisionReason::CacheHit
    };
    Some((chosen, reason))
}

/// The least-cost candidate among `scored` and the unscored candidates
/// (they hold nothing of the request) that `eligible` accepts, at
/// temperature 0. Returns the winner as a [`Scored`] (an unscored winner
/// has 0 blocks). `start` rotates the fair order among exact ties.
///
/// One pass over the scored candidates and one fair least-loaded scan of
/// all candidates; `eligible` (a lock and a hash lookup in kv-aware) is
/// asked only of a candidate about to win, not of every candidate.
pub(crate) fn least_cost<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    scored: &[Scored],
    start: usize,
    eligible: impl Fn(usize) -> bool,
) -> Option<Scored> {
    let n = candidates.len().max(1);
    let model = &model.for_fleet(candidates);
    // The ordering: cost, then more saved (locality), then the fair order
    // (load, processed, rotating start).
    let key = |s: &Scored| {
        let c = &candidates[s.index];
        let load = c.load();
        (
            model.cost_with_credit(blocks, s.credit, load),
            s.credit,
            load,
            c.processed(),
            (s.index + n - start % n) % n,
        )
    };
    let better = |a: &Scored, b: &Scored| {
        let (ka, kb) = (key(a), key(b));
        ka.0.total_cmp(&kb.0)
            .then(kb.1.total_cmp(&ka.1))
            .then(ka.2.cmp(&kb.2))
            .then(ka.3.cmp(&kb.3))
            .then(ka.4.cmp(&kb.4))
            .is_lt()
    };
    let mut best: Option<Scored> = None;
    for s in scored {
        if candidates[s.index].is_available()
            && best.is_none_or(|b| better(s, &b))
            && eligible(s.index)
        {
            best = Some(*s);
        }
    }
    // Among the unscored only the fair least loaded can win (they all
    // hold nothing, so cost follows load). The least loaded of *all*
    // candidates is enough: if it is scored, its scored cost is at most
    // its unscored cost, which bounds every unscored candidate's, and it
    // was weighed above.
    let least = super::fair_least_loaded(candidates, start)
        .map(|(i, _)| i)
        .filter(|&i| eligible(i))
        .or_else(|| {
            // It was removed (a stale slice): scan again without the
            // removed, asking of each this time. Rare.
            super::fair_least_loaded_where(candidates, start, &eligible).map(|(i, _)| i)
        });
    if let Some(i) = least
        && !scored.iter().any(|s| s.index == i)
    {
        let s = Scored::new(i, 0, false);
        if best.is_none_or(|b| better(&s, &b)) {
            best = Some(s);
        }
    }
    best
}

/// A softmax draw over every eligible available candidate's cost (see
/// the [module docs](self)); `draw` is uniform in `[0, 1)`.
///
/// Linear in the candidates: the scored ones are matched to their
/// candidates by one sort and a merge, and `eligible` is asked only of
/// the drawn candidate (a draw that lands on an ineligible one, a removed
/// worker in a stale slice, draws again over the eligible alone).
pub(crate) fn softmax<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    scored: &[Scored],
    draw: f64,
    eligible: impl Fn(usize) -> bool,
) -> Option<Scored> {
    let mut by_index: Vec<Scored> = scored.to_vec();
    by_index.sort_unstable_by_key(|s| s.index);
    by_index.dedup_by_key(|s| s.index);
    let chosen = draw_softmax(model, candidates, blocks, &by_index, draw, |_| true)?;
    if eligible(chosen.index) {
        return Some(chosen);
    }
    draw_softmax(model, candidates, blocks, &by_index, draw, eligible)
}

/// One softmax draw over the available candidates `keep` accepts;
/// `by_index` is the scored candidates sorted by index, one each.
fn draw_softmax<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    by_index: &[Scored],
    draw: f64,
    keep: impl Fn(usize) -> bool,
) -> Option<Scored> {
    let keep = &keep;
    // The pool in candidate order, each with its score (0 when unscored).
    let pool = || {
        let mut next = 0;
        (0..candidates.len()).filter_map(move |i| {
            while next < by_index.len() && by_index[next].index < i {
                next += 1;
            }
            let s = match by_index.get(next) {
                Some(s) if s.index == i => *s,
                _ => Scored::new(i, 0, false),
            };
            (candidates[i].is_available() && keep(i)).then_some(s)
        })
    };
    let cost = |s: &Scored| model.cost_with_credit(blocks, s.credit, candidates[s.index].load());
    let least = pool().map(|s| cost(&s)).min_by(f64::total_cmp)?;
    let scale = model.temperature * blocks.max(1) as f64;
    let weight = |s: &Scored| (-(cost(s) - least) / scale).exp();
    let total: f64 = pool().map(|s| weight(&s)).sum();
    let mut left = draw * total;
    let mut last = None;
    for s in pool() {
        let w = weight(&s);
        if left < w {
            return Some(s);
        }
        left -= w;
        last = Some(s);
    }
    last
}

#[cfg(all(test, not(loom), feature = "kv-block-index"))]
mod tests {
    use super::*;
    use crate::backend::BasicBackend;

    fn fleet(loads: &[usize]) -> Vec<BasicBackend> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &l)| BasicBackend::new(format!("w{i}")).with_load(l))
            .collect()
    }

    const ANY: fn(usize) -> bool = |_| true;

    fn sc(index: usize, blocks: usize, exact: bool) -> Scored {
        Scored::new(index, blocks, exact)
    }

    fn model(load_weight: f64, temperature: f64) -> CostModel {
        CostModel {
            load_weight,
            temperature,
            ..CostModel::default()
        }
    }

    #[test]
    fn a_long_hit_wins_until_the_queue_in_front_of_it_outweighs_it() {
        let model = model(2.0, 0.0);
        // 100 blocks; w0 holds 60 of them. w1 holds nothing.
        let scored = [sc(0, 60, true)];
        // 60 blocks saved = 30 requests of load at weight 2.
        for (load, winner) in [(0, 0), (29, 0), (31, 1)] {
            let candidates = fleet(&[load, 0]);
            let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
            assert_eq!(chosen.index, winner, "w0 at load {load}");
        }
    }

    #[test]
    fn pressure_starts_at_four_fifths_of_the_cache_and_is_one_when_full() {
        assert_eq!(pressure(0.0), 0.0);
        assert_eq!(pressure(PRESSURE_FROM), 0.0);
        assert!((pressure(0.9) - 0.5).abs() < 1e-9);
        assert_eq!(pressure(1.0), 1.0);
        assert_eq!(pressure(7.0), 1.0);
        assert_eq!(pressure(f64::NAN), 0.0);
    }

    #[test]
    fn a_fleet_short_of_cache_keeps_a_session_on_its_engine_longer() {
        // w0 holds 60 of 100 blocks; at weight 2 a queue of 31 more
        // requests moves the session to the idle w1 (as above).
        let scored = [sc(0, 60, true)];
        let candidates = fleet(&[31, 0]);
        let model = CostModel {
            load_weight: 2.0,
            eviction_weight: 3.0,
            ..CostModel::default()
        };
        let chosen = |m: &CostModel| least_cost(m, &candidates, 100, &scored, 0, ANY).unwrap();
        // Caches with room: no pressure, the same choice as without it.
        for c in &candidates {
            c.set_cache_usage(0.5);
        }
        assert_eq!(model.for_fleet(&candidates), model);
        assert_eq!(chosen(&model).index, 1);
        // Every cache full: load counts a quarter (2 / (1 + 3)), so 31
        // requests (15.5 blocks) no longer outweigh 60 cached blocks.
        for c in &candidates {
            c.set_cache_usage(1.0);
        }
        assert_eq!(model.for_fleet(&candidates).load_weight, 0.5);
        assert_eq!(chosen(&model).index, 0);
        // The softmax draw weighs the same costs: at a low temperature it
        // keeps the session too.
        let cool = CostModel {
            temperature: 0.01,
            ..model
        };
        let drawn = softmax(
            &cool.for_fleet(&candidates),
            &candidates,
            100,
            &scored,
            0.5,
            ANY,
        );
        assert_eq!(drawn.unwrap().index, 0);
        // The pressure is the available candidates' mean: one full cache
        // of two is half the pressure; an unavailable one does not count.
        candidates[1].set_cache_usage(0.0);
        assert_eq!(model.for_fleet(&candidates).load_weight, 2.0 / 2.5);
        candidates[1].set_available(false);
        assert_eq!(model.for_fleet(&candidates).load_weight, 0.5);
        // Off: cache usage is ignored.
        let off = CostModel {
            eviction_weight: 0.0,
            ..model
        };
        assert_eq!(off.for_fleet(&candidates), off);
    }

    #[test]
    fn equal_costs_prefer_the_longer_prefix_then_the_lighter_worker() {
        let weighted = model(1.0, 0.0);
        // w0: 10 cached, load 5 -> 90 + 5 = 95; w1: 5 cached, load 0 -> 95.
        let candidates = fleet(&[5, 0, 0]);
        let scored = [sc(0, 10, true), sc(1, 5, true)];
        let chosen = least_cost(&weighted, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen, sc(0, 10, true));
        // Same prefix, same cost: the lighter one.
        let candidates = fleet(&[3, 2, 9]);
        let model = model(0.0, 0.0);
        let scored = [sc(0, 10, true), sc(1, 10, true)];
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen.index, 1);
    }

    #[test]
    fn the_unscored_compete_through_their_least_loaded_and_ineligible_never_win() {
        let model = model(8.0, 0.0);
        let candidates = fleet(&[50, 7, 3, 4]);
        // w0 holds everything but is swamped (400 blocks of queue against
        // a 100-block prefill); w2 is the lightest unscored.
        let scored = [sc(0, 100, true)];
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen, sc(2, 0, false));
        // w2 removed: the next lightest.
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, |i| i != 2).unwrap();
        assert_eq!(chosen, sc(3, 0, false));
        // An unavailable worker is never chosen, scored or not.
        candidates[0].set_available(false);
        candidates[2].set_available(false);
        let chosen = least_cost(&model, &candidates, 100, &[sc(0, 100, true)], 0, ANY).unwrap();
        assert_eq!(chosen.index, 3);
        for c in &candidates {
            c.set_available(false);
        }
        assert!(least_cost(&model, &candidates, 100, &scored, 0, ANY).is_none());
        assert!(softmax(&model, &candidates, 100, &scored, 0.5, ANY).is_none());
    }

    #[test]
    fn softmax_draws_follow_the_costs() {
        let model = model(1.0, 0.1);
        // 100 blocks: w0 costs 0 + 0, w1 (holding nothing) 100 + 0 (a
        // whole prefill more: e^-10 as likely), w2 0 + 10 (e^-1).
        let candidates = fleet(&[0, 0, 10]);
        let scored = [sc(0, 100, true), sc(2, 100, true)];
        let mut counts = [0usize; 3];
        for k in 0..10_000 {
            let draw = (k as f64 + 0.5) / 10_000.0;
            let s = softmax(&model, &candidates, 100, &scored, draw, ANY).unwrap();
            counts[s.index] += 1;
        }
        let expected_w2 = (-1.0f64).exp() / (1.0 + (-1.0f64).exp() + (-10.0f64).exp());
        let share_w2 = counts[2] as f64 / 10_000.0;
        assert!((share_w2 - expected_w2).abs() < 0.01, "{counts:?}");
        assert!(counts[1] <= 2, "{counts:?}");
        assert!(counts[0] > counts[2]);
    }

    #[test]
    fn knobs_out_of_range_are_refused_by_name() {
        for (weight, temperature, field) in [
            (-1.0, 0.0, "cost.load_weight"),
            (f64::NAN, 0.0, "cost.load_weight"),
            (1.0, f64::INFINITY, "cost.temperature"),
            (1.0, -0.5, "cost.temperature"),
        ] {
            match model(weight, temperature).validate() {
                Err(PolicyError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{weight} {temperature}: {other:?}"),
            }
        }
        for eviction_weight in [-1.0, f64::NAN, f64::INFINITY] {
            let model = CostModel {
                eviction_weight,
                ..CostModel::default()
            };
            match model.validate() {
                Err(PolicyError::InvalidConfig { field, .. }) => {
                    assert_eq!(field, "cost.eviction_weight")
                }
                other => panic!("{eviction_weight}: {other:?}"),
            }
        }
        assert!(CostModel::default().validate().is_ok());
    }

    #[test]
    fn lower_tiers_credit_each_block_at_the_cheapest_tier_that_reaches_it() {
        let penalties = TierPenalties::new(0.25, 0.5, 0.75);
        // Nothing below: the device prefix alone.
        assert_eq!(penalties.credit(10, &LowerPrefix::default()), 10.0);
        // Host reaches 20, disk 40, external 30 (shadowed by disk).
        let lower = LowerPrefix([20, 40, 30]);
        // Blocks 10..20 from host (0.75 each), 20..40 from disk (0.5 each).
        assert_eq!(penalties.credit(10, &lower), 10.0 + 7.5 + 10.0);
        // A device prefix past every lower one: nothing more.
        assert_eq!(penalties.credit(50, &lower), 50.0);
        // The cheapest tier wins where tiers overlap, whatever its order.
        let penalties = TierPenalties::new(0.9, 0.1, 1.0);
        assert!((penalties.credit(0, &LowerPrefix([40, 20, 0])) - (18.0 + 2.0)).abs() < 1e-9);
        // Penalty 1 everywhere: only the device counts.
        assert_eq!(TierPenalties::none().credit(3, &lower), 3.0);
    }

    #[test]
    fn a_host_copy_of_a_prefix_beats_a_miss_on_an_equally_loaded_worker() {
        let model = CostModel::default();
        let candidates = fleet(&[1, 1]);
        let mut host_only = sc(0, 0, true);
        host_only.credit = model.penalties.credit(0, &LowerPrefix([80, 0, 0]));
        let chosen = least_cost(&model, &candidates, 100, &[host_only], 0, ANY).unwrap();
        assert_eq!(chosen.index, 0);
        // ... but a device copy of the same prefix beats the host copy.
        let chosen = least_cost(
            &model,
            &candidates,
            100,
            &[host_only, sc(1, 80, true)],
            0,
            ANY,
        )
        .unwrap();
        assert_eq!(chosen.index, 1);
        // And with no credit for the host tier the two unscored-equal
        // workers tie on cost, so the longer saving no longer decides.
        let none = CostModel {
            penalties: TierPenalties::none(),
            ..CostModel::default()
        };
        let mut no_credit = sc(0, 0, true);
        no_credit.credit = none.penalties.credit(0, &LowerPrefix([80, 0, 0]));
        assert_eq!(no_credit.credit, 0.0);
    }

    #[test]
    fn softmax_skips_an_ineligible_draw_and_draws_among_the_rest() {
        let model = model(1.0, 0.1);
        let candidates = fleet(&[0, 0, 0]);
        // w0 holds everything: nearly every draw lands on it.
        let scored = [sc(0, 100, true)];
        let s = softmax(&model, &candidates, 100, &scored, 0.5, ANY).unwrap();
        assert_eq!(s.index, 0);
        // w0 is ineligible (removed): the draw is among w1 and w2.
        for draw in [0.1, 0.6, 0.99] {
            let s = softmax(&model, &candidates, 100, &scored, draw, |i| i != 0).unwrap();
            assert_ne!(s.index, 0);
        }
        // Scored entries given twice or out of order change nothing.
        let twice = [sc(2, 100, true), sc(0, 100, true), sc(2, 100, true)];
        let a = softmax(&model, &candidates, 100, &twice, 0.75, ANY).unwrap();
        let b = softmax(
            &model,
            &candidates,
            100,
            &[sc(0, 100, true), sc(2, 100, true)],
            0.75,
            ANY,
        )
        .unwrap();
        assert_eq!(a.index, b.index);
    }

    #[test]
    fn tier_penalties_out_of_range_are_refused_by_name() {
        for (host, disk, external, field) in [
            (1.5, 0.5, 0.5, "cost.penalties.host"),
            (0.5, -0.1, 0.5, "cost.penalties.disk"),
            (0.5, 0.5, f64::NAN, "cost.penalties.external"),
        ] {
            let model = CostModel {
                penalties: TierPenalties::new(host, disk, external),
                ..CostModel::default()
            };
            match model.validate() {
                Err(PolicyError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{host} {disk} {external}: {other:?}"),
            }
        }
    }
}
