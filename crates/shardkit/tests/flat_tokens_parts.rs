//! One flat-tokens split written by several writers (`flat_tokens::PartWriter`): byte-identical
//! to one `Writer`'s (every file, the sidecar included), in both layouts; resumable after a
//! killed rank with another world size and after a commit cut short; refusing what would mix
//! two configurations or two writers of one part. (Multi-process runs, with SIGKILL, are in the
//! Python tests: crates/shardkit-py/tests/test_flat_tokens_parts.py.)

#![allow(clippy::single_range_in_vec_init)] // one pending range is what most parts have

mod common;

use common::flat_tokens::{
    assert_other_configurations_refused, names, options, seq, seqs, single, small_v3, write_all,
    write_ranks, TOTAL,
};
use common::{rank, tree};

use std::path::Path;

use shardkit::flat_tokens::{self, Layout, PartOptions, PartWriter, Split, Writer, WriterOptions};
use shardkit::Error;

#[test]
fn one_to_four_writers_commit_the_split_one_writer_writes_byte_for_byte() {
    for layout in [Layout::V2, small_v3()] {
        let dir = tempfile::tempdir().unwrap();
        let reference = dir.path().join("one.zarr");
        single(&reference, layout);
        let want = tree(&reference);
        assert!(want.contains_key("shardkit.checksums.json"));
        for world in 1..=4u64 {
            let root = dir.path().join(format!("w{world}.zarr"));
            let statuses = write_ranks(&root, layout, world);
            assert!(statuses.iter().any(|s| s.committed), "{statuses:?}");
            let got = tree(&root);
            assert_eq!(names(&got), names(&want), "{layout:?}, {world} writers");
            assert!(got == want, "{layout:?}, {world} writers: bytes differ");
            let st = flat_tokens::status(&root, "train").unwrap();
            assert!(st.committed && st.missing().is_empty(), "{st:?}");
            let split = Split::open(&root, "train").unwrap();
            assert_eq!(split.ids(999).unwrap(), seq(999));
        }
    }
}

#[test]
fn a_rank_dropped_mid_unit_then_a_restart_with_another_world_size_commits_the_same_split() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("one.zarr");
    single(&reference, small_v3());
    let root = dir.path().join("parts.zarr");
    // Rank 0 of 2 (units 0..14, sequences 0..518) writes 100 sequences and dies mid-unit 2.
    let mut w0 =
        PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(0, 2)).unwrap();
    assert_eq!(w0.pending(), [0..518]);
    w0.append(&seqs(0..100)).unwrap();
    assert_eq!(w0.next_sequence(), Some(100));
    drop(w0);
    let w1 = PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(1, 2)).unwrap();
    let st = write_all(w1).unwrap();
    assert!(!st.committed);
    assert_eq!(st.missing(), vec![2..14]);
    // Readers see no split, and are told why.
    let e = Split::open(&root, "train").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    assert!(
        msg.contains("units 2..14") && msg.contains("in parts"),
        "{msg}"
    );
    let report = flat_tokens::validate(&root);
    assert!(!report.is_valid());
    let errors: Vec<String> = report.errors().map(|e| e.to_string()).collect();
    assert!(
        errors.len() == 1 && errors[0].contains("units 2..14"),
        "{errors:?}"
    );
    // A restart with 3 ranks: each writes only its missing units (units 0..10, 10..19, 19..28).
    let st = flat_tokens::status(&root, "train").unwrap();
    assert_eq!(st.resume_plan(3), vec![vec![2..10], vec![10..14], vec![]]);
    let mut last = None;
    for r in 0..3 {
        let w = PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(r, 3)).unwrap();
        let want: Vec<std::ops::Range<u64>> = match r {
            0 => vec![74..370],
            1 => vec![370..518],
            _ => vec![],
        };
        assert_eq!(w.pending(), want, "rank {r} of 3");
        last = Some(write_all(w).unwrap());
    }
    assert!(last.unwrap().committed);
    assert!(tree(&root) == tree(&reference), "bytes differ");
}

#[test]
fn ranks_with_another_configuration_are_refused_naming_the_key_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ds.zarr");
    let _w0 = PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(0, 2)).unwrap();
    assert_other_configurations_refused(&root, || tree(&root));
    // A whole-split writer is refused while the split is written in parts.
    drop(_w0);
    let e = Writer::create(&root, "train", WriterOptions::default()).unwrap_err();
    assert!(e.to_string().contains("being written in parts"), "{e}");
    // (In an object store: tests/flat_tokens_parts_s3.rs.)
}

#[test]
fn an_overlapping_live_claim_is_refused_naming_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ds.zarr");
    let _w0 = PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(0, 2)).unwrap();
    // Rank 0 of 3 (units 0..10) overlaps the live rank 0 of 2 (units 0..14).
    let e = PartWriter::create(&root, "train", TOTAL, options(small_v3()), rank(0, 3)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(
        msg.contains("rank 0 of 2") && msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    let st = flat_tokens::status(&root, "train").unwrap();
    assert_eq!(st.claimed.len(), 1);
    assert_eq!(st.claimed[0].0, 0..14);
}

#[test]
fn a_commit_cut_short_is_finished_by_commit_parts_byte_for_byte_and_a_late_rank_touches_nothing() {
    for layout in [Layout::V2, small_v3()] {
        let dir = tempfile::tempdir().unwrap();
        let reference = dir.path().join("one.zarr");
        single(&reference, layout);
        let root = dir.path().join("parts.zarr");
        let w0 = PartWriter::create(&root, "train", TOTAL, options(layout), rank(0, 2)).unwrap();
        assert!(!write_all(w0).unwrap().committed);
        // Rank 1 completes the set and commits, killed after replaying 20 of 28 units.
        shardkit::internals::stop_flat_tokens_commit_after(20);
        let w1 = PartWriter::create(&root, "train", TOTAL, options(layout), rank(1, 2)).unwrap();
        let e = write_all(w1).unwrap_err();
        assert!(e.to_string().contains("injected fault"), "{e}");
        let st = flat_tokens::status(&root, "train").unwrap();
        assert!(!st.committed && st.missing().is_empty(), "{st:?}");
        let e = Split::open(&root, "train").unwrap_err();
        assert!(
            e.to_string().contains("killed while committing"),
            "{layout:?}: {e}"
        );
        let st = if layout == Layout::V2 {
            flat_tokens::commit_parts(&root, "train").unwrap()
        } else {
            // Or any rank started again (with any world size): nothing pending, it commits.
            let w = PartWriter::create(&root, "train", TOTAL, options(layout), rank(0, 1)).unwrap();
            assert!(w.pending().is_empty());
            w.finish().unwrap()
        };
        assert!(st.committed, "{st:?}");
        let want = tree(&reference);
        assert_eq!(names(&tree(&root)), names(&want), "{layout:?}");
        assert!(tree(&root) == want, "{layout:?}: bytes differ");
        // A rank started after the commit writes nothing, and touches nothing.
        let mtimes = |p: &Path| -> Vec<std::time::SystemTime> {
            let mut v: Vec<_> = std::fs::read_dir(p)
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().modified().unwrap())
                .collect();
            v.sort();
            v
        };
        let before = (mtimes(&root), mtimes(&root.join("train")));
        let mut late =
            PartWriter::create(&root, "train", TOTAL, options(layout), rank(1, 2)).unwrap();
        assert!(late.pending().is_empty() && late.next_sequence().is_none());
        let e = late.append(&seqs(0..1)).unwrap_err();
        assert!(e.to_string().contains("already committed"), "{e}");
        assert!(late.finish().unwrap().committed);
        assert!(
            tree(&root) == want,
            "{layout:?}: the late rank changed the split"
        );
        assert_eq!(before, (mtimes(&root), mtimes(&root.join("train"))));
        assert!(!root.join(".shardkit-parts").exists());
        // ... and one with another total is refused: the split holds another write.
        let e =
            PartWriter::create(&root, "train", TOTAL - 1, options(layout), rank(0, 1)).unwrap_err();
        assert!(e.to_string().contains("not being written in parts"), "{e}");
    }
}

#[test]
fn token_ids_above_the_encodings_limit_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ds.zarr");
    let mut w = PartWriter::create(&root, "train", 10, PartOptions::default(), rank(0, 1)).unwrap();
    let e = w.append(&[vec![1u32], vec![2, 1 << 31]]).unwrap_err();
    assert!(matches!(e, Error::Refused { .. }), "{e:?}");
    assert_eq!(w.next_sequence(), Some(0));
    let e = w.append(&seqs(0..11)).unwrap_err();
    assert!(e.to_string().contains("pass the end"), "{e}");
    w.append(&seqs(0..10)).unwrap();
    assert!(w.finish().unwrap().committed);
    assert_eq!(Split::open(&root, "train").unwrap().ids(3).unwrap(), seq(3));
}

#[test]
fn both_splits_written_in_parts_at_once_make_the_dataset_one_writer_makes() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("one.zarr");
    single(&reference, small_v3());
    let opts = WriterOptions {
        layout: Some(small_v3()),
        ..WriterOptions::default()
    };
    let mut w = Writer::create(&reference, "validation", opts).unwrap();
    w.append(&seqs(5000..5100)).unwrap();
    w.finish().unwrap();
    let root = dir.path().join("parts.zarr");
    // Two ranks a split, all four at once: the splits' commits take turns on the root.
    std::thread::scope(|s| {
        for (split, first, total) in [("train", 0u64, TOTAL), ("validation", 5000, 100)] {
            for r in 0..2 {
                let root = root.clone();
                s.spawn(move || {
                    let mut w =
                        PartWriter::create(&root, split, total, options(small_v3()), rank(r, 2))
                            .unwrap();
                    for p in w.pending().to_vec() {
                        w.append(&seqs(first + p.start..first + p.end)).unwrap();
                    }
                    w.finish().unwrap()
                });
            }
        }
    });
    assert!(!root.join(".shardkit-parts").exists());
    let want = tree(&reference);
    assert_eq!(names(&tree(&root)), names(&want));
    assert!(tree(&root) == want, "bytes differ");
}
