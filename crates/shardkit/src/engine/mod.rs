//! The format-agnostic read engine: orders decided before any I/O ([`order`]), many large
//! reads in flight ([`reader`]), and batches gathered with one copy per row under a memory
//! budget ([`stream`]).

pub mod batch;
pub mod order;
pub mod quality;
pub mod reader;
pub mod stream;

pub use batch::{Buffer, BufferPool};
pub use order::{EpochOrder, Order};
pub use stream::{BlockSource, RawBatch, Stream, StreamConfig};
