//! Checksums beyond every reference format: xxh3-64 hashes of every block of every file of a
//! dataset, kept in a sidecar that the reference readers never open.
//!
//! The sidecar is `shardkit.checksums.json` inside a dataset directory (saev, EAGLE-3,
//! flat-tokens); beside a container it is named after that container, so that containers in one
//! directory never share one: `NAME.checksums.json` for an SDNB file or SDZ archive named NAME
//! (`m.sdnb.checksums.json`, `m.sdz.checksums.json`), `BASE.shard-set.checksums.json` for the
//! shard set `BASE.shard<i>-of-<N>.sdnb`. Earlier versions wrote `BASE.checksums.json` (BASE: the
//! name without extension or shard suffix) for all three; such a sidecar is still read for the
//! container whose files it covers, when the container has none of the new name, and is removed
//! when a new one is written for that container.
//!
//! ```json
//! {"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {
//!   "acts000000.bin": {"bytes": 268435456, "block_bytes": 1048576, "xxh3": ["9f0c...", ...]}}}
//! ```
//!
//! File names are relative to the sidecar's directory (`/`-separated below it). Each file is cut
//! into blocks of `block_bytes` (a power of two, at least 1 MiB, and large enough that a file has
//! at most 4,096 blocks); `xxh3[i]` is the 16-hex-digit XXH3-64 (seed 0) of block `i`, the last
//! block being the file's remainder. Blocks let random readers verify only what they read.
//!
//! While shardkit changes files of a dataset that has a sidecar (`Change`), the sidecar also
//! holds `"previous": {NAME: {...} | null}`: the state each changing file had before, which it
//! also verifies against (`null`: the file did not exist). This keeps `validate --deep` passing
//! at every instant of a change that a kill may interrupt; the entry is dropped when the change
//! is done (readers of earlier versions ignore it).

use std::collections::BTreeMap;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::json::{self, Escape, Value};

/// The sidecar's name inside a dataset directory.
pub const SIDECAR: &str = "shardkit.checksums.json";
/// The smallest block.
pub(crate) const MIN_BLOCK: u64 = 1 << 20;
/// The most blocks a file is cut into (larger files get larger blocks).
pub(crate) const MAX_BLOCKS: u64 = 4096;

/// The block size of a file of `len` bytes.
pub(crate) fn block_bytes_for(len: u64) -> u64 {
    len.div_ceil(MAX_BLOCKS)
        .checked_next_power_of_two()
        .unwrap_or(1 << 63)
        .max(MIN_BLOCK)
}

/// The hashes of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSums {
    /// The file's length.
    pub bytes: u64,
    /// The block size.
    pub block_bytes: u64,
    /// XXH3-64 of each block.
    pub blocks: Vec<u64>,
}

impl FileSums {
    /// The hashes of `data`.
    pub(crate) fn of_bytes(data: &[u8]) -> FileSums {
        let block_bytes = block_bytes_for(data.len() as u64);
        FileSums {
            bytes: data.len() as u64,
            block_bytes,
            blocks: data.chunks(block_bytes as usize).map(xxh3_64).collect(),
        }
    }

    /// The hashes of the file at `path`, read block by block.
    pub(crate) fn of_file(path: &Path) -> Result<FileSums> {
        let mut f = fsutil::open_regular(path)?;
        let bytes = f.metadata().at(path)?.len();
        let block_bytes = block_bytes_for(bytes);
        let mut buf = vec![0u8; block_bytes.min(bytes.max(1)) as usize];
        let mut blocks = Vec::with_capacity(bytes.div_ceil(block_bytes) as usize);
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block_bytes) as usize;
            f.read_exact(&mut buf[..n]).map_err(|e| {
                Error::format(
                    path,
                    format!("could not be read whole for its checksum: {e}"),
                )
            })?;
            blocks.push(xxh3_64(&buf[..n]));
            left -= n as u64;
        }
        Ok(FileSums {
            bytes,
            block_bytes,
            blocks,
        })
    }

    /// The byte range of block `i`.
    pub fn block(&self, i: usize) -> Range<u64> {
        let start = i as u64 * self.block_bytes;
        start..(start + self.block_bytes).min(self.bytes)
    }

    /// The blocks that `range` touches.
    pub(crate) fn blocks_of(&self, range: Range<u64>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        (range.start / self.block_bytes) as usize
            ..(range.end.div_ceil(self.block_bytes) as usize).min(self.blocks.len())
    }

    pub(crate) fn to_json(&self) -> Value {
        Value::Object(vec![
            ("bytes".into(), Value::int(self.bytes)),
            ("block_bytes".into(), Value::int(self.block_bytes)),
            (
                "xxh3".into(),
                Value::Array(
                    self.blocks
                        .iter()
                        .map(|h| Value::String(format!("{h:016x}")))
                        .collect(),
                ),
            ),
        ])
    }

    pub(crate) fn from_json(v: &Value, name: &str, src: &Path) -> Result<FileSums> {
        let bad = |rule: String| Error::format(src, format!("files[{name:?}]: {rule}"));
        let num = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative integer")))
        };
        let bytes = num("bytes")?;
        let block_bytes = num("block_bytes")?;
        if block_bytes == 0 || !block_bytes.is_power_of_two() {
            return Err(bad(format!(
                "block_bytes {block_bytes} is not a power of two"
            )));
        }
        let Some(Value::Array(hs)) = v.get("xxh3") else {
            return Err(bad("`xxh3` must be a list of hex strings".into()));
        };
        if hs.len() as u64 != bytes.div_ceil(block_bytes) {
            return Err(bad(format!(
                "{} hashes for {bytes} bytes in blocks of {block_bytes}",
                hs.len()
            )));
        }
        let blocks = hs
            .iter()
            .map(|h| match h {
                Value::String(s) if s.len() == 16 => u64::from_str_radix(s, 16).ok(),
                _ => None,
            })
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| bad("a hash is not 16 hex digits".into()))?;
        Ok(FileSums {
            bytes,
            block_bytes,
            blocks,
        })
    }
}

/// A damaged (or missing) part of a dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// The file.
    pub file: PathBuf,
    /// The bytes that do not match.
    pub range: Range<u64>,
    /// What is wrong.
    pub what: String,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: bytes {} to {}: {}",
            self.file.display(),
            self.range.start,
            self.range.end.saturating_sub(1),
            self.what
        )
    }
}

/// The checksums of a dataset: file name (relative to the sidecar's directory) to its hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checksums {
    /// Every file covered.
    pub files: BTreeMap<String, FileSums>,
    /// Files that a change in progress (or one a kill interrupted) is replacing: the state each
    /// had before (None: it did not exist). Such a file verifies against either state.
    pub previous: BTreeMap<String, Option<FileSums>>,
}

impl Checksums {
    /// Reads a sidecar (None when there is none).
    pub fn read(path: &Path) -> Result<Option<Checksums>> {
        let bytes = match fsutil::read_json_file(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        Checksums::parse(&bytes, path).map(Some)
    }

    /// Parses a sidecar's bytes (`path` names it in errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Checksums> {
        let v = json::parse(bytes).map_err(|e| Error::format(path, e.to_string()))?;
        if v.get("shardkit_checksums").and_then(Value::as_u64) != Some(1) {
            return Err(Error::format(
                path,
                "not a shardkit checksums sidecar of version 1 (`shardkit_checksums`: 1)",
            ));
        }
        if v.get("algorithm").and_then(Value::as_str) != Some("xxh3-64") {
            return Err(Error::format(path, "`algorithm` must be \"xxh3-64\""));
        }
        let Some(Value::Object(files)) = v.get("files") else {
            return Err(Error::format(path, "`files` must be an object"));
        };
        let mut out = Checksums::default();
        for (name, f) in files {
            if name.is_empty() || name.starts_with('/') || name.split('/').any(|c| c == "..") {
                return Err(Error::format(
                    path,
                    format!("file name {name:?} is not a path below the sidecar's directory"),
                ));
            }
            out.files
                .insert(name.clone(), FileSums::from_json(f, name, path)?);
        }
        match v.get("previous") {
            None => {}
            Some(Value::Object(prev)) => {
                for (name, f) in prev {
                    if !out.files.contains_key(name) {
                        return Err(Error::format(
                            path,
                            format!("previous[{name:?}]: names a file that `files` does not"),
                        ));
                    }
                    let sums = match f {
                        Value::Null => None,
                        f => Some(FileSums::from_json(f, name, path)?),
                    };
                    out.previous.insert(name.clone(), sums);
                }
            }
            Some(_) => return Err(Error::format(path, "`previous` must be an object")),
        }
        Ok(out)
    }

    /// Writes the sidecar atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        fsutil::atomic_write(path, &document_bytes(self.to_json()))
    }

    fn to_json(&self) -> Vec<(String, Value)> {
        let mut out = vec![
            ("shardkit_checksums".into(), Value::int(1)),
            ("algorithm".into(), Value::String("xxh3-64".into())),
            (
                "files".into(),
                Value::Object(
                    self.files
                        .iter()
                        .map(|(k, s)| (k.clone(), s.to_json()))
                        .collect(),
                ),
            ),
        ];
        // Only while a change is in flight: a settled sidecar has exactly the three keys.
        if !self.previous.is_empty() {
            out.push((
                "previous".into(),
                Value::Object(
                    self.previous
                        .iter()
                        .map(|(k, s)| {
                            (k.clone(), s.as_ref().map_or(Value::Null, FileSums::to_json))
                        })
                        .collect(),
                ),
            ));
        }
        out
    }

    /// What file `name` of `len` bytes (None: absent) is checked against: the recorded hashes,
    /// or its previous state's while a change is replacing it, and per block an alternative
    /// (a file rewritten in place verifies while each block is either old or new). None: the
    /// file's absence is expected (a change is creating it).
    fn expected(&self, name: &str, len: Option<u64>) -> Option<(&FileSums, Option<&FileSums>)> {
        let sums = self.files.get(name)?;
        let Some(prev) = self.previous.get(name) else {
            return Some((sums, None));
        };
        match (prev, len) {
            (None, None) => None,
            (Some(p), Some(len)) if len != sums.bytes && len == p.bytes => Some((p, None)),
            (Some(p), _) if p.bytes == sums.bytes && p.block_bytes == sums.block_bytes => {
                Some((sums, Some(p)))
            }
            _ => Some((sums, None)),
        }
    }

    /// Intact (every recorded file and byte) when `damage` is empty, else damaged.
    fn verdict(&self, damage: Vec<Damage>) -> Verdict {
        if damage.is_empty() {
            Verdict::Intact {
                files: self.files.len(),
                bytes: self.files.values().map(|s| s.bytes).sum(),
            }
        } else {
            Verdict::Damaged(damage)
        }
    }

    /// Checks every file below `base`: present, of the recorded length, every block matching
    /// (or matching the state a change in progress replaces, see [`Checksums::previous`]).
    pub fn verify(&self, base: &Path) -> Vec<Damage> {
        let mut out: Vec<Damage> = self
            .files
            .par_iter()
            .flat_map_iter(|(name, _)| {
                let path = base.join(name);
                match self.expected(name, fsutil::regular_file_len(&path)) {
                    Some((sums, alt)) => verify_file(&path, sums, alt),
                    None => Vec::new(),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.file, a.range.start).cmp(&(&b.file, b.range.start)));
        out
    }
}

/// Checks `path` against `sums`; a block also passes when it matches the same block of `alt`.
fn verify_file(path: &Path, sums: &FileSums, alt: Option<&FileSums>) -> Vec<Damage> {
    let damage = |range: Range<u64>, what: String| Damage {
        file: path.to_path_buf(),
        range,
        what,
    };
    let f = match fsutil::open_regular(path) {
        Ok(f) => f,
        Err(e) => return vec![damage(0..sums.bytes, format!("cannot be read: {e}"))],
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut out = Vec::new();
    if len != sums.bytes {
        out.push(damage(
            len.min(sums.bytes)..len.max(sums.bytes),
            format!("is {len} bytes; its checksums record {}", sums.bytes),
        ));
    }
    let mut buf = vec![0u8; sums.block_bytes.min(sums.bytes.max(1)) as usize];
    let mut f = f;
    for (i, &want) in sums.blocks.iter().enumerate() {
        let r = sums.block(i);
        let n = (r.end - r.start) as usize;
        match f.read_exact(&mut buf[..n]) {
            Ok(()) if block_matches(xxh3_64(&buf[..n]), want, alt, i) => {}
            Ok(()) => out.push(damage(r, "does not match its checksum".into())),
            Err(_) => {
                // Reported above as a length mismatch; nothing more to read.
                break;
            }
        }
    }
    out
}

/// Whether a block hashing to `h` is good: `want`, or block `i` of the alternative state.
fn block_matches(h: u64, want: u64, alt: Option<&FileSums>, i: usize) -> bool {
    h == want || alt.and_then(|a| a.blocks.get(i)) == Some(&h)
}

/// Where the sidecar of the dataset at `path` lives, the directory its names are relative to,
/// and the dataset's files (relative names). A directory is every regular file below it but
/// the sidecar, writers' temporaries and lock files; anything else is an SDNB container (a
/// file, an archive, a shard file or a shard set's base name, as [`crate::sdnb::open`] takes
/// it), whose files are its parts. The sidecar is the one in use: the container's own, or one
/// an earlier version wrote under the old shared name when only it covers the container.
pub fn dataset_files(path: &Path) -> Result<(PathBuf, PathBuf, Vec<String>)> {
    let l = locate(path)?;
    Ok((l.sidecar, l.base, l.names))
}

/// A dataset's sidecar and files (see [`dataset_files`]).
pub(crate) struct Located {
    /// The sidecar in use (read, and rewritten by a [`Change`]).
    pub sidecar: PathBuf,
    /// Where a sidecar written afresh goes (the container's own name).
    pub fresh: PathBuf,
    /// A sidecar of the old shared name that covers this container (removed once `fresh`
    /// is written).
    pub legacy: Option<PathBuf>,
    /// The directory the names are relative to.
    pub base: PathBuf,
    /// The dataset's files.
    pub names: Vec<String>,
}

fn locate(path: &Path) -> Result<Located> {
    if crate::storage::is_remote(path) {
        return Err(Error::Invalid(format!(
            "{}: checksums are recorded on local files (a writer given a URL records them \
             before it uploads); to add them to a dataset in a store, download it, run \
             `checksum`, and upload it again",
            path.display()
        )));
    }
    let path = &crate::storage::local_path(path);
    // A path that does not exist may still name a container: a shard set's base name.
    if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        let mut names = Vec::new();
        walk(path, "", &mut names)?;
        names.sort();
        let sidecar = path.join(SIDECAR);
        return Ok(Located {
            fresh: sidecar.clone(),
            sidecar,
            legacy: None,
            base: path.to_path_buf(),
            names,
        });
    }
    let c = crate::sdnb::open(path)?;
    locate_container(&c)
}

/// [`locate`] for a container already open (local).
pub(crate) fn locate_container(c: &crate::sdnb::Container) -> Result<Located> {
    let files = c.files();
    let first = files
        .first()
        .ok_or_else(|| Error::format(c.path(), "has no files"))?;
    let dir = fsutil::parent_of(first).to_path_buf();
    let names: Vec<String> = files
        .iter()
        .map(|p| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let sharded = matches!(c.kind(), crate::sdnb::Kind::Sharded { .. });
    let named = match sharded {
        true => names
            .iter()
            .find(|n| crate::sdnb::sdz::parse_shard_name(n).is_some())
            .unwrap_or(&names[0]),
        false => &names[0],
    };
    let (own, old) = container_sidecar_names(named, sharded);
    let fresh = dir.join(&own);
    let legacy = (old != own)
        .then(|| dir.join(&old))
        .filter(|p| legacy_covers(p, named, sharded));
    let sidecar = match &legacy {
        Some(l) if !fresh.exists() => l.clone(),
        _ => fresh.clone(),
    };
    Ok(Located {
        sidecar,
        fresh,
        legacy,
        base: dir,
        names,
    })
}

/// The sidecar names of a container whose (first) file is named `name`: its own
/// (`NAME.checksums.json`, or `BASE.shard-set.checksums.json` for a shard set), and the name
/// earlier versions gave every container of that base (`BASE.checksums.json`).
pub(crate) fn container_sidecar_names(name: &str, sharded: bool) -> (String, String) {
    let base = match crate::sdnb::sdz::parse_shard_name(name) {
        Some((b, _, _)) => b,
        None => crate::sdnb::base_name(name),
    };
    let own = if sharded {
        format!("{base}.shard-set.checksums.json")
    } else {
        format!("{name}.checksums.json")
    };
    (own, format!("{base}.checksums.json"))
}

/// Whether the sidecar of the old shared name in `bytes` covers the container named `name`
/// (every file it records is that file, or a shard of that set): it belongs to another
/// container of the same base otherwise (`m.sdnb`'s beside `m.sdz`).
fn legacy_bytes_cover(bytes: &[u8], at: &Path, name: &str, sharded: bool) -> bool {
    let Ok(sums) = Checksums::parse(bytes, at) else {
        return false;
    };
    let base = match crate::sdnb::sdz::parse_shard_name(name) {
        Some((b, _, _)) => b,
        None => crate::sdnb::base_name(name),
    };
    !sums.files.is_empty()
        && sums.files.keys().all(|k| match sharded {
            true => crate::sdnb::sdz::parse_shard_name(k).is_some_and(|(b, _, _)| b == base),
            false => k == name,
        })
}

/// Before the container `dir/name` (a shard set when `sharded`: `name` is its base name or a
/// shard's) is written anew: removes its sidecars (its own, and one of the old shared name
/// that covers it), so that none outlives the overwrite as a stale record; a kill before the
/// new one is written leaves the container without a sidecar, which `validate --deep` notes
/// and saving again adds. Returns what was removed, for [`put_back_sidecars`].
pub(crate) fn take_container_sidecars(
    dir: &Path,
    name: &str,
    sharded: bool,
) -> Result<Vec<(PathBuf, Vec<u8>)>> {
    let (own, old) = container_sidecar_names(name, sharded);
    let mut taken = Vec::new();
    let mut paths = vec![dir.join(&own)];
    if old != own && legacy_covers(&dir.join(&old), name, sharded) {
        paths.push(dir.join(&old));
    }
    for p in paths {
        if let Ok(bytes) = std::fs::read(&p) {
            remove_sidecar(&p)?;
            taken.push((p, bytes));
        }
    }
    Ok(taken)
}

/// After a write that failed before replacing anything: puts back the sidecars
/// [`take_container_sidecars`] removed, those that still hold for the files on disk.
pub(crate) fn put_back_sidecars(dir: &Path, taken: Vec<(PathBuf, Vec<u8>)>) {
    for (p, bytes) in taken {
        let still_true = Checksums::parse(&bytes, &p)
            .map(|s| s.verify(dir).is_empty())
            .unwrap_or(false);
        if still_true {
            let _ = fsutil::atomic_write(&p, &bytes);
        }
    }
}

/// [`legacy_bytes_cover`] of the sidecar file at `p`.
pub(crate) fn legacy_covers(p: &Path, name: &str, sharded: bool) -> bool {
    match fsutil::read_json_file(p) {
        Ok(bytes) => legacy_bytes_cover(&bytes, p, name, sharded),
        Err(_) => false,
    }
}

fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) -> Result<()> {
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = format!("{prefix}{name}");
        let ty = e.file_type().at(e.path())?;
        if ty.is_dir() {
            // A writer's private directory (a store write's labels pieces) holds no data.
            if !name.starts_with(".shardkit") {
                walk(&e.path(), &format!("{rel}/"), out)?;
            }
        } else if ty.is_file() && is_data_name(&name) {
            out.push(rel);
        }
    }
    Ok(())
}

/// Whether a file named `leaf` is part of a dataset's data (not its sidecar, a writer's
/// temporary, a lock file or shardkit's own bookkeeping).
fn is_data_name(leaf: &str) -> bool {
    let ours = leaf == SIDECAR
        || fsutil::is_temp_name(leaf)
        || (leaf.starts_with('.') && leaf.ends_with(".lock"))
        || leaf.starts_with(".shardkit");
    !ours
}

/// Hashes every file of the dataset at `path` (those in `known` whose length still matches are
/// taken as they are) and writes its sidecar; returns the sidecar's path.
pub(crate) fn record_with(path: &Path, known: &BTreeMap<String, FileSums>) -> Result<PathBuf> {
    let Located {
        fresh: sidecar,
        legacy,
        base,
        mut names,
        ..
    } = locate(path)?;
    // Files known but not on disk yet (a commit record written right after the sidecar).
    for n in known.keys() {
        if !names.contains(n) && fsutil::regular_file_len(&base.join(n)).is_none() {
            names.push(n.clone());
        }
    }
    let files = names
        .par_iter()
        .map(|n| {
            let p = base.join(n);
            let len = fsutil::regular_file_len(&p);
            match known.get(n) {
                Some(s) if len.is_none() || Some(s.bytes) == len => Ok((n.clone(), s.clone())),
                _ => FileSums::of_file(&p).map(|s| (n.clone(), s)),
            }
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    Checksums {
        files,
        previous: BTreeMap::new(),
    }
    .write(&sidecar)?;
    // The container's sidecar under the name earlier versions shared between containers of
    // one base is stale now; it goes once the new one is durable (until then it is not read,
    // as the new one is found first).
    if let Some(old) = legacy.filter(|l| *l != sidecar) {
        remove_sidecar(&old)?;
    }
    Ok(sidecar)
}

/// `record_with` hashing everything: `shardkit <format> checksum`.
pub fn record(path: &Path) -> Result<PathBuf> {
    record_with(path, &BTreeMap::new())
}

/// Keeps the sidecar of a dataset true while some of its files change (an EAGLE-3 manifest or
/// embeddings file replaced, an SDNB container's graph region rewritten in place, flat-tokens'
/// completion marker set). A dataset without a sidecar is left without one.
///
/// The order, and why `validate --deep` passes whenever a kill interrupts it:
/// 1. [`Change::begin`] rewrites the sidecar (atomically: temporary, fsync, rename) so that each
///    changing file verifies against its new hashes or the state it has now (`previous`). Before
///    this rename: old sidecar, old files. After it: either state of each file verifies.
/// 2. The caller changes the files, each durable (fsynced; renamed and the directory fsynced)
///    before step 3. A file rewritten in place verifies block by block against either state,
///    so even a kill between two of its writes leaves it verifying.
/// 3. [`Change::commit`] rewrites the sidecar with the new hashes alone.
///
/// A kill between 1 and 3 leaves `previous` behind; it still verifies whichever state the files
/// are in, and the next change (or `checksum`) settles it to the state on disk.
#[derive(Debug)]
pub(crate) struct Change {
    sidecar: PathBuf,
    done: Checksums,
}

impl Change {
    /// Step 1 for the dataset whose sidecar is `sidecar` (names relative to `base`): `new(sums)`
    /// gives the hashes each changing file will have, from the sidecar's settled hashes. None
    /// (and nothing written) when the dataset has no sidecar.
    pub(crate) fn begin(
        sidecar: &Path,
        base: &Path,
        new: impl FnOnce(&Checksums) -> Result<Vec<(String, FileSums)>>,
    ) -> Result<Option<Change>> {
        let Some(mut sums) = Checksums::read(sidecar)? else {
            return Ok(None);
        };
        sums.settle(base)?;
        let mut during = sums.clone();
        let mut done = sums.clone();
        for (name, s) in new(&sums)? {
            if sums.files.get(&name) == Some(&s) {
                continue;
            }
            during
                .previous
                .insert(name.clone(), sums.files.get(&name).cloned());
            during.files.insert(name.clone(), s.clone());
            done.files.insert(name, s);
        }
        if during != sums {
            during.write(sidecar)?;
        } else if done != sums {
            // Only settled leftovers of a killed change: written now, before anything changes.
            done.write(sidecar)?;
        }
        Ok(Some(Change {
            sidecar: sidecar.to_path_buf(),
            done,
        }))
    }

    /// Step 3: the files are changed and durable; the sidecar records their new state alone.
    pub(crate) fn commit(self) -> Result<()> {
        match Checksums::read(&self.sidecar)? {
            Some(now) if now == self.done => Ok(()),
            _ => self.done.write(&self.sidecar),
        }
    }
}

/// Replaces the file `base/name` with `bytes` (written to a temporary, fsynced, renamed),
/// keeping the sidecar `sidecar` true (see [`Change`]).
pub(crate) fn replace_file(sidecar: &Path, base: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let change = Change::begin(sidecar, base, |_| {
        Ok(vec![(name.to_string(), FileSums::of_bytes(bytes))])
    })?;
    fsutil::atomic_write(&base.join(name), bytes)?;
    match change {
        Some(c) => c.commit(),
        None => Ok(()),
    }
}

impl Checksums {
    /// Resolves what a killed [`Change`] left: each file with a `previous` state is hashed and
    /// recorded as it is where it matches either state (block by block), keeping the recorded
    /// hash where it matches neither (damage stays reported).
    fn settle(&mut self, base: &Path) -> Result<()> {
        for (name, prev) in std::mem::take(&mut self.previous) {
            let path = base.join(&name);
            if fsutil::regular_file_len(&path).is_none() {
                if prev.is_none() {
                    self.files.remove(&name); // the file a change was creating is not there
                }
                continue;
            }
            let Some(sums) = self.files.get(&name) else {
                continue;
            };
            let now = FileSums::of_file(&path)?;
            let settled = match &prev {
                Some(p) if now.bytes != sums.bytes && now.bytes == p.bytes => p.clone(),
                _ if now.bytes != sums.bytes => sums.clone(),
                _ => FileSums {
                    blocks: (0..sums.blocks.len())
                        .map(|i| {
                            let alt = prev.as_ref().filter(|p| {
                                p.bytes == sums.bytes && p.block_bytes == sums.block_bytes
                            });
                            let good = block_matches(now.blocks[i], sums.blocks[i], alt, i);
                            if good {
                                now.blocks[i]
                            } else {
                                sums.blocks[i]
                            }
                        })
                        .collect(),
                    ..sums.clone()
                },
            };
            self.files.insert(name, settled);
        }
        Ok(())
    }
}

impl FileSums {
    /// The hashes of the file at `path` once `patches` ((offset, bytes) each) are written over
    /// it in place: only the blocks they touch are read. Each of those must match its recorded
    /// hash first, so that a change never records damaged bytes as good.
    pub(crate) fn patched(&self, path: &Path, patches: &[(u64, &[u8])]) -> Result<FileSums> {
        if let Some((at, b)) = patches.iter().find(|(at, b)| {
            at.checked_add(b.len() as u64)
                .is_none_or(|e| e > self.bytes)
        }) {
            return Err(Error::Invalid(format!(
                "{}: a write of {} bytes at {at} would pass the end of the file ({} bytes)",
                path.display(),
                b.len(),
                self.bytes
            )));
        }
        let mut f = fsutil::open_regular(path)?;
        let len = f.metadata().at(path)?.len();
        if len != self.bytes {
            return Err(Error::format(
                path,
                format!(
                    "is {len} bytes; its checksums record {}: the file is damaged, so it is not \
                     changed (restore it, or run `checksum` to accept it as it is)",
                    self.bytes
                ),
            ));
        }
        let mut touched: Vec<usize> = patches
            .iter()
            .flat_map(|(at, b)| self.blocks_of(*at..at + b.len() as u64))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let mut out = self.clone();
        for b in touched {
            let r = self.block(b);
            let mut buf = vec![0u8; (r.end - r.start) as usize];
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(r.start)).at(path)?;
            f.read_exact(&mut buf).at(path)?;
            if xxh3_64(&buf) != self.blocks[b] {
                return Err(Error::format(
                    path,
                    format!(
                        "bytes {} to {} do not match their checksum: the file is damaged, so it \
                         is not changed (restore it, or run `checksum` to accept it as it is)",
                        r.start,
                        r.end.saturating_sub(1)
                    ),
                ));
            }
            for (at, bytes) in patches {
                let (s, e) = (*at.max(&r.start), (at + bytes.len() as u64).min(r.end));
                if s < e {
                    buf[(s - r.start) as usize..(e - r.start) as usize]
                        .copy_from_slice(&bytes[(s - at) as usize..(e - at) as usize]);
                }
            }
            out.blocks[b] = xxh3_64(&buf);
        }
        Ok(out)
    }
}

/// Removes a sidecar before its dataset changes (a writer's first change to a finished
/// dataset): a crash mid-write then leaves no sidecar rather than a stale one.
pub(crate) fn remove_sidecar(sidecar: &Path) -> Result<()> {
    match std::fs::remove_file(sidecar) {
        Ok(()) => fsutil::fsync_dir(fsutil::parent_of(sidecar)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(sidecar, e)),
    }
}

fn document_bytes(fields: Vec<(String, Value)>) -> Vec<u8> {
    let mut text = json::to_pretty(&Value::Object(fields), 1, Escape::Utf8);
    text.push('\n');
    text.into_bytes()
}

/// What a writer streaming a dataset to an object store has put there: the checksums of the
/// files uploaded so far (in the sidecar's format) and the facts a resumed write cannot tell
/// from the store (saev: `labels`, whether the dataset has labels; EAGLE-3: `manifest`, the
/// cache's configuration). The writer rewrites it after each upload, so it never names a file
/// the store does not hold; a resumed write keeps the files it names that are present at their
/// size, and their checksums go into the finished dataset's sidecar.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Journal {
    pub files: Checksums,
    pub facts: Vec<(String, Value)>,
}

impl Journal {
    /// The journal's object name, beside the dataset's files.
    pub(crate) const NAME: &'static str = ".shardkit-upload.json";

    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut fields = self.files.to_json();
        fields.extend(self.facts.iter().cloned());
        document_bytes(fields)
    }

    /// Parses a journal (`path` names it in errors).
    pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Journal> {
        let files = Checksums::parse(bytes, path)?;
        let Ok(Value::Object(fields)) = json::parse(bytes) else {
            return Err(Error::format(path, "not a JSON object"));
        };
        let facts = fields
            .into_iter()
            .filter(|(k, _)| !matches!(k.as_str(), "shardkit_checksums" | "algorithm" | "files"))
            .collect();
        Ok(Journal { files, facts })
    }

    /// The fact recorded under `key`.
    pub(crate) fn fact(&self, key: &str) -> Option<&Value> {
        self.facts.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Records `value` under `key`, replacing what was there.
    pub(crate) fn set_fact(&mut self, key: &str, value: Value) {
        self.facts.retain(|(k, _)| k != key);
        self.facts.push((key.into(), value));
    }
}

/// The outcome of checking a dataset against its sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No sidecar.
    NoSidecar,
    /// Every file matches.
    Intact {
        /// Files checked.
        files: usize,
        /// Bytes hashed.
        bytes: u64,
    },
    /// What does not match (and the files present but not covered).
    Damaged(Vec<Damage>),
}

/// Checks the dataset at `path` against its sidecar (`validate --deep`). A dataset in an
/// object store is read once with ranged GETs, block by block, without a local copy.
pub fn verify(path: &Path) -> Result<Verdict> {
    if crate::storage::is_remote(path) {
        return verify_remote(path);
    }
    let (sidecar, base, names) = dataset_files(path)?;
    let Some(sums) = Checksums::read(&sidecar)? else {
        return Ok(Verdict::NoSidecar);
    };
    let mut damage = sums.verify(&base);
    for n in names.iter().filter(|n| !sums.files.contains_key(*n)) {
        let p = base.join(n);
        damage.push(Damage {
            range: 0..fsutil::regular_file_len(&p).unwrap_or(0),
            file: p,
            what: format!("is not covered by {}", sidecar.display()),
        });
    }
    Ok(sums.verdict(damage))
}

/// Bytes of blocks read by one request list of [`verify_remote`] (bounds its memory).
const REMOTE_VERIFY_GROUP: u64 = 256 << 20;

/// [`verify`] of a dataset directory or a container object in a store: the sidecar object,
/// then every block of every file it records, fetched in parallel groups of ranged GETs and
/// hashed on every core; objects the sidecar does not cover are reported as locally.
fn verify_remote(url: &Path) -> Result<Verdict> {
    use crate::storage::Remote;
    let remote = Remote::parse(url)?;
    let below = remote.list()?;
    // A dataset directory: every object below the prefix. Nothing below: a container object
    // (SDNB, shard set, SDZ; also a shard set's base name), with its files and its sidecar
    // beside it (`NAME.checksums.json`, `BASE.shard-set.checksums.json`, or the old shared
    // `BASE.checksums.json` when only that covers it).
    let (base, sidecar, bytes, objects) = if below.is_empty() {
        let (parent, _) = remote.split_last()?;
        let beside = parent.list()?;
        let c = crate::sdnb::open(url)?;
        let files: Vec<String> = c
            .files()
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        let sharded = matches!(c.kind(), crate::sdnb::Kind::Sharded { .. });
        let named = files
            .iter()
            .find(|n| !sharded || crate::sdnb::sdz::parse_shard_name(n).is_some())
            .cloned()
            .unwrap_or_default();
        let (own, old) = container_sidecar_names(&named, sharded);
        let objects: Vec<(String, u64)> = beside
            .into_iter()
            .filter(|(n, _)| files.contains(n))
            .collect();
        let (sidecar, bytes) = match parent.get_opt(&own)? {
            Some(b) => (own, Some(b)),
            None => match parent.get_opt(&old)? {
                Some(b) if legacy_bytes_cover(&b, &parent.url_of(&old), &named, sharded) => {
                    (old, Some(b))
                }
                _ => (own, None),
            },
        };
        (parent, sidecar, bytes, objects)
    } else {
        let objects = below
            .into_iter()
            .filter(|(n, _)| is_data_name(n.rsplit('/').next().unwrap_or(n)))
            .collect();
        let bytes = remote.get_opt(SIDECAR)?;
        (remote, SIDECAR.to_string(), bytes, objects)
    };
    let sidecar_url = base.url_of(&sidecar);
    let Some(bytes) = bytes else {
        return Ok(Verdict::NoSidecar);
    };
    let sums = Checksums::parse(&bytes, &sidecar_url)?;
    let sizes: BTreeMap<&str, u64> = objects.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    let mut damage = Vec::new();
    // Every block present in its object: (file, block, range).
    let names: Vec<String> = sums.files.keys().cloned().collect();
    let mut blocks: Vec<(usize, usize, Range<u64>)> = Vec::new();
    // Per file, the hashes its blocks are checked against (and an alternative while a change
    // replaces it; see Checksums::previous).
    let mut expected: Vec<Option<(&FileSums, Option<&FileSums>)>> = Vec::new();
    for (f, name) in names.iter().enumerate() {
        let file = base.url_of(name);
        let len = sizes.get(name.as_str()).copied();
        expected.push(sums.expected(name, len));
        let Some((s, _)) = expected[f] else {
            continue; // a file that a change in progress creates, not there yet
        };
        let Some(len) = len else {
            damage.push(Damage {
                file,
                range: 0..s.bytes,
                what: "cannot be read: no such object".into(),
            });
            continue;
        };
        if len != s.bytes {
            damage.push(Damage {
                file,
                range: len.min(s.bytes)..len.max(s.bytes),
                what: format!("is {len} bytes; its checksums record {}", s.bytes),
            });
        }
        for b in 0..s.blocks.len() {
            let r = s.block(b);
            if r.end <= len {
                blocks.push((f, b, r));
            }
        }
    }
    let mut group: Vec<(usize, usize, Range<u64>)> = Vec::new();
    let mut group_bytes = 0;
    let mut check = |group: &mut Vec<(usize, usize, Range<u64>)>| -> Result<()> {
        let mut reqs = Vec::with_capacity(group.len());
        let mut dst = 0u64;
        for (f, _, r) in group.iter() {
            reqs.push((*f as u32, r.start, r.end - r.start, dst));
            dst += r.end - r.start;
        }
        let mut buf = vec![0u8; dst as usize];
        base.read_ranges(&names, &reqs, &mut buf)?;
        let bad: Vec<Damage> = group
            .par_iter()
            .zip(&reqs)
            .filter_map(|((f, b, r), &(_, _, len, at))| {
                let data = &buf[at as usize..(at + len) as usize];
                let (s, alt) = expected[*f]?;
                let want = *s.blocks.get(*b)?;
                (!block_matches(xxh3_64(data), want, alt, *b)).then(|| Damage {
                    file: base.url_of(&names[*f]),
                    range: r.clone(),
                    what: "does not match its checksum".into(),
                })
            })
            .collect();
        damage.extend(bad);
        group.clear();
        Ok(())
    };
    for block in blocks {
        let n = block.2.end - block.2.start;
        if !group.is_empty() && group_bytes + n > REMOTE_VERIFY_GROUP {
            check(&mut group)?;
            group_bytes = 0;
        }
        group_bytes += n;
        group.push(block);
    }
    if !group.is_empty() {
        check(&mut group)?;
    }
    for (n, len) in &objects {
        if !sums.files.contains_key(n) {
            damage.push(Damage {
                file: base.url_of(n),
                range: 0..*len,
                what: format!("is not covered by {}", sidecar_url.display()),
            });
        }
    }
    damage.sort_by(|a, b| (&a.file, a.range.start).cmp(&(&b.file, b.range.start)));
    Ok(sums.verdict(damage))
}

/// [`verify`] as findings of `report` (what `validate --deep` adds): an error per damaged range
/// naming its file, or a note that every block matches or that there is no sidecar.
pub fn verify_into(path: &Path, report: &mut crate::report::Validation) {
    match verify(path) {
        Ok(Verdict::NoSidecar) => report.note(
            path,
            "no checksums sidecar, so payload bytes were not verified (add one with `shardkit \
             <format> checksum`)",
        ),
        Ok(Verdict::Intact { files, bytes }) => report.note(
            path,
            format!("checksums: {files} file(s), {bytes} bytes, every block matches"),
        ),
        Ok(Verdict::Damaged(d)) => {
            for x in d {
                report.error(
                    &x.file,
                    format!(
                        "bytes {} to {}: {}",
                        x.range.start,
                        x.range.end.saturating_sub(1),
                        x.what
                    ),
                );
            }
        }
        Err(e) => report.error_from(&e),
    }
}

/// Hashes files as a writer publishes them (while they are still in the page cache), so that
/// finishing the dataset does not read it again.
#[derive(Debug, Default)]
pub(crate) struct Recorder {
    known: BTreeMap<String, FileSums>,
}

impl Recorder {
    /// Hashes `dir/name`, just written; returns its hashes.
    pub(crate) fn add(&mut self, dir: &Path, name: &str) -> Result<FileSums> {
        let s = FileSums::of_file(&dir.join(name))?;
        self.known.insert(name.to_string(), s.clone());
        Ok(s)
    }
    /// Records `name`'s hashes from its bytes (a file about to be written).
    pub(crate) fn add_bytes(&mut self, name: &str, bytes: &[u8]) {
        self.known
            .insert(name.to_string(), FileSums::of_bytes(bytes));
    }
    /// Records `name`'s hashes, known from elsewhere (an upload journal).
    pub(crate) fn insert(&mut self, name: &str, sums: FileSums) {
        self.known.insert(name.to_string(), sums);
    }
    /// Writes the sidecar of the finished dataset at `path`.
    pub(crate) fn finish(&self, path: &Path) -> Result<PathBuf> {
        record_with(path, &self.known)
    }
}

/// Verifies the blocks of a loader's files before they are gathered: a block is hashed when
/// it is first needed, and again whenever it has left the page cache since (so every read from
/// storage is checked, and data that stays in memory is not hashed again each epoch).
#[derive(Debug)]
pub(crate) struct Verifier {
    files: Vec<(PathBuf, FileSums)>,
    /// Per file, per block: 0 unchecked, 2 good, 3 damaged.
    state: Vec<Vec<AtomicU8>>,
}

impl Verifier {
    /// A verifier of `files` (paths below `base`, in the loader's file order) from the sidecar
    /// at `sidecar`; an error when there is none or it misses one of them.
    pub(crate) fn open(sidecar: &Path, base: &Path, files: &[String]) -> Result<Verifier> {
        let sums = Checksums::read(sidecar)?.ok_or_else(|| Error::NotFound {
            path: sidecar.to_path_buf(),
            what: "verify was asked for but the dataset has no checksums sidecar; add one with \
                   `shardkit <format> checksum PATH`"
                .into(),
        })?;
        let files = files
            .iter()
            .map(|n| {
                let path = base.join(n);
                // A file a change left in flight (see Checksums::previous) is checked against
                // the state its length matches.
                sums.expected(n, fsutil::regular_file_len(&path))
                    .map(|(s, _)| (path, s.clone()))
                    .ok_or_else(|| Error::format(sidecar, format!("has no checksums for {n:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let state = files
            .iter()
            .map(|(_, s)| (0..s.blocks.len()).map(|_| AtomicU8::new(0)).collect())
            .collect();
        Ok(Verifier { files, state })
    }

    /// The blocks of file `i` that `range` touches, as (file, block) pairs.
    pub(crate) fn blocks(
        &self,
        i: usize,
        range: Range<u64>,
    ) -> impl Iterator<Item = (usize, usize)> {
        self.files[i].1.blocks_of(range).map(move |b| (i, b))
    }

    /// Whether block `b` of file `i` must be hashed before use: never checked, or no longer
    /// wholly in the page cache (`whole` is the file's map).
    pub(crate) fn needs(&self, i: usize, b: usize, whole: &[u8]) -> bool {
        if self.state[i][b].load(Ordering::Acquire) != 2 {
            return true;
        }
        let r = self.files[i].1.block(b);
        whole
            .get(r.start as usize..r.end as usize)
            .is_none_or(|bytes| !crate::engine::reader::resident(bytes))
    }

    /// Hashes block `b` of file `i` (`whole` is the file's map): an error naming the file and
    /// the byte range when it does not match.
    pub(crate) fn check_block(&self, i: usize, b: usize, whole: &[u8]) -> Result<()> {
        let (path, sums) = &self.files[i];
        if whole.len() as u64 != sums.bytes {
            return Err(Error::format(
                path,
                format!(
                    "is {} bytes; its checksums record {}: the file changed",
                    whole.len(),
                    sums.bytes
                ),
            ));
        }
        let r = sums.block(b);
        let good = xxh3_64(&whole[r.start as usize..r.end as usize]) == sums.blocks[b];
        self.state[i][b].store(if good { 2 } else { 3 }, Ordering::Release);
        if good {
            Ok(())
        } else {
            Err(Error::format(
                path,
                format!(
                    "bytes {} to {} do not match their checksum: the file is damaged (restore \
                     it from a good copy)",
                    r.start,
                    r.end.saturating_sub(1)
                ),
            ))
        }
    }

    /// Checks every block `touched` ((file, block) pairs, any order, repeats allowed) that
    /// [`Verifier::needs`] it, in parallel on `pool`; `map(i)` is file `i`'s map.
    pub(crate) fn ensure<'m>(
        &self,
        touched: impl IntoIterator<Item = (usize, usize)>,
        map: impl Fn(usize) -> Result<&'m [u8]> + Sync,
        pool: &rayon::ThreadPool,
    ) -> Result<()> {
        let mut todo: Vec<(usize, usize)> = touched.into_iter().collect();
        todo.sort_unstable();
        todo.dedup();
        let mut work = Vec::new();
        for (i, b) in todo {
            if self.needs(i, b, map(i)?) {
                work.push((i, b));
            }
        }
        pool.install(|| {
            work.par_iter()
                .try_for_each(|&(i, b)| self.check_block(i, b, map(i)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_powers_of_two_with_at_most_4096_blocks() {
        assert_eq!(block_bytes_for(0), MIN_BLOCK);
        assert_eq!(block_bytes_for(10 << 30), 4 << 20);
        for len in [1u64, 1 << 20, (1 << 32) + 5, u64::MAX] {
            let b = block_bytes_for(len);
            assert!(b.is_power_of_two() && b >= MIN_BLOCK);
            assert!(len.div_ceil(b) <= MAX_BLOCKS, "{len}");
        }
    }

    #[test]
    fn a_flipped_bit_is_found_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3 * MIN_BLOCK + 7)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        std::fs::write(dir.path().join("a.bin"), &data).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b.json"), b"{}").unwrap();
        std::fs::write(dir.path().join(".x.tmp"), b"temp").unwrap();
        let sidecar = record(dir.path()).unwrap();
        assert_eq!(sidecar, dir.path().join(SIDECAR));
        let sums = Checksums::read(&sidecar).unwrap().unwrap();
        assert_eq!(
            sums.files.keys().collect::<Vec<_>>(),
            ["a.bin", "sub/b.json"]
        );
        assert_eq!(sums.files["a.bin"], FileSums::of_bytes(&data));
        assert!(matches!(
            verify(dir.path()).unwrap(),
            Verdict::Intact { files: 2, .. }
        ));

        let mut bad = data.clone();
        bad[2 * MIN_BLOCK as usize + 3] ^= 0x10;
        std::fs::write(dir.path().join("a.bin"), &bad).unwrap();
        let Verdict::Damaged(d) = verify(dir.path()).unwrap() else {
            panic!()
        };
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].file, dir.path().join("a.bin"));
        assert_eq!(d[0].range, 2 * MIN_BLOCK..3 * MIN_BLOCK);
        assert!(d[0].to_string().contains("does not match its checksum"));

        // The verifier a loader uses finds the same block, and only when it is read.
        let v = Verifier::open(&sidecar, dir.path(), &["a.bin".into()]).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let map = |_| Ok(&bad[..]);
        v.ensure(v.blocks(0, 0..MIN_BLOCK), map, &pool).unwrap();
        // Checked and still in memory: not hashed again.
        assert!(!v.needs(0, 0, &bad));
        assert!(v.needs(0, 1, &bad));
        let e = v
            .ensure(
                v.blocks(0, 2 * MIN_BLOCK + 1..2 * MIN_BLOCK + 2),
                map,
                &pool,
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("a.bin")
                && e.to_string()
                    .contains("bytes 2097152 to 3145727 do not match"),
            "{e}"
        );

        // Truncation and an uncovered file.
        std::fs::write(dir.path().join("a.bin"), &data[..100]).unwrap();
        std::fs::write(dir.path().join("new.bin"), b"x").unwrap();
        let Verdict::Damaged(d) = verify(dir.path()).unwrap() else {
            panic!()
        };
        assert!(d.iter().any(|x| x.what.contains("is 100 bytes")), "{d:?}");
        assert!(d
            .iter()
            .any(|x| x.file.ends_with("new.bin") && x.what.contains("not covered")));
    }

    /// Every instant of a [`Change`] verifies: before `begin`, between `begin` and the data
    /// change (a kill there leaves old data), between the data change and `commit` (new data),
    /// and after; a leftover `previous` is settled by the next change, and a block damaged
    /// meanwhile is still reported.
    #[test]
    fn a_change_verifies_at_every_instant_a_kill_could_stop_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let big: Vec<u8> = (0..3 * MIN_BLOCK).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(d.join("big.bin"), &big).unwrap();
        std::fs::write(d.join("m.json"), b"{\"v\": 1}").unwrap();
        record(d).unwrap();
        let sidecar = d.join(SIDECAR);
        let intact =
            |files| matches!(verify(d).unwrap(), Verdict::Intact { files: n, .. } if n == files);

        // A whole-file replacement (EAGLE-3's manifest), killed after `begin`.
        let change = Change::begin(&sidecar, d, |_| {
            Ok(vec![(
                "m.json".into(),
                FileSums::of_bytes(b"{\"v\": 2, \"x\": 0}"),
            )])
        })
        .unwrap()
        .unwrap();
        let during = Checksums::read(&sidecar).unwrap().unwrap();
        assert_eq!(during.previous.len(), 1, "{during:?}");
        assert!(intact(2), "old data, sidecar accepting both");
        fsutil::atomic_write(&d.join("m.json"), b"{\"v\": 2, \"x\": 0}").unwrap();
        assert!(intact(2), "new data, sidecar accepting both");
        drop(change); // killed before commit
                      // The leftover is settled by the next change: an in-place patch of the big file.
        let patch = vec![0xAAu8; 100];
        let at = MIN_BLOCK + 10;
        let change = Change::begin(&sidecar, d, |sums| {
            let p = sums.files["big.bin"].patched(&d.join("big.bin"), &[(at, &patch)])?;
            Ok(vec![("big.bin".into(), p)])
        })
        .unwrap()
        .unwrap();
        let during = Checksums::read(&sidecar).unwrap().unwrap();
        assert_eq!(during.previous.keys().collect::<Vec<_>>(), ["big.bin"]);
        assert_eq!(
            during.files["m.json"],
            FileSums::of_bytes(b"{\"v\": 2, \"x\": 0}")
        );
        assert!(intact(2));
        let mut new_big = big.clone();
        new_big[at as usize..at as usize + 100].copy_from_slice(&patch);
        std::fs::write(d.join("big.bin"), &new_big).unwrap();
        assert!(intact(2));
        change.commit().unwrap();
        let after = Checksums::read(&sidecar).unwrap().unwrap();
        assert!(after.previous.is_empty());
        assert_eq!(after.files["big.bin"], FileSums::of_bytes(&new_big));
        assert!(intact(2));
        // The sidecar text has the three keys of version 1 once settled.
        let text = std::fs::read_to_string(&sidecar).unwrap();
        assert!(!text.contains("previous"), "{text}");

        // A file created by a change (EAGLE-3's embeddings) may be absent until the rename.
        let change = Change::begin(&sidecar, d, |_| {
            Ok(vec![("new.bin".into(), FileSums::of_bytes(b"fresh"))])
        })
        .unwrap()
        .unwrap();
        let text = std::fs::read_to_string(&sidecar).unwrap();
        assert!(
            text.contains("\"previous\": {\n  \"new.bin\": null"),
            "{text}"
        );
        assert!(intact(3));
        std::fs::write(d.join("new.bin"), b"fresh").unwrap();
        assert!(intact(3));
        change.commit().unwrap();
        assert!(intact(3));

        // Damage is never settled into the sidecar: a flipped bit in a block the patch does
        // not touch stays reported, and one in a block it touches refuses the patch.
        let mut bad = new_big.clone();
        bad[10] ^= 1;
        std::fs::write(d.join("big.bin"), &bad).unwrap();
        let e = Change::begin(&sidecar, d, |sums| {
            let p = sums.files["big.bin"].patched(&d.join("big.bin"), &[(5, &patch[..4])])?;
            Ok(vec![("big.bin".into(), p)])
        })
        .unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("bytes 0 to 1048575 do not match their checksum"),
            "{e}"
        );
        let change = Change::begin(&sidecar, d, |sums| {
            let p = sums.files["big.bin"].patched(&d.join("big.bin"), &[(at, &patch[..4])])?;
            Ok(vec![("big.bin".into(), p)])
        })
        .unwrap()
        .unwrap();
        change.commit().unwrap();
        let Verdict::Damaged(dmg) = verify(d).unwrap() else {
            panic!("damage hidden")
        };
        assert_eq!(dmg.len(), 1);
        assert_eq!(dmg[0].range, 0..MIN_BLOCK);
        // A sidecar whose `previous` names a file `files` does not is refused.
        std::fs::write(
            &sidecar,
            r#"{"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {}, "previous": {"a": null}}"#,
        )
        .unwrap();
        let e = Checksums::read(&sidecar).unwrap_err().to_string();
        assert!(e.contains("previous[\"a\"]") && e.contains(SIDECAR), "{e}");
    }

    #[test]
    fn container_sidecars_are_named_per_container_and_old_names_are_read() {
        assert_eq!(
            container_sidecar_names("m.sdnb", false),
            ("m.sdnb.checksums.json".into(), "m.checksums.json".into())
        );
        assert_eq!(
            container_sidecar_names("m.sdz", false),
            ("m.sdz.checksums.json".into(), "m.checksums.json".into())
        );
        for name in ["m.sdnb", "m.shard0-of-3.sdnb", "m"] {
            assert_eq!(
                container_sidecar_names(name, true),
                (
                    "m.shard-set.checksums.json".into(),
                    "m.checksums.json".into()
                )
            );
        }
        let doc = |names: &[&str]| {
            let mut c = Checksums::default();
            for n in names {
                c.files.insert(n.to_string(), FileSums::of_bytes(b"x"));
            }
            document_bytes(c.to_json())
        };
        let at = Path::new("m.checksums.json");
        assert!(legacy_bytes_cover(&doc(&["m.sdnb"]), at, "m.sdnb", false));
        assert!(!legacy_bytes_cover(&doc(&["m.sdnb"]), at, "m.sdz", false));
        let set = doc(&["m.shard0-of-2.sdnb", "m.shard1-of-2.sdnb"]);
        assert!(legacy_bytes_cover(&set, at, "m.sdnb", true));
        assert!(legacy_bytes_cover(&set, at, "m.shard1-of-2.sdnb", true));
        assert!(!legacy_bytes_cover(&set, at, "m.sdnb", false));
        assert!(!legacy_bytes_cover(&doc(&[]), at, "m.sdnb", false));
    }

    #[test]
    fn an_upload_journal_round_trips_its_files_and_facts() {
        let mut j = Journal::default();
        j.files
            .files
            .insert("acts000000.bin".into(), FileSums::of_bytes(&[7u8; 3000]));
        j.set_fact("labels", Value::Bool(true));
        j.set_fact("labels", Value::Bool(false)); // replaced, not repeated
        j.set_fact("manifest", Value::String("{\"a\": 1}".into()));
        let path = Path::new("s3://b/d/.shardkit-upload.json");
        let back = Journal::parse(&j.to_bytes(), path).unwrap();
        assert_eq!(back, j);
        assert_eq!(back.fact("labels"), Some(&Value::Bool(false)));
        assert_eq!(back.fact("missing"), None);
        // A journal is a sidecar document: the same rules, and errors name it.
        for bad in [&b"[1]"[..], b"{}", b"not json"] {
            let e = Journal::parse(bad, path).unwrap_err().to_string();
            assert!(e.contains(".shardkit-upload.json"), "{e}");
        }
    }

    #[test]
    fn hostile_sidecars_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(SIDECAR);
        for (text, rule) in [
            (r#"{"shardkit_checksums": 2}"#, "version 1"),
            (
                r#"{"shardkit_checksums": 1, "algorithm": "md5"}"#,
                "xxh3-64",
            ),
            (
                r#"{"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {"../x": {}}}"#,
                "not a path below",
            ),
            (
                r#"{"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {"a": {"bytes": 5, "block_bytes": 3, "xxh3": []}}}"#,
                "power of two",
            ),
            (
                r#"{"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {"a": {"bytes": 5, "block_bytes": 1048576, "xxh3": []}}}"#,
                "0 hashes for 5 bytes",
            ),
            (
                r#"{"shardkit_checksums": 1, "algorithm": "xxh3-64", "files": {"a": {"bytes": 18446744073709551615, "block_bytes": 1, "xxh3": []}}}"#,
                "hashes for",
            ),
        ] {
            std::fs::write(&p, text).unwrap();
            let e = Checksums::read(&p).unwrap_err();
            assert!(matches!(e, Error::Format { .. }), "{e:?}");
            assert!(
                e.to_string().contains(SIDECAR) && e.to_string().contains(rule),
                "{e}"
            );
        }
    }
}
