//! The bounded local cache as a wrapper around a store's source: reads are served from the
//! pages held in the cache, and the pages they miss are fetched from the store, copied into
//! the read and kept (see the `cache` module).

use std::path::PathBuf;
use std::sync::Arc;

use super::super::buffer::Buffer;
use super::super::local::ReadRange;
use super::super::location::Location;
use super::super::runtime::{block_on_stopped, PendingRead};
use super::super::source::Source;
use super::super::stop::Stop;
use super::super::Remote;
use super::HeldPages;
use crate::error::Result;

/// A store's objects read through the cache in `dir`.
#[derive(Debug, Clone)]
pub(crate) struct Cached {
    inner: Remote,
    dir: PathBuf,
}

impl Cached {
    /// `inner` read through the cache at `dir`.
    pub(crate) fn new(inner: Remote, dir: PathBuf) -> Cached {
        Cached { inner, dir }
    }
}

impl Source for Cached {
    fn location(&self) -> Location {
        self.inner.location()
    }

    fn path_of(&self, name: &str) -> PathBuf {
        self.inner.path_of(name)
    }

    fn list(&self) -> Result<Vec<(String, u64)>> {
        Source::list(&self.inner)
    }

    fn len(&self, name: &str) -> Result<u64> {
        Source::len(&self.inner, name)
    }

    fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>> {
        Source::get_opt(&self.inner, name)
    }

    fn read_into(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()> {
        let remote = &self.inner;
        remote.check_reads(names.len(), ranges, buf.len())?;
        let paged = remote.read_cached(&self.dir, names, ranges, buf)?;
        if paged.is_done() {
            return Ok(());
        }
        let store = remote.store()?;
        let flag = stop.flag();
        let fetch = remote.fetch_paged(&store, names, paged, buf, flag.as_deref());
        block_on_stopped(fetch, stop)
    }

    fn start_read(
        &self,
        names: Arc<Vec<String>>,
        ranges: Vec<ReadRange>,
        mut buf: Buffer,
        stop: &Stop,
    ) -> Result<PendingRead> {
        let remote = &self.inner;
        remote.check_reads(names.len(), &ranges, buf.len())?;
        // Pages already in the cache are read here, before returning; the rest in the task.
        let paged = remote.read_cached(&self.dir, &names, &ranges, buf.as_mut_bytes())?;
        remote.start_paged(names, paged, buf, stop.flag())
    }

    fn held_pages(&self, names: &[String], ranges: &[ReadRange]) -> Result<Option<HeldPages>> {
        self.inner.held_pages(&self.dir, names, ranges)
    }
}
