//! A saev loader's options and its resumable state, on the loader contract
//! ([`crate::engine::LoaderOptions`], [`crate::engine::LoaderState`]): saev's own knobs (layer,
//! tokens, memory budget, ignored labels, O_DIRECT) beside the common ones, and its state's
//! own keys (`cursor`, `global_batch_size` and the parameters that decide the order).

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::follow;
use super::loader::Loader;
use crate::engine::dist::{differ, refuse};
use crate::engine::order::Order;
use crate::engine::{LoaderState, StateValue};
use crate::error::{Error, Result};
use crate::saev::TokenMode;

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

impl std::fmt::Display for LayerSel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerSel::Value(v) => write!(f, "{v}"),
            LayerSel::All => f.write_str("all"),
        }
    }
}

/// Default memory budget: 1 GiB.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

/// The format's name in a [`LoaderState`].
const FORMAT: &str = "saev";

/// saev's own loader knobs (fields of [`LoaderOptions`] through `Deref`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaevOptions {
    /// Layer to read.
    pub layer: LayerSel,
    /// Tokens to read.
    pub tokens: TokenMode,
    /// Bytes of buffers the loader may hold (default 1 GiB).
    pub memory_budget: Option<u64>,
    /// Skip content tokens whose labels.bin value is in this set (needs labels.bin).
    pub ignore_labels: Vec<u8>,
    /// Reads in flight for O_DIRECT window reads (default 16).
    pub io_threads: usize,
    /// Bypass the page cache: windows (sequential and block orders) are read with O_DIRECT
    /// into the loader's own buffers and rows of the exact order with O_DIRECT reads, where
    /// the file system allows it and ranges are 4 KiB-aligned (anything refused falls back to
    /// buffered reads). Streams data larger than memory without evicting the page cache, but
    /// data already cached is read from disk again. Default false: reads go through the page
    /// cache and cached data is gathered straight from it. Not with `verify` (blocks are
    /// verified through the page cache).
    pub direct_io: bool,
    /// Read the dataset while it is written (see [`super::FollowOptions`]): `None` (the
    /// default) reads only a committed dataset. Applied by [`Loader::new`] (a loader made with
    /// [`Loader::with_dataset`] reads the dataset given, as without follow).
    pub follow: Option<super::FollowOptions>,
    /// Serve float32 rows from a bfloat16 / float16 dataset, widened (exactly) once a batch is
    /// gathered: the disk and the page cache still move the stored bytes. Default false: rows
    /// as stored ([`Batch::dtype`](super::Batch::dtype)). No effect on a float32 dataset.
    pub upcast: bool,
}

/// Options of a [`Loader`]: the common knobs (`batch_size` is rows per batch on each rank)
/// and [`SaevOptions`]. Start from `LoaderOptions::new(layer)`.
pub type LoaderOptions = crate::engine::LoaderOptions<SaevOptions>;

impl crate::engine::LoaderOptions<SaevOptions> {
    /// Defaults for `layer`: content tokens, batch 16384, the default (block) order, seed 0,
    /// epoch 0, a 1 GiB memory budget, 16 O_DIRECT reads in flight.
    pub fn new(layer: LayerSel) -> LoaderOptions {
        LoaderOptions::with_format(
            16384,
            SaevOptions {
                layer,
                tokens: TokenMode::Content,
                memory_budget: None,
                ignore_labels: Vec::new(),
                io_threads: 16,
                direct_io: false,
                follow: None,
                upcast: false,
            },
        )
    }
}

/// A state with only the global position (what `saev stream` states and states saved before
/// the order's parameters were recorded hold): checked on the seed and the global batch only.
pub fn state_at(seed: u64, epoch: u64, cursor: u64, global_batch_size: u64) -> LoaderState {
    LoaderState::new(
        FORMAT,
        seed,
        epoch,
        batch_of(cursor, global_batch_size),
        global_batch_size,
        1,
    )
    .with("cursor", StateValue::UInt(cursor))
    .with("global_batch_size", StateValue::UInt(global_batch_size))
}

/// The global batch a cursor (global rows consumed) is at.
fn batch_of(cursor: u64, global: u64) -> u64 {
    if global == 0 {
        0
    } else {
        cursor.div_ceil(global)
    }
}

impl Loader {
    /// The resumable position and the parameters that decide the order: the common position
    /// (`batch` counts global batches, the same on every rank), then saev's `cursor` (global
    /// rows consumed), `global_batch_size`, `order`, `layer`, `tokens`, `ignore_labels`,
    /// `drop_last`, `memory_budget`, `window_blocks` and `rows`.
    pub fn state(&self) -> LoaderState {
        let mut ignore = self.opts.ignore_labels.clone();
        ignore.sort_unstable();
        ignore.dedup();
        let cursor = self.cursor.load(Ordering::Relaxed);
        let global = self.opts.batch_size * self.world;
        let layer = match self.opts.layer {
            LayerSel::Value(v) => StateValue::Int(v),
            LayerSel::All => StateValue::Str("all".into()),
        };
        let st = state_at(self.opts.seed, self.opts.epoch, cursor, global)
            .with_world(self.opts.batch_size, self.world)
            .with("order", StateValue::Str(self.opts.order.name().into()))
            .with("layer", layer)
            .with("tokens", StateValue::Str(self.opts.tokens.name().into()))
            .with(
                "ignore_labels",
                StateValue::List(ignore.into_iter().map(u64::from).collect()),
            )
            .with("drop_last", StateValue::Bool(self.opts.drop_last))
            .with(
                "memory_budget",
                StateValue::UInt(self.opts.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET)),
            )
            .with("window_blocks", StateValue::UInt(self.effective_window()))
            .with("rows", StateValue::UInt(self.order.len()));
        match &self.follow {
            // Follow mode: the epoch's rounds, which the cursor counts through; each round
            // ends with its own partial batch, so `batch` counts the batches served.
            Some(f) => {
                let mut st = st.with(follow::ROUNDS_KEY, follow::state_value(f));
                st.batch = self.follow_batches(&f.rounds(), cursor);
                st
            }
            None => st,
        }
    }

    /// Blocks per window as the order uses them (a budget larger than the dataset gives one
    /// window, whatever its size).
    fn effective_window(&self) -> u64 {
        self.window_blocks.min(self.blocks())
    }

    /// Restores a position taken with [`Loader::state`] (possibly on another world size with
    /// the same global batch size). A state taken by a loader that would serve other rows (other
    /// seed, order, layer, tokens, ignored labels, `drop_last`, memory budget of the block
    /// order, global batch or dataset size) is refused, naming each parameter that differs.
    /// The position is the state's `cursor` and `global_batch_size`, or, in a state without
    /// them, its `batch` of `batch_size × world_size` rows.
    pub fn load_state(&mut self, st: LoaderState) -> Result<()> {
        st.check_format(FORMAT)?;
        let theirs = SaevState::read(&st, self.order.len())?;
        let mine = self.state();
        let global = self.opts.batch_size * self.world;
        let mut diff = Vec::new();
        if theirs.global != global {
            diff.push(format!(
                "global_batch_size: state {}, this loader {global} (batch_size {} x world_size \
                 {}; keep batch_size x world_size fixed to resume)",
                theirs.global, self.opts.batch_size, self.world
            ));
        }
        let shuffled = |o: Option<Order>| o != Some(Order::Sequential);
        if shuffled(theirs.order) && shuffled(Some(self.opts.order)) {
            differ(
                &mut diff,
                "seed",
                Some(&st.seed),
                &mine.seed,
                u64::to_string,
            );
        }
        differ(
            &mut diff,
            "order",
            theirs.order.as_ref(),
            &self.opts.order,
            |o| o.name().to_string(),
        );
        differ(
            &mut diff,
            "layer",
            theirs.layer.as_ref(),
            &self.opts.layer,
            |l| l.to_string(),
        );
        differ(
            &mut diff,
            "tokens",
            theirs.tokens.as_ref(),
            &self.opts.tokens,
            |t| t.name().to_string(),
        );
        let mut my_ignore = self.opts.ignore_labels.clone();
        my_ignore.sort_unstable();
        my_ignore.dedup();
        differ(
            &mut diff,
            "ignore_labels",
            theirs.ignore_labels.as_ref(),
            &my_ignore,
            |v| format!("{v:?}"),
        );
        differ(
            &mut diff,
            "drop_last",
            theirs.drop_last.as_ref(),
            &self.opts.drop_last,
            bool::to_string,
        );
        // The budget decides the block order through the blocks per window it gives.
        let my_window = self.effective_window();
        if self.opts.order == Order::Block && theirs.window_blocks != Some(my_window) {
            if let Some(w) = theirs.window_blocks {
                let budget = |b: Option<u64>| b.map_or("?".to_string(), |b| b.to_string());
                diff.push(format!(
                    "memory_budget: state {} bytes (windows of {w} blocks), this loader {} bytes \
                     (windows of {my_window} blocks)",
                    budget(theirs.memory_budget),
                    budget(Some(
                        self.opts.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET)
                    )),
                ));
            }
        }
        differ(
            &mut diff,
            "rows",
            theirs.rows.as_ref(),
            &self.order.len(),
            u64::to_string,
        );
        refuse(diff)?;
        if st.epoch != self.opts.epoch {
            self.opts.epoch = st.epoch;
            self.order = Arc::new(Self::plan_epoch(&self.src, &self.opts, self.window_blocks)?);
        }
        let cursor = theirs.cursor;
        if let Some(rounds) = self.follow_rounds(&st, cursor)? {
            let f = self.follow.as_ref().ok_or_else(|| {
                Error::Internal("internal: follow rounds without follow mode".into())
            })?;
            f.set_rounds(rounds);
            self.cursor.store(cursor, Ordering::Relaxed);
            *self.resumed.get_mut() = true;
            return Ok(());
        }
        if cursor > self.order.len() {
            return Err(Error::Invalid(format!(
                "cursor {} is past the end of the epoch ({} rows)",
                cursor,
                self.order.len()
            )));
        }
        if !cursor.is_multiple_of(global) && cursor != self.order.len() {
            return Err(Error::Invalid(format!(
                "cursor {cursor} is not a multiple of the global batch size {global}"
            )));
        }
        self.cursor.store(cursor, Ordering::Relaxed);
        *self.resumed.get_mut() = true;
        Ok(())
    }
}

impl Loader {
    /// Global batches a follow-mode loader has served at `cursor` of an epoch of `rounds`.
    fn follow_batches(&self, rounds: &[Vec<Range<u64>>], cursor: u64) -> u64 {
        let bs = (self.opts.batch_size * self.world).max(1);
        let (mut offset, mut batches) = (0, 0);
        for r in rounds {
            let rows = self.src.rows_in_shards(r);
            batches += cursor.saturating_sub(offset).min(rows).div_ceil(bs);
            offset += rows;
        }
        batches
    }

    /// The rounds a follow-mode loader resumes `st` with (`None` for a loader that is not in
    /// follow mode, given a state of one epoch in one round: read as without follow). A state
    /// of several rounds needs follow mode; a cursor must be at a batch of its round.
    fn follow_rounds(&self, st: &LoaderState, cursor: u64) -> Result<Option<Vec<Vec<Range<u64>>>>> {
        let n = self.dataset().layout().n_shards;
        #[allow(clippy::single_range_in_vec_init)] // one round of one range: every shard
        let whole = vec![0..n];
        let rounds = match st.get(follow::ROUNDS_KEY) {
            None => None,
            Some(StateValue::List(flat)) => Some(follow::decode(flat, n)?),
            Some(v) => {
                return Err(Error::Invalid(format!(
                    "state key {:?} is {v}, not a list of counts",
                    follow::ROUNDS_KEY
                )))
            }
        };
        if self.follow.is_none() {
            return match rounds {
                Some(r) if !(r.is_empty() || r == [whole]) => Err(Error::Invalid(format!(
                    "the state was taken by a follow-mode loader part way through an epoch read \
                     while the dataset was written ({} rounds): resume it with follow mode \
                     (follow=True, drop_last off, and with world_size > 1 a round broadcast)",
                    r.len()
                ))),
                _ => Ok(None),
            };
        }
        // A state of a loader without follow: its epoch was one round of every shard.
        let rounds = rounds.unwrap_or_else(|| if cursor > 0 { vec![whole] } else { Vec::new() });
        let bs = self.opts.batch_size * self.world;
        let mut offset = 0;
        for r in &rounds {
            let rows = self.src.rows_in_shards(r);
            if (offset..offset + rows).contains(&cursor) && !(cursor - offset).is_multiple_of(bs) {
                return Err(Error::Invalid(format!(
                    "cursor {cursor} is not at a batch of its round (rows {offset}..{} of the \
                     epoch, global batches of {bs})",
                    offset + rows
                )));
            }
            offset += rows;
        }
        if cursor > offset {
            return Err(Error::Invalid(format!(
                "cursor {cursor} is past the end of the state's rounds ({offset} rows)"
            )));
        }
        Ok(Some(rounds))
    }
}

impl LoaderState {
    /// `self` with the per-rank batch size and world size set.
    fn with_world(mut self, batch_size: u64, world_size: u64) -> LoaderState {
        self.batch_size = batch_size;
        self.world_size = world_size;
        self
    }
}

/// saev's keys of a state, read (each `None` when the state lacks it).
struct SaevState {
    cursor: u64,
    global: u64,
    order: Option<Order>,
    layer: Option<LayerSel>,
    tokens: Option<TokenMode>,
    ignore_labels: Option<Vec<u8>>,
    drop_last: Option<bool>,
    memory_budget: Option<u64>,
    window_blocks: Option<u64>,
    rows: Option<u64>,
}

impl SaevState {
    /// saev's keys of `st`; the position from `cursor` and `global_batch_size`, else from the
    /// common `batch` (of an epoch of `rows` rows).
    fn read(st: &LoaderState, rows: u64) -> Result<SaevState> {
        let (cursor, global) = match (st.uint("cursor")?, st.uint("global_batch_size")?) {
            (Some(c), Some(g)) => (c, g),
            _ => {
                let g = st.batch_size.saturating_mul(st.world_size);
                (st.batch.saturating_mul(g).min(rows), g)
            }
        };
        let layer = match st.get("layer") {
            None => None,
            Some(StateValue::Str(s)) => Some(s.parse::<LayerSel>()?),
            Some(_) => Some(LayerSel::Value(
                st.read("layer", |v| match *v {
                    StateValue::Int(x) => Some(x),
                    StateValue::UInt(x) => i64::try_from(x).ok(),
                    _ => None,
                })?
                .unwrap_or_default(),
            )),
        };
        let ignore_labels = st.read("ignore_labels", |v| match v {
            StateValue::List(items) => items.iter().map(|&x| u8::try_from(x).ok()).collect(),
            _ => None,
        })?;
        let ignore_labels = ignore_labels.map(|mut v: Vec<u8>| {
            v.sort_unstable();
            v.dedup();
            v
        });
        Ok(SaevState {
            cursor,
            global,
            order: st.name("order")?.map(str::parse).transpose()?,
            layer,
            tokens: st.name("tokens")?.map(str::parse).transpose()?,
            ignore_labels,
            drop_last: st.flag("drop_last")?,
            memory_budget: st.uint("memory_budget")?,
            window_blocks: st.uint("window_blocks")?,
            rows: st.uint("rows")?,
        })
    }
}
