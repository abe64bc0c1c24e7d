//! The process's request slots: how many requests run at once, and whose turn it is.

use std::sync::{Arc, Mutex};

use crate::config::inflight;

/// A GET of `len` bytes takes this many quarters of a request slot: its size over the full
/// request size, rounded up, at least one quarter. A far store's throughput is the bytes kept
/// outstanding (each request waits a round trip, then streams at a connection's rate), so a
/// loader whose layout gives small requests (one layer's 1 MiB slabs of a saev shard) keeps
/// as many bytes in flight as one reading whole shards, with up to four times as many
/// requests; memory held stays within `inflight · max_request` either way.
pub(crate) fn slot_quarters(len: u64, max_request: u64) -> u32 {
    let q = QUARTERS_PER_SLOT as u64;
    (len.saturating_mul(q).div_ceil(max_request.max(1))).clamp(1, q) as u32
}

/// The parts a request slot is counted in ([`slot_quarters`]).
const QUARTERS_PER_SLOT: u32 = 4;

/// The process's [`inflight`] request slots (counted in quarters, [`slot_quarters`]), shared
/// by every read, and the turn to take them.
/// Reads take the turn first come first served, and a read keeps it until each of its requests
/// has a slot: a read started while another is still fetching (a loader's next window) queues
/// behind all of the first read's requests, then takes each slot they leave. So the store stays
/// busy through the first read's tail, the first read is not slowed by the second, and at most
/// `inflight` responses are held at once. Made again when [`inflight`] changes, and in a forked
/// child (whose copy may count slots held by the parent's tasks, which do not exist there).
#[derive(Clone)]
pub(crate) struct RequestSlots {
    pub(crate) slots: Arc<tokio::sync::Semaphore>,
    pub(crate) turn: Arc<tokio::sync::Mutex<()>>,
}

pub(crate) fn request_slots() -> RequestSlots {
    static SLOTS: Mutex<Option<(u32, usize, RequestSlots)>> = Mutex::new(None);
    let mut slots = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
    let (pid, n) = (std::process::id(), inflight());
    match &*slots {
        Some((p, m, s)) if *p == pid && *m == n => s.clone(),
        _ => {
            let s = RequestSlots {
                slots: Arc::new(tokio::sync::Semaphore::new(
                    n.saturating_mul(QUARTERS_PER_SLOT as usize),
                )),
                turn: Arc::new(tokio::sync::Mutex::new(())),
            };
            *slots = Some((pid, n, s.clone()));
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_takes_a_share_of_a_slot_by_its_size_down_to_a_quarter() {
        let max = 8 << 20;
        assert_eq!(slot_quarters(max, max), 4);
        assert_eq!(slot_quarters(6 << 20, max), 3);
        assert_eq!(slot_quarters((2 << 20) + 1, max), 2);
        assert_eq!(slot_quarters(2 << 20, max), 1);
        assert_eq!(slot_quarters(1 << 20, max), 1);
        assert_eq!(slot_quarters(0, max), 1);
        // Never more than a slot, never a zero-sized request size.
        assert_eq!(slot_quarters(u64::MAX, max), 4);
        assert_eq!(slot_quarters(1, 0), 4);
    }
}
