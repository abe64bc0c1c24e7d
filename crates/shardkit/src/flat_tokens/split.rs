//! One split (`train` or `validation`) of a flat-tokens dataset, read through zarrs and checked
//! against every invariant of the format (flat_tokens.md §2.3, §9.3).
//!
//! Opening reads metadata only (plus two `seq_starts` entries for a marked dataset), so it is
//! fast whatever the size; `seq_starts` is read on demand, like the tokens. Sharded arrays are
//! read by inner chunk (partial decoding, shard indexes cached); other arrays by whole chunk
//! through a small cache of decoded chunks (a seqax v2 chunk must be decoded whole anyway).
//! Bulk reads ([`Column::fetch`], then [`Column::decode`]) fetch the inner chunks they need as
//! one request list per shard, located through the shard's index, and decode zstd inner chunks
//! directly (one reused zstd context per thread) rather than through zarrs' codec pipeline.
//!
//! The jobs live in submodules: `column` (one array and its chunk or shard access, and the
//! errors naming a damaged file), `bulk` (reading many ranges at once: fetch, then decode),
//! `prefetch` (the in-memory store that serves fetched bytes to zarrs) and `scan`
//! ([`Split::validate`]). This file opens a split and answers for it.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::{data_type, Array};
use zarrs::filesystem::FilesystemStore;
use zarrs::group::Group;
use zarrs::storage::{ReadableStorageTraits, StoreKey};

use super::store::{zarrs_error, Completion, IoBeneath, ZarrFormat};
use crate::error::{Error, Result};

mod bulk;
mod column;
mod prefetch;
mod scan;

use bulk::Fetched;
pub(crate) use bulk::DECODE_PIECE;
use column::{Access, Column};

type Storage = dyn ReadableStorageTraits;

/// Checks that `a` is 1-D uint32 (`tokens`) or uint64.
pub(crate) fn check_dtype<S: ?Sized>(a: &Array<S>, path: &Path, tokens: bool) -> Result<()> {
    let (dt, name) = if tokens {
        (data_type::uint32(), "uint32")
    } else {
        (data_type::uint64(), "uint64")
    };
    if a.shape().len() != 1 || *a.data_type() != dt {
        return Err(Error::format(
            path,
            format!(
                "must be a 1-D {name} array; found shape {:?} of {}",
                a.shape(),
                a.data_type()
                    .name_v3()
                    .map(|n| n.into_owned())
                    .unwrap_or_else(|| format!("{:?}", a.data_type()))
            ),
        ));
    }
    Ok(())
}

/// The split group's `max_token_id`: a non-negative integer.
pub(crate) fn max_token_id_attr<S: ?Sized>(g: &Group<S>, path: &Path) -> Result<u64> {
    match g.attributes().get("max_token_id") {
        None => Err(Error::format(
            path,
            "the split group has no `max_token_id` attribute",
        )),
        Some(v) => v.as_u64().ok_or_else(|| {
            Error::format(
                path,
                format!("`max_token_id` must be a non-negative integer, found {v}"),
            )
        }),
    }
}

/// What an opened split is ([`Split::info`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SplitInfo {
    /// The split's directory.
    pub path: PathBuf,
    /// The dataset's zarr format.
    pub format: ZarrFormat,
    /// What the root's completion marker says (`Complete`: `write_completed: true`, which
    /// seqax data never carries).
    pub completion: Completion,
    /// Tokens in the split.
    pub token_count: u64,
    /// Sequences (documents) in the split.
    pub seq_count: u64,
    /// The `max_token_id` attribute.
    pub max_token_id: u64,
    /// Whether `encoded_tokens` is sharded (read by inner chunk).
    pub sharded: bool,
}

/// An opened split: `encoded_tokens` (uint32) and `seq_starts` (uint64).
pub struct Split {
    path: PathBuf,
    format: ZarrFormat,
    completion: Completion,
    tokens: Column,
    starts: Column,
    max_token_id: u64,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("completion", &self.completion)
            .field("token_count", &self.token_count())
            .field("seq_count", &self.seq_count())
            .field("max_token_id", &self.max_token_id)
            .finish()
    }
}

fn check_split_name(split: &str) -> Result<()> {
    if split != "train" && split != "validation" {
        return Err(Error::Invalid(format!(
            "split must be \"train\" or \"validation\", got {split:?}"
        )));
    }
    Ok(())
}

/// A zarrs failure opening the node at `path` (a group or array of `format`): an I/O error
/// names its metadata file.
fn zerr(path: &Path, format: ZarrFormat, what: &str, e: &impl IoBeneath) -> Error {
    let meta: Vec<PathBuf> = match format {
        ZarrFormat::V3 => vec![path.join("zarr.json")],
        ZarrFormat::V2 => [".zarray", ".zgroup", ".zattrs"]
            .iter()
            .map(|n| path.join(n))
            .filter(|p| p.exists())
            .collect(),
    };
    zarrs_error(e, path, &meta, || what.to_string())
}

impl Split {
    /// Opens `split` of the dataset at `root` for reading.
    ///
    /// A dataset a shardkit writer finished (`write_completed: true`) opens after cheap checks;
    /// one it left unfinished is refused ([`Error::Interrupted`]); one without the marker
    /// (seqax's) opens only if it passes [`Split::validate`] in full, which reads every token —
    /// `shardkit tokens validate --mark` does that once and marks it.
    pub fn open(root: impl AsRef<Path>, split: &str) -> Result<Split> {
        let root = root.as_ref();
        let opened = Self::open_unvalidated(root, split).and_then(|s| {
            s.check_servable()?;
            Ok(s)
        });
        // A split being written in parts is named as such, with the units it still lacks.
        opened.map_err(|e| super::parts::unfinished(root, split).unwrap_or(e))
    }

    /// Opens `split` from any zarrs store (`root` labels paths in messages); the same rules as
    /// [`Split::open`] (the tests' counting store).
    #[cfg(test)]
    pub(crate) fn open_in_store(store: Arc<Storage>, root: &Path, split: &str) -> Result<Split> {
        let s = Self::from_store(store, root, split, crate::io::is_local(root))?;
        s.check_servable()?;
        Ok(s)
    }

    /// Opens without the completion and content checks (structure, names and dtypes are still
    /// checked): for validation and inspection.
    ///
    /// `root` may be an `s3://bucket/prefix` URL: the objects are listed once and every chunk
    /// or inner chunk zarrs reads is a ranged GET, retried like every request of
    /// [`crate::io`].
    pub fn open_unvalidated(root: impl AsRef<Path>, split: &str) -> Result<Split> {
        let root = root.as_ref();
        check_split_name(split)?;
        let root = &match crate::io::Location::parse(root)? {
            crate::io::Location::Local(dir) => dir,
            store => {
                let remote = crate::io::Remote::from_location(&store)?.with_object_cache();
                let url = PathBuf::from(remote.url());
                return Self::from_store(remote.zarr_store()?, &url, split, false);
            }
        };
        if let Some(e) = super::report::not_a_directory(root) {
            return Err(e);
        }
        // zarrs opens chunk files with a blocking open: a FIFO among them would hang a read.
        let dir = root.join(split);
        if dir.is_dir() {
            crate::fsutil::check_regular_tree(&dir)?;
        }
        let store: Arc<Storage> = Arc::new(
            FilesystemStore::new(root)
                .map_err(|e| zarrs_error(&e, root, &[], || "store".into()))?,
        );
        Self::from_store(store, root, split, true)
    }

    /// The split `split` of the dataset at `root` in `store`; `local`: whether `root` is a
    /// local directory (a chunk cut short is then measured and named).
    fn from_store(store: Arc<Storage>, root: &Path, split: &str, local: bool) -> Result<Split> {
        check_split_name(split)?;
        super::delta::register();
        let path = root.join(split);
        let has = |k: &str| {
            StoreKey::new(k)
                .ok()
                .and_then(|k| store.size_key(&k).ok().flatten())
                .is_some()
        };
        let format = if has("zarr.json") {
            ZarrFormat::V3
        } else if has(".zgroup") {
            ZarrFormat::V2
        } else {
            return Err(Error::format(
                root,
                "not a zarr group (no zarr.json or .zgroup); expected a flat-tokens dataset",
            ));
        };
        let completion = Completion::read(store.clone());
        let group = Group::open(store.clone(), &format!("/{split}")).map_err(|e| {
            zerr(
                &path,
                format,
                "the split is missing or not a zarr group",
                &e,
            )
        })?;
        let max_token_id = max_token_id_attr(&group, &path)?;
        let open = |name: &str, tokens: bool| -> Result<Column> {
            let p = path.join(name);
            let a = Array::open(store.clone(), &format!("/{split}/{name}"))
                .map_err(|e| zerr(&p, format, "cannot open the array", &e))?;
            check_dtype(&a, &p, tokens)?;
            Ok(Column::new(a, p, local))
        };
        let tokens = open("encoded_tokens", true)?;
        let starts = open("seq_starts", false)?;
        if starts.len() == 0 {
            return Err(Error::format(
                &starts.path,
                "is empty; it must hold at least the initial 0",
            ));
        }
        Ok(Split {
            path,
            format,
            completion,
            tokens,
            starts,
            max_token_id,
        })
    }

    fn check_servable(&self) -> Result<()> {
        match self.completion {
            Completion::Interrupted => Err(Error::Interrupted {
                path: self.path.clone(),
                detail: format!(
                    "the dataset's write_completed is false: a shardkit write did not finish \
                     (this split has {} sequences committed); resume it to complete the dataset",
                    self.seq_count()
                ),
            }),
            Completion::Complete => {
                // Through `fetch`, which keeps the shard indexes it reads: a loader's reads of
                // seq_starts from a store then do not fetch them again.
                let n = self.starts.len();
                let got: Vec<Vec<u64>> =
                    self.starts
                        .read_many(&[0..1, n - 1..n], "seq_starts entry", None)?;
                let (first, last) = (got[0][0], got[1][0]);
                if first != 0 || last != self.token_count() {
                    return Err(Error::format(
                        &self.path,
                        format!(
                            "seq_starts runs from {first} to {last}; it must run from 0 to \
                             token_count {}",
                            self.token_count()
                        ),
                    ));
                }
                Ok(())
            }
            Completion::Unmarked => {
                let problems = self.validate();
                if problems.is_empty() {
                    Ok(())
                } else {
                    Err(Error::format(
                        &self.path,
                        format!(
                            "not served: the dataset has no completion marker and fails \
                             validation: {}",
                            problems.join("; ")
                        ),
                    ))
                }
            }
        }
    }

    /// What the split is: where, its format and completion, its counts.
    pub fn info(&self) -> SplitInfo {
        SplitInfo {
            path: self.path.clone(),
            format: self.format,
            completion: self.completion,
            token_count: self.token_count(),
            seq_count: self.seq_count(),
            max_token_id: self.max_token_id,
            sharded: matches!(self.tokens.access, Access::Sharded(_)),
        }
    }
    /// The split's directory.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
    /// The files (chunks or shards, below the dataset root) that hold tokens `range`.
    pub(crate) fn token_files(&self, range: Range<u64>) -> Vec<PathBuf> {
        self.tokens
            .files_of(crate::fsutil::parent_of(&self.path), range)
    }
    /// The files that hold `seq_starts` entries `range`.
    pub(crate) fn start_files(&self, range: Range<u64>) -> Vec<PathBuf> {
        self.starts
            .files_of(crate::fsutil::parent_of(&self.path), range)
    }
    /// The dataset's zarr format.
    pub(crate) fn format(&self) -> ZarrFormat {
        self.format
    }
    /// Tokens in the split.
    pub(crate) fn token_count(&self) -> u64 {
        self.tokens.len()
    }
    /// Sequences (documents) in the split.
    pub(crate) fn seq_count(&self) -> u64 {
        self.starts.len() - 1
    }
    /// The `max_token_id` attribute.
    pub(crate) fn max_token_id(&self) -> u64 {
        self.max_token_id
    }

    /// Entries `range` of `seq_starts` (`seq_count + 1` entries in all).
    pub fn seq_starts(&self, range: Range<u64>) -> Result<Vec<u64>> {
        self.starts.read(range, "seq_starts entry")
    }

    /// The token range of document `i`.
    pub(crate) fn document(&self, i: u64) -> Result<Range<u64>> {
        if i >= self.seq_count() {
            return Err(Error::OutOfRange {
                what: "sequence",
                index: i.min(i64::MAX as u64) as i64,
                len: self.seq_count(),
            });
        }
        let s = self.seq_starts(i..i + 2)?;
        if s[1] < s[0] || s[1] > self.token_count() {
            return Err(Error::format(
                &self.starts.path,
                format!(
                    "sequence {i} starts at token {} and ends before token {}, outside the {} \
                     tokens of the split (seq_starts must be non-decreasing and end at \
                     token_count)",
                    s[0],
                    s[1],
                    self.token_count()
                ),
            ));
        }
        Ok(s[0]..s[1])
    }

    /// Encoded tokens `range`.
    pub fn encoded(&self, range: Range<u64>) -> Result<Vec<u32>> {
        self.tokens.read(range, "token")
    }

    /// The stored bytes of encoded tokens `ranges`, fetched together (few large requests to
    /// an object store instead of one per inner chunk), for [`Split::decode_encoded`].
    pub(crate) fn fetch_encoded(
        &self,
        ranges: &[Range<u64>],
        stop: Option<&Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Fetched> {
        self.tokens.fetch(ranges, "token", stop)
    }

    /// The encoded tokens of each range [`Split::fetch_encoded`] fetched, decoded on `pool`.
    pub(crate) fn decode_encoded(
        &self,
        f: &Fetched,
        pool: &rayon::ThreadPool,
    ) -> Result<Vec<Vec<u32>>> {
        self.tokens.decode(f, "token", Some(pool))
    }

    /// Entries of `seq_starts` in each of `ranges`, fetched together like
    /// [`Split::encoded_many`].
    pub(crate) fn seq_starts_many(
        &self,
        ranges: &[Range<u64>],
        pool: &rayon::ThreadPool,
    ) -> Result<Vec<Vec<u64>>> {
        self.starts
            .read_many(ranges, "seq_starts entry", Some(pool))
    }

    /// The token ids of document `i` (decoded: `enc >> 1`).
    pub fn ids(&self, i: u64) -> Result<Vec<u32>> {
        let mut v = self.encoded(self.document(i)?)?;
        for x in &mut v {
            *x >>= 1;
        }
        Ok(v)
    }
}

/// Refuses a read of `range` (half-open) from an array of `len` `what`s: a range whose start is
/// after its end is the caller's mistake ([`Error::Invalid`]); one reaching past the end is
/// [`Error::OutOfRange`] naming the first index past the end.
fn check_range(range: &Range<u64>, len: u64, what: &'static str) -> Result<()> {
    if range.start > range.end {
        return Err(Error::Invalid(format!(
            "{what} range from {} up to {}: the start is after the end",
            range.start, range.end
        )));
    }
    if range.end > len {
        return Err(Error::OutOfRange {
            what,
            index: range.start.max(len).min(i64::MAX as u64) as i64,
            len,
        });
    }
    Ok(())
}
