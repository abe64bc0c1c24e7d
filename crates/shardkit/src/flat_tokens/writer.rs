//! Appending sequences to one split, crash-safely and resumably (flat_tokens.md §4, §9.3–9.4).
//!
//! The writer keeps the trailing, not yet full chunk of each array in memory (a v2 chunk or a
//! v3 shard: the unit zarr encodes) and stores each chunk once it is full, so appending costs
//! one encode per chunk however the sequences arrive, and the bytes equal a one-shot write.
//!
//! Durability works in commits. A commit stores the trailing chunks, fsyncs, then rewrites the
//! metadata in a fixed order: `encoded_tokens` shape, the split's `max_token_id`, and last the
//! `seq_starts` shape, which is therefore the commit record. Every file is replaced atomically
//! (a `.tmp` sibling renamed over it), so a crash at any point leaves the last commit intact:
//! a resumed writer reads `seq_starts`, rolls `encoded_tokens` back to `seq_starts[-1]`, and
//! carries on. The root group says `write_completed: false` from the first change until
//! [`Writer::finish`] sets it to `true`, so an unfinished dataset is never served.
//!
//! Writing to an object store, the dataset is staged locally and streamed by commit: the chunks
//! a commit completed go up in the background, then the commit is recorded in the store as a
//! checkpoint (its trailing chunks under private names, its metadata documents in the upload
//! journal), from which a killed write resumes on any machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::codec::api::{CodecOptions, CodecSpecificOptions};
use zarrs::array::codec::{ShardingCodecOptions, SubchunkWriteOrder};
use zarrs::array::{Array, ArrayMetadata, ArraySubset, Element, ElementOwned};
use zarrs::filesystem::FilesystemStore;
use zarrs::group::{Group, GroupMetadata};
use zarrs::metadata::v3::GroupMetadataV3;
use zarrs::storage::storage_adapter::atomic_write::AtomicWriteStorageAdapter;
use zarrs::storage::{ListableStorageTraits, StorePrefix, WritableStorageTraits};

use super::layout::{self, Layout};
use super::store::{self, get_json, put_zarr2_json, zarrs_error, Completion, ZarrFormat, MARKER};
use crate::checksum::FileSums;
use crate::commit::parts::PARTS_DIR;
use crate::commit::store_lock::StoreLock;
use crate::commit::{Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::{self, Value};

/// The largest token id the encoding can hold (`2*id + 1` must fit in uint32).
pub const MAX_TOKEN_ID: u32 = (1 << 31) - 1;

mod upload;

use upload::Upload;

type Store = AtomicWriteStorageAdapter<FilesystemStore>;

/// Options of [`Writer::create`].
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Layout of a new dataset. `None`: an existing dataset keeps its own format and chunking,
    /// a new one gets [`Layout::default`] (v3). Asking for a format other than an existing
    /// dataset's is an error.
    pub layout: Option<Layout>,
    /// Continue the split if it already exists (an interrupted write, or a finished split to
    /// append to) instead of refusing. [`WriteSummary::resumed_from`] then says how many sequences
    /// it already holds.
    pub resume: bool,
    /// Commit (make everything so far durable and resumable) whenever this many tokens have
    /// been appended since the last commit; also on [`Writer::flush`] and [`Writer::finish`].
    pub checkpoint_tokens: u64,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            layout: None,
            resume: false,
            checkpoint_tokens: 1 << 28,
        }
    }
}

/// What a write produced: so far ([`Writer::info`]) or when finished ([`Writer::finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteSummary {
    /// The dataset root.
    pub root: PathBuf,
    /// The dataset's zarr format.
    pub format: ZarrFormat,
    /// When the split existed before this writer: the sequences it held (after rolling back an
    /// interrupted write to its last commit). A resumed build skips that many input sequences.
    pub resumed_from: Option<u64>,
    /// Sequences in the split.
    pub seq_count: u64,
    /// Tokens in the split.
    pub token_count: u64,
    /// The split's `max_token_id`.
    pub max_token_id: u64,
    /// Sequences (appended by this writer) that contain token id 0.
    pub sequences_with_id_zero: u64,
}

/// One array's appendable tail: elements `[start, start + buf.len())` of the trailing chunk.
struct Column<T> {
    array: Array<Store>,
    /// Elements per stored chunk (a v2 chunk or a v3 shard).
    unit: u64,
    start: u64,
    buf: Vec<T>,
    /// `buf` holds elements not yet stored.
    dirty: bool,
    /// The v2 `.zarray` document (rewritten in zarr-python 2's text); None for v3.
    zarray: Option<Value>,
    /// Root-relative key of the array, e.g. `train/encoded_tokens`.
    key: String,
}

impl<T: Element + ElementOwned + Copy + Default> Column<T> {
    /// Opens the array and loads its trailing chunk up to `len` elements.
    fn open(
        store: &Arc<Store>,
        fs: &FilesystemStore,
        root: &Path,
        key: &str,
        len: u64,
        v2: bool,
    ) -> Result<Self> {
        let path = root.join(key);
        let zarray = if v2 {
            get_json(fs, root, &format!("{key}/.zarray"))?
        } else {
            None
        };
        // zarrs' default writes a shard's inner chunks in the order they finish encoding; C
        // order makes a shard's bytes a function of its contents (and resume byte-exact).
        let order = CodecSpecificOptions::default().with_option(
            ShardingCodecOptions::default().with_subchunk_write_order(SubchunkWriteOrder::C),
        );
        let array = Array::open(store.clone(), &format!("/{key}"))
            .map_err(|e| zarrs_error(&e, &path, &[], || "cannot open the array".into()))?;
        let mut array = array.with_codec_specific_options(&order);
        let unit = array
            .chunk_shape(&[0])
            .map_err(|e| Error::format(&path, format!("no regular chunk grid: {e}")))?[0]
            .get();
        if let ArrayMetadata::V3(m) = array.metadata() {
            if m.chunk_grid.name() != "regular" {
                return Err(Error::format(
                    &path,
                    format!(
                        "chunk grid {:?}: only a regular grid can be appended to",
                        m.chunk_grid.name()
                    ),
                ));
            }
        }
        if unit > 1 << 28 {
            return Err(Error::format(
                &path,
                format!("chunks of {unit} elements are too large to append to (at most 2^28)"),
            ));
        }
        let start = len - len % unit;
        let buf = if len > start {
            array
                .retrieve_array_subset::<Vec<T>>(&span(start, len))
                .map_err(|e| {
                    let chunk = root.join(array.chunk_key(&[start / unit]).as_str());
                    zarrs_error(&e, &path, &[chunk], || "cannot read the last chunk".into())
                })?
        } else {
            Vec::new()
        };
        array
            .set_shape(vec![len])
            .map_err(|e| Error::format(&path, e.to_string()))?;
        let mut buf_full = Vec::with_capacity(unit as usize);
        buf_full.extend_from_slice(&buf);
        Ok(Column {
            array,
            unit,
            start,
            buf: buf_full,
            dirty: false,
            zarray,
            key: key.to_string(),
        })
    }

    fn len(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    /// Appends `xs`, storing each chunk as it fills.
    fn extend(&mut self, mut xs: &[T], opts: &CodecOptions, root: &Path) -> Result<()> {
        while !xs.is_empty() {
            let room = self.unit as usize - self.buf.len();
            let take = room.min(xs.len());
            self.buf.extend_from_slice(&xs[..take]);
            self.dirty = true;
            xs = &xs[take..];
            if self.buf.len() as u64 == self.unit {
                self.store_tail(opts, root)?;
                self.start += self.unit;
                self.buf.clear();
            }
        }
        Ok(())
    }

    /// Stores the trailing chunk (zero-padded to full size, as zarr stores every chunk) if it
    /// holds unstored elements.
    fn store_tail(&mut self, opts: &CodecOptions, root: &Path) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let index = self.start / self.unit;
        let res = if self.buf.len() as u64 == self.unit {
            self.array.store_chunk_opt(&[index], &self.buf[..], opts)
        } else {
            let mut padded = self.buf.clone();
            padded.resize(self.unit as usize, T::default());
            self.array.store_chunk_opt(&[index], padded, opts)
        };
        res.map_err(|e| {
            let chunk = root.join(self.array.chunk_key(&[index]).as_str());
            zarrs_error(&e, &root.join(&self.key), &[chunk], || {
                format!("chunk {index}")
            })
        })?;
        self.dirty = false;
        Ok(())
    }

    /// The names (root-relative) of the stored chunks `from..` that are full, and of the
    /// trailing chunk when it holds elements.
    fn chunk_names(&self, from: u64) -> (Vec<String>, Option<String>) {
        let key = |i: u64| self.array.chunk_key(&[i]).as_str().to_string();
        let full = self.len() / self.unit;
        let tail = (!self.len().is_multiple_of(self.unit)).then(|| key(full));
        ((from..full).map(key).collect(), tail)
    }

    /// The directory holding this array's chunk files.
    fn chunk_dir(&self, root: &Path) -> PathBuf {
        let k = self.array.chunk_key(&[0]);
        fsutil::parent_of(&root.join(k.as_str())).to_path_buf()
    }

    /// Rewrites the array's metadata with its current length.
    fn store_shape(&mut self, store: &Store, root: &Path) -> Result<()> {
        let len = self.len();
        let path = root.join(&self.key);
        self.array
            .set_shape(vec![len])
            .map_err(|e| Error::format(&path, e.to_string()))?;
        match &mut self.zarray {
            Some(z) => {
                z.set("shape", Value::Array(vec![Value::int(len)]));
                put_zarr2_json(store, root, &format!("{}/.zarray", self.key), z)
            }
            None => self
                .array
                .store_metadata_opt(&layout::metadata_options())
                .map_err(|e| {
                    let meta = path.join("zarr.json");
                    zarrs_error(&e, &path, &[meta], || "cannot write zarr.json".into())
                }),
        }
    }

    /// Erases chunk files past the current length (left by writes that were never committed).
    fn erase_stray_chunks(&self, store: &Store, root: &Path) -> Result<()> {
        let used = self.len().div_ceil(self.unit);
        let prefix = StorePrefix::new(format!("{}/", self.key))
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let keys = store
            .list_prefix(&prefix)
            .map_err(|e| zarrs_error(&e, &root.join(&self.key), &[], || "cannot list".into()))?;
        let first_chunk_key = self.array.chunk_key(&[0]);
        let chunk_prefix = first_chunk_key
            .as_str()
            .strip_suffix('0')
            .unwrap_or_default()
            .to_string();
        for k in keys {
            let Some(idx) = k.as_str().strip_prefix(&chunk_prefix) else {
                continue;
            };
            match idx.parse::<u64>() {
                Ok(i) if i >= used && self.array.chunk_key(&[i]) == k => {
                    store.erase(&k).map_err(|e| {
                        zarrs_error(&e, &root.join(k.as_str()), &[], || "cannot erase".into())
                    })?;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A single-range subset of a 1-D array.
fn span(start: u64, end: u64) -> ArraySubset {
    ArraySubset::new_with_start_shape(vec![start], vec![end - start])
        .expect("one dimension, one range")
}

/// The dataset a writer changes: where it is, its zarr format, and the stores over it (reads go
/// straight to the file system; writes replace each file atomically).
struct Dataset {
    root: PathBuf,
    format: ZarrFormat,
    fs: Arc<FilesystemStore>,
    store: Arc<Store>,
}

impl Dataset {
    fn new(root: &Path, format: ZarrFormat) -> Result<Dataset> {
        let fs = Arc::new(
            FilesystemStore::new(root).map_err(|e| zarrs_error(&e, root, &[], String::new))?,
        );
        let store = Arc::new(AtomicWriteStorageAdapter::new(fs.clone()));
        Ok(Dataset {
            root: root.to_path_buf(),
            format,
            fs,
            store,
        })
    }

    /// Sets one attribute of the group at `group` ("" for the root), keeping the others.
    fn set_attr(&self, group: &str, name: &str, value: serde_json::Value) -> Result<()> {
        let dir = self.root.join(group);
        match self.format {
            ZarrFormat::V2 => {
                let k = if group.is_empty() {
                    ".zattrs".to_string()
                } else {
                    format!("{group}/.zattrs")
                };
                let mut attrs =
                    get_json(&self.fs, &self.root, &k)?.unwrap_or(Value::Object(Vec::new()));
                if !matches!(attrs, Value::Object(_)) {
                    return Err(Error::format(dir.join(".zattrs"), "is not a JSON object"));
                }
                let v = json::parse(value.to_string().as_bytes())
                    .map_err(|e| Error::Invalid(e.to_string()))?;
                if attrs.get(name) == Some(&v) {
                    return Ok(()); // unchanged: no rewrite a kill could leave half-done
                }
                attrs.set(name, v);
                put_zarr2_json(&*self.store, &self.root, &k, &attrs)
            }
            ZarrFormat::V3 => {
                let path = format!("/{group}");
                let mut meta = Group::open(self.fs.clone(), &path)
                    .map_err(|e| zarrs_error(&e, &dir, &[], || "cannot open the group".into()))?
                    .metadata()
                    .clone();
                if let GroupMetadata::V3(m) = &mut meta {
                    if m.attributes.get(name) == Some(&value) {
                        return Ok(()); // unchanged: no rewrite a kill could leave half-done
                    }
                    m.attributes.insert(name.to_string(), value);
                }
                self.store_v3_group(group, meta)
            }
        }
    }

    fn store_v3_group(&self, group: &str, meta: GroupMetadata) -> Result<()> {
        let dir = self.root.join(group);
        Group::new_with_metadata(self.store.clone(), &format!("/{group}"), meta)
            .map_err(|e| zarrs_error(&e, &dir, &[], || "cannot make the group".into()))?
            .store_metadata()
            .map_err(|e| zarrs_error(&e, &dir.join("zarr.json"), &[], || "cannot write".into()))
    }

    /// A new group with `attrs` (v2: `.zattrs` and `.zgroup` in zarr-python 2's text). For v2
    /// the `.zgroup` that makes the directory a group is written last, so a split group exists
    /// only once everything under it does.
    fn create_group(
        &self,
        group: &str,
        attrs: serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        match self.format {
            ZarrFormat::V2 => {
                let prefix = if group.is_empty() {
                    String::new()
                } else {
                    format!("{group}/")
                };
                let attrs = json::parse(serde_json::Value::Object(attrs).to_string().as_bytes())
                    .map_err(|e| Error::Invalid(e.to_string()))?;
                put_zarr2_json(
                    &*self.store,
                    &self.root,
                    &format!("{prefix}.zattrs"),
                    &attrs,
                )?;
                let zgroup = Value::Object(vec![("zarr_format".into(), Value::int(2))]);
                put_zarr2_json(
                    &*self.store,
                    &self.root,
                    &format!("{prefix}.zgroup"),
                    &zgroup,
                )
            }
            ZarrFormat::V3 => self.store_v3_group(
                group,
                GroupMetadata::V3(GroupMetadataV3::new().with_attributes(attrs)),
            ),
        }
    }

    fn set_marker(&self, done: bool) -> Result<()> {
        self.set_attr("", MARKER, serde_json::Value::Bool(done))?;
        fsutil::fsync_dir(&self.root)
    }

    /// A new, empty split: the group with `max_token_id: 0`, `encoded_tokens` of shape 0 and
    /// `seq_starts` of shape 1 (its fill value makes it `[0]`), as seqax's writer creates them.
    ///
    /// The arrays come first and the group document last: a split whose group exists is fully
    /// created, and a write killed before that simply creates it again.
    fn create_split(&self, split: &str, layout: &Layout) -> Result<()> {
        match layout {
            Layout::V2 => {
                for (name, tokens) in [("encoded_tokens", true), ("seq_starts", false)] {
                    let k = format!("{split}/{name}/.zarray");
                    put_zarr2_json(&*self.store, &self.root, &k, &layout::zarray_v2(tokens))?;
                }
            }
            Layout::V3(sharded) => layout::create_v3(&self.store, &self.root, split, sharded)?,
        }
        for dir in ["encoded_tokens", "seq_starts"] {
            fsutil::fsync_dir(&self.root.join(split).join(dir))?;
        }
        fsutil::fsync_dir(&self.root.join(split))?;
        let mut attrs = serde_json::Map::new();
        attrs.insert("max_token_id".into(), 0u64.into());
        self.create_group(split, attrs)?;
        fsutil::fsync_dir(&self.root.join(split))?;
        fsutil::fsync_dir(&self.root)
    }

    fn max_token_id(&self, split: &str) -> Result<u64> {
        let g = Group::open(self.fs.clone(), &format!("/{split}")).map_err(|e| {
            zarrs_error(&e, &self.root.join(split), &[], || {
                "cannot open the group".into()
            })
        })?;
        super::split::max_token_id_attr(&g, &self.root.join(split))
    }

    /// The root's attributes document with the completion marker set to `done`: its file name
    /// and bytes, exactly as [`Dataset::set_marker`] writes them (v2: `.zattrs` in zarr-python
    /// 2's text; v3: `zarr.json` as zarrs stores group metadata). None when it already says so.
    fn marker_document(&self, done: bool) -> Result<Option<(&'static str, Vec<u8>)>> {
        match self.format {
            ZarrFormat::V2 => {
                let mut attrs =
                    get_json(&self.fs, &self.root, ".zattrs")?.unwrap_or(Value::Object(Vec::new()));
                if !matches!(attrs, Value::Object(_)) {
                    return Err(Error::format(
                        self.root.join(".zattrs"),
                        "is not a JSON object",
                    ));
                }
                if attrs.get(MARKER) == Some(&Value::Bool(done)) {
                    return Ok(None);
                }
                attrs.set(MARKER, Value::Bool(done));
                Ok(Some((".zattrs", store::zarr2_json(&attrs))))
            }
            ZarrFormat::V3 => {
                let file = self.root.join("zarr.json");
                let mut meta = Group::open(self.fs.clone(), "/")
                    .map_err(|e| {
                        zarrs_error(&e, &self.root, &[], || "cannot open the group".into())
                    })?
                    .metadata()
                    .clone();
                if let GroupMetadata::V3(m) = &mut meta {
                    let v = serde_json::Value::Bool(done);
                    if m.attributes.get(MARKER) == Some(&v) {
                        return Ok(None);
                    }
                    m.attributes.insert(MARKER.to_string(), v);
                }
                // zarrs' own serialisation, captured in memory.
                let mem = Arc::new(zarrs::storage::store::MemoryStore::new());
                Group::new_with_metadata(mem.clone(), "/", meta)
                    .and_then(|g| g.store_metadata().map_err(Into::into))
                    .map_err(|e| zarrs_error(&e, &file, &[], || "cannot encode".into()))?;
                let bytes =
                    zarrs::storage::ReadableStorageTraits::get(&*mem, &store::key("zarr.json")?)
                        .map_err(|e| zarrs_error(&e, &file, &[], || "cannot encode".into()))?
                        .ok_or_else(|| Error::format(&file, "zarrs stored no group metadata"))?;
                Ok(Some(("zarr.json", bytes.to_vec())))
            }
        }
    }

    fn remove_root_temporaries(&self) -> Result<u64> {
        let mut n = 0;
        for name in [".zgroup.tmp", ".zattrs.tmp", "zarr.json.tmp"] {
            let p = self.root.join(name);
            if p.is_file() {
                std::fs::remove_file(&p).at(&p)?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// Appends sequences to one split of a flat-tokens dataset.
///
/// ```no_run
/// use shardkit::flat_tokens::{Writer, WriterOptions};
/// let mut w = Writer::create("DS.zarr", "train", WriterOptions::default())?;
/// w.append(&[vec![1u32, 2], vec![3, 4, 5], vec![6, 7, 8]])?;
/// w.append(&[vec![9u32], vec![], vec![10, 11]])?;   // any number of calls
/// let summary = w.finish()?;                         // marks the dataset complete
/// # Ok::<(), shardkit::Error>(())
/// ```
pub struct Writer {
    ds: Dataset,
    split: String,
    tokens: Column<u32>,
    starts: Column<u64>,
    max_token_id: u64,
    opts: CodecOptions,
    checkpoint_tokens: u64,
    committed_tokens: u64,
    resumed_seqs: Option<u64>,
    root_marked_writing: bool,
    sequences_with_id_zero: u64,
    scratch: Vec<u32>,
    _lock: WriteLock,
    /// Writing to an object store: the dataset is staged locally and streamed there.
    upload_to: Option<Upload>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("root", &self.ds.root)
            .field("split", &self.split)
            .field("format", &self.ds.format)
            .field("seq_count", &self.seq_count())
            .field("token_count", &self.token_count())
            .finish()
    }
}

fn format_of(l: &Layout) -> ZarrFormat {
    match l {
        Layout::V2 => ZarrFormat::V2,
        Layout::V3(_) => ZarrFormat::V3,
    }
}

/// The zarr format of an existing dataset at `root` (None when there is nothing yet).
fn existing_format(root: &Path) -> Result<Option<ZarrFormat>> {
    match std::fs::metadata(root) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(root, e)),
        Ok(m) if !m.is_dir() => Err(Error::Exists {
            path: root.to_path_buf(),
            why: "exists and is not a directory; a flat-tokens dataset is a directory".into(),
        }),
        Ok(_) => match ZarrFormat::of_group(root) {
            Some(f) => Ok(Some(f)),
            // Empty, or holding only what a writer killed at its very start left.
            None if only_leftovers(root)? => Ok(None),
            None => Err(Error::Exists {
                path: root.to_path_buf(),
                why: "is a non-empty directory that is not a zarr group; refusing to write into it"
                    .into(),
            }),
        },
    }
}

/// Whether `dir` holds nothing but what a writer killed at its very start leaves: temporaries,
/// and a root `.zattrs` that is exactly our `{"write_completed": false}` (written just before
/// the root's `.zgroup`).
fn only_leftovers(dir: &Path) -> Result<bool> {
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name == PARTS_DIR && e.file_type().at(e.path())?.is_dir() {
            continue; // the state of splits being written in parts (`flat_tokens::PartWriter`)
        }
        if !e.file_type().at(e.path())?.is_file() {
            return Ok(false);
        }
        let ours = name.ends_with(".tmp")
            || (name == ".zattrs"
                && json::parse(&fsutil::read_json_file(&e.path()).at(e.path())?).ok()
                    == Some(Value::Object(vec![(MARKER.into(), Value::Bool(false))])));
        if !ours {
            return Ok(false);
        }
    }
    Ok(true)
}

impl Writer {
    /// Opens `split` of the dataset at `root` for appending, creating the dataset and the split
    /// as needed. An existing split is refused unless `options.resume`.
    ///
    /// `root` may be an `s3://bucket/prefix` URL naming an empty prefix: the dataset is then
    /// staged in a local directory ([`crate::commit::staging_dir`]) and streamed to the store. At
    /// each commit the chunks it completed are uploaded in the background (their staged copies
    /// removed once they are in the store), and the commit is recorded in the store's upload
    /// journal as a checkpoint: the trailing chunks (under private names) and the metadata
    /// documents. The staging directory thus holds at most one commit's worth of chunks
    /// (`checkpoint_tokens`) plus the trailing ones. [`Writer::finish`] uploads the rest, the
    /// root group's documents (which carry `write_completed`) last. A killed write is resumed
    /// with `options.resume`: from the staging directory on the same machine, and from the
    /// last checkpoint in the store on any other (the chunks below it are not uploaded again).
    /// To add a split to a dataset already in a store, download it, write locally and upload
    /// it.
    pub fn create(root: impl AsRef<Path>, split: &str, options: WriterOptions) -> Result<Writer> {
        if split != "train" && split != "validation" {
            return Err(Error::Invalid(format!(
                "split must be \"train\" or \"validation\", got {split:?}"
            )));
        }
        let root = match Target::parse(root.as_ref())? {
            Target::Store(target) => return Self::create_remote(target, split, options, None),
            Target::Local(root) => root,
        };
        let parts = root.join(PARTS_DIR).join(split);
        if parts.is_dir() {
            // Its sequences are in the ranks' pieces until their commit writes the split; a
            // whole-split writer would write it beside them.
            return Err(Error::Exists {
                path: parts,
                why: format!(
                    "split {split:?} is being written in parts (flat_tokens.PartWriter; this \
                     directory holds its state): continue it with part writers (any world \
                     size), commit it with `shardkit flat-tokens status --commit`, or write the \
                     split elsewhere"
                ),
            });
        }
        Self::create_local(&root, split, options, None)
    }

    /// [`Writer::create`] of the store prefix `target` by the commit of a split written in
    /// parts, holding its commit lock `lock` instead of the dataset's (as
    /// [`Writer::create_local`] takes the part writers' shared lock).
    pub(crate) fn create_store_held(
        target: Remote,
        split: &str,
        options: WriterOptions,
        lock: StoreLock,
    ) -> Result<Writer> {
        Self::create_remote(target, split, options, Some(lock))
    }

    /// [`Writer::create`] of a local `root`; `lock` is the lock on `root` the writer holds
    /// (a part writer's commit passes its shared one: the ranks' shared locks exclude every
    /// whole-dataset writer), `None` to take it exclusively.
    pub(crate) fn create_local(
        root: &Path,
        split: &str,
        options: WriterOptions,
        lock: Option<WriteLock>,
    ) -> Result<Writer> {
        super::delta::register();
        let existing = existing_format(root)?;
        let split_exists = ZarrFormat::of_group(&root.join(split)).is_some();
        if split_exists && !options.resume {
            let fs =
                FilesystemStore::new(root).map_err(|e| zarrs_error(&e, root, &[], String::new))?;
            let fs = Arc::new(fs);
            let n = Array::open(fs.clone(), &format!("/{split}/seq_starts"))
                .map(|a| a.shape()[0].saturating_sub(1))
                .unwrap_or(0);
            return Err(Error::Exists {
                path: root.join(split),
                why: format!(
                    "the split already holds {n} sequences ({} dataset); resume the write to \
                     continue it or append to it",
                    Completion::read(fs).name()
                ),
            });
        }
        let format = match (existing, options.layout) {
            (Some(f), Some(l)) if f != format_of(&l) => {
                return Err(Error::Invalid(format!(
                    "{}: the dataset is zarr {}; it cannot take a {} split (leave the layout \
                     unset to continue in its format)",
                    root.display(),
                    f.name(),
                    format_of(&l).name()
                )))
            }
            (Some(f), _) => f,
            (None, l) => format_of(&l.unwrap_or_default()),
        };
        std::fs::create_dir_all(root).at(root)?;
        let lock = match lock {
            Some(l) => l,
            None => WriteLock::dir(root)?,
        };
        let ds = Dataset::new(root, format)?;
        // Nothing on disk has changed before this point.
        let cleaned =
            store::remove_temporaries(&root.join(split))? + ds.remove_root_temporaries()?;
        if cleaned > 0 {
            log::info!(
                "{}: removed {cleaned} temporary files of an interrupted write",
                root.display()
            );
        }
        let mut root_marked_writing = false;
        if existing.is_none() {
            // v2 writes the marker before `.zgroup`; a directory holding only that marker is
            // recognised as a killed start (`only_leftovers`) and begun again.
            let mut attrs = serde_json::Map::new();
            attrs.insert(MARKER.into(), false.into());
            ds.create_group("", attrs)?;
            fsutil::fsync_dir(root)?;
            root_marked_writing = true;
        }
        if !split_exists {
            if !root_marked_writing {
                ds.set_marker(false)?;
                root_marked_writing = true;
            }
            let layout = match (format, options.layout) {
                (ZarrFormat::V2, _) => Layout::V2,
                (ZarrFormat::V3, Some(l @ Layout::V3(_))) => l,
                (ZarrFormat::V3, _) => Layout::default(),
            };
            ds.create_split(split, &layout)?;
        }
        let mut w = Self::open_split(ds, split, lock, &options)?;
        w.root_marked_writing = root_marked_writing;
        w.resumed_seqs = split_exists.then(|| w.seq_count());
        Ok(w)
    }

    /// Opens the split's arrays at its last commit: `seq_starts` (the commit record) and
    /// `encoded_tokens` rolled back to `seq_starts[-1]`.
    fn open_split(
        ds: Dataset,
        split: &str,
        lock: WriteLock,
        options: &WriterOptions,
    ) -> Result<Writer> {
        let split_path = ds.root.join(split);
        let v2 = ds.format == ZarrFormat::V2;
        let open = |name: &str, tokens: bool| -> Result<Array<FilesystemStore>> {
            let p = split_path.join(name);
            let a = Array::open(ds.fs.clone(), &format!("/{split}/{name}"))
                .map_err(|e| zarrs_error(&e, &p, &[], || "cannot open the array".into()))?;
            super::split::check_dtype(&a, &p, tokens)?;
            Ok(a)
        };
        let starts_arr = open("seq_starts", false)?;
        let tokens_arr = open("encoded_tokens", true)?;
        let n_starts = starts_arr.shape()[0];
        if n_starts == 0 {
            return Err(Error::format(
                split_path.join("seq_starts"),
                "is empty; it must hold at least the initial 0",
            ));
        }
        let last: Vec<u64> = starts_arr
            .retrieve_array_subset(&span(n_starts - 1, n_starts))
            .map_err(|e| {
                let p = split_path.join("seq_starts");
                zarrs_error(&e, &p, &[], || "cannot read the last sequence start".into())
            })?;
        let token_count = last[0];
        let token_shape = tokens_arr.shape()[0];
        if token_count > token_shape {
            return Err(Error::format(
                &split_path,
                format!(
                    "seq_starts ends at {token_count} but encoded_tokens holds only \
                     {token_shape} tokens; the split is damaged and cannot be continued"
                ),
            ));
        }
        let max_token_id = ds.max_token_id(split)?;
        let tokens_key = format!("{split}/encoded_tokens");
        let starts_key = format!("{split}/seq_starts");
        let tokens = Column::open(&ds.store, &ds.fs, &ds.root, &tokens_key, token_count, v2)?;
        let starts = Column::open(&ds.store, &ds.fs, &ds.root, &starts_key, n_starts, v2)?;
        // Byte-exact v2 chunks need one blosc thread (flat_tokens.md §3.3); zarr-python 2 also
        // stores chunks that equal the fill value.
        let mut opts = CodecOptions::default().with_store_empty_chunks(v2);
        if v2 {
            opts = opts.with_concurrent_target(1);
        }
        let mut w = Writer {
            ds,
            split: split.to_string(),
            tokens,
            starts,
            max_token_id,
            opts,
            checkpoint_tokens: options.checkpoint_tokens.max(1),
            committed_tokens: token_count,
            resumed_seqs: None,
            root_marked_writing: false,
            sequences_with_id_zero: 0,
            scratch: Vec::new(),
            _lock: lock,
            upload_to: None,
        };
        if token_count < token_shape {
            log::warn!(
                "{}: rolling encoded_tokens back from {token_shape} to {token_count} tokens \
                 (a write was interrupted before its commit)",
                split_path.display()
            );
            // Make the rollback durable before anything else lands.
            w.mark_writing()?;
            w.tokens.store_shape(&w.ds.store, &w.ds.root)?;
        }
        Ok(w)
    }

    /// What the writer has written so far (committed or not); `root` is the local dataset
    /// (the staging directory when writing to an object store).
    pub fn info(&self) -> WriteSummary {
        WriteSummary {
            root: self.ds.root.clone(),
            format: self.ds.format,
            resumed_from: self.resumed_seqs,
            seq_count: self.seq_count(),
            token_count: self.token_count(),
            max_token_id: self.max_token_id,
            sequences_with_id_zero: self.sequences_with_id_zero,
        }
    }
    /// Sequences in the split so far (committed or not).
    pub(crate) fn seq_count(&self) -> u64 {
        self.starts.len() - 1
    }
    /// Tokens in the split so far.
    pub(crate) fn token_count(&self) -> u64 {
        self.tokens.len()
    }

    /// Appends whole sequences of token ids. Ids above [`MAX_TOKEN_ID`] (2^31 - 1) are refused
    /// ([`Error::Refused`]) before anything is appended; empty sequences are allowed (`seq_starts` repeats a value);
    /// a sequence containing id 0 (reserved as the loader's input at sequence starts) is
    /// written, with a warning.
    pub fn append<S: AsRef<[u32]>>(&mut self, sequences: &[S]) -> Result<()> {
        for (i, s) in sequences.iter().enumerate() {
            if let Some(j) = s.as_ref().iter().position(|&id| id > MAX_TOKEN_ID) {
                return Err(Error::Refused {
                    path: self.ds.root.join(&self.split),
                    field: "token ids".into(),
                    at: format!("sequence {i} of this append, position {j}"),
                    value: s.as_ref()[j].to_string(),
                    allowed: format!(
                        "0 to {MAX_TOKEN_ID} (below 2^31, as 2*id+1 must fit the uint32 \
                         encoding)"
                    ),
                });
            }
        }
        self.mark_writing()?;
        for s in sequences {
            let s = s.as_ref();
            let mut max = 0u32;
            let mut zero = false;
            self.scratch.clear();
            self.scratch.reserve(s.len());
            for (j, &id) in s.iter().enumerate() {
                max = max.max(id);
                zero |= id == 0;
                self.scratch.push(id << 1 | u32::from(j == 0));
            }
            if zero {
                if self.sequences_with_id_zero == 0 {
                    log::warn!(
                        "{}: sequence {} contains token id 0, which the loader feeds as the \
                         input at sequence starts (seqax's convention); written anyway",
                        self.ds.root.join(&self.split).display(),
                        self.seq_count()
                    );
                }
                self.sequences_with_id_zero += 1;
            }
            if !s.is_empty() {
                self.max_token_id = self.max_token_id.max(u64::from(max));
            }
            self.tokens
                .extend(&self.scratch, &self.opts, &self.ds.root)?;
            let end = self.tokens.len();
            self.starts.extend(&[end], &self.opts, &self.ds.root)?;
        }
        if self.tokens.len() - self.committed_tokens >= self.checkpoint_tokens {
            self.flush()?;
        }
        Ok(())
    }

    /// Commits: everything appended so far becomes durable, and a crash from here on resumes
    /// after it. A writer that has changed nothing (it reopened a finished split and appended
    /// nothing) leaves the dataset as it was, complete.
    pub fn flush(&mut self) -> Result<()> {
        if !self.root_marked_writing {
            return Ok(());
        }
        let (root, store) = (&self.ds.root, &*self.ds.store);
        self.tokens.store_tail(&self.opts, root)?;
        self.starts.store_tail(&self.opts, root)?;
        self.fsync_chunk_dirs()?;
        // Order matters: seq_starts' shape is the commit record and goes last.
        self.tokens.store_shape(store, root)?;
        self.ds.set_attr(
            &self.split,
            "max_token_id",
            serde_json::Value::from(self.max_token_id),
        )?;
        self.starts.store_shape(store, root)?;
        for key in [&self.tokens.key, &self.starts.key, &self.split] {
            fsutil::fsync_dir(&self.ds.root.join(key))?;
        }
        self.committed_tokens = self.tokens.len();
        if let Some(mut up) = self.upload_to.take() {
            let streamed = up.commit(self);
            self.upload_to = Some(up);
            streamed?;
        }
        Ok(())
    }

    /// Commits, removes chunk files no commit covers, and marks the dataset complete.
    ///
    /// Writing to an object store, the staged dataset is then uploaded and its staging
    /// directory removed; the summary's `root` is the dataset's URL.
    pub fn finish(mut self) -> Result<WriteSummary> {
        let Some(mut up) = self.upload_to.take() else {
            return self.finish_local(&Default::default());
        };
        // The final commit's chunks go up with the rest, in `Streaming::finish`.
        let uploaded = up.streaming.uploaded()?;
        let mut summary = self.finish_local(&uploaded)?;
        let url = up.finish(&summary.root, &self.split, &uploaded)?;
        summary.root = url;
        Ok(summary)
    }

    /// `uploaded`: files in the store, not staged (their checksums go into the sidecar).
    fn finish_local(
        &mut self,
        uploaded: &std::collections::BTreeMap<String, FileSums>,
    ) -> Result<WriteSummary> {
        self.flush()?;
        self.tokens
            .erase_stray_chunks(&self.ds.store, &self.ds.root)?;
        self.starts
            .erase_stray_chunks(&self.ds.store, &self.ds.root)?;
        self.fsync_chunk_dirs()?;
        self.ds.set_marker(true)?;
        // zarrs writes the shard files: they are hashed here, once the dataset is complete.
        crate::checksum::record_with(&self.ds.root, uploaded)?;
        Ok(self.info())
    }

    fn fsync_chunk_dirs(&self) -> Result<()> {
        for dir in [
            self.tokens.chunk_dir(&self.ds.root),
            self.starts.chunk_dir(&self.ds.root),
        ] {
            if dir.is_dir() {
                fsutil::fsync_dir(&dir)?;
            }
        }
        Ok(())
    }

    /// Sets `write_completed: false` before the first change this writer makes.
    fn mark_writing(&mut self) -> Result<()> {
        if !self.root_marked_writing {
            // A stale sidecar must not outlive the change (finish writes a new one).
            crate::checksum::remove_sidecar(&self.ds.root.join(crate::checksum::SIDECAR))?;
            self.ds.set_marker(false)?;
            self.root_marked_writing = true;
        }
        Ok(())
    }
}

/// Validates every split of an unmarked dataset (seqax's) in full and, when all pass, sets
/// `write_completed: true` on its root so later opens skip the full validation. Refuses a
/// dataset whose shardkit write was interrupted, and one that fails validation (listing every
/// problem). A dataset already marked is left as it is.
pub fn mark_complete(root: impl AsRef<Path>) -> Result<()> {
    let root = root.as_ref();
    let format = ZarrFormat::of_group(root)
        .ok_or_else(|| Error::format(root, "not a zarr group; expected a flat-tokens dataset"))?;
    match Completion::read(Dataset::new(root, format)?.fs) {
        Completion::Complete => return Ok(()),
        Completion::Interrupted => {
            return Err(Error::Interrupted {
                path: root.to_path_buf(),
                detail: "write_completed is false; resume the write instead of marking it".into(),
            })
        }
        Completion::Unmarked => {}
    }
    let report = super::validate(root);
    if !report.is_valid() {
        return Err(Error::format(
            root,
            format!(
                "not marked, validation failed: {}",
                report
                    .errors()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ));
    }
    let _lock = WriteLock::dir(root)?;
    let ds = Dataset::new(root, format)?;
    ds.remove_root_temporaries()?;
    // The marker changes the root's attributes file, which a sidecar (`tokens checksum` on
    // seqax data) covers: the new document is written with the sidecar kept true across the
    // rename (crate::checksum::Change).
    if let Some((name, bytes)) = ds.marker_document(true)? {
        crate::checksum::replace_file(&root.join(crate::checksum::SIDECAR), root, name, &bytes)?;
    }
    Ok(())
}
