//! Shared by the integration tests: the saev reference fixtures and their coded values.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use shardkit::Rank;

/// Rank `r` of `w`.
pub fn rank(r: u64, w: u64) -> Rank {
    Rank::new(r, w).unwrap()
}

/// `shared/fixtures/saev`, beside the repository.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/saev")
}

pub const A_100: &str = "v1.0.0/bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47";
pub const B_100: &str = "v1.0.0/abbe30ad92e85b5b2346422cd3fe5d77198b6eb50315ea9f9fac35305004416a";
pub const A_20: &str = "v2.0/eec1d7ba782d48ff23cf8e88b9a79fe637f800b9d56a9b16f2bd03bfcb7a8401";
pub const CRASHED_20: &str =
    "v2.0/36f76cd85cfb77f6ae191c8994a7e313994553017475db89e31564e3464623af";
pub const A_21: &str = "v2.1/aa57b80c";
pub const B_21: &str = "v2.1/1acdd127";
pub const C_21: &str = "v2.1/e64e5d2c";

/// A complete saev 2.1 dataset of `n_examples` under `root` (CLS + `content` tokens, d_model 4,
/// two recorded layers), whose every value is coded from where it lies (1000 * example + 100 *
/// layer + 10 * token + dimension) and whose labels are `(example + token) % label_mod`: a
/// batch shows which rows it holds.
pub fn coded_saev(
    root: &Path,
    n_examples: u64,
    layers: [i64; 2],
    content: u64,
    max_tokens_per_shard: u64,
    label_mod: u64,
) -> PathBuf {
    use shardkit::saev::{Metadata, Writer, WriterOptions};
    let md = format!(
        r#"{{"family": "clip", "ckpt": "x", "layers": [{}, {}], "content_tokens_per_example": {content},
        "cls_token": true, "d_model": 4, "n_examples": {n_examples}, "max_tokens_per_shard": {max_tokens_per_shard},
        "data": "d", "dataset": "t", "protocol": "2.1"}}"#,
        layers[0], layers[1]
    );
    let md = Metadata::for_writing(&shardkit::json::parse(md.as_bytes()).unwrap()).unwrap();
    let mut w = Writer::create(root, md, WriterOptions::default()).unwrap();
    let mut acts = Vec::new();
    let mut labels = Vec::new();
    for e in 0..n_examples {
        for l in 0..2u64 {
            for t in 0..=content {
                for d in 0..4u64 {
                    acts.push((1000 * e + 100 * l + 10 * t + d) as f32);
                }
            }
        }
        labels.extend((0..content).map(|c| ((e + c) % label_mod) as u8));
    }
    w.write(&acts, Some(&labels)).unwrap();
    w.finish().unwrap()
}

/// Every file below `dir` (paths relative to it, hidden ones included) with its bytes: two
/// datasets are byte-identical when their trees are equal.
pub fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let name = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.insert(name, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Asserts two directories hold the same files with the same bytes, naming any that differ.
pub fn assert_same_tree(a: &Path, b: &Path, what: &str) {
    let (ta, tb) = (tree(a), tree(b));
    let keys: std::collections::BTreeSet<&String> = ta.keys().chain(tb.keys()).collect();
    let differ: Vec<&&String> = keys.iter().filter(|k| ta.get(**k) != tb.get(**k)).collect();
    assert!(differ.is_empty(), "{what}: files differ: {differ:?}");
}
pub mod broadcast;
pub mod eagle3;
pub mod flat_tokens;
pub mod saev;
pub mod stores;
