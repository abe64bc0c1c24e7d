//! EAGLE-3 offline cache: the reference's byte vectors, index maths, shard-set rules, malformed
//! files, top-k, resume, version switching, the loader's sampler and deep validation
//! (eagle3.md §13).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use safetensors::SafeTensorError;
use shardkit::eagle3::{
    self, Batch, BatchField, Cache, Loader, LoaderOptions, Writer, WriterOptions,
};
use shardkit::json::{self, Value};
use shardkit::Error;

fn config(n: u64, s: u64, seq: u64, aux: u64, vd: u64, dtype: &str, topk: Option<u64>) -> Value {
    let selected: Vec<String> = (0..vd).map(|j| ((j * 7 + 3) % 1000).to_string()).collect();
    let mut text = format!(
        r#"{{"target_model": "org/Modèl-1B", "target_vocab_size": 1000, "draft_vocab_size": {vd},
        "seq_length": {seq}, "dtype": "{dtype}", "num_samples": {n}, "shard_size": {s},
        "aux_hidden_dim": {aux}, "aux_layer_ids": [1, 3, 4], "selected_token_ids": [{}],
        "input_data": "data.jsonl", "split": null, "shuffle_seed": 42"#,
        selected.join(", ")
    );
    if let Some(k) = topk {
        text.push_str(&format!(r#", "target_probs_topk": {k}"#));
    }
    text.push('}');
    json::parse(text.as_bytes()).unwrap()
}

/// Deterministic bytes for sample `i` of every stored field (valid: masks 0/1, position_mask
/// inside loss_mask, probabilities summing to 1, top-k indices in range).
fn sample(w_specs: &[eagle3::FieldSpec], m: &eagle3::Manifest, i: u64) -> Vec<(String, Vec<u8>)> {
    let s = m.seq_length as usize;
    let mut out = Vec::new();
    for spec in w_specs {
        let elems: usize = spec.row.iter().product();
        let bytes: Vec<u8> = match spec.name {
            "input_ids" => (0..s)
                .flat_map(|p| ((i as i64 * 31 + p as i64) % 1000).to_le_bytes())
                .collect(),
            "attention_mask" => (0..s).flat_map(|_| 1i64.to_le_bytes()).collect(),
            "loss_mask" => (0..s)
                .flat_map(|p| (((i as usize + p) % 2) as i64).to_le_bytes())
                .collect(),
            "position_mask" => (0..s)
                .map(|p| u8::from((i as usize + p) % 4 == 1))
                .collect(),
            "target_probs_indices" => {
                let k = spec.row[1];
                (0..s)
                    .flat_map(|p| {
                        (0..k).map(move |j| {
                            ((p * 3 + j * 5 + i as usize)
                                % m.eagle3().unwrap().draft_vocab_size as usize)
                                as i32
                        })
                    })
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            }
            "target_probs" => {
                let vd = spec.row[1];
                floats(spec.dtype, (0..elems).map(|_| 1.0 / vd as f32))
            }
            _ => floats(
                spec.dtype,
                (0..elems).map(|e| ((i as usize * 13 + e) % 97) as f32 / 8.0),
            ),
        };
        out.push((spec.name.to_string(), bytes));
    }
    out
}

fn floats(dtype: safetensors::Dtype, values: impl Iterator<Item = f32>) -> Vec<u8> {
    match dtype {
        safetensors::Dtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
        safetensors::Dtype::BF16 => values
            .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// Writes samples `range` of a cache, in batches of `step`.
fn add(w: &mut Writer, range: std::ops::Range<u64>, step: u64) {
    let m = w.manifest().clone();
    let specs = w.fields().to_vec();
    let mut i = range.start;
    while i < range.end {
        let n = step.min(range.end - i);
        let mut fields: Vec<(String, Vec<u8>)> = specs
            .iter()
            .map(|s| (s.name.to_string(), Vec::new()))
            .collect();
        for j in i..i + n {
            for (f, (_, b)) in fields.iter_mut().zip(sample(&specs, &m, j)) {
                f.1.extend(b);
            }
        }
        let refs: Vec<(&str, &[u8])> = fields
            .iter()
            .map(|(n, b)| (n.as_str(), b.as_slice()))
            .collect();
        w.add(n, &refs).unwrap();
        i += n;
    }
}

/// Writes a cache; returns the tensors each shard stores.
fn write_cache(dir: &Path, cfg: &Value, version: u8, step: u64) -> Vec<eagle3::FieldSpec> {
    let mut w = Writer::create(
        dir,
        cfg,
        WriterOptions {
            version,
            resume: false,
        },
    )
    .unwrap();
    let n = w.manifest().num_samples;
    add(&mut w, 0..n, step);
    let specs = w.fields().to_vec();
    w.finish().unwrap();
    specs
}

/// Field `name` of a batch, with its bytes.
fn field<'a>(b: &'a Batch, name: &str) -> Option<(&'a BatchField, &'a [u8])> {
    let f = b.layout.iter().find(|f| f.name == name)?;
    Some((f, b.data.field(f)))
}

fn files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    files(dir)
        .into_iter()
        .map(|f| (f.clone(), std::fs::read(dir.join(&f)).unwrap()))
        .collect()
}

#[test]
fn index_maths_and_the_shard_set() {
    let tmp = tempfile::tempdir().unwrap();
    for (n, s, shards) in [(5u64, 2u64, 3usize), (4, 2, 2), (0, 2, 0)] {
        let dir = tmp.path().join(format!("c{n}"));
        write_cache(&dir, &config(n, s, 3, 6, 4, "fp32", None), 1, 3);
        let names = files(&dir);
        assert_eq!(
            names.iter().filter(|f| f.starts_with("shard-")).count(),
            shards,
            "N={n}"
        );
        let c = Cache::open(&dir).unwrap();
        assert_eq!(c.manifest().num_samples, n);
        if n == 5 {
            let it = c.item(4).unwrap();
            assert_eq!((it.shard, it.row), (2, 0), "item 4 = shard 2 row 0");
            assert_eq!(c.item(-1).unwrap().index, 4);
            for bad in [5i64, -6] {
                assert!(
                    matches!(c.item(bad), Err(Error::OutOfRange { .. })),
                    "{bad}"
                );
            }
        }
    }
    // {0, 2} and {0, 1, 2, 3} are rejected for N=5, s=2.
    let dir = tmp.path().join("c5");
    let keep = std::fs::read(dir.join("shard-000001.safetensors")).unwrap();
    std::fs::remove_file(dir.join("shard-000001.safetensors")).unwrap();
    let err = Cache::open(&dir).unwrap_err().to_string();
    assert!(err.contains("missing shard-000001.safetensors"), "{err}");
    std::fs::write(dir.join("shard-000001.safetensors"), &keep).unwrap();
    std::fs::write(dir.join("shard-000003.safetensors"), &keep).unwrap();
    let err = Cache::open(&dir).unwrap_err().to_string();
    assert!(err.contains("unexpected shard-000003.safetensors"), "{err}");
    std::fs::remove_file(dir.join("shard-000003.safetensors")).unwrap();
    // Leftovers never count: temporaries and near-miss names.
    for junk in [
        "shard-000001.safetensors.tmp",
        ".tmpAbC123",
        "shard-00001.safetensors",
        "shard-0000001.safetensors",
    ] {
        std::fs::write(dir.join(junk), b"x").unwrap();
    }
    assert_eq!(Cache::open(&dir).unwrap().manifest().num_samples, 5);
    // A prefix is a writer that has not finished: the missing samples are named.
    std::fs::remove_file(dir.join("shard-000002.safetensors")).unwrap();
    let err = Cache::open(&dir).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Incomplete {
                present: 4,
                total: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("sample 4 is missing (shard shard-000002.safetensors absent)"),
        "{err}"
    );
}

/// Every malformed input of eagle3.md §13 is a typed safetensors error (never a panic).
#[test]
fn malformed_shards_are_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    write_cache(&dir, &config(2, 2, 3, 6, 4, "fp32", None), 1, 2);
    let path = dir.join("shard-000000.safetensors");
    let good = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(good[8..8 + n].to_vec()).unwrap();
    let with_header = |h: &str| {
        let mut h = h.to_string();
        while !h.len().is_multiple_of(8) {
            h.push(' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h.as_bytes());
        out.extend(&good[8 + n..]);
        out
    };
    let mut too_large = good.clone();
    too_large[..8].copy_from_slice(&200_000_000u64.to_le_bytes());
    let mut past_eof = good.clone();
    past_eof[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    let mut not_utf8 = good.clone();
    not_utf8[10] = 0xff;
    type Kind = fn(&SafeTensorError) -> bool;
    let cases: Vec<(&str, Vec<u8>, Kind)> = vec![
        ("header too large", too_large, |e| {
            matches!(e, SafeTensorError::HeaderTooLarge)
        }),
        ("trailing byte", [&good[..], &[0]].concat(), |e| {
            matches!(e, SafeTensorError::MetadataIncompleteBuffer)
        }),
        (
            "overlapping offsets",
            with_header(&header.replace("[48,96]", "[40,96]")),
            |e| matches!(e, SafeTensorError::InvalidOffset(_)),
        ),
        (
            "wrong shape",
            with_header(&header.replace("\"shape\":[2,3,6]", "\"shape\":[2,3,5]")),
            |e| matches!(e, SafeTensorError::TensorInvalidInfo),
        ),
        ("non-UTF-8 header", not_utf8, |e| {
            matches!(e, SafeTensorError::InvalidHeader(_))
        }),
        (
            "invalid JSON",
            with_header(&header.replacen('{', "[", 1)),
            |e| matches!(e, SafeTensorError::InvalidHeaderDeserialization(_)),
        ),
    ];
    for (what, bytes, kind) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let c = Cache::open(&dir).unwrap(); // shards are opened lazily
        match c.item(0) {
            Err(Error::Safetensors { path: p, source }) => {
                assert_eq!(p, path, "{what}");
                assert!(kind(&source), "{what}: {source:?}");
            }
            other => panic!("{what}: {other:?}"),
        }
        let v = eagle3::validate(&dir, false);
        assert!(
            !v.is_valid()
                && v.errors()
                    .next()
                    .unwrap()
                    .message
                    .contains("not a valid safetensors file"),
            "{what}"
        );
    }
    // A file shorter than its header declares is "truncated: X of Y bytes" (a format error
    // naming the file), not the crate's words for it ("incomplete metadata, file not fully
    // covered", "header too small"), from the cache and from validate alike.
    let len = good.len();
    let truncations: Vec<(&str, Vec<u8>, String)> = vec![
        (
            "one byte short",
            good[..len - 1].to_vec(),
            format!("truncated: {} of {len} bytes", len - 1),
        ),
        (
            "cut inside the header",
            good[..8 + n / 2].to_vec(),
            format!("truncated: {} of at least {} bytes", 8 + n / 2, 8 + n),
        ),
        (
            "header past EOF",
            past_eof,
            format!("truncated: {len} of at least {} bytes", 8 + len),
        ),
        (
            "short file",
            vec![1, 2, 3],
            "truncated: 3 of at least 8 bytes".to_string(),
        ),
    ];
    for (what, bytes, words) in truncations {
        std::fs::write(&path, &bytes).unwrap();
        let c = Cache::open(&dir).unwrap();
        match c.item(0) {
            Err(e @ Error::Format { .. }) => {
                assert_eq!(e.path(), Some(path.as_path()), "{what}");
                let msg = e.to_string();
                assert!(msg.contains(&words), "{what}: {msg}");
                assert!(msg.contains("copy or write it again"), "{what}: {msg}");
            }
            other => panic!("{what}: {other:?}"),
        }
        let v = eagle3::validate(&dir, false);
        let first = v.errors().next().unwrap();
        assert!(
            !v.is_valid() && first.message.contains(&words),
            "{what}: {}",
            first.message
        );
        assert_eq!(first.file, path, "{what}");
    }
    std::fs::write(&path, &good).unwrap();
    // Valid safetensors, but not what the manifest describes: a format error naming the tensor.
    let h2 = header.replace(
        "\"shape\":[2,3,6],\"data_offsets\":[144,288]",
        "\"shape\":[2,6,3],\"data_offsets\":[144,288]",
    );
    std::fs::write(&path, with_header(&h2)).unwrap();
    let err = Cache::open(&dir).unwrap().item(0).unwrap_err().to_string();
    assert!(
        err.contains("aux_hidden_states") && err.contains("[2, 3, 6]"),
        "{err}"
    );
}

#[test]
fn topk_caches_expand_to_full_width() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let cfg = config(5, 2, 4, 6, 16, "bf16", Some(3));
    let err =
        Writer::create(&dir, &cfg, WriterOptions::default()).expect_err("top-k needs version 2");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("top")),
        "{err:?}"
    );
    let specs = write_cache(&dir, &cfg, 2, 2);
    let c = Cache::open(&dir).unwrap();
    let m = c.manifest();
    assert_eq!((m.format_version, m.topk()), (2, Some(3)));
    let names: Vec<&str> = specs.iter().map(|s| s.name).collect();
    assert!(names.contains(&"target_probs_values") && names.contains(&"target_probs_indices"));
    let item = c.item(3).unwrap();
    let fields = c.fields(&item).unwrap();
    let probs = &fields[5];
    assert_eq!(
        (probs.name, probs.shape.as_slice()),
        ("target_probs", &[4usize, 16][..])
    );
    // Rebuild by hand from the stored pair.
    let stored = sample(&specs, m, 3);
    let get = |n: &str| stored.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let (vals, idx) = (get("target_probs_values"), get("target_probs_indices"));
    let mut want = [0u8; 4 * 16 * 2];
    for p in 0..4 {
        for j in 0..3 {
            let col = i32::from_le_bytes(idx[(p * 3 + j) * 4..][..4].try_into().unwrap()) as usize;
            want[(p * 16 + col) * 2..][..2].copy_from_slice(&vals[(p * 3 + j) * 2..][..2]);
        }
    }
    assert_eq!(&probs.bytes[..], &want[..]);
    // The loader expands the same way.
    let mut o = LoaderOptions::new(2);
    (o.rank, o.world_size) = (Some(0), Some(1));
    o.set_shuffle(false);
    let l = Loader::new(Arc::new(Cache::open(&dir).unwrap()), o).unwrap();
    let b = l.read(&[3, 0]).unwrap();
    let (f, bytes) = field(&b, "target_probs").unwrap();
    assert_eq!(f.shape, [2, 4, 16]);
    assert_eq!(&bytes[..want.len()], &want[..]);
    // Over a whole epoch, with batch buffers recycled, every row equals its item (no bytes of
    // an earlier batch survive in the scattered target_probs).
    let mut o = LoaderOptions::new(2);
    (o.seed, o.rank, o.world_size) = (9, Some(0), Some(1));
    let cache = Arc::new(Cache::open(&dir).unwrap());
    let l = Loader::new(cache.clone(), o).unwrap();
    for _ in 0..2 {
        for b in l.iter() {
            let b = b.unwrap();
            let (_, bytes) = field(&b, "target_probs").unwrap();
            for (row, &i) in b.indices.iter().enumerate() {
                let item = cache.item(i as i64).unwrap();
                let want = &cache.fields(&item).unwrap()[5].bytes;
                assert_eq!(&bytes[row * want.len()..(row + 1) * want.len()], &want[..]);
            }
        }
    }
    // A top-k cache cannot become version 1.
    let err = eagle3::set_version(&dir, 1).unwrap_err().to_string();
    assert!(err.contains("top-k"), "{err}");
}

#[test]
fn resume_rules_and_byte_identical_completion() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(7, 2, 3, 6, 4, "fp16", None);
    let clean = tmp.path().join("clean");
    write_cache(&clean, &cfg, 2, 3);
    let dir = tmp.path().join("c");
    let mut w = Writer::create(
        &dir,
        &cfg,
        WriterOptions {
            version: 2,
            resume: false,
        },
    )
    .unwrap();
    add(&mut w, 0..5, 5); // shards 0 and 1 written; sample 4 buffered, then the job dies
    drop(w);
    let err = Cache::open(&dir).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Incomplete {
                present: 4,
                total: 7,
                ..
            }
        ),
        "{err}"
    );
    let before = tree(&dir);
    let mtime = std::fs::metadata(dir.join("shard-000000.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    // Without resume: refused.
    let err = Writer::create(
        &dir,
        &cfg,
        WriterOptions {
            version: 2,
            resume: false,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("already has shards"), "{err}");
    // A changed configuration: refused with the keys listed, nothing touched.
    let mut changed = cfg.clone();
    changed.set("seq_length", Value::int(4));
    changed.set("shuffle_seed", Value::int(7));
    changed.set("dtype", Value::String("bf16".into()));
    let err = Writer::create(
        &dir,
        &changed,
        WriterOptions {
            version: 2,
            resume: true,
        },
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("dtype, seq_length, shuffle_seed"),
        "{err}"
    );
    let mut reordered = cfg.clone();
    if let Some(Value::Array(ids)) = reordered.get("selected_token_ids").cloned() {
        let mut ids = ids;
        ids.swap(0, 1);
        reordered.set("selected_token_ids", Value::Array(ids));
    }
    let err = Writer::create(
        &dir,
        &reordered,
        WriterOptions {
            version: 2,
            resume: true,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("selected_token_ids"), "{err}");
    assert_eq!(tree(&dir), before);
    // Shards but no manifest: refused.
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    std::fs::copy(
        dir.join("shard-000000.safetensors"),
        bare.join("shard-000000.safetensors"),
    )
    .unwrap();
    let err = Writer::create(
        &bare,
        &cfg,
        WriterOptions {
            version: 2,
            resume: true,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("no manifest"), "{err}");
    // Not a contiguous prefix: refused.
    let gap = tmp.path().join("gap");
    std::fs::create_dir(&gap).unwrap();
    for f in ["manifest.json", "shard-000001.safetensors"] {
        std::fs::copy(dir.join(f), gap.join(f)).unwrap();
    }
    let err = Writer::create(
        &gap,
        &cfg,
        WriterOptions {
            version: 2,
            resume: true,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("contiguous prefix"), "{err}");
    // Resume: continues at sample 4; kept shards untouched; the result equals a clean run.
    std::fs::write(dir.join(".tmpAbC123"), b"junk").unwrap();
    let mut w = Writer::create(
        &dir,
        &cfg,
        WriterOptions {
            version: 2,
            resume: true,
        },
    )
    .unwrap();
    assert_eq!((w.next_sample(), w.resumed_from()), (4, Some(4)));
    add(&mut w, 4..7, 2);
    w.finish().unwrap();
    assert_eq!(
        std::fs::metadata(dir.join("shard-000000.safetensors"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime
    );
    assert_eq!(tree(&dir), tree(&clean));
    // Finishing short says where a resume would continue.
    let short = tmp.path().join("short");
    let mut w = Writer::create(&short, &cfg, WriterOptions::default()).unwrap();
    add(&mut w, 0..3, 3);
    let err = w.finish().unwrap_err();
    assert!(err.to_string().contains("continues at sample 2"), "{err}");
    let mut w = Writer::create(
        &short,
        &cfg,
        WriterOptions {
            version: 1,
            resume: true,
        },
    )
    .unwrap();
    assert!(w
        .add(8, &[])
        .unwrap_err()
        .to_string()
        .contains("exceed num_samples 7"));
}

#[test]
fn version_switching_rewrites_only_the_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    write_cache(&dir, &config(3, 2, 3, 6, 4, "bf16", None), 1, 3);
    let shards: Vec<_> = tree(&dir)
        .into_iter()
        .filter(|(n, _)| n.starts_with("shard-"))
        .collect();
    let m = eagle3::set_version(&dir, 2).unwrap();
    assert_eq!((m.format_version, m.topk()), (2, None));
    let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(text.contains("\"format_version\": 2") && text.contains("\"target_probs_topk\": 0"));
    eagle3::set_version(&dir, 1).unwrap();
    let text1 = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(text1.contains("\"format_version\": 1") && !text1.contains("topk"));
    let after: Vec<_> = tree(&dir)
        .into_iter()
        .filter(|(n, _)| n.starts_with("shard-"))
        .collect();
    assert_eq!(shards, after);
    assert!(eagle3::set_version(&dir, 3)
        .unwrap_err()
        .to_string()
        .contains("format_version 3"));
    std::fs::write(
        dir.join("manifest.json"),
        text1.replace("\"format_version\": 1", "\"format_version\": 7"),
    )
    .unwrap();
    assert!(Cache::open(&dir)
        .unwrap_err()
        .to_string()
        .contains("format_version 7"));
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    assert!(matches!(Cache::open(&dir), Err(Error::NotFound { .. })));
}

#[test]
fn the_sampler_follows_distributed_sampler_and_batches_match_items() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    write_cache(&dir, &config(10, 3, 3, 6, 4, "fp32", None), 1, 4);
    let cache = Arc::new(Cache::open(&dir).unwrap());
    let opts = |rank, world, shuffle, drop_last, epoch| {
        let mut o = LoaderOptions::new(3);
        (o.rank, o.world_size, o.drop_last, o.epoch) = (Some(rank), Some(world), drop_last, epoch);
        o.set_shuffle(shuffle);
        o
    };
    // Not shuffled, 3 ranks: 10 samples padded to 12 by wrapping around ([0, 1] again).
    let mut all = Vec::new();
    for r in 0..3 {
        let l = Loader::new(cache.clone(), opts(r, 3, false, false, 0)).unwrap();
        let ix = l.indices();
        assert_eq!(ix.len(), 4);
        assert_eq!(l.len(), 2, "batches of 3 and 1");
        all.extend(ix);
    }
    all.sort_unstable();
    assert_eq!(all, [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    // drop_last: 3 per rank, all distinct, full batches only.
    let mut kept = Vec::new();
    for r in 0..3 {
        let l = Loader::new(cache.clone(), opts(r, 3, true, true, 0)).unwrap();
        assert_eq!(l.indices().len(), 3);
        assert_eq!(l.len(), 1);
        kept.extend(l.indices());
    }
    kept.sort_unstable();
    kept.dedup();
    assert_eq!(kept.len(), 9);
    // Shuffling: deterministic, a different order per epoch.
    let e0 = Loader::new(cache.clone(), opts(0, 1, true, false, 0))
        .unwrap()
        .indices();
    assert_eq!(
        e0,
        Loader::new(cache.clone(), opts(0, 1, true, false, 0))
            .unwrap()
            .indices()
    );
    let e1 = Loader::new(cache.clone(), opts(0, 1, true, false, 1))
        .unwrap()
        .indices();
    assert_ne!(e0, e1);
    let mut sorted = e1.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..10).collect::<Vec<u64>>());
    // Batches hold exactly the items' bytes, in order; resume from a state.
    let mut l = Loader::new(cache.clone(), opts(0, 1, true, false, 3)).unwrap();
    let batches: Vec<_> = l.iter().map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 4);
    let flat: Vec<u64> = batches.iter().flat_map(|b| b.indices.clone()).collect();
    assert_eq!(flat, l.indices());
    for b in &batches {
        for (row, &i) in b.indices.iter().enumerate() {
            let item = cache.item(i as i64).unwrap();
            for f in cache.fields(&item).unwrap() {
                let (bf, bytes) = field(b, f.name).unwrap();
                let rb = bytes.len() / bf.shape[0];
                assert_eq!(
                    &bytes[row * rb..(row + 1) * rb],
                    &f.bytes[..],
                    "{} of sample {i}",
                    f.name
                );
            }
        }
    }
    l.advance_to(2);
    let st = l.state();
    assert_eq!((st.epoch, st.batch), (3, 2));
    let mut fresh = Loader::new(cache.clone(), opts(0, 1, true, false, 0)).unwrap();
    fresh.load_state(st.clone()).unwrap();
    let rest: Vec<_> = fresh.iter().map(|b| b.unwrap().indices).collect();
    assert_eq!(
        rest,
        [batches[2].indices.clone(), batches[3].indices.clone()]
    );
    let mut other = Loader::new(cache, opts(0, 2, true, false, 0)).unwrap();
    let err = other.load_state(st).unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("world")),
        "another world size: {err:?}"
    );
}

#[test]
fn deep_validation_finds_bad_values() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    write_cache(&dir, &config(2, 2, 3, 6, 4, "fp32", None), 1, 2);
    assert!(
        eagle3::validate(&dir, true).is_valid(),
        "{:?}",
        eagle3::validate(&dir, true)
    );
    let v = eagle3::validate(&dir, false);
    assert!(v
        .notes()
        .any(|n| n.to_string().contains("target_embeddings")));
    // Corrupt values in place (a copy of the shard with edited data bytes).
    let path = dir.join("shard-000000.safetensors");
    let good = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let data = 8 + n;
    let mut bad = good.clone();
    // attention_mask [0, 48): a 2; loss_mask [96, 144): zeros under position_mask.
    bad[data..data + 8].copy_from_slice(&2i64.to_le_bytes());
    for x in &mut bad[data + 96..data + 144] {
        *x = 0;
    }
    // aux_hidden_states [144, 288): a NaN; target_probs [288, 384): a row summing to 2.
    bad[data + 144..data + 148].copy_from_slice(&f32::NAN.to_le_bytes());
    bad[data + 288..data + 292].copy_from_slice(&1.25f32.to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    let v = eagle3::validate(&dir, true);
    let all = v
        .errors()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    for words in [
        "attention_mask` holds 1 values other than 0 and 1",
        "NaN",
        "position_mask` is set at",
        "rows do not sum to 1",
    ] {
        assert!(all.contains(words), "{words}: {all}");
    }
    assert!(
        eagle3::validate(&dir, false).is_valid(),
        "cheap validation reads no values"
    );
}
