//! `shardkit bench parts`: one saev dataset written by 1, 2, 4, ... writer processes
//! (`saev::PartWriter`, rank r of W each), against the disk's sequential write ceiling measured
//! in the same run, each run's dataset checked byte-identical to the 1-writer one; and the
//! commit time of a 1,000-shard dataset written in parts.
//!
//! Each writer is a child process (this binary's hidden `parts-rank` command), as ranks of a
//! `torchrun` job are: they share nothing but the dataset directory. A rank writes its pending
//! examples from a synthetic generator that costs one store per example (a fixed example with
//! its index stamped in its first value), so the writers, not the generator, are timed. The
//! ceiling is plain files written in 8 MiB writes and fsynced at the end, by one writer and by
//! as many writers (threads) as the run being compared, alternating with the runs.
//!
//! With `--url s3://bucket/prefix` the ranks write to the store instead (each shard a PUT, its
//! record a PUT, the commit's objects last), and the ceiling is the PUT ceiling: the same
//! bytes, as objects of the shard size, uploaded from page cache by one and by as many
//! concurrent uploads as the run has writers (`shardkit::upload`, the client the writers use).
//! Each run's committed dataset is downloaded and compared with the 1-writer one.
//! `scripts/bench_remote parts` starts a loopback server and runs this.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use shardkit::json::{self, Escape, Value};
use shardkit::saev::{self, Metadata, PartWriter};
use shardkit::{download, upload, Error, Rank, Result};

use crate::bench::{flush_page_cache, num, ratio, thread_counts, tree_sha256, vit_l};
use crate::saev_cmd::synth_metadata;

/// `shardkit bench parts`.
#[derive(Args)]
pub struct PartsBenchArgs {
    /// Directory to write into (a file system you care about); every run's data is removed.
    #[arg(long, default_value = "bench-data/parts")]
    dir: PathBuf,
    /// Dataset size in MiB (ViT-L-shaped examples: 2 layers x 257 tokens x 1024 floats).
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Shard size in MiB (whole examples; at least one). Ranks split the dataset by shards, so
    /// a dataset needs at least as many shards as writers to keep them all busy.
    #[arg(long, default_value_t = 16)]
    shard_mib: u64,
    /// Writer process counts (comma-separated; default 1, 2, 4 and the core count). 1 is
    /// always run, first: its dataset is the one the others must equal byte for byte.
    #[arg(long, value_delimiter = ',')]
    writers: Vec<usize>,
    /// Measured rounds (the best of each figure is reported).
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Shards of the commit-time dataset (one tiny example each).
    #[arg(long, default_value_t = 1000)]
    commit_shards: u64,
    /// Writer processes that write the commit-time dataset before its commit is timed.
    #[arg(long, default_value_t = 4)]
    commit_writers: u64,
    /// Write to this object store prefix (`s3://bucket/prefix`, endpoint and credentials from
    /// the AWS environment) against its PUT ceiling, instead of to `--dir` against the disk's.
    /// `--dir` then holds the ceiling's source files and the downloaded copies.
    #[arg(long)]
    url: Option<String>,
    /// Print JSON (always printed; kept for symmetry with other benches).
    #[arg(long)]
    json: bool,
}

/// `shardkit-bench parts-rank`: one writer process of `bench parts` (internal).
#[derive(Args)]
pub struct RankArgs {
    /// Root the dataset directory is made under.
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    rank: u64,
    #[arg(long)]
    world: u64,
    /// Examples in the dataset.
    #[arg(long)]
    examples: u64,
    /// Examples per shard.
    #[arg(long)]
    shard_examples: u64,
    /// `vit-l` (2 x 257 x 1024) or `tiny` (1 x 2 x 8).
    #[arg(long)]
    shape: String,
    /// Write the part and exit without finishing (the commit is timed on its own).
    #[arg(long)]
    no_finish: bool,
}

/// The saev metadata every rank of one run writes: `shape` examples, `shard_examples` a shard.
fn metadata(root: &Path, shape: &str, examples: u64, shard_examples: u64) -> Result<Metadata> {
    let mut args = vit_l(root.to_path_buf(), examples, false);
    match shape {
        "vit-l" => {}
        "tiny" => {
            args.layers = vec![-1];
            args.content_tokens = 1;
            args.d_model = 8;
        }
        other => {
            return Err(Error::Invalid(format!(
                "parts-rank --shape {other:?}: the shapes are vit-l and tiny"
            )))
        }
    }
    let vectors = args.layers.len() as u64 * (args.content_tokens + 1);
    args.budget = Some(shard_examples.max(1) * vectors);
    synth_metadata(&args)
}

fn epoch_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One rank: writes its pending examples, finishes (commits when it completes the set) and
/// prints one JSON line: its start and end (seconds since the epoch), its write and finish
/// seconds, the bytes it wrote and whether its finish committed the dataset.
pub fn rank(a: RankArgs) -> Result<()> {
    let md = metadata(&a.dir, &a.shape, a.examples, a.shard_examples)?;
    let layout = saev::Layout::new(&md, Path::new("metadata.json"))?;
    let ev = (layout.n_layers * layout.tokens * layout.d_model) as usize;
    // Example e is one fixed example with e in its first value: a store per example, and the
    // same bytes for e however the examples are batched, so any world size writes one dataset.
    let per_batch = (8usize << 20) / (ev * 4);
    let per_batch = per_batch.max(1);
    let one: Vec<f32> = (0..ev).map(|i| (i % 4093) as f32 / 8.0).collect();
    let mut batch = one.repeat(per_batch);
    let start = epoch_s();
    let t0 = Instant::now();
    let mut w = PartWriter::create(&a.dir, md, Rank::new(a.rank, a.world)?)?;
    let pending = w.pending().to_vec();
    let mut bytes = 0u64;
    for r in pending {
        let mut e = r.start;
        while e < r.end {
            let b = (per_batch as u64).min(r.end - e);
            for i in 0..b {
                batch[i as usize * ev] = (e + i) as f32;
            }
            w.write(&batch[..b as usize * ev], None)?;
            bytes += b * ev as u64 * 4;
            e += b;
        }
    }
    let write_s = t0.elapsed().as_secs_f64();
    let (finish_s, committed) = if a.no_finish {
        // Dropped: every shard of the part is durable; the claim goes with the process.
        drop(w);
        (0.0, false)
    } else {
        let t1 = Instant::now();
        let status = w.finish()?;
        (t1.elapsed().as_secs_f64(), status.committed)
    };
    let end = epoch_s();
    let line = Value::Object(vec![
        ("rank".into(), Value::int(a.rank)),
        ("start".into(), Value::float(start, 6)),
        ("end".into(), Value::float(end, 6)),
        ("write_s".into(), Value::float(write_s, 6)),
        ("finish_s".into(), Value::float(finish_s, 6)),
        ("bytes".into(), Value::int(bytes)),
        ("committed".into(), Value::Bool(committed)),
    ]);
    println!("{}", json::to_compact(&line, false, Escape::Utf8));
    Ok(())
}

/// What the ranks of one run reported.
struct RankReport {
    start: f64,
    end: f64,
    write_s: f64,
    bytes: u64,
    committed: bool,
}

fn field(v: &Value, key: &str) -> Result<f64> {
    match v.get(key) {
        Some(Value::Number(n)) => n.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| Error::Invalid(format!("parts-rank reported no number {key:?}: {v:?}")))
}

/// Runs `world` rank processes writing one dataset under `root`; their reports, rank order,
/// and the wall seconds from the first spawn to the last exit.
fn run_ranks(
    root: &Path,
    world: u64,
    shape: &str,
    examples: u64,
    shard_examples: u64,
    no_finish: bool,
) -> Result<(Vec<RankReport>, f64)> {
    let exe = std::env::current_exe().map_err(|e| Error::io(Path::new("current_exe"), e))?;
    let t0 = Instant::now();
    let mut children = Vec::new();
    for r in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.arg("parts-rank")
            .arg("--dir")
            .arg(root)
            .args(["--rank", &r.to_string(), "--world", &world.to_string()])
            .args(["--examples", &examples.to_string()])
            .args(["--shard-examples", &shard_examples.to_string()])
            .args(["--shape", shape])
            .stdout(Stdio::piped());
        if no_finish {
            cmd.arg("--no-finish");
        }
        children.push(cmd.spawn().map_err(|e| Error::io(&exe, e))?);
    }
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().map_err(|e| Error::io(&exe, e)))
        .collect::<Result<_>>()?;
    let wall = t0.elapsed().as_secs_f64();
    let mut reports = Vec::new();
    for (r, out) in outs.into_iter().enumerate() {
        if !out.status.success() {
            return Err(Error::Invalid(format!(
                "bench parts: writer rank {r} of {world} failed ({}; its error is above)",
                out.status
            )));
        }
        let v = json::parse(&out.stdout).map_err(|e| {
            Error::Invalid(format!("bench parts: rank {r}'s report is not JSON: {e}"))
        })?;
        reports.push(RankReport {
            start: field(&v, "start")?,
            end: field(&v, "end")?,
            write_s: field(&v, "write_s")?,
            bytes: field(&v, "bytes")? as u64,
            committed: v.get("committed") == Some(&Value::Bool(true)),
        });
    }
    Ok((reports, wall))
}

/// `writers` threads each writing `bytes / writers` to a plain file of its own in 8 MiB
/// writes, fsynced at the end; bytes/s from the start to the last fsync.
fn parallel_ceiling(dir: &Path, bytes: u64, writers: usize) -> Result<f64> {
    use std::io::Write;
    let writers = writers.max(1);
    let per = bytes.div_ceil(writers as u64);
    let paths: Vec<PathBuf> = (0..writers)
        .map(|i| dir.join(format!("ceiling-{i}.tmp")))
        .collect();
    flush_page_cache();
    let barrier = std::sync::Barrier::new(writers + 1);
    let t0 = std::sync::Mutex::new(Instant::now());
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = paths
            .iter()
            .map(|p| {
                let barrier = &barrier;
                s.spawn(move || -> Result<()> {
                    let chunk = vec![0x5au8; 8 << 20];
                    let mut f = std::fs::File::create(p).map_err(|e| Error::io(p, e))?;
                    barrier.wait();
                    let mut left = per;
                    while left > 0 {
                        let n = left.min(chunk.len() as u64) as usize;
                        f.write_all(&chunk[..n]).map_err(|e| Error::io(p, e))?;
                        left -= n as u64;
                    }
                    f.sync_all().map_err(|e| Error::io(p, e))
                })
            })
            .collect();
        barrier.wait();
        *t0.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("a ceiling writer panicked".into())))
            })
            .collect()
    });
    let secs = t0.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
    for r in results {
        r?;
    }
    for p in &paths {
        std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
    }
    Ok((per * writers as u64) as f64 / secs.as_secs_f64())
}

fn gb_list(v: &[f64]) -> Value {
    Value::Array(v.iter().map(|&x| num(x / 1e9)).collect())
}

fn remove_dir(p: &Path) -> Result<()> {
    match std::fs::remove_dir_all(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(p, e)),
        _ => Ok(()),
    }
}

/// What the writers are measured against, for messages.
fn target_name(store: &Option<String>) -> &'static str {
    match store {
        Some(_) => "store's PUT ceiling",
        None => "disk",
    }
}

/// The best of one writer count's rounds.
#[derive(Default)]
struct Best {
    seconds: f64,
    wall_s: f64,
    commit_s: f64,
    ceiling_1: f64,
    ceiling_w: f64,
    bytes: u64,
    sha256: String,
    /// Every round's rate and ceilings, bytes/s (the disk's speed varies from run to run).
    rates: Vec<f64>,
    ceilings_1: Vec<f64>,
    ceilings_w: Vec<f64>,
    /// Every round's dataset equalled the 1-writer one.
    identical: bool,
}

/// A ViT-L example's bytes (2 layers x 257 tokens x 1024 floats).
const EXAMPLE_BYTES: u64 = 2 * 257 * 1024 * 4;

/// `writers` concurrent uploads (`shardkit::upload`, the writers' client) of `bytes / writers`
/// each, as objects of `object` bytes read from page cache, to fresh prefixes under `url`;
/// bytes/s from the start to the last upload's end.
fn put_ceiling(
    dir: &Path,
    url: &str,
    tag: &str,
    bytes: u64,
    object: u64,
    writers: usize,
) -> Result<f64> {
    let writers = writers.max(1);
    let per = bytes.div_ceil(writers as u64);
    let src = dir.join("put-ceiling");
    remove_dir(&src)?;
    let chunk = vec![0x5au8; object.clamp(1, 64 << 20) as usize];
    let mut sources = Vec::new();
    for i in 0..writers {
        let d = src.join(i.to_string());
        std::fs::create_dir_all(&d).map_err(|e| Error::io(&d, e))?;
        let mut left = per;
        let mut k = 0;
        while left > 0 {
            let p = d.join(format!("object-{k:05}"));
            let n = left.min(object.max(1));
            let mut bytes = Vec::with_capacity(n as usize);
            while (bytes.len() as u64) < n {
                let take = (n as usize - bytes.len()).min(chunk.len());
                bytes.extend_from_slice(&chunk[..take]);
            }
            std::fs::write(&p, &bytes).map_err(|e| Error::io(&p, e))?;
            left -= n;
            k += 1;
        }
        sources.push(d);
    }
    let t0 = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let dst = PathBuf::from(format!("{url}/ceiling-{tag}-{writers}-{i}"));
                s.spawn(move || upload(d, &dst, |_, _| {}).map(|_| ()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("a ceiling upload panicked".into())))
            })
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    for r in results {
        r?;
    }
    remove_dir(&src)?;
    Ok((per * writers as u64) as f64 / secs)
}

pub fn run(a: PartsBenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir).map_err(|e| Error::io(&a.dir, e))?;
    let store = a
        .url
        .as_deref()
        .map(|u| u.trim_end_matches('/').to_string());
    if let Some(u) = &store {
        if !u.starts_with("s3://") {
            return Err(Error::Invalid(format!(
                "bench parts --url {u}: not an s3:// URL (s3://bucket/prefix)"
            )));
        }
    }
    let examples = ((a.size_mib << 20) / EXAMPLE_BYTES).max(1);
    let shard_examples = ((a.shard_mib << 20) / EXAMPLE_BYTES).max(1);
    let mut writers: Vec<usize> = if a.writers.is_empty() {
        let mut w = vec![1, 2, 4];
        w.extend(thread_counts().last());
        w
    } else {
        a.writers.clone()
    };
    writers.push(1);
    writers.retain(|&w| w > 0);
    writers.sort_unstable();
    writers.dedup();

    // The commit first, before the large runs leave the disk busy with their deletions.
    let commit = commit_bench(&a)?;

    let mut best: Vec<Best> = writers
        .iter()
        .map(|_| Best {
            identical: true,
            ..Best::default()
        })
        .collect();
    // The first 1-writer dataset's digest: every run's dataset must have it.
    let mut reference: Option<String> = None;
    let max_of = |a: &mut f64, x: f64| *a = a.max(x);
    for round in 0..a.rounds.max(1) {
        for (i, &w) in writers.iter().enumerate() {
            let root = match &store {
                Some(url) => PathBuf::from(format!("{url}/w{w}-r{round}")),
                None => a.dir.join(format!("w{w}")),
            };
            if store.is_none() {
                remove_dir(&root)?;
            }
            flush_page_cache();
            let (reports, wall) =
                run_ranks(&root, w as u64, "vit-l", examples, shard_examples, false)?;
            let first = reports.iter().map(|r| r.start).fold(f64::MAX, f64::min);
            let last = reports.iter().map(|r| r.end).fold(0.0, f64::max);
            if !reports.iter().any(|r| r.committed) {
                return Err(Error::Invalid(format!(
                    "bench parts: {w} ranks finished and none found the dataset committed"
                )));
            }
            // The commit: from the last shard durable (the last rank's write done) to the
            // dataset committed (the last rank's finish returned; a rank that finds another
            // committing waits for it).
            let durable = reports
                .iter()
                .map(|r| r.start + r.write_s)
                .fold(0.0, f64::max);
            let commit_s = last - durable;
            let bytes: u64 = reports.iter().map(|r| r.bytes).sum();
            let md = metadata(&root, "vit-l", examples, shard_examples)?;
            let b = &mut best[i];
            // Alternating with the runs, so drift hits both.
            let (sha, cw, c1) = match &store {
                None => {
                    let sha = tree_sha256(&root.join(md.dir_name()))?;
                    remove_dir(&root)?;
                    (
                        sha,
                        parallel_ceiling(&a.dir, bytes, w)?,
                        parallel_ceiling(&a.dir, bytes, 1)?,
                    )
                }
                Some(url) => {
                    let copy = a.dir.join("downloaded");
                    remove_dir(&copy)?;
                    download(&root.join(md.dir_name()), &copy, |_, _| {})?;
                    let sha = tree_sha256(&copy)?;
                    remove_dir(&copy)?;
                    let object = shard_examples * EXAMPLE_BYTES;
                    let tag = format!("w{w}-r{round}");
                    (
                        sha,
                        put_ceiling(&a.dir, url, &tag, bytes, object, w)?,
                        put_ceiling(&a.dir, url, &tag, bytes, object, 1)?,
                    )
                }
            };
            max_of(&mut b.ceiling_w, cw);
            max_of(&mut b.ceiling_1, c1);
            let seconds = last - first;
            b.rates.push(bytes as f64 / seconds);
            b.ceilings_1.push(c1);
            b.ceilings_w.push(cw);
            if round == 0 || seconds < b.seconds {
                b.seconds = seconds;
                b.wall_s = wall;
                b.commit_s = commit_s;
            }
            b.bytes = bytes;
            let reference = reference.get_or_insert_with(|| sha.clone());
            b.identical &= sha == *reference;
            b.sha256 = sha;
        }
    }
    let mut runs = Vec::new();
    let mut all_identical = true;
    for (b, &w) in best.iter().zip(&writers) {
        let rate = b.bytes as f64 / b.seconds;
        // The disk's ceiling is the best it did: 1 writer or as many as this run.
        let ceiling = b.ceiling_1.max(b.ceiling_w);
        let identical = b.identical;
        all_identical &= identical;
        runs.push(Value::Object(vec![
            ("writers".into(), Value::int(w as u64)),
            ("seconds".into(), num(b.seconds)),
            ("wall_s".into(), num(b.wall_s)),
            ("bytes".into(), Value::int(b.bytes)),
            ("gb_per_s".into(), num(rate / 1e9)),
            ("ceiling_1_writer_gb_per_s".into(), num(b.ceiling_1 / 1e9)),
            (
                "ceiling_same_writers_gb_per_s".into(),
                num(b.ceiling_w / 1e9),
            ),
            ("ceiling_gb_per_s".into(), num(ceiling / 1e9)),
            (
                "ratio".into(),
                num(ratio(
                    &format!("{w} part writers vs the {}", target_name(&store)),
                    rate,
                    ceiling,
                )?),
            ),
            ("commit_s".into(), num(b.commit_s)),
            ("runs_gb_per_s".into(), gb_list(&b.rates)),
            (
                "ceiling_1_writer_runs_gb_per_s".into(),
                gb_list(&b.ceilings_1),
            ),
            (
                "ceiling_same_writers_runs_gb_per_s".into(),
                gb_list(&b.ceilings_w),
            ),
            ("sha256".into(), Value::String(b.sha256.clone())),
            ("byte_identical_to_1_writer".into(), Value::Bool(identical)),
        ]));
    }

    let report = Value::Object(vec![
        ("bench".into(), Value::String("parts".into())),
        ("dir".into(), Value::String(a.dir.display().to_string())),
        (
            "target".into(),
            Value::String(store.clone().unwrap_or_else(|| "local disk".into())),
        ),
        (
            "cores".into(),
            Value::int(std::thread::available_parallelism().map_or(1, |n| n.get()) as u64),
        ),
        (
            "shape".into(),
            Value::String(format!("({examples}, 2, 257, 1024) float32")),
        ),
        ("examples_per_shard".into(), Value::int(shard_examples)),
        (
            "shards".into(),
            Value::int(examples.div_ceil(shard_examples)),
        ),
        ("rounds".into(), Value::int(a.rounds.max(1))),
        (
            "writers_are".into(),
            Value::String(
                "processes (this binary's parts-rank), rank r of W each; seconds = first rank's \
                 start to last rank's end, wall_s adds the spawns"
                    .into(),
            ),
        ),
        (
            "ratio_uses".into(),
            Value::String(match store {
                None => "ceiling_gb_per_s: the higher of the 1-writer and the same-writer-count \
                         sequential write ceilings (plain files, 8 MiB writes, fsync at the end)"
                    .into(),
                Some(_) => "ceiling_gb_per_s: the higher of the 1-upload and the \
                            same-writer-count PUT ceilings (the same bytes as shard-sized \
                            objects, uploaded from page cache with shardkit::upload); target \
                            ratio 0.8"
                    .into(),
            }),
        ),
        ("runs".into(), Value::Array(runs)),
        ("byte_identical".into(), Value::Bool(all_identical)),
        ("commit".into(), commit),
    ]);
    println!("{}", json::to_pretty(&report, 2, Escape::Utf8));
    if !all_identical {
        return Err(Error::Invalid(
            "bench parts: a run's dataset differs from the 1-writer dataset (see \
             byte_identical_to_1_writer)"
                .into(),
        ));
    }
    Ok(())
}

/// The commit of a dataset of `commit_shards` shards: each round, writer processes write one
/// tiny example per shard and exit without finishing, then `saev::commit_parts` commits alone,
/// timed; beside it, in the same round, the time to remove as many small fsynced files as the
/// commit removes records, one after another (what the cleanup costs done serially).
fn commit_bench(a: &PartsBenchArgs) -> Result<Value> {
    let root = a.dir.join("commit");
    let n = a.commit_shards.max(1);
    let world = a.commit_writers.max(1);
    let md = metadata(&root, "tiny", n, 1)?;
    let shards = saev::Layout::new(&md, Path::new("metadata.json"))?.n_shards;
    let dir = root.join(md.dir_name());
    let (mut commits, mut removes, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.rounds.max(1) {
        remove_dir(&root)?;
        let (_, write_s) = run_ranks(&root, world, "tiny", n, 1, true)?;
        flush_page_cache();
        let t0 = Instant::now();
        let status = saev::commit_parts(&dir)?;
        let commit_s = t0.elapsed().as_secs_f64();
        if !status.committed {
            return Err(Error::Invalid(format!(
                "bench parts: the {shards}-shard dataset did not commit ({} shards missing)",
                status.units - status.done.len() as u64
            )));
        }
        remove_dir(&root)?;
        removes.push(remove_small_files(&a.dir.join("unlink"), shards)?);
        commits.push(commit_s);
        writes.push(write_s);
    }
    let best = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
    let list = |v: &[f64]| Value::Array(v.iter().map(|&x| num(x)).collect());
    Ok(Value::Object(vec![
        ("shards".into(), Value::int(shards)),
        ("writers".into(), Value::int(world)),
        (
            "how".into(),
            Value::String(
                "writer processes write one tiny example per shard and exit without \
                 finishing; then saev::commit_parts commits alone, timed (it reads the shard \
                 records, writes the checksum sidecar and shards.json, then removes the \
                 records, several threads at once); remove_files_serial_s: removing as many small \
                 fsynced files one after another, same round (the file system's cost of the \
                 cleanup done serially)"
                    .into(),
            ),
        ),
        ("commit_s".into(), num(best(&commits))),
        ("commit_runs_s".into(), list(&commits)),
        ("remove_files_serial_s".into(), num(best(&removes))),
        ("remove_files_serial_runs_s".into(), list(&removes)),
        ("write_runs_s".into(), list(&writes)),
        ("target_s".into(), num(1.0)),
        ("committed".into(), Value::Bool(true)),
    ]))
}

/// Seconds to remove a directory of `n` small files, each written and fsynced as a shard's
/// record is, after a sync.
fn remove_small_files(dir: &Path, n: u64) -> Result<f64> {
    use std::io::Write;
    remove_dir(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    for i in 0..n {
        let p = dir.join(format!("{i:06}.json"));
        let mut f = std::fs::File::create(&p).map_err(|e| Error::io(&p, e))?;
        f.write_all(&[b' '; 160]).map_err(|e| Error::io(&p, e))?;
        f.sync_all().map_err(|e| Error::io(&p, e))?;
    }
    flush_page_cache();
    let t0 = Instant::now();
    remove_dir(dir)?;
    Ok(t0.elapsed().as_secs_f64())
}
