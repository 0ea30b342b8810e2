//! Prefill/decode: a prefill engine produces `kv_transfer_params`, a decode
//! engine sharing the registry counts what it receives as valid or invalid.

mod common;

use std::sync::Arc;

use common::{get, metric, post};
use engine_sim::{
    EngineConfig, EngineHandle, MoriIoMode, Role, ServeOptions, TransferFormat, TransferRegistry,
    spawn,
};
use serde_json::{Value, json};

async fn pair(
    connector: TransferFormat,
    mode: MoriIoMode,
) -> (EngineHandle, EngineHandle, Arc<TransferRegistry>) {
    let registry = TransferRegistry::new();
    let config = |role, id: &str| EngineConfig {
        role,
        kv_connector: connector,
        moriio_mode: mode,
        engine_id: Some(id.to_owned()),
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    let options = ServeOptions {
        registry: Some(registry.clone()),
        ..ServeOptions::default()
    };
    let prefill = spawn(config(Role::Prefill, "prefill-0"), options.clone())
        .await
        .expect("prefill");
    let decode = spawn(config(Role::Decode, "decode-0"), options)
        .await
        .expect("decode");
    (prefill, decode, registry)
}

fn prompt() -> String {
    "Summarise the following document. ".repeat(20)
}

async fn prefill_leg(prefill: &EngineHandle, params: Value) -> Value {
    let reply = post(
        prefill.addr(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 1, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

async fn decode_leg(decode: &EngineHandle, params: Option<Value>) -> Value {
    let mut body = json!({"prompt": prompt(), "max_tokens": 4});
    if let Some(params) = params {
        body["kv_transfer_params"] = params;
    }
    let reply = post(decode.addr(), "/v1/completions", &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()
}

async fn counts(decode: &EngineHandle) -> (f64, f64) {
    (
        metric(decode.addr(), "engine_sim:kv_transfers_valid_total").await,
        metric(decode.addr(), "engine_sim:kv_transfers_invalid_total").await,
    )
}

#[tokio::test]
async fn nixl_valid_params_are_accepted_and_forgeries_are_not() {
    let (prefill, decode, _registry) = pair(TransferFormat::Nixl, MoriIoMode::Read).await;
    let request_params = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let first = prefill_leg(&prefill, request_params.clone()).await;
    assert_eq!(first["usage"]["completion_tokens"], 1);
    let produced = first["kv_transfer_params"].clone();
    assert_eq!(produced["do_remote_prefill"], true);
    assert_eq!(produced["do_remote_decode"], false);
    assert_eq!(produced["remote_engine_id"], "prefill-0");
    assert_eq!(produced["remote_host"], "127.0.0.1");
    assert_eq!(produced["remote_port"], prefill.addr().port());
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = produced["remote_block_ids"]
        .as_array()
        .expect("block ids")
        .len() as u64;
    assert_eq!(blocks, prompt_tokens.div_ceil(16));
    assert_eq!(
        metric(prefill.addr(), "engine_sim:kv_transfers_held").await,
        1.0
    );

    // The verbatim params: valid; the whole prompt arrives over the connector.
    let decoded = decode_leg(&decode, Some(produced.clone())).await;
    assert_eq!(
        decoded["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens
    );
    assert_eq!(decoded["usage"]["completion_tokens"], 4);
    assert_eq!(counts(&decode).await, (1.0, 0.0));
    // The prefill engine freed the blocks it kept for the transfer.
    assert_eq!(
        metric(prefill.addr(), "engine_sim:kv_transfers_held").await,
        0.0
    );

    // Replaying consumed params is invalid.
    decode_leg(&decode, Some(produced.clone())).await;
    assert_eq!(counts(&decode).await, (1.0, 1.0));

    // Forged block ids for a real pending transfer.
    let second = prefill_leg(&prefill, request_params.clone()).await;
    let mut forged = second["kv_transfer_params"].clone();
    forged["remote_block_ids"] = json!([9999]);
    decode_leg(&decode, Some(forged)).await;
    // An engine nobody registered.
    let mut stranger = second["kv_transfer_params"].clone();
    stranger["remote_engine_id"] = json!("prefill-9");
    decode_leg(&decode, Some(stranger)).await;
    // No params at all, and params missing a field the connector needs.
    decode_leg(&decode, None).await;
    let mut incomplete = second["kv_transfer_params"].clone();
    incomplete.as_object_mut().unwrap().remove("remote_port");
    decode_leg(&decode, Some(incomplete)).await;
    assert_eq!(counts(&decode).await, (1.0, 5.0));
    let text = get(decode.addr(), "/metrics").await.text();
    for reason in [
        "unknown_transfer",
        "block_mismatch",
        "unknown_engine",
        "missing",
        "malformed",
    ] {
        assert!(
            text.contains(&format!("reason=\"{reason}\"}} 1")),
            "{reason} not counted once:\n{text}"
        );
    }
    // The untouched second transfer is still valid afterwards.
    decode_leg(&decode, Some(second["kv_transfer_params"].clone())).await;
    assert_eq!(counts(&decode).await, (2.0, 5.0));
}

#[tokio::test]
async fn mooncake_decode_dispatched_first_waits_for_the_push() {
    let (prefill, decode, registry) = pair(TransferFormat::Mooncake, MoriIoMode::Read).await;
    let query = get(prefill.addr(), "/query").await.json();
    assert_eq!(query["0"]["engine_id"], "prefill-0");
    let decode_params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "transfer_id": "xfer-1", "remote_engine_id": "prefill-0",
        "remote_bootstrap_addr": format!("http://{}", prefill.addr())});
    // Concurrent legs: decode starts before the prefill produced anything.
    let decode_task = {
        let addr = decode.addr();
        let params = decode_params.clone();
        tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &json!({"prompt": prompt(), "max_tokens": 2,
                "kv_transfer_params": params}),
            )
            .await
            .json()
        })
    };
    tokio::task::yield_now().await;
    let produced = prefill_leg(
        &prefill,
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "xfer-1"}),
    )
    .await["kv_transfer_params"]
        .clone();
    assert_eq!(produced["transfer_id"], "xfer-1");
    assert_eq!(produced["remote_engine_id"], "prefill-0");
    let decoded = decode_task.await.expect("decode");
    assert_eq!(decoded["usage"]["completion_tokens"], 2);
    assert_eq!(counts(&decode).await, (1.0, 0.0));

    // A transfer id nobody produced, with a short wait: invalid.
    let mut forged = decode_params;
    forged["transfer_id"] = json!("xfer-forged");
    let mut config = EngineConfig {
        role: Role::Decode,
        kv_connector: TransferFormat::Mooncake,
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    config.kv_wait_timeout = std::time::Duration::from_millis(20);
    let impatient = spawn(
        config,
        ServeOptions {
            registry: Some(registry.clone()),
            ..ServeOptions::default()
        },
    )
    .await
    .expect("decode");
    decode_leg(&impatient, Some(forged)).await;
    assert_eq!(counts(&impatient).await, (0.0, 1.0));
}

#[tokio::test]
async fn moriio_read_checks_transfer_id_and_blocks() {
    let (prefill, decode, _registry) = pair(TransferFormat::MoriIo, MoriIoMode::Read).await;
    let produced = prefill_leg(
        &prefill,
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "tx-7",
               "remote_engine_id": null, "remote_block_ids": null}),
    )
    .await["kv_transfer_params"]
        .clone();
    assert_eq!(produced["transfer_id"], "tx-7");
    let mut decode_params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "transfer_id": "tx-7", "remote_host": "127.0.0.1", "remote_port": prefill.addr().port(),
        "remote_dp_size": 1});
    decode_params["remote_engine_id"] = produced["remote_engine_id"].clone();
    decode_params["remote_block_ids"] = produced["remote_block_ids"].clone();
    decode_leg(&decode, Some(decode_params)).await;
    assert_eq!(counts(&decode).await, (1.0, 0.0));
}

#[tokio::test]
async fn without_a_shared_registry_well_formed_params_are_accepted() {
    let config = EngineConfig {
        role: Role::Decode,
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    let decode = spawn(config, ServeOptions::default())
        .await
        .expect("decode");
    let params = json!({"do_remote_prefill": true, "remote_engine_id": "elsewhere",
        "remote_block_ids": [1, 2, 3], "remote_host": "10.0.0.1", "remote_port": 5600});
    decode_leg(&decode, Some(params)).await;
    decode_leg(
        &decode,
        Some(json!({"do_remote_prefill": true, "remote_block_ids": "x"})),
    )
    .await;
    assert_eq!(counts(&decode).await, (1.0, 1.0));
}

#[tokio::test]
async fn moriio_write_legs_rendezvous_on_the_transfer_id() {
    let (prefill, decode, registry) = pair(TransferFormat::MoriIo, MoriIoMode::Write).await;
    let decode_params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "transfer_id": "tx-42", "remote_engine_id": null, "remote_block_ids": null,
        "remote_host": "127.0.0.1", "remote_port": prefill.addr().port(), "remote_dp_size": 1});
    // WRITE runs both legs at once: decode may arrive first.
    let decode_task = {
        let addr = decode.addr();
        tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &json!({"prompt": prompt(), "max_tokens": 3,
                "kv_transfer_params": decode_params}),
            )
            .await
        })
    };
    tokio::task::yield_now().await;
    prefill_leg(
        &prefill,
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": "tx-42",
               "remote_host": "127.0.0.1", "remote_port": decode.addr().port()}),
    )
    .await;
    let decoded = decode_task.await.expect("decode");
    assert_eq!(decoded.status, 200);
    assert_eq!(counts(&decode).await, (1.0, 0.0));
    // A second decode with the same id finds nothing left to claim.
    let replay = json!({"do_remote_prefill": true, "transfer_id": "tx-42"});
    let mut config = EngineConfig {
        role: Role::Decode,
        kv_connector: TransferFormat::MoriIo,
        moriio_mode: MoriIoMode::Write,
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    config.kv_wait_timeout = std::time::Duration::from_millis(10);
    let other = spawn(
        config,
        ServeOptions {
            registry: Some(registry.clone()),
            ..ServeOptions::default()
        },
    )
    .await
    .expect("decode");
    decode_leg(&other, Some(replay)).await;
    assert_eq!(counts(&other).await, (0.0, 1.0));
}
