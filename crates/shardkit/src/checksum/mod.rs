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

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::json::{self, Escape, Value};

mod container;
mod journal;
mod verify;

#[cfg(feature = "zarr")]
pub(crate) use container::dataset_files;
#[cfg(test)]
pub(crate) use container::{container_sidecar_names, legacy_bytes_cover};
pub(crate) use container::{
    locate_container, put_back_sidecars, record_with, take_container_sidecars, Container, Naming,
};
pub use container::{record, Recorded};
pub(crate) use journal::Journal;
pub(crate) use verify::Verifier;
pub use verify::{verify, verify_into, Verdict};

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
pub(crate) struct FileSums {
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
    pub(crate) fn block(&self, i: usize) -> Range<u64> {
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
pub(crate) struct Checksums {
    /// Every file covered.
    pub files: BTreeMap<String, FileSums>,
    /// Files that a change in progress (or one a kill interrupted) is replacing: the state each
    /// had before (None: it did not exist). Such a file verifies against either state.
    pub previous: BTreeMap<String, Option<FileSums>>,
}

impl Checksums {
    /// Reads a sidecar (None when there is none).
    pub(crate) fn read(path: &Path) -> Result<Option<Checksums>> {
        let bytes = match fsutil::read_json_file(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        Checksums::parse(&bytes, path).map(Some)
    }

    /// Parses a sidecar's bytes (`path` names it in errors).
    pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Checksums> {
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
    pub(crate) fn write(&self, path: &Path) -> Result<()> {
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
    pub(crate) fn verify(&self, base: &Path) -> Vec<Damage> {
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
        let sidecar = record(dir.path()).unwrap().sidecar;
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
