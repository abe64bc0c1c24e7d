//! Robustness: hostile SameDiff containers give typed errors, never panics (samediff.md §9.5, §9.7).
//!
//! - Valid seeds (a single SDNB with inline, appended and zero-element arrays; a shard set; SDZ
//!   archives, single and sharded, with extra entries; a DEFLATE archive; a hand-built graph
//!   with ops, updater state and sub-graphs, and its `convert`ed copy) are mutated where the
//!   parsers look (header, FlatGraph region, manifest, ZIP local headers, central directory and
//!   end records): bits flipped, bytes and u16/u32/u64 fields overwritten with extreme values,
//!   bytes inserted, deleted and copied, files truncated, shards removed or renamed. Every
//!   result is opened, listed, read byte for byte, converted (and the copy reopened) and edited
//!   in place on a copy.
//! - The header, FlatGraph, manifest and ZIP parsers get arbitrary bytes and mutated valid
//!   encodings.
//! - Named hostile inputs (counts of 2^31, a zip with 2000 entries, escaping entry names, zip
//!   bombs, offsets past the end, version 2, external arrays, self-referencing and deeply
//!   nested FlatBuffers) are refused by the check that names the violated limit, without large
//!   allocations and without reading what the hostile field claims: a counting global
//!   allocator measures the heap each refusal needs, and the page cache shows what was read of
//!   a file. (No wall-clock limit: a parser that loops over a claimed count is a hang, which
//!   the test runner's timeout reports.)
//!
//! Every error must be a non-empty message that names the file (or the archive).

use std::alloc::{GlobalAlloc, Layout, System};
use std::any::Any;
use std::cell::Cell;
use std::fs;
use std::io::Write;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::sdnb::graph::Graph;
use crate::sdnb::header::Header;
use crate::sdnb::manifest::{self, Entry};
use crate::sdnb::read::Limits;
use crate::sdnb::sdz::{self, Method, ModelEntries, ZipLimits};
use crate::sdnb::{
    self, Container, DType, Format, Kind, Order, SaveOptions, Storage, TensorIn, VarType,
};
use flatbuffers::{FlatBufferBuilder, TableFinishedWIPOffset, WIPOffset};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

mod hostile;
mod mutate;
mod native;
mod stores;

// ---- Heap accounting ----

/// The system allocator, counting live heap bytes per thread so a test can check how much a
/// refusal allocated (memory maps are not counted).
struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn grew(n: usize) {
    let _ = LIVE.try_with(|l| {
        let v = l.get().saturating_add(n);
        l.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

fn shrank(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(n)));
}

// SAFETY: every call is forwarded to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        shrank(l.size());
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            shrank(l.size());
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`; returns its result and the most heap this thread held at once beyond what was
/// live before.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get).saturating_sub(base))
}

/// Bytes of `p` in the page cache (`mincore` over a map of the whole file): what has been
/// read of it, through a map or `read`, since it was written. Pages are 4 KiB or more, so a
/// read of a few bytes counts a page.
fn cached_bytes(p: &Path) -> u64 {
    let file = fs::File::open(p).unwrap();
    // SAFETY: a read-only map of a file nothing else writes while it is mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut resident = vec![0u8; map.len().div_ceil(page)];
    // SAFETY: `map` covers `map.len()` bytes from a page-aligned start; `resident` has one
    // byte per page of it.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut _, map.len(), resident.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    (resident.iter().filter(|&&r| r & 1 == 1).count() * page) as u64
}

const MIB: usize = 1 << 20;

/// One metadata value of `c`.
fn meta<'a>(c: &'a Container, key: &str) -> Option<&'a str> {
    c.metadata()
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The path the parsers' own tests name in errors.
const P: &str = "/fuzz/in.sdnb";

/// The default RNG seed of the property tests.
const SEED: u64 = 0x5d6e_b020_2025;

// ---- Checks ----

fn panic_text(p: Box<dyn Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// An error must say something and name one of `places` (the file, archive or directory).
fn named(e: &crate::Error, places: &[&Path]) -> Result<(), String> {
    let msg = e.to_string();
    if msg.trim().is_empty() {
        return Err(format!("an empty error message ({e:?})"));
    }
    if !places
        .iter()
        .any(|p| msg.contains(p.to_string_lossy().as_ref()))
    {
        return Err(format!("the error names none of {places:?}: {msg}"));
    }
    Ok(())
}

/// `f` must return normally; an `Err` must name one of `places`.
fn typed<T>(
    what: &str,
    places: &[&Path],
    f: impl FnOnce() -> crate::Result<T>,
) -> Result<Option<T>, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Err(p) => Err(format!("{what} panicked: {}", panic_text(p))),
        Ok(Ok(v)) => Ok(Some(v)),
        Ok(Err(e)) => named(&e, places)
            .map(|_| None)
            .map_err(|m| format!("{what}: {m}")),
    }
}

// ---- Building valid inputs ----

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    let mut x = 0x9e37_79b9u32 ^ seed.wrapping_mul(0x85eb_ca6b);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8
        })
        .collect()
}

#[derive(Clone)]
struct T {
    name: &'static str,
    dtype: DType,
    shape: Vec<i64>,
    order: Order,
    var_type: VarType,
    bytes: Vec<u8>,
}

fn t(name: &'static str, dtype: DType, shape: &[i64], order: Order) -> T {
    let n: i64 = shape.iter().product();
    T {
        name,
        dtype,
        shape: shape.to_vec(),
        order,
        var_type: if name.starts_with('c') {
            VarType::Constant
        } else {
            VarType::Variable
        },
        bytes: {
            let mut b = pattern(n as usize * dtype.width().unwrap(), name.len() as u32);
            if dtype == DType::Bool {
                // BOOL holds bytes 0 and 1 only (a save refuses anything else).
                b.iter_mut().for_each(|x| *x &= 1);
            }
            b
        },
    }
}

/// Inline and zero-element arrays of several dtypes and both orders.
fn small_tensors() -> Vec<T> {
    vec![
        t("w", DType::Float, &[3, 5], Order::F),
        t("b", DType::Half, &[7], Order::C),
        t("ids", DType::Int64, &[4], Order::C),
        t("c_scalar", DType::Double, &[], Order::C),
        t("empty", DType::Float, &[0, 4], Order::C),
        t("none", DType::Uint8, &[0], Order::C),
        t("mask", DType::Bool, &[9], Order::C),
        t("bf", DType::Bfloat16, &[2, 3], Order::F),
        t("u", DType::Uint32, &[5], Order::C),
        t("naïve ünï", DType::Float, &[2], Order::C),
    ]
}

/// One appended array (≥ 1 MiB): about 1.07 MiB.
fn big_tensor() -> T {
    t("big", DType::Uint16, &[560_000], Order::C)
}

fn tensor_ins(ts: &[T]) -> Vec<TensorIn<'_>> {
    ts.iter()
        .map(|t| TensorIn {
            name: t.name.into(),
            var_type: t.var_type,
            dtype: t.dtype,
            shape: t.shape.clone(),
            order: t.order,
            bytes: &t.bytes,
        })
        .collect()
}

fn save_opts(format: Format, shard_size: Option<u64>, slack: u64) -> SaveOptions {
    SaveOptions {
        format,
        shard_size,
        slack,
        metadata: vec![
            ("model.name".into(), "fuzz-seed".into()),
            ("creation.time".into(), "1700000000000".into()),
        ],
        ..SaveOptions::default()
    }
}

/// The vtable offset of field `n`.
const fn slot(n: u16) -> u16 {
    4 + 2 * n
}

type Off = WIPOffset<TableFinishedWIPOffset>;

/// A `FlatArray` as the test writes it by hand.
#[derive(Clone, Default)]
struct ArraySpec {
    shape: Option<Vec<i64>>,
    buffer: Option<Vec<u8>>,
    dtype: i8,
    order: i8,
    /// (appendedDataOffset, appendedDataLength).
    appended: Option<(i64, i64)>,
    /// externalDataFilename, with isExternal = true.
    external: Option<String>,
    /// One bufferChunks entry.
    chunks: bool,
}

/// A `FlatVariable`.
#[derive(Clone)]
struct VarSpec {
    name: String,
    dtype: i8,
    shape: Option<Vec<i64>>,
    var_type: i8,
    array: Option<ArraySpec>,
}

/// A `FlatGraph`; `rich` adds ops, outputs, configuration, placeholders, loss variables, a
/// training config, updater state and a sub-graph; `nesting` hangs a chain of that many nested
/// tables off the first op.
#[derive(Clone, Default)]
struct GraphSpec {
    vars: Vec<VarSpec>,
    metadata: Vec<(String, String)>,
    rich: bool,
    nesting: usize,
}

fn int_pair(b: &mut FlatBufferBuilder, first: i32, second: i32) -> Off {
    let t = b.start_table();
    b.push_slot(slot(0), first, 0);
    b.push_slot(slot(1), second, 0);
    b.end_table(t)
}

fn flat_array(b: &mut FlatBufferBuilder, a: &ArraySpec) -> Off {
    let shape = a.shape.as_ref().map(|s| b.create_vector(s));
    let buffer = a.buffer.as_ref().map(|d| b.create_vector(d));
    let chunks = if a.chunks {
        let data = b.create_vector(&[1u8, 2, 3, 4]);
        let t = b.start_table();
        b.push_slot(slot(0), 0i64, -1);
        b.push_slot_always(slot(1), data);
        let c = b.end_table(t);
        Some(b.create_vector(&[c]))
    } else {
        None
    };
    let external = a.external.as_ref().map(|e| {
        let s = b.create_string(e);
        b.create_vector(&[s])
    });
    let t = b.start_table();
    if let Some(s) = shape {
        b.push_slot_always(slot(0), s);
    }
    if let Some(x) = buffer {
        b.push_slot_always(slot(1), x);
    }
    b.push_slot(slot(2), a.dtype, 0);
    b.push_slot(slot(3), a.order, 0);
    if let Some(c) = chunks {
        b.push_slot_always(slot(4), c);
    }
    if let Some((off, len)) = a.appended {
        b.push_slot(slot(5), len, 0);
        b.push_slot(slot(8), off, 0);
        b.push_slot(slot(9), len, 0);
    }
    if let Some(e) = external {
        b.push_slot_always(slot(6), e);
        b.push_slot(slot(7), true, false);
    }
    b.end_table(t)
}

fn flat_variable(b: &mut FlatBufferBuilder, v: &VarSpec, id: i32) -> Off {
    let array = v.array.as_ref().map(|a| flat_array(b, a));
    let idp = int_pair(b, id, 0);
    let name = b.create_string(&v.name);
    let shape = v.shape.as_ref().map(|s| b.create_vector(s));
    let op = b.create_string("op0");
    let deps = b.create_vector(&[op]);
    let t = b.start_table();
    b.push_slot_always(slot(0), idp);
    b.push_slot_always(slot(1), name);
    b.push_slot(slot(2), v.dtype, 0);
    if let Some(s) = shape {
        b.push_slot_always(slot(3), s);
    }
    if let Some(a) = array {
        b.push_slot_always(slot(4), a);
    }
    b.push_slot(slot(5), -1i32, 0);
    b.push_slot(slot(6), v.var_type, 0);
    b.push_slot_always(slot(8), deps);
    b.end_table(t)
}

fn strings<'b>(
    b: &mut FlatBufferBuilder<'b>,
    s: &[&str],
) -> WIPOffset<flatbuffers::Vector<'b, flatbuffers::ForwardsUOffset<&'b str>>> {
    let offs: Vec<_> = s.iter().map(|x| b.create_string(x)).collect();
    b.create_vector(&offs)
}

fn flat_graph(g: &GraphSpec) -> Vec<u8> {
    let mut b = FlatBufferBuilder::new();
    let vars: Vec<Off> = g
        .vars
        .iter()
        .enumerate()
        .map(|(i, v)| flat_variable(&mut b, v, i as i32))
        .collect();
    let variables = b.create_vector(&vars);
    let keys: Vec<&str> = g.metadata.iter().map(|(k, _)| k.as_str()).collect();
    let values: Vec<&str> = g.metadata.iter().map(|(_, v)| v.as_str()).collect();
    let keys = strings(&mut b, &keys);
    let values = strings(&mut b, &values);
    let mut rich = None;
    if g.rich {
        // A chain of nested tables, innermost first.
        let mut inner: Option<Off> = None;
        for depth in 0..g.nesting {
            let t = b.start_table();
            if let Some(child) = inner {
                b.push_slot_always(slot(0), child);
            }
            b.push_slot(slot(1), depth as i32, -1);
            inner = Some(b.end_table(t));
        }
        let mut nodes = Vec::new();
        for i in 0..2 {
            let name = b.create_string(&format!("op{i}"));
            let ints = b.create_vector(&[1i32, 2, 3]);
            let t = b.start_table();
            b.push_slot(slot(0), i, -1);
            b.push_slot_always(slot(1), name);
            b.push_slot_always(slot(2), ints);
            if let (0, Some(chain)) = (i, inner) {
                b.push_slot_always(slot(3), chain);
            }
            nodes.push(b.end_table(t));
        }
        let nodes = b.create_vector(&nodes);
        let out = int_pair(&mut b, 1, 0);
        let outputs = b.create_vector(&[out]);
        let cfg_name = b.create_string("cfg");
        let t = b.start_table();
        b.push_slot(slot(0), 42i64, 0);
        b.push_slot_always(slot(1), cfg_name);
        let configuration = b.end_table(t);
        let placeholders = strings(&mut b, &["x"]);
        let loss = strings(&mut b, &["loss"]);
        let training = b.create_string("{\"lr\": 0.01}");
        let mut states = Vec::new();
        for (param, tag) in [("w", 1u8), ("gone", 2)] {
            let arrays: Vec<Off> = (0..2)
                .map(|k| {
                    flat_array(
                        &mut b,
                        &ArraySpec {
                            shape: Some(vec![2]),
                            buffer: Some(vec![tag + k; 8]),
                            dtype: 5,
                            ..ArraySpec::default()
                        },
                    )
                })
                .collect();
            let arrays = b.create_vector(&arrays);
            let skeys = strings(&mut b, &["M", "V"]);
            let pname = b.create_string(param);
            let t = b.start_table();
            b.push_slot_always(slot(0), pname);
            b.push_slot_always(slot(1), skeys);
            b.push_slot_always(slot(2), arrays);
            states.push(b.end_table(t));
        }
        let updater = b.create_vector(&states);
        let sub_name = b.create_string("sub");
        let sub_data = b.create_vector(&[1u8, 2, 3, 4, 5]);
        let t = b.start_table();
        b.push_slot_always(slot(0), sub_name);
        b.push_slot_always(slot(1), sub_data);
        let sub = b.end_table(t);
        let subs = b.create_vector(&[sub]);
        rich = Some((
            nodes,
            outputs,
            configuration,
            placeholders,
            loss,
            training,
            updater,
            subs,
        ));
    }
    let root = b.start_table();
    b.push_slot(slot(0), 7i64, 0);
    b.push_slot_always(slot(1), variables);
    if let Some((nodes, outputs, configuration, placeholders, loss, training, updater, subs)) = rich
    {
        b.push_slot_always(slot(2), nodes);
        b.push_slot_always(slot(3), outputs);
        b.push_slot_always(slot(4), configuration);
        b.push_slot_always(slot(5), placeholders);
        b.push_slot_always(slot(6), loss);
        b.push_slot_always(slot(7), training);
        b.push_slot_always(slot(8), updater);
        b.push_slot_always(slot(11), subs);
    }
    b.push_slot_always(slot(9), keys);
    b.push_slot_always(slot(10), values);
    let root = b.end_table(root);
    b.finish_minimal(root);
    b.finished_data().to_vec()
}

fn forced_metadata() -> Vec<(String, String)> {
    vec![
        ("model.name".into(), "handmade".into()),
        ("nd4j.format.type".into(), "APPENDED_BLOB".into()),
        ("nd4j.format.version".into(), "1".into()),
    ]
}

/// The variables of the hand-built graph: inline C and F arrays, a stub of a 16-byte appended
/// blob named `app`, an empty array, a placeholder with a free dimension, an op output without
/// shape, an inline scalar and a variable without an array.
fn handmade_vars() -> Vec<VarSpec> {
    let v = |name: &str, dtype: i8, shape: Option<Vec<i64>>, var_type: i8, array| VarSpec {
        name: name.into(),
        dtype,
        shape,
        var_type,
        array,
    };
    let arr = |shape: &[i64], dtype: i8, order: i8, buffer: Option<Vec<u8>>| ArraySpec {
        shape: Some(shape.to_vec()),
        buffer,
        dtype,
        order,
        ..ArraySpec::default()
    };
    vec![
        v(
            "w",
            5,
            Some(vec![2, 3]),
            0,
            Some(arr(&[2, 3], 5, 0, Some(pattern(24, 1)))),
        ),
        v(
            "wf",
            3,
            Some(vec![3, 2]),
            0,
            Some(arr(&[3, 2], 3, 1, Some(pattern(12, 2)))),
        ),
        v(
            "app",
            5,
            Some(vec![4]),
            1,
            Some(ArraySpec {
                appended: Some((0, 16)),
                ..arr(&[4], 5, 0, None)
            }),
        ),
        v("e", 5, Some(vec![0, 3]), 0, Some(arr(&[0, 3], 5, 0, None))),
        v("x", 5, Some(vec![-1, 3]), 3, None),
        v("loss", 5, None, 2, None),
        v(
            "c",
            10,
            Some(vec![]),
            1,
            Some(arr(&[], 10, 0, Some(pattern(8, 3)))),
        ),
        v("nodata", 5, Some(vec![5]), 0, None),
    ]
}

/// An SDNB file written field by field: header, `graph` at 32, `slack` zero bytes, each blob
/// 64-aligned, then the manifest of the blobs.
fn sdnb_bytes(graph: &[u8], slack: usize, blobs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut f = vec![0u8; 32];
    f.extend_from_slice(graph);
    f.resize(f.len() + slack, 0);
    let mut entries = Vec::new();
    for (name, data) in blobs {
        f.resize(f.len().next_multiple_of(64), 0);
        entries.push(Entry {
            name: name.to_string(),
            offset: f.len() as u64,
            length: data.len() as u64,
        });
        f.extend_from_slice(data);
    }
    let m = f.len() as u64;
    let man = manifest::encode(&entries);
    f.extend_from_slice(&man);
    let h = Header {
        manifest_offset: m,
        manifest_len: man.len() as u64,
    };
    f[..32].copy_from_slice(&h.to_bytes());
    f
}

fn handmade_sdnb(nesting: usize) -> Vec<u8> {
    let g = flat_graph(&GraphSpec {
        vars: handmade_vars(),
        metadata: forced_metadata(),
        rich: true,
        nesting,
    });
    sdnb_bytes(&g, 256, &[("app", &pattern(16, 4))])
}

/// One ZIP entry to write by hand.
struct ZipIn {
    name: Vec<u8>,
    method: u16,
    raw: Vec<u8>,
    size: u32,
    crc: u32,
}

fn stored(name: &[u8], data: &[u8]) -> ZipIn {
    ZipIn {
        name: name.to_vec(),
        method: 0,
        raw: data.to_vec(),
        size: data.len() as u32,
        crc: crc32fast::hash(data),
    }
}

fn deflate(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

fn deflated(name: &[u8], data: &[u8]) -> ZipIn {
    ZipIn {
        name: name.to_vec(),
        method: 8,
        raw: deflate(data),
        size: data.len() as u32,
        crc: crc32fast::hash(data),
    }
}

/// A plain ZIP (no ZIP64, no data descriptors), local headers and central directory agreeing.
fn zip_of(entries: &[ZipIn]) -> Vec<u8> {
    let mut z = Vec::new();
    let mut offsets = Vec::new();
    for e in entries {
        offsets.push(z.len() as u32);
        z.extend(0x0403_4b50u32.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(e.method.to_le_bytes());
        z.extend([0u8; 4]);
        z.extend(e.crc.to_le_bytes());
        z.extend((e.raw.len() as u32).to_le_bytes());
        z.extend(e.size.to_le_bytes());
        z.extend((e.name.len() as u16).to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(&e.name);
        z.extend(&e.raw);
    }
    let cd = z.len();
    for (e, off) in entries.iter().zip(offsets) {
        z.extend(0x0201_4b50u32.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(e.method.to_le_bytes());
        z.extend([0u8; 4]);
        z.extend(e.crc.to_le_bytes());
        z.extend((e.raw.len() as u32).to_le_bytes());
        z.extend(e.size.to_le_bytes());
        z.extend((e.name.len() as u16).to_le_bytes());
        z.extend([0u8; 8]);
        z.extend(0u32.to_le_bytes());
        z.extend(off.to_le_bytes());
        z.extend(&e.name);
    }
    let cd_len = z.len() - cd;
    z.extend(0x0605_4b50u32.to_le_bytes());
    z.extend([0u8; 4]);
    z.extend((entries.len() as u16).to_le_bytes());
    z.extend((entries.len() as u16).to_le_bytes());
    z.extend((cd_len as u32).to_le_bytes());
    z.extend((cd as u32).to_le_bytes());
    z.extend(0u16.to_le_bytes());
    z
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

// ---- Seeds ----

/// A valid container, held in memory: its files, the path to open (relative), and per file
/// the byte ranges worth mutating (the whole file first).
struct Seed {
    name: &'static str,
    files: Vec<(String, Vec<u8>)>,
    open_as: String,
    hot: Vec<Vec<Range<usize>>>,
    /// A shard set: errors may name any member, so the directory is what they must name.
    sharded: bool,
}

/// Inputs for the parser-level tests, taken from the seeds.
struct Corpus {
    seeds: Vec<Seed>,
    /// FlatGraph regions [32, 32 + graph length) of every seed part, and the raw hand-built
    /// graph.
    graphs: Vec<Vec<u8>>,
    /// Manifests of every seed part.
    manifests: Vec<Vec<u8>>,
    /// Every seed archive, and small hand-built ones.
    zips: Vec<Vec<u8>>,
}

fn corpus() -> &'static Corpus {
    static CORPUS: OnceLock<Corpus> = OnceLock::new();
    CORPUS.get_or_init(build_corpus)
}

fn seed(name: &str) -> &'static Seed {
    corpus()
        .seeds
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no seed {name}"))
}

fn read_dir_sorted(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Reads a seed's directory back and finds its regions from the container's layout and the
/// archives' entries.
fn capture(
    name: &'static str,
    dir: &Path,
    open_as: &str,
    sharded: bool,
    graphs: &mut Vec<Vec<u8>>,
    manifests: &mut Vec<Vec<u8>>,
    zips: &mut Vec<Vec<u8>>,
) -> Seed {
    let files = read_dir_sorted(dir);
    let c = sdnb::open(dir.join(open_as)).unwrap_or_else(|e| panic!("seed {name}: {e}"));
    let mut hot: Vec<Vec<Range<usize>>> = files
        .iter()
        .map(|(_, b)| std::iter::once(0..b.len()).collect())
        .collect();
    let mut archive_entries = Vec::new();
    for (i, (fname, bytes)) in files.iter().enumerate() {
        if !bytes.starts_with(b"PK\x03\x04") {
            continue;
        }
        zips.push(bytes.clone());
        let es = sdz::entries(bytes, Path::new(fname), &ZipLimits::default()).unwrap();
        for e in &es {
            let (lh, ch) = (e.local_header as usize, e.central_header as usize);
            hot[i].push(lh..e.data.start as usize);
            hot[i].push(ch..ch + 46 + e.name.len());
            if e.method == Method::Deflate {
                hot[i].push(e.data.start as usize..e.data.end as usize);
            }
        }
        for sig in [&b"PK\x05\x06"[..], b"PK\x06\x06", b"PK\x06\x07"] {
            if let Some(at) = rfind(bytes, sig) {
                hot[i].push(at..bytes.len());
            }
        }
        archive_entries.push((i, es));
    }
    for l in c.layout() {
        let label = l.name.to_string_lossy().into_owned();
        let (file, offset) = match label.split_once('!') {
            Some((_, entry)) => {
                let (i, es) = &archive_entries[0];
                let e = es.iter().find(|e| e.name == entry).unwrap();
                if e.method != Method::Stored {
                    continue;
                }
                (*i, e.data.start as usize)
            }
            None => {
                let fname = l.name.file_name().unwrap().to_string_lossy().into_owned();
                (files.iter().position(|(n, _)| *n == fname).unwrap(), 0)
            }
        };
        let (gb, b, m, mb) = (
            l.graph_bytes as usize,
            l.blob_start as usize,
            l.manifest_offset as usize,
            l.manifest_bytes as usize,
        );
        let o = offset;
        let bytes = &files[file].1;
        graphs.push(bytes[o + 32..o + 32 + gb.min(b - 32)].to_vec());
        manifests.push(bytes[o + m..o + m + mb].to_vec());
        let h = &mut hot[file];
        h.push(o..o + 32);
        h.push(o + 8..o + 24);
        h.push(o + 32..o + 32 + gb);
        h.push(o + 32..o + 32 + gb.min(192));
        h.push(o + 32 + gb.saturating_sub(64)..o + 32 + gb);
        if b < m {
            h.push(o + b..o + (b + 64).min(m));
        }
        h.push(o + m..o + m + mb);
        h.push(o + m + mb.saturating_sub(48)..o + m + mb);
    }
    for h in &mut hot {
        h.retain(|r| r.start < r.end);
    }
    Seed {
        name,
        files,
        open_as: open_as.into(),
        hot,
        sharded,
    }
}

fn build_corpus() -> Corpus {
    let tmp = tempfile::tempdir().unwrap();
    let (mut graphs, mut manifests, mut zips) = (Vec::new(), Vec::new(), Vec::new());
    let mut seeds = Vec::new();
    let small = small_tensors();
    let mut with_big = small.clone();
    with_big.insert(2, big_tensor());
    let extras = vec![
        (
            "tokenizer.json".to_string(),
            b"{\"vocab\": [1, 2]}".to_vec(),
        ),
        ("assets/readme.txt".to_string(), b"hello".to_vec()),
    ];
    let mut mk = |name: &'static str, open_as: &str, sharded: bool, write: &dyn Fn(&Path)| {
        let dir = tmp.path().join(name);
        fs::create_dir(&dir).unwrap();
        write(&dir);
        let s = capture(
            name,
            &dir,
            open_as,
            sharded,
            &mut graphs,
            &mut manifests,
            &mut zips,
        );
        seeds.push(s);
    };
    mk("single", "m.sdnb", false, &|d| {
        let o = save_opts(Format::Sdnb, None, 4096);
        sdnb::save(&d.join("m.sdnb"), &tensor_ins(&with_big), &o).unwrap();
    });
    mk("sharded", "m.bin", true, &|d| {
        let o = save_opts(Format::Sharded, Some(8192), 512);
        let files = sdnb::save(&d.join("m.bin"), &tensor_ins(&small), &o).unwrap();
        assert!(files.len() >= 3, "{files:?}");
    });
    mk("sdz", "m.sdz", false, &|d| {
        let mut o = save_opts(Format::Sdz, None, 512);
        o.extra_entries = extras.clone();
        sdnb::save(&d.join("m.sdz"), &tensor_ins(&small), &o).unwrap();
    });
    mk("sdz-sharded", "m.sdz", false, &|d| {
        let mut o = save_opts(Format::Sdz, Some(8192), 512);
        o.extra_entries = extras[..1].to_vec();
        sdnb::save(&d.join("m.sdz"), &tensor_ins(&small), &o).unwrap();
    });
    mk("handmade", "h.sdnb", false, &|d| {
        fs::write(d.join("h.sdnb"), handmade_sdnb(3)).unwrap();
    });
    mk("converted", "conv.sdnb", false, &|d| {
        let src = d.join("src.sdnb");
        fs::write(&src, handmade_sdnb(3)).unwrap();
        let c = sdnb::open(&src).unwrap();
        let mut o = save_opts(Format::Sdnb, None, 256);
        o.align = 4096;
        sdnb::convert(&c, &d.join("conv.sdnb"), &o).unwrap();
        drop(c);
        fs::remove_file(&src).unwrap();
    });
    mk("deflate-sdz", "d.sdz", false, &|d| {
        let src = d.join("src.sdnb");
        sdnb::save(
            &src,
            &tensor_ins(&small),
            &save_opts(Format::Sdnb, None, 512),
        )
        .unwrap();
        let model = fs::read(&src).unwrap();
        fs::remove_file(&src).unwrap();
        let z = zip_of(&[
            deflated(b"model", &model),
            stored(b"assets/", b""),
            deflated(b"tokenizer.json", &pattern(3000, 9)),
            stored(b"assets/vocab.txt", b"a\nb\n"),
        ]);
        fs::write(d.join("d.sdz"), z).unwrap();
    });
    graphs.push(flat_graph(&GraphSpec {
        vars: handmade_vars(),
        metadata: forced_metadata(),
        rich: true,
        nesting: 5,
    }));
    manifests.push(manifest::encode(&[
        Entry {
            name: "a\u{0}é€😀".into(),
            offset: 64,
            length: 0,
        },
        Entry {
            name: "b".into(),
            offset: 64,
            length: 0,
        },
        Entry {
            name: "c".into(),
            offset: 1 << 40,
            length: i64::MAX as u64,
        },
    ]));
    zips.push(zip_of(&[stored(b"model", b"SDNB")]));
    zips.push(zip_of(&[
        stored(
            b"model.shard1-of-2.sdnb",
            &[b'S', b'D', b'N', b'B', 0, 0, 0, 1],
        ),
        deflated(
            b"model.shard0-of-2.sdnb",
            &[b"SDNB".as_slice(), &[7; 60]].concat(),
        ),
    ]));
    Corpus {
        seeds,
        graphs,
        manifests,
        zips,
    }
}
