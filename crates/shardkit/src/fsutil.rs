//! File-system primitives that make writers crash-safe.
//!
//! A file appears under its final name only when complete: it is written to a temporary sibling
//! (a leading `.` and a `.tmp` suffix, so no format's glob such as `acts*.bin` matches it),
//! fsynced, renamed over the final name, and then the directory is fsynced so the rename itself
//! is durable. A crash therefore leaves either the old state or the new one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

/// The temporary sibling used while `path` is being written: `dir/.name.tmp`.
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// A temporary beside `path` of this process and call (`.NAME.PID-N.tmp`), for a file that
/// several processes (ranks) may write at once: one shared temporary would be renamed away
/// under one of them.
pub(crate) fn unique_temp_sibling(path: &Path) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}-{n}.tmp", std::process::id()))
}

/// Whether `name` is a temporary created by [`temp_sibling`] or [`unique_temp_sibling`].
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).at(dir)?;
    #[cfg(feature = "fault-injection")]
    trace::record(trace::Event::SyncDir(dir.to_path_buf()));
    Ok(())
}

/// Removes the directory `dir` and everything in it (nothing when it is absent), the files
/// directly in it by several threads at once. Freeing a small file's block can cost a disk
/// round trip of its own: on this project's VM (ext4 mounted with `discard`, a virtual disk)
/// removing 1,000 records of a dataset written in parts took 3.3 s one after another and
/// 0.13 s eight at a time, the difference between a commit inside its 1 s target and not.
pub(crate) fn remove_dir_files_parallel(dir: &Path) -> Result<()> {
    const THREADS: usize = 8;
    let files: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
            .map(|e| e.path())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let remove = |paths: &[PathBuf]| -> Result<()> {
        for p in paths {
            match fs::remove_file(p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(p, e)),
                _ => {}
            }
        }
        Ok(())
    };
    if files.len() < 2 * THREADS {
        remove(&files)?;
    } else {
        let what = format!("removing the files of {}", dir.display());
        crate::par::chunked(&files, THREADS, &what, |c| {
            remove(c).map(|()| Vec::<()>::new())
        })?;
    }
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(dir, e)),
        _ => Ok(()),
    }
}

/// fsyncs a file's data and metadata (`path` names it in errors).
pub(crate) fn sync_file(f: &File, path: &Path) -> Result<()> {
    f.sync_all().at(path)?;
    #[cfg(feature = "fault-injection")]
    trace::record(trace::Event::SyncFile(path.to_path_buf()));
    Ok(())
}

/// fsyncs a file's data (and the metadata needed to read it back: its size).
pub(crate) fn sync_data(f: &File, path: &Path) -> Result<()> {
    f.sync_data().at(path)?;
    #[cfg(feature = "fault-injection")]
    trace::record(trace::Event::SyncFile(path.to_path_buf()));
    Ok(())
}

/// Renames `from` to `to` (not yet durable: fsync the directory after).
pub(crate) fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).at(to)?;
    #[cfg(feature = "fault-injection")]
    trace::record(trace::Event::Rename {
        from: from.to_path_buf(),
        to: to.to_path_buf(),
    });
    #[cfg(feature = "fault-injection")]
    trace::abort_point();
    Ok(())
}

/// The durability calls writers make, recorded for tests of their order (crash safety after a
/// power loss depends on it: a file is fsynced before it is renamed to its final name, and the
/// directory after). Off unless a test calls [`trace::start`]. Compiled in only with the
/// `fault-injection` cargo feature (the tests', through `shardkit::internals::trace`), as are the
/// kill tests' abort hooks below: the user's build has no trace and reads no test variable.
#[cfg(feature = "fault-injection")]
pub(crate) mod trace {
    use std::path::PathBuf;
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, OnceLock};

    /// One durability call.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Event {
        /// A file's fsync (or fdatasync).
        SyncFile(PathBuf),
        /// A rename.
        Rename {
            /// The old name.
            from: PathBuf,
            /// The new name.
            to: PathBuf,
        },
        /// A directory's fsync.
        SyncDir(PathBuf),
    }

    static ON: AtomicBool = AtomicBool::new(false);
    static LOG: Mutex<Vec<Event>> = Mutex::new(Vec::new());

    /// Starts recording (clearing what was recorded).
    pub fn start() {
        LOG.lock().unwrap_or_else(|e| e.into_inner()).clear();
        ON.store(true, Ordering::SeqCst);
    }

    /// Stops recording and returns the events.
    pub fn take() -> Vec<Event> {
        ON.store(false, Ordering::SeqCst);
        std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The kill tests' hook: with `SHARDKIT_TEST_ABORT_AFTER_RENAMES=K` in the environment, the
    /// process aborts (as if killed) right after its K-th rename through [`super::rename`].
    /// Kills timed from outside cannot hit the microseconds between two renames; this can.
    pub(crate) fn abort_point() {
        static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
        static RENAMES: AtomicU64 = AtomicU64::new(0);
        abort_at(crate::config::AbortAfter::Renames, &LIMIT, &RENAMES);
    }

    /// The same for uploads: with `SHARDKIT_TEST_ABORT_AFTER_PUTS=K`, the process aborts right
    /// after its K-th object is written to an object store.
    pub(crate) fn abort_after_put() {
        static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
        static PUTS: AtomicU64 = AtomicU64::new(0);
        abort_at(crate::config::AbortAfter::Puts, &LIMIT, &PUTS);
    }

    /// Aborts when `count`, counting this call, reaches the limit the environment sets for
    /// `what`.
    fn abort_at(what: crate::config::AbortAfter, limit: &OnceLock<Option<u64>>, count: &AtomicU64) {
        let limit = limit.get_or_init(|| crate::config::test_abort_after(what));
        if let Some(k) = *limit {
            if count.fetch_add(1, Ordering::SeqCst) + 1 == k {
                std::process::abort();
            }
        }
    }

    pub(crate) fn record(e: Event) {
        if ON.load(Ordering::Relaxed) {
            LOG.lock().unwrap_or_else(|e| e.into_inner()).push(e);
        }
    }
}

/// Writes `bytes` to `path` atomically: temporary sibling, fsync, rename, fsync of the directory.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    write_through(&temp_sibling(path), path, bytes)
}

/// [`atomic_write`] through a [`unique_temp_sibling`]: for a file several processes may
/// write at once (each lands whole; the last rename wins).
pub(crate) fn atomic_write_shared(path: &Path, bytes: &[u8]) -> Result<()> {
    write_through(&unique_temp_sibling(path), path, bytes)
}

/// Writes `bytes` to the temporary `tmp` durably, then publishes it as `path` (removing the
/// temporary on failure).
fn write_through(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    let result = write_synced(tmp, bytes).and_then(|()| publish(tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(tmp);
    }
    result
}

/// Creates `path` holding `bytes`, fsynced (not its directory: the caller publishes it).
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).at(path)?;
    f.write_all(bytes).at(path)?;
    sync_file(&f, path)
}

/// Renames a finished, already-fsynced temporary to its final name and fsyncs the directory.
pub fn publish(tmp: &Path, path: &Path) -> Result<()> {
    rename(tmp, path)?;
    fsync_dir(parent_of(path))
}

/// Creates (or truncates) `path` and sets its length, leaving a sparse hole where the platform
/// supports one, so unwritten regions read as zeros without costing disk space.
pub(crate) fn create_sized(path: &Path, len: u64) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .at(path)?;
    f.set_len(len).at(path)?;
    Ok(f)
}

/// The largest JSON file shardkit reads (metadata, manifests, shard lists, zarr documents):
/// 64 MiB. Real ones are kilobytes (a saev `shards.json` of a million shards is about 50 MB);
/// anything larger is refused before it is read, so a hostile file cannot exhaust memory.
pub(crate) const MAX_JSON_BYTES: u64 = 64 << 20;

/// Reads a JSON file whole, refusing one larger than [`MAX_JSON_BYTES`] (an `InvalidData`
/// error saying so; a missing file stays `NotFound`).
pub(crate) fn read_json_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let too_big = |n: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{n} bytes or more: over the {} MiB cap on JSON files (see MAX_JSON_BYTES)",
                MAX_JSON_BYTES >> 20
            ),
        )
    };
    let f = File::open(path)?;
    let len = f.metadata()?.len();
    if len > MAX_JSON_BYTES {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    // The file may grow after the check: read at most one byte past the cap.
    f.take(MAX_JSON_BYTES + 1).read_to_end(&mut out)?;
    if out.len() as u64 > MAX_JSON_BYTES {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// Opens `path` for reading, refusing anything but a regular file (after symlinks): a FIFO or
/// a device in place of a shard is an error naming it, never a read that blocks forever (the
/// open itself does not block: it is non-blocking until the type is known).
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .at(path)?;
    let meta = f.metadata().at(path)?;
    if !meta.is_file() {
        return Err(crate::error::Error::format(
            path,
            "not a regular file (a FIFO, device or directory in place of a dataset file)",
        ));
    }
    // Regular files ignore O_NONBLOCK; cleared anyway so the descriptor is an ordinary one.
    {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl on a descriptor we own, with flags it returned.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
            }
        }
    }
    Ok(f)
}

/// Checks that everything below `dir` is a directory or a regular file (after symlinks): an
/// error naming the first FIFO, socket or device found.
pub(crate) fn check_regular_tree(dir: &Path) -> Result<()> {
    for e in fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let path = e.path();
        let ty = e.file_type().at(&path)?;
        let (is_dir, is_file) = if ty.is_symlink() {
            match fs::metadata(&path) {
                Ok(m) => (m.is_dir(), m.is_file()),
                Err(_) => (false, true), // dangling: reported by the read that needs it
            }
        } else {
            (ty.is_dir(), ty.is_file())
        };
        if is_dir {
            if !ty.is_symlink() {
                check_regular_tree(&path)?; // (symlinked directories are not followed: no loops)
            }
        } else if !is_file {
            return Err(crate::error::Error::format(
                &path,
                "not a regular file (a FIFO, socket or device in place of a dataset file)",
            ));
        }
    }
    Ok(())
}

/// The directory that holds `path` (`.` for a bare file name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The size of `path` if it is a regular file.
pub fn regular_file_len(path: &Path) -> Option<u64> {
    fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

/// Raises the soft limit on open files to the hard limit. Datasets with thousands of shards keep
/// one descriptor per shard, far beyond the common soft default of 1024.
pub(crate) fn raise_open_file_limit() {
    #[cfg(unix)]
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Asks the kernel to start writing a just-written range back now, without waiting for it, so
/// the disk stays busy while the next chunk is produced and the shard's final fsync is short.
pub(crate) fn start_writeback(f: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor; failure only loses the hint.
        unsafe {
            libc::sync_file_range(
                f.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, offset, len);
}

/// Opens `path` read-only with O_DIRECT (reads that bypass the page cache); `None` where that is
/// refused (tmpfs, non-Linux).
pub fn open_direct(path: &Path) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        atomic_write(&p, b"one").unwrap();
        atomic_write(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(is_temp_name(".a.json.tmp"));
        assert!(!is_temp_name("acts000000.bin"));
        assert_eq!(temp_sibling(&p), dir.path().join(".a.json.tmp"));
    }

    #[test]
    fn json_files_over_the_cap_are_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metadata.json");
        fs::write(&p, b"{}").unwrap();
        assert_eq!(read_json_file(&p).unwrap(), b"{}");
        // A sparse file: the size check refuses it without reading (or allocating) 64 MiB.
        let f = File::create(&p).unwrap();
        f.set_len(MAX_JSON_BYTES + 1).unwrap();
        let e = read_json_file(&p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("64 MiB cap"), "{e}");
        let missing = read_json_file(&dir.path().join("absent.json")).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn a_directory_of_many_files_is_removed_whole_and_an_absent_one_is_no_error() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("done");
        fs::create_dir_all(dir.join("sub")).unwrap();
        // Enough files for the threads; a subdirectory is left to remove_dir_all.
        for i in 0..100 {
            fs::write(dir.join(format!("{i:03}.json")), b"{}").unwrap();
        }
        fs::write(dir.join("sub").join("x"), b"x").unwrap();
        remove_dir_files_parallel(&dir).unwrap();
        assert!(!dir.exists());
        remove_dir_files_parallel(&dir).unwrap();
        // A file where the directory should be is an error naming it.
        fs::write(&dir, b"not a directory").unwrap();
        let e = remove_dir_files_parallel(&dir).unwrap_err().to_string();
        assert!(e.contains("done"), "{e}");
    }
}
