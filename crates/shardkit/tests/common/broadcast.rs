//! An in-memory round broadcast between loaders on threads of one process (what a
//! torch.distributed broadcast does between processes), for follow-mode loaders reading as
//! several ranks (and the follow options that take such a broadcast).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use shardkit::engine::{FollowOptions, RoundBroadcast};

/// One broadcast per rank of `world` (rank `r` passes the `r`-th to its loader), and how many
/// times each rank called it.
pub fn channel(world: usize) -> (Vec<RoundBroadcast>, Arc<Vec<AtomicU64>>) {
    let barrier = Arc::new(Barrier::new(world));
    let slot: Arc<Mutex<Vec<u64>>> = Arc::default();
    let calls: Arc<Vec<AtomicU64>> = Arc::new((0..world).map(|_| AtomicU64::new(0)).collect());
    let per_rank = (0..world)
        .map(|r| {
            let (barrier, slot, calls) = (barrier.clone(), slot.clone(), calls.clone());
            RoundBroadcast::new(move |value| {
                assert_eq!(value.is_some(), r == 0, "only rank 0 sends");
                if let Some(v) = value {
                    *slot.lock().unwrap() = v;
                }
                barrier.wait(); // rank 0 has put its value
                let out = slot.lock().unwrap().clone();
                barrier.wait(); // every rank has read it before the next round's
                calls[r].fetch_add(1, Ordering::Relaxed);
                Ok(out)
            })
        })
        .collect();
    (per_rank, calls)
}

/// Follow mode for a rank whose rounds come through `bc`: waits of `timeout_ms`, polls of 5 ms.
pub fn follow_with(bc: &RoundBroadcast, timeout_ms: u64) -> FollowOptions {
    FollowOptions {
        timeout: Duration::from_millis(timeout_ms),
        poll: Duration::from_millis(5),
        broadcast: Some(bc.clone()),
        ..FollowOptions::default()
    }
}
