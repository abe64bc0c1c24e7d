//! The flat-tokens writer: seqax-exact v2 bytes, sharded v3, append patterns, crash states and
//! resume, refusals that leave the disk untouched.
#![cfg(feature = "zarr")]

mod common;

use common::{assert_same_tree, tree};

use std::path::{Path, PathBuf};

use shardkit::flat_tokens::{
    mark_complete, Completion, Layout, Sharded, Split, Writer, WriterOptions, ZarrFormat,
};
use shardkit::json::sha256_hex;
use shardkit::Error;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/flat_tokens/seqax_synthetic_dataset.zarr")
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for (rel, bytes) in tree(from) {
        let p = to.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
}

fn opts(layout: Layout) -> WriterOptions {
    WriterOptions {
        layout: Some(layout),
        ..Default::default()
    }
}

/// A small sharded layout so a few thousand tokens span many shards and inner chunks.
fn tiny_v3() -> Layout {
    Layout::V3(Sharded {
        tokens_per_shard: 64,
        tokens_per_chunk: 16,
        starts_per_shard: 32,
        starts_per_chunk: 8,
        zstd_level: 3,
    })
}

/// Deterministic ragged sequences, empty ones included, ids in 1..=1000 (no 0).
fn corpus(n: usize, max_len: usize) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_u64;
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = if i % 17 == 5 {
                0
            } else {
                (x >> 33) as usize % max_len + 1
            };
            (0..len)
                .map(|j| {
                    ((x >> 7) as u32).wrapping_add((j as u32).wrapping_mul(2654435761)) % 1000 + 1
                })
                .collect()
        })
        .collect()
}

fn write_all(root: &Path, split: &str, layout: Layout, seqs: &[Vec<u32>], pieces: &[usize]) {
    let mut w = Writer::create(root, split, opts(layout)).unwrap();
    let mut at = 0;
    for &p in pieces {
        w.append(&seqs[at..at + p]).unwrap();
        at += p;
    }
    w.append(&seqs[at..]).unwrap();
    w.finish().unwrap();
}

/// Reads a split back: every document's ids, checked against `seqs`.
fn assert_reads_back(root: &Path, split: &str, seqs: &[Vec<u32>]) {
    let s = Split::open(root, split).unwrap();
    assert!(s.info().completion == shardkit::flat_tokens::Completion::Complete);
    assert_eq!(s.info().seq_count, seqs.len() as u64);
    let total: usize = seqs.iter().map(Vec::len).sum();
    assert_eq!(s.info().token_count, total as u64);
    let max = seqs.iter().flatten().copied().max().unwrap_or(0);
    assert_eq!(s.info().max_token_id, u64::from(max));
    for (i, q) in seqs.iter().enumerate() {
        assert_eq!(&s.ids(i as u64).unwrap(), q, "sequence {i}");
    }
    assert_eq!(s.validate(), Vec::<String>::new());
}

#[test]
fn v2_chunks_equal_zarr_python_2_bytes_however_appended() {
    // flat_tokens.md §10.2: the spec's example, then [[9], [], [10, 11]].
    let first: Vec<Vec<u32>> = vec![vec![1, 2], vec![3, 4, 5], vec![6, 7, 8]];
    let second: Vec<Vec<u32>> = vec![vec![9], vec![], vec![10, 11]];
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a.zarr");
    let mut w = Writer::create(&a, "train", opts(Layout::V2)).unwrap();
    w.append(&first).unwrap();
    w.finish().unwrap();
    let sha = |p: &str| sha256_hex(&std::fs::read(a.join(p)).unwrap());
    assert_eq!(
        sha("train/encoded_tokens/0"),
        "7e434f5c8f371000da1d919e98f47a2c231c2e02d83f22451085ef823f1e9da0"
    );
    assert_eq!(
        sha("train/seq_starts/0"),
        "00859b9eacf754f776af944ad1d1b4a4ab056d1399bc3a89b43be49bc51c9155"
    );
    let s = Split::open(&a, "train").unwrap();
    assert_eq!(s.encoded(0..8).unwrap(), [3, 4, 7, 8, 10, 13, 14, 16]);
    assert_eq!(s.seq_starts(0..4).unwrap(), [0, 2, 5, 8]);
    assert_eq!(s.info().max_token_id, 8);
    drop(s);

    let mut w = Writer::create(
        &a,
        "train",
        WriterOptions {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(w.info().resumed_from, Some(3));
    assert_eq!(w.info().format, ZarrFormat::V2);
    w.append(&second).unwrap();
    w.finish().unwrap();
    assert_eq!(
        sha("train/encoded_tokens/0"),
        "5803df80185b59c27026a42ea42a545baefc9ed820801416cf1603c99c32da5d"
    );
    assert_eq!(
        sha("train/seq_starts/0"),
        "73e64a5d3273b570498305cd956fc3695de2de8fc3f389cc8194e6617df8f591"
    );
    let s = Split::open(&a, "train").unwrap();
    assert_eq!(
        s.encoded(0..11).unwrap(),
        [3, 4, 7, 8, 10, 13, 14, 16, 19, 21, 22]
    );
    assert_eq!(s.seq_starts(0..7).unwrap(), [0, 2, 5, 8, 9, 9, 11]);
    assert_eq!(s.info().max_token_id, 11);

    // One call, and one call per sequence, give the same files.
    let all: Vec<Vec<u32>> = first.iter().chain(&second).cloned().collect();
    let b = tmp.path().join("b.zarr");
    write_all(&b, "train", Layout::V2, &all, &[]);
    let c = tmp.path().join("c.zarr");
    write_all(&c, "train", Layout::V2, &all, &[1, 1, 1, 1, 1]);
    assert_same_tree(&a, &b, "one call");
    assert_same_tree(&a, &c, "a call per sequence");

    // Metadata in zarr-python 2's text (sorted keys, 4 spaces, no trailing newline).
    let zarray =
        String::from_utf8(std::fs::read(a.join("train/seq_starts/.zarray")).unwrap()).unwrap();
    assert!(zarray.starts_with("{\n    \"chunks\": [\n        65536\n    ],"));
    assert!(zarray.ends_with("\n}") && zarray.contains("\"id\": \"delta\""));
    assert_eq!(
        std::fs::read_to_string(a.join("train/.zattrs")).unwrap(),
        "{\n    \"max_token_id\": 11\n}"
    );
    assert_eq!(
        std::fs::read_to_string(a.join(".zattrs")).unwrap(),
        "{\n    \"write_completed\": true\n}"
    );
    assert_eq!(
        std::fs::read_to_string(a.join(".zgroup")).unwrap(),
        "{\n    \"zarr_format\": 2\n}"
    );
}

#[test]
fn v2_spanning_chunks_and_v3_spanning_shards_equal_one_shot_writes() {
    let tmp = tempfile::tempdir().unwrap();
    // v2: 4 Mi-token chunks; about 9.5 M tokens make three chunks, sequences straddle them.
    let big = corpus(20_000, 950);
    let one = tmp.path().join("one.zarr");
    write_all(&one, "train", Layout::V2, &big, &[]);
    let many = tmp.path().join("many.zarr");
    write_all(
        &many,
        "train",
        Layout::V2,
        &big,
        &[1, 7, 3000, 1, 0, 9000, 5],
    );
    assert_same_tree(&one, &many, "v2");
    assert!(one.join("train/encoded_tokens/2").is_file());
    assert_reads_back(&many, "train", &big);

    // v3 with tiny shards: many shards and inner chunks of both arrays.
    let small = corpus(300, 40);
    let one = tmp.path().join("one3.zarr");
    write_all(&one, "validation", tiny_v3(), &small, &[]);
    let many = tmp.path().join("many3.zarr");
    write_all(
        &many,
        "validation",
        tiny_v3(),
        &small,
        &[1, 2, 3, 50, 0, 100],
    );
    assert_same_tree(&one, &many, "v3");
    let s = Split::open(&many, "validation").unwrap();
    assert!(s.info().sharded);
    assert_eq!(s.info().format, ZarrFormat::V3);
    drop(s);
    assert_reads_back(&many, "validation", &small);
    // The default layout: one shard of ~60 inner chunks encoded in parallel, laid out in C
    // order, so its bytes depend only on the data.
    let mid = corpus(2_000, 950);
    let a = tmp.path().join("a3.zarr");
    write_all(&a, "train", Layout::default(), &mid, &[]);
    let b = tmp.path().join("b3.zarr");
    write_all(&b, "train", Layout::default(), &mid, &[3, 500, 1, 700]);
    assert_same_tree(&a, &b, "default v3");
    let meta = std::fs::read_to_string(many.join("validation/encoded_tokens/zarr.json")).unwrap();
    assert!(meta.contains("\"dimension_names\"") && meta.contains("\"token\""));
    assert!(meta.contains("sharding_indexed") && meta.contains("zstd"));
    assert!(!meta.contains("_zarrs"), "no stray _zarrs attribute");
}

#[test]
fn content_rules_ids_empty_sequences_and_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    let mut w = Writer::create(&root, "train", WriterOptions::default()).unwrap();
    w.append(&[vec![5u32, 6]]).unwrap();
    // One bad id anywhere refuses the whole call.
    let err = w
        .append(&[vec![1u32], vec![2, 1 << 31]])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2147483648") && err.contains("sequence 1") && err.contains("below 2^31"),
        "{err}"
    );
    assert_eq!((w.info().seq_count, w.info().token_count), (1, 2));
    w.append(&[vec![], vec![0u32, 3], vec![]]).unwrap();
    assert_eq!(w.info().sequences_with_id_zero, 1);
    w.append(&[vec![(1u32 << 31) - 1]]).unwrap();
    let summary = w.finish().unwrap();
    assert_eq!(summary.seq_count, 5);
    assert_eq!(summary.max_token_id, (1 << 31) - 1);
    let s = Split::open(&root, "train").unwrap();
    assert_eq!(s.seq_starts(0..6).unwrap(), [0, 2, 2, 4, 4, 5]);
    assert_eq!(s.encoded(0..5).unwrap(), [11, 12, 1, 6, u32::MAX]);
    assert!(s.validate().is_empty());

    // An empty split is valid: no tokens, seq_starts [0], max_token_id 0.
    let w = Writer::create(&root, "validation", WriterOptions::default()).unwrap();
    w.finish().unwrap();
    let s = Split::open(&root, "validation").unwrap();
    assert_eq!(
        (
            s.info().token_count,
            s.info().seq_count,
            s.info().max_token_id
        ),
        (0, 0, 0)
    );
    assert_eq!(s.seq_starts(0..1).unwrap(), [0]);
}

#[test]
fn refusals_leave_the_disk_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    write_all(&root, "train", Layout::V2, &corpus(50, 30), &[]);
    let before = tree(&root);
    // The split exists: refused unless resuming.
    let err = Writer::create(&root, "train", WriterOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Exists { .. }), "{err}");
    assert!(err.to_string().contains("50 sequences"), "{err}");
    // Another format than the dataset's.
    let err = Writer::create(&root, "validation", opts(Layout::default())).unwrap_err();
    assert!(err.to_string().contains("zarr v2"), "{err}");
    let err =
        Writer::create(&root, "test", WriterOptions::default()).expect_err("not a split name");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains(r#"split must be "train" or "validation", got "test""#)),
        "{err:?}"
    );
    assert_eq!(before, tree(&root));
    // Not a zarr group, or not a directory.
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let err = Writer::create(&other, "train", WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not a zarr group"), "{err}");
    assert_eq!(tree(&other).len(), 1);
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let err = Writer::create(&file, "train", WriterOptions::default())
        .expect_err("a file, not a directory");
    assert!(
        matches!(&err, Error::Exists { path, why } if path == &file && why.contains("not a directory")),
        "{err:?}"
    );
    // Two writers at once.
    let _w = Writer::create(&root, "validation", WriterOptions::default()).unwrap();
    let err = Writer::create(
        &root,
        "train",
        WriterOptions {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("another writer"), "{err}");
}

fn resume_opts(layout: Layout, checkpoint: u64) -> WriterOptions {
    WriterOptions {
        layout: Some(layout),
        resume: true,
        checkpoint_tokens: checkpoint,
    }
}

#[test]
fn a_crashed_write_is_refused_and_resume_completes_it_byte_for_byte() {
    for layout in [Layout::V2, tiny_v3()] {
        let tmp = tempfile::tempdir().unwrap();
        let seqs = corpus(400, 60);
        let clean = tmp.path().join("clean.zarr");
        write_all(&clean, "train", layout, &seqs, &[]);

        let root = tmp.path().join("crashed.zarr");
        let mut w = Writer::create(&root, "train", resume_opts(layout, 500)).unwrap();
        w.append(&seqs[..150]).unwrap(); // commits along the way
        w.flush().unwrap();
        w.append(&seqs[150..170]).unwrap(); // not committed
        let committed = 150;
        drop(w); // the process dies here

        // Never served, with the reason; inspection still works.
        let err = Split::open(&root, "train").unwrap_err();
        assert!(matches!(err, Error::Interrupted { .. }), "{err}");
        assert!(err.to_string().contains("150 sequences committed"), "{err}");
        let s = Split::open_unvalidated(&root, "train").unwrap();
        assert_eq!(s.info().completion, Completion::Interrupted);
        assert_eq!(s.info().seq_count, committed);
        drop(s);

        // A crash inside the next commit, after encoded_tokens' metadata grew but before the
        // commit record: simulate by growing the tokens shape, and leave stale temporaries and
        // a chunk file no commit covers.
        let grow = |key: &str| {
            let p = root.join(key);
            let text = std::fs::read_to_string(&p).unwrap();
            let n = Split::open_unvalidated(&root, "train")
                .unwrap()
                .info()
                .token_count;
            std::fs::write(
                &p,
                text.replacen(&format!("{n}"), &format!("{}", n + 40), 1),
            )
            .unwrap();
        };
        if layout == Layout::V2 {
            grow("train/encoded_tokens/.zarray");
            std::fs::write(root.join("train/encoded_tokens/7"), b"stray").unwrap();
            std::fs::write(root.join("train/.zattrs.tmp"), b"{").unwrap();
        } else {
            grow("train/encoded_tokens/zarr.json");
            std::fs::write(root.join("train/encoded_tokens/c/900"), b"stray").unwrap();
            std::fs::write(root.join("train/zarr.json.tmp"), b"{").unwrap();
        }
        let mut w = Writer::create(&root, "train", resume_opts(layout, 500)).unwrap();
        assert_eq!(w.info().resumed_from, Some(committed));
        w.append(&seqs[committed as usize..]).unwrap();
        w.finish().unwrap();
        assert_same_tree(&clean, &root, &format!("{layout:?}"));
        assert_reads_back(&root, "train", &seqs);
    }
}

#[test]
fn a_resumed_writer_that_writes_nothing_keeps_a_complete_dataset_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    write_all(&root, "train", Layout::default(), &corpus(20, 10), &[]);
    let before = tree(&root);
    let w = Writer::create(&root, "train", resume_opts(Layout::default(), 1 << 20)).unwrap();
    assert_eq!(w.info().resumed_from, Some(20));
    drop(w);
    assert_eq!(before, tree(&root));
    assert!(
        Split::open(&root, "train").unwrap().info().completion
            == shardkit::flat_tokens::Completion::Complete
    );
}

/// Finishing a resumed writer that added nothing leaves every metadata document as it was (not
/// rewritten with the same bytes: a kill mid-rewrite would leave a stray temporary beside a
/// complete dataset).
#[test]
fn finishing_a_resumed_writer_that_added_nothing_rewrites_no_metadata() {
    use std::os::unix::fs::MetadataExt;
    for layout in [Layout::V2, tiny_v3()] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ds.zarr");
        write_all(&root, "train", layout, &corpus(20, 10), &[]);
        let docs = [
            ".zattrs",
            ".zgroup",
            "zarr.json",
            "train/.zattrs",
            "train/zarr.json",
        ];
        let inodes = |root: &Path| -> Vec<(String, u64)> {
            docs.iter()
                .filter_map(|d| Some((d.to_string(), std::fs::metadata(root.join(d)).ok()?.ino())))
                .collect()
        };
        let before = inodes(&root);
        assert!(!before.is_empty());
        let w = Writer::create(&root, "train", resume_opts(layout, 1 << 20)).unwrap();
        assert_eq!(w.info().resumed_from, Some(20));
        w.finish().unwrap();
        assert_eq!(inodes(&root), before, "{layout:?}");
        assert!(
            Split::open(&root, "train").unwrap().info().completion
                == shardkit::flat_tokens::Completion::Complete
        );
    }
}

#[test]
fn seqax_data_is_marked_once_validated_and_can_be_appended_to() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("seqax.zarr");
    copy_tree(&fixture(), &root);
    assert_eq!(
        Split::open(&root, "train").unwrap().info().completion,
        Completion::Unmarked
    );
    mark_complete(&root).unwrap();
    assert_eq!(
        std::fs::read_to_string(root.join(".zattrs")).unwrap(),
        "{\n    \"write_completed\": true\n}"
    );
    assert!(
        Split::open(&root, "train").unwrap().info().completion
            == shardkit::flat_tokens::Completion::Complete
    );

    // Appending keeps seqax's own .zarray (fill_value null included) apart from the shape.
    let zarray = std::fs::read_to_string(root.join("train/encoded_tokens/.zarray")).unwrap();
    let mut w = Writer::create(&root, "train", resume_opts(Layout::V2, 1 << 20)).unwrap();
    assert_eq!(w.info().resumed_from, Some(512));
    w.append(&[vec![7u32, 8, 9]]).unwrap();
    w.finish().unwrap();
    let after = std::fs::read_to_string(root.join("train/encoded_tokens/.zarray")).unwrap();
    assert_eq!(after, zarray.replace("264992", "264995"));
    let s = Split::open(&root, "train").unwrap();
    assert_eq!(s.ids(512).unwrap(), [7, 8, 9]);
    assert_eq!(s.ids(0).unwrap().len(), 555);
    assert!(s.validate().is_empty());

    // A damaged copy is not marked, and says why.
    let bad = tmp.path().join("bad.zarr");
    copy_tree(&fixture(), &bad);
    std::fs::write(
        bad.join("validation/.zattrs"),
        "{\n    \"max_token_id\": 5\n}",
    )
    .unwrap();
    let err = mark_complete(&bad).unwrap_err().to_string();
    assert!(
        err.contains("validation: ") && err.contains("exceed"),
        "{err}"
    );
    assert!(!bad.join(".zattrs").exists());
}

#[test]
fn converting_seqax_data_to_v3_and_back_gives_seqaxs_chunk_files() {
    use shardkit::flat_tokens::{convert, LoaderOptions, TokenLoader};
    let tmp = tempfile::tempdir().unwrap();
    let v3 = tmp.path().join("v3.zarr");
    let mut calls = 0;
    let done = convert(fixture(), &v3, Layout::default(), |done, total| {
        calls += 1;
        assert!(done <= total && total == 264_992 + 278_035);
    })
    .unwrap();
    assert!(calls >= 2);
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].1.token_count, 264_992);
    let (a, b) = (
        Split::open(fixture(), "validation").unwrap(),
        Split::open(&v3, "validation").unwrap(),
    );
    assert!(b.info().sharded && b.info().completion == shardkit::flat_tokens::Completion::Complete);
    assert_eq!(
        a.encoded(0..278_035).unwrap(),
        b.encoded(0..278_035).unwrap()
    );
    assert_eq!(a.seq_starts(0..513).unwrap(), b.seq_starts(0..513).unwrap());
    // The loader serves the same batches (seqax's golden rows) from the converted copy.
    let mut o = LoaderOptions::new(64, 64);
    (o.streams, o.read_blocks_per_shuffle_buffer) = (2, 8);
    o.sequences_per_read_block = Some(16);
    let l = TokenLoader::new(Split::open(&v3, "train").unwrap(), o.clone()).unwrap();
    let r = TokenLoader::new(Split::open(fixture(), "train").unwrap(), o).unwrap();
    assert_eq!(l.load(0).unwrap().rows[..3], [2937, 398, 3520]);
    assert_eq!(l.load(9).unwrap(), r.load(9).unwrap());

    // Back to v2: the chunk files are seqax's own, byte for byte.
    let v2 = tmp.path().join("v2.zarr");
    convert(&v3, &v2, Layout::V2, |_, _| {}).unwrap();
    for f in [
        "train/encoded_tokens/0",
        "train/seq_starts/0",
        "validation/encoded_tokens/0",
        "validation/seq_starts/0",
    ] {
        assert!(
            std::fs::read(v2.join(f)).unwrap() == std::fs::read(fixture().join(f)).unwrap(),
            "{f}"
        );
    }
    // The destination must not exist.
    let err = convert(&v3, &v2, Layout::V2, |_, _| {}).unwrap_err();
    assert!(matches!(err, Error::Exists { .. }), "{err}");
}
