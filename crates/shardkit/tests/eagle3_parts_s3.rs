//! One EAGLE-3 cache written by several writers to an object store (an in-memory one put in
//! place of the bucket; threads as ranks): every committed object byte-identical to the file
//! one writer writes locally, resumable after a kill with another world size, committed by
//! `commit_parts` after a killed commit, and refusing another configuration (before any
//! object is written), an overlapping live rank and a whole-cache writer. Each test is its own
//! process under nextest, so the environment variables each sets are its own.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use shardkit::eagle3::{
    self, synthetic_sample, Cache, Manifest, PartOptions, PartWriter, Writer, WriterOptions,
};
use shardkit::json::Value;
use shardkit::{Error, Rank};

const URL: &str = "s3://bucket/c";
const N: u64 = 11;

/// 11 samples in shards of 2 (6 shards, the last one short), seq 4, hidden 2 (aux 6).
fn config() -> Value {
    shardkit::json::parse(
        br#"{"target_model": "demo", "target_vocab_size": 8, "draft_vocab_size": 8,
        "seq_length": 4, "dtype": "bf16", "num_samples": 11, "shard_size": 2,
        "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3],
        "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7], "input_data": "demo", "split": null,
        "shuffle_seed": 1}"#,
    )
    .unwrap()
}

fn rank(r: u64, w: u64) -> Rank {
    Rank::new(r, w).unwrap()
}

fn batch(m: &Manifest, first: u64, end: u64) -> Vec<(&'static str, Vec<u8>)> {
    let mut out: Vec<(&'static str, Vec<u8>)> = Vec::new();
    for i in first..end {
        for (f, (name, bytes)) in synthetic_sample(m, i).into_iter().enumerate() {
            match out.get_mut(f) {
                Some((_, b)) => b.extend(bytes),
                None => out.push((name, bytes)),
            }
        }
    }
    out
}

fn refs<'a>(b: &'a [(&'static str, Vec<u8>)]) -> Vec<(&'static str, &'a [u8])> {
    b.iter().map(|(n, v)| (*n, v.as_slice())).collect()
}

fn table(seed: u8) -> Vec<u8> {
    (0..16u8)
        .flat_map(|i| f32::from(i.wrapping_mul(seed)).to_le_bytes())
        .collect()
}

fn store(staging: &Path) -> Arc<InMemory> {
    std::env::set_var("SHARDKIT_STAGING_DIR", staging);
    let mem = Arc::new(InMemory::new());
    shardkit::internals::stores::use_store("bucket", mem.clone());
    mem
}

/// Every object under `c/` with its bytes, names relative to it.
fn objects(mem: &InMemory) -> BTreeMap<String, Vec<u8>> {
    futures::executor::block_on(async {
        let metas: Vec<_> = mem
            .list(Some(&ObjectPath::from("c")))
            .try_collect()
            .await
            .unwrap();
        let mut out = BTreeMap::new();
        for m in metas {
            let bytes = mem.get(&m.location).await.unwrap().bytes().await.unwrap();
            out.insert(m.location.as_ref()[2..].to_string(), bytes.to_vec());
        }
        out
    })
}

fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        out.insert(name, std::fs::read(&p).unwrap());
    }
    out
}

fn single_local(dir: &Path, version: u8, embeddings: bool) -> BTreeMap<String, Vec<u8>> {
    let opts = WriterOptions {
        version,
        resume: false,
    };
    let mut w = Writer::create(dir, &config(), opts).unwrap();
    if embeddings {
        w.write_target_embeddings(&table(3), 8, 2).unwrap();
    }
    let b = batch(w.manifest(), 0, N);
    w.add(N, &refs(&b)).unwrap();
    tree(&w.finish().unwrap())
}

fn options(version: u8, embeddings: bool) -> PartOptions {
    PartOptions {
        version,
        target_embeddings: embeddings,
    }
}

fn write_all(mut w: PartWriter) -> shardkit::PartsStatus {
    for r in w.pending().to_vec() {
        let mut at = r.start;
        while at < r.end {
            let end = (at + 3).min(r.end);
            let b = batch(w.manifest(), at, end);
            w.add(end - at, &refs(&b)).unwrap();
            at = end;
        }
    }
    w.finish().unwrap()
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
