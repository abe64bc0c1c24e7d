//! Opening a container: one entry point that recognises an SDZ archive, a single SDNB file or a
//! shard set, checks every part once (samediff.md §9.5, §9.6, §9.7), and then serves tensors
//! straight from a memory map.
//!
//! Opening touches only each part's header, graph region and manifest; blob pages are read when
//! a tensor's bytes are. STORED archive entries are mapped in place; DEFLATE entries are inflated
//! (within the archive limits) into memory. A container in an object store is read the same way
//! by ranged GETs: what opening checks is fetched into an anonymous map of the object's size
//! (see the `remote` module), and each blob into a buffer of its own when its tensor is first asked for.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::graph::{byte_len, Graph};
use super::header::{Header, HEADER_LEN, MAGIC};
use super::manifest::{self, Entry};
use super::sdz::{self, Method, ModelEntries, ZipEntry, ZipLimits};
use super::types::{DType, Order, VarType};
use crate::error::{Error, IoContext, Result};

mod remote;
#[cfg(test)]
pub(crate) use remote::open_source;

/// Caps applied while opening, so a hostile file cannot make the reader allocate or scan
/// without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The FlatGraph region, [32, B) (at most 2^31 − 1: FlatBuffers' and Java's limit).
    pub max_graph_bytes: u64,
    /// The manifest, in bytes.
    pub max_manifest_bytes: u64,
    /// Manifest entries.
    pub max_manifest_entries: usize,
    /// Archive limits for SDZ files.
    pub zip: ZipLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_graph_bytes: i32::MAX as u64,
            max_manifest_bytes: 256 << 20,
            max_manifest_entries: 1 << 22,
            zip: ZipLimits::default(),
        }
    }
}

/// What kind of container was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One SDNB file.
    Sdnb,
    /// `<base>.shard<i>-of-<N>.sdnb` files.
    Sharded {
        /// N.
        shards: usize,
    },
    /// A ZIP holding `model` (shards = 1) or a `model.shard*` set.
    Sdz {
        /// The number of SDNB entries that make up the model.
        shards: usize,
    },
}

/// "sdnb", "sharded" or "sdz".
impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Kind::Sdnb => "sdnb",
            Kind::Sharded { .. } => "sharded",
            Kind::Sdz { .. } => "sdz",
        })
    }
}

/// Where a variable's array is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// In the graph (`FlatArray.buffer`).
    Inline,
    /// A blob after the graph, located by the manifest.
    Appended,
    /// An array with zero elements.
    Empty,
    /// No array (placeholders, ARRAY variables, stubs).
    None,
}

/// "inline", "appended", "empty" or "none".
impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Storage::Inline => "inline",
            Storage::Appended => "appended",
            Storage::Empty => "empty",
            Storage::None => "none",
        })
    }
}

/// One variable as listed: its descriptor and where its data is.
#[derive(Debug, Clone, PartialEq)]
pub struct Variable {
    /// The variable's name.
    pub name: String,
    /// VARIABLE, CONSTANT, ARRAY or PLACEHOLDER.
    pub var_type: VarType,
    /// The element type.
    pub dtype: DType,
    /// The shape; `None` when unknown (a placeholder without one). -1 marks a free dimension.
    pub shape: Option<Vec<i64>>,
    /// Where the array is.
    pub storage: Storage,
    /// The array's bytes (0 without data).
    pub byte_len: u64,
    /// Element order of the stored bytes.
    pub order: Order,
    /// (part, byte range within the part) of the data.
    pub(crate) data: Option<(usize, Range<usize>)>,
    /// (part, index into that part's graph variables) of the descriptor with the data, or of
    /// the declaring descriptor when there is none.
    pub(crate) source: (usize, usize),
}

/// A tensor's bytes, borrowed from the container's memory map.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tensor<'a> {
    /// The element type.
    pub dtype: DType,
    /// The shape, in elements.
    pub shape: &'a [i64],
    /// 'c' or 'f' order of `bytes`.
    pub order: Order,
    /// Exactly prod(shape) × width bytes, little-endian.
    pub bytes: &'a [u8],
}

impl<'a> Tensor<'a> {
    /// The bytes in C (row-major) order: borrowed when already so, else transposed.
    pub fn c_order_bytes(&self) -> Cow<'a, [u8]> {
        match self.order {
            Order::C => Cow::Borrowed(self.bytes),
            Order::F => Cow::Owned(f_to_c(
                self.bytes,
                self.shape,
                self.dtype.width().unwrap_or(1),
            )),
        }
    }
}

/// Reorders column-major bytes of `shape` (elements of `width` bytes) into row-major order.
pub(crate) fn f_to_c(bytes: &[u8], shape: &[i64], width: usize) -> Vec<u8> {
    let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let n: usize = dims.iter().product();
    if dims.len() < 2 || n == 0 {
        return bytes.to_vec();
    }
    // Column-major strides, in elements.
    let mut fstride = vec![1usize; dims.len()];
    for k in 1..dims.len() {
        fstride[k] = fstride[k - 1] * dims[k - 1];
    }
    let mut out = Vec::with_capacity(n * width);
    let mut idx = vec![0usize; dims.len()];
    for _ in 0..n {
        let src: usize = idx.iter().zip(&fstride).map(|(i, s)| i * s).sum();
        out.extend_from_slice(&bytes[src * width..(src + 1) * width]);
        for k in (0..dims.len()).rev() {
            idx[k] += 1;
            if idx[k] < dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    out
}

/// Where the regions of one part lie (samediff.md §1.1).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartLayout {
    /// The file, or `archive!entry`.
    pub name: PathBuf,
    /// The part's size.
    pub bytes: u64,
    /// The FlatBuffer's length without the zero slack after it (its last non-zero byte,
    /// rounded up to 8).
    pub graph_bytes: u64,
    /// B: the first blob (or the manifest when there are none).
    pub blob_start: u64,
    /// M.
    pub manifest_offset: u64,
    /// The manifest's length.
    pub manifest_bytes: u64,
    /// Manifest entries (appended arrays).
    pub manifest_entries: usize,
}

/// The bytes a part lives in.
pub(crate) enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
    /// An object in a store, read by range (see [`RemotePart`]).
    Remote(remote::RemotePart),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
            Backing::Remote(r) => &r.skeleton,
        }
    }
}

/// Where a part sits on disk, for in-place edits.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    /// The file holding the part (the archive for SDZ entries).
    pub file: PathBuf,
    /// The part's first byte in that file.
    pub offset: u64,
    /// The archive entry, for SDZ parts.
    pub entry: Option<ZipEntry>,
}

/// One checked SDNB: a single file, a shard, or an archive entry.
pub(crate) struct Part {
    backing: Arc<Backing>,
    range: Range<usize>,
    /// How errors name this part (`model.sdz!model.shard1-of-3.sdnb` inside archives).
    pub label: PathBuf,
    pub origin: Origin,
    pub header: Header,
    /// B: where the blob section starts (M without blobs).
    pub blob_start: u64,
    pub graph: Graph,
    pub manifest: Vec<Entry>,
    /// Per graph variable: storage, byte length and data range within the part.
    located: Vec<Located>,
}

impl Part {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.range.clone()]
    }

    /// Bytes `r` of the part (a tensor's data): from the map, or fetched from a store.
    fn data(&self, r: Range<usize>) -> Result<&[u8]> {
        match &*self.backing {
            Backing::Remote(remote) => {
                let at = self.range.start;
                remote.range(at + r.start..at + r.end)
            }
            _ => Ok(&self.bytes()[r]),
        }
    }

    /// The graph region [32, B).
    pub(crate) fn region(&self) -> &[u8] {
        &self.bytes()[HEADER_LEN as usize..self.blob_start as usize]
    }

    fn parse(
        backing: Arc<Backing>,
        range: Range<usize>,
        label: PathBuf,
        origin: Origin,
        limits: &Limits,
    ) -> Result<Part> {
        let bytes = &backing.bytes()[range.clone()];
        let bad = |rule: String| Error::format(&label, rule);
        let header = Header::parse(bytes, bytes.len() as u64, &label)?;
        let (m, mlen) = (header.manifest_offset, header.manifest_len);
        if mlen > limits.max_manifest_bytes {
            return Err(bad(format!(
                "manifest of {mlen} bytes exceeds the cap of {} bytes",
                limits.max_manifest_bytes
            )));
        }
        // Header::parse checked m + mlen <= len.
        let mbytes = &bytes[m as usize..(m + mlen) as usize];
        let manifest = manifest::decode(mbytes, &label, limits.max_manifest_entries)?;
        for e in &manifest {
            if e.offset < HEADER_LEN || e.offset.checked_add(e.length).is_none_or(|end| end > m) {
                return Err(bad(format!(
                    "manifest entry {:?} at byte {}, {} bytes long, lies outside the blob \
                     section (bytes 32 to {})",
                    e.name,
                    e.offset,
                    e.length,
                    m.saturating_sub(1)
                )));
            }
        }
        let blob_start = manifest.iter().map(|e| e.offset).min().unwrap_or(m);
        let graph_len = blob_start - HEADER_LEN;
        if graph_len > limits.max_graph_bytes {
            return Err(bad(format!(
                "graph region of {graph_len} bytes exceeds the cap of {} bytes",
                limits.max_graph_bytes
            )));
        }
        let graph = Graph::parse(&bytes[HEADER_LEN as usize..blob_start as usize], &label)?;
        let located = locate(&graph, &manifest, blob_start, &label)?;
        Ok(Part {
            backing,
            range,
            label,
            origin,
            header,
            blob_start,
            graph,
            manifest,
            located,
        })
    }
}

/// A variable's storage, byte length and data range within its part.
pub(crate) type Located = (Storage, u64, Option<Range<usize>>);

/// Where each variable's data is (§9.5): manifest entries agree with the graph, stubs with
/// the manifest, lengths with shapes.
pub(crate) fn locate(
    graph: &Graph,
    manifest: &[Entry],
    blob_start: u64,
    label: &Path,
) -> Result<Vec<Located>> {
    let bad = |rule: String| Error::format(label, rule);
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(graph.variables.len());
    for (i, v) in graph.variables.iter().enumerate() {
        if by_name.insert(v.name.as_str(), i).is_some() {
            return Err(bad(format!("variable {:?} is declared twice", v.name)));
        }
    }
    let mut entries: Vec<Option<&Entry>> = vec![None; graph.variables.len()];
    for e in manifest {
        let Some(&i) = by_name.get(e.name.as_str()) else {
            return Err(bad(format!(
                "manifest entry {:?} names no variable of the graph",
                e.name
            )));
        };
        entries[i] = Some(e);
    }
    let mut out = Vec::with_capacity(graph.variables.len());
    for (v, entry) in graph.variables.iter().zip(entries) {
        let bad_var = |rule: String| bad(format!("variable {:?}: {rule}", v.name));
        let arr = v.array.as_ref();
        if let Some(a) = arr {
            if a.dtype != v.dtype {
                return Err(bad_var(format!(
                    "array dtype {} differs from the variable's {}",
                    a.dtype.name(),
                    v.dtype.name()
                )));
            }
            if let (Some(vs), Some(s)) = (&v.shape, &a.shape) {
                if vs != s {
                    return Err(bad_var(format!(
                        "array shape {s:?} differs from the variable's {vs:?}"
                    )));
                }
            }
        }
        let Some(shape) = arr.and_then(|a| a.shape.as_ref()).or(v.shape.as_ref()) else {
            if entry.is_some() || arr.is_some_and(|a| a.inline.is_some()) {
                return Err(bad_var("has data but no shape".into()));
            }
            out.push((Storage::None, 0, None));
            continue;
        };
        if entry.is_none() && arr.is_none() {
            out.push((Storage::None, 0, None));
            continue;
        }
        let Some(width) = v.dtype.width() else {
            return Err(bad_var(format!(
                "dtype {} has no fixed width, so its bytes cannot be served",
                v.dtype.name()
            )));
        };
        let Some(expected) = byte_len(shape, width) else {
            return Err(bad_var(format!(
                "shape {shape:?} has a negative dimension or its size overflows"
            )));
        };
        let too_big = |n: u64| usize::try_from(n).map_err(|_| bad_var("too large".into()));
        if let Some(e) = entry {
            if arr.is_some_and(|a| a.inline.is_some()) {
                return Err(bad_var("has both inline bytes and a manifest entry".into()));
            }
            if e.length != expected {
                return Err(bad_var(format!(
                    "manifest length {} != {} bytes (shape {shape:?} × {width})",
                    e.length, expected
                )));
            }
            if let Some(a) = arr.filter(|a| a.appended_length != 0) {
                let agrees = u64::try_from(a.appended_offset)
                    .ok()
                    .and_then(|rel| blob_start.checked_add(rel))
                    == Some(e.offset)
                    && u64::try_from(a.appended_length) == Ok(e.length);
                if !agrees {
                    return Err(bad_var(format!(
                        "stub (offset {} from B={blob_start}, length {}) disagrees with the \
                         manifest (offset {}, length {})",
                        a.appended_offset, a.appended_length, e.offset, e.length
                    )));
                }
            }
            let storage = if e.length == 0 {
                Storage::Empty
            } else {
                Storage::Appended
            };
            let start = too_big(e.offset)?;
            out.push((storage, e.length, Some(start..start + too_big(e.length)?)));
            continue;
        }
        let a = arr.expect("checked above");
        if a.appended_length != 0 {
            return Err(bad_var(format!(
                "stub of {} appended bytes has no manifest entry",
                a.appended_length
            )));
        }
        match &a.inline {
            Some(r) => {
                if r.len() as u64 != expected {
                    return Err(bad_var(format!(
                        "inline buffer of {} bytes != {expected} bytes (shape {shape:?} × \
                         {width})",
                        r.len()
                    )));
                }
                let at = HEADER_LEN as usize + r.start;
                out.push((Storage::Inline, expected, Some(at..at + r.len())));
            }
            None if expected == 0 => out.push((Storage::Empty, 0, None)),
            None => {
                return Err(bad_var(format!(
                    "array of {expected} bytes holds no data (no buffer, no manifest entry)"
                )))
            }
        }
    }
    Ok(out)
}

/// An opened, checked container.
pub struct Container {
    path: PathBuf,
    kind: Kind,
    pub(crate) parts: Vec<Part>,
    variables: Vec<Variable>,
    index: HashMap<String, usize>,
    /// The archive's map and its entries that are not part of the model.
    extras: Option<(Arc<Backing>, Vec<ZipEntry>)>,
    /// The bundle manifest it was opened through.
    bundle: Option<PathBuf>,
}

impl std::fmt::Debug for Container {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Container")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .field("variables", &self.variables.len())
            .finish()
    }
}

/// Opens `path`: an SDZ archive (zip magic), an SDNB file (SDNB magic), a shard file
/// `<base>.shard<i>-of-<N>.sdnb`, or a base name whose shards sit beside it. Every structure,
/// offset and manifest entry is checked once, within caps that keep a hostile file from making
/// the reader allocate or scan without bound.
///
/// `path` may be an `s3://` URL. The container (an SDNB object, a shard set or an SDZ
/// archive) is read by range: opening fetches each part's header, graph region and
/// manifest (for an archive first its central directory and local headers), and a
/// tensor's blob is fetched the first time it is asked for. With `SHARDKIT_CACHE_DIR` set,
/// the objects are instead copied whole into that bounded cache
/// ([`crate::io::cache_dir`], reused while unchanged) and opened from there.
pub fn open(path: impl AsRef<Path>) -> Result<Container> {
    Container::open_with(path.as_ref(), &Limits::default())
}

impl Container {
    /// [`open`] within `limits`.
    pub(crate) fn open_with(path: &Path, limits: &Limits) -> Result<Container> {
        let location = crate::io::Location::parse(path)?;
        if !location.is_local() {
            return remote::open_remote(&location, limits);
        }
        let path = &location.to_path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // A bundle directory of the native runtime, or its manifest (see the bundle module).
        if let Some((manifest, model)) = super::bundle::resolve(path)? {
            let mut c = Container::open_with(&model, limits)?;
            c.bundle = Some(manifest);
            return Ok(c);
        }
        let dir = crate::fsutil::parent_of(path);
        if let Some((base, _, _)) = sdz::parse_shard_name(&name) {
            return open_sharded(path, dir, base, limits);
        }
        let base = base_name(&name);
        let meta = fs::metadata(path);
        match meta {
            Ok(_) => {
                let mut head = [0u8; 4];
                let mut f = crate::fsutil::open_regular(path)?;
                let n = read_up_to(&mut f, &mut head).at(path)?;
                let head = &head[..n];
                if head == b"PK\x03\x04" {
                    return open_sdz(path, limits);
                }
                if head == MAGIC {
                    let shards = shard_files(dir, base)?;
                    if !shards.is_empty() {
                        return Err(Error::format(
                            path,
                            format!(
                                "ambiguous: an SDNB file and shard files {}.shard*.sdnb sit \
                                 side by side (DL4J would silently load the shards); remove \
                                 one of them",
                                dir.join(base).display()
                            ),
                        ));
                    }
                    return open_single(path, limits);
                }
                Err(Error::format(
                    path,
                    format!(
                        "not a SameDiff container: starts {head:02x?}, neither a ZIP (50 4b 03 \
                         04, SDZ) nor \"SDNB\", and not named <base>.shard<i>-of-<N>.sdnb"
                    ),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !shard_files(dir, base)?.is_empty() {
                    return open_sharded(path, dir, base, limits);
                }
                Err(Error::NotFound {
                    path: path.to_path_buf(),
                    what: format!(
                        "no such file, and no shard files {}.shard<i>-of-<N>.sdnb",
                        dir.join(base).display()
                    ),
                })
            }
            Err(e) => Err(Error::io(path, e)),
        }
    }

    /// The path it was opened from (the model file, for a bundle).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The native runtime's bundle manifest (`manifest.json`) it was opened through, if any.
    pub fn bundle_manifest(&self) -> Option<&Path> {
        self.bundle.as_deref()
    }

    /// An archive's bytes (as opening read them, for a remote one).
    pub(crate) fn archive_bytes(&self) -> Option<&[u8]> {
        self.extras.as_ref().map(|(b, _)| b.bytes())
    }

    /// The files the container is made of: the file itself, or every shard of a set.
    pub fn files(&self) -> Vec<PathBuf> {
        match self.kind() {
            Kind::Sharded { .. } => self.parts.iter().map(|p| p.label.clone()).collect(),
            _ => vec![self.path.clone()],
        }
    }

    /// Single file, shard set or archive.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The graph's key/value metadata (shard 0's for sets), in stored order.
    pub fn metadata(&self) -> &[(String, String)] {
        &self.parts[0].graph.metadata
    }

    /// Every variable, in the graph's order.
    pub fn variables(&self) -> &[Variable] {
        &self.variables
    }

    /// A variable by name.
    pub(crate) fn variable(&self, name: &str) -> Option<&Variable> {
        self.index.get(name).map(|&i| &self.variables[i])
    }

    /// The number of ops (not decoded).
    pub fn op_count(&self) -> usize {
        self.parts[0].graph.node_count
    }

    /// Names of the parameters with updater state, over all parts.
    pub fn updater_params(&self) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| p.graph.updater_params())
            .map(|p| p.unwrap_or("").to_string())
            .collect()
    }

    /// Each part's layout (its name: the file, or `archive!entry`), in shard order.
    pub fn layout(&self) -> Vec<PartLayout> {
        self.parts
            .iter()
            .map(|p| PartLayout {
                name: p.label.clone(),
                bytes: p.range.len() as u64,
                graph_bytes: p
                    .region()
                    .iter()
                    .rposition(|&b| b != 0)
                    .map_or(0, |i| (i as u64 + 1).div_ceil(8) * 8),
                blob_start: p.blob_start,
                manifest_offset: p.header.manifest_offset,
                manifest_bytes: p.header.manifest_len,
                manifest_entries: p.manifest.len(),
            })
            .collect()
    }

    /// Archive entries that are not part of the model (e.g. `tokenizer.json`).
    pub fn extra_entries(&self) -> Vec<&str> {
        self.extras
            .iter()
            .flat_map(|(_, es)| es.iter().map(|e| e.name.as_str()))
            .collect()
    }

    /// The bytes of an archive's extra entry (inflated when compressed).
    pub fn extra_entry(&self, name: &str) -> Result<Vec<u8>> {
        let found = self
            .extras
            .as_ref()
            .and_then(|(map, es)| es.iter().find(|e| e.name == name).map(|e| (map, e)));
        let Some((map, e)) = found else {
            return Err(Error::Missing(format!(
                "{}: no extra entry {name:?}",
                self.path.display()
            )));
        };
        if let Backing::Remote(remote) = &**map {
            // Fetched now: an archive in a store holds only what opening read.
            let data = remote.fetch(e.data.start, e.data.end - e.data.start)?;
            let e = ZipEntry {
                data: 0..data.len() as u64,
                ..e.clone()
            };
            return match e.method {
                Method::Stored => Ok(data),
                Method::Deflate => sdz::inflate(&data, &e, &self.path),
            };
        }
        match e.method {
            Method::Stored => Ok(map.bytes()[e.data.start as usize..e.data.end as usize].to_vec()),
            Method::Deflate => sdz::inflate(map.bytes(), e, &self.path),
        }
    }

    /// A tensor's bytes, straight from the map. Errors for variables without data.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>> {
        let v = self.variable(name).ok_or_else(|| {
            Error::Missing(format!("{}: no variable {name:?}", self.path.display()))
        })?;
        self.tensor_of(v)
    }

    /// Fetches the tensors `names` (every one when empty) of a container read from an object
    /// store in a few lists of parallel, coalesced ranged GETs, so that reading them afterwards
    /// costs no request; tensors already fetched are skipped. Does nothing for a local
    /// container.
    pub fn prefetch<S: AsRef<str>>(&self, names: &[S]) -> Result<()> {
        let vars: Vec<&Variable> = if names.is_empty() {
            self.variables.iter().collect()
        } else {
            names
                .iter()
                .map(|n| {
                    self.variable(n.as_ref()).ok_or_else(|| {
                        Error::Missing(format!(
                            "{}: no variable {:?}",
                            self.path.display(),
                            n.as_ref()
                        ))
                    })
                })
                .collect::<Result<_>>()?
        };
        let mut by_part: std::collections::BTreeMap<usize, Vec<Range<usize>>> = Default::default();
        for v in vars {
            if let Some((p, r)) = &v.data {
                by_part.entry(*p).or_default().push(r.clone());
            }
        }
        for (p, ranges) in by_part {
            let part = &self.parts[p];
            if let Backing::Remote(remote) = &*part.backing {
                let at = part.range.start;
                let ranges: Vec<Range<usize>> = ranges
                    .into_iter()
                    .map(|r| at + r.start..at + r.end)
                    .collect();
                remote.prefetch(&ranges)?;
            }
        }
        Ok(())
    }

    /// The tensor of a listed variable.
    pub(crate) fn tensor_of<'a>(&'a self, v: &'a Variable) -> Result<Tensor<'a>> {
        let shape = match (&v.shape, v.storage) {
            (_, Storage::None) | (None, _) => {
                return Err(Error::Missing(format!(
                    "{}: variable {:?} ({}) has no array",
                    self.path.display(),
                    v.name,
                    v.var_type.name()
                )))
            }
            (Some(s), _) => s,
        };
        let bytes = match &v.data {
            Some((p, r)) => self.parts[*p].data(r.clone())?,
            None => &[][..],
        };
        Ok(Tensor {
            dtype: v.dtype,
            shape,
            order: v.order,
            bytes,
        })
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The file name minus its last extension when the last `.` is past index 0 (DL4J's base).
pub(crate) fn base_name(name: &str) -> &str {
    match name.rfind('.') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    }
}

/// (index, count, path) of the shard set `<base>.shard<i>-of-<N>.sdnb` in `dir`, sorted.
///
/// While an overwrite of the set is being published (its journal, `pending_name`, exists),
/// this is the new set: shard i is the new temporary where it is not renamed yet, and files of
/// the old set that the new one does not replace are left out. Without a journal it is every
/// file that matches the pattern.
pub(crate) fn shard_files(dir: &Path, base: &str) -> Result<Vec<(u32, u32, PathBuf)>> {
    match pending_set(dir, base)? {
        None => listed_shard_files(dir, base),
        Some(set) => Ok(set),
    }
}

/// The set a pending overwrite's journal names, shard i being its temporary until renamed.
pub(crate) fn pending_set(dir: &Path, base: &str) -> Result<Option<Vec<(u32, u32, PathBuf)>>> {
    let Some(n) = pending_count(dir, base)? else {
        return Ok(None);
    };
    let mut set = Vec::with_capacity(n.min(1 << 16) as usize);
    for i in 0..n {
        let last = in_dir(dir, &shard_name(base, i, n));
        let tmp = crate::fsutil::temp_sibling(&last);
        let path = if tmp.is_file() {
            tmp
        } else if last.is_file() {
            last
        } else {
            return Err(Error::format(
                in_dir(dir, &pending_name(base)),
                format!(
                    "journal of an interrupted shard-set overwrite names {n} shards, but {} is \
                     missing and so is its temporary",
                    last.display()
                ),
            ));
        };
        set.push((i, n, path));
    }
    Ok(Some(set))
}

/// `<base>.shard<i>-of-<n>.sdnb`.
pub(crate) fn shard_name(base: &str, i: u32, n: u32) -> String {
    format!("{base}.shard{i}-of-{n}.sdnb")
}

/// The journal of a shard-set overwrite in progress, `.<base>.shard-set.pending` (hidden from
/// DL4J, which matches only the shard pattern): `{"shard_count": N}`. It is written once every
/// new shard is complete and durable under its temporary name, before the first rename, and
/// removed once the old set is gone; while it exists, the new set is the set.
pub(crate) fn pending_name(base: &str) -> String {
    format!(".{base}.shard-set.pending")
}

/// The shard count a pending overwrite's journal names, if there is one.
pub(crate) fn pending_count(dir: &Path, base: &str) -> Result<Option<u32>> {
    let path = in_dir(dir, &pending_name(base));
    let bytes = match crate::fsutil::read_json_file(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let bad = |why: &str| {
        Error::format(
            &path,
            format!("journal of an interrupted shard-set overwrite: {why}"),
        )
    };
    let value = crate::json::parse(&bytes).map_err(|e| bad(&e.to_string()))?;
    let n = value
        .get("shard_count")
        .and_then(crate::json::Value::as_u64)
        .ok_or_else(|| bad("expected {\"shard_count\": N}"))?;
    match u32::try_from(n) {
        Ok(n) if n >= 1 => Ok(Some(n)),
        _ => Err(bad(&format!("shard_count {n} is not in 1..2^32"))),
    }
}

/// Every file in `dir` named `<base>.shard<i>-of-<N>.sdnb`, whatever set it belongs to, sorted.
pub(crate) fn listed_shard_files(dir: &Path, base: &str) -> Result<Vec<(u32, u32, PathBuf)>> {
    let mut out = Vec::new();
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(dir, e)),
    };
    for ent in rd {
        let ent = ent.at(dir)?;
        let name = ent.file_name().to_string_lossy().into_owned();
        if let Some((b, i, n)) = sdz::parse_shard_name(&name) {
            if b == base {
                out.push((i, n, in_dir(dir, &name)));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `dir/name`, or just `name` for the current directory (no `./` in messages).
pub(crate) fn in_dir(dir: &Path, name: &str) -> PathBuf {
    if dir == Path::new(".") {
        PathBuf::from(name)
    } else {
        dir.join(name)
    }
}

/// Maps a whole file read-only.
fn map_file(path: &Path) -> Result<Arc<Backing>> {
    let file = crate::fsutil::open_regular(path)?;
    let len = file.metadata().at(path)?.len();
    if len == 0 {
        return Ok(Arc::new(Backing::Owned(Vec::new())));
    }
    // SAFETY: the map is read-only. shardkit never writes a file while it is mapped except
    // through in-place metadata edits, which touch only the graph region of a file the caller
    // asked to edit; a file truncated by another process can raise SIGBUS, as with any mmap
    // reader.
    let map = unsafe { Mmap::map(&file) }.at(path)?;
    // Opening touches a few pages at both ends of the file; without this hint the kernel's
    // readahead (often megabytes) would read far more. `assemble` restores normal readahead
    // for tensor reads.
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    Ok(Arc::new(Backing::Map(map)))
}

fn open_single(path: &Path, limits: &Limits) -> Result<Container> {
    let backing = map_file(path)?;
    let len = backing.bytes().len();
    let origin = Origin {
        file: path.to_path_buf(),
        offset: 0,
        entry: None,
    };
    let part = Part::parse(backing, 0..len, path.to_path_buf(), origin, limits)?;
    assemble(path, Kind::Sdnb, vec![part], None)
}

fn open_sharded(path: &Path, dir: &Path, base: &str, limits: &Limits) -> Result<Container> {
    let files = shard_files(dir, base)?;
    let set = complete_set(
        files
            .iter()
            .map(|(i, n, p)| (*i, *n, p.display().to_string())),
        &dir.join(format!("{base}.shard*.sdnb")),
    )?;
    let mut parts = Vec::with_capacity(set.len());
    for k in set {
        let p = &files[k].2;
        let backing = map_file(p)?;
        let len = backing.bytes().len();
        let origin = Origin {
            file: p.clone(),
            offset: 0,
            entry: None,
        };
        parts.push(Part::parse(backing, 0..len, p.clone(), origin, limits)?);
    }
    let n = parts.len();
    assemble(path, Kind::Sharded { shards: n }, parts, None)
}

/// Checks that (index, count) pairs form exactly 0..N−1 with one N; returns their positions
/// in shard order.
fn complete_set(
    items: impl Iterator<Item = (u32, u32, String)>,
    what: &Path,
) -> Result<Vec<usize>> {
    let items: Vec<(u32, u32, String)> = items.collect();
    let Some(&(_, n, _)) = items.first() else {
        return Err(Error::NotFound {
            path: what.to_path_buf(),
            what: "no shard files".into(),
        });
    };
    if let Some((_, m, name)) = items.iter().find(|(_, m, _)| *m != n) {
        return Err(Error::format(
            what,
            format!("shard counts differ: {name} says {m}, others {n}"),
        ));
    }
    // N comes from file names: check it against what is there before it sizes anything.
    if n as usize > items.len() + 1024 {
        let have: Vec<u32> = items.iter().map(|(i, _, _)| *i).take(16).collect();
        return Err(Error::format(
            what,
            format!(
                "incomplete shard set: the names declare {n} shards, {} are present (indices \
                 {have:?}{}); shardkit never loads a partial model",
                items.len(),
                if items.len() > 16 { ", ..." } else { "" }
            ),
        ));
    }
    let mut slot: Vec<Option<usize>> = vec![None; n as usize];
    for (k, (i, _, name)) in items.iter().enumerate() {
        if *i >= n {
            return Err(Error::format(
                what,
                format!("{name}: shard index {i} is not below the count {n}"),
            ));
        }
        if slot[*i as usize].replace(k).is_some() {
            return Err(Error::format(what, format!("shard {i} appears twice")));
        }
    }
    let missing: Vec<usize> = (0..n as usize).filter(|&i| slot[i].is_none()).collect();
    if !missing.is_empty() {
        let more = if missing.len() > 16 { ", ..." } else { "" };
        return Err(Error::format(
            what,
            format!(
                "incomplete shard set: {} shard(s) of {n} are missing ({:?}{more}); shardkit \
                 never loads a partial model",
                missing.len(),
                &missing[..missing.len().min(16)]
            ),
        ));
    }
    Ok(slot.into_iter().map(|s| s.expect("complete")).collect())
}

fn open_sdz(path: &Path, limits: &Limits) -> Result<Container> {
    let map = map_file(path)?;
    let bytes = map.bytes();
    let entries = sdz::entries(bytes, path, &limits.zip)?;
    let chosen = sdz::choose_model(bytes, &entries, path)?;
    let order: Vec<usize> = match &chosen {
        ModelEntries::Single(i) => vec![*i],
        ModelEntries::Sharded(v) => v.clone(),
    };
    sdz_container(path, map, entries, &order, limits)
}

/// The container of an archive at `path` held in `backing`: the model entries `order` parsed
/// (STORED in place, DEFLATE inflated), the other entries kept as extras.
fn sdz_container(
    path: &Path,
    backing: Arc<Backing>,
    entries: Vec<ZipEntry>,
    order: &[usize],
    limits: &Limits,
) -> Result<Container> {
    let mut parts = Vec::with_capacity(order.len());
    for &i in order {
        let e = &entries[i];
        let label = PathBuf::from(format!("{}!{}", path.display(), e.name));
        let origin = Origin {
            file: path.to_path_buf(),
            offset: e.data.start,
            entry: Some(e.clone()),
        };
        let part = match e.method {
            Method::Stored => {
                let r = e.data.start as usize..e.data.end as usize;
                Part::parse(backing.clone(), r, label, origin, limits)?
            }
            Method::Deflate => {
                let v = sdz::inflate(backing.bytes(), e, path)?;
                let n = v.len();
                Part::parse(Arc::new(Backing::Owned(v)), 0..n, label, origin, limits)?
            }
        };
        parts.push(part);
    }
    remote::register_blobs(&backing, &parts);
    let extras = entries
        .into_iter()
        .enumerate()
        .filter(|(i, e)| !e.is_dir && !order.contains(i))
        .map(|(_, e)| e)
        .collect();
    let n = parts.len();
    assemble(
        path,
        Kind::Sdz { shards: n },
        parts,
        Some((backing, extras)),
    )
}

/// Merges the parts' variables (§9.6 for sets) into one listing.
fn assemble(
    path: &Path,
    kind: Kind,
    parts: Vec<Part>,
    extras: Option<(Arc<Backing>, Vec<ZipEntry>)>,
) -> Result<Container> {
    let sharded = parts.len() > 1 || matches!(kind, Kind::Sharded { .. });
    if sharded {
        for (i, p) in parts.iter().enumerate() {
            let want = if i == 0 { "graph" } else { "weights" };
            if p.graph.meta("shard.type") != Some(want) {
                return Err(Error::format(
                    &p.label,
                    format!(
                        "shard {i} must be a {want} shard (metadata shard.type={want}), found {:?}",
                        p.graph.meta("shard.type")
                    ),
                ));
            }
            if let Some(idx) = p.graph.meta("shard.index") {
                if idx != i.to_string() {
                    return Err(Error::format(
                        &p.label,
                        format!("metadata shard.index={idx} but the name says shard {i}"),
                    ));
                }
            }
        }
    }
    let mut variables = Vec::with_capacity(parts[0].graph.variables.len());
    let mut index = HashMap::with_capacity(parts[0].graph.variables.len());
    for (i, v) in parts[0].graph.variables.iter().enumerate() {
        let (storage, byte_len, data) = parts[0].located[i].clone();
        index.insert(v.name.clone(), variables.len());
        variables.push(Variable {
            name: v.name.clone(),
            var_type: v.var_type,
            dtype: v.dtype,
            shape: v
                .array
                .as_ref()
                .and_then(|a| a.shape.clone())
                .or_else(|| v.shape.clone()),
            storage,
            byte_len,
            order: v.array.as_ref().map_or(Order::C, |a| a.order),
            data: data.map(|r| (0, r)),
            source: (0, i),
        });
    }
    for (p, part) in parts.iter().enumerate().skip(1) {
        for (i, v) in part.graph.variables.iter().enumerate() {
            let Some(&k) = index.get(&v.name) else {
                return Err(Error::format(
                    &part.label,
                    format!("variable {:?} is not declared by shard 0", v.name),
                ));
            };
            let (storage, byte_len, data) = part.located[i].clone();
            if storage == Storage::None {
                continue;
            }
            let known = &mut variables[k];
            if known.storage != Storage::None {
                return Err(Error::format(
                    &part.label,
                    format!("variable {:?} receives data a second time", v.name),
                ));
            }
            if known.dtype != v.dtype {
                return Err(Error::format(
                    &part.label,
                    format!(
                        "variable {:?} is {} here but {} in shard 0",
                        v.name,
                        v.dtype.name(),
                        known.dtype.name()
                    ),
                ));
            }
            let shape = v
                .array
                .as_ref()
                .and_then(|a| a.shape.clone())
                .or_else(|| v.shape.clone());
            if let (Some(a), Some(b)) = (&known.shape, &shape) {
                if a != b && !a.contains(&-1) {
                    return Err(Error::format(
                        &part.label,
                        format!(
                            "variable {:?} has shape {b:?} here but {a:?} in shard 0",
                            v.name
                        ),
                    ));
                }
            }
            known.shape = shape;
            known.storage = storage;
            known.byte_len = byte_len;
            known.order = v.array.as_ref().map_or(Order::C, |a| a.order);
            known.data = data.map(|r| (p, r));
            known.source = (p, i);
        }
    }
    #[cfg(unix)]
    for p in &parts {
        if let Backing::Map(m) = p.backing.as_ref() {
            let _ = m.advise(memmap2::Advice::Normal);
        }
    }
    Ok(Container {
        path: path.to_path_buf(),
        kind,
        parts,
        variables,
        index,
        extras,
        bundle: None,
    })
}

#[cfg(test)]
mod tests;
