//! Whole datasets copied between a local directory and a store ([`upload`], [`download`]), the
//! commit records last.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use object_store::ObjectStoreExt;

use super::staged::Streaming;
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::buffer::Buffer;
use crate::io::runtime::block_on;
use crate::io::store::PART_SIZE;
use crate::io::{inflight, local_path, max_request, Location, ReadRange, Remote};

/// Files of a dataset written last, deepest first, then in this order: their presence says the
/// dataset is whole (a zarr group's documents, whose root attributes carry flat-tokens'
/// `write_completed`; EAGLE-3's manifest.json; saev's shards.json).
const COMMIT_RECORDS: [&str; 5] = [
    ".zgroup",
    ".zattrs",
    "zarr.json",
    "manifest.json",
    "shards.json",
];

fn is_commit_record(name: &str) -> bool {
    COMMIT_RECORDS.contains(&name.rsplit('/').next().unwrap_or(name))
}

/// Names a local writer leaves that are not part of the dataset (locks, markers, temporaries,
/// and whatever lies below a `.shardkit-*` directory, such as a checkpoint's chunks).
pub(crate) fn is_private(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    name.split('/').any(|c| c.starts_with(".shardkit-"))
        || base.ends_with(".tmp")
        || base.contains(".tmp.")
        || base.starts_with(".shardkit-")
        || base.ends_with(".lock")
        || base.ends_with(".pending")
}

/// The ETag S3 gives local file `path` (`len` bytes) uploaded by [`Remote::put_file`]: the MD5
/// of a single PUT, or for a multipart upload the MD5 of its parts' MD5s and `-parts`. An
/// object whose ETag differs (another writer's, or a store that computes ETags otherwise) is
/// uploaded again rather than trusted.
fn upload_etag(path: &Path, len: u64) -> Result<String> {
    use md5::{Digest, Md5};
    use std::io::Read;
    let mut f = std::fs::File::open(path).at(path)?;
    let mut part = vec![0u8; PART_SIZE.min(len as usize).max(1)];
    let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    if len <= PART_SIZE as u64 {
        f.read_exact(&mut part[..len as usize]).at(path)?;
        return Ok(hex(Md5::digest(&part[..len as usize]).as_slice()));
    }
    let mut parts = Md5::new();
    let mut done = 0u64;
    let mut count = 0;
    while done < len {
        let n = ((len - done) as usize).min(PART_SIZE);
        f.read_exact(&mut part[..n]).at(path)?;
        parts.update(Md5::digest(&part[..n]).as_slice());
        done += n as u64;
        count += 1;
    }
    Ok(format!("{}-{count}", hex(parts.finalize().as_slice())))
}

/// What [`upload`] and [`download`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfer {
    /// Objects (files) copied.
    pub copied: u64,
    /// Objects already present at the destination with the same size, skipped.
    pub skipped: u64,
    /// Bytes copied.
    pub bytes: u64,
}

/// The files under `dir`, relative, with sizes, sorted; the commit records at top level last.
pub(crate) fn local_files(dir: &Path) -> Result<Vec<(String, u64)>> {
    walk_files(dir, false)
}

/// [`local_files`] of a staging directory that [`Streaming`]'s upload threads shrink while it is
/// listed (each removes a file's staged copy once the store holds it): a file removed between
/// being listed and being looked at is left out, as it is in the store. Elsewhere a file that
/// vanishes mid-walk is an error: the dataset changed while it was being read.
pub(crate) fn staged_files(dir: &Path) -> Result<Vec<(String, u64)>> {
    walk_files(dir, true)
}

fn walk_files(dir: &Path, skip_removed: bool) -> Result<Vec<(String, u64)>> {
    let mut out = crate::io::local::walk(dir, skip_removed)?;
    out.retain(|(n, _)| !is_private(n));
    sort_commit_last(&mut out);
    Ok(out)
}

pub(crate) fn sort_commit_last(files: &mut [(String, u64)]) {
    let key = |n: &str| {
        let base = n.rsplit('/').next().unwrap_or(n);
        if n == "metadata.json" {
            // saev's configuration first: a partial upload then reads as an incomplete
            // dataset (what is missing), not as no dataset at all.
            return (0, 0, 0);
        }
        match COMMIT_RECORDS.iter().position(|c| *c == base) {
            None => (1, 0, 0),
            Some(i) => (2, usize::MAX - n.matches('/').count(), i + 1),
        }
    };
    files.sort_by(|a, b| (key(&a.0), &a.0).cmp(&(key(&b.0), &b.0)));
}

/// The store prefix `url` names; a local path is refused.
fn store_at(url: &Path) -> Result<Remote> {
    match Location::parse(url)? {
        Location::Local(_) => Err(crate::io::not_a_store(url)),
        store => Remote::from_location(&store),
    }
}

/// Copies the dataset in local directory `src` to `dst` (`s3://bucket/prefix`), crash-safely
/// and resumably: every data object first (those already present at the same size are
/// skipped, so a rerun after a kill continues where it stopped), then the commit record
/// (shards.json, manifest.json, the root zarr.json/.zgroup), so a reader never sees a dataset
/// that is not whole. A destination whose commit record differs from the source's is refused.
///
/// A single file (an SDNB or SDZ container) is uploaded as the one object `dst`. Data files go
/// up several at a time (`SHARDKIT_S3_INFLIGHT` / 8 of them, 2 to 16), each a multipart upload
/// when large.
pub fn upload(src: &Path, dst: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Transfer> {
    let src = local_path(src);
    let remote = store_at(dst)?;
    if src.is_file() {
        let (parent, name) = remote.split_last()?;
        let len = std::fs::metadata(&src).at(&src)?.len();
        parent.put_file(&name, &src)?;
        progress(len, len);
        return Ok(Transfer {
            copied: 1,
            skipped: 0,
            bytes: len,
        });
    }
    if !src.is_dir() {
        return Err(Error::NotFound {
            path: src,
            what: "not a directory or file; expected a dataset to upload".into(),
        });
    }
    let files = local_files(&src)?;
    let present: HashMap<String, (u64, Option<String>)> = remote
        .list_etags()?
        .into_iter()
        .map(|(n, size, etag)| (n, (size, etag)))
        .collect();
    for (name, _) in files.iter().filter(|(n, _)| is_commit_record(n)) {
        if present.contains_key(name) {
            let theirs = remote.get(name)?;
            let ours = std::fs::read(src.join(name)).at(src.join(name))?;
            if theirs != ours {
                return Err(Error::Exists {
                    path: remote.url_of(name),
                    why: "holds a different dataset's commit record; upload to another prefix \
                          or delete the objects first"
                        .into(),
                });
            }
        }
    }
    let total: u64 = files.iter().map(|(_, n)| n).sum();
    let mut t = Transfer::default();
    let mut done = 0u64;
    // One file: uploaded unless the store holds it already (same size and ETag).
    let put = |name: &str, len: u64| -> Result<bool> {
        let same = match present.get(name) {
            Some((size, Some(etag))) if *size == len && !is_commit_record(name) => {
                *etag == upload_etag(&src.join(name), len)?
            }
            _ => false,
        };
        if !same {
            remote.put_file(name, &src.join(name))?;
        }
        Ok(!same)
    };
    let mut tally = |len: u64, copied: bool| {
        if copied {
            t.copied += 1;
            t.bytes += len;
        } else {
            t.skipped += 1;
        }
        done += len;
        progress(done, total);
    };
    // saev's metadata.json first, then the data files several at a time (each a multipart
    // upload with its own parts in flight), then the commit records one by one, in order.
    let (commit, data): (Vec<_>, Vec<_>) = files.iter().partition(|(n, _)| is_commit_record(n));
    let (first, data): (Vec<_>, Vec<_>) = data.into_iter().partition(|(n, _)| n == "metadata.json");
    for (name, len) in first {
        tally(*len, put(name, *len)?);
    }
    let workers = Streaming::workers().min(data.len().max(1));
    let next = AtomicUsize::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel::<Result<(u64, bool)>>();
    let failed = std::thread::scope(|scope| {
        for _ in 0..workers {
            let tx = tx.clone();
            let (next, stop, data, put) = (&next, &stop, &data, &put);
            scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Some((name, len)) = data.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    let r = put(name, *len).map(|copied| (*len, copied));
                    stop.fetch_or(r.is_err(), Ordering::Relaxed);
                    if tx.send(r).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut failed = None;
        for r in rx {
            match r {
                Ok((len, copied)) => tally(len, copied),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed
    });
    if let Some(e) = failed {
        return Err(e);
    }
    for (name, len) in commit {
        tally(*len, put(name, *len)?);
    }
    Ok(t)
}

/// Copies the dataset at `src` (`s3://bucket/prefix`) into local directory `dst`: every object
/// (files already present at the same size are kept), each written atomically, the commit
/// record last, so an interrupted download is an incomplete dataset that readers refuse and a
/// rerun completes. Objects are read in bounded windows of parallel ranged GETs
/// ([`inflight`] × [`max_request`] bytes). A `src` naming one object (a container file) is
/// copied into the file `dst`.
pub fn download(src: &Path, dst: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Transfer> {
    let remote = store_at(src)?;
    let dst = local_path(dst);
    let mut objects = remote.list()?;
    if objects.is_empty() {
        // One object (a container file) rather than a prefix.
        let (parent, name) = remote.split_last()?;
        let store = parent.store()?;
        let size = match block_on(store.head(&parent.key(&name)))? {
            Ok(meta) => meta.size,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::NotFound {
                    path: PathBuf::from(remote.url()),
                    what: "no such object, and no objects under this prefix".into(),
                })
            }
            Err(e) => return Err(parent.error(&name, None, e)),
        };
        let leaf = PathBuf::from(&name);
        let into = fsutil::parent_of(&dst).to_path_buf();
        let as_name = dst.file_name().map_or_else(|| leaf.clone(), PathBuf::from);
        fetch_files(&parent, &[(name, size)], &into, Some(&as_name), |n| {
            progress(n, size)
        })?;
        return Ok(Transfer {
            copied: 1,
            skipped: 0,
            bytes: size,
        });
    }
    objects.retain(|(n, _)| !is_private(n));
    sort_commit_last(&mut objects);
    let total: u64 = objects.iter().map(|(_, n)| n).sum();
    let mut t = Transfer::default();
    let mut skipped_bytes = 0u64;
    objects.retain(|(name, len)| {
        let keep =
            is_commit_record(name) || fsutil::regular_file_len(&dst.join(name)) != Some(*len);
        if !keep {
            t.skipped += 1;
            skipped_bytes += len;
        }
        keep
    });
    progress(skipped_bytes, total);
    fetch_files(&remote, &objects, &dst, None, |n| {
        progress(skipped_bytes + n, total)
    })?;
    t.copied = objects.len() as u64;
    t.bytes = objects.iter().map(|(_, n)| n).sum();
    Ok(t)
}

/// Copies `objects` (name, size) of `remote` into files below `dst` (or, for one object, into
/// `dst/as_name`): each written under a temporary name and published (fsync, rename) once
/// whole, in the order given. They are read in windows of `inflight · max_request` bytes (several
/// small objects per window, a large one over several): a window's ranged GETs run in parallel,
/// and the next window's while this one is written out, so memory stays at two windows however
/// large the objects. `done` gets the bytes copied so far after each window.
fn fetch_files(
    remote: &Remote,
    objects: &[(String, u64)],
    dst: &Path,
    as_name: Option<&Path>,
    mut done: impl FnMut(u64),
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let windows = windows_of(
        objects,
        (inflight() as u64 * max_request()).max(max_request()),
    );
    let names = Arc::new(objects.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>());
    let start = |w: &Vec<ReadRange>| {
        let bytes = w.iter().map(|r| r.dst + r.len).max().unwrap_or(0);
        let ranges = w.iter().filter(|r| r.len > 0).cloned().collect();
        remote.start_read(names.clone(), ranges, Buffer::zeroed(bytes as usize), None)
    };
    let path_of = |i: usize| match as_name {
        Some(n) => dst.join(n),
        None => dst.join(&objects[i].0),
    };
    let mut open: HashMap<usize, (std::fs::File, PathBuf)> = HashMap::new();
    let mut copied = 0u64;
    let mut pending = windows.first().map(start).transpose()?;
    for (k, window) in windows.iter().enumerate() {
        let next = windows.get(k + 1).map(start).transpose()?;
        let buf = match pending.take() {
            Some(p) => p.wait(|| false)?,
            None => break,
        };
        pending = next;
        for r in window {
            let i = r.file as usize;
            let path = path_of(i);
            let (file, tmp) = match open.entry(i) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let parent = fsutil::parent_of(&path).to_path_buf();
                    std::fs::create_dir_all(&parent).at(&parent)?;
                    let tmp = fsutil::temp_sibling(&path);
                    let f = std::fs::File::create(&tmp).at(&tmp)?;
                    e.insert((f, tmp))
                }
            };
            let piece = &buf.as_bytes()[r.dst as usize..(r.dst + r.len) as usize];
            file.write_all_at(piece, r.offset).at(&*tmp)?;
            if r.offset + r.len == objects[i].1 {
                if let Some((file, tmp)) = open.remove(&i) {
                    file.sync_all().at(&tmp)?;
                    drop(file);
                    fsutil::publish(&tmp, &path)?;
                }
            }
            copied += r.len;
        }
        done(copied);
    }
    Ok(())
}

/// `objects` (name, size) cut into windows of at most `window` bytes, in order: each piece is
/// (object, offset, len, place in the window's buffer). Empty objects get an empty piece.
pub(crate) fn windows_of(objects: &[(String, u64)], window: u64) -> Vec<Vec<ReadRange>> {
    let mut out = Vec::new();
    let (mut next, mut offset) = (0usize, 0u64);
    while next < objects.len() {
        let (mut pieces, mut bytes) = (Vec::new(), 0u64);
        while next < objects.len() && bytes < window {
            let size = objects[next].1;
            let len = (size - offset).min(window - bytes);
            pieces.push(ReadRange {
                file: next as u32,
                offset,
                len,
                dst: bytes,
            });
            bytes += len;
            offset += len;
            if offset == size {
                next += 1;
                offset = 0;
            }
        }
        out.push(pieces);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_windows_split_large_objects_and_share_small_ones() {
        let objects: Vec<(String, u64)> = [("a", 25), ("empty", 0), ("b", 3), ("c", 10)]
            .iter()
            .map(|(n, s)| (n.to_string(), *s))
            .collect();
        let spans = |w: &Vec<ReadRange>| -> Vec<(u32, u64, u64, u64)> {
            w.iter().map(|r| (r.file, r.offset, r.len, r.dst)).collect()
        };
        let windows: Vec<_> = windows_of(&objects, 10).iter().map(spans).collect();
        assert_eq!(
            windows,
            [
                vec![(0, 0, 10, 0)],
                vec![(0, 10, 10, 0)],
                vec![(0, 20, 5, 0), (1, 0, 0, 5), (2, 0, 3, 5), (3, 0, 2, 8)],
                vec![(3, 2, 8, 0)],
            ]
        );
        // Every byte of every object once, in order.
        let total: u64 = windows.iter().flatten().map(|p| p.2).sum();
        assert_eq!(total, 38);
        assert!(windows_of(&[], 10).is_empty());
        assert_eq!(windows_of(&objects[1..2], 10).len(), 1);
    }

    #[test]
    fn commit_records_sort_last_and_private_files_are_skipped() {
        let mut files = vec![
            ("shards.json".to_string(), 1),
            ("acts000000.bin".to_string(), 1),
            ("metadata.json".to_string(), 1),
            ("zarr.json".to_string(), 1),
            ("a/zarr.json".to_string(), 1),
        ];
        sort_commit_last(&mut files);
        let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "metadata.json",
                "acts000000.bin",
                "a/zarr.json",
                "zarr.json",
                "shards.json"
            ]
        );
        assert!(is_private(".shardkit-writing"));
        assert!(is_private("x/.labels.bin.tmp"));
        assert!(!is_private("labels.bin"));
    }

    #[test]
    fn a_staging_directory_is_listed_while_upload_threads_remove_what_they_sent() {
        // A flat-tokens commit lists its staging directory for the metadata documents while
        // the upload threads remove chunks they have sent: a chunk listed by readdir and gone
        // before its stat is left out. A strict walk fails here with NotFound in nearly every
        // run, as a commit once did in CI.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("train/encoded_tokens/c")).unwrap();
        std::fs::write(root.join("zarr.json"), b"{}").unwrap();
        std::fs::write(root.join("train/encoded_tokens/zarr.json"), b"{}").unwrap();
        let chunks: Vec<PathBuf> = (0..1000)
            .map(|i| root.join(format!("train/encoded_tokens/c/{i}")))
            .collect();
        for c in &chunks {
            std::fs::write(c, [7u8; 3]).unwrap();
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for c in &chunks {
                    std::fs::remove_file(c).unwrap();
                }
                done.store(true, Ordering::SeqCst);
            });
            let mut walks = 0;
            while !done.load(Ordering::SeqCst) || walks == 0 {
                let files = staged_files(root).unwrap();
                let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
                assert_eq!(
                    names[names.len() - 2..],
                    ["train/encoded_tokens/zarr.json", "zarr.json"]
                );
                assert!(files
                    .iter()
                    .all(|(n, len)| *len == if n.ends_with(".json") { 2 } else { 3 }));
                walks += 1;
            }
        });
        assert_eq!(staged_files(root).unwrap().len(), 2);
        // The directory itself must be there: a missing one is an error, not an empty listing.
        let missing = staged_files(&root.join("missing")).unwrap_err();
        assert!(matches!(&missing, Error::NotFound { .. }), "{missing:?}");
    }
}
