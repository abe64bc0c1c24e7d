//! `shardkit bench ...`: measurements, never tests. Each prints the ceiling it measured in the
//! same run next to the figure, so a ratio is never taken against a number from another day.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Subcommand;
use shardkit::internals::open_direct;
use shardkit::json::{self, Escape, Value};
use shardkit::saev::{Writer, WriterOptions};
use shardkit::{Error, Result};

use crate::saev_cmd::{coded_block, synth_metadata, SynthArgs};

/// Benchmarks.
#[derive(Subcommand)]
pub enum BenchCmd {
    /// saev writer throughput against large sequential writes with fsync, in the same run.
    SaevWrite {
        /// Directory to write into (a file system you care about; default ./bench-data).
        #[arg(long, default_value = "bench-data")]
        dir: PathBuf,
        /// Bytes written per run, in MiB.
        #[arg(long, default_value_t = 1024)]
        size_mib: u64,
        /// Measured rounds (each: one ceiling run and one writer run, alternating).
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// saev loaders (ordered, block, exact; cold and warm) against sequential and random-4K
    /// read ceilings measured on the same files in the same run.
    SaevRead {
        /// Directory for the synthetic dataset (reused when already there).
        #[arg(long, default_value = "bench-data")]
        dir: PathBuf,
        /// Dataset size in GiB.
        #[arg(long, default_value_t = 8.0)]
        size_gib: f64,
        /// Rounds (the best of each is reported).
        #[arg(long, default_value_t = 2)]
        rounds: u32,
        /// Print JSON (always printed; kept for symmetry with other benches).
        #[arg(long)]
        json: bool,
        /// Draw each loader's throughput over time against the ceilings into this PNG.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Run only these measurements (comma-separated: seq, rand4k, ordered, block, exact,
        /// warm); ratios need their ceiling in the same run.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Gather thread counts of the warm block loader, each beside a memory-copy ceiling
        /// with as many threads (comma-separated; default 1, 2, 4, ... and every core).
        #[arg(long, value_delimiter = ',')]
        threads: Vec<usize>,
        /// Reduced-precision variants measured beside float32, comma-separated: bf16 (a
        /// bfloat16 dataset of the same rows, written beside the float32 one; rows as stored),
        /// bf16-upcast (the same, widened to float32 by the loader), or none. Cold and warm
        /// block-shuffled only.
        #[arg(long, value_delimiter = ',', default_value = "bf16,bf16-upcast")]
        dtypes: Vec<String>,
    },
    /// flat-tokens: time to the first batch at a random step, sustained packed-batch
    /// throughput against zarr-python + numpy and the sequential ceilings, writer throughput.
    Tokens(crate::bench_tokens::TokensBenchArgs),
    /// saev and flat-tokens loaders reading from an object store (`s3://`), against the raw
    /// parallel-GET ceiling of the same objects, at several in-flight and thread counts.
    Remote(crate::bench_remote::RemoteBenchArgs),
    /// EAGLE-3: the shuffled loader, cold, against the sequential-read ceiling of the same
    /// shard files and a NeMo-style Python reader, in the same run.
    Eagle3(crate::bench_eagle3::Eagle3BenchArgs),
    /// SameDiff containers: SDNB and SDZ writers against the sequential-write ceiling, and
    /// cold open-and-list of a large container, in the same run.
    Sdnb(crate::bench_sdnb::SdnbBenchArgs),
    /// A TCP relay that makes a loopback S3 server answer like a far store (a latency on every
    /// response, a pace per connection); `bench remote --link-latency-ms` starts one itself.
    Link(crate::bench_link::LinkArgs),
    /// One saev dataset written by 1, 2, 4, ... writer processes (ranks of one PartWriter
    /// job) against the sequential write ceiling, each checked byte-identical to 1 writer;
    /// and the commit time of a 1,000-shard dataset, in the same run.
    Parts(crate::bench_parts::PartsBenchArgs),
    /// One writer process of `parts` (internal: the benchmark spawns it).
    #[command(hide = true)]
    PartsRank(crate::bench_parts::RankArgs),
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::SaevWrite {
            dir,
            size_mib,
            rounds,
            json: as_json,
        } => saev_write(&dir, size_mib, rounds.max(1), as_json),
        BenchCmd::SaevRead {
            dir,
            size_gib,
            rounds,
            json: _,
            only,
            plot,
            threads,
            dtypes,
        } => {
            let variants = crate::bench_precision::Variant::parse_list(&dtypes)?;
            let threads = if threads.is_empty() {
                thread_counts()
            } else {
                threads
            };
            let v = saev_read(
                &dir,
                size_gib,
                rounds.max(1),
                &only,
                plot.as_deref(),
                &threads,
                &variants,
            )?;
            println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
            Ok(())
        }
        BenchCmd::Tokens(args) => crate::bench_tokens::run(args),
        BenchCmd::Remote(args) => crate::bench_remote::run(args),
        BenchCmd::Eagle3(args) => crate::bench_eagle3::run(args),
        BenchCmd::Sdnb(args) => crate::bench_sdnb::run(args),
        BenchCmd::Link(args) => crate::bench_link::run(args),
        BenchCmd::Parts(args) => crate::bench_parts::run(args),
        BenchCmd::PartsRank(args) => crate::bench_parts::rank(args),
    }
}

/// The `shardkit` binary, for the benchmarks that time a command as a user runs it: next to
/// this executable (cargo builds both into one directory), else the first on PATH.
pub(crate) fn shardkit_exe() -> Result<PathBuf> {
    shardkit_cli::sibling_exe("shardkit").ok_or_else(|| {
        Error::Invalid(format!(
            "this benchmark runs the shardkit binary, which is neither next to {} nor on \
             PATH: build it with `cargo build --release -p shardkit-cli`",
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "shardkit-bench".into())
        ))
    })
}

/// Bytes of one example of the benchmark shape: 2 layers x (256 patches + CLS) x 1024 floats.
const VIT_L_EXAMPLE_BYTES: u64 = 2 * 257 * 1024 * 4;

/// A synthetic ViT-L-shaped saev dataset of `examples` examples (at least one) under `out`.
pub(crate) fn vit_l(out: PathBuf, examples: u64, resume: bool) -> SynthArgs {
    SynthArgs {
        out,
        examples: examples.max(1),
        layers: vec![-2, -1],
        content_tokens: 256,
        no_cls: false,
        d_model: 1024,
        budget: None,
        protocol: "2.1".into(),
        family: "clip".into(),
        ckpt: "synthetic".into(),
        labels: false,
        npy: false,
        resume,
    }
}

/// A figure in a bench's JSON, to three decimals.
pub(crate) fn num(x: f64) -> shardkit::json::Value {
    shardkit::json::Value::float(x, 3)
}

// --- comparisons with a baseline ------------------------------------------------------------
//
// Every ratio a bench prints (a speedup over another reader, one input format against another,
// a figure against its ceiling) goes through `ratio`, and every baseline that reads or builds
// the same data proves it did with `same_bytes`: a missing, zero or non-finite rate, or a
// baseline that produced other bytes, fails the bench (non-zero exit) instead of printing a
// figure that only looks like a measurement.

/// `ours / theirs`, for the comparison named `what`. Both must be positive and finite: a rate
/// that is missing (0 by default), zero or NaN is an error, never an infinite or zero ratio.
pub(crate) fn ratio(what: &str, ours: f64, theirs: f64) -> Result<f64> {
    let measured = |x: f64| x.is_finite() && x > 0.0;
    if !measured(ours) || !measured(theirs) {
        return Err(Error::Invalid(format!(
            "{what}: no ratio of {ours} to {theirs}: a rate is missing, zero or not finite \
             (the measurement failed; nothing to compare)"
        )));
    }
    Ok(ours / theirs)
}

/// The positive, finite rate `key` of a baseline's JSON report, or an error naming the
/// baseline: a report without it cannot be compared with.
pub(crate) fn baseline_rate(baseline: &str, report: &Value, key: &str) -> Result<f64> {
    let rate = match report.get(key) {
        Some(Value::Number(n)) => n.parse::<f64>().ok(),
        _ => None,
    };
    match rate {
        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(Error::Invalid(format!(
            "{baseline}: its report has no positive `{key}` ({:?}); no speedup can be computed",
            report.get(key)
        ))),
    }
}

/// Checks that a baseline produced exactly the bytes shardkit did: `theirs` (the SHA-256, in
/// hex, that the baseline reported for `what`) equals `ours`. A baseline that read other
/// samples, another order or other bytes measured something else, so no speedup is reported.
pub(crate) fn same_bytes(
    baseline: &str,
    what: &str,
    ours: &str,
    theirs: Option<&str>,
) -> Result<()> {
    match theirs {
        Some(t) if t == ours => Ok(()),
        Some(t) => Err(Error::Invalid(format!(
            "{baseline} produced other bytes than shardkit for {what}: sha256 {t}, shardkit's {ours}"
        ))),
        None => Err(Error::Invalid(format!(
            "{baseline}: its report gives no sha256 of {what}, so it cannot be shown to have \
             read the same bytes as shardkit"
        ))),
    }
}

/// The SHA-256 of every file under `root`: each file's path relative to `root`, its length and
/// its bytes, in path order. Two directories with the same digest hold the same files.
pub(crate) fn tree_sha256(root: &Path) -> Result<String> {
    let mut files = crate::bench_tokens::files_under(root);
    files.sort();
    if files.is_empty() {
        return Err(Error::NotFound {
            path: root.to_path_buf(),
            what: "no files to compare".into(),
        });
    }
    let mut digest = Digest::default();
    for f in files {
        let rel = f
            .strip_prefix(root)
            .unwrap_or(&f)
            .to_string_lossy()
            .into_owned();
        let bytes = std::fs::read(&f).map_err(|e| Error::io(&f, e))?;
        digest.update(rel.as_bytes());
        digest.update(&[0]);
        digest.update(&(bytes.len() as u64).to_le_bytes());
        digest.update(&bytes);
    }
    Ok(digest.hex())
}

/// A running SHA-256 over the bytes a reader produced, in order (hex at the end), to compare
/// with a baseline's or another build's.
#[derive(Default)]
pub(crate) struct Digest(sha2::Sha256);

impl Digest {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        sha2::Digest::update(&mut self.0, bytes);
    }
    pub(crate) fn hex(self) -> String {
        sha2::Digest::finalize(self.0)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// CPU seconds this process has used so far, user and system, over all its threads. Taken
/// around a run beside its wall time, it gives what the work costs per byte or token however
/// busy a shared machine is, and, divided by the wall time, how many cores it kept busy.
pub(crate) fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the rusage it is given; on failure it is not read.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return 0.0;
    }
    // SAFETY: filled by the successful call above (and all-zero bytes are a valid rusage).
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

pub(crate) fn flush_page_cache() {
    // SAFETY: sync(2) has no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// Large sequential writes of `bytes` with one fsync at the end, as fast as the disk allows.
pub(crate) fn ceiling_run(path: &Path, bytes: u64) -> Result<f64> {
    let chunk = vec![0x5au8; 8 << 20];
    flush_page_cache();
    let t0 = Instant::now();
    let mut f = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).map_err(|e| Error::io(path, e))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| Error::io(path, e))?;
    let secs = t0.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(path).map_err(|e| Error::io(path, e))?;
    Ok(bytes as f64 / secs)
}

/// The saev writer producing a ViT-L-shaped dataset (2 layers, 256 patches + CLS, d 1024).
fn writer_run(root: &Path, args: &SynthArgs, batch: &[f32]) -> Result<(f64, u64)> {
    let md = synth_metadata(args)?;
    let layout = shardkit::saev::Layout::new(&md, Path::new("metadata.json"))?;
    let eb = layout.n_layers * layout.tokens * layout.d_model;
    let n = layout.n_examples;
    let per_batch = batch.len() as u64 / eb;
    flush_page_cache();
    let t0 = Instant::now();
    let mut w = Writer::create(root, md, WriterOptions::default())?;
    let mut e = 0;
    while e < n {
        let b = per_batch.min(n - e);
        w.write(&batch[..(b * eb) as usize], None)?;
        e += b;
    }
    let dir = w.finish()?;
    let secs = t0.elapsed().as_secs_f64();
    let bytes = n * eb * 4;
    std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    Ok((bytes as f64 / secs, bytes))
}

fn saev_write(dir: &Path, size_mib: u64, rounds: u32, as_json: bool) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let args = vit_l(
        dir.to_path_buf(),
        (size_mib << 20) / VIT_L_EXAMPLE_BYTES,
        false,
    );
    let mut batch = Vec::new();
    coded_block(0, 32, 2, 257, 1024, &mut batch);
    let ceiling_file = dir.join("ceiling.tmp");
    let bytes = args.examples * VIT_L_EXAMPLE_BYTES;

    // One unmeasured warm-up of each, then alternate so drift hits both equally.
    ceiling_run(&ceiling_file, bytes)?;
    writer_run(dir, &args, &batch)?;
    let (mut ceil, mut wr) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        ceil.push(ceiling_run(&ceiling_file, bytes)?);
        wr.push(writer_run(dir, &args, &batch)?.0);
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0f64, f64::max);
    let (c, w) = (best(&ceil), best(&wr));
    let num = |x: f64| Value::float(x, 0);
    let list = |v: &[f64]| Value::Array(v.iter().map(|&x| num(x)).collect());
    let report = Value::Object(vec![
        ("bench".into(), Value::String("saev-write".into())),
        ("dir".into(), Value::String(dir.display().to_string())),
        ("bytes_per_run".into(), Value::int(bytes)),
        (
            "shape".into(),
            Value::String(format!("({}, 2, 257, 1024) float32", args.examples)),
        ),
        ("rounds".into(), Value::int(rounds)),
        (
            "cores".into(),
            Value::int(std::thread::available_parallelism().map_or(1, |n| n.get()) as u64),
        ),
        ("ceiling_bytes_per_s".into(), num(c)),
        ("writer_bytes_per_s".into(), num(w)),
        (
            "ratio".into(),
            Value::float(ratio("saev writer vs sequential write", w, c)?, 3),
        ),
        ("ceiling_runs_bytes_per_s".into(), list(&ceil)),
        ("writer_runs_bytes_per_s".into(), list(&wr)),
    ]);
    if as_json {
        println!("{}", json::to_pretty(&report, 2, Escape::Utf8));
    } else {
        println!(
            "sequential write ceiling {:.0} MiB/s, saev writer {:.0} MiB/s, ratio {:.2}",
            c / 1048576.0,
            w / 1048576.0,
            w / c
        );
    }
    Ok(())
}

/// Drops a file's pages from the page cache (clean pages only; the dataset is fsynced).
pub(crate) fn evict(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| Error::io(path, e))?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advisory syscall on an open descriptor.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(())
}

/// Reads every file sequentially in `chunk`-byte reads with `inflight` threads; bytes/s.
/// `direct` uses O_DIRECT with page-aligned buffers; otherwise buffered reads after eviction.
pub(crate) fn seq_read(
    files: &[PathBuf],
    chunk: u64,
    inflight: usize,
    direct: bool,
) -> Result<Option<f64>> {
    let mut handles = Vec::new();
    for p in files {
        evict(p)?;
        let f = if direct {
            match open_direct(p) {
                Some(f) => f,
                None => return Ok(None),
            }
        } else {
            File::open(p).map_err(|e| Error::io(p, e))?
        };
        let len = f.metadata().map_err(|e| Error::io(p, e))?.len();
        handles.push((f, len));
    }
    let jobs: Vec<(usize, u64)> = handles
        .iter()
        .enumerate()
        .flat_map(|(i, (_, len))| (0..len.div_ceil(chunk)).map(move |k| (i, k * chunk)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let total: u64 = handles.iter().map(|(_, l)| l).sum();
    let t0 = Instant::now();
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..inflight {
            s.spawn(|| {
                use std::os::unix::fs::FileExt;
                let mut buf = shardkit::engine::Buffer::zeroed(chunk as usize);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(fi, off)) = jobs.get(i) else {
                        return;
                    };
                    let (f, len) = &handles[fi];
                    let n = chunk.min(len - off) as usize;
                    // O_DIRECT needs an aligned length: read the rounded-up tail.
                    let n = if direct { n.div_ceil(4096) * 4096 } else { n };
                    if f.read_at(&mut buf[..n.min(chunk as usize)], off).is_err() {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    if failed.into_inner() {
        return Ok(None);
    }
    Ok(Some(total as f64 / t0.elapsed().as_secs_f64()))
}

/// Random 4 KiB O_DIRECT reads (buffered after eviction if O_DIRECT is refused), 16 in flight.
fn rand4k(files: &[PathBuf], reads: usize) -> Result<f64> {
    let mut handles = Vec::new();
    for p in files {
        evict(p)?;
        let f = match open_direct(p) {
            Some(f) => f,
            None => File::open(p).map_err(|e| Error::io(p, e))?,
        };
        let len = f.metadata().map_err(|e| Error::io(p, e))?.len();
        handles.push((f, len / 4096));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..16u64 {
            let (handles, next) = (&handles, &next);
            s.spawn(move || {
                use std::os::unix::fs::FileExt;
                let mut rng = shardkit::internals::SplitMix64(t * 7919 + 1);
                let mut buf = shardkit::engine::Buffer::zeroed(4096);
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < reads {
                    let (f, pages) = &handles[rng.below(handles.len() as u64) as usize];
                    let off = rng.below(*pages) * 4096;
                    let _ = f.read_at(&mut buf, off);
                }
            });
        }
    });
    Ok(reads as f64 * 4096.0 / t0.elapsed().as_secs_f64())
}

/// 1, 2, 4, ... below the core count, and the core count.
pub(crate) fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut t: Vec<usize> = std::iter::successors(Some(1), |&n| Some(n * 2))
        .take_while(|&n| n < cores)
        .collect();
    t.push(cores);
    t
}

/// The memory-copy ceiling with `threads` threads: each copies its own source buffer into its
/// own destination (about 1 GiB of sources in all, large enough to miss every cache), best of
/// three passes; bytes copied per second.
pub(crate) fn memcpy_ceiling(threads: usize) -> f64 {
    let threads = threads.max(1);
    let per = ((1usize << 30) / threads).clamp(16 << 20, 256 << 20);
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|t| (vec![t as u8 | 1; per], vec![0u8; per]))
        .collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let barrier = std::sync::Barrier::new(threads + 1);
        let t0 = std::sync::Mutex::new(None);
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    dst.copy_from_slice(src);
                    std::hint::black_box(&dst);
                });
            }
            barrier.wait();
            *t0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        });
        let started = t0.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(t0) = started {
            best = best.max((per * threads) as f64 / t0.elapsed().as_secs_f64());
        }
    }
    best
}

/// The random-row gather ceiling with `threads` threads: each copies `row` bytes from random
/// row-aligned places of a shared 1 GiB source into its own 64 MiB batch (what a shuffled
/// loader does with data in memory, without any loader), best of three passes; bytes/s.
pub(crate) fn gather_ceiling(threads: usize, row: usize) -> f64 {
    let threads = threads.max(1);
    let row = row.max(64);
    let src = vec![7u8; 1 << 30];
    let rows_per_batch = ((64usize << 20) / row).max(1);
    let mut dsts: Vec<shardkit::engine::Buffer> = (0..threads)
        .map(|_| shardkit::engine::Buffer::zeroed(rows_per_batch * row))
        .collect();
    let slots = src.len() / row;
    let mut best = 0f64;
    for pass in 0..3u64 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (t, dst) in dsts.iter_mut().enumerate() {
                let src = &src;
                s.spawn(move || {
                    let mut rng = shardkit::internals::SplitMix64(pass * 1000 + t as u64);
                    for out in dst.chunks_exact_mut(row) {
                        let at = rng.below(slots as u64) as usize * row;
                        shardkit::internals::copy_streaming(out, &src[at..at + row]);
                    }
                    shardkit::internals::copy_done();
                });
            }
        });
        best = best.max((threads * rows_per_batch * row) as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

/// One loader pass: payload bytes/s (the bytes stored: 2 a value in a bfloat16 dataset, even
/// when the loader widens them), rows/s, and the bytes read over time (for --plot).
pub(crate) struct Pass {
    pub(crate) bytes_per_s: f64,
    pub(crate) rows_per_s: f64,
    /// CPU seconds of the whole process per wall second of the pass (cores kept busy).
    pub(crate) cores_busy: f64,
    pub(crate) samples: Vec<(f64, u64)>,
}

impl Pass {
    fn rate(&self) -> crate::bench_precision::Rate {
        crate::bench_precision::Rate {
            rows_per_s: self.rows_per_s,
            bytes_per_s: self.bytes_per_s,
            cores_busy: self.cores_busy,
        }
    }
}

/// A loader over at most `max_bytes` of payload, after `warmup_epochs` unmeasured passes
/// (which also fill the loader's buffer pools), gathering on `threads` threads (0: every core),
/// checking every block against the checksums sidecar if `verify`, widening a reduced-precision
/// dataset's rows to float32 if `upcast`.
#[allow(clippy::too_many_arguments)]
fn loader_run(
    dir: &Path,
    order: shardkit::engine::Order,
    files: &[PathBuf],
    max_bytes: u64,
    evict_first: bool,
    warmup_epochs: u32,
    threads: usize,
    verify: bool,
    upcast: bool,
) -> Result<Pass> {
    use shardkit::saev::{LayerSel, Loader, LoaderOptions};
    let mut o = LoaderOptions::new(LayerSel::Value(-1));
    o.order = order;
    o.seed = 1;
    o.threads = threads;
    o.verify = verify;
    o.upcast = upcast;
    let mut loader = Loader::new(dir, o)?;
    let stored = loader.dataset().layout().value_bytes() as usize;
    for e in 0..warmup_epochs {
        loader.set_epoch(100 + e as u64)?;
        for b in loader.iter()? {
            b?;
        }
    }
    loader.set_epoch(0)?;
    if evict_first {
        for p in files {
            evict(p)?;
        }
    }
    let (t0, cpu0) = (Instant::now(), cpu_seconds());
    let (mut bytes, mut rows) = (0u64, 0u64);
    let mut samples = vec![(0.0, 0u64)];
    for b in loader.iter()? {
        let b = b?;
        bytes += (b.n * b.d_model * stored) as u64;
        rows += b.n as u64;
        samples.push((t0.elapsed().as_secs_f64(), bytes));
        if bytes >= max_bytes {
            break;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(Pass {
        bytes_per_s: bytes as f64 / secs,
        rows_per_s: rows as f64 / secs,
        cores_busy: (cpu_seconds() - cpu0) / secs,
        samples,
    })
}

/// `shardkit bench saev-read`.
pub fn saev_read(
    dir: &Path,
    size_gib: f64,
    rounds: u32,
    only: &[String],
    plot: Option<&Path>,
    threads: &[usize],
    variants: &[crate::bench_precision::Variant],
) -> Result<Value> {
    use crate::bench_precision::{Tally, Variant};
    let run = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    use shardkit::engine::Order;
    let examples = (size_gib * (1u64 << 30) as f64) as u64 / VIT_L_EXAMPLE_BYTES;
    let args = vit_l(dir.join("saev/shards"), examples, true);
    let md = synth_metadata(&args)?;
    let ds_dir = args.out.join(md.dir_name());
    if shardkit::saev::Dataset::open(&ds_dir).is_err() {
        eprintln!(
            "writing the {size_gib} GiB benchmark dataset to {}",
            ds_dir.display()
        );
        crate::saev_cmd::synth(&args)?;
    }
    let ds = shardkit::saev::Dataset::open(&ds_dir)?;
    let l = ds.layout();
    let files: Vec<PathBuf> = (0..l.n_shards)
        .map(|s| ds.path().join(format!("acts{s:06}.bin")))
        .collect();
    // Every shard file is full size: eps x L x T x D float32 values.
    let total: u64 = l.examples_per_shard * l.n_layers * l.tokens * l.d_model * 4 * l.n_shards;
    // The bfloat16 dataset of the same rows, when a reduced variant is measured.
    let bf16 = if variants.is_empty() || !(run("block") || run("warm")) {
        None
    } else {
        Some(crate::bench_precision::bf16_beside(&args, &md, &ds)?)
    };
    let mut tally = Tally::default();
    let best = |v: &mut Vec<f64>, x: f64| v.push(x);
    // The last round's time series of each loader, for --plot.
    let mut series: Vec<crate::plot::Series> = Vec::new();
    let mut keep = |name: &str, pass: Pass| -> Pass {
        series.retain(|s| s.name != name);
        series.push(crate::plot::Series {
            name: name.to_string(),
            samples: pass.samples.clone(),
        });
        pass
    };
    let (mut seq_ways, mut r4k, mut ord, mut blk, mut ex, mut warm) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut ways_report = Vec::new();
    for round in 0..rounds {
        if run("seq") {
            for (name, chunk, inflight, direct) in [
                ("odirect_1mib_x16", 1u64 << 20, 16, true),
                ("odirect_8mib_x8", 8 << 20, 8, true),
                ("buffered_8mib_x2", 8 << 20, 2, false),
            ] {
                if let Some(x) = seq_read(&files, chunk, inflight, direct)? {
                    best(&mut seq_ways, x);
                    if round == 0 {
                        ways_report.push((name, x));
                    }
                }
            }
        }
        if run("rand4k") {
            best(&mut r4k, rand4k(&files, 20_000)?);
        }
        // The read ceiling of one layer's slabs (the block loader's pattern), per dtype.
        if let (Some(b), true) = (&bf16, run("seq")) {
            use shardkit::precision::Dtype;
            let bds = shardkit::saev::Dataset::open(&b.dir)?;
            tally.layer_ceiling(Dtype::F32, crate::bench_precision::layer_read(&ds, 16)?);
            tally.layer_ceiling(Dtype::BF16, crate::bench_precision::layer_read(&bds, 16)?);
        }
        // The cold loaders, each evicted first; exact over its first GiB of payload.
        for (name, label, order, max_bytes, runs) in [
            (
                "ordered",
                "ordered (cold)",
                Order::Sequential,
                u64::MAX,
                &mut ord,
            ),
            (
                "block",
                "block shuffle (cold)",
                Order::Block,
                u64::MAX,
                &mut blk,
            ),
            (
                "exact",
                "exact shuffle (cold)",
                Order::Exact,
                1 << 30,
                &mut ex,
            ),
        ] {
            if run(name) {
                let p = loader_run(&ds_dir, order, &files, max_bytes, true, 0, 0, false, false)?;
                let p = keep(label, p);
                if order == Order::Block {
                    tally.cold(Variant::F32, p.rate());
                }
                best(runs, p.bytes_per_s);
            }
        }
        // The same block-shuffled read of the bfloat16 rows, right after float32's.
        if let (Some(b), true) = (&bf16, run("block")) {
            for &v in variants {
                let label = format!("block shuffle, {} (cold)", v.key());
                let p = loader_run(
                    &b.dir,
                    Order::Block,
                    &b.files,
                    u64::MAX,
                    true,
                    0,
                    0,
                    false,
                    v.upcast(),
                )?;
                tally.cold(v, keep(&label, p).rate());
            }
        }
    }
    // Warm: the whole dataset in the page cache first, and unmeasured epochs; at each thread
    // count, the memory-copy ceiling with as many threads, measured just before.
    let mut scaling = Vec::new();
    if run("warm") {
        // Datasets written before checksums existed get their sidecar now.
        if !ds_dir.join(shardkit::checksum::SIDECAR).exists() {
            shardkit::checksum::record(&ds_dir)?;
        }
        let mut buf = vec![0u8; 8 << 20];
        for p in files.iter().chain(bf16.iter().flat_map(|b| &b.files)) {
            use std::io::Read;
            let mut f = File::open(p).map_err(|e| Error::io(p, e))?;
            while f.read(&mut buf).map_err(|e| Error::io(p, e))? > 0 {}
        }
        for &t in threads {
            let ceiling = memcpy_ceiling(t);
            let row_ceiling = gather_ceiling(t, 1024 * 4);
            let mut rates = Vec::new();
            for _ in 0..rounds {
                let label = format!("block shuffle (page cache, {t} threads)");
                let r = loader_run(
                    &ds_dir,
                    Order::Block,
                    &files,
                    u64::MAX,
                    false,
                    2,
                    t,
                    false,
                    false,
                )?;
                let r = keep(&label, r);
                tally.warm(Variant::F32, t, r.rate());
                rates.push(r.bytes_per_s);
            }
            // The bfloat16 rows at the same thread count, right after float32's.
            if let Some(b) = &bf16 {
                for &v in variants {
                    for _ in 0..rounds {
                        let label = format!("block shuffle, {} (page cache, {t} threads)", v.key());
                        let r = loader_run(
                            &b.dir,
                            Order::Block,
                            &b.files,
                            u64::MAX,
                            false,
                            2,
                            t,
                            false,
                            v.upcast(),
                        )?;
                        tally.warm(v, t, keep(&label, r).rate());
                    }
                }
            }
            let w = rates.iter().cloned().fold(0f64, f64::max);
            // The same with every block checked against the checksums sidecar (each pass).
            let mut verified = 0f64;
            for _ in 0..rounds {
                let label = format!("block shuffle, verified (page cache, {t} threads)");
                let r = loader_run(
                    &ds_dir,
                    Order::Block,
                    &files,
                    u64::MAX,
                    false,
                    2,
                    t,
                    true,
                    false,
                )?;
                verified = verified.max(keep(&label, r).bytes_per_s);
            }
            let verified_vs_unverified = ratio(
                &format!("verified vs unverified ({t} threads)"),
                verified,
                w,
            )?;
            let vs_memcpy = ratio(
                &format!("warm block ({t} threads) vs memory copy"),
                w,
                ceiling,
            )?;
            let vs_rows = ratio(
                &format!("warm block ({t} threads) vs 4 KiB row gather"),
                w,
                row_ceiling,
            )?;
            eprintln!(
                "warm block loader with verify, {t} threads: {:.2} GB/s ({verified_vs_unverified:.2} \
                 of unverified)",
                verified / 1e9,
            );
            eprintln!(
                "warm block loader, {t} threads: {:.2} GB/s; memory copy {:.2} GB/s ({:.2}); \
                 random 4 KiB rows {:.2} GB/s ({:.2})",
                w / 1e9,
                ceiling / 1e9,
                vs_memcpy,
                row_ceiling / 1e9,
                vs_rows
            );
            best(&mut warm, w);
            scaling.push(Value::Object(vec![
                ("threads".into(), Value::int(t as u64)),
                ("memcpy_bytes_per_s".into(), Value::float(ceiling, 0)),
                ("block_warm_bytes_per_s".into(), Value::float(w, 0)),
                ("block_warm_vs_memcpy".into(), Value::float(vs_memcpy, 3)),
                (
                    "row_gather_bytes_per_s".into(),
                    Value::float(row_ceiling, 0),
                ),
                ("block_warm_vs_row_gather".into(), Value::float(vs_rows, 3)),
                (
                    "block_warm_verified_bytes_per_s".into(),
                    Value::float(verified, 0),
                ),
                (
                    "verified_vs_unverified".into(),
                    Value::float(verified_vs_unverified, 3),
                ),
            ]));
        }
    }
    let max = |v: &[f64]| v.iter().cloned().fold(0f64, f64::max);
    let (seq, rnd) = (max(&seq_ways), max(&r4k));
    if let Some(p) = plot {
        crate::plot::draw(
            p,
            "shardkit saev loaders vs. disk ceilings",
            &series,
            &[
                ("sequential-read ceiling", seq),
                ("random 4 KiB ceiling", rnd),
            ],
        )?;
        eprintln!("plot written to {}", p.display());
    }
    let num = |x: f64| Value::float(x, 0);
    // A loader's ratio to its ceiling, where both were measured (`--only` can leave either
    // out: then no ratio is printed); a measured rate of zero is an error.
    let vs = |what: &str, x: &[f64], c: &[f64]| -> Result<Option<Value>> {
        if x.is_empty() || c.is_empty() {
            return Ok(None);
        }
        Ok(Some(Value::float(ratio(what, max(x), max(c))?, 3)))
    };
    let ratios: Vec<(String, Value)> = [
        (
            "ordered_ratio",
            vs("ordered vs sequential read", &ord, &seq_ways)?,
        ),
        (
            "block_ratio",
            vs("block vs sequential read", &blk, &seq_ways)?,
        ),
        ("exact_ratio", vs("exact vs random 4 KiB reads", &ex, &r4k)?),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
    .collect();
    let mut report = vec![
        ("bench".into(), Value::String("saev-read".into())),
        ("dir".into(), Value::String(ds_dir.display().to_string())),
        ("dataset_bytes".into(), Value::int(total)),
        (
            "shape".into(),
            Value::String(format!(
                "({examples}, 2, 257, 1024) float32; loaders read layer -1, content tokens"
            )),
        ),
        (
            "cores".into(),
            Value::int(std::thread::available_parallelism().map_or(1, |n| n.get()) as u64),
        ),
        ("rounds".into(), Value::int(rounds)),
        ("seq_ceiling_bytes_per_s".into(), num(seq)),
        (
            "seq_ceiling_ways_bytes_per_s".into(),
            Value::Object(
                ways_report
                    .iter()
                    .map(|(n, x)| (n.to_string(), num(*x)))
                    .collect(),
            ),
        ),
        ("rand4k_ceiling_bytes_per_s".into(), num(rnd)),
        ("ordered_bytes_per_s".into(), num(max(&ord))),
        ("block_bytes_per_s".into(), num(max(&blk))),
        ("exact_bytes_per_s".into(), num(max(&ex))),
        ("block_warm_bytes_per_s".into(), num(max(&warm))),
        ("block_warm_by_threads".into(), Value::Array(scaling)),
    ];
    report.extend(ratios);
    if let Some(b) = &bf16 {
        let dirs = [(Variant::F32, ds_dir.as_path(), total)];
        let mut dirs = dirs.to_vec();
        for &v in variants {
            dirs.push((v, b.dir.as_path(), b.bytes));
        }
        report.push((
            "precision".into(),
            tally.report(variants, seq, threads, &dirs)?,
        ));
    }
    Ok(Value::Object(report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_needs_two_measured_rates() {
        assert_eq!(ratio("x", 6.0, 2.0).unwrap(), 3.0);
        for (ours, theirs) in [
            (1.0, 0.0),
            (0.0, 1.0),
            (1.0, f64::NAN),
            (f64::INFINITY, 1.0),
        ] {
            let err = ratio("warm vs baseline", ours, theirs).unwrap_err();
            assert!(
                matches!(&err, Error::Invalid(m) if m.starts_with("warm vs baseline: no ratio")
                    && m.contains("a rate is missing, zero or not finite")),
                "{err:?}"
            );
        }
    }

    #[test]
    fn a_baseline_report_without_a_positive_rate_is_refused() {
        let v = json::parse(br#"{"samples_per_s": 12.5, "zero": 0, "text": "fast"}"#).unwrap();
        assert_eq!(baseline_rate("b", &v, "samples_per_s").unwrap(), 12.5);
        for key in ["zero", "text", "absent"] {
            let err = baseline_rate("the NeMo-style baseline", &v, key).unwrap_err();
            assert!(
                matches!(&err, Error::Invalid(m) if m.starts_with("the NeMo-style baseline: its report has no positive")
                    && m.contains(key)),
                "{err:?}"
            );
        }
    }

    #[test]
    fn a_baseline_must_report_the_same_sha256() {
        let ours = json::sha256_hex(b"batches");
        assert_eq!(Digest::default().hex(), json::sha256_hex(b""));
        let mut d = Digest::default();
        d.update(b"batch");
        d.update(b"es");
        assert_eq!(d.hex(), ours, "a running digest equals the one-shot one");
        same_bytes("b", "the batches", &ours, Some(&ours)).unwrap();
        let other = json::sha256_hex(b"other");
        let err = same_bytes("the baseline", "the batches", &ours, Some(&other)).unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(m) if m.contains("produced other bytes than shardkit for the batches")
                && m.contains(&other) && m.contains(&ours)),
            "{err:?}"
        );
        let err = same_bytes("the baseline", "the batches", &ours, None).unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(m) if m.contains("gives no sha256 of the batches")),
            "{err:?}"
        );
    }

    #[test]
    fn tree_digests_see_names_and_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for root in [&a, &b] {
            std::fs::create_dir_all(root.join("sub")).unwrap();
            std::fs::write(root.join("sub/x.bin"), b"12345").unwrap();
            std::fs::write(root.join("y.json"), b"{}").unwrap();
        }
        assert_eq!(tree_sha256(&a).unwrap(), tree_sha256(&b).unwrap());
        std::fs::write(b.join("sub/x.bin"), b"12346").unwrap();
        assert_ne!(tree_sha256(&a).unwrap(), tree_sha256(&b).unwrap());
        std::fs::write(b.join("sub/x.bin"), b"12345").unwrap();
        std::fs::rename(b.join("y.json"), b.join("z.json")).unwrap();
        assert_ne!(tree_sha256(&a).unwrap(), tree_sha256(&b).unwrap());
        let err = tree_sha256(&dir.path().join("none")).unwrap_err();
        assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    }
}
