//! File-system primitives that make writers crash-safe.
//!
//! A file appears under its final name only when complete: it is written to a temporary sibling
//! (a leading `.` and a `.tmp` suffix, so no format's glob such as `acts*.bin` matches it),
//! fsynced, renamed over the final name, and then the directory is fsynced so the rename itself
//! is durable. A crash therefore leaves either the old state or the new one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result};

/// The temporary sibling used while `path` is being written: `dir/.name.tmp`.
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Whether `name` is a temporary created by [`temp_sibling`].
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// fsyncs a directory so that entries created, renamed or removed in it are durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).at(dir)
}

/// Writes `bytes` to `path` atomically: temporary sibling, fsync, rename, fsync of the directory.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_sibling(path);
    let result = (|| {
        let mut f = File::create(&tmp).at(&tmp)?;
        f.write_all(bytes).at(&tmp)?;
        f.sync_all().at(&tmp)?;
        drop(f);
        publish(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Renames a finished, already-fsynced temporary to its final name and fsyncs the directory.
pub fn publish(tmp: &Path, path: &Path) -> Result<()> {
    fs::rename(tmp, path).at(path)?;
    fsync_dir(parent_of(path))
}

/// Creates (or truncates) `path` and sets its length, leaving a sparse hole where the platform
/// supports one, so unwritten regions read as zeros without costing disk space.
pub fn create_sized(path: &Path, len: u64) -> Result<File> {
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
pub fn raise_open_file_limit() {
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
pub fn start_writeback(f: &File, offset: u64, len: u64) {
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
}
