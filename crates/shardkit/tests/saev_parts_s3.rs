//! One saev dataset written by several writers to an object store (an in-memory one put in
//! place of the bucket; threads as ranks): every committed object byte-identical to the
//! file one writer writes locally, resumable after a kill with another world size, and
//! refusing what would mix two datasets or two writers of one part. The ranks coordinate
//! through the store alone. (Processes against a real S3 server, with SIGKILL, are in
//! crates/shardkit-py/tests/test_parts_s3.py.) Each test is its own process under nextest,
//! so the environment variables each sets are its own.
#![allow(clippy::single_range_in_vec_init)] // one pending range is what most parts have

mod common;

use common::saev::{acts, labels, metadata, single, write_all};
use common::stores::{self, store, Hook, Hooked};
use common::{rank, tree};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use shardkit::saev::{self, Dataset, PartWriter, Writer, WriterOptions};
use shardkit::Error;

const ROOT: &str = "s3://bucket/data";

/// Every object of the dataset `data/<dir>` with its bytes, names relative to it.
fn objects(mem: &InMemory, dir: &str) -> BTreeMap<String, Vec<u8>> {
    common::stores::objects(mem, &format!("data/{dir}"))
}

/// Every file one writer writes locally, as [`objects`].
fn single_local(root: &Path, n: u64, with_labels: bool) -> BTreeMap<String, Vec<u8>> {
    tree(&single(root, n, with_labels))
}

fn url(dir: &str) -> PathBuf {
    PathBuf::from(format!("{ROOT}/{dir}"))
}

#[test]
fn one_to_four_ranks_in_a_store_commit_the_objects_one_local_writer_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = metadata(11).dir_name();
    for with_labels in [true, false] {
        let want = single_local(
            &tmp.path().join(format!("one-{with_labels}")),
            11,
            with_labels,
        );
        for world in [1u64, 2, 3, 4] {
            let mem = store(&tmp.path().join(format!("staging-{world}-{with_labels}")));
            let writers: Vec<PartWriter> = (0..world)
                .map(|r| PartWriter::create(ROOT, metadata(11), rank(r, world)).unwrap())
                .collect();
            // The ranks write and finish at once; whichever completes the set commits.
            let statuses: Vec<shardkit::PartsStatus> = std::thread::scope(|s| {
                let ts: Vec<_> = writers
                    .into_iter()
                    .map(|w| s.spawn(move || write_all(w, with_labels)))
                    .collect();
                ts.into_iter().map(|t| t.join().unwrap()).collect()
            });
            assert!(statuses.iter().any(|s| s.committed), "{statuses:?}");
            assert_eq!(
                objects(&mem, &dir),
                want,
                "world {world}, labels {with_labels}"
            );
            Dataset::open(url(&dir)).unwrap();
            assert!(saev::status(url(&dir)).unwrap().committed);
        }
    }
}

#[test]
fn a_rank_killed_mid_part_in_a_store_is_resumed_with_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let want = single_local(&tmp.path().join("one"), 11, true);
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    // World 3: shards 0..2, 2..4, 4..6. Rank 0 finishes; rank 1 dies after one shard and a
    // half; rank 2 never starts.
    assert!(
        !write_all(
            PartWriter::create(ROOT, metadata(11), rank(0, 3)).unwrap(),
            true
        )
        .committed
    );
    let mut w = PartWriter::create(ROOT, metadata(11), rank(1, 3)).unwrap();
    assert_eq!(w.path(), url(&dir));
    assert_eq!(w.pending(), [4..8]);
    w.write(&acts(4..7), Some(&labels(4..7))).unwrap();
    drop(w); // a kill: its claim goes (its process's), the half shard was never uploaded
    let st = saev::status(url(&dir)).unwrap();
    assert!(!st.committed);
    assert_eq!(st.done, [0, 1, 2]);
    assert!(st.claimed.is_empty(), "{:?}", st.claimed);
    assert_eq!(st.resume_plan(2), [vec![], vec![3..6]]);
    assert!(Dataset::open(url(&dir)).is_err());
    // validate names what is missing, as for a directory.
    let report = saev::validate(url(&dir));
    assert!(
        report.errors().any(|f| f.message.contains(
            "written in parts and not committed: 3 of 6 shards durable; missing shards 3..6"
        )),
        "{:?}",
        report.findings
    );
    let w0 = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap();
    assert!(w0.pending().is_empty());
    let w1 = PartWriter::create(ROOT, metadata(11), rank(1, 2)).unwrap();
    assert_eq!(w1.pending(), [6..11]);
    assert!(!w0.finish().unwrap().committed);
    assert!(write_all(w1, true).committed);
    assert_eq!(objects(&mem, &dir), want);
    // A rank started after the commit writes nothing.
    let w = PartWriter::create(ROOT, metadata(11), rank(1, 2)).unwrap();
    assert!(w.pending().is_empty());
    assert!(w.finish().unwrap().committed);
    assert_eq!(objects(&mem, &dir), want);
}

#[test]
fn every_shard_durable_in_a_store_is_committed_by_commit_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let want = single_local(&tmp.path().join("one"), 11, false);
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    write_all(
        PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap(),
        false,
    );
    let mut w = PartWriter::create(ROOT, metadata(11), rank(1, 2)).unwrap();
    w.write(&acts(6..11), None).unwrap();
    drop(w); // killed before its commit
    let st = saev::status(url(&dir)).unwrap();
    assert!(!st.committed && st.missing().is_empty(), "{st:?}");
    assert!(saev::commit_parts(url(&dir)).unwrap().committed);
    assert_eq!(objects(&mem, &dir), want);
    assert!(saev::commit_parts(url(&dir)).unwrap().committed);
}

#[test]
fn in_a_store_an_overlapping_live_rank_another_dataset_and_a_whole_writer_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    let a = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap();
    let e = PartWriter::create(ROOT, metadata(11), rank(0, 3)).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 of 2")
            && msg.contains(&format!("pid {}", std::process::id()))
            && msg.contains("units 0..3")
            && msg.contains("claims/000000000-000000003"),
        "{msg}"
    );
    // A whole-dataset writer does not start beside the parts, naming the claim.
    let e = Writer::create(ROOT, metadata(11), WriterOptions::resuming()).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(e.to_string().contains("write in parts is under way"), "{e}");
    assert!(e.to_string().contains("rank 0 of 2"), "{e}");
    drop(a);
    // Nor does it once a unit is durable and no rank runs.
    let mut b = PartWriter::create(ROOT, metadata(11), rank(1, 2)).unwrap();
    b.write(&acts(6..8), None).unwrap();
    drop(b);
    let e = Writer::create(ROOT, metadata(11), WriterOptions::resuming()).unwrap_err();
    assert!(e.to_string().contains("1 unit(s) durable"), "{e}");
    // A part writer does not start while a whole-dataset writer holds the lock.
    let other = metadata(12);
    let whole = Writer::create(ROOT, other.clone(), WriterOptions::default()).unwrap();
    let e = PartWriter::create(ROOT, other.clone(), rank(0, 2)).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(e.to_string().contains("whole-dataset writer"), "{e}");
    drop(whole);
    // metadata.json of other bytes under this dataset's prefix: refused naming the key,
    // before any object is written.
    let key = ObjectPath::from(format!("data/{dir}/metadata.json"));
    let md = String::from_utf8(objects(&mem, &dir)["metadata.json"].clone()).unwrap();
    futures::executor::block_on(
        mem.put(
            &key,
            PutPayload::from(
                md.replace("\"ckpt\": \"x\"", "\"ckpt\": \"y\"")
                    .into_bytes(),
            ),
        ),
    )
    .unwrap();
    let before = objects(&mem, &dir);
    let e = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e:?}");
    assert!(
        e.to_string().contains("\"ckpt\"") && e.to_string().contains("metadata.json"),
        "{e}"
    );
    assert_eq!(objects(&mem, &dir), before);
}

#[test]
fn the_commit_lock_in_a_store_is_one_ranks_and_a_dead_holders_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let want = single_local(&tmp.path().join("one"), 11, true);
    std::env::set_var("SHARDKIT_S3_LOCK_LEASE_S", "2");
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    let w0 = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap();
    let w1 = PartWriter::create(ROOT, metadata(11), rank(1, 2)).unwrap();
    assert!(!write_all(w0, true).committed);
    // Another machine's committer holds the commit lock (renewed just now).
    let key = format!("data/{dir}/.shardkit-parts/commit.lock");
    stores::plant_held_lock(&mem, &key, 2);
    // The last rank waits for the holder, whose lease runs out (it stopped renewing): then
    // it commits.
    let started = std::time::Instant::now();
    assert!(write_all(w1, true).committed);
    assert!(started.elapsed() >= std::time::Duration::from_secs(1));
    assert_eq!(objects(&mem, &dir), want);
}

#[test]
fn parts_in_a_store_are_refused_when_conditional_writes_are_turned_off() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    std::env::set_var("SHARDKIT_S3_LOCK", "0");
    let e = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    assert!(
        e.to_string().contains("SHARDKIT_S3_LOCK=0 turns off"),
        "{e}"
    );
    assert!(objects(&mem, &metadata(11).dir_name()).is_empty());
}

#[test]
fn another_machines_claim_in_a_store_is_refused_while_its_lease_runs_and_taken_over_after() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // A claim on shards 0..3 by rank 0 of 2 on another machine, renewed `ago` seconds ago.
    let plant = |ago: u64| {
        let body = format!(
            "{{\"shardkit_lock\": 1, \"host\": \"node9\", \"boot_id\": \"b\", \"pid\": 7, \
             \"token\": \"t\", \"renewed_unix\": {}, \"lease_s\": 120, \
             \"who\": \"rank 0 of 2\"}}",
            now - ago
        );
        let key = ObjectPath::from(format!(
            "data/{dir}/.shardkit-parts/claims/000000000-000000003"
        ));
        futures::executor::block_on(mem.put(&key, PutPayload::from(body.into_bytes()))).unwrap();
    };
    plant(5);
    let e = PartWriter::create(ROOT, metadata(11), rank(0, 3)).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("(rank 0 of 2, node9 pid 7, lock renewed"),
        "{e}"
    );
    let st = saev::status(url(&dir)).unwrap();
    assert_eq!(st.claimed.len(), 1, "{st:?}");
    assert_eq!(st.claimed[0].0, 0..3);
    // Its lease ran out: taken over.
    plant(500);
    assert!(saev::status(url(&dir)).unwrap().claimed.is_empty());
    let w = PartWriter::create(ROOT, metadata(11), rank(0, 3)).unwrap();
    assert_eq!(w.pending(), [0..4]);
}

#[test]
fn a_rank_whose_claim_was_taken_over_uploads_and_records_nothing_more() {
    let tmp = tempfile::tempdir().unwrap();
    std::env::set_var("SHARDKIT_S3_LOCK_LEASE_S", "2");
    let mem = store(&tmp.path().join("staging"));
    let dir = metadata(11).dir_name();
    let mut w = PartWriter::create(ROOT, metadata(11), rank(0, 2)).unwrap();
    // Another rank took the claim over (as after this one stalled past its lease); this one's
    // next renewal (every quarter lease) finds it so.
    let body = "{\"shardkit_lock\": 1, \"host\": \"node9\", \"boot_id\": \"b\", \"pid\": 7, \
                \"token\": \"t\", \"renewed_unix\": 0, \"lease_s\": 2, \"who\": \"rank 0 of 2\"}";
    let key = ObjectPath::from(format!(
        "data/{dir}/.shardkit-parts/claims/000000000-000000003"
    ));
    futures::executor::block_on(mem.put(&key, PutPayload::from(body.as_bytes().to_vec()))).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let e = w.write(&acts(0..2), None).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(e.to_string().contains("taken over"), "{e}");
    let names: Vec<String> = objects(&mem, &dir).into_keys().collect();
    assert!(!names.iter().any(|n| n.starts_with("acts")), "{names:?}");
    assert!(saev::status(url(&dir)).unwrap().done.is_empty());
}

/// Refuses every write of an object whose name contains its text, as a store answering 500
/// to it would.
#[derive(Debug)]
struct RefusePuts(&'static str);

impl Hook for RefusePuts {
    fn before(&self, op: &'static str, path: Option<&ObjectPath>) -> object_store::Result<()> {
        if op == "put" && path.is_some_and(|p| p.as_ref().contains(self.0)) {
            return Err(object_store::Error::Generic {
                store: "RefusingPuts",
                source: "Server returned non-2xx status code: 500 Internal Server Error".into(),
            });
        }
        Ok(())
    }
}

#[test]
fn a_shard_whose_upload_fails_behind_the_writer_is_its_error_and_is_never_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    stores::install(tmp.path(), Hooked::new(RefusePuts("acts000002.bin")));
    let dir = metadata(11).dir_name();
    let mut w = PartWriter::create(ROOT, metadata(11), rank(0, 1)).unwrap();
    // Shards go up behind the writer: the failure is the error of a later write or of finish.
    let mut failed = None;
    for at in (0..11u64).step_by(3) {
        if let Err(e) = w.write(&acts(at..(at + 3).min(11)), None) {
            failed = Some(e);
            break;
        }
    }
    let e = match failed {
        Some(e) => e,
        None => w.finish().unwrap_err(),
    };
    assert!(
        matches!(&e, Error::Remote { object, .. } if object.contains("acts000002.bin")),
        "{e}"
    );
    // Shards 0 and 1 are durable; 2 was never recorded, so a restart writes it (and the rest).
    let st = saev::status(url(&dir)).unwrap();
    assert!(!st.committed, "{st:?}");
    assert_eq!(st.missing(), vec![2..6], "{st:?}");
}

#[test]
fn a_provenance_record_in_a_store_is_created_once_and_a_different_one_refused() {
    use shardkit::json::{parse, Value};
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    let dir = url("prov");
    let ours: Value = parse(br#"{"model": {"sha256": "aa"}, "inputs": {"sha256": "bb"}}"#).unwrap();
    assert!(shardkit::provenance::read(&dir).unwrap().is_none());
    shardkit::provenance::record(&dir, &ours).unwrap();
    shardkit::provenance::record(&dir, &ours).unwrap();
    let theirs: Value =
        parse(br#"{"model": {"sha256": "ab"}, "inputs": {"sha256": "bb"}}"#).unwrap();
    let e = shardkit::provenance::record(&dir, &theirs).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e:?}");
    assert!(
        e.to_string().contains("provenance model.sha256 differs"),
        "{e}"
    );
    assert_eq!(shardkit::provenance::read(&dir).unwrap().unwrap(), ours);
    assert_eq!(
        objects(&mem, "prov").keys().collect::<Vec<_>>(),
        ["shardkit.provenance.json"]
    );
}
