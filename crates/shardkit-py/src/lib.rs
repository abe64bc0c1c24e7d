//! `shardkit._shardkit`: the compiled core of the `shardkit` Python package.
//!
//! The public Python API lives in `python/shardkit/` (thin wrappers with docstrings and types);
//! this module exposes the Rust library with three rules: the GIL is released for every read,
//! wait and write; Rust errors become the natural Python exception with the same message; and
//! arrays cross the boundary without a copy, through the buffer protocol of [`RustBuffer`].

use std::ffi::{c_int, CStr};
use std::sync::{Arc, Mutex};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyKeyError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardkit::engine::{Buffer, Order};
use shardkit::json;
use shardkit::saev;

mod eagle3;
mod flat_tokens;
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
    Engine(Buffer),
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
            Storage::Engine(b) => (b.as_ptr(), b.len(), c"f", 4),
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

/// Key `k` of a state dict saved by `state_dict()`, as an integer.
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

pub(crate) fn state_u64(state: &Bound<'_, PyDict>, k: &str) -> PyResult<u64> {
    state
        .get_item(k)?
        .ok_or_else(|| PyKeyError::new_err(format!("state is missing {k:?}")))?
        .extract::<u64>()
}

/// Key `k` of a state dict, when it has it (states saved by older versions lack the order's
/// parameters: they are checked on the keys they have).
pub(crate) fn state_opt<'py, T: FromPyObject<'py>>(
    state: &Bound<'py, PyDict>,
    k: &str,
) -> PyResult<Option<T>> {
    match state.get_item(k)? {
        None => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|_| {
            to_py(shardkit::Error::Invalid(format!(
                "state key {k:?} has a value of the wrong type: {v}"
            )))
        }),
    }
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

/// Streaming, crash-safe writer of one saev directory.
#[pyclass(module = "shardkit._shardkit")]
pub struct Writer {
    inner: Option<saev::Writer>,
    path: String,
    start: String,
    shape: (usize, usize, usize, usize),
    content_tokens: usize,
}

impl Drop for Writer {
    fn drop(&mut self) {
        if let Some(w) = self.inner.take() {
            drop_without_gil(w);
        }
    }
}

/// Drops `value` (a writer) with the GIL released: ending a writer that streams to a store
/// waits for its uploads and deletes its lock there, which must not stall the other Python
/// threads (nor a server running in this process) when a writer is garbage-collected unclosed.
pub(crate) fn drop_without_gil<T: Send>(value: T) {
    Python::with_gil(|py| py.allow_threads(move || drop(value)));
}

#[pymethods]
impl Writer {
    #[new]
    #[pyo3(signature = (root, metadata_json, resume=false))]
    fn new(
        py: Python<'_>,
        root: std::path::PathBuf,
        metadata_json: &str,
        resume: bool,
    ) -> PyResult<Self> {
        let v = json::parse(metadata_json.as_bytes())
            .map_err(|e| py_error("InvalidArgumentError", format!("metadata: {e}")))?;
        let md = saev::Metadata::for_writing(&v).map_err(to_py)?;
        let shape = (
            md.n_examples() as usize,
            md.layers().len(),
            md.tokens_per_example() as usize,
            md.d_model() as usize,
        );
        let content_tokens = md.content_tokens_per_example() as usize;
        let w = py
            .allow_threads(|| saev::Writer::create(root, md, saev::WriterOptions { resume }))
            .map_err(to_py)?;
        let start = match w.start() {
            saev::WriteStart::Fresh => "fresh".to_string(),
            saev::WriteStart::Resumed { from } => format!("resumed:{from}"),
            saev::WriteStart::AlreadyComplete => "complete".to_string(),
        };
        Ok(Writer {
            path: w.destination().display().to_string(),
            inner: Some(w),
            start,
            shape,
            content_tokens,
        })
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
        let (n, l, t, d) = self.shape;
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
        let acts_s = SendSlice(a.buf_ptr() as *const f32, a.item_count());
        let lab_s = lab
            .as_ref()
            .map(|b| SendSlice(b.buf_ptr() as *const u8, b.item_count()));
        // SAFETY: `a` and `lab` (the exporters' views) outlive the closure.
        py.allow_threads(|| unsafe { w.write(acts_s.get(), lab_s.as_ref().map(|x| x.get())) })
            .map_err(to_py)
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
    /// One vector (D,) of (example, recorded layer, token slot).
    fn get(&self, py: Python<'_>, example: i64, layer: i64, token: i64) -> PyResult<RustBuffer> {
        let (e, t) = (index(example, "example")?, index(token, "token")?);
        let v = py
            .allow_threads(|| self.inner.get(e, layer, t))
            .map_err(to_py)?;
        let d = v.len();
        Ok(RustBuffer::new(Storage::F32(v), &[d]))
    }
    /// Many vectors (n, D): coordinates given as three equal-length sequences.
    fn take(
        &self,
        py: Python<'_>,
        examples: Vec<i64>,
        layers: Vec<i64>,
        tokens: Vec<i64>,
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
        let v = py
            .allow_threads(|| self.inner.take(&coords))
            .map_err(to_py)?;
        let d = self.inner.layout().d_model as usize;
        Ok(RustBuffer::new(Storage::F32(v), &[coords.len(), d]))
    }
    /// Rows of saev's indexed view for (layer, tokens).
    fn indexed_len(&self, layer: i64, tokens: &str) -> PyResult<u64> {
        let mode: saev::TokenMode = tokens.parse().map_err(to_py)?;
        Ok(self.inner.indexed(layer, mode).map_err(to_py)?.len())
    }
    /// Row `i` of saev's indexed view: {"act", "example_idx", "token_idx", "token_label"
    /// (None without labels)}.
    fn indexed_get<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        tokens: &str,
        i: i64,
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
        record(
            py,
            [
                (
                    "act",
                    obj(py, RustBuffer::new(Storage::F32(row.act), &[d]))?,
                ),
                ("example_idx", obj(py, row.example_idx)?),
                ("token_idx", obj(py, row.token_idx)?),
                ("token_label", obj(py, row.token_label)?),
            ],
        )
    }
}

/// {"rank", "world_size"} of a loader.
pub(crate) fn rank_world(py: Python<'_>, (rank, world): (u64, u64)) -> PyResult<Bound<'_, PyDict>> {
    record(
        py,
        [("rank", obj(py, rank)?), ("world_size", obj(py, world)?)],
    )
}

fn index(i: i64, what: &str) -> PyResult<u64> {
    u64::try_from(i)
        .map_err(|_| py_error("OutOfRangeError", format!("{what} index {i} is negative")))
}

/// Ordered or shuffled batches of a saev directory.
#[pyclass(module = "shardkit._shardkit")]
pub struct Loader {
    inner: saev::Loader,
}

#[pymethods]
impl Loader {
    #[new]
    #[pyo3(signature = (path, layer, tokens="content", batch_size=16384, order="sequential",
        seed=0, epoch=0, rank=None, world_size=None, drop_last=false, memory_budget=None,
        ignore_labels=Vec::new(), io_threads=16, direct_io=false, threads=0, verify=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        layer: &Bound<'_, PyAny>,
        tokens: &str,
        batch_size: u64,
        order: &str,
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
        o.order = order.parse::<Order>().map_err(to_py)?;
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
    /// Bytes of the `act` buffer of a full batch.
    #[getter]
    fn batch_bytes(&self) -> u64 {
        self.inner.batch_bytes()
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
    /// The resumable state: {"seed", "epoch", "cursor", "global_batch_size"} and the order's
    /// parameters ("order", "layer", "tokens", "ignore_labels", "drop_last", "memory_budget",
    /// "window_blocks", "rows").
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.inner.state();
        let d = PyDict::new(py);
        d.set_item("seed", st.seed)?;
        d.set_item("epoch", st.epoch)?;
        d.set_item("cursor", st.cursor)?;
        d.set_item("global_batch_size", st.global_batch_size)?;
        if let Some(o) = st.order {
            d.set_item("order", o.name())?;
        }
        match st.layer {
            Some(saev::LayerSel::Value(v)) => d.set_item("layer", v)?,
            Some(saev::LayerSel::All) => d.set_item("layer", "all")?,
            None => {}
        }
        if let Some(t) = st.tokens {
            d.set_item("tokens", t.name())?;
        }
        if let Some(v) = st.ignore_labels {
            d.set_item(
                "ignore_labels",
                v.into_iter().map(u64::from).collect::<Vec<u64>>(),
            )?;
        }
        if let Some(b) = st.drop_last {
            d.set_item("drop_last", b)?;
        }
        for (k, v) in [
            ("memory_budget", st.memory_budget),
            ("window_blocks", st.window_blocks),
            ("rows", st.rows),
        ] {
            if let Some(v) = v {
                d.set_item(k, v)?;
            }
        }
        Ok(d)
    }
    /// Restores a state from `state_dict()` (refused, naming each differing key, when it was
    /// taken by a loader that would serve other rows).
    fn load_state_dict(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let get = |k: &str| state_u64(state, k);
        let mut st = saev::LoaderState::position(
            get("seed")?,
            get("epoch")?,
            get("cursor")?,
            get("global_batch_size")?,
        );
        st.order = state_opt::<String>(state, "order")?
            .map(|s| s.parse::<Order>())
            .transpose()
            .map_err(to_py)?;
        st.tokens = state_opt::<String>(state, "tokens")?
            .map(|s| s.parse::<saev::TokenMode>())
            .transpose()
            .map_err(to_py)?;
        st.layer = match state.get_item("layer")? {
            None => None,
            Some(v) => Some(if let Ok(s) = v.extract::<String>() {
                s.parse::<saev::LayerSel>().map_err(to_py)?
            } else {
                saev::LayerSel::Value(state_opt::<i64>(state, "layer")?.unwrap_or_default())
            }),
        };
        st.ignore_labels = state_opt::<Vec<u8>>(state, "ignore_labels")?;
        st.drop_last = state_opt::<bool>(state, "drop_last")?;
        st.memory_budget = state_opt::<u64>(state, "memory_budget")?;
        st.window_blocks = state_opt::<u64>(state, "window_blocks")?;
        st.rows = state_opt::<u64>(state, "rows")?;
        self.inner.load_state(st).map_err(to_py)
    }
    /// Runs the rest of the epoch entirely in Rust and returns the payload bytes (for
    /// benchmarks: the same loader, process and page cache as a Python loop).
    fn _drain(&self, py: Python<'_>) -> PyResult<u64> {
        py.allow_threads(|| {
            let mut bytes = 0u64;
            for b in self.inner.iter()? {
                let b = b?;
                bytes += (b.n * b.d_model * 4) as u64;
            }
            Ok(bytes)
        })
        .map_err(to_py)
    }

    /// Starts a pass over the rest of the epoch.
    fn iter(&self, py: Python<'_>) -> PyResult<BatchIter> {
        let it = py.allow_threads(|| self.inner.iter()).map_err(to_py)?;
        Ok(BatchIter {
            pass: Pass::new(it),
        })
    }
}

/// One pass of a background iterator, shared by the batch iterators: advanced with the GIL
/// released, refused in a forked child (its threads belong to the parent, so waiting would
/// hang), and stopped as soon as it ends or fails. The Mutex makes it shareable between Python
/// threads (the channel receivers inside are not Sync).
pub(crate) struct Pass<I> {
    inner: Mutex<Option<I>>,
    pid: u32,
}

impl<T: Send, I: Iterator<Item = shardkit::Result<T>> + Send> Pass<I> {
    pub(crate) fn new(it: I) -> Self {
        Pass {
            inner: Mutex::new(Some(it)),
            pid: std::process::id(),
        }
    }

    pub(crate) fn next(&self, py: Python<'_>) -> PyResult<Option<T>> {
        if std::process::id() != self.pid {
            return Err(PyRuntimeError::new_err(
                "this iterator was started before fork(); start a new one in the child \
                 (iterating the loader again does)",
            ));
        }
        let inner = &self.inner;
        let next = py.allow_threads(|| {
            let mut guard = inner.lock().unwrap_or_else(|e| e.into_inner());
            let item = guard.as_mut().and_then(|it| it.next());
            if !matches!(item, Some(Ok(_))) {
                *guard = None; // finished or failed: stop the threads now
            }
            item
        });
        next.transpose().map_err(to_py)
    }

    /// Stops the threads now (also done when the Python object is garbage collected).
    pub(crate) fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.allow_threads(|| drop(inner.lock().unwrap_or_else(|e| e.into_inner()).take()));
    }
}

/// One pass of a [`Loader`]; yields {"act", "example_idx", "token_idx", "layer", "token_label",
/// "cursor"} (layer and token_label None when not selected).
#[pyclass(module = "shardkit._shardkit")]
pub struct BatchIter {
    pass: Pass<saev::Batches>,
}

#[pymethods]
impl BatchIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(b) = self.pass.next(py)? else {
            return Ok(None);
        };
        let n = b.n;
        let i64s = |v: Vec<i64>| RustBuffer::new(Storage::I64(v), &[n]);
        record(
            py,
            [
                (
                    "act",
                    obj(py, RustBuffer::new(Storage::Engine(b.act), &[n, b.d_model]))?,
                ),
                ("example_idx", obj(py, i64s(b.example_idx))?),
                ("token_idx", obj(py, i64s(b.token_idx))?),
                ("layer", obj(py, b.layer.map(i64s))?),
                ("token_label", obj(py, b.token_label.map(i64s))?),
                ("cursor", obj(py, b.cursor)?),
            ],
        )
        .map(Some)
    }
    /// Stops the reader threads now (also done when the iterator is garbage collected).
    fn close(&self, py: Python<'_>) {
        self.pass.close(py)
    }
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

/// Copies a local dataset directory to an `s3://` prefix (or back, `upload=False`), commit
/// record last, skipping objects already there; `progress(done_bytes, total_bytes)` is called
/// after each object. Returns {"copied", "skipped", "bytes"}.
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
                shardkit::storage::upload(&src, &dst, &mut report)
            } else {
                shardkit::storage::download(&src, &dst, &mut report)
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
    let c = shardkit::storage::counters();
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
    py.allow_threads(shardkit::storage::wait_for_cache)
        .map_err(to_py)
}

/// What the local cache holds: {"dir", "bytes", "limit_bytes", "objects": [{"url", "bytes",
/// "pages", "last_used"}]}, the largest object first.
#[pyfunction]
#[pyo3(signature = (dir=None))]
fn cache_info(py: Python<'_>, dir: Option<std::path::PathBuf>) -> PyResult<Bound<'_, PyDict>> {
    let dir = shardkit::storage::cache_dir_or(dir).map_err(to_py)?;
    let usage = py
        .allow_threads(|| shardkit::storage::cache_usage(&dir))
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

/// Removes the cached objects at or below `url` (every one with None): {"files", "bytes"}.
#[pyfunction]
#[pyo3(signature = (url=None, dir=None))]
fn clear_cache(
    py: Python<'_>,
    url: Option<String>,
    dir: Option<std::path::PathBuf>,
) -> PyResult<Bound<'_, PyDict>> {
    let dir = shardkit::storage::cache_dir_or(dir).map_err(to_py)?;
    let (files, bytes) = py
        .allow_threads(|| shardkit::storage::clear_cache(&dir, url.as_deref()))
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
    m.add_class::<Writer>()?;
    m.add_class::<Dataset>()?;
    m.add_class::<Loader>()?;
    m.add_class::<BatchIter>()?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_inject_fault, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(transfer, m)?)?;
    m.add_function(wrap_pyfunction!(storage_counters, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_cache, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(clear_cache, m)?)?;
    m.add_function(wrap_pyfunction!(verify_checksums, m)?)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_clear_faults, m)?)?;
    flat_tokens::register(m)?;
    eagle3::register(m)?;
    sdnb::register(m)?;
    Ok(())
}
