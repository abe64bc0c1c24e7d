//! Reading a saev dataset while its ranks write it (follow mode): every row served exactly
//! once in the epoch that reads during the write, never a torn row, later epochs equal to a
//! loader's on the finished dataset, states that resume exactly, and an error naming the
//! missing shards when they do not come. (Writer processes: crates/shardkit-py/tests/
//! test_follow.py.)

mod common;

use common::rank;
use common::saev::{
    assert_committed_epochs_as_plain, assert_each_row_once, assert_states_resume_exactly, drain,
    metadata, options, rounds_of, rows_of, take, two_ranks_after_round_1, write_meanwhile,
    write_shard, Rows, FOLLOW_N,
};

use std::sync::{Arc, Barrier};
use std::time::Duration;

use shardkit::engine::Order;
use shardkit::saev::{FollowOptions, Loader, LoaderOptions, PartWriter, RoundBroadcast, WaitCheck};
use shardkit::Error;

/// 40 examples, 2 examples per shard: 20 shards.
const N: u64 = FOLLOW_N;
const SHARDS: u64 = 20;

#[test]
fn a_follow_loader_reading_during_the_write_serves_every_row_once_and_later_epochs_as_finished() {
    for order in [Order::Block, Order::Exact, Order::Sequential] {
        let tmp = tempfile::tempdir().unwrap();
        // Both ranks open (metadata.json exists), then write a shard every few milliseconds.
        let writers: Vec<PartWriter> = (0..2)
            .map(|r| PartWriter::create(tmp.path(), metadata(N), rank(r, 2)).unwrap())
            .collect();
        let dir = writers[0].path().to_path_buf();
        let mut loader = Loader::new(&dir, options(true, order)).unwrap();
        let threads = write_meanwhile(writers);
        let epoch0 = drain(&loader);
        let rounds = rounds_of(&loader.state());
        for t in threads {
            t.join().unwrap();
        }
        assert_each_row_once(&epoch0);
        assert!(
            rounds >= 2,
            "{order:?}: the write was read in {rounds} round(s)"
        );
        assert_eq!(loader.state().uint("cursor").unwrap(), Some(N * 3));
        // Committed: epoch 1 (and epoch 0 read again) are a finished dataset's, batch for
        // batch; opened on the committed dataset, follow mode changes nothing.
        let late = assert_committed_epochs_as_plain(&mut loader, &dir, order);
        assert_eq!(late.state().uint("cursor").unwrap(), Some(N * 3));
    }
}

#[test]
fn a_state_saved_mid_round_or_across_rounds_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    // Round 1: shards 0, 1, 2, 10, 11 (30 rows: 7 batches of 4 and one of 2).
    let (mut a, mut b, dir) = two_ranks_after_round_1(tmp.path());
    let loader = Loader::new(&dir, options(true, Order::Block)).unwrap();
    let mut it = loader.iter().unwrap();
    let mut seen = take(&mut it, 3);
    let mid_round = loader.state();
    assert_eq!(mid_round.uint("cursor").unwrap(), Some(12));
    seen.extend(take(&mut it, 5));
    assert_eq!(loader.state().uint("cursor").unwrap(), Some(30));
    // Round 2: shards 3, 4 and 12 (18 rows).
    for s in [3, 4] {
        write_shard(&mut a, s);
    }
    write_shard(&mut b, 12);
    seen.extend(take(&mut it, 2));
    let across = loader.state();
    assert_eq!(across.uint("cursor").unwrap(), Some(38));
    assert_eq!(rounds_of(&across), 2);
    // The rest lands and commits; the pass reads it as one more round.
    for s in 5..10 {
        write_shard(&mut a, s);
    }
    for s in 13..20 {
        write_shard(&mut b, s);
    }
    // Every shard is durable: the first to finish commits.
    assert!(a.finish().unwrap().committed);
    assert!(b.finish().unwrap().committed);
    seen.extend(it.map(|b| rows_of(b.unwrap())));
    assert_each_row_once(&seen);

    // Across rounds the rounds recorded are replayed; mid-round, the round's remaining
    // batches come exactly, then the rest.
    assert_states_resume_exactly(&dir, &across, &mid_round, &seen);
    // A loader without follow mode cannot continue a state of several rounds.
    let mut plain = Loader::new(&dir, options(false, Order::Block)).unwrap();
    let e = plain.load_state(across).unwrap_err();
    assert!(
        matches!(e, Error::Invalid(_)) && e.to_string().contains("follow-mode loader"),
        "{e}"
    );
}

#[test]
fn a_follow_loader_waiting_too_long_names_the_missing_shards_and_their_holders() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = PartWriter::create(tmp.path(), metadata(N), rank(0, 2)).unwrap();
    let dir = a.path().to_path_buf();
    write_shard(&mut a, 0);
    let mut o = options(true, Order::Block);
    o.follow = Some(FollowOptions {
        timeout: Duration::from_millis(200),
        poll: Duration::from_millis(20),
        interrupted: None,
        broadcast: None,
    });
    let loader = Loader::new(&dir, o).unwrap();
    let out: Vec<_> = loader.iter().unwrap().collect();
    // Shard 0's 6 rows, then the error.
    assert_eq!(out.len(), 3);
    let e = out.into_iter().last().unwrap().unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            Error::Incomplete {
                present: 2,
                total: 40,
                ..
            }
        ),
        "{e:?}"
    );
    let holder = format!("rank 0 of 2, pid {}", std::process::id());
    assert!(
        msg.contains(&format!("shards 1..10 (claimed by {holder}"))
            && msg.contains("shards 10..20 (claimed by no live writer)"),
        "{msg}"
    );
    // A wait whose check says stop ends at once, saying why.
    let mut o = options(true, Order::Block);
    o.follow = Some(FollowOptions {
        interrupted: Some(WaitCheck(|| true)),
        ..FollowOptions::default()
    });
    let loader = Loader::new(&dir, o).unwrap();
    let t0 = std::time::Instant::now();
    let e = loader.iter().unwrap().last().unwrap().unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    let msg = e.to_string();
    assert!(
        msg.contains("stopped waiting for shards: it was interrupted")
            && msg.contains("shards 1..10"),
        "{msg}"
    );
    drop(a);
}

#[test]
fn follow_mode_refuses_what_it_cannot_keep_exact_and_without_it_an_unfinished_dataset_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = PartWriter::create(tmp.path(), metadata(N), rank(0, 1)).unwrap();
    let dir = a.path().to_path_buf();
    write_shard(&mut a, 0);
    let e = Loader::new(&dir, options(false, Order::Block)).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    let mut o = options(true, Order::Block);
    o.world_size = Some(2);
    o.rank = Some(0);
    let e = Loader::new(&dir, o).unwrap_err().to_string();
    assert!(
        e.contains("reads with world_size 2 only when the ranks agree on its rounds")
            && e.contains("follow_broadcast="),
        "{e}"
    );
    let mut o = options(true, Order::Block);
    o.drop_last = true;
    let e = Loader::new(&dir, o).unwrap_err().to_string();
    assert!(e.contains("cannot drop_last"), "{e}");
    // Committed, follow mode with two ranks reads as without it.
    for s in 1..SHARDS {
        write_shard(&mut a, s);
    }
    assert!(a.finish().unwrap().committed);
    for r in 0..2 {
        let mut o = options(true, Order::Exact);
        (o.rank, o.world_size) = (Some(r), Some(2));
        let mut p = options(false, Order::Exact);
        (p.rank, p.world_size) = (Some(r), Some(2));
        let f = Loader::new(&dir, o).unwrap();
        assert_eq!(drain(&f), drain(&Loader::new(&dir, p).unwrap()));
        assert!(f.state().get("follow_rounds").is_none());
    }
    // Committed but broken is an error naming the file, not a wait for it.
    let shard = dir.join("acts000003.bin");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.set_len(10).unwrap();
    let e = Loader::new(&dir, options(true, Order::Block)).unwrap_err();
    assert!(
        matches!(e, Error::Format { .. }) && e.to_string().contains("acts000003.bin"),
        "{e:?}"
    );
}

/// Rank `r` of `w` reading in follow mode with broadcast `bc` and timeout `timeout_ms`.
fn ranked(order: Order, r: u64, w: u64, bc: &RoundBroadcast, timeout_ms: u64) -> LoaderOptions {
    let mut o = options(true, order);
    (o.rank, o.world_size) = (Some(r), Some(w));
    o.follow = Some(common::broadcast::follow_with(bc, timeout_ms));
    o
}

#[test]
fn ranks_reading_together_serve_every_row_once_and_after_the_commit_as_the_plain_loader() {
    const W: u64 = 3;
    for order in [Order::Block, Order::Exact] {
        let tmp = tempfile::tempdir().unwrap();
        let writers: Vec<PartWriter> = (0..2)
            .map(|r| PartWriter::create(tmp.path(), metadata(N), rank(r, 2)).unwrap())
            .collect();
        let dir = writers[0].path().to_path_buf();
        let (bcs, calls) = common::broadcast::channel(W as usize);
        // The readers open before the first shard, read epoch 0 while the writers write, then
        // (once the main thread has seen the commit) epoch 1.
        let committed = Arc::new(Barrier::new(W as usize + 1));
        let readers: Vec<_> = (0..W)
            .map(|r| {
                let (dir, bc, committed) =
                    (dir.clone(), bcs[r as usize].clone(), committed.clone());
                let mut loader = Loader::new(&dir, ranked(order, r, W, &bc, 20_000)).unwrap();
                std::thread::spawn(move || {
                    let epoch0 = drain(&loader);
                    let st = loader.state();
                    committed.wait();
                    loader.set_epoch(1).unwrap();
                    let epoch1 = drain(&loader);
                    let mut p = options(false, order);
                    (p.rank, p.world_size, p.epoch) = (Some(r), Some(W), 1);
                    let plain = drain(&Loader::new(&dir, p).unwrap());
                    (epoch0, st, epoch1, plain)
                })
            })
            .collect();
        for t in write_meanwhile(writers) {
            t.join().unwrap();
        }
        committed.wait();
        let out: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
        let all: Vec<Rows> = out.iter().flat_map(|o| o.0.clone()).collect();
        assert_each_row_once(&all); // so the ranks' rows are disjoint too
        let rounds = rounds_of(&out[0].1);
        assert!(
            rounds >= 2,
            "{order:?}: the write was read in {rounds} round(s)"
        );
        for (r, (epoch0, st, epoch1, plain)) in out.iter().enumerate() {
            // The same rounds on every rank, each formed by one broadcast.
            assert_eq!(
                st.get("follow_rounds"),
                out[0].1.get("follow_rounds"),
                "rank {r}"
            );
            assert_eq!(
                calls[r].load(std::sync::atomic::Ordering::Relaxed),
                rounds as u64 + 1
            );
            // Every round but the last gives every rank as many batches: the rows here come
            // in shards of 6, so each rank had a batch of every global batch.
            assert_eq!(epoch0.len(), out[0].0.len(), "rank {r}");
            assert_eq!(st.uint("cursor").unwrap(), Some(N * 3));
            assert!(epoch0.iter().all(|b| b.0.len() <= 4));
            assert_eq!(epoch1, plain, "{order:?}: rank {r}'s epoch 1");
        }
    }
}

#[test]
fn ranks_reading_together_resume_mid_round_each_from_its_own_state() {
    const W: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    // Round 1: shards 0, 1, 2, 10, 11 (30 rows: 3 global batches of 2 x 4, then 3 rows each).
    let (mut a, mut b, dir) = two_ranks_after_round_1(tmp.path());
    let (bcs, _) = common::broadcast::channel(W as usize);
    let halfway = Arc::new(Barrier::new(W as usize + 1));
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, halfway) = (dir.clone(), bcs[r as usize].clone(), halfway.clone());
            std::thread::spawn(move || {
                let loader = Loader::new(&dir, ranked(Order::Block, r, W, &bc, 20_000)).unwrap();
                let mut it = loader.iter().unwrap();
                let mut seen = take(&mut it, 2);
                let mid = loader.state();
                assert_eq!(mid.uint("cursor").unwrap(), Some(16));
                assert_eq!(mid.batch, 2, "global batches served");
                seen.extend(take(&mut it, 2));
                assert_eq!(loader.state().uint("cursor").unwrap(), Some(30));
                halfway.wait();
                seen.extend(it.map(|b| rows_of(b.unwrap())));
                (seen, mid)
            })
        })
        .collect();
    halfway.wait();
    for s in 3..10 {
        write_shard(&mut a, s);
    }
    for s in 12..20 {
        write_shard(&mut b, s);
    }
    assert!(a.finish().unwrap().committed || b.finish().unwrap().committed);
    let out: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
    let all: Vec<Rows> = out.iter().flat_map(|o| o.0.clone()).collect();
    assert_each_row_once(&all);
    // Each rank from its own state: the rest of its round exactly, then the rest once.
    let (bcs, _) = common::broadcast::channel(W as usize);
    let resumed: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, mid) = (
                dir.clone(),
                bcs[r as usize].clone(),
                out[r as usize].1.clone(),
            );
            std::thread::spawn(move || {
                let mut l = Loader::new(&dir, ranked(Order::Block, r, W, &bc, 20_000)).unwrap();
                l.load_state(mid).unwrap();
                l.set_epoch(0).unwrap();
                drain(&l)
            })
        })
        .collect();
    let mut all = Vec::new();
    for (r, t) in resumed.into_iter().enumerate() {
        let rest = t.join().unwrap();
        assert_eq!(rest[..2], out[r].0[2..4], "rank {r}: the rest of its round");
        all.extend(out[r].0[..2].iter().cloned());
        all.extend(rest);
    }
    assert_each_row_once(&all);
}

#[test]
fn a_stop_on_rank_0_reaches_every_rank_as_the_same_incomplete_error() {
    const W: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let mut a = PartWriter::create(tmp.path(), metadata(N), rank(0, 2)).unwrap();
    let dir = a.path().to_path_buf();
    write_shard(&mut a, 0);
    let (bcs, _) = common::broadcast::channel(W as usize);
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc) = (dir.clone(), bcs[r as usize].clone());
            // Rank 1 alone would wait an hour: it stops when rank 0 does.
            let timeout = if r == 0 { 200 } else { 3_600_000 };
            std::thread::spawn(move || {
                let l = Loader::new(&dir, ranked(Order::Block, r, W, &bc, timeout)).unwrap();
                let out: Vec<_> = l.iter().unwrap().collect();
                let n = out.len();
                (n, out.into_iter().last().unwrap().unwrap_err())
            })
        })
        .collect();
    for (r, t) in readers.into_iter().enumerate() {
        let (n, e) = t.join().unwrap();
        // Shard 0's 6 rows: one global batch of 4 + 2, so one batch a rank, then the error.
        assert_eq!(n, 2, "rank {r}");
        assert!(
            matches!(
                e,
                Error::Incomplete {
                    present: 2,
                    total: 40,
                    ..
                }
            ),
            "rank {r}: {e:?}"
        );
        assert!(
            e.to_string().contains("shards 1..10 (claimed by"),
            "rank {r}: {e}"
        );
    }
    drop(a);
}
