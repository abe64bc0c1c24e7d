//! Follow mode on `s3://`: a saev dataset and an EAGLE-3 cache read while their ranks write
//! them to an object store (an in-memory one put in place of the bucket, wrapped to log every
//! request; threads as ranks), as on a local file system (tests/saev_follow.rs,
//! tests/eagle3_follow.rs): every row once in the epoch read during the write, never a torn
//! row, labels from the pieces and then from labels.bin, later epochs equal to the committed
//! loader's, states resuming exactly, and a wait that ends naming the missing shards and their
//! holders; while it waits a loader lists the store at most once a poll and writes nothing.
//! Each test is its own process under nextest, so the store each installs is its own.
#![allow(clippy::single_range_in_vec_init)] // rounds of one range

mod common;

use common::rank;
use common::saev::{
    assert_committed_epochs_as_plain, assert_each_row_once, assert_states_resume_exactly, drain,
    metadata, options, rounds_of, rows_of, take, two_ranks_after_round_1, write_meanwhile,
    write_shard, FOLLOW_N,
};
use common::stores::{self, Hook, Hooked};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use shardkit::engine::Order;
use shardkit::saev::{FollowOptions, Loader, PartWriter};
use shardkit::Error;

const ROOT: &str = "s3://bucket/data";

/// The requests to a store, each (operation, object or prefix).
#[derive(Debug, Default)]
struct Log(Mutex<Vec<(&'static str, String)>>);

impl Hook for Log {
    fn before(&self, op: &'static str, path: Option<&ObjectPath>) -> object_store::Result<()> {
        let p = path.map(|p| p.as_ref().to_string()).unwrap_or_default();
        self.0.lock().unwrap().push((op, p));
        Ok(())
    }
}

/// An in-memory store that logs each request.
type Logged = Hooked<Log>;

impl Logged {
    /// The requests logged so far.
    fn mark(&self) -> usize {
        self.hook.0.lock().unwrap().len()
    }

    /// The requests logged since `mark`.
    fn since(&self, mark: usize) -> Vec<(&'static str, String)> {
        self.hook.0.lock().unwrap()[mark..].to_vec()
    }

    /// Whether shards `shards` of the dataset `dir` (its URL) are recorded durable.
    fn durable(&self, dir: &Path, shards: &[&str]) -> bool {
        let prefix = format!("{}/.shardkit-parts/done", key_of(dir));
        let names: Vec<String> = futures::executor::block_on(
            self.inner
                .list(Some(&ObjectPath::from(prefix.as_str())))
                .try_collect::<Vec<_>>(),
        )
        .unwrap()
        .into_iter()
        .map(|m| m.location.as_ref().to_string())
        .collect();
        shards
            .iter()
            .all(|s| names.iter().any(|n| n.ends_with(&format!("/{s}.json"))))
    }

    /// Waits until `shards` are durable (a rank uploads its shards behind its writer).
    fn wait_durable(&self, dir: &Path, shards: &[&str]) {
        let t0 = Instant::now();
        while !self.durable(dir, shards) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{shards:?} never durable"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The object key of the dataset at URL `dir`.
fn key_of(dir: &Path) -> String {
    dir.to_str()
        .unwrap()
        .strip_prefix("s3://bucket/")
        .unwrap()
        .to_string()
}

/// A fresh logged store in place of `s3://bucket`, staging under `tmp`.
fn store(tmp: &Path) -> Arc<Logged> {
    stores::install(&tmp.join("staging"), Logged::default())
}

// ---- saev: the dataset of tests/saev_follow.rs ----

const N: u64 = FOLLOW_N;

fn shard(s: u64) -> String {
    format!("acts{s:06}.bin")
}

#[test]
fn a_follow_loader_on_a_store_serves_every_row_once_during_the_write_then_the_committed_epochs() {
    for order in [Order::Block, Order::Exact, Order::Sequential] {
        let tmp = tempfile::tempdir().unwrap();
        let _store = store(tmp.path());
        let writers: Vec<PartWriter> = (0..2)
            .map(|r| PartWriter::create(ROOT, metadata(N), rank(r, 2)).unwrap())
            .collect();
        let dir = writers[0].path().to_path_buf();
        // Not committed: without follow mode it is refused, as locally.
        let e = Loader::new(&dir, options(false, order)).unwrap_err();
        assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
        let mut loader = Loader::new(&dir, options(true, order)).unwrap();
        let threads = write_meanwhile(writers);
        let epoch0 = drain(&loader);
        let rounds = rounds_of(&loader.state());
        let committed = threads
            .into_iter()
            .map(|t| t.join().unwrap().committed)
            .collect::<Vec<_>>();
        assert!(committed.contains(&true), "{committed:?}");
        assert_each_row_once(&epoch0);
        assert!(rounds >= 2, "{order:?}: read in {rounds} round(s)");
        assert_eq!(loader.state().uint("cursor").unwrap(), Some(N * 3));
        // Committed: epoch 1 (its labels from labels.bin, the pieces gone) and epoch 0 read
        // again are the committed loader's, batch for batch; opened on the committed dataset,
        // follow mode changes nothing.
        assert_committed_epochs_as_plain(&mut loader, &dir, order);
    }
}

#[test]
fn a_state_saved_mid_round_on_a_store_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let store = store(tmp.path());
    // Round 1: shards 0, 1, 2, 10, 11 (30 rows: 7 batches of 4 and one of 2).
    let (mut a, mut b, dir) = two_ranks_after_round_1(ROOT);
    let round1: Vec<String> = [0, 1, 2, 10, 11].map(shard).to_vec();
    store.wait_durable(&dir, &round1.iter().map(String::as_str).collect::<Vec<_>>());
    let loader = Loader::new(&dir, options(true, Order::Block)).unwrap();
    let mut it = loader.iter().unwrap();
    let mut seen = take(&mut it, 3);
    let mid_round = loader.state();
    assert_eq!(mid_round.uint("cursor").unwrap(), Some(12));
    seen.extend(take(&mut it, 5));
    assert_eq!(loader.state().uint("cursor").unwrap(), Some(30));
    // Round 2: shards 3, 4 and 12 (18 rows), once all three are durable.
    for s in [3, 4] {
        write_shard(&mut a, s);
    }
    write_shard(&mut b, 12);
    store.wait_durable(&dir, &[&shard(3), &shard(4), &shard(12)]);
    seen.extend(take(&mut it, 2));
    let across = loader.state();
    assert_eq!(across.uint("cursor").unwrap(), Some(38));
    assert_eq!(rounds_of(&across), 2);
    for s in 5..10 {
        write_shard(&mut a, s);
    }
    for s in 13..20 {
        write_shard(&mut b, s);
    }
    // Rank 0 finds rank 1's last shards still going up (or not) and leaves the commit to it.
    a.finish().unwrap();
    assert!(b.finish().unwrap().committed);
    seen.extend(it.map(|b| rows_of(b.unwrap())));
    assert_each_row_once(&seen);

    // Across rounds the rounds recorded are replayed; mid-round, the round's remaining
    // batches come exactly, then the rest.
    assert_states_resume_exactly(&dir, &across, &mid_round, &seen);
}

/// The LISTs of a pass's requests, by prefix under the dataset `dir`, and whether any
/// request wrote (a PUT, a DELETE or a COPY).
fn lists_and_writes(log: &[(&'static str, String)], dir: &Path) -> (BTreeMap<String, u32>, bool) {
    let key = key_of(dir);
    let mut lists = BTreeMap::new();
    for (op, p) in log.iter().filter(|(op, _)| *op == "list") {
        let under = p.strip_prefix(&key).unwrap_or(p).to_string();
        *lists.entry(format!("{op} {under}")).or_insert(0) += 1;
    }
    let wrote = log
        .iter()
        .any(|(op, _)| ["put", "delete", "copy"].contains(op));
    (lists, wrote)
}

#[test]
fn a_follow_loader_on_a_store_waits_listing_once_a_poll_writes_nothing_and_names_the_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let store = store(tmp.path());
    let mut a = PartWriter::create(ROOT, metadata(N), rank(0, 2)).unwrap();
    let dir = a.path().to_path_buf();
    write_shard(&mut a, 0);
    write_shard(&mut a, 1);
    store.wait_durable(&dir, &[&shard(0), &shard(1)]);
    let poll = Duration::from_millis(50);
    let mut o = options(true, Order::Block);
    o.follow = Some(FollowOptions {
        timeout: Duration::from_millis(600),
        poll,
        interrupted: None,
        broadcast: None,
    });
    // Rank 0 is alive (claiming shards 0..10); rank 1 never started.
    let loader = Loader::new(&dir, o.clone()).unwrap();
    let out: Vec<_> = loader.iter().unwrap().collect();
    assert_eq!(out.len(), 4); // shards 0 and 1: 12 rows, 3 batches; then the error
    let e = out.into_iter().last().unwrap().unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            Error::Incomplete {
                present: 4,
                total: 40,
                ..
            }
        ),
        "{e:?}"
    );
    // A store's claim names its holder's rank, host and pid, and its lease.
    let pid = format!(" pid {}, lock renewed", std::process::id());
    assert!(
        msg.contains("follow mode waited 0.6 s")
            && msg.contains("shards 2..10 (claimed by rank 0 of 2, ")
            && msg.contains(&pid)
            && msg.contains("shards 10..20 (claimed by no live writer)")
            && msg.contains("shardkit saev status")
            && msg.contains(&dir.display().to_string()),
        "{msg}"
    );
    // Rank 0 gone (its claim with it): the loader waits, listing the records once a poll, and
    // writes nothing to the store (no claim, no lock, no cleanup).
    drop(a);
    let mark = store.mark();
    let t0 = Instant::now();
    let loader = Loader::new(&dir, o).unwrap();
    let e = loader
        .iter()
        .unwrap()
        .last()
        .unwrap()
        .unwrap_err()
        .to_string();
    let polls = (t0.elapsed().as_millis() / poll.as_millis()) as u32 + 1;
    assert!(
        e.contains("shards 2..20 (claimed by no live writer)"),
        "{e}"
    );
    let (lists, wrote) = lists_and_writes(&store.since(mark), &dir);
    assert!(!wrote, "{:?}", store.since(mark));
    // The open lists the prefix once; each look lists the records (the first round's, then
    // the wait's polls: two a poll would be about twice `polls`); the error lists the claims.
    let records = lists
        .get("list /.shardkit-parts/done")
        .copied()
        .unwrap_or(0);
    assert!(
        records >= 5 && records <= polls + 2,
        "{records} LISTs of the records in {polls} polls: {lists:?}"
    );
    let others: u32 = lists.values().sum::<u32>() - records;
    assert!(others <= 2, "{lists:?}");
}

// ---- EAGLE-3: the cache of tests/eagle3_follow.rs ----

mod eagle3 {
    use super::*;
    use common::eagle3::{
        assert_epoch_1_as_committed, assert_every_sample_once_in_rounds, assert_resumed_alike,
        drain, follow_opts, write_meanwhile, write_shards, writer, FOLLOW_N,
    };
    use shardkit::eagle3::{Cache, Loader, PartWriter};

    const N: u64 = FOLLOW_N;

    #[test]
    fn a_follow_loader_on_a_store_serves_every_sample_once_while_ranks_write_then_as_committed() {
        let tmp = tempfile::tempdir().unwrap();
        let store = store(tmp.path());
        let dir = PathBuf::from(format!("{ROOT}/cache"));
        let ws: Vec<PartWriter> = (0..3).map(|r| writer(&dir, r, 3)).collect();
        let m = ws[0].manifest().clone();
        // Unfinished: the cache's reader names what is missing (not "no manifest").
        let e = Cache::open(&dir).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                shardkit::Error::Incomplete {
                    present: 0,
                    total: N,
                    ..
                }
            ) && msg.contains("being written in parts")
                && msg.contains("missing: shard-000000.safetensors to shard-000011.safetensors"),
            "{msg}"
        );
        let mut loader = Loader::open(&dir, follow_opts(20_000)).unwrap();
        let threads = write_meanwhile(ws);
        assert_every_sample_once_in_rounds(&loader, &m);
        for t in threads {
            t.join().unwrap();
        }
        // A shard durable after the loader opened had its size asked for once.
        let mut heads: BTreeMap<String, u32> = BTreeMap::new();
        for (_, p) in store.since(0).iter().filter(|(op, _)| *op == "head") {
            *heads.entry(p.clone()).or_insert(0) += 1;
        }
        assert!(
            !heads.is_empty() && heads.values().all(|&n| n == 1),
            "{heads:?}"
        );
        // Committed now: epoch 1 is the committed loader's.
        assert_epoch_1_as_committed(&mut loader, &dir, &m);
    }

    #[test]
    fn a_state_saved_on_a_store_resumes_exactly_and_the_timeout_names_the_missing_shards() {
        let tmp = tempfile::tempdir().unwrap();
        let store = store(tmp.path());
        let dir = PathBuf::from(format!("{ROOT}/cache"));
        let w0 = writer(&dir, 0, 2);
        let w1 = writer(&dir, 1, 2); // claims shards 6..12, writes later
        let m = w0.manifest().clone();
        write_shards(w0, Duration::ZERO); // its finish waits for its uploads
        let mut a = Loader::open(&dir, follow_opts(300)).unwrap();
        let mut it = a.iter();
        let first = it.next().unwrap().unwrap();
        let saved = {
            let mut s = a.state();
            s.batch = it.cursor();
            s
        };
        let mark = store.mark();
        let (rest_a, err) = drain(&mut it, &m);
        let err = err.expect("the wait times out");
        let pid = format!(" pid {}, lock renewed", std::process::id());
        assert!(
            err.contains("missing: shards 6..12 (claimed by rank 1 of 2, ")
                && err.contains(&pid)
                && err.contains("follow mode waited")
                && err.contains("shardkit eagle3 status"),
            "{err}"
        );
        let wrote = store
            .since(mark)
            .iter()
            .any(|(op, p)| ["put", "delete", "copy"].contains(op) && !p.contains("/claims/"));
        assert!(!wrote, "{:?}", store.since(mark));
        let at = it.cursor();
        drop(it);
        a.advance_to(at);
        // Another loader from the saved state serves the rest of the round, then waits likewise.
        assert_resumed_alike(&dir, &mut a, saved, &first.indices, rest_a, w1, &m);
    }
}
