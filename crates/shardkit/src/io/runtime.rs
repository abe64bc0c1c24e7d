//! The tokio runtime every request runs on (one per process, made again after fork), and
//! blocking on it.

use std::sync::Mutex;

use super::stop::{stopped_error, Stop, STOP_POLL};
use crate::error::{Error, Result};

/// The runtime that drives every request: a few threads suffice, they only wait on sockets
/// and copy responses. One per process: a child forked from a process that used a store (a
/// PyTorch DataLoader worker) starts its own, as the parent's threads do not exist there.
pub(crate) fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: Mutex<Option<(u32, &'static tokio::runtime::Runtime)>> = Mutex::new(None);
    let mut rt = RT.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((owner, r)) = *rt {
        if owner == pid {
            return Ok(r);
        }
    }
    let built = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(crate::config::available_cores().clamp(2, 8))
        .thread_name("shardkit-s3")
        .enable_all()
        .build()
        .map_err(|e| Error::Thread {
            what: "the object-store runtime".into(),
            source: e,
        })?;
    // Kept for the process's life (a parent's, in a forked child, is never touched again).
    let r: &'static tokio::runtime::Runtime = Box::leak(Box::new(built));
    *rt = Some((pid, r));
    Ok(r)
}

pub(crate) fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::Invalid(
            "shardkit's blocking object-store calls cannot run inside an async runtime; call \
             them from a plain thread (tokio::task::spawn_blocking)"
                .into(),
        ));
    }
    Ok(runtime()?.block_on(f))
}

/// Runs `f` on the runtime until it completes, or until `stopped()` turns true (checked every
/// [`STOP_POLL`]): `None` then, and `f` is dropped unfinished (a read's requests not yet
/// sent are never sent, those in flight are cut, and its request slots go to other reads).
pub(crate) fn block_on_until<F: std::future::Future>(
    f: F,
    stopped: impl Fn() -> bool,
) -> Result<Option<F::Output>> {
    block_on(async {
        let mut f = std::pin::pin!(f);
        loop {
            match tokio::time::timeout(STOP_POLL, f.as_mut()).await {
                Ok(out) => return Some(out),
                Err(_) if stopped() => return None,
                Err(_) => {}
            }
        }
    })
}

/// Blocks on a read `f`, giving up once `stop` is set.
pub(crate) fn block_on_stopped<F: std::future::Future<Output = Result<()>>>(
    f: F,
    stop: &Stop,
) -> Result<()> {
    block_on_until(f, || stop.is_set())?.unwrap_or_else(|| Err(stopped_error()))
}

/// A read running on the object-store runtime (see [`Remote::start_read`]). Dropped before
/// [`PendingRead::wait`] (a loader dropped mid-epoch), it stops: requests not yet sent are never
/// sent, and its slots of the request limit go to other reads at once.
pub struct PendingRead(
    pub(crate) Mutex<Option<tokio::task::JoinHandle<Result<crate::io::buffer::Buffer>>>>,
);

impl PendingRead {
    /// The buffer, once every range is in (or the read's error). Gives up, stopping the read,
    /// when `stopped()` turns true (checked every [`STOP_POLL`]): a loader dropped while it
    /// waits for a window goes at once, not when the window is in.
    pub fn wait(&self, stopped: impl Fn() -> bool) -> Result<crate::io::buffer::Buffer> {
        let mut task = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| Error::Internal("internal: a read waited for twice".into()))?;
        let joined = block_on_until(&mut task, stopped)?;
        match joined {
            Some(Ok(read)) => read,
            Some(Err(e)) => Err(Error::Internal(format!(
                "an object-store read stopped: {e}"
            ))),
            None => {
                task.abort();
                Err(stopped_error())
            }
        }
    }
}

impl Drop for PendingRead {
    fn drop(&mut self) {
        let task = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            // Its futures are dropped at their next await: pages already fetched are still
            // kept (on their own blocking tasks), and the buffer goes back to its pool.
            task.abort();
        }
    }
}
