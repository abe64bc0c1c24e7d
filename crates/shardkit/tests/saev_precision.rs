//! Reduced-precision saev datasets (bfloat16 / float16, shardkit's dialect of protocol 2.1):
//! rounding, the per-shard error sidecar, `max_rel_error`, readers serving rows as stored or
//! widened, validation, resume and the parallel writers.

mod common;

use std::path::{Path, PathBuf};

use common::saev::{acts, hard_acts, metadata, EV};
use shardkit::engine::Order;
use shardkit::precision::{self, Dtype};
use shardkit::saev::{
    self, Dataset, LayerSel, Loader, LoaderOptions, PartWriter, Severity, Writer, WriterOptions,
};
use shardkit::{Error, Rank};

/// The test dataset (2 layers, CLS + 3 tokens, d_model 4, 2 examples per shard) in `dtype`.
fn md(n: u64, dtype: Dtype) -> saev::Metadata {
    metadata(n).with_dtype(dtype).unwrap()
}

fn write(root: &Path, n: u64, dtype: Dtype, data: &[f32], opts: WriterOptions) -> PathBuf {
    let mut w = Writer::create(root, md(n, dtype), opts).unwrap();
    w.write(data, None).unwrap();
    w.finish().unwrap()
}

/// What the shard bytes must be: every value rounded to nearest even.
fn expected_bytes(dtype: Dtype, data: &[f32], eps_values: usize) -> Vec<u8> {
    let mut out = precision::encoded(dtype, data);
    let shard_bytes = eps_values * dtype.size();
    out.resize(out.len().div_ceil(shard_bytes) * shard_bytes, 0);
    out
}

fn shard_bytes_of(dir: &Path) -> Vec<u8> {
    let mut all = Vec::new();
    for s in 0.. {
        match std::fs::read(dir.join(format!("acts{s:06}.bin"))) {
            Ok(b) => all.extend(b),
            Err(_) => break,
        }
    }
    all
}

/// The error sidecar statistics recomputed independently, in f64, for the rows `data`.
fn reference_stats(dtype: Dtype, data: &[f32]) -> (f64, f64, f64, u64, u64) {
    let q = precision::decoded(dtype, &precision::encoded(dtype, data));
    let (mut max_abs, mut max_rel, mut sum_rel, mut overflow, mut flushed) =
        (0f64, 0f64, 0f64, 0u64, 0u64);
    let rows = data.len() / 4;
    for r in 0..rows {
        let (mut e2, mut n2) = (0f64, 0f64);
        for i in r * 4..r * 4 + 4 {
            let (x, y) = (data[i], q[i]);
            if !x.is_finite() {
                continue;
            }
            if y.is_infinite() {
                overflow += 1;
                continue;
            }
            if x != 0.0 && y == 0.0 {
                flushed += 1;
            }
            let e = (f64::from(x) - f64::from(y)).abs();
            max_abs = max_abs.max(e);
            e2 += e * e;
            n2 += f64::from(x) * f64::from(x);
        }
        let rel = if n2 > 0.0 { (e2 / n2).sqrt() } else { 0.0 };
        max_rel = max_rel.max(rel);
        sum_rel += rel;
    }
    (max_abs, max_rel, sum_rel / rows as f64, overflow, flushed)
}

#[test]
fn shards_hold_rounded_values_and_sidecars_their_error() {
    for dtype in [Dtype::BF16, Dtype::F16] {
        let tmp = tempfile::tempdir().unwrap();
        let n = 5;
        let data = hard_acts(n);
        let dir = write(tmp.path(), n, dtype, &data, WriterOptions::default());
        assert_eq!(
            shard_bytes_of(&dir),
            expected_bytes(dtype, &data, 2 * EV),
            "{dtype}"
        );
        let md_text = std::fs::read_to_string(dir.join("metadata.json")).unwrap();
        assert!(md_text.contains(&format!("\"dtype\": \"{}\"", dtype.name())));
        assert_ne!(
            dir.file_name(),
            write(tmp.path(), n, Dtype::F32, &data, WriterOptions::default()).file_name(),
            "the content hash covers dtype"
        );
        for s in 0..3u64 {
            let rows = &data[(s * 2) as usize * EV..((s * 2 + 2).min(n)) as usize * EV];
            let side = dir.join(format!("acts{s:06}.error.json"));
            let v = shardkit::json::parse(&std::fs::read(&side).unwrap()).unwrap();
            let (max_abs, max_rel, mean_rel, overflow, flushed) = reference_stats(dtype, rows);
            let f = |k: &str| v.get(k).unwrap().as_f64().unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-30);
            assert!(close(f("max_abs_error"), max_abs), "{dtype} shard {s}");
            assert!(close(f("max_rel_l2_error"), max_rel), "{dtype} shard {s}");
            assert!(close(f("mean_rel_l2_error"), mean_rel), "{dtype} shard {s}");
            assert_eq!(v.get("overflow").unwrap().as_i64(), Some(overflow as i64));
            assert_eq!(
                v.get("flushed_to_zero").unwrap().as_i64(),
                Some(flushed as i64)
            );
            assert_eq!(
                v.get("rows").unwrap().as_i64(),
                Some(rows.len() as i64 / 4),
                "rows of the short last shard count only its examples"
            );
        }
        let report = saev::validate(&dir);
        assert!(report.is_valid(), "{report:?}");
        assert!(
            report
                .findings
                .iter()
                .any(|f| f.severity == Severity::Note && f.message.contains("saev does not load")),
            "validate names why saev refuses it: {report:?}"
        );
        let info = saev::inspect(&dir).unwrap();
        assert_eq!(info.get("dtype").unwrap().as_str(), Some(dtype.name()));
        assert_eq!(
            info.get("saev_loads"),
            Some(&shardkit::json::Value::Bool(false))
        );
        let p = info.get("precision").unwrap();
        assert_eq!(p.get("shards_measured").unwrap().as_i64(), Some(3));
    }
}

#[test]
fn float16_overflow_is_counted_and_float32_is_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let mut data = acts(0..2);
    data[3] = 1e6; // beyond float16's 65504
    let dir = write(tmp.path(), 2, Dtype::F16, &data, WriterOptions::default());
    let info = saev::inspect(&dir).unwrap();
    assert_eq!(
        info.get("precision")
            .unwrap()
            .get("overflow")
            .unwrap()
            .as_i64(),
        Some(1)
    );

    let f32_dir = write(tmp.path(), 2, Dtype::F32, &data, WriterOptions::default());
    let names: Vec<String> = std::fs::read_dir(&f32_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with(".error.json")),
        "{names:?}"
    );
    assert_eq!(
        shard_bytes_of(&f32_dir),
        precision::encoded(Dtype::F32, &data)
    );
    assert_eq!(
        saev::inspect(&f32_dir).unwrap().get("precision"),
        Some(&shardkit::json::Value::Null)
    );
}

#[test]
fn readers_serve_rows_as_stored_or_widened() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 6;
    let data = acts(0..n)
        .iter()
        .map(|v| v * 1.001 + 0.37)
        .collect::<Vec<_>>();
    let dir = write(tmp.path(), n, Dtype::BF16, &data, WriterOptions::default());
    let widened = precision::decoded(Dtype::BF16, &precision::encoded(Dtype::BF16, &data));
    let ds = Dataset::open(&dir).unwrap();
    // example 1, layer 7 (slot 1), token slot 2
    let at = EV + 4 * 4 + 2 * 4;
    assert_eq!(ds.get(1, 7, 2).unwrap(), widened[at..at + 4]);
    assert_eq!(ds.take(&[(1, 7, 2)]).unwrap(), widened[at..at + 4]);
    assert_eq!(
        ds.take_stored(&[(1, 7, 2)]).unwrap(),
        precision::encoded(Dtype::BF16, &data[at..at + 4])
    );

    for upcast in [false, true] {
        let mut opts = LoaderOptions::new(LayerSel::Value(3));
        opts.order = Order::Sequential;
        opts.batch_size = 4;
        opts.upcast = upcast;
        let loader = Loader::new(&dir, opts).unwrap();
        let mut seen = 0;
        for b in loader.iter().unwrap() {
            let b = b.unwrap();
            assert_eq!(b.dtype, if upcast { Dtype::F32 } else { Dtype::BF16 });
            for r in 0..b.n {
                let (e, t) = (b.example_idx[r] as usize, (b.token_idx[r] + 1) as usize);
                let at = e * EV + t * 4;
                let row = &b.act[r * 4 * b.dtype.size()..(r + 1) * 4 * b.dtype.size()];
                assert_eq!(precision::decoded(b.dtype, row), widened[at..at + 4]);
                seen += 1;
            }
        }
        assert_eq!(seen, n * 3);
    }
}

#[test]
fn max_rel_error_refuses_the_write_naming_shard_and_row() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = WriterOptions {
        max_rel_error: Some(1e-3),
        ..Default::default()
    };
    let mut w = Writer::create(tmp.path(), md(4, Dtype::BF16), opts).unwrap();
    // Whole numbers up to 256 are exact in bfloat16; 1001.9 rounds to 1000 (relative 1.9e-3).
    let mut data = vec![1.0f32; 4 * EV];
    w.write(&data[..2 * EV], None).unwrap();
    data[3 * EV + 4 * 4 + 5] = 1001.9; // example 3, layer 7, token slot 1
    let e = w.write(&data[2 * EV..], None).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    for part in [
        "acts000001.bin",
        "example 3",
        "row 1 of the shard",
        "layer 7",
        "token slot 1",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    assert_eq!(
        w.next_example(),
        2,
        "nothing of the refused write was stored"
    );
    data[3 * EV + 4 * 4 + 5] = 1.0;
    w.write(&data[2 * EV..], None).unwrap();
    w.finish().unwrap();
}

#[test]
fn reduced_precision_needs_protocol_2_1() {
    let v = shardkit::json::parse(
        br#"{"family": "clip", "ckpt": "x", "layers": [3], "patches_per_ex": 3,
        "cls_token": true, "d_model": 4, "n_ex": 2, "patches_per_shard": 16,
        "data": {}, "dataset": "t", "dtype": "bfloat16", "protocol": "2.0"}"#,
    )
    .unwrap();
    let e = saev::Metadata::for_writing(&v).unwrap_err();
    assert!(e.to_string().contains("protocol 2.1"), "{e}");
}

#[test]
fn a_killed_write_resumes_byte_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 7;
    let data = hard_acts(n);
    let whole = write(
        &tmp.path().join("a"),
        n,
        Dtype::BF16,
        &data,
        WriterOptions::default(),
    );
    let root = tmp.path().join("b");
    let mut w = Writer::create(&root, md(n, Dtype::BF16), WriterOptions::default()).unwrap();
    w.write(&data[..5 * EV], None).unwrap(); // shards 0 and 1 published, shard 2 half full
    let dir = w.path();
    w.abandon();
    // inspect of the unfinished dataset measures the shards written, and misses none.
    let info = saev::inspect(&dir).unwrap();
    let p = info.get("precision").unwrap();
    assert_eq!(p.get("shards_measured").unwrap().as_i64(), Some(2));
    assert_eq!(p.get("rows").unwrap().as_i64(), Some(4 * 8));
    assert_eq!(
        p.get("shards_without_sidecar"),
        Some(&shardkit::json::Value::Array(vec![]))
    );
    let opts = WriterOptions::resuming();
    let mut w = Writer::create(&root, md(n, Dtype::BF16), opts).unwrap();
    let from = w.next_example() as usize;
    assert_eq!(from, 4);
    w.write(&data[from * EV..], None).unwrap();
    let resumed = w.finish().unwrap();
    for name in [
        "acts000002.bin",
        "acts000002.error.json",
        "acts000003.error.json",
        "shards.json",
    ] {
        assert_eq!(
            std::fs::read(whole.join(name)).unwrap(),
            std::fs::read(resumed.join(name)).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn parallel_writers_produce_the_single_writers_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 11;
    let data = hard_acts(n);
    let whole = write(
        &tmp.path().join("a"),
        n,
        Dtype::F16,
        &data,
        WriterOptions::default(),
    );
    let root = tmp.path().join("b");
    let mut dir = PathBuf::new();
    for r in 0..3 {
        let mut w = PartWriter::create(&root, md(n, Dtype::F16), Rank::new(r, 3).unwrap()).unwrap();
        let range = w.pending()[0].clone();
        let part = &data[range.start as usize * EV..range.end as usize * EV];
        // Every row of these values rounds with a relative error far above 1e-9: the first
        // row of the part is refused, named by its global example.
        w.set_max_rel_error(Some(1e-9));
        let e = w.write(part, None).unwrap_err().to_string();
        let shard = format!("acts{:06}.bin", range.start / 2);
        assert!(
            e.contains(&shard) && e.contains(&format!("example {}", range.start)),
            "{e}"
        );
        w.set_max_rel_error(None);
        w.write(part, None).unwrap();
        dir = w.path().to_path_buf();
        w.finish().unwrap();
    }
    let mut names = vec!["shardkit.checksums.json".to_string(), "shards.json".into()];
    for s in 0..6 {
        names.extend([format!("acts{s:06}.bin"), format!("acts{s:06}.error.json")]);
    }
    {
        for name in names {
            assert_eq!(
                std::fs::read(whole.join(&name)).unwrap(),
                std::fs::read(dir.join(&name)).unwrap(),
                "{name}"
            );
        }
    }
    assert!(saev::validate(&dir).is_valid());
}

#[test]
fn validate_names_a_missing_or_foreign_sidecar() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(
        tmp.path(),
        4,
        Dtype::BF16,
        &acts(0..4),
        WriterOptions::default(),
    );
    std::fs::remove_file(dir.join("acts000001.error.json")).unwrap();
    let report = saev::validate(&dir);
    let f = report
        .findings
        .iter()
        .find(|f| f.severity == Severity::Error)
        .expect("an error");
    assert!(f.file.ends_with("acts000001.error.json"), "{f:?}");
    assert!(f.message.contains("rounding error"), "{f:?}");
    std::fs::write(dir.join("acts000001.error.json"), b"{\"format\": 1}").unwrap();
    let report = saev::validate(&dir);
    assert!(
        report.findings.iter().any(|f| f.severity == Severity::Error
            && f.message.contains("not a precision sidecar")),
        "{report:?}"
    );
}

#[test]
fn a_large_write_rounded_on_every_core_is_the_same_and_refuses_its_first_bad_row() {
    // 80 examples of 16 tokens x 1024 values: over a million values, rounded in parallel.
    let md = |n: u64| {
        let text = format!(
            r#"{{"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 15,
            "cls_token": true, "d_model": 1024, "n_examples": {n}, "max_tokens_per_shard": 512,
            "data": "d", "dataset": "t", "dtype": "bfloat16", "protocol": "2.1"}}"#
        );
        saev::Metadata::for_writing(&shardkit::json::parse(text.as_bytes()).unwrap()).unwrap()
    };
    let ev = 16 * 1024;
    let mut data: Vec<f32> = (0..80 * ev)
        .map(|i| (i as f32 * 0.618).sin() * 3.0)
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path().join("a"), md(80), WriterOptions::default()).unwrap();
    w.write(&data, None).unwrap();
    let dir = w.finish().unwrap();
    // 32 examples a shard: the last of the 3 shards is zero-padded.
    let same = shard_bytes_of(&dir) == expected_bytes(Dtype::BF16, &data, 32 * ev);
    assert!(
        same,
        "the parallel rounding differs from one value at a time"
    );

    let opts = WriterOptions {
        max_rel_error: Some(0.01),
        ..Default::default()
    };
    for e in [70usize, 50] {
        // One row that rounds badly (rows of these values err by about 1e-3): a float32
        // subnormal alone, which bfloat16's coarser subnormals miss by about a fifth.
        data[e * ev + 3 * 1024..e * ev + 4 * 1024].fill(0.0);
        data[e * ev + 3 * 1024] = 1.5e-40;
    }
    let mut w = Writer::create(tmp.path().join("b"), md(80), opts).unwrap();
    let err = w.write(&data, None).unwrap_err().to_string();
    assert!(
        err.contains("example 50 ") && err.contains("token slot 3"),
        "{err}"
    );
    assert_eq!(w.next_example(), 0);
}

/// `upcast` widens rows while they are gathered (on the gather threads, straight into the
/// float32 batch): in every order, through the page cache and with O_DIRECT, for both 16-bit
/// types and NaN/inf/subnormal values, the batches are the same rows in the same order as the
/// stored batches widened afterwards, bit for bit.
#[test]
fn upcast_while_gathering_equals_widening_the_stored_batches() {
    let n = 12u64;
    for dtype in [Dtype::BF16, Dtype::F16] {
        let tmp = tempfile::tempdir().unwrap();
        let data = hard_acts(n);
        let dir = write(tmp.path(), n, dtype, &data, WriterOptions::default());
        for order in [Order::Sequential, Order::Block, Order::Exact] {
            for direct_io in [false, true] {
                let batches = |upcast: bool| {
                    let mut opts = LoaderOptions::new(LayerSel::Value(7));
                    opts.order = order;
                    opts.seed = 3;
                    opts.batch_size = 5;
                    opts.threads = 2;
                    opts.direct_io = direct_io;
                    opts.upcast = upcast;
                    let loader = Loader::new(&dir, opts).unwrap();
                    loader
                        .iter()
                        .unwrap()
                        .map(|b| {
                            let b = b.unwrap();
                            assert_eq!(b.dtype, if upcast { Dtype::F32 } else { dtype });
                            assert_eq!(b.act.len(), b.n * 4 * b.dtype.size());
                            let bits: Vec<u32> = precision::decoded(b.dtype, &b.act[..])
                                .iter()
                                .map(|x| x.to_bits())
                                .collect();
                            (b.example_idx, b.token_idx, bits)
                        })
                        .collect::<Vec<_>>()
                };
                let (stored, wide) = (batches(false), batches(true));
                assert_eq!(stored.len(), (n * 3).div_ceil(5) as usize);
                assert_eq!(stored, wide, "{dtype} {order:?} direct_io={direct_io}");
            }
        }
    }
}
