//! Which files a dataset is made of, and where its sidecar lives.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::{remove_sidecar, Checksums, FileSums, SIDECAR};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// What checksums ask of a container format: a dataset made of files that sit beside others
/// in a directory (an SDNB file, an archive, a shard set) rather than of a directory of its own.
/// Checksums never open a format; the crate root says which container is at a path
/// ([`crate::open_container`]).
pub(crate) trait Container {
    /// The path it was opened from (named in errors).
    fn path(&self) -> &Path;
    /// The files it is made of, in order (for a container in a store, URLs whose last
    /// component is the object's name).
    fn files(&self) -> Vec<PathBuf>;
    /// Whether its files are a shard set (one sidecar covers the set).
    fn sharded(&self) -> bool;
    /// How its format names files.
    fn naming(&self) -> &'static dyn Naming;
}

/// How a container format names its files, as far as sidecars are named after them.
pub(crate) trait Naming {
    /// Whether `name` is one shard's file of a shard set.
    fn is_shard(&self, name: &str) -> bool;
    /// The base name the containers a file named `name` belongs to share (`m` of `m.sdnb`,
    /// `m.sdz` and `m.shard0-of-2.sdnb`).
    fn base<'a>(&self, name: &'a str) -> &'a str;
}

/// Where the sidecar of the dataset at `path` lives, the directory its names are relative to,
/// and the dataset's files (relative names). A directory is every regular file below it but
/// the sidecar, writers' temporaries and lock files; anything else is an SDNB container (a
/// file, an archive, a shard file or a shard set's base name), whose files are its parts. The sidecar is the one in use: the container's own, or one
/// an earlier version wrote under the old shared name when only it covers the container.
pub(crate) fn dataset_files(path: &Path) -> Result<(PathBuf, PathBuf, Vec<String>)> {
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
    let path = &match crate::io::Location::parse(path) {
        Ok(crate::io::Location::Local(dir)) => dir,
        _ => {
            return Err(Error::Invalid(format!(
                "{}: checksums are recorded on local files (a writer given a URL records them \
             before it uploads); to add them to a dataset in a store, download it, run \
             `checksum`, and upload it again",
                path.display()
            )))
        }
    };
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
    let c = crate::open_container(path)?;
    locate_container(&*c)
}

/// [`locate`] for a container already open (local).
pub(crate) fn locate_container(c: &dyn Container) -> Result<Located> {
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
    let (sharded, naming) = (c.sharded(), c.naming());
    let named = match sharded {
        true => names
            .iter()
            .find(|n| naming.is_shard(n))
            .unwrap_or(&names[0]),
        false => &names[0],
    };
    let (own, old) = container_sidecar_names(naming, named, sharded);
    let fresh = dir.join(&own);
    let legacy = (old != own)
        .then(|| dir.join(&old))
        .filter(|p| legacy_covers(naming, p, named, sharded));
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
pub(crate) fn container_sidecar_names(
    naming: &dyn Naming,
    name: &str,
    sharded: bool,
) -> (String, String) {
    let base = naming.base(name);
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
pub(crate) fn legacy_bytes_cover(
    naming: &dyn Naming,
    bytes: &[u8],
    at: &Path,
    name: &str,
    sharded: bool,
) -> bool {
    let Ok(sums) = Checksums::parse(bytes, at) else {
        return false;
    };
    let base = naming.base(name);
    !sums.files.is_empty()
        && sums.files.keys().all(|k| match sharded {
            true => naming.is_shard(k) && naming.base(k) == base,
            false => k == name,
        })
}

/// Before the container `dir/name` (a shard set when `sharded`: `name` is its base name or a
/// shard's) is written anew: removes its sidecars (its own, and one of the old shared name
/// that covers it), so that none outlives the overwrite as a stale record; a kill before the
/// new one is written leaves the container without a sidecar, which `validate --deep` notes
/// and saving again adds. Returns what was removed, for [`put_back_sidecars`].
pub(crate) fn take_container_sidecars(
    naming: &dyn Naming,
    dir: &Path,
    name: &str,
    sharded: bool,
) -> Result<Vec<(PathBuf, Vec<u8>)>> {
    let (own, old) = container_sidecar_names(naming, name, sharded);
    let mut taken = Vec::new();
    let mut paths = vec![dir.join(&own)];
    if old != own && legacy_covers(naming, &dir.join(&old), name, sharded) {
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
pub(crate) fn legacy_covers(naming: &dyn Naming, p: &Path, name: &str, sharded: bool) -> bool {
    match fsutil::read_json_file(p) {
        Ok(bytes) => legacy_bytes_cover(naming, &bytes, p, name, sharded),
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
pub(super) fn is_data_name(leaf: &str) -> bool {
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

/// What [`record`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recorded {
    /// The sidecar.
    pub sidecar: PathBuf,
    /// The files it covers, relative to the sidecar's directory, sorted.
    pub files: Vec<String>,
    /// Their bytes, all together.
    pub bytes: u64,
}

/// Hashes every file of the dataset at `path` (a directory or an SDNB container) into its
/// sidecar: `shardkit <format> checksum`.
pub fn record(path: &Path) -> Result<Recorded> {
    let sidecar = record_with(path, &BTreeMap::new())?;
    let sums = Checksums::read(&sidecar)?.unwrap_or_default();
    Ok(Recorded {
        bytes: sums.files.values().map(|s| s.bytes).sum(),
        files: sums.files.into_keys().collect(),
        sidecar,
    })
}
