//! Committing a write: one piece every writer calls.
//!
//! A writer holds one lock for its life ([`lock`] in a local directory, [`store_lock`] in an
//! object store), writes its files in a local directory (the dataset itself, or its staging
//! directory for a store: [`staged`]), hands each finished data file over (checksummed, and
//! for a store uploaded in the background under an upload journal), and commits last: the
//! checksum sidecar, then the format's commit record. [`transfer`] copies whole datasets
//! between a directory and a store, the commit records last.
//!
//! [`Target`] is what a writer opens: it decides local or store, takes the lock, reads what an
//! interrupted write left in the store, and streams; the writer only says which files it keeps
//! and what its commit record is.

pub mod lock;
pub(crate) mod staged;
pub(crate) mod store_lock;
pub(crate) mod transfer;

pub use transfer::{download, upload, Transfer};

use std::path::{Path, PathBuf};

use crate::checksum::Journal;
use crate::error::Result;
use crate::storage::{self, Remote};
use store_lock::StoreLock;

pub(crate) use lock::WriteLock;
pub use staged::staging_dir;
pub(crate) use staged::Streaming;
pub(crate) use transfer::{is_private, staged_files};

/// Where a write goes: a local directory, or a prefix in an object store (written through a
/// local staging directory). The one place a writer's destination is told apart.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// A local directory (`file://` stripped).
    Local(PathBuf),
    /// A prefix in an object store.
    Store(Remote),
}

impl Target {
    /// The destination `path` names: an `s3://` URL is a store, anything else a local path.
    pub(crate) fn parse(path: &Path) -> Result<Target> {
        if storage::is_remote(path) {
            return Ok(Target::Store(Remote::parse(path)?));
        }
        Ok(Target::Local(storage::local_path(path)))
    }
}

/// A write to a store, begun: the writer's lock on the prefix is held, and what an
/// interrupted write left there (its upload journal, keeping only the files present at their
/// size) is read. The writer decides from [`StoreWrite::found`] what it keeps, prepares its
/// staging directory ([`StoreWrite::staging`]), then streams ([`StoreWrite::stream`]).
#[derive(Debug)]
pub(crate) struct StoreWrite {
    target: Remote,
    /// Held from before the journal is read until the write ends.
    lock: StoreLock,
    found: Journal,
}

impl StoreWrite {
    /// Takes the writer's lock on `target`, then reads what an interrupted write left there.
    pub(crate) fn begin(target: Remote) -> Result<StoreWrite> {
        let lock = StoreLock::acquire(&target)?;
        let found = Streaming::left_in(&target)?;
        Ok(StoreWrite {
            target,
            lock,
            found,
        })
    }

    /// The store prefix written.
    pub(crate) fn target(&self) -> &Remote {
        &self.target
    }

    /// The dataset's URL.
    pub(crate) fn url(&self) -> PathBuf {
        PathBuf::from(self.target.url())
    }

    /// The local directory the write is staged in ([`staging_dir`] of its URL).
    pub(crate) fn staging(&self) -> PathBuf {
        staging_dir(&self.url())
    }

    /// What an interrupted write left in the store (an empty journal when none).
    pub(crate) fn found(&self) -> &Journal {
        &self.found
    }

    /// Starts streaming: the store's journal from now on is `journal` (the files the writer
    /// keeps and its facts; written first when it differs from what was found), and each
    /// finished file sent is uploaded in the background.
    pub(crate) fn stream(self, journal: Journal) -> Result<Streaming> {
        Streaming::start(self.target, journal, &self.found, self.lock)
    }
}
