//! `shardkit bench tokens`: the flat-tokens loader against the disk, the codec and zarr-python,
//! all measured in the same run on the same synthetic dataset.
//!
//! Figures: time from opening the dataset to the first batch at random steps (page cache
//! evicted first), sustained tokens/s of packed batches (warm and cold), the same batches read
//! by zarr-python + numpy, the disk's sequential-read ceiling over the dataset's files and the
//! rate of a sequential scan through zarrs, and the writer's throughput (library, and
//! `tokens build` from JSONL).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Args;
use shardkit::flat_tokens::{Layout, LoaderOptions, Split, TokenLoader, Writer, WriterOptions};
use shardkit::internals::SplitMix64;
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

use crate::bench::{baseline_rate, evict, num, ratio, same_bytes, seq_read, Digest};

/// `shardkit bench tokens`.
#[derive(Args)]
pub struct TokensBenchArgs {
    /// Directory for the synthetic dataset (reused when already there).
    #[arg(long, default_value = "bench-data")]
    dir: PathBuf,
    /// Tokens in the dataset, in GiB of uint32 (1.0 = 2^28 tokens).
    #[arg(long, default_value_t = 1.0)]
    size_gib: f64,
    /// Layout of the dataset: v3 (sharded zstd) or v2 (seqax's).
    #[arg(long, default_value = "v3")]
    layout: String,
    /// Tokens per inner chunk of a v3 dataset (default: the writer's).
    #[arg(long)]
    chunk_tokens: Option<u64>,
    /// Tokens per row.
    #[arg(long, default_value_t = 2048)]
    seq_len: u64,
    /// Rows per step.
    #[arg(long, default_value_t = 16)]
    batch: u64,
    /// Steps timed for sustained throughput.
    #[arg(long, default_value_t = 2000)]
    steps: u64,
    /// Steps read by the zarr-python baseline (it is slow; its rate is per token).
    #[arg(long, default_value_t = 200)]
    python_steps: u64,
    /// Python with zarr-python 3 for the baseline ("" skips it).
    #[arg(long, default_value = ".venv/bin/python")]
    python: String,
    /// Tokens written as JSONL and built with `tokens build` (0 skips it), in millions.
    #[arg(long, default_value_t = 32)]
    build_mtokens: u64,
    /// Tokens of the corpus built from plain JSONL, zstd JSONL and Parquet (0 skips it), in
    /// millions.
    #[arg(long, default_value_t = 16)]
    corpus_mtokens: u64,
    /// Thread counts of the warm loader (each beside a memory-copy ceiling with as many
    /// threads) and of the corpus builds, comma-separated (default: 1, 2, 4, ... up to the
    /// cores, and the cores).
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Only the corpus builds (no loader dataset).
    #[arg(long)]
    corpus_only: bool,
    /// Print JSON (always printed; kept for symmetry with other benches).
    #[arg(long)]
    json: bool,
}

/// Ids spread log-uniformly over a GPT-2-sized vocabulary, so the data compresses about as
/// real token streams do (frequent small ids, a long tail).
fn synthetic_sequence(rng: &mut SplitMix64, max_len: u64) -> Vec<u32> {
    let len = rng.below(max_len) + 1;
    let ln_vocab = (50_257f64).ln();
    (0..len)
        .map(|_| {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            (u * ln_vocab).exp() as u32
        })
        .collect()
}

pub(crate) fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p);
                }
            }
        }
    }
    out
}

fn evict_all(files: &[PathBuf]) -> Result<()> {
    files.iter().try_for_each(|p| evict(p))
}

/// Writes the synthetic dataset unless a complete one of the right size is there; returns the
/// writer's tokens per second when it wrote.
pub(crate) fn ensure_dataset(root: &Path, layout: Layout, tokens: u64) -> Result<Option<f64>> {
    ensure_dataset_with(
        root,
        layout,
        tokens,
        WriterOptions::default().checkpoint_tokens,
    )
}

/// [`ensure_dataset`] committing every `checkpoint_tokens` tokens (a writer streaming to a
/// store uploads at each commit).
pub(crate) fn ensure_dataset_with(
    root: &Path,
    layout: Layout,
    tokens: u64,
    checkpoint_tokens: u64,
) -> Result<Option<f64>> {
    // Written in batches of at least BATCH_TOKENS tokens, sequences of at most MAX_SEQ: a
    // split holding what this call would write overshoots `tokens` by less than one batch. A
    // larger one (an earlier run's `--size-mib`) is written again: the figures are for the
    // size asked for.
    const BATCH_TOKENS: usize = 1 << 20;
    const MAX_SEQ: u64 = 4096;
    if let Ok(s) = Split::open(root, "train") {
        if (tokens..tokens + BATCH_TOKENS as u64 + MAX_SEQ).contains(&s.info().token_count) {
            return Ok(None);
        }
    }
    if root.exists() {
        std::fs::remove_dir_all(root).map_err(|e| Error::io(root, e))?;
    }
    let mut rng = SplitMix64(0x70c5);
    let t0 = Instant::now();
    let mut w = Writer::create(
        root,
        "train",
        WriterOptions {
            layout: Some(layout),
            checkpoint_tokens,
            ..Default::default()
        },
    )?;
    let mut batch = Vec::new();
    let mut gen_secs = 0.0;
    while w.info().token_count < tokens {
        let g = Instant::now();
        batch.clear();
        let mut n = 0;
        while n < BATCH_TOKENS {
            let s = synthetic_sequence(&mut rng, MAX_SEQ);
            n += s.len();
            batch.push(s);
        }
        gen_secs += g.elapsed().as_secs_f64();
        w.append(&batch)?;
    }
    let written = w.info().token_count;
    w.finish()?;
    Ok(Some(
        written as f64 / (t0.elapsed().as_secs_f64() - gen_secs),
    ))
}

/// `tokens build` from a JSONL file of `mtokens` million tokens: tokens per second, end to end.
fn build_from_jsonl(dir: &Path, mtokens: u64) -> Result<(f64, u64)> {
    let src = dir.join("build-input.jsonl");
    let mut rng = SplitMix64(0xb17d);
    let mut total = 0u64;
    {
        let f = std::fs::File::create(&src).map_err(|e| Error::io(&src, e))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        let mut line = String::new();
        while total < mtokens * 1_000_000 {
            let s = synthetic_sequence(&mut rng, 4096);
            total += s.len() as u64;
            line.clear();
            line.push('[');
            for (i, id) in s.iter().enumerate() {
                if i > 0 {
                    line.push_str(", ");
                }
                line.push_str(&id.to_string());
            }
            line.push_str("]\n");
            w.write_all(line.as_bytes())
                .map_err(|e| Error::io(&src, e))?;
        }
        w.flush().map_err(|e| Error::io(&src, e))?;
    }
    let out = dir.join("build-output.zarr");
    let _ = std::fs::remove_dir_all(&out);
    let exe = crate::bench::shardkit_exe()?;
    let t0 = Instant::now();
    let status = Command::new(exe)
        .args(["tokens", "build", "--split", "train", "--from"])
        .arg(&src)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| Error::io(&src, e))?;
    let secs = t0.elapsed().as_secs_f64();
    if !status.success() {
        return Err(Error::Invalid(format!("tokens build failed: {status}")));
    }
    let bytes = std::fs::metadata(&src).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&src);
    Ok((total as f64 / secs, bytes))
}

fn options(a: &TokensBenchArgs, seed: u64) -> LoaderOptions {
    let mut o = LoaderOptions::new(a.seq_len, a.batch);
    o.seed = seed;
    o
}

/// Tokens per second over `steps` steps from `start`, through the prefetching iterator.
fn sustained(loader: &TokenLoader, start: u64, steps: u64) -> Result<f64> {
    // One unmeasured step first: the loader's threads and buffers are started lazily.
    if let Some(b) = loader.iter(start).next() {
        b?;
    }
    let t0 = Instant::now();
    let mut tokens = 0u64;
    for b in loader.iter(start).take(steps as usize) {
        let b = b?;
        tokens += b.arrays().encoded.len() as u64;
        std::hint::black_box(b.arrays().inputs);
    }
    Ok(tokens as f64 / t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// 1, 2, 4, ... up to the cores, and the cores.
fn default_threads() -> Vec<usize> {
    let cores = num_cpus();
    let mut t: Vec<usize> = std::iter::successors(Some(1), |&n| Some(n * 2))
        .take_while(|&n| n < cores)
        .collect();
    t.push(cores);
    t
}

pub fn run(a: TokensBenchArgs) -> Result<()> {
    let mut layout: Layout = a.layout.parse()?;
    if let (Layout::V3(sharded), Some(c)) = (&mut layout, a.chunk_tokens) {
        sharded.tokens_per_chunk = c;
    }
    std::fs::create_dir_all(&a.dir).map_err(|e| Error::io(&a.dir, e))?;
    let threads = if a.threads.is_empty() {
        default_threads()
    } else {
        a.threads.clone()
    };
    if a.corpus_only {
        let v = crate::bench_corpus::run(&a.dir, a.corpus_mtokens.max(1), &threads)?;
        let fields = vec![
            ("cores".into(), Value::int(num_cpus() as u64)),
            ("corpus".into(), v),
        ];
        println!(
            "{}",
            json::to_pretty(&Value::Object(fields), 2, Escape::Utf8)
        );
        return Ok(());
    }
    let tokens = (a.size_gib * (1u64 << 28) as f64) as u64;
    let root = match (&layout, a.chunk_tokens) {
        (Layout::V3(s), Some(_)) => a.dir.join(format!("tokens-v3-{}.zarr", s.tokens_per_chunk)),
        _ => a.dir.join(format!("tokens-{}.zarr", a.layout)),
    };
    eprintln!(
        "dataset: {} ({} M tokens)",
        root.display(),
        tokens / 1_000_000
    );
    let writer_tps = ensure_dataset(&root, layout, tokens)?;
    let files = files_under(&root);
    let disk_bytes: u64 = files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let split = Split::open(&root, "train")?;
    let token_count = split.info().token_count;
    drop(split);

    eprintln!("ceilings: sequential read of the files, and a sequential scan through zarrs");
    let seq_ceiling = seq_read(&files, 8 << 20, 8, false)?.unwrap_or(0.0);
    let split = Split::open(&root, "train")?;
    let t0 = Instant::now();
    let mut at = 0;
    while at < token_count {
        let end = (at + (1 << 24)).min(token_count);
        std::hint::black_box(split.encoded(at..end)?);
        at = end;
    }
    let bulk_decode = token_count as f64 / t0.elapsed().as_secs_f64();
    drop(split);

    // Time to the first batch at a random step, cold: open, plan, read.
    eprintln!("first batch at random steps (page cache evicted before each)");
    let mut rng = SplitMix64(0xf157);
    let mut cold_ms = Vec::new();
    let mut warm_ms = Vec::new();
    let mut step_count = 0;
    for round in 0..7 {
        let seed = rng.next_u64() % 1000;
        evict_all(&files)?;
        let t0 = Instant::now();
        let loader = TokenLoader::new(Split::open(&root, "train")?, options(&a, seed))?;
        step_count = loader.info().step_count;
        let step = rng.below(step_count);
        std::hint::black_box(loader.load(step)?);
        let cold = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let loader = TokenLoader::new(Split::open(&root, "train")?, options(&a, seed))?;
        std::hint::black_box(loader.load(step)?);
        let warm = t1.elapsed().as_secs_f64() * 1e3;
        if round > 0 {
            // Round 0 warms the binary and the allocator.
            cold_ms.push(cold);
            warm_ms.push(warm);
        }
    }

    eprintln!("sustained packed batches of {} x {}", a.batch, a.seq_len);
    let loader = TokenLoader::new(Split::open(&root, "train")?, options(&a, 17))?;
    let steps = a.steps.min(step_count);
    let start = rng.below(step_count - steps + 1);
    // Cold first (after eviction), then warm over the same steps.
    evict_all(&files)?;
    let cold_tps = sustained(&loader, start, steps)?;
    let warm_tps = sustained(&loader, start, steps)?;
    // The warm loader at each thread count, beside a memory copy with as many threads; a batch
    // writes 18 bytes per token (encoded, targets, inputs, segment ids, two flags).
    let mut scaling = Vec::new();
    for &t in &threads {
        let mut o = options(&a, 17);
        o.threads = t;
        let l = TokenLoader::new(Split::open(&root, "train")?, o)?;
        let tps = sustained(&l, start, steps)?.max(sustained(&l, start, steps)?);
        let ceiling = crate::bench::memcpy_ceiling(t);
        eprintln!(
            "warm loader, {t} threads: {:.1} M tokens/s ({:.2} GB/s of batch); memory copy {:.2} \
             GB/s; bulk decode {:.1} M tokens/s",
            tps / 1e6,
            tps * 18.0 / 1e9,
            ceiling / 1e9,
            bulk_decode / 1e6
        );
        scaling.push(Value::Object(vec![
            ("threads".into(), Value::int(t as u64)),
            ("loader_warm_tokens_per_s".into(), num(tps)),
            ("loader_warm_batch_bytes_per_s".into(), num(tps * 18.0)),
            ("memcpy_bytes_per_s".into(), num(ceiling)),
            (
                "loader_warm_vs_memcpy".into(),
                num(ratio(
                    &format!("warm loader ({t} threads) vs memory copy"),
                    tps * 18.0,
                    ceiling,
                )?),
            ),
            (
                "loader_warm_vs_bulk_decode".into(),
                num(ratio(
                    &format!("warm loader ({t} threads) vs bulk decode"),
                    tps,
                    bulk_decode,
                )?),
            ),
        ]));
    }

    let mut fields: Vec<(String, Value)> = vec![
        ("layout".into(), Value::String(a.layout.clone())),
        ("token_count".into(), Value::int(token_count)),
        ("bytes_on_disk".into(), Value::int(disk_bytes)),
        ("seq_len".into(), Value::int(a.seq_len)),
        ("batch".into(), Value::int(a.batch)),
        ("step_count".into(), Value::int(step_count)),
        ("steps_timed".into(), Value::int(steps)),
        ("cores".into(), Value::int(num_cpus() as u64)),
        ("seq_read_ceiling_bytes_per_s".into(), num(seq_ceiling)),
        (
            "seq_read_ceiling_tokens_per_s".into(),
            num(seq_ceiling * token_count as f64 / disk_bytes.max(1) as f64),
        ),
        // Whole shards decoded in order: what a full scan (e.g. validation) achieves; CPU-bound
        // in the codec on small machines.
        ("bulk_decode_tokens_per_s".into(), num(bulk_decode)),
        (
            "first_batch_cold_ms_median".into(),
            num(median(cold_ms.clone())),
        ),
        (
            "first_batch_cold_ms_max".into(),
            num(cold_ms.iter().copied().fold(0.0, f64::max)),
        ),
        ("first_batch_warm_ms_median".into(), num(median(warm_ms))),
        ("loader_cold_tokens_per_s".into(), num(cold_tps)),
        ("loader_warm_tokens_per_s".into(), num(warm_tps)),
        (
            "loader_warm_vs_bulk_decode".into(),
            num(ratio("warm loader vs bulk decode", warm_tps, bulk_decode)?),
        ),
        ("loader_warm_by_threads".into(), Value::Array(scaling)),
    ];

    if !a.python.is_empty() {
        eprintln!("zarr-python + numpy over the same batches");
        let py_steps = a.python_steps.min(steps);
        let rows_path = a.dir.join("bench-tokens-rows.npy");
        let mut rows = Vec::new();
        for s in start..start + py_steps {
            rows.extend(loader.sequences(s)?.into_iter().map(|r| r as i64));
        }
        let bytes: Vec<u8> = rows.iter().flat_map(|r| r.to_le_bytes()).collect();
        crate::npy::write_npy(
            &rows_path,
            crate::npy::Dtype::I64,
            &[py_steps, a.batch],
            &bytes,
        )?;
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench_tokens_zarr.py");
        let out = Command::new(&a.python)
            .arg(&script)
            .arg(&root)
            .arg("train")
            .arg(&rows_path)
            .arg(a.seq_len.to_string())
            .output()
            .map_err(|e| Error::io(&a.python, e))?;
        let _ = std::fs::remove_file(&rows_path);
        if !out.status.success() {
            return Err(Error::Invalid(format!(
                "the zarr-python baseline failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let v = json::parse(&out.stdout)
            .map_err(|e| Error::Invalid(format!("baseline output: {e}")))?;
        let theirs = baseline_rate("the zarr-python baseline", &v, "tokens_per_s")?;
        // Both ways of reading must have decoded exactly the targets of every step it timed
        // (int32, little-endian, step after step), as shardkit's loader does.
        let mut digest = Digest::default();
        for s in start..start + py_steps {
            for t in loader.load(s)?.arrays().targets {
                digest.update(&t.to_le_bytes());
            }
        }
        let ours_sha = digest.hex();
        for k in ["per_row", "coords"] {
            same_bytes(
                &format!("the zarr-python baseline ({k})"),
                &format!("the targets of steps {start} to {}", start + py_steps - 1),
                &ours_sha,
                v.get(k)
                    .and_then(|x| x.get("targets_sha256"))
                    .and_then(Value::as_str),
            )?;
        }
        fields.push(("targets_sha256".into(), Value::String(ours_sha)));
        fields.push(("zarr_python".into(), v));
        fields.push(("zarr_python_tokens_per_s".into(), num(theirs)));
        fields.push((
            "speedup_warm_vs_zarr_python".into(),
            num(ratio("warm loader vs zarr-python", warm_tps, theirs)?),
        ));
    }
    if let Some(tps) = writer_tps {
        fields.push(("writer_tokens_per_min".into(), num(tps * 60.0)));
    }
    if a.build_mtokens > 0 {
        eprintln!("tokens build from {} M tokens of JSONL", a.build_mtokens);
        let (tps, bytes) = build_from_jsonl(&a.dir, a.build_mtokens)?;
        fields.push(("build_jsonl_bytes".into(), Value::int(bytes)));
        fields.push(("build_jsonl_tokens_per_min".into(), num(tps * 60.0)));
    }
    if a.corpus_mtokens > 0 {
        let v = crate::bench_corpus::run(&a.dir, a.corpus_mtokens, &threads)?;
        fields.push(("corpus".into(), v));
    }
    println!(
        "{}",
        json::to_pretty(&Value::Object(fields), 2, Escape::Utf8)
    );
    Ok(())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
