//! saev activation shards: write a small dataset, read rows back by index, and stream shuffled
//! batches with the loader.
//!
//! Run with `cargo run -p shardkit --example saev`.

use shardkit::engine::Order;
use shardkit::json;
use shardkit::saev::{Dataset, LayerSel, Loader, LoaderOptions, Metadata, TokenMode, Writer};

fn main() -> shardkit::Result<()> {
    let root = std::env::temp_dir().join(format!("shardkit-example-saev-{}", std::process::id()));
    let result = run(&root);
    // Remove the example's files whether or not it succeeded.
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn run(root: &std::path::Path) -> shardkit::Result<()> {
    // The configuration saev records in metadata.json: 20 examples of 2 layers, each with 4
    // content tokens plus a CLS token, 8 values wide (protocol 2.1).
    let config = json::parse(
        br#"{"family": "clip", "ckpt": "demo", "layers": [6, 11],
            "content_tokens_per_example": 4, "cls_token": true, "d_model": 8,
            "n_examples": 20, "max_tokens_per_shard": 50, "data": "demo", "dataset": "demo",
            "protocol": "2.1"}"#,
    )
    .expect("valid JSON");
    let md = Metadata::for_writing(&config)?;

    // Examples go in in global order, as (layers, tokens, d_model) float32 values each.
    let mut writer = Writer::create(root, md, Default::default())?;
    for e in 0..20u32 {
        let acts: Vec<f32> = (0..2 * 5 * 8).map(|i| (e * 1000 + i) as f32).collect();
        writer.write(&acts, None)?;
    }
    let dir = writer.finish()?;
    println!("wrote {}", dir.display());

    // Random access: one vector, or saev's flat index over a layer's content tokens.
    let ds = Dataset::open(&dir)?;
    let v = ds.get(3, 11, 2)?; // example 3, layer 11, token slot 2
    println!("example 3, layer 11, token 2: {:?}...", &v[..3]);
    let rows = ds.indexed(6, TokenMode::Content)?;
    let row = rows.get(rows.len() - 1)?;
    println!(
        "{} content rows of layer 6; the last is example {}, token {}",
        rows.len(),
        row.example_idx,
        row.token_idx
    );

    // Streaming: shuffled batches of layer 6, exactly once each per epoch.
    let mut opts = LoaderOptions::new(LayerSel::Value(6));
    opts.order = Order::Block;
    opts.batch_size = 16;
    opts.seed = 42;
    let loader = Loader::new(&dir, opts)?;
    for batch in loader.iter()?.take(2) {
        let batch = batch?;
        println!(
            "batch of {} rows x {}: examples {:?}...",
            batch.n,
            batch.d_model,
            &batch.example_idx[..4]
        );
    }

    Ok(())
}
