//! One EAGLE-3 cache written by several writers (`eagle3::PartWriter`): byte-identical to one
//! writer's (shards, manifest.json, target_embeddings.safetensors, checksum sidecar),
//! resumable after a kill with the same or another world size, unreadable until committed, and
//! refusing what would mix two caches or two writers of one part. (Multi-process runs, with
//! SIGKILL, are in the Python tests: crates/shardkit-py/tests/test_eagle3_parts.py.)
#![allow(clippy::single_range_in_vec_init)] // one pending range is what most parts have

mod common;

use common::eagle3::{batch, options, refs, single, table, write_all, PARTS_N};
use common::{rank, tree};

use shardkit::eagle3::{self, Cache, PartWriter, Writer, WriterOptions};
use shardkit::json::Value;
use shardkit::Error;

const N: u64 = PARTS_N;

/// The configuration, `num_samples` declared or not.
fn config(with_num_samples: bool) -> Value {
    common::eagle3::config(with_num_samples.then_some(N))
}

#[test]
fn one_to_four_writers_commit_the_cache_one_writer_writes_byte_for_byte() {
    for (version, embeddings) in [(1u8, true), (2, false)] {
        let tmp = tempfile::tempdir().unwrap();
        let want = tree(&single(&tmp.path().join("one"), version, embeddings));
        let mut expected: Vec<String> = (0..6)
            .map(|k| format!("shard-{k:06}.safetensors"))
            .collect();
        expected.extend(["manifest.json".into(), "shardkit.checksums.json".into()]);
        if embeddings {
            expected.push("target_embeddings.safetensors".into());
        }
        expected.sort();
        assert_eq!(want.keys().cloned().collect::<Vec<_>>(), expected);
        for world in [1u64, 2, 3, 4] {
            let dir = tmp.path().join(format!("w{world}-v{version}"));
            // Every rank opens before any writes, as launched ranks do; num_samples comes
            // from total_samples when the configuration lacks it.
            let writers: Vec<PartWriter> = (0..world)
                .map(|r| {
                    let c = config(r % 2 == 0);
                    PartWriter::create(&dir, &c, options(version, embeddings), N, rank(r, world))
                        .unwrap()
                })
                .collect();
            // The table once, by rank 0 before its samples (as NeMo's producer does); another
            // rank giving the same table writes nothing.
            if embeddings {
                writers[0].write_target_embeddings(&table(3), 8, 2).unwrap();
                writers[world as usize - 1]
                    .write_target_embeddings(&table(3), 8, 2)
                    .unwrap();
            }
            // Ranks finish out of order; the last to finish commits, and nothing is readable
            // before.
            let mut statuses = Vec::new();
            for w in writers.into_iter().rev() {
                if !statuses.is_empty() {
                    assert!(matches!(Cache::open(&dir), Err(Error::Incomplete { .. })));
                }
                statuses.push(write_all(w));
            }
            assert!(statuses[..statuses.len() - 1].iter().all(|s| !s.committed));
            let last = statuses.last().unwrap();
            assert!(last.committed && last.missing().is_empty(), "{last:?}");
            assert_eq!(tree(&dir), want, "world {world}, version {version}");
            assert_eq!(Cache::open(&dir).unwrap().manifest().num_samples, N);
            assert!(eagle3::validate(&dir, true).is_valid());
            // A rank started after the commit writes nothing.
            let mut late = PartWriter::create(
                &dir,
                &config(true),
                options(version, embeddings),
                N,
                rank(0, 2),
            )
            .unwrap();
            assert!(late.pending().is_empty() && late.next_sample().is_none());
            let b = batch(late.manifest(), 0, 1);
            let e = late.add(1, &refs(&b)).unwrap_err();
            assert!(e.to_string().contains("already committed"), "{e}");
            assert!(late.finish().unwrap().committed);
            assert_eq!(tree(&dir), want);
        }
    }
}

#[test]
fn a_rank_killed_mid_part_is_resumed_by_a_restart_with_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let want = tree(&single(&tmp.path().join("one"), 1, true));
    let dir = tmp.path().join("parts");
    let open = |r, w| PartWriter::create(&dir, &config(true), options(1, true), N, rank(r, w));
    // World 3: shards 0..2, 2..4, 4..6. Rank 0 finishes (with the table); rank 1 dies after
    // one shard and a half; rank 2 never starts.
    let w0 = open(0, 3).unwrap();
    w0.write_target_embeddings(&table(3), 8, 2).unwrap();
    assert!(!write_all(w0).committed);
    let mut w = open(1, 3).unwrap();
    assert_eq!((w.samples(), w.pending()), (4..8, &[4..8][..]));
    let b = batch(w.manifest(), 4, 7);
    w.add(3, &refs(&b)).unwrap();
    assert_eq!(w.next_sample(), Some(7));
    drop(w); // a kill: the claim and the lock go with the process; the half shard is lost
    let st = eagle3::status(&dir).unwrap();
    assert!(!st.committed);
    assert_eq!((st.done.clone(), st.missing()), (vec![0, 1, 2], vec![3..6]));
    assert!(
        st.claimed.is_empty() && st.missing_files.is_empty(),
        "{st:?}"
    );
    assert_eq!(st.resume_plan(2), [vec![], vec![3..6]]);
    // Unreadable meanwhile: the error names the shards missing.
    let e = Cache::open(&dir).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            Error::Incomplete {
                present: 6,
                total: 11,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        msg.contains("shard-000003.safetensors to shard-000005.safetensors"),
        "{msg}"
    );
    let e = eagle3::inspect(&dir).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    let v = eagle3::validate(&dir, false);
    assert!(
        v.errors().any(|e| e.message.contains("written in parts")),
        "{:?}",
        v.errors().collect::<Vec<_>>()
    );
    // Restarted with world 2: rank 0 (shards 0..3) has nothing left, rank 1 writes 3..6.
    let w0 = open(0, 2).unwrap();
    assert!(w0.pending().is_empty() && w0.next_sample().is_none());
    let w1 = open(1, 2).unwrap();
    assert_eq!(w1.pending(), [6..11]);
    assert!(!w0.finish().unwrap().committed);
    assert!(write_all(w1).committed);
    assert_eq!(tree(&dir), want);
}

#[test]
fn the_commit_waits_for_declared_embeddings_and_commit_parts_finishes_a_killed_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let want = tree(&single(&tmp.path().join("one"), 1, true));
    let dir = tmp.path().join("parts");
    // Every shard written by one rank of 1; the table not yet: not committed.
    let w = PartWriter::create(&dir, &config(true), options(1, true), N, rank(0, 2)).unwrap();
    let st = write_all(w);
    assert!(!st.committed);
    let w = PartWriter::create(&dir, &config(true), options(1, true), N, rank(1, 2)).unwrap();
    let st = write_all(w);
    assert!(!st.committed && st.missing().is_empty(), "{st:?}");
    assert_eq!(st.missing_files, ["target_embeddings.safetensors"]);
    let e = Cache::open(&dir).unwrap_err();
    assert!(
        e.to_string()
            .contains("missing: target_embeddings.safetensors"),
        "{e}"
    );
    // Any rank of a restart writes the table; its finish commits.
    let w = PartWriter::create(&dir, &config(true), options(1, true), N, rank(3, 4)).unwrap();
    let e = w.write_target_embeddings(&table(3), 8, 3).unwrap_err();
    assert!(
        e.to_string()
            .contains("64 bytes given; 8 x 3 float32 need 96"),
        "{e}"
    );
    w.write_target_embeddings(&table(3), 8, 2).unwrap();
    // Killed before its finish: every part durable, committed by commit_parts.
    drop(w);
    assert!(!eagle3::status(&dir).unwrap().committed);
    assert!(eagle3::commit_parts(&dir).unwrap().committed);
    assert_eq!(tree(&dir), want);
    assert!(eagle3::status(&dir).unwrap().committed);
    assert!(eagle3::commit_parts(&dir).unwrap().committed);
    // A late rank with another table is refused; with the same one, nothing happens.
    let late = PartWriter::create(&dir, &config(true), options(1, true), N, rank(0, 1)).unwrap();
    late.write_target_embeddings(&table(3), 8, 2).unwrap();
    let e = late.write_target_embeddings(&table(5), 8, 2).unwrap_err();
    assert!(e.to_string().contains("another table"), "{e}");
    assert_eq!(tree(&dir), want);
}

#[test]
fn another_configuration_an_overlapping_rank_and_a_whole_cache_writer_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let a = PartWriter::create(&dir, &config(true), options(1, true), N, rank(0, 2)).unwrap();
    // Another configuration: refused naming the keys, before anything is written.
    let before = tree(&dir);
    let mut other = config(true);
    other.set("dtype", Value::String("fp16".into()));
    let e = PartWriter::create(&dir, &other, options(1, true), N, rank(1, 2)).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e:?}");
    assert!(
        e.to_string().contains("manifest key(s) dtype differ"),
        "{e}"
    );
    let e = PartWriter::create(&dir, &config(true), options(2, true), N, rank(1, 2)).unwrap_err();
    assert!(
        e.to_string()
            .contains("format_version, target_probs_topk differ"),
        "{e}"
    );
    let e = PartWriter::create(&dir, &config(true), options(1, false), N, rank(1, 2)).unwrap_err();
    assert!(
        e.to_string()
            .contains("target_embeddings true, this one with false"),
        "{e}"
    );
    let e = PartWriter::create(&dir, &config(true), options(1, true), 12, rank(1, 2)).unwrap_err();
    assert!(
        e.to_string()
            .contains("\"num_samples\" (11) differs from total_samples 12"),
        "{e}"
    );
    assert_eq!(tree(&dir), before);
    // The same part twice (a rank started twice, or two world sizes at once): refused naming
    // the holder.
    let e = PartWriter::create(&dir, &config(true), options(1, true), N, rank(0, 3)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 of 2") && msg.contains("claimed"),
        "{msg}"
    );
    // A whole-cache writer cannot start while parts are being written, nor parts while it
    // writes; and it refuses a directory being written in parts.
    let resume = WriterOptions {
        version: 1,
        resume: true,
    };
    let e = Writer::create(&dir, &config(true), resume.clone()).unwrap_err();
    assert!(matches!(e, Error::Locked { .. }), "{e:?}");
    drop(a);
    let e = Writer::create(&dir, &config(true), resume.clone()).unwrap_err();
    assert!(e.to_string().contains("is being written in parts"), "{e}");
    let whole_dir = tmp.path().join("whole");
    let whole = Writer::create(&whole_dir, &config(true), resume).unwrap();
    let e = PartWriter::create(&whole_dir, &config(true), options(1, false), N, rank(0, 1))
        .unwrap_err();
    assert!(matches!(e, Error::Locked { .. }), "{e:?}");
    drop(whole);
    // The single writer's unfinished cache (manifest first, shards missing) is not a parts
    // cache.
    let e = PartWriter::create(&whole_dir, &config(true), options(1, false), N, rank(0, 1))
        .unwrap_err();
    assert!(
        e.to_string().contains("did not finish (0 of 6 shards)"),
        "{e}"
    );
    // Undeclared embeddings, writing past the part, and finishing early are refused.
    let w0 = PartWriter::create(&dir, &config(true), options(1, true), N, rank(0, 2)).unwrap();
    let plain = tmp.path().join("plain");
    let p = PartWriter::create(&plain, &config(true), options(1, false), N, rank(0, 1)).unwrap();
    let e = p.write_target_embeddings(&table(3), 8, 2).unwrap_err();
    assert!(
        e.to_string().contains("started without target_embeddings"),
        "{e}"
    );
    let mut w = PartWriter::create(&dir, &config(true), options(1, true), N, rank(1, 2)).unwrap();
    assert_eq!(w.samples(), 6..11);
    let b = batch(w.manifest(), 0, 6);
    let e = w.add(6, &refs(&b)).unwrap_err();
    assert!(
        e.to_string()
            .contains("pass the end of rank 1 of 2's part (5 left"),
        "{e}"
    );
    let b = batch(w.manifest(), 6, 9);
    w.add(3, &refs(&b)).unwrap();
    let e = w.finish().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Incomplete {
                present: 2,
                total: 5,
                ..
            }
        ),
        "{e:?}"
    );
    drop(w0);
}
