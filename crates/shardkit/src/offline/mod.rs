//! NVIDIA NeMo Automodel's offline-cache family (`offline_cache.py`): a frozen target model's
//! per-token supervision, stored once so draft training reads it back without the target.
//! Its members share one layout and differ in what a sample holds ([`Schema`]):
//!
//! ```text
//! <cache_dir>/manifest.json             the run configuration and format_version
//!            /shard-NNNNNN.safetensors  samples [k·s, k·s + n), every tensor stacked on dim 0
//!            /<target weights>.safetensors
//! ```
//!
//! Sample i is row `i % s` of shard `i // s`; the shard set is exactly `0..ceil(N/s)`. The
//! members' pages: `shardkit::eagle3` and `shardkit::dspark`, which re-export this module's types.
//! One implementation serves both: the writers ([`Writer`], [`PartWriter`] with NeMo's own
//! shard partition), the reader ([`Cache`]), the shuffled distributed [`Loader`], [`validate`]
//! and [`inspect`]; a manifest's keys say which member a cache is, checked once at parse time.

mod cache;
mod follow;
mod loader;
mod manifest;
mod parts;
mod rules;
mod schema;
mod shard;
mod synth;
#[cfg(test)]
mod tests;
mod validate;
mod weights;
mod writer;

pub use crate::engine::follow::{FollowOptions, RoundBroadcast, WaitCheck};
pub use crate::engine::LoaderState;
pub use cache::{Cache, Field, Item, DEFAULT_OPEN_SHARDS};
pub use loader::{Batch, BatchField, Batches, Eagle3Options, Loader, LoaderOptions};
pub use manifest::{DSparkLayout, Eagle3Layout, Layout, Manifest};
pub use parts::{commit_parts, status, PartOptions, PartWriter};
pub use schema::Schema;
pub use shard::{read_header, FieldSpec};
pub use synth::synthetic_sample;
pub use validate::{inspect, set_version, validate, Validation};
pub use weights::{Embeddings, WeightInfo, WeightTable, Weights};
pub use writer::{Writer, WriterOptions};
