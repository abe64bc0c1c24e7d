//! Many processes, one dataset: each writes a part, and whichever completes the set commits
//! it, once.
//!
//! A dataset written in parts is cut into `units` (its shards), and rank `r` of `world` writes
//! the contiguous block [`part_of`]`(units, world, r)`: the units split into `world` blocks in
//! order, the first `units % world` of them one unit longer. The assignment depends on nothing
//! else, so every rank computes it alone, and a restart with another world size recomputes it
//! and skips the units already durable.
//!
//! Beside the dataset's own files, a write in parts keeps (private names that readers, the
//! checksum sidecar and transfers ignore; removed by the commit):
//!
//! ```text
//! .shardkit-parts/claims/FIRST-END   a rank's claim on units FIRST..END: a file it holds a lock on
//!                                    for its life, naming it (host, pid, rank of world)
//! .shardkit-parts/done/UNIT.json     one unit durable: the checksums of its files, written
//!                                    (fsynced, renamed) after the files themselves
//! .shardkit-parts/claims.lock        held while a claim is checked and made
//! .shardkit-parts/setup.lock         held while a rank writes or checks the configuration
//! .shardkit-parts/commit.lock        held by the process committing
//! ```
//!
//! In an object store the same state is objects under the same names ([`super::parts_store`]):
//! claims and the commit lock are lock objects with leases (`commit::store_lock`), records
//! plain PUTs.
//!
//! Every part writer holds the dataset directory's lock shared (a whole-dataset writer holds it
//! exclusively, so neither starts while the other writes). A claim that overlaps a live one is
//! refused naming its holder; a dead holder's claim (its lock gone with its process) is taken
//! over. When a rank has made its units durable it takes the commit lock, waiting for a rank
//! committing meanwhile, and commits if every unit is done and nobody has: the format's
//! commit record is written last, as one process writes it, so the committed dataset is the
//! one a single process writes. A rank that finds units missing leaves the commit to the rank
//! that completes them, or to a restart.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::parts_store::StoreParts;
use super::store_lock::{LockWatch, StoreLock};
use crate::checksum::FileSums;
use crate::commit::WriteLock;
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::{self, Value};

/// The private directory of a write in parts.
pub(crate) const PARTS_DIR: &str = ".shardkit-parts";

/// One unit's upload and record, run by [`Uploads`]' worker.
pub(crate) type UploadJob = Box<dyn FnOnce() -> Result<()> + Send>;

/// A rank's units going up to a store in the background, one at a time, while the writer fills
/// the next: the writer hands over a unit (its bytes in memory, its upload and record as one
/// job) and goes on; a failed job is the error of the next hand-over or of [`Uploads::wait`].
/// The hand-over waits while a unit is still going up, so a rank holds at most two units in
/// memory (the one filling, the one going up) and a killed rank loses at most those two.
#[derive(Debug, Default)]
pub(crate) struct Uploads {
    /// Hands jobs over; dropped to tell the worker no more come.
    jobs: Option<std::sync::mpsc::SyncSender<UploadJob>>,
    worker: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Uploads {
    /// Hands `job` (a unit's upload and record) over, starting the worker on first use.
    pub(crate) fn push(&mut self, job: UploadJob) -> Result<()> {
        if self.jobs.is_none() {
            // A rendezvous: the hand-over waits for the worker to take the job.
            let (tx, rx) = std::sync::mpsc::sync_channel::<UploadJob>(0);
            let worker = std::thread::Builder::new()
                .name("shardkit-part-upload".into())
                .spawn(move || rx.iter().try_for_each(|job| job()))
                .map_err(|e| Error::Thread {
                    what: "the part upload thread shardkit-part-upload".into(),
                    source: e,
                })?;
            self.jobs = Some(tx);
            self.worker = Some(worker);
        }
        let sent = self.jobs.as_ref().map(|tx| tx.send(job));
        match sent {
            Some(Ok(())) => Ok(()),
            // The worker stopped at a failed job: its error.
            _ => self.wait(),
        }
    }

    /// Waits for every unit handed over to be up and recorded; the first failure.
    pub(crate) fn wait(&mut self) -> Result<()> {
        self.jobs = None;
        match self.worker.take() {
            None => Ok(()),
            Some(w) => w.join().unwrap_or_else(|_| {
                Err(Error::Internal(
                    "internal: the part upload thread panicked".into(),
                ))
            }),
        }
    }
}

impl Drop for Uploads {
    /// A writer dropped unfinished still makes what it handed over durable.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

/// What [`Parts::begin_commit`] found.
pub(crate) enum CommitStart {
    /// The dataset is committed (now clean).
    Committed,
    /// A unit is not durable yet.
    Missing,
    /// The commit is this rank's: its lock (held until dropped) and every unit's record.
    Ready(Held, BTreeMap<String, UnitFiles>),
}

/// Whether every unit `units` names is recorded durable, from one listing of the records and
/// without the commit lock: a rank that finds one missing leaves the commit to the rank that
/// records it. Safe because a rank lists only after recording its own units, and a store lists
/// what was written before (S3 and its kind are strongly consistent): of two ranks recording
/// their last units at once, the later to record sees the other's record.
pub(crate) fn every_unit_listed(
    parts: &Parts,
    units: impl Iterator<Item = String>,
) -> Result<bool> {
    let listed: std::collections::HashSet<String> = parts.durable_units()?.into_iter().collect();
    Ok(units.into_iter().all(|u| listed.contains(&u)))
}

/// Runs `attempt`, a commit in a store, again while it fails because its commit lock was taken
/// over, and takes any failure of it for success when `committed` finds the dataset committed.
///
/// A committer loses its lock when it stalls past the lease, or when a store whose conditional
/// create is not atomic (some S3 emulators check, then write) let two ranks take it at once; the
/// loser notices before uploading the commit record (`Held::confirm`) and stops. The other rank
/// commits, and cleans up (which may fail the loser's attempt midway, reading a piece already
/// removed): the loser then waits for the commit lock again and finds the dataset committed.
pub(crate) fn commit_surviving_takeover(
    attempt: impl Fn() -> Result<bool>,
    committed: impl Fn() -> Result<bool>,
) -> Result<bool> {
    const TRIES: usize = 3;
    let mut tries = 0;
    loop {
        let e = match attempt() {
            Ok(done) => return Ok(done),
            Err(e) => e,
        };
        if committed()? {
            return Ok(true);
        }
        // The commit lock of a dataset's parts (`.shardkit-parts/commit.lock`), or of a
        // flat-tokens split's (`.shardkit-parts/<split>/commit.lock`).
        let lost = matches!(&e, Error::LockedRemote { path, .. }
            if path.file_name().is_some_and(|n| n == "commit.lock")
                && path.components().any(|c| c.as_os_str() == PARTS_DIR));
        tries += 1;
        if !lost || tries >= TRIES {
            return Err(e);
        }
    }
}

/// Which process of how many: a rank of a `torchrun` job, a task of a Slurm job or array, a
/// process of an MPI job, or one given by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    /// This process's rank, `0..world_size`.
    pub rank: u64,
    /// How many processes write the dataset.
    pub world_size: u64,
}

impl Rank {
    /// Rank `rank` of `world_size` (checked: `rank < world_size`).
    pub fn new(rank: u64, world_size: u64) -> Result<Rank> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Invalid(format!(
                "rank {rank} of world size {world_size}: a rank is 0..world_size and the world \
                 size at least 1"
            )));
        }
        Ok(Rank { rank, world_size })
    }

    /// The rank the launcher set in the environment, first found of: `RANK`/`WORLD_SIZE`
    /// (torchrun, torch.distributed), `SLURM_ARRAY_TASK_ID` with `SLURM_ARRAY_TASK_COUNT`
    /// (a Slurm array, its task ids counted from `SLURM_ARRAY_TASK_MIN`), `SLURM_PROCID`/
    /// `SLURM_NTASKS` (srun), `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE` (Open MPI),
    /// `PMI_RANK`/`PMI_SIZE` (MPICH, Intel MPI). Rank 0 of 1 when none is set.
    pub fn from_env() -> Result<Rank> {
        Rank::from_vars(|k| std::env::var(k).ok())
    }

    /// [`Rank::from_env`] reading variables through `var`.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Rank> {
        let num = |k: &str| -> Result<Option<u64>> {
            match var(k) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    Error::Invalid(format!("environment variable {k}={v:?} is not a count"))
                }),
            }
        };
        let pairs = [
            ("RANK", "WORLD_SIZE"),
            ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
            ("SLURM_PROCID", "SLURM_NTASKS"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
        ];
        for (r, w) in pairs {
            match (num(r)?, num(w)?) {
                (Some(mut rank), Some(world)) => {
                    if r == "SLURM_ARRAY_TASK_ID" {
                        rank = rank.saturating_sub(num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0));
                    }
                    return Rank::new(rank, world).map_err(|_| {
                        Error::Invalid(format!(
                            "environment: {r}={rank} is not a rank of {w}={world}"
                        ))
                    });
                }
                (Some(_), None) => {
                    return Err(Error::Invalid(format!(
                        "environment: {r} is set but {w} is not; set both, or pass the rank \
                         and world size"
                    )))
                }
                _ => {}
            }
        }
        Ok(Rank {
            rank: 0,
            world_size: 1,
        })
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank, self.world_size)
    }
}

/// The units rank `rank` of `world` writes: `units` split into `world` contiguous blocks in
/// order, the first `units % world` of them one longer (a rank past the units gets none).
pub fn part_of(units: u64, rank: Rank) -> Range<u64> {
    let (w, r) = (rank.world_size.max(1), rank.rank);
    let (q, extra) = (units / w, units % w);
    let start = r * q + r.min(extra);
    let len = q + u64::from(r < extra);
    start.min(units)..(start + len).min(units)
}

/// Who holds a claim: written into the claim file, shown when another claim is refused.
fn holder_text(rank: Rank) -> String {
    let host = fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    format!("{rank}, pid {} on {host}", std::process::id())
}

/// A rank's claim on its units, held until dropped (or its process dies).
#[derive(Debug)]
pub(crate) struct Claim {
    /// The claim file (locally; a store's claim object is deleted by its lock's drop).
    path: Option<PathBuf>,
    _lock: Held,
}

impl Claim {
    /// Fails if this claim was taken over (a store's, whose renewals stopped for longer than
    /// its lease): the rank then writes nothing more. No request; a local claim never is.
    pub(crate) fn check(&self) -> Result<()> {
        match &self._lock {
            Held::Store(l) => l.check(),
            Held::Local(_) | Held::Nothing => Ok(()),
        }
    }
}

impl Claim {
    /// A handle that tells, from another thread, whether this claim was taken over.
    pub(crate) fn watch(&self) -> LockWatch {
        match &self._lock {
            Held::Store(l) => l.watch(),
            Held::Local(_) | Held::Nothing => LockWatch::default(),
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked: no other claimer can hold this inode.
        if let Some(p) = &self.path {
            let _ = fs::remove_file(p);
        }
    }
}

/// A lock held on the parts state: a locked file, or a lock object in a store.
#[derive(Debug)]
pub(crate) enum Held {
    /// A locked file (held only to be dropped: the kernel releases it).
    #[allow(dead_code)]
    Local(WriteLock),
    /// A lock object with its lease.
    Store(StoreLock),
    /// Nothing: the claim of a rank with no units (several such ranks would share its name).
    Nothing,
}

impl Held {
    /// Renews a store's lock now, failing if it was taken over (before a commit record).
    pub(crate) fn confirm(&self) -> Result<()> {
        match self {
            Held::Local(_) | Held::Nothing => Ok(()),
            Held::Store(l) => l.confirm(),
        }
    }
}

/// A unit's durable record: the checksums of its files, by name.
pub(crate) type UnitFiles = BTreeMap<String, FileSums>;

/// The private state of a dataset written in parts: in its directory, or in its store prefix.
#[derive(Debug, Clone)]
pub(crate) struct Parts {
    place: Place,
}

#[derive(Debug, Clone)]
enum Place {
    /// `.shardkit-parts` in the dataset directory.
    Dir(PathBuf),
    /// `.shardkit-parts/` under the dataset's prefix.
    Store(StoreParts),
}

/// A claim file's name: `FIRST-END` of its units.
pub(super) fn claim_name(units: &Range<u64>) -> String {
    format!("{:09}-{:09}", units.start, units.end)
}

pub(super) fn parse_claim_name(name: &str) -> Option<Range<u64>> {
    let (a, b) = name.split_once('-')?;
    let (a, b) = (a.parse().ok()?, b.parse().ok()?);
    (a <= b).then_some(a..b)
}

impl Parts {
    /// The parts state of the dataset directory `dataset` (created when absent).
    pub(crate) fn open(dataset: &Path) -> Result<Parts> {
        let dir = dataset.join(PARTS_DIR);
        for d in [dir.join("claims"), dir.join("done")] {
            fs::create_dir_all(&d).at(&d)?;
        }
        Ok(Parts {
            place: Place::Dir(dir),
        })
    }

    /// The parts state of `dataset`, when a write in parts left one.
    pub(crate) fn existing(dataset: &Path) -> Option<Parts> {
        let dir = dataset.join(PARTS_DIR);
        dir.is_dir().then_some(Parts {
            place: Place::Dir(dir),
        })
    }

    /// The parts state of the dataset at the store prefix `dataset` (objects appear as ranks
    /// write them). Refused with `SHARDKIT_S3_LOCK=0`: the ranks coordinate through the
    /// conditional writes that setting turns off.
    pub(crate) fn open_store(dataset: &Remote) -> Result<Parts> {
        if !crate::config::s3_lock()? {
            return Err(Error::Invalid(format!(
                "{}: a write in parts coordinates its ranks through conditional writes, which \
                 SHARDKIT_S3_LOCK=0 turns off; unset it (or write with one process)",
                dataset.url()
            )));
        }
        Ok(Parts {
            place: Place::Store(StoreParts::new(dataset.clone())),
        })
    }

    /// [`Parts::open_store`]'s state kept under `state` (relative to `dataset`): for a format
    /// that writes several things in parts under one prefix (flat-tokens' splits, in
    /// `.shardkit-parts/<split>`), as [`Parts::open_in`] locally.
    #[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' only
    pub(crate) fn open_store_in(dataset: &Remote, state: &str) -> Result<Parts> {
        let mut p = Parts::open_store(dataset)?;
        p.place = Place::Store(StoreParts::new_in(dataset.clone(), state));
        Ok(p)
    }

    /// [`Parts::open_store_in`]'s state, when objects of it are there.
    #[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' only
    pub(crate) fn existing_store_in(dataset: &Remote, state: &str) -> Result<Option<Parts>> {
        let p = StoreParts::new_in(dataset.clone(), state);
        Ok(p.exists()?.then_some(Parts {
            place: Place::Store(p),
        }))
    }

    /// The parts state at the store prefix `dataset`, when a write in parts left objects there.
    pub(crate) fn existing_store(dataset: &Remote) -> Result<Option<Parts>> {
        let p = StoreParts::new(dataset.clone());
        Ok(p.exists()?.then_some(Parts {
            place: Place::Store(p),
        }))
    }

    /// The store's side of the state, when it is in a store.
    pub(crate) fn store(&self) -> Option<&StoreParts> {
        match &self.place {
            Place::Store(p) => Some(p),
            Place::Dir(_) => None,
        }
    }

    /// The local state directory; for a store an internal error (callers tell them apart).
    fn dir(&self) -> Result<&Path> {
        match &self.place {
            Place::Dir(d) => Ok(d),
            Place::Store(p) => Err(Error::Internal(format!(
                "internal: {}: a local operation on a write in parts in a store",
                p.dataset().url()
            ))),
        }
    }

    /// The parts state kept in `dir` itself (created when absent): for a format that writes
    /// several things in parts under one directory, one state each (flat-tokens' splits, in
    /// `.shardkit-parts/<split>`).
    #[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' only
    pub(crate) fn open_in(dir: &Path) -> Result<Parts> {
        for d in [dir.join("claims"), dir.join("done")] {
            fs::create_dir_all(&d).at(&d)?;
        }
        Ok(Parts {
            place: Place::Dir(dir.to_path_buf()),
        })
    }

    /// [`Parts::open_in`]'s state, when there is one.
    #[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' only
    pub(crate) fn existing_in(dir: &Path) -> Option<Parts> {
        dir.is_dir().then(|| Parts {
            place: Place::Dir(dir.to_path_buf()),
        })
    }

    /// Waits for and takes the lock the ranks of a dataset set it up under, one at a time
    /// (its configuration file written by the first, compared by the others). Local only: in
    /// a store the configuration is created conditionally ([`StoreParts::create_setup`]).
    pub(crate) fn setup_lock(&self) -> Result<WriteLock> {
        WriteLock::waiting(&self.dir()?.join("setup.lock"))
    }

    /// Claims `units` for `rank`. Refused, naming the holder, when a live claim overlaps them;
    /// the claims of dead holders are taken over.
    pub(crate) fn claim(&self, units: Range<u64>, rank: Rank) -> Result<Claim> {
        if units.is_empty() {
            // A rank past the units writes nothing, so overlaps nothing; ranks past the units
            // (world size above the unit count) would otherwise contend for one claim name.
            return Ok(Claim {
                path: None,
                _lock: Held::Nothing,
            });
        }
        if let Place::Store(p) = &self.place {
            return Ok(Claim {
                path: None,
                _lock: Held::Store(p.claim(units, rank)?),
            });
        }
        let dir = self.dir()?;
        let _claiming = WriteLock::waiting(&dir.join("claims.lock"))?;
        for (other, path) in self.claim_files()? {
            if other.start >= units.end || units.start >= other.end || other.is_empty() {
                continue;
            }
            match WriteLock::try_file(&path)? {
                // Its holder is gone (the kernel dropped the lock with the process).
                Some(_stale) => {
                    fs::remove_file(&path).at(&path)?;
                }
                None => {
                    let who = fs::read_to_string(&path).unwrap_or_default();
                    return Err(Error::LockedRemote {
                        path: path.clone(),
                        why: format!(
                            "units {}..{} are claimed by a live writer ({}); units {}..{} \
                             overlap them: two processes were given the same part (check \
                             the rank and world size each was started with)",
                            other.start,
                            other.end,
                            who.trim(),
                            units.start,
                            units.end
                        ),
                    });
                }
            }
        }
        let path = dir.join("claims").join(claim_name(&units));
        // One descriptor creates and locks it: a claim file is never unlocked while named.
        let lock = WriteLock::create_try(&path)?.ok_or_else(|| Error::Locked {
            path: path.clone(),
            pid: None,
        })?;
        let mut f = lock.file();
        f.set_len(0).at(&path)?;
        f.write_all(holder_text(rank).as_bytes()).at(&path)?;
        Ok(Claim {
            path: Some(path),
            _lock: Held::Local(lock),
        })
    }

    /// Every claim file: (its units, its path).
    fn claim_files(&self) -> Result<Vec<(Range<u64>, PathBuf)>> {
        let dir = self.dir()?.join("claims");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).at(&dir)? {
            let e = e.at(&dir)?;
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(r) = parse_claim_name(&name) {
                out.push((r, e.path()));
            }
        }
        out.sort_by_key(|(r, _)| (r.start, r.end));
        Ok(out)
    }

    /// The live claims: (units, who holds them). A claim whose holder is gone is not listed.
    pub(crate) fn live_claims(&self) -> Result<Vec<(Range<u64>, String)>> {
        if let Place::Store(p) = &self.place {
            return p.live_claims();
        }
        let mut out = Vec::new();
        for (units, path) in self.claim_files()? {
            // A claim removed meanwhile (its writer ended) is simply not live.
            if let Ok(None) = WriteLock::try_file(&path) {
                let who = fs::read_to_string(&path).unwrap_or_default();
                out.push((units, who.trim().to_string()));
            }
        }
        Ok(out)
    }

    /// Records unit `unit` durable, with the checksums of its files (already published and
    /// fsynced). Written through a temporary, fsynced and renamed: a record present is whole.
    pub(crate) fn record_done(&self, unit: &str, files: &UnitFiles) -> Result<()> {
        if let Place::Store(p) = &self.place {
            return p.record_done(unit, files);
        }
        let path = self.dir()?.join("done").join(format!("{unit}.json"));
        fsutil::atomic_write(&path, &record_bytes(files))
    }

    /// The units recorded durable: unit name to the checksums of its files. A record that
    /// does not parse is an error naming it (records are written whole, so it was damaged).
    pub(crate) fn done(&self) -> Result<BTreeMap<String, UnitFiles>> {
        if let Place::Store(p) = &self.place {
            return p.done();
        }
        let dir = self.dir()?.join("done");
        let mut out = BTreeMap::new();
        for e in fs::read_dir(&dir).at(&dir)? {
            let e = e.at(&dir)?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(unit) = name.strip_suffix(".json") else {
                continue; // a temporary of a record being written
            };
            if fsutil::is_temp_name(&name) {
                continue;
            }
            let path = e.path();
            let bytes = fs::read(&path).at(&path)?;
            out.insert(unit.to_string(), parse_record(&bytes, &path)?);
        }
        Ok(out)
    }

    /// The names of the units recorded durable, read only (a reader following the write:
    /// nothing is created, no record is parsed). A record is renamed into place whole after
    /// the unit's files are published, so a name listed is a unit whose files are final.
    pub(crate) fn durable_units(&self) -> Result<Vec<String>> {
        if let Place::Store(p) = &self.place {
            return p.durable_units();
        }
        let dir = self.dir()?.join("done");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).at(&dir)? {
            let name = e.at(&dir)?.file_name().to_string_lossy().into_owned();
            if let (Some(unit), false) = (name.strip_suffix(".json"), fsutil::is_temp_name(&name)) {
                out.push(unit.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    /// How a commit starts, the same for every format and place: waits for and takes the
    /// commit lock; then the dataset is committed already (`committed`; what a killed
    /// committer left is removed by `clean`), or a unit of `units` has no record yet (the rank
    /// that records it commits), or the commit is this rank's, with its lock and the records.
    pub(crate) fn begin_commit(
        &self,
        units: impl IntoIterator<Item = String>,
        committed: impl Fn() -> Result<bool>,
        clean: impl FnOnce() -> Result<()>,
    ) -> Result<CommitStart> {
        let Some(lock) = self.commit_lock()? else {
            // Another rank committed and removed the state while this one waited.
            return Ok(if committed()? {
                CommitStart::Committed
            } else {
                CommitStart::Missing
            });
        };
        if committed()? {
            // Committed by another rank (or by a run killed while cleaning up after it).
            clean()?;
            return Ok(CommitStart::Committed);
        }
        let done = self.done()?;
        if units.into_iter().any(|u| !done.contains_key(&u)) {
            return Ok(CommitStart::Missing);
        }
        Ok(CommitStart::Ready(lock, done))
    }

    /// Forgets unit `unit` (its files are being written again).
    pub(crate) fn forget(&self, unit: &str) -> Result<()> {
        if let Place::Store(p) = &self.place {
            return p.forget(unit);
        }
        let path = self.dir()?.join("done").join(format!("{unit}.json"));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&path, e)),
            _ => Ok(()),
        }
    }

    /// Waits for and takes the lock `name` of the state (one rank at a time does what it
    /// guards: EAGLE-3's embeddings).
    pub(crate) fn lock_named(&self, name: &str) -> Result<Held> {
        match &self.place {
            Place::Store(p) => p.lock_named(name).map(Held::Store),
            Place::Dir(d) => WriteLock::waiting(&d.join(name)).map(Held::Local),
        }
    }

    /// Waits for and takes the commit lock.
    /// `None` when the parts state is gone: a rank that committed meanwhile removed it (the
    /// caller then looks at the commit record).
    pub(crate) fn commit_lock(&self) -> Result<Option<Held>> {
        if let Place::Store(p) = &self.place {
            // No state to lose in a store: the lock object is made again if removed.
            return p.commit_lock().map(|l| Some(Held::Store(l)));
        }
        let dir = self.dir()?;
        match WriteLock::waiting(&dir.join("commit.lock")) {
            Ok(l) => Ok(Some(Held::Local(l))),
            Err(_) if !dir.is_dir() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether unit `unit`'s files, recorded with `files`, are in the dataset at their
    /// recorded sizes, the unit's own file among them (the checksums are the sidecar's to
    /// check).
    pub(crate) fn intact(&self, unit: &str, files: &UnitFiles) -> Result<bool> {
        if !files.contains_key(unit) {
            return Ok(false);
        }
        match &self.place {
            Place::Store(p) => p.intact(files),
            Place::Dir(d) => {
                let dataset = fsutil::parent_of(d);
                Ok(files.iter().all(|(name, sums)| {
                    fsutil::regular_file_len(&dataset.join(name)) == Some(sums.bytes)
                }))
            }
        }
    }

    /// The units of `done` whose files are all in the dataset at their recorded sizes (see
    /// [`Parts::intact`]); a store is listed once for all of them.
    pub(crate) fn intact_units(
        &self,
        done: &BTreeMap<String, UnitFiles>,
    ) -> Result<std::collections::BTreeSet<String>> {
        let sizes: Option<BTreeMap<String, u64>> = match &self.place {
            Place::Store(p) => Some(p.dataset().list()?.into_iter().collect()),
            Place::Dir(_) => None,
        };
        let mut out = std::collections::BTreeSet::new();
        for (unit, files) in done {
            let whole = files.contains_key(unit)
                && match &sizes {
                    Some(sizes) => files
                        .iter()
                        .all(|(name, sums)| sizes.get(name) == Some(&sums.bytes)),
                    None => self.intact(unit, files)?,
                };
            if whole {
                out.insert(unit.clone());
            }
        }
        Ok(out)
    }

    /// Where a write in parts of `units` units, not committed, stands: the units recorded
    /// durable (`unit_index` tells a unit's index from its name) and the live claims; with
    /// the records, for a format's extras.
    pub(crate) fn status(
        &self,
        units: u64,
        unit_index: impl Fn(&str) -> Option<u64>,
    ) -> Result<(PartsStatus, BTreeMap<String, UnitFiles>)> {
        let done = self.done()?;
        let mut st = PartsStatus::new(false, units);
        st.done = done
            .keys()
            .filter_map(|n| unit_index(n))
            .filter(|&u| u < units)
            .collect();
        st.done.sort_unstable();
        st.claimed = self.live_claims()?;
        Ok((st, done))
    }

    /// Cleans up after the commit (its record is durable): the format's private `dirs` and
    /// `files` (relative to the dataset), then the state itself. A later open, status or
    /// commit finishes what a kill cuts short.
    pub(crate) fn clean_after_commit(self, dirs: &[&str], files: &[&str]) -> Result<()> {
        if let Place::Store(p) = &self.place {
            for d in dirs {
                p.delete_under(d, &[])?;
            }
            for f in files {
                p.dataset().delete(f)?;
            }
            return p.remove();
        }
        let dataset = fsutil::parent_of(self.dir()?).to_path_buf();
        for d in dirs {
            // One piece a unit: removed several at a time, as the records are.
            fsutil::remove_dir_files_parallel(&dataset.join(d))?;
        }
        for f in files {
            let p = dataset.join(f);
            match fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&p, e)),
                _ => {}
            }
        }
        self.remove()?;
        fsutil::fsync_dir(&dataset)
    }

    /// Removes the parts state (after the commit record is durable): the unit records, one
    /// file per unit, several at a time (see `fsutil::remove_dir_files_parallel`).
    pub(crate) fn remove(self) -> Result<()> {
        if let Place::Store(p) = &self.place {
            return p.remove();
        }
        let dir = self.dir()?;
        fsutil::remove_dir_files_parallel(&dir.join("done"))?;
        // A rank reaching its commit while this runs can create commit.lock again after it was
        // removed (the directory is then not empty): removed on the next try; that rank finds
        // the dataset committed.
        let mut tries = 0;
        loop {
            match fs::remove_dir_all(dir) {
                Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty && tries < 3 => {
                    tries += 1;
                }
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(dir, e))
                }
                _ => return Ok(()),
            }
        }
    }
}

/// A unit's record: the checksums of its files.
pub(super) fn record_bytes(files: &UnitFiles) -> Vec<u8> {
    let sums = files
        .iter()
        .map(|(name, s)| (name.clone(), s.to_json()))
        .collect();
    let v = Value::Object(vec![("files".into(), Value::Object(sums))]);
    json::to_compact(&v, true, json::Escape::Ascii).into_bytes()
}

pub(super) fn parse_record(bytes: &[u8], path: &Path) -> Result<UnitFiles> {
    let bad = |why: &str| {
        Error::format(
            path,
            format!("a part's record that {why} (records are written whole: it was damaged; delete it and that unit is written again)"),
        )
    };
    let v = json::parse(bytes).map_err(|_| bad("is not JSON"))?;
    let Some(Value::Object(files)) = v.get("files") else {
        return Err(bad("has no `files` object"));
    };
    let mut out = UnitFiles::new();
    for (name, s) in files {
        out.insert(name.clone(), FileSums::from_json(s, name, path)?);
    }
    Ok(out)
}

/// Where a dataset written in parts stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartsStatus {
    /// Whether the dataset is committed (complete; readers see it).
    pub committed: bool,
    /// How many units (shards) the dataset has.
    pub units: u64,
    /// The units durable, in order.
    pub done: Vec<u64>,
    /// The live claims: units and who holds them.
    pub claimed: Vec<(Range<u64>, String)>,
    /// Files the commit still waits for besides the units (an EAGLE-3 cache's
    /// `target_embeddings.safetensors`, declared by its ranks, until one of them writes it).
    pub missing_files: Vec<String>,
}

impl PartsStatus {
    /// A status of `units` units, none durable, none claimed, no file missing.
    pub(crate) fn new(committed: bool, units: u64) -> PartsStatus {
        PartsStatus {
            committed,
            units,
            done: Vec::new(),
            claimed: Vec::new(),
            missing_files: Vec::new(),
        }
    }

    /// A committed dataset of `units` units: every one durable.
    pub(crate) fn committed(units: u64) -> PartsStatus {
        let mut st = PartsStatus::new(true, units);
        st.done = (0..units).collect();
        st
    }

    /// The units not durable yet, as ranges.
    pub fn missing(&self) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        let mut done = self.done.iter().peekable();
        for u in 0..self.units {
            while done.next_if(|&&d| d < u).is_some() {}
            if done.peek() == Some(&&u) {
                continue;
            }
            match out.last_mut() {
                Some(r) if r.end == u => r.end = u + 1,
                _ => out.push(u..u + 1),
            }
        }
        out
    }

    /// What a restart with `world_size` ranks would write: for each rank, its units still
    /// missing (empty for a rank with nothing left).
    pub fn resume_plan(&self, world_size: u64) -> Vec<Vec<Range<u64>>> {
        let missing = self.missing();
        (0..world_size.max(1))
            .map(|r| {
                let part = part_of(
                    self.units,
                    Rank {
                        rank: r,
                        world_size: world_size.max(1),
                    },
                );
                missing
                    .iter()
                    .filter_map(|m| {
                        let r = m.start.max(part.start)..m.end.min(part.end);
                        (!r.is_empty()).then_some(r)
                    })
                    .collect()
            })
            .collect()
    }

    /// The status as JSON (the CLI's `status --json`, Python's dict).
    pub fn to_json(&self) -> Value {
        let ranges = |rs: &[Range<u64>]| {
            Value::Array(
                rs.iter()
                    .map(|r| Value::Array(vec![Value::int(r.start), Value::int(r.end)]))
                    .collect(),
            )
        };
        let mut fields = vec![
            ("committed".into(), Value::Bool(self.committed)),
            ("units".into(), Value::int(self.units)),
            ("done".into(), Value::int(self.done.len() as u64)),
            ("missing".into(), ranges(&self.missing())),
        ];
        if !self.missing_files.is_empty() {
            // Only where a format has such files: the others' status stays as it was.
            fields.push((
                "missing_files".into(),
                Value::Array(
                    self.missing_files
                        .iter()
                        .map(|f| Value::String(f.clone()))
                        .collect(),
                ),
            ));
        }
        fields.push((
            "claimed".into(),
            Value::Array(
                self.claimed
                    .iter()
                    .map(|(r, who)| {
                        Value::Object(vec![
                            (
                                "units".into(),
                                Value::Array(vec![Value::int(r.start), Value::int(r.end)]),
                            ),
                            ("by".into(), Value::String(who.clone())),
                        ])
                    })
                    .collect(),
            ),
        ));
        Value::Object(fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: u64, w: u64) -> Rank {
        Rank::new(r, w).unwrap()
    }

    #[test]
    fn parts_cover_every_unit_once_in_order_the_first_ones_longer() {
        for units in [0u64, 1, 2, 7, 10, 1000, 1001] {
            for w in [1u64, 2, 3, 4, 8, 13] {
                let parts: Vec<Range<u64>> = (0..w).map(|r| part_of(units, rank(r, w))).collect();
                let mut next = 0;
                for (r, p) in parts.iter().enumerate() {
                    assert_eq!(p.start, next, "units {units} world {w} rank {r}");
                    next = p.end;
                    let len = p.end - p.start;
                    assert!(len == units / w || len == units / w + 1);
                    assert_eq!(len == units / w + 1, (r as u64) < units % w);
                }
                assert_eq!(next, units);
            }
        }
        assert_eq!(part_of(10, rank(0, 3)), 0..4);
        assert_eq!(part_of(10, rank(2, 3)), 7..10);
        assert_eq!(part_of(2, rank(3, 4)), 2..2);
    }

    #[test]
    fn the_rank_comes_from_the_launchers_variables_and_bad_ones_are_named() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(Rank::from_vars(env(&[])).unwrap(), rank(0, 1));
        assert_eq!(
            Rank::from_vars(env(&[("RANK", "3"), ("WORLD_SIZE", "8")])).unwrap(),
            rank(3, 8)
        );
        assert_eq!(
            Rank::from_vars(env(&[
                ("SLURM_ARRAY_TASK_ID", "5"),
                ("SLURM_ARRAY_TASK_MIN", "1"),
                ("SLURM_ARRAY_TASK_COUNT", "6"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
            ]))
            .unwrap(),
            rank(4, 6)
        );
        assert_eq!(
            Rank::from_vars(env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")])).unwrap(),
            rank(1, 2)
        );
        let e = Rank::from_vars(env(&[("RANK", "2")])).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE"), "{e}");
        let e = Rank::from_vars(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK=\"x\""), "{e}");
        let e = Rank::from_vars(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK=2"), "{e}");
        assert!(Rank::new(0, 0).is_err());
    }

    #[test]
    fn an_overlapping_live_claim_is_refused_naming_its_holder_and_a_dead_ones_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let parts = Parts::open(dir.path()).unwrap();
        let a = parts.claim(0..4, rank(0, 2)).unwrap();
        let b = parts.claim(4..8, rank(1, 2)).unwrap();
        let e = parts.claim(3..6, rank(0, 3)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::LockedRemote { .. }), "{e:?}");
        assert!(
            msg.contains("rank 0 of 2") && msg.contains("units 0..4"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert_eq!(
            parts.live_claims().unwrap(),
            vec![
                (0..4, holder_text(rank(0, 2))),
                (4..8, holder_text(rank(1, 2)))
            ]
        );
        // A claim's file left by a dead holder (no lock on it) is taken over.
        drop(a);
        std::fs::write(
            dir.path()
                .join(PARTS_DIR)
                .join("claims")
                .join(claim_name(&(0..5))),
            "rank 0 of 2, pid 1 on gone",
        )
        .unwrap();
        let c = parts.claim(0..4, rank(0, 2)).unwrap();
        assert_eq!(parts.live_claims().unwrap().len(), 2);
        drop((b, c));
        assert!(parts.live_claims().unwrap().is_empty());
        // Ranks past the units (units 8, world 12) claim nothing, so never contend.
        let past = (0..2)
            .map(|r| parts.claim(8..8, rank(10 + r, 12)).unwrap())
            .collect::<Vec<_>>();
        assert!(parts.live_claims().unwrap().is_empty());
        drop(past);
    }

    #[test]
    fn a_commit_whose_lock_was_taken_over_waits_its_turn_and_finds_the_dataset_committed() {
        use std::cell::Cell;
        let lost = || Error::LockedRemote {
            path: PathBuf::from("s3://b/ds/.shardkit-parts/commit.lock"),
            why: "taken over".into(),
        };
        // Lost twice, then the attempt finds the other rank's commit done.
        let tries = Cell::new(0);
        let done = commit_surviving_takeover(
            || {
                tries.set(tries.get() + 1);
                if tries.get() < 3 {
                    Err(lost())
                } else {
                    Ok(true)
                }
            },
            || Ok(false),
        );
        assert!(done.unwrap());
        assert_eq!(tries.get(), 3);
        // Lost every time: the third loss is the caller's error.
        let tries = Cell::new(0);
        let e = commit_surviving_takeover(
            || {
                tries.set(tries.get() + 1);
                Err::<bool, _>(lost())
            },
            || Ok(false),
        )
        .unwrap_err();
        assert!(matches!(e, Error::LockedRemote { .. }), "{e}");
        assert_eq!(tries.get(), 3);
        // Any failure with the dataset committed meanwhile (a piece removed by the other
        // rank's cleanup) is the other rank's success.
        let gone = || Error::NotFound {
            path: PathBuf::from("s3://b/ds/.shardkit-labels/shard_00001"),
            what: "removed".into(),
        };
        assert!(commit_surviving_takeover(|| Err(gone()), || Ok(true)).unwrap());
        // Not committed and not a lost lock: the error, at once.
        let tries = Cell::new(0);
        let e = commit_surviving_takeover(
            || {
                tries.set(tries.get() + 1);
                Err::<bool, _>(gone())
            },
            || Ok(false),
        )
        .unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        assert_eq!(tries.get(), 1);
        // A flat-tokens split's commit lock is one too; another lock object is not.
        for (lock, tried) in [(".shardkit-parts/train/commit.lock", 2), ("claims/0-1", 1)] {
            let tries = Cell::new(0);
            let done = commit_surviving_takeover(
                || {
                    tries.set(tries.get() + 1);
                    match tries.get() {
                        1 => Err(Error::LockedRemote {
                            path: PathBuf::from(format!("s3://b/ds/{lock}")),
                            why: "taken over".into(),
                        }),
                        _ => Ok(true),
                    }
                },
                || Ok(false),
            );
            assert_eq!(done.is_ok(), tried == 2, "{lock}");
            assert_eq!(tries.get(), tried, "{lock}");
        }
    }

    #[test]
    fn the_commit_lock_of_a_removed_parts_state_says_so_instead_of_failing() {
        let dir = tempfile::tempdir().unwrap();
        let parts = Parts::open(dir.path()).unwrap();
        assert!(parts.commit_lock().unwrap().is_some());
        // Another rank committed and removed the state while this one waited.
        parts.clone().remove().unwrap();
        assert!(parts.commit_lock().unwrap().is_none());
    }

    #[test]
    fn done_records_round_trip_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let parts = Parts::open(dir.path()).unwrap();
        let mut files = UnitFiles::new();
        files.insert("acts000001.bin".into(), FileSums::of_bytes(b"shard"));
        files.insert(
            ".shardkit-labels/acts000001.bin".into(),
            FileSums::of_bytes(b"l"),
        );
        parts.record_done("acts000001.bin", &files).unwrap();
        let done = parts.done().unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done["acts000001.bin"], files);
        parts.forget("acts000001.bin").unwrap();
        assert!(parts.done().unwrap().is_empty());
        let bad = dir.path().join(PARTS_DIR).join("done").join("x.json");
        std::fs::write(&bad, b"{\"files\": 3}").unwrap();
        let e = parts.done().unwrap_err();
        assert!(
            e.to_string().contains("x.json") && e.to_string().contains("damaged"),
            "{e}"
        );
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a rank's missing units: one range each here
    fn a_status_names_missing_units_and_what_each_rank_of_a_restart_writes() {
        let mut s = PartsStatus::new(false, 10);
        s.done = vec![0, 1, 2, 5, 9];
        assert_eq!(s.missing(), vec![3..5, 6..9]);
        assert_eq!(s.resume_plan(2), [[3..5], [6..9]]);
        assert_eq!(
            s.resume_plan(3),
            vec![vec![3..4], vec![4..5, 6..7], vec![7..9]]
        );
        let j = json::to_compact(&s.to_json(), false, json::Escape::Utf8);
        assert!(j.contains("\"missing\":[[3,5],[6,9]]"), "{j}");
    }
}
