//! The P/D series of `/metrics`.

use pd_orchestrator::pools::{LEG_OUTCOMES, PdPools};
use pd_orchestrator::{FlowStatsSnapshot, Phase};
use prom_text::{Exposition, MetricType};

/// Writes the P/D series: leg outcomes per phase, refusals per role, the
/// flow's counters and both roles' policy decisions.
pub(crate) fn render(pools: &PdPools, flow: FlowStatsSnapshot, exposition: &mut Exposition<'_>) {
    let mut family = exposition.family(
        "router_pd_leg_outcomes_total",
        MetricType::Counter,
        "Prefill and decode legs by how they ended.",
    );
    for phase in [Phase::Prefill, Phase::Decode] {
        for outcome in LEG_OUTCOMES {
            let value = pools.metrics().outcomes(phase, outcome);
            family.sample(&[("phase", &phase), ("outcome", &outcome)], value);
        }
    }
    let roles = [pools.prefill(), pools.decode()];
    let mut family = exposition.family(
        "router_pd_unavailable_total",
        MetricType::Counter,
        "Requests refused with 503 because a role had no available worker.",
    );
    for role in roles {
        family.sample(&[("role", &role.role())], role.unavailable_count());
    }
    let flow_series: [(&str, &str, u64); 5] = [
        (
            "router_pd_requests_total",
            "Two-phase requests started.",
            flow.requests,
        ),
        (
            "router_pd_prefill_retries_total",
            "Prefill attempts after the first, on a fresh prefill worker.",
            flow.prefill_retries,
        ),
        (
            "router_pd_missing_prefill_kv_params_total",
            "2xx prefill responses without kv_transfer_params (decode recomputed the prompt).",
            flow.missing_prefill_kv_params,
        ),
        (
            "router_pd_merged_responses_total",
            "Non-streaming responses whose usage or prompt logprobs were merged.",
            flow.merged_responses,
        ),
        (
            "router_pd_prefill_failures_during_decode_total",
            "Concurrent prefill legs that failed while decode was already streaming.",
            flow.prefill_failures_during_decode,
        ),
    ];
    for (name, help, value) in flow_series {
        exposition
            .family(name, MetricType::Counter, help)
            .sample(&[], value);
    }
    let mut family = exposition.family(
        "router_pd_policy_decisions_total",
        MetricType::Counter,
        "Policy decisions of each P/D role by model, policy and reason.",
    );
    for role in roles {
        let kind = role.role();
        for (model, policy, counts) in role.policies().counts() {
            for (reason, value) in counts.iter() {
                let labels: [(&str, &dyn std::fmt::Display); 4] = [
                    ("role", &kind),
                    ("model", &model),
                    ("policy", &policy),
                    ("reason", &reason),
                ];
                family.sample(&labels, value);
            }
        }
    }
}
