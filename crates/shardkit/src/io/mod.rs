//! Where bytes live, one layer: a dataset is a local path or a prefix in an S3-compatible
//! object store, and every read goes through this module.
//!
//! A path or URL is parsed once into a [`Location`]; [`open`] makes the [`Source`] a format
//! holds: `LocalDir` for local files, `Remote` for a prefix in any `object_store` store
//! (S3 behind the `s3` cargo feature, on by default; in tests an in-memory or local-filesystem
//! store, [`open_store`]), wrapped in `Cached` when `SHARDKIT_CACHE_DIR` is set. A source
//! lists, sizes and gets objects, and reads ranges of them into the caller's buffer, now or
//! started and left running ([`Source::start_read`]), until its [`Stop`] is set. Formats ask a
//! source what it can do ([`Source::local_path`]: files to map, read ahead, read with O_DIRECT,
//! the `local` module's readers) rather than whether a path is remote.
//!
//! ```text
//! location.rs  parsing        source.rs   the trait, open     local.rs    files: maps, O_DIRECT
//! store.rs     object stores  s3/         AWS config, client  cache.rs    the bounded cache
//! runtime.rs   tokio, fork    slots.rs    request slots       coalesce.rs ranges to requests
//! zarr.rs      zarrs adapter  buffer.rs   batch memory        stop.rs     stopping reads
//! ```
//!
//! ```text
//! /data/acts, file:///data/acts     a local directory (as before)
//! s3://bucket/prefix/acts           objects under bucket/prefix/acts/
//! ```
//!
//! Every API that takes a path also takes an `s3://` URL. The endpoint, region and credentials
//! come from the standard AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_SESSION_TOKEN`, `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` for S3-compatible
//! servers, `AWS_ENDPOINT_URL_S3` before it), falling back to the `[default]` (or `AWS_PROFILE`)
//! section of `~/.aws/credentials` and `~/.aws/config`; `AWS_SKIP_SIGNATURE=true` reads public
//! buckets unsigned. Signing, retries and multipart uploads are the `object_store` crate's.
//!
//! Reads are ranged GETs: the ranges a batch needs are sorted, ranges of one object less than
//! 1 MiB apart are merged into requests of at most [`max_request`] bytes, and
//! [`inflight`] request slots (shared by the process's reads, which take them in turn, first
//! come first served; a small request takes a share of a slot) bound the requests running at
//! once on one small tokio runtime; each response is copied into its place in the caller's
//! buffer. Throttling (503 SlowDown), server errors, dropped connections
//! (also mid-body) and timeouts are retried with exponential backoff, at most
//! `SHARDKIT_S3_RETRIES` times (default 10) and for at most `SHARDKIT_S3_RETRY_TIMEOUT` seconds
//! (default 180); then the read fails with an error naming the object and the range. A
//! response shorter than the range asked for is retried too, never served.
//!
//! Writes are single PUTs for small objects and multipart uploads for large ones: an object
//! appears whole or not at all, so a dataset's commit record, written last, is the only thing
//! a reader needs to trust (`commit`'s transfers: `shardkit::upload`).

use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) mod buffer;
pub(crate) mod cache;
pub(crate) mod coalesce;
pub(crate) mod local;
pub(crate) mod location;
pub(crate) mod runtime;
#[cfg(feature = "s3")]
pub(crate) mod s3;
pub(crate) mod slots;
pub(crate) mod source;
pub(crate) mod stop;
pub(crate) mod store;
#[cfg(feature = "zarr")]
pub(crate) mod zarr;
#[cfg(feature = "zarr")]
pub(crate) use zarr::zarr_reads_stopped_by;

pub use crate::config::{inflight, max_request, set_inflight, set_max_request_mib};
pub(crate) use cache::Cached;
pub use cache::HeldPages;
pub use cache::{
    cache_dir, cache_dir_or, cache_usage, clear_cache, wait_for_cache, CacheUsage, CachedObject,
};
pub(crate) use cache::{fetch_container, ShardNames};
pub use local::ReadRange;
pub(crate) use location::verify_needs_local;
pub use location::Location;
pub(crate) use location::{is_local, local_path};
pub use runtime::PendingRead;
pub use source::{open, open_store, open_uncached, Source};
pub use stop::Stop;
pub(crate) use store::not_a_store;
pub(crate) use store::Remote;

/// Counters of the requests this process has made (for benchmarks and reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Ranged or whole-object GETs completed.
    pub gets: u64,
    /// Bytes those GETs returned (gap bytes of coalesced requests included).
    pub get_bytes: u64,
    /// Objects written (PUTs and completed multipart uploads).
    pub puts: u64,
    /// Bytes written.
    pub put_bytes: u64,
    /// Bytes reads took from the local cache's pages (`SHARDKIT_CACHE_DIR`) by reading them.
    pub cache_read_bytes: u64,
    /// Bytes of the cache's pages mapped for reads served straight out of them (a saev window
    /// whose pages are all held: its rows are copied once, from the pages).
    pub cache_mapped_bytes: u64,
}

pub(crate) static GETS: AtomicU64 = AtomicU64::new(0);
pub(crate) static GET_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static PUTS: AtomicU64 = AtomicU64::new(0);
pub(crate) static PUT_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static CACHE_READ_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static CACHE_MAPPED_BYTES: AtomicU64 = AtomicU64::new(0);

/// The process's request counters so far.
pub fn counters() -> Counters {
    Counters {
        gets: GETS.load(Ordering::Relaxed),
        get_bytes: GET_BYTES.load(Ordering::Relaxed),
        puts: PUTS.load(Ordering::Relaxed),
        put_bytes: PUT_BYTES.load(Ordering::Relaxed),
        cache_read_bytes: CACHE_READ_BYTES.load(Ordering::Relaxed),
        cache_mapped_bytes: CACHE_MAPPED_BYTES.load(Ordering::Relaxed),
    }
}
