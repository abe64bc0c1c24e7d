//! `shardkit tokens ...`: flat-tokens datasets (seqax).

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use shardkit::flat_tokens::{
    self, mark_complete, Completion, Layout, LoaderOptions, Packing, Split, TokenLoader, Writer,
    WriterOptions, MAX_TOKEN_ID,
};
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

use crate::npy::{Dtype, NpzWriter};

/// Subcommands of `shardkit tokens`.
#[derive(Subcommand)]
pub enum TokensCmd {
    /// Append sequences from a JSONL file to a split (creating the dataset as needed).
    Build(BuildArgs),
    /// Summarise both splits: format, completion, counts, max_token_id, sequence lengths.
    Inspect {
        /// The dataset (a zarr group holding train/ and validation/).
        dir: PathBuf,
    },
    /// Check every invariant of both splits and list every violation; exit 0 only when valid.
    Validate {
        /// The dataset.
        dir: PathBuf,
        /// When valid and unmarked (seqax data), set write_completed: true on the root so later
        /// opens skip the full validation.
        #[arg(long)]
        mark: bool,
        /// Print {"valid", "errors", "notes"} as JSON.
        #[arg(long)]
        json: bool,
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
    /// JSONL input, one sequence per line ("-" for stdin): a list of token ids, or with
    /// --tokenizer a string of text; or an object holding either (see --field).
    #[arg(long)]
    from: PathBuf,
    /// Layout of a new dataset: v3 (default: sharded zstd) or v2 (seqax's codecs, readable by
    /// seqax). An existing dataset keeps its own.
    #[arg(long)]
    layout: Option<String>,
    /// A Hugging Face tokenizer.json: lines are text, tokenized without special tokens (as
    /// seqax's tools do).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// For object lines, the member holding the sequence (default: "text" with --tokenizer,
    /// otherwise "input_ids" or "tokens").
    #[arg(long)]
    field: Option<String>,
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
        TokensCmd::Inspect { dir } => {
            let v = flat_tokens::inspect(&dir)?;
            println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
            Ok(true)
        }
        TokensCmd::Validate { dir, mark, json } => validate(&dir, mark, json),
        TokensCmd::Batch(args) => batch(args),
        TokensCmd::Convert { src, dst, layout } => {
            let layout: Layout = layout.parse()?;
            let pb = progress(None, "converting");
            let t0 = Instant::now();
            let done = flat_tokens::convert(&src, &dst, layout, |done, total| {
                if pb.length().is_none() {
                    pb.set_length(total);
                    pb.set_style(
                        ProgressStyle::with_template(
                            "{msg} [{bar:30}] {pos}/{len} tokens eta {eta}",
                        )
                        .expect("valid template")
                        .progress_chars("=> "),
                    );
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

fn validate(dir: &Path, mark: bool, as_json: bool) -> Result<bool> {
    let report = flat_tokens::validate(dir);
    let valid = report.is_valid();
    if valid && mark {
        mark_complete(dir)?;
        eprintln!("{}: marked write_completed: true", dir.display());
    }
    if as_json {
        println!("{}", json::to_pretty(&report.to_json(), 2, Escape::Utf8));
        return Ok(valid);
    }
    for e in &report.errors {
        println!("error: {e}");
    }
    for n in &report.notes {
        println!("note: {n}");
    }
    println!(
        "{}: {}",
        dir.display(),
        if valid { "valid" } else { "INVALID" }
    );
    Ok(valid)
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
    o.host_index = a.host_index;
    o.host_count = a.host_count;
    o.epochs = a.epochs;
    let loader = TokenLoader::new(Split::open(&a.dir, &a.split)?, o)?;
    let b = loader.load(a.step)?;
    let Some(out) = a.out else {
        let ints = |v: &[u64]| Value::Array(v.iter().map(|&x| Value::int(x)).collect());
        let targets: Vec<Value> = b
            .decoded
            .targets
            .chunks(b.seq_len.max(1))
            .map(|r| Value::Array(r.iter().map(|&x| Value::int(x)).collect()))
            .collect();
        let v = Value::Object(vec![
            ("step".into(), Value::int(a.step)),
            ("step_count".into(), Value::int(loader.step_count())),
            ("rows".into(), ints(&b.rows)),
            ("targets".into(), Value::Array(targets)),
        ]);
        println!("{}", json::to_compact(&v, false, Escape::Utf8));
        return Ok(true);
    };
    let shape = [b.rows.len() as u64, b.seq_len as u64];
    let mut npz = NpzWriter::create(&out)?;
    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bools = |v: &[bool]| v.iter().map(|&x| u8::from(x)).collect::<Vec<u8>>();
    let members: [(&str, Dtype, &[u64], Vec<u8>); 6] = [
        ("inputs", Dtype::I32, &shape, u32s(&b.decoded.inputs)),
        ("targets", Dtype::I32, &shape, u32s(&b.decoded.targets)),
        (
            "segment_ids",
            Dtype::I32,
            &shape,
            u32s(&b.decoded.segment_ids),
        ),
        (
            "is_seq_start",
            Dtype::Bool,
            &shape,
            bools(&b.decoded.is_seq_start),
        ),
        ("mask", Dtype::Bool, &shape, bools(&b.mask)),
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
        loader.step_count(),
        b.rows.len(),
        b.seq_len,
        out.display()
    );
    Ok(true)
}

// ---------------------------------------------------------------------------------------------
// build

/// Turns input lines into token-id sequences.
enum Encoder {
    Ids {
        field: Option<String>,
    },
    #[cfg(feature = "tokenizer")]
    Text {
        tokenizer: Box<tokenizers::Tokenizer>,
        field: String,
    },
}

impl Encoder {
    fn new(tokenizer: Option<&Path>, field: Option<String>) -> Result<Encoder> {
        match tokenizer {
            None => Ok(Encoder::Ids { field }),
            #[cfg(feature = "tokenizer")]
            Some(p) => {
                let t = tokenizers::Tokenizer::from_file(p)
                    .map_err(|e| Error::format(p, format!("cannot load the tokenizer: {e}")))?;
                Ok(Encoder::Text {
                    tokenizer: Box::new(t),
                    field: field.unwrap_or_else(|| "text".into()),
                })
            }
            #[cfg(not(feature = "tokenizer"))]
            Some(_) => Err(Error::Invalid(
                "--tokenizer needs shardkit built with the `tokenizer` feature".into(),
            )),
        }
    }

    /// Sequences of `lines` (numbered from `first_line`, 1-based) of `path`.
    fn encode(&self, path: &Path, first_line: u64, lines: &[Vec<u8>]) -> Result<Vec<Vec<u32>>> {
        let at = |i: usize, msg: String| {
            Error::format(path, format!("line {}: {msg}", first_line + i as u64))
        };
        match self {
            Encoder::Ids { field } => lines
                .iter()
                .enumerate()
                .map(|(i, l)| ids_of_line(l, field.as_deref()).map_err(|m| at(i, m)))
                .collect(),
            #[cfg(feature = "tokenizer")]
            Encoder::Text { tokenizer, field } => {
                let texts: Vec<String> = lines
                    .iter()
                    .enumerate()
                    .map(|(i, l)| text_of_line(l, field).map_err(|m| at(i, m)))
                    .collect::<Result<_>>()?;
                let encodings = tokenizer
                    .encode_batch(texts, false)
                    .map_err(|e| at(0, format!("tokenizer failed on this batch: {e}")))?;
                Ok(encodings
                    .into_iter()
                    .map(|e| e.get_ids().to_vec())
                    .collect())
            }
        }
    }
}

/// A JSON array of token ids, read without building a JSON tree (the common case), or the
/// member `field` (default "input_ids", then "tokens") of a JSON object.
fn ids_of_line(line: &[u8], field: Option<&str>) -> std::result::Result<Vec<u32>, String> {
    let t = trim(line);
    if t.first() == Some(&b'[') {
        if let Some(v) = fast_int_list(t) {
            return v;
        }
    }
    let v = json::parse(t).map_err(|e| e.to_string())?;
    let arr = match (&v, field) {
        (Value::Array(_), None) => &v,
        (Value::Object(_), Some(f)) => v
            .get(f)
            .ok_or_else(|| format!("the object has no member {f:?}"))?,
        (Value::Object(_), None) => v.get("input_ids").or_else(|| v.get("tokens")).ok_or(
            "the object has neither \"input_ids\" nor \"tokens\" (name the member with --field)",
        )?,
        _ => {
            return Err(format!(
                "expected a JSON array of token ids{}, found {}",
                if field.is_some() { " in an object" } else { "" },
                v.type_name()
            ))
        }
    };
    let Value::Array(items) = arr else {
        return Err(format!(
            "expected an array of token ids, found {}",
            arr.type_name()
        ));
    };
    items
        .iter()
        .map(|x| match x {
            Value::Number(n) => parse_id(n.as_bytes()),
            other => Err(format!(
                "token ids must be integers, found {}",
                other.type_name()
            )),
        })
        .collect()
}

fn parse_id(digits: &[u8]) -> std::result::Result<u32, String> {
    let text = String::from_utf8_lossy(digits);
    let v: u64 = text
        .parse()
        .map_err(|_| format!("token id {text} is not a non-negative integer"))?;
    if v > u64::from(MAX_TOKEN_ID) {
        return Err(format!(
            "token id {v} does not fit the flat-tokens encoding (ids must be below 2^31)"
        ));
    }
    Ok(v as u32)
}

/// `[1, 2, 3]` with optional whitespace; None when the text is anything else (the caller then
/// parses it as JSON for a precise message).
fn fast_int_list(t: &[u8]) -> Option<std::result::Result<Vec<u32>, String>> {
    let mut out = Vec::with_capacity(t.len() / 4);
    let mut i = 1;
    let skip = |i: &mut usize| {
        while *i < t.len() && t[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    skip(&mut i);
    if t.get(i) == Some(&b']') {
        return (i + 1 == t.len()).then_some(Ok(out));
    }
    loop {
        skip(&mut i);
        let start = i;
        while i < t.len() && t[i].is_ascii_digit() {
            i += 1;
        }
        if i == start || i - start > 19 {
            return None;
        }
        match parse_id(&t[start..i]) {
            Ok(v) => out.push(v),
            Err(e) => return Some(Err(e)),
        }
        skip(&mut i);
        match t.get(i) {
            Some(b',') => i += 1,
            Some(b']') if i + 1 == t.len() => return Some(Ok(out)),
            _ => return None,
        }
    }
}

#[cfg(feature = "tokenizer")]
fn text_of_line(line: &[u8], field: &str) -> std::result::Result<String, String> {
    match json::parse(trim(line)).map_err(|e| e.to_string())? {
        Value::String(s) => Ok(s),
        v @ Value::Object(_) => match v.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!(
                "member {field:?} must be a string, found {}",
                other.type_name()
            )),
            None => Err(format!(
                "the object has no member {field:?} (name it with --field)"
            )),
        },
        v => Err(format!(
            "expected a JSON string of text (or an object with {field:?}), found {}",
            v.type_name()
        )),
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let s = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let e = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(s, |e| e + 1);
    &b[s..e]
}

/// Lines sent from the reading thread: the sequences of a batch, or the last sequence already
/// in the split (checked against the dataset when resuming).
enum Piece {
    Batch {
        seqs: Vec<Vec<u32>>,
        bytes_read: u64,
    },
    Resumed(Vec<u32>),
}

const LINES_PER_BATCH: usize = 4096;

fn open_input(path: &Path) -> Result<(Box<dyn Read + Send>, Option<u64>)> {
    if path == Path::new("-") {
        return Ok((Box::new(std::io::stdin()), None));
    }
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = f.metadata().ok().map(|m| m.len());
    Ok((Box::new(f), len))
}

fn build(args: BuildArgs) -> Result<bool> {
    let layout = args
        .layout
        .as_deref()
        .map(str::parse::<Layout>)
        .transpose()?;
    let encoder = Encoder::new(args.tokenizer.as_deref(), args.field.clone())?;
    let (input, total) = open_input(&args.from)?;
    if args.append && args.out.join(&args.split).is_dir() {
        let s = Split::open_unvalidated(&args.out, &args.split)?;
        if s.completion() == Completion::Interrupted {
            return Err(Error::Interrupted {
                path: args.out.clone(),
                detail: "a build did not finish; finish it with --resume before appending".into(),
            });
        }
    }
    let options = WriterOptions {
        layout,
        resume: args.resume || args.append,
        checkpoint_tokens: args.checkpoint_tokens,
    };
    let mut writer = Writer::create(&args.out, &args.split, options).map_err(|e| match e {
        Error::Exists { path, why } if why.contains("resume") => Error::Exists {
            path,
            why: format!("{why} (--resume continues an interrupted build; --append adds to it)"),
        },
        e => e,
    })?;
    let skip = if args.resume {
        writer.resumed_from().unwrap_or(0)
    } else {
        0
    };
    if skip > 0 {
        eprintln!(
            "resuming {}: {skip} sequences ({} tokens) already written; skipping them in the input",
            writer.root().join(&args.split).display(),
            writer.token_count()
        );
    }
    let pb = progress(total, &format!("building {}", args.split));
    let from = args.from.clone();
    let (tx, rx) = sync_channel::<Result<Piece>>(4);
    let reader = std::thread::spawn(move || {
        let send = |p: Result<Piece>| tx.send(p).is_ok();
        let mut r = BufReader::with_capacity(1 << 20, input);
        let mut line = Vec::new();
        let (mut line_no, mut seq_no, mut bytes) = (0u64, 0u64, 0u64);
        let mut batch: Vec<Vec<u8>> = Vec::new();
        let mut first_line = 1u64;
        loop {
            line.clear();
            let n = match r.read_until(b'\n', &mut line) {
                Ok(n) => n,
                Err(e) => {
                    send(Err(Error::io(&from, e)));
                    return;
                }
            };
            bytes += n as u64;
            let eof = n == 0;
            if !eof {
                line_no += 1;
                if !trim(&line).is_empty() {
                    seq_no += 1;
                    if seq_no <= skip {
                        if seq_no == skip {
                            let r = encoder.encode(&from, line_no, std::slice::from_ref(&line));
                            if !send(r.map(|mut v| Piece::Resumed(v.remove(0)))) {
                                return;
                            }
                        }
                        continue;
                    }
                    if batch.is_empty() {
                        first_line = line_no;
                    }
                    batch.push(std::mem::take(&mut line));
                }
            }
            if batch.len() >= LINES_PER_BATCH || (eof && !batch.is_empty()) {
                let seqs = encoder.encode(&from, first_line, &batch);
                batch.clear();
                if !send(seqs.map(|seqs| Piece::Batch {
                    seqs,
                    bytes_read: bytes,
                })) {
                    return;
                }
            }
            if eof {
                if seq_no < skip {
                    send(Err(Error::format(
                        &from,
                        format!(
                            "holds {seq_no} sequences, but the split already has {skip}; is \
                             this the input of the interrupted build?"
                        ),
                    )));
                }
                return;
            }
        }
    });
    let t0 = Instant::now();
    let start_tokens = writer.token_count();
    let mut result = Ok(());
    for piece in rx {
        match piece {
            Err(e) => {
                result = Err(e);
                break;
            }
            Ok(Piece::Resumed(seq)) => {
                let s = Split::open_unvalidated(&args.out, &args.split)?;
                let have = s.ids(skip - 1)?;
                if have != seq {
                    result = Err(Error::format(
                        &args.from,
                        format!(
                            "sequence {} of the input differs from the last sequence in the \
                             split; --resume needs the input of the interrupted build",
                            skip - 1
                        ),
                    ));
                    break;
                }
            }
            Ok(Piece::Batch { seqs, bytes_read }) => {
                if let Err(e) = writer.append(&seqs) {
                    result = Err(e);
                    break;
                }
                pb.set_position(bytes_read);
                let done = writer.token_count() - start_tokens;
                pb.set_message(format!(
                    "building {}: {} tokens",
                    args.split,
                    human(done as f64)
                ));
            }
        }
    }
    let _ = reader.join();
    if let Err(e) = result {
        pb.abandon();
        // Whatever was appended is committed, so --resume redoes as little as possible.
        let _ = writer.flush();
        return Err(e);
    }
    let appended = writer.token_count() - start_tokens;
    let summary = writer.finish()?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if summary.sequences_with_id_zero > 0 {
        eprintln!(
            "warning: {} sequences contain token id 0, which the loader feeds as the input at \
             sequence starts",
            summary.sequences_with_id_zero
        );
    }
    eprintln!(
        "{}: {} sequences, {} tokens (max_token_id {}); appended {} tokens in {:.2} s ({} \
         tokens/min)",
        summary.root.join(&args.split).display(),
        summary.seq_count,
        summary.token_count,
        summary.max_token_id,
        appended,
        secs,
        human(appended as f64 / secs.max(1e-9) * 60.0)
    );
    println!("{}", summary.root.display());
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

fn progress(total: Option<u64>, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = match total {
        Some(t) => {
            let pb = ProgressBar::new(t);
            pb.set_style(
                ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            pb
        }
        None => ProgressBar::new_spinner(),
    };
    pb.set_message(what.to_string());
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lines_parse_fast_and_slow() {
        assert_eq!(ids_of_line(b"[1, 2,3]\n", None), Ok(vec![1, 2, 3]));
        assert_eq!(ids_of_line(b" [ ] ", None), Ok(vec![]));
        assert_eq!(
            ids_of_line(br#"{"input_ids": [5, 6], "x": 1}"#, None),
            Ok(vec![5, 6])
        );
        assert_eq!(ids_of_line(br#"{"ids": [7]}"#, Some("ids")), Ok(vec![7]));
        assert!(ids_of_line(b"[2147483648]", None)
            .unwrap_err()
            .contains("2^31"));
        assert!(ids_of_line(b"[1.5]", None).unwrap_err().contains("integer"));
        assert!(ids_of_line(b"[-1]", None).is_err());
        assert!(ids_of_line(b"[1,]", None).is_err());
        assert!(ids_of_line(b"\"text\"", None)
            .unwrap_err()
            .contains("array"));
        assert!(ids_of_line(br#"{"a": 1}"#, None)
            .unwrap_err()
            .contains("--field"));
        assert_eq!(ids_of_line(b"[2147483647]", None), Ok(vec![MAX_TOKEN_ID]));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_give_ids_or_a_message(line in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = ids_of_line(&line, None);
            let _ = ids_of_line(&line, Some("x"));
        }

        #[test]
        fn id_lists_round_trip_whatever_the_spacing(
            ids in proptest::collection::vec(0u32..=MAX_TOKEN_ID, 0..40),
            sep in "[ \t]{0,2},[ \t]{0,2}",
        ) {
            let text: Vec<String> = ids.iter().map(u32::to_string).collect();
            let line = format!("[{}]\n", text.join(&sep));
            proptest::prop_assert_eq!(ids_of_line(line.as_bytes(), None), Ok(ids.clone()));
            let obj = format!("{{\"input_ids\": {}}}", line.trim());
            proptest::prop_assert_eq!(ids_of_line(obj.as_bytes(), None), Ok(ids));
        }
    }
}
