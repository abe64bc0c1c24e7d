//! flat-tokens (MatX seqax): token datasets as a zarr group.
//!
//! ```text
//! DS.zarr/                 root group (shardkit writers add write_completed: true when done)
//!   {train,validation}/    split groups, attribute max_token_id (running maximum of ids)
//!     encoded_tokens       uint32[token_count]   id*2+1 at a sequence start, id*2 otherwise
//!     seq_starts           uint64[seq_count+1]   0, non-decreasing, ..., token_count
//! ```
//!
//! Reference: seqax `docs/flat-tokens.md`, `tools/flat_tokens.py`, `input_loader.py`; exact
//! behaviour in `shared/formats/flat_tokens.md`. seqax writes zarr v2 with blosc and a numcodecs
//! `delta` filter on `seq_starts` (the `delta` module registers it with zarrs).
//!
//! * [`Writer`] appends sequences in any number of calls, in seqax's v2 layout or sharded v3
//!   ([`Layout`]), crash-safely, with resume.
//! * [`Split`] reads and validates one split; datasets without shardkit's completion marker
//!   are validated in full before they are served.
//! * [`TokenLoader`] serves any step of seqax's shuffled order directly (in closed form, the
//!   `seqax` module), packed or one document per row, decoded into model inputs ([`TokenArrays`]),
//!   split across hosts, and optionally over several epochs.
//! * [`build`] fills a split from JSONL (plain, zstd, gzip) or Parquet corpora,
//!   tokenizing text with a Hugging Face tokenizer on every core, with the writer's resume.
//! * [`PartWriter`] writes one split from many processes (each its block of sequences), the
//!   committed split byte-identical to one [`Writer`]'s; [`status`] and [`commit_parts`] say
//!   where it stands and finish a commit cut short (docs/parallel.md).
//! * [`convert`] rewrites a dataset in the other layout (seqax's v2 chunks must be decoded
//!   whole for any row, so v3 serves random rows far faster; v2 is what seqax reads).
//!
//! # Example
//!
//! ```
//! use shardkit::flat_tokens::{LoaderOptions, Split, TokenLoader, Writer, WriterOptions};
//!
//! # fn main() -> shardkit::Result<()> {
//! let root = tempfile::tempdir().unwrap();
//! let root = root.path().join("ds.zarr");
//! let mut writer = Writer::create(&root, "train", WriterOptions::default())?;
//! let docs: Vec<Vec<u32>> = (0..64u32).map(|d| (0..8).map(|t| d * 8 + t).collect()).collect();
//! writer.append(&docs)?;
//! writer.finish()?;
//!
//! // Random access: document 3's token ids.
//! let split = Split::open(&root, "train")?;
//! assert_eq!(split.ids(3)?, (24..32).collect::<Vec<u32>>());
//!
//! // Step 0 of seqax's shuffled order: 4 packed rows of 16 tokens.
//! let mut opts = LoaderOptions::new(16, 4);
//! opts.sequences_per_read_block = Some(4);
//! let loader = TokenLoader::new(split, opts)?;
//! let batch = loader.load(0)?;
//! assert_eq!(batch.arrays().inputs.len(), 4 * 16);
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "zarr")]
mod batch;
#[cfg(feature = "corpus")]
mod build;
#[cfg(feature = "zarr")]
mod convert;
#[cfg(feature = "corpus")]
mod corpus;
#[cfg(feature = "zarr")]
mod decode;
#[cfg(feature = "zarr")]
mod delta;
#[cfg(feature = "zarr")]
mod layout;
#[cfg(feature = "zarr")]
mod loader;
#[cfg(feature = "zarr")]
pub(crate) mod parts;
#[cfg(feature = "zarr")]
mod report;
#[cfg(feature = "zarr")]
mod resume;
#[cfg(feature = "zarr")]
mod seqax;
#[cfg(feature = "zarr")]
mod split;
#[cfg(feature = "zarr")]
mod store;
#[cfg(feature = "zarr")]
mod writer;

#[cfg(all(test, feature = "zarr"))]
mod tests;

#[cfg(feature = "zarr")]
pub use batch::{TokenArrays, TokenBatch};
#[cfg(feature = "corpus")]
pub use build::{build, BuildOptions, BuildProgress, BuildSummary, Tokenizer};
#[cfg(feature = "zarr")]
pub use convert::convert;
#[cfg(feature = "zarr")]
pub use layout::{Layout, Sharded};
#[cfg(feature = "zarr")]
pub use loader::{Batches, LoaderInfo, LoaderOptions, Packing, TokenLoader, TokenOptions};
#[cfg(feature = "zarr")]
pub use parts::{commit_parts, status, PartOptions, PartWriter};
#[cfg(feature = "zarr")]
pub use report::{inspect, splits, validate, Validation};
#[cfg(feature = "zarr")]
pub use split::{Split, SplitInfo};
#[cfg(feature = "zarr")]
pub use store::{Completion, ZarrFormat};
#[cfg(feature = "zarr")]
pub use writer::{mark_complete, WriteSummary, Writer, WriterOptions, MAX_TOKEN_ID};
