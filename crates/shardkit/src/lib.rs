//! shardkit: exact, crash-safe and fast access to the on-disk caches ML training reads.
//!
//! Each format module writes a dataset, reads any item of it back by index, and streams it in
//! batches (sequential or shuffled, split across ranks, resumable), with the same guarantees:
//!
//! * [`saev`]: the saev Sharded Activation File Protocol (transformer activations for
//!   sparse-autoencoder training), every protocol version in use.
//! * [`flat_tokens`]: MatX seqax's token datasets in zarr (v2 exactly as seqax writes them, or
//!   sharded v3), with seqax's shuffled order served step by step.
//! * [`eagle3`] and [`dspark`]: NeMo Automodel's EAGLE-3 and DSpark offline caches (manifest
//!   and safetensors shards), two schemas of one implementation ([`offline`]).
//! * [`sdnb`]: SameDiff (Deeplearning4j) model containers: single SDNB files, shard sets and
//!   SDZ archives, served from a memory map.
//!
//! Each module's documentation opens with a short example; `crates/shardkit/examples/` has a
//! runnable program per format (`cargo run -p shardkit --example saev`).
//!
//! Conventions shared by every format: all input from disk or from a caller is validated once,
//! at parse time, and errors name the file and the rule it breaks ([`Error`]); writers publish a
//! file under its final name only when it is complete ([`fsutil`]); JSON that another
//! implementation hashes is emitted byte-identically ([`json`]). Loaders take their row order
//! from [`engine::Order`].
//!
//! ```
//! # fn main() -> shardkit::Result<()> {
//! // Every failure is a `shardkit::Error` that names what was wrong.
//! let err = shardkit::sdnb::open("/nonexistent/model.sdnb").unwrap_err();
//! assert!(matches!(err, shardkit::Error::NotFound { .. }));
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]
// Without flat-tokens (the `zarr` feature) some shared helpers have no caller; they are kept
// rather than each gated on the feature.
#![cfg_attr(not(feature = "zarr"), allow(dead_code))]

// The layers, bottom to top. A module uses only modules of its own layer or below
// (`../shared/tools/layers.py crates/shardkit/src` shows no cycle, at depth 1 and 2):
//
//   formats   saev, flat_tokens, offline, sdnb    parse, lay out, validate; describe batches
//             (eagle3, dspark: offline's members)
//   engine    engine                              orders, gathers, batches, the loader contract
//   commit    commit, checksum, report            locks, staging, upload journal, sidecars,
//                                                 the commit record written last
//   io        io                                  where bytes live: locations, the `Source`
//                                                 trait (local, object stores, the cache)
//   base      error, config, json, fsutil, fault  errors, settings, exact JSON, atomic files
pub mod checksum;
pub(crate) mod commit;
pub(crate) mod config;
pub mod dspark;
pub mod eagle3;
pub mod engine;
mod error;
// Test-only fault hooks (engine, reads), compiled only with the `fault-injection` feature.
pub(crate) mod fault;
pub mod flat_tokens;
pub mod fsutil;
#[cfg(any(feature = "bench-internals", feature = "fault-injection"))]
#[doc(hidden)]
pub mod internals;
pub mod io;
pub mod json;
pub mod offline;
pub(crate) mod par;
pub mod precision;
pub mod report;
pub mod saev;
pub mod sdnb;

pub use commit::parts::{part_of, PartsStatus, Rank};
pub use commit::transfer::{download, upload, Transfer};
pub use commit::{notes, provenance};
pub use error::{Error, Result};

/// The container (a dataset made of files, not a directory) at `path`, as checksums see it.
/// Checksums sit below the formats, so the crate root tells them which format is at a path:
/// SDNB is the one container format.
pub(crate) fn open_container(path: &std::path::Path) -> Result<Box<dyn checksum::Container>> {
    sdnb::sidecar::open(path)
}

/// The version of this library.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

// The Rust snippets of the README and of docs/ are compiled (and run) as doctests.
#[doc = include_str!("../../../docs/saev.md")]
#[cfg(doctest)]
pub(crate) struct SaevDocs;

#[doc = include_str!("../../../docs/flat_tokens.md")]
#[cfg(doctest)]
pub(crate) struct FlatTokensDocs;

#[doc = include_str!("../../../docs/eagle3.md")]
#[cfg(doctest)]
pub(crate) struct Eagle3Docs;

#[doc = include_str!("../../../docs/dspark.md")]
#[cfg(doctest)]
pub(crate) struct DSparkDocs;

#[doc = include_str!("../../../docs/sdnb.md")]
#[cfg(doctest)]
pub(crate) struct SdnbDocs;

#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub(crate) struct ReadmeDocs;
