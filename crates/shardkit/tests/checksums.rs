//! Checksum sidecars end to end: every writer leaves one that verifies; a flipped bit in a
//! payload file is found by `checksum::verify` (naming the file and byte range) and by loaders
//! asked to verify (an error naming the shard, never wrong data); sidecars can be added to data
//! written by other tools.

use std::path::Path;
use std::sync::Arc;

use shardkit::checksum::{self, Verdict};
use shardkit::json;
use shardkit::saev::{self, LayerSel, LoaderOptions};
use shardkit::Error;
use shardkit::{eagle3, engine::Order};

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x01;
    std::fs::write(path, b).unwrap();
}

fn saev_dataset(root: &Path) -> std::path::PathBuf {
    let text = format!(
        r#"{{"protocol": "2.1", "family": "clip", "ckpt": "c", "layers": [0],
        "content_tokens_per_example": 64, "cls_token": false, "d_model": 256, "n_examples": 160,
        "max_tokens_per_shard": 4096, "data": {:?}, "dataset": "d"}}"#,
        saev::fake_dataset_data(160)
    );
    let md = saev::Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap();
    let mut w = saev::Writer::create(root, md, Default::default()).unwrap();
    let acts: Vec<f32> = (0..160 * 64 * 256).map(|i| (i % 977) as f32).collect();
    w.write(&acts, None).unwrap();
    w.finish().unwrap()
}

fn drain(loader: &saev::Loader) -> Result<u64, Error> {
    let mut n = 0;
    for b in loader.iter()? {
        n += b?.n as u64;
    }
    Ok(n)
}

#[test]
fn saev_sidecar_verify_and_verifying_loader() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dataset(tmp.path());
    assert!(matches!(
        checksum::verify(&dir).unwrap(),
        Verdict::Intact { .. }
    ));
    let mut o = LoaderOptions::new(LayerSel::Value(0));
    (o.order, o.batch_size, o.verify, o.threads) = (Order::Block, 512, true, 2);
    o.memory_budget = Some(64 << 20);
    let loader = saev::Loader::new(&dir, o.clone()).unwrap();
    assert_eq!(drain(&loader).unwrap(), 160 * 64);

    // One flipped bit in shard 1, block 2 (shards are 4 MiB: 64 examples of 64 KiB).
    let shard = dir.join("acts000001.bin");
    flip(&shard, (2 << 20) + 12345);
    let Verdict::Damaged(d) = checksum::verify(&dir).unwrap() else {
        panic!("the flip went unnoticed")
    };
    assert_eq!(d.len(), 1);
    assert_eq!(
        (d[0].file.as_path(), d[0].range.clone()),
        (shard.as_path(), (2 << 20)..(3 << 20))
    );
    // A fresh loader (the damaged bytes are what a new read sees) stops with an error naming
    // the shard and the block; it never serves the damaged rows.
    let loader = saev::Loader::new(&dir, o.clone()).unwrap();
    let e = drain(&loader).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Format { .. }), "{e:?}");
    assert!(
        msg.contains("acts000001.bin") && msg.contains("bytes 2097152 to 3145727 do not match"),
        "{msg}"
    );
    // Without verify the same loader reads (the damage is what the sidecar exists for).
    o.verify = false;
    assert_eq!(
        drain(&saev::Loader::new(&dir, o.clone()).unwrap()).unwrap(),
        160 * 64
    );

    // verify needs the page cache, and a sidecar.
    o.verify = true;
    o.direct_io = true;
    let e = saev::Loader::new(&dir, o.clone()).unwrap_err();
    assert!(e.to_string().contains("direct_io"), "{e}");
    o.direct_io = false;
    std::fs::remove_file(dir.join(checksum::SIDECAR)).unwrap();
    let e = saev::Loader::new(&dir, o).unwrap_err();
    assert!(
        matches!(&e, Error::NotFound { path, .. } if path.ends_with(checksum::SIDECAR)),
        "{e:?}"
    );
    assert_eq!(checksum::verify(&dir).unwrap(), Verdict::NoSidecar);
    // Added afterwards (as for data written by other tools), it covers every file.
    let recorded = checksum::record(&dir).unwrap();
    assert_eq!(recorded.sidecar, dir.join(checksum::SIDECAR));
    assert_eq!(
        recorded
            .files
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        [
            "acts000000.bin",
            "acts000001.bin",
            "acts000002.bin",
            "metadata.json",
            "shards.json"
        ]
    );
}

#[test]
fn eagle3_verifying_loader_finds_a_flipped_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cfg = json::parse(
        br#"{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": 8,
        "seq_length": 512, "dtype": "fp32", "num_samples": 12, "shard_size": 4,
        "aux_hidden_dim": 768, "aux_layer_ids": [1, 2, 3], "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
        "input_data": "x", "split": null, "shuffle_seed": 1}"#,
    )
    .unwrap();
    let mut w = eagle3::Writer::create(&dir, &cfg, Default::default()).unwrap();
    let m = w.manifest().clone();
    for i in 0..12 {
        // Valid samples (the writer refuses all-zero probability rows).
        let fields = eagle3::synthetic_sample(&m, i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, &b[..])).collect();
        w.add(1, &refs).unwrap();
    }
    w.finish().unwrap();
    assert!(matches!(
        checksum::verify(&dir).unwrap(),
        Verdict::Intact { .. }
    ));
    let cache = Arc::new(eagle3::Cache::open(&dir).unwrap());
    let mut o = eagle3::LoaderOptions::new(4);
    (o.rank, o.world_size, o.verify, o.threads) = (Some(0), Some(1), true, 2);
    let n: usize = eagle3::Loader::new(cache.clone(), o.clone())
        .unwrap()
        .iter()
        .map(|b| b.unwrap().indices.len())
        .sum();
    assert_eq!(n, 12);
    let name = "shard-000002.safetensors";
    let shard = dir.join(name);
    flip(&shard, 3_000_000);
    let e = eagle3::Loader::new(cache, o)
        .unwrap()
        .iter()
        .find_map(|b| b.err())
        .expect("the damaged shard was served");
    assert!(
        e.to_string().contains(name) && e.to_string().contains("checksum"),
        "{e}"
    );
    let v = eagle3::validate(&dir, true);
    assert!(
        v.errors()
            .any(|x| x.file.ends_with(name) && x.message.contains("does not match")),
        "{v:?}"
    );
}

#[test]
fn flat_tokens_verifying_loader_finds_a_damaged_chunk_file() {
    use shardkit::flat_tokens::{self, LoaderOptions as TokOptions, Packing, Split, TokenLoader};
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    let mut w = flat_tokens::Writer::create(&root, "train", Default::default()).unwrap();
    let seqs: Vec<Vec<u32>> = (0..400u32)
        .map(|i| {
            (0..50 + i % 200)
                .map(|j| (i * 31 + j) % 50_000 + 1)
                .collect()
        })
        .collect();
    w.append(&seqs).unwrap();
    w.finish().unwrap();
    assert!(matches!(
        checksum::verify(&root).unwrap(),
        Verdict::Intact { .. }
    ));
    for packing in [Packing::Packed, Packing::Unpacked] {
        let mut o = TokOptions::new(64, 8);
        (o.packing, o.verify, o.threads) = (packing, true, 2);
        o.sequences_per_read_block = Some(4);
        o.read_blocks_per_shuffle_buffer = 4;
        let l = TokenLoader::new(Split::open(&root, "train").unwrap(), o).unwrap();
        for step in 0..l.info().step_count {
            l.load(step).unwrap();
        }
    }
    // Damage the last byte of the biggest token file: a zstd chunk whose checksum no longer
    // matches (zstd itself may or may not notice).
    let sidecar =
        shardkit::json::parse(&std::fs::read(root.join(checksum::SIDECAR)).unwrap()).unwrap();
    let Some(shardkit::json::Value::Object(files)) = sidecar.get("files") else {
        panic!("the sidecar lists its files");
    };
    let files: Vec<&String> = files.iter().map(|(name, _)| name).collect();
    let victim = files
        .iter()
        .filter(|n| n.contains("encoded_tokens/c/"))
        .max_by_key(|n| std::fs::metadata(root.join(n)).unwrap().len())
        .expect("a token chunk file");
    let len = std::fs::metadata(root.join(victim)).unwrap().len();
    flip(&root.join(victim), len - 2);
    let mut o = TokOptions::new(64, 8);
    (o.verify, o.threads) = (true, 2);
    o.sequences_per_read_block = Some(4);
    o.read_blocks_per_shuffle_buffer = 4;
    let l = TokenLoader::new(Split::open(&root, "train").unwrap(), o).unwrap();
    let e = (0..l.info().step_count)
        .find_map(|s| l.load(s).err())
        .expect("the damaged chunk was decoded");
    assert!(matches!(e, Error::Format { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(victim.as_str()) && msg.contains("do not match their checksum"),
        "{msg}"
    );
}
