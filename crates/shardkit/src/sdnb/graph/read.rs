//! Parsing a verified FlatGraph region into a [`Graph`]: a small bounds-checked reader (`Fb`)
//! written by hand against `samediff.fbs`, then variables with their descriptors and array
//! locations, metadata, and the positions of the parts kept opaque. A FlatBuffer starts with a
//! u32 offset to its root table; a table starts with an i32 back-offset to its vtable (u16
//! vtable length, u16 table length, then one u16 offset per field slot, 0 = absent).

use std::ops::Range;
use std::path::Path;

use super::verify::verify;
use super::{
    fa, fg, fv, ip, slot, ArrayDesc, DType, Graph, Opaque, OpaqueParts, Order, UpdaterRef, VarDesc,
    VarType, END_MARK,
};
use crate::error::{Error, Result};

#[derive(Clone, Copy)]
pub(super) struct Fb<'a> {
    pub(super) b: &'a [u8],
    pub(super) path: &'a Path,
}

/// A table: its position and its vtable's.
#[derive(Clone, Copy)]
pub(super) struct Tab {
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
    pub(super) fn follow(&self, pos: usize) -> Result<usize> {
        pos.checked_add(self.u32(pos)? as usize)
            .ok_or_else(|| self.err("offset overflow"))
    }
    pub(super) fn table(&self, pos: usize) -> Result<Tab> {
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
    pub(super) fn scalar_i64(&self, t: Tab, slot: u16) -> Result<i64> {
        match self.field(t, slot)? {
            Some(p) => self.i64(p),
            None => Ok(0),
        }
    }
    pub(super) fn scalar_i32(&self, t: Tab, slot: u16, default: i32) -> Result<i32> {
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
    pub(super) fn sub_table(&self, t: Tab, slot: u16) -> Result<Option<Tab>> {
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
    pub(super) fn string(&self, t: Tab, slot: u16) -> Result<Option<&'a str>> {
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
    pub(super) fn tables(&self, t: Tab, slot: u16) -> Result<Option<Vec<usize>>> {
        self.elements(t, slot, 4, |p| self.follow(p))
    }
    fn strings(&self, t: Tab, slot: u16) -> Result<Option<Vec<String>>> {
        self.elements(t, slot, 4, |p| {
            self.string_at(self.follow(p)?).map(str::to_owned)
        })
    }
    pub(super) fn longs(&self, t: Tab, slot: u16) -> Result<Option<Vec<i64>>> {
        self.elements(t, slot, 8, |p| self.i64(p))
    }
    pub(super) fn byte_range(&self, t: Tab, slot: u16) -> Result<Option<Range<usize>>> {
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

impl Graph {
    /// Verifies and parses the graph region (bytes [32, B) of an SDNB file); `path` names the
    /// file in errors.
    pub(crate) fn parse(region: &[u8], path: &Path) -> Result<Graph> {
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
        let has_nodes = r.child(root, fg::NODES)?.is_some();
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
            has_nodes,
            sub_instance_count: subs.map_or(0, |s| s.1),
            opaque,
            extent,
        })
    }

    /// A metadata value.
    pub(crate) fn meta(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The parameter names of the updater state entries (`None` for an entry without one).
    pub(crate) fn updater_params(&self) -> Vec<Option<&str>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use flatbuffers::FlatBufferBuilder;

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
