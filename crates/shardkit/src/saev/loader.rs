//! Ordered and shuffled loaders over a saev directory, on the read engine.
//!
//! A *block* is one example's contiguous slab of the selected layer (`T·D·4` bytes), or the
//! whole example when `layer` is `all`; its rows are the selected tokens (minus those whose
//! label is ignored). Orders come from [`crate::engine::order`], so batches depend only on
//! `(seed, epoch, world_size, batch_size)` and the cursor, never on threads or timing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::engine::order::{rank_batches, EpochOrder, Order};
use crate::engine::reader::Files;
use crate::engine::stream::{self, BlockSource, StreamConfig};
use crate::engine::Buffer;
use crate::error::{Error, Result};
use crate::saev::{Dataset, TokenMode};

/// Which layer a loader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerSel {
    /// The slot recorded with this value.
    Value(i64),
    /// Every recorded layer (batches then carry `layer`).
    All,
}

impl std::str::FromStr for LayerSel {
    type Err = Error;
    fn from_str(s: &str) -> Result<LayerSel> {
        if s == "all" {
            return Ok(LayerSel::All);
        }
        s.parse()
            .map(LayerSel::Value)
            .map_err(|_| Error::Invalid(format!("layer must be an integer or \"all\", got {s:?}")))
    }
}

/// Default memory budget: 1 GiB.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

/// Options of a [`Loader`] (builder-style: start from `LoaderOptions::new(layer)`).
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Layer to read.
    pub layer: LayerSel,
    /// Tokens to read.
    pub tokens: TokenMode,
    /// Rows per batch on each rank.
    pub batch_size: u64,
    /// Drop the final partial global batch (on every rank alike).
    pub drop_last: bool,
    /// Order of the rows.
    pub order: Order,
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch; each epoch is a different order.
    pub epoch: u64,
    /// This rank (default: `$RANK`, else 0).
    pub rank: Option<u64>,
    /// Number of ranks (default: `$WORLD_SIZE`, else 1).
    pub world_size: Option<u64>,
    /// Bytes of buffers the loader may hold (default 1 GiB).
    pub memory_budget: Option<u64>,
    /// Skip content tokens whose labels.bin value is in this set (needs labels.bin).
    pub ignore_labels: Vec<u8>,
    /// Reads in flight (default 16).
    pub io_threads: usize,
    /// Read windows (sequential and block orders) with O_DIRECT where the file system allows
    /// it and ranges are 4 KiB-aligned: data goes straight from the disk into the loader's
    /// buffers, skipping the page-cache copy, but data already in the page cache is read from
    /// disk again. Default false. The exact order always uses O_DIRECT for aligned rows;
    /// anything refused falls back to buffered reads.
    pub direct_io: bool,
}

impl LoaderOptions {
    /// Defaults for `layer`: content tokens, batch 16384, sequential order, seed 0, epoch 0.
    pub fn new(layer: LayerSel) -> LoaderOptions {
        LoaderOptions {
            layer,
            tokens: TokenMode::Content,
            batch_size: 16384,
            drop_last: false,
            order: Order::Sequential,
            seed: 0,
            epoch: 0,
            rank: None,
            world_size: None,
            memory_budget: None,
            ignore_labels: Vec::new(),
            io_threads: 16,
            direct_io: false,
        }
    }
}

fn env_u64(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            Error::Invalid(format!(
                "environment variable {name}={v:?} is not a non-negative integer"
            ))
        }),
        Err(_) => Ok(None),
    }
}

/// The saev directory seen as blocks of selected rows.
pub struct SaevSource {
    ds: Dataset,
    slots: Vec<usize>,
    mode: TokenMode,
    /// Selected tokens per example before filtering.
    per_example: u64,
    /// With ignore_labels: kept selected-token indices of all examples, and per-example prefix.
    kept: Option<(Vec<u32>, Vec<u64>)>,
    labels: Option<Vec<u8>>,
}

impl SaevSource {
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
    /// The dataset.
    pub fn dataset(&self) -> &Dataset {
        &self.ds
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

impl BlockSource for SaevSource {
    fn n_blocks(&self) -> usize {
        self.ds.layout().n_examples as usize
    }
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
    fn rows(&self, b: u32) -> u64 {
        self.kept_count(b as u64) * self.slots.len() as u64
    }
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

/// One batch: `act` is `(n, d_model)` float32 in a page-aligned buffer.
#[derive(Debug)]
pub struct Batch {
    /// Activations, row-major `(n, d_model)`.
    pub act: Buffer,
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

impl Batch {
    /// The activations as `n · d_model` values.
    pub fn act(&self) -> &[f32] {
        self.act.as_f32()
    }
}

/// A loader's resumable position: a few integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderState {
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch.
    pub epoch: u64,
    /// Global stream rows consumed in this epoch (a global batch boundary).
    pub cursor: u64,
    /// `batch_size · world_size` when the state was taken.
    pub global_batch_size: u64,
}

/// Ordered or shuffled batches of one layer (or all) of a saev directory.
pub struct Loader {
    src: Arc<SaevSource>,
    opts: LoaderOptions,
    rank: u64,
    world: u64,
    budget: u64,
    window_blocks: u64,
    order: Arc<EpochOrder>,
    cursor: Arc<AtomicU64>,
    pools: stream::Pools,
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
    pub fn new(dir: impl AsRef<std::path::Path>, opts: LoaderOptions) -> Result<Loader> {
        let ds = Dataset::open(dir)?;
        let layout = *ds.layout();
        let slots = match opts.layer {
            LayerSel::Value(v) => vec![ds.metadata().layer_slot(v)?],
            LayerSel::All => (0..layout.n_layers as usize).collect(),
        };
        let per_example = opts.tokens.rows_per_example(&layout)?;
        let world = match opts.world_size {
            Some(w) => w,
            None => env_u64("WORLD_SIZE")?.unwrap_or(1),
        };
        let rank = match opts.rank {
            Some(r) => r,
            None => env_u64("RANK")?.unwrap_or(0),
        };
        if world == 0 || rank >= world {
            return Err(Error::Invalid(format!(
                "rank {rank} is not below world_size {world}"
            )));
        }
        if opts.batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
        }
        let labels = if ds.has_labels() {
            let mut all = vec![0u8; (layout.n_examples * layout.content_tokens) as usize];
            for e in 0..layout.n_examples {
                let p = layout.content_tokens as usize;
                ds.read_labels_into(e, &mut all[e as usize * p..(e as usize + 1) * p])?;
            }
            Some(all)
        } else {
            None
        };
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
            labels,
        };
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
        let src = Arc::new(src);
        let order = Arc::new(Self::plan_epoch(&src, &opts, window_blocks)?);
        Ok(Loader {
            src,
            opts,
            rank,
            world,
            budget,
            window_blocks,
            order,
            cursor: Arc::new(AtomicU64::new(0)),
            pools: stream::Pools::default(),
        })
    }

    fn plan_epoch(
        src: &SaevSource,
        opts: &LoaderOptions,
        window_blocks: u64,
    ) -> Result<EpochOrder> {
        let rows: Vec<u64> = (0..src.n_blocks() as u32).map(|b| src.rows(b)).collect();
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
    /// The blocks one window of the block order holds, as the budget allows.
    pub fn window_blocks(&self) -> u64 {
        self.window_blocks
    }

    /// Switches to epoch `epoch` (a different order) from its start.
    pub fn set_epoch(&mut self, epoch: u64) -> Result<()> {
        if epoch != self.opts.epoch {
            self.opts.epoch = epoch;
            self.order = Arc::new(Self::plan_epoch(&self.src, &self.opts, self.window_blocks)?);
        }
        self.cursor.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// The resumable position.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            seed: self.opts.seed,
            epoch: self.opts.epoch,
            cursor: self.cursor.load(Ordering::Relaxed),
            global_batch_size: self.opts.batch_size * self.world,
        }
    }

    /// Restores a position taken with [`Loader::state`] (possibly on another world size with
    /// the same global batch size).
    pub fn load_state(&mut self, st: LoaderState) -> Result<()> {
        let global = self.opts.batch_size * self.world;
        if st.global_batch_size != global {
            return Err(Error::Invalid(format!(
                "the state was taken with a global batch of {} rows; this loader's is {global} \
                 (batch_size {} x world_size {}); keep batch_size x world_size fixed to resume",
                st.global_batch_size, self.opts.batch_size, self.world
            )));
        }
        if st.cursor > self.order.len() {
            return Err(Error::Invalid(format!(
                "cursor {} is past the end of the epoch ({} rows)",
                st.cursor,
                self.order.len()
            )));
        }
        if st.seed != self.opts.seed || st.epoch != self.opts.epoch {
            self.opts.seed = st.seed;
            self.opts.epoch = st.epoch;
            self.order = Arc::new(Self::plan_epoch(&self.src, &self.opts, self.window_blocks)?);
        }
        if !st.cursor.is_multiple_of(global) && st.cursor != self.order.len() {
            return Err(Error::Invalid(format!(
                "cursor {} is not a multiple of the global batch size {global}",
                st.cursor
            )));
        }
        self.cursor.store(st.cursor, Ordering::Relaxed);
        Ok(())
    }

    /// Iterates the rest of the epoch from the current cursor (from the start if the epoch was
    /// finished). The same epoch is repeated until [`Loader::set_epoch`] changes it.
    pub fn iter(&self) -> Result<Batches> {
        let total = self.order.len();
        let end = if self.opts.drop_last {
            total - total % (self.opts.batch_size * self.world)
        } else {
            total
        };
        let mut cursor = self.cursor.load(Ordering::Relaxed);
        if cursor >= end {
            cursor = 0;
            self.cursor.store(0, Ordering::Relaxed);
        }
        let cfg = StreamConfig {
            order: self.opts.order,
            seed: self.opts.seed,
            epoch: self.opts.epoch,
            batch_size: self.opts.batch_size,
            rank: self.rank,
            world_size: self.world,
            drop_last: self.opts.drop_last,
            memory_budget: self.budget,
            io_threads: self.opts.io_threads.max(1),
            direct_io: self.opts.direct_io,
            cursor,
        };
        let stream = stream::start(
            self.src.clone(),
            self.order.clone(),
            cfg,
            self.pools.clone(),
        )?;
        Ok(Batches {
            stream,
            src: self.src.clone(),
            cursor: self.cursor.clone(),
        })
    }
}

/// The batches of one pass (see [`Loader::iter`]).
pub struct Batches {
    stream: stream::Stream,
    src: Arc<SaevSource>,
    cursor: Arc<AtomicU64>,
}

impl Iterator for Batches {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        let raw = match self.stream.next()? {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let src = &*self.src;
        let layout = src.ds.layout();
        let layers = src.ds.metadata().layers();
        let n = raw.rows.len();
        let mut example_idx = Vec::with_capacity(n);
        let mut token_idx = Vec::with_capacity(n);
        let mut layer = (src.slots.len() > 1).then(|| Vec::with_capacity(n));
        let mut token_label = src.labels.as_ref().map(|_| Vec::with_capacity(n));
        for &(b, j) in &raw.rows {
            let (li, sel) = src.split_row(b as u64, j as u64);
            let (_, c) = src.mode.token_of(layout, sel);
            example_idx.push(b as i64);
            token_idx.push(c);
            if let Some(l) = &mut layer {
                l.push(layers[src.slots[li]]);
            }
            if let (Some(out), Some(labels)) = (&mut token_label, &src.labels) {
                out.push(if c < 0 {
                    -1
                } else {
                    i64::from(labels[(b as u64 * layout.content_tokens + c as u64) as usize])
                });
            }
        }
        self.cursor.store(raw.cursor, Ordering::Relaxed);
        Some(Ok(Batch {
            act: raw.data,
            n,
            d_model: layout.d_model as usize,
            example_idx,
            token_idx,
            layer,
            token_label,
            cursor: raw.cursor,
        }))
    }
}
