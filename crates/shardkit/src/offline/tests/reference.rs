//! The reference's byte vectors (eagle3.md §13): filler values that break the value rules,
//! written without them for their bytes ([`Writer::add_unchecked`], a crate-only hook).

use std::collections::BTreeSet;
use std::path::Path;

use crate::json::{self, sha256_hex, Value};
use crate::offline::{Cache, Writer, WriterOptions};

/// The reference's run configuration: `n` samples in shards of `s`, S = `seq`, 3H = `aux`,
/// Vd = `vd`.
fn config(n: u64, s: u64, seq: u64, aux: u64, vd: u64, dtype: &str) -> Value {
    let selected: Vec<String> = (0..vd).map(|j| ((j * 7 + 3) % 1000).to_string()).collect();
    let text = format!(
        r#"{{"target_model": "org/Modèl-1B", "target_vocab_size": 1000, "draft_vocab_size": {vd},
        "seq_length": {seq}, "dtype": "{dtype}", "num_samples": {n}, "shard_size": {s},
        "aux_hidden_dim": {aux}, "aux_layer_ids": [1, 3, 4], "selected_token_ids": [{}],
        "input_data": "data.jsonl", "split": null, "shuffle_seed": 42}}"#,
        selected.join(", ")
    );
    json::parse(text.as_bytes()).unwrap()
}

fn files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_reference_shard_and_embeddings_bytes() {
    // §13: n=2, S=3, 3H=6, Vd=4, fp32, lossless; arrays filled as the reference says.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let cfg = config(2, 2, 3, 6, 4, "fp32");
    let mut w = Writer::create(&dir, &cfg, WriterOptions::default()).unwrap();
    let i64s = |v: Vec<i64>| {
        v.into_iter()
            .flat_map(i64::to_le_bytes)
            .collect::<Vec<u8>>()
    };
    let f32s = |n: usize| {
        (0..n)
            .flat_map(|x| (x as f32).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let ids = i64s((0..6).collect());
    let att = i64s(vec![1; 6]);
    let loss = i64s((0..6).map(|x| x % 2).collect());
    let aux = f32s(36);
    let probs = f32s(24);
    let pos: Vec<u8> = (0..6).map(|x| u8::from(x % 2 == 0)).collect();
    let fields: [(&str, &[u8]); 6] = [
        ("input_ids", &ids),
        ("attention_mask", &att),
        ("loss_mask", &loss),
        ("aux_hidden_states", &aux),
        ("target_probs", &probs),
        ("position_mask", &pos),
    ];
    // The reference's filler values break the value rules (rows of 0, 1, 2, 3 as
    // probabilities): they are written unchecked, for their bytes.
    w.add_unchecked(2, &fields).unwrap();
    w.write_target_embeddings(&f32s(10), 5, 2).unwrap();
    w.finish().unwrap();
    let shard = std::fs::read(dir.join("shard-000000.safetensors")).unwrap();
    assert_eq!(shard.len(), 822);
    assert_eq!(shard[..8], [0xa8, 0x01, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        sha256_hex(&shard[8 + 424..]),
        "742996fceffbe6faa29314ab6940e960882e07acd9e63527c5c0410663618f33"
    );
    assert_eq!(
        sha256_hex(&shard),
        "d96aa4ccd3d357dfd62ea10aa066f0a112ceb17cadb8cbfcd6e2fb17b8a503e0"
    );
    let emb = std::fs::read(dir.join("target_embeddings.safetensors")).unwrap();
    assert_eq!(emb.len(), 112);
    assert_eq!(
        sha256_hex(&emb),
        "5e8132d12a55c327ff06113af2d3aa10a7fe45b0b6a73f852226936fdc66715b"
    );
    // The v1 manifest: no target_probs_topk; files readable; no temporaries left behind.
    let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(text.contains("\"format_version\": 1") && !text.contains("topk"));
    assert_eq!(
        files(&dir),
        [
            "manifest.json",
            "shard-000000.safetensors",
            "shardkit.checksums.json",
            "target_embeddings.safetensors"
        ]
        .map(String::from)
        .into()
    );
    let cache = Cache::open(&dir).unwrap();
    let item = cache.item(1).unwrap();
    let f = cache.fields(&item).unwrap();
    assert_eq!(f[3].name, "aux_hidden_states");
    assert_eq!(f[3].shape, [3, 6]);
    assert_eq!(&f[3].bytes[..], &aux[72..]);
    assert_eq!(f[4].shape, [3, 1]);
    let e = cache.target_embeddings().unwrap();
    assert_eq!((e.rows, e.cols), (5, 2));
    assert_eq!(e.bytes(), &f32s(10)[..]);
}
