//! Batches of a flat-tokens split in seqax's shuffled order (flat_tokens.md §5, §9.5–9.7).
//!
//! Step `t` is computed in closed form ([`Schedule`]) and only its own rows are read: a packed
//! row is one range of `len` tokens; an unpacked row is one document, truncated to `len` and
//! right-padded (seqax's pad value, encoded 1) with `mask` false on the padding. Offsets are
//! absolute, so every read block is correct (seqax's unpacked mode is not). Rows are read in
//! parallel, and [`TokenLoader::iter`] prepares the next steps while the caller uses one.

use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::flat_tokens::decode::{decode, Decoded};
use crate::flat_tokens::seqax::{Schedule, ShuffleParams};
use crate::flat_tokens::Split;

/// How rows are cut from the token stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// Row i is tokens `[i·len, (i+1)·len)`; documents run across rows.
    Packed,
    /// Row i is document i (truncated to `len`, padded).
    Unpacked,
}

/// Everything that decides which rows a step holds, plus this host's share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderOptions {
    /// Tokens per row (seqax's `len`).
    pub seq_len: u64,
    /// Rows per step over all hosts (seqax's `batch`).
    pub batch_size: u64,
    /// Packed rows (default) or one document per row.
    pub packing: Packing,
    /// Streams S (seqax recommends the maximum number of hosts); must divide `batch_size`.
    pub streams: u64,
    /// Read blocks per shuffle buffer R (seqax recommends 1024).
    pub read_blocks_per_shuffle_buffer: u64,
    /// Sequences per read block B; `None` is seqax's recommendation, `2^20 / seq_len`.
    pub sequences_per_read_block: Option<u64>,
    /// Seed.
    pub seed: u64,
    /// This host (0-based); it serves rows `[h·batch/H, (h+1)·batch/H)` of every step.
    pub host_index: u64,
    /// Hosts H; must divide `batch_size`.
    pub host_count: u64,
    /// Past the last step, continue with epoch `step / step_count` in a new deterministic
    /// order instead of failing (epoch 0 is seqax's order).
    pub epochs: bool,
    /// Threads reading rows: a step's rows are read concurrently, so on a cold cache this many
    /// reads are in flight (16 by default).
    pub io_threads: usize,
}

impl LoaderOptions {
    /// Packed rows of `seq_len`, `batch_size` rows a step, seqax's recommended shuffle
    /// (S = 1, R = 1024, B = 2^20 / seq_len), seed 0, one host, no epochs.
    pub fn new(seq_len: u64, batch_size: u64) -> LoaderOptions {
        LoaderOptions {
            seq_len,
            batch_size,
            packing: Packing::Packed,
            streams: 1,
            read_blocks_per_shuffle_buffer: 1024,
            sequences_per_read_block: None,
            seed: 0,
            host_index: 0,
            host_count: 1,
            epochs: false,
            io_threads: 16,
        }
    }

    /// seqax's shuffle parameters.
    pub fn shuffle_params(&self) -> ShuffleParams {
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

/// One step's rows (this host's share).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// The step (counting across epochs when epochs are enabled).
    pub step: u64,
    /// Tokens per row.
    pub seq_len: usize,
    /// The sequence (packed row or document) index of each row.
    pub rows: Vec<u64>,
    /// Encoded tokens, `rows × seq_len`.
    pub encoded: Vec<u32>,
    /// True for real tokens, false for padding (always true when packed).
    pub mask: Vec<bool>,
    /// Model inputs decoded from `encoded`.
    pub decoded: Decoded,
}

/// Largest batch held in memory (elements of `rows × seq_len`).
const MAX_BATCH_TOKENS: u64 = 1 << 31;
/// Steps prepared ahead of the caller by [`TokenLoader::iter`].
const PREFETCH: usize = 4;

struct Inner {
    split: Split,
    opts: LoaderOptions,
    n_seq: u64,
    epoch0: Arc<Schedule>,
    /// The most recently used later epoch.
    later: Mutex<Option<Arc<Schedule>>>,
    host_rows: Range<u64>,
    /// Reads rows; I/O-bound, so wider than the core count.
    pool: rayon::ThreadPool,
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
            .field("step_count", &self.step_count())
            .finish()
    }
}

impl TokenLoader {
    /// A loader over `split`.
    pub fn new(split: Split, opts: LoaderOptions) -> Result<Self> {
        if opts.seq_len == 0 {
            return Err(Error::Invalid("seq_len must be at least 1".into()));
        }
        if opts.host_count == 0 || opts.host_index >= opts.host_count {
            return Err(Error::Invalid(format!(
                "host_index {} must be below host_count {} (and host_count at least 1)",
                opts.host_index, opts.host_count
            )));
        }
        if !opts.batch_size.is_multiple_of(opts.host_count) {
            return Err(Error::Invalid(format!(
                "batch_size {} must be a multiple of host_count {}",
                opts.batch_size, opts.host_count
            )));
        }
        let per_host = opts.batch_size / opts.host_count;
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
        let host_rows = opts.host_index * per_host..(opts.host_index + 1) * per_host;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.io_threads.clamp(1, 256))
            .thread_name(|i| format!("shardkit-tokens-io-{i}"))
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start the loader's threads: {e}")))?;
        Ok(TokenLoader {
            inner: Arc::new(Inner {
                split,
                opts,
                n_seq,
                epoch0,
                later: Mutex::new(None),
                host_rows,
                pool,
            }),
        })
    }

    /// Steps in an epoch (seqax's `step_count`).
    pub fn step_count(&self) -> u64 {
        self.inner.epoch0.step_count()
    }
    /// Epoch 0's schedule (seqax's order).
    pub fn schedule(&self) -> &Schedule {
        &self.inner.epoch0
    }
    /// The split.
    pub fn split(&self) -> &Split {
        &self.inner.split
    }
    /// The options.
    pub fn options(&self) -> &LoaderOptions {
        &self.inner.opts
    }
    /// The batch rows this host serves.
    pub fn host_rows(&self) -> Range<u64> {
        self.inner.host_rows.clone()
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
        let epoch = step / n;
        let mut later = self.inner.later.lock().unwrap_or_else(|e| e.into_inner());
        let s = match later.as_ref() {
            Some(s) if s.epoch() == epoch => s.clone(),
            _ => {
                let s = Arc::new(Schedule::for_epoch(
                    self.inner.n_seq,
                    self.inner.opts.shuffle_params(),
                    epoch,
                )?);
                *later = Some(s.clone());
                s
            }
        };
        Ok((s, step % n))
    }

    /// The sequence index of every row this host serves at `step`.
    pub fn sequences(&self, step: u64) -> Result<Vec<u64>> {
        let (schedule, t) = self.locate(step)?;
        self.host_rows().map(|b| schedule.sequence(t, b)).collect()
    }

    /// This host's rows of `step`.
    pub fn load(&self, step: u64) -> Result<TokenBatch> {
        let rows = self.sequences(step)?;
        let len = self.inner.opts.seq_len as usize;
        let split = &self.inner.split;
        let packing = self.inner.opts.packing;
        // Padding is seqax's encoded 1 (target 0, "start"); packed rows overwrite all of it.
        let mut encoded = vec![1u32; rows.len() * len];
        let mut real = vec![0usize; rows.len()];
        self.inner.pool.install(|| {
            encoded
                .par_chunks_mut(len.max(1))
                .zip(real.par_iter_mut())
                .zip(rows.par_iter())
                .try_for_each(|((dst, real), &seq)| -> Result<()> {
                    let range = match packing {
                        Packing::Packed => seq * len as u64..(seq + 1) * len as u64,
                        Packing::Unpacked => {
                            let d = split.document(seq)?;
                            d.start..d.end.min(d.start + len as u64)
                        }
                    };
                    let tokens = split.encoded(range)?;
                    dst[..tokens.len()].copy_from_slice(&tokens);
                    *real = tokens.len();
                    Ok(())
                })
        })?;
        let mut mask = vec![false; encoded.len()];
        for (m, &r) in mask.chunks_mut(len.max(1)).zip(&real) {
            m[..r].fill(true);
        }
        let decoded = decode(&encoded, len);
        Ok(TokenBatch {
            step,
            seq_len: len,
            rows,
            encoded,
            mask,
            decoded,
        })
    }

    /// Batches from `step` on, prepared ahead in a background thread: to the end of the epoch,
    /// or without end when epochs are enabled. Dropping the iterator stops the thread.
    pub fn iter(&self, step: u64) -> Batches {
        let (tx, rx) = sync_channel(PREFETCH);
        let loader = self.clone();
        let end = if self.inner.opts.epochs {
            u64::MAX
        } else {
            self.step_count()
        };
        let thread = std::thread::Builder::new()
            .name("shardkit-tokens".into())
            .spawn(move || {
                for s in step..end {
                    let b = loader.load(s);
                    let failed = b.is_err();
                    if tx.send(b).is_err() || failed {
                        break;
                    }
                }
            })
            .ok();
        Batches {
            rx: Some(rx),
            thread,
            spawn_failed: false,
        }
        .check_spawned()
    }
}

/// Batches prepared ahead by [`TokenLoader::iter`].
pub struct Batches {
    rx: Option<Receiver<Result<TokenBatch>>>,
    thread: Option<JoinHandle<()>>,
    spawn_failed: bool,
}

impl Batches {
    fn check_spawned(mut self) -> Self {
        self.spawn_failed = self.thread.is_none();
        self
    }
}

impl Iterator for Batches {
    type Item = Result<TokenBatch>;
    fn next(&mut self) -> Option<Result<TokenBatch>> {
        if self.spawn_failed {
            self.spawn_failed = false;
            self.rx = None;
            return Some(Err(Error::Invalid(
                "cannot start the loader's reading thread".into(),
            )));
        }
        let item = self.rx.as_ref()?.recv().ok();
        if !matches!(item, Some(Ok(_))) {
            self.rx = None;
        }
        item
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        // Closing the channel makes the producer's next send fail, so it stops.
        self.rx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
