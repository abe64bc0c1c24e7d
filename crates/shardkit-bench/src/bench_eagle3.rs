//! `shardkit bench eagle3`: the shuffled EAGLE-3 loader against the disk's sequential-read
//! ceiling over the same shard files, and against a reader built the way NeMo's is
//! (`scripts/bench_eagle3_nemo.py`), all in the same run with the page cache evicted first.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use shardkit::eagle3::{Cache, Loader, LoaderOptions};
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

use crate::bench::{baseline_rate, evict, num, ratio, same_bytes, seq_read, Digest};
use crate::eagle3_cmd::{synth_cache, SynthArgs};

/// `shardkit bench eagle3`.
#[derive(Args)]
pub struct Eagle3BenchArgs {
    /// Directory for the synthetic cache (reused when already there).
    #[arg(long, default_value = "bench-data")]
    dir: PathBuf,
    /// Cache size in GiB (bf16, S = 512, H = 1024, draft vocabulary 8192: 11.5 MB a sample).
    #[arg(long, default_value_t = 4.0)]
    size_gib: f64,
    /// Samples per batch.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// Samples per shard.
    #[arg(long, default_value_t = 16)]
    shard_size: u64,
    /// Batches read ahead by the loader.
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    /// Thread counts of the warm loader, each beside a memory-copy ceiling with as many threads
    /// (comma-separated; default 1, 2, 4, ... and every core). Cold runs use every core.
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Python with safetensors, numpy and ml_dtypes for the NeMo-style baseline ("" skips it).
    #[arg(long, default_value = ".venv/bin/python")]
    python: String,
    /// Print JSON (always printed; kept for symmetry with other benches).
    #[arg(long)]
    json: bool,
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_shard))
        .map(|e| e.path())
        .collect();
    v.sort();
    Ok(v)
}

/// Whether a file name is exactly `shard-` + 6 digits + `.safetensors` (an EAGLE-3 shard).
fn is_shard(name: &str) -> bool {
    name.strip_prefix("shard-")
        .and_then(|n| n.strip_suffix(".safetensors"))
        .is_some_and(|d| d.len() == 6 && d.bytes().all(|b| b.is_ascii_digit()))
}

/// One pass of the shuffled loader over the epoch: (payload bytes/s, samples/s).
/// One epoch of the shuffled loader, after `warmup` unmeasured epochs of the same loader (as in
/// training, where one loader serves every epoch: its maps and buffers are made once).
fn loader_pass(
    cache: &Arc<Cache>,
    a: &Eagle3BenchArgs,
    threads: usize,
    warmup: u64,
) -> Result<(f64, f64, u64)> {
    let mut o = LoaderOptions::new(a.batch);
    (o.seed, o.rank, o.world_size) = (7, Some(0), Some(1));
    (o.prefetch, o.threads) = (a.prefetch, threads);
    let mut loader = Loader::new(cache.clone(), o)?;
    let per_sample = cache.manifest().sample_bytes().unwrap_or(0);
    for epoch in 0..warmup {
        loader.set_epoch(100 + epoch);
        for b in loader.iter() {
            std::hint::black_box(b?.data.len());
        }
    }
    loader.set_epoch(0);
    let t0 = Instant::now();
    let mut samples = 0u64;
    for b in loader.iter() {
        let b = b?;
        samples += b.indices.len() as u64;
        std::hint::black_box(b.data.len());
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok((
        (samples * per_sample) as f64 / secs,
        samples as f64 / secs,
        samples,
    ))
}

/// The SHA-256 of every batch of epoch 0 of the loader the NeMo-style baseline is given the
/// order of (seed 7, one rank), its fields in NeMo's collate order, batch
/// after batch: what the baseline must have read too (an unmeasured pass).
fn batches_sha256(cache: &Arc<Cache>, a: &Eagle3BenchArgs) -> Result<String> {
    let mut o = LoaderOptions::new(a.batch);
    (o.seed, o.rank, o.world_size) = (7, Some(0), Some(1));
    let mut loader = Loader::new(cache.clone(), o)?;
    loader.set_epoch(0);
    let mut digest = Digest::default();
    for b in loader.iter() {
        let b = b?;
        for f in &b.layout {
            digest.update(b.data.field(f));
        }
    }
    Ok(digest.hex())
}

pub fn run(a: Eagle3BenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir).map_err(|e| Error::io(&a.dir, e))?;
    let synth = SynthArgs {
        out: a.dir.join("eagle3-cache"),
        samples: 0,
        shard_size: a.shard_size,
        seq_length: 512,
        hidden: 1024,
        draft_vocab: 8192,
        dtype: "bf16".into(),
        topk: None,
        version: 2,
        resume: false,
    };
    let sample_bytes = 512 * 25 + 512 * 3072 * 2 + 512 * 8192 * 2;
    let samples = ((a.size_gib * (1u64 << 30) as f64) / sample_bytes as f64).ceil() as u64;
    let synth = SynthArgs { samples, ..synth };
    let mut writer_bps = None;
    let reuse = Cache::open(&synth.out)
        .map(|c| c.manifest().num_samples == samples && c.manifest().shard_size == a.shard_size)
        .unwrap_or(false);
    if !reuse {
        if synth.out.exists() {
            std::fs::remove_dir_all(&synth.out).map_err(|e| Error::io(&synth.out, e))?;
        }
        eprintln!("writing a synthetic cache of {samples} samples");
        let t0 = Instant::now();
        synth_cache(&synth)?;
        writer_bps = Some((samples * sample_bytes) as f64 / t0.elapsed().as_secs_f64());
    }
    let files = shard_files(&synth.out)?;
    let disk_bytes: u64 = files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();

    eprintln!("ceiling: sequential reads of the shard files");
    let buffered = seq_read(&files, 8 << 20, 8, false)?.unwrap_or(0.0);
    let direct = seq_read(&files, 8 << 20, 8, true)?.unwrap_or(0.0);
    let ceiling = buffered.max(direct);

    eprintln!("shuffled loader, cold then warm");
    let cache = Arc::new(Cache::open(&synth.out)?);
    for f in &files {
        evict(f)?;
    }
    let (cold_bps, cold_sps, n) = loader_pass(&cache, &a, 0, 0)?;
    let (warm_bps, warm_sps, _) = loader_pass(&cache, &a, 0, 1)?;
    let counts = if a.threads.is_empty() {
        crate::bench::thread_counts()
    } else {
        a.threads.clone()
    };
    let mut scaling = Vec::new();
    for &t in &counts {
        let ceiling = crate::bench::memcpy_ceiling(t);
        let (w, _, _) = loader_pass(&cache, &a, t, 1)?;
        let (w2, _, _) = loader_pass(&cache, &a, t, 1)?;
        let w = w.max(w2);
        eprintln!(
            "warm loader, {t} threads: {:.2} GB/s; memory copy {:.2} GB/s ({:.2})",
            w / 1e9,
            ceiling / 1e9,
            w / ceiling
        );
        scaling.push(Value::Object(vec![
            ("threads".into(), Value::int(t as u64)),
            ("memcpy_bytes_per_s".into(), num(ceiling)),
            ("loader_warm_bytes_per_s".into(), num(w)),
            (
                "loader_warm_vs_memcpy".into(),
                num(ratio(
                    &format!("warm loader ({t} threads) vs memory copy"),
                    w,
                    ceiling,
                )?),
            ),
        ]));
    }

    let mut fields = vec![
        ("samples".into(), Value::int(samples)),
        ("sample_bytes".into(), Value::int(sample_bytes)),
        ("shard_size".into(), Value::int(a.shard_size)),
        ("batch".into(), Value::int(a.batch)),
        ("bytes_on_disk".into(), Value::int(disk_bytes)),
        (
            "cores".into(),
            Value::int(std::thread::available_parallelism().map_or(1, |n| n.get()) as u64),
        ),
        ("seq_read_ceiling_bytes_per_s".into(), num(ceiling)),
        ("seq_read_buffered_bytes_per_s".into(), num(buffered)),
        ("seq_read_direct_bytes_per_s".into(), num(direct)),
        ("loader_cold_bytes_per_s".into(), num(cold_bps)),
        ("loader_cold_samples_per_s".into(), num(cold_sps)),
        (
            "loader_cold_vs_ceiling".into(),
            num(ratio("cold loader vs sequential read", cold_bps, ceiling)?),
        ),
        ("loader_warm_bytes_per_s".into(), num(warm_bps)),
        ("loader_warm_samples_per_s".into(), num(warm_sps)),
        ("samples_read".into(), Value::int(n)),
        ("loader_warm_by_threads".into(), Value::Array(scaling)),
    ];

    if !a.python.is_empty() {
        eprintln!("NeMo-style reader (safe_open + per-item slices + stacking), cold");
        let mut o = LoaderOptions::new(a.batch);
        (o.seed, o.rank, o.world_size) = (7, Some(0), Some(1));
        let order = Loader::new(cache.clone(), o)?.indices();
        let order_path = a.dir.join("bench-eagle3-order.npy");
        let bytes: Vec<u8> = order
            .iter()
            .flat_map(|&i| (i as i64).to_le_bytes())
            .collect();
        crate::npy::write_npy(
            &order_path,
            crate::npy::Dtype::I64,
            &[order.len() as u64],
            &bytes,
        )?;
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench_eagle3_nemo.py");
        let run_baseline = || -> Result<(Value, f64)> {
            let out = Command::new(&a.python)
                .arg(&script)
                .arg(&synth.out)
                .arg(&order_path)
                .arg(a.batch.to_string())
                .output()
                .map_err(|e| Error::io(&a.python, e))?;
            if !out.status.success() {
                return Err(Error::Invalid(format!(
                    "the NeMo-style baseline failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            let v = json::parse(&out.stdout)
                .map_err(|e| Error::Invalid(format!("baseline output: {e}")))?;
            let sps = baseline_rate("the NeMo-style baseline", &v, "samples_per_s")?;
            Ok((v, sps))
        };
        for f in &files {
            evict(f)?;
        }
        let cold = run_baseline();
        let warm = cold.as_ref().ok().map(|_| run_baseline());
        let _ = std::fs::remove_file(&order_path);
        let (cold_v, cold_theirs) = cold?;
        let (warm_v, warm_theirs) = warm.expect("ran after a successful cold run")?;
        // Both baseline runs must have read exactly the batches shardkit's loader serves.
        let ours = batches_sha256(&cache, &a)?;
        for (run, v) in [("cold", &cold_v), ("warm", &warm_v)] {
            same_bytes(
                &format!("the NeMo-style baseline ({run})"),
                "the epoch's batches",
                &ours,
                v.get("batches_sha256").and_then(Value::as_str),
            )?;
        }
        fields.push(("batches_sha256".into(), Value::String(ours)));
        fields.push(("nemo_style_reader_cold".into(), cold_v));
        fields.push(("nemo_style_reader_warm".into(), warm_v));
        fields.push((
            "speedup_cold_vs_nemo_style".into(),
            num(ratio("cold loader vs NeMo-style", cold_sps, cold_theirs)?),
        ));
        fields.push((
            "speedup_warm_vs_nemo_style".into(),
            num(ratio("warm loader vs NeMo-style", warm_sps, warm_theirs)?),
        ));
        fields.push((
            "nemo_style_cold_vs_ceiling".into(),
            num(ratio(
                "NeMo-style (cold) vs sequential read",
                cold_theirs * sample_bytes as f64,
                ceiling,
            )?),
        ));
    }
    if let Some(w) = writer_bps {
        fields.push(("writer_bytes_per_s".into(), num(w)));
    }
    println!(
        "{}",
        json::to_pretty(&Value::Object(fields), 2, Escape::Utf8)
    );
    Ok(())
}
