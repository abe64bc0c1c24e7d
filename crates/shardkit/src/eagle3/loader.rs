//! Batches of a cache on the read engine: which samples a rank reads is decided before any I/O
//! (DistributedSampler's semantics over a seeded, per-epoch shuffle), and each batch's rows are
//! read straight from the shard files into one buffer with many reads in flight, a few batches
//! ahead of the caller.
//!
//! A sample is one row of each tensor of its shard (six byte ranges, seven for top-k); a batch
//! holds every field stacked on a new dim 0, as NeMo's collate produces them, with top-k caches
//! expanded to the full-width `target_probs`.

use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use safetensors::Dtype;

use super::cache::{scatter, Cache, ITEM_FIELDS};
use super::shard::shard_name;
use crate::engine::batch::{Buffer, BufferPool};
use crate::engine::order::{derive_key, shuffled};
use crate::engine::reader::{plan_reads, read_all, Files, ReadRange};
use crate::error::{Error, Result};

/// Options of [`Loader::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderOptions {
    /// Samples per batch on this rank.
    pub batch_size: u64,
    /// A new seeded order every epoch (false: index order).
    pub shuffle: bool,
    /// Seed of the shuffle.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// This rank (default `$RANK`, else 0).
    pub rank: Option<u64>,
    /// Number of ranks (default `$WORLD_SIZE`, else 1).
    pub world_size: Option<u64>,
    /// Drop the uneven tail: each rank gets `floor(N/W)` samples and only full batches.
    /// Otherwise each rank gets `ceil(N/W)` (padded by wrapping around to the start of the
    /// order, as DistributedSampler does) and the last batch may be short.
    pub drop_last: bool,
    /// Reads in flight per batch.
    pub io_threads: usize,
    /// Batches prepared ahead of the caller.
    pub prefetch: usize,
}

impl LoaderOptions {
    /// Shuffled batches of `batch_size`, seed 0, epoch 0, ranks from the environment.
    pub fn new(batch_size: u64) -> LoaderOptions {
        LoaderOptions {
            batch_size,
            shuffle: true,
            seed: 0,
            epoch: 0,
            rank: None,
            world_size: None,
            drop_last: false,
            io_threads: 16,
            prefetch: 2,
        }
    }
}

/// What resumes a loader: the order's inputs and the next batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderState {
    /// Seed.
    pub seed: u64,
    /// Epoch.
    pub epoch: u64,
    /// Batches of this epoch already consumed on this rank.
    pub batch: u64,
    /// Samples per batch (a state only resumes the same batching).
    pub batch_size: u64,
    /// Number of ranks.
    pub world_size: u64,
}

/// Where one field of a batch lies in the batch's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchField {
    /// The field name.
    pub name: &'static str,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape, `[batch, ...]`.
    pub shape: Vec<usize>,
    /// Byte offset in the buffer.
    pub offset: usize,
}

impl BatchField {
    /// Bytes of the field.
    pub fn len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
    /// Whether the field has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One batch: every field stacked on dim 0, in one page-aligned buffer.
pub struct Batch {
    /// The sample index of each row.
    pub indices: Vec<u64>,
    data: Buffer,
    layout: Vec<BatchField>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("indices", &self.indices)
            .finish()
    }
}

impl Batch {
    /// The fields in [`ITEM_FIELDS`] order, with their bytes.
    pub fn fields(&self) -> impl Iterator<Item = (&BatchField, &[u8])> {
        self.layout
            .iter()
            .map(|f| (f, &self.data.as_bytes()[f.offset..f.offset + f.len()]))
    }
    /// One field by name.
    pub fn field(&self, name: &str) -> Option<(&BatchField, &[u8])> {
        self.fields().find(|(f, _)| f.name == name)
    }
    /// Total bytes of the batch's fields.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
    /// The buffer and field layout (for zero-copy hand-off).
    pub fn into_parts(self) -> (Buffer, Vec<BatchField>) {
        (self.data, self.layout)
    }
}

/// The shard files, opened on first read.
struct ShardFiles {
    dir: PathBuf,
    files: Vec<OnceLock<Option<File>>>,
}

impl Files for ShardFiles {
    fn file(&self, i: u32) -> Result<&File> {
        let path = self.path(i);
        self.files[i as usize]
            .get_or_init(|| File::open(&path).ok())
            .as_ref()
            .ok_or_else(|| Error::NotFound {
                path,
                what: "the shard disappeared while the cache was being read".into(),
            })
    }
    fn path(&self, i: u32) -> PathBuf {
        self.dir.join(shard_name(u64::from(i)))
    }
}

struct Inner {
    cache: Arc<Cache>,
    files: ShardFiles,
    /// Batch buffers are recycled: a fresh multi-megabyte allocation per batch costs more in
    /// page faults than the reads themselves.
    pool: BufferPool,
}

/// Shuffled or sequential batches of a cache for one rank.
pub struct Loader {
    inner: Arc<Inner>,
    opts: LoaderOptions,
    rank: u64,
    world: u64,
    /// Batches of the current epoch already handed out (by `iter` or `load_state`).
    cursor: u64,
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

impl Loader {
    /// A loader over `cache`.
    pub fn new(cache: Arc<Cache>, opts: LoaderOptions) -> Result<Loader> {
        let world = opts
            .world_size
            .or_else(|| env_u64("WORLD_SIZE"))
            .unwrap_or(1);
        let rank = opts.rank.or_else(|| env_u64("RANK")).unwrap_or(0);
        if opts.batch_size == 0 || world == 0 || rank >= world {
            return Err(Error::Invalid(format!(
                "need batch_size >= 1 and rank < world_size (got batch_size {}, rank {rank}, \
                 world_size {world})",
                opts.batch_size
            )));
        }
        if cache.len() >= 1 << 32 {
            return Err(Error::Invalid(format!(
                "{} samples: at most 2^32 - 1 can be shuffled",
                cache.len()
            )));
        }
        let k = cache.manifest().num_shards() as usize;
        crate::fsutil::raise_open_file_limit();
        let files = ShardFiles {
            dir: cache.dir().to_path_buf(),
            files: (0..k).map(|_| OnceLock::new()).collect(),
        };
        Ok(Loader {
            inner: Arc::new(Inner {
                cache,
                files,
                pool: BufferPool::new(opts.prefetch + 6),
            }),
            opts,
            rank,
            world,
            cursor: 0,
        })
    }

    /// (rank, world_size).
    pub fn rank_and_world(&self) -> (u64, u64) {
        (self.rank, self.world)
    }
    /// The options.
    pub fn options(&self) -> &LoaderOptions {
        &self.opts
    }
    /// The cache.
    pub fn cache(&self) -> &Arc<Cache> {
        &self.inner.cache
    }

    /// The sample indices this rank reads in the current epoch, in order.
    pub fn indices(&self) -> Vec<u64> {
        let n = self.inner.cache.len();
        let order: Vec<u64> = if self.opts.shuffle {
            let key = derive_key(self.opts.seed, self.opts.epoch, 0xea61e3);
            shuffled(n as usize, key)
                .into_iter()
                .map(u64::from)
                .collect()
        } else {
            (0..n).collect()
        };
        let w = self.world;
        let total = if self.opts.drop_last {
            (n / w) * w
        } else {
            n.div_ceil(w) * w
        };
        let mut padded = order;
        padded.truncate(total as usize);
        if !padded.is_empty() {
            // DistributedSampler: wrap around to the start (repeatedly if N < the padding).
            let mut i = 0;
            while (padded.len() as u64) < total {
                padded.push(padded[i]);
                i += 1;
            }
        }
        padded
            .into_iter()
            .skip(self.rank as usize)
            .step_by(w as usize)
            .collect()
    }

    /// Batches per epoch on this rank.
    pub fn len(&self) -> u64 {
        let per_rank = self.indices_len();
        if self.opts.drop_last {
            per_rank / self.opts.batch_size
        } else {
            per_rank.div_ceil(self.opts.batch_size)
        }
    }
    /// Whether an epoch has no batches.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn indices_len(&self) -> u64 {
        let (n, w) = (self.inner.cache.len(), self.world);
        if self.opts.drop_last {
            n / w
        } else {
            n.div_ceil(w)
        }
    }

    /// Switches to `epoch` (a different order when shuffling) from its start.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.opts.epoch = epoch;
        self.cursor = 0;
    }

    /// The position to save with a checkpoint.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            seed: self.opts.seed,
            epoch: self.opts.epoch,
            batch: self.cursor,
            batch_size: self.opts.batch_size,
            world_size: self.world,
        }
    }

    /// Continues from a saved position (same batch size and world size).
    pub fn load_state(&mut self, s: LoaderState) -> Result<()> {
        if s.batch_size != self.opts.batch_size || s.world_size != self.world {
            return Err(Error::Invalid(format!(
                "the state was saved with batch_size {} and world_size {}; this loader has {} \
                 and {}",
                s.batch_size, s.world_size, self.opts.batch_size, self.world
            )));
        }
        if s.batch > self.len() {
            return Err(Error::Invalid(format!(
                "the state's batch {} is past the epoch's {} batches",
                s.batch,
                self.len()
            )));
        }
        self.opts.seed = s.seed;
        self.opts.epoch = s.epoch;
        self.cursor = s.batch;
        Ok(())
    }

    /// The batches left in the epoch from the loader's position, read ahead in background
    /// threads. The position does not move by itself: record progress with
    /// [`Loader::advance_to`]`(batches.cursor())` so `state()` saves it.
    pub fn iter(&self) -> Batches {
        let indices = self.indices();
        let bs = self.opts.batch_size as usize;
        let mut batches: Vec<Vec<u64>> = indices.chunks(bs).map(<[u64]>::to_vec).collect();
        if self.opts.drop_last && batches.last().is_some_and(|b| b.len() < bs) {
            batches.pop();
        }
        let start = (self.cursor as usize).min(batches.len());
        let batches: Vec<Vec<u64>> = batches.split_off(start);
        Batches::start(
            self.inner.clone(),
            batches,
            self.opts.io_threads,
            self.opts.prefetch,
            self.cursor,
        )
    }

    /// Sets the position to batch `batch` of the epoch (see [`Batches::cursor`]).
    pub fn advance_to(&mut self, batch: u64) {
        self.cursor = batch.min(self.len());
    }

    /// Reads the samples `indices` as one batch, now.
    pub fn read(&self, indices: &[u64]) -> Result<Batch> {
        read_batch(&self.inner, indices, self.opts.io_threads)
    }
}

/// Reads `indices` into one batch buffer: every stored row straight from its shard file,
/// merged and split into large reads, `threads` at a time; top-k rows are expanded.
fn read_batch(inner: &Inner, indices: &[u64], threads: usize) -> Result<Batch> {
    let cache = &inner.cache;
    let m = cache.manifest();
    let specs = cache.specs();
    let b = indices.len();
    let s = m.shard_size;
    // Output fields, then (top-k) the stored values and indices to scatter from.
    let mut layout = Vec::new();
    let mut off = 0usize;
    let align = |x: usize| x.next_multiple_of(64);
    for name in ITEM_FIELDS {
        let (dtype, row) = if name == "target_probs" {
            (
                m.dtype.safetensors(),
                vec![m.seq_length as usize, m.draft_vocab_size as usize],
            )
        } else {
            let spec = specs.iter().find(|x| x.name == name).expect("spec");
            (spec.dtype, spec.row.clone())
        };
        let mut shape = vec![b];
        shape.extend(row);
        let field = BatchField {
            name,
            dtype,
            shape,
            offset: off,
        };
        off = align(off + field.len());
        layout.push(field);
    }
    let mut staging = Vec::new();
    if m.topk.is_some() {
        for name in ["target_probs_values", "target_probs_indices"] {
            let spec = specs.iter().find(|x| x.name == name).expect("spec");
            staging.push((name, spec.row_bytes(), off));
            off = align(off + spec.row_bytes() * b);
        }
    }
    let mut ranges = Vec::with_capacity(b * specs.len());
    for (j, &i) in indices.iter().enumerate() {
        let k = i / s;
        let shard = cache.shard(k)?;
        let row = i % s;
        for (f, spec) in specs.iter().enumerate() {
            let rb = spec.row_bytes();
            let dst = match layout.iter().find(|l| l.name == spec.name) {
                Some(l) => l.offset + j * rb,
                None => {
                    let st = staging
                        .iter()
                        .find(|x| x.0 == spec.name)
                        .expect("staged field");
                    st.2 + j * rb
                }
            };
            ranges.push(ReadRange {
                file: k as u32,
                offset: shard.row_offset(f, row, rb),
                len: rb as u64,
                dst: dst as u64,
            });
        }
    }
    // Allocated only now: every shard of the batch has been opened, and so checked against
    // the manifest, so sizes claimed by a damaged manifest are never allocated.
    // Every output byte is overwritten by a read, except a top-k `target_probs` (zeroed below).
    let mut data = inner.pool.get(off);
    read_all(
        &inner.files,
        &plan_reads(ranges),
        data.as_mut_bytes(),
        threads,
        false,
    )?;
    if m.topk.is_some() {
        let elem = m.dtype.size();
        let vd = m.draft_vocab_size as usize;
        let probs = layout
            .iter()
            .find(|l| l.name == "target_probs")
            .expect("probs");
        let out_off = probs.offset;
        let row_out = cache.full_probs_bytes();
        let (vals, idx) = (staging[0], staging[1]);
        let bytes = data.as_mut_bytes();
        bytes[out_off..out_off + b * row_out].fill(0);
        for j in 0..b {
            let (head, tail) = bytes.split_at_mut(vals.2);
            let v = &tail[j * vals.1..(j + 1) * vals.1];
            let ix_start = idx.2 - vals.2;
            let ix = &tail[ix_start + j * idx.1..ix_start + (j + 1) * idx.1];
            let out = &mut head[out_off + j * row_out..out_off + (j + 1) * row_out];
            let path = inner.files.path((indices[j] / s) as u32);
            scatter(v, ix, out, elem, vd, &path)?;
        }
    }
    Ok(Batch {
        indices: indices.to_vec(),
        data,
        layout,
    })
}

/// Batches being read ahead; dropping it stops and joins the readers.
pub struct Batches {
    rx: Vec<Receiver<Result<Batch>>>,
    next: usize,
    threads: Vec<JoinHandle<()>>,
    start: u64,
    pid: u32,
}

impl Batches {
    fn start(
        inner: Arc<Inner>,
        batches: Vec<Vec<u64>>,
        io_threads: usize,
        prefetch: usize,
        start: u64,
    ) -> Batches {
        // Two producers on alternating batches keep reads in flight while one batch completes
        // and is handed over.
        const PRODUCERS: usize = 2;
        let mut rx = Vec::new();
        let mut threads = Vec::new();
        let batches = Arc::new(batches);
        for p in 0..PRODUCERS {
            let (tx, r) = sync_channel(prefetch.div_ceil(PRODUCERS).max(1));
            rx.push(r);
            let (inner, batches) = (inner.clone(), batches.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("shardkit-eagle3-{p}"))
                .spawn(move || {
                    for b in batches.iter().skip(p).step_by(PRODUCERS) {
                        let r = read_batch(&inner, b, io_threads);
                        let failed = r.is_err();
                        if tx.send(r).is_err() || failed {
                            return;
                        }
                    }
                });
            match spawned {
                Ok(t) => threads.push(t),
                Err(_) => {
                    rx.clear();
                    break;
                }
            }
        }
        Batches {
            rx,
            next: 0,
            threads,
            start,
            pid: std::process::id(),
        }
    }

    /// The epoch's batch index the next batch will have (resume a loader there with
    /// [`Loader::advance_to`]).
    pub fn cursor(&self) -> u64 {
        self.start + self.next as u64
    }
}

impl Iterator for Batches {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        if self.rx.is_empty() {
            return None;
        }
        if std::process::id() != self.pid {
            return Some(Err(Error::Invalid(
                "these batches were started before fork(); start a new iteration in the child"
                    .into(),
            )));
        }
        let r = self.rx[self.next % self.rx.len()].recv().ok();
        match &r {
            Some(Ok(_)) => self.next += 1,
            _ => self.rx.clear(),
        }
        r
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        self.rx.clear();
        if std::process::id() != self.pid {
            self.threads.drain(..).for_each(std::mem::forget);
            return;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
