//! The one loader wrapper every format's Python loader class uses: a pass over a loader's
//! batches (advanced with the GIL released, each batch handed over as a dict of arrays), the
//! loader state as a dict and back (the same conversion for every format: the Rust
//! [`LoaderState`] is the dict, key by key), and `{"rank", "world_size"}`.

use std::sync::Mutex;

use pyo3::exceptions::{PyKeyError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString, PyTuple};
use shardkit::engine::{LoaderState, StateValue};

use crate::{obj, record, to_py};

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
        // An exception a wait inside the pass left set (Ctrl-C while a follow-mode loader
        // waited for shards) is the one raised.
        next.transpose()
            .map_err(|e| PyErr::take(py).unwrap_or_else(|| to_py(e)))
    }

    /// Stops the threads now (also done when the Python object is garbage collected).
    pub(crate) fn close(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.allow_threads(|| drop(inner.lock().unwrap_or_else(|e| e.into_inner()).take()));
    }
}

/// A batch as Python receives it: a dict of named arrays (views of the batch's buffer, no
/// copy) and values. Each format's module implements it for its batch.
pub(crate) trait IntoDict: Send + 'static {
    /// The dict.
    fn into_dict(self, py: Python<'_>) -> PyResult<Bound<'_, PyDict>>;
}

/// A type-erased batch.
trait AnyBatch: Send {
    fn dict<'py>(self: Box<Self>, py: Python<'py>) -> PyResult<Bound<'py, PyDict>>;
}

impl<T: IntoDict> AnyBatch for T {
    fn dict<'py>(self: Box<Self>, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        (*self).into_dict(py)
    }
}

type Erased = Box<dyn Iterator<Item = shardkit::Result<Box<dyn AnyBatch>>> + Send>;

/// One pass of a loader, whatever its format: yields each batch's dict (see [`IntoDict`]).
#[pyclass(module = "shardkit._shardkit")]
pub struct BatchIter {
    pass: Pass<Erased>,
}

impl BatchIter {
    /// A pass over `batches`.
    pub(crate) fn new<T: IntoDict, I>(batches: I) -> BatchIter
    where
        I: Iterator<Item = shardkit::Result<T>> + Send + 'static,
    {
        let erased: Erased = Box::new(batches.map(|b| b.map(|b| Box::new(b) as Box<dyn AnyBatch>)));
        BatchIter {
            pass: Pass::new(erased),
        }
    }
}

#[pymethods]
impl BatchIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.pass.next(py)?.map(|b| b.dict(py)).transpose()
    }
    /// Stops the reader threads now (also done when the iterator is garbage collected).
    fn close(&self, py: Python<'_>) {
        self.pass.close(py)
    }
}

/// {"rank", "world_size"} of a loader.
pub(crate) fn rank_world(py: Python<'_>, (rank, world): (u64, u64)) -> PyResult<Bound<'_, PyDict>> {
    record(
        py,
        [("rank", obj(py, rank)?), ("world_size", obj(py, world)?)],
    )
}

/// The keys of [`LoaderState`]'s common part, in the order a state dict lists them (after
/// `"format"`).
const COMMON: [&str; 5] = ["seed", "epoch", "batch", "batch_size", "world_size"];

/// A loader state as the dict `state_dict()` returns: `"format"`, the common position, then the
/// format's own keys, in the state's order.
pub(crate) fn state_dict<'py>(py: Python<'py>, st: &LoaderState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("format", &st.format)?;
    for (k, v) in COMMON
        .iter()
        .zip([st.seed, st.epoch, st.batch, st.batch_size, st.world_size])
    {
        d.set_item(k, v)?;
    }
    for (k, v) in &st.params {
        match v {
            StateValue::UInt(x) => d.set_item(k, x)?,
            StateValue::Int(x) => d.set_item(k, x)?,
            StateValue::Bool(x) => d.set_item(k, x)?,
            StateValue::Str(x) | StateValue::Other(x) => d.set_item(k, x)?,
            StateValue::List(x) => d.set_item(k, x)?,
        }
    }
    Ok(d)
}

/// Key `k` of a state dict, as an integer (a `KeyError` naming it when it is missing).
fn required(state: &Bound<'_, PyDict>, k: &str) -> PyResult<u64> {
    state
        .get_item(k)?
        .ok_or_else(|| PyKeyError::new_err(format!("state is missing {k:?}")))?
        .extract::<u64>()
}

/// One value of a state dict's format-specific part.
fn value(v: &Bound<'_, PyAny>) -> PyResult<StateValue> {
    if v.is_instance_of::<PyBool>() {
        return Ok(StateValue::Bool(v.extract()?));
    }
    if v.is_instance_of::<PyString>() {
        return Ok(StateValue::Str(v.extract()?));
    }
    if let Ok(x) = v.extract::<u64>() {
        return Ok(StateValue::UInt(x));
    }
    if let Ok(x) = v.extract::<i64>() {
        return Ok(StateValue::Int(x));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        if let Ok(items) = v.extract::<Vec<u64>>() {
            return Ok(StateValue::List(items));
        }
    }
    Ok(StateValue::Other(v.str()?.to_string()))
}

/// A state dict saved by `state_dict()` (by this version or an older one) as a
/// [`LoaderState`]: `seed` and `epoch` are required; the position is `batch`, `batch_size` and
/// `world_size`, or, with `global_position` (saev's states before they had the common
/// position), `cursor` and `global_batch_size`; every other key is kept, in order, for the
/// loader to check.
pub(crate) fn state_from_dict(
    state: &Bound<'_, PyDict>,
    global_position: bool,
) -> PyResult<LoaderState> {
    let format = match state.get_item("format")? {
        Some(f) => f.extract::<String>().unwrap_or_default(),
        None => String::new(),
    };
    let seed = required(state, "seed")?;
    let epoch = required(state, "epoch")?;
    // The position keys after seed and epoch.
    let position = &COMMON[2..];
    let mut st = if !global_position || position.iter().all(|k| state.contains(k).unwrap_or(false))
    {
        LoaderState::new(
            &format,
            seed,
            epoch,
            required(state, "batch")?,
            required(state, "batch_size")?,
            required(state, "world_size")?,
        )
    } else {
        let cursor = required(state, "cursor")?;
        let global = required(state, "global_batch_size")?;
        let batch = if global == 0 {
            0
        } else {
            cursor.div_ceil(global)
        };
        LoaderState::new(&format, seed, epoch, batch, global, 1)
    };
    for (k, v) in state.iter() {
        let k: String = k.extract()?;
        if k == "format" || COMMON.contains(&k.as_str()) {
            continue;
        }
        st.set(&k, value(&v)?);
    }
    Ok(st)
}
