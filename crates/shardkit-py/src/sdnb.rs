//! SameDiff container bindings (wrapped by `shardkit/sdnb.py`): a mapped reader whose arrays
//! are read-only views of the container's memory map, the writer, conversion and metadata
//! edits.

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use shardkit::sdnb::{self, Container, DType, Format, Kind, Order, SaveOptions, TensorIn, VarType};

use crate::{contiguous, obj, record, to_py, RustBuffer, SendSlice};

/// The buffer-protocol format of a dtype's bytes. BFLOAT16 and FLOAT8 go out as their bit
/// patterns (uint16, uint8); the Python wrapper reinterprets them with ml_dtypes.
fn format(d: DType) -> Option<(&'static CStr, isize)> {
    use DType::*;
    Some(match d {
        Bool => (c"?", 1),
        Float8 | Uint8 => (c"B", 1),
        Int8 => (c"b", 1),
        Half => (c"e", 2),
        Bfloat16 | Uint16 => (c"H", 2),
        Int16 => (c"h", 2),
        Float => (c"f", 4),
        Int32 => (c"i", 4),
        Uint32 => (c"I", 4),
        Double => (c"d", 8),
        Int64 => (c"q", 8),
        Uint64 => (c"Q", 8),
        _ => return None,
    })
}

fn order_name(o: Order) -> &'static str {
    match o {
        Order::C => "c",
        Order::F => "f",
    }
}

/// An opened container. Arrays keep the container (and so its memory map) alive; `close`
/// only drops this object's reference.
#[pyclass(module = "shardkit._shardkit", frozen)]
pub struct SdnbContainer {
    inner: RwLock<Option<Arc<Container>>>,
    path: String,
    kind: String,
    shards: usize,
    bundle: Option<String>,
}

impl SdnbContainer {
    fn get(&self) -> PyResult<Arc<Container>> {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                crate::py_error(
                    "InvalidArgumentError",
                    format!("{}: the container is closed", self.path),
                )
            })
    }
}

#[pymethods]
impl SdnbContainer {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let c = py.allow_threads(|| sdnb::open(&path)).map_err(to_py)?;
        let kind = c.kind().to_string();
        let shards = match c.kind() {
            Kind::Sdnb => 1,
            Kind::Sharded { shards } | Kind::Sdz { shards } => shards,
        };
        Ok(SdnbContainer {
            path: c.path().display().to_string(),
            bundle: c.bundle_manifest().map(|p| p.display().to_string()),
            inner: RwLock::new(Some(Arc::new(c))),
            kind,
            shards,
        })
    }
    /// The path it was opened from.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }
    /// "sdnb", "sharded" or "sdz".
    #[getter]
    fn kind(&self) -> &str {
        &self.kind
    }
    /// The native runtime's bundle manifest it was opened through, if any.
    #[getter]
    fn bundle_manifest(&self) -> Option<&str> {
        self.bundle.as_deref()
    }
    /// The number of SDNB parts (shards) that make up the model.
    #[getter]
    fn shards(&self) -> usize {
        self.shards
    }
    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
    /// The graph's metadata, in stored order.
    #[getter]
    fn metadata(&self) -> PyResult<Vec<(String, String)>> {
        Ok(self.get()?.metadata().to_vec())
    }
    /// Every variable, in graph order.
    #[getter]
    /// Each a dict {"name", "var_type", "dtype", "shape", "storage", "nbytes", "order"}.
    fn variables<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.get()?
            .variables()
            .iter()
            .map(|v| {
                record(
                    py,
                    [
                        ("name", obj(py, &v.name)?),
                        ("var_type", obj(py, v.var_type.to_string())?),
                        ("dtype", obj(py, v.dtype.to_string())?),
                        ("shape", obj(py, &v.shape)?),
                        ("storage", obj(py, v.storage.to_string())?),
                        ("nbytes", obj(py, v.byte_len)?),
                        ("order", obj(py, order_name(v.order))?),
                    ],
                )
            })
            .collect()
    }
    /// The number of ops in the graph.
    #[getter]
    fn op_count(&self) -> PyResult<usize> {
        Ok(self.get()?.op_count())
    }
    /// The files (or `archive!entry` names) of the model, in shard order.
    #[getter]
    fn parts(&self) -> PyResult<Vec<String>> {
        let c = self.get()?;
        Ok(c.layout()
            .iter()
            .map(|p| p.name.display().to_string())
            .collect())
    }
    /// Archive entries that are not part of the model.
    #[getter]
    fn extra_entries(&self) -> PyResult<Vec<String>> {
        Ok(self
            .get()?
            .extra_entries()
            .into_iter()
            .map(str::to_owned)
            .collect())
    }
    /// An extra archive entry's bytes.
    fn extra_entry<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let c = self.get()?;
        let bytes = py.allow_threads(|| c.extra_entry(name)).map_err(to_py)?;
        Ok(PyBytes::new(py, &bytes))
    }
    /// {"dtype" (name), "array"} of a variable: a read-only view of the map, in the stored
    /// order.
    fn array<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let c = self.get()?;
        // From an object store the first access fetches the blob: without the GIL.
        let t = py.allow_threads(|| c.tensor(name)).map_err(to_py)?;
        let fmt = format(t.dtype).ok_or_else(|| {
            crate::py_error(
                "InvalidArgumentError",
                format!(
                    "{}: variable {name:?} has dtype {}, which has no numpy equivalent",
                    self.path, t.dtype
                ),
            )
        })?;
        // The reader checked that data variables have non-negative dimensions; refuse rather
        // than wrap if that ever fails.
        let shape = t
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|_| {
                crate::py_error(
                    "CorruptDataError",
                    format!(
                        "{}: variable {name:?} has a negative dimension {:?}",
                        self.path, t.shape
                    ),
                )
            })?;
        let fortran = t.order == Order::F;
        let (dtype, bytes) = (t.dtype.to_string(), t.bytes);
        let view = RustBuffer::view(c.clone(), bytes, fmt, &shape, fortran, false);
        record(py, [("dtype", obj(py, dtype)?), ("array", obj(py, view)?)])
    }
    /// Fetches these tensors of a container read from a store in one batch (without the GIL).
    fn prefetch(&self, py: Python<'_>, names: Vec<String>) -> PyResult<()> {
        let c = self.get()?;
        py.allow_threads(|| c.prefetch(&names)).map_err(to_py)
    }
    /// Drops this object's reference to the container; arrays handed out stay valid.
    fn close(&self) {
        self.inner.write().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// One tensor to save, as the Python wrapper passes it: (name, var_type, dtype, shape, order,
/// its bytes as a C-contiguous uint8 buffer).
type TensorArg<'py> = (String, String, String, Vec<i64>, String, Bound<'py, PyAny>);

fn save_options(
    path: &std::path::Path,
    format: Option<&str>,
    shard_size: Option<u64>,
    metadata: Vec<(String, String)>,
) -> PyResult<SaveOptions> {
    let format = match format {
        Some(f) => f.parse::<Format>().map_err(to_py)?,
        None => Format::infer(path, shard_size),
    };
    // The library ignores a shard size for a single file; a caller asking for both erred.
    if format == Format::Sdnb && shard_size.is_some() {
        return Err(crate::py_error(
            "InvalidArgumentError",
            format!(
                "{}: shard_size needs format \"sharded\" or \"sdz\"",
                path.display()
            ),
        ));
    }
    Ok(SaveOptions {
        format,
        shard_size,
        metadata,
        ..SaveOptions::default()
    })
}

/// A writer progress hook calling a Python `callback(done, total)` (taking the GIL for the
/// call; the write itself runs without it). Errors raised by the callback are ignored: a
/// progress display must not abort a write half-way.
fn py_progress(callback: PyObject) -> Arc<dyn Fn(u64, u64) + Send + Sync> {
    Arc::new(move |done, total| {
        Python::with_gil(|py| {
            let _ = callback.call1(py, (done, total));
        })
    })
}

fn paths(files: Vec<PathBuf>) -> Vec<String> {
    files.iter().map(|p| p.display().to_string()).collect()
}

/// Writes tensors as a container; returns the files written. The bytes are read in place
/// (no copy) with the GIL released.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata, format, shard_size, align, slack, extra_entries, progress=None, bundle=false))]
#[allow(clippy::too_many_arguments)]
pub fn sdnb_save(
    py: Python<'_>,
    path: PathBuf,
    tensors: Vec<TensorArg<'_>>,
    metadata: Vec<(String, String)>,
    format: Option<&str>,
    shard_size: Option<u64>,
    align: u64,
    slack: u64,
    extra_entries: Vec<(String, Bound<'_, PyBytes>)>,
    progress: Option<PyObject>,
    bundle: bool,
) -> PyResult<Vec<String>> {
    let mut opts = save_options(&path, format, shard_size, metadata)?;
    opts.progress = progress.map(py_progress);
    opts.bundle = bundle;
    // Only an archive has room for them; the library would drop them silently.
    if !extra_entries.is_empty() && opts.format != Format::Sdz {
        return Err(crate::py_error(
            "InvalidArgumentError",
            format!("{}: extra_entries need an SDZ archive", path.display()),
        ));
    }
    opts.align = align;
    opts.slack = slack;
    opts.extra_entries = extra_entries
        .iter()
        .map(|(n, b)| (n.clone(), b.as_bytes().to_vec()))
        .collect();
    // Everything but the bytes is checked and converted before the GIL is released.
    let mut metas = Vec::with_capacity(tensors.len());
    let mut bufs = Vec::with_capacity(tensors.len());
    for (name, var_type, dtype, shape, order, data) in tensors {
        let var_type: VarType = var_type.parse().map_err(to_py)?;
        let dtype: DType = dtype.parse().map_err(to_py)?;
        let order = match order.as_str() {
            "c" => Order::C,
            "f" => Order::F,
            other => {
                return Err(crate::py_error(
                    "InvalidArgumentError",
                    format!("tensor {name:?}: order must be \"c\" or \"f\", not {other:?}"),
                ))
            }
        };
        let buf = contiguous::<u8>(&data, &format!("tensor {name:?} (bytes)"))?;
        metas.push((name, var_type, dtype, shape, order));
        bufs.push(buf);
    }
    let slices: Vec<SendSlice<u8>> = bufs
        .iter()
        .map(|b| SendSlice(b.buf_ptr() as *const u8, b.item_count()))
        .collect();
    py.allow_threads(|| {
        let tensors: Vec<TensorIn> = metas
            .into_iter()
            .zip(&slices)
            .map(|((name, var_type, dtype, shape, order), s)| TensorIn {
                name,
                var_type,
                dtype,
                shape,
                order,
                // SAFETY: the exporters' views (`bufs`) outlive the closure.
                bytes: unsafe { s.get() },
            })
            .collect();
        sdnb::save(&path, &tensors, &opts)
    })
    .map(paths)
    .map_err(to_py)
}

/// Writes `src` (a path or an open [`SdnbContainer`]) again as `dst`; returns the files
/// written. Metadata given overrides the source's keys.
#[pyfunction]
#[pyo3(signature = (src, dst, format, shard_size, metadata, progress=None, bundle=false))]
#[allow(clippy::too_many_arguments)] // the Python keyword arguments, one by one
pub fn sdnb_convert(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: PathBuf,
    format: Option<&str>,
    shard_size: Option<u64>,
    metadata: Vec<(String, String)>,
    progress: Option<PyObject>,
    bundle: bool,
) -> PyResult<Vec<String>> {
    let mut opts = save_options(&dst, format, shard_size, metadata)?;
    opts.progress = progress.map(py_progress);
    opts.bundle = bundle;
    enum Source {
        Open(Arc<Container>),
        Path(PathBuf),
    }
    let src = match src.downcast::<SdnbContainer>() {
        Ok(c) => Source::Open(c.get().get()?),
        Err(_) => Source::Path(src.extract()?),
    };
    py.allow_threads(|| {
        let c = match src {
            Source::Open(c) => c,
            Source::Path(p) => Arc::new(sdnb::open(p)?),
        };
        sdnb::convert(&c, &dst, &opts)
    })
    .map(paths)
    .map_err(to_py)
}

/// Applies metadata changes (None removes a key); returns {"in_place", "files"} (the files
/// changed).
#[pyfunction]
#[pyo3(signature = (path, changes, rewrite))]
pub fn sdnb_set_metadata(
    py: Python<'_>,
    path: PathBuf,
    changes: Vec<(String, Option<String>)>,
    rewrite: bool,
) -> PyResult<Bound<'_, PyDict>> {
    let o = py
        .allow_threads(|| sdnb::set_metadata(&path, &changes, rewrite))
        .map_err(to_py)?;
    record(
        py,
        [
            ("in_place", obj(py, o.in_place)?),
            ("files", obj(py, paths(o.files))?),
        ],
    )
}

/// Registers the class and functions.
/// `shardkit sdnb validate [--deep] --json` as a JSON string.
#[pyfunction]
#[pyo3(signature = (path, deep=false))]
pub fn sdnb_validate(py: Python<'_>, path: PathBuf, deep: bool) -> String {
    let report = py.allow_threads(|| sdnb::validate(&path, deep));
    crate::json_of(&report.to_json())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SdnbContainer>()?;
    m.add_function(wrap_pyfunction!(sdnb_save, m)?)?;
    m.add_function(wrap_pyfunction!(sdnb_convert, m)?)?;
    m.add_function(wrap_pyfunction!(sdnb_set_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(sdnb_validate, m)?)?;
    Ok(())
}
