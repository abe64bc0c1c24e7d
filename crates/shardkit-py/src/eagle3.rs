//! EAGLE-3 cache bindings (wrapped by `shardkit/eagle3.py`): writer, mapped reader, loader.
//! Items are views of the shards' memory maps (read-only); batches are views of one buffer
//! per batch (writable); neither is copied on the way to numpy.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardkit::eagle3::{self, Cache, Loader, LoaderOptions, WeightTable, Writer};
use shardkit::json;

use crate::loader::{rank_world, state_dict, state_from_dict, BatchIter, IntoDict};
use crate::{
    batch_views, contiguous, external_pool, format, held, json_of, obj, record, to_py, RustBuffer,
    SendSlice, Storage,
};

/// {"name", "dtype" (code), "shape", "array"} of one field, for Python.
fn field_out<'py>(
    py: Python<'py>,
    name: &'static str,
    dtype: String,
    shape: Vec<usize>,
    array: RustBuffer,
) -> PyResult<Bound<'py, PyDict>> {
    record(
        py,
        [
            ("name", obj(py, name)?),
            ("dtype", obj(py, dtype)?),
            ("shape", obj(py, shape)?),
            ("array", obj(py, array)?),
        ],
    )
}

fn closed() -> PyErr {
    crate::py_error("InvalidArgumentError", "the writer is closed")
}

/// {"name", "dtype" (code), "shape" (of a row)} of every stored tensor, for Python.
fn fields_out<'py>(
    py: Python<'py>,
    fields: &[(&'static str, String, Vec<usize>)],
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    fields
        .iter()
        .map(|(name, dtype, shape)| {
            record(
                py,
                [
                    ("name", obj(py, *name)?),
                    ("dtype", obj(py, dtype)?),
                    ("shape", obj(py, shape)?),
                ],
            )
        })
        .collect()
}

/// Calls `add` without the GIL on byte views of `fields` (each stored tensor's name → a
/// C-contiguous buffer), for both writers' `add_rows`.
fn add_without_gil(
    py: Python<'_>,
    fields: &Bound<'_, PyDict>,
    add: impl FnOnce(&[(&str, &[u8])]) -> shardkit::Result<()> + Send,
) -> PyResult<()> {
    let mut bufs = Vec::new();
    for (k, v) in fields.iter() {
        let name: String = k.extract()?;
        let b = contiguous::<u8>(&v, &format!("{name} (bytes)"))?;
        bufs.push((name, b));
    }
    let slices: Vec<(String, SendSlice<u8>)> = bufs
        .iter()
        .map(|(n, b)| {
            (
                n.clone(),
                SendSlice(b.buf_ptr() as *const u8, b.item_count()),
            )
        })
        .collect();
    // SAFETY: the exporters' views (`bufs`) outlive the closure.
    py.allow_threads(|| {
        let refs: Vec<(&str, &[u8])> = slices
            .iter()
            .map(|(n, s)| (n.as_str(), unsafe { s.get() }))
            .collect();
        add(&refs)
    })
    .map_err(to_py)
}

/// Calls `f` without the GIL on a byte view of `data` (`what` names it in errors).
fn bytes_without_gil(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    what: &str,
    f: impl FnOnce(&[u8]) -> shardkit::Result<()> + Send,
) -> PyResult<()> {
    let b = contiguous::<u8>(data, what)?;
    let s = SendSlice(b.buf_ptr() as *const u8, b.item_count());
    // SAFETY: `b` outlives the closure.
    py.allow_threads(|| f(unsafe { s.get() })).map_err(to_py)
}

/// Calls `f` without the GIL on the target weights `tables`: (name, bytes of the table in the
/// file's dtype, rows, cols) each, for both writers' `write_target_weights`.
fn tables_without_gil(
    py: Python<'_>,
    tables: Vec<(String, Bound<'_, PyAny>, u64, u64)>,
    f: impl FnOnce(&[WeightTable<'_>]) -> shardkit::Result<()> + Send,
) -> PyResult<()> {
    let mut bufs = Vec::new();
    for (name, data, rows, cols) in &tables {
        let b = contiguous::<u8>(data, &format!("{name} (bytes)"))?;
        bufs.push((name.clone(), b, *rows, *cols));
    }
    let slices: Vec<(String, SendSlice<u8>, u64, u64)> = bufs
        .iter()
        .map(|(n, b, r, c)| {
            (
                n.clone(),
                SendSlice(b.buf_ptr() as *const u8, b.item_count()),
                *r,
                *c,
            )
        })
        .collect();
    // SAFETY: the exporters' views (`bufs`) outlive the closure.
    py.allow_threads(|| {
        let tables: Vec<WeightTable<'_>> = slices
            .iter()
            .map(|(name, s, rows, cols)| WeightTable {
                name,
                rows: *rows,
                cols: *cols,
                data: unsafe { s.get() },
            })
            .collect();
        f(&tables)
    })
    .map_err(to_py)
}

/// Writes one cache directory.
#[pyclass(module = "shardkit._shardkit")]
pub struct Eagle3Writer {
    inner: Option<Writer>,
    manifest_json: String,
    fields: Vec<(&'static str, String, Vec<usize>)>,
    resumed_from: Option<u64>,
    num_samples: u64,
}

impl Drop for Eagle3Writer {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            crate::drop_without_gil(w);
        }
    }
}

#[pymethods]
impl Eagle3Writer {
    #[new]
    #[pyo3(signature = (cache_dir, manifest_json, version=1, resume=false))]
    fn new(
        py: Python<'_>,
        cache_dir: PathBuf,
        manifest_json: &str,
        version: u8,
        resume: bool,
    ) -> PyResult<Self> {
        let config = json::parse(manifest_json.as_bytes())
            .map_err(|e| crate::py_error("InvalidArgumentError", format!("manifest: {e}")))?;
        let options = eagle3::WriterOptions { version, resume };
        let w = py
            .allow_threads(|| Writer::create(cache_dir, &config, options))
            .map_err(to_py)?;
        Ok(Eagle3Writer {
            manifest_json: json_of(&w.manifest().to_value()),
            fields: w
                .fields()
                .iter()
                .map(|f| (f.name, f.dtype.to_string(), f.row.clone()))
                .collect(),
            resumed_from: w.resumed_from(),
            num_samples: w.manifest().num_samples,
            inner: Some(w),
        })
    }
    /// The manifest written, as JSON.
    #[getter]
    fn manifest_json(&self) -> &str {
        &self.manifest_json
    }
    /// {"name", "dtype" (code), "shape" (of a row)} of every stored tensor.
    #[getter]
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        fields_out(py, &self.fields)
    }
    /// The first sample still to be written.
    #[getter]
    fn next_sample(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(self.num_samples, |w| w.next_sample())
    }
    /// The first sample this writer had to write, when the cache had shards already.
    #[getter]
    fn resumed_from(&self) -> Option<u64> {
        self.resumed_from
    }
    /// Adds `n` samples: `fields` maps each stored tensor's name to a C-contiguous buffer of
    /// its bytes (uint8 view).
    fn add_rows(&mut self, py: Python<'_>, n: u64, fields: &Bound<'_, PyDict>) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        add_without_gil(py, fields, |refs| w.add(n, refs))
    }
    /// Writes target_embeddings.safetensors from float32 bytes of `rows × cols`.
    fn write_target_embeddings(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        rows: u64,
        cols: u64,
    ) -> PyResult<()> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        bytes_without_gil(py, data, "embeddings (bytes)", |b| {
            w.write_target_embeddings(b, rows, cols)
        })
    }
    /// Writes the target weights file from `tables`: (name, bytes, rows, cols) each, in the
    /// file's dtype (EAGLE-3 float32; DSpark the cache dtype).
    fn write_target_weights(
        &self,
        py: Python<'_>,
        tables: Vec<(String, Bound<'_, PyAny>, u64, u64)>,
    ) -> PyResult<()> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        tables_without_gil(py, tables, |t| w.write_target_weights(t))
    }
    /// The cache's member of the family: "eagle3" or "dspark".
    #[getter]
    fn schema(&self) -> PyResult<&'static str> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        Ok(w.manifest().schema().name())
    }
    /// Finishes the cache (every sample must have been added) and returns its directory.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        let w = self.inner.take().ok_or_else(closed)?;
        py.allow_threads(|| w.finish())
            .map(|p| p.display().to_string())
            .map_err(to_py)
    }
    /// Stops without finishing: the written shards stay, and a resumed writer continues.
    /// (Writing to a store, the shards already written are uploaded first, without the GIL.)
    fn abort(&mut self, py: Python<'_>) {
        let w = self.inner.take();
        py.allow_threads(move || drop(w));
    }
}

/// Writes one rank's part of a cache that several processes write together.
#[pyclass(module = "shardkit._shardkit")]
pub struct Eagle3PartWriter {
    inner: Option<eagle3::PartWriter>,
    path: String,
    rank: shardkit::Rank,
    samples: (u64, u64),
    manifest_json: String,
    fields: Vec<(&'static str, String, Vec<usize>)>,
}

impl Drop for Eagle3PartWriter {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            crate::drop_without_gil(w);
        }
    }
}

#[pymethods]
impl Eagle3PartWriter {
    #[new]
    #[pyo3(signature = (cache_dir, manifest_json, total_samples, version=1, target_embeddings=false, rank=None, world_size=None))]
    #[allow(clippy::too_many_arguments)] // the Python constructor's keywords
    fn new(
        py: Python<'_>,
        cache_dir: PathBuf,
        manifest_json: &str,
        total_samples: u64,
        version: u8,
        target_embeddings: bool,
        rank: Option<u64>,
        world_size: Option<u64>,
    ) -> PyResult<Self> {
        let config = json::parse(manifest_json.as_bytes())
            .map_err(|e| crate::py_error("InvalidArgumentError", format!("manifest: {e}")))?;
        let options = eagle3::PartOptions {
            version,
            target_embeddings,
        };
        let rank = crate::saev::rank_of(rank, world_size)?;
        let w = py
            .allow_threads(|| {
                eagle3::PartWriter::create(cache_dir, &config, options, total_samples, rank)
            })
            .map_err(to_py)?;
        let samples = w.samples();
        Ok(Eagle3PartWriter {
            path: w.path().display().to_string(),
            rank,
            samples: (samples.start, samples.end),
            manifest_json: json_of(&w.manifest().to_value()),
            fields: w
                .fields()
                .iter()
                .map(|f| (f.name, f.dtype.to_string(), f.row.clone()))
                .collect(),
            inner: Some(w),
        })
    }
    /// The cache directory.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }
    /// (rank, world_size).
    #[getter]
    fn rank(&self) -> (u64, u64) {
        (self.rank.rank, self.rank.world_size)
    }
    /// (first, end) of the samples this part covers.
    #[getter]
    fn samples(&self) -> (u64, u64) {
        self.samples
    }
    /// The (first, end) ranges of samples still to write, in order.
    #[getter]
    fn pending(&self) -> Vec<(u64, u64)> {
        self.inner.as_ref().map_or_else(Vec::new, |w| {
            w.pending().iter().map(|r| (r.start, r.end)).collect()
        })
    }
    /// The sample the next add begins at (None once the part is written).
    #[getter]
    fn next_sample(&self) -> Option<u64> {
        self.inner.as_ref().and_then(|w| w.next_sample())
    }
    /// The manifest the commit writes, as JSON.
    #[getter]
    fn manifest_json(&self) -> &str {
        &self.manifest_json
    }
    /// {"name", "dtype" (code), "shape" (of a row)} of every stored tensor.
    #[getter]
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        fields_out(py, &self.fields)
    }
    /// Adds `n` samples: `fields` maps each stored tensor's name to a C-contiguous buffer of
    /// its bytes (uint8 view).
    fn add_rows(&mut self, py: Python<'_>, n: u64, fields: &Bound<'_, PyDict>) -> PyResult<()> {
        let w = self.inner.as_mut().ok_or_else(closed)?;
        add_without_gil(py, fields, |refs| w.add(n, refs))
    }
    /// Writes target_embeddings.safetensors from float32 bytes of `rows × cols`, once for the
    /// cache.
    fn write_target_embeddings(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        rows: u64,
        cols: u64,
    ) -> PyResult<()> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        bytes_without_gil(py, data, "embeddings (bytes)", |b| {
            w.write_target_embeddings(b, rows, cols)
        })
    }
    /// Writes the target weights file from `tables` (as the Writer's), once for the cache.
    fn write_target_weights(
        &self,
        py: Python<'_>,
        tables: Vec<(String, Bound<'_, PyAny>, u64, u64)>,
    ) -> PyResult<()> {
        let w = self.inner.as_ref().ok_or_else(closed)?;
        tables_without_gil(py, tables, |t| w.write_target_weights(t))
    }
    /// Ends the part and commits the cache when every part is durable; returns the status as
    /// JSON.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        let w = self.inner.take().ok_or_else(closed)?;
        py.allow_threads(|| w.finish())
            .map(|st| crate::saev::status_json(&st))
            .map_err(to_py)
    }
    /// Drops the writer without finishing: the shards written are durable, the rest is left
    /// to a restart.
    fn abort(&mut self, py: Python<'_>) {
        let w = self.inner.take();
        py.allow_threads(move || drop(w));
    }
}

/// The status of a cache written in parts, as JSON.
#[pyfunction]
pub fn eagle3_status(py: Python<'_>, cache_dir: PathBuf) -> PyResult<String> {
    py.allow_threads(|| eagle3::status(&cache_dir))
        .map(|st| crate::saev::status_json(&st))
        .map_err(to_py)
}

/// Commits a cache written in parts whose every part is durable; its status as JSON.
#[pyfunction]
pub fn eagle3_commit_parts(py: Python<'_>, cache_dir: PathBuf) -> PyResult<String> {
    py.allow_threads(|| eagle3::commit_parts(&cache_dir))
        .map(|st| crate::saev::status_json(&st))
        .map_err(to_py)
}

/// A cache opened for reading.
#[pyclass(module = "shardkit._shardkit", frozen)]
pub struct Eagle3Cache {
    inner: Arc<Cache>,
}

#[pymethods]
impl Eagle3Cache {
    #[new]
    #[pyo3(signature = (cache_dir, max_open=eagle3::DEFAULT_OPEN_SHARDS))]
    fn new(py: Python<'_>, cache_dir: PathBuf, max_open: usize) -> PyResult<Self> {
        let inner = py
            .allow_threads(|| {
                let at = shardkit::io::Location::parse(&cache_dir)?;
                Cache::open_source(shardkit::io::open(&at)?, max_open)
            })
            .map_err(to_py)?;
        Ok(Eagle3Cache {
            inner: Arc::new(inner),
        })
    }
    fn __len__(&self) -> usize {
        self.inner.manifest().num_samples as usize
    }
    /// The manifest, as JSON.
    #[getter]
    fn manifest_json(&self) -> String {
        json_of(&self.inner.manifest().to_value())
    }
    /// The fields of sample `i` (negative counts from the end), viewing the shard's map.
    fn item<'py>(&self, py: Python<'py>, i: i64) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let cache = &self.inner;
        // The item owns what its fields view: the shard's map, or the rows fetched from an
        // object store.
        let item = Arc::new(py.allow_threads(|| cache.item(i)).map_err(to_py)?);
        let fields = cache.fields(&item).map_err(to_py)?;
        let owner: Arc<dyn Send + Sync> = item.clone();
        fields
            .into_iter()
            .map(|f| {
                let array = match f.bytes {
                    std::borrow::Cow::Borrowed(b) => {
                        held(owner.clone(), b, f.dtype, &f.shape, false)?
                    }
                    // A top-k item's rebuilt target_probs: owned, handed over as it is.
                    std::borrow::Cow::Owned(v) => {
                        let (format, item) = format(f.dtype)?;
                        RustBuffer::new(Storage::Bytes(v, format, item), &f.shape)
                    }
                };
                field_out(py, f.name, f.dtype.to_string(), f.shape, array)
            })
            .collect()
    }
    /// The cache's member of the family: "eagle3" or "dspark".
    #[getter]
    fn schema(&self) -> &'static str {
        self.inner.manifest().schema().name()
    }
    /// The target weights: (name, dtype code, view of its map [rows, cols]) per table.
    fn target_weights(&self, py: Python<'_>) -> PyResult<Vec<(String, String, RustBuffer)>> {
        let cache = &self.inner;
        let w = py.allow_threads(|| cache.target_weights()).map_err(to_py)?;
        let w = Arc::new(w);
        let mut out = Vec::new();
        for t in w.tables() {
            let bytes = w.table(&t.name).unwrap_or(&[]);
            let view = RustBuffer::view(
                w.clone(),
                bytes,
                format(t.dtype)?,
                &[t.rows, t.cols],
                false,
                false,
            );
            out.push((t.name.clone(), t.dtype.to_string(), view));
        }
        Ok(out)
    }
    /// The embedding table (F32 [rows, hidden]), viewing its map.
    fn target_embeddings(&self, py: Python<'_>) -> PyResult<RustBuffer> {
        let cache = &self.inner;
        let e = py
            .allow_threads(|| cache.target_embeddings())
            .map_err(to_py)?;
        let shape = [e.rows, e.cols];
        let e = Arc::new(e);
        Ok(RustBuffer::view(
            e.clone(),
            e.bytes(),
            (c"f", 4),
            &shape,
            false,
            false,
        ))
    }
}

/// Batches of a cache for one rank.
#[pyclass(module = "shardkit._shardkit")]
pub struct Eagle3Loader {
    inner: Loader,
}

#[pymethods]
impl Eagle3Loader {
    #[new]
    #[pyo3(signature = (cache_dir, batch_size, shuffle=true, seed=0, epoch=0, rank=None,
        world_size=None, drop_last=false, threads=0, prefetch=2, verify=false, follow=false,
        follow_timeout=None, follow_broadcast=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        cache_dir: PathBuf,
        batch_size: u64,
        shuffle: bool,
        seed: u64,
        epoch: u64,
        rank: Option<u64>,
        world_size: Option<u64>,
        drop_last: bool,
        threads: usize,
        prefetch: usize,
        verify: bool,
        follow: bool,
        follow_timeout: Option<f64>,
        follow_broadcast: Option<PyObject>,
    ) -> PyResult<Self> {
        let mut o = LoaderOptions::new(batch_size);
        o.set_shuffle(shuffle);
        o.seed = seed;
        o.epoch = epoch;
        o.rank = rank;
        o.world_size = world_size;
        o.drop_last = drop_last;
        o.threads = threads;
        o.prefetch = prefetch;
        o.verify = verify;
        o.follow = crate::saev::follow_options(follow, follow_timeout, follow_broadcast)?;
        let inner = py
            .allow_threads(|| Loader::open(cache_dir, o))
            .map_err(to_py)?;
        Ok(Eagle3Loader { inner })
    }
    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }
    /// {"rank", "world_size"}.
    #[getter]
    fn rank_world<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let o = self.inner.options();
        rank_world(py, (o.rank.unwrap_or(0), o.world_size.unwrap_or(1)))
    }
    /// The current epoch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.options().epoch
    }
    /// This rank's sample indices in the current epoch.
    fn indices(&self) -> Vec<u64> {
        self.inner.indices()
    }
    /// Switches to `epoch` from its start (right after `load_state_dict`, the state's epoch
    /// keeps the loaded position).
    fn set_epoch(&mut self, epoch: u64) {
        self.inner.set_epoch(epoch);
    }
    /// Sets the position to batch `batch` of the epoch.
    fn advance_to(&mut self, batch: u64) {
        self.inner.advance_to(batch);
    }
    /// Whether the position is at the end of the epoch (in follow mode, every shard served).
    #[getter]
    fn epoch_finished(&self) -> bool {
        self.inner.epoch_finished()
    }
    /// {"seed", "epoch", "batch", "batch_size", "world_size"}.
    /// Bytes of the buffer of a full batch (every field).
    #[getter]
    fn batch_bytes(&self) -> PyResult<usize> {
        self.inner.batch_bytes().map_err(to_py)
    }
    /// Gathers batches into caller-owned memory from now on (internal: shardkit.torch passes
    /// pinned tensors held by `keeper`).
    fn _set_batch_buffers(&self, keeper: PyObject, regions: Vec<(usize, usize)>) -> PyResult<()> {
        self.inner
            .set_batch_buffers(external_pool(keeper, regions)?);
        Ok(())
    }
    /// The resumable state, as `eagle3.Loader.state_dict()` returns it (see
    /// [`crate::loader::state_dict`]).
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        state_dict(py, &self.inner.state())
    }
    /// Restores a position saved by `state_dict()` (refused, naming each differing key, when it
    /// was taken by a loader that would serve other samples).
    fn load_state_dict(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let st = state_from_dict(state, false)?;
        self.inner.load_state(st).map_err(to_py)
    }
    /// Whether a state was loaded and no pass has started since.
    #[getter]
    fn resumed(&self) -> bool {
        self.inner.resumed()
    }
    /// The rest of the epoch from the loader's position, read ahead; yields {"cursor" (the
    /// next batch's index), "indices", "fields": [{"name", "dtype", "shape", "array"}]}.
    fn iter(&self) -> BatchIter {
        let it = self.inner.iter();
        let start = it.cursor();
        BatchIter::new(
            it.zip(start + 1..)
                .map(|(b, cursor)| b.map(|batch| E3Batch { cursor, batch })),
        )
    }
}

/// A batch of an [`Eagle3Loader`] pass, and the epoch's batch index after it.
struct E3Batch {
    cursor: u64,
    batch: eagle3::Batch,
}

impl IntoDict for E3Batch {
    /// {"cursor", "indices", "fields": [{"name", "dtype", "shape", "array"}]}.
    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let eagle3::Batch {
            indices,
            data,
            layout,
            ..
        } = self.batch;
        let out = batch_views(data, &layout)?
            .into_iter()
            .zip(&layout)
            .map(|((name, array), f)| {
                field_out(py, name, f.dtype.to_string(), f.shape.clone(), array)
            })
            .collect::<PyResult<Vec<_>>>()?;
        record(
            py,
            [
                ("cursor", obj(py, self.cursor)?),
                ("indices", obj(py, indices)?),
                ("fields", obj(py, out)?),
            ],
        )
    }
}

/// `shardkit eagle3 validate [--deep] --json` as a JSON string.
#[pyfunction]
#[pyo3(signature = (cache_dir, deep=false))]
pub fn eagle3_validate(py: Python<'_>, cache_dir: PathBuf, deep: bool) -> String {
    json_of(
        &py.allow_threads(|| eagle3::validate(&cache_dir, deep))
            .to_json(),
    )
}

/// `shardkit eagle3 inspect` as a JSON string.
#[pyfunction]
pub fn eagle3_inspect(py: Python<'_>, cache_dir: PathBuf) -> PyResult<String> {
    py.allow_threads(|| eagle3::inspect(&cache_dir))
        .map(|v| json_of(&v))
        .map_err(to_py)
}

/// Switches a cache's format_version by rewriting its manifest; returns the manifest JSON.
#[pyfunction]
pub fn eagle3_set_version(py: Python<'_>, cache_dir: PathBuf, version: u8) -> PyResult<String> {
    py.allow_threads(|| eagle3::set_version(&cache_dir, version))
        .map(|m| json_of(&m.to_value()))
        .map_err(to_py)
}

/// Registers the classes and functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Eagle3Writer>()?;
    m.add_class::<Eagle3PartWriter>()?;
    m.add_function(wrap_pyfunction!(eagle3_status, m)?)?;
    m.add_function(wrap_pyfunction!(eagle3_commit_parts, m)?)?;
    m.add_class::<Eagle3Cache>()?;
    m.add_class::<Eagle3Loader>()?;
    // The pass of every loader is one class (see `crate::loader`); the old name stays.
    m.add("Eagle3BatchIter", m.py().get_type::<BatchIter>())?;
    m.add_function(wrap_pyfunction!(eagle3_validate, m)?)?;
    m.add_function(wrap_pyfunction!(eagle3_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(eagle3_set_version, m)?)?;
    Ok(())
}
