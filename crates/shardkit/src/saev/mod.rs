//! The saev Sharded Activation File Protocol (protocols 1.0.0, 1.1, 2.0, 2.1).
//!
//! ```text
//! <root>/<NAME>/            NAME = content hash of metadata.json (R1: 64 hex; 2.1: R2, 8 hex)
//!     metadata.json         the configuration (keys and bytes per protocol version)
//!     shards.json           [{"name": "acts000000.bin", "n_examples": k}, ...]
//!     acts000000.bin ...    float32 LE, C order (examples_per_shard, L, T, D), all full size
//!     labels.bin            optional uint8 (N, P), content tokens only
//! ```
//!
//! Reference: saev (OSU-NLP-Group/saev), `src/saev/data/shards.py`; the exact behaviour and
//! the reference's bugs are in `shared/formats/saev.md`. Reading accepts every version by its
//! key names; writing produces 1.0.0, 2.0 or 2.1 byte-identically to saev, crash-safely.

mod compat;
mod dataset;
mod layout;
mod loader;
mod metadata;
mod validate;
mod writer;

pub use compat::fake_dataset_data;
pub use dataset::{Dataset, Indexed, Row, TokenMode};
pub use layout::{parse_shards_json, shards_json_bytes, Layout, ShardEntry, VALUE_BYTES};
pub use loader::{
    Batch, Batches, LayerSel, Loader, LoaderOptions, LoaderState, SaevSource, DEFAULT_MEMORY_BUDGET,
};
pub use metadata::{Metadata, Recipe, WriteVersion};
pub use validate::{inspect, validate, Problem, Report, Severity};
pub use writer::{WriteStart, Writer, WriterOptions};
