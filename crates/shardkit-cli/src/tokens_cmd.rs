//! `shardkit tokens ...`: flat-tokens datasets (seqax).

use std::path::PathBuf;

use clap::Subcommand;
use shardkit::flat_tokens::seqax::ShuffleParams;
use shardkit::flat_tokens::{Packing, Split, TokenLoader};
use shardkit::json::{self, Escape, Value};
use shardkit::Result;

/// Subcommands of `shardkit tokens`.
#[derive(Subcommand)]
pub enum TokensCmd {
    /// Summarise both splits: counts, max_token_id, sequence lengths, completion marker.
    Inspect {
        /// The dataset (a zarr group holding train/ and validation/).
        dir: PathBuf,
    },
    /// Check every invariant of both splits and list every violation; exit 0 only when valid.
    Validate {
        /// The dataset.
        dir: PathBuf,
    },
    /// Print one step of seqax's shuffled order: row indices and their decoded targets.
    Batch {
        /// The dataset.
        dir: PathBuf,
        /// train or validation.
        #[arg(long, default_value = "train")]
        split: String,
        /// Tokens per row.
        #[arg(long)]
        len: u64,
        /// Rows per step.
        #[arg(long)]
        batch: u64,
        /// Streams (S).
        #[arg(long, default_value_t = 1)]
        streams: u64,
        /// Read blocks per shuffle buffer (R).
        #[arg(long, default_value_t = 1024)]
        read_blocks: u64,
        /// Sequences per read block (B; default 2^20 / len).
        #[arg(long)]
        block: Option<u64>,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Step.
        #[arg(long, default_value_t = 0)]
        step: u64,
        /// One document per row (truncated, padded, masked) instead of packed rows.
        #[arg(long)]
        unpacked: bool,
    },
}

fn splits(dir: &PathBuf) -> Vec<(&'static str, Result<Split>)> {
    ["train", "validation"]
        .into_iter()
        .map(|s| (s, Split::open(dir, s)))
        .collect()
}

pub fn run(cmd: TokensCmd) -> Result<bool> {
    match cmd {
        TokensCmd::Inspect { dir } => {
            let mut out = Vec::new();
            for (name, split) in splits(&dir) {
                let v = match split {
                    Err(e) => Value::Object(vec![("error".into(), Value::String(e.to_string()))]),
                    Ok(s) => {
                        let lens: Vec<u64> =
                            s.seq_starts().windows(2).map(|w| w[1] - w[0]).collect();
                        Value::Object(vec![
                            ("token_count".into(), Value::int(s.token_count())),
                            ("seq_count".into(), Value::int(s.seq_count())),
                            ("max_token_id".into(), Value::int(s.max_token_id())),
                            (
                                "write_completed".into(),
                                Value::Bool(s.is_marked_complete()),
                            ),
                            (
                                "min_seq_len".into(),
                                Value::int(lens.iter().copied().min().unwrap_or(0)),
                            ),
                            (
                                "max_seq_len".into(),
                                Value::int(lens.iter().copied().max().unwrap_or(0)),
                            ),
                            (
                                "empty_sequences".into(),
                                Value::int(lens.iter().filter(|&&l| l == 0).count() as u64),
                            ),
                        ])
                    }
                };
                out.push((name.to_string(), v));
            }
            println!("{}", json::to_pretty(&Value::Object(out), 2, Escape::Utf8));
            Ok(true)
        }
        TokensCmd::Validate { dir } => {
            let mut valid = true;
            for (name, split) in splits(&dir) {
                match split {
                    Err(e) => {
                        valid = false;
                        println!("error: {name}: {e}");
                    }
                    Ok(s) => {
                        let problems = s.validate();
                        valid &= problems.is_empty();
                        for p in &problems {
                            println!("error: {}: {p}", s.path().display());
                        }
                    }
                }
            }
            println!(
                "{}: {}",
                dir.display(),
                if valid { "valid" } else { "INVALID" }
            );
            Ok(valid)
        }
        TokensCmd::Batch {
            dir,
            split,
            len,
            batch,
            streams,
            read_blocks,
            block,
            seed,
            step,
            unpacked,
        } => {
            let params = ShuffleParams {
                batch,
                streams,
                read_blocks_per_shuffle_buffer: read_blocks,
                sequences_per_read_block: block.unwrap_or(((1u64 << 20) / len.max(1)).max(1)),
                seed,
            };
            let packing = if unpacked {
                Packing::Unpacked
            } else {
                Packing::Packed
            };
            let loader = TokenLoader::new(Split::open(&dir, &split)?, len, packing, params)?;
            let b = loader.load(step)?;
            let ints = |v: &[u64]| Value::Array(v.iter().map(|&x| Value::int(x)).collect());
            let targets: Vec<Value> = b
                .decoded
                .targets
                .chunks(len as usize)
                .map(|r| Value::Array(r.iter().map(|&x| Value::int(x)).collect()))
                .collect();
            let v = Value::Object(vec![
                ("step".into(), Value::int(step)),
                ("step_count".into(), Value::int(loader.step_count())),
                ("rows".into(), ints(&b.rows)),
                ("targets".into(), Value::Array(targets)),
            ]);
            println!("{}", json::to_compact(&v, false, Escape::Utf8));
            Ok(true)
        }
    }
}
