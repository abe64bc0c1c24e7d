//! Many reads in flight: a set of byte ranges, possibly from many files, read in parallel into
//! one destination buffer. Ranges adjacent in a file and in the buffer are merged into one large
//! read; large reads are split into pieces of at most `MAX_READ` so threads share the work.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, IoContext, Result};
use crate::fault;

/// Largest single read issued.
pub(crate) const MAX_READ: u64 = 8 << 20;

/// One range to read: `len` bytes of file `file` at `offset`, into the buffer at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadRange {
    /// Index of the file (see [`Files`]).
    pub file: u32,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// Byte offset in the destination buffer.
    pub dst: u64,
}

impl ReadRange {
    /// Ranges written as `(file, offset, len, dst)` tuples, the short form callers of
    /// `read_ranges` use.
    pub(crate) fn from_tuples(ranges: &[(u32, u64, u64, u64)]) -> Vec<ReadRange> {
        ranges
            .iter()
            .map(|&(file, offset, len, dst)| ReadRange {
                file,
                offset,
                len,
                dst,
            })
            .collect()
    }
}

/// The files a reader may touch, with their paths for error messages.
pub(crate) trait Files: Sync {
    /// The open file `i`.
    fn file(&self, i: u32) -> Result<&File>;
    /// The path of file `i`.
    fn path(&self, i: u32) -> std::path::PathBuf;
    /// File `i` opened with O_DIRECT, when the platform and file system allow it.
    fn direct(&self, _i: u32) -> Option<&File> {
        None
    }
}

/// Alignment O_DIRECT needs for offsets, lengths and buffers.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

pub use crate::fsutil::open_direct;

/// Sorts, merges adjacent ranges and splits long ones into pieces of at most [`MAX_READ`].
pub(crate) fn plan_reads(mut ranges: Vec<ReadRange>) -> Vec<ReadRange> {
    ranges.sort_unstable();
    let mut merged: Vec<ReadRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let Some(last) = merged.last_mut() {
            if last.file == r.file
                && last.offset + last.len == r.offset
                && last.dst + last.len == r.dst
                && last.len + r.len <= MAX_READ
            {
                last.len += r.len;
                continue;
            }
        }
        merged.push(r);
    }
    let mut out = Vec::with_capacity(merged.len());
    for r in merged {
        let mut done = 0;
        while done < r.len {
            let n = (r.len - done).min(MAX_READ);
            out.push(ReadRange {
                file: r.file,
                offset: r.offset + done,
                len: n,
                dst: r.dst + done,
            });
            done += n;
        }
    }
    out
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: used only for disjoint writes inside a thread scope (see `read_all`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Checks that every range's destination lies inside a `len`-byte buffer and that no two
/// overlap there (readers write them concurrently).
pub(crate) fn check_destinations(ranges: &[ReadRange], len: usize) -> Result<()> {
    let mut by_dst: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match r.dst.checked_add(r.len) {
            Some(end) if end <= len as u64 => by_dst.push((r.dst, end)),
            _ => {
                return Err(Error::Invalid(format!(
                    "read of {} bytes at buffer offset {} exceeds the {}-byte buffer",
                    r.len, r.dst, len
                )))
            }
        }
    }
    // Threads write the ranges' destinations concurrently: they must be disjoint.
    by_dst.sort_unstable();
    if let Some(w) = by_dst.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(Error::Invalid(format!(
            "reads overlap in the destination buffer (bytes {}..{} and {}..{})",
            w[0].0, w[0].1, w[1].0, w[1].1
        )));
    }
    Ok(())
}

/// Reads every range into `buf` using up to `threads` threads. Ranges must lie inside `buf`
/// and not overlap there (both checked: an error, before anything is read). A short read (a
/// file that shrank) is an error naming the file.
pub(crate) fn read_all(
    files: &dyn Files,
    ranges: &[ReadRange],
    buf: &mut [u8],
    threads: usize,
    direct: bool,
) -> Result<()> {
    check_destinations(ranges, buf.len())?;
    let next = AtomicUsize::new(0);
    let base = SendPtr(buf.as_mut_ptr());
    let threads = threads.clamp(1, ranges.len().max(1));
    let work = |base: SendPtr| -> Result<()> {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(r) = ranges.get(i) else {
                return Ok(());
            };
            // SAFETY: bounds checked above; destination ranges are disjoint by contract, so no
            // two threads write the same bytes, and `buf` outlives the scope.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(base.0.add(r.dst as usize), r.len as usize)
            };
            fault::before_read(files.path(r.file))?;
            // O_DIRECT when asked and the range and buffer are aligned: random small reads then
            // skip the page cache and readahead; anything refused falls back to a plain read.
            let aligned = r.offset % DIRECT_ALIGN == 0
                && r.len % DIRECT_ALIGN == 0
                && (dst.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN);
            if direct && aligned {
                if let Some(f) = files.direct(r.file) {
                    if f.read_exact_at(dst, r.offset).is_ok() {
                        continue;
                    }
                }
            }
            // The path is only built for an error message, never on the hot path.
            let file = files.file(r.file)?;
            if let Err(e) = file.read_exact_at(dst, r.offset) {
                return Err(read_error(&files.path(r.file), r.offset, dst.len(), e));
            }
        }
    };
    if threads == 1 {
        return work(base);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(move || work(base))).collect();
        let mut result = Ok(());
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(Error::Internal("an I/O thread panicked".into())));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

/// `read_exact_at` with an error that names the file and says it shrank.
pub(crate) fn read_exact(file: &File, path: &Path, offset: u64, dst: &mut [u8]) -> Result<()> {
    fault::before_read(path)?;
    file.read_exact_at(dst, offset)
        .map_err(|e| read_error(path, offset, dst.len(), e))
}

/// Asks the kernel to start reading `len` bytes at `offset` into the page cache, without
/// waiting (`posix_fadvise(WILLNEED)`). Advisory: failures are ignored.
pub(crate) fn readahead(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: an advisory syscall on a descriptor we own; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// Checks that `file` still holds at least `len` bytes (an error naming it otherwise): a
/// memory map must never be read past the end of its file.
pub(crate) fn check_len(file: &File, path: &Path, len: u64) -> Result<()> {
    fault::before_read(path)?;
    let have = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if have < len {
        return Err(Error::format(
            path,
            format!(
                "file ended before byte {len} ({have} bytes): it shrank or was replaced while \
                 being read"
            ),
        ));
    }
    Ok(())
}

/// The first `len` bytes of `file`, mapped read-only (`len` must be non-zero). The caller
/// checks that the file still holds them (`check_len`) before reading a part of the map it
/// has not checked since: a map must never be read past the end of its file.
pub(crate) fn map_file(file: &File, path: &Path, len: u64) -> Result<memmap2::Mmap> {
    // SAFETY: a read-only shared map of a finished file, which shardkit never writes; its length
    // is checked against the file before each use. (Another process truncating the file while it
    // is mapped is the one hazard of any memory map.)
    unsafe { memmap2::MmapOptions::new().len(len as usize).map(file) }
        .map_err(|e| Error::io(path, e))
}

/// Whether every page of `bytes` (a part of a file map) is in memory (`mincore`). True when
/// it cannot be told: the answer only decides whether to start readahead.
pub(crate) fn resident(bytes: &[u8]) -> bool {
    #[cfg(target_os = "linux")]
    {
        if bytes.is_empty() {
            return true;
        }
        let page = 4096usize;
        let start = bytes.as_ptr() as usize & !(page - 1);
        let end = bytes.as_ptr() as usize + bytes.len();
        let pages = (end - start).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: `start..end` lies inside the mapping that holds `bytes` (rounded down to its
        // page), and `vec` has one byte per page of that range.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        rc != 0 || vec.iter().all(|&v| v & 1 == 1)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = bytes;
        true
    }
}

fn read_error(path: &Path, offset: u64, len: usize, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::format(
            path,
            format!(
                "file ended before byte {}: it shrank or was replaced while being read",
                offset + len as u64
            ),
        )
    } else {
        Error::io(path, e)
    }
}

/// The regular files under `dir`, as paths relative to it with their sizes, unsorted. With
/// `skip_removed`, a file removed between being listed and being looked at is left out (a
/// directory other threads shrink while it is walked); otherwise that is an error.
pub(crate) fn walk(dir: &Path, skip_removed: bool) -> Result<Vec<(String, u64)>> {
    let removed = |e: &std::io::Error| skip_removed && e.kind() == std::io::ErrorKind::NotFound;
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let here = dir.join(&rel);
        for entry in std::fs::read_dir(&here).at(&here)? {
            let entry = entry.at(&here)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel_name = rel.join(&name);
            let kind = match entry.file_type() {
                Err(e) if removed(&e) => continue,
                kind => kind.at(entry.path())?,
            };
            if kind.is_dir() {
                stack.push(rel_name);
            } else if kind.is_file() {
                let len = match entry.metadata() {
                    Err(e) if removed(&e) => continue,
                    meta => meta.at(entry.path())?.len(),
                };
                out.push((rel_name.to_string_lossy().into_owned(), len));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct One(File, std::path::PathBuf);
    impl Files for One {
        fn file(&self, _: u32) -> Result<&File> {
            Ok(&self.0)
        }
        fn path(&self, _: u32) -> std::path::PathBuf {
            self.1.clone()
        }
    }

    #[test]
    fn read_all_refuses_overlapping_or_outside_destinations() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, (0..=255u8).collect::<Vec<_>>()).unwrap();
        let files = One(File::open(&p).unwrap(), p.clone());
        let r = |offset, len, dst| ReadRange {
            file: 0,
            offset,
            len,
            dst,
        };
        let mut buf = vec![0u8; 16];
        for bad in [
            vec![r(0, 8, 0), r(8, 8, 4)],
            vec![r(0, 4, 12), r(10, 4, 0), r(20, 2, 13)],
            vec![r(0, 17, 0)],
            vec![r(0, 1, u64::MAX)],
        ] {
            let e = read_all(&files, &bad, &mut buf, 4, false).unwrap_err();
            assert!(e.to_string().contains("overlap") || e.to_string().contains("exceeds"));
            assert_eq!(buf, vec![0u8; 16], "nothing read before the check");
        }
        read_all(
            &files,
            &[r(10, 4, 0), r(0, 4, 4), r(200, 8, 8)],
            &mut buf,
            3,
            false,
        )
        .unwrap();
        assert_eq!(
            buf,
            [10, 11, 12, 13, 0, 1, 2, 3, 200, 201, 202, 203, 204, 205, 206, 207]
        );
        let e = read_all(&files, &[r(250, 8, 0)], &mut buf, 1, false).unwrap_err();
        assert!(e.to_string().contains("shrank"), "{e}");
    }

    #[test]
    fn merges_adjacent_and_splits_long_ranges() {
        let r = |file, offset, len, dst| ReadRange {
            file,
            offset,
            len,
            dst,
        };
        let plan = plan_reads(vec![
            r(0, 100, 50, 100),
            r(0, 0, 100, 0),
            r(1, 0, 10, 150),
            r(0, 150, 10, 300),
        ]);
        assert_eq!(
            plan,
            vec![r(0, 0, 150, 0), r(0, 150, 10, 300), r(1, 0, 10, 150)]
        );
        let plan = plan_reads(vec![r(0, 0, MAX_READ * 2 + 1, 0)]);
        assert_eq!(plan.len(), 3);
        assert_eq!(plan[2], r(0, MAX_READ * 2, 1, MAX_READ * 2));
    }
}
