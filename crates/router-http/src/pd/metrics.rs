//! The P/D series of `/metrics`.

use crate::metrics::{escape_label, family, sample};
use pd_orchestrator::pools::{LEG_OUTCOMES, PdPools};
use pd_orchestrator::{FlowStatsSnapshot, Phase};

/// Writes the P/D series: leg outcomes per phase, refusals per role,
/// the flow's counters and both roles' policy decisions.
pub(crate) fn render(pools: &PdPools, flow: FlowStatsSnapshot, out: &mut String) {
    family(
        out,
        "router_pd_leg_outcomes_total",
        "counter",
        "Prefill and decode legs by how they ended.",
    );
    for phase in [Phase::Prefill, Phase::Decode] {
        for outcome in LEG_OUTCOMES {
            let labels = format!("phase=\"{phase}\",outcome=\"{outcome}\"");
            sample(
                out,
                "router_pd_leg_outcomes_total",
                &labels,
                pools.metrics().outcomes(phase, outcome),
            );
        }
    }
    family(
        out,
        "router_pd_unavailable_total",
        "counter",
        "Requests refused with 503 because a role had no available worker.",
    );
    for role in [pools.prefill(), pools.decode()] {
        sample(
            out,
            "router_pd_unavailable_total",
            &format!("role=\"{}\"", role.role()),
            role.unavailable_count(),
        );
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
        family(out, name, "counter", help);
        sample(out, name, "", value);
    }
    family(
        out,
        "router_pd_policy_decisions_total",
        "counter",
        "Policy decisions of each P/D role by model, policy and reason.",
    );
    for role in [pools.prefill(), pools.decode()] {
        for (model, policy, counts) in role.policies().counts() {
            let model = escape_label(&model);
            for (reason, value) in counts.iter() {
                let labels = format!(
                    "role=\"{}\",model=\"{model}\",policy=\"{policy}\",reason=\"{reason}\"",
                    role.role()
                );
                sample(out, "router_pd_policy_decisions_total", &labels, value);
            }
        }
    }
}
