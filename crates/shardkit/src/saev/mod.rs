//! The saev Sharded Activation File Protocol (protocols 1.0.0, 1.1, 2.0, 2.1).
//!
//! ```text
//! <root>/<NAME>/            NAME = content hash of metadata.json (R1: 64 hex; 2.1: R2, 8 hex)
//!     metadata.json         the configuration (keys and bytes per protocol version)
//!     shards.json           [{"name": "acts000000.bin", "n_examples": k}, ...]
//!     acts000000.bin ...    float32 LE, C order (examples_per_shard, L, T, D), all full size
//!                           (bfloat16 / float16 LE in shardkit's dialect of 2.1; see [`convert`])
//!     acts000000.error.json ...  bfloat16/float16 datasets only: each shard's rounding error
//!     labels.bin            optional uint8 (N, P), content tokens only
//! ```
//!
//! Reference: saev (OSU-NLP-Group/saev), `src/saev/data/shards.py`; the exact behaviour and
//! the reference's bugs are in `shared/formats/saev.md`. Reading accepts every version by its
//! key names; writing produces 1.0.0, 2.0 or 2.1 byte-identically to saev, crash-safely.
//!
//! # Example
//!
//! ```
//! use shardkit::saev::{Dataset, LayerSel, Loader, LoaderOptions, Metadata, Writer};
//!
//! # fn main() -> shardkit::Result<()> {
//! let root = tempfile::tempdir().unwrap();
//! // 4 examples of one layer, 2 content tokens + CLS, 3 values wide.
//! let config = shardkit::json::parse(
//!     br#"{"family": "clip", "ckpt": "demo", "layers": [11], "content_tokens_per_example": 2,
//!         "cls_token": true, "d_model": 3, "n_examples": 4, "max_tokens_per_shard": 9,
//!         "data": "demo", "dataset": "demo", "protocol": "2.1"}"#,
//! )
//! .expect("valid JSON");
//! let mut writer = Writer::create(root.path(), Metadata::for_writing(&config)?, Default::default())?;
//! let acts: Vec<f32> = (0..4 * 3 * 3).map(|i| i as f32).collect();
//! writer.write(&acts, None)?; // any number of whole examples per call
//! let dir = writer.finish()?;
//!
//! // Random access: example 1, layer 11, token slot 2 (CLS is slot 0).
//! assert_eq!(Dataset::open(&dir)?.get(1, 11, 2)?, [15.0, 16.0, 17.0]);
//!
//! // Shuffled batches of content tokens.
//! let mut opts = LoaderOptions::new(LayerSel::Value(11));
//! opts.order = shardkit::engine::Order::Exact;
//! opts.batch_size = 4;
//! let loader = Loader::new(&dir, opts)?;
//! let rows: usize = loader.iter()?.map(|b| b.map(|b| b.n)).sum::<shardkit::Result<_>>()?;
//! assert_eq!(rows, 8);
//! # Ok(())
//! # }
//! ```

mod compat;
mod convert;
mod dataset;
mod follow;
mod layout;
mod loader;
mod metadata;
mod options;
mod parts;
mod rounding;
#[cfg(test)]
mod tests;
mod validate;
mod writer;

pub use crate::engine::LoaderState;
pub use compat::fake_dataset_data;
pub use convert::{
    convert, converted_metadata, ConvertOptions, ConvertProgress, ProgressFn, DEFAULT_CHUNK_BYTES,
};
pub use dataset::{Dataset, Indexed, Row, TokenMode};
pub use follow::{FollowOptions, RoundBroadcast, WaitCheck};
pub use layout::Layout;
pub use loader::{Batch, Batches, LayerSel, Loader};
pub use metadata::Metadata;
pub use options::{state_at, LoaderOptions, SaevOptions, DEFAULT_MEMORY_BUDGET};
pub use parts::{commit_parts, status, PartWriter};
pub use validate::{inspect, validate, Severity};
pub use writer::{WriteStart, Writer, WriterOptions};
