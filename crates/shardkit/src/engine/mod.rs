//! The format-agnostic read engine every loader runs on.
//!
//! What a user needs of it: [`Order`] (the row order a loader option takes), and [`Buffer`],
//! [`BufferPool`] and [`Field`] (batch memory, and caller-owned memory such as pinned host
//! buffers). The parts below are the loaders' internals.
//!
//! * `order`: which row goes to which batch slot, decided before any I/O: a pure function of
//!   `(seed, epoch, rank, world_size, cursor)` and the blocks' row counts (sequential, block
//!   shuffle in memory-bounded windows, exact shuffle).
//! * `exec`: the pipeline. A format describes its batches as a `Job`
//!   (prepare: make the data resident and take a buffer; fill: pieces gathered in parallel
//!   into disjoint regions of the batch buffer; finish: per-batch extras); the engine runs
//!   prepare a few batches ahead on a prefetch thread, gathers on a pool of threads (default:
//!   every core), hands batches over in planned order through bounded queues, and turns every
//!   fault (an error, a panic, a thread that cannot start) into an error at the consumer.
//! * `dist`: the one `RANK`/`WORLD_SIZE` parser.
//! * `contract`: what every loader takes and gives back alike: [`LoaderOptions`] (the common
//!   knobs, their defaults written once, the format's own beside them) and [`LoaderState`].
//!
//! The engine orders and gathers; it does not know where bytes live. Reads go down to
//! [`crate::io`] (a format's `prepare` names byte ranges and hands them to its dataset's
//! `io::Source`, with the loader's `Stop`), and batch memory is `io::buffer`'s. The layers, and
//! how a shuffled batch and a remote write travel through them, are drawn in
//! docs/development.md ("The library's layers").
//!
//! Thread counts and I/O timing change when a batch is ready, never what is in it.

// The engine's parts are internals of the format loaders. What the benchmarks time on its own
// and what the fault-injection tests arm is re-exported by `shardkit::internals`, behind the
// `bench-internals` and `fault-injection` cargo features.
mod contract;
pub(crate) mod dist;
pub(crate) mod exec;
pub(crate) mod follow;
pub(crate) mod order;
pub(crate) mod quality;

pub use crate::io::buffer::{Buffer, BufferPool, Field};
pub use contract::{LoaderOptions, LoaderState, StateValue, DEFAULT_ORDER};
pub use follow::{BroadcastFn, FollowOptions, RoundBroadcast, WaitCheck};
pub use order::Order;
pub use quality::{shuffle_quality, ShuffleQuality};
