//! flat-tokens (seqax) token datasets: write a split, read documents back by index, and serve
//! steps of seqax's shuffled order with the loader.
//!
//! Run with `cargo run -p shardkit --example flat_tokens`.

use shardkit::flat_tokens::{LoaderOptions, Split, TokenLoader, Writer, WriterOptions};

fn main() -> shardkit::Result<()> {
    let root = std::env::temp_dir().join(format!(
        "shardkit-example-flat-tokens-{}.zarr",
        std::process::id()
    ));
    let result = run(&root);
    // Remove the example's files whether or not it succeeded.
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn run(root: &std::path::Path) -> shardkit::Result<()> {
    // 200 documents of 5 to 40 token ids, appended in a few calls (the default layout is
    // seqax's zarr v2; `WriterOptions::layout` picks sharded v3 instead).
    let mut writer = Writer::create(root, "train", WriterOptions::default())?;
    for chunk in 0..4u32 {
        let docs: Vec<Vec<u32>> = (0..50u32)
            .map(|d| {
                let doc = chunk * 50 + d;
                (0..5 + doc % 36)
                    .map(|t| 1 + (doc * 7 + t) % 1000)
                    .collect()
            })
            .collect();
        writer.append(&docs)?;
    }
    let summary = writer.finish()?;
    println!(
        "wrote {} sequences, {} tokens to {}",
        summary.seq_count,
        summary.token_count,
        summary.root.display()
    );

    // Random access: any document's token ids.
    let split = Split::open(root, "train")?;
    println!("document 17: {:?}", split.ids(17)?);

    // Streaming: step i of seqax's shuffled order, as packed rows of 32 tokens (targets,
    // inputs, segment ids and masks, decoded for the model). The shuffle reads blocks of 16
    // rows here (seqax's default, 2^20 / seq_len, is sized for real datasets).
    let mut opts = LoaderOptions::new(32, 8);
    opts.sequences_per_read_block = Some(16);
    opts.seed = 7;
    let loader = TokenLoader::new(split, opts)?;
    println!("{} steps per epoch", loader.info().step_count);
    for batch in loader.iter(0).take(2) {
        let batch = batch?;
        println!(
            "step {}: rows {:?}, first inputs {:?}",
            batch.step,
            batch.rows,
            &batch.arrays().inputs[..6]
        );
    }

    Ok(())
}
