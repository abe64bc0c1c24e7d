//! `shardkit bench tokens` (corpus part): `tokens build` from the same documents stored as
//! plain JSONL, zstd JSONL and Parquet, at several thread counts, beside the rate at which
//! each input alone is decoded (one thread: what the build's reading stage does).
//!
//! Documents are synthetic text: words of a 8,192-word vocabulary drawn Zipf-like, lengths
//! from a few words to a few thousand. Text mode tokenizes them with a word-level Hugging Face
//! tokenizer (cheaper per byte than a BPE, so the input formats weigh more in the comparison
//! than they would in real use); ids mode builds from the same documents' token ids (JSON
//! lists, Parquet `list<uint32>`), where reading is all the work there is.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arrow_array::builder::{ListBuilder, StringBuilder, UInt32Builder};
use arrow_array::{ArrayRef, RecordBatch};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use shardkit::flat_tokens::{build, BuildOptions, Split, Tokenizer};
use shardkit::internals::SplitMix64;
use shardkit::json::Value;
use shardkit::{Error, Result};

use crate::bench::{ratio, same_bytes, Digest};

const VOCAB: u64 = 8192;
/// Documents per Parquet row group (about 20 MiB of text).
const ROW_GROUP: usize = 8192;

fn word(i: u64) -> String {
    // Distinct, pronounceable-ish words of 2-9 letters.
    const SYL: [&str; 16] = [
        "ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "an", "el", "or", "um", "pe", "zu", "di",
        "ga",
    ];
    let mut s = String::new();
    let mut x = i + 1;
    while x > 0 {
        s.push_str(SYL[(x % 16) as usize]);
        x /= 16;
    }
    s
}

/// A Zipf-like word index: small indices far more often than large ones.
fn zipf(rng: &mut SplitMix64) -> u32 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((VOCAB as f64).powf(u) - 1.0) as u32
}

/// The token id of word `i`: ids start at 1 (0 is the loader's input at sequence starts), and
/// `[UNK]` takes the id after the words.
fn id_of(i: u32) -> u32 {
    i + 1
}

/// The inputs written for the benchmark.
struct Corpus {
    documents: u64,
    tokens: u64,
    /// What every build must hold, from the ids drawn here: (SHA-256 of every document's ids as
    /// little-endian u32, in order; SHA-256 of the document lengths as little-endian u64).
    expected: (String, String),
    tokenizer: PathBuf,
    text: [PathBuf; 3],
    ids: [PathBuf; 3],
}

const FORMATS: [&str; 3] = ["jsonl", "jsonl_zst", "parquet"];

fn io(p: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(p, e)
}

fn pq_err(p: &Path) -> impl Fn(parquet::errors::ParquetError) -> Error + '_ {
    move |e| Error::format(p, e.to_string())
}

/// Writes the corpus of about `tokens` tokens under `dir` in every form.
fn write_corpus(dir: &Path, tokens: u64) -> Result<Corpus> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tokenizer = dir.join("corpus-tokenizer.json");
    let mut vocab = vec![("\"[UNK]\"".to_string(), u64::from(id_of(VOCAB as u32)))];
    vocab.extend((0..VOCAB).map(|i| (format!("{:?}", word(i)), u64::from(id_of(i as u32)))));
    let vocab: Vec<String> = vocab.iter().map(|(w, i)| format!("{w}: {i}")).collect();
    std::fs::write(
        &tokenizer,
        format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}}, "post_processor": null,
  "decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "[UNK]"}}}}"#,
            vocab.join(", ")
        ),
    )
    .map_err(io(&tokenizer))?;
    let words: Vec<String> = (0..VOCAB).map(word).collect();
    let name = |mode: &str, f: &str| {
        dir.join(format!(
            "corpus-{mode}.{}",
            match f {
                "jsonl" => "jsonl",
                "jsonl_zst" => "jsonl.zst",
                _ => "parquet",
            }
        ))
    };
    let text = FORMATS.map(|f| name("text", f));
    let ids = FORMATS.map(|f| name("ids", f));
    let mut plain = [
        BufWriter::with_capacity(1 << 20, File::create(&text[0]).map_err(io(&text[0]))?),
        BufWriter::with_capacity(1 << 20, File::create(&ids[0]).map_err(io(&ids[0]))?),
    ];
    let zfile = |p: &PathBuf| -> Result<zstd::Encoder<'static, BufWriter<File>>> {
        zstd::Encoder::new(BufWriter::new(File::create(p).map_err(io(p))?), 3).map_err(io(p))
    };
    let mut zst = [zfile(&text[1])?, zfile(&ids[1])?];
    let props = || {
        WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .set_max_row_group_row_count(Some(ROW_GROUP))
            .build()
    };
    let text_schema = Arc::new(arrow_schema::Schema::new(vec![
        arrow_schema::Field::new("id", arrow_schema::DataType::UInt64, false),
        arrow_schema::Field::new("text", arrow_schema::DataType::Utf8, false),
    ]));
    let ids_schema = RecordBatch::try_from_iter([(
        "input_ids",
        Arc::new(ListBuilder::new(UInt32Builder::new()).finish()) as ArrayRef,
    )])
    .map_err(|e| Error::Invalid(e.to_string()))?
    .schema();
    let pfile = |p: &PathBuf| File::create(p).map_err(io(p));
    let mut ptext = ArrowWriter::try_new(pfile(&text[2])?, text_schema.clone(), Some(props()))
        .map_err(pq_err(&text[2]))?;
    let mut pids = ArrowWriter::try_new(pfile(&ids[2])?, ids_schema, Some(props()))
        .map_err(pq_err(&ids[2]))?;

    let mut rng = SplitMix64(0xc0de);
    let (mut documents, mut written) = (0u64, 0u64);
    let (mut ids_digest, mut lengths_digest) = (Digest::default(), Digest::default());
    while written < tokens {
        let mut idb = Vec::with_capacity(ROW_GROUP);
        let mut tb = StringBuilder::new();
        let mut lb = ListBuilder::new(UInt32Builder::new());
        for _ in 0..ROW_GROUP {
            if written >= tokens {
                break;
            }
            // Lengths from a few words to a few thousand, log-uniform.
            let len = 4f64.powf(1.0 + 4.5 * (rng.next_u64() % 1000) as f64 / 1000.0) as usize;
            let doc: Vec<u32> = (0..len).map(|_| zipf(&mut rng)).collect();
            let le: Vec<u8> = doc.iter().flat_map(|&i| id_of(i).to_le_bytes()).collect();
            ids_digest.update(&le);
            lengths_digest.update(&(len as u64).to_le_bytes());
            let body: Vec<&str> = doc.iter().map(|&i| words[i as usize].as_str()).collect();
            let body = body.join(" ");
            let line = format!("{{\"id\": {documents}, \"text\": \"{body}\"}}\n");
            let ids: Vec<String> = doc.iter().map(|&i| id_of(i).to_string()).collect();
            let ids_line = format!("{{\"input_ids\": [{}]}}\n", ids.join(", "));
            for (w, b) in [(0, &line), (1, &ids_line)] {
                plain[w].write_all(b.as_bytes()).map_err(io(dir))?;
                zst[w].write_all(b.as_bytes()).map_err(io(dir))?;
            }
            idb.push(documents);
            tb.append_value(&body);
            lb.values().extend(doc.iter().map(|&i| Some(id_of(i))));
            lb.append(true);
            documents += 1;
            written += len as u64;
        }
        let batch = RecordBatch::try_new(
            text_schema.clone(),
            vec![
                Arc::new(arrow_array::UInt64Array::from(idb)) as ArrayRef,
                Arc::new(tb.finish()) as ArrayRef,
            ],
        )
        .map_err(|e| Error::Invalid(e.to_string()))?;
        ptext.write(&batch).map_err(pq_err(&text[2]))?;
        let batch = RecordBatch::try_from_iter([("input_ids", Arc::new(lb.finish()) as ArrayRef)])
            .map_err(|e| Error::Invalid(e.to_string()))?;
        pids.write(&batch).map_err(pq_err(&ids[2]))?;
    }
    for w in &mut plain {
        w.flush().map_err(io(dir))?;
    }
    for z in zst {
        z.finish().map_err(io(dir))?.flush().map_err(io(dir))?;
    }
    ptext.close().map_err(pq_err(&text[2]))?;
    pids.close().map_err(pq_err(&ids[2]))?;
    Ok(Corpus {
        documents,
        tokens: written,
        expected: (ids_digest.hex(), lengths_digest.hex()),
        tokenizer,
        text,
        ids,
    })
}

/// Bytes per second through one thread, the input stage's ceiling: JSONL bytes after
/// decompression, or for Parquet the decoded Arrow arrays of the document column.
fn decode_rate(path: &Path, format: &str) -> Result<f64> {
    let t0 = Instant::now();
    let mut bytes = 0u64;
    if format == "parquet" {
        let f = File::open(path).map_err(io(path))?;
        let b = ParquetRecordBatchReaderBuilder::try_new(f).map_err(pq_err(path))?;
        let mask = ProjectionMask::roots(b.parquet_schema(), [b.schema().fields().len() - 1]);
        for batch in b.with_projection(mask).build().map_err(pq_err(path))? {
            let batch = batch.map_err(|e| Error::format(path, e.to_string()))?;
            bytes += batch.get_array_memory_size() as u64;
        }
    } else {
        let f = File::open(path).map_err(io(path))?;
        let r: Box<dyn BufRead> = if format == "jsonl_zst" {
            Box::new(BufReader::with_capacity(
                1 << 20,
                zstd::Decoder::new(f).map_err(io(path))?,
            ))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, f))
        };
        for line in r.split(b'\n') {
            bytes += line.map_err(io(path))?.len() as u64 + 1;
        }
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64())
}

/// The digests of what the train split at `root` holds, as [`Corpus::expected`] has them.
fn built_digests(root: &Path) -> Result<(String, String)> {
    let split = Split::open(root, "train")?;
    let starts = split.seq_starts(0..split.info().seq_count + 1)?;
    let mut lengths = Digest::default();
    for w in starts.windows(2) {
        lengths.update(&(w[1] - w[0]).to_le_bytes());
    }
    let mut ids = Digest::default();
    let total = split.info().token_count;
    let mut at = 0;
    while at < total {
        let end = (at + (1 << 22)).min(total);
        let le: Vec<u8> = split
            .encoded(at..end)?
            .iter()
            .flat_map(|&x| (x >> 1).to_le_bytes())
            .collect();
        ids.update(&le);
        at = end;
    }
    Ok((ids.hex(), lengths.hex()))
}

/// Tokens per second of `tokens build` from `input` with `threads` threads (best of two); each
/// build must hold exactly the corpus' documents (`expected`), or no rate is reported.
fn build_rate(
    dir: &Path,
    input: &Path,
    tokenizer: Option<&Path>,
    threads: usize,
    tokens: u64,
    expected: &(String, String),
) -> Result<f64> {
    let out = dir.join("corpus-build.zarr");
    let mut best = 0f64;
    for _ in 0..2 {
        let _ = std::fs::remove_dir_all(&out);
        let options = BuildOptions {
            tokenizer: tokenizer.map(Tokenizer::from_file).transpose()?,
            threads,
            ..BuildOptions::default()
        };
        let t0 = Instant::now();
        let s = build(
            &out,
            "train",
            &[input.display().to_string()],
            &options,
            &mut |_| Ok(()),
        )?;
        let secs = t0.elapsed().as_secs_f64();
        if s.write.token_count != tokens {
            return Err(Error::Invalid(format!(
                "{}: built {} tokens, expected {tokens}",
                input.display(),
                s.write.token_count
            )));
        }
        best = best.max(tokens as f64 / secs);
        // Outside the timing: the build holds exactly the corpus' documents.
        let (ids, lengths) = built_digests(&out)?;
        let who = format!("tokens build from {}", input.display());
        same_bytes(&who, "the documents' ids", &expected.0, Some(&ids))?;
        same_bytes(&who, "the document lengths", &expected.1, Some(&lengths))?;
    }
    let _ = std::fs::remove_dir_all(&out);
    Ok(best)
}

/// The corpus figures: inputs, decode ceilings, and build rates per format and thread count.
pub fn run(dir: &Path, mtokens: u64, threads: &[usize]) -> Result<Value> {
    eprintln!("corpus: writing about {mtokens} M tokens as JSONL, zstd JSONL and Parquet");
    let c = write_corpus(dir, mtokens * 1_000_000)?;
    let num = |x: f64| Value::float(x, 3);
    let size = |p: &Path| Value::int(std::fs::metadata(p).map_or(0, |m| m.len()));
    let mut modes = Vec::new();
    for (mode, files, tokenizer) in [
        ("text", &c.text, Some(c.tokenizer.as_path())),
        ("ids", &c.ids, None),
    ] {
        let mut inputs = Vec::new();
        for (f, path) in FORMATS.iter().zip(files) {
            let rate = decode_rate(path, f)?;
            inputs.push((
                f.to_string(),
                Value::Object(vec![
                    ("bytes".into(), size(path)),
                    ("decode_bytes_per_s_one_thread".into(), num(rate)),
                ]),
            ));
        }
        let mut rows = Vec::new();
        for &t in threads {
            eprintln!("corpus: {mode} builds with {t} threads");
            let rates: Vec<f64> = files
                .iter()
                .map(|p| build_rate(dir, p, tokenizer, t, c.tokens, &c.expected))
                .collect::<Result<_>>()?;
            rows.push(Value::Object(vec![
                ("threads".into(), Value::int(t as u64)),
                ("jsonl_tokens_per_s".into(), num(rates[0])),
                ("jsonl_zst_tokens_per_s".into(), num(rates[1])),
                ("parquet_tokens_per_s".into(), num(rates[2])),
                (
                    "jsonl_zst_vs_jsonl".into(),
                    num(ratio(
                        &format!("{mode} build, zstd JSONL vs JSONL"),
                        rates[1],
                        rates[0],
                    )?),
                ),
                (
                    "parquet_vs_jsonl".into(),
                    num(ratio(
                        &format!("{mode} build, Parquet vs JSONL"),
                        rates[2],
                        rates[0],
                    )?),
                ),
            ]));
        }
        modes.push((
            mode.to_string(),
            Value::Object(vec![
                ("inputs".into(), Value::Object(inputs)),
                ("builds".into(), Value::Array(rows)),
            ]),
        ));
    }
    for p in c.text.iter().chain(&c.ids).chain([&c.tokenizer]) {
        let _ = std::fs::remove_file(p);
    }
    let mut fields = vec![
        ("documents".into(), Value::int(c.documents)),
        ("tokens".into(), Value::int(c.tokens)),
        (
            "tokenizer".into(),
            Value::String(format!("word-level, {VOCAB} words, whitespace split")),
        ),
    ];
    fields.extend(modes);
    Ok(Value::Object(fields))
}
