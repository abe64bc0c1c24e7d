//! `shardkit tokens ...`: flat-tokens datasets (seqax).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::progress::{self, Unit};
use clap::{Args, Subcommand};
use shardkit::flat_tokens::{
    self, mark_complete, BuildOptions, Layout, LoaderOptions, Packing, Split, TokenLoader,
};
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

use crate::npy::{Dtype, NpzWriter};

/// Subcommands of `shardkit tokens`.
#[derive(Subcommand)]
pub enum TokensCmd {
    /// Append documents from JSONL (plain, zstd, gzip) or Parquet corpora to a split, creating
    /// the dataset as needed; tokenizes text with a Hugging Face tokenizer on every core.
    Build(BuildArgs),
    /// Summarise both splits: format, completion, counts, max_token_id, sequence lengths
    /// (text; --json for JSON).
    Inspect {
        /// The dataset (a zarr group holding train/ and validation/).
        dir: PathBuf,
        /// Print the summary as JSON (stable keys, for scripts).
        #[arg(long)]
        json: bool,
    },
    /// Where a split written in parts (flat_tokens.PartWriter) stands: units durable, missing,
    /// claimed by live ranks (and by whom), and what a restart would write.
    Status {
        /// The dataset (a zarr group, the directory its ranks are filling, or its s3:// URL).
        dir: PathBuf,
        /// The split.
        #[arg(long, default_value = "train")]
        split: String,
        #[command(flatten)]
        show: crate::parts_cmd::StatusArgs,
    },
    /// Check every invariant of both splits and list every violation; exit 0 only when valid.
    Validate {
        /// The dataset.
        dir: PathBuf,
        /// When valid and unmarked (seqax data), set write_completed: true on the root so later
        /// opens skip the full validation.
        #[arg(long)]
        mark: bool,
        /// Also check every byte against the checksums sidecar, naming damaged byte ranges.
        #[arg(long)]
        deep: bool,
        /// Print {"valid", "errors", "notes"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Hash every file into the checksums sidecar (shardkit.checksums.json), for datasets
    /// written by other tools; `validate --deep` and loaders with verify then check them.
    Checksum {
        /// The dataset.
        path: PathBuf,
    },
    /// One step of seqax's shuffled order: JSON rows and targets, or every array to an .npz.
    Batch(BatchArgs),
    /// Rewrite a dataset in another layout (v2 -> v3 for fast random rows; v3 -> v2 for seqax).
    Convert {
        /// The dataset to read.
        src: PathBuf,
        /// The new dataset (must not exist).
        dst: PathBuf,
        /// v3 (sharded zstd) or v2 (seqax's codecs).
        #[arg(long, default_value = "v3")]
        layout: String,
    },
}

/// `shardkit tokens build`.
#[derive(Args)]
pub struct BuildArgs {
    /// The dataset to create or extend (a directory, e.g. DS.zarr).
    #[arg(long)]
    out: PathBuf,
    /// train or validation.
    #[arg(long)]
    split: String,
    /// Inputs, in order: files, directories (their .jsonl/.json/.parquet files, compressed or
    /// not, sorted), glob patterns (quote them: 'data/*.parquet'), or "-" for standard input.
    /// JSONL (plain, .zst, .gz: recognised by content) holds one document per line: token ids
    /// (a list), or with --tokenizer text (a string); or an object holding either (--field).
    /// Parquet holds them in a column (--field): strings with --tokenizer, else lists of ids.
    #[arg(long, num_args = 1.., required = true)]
    from: Vec<String>,
    /// Layout of a new dataset: v3 (default: sharded zstd) or v2 (seqax's codecs, readable by
    /// seqax). An existing dataset keeps its own.
    #[arg(long)]
    layout: Option<String>,
    /// A Hugging Face tokenizer.json: documents are text, tokenized on every core without
    /// special tokens, truncation or padding (as seqax's tools do).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The JSONL member or Parquet column holding each document (default: "text" with
    /// --tokenizer, otherwise "input_ids" or "tokens"). Null values are skipped and counted.
    #[arg(long)]
    field: Option<String>,
    /// Threads that parse and tokenize (0: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Continue an interrupted build of this split from the same input: the sequences already
    /// committed are skipped.
    #[arg(long, conflicts_with = "append")]
    resume: bool,
    /// Append the whole input to an existing, finished split.
    #[arg(long)]
    append: bool,
    /// Commit (make durable and resumable) every this many tokens.
    #[arg(long, default_value_t = 1 << 28)]
    checkpoint_tokens: u64,
}

/// `shardkit tokens batch`.
#[derive(Args)]
pub struct BatchArgs {
    /// The dataset.
    dir: PathBuf,
    /// train or validation.
    #[arg(long, default_value = "train")]
    split: String,
    /// Tokens per row.
    #[arg(long)]
    len: u64,
    /// Rows per step (over all hosts).
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
    /// Step (past step_count only with --epochs).
    #[arg(long, default_value_t = 0)]
    step: u64,
    /// One document per row (truncated, padded, masked) instead of packed rows.
    #[arg(long)]
    unpacked: bool,
    /// This host's index (it gets rows [h*batch/H, (h+1)*batch/H)).
    #[arg(long, default_value_t = 0)]
    host_index: u64,
    /// Number of hosts.
    #[arg(long, default_value_t = 1)]
    host_count: u64,
    /// Steps past the end continue in a new order per epoch.
    #[arg(long)]
    epochs: bool,
    /// Write inputs, targets, segment_ids (int32), is_seq_start, mask (bool) and rows (int64)
    /// to this .npz instead of printing JSON.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(cmd: TokensCmd) -> Result<bool> {
    match cmd {
        TokensCmd::Build(args) => build(args),
        TokensCmd::Inspect { dir, json } => {
            let v = flat_tokens::inspect(&dir)?;
            if json {
                println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
            } else {
                crate::inspect_text::print(&v);
            }
            Ok(true)
        }
        TokensCmd::Validate {
            dir,
            mark,
            deep,
            json,
        } => validate(&dir, mark, deep, json),
        TokensCmd::Status { dir, split, show } => show.run(
            &dir.join(&split),
            "unit",
            || flat_tokens::status(&dir, &split),
            || flat_tokens::commit_parts(&dir, &split),
        ),
        TokensCmd::Checksum { path } => crate::checksum_cmd::checksum(&path),
        TokensCmd::Batch(args) => batch(args),
        TokensCmd::Convert { src, dst, layout } => {
            let layout: Layout = layout.parse()?;
            let pb = progress::bar(None, "converting", Unit::Items("tokens"));
            let t0 = Instant::now();
            let done = flat_tokens::convert(&src, &dst, layout, |done, total| {
                if pb.length().is_none() {
                    progress::set_total(&pb, total, Unit::Items("tokens"));
                }
                pb.set_position(done);
            })?;
            pb.finish_and_clear();
            for (name, s) in &done {
                eprintln!(
                    "{}: {} sequences, {} tokens (max_token_id {})",
                    dst.join(name).display(),
                    s.seq_count,
                    s.token_count,
                    s.max_token_id
                );
            }
            eprintln!("converted in {:.1} s", t0.elapsed().as_secs_f64());
            println!("{}", dst.display());
            Ok(true)
        }
    }
}

fn validate(dir: &Path, mark: bool, deep: bool, as_json: bool) -> Result<bool> {
    let mut report = flat_tokens::validate(dir);
    if deep {
        shardkit::checksum::verify_into(dir, &mut report);
    }
    if report.is_valid() && mark {
        mark_complete(dir)?;
        eprintln!("{}: marked write_completed: true", dir.display());
    }
    Ok(crate::checksum_cmd::print_report(&report, as_json, deep))
}

fn batch(a: BatchArgs) -> Result<bool> {
    let mut o = LoaderOptions::new(a.len, a.batch);
    o.packing = if a.unpacked {
        Packing::Unpacked
    } else {
        Packing::Packed
    };
    o.streams = a.streams;
    o.read_blocks_per_shuffle_buffer = a.read_blocks;
    o.sequences_per_read_block = a.block;
    o.seed = a.seed;
    o.epochs = a.epochs;
    o.rank = Some(a.host_index);
    o.world_size = Some(a.host_count);
    let loader = TokenLoader::new(Split::open(&a.dir, &a.split)?, o)?;
    let b = loader.load(a.step)?;
    let Some(out) = a.out else {
        let ints = |v: &[u64]| Value::Array(v.iter().map(|&x| Value::int(x)).collect());
        let targets: Vec<Value> = b
            .arrays()
            .targets
            .chunks(b.seq_len.max(1))
            .map(|r| Value::Array(r.iter().map(|&x| Value::int(x)).collect()))
            .collect();
        let v = Value::Object(vec![
            ("step".into(), Value::int(a.step)),
            ("step_count".into(), Value::int(loader.info().step_count)),
            ("rows".into(), ints(&b.rows)),
            ("targets".into(), Value::Array(targets)),
        ]);
        println!("{}", json::to_compact(&v, false, Escape::Utf8));
        return Ok(true);
    };
    let shape = [b.rows.len() as u64, b.seq_len as u64];
    let mut npz = NpzWriter::create(&out)?;
    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let members: [(&str, Dtype, &[u64], Vec<u8>); 6] = [
        ("inputs", Dtype::I32, &shape, u32s(b.arrays().inputs)),
        ("targets", Dtype::I32, &shape, u32s(b.arrays().targets)),
        (
            "segment_ids",
            Dtype::I32,
            &shape,
            u32s(b.arrays().segment_ids),
        ),
        (
            "is_seq_start",
            Dtype::Bool,
            &shape,
            b.arrays().is_seq_start.to_vec(),
        ),
        ("mask", Dtype::Bool, &shape, b.arrays().mask.to_vec()),
        (
            "rows",
            Dtype::I64,
            &shape[..1],
            b.rows.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
    ];
    for (name, dtype, shape, bytes) in members {
        let tmp = npz.tmp().to_path_buf();
        npz.start(name, dtype, shape)?
            .write_all(&bytes)
            .map_err(|e| Error::io(&tmp, e))?;
    }
    npz.finish()?;
    eprintln!(
        "step {} of {} ({} rows of {}) written to {}",
        a.step,
        loader.info().step_count,
        b.rows.len(),
        b.seq_len,
        out.display()
    );
    Ok(true)
}

// ---------------------------------------------------------------------------------------------
// build

fn build(args: BuildArgs) -> Result<bool> {
    let layout = args
        .layout
        .as_deref()
        .map(str::parse::<Layout>)
        .transpose()?;
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(flat_tokens::Tokenizer::from_file)
        .transpose()?;
    let options = BuildOptions {
        field: args.field.clone(),
        tokenizer,
        layout,
        resume: args.resume,
        append: args.append,
        checkpoint_tokens: args.checkpoint_tokens,
        threads: args.threads,
    };
    let pb = progress::bar(None, &format!("building {}", args.split), Unit::Bytes);
    let t0 = Instant::now();
    let result = flat_tokens::build(&args.out, &args.split, &args.from, &options, &mut |p| {
        if let (Some(total), None) = (p.bytes_total, pb.length()) {
            progress::set_total(&pb, total, Unit::Bytes);
        }
        pb.set_position(p.bytes_read);
        pb.set_message(format!(
            "building {}: {} tokens",
            args.split,
            human(p.tokens as f64)
        ));
        Ok(())
    });
    let summary = match result {
        Ok(s) => s,
        Err(e) => {
            pb.abandon();
            return Err(match e {
                Error::Exists { path, why } if why.contains("resume") => Error::Exists {
                    path,
                    why: format!(
                        "{why} (--resume continues an interrupted build; --append adds to it)"
                    ),
                },
                e => e,
            });
        }
    };
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if summary.skipped_documents > 0 {
        eprintln!(
            "resumed: skipped the {} documents the split already held",
            summary.skipped_documents
        );
    }
    if summary.null_values > 0 {
        eprintln!(
            "warning: {} lines/rows had a null value and were skipped (not documents)",
            summary.null_values
        );
    }
    let w = &summary.write;
    if w.sequences_with_id_zero > 0 {
        eprintln!(
            "warning: {} sequences contain token id 0, which the loader feeds as the input at \
             sequence starts",
            w.sequences_with_id_zero
        );
    }
    eprintln!(
        "{}: {} sequences, {} tokens (max_token_id {}); appended {} tokens from {} file(s) in \
         {:.2} s ({} tokens/min)",
        w.root.join(&args.split).display(),
        w.seq_count,
        w.token_count,
        w.max_token_id,
        summary.appended_tokens,
        summary.inputs.len(),
        secs,
        human(summary.appended_tokens as f64 / secs.max(1e-9) * 60.0)
    );
    println!("{}", w.root.display());
    Ok(true)
}

fn human(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}K", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}
