//! One flat-tokens split written in parts to an object store (an in-memory one put in place of
//! the bucket; threads as ranks): every committed object byte-identical to what one `Writer`
//! writes to a store and to the file it writes locally, in both layouts; resumable after a rank
//! dropped mid-unit with another world size, and after a commit cut short (by `commit_parts` or
//! the next rank); refusing another configuration (naming the key, before any object is
//! written), an overlapping live rank (naming it) and a whole-split writer. Each test is its own
//! process under nextest, so the environment variables each sets are its own.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use common::flat_tokens::{
    assert_other_configurations_refused, names, options, seqs, single, small_v3, write_all,
    write_ranks, TOTAL,
};
use common::rank;
use common::stores::{objects, store};

use std::collections::BTreeMap;
use std::path::Path;

use object_store::memory::InMemory;
use shardkit::flat_tokens::{self, Layout, PartWriter, Split, Writer, WriterOptions};
use shardkit::Error;

/// The reference objects of `layout`: what one writer puts in a store, checked equal, object
/// by object, to the files it writes locally.
fn reference(mem: &InMemory, dir: &Path, layout: Layout, name: &str) -> BTreeMap<String, Vec<u8>> {
    single(format!("s3://bucket/{name}"), layout);
    let want = objects(mem, name);
    let local = dir.join(format!("{name}.zarr"));
    single(local.to_str().unwrap(), layout);
    let files = common::tree(&local);
    assert_eq!(names(&want), names(&files), "{layout:?}");
    assert!(
        want == files,
        "{layout:?}: the store's objects differ from the files"
    );
    assert!(want.contains_key("shardkit.checksums.json"));
    want
}

#[test]
fn one_to_three_writers_in_a_store_commit_the_objects_one_writer_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mem = store(&dir.path().join("staging"));
    for (l, layout) in [Layout::V2, small_v3()].into_iter().enumerate() {
        let want = reference(&mem, dir.path(), layout, &format!("one{l}"));
        for world in 1..=3u64 {
            let name = format!("w{l}{world}");
            let url = format!("s3://bucket/{name}");
            let statuses = write_ranks(Path::new(&url), layout, world);
            assert!(statuses.iter().any(|s| s.committed), "{statuses:?}");
            let got = objects(&mem, &name);
            assert_eq!(names(&got), names(&want), "{layout:?}, {world} writers");
            assert!(got == want, "{layout:?}, {world} writers: bytes differ");
            let st = flat_tokens::status(&url, "train").unwrap();
            assert!(st.committed && st.missing().is_empty(), "{st:?}");
        }
    }
}

#[test]
fn a_rank_dropped_mid_unit_and_a_commit_cut_short_in_a_store_end_in_the_same_objects() {
    let dir = tempfile::tempdir().unwrap();
    let mem = store(&dir.path().join("staging"));
    for (l, layout) in [Layout::V2, small_v3()].into_iter().enumerate() {
        let want = reference(&mem, dir.path(), layout, &format!("one{l}"));
        let name = format!("parts{l}");
        let url = format!("s3://bucket/{name}");
        // Rank 0 of 2 (units 0..14, sequences 0..518) writes 100 sequences and dies mid-unit 2.
        let mut w0 = PartWriter::create(&url, "train", TOTAL, options(layout), rank(0, 2)).unwrap();
        assert_eq!(w0.pending(), [0..518]);
        w0.append(&seqs(0..100)).unwrap();
        drop(w0);
        let w1 = PartWriter::create(&url, "train", TOTAL, options(layout), rank(1, 2)).unwrap();
        let st = write_all(w1).unwrap();
        assert!(!st.committed);
        assert_eq!(st.missing(), vec![2..14]);
        // Only the parts state is in the store so far.
        let got = objects(&mem, &name);
        assert!(
            got.keys().all(|k| k.starts_with(".shardkit-parts/train/")),
            "{got:?}"
        );
        let st = flat_tokens::status(&url, "train").unwrap();
        assert_eq!(st.resume_plan(3), vec![vec![2..10], vec![10..14], vec![]]);
        // Readers see no split, and are told why.
        let e = Split::open(&url, "train").unwrap_err();
        assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
        assert!(e.to_string().contains("units 2..14"), "{e}");
        // A restart with 3 ranks; rank 1 completes the set and commits, killed after replaying
        // 20 units.
        shardkit::internals::stop_flat_tokens_commit_after(20);
        let open = |r| PartWriter::create(&url, "train", TOTAL, options(layout), rank(r, 3));
        let w = open(0).unwrap();
        assert_eq!(w.pending(), [74..370]);
        assert!(!write_all(w).unwrap().committed);
        let w = open(1).unwrap();
        assert_eq!(w.pending(), [370..518]);
        let e = write_all(w).unwrap_err();
        assert!(e.to_string().contains("injected fault"), "{e}");
        let st = flat_tokens::status(&url, "train").unwrap();
        assert!(!st.committed && st.missing().is_empty(), "{st:?}");
        let st = if layout == Layout::V2 {
            // On another machine: no staged copy, the writer resumes from the store's journal.
            let staged = dir.path().join("staging/bucket").join(&name);
            assert!(staged.is_dir());
            std::fs::remove_dir_all(&staged).unwrap();
            flat_tokens::commit_parts(&url, "train").unwrap()
        } else {
            // Or the next rank (nothing pending) finishes it.
            let w = open(2).unwrap();
            assert!(w.pending().is_empty());
            w.finish().unwrap()
        };
        assert!(st.committed, "{st:?}");
        let got = objects(&mem, &name);
        assert_eq!(names(&got), names(&want), "{layout:?}");
        assert!(got == want, "{layout:?}: bytes differ");
        // A rank started after the commit writes nothing.
        let late = PartWriter::create(&url, "train", TOTAL, options(layout), rank(1, 2)).unwrap();
        assert!(late.pending().is_empty());
        assert!(late.finish().unwrap().committed);
        assert!(objects(&mem, &name) == want);
    }
}

#[test]
fn in_a_store_another_configuration_an_overlapping_rank_and_a_whole_writer_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mem = store(&dir.path().join("staging"));
    let url = "s3://bucket/ds";
    let w0 = PartWriter::create(url, "train", TOTAL, options(small_v3()), rank(0, 2)).unwrap();
    assert_other_configurations_refused(Path::new(url), || objects(&mem, "ds"));
    // Rank 0 of 3 (units 0..10) overlaps the live rank 0 of 2 (units 0..14).
    let e = PartWriter::create(url, "train", TOTAL, options(small_v3()), rank(0, 3)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(msg.contains("rank 0 of 2"), "{msg}");
    let st = flat_tokens::status(url, "train").unwrap();
    assert_eq!(st.claimed.len(), 1);
    assert_eq!(st.claimed[0].0, 0..14);
    // A whole-split writer (of either split) is refused while the split is written in parts.
    drop(w0);
    for split in ["train", "validation"] {
        let e = Writer::create(url, split, WriterOptions::default()).unwrap_err();
        assert!(matches!(e, Error::Exists { .. }), "{e:?}");
        assert!(e.to_string().contains("being written in parts"), "{e}");
    }
    // A rank is refused while a whole-split writer holds another prefix, naming it.
    let whole = Writer::create("s3://bucket/whole", "train", WriterOptions::default()).unwrap();
    let e = PartWriter::create(
        "s3://bucket/whole",
        "train",
        10,
        options(small_v3()),
        rank(0, 1),
    )
    .unwrap_err();
    assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
    assert!(e.to_string().contains("whole-dataset writer"), "{e}");
    drop(whole);
    // So is the other split in parts: a store's dataset holds one.
    let e = PartWriter::create(url, "validation", 10, options(small_v3()), rank(0, 1)).unwrap_err();
    assert!(e.to_string().contains("another split"), "{e}");
}

#[test]
fn a_rank_finishing_while_a_unit_is_missing_does_not_queue_on_a_live_commit_lock() {
    std::env::set_var("SHARDKIT_S3_LOCK_LEASE_S", "30");
    let dir = tempfile::tempdir().unwrap();
    let mem = store(&dir.path().join("staging"));
    let url = "s3://bucket/ds";
    let w0 = PartWriter::create(url, "train", TOTAL, options(small_v3()), rank(0, 2)).unwrap();
    let w1 = PartWriter::create(url, "train", TOTAL, options(small_v3()), rank(1, 2)).unwrap();
    // Another machine's committer holds the split's commit lock (renewed just now, 30 s lease).
    common::stores::plant_held_lock(&mem, "ds/.shardkit-parts/train/commit.lock", 30);
    // Rank 0 finishes with rank 1's units missing: it sees so from the records alone and
    // returns at once, instead of waiting out the holder's lease to find the same.
    let started = std::time::Instant::now();
    let st = write_all(w0).unwrap();
    assert!(!st.committed, "{st:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "rank 0 queued on the commit lock"
    );
    drop(w1);
}
