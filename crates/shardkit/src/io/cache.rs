//! The opt-in local cache of a store's objects: `$SHARDKIT_CACHE_DIR`, at most
//! `$SHARDKIT_CACHE_GIB` GiB (default 32).
//!
//! ```text
//! CACHE/bucket/key                            an SDNB/SDZ container, copied whole
//! CACHE/bucket/key.etag                       (hidden: .key.etag) the ETag it was copied at
//! CACHE/bucket/key.pages/<version>/<index>    page <index> of a data object, as read
//! ```
//!
//! Data objects (saev and EAGLE-3 shards, zarr chunks) are cached by page
//! (`$SHARDKIT_CACHE_PAGE_MIB`, default 4 MiB), never whole. A read is served from the pages it
//! touches: held ones are read on every core by the engine's reader; the others are fetched
//! whole (coalesced ranged GETs, as without a cache), copied into the read, and written into
//! the cache after the read returns (at most [`KEEPING_MIB`] waiting; [`wait_for_cache`] waits
//! for them and reports a failure). So one row of a 1 GB shard costs one page, not the shard,
//! and a cache smaller than the data holds the pages read most recently. `<version>` hashes
//! the object's ETag and size and the page size, learned by one HEAD per object per process,
//! so pages of a replaced object never mix with its predecessor's; an object without an ETag
//! is not cached.
//!
//! The directory is marked by a `CACHEDIR.TAG` that names shardkit ([`claim`]): shardkit makes
//! a cache only in a new or empty directory and evicts only inside one it marked, so a
//! `SHARDKIT_CACHE_DIR` pointed by mistake at a home or a dataset disk is refused, not emptied.
//!
//! Every file is written aside, synced and renamed, so it is whole or absent, and a page is
//! used only at its expected length. Files are evicted least recently used first (a read
//! touches what it uses). Each process sums the cache when it starts adding to it and again
//! whenever its own count passes the limit, then evicts down to the limit less an eighth of it
//! (at most 1 GiB), counting what it is writing. Processes sharing a cache do not see each
//! other's writes in progress, so each may overrun it by that eighth plus the pages it is
//! writing (one per core).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::StreamExt;

use object_store::{ObjectStore, ObjectStoreExt};

use super::local::{read_all, Files, ReadRange};
use super::runtime::block_on;
use super::Remote;
use crate::config::{inflight, max_request};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// The cache directory, `$SHARDKIT_CACHE_DIR`, when it is set: the saev, flat-tokens and
/// EAGLE-3 readers then keep the pages of the objects they read in it, and SDNB/SDZ containers
/// read from a store are copied whole into it and opened from there. At most
/// `$SHARDKIT_CACHE_GIB` GiB (default 32), the least recently used files evicted to make room.
pub fn cache_dir() -> Option<PathBuf> {
    crate::config::cache_dir()
}

/// The cache directory a command names, `dir`, else [`cache_dir`]; an error when neither is
/// given (`shardkit cache`, `shardkit.cache_info`).
pub fn cache_dir_or(dir: Option<PathBuf>) -> Result<PathBuf> {
    dir.or_else(cache_dir).ok_or_else(|| {
        Error::Invalid("no cache directory given, and SHARDKIT_CACHE_DIR is not set".into())
    })
}

use crate::config::{cache_limit, cache_page_size as page_size};

/// The file marking a shardkit cache, after the Cache Directory Tagging Specification (so
/// backup tools skip the cache too): its signature line, then a line naming shardkit (other
/// tools' caches carry the same signature, and are not ours to evict from).
const TAG: &str = "CACHEDIR.TAG";
const TAG_TEXT: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
# This directory is a shardkit cache (SHARDKIT_CACHE_DIR): its files are evicted\n\
# least recently used first. `shardkit cache clear` empties it.\n";

/// Cache directories this process has found marked ([`claim`]).
static CLAIMED: Mutex<(u32, Vec<PathBuf>)> = Mutex::new((0, Vec::new()));

/// Checks that `root` is a shardkit cache, marking it first when it is new or empty; a
/// directory that holds anything else is refused, naming it. Checked once per process.
pub(crate) fn claim(root: &Path) -> Result<()> {
    let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
    let claimed = for_this_process(&mut claimed);
    if claimed.iter().any(|c| c == root) {
        return Ok(());
    }
    let tag = root.join(TAG);
    if !is_ours(&tag)? {
        std::fs::create_dir_all(root).at(root)?;
        // Temporaries: another process marking it at this moment.
        let other = std::fs::read_dir(root)
            .at(root)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| !fsutil::is_temp_name(n));
        match other {
            // Ranks of a node starting together may all mark it: each writes its own
            // temporary, and every rename leaves the same tag.
            None => write_aside(&tag, |f, tmp| {
                use std::io::Write;
                f.write_all(TAG_TEXT.as_bytes()).at(tmp)
            })?,
            // Unless another process marked it since the check above (and may have written
            // pages since).
            Some(other) if !is_ours(&tag)? => return Err(not_a_cache(root, &other)),
            Some(_) => {}
        }
    }
    claimed.push(root.to_path_buf());
    Ok(())
}

/// Whether `tag` is a shardkit cache's tag (false when absent).
fn is_ours(tag: &Path) -> Result<bool> {
    match std::fs::read(tag) {
        Ok(b) => {
            let text = String::from_utf8_lossy(&b);
            let signature = TAG_TEXT.lines().next().unwrap_or_default();
            Ok(text.starts_with(signature) && text.contains("shardkit cache"))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).at(tag),
    }
}

fn not_a_cache(root: &Path, found: &str) -> Error {
    Error::Invalid(format!(
        "SHARDKIT_CACHE_DIR={}: not a shardkit cache (it holds {found:?} and no {TAG} written \
         by shardkit). The cache evicts its files least recently used first, so it is made \
         only in a new or empty directory: point SHARDKIT_CACHE_DIR at one (a cache made by \
         shardkit before the tag existed can be removed and made again)",
        root.display()
    ))
}

/// One object's share of a cache ([`cache_usage`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CachedObject {
    /// `s3://bucket/key`.
    pub url: String,
    /// Bytes held: its pages, or its whole copy.
    pub bytes: u64,
    /// Pages held (0 for an object copied whole: an SDNB/SDZ container).
    pub pages: u64,
    /// When a read last used any of it.
    pub last_used: std::time::SystemTime,
}

/// What a cache directory holds, by object, the largest first.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheUsage {
    /// Bytes of every file held (pages, copies; not stamps, temporaries or the mark).
    pub bytes: u64,
    /// The size readers in this process keep it under (`SHARDKIT_CACHE_GIB`, default 32 GiB).
    pub limit: u64,
    /// The objects held.
    pub objects: Vec<CachedObject>,
}

/// A cached file: the object it belongs to (`bucket/key`), its length, when it was last used,
/// and whether it is a page. Stamps (`.key.etag`) belong to their object with no length;
/// temporaries belong to none.
struct CachedFile {
    object: Option<String>,
    path: PathBuf,
    len: u64,
    used: std::time::SystemTime,
    page: bool,
}

/// Every file below the cache at `root` but its mark, with the object each belongs to (the
/// layout in the module doc); the cache must carry shardkit's mark.
fn cached_files(root: &Path) -> Result<Vec<CachedFile>> {
    if !root.is_dir() {
        return Err(Error::NotFound {
            path: root.to_path_buf(),
            what: "no such cache directory".into(),
        });
    }
    if !is_ours(&root.join(TAG))? {
        return Err(Error::Invalid(format!(
            "{}: not a shardkit cache (no {TAG} written by shardkit): only a directory shardkit \
             made its cache is looked into or cleared",
            root.display()
        )));
    }
    let mut out = Vec::new();
    for (path, name, m) in files_below(root) {
        let Ok(rel) = path.strip_prefix(root) else {
            continue;
        };
        let rel = rel.to_string_lossy().into_owned();
        // A temporary is another process's write in progress (or a killed one's, which
        // eviction removes): it belongs to no object, and is never removed here.
        let (object, page) = if fsutil::is_temp_name(&name) {
            (None, false)
        } else if let Some((key, _)) = rel.split_once(".pages/") {
            (Some(key.to_string()), !name.starts_with('.'))
        } else if let Some(stamped) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".etag")) {
            let stamped = match rel.rsplit_once('/') {
                Some((dir, _)) => format!("{dir}/{stamped}"),
                None => stamped.to_string(),
            };
            (Some(stamped), false)
        } else {
            (Some(rel), false)
        };
        out.push(CachedFile {
            object,
            path,
            len: if name.starts_with('.') { 0 } else { m.len() },
            used: m.modified().unwrap_or(std::time::UNIX_EPOCH),
            page,
        });
    }
    Ok(out)
}

/// Every file below the cache at `root` but its mark, with its name and metadata; what cannot
/// be read (removed meanwhile by another process) is passed over.
fn files_below(root: &Path) -> Vec<(PathBuf, String, std::fs::Metadata)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            let name = e.file_name().to_string_lossy().into_owned();
            if m.is_dir() {
                stack.push(e.path());
            } else if !(d == root && name == TAG) {
                out.push((e.path(), name, m));
            }
        }
    }
    out
}

/// What the cache at `root` holds (`shardkit cache info`). Refused, naming it, unless it is a
/// shardkit cache.
pub fn cache_usage(root: &Path) -> Result<CacheUsage> {
    let mut by_object: BTreeMap<String, CachedObject> = BTreeMap::new();
    let mut bytes = 0;
    for f in cached_files(root)? {
        bytes += f.len;
        let Some(object) = f.object else { continue };
        let o = by_object.entry(object.clone()).or_insert(CachedObject {
            url: format!("s3://{object}"),
            bytes: 0,
            pages: 0,
            last_used: std::time::UNIX_EPOCH,
        });
        o.bytes += f.len;
        o.pages += f.page as u64;
        if f.len > 0 {
            o.last_used = o.last_used.max(f.used);
        }
    }
    let mut objects: Vec<CachedObject> = by_object.into_values().filter(|o| o.bytes > 0).collect();
    objects.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.url.cmp(&b.url)));
    Ok(CacheUsage {
        bytes,
        limit: cache_limit(),
        objects,
    })
}

/// Removes from the cache at `root` every object (its pages, whole copy and stamp) whose URL is
/// `prefix` or lies below it (`s3://bucket/prefix`), or everything with `None`; returns the
/// files and bytes removed (`shardkit cache clear`). Refused, naming it, unless it is a
/// shardkit cache; the mark stays, and so do directories (a process reading through the cache
/// at the same time may be writing into them; it fetches again what was removed).
pub fn clear_cache(root: &Path, prefix: Option<&str>) -> Result<(u64, u64)> {
    let prefix = match prefix {
        Some(p) => {
            let p = p
                .strip_prefix("s3://")
                .ok_or_else(|| Error::Invalid(format!("{p}: not an s3://bucket/prefix URL")))?;
            Some(p.trim_end_matches('/').to_string())
        }
        None => None,
    };
    let (mut files, mut bytes) = (0, 0);
    for f in cached_files(root)? {
        let chosen = match (&prefix, &f.object) {
            // A write in progress: it finishes, and eviction removes a killed one's.
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(p), Some(o)) => {
                o == p
                    || o.strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            }
        };
        if !chosen {
            continue;
        }
        match std::fs::remove_file(&f.path) {
            Ok(()) => {
                files += 1;
                bytes += f.len;
            }
            // Evicted meanwhile by a process using the cache.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).at(&f.path),
        }
    }
    Ok((files, bytes))
}

/// Bytes fetched per step when a container is copied whole.
const COPY_STEP: u64 = 256 << 20;

/// A temporary this old was left by a killed process: eviction removes it.
const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(3600);

/// Most bytes of pages one read fetches at a time: its memory beyond the caller's buffer.
const PAGE_GROUP: u64 = 256 << 20;

/// The pieces of a read that the cache did not serve at once ([`Remote::read_cached`]).
pub(crate) struct Paged {
    /// Ranges of objects that are not cached: read from the store as without a cache.
    pub direct: Vec<ReadRange>,
    /// Pages to fetch, keep, and copy into the read.
    pub missing: Vec<MissingPage>,
    /// The cache the missing pages are kept in.
    pub cache: Option<PathBuf>,
}

impl Paged {
    /// Everything read from the store (no cache).
    pub(crate) fn direct(ranges: Vec<ReadRange>) -> Paged {
        Paged {
            direct: ranges,
            missing: Vec::new(),
            cache: None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.direct.is_empty() && self.missing.is_empty()
    }
}

/// Part of a read inside one page: (offset in the page, length, offset in the read's buffer).
type Piece = (u64, u64, u64);

/// A page the cache lacks, and the pieces of the read it serves.
pub(crate) struct MissingPage {
    file: u32,
    offset: u64,
    len: u64,
    /// Where the page is kept.
    path: PathBuf,
    pieces: Vec<Piece>,
}

/// Where a data object's pages are kept: its version's directory, its size and the page size.
#[derive(Clone)]
struct ObjectPages {
    dir: PathBuf,
    size: u64,
    page: u64,
}

impl ObjectPages {
    /// The pieces of `r` (a range of this object), page by page, in order: (page index,
    /// offset in the page, length, where the piece goes in the read's buffer).
    fn pieces_of(&self, r: &ReadRange) -> impl Iterator<Item = (u64, u64, u64, u64)> {
        let (page, end, offset, dst) = (self.page, r.offset + r.len, r.offset, r.dst);
        let mut at = offset;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let index = at / page;
                let start = index * page;
                let take = (start + page).min(end) - at;
                let piece = (index, at - start, take, dst + (at - offset));
                at += take;
                piece
            })
        })
    }

    /// Page `index`'s file and length (the object's last page may be short).
    fn page_file(&self, index: u64) -> (PathBuf, u64) {
        let len = self.page.min(self.size - index * self.page);
        (self.dir.join(index.to_string()), len)
    }
}

/// Per object URL and cache directory, where its pages are kept, or `None` when it is not
/// cached (no ETag to check pages against, or a cache smaller than a page); per process: a
/// forked child asks again.
static KNOWN: Mutex<(u32, BTreeMap<String, Option<ObjectPages>>)> =
    Mutex::new((0, BTreeMap::new()));

/// What this process counts in a cache directory ([`reserve`]).
#[derive(Default)]
struct Held {
    /// The sum at its last sweep, plus what it has added since; `None` before its first sweep.
    swept: Option<u64>,
    /// Bytes it is writing now (not yet in a sweep's sum of the files).
    writing: u64,
}

/// Per cache directory, what this process counts in it.
static HELD: Mutex<(u32, BTreeMap<PathBuf, Held>)> = Mutex::new((0, BTreeMap::new()));

/// The most MiB of fetched pages waiting to be written into the cache: a read that would pass
/// it waits for the writes (so a disk slower than the network slows reads, not memory).
const KEEPING_MIB: u32 = 512;

/// This process's limit on pages waiting to be written ([`KEEPING_MIB`]), once a read has
/// fetched pages.
static KEEPING: Mutex<(u32, Option<Arc<tokio::sync::Semaphore>>)> = Mutex::new((0, None));

/// [`KEEPING`], made now if need be.
fn keeping() -> Arc<tokio::sync::Semaphore> {
    let mut k = KEEPING.lock().unwrap_or_else(|e| e.into_inner());
    for_this_process(&mut k)
        .get_or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(KEEPING_MIB as usize)))
        .clone()
}

// A read's pages fit the limit on pages waiting to be written, or it would wait forever.
const _: () = assert!(PAGE_GROUP >> 20 <= KEEPING_MIB as u64);

/// Waits until the pages that earlier reads fetched are written into the cache (reads return
/// before that), then reports the first failure to write them since the last report. A process
/// that wants its pages kept calls it before it exits: shardkit's CLI does, and the Python
/// package at interpreter exit.
pub fn wait_for_cache() -> Result<()> {
    // A process that never fetched a page through the cache has nothing to wait for (and
    // starts no runtime to find that out).
    let started = {
        let mut k = KEEPING.lock().unwrap_or_else(|e| e.into_inner());
        for_this_process(&mut k).clone()
    };
    if let Some(keeping) = started {
        let all = block_on(keeping.acquire_many(KEEPING_MIB))?
            .map_err(|e| Error::Internal(format!("internal: waiting for cache pages: {e}")))?;
        drop(all);
    }
    Remote::keep_failure()
}

/// The first failure to write pages into the cache in the background, not yet reported.
static KEEP_FAILED: Mutex<(u32, Option<Error>)> = Mutex::new((0, None));

/// This process's entry of a process-wide table, reset in a forked child.
fn for_this_process<T: Default>(table: &mut (u32, T)) -> &mut T {
    let pid = std::process::id();
    if table.0 != pid {
        // Forget, not drop: the parent's values may be held by threads the child lacks.
        std::mem::forget(std::mem::replace(table, (pid, T::default())));
    }
    &mut table.1
}

/// Pages of the cache mapped into memory, covering the ranges of one read laid end to end as
/// in its buffer (each range at its `dst`): a warm read's rows are then copied once, straight
/// out of the pages (as a local file's rows are out of its map), instead of read into a
/// buffer first and copied again from there. A page evicted meanwhile stays mapped (pages are
/// written aside and renamed, never changed in place).
pub struct HeldPages {
    /// (start in the read's buffer, map, offset in the map, length), by start.
    pieces: Vec<(u64, Arc<memmap2::Mmap>, usize, usize)>,
}

impl HeldPages {
    /// Copies the bytes at `at..at + dst.len()` of the read's buffer into `dst` with `copy`,
    /// piece by piece where they span pages; `None` when they lie outside the read.
    pub(crate) fn copy_into(
        &self,
        at: u64,
        dst: &mut [u8],
        copy: impl Fn(&mut [u8], &[u8]),
    ) -> Option<()> {
        let mut i = self.pieces.partition_point(|p| p.0 + p.3 as u64 <= at);
        let (mut at, mut done) = (at, 0);
        while done < dst.len() {
            let (start, map, offset, len) = self.pieces.get(i)?;
            let begin = usize::try_from(at.checked_sub(*start)?).ok()?;
            let take = len.checked_sub(begin)?.min(dst.len() - done);
            copy(
                &mut dst[done..done + take],
                map.get(offset + begin..offset + begin + take)?,
            );
            (at, done, i) = (at + take as u64, done + take, i + 1);
        }
        Some(())
    }

    /// The first bytes at `at` (to prefetch).
    pub(crate) fn first(&self, at: u64) -> Option<&[u8]> {
        let (start, map, offset, len) = self
            .pieces
            .get(self.pieces.partition_point(|p| p.0 + p.3 as u64 <= at))?;
        let begin = usize::try_from(at.checked_sub(*start)?).ok()?;
        map.get(offset + begin..offset + len)
    }
}

impl Remote {
    /// Serves what it can of `ranges` from the pages held in `cache` (copying into `buf`), and
    /// returns the rest: ranges of objects not cached, and the pages to fetch.
    pub(super) fn read_cached(
        &self,
        cache: &Path,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
    ) -> Result<Paged> {
        claim(cache)?;
        // A page the cache failed to keep in the background (its disk full, say) fails the
        // next read, so the failure is seen; the read it came from was served whole.
        Remote::keep_failure()?;
        let objects = self.objects_in(cache, names, ranges)?;
        // The pieces of the read per page, so that each page is opened once (and closed
        // before the next: a read may touch more pages than a process may hold open).
        let mut by_page: BTreeMap<(u32, u64), (&ObjectPages, Vec<Piece>)> = BTreeMap::new();
        let mut out = Paged::direct(Vec::new());
        out.cache = Some(cache.to_path_buf());
        for r in ranges {
            let Some(Some(o)) = objects.get(&r.file) else {
                out.direct.push(*r);
                continue;
            };
            if r.offset + r.len > o.size {
                // The store answers, and errs as it should.
                out.direct.push(*r);
                continue;
            }
            for (index, offset, len, dst) in o.pieces_of(r) {
                let (_, pieces) = by_page
                    .entry((r.file, index))
                    .or_insert_with(|| (o, Vec::new()));
                pieces.push((offset, len, dst));
            }
        }
        // Held pages are read by the engine's reader, on every core, a bounded number open
        // at a time (a read may touch more pages than a process may hold open).
        let mut held = PageFiles(Vec::new());
        let mut reads = Vec::new();
        for ((file, index), (o, pieces)) in by_page {
            let (path, len) = o.page_file(index);
            let Some(f) = open_page(&path, len) else {
                out.missing.push(MissingPage {
                    file,
                    offset: index * o.page,
                    len,
                    path,
                    pieces,
                });
                continue;
            };
            let i = held.0.len() as u32;
            held.0.push((f, path));
            reads.extend(pieces.iter().map(|&(offset, len, dst)| ReadRange {
                file: i,
                offset,
                len,
                dst,
            }));
            if held.0.len() == OPEN_PAGES {
                held.read(&mut reads, buf)?;
            }
        }
        held.read(&mut reads, buf)?;
        Ok(out)
    }

    /// With the object cache on and every page `ranges` touch held in it, those pages mapped
    /// ([`HeldPages`]); `None` when any is missing (the read then goes through
    /// [`Remote::start_read`], which fetches what is missing).
    pub(crate) fn held_pages(
        &self,
        cache: &Path,
        names: &[String],
        ranges: &[ReadRange],
    ) -> Result<Option<HeldPages>> {
        claim(cache)?;
        Remote::keep_failure()?;
        let objects = self.objects_in(cache, names, ranges)?;
        let mut maps: HashMap<(u32, u64), Arc<memmap2::Mmap>> = HashMap::new();
        let mut pieces = Vec::new();
        for r in ranges {
            let Some(Some(o)) = objects.get(&r.file) else {
                return Ok(None);
            };
            if r.offset + r.len > o.size {
                return Ok(None);
            }
            for (index, offset, len, dst) in o.pieces_of(r) {
                let map = match maps.get(&(r.file, index)) {
                    Some(m) => m.clone(),
                    None => {
                        let (path, page_len) = o.page_file(index);
                        let Some(f) = open_page(&path, page_len) else {
                            return Ok(None);
                        };
                        // SAFETY: a page file is written aside and renamed into place, never
                        // modified after (see `write_aside`); removal leaves the map valid.
                        let m = Arc::new(unsafe { memmap2::Mmap::map(&f) }.at(&path)?);
                        maps.insert((r.file, index), m.clone());
                        m
                    }
                };
                pieces.push((dst, map, offset as usize, len as usize));
            }
        }
        pieces.sort_by_key(|p| p.0);
        let bytes = pieces.iter().map(|p| p.3 as u64).sum::<u64>();
        super::CACHE_MAPPED_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(HeldPages { pieces }))
    }

    /// The first failure to keep pages since the last call, if any (reported once).
    fn keep_failure() -> Result<()> {
        let mut failed = KEEP_FAILED.lock().unwrap_or_else(|e| e.into_inner());
        match for_this_process(&mut failed).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Where the pages of each object `ranges` read are kept (`None`: not cached). Objects
    /// this process has not seen yet are asked about with one HEAD each, all in flight at once.
    fn objects_in(
        &self,
        cache: &Path,
        names: &[String],
        ranges: &[ReadRange],
    ) -> Result<HashMap<u32, Option<ObjectPages>>> {
        let key = |file: u32| {
            let url = self.url_of(&names[file as usize]);
            format!("{}\n{}", url.display(), cache.display())
        };
        let mut files: Vec<u32> = ranges.iter().map(|r| r.file).collect();
        files.sort_unstable();
        files.dedup();
        let mut out = HashMap::new();
        let mut unknown = Vec::new();
        {
            let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
            let known = for_this_process(&mut known);
            for file in files {
                match known.get(&key(file)) {
                    Some(o) => drop(out.insert(file, o.clone())),
                    None => unknown.push(file),
                }
            }
        }
        if unknown.is_empty() {
            return Ok(out);
        }
        let store = self.store()?;
        let heads = block_on(
            futures::stream::iter(unknown.iter().map(|&file| {
                let (store, name) = (&store, &names[file as usize]);
                async move {
                    let meta = store.head(&self.key(name)).await;
                    (file, meta.map_err(|e| self.error(name, None, e)))
                }
            }))
            .buffer_unordered(inflight())
            .collect::<Vec<_>>(),
        )?;
        let page = page_size();
        for (file, meta) in heads {
            let meta = meta?;
            let name = &names[file as usize];
            let etag = meta.e_tag.as_deref().map(|e| e.trim_matches('"'));
            let object = etag.filter(|_| cache_limit() >= page).map(|etag| {
                let version = format!("{etag}\n{}\n{page}", meta.size);
                let version = xxhash_rust::xxh3::xxh3_64(version.as_bytes());
                let pages = cache
                    .join(&self.bucket)
                    .join(&self.prefix)
                    .join(format!("{name}.pages"));
                let dir = pages.join(format!("{version:016x}"));
                // Pages of earlier versions (or page sizes) will not be read again.
                if let Ok(entries) = std::fs::read_dir(&pages) {
                    for e in entries.flatten().filter(|e| e.path() != dir) {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
                ObjectPages {
                    dir,
                    size: meta.size,
                    page,
                }
            });
            let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
            for_this_process(&mut known).insert(key(file), object.clone());
            out.insert(file, object);
        }
        Ok(out)
    }

    /// What the cache did not serve of a read ([`Remote::read_cached`]): the ranges of objects
    /// not cached, then the missing pages.
    pub(super) async fn fetch_paged(
        &self,
        store: &dyn ObjectStore,
        names: &[String],
        paged: Paged,
        buf: &mut [u8],
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<()> {
        self.fetch_into(store, names, &paged.direct, buf, stop)
            .await?;
        let Some(cache) = paged.cache else {
            return Ok(());
        };
        self.fill_pages(store, &cache, names, paged.missing, buf, stop)
            .await
    }

    /// Fetches the `missing` pages (at most [`PAGE_GROUP`] bytes of them at a time, as
    /// coalesced ranged GETs), copies their pieces into `buf`, and keeps them in the cache.
    async fn fill_pages(
        &self,
        store: &dyn ObjectStore,
        cache: &Path,
        names: &[String],
        missing: Vec<MissingPage>,
        buf: &mut [u8],
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<()> {
        let group_bytes = (inflight() as u64 * max_request()).min(PAGE_GROUP);
        let mut rest = missing;
        while !rest.is_empty() {
            let mut bytes = 0;
            let n = rest
                .iter()
                .take_while(|p| {
                    bytes += p.len;
                    bytes - p.len == 0 || bytes <= group_bytes
                })
                .count();
            let group: Vec<MissingPage> = rest.drain(..n).collect();
            let mut ranges = Vec::with_capacity(group.len());
            let mut dst = 0;
            for p in &group {
                ranges.push(ReadRange {
                    file: p.file,
                    offset: p.offset,
                    len: p.len,
                    dst,
                });
                dst += p.len;
            }
            let mut fetched = vec![0u8; dst as usize];
            self.fetch_into(store, names, &ranges, &mut fetched, stop)
                .await?;
            for (p, r) in group.iter().zip(&ranges) {
                for &(at, len, to) in &p.pieces {
                    let from = (r.dst + at) as usize;
                    buf[to as usize..(to + len) as usize]
                        .copy_from_slice(&fetched[from..from + len as usize]);
                }
            }
            // The read is complete: the pages are kept in the background, while the loader
            // goes on fetching (writes and syncs would otherwise take turns with GETs).
            let permit = keeping()
                .acquire_many_owned(fetched.len().div_ceil(1 << 20) as u32)
                .await
                .map_err(|e| Error::Internal(format!("internal: keeping cache pages: {e}")))?;
            let cache = cache.to_path_buf();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = keep_pages(&cache, &group, &ranges, &fetched) {
                    let mut failed = KEEP_FAILED.lock().unwrap_or_else(|e| e.into_inner());
                    for_this_process(&mut failed).get_or_insert(e);
                }
                drop(permit);
            });
        }
        Ok(())
    }
}

/// Most cached pages a read holds open at once.
const OPEN_PAGES: usize = 256;

/// Open cache pages, as files for the engine's reader.
struct PageFiles(Vec<(std::fs::File, PathBuf)>);

impl Files for PageFiles {
    fn file(&self, i: u32) -> Result<&std::fs::File> {
        Ok(&self.0[i as usize].0)
    }

    fn path(&self, i: u32) -> PathBuf {
        self.0[i as usize].1.clone()
    }
}

impl PageFiles {
    /// Reads `reads` (of these pages) into `buf` on every core, then closes the pages.
    fn read(&mut self, reads: &mut Vec<ReadRange>, buf: &mut [u8]) -> Result<()> {
        if !reads.is_empty() {
            let threads = crate::config::available_cores().min(reads.len());
            read_all(self, reads, buf, threads, false)?;
            let bytes = reads.iter().map(|r| r.len).sum::<u64>();
            super::CACHE_READ_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        reads.clear();
        self.0.clear();
        Ok(())
    }
}

/// The page at `path` when it is held at its full length `len` (marked used: evicted last).
fn open_page(path: &Path, len: u64) -> Option<std::fs::File> {
    let f = std::fs::File::open(path).ok()?;
    if f.metadata().ok()?.len() != len {
        return None;
    }
    let _ = f.set_modified(std::time::SystemTime::now());
    Some(f)
}

/// Writes the fetched pages of `group` (at `ranges[i].dst` in `fetched`) into the cache, each
/// aside, synced and renamed into place, several at once.
fn keep_pages(
    cache: &Path,
    group: &[MissingPage],
    ranges: &[ReadRange],
    fetched: &[u8],
) -> Result<()> {
    use rayon::prelude::*;
    // In parallel: each page is synced before its rename, and syncs wait on the disk.
    group.par_iter().zip(ranges).try_for_each(|(p, r)| {
        let _writing = reserve(cache, p.len)?;
        let bytes = &fetched[r.dst as usize..(r.dst + p.len) as usize];
        write_aside(&p.path, |f, tmp| {
            use std::io::Write;
            f.write_all(bytes).at(tmp)
        })
    })
}

/// Writes `path` through `fill` into a temporary beside it (one per process and thread, so
/// ranks of a node may write the same file at once), synced, then renamed into place.
fn write_aside(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File, &Path) -> Result<()>,
) -> Result<()> {
    let dir = fsutil::parent_of(path);
    std::fs::create_dir_all(dir).at(dir)?;
    let leaf = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{leaf}.{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp).at(&tmp)?;
        fill(&mut f, &tmp)?;
        fsutil::sync_data(&f, &tmp)?;
        fsutil::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Makes room for `incoming` more bytes in the cache at `root`, counted as being written until
/// the returned reservation is dropped. When this process's count would pass the limit (or it
/// has not counted yet), sums the cache and evicts the least recently used files down to the
/// limit less an eighth of it (at most 1 GiB), counting the files this process is writing.
fn reserve(root: &Path, incoming: u64) -> Result<Reservation> {
    claim(root)?;
    let limit = cache_limit();
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let held = for_this_process(&mut held)
        .entry(root.to_path_buf())
        .or_default();
    if held.swept.is_none_or(|n| n + incoming > limit) {
        let slack = (limit / 8).min(1 << 30);
        let target = limit.saturating_sub(slack);
        held.swept = Some(evict(root, held.writing + incoming, target)? + held.writing);
    }
    held.swept = held.swept.map(|n| n + incoming);
    held.writing += incoming;
    Ok(Reservation {
        root: root.to_path_buf(),
        bytes: incoming,
    })
}

/// Bytes being written into a cache ([`reserve`]), until dropped.
struct Reservation {
    root: PathBuf,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = for_this_process(&mut held).get_mut(&self.root) {
            h.writing = h.writing.saturating_sub(self.bytes);
        }
    }
}

/// Removes the least recently used files of the cache at `root` until `incoming` more bytes
/// fit under `target`; the bytes it then holds.
fn evict(root: &Path, incoming: u64, target: u64) -> Result<u64> {
    let mut files = Vec::new();
    for (path, name, m) in files_below(root) {
        let used = m.modified().unwrap_or(std::time::UNIX_EPOCH);
        if !name.starts_with('.') {
            files.push((used, m.len(), path));
        } else if fsutil::is_temp_name(&name) && used.elapsed().unwrap_or_default() > STALE_TMP {
            // Left by a process killed while writing (a live writer renames within seconds).
            let _ = std::fs::remove_file(path);
        }
    }
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    files.sort();
    for (_, len, path) in files {
        if total + incoming <= target {
            break;
        }
        match std::fs::remove_file(&path) {
            // Another process evicted it first.
            Ok(()) => total -= len,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => total -= len,
            Err(e) => return Err(e).at(&path),
        }
    }
    Ok(total)
}

/// A local copy of object `name` under `remote` in the cache at `cache`: reused while its size
/// and ETag match the object's, else fetched again (parallel ranged GETs, written aside).
fn whole_copy(
    cache: &Path,
    remote: &Remote,
    name: &str,
    size: u64,
    etag: Option<&str>,
) -> Result<PathBuf> {
    let local = cache.join(&remote.bucket).join(&remote.prefix).join(name);
    let dir = fsutil::parent_of(&local).to_path_buf();
    let leaf = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stamp = dir.join(format!(".{leaf}.etag"));
    let stamp_ok = match (etag, std::fs::read_to_string(&stamp)) {
        (Some(e), Ok(s)) => s == e,
        _ => false,
    };
    if stamp_ok && fsutil::regular_file_len(&local) == Some(size) {
        // Recently used: last to be evicted.
        let _ =
            std::fs::File::open(&local).and_then(|f| f.set_modified(std::time::SystemTime::now()));
        return Ok(local);
    }
    let _writing = reserve(cache, size)?;
    let _ = std::fs::remove_file(&stamp);
    write_aside(&local, |f, tmp| {
        use std::io::Write;
        let names = [name.to_string()];
        let mut buf = vec![0u8; COPY_STEP.min(size) as usize];
        let mut done = 0;
        while done < size {
            let n = COPY_STEP.min(size - done);
            remote.read_ranges(&names, &[(0, done, n, 0)], &mut buf[..n as usize])?;
            f.write_all(&buf[..n as usize]).at(tmp)?;
            done += n;
        }
        Ok(())
    })?;
    if let Some(e) = etag {
        fsutil::atomic_write(&stamp, e.as_bytes())?;
    }
    Ok(local)
}

/// How a container format names the shards of a set (see [`fetch_container`]).
pub(crate) struct ShardNames {
    /// The base name of the set `name` would belong to.
    pub base: fn(&str) -> &str,
    /// Whether object `name` is a shard of the set `base`.
    pub is_shard: fn(&str, &str) -> bool,
}

/// A container (one object, or a shard set `BASE.shard<i>-of-<N>.sdnb` beside `url`) copied into
/// the cache at `cache` (reused while each object's size and ETag are unchanged); returns the
/// local path to open. Used only when `SHARDKIT_CACHE_DIR` is set ([`cache_dir`]). The format
/// names its shard objects: `shards.base` is the set's base name for `name`, and
/// `shards.is_shard` whether an object is a shard of that base.
pub(crate) fn fetch_container(url: &Path, cache: &Path, shards: &ShardNames) -> Result<PathBuf> {
    claim(cache)?;
    let remote = Remote::parse(url)?;
    let (parent, name) = remote.split_last()?;
    let objects: Vec<(String, u64, Option<String>)> = parent
        .list_etags()?
        .into_iter()
        .filter(|(n, _, _)| !n.contains('/'))
        .collect();
    let local = cache.join(&parent.bucket).join(&parent.prefix).join(&name);
    if let Some((_, size, etag)) = objects.iter().find(|(n, _, _)| *n == name) {
        return whole_copy(cache, &parent, &name, *size, etag.as_deref());
    }
    let base = (shards.base)(&name);
    let shards: Vec<_> = objects
        .iter()
        .filter(|(n, _, _)| (shards.is_shard)(n, base))
        .collect();
    if shards.is_empty() {
        return Err(Error::NotFound {
            path: PathBuf::from(remote.url()),
            what: format!(
                "no such object, and no shard objects {base}.shard<i>-of-<N>.sdnb beside it"
            ),
        });
    }
    for (n, size, etag) in shards {
        whole_copy(cache, &parent, n, *size, etag.as_deref())?;
    }
    Ok(local)
}

mod cached;
pub(crate) use cached::Cached;

#[cfg(test)]
mod tests;
