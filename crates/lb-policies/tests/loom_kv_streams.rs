//! loom model of kv-aware's own shared-memory state: the [`KvStreams`]
//! liveness bitset (the index's read path is modelled by kv-block-index's own
//! loom tests). Two host tasks flip the bits of two workers that share one
//! word while a reader checks the change counter's promise: a reader that
//! sees both changes counted also sees both bits.
//!
//! Needs the `kv-block-index` feature:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release -p lb-policies --features kv-block-index --test loom_kv_streams`.
//! Bound: LOOM_MAX_PREEMPTIONS=2, three threads, one or two operations each.
#![cfg(all(loom, feature = "kv-block-index"))]

use std::sync::Arc;

use kv_block_index::{IndexConfig, KvIndex};
use lb_policies::KvStreams;
use loom::thread;

#[test]
fn concurrent_set_live_loses_no_bit_and_the_counter_publishes_them() {
    loom::model(|| {
        let index: KvIndex = KvIndex::new(IndexConfig::default());
        let a = index.register_worker("a".to_owned());
        let b = index.register_worker("b".to_owned());
        let streams = Arc::new(KvStreams::with_capacity(64));
        let writers: Vec<_> = [a, b]
            .into_iter()
            .map(|w| {
                let streams = Arc::clone(&streams);
                thread::spawn(move || assert!(streams.set_live(w, true)))
            })
            .collect();
        let reader = {
            let streams = Arc::clone(&streams);
            thread::spawn(move || {
                if streams.changes() == 2 {
                    assert!(streams.is_live(a) && streams.is_live(b));
                }
            })
        };
        for t in writers {
            t.join().expect("no panic");
        }
        reader.join().expect("no panic");
        assert!(streams.is_live(a) && streams.is_live(b));
        assert_eq!(streams.changes(), 2);
        // Clearing one bit leaves the other.
        assert!(streams.set_live(a, false));
        assert!(!streams.is_live(a) && streams.is_live(b));
    });
}
