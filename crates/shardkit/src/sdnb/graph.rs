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

use std::ops::Range;
use std::path::Path;

use flatbuffers::{
    FlatBufferBuilder, ForwardsUOffset, InvalidFlatbuffer, Vector, Verifiable, Verifier,
    VerifierOptions, WIPOffset,
};

use super::types::{DType, Order, VarType};
use crate::error::{Error, Result};

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

// ---- Verification (the flatbuffers crate's verifier, one impl per table shardkit reads) ----

struct FlatGraphV;
struct FlatVariableV;
struct FlatArrayV;
struct IntPairV;
struct BufferChunkV;
struct UpdaterStateV;
struct SubInstanceV;
/// A table shardkit never looks inside: only its vtable and extent are checked.
struct OpaqueV;

type Strings<'a> = Vector<'a, ForwardsUOffset<&'a str>>;
type Tables<'a, T> = Vector<'a, ForwardsUOffset<T>>;
type VResult = std::result::Result<(), InvalidFlatbuffer>;

impl Verifiable for OpaqueV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?.finish();
        Ok(())
    }
}
impl Verifiable for IntPairV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i32>("first", ip::FIRST, false)?
            .visit_field::<i32>("second", ip::SECOND, false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for BufferChunkV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i64>("index", slot(0), false)?
            .visit_field::<ForwardsUOffset<Vector<i8>>>("data", slot(1), false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatArrayV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<Vector<i64>>>("shape", fa::SHAPE, false)?
            .visit_field::<ForwardsUOffset<Vector<i8>>>("buffer", fa::BUFFER, false)?
            .visit_field::<i8>("dtype", fa::DTYPE, false)?
            .visit_field::<i8>("byteOrder", fa::BYTE_ORDER, false)?
            .visit_field::<ForwardsUOffset<Tables<BufferChunkV>>>(
                "bufferChunks",
                fa::BUFFER_CHUNKS,
                false,
            )?
            .visit_field::<i64>("totalBufferSize", fa::TOTAL_BUFFER_SIZE, false)?
            .visit_field::<ForwardsUOffset<Strings>>(
                "externalDataFilename",
                fa::EXTERNAL_FILENAME,
                false,
            )?
            .visit_field::<bool>("isExternal", fa::IS_EXTERNAL, false)?
            .visit_field::<i64>("appendedDataOffset", fa::APPENDED_OFFSET, false)?
            .visit_field::<i64>("appendedDataLength", fa::APPENDED_LENGTH, false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatVariableV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<IntPairV>>("id", fv::ID, false)?
            .visit_field::<ForwardsUOffset<&str>>("name", fv::NAME, false)?
            .visit_field::<i8>("dtype", fv::DTYPE, false)?
            .visit_field::<ForwardsUOffset<Vector<i64>>>("shape", fv::SHAPE, false)?
            .visit_field::<ForwardsUOffset<FlatArrayV>>("ndarray", fv::NDARRAY, false)?
            .visit_field::<i32>("device", fv::DEVICE, false)?
            .visit_field::<i8>("variabletype", fv::VARIABLETYPE, false)?
            .visit_field::<ForwardsUOffset<Strings>>("controlDeps", fv::CONTROL_DEPS[0], false)?
            .visit_field::<ForwardsUOffset<Strings>>("controlDepForOp", fv::CONTROL_DEPS[1], false)?
            .visit_field::<ForwardsUOffset<Strings>>(
                "controlDepsForVar",
                fv::CONTROL_DEPS[2],
                false,
            )?
            .finish();
        Ok(())
    }
}
impl Verifiable for UpdaterStateV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<&str>>("paramName", slot(0), false)?
            .visit_field::<ForwardsUOffset<Strings>>("updaterStateKeys", slot(1), false)?
            .visit_field::<ForwardsUOffset<Tables<FlatArrayV>>>(
                "updaterStateValues",
                slot(2),
                false,
            )?
            .finish();
        Ok(())
    }
}
impl Verifiable for SubInstanceV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<ForwardsUOffset<&str>>("name", slot(0), false)?
            .visit_field::<ForwardsUOffset<Vector<u8>>>("serializedData", slot(1), false)?
            .finish();
        Ok(())
    }
}
impl Verifiable for FlatGraphV {
    fn run_verifier(v: &mut Verifier, pos: usize) -> VResult {
        v.visit_table(pos)?
            .visit_field::<i64>("id", fg::ID, false)?
            .visit_field::<ForwardsUOffset<Tables<FlatVariableV>>>(
                "variables",
                fg::VARIABLES,
                false,
            )?
            .visit_field::<ForwardsUOffset<Tables<OpaqueV>>>("nodes", fg::NODES, false)?
            .visit_field::<ForwardsUOffset<Tables<IntPairV>>>("outputs", fg::OUTPUTS, false)?
            .visit_field::<ForwardsUOffset<OpaqueV>>("configuration", fg::CONFIGURATION, false)?
            .visit_field::<ForwardsUOffset<Strings>>("placeholders", fg::PLACEHOLDERS, false)?
            .visit_field::<ForwardsUOffset<Strings>>("lossVariables", fg::LOSS_VARIABLES, false)?
            .visit_field::<ForwardsUOffset<&str>>("trainingConfig", fg::TRAINING_CONFIG, false)?
            .visit_field::<ForwardsUOffset<Tables<UpdaterStateV>>>(
                "updaterState",
                fg::UPDATER_STATE,
                false,
            )?
            .visit_field::<ForwardsUOffset<Strings>>("metadataKeys", fg::METADATA_KEYS, false)?
            .visit_field::<ForwardsUOffset<Strings>>("metadataValues", fg::METADATA_VALUES, false)?
            .visit_field::<ForwardsUOffset<Tables<SubInstanceV>>>(
                "subInstances",
                fg::SUB_INSTANCES,
                false,
            )?
            .finish();
        Ok(())
    }
}

/// Runs the verifier over a whole graph region.
fn verify(region: &[u8], path: &Path) -> Result<()> {
    // Offsets may alias, so a small region can describe a huge tree; bounding the verified
    // size (aliases counted each time) bounds what parsing allocates to a multiple of the
    // region, with room for the sharing a real builder produces.
    let opts = VerifierOptions {
        max_depth: 64,
        max_tables: region.len() / 4 + 1024,
        max_apparent_size: region.len().saturating_mul(4).max(16 << 20),
        ignore_missing_null_terminator: false,
    };
    let mut v = Verifier::new(&opts, region);
    <ForwardsUOffset<FlatGraphV>>::run_verifier(&mut v, 0)
        .map_err(|e| Error::format(path, format!("the FlatGraph fails verification: {e}")))
}

// ---- A bounds-checked reader over a verified region ----

#[derive(Clone, Copy)]
struct Fb<'a> {
    b: &'a [u8],
    path: &'a Path,
}

/// A table: its position and its vtable's.
#[derive(Clone, Copy)]
struct Tab {
    pos: usize,
    vt: usize,
    vt_len: usize,
}

impl<'a> Fb<'a> {
    fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::format(self.path, format!("FlatGraph: {what}"))
    }
    fn bytes(&self, pos: usize, n: usize) -> Result<&'a [u8]> {
        pos.checked_add(n)
            .and_then(|end| self.b.get(pos..end))
            .ok_or_else(|| self.err(format!("{n} bytes at {pos} lie outside the buffer")))
    }
    fn u16(&self, pos: usize) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.bytes(pos, 2)?.try_into().expect("2"),
        ))
    }
    fn u32(&self, pos: usize) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(pos, 4)?.try_into().expect("4"),
        ))
    }
    fn i64(&self, pos: usize) -> Result<i64> {
        Ok(i64::from_le_bytes(
            self.bytes(pos, 8)?.try_into().expect("8"),
        ))
    }
    /// The target of the uoffset stored at `pos`.
    fn follow(&self, pos: usize) -> Result<usize> {
        pos.checked_add(self.u32(pos)? as usize)
            .ok_or_else(|| self.err("offset overflow"))
    }
    fn table(&self, pos: usize) -> Result<Tab> {
        let soff = self.u32(pos)? as i32 as i64;
        let vt = usize::try_from(pos as i64 - soff).map_err(|_| self.err("vtable before 0"))?;
        let vt_len = self.u16(vt)? as usize;
        Ok(Tab { pos, vt, vt_len })
    }
    /// The absolute position of a present field.
    fn field(&self, t: Tab, slot: u16) -> Result<Option<usize>> {
        let s = slot as usize;
        if s + 2 > t.vt_len {
            return Ok(None);
        }
        match self.u16(t.vt + s)? {
            0 => Ok(None),
            off => Ok(Some(t.pos + off as usize)),
        }
    }
    fn scalar_i64(&self, t: Tab, slot: u16) -> Result<i64> {
        match self.field(t, slot)? {
            Some(p) => self.i64(p),
            None => Ok(0),
        }
    }
    fn scalar_i32(&self, t: Tab, slot: u16, default: i32) -> Result<i32> {
        match self.field(t, slot)? {
            Some(p) => Ok(self.u32(p)? as i32),
            None => Ok(default),
        }
    }
    fn scalar_i8(&self, t: Tab, slot: u16) -> Result<i8> {
        match self.field(t, slot)? {
            Some(p) => Ok(self.bytes(p, 1)?[0] as i8),
            None => Ok(0),
        }
    }
    fn child(&self, t: Tab, slot: u16) -> Result<Option<usize>> {
        self.field(t, slot)?.map(|p| self.follow(p)).transpose()
    }
    fn sub_table(&self, t: Tab, slot: u16) -> Result<Option<Tab>> {
        self.child(t, slot)?.map(|p| self.table(p)).transpose()
    }
    /// A vector's element count and first element position.
    fn vector(&self, pos: usize, elem: usize) -> Result<(usize, usize)> {
        let n = self.u32(pos)? as usize;
        let start = pos + 4;
        n.checked_mul(elem)
            .and_then(|bytes| start.checked_add(bytes))
            .filter(|&end| end <= self.b.len())
            .ok_or_else(|| self.err(format!("a vector of {n} at {pos} overruns the buffer")))?;
        Ok((n, start))
    }
    fn string_at(&self, pos: usize) -> Result<&'a str> {
        let (n, start) = self.vector(pos, 1)?;
        std::str::from_utf8(self.bytes(start, n)?).map_err(|_| self.err("a string is not UTF-8"))
    }
    fn string(&self, t: Tab, slot: u16) -> Result<Option<&'a str>> {
        self.child(t, slot)?.map(|p| self.string_at(p)).transpose()
    }
    /// The elements of the vector in `slot`, each `width` bytes, read by `read` at its position.
    fn elements<T>(
        &self,
        t: Tab,
        slot: u16,
        width: usize,
        read: impl Fn(usize) -> Result<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(v) = self.child(t, slot)? else {
            return Ok(None);
        };
        let (n, start) = self.vector(v, width)?;
        (0..n)
            .map(|i| read(start + width * i))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    fn tables(&self, t: Tab, slot: u16) -> Result<Option<Vec<usize>>> {
        self.elements(t, slot, 4, |p| self.follow(p))
    }
    fn strings(&self, t: Tab, slot: u16) -> Result<Option<Vec<String>>> {
        self.elements(t, slot, 4, |p| {
            self.string_at(self.follow(p)?).map(str::to_owned)
        })
    }
    fn longs(&self, t: Tab, slot: u16) -> Result<Option<Vec<i64>>> {
        self.elements(t, slot, 8, |p| self.i64(p))
    }
    fn byte_range(&self, t: Tab, slot: u16) -> Result<Option<Range<usize>>> {
        let Some(v) = self.child(t, slot)? else {
            return Ok(None);
        };
        let (n, start) = self.vector(v, 1)?;
        Ok(Some(start..start + n))
    }
    /// The lowest byte a table needs of its own (itself or its vtable).
    fn table_lo(&self, pos: usize) -> Result<usize> {
        Ok(self.table(pos)?.vt.min(pos))
    }
}

// ---- The parsed graph ----

/// Where an inline or appended array's bytes are, as a FlatArray describes them.
#[derive(Debug, Clone, PartialEq)]
pub struct ArrayDesc {
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
pub struct VarDesc {
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
pub struct Graph {
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
    /// The number of `subInstances`.
    pub sub_instance_count: usize,
    pub(crate) opaque: OpaqueParts,
    /// Where the buffer ends inside its region: the whole region, or just past the end mark
    /// of a shardkit graph followed by slack.
    pub(crate) extent: usize,
}

/// The byte length of a dense array, overflow-checked; `None` for negative dims or overflow.
pub fn byte_len(shape: &[i64], width: usize) -> Option<u64> {
    shape.iter().try_fold(width as u64, |acc, &d| {
        u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}

impl Graph {
    /// Verifies and parses the graph region (bytes [32, B) of an SDNB file); `path` names the
    /// file in errors.
    pub fn parse(region: &[u8], path: &Path) -> Result<Graph> {
        verify(region, path)?;
        let r = Fb { b: region, path };
        let root = r.table(r.follow(0)?)?;

        let mut variables = Vec::new();
        for (i, p) in r
            .tables(root, fg::VARIABLES)?
            .unwrap_or_default()
            .into_iter()
            .enumerate()
        {
            variables.push(parse_variable(&r, p).map_err(|e| match e {
                Error::Format { path, rule } => Error::Format {
                    path,
                    rule: format!("variable {i}: {rule}"),
                },
                e => e,
            })?);
        }
        let keys = r.strings(root, fg::METADATA_KEYS)?.unwrap_or_default();
        let values = r.strings(root, fg::METADATA_VALUES)?.unwrap_or_default();
        if keys.len() != values.len() {
            return Err(r.err(format!(
                "{} metadata keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(k) = keys.iter().find(|k| !seen.insert(k.as_str())) {
            return Err(r.err(format!("metadata key {k:?} appears twice")));
        }
        let metadata: Vec<(String, String)> = keys.into_iter().zip(values).collect();

        let mut outputs = Vec::new();
        for p in r.tables(root, fg::OUTPUTS)?.unwrap_or_default() {
            outputs.push(int_pair(&r, p)?);
        }

        let vector_of_tables = |slot: u16| -> Result<Option<(Opaque, usize)>> {
            let Some(v) = r.child(root, slot)? else {
                return Ok(None);
            };
            let elems = r.tables(root, slot)?.unwrap_or_default();
            if elems.is_empty() {
                // Nothing to carry; shardkit always writes `nodes`, empty when there are none.
                return Ok(None);
            }
            let mut lo = v;
            for &e in &elems {
                lo = lo.min(r.table_lo(e)?);
            }
            Ok(Some((Opaque { pos: v, lo }, elems.len())))
        };
        let nodes = vector_of_tables(fg::NODES)?;
        let subs = vector_of_tables(fg::SUB_INSTANCES)?;
        let configuration = match r.child(root, fg::CONFIGURATION)? {
            Some(p) => Some(Opaque {
                pos: p,
                lo: r.table_lo(p)?,
            }),
            None => None,
        };
        let updater_state = match r.tables(root, fg::UPDATER_STATE)? {
            Some(ps) => Some(
                ps.into_iter()
                    .map(|p| {
                        Ok(UpdaterRef {
                            param: r.string(r.table(p)?, slot(0))?.map(str::to_owned),
                            at: Opaque {
                                pos: p,
                                lo: r.table_lo(p)?,
                            },
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            None => None,
        };

        let opaque = OpaqueParts {
            nodes: nodes.map(|n| n.0),
            configuration,
            updater_state,
            sub_instances: subs.map(|s| s.0),
        };
        // A part placed after the end mark (only a crafted file does that: zero bytes read as
        // an empty table) means the mark does not end this buffer; carry the whole region.
        let mut extent = extent(region);
        let mut positions = opaque
            .nodes
            .iter()
            .chain(&opaque.configuration)
            .chain(&opaque.sub_instances)
            .chain(opaque.updater_state.iter().flatten().map(|u| &u.at));
        if positions.any(|o| o.pos >= extent) {
            extent = region.len();
        }
        Ok(Graph {
            variables,
            metadata,
            outputs,
            placeholders: r.strings(root, fg::PLACEHOLDERS)?,
            loss_variables: r.strings(root, fg::LOSS_VARIABLES)?,
            training_config: r.string(root, fg::TRAINING_CONFIG)?.map(str::to_owned),
            node_count: nodes.map_or(0, |n| n.1),
            sub_instance_count: subs.map_or(0, |s| s.1),
            opaque,
            extent,
        })
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The parameter names of the updater state entries (`None` for an entry without one).
    pub fn updater_params(&self) -> Vec<Option<&str>> {
        self.opaque
            .updater_state
            .iter()
            .flatten()
            .map(|u| u.param.as_deref())
            .collect()
    }
}

/// The end of the buffer's carried part inside `region`: where the tail ends in front of a
/// shardkit end mark (followed only by zeros), else the whole region (DL4J leaves no gap after
/// its buffer).
fn extent(region: &[u8]) -> usize {
    let end = region.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    // From the end: the mark, its u32 length, and the 4 zero bytes that 8-align the tail.
    let block = [&[0, 0, 0, 0, 8, 0, 0, 0][..], &END_MARK[..]].concat();
    if end >= block.len() && end % 8 == 0 && region[end - block.len()..end] == block[..] {
        end - block.len()
    } else {
        region.len()
    }
}

fn int_pair(r: &Fb, pos: usize) -> Result<(i32, i32)> {
    let t = r.table(pos)?;
    Ok((
        r.scalar_i32(t, ip::FIRST, 0)?,
        r.scalar_i32(t, ip::SECOND, 0)?,
    ))
}

fn parse_variable(r: &Fb, pos: usize) -> Result<VarDesc> {
    let t = r.table(pos)?;
    let name = r
        .string(t, fv::NAME)?
        .ok_or_else(|| r.err("a variable has no name"))?
        .to_owned();
    let named = |e: Error| match e {
        Error::Format { path, rule } => Error::Format {
            path,
            rule: format!("{name:?}: {rule}"),
        },
        Error::Invalid(rule) => Error::format(r.path, format!("FlatGraph: {name:?}: {rule}")),
        e => e,
    };
    let id = match r.child(t, fv::ID)? {
        Some(p) => Some(int_pair(r, p)?),
        None => None,
    };
    let dtype = DType::from_code(r.scalar_i8(t, fv::DTYPE)?).map_err(named)?;
    let var_type = VarType::from_code(r.scalar_i8(t, fv::VARIABLETYPE)?).map_err(named)?;
    let shape = r.longs(t, fv::SHAPE)?;
    if let Some(d) = shape.iter().flatten().find(|&&d| d < -1) {
        return Err(named(r.err(format!("shape dimension {d}"))));
    }
    let array = match r.sub_table(t, fv::NDARRAY)? {
        Some(a) => Some(parse_array(r, a).map_err(named)?),
        None => None,
    };
    Ok(VarDesc {
        id,
        dtype,
        shape,
        var_type,
        device: r.scalar_i32(t, fv::DEVICE, 0)?,
        control_deps: [
            r.strings(t, fv::CONTROL_DEPS[0])?,
            r.strings(t, fv::CONTROL_DEPS[1])?,
            r.strings(t, fv::CONTROL_DEPS[2])?,
        ],
        array,
        name,
    })
}

fn parse_array(r: &Fb, t: Tab) -> Result<ArrayDesc> {
    if r.scalar_i8(t, fa::IS_EXTERNAL)? != 0 {
        return Err(r.err(
            "isExternal arrays (data in another file) are refused; shardkit follows no path",
        ));
    }
    if let Some(p) = r.child(t, fa::BUFFER_CHUNKS)? {
        if r.u32(p)? > 0 {
            return Err(r.err(
                "bufferChunks (the legacy chunked layout) are not part of SDNB; DL4J's SDNB \
                 loader refuses them too",
            ));
        }
    }
    let order = match r.scalar_i8(t, fa::BYTE_ORDER)? {
        0 => Order::C,
        1 => Order::F,
        b => return Err(r.err(format!("byteOrder {b} (SDNB uses 0 = c, 1 = f)"))),
    };
    let shape = r.longs(t, fa::SHAPE)?;
    if let Some(d) = shape.iter().flatten().find(|&&d| d < 0) {
        return Err(r.err(format!("array shape dimension {d}")));
    }
    let appended_offset = r.scalar_i64(t, fa::APPENDED_OFFSET)?;
    let appended_length = r.scalar_i64(t, fa::APPENDED_LENGTH)?;
    if appended_offset < 0 || appended_length < 0 {
        return Err(r.err(format!(
            "appended data offset {appended_offset} or length {appended_length} is negative"
        )));
    }
    Ok(ArrayDesc {
        shape,
        dtype: DType::from_code(r.scalar_i8(t, fa::DTYPE)?)?,
        order,
        inline: r.byte_range(t, fa::BUFFER)?.filter(|b| !b.is_empty()),
        appended_offset,
        appended_length,
    })
}

// ---- Writing ----

/// What a written variable's `ndarray` holds.
#[derive(Debug, Clone)]
pub(crate) enum ArrayOut<'a> {
    /// No `ndarray`.
    None,
    /// Inline bytes (none for a zero-element array).
    Inline {
        dtype: DType,
        shape: Vec<i64>,
        order: Order,
        bytes: &'a [u8],
    },
    /// A stub for an appended blob at `rel` from the first blob.
    Stub {
        dtype: DType,
        shape: Vec<i64>,
        order: Order,
        rel: u64,
        len: u64,
    },
}

/// A variable to write.
#[derive(Debug, Clone)]
pub(crate) struct VarOut<'a> {
    pub desc: &'a VarDesc,
    pub array: ArrayOut<'a>,
}

/// An opaque object of an old graph region, carried into a new graph.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Carried<'a> {
    pub region: &'a [u8],
    pub extent: usize,
    pub at: Opaque,
}

/// Everything a new graph holds.
#[derive(Debug, Clone, Default)]
pub(crate) struct GraphOut<'a> {
    pub variables: Vec<VarOut<'a>>,
    /// Sorted and completed with the forced keys by [`build`].
    pub metadata: Vec<(String, String)>,
    pub outputs: Vec<(i32, i32)>,
    pub placeholders: Option<Vec<String>>,
    pub loss_variables: Option<Vec<String>>,
    pub training_config: Option<String>,
    pub nodes: Option<Carried<'a>>,
    pub configuration: Option<Carried<'a>>,
    pub updater_state: Option<Vec<Carried<'a>>>,
    pub sub_instances: Option<Carried<'a>>,
}

/// Keys every SDNB carries with fixed values (samediff.md §3.3).
pub(crate) const FORCED_METADATA: [(&str, &str); 2] = [
    ("nd4j.format.version", "1"),
    ("nd4j.format.type", "APPENDED_BLOB"),
];

/// `metadata` with the forced keys set and sorted as Java sorts strings (by UTF-16 units).
pub(crate) fn final_metadata(metadata: &[(String, String)]) -> Vec<(String, String)> {
    let mut m: Vec<(String, String)> = metadata
        .iter()
        .filter(|(k, _)| !FORCED_METADATA.iter().any(|(f, _)| f == k))
        .cloned()
        .collect();
    m.extend(
        FORCED_METADATA
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    m.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
    m.dedup_by(|a, b| a.0 == b.0);
    m
}

/// The tails of the old regions a graph points into, one per region.
struct Tail<'a> {
    region: &'a [u8],
    lo: usize,
    /// The builder offset (distance from the end) of the byte at `lo`.
    base: u32,
}

/// An upper bound of the built size, so an oversized graph is refused before the builder's
/// 2 GiB assertion.
fn size_bound(g: &GraphOut) -> u64 {
    let strs =
        |v: &Option<Vec<String>>| v.iter().flatten().map(|s| s.len() as u64 + 12).sum::<u64>();
    let mut n = 4096 + strs(&g.placeholders) + strs(&g.loss_variables);
    n += g
        .training_config
        .as_ref()
        .map_or(0, |s| s.len() as u64 + 12);
    n += g
        .metadata
        .iter()
        .map(|(k, v)| k.len() as u64 + v.len() as u64 + 40)
        .sum::<u64>();
    n += g.outputs.len() as u64 * 32;
    for v in &g.variables {
        let d = v.desc;
        n += 256 + d.name.len() as u64 + d.shape.as_ref().map_or(0, |s| 8 * s.len() as u64);
        n += d.control_deps.iter().map(strs).sum::<u64>();
        n += match &v.array {
            ArrayOut::None => 0,
            ArrayOut::Inline { shape, bytes, .. } => {
                96 + 8 * shape.len() as u64 + bytes.len() as u64
            }
            ArrayOut::Stub { shape, .. } => 96 + 8 * shape.len() as u64,
        };
    }
    let carried = g
        .nodes
        .iter()
        .chain(&g.configuration)
        .chain(&g.sub_instances)
        .chain(g.updater_state.iter().flatten());
    let mut regions: Vec<(usize, usize)> = carried
        .map(|c| (c.region.as_ptr() as usize, c.extent))
        .collect();
    regions.sort();
    regions.dedup();
    n + regions.iter().map(|r| r.1 as u64 + 32).sum::<u64>()
}

/// Builds the FlatGraph buffer (to be written at byte 32) and checks it parses back.
pub(crate) fn build(g: &GraphOut, path: &Path) -> Result<Vec<u8>> {
    let bound = size_bound(g);
    if bound > (i32::MAX as u64) - (1 << 20) {
        return Err(Error::Invalid(format!(
            "{}: the FlatGraph would reach about {bound} bytes; FlatBuffers (and DL4J) cap it \
             below 2 GiB. Inline arrays (under 1 MiB each) and updater state add up there",
            path.display()
        )));
    }
    let mut b = FlatBufferBuilder::with_capacity((bound as usize).min(1 << 26));

    // Carried tails first: they end up last in the buffer, behind the end mark.
    let carried: Vec<&Carried> = g
        .nodes
        .iter()
        .chain(&g.configuration)
        .chain(&g.sub_instances)
        .chain(g.updater_state.iter().flatten())
        .collect();
    for c in &carried {
        if c.at.lo > c.at.pos || c.at.pos >= c.extent.min(c.region.len()) {
            return Err(Error::format(
                path,
                format!(
                    "an opaque graph part at byte {} lies outside the buffer it is carried from \
                     (which ends at {})",
                    c.at.pos, c.extent
                ),
            ));
        }
    }
    let mut tails: Vec<Tail> = Vec::new();
    // The end mark comes first so it lands last: it tells where this buffer ends and zero
    // slack begins, for listings and for re-saves that carry tails.
    b.create_vector(&END_MARK[..]);
    if !carried.is_empty() {
        let mut groups: Vec<(&[u8], usize, usize)> = Vec::new(); // region, lo, extent
        for c in &carried {
            match groups.iter_mut().find(|(r, ..)| std::ptr::eq(*r, c.region)) {
                Some(gr) => gr.1 = gr.1.min(c.at.lo),
                None => groups.push((c.region, c.at.lo, c.extent)),
            }
        }
        for (region, lo, ext) in groups {
            let lo = lo / 8 * 8;
            let ext = ext.min(region.len()).max(lo);
            let mut bytes = region[lo..ext].to_vec();
            bytes.resize(bytes.len().div_ceil(8) * 8, 0);
            // The data must start 8-aligned from the end, as it was in its old region.
            while !b.unfinished_data().len().is_multiple_of(8) {
                b.push(0u8);
            }
            let before = b.unfinished_data().len();
            b.create_vector(&bytes[..]);
            tails.push(Tail {
                region,
                lo,
                base: (before + bytes.len()) as u32,
            });
        }
    }
    let point = |c: &Carried| -> u32 {
        let t = tails
            .iter()
            .find(|t| std::ptr::eq(t.region, c.region))
            .expect("every carried region has a tail");
        t.base - (c.at.pos - t.lo) as u32
    };

    // Variables.
    let mut var_offsets = Vec::with_capacity(g.variables.len());
    for v in &g.variables {
        var_offsets.push(build_variable(&mut b, v));
    }
    let variables = b.create_vector(&var_offsets);
    let nodes = match &g.nodes {
        Some(c) => WIPOffset::<Vector<ForwardsUOffset<()>>>::new(point(c)),
        None => {
            let empty: [WIPOffset<()>; 0] = [];
            b.create_vector(&empty)
        }
    };
    let mut output_tables = Vec::with_capacity(g.outputs.len());
    for &(first, second) in &g.outputs {
        output_tables.push(int_pair_out(&mut b, first, second));
    }
    let outputs = b.create_vector(&output_tables);
    let placeholders = g.placeholders.as_ref().map(|s| strings_out(&mut b, s));
    let loss = g.loss_variables.as_ref().map(|s| strings_out(&mut b, s));
    let training = g.training_config.as_ref().map(|s| b.create_string(s));
    let updater = g.updater_state.as_ref().map(|us| {
        let offs: Vec<WIPOffset<()>> = us.iter().map(|c| WIPOffset::new(point(c))).collect();
        b.create_vector(&offs)
    });
    let metadata = final_metadata(&g.metadata);
    let keys: Vec<String> = metadata.iter().map(|(k, _)| k.clone()).collect();
    let values: Vec<String> = metadata.iter().map(|(_, v)| v.clone()).collect();
    let keys = strings_out(&mut b, &keys);
    let values = strings_out(&mut b, &values);

    let root = b.start_table();
    b.push_slot_always(fg::ID, 0i64);
    b.push_slot_always(fg::VARIABLES, variables);
    b.push_slot_always(fg::NODES, nodes);
    b.push_slot_always(fg::OUTPUTS, outputs);
    if let Some(c) = &g.configuration {
        b.push_slot_always(fg::CONFIGURATION, WIPOffset::<()>::new(point(c)));
    }
    if let Some(p) = placeholders {
        b.push_slot_always(fg::PLACEHOLDERS, p);
    }
    if let Some(l) = loss {
        b.push_slot_always(fg::LOSS_VARIABLES, l);
    }
    if let Some(t) = training {
        b.push_slot_always(fg::TRAINING_CONFIG, t);
    }
    if let Some(u) = updater {
        b.push_slot_always(fg::UPDATER_STATE, u);
    }
    b.push_slot_always(fg::METADATA_KEYS, keys);
    b.push_slot_always(fg::METADATA_VALUES, values);
    if let Some(c) = &g.sub_instances {
        b.push_slot_always(fg::SUB_INSTANCES, WIPOffset::<()>::new(point(c)));
    }
    let root = b.end_table(root);
    b.finish_minimal(root);
    let out = b.finished_data().to_vec();
    debug_assert_eq!(out.len() % 8, 0);
    // The result must pass the same verifier and parse to the same descriptors.
    Graph::parse(&out, path).map_err(|e| {
        Error::Internal(format!(
            "{}: internal error, the graph shardkit built does not parse back: {e}",
            path.display()
        ))
    })?;
    Ok(out)
}

fn int_pair_out(b: &mut FlatBufferBuilder, first: i32, second: i32) -> WIPOffset<()> {
    let t = b.start_table();
    b.push_slot(ip::FIRST, first, 0);
    b.push_slot(ip::SECOND, second, 0);
    WIPOffset::new(b.end_table(t).value())
}

fn strings_out<'b>(
    b: &mut FlatBufferBuilder<'b>,
    s: &[String],
) -> WIPOffset<Vector<'b, ForwardsUOffset<&'b str>>> {
    let offs: Vec<_> = s.iter().map(|x| b.create_string(x)).collect();
    b.create_vector(&offs)
}

/// A byte vector whose data starts 8-aligned in the finished buffer, so inline tensors can be
/// viewed in place.
fn aligned_bytes<'b>(b: &mut FlatBufferBuilder<'b>, bytes: &[u8]) -> WIPOffset<Vector<'b, u8>> {
    while !(b.unfinished_data().len() + bytes.len()).is_multiple_of(8) {
        b.push(0u8);
    }
    b.create_vector(bytes)
}

fn array_out(b: &mut FlatBufferBuilder, a: &ArrayOut) -> Option<WIPOffset<()>> {
    let (dtype, shape, order) = match a {
        ArrayOut::None => return None,
        ArrayOut::Inline {
            dtype,
            shape,
            order,
            ..
        }
        | ArrayOut::Stub {
            dtype,
            shape,
            order,
            ..
        } => (*dtype, shape, *order),
    };
    let shape = b.create_vector(shape);
    let buffer = match a {
        ArrayOut::Inline { bytes, .. } if !bytes.is_empty() => Some(aligned_bytes(b, bytes)),
        _ => None,
    };
    let t = b.start_table();
    b.push_slot_always(fa::SHAPE, shape);
    if let Some(buf) = buffer {
        b.push_slot_always(fa::BUFFER, buf);
    }
    b.push_slot(fa::DTYPE, dtype.code(), 0);
    b.push_slot(fa::BYTE_ORDER, (order == Order::F) as i8, 0);
    if let ArrayOut::Stub { rel, len, .. } = a {
        b.push_slot(fa::TOTAL_BUFFER_SIZE, *len as i64, 0);
        b.push_slot(fa::APPENDED_OFFSET, *rel as i64, 0);
        b.push_slot(fa::APPENDED_LENGTH, *len as i64, 0);
    }
    Some(WIPOffset::new(b.end_table(t).value()))
}

fn build_variable<'b>(b: &mut FlatBufferBuilder<'b>, v: &VarOut) -> WIPOffset<()> {
    let d = v.desc;
    let array = array_out(b, &v.array);
    let id = d.id.map(|(f, s)| int_pair_out(b, f, s));
    let name = b.create_string(&d.name);
    let shape = d.shape.as_ref().map(|s| b.create_vector(s));
    let deps: Vec<_> = d
        .control_deps
        .iter()
        .map(|c| c.as_ref().map(|s| strings_out(b, s)))
        .collect();
    let t = b.start_table();
    if let Some(id) = id {
        b.push_slot_always(fv::ID, id);
    }
    b.push_slot_always(fv::NAME, name);
    b.push_slot(fv::DTYPE, d.dtype.code(), 0);
    if let Some(s) = shape {
        b.push_slot_always(fv::SHAPE, s);
    }
    if let Some(a) = array {
        b.push_slot_always(fv::NDARRAY, a);
    }
    b.push_slot(fv::DEVICE, d.device, 0);
    b.push_slot(fv::VARIABLETYPE, d.var_type.code(), 0);
    for (slot, dep) in fv::CONTROL_DEPS.iter().zip(deps) {
        if let Some(dep) = dep {
            b.push_slot_always(*slot, dep);
        }
    }
    WIPOffset::new(b.end_table(t).value())
}

impl Graph {
    /// The opaque parts of this graph (parsed from `region`), ready to carry into a new one.
    pub(crate) fn carried<'a>(&self, region: &'a [u8]) -> CarriedParts<'a> {
        let c = |at: Opaque| Carried {
            region,
            extent: self.extent,
            at,
        };
        CarriedParts {
            nodes: self.opaque.nodes.map(c),
            configuration: self.opaque.configuration.map(c),
            updater_state: self
                .opaque
                .updater_state
                .as_ref()
                .map(|us| us.iter().map(|u| (u.param.clone(), c(u.at))).collect()),
            sub_instances: self.opaque.sub_instances.map(c),
        }
    }
}

/// A graph's opaque parts tied to their region bytes.
#[derive(Debug, Clone)]
pub(crate) struct CarriedParts<'a> {
    pub nodes: Option<Carried<'a>>,
    pub configuration: Option<Carried<'a>>,
    pub updater_state: Option<Vec<(Option<String>, Carried<'a>)>>,
    pub sub_instances: Option<Carried<'a>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(name: &str, dtype: DType, shape: Option<Vec<i64>>, vt: VarType) -> VarDesc {
        VarDesc {
            id: Some((0, 0)),
            name: name.into(),
            dtype,
            shape,
            var_type: vt,
            device: -1,
            control_deps: [None, Some(vec!["op1".into()]), None],
            array: None,
        }
    }

    #[test]
    fn variables_metadata_and_stubs_round_trip() {
        let w = var("w", DType::Float, Some(vec![2, 3]), VarType::Variable);
        let big = var(
            "big",
            DType::Bfloat16,
            Some(vec![1024, 1024]),
            VarType::Constant,
        );
        let x = var("x", DType::Float, Some(vec![-1, 3]), VarType::Placeholder);
        let s = var("s", DType::Double, Some(vec![]), VarType::Constant);
        let data: Vec<u8> = (0..24).collect();
        let scalar = 1.5f64.to_le_bytes();
        let g = GraphOut {
            variables: vec![
                VarOut {
                    desc: &w,
                    array: ArrayOut::Inline {
                        dtype: DType::Float,
                        shape: vec![2, 3],
                        order: Order::F,
                        bytes: &data,
                    },
                },
                VarOut {
                    desc: &big,
                    array: ArrayOut::Stub {
                        dtype: DType::Bfloat16,
                        shape: vec![1024, 1024],
                        order: Order::C,
                        rel: 0,
                        len: 2 << 20,
                    },
                },
                VarOut {
                    desc: &x,
                    array: ArrayOut::None,
                },
                VarOut {
                    desc: &s,
                    array: ArrayOut::Inline {
                        dtype: DType::Double,
                        shape: vec![],
                        order: Order::C,
                        bytes: &scalar,
                    },
                },
            ],
            metadata: vec![
                ("ü".into(), "1".into()),
                ("\u{ffff}".into(), "2".into()),
                ("😀".into(), "3".into()),
                ("nd4j.format.version".into(), "7".into()),
                ("a".into(), "".into()),
            ],
            outputs: vec![(3, 1)],
            training_config: Some("{}".into()),
            ..Default::default()
        };
        let buf = build(&g, Path::new("t")).unwrap();
        let p = Graph::parse(&buf, Path::new("t")).unwrap();
        assert_eq!(p.variables.len(), 4);
        assert_eq!(p.variables[0].name, "w");
        assert_eq!(
            p.variables[0].control_deps[1],
            Some(vec!["op1".to_string()])
        );
        let a = p.variables[0].array.as_ref().unwrap();
        assert_eq!(a.order, Order::F);
        let r = a.inline.clone().unwrap();
        assert_eq!(&buf[r.clone()], &data[..]);
        assert_eq!(r.start % 8, 0, "inline data is 8-aligned");
        let stub = p.variables[1].array.as_ref().unwrap();
        assert_eq!((stub.appended_offset, stub.appended_length), (0, 2 << 20));
        assert_eq!(stub.inline, None);
        assert!(p.variables[2].array.is_none());
        assert_eq!(p.variables[2].shape, Some(vec![-1, 3]));
        assert_eq!(p.variables[3].shape, Some(vec![]));
        assert_eq!(
            &buf[p.variables[3]
                .array
                .as_ref()
                .unwrap()
                .inline
                .clone()
                .unwrap()],
            &scalar
        );
        // Sorted by UTF-16 units: U+FFFF (one unit) after the surrogate pair of U+1F600.
        let keys: Vec<&str> = p.metadata.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "a",
                "nd4j.format.type",
                "nd4j.format.version",
                "ü",
                "😀",
                "\u{ffff}"
            ]
        );
        assert_eq!(p.meta("nd4j.format.version"), Some("1"));
        assert_eq!(p.outputs, vec![(3, 1)]);
        assert_eq!(p.node_count, 0);
        assert_eq!(
            p.opaque.nodes, None,
            "the empty nodes vector is not carried"
        );
        assert_eq!(p.extent, buf.len() - 16, "up to the end mark");
    }

    /// A foreign graph with ops, configuration, updater state and sub-graphs, built the way
    /// Java's builder does it (children first).
    fn foreign() -> Vec<u8> {
        let mut b = FlatBufferBuilder::new();
        // A FlatNode with an id, a name and a vector of ints (fields shardkit never decodes).
        let mut nodes = Vec::new();
        for i in 0..3 {
            let name = b.create_string(&format!("op{i}"));
            let ints = b.create_vector(&[i as i64, 0, 0]);
            let t = b.start_table();
            b.push_slot(slot(0), i, 0i32);
            b.push_slot_always(slot(1), name);
            b.push_slot_always(slot(2), ints);
            nodes.push(WIPOffset::<()>::new(b.end_table(t).value()));
        }
        let nodes = b.create_vector(&nodes);
        let conf = {
            let t = b.start_table();
            b.push_slot(slot(0), 5i64, 0);
            b.end_table(t)
        };
        let mut ups = Vec::new();
        for p in ["w", "v"] {
            let name = b.create_string(p);
            let k = b.create_string("M");
            let keys = b.create_vector(&[k]);
            let t = b.start_table();
            b.push_slot_always(slot(0), name);
            b.push_slot_always(slot(1), keys);
            ups.push(b.end_table(t));
        }
        let ups = b.create_vector(&ups);
        let sub = {
            let n = b.create_string("sub");
            let d = b.create_vector(&[1u8, 2, 3, 0]);
            let t = b.start_table();
            b.push_slot_always(slot(0), n);
            b.push_slot_always(slot(1), d);
            b.end_table(t)
        };
        let subs = b.create_vector(&[sub]);
        let vname = b.create_string("w");
        let v = {
            let t = b.start_table();
            b.push_slot_always(fv::NAME, vname);
            b.push_slot(fv::DTYPE, 5i8, 0);
            b.end_table(t)
        };
        let vars = b.create_vector(&[v]);
        let root = b.start_table();
        b.push_slot_always(fg::VARIABLES, vars);
        b.push_slot_always(fg::NODES, nodes);
        b.push_slot_always(fg::CONFIGURATION, conf);
        b.push_slot_always(fg::UPDATER_STATE, ups);
        b.push_slot_always(fg::SUB_INSTANCES, subs);
        let root = b.end_table(root);
        b.finish_minimal(root);
        b.finished_data().to_vec()
    }

    /// Decodes the test's FlatNodes the way a reader of the full schema would.
    fn decode_nodes(buf: &[u8]) -> Vec<(i32, String, Vec<i64>)> {
        let r = Fb {
            b: buf,
            path: Path::new("t"),
        };
        let root = r.table(r.follow(0).unwrap()).unwrap();
        r.tables(root, fg::NODES)
            .unwrap()
            .unwrap()
            .into_iter()
            .map(|p| {
                let t = r.table(p).unwrap();
                (
                    r.scalar_i32(t, slot(0), 0).unwrap(),
                    r.string(t, slot(1)).unwrap().unwrap().to_string(),
                    r.longs(t, slot(2)).unwrap().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn opaque_parts_survive_repeated_rebuilds_without_growing() {
        let old = foreign();
        let g = Graph::parse(&old, Path::new("t")).unwrap();
        assert_eq!((g.node_count, g.sub_instance_count), (3, 1));
        assert_eq!(g.updater_params(), vec![Some("w"), Some("v")]);
        let want = decode_nodes(&old);
        assert_eq!(want[2], (2, "op2".to_string(), vec![2, 0, 0]));

        let rebuild = |region: &[u8], with_slack: bool| -> Vec<u8> {
            let mut region = region.to_vec();
            if with_slack {
                region.resize(region.len() + 4096, 0);
            }
            let g = Graph::parse(&region, Path::new("t")).unwrap();
            let c = g.carried(&region);
            let vars: Vec<VarOut> = g
                .variables
                .iter()
                .map(|d| VarOut {
                    desc: d,
                    array: ArrayOut::None,
                })
                .collect();
            build(
                &GraphOut {
                    variables: vars,
                    metadata: vec![("k".into(), "v".into())],
                    nodes: c.nodes,
                    configuration: c.configuration,
                    updater_state: c
                        .updater_state
                        .map(|u| u.into_iter().map(|(_, c)| c).collect()),
                    sub_instances: c.sub_instances,
                    ..Default::default()
                },
                Path::new("t"),
            )
            .unwrap()
        };
        let once = rebuild(&old, false);
        assert_eq!(decode_nodes(&once), want);
        let twice = rebuild(&once, true);
        let thrice = rebuild(&twice, true);
        assert_eq!(decode_nodes(&thrice), want);
        assert_eq!(
            twice.len(),
            thrice.len(),
            "a re-save carries no slack and no dead root"
        );
        let g3 = Graph::parse(&thrice, Path::new("t")).unwrap();
        assert_eq!(g3.updater_params(), vec![Some("w"), Some("v")]);
        assert_eq!(g3.variables[0].name, "w");
        assert_eq!(g3.meta("k"), Some("v"));
        // The configuration table and the sub-graph bytes are where they point.
        let r = Fb {
            b: &thrice,
            path: Path::new("t"),
        };
        let root = r.table(r.follow(0).unwrap()).unwrap();
        let conf = r.sub_table(root, fg::CONFIGURATION).unwrap().unwrap();
        assert_eq!(r.scalar_i64(conf, slot(0)).unwrap(), 5);
        let sub = r
            .table(r.tables(root, fg::SUB_INSTANCES).unwrap().unwrap()[0])
            .unwrap();
        let data = r.byte_range(sub, slot(1)).unwrap().unwrap();
        assert_eq!(&thrice[data], &[1, 2, 3, 0]);
    }

    #[test]
    fn refusals() {
        let mut b = FlatBufferBuilder::new();
        let name = b.create_string("w");
        let arr = {
            let t = b.start_table();
            b.push_slot(fa::IS_EXTERNAL, true, false);
            b.end_table(t)
        };
        let t = b.start_table();
        b.push_slot_always(fv::NAME, name);
        b.push_slot_always(fv::NDARRAY, arr);
        let v = b.end_table(t);
        let vars = b.create_vector(&[v]);
        let root = b.start_table();
        b.push_slot_always(fg::VARIABLES, vars);
        let root = b.end_table(root);
        b.finish_minimal(root);
        let e = Graph::parse(b.finished_data(), Path::new("t"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("isExternal") && e.contains("\"w\""), "{e}");

        let mut b = FlatBufferBuilder::new();
        let name = b.create_string("w");
        let t = b.start_table();
        b.push_slot_always(fv::NAME, name);
        b.push_slot(fv::DTYPE, 99i8, 0);
        let v = b.end_table(t);
        let vars = b.create_vector(&[v]);
        let root = b.start_table();
        b.push_slot_always(fg::VARIABLES, vars);
        let root = b.end_table(root);
        b.finish_minimal(root);
        let e = Graph::parse(b.finished_data(), Path::new("t"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown DType code 99"), "{e}");

        for junk in [&[][..], &[1, 2, 3], &[0xff; 64]] {
            let e = Graph::parse(junk, Path::new("t")).unwrap_err().to_string();
            assert!(e.contains("verification"), "{e}");
        }
    }
}
