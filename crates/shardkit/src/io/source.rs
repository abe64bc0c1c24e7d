//! One read trait over every place bytes live: [`Source`], opened from a [`Location`] by
//! [`open`]. A format holds an `Arc<dyn Source>`, reads through it, and asks it capability
//! questions ([`Source::local_path`]) instead of whether a path is remote.
//!
//! Implementations: [`LocalDir`] (a local directory's files), [`Remote`] (a prefix in any
//! `object_store` store: S3, or in tests an in-memory or local-filesystem one), read through
//! the bounded local cache when `SHARDKIT_CACHE_DIR` is set.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ObjectStore;

use super::buffer::Buffer;
use super::local::{read_all, Files, ReadRange};
use super::location::Location;
use super::runtime::{runtime, PendingRead};
use super::stop::Stop;
use super::{Cached, HeldPages, Remote};
use crate::error::{Error, IoContext, Result};

/// A place a dataset's bytes are read from: a set of named objects (files of a directory,
/// objects under a prefix), each read whole or by ranges into the caller's buffer.
pub trait Source: Send + Sync + std::fmt::Debug {
    /// Where it is.
    fn location(&self) -> Location;

    /// The local directory, when the bytes are local files (they can then be mapped, read
    /// ahead, read with O_DIRECT, and checked as the page cache is read).
    fn local_path(&self) -> Option<&Path> {
        None
    }

    /// Whether the bytes are local files ([`Source::local_path`]).
    fn is_local(&self) -> bool {
        self.local_path().is_some()
    }

    /// Object `name` as a path, for messages (`DIR/name` or `s3://bucket/prefix/name`).
    fn path_of(&self, name: &str) -> PathBuf;

    /// Every object: (name relative to the source, size), sorted by name.
    fn list(&self) -> Result<Vec<(String, u64)>>;

    /// The size of object `name`.
    fn len(&self, name: &str) -> Result<u64>;

    /// The whole of object `name`, or `None` when it does not exist.
    fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>>;

    /// The whole of object `name`.
    fn get(&self, name: &str) -> Result<Vec<u8>> {
        self.get_opt(name)?.ok_or_else(|| Error::NotFound {
            path: self.path_of(name),
            what: "no such object".into(),
        })
    }

    /// Reads `ranges` of the objects `names[r.file]` into `buf` at `r.dst` (destinations inside
    /// `buf` and disjoint: checked before anything is read). Gives up with the stopped error
    /// once `stop` is set.
    fn read_into(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()>;

    /// [`Source::read_into`] of `(object, offset, len, dst)` ranges, giving up once `stop` is
    /// set.
    fn read_ranges(
        &self,
        names: &[String],
        ranges: &[(u32, u64, u64, u64)],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()> {
        let ranges = ReadRange::from_tuples(ranges);
        self.read_into(names, &ranges, buf, stop)
    }

    /// [`Source::read_into`] started and left running: the caller gets `buf` back, filled, from
    /// [`PendingRead::wait`] (a loader starts the next batch's reads while the previous ones are
    /// in flight). A source without asynchronous reads reads before returning.
    fn start_read(
        &self,
        names: Arc<Vec<String>>,
        ranges: Vec<ReadRange>,
        buf: Buffer,
        stop: &Stop,
    ) -> Result<PendingRead>;

    /// With a local cache in front of the source and every page `ranges` touch held in it,
    /// those pages mapped (the read is then a copy out of them); `None` otherwise.
    #[doc(hidden)]
    fn held_pages(&self, _names: &[String], _ranges: &[ReadRange]) -> Result<Option<HeldPages>> {
        Ok(None)
    }
}

/// Opens the source at `location`: a local directory, or an object-store prefix read through
/// the bounded local cache when `SHARDKIT_CACHE_DIR` is set.
pub fn open(location: &Location) -> Result<Arc<dyn Source>> {
    Ok(match location {
        Location::Local(dir) => Arc::new(LocalDir::new(dir.clone())),
        Location::S3 { .. } => Remote::parse(&location.to_path())?.with_object_cache(),
    })
}

/// Opens the source at `location` reading the store itself, never through the local cache
/// (validation, checksum verification and transfers check what the store holds).
pub fn open_uncached(location: &Location) -> Result<Arc<dyn Source>> {
    Ok(match location {
        Location::Local(dir) => Arc::new(LocalDir::new(dir.clone())),
        Location::S3 { .. } => Arc::new(Remote::parse(&location.to_path())?),
    })
}

/// `url` (`s3://bucket/prefix`) read through `store`, any object store (S3, or an in-memory or
/// local-filesystem one in tests), with the same requests, retries of short responses, and
/// errors as S3; through a bounded local cache in `cache_dir` when one is given.
pub fn open_store(
    url: impl AsRef<Path>,
    store: Arc<dyn ObjectStore>,
    cache_dir: Option<PathBuf>,
) -> Result<Arc<dyn Source>> {
    let remote = Remote::with_store(url.as_ref(), store)?;
    Ok(match cache_dir {
        Some(dir) => Arc::new(Cached::new(remote, dir)),
        None => Arc::new(remote),
    })
}

/// A local directory's files.
#[derive(Debug, Clone)]
pub(crate) struct LocalDir {
    root: PathBuf,
}

impl LocalDir {
    /// The files of `root`.
    pub(crate) fn new(root: PathBuf) -> LocalDir {
        LocalDir { root }
    }
}

/// Files opened for one read.
struct Opened(Vec<(File, PathBuf)>);

impl Files for Opened {
    fn file(&self, i: u32) -> Result<&File> {
        Ok(&self.0[i as usize].0)
    }
    fn path(&self, i: u32) -> PathBuf {
        self.0[i as usize].1.clone()
    }
}

impl LocalDir {
    fn open_files(&self, names: &[String], ranges: &[ReadRange]) -> Result<Opened> {
        if let Some(r) = ranges.iter().find(|r| r.file as usize >= names.len()) {
            return Err(Error::Internal(format!(
                "internal: read of file {} of {}",
                r.file,
                names.len()
            )));
        }
        let files = names
            .iter()
            .map(|n| {
                let path = self.root.join(n);
                Ok((File::open(&path).at(&path)?, path))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Opened(files))
    }
}

impl Source for LocalDir {
    fn location(&self) -> Location {
        Location::Local(self.root.clone())
    }

    fn local_path(&self) -> Option<&Path> {
        Some(&self.root)
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn list(&self) -> Result<Vec<(String, u64)>> {
        let mut out = super::local::walk(&self.root, false)?;
        out.sort();
        Ok(out)
    }

    fn len(&self, name: &str) -> Result<u64> {
        let path = self.root.join(name);
        Ok(std::fs::metadata(&path).at(&path)?.len())
    }

    fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let path = self.root.join(name);
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).at(&path),
        }
    }

    fn read_into(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()> {
        stop.check()?;
        let files = self.open_files(names, ranges)?;
        let threads = crate::config::available_cores();
        read_all(&files, ranges, buf, threads, false)
    }

    fn start_read(
        &self,
        names: Arc<Vec<String>>,
        ranges: Vec<ReadRange>,
        mut buf: Buffer,
        stop: &Stop,
    ) -> Result<PendingRead> {
        self.read_into(&names, &ranges, buf.as_mut_bytes(), stop)?;
        PendingRead::ready(buf)
    }
}

impl Source for Remote {
    fn location(&self) -> Location {
        Location::S3 {
            bucket: self.bucket.clone(),
            prefix: self.prefix.clone(),
        }
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.url_of(name)
    }

    fn list(&self) -> Result<Vec<(String, u64)>> {
        Remote::list(self)
    }

    fn len(&self, name: &str) -> Result<u64> {
        Remote::len(self, name)
    }

    fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>> {
        Remote::get_opt(self, name)
    }

    fn read_into(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()> {
        self.read_into_until(names, ranges, buf, stop)
    }

    fn start_read(
        &self,
        names: Arc<Vec<String>>,
        ranges: Vec<ReadRange>,
        buf: Buffer,
        stop: &Stop,
    ) -> Result<PendingRead> {
        Remote::start_read(self, names, ranges, buf, stop.flag())
    }
}

impl PendingRead {
    /// A read already done: `wait` hands `buf` back.
    pub(crate) fn ready(buf: Buffer) -> Result<PendingRead> {
        let task = runtime()?.spawn(async move { Ok(buf) });
        Ok(PendingRead(std::sync::Mutex::new(Some(task))))
    }
}
