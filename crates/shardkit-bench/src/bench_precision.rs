//! The reduced-precision part of `bench saev-read`: a bfloat16 dataset of the same rows beside
//! the float32 one, read by the same loaders in the same run (cold and warm), so that rows per
//! second can be compared between the two on one disk, and bytes per second against the
//! sequential-read ceiling measured in that run.

use std::path::{Path, PathBuf};

use shardkit::json::Value;
use shardkit::precision::Dtype;
use shardkit::saev::{Dataset, Metadata, Writer, WriterOptions};
use shardkit::{Error, Result};

use crate::bench::ratio;
use crate::saev_cmd::{coded_block, SynthArgs};

/// The targets (issue 37): cold block-shuffled rows/s of bfloat16 against float32, its
/// bytes/s against the sequential-read ceiling, and warm rows/s against float32.
const COLD_ROWS_TARGET: f64 = 1.8;
const COLD_CEILING_TARGET: f64 = 0.85;
const WARM_ROWS_TARGET: f64 = 1.5;

/// A dataset variant the bench reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The float32 dataset (always measured: the baseline).
    F32,
    /// The bfloat16 dataset, rows served as stored (2 bytes a value).
    Bf16,
    /// The bfloat16 dataset widened to float32 by the loader (`LoaderOptions.upcast`): what a
    /// user training in float32 reads.
    Bf16Upcast,
}

impl Variant {
    /// The JSON key of this variant.
    pub fn key(self) -> &'static str {
        match self {
            Variant::F32 => "float32",
            Variant::Bf16 => "bfloat16",
            Variant::Bf16Upcast => "bfloat16_upcast",
        }
    }
    /// Whether the loader widens the rows.
    pub fn upcast(self) -> bool {
        self == Variant::Bf16Upcast
    }
    /// The variants named by `--dtypes` (bf16, bf16-upcast; "none" for neither).
    pub fn parse_list(names: &[String]) -> Result<Vec<Variant>> {
        let mut out = Vec::new();
        for n in names {
            let v = match n.trim().to_ascii_lowercase().as_str() {
                "bf16" | "bfloat16" => Some(Variant::Bf16),
                "bf16-upcast" | "bfloat16-upcast" | "bfloat16_upcast" => Some(Variant::Bf16Upcast),
                "none" | "" => None,
                other => {
                    return Err(Error::Invalid(format!(
                        "--dtypes: unknown variant {other:?} (bf16, bf16-upcast or none)"
                    )))
                }
            };
            if let Some(v) = v {
                if !out.contains(&v) {
                    out.push(v);
                }
            }
        }
        Ok(out)
    }
}

/// The bfloat16 dataset beside the float32 one: where, and its shard files.
pub struct Beside {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub bytes: u64,
}

/// Writes (or reuses) the bfloat16 dataset of the rows of `args` (the float32 one's metadata
/// with `dtype` bfloat16, so a directory of its own beside it), and checks on a few rows that it
/// holds the float32 dataset's rows rounded to nearest even: a ratio between two datasets of
/// different rows would compare nothing.
pub fn bf16_beside(args: &SynthArgs, md: &Metadata, f32_ds: &Dataset) -> Result<Beside> {
    let md = md.with_dtype(Dtype::BF16)?;
    let dir = args.out.join(md.dir_name());
    if Dataset::open(&dir).is_err() {
        eprintln!(
            "writing the bfloat16 benchmark dataset (same rows) to {}",
            dir.display()
        );
        write_rows(&args.out, md)?;
    }
    let ds = Dataset::open(&dir)?;
    same_rows(f32_ds, &ds)?;
    let l = ds.layout();
    let files = (0..l.n_shards)
        .map(|s| ds.path().join(format!("acts{s:06}.bin")))
        .collect();
    let bytes = l.examples_per_shard * l.n_layers * l.tokens * l.d_model * 2 * l.n_shards;
    Ok(Beside { dir, files, bytes })
}

/// The rows `saev synth` writes (the same generator, the same batches), through a writer of
/// `md`'s dtype: the writer rounds them.
fn write_rows(root: &Path, md: Metadata) -> Result<()> {
    let layout = shardkit::saev::Layout::new(&md, Path::new("metadata.json"))?;
    let (n, l, t, d) = (
        layout.n_examples,
        layout.n_layers,
        layout.tokens,
        layout.d_model,
    );
    let batch = ((32u64 << 20) / (l * t * d * 4)).max(1);
    let mut w = Writer::create(
        root,
        md,
        WriterOptions {
            resume: true,
            ..Default::default()
        },
    )?;
    let mut buf = Vec::new();
    let mut e = w.next_example();
    while e < n {
        let b = batch.min(n - e);
        coded_block(e, b, l, t, d, &mut buf);
        w.write(&buf, None)?;
        e += b;
    }
    w.finish()?;
    Ok(())
}

/// Checks the first and last rows of the first and last examples of layer -1: the bfloat16
/// dataset's values are the float32 dataset's rounded to nearest even.
fn same_rows(f32_ds: &Dataset, bf16_ds: &Dataset) -> Result<()> {
    let (a, b) = (f32_ds.layout(), bf16_ds.layout());
    if (a.n_examples, a.n_layers, a.tokens, a.d_model)
        != (b.n_examples, b.n_layers, b.tokens, b.d_model)
    {
        return Err(Error::Invalid(format!(
            "{}: the bfloat16 benchmark dataset has another shape than the float32 one at {} \
             (remove it and rerun)",
            bf16_ds.path().display(),
            f32_ds.path().display()
        )));
    }
    let last = a.n_examples - 1;
    for (e, tok) in [(0, 0), (0, a.tokens - 1), (last, 0), (last, a.tokens - 1)] {
        let wide = f32_ds.get(e, -1, tok)?;
        let want = shardkit::precision::decoded(
            Dtype::BF16,
            &shardkit::precision::encoded(Dtype::BF16, &wide),
        );
        let got = bf16_ds.get(e, -1, tok)?;
        if got
            .iter()
            .map(|x| x.to_bits())
            .ne(want.iter().map(|x| x.to_bits()))
        {
            return Err(Error::Invalid(format!(
                "{}: example {e}, layer -1, token {tok} is not the float32 dataset's row \
                 rounded to bfloat16 (remove the bfloat16 dataset and rerun)",
                bf16_ds.path().display()
            )));
        }
    }
    Ok(())
}

/// The read ceiling of the block loader's pattern: the last layer's slab of every example (what
/// a loader of layer -1 reads: runs of T·D values at the stored width, separated by the other
/// layers' slabs), in file order, `inflight` buffered reads at a time after eviction; bytes/s.
/// Beside the sequential ceiling it separates what the pattern costs on this disk from what the
/// loader costs.
pub fn layer_read(ds: &Dataset, inflight: usize) -> Result<f64> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let l = *ds.layout();
    let slab = l.tokens * l.d_model * l.value_bytes();
    let mut files = Vec::new();
    for s in 0..l.n_shards {
        let p = ds.path().join(format!("acts{s:06}.bin"));
        crate::bench::evict(&p)?;
        files.push(std::fs::File::open(&p).map_err(|e| Error::io(&p, e))?);
    }
    let jobs: Vec<(usize, u64)> = (0..l.n_examples)
        .map(|g| {
            let row = g % l.examples_per_shard;
            let at = (row * l.n_layers + l.n_layers - 1) * slab;
            ((g / l.examples_per_shard) as usize, at)
        })
        .collect();
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let t0 = std::time::Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..inflight.max(1) {
            sc.spawn(|| {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; slab as usize];
                while let Some(&(f, at)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if files[f].read_exact_at(&mut buf, at).is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    if failed.into_inner() {
        return Err(Error::Invalid(format!(
            "{}: a shard read failed while measuring the layer-read ceiling",
            ds.path().display()
        )));
    }
    Ok((jobs.len() as u64 * slab) as f64 / t0.elapsed().as_secs_f64())
}

/// One measurement of a loader: rows and stored bytes per second.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    pub rows_per_s: f64,
    pub bytes_per_s: f64,
    /// Cores the process kept busy during the pass (CPU seconds per wall second): near the core
    /// count, the pass was CPU-bound; well below it, it waited on the disk.
    pub cores_busy: f64,
}

impl Rate {
    fn best(v: &[Rate]) -> Rate {
        v.iter().copied().fold(Rate::default(), |a, b| {
            if b.rows_per_s > a.rows_per_s {
                b
            } else {
                a
            }
        })
    }
}

/// Every measurement of each variant in one run.
#[derive(Default)]
pub struct Tally {
    /// Cold block-shuffled runs, per variant.
    cold: Vec<(Variant, Vec<Rate>)>,
    /// Warm block-shuffled runs, per variant and gather thread count.
    warm: Vec<(Variant, usize, Vec<Rate>)>,
    /// The layer-read ceiling of each dataset (float32, bfloat16), every round.
    layer: Vec<(Dtype, Vec<f64>)>,
}

impl Tally {
    pub fn cold(&mut self, v: Variant, r: Rate) {
        match self.cold.iter_mut().find(|(w, _)| *w == v) {
            Some((_, runs)) => runs.push(r),
            None => self.cold.push((v, vec![r])),
        }
    }
    pub fn layer_ceiling(&mut self, dtype: Dtype, bytes_per_s: f64) {
        match self.layer.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, runs)) => runs.push(bytes_per_s),
            None => self.layer.push((dtype, vec![bytes_per_s])),
        }
    }
    fn best_layer(&self, dtype: Dtype) -> Option<f64> {
        self.layer
            .iter()
            .find(|(d, _)| *d == dtype)
            .map(|(_, r)| r.iter().cloned().fold(0f64, f64::max))
    }
    pub fn warm(&mut self, v: Variant, threads: usize, r: Rate) {
        match self
            .warm
            .iter_mut()
            .find(|(w, t, _)| *w == v && *t == threads)
        {
            Some((_, _, runs)) => runs.push(r),
            None => self.warm.push((v, threads, vec![r])),
        }
    }
    fn cold_runs(&self, v: Variant) -> &[Rate] {
        self.cold
            .iter()
            .find(|(w, _)| *w == v)
            .map_or(&[], |(_, r)| &r[..])
    }
    fn best_cold(&self, v: Variant) -> Option<Rate> {
        self.cold
            .iter()
            .find(|(w, _)| *w == v)
            .map(|(_, r)| Rate::best(r))
    }
    fn best_warm_at(&self, v: Variant, threads: usize) -> Option<Rate> {
        self.warm
            .iter()
            .find(|(w, t, _)| *w == v && *t == threads)
            .map(|(_, _, r)| Rate::best(r))
    }
    /// The best warm rate of `v` over every thread count.
    fn best_warm(&self, v: Variant) -> Option<Rate> {
        let all: Vec<Rate> = self
            .warm
            .iter()
            .filter(|(w, _, _)| *w == v)
            .flat_map(|(_, _, r)| r.iter().copied())
            .collect();
        (!all.is_empty()).then(|| Rate::best(&all))
    }

    /// The `precision` object of the report: per variant rows/s and GB/s, cold and warm, the
    /// ratios to float32 and to the sequential-read ceiling `seq` (0: not measured), and the
    /// issue's targets with whether this run met them.
    pub fn report(
        &self,
        variants: &[Variant],
        seq: f64,
        threads: &[usize],
        dirs: &[(Variant, &Path, u64)],
    ) -> Result<Value> {
        let f = |x: f64, p: usize| Value::float(x, p);
        let mut out = Vec::new();
        let base_cold = self.best_cold(Variant::F32);
        let base_warm = self.best_warm(Variant::F32);
        let mut all = vec![Variant::F32];
        all.extend(variants.iter().copied().filter(|v| *v != Variant::F32));
        // (cold rows ratio, cold bytes vs ceiling, warm rows ratio) of the bfloat16 variant.
        let mut bf16 = (None, None, None);
        for v in all {
            let mut kv: Vec<(String, Value)> = Vec::new();
            if let Some((_, dir, bytes)) = dirs.iter().find(|(w, _, _)| *w == v) {
                kv.push(("dir".into(), Value::String(dir.display().to_string())));
                kv.push(("dataset_bytes".into(), Value::int(*bytes)));
            }
            kv.push((
                "stored_value_bytes".into(),
                Value::int(if v == Variant::F32 { 4 } else { 2 }),
            ));
            kv.push(("upcast".into(), Value::Bool(v.upcast())));
            if let Some(c) = self.best_cold(v) {
                kv.push(("cold_block_rows_per_s".into(), f(c.rows_per_s, 0)));
                kv.push(("cold_block_bytes_per_s".into(), f(c.bytes_per_s, 0)));
                kv.push(("cold_block_gb_per_s".into(), f(c.bytes_per_s / 1e9, 3)));
                kv.push(("cold_block_cores_busy".into(), f(c.cores_busy, 2)));
                let dtype = if v == Variant::F32 {
                    Dtype::F32
                } else {
                    Dtype::BF16
                };
                if let Some(lc) = self.best_layer(dtype) {
                    kv.push(("layer_read_ceiling_gb_per_s".into(), f(lc / 1e9, 3)));
                    let r = ratio(
                        &format!("{} cold block vs layer-read ceiling", v.key()),
                        c.bytes_per_s,
                        lc,
                    )?;
                    kv.push(("cold_block_bytes_vs_layer_ceiling".into(), f(r, 3)));
                }
                // Every round (the best is reported above): a virtual disk's speed drifts.
                let runs = self.cold_runs(v);
                kv.push((
                    "cold_block_runs_rows_per_s".into(),
                    Value::Array(runs.iter().map(|r| f(r.rows_per_s, 0)).collect()),
                ));
                if seq > 0.0 {
                    let r = ratio(
                        &format!("{} cold block vs sequential read", v.key()),
                        c.bytes_per_s,
                        seq,
                    )?;
                    kv.push(("cold_block_bytes_vs_seq_ceiling".into(), f(r, 3)));
                    if v == Variant::Bf16 {
                        bf16.1 = Some(r);
                    }
                }
                if let (Some(b), true) = (base_cold, v != Variant::F32) {
                    let r = ratio(
                        &format!("{} vs float32 cold rows", v.key()),
                        c.rows_per_s,
                        b.rows_per_s,
                    )?;
                    kv.push(("cold_rows_vs_float32".into(), f(r, 3)));
                    if v == Variant::Bf16 {
                        bf16.0 = Some(r);
                    }
                }
            }
            if let Some(w) = self.best_warm(v) {
                kv.push(("warm_block_rows_per_s".into(), f(w.rows_per_s, 0)));
                kv.push(("warm_block_gb_per_s".into(), f(w.bytes_per_s / 1e9, 3)));
                if let (Some(b), true) = (base_warm, v != Variant::F32) {
                    let r = ratio(
                        &format!(
                            "{} vs float32 warm rows (best thread count of each)",
                            v.key()
                        ),
                        w.rows_per_s,
                        b.rows_per_s,
                    )?;
                    kv.push(("warm_rows_vs_float32".into(), f(r, 3)));
                    if v == Variant::Bf16 {
                        bf16.2 = Some(r);
                    }
                }
                let mut by = Vec::new();
                for &t in threads {
                    let Some(r) = self.best_warm_at(v, t) else {
                        continue;
                    };
                    let mut e = vec![
                        ("threads".into(), Value::int(t as u64)),
                        ("rows_per_s".into(), f(r.rows_per_s, 0)),
                        ("gb_per_s".into(), f(r.bytes_per_s / 1e9, 3)),
                        ("cores_busy".into(), f(r.cores_busy, 2)),
                    ];
                    if let (Some(b), true) = (self.best_warm_at(Variant::F32, t), v != Variant::F32)
                    {
                        let x = ratio(
                            &format!("{} vs float32 warm rows ({t} threads)", v.key()),
                            r.rows_per_s,
                            b.rows_per_s,
                        )?;
                        e.push(("rows_vs_float32".into(), f(x, 3)));
                    }
                    by.push(Value::Object(e));
                }
                kv.push(("warm_by_threads".into(), Value::Array(by)));
            }
            out.push((v.key().to_string(), Value::Object(kv)));
        }
        let target = |what: &str, want: f64, got: Option<f64>| {
            (
                what.to_string(),
                Value::Object(vec![
                    ("target".into(), f(want, 2)),
                    ("measured".into(), got.map_or(Value::Null, |x| f(x, 3))),
                    (
                        "met".into(),
                        got.map_or(Value::Null, |x| Value::Bool(x >= want)),
                    ),
                ]),
            )
        };
        out.push((
            "targets".into(),
            Value::Object(vec![
                target("bf16_cold_rows_vs_float32", COLD_ROWS_TARGET, bf16.0),
                target(
                    "bf16_cold_bytes_vs_seq_ceiling",
                    COLD_CEILING_TARGET,
                    bf16.1,
                ),
                target("bf16_warm_rows_vs_float32", WARM_ROWS_TARGET, bf16.2),
            ]),
        ));
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_and_unknown_names_are_refused() {
        let names = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            Variant::parse_list(&names(&["bf16", "BF16-upcast", "bf16"])).unwrap(),
            vec![Variant::Bf16, Variant::Bf16Upcast]
        );
        assert!(Variant::parse_list(&names(&["none"])).unwrap().is_empty());
        let err = Variant::parse_list(&names(&["fp8"])).unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(m) if m.contains("unknown variant \"fp8\"")),
            "{err:?}"
        );
    }

    #[test]
    fn the_report_takes_ratios_against_float32_and_the_ceiling() {
        let mut t = Tally::default();
        let r = |rows: f64, bytes: f64| Rate {
            rows_per_s: rows,
            bytes_per_s: bytes,
            cores_busy: 1.0,
        };
        t.cold(Variant::F32, r(100.0, 400.0));
        t.cold(Variant::F32, r(120.0, 480.0));
        t.cold(Variant::Bf16, r(200.0, 400.0));
        t.warm(Variant::F32, 1, r(1000.0, 4000.0));
        t.warm(Variant::F32, 2, r(1500.0, 6000.0));
        t.warm(Variant::Bf16, 1, r(1400.0, 2800.0));
        t.warm(Variant::Bf16, 2, r(2400.0, 4800.0));
        let v = t.report(&[Variant::Bf16], 500.0, &[1, 2], &[]).unwrap();
        let get = |path: &[&str]| {
            let mut x = &v;
            for p in path {
                x = x.get(p).unwrap_or_else(|| panic!("no {p} in {path:?}"));
            }
            x.clone()
        };
        let num = |path: &[&str]| match get(path) {
            Value::Number(n) => n.parse::<f64>().unwrap(),
            other => panic!("{path:?} is {other:?}"),
        };
        // Best of the rounds: 120 rows/s for float32; 200 / 120 for bfloat16.
        assert_eq!(num(&["bfloat16", "cold_rows_vs_float32"]), 1.667);
        assert_eq!(num(&["bfloat16", "cold_block_bytes_vs_seq_ceiling"]), 0.8);
        assert_eq!(num(&["bfloat16", "warm_rows_vs_float32"]), 1.6);
        assert_eq!(num(&["float32", "cold_block_bytes_vs_seq_ceiling"]), 0.96);
        assert_eq!(
            get(&["targets", "bf16_cold_rows_vs_float32", "met"]),
            Value::Bool(false)
        );
        assert_eq!(
            get(&["targets", "bf16_warm_rows_vs_float32", "met"]),
            Value::Bool(true)
        );
        match get(&["bfloat16", "warm_by_threads"]) {
            Value::Array(a) => {
                assert_eq!(a.len(), 2);
                assert_eq!(a[0].get("rows_vs_float32"), Some(&Value::float(1.4, 3)));
            }
            other => panic!("{other:?}"),
        }
        // A zero rate is an error, never a ratio.
        let mut z = Tally::default();
        z.cold(Variant::F32, r(0.0, 0.0));
        z.cold(Variant::Bf16, r(10.0, 20.0));
        let err = z.report(&[Variant::Bf16], 500.0, &[], &[]).unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(m) if m.contains("float32 cold block vs sequential read: no ratio")),
            "{err:?}"
        );
    }
}
