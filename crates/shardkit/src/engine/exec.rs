//! The pipeline every loader runs on: batches planned in order, prepared ahead, gathered on
//! many threads, finished and handed over in the planned order.
//!
//! A format describes its batches as a [`Job`]:
//! 1. **prepare** (one thread, in batch order, a few batches ahead): make the batch's data
//!    resident (read windows, start readahead, map blocks) and take its buffer;
//! 2. **fill** (the gather pool, in parallel): each piece writes one disjoint region of the
//!    buffer (a run of rows, a field, a decoded row); the regions are checked disjoint and
//!    handed out as `&mut [u8]`, so pieces never share memory;
//! 3. **finish** (in order): small per-batch work (indices, labels, expansions) and the item.
//!
//! Two lanes take prepared batches alternately and fill them on the shared gather pool, so the
//! next batch is being gathered while the previous one is finished and handed over; the
//! consumer takes the lanes' outputs alternately, which restores the planned order. Queues are
//! bounded: a slow consumer stops the pipeline instead of growing memory.
//!
//! Every fault reaches the consumer as an error, never as a short epoch: an error of any stage,
//! a panic anywhere (caught and reported with its message), a thread that cannot be started,
//! and a stage that stops without its end mark. After an error the stream ends. Dropping the
//! stream stops and joins its threads. A stream started before `fork()` refuses to run in the
//! child (its threads live in the parent).

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fault;
use crate::io::buffer::{Buffer, BufferPool};

/// A batch after [`Job::prepare`]: its buffer, the regions the pieces fill, and what the job
/// needs to fill and finish it.
pub(crate) struct Prepared<S> {
    /// The batch's memory.
    pub buf: Buffer,
    /// The regions of `buf` each piece fills (piece `i` gets `regions[i]`, in that order).
    /// All regions, of all pieces, must be disjoint and inside `buf` (checked); they need not
    /// cover it.
    pub regions: Vec<Vec<Range<usize>>>,
    /// The job's own state of this batch (rows, resident windows, ...).
    pub state: S,
}

/// Pieces of one region each, from consecutive `step`-byte slices of `0..len`.
pub(crate) fn even_pieces(len: usize, step: usize) -> Vec<Vec<Range<usize>>> {
    let step = step.max(1);
    (0..len)
        .step_by(step)
        .map(|a| std::iter::once(a..(a + step).min(len)).collect())
        .collect()
}

/// One format's batches as the engine runs them.
pub(crate) trait Job: Send + Sync + 'static {
    /// What the order assigns one batch (its rows, its step, its samples).
    type Plan: Send + 'static;
    /// The job's state of a prepared batch.
    type State: Send + Sync + 'static;
    /// A finished batch.
    type Item: Send + 'static;

    /// Makes the batch's data ready to gather and takes its buffer (through
    /// [`Context::buffer`], so a stopped stream never waits for one). Runs on the prefetch
    /// thread, in batch order, ahead of the gather.
    fn prepare(&self, plan: Self::Plan, cx: &Context<'_>) -> Result<Prepared<Self::State>>;

    /// Fills piece `piece` of a prepared batch: `out[k]` is exactly region `regions[piece][k]`
    /// of its buffer. Runs on the gather pool, many pieces at once.
    fn fill(&self, state: &Self::State, piece: usize, out: &mut [&mut [u8]]) -> Result<()>;

    /// Turns a filled batch into the item handed to the consumer (in batch order). `pool` may
    /// be used for parallel work.
    fn finish(&self, batch: Prepared<Self::State>, pool: &rayon::ThreadPool) -> Result<Self::Item>;
}

/// What [`Job::prepare`] may ask of the stream running it.
pub(crate) struct Context<'a> {
    stop: &'a Arc<AtomicBool>,
}

impl Context<'_> {
    /// A buffer of `len` bytes from `pool`; with an external pool, waits for one to come back
    /// unless the stream is being stopped.
    pub(crate) fn buffer(&self, pool: &BufferPool, len: usize) -> Result<Buffer> {
        pool.get_or_wait(len, self.stop)
    }
    /// Whether the stream is being stopped (long preparations may give up early).
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
    /// The stream's stop flag itself, for work that outlives this call or runs on other
    /// threads (a read ahead, store requests to cut).
    pub(crate) fn stop_flag(&self) -> &Arc<AtomicBool> {
        self.stop
    }
}

// Used by the flat-tokens loader only (behind the `zarr` feature).
#[cfg(feature = "zarr")]
pub(crate) use crate::io::stop::{stopped_error, STOP_POLL};

/// How a stream runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamOptions {
    /// Batches prepared ahead of the gather (at least 1).
    pub ahead: usize,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions { ahead: 2 }
    }
}

/// The gather threads of a loader (default: one per core). Kept across epochs.
pub(crate) struct GatherPool {
    pool: rayon::ThreadPool,
}

impl std::fmt::Debug for GatherPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GatherPool({} threads)", self.pool.current_num_threads())
    }
}

pub(crate) use crate::config::available_cores;

impl GatherPool {
    /// A pool of `threads` gather threads (0: one per core).
    pub(crate) fn new(threads: usize) -> Result<GatherPool> {
        let threads = if threads == 0 {
            available_cores()
        } else {
            threads
        };
        if fault::spawn_fails() {
            return Err(Error::Thread {
                what: "the gather threads".into(),
                source: std::io::Error::other("injected spawn failure"),
            });
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("shardkit-gather-{i}"))
            .build()
            .map_err(|e| Error::Thread {
                what: format!("{threads} gather threads"),
                source: std::io::Error::other(e),
            })?;
        Ok(GatherPool { pool })
    }
    /// The underlying pool.
    pub(crate) fn pool(&self) -> &rayon::ThreadPool {
        &self.pool
    }
}

/// A loader's gather pool, started on first use and kept across epochs; a forked child (which
/// has none of the parent's threads) starts its own.
#[derive(Debug, Default)]
pub(crate) struct GatherCell {
    pool: std::sync::Mutex<Option<(u32, Arc<GatherPool>)>>,
}

impl GatherCell {
    /// The pool of this process, started with `threads` threads (0: one per core) if needed.
    pub(crate) fn get(&self, threads: usize) -> Result<Arc<GatherPool>> {
        let pid = std::process::id();
        let mut g = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        match g.take() {
            Some((owner, p)) if owner == pid => {
                *g = Some((owner, p.clone()));
                return Ok(p);
            }
            // The parent's pool: its threads do not exist here, and tearing it down would wait
            // for them, so it is left alone.
            Some((_, p)) => std::mem::forget(p),
            None => {}
        }
        let p = Arc::new(GatherPool::new(threads)?);
        *g = Some((pid, p.clone()));
        Ok(p)
    }
}

/// What travels between the stages.
enum Msg<T> {
    Batch(Result<T>),
    End,
}

/// A running pipeline; iterate it for the items in planned order.
pub(crate) struct Stream<T> {
    lanes: Vec<Receiver<Msg<T>>>,
    next: usize,
    /// Set when the stream has ended (end mark or error): `next` returns None from then on.
    done: bool,
    /// An error to report before anything else (a thread could not be started).
    pending: Option<Error>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pid: u32,
}

impl<T> std::fmt::Debug for Stream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("lanes", &self.lanes.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

pub(crate) use crate::error::panic_message;

fn panicked(stage: &str, p: Box<dyn std::any::Any + Send>) -> Error {
    Error::Internal(format!(
        "a loader thread panicked while {stage} a batch: {}",
        panic_message(&*p)
    ))
}

/// Runs `f`, turning a panic into an error naming `stage`.
fn guarded<R>(stage: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panicked(stage, p)))
}

/// Splits `buf` into the regions of each piece (all checked: disjoint and inside `buf`).
fn carve<'a>(buf: &'a mut [u8], pieces: &[Vec<Range<usize>>]) -> Result<Vec<Vec<&'a mut [u8]>>> {
    let mut all: Vec<(usize, usize, Range<usize>)> = pieces
        .iter()
        .enumerate()
        .flat_map(|(p, rs)| rs.iter().enumerate().map(move |(k, r)| (p, k, r.clone())))
        .collect();
    all.sort_unstable_by_key(|(_, _, r)| (r.start, r.end));
    let mut out: Vec<Vec<Option<&'a mut [u8]>>> = pieces
        .iter()
        .map(|rs| (0..rs.len()).map(|_| None).collect())
        .collect();
    let total = buf.len();
    let mut rest = buf;
    let mut at = 0usize;
    for (p, k, r) in all {
        if r.start < at || r.end < r.start || r.end > total {
            return Err(Error::Invalid(format!(
                "batch region {r:?} overlaps another or lies outside the {total}-byte buffer"
            )));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (piece, tail) = tail.split_at_mut(r.end - r.start);
        out[p][k] = Some(piece);
        rest = tail;
        at = r.end;
    }
    Ok(out
        .into_iter()
        .map(|rs| rs.into_iter().map(|r| r.unwrap_or_default()).collect())
        .collect())
}

/// Fills every piece of `batch` on `pool` and finishes it.
fn gather<J: Job>(
    job: &J,
    mut batch: Prepared<J::State>,
    pool: &rayon::ThreadPool,
) -> Result<J::Item> {
    if !batch.regions.is_empty() {
        let regions = std::mem::take(&mut batch.regions);
        let state = &batch.state;
        let pieces = carve(batch.buf.as_mut_bytes(), &regions)?;
        pool.install(|| {
            pieces
                .into_par_iter()
                .enumerate()
                .try_for_each(|(i, mut out)| {
                    fault::before_fill()?;
                    job.fill(state, i, &mut out)
                })
        })?;
        batch.regions = regions;
    }
    job.finish(batch, pool)
}

/// Prepares, fills and finishes one batch on the calling thread and `pool` (random access:
/// the same work a stream does, without the pipeline).
pub(crate) fn run_one<J: Job>(job: &J, plan: J::Plan, pool: &GatherPool) -> Result<J::Item> {
    let never_stopped = Arc::new(AtomicBool::new(false));
    let cx = Context {
        stop: &never_stopped,
    };
    guarded("preparing", || job.prepare(plan, &cx))
        .and_then(|b| guarded("gathering", || gather(job, b, &pool.pool)))
}

const LANES: usize = 2;

/// Starts the pipeline over `plans` (in order; may be endless).
pub(crate) fn start<J, P>(
    job: Arc<J>,
    plans: P,
    pool: Arc<GatherPool>,
    opts: StreamOptions,
) -> Stream<J::Item>
where
    J: Job,
    P: Iterator<Item = J::Plan> + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let mut stream = Stream {
        lanes: Vec::new(),
        next: 0,
        done: false,
        pending: None,
        stop: stop.clone(),
        threads: Vec::new(),
        pid: std::process::id(),
    };
    let per_lane = opts.ahead.max(1).div_ceil(LANES);
    let mut to_lanes = Vec::new();
    for lane in 0..LANES {
        let (tx, rx) = sync_channel::<Msg<Prepared<J::State>>>(per_lane);
        let (out_tx, out_rx) = sync_channel::<Msg<J::Item>>(1);
        to_lanes.push(tx);
        stream.lanes.push(out_rx);
        let (job, pool) = (job.clone(), pool.clone());
        match spawn(&format!("shardkit-lane-{lane}"), move || {
            lane_loop(&*job, &pool.pool, rx, out_tx)
        }) {
            Ok(t) => stream.threads.push(t),
            Err(e) => {
                stream.pending = Some(e);
                return stream;
            }
        }
    }
    let stop2 = stop.clone();
    match spawn("shardkit-prefetch", move || {
        prefetch_loop(&*job, plans, to_lanes, &stop2)
    }) {
        Ok(t) => stream.threads.push(t),
        Err(e) => stream.pending = Some(e),
    }
    stream
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    if fault::spawn_fails() {
        return Err(Error::Thread {
            what: format!("the loader thread {name}"),
            source: std::io::Error::other("injected spawn failure"),
        });
    }
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|source| Error::Thread {
            what: format!("the loader thread {name}"),
            source,
        })
}

/// Prepares each planned batch in order and hands it to the lanes alternately; after the last,
/// the end mark goes to the lane whose turn is next (so the consumer meets it in order).
fn prefetch_loop<J: Job, P: Iterator<Item = J::Plan>>(
    job: &J,
    plans: P,
    lanes: Vec<SyncSender<Msg<Prepared<J::State>>>>,
    stop: &Arc<AtomicBool>,
) {
    let mut turn = 0usize;
    let mut plans = plans;
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        // The plan iterator is the job's code too: a panic there is a fault like any other.
        let plan = match catch_unwind(AssertUnwindSafe(|| plans.next())) {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(p) => {
                let _ = lanes[turn].send(Msg::Batch(Err(panicked("planning", p))));
                return;
            }
        };
        let prepared = guarded("preparing", || {
            fault::before_prepare()?;
            // The preparation's reads give up once the stream stops: it passes
            // `Context::stop_flag` to each.
            job.prepare(plan, &Context { stop })
        });
        let failed = prepared.is_err();
        if lanes[turn].send(Msg::Batch(prepared)).is_err() || failed {
            return;
        }
        turn = (turn + 1) % lanes.len();
    }
    let _ = lanes[turn].send(Msg::End);
}

fn lane_loop<J: Job>(
    job: &J,
    pool: &rayon::ThreadPool,
    rx: Receiver<Msg<Prepared<J::State>>>,
    tx: SyncSender<Msg<J::Item>>,
) {
    for msg in rx {
        let out = match msg {
            Msg::End => Msg::End,
            Msg::Batch(Err(e)) => Msg::Batch(Err(e)),
            Msg::Batch(Ok(b)) => Msg::Batch(guarded("gathering", || gather(job, b, pool))),
        };
        let last = !matches!(out, Msg::Batch(Ok(_)));
        if tx.send(out).is_err() || last {
            return;
        }
    }
}

impl<T> Stream<T> {
    /// A stream that ends at once (a follow-mode pass before its first round).
    pub(crate) fn empty() -> Stream<T> {
        let mut s = Stream::failed(Error::Internal(String::new()));
        s.pending = None;
        s.done = true;
        s
    }

    /// A stream that reports `e` at its first `next` (a loader that could not start).
    pub(crate) fn failed(e: Error) -> Stream<T> {
        Stream {
            lanes: Vec::new(),
            next: 0,
            done: false,
            pending: Some(e),
            stop: Arc::new(AtomicBool::new(true)),
            threads: Vec::new(),
            pid: std::process::id(),
        }
    }
}

impl<T> Iterator for Stream<T> {
    type Item = Result<T>;
    fn next(&mut self) -> Option<Result<T>> {
        if let Some(e) = self.pending.take() {
            self.done = true;
            return Some(Err(e));
        }
        if self.done || self.lanes.is_empty() {
            return None;
        }
        if std::process::id() != self.pid {
            self.done = true;
            return Some(Err(Error::Invalid(
                "this loader's iteration was started before fork(); its threads live in the \
                 parent process: start a new iteration in the child"
                    .into(),
            )));
        }
        let lane = self.next % self.lanes.len();
        self.next += 1;
        match self.lanes[lane].recv() {
            Ok(Msg::Batch(Ok(item))) => Some(Ok(item)),
            Ok(Msg::Batch(Err(e))) => {
                self.done = true;
                Some(Err(e))
            }
            Ok(Msg::End) => {
                self.done = true;
                None
            }
            Err(_) => {
                self.done = true;
                Some(Err(Error::Internal(
                    "a loader thread stopped before the end of the epoch without reporting \
                     why; the epoch is incomplete"
                        .into(),
                )))
            }
        }
    }
}

impl<T> Drop for Stream<T> {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: the threads exist only in the parent, and a lock inside a channel
            // may have been held by one of them at fork() time: nothing is touched.
            std::mem::forget(std::mem::take(&mut self.lanes));
            self.threads.drain(..).for_each(std::mem::forget);
            return;
        }
        self.stop.store(true, Ordering::Relaxed);
        self.lanes.clear(); // unblocks stages waiting to send
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches of `n` bytes, byte k of batch b = (b + k) % 251, filled in pieces of 7 bytes.
    struct Counting {
        pool: BufferPool,
        n: usize,
        panic_at: Option<u64>,
    }

    impl Job for Counting {
        type Plan = u64;
        type State = u64;
        type Item = (u64, Vec<u8>);
        fn prepare(&self, b: u64, cx: &Context<'_>) -> Result<Prepared<u64>> {
            if Some(b) == self.panic_at {
                panic!("batch {b} cannot be prepared");
            }
            let regions = even_pieces(self.n, 7);
            Ok(Prepared {
                buf: cx.buffer(&self.pool, self.n)?,
                regions,
                state: b,
            })
        }
        fn fill(&self, b: &u64, piece: usize, out: &mut [&mut [u8]]) -> Result<()> {
            for (k, x) in out[0].iter_mut().enumerate() {
                *x = ((*b as usize + piece * 7 + k) % 251) as u8;
            }
            Ok(())
        }
        fn finish(&self, p: Prepared<u64>, _: &rayon::ThreadPool) -> Result<(u64, Vec<u8>)> {
            Ok((p.state, p.buf.as_bytes().to_vec()))
        }
    }

    #[test]
    fn batches_come_in_order_whatever_the_threads() {
        for threads in [1, 2, 5] {
            let pool = Arc::new(GatherPool::new(threads).unwrap());
            let job = Arc::new(Counting {
                pool: BufferPool::new(8),
                n: 100,
                panic_at: None,
            });
            let items: Vec<_> = start(job, 0..50u64, pool, StreamOptions { ahead: 3 })
                .collect::<Result<_>>()
                .unwrap();
            assert_eq!(items.len(), 50);
            for (i, (b, bytes)) in items.iter().enumerate() {
                assert_eq!(*b, i as u64);
                assert!(bytes
                    .iter()
                    .enumerate()
                    .all(|(k, &x)| x == ((i + k) % 251) as u8));
            }
        }
    }

    #[test]
    fn a_panic_is_an_error_not_a_short_epoch() {
        let pool = Arc::new(GatherPool::new(2).unwrap());
        let job = Arc::new(Counting {
            pool: BufferPool::new(8),
            n: 10,
            panic_at: Some(7),
        });
        let mut s = start(job, 0..20u64, pool, StreamOptions::default());
        for _ in 0..7 {
            s.next().unwrap().unwrap();
        }
        let e = s.next().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("panicked") && e.contains("batch 7 cannot be prepared"),
            "{e}"
        );
        assert!(s.next().is_none());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init, clippy::reversed_empty_ranges)]
    fn regions_must_be_disjoint_and_inside() {
        let mut buf = vec![0u8; 10];
        let one = |rs: &[Range<usize>]| {
            rs.iter()
                .map(|r| std::iter::once(r.clone()).collect())
                .collect::<Vec<Vec<_>>>()
        };
        assert!(carve(&mut buf, &one(&[0..3, 3..10])).is_ok());
        let refused = |buf: &mut [u8], pieces: &[Vec<Range<usize>>], r: &str| {
            let err = carve(buf, pieces).expect_err(r);
            let want =
                format!("batch region {r} overlaps another or lies outside the 10-byte buffer");
            assert!(matches!(&err, Error::Invalid(m) if *m == want), "{err:?}");
        };
        refused(&mut buf, &one(&[0..3, 2..4]), "2..4");
        refused(&mut buf, &one(&[5..11]), "5..11");
        refused(&mut buf, &one(&[4..3]), "4..3");
        assert!(carve(&mut buf, &[vec![3..4, 0..2], vec![2..3]]).is_ok());
        refused(&mut buf, &[vec![3..4, 0..2], vec![1..3]], "1..3");
        let mut parts = carve(&mut buf, &[vec![9..10, 1..2], vec![4..4]]).unwrap();
        parts[0][0][0] = 9;
        parts[0][1][0] = 1;
        assert_eq!(parts[1][0].len(), 0);
        assert_eq!(buf, [0, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
    }
}
