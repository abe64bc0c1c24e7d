//! The corpora `tokens build` reads: JSONL (plain, zstd or gzip) and Parquet, from paths, glob
//! patterns or directories, one bounded chunk of documents at a time.
//!
//! A **document** is one JSONL line or one Parquet row whose selected value is not null.
//! * JSONL: a line is a JSON string (text), an array of token ids, or an object whose member
//!   names the value (`field`). Blank lines are not documents. Compression is recognised by its
//!   magic bytes (zstd `28 B5 2F FD`, gzip `1F 8B`; concatenated frames and members are read).
//! * Parquet: the top-level column `field`, holding strings (text) or lists of integers (ids),
//!   read a few hundred rows at a time through the `parquet` crate's Arrow reader, so memory
//!   stays bounded by a page and a batch whatever the file's size.
//!
//! Locations in messages: JSONL lines are numbered from 1, Parquet rows from 0 (as pyarrow
//! indexes them); a decompression error gives the compressed byte offset reached.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, OffsetSizeTrait, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;

use super::MAX_TOKEN_ID;
use crate::error::{Error, IoContext, Result};
use crate::json::{self, Value};

/// How an input file is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InputFormat {
    /// JSON Lines, uncompressed.
    Jsonl,
    /// JSON Lines in zstd frames (`.jsonl.zst`).
    JsonlZstd,
    /// JSON Lines in gzip members (`.jsonl.gz`, `.json.gz`).
    JsonlGzip,
    /// An Apache Parquet file.
    Parquet,
}

impl InputFormat {
    /// The format of a file whose first bytes are `head`.
    fn sniff(head: &[u8]) -> InputFormat {
        if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            InputFormat::JsonlZstd
        } else if head.starts_with(&[0x1f, 0x8b]) {
            InputFormat::JsonlGzip
        } else if head.starts_with(b"PAR1") {
            InputFormat::Parquet
        } else {
            InputFormat::Jsonl
        }
    }
}

/// One input of a build: a file, or standard input (`-`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Input {
    /// The file (`-` for standard input).
    pub path: PathBuf,
    /// How it is stored (from its first bytes).
    pub format: InputFormat,
    /// Its size in bytes (None for standard input).
    pub len: Option<u64>,
}

/// Whether `p` is a file a directory scan picks up: JSONL or Parquet, compressed or not.
fn corpus_extension(p: &Path) -> bool {
    let name = p.file_name().map(|n| n.to_string_lossy().to_lowercase());
    let Some(name) = name else { return false };
    let stem = ["zst", "zstd", "gz"]
        .iter()
        .find_map(|c| name.strip_suffix(&format!(".{c}")))
        .unwrap_or(&name);
    [".jsonl", ".json", ".ndjson", ".parquet", ".pq"]
        .iter()
        .any(|e| stem.ends_with(e))
}

/// The inputs named by `specs`, in order: `-` (standard input), a file, a directory (its
/// JSONL/Parquet files, sorted by name), or a glob pattern (`*`, `?`, `[..]`; matches sorted
/// by name). A pattern or directory that names no file is an error, as is a file given twice.
pub(crate) fn expand_inputs<S: AsRef<str>>(specs: &[S]) -> Result<Vec<Input>> {
    if specs.is_empty() {
        return Err(Error::Invalid("no input files given".into()));
    }
    let mut paths: Vec<PathBuf> = Vec::new();
    for spec in specs {
        let spec = spec.as_ref();
        let p = Path::new(spec);
        if spec == "-" {
            paths.push(p.to_path_buf());
        } else if spec.contains(['*', '?', '[']) && !p.exists() {
            let matches = glob::glob(spec)
                .map_err(|e| Error::Invalid(format!("bad glob pattern {spec:?}: {e}")))?;
            let mut found = Vec::new();
            for m in matches {
                let m = m.map_err(|e| Error::io(e.path(), std::io::Error::other(e.to_string())))?;
                if m.is_file() {
                    found.push(m);
                }
            }
            if found.is_empty() {
                return Err(Error::NotFound {
                    path: p.to_path_buf(),
                    what: "the pattern matches no file".into(),
                });
            }
            found.sort();
            paths.extend(found);
        } else if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .at(p)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|e| e.is_file() && corpus_extension(e))
                .collect();
            if found.is_empty() {
                return Err(Error::NotFound {
                    path: p.to_path_buf(),
                    what: "the directory holds no .jsonl/.json/.parquet file (compressed or not)"
                        .into(),
                });
            }
            found.sort();
            paths.extend(found);
        } else {
            paths.push(p.to_path_buf());
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut inputs = Vec::with_capacity(paths.len());
    for path in paths {
        if path != Path::new("-") && !seen.insert(path.clone()) {
            return Err(Error::Invalid(format!(
                "{} is given twice; each document would be built twice",
                path.display()
            )));
        }
        inputs.push(open_input(path)?);
    }
    Ok(inputs)
}

fn open_input(path: PathBuf) -> Result<Input> {
    if path == Path::new("-") {
        // Sniffed when read: standard input cannot be peeked twice.
        return Ok(Input {
            path,
            format: InputFormat::Jsonl,
            len: None,
        });
    }
    let mut f = File::open(&path).at(&path)?;
    let meta = f.metadata().at(&path)?;
    if !meta.is_file() {
        return Err(Error::format(&path, "is not a regular file"));
    }
    let mut head = [0u8; 4];
    let n = read_full(&mut f, &mut head).at(&path)?;
    Ok(Input {
        format: InputFormat::sniff(&head[..n]),
        len: Some(meta.len()),
        path,
    })
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------------
// Documents

/// What a document's value must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Want {
    /// Token ids: a JSON array, or (objects, Parquet) the first of `names` present.
    Ids { names: Vec<String> },
    /// Text to tokenize: a JSON string, or (objects, Parquet) the member/column `name`.
    Text { name: String },
}

impl Want {
    /// `field` or the default names for the mode.
    pub(crate) fn new(field: Option<&str>, text: bool) -> Want {
        match (field, text) {
            (Some(f), true) => Want::Text { name: f.into() },
            (None, true) => Want::Text {
                name: "text".into(),
            },
            (Some(f), false) => Want::Ids {
                names: vec![f.into()],
            },
            (None, false) => Want::Ids {
                names: vec!["input_ids".into(), "tokens".into()],
            },
        }
    }
}

/// A document as read, before its value is extracted (JSONL lines are parsed by the encoding
/// threads, not the reader).
#[derive(Debug)]
pub(crate) enum Raw {
    /// A non-blank JSONL line.
    Line(Vec<u8>),
    /// A Parquet string value.
    Text(String),
    /// A Parquet list of ids (already range-checked).
    Ids(Vec<u32>),
}

impl Raw {
    fn size(&self) -> usize {
        match self {
            Raw::Line(b) => b.len(),
            Raw::Text(s) => s.len(),
            Raw::Ids(v) => v.len() * 4,
        }
    }
}

/// A document's value.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Content {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// A raw document with its place in its file (line from 1, or row from 0).
#[derive(Debug)]
pub(crate) struct Located {
    pub at: u64,
    pub raw: Raw,
}

/// Where a document sits, for messages: `line 12` or `row 11`.
pub(crate) fn place(format: InputFormat, at: u64) -> String {
    match format {
        InputFormat::Parquet => format!("row {at}"),
        _ => format!("line {at}"),
    }
}

/// The value of a raw document: None for a null value (not a document), or why it is refused.
pub(crate) fn extract(raw: Raw, want: &Want) -> std::result::Result<Option<Content>, String> {
    match raw {
        Raw::Text(s) => Ok(Some(Content::Text(s))),
        Raw::Ids(v) => Ok(Some(Content::Ids(v))),
        Raw::Line(line) => match want {
            Want::Ids { names } => ids_of_line(&line, names).map(|v| v.map(Content::Ids)),
            Want::Text { name } => text_of_line(&line, name).map(|t| t.map(Content::Text)),
        },
    }
}

/// A JSONL line of ids: a JSON array of token ids (read without building a JSON tree, the
/// common case), or an object whose first member of `names` present holds one (or null).
pub(crate) fn ids_of_line(
    line: &[u8],
    names: &[String],
) -> std::result::Result<Option<Vec<u32>>, String> {
    let t = trim(line);
    if t.first() == Some(&b'[') {
        if let Some(v) = fast_int_list(t) {
            return v.map(Some);
        }
    }
    let v = json::parse(t).map_err(|e| e.to_string())?;
    let arr = match &v {
        Value::Array(_) => &v,
        Value::Object(_) => match names.iter().find_map(|n| v.get(n)) {
            Some(x) => x,
            None => {
                return Err(format!(
                    "the object has no member {} (name the member with --field)",
                    names
                        .iter()
                        .map(|n| format!("{n:?}"))
                        .collect::<Vec<_>>()
                        .join(" or ")
                ))
            }
        },
        other => {
            return Err(format!(
                "expected a JSON array of token ids (or an object holding one), found {}",
                other.type_name()
            ))
        }
    };
    let items = match arr {
        Value::Array(items) => items,
        Value::Null => return Ok(None),
        other => {
            return Err(format!(
                "expected an array of token ids, found {}",
                other.type_name()
            ))
        }
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
        .collect::<std::result::Result<Vec<u32>, String>>()
        .map(Some)
}

fn parse_id(digits: &[u8]) -> std::result::Result<u32, String> {
    let text = String::from_utf8_lossy(digits);
    let v: u64 = text
        .parse()
        .map_err(|_| format!("token id {text} is not a non-negative integer"))?;
    check_id(v)
}

/// A token id that fits the flat-tokens encoding.
pub(crate) fn check_id(v: u64) -> std::result::Result<u32, String> {
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

/// A JSONL line of text: a JSON string, or an object whose member `name` is one (or null).
pub(crate) fn text_of_line(line: &[u8], name: &str) -> std::result::Result<Option<String>, String> {
    match json::parse(trim(line)).map_err(|e| e.to_string())? {
        Value::String(s) => Ok(Some(s)),
        Value::Null => Ok(None),
        v @ Value::Object(_) => match v.get(name) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Null) => Ok(None),
            Some(other) => Err(format!(
                "member {name:?} must be a string, found {}",
                other.type_name()
            )),
            None => Err(format!(
                "the object has no member {name:?} (name it with --field)"
            )),
        },
        v => Err(format!(
            "expected a JSON string of text (or an object with {name:?}), found {}",
            v.type_name()
        )),
    }
}

pub(crate) fn trim(b: &[u8]) -> &[u8] {
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

// ---------------------------------------------------------------------------------------------
// Reading files

/// Counts the bytes read through it (the compressed offset a decoder has reached).
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// A source of documents from one input file.
pub(crate) trait DocSource {
    /// Appends documents to `out` until about `max_bytes` were added or the file ends; returns
    /// false at the end of the file. Null Parquet values are counted in `nulls`, not returned.
    fn fill(&mut self, out: &mut Vec<Located>, max_bytes: usize, nulls: &mut u64) -> Result<bool>;
    /// Input bytes consumed so far (compressed bytes for compressed files; an estimate for
    /// Parquet, from the rows read).
    fn consumed(&self) -> u64;
}

/// Opens `input` for reading documents holding `want`.
pub(crate) fn open_source(input: &Input, want: &Want) -> Result<Box<dyn DocSource + Send>> {
    let count = Arc::new(AtomicU64::new(0));
    let path = &input.path;
    let raw: Box<dyn Read + Send> = if path == Path::new("-") {
        Box::new(std::io::stdin())
    } else {
        Box::new(File::open(path).at(path)?)
    };
    let mut buffered = BufReader::with_capacity(
        1 << 20,
        Counting {
            inner: raw,
            count: count.clone(),
        },
    );
    let format = if path == Path::new("-") {
        InputFormat::sniff(buffered.fill_buf().at(path)?)
    } else {
        input.format
    };
    let lines: Box<dyn BufRead + Send> = match format {
        InputFormat::Parquet if path == Path::new("-") => {
            return Err(Error::Invalid(
                "Parquet cannot be read from standard input (its index is at the end of the \
                 file); name the file"
                    .into(),
            ))
        }
        InputFormat::Parquet => return Ok(Box::new(ParquetSource::open(path, want)?)),
        InputFormat::Jsonl => Box::new(buffered),
        InputFormat::JsonlZstd => Box::new(BufReader::with_capacity(
            1 << 20,
            zstd::stream::read::Decoder::with_buffer(buffered).at(path)?,
        )),
        InputFormat::JsonlGzip => Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::bufread::MultiGzDecoder::new(buffered),
        )),
    };
    Ok(Box::new(JsonlSource {
        path: path.clone(),
        format,
        lines,
        line_no: 0,
        count,
        line: Vec::new(),
    }))
}

/// Checks the start of every input before anything is written: a Parquet file's footer holds
/// the column `want` names with a usable type, and a JSONL file's (or compressed JSONL's) first
/// document has the member it names. A build given the wrong `field` (or a file that cannot be
/// opened or decompressed) thus fails before the split is created, not after, when the rerun
/// would find an empty interrupted split. Standard input is checked as it is read.
pub(crate) fn check_inputs(inputs: &[Input], want: &Want) -> Result<()> {
    for i in inputs {
        if i.format == InputFormat::Parquet {
            ParquetSource::open(&i.path, want)?;
            continue;
        }
        if i.path == Path::new("-") {
            continue;
        }
        let mut source = open_source(i, want)?;
        let (mut docs, mut nulls) = (Vec::new(), 0);
        source.fill(&mut docs, FIRST_DOCUMENT_BYTES, &mut nulls)?;
        for d in docs {
            let at = d.at;
            let content = extract(d.raw, want)
                .map_err(|m| Error::format(&i.path, format!("{}: {m}", place(i.format, at))))?;
            if content.is_some() {
                break;
            }
        }
    }
    Ok(())
}

/// Bytes of documents [`check_inputs`] reads at the start of a JSONL input.
const FIRST_DOCUMENT_BYTES: usize = 64 << 10;

struct JsonlSource {
    path: PathBuf,
    format: InputFormat,
    lines: Box<dyn BufRead + Send>,
    line_no: u64,
    count: Arc<AtomicU64>,
    line: Vec<u8>,
}

impl DocSource for JsonlSource {
    fn fill(&mut self, out: &mut Vec<Located>, max_bytes: usize, _nulls: &mut u64) -> Result<bool> {
        let mut added = 0;
        while added < max_bytes {
            self.line.clear();
            let n = self.lines.read_until(b'\n', &mut self.line).map_err(|e| {
                let what = match self.format {
                    InputFormat::JsonlZstd => "corrupt or truncated zstd stream",
                    InputFormat::JsonlGzip => "corrupt or truncated gzip stream",
                    _ => "read failed",
                };
                Error::format(
                    &self.path,
                    format!(
                        "{what} near compressed byte {} (after line {}): {e}",
                        self.count.load(Ordering::Relaxed),
                        self.line_no
                    ),
                )
            })?;
            if n == 0 {
                return Ok(false);
            }
            self.line_no += 1;
            if trim(&self.line).is_empty() {
                continue;
            }
            added += self.line.len();
            out.push(Located {
                at: self.line_no,
                raw: Raw::Line(std::mem::take(&mut self.line)),
            });
        }
        Ok(true)
    }

    fn consumed(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Rows per Arrow batch: small enough that a batch of long documents (books) stays a few
/// hundred MB at most, large enough to amortise the reader.
const PARQUET_BATCH_ROWS: usize = 256;

/// What the selected Parquet column holds.
#[derive(Debug, Clone, Copy)]
enum ColumnKind {
    Text,
    Ids,
}

struct ParquetSource {
    path: PathBuf,
    file: File,
    metadata: ArrowReaderMetadata,
    mask: ProjectionMask,
    kind: ColumnKind,
    column: String,
    /// The row group being read, its reader and its first row.
    group: Option<(usize, ParquetRecordBatchReader, u64)>,
    next_group: usize,
    rows_done: u64,
    rows_total: u64,
    file_len: u64,
}

/// Whether `t` is a string type the reader can hand out as text.
fn is_text(t: &DataType) -> bool {
    match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(_, v) => is_text(v),
        _ => false,
    }
}

/// Whether `t` is a list of integers.
fn is_id_list(t: &DataType) -> bool {
    match t {
        DataType::List(f) | DataType::LargeList(f) => f.data_type().is_integer(),
        _ => false,
    }
}

impl ParquetSource {
    /// Reads the footer and checks the column; rows are read one row group at a time, so an
    /// error names its row group and rows.
    fn open(path: &Path, want: &Want) -> Result<ParquetSource> {
        let bad = |e: parquet::errors::ParquetError| {
            Error::format(path, format!("not a readable Parquet file: {e}"))
        };
        let file = File::open(path).at(path)?;
        let file_len = file.metadata().at(path)?.len();
        let metadata =
            ArrowReaderMetadata::load(&file, ArrowReaderOptions::default()).map_err(bad)?;
        let schema = metadata.schema().clone();
        let names: Vec<&str> = match want {
            Want::Text { name } => vec![name],
            Want::Ids { names } => names.iter().map(String::as_str).collect(),
        };
        let found = names
            .iter()
            .find_map(|n| schema.index_of(n).ok().map(|i| (i, *n)));
        let Some((index, column)) = found else {
            let have: Vec<String> = schema
                .fields()
                .iter()
                .map(|f| format!("{:?}", f.name()))
                .collect();
            let hint = match want {
                Want::Ids { .. } if schema.index_of("text").is_ok() => {
                    "; it has a \"text\" column: give a tokenizer to build from text"
                }
                _ => "; choose one with --field",
            };
            return Err(Error::format(
                path,
                format!(
                    "has no column {} (its columns: {}){hint}",
                    names
                        .iter()
                        .map(|n| format!("{n:?}"))
                        .collect::<Vec<_>>()
                        .join(" or "),
                    have.join(", ")
                ),
            ));
        };
        let t = schema.field(index).data_type();
        let kind = match want {
            Want::Text { .. } if is_text(t) => ColumnKind::Text,
            Want::Ids { .. } if is_id_list(t) => ColumnKind::Ids,
            Want::Text { .. } => {
                return Err(Error::format(
                    path,
                    format!(
                        "column {column:?} is {t}, not strings; with a tokenizer the column \
                         must hold text{}",
                        if is_id_list(t) {
                            " (it holds token ids: build without a tokenizer)"
                        } else {
                            ""
                        }
                    ),
                ))
            }
            Want::Ids { .. } => {
                return Err(Error::format(
                    path,
                    format!(
                        "column {column:?} is {t}, not a list of integer token ids{}",
                        if is_text(t) {
                            " (it holds text: give a tokenizer)"
                        } else {
                            ""
                        }
                    ),
                ))
            }
        };
        let rows_total = metadata.metadata().file_metadata().num_rows().max(0) as u64;
        let mask = ProjectionMask::roots(metadata.parquet_schema(), [index]);
        Ok(ParquetSource {
            path: path.to_path_buf(),
            file,
            metadata,
            mask,
            kind,
            column: column.to_string(),
            group: None,
            next_group: 0,
            rows_done: 0,
            rows_total,
            file_len,
        })
    }

    /// The rows of row group `g`, for messages.
    fn group_place(&self, g: usize, first: u64) -> String {
        let rows = self.metadata.metadata().row_group(g).num_rows().max(0) as u64;
        format!(
            "column {:?}, row group {g} (rows {first} to {})",
            self.column,
            (first + rows).saturating_sub(1)
        )
    }

    /// The reader of the next row group (None after the last).
    fn next_reader(&mut self) -> Result<bool> {
        let n = self.metadata.metadata().num_row_groups();
        if self.next_group >= n {
            return Ok(false);
        }
        let g = self.next_group;
        self.next_group += 1;
        let first = self.rows_done;
        let file = self.file.try_clone().at(&self.path)?;
        let reader =
            ParquetRecordBatchReaderBuilder::new_with_metadata(file, self.metadata.clone())
                .with_row_groups(vec![g])
                .with_projection(self.mask.clone())
                .with_batch_size(PARQUET_BATCH_ROWS)
                .build()
                .map_err(|e| {
                    Error::format(
                        &self.path,
                        format!("{}: cannot read: {e}", self.group_place(g, first)),
                    )
                })?;
        self.group = Some((g, reader, first));
        Ok(true)
    }

    fn push_batch(
        &self,
        batch: &RecordBatch,
        out: &mut Vec<Located>,
        nulls: &mut u64,
    ) -> Result<usize> {
        let col = batch.column(0);
        let first = self.rows_done;
        let mut added = 0;
        let mut push = |i: usize, raw: Raw| {
            added += raw.size();
            out.push(Located {
                at: first + i as u64,
                raw,
            });
        };
        match self.kind {
            ColumnKind::Text => {
                let texts = strings(col).map_err(|m| self.at(first, m))?;
                for (i, t) in texts.into_iter().enumerate() {
                    match t {
                        Some(t) => push(i, Raw::Text(t)),
                        None => *nulls += 1,
                    }
                }
            }
            ColumnKind::Ids => {
                let lists = id_lists(col).map_err(|(i, m)| self.at(first + i as u64, m))?;
                for (i, l) in lists.into_iter().enumerate() {
                    match l {
                        Some(ids) => push(i, Raw::Ids(ids)),
                        None => *nulls += 1,
                    }
                }
            }
        }
        Ok(added)
    }

    fn at(&self, row: u64, msg: String) -> Error {
        Error::format(
            &self.path,
            format!("column {:?}, row {row}: {msg}", self.column),
        )
    }
}

impl DocSource for ParquetSource {
    fn fill(&mut self, out: &mut Vec<Located>, max_bytes: usize, nulls: &mut u64) -> Result<bool> {
        let mut added = 0;
        while added < max_bytes {
            if self.group.is_none() && !self.next_reader()? {
                return Ok(false);
            }
            let Some((g, reader, first)) = self.group.as_mut() else {
                return Ok(false);
            };
            let (g, first) = (*g, *first);
            let batch = match reader.next() {
                None => {
                    self.group = None;
                    continue;
                }
                Some(Ok(b)) => b,
                Some(Err(e)) => {
                    return Err(Error::format(
                        &self.path,
                        format!(
                            "{}: cannot decode the rows from row {} on (a corrupt page?): {e}",
                            self.group_place(g, first),
                            self.rows_done
                        ),
                    ))
                }
            };
            added += self.push_batch(&batch, out, nulls)?;
            self.rows_done += batch.num_rows() as u64;
        }
        Ok(true)
    }

    fn consumed(&self) -> u64 {
        if self.rows_total == 0 {
            return 0;
        }
        (self.file_len as f64 * (self.rows_done as f64 / self.rows_total as f64)) as u64
    }
}

/// The values of a string column (any Arrow string type, dictionary-encoded or not).
fn strings(col: &ArrayRef) -> std::result::Result<Vec<Option<String>>, String> {
    fn offsets<O: OffsetSizeTrait>(a: &dyn Array) -> Option<Vec<Option<String>>> {
        let s = a.as_string_opt::<O>()?;
        Some(s.iter().map(|v| v.map(str::to_owned)).collect())
    }
    let flat = |a: &dyn Array| -> Option<Vec<Option<String>>> {
        offsets::<i32>(a).or_else(|| offsets::<i64>(a)).or_else(|| {
            a.as_string_view_opt()
                .map(|s| s.iter().map(|v| v.map(str::to_owned)).collect())
        })
    };
    if let Some(v) = flat(col.as_ref()) {
        return Ok(v);
    }
    if let Some(d) = col.as_any_dictionary_opt() {
        let values = flat(d.values().as_ref()).ok_or("dictionary values are not strings")?;
        let keys = d.normalized_keys();
        return Ok((0..col.len())
            .map(|i| {
                if col.is_null(i) {
                    None
                } else {
                    values.get(keys[i]).cloned().flatten()
                }
            })
            .collect());
    }
    Err(format!("expected strings, found {}", col.data_type()))
}

/// The values of a list-of-integers column, each id range-checked; a failure gives the row
/// within the batch.
#[allow(clippy::type_complexity)]
fn id_lists(col: &ArrayRef) -> std::result::Result<Vec<Option<Vec<u32>>>, (usize, String)> {
    fn lists<O: OffsetSizeTrait>(
        col: &dyn Array,
    ) -> Option<std::result::Result<Vec<Option<Vec<u32>>>, (usize, String)>> {
        let l = col.as_list_opt::<O>()?;
        Some(
            (0..l.len())
                .map(|i| {
                    if l.is_null(i) {
                        return Ok(None);
                    }
                    ints(l.value(i).as_ref()).map(Some).map_err(|m| (i, m))
                })
                .collect(),
        )
    }
    lists::<i32>(col.as_ref())
        .or_else(|| lists::<i64>(col.as_ref()))
        .unwrap_or_else(|| {
            Err((
                0,
                format!("expected lists of ids, found {}", col.data_type()),
            ))
        })
}

/// Integer values as token ids: no nulls, none negative, all below 2^31.
fn ints(a: &dyn Array) -> std::result::Result<Vec<u32>, String> {
    if a.null_count() > 0 {
        return Err("a list of token ids holds a null".into());
    }
    macro_rules! conv {
        ($t:ty) => {
            if let Some(p) = a.as_primitive_opt::<$t>() {
                return p
                    .values()
                    .iter()
                    .map(|&v| {
                        let v = i128::from(v);
                        if v < 0 {
                            Err(format!("token id {v} is negative"))
                        } else {
                            check_id(v as u64)
                        }
                    })
                    .collect();
            }
        };
    }
    conv!(Int8Type);
    conv!(Int16Type);
    conv!(Int32Type);
    conv!(Int64Type);
    conv!(UInt8Type);
    conv!(UInt16Type);
    conv!(UInt32Type);
    conv!(UInt64Type);
    Err(format!(
        "token ids must be integers, found {}",
        a.data_type()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn id_lines_parse_fast_and_slow() {
        let d = ids(&["input_ids", "tokens"]);
        assert_eq!(ids_of_line(b"[1, 2,3]\n", &d), Ok(Some(vec![1, 2, 3])));
        assert_eq!(ids_of_line(b" [ ] ", &d), Ok(Some(vec![])));
        assert_eq!(
            ids_of_line(br#"{"input_ids": [5, 6], "x": 1}"#, &d),
            Ok(Some(vec![5, 6]))
        );
        assert_eq!(ids_of_line(br#"{"tokens": null}"#, &d), Ok(None));
        assert_eq!(
            ids_of_line(br#"{"ids": [7]}"#, &ids(&["ids"])),
            Ok(Some(vec![7]))
        );
        assert!(ids_of_line(b"[2147483648]", &d)
            .unwrap_err()
            .contains("2^31"));
        assert!(ids_of_line(b"[1.5]", &d).unwrap_err().contains("integer"));
        assert!(ids_of_line(b"[-1]", &d).unwrap_err().contains("-1"));
        assert!(ids_of_line(b"[1,]", &d).unwrap_err().contains("JSON"));
        assert!(ids_of_line(b"\"text\"", &d).unwrap_err().contains("array"));
        assert!(ids_of_line(br#"{"a": 1}"#, &d)
            .unwrap_err()
            .contains("--field"));
        assert_eq!(
            ids_of_line(b"[2147483647]", &d),
            Ok(Some(vec![MAX_TOKEN_ID]))
        );
    }

    #[test]
    fn text_lines() {
        assert_eq!(text_of_line(br#""a b""#, "text"), Ok(Some("a b".into())));
        assert_eq!(
            text_of_line(br#"{"id": 1, "text": "x"}"#, "text"),
            Ok(Some("x".into()))
        );
        assert_eq!(text_of_line(br#"{"text": null}"#, "text"), Ok(None));
        assert!(text_of_line(br#"{"text": 5}"#, "text")
            .unwrap_err()
            .contains("must be a string, found a number"));
        assert!(text_of_line(br#"{"body": "x"}"#, "text")
            .unwrap_err()
            .contains("no member \"text\""));
        assert!(text_of_line(b"[1]", "text").unwrap_err().contains("array"));
        assert!(text_of_line(b"{", "text").unwrap_err().contains("JSON"));
    }

    #[test]
    fn formats_are_sniffed_and_directories_filtered() {
        assert_eq!(
            InputFormat::sniff(&[0x28, 0xb5, 0x2f, 0xfd]),
            InputFormat::JsonlZstd
        );
        assert_eq!(
            InputFormat::sniff(&[0x1f, 0x8b, 8, 0]),
            InputFormat::JsonlGzip
        );
        assert_eq!(InputFormat::sniff(b"PAR1"), InputFormat::Parquet);
        assert_eq!(InputFormat::sniff(b"{\"te"), InputFormat::Jsonl);
        assert_eq!(InputFormat::sniff(b""), InputFormat::Jsonl);
        for yes in [
            "a.jsonl",
            "b.json.gz",
            "c.jsonl.zst",
            "d.parquet",
            "E.PARQUET",
            "f.ndjson.zstd",
        ] {
            assert!(corpus_extension(Path::new(yes)), "{yes}");
        }
        for no in ["a.txt", "b.gz", "c.zst", "README", "d.parquet.bak"] {
            assert!(!corpus_extension(Path::new(no)), "{no}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_give_a_value_or_a_message(line in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = ids_of_line(&line, &ids(&["x"]));
            let _ = text_of_line(&line, "x");
        }

        #[test]
        fn id_lists_round_trip_whatever_the_spacing(
            v in proptest::collection::vec(0u32..=MAX_TOKEN_ID, 0..40),
            sep in "[ \t]{0,2},[ \t]{0,2}",
        ) {
            let text: Vec<String> = v.iter().map(u32::to_string).collect();
            let line = format!("[{}]\n", text.join(&sep));
            let d = ids(&["input_ids"]);
            proptest::prop_assert_eq!(ids_of_line(line.as_bytes(), &d), Ok(Some(v.clone())));
            let obj = format!("{{\"input_ids\": {}}}", line.trim());
            proptest::prop_assert_eq!(ids_of_line(obj.as_bytes(), &d), Ok(Some(v)));
        }
    }
}
