//! The library's internals that its own benchmarks (`shardkit-bench`) reach, in one place. Not
//! part of the API (it changes without notice), and only there with the cargo feature that asks
//! for it:
//!
//! * `bench-internals` (shardkit-bench): the engine's parts the benchmarks time on their own.

/// Streaming (non-temporal) copies into batch buffers, and the fence that ends them.
#[cfg(feature = "bench-internals")]
pub use crate::engine::batch::{copy_done, copy_streaming};
/// The engine's PRNG (row orders are reproducible from its seeds).
#[cfg(feature = "bench-internals")]
pub use crate::engine::order::SplitMix64;
/// O_DIRECT opens, for read ceilings that bypass the page cache.
#[cfg(feature = "bench-internals")]
pub use crate::fsutil::open_direct;
