//! Writing containers (samediff.md §9.2, §9.6, §9.7): single SDNB files, shard sets and SDZ
//! archives, from new tensors or from an opened container whose opaque graph parts are
//! carried verbatim.
//!
//! Every part's layout is planned before a byte is written (graph, slack, aligned blobs,
//! manifest), so the header holds its final values from the start, each file is written once
//! front to back in large writes, and an archive entry's CRC-32 is computed as it streams.
//! Files are published atomically.

use std::borrow::Cow;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::graph::{build, byte_len, ArrayOut, Carried, GraphOut, VarDesc, VarOut};
use super::header::{Header, HEADER_LEN};
use super::manifest::{self, Entry};
use super::read::{self, base_name, in_dir, shard_files, Container, Kind, Storage};
use super::sdz::ZipWriter;
use super::types::{DType, Order, VarType};
use crate::commit::WriteLock;
use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// Arrays of at least this many bytes are appended as blobs; smaller ones are inline (DL4J's
/// `APPEND_THRESHOLD_BYTES`).
pub(crate) const APPEND_THRESHOLD: u64 = 1 << 20;
/// The default shard size cap (DL4J's `MAX_SHARD_FILE_BYTES`).
pub(crate) const DEFAULT_SHARD_SIZE: u64 = 1 << 30;
/// Default blob alignment.
pub(crate) const DEFAULT_ALIGN: u64 = 64;
/// Default zero slack after the graph, for in-place metadata edits.
pub(crate) const DEFAULT_SLACK: u64 = 64 << 10;

/// Which container to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One SDNB file at the given path.
    Sdnb,
    /// `<base>.shard<i>-of-<N>.sdnb` beside the given path.
    Sharded,
    /// A ZIP that Deeplearning4j's native runtime and Java both load: STORED entry
    /// `model.sdnb`, or a `model.shard*` set (graph shard first) when a shard size is given.
    Sdz,
}

impl Format {
    /// SDZ for a `.sdz` path, else sharded when a shard size is given, else single SDNB.
    pub fn infer(path: &Path, shard_size: Option<u64>) -> Format {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("sdz"))
        {
            Format::Sdz
        } else if shard_size.is_some() {
            Format::Sharded
        } else {
            Format::Sdnb
        }
    }
}

impl std::str::FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Format> {
        match s.to_ascii_lowercase().as_str() {
            "sdnb" => Ok(Format::Sdnb),
            "sharded" => Ok(Format::Sharded),
            "sdz" => Ok(Format::Sdz),
            _ => Err(Error::Invalid(format!(
                "unknown container format {s:?} (sdnb, sharded, sdz)"
            ))),
        }
    }
}

/// How to write.
#[derive(Clone)]
pub struct SaveOptions {
    /// The container kind.
    pub format: Format,
    /// Shard size cap in bytes (sharded; SDZ writes a shard set when set). A single larger
    /// tensor gets a shard of its own.
    pub shard_size: Option<u64>,
    /// Blob and archive-entry alignment: a power of two from 8 to 32768 (64 by default).
    pub align: u64,
    /// Zero bytes reserved after the graph for in-place metadata edits.
    pub slack: u64,
    /// User metadata; overrides a source container's keys. `nd4j.format.*` and `shard.*` are
    /// set by the writer.
    pub metadata: Vec<(String, String)>,
    /// Further SDZ entries (e.g. `tokenizer.json`), kept as they are. Names ending in
    /// `.sdnb` and SDNB bytes are refused: loaders would take them for part of the model.
    pub extra_entries: Vec<(String, Vec<u8>)>,
    /// Also write `manifest.json` beside the container (replacing one there), making its
    /// directory a bundle of Deeplearning4j's native runtime: `{"modelPath": "<file name>"}`.
    /// Needs one `.sdz` or `.sdnb` file (the runtime loads no shard set).
    pub bundle: bool,
    /// Told (bytes written, bytes in all) as a write proceeds, about every 16 MiB and once at
    /// the end; for progress bars.
    pub progress: Option<Arc<dyn Fn(u64, u64) + Send + Sync>>,
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("format", &self.format)
            .field("shard_size", &self.shard_size)
            .field("align", &self.align)
            .field("slack", &self.slack)
            .field("metadata", &self.metadata)
            .field("extra_entries", &self.extra_entries)
            .field("bundle", &self.bundle)
            .field("progress", &self.progress.as_ref().map(|_| ".."))
            .finish()
    }
}

impl SaveOptions {
    /// The first file that a save to `path` with these options would replace, if any: `path`
    /// itself, or for a shard set any shard of its set (`path` may name a shard or the base).
    pub fn existing(&self, path: &Path) -> Result<Option<PathBuf>> {
        if self.format != Format::Sharded {
            return Ok(path.exists().then(|| path.to_path_buf()));
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.as_deref().unwrap_or("");
        let base =
            super::sdz::parse_shard_name(name).map_or_else(|| base_name(name), |(b, _, _)| b);
        Ok(shard_files(fsutil::parent_of(path), base)?
            .into_iter()
            .next()
            .map(|(_, _, p)| p))
    }
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            format: Format::Sdnb,
            shard_size: None,
            align: DEFAULT_ALIGN,
            slack: DEFAULT_SLACK,
            metadata: Vec::new(),
            extra_entries: Vec::new(),
            bundle: false,
            progress: None,
        }
    }
}

/// A new tensor to store.
#[derive(Debug, Clone)]
pub struct TensorIn<'a> {
    /// Variable name (unique).
    pub name: String,
    /// VARIABLE or CONSTANT.
    pub var_type: VarType,
    /// Element type (a fixed-width one).
    pub dtype: DType,
    /// Shape (non-negative dimensions).
    pub shape: Vec<i64>,
    /// Element order of `bytes`.
    pub order: Order,
    /// prod(shape) × width bytes, little-endian.
    pub bytes: &'a [u8],
}

/// A variable's array to write.
#[derive(Debug, Clone)]
struct Data<'a> {
    dtype: DType,
    shape: Vec<i64>,
    order: Order,
    bytes: &'a [u8],
}

/// Everything a container holds, ready to be laid out.
struct Model<'a> {
    vars: Vec<(Cow<'a, VarDesc>, Option<Data<'a>>)>,
    metadata: Vec<(String, String)>,
    outputs: Vec<(i32, i32)>,
    placeholders: Option<Vec<String>>,
    loss_variables: Option<Vec<String>>,
    training_config: Option<String>,
    nodes: Option<Carried<'a>>,
    configuration: Option<Carried<'a>>,
    sub_instances: Option<Carried<'a>>,
    updater_state: Option<Vec<(Option<String>, Carried<'a>)>>,
}

/// Writes new tensors as a container at `path`; returns the files written. Each tensor's bytes
/// must match its shape and dtype (and a BOOL tensor's bytes be 0 or 1, [`Error::Refused`]):
/// nothing is written otherwise.
pub fn save(path: &Path, tensors: &[TensorIn], opts: &SaveOptions) -> Result<Vec<PathBuf>> {
    let mut seen = std::collections::HashSet::new();
    let mut vars = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let bad = |rule: String| Error::Invalid(format!("tensor {:?}: {rule}", t.name));
        if t.name.is_empty() {
            return Err(bad("empty name".into()));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(bad("name given twice".into()));
        }
        if !t.var_type.has_data() {
            return Err(bad(format!(
                "{} variables carry no stored array (only VARIABLE and CONSTANT do)",
                t.var_type.name()
            )));
        }
        let Some(width) = t.dtype.width().filter(|_| t.dtype != DType::Inherit) else {
            return Err(bad(format!(
                "dtype {} cannot be stored (no fixed element width)",
                t.dtype.name()
            )));
        };
        let Some(n) = byte_len(&t.shape, width) else {
            return Err(bad(format!(
                "shape {:?} has a negative dimension or overflows",
                t.shape
            )));
        };
        if n != t.bytes.len() as u64 {
            return Err(bad(format!(
                "{} bytes given, shape {:?} × {width} needs {n}",
                t.bytes.len(),
                t.shape
            )));
        }
        if t.dtype == DType::Bool {
            if let Some(j) = t.bytes.iter().position(|&b| b > 1) {
                return Err(Error::Refused {
                    path: path.to_path_buf(),
                    field: t.name.clone(),
                    at: format!("element {j}"),
                    value: format!("byte {}", t.bytes[j]),
                    allowed: "0 or 1, a BOOL element is one byte holding false or true".into(),
                });
            }
        }
        let id = i32::try_from(i).map_err(|_| bad("too many tensors".into()))?;
        let desc = VarDesc {
            id: Some((id, 0)),
            name: t.name.clone(),
            dtype: t.dtype,
            shape: Some(t.shape.clone()),
            var_type: t.var_type,
            device: -1,
            control_deps: [None, None, None],
            array: None,
        };
        let data = Data {
            dtype: t.dtype,
            shape: t.shape.clone(),
            order: t.order,
            bytes: t.bytes,
        };
        vars.push((Cow::Owned(desc), Some(data)));
    }
    let mut metadata = opts.metadata.clone();
    if !metadata.iter().any(|(k, _)| k == "creation.time") {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        metadata.push(("creation.time".into(), ms.to_string()));
    }
    let model = Model {
        vars,
        metadata: clean_metadata(&metadata)?,
        outputs: Vec::new(),
        placeholders: None,
        loss_variables: None,
        training_config: None,
        nodes: None,
        configuration: None,
        sub_instances: None,
        updater_state: None,
    };
    write_model(path, &model, opts)
}

/// Writes `src` again as `path` in `opts.format`: same variables, data bytes, ops and other
/// opaque graph parts; metadata from `src` overridden by `opts.metadata`.
pub fn convert(src: &Container, path: &Path, opts: &SaveOptions) -> Result<Vec<PathBuf>> {
    let mut metadata: Vec<(String, String)> = src.metadata().to_vec();
    for (k, v) in &opts.metadata {
        match metadata.iter_mut().find(|(mk, _)| mk == k) {
            Some(slot) => slot.1 = v.clone(),
            None => metadata.push((k.clone(), v.clone())),
        }
    }
    convert_with_metadata(src, path, opts, metadata)
}

/// [`convert`] with the complete metadata given.
pub(crate) fn convert_with_metadata(
    src: &Container,
    path: &Path,
    opts: &SaveOptions,
    metadata: Vec<(String, String)>,
) -> Result<Vec<PathBuf>> {
    let head = &src.parts[0];
    let mut vars = Vec::with_capacity(src.variables().len());
    for (k, v) in src.variables().iter().enumerate() {
        let desc = &head.graph.variables[k];
        let data = match v.storage {
            Storage::None => None,
            _ => {
                let t = src.tensor_of(v)?;
                Some(Data {
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    order: t.order,
                    bytes: t.bytes,
                })
            }
        };
        vars.push((Cow::Borrowed(desc), data));
    }
    let carried = head.graph.carried(head.region());
    let mut updater: Option<Vec<(Option<String>, Carried)>> = carried.updater_state;
    for p in &src.parts[1..] {
        if let Some(us) = p.graph.carried(p.region()).updater_state {
            updater.get_or_insert_with(Vec::new).extend(us);
        }
    }
    let model = Model {
        vars,
        metadata: clean_metadata(&metadata)?,
        outputs: head.graph.outputs.clone(),
        placeholders: head.graph.placeholders.clone(),
        loss_variables: head.graph.loss_variables.clone(),
        training_config: head.graph.training_config.clone(),
        nodes: carried.nodes,
        configuration: carried.configuration,
        sub_instances: carried.sub_instances,
        updater_state: updater,
    };
    let mut opts = opts.clone();
    if matches!(src.kind(), Kind::Sdz { .. }) && opts.format == Format::Sdz {
        for name in src.extra_entries() {
            if !opts.extra_entries.iter().any(|(n, _)| n == name) {
                opts.extra_entries
                    .push((name.to_string(), src.extra_entry(name)?));
            }
        }
    }
    write_model(path, &model, &opts)
}

/// Drops the keys the writer sets itself and rejects duplicates.
fn clean_metadata(m: &[(String, String)]) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::with_capacity(m.len());
    for (k, v) in m {
        if k.starts_with("nd4j.format.") || k.starts_with("shard.") {
            continue;
        }
        if out.iter().any(|(o, _)| o == k) {
            return Err(Error::Invalid(format!("metadata key {k:?} given twice")));
        }
        out.push((k.clone(), v.clone()));
    }
    Ok(out)
}

fn check_options(opts: &SaveOptions) -> Result<()> {
    if !opts.align.is_power_of_two() || !(8..=32768).contains(&opts.align) {
        return Err(Error::Invalid(format!(
            "alignment {} must be a power of two from 8 to 32768",
            opts.align
        )));
    }
    if opts.slack > 1 << 30 {
        return Err(Error::Invalid(format!(
            "slack of {} bytes is over 1 GiB",
            opts.slack
        )));
    }
    if opts.shard_size == Some(0) {
        return Err(Error::Invalid("shard size must be positive".into()));
    }
    if opts.format == Format::Sdnb && opts.shard_size.is_some() {
        return Err(Error::Invalid(
            "a shard size needs the sharded or SDZ format; a single SDNB file is not split".into(),
        ));
    }
    if opts.format != Format::Sdz && !opts.extra_entries.is_empty() {
        return Err(Error::Invalid(
            "extra entries (e.g. tokenizer.json) can only be stored in an SDZ archive".into(),
        ));
    }
    Ok(())
}

fn write_model(path: &Path, model: &Model, opts: &SaveOptions) -> Result<Vec<PathBuf>> {
    check_options(opts)?;
    if !crate::io::is_local(path) {
        return Err(Error::Invalid(format!(
            "{}: containers are written to local files; write it locally, then copy it (each \
             file of a shard set) with \
             `shardkit upload FILE URL` (shardkit.upload)",
            path.display()
        )));
    }
    if path.is_dir() {
        return Err(Error::Exists {
            path: path.to_path_buf(),
            why: "is a directory; give a file path for the container".into(),
        });
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Invalid(format!("{}: not a file name", path.display())))?;
    if opts.bundle {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let one_file = opts.format != Format::Sharded
            && (ext.eq_ignore_ascii_case("sdz") || ext.eq_ignore_ascii_case("sdnb"));
        if !one_file || name.chars().any(char::is_control) {
            return Err(Error::Invalid(format!(
                "{}: a bundle's model is one file named *.sdz or *.sdnb (the native runtime \
                 chooses its reader by the extension and loads no shard set)",
                path.display()
            )));
        }
    }
    let dir = fsutil::parent_of(path);
    if !dir.is_dir() {
        return Err(Error::NotFound {
            path: dir.to_path_buf(),
            what: format!("no such directory to write {} into", path.display()),
        });
    }
    // A shard file's name stands for its set.
    let base = match super::sdz::parse_shard_name(name) {
        Some((b, _, _)) if opts.format == Format::Sharded => b,
        _ => base_name(name),
    };
    // One writer per base name: a single file, its shard set and an SDZ of it share the lock.
    let _lock = WriteLock::beside_as(&dir.join(base), path)?;
    // An overwrite must never leave the old sidecar beside new files (it would call them
    // damaged): it goes first, and the new one is written once every file is in place. A save
    // that fails before replacing anything puts the old one back. Each output has its own
    // sidecar (`m.sdnb.checksums.json`, `m.sdz.checksums.json`, `m.shard-set.checksums.json`),
    // so writing one never touches another container's.
    let taken = crate::checksum::take_container_sidecars(
        &super::sidecar::Naming,
        dir,
        name,
        opts.format == Format::Sharded,
    )?;
    let written = write_model_files(path, model, opts, name, dir, base);
    if written.is_err() {
        crate::checksum::put_back_sidecars(dir, taken);
    }
    let files = written?;
    // The container's own sidecar (see crate::checksum), while the lock is still held.
    if let Some(first) = files.first() {
        crate::checksum::record(first)?;
    }
    if opts.bundle {
        let manifest = dir.join(super::bundle::MANIFEST);
        fsutil::atomic_write(&manifest, super::bundle::manifest_text(name).as_bytes())?;
    }
    Ok(files)
}

/// The files of [`write_model`], published; `name`, `dir` and `base` are `path`'s.
fn write_model_files(
    path: &Path,
    model: &Model,
    opts: &SaveOptions,
    name: &str,
    dir: &Path,
    base: &str,
) -> Result<Vec<PathBuf>> {
    // An overwrite of this base's shard set that a kill interrupted is finished first, so that
    // what follows sees one set (this process holds the lock the killed one had).
    finish_pending(dir, base)?;
    let sharded_parts = match (opts.format, opts.shard_size) {
        (Format::Sharded, cap) => Some(cap.unwrap_or(DEFAULT_SHARD_SIZE)),
        (Format::Sdz, Some(cap)) => Some(cap),
        _ => None,
    };
    let plans = match sharded_parts {
        Some(cap) => plan_sharded(model, cap, opts, path)?,
        None => vec![plan_part(model_graph(model, None), opts, path)?],
    };
    let total = plans.iter().map(PartPlan::len).sum::<u64>()
        + opts
            .extra_entries
            .iter()
            .map(|(_, d)| d.len() as u64)
            .sum::<u64>();
    let mut tracker = Tracker {
        callback: opts.progress.as_ref(),
        done: 0,
        total,
        reported: 0,
    };
    match opts.format {
        Format::Sdnb => {
            let shards = shard_files(dir, base)?;
            if let Some((_, _, p)) = shards.first() {
                return Err(Error::Exists {
                    path: p.clone(),
                    why: format!(
                        "shard files of base {:?} sit here; a single file {} beside them would \
                         be hidden from DL4J's loader. Remove them or choose another name",
                        base,
                        path.display()
                    ),
                });
            }
            write_file(path, &plans[0], &mut tracker)?;
            Ok(vec![path.to_path_buf()])
        }
        Format::Sharded => {
            if super::sdz::parse_shard_name(name).is_none()
                && fsutil::regular_file_len(path).is_some()
            {
                return Err(Error::Exists {
                    path: path.to_path_buf(),
                    why: "a single-file container exists under the shard set's base name; \
                          remove it or choose another name"
                        .into(),
                });
            }
            write_shard_set(dir, base, &plans, &mut tracker)
        }
        Format::Sdz => {
            write_sdz(path, &plans, &opts.extra_entries, opts.align, &mut tracker)?;
            Ok(vec![path.to_path_buf()])
        }
    }
}

/// The graph fields of one part.
struct PartModel<'m, 'a> {
    vars: Vec<(&'m VarDesc, Option<&'m Data<'a>>)>,
    metadata: Vec<(String, String)>,
    outputs: Vec<(i32, i32)>,
    placeholders: Option<Vec<String>>,
    loss_variables: Option<Vec<String>>,
    training_config: Option<String>,
    nodes: Option<Carried<'a>>,
    configuration: Option<Carried<'a>>,
    sub_instances: Option<Carried<'a>>,
    updater_state: Option<Vec<Carried<'a>>>,
}

/// The whole model as one part (with `extra` metadata).
fn model_graph<'m, 'a>(
    model: &'m Model<'a>,
    extra: Option<Vec<(String, String)>>,
) -> PartModel<'m, 'a> {
    let mut metadata = model.metadata.clone();
    metadata.extend(extra.unwrap_or_default());
    PartModel {
        vars: model
            .vars
            .iter()
            .map(|(d, data)| (d.as_ref(), data.as_ref()))
            .collect(),
        metadata,
        outputs: model.outputs.clone(),
        placeholders: model.placeholders.clone(),
        loss_variables: model.loss_variables.clone(),
        training_config: model.training_config.clone(),
        nodes: model.nodes,
        configuration: model.configuration,
        sub_instances: model.sub_instances,
        updater_state: model
            .updater_state
            .as_ref()
            .map(|u| u.iter().map(|(_, c)| *c).collect()),
    }
}

/// One SDNB's planned bytes.
struct PartPlan<'a> {
    graph: Vec<u8>,
    blob_start: u64,
    /// (offset from B, bytes), in file order.
    blobs: Vec<(u64, &'a [u8])>,
    manifest: Vec<u8>,
    header: Header,
}

impl PartPlan<'_> {
    fn len(&self) -> u64 {
        self.header.manifest_offset + self.header.manifest_len
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|y| y / a * a)
}

fn plan_part<'a>(p: PartModel<'_, 'a>, opts: &SaveOptions, path: &Path) -> Result<PartPlan<'a>> {
    let overflow = || Error::Invalid(format!("{}: container size overflows", path.display()));
    let mut blobs: Vec<(u64, &'a [u8], &str)> = Vec::new();
    let mut next = 0u64;
    let mut outs = Vec::with_capacity(p.vars.len());
    for (desc, data) in &p.vars {
        let array = match data {
            None => ArrayOut::None,
            Some(d) => {
                let len = d.bytes.len() as u64;
                if len >= APPEND_THRESHOLD && desc.var_type.has_data() {
                    let rel = align_up(next, opts.align).ok_or_else(overflow)?;
                    next = rel.checked_add(len).ok_or_else(overflow)?;
                    blobs.push((rel, d.bytes, desc.name.as_str()));
                    ArrayOut::Stub {
                        dtype: d.dtype,
                        shape: d.shape.clone(),
                        order: d.order,
                        rel,
                        len,
                    }
                } else {
                    ArrayOut::Inline {
                        dtype: d.dtype,
                        shape: d.shape.clone(),
                        order: d.order,
                        bytes: d.bytes,
                    }
                }
            }
        };
        outs.push(VarOut { desc, array });
    }
    let go = GraphOut {
        variables: outs,
        metadata: p.metadata,
        outputs: p.outputs,
        placeholders: p.placeholders,
        loss_variables: p.loss_variables,
        training_config: p.training_config,
        nodes: p.nodes,
        configuration: p.configuration,
        updater_state: p.updater_state,
        sub_instances: p.sub_instances,
    };
    let graph = build(&go, path)?;
    let after_slack = HEADER_LEN + graph.len() as u64 + opts.slack;
    let blob_start = if blobs.is_empty() {
        after_slack
    } else {
        align_up(after_slack, opts.align).ok_or_else(overflow)?
    };
    let m = blob_start.checked_add(next).ok_or_else(overflow)?;
    let entries: Vec<Entry> = blobs
        .iter()
        .map(|(rel, b, name)| Entry {
            name: name.to_string(),
            offset: blob_start + rel,
            length: b.len() as u64,
        })
        .collect();
    let manifest = manifest::encode(&entries);
    let header = Header {
        manifest_offset: m,
        manifest_len: manifest.len() as u64,
    };
    Ok(PartPlan {
        graph,
        blob_start,
        blobs: blobs.into_iter().map(|(r, b, _)| (r, b)).collect(),
        manifest,
        header,
    })
}

/// Shard 0 (graph and stubs) and weight shards packed by descending size against `cap`.
fn plan_sharded<'a>(
    model: &Model<'a>,
    cap: u64,
    opts: &SaveOptions,
    path: &Path,
) -> Result<Vec<PartPlan<'a>>> {
    let mut with_data: Vec<usize> = (0..model.vars.len())
        .filter(|&i| model.vars[i].1.is_some())
        .collect();
    let size = |i: usize| model.vars[i].1.as_ref().map_or(0, |d| d.bytes.len() as u64);
    with_data.sort_by_key(|&i| std::cmp::Reverse(size(i)));
    // An estimate of each shard's file size: fixed parts plus, per variable, its descriptor,
    // alignment padding and data.
    let fixed = HEADER_LEN + opts.slack + 4096 + opts.align;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut used = 0u64;
    for i in with_data {
        let d = model.vars[i].1.as_ref().expect("has data");
        let est = 512
            + model.vars[i].0.name.len() as u64 * 2
            + 8 * d.shape.len() as u64
            + size(i)
            + opts.align;
        match groups.last_mut() {
            Some(g) if used.saturating_add(est) <= cap => {
                g.push(i);
                used += est;
            }
            _ => {
                groups.push(vec![i]);
                used = fixed + est;
            }
        }
    }
    let n = groups.len() + 1;
    let shard_meta = |i: usize, kind: &str| {
        vec![
            ("shard.index".to_string(), i.to_string()),
            ("shard.type".to_string(), kind.to_string()),
        ]
    };
    let mut plans = Vec::with_capacity(n);
    let mut head = model_graph(model, Some(shard_meta(0, "graph")));
    for v in &mut head.vars {
        v.1 = None;
    }
    // Updater state goes with its parameters' weights; with no weights at all it stays here.
    if !groups.is_empty() {
        head.updater_state = None;
    }
    plans.push(plan_part(head, opts, path)?);
    // Each updater state goes to its parameter's shard; orphans (no parameter among the
    // weights) to the first weight shard.
    let shard_of: std::collections::HashMap<&str, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(s, g)| g.iter().map(move |&i| (model.vars[i].0.name.as_str(), s)))
        .collect();
    let mut states: Vec<Vec<Carried>> = vec![Vec::new(); groups.len()];
    if !groups.is_empty() {
        for (param, c) in model.updater_state.iter().flatten() {
            let s = param
                .as_deref()
                .and_then(|p| shard_of.get(p))
                .map_or(0, |&s| s);
            states[s].push(*c);
        }
    }
    for (s, g) in groups.iter().enumerate() {
        let states = std::mem::take(&mut states[s]);
        let mut metadata = model.metadata.clone();
        metadata.extend(shard_meta(s + 1, "weights"));
        let part = PartModel {
            vars: g
                .iter()
                .map(|&i| (model.vars[i].0.as_ref(), model.vars[i].1.as_ref()))
                .collect(),
            metadata,
            outputs: Vec::new(),
            placeholders: None,
            loss_variables: None,
            training_config: None,
            nodes: None,
            configuration: None,
            sub_instances: None,
            updater_state: (!states.is_empty()).then_some(states),
        };
        plans.push(plan_part(part, opts, path)?);
    }
    Ok(plans)
}

/// Counts written bytes for the progress callback.
struct Tracker<'p> {
    callback: Option<&'p Arc<dyn Fn(u64, u64) + Send + Sync>>,
    done: u64,
    total: u64,
    reported: u64,
}

impl Tracker<'_> {
    fn add(&mut self, n: u64) {
        self.done += n;
        if let Some(p) = self.callback {
            if self.done - self.reported >= 16 << 20 || self.done >= self.total {
                p(self.done, self.total);
                self.reported = self.done;
            }
        }
    }
}

/// Large positional writes with optional CRC and early writeback.
struct Sink<'f, 't, 'p> {
    file: &'f File,
    path: &'f Path,
    pos: u64,
    crc: Option<crc32fast::Hasher>,
    flushed_to: u64,
    tracker: &'t mut Tracker<'p>,
}

const WRITE_CHUNK: usize = 8 << 20;
const WRITEBACK_EVERY: u64 = 64 << 20;

impl Sink<'_, '_, '_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        for chunk in bytes.chunks(WRITE_CHUNK) {
            self.file.write_all_at(chunk, self.pos).at(self.path)?;
            if let Some(c) = &mut self.crc {
                c.update(chunk);
            }
            self.pos += chunk.len() as u64;
            self.tracker.add(chunk.len() as u64);
            if self.pos - self.flushed_to >= WRITEBACK_EVERY {
                fsutil::start_writeback(self.file, self.flushed_to, self.pos - self.flushed_to);
                self.flushed_to = self.pos;
            }
        }
        Ok(())
    }

    fn zeros(&mut self, mut n: u64) -> Result<()> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        while n > 0 {
            let k = n.min(ZEROS.len() as u64);
            self.put(&ZEROS[..k as usize])?;
            n -= k;
        }
        Ok(())
    }

    /// Writes a planned part from the current position.
    fn part(&mut self, plan: &PartPlan) -> Result<()> {
        let start = self.pos;
        self.put(&plan.header.to_bytes())?;
        self.put(&plan.graph)?;
        let mut at = HEADER_LEN + plan.graph.len() as u64;
        for (rel, bytes) in &plan.blobs {
            let want = plan.blob_start + rel;
            self.zeros(want - at)?;
            self.put(bytes)?;
            at = want + bytes.len() as u64;
        }
        self.zeros(plan.header.manifest_offset - at)?;
        self.put(&plan.manifest)?;
        debug_assert_eq!(self.pos - start, plan.len());
        Ok(())
    }
}

/// Writes one SDNB file through a temporary sibling; the caller publishes it.
fn write_temp(path: &Path, plan: &PartPlan, tracker: &mut Tracker) -> Result<PathBuf> {
    let tmp = fsutil::temp_sibling(path);
    let result = (|| {
        let f = File::create(&tmp).at(&tmp)?;
        let mut sink = Sink {
            file: &f,
            path: &tmp,
            pos: 0,
            crc: None,
            flushed_to: 0,
            tracker,
        };
        sink.part(plan)?;
        fsutil::sync_file(&f, &tmp)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(tmp)
}

fn write_file(path: &Path, plan: &PartPlan, tracker: &mut Tracker) -> Result<()> {
    let tmp = write_temp(path, plan, tracker)?;
    fsutil::publish(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

fn write_shard_set(
    dir: &Path,
    base: &str,
    plans: &[PartPlan],
    tracker: &mut Tracker,
) -> Result<Vec<PathBuf>> {
    let n = u32::try_from(plans.len())
        .map_err(|_| Error::Invalid(format!("{} shards is too many", plans.len())))?;
    let names: Vec<PathBuf> = (0..n)
        .map(|i| in_dir(dir, &read::shard_name(base, i, n)))
        .collect();
    let mut temps = Vec::with_capacity(names.len());
    for (p, plan) in names.iter().zip(plans) {
        match write_temp(p, plan, tracker) {
            Ok(t) => temps.push(t),
            Err(e) => {
                for t in &temps {
                    let _ = fs::remove_file(t);
                }
                return Err(e);
            }
        }
    }
    // Renaming N files is not atomic, and the old set may have the same names: a kill between
    // two renames would leave shards of two saves. The journal is the commit point instead:
    // once it is durable (after every temporary and its directory entry), readers see the new
    // set and the next writer finishes the renames; before, the old set is untouched.
    let committed = fsutil::fsync_dir(dir).and_then(|()| {
        let journal = format!("{{\"shard_count\": {n}}}\n");
        fsutil::atomic_write(&in_dir(dir, &read::pending_name(base)), journal.as_bytes())
    });
    if let Err(e) = committed {
        for t in &temps {
            let _ = fs::remove_file(t);
        }
        return Err(e);
    }
    finish_pending(dir, base)?;
    Ok(names)
}

/// Completes a shard-set overwrite whose journal exists (see [`read::pending_name`]): renames
/// the new temporaries to their names, removes the old set's other files, then the journal.
/// Idempotent, so a kill anywhere in it is finished by the next call.
pub(crate) fn finish_pending(dir: &Path, base: &str) -> Result<()> {
    let Some(set) = read::pending_set(dir, base)? else {
        return Ok(());
    };
    let mut names = Vec::with_capacity(set.len());
    for (i, n, path) in set {
        let last = in_dir(dir, &read::shard_name(base, i, n));
        if path != last {
            fsutil::rename(&path, &last)?;
        }
        names.push(last);
    }
    // Shards of the old set with another count would make the set unreadable.
    for (_, _, p) in read::listed_shard_files(dir, base)? {
        if !names.contains(&p) {
            fs::remove_file(&p).at(&p)?;
        }
    }
    fsutil::fsync_dir(dir)?;
    let journal = in_dir(dir, &read::pending_name(base));
    fs::remove_file(&journal).at(&journal)?;
    fsutil::fsync_dir(dir)
}

fn write_sdz(
    path: &Path,
    plans: &[PartPlan],
    extras: &[(String, Vec<u8>)],
    align: u64,
    tracker: &mut Tracker,
) -> Result<()> {
    let n = plans.len();
    // Names that Deeplearning4j's native SdzReader reads (it skips entries not ending in
    // `.sdnb`) and Java's SDZSerializer prefers (`model.sdnb` first); shard 0, which holds the
    // graph, is written first, as the native reader takes the graph from the first entry.
    let names: Vec<String> = if n == 1 {
        vec!["model.sdnb".into()]
    } else {
        (0..n)
            .map(|i| format!("model.shard{i}-of-{n}.sdnb"))
            .collect()
    };
    for (name, data) in extras {
        super::sdz::check_name(name.as_bytes(), path)?;
        // The native reader merges every `.sdnb` entry (its newest revision, and Java, any
        // entry with SDNB bytes) into the model.
        if names.contains(name)
            || name.to_ascii_lowercase().ends_with(".sdnb")
            || name == "model"
            || data.starts_with(&super::header::MAGIC)
        {
            return Err(Error::Invalid(format!(
                "extra entry {name:?} would be taken for part of the model (a name ending in \
                 .sdnb, the name model, or SDNB bytes)"
            )));
        }
    }
    let tmp = fsutil::temp_sibling(path);
    let result = (|| {
        let f = File::create(&tmp).at(&tmp)?;
        let mut zip = ZipWriter::new(f, &tmp, align);
        for (name, plan) in names.iter().zip(plans) {
            let at = zip.start_stored(name, plan.len())?;
            let mut sink = Sink {
                file: zip.file(),
                path: &tmp,
                pos: at,
                crc: Some(crc32fast::Hasher::new()),
                flushed_to: at,
                tracker: &mut *tracker,
            };
            sink.part(plan)?;
            let crc = sink.crc.take().expect("set").finalize();
            zip.advance(plan.len());
            zip.finish_entry(crc)?;
        }
        for (name, data) in extras {
            zip.add_stored(name, data)?;
            tracker.add(data.len() as u64);
        }
        let f = zip.finish()?;
        fsutil::sync_file(&f, &tmp)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fsutil::publish(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}
