//! Building a split from corpora: documents read from JSONL/Parquet files ([`corpus`]),
//! tokenized on every core, appended in input order by the crash-safe [`Writer`].
//!
//! Three stages joined by bounded channels, so memory stays at a few chunks whatever the
//! corpus size: a reader thread (files, decompression, Parquet pages; chunks of about 1 MiB of
//! documents per thread), an encoding stage (JSON parsing and tokenization of a chunk on a
//! rayon pool of `threads` threads, order kept), and the caller's thread appending to the
//! split. A fault in any stage (an error, or a panic) ends the build with an error naming it;
//! what was appended before is committed, and `resume` continues from there.
//!
//! [`corpus`]: super::corpus

use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use rayon::prelude::*;

use super::corpus::{self, expand_inputs, extract, place, Content, Input, Located, Want};
use super::{Completion, Layout, Split, WriteSummary, Writer, WriterOptions, MAX_TOKEN_ID};
use crate::error::{Error, Result};

/// A Hugging Face tokenizer (`tokenizer.json`), applied as seqax's tools do: no special tokens
/// added, and no truncation or padding (a corpus keeps whole documents, whatever the file
/// configures).
pub struct Tokenizer(tokenizers::Tokenizer);

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tokenizer").finish_non_exhaustive()
    }
}

/// A tokenizer from the JSON text of a `tokenizer.json`.
impl std::str::FromStr for Tokenizer {
    type Err = Error;
    fn from_str(text: &str) -> Result<Tokenizer> {
        let t: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| Error::Invalid(format!("cannot load the tokenizer: {e}")))?;
        Ok(Tokenizer::plain(t))
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::format(path, format!("cannot load the tokenizer: {e}")))?;
        Ok(Self::plain(t))
    }

    fn plain(mut t: tokenizers::Tokenizer) -> Tokenizer {
        t.with_padding(None);
        // Removing truncation cannot fail (only setting invalid parameters does).
        let _ = t.with_truncation(None);
        Tokenizer(t)
    }

    /// The token ids of `text`.
    pub(crate) fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        let e = self
            .0
            .encode_fast(text, false)
            .map_err(|e| format!("the tokenizer failed: {e}"))?;
        let ids = e.get_ids();
        if let Some(&bad) = ids.iter().find(|&&id| id > MAX_TOKEN_ID) {
            return Err(format!(
                "the tokenizer produced id {bad}, which does not fit the flat-tokens encoding \
                 (ids must be below 2^31)"
            ));
        }
        Ok(ids.to_vec())
    }
}

/// Options of [`build`].
#[derive(Debug, Default)]
pub struct BuildOptions {
    /// The JSONL member / Parquet column holding each document. Default: `text` with a
    /// tokenizer; otherwise `input_ids`, then `tokens`.
    pub field: Option<String>,
    /// Tokenizes text documents; without it documents must be token ids.
    pub tokenizer: Option<Tokenizer>,
    /// Layout of a new dataset (default v3); an existing dataset keeps its own.
    pub layout: Option<Layout>,
    /// Continue an interrupted build of the split from the same inputs: the documents already
    /// committed are skipped (the last of them is checked against the split).
    pub resume: bool,
    /// Append every document to an existing, finished split.
    pub append: bool,
    /// Commit every this many tokens (0: the writer's default).
    pub checkpoint_tokens: u64,
    /// Threads that parse and tokenize (0: every core).
    pub threads: usize,
}

/// Where a build stands, reported after each chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildProgress {
    /// Input bytes consumed (compressed bytes for compressed files).
    pub bytes_read: u64,
    /// Size of all inputs (None when reading standard input).
    pub bytes_total: Option<u64>,
    /// Sequences appended by this build.
    pub sequences: u64,
    /// Tokens appended by this build.
    pub tokens: u64,
}

/// What [`build`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildSummary {
    /// The split as finished (counts over the whole split).
    pub write: WriteSummary,
    /// The input files read, in order.
    pub inputs: Vec<PathBuf>,
    /// Documents skipped because the split already held them (resume).
    pub skipped_documents: u64,
    /// Sequences appended by this build.
    pub appended_sequences: u64,
    /// Tokens appended by this build.
    pub appended_tokens: u64,
    /// Rows/lines whose value was null: not documents, not written.
    pub null_values: u64,
    /// Input bytes read.
    pub bytes_read: u64,
}

/// A chunk of documents on its way to the encoding stage.
enum ToEncoder {
    Docs {
        input: usize,
        docs: Vec<Located>,
        nulls: u64,
        bytes_read: u64,
    },
    /// The last document the split already holds (resume): tokenized and compared.
    Check {
        input: usize,
        at: u64,
        content: Content,
    },
    End,
}

/// Encoded sequences on their way to the writer.
enum ToWriter {
    Seqs {
        seqs: Vec<Vec<u32>>,
        bytes_read: u64,
    },
    Check {
        input: usize,
        at: u64,
        ids: Vec<u32>,
    },
    End,
}

/// Appends the documents of `inputs` (paths, glob patterns, directories or `-`; see
/// `corpus::expand_inputs`) to `split` of the dataset at `root`,
/// creating it as needed. `progress` is called after each chunk; an error it returns stops
/// the build (what was appended is committed). Bad input (a missing column, a non-string
/// value, a corrupt Parquet page, a truncated zstd frame) ends the build with an error naming
/// the file and the line, row or byte offset.
pub fn build<S: AsRef<str>>(
    root: impl AsRef<Path>,
    split: &str,
    inputs: &[S],
    options: &BuildOptions,
    progress: &mut dyn FnMut(&BuildProgress) -> Result<()>,
) -> Result<BuildSummary> {
    let root = root.as_ref();
    let inputs = expand_inputs(inputs)?;
    let want = Want::new(options.field.as_deref(), options.tokenizer.is_some());
    if options.resume && options.append {
        return Err(Error::Invalid(
            "resume and append exclude each other: resume continues an interrupted build, \
             append adds to a finished one"
                .into(),
        ));
    }
    // A wrong column or member fails here, before the dataset is created or touched.
    corpus::check_inputs(&inputs, &want)?;
    if options.append && root.join(split).is_dir() {
        let s = Split::open_unvalidated(root, split)?;
        if s.info().completion == Completion::Interrupted {
            return Err(Error::Interrupted {
                path: root.to_path_buf(),
                detail: "a build did not finish; resume it before appending".into(),
            });
        }
    }
    let mut writer_options = WriterOptions {
        layout: options.layout,
        resume: options.resume || options.append,
        ..WriterOptions::default()
    };
    if options.checkpoint_tokens > 0 {
        writer_options.checkpoint_tokens = options.checkpoint_tokens;
    }
    let mut writer = Writer::create(root, split, writer_options)?;
    let skip = if options.resume {
        writer.info().resumed_from.unwrap_or(0)
    } else {
        0
    };
    let threads = match options.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("shardkit-tokenize-{i}"))
        .build()
        .map_err(|e| Error::Thread {
            what: format!("{threads} tokenizing threads"),
            source: std::io::Error::other(e),
        })?;
    // About a MiB of documents per thread keeps every thread busy within a chunk.
    let chunk_bytes = (threads << 20).clamp(4 << 20, 64 << 20);
    let bytes_total = inputs.iter().map(|i| i.len).sum::<Option<u64>>();
    let start_seqs = writer.seq_count();
    let start_tokens = writer.token_count();

    let (to_encoder, encoder_rx) = sync_channel::<ToEncoder>(2);
    let (to_writer, writer_rx) = sync_channel::<ToWriter>(2);
    let (outcome, reader_result, encoder_result) = std::thread::scope(|s| {
        let reader = std::thread::Builder::new()
            .name("shardkit-read".into())
            .spawn_scoped(s, || {
                read_docs(&inputs, &want, skip, chunk_bytes, to_encoder)
            })
            .map_err(|source| Error::Thread {
                what: "the reading thread".into(),
                source,
            });
        let encoder = std::thread::Builder::new()
            .name("shardkit-encode".into())
            .spawn_scoped(s, || {
                encode_docs(encoder_rx, to_writer, &pool, &want, options, &inputs)
            })
            .map_err(|source| Error::Thread {
                what: "the encoding thread".into(),
                source,
            });
        let outcome = match (&reader, &encoder) {
            (Ok(_), Ok(_)) => write_docs(
                writer_rx,
                &mut writer,
                root,
                split,
                skip,
                &inputs,
                bytes_total,
                (start_seqs, start_tokens),
                progress,
            ),
            (Err(e), _) | (_, Err(e)) => {
                drop(writer_rx);
                Err(WriteEnd::Failed(Error::Invalid(e.to_string())))
            }
        };
        let join = |h: Result<std::thread::ScopedJoinHandle<'_, Result<u64>>>, who: &str| match h {
            Err(_) => Ok(0),
            Ok(h) => h.join().unwrap_or_else(|p| {
                Err(Error::Internal(format!(
                    "the {who} thread panicked: {}",
                    panic_message(&p)
                )))
            }),
        };
        let r = join(reader, "reading");
        let e = join(encoder, "tokenizing");
        (outcome, r, e)
    });
    if let Err(end) = outcome {
        let err = match end {
            WriteEnd::Failed(e) => e,
            // The encoding stage stopped without its end mark: the reader or the encoder
            // failed (an error or a panic), never the end of the input.
            WriteEnd::Disconnected => match (reader_result, encoder_result) {
                (Err(e), _) | (_, Err(e)) => e,
                _ => Error::Internal(
                    "the build's worker threads stopped before the end of the input".into(),
                ),
            },
        };
        // Whatever was appended is committed, so a resume redoes as little as possible.
        let _ = writer.flush();
        return Err(err);
    }
    let bytes_read = reader_result?;
    let nulls = encoder_result?;
    let appended_sequences = writer.seq_count() - start_seqs;
    let appended_tokens = writer.token_count() - start_tokens;
    let write = writer.finish()?;
    Ok(BuildSummary {
        write,
        inputs: inputs.into_iter().map(|i| i.path).collect(),
        skipped_documents: skip,
        appended_sequences,
        appended_tokens,
        null_values: nulls,
        bytes_read,
    })
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// The reading stage: every document of `inputs` in order, in chunks of about `chunk_bytes`,
/// after skipping the first `skip` documents (the last of which is sent for checking). Returns
/// the input bytes read. A closed channel (the writer stopped) ends it quietly.
fn read_docs(
    inputs: &[Input],
    want: &Want,
    skip: u64,
    chunk_bytes: usize,
    tx: SyncSender<ToEncoder>,
) -> Result<u64> {
    let mut seen = 0u64;
    let mut done_bytes = 0u64;
    for (index, input) in inputs.iter().enumerate() {
        let mut source = corpus::open_source(input, want)?;
        let mut more = true;
        while more {
            let mut docs = Vec::new();
            let mut nulls = 0;
            more = source.fill(&mut docs, chunk_bytes, &mut nulls)?;
            if seen < skip {
                // Skipped documents are only parsed (a null value is not a document), never
                // tokenized; the last of them is checked against the split.
                let mut rest = Vec::new();
                for d in docs {
                    if seen == skip {
                        rest.push(d);
                        continue;
                    }
                    let at = d.at;
                    let content = extract(d.raw, want).map_err(|m| {
                        Error::format(&input.path, format!("{}: {m}", place(input.format, at)))
                    })?;
                    let Some(content) = content else { continue };
                    seen += 1;
                    if seen == skip {
                        let check = ToEncoder::Check {
                            input: index,
                            at,
                            content,
                        };
                        if tx.send(check).is_err() {
                            return Ok(done_bytes);
                        }
                    }
                }
                docs = rest;
            }
            if docs.is_empty() && nulls == 0 {
                continue;
            }
            let msg = ToEncoder::Docs {
                input: index,
                docs,
                nulls,
                bytes_read: done_bytes + source.consumed(),
            };
            if tx.send(msg).is_err() {
                return Ok(done_bytes);
            }
        }
        done_bytes += input.len.unwrap_or_else(|| source.consumed());
    }
    if seen < skip {
        return Err(Error::format(
            &inputs[inputs.len() - 1].path,
            format!(
                "the inputs hold {seen} documents, but the split already has {skip}; resuming \
                 needs the inputs of the interrupted build"
            ),
        ));
    }
    let _ = tx.send(ToEncoder::End);
    Ok(done_bytes)
}

/// The value of one document as token ids (None: a null value).
fn encode_one(
    d: Located,
    want: &Want,
    tokenizer: Option<&Tokenizer>,
) -> std::result::Result<Option<Vec<u32>>, (u64, String)> {
    let at = d.at;
    match extract(d.raw, want).map_err(|m| (at, m))? {
        None => Ok(None),
        Some(Content::Ids(ids)) => Ok(Some(ids)),
        Some(Content::Text(t)) => match tokenizer {
            Some(tok) => tok.encode(&t).map(Some).map_err(|m| (at, m)),
            None => Err((at, "a text document needs a tokenizer".into())),
        },
    }
}

/// The encoding stage: each chunk parsed and tokenized on `pool`, in order. Returns the null
/// values seen (not documents).
fn encode_docs(
    rx: Receiver<ToEncoder>,
    tx: SyncSender<ToWriter>,
    pool: &rayon::ThreadPool,
    want: &Want,
    options: &BuildOptions,
    inputs: &[Input],
) -> Result<u64> {
    let tokenizer = options.tokenizer.as_ref();
    let located = |input: usize, (at, m): (u64, String)| {
        let i = &inputs[input];
        Error::format(&i.path, format!("{}: {m}", place(i.format, at)))
    };
    let mut total_nulls = 0;
    for msg in rx {
        let out = match msg {
            ToEncoder::Docs {
                input,
                docs,
                nulls,
                bytes_read,
            } => {
                let encoded: Vec<_> = pool.install(|| {
                    docs.into_par_iter()
                        .map(|d| encode_one(d, want, tokenizer))
                        .collect()
                });
                let mut seqs = Vec::with_capacity(encoded.len());
                let mut nulls = nulls;
                for e in encoded {
                    match e.map_err(|e| located(input, e))? {
                        Some(s) => seqs.push(s),
                        None => nulls += 1,
                    }
                }
                total_nulls += nulls;
                ToWriter::Seqs { seqs, bytes_read }
            }
            ToEncoder::Check { input, at, content } => {
                let ids = match content {
                    Content::Ids(ids) => ids,
                    Content::Text(t) => match tokenizer {
                        Some(tok) => tok.encode(&t).map_err(|m| located(input, (at, m)))?,
                        None => {
                            return Err(located(
                                input,
                                (at, "a text document needs a tokenizer".into()),
                            ))
                        }
                    },
                };
                ToWriter::Check { input, at, ids }
            }
            ToEncoder::End => ToWriter::End,
        };
        if tx.send(out).is_err() {
            break;
        }
    }
    Ok(total_nulls)
}

/// How the writing stage ended early.
enum WriteEnd {
    /// An error of its own (appending, checking, or the progress callback).
    Failed(Error),
    /// The encoding stage went away without its end mark.
    Disconnected,
}

/// The writing stage (the caller's thread): appends each chunk's sequences, checks a resumed
/// split, reports progress.
#[allow(clippy::too_many_arguments)]
fn write_docs(
    rx: Receiver<ToWriter>,
    writer: &mut Writer,
    root: &Path,
    split: &str,
    skip: u64,
    inputs: &[Input],
    bytes_total: Option<u64>,
    (start_seqs, start_tokens): (u64, u64),
    progress: &mut dyn FnMut(&BuildProgress) -> Result<()>,
) -> std::result::Result<(), WriteEnd> {
    loop {
        match rx.recv() {
            Err(_) => return Err(WriteEnd::Disconnected),
            Ok(ToWriter::End) => return Ok(()),
            Ok(ToWriter::Check { input, at, ids }) => {
                let have = Split::open_unvalidated(root, split)
                    .and_then(|s| s.ids(skip - 1))
                    .map_err(WriteEnd::Failed)?;
                if have != ids {
                    let i = &inputs[input];
                    return Err(WriteEnd::Failed(Error::format(
                        &i.path,
                        format!(
                            "{}: document {} of the inputs differs from the last sequence in \
                             the split; resuming needs the inputs of the interrupted build",
                            place(i.format, at),
                            skip - 1
                        ),
                    )));
                }
            }
            Ok(ToWriter::Seqs { seqs, bytes_read }) => {
                writer.append(&seqs).map_err(WriteEnd::Failed)?;
                progress(&BuildProgress {
                    bytes_read,
                    bytes_total,
                    sequences: writer.seq_count() - start_seqs,
                    tokens: writer.token_count() - start_tokens,
                })
                .map_err(WriteEnd::Failed)?;
            }
        }
    }
}
