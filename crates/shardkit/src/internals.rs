//! The library's internals that its own benchmarks (`shardkit-bench`) and fault-injection tests
//! reach, in one place. Not part of the API (it changes without notice), and only there with
//! the cargo features that ask for it:
//!
//! * `bench-internals` (shardkit-bench): the engine's parts the benchmarks time on their own.
//! * `fault-injection` (the tests: the library's dev-dependency on itself, and the CLI and the
//!   Python extension built for the tests): arming the engine's faults ([`fault`]) and tracing
//!   the durability calls writers make ([`trace`]). Without it the hooks compile to nothing;
//!   the kill tests' `SHARDKIT_TEST_ABORT_AFTER_RENAMES` / `SHARDKIT_TEST_ABORT_AFTER_PUTS` are
//!   read only with it.

/// The engine's PRNG (row orders are reproducible from its seeds).
#[cfg(feature = "bench-internals")]
pub use crate::engine::order::SplitMix64;
/// O_DIRECT opens, for read ceilings that bypass the page cache.
#[cfg(feature = "bench-internals")]
pub use crate::fsutil::open_direct;
/// Streaming (non-temporal) copies into batch buffers, and the fence that ends them.
#[cfg(feature = "bench-internals")]
pub use crate::io::buffer::{copy_done, copy_streaming};

/// Faults the tests inject into the engine.
#[cfg(feature = "fault-injection")]
pub mod fault {
    pub use crate::fault::{clear, inject, Fault};
}

/// The durability calls writers make (fsyncs, renames), recorded for tests of their order.
#[cfg(feature = "fault-injection")]
pub mod trace {
    pub use crate::fsutil::trace::{start, take, Event};
}

/// Stops the next commit of a flat-tokens split written in parts after it has replayed `units`
/// units, as if it were killed there (its writer checkpointed, the split left unfinished).
#[cfg(all(feature = "fault-injection", feature = "zarr"))]
pub fn stop_flat_tokens_commit_after(units: u64) {
    crate::flat_tokens::parts::STOP_COMMIT_AFTER_UNITS
        .store(units, std::sync::atomic::Ordering::SeqCst);
}

/// Object stores put in place of buckets, for the tests of writes to `s3://`.
#[cfg(feature = "fault-injection")]
pub mod stores {
    pub use crate::io::store::use_store;
}
