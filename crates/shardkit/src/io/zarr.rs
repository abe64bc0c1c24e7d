//! The zarrs storage adapter: a prefix read by zarrs through coalesced ranged reads.
//!
//! zarrs calls the adapter through its own storage interface, which has no place for a stop
//! token. The one caller that needs its reads stopped (a flat-tokens stream: a shuffle buffer
//! read ahead for an iterator that was closed) runs its zarrs calls inside
//! [`zarr_reads_stopped_by`], and the adapter passes that stop to [`Source::read_into`]. This
//! bridge is the library's only stop not passed as an argument, and it lives here, at the edge
//! where an interface without one is crossed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use super::local::ReadRange;
use super::source::Source;
use super::stop::Stop;
use crate::error::Result;

thread_local! {
    /// The stop of the zarrs reads this thread makes ([`zarr_reads_stopped_by`]).
    static ZARR_STOP: RefCell<Stop> = RefCell::new(Stop::never());
}

/// Runs `f`; the reads the adapter makes for zarrs on this thread during it give up once
/// `stop` is set. [`Stop::never`] keeps the stop already in force on this thread, if any; the
/// one before is back in force when `f` returns or unwinds.
pub(crate) fn zarr_reads_stopped_by<T>(stop: &Stop, f: impl FnOnce() -> T) -> T {
    if stop.is_never() {
        return f();
    }
    struct Restore(Stop);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = std::mem::take(&mut self.0);
            ZARR_STOP.with_borrow_mut(|s| *s = before);
        }
    }
    let _restore = Restore(ZARR_STOP.with_borrow_mut(|s| std::mem::replace(s, stop.clone())));
    f()
}

/// The stop [`zarr_reads_stopped_by`] put in force on this thread.
fn zarr_stop() -> Stop {
    ZARR_STOP.with_borrow(Stop::clone)
}

impl dyn Source {
    /// The source as a zarr store for zarrs' readers: every partial read is one coalesced
    /// batch of ranged reads ([`Source::read_into`], stopped by the stop in force on the
    /// reading thread: [`zarr_reads_stopped_by`]), with object sizes taken from one listing
    /// made here (no HEAD request per read).
    pub(crate) fn zarr_store(
        self: Arc<Self>,
    ) -> Result<Arc<dyn zarrs::storage::ReadableStorageTraits>> {
        let sizes = self.list()?.into_iter().collect();
        Ok(Arc::new(ZarrSource {
            source: self,
            sizes,
        }))
    }

    /// The location as a URL or path, in words.
    pub(crate) fn url(&self) -> String {
        self.location().to_string()
    }
}

/// A source read by zarrs (see `zarr_store`). The dataset is complete when it is opened for
/// reading, so the listing made then is the set of its objects.
struct ZarrSource {
    source: Arc<dyn Source>,
    sizes: HashMap<String, u64>,
}

impl zarrs::storage::ReadableStorageTraits for ZarrSource {
    fn get_partial_many<'a>(
        &'a self,
        key: &zarrs::storage::StoreKey,
        byte_ranges: zarrs::storage::byte_range::ByteRangeIterator<'a>,
    ) -> std::result::Result<zarrs::storage::MaybeBytesIterator<'a>, zarrs::storage::StorageError>
    {
        use zarrs::storage::StorageError;
        let name = key.as_str();
        let Some(&size) = self.sizes.get(name) else {
            return Ok(None);
        };
        let mut ranges = Vec::new();
        let mut at = 0u64;
        for r in byte_ranges {
            let range = r.to_range(size);
            if range.start > range.end || range.end > size {
                return Err(StorageError::Other(format!(
                    "{}: bytes {} up to {} asked of a {size}-byte object, past its end",
                    self.source.path_of(name).display(),
                    range.start,
                    range.end
                )));
            }
            let len = range.end - range.start;
            ranges.push(ReadRange {
                file: 0,
                offset: range.start,
                len,
                dst: at,
            });
            at += len;
        }
        let mut buf = vec![0u8; at as usize];
        self.source
            .read_into(&[name.to_string()], &ranges, &mut buf, &zarr_stop())
            .map_err(|e| StorageError::Other(e.to_string()))?;
        let buf = bytes::Bytes::from(buf);
        let parts: Vec<_> = ranges
            .iter()
            .map(|r| Ok(buf.slice(r.dst as usize..(r.dst + r.len) as usize)))
            .collect();
        Ok(Some(Box::new(parts.into_iter())))
    }

    fn size_key(
        &self,
        key: &zarrs::storage::StoreKey,
    ) -> std::result::Result<Option<u64>, zarrs::storage::StorageError> {
        Ok(self.sizes.get(key.as_str()).copied())
    }

    fn supports_get_partial(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::io::runtime::block_on_stopped;
    use crate::io::stop::stopped_error;

    #[test]
    fn a_zarr_read_stop_holds_on_its_thread_for_its_call_and_cuts_a_blocked_read() {
        let current = || ZARR_STOP.with_borrow(|s| format!("{s:?}"));
        let never = format!("{:?}", Stop::never());
        let outer = Stop::new(Arc::new(AtomicBool::new(false)));
        let inner = Stop::new(Arc::new(AtomicBool::new(true)));
        assert_eq!(current(), never);
        zarr_reads_stopped_by(&outer, || {
            assert!(!zarr_stop().is_never() && !zarr_stop().is_set());
            // Never keeps the stop in force; another replaces it for its call only.
            zarr_reads_stopped_by(&Stop::never(), || assert!(!zarr_stop().is_never()));
            zarr_reads_stopped_by(&inner, || {
                assert!(zarr_stop().is_set());
                // A read that would never end gives up once its stop is set.
                let e = block_on_stopped(std::future::pending(), &zarr_stop()).unwrap_err();
                assert_eq!(e.to_string(), stopped_error().to_string());
            });
            assert!(!zarr_stop().is_never() && !zarr_stop().is_set());
            // Restored when the call panics too.
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                zarr_reads_stopped_by(&inner, || panic!("a read failed"))
            }));
            assert!(unwound.is_err());
            assert!(!zarr_stop().is_set());
            // Not stopped: a read completes.
            assert!(block_on_stopped(async { Ok(()) }, &zarr_stop()).is_ok());
        });
        assert_eq!(current(), never);
        std::thread::spawn(move || assert!(zarr_stop().is_never()))
            .join()
            .unwrap();
    }
}
