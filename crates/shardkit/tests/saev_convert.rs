//! `saev::convert`: a dataset converted between float32 and bfloat16 / float16 is, file for
//! file, the dataset a `Writer` makes of the same float32 rows in that dtype directly (shards,
//! error sidecars, labels, metadata, shards.json, checksums); it streams in runs, resumes
//! after an interruption byte-identically, reports a complete destination, and refuses what
//! it cannot or should not do with messages that say why.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::saev::{acts, hard_acts, labels, metadata, EV};
use common::{assert_same_tree, tree};
use shardkit::precision::{self, Dtype};
use shardkit::saev::{
    self, convert, ConvertOptions, ConvertProgress, Dataset, Severity, WriteStart, Writer,
    WriterOptions,
};
use shardkit::Error;

const N: u64 = 7; // 4 shards of 2 examples, the last one holding 1

/// Writes `data` (float32 rows) with labels as the test dataset in `dtype`, directly.
fn write_direct(root: &Path, dtype: Dtype, data: &[f32]) -> PathBuf {
    let md = metadata(N).with_dtype(dtype).unwrap();
    let mut w = Writer::create(root, md, WriterOptions::default()).unwrap();
    w.write(data, Some(&labels(0..N))).unwrap();
    w.finish().unwrap()
}

/// Options with runs of `examples` examples.
fn runs_of(examples: usize) -> ConvertOptions {
    ConvertOptions {
        chunk_bytes: examples * EV * 4,
        ..Default::default()
    }
}

#[test]
fn float32_to_reduced_equals_writing_the_reduced_dataset_directly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &data);
    for dtype in [Dtype::BF16, Dtype::F16] {
        let direct = write_direct(&tmp.path().join(format!("direct-{dtype}")), dtype, &data);
        // Runs of 3 examples: they straddle the 2-example shards of source and destination.
        let root = tmp.path().join(format!("conv-{dtype}"));
        let got = convert(&src, &root, dtype, runs_of(3)).unwrap();
        assert_eq!(got.file_name(), direct.file_name(), "the name hashes dtype");
        assert_ne!(got.file_name(), src.file_name());
        assert_same_tree(&direct, &got, &format!("float32 -> {dtype}"));
        let t = tree(&got);
        for name in [
            "metadata.json",
            "shards.json",
            "labels.bin",
            "acts000003.bin",
            "acts000003.error.json",
            "shardkit.checksums.json",
        ] {
            assert!(
                t.contains_key(name),
                "{dtype}: {name} missing: {:?}",
                t.keys()
            );
        }
        assert!(String::from_utf8_lossy(&t["metadata.json"])
            .contains(&format!("\"dtype\": \"{}\"", dtype.name())));
        // The shard holds every value rounded to nearest even, nothing else.
        let want = precision::encoded(dtype, &data[..2 * EV]);
        assert_eq!(t["acts000000.bin"], want);
    }
}

#[test]
fn reduced_to_float32_is_exact_and_equals_writing_the_widened_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    for dtype in [Dtype::BF16, Dtype::F16] {
        let src = write_direct(&tmp.path().join(format!("src-{dtype}")), dtype, &data);
        let widened = precision::decoded(dtype, &precision::encoded(dtype, &data));
        let direct = write_direct(
            &tmp.path().join(format!("direct-{dtype}")),
            Dtype::F32,
            &widened,
        );
        let got = convert(
            &src,
            tmp.path().join(format!("conv-{dtype}")),
            Dtype::F32,
            runs_of(1),
        )
        .unwrap();
        assert_same_tree(&direct, &got, &format!("{dtype} -> float32"));
        // The float32 dataset has the original float32 dataset's name (the metadata is its own
        // again), and no sidecar: it rounds nothing.
        assert_eq!(
            got.file_name().unwrap().to_str().unwrap(),
            metadata(N).dir_name()
        );
        assert!(!got.join("acts000000.error.json").exists());
        let ds = Dataset::open(&got).unwrap();
        let row = ds.get(3, 7, 2).unwrap();
        let at = 3 * EV + 4 * 4 + 2 * 4; // example 3, layer slot 1, token 2
        assert_eq!(row, widened[at..at + 4]);
        // saev loads it: validation finds nothing about saev refusing it.
        let v = saev::validate(&got);
        assert!(v.is_valid(), "{:?}", v.findings);
        assert!(
            !v.findings
                .iter()
                .any(|f| f.message.contains("saev does not load")),
            "{:?}",
            v.findings
        );
        // The reduced source is the one saev refuses, and the note says why and what to run.
        let v = saev::validate(&src);
        let note = v
            .findings
            .iter()
            .find(|f| f.severity == Severity::Note && f.message.contains("saev does not load"))
            .unwrap_or_else(|| panic!("no note in {:?}", v.findings));
        assert!(
            note.message.contains("Literal[\"float32\"]")
                && note.message.contains("shardkit saev convert")
                && note.message.contains("--dtype float32"),
            "{}",
            note.message
        );
    }
}

#[test]
fn float16_to_bfloat16_goes_through_float32() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    let src = write_direct(&tmp.path().join("src"), Dtype::F16, &data);
    let via = precision::decoded(Dtype::F16, &precision::encoded(Dtype::F16, &data));
    let direct = write_direct(&tmp.path().join("direct"), Dtype::BF16, &via);
    let got = convert(&src, tmp.path().join("conv"), Dtype::BF16, runs_of(2)).unwrap();
    assert_same_tree(&direct, &got, "float16 -> bfloat16");
    // And back: bfloat16 -> float16 is what the widened bfloat16 rows make directly.
    let via = precision::decoded(Dtype::BF16, &precision::encoded(Dtype::BF16, &via));
    let direct = write_direct(&tmp.path().join("direct-back"), Dtype::F16, &via);
    let back = convert(&got, tmp.path().join("back"), Dtype::F16, runs_of(5)).unwrap();
    assert_same_tree(&direct, &back, "bfloat16 -> float16");
}

/// Options recording every progress report, stopping once `stop_after` examples are done.
fn recording(
    examples: usize,
    stop_after: Option<u64>,
) -> (ConvertOptions, Arc<Mutex<Vec<ConvertProgress>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let mut opts = runs_of(examples);
    opts.progress = Some(Box::new(move |p: &ConvertProgress| {
        log.lock().unwrap().push(*p);
        match stop_after {
            Some(k) if p.examples_done >= k => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        }
    }));
    (opts, seen)
}

#[test]
fn streams_in_runs_and_reports_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &hard_acts(N));
    let (opts, seen) = recording(3, None);
    convert(&src, tmp.path().join("dst"), Dtype::BF16, opts).unwrap();
    let seen = seen.lock().unwrap();
    let done: Vec<u64> = seen.iter().map(|p| p.examples_done).collect();
    assert_eq!(done, [0, 3, 6, 7], "runs of 3 examples, the last one short");
    assert!(seen
        .iter()
        .all(|p| p.start == WriteStart::Fresh && p.examples == N));
    assert_eq!(seen[0].source_example_bytes, (EV * 4) as u64);
}

#[test]
fn an_interrupted_conversion_resumes_byte_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &data);
    let whole = convert(&src, tmp.path().join("whole"), Dtype::BF16, runs_of(3)).unwrap();
    for (run, stop_after) in [(1usize, 1u64), (3, 3), (5, 5), (2, 6)] {
        let root = tmp.path().join(format!("resumed-{run}-{stop_after}"));
        let (opts, _) = recording(run, Some(stop_after));
        let e = convert(&src, &root, Dtype::BF16, opts).unwrap_err();
        assert!(matches!(e, Error::Interrupted { .. }), "{e}");
        assert!(
            e.to_string().contains(&format!(
                "conversion stopped at example {stop_after} of {N}; run the same conversion again"
            )),
            "{e}"
        );
        let dir = root.join(whole.file_name().unwrap());
        // Never served while incomplete.
        assert!(matches!(
            Dataset::open(&dir),
            Err(Error::Incomplete { total: N, .. })
        ));
        // Rerun, with other runs: it continues from the first shard not durable.
        let (opts, seen) = recording(4, None);
        let got = convert(&src, &root, Dtype::BF16, opts).unwrap();
        let from = stop_after / 2 * 2; // whole shards of 2 examples are kept
        assert_eq!(
            seen.lock().unwrap()[0].start,
            WriteStart::Resumed { from },
            "stopped after {stop_after}"
        );
        assert_same_tree(&whole, &got, &format!("stopped after {stop_after}"));
    }
    // A rerun on the complete destination writes nothing and says so.
    let before = tree(&whole);
    let (opts, seen) = recording(3, None);
    let again = convert(&src, tmp.path().join("whole"), Dtype::BF16, opts).unwrap();
    assert_eq!(again, whole);
    assert_eq!(tree(&whole), before);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].start, WriteStart::AlreadyComplete);
    assert_eq!(seen[0].examples_done, N);
}

#[test]
fn a_refused_row_names_where_it_is_and_leaves_the_destination_resumable() {
    let tmp = tempfile::tempdir().unwrap();
    let mut data = acts(0..N);
    data.iter_mut().for_each(|x| *x /= 1000.0);
    // Example 5, layer slot 1, token 2: 2^20 overflows float16.
    data[5 * EV + 4 * 4 + 2 * 4 + 1] = 1048576.0;
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &data);
    let mut opts = runs_of(2);
    opts.max_rel_error = Some(1e-2);
    let root = tmp.path().join("dst");
    let e = convert(&src, &root, Dtype::F16, opts).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("acts000002.bin: example 5 (row 1 of the shard), layer 7, token slot 2")
            && msg.contains("overflow to infinity"),
        "{msg}"
    );
    // Shards 0 and 1 are kept; bfloat16 holds 2^20 exactly, so a conversion to it completes.
    let dir = root.join(metadata(N).with_dtype(Dtype::F16).unwrap().dir_name());
    assert!(matches!(
        Dataset::open(&dir),
        Err(Error::Incomplete { present: 4, .. })
    ));
    let mut opts = runs_of(2);
    opts.max_rel_error = Some(1e-2);
    let bf = convert(&src, &root, Dtype::BF16, opts).unwrap();
    assert_eq!(
        Dataset::open(&bf).unwrap().get(5, 7, 2).unwrap()[1],
        1048576.0
    );
}

#[test]
fn refuses_what_it_cannot_or_should_not_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &hard_acts(N));

    // The dtype it already has: nothing to convert, and nothing is created.
    let dst = tmp.path().join("same");
    let e = convert(&src, &dst, Dtype::F32, ConvertOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: already float32; nothing to convert (the result would be this dataset under \
             its own name; to copy it use `shardkit upload` / `shardkit download` or cp -r)",
            src.display()
        )
    );
    assert!(!dst.exists());

    // An unknown dtype name lists those accepted.
    let e = Dtype::from_name("fp8").unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown dtype \"fp8\": expected float32, bfloat16 (bf16) or float16 (fp16)"
    );

    // A protocol 2.0 (or 1.0.0) dataset cannot hold bfloat16.
    let fixture = common::fixtures().join(common::A_20);
    let e = convert(&fixture, &dst, Dtype::BF16, ConvertOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("cannot convert protocol 2.0 to bfloat16")
            && msg.contains("shardkit's dialect of protocol 2.1 only")
            && msg.contains("--dtype bfloat16"),
        "{msg}"
    );
    assert!(!dst.exists());

    // An incomplete source is refused before anything is written.
    let md = metadata(N);
    let mut w = Writer::create(tmp.path().join("partial"), md, WriterOptions::default()).unwrap();
    w.write(&acts(0..3), Some(&labels(0..3))).unwrap();
    let partial = w.path();
    w.abandon();
    let e = convert(&partial, &dst, Dtype::BF16, ConvertOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Incomplete {
                present: 2,
                total: N,
                ..
            }
        ),
        "{e}"
    );
    assert!(!dst.exists());

    // A destination directory of that name holding another dataset is never overwritten.
    let name = metadata(N).with_dtype(Dtype::BF16).unwrap().dir_name();
    let foreign = dst.join(&name);
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("metadata.json"), b"{\"other\": 1}").unwrap();
    std::fs::write(foreign.join("acts000000.bin"), b"theirs").unwrap();
    let e = convert(&src, &dst, Dtype::BF16, ConvertOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e}");
    assert!(e.to_string().contains("holds a different dataset"), "{e}");
    assert_eq!(
        std::fs::read(foreign.join("metadata.json")).unwrap(),
        b"{\"other\": 1}"
    );
    assert_eq!(
        std::fs::read(foreign.join("acts000000.bin")).unwrap(),
        b"theirs"
    );
}

#[test]
fn the_saev_fixture_converts_and_comes_back_with_its_own_values() {
    // A dataset saev itself wrote (2.1, no labels): to bfloat16 and back to float32.
    let tmp = tempfile::tempdir().unwrap();
    let fixture = common::fixtures().join(common::A_21);
    let bf = convert(&fixture, tmp.path().join("bf"), Dtype::BF16, runs_of(1)).unwrap();
    let back = convert(&bf, tmp.path().join("back"), Dtype::F32, runs_of(1)).unwrap();
    assert_eq!(
        back.file_name(),
        fixture.file_name(),
        "the original metadata, so the original name"
    );
    let (src, got) = (
        Dataset::open(&fixture).unwrap(),
        Dataset::open(&back).unwrap(),
    );
    for e in [0, 3, 6] {
        let want = src.get(e, -1, 4).unwrap();
        let rounded = precision::decoded(Dtype::BF16, &precision::encoded(Dtype::BF16, &want));
        assert_eq!(got.get(e, -1, 4).unwrap(), rounded, "example {e}");
    }
}

#[test]
fn converts_from_and_to_an_object_store() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    let src = write_direct(&tmp.path().join("src"), Dtype::F32, &data);
    let local = convert(&src, tmp.path().join("local"), Dtype::BF16, runs_of(3)).unwrap();
    let mem = common::stores::store(&tmp.path().join("staging"));
    // The float32 source goes to the store, then is converted there, store to store.
    let mut w = Writer::create("s3://bucket/src", metadata(N), WriterOptions::default()).unwrap();
    w.write(&data, Some(&labels(0..N))).unwrap();
    let remote_src = w.finish().unwrap();
    let got = convert(&remote_src, "s3://bucket/dst", Dtype::BF16, runs_of(3)).unwrap();
    let name = local.file_name().unwrap().to_str().unwrap();
    assert_eq!(got, PathBuf::from(format!("s3://bucket/dst/{name}")));
    let objects = common::stores::objects(&mem, &format!("dst/{name}"));
    assert_eq!(
        objects,
        tree(&local),
        "the store holds the local conversion's files"
    );
    // Stopped, then run again: the store ends holding the same files.
    for stop_after in [3, 5] {
        let root = format!("s3://bucket/stopped{stop_after}");
        let (opts, _) = recording(1, Some(stop_after));
        let e = convert(&remote_src, &root, Dtype::BF16, opts).unwrap_err();
        assert!(matches!(e, Error::Interrupted { .. }), "{e}");
        let (opts, seen) = recording(2, None);
        convert(&remote_src, &root, Dtype::BF16, opts).unwrap();
        let start = seen.lock().unwrap()[0].start;
        assert!(
            matches!(start, WriteStart::Resumed { from } if from > 0),
            "{start:?}"
        );
        let objects = common::stores::objects(&mem, &format!("stopped{stop_after}/{name}"));
        assert_eq!(
            objects,
            tree(&local),
            "stopped after {stop_after}, then resumed"
        );
    }
}

#[test]
fn runs_of_whole_examples_read_across_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    for dtype in [Dtype::F32, Dtype::BF16] {
        let ds = Dataset::open(write_direct(&tmp.path().join(dtype.name()), dtype, &data)).unwrap();
        let stored = precision::encoded(dtype, &data);
        let mut out = vec![0f32; 3 * EV];
        ds.read_examples_into(1, &mut out).unwrap(); // shards 0, 1
        let want = precision::decoded(dtype, &stored[dtype.size() * EV..dtype.size() * 4 * EV]);
        assert_eq!(
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{dtype}: NaN, infinities and signed zeros included"
        );
        let mut raw = vec![0u8; 2 * EV * dtype.size()];
        ds.read_examples_stored(5, &mut raw).unwrap(); // the last shard's one example too
        assert_eq!(raw, stored[5 * EV * dtype.size()..]);
        let mut l = vec![0u8; 2 * 3];
        assert!(ds.read_labels_run(5, &mut l).unwrap());
        assert_eq!(l, labels(5..7));

        let e = ds.read_examples_into(0, &mut [0f32; EV + 1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "read_examples_into: the buffer holds {} values, not a whole number of examples \
                 (L*T*D = {EV} each)",
                EV + 1
            )
        );
        let e = ds.read_examples_into(6, &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfRange {
                    what: "example",
                    index: 8,
                    len: N
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn an_interrupted_conversion_of_other_data_with_the_same_metadata_is_not_continued() {
    let tmp = tempfile::tempdir().unwrap();
    let data = hard_acts(N);
    let a = write_direct(&tmp.path().join("a"), Dtype::F32, &data);
    // The same metadata, other values (activations recorded again, say).
    let other: Vec<f32> = data.iter().map(|x| x * 2.0).collect();
    let b = write_direct(&tmp.path().join("b"), Dtype::F32, &other);
    assert_eq!(a.file_name(), b.file_name());
    let root = tmp.path().join("dst");
    let (opts, _) = recording(3, Some(3));
    convert(&a, &root, Dtype::BF16, opts).unwrap_err();
    let e = convert(&b, &root, Dtype::BF16, ConvertOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Exists { .. }), "{e}");
    let dir = root.join(metadata(N).with_dtype(Dtype::BF16).unwrap().dir_name());
    assert_eq!(
        e.to_string(),
        format!(
            "{}: holds an interrupted write of a dataset with the same metadata whose example 1 \
             is not {}'s converted: other data (the name hashes the metadata only); refusing to \
             continue it. Delete it, or convert into another root",
            dir.display(),
            b.display()
        )
    );
    // The kept shard is still the first source's, and that conversion still completes.
    assert_eq!(
        std::fs::read(dir.join("acts000000.bin")).unwrap(),
        precision::encoded(Dtype::BF16, &data[..2 * EV])
    );
    let whole = convert(&a, tmp.path().join("whole"), Dtype::BF16, runs_of(3)).unwrap();
    let got = convert(&a, &root, Dtype::BF16, ConvertOptions::default()).unwrap();
    assert_same_tree(&whole, &got, "resumed after the refusal");
}
