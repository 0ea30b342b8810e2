//! The poller's state over explicit times (no sockets).

use super::*;
use worker_lifecycle::{Endpoint, WorkerOptions, WorkerRole, WorkerSpec};

fn worker(url: &str, rank: Option<u32>, generation: u64) -> Arc<Worker> {
    let endpoint = Endpoint::new(url, rank).unwrap();
    let spec = WorkerSpec::new(WorkerRole::Regular, endpoint);
    Worker::new(spec, generation, &WorkerOptions::default())
}

fn polls() -> Arc<LoadPolls> {
    LoadPolls::new(LoadPollConfig::default()).unwrap()
}

fn loads(text: &str) -> EngineLoads {
    parse_metrics(text.as_bytes()).unwrap()
}

#[test]
fn polling_is_off_without_an_interval_or_with_zero() {
    assert!(LoadPolls::new(LoadPollConfig::off()).is_none());
    let zero = LoadPollConfig {
        interval: Some(Duration::ZERO),
        ..LoadPollConfig::default()
    };
    assert!(LoadPolls::new(zero).is_none());
    let config = LoadPollConfig::default();
    assert_eq!(config.poll_timeout(), Duration::from_millis(50));
    assert_eq!(config.stale_age(), Duration::from_millis(150));
    let slow = LoadPollConfig {
        interval: Some(Duration::from_secs(5)),
        ..LoadPollConfig::default()
    };
    assert_eq!(slow.poll_timeout(), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn ranks_of_one_url_share_a_poll_and_get_their_own_reports() {
    let polls = polls();
    let workers = [
        worker("http://10.0.0.1:8000", Some(0), 1),
        worker("http://10.0.0.1:8000", Some(1), 1),
        worker("http://10.0.0.2:8000", None, 1),
    ];
    let plan = polls.plan(&workers, Instant::now());
    assert_eq!(plan.len(), 2);
    assert_eq!(plan[0].workers.len(), 2);
    let mine = workers[1].try_reserve().unwrap();
    let text = "vllm:num_requests_running{engine=\"0\"} 3\nvllm:num_requests_waiting{engine=\"0\"} 1\n\
        vllm:num_requests_running{engine=\"1\"} 2\nvllm:num_requests_waiting{engine=\"1\"} 0\n";
    polls.finish(
        &plan[0],
        Ok((LoadSource::Metrics, loads(text), vec![0, 1])),
        Instant::now(),
    );
    assert_eq!(workers[0].engine_reported_load(), Some(4));
    assert_eq!(workers[0].estimated_load(), 4);
    assert_eq!(workers[1].engine_reported_load(), Some(2));
    assert_eq!(workers[1].estimated_load(), 2, "one of the two is ours");
    // The queued part is kept apart, per rank.
    assert_eq!(workers[0].engine_waiting(), Some(1));
    assert_eq!(workers[1].engine_waiting(), Some(0));
    drop(mine);
    assert_eq!(workers[1].estimated_load(), 1);
    let status = polls.status(&workers[0]);
    assert_eq!(status.source, Some("metrics"));
    assert_eq!((status.own_load, status.reported), (0, Some(4)));
    assert_eq!(polls.reports(LoadSource::Metrics), 1);
}

#[tokio::test(start_paused = true)]
async fn failures_withdraw_the_report_and_no_source_backs_off() {
    let polls = polls();
    let workers = [worker("http://10.0.0.1:8000", None, 1)];
    let start = Instant::now();
    let plan = polls.plan(&workers, start);
    let text = "vllm:num_requests_running 5\nvllm:num_requests_waiting 0\n";
    polls.finish(
        &plan[0],
        Ok((LoadSource::Metrics, loads(text), vec![0])),
        start,
    );
    assert_eq!(workers[0].estimated_load(), 5);
    let failure = Failure::new(PollError::Garbage, LoadSource::Metrics, "x");
    assert_eq!(workers[0].engine_waiting(), Some(0));
    polls.finish(&plan[0], Err(failure), start);
    assert_eq!(workers[0].engine_reported_load(), None);
    assert_eq!(workers[0].engine_waiting(), None);
    assert_eq!(workers[0].estimated_load(), 0);
    assert_eq!(polls.errors(&workers[0], PollError::Garbage), 1);
    let status = polls.status(&workers[0]);
    assert_eq!(status.last_error.unwrap().reason, "garbage");
    // The source that answered is still the one asked first.
    assert_eq!(
        polls.plan(&workers, start)[0].source,
        Some(LoadSource::Metrics)
    );

    let none = Failure {
        reason: PollError::NoSource,
        detail: String::new(),
    };
    polls.finish(&plan[0], Err(none), start);
    let backoff = polls.config().no_source_backoff;
    assert!(polls.plan(&workers, start).is_empty());
    assert!(
        polls
            .plan(&workers, start + backoff - Duration::from_millis(1))
            .is_empty()
    );
    assert!(polls.status(&workers[0]).backoff_ms.is_some());
    let again = polls.plan(&workers, start + backoff);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].source, None, "every source is tried again");
}

#[tokio::test(start_paused = true)]
async fn a_report_older_than_the_limit_is_withdrawn_as_stale() {
    let polls = polls();
    let workers = [worker("http://10.0.0.1:8000", None, 1)];
    let start = Instant::now();
    let plan = polls.plan(&workers, start);
    let text = "vllm:num_requests_running 2\nvllm:num_requests_waiting 2\n";
    polls.finish(
        &plan[0],
        Ok((LoadSource::Metrics, loads(text), vec![0])),
        start,
    );
    let limit = polls.config().stale_age();
    let _ = polls.plan(&workers, start + limit);
    assert_eq!(workers[0].engine_reported_load(), Some(4), "at the limit");
    let _ = polls.plan(&workers, start + limit + Duration::from_millis(1));
    assert_eq!(workers[0].engine_reported_load(), None);
    assert_eq!(polls.errors(&workers[0], PollError::Stale), 1);
}

#[tokio::test(start_paused = true)]
async fn a_rank_missing_from_the_reply_fails_alone() {
    let polls = polls();
    let workers = [
        worker("http://10.0.0.1:8000", Some(0), 1),
        worker("http://10.0.0.1:8000", Some(7), 1),
    ];
    let plan = polls.plan(&workers, Instant::now());
    let text =
        "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 1\n";
    polls.finish(
        &plan[0],
        Ok((LoadSource::Metrics, loads(text), vec![0, 0])),
        Instant::now(),
    );
    assert_eq!(workers[0].engine_reported_load(), Some(2));
    assert_eq!(workers[1].engine_reported_load(), None);
    assert_eq!(polls.errors(&workers[1], PollError::RankAbsent), 1);
    assert_eq!(polls.errors(&workers[0], PollError::RankAbsent), 0);
}

#[tokio::test(start_paused = true)]
async fn workers_that_leave_are_forgotten_and_stopping_withdraws_every_report() {
    let polls = polls();
    let first = worker("http://10.0.0.1:8000", None, 1);
    let second = worker("http://10.0.0.2:8000", None, 1);
    let both = [Arc::clone(&first), Arc::clone(&second)];
    let plan = polls.plan(&both, Instant::now());
    let text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n";
    for poll in &plan {
        polls.finish(
            poll,
            Ok((LoadSource::Metrics, loads(text), vec![0])),
            Instant::now(),
        );
    }
    assert_eq!(first.engine_reported_load(), Some(1));
    let _ = polls.plan(std::slice::from_ref(&second), Instant::now());
    assert_eq!(first.engine_reported_load(), None, "it left");
    assert_eq!(polls.state.lock().workers.len(), 1);
    assert_eq!(polls.state.lock().engines.len(), 1);
    drop(WithdrawOnDrop(Arc::clone(&polls)));
    assert_eq!(second.engine_reported_load(), None);
}
