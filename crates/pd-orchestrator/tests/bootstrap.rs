//! Mooncake bootstrap: the `/query` URL, the retry schedule, and the
//! startup errors, with HTTP and time injected.

mod support;

use std::collections::VecDeque;
use std::future::ready as now;
use std::sync::Mutex;
use std::time::Duration;

use pd_orchestrator::bootstrap::{
    BootstrapError, BootstrapQuery, BootstrapRetry, Sleeper, learn_engine_ids,
};
use pd_orchestrator::{Mooncake, MooncakeEndpoint, PdEndpoint};
use support::ready;

/// Answers each `get` with the next scripted result; records the URLs.
struct ScriptedQuery {
    answers: Mutex<VecDeque<Result<Vec<u8>, String>>>,
    urls: Mutex<Vec<String>>,
}

impl ScriptedQuery {
    fn new(answers: Vec<Result<&str, &str>>) -> Self {
        Self {
            answers: Mutex::new(
                answers
                    .into_iter()
                    .map(|a| a.map(|b| b.as_bytes().to_vec()).map_err(str::to_owned))
                    .collect(),
            ),
            urls: Mutex::default(),
        }
    }
}

impl BootstrapQuery for ScriptedQuery {
    fn get(&self, url: &str) -> impl std::future::Future<Output = Result<Vec<u8>, String>> + Send {
        self.urls.lock().unwrap().push(url.to_owned());
        let answer = self
            .answers
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| Err("connection refused".to_owned()));
        now(answer)
    }
}

/// Records every wait instead of waiting.
#[derive(Default)]
struct RecordingSleeper(Mutex<Vec<Duration>>);

impl Sleeper for RecordingSleeper {
    fn sleep(&self, duration: Duration) -> impl std::future::Future<Output = ()> + Send {
        self.0.lock().unwrap().push(duration);
        now(())
    }
}

const TWO_RANKS: &str =
    r#"{"0": {"engine_id": "eng-a", "host": "10.0.0.1"}, "1": {"engine_id": "eng-b"}}"#;

#[test]
fn learns_engine_ids_after_retrying_with_backoff() {
    let query = ScriptedQuery::new(vec![
        Err("connection refused"),
        Err("503"),
        Err("503"),
        Ok(TWO_RANKS),
    ]);
    let sleeper = RecordingSleeper::default();
    let prefill = PdEndpoint::new("http://10.0.0.1:8000").unwrap();
    let learned = ready(learn_engine_ids(
        &query,
        &sleeper,
        &prefill,
        None,
        &BootstrapRetry::default(),
    ))
    .unwrap();
    assert_eq!(
        learned,
        MooncakeEndpoint {
            bootstrap_addr: "http://10.0.0.1:8998".to_owned(),
            engine_ids: [(0, "eng-a".to_owned()), (1, "eng-b".to_owned())]
                .into_iter()
                .collect(),
        }
    );
    assert_eq!(learned.dp_size(), 2);
    assert_eq!(learned.engine_id(Some(1)), Some("eng-b"));
    assert_eq!(learned.engine_id(None), Some("eng-a"));
    assert_eq!(
        *query.urls.lock().unwrap(),
        vec!["http://10.0.0.1:8998/query"; 4]
    );
    assert_eq!(
        *sleeper.0.lock().unwrap(),
        [
            Duration::from_millis(500),
            Duration::from_millis(1000),
            Duration::from_millis(2000)
        ]
    );
}

#[test]
fn explicit_bootstrap_port_and_ipv6_host() {
    let query = ScriptedQuery::new(vec![Ok(r#"{"0": {"engine_id": "e"}}"#)]);
    let prefill = PdEndpoint::new("http://[fd00::1]:8000").unwrap();
    let learned = ready(learn_engine_ids(
        &query,
        &RecordingSleeper::default(),
        &prefill,
        Some(9100),
        &BootstrapRetry::default(),
    ))
    .unwrap();
    assert_eq!(learned.bootstrap_addr, "http://[fd00::1]:9100");
    assert_eq!(*query.urls.lock().unwrap(), ["http://[fd00::1]:9100/query"]);
}

#[test]
fn gives_up_with_a_clear_error_after_the_attempt_budget() {
    let query = ScriptedQuery::new(vec![]);
    let sleeper = RecordingSleeper::default();
    let retry = BootstrapRetry {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(300),
    };
    let error = ready(learn_engine_ids(
        &query,
        &sleeper,
        &PdEndpoint::new("http://p:8000").unwrap(),
        None,
        &retry,
    ))
    .unwrap_err();
    assert_eq!(
        error,
        BootstrapError::Unreachable {
            url: "http://p:8998/query".to_owned(),
            attempts: 5,
            last: "connection refused".to_owned(),
        }
    );
    assert_eq!(
        error.to_string(),
        "Mooncake bootstrap server http://p:8998/query did not answer after 5 attempt(s): connection refused"
    );
    let waits: Vec<u128> = sleeper
        .0
        .lock()
        .unwrap()
        .iter()
        .map(Duration::as_millis)
        .collect();
    assert_eq!(waits, [100, 200, 300, 300]);
}

#[test]
fn an_invalid_answer_fails_at_once() {
    let query = ScriptedQuery::new(vec![
        Err("refused"),
        Ok(r#"{"0": {"id": "no engine_id"}}"#),
        Ok(TWO_RANKS),
    ]);
    let sleeper = RecordingSleeper::default();
    let error = ready(learn_engine_ids(
        &query,
        &sleeper,
        &PdEndpoint::new("http://p:8000").unwrap(),
        None,
        &BootstrapRetry::default(),
    ))
    .unwrap_err();
    assert!(
        matches!(error, BootstrapError::InvalidResponse { .. }),
        "{error}"
    );
    assert_eq!(query.urls.lock().unwrap().len(), 2);
}

#[test]
fn learned_data_feeds_the_mooncake_decode_params() {
    use pd_orchestrator::{DecodeHandoff, KvConnector, LegContext};
    let query = ScriptedQuery::new(vec![Ok(TWO_RANKS)]);
    let base = PdEndpoint::new("http://10.0.0.1:8000").unwrap();
    let learned = ready(learn_engine_ids(
        &query,
        &RecordingSleeper::default(),
        &base,
        None,
        &BootstrapRetry::default(),
    ))
    .unwrap();
    let prefill = base.with_mooncake(learned).with_dp_rank(1);
    let decode = PdEndpoint::new("http://10.0.0.2:8000").unwrap();
    let ctx = LegContext {
        request_id: "r",
        attempt: 0,
        prefill: &prefill,
        decode: &decode,
    };
    let DecodeHandoff::Params(params) = Mooncake::concurrent().decode_params(&ctx, None).unwrap()
    else {
        panic!("mooncake always hands off params")
    };
    assert_eq!(params["remote_engine_id"], "eng-b");
    assert_eq!(params["remote_bootstrap_addr"], "http://10.0.0.1:8998");

    let unknown_rank = prefill.clone().with_dp_rank(7);
    let ctx = LegContext {
        prefill: &unknown_rank,
        ..ctx
    };
    assert!(Mooncake::concurrent().decode_params(&ctx, None).is_err());
}
