//! Batches of a flat-tokens split in seqax's shuffled order (flat_tokens.md §5, §9.5–9.7).
//!
//! Step `t` is computed in closed form ([`Schedule`]) and only its own rows are read: a packed
//! row is one range of `len` tokens; an unpacked row is one document, truncated to `len` and
//! right-padded (seqax's pad value, encoded 1) with `mask` false on the padding. Offsets are
//! absolute, so every read block is correct (seqax's unpacked mode is not). On the engine, each
//! row is read, decoded and written into every array of the batch by one gather thread, and
//! [`TokenLoader::iter`] prepares the next steps while the caller uses one.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::checksum::{self, Verifier};
use crate::engine::exec::{self, Context, GatherCell, GatherPool, Job, Prepared, StreamOptions};
use crate::error::{Error, Result};
use crate::flat_tokens::batch::batch_layout;
use crate::flat_tokens::decode::decode_into;
use crate::flat_tokens::seqax::{Schedule, ShuffleParams};
use crate::flat_tokens::{Split, TokenBatch};
use crate::io::buffer::{BufferPool, Field};
use crate::io::local;

/// How rows are cut from the token stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// Row i is tokens `[i·len, (i+1)·len)`; documents run across rows.
    Packed,
    /// Row i is document i (truncated to `len`, padded).
    Unpacked,
}

/// flat-tokens' own loader knobs (fields of [`LoaderOptions`] through `Deref`): seqax's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOptions {
    /// Tokens per row (seqax's `len`).
    pub seq_len: u64,
    /// Packed rows (default) or one document per row.
    pub packing: Packing,
    /// Streams S (seqax recommends the maximum number of hosts); must divide `batch_size`.
    pub streams: u64,
    /// Read blocks per shuffle buffer R (seqax recommends 1024).
    pub read_blocks_per_shuffle_buffer: u64,
    /// Sequences per read block B; `None` is seqax's recommendation, `2^20 / seq_len`.
    pub sequences_per_read_block: Option<u64>,
    /// Past the last step, continue with epoch `step / step_count` in a new deterministic
    /// order instead of failing (epoch 0 is seqax's order).
    pub epochs: bool,
    /// Read each shuffle buffer whole into memory when a step first needs it, and serve its
    /// rows from there (seqax's own strategy): a few large reads per buffer instead of one
    /// small read per row. While [`TokenLoader::iter`] serves a minipoch, the next minipoch's
    /// buffers (with `epochs`, the next epoch's first) are read in the background, so memory
    /// holds two minipochs' buffers. `None` (the default) does so for splits in an object
    /// store whose two minipochs' buffers fit in `SHARDKIT_TOKEN_BUFFER_GIB` (16 by default)
    /// and reads row by row otherwise; `Some(true)` always (e.g. seqax's compressed 4 Mi-token
    /// chunks on a parallel file system), `Some(false)` never.
    pub buffer_in_memory: Option<bool>,
}

/// Everything that decides which rows a step holds, plus this host's share: the common knobs
/// and [`TokenOptions`]. Here `batch_size` is rows per step over all hosts (seqax's `batch`);
/// host `rank` of `world_size` (seqax's `host_index` of `host_count`;
/// default host 0 of 1, not `$RANK`) serves rows
/// `[h·batch/H, (h+1)·batch/H)` of every step. The order is seqax's shuffled one (any
/// shuffled `order`; `Sequential` is refused), batches are always full (`drop_last`), steps
/// count across epochs (`epoch` must be 0: iterate from step `epoch × step_count`), and
/// `threads` read and decode rows (a step's rows, and the next steps', concurrently). `verify`
/// checks the chunk (shard) files a step reads before decoding them, each file again only when
/// it has left the page cache since.
pub type LoaderOptions = crate::engine::LoaderOptions<TokenOptions>;

impl crate::engine::LoaderOptions<TokenOptions> {
    /// Packed rows of `seq_len`, `batch_size` rows a step, seqax's recommended shuffle
    /// (S = 1, R = 1024, B = 2^20 / seq_len), seed 0, one host, no epochs.
    pub fn new(seq_len: u64, batch_size: u64) -> LoaderOptions {
        let mut o = LoaderOptions::with_format(
            batch_size,
            TokenOptions {
                seq_len,
                packing: Packing::Packed,
                streams: 1,
                read_blocks_per_shuffle_buffer: 1024,
                sequences_per_read_block: None,
                epochs: false,
                buffer_in_memory: None,
            },
        );
        o.drop_last = true;
        o
    }

    /// (host_index, host_count): `rank` and `world_size`, host 0 of 1 by default.
    pub(crate) fn host(&self) -> (u64, u64) {
        (self.rank.unwrap_or(0), self.world_size.unwrap_or(1))
    }

    /// seqax's shuffle parameters.
    pub(crate) fn shuffle_params(&self) -> ShuffleParams {
        ShuffleParams {
            batch: self.batch_size,
            streams: self.streams,
            read_blocks_per_shuffle_buffer: self.read_blocks_per_shuffle_buffer,
            sequences_per_read_block: self
                .sequences_per_read_block
                .unwrap_or(((1u64 << 20) / self.seq_len.max(1)).max(1)),
            seed: self.seed,
        }
    }
}

/// Largest batch held in memory (elements of `rows × seq_len`).
const MAX_BATCH_TOKENS: u64 = 1 << 31;
/// Steps prepared ahead of the caller by [`TokenLoader::iter`].
const PREFETCH: usize = 4;
/// Default bound on the shuffle buffers held in memory when reading from an object store.
const BUFFER_GIB: u64 = 16;
/// Tokens of a buffer fetched together (a v3 shard's worth by default, 32 MB or so stored).
const GROUP_TOKENS: u64 = 1 << 24;

/// [`GROUP_TOKENS`], or `SHARDKIT_TEST_TOKEN_GROUP` (tests only: small datasets in many
/// groups). It also bounds the longest contiguous piece of a buffer in memory, so that a
/// buffer of long contiguous runs still comes in many groups.
fn group_tokens() -> u64 {
    crate::config::test_token_group().unwrap_or(GROUP_TOKENS)
}

/// Most groups of a buffer fetched at once.
const MAX_LANES: u64 = 16;

/// How a buffer of `tokens` tokens is fetched: (tokens per group, groups fetched at once).
/// Locally, groups of [`group_tokens`], 4 at once (reads of local files are quick, and a cold
/// disk gains from a few in flight). From a store, enough groups at once to ask for twice
/// `inflight` requests of the request size (2 to 16 groups); and a buffer too small to give
/// every lane a full group is cut into smaller ones (down to a decode piece, 1 Mi tokens), so
/// that a small buffer (a minipoch of a small R) still keeps the store's slots busy rather
/// than fetching two groups' few requests at a time.
fn fetch_plan(path: &std::path::Path, tokens: u64) -> (u64, usize) {
    let slot_bytes = crate::config::inflight() as u64 * crate::config::max_request();
    let remote = !crate::io::is_local(path);
    plan_groups(remote, tokens, group_tokens(), slot_bytes)
}

/// [`fetch_plan`] for groups of at most `full` tokens and request slots of `slot_bytes` in all.
fn plan_groups(remote: bool, tokens: u64, full: u64, slot_bytes: u64) -> (u64, usize) {
    if !remote {
        return (full, 4);
    }
    let group = tokens
        .div_ceil(MAX_LANES)
        .clamp(crate::flat_tokens::split::DECODE_PIECE.min(full), full);
    // Twice the slots' bytes asked for, at about 2 stored bytes per token (zstd over typical
    // token ids): a group's tokens. Twice, because a lane waits a round trip whenever its group
    // enters a shard whose index is not yet held, and at its group's last request; the other
    // lanes' requests, queued behind, keep the slots busy meanwhile.
    let lanes = slot_bytes.div_ceil(group).clamp(2, MAX_LANES);
    (group, lanes as usize)
}

/// Groups of a shuffle buffer being decoded, at most a given number at once
/// ([`TokenLoader::read_buffer`]).
#[derive(Default)]
struct DecodeSlots {
    taken: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

impl DecodeSlots {
    /// Waits until fewer than `most` are taken, and takes one (given back when dropped, a
    /// panicking decode's too).
    fn take(&self, most: usize) -> DecodeSlot<'_> {
        let mut n = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= most {
            n = self.freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
        DecodeSlot(self)
    }
}

struct DecodeSlot<'a>(&'a DecodeSlots);

impl Drop for DecodeSlot<'_> {
    fn drop(&mut self) {
        *self.0.taken.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

/// One stream's shuffle buffer of one minipoch, in memory: the tokens of every sequence it
/// holds (a packed row, or a document cut to the row length).
struct Resident {
    /// (epoch, minipoch, stream).
    key: (u64, u64, u64),
    pieces: Vec<Vec<u32>>,
    /// Sequence → (piece, first token in it, tokens).
    rows: std::collections::HashMap<u64, (usize, usize, usize)>,
}

impl Resident {
    fn tokens(&self, seq: u64) -> Result<&[u32]> {
        let &(p, at, n) = self.rows.get(&seq).ok_or_else(|| {
            Error::Internal(format!(
                "internal: sequence {seq} is not in shuffle buffer {:?}",
                self.key
            ))
        })?;
        self.pieces
            .get(p)
            .and_then(|piece| piece.get(at..at + n))
            .ok_or_else(|| Error::Internal("internal: a buffer row is out of its piece".into()))
    }
}

struct Inner {
    split: Split,
    opts: LoaderOptions,
    n_seq: u64,
    epoch0: Arc<Schedule>,
    /// The later epochs' schedules most recently used: the one served, and the next one,
    /// whose first buffers are read ahead.
    later: Mutex<Vec<Arc<Schedule>>>,
    info: LoaderInfo,
    /// Gathers (decodes) rows; started on first use and kept.
    gather: GatherCell,
    /// Batch buffers, recycled.
    buffers: Mutex<BufferPool>,
    /// With `verify`: the checksums of the split's files.
    verify: Option<FileVerifier>,
    /// Shuffle buffers in memory (see [`LoaderOptions::buffer_in_memory`]) of the process
    /// using them; `None` when rows are read one by one.
    residents: Option<Mutex<(u32, Arc<Residents>)>>,
    /// Whether [`TokenLoader::iter`] has run (plain `load` calls may jump anywhere, so they do
    /// not read ahead).
    streaming: std::sync::atomic::AtomicBool,
}

/// The shuffle buffers one process holds. A forked child (a DataLoader worker) starts with
/// none of its own: the parent's locks may be held by threads the child does not have, and
/// its reads ahead run on such threads, so the child must not touch either.
#[derive(Default)]
struct Residents {
    /// The buffers of the minipoch being served.
    held: Mutex<Vec<Arc<Resident>>>,
    /// Under [`TokenLoader::iter`]: the next minipoch's buffers, being read in the background.
    ahead: Mutex<Vec<ReadAhead>>,
}

/// A shuffle buffer being read on a thread of its own.
struct ReadAhead {
    key: (u64, u64, u64),
    /// The read's result, once it is done (disconnected: the thread panicked).
    read: std::sync::mpsc::Receiver<Result<Resident>>,
    /// Set to stop the read (its iterator was dropped): no further group is fetched.
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl ReadAhead {
    /// The buffer, once read; gives up (and stops the read) once `stop`, the waiting stream's,
    /// is set.
    fn wait(self, stop: &std::sync::atomic::AtomicBool) -> Result<Resident> {
        use std::sync::mpsc::RecvTimeoutError;
        loop {
            match self.read.recv_timeout(exec::STOP_POLL) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Timeout) => {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
                        return Err(exec::stopped_error());
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Internal("a buffer read-ahead panicked".into()))
                }
            }
        }
    }
}

/// The split's files with their checksums, mapped on first use.
struct FileVerifier {
    v: Verifier,
    index: std::collections::HashMap<std::path::PathBuf, usize>,
    paths: Vec<std::path::PathBuf>,
    maps: Vec<std::sync::OnceLock<memmap2::Mmap>>,
}

impl FileVerifier {
    fn open(split: &Split) -> Result<FileVerifier> {
        let root = crate::fsutil::parent_of(split.path()).to_path_buf();
        let name = split
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (sidecar, base, names) = checksum::dataset_files(&root)?;
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| n.starts_with(&format!("{name}/")))
            .collect();
        let v = Verifier::open(&sidecar, &base, &names)?;
        let paths: Vec<_> = names.iter().map(|n| base.join(n)).collect();
        Ok(FileVerifier {
            v,
            index: paths
                .iter()
                .cloned()
                .enumerate()
                .map(|(i, p)| (p, i))
                .collect(),
            maps: paths.iter().map(|_| std::sync::OnceLock::new()).collect(),
            paths,
        })
    }

    fn map(&self, i: usize) -> Result<&[u8]> {
        if let Some(m) = self.maps[i].get() {
            return Ok(m);
        }
        let p = &self.paths[i];
        let f = crate::fsutil::open_regular(p)?;
        let len = f.metadata().map_err(|e| Error::io(p, e))?.len();
        if len == 0 {
            return Ok(&[]);
        }
        let _ = self.maps[i].set(local::map_file(&f, p, len)?);
        self.maps[i]
            .get()
            .map(|m| &m[..])
            .ok_or_else(|| Error::Internal("internal: a map vanished".into()))
    }

    /// Checks every block of `files` (whole files: decoding reads a chunk whole) that needs it.
    fn ensure(
        &self,
        files: impl IntoIterator<Item = std::path::PathBuf>,
        pool: &GatherPool,
    ) -> Result<()> {
        let mut touched = Vec::new();
        for f in files {
            let i = *self.index.get(&f).ok_or_else(|| {
                Error::format(&f, "is not covered by the dataset's checksums sidecar")
            })?;
            let len = self.map(i)?.len() as u64;
            touched.extend(self.v.blocks(i, 0..len));
        }
        self.v.ensure(touched, |i| self.map(i), pool.pool())
    }
}

/// What a [`TokenLoader`] serves, fixed when it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoaderInfo {
    /// Steps in an epoch (seqax's `step_count`).
    pub step_count: u64,
    /// The batch rows this host serves.
    pub host_rows: Range<u64>,
    /// Bytes of one batch's buffer (every array).
    pub batch_bytes: usize,
    /// Whether shuffle buffers are read whole into memory (see
    /// [`TokenOptions::buffer_in_memory`]).
    pub buffers_in_memory: bool,
    /// Sequences per read block actually used (B).
    pub sequences_per_read_block: u64,
    /// Read blocks of epoch 0's shuffle.
    pub read_blocks: u64,
    /// Minipochs (shuffle buffers per stream) of epoch 0's shuffle.
    pub minipochs: u64,
}

/// seqax-compatible loader over one split; cheap to clone (shared state).
#[derive(Clone)]
pub struct TokenLoader {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TokenLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenLoader")
            .field("split", &self.inner.split)
            .field("options", &self.inner.opts)
            .field("info", &self.inner.info)
            .finish()
    }
}

impl TokenLoader {
    /// A loader over `split`.
    pub fn new(split: Split, opts: LoaderOptions) -> Result<Self> {
        if opts.seq_len == 0 {
            return Err(Error::Invalid("seq_len must be at least 1".into()));
        }
        let (host_index, host_count) = opts.host();
        if host_count == 0 || host_index >= host_count {
            return Err(Error::Invalid(format!(
                "host_index {host_index} must be below host_count {host_count} (and host_count at \
                 least 1)"
            )));
        }
        if !opts.batch_size.is_multiple_of(host_count) {
            return Err(Error::Invalid(format!(
                "batch_size {} must be a multiple of host_count {host_count}",
                opts.batch_size
            )));
        }
        if !opts.shuffled() || !opts.drop_last || opts.epoch != 0 {
            return Err(Error::Invalid(
                "flat-tokens batches follow seqax's shuffled order, full batches only, with steps \
                 counted across epochs (order must be shuffled, drop_last true and epoch 0)"
                    .into(),
            ));
        }
        let per_host = opts.batch_size / host_count;
        if per_host.saturating_mul(opts.seq_len) > MAX_BATCH_TOKENS {
            return Err(Error::Invalid(format!(
                "{per_host} rows of {} tokens per step exceed {MAX_BATCH_TOKENS} tokens",
                opts.seq_len
            )));
        }
        let n_seq = match opts.packing {
            Packing::Packed => split.token_count() / opts.seq_len,
            Packing::Unpacked => split.seq_count(),
        };
        let epoch0 = Arc::new(Schedule::new(n_seq, opts.shuffle_params())?);
        let verify = if opts.verify {
            Some(FileVerifier::open(&split)?)
        } else {
            None
        };
        let host_rows = host_index * per_host..(host_index + 1) * per_host;
        let in_memory = match opts.buffer_in_memory {
            Some(yes) => yes,
            None => {
                // Two minipochs' buffers: the one served and the next, read ahead.
                let two = buffer_bytes(&epoch0, &host_rows, opts.seq_len).saturating_mul(2);
                !crate::io::is_local(split.path()) && two <= buffer_cap()?
            }
        };
        let info = LoaderInfo {
            step_count: epoch0.step_count(),
            batch_bytes: batch_layout(per_host, opts.seq_len).1,
            host_rows,
            buffers_in_memory: in_memory,
            sequences_per_read_block: epoch0.params().sequences_per_read_block,
            read_blocks: epoch0.read_blocks(),
            minipochs: epoch0.minipochs(),
        };
        Ok(TokenLoader {
            inner: Arc::new(Inner {
                split,
                opts,
                n_seq,
                epoch0,
                later: Mutex::new(Vec::new()),
                info,
                gather: GatherCell::default(),
                buffers: Mutex::new(BufferPool::new(PREFETCH + 6)),
                verify,
                residents: in_memory.then(|| Mutex::new((std::process::id(), Arc::default()))),
                streaming: Default::default(),
            }),
        })
    }

    /// What the loader serves: step count, this host's rows, batch size in bytes, and the
    /// shuffle it follows.
    pub fn info(&self) -> &LoaderInfo {
        &self.inner.info
    }
    /// Steps in an epoch.
    pub(crate) fn step_count(&self) -> u64 {
        self.inner.info.step_count
    }
    /// Epoch 0's schedule (seqax's order).
    #[cfg(test)]
    pub(crate) fn schedule(&self) -> &Schedule {
        &self.inner.epoch0
    }
    /// The split.
    pub(crate) fn split(&self) -> &Split {
        &self.inner.split
    }
    /// The options.
    pub(crate) fn options(&self) -> &LoaderOptions {
        &self.inner.opts
    }
    /// The batch rows this host serves.
    pub(crate) fn host_rows(&self) -> Range<u64> {
        self.inner.info.host_rows.clone()
    }
    /// Gathers batches into `pool` from now on (e.g. pinned host memory for copies to a GPU;
    /// each buffer must hold [`LoaderInfo::batch_bytes`]).
    pub fn set_batch_buffers(&self, pool: BufferPool) {
        *self.inner.buffers.lock().unwrap_or_else(|e| e.into_inner()) = pool;
    }

    /// The arrays of a batch of `rows` rows and the bytes they need.
    fn layout(&self, rows: u64) -> (Vec<Field>, usize) {
        batch_layout(rows, self.inner.opts.seq_len)
    }

    /// The gather pool, started on first use.
    fn gather_pool(&self) -> Result<Arc<GatherPool>> {
        // From an object store each thread waits on one request at a time (zarrs reads are
        // blocking calls): by default as many threads as requests should be in flight.
        let threads = match self.inner.opts.threads {
            0 if !crate::io::is_local(self.inner.split.path()) => crate::config::inflight(),
            t => t,
        };
        self.inner.gather.get(threads)
    }

    /// The schedule of `step` and the step within its epoch.
    fn locate(&self, step: u64) -> Result<(Arc<Schedule>, u64)> {
        let n = self.step_count();
        if step < n {
            return Ok((self.inner.epoch0.clone(), step));
        }
        if !self.inner.opts.epochs {
            return Err(Error::OutOfRange {
                what: "step (enable epochs to continue past the end in a new order)",
                index: step.min(i64::MAX as u64) as i64,
                len: n,
            });
        }
        Ok((self.schedule_of(step / n)?, step % n))
    }

    /// The schedule of `epoch` (a later epoch only with epochs enabled).
    fn schedule_of(&self, epoch: u64) -> Result<Arc<Schedule>> {
        if epoch == 0 {
            return Ok(self.inner.epoch0.clone());
        }
        let mut later = self.inner.later.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = later.iter().find(|s| s.epoch() == epoch) {
            return Ok(s.clone());
        }
        let s = Arc::new(Schedule::for_epoch(
            self.inner.n_seq,
            self.inner.opts.shuffle_params(),
            epoch,
        )?);
        if later.len() == 2 {
            later.remove(0);
        }
        later.push(s.clone());
        Ok(s)
    }

    /// This process's shuffle buffers, with buffers in memory (a forked child leaves its
    /// parent's alone, leaked).
    fn residents(&self) -> Option<Arc<Residents>> {
        let residents = self.inner.residents.as_ref()?;
        let mut r = residents.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if r.0 != pid {
            std::mem::forget(std::mem::replace(&mut *r, (pid, Arc::default())));
        }
        Some(r.1.clone())
    }

    /// The in-memory shuffle buffer `key` = (epoch, minipoch, stream) of `schedule`: held, or
    /// read ahead (waited for), or read now. Buffers of earlier minipochs are let go (steps
    /// already prepared keep theirs). Under [`TokenLoader::iter`], the same stream's buffer of
    /// the next minipoch is read ahead ([`TokenLoader::read_ahead`]), so that only the first
    /// minipoch's steps wait for a whole read: once this buffer is read, or, when it was read
    /// ahead, as soon as it is asked for. A read (or the wait for one ahead) gives up once
    /// `stop` (the stream's) is set: a dropped iterator does not wait for a buffer of
    /// gigabytes.
    fn resident(
        &self,
        schedule: &Arc<Schedule>,
        key: (u64, u64, u64),
        residents: &Residents,
        stop: &Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Arc<Resident>> {
        let mut held = residents.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = held.iter().find(|r| r.key == key) {
            return Ok(r.clone());
        }
        held.retain(|r| (r.key.0, r.key.1) == (key.0, key.1));
        // Not held while waiting, so that a dropped iterator can stop the reads ahead.
        let pending = {
            let mut ahead = residents.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let i = ahead.iter().position(|a| a.key == key);
            i.map(|i| ahead.swap_remove(i))
        };
        let r = match pending {
            Some(a) => {
                // This minipoch's read is under way, and the one before it is served: the next
                // read starts now, so that reads follow one another without a gap (its requests
                // queue behind this read's). Memory still holds two minipochs' buffers.
                self.read_ahead(schedule, key, residents)?;
                a.wait(stop)?
            }
            // The first minipoch read has the requests to itself: the first step waits for it.
            None => {
                let r = self.read_buffer(schedule, key, stop)?;
                self.read_ahead(schedule, key, residents)?;
                r
            }
        };
        let r = Arc::new(r);
        held.push(r.clone());
        Ok(r)
    }

    /// Under [`TokenLoader::iter`], starts reading the same stream's buffer of the minipoch
    /// after `key`'s on a thread of its own, unless it is read already: the next of the epoch,
    /// or with epochs enabled the next epoch's first. Reads ahead of minipochs already passed
    /// are stopped and let go.
    fn read_ahead(
        &self,
        schedule: &Arc<Schedule>,
        key: (u64, u64, u64),
        residents: &Residents,
    ) -> Result<()> {
        let streaming = self
            .inner
            .streaming
            .load(std::sync::atomic::Ordering::Relaxed);
        if !streaming {
            return Ok(());
        }
        let (next, schedule) = if key.1 + 1 < schedule.minipochs() {
            ((key.0, key.1 + 1, key.2), schedule.clone())
        } else if self.inner.opts.epochs && key.0 < u64::MAX {
            ((key.0 + 1, 0, key.2), self.schedule_of(key.0 + 1)?)
        } else {
            return Ok(());
        };
        let mut ahead = residents.ahead.lock().unwrap_or_else(|e| e.into_inner());
        ahead.retain(|a| {
            let keep = (a.key.0, a.key.1) >= (next.0, next.1);
            if !keep {
                a.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            keep
        });
        if ahead.iter().any(|a| a.key == next) {
            return Ok(());
        }
        let me = self.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, read) = std::sync::mpsc::sync_channel(1);
        let stop2 = stop.clone();
        std::thread::Builder::new()
            .name("shardkit-buffer".into())
            .spawn(move || {
                let _ = tx.send(me.read_buffer(&schedule, next, &stop2));
            })
            .map_err(|e| Error::Thread {
                what: "a shuffle buffer's read-ahead".into(),
                source: e,
            })?;
        ahead.push(ReadAhead {
            key: next,
            read,
            stop,
        });
        Ok(())
    }

    /// Reads shuffle buffer `key` whole: its read blocks in file order, cut into contiguous
    /// pieces of at most a group's tokens, fetched in groups ([`fetch_plan`]: their size, and
    /// how many at once) and decoded in parallel as they arrive, several groups at once. Once
    /// `stop` is set, no further group is fetched, and from a store the requests of the groups
    /// being fetched are cut.
    fn read_buffer(
        &self,
        schedule: &Schedule,
        key: (u64, u64, u64),
        stop: &Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Resident> {
        let stopped = || stop.load(std::sync::atomic::Ordering::Relaxed);
        let split = &self.inner.split;
        let pool = self.gather_pool()?;
        let pool = pool.pool();
        let b = schedule.params().sequences_per_read_block;
        let len = self.inner.opts.seq_len;
        let mut blocks = schedule.buffer_blocks(key.1, key.2);
        blocks.sort_unstable();
        // Every sequence of the buffer with its token range, in file order.
        let mut seqs: Vec<(u64, Range<u64>)> = Vec::with_capacity(blocks.len() * b as usize);
        match self.inner.opts.packing {
            Packing::Packed => {
                for &k in &blocks {
                    seqs.extend((k * b..(k + 1) * b).map(|i| (i, i * len..(i + 1) * len)));
                }
            }
            Packing::Unpacked => {
                crate::fault::before_read(split.path())?;
                let ranges: Vec<Range<u64>> =
                    blocks.iter().map(|&k| k * b..(k + 1) * b + 1).collect();
                let starts = split.seq_starts_many(&ranges, pool)?;
                for (&k, st) in blocks.iter().zip(&starts) {
                    for (i, w) in st.windows(2).enumerate() {
                        let seq = k * b + i as u64;
                        if w[1] < w[0] || w[1] > split.token_count() {
                            return Err(Error::format(
                                split.path().join("seq_starts"),
                                format!(
                                    "sequence {seq} starts at token {} and ends before token \
                                     {}, outside the {} tokens of the split (seq_starts must \
                                     be non-decreasing and end at token_count)",
                                    w[0],
                                    w[1],
                                    split.token_count()
                                ),
                            ));
                        }
                        seqs.push((seq, w[0]..w[1].min(w[0] + len)));
                    }
                }
            }
        }
        // Contiguous spans of tokens, cut between sequences to stay within a piece.
        let total: u64 = seqs.iter().map(|(_, r)| r.end - r.start).sum();
        let (group, lanes) = fetch_plan(split.path(), total);
        let mut spans: Vec<Range<u64>> = Vec::new();
        let mut rows = std::collections::HashMap::with_capacity(seqs.len());
        for (seq, r) in seqs {
            let n = (r.end - r.start) as usize;
            let piece = spans.len();
            match spans.last_mut() {
                Some(last) if last.end == r.start && r.end - last.start <= group => {
                    rows.insert(seq, (piece - 1, (r.start - last.start) as usize, n));
                    last.end = r.end;
                }
                _ => {
                    rows.insert(seq, (piece, 0, n));
                    spans.push(r);
                }
            }
        }
        // Groups of spans of about `group` tokens, several fetched at once while those
        // already fetched decode (in whatever order they arrive): reading a buffer takes the
        // longer of fetching and decoding, not their sum.
        let mut groups: Vec<(usize, Vec<Range<u64>>)> = vec![(0, Vec::new())];
        let mut tokens = 0;
        let n_spans = spans.len();
        for (i, span) in spans.into_iter().enumerate() {
            if tokens >= group {
                groups.push((i, Vec::new()));
                tokens = 0;
            }
            tokens += span.end - span.start;
            groups.last_mut().expect("one group").1.push(span);
        }
        let fetch = |g: &[Range<u64>]| {
            crate::fault::before_read(split.path())?;
            split.fetch_encoded(g, Some(stop))
        };
        let lanes = lanes.min(groups.len()).max(1);
        let mut pieces: Vec<Vec<u32>> = vec![Vec::new(); n_spans];
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| -> Result<()> {
            // At most `lanes` groups fetched and waiting, `lanes` more being fetched.
            let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Result<_>)>(lanes);
            let (groups, next, fetch) = (&groups, &next, &fetch);
            let handles = (0..lanes)
                .map(|_| {
                    let tx = tx.clone();
                    let lane = std::thread::Builder::new().name("shardkit-fetch".into());
                    lane.spawn_scoped(scope, move || loop {
                        if stopped() {
                            return;
                        }
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((_, g)) = groups.get(i) else {
                            return;
                        };
                        if tx.send((i, fetch(g))).is_err() {
                            return; // the reader stopped at an error
                        }
                    })
                    .map_err(|e| Error::Thread {
                        what: "a shuffle buffer's fetch lanes shardkit-fetch".into(),
                        source: e,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            drop(tx);
            // Several groups decode at once, each on its own task of the pool: one group's
            // pieces alone would leave threads idle behind its slowest piece (a full group is
            // GROUP_TOKENS / split::DECODE_PIECE = 16 pieces, fewer than the cores of a big
            // machine; a small buffer's groups hold fewer). At most `decoding` groups at once
            // bounds the fetched bytes held.
            let pieces_per_group = group.div_ceil(crate::flat_tokens::split::DECODE_PIECE);
            let decoding = pool
                .current_num_threads()
                .div_ceil(pieces_per_group as usize)
                + 1;
            let busy = DecodeSlots::default();
            let decoded = std::sync::Mutex::new(Vec::with_capacity(groups.len()));
            let failed = std::sync::atomic::AtomicBool::new(false);
            pool.in_place_scope(|tasks| {
                let (busy, decoded, failed) = (&busy, &decoded, &failed);
                for (i, fetched) in rx.iter() {
                    if failed.load(std::sync::atomic::Ordering::Relaxed) || stopped() {
                        break;
                    }
                    let slot = busy.take(decoding);
                    tasks.spawn(move |_| {
                        let _slot = slot;
                        let got = fetched.and_then(|f| split.decode_encoded(&f, pool));
                        if got.is_err() {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        decoded
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((i, got));
                    });
                }
            });
            let mut result = if stopped() {
                Err(exec::stopped_error())
            } else {
                Ok(())
            };
            let mut decoded_groups = 0;
            for (i, got) in decoded.into_inner().unwrap_or_else(|e| e.into_inner()) {
                match got {
                    Ok(decoded) => {
                        let first = groups[i].0;
                        for (k, piece) in decoded.into_iter().enumerate() {
                            pieces[first + k] = piece;
                        }
                        decoded_groups += 1;
                    }
                    Err(e) => {
                        if result.is_ok() {
                            result = Err(e);
                        }
                    }
                }
            }
            // Unblocks fetchers waiting to send, so that they see the end.
            drop(rx);
            next.store(groups.len(), std::sync::atomic::Ordering::Relaxed);
            for h in handles {
                if h.join().is_err() && result.is_ok() {
                    result = Err(Error::Internal("a buffer fetch thread panicked".into()));
                }
            }
            if result.is_ok() && decoded_groups != groups.len() {
                result = Err(Error::Internal(format!(
                    "internal: {decoded_groups} of a buffer's {} groups were read",
                    groups.len()
                )));
            }
            result
        })?;
        Ok(Resident { key, pieces, rows })
    }

    /// The sequence index of every row this host serves at `step`.
    pub fn sequences(&self, step: u64) -> Result<Vec<u64>> {
        let (schedule, t) = self.locate(step)?;
        self.host_rows().map(|b| schedule.sequence(t, b)).collect()
    }

    /// This host's rows of `step`, now.
    pub fn load(&self, step: u64) -> Result<TokenBatch> {
        exec::run_one(self, step, &*self.gather_pool()?)
    }

    /// Batches from `step` on, prepared ahead on the engine's threads: to the end of the epoch,
    /// or without end when epochs are enabled. A fault (an error, a panicking or unstartable
    /// thread) is an error, never an early end; dropping the iterator stops the threads.
    pub fn iter(&self, step: u64) -> Batches {
        self.inner
            .streaming
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let end = if self.inner.opts.epochs {
            u64::MAX
        } else {
            self.step_count()
        };
        let stream = match self.gather_pool() {
            Err(e) => exec::Stream::failed(e),
            Ok(pool) => exec::start(
                Arc::new(self.clone()),
                step..end.max(step),
                pool,
                StreamOptions { ahead: PREFETCH },
            ),
        };
        Batches {
            stream,
            residents: self.residents(),
        }
    }
}

/// A prepared step: its rows' sequences.
pub(crate) struct StepRows {
    step: u64,
    rows: Vec<u64>,
    fields: Vec<Field>,
    /// With buffers in memory: the buffer holding each row.
    from: Vec<Arc<Resident>>,
}

impl Job for TokenLoader {
    type Plan = u64;
    type State = StepRows;
    type Item = TokenBatch;

    fn prepare(&self, step: u64, cx: &Context<'_>) -> Result<Prepared<StepRows>> {
        // The split's chunks are read through zarrs, whose storage interface carries no stop:
        // its reads on this thread give up once the stream stops (`io::zarr_reads_stopped_by`).
        let stop = crate::io::Stop::new(cx.stop_flag().clone());
        crate::io::zarr_reads_stopped_by(&stop, || {
            let rows = self.sequences(step)?;
            // With buffers in memory: the buffer each row is served from, read now if new.
            let mut from = Vec::new();
            if let Some(residents) = self.residents() {
                let (schedule, t) = self.locate(step)?;
                let mut last: Option<Arc<Resident>> = None;
                for b in self.host_rows() {
                    let (m, s) = schedule.buffer_of(t, b);
                    let key = (schedule.epoch(), m, s);
                    let r = match last {
                        Some(r) if r.key == key => r,
                        _ => self.resident(&schedule, key, &residents, cx.stop_flag())?,
                    };
                    from.push(r.clone());
                    last = Some(r);
                }
            }
            if let Some(fv) = &self.inner.verify {
                // The files this step decodes, checked before any of them is read.
                let split = &self.inner.split;
                let pool = self.gather_pool()?;
                let len = self.inner.opts.seq_len;
                let mut files = Vec::new();
                for &seq in &rows {
                    let range = match self.inner.opts.packing {
                        Packing::Packed => seq * len..(seq + 1) * len,
                        Packing::Unpacked => {
                            fv.ensure(split.start_files(seq..seq + 2), &pool)?;
                            let d = split.document(seq)?;
                            d.start..d.end.min(d.start + len)
                        }
                    };
                    files.extend(split.token_files(range));
                }
                files.sort();
                files.dedup();
                fv.ensure(files, &pool)?;
            }
            let (fields, bytes) = self.layout(rows.len() as u64);
            let len = self.inner.opts.seq_len as usize;
            // Row r of every array: one piece.
            let regions = (0..rows.len())
                .map(|r| {
                    fields
                        .iter()
                        .map(|f| {
                            let w = f.dtype.bitsize() / 8 * len;
                            f.offset + r * w..f.offset + (r + 1) * w
                        })
                        .collect()
                })
                .collect();
            let pool = self
                .inner
                .buffers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            Ok(Prepared {
                buf: cx.buffer(&pool, bytes)?,
                regions,
                state: StepRows {
                    step,
                    rows,
                    fields,
                    from,
                },
            })
        })
    }

    /// Reads (decodes) row `r`'s tokens and writes it in every array.
    fn fill(&self, st: &StepRows, r: usize, out: &mut [&mut [u8]]) -> Result<()> {
        let split = &self.inner.split;
        let len = self.inner.opts.seq_len as usize;
        let seq = st.rows[r];
        let read;
        let tokens: &[u32] = match st.from.get(r) {
            Some(resident) => resident.tokens(seq)?,
            None => {
                let range = match self.inner.opts.packing {
                    Packing::Packed => seq * len as u64..(seq + 1) * len as u64,
                    Packing::Unpacked => {
                        let d = split.document(seq)?;
                        d.start..d.end.min(d.start + len as u64)
                    }
                };
                crate::fault::before_read(split.path())?;
                read = split.encoded(range)?;
                &read
            }
        };
        let [enc, targets, inputs, segments, starts, mask] = out else {
            return Err(Error::Internal(
                "internal: a token row has six arrays".into(),
            ));
        };
        let real = tokens.len().min(len);
        mask[..real].fill(1);
        mask[real..].fill(0);
        // Batch fields start at multiples of 64 in page-aligned memory (engine::batch), so
        // each row of a u32 field is u32-aligned.
        let words = bytemuck::try_cast_slice_mut::<u8, u32>;
        let (Ok(e), Ok(t), Ok(i), Ok(s)) =
            (words(enc), words(targets), words(inputs), words(segments))
        else {
            return Err(Error::Internal(
                "internal: a token batch field is not u32-aligned".into(),
            ));
        };
        e[..real].copy_from_slice(&tokens[..real]);
        // Padding is seqax's encoded 1 (target 0, "start"); packed rows overwrite all of it.
        e[real..].fill(1);
        decode_into(e, t, i, s, starts);
        Ok(())
    }

    fn finish(&self, p: Prepared<StepRows>, _: &rayon::ThreadPool) -> Result<TokenBatch> {
        Ok(TokenBatch::new(
            p.state.step,
            self.inner.opts.seq_len as usize,
            p.state.rows,
            p.buf,
            p.state.fields,
        ))
    }
}

/// Bytes of the shuffle buffers a host holds at once with buffers in memory (an upper bound:
/// unpacked documents shorter than a row take less).
fn buffer_bytes(schedule: &Schedule, host_rows: &Range<u64>, seq_len: u64) -> u64 {
    let bips = schedule.rows_per_stream().max(1);
    let streams =
        (host_rows.end.saturating_sub(1) / bips + 1).saturating_sub(host_rows.start / bips);
    streams
        .saturating_mul(schedule.blocks_in(0))
        .saturating_mul(schedule.params().sequences_per_read_block)
        .saturating_mul(seq_len)
        .saturating_mul(4)
}

/// `SHARDKIT_TOKEN_BUFFER_GIB` in bytes (16 GiB when unset).
fn buffer_cap() -> Result<u64> {
    Ok(crate::config::token_buffer_gib()?
        .unwrap_or(BUFFER_GIB)
        .saturating_mul(1 << 30))
}

/// Batches prepared ahead by [`TokenLoader::iter`].
pub struct Batches {
    stream: exec::Stream<TokenBatch>,
    /// With buffers in memory: the loader's, whose reads ahead stop when this is dropped.
    residents: Option<Arc<Residents>>,
}

impl Drop for Batches {
    fn drop(&mut self) {
        // Before the stream's threads are joined (the fields drop after this): a step waiting
        // for a buffer read ahead stops waiting, and no read goes on fetching for nobody.
        if let Some(r) = &self.residents {
            let mut ahead = r.ahead.lock().unwrap_or_else(|e| e.into_inner());
            for a in ahead.drain(..) {
                a.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

impl Iterator for Batches {
    type Item = Result<TokenBatch>;
    fn next(&mut self) -> Option<Result<TokenBatch>> {
        self.stream.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_buffer_from_a_store_is_cut_into_a_group_per_lane() {
        // 16 request slots of 8 MiB.
        let (mi, full, slots) = (1u64 << 20, GROUP_TOKENS, 16u64 << 23);
        let store = |tokens| plan_groups(true, tokens, full, slots);
        // A buffer of seqax's size: full groups, as many at once as ask for twice the slots'
        // bytes at about 2 stored bytes per token.
        assert_eq!(store(1 << 30), (full, 8));
        // 25 M tokens (a 54 MB minipoch): sixteen groups, all fetched at once.
        assert_eq!(store(25_000_000), (25_000_000u64.div_ceil(16), 16));
        // Never below a decode piece, nor above a full group.
        assert_eq!(store(100), (mi, 16));
        assert_eq!(store(17 * full), (full, 8));
        // Locally the buffer's size changes nothing.
        assert_eq!(plan_groups(false, 25_000_000, full, slots), (full, 4));
        assert_eq!(plan_groups(false, 1 << 30, full, slots), (full, 4));
        // The path decides which.
        let local = std::path::Path::new("/data/tokens/train");
        assert_eq!(fetch_plan(local, 25_000_000), (group_tokens(), 4));
    }
}
