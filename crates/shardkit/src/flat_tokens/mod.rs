//! flat-tokens (MatX seqax): token datasets as a zarr group.
//!
//! ```text
//! DS.zarr/{train,validation}/
//!     encoded_tokens   uint32[token_count]   id*2+1 at a sequence start, id*2 otherwise
//!     seq_starts       uint64[seq_count+1]   0, non-decreasing, ..., token_count
//!     (attribute max_token_id on the split group)
//! ```
//!
//! Reference: seqax `docs/flat-tokens.md`, `tools/flat_tokens.py`, `input_loader.py`; exact
//! behaviour in `shared/formats/flat_tokens.md`. This module so far holds the format-independent
//! parts: seqax's shuffle ([`seqax`]) and the decoding of rows into model inputs ([`decode`]),
//! and, with the `zarr` feature, reading and validating a split through `zarrs` ([`Split`],
//! with seqax's numcodecs `delta` filter in [`delta`]).

pub mod decode;
#[cfg(feature = "zarr")]
pub mod delta;
#[cfg(feature = "zarr")]
mod loader;
pub mod seqax;
#[cfg(feature = "zarr")]
mod split;

#[cfg(feature = "zarr")]
pub use loader::{Packing, TokenBatch, TokenLoader};
#[cfg(feature = "zarr")]
pub use split::Split;
