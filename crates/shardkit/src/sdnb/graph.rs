//! The FlatGraph FlatBuffer at byte 32 of every SDNB file (samediff.md §3), read and written
//! against shardkit's own schema, `samediff.fbs`.
//!
//! Reading: the region first goes through the `flatbuffers` verifier (every table, vector and
//! string of the parts shardkit interprets; ops and configuration tables shallowly), then a
//! small bounds-checked reader turns it into a [`Graph`]: variables with their descriptors and
//! array locations, metadata, and the *positions* of the parts shardkit keeps opaque (ops,
//! configuration, updater state, sub-graphs). The accessors are written by hand against the
//! schema: flatc's Rust output targets another version of the crate.
//!
//! Writing: variables, metadata, outputs, placeholders, loss variables and the training config
//! are encoded afresh. Opaque parts of a foreign graph are carried verbatim: their old bytes
//! (the *tail*, from the lowest byte they need to the end of the old buffer) are copied into
//! the new buffer at the same position modulo 8, and the new root points into them. Builders
//! write children before parents and FlatBuffers offsets only point forward, so everything an
//! opaque object reaches lies above it and the copy keeps it whole. Every graph shardkit builds
//! ends with a dead byte vector "shardkit" (12 bytes): in a shardkit file it marks where the
//! buffer ends and the zero slack begins, so listings report the real length and re-saves carry
//! no slack.
//!
//! The jobs live in submodules: `verify` (the verifier, one impl per table), `read` (the
//! bounds-checked reader and [`Graph::parse`]) and `build` (encoding a new graph, carrying the
//! opaque tail). This file holds the schema's field slots and the parsed descriptors.

use std::ops::Range;

use super::types::{DType, Order, VarType};

mod build;
mod read;
mod verify;

pub(crate) use build::{build, ArrayOut, Carried, GraphOut, VarOut};

/// The vtable byte offset of field `slot`.
const fn slot(n: u16) -> u16 {
    4 + 2 * n
}

mod fg {
    use super::slot;
    pub(crate) const ID: u16 = slot(0);
    pub(crate) const VARIABLES: u16 = slot(1);
    pub(crate) const NODES: u16 = slot(2);
    pub(crate) const OUTPUTS: u16 = slot(3);
    pub(crate) const CONFIGURATION: u16 = slot(4);
    pub(crate) const PLACEHOLDERS: u16 = slot(5);
    pub(crate) const LOSS_VARIABLES: u16 = slot(6);
    pub(crate) const TRAINING_CONFIG: u16 = slot(7);
    pub(crate) const UPDATER_STATE: u16 = slot(8);
    pub(crate) const METADATA_KEYS: u16 = slot(9);
    pub(crate) const METADATA_VALUES: u16 = slot(10);
    pub(crate) const SUB_INSTANCES: u16 = slot(11);
}
mod fv {
    use super::slot;
    pub(crate) const ID: u16 = slot(0);
    pub(crate) const NAME: u16 = slot(1);
    pub(crate) const DTYPE: u16 = slot(2);
    pub(crate) const SHAPE: u16 = slot(3);
    pub(crate) const NDARRAY: u16 = slot(4);
    pub(crate) const DEVICE: u16 = slot(5);
    pub(crate) const VARIABLETYPE: u16 = slot(6);
    pub(crate) const CONTROL_DEPS: [u16; 3] = [slot(7), slot(8), slot(9)];
}
mod fa {
    use super::slot;
    pub(crate) const SHAPE: u16 = slot(0);
    pub(crate) const BUFFER: u16 = slot(1);
    pub(crate) const DTYPE: u16 = slot(2);
    pub(crate) const BYTE_ORDER: u16 = slot(3);
    pub(crate) const BUFFER_CHUNKS: u16 = slot(4);
    pub(crate) const TOTAL_BUFFER_SIZE: u16 = slot(5);
    pub(crate) const EXTERNAL_FILENAME: u16 = slot(6);
    pub(crate) const IS_EXTERNAL: u16 = slot(7);
    pub(crate) const APPENDED_OFFSET: u16 = slot(8);
    pub(crate) const APPENDED_LENGTH: u16 = slot(9);
}
mod ip {
    use super::slot;
    pub(crate) const FIRST: u16 = slot(0);
    pub(crate) const SECOND: u16 = slot(1);
}

/// The dead vector that ends every shardkit graph carrying a tail (see the module docs).
const END_MARK: &[u8; 8] = b"shardkit";

// ---- The parsed graph ----

/// Where an inline or appended array's bytes are, as a FlatArray describes them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ArrayDesc {
    /// `FlatArray.shape`: plain dimensions; absent on some stubs of old files.
    pub shape: Option<Vec<i64>>,
    /// `FlatArray.dtype`.
    pub dtype: DType,
    /// `FlatArray.byteOrder`, read as SDNB's c/f order.
    pub order: Order,
    /// The inline element bytes' position in the graph region (`FlatArray.buffer`).
    pub inline: Option<Range<usize>>,
    /// `appendedDataOffset`, relative to the first blob.
    pub appended_offset: i64,
    /// `appendedDataLength`: > 0 marks a stub of an appended array.
    pub appended_length: i64,
}

/// One `FlatVariable`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VarDesc {
    /// `id`: (node id, output index); `None` when the table is absent.
    pub id: Option<(i32, i32)>,
    /// The variable's name.
    pub name: String,
    /// `dtype`.
    pub dtype: DType,
    /// `shape`: `None` = unknown, empty = scalar; -1 marks a free dimension.
    pub shape: Option<Vec<i64>>,
    /// `variabletype`.
    pub var_type: VarType,
    /// `device` (DL4J writes -1).
    pub device: i32,
    /// `controlDeps`, `controlDepForOp`, `controlDepsForVar`.
    pub control_deps: [Option<Vec<String>>; 3],
    /// `ndarray`: inline data, an appended stub, or an empty array.
    pub array: Option<ArrayDesc>,
}

/// A position in an old graph region that a rebuilt graph points back into, with the lowest
/// byte the object needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Opaque {
    pub pos: usize,
    pub lo: usize,
}

/// One `UpdaterState` table, kept opaque but listed by parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UpdaterRef {
    pub param: Option<String>,
    pub at: Opaque,
}

/// The parts of a graph shardkit carries without decoding.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct OpaqueParts {
    pub nodes: Option<Opaque>,
    pub configuration: Option<Opaque>,
    pub updater_state: Option<Vec<UpdaterRef>>,
    pub sub_instances: Option<Opaque>,
}

/// A parsed and verified FlatGraph.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Graph {
    /// `variables`, in order.
    pub variables: Vec<VarDesc>,
    /// `metadataKeys`/`metadataValues`, in stored order.
    pub metadata: Vec<(String, String)>,
    /// `outputs`: (node id, output index) pairs.
    pub outputs: Vec<(i32, i32)>,
    /// `placeholders`.
    pub placeholders: Option<Vec<String>>,
    /// `lossVariables`.
    pub loss_variables: Option<Vec<String>>,
    /// `trainingConfig` (JSON, not interpreted).
    pub training_config: Option<String>,
    /// The number of ops (`nodes`), which are not decoded.
    pub node_count: usize,
    /// Whether `nodes` is present (possibly empty); DL4J's native reader needs it.
    pub has_nodes: bool,
    /// The number of `subInstances`.
    pub sub_instance_count: usize,
    pub(crate) opaque: OpaqueParts,
    /// Where the buffer ends inside its region: the whole region, or just past the end mark
    /// of a shardkit graph followed by slack.
    pub(crate) extent: usize,
}

/// The byte length of a dense array, overflow-checked; `None` for negative dims or overflow.
pub(crate) fn byte_len(shape: &[i64], width: usize) -> Option<u64> {
    shape.iter().try_fold(width as u64, |acc, &d| {
        u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}
