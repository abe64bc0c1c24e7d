//! A flat-tokens write to an object store: the dataset staged locally and streamed by commit
//! (see [`Writer::create`]).

use std::path::{Path, PathBuf};

use super::{Writer, WriterOptions};
use crate::checksum::{FileSums, Journal};
use crate::commit::parts::PARTS_DIR;
use crate::commit::store_lock::StoreLock;
use crate::commit::{self, StoreWrite, Streaming};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::Value;

/// A writer's stream to an object store (see [`Writer::create`]).
pub(super) struct Upload {
    pub(super) streaming: Streaming,
    /// Full chunks of `encoded_tokens` and of `seq_starts` in the store or queued for it.
    sent: [u64; 2],
    /// The checkpoint slot the next commit's trailing chunks go to (the other one holds those
    /// of the checkpoint the journal names).
    slot: u64,
}

/// The journal fact recording a flat-tokens write's last checkpoint: `split`, `seqs` (the
/// commit's `seq_starts` length), `slot`, `documents` (every metadata document of the staged
/// dataset, by path, as text) and `tails` (the trailing chunks, by path, with their
/// checksums; each in the store as `.shardkit-tail-<slot>/<path>`).
const CHECKPOINT: &str = "flat_tokens_checkpoint";

/// Where a checkpoint keeps the trailing chunk `key`: a private name, never a dataset object.
fn tail_object(slot: u64, key: &str) -> String {
    format!(".shardkit-tail-{slot}/{key}")
}

/// The metadata documents of a zarr hierarchy, by base name.
fn is_document(name: &str) -> bool {
    matches!(
        name.rsplit('/').next().unwrap_or(name),
        "zarr.json" | ".zgroup" | ".zattrs" | ".zarray"
    )
}

impl Writer {
    /// [`Writer::create`] for an `s3://` URL (see there).
    pub(super) fn create_remote(
        target: Remote,
        split: &str,
        options: WriterOptions,
        held: Option<StoreLock>,
    ) -> Result<Writer> {
        let store = match held {
            // A write in parts' commit, under its commit lock (see StoreWrite::begin_held).
            Some(lock) => StoreWrite::begin_held(target, lock)?,
            None => {
                let store = StoreWrite::begin(target)?;
                // Looked for under the lock: a rank starting in parts makes its claim, then
                // looks for this lock, so of the two one sees the other.
                let state = store.target().join(PARTS_DIR);
                if !state.list()?.is_empty() {
                    // A split in parts: its commit writes the dataset (a store's holds one split).
                    return Err(Error::Exists {
                        path: state.url().into(),
                        why: "a split is being written in parts here (flat_tokens.PartWriter; \
                              these objects hold its state): continue it with part writers \
                              (any world size), commit it with `shardkit tokens status \
                              --commit`, or write elsewhere"
                            .into(),
                    });
                }
                store
            }
        };
        let (target, url, staged) = (store.target(), store.url(), store.staging());
        let was = store.found();
        let checkpoint = was.fact(CHECKPOINT);
        if let Some(theirs) = checkpoint.and_then(|c| c.get("split")?.as_str()) {
            if theirs != split {
                return Err(Error::Exists {
                    path: url,
                    why: format!(
                        "holds an interrupted write of split {theirs:?}; resume that write or \
                         delete its objects"
                    ),
                });
            }
        }
        if !staged.exists() {
            if *was != Journal::default() {
                if !options.resume {
                    return Err(Error::Exists {
                        path: url,
                        why: format!(
                            "holds an interrupted write ({} chunk file(s) uploaded); resume it \
                             or delete its objects",
                            was.files.files.len()
                        ),
                    });
                }
                if let Some(cp) = checkpoint {
                    rebuild_staging(target, cp, &staged)?;
                }
            } else if target.list()?.iter().any(|(n, _)| !commit::is_private(n)) {
                return Err(Error::Exists {
                    path: url,
                    why: "already holds objects; a flat-tokens dataset is written to an empty \
                          prefix (to add a split: shardkit download, write locally, shardkit \
                          upload)"
                        .into(),
                });
            }
        }
        let mut w = Self::create(&staged, split, options)?;
        // The store's journal from now on: the full chunks below the staged commit that are
        // there, and the checkpoint if the staged commit is not behind it.
        let (tokens_full, _) = w.tokens.chunk_names(0);
        let (starts_full, _) = w.starts.chunk_names(0);
        let mut journal = Journal::default();
        let mut unsent = Vec::new();
        for name in tokens_full.iter().chain(&starts_full) {
            match was.files.files.get(name) {
                Some(sums) => {
                    journal.files.files.insert(name.clone(), sums.clone());
                }
                None => unsent.push(name.clone()),
            }
        }
        let mut slot = 0;
        if let Some(cp) = checkpoint {
            // Its trailing chunks stay where they are until the next checkpoint is written.
            slot = 1 - cp.get("slot").and_then(Value::as_u64).unwrap_or(1).min(1);
            if cp.get("seqs").and_then(Value::as_u64) <= Some(w.starts.len()) {
                journal.set_fact(CHECKPOINT, cp.clone());
            }
        }
        let mut streaming = store.stream(journal)?;
        for name in unsent {
            // Chunks the interrupted run committed but did not upload: staged, or lost.
            let path = w.ds.root.join(&name);
            if fsutil::regular_file_len(&path).is_none() {
                return Err(Error::format(
                    &path,
                    format!(
                        "is committed but neither staged nor in {url} (its upload journal does \
                         not name it); delete the staging directory {} to resume from the \
                         store's checkpoint, or it and the objects to start over",
                        w.ds.root.display(),
                        url = url.display()
                    ),
                ));
            }
            let sums = FileSums::of_file(&path)?;
            streaming.send(&w.ds.root, &name, sums)?;
        }
        w.upload_to = Some(Upload {
            streaming,
            sent: [tokens_full.len() as u64, starts_full.len() as u64],
            slot,
        });
        Ok(w)
    }
}

impl Upload {
    /// Streams the commit `w` just made: queues the chunks it completed, uploads its trailing
    /// chunks to this checkpoint's slot, and (once every chunk sent is in the store) records
    /// the checkpoint in the journal.
    ///
    /// The writer does not wait for this commit's chunks: only, at the next commit, for this
    /// one's checkpoint (whose slot the next one's trailing chunks would overwrite).
    pub(super) fn commit(&mut self, w: &Writer) -> Result<()> {
        let root = &w.ds.root;
        let (tokens_full, tokens_tail) = w.tokens.chunk_names(self.sent[0]);
        let (starts_full, starts_tail) = w.starts.chunk_names(self.sent[1]);
        // A chunk holding only the fill value is not stored (zarr reads it as fill): there is
        // nothing to upload, and a checkpoint without it restores it the same way.
        let stored = |name: &String| fsutil::regular_file_len(&root.join(name)).is_some();
        for name in tokens_full.iter().chain(&starts_full).filter(|n| stored(n)) {
            let sums = FileSums::of_file(&root.join(name))?;
            self.streaming.send(root, name, sums)?;
        }
        self.sent[0] += tokens_full.len() as u64;
        self.sent[1] += starts_full.len() as u64;
        // The journal then names the previous checkpoint, in the other slot, or none.
        self.streaming.wait_checkpoint()?;
        let mut tails = Vec::new();
        for key in tokens_tail.iter().chain(&starts_tail).filter(|n| stored(n)) {
            let path = root.join(key);
            let sums = FileSums::of_file(&path)?;
            self.streaming
                .target
                .put_file(&tail_object(self.slot, key), &path)?;
            tails.push((key.clone(), sums.to_json()));
        }
        let mut documents = Vec::new();
        // The upload threads are removing the staged copies of chunks they have sent.
        for (name, _) in commit::staged_files(root)? {
            if is_document(&name) {
                let path = root.join(&name);
                let text = std::fs::read_to_string(&path).at(&path)?;
                documents.push((name, Value::String(text)));
            }
        }
        let fact = Value::Object(vec![
            ("split".into(), Value::String(w.split.clone())),
            ("seqs".into(), Value::int(w.starts.len())),
            ("slot".into(), Value::int(self.slot)),
            ("documents".into(), Value::Object(documents)),
            ("tails".into(), Value::Object(tails)),
        ]);
        self.streaming.checkpoint(vec![(CHECKPOINT.into(), fact)])?;
        self.slot = 1 - self.slot;
        Ok(())
    }

    /// Uploads what is left of the finished dataset staged in `root` (commit record last),
    /// after deleting the chunk objects of a killed run past where this one ended (`uploaded`:
    /// the chunks in the store); then the checkpoints' trailing chunks and the journal go.
    pub(super) fn finish(
        self,
        root: &Path,
        split: &str,
        uploaded: &std::collections::BTreeMap<String, FileSums>,
    ) -> Result<PathBuf> {
        // A writer whose lock was taken over deletes nothing.
        self.streaming.confirm_lock()?;
        let target = self.streaming.target.clone();
        let staged: std::collections::HashSet<String> = commit::staged_files(root)?
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let arrays = [
            format!("{split}/encoded_tokens/"),
            format!("{split}/seq_starts/"),
        ];
        let mut tails = Vec::new();
        for (name, _) in target.list()? {
            if name.starts_with(".shardkit-tail-") {
                tails.push(name);
            } else if arrays.iter().any(|a| name.starts_with(a.as_str()))
                && !staged.contains(&name)
                && !uploaded.contains_key(&name)
            {
                target.delete(&name)?;
            }
        }
        self.streaming.finish(root, &tails)
    }
}

/// Recreates the staging directory `staged` of an interrupted write from its last checkpoint
/// `cp` in `target` (a write resumed on another machine): its metadata documents, and its
/// trailing chunks, checked against the checksums the checkpoint recorded. It is built beside
/// and renamed into place, so a kill here never leaves a partial staging directory.
fn rebuild_staging(target: &Remote, cp: &Value, staged: &Path) -> Result<()> {
    let journal = target.url_of(Journal::NAME);
    let bad = |rule: String| Error::format(&journal, format!("{CHECKPOINT}: {rule}"));
    let slot = cp
        .get("slot")
        .and_then(Value::as_u64)
        .filter(|s| *s < 2)
        .ok_or_else(|| bad("`slot` must be 0 or 1".into()))?;
    let building = fsutil::temp_sibling(staged);
    match std::fs::remove_dir_all(&building) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&building, e)),
        _ => {}
    }
    let built = build_staging(target, cp, &building, slot).and_then(|()| {
        let parent = fsutil::parent_of(staged);
        std::fs::create_dir_all(parent).at(parent)?;
        fsutil::rename(&building, staged)?;
        fsutil::fsync_dir(parent)
    });
    if built.is_err() {
        let _ = std::fs::remove_dir_all(&building);
    }
    built
}

/// [`rebuild_staging`]'s files, written into `building`.
fn build_staging(target: &Remote, cp: &Value, building: &Path, slot: u64) -> Result<()> {
    let journal = target.url_of(Journal::NAME);
    let bad = |rule: String| Error::format(&journal, format!("{CHECKPOINT}: {rule}"));
    let (Some(Value::Object(documents)), Some(Value::Object(tails))) =
        (cp.get("documents"), cp.get("tails"))
    else {
        return Err(bad("`documents` and `tails` must be objects".into()));
    };
    let below =
        |p: &str| !p.is_empty() && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    let put = |rel: &str, bytes: &[u8]| -> Result<()> {
        let path = building.join(rel);
        let dir = fsutil::parent_of(&path);
        std::fs::create_dir_all(dir).at(dir)?;
        fsutil::atomic_write(&path, bytes)
    };
    for (name, text) in documents {
        match text.as_str() {
            Some(text) if below(name) && is_document(name) => put(name, text.as_bytes())?,
            _ => {
                return Err(bad(format!(
                    "documents[{name:?}] must be a zarr metadata document's text, by its path"
                )))
            }
        }
    }
    for (key, sums) in tails {
        if !below(key) || is_document(key) {
            return Err(bad(format!("tails[{key:?}] is not a chunk's path")));
        }
        let sums = FileSums::from_json(sums, key, &journal)?;
        let object = tail_object(slot, key);
        let bytes = target.get(&object)?;
        if FileSums::of_bytes(&bytes) != sums {
            return Err(Error::format(
                target.url_of(&object),
                "does not match the checksums of the checkpoint that names it; the write cannot \
                 be resumed from the store (delete its objects to start over)",
            ));
        }
        put(key, &bytes)?;
    }
    Ok(())
}
