//! Encoding a FlatGraph: variables, metadata, outputs, placeholders, loss variables and the
//! training config are written afresh; the opaque parts of an old graph (ops, configuration,
//! updater state, sub-graphs) are carried as a verbatim tail of the old buffer, copied at the
//! same position modulo 8, and every built graph ends with the 12-byte `shardkit` end mark.
//! The result is parsed back before it is returned.

use std::path::Path;

use flatbuffers::{FlatBufferBuilder, ForwardsUOffset, Vector, WIPOffset};

use super::{fa, fg, fv, ip, DType, Graph, Opaque, Order, VarDesc, END_MARK};
use crate::error::{Error, Result};

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
    use super::super::read::Fb;
    use super::super::{slot, VarType};
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
}
