//! One saev dataset written by several writers (`saev::PartWriter`): byte-identical to one
//! writer's, resumable after a kill with the same or another world size, and refusing what
//! would mix two datasets or two writers of one part. (Multi-process runs, with SIGKILL, are
//! in the Python tests: crates/shardkit-py/tests/test_parts.py.)
#![allow(clippy::single_range_in_vec_init)] // one pending range is what most parts have

mod common;

use common::saev::{acts, labels, metadata, single, write_all};
use common::tree;

use shardkit::saev::{self, Dataset, PartWriter, Writer, WriterOptions};
use shardkit::{Error, Rank};

#[test]
fn two_three_and_four_writers_commit_the_dataset_one_writer_writes_byte_for_byte() {
    for with_labels in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let want = tree(&single(&tmp.path().join("one"), 11, with_labels));
        let names: Vec<&str> = want.keys().map(String::as_str).collect();
        let mut expected = vec!["acts000000.bin", "acts000001.bin", "acts000002.bin"];
        expected.extend(["acts000003.bin", "acts000004.bin", "acts000005.bin"]);
        expected.extend(with_labels.then_some("labels.bin"));
        expected.extend(["metadata.json", "shardkit.checksums.json", "shards.json"]);
        assert_eq!(names, expected);
        for world in [1u64, 2, 3, 4, 7] {
            let root = tmp.path().join(format!("w{world}-{with_labels}"));
            // Every rank opens before any writes, as launched ranks do.
            let writers: Vec<PartWriter> = (0..world)
                .map(|r| {
                    PartWriter::create(&root, metadata(11), Rank::new(r, world).unwrap()).unwrap()
                })
                .collect();
            let dir = writers[0].path().to_path_buf();
            let mut statuses = Vec::new();
            // Ranks finish out of order; the last to finish commits.
            for w in writers.into_iter().rev() {
                statuses.push(write_all(w, with_labels));
            }
            assert!(statuses[..statuses.len() - 1].iter().all(|s| !s.committed));
            let last = statuses.last().unwrap();
            assert!(last.committed && last.missing().is_empty(), "{last:?}");
            assert_eq!(tree(&dir), want, "world {world}, labels {with_labels}");
            Dataset::open(&dir).unwrap();
        }
    }
}

#[test]
fn a_rank_killed_mid_part_is_resumed_by_a_restart_with_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let want = tree(&single(&tmp.path().join("one"), 11, true));
    let root = tmp.path().join("parts");
    let rank = |r, w| Rank::new(r, w).unwrap();
    // World 3: shards 0..2, 2..4, 4..6. Rank 0 finishes; rank 1 dies after one shard and a
    // half; rank 2 never starts.
    write_all(
        PartWriter::create(&root, metadata(11), rank(0, 3)).unwrap(),
        true,
    );
    let mut w = PartWriter::create(&root, metadata(11), rank(1, 3)).unwrap();
    assert_eq!(w.pending(), [4..8]);
    w.write(&acts(4..7), Some(&labels(4..7))).unwrap();
    let dir = w.path().to_path_buf();
    drop(w); // a kill: the claim and the lock go with the process; the half shard stays
    let st = saev::status(&dir).unwrap();
    assert!(!st.committed);
    assert_eq!(st.done, [0, 1, 2]);
    // validate names what is missing.
    let report = saev::validate(&dir);
    assert!(
        report.errors().any(|f| f.message.contains(
            "written in parts and not committed: 3 of 6 shards durable; missing shards 3..6"
        )),
        "{:?}",
        report.findings
    );
    assert_eq!(st.missing(), [3..6]);
    assert!(st.claimed.is_empty(), "{:?}", st.claimed);
    assert_eq!(st.resume_plan(2), [vec![], vec![3..6]]);
    // Restarted with world 2: rank 0 (shards 0..3) has nothing left, rank 1 writes 3..6.
    let w0 = PartWriter::create(&root, metadata(11), rank(0, 2)).unwrap();
    assert!(w0.pending().is_empty() && w0.next_example().is_none());
    let w1 = PartWriter::create(&root, metadata(11), rank(1, 2)).unwrap();
    assert_eq!(w1.pending(), [6..11]);
    assert!(!w0.finish().unwrap().committed);
    assert!(write_all(w1, true).committed);
    assert_eq!(tree(&dir), want);
}

#[test]
fn every_shard_durable_but_not_committed_is_committed_by_commit_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let want = tree(&single(&tmp.path().join("one"), 11, false));
    let root = tmp.path().join("parts");
    write_all(
        PartWriter::create(&root, metadata(11), Rank::new(0, 2).unwrap()).unwrap(),
        false,
    );
    // The last rank writes everything and is killed before it commits.
    let mut w = PartWriter::create(&root, metadata(11), Rank::new(1, 2).unwrap()).unwrap();
    w.write(&acts(6..11), None).unwrap();
    let dir = w.path().to_path_buf();
    drop(w);
    let e = Dataset::open(&dir).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    let st = saev::status(&dir).unwrap();
    assert!(!st.committed && st.missing().is_empty(), "{st:?}");
    assert!(saev::commit_parts(&dir).unwrap().committed);
    assert_eq!(tree(&dir), want);
    // Committed: status says so, and a second commit is a no-op.
    assert!(saev::status(&dir).unwrap().committed);
    assert!(saev::commit_parts(&dir).unwrap().committed);
    assert_eq!(tree(&dir), want);
    // A rank started after the commit writes nothing and touches nothing, even where a
    // committer killed while cleaning up left parts state behind.
    std::fs::create_dir_all(dir.join(".shardkit-parts/done")).unwrap();
    let w = PartWriter::create(&root, metadata(11), Rank::new(1, 2).unwrap()).unwrap();
    assert!(w.pending().is_empty());
    assert!(w.finish().unwrap().committed);
    assert_eq!(tree(&dir), want);
}

#[test]
fn another_dataset_an_overlapping_rank_and_a_whole_dataset_writer_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let a = PartWriter::create(root, metadata(11), Rank::new(0, 2).unwrap()).unwrap();
    let dir = a.path().to_path_buf();
    // The same part twice (a rank started twice, or two world sizes at once): refused naming
    // the holder.
    let e = PartWriter::create(root, metadata(11), Rank::new(0, 3).unwrap()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 of 2") && msg.contains("claimed"),
        "{msg}"
    );
    // A whole-dataset writer cannot start while parts are being written, nor parts while it
    // writes.
    let e = Writer::create(root, metadata(11), WriterOptions::resuming()).unwrap_err();
    assert!(matches!(e, Error::Locked { .. }), "{e:?}");
    drop(a);
    let whole = Writer::create(root, metadata(11), WriterOptions::resuming()).unwrap();
    let e = PartWriter::create(root, metadata(11), Rank::new(1, 2).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Locked { .. }), "{e:?}");
    drop(whole);
    // Another metadata lands in another hash directory; the same directory with other bytes
    // in metadata.json is refused naming the key.
    let md = std::fs::read_to_string(dir.join("metadata.json")).unwrap();
    std::fs::write(
        dir.join("metadata.json"),
        md.replace("\"ckpt\": \"x\"", "\"ckpt\": \"y\""),
    )
    .unwrap();
    let e = PartWriter::create(root, metadata(11), Rank::new(1, 2).unwrap()).unwrap_err();
    assert!(e.to_string().contains("\"ckpt\""), "{e}");
    // Writing past the part, and finishing early, are refused.
    std::fs::write(dir.join("metadata.json"), md).unwrap();
    let mut w = PartWriter::create(root, metadata(11), Rank::new(1, 2).unwrap()).unwrap();
    assert_eq!(w.examples(), 6..11);
    let e = w.write(&acts(0..6), None).unwrap_err();
    assert!(e.to_string().contains("rank 1 of 2"), "{e}");
    w.write(&acts(6..8), None).unwrap();
    let e = w.finish().unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
}

#[test]
fn ranks_that_disagree_on_labels_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    write_all(
        PartWriter::create(root, metadata(11), Rank::new(0, 2).unwrap()).unwrap(),
        true,
    );
    let mut w = PartWriter::create(root, metadata(11), Rank::new(1, 2).unwrap()).unwrap();
    let e = w.write(&acts(6..8), None).unwrap_err();
    assert!(e.to_string().contains("labels"), "{e}");
}

#[test]
fn a_rank_finishing_after_another_committed_and_cleaned_up_finds_the_dataset_committed() {
    // Both ranks' shards durable; rank 1 finishes first, commits and removes the parts state;
    // rank 0, which had not reached its commit lock yet (seen with 4 rank processes on 2
    // cores in `shardkit bench parts`), then finishes: committed, not an error about the
    // removed `.shardkit-parts/commit.lock`.
    let tmp = tempfile::tempdir().unwrap();
    let want = tree(&single(&tmp.path().join("one"), 11, false));
    let root = tmp.path().join("parts");
    let mut writers: Vec<PartWriter> = (0..2)
        .map(|r| PartWriter::create(&root, metadata(11), Rank::new(r, 2).unwrap()).unwrap())
        .collect();
    for w in &mut writers {
        for r in w.pending().to_vec() {
            w.write(&acts(r), None).unwrap();
        }
    }
    let dir = writers[0].path().to_path_buf();
    let rank0 = writers.remove(0);
    let committed = writers.remove(0).finish().unwrap();
    assert!(committed.committed, "{committed:?}");
    assert!(!dir.join(".shardkit-parts").exists());
    let late = rank0.finish().unwrap();
    assert!(late.committed && late.missing().is_empty(), "{late:?}");
    assert_eq!(tree(&dir), want);
}
