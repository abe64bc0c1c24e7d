//! One EAGLE-3 cache written by several writers to an object store (an in-memory one put in
//! place of the bucket; threads as ranks): every committed object byte-identical to the file
//! one writer writes locally, resumable after a kill with another world size, committed by
//! `commit_parts` after a killed commit, and refusing another configuration (before any
//! object is written), an overlapping live rank and a whole-cache writer. Each test is its own
//! process under nextest, so the environment variables each sets are its own.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use common::eagle3::{batch, options, refs, single, table, write_all, PARTS_N};
use common::stores::store;
use common::{rank, tree};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use object_store::memory::InMemory;
use shardkit::eagle3::{self, Cache, PartWriter, Writer, WriterOptions};
use shardkit::json::Value;
use shardkit::Error;

const URL: &str = "s3://bucket/c";
const N: u64 = PARTS_N;

/// The configuration, `num_samples` declared.
fn config() -> Value {
    common::eagle3::config(Some(N))
}

/// Every object of the cache with its bytes, names relative to it.
fn objects(mem: &InMemory) -> BTreeMap<String, Vec<u8>> {
    common::stores::objects(mem, "c")
}

/// Every file one writer writes locally, as [`objects`].
fn single_local(dir: &Path, version: u8, embeddings: bool) -> BTreeMap<String, Vec<u8>> {
    tree(&single(dir, version, embeddings))
}

fn open(r: u64, w: u64, version: u8, embeddings: bool) -> Result<PartWriter, Error> {
    PartWriter::create(URL, &config(), options(version, embeddings), N, rank(r, w))
}

#[test]
fn one_to_four_ranks_in_a_store_commit_the_objects_one_local_writer_writes() {
    let tmp = tempfile::tempdir().unwrap();
    for (version, embeddings) in [(1u8, true), (2, false)] {
        let want = single_local(
            &tmp.path().join(format!("one-{version}")),
            version,
            embeddings,
        );
        for world in [1u64, 2, 3, 4] {
            let mem = store(&tmp.path().join(format!("staging-{world}-{version}")));
            let writers: Vec<PartWriter> = (0..world)
                .map(|r| open(r, world, version, embeddings).unwrap())
                .collect();
            if embeddings {
                writers[0].write_target_embeddings(&table(3), 8, 2).unwrap();
                writers[world as usize - 1]
                    .write_target_embeddings(&table(3), 8, 2)
                    .unwrap();
            }
            let statuses: Vec<shardkit::PartsStatus> = std::thread::scope(|s| {
                let ts: Vec<_> = writers
                    .into_iter()
                    .map(|w| s.spawn(move || write_all(w)))
                    .collect();
                ts.into_iter().map(|t| t.join().unwrap()).collect()
            });
            assert!(statuses.iter().any(|s| s.committed), "{statuses:?}");
            assert_eq!(objects(&mem), want, "world {world}, version {version}");
            assert_eq!(Cache::open(URL).unwrap().manifest().num_samples, N);
            assert!(eagle3::status(URL).unwrap().committed);
            // A rank started after the commit writes nothing.
            let late = open(0, 2, version, embeddings).unwrap();
            assert!(late.pending().is_empty());
            assert!(late.finish().unwrap().committed);
            assert_eq!(objects(&mem), want);
        }
    }
}

#[test]
fn a_rank_killed_in_a_store_is_resumed_with_another_world_size_and_commit_parts_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let want = single_local(&tmp.path().join("one"), 1, true);
    let mem = store(&tmp.path().join("staging"));
    let w0 = open(0, 3, 1, true).unwrap();
    w0.write_target_embeddings(&table(3), 8, 2).unwrap();
    assert!(!write_all(w0).committed);
    let mut w = open(1, 3, 1, true).unwrap();
    let b = batch(w.manifest(), 4, 7);
    w.add(3, &refs(&b)).unwrap();
    drop(w); // a kill: its claim goes, the half shard was never uploaded
    let st = eagle3::status(URL).unwrap();
    assert!(!st.committed && st.claimed.is_empty(), "{st:?}");
    assert_eq!((st.done.clone(), st.missing()), (vec![0, 1, 2], vec![3..6]));
    let v = eagle3::validate(URL, false);
    assert!(
        v.errors().any(|e| e.message.contains("written in parts")
            && e.message
                .contains("shard-000003.safetensors to shard-000005.safetensors")),
        "{:?}",
        v.errors().collect::<Vec<_>>()
    );
    // Restarted with world 2; its last rank is killed before committing.
    let w0 = open(0, 2, 1, true).unwrap();
    assert!(w0.pending().is_empty());
    assert!(!w0.finish().unwrap().committed);
    let mut w1 = open(1, 2, 1, true).unwrap();
    assert_eq!(w1.pending(), [6..11]);
    let b = batch(w1.manifest(), 6, 11);
    w1.add(5, &refs(&b)).unwrap();
    drop(w1);
    let st = eagle3::status(URL).unwrap();
    assert!(!st.committed && st.missing().is_empty(), "{st:?}");
    // Unreadable until committed: manifest.json, the commit record, is not there yet.
    let e = Cache::open(URL).unwrap_err();
    assert!(e.to_string().contains("manifest.json"), "{e:?}");
    assert!(eagle3::commit_parts(URL).unwrap().committed);
    assert_eq!(objects(&mem), want);
    assert!(eagle3::commit_parts(URL).unwrap().committed);
}

#[test]
fn in_a_store_another_configuration_an_overlapping_rank_and_a_whole_writer_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    let a = open(0, 2, 1, true).unwrap();
    let before = objects(&mem);
    let mut other = config();
    other.set("dtype", Value::String("fp16".into()));
    let e = PartWriter::create(URL, &other, options(1, true), N, rank(1, 2)).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e:?}");
    assert!(
        e.to_string().contains("manifest key(s) dtype differ"),
        "{e}"
    );
    let e = open(1, 2, 1, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("target_embeddings true, this one with false"),
        "{e}"
    );
    assert_eq!(objects(&mem), before);
    let e = open(0, 3, 1, true).unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(e.to_string().contains("rank 0 of 2"), "{e}");
    let resume = WriterOptions {
        version: 1,
        resume: true,
    };
    let e = Writer::create(URL, &config(), resume.clone()).unwrap_err();
    assert!(e.to_string().contains("write in parts is under way"), "{e}");
    drop(a);
    // Another cache, written whole: a part writer does not start beside it.
    let whole = Writer::create(PathBuf::from("s3://bucket/w"), &config(), resume).unwrap();
    let e = PartWriter::create("s3://bucket/w", &config(), options(1, false), N, rank(0, 1))
        .unwrap_err();
    assert!(e.to_string().contains("whole-dataset writer"), "{e}");
    drop(whole);
}
