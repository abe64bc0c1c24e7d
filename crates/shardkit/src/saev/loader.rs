//! Ordered and shuffled loaders over a saev directory, on the read engine.
//!
//! A *block* is one example's contiguous slab of the selected layer (`T·D·4` bytes), or the
//! whole example when `layer` is `all`; its rows are the selected tokens (minus those whose
//! label is ignored). Orders come from [`crate::engine::order`], so batches depend only on
//! `(seed, epoch, world_size, batch_size)` and the cursor, never on threads or timing.
//!
//! How rows reach the batch, one copy each, on the engine's gather threads:
//! * sequential and block orders go window by window (the order's memory-bounded groups of
//!   blocks). By default a window's blocks are read ahead into the page cache (the next
//!   window's reads start as soon as the current one is ready) and mapped; rows are copied
//!   from the maps, so data already in the page cache is copied once, straight into the batch.
//!   With `direct_io` the window is read with O_DIRECT into a buffer of the loader's instead,
//!   leaving the page cache alone (streaming more data than memory without evicting anything);
//!   from an object store, windows are always read into buffers, and the next window's
//!   requests queue behind the current one's, so the store never idles between windows;
//! * the exact order reads each row straight into the batch (`pread`, O_DIRECT with
//!   `direct_io`), after asking the kernel to read the batch's rows ahead.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use crate::checksum::{self, Verifier};
use crate::engine::exec::{self, Context, GatherCell, GatherPool, Job, Prepared, StreamOptions};
use crate::engine::order::{rank_batches, EpochOrder, Order};
use crate::engine::Buffer;
use crate::error::{Error, Result};
use crate::io::buffer::{self, BufferPool};
use crate::io::local::{self, plan_reads, read_all, Files, ReadRange};
use crate::io::{HeldPages, PendingRead, Stop};
use crate::precision::Dtype;
use crate::saev::{Dataset, TokenMode};

pub use super::options::LayerSel;
use super::options::{LoaderOptions, DEFAULT_MEMORY_BUDGET};

/// The saev directory seen as blocks of selected rows.
pub(crate) struct SaevSource {
    ds: Dataset,
    slots: Vec<usize>,
    mode: TokenMode,
    /// Selected tokens per example before filtering.
    per_example: u64,
    /// With ignore_labels: kept selected-token indices of all examples, and per-example prefix.
    kept: Option<(Vec<u32>, Vec<u64>)>,
    /// labels.bin, when the dataset has it (a follow-mode loader fills it from the shards'
    /// label pieces round by round, before the commit writes labels.bin).
    labels: RwLock<Option<Arc<Vec<u8>>>>,
    /// Each shard mapped once, on first use, for the loader's life: rows already in the page
    /// cache are copied straight from there, and the page tables built on the first pass serve
    /// every later one.
    maps: Vec<OnceLock<memmap2::Mmap>>,
}

impl SaevSource {
    /// Shard `s` mapped (whole, read-only).
    fn map(&self, s: u32) -> Result<&memmap2::Mmap> {
        let cell = self.maps.get(s as usize).ok_or(Error::OutOfRange {
            what: "shard",
            index: i64::from(s),
            len: self.maps.len() as u64,
        })?;
        if let Some(m) = cell.get() {
            return Ok(m);
        }
        let len = self.ds.layout().shard_bytes();
        let f = self.file(s)?;
        local::check_len(f, &self.path(s), len)?;
        let _ = cell.set(local::map_file(f, &self.path(s), len)?);
        cell.get()
            .ok_or_else(|| Error::Internal("internal: shard map vanished".into()))
    }

    /// Checks that every shard in `shards` still has its full length (a map is never read past
    /// the end of a file that shrank).
    fn check_lengths(&self, shards: impl IntoIterator<Item = u32>) -> Result<()> {
        let len = self.ds.layout().shard_bytes();
        let mut seen = Vec::new();
        for s in shards {
            if !seen.contains(&s) {
                seen.push(s);
                local::check_len(self.file(s)?, &self.path(s), len)?;
            }
        }
        Ok(())
    }

    /// The bytes of block `b` in its shard's map.
    fn mapped_block(&self, b: u32) -> Result<&[u8]> {
        let (file, offset, len) = self.block(b);
        self.map(file)?
            .get(offset as usize..(offset + len) as usize)
            .ok_or_else(|| Error::Internal(format!("internal: example {b} lies outside its shard")))
    }

    fn kept_count(&self, e: u64) -> u64 {
        match &self.kept {
            Some((_, prefix)) => prefix[e as usize + 1] - prefix[e as usize],
            None => self.per_example,
        }
    }
    /// The selected-token index (mode-relative) of the `k`-th kept token of example `e`.
    fn selected(&self, e: u64, k: u64) -> u64 {
        match &self.kept {
            Some((idx, prefix)) => idx[(prefix[e as usize] + k) as usize] as u64,
            None => k,
        }
    }
    /// (layer slot index in `slots`, selected-token index) of row `j` of block `e`.
    fn split_row(&self, e: u64, j: u64) -> (usize, u64) {
        let n = self.kept_count(e);
        ((j / n) as usize, self.selected(e, j % n))
    }
}

impl Files for SaevSource {
    fn file(&self, i: u32) -> Result<&std::fs::File> {
        self.ds.shard_file(i as u64)
    }
    fn path(&self, i: u32) -> std::path::PathBuf {
        self.ds.shard_path(i as u64)
    }
    fn direct(&self, i: u32) -> Option<&std::fs::File> {
        self.ds.shard_file_direct(i as u64)
    }
}

impl SaevSource {
    /// Selected rows of the blocks of shards `shards`.
    pub(super) fn rows_in_shards(&self, shards: &[std::ops::Range<u64>]) -> u64 {
        let l = self.ds.layout();
        let eps = l.examples_per_shard;
        shards
            .iter()
            .flat_map(|r| (r.start * eps).min(l.n_examples)..(r.end * eps).min(l.n_examples))
            .map(|b| self.rows(b as u32))
            .sum()
    }
    /// The dataset read.
    pub(super) fn dataset(&self) -> &Dataset {
        &self.ds
    }
    /// The labels (`N·P` bytes), when known.
    pub(super) fn labels(&self) -> Option<Arc<Vec<u8>>> {
        self.labels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// Takes the labels out (a follow-mode round adds to them in place, then puts them back).
    pub(super) fn take_labels(&self) -> Option<Arc<Vec<u8>>> {
        self.labels
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
    /// Replaces the labels (a follow-mode round read more of them).
    pub(super) fn set_labels(&self, labels: Arc<Vec<u8>>) {
        *self.labels.write().unwrap_or_else(|e| e.into_inner()) = Some(labels);
    }
    fn n_blocks(&self) -> usize {
        self.ds.layout().n_examples as usize
    }
    /// (shard, byte offset, byte length) of block `b`: one example's selected slab.
    fn block(&self, b: u32) -> (u32, u64, u64) {
        let l = self.ds.layout();
        let (s, _) = l.locate(b as u64);
        if self.slots.len() == 1 {
            (
                s as u32,
                l.offset(b as u64, self.slots[0] as u64, 0),
                l.slab_bytes(),
            )
        } else {
            (s as u32, l.offset(b as u64, 0, 0), l.example_bytes())
        }
    }
    /// Selected rows of block `b`.
    fn rows(&self, b: u32) -> u64 {
        self.kept_count(b as u64) * self.slots.len() as u64
    }
    /// Byte offset, inside block `b`, of its selected row `j`.
    fn row_offset(&self, b: u32, j: u64) -> u64 {
        let l = self.ds.layout();
        let (li, sel) = self.split_row(b as u64, j);
        let (t, _) = self.mode.token_of(l, sel);
        let slab = if self.slots.len() == 1 {
            0
        } else {
            self.slots[li] as u64 * l.slab_bytes()
        };
        slab + t * l.vector_bytes()
    }
    fn row_bytes(&self) -> u64 {
        self.ds.layout().vector_bytes()
    }
}

/// One batch: `act` is `(n, d_model)` values of `dtype` in a page-aligned buffer.
#[derive(Debug)]
pub struct Batch {
    /// Activations, row-major `(n, d_model)`, little-endian values of `dtype`.
    pub act: Buffer,
    /// The type of `act`'s values: the dataset's, or float32 with
    /// [`SaevOptions::upcast`](super::SaevOptions::upcast).
    pub dtype: Dtype,
    /// Rows in the batch.
    pub n: usize,
    /// Width.
    pub d_model: usize,
    /// Global example index of each row.
    pub example_idx: Vec<i64>,
    /// Content token index of each row (-1 for CLS).
    pub token_idx: Vec<i64>,
    /// Recorded layer value of each row (only when the loader reads `all` layers).
    pub layer: Option<Vec<i64>>,
    /// labels.bin value of each row (-1 for CLS), when labels.bin exists.
    pub token_label: Option<Vec<i64>>,
    /// The loader's cursor once this batch is consumed.
    pub cursor: u64,
}

/// Free batch buffers kept for reuse: the batches in flight (prefetched, two lanes, queued,
/// held by the consumer).
const BATCH_POOL: usize = 8;

/// Ordered or shuffled batches of one layer (or all) of a saev directory.
pub struct Loader {
    pub(super) src: Arc<SaevSource>,
    pub(super) opts: LoaderOptions,
    rank: u64,
    pub(super) world: u64,
    pub(super) window_blocks: u64,
    pub(super) order: Arc<EpochOrder>,
    pub(super) cursor: Arc<AtomicU64>,
    batches: BufferPool,
    windows: BufferPool,
    /// Float32 batches widened from a reduced-precision dataset's (`upcast`).
    upcast: BufferPool,
    /// Started on the first pass and kept (a failure to start is reported by that pass).
    gather: GatherCell,
    /// With `verify`: the shards' checksums and which blocks this pass has checked.
    verifier: Option<Arc<Verifier>>,
    /// A state was loaded and no pass has started since: `set_epoch` of the state's epoch keeps
    /// the position, and a state at the end of its epoch yields no batch (not the epoch again).
    pub(super) resumed: AtomicBool,
    /// Follow mode (reading while the dataset is written), when on: the epoch's rounds.
    pub(super) follow: Option<super::follow::Follow>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("dir", &self.src.ds.path())
            .field("opts", &self.opts)
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .finish_non_exhaustive()
    }
}

impl Loader {
    /// Opens `dir` (which must be a complete dataset) for loading with `opts`.
    /// With `opts.follow`, `dir` may be a dataset still being written in parts (see
    /// [`super::FollowOptions`]).
    pub fn new(dir: impl AsRef<std::path::Path>, opts: LoaderOptions) -> Result<Loader> {
        if opts.follow.is_some() {
            return super::follow::open(dir.as_ref(), opts);
        }
        Loader::with_dataset(Dataset::open(dir)?, opts)
    }

    /// Loads `ds`, already open (a dataset opened over any source: [`Dataset::open_source`]).
    pub fn with_dataset(ds: Dataset, opts: LoaderOptions) -> Result<Loader> {
        let layout = *ds.layout();
        let slots = match opts.layer {
            LayerSel::Value(v) => vec![ds.metadata().layer_slot(v)?],
            LayerSel::All => (0..layout.n_layers as usize).collect(),
        };
        let per_example = opts.tokens.rows_per_example(&layout)?;
        let (rank, world) = opts.rank_and_world()?;
        if opts.batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
        }
        let labels = ds.read_all_labels()?;
        if opts.verify && ds.remote().is_some() {
            return Err(crate::io::verify_needs_local(ds.path()));
        }
        let kept = if opts.ignore_labels.is_empty() {
            None
        } else {
            let Some(labels) = &labels else {
                return Err(Error::NotFound {
                    path: ds.path().join("labels.bin"),
                    what: "ignore_labels needs labels.bin, which this dataset does not have (or \
                           it is not N x P bytes)"
                        .into(),
                });
            };
            if opts.tokens == TokenMode::Special {
                return Err(Error::Invalid(
                    "ignore_labels applies to content tokens; it cannot be used with tokens=\"special\""
                        .into(),
                ));
            }
            let p = layout.content_tokens;
            let mut idx = Vec::new();
            let mut prefix = vec![0u64];
            for e in 0..layout.n_examples {
                for j in 0..per_example {
                    let (_, c) = opts.tokens.token_of(&layout, j);
                    let keep = c < 0
                        || !opts
                            .ignore_labels
                            .contains(&labels[(e * p + c as u64) as usize]);
                    if keep {
                        idx.push(j as u32);
                    }
                }
                prefix.push(idx.len() as u64);
            }
            Some((idx, prefix))
        };
        let src = SaevSource {
            ds,
            slots,
            mode: opts.tokens,
            per_example,
            kept,
            labels: RwLock::new(labels.map(Arc::new)),
            maps: (0..layout.n_shards).map(|_| OnceLock::new()).collect(),
        };
        if src.n_blocks() == 0 {
            return Err(Error::Invalid(format!(
                "{}: the dataset has no examples",
                src.ds.path().display()
            )));
        }
        let block_bytes = src.block(0).2;
        let batch_bytes = opts.batch_size * src.row_bytes();
        let budget = opts.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET);
        // Resident at once: three windows (two being gathered, one being read), each a quarter
        // of the budget, and a few batches in the last quarter. Windows depend only on the
        // budget and the block size, so the order is the same for any split of the global batch.
        let need = 3 * block_bytes + 3 * batch_bytes;
        if budget < need || budget / 4 < block_bytes {
            return Err(Error::Invalid(format!(
                "memory budget of {budget} bytes is too small: it must hold 4 blocks of \
                 {block_bytes} bytes and 3 batches of {batch_bytes} bytes besides ({} bytes)",
                (4 * block_bytes).max(need)
            )));
        }
        let window_blocks = (budget / 4 / block_bytes).max(1);
        let verifier = if opts.verify {
            if opts.direct_io {
                return Err(Error::Invalid(
                    "verify cannot be combined with direct_io: blocks are verified through the \
                     page cache"
                        .into(),
                ));
            }
            let dir = src.ds.path();
            let names: Vec<String> = (0..layout.n_shards)
                .map(crate::saev::Layout::shard_name)
                .collect();
            Some(Arc::new(Verifier::open(
                &dir.join(checksum::SIDECAR),
                dir,
                &names,
            )?))
        } else {
            None
        };
        let src = Arc::new(src);
        let order = Arc::new(Self::plan_epoch(&src, &opts, window_blocks)?);
        Ok(Loader {
            src,
            opts,
            rank,
            world,
            window_blocks,
            order,
            cursor: Arc::new(AtomicU64::new(0)),
            batches: BufferPool::new(BATCH_POOL),
            windows: BufferPool::new(3),
            upcast: BufferPool::new(BATCH_POOL),
            gather: GatherCell::default(),
            verifier,
            resumed: AtomicBool::new(false),
            follow: None,
        })
    }

    /// Gathers batches into `pool` from now on (e.g. pinned host memory for copies to a GPU;
    /// each buffer must hold `batch_size x d_model x 4` bytes: float32 rows, widened ones with
    /// `upcast` included).
    pub fn set_batch_buffers(&mut self, pool: BufferPool) {
        self.batches = pool;
    }

    /// The gather pool, started on first use.
    fn gather_pool(&self) -> Result<Arc<GatherPool>> {
        self.gather.get(self.opts.threads)
    }

    pub(super) fn plan_epoch(
        src: &SaevSource,
        opts: &LoaderOptions,
        window_blocks: u64,
    ) -> Result<EpochOrder> {
        Self::plan_over(src, opts, window_blocks, None)
    }

    /// The epoch's order restricted to the blocks of the shards `keep` marks (all when
    /// `None`): the other blocks count no rows, so the block and sequential orders are the
    /// whole epoch's with those blocks left out, and the exact order a keyed permutation of
    /// the rows kept (the whole epoch's when every shard is kept).
    pub(super) fn plan_over(
        src: &SaevSource,
        opts: &LoaderOptions,
        window_blocks: u64,
        keep: Option<&[bool]>,
    ) -> Result<EpochOrder> {
        let eps = src.ds.layout().examples_per_shard.max(1);
        let rows: Vec<u64> = (0..src.n_blocks() as u32)
            .map(|b| match keep {
                Some(k) if !k.get((b as u64 / eps) as usize).copied().unwrap_or(false) => 0,
                _ => src.rows(b),
            })
            .collect();
        EpochOrder::new(opts.order, opts.seed, opts.epoch, &rows, window_blocks)
    }

    /// The dataset being read.
    pub fn dataset(&self) -> &Dataset {
        &self.src.ds
    }
    /// The options in force (epoch and seed as currently set).
    pub fn options(&self) -> &LoaderOptions {
        &self.opts
    }
    /// This rank and the world size.
    pub fn rank_and_world(&self) -> (u64, u64) {
        (self.rank, self.world)
    }
    /// Selected rows in one epoch, over all ranks.
    pub fn rows(&self) -> u64 {
        self.order.len()
    }
    /// Batches this rank yields in a whole epoch.
    pub fn len(&self) -> u64 {
        rank_batches(
            self.order.len(),
            self.opts.batch_size,
            self.rank,
            self.world,
            self.opts.drop_last,
        )
        .count() as u64
    }
    /// Whether an epoch yields no batch on this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Blocks in the dataset.
    pub(super) fn blocks(&self) -> u64 {
        self.src.n_blocks() as u64
    }
    /// The blocks one window of the block order holds, as the budget allows.
    pub fn window_blocks(&self) -> u64 {
        self.window_blocks
    }

    /// Switches to epoch `epoch` (a different order) from its start. Right after
    /// [`Loader::load_state`], `set_epoch` of the state's epoch keeps the loaded position (the
    /// training loop calls `set_epoch` at the start of every epoch, the resumed one included).
    pub fn set_epoch(&mut self, epoch: u64) -> Result<()> {
        if epoch == self.opts.epoch && *self.resumed.get_mut() {
            return Ok(());
        }
        *self.resumed.get_mut() = false;
        if epoch != self.opts.epoch {
            self.opts.epoch = epoch;
            self.order = Arc::new(Self::plan_epoch(&self.src, &self.opts, self.window_blocks)?);
        }
        self.cursor.store(0, Ordering::Relaxed);
        if let Some(f) = &self.follow {
            f.restart();
        }
        Ok(())
    }

    /// Iterates the rest of the epoch from the current cursor (from the start if the epoch was
    /// finished, except right after loading a state taken at the end of its epoch: that pass is
    /// empty, as the rest of the interrupted run's epoch was). The same epoch is repeated until
    /// [`Loader::set_epoch`] changes it. A thread that cannot be started is reported by the
    /// first `next`.
    pub fn iter(&self) -> Result<Batches> {
        if let Some(f) = &self.follow {
            return f.iter(self);
        }
        let total = self.order.len();
        let global = self.opts.batch_size * self.world;
        let end = if self.opts.drop_last {
            total - total % global
        } else {
            total
        };
        let resumed = self.resumed.swap(false, Ordering::Relaxed);
        let mut cursor = self.cursor.load(Ordering::Relaxed);
        if cursor >= end && !resumed {
            cursor = 0;
            self.cursor.store(0, Ordering::Relaxed);
        }
        // Batches: stream ranges of this rank from the cursor on, with the global cursor after
        // each.
        let plans: Vec<(u64, u64, u64)> = rank_batches(
            total,
            self.opts.batch_size,
            self.rank,
            self.world,
            self.opts.drop_last,
        )
        .filter(|&(s, _)| s >= cursor - cursor % global && cursor < end)
        .map(|(s, e)| (s, e, (((s / global) + 1) * global).min(total)))
        .collect();
        let stream = match self.pass_parts() {
            Err(e) => exec::Stream::failed(e),
            Ok(parts) => parts.stream(self.order.clone(), plans),
        };
        Ok(Batches {
            inner: Inner::One(stream),
            cursor: self.cursor.clone(),
        })
    }

    /// What a pass needs of the loader, held apart from it (a follow-mode pass starts one
    /// stream a round).
    pub(super) fn pass_parts(&self) -> Result<PassParts> {
        Ok(PassParts {
            src: self.src.clone(),
            pool: self.gather_pool()?,
            verifier: self.verifier.clone(),
            batches: self.batches.clone(),
            windows: self.windows.clone(),
            upcast: (self.opts.upcast && self.src.ds.layout().dtype.is_reduced())
                .then(|| self.upcast.clone()),
            order: self.opts.order,
            direct_io: self.opts.direct_io,
            io_threads: self.opts.io_threads,
        })
    }
}

/// What a pass needs of its loader (see [`Loader::pass_parts`]).
pub(super) struct PassParts {
    pub(super) src: Arc<SaevSource>,
    pool: Arc<GatherPool>,
    verifier: Option<Arc<Verifier>>,
    batches: BufferPool,
    windows: BufferPool,
    /// Where batches widened to float32 go (`upcast` of a reduced-precision dataset).
    upcast: Option<BufferPool>,
    order: Order,
    direct_io: bool,
    io_threads: usize,
}

impl PassParts {
    /// Streams the batches `plans` (stream start, end, cursor after it) of `order`.
    pub(super) fn stream(
        &self,
        order: Arc<EpochOrder>,
        plans: Vec<(u64, u64, u64)>,
    ) -> exec::Stream<Batch> {
        let windowed = self.order != Order::Exact;
        let needed = if windowed {
            windows_needed(&order, &plans)
        } else {
            Vec::new()
        };
        let job = SaevJob {
            verify: self.verifier.clone().map(|v| (v, self.pool.clone())),
            src: self.src.clone(),
            order,
            batches: self.batches.clone(),
            windows: self.windows.clone(),
            upcast: self.upcast.clone(),
            // Reads from an object store always go into window buffers.
            direct: self.direct_io || self.src.ds.remote().is_some(),
            io_threads: self.io_threads.max(1),
            piece_rows: (PIECE_BYTES / self.src.row_bytes()).max(1) as usize,
            resident: Mutex::new(Resident {
                needed,
                next: 0,
                windows: VecDeque::new(),
                pending: None,
                loaded: Vec::new(),
            }),
        };
        exec::start(
            Arc::new(job),
            plans.into_iter(),
            self.pool.clone(),
            StreamOptions { ahead: 2 },
        )
    }
}

/// Bytes a gather piece copies: small enough to spread a batch over every thread, large enough
/// that handing out pieces costs nothing.
const PIECE_BYTES: u64 = 256 << 10;

/// Windows touched by the batches, in stream order.
fn windows_needed(order: &EpochOrder, batches: &[(u64, u64, u64)]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for &(s, e, _) in batches {
        for w in order.window_of(s)..=order.window_of(e - 1) {
            if out.last().is_none_or(|&l| l < w) {
                out.push(w);
            }
        }
    }
    out
}

/// Where a window's blocks are: in the page cache (gathered through the shards' maps), or
/// read into a buffer of the loader's.
enum WindowData {
    /// In the shards' maps (read ahead into the page cache where they were not there yet).
    Mapped,
    /// The blocks read into one buffer, block `i` at `block_dst[i]`.
    Read { buf: Buffer, block_dst: Vec<u64> },
    /// From a store, every page the blocks lie in held by the local cache: the pages mapped,
    /// block `i` at `block_dst[i]` as if read into a buffer (rows are copied out of them once).
    Held {
        pages: HeldPages,
        block_dst: Vec<u64>,
    },
}

/// A store window's blocks on their way: requests in flight, or pages held by the cache.
enum Fetch {
    Read(PendingRead),
    Held(HeldPages),
}

struct LoadedWindow {
    index: usize,
    /// The order of the window's rows.
    perm: Vec<u32>,
    data: WindowData,
}

/// The windows of a pass that are in memory, and which one comes next.
struct Resident {
    needed: Vec<usize>,
    next: usize,
    windows: VecDeque<Arc<LoadedWindow>>,
    /// From an object store: the next window's requests, in flight while the current windows
    /// are gathered (window index, the read, where each block lands).
    pending: Option<(usize, Fetch, Vec<u64>)>,
    /// Every window loaded from the store so far, to count those still held (by `windows` or
    /// by batches not yet gathered): with at most one, the window after `pending` may start
    /// before `pending` is in, and the loader still holds at most three.
    loaded: Vec<Weak<LoadedWindow>>,
}

impl Resident {
    /// Windows loaded and still held.
    fn held(&mut self) -> usize {
        self.loaded.retain(|w| w.strong_count() > 0);
        self.loaded.len()
    }
}

/// One pass of a loader, as the engine runs it.
struct SaevJob {
    src: Arc<SaevSource>,
    order: Arc<EpochOrder>,
    batches: BufferPool,
    windows: BufferPool,
    upcast: Option<BufferPool>,
    direct: bool,
    io_threads: usize,
    piece_rows: usize,
    resident: Mutex<Resident>,
    /// With `verify`: the checksums, and the gather pool that hashes blocks ahead of use.
    verify: Option<(Arc<Verifier>, Arc<GatherPool>)>,
}

/// A prepared batch: each row's (block, selected row) and where its bytes are.
struct SaevBatch {
    rows: Vec<(u32, u32)>,
    /// Per row: where its bytes start, in `base` (a shard's map, or a window's buffer).
    src: Vec<(u32, u64)>,
    /// Whether `src` bases are shards (mapped) or indices into `windows` (read into buffers).
    in_windows: bool,
    /// The windows the batch draws from (kept alive until it is gathered).
    windows: Vec<Arc<LoadedWindow>>,
    cursor: u64,
    /// With `upcast`: the stored type of rows widened to float32 as they are gathered (each
    /// gather thread widens its own rows, which it has just read; `None` where the rows arrive
    /// as stored, e.g. fetched at once from an object store, and are widened afterwards).
    widen: Option<Dtype>,
}

impl SaevJob {
    /// Where window `w`'s blocks are in their shards, and where each lands in the window's
    /// buffer; the buffer's length.
    fn window_ranges(&self, w: usize) -> (Vec<ReadRange>, Vec<u64>, u64) {
        let src = &*self.src;
        let win = &self.order.windows()[w];
        let mut ranges = Vec::with_capacity(win.blocks.len());
        let mut block_dst = Vec::with_capacity(win.blocks.len());
        let mut dst = 0u64;
        for &b in &win.blocks {
            let (file, offset, len) = src.block(b);
            ranges.push(ReadRange {
                file,
                offset,
                len,
                dst,
            });
            block_dst.push(dst);
            dst += len;
        }
        (ranges, block_dst, dst)
    }

    /// Starts fetching window `w` from the object store (see [`Resident::pending`]).
    fn start_window(&self, w: usize, cx: &Context<'_>) -> Result<Option<(usize, Fetch, Vec<u64>)>> {
        let Some((store, names)) = self.src.ds.remote() else {
            return Ok(None);
        };
        let (ranges, block_dst, len) = self.window_ranges(w);
        if let Some(pages) = store.held_pages(names, &ranges)? {
            return Ok(Some((w, Fetch::Held(pages), block_dst)));
        }
        let buf = cx.buffer(&self.windows, len as usize)?;
        // The window belongs to this pass: once it stops, no further request is sent.
        let stop = Stop::new(cx.stop_flag().clone());
        let read = store.start_read(Arc::new(names.to_vec()), ranges, buf, &stop)?;
        Ok(Some((w, Fetch::Read(read), block_dst)))
    }

    /// Reads window `w`'s blocks into memory (or takes them from `pending`, a fetch of it
    /// started earlier).
    fn load_window(
        &self,
        w: usize,
        pending: Option<(usize, Fetch, Vec<u64>)>,
        cx: &Context<'_>,
    ) -> Result<LoadedWindow> {
        let src = &*self.src;
        let win = &self.order.windows()[w];
        let data = if let Some((_, fetch, block_dst)) = pending {
            match fetch {
                Fetch::Read(read) => WindowData::Read {
                    buf: read.wait(|| cx.stopped())?,
                    block_dst,
                },
                Fetch::Held(pages) => WindowData::Held { pages, block_dst },
            }
        } else if self.direct {
            // O_DIRECT from local shards (a store's windows always come as `pending`).
            let (ranges, block_dst, dst) = self.window_ranges(w);
            let mut buf = cx.buffer(&self.windows, dst as usize)?;
            read_all(
                src,
                &plan_reads(ranges),
                buf.as_mut_bytes(),
                self.io_threads,
                true,
            )?;
            WindowData::Read { buf, block_dst }
        } else {
            // Reads of blocks not yet in the page cache started a window ahead (or start now);
            // the gather threads wait for them page by page.
            src.check_lengths(win.blocks.iter().map(|&b| src.block(b).0))?;
            self.readahead(w);
            WindowData::Mapped
        };
        Ok(LoadedWindow {
            index: w,
            perm: self.order.window_permutation(w),
            data,
        })
    }

    /// Starts reading window `w`'s blocks that are not in the page cache yet.
    fn readahead(&self, w: usize) {
        for &b in &self.order.windows()[w].blocks {
            let (file, offset, len) = self.src.block(b);
            let cached = self.src.mapped_block(b).is_ok_and(local::resident);
            if let (false, Ok(f)) = (cached, self.src.file(file)) {
                local::readahead(f, offset, len);
            }
        }
    }

    fn prepare_windowed(&self, s: u64, e: u64, cx: &Context<'_>) -> Result<SaevBatch> {
        let order = &*self.order;
        let (first, last) = (order.window_of(s), order.window_of(e - 1));
        let mut r = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        while r.windows.front().is_some_and(|w| w.index < first) {
            r.windows.pop_front();
        }
        while r.windows.back().is_none_or(|w| w.index < last) {
            let Some(&w) = r.needed.get(r.next) else {
                return Err(Error::Internal(format!(
                    "internal: window {last} was not planned for this pass"
                )));
            };
            r.next += 1;
            // From a store, window `w`'s requests are in flight (started a window ahead, or
            // now, for the first window of a pass). When the windows before it are (all but at
            // most one) gathered, the next window's requests start now too: they queue behind
            // `w`'s (see `io::inflight`), so the store stays busy through the tail of
            // `w`'s fetch instead of idling until `w` is in.
            let pending = match r.pending.take().filter(|p| p.0 == w) {
                Some(p) => Some(p),
                None => self.start_window(w, cx)?,
            };
            let next = r.needed.get(r.next).copied();
            let early = match (&pending, next) {
                (Some(_), Some(next)) if r.held() <= 1 => self.start_window(next, cx)?,
                _ => None,
            };
            // Counted while held: a buffer of the loader's (held pages are the cache's).
            let from_store = matches!(pending, Some((_, Fetch::Read(_), _)));
            let loaded = Arc::new(self.load_window(w, pending, cx)?);
            if from_store {
                r.loaded.push(Arc::downgrade(&loaded));
            }
            r.windows.push_back(loaded);
            // The next window's reads overlap the gathering of this one.
            if let Some(next) = next {
                if !self.direct {
                    self.readahead(next);
                } else if early.is_some() {
                    r.pending = early;
                } else {
                    r.pending = self.start_window(next, cx)?;
                }
            }
        }
        let windows: Vec<Arc<LoadedWindow>> = r
            .windows
            .iter()
            .filter(|w| (first..=last).contains(&w.index))
            .cloned()
            .collect();
        drop(r);
        let n = (e - s) as usize;
        let src = &*self.src;
        let in_windows = windows
            .iter()
            .any(|w| !matches!(w.data, WindowData::Mapped));
        let mut rows = Vec::with_capacity(n);
        let mut at = Vec::with_capacity(n);
        let mut p = s;
        while p < e {
            let wi = order.window_of(p);
            let win = &order.windows()[wi];
            let seg_end = e.min(win.start + win.rows());
            let k = windows
                .iter()
                .position(|w| w.index == wi)
                .ok_or_else(|| Error::Internal(format!("internal: window {wi} is not resident")))?;
            for &q in &windows[k].perm[(p - win.start) as usize..(seg_end - win.start) as usize] {
                let q = q as u64;
                let i = win.row_prefix.partition_point(|&x| x <= q) - 1;
                let (blk, j) = (win.blocks[i], q - win.row_prefix[i]);
                rows.push((blk, j as u32));
                let off = src.row_offset(blk, j);
                at.push(match &windows[k].data {
                    WindowData::Read { block_dst, .. } | WindowData::Held { block_dst, .. } => {
                        (k as u32, block_dst[i] + off)
                    }
                    WindowData::Mapped => {
                        let (shard, offset, _) = src.block(blk);
                        (shard, offset + off)
                    }
                });
            }
            p = seg_end;
        }
        Ok(SaevBatch {
            rows,
            src: at,
            in_windows,
            windows,
            cursor: 0,
            widen: None,
        })
    }
}

impl Job for SaevJob {
    type Plan = (u64, u64, u64);
    type State = SaevBatch;
    type Item = Batch;

    fn prepare(
        &self,
        (s, e, cursor): (u64, u64, u64),
        cx: &Context<'_>,
    ) -> Result<Prepared<SaevBatch>> {
        let mut state = if self.order.order() == Order::Exact {
            let rows: Vec<(u32, u32)> = (s..e)
                .map(|p| {
                    let (b, j) = self.order.locate(p);
                    (b, j as u32)
                })
                .collect();
            if !self.direct {
                let rb = self.src.row_bytes();
                self.src
                    .check_lengths(rows.iter().map(|&(b, _)| self.src.block(b).0))?;
                for &(b, j) in &rows {
                    let (file, offset, _) = self.src.block(b);
                    let f = self.src.file(file)?;
                    local::readahead(f, offset + self.src.row_offset(b, j as u64), rb);
                }
            }
            let src = rows
                .iter()
                .map(|&(b, j)| {
                    let (shard, offset, _) = self.src.block(b);
                    (shard, offset + self.src.row_offset(b, j as u64))
                })
                .collect();
            SaevBatch {
                rows,
                src,
                in_windows: false,
                windows: Vec::new(),
                cursor,
                widen: None,
            }
        } else {
            self.prepare_windowed(s, e, cx)?
        };
        state.cursor = cursor;
        if let Some((v, pool)) = &self.verify {
            // Every block the batch reads, checked before it is gathered (in parallel on the
            // gather threads; blocks checked before and still in memory are skipped).
            let rb = self.src.row_bytes();
            let touched = state
                .src
                .iter()
                .flat_map(|&(i, off)| v.blocks(i as usize, off..off + rb));
            v.ensure(
                touched,
                |i| self.src.map(i as u32).map(|m| &m[..]),
                pool.pool(),
            )?;
        }
        let rb = self.src.row_bytes() as usize;
        let n = state.rows.len();
        if let (Some((store, names)), true) = (self.src.ds.remote(), state.windows.is_empty()) {
            let mut buf = cx.buffer(&self.batches, n * rb)?;
            let ranges: Vec<ReadRange> = state
                .src
                .iter()
                .enumerate()
                .map(|(k, &(file, offset))| ReadRange {
                    file,
                    offset,
                    len: rb as u64,
                    dst: (k * rb) as u64,
                })
                .collect();
            let stop = Stop::new(cx.stop_flag().clone());
            store.read_into(names, &ranges, buf.as_mut_bytes(), &stop)?;
            // Exact order from an object store: the batch's rows fetched at once with coalesced
            // ranged GETs (one request per row would leave the network idle between round
            // trips); the rows are in place: the gather has nothing left to do.
            return Ok(Prepared {
                buf,
                regions: Vec::new(),
                state,
            });
        }
        // Widened rows are gathered straight into the float32 batch: one pass over the rows,
        // on every gather thread, instead of a copy at the stored width and then a pass of one
        // thread over the whole batch.
        let layout = self.src.ds.layout();
        state.widen = self.upcast.is_some().then_some(layout.dtype);
        let ob = match state.widen {
            Some(_) => (layout.d_model * 4) as usize,
            None => rb,
        };
        let regions = exec::even_pieces(n * ob, self.piece_rows * ob);
        let buf = cx.buffer(&self.batches, n * ob)?;
        Ok(Prepared {
            buf,
            regions,
            state,
        })
    }

    fn fill(&self, b: &SaevBatch, piece: usize, out: &mut [&mut [u8]]) -> Result<()> {
        let src = &*self.src;
        let rb = src.row_bytes() as usize;
        // Bytes of a row in the batch: stored, or float32 when widened here.
        let ob = match b.widen {
            Some(_) => src.ds.layout().d_model as usize * 4,
            None => rb,
        };
        let first = piece * self.piece_rows;
        let rows = out[0].len() / ob;
        // A row that cannot be widened from where it lies is copied here first.
        let mut scratch = Vec::new();
        if self.direct && b.windows.is_empty() {
            for (k, dst) in out[0].chunks_exact_mut(ob).enumerate() {
                let (shard, offset) = b.src[first + k];
                match b.widen {
                    Some(dtype) => {
                        scratch.resize(rb, 0);
                        read_row(src, shard, offset, &mut scratch)?;
                        crate::precision::decode_bytes(dtype, &scratch, dst);
                    }
                    None => read_row(src, shard, offset, dst)?,
                }
            }
            return Ok(());
        }
        // Each row's bytes: in a shard's map or a window's buffer, or in the cache's pages held
        // for a window (one piece, or two where the row spans pages).
        let outside =
            |k: usize| Error::Internal(format!("internal: batch row {k} lies outside its data"));
        let row = |k: usize| -> Result<Row<'_>> {
            let (i, off) = b.src[k];
            let base = if b.in_windows {
                match &b.windows[i as usize].data {
                    WindowData::Read { buf, .. } => buf.as_bytes(),
                    WindowData::Held { pages, .. } => return Ok(Row::Held(pages, off)),
                    WindowData::Mapped => {
                        return Err(Error::Internal("internal: a mapped window".into()))
                    }
                }
            } else {
                src.map(i).map(|m| &m[..])?
            };
            base.get(off as usize..off as usize + rb)
                .map(Row::Bytes)
                .ok_or_else(|| outside(k))
        };
        let dsts = out[0].chunks_exact_mut(ob);
        for (k, dst) in (first..first + rows).zip(dsts) {
            if k + AHEAD < first + rows {
                match row(k + AHEAD) {
                    Ok(Row::Bytes(next)) => buffer::prefetch(next),
                    Ok(Row::Held(pages, off)) => {
                        if let Some(next) = pages.first(off) {
                            buffer::prefetch(next);
                        }
                    }
                    Err(_) => {}
                }
            }
            match (row(k)?, b.widen) {
                (Row::Bytes(bytes), None) => buffer::copy_streaming(dst, bytes),
                (Row::Held(pages, off), None) => pages
                    .copy_into(off, dst, buffer::copy_streaming)
                    .ok_or_else(|| outside(k))?,
                (Row::Bytes(bytes), Some(dtype)) => {
                    crate::precision::decode_bytes(dtype, bytes, dst)
                }
                (Row::Held(pages, off), Some(dtype)) => {
                    scratch.resize(rb, 0);
                    pages
                        .copy_into(off, &mut scratch, |d, s| d.copy_from_slice(s))
                        .ok_or_else(|| outside(k))?;
                    crate::precision::decode_bytes(dtype, &scratch, dst);
                }
            }
        }
        buffer::copy_done();
        Ok(())
    }

    fn finish(&self, p: Prepared<SaevBatch>, gather_pool: &rayon::ThreadPool) -> Result<Batch> {
        let src = &*self.src;
        let layout = src.ds.layout();
        let layers = src.ds.metadata().layers();
        let rows = &p.state.rows;
        let n = rows.len();
        let mut example_idx = Vec::with_capacity(n);
        let mut token_idx = Vec::with_capacity(n);
        let mut layer = (src.slots.len() > 1).then(|| Vec::with_capacity(n));
        let labels = src.labels();
        let mut token_label = labels.as_ref().map(|_| Vec::with_capacity(n));
        for &(b, j) in rows {
            let (li, sel) = src.split_row(b as u64, j as u64);
            let (_, c) = src.mode.token_of(layout, sel);
            example_idx.push(b as i64);
            token_idx.push(c);
            if let Some(l) = &mut layer {
                l.push(layers[src.slots[li]]);
            }
            if let (Some(out), Some(labels)) = (&mut token_label, &labels) {
                out.push(if c < 0 {
                    -1
                } else {
                    i64::from(labels[(b as u64 * layout.content_tokens + c as u64) as usize])
                });
            }
        }
        let (act, dtype) = match (&self.upcast, p.state.widen) {
            // Widened while gathered.
            (Some(_), Some(_)) => (p.buf, Dtype::F32),
            // Rows that arrived as stored (fetched at once from a store): widened now, in
            // pieces on the gather threads.
            (Some(pool), None) => {
                let mut wide = pool.get(n * layout.d_model as usize * 4);
                let (stored, d) = (layout.value_bytes() as usize, layout.d_model as usize);
                let out = wide.as_mut_f32();
                let piece = self.piece_rows * d;
                gather_pool.install(|| {
                    use rayon::prelude::*;
                    out.par_chunks_mut(piece)
                        .zip(p.buf[..n * d * stored].par_chunks(piece * stored))
                        .for_each(|(o, s)| crate::precision::decode(layout.dtype, s, o));
                });
                (wide, Dtype::F32)
            }
            (None, _) => (p.buf, layout.dtype),
        };
        Ok(Batch {
            act,
            dtype,
            n,
            d_model: layout.d_model as usize,
            example_idx,
            token_idx,
            layer,
            token_label,
            cursor: p.state.cursor,
        })
    }
}

/// Where a batch row's bytes are.
enum Row<'a> {
    /// In one slice (a shard's map, a window's buffer).
    Bytes(&'a [u8]),
    /// At this offset of a window whose pages the cache holds.
    Held(&'a HeldPages, u64),
}

/// Rows ahead of the one being copied whose first lines are prefetched: a gather of rows from
/// random places waits on memory (and the page table) for each, unless asked for early.
const AHEAD: usize = 4;

/// One row read straight into `dst`: O_DIRECT when aligned, else buffered.
fn read_row(src: &SaevSource, file: u32, offset: u64, dst: &mut [u8]) -> Result<()> {
    let aligned = offset.is_multiple_of(local::DIRECT_ALIGN)
        && (dst.len() as u64).is_multiple_of(local::DIRECT_ALIGN)
        && (dst.as_ptr() as u64).is_multiple_of(local::DIRECT_ALIGN);
    if aligned {
        if let Some(f) = src.direct(file) {
            use std::os::unix::fs::FileExt;
            if f.read_exact_at(dst, offset).is_ok() {
                return Ok(());
            }
        }
    }
    local::read_exact(src.file(file)?, &src.path(file), offset, dst)
}

/// The batches of one pass (see [`Loader::iter`]).
pub struct Batches {
    pub(super) inner: Inner,
    pub(super) cursor: Arc<AtomicU64>,
}

/// A pass over one planned order, or a follow-mode pass over rounds.
pub(super) enum Inner {
    One(exec::Stream<Batch>),
    Follow(Box<super::follow::FollowPass>),
}

impl Iterator for Batches {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        let b = match &mut self.inner {
            Inner::One(s) => s.next()?,
            Inner::Follow(f) => f.next()?,
        };
        if let Ok(b) = &b {
            self.cursor.store(b.cursor, Ordering::Relaxed);
        }
        Some(b)
    }
}
