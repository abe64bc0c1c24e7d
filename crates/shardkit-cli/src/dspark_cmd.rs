//! `shardkit dspark ...`: DSpark offline target-supervision caches (NeMo Automodel). The
//! commands are EAGLE-3's (`eagle3_cmd`): the two caches are schemas of one implementation.

use std::path::PathBuf;

use crate::eagle3_cmd::{self, CacheCmd, WriteArgs};
use crate::progress::{self, Unit};
use clap::{Args, Subcommand};
use shardkit::dspark::{synthetic_sample, WeightTable, Writer, WriterOptions};
use shardkit::json::{self, Value};
use shardkit::{Error, Result};

/// Subcommands of `shardkit dspark`.
#[derive(Subcommand)]
pub enum DsparkCmd {
    #[command(flatten)]
    Common(CacheCmd),
    /// Write a cache from safetensors batch files holding the stored tensors, [b, ...] each.
    Write(DsparkWriteArgs),
    /// Write a synthetic cache of valid, deterministic samples (for tests and benchmarks).
    Synth(DsparkSynthArgs),
}

/// `shardkit dspark write`.
#[derive(Args)]
pub struct DsparkWriteArgs {
    /// The cache directory.
    #[arg(long)]
    out: PathBuf,
    /// The run configuration: a JSON object with the keys NeMo's `build_cache_manifest` writes.
    #[arg(long)]
    manifest: PathBuf,
    /// Continue a cache that already has shards (its first samples are skipped in the input).
    #[arg(long)]
    resume: bool,
    /// A safetensors file whose `embed_tokens.weight` and `lm_head.weight` ([V, H] in the
    /// cache dtype) become target_weights.safetensors.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Batch files in sample order: safetensors with input_ids, loss_mask,
    /// target_hidden_states and target_last_hidden_states, each [b, ...].
    #[arg(required = true)]
    from: Vec<PathBuf>,
}

/// `shardkit dspark synth`.
#[derive(Args)]
pub struct DsparkSynthArgs {
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
    /// The target's hidden size H.
    #[arg(long, default_value_t = 1024)]
    pub hidden: u64,
    /// Target layers captured (target_hidden_dim is H times this).
    #[arg(long, default_value_t = 5)]
    pub layers: u64,
    /// bf16, fp16 or fp32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Continue a cache that already has shards.
    #[arg(long)]
    pub resume: bool,
}

pub fn run(cmd: DsparkCmd) -> Result<bool> {
    match cmd {
        DsparkCmd::Common(c) => eagle3_cmd::run_common(c),
        DsparkCmd::Write(a) => {
            require_dspark(&a.manifest)?;
            eagle3_cmd::write(WriteArgs {
                out: a.out,
                manifest: a.manifest,
                version: 1,
                resume: a.resume,
                embeddings: a.weights,
                from: a.from,
            })
        }
        DsparkCmd::Synth(a) => synth_cache(&a).map(|p| {
            println!("{}", p.display());
            true
        }),
    }
}

/// Refuses a run configuration that is not a DSpark one (`shardkit dspark write` with an
/// EAGLE-3 manifest would otherwise write an EAGLE-3 cache).
fn require_dspark(path: &std::path::Path) -> Result<()> {
    let text = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let config = json::parse(&text).map_err(|e| Error::format(path, e.to_string()))?;
    if config.get("target_hidden_dim").is_none() {
        return Err(Error::format(
            path,
            "has no `target_hidden_dim`: not a DSpark run configuration (an EAGLE-3 one is \
             written with `shardkit eagle3 write`)",
        ));
    }
    Ok(())
}

/// The run configuration of a synthetic cache (`build_cache_manifest`'s keys).
pub fn synth_config(a: &DsparkSynthArgs) -> Value {
    let layers: Vec<Value> = (0..a.layers).map(|i| Value::int(1 + 2 * i)).collect();
    Value::Object(vec![
        ("target_model".into(), Value::String("synthetic".into())),
        ("target_model_type".into(), Value::String("qwen3".into())),
        ("target_vocab_size".into(), Value::int(32_000)),
        ("hidden_size".into(), Value::int(a.hidden)),
        ("num_hidden_layers".into(), Value::int(2 * a.layers + 2)),
        ("seq_length".into(), Value::int(a.seq_length)),
        ("dtype".into(), Value::String(a.dtype.clone())),
        ("num_samples".into(), Value::int(a.samples)),
        ("shard_size".into(), Value::int(a.shard_size)),
        ("target_hidden_dim".into(), Value::int(a.hidden * a.layers)),
        ("target_last_hidden_dim".into(), Value::int(a.hidden)),
        ("target_layer_ids".into(), Value::Array(layers)),
        ("train_data_path".into(), Value::String("synthetic".into())),
        ("train_split".into(), Value::Null),
        ("shuffle_seed".into(), Value::int(42)),
        ("mask_reasoning_content".into(), Value::Bool(false)),
        (
            "chat_template_sha256".into(),
            // sha256 of the empty template.
            Value::String(
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855".into(),
            ),
        ),
    ])
}

/// Writes (or resumes) a synthetic cache; returns its directory.
pub fn synth_cache(a: &DsparkSynthArgs) -> Result<PathBuf> {
    let options = WriterOptions {
        version: 1,
        resume: a.resume,
    };
    let mut w = Writer::create(&a.out, &synth_config(a), options)?;
    let m = w.manifest().clone();
    // The target weights first, as NeMo's producer writes them.
    let (rows, h) = (64usize, a.hidden as usize);
    let table: Vec<f32> = (0..rows * h).map(|x| (x % 17) as f32 / 16.0).collect();
    let dtype = match m.dtype {
        safetensors::Dtype::BF16 => shardkit::precision::Dtype::BF16,
        safetensors::Dtype::F16 => shardkit::precision::Dtype::F16,
        _ => shardkit::precision::Dtype::F32,
    };
    let bytes = shardkit::precision::encoded(dtype, &table);
    let tables = [
        WeightTable {
            name: "embed_tokens.weight",
            rows: rows as u64,
            cols: a.hidden,
            data: &bytes,
        },
        WeightTable {
            name: "lm_head.weight",
            rows: rows as u64,
            cols: a.hidden,
            data: &bytes,
        },
    ];
    w.write_target_weights(&tables)?;
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
