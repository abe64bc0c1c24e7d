//! Crash-safe, resumable writer of saev directories.
//!
//! Order of durable events (saev.md §12): `metadata.json` first; each shard when it is full (the
//! last one at the end), through a temporary sibling that is fsynced and renamed; `labels.bin`
//! (kept as a temporary and fsynced before every shard is published) renamed at the end; and
//! `shards.json` last, as the commit record. A marker file `.shardkit-writing` says the directory
//! is a shardkit write in progress, so resume can trust final-named full-size shards even before
//! shards.json exists. A killed writer therefore leaves a directory that readers refuse as
//! incomplete and that [`Writer::create`] with `resume` continues byte-identically.
//!
//! To an object store: the same steps in a local staging directory, and each shard, once
//! published there, is uploaded in the background and its staged copy removed (so the staging
//! disk holds a few shards, not the dataset). After each upload an upload journal
//! ([`Journal`]) records the shards in the store with their checksums; a resumed write, on this
//! machine or another, keeps the journaled shards. A dataset with labels also sends, before
//! each shard, that shard's labels as a private object (`.shardkit-labels/<shard name>`), so a
//! write resumed on another machine rebuilds labels.bin's kept part from them. `finish`
//! uploads labels.bin, the checksums sidecar and, last, shards.json, then deletes the pieces.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::checksum::{FileSums, Journal};
use crate::commit::{self, Files, StoreWrite, Streaming, Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::{self, Remote};
use crate::json::Value;
use crate::precision::ErrorStats;
use crate::saev::dataset::check_complete;
use crate::saev::layout::{parse_shards_json, shards_json_bytes, Layout};
use crate::saev::rounding;
use crate::saev::validate::shard_index;
use crate::saev::Metadata;

pub(super) const MARKER: &str = ".shardkit-writing";
const LABELS_TMP: &str = ".labels.bin.tmp";
/// Where a write to a store keeps each shard's labels until labels.bin is uploaded.
pub(super) const LABEL_PIECES: &str = ".shardkit-labels";

/// The private object holding the labels of shard `s` (a write to a store with labels).
pub(super) fn label_piece(s: u64) -> String {
    format!("{LABEL_PIECES}/{}", Layout::shard_name(s))
}

/// The shard whose labels the private object `name` holds.
fn label_piece_index(name: &str) -> Option<u64> {
    shard_index(name.strip_prefix(LABEL_PIECES)?.strip_prefix('/')?)
}

/// What [`Writer::create`] found at the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStart {
    /// A new directory; writing starts at example 0.
    Fresh,
    /// An interrupted write of the same dataset; writing continues at `from`.
    Resumed {
        /// The first example still to be written.
        from: u64,
    },
    /// The same dataset is already complete; writes are accepted and discarded.
    AlreadyComplete,
}

/// Options of [`Writer::create`].
#[derive(Debug, Clone, Copy, Default)]
pub struct WriterOptions {
    /// Continue an interrupted write of the same dataset instead of refusing it.
    pub resume: bool,
    /// For a reduced-precision dataset: refuse a write holding a row whose relative L2
    /// rounding error exceeds this (or that overflows), naming the shard and the row. Nothing
    /// of a refused write is stored.
    pub max_rel_error: Option<f64>,
}

impl WriterOptions {
    /// The defaults, resuming an interrupted write ([`WriterOptions::resume`]).
    pub fn resuming() -> WriterOptions {
        WriterOptions {
            resume: true,
            ..WriterOptions::default()
        }
    }
}

struct OpenShard {
    index: u64,
    file: File,
    tmp: PathBuf,
    rows: u64,
    /// The rounding error of its rows so far (reduced-precision datasets).
    errors: ErrorStats,
}

/// Streams examples, in global order, into `root/<name>/`.
pub struct Writer {
    dir: PathBuf,
    md: Metadata,
    layout: Layout,
    start: WriteStart,
    next: u64,
    shard: Option<OpenShard>,
    /// `Some` once the dataset is known to carry labels (temporary labels file open).
    labels: Option<File>,
    labels_decided: bool,
    finished: bool,
    /// Held for the writer's life: a second writer of this directory fails at once. Held, not
    /// read (only the tests' `abandon` takes it out early).
    #[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
    lock: Option<WriteLock>,
    /// The shards published so far, checksummed (see [`crate::checksum`]) and, writing to an
    /// object store (staged in `dir`), streamed there as they are published.
    files: Files,
    /// Refuse rows rounded worse than this ([`WriterOptions::max_rel_error`]).
    max_rel_error: Option<f64>,
}

/// The journal fact saying whether the dataset has labels.
const LABELS: &str = "labels";

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("dir", &self.dir)
            .field("start", &self.start)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl Writer {
    /// Opens `root/<dir_name(md)>` for writing.
    ///
    /// * absent or empty: a fresh write;
    /// * the same metadata, complete: [`WriteStart::AlreadyComplete`] (nothing is touched);
    /// * the same metadata, incomplete: refused unless `opts.resume`, then resumed from the
    ///   first missing shard (everything after it is removed first);
    /// * anything else (different metadata.json bytes, foreign files): refused, never overwritten.
    ///
    /// `root` may be an `s3://bucket/prefix` URL: the dataset is then staged in a local
    /// directory ([`crate::commit::staging_dir`]), each shard uploaded as soon as it is complete and
    /// its staged copy removed, and the rest uploaded by [`Writer::finish`], shards.json last.
    /// The same rules apply to what the store holds: an interrupted write (shards named in its
    /// upload journal) is refused unless `opts.resume`, then continued from the first shard in
    /// neither the store nor the staging directory, so a killed job resumes on another machine
    /// too, labels included (each shard's labels are in the store beside it, checked against
    /// their checksums when fetched back). A prefix already holding the complete dataset is
    /// [`WriteStart::AlreadyComplete`]; one holding a different dataset is refused.
    pub fn create(root: impl AsRef<Path>, md: Metadata, opts: WriterOptions) -> Result<Writer> {
        match Target::parse(root.as_ref())? {
            Target::Store(root) => Self::create_remote(root, md, opts),
            Target::Local(root) => Self::create_local(&root, md, opts, &Journal::default(), None),
        }
    }

    /// [`Writer::create`] in a local directory; `uploaded` is what an interrupted write to the
    /// store `target` left there (`dir` is then its staging directory).
    fn create_local(
        root: &Path,
        md: Metadata,
        opts: WriterOptions,
        uploaded: &Journal,
        target: Option<&Remote>,
    ) -> Result<Writer> {
        let root = &io::local_path(root);
        let layout = Layout::new(&md, Path::new("metadata.json"))?;
        let dir = root.join(md.dir_name());
        let ours = md.file_bytes();
        fs::create_dir_all(root).at(root)?;
        match fs::create_dir(&dir) {
            Ok(()) => fsutil::fsync_dir(root)?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(&dir, e)),
        }
        let lock = WriteLock::dir(&dir)?;

        let mut w = Writer {
            dir: dir.clone(),
            md,
            layout,
            start: WriteStart::Fresh,
            next: 0,
            shard: None,
            labels: None,
            labels_decided: false,
            finished: false,
            lock: Some(lock),
            files: Files::default(),
            max_rel_error: opts.max_rel_error,
        };
        let md_path = dir.join("metadata.json");
        match fsutil::read_json_file(&md_path) {
            Ok(existing) if existing == ours => {
                // Staged whole, with its shards in the store: killed while finish() uploaded.
                let complete = check_complete(&dir, &w.layout).or_else(|e| {
                    if staged_whole(&dir, &w.layout, uploaded) {
                        Ok(())
                    } else {
                        Err(e)
                    }
                });
                match complete {
                    Ok(()) => {
                        w.start = WriteStart::AlreadyComplete;
                        w.next = w.layout.n_examples;
                        w.finished = true;
                        // A crash between shards.json and the marker's removal leaves it behind.
                        let _ = fs::remove_file(dir.join(MARKER));
                        return Ok(w);
                    }
                    Err(Error::Incomplete { present, total, .. }) if !opts.resume => {
                        return Err(Error::Exists {
                            path: dir,
                            why: format!(
                                "holds an interrupted write of this dataset ({present} of {total} \
                                 examples present); resume it or delete the directory"
                            ),
                        })
                    }
                    Err(Error::Incomplete { .. }) => w.prepare_resume(uploaded, target)?,
                    Err(e) => {
                        return Err(Error::Exists {
                            path: dir,
                            why: format!(
                                "holds this dataset's metadata.json but its shards are \
                                 inconsistent ({e}); refusing to overwrite it"
                            ),
                        })
                    }
                }
            }
            Ok(_) => {
                return Err(Error::Exists {
                    path: md_path,
                    why: "holds a different dataset (metadata.json differs from the one being \
                          written); refusing to overwrite it"
                        .into(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if dir.exists() {
                    let foreign: Vec<String> = list_dir(&dir)?
                        .into_iter()
                        .filter(|n| n != MARKER && !fsutil::is_temp_name(n))
                        .collect();
                    if !foreign.is_empty() {
                        return Err(Error::Exists {
                            path: dir,
                            why: format!(
                                "exists without metadata.json but holds {} other file(s) ({}); \
                                 refusing to write into it",
                                foreign.len(),
                                foreign.join(", ")
                            ),
                        });
                    }
                    for n in list_dir(&dir)? {
                        let p = dir.join(n);
                        fs::remove_file(&p).at(&p)?;
                    }
                }
                File::create(dir.join(MARKER)).at(dir.join(MARKER))?;
                fsutil::atomic_write(&md_path, &ours)?;
                if !uploaded.files.files.is_empty() {
                    w.prepare_resume(uploaded, target)?;
                }
            }
            Err(e) => return Err(Error::io(&md_path, e)),
        }
        Ok(w)
    }

    /// Finds the resume point and removes everything written after it. `uploaded` is what
    /// the store `target` holds of an interrupted write to it.
    fn prepare_resume(&mut self, uploaded: &Journal, target: Option<&Remote>) -> Result<()> {
        let dir = self.dir.clone();
        let full = |s: u64| {
            let name = Layout::shard_name(s);
            uploaded.files.files.contains_key(&name)
                || fsutil::regular_file_len(&dir.join(&name)) == Some(self.layout.shard_bytes())
        };
        let eps = self.layout.examples_per_shard;
        let k = if dir.join(MARKER).exists() {
            // shardkit publishes a shard under its final name only once it is complete.
            (0..self.layout.n_shards).take_while(|&s| full(s)).count() as u64
        } else {
            // saev rewrites shards.json after each full shard; trust only entries holding eps.
            let sj = dir.join("shards.json");
            match fsutil::read_json_file(&sj) {
                Ok(b) => parse_shards_json(&b, &sj)
                    .map(|entries| {
                        entries
                            .iter()
                            .enumerate()
                            .take_while(|(i, e)| {
                                e.name == Layout::shard_name(*i as u64)
                                    && e.count == eps
                                    && full(*i as u64)
                            })
                            .count() as u64
                    })
                    .unwrap_or(0),
                Err(_) => 0,
            }
            .min(self.layout.n_shards)
        };
        let mut from = (k * eps).min(self.layout.n_examples);

        // Labels: keep those of the kept shards, from our temporary or from a full-size labels.bin.
        let labels_len = self.layout.n_examples * self.layout.content_tokens;
        let tmp_labels = dir.join(LABELS_TMP);
        let final_labels = dir.join("labels.bin");
        if fsutil::regular_file_len(&final_labels) == Some(labels_len)
            && fsutil::regular_file_len(&tmp_labels).is_none()
        {
            fsutil::rename(&final_labels, &tmp_labels)?;
        }
        if let Some(target) = target.filter(|_| {
            from > 0
                && fsutil::regular_file_len(&tmp_labels) != Some(labels_len)
                && uploaded.fact(LABELS) == Some(&Value::Bool(true))
        }) {
            // Resumed without the staged labels (another machine): those of the shards kept
            // come back from their pieces in the store, as far as the pieces go.
            let pieces = (0..k)
                .take_while(|&s| uploaded.files.files.contains_key(&label_piece(s)))
                .count() as u64;
            from = (pieces * eps).min(self.layout.n_examples);
            if pieces > 0 {
                self.fetch_labels(target, uploaded, pieces, &tmp_labels)?;
            }
        }
        if from > 0 && fsutil::regular_file_len(&tmp_labels) == Some(labels_len) {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&tmp_labels)
                .at(&tmp_labels)?;
            self.labels = Some(f);
            self.labels_decided = true;
        } else if from > 0
            && (fsutil::regular_file_len(&tmp_labels).is_some()
                || uploaded.fact(LABELS) == Some(&Value::Bool(true)))
        {
            // Labels of the kept shards are not recoverable (a write by a version of shardkit
            // that kept them only in the staging directory): start over.
            from = 0;
        } else if from > 0 {
            self.labels_decided = true; // kept shards were written without labels
        }
        // Every shard holding examples below `from` is complete, the last partial one included.
        let keep_shards = from.div_ceil(eps);
        for (name, sums) in &uploaded.files.files {
            if shard_index(name)
                .or_else(|| rounding::sidecar_index(name))
                .is_some_and(|i| i < keep_shards)
            {
                self.files.insert(name, sums.clone());
            }
        }

        for name in list_dir(&dir)? {
            let remove = match name.as_str() {
                "metadata.json" => false,
                MARKER => false,
                // Pieces staged and not sent are made again from the labels, before sending.
                LABEL_PIECES => {
                    let p = dir.join(LABEL_PIECES);
                    fs::remove_dir_all(&p).at(&p)?;
                    false
                }
                LABELS_TMP => !self.labels_decided || self.labels.is_none(),
                "shards.json" | "labels.bin" => true,
                n if fsutil::is_temp_name(n) => true,
                n => shard_index(n)
                    .or_else(|| rounding::sidecar_index(n))
                    .is_some_and(|i| i >= keep_shards),
            };
            if remove {
                let p = dir.join(&name);
                fs::remove_file(&p).at(&p)?;
            }
        }
        File::create(dir.join(MARKER)).at(dir.join(MARKER))?;
        fsutil::fsync_dir(&dir)?;
        self.next = from;
        self.start = WriteStart::Resumed { from };
        Ok(())
    }

    /// Rebuilds the temporary labels file `tmp` from the pieces of shards `0..pieces` in
    /// `target`, each checked against the checksums `uploaded` records for it. Built beside
    /// and renamed into place: a full-size `tmp` is trusted by the next resume.
    fn fetch_labels(
        &self,
        target: &Remote,
        uploaded: &Journal,
        pieces: u64,
        tmp: &Path,
    ) -> Result<()> {
        let building = fsutil::temp_sibling(tmp);
        let p = self.layout.content_tokens;
        let write = |f: &File| -> Result<()> {
            for s in 0..pieces {
                let name = label_piece(s);
                let bytes = target.get(&name)?;
                let expected = self.layout.shard_count(s) * p;
                if uploaded.files.files.get(&name) != Some(&FileSums::of_bytes(&bytes))
                    || bytes.len() as u64 != expected
                {
                    return Err(Error::format(
                        target.url_of(&name),
                        format!(
                            "does not match the checksums the upload journal records for it \
                             (the labels of shard {s}, {expected} bytes); the write cannot be \
                             resumed from the store (delete its objects to start over)"
                        ),
                    ));
                }
                f.write_all_at(&bytes, s * self.layout.examples_per_shard * p)
                    .at(&building)?;
            }
            fsutil::sync_file(f, &building)
        };
        let built = fsutil::create_sized(&building, self.layout.n_examples * p)
            .and_then(|f| write(&f))
            .and_then(|()| fsutil::rename(&building, tmp));
        if built.is_err() {
            let _ = fs::remove_file(&building);
        }
        built
    }

    fn create_remote(root: Remote, md: Metadata, opts: WriterOptions) -> Result<Writer> {
        let target = root.join(&md.dir_name());
        let url = PathBuf::from(target.url());
        let theirs = target.get_opt("metadata.json")?;
        if let Some(theirs) = &theirs {
            if *theirs != md.file_bytes() {
                return Err(Error::Exists {
                    path: target.url_of("metadata.json"),
                    why: "holds a different dataset (metadata.json differs from the one being \
                          written); refusing to overwrite it"
                        .into(),
                });
            }
            // Complete if it opens; anything else is finished by uploading again.
            if target.get_opt("shards.json")?.is_some() && crate::saev::Dataset::open(&url).is_ok()
            {
                let staged = commit::staging_dir(&url).join(md.dir_name());
                // Left by a write killed after its commit: nothing needs them, and readers
                // ignore them, so a failure here loses nothing.
                let _ = delete_label_pieces(&target);
                Streaming::clear_leftovers(&target, &staged);
                let layout = Layout::new(&md, Path::new("metadata.json"))?;
                return Ok(Writer {
                    dir: url,
                    start: WriteStart::AlreadyComplete,
                    next: layout.n_examples,
                    md,
                    layout,
                    shard: None,
                    labels: None,
                    labels_decided: true,
                    finished: true,
                    lock: None,
                    files: Files::default(),
                    max_rel_error: opts.max_rel_error,
                });
            }
        }
        let store = StoreWrite::begin(target)?;
        let uploaded = store.found();
        if !uploaded.files.files.is_empty() && !opts.resume {
            return Err(Error::Exists {
                path: url,
                why: format!(
                    "holds an interrupted write of this dataset ({} shard(s) uploaded); resume \
                     it or delete its objects",
                    uploaded.files.files.len()
                ),
            });
        }
        let mut w = Self::create_local(&store.staging(), md, opts, uploaded, Some(store.target()))?;
        // The store's journal from now on: the shards kept (and their labels), and whether
        // there are labels.
        let mut journal = Journal::default();
        if w.labels_decided {
            journal.set_fact(LABELS, Value::Bool(w.labels.is_some()));
        }
        let kept = w.next.div_ceil(w.layout.examples_per_shard);
        for (name, sums) in &uploaded.files.files {
            let shard = shard_index(name).or_else(|| label_piece_index(name));
            if shard.is_some_and(|i| i < kept) {
                journal.files.files.insert(name.clone(), sums.clone());
            }
        }
        if theirs.is_none() {
            // Claims the prefix for this dataset before any shard goes there.
            store.target().put("metadata.json", w.md.file_bytes())?;
        }
        let mut streaming = store.stream(journal)?;
        if w.start != WriteStart::AlreadyComplete {
            // Shards the interrupted run staged but did not upload go first.
            for s in 0..kept {
                let name = Layout::shard_name(s);
                if w.labels.is_some() && !streaming.has_sent(&label_piece(s)) {
                    w.send_labels(&mut streaming, s)?;
                }
                if !streaming.has_sent(&name) {
                    let sums = w.files.record(&w.dir, &name)?;
                    w.send(&mut streaming, &name, sums)?;
                }
            }
        }
        w.files.stream(streaming);
        Ok(w)
    }

    /// Queues the published shard `name` (whose checksums are `sums`) for upload.
    fn send(&self, up: &mut Streaming, name: &str, sums: FileSums) -> Result<()> {
        up.set_fact(LABELS, Value::Bool(self.labels.is_some()));
        up.send(&self.dir, name, sums)
    }

    /// Stages the labels of shard `s` (durable in the temporary labels file already) as their
    /// piece and queues it for upload, ahead of the shard: a journal naming a shard then
    /// names its labels too, unless a kill fell between the two uploads.
    fn send_labels(&self, up: &mut Streaming, s: u64) -> Result<()> {
        let Some(f) = &self.labels else {
            return Ok(());
        };
        let p = self.layout.content_tokens;
        let mut bytes = vec![0u8; (self.layout.shard_count(s) * p) as usize];
        let tmp = self.dir.join(LABELS_TMP);
        f.read_exact_at(&mut bytes, s * self.layout.examples_per_shard * p)
            .at(&tmp)?;
        let name = label_piece(s);
        let path = self.dir.join(&name);
        let dir = fsutil::parent_of(&path);
        fs::create_dir_all(dir).at(dir)?;
        // Not fsynced: a piece lost in a crash was not journaled, and is made again.
        fs::write(&path, &bytes).at(&path)?;
        up.send(&self.dir, &name, FileSums::of_bytes(&bytes))
    }

    /// Where the finished dataset will be: the dataset directory `root/<name>`, or its
    /// `s3://` URL when writing to an object store (staged in a local directory meanwhile).
    pub fn path(&self) -> PathBuf {
        self.files.destination(&self.dir)
    }
    /// What was found at the destination.
    pub fn start(&self) -> WriteStart {
        self.start
    }
    /// The first example still to be written (`n_examples` when done or already complete).
    pub fn next_example(&self) -> u64 {
        self.next
    }

    /// Writes the next `b` examples: `acts` holds `b·L·T·D` float32 values, C order
    /// `(b, L, T, D)`, rounded to the dataset's dtype when it is a reduced one; `labels`, when
    /// the dataset has labels, `b·P` bytes `(b, P)`. The first call decides whether the dataset
    /// has labels; later calls must agree. On an already-complete dataset the data are
    /// discarded. A write refused (bad sizes, `max_rel_error`) stores nothing.
    pub fn write(&mut self, acts: &[f32], labels: Option<&[u8]>) -> Result<()> {
        let b = examples_in(&self.layout, acts, labels)?;
        let p = self.layout.content_tokens;
        if self.start == WriteStart::AlreadyComplete {
            return Ok(());
        }
        if self.finished {
            return Err(Error::Invalid("the writer is already finished".into()));
        }
        if self.next + b > self.layout.n_examples {
            return Err(Error::Invalid(format!(
                "{b} more examples would exceed n_examples = {} ({} already written)",
                self.layout.n_examples, self.next
            )));
        }
        if b == 0 {
            return Ok(()); // an empty batch decides nothing
        }
        let first = self.next;
        let stored =
            rounding::store_examples(&self.md, &self.layout, acts, self.max_rel_error, |k| {
                first + k
            })?;
        let bytes = &stored.bytes[..];
        self.decide_labels(labels.is_some())?;
        if let (Some(f), Some(l)) = (&self.labels, labels) {
            let tmp = self.dir.join(LABELS_TMP);
            f.write_all_at(l, self.next * p).at(&tmp)?;
        }
        let eb = self.layout.example_bytes() as usize;
        let eps = self.layout.examples_per_shard;
        let mut done = 0u64;
        while done < b {
            let shard = self.open_shard()?;
            let n = (eps - shard.rows).min(b - done);
            let chunk = &bytes[done as usize * eb..(done + n) as usize * eb];
            shard.file.write_all(chunk).at(&shard.tmp)?;
            fsutil::start_writeback(&shard.file, shard.rows * eb as u64, chunk.len() as u64);
            shard.errors.merge(&stored.errors_of(done..done + n));
            shard.rows += n;
            let shard_full = shard.rows == eps;
            done += n;
            self.next += n;
            if shard_full || self.next == self.layout.n_examples {
                self.publish_shard()?;
            }
        }
        Ok(())
    }

    fn decide_labels(&mut self, has: bool) -> Result<()> {
        if has && self.md.major() == 1 {
            return Err(Error::Invalid(
                "protocol 1.0.0 has no labels.bin (labels arrived with 1.1); write protocol 2.0 \
                 or 2.1 to store labels"
                    .into(),
            ));
        }
        if !self.labels_decided {
            self.labels_decided = true;
            if has {
                let tmp = self.dir.join(LABELS_TMP);
                let len = self.layout.n_examples * self.layout.content_tokens;
                self.labels = Some(fsutil::create_sized(&tmp, len)?);
            }
            return Ok(());
        }
        match (self.labels.is_some(), has) {
            (true, false) => Err(Error::Invalid(
                "this dataset has labels: every batch must come with labels".into(),
            )),
            (false, true) => Err(Error::Invalid(
                "this dataset was started without labels: labels cannot be added later".into(),
            )),
            _ => Ok(()),
        }
    }

    fn open_shard(&mut self) -> Result<&mut OpenShard> {
        let index = self.next / self.layout.examples_per_shard;
        if self.shard.is_none() {
            let tmp = fsutil::temp_sibling(&self.dir.join(Layout::shard_name(index)));
            let file = fsutil::create_sized(&tmp, self.layout.shard_bytes())?;
            self.shard = Some(OpenShard {
                index,
                file,
                tmp,
                rows: 0,
                errors: ErrorStats::default(),
            });
        }
        Ok(self.shard.as_mut().expect("opened above"))
    }

    fn publish_shard(&mut self) -> Result<()> {
        let Some(shard) = self.shard.take() else {
            return Ok(());
        };
        fsutil::sync_data(&shard.file, &shard.tmp)?;
        drop(shard.file);
        if let Some(l) = &self.labels {
            // The labels of a published shard must be durable before it is.
            fsutil::sync_data(l, &self.dir.join(LABELS_TMP))?;
        }
        let name = Layout::shard_name(shard.index);
        // The error sidecar is durable before the shard it describes.
        let sidecar = if self.layout.dtype.is_reduced() {
            rounding::write_sidecar(&self.dir, shard.index, self.layout.dtype, &shard.errors)?;
            let sidecar = rounding::sidecar_name(shard.index);
            let sums = self.files.record(&self.dir, &sidecar)?;
            Some((sidecar, sums))
        } else {
            None
        };
        fsutil::publish(&shard.tmp, &self.dir.join(&name))?;
        // Hashed now, while its pages are still in memory.
        let sums = self.files.record(&self.dir, &name)?;
        if let Some(mut up) = self.files.take_streaming() {
            let sent = self
                .send_labels(&mut up, shard.index)
                .and_then(|()| match sidecar {
                    Some((sidecar, sums)) => self.send(&mut up, &sidecar, sums),
                    None => Ok(()),
                })
                .and_then(|()| self.send(&mut up, &name, sums));
            self.files.stream(up);
            sent?;
        }
        Ok(())
    }

    /// Ends the writer as a killed process would (tests of crash recovery): nothing runs on
    /// the way out and nothing is cleaned up; only the lock goes, as the kernel releases it.
    /// Only in test builds (the `fault-injection` feature).
    #[cfg(any(test, feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn abandon(self) {
        let mut me = std::mem::ManuallyDrop::new(self);
        me.lock.take();
    }

    /// Completes the dataset: publishes labels.bin, then writes shards.json (the commit record).
    /// Fails, leaving the directory resumable, if fewer than `n_examples` were written.
    ///
    /// Writing to an object store, the staged dataset is then uploaded (commit record last)
    /// and its staging directory removed; the `s3://` URL of the dataset is returned.
    pub fn finish(mut self) -> Result<PathBuf> {
        let mut files = std::mem::take(&mut self.files);
        let dir = self.finish_local(&mut files)?;
        // Streaming, labels.bin, the sidecar, shards.json last (and whatever an earlier run
        // staged whole) are what is left to upload; then the labels' pieces go.
        let mut pieces = Vec::new();
        if let Some(streaming) = files.streaming() {
            // Listed once no upload is in flight, so that none is missed.
            streaming.uploaded()?;
            pieces = streaming
                .target
                .join(LABEL_PIECES)
                .list()?
                .into_iter()
                .map(|(n, _)| format!("{LABEL_PIECES}/{n}"))
                .collect::<Vec<_>>();
        }
        files.finish(&dir, &pieces)
    }

    /// The local part of [`Writer::finish`]; `files` are the writer's (taken out of it).
    fn finish_local(&mut self, files: &mut Files) -> Result<PathBuf> {
        if self.start == WriteStart::AlreadyComplete {
            return Ok(self.dir.clone());
        }
        if self.next < self.layout.n_examples {
            return Err(Error::Incomplete {
                path: self.dir.clone(),
                present: self.next,
                total: self.layout.n_examples,
                detail: "finish() called early; the directory is left resumable".into(),
            });
        }
        if let Some(l) = self.labels.take() {
            fsutil::sync_file(&l, &self.dir.join(LABELS_TMP))?;
            fsutil::publish(&self.dir.join(LABELS_TMP), &self.dir.join("labels.bin"))?;
        }
        let counts: Vec<u64> = (0..self.layout.n_shards)
            .map(|s| self.layout.shard_count(s))
            .collect();
        let count_key = self.md.count_key();
        let shards_json = shards_json_bytes(&counts, count_key);
        // The sidecar goes before the commit record (whose hash is known from its bytes): a
        // complete dataset always has one, and a crash before the commit leaves an incomplete
        // dataset whose resumed writer rewrites it.
        files.record_bytes("shards.json", &shards_json);
        files.write_sidecar(&self.dir)?;
        fsutil::atomic_write(&self.dir.join("shards.json"), &shards_json)?;
        let marker = self.dir.join(MARKER);
        fs::remove_file(&marker).at(&marker)?;
        fsutil::fsync_dir(&self.dir)?;
        self.finished = true;
        Ok(self.dir.clone())
    }
}

/// Whether the staging directory `dir` holds a finished write (shards.json staged: finish()
/// writes it last) whose shards are each either staged or in the store: only the final upload
/// remains.
fn staged_whole(dir: &Path, layout: &Layout, uploaded: &Journal) -> bool {
    !uploaded.files.files.is_empty()
        && dir.join("shards.json").is_file()
        && (0..layout.n_shards).all(|s| {
            let name = Layout::shard_name(s);
            uploaded.files.files.contains_key(&name)
                || fsutil::regular_file_len(&dir.join(&name)) == Some(layout.shard_bytes())
        })
}

/// Deletes the labels' pieces a write to `target` left (killed after its commit).
fn delete_label_pieces(target: &Remote) -> Result<()> {
    let pieces = target.join(LABEL_PIECES);
    for (name, _) in pieces.list()? {
        pieces.delete(&name)?;
    }
    Ok(())
}

/// How many examples a write of `acts` (and `labels`) holds: `acts` must be whole examples
/// (`L·T·D` values each) and `labels`, when given, `P` bytes per example.
pub(super) fn examples_in(layout: &Layout, acts: &[f32], labels: Option<&[u8]>) -> Result<u64> {
    let ev = layout.example_values() as usize;
    if !acts.len().is_multiple_of(ev) {
        return Err(Error::Invalid(format!(
            "acts holds {} values, not a multiple of one example (L*T*D = {ev})",
            acts.len()
        )));
    }
    let b = (acts.len() / ev) as u64;
    let p = layout.content_tokens;
    if let Some(l) = labels.filter(|l| l.len() as u64 != b * p) {
        return Err(Error::Invalid(format!(
            "labels hold {} values; {b} examples need {} (b x P = {b} x {p})",
            l.len(),
            b * p
        )));
    }
    Ok(b)
}

fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}
