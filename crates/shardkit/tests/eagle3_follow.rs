//! Follow mode of the EAGLE-3 loader: a loader reading a cache while `eagle3::PartWriter`
//! ranks write it serves every sample once an epoch, whole (never a torn sample), resumes a
//! saved state exactly, names the missing shards and their claimants when it stops waiting,
//! reads like a plain loader once the cache is committed, and refuses world_size > 1 on an
//! unfinished cache.

mod common;

use common::eagle3::{
    assert_epoch_1_as_committed, assert_every_sample_once_in_rounds, assert_resumed_alike,
    check_whole, drain, follow_opts, write_meanwhile, write_shards, writer, FOLLOW_N,
};

use std::sync::{Arc, Barrier};
use std::time::Duration;

use shardkit::eagle3::{Cache, Loader, LoaderOptions, PartWriter, RoundBroadcast};

const N: u64 = FOLLOW_N;

#[test]
fn a_follow_loader_serves_every_sample_once_while_ranks_write_then_reads_as_a_plain_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let ws: Vec<PartWriter> = (0..3).map(|r| writer(&dir, r, 3)).collect();
    let m = ws[0].manifest().clone();
    let mut loader = Loader::open(&dir, follow_opts(20_000)).unwrap();
    let threads = write_meanwhile(ws);
    assert_every_sample_once_in_rounds(&loader, &m);
    for t in threads {
        t.join().unwrap();
    }
    // Committed now: epoch 1 is the plain loader's.
    assert_epoch_1_as_committed(&mut loader, &dir, &m);
}

#[test]
fn a_state_saved_mid_epoch_resumes_exactly_and_the_timeout_names_the_missing_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let w0 = writer(&dir, 0, 2);
    let w1 = writer(&dir, 1, 2); // claims shards 6..12, writes later
    let m = w0.manifest().clone();
    write_shards(w0, Duration::ZERO);
    let mut a = Loader::open(&dir, follow_opts(300)).unwrap();
    let mut it = a.iter();
    let first = it.next().unwrap().unwrap();
    check_whole(&m, &first);
    let saved = {
        let mut s = a.state();
        s.batch = it.cursor();
        s
    };
    let (rest_a, err) = drain(&mut it, &m);
    let err = err.expect("the wait times out");
    assert!(
        err.contains("missing: shards 6..12 (claimed by") && err.contains("follow mode waited"),
        "{err}"
    );
    let at = it.cursor();
    drop(it);
    a.advance_to(at);
    // Another loader from the saved state serves the rest of the round, then waits likewise.
    assert_resumed_alike(&dir, &mut a, saved, &first.indices, rest_a, w1, &m);
}

#[test]
fn world_size_above_one_is_refused_on_an_unfinished_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let _w = writer(&dir, 0, 2);
    let mut o = follow_opts(100);
    o.world_size = Some(2);
    let e = Loader::open(&dir, o).err().unwrap().to_string();
    assert!(
        e.contains("reads with world_size 2 only when the ranks agree on its rounds")
            && e.contains("follow_broadcast="),
        "{e}"
    );
    let mut o = follow_opts(100);
    o.drop_last = true;
    let e = Loader::open(&dir, o).err().unwrap().to_string();
    assert!(e.contains("cannot drop_last"), "{e}");
}

/// Rank `r` of `w` in follow mode with broadcast `bc`, batches of 3.
fn ranked(r: u64, w: u64, bc: &RoundBroadcast, timeout_ms: u64) -> LoaderOptions {
    let mut o = follow_opts(timeout_ms);
    (o.rank, o.world_size) = (Some(r), Some(w));
    o.follow = Some(common::broadcast::follow_with(bc, timeout_ms));
    o
}

#[test]
fn ranks_reading_together_serve_every_sample_once_but_the_last_rounds_padding() {
    const W: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let ws: Vec<PartWriter> = (0..3).map(|r| writer(&dir, r, 3)).collect();
    let m = ws[0].manifest().clone();
    let (bcs, calls) = common::broadcast::channel(W as usize);
    let committed = Arc::new(Barrier::new(W as usize + 1));
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, m, committed) = (
                dir.clone(),
                bcs[r as usize].clone(),
                m.clone(),
                committed.clone(),
            );
            let mut loader = Loader::open(&dir, ranked(r, W, &bc, 20_000)).unwrap();
            std::thread::spawn(move || {
                let (epoch0, err) = drain(&mut loader.iter(), &m);
                assert_eq!(err, None, "rank {r}");
                let rounds = loader.state().get("follow_rounds").cloned();
                committed.wait();
                loader.set_epoch(1);
                let (epoch1, err) = drain(&mut loader.iter(), &m);
                assert_eq!(err, None, "rank {r}");
                let mut o = follow_opts(0);
                (o.follow, o.epoch, o.rank, o.world_size) = (None, 1, Some(r), Some(W));
                let plain = Loader::new(Arc::new(Cache::open(&dir).unwrap()), o).unwrap();
                let (plain1, _) = drain(&mut plain.iter(), &m);
                (epoch0, rounds, epoch1, plain1)
            })
        })
        .collect();
    let threads = write_meanwhile(ws);
    for t in threads {
        t.join().unwrap();
    }
    committed.wait();
    let out: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
    let Some(shardkit::engine::StateValue::List(flat)) = out[0].1.clone() else {
        panic!("no follow_rounds")
    };
    assert!(flat.len() > 3, "one round only: {flat:?}");
    // The rounds as rank 0 recorded them, each formed by one broadcast (and one for epoch 1).
    let (mut i, mut rounds, mut last) = (0, 0, Vec::new());
    while i < flat.len() {
        last = flat[i + 1..i + 1 + 2 * flat[i] as usize].to_vec();
        i += 1 + 2 * flat[i] as usize;
        rounds += 1;
    }
    let mut counts = vec![0u32; N as usize];
    for (r, (epoch0, rounds_r, epoch1, plain1)) in out.iter().enumerate() {
        assert_eq!(rounds_r, &out[0].1, "rank {r}: the same rounds");
        assert_eq!(
            calls[r].load(std::sync::atomic::Ordering::Relaxed),
            rounds + 1
        );
        assert_eq!(epoch0.len(), out[0].0.len(), "rank {r}: as many batches");
        assert_eq!(epoch1, plain1, "rank {r}: epoch 1 is the plain loader's");
        for &i in epoch0.iter().flatten() {
            counts[i as usize] += 1;
        }
    }
    // Every sample once, but the last round padded to a multiple of the ranks (as the plain
    // loader pads its epoch): its first sample twice when it has an odd count.
    let last_samples: u64 = last
        .chunks(2)
        .flat_map(|p| p[0]..p[1])
        .map(|s| m.shard_size.min(N - s * m.shard_size))
        .sum();
    let twice = counts.iter().filter(|&&c| c == 2).count() as u64;
    assert!(counts.iter().all(|&c| c == 1 || c == 2), "{counts:?}");
    assert_eq!(twice, last_samples % W, "{counts:?}");
}

#[test]
fn a_round_that_would_split_unevenly_over_the_ranks_waits_for_more_shards() {
    const W: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    // One shard a writer: shard 11 holds the 23rd sample alone.
    let mut ws: Vec<Option<PartWriter>> = (0..12).map(|r| Some(writer(&dir, r, 12))).collect();
    let m = ws[0].as_ref().unwrap().manifest().clone();
    for s in [0, 1, 2, 11] {
        write_shards(ws[s].take().unwrap(), Duration::ZERO);
    }
    // 7 samples over 2 ranks in batches of 3: 4 samples (2 batches) and 3 (1 batch). Nothing
    // more comes: the wait ends saying why.
    let (bcs, _) = common::broadcast::channel(W as usize);
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, m) = (dir.clone(), bcs[r as usize].clone(), m.clone());
            std::thread::spawn(move || {
                let l = Loader::open(&dir, ranked(r, W, &bc, 200)).unwrap();
                drain(&mut l.iter(), &m)
            })
        })
        .collect();
    for t in readers {
        let (batches, err) = t.join().unwrap();
        assert!(batches.is_empty());
        let err = err.unwrap();
        assert!(err.contains("different numbers of batches"), "{err}");
    }
    // With shard 3 too, a moment later: 9 samples, 2 batches on each rank.
    let (bcs, _) = common::broadcast::channel(W as usize);
    let formed = Arc::new(Barrier::new(W as usize + 1));
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, m, formed) = (
                dir.clone(),
                bcs[r as usize].clone(),
                m.clone(),
                formed.clone(),
            );
            std::thread::spawn(move || {
                let l = Loader::open(&dir, ranked(r, W, &bc, 20_000)).unwrap();
                let mut it = l.iter();
                let first = it.next().unwrap().unwrap();
                check_whole(&m, &first);
                formed.wait();
                let (mut rest, err) = drain(&mut it, &m);
                assert_eq!(err, None);
                rest.insert(0, first.indices.clone());
                (rest, l.state().get("follow_rounds").cloned())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    write_shards(ws[3].take().unwrap(), Duration::ZERO);
    formed.wait();
    for w in ws.iter_mut().filter_map(Option::take) {
        write_shards(w, Duration::ZERO);
    }
    let mut seen = Vec::new();
    for t in readers {
        let (batches, rounds) = t.join().unwrap();
        let Some(shardkit::engine::StateValue::List(flat)) = rounds else {
            panic!("no follow_rounds")
        };
        assert_eq!(
            flat[..5],
            [2, 0, 4, 11, 12],
            "the first round: shards 0..4 and 11"
        );
        seen.extend(batches.concat());
    }
    seen.sort_unstable();
    // The later rounds (of shards 4..11, 2 samples each) split evenly: no padding.
    assert_eq!(seen, (0..N).collect::<Vec<_>>());
}

#[test]
fn ranks_reading_together_resume_mid_round_each_from_its_own_state() {
    const W: u64 = 2;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let w0 = writer(&dir, 0, 2);
    let w1 = writer(&dir, 1, 2);
    let m = w0.manifest().clone();
    // Round 1: shards 0..6, 12 samples: 6 a rank, 2 batches each.
    write_shards(w0, Duration::ZERO);
    let (bcs, _) = common::broadcast::channel(W as usize);
    let (round1, written) = (
        Arc::new(Barrier::new(W as usize + 1)),
        Arc::new(Barrier::new(W as usize + 1)),
    );
    let readers: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, m) = (dir.clone(), bcs[r as usize].clone(), m.clone());
            let (round1, written) = (round1.clone(), written.clone());
            std::thread::spawn(move || {
                let l = Loader::open(&dir, ranked(r, W, &bc, 20_000)).unwrap();
                let mut it = l.iter();
                let first = it.next().unwrap().unwrap();
                let mut st = l.state();
                st.batch = it.cursor();
                let second = it.next().unwrap().unwrap();
                round1.wait();
                written.wait(); // round 2 is the rest, 11 samples: padded to 12, 2 batches each
                let (rest, err) = drain(&mut it, &m);
                assert_eq!(err, None);
                let all = [vec![first.indices.clone(), second.indices.clone()], rest].concat();
                (all, st)
            })
        })
        .collect();
    round1.wait();
    write_shards(w1, Duration::ZERO);
    written.wait();
    let out: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
    for (all, _) in &out {
        assert_eq!(all.len(), 4, "2 batches a round on each rank");
    }
    let (bcs, _) = common::broadcast::channel(W as usize);
    let resumed: Vec<_> = (0..W)
        .map(|r| {
            let (dir, bc, m) = (dir.clone(), bcs[r as usize].clone(), m.clone());
            let st = out[r as usize].1.clone();
            std::thread::spawn(move || {
                let mut l = Loader::open(&dir, ranked(r, W, &bc, 20_000)).unwrap();
                l.load_state(st).unwrap();
                drain(&mut l.iter(), &m)
            })
        })
        .collect();
    for (r, t) in resumed.into_iter().enumerate() {
        let (rest, err) = t.join().unwrap();
        assert_eq!(err, None);
        assert_eq!(rest, out[r].0[1..], "rank {r} resumes batch for batch");
    }
}
