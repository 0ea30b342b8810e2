//! loom model of the publisher's replay buffer: two publishing threads and
//! a replay reader. Whatever the interleaving, numbers are unique and
//! consecutive from 0, a replay snapshot is an ordered run of consecutive
//! numbers whose payloads are the ones pushed under them, and the buffer
//! keeps exactly the newest `capacity` batches.
//!
//! Bound: 3 threads, 2 operations each; `LOOM_MAX_PREEMPTIONS=2` finishes
//! in about a second in release mode.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;

use kv_events::ReplayBuffer;

/// A payload that names its pusher and the number it got, so the reader
/// can check pairs: (thread, its k-th push).
type Payload = (u8, u8);

#[test]
fn concurrent_pushes_and_a_replay_stay_consistent() {
    loom::model(|| {
        let buffer = Arc::new(ReplayBuffer::<Payload>::new(3));
        let pushers: Vec<_> = (0..2u8)
            .map(|t| {
                let buffer = Arc::clone(&buffer);
                thread::spawn(move || {
                    let first = buffer.push((t, 0));
                    let second = buffer.push((t, 1));
                    // One thread's pushes are numbered in its order.
                    assert!(second > first);
                    (first, second)
                })
            })
            .collect();
        let reader = {
            let buffer = Arc::clone(&buffer);
            thread::spawn(move || buffer.since(1))
        };
        let snapshot = reader.join().unwrap();
        // Ordered, consecutive, at or above the requested number.
        for pair in snapshot.windows(2) {
            assert_eq!(pair[1].0, pair[0].0 + 1);
        }
        assert!(snapshot.iter().all(|(seq, _)| *seq >= 1));
        let numbers: Vec<(u64, u64)> = pushers.into_iter().map(|h| h.join().unwrap()).collect();
        let mut all: Vec<u64> = numbers.iter().flat_map(|(a, b)| [*a, *b]).collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
        assert_eq!(buffer.next_seq(), 4);
        // The newest three are kept, each under the number it was given.
        let kept = buffer.since(0);
        assert_eq!(
            kept.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        for (seq, (t, k)) in &kept {
            let given = numbers[usize::from(*t)];
            let expected = if *k == 0 { given.0 } else { given.1 };
            assert_eq!(*seq, expected);
        }
        // A snapshot taken during the pushes agrees with the final state.
        for entry in &snapshot {
            if let Some(now) = kept.iter().find(|(s, _)| *s == entry.0) {
                assert_eq!(now, entry);
            }
        }
    });
}
