//! flat-tokens bindings: writer, split reader, seqax-order loader (wrapped by
//! `shardkit/flat_tokens.py`). The same three rules as the rest of the module: the GIL is
//! released for I/O, errors become natural Python exceptions, arrays cross without a copy.

use std::path::PathBuf;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardkit::flat_tokens::{
    self, Layout, LoaderOptions, Packing, Sharded, Split, TokenBatch, TokenLoader, Writer,
    WriterOptions,
};

use shardkit::json::Value;

use crate::loader::{BatchIter, IntoDict};
use crate::{
    batch_views, contiguous, external_pool, json_of, obj, record, to_py, RustBuffer, SendSlice,
    Storage,
};

fn closed() -> PyErr {
    crate::py_error("InvalidArgumentError", "the writer is closed")
}

/// The layout asked for: "v2", "v3" or None, with the v3 shard and chunk sizes when given.
fn layout_of(
    layout: Option<&str>,
    tokens_per_shard: Option<u64>,
    tokens_per_chunk: Option<u64>,
) -> PyResult<Option<Layout>> {
    let mut layout = layout
        .map(str::parse::<Layout>)
        .transpose()
        .map_err(to_py)?;
    if tokens_per_shard.is_some() || tokens_per_chunk.is_some() {
        let mut s = Sharded::default();
        s.tokens_per_shard = tokens_per_shard.unwrap_or(s.tokens_per_shard);
        s.tokens_per_chunk = tokens_per_chunk.unwrap_or(s.tokens_per_chunk);
        layout = match layout {
            None | Some(Layout::V3(_)) => Some(Layout::V3(s)),
            Some(Layout::V2) => {
                return Err(to_py(shardkit::Error::Invalid(
                    "tokens_per_shard / tokens_per_chunk apply to the v3 layout only".into(),
                )))
            }
        };
    }
    Ok(layout)
}

/// `tokens` (uint32) cut into sequences of `lengths`, checked to add up.
fn sequences_of<'a>(tokens: &'a [u32], lengths: &[u64]) -> shardkit::Result<Vec<&'a [u32]>> {
    lengths
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .filter(|&n| n == tokens.len() as u64)
        .ok_or_else(|| {
            shardkit::Error::Invalid(format!(
                "the lengths add up to something other than the {} tokens given",
                tokens.len()
            ))
        })?;
    let mut seqs = Vec::with_capacity(lengths.len());
    let mut at = 0usize;
    for &n in lengths {
        seqs.push(&tokens[at..at + n as usize]);
        at += n as usize;
    }
    Ok(seqs)
}

/// Calls `append` without the GIL on the sequences `tokens` (uint32) and `lengths` (uint64, one
/// per sequence) hold, for both writers' `append_flat`.
fn append_without_gil(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
    append: impl FnOnce(&[&[u32]]) -> shardkit::Result<()> + Send,
) -> PyResult<()> {
    let t = contiguous::<u32>(tokens, "tokens (uint32)")?;
    let l = contiguous::<u64>(lengths, "lengths (uint64)")?;
    let ts = SendSlice(t.buf_ptr() as *const u32, t.item_count());
    let ls = SendSlice(l.buf_ptr() as *const u64, l.item_count());
    // SAFETY: `t` and `l` (the exporters' views) outlive the closure.
    py.allow_threads(|| unsafe {
        let (tokens, lengths) = (ts.get(), ls.get());
        append(&sequences_of(tokens, lengths)?)
    })
    .map_err(to_py)
}

/// Appends sequences to one split, crash-safely.
#[pyclass(module = "shardkit._shardkit")]
pub struct TokensWriter {
    inner: Option<Writer>,
    resumed_from: Option<u64>,
    format: String,
}

impl Drop for TokensWriter {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            crate::drop_without_gil(w);
        }
    }
}

#[pymethods]
impl TokensWriter {
    #[new]
    #[pyo3(signature = (path, split, layout=None, resume=false, checkpoint_tokens=1u64 << 28,
        tokens_per_shard=None, tokens_per_chunk=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        split: &str,
        layout: Option<&str>,
        resume: bool,
        checkpoint_tokens: u64,
        tokens_per_shard: Option<u64>,
        tokens_per_chunk: Option<u64>,
    ) -> PyResult<Self> {
        let layout = layout_of(layout, tokens_per_shard, tokens_per_chunk)?;
        let options = WriterOptions {
            layout,
            resume,
            checkpoint_tokens,
        };
        let w = py
            .allow_threads(|| Writer::create(path, split, options))
            .map_err(to_py)?;
        Ok(TokensWriter {
            resumed_from: w.info().resumed_from,
            format: w.info().format.to_string(),
            inner: Some(w),
        })
    }

    /// Sequences already in the split when the writer opened it (None for a new split).
    #[getter]
    fn resumed_from(&self) -> Option<u64> {
        self.resumed_from
    }
    /// "v2" or "v3".
    #[getter]
    fn format(&self) -> &str {
        &self.format
    }
    /// {"seq_count", "token_count", "max_token_id", "sequences_with_id_zero"} so far.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        record(
            py,
            [
                ("seq_count", obj(py, w.info().seq_count)?),
                ("token_count", obj(py, w.info().token_count)?),
                ("max_token_id", obj(py, w.info().max_token_id)?),
                (
                    "sequences_with_id_zero",
                    obj(py, w.info().sequences_with_id_zero)?,
                ),
            ],
        )
    }

    /// Appends sequences given flat: `tokens` uint32 and `lengths` uint64 (one per sequence).
    fn append_flat(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        append_without_gil(py, tokens, lengths, |seqs| w.append(seqs))
    }

    /// Commits everything appended so far.
    fn flush(&mut self, py: Python<'_>) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        py.allow_threads(|| w.flush()).map_err(to_py)
    }

    /// Commits and marks the dataset complete; returns {"seq_count", "token_count",
    /// "max_token_id"}.
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let w = self.inner.take().ok_or_else(closed)?;
        let s = py.allow_threads(|| w.finish()).map_err(to_py)?;
        record(
            py,
            [
                ("seq_count", obj(py, s.seq_count)?),
                ("token_count", obj(py, s.token_count)?),
                ("max_token_id", obj(py, s.max_token_id)?),
            ],
        )
    }

    /// Commits what was appended (best effort) and stops without marking the dataset complete.
    fn abort(&mut self, py: Python<'_>) {
        if let Some(mut w) = self.inner.take() {
            // Dropped without the GIL too: ending the writer waits for its uploads and
            // releases its lock in the store.
            py.allow_threads(move || {
                let _ = w.flush();
                drop(w);
            });
        }
    }
}

/// Writes one rank's part of a split that several processes write together.
#[pyclass(module = "shardkit._shardkit")]
pub struct TokensPartWriter {
    inner: Option<flat_tokens::PartWriter>,
    rank: shardkit::Rank,
    sequences: (u64, u64),
}

impl Drop for TokensPartWriter {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            crate::drop_without_gil(w);
        }
    }
}

#[pymethods]
impl TokensPartWriter {
    #[new]
    #[pyo3(signature = (path, split, total_sequences, layout=None, sequences_per_unit=65_536,
        rank=None, world_size=None, tokens_per_shard=None, tokens_per_chunk=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        split: &str,
        total_sequences: u64,
        layout: Option<&str>,
        sequences_per_unit: u64,
        rank: Option<u64>,
        world_size: Option<u64>,
        tokens_per_shard: Option<u64>,
        tokens_per_chunk: Option<u64>,
    ) -> PyResult<Self> {
        let options = flat_tokens::PartOptions {
            layout: layout_of(layout, tokens_per_shard, tokens_per_chunk)?,
            sequences_per_unit,
        };
        let rank = crate::saev::rank_of(rank, world_size)?;
        let w = py
            .allow_threads(|| {
                flat_tokens::PartWriter::create(path, split, total_sequences, options, rank)
            })
            .map_err(to_py)?;
        let r = w.sequences();
        Ok(TokensPartWriter {
            rank,
            sequences: (r.start, r.end),
            inner: Some(w),
        })
    }

    /// (rank, world_size).
    #[getter]
    fn rank(&self) -> (u64, u64) {
        (self.rank.rank, self.rank.world_size)
    }
    /// (first, end) of the sequences this part covers.
    #[getter]
    fn sequences(&self) -> (u64, u64) {
        self.sequences
    }
    /// The (first, end) ranges of sequences still to write, in order.
    #[getter]
    fn pending(&self) -> Vec<(u64, u64)> {
        self.inner.as_ref().map_or_else(Vec::new, |w| {
            w.pending().iter().map(|r| (r.start, r.end)).collect()
        })
    }
    /// The sequence the next append begins at (None once the part is written).
    #[getter]
    fn next_sequence(&self) -> Option<u64> {
        self.inner.as_ref().and_then(|w| w.next_sequence())
    }

    /// Appends sequences given flat: `tokens` uint32 and `lengths` uint64 (one per sequence).
    fn append_flat(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        append_without_gil(py, tokens, lengths, |seqs| w.append(seqs))
    }

    /// Ends the part and commits the split when every unit is durable; returns the status as
    /// JSON.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        let w = self.inner.take().ok_or_else(closed)?;
        py.allow_threads(|| w.finish())
            .map(|st| crate::saev::status_json(&st))
            .map_err(to_py)
    }

    /// Drops the writer without finishing: the units written are durable, the rest is left
    /// to a restart.
    fn abort(&mut self, py: Python<'_>) {
        let w = self.inner.take();
        py.allow_threads(move || drop(w));
    }
}

/// The status of a split written in parts, as JSON.
#[pyfunction]
pub fn tokens_parts_status(py: Python<'_>, path: PathBuf, split: &str) -> PyResult<String> {
    py.allow_threads(|| flat_tokens::status(&path, split))
        .map(|st| crate::saev::status_json(&st))
        .map_err(to_py)
}

/// Commits a split written in parts whose every unit is durable; its status as JSON.
#[pyfunction]
pub fn tokens_commit_parts(py: Python<'_>, path: PathBuf, split: &str) -> PyResult<String> {
    py.allow_threads(|| flat_tokens::commit_parts(&path, split))
        .map(|st| crate::saev::status_json(&st))
        .map_err(to_py)
}

/// One split opened for reading.
#[pyclass(module = "shardkit._shardkit", frozen)]
pub struct TokensSplit {
    inner: Split,
}

#[pymethods]
impl TokensSplit {
    #[new]
    fn new(py: Python<'_>, path: PathBuf, split: &str) -> PyResult<Self> {
        let inner = py
            .allow_threads(|| Split::open(path, split))
            .map_err(to_py)?;
        Ok(TokensSplit { inner })
    }
    /// {"token_count", "seq_count", "max_token_id"}.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        record(
            py,
            [
                ("token_count", obj(py, s.info().token_count)?),
                ("seq_count", obj(py, s.info().seq_count)?),
                ("max_token_id", obj(py, s.info().max_token_id)?),
            ],
        )
    }
    /// {"format", "completion", "sharded"}.
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        record(
            py,
            [
                ("format", obj(py, s.info().format.to_string())?),
                ("completion", obj(py, s.info().completion.to_string())?),
                ("sharded", obj(py, s.info().sharded)?),
            ],
        )
    }
    /// The split's directory.
    #[getter]
    fn path(&self) -> String {
        self.inner.info().path.display().to_string()
    }
    /// `seq_starts[start:stop]` (uint64).
    fn seq_starts(&self, py: Python<'_>, start: u64, stop: u64) -> PyResult<RustBuffer> {
        let v = py
            .allow_threads(|| self.inner.seq_starts(start..stop))
            .map_err(to_py)?;
        let n = v.len();
        Ok(RustBuffer::new(Storage::U64(v), &[n]))
    }
    /// `encoded_tokens[start:stop]` (uint32).
    fn encoded(&self, py: Python<'_>, start: u64, stop: u64) -> PyResult<RustBuffer> {
        let v = py
            .allow_threads(|| self.inner.encoded(start..stop))
            .map_err(to_py)?;
        let n = v.len();
        Ok(RustBuffer::new(Storage::U32(v), &[n]))
    }
    /// The token ids of document `i` (uint32).
    fn ids(&self, py: Python<'_>, i: i64) -> PyResult<RustBuffer> {
        let n = self.inner.info().seq_count as i64;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(crate::py_error(
                "OutOfRangeError",
                format!("sequence {i} is out of range for {n} sequences"),
            ));
        }
        let v = py
            .allow_threads(|| self.inner.ids(j as u64))
            .map_err(to_py)?;
        let len = v.len();
        Ok(RustBuffer::new(Storage::U32(v), &[len]))
    }
}

/// The arrays of a batch, in the order of its dict.
const ARRAYS: [&str; 5] = ["inputs", "targets", "segment_ids", "is_seq_start", "mask"];

/// {"step", "inputs", "targets", "segment_ids", "is_seq_start", "mask"}, each array (rows,
/// seq_len): views of the batch's one buffer.
fn arrays(py: Python<'_>, b: TokenBatch) -> PyResult<Bound<'_, PyDict>> {
    let step = b.step;
    let (data, fields) = b.into_parts();
    let mut views = batch_views(data, &fields)?;
    let d = record(py, [("step", obj(py, step)?)])?;
    for name in ARRAYS {
        let i = views
            .iter()
            .position(|(n, _)| *n == name)
            .ok_or_else(|| PyRuntimeError::new_err(format!("internal: no {name} array")))?;
        d.set_item(name, views.swap_remove(i).1)?;
    }
    Ok(d)
}

/// seqax's shuffled order over one split.
#[pyclass(module = "shardkit._shardkit", frozen)]
pub struct TokensLoader {
    inner: TokenLoader,
}

#[pymethods]
impl TokensLoader {
    #[new]
    #[pyo3(signature = (path, split, seq_len, batch_size, packed, streams,
        read_blocks_per_shuffle_buffer, sequences_per_read_block, seed, host_index, host_count,
        epochs, threads=0, verify=false, buffer_in_memory=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        split: &str,
        seq_len: u64,
        batch_size: u64,
        packed: bool,
        streams: u64,
        read_blocks_per_shuffle_buffer: u64,
        sequences_per_read_block: Option<u64>,
        seed: u64,
        host_index: u64,
        host_count: u64,
        epochs: bool,
        threads: usize,
        verify: bool,
        buffer_in_memory: Option<bool>,
    ) -> PyResult<Self> {
        let mut o = LoaderOptions::new(seq_len, batch_size);
        o.packing = if packed {
            Packing::Packed
        } else {
            Packing::Unpacked
        };
        o.streams = streams;
        o.read_blocks_per_shuffle_buffer = read_blocks_per_shuffle_buffer;
        o.sequences_per_read_block = sequences_per_read_block;
        o.seed = seed;
        o.epochs = epochs;
        o.threads = threads;
        o.verify = verify;
        o.buffer_in_memory = buffer_in_memory;
        o.rank = Some(host_index);
        o.world_size = Some(host_count);
        let split = split.to_string();
        let inner = py
            .allow_threads(|| TokenLoader::new(Split::open(path, &split)?, o))
            .map_err(to_py)?;
        Ok(TokensLoader { inner })
    }
    /// Bytes of one batch's buffer (every array).
    #[getter]
    fn batch_bytes(&self) -> usize {
        self.inner.info().batch_bytes
    }
    /// Gathers batches into caller-owned memory from now on (internal: shardkit.torch passes
    /// pinned tensors held by `keeper`).
    fn _set_batch_buffers(&self, keeper: PyObject, regions: Vec<(usize, usize)>) -> PyResult<()> {
        self.inner
            .set_batch_buffers(external_pool(keeper, regions)?);
        Ok(())
    }
    /// Whether shuffle buffers are read whole into memory.
    #[getter]
    fn buffers_in_memory(&self) -> bool {
        self.inner.info().buffers_in_memory
    }
    /// The loader state (`flat_tokens.Loader.state_dict()`) at `step`, serving `epoch` (the
    /// wrapper keeps the position; see [`crate::loader::state_dict`]).
    fn state_dict<'py>(
        &self,
        py: Python<'py>,
        epoch: u64,
        step: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        crate::loader::state_dict(py, &self.inner.state_at(epoch, step))
    }
    /// The global step a state from `state_dict()` resumes at (refused, naming each differing
    /// key, when it was taken by a loader that would serve other rows).
    fn resume_step(&self, state: &Bound<'_, PyDict>) -> PyResult<u64> {
        let st = crate::loader::state_from_dict(state, false)?;
        self.inner.resume_step(&st).map_err(to_py)
    }
    /// Steps in an epoch.
    #[getter]
    fn step_count(&self) -> u64 {
        self.inner.info().step_count
    }
    /// Sequences per read block actually used (B).
    #[getter]
    fn sequences_per_read_block(&self) -> u64 {
        self.inner.info().sequences_per_read_block
    }
    /// {"start", "end"}: the batch rows this host serves.
    #[getter]
    fn host_rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.info().host_rows.clone();
        record(py, [("start", obj(py, r.start)?), ("end", obj(py, r.end)?)])
    }
    /// This host's rows of `step`.
    fn load<'py>(&self, py: Python<'py>, step: u64) -> PyResult<Bound<'py, PyDict>> {
        let b = py.allow_threads(|| self.inner.load(step)).map_err(to_py)?;
        arrays(py, b)
    }
    /// The sequence index (packed row or document) of each of this host's rows at `step`.
    fn rows(&self, py: Python<'_>, step: u64) -> PyResult<RustBuffer> {
        let v = py
            .allow_threads(|| self.inner.sequences(step))
            .map_err(to_py)?;
        let v: Vec<i64> = v.into_iter().map(|x| x as i64).collect();
        let n = v.len();
        Ok(RustBuffer::new(Storage::I64(v), &[n]))
    }
    /// Batches from `step` on, prepared ahead in a background thread; yields the dicts of
    /// [`arrays`].
    fn iter(&self, step: u64) -> BatchIter {
        BatchIter::new(self.inner.iter(step))
    }
}

impl IntoDict for TokenBatch {
    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        arrays(py, self)
    }
}

/// `shardkit tokens validate --json` as a JSON string.
#[pyfunction]
pub fn tokens_validate(py: Python<'_>, path: PathBuf) -> String {
    json_of(&py.allow_threads(|| flat_tokens::validate(&path)).to_json())
}

/// The splits (zarr groups) of the dataset at `path`, a directory or an `s3://` prefix.
#[pyfunction]
pub fn tokens_splits(py: Python<'_>, path: PathBuf) -> PyResult<Vec<String>> {
    py.allow_threads(|| flat_tokens::splits(&path))
        .map(|v| v.into_iter().map(str::to_string).collect())
        .map_err(to_py)
}

/// The local path `path` names (`file://` stripped), or `None` for a store location (a
/// malformed `s3://` URL included: opening it says what is wrong): the library's one parser.
#[pyfunction]
pub fn local_path(path: PathBuf) -> Option<String> {
    shardkit::io::Location::parse(&path)
        .ok()
        .and_then(|l| l.local_path().map(|p| p.to_string_lossy().into_owned()))
}

/// `shardkit tokens inspect` as a JSON string.
#[pyfunction]
pub fn tokens_inspect(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    py.allow_threads(|| flat_tokens::inspect(&path))
        .map(|v| json_of(&v))
        .map_err(to_py)
}

/// Validates an unmarked (seqax) dataset in full and marks it complete.
#[pyfunction]
pub fn tokens_mark_complete(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.allow_threads(|| flat_tokens::mark_complete(&path))
        .map_err(to_py)
}

/// Builds a split from JSONL/Parquet corpora (`shardkit tokens build`); returns the summary as
/// JSON. `tokenizer` is a tokenizer.json path or (`tokenizer_is_json`) its JSON text.
/// `progress(bytes_read, bytes_total, sequences, tokens)` is called after each chunk; an
/// exception it raises (KeyboardInterrupt included, checked there too) stops the build, with
/// what was appended committed, and propagates.
#[pyfunction]
#[pyo3(signature = (path, split, inputs, field=None, tokenizer=None, tokenizer_is_json=false,
    layout=None, resume=false, append=false, checkpoint_tokens=0, num_threads=0, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn tokens_build(
    py: Python<'_>,
    path: PathBuf,
    split: &str,
    inputs: Vec<String>,
    field: Option<String>,
    tokenizer: Option<String>,
    tokenizer_is_json: bool,
    layout: Option<&str>,
    resume: bool,
    append: bool,
    checkpoint_tokens: u64,
    num_threads: usize,
    progress: Option<PyObject>,
) -> PyResult<String> {
    let layout = layout
        .map(str::parse::<Layout>)
        .transpose()
        .map_err(to_py)?;
    let options = py.allow_threads(|| -> shardkit::Result<flat_tokens::BuildOptions> {
        let tokenizer = match tokenizer {
            None => None,
            Some(t) if tokenizer_is_json => Some(t.parse::<flat_tokens::Tokenizer>()?),
            Some(t) => Some(flat_tokens::Tokenizer::from_file(t)?),
        };
        Ok(flat_tokens::BuildOptions {
            field,
            tokenizer,
            layout,
            resume,
            append,
            checkpoint_tokens,
            threads: num_threads,
        })
    });
    let options = options.map_err(to_py)?;
    // The first Python exception raised while reporting progress; it replaces the error the
    // build returns because of it.
    let mut raised: Option<PyErr> = None;
    let result = py.allow_threads(|| {
        flat_tokens::build(&path, split, &inputs, &options, &mut |p| {
            Python::with_gil(|py| {
                let call = py.check_signals().and_then(|()| match &progress {
                    Some(f) => f
                        .call1(py, (p.bytes_read, p.bytes_total, p.sequences, p.tokens))
                        .map(drop),
                    None => Ok(()),
                });
                call.map_err(|e| {
                    let msg = e.to_string();
                    raised.get_or_insert(e);
                    shardkit::Error::Invalid(format!("stopped by Python: {msg}"))
                })
            })
        })
    });
    if let Some(e) = raised {
        return Err(e);
    }
    let s = result.map_err(to_py)?;
    let w = &s.write;
    let int = |v: u64| Value::int(v);
    Ok(json_of(&Value::Object(vec![
        ("path".into(), Value::String(w.root.display().to_string())),
        ("split".into(), Value::String(split.into())),
        ("seq_count".into(), int(w.seq_count)),
        ("token_count".into(), int(w.token_count)),
        ("max_token_id".into(), int(w.max_token_id)),
        (
            "sequences_with_id_zero".into(),
            int(w.sequences_with_id_zero),
        ),
        (
            "inputs".into(),
            Value::Array(
                s.inputs
                    .iter()
                    .map(|p| Value::String(p.display().to_string()))
                    .collect(),
            ),
        ),
        ("skipped_documents".into(), int(s.skipped_documents)),
        ("appended_sequences".into(), int(s.appended_sequences)),
        ("appended_tokens".into(), int(s.appended_tokens)),
        ("null_values".into(), int(s.null_values)),
        ("bytes_read".into(), int(s.bytes_read)),
    ])))
}

/// Rewrites a dataset in another layout; returns {"split", "seq_count", "token_count",
/// "max_token_id"} of each split written.
#[pyfunction]
pub fn tokens_convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    layout: &str,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let layout: Layout = layout.parse().map_err(to_py)?;
    let done = py
        .allow_threads(|| flat_tokens::convert(&src, &dst, layout, |_, _| {}))
        .map_err(to_py)?;
    done.into_iter()
        .map(|(n, s)| {
            record(
                py,
                [
                    ("split", obj(py, n)?),
                    ("seq_count", obj(py, s.seq_count)?),
                    ("token_count", obj(py, s.token_count)?),
                    ("max_token_id", obj(py, s.max_token_id)?),
                ],
            )
        })
        .collect()
}

/// Registers the classes and functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TokensWriter>()?;
    m.add_class::<TokensPartWriter>()?;
    m.add_function(wrap_pyfunction!(tokens_parts_status, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_commit_parts, m)?)?;
    m.add_class::<TokensSplit>()?;
    m.add_class::<TokensLoader>()?;
    // The pass of every loader is one class (see `crate::loader`); the old name stays.
    m.add("TokensBatchIter", m.py().get_type::<BatchIter>())?;
    m.add_function(wrap_pyfunction!(tokens_validate, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_splits, m)?)?;
    m.add_function(wrap_pyfunction!(local_path, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_mark_complete, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_convert, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_build, m)?)?;
    Ok(())
}
