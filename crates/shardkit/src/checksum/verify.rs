//! Checking a dataset against its sidecar: whole (`validate --deep`) or block by block as a
//! loader reads.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use super::container::{container_sidecar_names, dataset_files, is_data_name, legacy_bytes_cover};
use super::{block_matches, Checksums, Damage, FileSums, SIDECAR};
use crate::error::{Error, Result};
use crate::fsutil;

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
    let at = crate::io::Location::parse(path)?;
    if !at.is_local() {
        return verify_remote(&at, path);
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
fn verify_remote(at: &crate::io::Location, url: &Path) -> Result<Verdict> {
    use crate::io::Remote;
    let remote = Remote::from_location(at)?;
    let below = remote.list()?;
    // A dataset directory: every object below the prefix. Nothing below: a container object
    // (SDNB, shard set, SDZ; also a shard set's base name), with its files and its sidecar
    // beside it (`NAME.checksums.json`, `BASE.shard-set.checksums.json`, or the old shared
    // `BASE.checksums.json` when only that covers it).
    let (base, sidecar, bytes, objects) = if below.is_empty() {
        let (parent, _) = remote.split_last()?;
        let beside = parent.list()?;
        let c = crate::open_container(url)?;
        let files: Vec<String> = c
            .files()
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        let (sharded, naming) = (c.sharded(), c.naming());
        let named = files
            .iter()
            .find(|n| !sharded || naming.is_shard(n))
            .cloned()
            .unwrap_or_default();
        let (own, old) = container_sidecar_names(naming, &named, sharded);
        let objects: Vec<(String, u64)> = beside
            .into_iter()
            .filter(|(n, _)| files.contains(n))
            .collect();
        let (sidecar, bytes) = match parent.get_opt(&own)? {
            Some(b) => (own, Some(b)),
            None => match parent.get_opt(&old)? {
                Some(b)
                    if legacy_bytes_cover(naming, &b, &parent.url_of(&old), &named, sharded) =>
                {
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
            .is_none_or(|bytes| !crate::io::local::resident(bytes))
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
