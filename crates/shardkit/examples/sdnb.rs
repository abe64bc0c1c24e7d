//! SameDiff containers (SDNB, shard sets, SDZ): save tensors, open the container and read
//! tensors back by name, walk every variable, and edit metadata in place.
//!
//! SDNB holds a model's weights rather than training data, so there is no batch loader: a
//! container is opened once and its tensors are served straight from a memory map.
//!
//! Run with `cargo run -p shardkit --example sdnb`.

use shardkit::sdnb::{self, DType, Order, SaveOptions, TensorIn, VarType};

fn main() -> shardkit::Result<()> {
    let dir = std::env::temp_dir().join(format!("shardkit-example-sdnb-{}", std::process::id()));
    let result = run(&dir);
    // Remove the example's files whether or not it succeeded.
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(dir: &std::path::Path) -> shardkit::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| shardkit::Error::io(dir, e))?;
    let path = dir.join("model.sdnb");

    // Two float32 tensors: a 512 x 512 weight (1 MiB, stored as an aligned blob) and a bias
    // (small enough to live inline in the graph).
    let weight: Vec<u8> = (0..512 * 512)
        .flat_map(|i| (i as f32 / 1000.0).to_le_bytes())
        .collect();
    let bias: Vec<u8> = (0..512).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensor = |name: &str, shape: Vec<i64>, bytes| TensorIn {
        name: name.into(),
        var_type: VarType::Variable,
        dtype: DType::Float,
        shape,
        order: Order::C,
        bytes,
    };
    let opts = SaveOptions {
        metadata: vec![("model.name".into(), "demo".into())],
        ..SaveOptions::default()
    };
    sdnb::save(
        &path,
        &[
            tensor("layer0/w", vec![512, 512], &weight),
            tensor("layer0/b", vec![512], &bias),
        ],
        &opts,
    )?;

    // Random access by name: the bytes are borrowed from the memory-mapped file.
    let model = sdnb::open(&path)?;
    let w = model.tensor("layer0/w")?;
    let row1: Vec<f32> = w.bytes[512 * 4..512 * 4 + 16]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    println!("{:?} {:?}: row 1 starts {:?}", w.dtype, w.shape, row1);

    // Every variable, with where its data lives.
    for v in model.variables() {
        println!(
            "{}: {:?} {:?}, {} bytes, {}",
            v.name, v.dtype, v.shape, v.byte_len, v.storage
        );
    }

    // Metadata edits happen in place when they fit the slack left after the graph.
    let edit = sdnb::set_metadata(
        &path,
        &[("model.name".into(), Some("demo-v2".into()))],
        false,
    )?;
    println!(
        "model.name = {:?} (edited in place: {})",
        sdnb::open(&path)?
            .metadata()
            .iter()
            .find(|(k, _)| k == "model.name")
            .map(|(_, v)| v),
        edit.in_place
    );

    Ok(())
}
