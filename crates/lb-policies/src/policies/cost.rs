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
//! With a `temperature` above zero the choice is a softmax draw instead:
//! a worker is drawn with probability proportional to
//! `exp(−(cost − least) / (temperature × n))`, so the temperature is in
//! units of one whole prefill of this request.

#[cfg(feature = "kv-block-index")]
use crate::backend::Backend;
use crate::error::PolicyError;

/// Knobs of the expected-cost choice (`kv_aware`).
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
}

/// Default [`CostModel::load_weight`].
pub const DEFAULT_LOAD_WEIGHT: f64 = 2.0;

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            load_weight: DEFAULT_LOAD_WEIGHT,
            temperature: 0.0,
        }
    }
}

impl CostModel {
    /// Checks both knobs' ranges.
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (field, value) in [
            ("cost.load_weight", self.load_weight),
            ("cost.temperature", self.temperature),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PolicyError::InvalidConfig {
                    field,
                    reason: format!("must be a finite number >= 0, got {value}"),
                });
            }
        }
        Ok(())
    }

    /// The cost of a worker holding `cached` of the request's `blocks`
    /// full blocks, with `load` requests in flight.
    pub fn cost(&self, blocks: usize, cached: usize, load: usize) -> f64 {
        blocks.saturating_sub(cached) as f64 + self.load_weight * load as f64
    }
}

/// A candidate the policy scored: (candidate index, cached blocks, exact).
#[cfg(feature = "kv-block-index")]
pub(crate) type Scored = (usize, usize, bool);

/// The least-cost candidate among `scored` and the unscored candidates
/// (they hold nothing of the request) that `eligible` accepts, at
/// temperature 0. Returns the winner as a [`Scored`] (an unscored winner
/// has 0 blocks). `start` rotates the fair order among exact ties.
///
/// One pass over the scored candidates and one fair least-loaded scan of
/// all candidates; `eligible` (a lock and a hash lookup in kv-aware) is
/// asked only of a candidate about to win, not of every candidate.
#[cfg(feature = "kv-block-index")]
pub(crate) fn least_cost<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    scored: &[Scored],
    start: usize,
    eligible: impl Fn(usize) -> bool,
) -> Option<Scored> {
    let n = candidates.len().max(1);
    // The ordering: cost, then more cached blocks (locality), then the
    // fair order (load, processed, rotating start).
    let key = |s: &Scored| {
        let c = &candidates[s.0];
        let load = c.load();
        (
            model.cost(blocks, s.1, load),
            usize::MAX - s.1,
            load,
            c.processed(),
            (s.0 + n - start % n) % n,
        )
    };
    let better = |a: &Scored, b: &Scored| {
        let (ka, kb) = (key(a), key(b));
        ka.0.total_cmp(&kb.0)
            .then(ka.1.cmp(&kb.1))
            .then(ka.2.cmp(&kb.2))
            .then(ka.3.cmp(&kb.3))
            .then(ka.4.cmp(&kb.4))
            .is_lt()
    };
    let mut best: Option<Scored> = None;
    for s in scored {
        if candidates[s.0].is_available() && best.is_none_or(|b| better(s, &b)) && eligible(s.0) {
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
        && !scored.iter().any(|s| s.0 == i)
    {
        let s = (i, 0, false);
        if best.is_none_or(|b| better(&s, &b)) {
            best = Some(s);
        }
    }
    best
}

/// A softmax draw over every eligible available candidate's cost (see
/// the [module docs](self)); `draw` is uniform in `[0, 1)`.
#[cfg(feature = "kv-block-index")]
pub(crate) fn softmax<B: Backend>(
    model: &CostModel,
    candidates: &[B],
    blocks: usize,
    scored: &[Scored],
    draw: f64,
    eligible: impl Fn(usize) -> bool,
) -> Option<Scored> {
    let of = |i: usize| -> Scored {
        scored
            .iter()
            .find(|s| s.0 == i)
            .copied()
            .unwrap_or((i, 0, false))
    };
    let pool = || {
        (0..candidates.len())
            .filter(|&i| candidates[i].is_available() && eligible(i))
            .map(of)
    };
    let cost = |s: &Scored| model.cost(blocks, s.1, candidates[s.0].load());
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

    #[test]
    fn a_long_hit_wins_until_the_queue_in_front_of_it_outweighs_it() {
        let model = CostModel {
            load_weight: 2.0,
            temperature: 0.0,
        };
        // 100 blocks; w0 holds 60 of them. w1 holds nothing.
        let scored = [(0, 60, true)];
        // 60 blocks saved = 30 requests of load at weight 2.
        for (load, winner) in [(0, 0), (29, 0), (31, 1)] {
            let candidates = fleet(&[load, 0]);
            let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
            assert_eq!(chosen.0, winner, "w0 at load {load}");
        }
    }

    #[test]
    fn equal_costs_prefer_the_longer_prefix_then_the_lighter_worker() {
        let model = CostModel {
            load_weight: 1.0,
            temperature: 0.0,
        };
        // w0: 10 cached, load 5 -> 90 + 5 = 95; w1: 5 cached, load 0 -> 95.
        let candidates = fleet(&[5, 0, 0]);
        let scored = [(0, 10, true), (1, 5, true)];
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen, (0, 10, true));
        // Same prefix, same cost: the lighter one.
        let candidates = fleet(&[3, 2, 9]);
        let model = CostModel {
            load_weight: 0.0,
            temperature: 0.0,
        };
        let scored = [(0, 10, true), (1, 10, true)];
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen.0, 1);
    }

    #[test]
    fn the_unscored_compete_through_their_least_loaded_and_ineligible_never_win() {
        let model = CostModel {
            load_weight: 8.0,
            temperature: 0.0,
        };
        let candidates = fleet(&[50, 7, 3, 4]);
        // w0 holds everything but is swamped (400 blocks of queue against
        // a 100-block prefill); w2 is the lightest unscored.
        let scored = [(0, 100, true)];
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, ANY).unwrap();
        assert_eq!(chosen, (2, 0, false));
        // w2 removed: the next lightest.
        let chosen = least_cost(&model, &candidates, 100, &scored, 0, |i| i != 2).unwrap();
        assert_eq!(chosen, (3, 0, false));
        // An unavailable worker is never chosen, scored or not.
        candidates[0].set_available(false);
        candidates[2].set_available(false);
        let chosen = least_cost(&model, &candidates, 100, &[(0, 100, true)], 0, ANY).unwrap();
        assert_eq!(chosen.0, 3);
        for c in &candidates {
            c.set_available(false);
        }
        assert!(least_cost(&model, &candidates, 100, &scored, 0, ANY).is_none());
        assert!(softmax(&model, &candidates, 100, &scored, 0.5, ANY).is_none());
    }

    #[test]
    fn softmax_draws_follow_the_costs() {
        let model = CostModel {
            load_weight: 1.0,
            temperature: 0.1,
        };
        // 100 blocks: w0 costs 0 + 0, w1 (holding nothing) 100 + 0 (a
        // whole prefill more: e^-10 as likely), w2 0 + 10 (e^-1).
        let candidates = fleet(&[0, 0, 10]);
        let scored = [(0, 100, true), (2, 100, true)];
        let mut counts = [0usize; 3];
        for k in 0..10_000 {
            let draw = (k as f64 + 0.5) / 10_000.0;
            let s = softmax(&model, &candidates, 100, &scored, draw, ANY).unwrap();
            counts[s.0] += 1;
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
            let model = CostModel {
                load_weight: weight,
                temperature,
            };
            match model.validate() {
                Err(PolicyError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{weight} {temperature}: {other:?}"),
            }
        }
        assert!(CostModel::default().validate().is_ok());
    }
}
