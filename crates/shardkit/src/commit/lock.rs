//! One writer per dataset: an exclusive advisory lock held for the writer's whole life.
//!
//! Directory formats (saev, flat-tokens, EAGLE-3) lock the directory itself; single-file
//! containers (SDNB, shard sets, SDZ) lock `.NAME.lock` beside the file, removed when the writer
//! ends. The lock is `flock(LOCK_EX | LOCK_NB)`: a second writer fails at once with
//! [`Error::Locked`] naming the path and, on Linux, the holder's pid (read from `/proc/locks`);
//! the kernel drops the lock when its holder exits, so a killed job never leaves a stale lock.
//! Readers take no lock. Two writers in one process conflict as two processes do.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// A held writer lock; dropping it releases the lock (and removes a lock file it created).
#[derive(Debug)]
pub(crate) struct WriteLock {
    file: File,
    /// The lock file to remove on drop (None for a locked directory).
    remove: Option<PathBuf>,
}

impl WriteLock {
    /// Locks the directory `dir` (which must exist).
    pub(crate) fn dir(dir: &Path) -> Result<WriteLock> {
        let file = File::open(dir).at(dir)?;
        try_lock(&file, dir)?;
        Ok(WriteLock { file, remove: None })
    }

    /// Locks the directory `dir` shared: the part writers of one dataset hold it together
    /// (`commit::parts`), and none of them can start while a whole-dataset writer holds it
    /// exclusively, nor that writer while any of them does.
    pub(crate) fn dir_shared(dir: &Path) -> Result<WriteLock> {
        let file = File::open(dir).at(dir)?;
        flock(&file, libc::LOCK_SH | libc::LOCK_NB, dir)?;
        Ok(WriteLock { file, remove: None })
    }

    /// Locks the file at `path` (created if absent, never removed), waiting while another
    /// process holds it: the commit of a dataset written in parts is one process's at a time.
    pub(crate) fn waiting(path: &Path) -> Result<WriteLock> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .at(path)?;
        flock(&file, libc::LOCK_EX, path)?;
        Ok(WriteLock { file, remove: None })
    }

    /// Locks the file at `path`, which must exist, exclusively without waiting; `None` when
    /// another process holds it.
    pub(crate) fn try_file(path: &Path) -> Result<Option<WriteLock>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .at(path)?;
        match flock(&file, libc::LOCK_EX | libc::LOCK_NB, path) {
            Ok(()) => Ok(Some(WriteLock { file, remove: None })),
            Err(Error::Locked { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates (or opens) the file at `path` and locks it exclusively without waiting, through
    /// the one descriptor: `None` when another process holds it.
    pub(crate) fn create_try(path: &Path) -> Result<Option<WriteLock>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .at(path)?;
        match flock(&file, libc::LOCK_EX | libc::LOCK_NB, path) {
            Ok(()) => Ok(Some(WriteLock { file, remove: None })),
            Err(Error::Locked { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The locked file (a part's claim writes who holds it there).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Locks the file `target` (which need not exist yet) through `.NAME.lock` beside it.
    #[cfg(test)]
    pub(crate) fn beside(target: &Path) -> Result<WriteLock> {
        WriteLock::beside_as(target, target)
    }

    /// [`WriteLock::beside`], naming `shown` in a conflict (e.g. the container file, when the
    /// lock stands for every file of its base name).
    pub(crate) fn beside_as(target: &Path, shown: &Path) -> Result<WriteLock> {
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| Error::Invalid(format!("{}: not a file name", target.display())))?;
        let path = fsutil::parent_of(target).join(format!(".{name}.lock"));
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .at(&path)?;
            try_lock(&file, shown)?;
            // A writer that ended between our open and our lock removed the file we locked:
            // lock the one now at the path instead, or two writers would both hold "the" lock.
            if same_file(&file, &path) {
                return Ok(WriteLock {
                    file,
                    remove: Some(path),
                });
            }
        }
    }
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        // Removed while still held, so no other writer can hold a lock on this inode.
        if let Some(p) = &self.remove {
            let _ = std::fs::remove_file(p);
        }
        let _ = &self.file; // closing the descriptor releases the lock
    }
}

fn try_lock(file: &File, shown: &Path) -> Result<()> {
    flock(file, libc::LOCK_EX | libc::LOCK_NB, shown)
}

/// `flock(op)` on `file`; a lock held elsewhere (with `LOCK_NB`) is [`Error::Locked`] naming
/// `shown` and the holder. A wait interrupted by a signal is taken up again.
fn flock(file: &File, op: libc::c_int, shown: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let err = loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            break err;
        }
    };
    if err.kind() == std::io::ErrorKind::WouldBlock {
        return Err(Error::Locked {
            path: shown.to_path_buf(),
            pid: holder_pid(file),
        });
    }
    Err(Error::io(shown, err))
}

fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The pid holding a flock on `file`'s inode, from `/proc/locks` (None where it cannot be told).
///
/// The kernel hands `/proc/locks` out a page per `read`, walking its lock list afresh each time:
/// a lock taken or dropped elsewhere between two reads shifts the list, and one entry (ours
/// among them) can be skipped. So an entry not found is looked for again, a few times.
fn holder_pid(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    const ATTEMPTS: usize = 8;
    let meta = file.metadata().ok()?;
    (0..ATTEMPTS).find_map(|_| {
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        holder_in(&locks, meta.dev(), meta.ino())
    })
}

/// Parses `/proc/locks` lines such as `1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF`
/// (device as hex major:minor, inode decimal); waiters (`->`) are skipped.
fn holder_in(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let (major, minor) = (
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t),
    );
    locks.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] == "->" || f[1] != "FLOCK" {
            return None;
        }
        let mut id = f[5].split(':');
        let maj = u32::from_str_radix(id.next()?, 16).ok()?;
        let min = u32::from_str_radix(id.next()?, 16).ok()?;
        let inode: u64 = id.next()?.parse().ok()?;
        (maj == major && min == minor && inode == ino)
            .then(|| f[4].parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_fails_naming_the_holder_and_a_released_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let a = WriteLock::dir(dir.path()).unwrap();
        match WriteLock::dir(dir.path()) {
            Err(Error::Locked { path, pid }) => {
                assert_eq!(path, dir.path());
                assert_eq!(pid, Some(std::process::id()));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(a);
        drop(WriteLock::dir(dir.path()).unwrap());

        let target = dir.path().join("model.sdnb");
        let b = WriteLock::beside(&target).unwrap();
        assert!(dir.path().join(".model.sdnb.lock").exists());
        let e = WriteLock::beside(&target).unwrap_err();
        assert!(
            matches!(&e, Error::Locked { path, .. } if path == &target),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("model.sdnb") && msg.contains(&std::process::id().to_string()),
            "{msg}"
        );
        drop(b);
        assert!(!dir.path().join(".model.sdnb.lock").exists());
        drop(WriteLock::beside(&target).unwrap());
    }

    /// `/proc/locks` spans several reads once many locks are held, and locks dropped between
    /// those reads shift the kernel's list past entries not read yet: the holder must still be
    /// named. (With a single look, this misses the holder a few times in a thousand here.)
    #[test]
    fn the_holder_is_named_while_other_locks_come_and_go() {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::create_dir(&target).unwrap();
        // Taken first, ours lies behind the others in the kernel's list, past the first page.
        let _ours = WriteLock::dir(&target).unwrap();
        let others: Vec<File> = (0..200)
            .map(|i| File::create(dir.path().join(format!("other-{i}"))).unwrap())
            .collect();
        let flock = |f: &File, op| {
            // SAFETY: flock on a descriptor we own.
            assert_eq!(unsafe { libc::flock(f.as_raw_fd(), op) }, 0);
        };
        others.iter().for_each(|f| flock(f, libc::LOCK_EX));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    others
                        .iter()
                        .step_by(2)
                        .for_each(|f| flock(f, libc::LOCK_UN));
                    others
                        .iter()
                        .step_by(2)
                        .for_each(|f| flock(f, libc::LOCK_EX));
                }
            });
            const LOOKS: usize = 3000;
            let mut missed = 0;
            for _ in 0..LOOKS {
                match WriteLock::dir(&target) {
                    Err(Error::Locked { pid, .. }) => {
                        missed += usize::from(pid != Some(std::process::id()))
                    }
                    other => panic!("expected Locked, got {other:?}"),
                }
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(
                missed, 0,
                "the holder went unnamed {missed} times in {LOOKS}"
            );
        });
    }

    #[test]
    fn proc_locks_lines_are_matched_by_device_and_inode() {
        let dev = libc::makedev(0xfd, 1) as u64;
        let text = "1: POSIX  ADVISORY  WRITE 11 fd:01:77 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 4242 fd:01:77 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 99 fd:01:77 0 EOF\n";
        assert_eq!(holder_in(text, dev, 77), Some(4242));
        assert_eq!(holder_in(text, dev, 78), None);
        assert_eq!(holder_in("garbage\n\n", dev, 77), None);
    }
}
