//! SameDiff unified containers (Deeplearning4j ADR 0035, samediff.md): single SDNB files,
//! shard sets and SDZ archives.
//!
//! An SDNB file is a 32-byte big-endian header (`SDNB`, version 1, manifest offset M and
//! length), a FlatBuffers `FlatGraph` at byte 32 (variables, small arrays inline, ops,
//! metadata), raw little-endian blobs for arrays of 1 MiB and more, and at M a Java-serialized
//! `LinkedHashMap<String, Pair<Long, Long>>` locating each blob. A shard set splits one model
//! into `<base>.shard<i>-of-<N>.sdnb` (shard 0: graph and stubs; the rest: weights); an SDZ is
//! a ZIP holding either.
//!
//! [`open`] recognises all three, checks every offset once, and serves tensors from a memory
//! map; [`save`] and [`convert`] write them with 64-byte-aligned blobs and slack for in-place
//! [`set_metadata`] edits, still loadable by DL4J.

pub mod edit;
pub mod graph;
pub mod header;
pub mod manifest;
pub mod read;
pub mod sdz;
pub mod types;
pub mod write;

pub use edit::{set_metadata, EditOutcome};
pub use read::{open, Container, Kind, Limits, PartLayout, Storage, Tensor, Variable};
pub use sdz::ZipLimits;
pub use types::{DType, Order, VarType};
pub use write::{convert, save, Format, Progress, SaveOptions, TensorIn};
