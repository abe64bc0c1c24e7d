//! `shardkit saev ...`: validate, inspect, write, convert, export, get, synth.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::progress::{self, Unit};
use clap::{Args, Subcommand};
use shardkit::engine::{shuffle_quality, StateValue};
use shardkit::json::{self, Escape, Value};
use shardkit::precision;
use shardkit::saev::{
    self, inspect, validate, Dataset, LayerSel, Layout, Loader, LoaderOptions, LoaderState,
    Metadata, TokenMode, WriteStart, Writer, WriterOptions,
};
use shardkit::{Error, Result};

use crate::npy::{self, Dtype, NpyArray, NpzWriter};

/// Subcommands of `shardkit saev`.
#[derive(Subcommand)]
pub enum SaevCmd {
    /// Check a directory and list every problem; exit 0 only when it is valid.
    Validate {
        /// The dataset directory (the one holding metadata.json).
        dir: PathBuf,
        /// Also check every byte against the checksums sidecar, naming damaged byte ranges.
        #[arg(long)]
        deep: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Hash every file into the checksums sidecar (shardkit.checksums.json), for datasets
    /// written by other tools; `validate --deep` and loaders with verify then check them.
    Checksum {
        /// The dataset.
        path: PathBuf,
    },

    /// Summarise a directory: version, shapes, layers, counts, sizes, completeness, hash recipe
    /// (text; --json for JSON).
    Inspect {
        /// The dataset directory.
        dir: PathBuf,
        /// Print the summary as JSON (stable keys, for scripts).
        #[arg(long)]
        json: bool,
    },
    /// Write ROOT/<hash>/ from a metadata JSON file and .npy arrays; prints the directory.
    Write(WriteArgs),
    /// Convert a dataset to another dtype (float32 <-> bfloat16 / float16) as ROOT/<hash>/,
    /// streaming; prints the new directory. Run it again after a kill to resume.
    Convert {
        /// The dataset (a directory or an s3:// URL), complete.
        src: PathBuf,
        /// The dtype to store: float32 (f32, fp32), bfloat16 (bf16) or float16 (f16, fp16,
        /// half). float32 is what saev's own loaders read; reduced types need protocol 2.1.
        #[arg(long)]
        dtype: String,
        /// Root directory (or s3:// prefix); the dataset goes to ROOT/<hash of its metadata>/.
        #[arg(long)]
        out: PathBuf,
        /// Refuse a row whose relative L2 rounding error exceeds this, or that overflows
        /// (naming shard, example, layer and token); what was converted before it is kept.
        #[arg(long)]
        max_rel_error: Option<f64>,
    },
    /// Export the ordered stream of one layer as an .npz (act, example_idx, token_idx).
    Export {
        /// The dataset directory.
        dir: PathBuf,
        /// Recorded layer value (negative values are labels, e.g. -2).
        #[arg(long, allow_hyphen_values = true)]
        layer: i64,
        /// Which tokens: content, special (CLS) or all.
        #[arg(long, default_value = "content")]
        tokens: String,
        /// Output .npz path (written atomically).
        #[arg(long)]
        out: PathBuf,
        /// `act` as float32 (the default: bfloat16 and float16 widen exactly), or `stored`:
        /// float16 as '<f2'; bfloat16, which numpy has no type for, as its bits ('<u2')
        /// named `act_bf16_bits` (`.view(ml_dtypes.bfloat16)` reads them).
        #[arg(long, default_value = "float32")]
        dtype: String,
    },
    /// Print one vector as JSON (float32: a reduced dataset's values widened exactly).
    Get {
        /// The dataset directory.
        dir: PathBuf,
        /// Global example index.
        #[arg(long)]
        example: u64,
        /// Recorded layer value.
        #[arg(long, allow_hyphen_values = true)]
        layer: i64,
        /// Stored token slot (0 is CLS when the dataset has one).
        #[arg(long)]
        token: u64,
    },
    /// Make a synthetic dataset with coded values v[e,l,t,d] = 1000e + 100l + t + d/16.
    Synth(SynthCmd),
    /// Run a loader over one epoch (from a saved state) and write what it yields to an .npz:
    /// example_idx, token_idx (and act with --with-acts), plus the final state.
    Stream {
        /// The dataset directory.
        dir: PathBuf,
        #[command(flatten)]
        loader: LoaderArgs,
        /// Resume from a state JSON written by an earlier run (--state-out).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Output .npz.
        #[arg(long)]
        out: PathBuf,
        /// Also store the activations.
        #[arg(long)]
        with_acts: bool,
        /// Stop after this many batches (to simulate an interruption).
        #[arg(long)]
        max_batches: Option<u64>,
        /// Where to write the final state as JSON (default: OUT with .state.json).
        #[arg(long)]
        state_out: Option<PathBuf>,
    },
    /// Where a dataset written in parts (saev.PartWriter) stands: shards durable, missing,
    /// claimed by live ranks (and by whom), and what a restart would write.
    Status {
        /// The dataset directory.
        dir: PathBuf,
        #[command(flatten)]
        show: crate::parts_cmd::StatusArgs,
    },
    /// Measure shuffle quality of a loader's epoch (MosaicML entropy, distinct examples/batch).
    Quality {
        /// The dataset directory.
        dir: PathBuf,
        #[command(flatten)]
        loader: LoaderArgs,
    },
}

/// Loader options shared by `stream` and `quality`.
#[derive(Args, Clone)]
pub struct LoaderArgs {
    /// Recorded layer value, or "all".
    #[arg(long, allow_hyphen_values = true)]
    pub layer: String,
    /// content, special or all.
    #[arg(long, default_value = "content")]
    pub tokens: String,
    /// sequential, block or exact.
    #[arg(long, default_value = "block")]
    pub order: String,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Epoch.
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    /// Rows per batch on this rank.
    #[arg(long, default_value_t = 16384)]
    pub batch_size: u64,
    /// This rank (default $RANK or 0).
    #[arg(long)]
    pub rank: Option<u64>,
    /// Number of ranks (default $WORLD_SIZE or 1).
    #[arg(long)]
    pub world_size: Option<u64>,
    /// Drop the final partial global batch.
    #[arg(long)]
    pub drop_last: bool,
    /// Memory budget in MiB (default 1024).
    #[arg(long)]
    pub memory_budget_mib: Option<u64>,
    /// Skip content tokens with these labels (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub ignore_labels: Vec<u8>,
    /// Threads gathering rows into batches (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Reads in flight for O_DIRECT window reads.
    #[arg(long, default_value_t = 16)]
    pub io_threads: usize,
    /// Bypass the page cache: O_DIRECT reads into the loader's buffers (see the README).
    #[arg(long)]
    pub direct_io: bool,
}

impl LoaderArgs {
    /// The library options these arguments describe.
    pub fn options(&self) -> Result<LoaderOptions> {
        let mut o = LoaderOptions::new(self.layer.parse::<LayerSel>()?);
        o.tokens = self.tokens.parse()?;
        o.order = self.order.parse()?;
        o.seed = self.seed;
        o.epoch = self.epoch;
        o.batch_size = self.batch_size;
        o.rank = self.rank;
        o.world_size = self.world_size;
        o.drop_last = self.drop_last;
        o.memory_budget = self.memory_budget_mib.map(|m| m << 20);
        o.ignore_labels = self.ignore_labels.clone();
        o.threads = self.threads;
        o.io_threads = self.io_threads;
        o.direct_io = self.direct_io;
        Ok(o)
    }
}

/// Arguments of `saev write`.
#[derive(Args)]
pub struct WriteArgs {
    /// Root directory; the dataset goes to ROOT/<hash of metadata>/.
    #[arg(long)]
    out: PathBuf,
    /// metadata.json content as the caller has it (any key order); its protocol selects the
    /// version written (1.0.0, 2.0 or 2.1; default 2.1).
    #[arg(long)]
    metadata: PathBuf,
    /// float32 array of shape (n_examples, n_layers, tokens_per_example, d_model).
    #[arg(long)]
    acts: PathBuf,
    /// Optional uint8 array of shape (n_examples, content_tokens_per_example).
    #[arg(long)]
    labels: Option<PathBuf>,
    /// Continue an interrupted write of the same dataset.
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    store: DtypeArgs,
}

/// The stored type of a dataset being written (`saev write`, `saev synth`).
#[derive(Args, Clone, Default)]
pub struct DtypeArgs {
    /// Store float32 (the default), bfloat16 (bf16) or float16 (fp16, half): float32 input is
    /// rounded to nearest even, each shard's error recorded beside it. Reduced types need
    /// protocol 2.1, and saev's own loaders read float32 only.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Refuse a row whose relative L2 rounding error exceeds this, or that overflows.
    #[arg(long)]
    pub max_rel_error: Option<f64>,
}

impl DtypeArgs {
    /// The dtype asked for, if any (an unknown name: an error listing the accepted ones).
    pub fn dtype(&self) -> Result<Option<precision::Dtype>> {
        self.dtype
            .as_deref()
            .map(precision::Dtype::from_name)
            .transpose()
    }
}

/// Arguments of `saev synth`: the shape, and the stored type.
#[derive(Args)]
pub struct SynthCmd {
    #[command(flatten)]
    pub args: SynthArgs,
    #[command(flatten)]
    pub store: DtypeArgs,
}

/// Arguments of `saev synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Root directory of the dataset (or, with --npy, the folder for metadata.json/acts.npy).
    #[arg(long)]
    pub out: PathBuf,
    /// Number of examples.
    #[arg(long, default_value_t = 64)]
    pub examples: u64,
    /// Recorded layer values, comma-separated.
    #[arg(
        long,
        default_value = "-2,-1",
        allow_hyphen_values = true,
        value_delimiter = ','
    )]
    pub layers: Vec<i64>,
    /// Content tokens per example.
    #[arg(long, default_value_t = 256)]
    pub content_tokens: u64,
    /// Store no CLS token.
    #[arg(long)]
    pub no_cls: bool,
    /// Width.
    #[arg(long, default_value_t = 1024)]
    pub d_model: u64,
    /// Shard budget in vectors (default: about 256 MiB shards).
    #[arg(long)]
    pub budget: Option<u64>,
    /// Protocol to write.
    #[arg(long, default_value = "2.1")]
    pub protocol: String,
    /// Model family recorded in metadata.json (one saev accepts for the protocol).
    #[arg(long, default_value = "clip")]
    pub family: String,
    /// Checkpoint recorded in metadata.json.
    #[arg(long, default_value = "synthetic")]
    pub ckpt: String,
    /// Also write labels.bin with labels[e, c] = (10e + c) % 7.
    #[arg(long)]
    pub labels: bool,
    /// Write metadata.json, acts.npy (and labels.npy) into --out instead of a dataset.
    #[arg(long)]
    pub npy: bool,
    /// Continue an interrupted synthetic write.
    #[arg(long)]
    pub resume: bool,
}

pub fn run(cmd: SaevCmd) -> Result<bool> {
    match cmd {
        SaevCmd::Checksum { path } => crate::checksum_cmd::checksum(&path),
        SaevCmd::Validate { dir, deep, json } => {
            let mut report = validate(&dir);
            if deep {
                shardkit::checksum::verify_into(&dir, &mut report);
            }
            Ok(crate::checksum_cmd::print_report(&report, json, deep))
        }
        SaevCmd::Inspect { dir, json } => {
            let v = inspect(&dir)?;
            if json {
                println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
            } else {
                crate::inspect_text::print(&crate::saev_convert_cmd::precision_text(v, &dir));
            }
            Ok(true)
        }
        SaevCmd::Write(args) => write_cmd(args).map(|_| true),
        SaevCmd::Convert {
            src,
            dtype,
            out,
            max_rel_error,
        } => crate::saev_convert_cmd::convert(&src, &dtype, &out, max_rel_error).map(|_| true),
        SaevCmd::Export {
            dir,
            layer,
            tokens,
            out,
            dtype,
        } => {
            let stored = crate::saev_convert_cmd::export_stored(&dtype)?;
            export(&dir, layer, tokens.parse()?, &out, stored).map(|_| true)
        }
        SaevCmd::Get {
            dir,
            example,
            layer,
            token,
        } => {
            let ds = Dataset::open(&dir)?;
            let v = ds.get(example, layer, token)?;
            let text: Vec<String> = v.iter().map(|x| format!("{x:?}")).collect();
            println!("[{}]", text.join(", "));
            Ok(true)
        }
        SaevCmd::Stream {
            dir,
            loader,
            resume,
            out,
            with_acts,
            max_batches,
            state_out,
        } => stream_cmd(
            &dir,
            &loader,
            resume.as_deref(),
            &out,
            with_acts,
            max_batches,
            state_out,
        )
        .map(|_| true),
        SaevCmd::Quality { dir, loader } => quality_cmd(&dir, &loader).map(|_| true),
        SaevCmd::Status { dir, show } => show.run(
            &dir,
            "shard",
            || shardkit::saev::status(&dir),
            || shardkit::saev::commit_parts(&dir),
        ),
        SaevCmd::Synth(cmd) => synth_as(&cmd.args, &cmd.store).map(|p| {
            println!("{}", p.display());
            true
        }),
    }
}

/// Reads `bytes` (little-endian float32) as f32s, borrowing when aligned.
fn as_f32(bytes: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    if cfg!(target_endian = "little") && bytes.as_ptr().align_offset(4) == 0 {
        // SAFETY: aligned, length a multiple of 4 (checked by the caller's shapes), and every
        // bit pattern is a valid f32.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4)
        })
    } else {
        std::borrow::Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

/// The metadata file `path`, stored as `dtype` when given. `dtype` replaces a recorded
/// "float32" (every saev metadata.json records it), not another reduced type.
fn read_metadata(path: &Path, dtype: Option<precision::Dtype>) -> Result<Metadata> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let mut v = json::parse(&bytes).map_err(|e| Error::format(path, e.to_string()))?;
    if let Some(dtype) = dtype {
        let theirs = v.get("dtype").and_then(Value::as_str);
        if let Some(t) = theirs.filter(|t| {
            let t = precision::Dtype::parse(t);
            t != Some(dtype) && t != Some(precision::Dtype::F32)
        }) {
            return Err(Error::format(
                path,
                format!("records \"dtype\": {t:?}, but --dtype asks for {dtype}; drop one"),
            ));
        }
        v.set("dtype", Value::String(dtype.name().into()));
    }
    Metadata::for_writing(&v).map_err(|e| Error::format(path, e.to_string()))
}

fn write_cmd(args: WriteArgs) -> Result<()> {
    let md = read_metadata(&args.metadata, args.store.dtype()?)?;
    let layout = Layout::new(&md, Path::new("metadata.json"))?;
    let (n, l, t, d, p) = (
        layout.n_examples,
        layout.n_layers,
        layout.tokens,
        layout.d_model,
        layout.content_tokens,
    );
    if args.labels.is_some() && md.protocol().starts_with("1.") {
        // Refuse before anything is created, so the corrected command starts cleanly.
        return Err(Error::Invalid(
            "protocol 1.0.0 has no labels.bin (labels arrived with 1.1): write protocol 2.0 or \
             2.1 to store labels, or drop --labels"
                .into(),
        ));
    }
    let acts = NpyArray::open(&args.acts)?;
    if acts.dtype != Dtype::F32 || acts.shape != [n, l, t, d] {
        return Err(Error::format(
            &args.acts,
            format!(
                "must be float32 of shape ({n}, {l}, {t}, {d}) = (n_examples, layers, \
                 tokens_per_example, d_model) to match the metadata; found {:?} of shape {:?}",
                acts.dtype, acts.shape
            ),
        ));
    }
    let labels = match &args.labels {
        None => None,
        Some(path) => {
            let a = NpyArray::open(path)?;
            if a.dtype != Dtype::U8 || a.shape != [n, p] {
                return Err(Error::format(
                    path,
                    format!(
                        "must be uint8 of shape ({n}, {p}) = (n_examples, content tokens); \
                         found {:?} of shape {:?}",
                        a.dtype, a.shape
                    ),
                ));
            }
            Some(a)
        }
    };
    let mut w = Writer::create(
        &args.out,
        md,
        WriterOptions {
            resume: args.resume,
            max_rel_error: args.store.max_rel_error,
        },
    )?;
    match w.start() {
        WriteStart::AlreadyComplete => {
            eprintln!(
                "already complete: {} holds this dataset; nothing written",
                w.path().display()
            );
            println!("{}", w.path().display());
            return Ok(());
        }
        WriteStart::Resumed { from } => eprintln!("resuming at example {from} of {n}"),
        WriteStart::Fresh => {}
    }
    let eb = (l * t * d * 4) as usize;
    let batch = ((64usize << 20) / eb).max(1) as u64;
    let pb = progress::bar(Some(n * eb as u64), "writing", Unit::Bytes);
    pb.set_position(w.next_example() * eb as u64);
    let mut e = w.next_example();
    while e < n {
        let b = batch.min(n - e);
        let chunk = &acts.bytes()[e as usize * eb..(e + b) as usize * eb];
        let lab = labels
            .as_ref()
            .map(|a| &a.bytes()[(e * p) as usize..((e + b) * p) as usize]);
        w.write(&as_f32(chunk), lab)?;
        e += b;
        pb.set_position(e * eb as u64);
    }
    let path = w.finish()?;
    pb.finish_and_clear();
    println!("{}", path.display());
    Ok(())
}

/// Writes the `.npz` of `saev export`; `stored` keeps a reduced dataset's values as stored
/// (see [`crate::saev_convert_cmd::stored_array`]) instead of widening them to float32.
fn export(dir: &Path, layer: i64, mode: TokenMode, out: &Path, stored: bool) -> Result<()> {
    let ds = Dataset::open(dir)?;
    let view = ds.indexed(layer, mode)?;
    let layout = *ds.layout();
    let n = view.len();
    // The selected rows of one example: (stored token slot, reported token index), the same
    // for every example (the view's first rows are example 0's).
    let per = n / layout.n_examples;
    let tokens: Vec<(u64, i64)> = (0..per)
        .map(|j| view.locate(j).map(|(_, t, c)| (t, c)))
        .collect::<Result<_>>()?;
    let d = layout.d_model as usize;
    let (name, npy_type, size) = match stored {
        true => crate::saev_convert_cmd::stored_array(layout.dtype),
        false => ("act", Dtype::F32, 4),
    };
    let mut npz = NpzWriter::create(out)?;
    let tmp = npz.tmp().to_path_buf();
    let io = |e| Error::io(&tmp, e);
    let pb = progress::bar(Some(n * (d * size) as u64), "exporting", Unit::Bytes);
    {
        let w = npz.start(name, npy_type, &[n, d as u64])?;
        let mut slab = vec![0f32; (layout.tokens * layout.d_model) as usize];
        let slab_bytes = (layout.tokens * layout.d_model) as usize * layout.dtype.size();
        let mut raw = vec![0u8; if stored { slab_bytes } else { 0 }];
        let mut rows: Vec<u8> = Vec::with_capacity(per as usize * d * size);
        for e in 0..layout.n_examples {
            rows.clear();
            if stored {
                ds.read_slab_stored_into(e, layer, &mut raw)?;
                for &(t, _) in &tokens {
                    rows.extend_from_slice(
                        &raw[t as usize * d * size..(t as usize + 1) * d * size],
                    );
                }
            } else {
                ds.read_slab_into(e, layer, &mut slab)?;
                for &(t, _) in &tokens {
                    let v = &slab[t as usize * d..(t as usize + 1) * d];
                    rows.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                }
            }
            w.write_all(&rows).map_err(io)?;
            pb.inc(rows.len() as u64);
        }
    }
    let ints = |f: &dyn Fn(u64, u64) -> i64| -> Vec<u8> {
        (0..layout.n_examples)
            .flat_map(|e| (0..per).map(move |j| (e, j)))
            .flat_map(|(e, j)| f(e, j).to_le_bytes())
            .collect()
    };
    let example_idx = ints(&|e, _| e as i64);
    npz.start("example_idx", Dtype::I64, &[n])?
        .write_all(&example_idx)
        .map_err(io)?;
    let token_idx = ints(&|_, j| tokens[j as usize].1);
    npz.start("token_idx", Dtype::I64, &[n])?
        .write_all(&token_idx)
        .map_err(io)?;
    if ds.has_labels() {
        let mut labels = Vec::with_capacity(n as usize * 8);
        let mut row = vec![0u8; layout.content_tokens as usize];
        for e in 0..layout.n_examples {
            ds.read_labels_into(e, &mut row)?;
            for &(_, c) in &tokens {
                let v = if c >= 0 {
                    i64::from(row[c as usize])
                } else {
                    -1
                };
                labels.extend(v.to_le_bytes());
            }
        }
        npz.start("token_label", Dtype::I64, &[n])?
            .write_all(&labels)
            .map_err(io)?;
    }
    npz.finish()?;
    pb.finish_and_clear();
    eprintln!(
        "exported {n} rows of layer {layer} ({mode} tokens) to {}",
        out.display()
    );
    Ok(())
}

/// The synthetic metadata of `args`: what saev's own fake-data pipeline records, in each
/// protocol's form (`data` describes saev's `FakeImg`/`Fake` dataset of `examples` items; for
/// 2.1 the base64 pickle saev writes), so saev loads the result and, with the fixtures' shapes
/// and checkpoint, the directory equals the fixture byte for byte.
pub fn synth_metadata(args: &SynthArgs) -> Result<Metadata> {
    synth_metadata_as(args, precision::Dtype::F32)
}

/// [`synth_metadata`] of a dataset storing `dtype` (the same shards' examples: the default
/// budget counts float32 bytes, so `synth --dtype` writes what `synth` then `convert` does).
pub fn synth_metadata_as(args: &SynthArgs, dtype: precision::Dtype) -> Result<Metadata> {
    let t = args.content_tokens + u64::from(!args.no_cls);
    let per_example = t * args.layers.len() as u64;
    // Default budget: shards of about 256 MiB.
    let budget = args.budget.unwrap_or_else(|| {
        let eps = ((256u64 << 20) / (per_example * args.d_model * 4).max(1)).max(1);
        eps * per_example
    });
    let n = args.examples;
    let fake = |count_key: &str| {
        Value::Object(vec![
            (count_key.into(), Value::int(n)),
            ("__class__".into(), Value::String("Fake".into())),
        ])
    };
    let (data, extra): (Value, Vec<(&str, Value)>) = match args.protocol.as_str() {
        "1.0.0" => (fake("n_imgs"), vec![]),
        "2.0" => (
            fake("n_ex"),
            vec![
                ("dataset", Value::String("fake".into())),
                ("pixel_agg", Value::Null),
            ],
        ),
        _ => (
            Value::String(shardkit::saev::fake_dataset_data(n)),
            vec![
                ("dataset", Value::String("fake".into())),
                ("pixel_agg", Value::String("majority".into())),
            ],
        ),
    };
    let mut members: Vec<(String, Value)> = vec![
        ("family".into(), Value::String(args.family.clone())),
        ("ckpt".into(), Value::String(args.ckpt.clone())),
        (
            "layers".into(),
            Value::Array(args.layers.iter().map(|&l| Value::int(l)).collect()),
        ),
        (
            "content_tokens_per_example".into(),
            Value::int(args.content_tokens),
        ),
        ("cls_token".into(), Value::Bool(!args.no_cls)),
        ("d_model".into(), Value::int(args.d_model)),
        ("n_examples".into(), Value::int(n)),
        ("max_tokens_per_shard".into(), Value::int(budget)),
        ("data".into(), data),
    ];
    members.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
    if dtype.is_reduced() {
        members.push(("dtype".into(), Value::String(dtype.name().into())));
    }
    members.push(("protocol".into(), Value::String(args.protocol.clone())));
    Metadata::for_writing(&Value::Object(members))
}

/// Coded activations of examples `first..first+n` (C order (n, L, T, D)).
pub fn coded_block(first: u64, n: u64, l: u64, t: u64, d: u64, out: &mut Vec<f32>) {
    out.clear();
    for e in first..first + n {
        for li in 0..l {
            for ti in 0..t {
                let base = (1000 * e + 100 * li + ti) as f32;
                out.extend((0..d).map(|di| base + di as f32 / 16.0));
            }
        }
    }
}

fn coded_labels(first: u64, n: u64, p: u64) -> Vec<u8> {
    (first..first + n)
        .flat_map(|e| (0..p).map(move |c| ((10 * e + c) % 7) as u8))
        .collect()
}

/// Writes the synthetic dataset (or .npy inputs) of `args` and returns where it went.
pub fn synth(args: &SynthArgs) -> Result<PathBuf> {
    synth_as(args, &DtypeArgs::default())
}

/// [`synth`] storing the dtype `store` names (float32 by default), rounding the coded float32
/// values; with `--npy` the metadata records it and acts.npy stays float32 (what `saev write`
/// takes).
pub fn synth_as(args: &SynthArgs, store: &DtypeArgs) -> Result<PathBuf> {
    let md = synth_metadata_as(args, store.dtype()?.unwrap_or_default())?;
    let layout = Layout::new(&md, Path::new("metadata.json"))?;
    let (n, l, t, d, p) = (
        layout.n_examples,
        layout.n_layers,
        layout.tokens,
        layout.d_model,
        layout.content_tokens,
    );
    let eb = l * t * d * 4;
    let batch = ((32u64 << 20) / eb).max(1);
    let mut buf = Vec::new();
    if args.npy {
        std::fs::create_dir_all(&args.out).map_err(|e| Error::io(&args.out, e))?;
        let md_path = args.out.join("metadata.json");
        shardkit::fsutil::atomic_write(&md_path, &md.file_bytes())?;
        let acts_path = args.out.join("acts.npy");
        let tmp = shardkit::fsutil::temp_sibling(&acts_path);
        let mut f =
            std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
        f.write_all(&npy::header(Dtype::F32, &[n, l, t, d]))
            .map_err(|e| Error::io(&tmp, e))?;
        let mut e = 0;
        while e < n {
            let b = batch.min(n - e);
            coded_block(e, b, l, t, d, &mut buf);
            let bytes: Vec<u8> = buf.iter().flat_map(|x| x.to_le_bytes()).collect();
            f.write_all(&bytes).map_err(|e| Error::io(&tmp, e))?;
            e += b;
        }
        let f = f
            .into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
        shardkit::fsutil::publish(&tmp, &acts_path)?;
        if args.labels {
            npy::write_npy(
                &args.out.join("labels.npy"),
                Dtype::U8,
                &[n, p],
                &coded_labels(0, n, p),
            )?;
        }
        return Ok(args.out.clone());
    }
    let mut w = Writer::create(
        &args.out,
        md,
        WriterOptions {
            resume: args.resume,
            max_rel_error: store.max_rel_error,
        },
    )?;
    let pb = progress::bar(Some(n * eb), "writing", Unit::Bytes);
    let mut e = w.next_example();
    while e < n {
        let b = batch.min(n - e);
        coded_block(e, b, l, t, d, &mut buf);
        let labels = args.labels.then(|| coded_labels(e, b, p));
        w.write(&buf, labels.as_deref())?;
        e += b;
        pb.set_position(e * eb);
    }
    pb.finish_and_clear();
    w.finish()
}

/// A loader state as JSON: `{"seed", "epoch", "cursor", "global_batch_size"}` (the position),
/// then the parameters that decide the order (`order`, `layer`, `tokens`, `ignore_labels`,
/// `drop_last`, `memory_budget`, `window_blocks`, `rows`), the same keys as Python's.
pub fn state_json(st: &LoaderState) -> Value {
    let mut kv = vec![
        ("seed".into(), Value::int(st.seed)),
        ("epoch".into(), Value::int(st.epoch)),
    ];
    for (k, v) in &st.params {
        kv.push((
            k.clone(),
            match v {
                StateValue::UInt(x) => Value::int(*x),
                StateValue::Int(x) => Value::Number(x.to_string()),
                StateValue::Bool(b) => Value::Bool(*b),
                StateValue::Str(s) | StateValue::Other(s) => Value::String(s.clone()),
                StateValue::List(items) => {
                    Value::Array(items.iter().map(|&x| Value::int(x)).collect())
                }
            },
        ));
    }
    Value::Object(kv)
}

/// A state written by `saev stream` (the order's parameters are optional: older states have
/// only the position, and are checked on what they have).
fn read_state(path: &Path) -> Result<LoaderState> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let v = json::parse(&bytes).map_err(|e| Error::format(path, e.to_string()))?;
    let bad = |k: &str, what: &str| Error::format(path, format!("state key {k:?} must be {what}"));
    let opt = |k: &str| -> Result<Option<u64>> {
        match v.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_i64()
                .filter(|&x| x >= 0)
                .map(|x| Some(x as u64))
                .ok_or_else(|| bad(k, "a non-negative integer")),
        }
    };
    let field = |k: &str| {
        opt(k)?
            .ok_or_else(|| Error::format(path, format!("state needs a non-negative integer {k:?}")))
    };
    let mut st = saev::state_at(
        field("seed")?,
        field("epoch")?,
        field("cursor")?,
        field("global_batch_size")?,
    );
    let name = |k: &str| -> Result<Option<&str>> {
        match v.get(k) {
            None => Ok(None),
            Some(x) => x.as_str().map(Some).ok_or_else(|| bad(k, "a string")),
        }
    };
    for k in ["order", "tokens"] {
        if let Some(s) = name(k)? {
            // Checked here, as the loader would.
            if k == "order" {
                s.parse::<shardkit::engine::Order>()?;
            } else {
                s.parse::<TokenMode>()?;
            }
            st.set(k, StateValue::Str(s.into()));
        }
    }
    match v.get("layer") {
        None => {}
        Some(Value::String(s)) => {
            s.parse::<LayerSel>()?;
            st.set("layer", StateValue::Str(s.clone()));
        }
        Some(x) => st.set(
            "layer",
            StateValue::Int(
                x.as_i64()
                    .ok_or_else(|| bad("layer", "an integer or \"all\""))?,
            ),
        ),
    }
    match v.get("ignore_labels") {
        None => {}
        Some(Value::Array(items)) => {
            let labels = items
                .iter()
                .map(|x| {
                    x.as_i64()
                        .and_then(|x| u8::try_from(x).ok())
                        .map(u64::from)
                        .ok_or_else(|| bad("ignore_labels", "a list of integers 0-255"))
                })
                .collect::<Result<Vec<u64>>>()?;
            st.set("ignore_labels", StateValue::List(labels));
        }
        Some(_) => return Err(bad("ignore_labels", "a list of integers 0-255")),
    }
    match v.get("drop_last") {
        None => {}
        Some(Value::Bool(b)) => st.set("drop_last", StateValue::Bool(*b)),
        Some(_) => return Err(bad("drop_last", "true or false")),
    }
    for k in ["memory_budget", "window_blocks", "rows"] {
        if let Some(x) = opt(k)? {
            st.set(k, StateValue::UInt(x));
        }
    }
    Ok(st)
}

fn stream_cmd(
    dir: &Path,
    args: &LoaderArgs,
    resume: Option<&Path>,
    out: &Path,
    with_acts: bool,
    max_batches: Option<u64>,
    state_out: Option<PathBuf>,
) -> Result<()> {
    let mut loader = Loader::new(dir, args.options()?)?;
    if let Some(p) = resume {
        loader.load_state(read_state(p)?)?;
    }
    let d = loader.dataset().layout().d_model;
    let (mut ex, mut tok, mut acts) = (Vec::new(), Vec::new(), Vec::new());
    let mut n_batches = 0u64;
    for batch in loader
        .iter()?
        .take(max_batches.unwrap_or(u64::MAX) as usize)
    {
        let b = batch?;
        ex.extend(b.example_idx.iter().flat_map(|x| x.to_le_bytes()));
        tok.extend(b.token_idx.iter().flat_map(|x| x.to_le_bytes()));
        if with_acts {
            acts.extend(b.act.as_f32().iter().flat_map(|x| x.to_le_bytes()));
        }
        n_batches += 1;
    }
    let n = (ex.len() / 8) as u64;
    let st = loader.state();
    let mut npz = NpzWriter::create(out)?;
    let tmp = npz.tmp().to_path_buf();
    let io = |e| Error::io(&tmp, e);
    npz.start("example_idx", Dtype::I64, &[n])?
        .write_all(&ex)
        .map_err(io)?;
    npz.start("token_idx", Dtype::I64, &[n])?
        .write_all(&tok)
        .map_err(io)?;
    if with_acts {
        npz.start("act", Dtype::F32, &[n, d])?
            .write_all(&acts)
            .map_err(io)?;
    }
    let (cursor, global) = (
        st.uint("cursor")?.unwrap_or(0),
        st.uint("global_batch_size")?.unwrap_or(0),
    );
    let state_arr: Vec<u8> = [st.seed, st.epoch, cursor, global]
        .iter()
        .flat_map(|x| (*x as i64).to_le_bytes())
        .collect();
    npz.start("state", Dtype::I64, &[4])?
        .write_all(&state_arr)
        .map_err(io)?;
    npz.finish()?;
    let state_path = state_out.unwrap_or_else(|| out.with_extension("state.json"));
    let text = json::to_pretty(&state_json(&st), 2, Escape::Utf8);
    shardkit::fsutil::atomic_write(&state_path, text.as_bytes())?;
    eprintln!(
        "{n_batches} batches, {n} rows; state in {}",
        state_path.display()
    );
    println!(
        "{}",
        json::to_compact(&state_json(&st), false, Escape::Utf8)
    );
    Ok(())
}

fn quality_cmd(dir: &Path, args: &LoaderArgs) -> Result<()> {
    let loader = Loader::new(dir, args.options()?)?;
    let layout = *loader.dataset().layout();
    let (mut rows, mut examples) = (Vec::new(), Vec::new());
    for batch in loader.iter()? {
        let b = batch?;
        for (&e, &c) in b.example_idx.iter().zip(&b.token_idx) {
            // Storage-order row id: example-major, then token slot.
            let t = (c + i64::from(layout.cls)) as u64;
            rows.push(e as u64 * layout.tokens + t);
            examples.push(e as u64);
        }
    }
    let q = shuffle_quality(&rows, &examples, args.batch_size);
    let f = |x: f64| Value::float(x, 3);
    let v = Value::Object(vec![
        ("order".into(), Value::String(args.order.clone())),
        ("rows".into(), Value::int(q.rows)),
        ("batch_size".into(), Value::int(q.batch_size)),
        ("window_blocks".into(), Value::int(loader.window_blocks())),
        ("entropy_bits".into(), f(q.entropy_bits)),
        ("row_entropy_bits".into(), f(q.row_entropy_bits)),
        ("example_entropy_bits".into(), f(q.example_entropy_bits)),
        (
            "mean_distinct_examples_per_batch".into(),
            f(q.mean_distinct_examples_per_batch),
        ),
    ]);
    println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
    Ok(())
}
