//! `shardkit eagle3 ...`: EAGLE-3 offline caches (NeMo Automodel).

use std::path::{Path, PathBuf};

use crate::progress::{self, Unit};
use clap::{Args, Subcommand};
use memmap2::Mmap;
use shardkit::eagle3::{
    self, read_header, synthetic_sample, Schema, WeightTable, Writer, WriterOptions,
};
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

/// Subcommands of `shardkit eagle3`.
#[derive(Subcommand)]
pub enum Eagle3Cmd {
    #[command(flatten)]
    Common(CacheCmd),
    /// Switch a cache between format_version 1 and 2 by rewriting only its manifest.
    SetVersion {
        /// The cache directory.
        dir: PathBuf,
        /// 1 or 2 (a top-k cache can only be 2).
        version: u8,
    },
    /// Write a cache from safetensors batch files holding the stored tensors, [b, ...] each.
    Write(WriteArgs),
    /// Write a synthetic cache of valid, deterministic samples (for tests and benchmarks).
    Synth(SynthArgs),
}

/// The subcommands every cache of NeMo's offline-cache family has (`shardkit eagle3 ...`,
/// `shardkit dspark ...`): the library's functions are the family's, whatever the member.
#[derive(Subcommand)]
pub enum CacheCmd {
    /// Hash every file into the checksums sidecar (shardkit.checksums.json), for caches
    /// written by other tools (NeMo's producers); `validate --deep` and loaders with verify
    /// then check them.
    Checksum {
        /// The cache directory.
        path: PathBuf,
    },
    /// Check a cache: manifest (DSpark: and its `complete` marker), shard set, headers, shapes
    /// and dtypes, the target weights file (--deep: every value, and every byte against the
    /// checksums sidecar).
    Validate {
        /// The cache directory.
        dir: PathBuf,
        /// Also read every tensor: NaN/Inf, masks, ids, probability rows summing to 1, indices.
        #[arg(long)]
        deep: bool,
        /// Print {"valid", "errors", "notes"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Summarise a cache: configuration, input identity, sizes and completeness (text;
    /// --json for JSON).
    Inspect {
        /// The cache directory.
        dir: PathBuf,
        /// Print the summary as JSON (stable keys, for scripts).
        #[arg(long)]
        json: bool,
    },
    /// Where a cache written in parts (PartWriter ranks, or NeMo's distributed DSpark
    /// producer) stands: shards durable, missing, claimed by live ranks (and by whom), the
    /// target weights if still owed, and what a restart would write.
    Status {
        /// The cache directory.
        dir: PathBuf,
        #[command(flatten)]
        show: crate::parts_cmd::StatusArgs,
    },
}

/// Runs one of the family's common subcommands.
pub fn run_common(cmd: CacheCmd) -> Result<bool> {
    match cmd {
        CacheCmd::Checksum { path } => crate::checksum_cmd::checksum(&path),
        CacheCmd::Validate { dir, deep, json } => Ok(crate::checksum_cmd::print_report(
            &eagle3::validate(&dir, deep),
            json,
            deep,
        )),
        CacheCmd::Inspect { dir, json } => {
            let v = eagle3::inspect(&dir)?;
            if json {
                println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
            } else {
                crate::inspect_text::print(&v);
            }
            Ok(true)
        }
        CacheCmd::Status { dir, show } => show.run(
            &dir,
            "shard",
            || eagle3::status(&dir),
            || eagle3::commit_parts(&dir),
        ),
    }
}

/// `shardkit eagle3 write`.
#[derive(Args)]
pub struct WriteArgs {
    /// The cache directory.
    #[arg(long)]
    pub out: PathBuf,
    /// The run configuration (JSON object with the keys NeMo's producer writes).
    #[arg(long)]
    pub manifest: PathBuf,
    /// format_version to write: 1 (default) or 2.
    #[arg(long, default_value_t = 1)]
    pub version: u8,
    /// Continue a cache that already has shards (its first samples are skipped in the input).
    #[arg(long)]
    pub resume: bool,
    /// A safetensors file whose `weight` (F32 [V, H]) becomes target_embeddings.safetensors.
    #[arg(long)]
    pub embeddings: Option<PathBuf>,
    /// Batch files in sample order: safetensors with input_ids, attention_mask, loss_mask,
    /// aux_hidden_states, position_mask and target_probs (or the top-k pair), each [b, ...].
    #[arg(required = true)]
    pub from: Vec<PathBuf>,
}

/// `shardkit eagle3 synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// The cache directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Samples (num_samples).
    #[arg(long)]
    pub samples: u64,
    /// Samples per shard.
    #[arg(long, default_value_t = 16)]
    pub shard_size: u64,
    /// Tokens per sample (seq_length).
    #[arg(long, default_value_t = 512)]
    pub seq_length: u64,
    /// The target's hidden size H (aux_hidden_dim is 3H).
    #[arg(long, default_value_t = 1024)]
    pub hidden: u64,
    /// Draft vocabulary size.
    #[arg(long, default_value_t = 8192)]
    pub draft_vocab: u64,
    /// bf16, fp16 or fp32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Store top-k target_probs (needs --version 2).
    #[arg(long)]
    pub topk: Option<u64>,
    /// format_version: 1 (default) or 2.
    #[arg(long, default_value_t = 1)]
    pub version: u8,
    /// Continue a cache that already has shards.
    #[arg(long)]
    pub resume: bool,
}

pub fn run(cmd: Eagle3Cmd) -> Result<bool> {
    match cmd {
        Eagle3Cmd::Common(c) => run_common(c),
        Eagle3Cmd::SetVersion { dir, version } => {
            let m = eagle3::set_version(&dir, version)?;
            eprintln!(
                "{}: format_version {} ({})",
                dir.display(),
                m.format_version,
                if m.topk().is_some() {
                    "top-k"
                } else {
                    "lossless"
                }
            );
            Ok(true)
        }
        Eagle3Cmd::Write(a) => write(a),
        Eagle3Cmd::Synth(a) => synth_cache(&a).map(|p| {
            println!("{}", p.display());
            true
        }),
    }
}

/// The run configuration of a synthetic cache.
pub fn synth_config(a: &SynthArgs) -> Value {
    let selected: Vec<Value> = (0..a.draft_vocab).map(Value::int).collect();
    let mut fields = vec![
        ("target_model".into(), Value::String("synthetic".into())),
        (
            "target_vocab_size".into(),
            Value::int(a.draft_vocab.max(32_000)),
        ),
        ("draft_vocab_size".into(), Value::int(a.draft_vocab)),
        ("seq_length".into(), Value::int(a.seq_length)),
        ("dtype".into(), Value::String(a.dtype.clone())),
        ("num_samples".into(), Value::int(a.samples)),
        ("shard_size".into(), Value::int(a.shard_size)),
        ("aux_hidden_dim".into(), Value::int(3 * a.hidden)),
        (
            "aux_layer_ids".into(),
            Value::Array(vec![Value::int(1), Value::int(7), Value::int(12)]),
        ),
        ("selected_token_ids".into(), Value::Array(selected)),
        ("input_data".into(), Value::String("synthetic".into())),
        ("split".into(), Value::Null),
        ("shuffle_seed".into(), Value::int(42)),
    ];
    if let Some(k) = a.topk {
        fields.push(("target_probs_topk".into(), Value::int(k)));
    }
    Value::Object(fields)
}

/// Writes (or resumes) a synthetic cache; returns its directory.
pub fn synth_cache(a: &SynthArgs) -> Result<PathBuf> {
    let options = WriterOptions {
        version: a.version,
        resume: a.resume,
    };
    let mut w = Writer::create(&a.out, &synth_config(a), options)?;
    let m = w.manifest().clone();
    // Embeddings first, as NeMo's producer does: a complete shard set then implies them.
    let (rows, h) = (64usize, a.hidden as usize);
    let emb: Vec<u8> = (0..rows * h)
        .flat_map(|x| ((x % 17) as f32 / 16.0).to_le_bytes())
        .collect();
    w.write_target_embeddings(&emb, rows as u64, a.hidden)?;
    let pb = progress::bar(Some(m.num_samples), "writing", Unit::Items("samples"));
    pb.set_position(w.next_sample());
    for i in w.next_sample()..m.num_samples {
        let fields = synthetic_sample(&m, i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs)?;
        pb.set_position(i + 1);
    }
    pb.finish_and_clear();
    w.finish()
}

/// A safetensors file mapped, with its parsed header.
struct Input {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    meta: safetensors::tensor::Metadata,
}

fn open_input(path: &Path) -> Result<Input> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only map of an input the user gave; modifying it meanwhile is their error
    // and at worst raises SIGBUS, as with numpy's memmap.
    let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
    let (n, meta) = read_header(&map, path)?;
    Ok(Input {
        path: path.to_path_buf(),
        data_start: 8 + n,
        meta,
        map,
    })
}

pub fn write(a: WriteArgs) -> Result<bool> {
    let text = std::fs::read(&a.manifest).map_err(|e| Error::io(&a.manifest, e))?;
    let config = json::parse(&text).map_err(|e| Error::format(&a.manifest, e.to_string()))?;
    let options = WriterOptions {
        version: a.version,
        resume: a.resume,
    };
    let mut w = Writer::create(&a.out, &config, options)?;
    let total = w.manifest().num_samples;
    let mut skip = w.next_sample();
    if skip > 0 {
        eprintln!(
            "resuming {}: samples 0 to {} are written; skipping them in the input",
            a.out.display(),
            skip - 1
        );
    }
    let pb = progress::bar(Some(total), "writing", Unit::Items("samples"));
    pb.set_position(skip);
    let specs: Vec<(&'static str, safetensors::Dtype, Vec<usize>)> = w
        .fields()
        .iter()
        .map(|s| (s.name, s.dtype, s.row.clone()))
        .collect();
    for path in &a.from {
        let input = open_input(path)?;
        // Every stored tensor, [b, ...], the same b for all.
        let mut rows: Option<u64> = None;
        let mut views: Vec<(&str, &[u8], usize)> = Vec::new();
        for (name, dtype, row) in &specs {
            let name = *name;
            let info = input
                .meta
                .info(name)
                .ok_or_else(|| Error::format(&input.path, format!("has no tensor `{name}`")))?;
            // Same-sized dtypes (bf16 and fp16, int64 and float64) would be taken bit for bit.
            if info.dtype != *dtype
                || info.shape.len() != row.len() + 1
                || info.shape[1..] != row[..]
            {
                return Err(Error::format(
                    &input.path,
                    format!(
                        "`{name}` is {} of shape {:?}; this cache stores it as {dtype} of shape \
                         [b, {}] (convert it before writing)",
                        info.dtype,
                        info.shape,
                        row.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            let b = *info.shape.first().unwrap_or(&0) as u64;
            if *rows.get_or_insert(b) != b {
                return Err(Error::format(
                    &input.path,
                    format!("tensors disagree on the batch size (dim 0): `{name}` has {b}"),
                ));
            }
            let (s, e) = info.data_offsets;
            let bytes = &input.map[input.data_start + s..input.data_start + e];
            views.push((name, bytes, bytes.len() / b.max(1) as usize));
        }
        let b = rows.unwrap_or(0);
        let take_from = skip.min(b);
        skip -= take_from;
        if take_from == b {
            continue;
        }
        let fields: Vec<(&str, &[u8])> = views
            .iter()
            .map(|(n, bytes, rb)| (*n, &bytes[take_from as usize * rb..]))
            .collect();
        w.add(b - take_from, &fields).map_err(|e| match e {
            Error::Invalid(why) => Error::format(&input.path, why),
            e => e,
        })?;
        pb.set_position(w.next_sample());
    }
    if let Some(p) = &a.embeddings {
        write_weights_from(&w, p)?;
    }
    pb.finish_and_clear();
    let dir = w.finish()?;
    println!("{}", dir.display());
    Ok(true)
}

/// Writes the cache's target weights from the safetensors file `path`, which holds the tables
/// under the names the cache stores them (EAGLE-3: `weight`, F32 [V, H]; DSpark:
/// `embed_tokens.weight` and `lm_head.weight`, [V, H] in the cache dtype).
pub fn write_weights_from(w: &Writer, path: &Path) -> Result<()> {
    let input = open_input(path)?;
    let m = w.manifest();
    let want = match m.schema() {
        Schema::Eagle3 => safetensors::Dtype::F32,
        Schema::DSpark => m.dtype,
    };
    let mut tables = Vec::new();
    for &name in m.schema().weight_tensors() {
        let info = input
            .meta
            .info(name)
            .ok_or_else(|| Error::format(path, format!("has no tensor `{name}`")))?;
        if info.dtype != want || info.shape.len() != 2 {
            return Err(Error::format(
                path,
                format!(
                    "`{name}` is {} {:?}; expected {want} [V, H]",
                    info.dtype, info.shape
                ),
            ));
        }
        let (s, e) = info.data_offsets;
        tables.push(WeightTable {
            name,
            rows: info.shape[0] as u64,
            cols: info.shape[1] as u64,
            data: &input.map[input.data_start + s..input.data_start + e],
        });
    }
    w.write_target_weights(&tables)
}
