//! Random access to a complete saev directory.
//!
//! Opening checks completeness once (saev.md §12): shards.json exists, its counts sum to
//! `n_examples`, and every shard holding examples exists at full size. A crashed or half-copied
//! directory is refused with the number of examples actually present, never served with zeros.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::local::{plan_reads, read_all, Files};
use crate::io::ReadRange;
use crate::io::{self, Location, Source};
use crate::precision::{self, Dtype};
use crate::saev::layout::{parse_shards_json, Layout, ShardEntry};
use crate::saev::Metadata;

/// Which tokens of each example a flat index enumerates (saev's `tokens` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenMode {
    /// Content tokens only: index `i` is example `i / P`, content token `i % P`.
    Content,
    /// The CLS token of each example: index `i` is example `i` (needs `cls_token`).
    Special,
    /// Every stored token: index `i` is example `i / T`, token slot `i % T`.
    All,
}

impl FromStr for TokenMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "content" | "image" | "patches" => Ok(TokenMode::Content),
            "special" | "cls" => Ok(TokenMode::Special),
            "all" => Ok(TokenMode::All),
            _ => Err(Error::Invalid(format!(
                "unknown token mode {s:?}: expected content, special or all"
            ))),
        }
    }
}

/// The option's canonical name.
impl std::fmt::Display for TokenMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl TokenMode {
    /// The option's canonical name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            TokenMode::Content => "content",
            TokenMode::Special => "special",
            TokenMode::All => "all",
        }
    }

    /// Rows this mode selects per example, or an error when the dataset has no CLS token.
    pub(crate) fn rows_per_example(self, layout: &Layout) -> Result<u64> {
        match self {
            TokenMode::Content => Ok(layout.content_tokens),
            TokenMode::Special if !layout.cls => Err(Error::Invalid(
                "tokens=\"special\" needs a CLS token, but this dataset has cls_token = false"
                    .into(),
            )),
            TokenMode::Special => Ok(1),
            TokenMode::All => Ok(layout.tokens),
        }
    }

    /// For the `j`-th selected row of an example: (stored token slot, reported token index).
    /// The reported index is the content token `c` (0-based), or -1 for CLS.
    pub(crate) fn token_of(self, layout: &Layout, j: u64) -> (u64, i64) {
        let cls = u64::from(layout.cls);
        match self {
            TokenMode::Content => (j + cls, j as i64),
            TokenMode::Special => (0, -1),
            TokenMode::All => (j, j as i64 - cls as i64),
        }
    }
}

/// Ok when the directory is complete (saev.md §12): shards.json lists counts summing to
/// `n_examples` and every shard holding examples exists at full size. Otherwise
/// `Error::Incomplete` with the examples present, or `Error::Format` naming the broken file.
pub(crate) fn check_complete(dir: &Path, layout: &Layout) -> Result<()> {
    let sj = dir.join("shards.json");
    let bytes = match fsutil::read_json_file(&sj) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(&sj, e)),
    };
    check_complete_with(dir, layout, bytes, |name| local_size(&dir.join(name)))
}

/// The size of a regular file, or why it cannot be a shard.
fn local_size(path: &Path) -> Result<u64, &'static str> {
    match std::fs::metadata(path) {
        Err(_) => Err("listed in shards.json but missing"),
        Ok(m) if !m.is_file() => Err("not a regular file"),
        Ok(m) => Ok(m.len()),
    }
}

/// [`check_complete`] of a dataset anywhere: `shards_json` is the commit record's bytes (None
/// when absent) and `size` tells a file's size (local file or object).
pub(crate) fn check_complete_with(
    dir: &Path,
    layout: &Layout,
    shards_json: Option<Vec<u8>>,
    size: impl Fn(&str) -> Result<u64, &'static str>,
) -> Result<()> {
    let sj = dir.join("shards.json");
    let n = layout.n_examples;
    let Some(bytes) = shards_json else {
        let k = leading_full_with(layout, &size);
        return Err(Error::Incomplete {
            path: dir.to_path_buf(),
            present: (k * layout.examples_per_shard).min(n),
            total: n,
            detail: format!(
                "shards.json is missing (it is written last); {k} leading shard files are full \
                 size"
            ),
        });
    };
    let entries = parse_shards_json(&bytes, &sj)?;
    check_entries(&entries, &sj, layout)?;
    for s in 0..layout.n_shards {
        let name = Layout::shard_name(s);
        let path = dir.join(&name);
        match size(&name) {
            Err(why) => return Err(Error::format(&path, why)),
            Ok(len) if len != layout.shard_bytes() => {
                return Err(Error::format(
                    &path,
                    format!(
                        "shard is {len} bytes, expected {} ({} examples x {} bytes); truncated \
                         or not written by this metadata",
                        layout.shard_bytes(),
                        layout.examples_per_shard,
                        layout.example_bytes()
                    ),
                ))
            }
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Checks shards.json entries against the layout: names, counts, a possible spurious trailing
/// empty entry (saev bug, accepted), and completeness.
pub(crate) fn check_entries(entries: &[ShardEntry], sj: &Path, layout: &Layout) -> Result<()> {
    let n_shards = layout.n_shards as usize;
    let dir = fsutil::parent_of(sj);
    if entries.len() > n_shards + 1
        || (entries.len() == n_shards + 1 && entries[n_shards].count != 0)
    {
        return Err(Error::format(
            sj,
            format!(
                "lists {} shards, but metadata implies {n_shards} (plus at most one empty \
                 trailing entry)",
                entries.len()
            ),
        ));
    }
    for (i, e) in entries.iter().enumerate() {
        let want = Layout::shard_name(i as u64);
        if e.name != want {
            return Err(Error::format(
                sj,
                format!("entry {i} names {:?}; expected {want:?}", e.name),
            ));
        }
    }
    let sum: u64 = entries.iter().map(|e| e.count).fold(0, u64::saturating_add);
    if sum < layout.n_examples {
        return Err(Error::Incomplete {
            path: dir.to_path_buf(),
            present: sum,
            total: layout.n_examples,
            detail: format!("shards.json lists {} shard(s)", entries.len()),
        });
    }
    for (i, e) in entries.iter().take(n_shards).enumerate() {
        let want = layout.shard_count(i as u64);
        if e.count != want {
            return Err(Error::format(
                sj,
                format!(
                    "entry {i} ({}) holds {} examples; expected {want} ({} per shard, {} in all)",
                    e.name, e.count, layout.examples_per_shard, layout.n_examples
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn leading_full_with(
    layout: &Layout,
    size: impl Fn(&str) -> Result<u64, &'static str>,
) -> u64 {
    (0..layout.n_shards)
        .take_while(|&s| size(&Layout::shard_name(s)) == Ok(layout.shard_bytes()))
        .count() as u64
}

/// Reads `out.len()` bytes at `offset`, failing (with the file named) on a short read.
pub(crate) fn read_bytes_at(file: &File, path: &Path, offset: u64, out: &mut [u8]) -> Result<()> {
    file.read_exact_at(out, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::format(
                path,
                format!(
                    "file ended before byte {}; it shrank after the dataset was opened",
                    offset + out.len() as u64
                ),
            )
        } else {
            Error::io(path, e)
        }
    })
}

/// `out` seen as its bytes (to read float32 values straight into it).
fn f32_bytes_mut(out: &mut [f32]) -> &mut [u8] {
    // SAFETY: every bit pattern is a valid f32, and the byte view covers exactly `out`.
    unsafe {
        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out))
    }
}

/// Little-endian values read as native ones (a no-op on little-endian machines).
fn from_le_in_place(out: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for v in out.iter_mut() {
            *v = f32::from_bits(v.to_bits().swap_bytes());
        }
    }
}

/// The dataset's local shard files, as the parallel reader takes them.
struct ShardFiles<'a>(&'a Dataset);

impl Files for ShardFiles<'_> {
    fn file(&self, i: u32) -> Result<&File> {
        self.0.shard_file(u64::from(i))
    }
    fn path(&self, i: u32) -> PathBuf {
        self.0.shard_path(u64::from(i))
    }
}

/// A complete saev directory opened for reading.
#[derive(Debug)]
pub struct Dataset {
    dir: PathBuf,
    md: Metadata,
    layout: Layout,
    warnings: Vec<String>,
    shards: Vec<OnceLock<File>>,
    direct: Vec<OnceLock<Option<File>>>,
    labels: Option<File>,
    /// Set when the dataset is not local files: its source and the object names read (the
    /// shards, then labels.bin when present).
    remote: Option<(Arc<dyn Source>, Vec<String>)>,
}

impl Dataset {
    /// Opens `dir`, refusing an incomplete or inconsistent dataset.
    ///
    /// `dir` may be an `s3://bucket/prefix` URL (see [`crate::io`]): metadata.json and
    /// shards.json are fetched and the shards' sizes listed once; every read afterwards is a
    /// ranged GET of exactly the bytes asked for.
    pub fn open(dir: impl AsRef<Path>) -> Result<Dataset> {
        let location = Location::parse(dir.as_ref())?;
        match location.local_path() {
            Some(dir) => Self::open_local(dir.to_path_buf()),
            None => Self::open_source(io::open(&location)?),
        }
    }

    /// Opens the dataset `source` holds: any [`Source`] (a store of your own, or an
    /// `object_store` store through [`crate::io::open_store`]).
    pub fn open_source(source: Arc<dyn Source>) -> Result<Dataset> {
        match source.local_path() {
            Some(dir) => Self::open_local(dir.to_path_buf()),
            None => Self::open_remote(source),
        }
    }

    fn open_local(dir: PathBuf) -> Result<Dataset> {
        let ds = Self::open_unfinished(&dir)?;
        check_complete(&dir, &ds.layout)?;
        Ok(ds)
    }

    /// Opens the local dataset `dir` whether or not it is committed (a follow-mode loader
    /// reading while it is written): the metadata is read and checked, nothing else. Shards
    /// are opened on first use, so only durable ones may be touched; labels.bin is used when
    /// present (the dataset committed).
    pub(crate) fn open_unfinished(dir: &Path) -> Result<Dataset> {
        if !dir.is_dir() {
            return Err(super::metadata::missing_metadata(dir, true, &[]));
        }
        let (md, warnings) = Metadata::read(dir)?;
        let layout = Layout::new(&md, &dir.join("metadata.json"))?;
        fsutil::raise_open_file_limit();
        let labels_path = dir.join("labels.bin");
        let labels = match fsutil::regular_file_len(&labels_path) {
            Some(len) if len == layout.n_examples * layout.content_tokens => {
                Some(File::open(&labels_path).at(&labels_path)?)
            }
            _ => None,
        };
        Ok(Dataset {
            shards: (0..layout.n_shards).map(|_| OnceLock::new()).collect(),
            direct: (0..layout.n_shards).map(|_| OnceLock::new()).collect(),
            dir: dir.to_path_buf(),
            md,
            layout,
            warnings,
            labels,
            remote: None,
        })
    }

    fn open_remote(remote: Arc<dyn Source>) -> Result<Dataset> {
        Self::open_remote_as(remote, false).map(|(ds, _)| ds)
    }

    /// Opens the dataset in the store `remote` whether or not it is committed (a follow-mode
    /// loader reading while it is written in parts), as [`Dataset::open_unfinished`] does a
    /// directory: metadata.json is read and the objects listed once; with shards.json it must
    /// be complete (else it is broken, and the error names what). Returns whether it is
    /// committed. Only shards known durable may be read.
    pub(crate) fn open_unfinished_remote(remote: Arc<dyn Source>) -> Result<(Dataset, bool)> {
        Self::open_remote_as(remote, true)
    }

    /// [`Dataset::open_remote`], or with `unfinished` [`Dataset::open_unfinished_remote`].
    fn open_remote_as(remote: Arc<dyn Source>, unfinished: bool) -> Result<(Dataset, bool)> {
        let dir = remote.location().to_path();
        let objects: std::collections::HashMap<String, u64> = remote.list()?.into_iter().collect();
        let md_path = remote.path_of("metadata.json");
        if !objects.contains_key("metadata.json") {
            let candidates = super::metadata::remote_candidates(objects.keys());
            return Err(super::metadata::missing_metadata(&dir, false, &candidates));
        }
        let (md, warnings) = Metadata::parse(&remote.get("metadata.json")?, &md_path)?;
        let layout = Layout::new(&md, &md_path)?;
        let shards_json = match objects.contains_key("shards.json") {
            true => Some(remote.get("shards.json")?),
            false => None,
        };
        let committed = shards_json.is_some();
        if committed || !unfinished {
            check_complete_with(&dir, &layout, shards_json, |name| {
                objects
                    .get(name)
                    .copied()
                    .ok_or("listed in shards.json but missing")
            })?;
        }
        let mut names: Vec<String> = (0..layout.n_shards).map(Layout::shard_name).collect();
        let has_labels =
            objects.get("labels.bin") == Some(&(layout.n_examples * layout.content_tokens));
        if has_labels {
            names.push("labels.bin".into());
        }
        let ds = Dataset {
            shards: Vec::new(),
            direct: Vec::new(),
            dir,
            md,
            layout,
            warnings,
            labels: None,
            remote: Some((remote, names)),
        };
        Ok((ds, committed))
    }

    /// The object store holding the dataset and the names of its shards (then labels.bin),
    /// when it is remote.
    pub(crate) fn remote(&self) -> Option<(&dyn Source, &[String])> {
        self.remote.as_ref().map(|(r, n)| (&**r, &n[..]))
    }

    /// Reads `out.len()` stored bytes of shard `s` at `offset`, from its file or with ranged
    /// GETs.
    fn read_shard_bytes(&self, s: u64, offset: u64, out: &mut [u8]) -> Result<()> {
        match &self.remote {
            None => read_bytes_at(self.shard_file(s)?, &self.shard_path(s), offset, out),
            Some((remote, names)) => {
                let r = ReadRange {
                    file: s as u32,
                    offset,
                    len: out.len() as u64,
                    dst: 0,
                };
                remote.read_into(names, &[r], out, &io::Stop::never())
            }
        }
    }

    /// Reads `out.len()` values of shard `s` from byte `offset`, as float32 (widened from the
    /// stored type when it is a reduced one).
    fn read_shard_at(&self, s: u64, offset: u64, out: &mut [f32]) -> Result<()> {
        match self.layout.dtype {
            Dtype::F32 => {
                self.read_shard_bytes(s, offset, f32_bytes_mut(out))?;
                from_le_in_place(out);
            }
            dtype => {
                let mut stored = vec![0u8; out.len() * dtype.size()];
                self.read_shard_bytes(s, offset, &mut stored)?;
                precision::decode(dtype, &stored, out);
            }
        }
        Ok(())
    }

    /// The dataset directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
    /// The parsed metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.md
    }
    /// The index arithmetic.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Warnings from parsing metadata.json (unknown minor version, foreign key names, ...).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// Whether a usable labels.bin (`N·P` bytes) is present.
    pub fn has_labels(&self) -> bool {
        self.labels.is_some()
            || self
                .remote
                .as_ref()
                .is_some_and(|(_, n)| n.last().is_some_and(|l| l == "labels.bin"))
    }

    /// The path of shard `s`.
    /// (An `s3://` URL when the dataset is remote.)
    pub(crate) fn shard_path(&self, s: u64) -> PathBuf {
        self.dir.join(Layout::shard_name(s))
    }

    /// The open file of shard `s`.
    pub(crate) fn shard_file(&self, s: u64) -> Result<&File> {
        let cell = self.shards.get(s as usize).ok_or(Error::OutOfRange {
            what: "shard",
            index: s as i64,
            len: self.layout.n_shards,
        })?;
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let path = self.shard_path(s);
        let f = File::open(&path).at(&path)?;
        let _ = cell.set(f);
        Ok(cell.get().expect("just set"))
    }

    /// Shard `s` opened with O_DIRECT, when the file system allows it (opened once, lazily).
    pub(crate) fn shard_file_direct(&self, s: u64) -> Option<&File> {
        self.direct
            .get(s as usize)?
            .get_or_init(|| crate::io::local::open_direct(&self.shard_path(s)))
            .as_ref()
    }

    fn check_example(&self, example: u64) -> Result<()> {
        if example >= self.layout.n_examples {
            return Err(Error::OutOfRange {
                what: "example",
                index: example as i64,
                len: self.layout.n_examples,
            });
        }
        Ok(())
    }

    fn check_token(&self, token: u64) -> Result<()> {
        if token >= self.layout.tokens {
            return Err(Error::OutOfRange {
                what: "token slot",
                index: token as i64,
                len: self.layout.tokens,
            });
        }
        Ok(())
    }

    /// Reads the vector of (`example`, layer `slot`, token `slot t`) into `out` (`D` values).
    pub(crate) fn read_vector_into(
        &self,
        example: u64,
        slot: usize,
        t: u64,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_example(example)?;
        self.check_token(t)?;
        if out.len() as u64 != self.layout.d_model || slot as u64 >= self.layout.n_layers {
            return Err(Error::Invalid(format!(
                "read_vector_into: need a buffer of d_model = {} values and a slot below {}",
                self.layout.d_model, self.layout.n_layers
            )));
        }
        let (s, _) = self.layout.locate(example);
        let off = self.layout.offset(example, slot as u64, t);
        self.read_shard_at(s, off, out)
    }

    /// Reads one example's contiguous slab of recorded layer value `layer` (`T·D` values, every
    /// stored token) into `out`.
    pub fn read_slab_into(&self, example: u64, layer: i64, out: &mut [f32]) -> Result<()> {
        let slot = self.md.layer_slot(layer)?;
        self.check_example(example)?;
        if out.len() as u64 != self.layout.tokens * self.layout.d_model {
            return Err(Error::Invalid(format!(
                "read_slab_into: need a buffer of T*D = {} values",
                self.layout.tokens * self.layout.d_model
            )));
        }
        let (s, _) = self.layout.locate(example);
        let off = self.layout.offset(example, slot as u64, 0);
        self.read_shard_at(s, off, out)
    }

    /// [`Dataset::read_slab_into`] as stored: `T·D` values of the dataset's
    /// [`dtype`](Layout::dtype), little-endian bytes.
    pub fn read_slab_stored_into(&self, example: u64, layer: i64, out: &mut [u8]) -> Result<()> {
        let slot = self.md.layer_slot(layer)?;
        self.check_example(example)?;
        if out.len() as u64 != self.layout.slab_bytes() {
            return Err(Error::Invalid(format!(
                "read_slab_stored_into: need a buffer of T*D*{} = {} bytes",
                self.layout.dtype.size(),
                self.layout.slab_bytes()
            )));
        }
        let (s, _) = self.layout.locate(example);
        let off = self.layout.offset(example, slot as u64, 0);
        self.read_shard_bytes(s, off, out)
    }

    /// Reads whole examples from `first` as stored into `out` (`k` examples: `k` times
    /// `L·T·D` little-endian values of the dataset's [`dtype`](Layout::dtype), C order
    /// `(k, L, T, D)`), across shards as needed. The bytes of consecutive examples lie
    /// together in a shard, so this is a few large reads: split over threads for local shards,
    /// concurrent ranged GETs for a store (what a conversion or a copy streams through).
    pub fn read_examples_stored(&self, first: u64, out: &mut [u8]) -> Result<()> {
        let eb = self.layout.example_bytes();
        let n = out.len() as u64 / eb.max(1);
        if eb == 0 || n * eb != out.len() as u64 {
            return Err(Error::Invalid(format!(
                "read_examples_stored: the buffer holds {} bytes, not a whole number of examples \
                 ({eb} bytes each)",
                out.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.check_example(first)?;
        self.check_example(first + n - 1)?;
        let eps = self.layout.examples_per_shard;
        let mut ranges = Vec::new();
        let mut e = first;
        while e < first + n {
            let (s, k) = (e / eps, e % eps);
            let count = (eps - k).min(first + n - e);
            ranges.push(ReadRange {
                file: s as u32,
                offset: k * eb,
                len: count * eb,
                dst: (e - first) * eb,
            });
            e += count;
        }
        match &self.remote {
            Some((remote, names)) => remote.read_into(names, &ranges, out, &io::Stop::never()),
            None => read_all(
                &ShardFiles(self),
                &plan_reads(ranges),
                out,
                crate::config::available_cores(),
                false,
            ),
        }
    }

    /// [`Dataset::read_examples_stored`] widened to float32 (exact): `out` holds `k` whole
    /// examples, `k·L·T·D` values.
    pub fn read_examples_into(&self, first: u64, out: &mut [f32]) -> Result<()> {
        let ev = self.layout.example_values() as usize;
        if ev == 0 || !out.len().is_multiple_of(ev) {
            return Err(Error::Invalid(format!(
                "read_examples_into: the buffer holds {} values, not a whole number of examples \
                 (L*T*D = {ev} each)",
                out.len()
            )));
        }
        match self.layout.dtype {
            Dtype::F32 => {
                self.read_examples_stored(first, f32_bytes_mut(out))?;
                from_le_in_place(out);
            }
            dtype => {
                let mut stored = vec![0u8; out.len() * dtype.size()];
                self.read_examples_stored(first, &mut stored)?;
                precision::decode(dtype, &stored, out);
            }
        }
        Ok(())
    }

    /// One vector: `example`, recorded layer value `layer`, stored token slot `token` (slot 0 is
    /// CLS when the dataset has one).
    pub fn get(&self, example: u64, layer: i64, token: u64) -> Result<Vec<f32>> {
        let slot = self.md.layer_slot(layer)?;
        let mut out = vec![0f32; self.layout.d_model as usize];
        self.read_vector_into(example, slot, token, &mut out)?;
        Ok(out)
    }

    /// Many vectors at once, `(example, layer value, token slot)` each, returned row-major
    /// (`coords.len() × D`) as float32 (widened from a reduced stored type). Reads run in
    /// parallel, in file order.
    pub fn take(&self, coords: &[(u64, i64, u64)]) -> Result<Vec<f32>> {
        let d = self.layout.d_model as usize;
        match self.layout.dtype {
            Dtype::F32 => {
                let mut out = vec![0f32; coords.len() * d];
                self.take_into(coords, f32_bytes_mut(&mut out))?;
                from_le_in_place(&mut out);
                Ok(out)
            }
            dtype => Ok(precision::decoded(dtype, &self.take_stored(coords)?)),
        }
    }

    /// [`Dataset::take`] as stored: `coords.len() × D` values of the dataset's
    /// [`dtype`](Layout::dtype), little-endian bytes (half of float32's for bfloat16).
    pub fn take_stored(&self, coords: &[(u64, i64, u64)]) -> Result<Vec<u8>> {
        let mut out = vec![0u8; coords.len() * self.layout.vector_bytes() as usize];
        self.take_into(coords, &mut out)?;
        Ok(out)
    }

    /// Reads the stored bytes of the vectors at `coords` into `out` (rows in `coords` order).
    fn take_into(&self, coords: &[(u64, i64, u64)], out: &mut [u8]) -> Result<()> {
        let rb = self.layout.vector_bytes() as usize;
        let mut resolved = Vec::with_capacity(coords.len());
        for (i, &(e, layer, t)) in coords.iter().enumerate() {
            self.check_example(e)?;
            self.check_token(t)?;
            let slot = self.md.layer_slot(layer)? as u64;
            let (s, _) = self.layout.locate(e);
            resolved.push((s, self.layout.offset(e, slot, t), i));
        }
        resolved.sort_unstable();
        if let Some((remote, names)) = &self.remote {
            // One coalesced batch of ranged GETs, many in flight.
            let ranges: Vec<ReadRange> = resolved
                .iter()
                .map(|&(s, off, i)| ReadRange {
                    file: s as u32,
                    offset: off,
                    len: rb as u64,
                    dst: (i * rb) as u64,
                })
                .collect();
            return remote.read_into(names, &ranges, out, &io::Stop::never());
        }
        // Hand each thread a contiguous run of the sorted requests; scatter by original index.
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get() * 4)
            .clamp(1, 16)
            .min(coords.len().div_ceil(64).max(1));
        let out_ptr = SendPtr(out.as_mut_ptr());
        let what = format!("reading rows of {}", self.dir.display());
        crate::par::chunked(&resolved, threads, &what, |chunk| {
            for &(s, off, i) in chunk {
                // SAFETY: each original index appears once, so the row slices written by
                // different threads never overlap, and `out` outlives the threads.
                let row = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(i * rb), rb) };
                read_bytes_at(self.shard_file(s)?, &self.shard_path(s), off, row)?;
            }
            Ok(Vec::<()>::new())
        })
        .map(|_| ())
    }

    /// The labels of one example's content tokens (`P` values), if labels.bin exists.
    pub fn read_labels_into(&self, example: u64, out: &mut [u8]) -> Result<bool> {
        self.check_example(example)?;
        if !self.has_labels() {
            return Ok(false);
        }
        if out.len() as u64 != self.layout.content_tokens {
            return Err(Error::Invalid("labels buffer must hold P values".into()));
        }
        let Some(f) = &self.labels else {
            let (remote, names) = self.remote.as_ref().ok_or_else(|| {
                Error::Internal("internal: labels neither local nor remote".into())
            })?;
            let r = ReadRange {
                file: names.len() as u32 - 1,
                offset: example * self.layout.content_tokens,
                len: out.len() as u64,
                dst: 0,
            };
            remote.read_into(names, &[r], out, &io::Stop::never())?;
            return Ok(true);
        };
        let path = self.dir.join("labels.bin");
        f.read_exact_at(out, example * self.layout.content_tokens)
            .map_err(|e| Error::io(&path, e))?;
        Ok(true)
    }

    /// The labels of examples `first..first + k` (`k·P` bytes, `out.len()` a multiple of
    /// `P`) into `out`; `false` (and `out` untouched) when the dataset has no labels.
    pub fn read_labels_run(&self, first: u64, out: &mut [u8]) -> Result<bool> {
        let p = self.layout.content_tokens;
        if !self.has_labels() || out.is_empty() {
            return Ok(self.has_labels());
        }
        let k = out.len() as u64 / p.max(1);
        if p == 0 || k * p != out.len() as u64 {
            return Err(Error::Invalid(format!(
                "read_labels_run: the buffer holds {} bytes, not a multiple of P = {p}",
                out.len()
            )));
        }
        self.check_example(first)?;
        self.check_example(first + k - 1)?;
        match (&self.labels, &self.remote) {
            (Some(f), _) => read_bytes_at(f, &self.dir.join("labels.bin"), first * p, out)?,
            (None, Some((remote, names))) => {
                let r = ReadRange {
                    file: names.len() as u32 - 1,
                    offset: first * p,
                    len: out.len() as u64,
                    dst: 0,
                };
                remote.read_into(names, &[r], out, &io::Stop::never())?;
            }
            (None, None) => return Err(Error::Internal("internal: no labels.bin".into())),
        }
        Ok(true)
    }

    /// Byte `at` of labels.bin (which must exist).
    fn read_label(&self, at: u64) -> Result<u8> {
        let mut b = [0u8];
        match (&self.labels, &self.remote) {
            (Some(f), _) => {
                let path = self.dir.join("labels.bin");
                f.read_exact_at(&mut b, at)
                    .map_err(|e| Error::io(&path, e))?;
            }
            (None, Some((remote, names))) => {
                let r = ReadRange {
                    file: names.len() as u32 - 1,
                    offset: at,
                    len: 1,
                    dst: 0,
                };
                remote.read_into(names, &[r], &mut b, &io::Stop::never())?;
            }
            (None, None) => return Err(Error::Internal("internal: no labels.bin".into())),
        }
        Ok(b[0])
    }

    /// The whole of labels.bin (`N·P` bytes), when the dataset has it.
    pub(crate) fn read_all_labels(&self) -> Result<Option<Vec<u8>>> {
        if !self.has_labels() {
            return Ok(None);
        }
        let len = self.layout.n_examples * self.layout.content_tokens;
        let mut all = vec![0u8; len as usize];
        match (&self.labels, &self.remote) {
            (Some(f), _) => {
                let path = self.dir.join("labels.bin");
                f.read_exact_at(&mut all, 0)
                    .map_err(|e| Error::io(&path, e))?;
            }
            (None, Some((remote, names))) => {
                let r = ReadRange {
                    file: names.len() as u32 - 1,
                    offset: 0,
                    len,
                    dst: 0,
                };
                remote.read_into(names, &[r], &mut all, &io::Stop::never())?;
            }
            (None, None) => return Err(Error::Internal("internal: no labels.bin".into())),
        }
        Ok(Some(all))
    }

    /// saev's indexed view: flat index → one row of `layer` under `mode`.
    pub fn indexed(&self, layer: i64, mode: TokenMode) -> Result<Indexed<'_>> {
        let slot = self.md.layer_slot(layer)?;
        let per_example = mode.rows_per_example(&self.layout)?;
        Ok(Indexed {
            ds: self,
            slot,
            mode,
            per_example,
            len: self.layout.n_examples * per_example,
        })
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: used only for disjoint writes inside a thread scope (see `take_into`).
unsafe impl Send for SendPtr {}
// SAFETY: as above: threads share the pointer, never the bytes they write through it.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

/// One row of an indexed view.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The activation (`D` values).
    pub act: Vec<f32>,
    /// Global example index.
    pub example_idx: u64,
    /// Content token index, -1 for CLS.
    pub token_idx: i64,
    /// The labels.bin value of a content token, when labels exist.
    pub token_label: Option<u8>,
}

/// saev's indexed semantics over one layer and token mode (see [`Dataset::indexed`]).
#[derive(Debug, Clone, Copy)]
pub struct Indexed<'a> {
    ds: &'a Dataset,
    slot: usize,
    mode: TokenMode,
    per_example: u64,
    len: u64,
}

impl Indexed<'_> {
    /// Number of rows.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// (example, stored token slot, reported token index) of row `i`.
    pub fn locate(&self, i: u64) -> Result<(u64, u64, i64)> {
        if i >= self.len {
            return Err(Error::OutOfRange {
                what: "index",
                index: i.min(i64::MAX as u64) as i64,
                len: self.len,
            });
        }
        let e = i / self.per_example;
        let (t, token_idx) = self.mode.token_of(&self.ds.layout, i % self.per_example);
        Ok((e, t, token_idx))
    }
    /// Row `i`.
    pub fn get(&self, i: u64) -> Result<Row> {
        let (e, t, token_idx) = self.locate(i)?;
        let mut act = vec![0f32; self.ds.layout.d_model as usize];
        self.ds.read_vector_into(e, self.slot, t, &mut act)?;
        let token_label = match token_idx {
            c if c >= 0 && self.ds.has_labels() => Some(
                self.ds
                    .read_label(e * self.ds.layout.content_tokens + c as u64)?,
            ),
            _ => None,
        };
        Ok(Row {
            act,
            example_idx: e,
            token_idx,
            token_label,
        })
    }
}
