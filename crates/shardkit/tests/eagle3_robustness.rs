//! Hostile EAGLE-3 caches give errors, never panics: manifests with odd or extreme values,
//! and shard files truncated at every length, with bytes flipped, or replaced by garbage, go
//! through opening, item access, the loader, validation (cheap and deep), inspect, resume and
//! version switching. Every error is of a kind that names a file, and names one; the
//! checksums sidecar points at exactly the damaged shard, and a verifying loader refuses it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use shardkit::checksum::{self, Verdict};
use shardkit::eagle3::{
    self, synthetic_sample, Cache, Loader, LoaderOptions, Writer, WriterOptions,
};
use shardkit::json::{self, Value};
use shardkit::Error;

fn config(n: u64, s: u64, seq: u64, vd: u64, dtype: &str, topk: Option<u64>) -> Value {
    let ids: Vec<String> = (0..vd).map(|j| j.to_string()).collect();
    let mut t = format!(
        r#"{{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": {vd},
        "seq_length": {seq}, "dtype": "{dtype}", "num_samples": {n}, "shard_size": {s},
        "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3], "selected_token_ids": [{}]"#,
        ids.join(",")
    );
    if let Some(k) = topk {
        t.push_str(&format!(r#", "target_probs_topk": {k}"#));
    }
    t.push('}');
    json::parse(t.as_bytes()).unwrap()
}

fn make(dir: &Path, cfg: &Value, version: u8) {
    let mut w = Writer::create(
        dir,
        cfg,
        WriterOptions {
            version,
            resume: false,
        },
    )
    .unwrap();
    let m = w.manifest().clone();
    for i in 0..m.num_samples {
        let f = synthetic_sample(&m, i);
        let refs: Vec<(&str, &[u8])> = f.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
    w.finish().unwrap();
}

/// Everything a user can do with a cache; must return normally whatever the files hold.
/// An error from a damaged cache: a kind that carries a path, naming a file of `dir`.
#[track_caller]
fn assert_names_file(e: &Error, dir: &Path) {
    assert!(
        matches!(
            e,
            Error::Format { .. }
                | Error::Safetensors { .. }
                | Error::NotFound { .. }
                | Error::Io { .. }
                | Error::Incomplete { .. }
        ),
        "unexpected error kind: {e:?}"
    );
    assert!(
        e.to_string().contains(&dir.display().to_string()),
        "does not name the file: {e}"
    );
}

fn exercise(dir: &Path) {
    let _ = eagle3::inspect(dir);
    for deep in [false, true] {
        for e in eagle3::validate(dir, deep).errors() {
            assert!(
                e.file.starts_with(dir),
                "validate error names no file of the cache: {e}"
            );
        }
    }
    if let Err(e) = Cache::open(dir) {
        assert_names_file(&e, dir);
    }
    if let Ok(c) = Cache::open(dir) {
        let n = c.manifest().num_samples as i64;
        for i in [0, 1, n - 1, -1, n, -n - 1] {
            if let Ok(item) = c.item(i) {
                let _ = c.fields(&item);
            }
        }
        let _ = c.target_embeddings();
        let c = Arc::new(c);
        let mut o = LoaderOptions::new(2);
        (o.rank, o.world_size) = (Some(0), Some(1));
        if let Ok(l) = Loader::new(c, o) {
            for b in l.iter().take(4) {
                let _ = b;
            }
        }
    }
    let _ = eagle3::set_version(dir, 2);
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn odd_manifests_are_errors_or_valid_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    make(&good, &config(5, 2, 4, 8, "fp16", None), 1);
    let text = std::fs::read_to_string(good.join("manifest.json")).unwrap();
    let edits: Vec<(&str, &str)> = vec![
        ("\"num_samples\": 5", "\"num_samples\": 0"),
        (
            "\"num_samples\": 5",
            "\"num_samples\": 18446744073709551615",
        ),
        ("\"num_samples\": 5", "\"num_samples\": -1"),
        ("\"num_samples\": 5", "\"num_samples\": 5.5"),
        ("\"shard_size\": 2", "\"shard_size\": 0"),
        ("\"shard_size\": 2", "\"shard_size\": 1"),
        ("\"seq_length\": 4", "\"seq_length\": 0"),
        ("\"seq_length\": 4", "\"seq_length\": 4294967296"),
        ("\"aux_hidden_dim\": 6", "\"aux_hidden_dim\": 0"),
        ("\"draft_vocab_size\": 8", "\"draft_vocab_size\": 0"),
        ("\"dtype\": \"fp16\"", "\"dtype\": \"fp64\""),
        ("\"dtype\": \"fp16\"", "\"dtype\": 3"),
        ("\"format_version\": 1", "\"format_version\": 2"),
        ("\"format_version\": 1", "\"format_version\": null"),
        ("\"selected_token_ids\": [", "\"selected_token_ids\": [-3,"),
        (
            "\"selected_token_ids\": [",
            "\"selected_token_ids\": {\"a\": [",
        ),
        ("{", "["),
        ("{", ""),
    ];
    for (i, (from, to)) in edits.into_iter().enumerate() {
        let dir = tmp.path().join(format!("m{i}"));
        copy(&good, &dir);
        std::fs::write(dir.join("manifest.json"), text.replacen(from, to, 1)).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| exercise(&dir)));
        assert!(r.is_ok(), "manifest edit {from:?} -> {to:?} panicked");
    }
    // Top-k with extreme k, and writers given odd configurations.
    for (k, vd) in [(1u64, 2u64), (7, 8)] {
        let dir = tmp.path().join(format!("k{k}"));
        make(&dir, &config(3, 2, 2, vd, "bf16", Some(k)), 2);
        assert!(catch_unwind(AssertUnwindSafe(|| exercise(&dir))).is_ok());
    }
    for cfg in [
        config(0, 1, 0, 1, "fp32", None),
        config(3, 5, 1, 1, "bf16", None),
    ] {
        let dir = tmp.path().join("w");
        let _ = std::fs::remove_dir_all(&dir);
        let r = catch_unwind(AssertUnwindSafe(|| {
            if let Ok(mut w) = Writer::create(&dir, &cfg, WriterOptions::default()) {
                let _ = w.add(1, &[]);
                let _ = w.write_target_embeddings(&[0; 8], 1, 2);
                let _ = w.finish();
            }
            exercise(&dir);
        }));
        assert!(r.is_ok());
    }
}

#[test]
fn damaged_shards_are_errors_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, cfg, version) in [
        ("lossless", config(5, 2, 3, 8, "bf16", None), 1u8),
        ("topk", config(5, 2, 3, 8, "fp32", Some(3)), 2),
    ] {
        let good = tmp.path().join(name);
        make(&good, &cfg, version);
        let shard = good.join("shard-000001.safetensors");
        let bytes = std::fs::read(&shard).unwrap();
        let mut variants: Vec<Vec<u8>> = Vec::new();
        for cut in (0..bytes.len()).step_by((bytes.len() / 97).max(1)) {
            variants.push(bytes[..cut].to_vec());
        }
        let mut x = 0x1234_5678u64;
        for _ in 0..60 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut v = bytes.clone();
            let at = (x >> 33) as usize % v.len();
            v[at] ^= 1 << ((x >> 20) % 8);
            variants.push(v);
        }
        variants.push(vec![0xff; bytes.len()]);
        for (i, v) in variants.into_iter().enumerate() {
            let dir = tmp.path().join(format!("{name}-{i}"));
            copy(&good, &dir);
            let shard = dir.join("shard-000001.safetensors");
            std::fs::write(&shard, &v).unwrap();
            // Every variant differs from what was written: the sidecar names exactly this
            // shard, and a verifying loader stops with an error naming it.
            match checksum::verify(&dir).unwrap() {
                Verdict::Damaged(d) => assert!(d.iter().all(|x| x.file == shard), "{d:?}"),
                other => panic!("{name} variant {i}: damage not found ({other:?})"),
            }
            if let Ok(c) = Cache::open(&dir) {
                let mut o = LoaderOptions::new(2);
                (o.rank, o.world_size, o.verify) = (Some(0), Some(1), true);
                let e = match Loader::new(Arc::new(c), o) {
                    Err(e) => e,
                    Ok(l) => l
                        .iter()
                        .find_map(|b| b.err())
                        .unwrap_or_else(|| panic!("{name} variant {i}: served damaged data")),
                };
                assert_names_file(&e, &dir);
                assert!(e.to_string().contains("shard-000001"), "{e}");
            }
            let r = catch_unwind(AssertUnwindSafe(|| exercise(&dir)));
            assert!(r.is_ok(), "{name} variant {i} ({} bytes) panicked", v.len());
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
