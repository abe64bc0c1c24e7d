//! DSpark caches (NeMo's `dspark_cache.py`): the manifest's bytes and `complete` marker, the
//! identity check of a rerun, the target weights, readers refusing an unfinished cache, part
//! writers finishing a directory NeMo's distributed producer began, deep validation, and the
//! same write in an object store. The byte-for-byte comparison with a restatement of NeMo's
//! writer is in tests/interop/test_dspark_interop.py.

mod common;

use common::stores::store;
use common::{rank, tree};

use std::path::Path;

use shardkit::dspark::{
    self, synthetic_sample, Cache, Loader, LoaderOptions, PartOptions, PartWriter, Schema,
    WeightTable, Writer, WriterOptions,
};
use shardkit::json::{self, Value};
use shardkit::Error;

const N: u64 = 7;

/// NeMo's `build_cache_manifest` for a small target: hidden 4, layers [1, 3], bf16, shards of 3.
fn config() -> Value {
    json::parse(
        r#"{"target_model": "org/Modèl-1B", "target_model_type": "qwen3",
            "target_vocab_size": 50, "hidden_size": 4, "num_hidden_layers": 6,
            "seq_length": 5, "dtype": "bf16", "num_samples": 7, "shard_size": 3,
            "target_hidden_dim": 8, "target_last_hidden_dim": 4, "target_layer_ids": [1, 3],
            "train_data_path": "data.jsonl", "train_split": null, "shuffle_seed": 42,
            "mask_reasoning_content": false,
            "chat_template_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}"#
            .as_bytes(),
    )
    .unwrap()
}

fn with(key: &str, v: Value) -> Value {
    let mut c = config();
    c.set(key, v);
    c
}

/// bf16 bytes of `n` values.
fn bf16s(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| half::bf16::from_f32((i % 13) as f32 / 8.0).to_le_bytes())
        .collect()
}

fn tables(data: &[u8]) -> [WeightTable<'_>; 2] {
    [
        WeightTable {
            name: "embed_tokens.weight",
            rows: 50,
            cols: 4,
            data,
        },
        WeightTable {
            name: "lm_head.weight",
            rows: 50,
            cols: 4,
            data,
        },
    ]
}

/// Adds samples `from..to` (synthetic, valid) to `w`.
fn add(w: &mut Writer, from: u64, to: u64) {
    for i in from..to {
        let f = synthetic_sample(w.manifest(), i);
        let refs: Vec<(&str, &[u8])> = f.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
}

/// One whole cache written by one writer, with its target weights.
fn single(dir: &Path) {
    let mut w = Writer::create(dir, &config(), WriterOptions::default()).unwrap();
    w.write_target_weights(&tables(&bf16s(200))).unwrap();
    add(&mut w, 0, N);
    w.finish().unwrap();
}

fn manifest_text(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("manifest.json")).unwrap()
}

#[test]
fn the_manifest_goes_down_incomplete_first_and_is_marked_complete_last() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let mut w = Writer::create(&dir, &config(), WriterOptions::default()).unwrap();
    assert_eq!(w.manifest().schema(), Schema::DSpark);
    let text = manifest_text(&dir);
    // json.dump(indent=2, sort_keys=True): ASCII-escaped, keys sorted, no final newline.
    assert!(
        text.starts_with("{\n  \"chat_template_sha256\": "),
        "{text}"
    );
    assert!(text.contains("\n  \"complete\": false,\n"), "{text}");
    assert!(text.contains("\"org/Mod\\u00e8l-1B\""), "{text}");
    assert!(text.contains("\n  \"format_version\": 1,\n"), "{text}");
    assert!(text.ends_with("\"train_split\": null\n}"), "{text}");
    add(&mut w, 0, 4);
    // Killed here: the shards written are whole, the manifest says incomplete; readers refuse.
    drop(w);
    let e = Cache::open(&dir).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e}");
    let v = dspark::validate(&dir, false);
    assert!(
        v.errors()
            .any(|f| f.message.contains("\"complete\": false")),
        "{:?}",
        v.errors().collect::<Vec<_>>()
    );
    // Resumed, finished: only the marker changed in the manifest.
    let opts = WriterOptions {
        resume: true,
        ..WriterOptions::default()
    };
    let mut w = Writer::create(&dir, &config(), opts).unwrap();
    assert_eq!(w.next_sample(), 3);
    w.write_target_weights(&tables(&bf16s(200))).unwrap();
    add(&mut w, 3, N);
    w.finish().unwrap();
    assert_eq!(
        manifest_text(&dir),
        text.replace("\"complete\": false", "\"complete\": true")
    );
    let one = tmp.path().join("one");
    single(&one);
    common::assert_same_tree(&dir, &one, "resumed vs uninterrupted");
    let v = dspark::validate(&dir, true);
    assert!(v.is_valid(), "{:?}", v.errors().collect::<Vec<_>>());
    let info = dspark::inspect(&dir).unwrap();
    assert_eq!(info.get("schema").and_then(Value::as_str), Some("dspark"));
    assert_eq!(info.get("complete"), Some(&Value::Bool(true)));
    assert_eq!(
        info.get("manifest_variant").and_then(Value::as_str),
        Some("v1 with the complete marker")
    );
    let identity = info.get("input_identity").unwrap();
    assert_eq!(
        identity.get("shuffle_seed").and_then(Value::as_i64),
        Some(42)
    );
}

#[test]
fn items_loader_and_weights_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    single(&dir);
    let cache = std::sync::Arc::new(Cache::open(&dir).unwrap());
    let m = cache.manifest().clone();
    for i in 0..N {
        let item = cache.item(i as i64).unwrap();
        let fields = cache.fields(&item).unwrap();
        let names: Vec<&str> = fields.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            [
                "input_ids",
                "loss_mask",
                "target_hidden_states",
                "target_last_hidden_states"
            ]
        );
        for (f, (name, want)) in fields.iter().zip(synthetic_sample(&m, i)) {
            assert_eq!(f.name, name);
            assert!(f.bytes.as_ref() == want.as_slice(), "sample {i} {name}");
        }
        assert_eq!(fields[2].shape, [5, 8]);
        assert_eq!(fields[3].shape, [5, 4]);
    }
    let w = cache.target_weights().unwrap();
    let names: Vec<&str> = w.tables().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["embed_tokens.weight", "lm_head.weight"]);
    assert_eq!((w.tables()[1].rows, w.tables()[1].cols), (50, 4));
    assert_eq!(w.tables()[1].dtype, safetensors::Dtype::BF16);
    assert!(w.table("lm_head.weight").unwrap() == bf16s(200).as_slice());
    // Shuffled batches over 2 ranks: every sample served, the state says "dspark".
    let mut seen = Vec::new();
    for r in 0..2 {
        let mut o = LoaderOptions::new(2);
        o.seed = 3;
        o.rank = Some(r);
        o.world_size = Some(2);
        let loader = Loader::new(cache.clone(), o).unwrap();
        assert_eq!(loader.state().format, "dspark");
        for b in loader.iter() {
            let b = b.unwrap();
            seen.extend(b.indices.iter().copied());
        }
    }
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, (0..N).collect::<Vec<_>>());
}

#[test]
fn a_rerun_of_another_configuration_is_refused_naming_nemos_keys_and_nothing_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    single(&dir);
    let before = tree(&dir);
    let other = {
        let mut c = with("shuffle_seed", Value::int(7));
        c.set("train_split", Value::String("train".into()));
        c
    };
    for resume in [false, true] {
        let opts = WriterOptions {
            resume,
            ..WriterOptions::default()
        };
        let e = Writer::create(&dir, &other, opts).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Exists { .. }), "{text}");
        assert!(
            text.contains("mismatched fields: shuffle_seed, train_split"),
            "{text}"
        );
    }
    let e = PartWriter::create(&dir, &other, PartOptions::default(), N, rank(0, 2)).unwrap_err();
    assert!(e.to_string().contains("shuffle_seed, train_split"), "{e}");
    // A manifest alone (the producer killed before its first shard) is refused as well.
    let fresh = tmp.path().join("fresh");
    drop(Writer::create(&fresh, &config(), WriterOptions::default()).unwrap());
    let e = Writer::create(&fresh, &other, WriterOptions::default()).unwrap_err();
    assert!(e.to_string().contains("shuffle_seed, train_split"), "{e}");
    assert_eq!(tree(&dir), before);
}

#[test]
fn writer_inputs_and_manifests_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    // build_cache_manifest's sizes.
    let e = Writer::create(
        &dir,
        &with("target_hidden_dim", Value::int(12)),
        Default::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("hidden_size × len(target_layer_ids) = 8"),
        "{e}"
    );
    let mut missing = config();
    if let Value::Object(m) = &mut missing {
        m.retain(|(k, _)| k != "chat_template_sha256");
    }
    let e = Writer::create(&dir, &missing, Default::default()).unwrap_err();
    assert!(
        e.to_string().contains("missing `chat_template_sha256`"),
        "{e}"
    );
    let v2 = WriterOptions {
        version: 2,
        ..WriterOptions::default()
    };
    let e = Writer::create(&dir, &config(), v2).unwrap_err();
    assert!(e.to_string().contains("DSpark caches have 1"), "{e}");
    assert!(
        !dir.exists(),
        "nothing is written for a refused configuration"
    );
    let mut w = Writer::create(&dir, &config(), WriterOptions::default()).unwrap();
    // Weights: both tables, as wide as hidden_size, in the cache dtype.
    let e = w
        .write_target_weights(&tables(&bf16s(200))[..1])
        .unwrap_err();
    assert!(e.to_string().contains("DSpark caches store exactly"), "{e}");
    let e = w.write_target_weights(&tables(&bf16s(100))).unwrap_err();
    assert!(
        e.to_string()
            .contains("200 bytes given; 50 x 4 bfloat16 need 400"),
        "{e}"
    );
    let narrow = bf16s(150);
    let mut t = tables(&narrow);
    t[0].cols = 3;
    t[1].cols = 3;
    let e = w.write_target_weights(&t).unwrap_err();
    assert!(e.to_string().contains("target_last_hidden_dim 4"), "{e}");
    // A loss_mask value other than 0 or 1 is refused, naming the sample.
    let mut f = synthetic_sample(w.manifest(), 0);
    f[1].1[..8].copy_from_slice(&2i64.to_le_bytes());
    let refs: Vec<(&str, &[u8])> = f.iter().map(|(n, b)| (*n, b.as_slice())).collect();
    let e = w.add(1, &refs).unwrap_err();
    assert!(e.to_string().contains("loss_mask"), "{e}");
    assert_eq!(w.next_sample(), 0);
}

#[test]
fn deep_validation_finds_non_finite_hidden_states_in_a_foreign_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    single(&dir);
    // Another tool rewrote shard 1 with a NaN in target_last_hidden_states (sample 3).
    let path = dir.join("shard-000001.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (n, meta) = dspark::read_header(&bytes, &path).unwrap();
    let info = meta.info("target_last_hidden_states").unwrap();
    let at = 8 + n + info.data_offsets.0 + 6;
    let mut bad = bytes.clone();
    bad[at..at + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    let v = dspark::validate(&dir, true);
    let errors: Vec<String> = v.errors().map(|e| e.message.clone()).collect();
    assert!(
        errors
            .iter()
            .any(|m| m.contains("`target_last_hidden_states` holds 1 NaN")
                && m.contains("the first at sample 3")),
        "{errors:?}"
    );
    // A weights file holding a table of another width is a format error naming the file.
    std::fs::write(&path, &bytes).unwrap();
    let one = [WeightTable {
        name: "embed_tokens.weight",
        rows: 2,
        cols: 2,
        data: &bf16s(4),
    }];
    let mut st = Vec::new();
    for t in one.iter().chain(&[WeightTable {
        name: "lm_head.weight",
        ..one[0]
    }]) {
        st.push((
            t.name,
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![2, 2], t.data)
                .unwrap(),
        ));
    }
    safetensors::serialize_to_file(st, None, &dir.join("target_weights.safetensors")).unwrap();
    let v = dspark::validate(&dir, false);
    assert!(
        v.errors().any(|e| e
            .message
            .contains("has 2 columns; the hidden size is target_last_hidden_dim 4")),
        "{:?}",
        v.errors().collect::<Vec<_>>()
    );
}

/// What NeMo's distributed producer leaves when killed: its manifest (`complete: false`), the
/// target weights, some ranks' shards, a torn temporary.
fn nemo_interrupted(dir: &Path, shards: &[u64]) {
    let mut w = Writer::create(dir, &config(), WriterOptions::default()).unwrap();
    w.write_target_weights(&tables(&bf16s(200))).unwrap();
    add(&mut w, 0, N);
    drop(w);
    for k in 0..3 {
        if !shards.contains(&k) {
            std::fs::remove_file(dir.join(format!("shard-{k:06}.safetensors"))).unwrap();
        }
    }
    std::fs::write(dir.join("shard-000001.safetensors.tmp"), b"torn").unwrap();
    std::fs::remove_file(dir.join(".shardkit.lock")).ok();
}

#[test]
fn part_writers_finish_a_cache_nemos_distributed_producer_began() {
    let tmp = tempfile::tempdir().unwrap();
    let want = tmp.path().join("one");
    single(&want);
    for world in [1u64, 2, 3] {
        let dir = tmp.path().join(format!("w{world}"));
        nemo_interrupted(&dir, &[0, 2]);
        assert!(!dspark::status(&dir).unwrap().committed);
        let opts = PartOptions {
            target_embeddings: true,
            ..PartOptions::default()
        };
        let mut writers: Vec<PartWriter> = (0..world)
            .map(|r| PartWriter::create(&dir, &config(), opts.clone(), N, rank(r, world)).unwrap())
            .collect();
        writers[0]
            .write_target_weights(&tables(&bf16s(200)))
            .unwrap();
        let mut committed = false;
        for mut w in writers.drain(..) {
            let m = w.manifest().clone();
            for range in w.pending().to_vec() {
                for i in range {
                    let f = synthetic_sample(&m, i);
                    let refs: Vec<(&str, &[u8])> =
                        f.iter().map(|(n, b)| (*n, b.as_slice())).collect();
                    w.add(1, &refs).unwrap();
                }
            }
            committed |= w.finish().unwrap().committed;
        }
        assert!(committed, "world {world}");
        let got = tree(&dir);
        let names: Vec<&String> = got.keys().collect();
        assert!(
            !names.iter().any(|n| n.ends_with(".tmp")),
            "world {world}: {names:?}"
        );
        for (name, bytes) in tree(&want) {
            if name.starts_with('.') {
                continue;
            }
            assert!(
                got.get(&name) == Some(&bytes),
                "world {world}: {name} differs from one writer's: {} vs {}",
                String::from_utf8_lossy(got.get(&name).map_or(&[][..], |v| &v[..])),
                String::from_utf8_lossy(&bytes)
            );
        }
        assert_eq!(Cache::open(&dir).unwrap().manifest().complete, Some(true));
    }
}

#[test]
fn a_cache_in_a_store_is_committed_with_the_marker_and_read_back() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = store(&tmp.path().join("staging"));
    let url = "s3://bucket/d";
    let mut w = Writer::create(url, &config(), WriterOptions::default()).unwrap();
    w.write_target_weights(&tables(&bf16s(200))).unwrap();
    add(&mut w, 0, N);
    w.finish().unwrap();
    let objects = common::stores::objects(&mem, "d");
    let one = tmp.path().join("one");
    single(&one);
    let local = tree(&one);
    for name in [
        "manifest.json",
        "target_weights.safetensors",
        "shard-000002.safetensors",
    ] {
        assert!(objects.get(name) == local.get(name), "{name}");
    }
    let cache = Cache::open(url).unwrap();
    assert_eq!(cache.manifest().complete, Some(true));
    assert_eq!(cache.target_weights().unwrap().tables().len(), 2);
    let v = dspark::validate(url, false);
    assert!(v.is_valid(), "{:?}", v.errors().collect::<Vec<_>>());
}

#[test]
fn hostile_manifests_are_errors_naming_the_file_and_the_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    single(&dir);
    let good = manifest_text(&dir);
    for (from, to, words) in [
        (
            "\"format_version\": 1",
            "\"format_version\": 2",
            "DSpark caches have 1",
        ),
        (
            "\"format_version\": 1",
            "\"format_version\": \"1\"",
            "format_version \"1\"",
        ),
        (
            "\"complete\": true",
            "\"complete\": 1",
            "`complete` must be true or false",
        ),
        (
            "\"complete\": true",
            "\"complete\": null",
            "`complete` must be true or false",
        ),
        (
            "\"target_hidden_dim\": 8",
            "\"target_hidden_dim\": -8",
            "`target_hidden_dim` must be a non-negative integer",
        ),
        (
            "\"target_hidden_dim\": 8",
            "\"hidden_dim\": 8",
            "neither `aux_hidden_dim`",
        ),
        // Read as EAGLE-3's (its marker key), which needs its own keys.
        (
            "\"target_hidden_dim\": 8",
            "\"aux_hidden_dim\": 8",
            "missing key `selected_token_ids`",
        ),
        (
            "\"target_last_hidden_dim\": 4",
            "\"target_last_hidden_dim\": 4, \"aux_hidden_dim\": 2",
            "has both",
        ),
        (
            "\"shard_size\": 3",
            "\"shard_size\": 0",
            "`shard_size` must be at least 1",
        ),
        (
            "\"dtype\": \"bf16\"",
            "\"dtype\": \"fp8\"",
            "`dtype` must be",
        ),
        (
            "\"seq_length\": 5",
            "\"seq_length\": 9223372036854775807",
            "overflow 64 bits",
        ),
        (
            "\"num_samples\": 7",
            "\"num_samples\": 9000000000",
            "6-digit shard names",
        ),
        ("{", "[", "JSON"),
    ] {
        assert!(good.contains(from), "{from}");
        std::fs::write(dir.join("manifest.json"), good.replacen(from, to, 1)).unwrap();
        let Err(e) = Cache::open(&dir) else {
            panic!("{to}: a hostile manifest was accepted");
        };
        let text = e.to_string();
        assert!(matches!(e, Error::Format { .. }), "{to}: {text}");
        assert!(
            text.contains("manifest.json") && text.contains(words),
            "{to}: {text}"
        );
        let v = dspark::validate(&dir, false);
        assert!(
            v.errors().any(|f| f.message.contains(words)),
            "{to}: {:?}",
            v.errors().collect::<Vec<_>>()
        );
    }
    // A shard of NeMo's first layout (a fifth tensor, attention_mask) is refused by name.
    std::fs::write(dir.join("manifest.json"), &good).unwrap();
    let path = dir.join("shard-000000.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = dspark::read_header(&bytes, &path).unwrap();
    let mut tensors = Vec::new();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        tensors.push((
            name.clone(),
            safetensors::tensor::TensorView::new(
                info.dtype,
                info.shape.clone(),
                &bytes[8 + n + s..8 + n + e],
            )
            .unwrap(),
        ));
    }
    let mask = vec![0u8; 3 * 5 * 8];
    tensors.push((
        "attention_mask".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![3, 5], &mask).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    let v = dspark::validate(&dir, false);
    assert!(
        v.errors().any(|f| f.message.contains("attention_mask")),
        "{:?}",
        v.errors().collect::<Vec<_>>()
    );
}
