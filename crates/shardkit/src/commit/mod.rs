//! Committing a write: one piece every writer calls.
//!
//! A writer holds one lock for its life ([`lock`] in a local directory, [`store_lock`] in an
//! object store), writes its files in a local directory (the dataset itself, or its staging
//! directory for a store: [`staged`]), hands each finished data file over (checksummed, and
//! for a store uploaded in the background under an upload journal), and commits last: the
//! checksum sidecar, then the format's commit record. [`transfer`] copies whole datasets
//! between a directory and a store, the commit records last.
//!
//! A writer opens its destination as a [`Target`] (a local directory, or a store prefix); for a
//! store, [`StoreWrite`] takes the lock, reads what an interrupted write left there, and starts
//! the stream once the writer has said which of those files it keeps. The writer then hands each
//! finished file to its [`Files`] (checksummed; uploaded in the background when streaming), and
//! ends with [`Files::finish`] once its sidecar and commit record are staged: for a store, the
//! rest is uploaded with the commit record last.

pub(crate) mod lock;
pub mod notes;
pub(crate) mod parts;
pub(crate) mod parts_read;
pub(crate) mod parts_store;
pub mod provenance;
pub(crate) mod staged;
pub(crate) mod store_lock;
pub(crate) mod transfer;

use std::path::{Path, PathBuf};

use crate::checksum::{FileSums, Journal, Recorder};
use crate::error::Result;
use crate::io::{self, Remote};
use store_lock::StoreLock;

pub(crate) use lock::WriteLock;
pub(crate) use staged::staging_dir;
pub(crate) use staged::Streaming;
// Used by the flat-tokens writer only (behind the `zarr` feature).
#[cfg(feature = "zarr")]
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
        Ok(match io::Location::parse(path)? {
            io::Location::Local(dir) => Target::Local(dir),
            store => Target::Store(Remote::from_location(&store)?),
        })
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
        // Lock first, then look: a rank claims, then looks for this lock (see parts_store).
        parts_store::refuse_whole_writer(&target)?;
        let found = Streaming::left_in(&target)?;
        Ok(StoreWrite {
            target,
            lock,
            found,
        })
    }

    /// [`StoreWrite::begin`] for the commit of a write in parts: `lock` (its commit lock on the
    /// parts state) is held instead of the dataset's. The ranks' claims and unit records keep
    /// whole-dataset writers out meanwhile, and the dataset's lock would turn away ranks
    /// restarting during the commit.
    #[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' only
    pub(crate) fn begin_held(target: Remote, lock: StoreLock) -> Result<StoreWrite> {
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

/// A writer's finished files on their way into the dataset: each checksummed as it is
/// published (while still in the page cache) and, writing to a store, uploaded in the
/// background ([`Streaming`]). Locally, sending a file only records its checksums.
#[derive(Debug, Default)]
pub(crate) struct Files {
    sums: Recorder,
    upload: Option<Streaming>,
}

impl Files {
    /// Files of a write that keeps those `kept` names (in a store already, with their
    /// checksums), nothing streamed yet.
    pub(crate) fn keeping(kept: &Journal) -> Files {
        let mut sums = Recorder::default();
        for (name, s) in &kept.files.files {
            sums.insert(name, s.clone());
        }
        Files { sums, upload: None }
    }

    /// Streams the files sent from now on through `streaming`.
    pub(crate) fn stream(&mut self, streaming: Streaming) {
        self.upload = Some(streaming);
    }

    /// The stream to the store, when writing to one.
    pub(crate) fn streaming(&mut self) -> Option<&mut Streaming> {
        self.upload.as_mut()
    }

    /// Where the dataset written in `dir` ends up: the store's URL when streaming.
    pub(crate) fn destination(&self, dir: &Path) -> PathBuf {
        match &self.upload {
            Some(up) => PathBuf::from(up.target.url()),
            None => dir.to_path_buf(),
        }
    }

    /// The stream to the store taken out (for a writer that sends more than the file itself
    /// with it); [`Files::stream`] puts it back.
    pub(crate) fn take_streaming(&mut self) -> Option<Streaming> {
        self.upload.take()
    }

    /// Records the checksums of `dir/name`, just published; returns them.
    pub(crate) fn record(&mut self, dir: &Path, name: &str) -> Result<FileSums> {
        self.sums.add(dir, name)
    }

    /// Records `name`'s checksums from its bytes (a file about to be written).
    pub(crate) fn record_bytes(&mut self, name: &str, bytes: &[u8]) {
        self.sums.add_bytes(name, bytes);
    }

    /// Records the checksums known of `name` (kept from an interrupted write).
    pub(crate) fn insert(&mut self, name: &str, sums: FileSums) {
        self.sums.insert(name, sums);
    }

    /// Records `dir/name`, just published, and queues it for upload when streaming.
    pub(crate) fn send(&mut self, dir: &Path, name: &str) -> Result<()> {
        let sums = self.sums.add(dir, name)?;
        match &mut self.upload {
            Some(up) => up.send(dir, name, sums),
            None => Ok(()),
        }
    }

    /// Writes the sidecar of the dataset in `dir`: every file recorded, the rest hashed now.
    pub(crate) fn write_sidecar(&self, dir: &Path) -> Result<PathBuf> {
        self.sums.finish(dir)
    }

    /// Ends the write of the dataset in `dir`, whose sidecar and commit record are in place.
    /// Locally that is all; streaming, the queued uploads are waited for, what is left in `dir`
    /// uploaded (the commit record last), the private objects `leftovers` deleted, and the
    /// journal and the staging directory removed. Returns where the dataset is.
    pub(crate) fn finish(self, dir: &Path, leftovers: &[String]) -> Result<PathBuf> {
        match self.upload {
            Some(streaming) => streaming.finish(dir, leftovers),
            None => Ok(dir.to_path_buf()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{Checksums, SIDECAR};

    #[test]
    fn a_destination_is_a_store_only_for_an_s3_url() {
        let t = Target::parse(Path::new("s3://bucket/prefix/ds")).unwrap();
        assert!(matches!(t, Target::Store(r) if r.url() == "s3://bucket/prefix/ds"));
        for (given, local) in [("file:///data/ds", "/data/ds"), ("data/ds", "data/ds")] {
            let t = Target::parse(Path::new(given)).unwrap();
            assert!(
                matches!(t, Target::Local(p) if p == Path::new(local)),
                "{given}"
            );
        }
    }

    #[test]
    fn local_files_are_recorded_and_the_sidecar_covers_them_and_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        std::fs::write(dir.join("a.bin"), b"first").unwrap();
        std::fs::write(dir.join("b.bin"), b"second").unwrap();
        let kept = FileSums::of_bytes(b"in the store");
        let mut journal = Journal::default();
        journal.files.files.insert("k.bin".into(), kept.clone());
        let mut files = Files::keeping(&journal);
        files.send(dir, "a.bin").unwrap();
        files.record_bytes("c.json", b"{}");
        std::fs::write(dir.join("c.json"), b"{}").unwrap();
        assert_eq!(files.destination(dir), dir);
        let sidecar = files.write_sidecar(dir).unwrap();
        assert_eq!(sidecar, dir.join(SIDECAR));
        let sums = Checksums::read(&sidecar).unwrap().unwrap();
        let names: Vec<&str> = sums.files.keys().map(String::as_str).collect();
        // Sent, recorded from bytes, hashed at the end (b.bin), and kept from the store.
        assert_eq!(names, ["a.bin", "b.bin", "c.json", "k.bin"]);
        assert_eq!(sums.files["k.bin"], kept);
        assert_eq!(sums.files["b.bin"], FileSums::of_bytes(b"second"));
        // Locally, finishing is only saying where the dataset is.
        assert_eq!(files.finish(dir, &[]).unwrap(), dir);
    }
}
