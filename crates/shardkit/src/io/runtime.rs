//! The tokio runtime every request runs on (one per process, made again after fork), and
//! blocking on it.

use std::sync::{Arc, Mutex};

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

thread_local! {
    /// The stop of the store reads this thread makes beneath an interface that carries none
    /// (zarrs's storage traits); set by [`reads_stopped_by`].
    pub(crate) static READ_STOP: std::cell::RefCell<Option<Arc<std::sync::atomic::AtomicBool>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f`; the reads the zarrs adapter (`io::zarr`) makes for it on this thread give up,
/// with [`stopped_error`], once `stop` is set (a flat-tokens buffer read ahead for an iterator
/// that was closed stops the GETs of the groups it is fetching, through zarrs). With `None`,
/// they keep the stop already in force on this thread, if any. Every other read takes its
/// [`Stop`] as an argument; zarrs's storage interface has no place for one.
pub(crate) fn reads_stopped_by<T>(
    stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    f: impl FnOnce() -> T,
) -> T {
    let Some(stop) = stop else {
        return f();
    };
    struct Restore(Option<Arc<std::sync::atomic::AtomicBool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            READ_STOP.with_borrow_mut(|s| *s = before);
        }
    }
    let _restore = Restore(READ_STOP.with_borrow_mut(|s| s.replace(stop)));
    f()
}

/// Blocks on a read `f` made on this thread, giving up if [`reads_stopped_by`] set a stop
/// that turns true.
#[cfg(test)]
pub(crate) fn block_on_read<F: std::future::Future<Output = Result<()>>>(f: F) -> Result<()> {
    block_on_stopped(f, &thread_stop())
}

/// The stop [`reads_stopped_by`] put in force on this thread, if any.
pub(crate) fn thread_stop() -> Stop {
    READ_STOP
        .with_borrow(|s| s.clone())
        .map_or_else(Stop::never, Stop::new)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_stop_holds_on_its_thread_for_its_call_and_cuts_a_blocked_read() {
        use std::sync::atomic::AtomicBool;
        let current = || READ_STOP.with_borrow(|s| s.as_ref().map(Arc::as_ptr));
        let outer = Arc::new(AtomicBool::new(false));
        let inner = Arc::new(AtomicBool::new(true));
        assert_eq!(current(), None);
        reads_stopped_by(Some(outer.clone()), || {
            assert_eq!(current(), Some(Arc::as_ptr(&outer)));
            // None keeps the stop in force; another replaces it for its call only.
            reads_stopped_by(None, || assert_eq!(current(), Some(Arc::as_ptr(&outer))));
            reads_stopped_by(Some(inner.clone()), || {
                assert_eq!(current(), Some(Arc::as_ptr(&inner)));
                // A read that would never end gives up once its stop is set.
                let e = block_on_read(std::future::pending()).unwrap_err();
                assert_eq!(e.to_string(), stopped_error().to_string());
            });
            assert_eq!(current(), Some(Arc::as_ptr(&outer)));
            // Restored when the call panics too.
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                reads_stopped_by(Some(inner.clone()), || panic!("a read failed"))
            }));
            assert!(unwound.is_err());
            assert_eq!(current(), Some(Arc::as_ptr(&outer)));
            // Not stopped: a read completes.
            assert!(block_on_read(async { Ok(()) }).is_ok());
        });
        assert_eq!(current(), None);
        std::thread::spawn(move || assert_eq!(current(), None))
            .join()
            .unwrap();
    }
}
