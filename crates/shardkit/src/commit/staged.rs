//! Writes to a store staged locally: the staging directory, and [`Streaming`], which uploads a
//! writer's finished files in the background under a journal.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::lock::WriteLock;
use super::store_lock::{self, LockWatch, StoreLock};
use super::transfer::upload;
use crate::checksum::{FileSums, Journal};
use crate::error::{Error, IoContext, Result};
use crate::io::{inflight, Remote};
use crate::json::Value;

/// The local directory a write to `url` is staged in: `$SHARDKIT_STAGING_DIR` (default: the
/// system's temporary directory, `shardkit-staging`), then the bucket and key. The same URL
/// always stages in the same place, so a killed write resumes from what it staged.
pub(crate) fn staging_dir(url: &Path) -> PathBuf {
    let base = crate::config::staging_base()
        .unwrap_or_else(|| std::env::temp_dir().join("shardkit-staging"));
    let key = url.to_string_lossy();
    let key = key
        .strip_prefix("s3://")
        .or_else(|| key.strip_prefix("s3a://"))
        .unwrap_or(&key);
    base.join(key.trim_matches('/'))
}

/// A dataset a writer streams to `target`: staged locally, each finished data file uploaded in
/// the background, the rest by [`Streaming::finish`].
///
/// [`Streaming::workers`] threads upload the files sent, several at once (each a multipart
/// upload with its own parts in flight). After each upload the journal ([`Journal`]), now naming
/// that file, is rewritten, then the staged copy removed, so the journal never names a file the
/// store does not hold. As many files as there are workers may wait, so the staging directory
/// holds at most twice that many finished files: a writer faster than the network waits instead
/// of filling the disk. The first failed upload stops the workers, and the writer's next
/// [`Streaming::send`] (or [`Streaming::finish`]) returns its error, naming the object.
///
/// A writer may also record a checkpoint ([`Streaming::checkpoint`]): facts the journal takes
/// once every file sent before it is in the store, without the writer waiting for that.
#[derive(Debug)]
pub(crate) struct Streaming {
    pub target: Remote,
    tx: Option<std::sync::mpsc::SyncSender<Job>>,
    workers: Vec<std::thread::JoinHandle<Result<()>>>,
    failed: Arc<std::sync::atomic::AtomicBool>,
    /// The journal and the uploads in flight, shared with the workers (who notify the
    /// condition variable as each upload ends).
    shared: Arc<(Mutex<Shared>, std::sync::Condvar)>,
    /// Files in the store or queued for it.
    sent: std::collections::BTreeSet<String>,
    /// The writer's lock on the dataset in the store, released when this ends (after the
    /// uploads, as fields drop after [`Drop::drop`]).
    store_lock: StoreLock,
}

/// A file to upload: (its number in sending order, name, staged path, checksums).
type Job = (u64, String, PathBuf, FileSums);

#[derive(Debug, Default)]
struct Shared {
    /// The store's journal: the files uploaded so far (the workers add them) and the facts.
    journal: Journal,
    /// Numbers of the files sent whose upload has not ended.
    outstanding: std::collections::BTreeSet<u64>,
    /// The number the next file sent gets.
    next: u64,
    /// A checkpoint waiting for the files sent before it: (files sent before it, its facts).
    checkpoint: Option<(u64, Vec<(String, Value)>)>,
    /// Whether the writer's lock in the store was taken over: then nothing more is written.
    lock: LockWatch,
}

impl Shared {
    /// Writes the journal to `remote`, with the pending checkpoint's facts when every file
    /// sent before it is uploaded; the checkpoint counts as recorded only once that write
    /// succeeded.
    fn write_journal(&mut self, remote: &Remote) -> Result<()> {
        self.lock.check()?;
        let ready = self
            .checkpoint
            .as_ref()
            .is_some_and(|(n, _)| self.outstanding.range(..*n).next().is_none());
        let bytes = match (&self.checkpoint, ready) {
            (Some((_, facts)), true) => {
                let mut j = self.journal.clone();
                for (k, v) in facts {
                    j.set_fact(k, v.clone());
                }
                j.to_bytes()
            }
            _ => self.journal.to_bytes(),
        };
        remote.put(Journal::NAME, bytes)?;
        if let (true, Some((_, facts))) = (ready, self.checkpoint.take()) {
            for (k, v) in facts {
                self.journal.set_fact(&k, v);
            }
        }
        Ok(())
    }
}

impl Streaming {
    /// Upload threads: `inflight() / 8` (each file keeps up to 8 parts in flight), 2 to 16.
    pub(crate) fn workers() -> usize {
        (inflight() / 8).clamp(2, 16)
    }

    /// What an interrupted write left in `target`: its journal, keeping only the files present
    /// at their size (an empty journal when there is none). Files upload several at a time, so
    /// the files kept need not be a prefix of the dataset's.
    pub(crate) fn left_in(target: &Remote) -> Result<Journal> {
        let Some(bytes) = target.get_opt(Journal::NAME)? else {
            return Ok(Journal::default());
        };
        let mut journal = Journal::parse(&bytes, &target.url_of(Journal::NAME))?;
        let present: HashMap<String, u64> = target.list()?.into_iter().collect();
        journal
            .files
            .files
            .retain(|name, sums| present.get(name) == Some(&sums.bytes));
        Ok(journal)
    }

    /// Starts streaming to `target`, whose journal now says `journal` (written first when it
    /// differs from `was`, what the store's journal said), under the writer's `lock` on it.
    pub(crate) fn start(
        target: Remote,
        journal: Journal,
        was: &Journal,
        lock: StoreLock,
    ) -> Result<Streaming> {
        if journal != *was && *was != Journal::default() {
            target.put(Journal::NAME, journal.to_bytes())?;
        }
        let workers = Self::workers();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(workers);
        let rx = Arc::new(Mutex::new(rx));
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sent = journal.files.files.keys().cloned().collect();
        let shared = Arc::new((
            Mutex::new(Shared {
                journal,
                lock: lock.watch(),
                ..Shared::default()
            }),
            std::sync::Condvar::new(),
        ));
        let mut s = Streaming {
            target,
            tx: Some(tx),
            workers: Vec::new(),
            failed,
            shared,
            sent,
            store_lock: lock,
        };
        for i in 0..workers {
            let (remote, rx) = (s.target.clone(), rx.clone());
            let (shared, failed) = (s.shared.clone(), s.failed.clone());
            let worker = std::thread::Builder::new()
                .name(format!("shardkit-upload-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok((seq, name, path, sums)) = job else {
                        return Ok(());
                    };
                    if failed.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    let done = upload_journaled(&remote, &shared.0, seq, name, &path, sums);
                    if done.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    // After `failed` is set, so that a waiting writer never misses a failure.
                    shared.1.notify_all();
                    done?;
                })
                .map_err(|e| Error::Thread {
                    what: "the upload threads shardkit-upload".into(),
                    source: e,
                })?;
            s.workers.push(worker);
        }
        Ok(s)
    }

    /// Clears what a write killed right after its commit leaves behind: the journal and the
    /// lock (unless its holder is alive) in `target`, and the staged copy `staged` (unless
    /// another writer holds it). None is needed once the store holds the whole dataset, and
    /// readers ignore them, so a failure here loses nothing.
    pub(crate) fn clear_leftovers(target: &Remote, staged: &Path) {
        let _ = target.delete(Journal::NAME);
        if let Ok(Some(_)) = target.get_tagged(store_lock::NAME) {
            // A lock whose holder is gone is taken, and deleted as it drops; a live one stays.
            let _ = StoreLock::acquire(target);
        }
        if let Ok(_lock) = WriteLock::dir(staged) {
            let _ = std::fs::remove_dir_all(staged);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `value` under `key` in the journal (written with the next upload).
    pub(crate) fn set_fact(&self, key: &str, value: Value) {
        self.lock().journal.set_fact(key, value);
    }

    /// Whether `name` is in the store (kept from an interrupted write) or queued for it.
    pub(crate) fn has_sent(&self, name: &str) -> bool {
        self.sent.contains(name)
    }

    /// Queues the finished file `dir/name` (whose checksums are `sums`) for upload, waiting
    /// while every worker is busy and the queue full; an error is an earlier upload's.
    pub(crate) fn send(&mut self, dir: &Path, name: &str, sums: FileSums) -> Result<()> {
        self.store_lock.check()?;
        let seq = {
            let mut s = self.lock();
            let seq = s.next;
            s.next += 1;
            s.outstanding.insert(seq);
            seq
        };
        let sent = !self.failed.load(Ordering::Relaxed)
            && self
                .tx
                .as_ref()
                .is_some_and(|tx| tx.send((seq, name.into(), dir.join(name), sums)).is_ok());
        if sent {
            self.sent.insert(name.into());
            return Ok(());
        }
        self.lock().outstanding.remove(&seq);
        self.join()?;
        Err(Error::Internal(
            "the upload threads ended before the writer did".into(),
        ))
    }

    /// Waits until `done` holds of the shared state; an error is an upload's.
    fn wait_until(&mut self, done: impl Fn(&Shared) -> bool) -> Result<()> {
        {
            let mut s = self.lock();
            while !done(&s) && !self.failed.load(Ordering::Relaxed) {
                s = self.shared.1.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        }
        if self.failed.load(Ordering::Relaxed) {
            self.join()?;
            return Err(Error::Internal(
                "the upload threads ended before the writer did".into(),
            ));
        }
        Ok(())
    }

    /// Records `facts` in the journal once every file sent so far is in the store, and
    /// returns at once: the journal takes them with the upload that completes that set (or
    /// now, when it is complete already). A write resumed from the store alone trusts only
    /// what a checkpoint recorded. An earlier checkpoint must be recorded first
    /// ([`Streaming::wait_checkpoint`]).
    pub(crate) fn checkpoint(&mut self, facts: Vec<(String, Value)>) -> Result<()> {
        self.wait_checkpoint()?;
        let mut s = self.lock();
        s.checkpoint = Some((s.next, facts));
        if s.outstanding.is_empty() {
            s.write_journal(&self.target)?;
        }
        Ok(())
    }

    /// Renews the writer's lock now: fails if another writer took it over (before deleting
    /// objects, or committing).
    pub(crate) fn confirm_lock(&self) -> Result<()> {
        self.store_lock.confirm()
    }

    /// Waits until the last checkpoint is recorded in the store's journal.
    pub(crate) fn wait_checkpoint(&mut self) -> Result<()> {
        self.wait_until(|s| s.checkpoint.is_none())
    }

    /// The files uploaded, with their checksums, once every file sent is (and the last
    /// checkpoint recorded).
    pub(crate) fn uploaded(&mut self) -> Result<std::collections::BTreeMap<String, FileSums>> {
        self.wait_until(|s| s.outstanding.is_empty() && s.checkpoint.is_none())?;
        Ok(self.lock().journal.files.files.clone())
    }

    /// Waits for the queued uploads, uploads what is left in the staging directory `dir` (the
    /// commit record last, objects already in the store skipped), deletes the objects
    /// `leftovers` (private ones the write kept there), the journal and the staging directory;
    /// returns the dataset's URL.
    pub(crate) fn finish(mut self, dir: &Path, leftovers: &[String]) -> Result<PathBuf> {
        self.join()?;
        self.store_lock.confirm()?;
        let url = PathBuf::from(self.target.url());
        upload(dir, &url, |_, _| {})?;
        for name in leftovers {
            self.target.delete(name)?;
        }
        // The dataset is committed: a journal left behind is ignored by readers and removed by
        // the next writer of this dataset; the staged copy served its purpose.
        let _ = self.target.delete(Journal::NAME);
        let _ = std::fs::remove_dir_all(dir);
        Ok(url)
    }

    /// Lets the workers finish what is queued, then returns the first error any of them met.
    fn join(&mut self) -> Result<()> {
        self.tx = None;
        let mut first = Ok(());
        for w in self.workers.drain(..) {
            let r = match w.join() {
                Ok(r) => r,
                Err(p) => Err(Error::Internal(format!(
                    "an upload thread panicked: {}",
                    panic_message(&*p)
                ))),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for Streaming {
    /// A writer dropped unfinished still uploads the files it finished: a resumed write then
    /// finds them in the store.
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Uploads `path` as `name` (file number `seq`), then rewrites the journal naming it too (and
/// taking a checkpoint this upload completes), then removes `path`.
fn upload_journaled(
    remote: &Remote,
    shared: &Mutex<Shared>,
    seq: u64,
    name: String,
    path: &Path,
    sums: FileSums,
) -> Result<()> {
    // A writer whose lock was taken over sends nothing more.
    shared
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .lock
        .check()?;
    remote.put_file(&name, path)?;
    {
        // Held across the PUT, so journals reach the store in the order they grow.
        let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
        s.journal.files.files.insert(name, sums);
        s.outstanding.remove(&seq);
        s.write_journal(remote)?;
    }
    // In the store and journaled: the staged copy is no longer needed.
    std::fs::remove_file(path).at(path)
}

/// The message a panic carried (as the engine's loader threads report theirs).
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
