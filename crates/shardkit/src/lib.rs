//! shardkit: exact, crash-safe and fast access to the on-disk caches ML training reads.
//!
//! Formats:
//! * [`saev`]: the saev Sharded Activation File Protocol (transformer activations for
//!   sparse-autoencoder training), every protocol version in use.
//! * [`flat_tokens`]: MatX seqax's token datasets in zarr (v2 exactly as seqax writes them, or
//!   sharded v3), with seqax's shuffled order served step by step.
//! * [`eagle3`]: NeMo Automodel's EAGLE-3 offline cache (manifest and safetensors shards).
//!
//! Conventions shared by every format: all input from disk or from a caller is validated once,
//! at parse time, and errors name the file and the rule it breaks ([`Error`]); writers publish a
//! file under its final name only when it is complete ([`fsutil`]); JSON that another
//! implementation hashes is emitted byte-identically ([`json`]).
#![deny(missing_docs)]

pub mod checksum;
pub mod eagle3;
pub mod engine;
pub mod error;
pub mod flat_tokens;
pub mod fsutil;
pub mod json;
pub mod lock;
pub mod report;
pub mod saev;
pub mod sdnb;

pub use error::{Error, Result};

/// The version of this library.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
