//! Batches of a cache on the read engine: which samples a rank reads is decided before any I/O
//! (DistributedSampler's semantics over a seeded, per-epoch shuffle); the engine prepares a few
//! batches ahead (laying them out, planning their reads), and its reader threads read each row
//! straight from its shard file into the batch buffer (one copy, from the page cache when the
//! data are there).
//!
//! A sample is one row of each tensor of its shard (six byte ranges, seven for top-k); a batch
//! holds every field stacked on a new dim 0, as NeMo's collate produces them, with top-k caches
//! expanded to the full-width `target_probs`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use super::cache::{scatter, Cache};
use super::follow::Follow;
use super::shard::shard_name;
use crate::checksum::{self, Verifier};
use crate::engine::exec::{self, Context, GatherCell, GatherPool, Job, Prepared, StreamOptions};
use crate::engine::follow::FollowOptions;
use crate::engine::order::{derive_key, shuffled};
use crate::engine::{LoaderState, StateValue};
use crate::error::{Error, Result};
use crate::io::buffer::{self, Buffer, BufferPool};
use crate::io::local::{self, plan_reads, Files, ReadRange};
use crate::io::{PendingRead, Stop};

/// EAGLE-3's own loader knobs (fields of [`LoaderOptions`] through `Deref`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eagle3Options {
    /// Batches prepared ahead of the caller. From an object store, at least as many as keep
    /// `SHARDKIT_S3_INFLIGHT` × the request size of GETs in flight (at most 256).
    pub prefetch: usize,
    /// Read the cache while it is written in parts (follow mode, with [`Loader::open`]):
    /// `None` (the default) reads a committed cache only. See docs/eagle3.md "Reading while
    /// it is written".
    pub follow: Option<FollowOptions>,
}

/// Options of [`Loader::new`]: the common knobs and [`Eagle3Options`]. `batch_size` is
/// samples per batch on this rank; any shuffled `order` is a new seeded permutation of the
/// samples every epoch (`Sequential`: index order). `drop_last` drops the uneven tail: each
/// rank gets `floor(N/W)` samples and only full batches; otherwise each rank gets `ceil(N/W)`
/// (padded by wrapping around to the start of the order, as DistributedSampler does) and the
/// last batch may be short. `threads` 0 is one per core and at least 16: a row read blocks on
/// the disk when the cache is cold, so more reads than cores stay in flight. `verify` checks
/// every block of the shard bytes a pass reads against the cache's checksums sidecar, once
/// per pass.
pub type LoaderOptions = crate::engine::LoaderOptions<Eagle3Options>;

impl crate::engine::LoaderOptions<Eagle3Options> {
    /// Batches of `batch_size` in the default (shuffled) order, seed 0, epoch 0, ranks from
    /// the environment, 2 batches prepared ahead.
    pub fn new(batch_size: u64) -> LoaderOptions {
        LoaderOptions::with_format(
            batch_size,
            Eagle3Options {
                prefetch: 2,
                follow: None,
            },
        )
    }
}

/// Where one field of a batch lies in the batch's buffer (the engine's [`Field`](crate::engine::Field)).
pub use crate::io::buffer::Field as BatchField;

/// One batch: every field stacked on dim 0, in one page-aligned buffer. The bytes of field
/// `f` (in `layout`, in NeMo's collate order: input_ids, attention_mask, loss_mask,
/// aux_hidden_states, position_mask, target_probs) are `data.field(f)`.
#[non_exhaustive]
pub struct Batch {
    /// The sample index of each row.
    pub indices: Vec<u64>,
    /// The buffer holding every field.
    pub data: Buffer,
    /// Where each field lies in `data`: name, dtype, shape (`[rows, ...]`), offset.
    pub layout: Vec<BatchField>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("indices", &self.indices)
            .finish()
    }
}

/// The shard files, opened on first read, and mapped on first use from the page cache (kept
/// for the loader's life, like saev's shards).
struct ShardFiles {
    dir: PathBuf,
    files: Vec<OnceLock<Option<File>>>,
    maps: Vec<OnceLock<Option<Arc<memmap2::Mmap>>>>,
}

impl ShardFiles {
    /// Shard `i` mapped whole, when it is at least `needed` bytes long (None when it cannot be
    /// mapped: the caller reads instead, and any error shows there).
    fn map(&self, i: u32, needed: u64) -> Option<Arc<memmap2::Mmap>> {
        let map = self.maps[i as usize].get_or_init(|| {
            let f = self.file(i).ok()?;
            let len = f.metadata().ok()?.len();
            local::map_file(f, &self.path(i), len).ok().map(Arc::new)
        });
        map.clone().filter(|m| m.len() as u64 >= needed)
    }
}

impl Files for ShardFiles {
    fn file(&self, i: u32) -> Result<&File> {
        let path = self.path(i);
        self.files[i as usize]
            .get_or_init(|| crate::fsutil::open_regular(&path).ok())
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
    pool: Mutex<BufferPool>,
    /// With `verify`: the shards' checksums and which blocks this pass has checked.
    verifier: Option<Verifier>,
    /// The shards' names (objects, for a cache in an object store).
    names: Arc<Vec<String>>,
}

/// Reader threads at least (see [`LoaderOptions::threads`]).
const IO_THREADS: usize = 16;

/// Shuffled or sequential batches of a cache for one rank.
pub struct Loader {
    inner: Arc<Inner>,
    opts: LoaderOptions,
    rank: u64,
    world: u64,
    /// Batches of the current epoch already handed out (by `iter` or `load_state`).
    cursor: u64,
    /// Started on the first pass and kept (a failure to start is reported by that pass).
    gather: GatherCell,
    /// A state was loaded and no pass has started since: `set_epoch` of the state's epoch keeps
    /// the position.
    resumed: AtomicBool,
    /// Follow mode's rounds (see eagle3/follow.rs).
    pub(super) follow: Option<Follow>,
}

impl Loader {
    /// A loader over the cache at `dir` (a path or an `s3://` URL); with `opts.follow`, one
    /// that reads a local cache while it is written in parts (see [`Eagle3Options::follow`]).
    pub fn open(dir: impl AsRef<Path>, opts: LoaderOptions) -> Result<Loader> {
        super::follow::open(dir.as_ref(), opts)
    }

    /// A loader over `cache`.
    pub fn new(cache: Arc<Cache>, mut opts: LoaderOptions) -> Result<Loader> {
        let (rank, world) = opts.rank_and_world()?;
        (opts.rank, opts.world_size) = (Some(rank), Some(world));
        if opts.batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
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
            maps: (0..k).map(|_| OnceLock::new()).collect(),
        };
        if opts.verify && cache.remote().is_some() {
            return Err(crate::io::verify_needs_local(cache.dir()));
        }
        let names: Arc<Vec<String>> = Arc::new((0..k as u64).map(shard_name).collect());
        let verifier = if opts.verify {
            let dir = cache.dir();
            Some(Verifier::open(&dir.join(checksum::SIDECAR), dir, &names)?)
        } else {
            None
        };
        let pool_size = depth(&cache, &opts) + 8;
        Ok(Loader {
            inner: Arc::new(Inner {
                cache,
                files,
                pool: Mutex::new(BufferPool::new(pool_size)),
                verifier,
                names,
            }),
            opts,
            rank,
            world,
            cursor: 0,
            gather: GatherCell::default(),
            resumed: AtomicBool::new(false),
            follow: None,
        })
    }

    /// The options, `rank` and `world_size` resolved (`epoch` is the current epoch).
    pub fn options(&self) -> &LoaderOptions {
        &self.opts
    }

    /// The gather pool, started on first use.
    fn gather_pool(&self) -> Result<Arc<GatherPool>> {
        // Each piece is a read that blocks on the disk when the data are not cached: more
        // threads than cores keep enough reads in flight.
        let threads = match self.opts.threads {
            0 => exec::available_cores().max(IO_THREADS),
            n => n,
        };
        self.gather.get(threads)
    }

    /// The epoch's planned order of every sample, before it is split over the ranks.
    fn epoch_order(&self) -> Vec<u64> {
        let n = self.inner.cache.len();
        if self.opts.shuffled() {
            let key = derive_key(self.opts.seed, self.opts.epoch, 0xea61e3);
            shuffled(n as usize, key)
                .into_iter()
                .map(u64::from)
                .collect()
        } else {
            (0..n).collect()
        }
    }

    /// The sample indices this rank reads in the current epoch, in order.
    pub fn indices(&self) -> Vec<u64> {
        let n = self.inner.cache.len();
        let order = self.epoch_order();
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

    /// Switches to `epoch` (a different order when shuffling) from its start. Right after
    /// [`Loader::load_state`], `set_epoch` of the state's epoch keeps the loaded position (the
    /// training loop calls `set_epoch` at the start of every epoch, the resumed one included).
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch == self.opts.epoch && *self.resumed.get_mut() {
            return;
        }
        *self.resumed.get_mut() = false;
        self.opts.epoch = epoch;
        self.cursor = 0;
        if let Some(f) = &self.follow {
            f.restart();
        }
    }

    /// Whether a state was loaded and no pass has started since (a state at the end of its
    /// epoch then resumes to no batch, not to the epoch again).
    pub fn resumed(&self) -> bool {
        self.resumed.load(Ordering::Relaxed)
    }

    /// The position to save with a checkpoint: the common position (`batch`: batches of this
    /// epoch consumed on this rank), then the cache loader's `shuffle`, `drop_last` and `samples`.
    pub fn state(&self) -> LoaderState {
        let st = LoaderState::new(
            self.inner.cache.manifest().schema().name(),
            self.opts.seed,
            self.opts.epoch,
            self.cursor,
            self.opts.batch_size,
            self.world,
        )
        .with("shuffle", StateValue::Bool(self.opts.shuffled()))
        .with("drop_last", StateValue::Bool(self.opts.drop_last))
        .with("samples", StateValue::UInt(self.inner.cache.len()));
        match &self.follow {
            Some(f) => f.save(st),
            None => st,
        }
    }

    /// Continues from a saved position. A state taken by a loader that would serve other
    /// samples (other seed when shuffling, batch size, world size, `shuffle`, `drop_last` or
    /// number of samples) is refused, naming each parameter that differs.
    pub fn load_state(&mut self, s: LoaderState) -> Result<()> {
        use crate::engine::dist::{differ, refuse};
        s.check_format(self.inner.cache.manifest().schema().name())?;
        let shuffle = s.flag("shuffle")?;
        let drop_last = s.flag("drop_last")?;
        let samples = s.uint("samples")?;
        let mut diff = Vec::new();
        let show = u64::to_string;
        if shuffle != Some(false) && self.opts.shuffled() {
            differ(&mut diff, "seed", Some(&s.seed), &self.opts.seed, show);
        }
        differ(
            &mut diff,
            "batch_size",
            Some(&s.batch_size),
            &self.opts.batch_size,
            show,
        );
        differ(
            &mut diff,
            "world_size",
            Some(&s.world_size),
            &self.world,
            show,
        );
        differ(
            &mut diff,
            "shuffle",
            shuffle.as_ref(),
            &self.opts.shuffled(),
            bool::to_string,
        );
        differ(
            &mut diff,
            "drop_last",
            drop_last.as_ref(),
            &self.opts.drop_last,
            bool::to_string,
        );
        differ(
            &mut diff,
            "samples",
            samples.as_ref(),
            &self.inner.cache.len(),
            show,
        );
        refuse(diff)?;
        if let Some(f) = &self.follow {
            let m = self.inner.cache.manifest();
            let (rounds, batches) = f.rounds_of(&s, m, self.opts.batch_size)?;
            if s.batch > batches {
                return Err(Error::Invalid(format!(
                    "the state's batch {} is past its follow_rounds' {batches} batches",
                    s.batch
                )));
            }
            f.set_rounds(rounds);
        } else if s.batch > self.len() {
            return Err(Error::Invalid(format!(
                "the state's batch {} is past the epoch's {} batches",
                s.batch,
                self.len()
            )));
        }
        self.opts.epoch = s.epoch;
        self.cursor = s.batch;
        *self.resumed.get_mut() = true;
        Ok(())
    }

    /// The batches left in the epoch from the loader's position, prepared ahead on the
    /// engine's threads. The position does not move by itself: record progress with
    /// [`Loader::advance_to`]`(batches.cursor())` so `state()` saves it.
    pub fn iter(&self) -> Batches {
        self.resumed.store(false, Ordering::Relaxed);
        if let Some(f) = &self.follow {
            return self.follow_iter(f);
        }
        let indices = self.indices();
        let bs = self.opts.batch_size as usize;
        let mut batches: Vec<Vec<u64>> = indices.chunks(bs).map(<[u64]>::to_vec).collect();
        if self.opts.drop_last && batches.last().is_some_and(|b| b.len() < bs) {
            batches.pop();
        }
        let start = (self.cursor as usize).min(batches.len());
        let batches: Vec<Vec<u64>> = batches.split_off(start);
        let stream = match self.gather_pool() {
            Err(e) => exec::Stream::failed(e),
            Ok(pool) => exec::start(
                Arc::new(Eagle3Job {
                    inner: self.inner.clone(),
                    pool: pool.clone(),
                }),
                batches.into_iter(),
                pool,
                StreamOptions {
                    ahead: depth(&self.inner.cache, &self.opts),
                },
            ),
        };
        Batches {
            stream,
            start: self.cursor,
            delivered: 0,
            follow: None,
        }
    }

    /// Follow mode's pass: the rounds' batches one after the other, waiting for shards between
    /// (see eagle3/follow.rs).
    fn follow_iter(&self, f: &Follow) -> Batches {
        let pass = self.gather_pool().map(|pool| FollowPass {
            follow: f.clone(),
            inner: self.inner.clone(),
            pool,
            order: self.epoch_order(),
            bs: self.opts.batch_size,
            epoch: self.opts.epoch,
            ahead: depth(&self.inner.cache, &self.opts),
        });
        let (stream, follow) = match pass {
            Ok(p) => (exec::Stream::empty(), Some(Box::new(p))),
            Err(e) => (exec::Stream::failed(e), None),
        };
        Batches {
            stream,
            start: self.cursor,
            delivered: 0,
            follow,
        }
    }

    /// Bytes of the buffer of a full batch (every field).
    pub fn batch_bytes(&self) -> Result<usize> {
        Ok(batch_layout(&self.inner.cache, self.opts.batch_size as usize)?.2)
    }

    /// Gathers batches into `pool` from now on (e.g. pinned host memory for copies to a GPU;
    /// each buffer must hold [`Loader::batch_bytes`]).
    pub fn set_batch_buffers(&self, pool: BufferPool) {
        *self.inner.pool.lock().unwrap_or_else(|e| e.into_inner()) = pool;
    }

    /// Sets the position to batch `batch` of the epoch (see [`Batches::cursor`]).
    pub fn advance_to(&mut self, batch: u64) {
        *self.resumed.get_mut() = false;
        // Follow mode: rounds may end with partial batches, so an epoch may have more; back at
        // its start, the epoch's rounds are formed again from what is durable then.
        self.cursor = match &self.follow {
            Some(f) if batch == 0 => {
                f.restart();
                0
            }
            Some(_) => batch,
            None => batch.min(self.len()),
        };
    }

    /// Whether the position is at the end of the epoch: every batch served (in follow mode,
    /// every shard served in the epoch's rounds).
    pub fn epoch_finished(&self) -> bool {
        match &self.follow {
            Some(f) => f.finished(
                self.inner.cache.manifest(),
                self.opts.batch_size,
                self.cursor,
            ),
            None => self.cursor >= self.len(),
        }
    }

    /// Reads the samples `indices` as one batch, now.
    pub fn read(&self, indices: &[u64]) -> Result<Batch> {
        let pool = self.gather_pool()?;
        let job = Eagle3Job {
            inner: self.inner.clone(),
            pool: pool.clone(),
        };
        exec::run_one(&job, indices.to_vec(), &pool)
    }
}

/// Batches prepared ahead: `prefetch`, or from a store at least enough to keep
/// `inflight · max_request` bytes of GETs in flight (a few batches' requests alone leave the
/// store idle between them), at most 256. Their buffers are what the GETs fill, so memory stays
/// at about that many bytes.
fn depth(cache: &Cache, opts: &LoaderOptions) -> usize {
    let asked = opts.prefetch.max(1);
    if cache.remote().is_none() {
        return asked;
    }
    let per_batch = batch_layout(cache, opts.batch_size.max(1) as usize).map_or(1, |l| l.2);
    let in_flight = crate::config::inflight() as u64 * crate::config::max_request();
    let want = in_flight.div_ceil(per_batch.max(1) as u64).min(256) as usize;
    asked.max(want)
}

/// The fields of a batch of `b` samples, then (top-k caches) the staging areas of the stored
/// values and indices, and the bytes they need.
#[allow(clippy::type_complexity)]
fn batch_layout(
    cache: &Cache,
    b: usize,
) -> Result<(Vec<BatchField>, Vec<(&'static str, usize, usize)>, usize)> {
    let m = cache.manifest();
    let specs = cache.specs();
    // Output fields, then (top-k) the stored values and indices to scatter from.
    let mut layout = Vec::new();
    let mut off = 0usize;
    let align = |x: usize| x.next_multiple_of(64);
    for &name in m.schema().item_fields() {
        let (dtype, row) = if let (Some(vd), "target_probs") = (cache.topk_width(), name) {
            (m.dtype, vec![m.seq_length as usize, vd])
        } else {
            let spec = specs
                .iter()
                .find(|x| x.name == name)
                .ok_or_else(|| Error::Internal(format!("internal: no stored field {name}")))?;
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
    if m.topk().is_some() {
        for name in ["target_probs_values", "target_probs_indices"] {
            let spec = specs
                .iter()
                .find(|x| x.name == name)
                .ok_or_else(|| Error::Internal(format!("internal: no stored field {name}")))?;
            staging.push((name, spec.row_bytes(), off));
            off = align(off + spec.row_bytes() * b);
        }
    }
    Ok((layout, staging, off))
}

/// The batches of one pass, as the engine runs them.
struct Eagle3Job {
    inner: Arc<Inner>,
    /// The gather pool (verification hashes blocks on it while preparing a batch).
    pool: Arc<GatherPool>,
}

/// A prepared batch: its samples, field layout, the reads that fill it (one per region, in
/// buffer order; each with its shard's map when its bytes are in the page cache) and the top-k
/// staging areas.
struct Eagle3Batch {
    indices: Vec<u64>,
    layout: Vec<BatchField>,
    reads: Vec<(ReadRange, Option<Arc<memmap2::Mmap>>)>,
    /// (field, row bytes, buffer offset) of the stored top-k values and indices.
    staging: Vec<(&'static str, usize, usize)>,
    /// From an object store: the batch's requests, in flight (the filled buffer comes from
    /// here), and the stream's stop flag, which gives up waiting for them.
    pending: Option<(PendingRead, Arc<std::sync::atomic::AtomicBool>)>,
}

impl Job for Eagle3Job {
    type Plan = Vec<u64>;
    type State = Eagle3Batch;
    type Item = Batch;

    /// Lays the batch out, checks its shards against the manifest (opening them), plans the
    /// reads, and takes the buffer: allocated only now, so sizes claimed by a damaged manifest
    /// are never allocated.
    fn prepare(&self, indices: Vec<u64>, cx: &Context<'_>) -> Result<Prepared<Eagle3Batch>> {
        let inner = &*self.inner;
        let cache = &inner.cache;
        let m = cache.manifest();
        let specs = cache.specs();
        let b = indices.len();
        let s = m.shard_size;
        let (layout, staging, off) = batch_layout(cache, b)?;
        let mut ranges = Vec::with_capacity(b * specs.len());
        // Every shard of the batch at once: from a store, the new ones' headers in one round.
        let ks: Vec<u64> = indices.iter().map(|&i| i / s).collect();
        // Their headers' reads stop with the stream.
        let shards = cache.shards(&ks, &Stop::new(cx.stop_flag().clone()))?;
        for (j, &i) in indices.iter().enumerate() {
            let k = i / s;
            let shard = shards
                .get(&k)
                .ok_or_else(|| Error::Internal(format!("internal: shard {k} was not opened")))?;
            let row = i % s;
            for (f, spec) in specs.iter().enumerate() {
                let rb = spec.row_bytes();
                let dst = match layout.iter().find(|l| l.name == spec.name) {
                    Some(l) => l.offset + j * rb,
                    None => match staging.iter().find(|x| x.0 == spec.name) {
                        Some(st) => st.2 + j * rb,
                        None => {
                            return Err(Error::Internal(format!(
                                "internal: stored field {} has no place in a batch",
                                spec.name
                            )))
                        }
                    },
                };
                ranges.push(ReadRange {
                    file: k as u32,
                    offset: shard.row_offset(f, row, rb),
                    len: rb as u64,
                    dst: dst as u64,
                });
            }
        }
        if let Some(remote) = cache.remote() {
            // From an object store: the batch's rows requested at once (coalesced ranged GETs)
            // and left in flight while the next batches are prepared; `finish` waits for them.
            // The gather has nothing to do.
            let buf = cx.buffer(
                &inner.pool.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                off,
            )?;
            // The batch is dropped when the stream stops: its requests stop with it.
            let stop = Stop::new(cx.stop_flag().clone());
            let pending = remote.start_read(inner.names.clone(), ranges, buf, &stop)?;
            return Ok(Prepared {
                buf: crate::engine::Buffer::zeroed(0),
                regions: Vec::new(),
                state: Eagle3Batch {
                    indices,
                    layout,
                    reads: Vec::new(),
                    staging,
                    pending: Some((pending, cx.stop_flag().clone())),
                },
            });
        }
        // Rows are megabytes each: the reader threads' own reads keep the disk busy (asking for
        // readahead as well measured slower).
        let mut reads = plan_reads(ranges);
        reads.sort_unstable_by_key(|r| r.dst);
        let regions = reads
            .iter()
            .map(|r| std::iter::once(r.dst as usize..(r.dst + r.len) as usize).collect())
            .collect();
        // Ranges already in the page cache are copied straight out of the shard's map (one
        // user-space copy, which scales with threads; a read's kernel copy does not); the
        // others are read, with many reads in flight on the gather threads.
        let files = &inner.files;
        let reads = reads
            .into_iter()
            .map(|r| {
                let end = r.offset + r.len;
                let map = files
                    .map(r.file, end)
                    .filter(|m| local::resident(&m[r.offset as usize..end as usize]));
                if map.is_some() {
                    // A map must never be read past its file's end: a shard that shrank is an
                    // error naming it, as a short read would be.
                    local::check_len(files.file(r.file)?, &files.path(r.file), end)?;
                }
                Ok((r, map))
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(v) = &inner.verifier {
            // Every block the batch reads, checked before it is gathered (in parallel on the
            // gather threads; blocks checked before and still in memory are skipped).
            let mut maps = std::collections::BTreeMap::new();
            for (r, _) in &reads {
                if let std::collections::btree_map::Entry::Vacant(slot) = maps.entry(r.file) {
                    slot.insert(files.map(r.file, 0).ok_or_else(|| {
                        Error::format(
                            files.path(r.file),
                            "cannot be mapped to verify its checksums",
                        )
                    })?);
                }
            }
            let touched = reads
                .iter()
                .flat_map(|(r, _)| v.blocks(r.file as usize, r.offset..r.offset + r.len));
            let map = |i: usize| {
                maps.get(&(i as u32))
                    .map(|m| &m[..])
                    .ok_or_else(|| Error::Internal("internal: an unmapped shard".into()))
            };
            v.ensure(touched, map, self.pool.pool())?;
        }
        Ok(Prepared {
            buf: cx.buffer(
                &inner.pool.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                off,
            )?,
            regions,
            state: Eagle3Batch {
                indices,
                layout,
                reads,
                staging,
                pending: None,
            },
        })
    }

    fn fill(&self, b: &Eagle3Batch, piece: usize, out: &mut [&mut [u8]]) -> Result<()> {
        let (r, map) = &b.reads[piece];
        if let Some(map) = map {
            let (start, end) = (r.offset as usize, (r.offset + r.len) as usize);
            buffer::copy_streaming(out[0], &map[start..end]);
            buffer::copy_done();
            return Ok(());
        }
        let files = &self.inner.files;
        local::read_exact(files.file(r.file)?, &files.path(r.file), r.offset, out[0])
    }

    /// Expands top-k rows into the full-width `target_probs` (in parallel over samples).
    fn finish(&self, p: Prepared<Eagle3Batch>, pool: &rayon::ThreadPool) -> Result<Batch> {
        let Prepared {
            mut buf, state: b, ..
        } = p;
        if let Some((pending, stop)) = &b.pending {
            // A loader dropped while its batch is in flight cuts the batch's requests and goes.
            buf = pending.wait(|| stop.load(std::sync::atomic::Ordering::Relaxed))?;
        }
        let cache = &self.inner.cache;
        let m = cache.manifest();
        if let Some(vd) = cache.topk_width() {
            let elem = m.dtype.bitsize() / 8;
            let probs = b
                .layout
                .iter()
                .find(|l| l.name == "target_probs")
                .ok_or_else(|| Error::Internal("internal: no target_probs field".into()))?;
            let row_out = cache.full_probs_bytes();
            let n = b.indices.len();
            let (vals, idx) = (b.staging[0], b.staging[1]);
            let bytes = buf.as_mut_bytes();
            let (head, tail) = bytes.split_at_mut(vals.2);
            let out = &mut head[probs.offset..probs.offset + n * row_out];
            let values = &tail[..n * vals.1];
            let indices = &tail[idx.2 - vals.2..idx.2 - vals.2 + n * idx.1];
            let s = m.shard_size;
            let files = &self.inner.files;
            pool.install(|| {
                out.par_chunks_mut(row_out.max(1))
                    .enumerate()
                    .try_for_each(|(j, out)| {
                        out.fill(0);
                        let path = files.path((b.indices[j] / s) as u32);
                        scatter(
                            &values[j * vals.1..(j + 1) * vals.1],
                            &indices[j * idx.1..(j + 1) * idx.1],
                            out,
                            elem,
                            vd,
                            &path,
                        )
                    })
            })?;
        }
        Ok(Batch {
            indices: b.indices,
            data: buf,
            layout: b.layout,
        })
    }
}

/// Batches being read ahead; dropping it stops and joins the engine's threads.
pub struct Batches {
    stream: exec::Stream<Batch>,
    start: u64,
    delivered: u64,
    /// Follow mode: the next rounds' batches, started when the current stream ends.
    follow: Option<Box<FollowPass>>,
}

/// What a follow-mode pass needs to start its rounds.
struct FollowPass {
    follow: Follow,
    inner: Arc<Inner>,
    pool: Arc<GatherPool>,
    /// The epoch's planned order (every rank's).
    order: Vec<u64>,
    bs: u64,
    epoch: u64,
    ahead: usize,
}

impl Batches {
    /// The epoch's batch index the next batch will have (resume a loader there with
    /// [`Loader::advance_to`]).
    pub fn cursor(&self) -> u64 {
        self.start + self.delivered
    }
}

impl Iterator for Batches {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        loop {
            match self.stream.next() {
                Some(Ok(b)) => {
                    self.delivered += 1;
                    return Some(Ok(b));
                }
                Some(Err(e)) => {
                    self.follow = None; // a failed pass ends
                    return Some(Err(e));
                }
                None => {}
            }
            let p = self.follow.as_ref()?;
            let at = self.start + self.delivered;
            match p
                .follow
                .next_round(&p.inner.cache, &p.order, p.bs, p.epoch, at)
            {
                Ok(Some(batches)) => {
                    let job = Arc::new(Eagle3Job {
                        inner: p.inner.clone(),
                        pool: p.pool.clone(),
                    });
                    let opts = StreamOptions { ahead: p.ahead };
                    self.stream = exec::start(job, batches.into_iter(), p.pool.clone(), opts);
                }
                Ok(None) => {
                    self.follow = None;
                    return None;
                }
                Err(e) => {
                    self.follow = None;
                    return Some(Err(e));
                }
            }
        }
    }
}
