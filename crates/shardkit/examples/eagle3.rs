//! EAGLE-3 offline caches (NeMo Automodel): write a small cache, read samples back by index,
//! and stream shuffled batches with the loader.
//!
//! Run with `cargo run -p shardkit --example eagle3`.

use std::sync::Arc;

use shardkit::eagle3::{synthetic_sample, Cache, Loader, LoaderOptions, Writer, WriterOptions};
use shardkit::json;

fn main() -> shardkit::Result<()> {
    let dir = std::env::temp_dir().join(format!("shardkit-example-eagle3-{}", std::process::id()));
    let result = run(&dir);
    // Remove the example's files whether or not it succeeded.
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(dir: &std::path::Path) -> shardkit::Result<()> {
    // The run configuration NeMo records in manifest.json: 12 samples of 16 tokens, bf16
    // hidden states (3 aux layers of width 8) and full target distributions over 32 tokens,
    // 4 samples per shard.
    let config = json::parse(
        br#"{"target_model": "demo", "target_vocab_size": 32, "draft_vocab_size": 32,
            "seq_length": 16, "dtype": "bf16", "num_samples": 12, "shard_size": 4,
            "aux_hidden_dim": 24, "aux_layer_ids": [1, 2, 3],
            "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                   17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
            "input_data": "demo", "split": null, "shuffle_seed": 1}"#,
    )
    .expect("valid JSON");
    let mut writer = Writer::create(dir, &config, WriterOptions::default())?;

    // Samples go in in order, as each field's little-endian bytes (here deterministic
    // synthetic values; a real run passes the target model's outputs).
    for i in 0..writer.manifest().num_samples {
        let fields = synthetic_sample(writer.manifest(), i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        writer.add(1, &refs)?;
    }
    writer.finish()?;

    // Random access: sample 5's fields, borrowed from the memory-mapped shard.
    let cache = Arc::new(Cache::open(dir)?);
    let item = cache.item(5)?;
    for field in cache.fields(&item)? {
        println!(
            "sample 5: {} {:?} {:?}",
            field.name, field.dtype, field.shape
        );
    }

    // Streaming: shuffled batches of 4 samples, every sample once per epoch.
    let mut opts = LoaderOptions::new(4);
    opts.set_shuffle(true);
    opts.seed = 3;
    let loader = Loader::new(cache, opts)?;
    for batch in loader.iter().take(2) {
        let batch = batch?;
        println!(
            "batch of samples {:?}: {} bytes",
            batch.indices,
            batch.data.len()
        );
    }

    Ok(())
}
