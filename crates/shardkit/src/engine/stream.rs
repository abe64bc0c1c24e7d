//! A running epoch: batches produced on background threads, in exactly the order that
//! [`order`](super::order) planned, with memory bounded by the budget.
//!
//! Block and sequential orders are served window by window: a reader thread reads each window's
//! blocks (merged, parallel, large reads) into one buffer, one window ahead of the gatherer,
//! which copies each row once into its batch buffer. The exact order reads each batch's rows
//! directly into the batch buffer with many small reads in flight. Channels are bounded, so a
//! slow consumer stops the readers instead of growing memory; dropping the stream stops and
//! joins its threads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::engine::batch::{Buffer, BufferPool};

use crate::engine::order::{rank_batches, EpochOrder, Order};
use crate::engine::reader::{plan_reads, read_all, Files, ReadRange};
use crate::error::{Error, Result};

/// Free batch buffers kept for reuse (queued + in the consumer's hands + one being built).
const BATCH_POOL: usize = 6;

/// Data laid out as blocks of rows (e.g. one example's slab of one layer).
pub trait BlockSource: Files + Send + 'static {
    /// Number of blocks.
    fn n_blocks(&self) -> usize;
    /// (file, byte offset, byte length) of block `b`; a block is contiguous on disk.
    fn block(&self, b: u32) -> (u32, u64, u64);
    /// Selected rows of block `b`.
    fn rows(&self, b: u32) -> u64;
    /// Byte offset, inside block `b`, of its selected row `j`.
    fn row_offset(&self, b: u32, j: u64) -> u64;
    /// Bytes per row.
    fn row_bytes(&self) -> u64;
}

/// What a stream serves.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// The order.
    pub order: Order,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Epoch (each epoch a different order).
    pub epoch: u64,
    /// Rows per batch on this rank.
    pub batch_size: u64,
    /// This rank.
    pub rank: u64,
    /// Number of ranks.
    pub world_size: u64,
    /// Drop the final partial global batch.
    pub drop_last: bool,
    /// Bytes the stream may hold in buffers.
    pub memory_budget: u64,
    /// Reads in flight.
    pub io_threads: usize,
    /// Read windows with O_DIRECT where ranges are aligned (the exact order always tries it).
    pub direct_io: bool,
    /// Global stream positions already consumed (a multiple of `batch_size · world_size`).
    pub cursor: u64,
}

/// One batch of raw rows.
#[derive(Debug)]
pub struct RawBatch {
    /// `rows.len() · row_bytes` bytes, row-major, page-aligned.
    pub data: Buffer,
    /// (block, selected row within block) of each row.
    pub rows: Vec<(u32, u32)>,
    /// The global cursor once this batch is consumed (the same on every rank).
    pub cursor: u64,
}

/// A running epoch; iterate it for batches.
pub struct Stream {
    /// One channel per producer; producer `i` serves batches `i, i + n, i + 2n, ...`.
    rx: Vec<Receiver<Result<RawBatch>>>,
    next: usize,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// The process that started the threads: after fork(), a child has none of them.
    pid: u32,
}

impl Iterator for Stream {
    type Item = Result<RawBatch>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.rx.is_empty() {
            return None;
        }
        if std::process::id() != self.pid {
            return Some(Err(Error::Invalid(
                "this stream was started before fork(); its reader threads live in the parent \
                 process: start a new iteration in the child"
                    .into(),
            )));
        }
        let i = self.next % self.rx.len();
        self.next += 1;
        self.rx[i].recv().ok()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.rx.clear(); // unblocks producers waiting to send
        if std::process::id() != self.pid {
            // A forked child: the threads exist only in the parent; joining would fail.
            self.threads.drain(..).for_each(std::mem::forget);
            return;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The batches (stream ranges) this rank serves from `cfg.cursor` on, and the epoch length.
pub fn plan(order: &EpochOrder, cfg: &StreamConfig) -> Result<Vec<(u64, u64, u64)>> {
    if cfg.batch_size == 0 || cfg.world_size == 0 || cfg.rank >= cfg.world_size {
        return Err(Error::Invalid(format!(
            "need batch_size >= 1 and rank < world_size (got batch_size {}, rank {}, world_size {})",
            cfg.batch_size, cfg.rank, cfg.world_size
        )));
    }
    let global = cfg.batch_size * cfg.world_size;
    let total = order.len();
    if !cfg.cursor.is_multiple_of(global) && cfg.cursor != total {
        return Err(Error::Invalid(format!(
            "cursor {} is not at a global batch boundary (multiple of batch_size x world_size = {global})",
            cfg.cursor
        )));
    }
    Ok(rank_batches(
        total,
        cfg.batch_size,
        cfg.rank,
        cfg.world_size,
        cfg.drop_last,
    )
    .filter(|&(s, _)| s >= cfg.cursor - cfg.cursor % global)
    .map(|(s, e)| {
        let g_end = ((s / global) + 1) * global;
        (s, e, g_end.min(total))
    })
    .collect())
}

/// Starts streaming `source` under `order` and `cfg`.
/// Buffers a stream draws from; keep them across epochs so memory is allocated once.
#[derive(Clone)]
pub struct Pools {
    /// Window buffers (three are live at most: one being read, two being gathered).
    pub windows: BufferPool,
    /// Batch buffers.
    pub batches: BufferPool,
}

impl Default for Pools {
    fn default() -> Pools {
        Pools {
            windows: BufferPool::new(3),
            batches: BufferPool::new(BATCH_POOL),
        }
    }
}

/// Starts streaming `source` under `order` and `cfg`, with buffers from `pools`.
pub fn start<S: BlockSource>(
    source: Arc<S>,
    order: Arc<EpochOrder>,
    cfg: StreamConfig,
    pools: Pools,
) -> Result<Stream> {
    let batches = plan(&order, &cfg)?;
    let stop = Arc::new(AtomicBool::new(false));
    let batch_bytes = cfg.batch_size * source.row_bytes();
    // Batches share the last quarter of the budget: queued ones plus one being built and one
    // held by the consumer.
    let depth = (cfg.memory_budget / 4 / batch_bytes.max(1))
        .saturating_sub(2)
        .clamp(1, 4) as usize;
    let mut threads = Vec::new();
    let mut receivers = Vec::new();
    match order.order() {
        Order::Exact => {
            // Two producers on alternating batches keep the next batch's small reads in flight
            // while the current one completes.
            const PRODUCERS: usize = 2;
            let cfg = Arc::new(cfg);
            for w in 0..PRODUCERS {
                let (tx, rx) = sync_channel(depth.div_ceil(PRODUCERS));
                receivers.push(rx);
                let mine: Vec<_> = batches.iter().copied().skip(w).step_by(PRODUCERS).collect();
                let (src, order, cfg, stop2, pool) = (
                    source.clone(),
                    order.clone(),
                    cfg.clone(),
                    stop.clone(),
                    pools.batches.clone(),
                );
                threads.push(
                    std::thread::Builder::new()
                        .name("shardkit-exact".into())
                        .spawn(move || {
                            exact_producer(&*src, &order, &cfg, mine, &pool, &tx, &stop2)
                        })
                        .map_err(|e| {
                            Error::Invalid(format!("cannot start a reader thread: {e}"))
                        })?,
                );
            }
        }
        Order::Block | Order::Sequential => {
            let (tx, rx) = sync_channel(depth);
            receivers.push(rx);
            let needed = windows_needed(&order, &batches);
            let (wtx, wrx) = sync_channel::<Result<LoadedWindow>>(0);
            let (src2, order2, stop2, cfg2) =
                (source.clone(), order.clone(), stop.clone(), cfg.clone());
            let (wpool, bpool) = (pools.windows.clone(), pools.batches);
            threads.push(
                std::thread::Builder::new()
                    .name("shardkit-read".into())
                    .spawn(move || {
                        window_reader(&*src2, &order2, needed, &cfg2, &wpool, &wtx, &stop2)
                    })
                    .map_err(|e| Error::Invalid(format!("cannot start a reader thread: {e}")))?,
            );
            let stop3 = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("shardkit-gather".into())
                    .spawn(move || gatherer(&*source, &order, batches, &bpool, wrx, &tx, &stop3))
                    .map_err(|e| Error::Invalid(format!("cannot start a gather thread: {e}")))?,
            );
        }
    }
    Ok(Stream {
        rx: receivers,
        next: 0,
        stop,
        threads,
        pid: std::process::id(),
    })
}

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

struct LoadedWindow {
    index: usize,
    buf: Buffer,
    /// Buffer offset of each of the window's blocks, in window order.
    block_dst: Vec<u64>,
    perm: Vec<u32>,
}

fn window_reader<S: BlockSource>(
    src: &S,
    order: &EpochOrder,
    needed: Vec<usize>,
    cfg: &StreamConfig,
    pool: &BufferPool,
    tx: &SyncSender<Result<LoadedWindow>>,
    stop: &AtomicBool,
) {
    for w in needed {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let win = &order.windows()[w];
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
        let mut buf = pool.get(dst as usize);
        let result = read_all(
            src,
            &plan_reads(ranges),
            buf.as_mut_bytes(),
            cfg.io_threads,
            cfg.direct_io,
        )
        .map(|()| LoadedWindow {
            index: w,
            buf,
            block_dst,
            perm: order.window_permutation(w),
        });
        let failed = result.is_err();
        if tx.send(result).is_err() || failed {
            return;
        }
    }
}

fn gatherer<S: BlockSource>(
    src: &S,
    order: &EpochOrder,
    batches: Vec<(u64, u64, u64)>,
    pool: &BufferPool,
    wrx: Receiver<Result<LoadedWindow>>,
    tx: &SyncSender<Result<RawBatch>>,
    stop: &AtomicBool,
) {
    let rb = src.row_bytes() as usize;
    let mut resident: VecDeque<LoadedWindow> = VecDeque::new();
    for (s, e, cursor) in batches {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let (first, last) = (order.window_of(s), order.window_of(e - 1));
        while resident.front().is_some_and(|w| w.index < first) {
            resident.pop_front();
        }
        while resident.back().is_none_or(|w| w.index < last) {
            match wrx.recv() {
                Ok(Ok(w)) => resident.push_back(w),
                Ok(Err(err)) => {
                    let _ = tx.send(Err(err));
                    return;
                }
                Err(_) => return, // reader stopped
            }
        }
        let n = (e - s) as usize;
        let mut data = pool.get(n * rb);
        let out = data.as_mut_bytes();
        let mut rows = Vec::with_capacity(n);
        let mut k = 0usize;
        let mut p = s;
        while p < e {
            // One window lookup per contiguous segment of the batch.
            let wi = order.window_of(p);
            let win = &order.windows()[wi];
            let seg_end = e.min(win.start + win.rows());
            let lw = resident
                .iter()
                .find(|w| w.index == wi)
                .expect("windows of the batch are resident");
            let window = lw.buf.as_bytes();
            for &q in &lw.perm[(p - win.start) as usize..(seg_end - win.start) as usize] {
                let q = q as u64;
                let i = win.row_prefix.partition_point(|&x| x <= q) - 1;
                let (b, j) = (win.blocks[i], q - win.row_prefix[i]);
                let at = (lw.block_dst[i] + src.row_offset(b, j)) as usize;
                out[k * rb..(k + 1) * rb].copy_from_slice(&window[at..at + rb]);
                rows.push((b, j as u32));
                k += 1;
            }
            p = seg_end;
        }
        if tx.send(Ok(RawBatch { data, rows, cursor })).is_err() {
            return;
        }
    }
}

fn exact_producer<S: BlockSource>(
    src: &S,
    order: &EpochOrder,
    cfg: &StreamConfig,
    batches: Vec<(u64, u64, u64)>,
    pool: &BufferPool,
    tx: &SyncSender<Result<RawBatch>>,
    stop: &AtomicBool,
) {
    let rb = src.row_bytes();
    for (s, e, cursor) in batches {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let n = (e - s) as usize;
        let mut rows = Vec::with_capacity(n);
        let mut ranges = Vec::with_capacity(n);
        for (k, p) in (s..e).enumerate() {
            let (b, j) = order.locate(p);
            let (file, offset, _) = src.block(b);
            ranges.push(ReadRange {
                file,
                offset: offset + src.row_offset(b, j),
                len: rb,
                dst: k as u64 * rb,
            });
            rows.push((b, j as u32));
        }
        let mut data = pool.get(n * rb as usize);
        let result = read_all(
            src,
            &plan_reads(ranges),
            data.as_mut_bytes(),
            cfg.io_threads,
            true,
        )
        .map(|()| RawBatch { data, rows, cursor });
        let failed = result.is_err();
        if tx.send(result).is_err() || failed {
            return;
        }
    }
}
