//! The format-agnostic read engine every loader runs on.
//!
//! * [`order`]: which row goes to which batch slot, decided before any I/O: a pure function of
//!   `(seed, epoch, rank, world_size, cursor)` and the blocks' row counts (sequential, block
//!   shuffle in memory-bounded windows, exact shuffle).
//! * [`exec`]: the pipeline. A format describes its batches as a [`Job`] (prepare: make the
//!   data resident and take a buffer; fill: pieces gathered in parallel into disjoint regions
//!   of the batch buffer; finish: per-batch extras); the engine runs prepare a few batches
//!   ahead on a prefetch thread, gathers on a pool of threads (default: every core), hands
//!   batches over in planned order through bounded queues, and turns every fault (an error, a
//!   panic, a thread that cannot start) into an error at the consumer.
//! * [`reader`]: many large reads in flight, readahead, memory maps of resident blocks.
//! * [`batch`]: page-aligned batch buffers, recycled through pools (or caller-owned memory such
//!   as pinned host buffers).
//! * [`dist`]: the one `RANK`/`WORLD_SIZE` parser.
//!
//! Thread counts and I/O timing change when a batch is ready, never what is in it.

pub mod batch;
pub mod dist;
pub mod exec;
#[doc(hidden)]
pub mod fault;
pub mod order;
pub mod quality;
pub mod reader;

pub use batch::{lay_out, Buffer, BufferPool, Field};
pub use exec::{GatherPool, Job, Prepared, Stream, StreamOptions};
pub use order::{EpochOrder, Order};
