//! saev bindings (wrapped by `shardkit/saev`): writer, dataset, loader.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardkit::engine::Order;
use shardkit::json;
use shardkit::precision::Dtype;
use shardkit::saev;

use crate::loader::{rank_world, state_dict, state_from_dict, BatchIter, IntoDict};
use crate::{
    contiguous, drop_without_gil, external_pool, json_of, obj, py_error, record, to_py,
    value_format, RustBuffer, SendSlice, Storage,
};

/// The metadata a writer writes: `metadata_json` (what the user gave) with the stored element
/// type `dtype` when one is given. A `dtype` key in the metadata that names another type is
/// refused (naming both), not silently overridden.
fn writing_metadata(metadata_json: &str, dtype: Option<&str>) -> PyResult<saev::Metadata> {
    let v = json::parse(metadata_json.as_bytes())
        .map_err(|e| py_error("InvalidArgumentError", format!("metadata: {e}")))?;
    let md = saev::Metadata::for_writing(&v).map_err(to_py)?;
    let Some(name) = dtype else {
        return Ok(md);
    };
    let want = Dtype::from_name(name).map_err(to_py)?;
    if want == md.dtype() {
        return Ok(md);
    }
    if let Some(given) = v.get("dtype") {
        return Err(py_error(
            "InvalidArgumentError",
            format!(
                "dtype={name:?} contradicts the metadata's \"dtype\": {}; give one of them",
                json_of(given)
            ),
        ));
    }
    md.with_dtype(want).map_err(to_py)
}

/// A writer's `max_rel_error`: a relative L2 error (finite, >= 0), or None for no bound.
fn rel_error_bound(bound: Option<f64>) -> PyResult<Option<f64>> {
    match bound {
        Some(b) if !(b.is_finite() && b >= 0.0) => Err(py_error(
            "InvalidArgumentError",
            format!(
                "max_rel_error must be a finite number >= 0 (the largest relative L2 error \
                 ||x - q|| / ||x|| of a row, e.g. 0.01), got {b}"
            ),
        )),
        b => Ok(b),
    }
}

/// Runs `write` on the examples `acts` and `labels` hold, without the GIL (the buffers are
/// the exporters' views, held for the call).
fn write_without_gil(
    py: Python<'_>,
    acts: &pyo3::buffer::PyBuffer<f32>,
    labels: Option<&pyo3::buffer::PyBuffer<u8>>,
    write: impl FnOnce(&[f32], Option<&[u8]>) -> shardkit::Result<()> + Send,
) -> PyResult<()> {
    let acts_s = SendSlice(acts.buf_ptr() as *const f32, acts.item_count());
    let lab_s = labels.map(|b| SendSlice(b.buf_ptr() as *const u8, b.item_count()));
    // SAFETY: `acts` and `labels` (the exporters' views) outlive the closure.
    py.allow_threads(|| unsafe { write(acts_s.get(), lab_s.as_ref().map(|x| x.get())) })
        .map_err(to_py)
}

/// {"n_examples", "n_layers", "tokens_per_example", "d_model"} of a writer.
fn shape_dict(py: Python<'_>, shape: (usize, usize, usize, usize)) -> PyResult<Bound<'_, PyDict>> {
    let (n, l, t, d) = shape;
    record(
        py,
        [
            ("n_examples", obj(py, n)?),
            ("n_layers", obj(py, l)?),
            ("tokens_per_example", obj(py, t)?),
            ("d_model", obj(py, d)?),
        ],
    )
}

/// Streaming, crash-safe writer of one saev directory.
#[pyclass(module = "shardkit._shardkit")]
pub struct Writer {
    inner: Option<saev::Writer>,
    path: String,
    start: String,
    shape: (usize, usize, usize, usize),
    content_tokens: usize,
    dtype: Dtype,
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            drop_without_gil(w);
        }
    }
}

#[pymethods]
impl Writer {
    #[new]
    #[pyo3(signature = (root, metadata_json, resume=false, dtype=None, max_rel_error=None))]
    fn new(
        py: Python<'_>,
        root: std::path::PathBuf,
        metadata_json: &str,
        resume: bool,
        dtype: Option<&str>,
        max_rel_error: Option<f64>,
    ) -> PyResult<Self> {
        let md = writing_metadata(metadata_json, dtype)?;
        let max_rel_error = rel_error_bound(max_rel_error)?;
        let dtype = md.dtype();
        let layout =
            saev::Layout::new(&md, std::path::Path::new("metadata.json")).map_err(to_py)?;
        let shape = (
            layout.n_examples as usize,
            layout.n_layers as usize,
            layout.tokens as usize,
            layout.d_model as usize,
        );
        let content_tokens = layout.content_tokens as usize;
        let w = py
            .allow_threads(|| {
                saev::Writer::create(
                    root,
                    md,
                    saev::WriterOptions {
                        resume,
                        max_rel_error,
                    },
                )
            })
            .map_err(to_py)?;
        let start = match w.start() {
            saev::WriteStart::Fresh => "fresh".to_string(),
            saev::WriteStart::Resumed { from } => format!("resumed:{from}"),
            saev::WriteStart::AlreadyComplete => "complete".to_string(),
        };
        Ok(Writer {
            path: w.path().display().to_string(),
            inner: Some(w),
            start,
            shape,
            content_tokens,
            dtype,
        })
    }

    /// The stored element type ("float32", "bfloat16" or "float16").
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The dataset directory.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }
    /// "fresh", "resumed:<first example>" or "complete".
    #[getter]
    fn start(&self) -> &str {
        &self.start
    }
    /// First example still to be written.
    #[getter]
    fn next_example(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(self.shape.0 as u64, |w| w.next_example())
    }
    /// {"n_examples", "n_layers", "tokens_per_example", "d_model"}.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        shape_dict(py, self.shape)
    }
    /// Content tokens per example (labels are (b, this)).
    #[getter]
    fn content_tokens(&self) -> usize {
        self.content_tokens
    }

    /// Writes acts float32 (b, L, T, D) and optional labels uint8 (b, P).
    #[pyo3(signature = (acts, labels=None))]
    fn write(
        &mut self,
        py: Python<'_>,
        acts: &Bound<'_, PyAny>,
        labels: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (_, l, t, d) = self.shape;
        let a = contiguous::<f32>(acts, "acts (float32)")?;
        let s = a.shape();
        if s.len() != 4 || s[1] != l || s[2] != t || s[3] != d {
            return Err(py_error(
                "InvalidArgumentError",
                format!(
                    "acts must have shape (b, {l}, {t}, {d}) = (batch, layers, \
                     tokens_per_example, d_model); got {s:?}"
                ),
            ));
        }
        let lab = match labels {
            None => None,
            Some(obj) => {
                let b = contiguous::<u8>(obj, "labels (uint8)")?;
                let ls = b.shape();
                if ls.len() != 2 || ls[0] != s[0] || ls[1] != self.content_tokens {
                    return Err(py_error(
                        "InvalidArgumentError",
                        format!(
                            "labels must have shape ({}, {}) = (batch, content tokens); got \
                             {ls:?}",
                            s[0], self.content_tokens
                        ),
                    ));
                }
                Some(b)
            }
        };
        let w = self
            .inner
            .as_mut()
            .ok_or_else(|| py_error("InvalidArgumentError", "the writer is closed"))?;
        write_without_gil(py, &a, lab.as_ref(), |acts, labels| w.write(acts, labels))
    }

    /// Completes the dataset (labels.bin, then shards.json) and returns its directory.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        let w = self
            .inner
            .take()
            .ok_or_else(|| py_error("InvalidArgumentError", "the writer is already closed"))?;
        py.allow_threads(|| w.finish())
            .map(|p| p.display().to_string())
            .map_err(to_py)
    }

    /// Drops the writer without completing: the directory stays resumable. (Writing to a
    /// store, the shards already finished are uploaded first, without holding the GIL.)
    fn abort(&mut self, py: Python<'_>) {
        let w = self.inner.take();
        py.allow_threads(move || drop(w));
    }
}

/// A complete saev directory opened for random access.
#[pyclass(module = "shardkit._shardkit", frozen)]
pub struct Dataset {
    inner: Arc<saev::Dataset>,
}

#[pymethods]
impl Dataset {
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let ds = py
            .allow_threads(|| saev::Dataset::open(path))
            .map_err(to_py)?;
        Ok(Dataset {
            inner: Arc::new(ds),
        })
    }
    /// metadata.json as a JSON string (keys in file order).
    #[getter]
    fn metadata_json(&self) -> String {
        json_of(self.inner.metadata().raw())
    }
    /// The directory.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }
    /// {"n_examples", "n_layers", "tokens_per_example", "d_model", "content_tokens",
    /// "cls_token", "examples_per_shard", "n_shards"}.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = self.inner.layout();
        record(
            py,
            [
                ("n_examples", obj(py, l.n_examples)?),
                ("n_layers", obj(py, l.n_layers)?),
                ("tokens_per_example", obj(py, l.tokens)?),
                ("d_model", obj(py, l.d_model)?),
                ("content_tokens", obj(py, l.content_tokens)?),
                ("cls_token", obj(py, l.cls)?),
                ("examples_per_shard", obj(py, l.examples_per_shard)?),
                ("n_shards", obj(py, l.n_shards)?),
                ("dtype", obj(py, l.dtype.name())?),
            ],
        )
    }
    /// Recorded layer values.
    #[getter]
    fn layers(&self) -> Vec<i64> {
        self.inner.metadata().layers().to_vec()
    }
    /// Whether labels.bin is present and usable.
    #[getter]
    fn has_labels(&self) -> bool {
        self.inner.has_labels()
    }
    /// Warnings from parsing metadata.json.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.inner.warnings().to_vec()
    }
    /// One vector (D,) of (example, recorded layer, token slot): float32 (widened from a
    /// reduced stored type), or with `stored` the stored values.
    #[pyo3(signature = (example, layer, token, stored=false))]
    fn get(
        &self,
        py: Python<'_>,
        example: i64,
        layer: i64,
        token: i64,
        stored: bool,
    ) -> PyResult<RustBuffer> {
        let (e, t) = (index(example, "example")?, index(token, "token")?);
        if stored && self.inner.layout().dtype.is_reduced() {
            return self.stored_rows(py, &[(e, layer, t)], &[self.d_model()]);
        }
        let v = py
            .allow_threads(|| self.inner.get(e, layer, t))
            .map_err(to_py)?;
        let d = v.len();
        Ok(RustBuffer::new(Storage::F32(v), &[d]))
    }
    /// Many vectors (n, D): coordinates given as three equal-length sequences; float32, or
    /// with `stored` the stored values.
    #[pyo3(signature = (examples, layers, tokens, stored=false))]
    fn take(
        &self,
        py: Python<'_>,
        examples: Vec<i64>,
        layers: Vec<i64>,
        tokens: Vec<i64>,
        stored: bool,
    ) -> PyResult<RustBuffer> {
        if examples.len() != layers.len() || examples.len() != tokens.len() {
            return Err(py_error(
                "InvalidArgumentError",
                format!(
                    "examples, layers and tokens must have the same length, got {}, {} and {}",
                    examples.len(),
                    layers.len(),
                    tokens.len()
                ),
            ));
        }
        let mut coords = Vec::with_capacity(examples.len());
        for i in 0..examples.len() {
            coords.push((
                index(examples[i], "example")?,
                layers[i],
                index(tokens[i], "token")?,
            ));
        }
        let d = self.d_model();
        if stored && self.inner.layout().dtype.is_reduced() {
            return self.stored_rows(py, &coords, &[coords.len(), d]);
        }
        let v = py
            .allow_threads(|| self.inner.take(&coords))
            .map_err(to_py)?;
        Ok(RustBuffer::new(Storage::F32(v), &[coords.len(), d]))
    }
    /// Rows of saev's indexed view for (layer, tokens).
    fn indexed_len(&self, layer: i64, tokens: &str) -> PyResult<u64> {
        let mode: saev::TokenMode = tokens.parse().map_err(to_py)?;
        Ok(self.inner.indexed(layer, mode).map_err(to_py)?.len())
    }
    /// Row `i` of saev's indexed view: {"act", "example_idx", "token_idx", "token_label"
    /// (None without labels)}; `act` float32, or with `stored` the stored values.
    #[pyo3(signature = (layer, tokens, i, stored=false))]
    fn indexed_get<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        tokens: &str,
        i: i64,
        stored: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mode: saev::TokenMode = tokens.parse().map_err(to_py)?;
        let view = self.inner.indexed(layer, mode).map_err(to_py)?;
        let n = view.len() as i64;
        let i = if i < 0 { i + n } else { i };
        if i < 0 || i >= n {
            return Err(py_error(
                "OutOfRangeError",
                format!(
                    "{}: row {i} is out of range for {n} rows",
                    self.inner.path().display()
                ),
            ));
        }
        let row = py.allow_threads(|| view.get(i as u64)).map_err(to_py)?;
        let d = row.act.len();
        let act = if stored && self.inner.layout().dtype.is_reduced() {
            let (e, t, _) = view.locate(i as u64).map_err(to_py)?;
            self.stored_rows(py, &[(e, layer, t)], &[d])?
        } else {
            RustBuffer::new(Storage::F32(row.act), &[d])
        };
        record(
            py,
            [
                ("act", obj(py, act)?),
                ("example_idx", obj(py, row.example_idx)?),
                ("token_idx", obj(py, row.token_idx)?),
                ("token_label", obj(py, row.token_label)?),
            ],
        )
    }
}

impl Dataset {
    fn d_model(&self) -> usize {
        self.inner.layout().d_model as usize
    }

    /// The stored values of the vectors at `coords`, as an array of `shape`.
    fn stored_rows(
        &self,
        py: Python<'_>,
        coords: &[(u64, i64, u64)],
        shape: &[usize],
    ) -> PyResult<RustBuffer> {
        let (format, item) = value_format(self.inner.layout().dtype)?;
        let bytes = py
            .allow_threads(|| self.inner.take_stored(coords))
            .map_err(to_py)?;
        Ok(RustBuffer::new(Storage::Bytes(bytes, format, item), shape))
    }
}

fn index(i: i64, what: &str) -> PyResult<u64> {
    u64::try_from(i)
        .map_err(|_| py_error("OutOfRangeError", format!("{what} index {i} is negative")))
}

/// A follow-mode loader's options (`None` without `follow`): Ctrl-C interrupts its waits;
/// `broadcast`, a Python callable `fn(value: Optional[list[int]]) -> list[int]`, is the round
/// broadcast of ranks reading together (see [`round_broadcast`]).
pub(crate) fn follow_options(
    follow: bool,
    follow_timeout: Option<f64>,
    broadcast: Option<PyObject>,
) -> PyResult<Option<saev::FollowOptions>> {
    if !follow {
        return Ok(None);
    }
    let mut f = saev::FollowOptions {
        interrupted: Some(saev::WaitCheck(ctrl_c)),
        broadcast: broadcast.map(round_broadcast),
        ..Default::default()
    };
    if let Some(t) = follow_timeout {
        f.timeout = std::time::Duration::try_from_secs_f64(t).map_err(|_| {
            to_py(shardkit::Error::Invalid(format!(
                "follow_timeout must be a number of seconds >= 0, got {t}"
            )))
        })?;
    }
    Ok(Some(f))
}

/// The Python callable `f` as a round broadcast. The loader calls it from the iterating thread
/// with the GIL released, so it takes the GIL; an exception it raises is left set, and the
/// pass raises it (see `loader::Pass::next`), as the loader's error.
fn round_broadcast(f: PyObject) -> saev::RoundBroadcast {
    saev::RoundBroadcast::new(move |value: Option<Vec<u64>>| {
        Python::with_gil(|py| {
            let out = f
                .call1(py, (value,))
                .and_then(|v| v.extract::<Vec<u64>>(py));
            out.map_err(|e| {
                let msg = format!("follow_broadcast failed: {e}");
                e.restore(py);
                shardkit::Error::Invalid(msg)
            })
        })
    })
}

/// Whether Python has a signal to handle (Ctrl-C) while a follow-mode loader waits for shards:
/// the exception it raises is left set, and the pass raises it (see `loader::Pass::next`).
fn ctrl_c() -> bool {
    Python::with_gil(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            e.restore(py);
            true
        }
    })
}

/// Ordered or shuffled batches of a saev directory.
#[pyclass(module = "shardkit._shardkit")]
pub struct Loader {
    inner: saev::Loader,
}

#[pymethods]
impl Loader {
    #[new]
    #[pyo3(signature = (path, layer, tokens="content", batch_size=16384, order=None,
        seed=0, epoch=0, rank=None, world_size=None, drop_last=false, memory_budget=None,
        ignore_labels=Vec::new(), io_threads=16, direct_io=false, threads=0, verify=false,
        follow=false, follow_timeout=None, follow_broadcast=None, upcast=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        layer: &Bound<'_, PyAny>,
        tokens: &str,
        batch_size: u64,
        order: Option<&str>,
        seed: u64,
        epoch: u64,
        rank: Option<u64>,
        world_size: Option<u64>,
        drop_last: bool,
        memory_budget: Option<u64>,
        ignore_labels: Vec<u8>,
        io_threads: usize,
        direct_io: bool,
        threads: usize,
        verify: bool,
        follow: bool,
        follow_timeout: Option<f64>,
        follow_broadcast: Option<PyObject>,
        upcast: bool,
    ) -> PyResult<Self> {
        let layer = if let Ok(s) = layer.extract::<String>() {
            s.parse::<saev::LayerSel>().map_err(to_py)?
        } else {
            saev::LayerSel::Value(layer.extract::<i64>().map_err(|_| {
                py_error(
                    "InvalidArgumentTypeError",
                    format!(
                        "layer must be a recorded layer value (an integer) or \"all\", got {layer}"
                    ),
                )
            })?)
        };
        let mut o = saev::LoaderOptions::new(layer);
        o.tokens = tokens.parse().map_err(to_py)?;
        o.batch_size = batch_size;
        if let Some(order) = order {
            o.order = order.parse::<Order>().map_err(to_py)?;
        }
        o.seed = seed;
        o.epoch = epoch;
        o.rank = rank;
        o.world_size = world_size;
        o.drop_last = drop_last;
        o.memory_budget = memory_budget;
        o.ignore_labels = ignore_labels;
        o.io_threads = io_threads;
        o.direct_io = direct_io;
        o.threads = threads;
        o.verify = verify;
        o.follow = follow_options(follow, follow_timeout, follow_broadcast)?;
        o.upcast = upcast;
        let inner = py
            .allow_threads(|| saev::Loader::new(path, o))
            .map_err(to_py)?;
        Ok(Loader { inner })
    }
    /// Batches per epoch on this rank.
    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }
    /// Selected rows per epoch over all ranks.
    #[getter]
    fn rows(&self) -> u64 {
        self.inner.rows()
    }
    /// {"rank", "world_size"}.
    #[getter]
    fn rank_world<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        rank_world(py, self.inner.rank_and_world())
    }
    /// d_model.
    #[getter]
    fn d_model(&self) -> u64 {
        self.inner.dataset().layout().d_model
    }
    /// The order ("sequential", "block" or "exact").
    #[getter]
    fn order(&self) -> &'static str {
        self.inner.options().order.name()
    }
    /// Current epoch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.options().epoch
    }
    /// Switches epoch (and rewinds to its start; right after `load_state_dict`, the state's
    /// epoch keeps the loaded position).
    fn set_epoch(&mut self, epoch: u64) -> PyResult<()> {
        self.inner.set_epoch(epoch).map_err(to_py)
    }
    /// The type of the `act` values served: the stored type, or float32 with `upcast`.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.served().name()
    }
    /// The dataset's stored type.
    #[getter]
    fn stored_dtype(&self) -> &'static str {
        self.inner.dataset().layout().dtype.name()
    }
    /// Bytes of the `act` buffer of a full batch (of the type served: a bfloat16 batch is half
    /// a float32 one).
    #[getter]
    fn batch_bytes(&self) -> u64 {
        self.inner.options().batch_size
            * self.inner.dataset().layout().d_model
            * self.served().size() as u64
    }
    /// Gathers batches into caller-owned memory from now on (internal: shardkit.torch passes
    /// pinned tensors held by `keeper`).
    fn _set_batch_buffers(
        &mut self,
        keeper: PyObject,
        regions: Vec<(usize, usize)>,
    ) -> PyResult<()> {
        self.inner
            .set_batch_buffers(external_pool(keeper, regions)?);
        Ok(())
    }
    /// The resumable state, as `saev.Loader.state_dict()` returns it (see
    /// [`crate::loader::state_dict`]).
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        state_dict(py, &self.inner.state())
    }
    /// Restores a state from `state_dict()` (refused, naming each differing key, when it was
    /// taken by a loader that would serve other rows).
    fn load_state_dict(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let st = state_from_dict(state, true)?;
        self.inner.load_state(st).map_err(to_py)
    }
    /// Runs the rest of the epoch entirely in Rust and returns the payload bytes (for
    /// benchmarks: the same loader, process and page cache as a Python loop).
    fn _drain(&self, py: Python<'_>) -> PyResult<u64> {
        py.allow_threads(|| {
            let mut bytes = 0u64;
            for b in self.inner.iter()? {
                let b = b?;
                bytes += (b.n * b.d_model * b.dtype.size()) as u64;
            }
            Ok(bytes)
        })
        .map_err(to_py)
    }

    /// Starts a pass over the rest of the epoch; yields {"act", "example_idx", "token_idx",
    /// "layer", "token_label", "cursor"} (layer and token_label None when not selected).
    fn iter(&self, py: Python<'_>) -> PyResult<BatchIter> {
        let it = py.allow_threads(|| self.inner.iter()).map_err(to_py)?;
        Ok(BatchIter::new(it))
    }
}

impl Loader {
    /// The type of the values batches hold.
    fn served(&self) -> Dtype {
        if self.inner.options().upcast {
            Dtype::F32
        } else {
            self.inner.dataset().layout().dtype
        }
    }
}

/// Writer of one rank's part of a saev dataset that several processes write together.
#[pyclass(module = "shardkit._shardkit")]
pub struct PartWriter {
    inner: Option<saev::PartWriter>,
    path: String,
    rank: shardkit::Rank,
    examples: (u64, u64),
    shape: (usize, usize, usize, usize),
    content_tokens: usize,
    dtype: Dtype,
}

impl Drop for PartWriter {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            drop_without_gil(w);
        }
    }
}

/// The rank given, or the launcher's from the environment when neither is given.
pub(crate) fn rank_of(rank: Option<u64>, world_size: Option<u64>) -> PyResult<shardkit::Rank> {
    match (rank, world_size) {
        (Some(r), Some(w)) => shardkit::Rank::new(r, w).map_err(to_py),
        (None, None) => shardkit::Rank::from_env().map_err(to_py),
        _ => Err(py_error(
            "InvalidArgumentError",
            "give both rank and world_size, or neither (they are then read from the \
             launcher's environment: RANK/WORLD_SIZE, Slurm or MPI variables)",
        )),
    }
}

/// A parts status as a dict: {"committed", "units", "done", "missing", "claimed"}.
pub(crate) fn status_json(st: &shardkit::PartsStatus) -> String {
    json_of(&st.to_json())
}

#[pymethods]
impl PartWriter {
    #[new]
    #[pyo3(signature = (root, metadata_json, rank=None, world_size=None, dtype=None,
        max_rel_error=None))]
    fn new(
        py: Python<'_>,
        root: std::path::PathBuf,
        metadata_json: &str,
        rank: Option<u64>,
        world_size: Option<u64>,
        dtype: Option<&str>,
        max_rel_error: Option<f64>,
    ) -> PyResult<Self> {
        let md = writing_metadata(metadata_json, dtype)?;
        let max_rel_error = rel_error_bound(max_rel_error)?;
        let dtype = md.dtype();
        let layout =
            saev::Layout::new(&md, std::path::Path::new("metadata.json")).map_err(to_py)?;
        let rank = rank_of(rank, world_size)?;
        let mut w = py
            .allow_threads(|| saev::PartWriter::create(root, md, rank))
            .map_err(to_py)?;
        w.set_max_rel_error(max_rel_error);
        let examples = w.examples();
        Ok(PartWriter {
            path: w.path().display().to_string(),
            rank,
            examples: (examples.start, examples.end),
            shape: (
                layout.n_examples as usize,
                layout.n_layers as usize,
                layout.tokens as usize,
                layout.d_model as usize,
            ),
            content_tokens: layout.content_tokens as usize,
            dtype,
            inner: Some(w),
        })
    }

    /// The stored element type ("float32", "bfloat16" or "float16").
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The dataset directory.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }
    /// (rank, world_size).
    #[getter]
    fn rank(&self) -> (u64, u64) {
        (self.rank.rank, self.rank.world_size)
    }
    /// (first, end) of the examples this part covers.
    #[getter]
    fn examples(&self) -> (u64, u64) {
        self.examples
    }
    /// The (first, end) ranges of examples still to write, in order.
    #[getter]
    fn pending(&self) -> Vec<(u64, u64)> {
        self.inner.as_ref().map_or_else(Vec::new, |w| {
            w.pending().iter().map(|r| (r.start, r.end)).collect()
        })
    }
    /// The example the next write begins at (None once the part is written).
    #[getter]
    fn next_example(&self) -> Option<u64> {
        self.inner.as_ref().and_then(|w| w.next_example())
    }
    /// Content tokens per example (labels are (b, this)).
    #[getter]
    fn content_tokens(&self) -> usize {
        self.content_tokens
    }
    /// {"n_examples", "n_layers", "tokens_per_example", "d_model"}.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        shape_dict(py, self.shape)
    }

    /// Writes acts float32 (b, L, T, D) and optional labels uint8 (b, P), checked by the
    /// Python wrapper.
    #[pyo3(signature = (acts, labels=None))]
    fn write(
        &mut self,
        py: Python<'_>,
        acts: &Bound<'_, PyAny>,
        labels: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let a = contiguous::<f32>(acts, "acts (float32)")?;
        let lab = labels
            .map(|l| contiguous::<u8>(l, "labels (uint8)"))
            .transpose()?;
        let w = self
            .inner
            .as_mut()
            .ok_or_else(|| py_error("InvalidArgumentError", "the writer is closed"))?;
        write_without_gil(py, &a, lab.as_ref(), |acts, labels| w.write(acts, labels))
    }

    /// Ends the part and commits the dataset when every shard is durable; returns the status
    /// as JSON.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        let w = self
            .inner
            .take()
            .ok_or_else(|| py_error("InvalidArgumentError", "the writer is already closed"))?;
        py.allow_threads(|| w.finish())
            .map(|st| status_json(&st))
            .map_err(to_py)
    }

    /// Drops the writer without finishing: the shards written are durable, the rest is left
    /// to a restart.
    fn abort(&mut self, py: Python<'_>) {
        let w = self.inner.take();
        py.allow_threads(move || drop(w));
    }
}

/// The status of a saev dataset written in parts, as JSON.
#[pyfunction(name = "saev_status")]
fn status(py: Python<'_>, path: std::path::PathBuf) -> PyResult<String> {
    py.allow_threads(|| saev::status(&path))
        .map(|st| status_json(&st))
        .map_err(to_py)
}

/// Commits a saev dataset written in parts whose every shard is durable; its status as JSON.
#[pyfunction(name = "saev_commit_parts")]
fn commit_parts(py: Python<'_>, path: std::path::PathBuf) -> PyResult<String> {
    py.allow_threads(|| saev::commit_parts(&path))
        .map(|st| status_json(&st))
        .map_err(to_py)
}

/// `shardkit saev validate --json` as a JSON string.
#[pyfunction]
fn validate(py: Python<'_>, path: std::path::PathBuf) -> String {
    let r = py.allow_threads(|| saev::validate(&path));
    json_of(&r.to_json())
}

/// `shardkit saev inspect --json` as a JSON string.
#[pyfunction]
fn inspect(py: Python<'_>, path: std::path::PathBuf) -> PyResult<String> {
    py.allow_threads(|| saev::inspect(&path))
        .map(|v| json_of(&v))
        .map_err(to_py)
}

/// `saev.convert`: the dataset `src` written again in `dtype` under `dst_root`; its path.
/// `progress(examples_done, examples, source_example_bytes, resumed_from)` is called as it
/// goes (with the GIL); an exception it raises, or a signal (Ctrl-C), stops the conversion
/// there, leaving the destination resumable, and is raised.
#[pyfunction]
#[pyo3(signature = (src, dst_root, dtype, max_rel_error=None, progress=None))]
fn convert(
    py: Python<'_>,
    src: std::path::PathBuf,
    dst_root: std::path::PathBuf,
    dtype: &str,
    max_rel_error: Option<f64>,
    progress: Option<PyObject>,
) -> PyResult<String> {
    let dtype = Dtype::from_name(dtype).map_err(to_py)?;
    let raised: Arc<std::sync::Mutex<Option<PyErr>>> = Arc::default();
    let mut opts = saev::ConvertOptions {
        max_rel_error: rel_error_bound(max_rel_error)?,
        ..Default::default()
    };
    let stash = raised.clone();
    opts.progress = Some(Box::new(move |p: &saev::ConvertProgress| {
        Python::with_gil(|py| {
            let from = match p.start {
                saev::WriteStart::Resumed { from } => Some(from),
                _ => None,
            };
            let called = py.check_signals().and_then(|()| match &progress {
                Some(f) => f
                    .call1(
                        py,
                        (p.examples_done, p.examples, p.source_example_bytes, from),
                    )
                    .map(|_| ()),
                None => Ok(()),
            });
            match called {
                Ok(()) => std::ops::ControlFlow::Continue(()),
                Err(e) => {
                    *stash.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    std::ops::ControlFlow::Break(())
                }
            }
        })
    }));
    let done = py.allow_threads(|| saev::convert(&src, &dst_root, dtype, opts));
    if let Some(e) = raised.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    done.map(|p| p.display().to_string()).map_err(to_py)
}

impl IntoDict for saev::Batch {
    /// {"act", "example_idx", "token_idx", "layer", "token_label", "cursor"}.
    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let n = self.n;
        let i64s = |v: Vec<i64>| RustBuffer::new(Storage::I64(v), &[n]);
        crate::record(
            py,
            [
                (
                    "act",
                    crate::obj(
                        py,
                        RustBuffer::new(
                            Storage::Engine(self.act, value_format(self.dtype)?),
                            &[n, self.d_model],
                        ),
                    )?,
                ),
                ("example_idx", crate::obj(py, i64s(self.example_idx))?),
                ("token_idx", crate::obj(py, i64s(self.token_idx))?),
                ("layer", crate::obj(py, self.layer.map(i64s))?),
                ("token_label", crate::obj(py, self.token_label.map(i64s))?),
                ("cursor", crate::obj(py, self.cursor)?),
            ],
        )
    }
}

/// Registers the classes and functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Writer>()?;
    m.add_class::<PartWriter>()?;
    m.add_function(wrap_pyfunction!(status, m)?)?;
    m.add_function(wrap_pyfunction!(commit_parts, m)?)?;
    m.add_class::<Dataset>()?;
    m.add_class::<Loader>()?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    Ok(())
}
