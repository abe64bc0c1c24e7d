//! `shardkit bench ...`: measurements, never tests. Each prints the ceiling it measured in the
//! same run next to the figure, so a ratio is never taken against a number from another day.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Subcommand;
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
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::SaevWrite {
            dir,
            size_mib,
            rounds,
            json: as_json,
        } => saev_write(&dir, size_mib, rounds.max(1), as_json),
    }
}

fn flush_page_cache() {
    // SAFETY: sync(2) has no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// Large sequential writes of `bytes` with one fsync at the end, as fast as the disk allows.
fn ceiling_run(path: &Path, bytes: u64) -> Result<f64> {
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
    let eb = md.layers().len() as u64 * md.tokens_per_example() * md.d_model();
    let n = md.n_examples();
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
    let args = SynthArgs {
        out: dir.to_path_buf(),
        examples: 0,
        layers: vec![-2, -1],
        content_tokens: 256,
        no_cls: false,
        d_model: 1024,
        budget: None,
        protocol: "2.1".into(),
        labels: false,
        npy: false,
        resume: false,
    };
    let example_bytes = 2 * 257 * 1024 * 4u64;
    let args = SynthArgs {
        examples: ((size_mib << 20) / example_bytes).max(1),
        ..args
    };
    let mut batch = Vec::new();
    coded_block(0, 32, 2, 257, 1024, &mut batch);
    let ceiling_file = dir.join("ceiling.tmp");
    let bytes = args.examples * example_bytes;

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
    let num = |x: f64| Value::Number(format!("{:.0}", x));
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
        ("ratio".into(), Value::Number(format!("{:.3}", w / c))),
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
