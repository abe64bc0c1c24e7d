//! `shardkit._shardkit`: the compiled core of the `shardkit` Python package.
//!
//! The public Python API lives in `python/shardkit/` (thin wrappers with docstrings and types);
//! this module exposes the Rust library with three rules: the GIL is released for every read,
//! wait and write; Rust errors become the natural Python exception with the same message; and
//! arrays cross the boundary without a copy, through the buffer protocol of [`RustBuffer`].

use std::ffi::{c_int, CStr};
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardkit::engine::Buffer;
use shardkit::json;

mod eagle3;
mod flat_tokens;
mod loader;
mod saev;
mod sdnb;

/// A Rust error as the Python exception a Python user expects: a class of `shardkit.errors`
/// (all `ShardkitError`s), each also the builtin a caller already catches (`ValueError`,
/// `OSError` by errno, `IndexError`, `RuntimeError`).
pub(crate) fn to_py(e: shardkit::Error) -> PyErr {
    use shardkit::Error as E;
    let msg = e.to_string();
    // (class, errno) — an errno makes it an OSError whose subclass Python code can catch.
    let (class, errno): (&str, Option<i32>) = match &e {
        E::NotFound { .. } => ("NotFoundError", None),
        E::Io { source, .. } => ("", Some(source.raw_os_error().unwrap_or(0))),
        E::Exists { .. } => ("AlreadyExistsError", None),
        E::Locked { .. } | E::LockedRemote { .. } => ("LockedError", None),
        E::Incomplete { .. } | E::Interrupted { .. } => ("IncompleteDatasetError", None),
        E::OutOfRange { .. } => ("OutOfRangeError", None),
        E::Format { .. } | E::Safetensors { .. } => ("CorruptDataError", None),
        E::Invalid(_) | E::Missing(_) | E::Refused { .. } => ("InvalidArgumentError", None),
        E::Remote { .. } => ("RemoteError", None),
        // A thread the system refused to start: an OSError with its errno where there is one.
        E::Thread { source, .. } if source.raw_os_error().is_some() => ("", source.raw_os_error()),
        E::Thread { .. } | E::Internal(_) => ("InternalError", None),
        // `shardkit::Error` is non_exhaustive: a kind added later is an internal error until
        // it gets its own class here.
        _ => ("InternalError", None),
    };
    Python::with_gil(|py| {
        let built = (|| -> PyResult<PyErr> {
            let errors = py.import("shardkit.errors")?;
            let value = match errno {
                Some(n) => errors
                    .getattr("_os_error")?
                    .call1(((n != 0).then_some(n), msg.as_str()))?,
                None => errors.getattr(class)?.call1((msg.as_str(),))?,
            };
            Ok(PyErr::from_value(value))
        })();
        // Only a broken installation lacks shardkit.errors: fall back to the builtins.
        built.unwrap_or_else(|_| match errno {
            Some(n) if n != 0 => PyOSError::new_err((n, msg)),
            Some(_) => PyOSError::new_err(msg),
            None => PyValueError::new_err(msg),
        })
    })
}

/// A `shardkit.errors` exception of `class` (e.g. "InvalidArgumentError", "OutOfRangeError")
/// raised by the bindings themselves, for conditions the library does not see (an argument the
/// bindings check). Falls back to the builtin only for a broken installation.
pub(crate) fn py_error(class: &str, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::with_gil(|py| {
        py.import("shardkit.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.call1((msg.as_str(),)))
            .map(PyErr::from_value)
            .unwrap_or_else(|_| match class {
                "OutOfRangeError" => PyIndexError::new_err(msg),
                "InternalError" => PyRuntimeError::new_err(msg),
                _ => PyValueError::new_err(msg),
            })
    })
}

pub(crate) enum Storage {
    /// A batch buffer of the engine holding values of the buffer-protocol format (and item
    /// size) given.
    Engine(Buffer, (&'static CStr, isize)),
    F32(Vec<f32>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    /// Owned bytes of any element type (struct format and item size given).
    Bytes(Vec<u8>, &'static CStr, isize),
    /// A view into memory kept alive by `owner` (a shard's memory map, a batch buffer that
    /// several arrays share).
    Held(Held),
}

/// Bytes inside memory that `owner` keeps alive.
pub(crate) struct Held {
    _owner: Arc<dyn Send + Sync>,
    ptr: *const u8,
    len: usize,
    format: &'static CStr,
    item: isize,
    /// False for views of a read-only memory map. True for a batch buffer, whose disjoint
    /// regions belong to the arrays handed out (no Rust code reads them afterwards).
    writable: bool,
}

// SAFETY: `ptr` points into memory owned by `owner`, which is Send + Sync and outlives the view;
// the bytes are never written through it.
unsafe impl Send for Held {}
// SAFETY: as above.
unsafe impl Sync for Held {}

/// The buffer-protocol format of a safetensors dtype (BF16 as its uint16 bit pattern).
pub(crate) fn format(d: safetensors::Dtype) -> PyResult<(&'static CStr, isize)> {
    use safetensors::Dtype;
    Ok(match d {
        Dtype::I64 => (c"q", 8),
        Dtype::I32 => (c"i", 4),
        Dtype::U32 => (c"I", 4),
        Dtype::U8 => (c"B", 1),
        Dtype::BOOL => (c"?", 1),
        Dtype::F32 => (c"f", 4),
        Dtype::F16 => (c"e", 2),
        Dtype::BF16 => (c"H", 2),
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype {other} has no buffer-protocol format here"
            )))
        }
    })
}

/// The buffer-protocol format of a stored activation type: bfloat16 as its uint16 bit pattern
/// (the Python wrappers view it as `ml_dtypes.bfloat16` or `torch.bfloat16`), float16 as
/// numpy's `e`.
pub(crate) fn value_format(d: shardkit::precision::Dtype) -> PyResult<(&'static CStr, isize)> {
    use shardkit::precision::Dtype;
    Ok(match d {
        Dtype::F32 => (c"f", 4),
        Dtype::BF16 => (c"H", 2),
        Dtype::F16 => (c"e", 2),
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype {other} has no buffer-protocol format here"
            )))
        }
    })
}

/// A view of `bytes`, inside memory `owner` keeps alive.
pub(crate) fn held(
    owner: Arc<dyn Send + Sync>,
    bytes: &[u8],
    dtype: safetensors::Dtype,
    shape: &[usize],
    writable: bool,
) -> PyResult<RustBuffer> {
    Ok(RustBuffer::view(
        owner,
        bytes,
        format(dtype)?,
        shape,
        false,
        writable,
    ))
}

/// A pool of batch buffers over memory that `keeper` (a Python list of pinned torch tensors)
/// owns; each region is (address, bytes), page-aligned.
pub(crate) fn external_pool(
    keeper: PyObject,
    regions: Vec<(usize, usize)>,
) -> PyResult<shardkit::engine::BufferPool> {
    let regions: Vec<(*mut u8, usize)> = regions
        .into_iter()
        .map(|(p, n)| (p as *mut u8, n))
        .collect();
    // SAFETY: shardkit.torch passes regions inside tensors that `keeper` holds (and so keeps
    // alive for as long as any buffer of the pool exists), each used by this loader alone.
    unsafe { shardkit::engine::BufferPool::external(&regions, Arc::new(keeper)) }.map_err(to_py)
}

/// One writable array per field of a batch buffer, each a view that keeps the buffer alive
/// (the buffer returns to its pool once every view is gone).
pub(crate) fn batch_views(
    data: Buffer,
    fields: &[shardkit::engine::Field],
) -> PyResult<Vec<(&'static str, RustBuffer)>> {
    let data: Arc<Buffer> = Arc::new(data);
    fields
        .iter()
        .map(|f| {
            let region = data.field(f);
            Ok((f.name, held(data.clone(), region, f.dtype, &f.shape, true)?))
        })
        .collect()
}

/// Memory owned by Rust, exported to Python through the buffer protocol (numpy wraps it
/// without a copy; the array keeps this object alive).
#[pyclass(module = "shardkit._shardkit")]
pub struct RustBuffer {
    storage: Storage,
    shape: Vec<isize>,
    strides: Vec<isize>,
    /// False only for column-major data with two or more dimensions longer than one: such a
    /// buffer is refused to consumers that cannot take strides or insist on C order.
    c_contiguous: bool,
}

impl RustBuffer {
    /// Row-major (C order) elements of `shape`.
    pub(crate) fn new(storage: Storage, shape: &[usize]) -> RustBuffer {
        RustBuffer::with_order(storage, shape, false)
    }

    /// Elements of `shape` in column-major order when `fortran` (the first index varies
    /// fastest), else row-major.
    pub(crate) fn with_order(storage: Storage, shape: &[usize], fortran: bool) -> RustBuffer {
        let mut b = RustBuffer {
            storage,
            shape: shape.iter().map(|&s| s as isize).collect(),
            strides: Vec::new(),
            c_contiguous: true,
        };
        let item = b.parts().3;
        let mut strides = vec![item; shape.len()];
        if fortran {
            for i in 1..shape.len() {
                strides[i] = strides[i - 1] * shape[i - 1] as isize;
            }
            // Only the order of the dimensions longer than one matters (numpy's rule).
            b.c_contiguous = shape.contains(&0) || shape.iter().filter(|&&d| d > 1).count() < 2;
        } else {
            for i in (0..shape.len().saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * shape[i + 1] as isize;
            }
        }
        b.strides = strides;
        b
    }

    /// A view of `bytes` (elements of the buffer-protocol `format` and `item` size), which
    /// `owner` keeps alive as long as any array over the view exists.
    pub(crate) fn view(
        owner: Arc<dyn Send + Sync>,
        bytes: &[u8],
        (format, item): (&'static CStr, isize),
        shape: &[usize],
        fortran: bool,
        writable: bool,
    ) -> RustBuffer {
        let held = Held {
            _owner: owner,
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            format,
            item,
            writable,
        };
        RustBuffer::with_order(Storage::Held(held), shape, fortran)
    }
    /// (pointer, bytes, struct format, item size).
    fn parts(&self) -> (*const u8, usize, &'static CStr, isize) {
        fn raw<T>(v: &[T], format: &'static CStr) -> (*const u8, usize, &'static CStr, isize) {
            let item = std::mem::size_of::<T>();
            (
                v.as_ptr().cast(),
                std::mem::size_of_val(v),
                format,
                item as isize,
            )
        }
        match &self.storage {
            Storage::Engine(b, (format, item)) => (b.as_ptr(), b.len(), format, *item),
            Storage::F32(v) => raw(v, c"f"),
            Storage::I64(v) => raw(v, c"q"),
            Storage::U32(v) => raw(v, c"I"),
            Storage::U64(v) => raw(v, c"Q"),
            Storage::Bytes(v, format, item) => (v.as_ptr(), v.len(), format, *item),
            Storage::Held(h) => (h.ptr, h.len, h.format, h.item),
        }
    }
}

#[pymethods]
impl RustBuffer {
    /// Fills a Py_buffer view over this object's memory (row- or column-major; read-only for
    /// memory maps).
    ///
    /// # Safety
    /// Called by CPython with a valid `view` pointer.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyValueError::new_err("null Py_buffer"));
        }
        let this = slf.borrow();
        let readonly = matches!(&this.storage, Storage::Held(h) if !h.writable);
        if readonly && (flags & pyo3::ffi::PyBUF_WRITABLE) != 0 {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "read-only memory (a memory-mapped file)",
            ));
        }
        if !this.c_contiguous {
            let strided = (flags & pyo3::ffi::PyBUF_STRIDES) == pyo3::ffi::PyBUF_STRIDES;
            let wants_c = (flags & pyo3::ffi::PyBUF_C_CONTIGUOUS) == pyo3::ffi::PyBUF_C_CONTIGUOUS;
            if !strided || wants_c {
                return Err(pyo3::exceptions::PyBufferError::new_err(
                    "column-major (Fortran-order) memory: the consumer must accept strides",
                ));
            }
        }
        let (ptr, len, format, item) = this.parts();
        let ptr = if len == 0 {
            std::ptr::NonNull::<u64>::dangling().as_ptr().cast::<u8>()
        } else {
            ptr
        };
        let v = &mut *view;
        v.obj = slf.clone().into_any().into_ptr();
        v.buf = ptr as *mut std::ffi::c_void;
        v.len = len as isize;
        v.readonly = c_int::from(readonly);
        v.itemsize = item;
        v.format = format.as_ptr() as *mut _;
        v.ndim = this.shape.len() as c_int;
        v.shape = this.shape.as_ptr() as *mut isize;
        v.strides = this.strides.as_ptr() as *mut isize;
        v.suboffsets = std::ptr::null_mut();
        v.internal = std::ptr::null_mut();
        Ok(())
    }

    /// Nothing to release: the memory lives as long as this object.
    ///
    /// # Safety
    /// Called by CPython.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    /// Bytes held.
    fn __len__(&self) -> usize {
        self.parts().1
    }
}

/// A dict of named values: the one shape the compiled core hands records and batches to Python
/// in (keys are the names the Python wrappers use).
pub(crate) fn record<'py>(
    py: Python<'py>,
    items: impl IntoIterator<Item = (&'static str, PyObject)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Converts a value for [`record`].
pub(crate) fn obj<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: T) -> PyResult<PyObject> {
    v.into_pyobject(py)
        .map(|b| pyo3::BoundObject::into_bound(b).into_any().unbind())
        .map_err(Into::into)
}

/// Drops `value` (a writer) with the GIL released: ending a writer that streams to a store
/// waits for its uploads and deletes its lock there, which must not stall the other Python
/// threads (nor a server running in this process) when a writer is garbage-collected unclosed.
pub(crate) fn drop_without_gil<T: Send>(value: T) {
    Python::with_gil(|py| py.allow_threads(move || drop(value)));
}

pub(crate) fn json_of(v: &json::Value) -> String {
    json::to_compact(v, false, json::Escape::Utf8)
}

/// A C-contiguous buffer of `T` from any exporter (numpy array, memoryview, ...).
pub(crate) fn contiguous<T: pyo3::buffer::Element>(
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<PyBuffer<T>> {
    let buf = PyBuffer::<T>::get(obj).map_err(|e| {
        py_error(
            "InvalidArgumentTypeError",
            format!("{what}: {e} (convert with numpy.ascontiguousarray)"),
        )
    })?;
    if !buf.is_c_contiguous() {
        return Err(py_error(
            "InvalidArgumentError",
            format!("{what} must be C-contiguous (use numpy.ascontiguousarray)"),
        ));
    }
    Ok(buf)
}

/// Raw pointer that may cross `allow_threads`; the exporter keeps the memory alive meanwhile.
pub(crate) struct SendSlice<T>(pub(crate) *const T, pub(crate) usize);
// SAFETY: only read while the PyBuffer that owns the view is alive (see `Writer::write`).
unsafe impl<T> Send for SendSlice<T> {}
// SAFETY: as above; the slice is only read.
unsafe impl<T> Sync for SendSlice<T> {}
impl<T> SendSlice<T> {
    pub(crate) unsafe fn get(&self) -> &[T] {
        if self.1 == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.0, self.1)
        }
    }
}

/// Copies a local dataset directory to an `s3://` prefix (or back, `upload=False`), commit
/// record last, skipping objects already there; `progress(done_bytes, total_bytes)` is called
/// after each object. Returns {"copied", "skipped", "bytes"}.
/// The contiguous block of `units` (shards, sequences) that rank `rank` of `world_size`
/// writes: NeMo's `partition_cache_shards` (the first `units % world_size` ranks take one
/// more), as `(start, end)`.
#[pyfunction]
fn part_of(units: u64, rank: u64, world_size: u64) -> PyResult<(u64, u64)> {
    let r = shardkit::Rank::new(rank, world_size).map_err(to_py)?;
    let p = shardkit::part_of(units, r);
    Ok((p.start, p.end))
}

#[pyfunction]
#[pyo3(signature = (src, dst, upload, progress=None))]
fn transfer<'py>(
    py: Python<'py>,
    src: std::path::PathBuf,
    dst: std::path::PathBuf,
    upload: bool,
    progress: Option<PyObject>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut report = |done: u64, total: u64| {
        if let Some(cb) = &progress {
            Python::with_gil(|py| {
                if let Err(e) = cb.call1(py, (done, total)) {
                    e.print(py);
                }
            });
        }
    };
    let t = py
        .allow_threads(|| {
            if upload {
                shardkit::upload(&src, &dst, &mut report)
            } else {
                shardkit::download(&src, &dst, &mut report)
            }
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("copied", t.copied)?;
    d.set_item("skipped", t.skipped)?;
    d.set_item("bytes", t.bytes)?;
    Ok(d)
}

/// The object-store request counters of this process: {"gets", "get_bytes", "puts",
/// "put_bytes", "cache_read_bytes", "cache_mapped_bytes"}.
#[pyfunction]
fn storage_counters(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = shardkit::io::counters();
    let d = PyDict::new(py);
    d.set_item("gets", c.gets)?;
    d.set_item("get_bytes", c.get_bytes)?;
    d.set_item("puts", c.puts)?;
    d.set_item("put_bytes", c.put_bytes)?;
    d.set_item("cache_read_bytes", c.cache_read_bytes)?;
    d.set_item("cache_mapped_bytes", c.cache_mapped_bytes)?;
    Ok(d)
}

/// Waits until pages fetched through the local cache are written into it; raises the first
/// failure to write them since the last call.
#[pyfunction]
fn wait_for_cache(py: Python<'_>) -> PyResult<()> {
    py.allow_threads(shardkit::io::wait_for_cache)
        .map_err(to_py)
}

/// What the local cache holds: {"dir", "bytes", "limit_bytes", "objects": [{"url", "bytes",
/// "pages", "last_used"}]}, the largest object first.
#[pyfunction]
#[pyo3(signature = (dir=None))]
fn cache_info(py: Python<'_>, dir: Option<std::path::PathBuf>) -> PyResult<Bound<'_, PyDict>> {
    let dir = shardkit::io::cache_dir_or(dir).map_err(to_py)?;
    let usage = py
        .allow_threads(|| shardkit::io::cache_usage(&dir))
        .map_err(to_py)?;
    let objects = pyo3::types::PyList::empty(py);
    for o in &usage.objects {
        let d = PyDict::new(py);
        d.set_item("url", &o.url)?;
        d.set_item("bytes", o.bytes)?;
        d.set_item("pages", o.pages)?;
        let unix = o
            .last_used
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |t| t.as_secs_f64());
        d.set_item("last_used", unix)?;
        objects.append(d)?;
    }
    let d = PyDict::new(py);
    d.set_item("dir", dir)?;
    d.set_item("bytes", usage.bytes)?;
    d.set_item("limit_bytes", usage.limit)?;
    d.set_item("objects", objects)?;
    Ok(d)
}

/// Records `record` (JSON text, an object) as the provenance of the dataset at `path`, or
/// refuses it naming the keys that differ from the one recorded.
#[pyfunction]
fn provenance_record(py: Python<'_>, path: std::path::PathBuf, record: String) -> PyResult<()> {
    let v = shardkit::json::parse(record.as_bytes()).map_err(|e| {
        py_error(
            "InvalidArgumentError",
            format!("provenance is not JSON: {e}"),
        )
    })?;
    py.allow_threads(|| shardkit::provenance::record(&path, &v))
        .map_err(to_py)
}

/// The provenance recorded for the dataset at `path` (JSON text), or None.
#[pyfunction]
fn provenance_read(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Option<String>> {
    py.allow_threads(|| shardkit::provenance::read(&path))
        .map(|v| v.map(|v| shardkit::json::to_compact(&v, false, shardkit::json::Escape::Utf8)))
        .map_err(to_py)
}

/// Writes note `name` (bytes) of the dataset at `path`, replacing it.
#[pyfunction]
fn note_put(py: Python<'_>, path: std::path::PathBuf, name: String, data: Vec<u8>) -> PyResult<()> {
    py.allow_threads(|| shardkit::notes::put(&path, &name, &data))
        .map_err(to_py)
}

/// The notes of the dataset at `path` whose names start with `prefix`: [(name, bytes)].
#[pyfunction]
fn notes_list(
    py: Python<'_>,
    path: std::path::PathBuf,
    prefix: String,
) -> PyResult<Vec<(String, Vec<u8>)>> {
    py.allow_threads(|| shardkit::notes::list(&path, &prefix))
        .map_err(to_py)
}

/// Removes the cached objects at or below `url` (every one with None): {"files", "bytes"}.
#[pyfunction]
#[pyo3(signature = (url=None, dir=None))]
fn clear_cache(
    py: Python<'_>,
    url: Option<String>,
    dir: Option<std::path::PathBuf>,
) -> PyResult<Bound<'_, PyDict>> {
    let dir = shardkit::io::cache_dir_or(dir).map_err(to_py)?;
    let (files, bytes) = py
        .allow_threads(|| shardkit::io::clear_cache(&dir, url.as_deref()))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("files", files)?;
    d.set_item("bytes", bytes)?;
    Ok(d)
}

/// Hashes every file of the dataset at `path` into its checksums sidecar; returns its path.
#[pyfunction]
fn checksum(py: Python<'_>, path: std::path::PathBuf) -> PyResult<std::path::PathBuf> {
    py.allow_threads(|| shardkit::checksum::record(&path))
        .map(|r| r.sidecar)
        .map_err(to_py)
}

/// Checks the dataset at `path` against its sidecar: {"has_sidecar", "damage": [{"file",
/// "start", "end", "what"}]}.
#[pyfunction]
fn verify_checksums(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Bound<'_, PyDict>> {
    use shardkit::checksum::Verdict;
    let (has, damage) = match py
        .allow_threads(|| shardkit::checksum::verify(&path))
        .map_err(to_py)?
    {
        Verdict::NoSidecar => (false, Vec::new()),
        Verdict::Intact { .. } => (true, Vec::new()),
        Verdict::Damaged(d) => (true, d),
    };
    let damage = damage
        .into_iter()
        .map(|x| {
            record(
                py,
                [
                    ("file", obj(py, x.file)?),
                    ("start", obj(py, x.range.start)?),
                    ("end", obj(py, x.range.end)?),
                    ("what", obj(py, x.what)?),
                ],
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    record(
        py,
        [("has_sidecar", obj(py, has)?), ("damage", obj(py, damage)?)],
    )
}

/// Arms a test fault in the engine (tests only): "panic_in_gather", "panic_in_prepare",
/// "spawn_fails" or "read_fails", firing at its `after + 1`-th opportunity. Only in builds with
/// the `fault-injection` feature (the tests'; not the user's wheel).
#[cfg(feature = "fault-injection")]
#[pyfunction]
fn _inject_fault(name: &str, after: u64) -> PyResult<()> {
    use shardkit::internals::fault::{inject, Fault};
    let f = match name {
        "panic_in_gather" => Fault::PanicInGather,
        "panic_in_prepare" => Fault::PanicInPrepare,
        "spawn_fails" => Fault::SpawnFails,
        "read_fails" => Fault::ReadFails,
        _ => return Err(PyValueError::new_err(format!("unknown fault {name:?}"))),
    };
    inject(f, after);
    Ok(())
}

/// Disarms every test fault.
#[cfg(feature = "fault-injection")]
#[pyfunction]
fn _clear_faults() {
    shardkit::internals::fault::clear();
}

/// The compiled module.
#[pymodule]
fn _shardkit(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", shardkit::VERSION)?;
    m.add_class::<RustBuffer>()?;
    m.add_class::<loader::BatchIter>()?;
    m.add("DEFAULT_ORDER", shardkit::engine::DEFAULT_ORDER.name())?;
    saev::register(m)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_inject_fault, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(part_of, m)?)?;
    m.add_function(wrap_pyfunction!(transfer, m)?)?;
    m.add_function(wrap_pyfunction!(storage_counters, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_cache, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(clear_cache, m)?)?;
    m.add_function(wrap_pyfunction!(provenance_record, m)?)?;
    m.add_function(wrap_pyfunction!(provenance_read, m)?)?;
    m.add_function(wrap_pyfunction!(note_put, m)?)?;
    m.add_function(wrap_pyfunction!(notes_list, m)?)?;
    m.add_function(wrap_pyfunction!(verify_checksums, m)?)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_clear_faults, m)?)?;
    flat_tokens::register(m)?;
    eagle3::register(m)?;
    sdnb::register(m)?;
    Ok(())
}
