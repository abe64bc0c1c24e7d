//! One saev dataset written by many processes ([`PartWriter`]): rank `r` of `W` writes the
//! shards [`part_of`](crate::commit::parts::part_of)`(n_shards, r of W)`, i.e. examples
//! `first_shard·eps .. min(end_shard·eps, n_examples)`, into the one dataset directory, and
//! the rank that completes the set commits it exactly as a single [`Writer`](super::Writer)
//! does: labels.bin, the checksum sidecar, shards.json last. The committed directory is
//! byte-identical to a single process's.
//!
//! Each shard is durable on its own: its labels (when the dataset has them) are written first
//! as a private piece (`.shardkit-labels/<shard>`, fsynced), then the shard is published under
//! its final name, then its record (`commit::parts`). A killed rank loses at most the shard it
//! was filling; a restart, with any world size, writes only the shards not recorded.
//!
//! `root` may be an `s3://` prefix: each rank then fills its shards in a local staging
//! directory (`commit::staging_dir` of the dataset's URL), uploads each full shard under its
//! final name (its labels' piece first, as an object `.shardkit-labels/<shard>`), then its
//! record; the ranks coordinate through the store alone (`commit::parts_store`). The commit
//! fetches the pieces in order to build labels.bin, uploads it and the checksum sidecar, and
//! uploads shards.json last: the committed objects are those one [`Writer`](super::Writer)
//! uploads.

use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::checksum::FileSums;
use crate::commit::parts::every_unit_listed;
use crate::commit::parts::CommitStart;
use crate::commit::parts::{
    commit_surviving_takeover, part_of, Claim, Parts, PartsStatus, Rank, UnitFiles, Uploads,
};
use crate::commit::{staging_dir, Files, Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::Value;
use crate::precision::ErrorStats;
use crate::saev::dataset::check_complete;
use crate::saev::layout::{shards_json_bytes, Layout};
use crate::saev::rounding;
use crate::saev::validate::shard_index;
use crate::saev::writer::{examples_in, label_piece, LABEL_PIECES, MARKER};
use crate::saev::Metadata;

/// Writes rank `rank`'s part of a saev dataset; see the module documentation.
pub struct PartWriter {
    /// Where shards are written: the dataset directory, or for a store the local staging.
    dir: PathBuf,
    /// The dataset's location: its directory, or its `s3://` URL.
    location: PathBuf,
    md: Metadata,
    layout: Layout,
    rank: Rank,
    /// This rank's shards.
    shards: Range<u64>,
    /// Examples still to write, in order (the part's, less the shards already durable).
    pending: Vec<Range<u64>>,
    /// The next example a write goes to (`None` once the part is written).
    next: Option<u64>,
    /// The shard being filled: (index, where, rows written, its labels).
    shard: Option<(u64, Sink, u64, Vec<u8>)>,
    /// The rounding error of the shard being filled (reduced-precision datasets).
    shard_errors: ErrorStats,
    /// Refuse rows rounded worse than this ([`PartWriter::set_max_rel_error`]).
    max_rel_error: Option<f64>,
    /// Whether the dataset has labels, once the first write (or a durable shard) says.
    labels: Option<bool>,
    /// Full shards going up to the store behind the writer. Declared before the claim: a
    /// writer dropped unfinished waits for them (making them durable) while it still holds it.
    uploads: Uploads,
    /// The parts state and this rank's claim on its shards; `None` when the dataset was
    /// already committed (nothing is written then).
    parts: Option<(Parts, Claim)>,
    /// The dataset's prefix when writing to a store (`dir` is then where shards are staged).
    store: Option<Remote>,
    /// Held shared by every part writer of a local dataset (a whole-dataset writer holds it
    /// exclusively); in a store the claims and the dataset lock exclude each other.
    _lock: Option<WriteLock>,
}

/// Where a shard is filled: a temporary file beside its final name, or for a store memory,
/// uploaded whole once full (no local copy to write and read back; a killed rank loses its
/// unfinished shard either way).
enum Sink {
    File(File, PathBuf),
    Memory(Vec<u8>),
}

impl std::fmt::Debug for PartWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWriter")
            .field("location", &self.location)
            .field("rank", &self.rank)
            .field("shards", &self.shards)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

/// The metadata keys in which `theirs` (a metadata.json's bytes) differs from `ours`, for a
/// refusal.
fn differing_text(ours: &Value, theirs: &[u8]) -> String {
    match crate::json::parse(theirs) {
        Err(_) => "(not JSON)".into(),
        Ok(t) => {
            let keys = crate::json::differing_keys(ours, &t);
            if keys.is_empty() {
                "(key order or formatting)".into()
            } else {
                keys.iter()
                    .map(|k| format!("{k:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        }
    }
}

impl PartWriter {
    /// Opens rank `rank`'s part of the dataset `md` under `root` (`root/<dir_name(md)>`, made
    /// by whichever rank comes first). Refused when the directory holds another dataset (naming
    /// the first metadata key that differs), when a whole-dataset writer holds it, or when a
    /// live rank has claimed shards of this part. Shards already durable (an earlier run, with
    /// any world size) are kept: [`PartWriter::pending`] says what is left to write.
    pub fn create(root: impl AsRef<Path>, md: Metadata, rank: Rank) -> Result<PartWriter> {
        let root = match Target::parse(root.as_ref())? {
            Target::Local(root) => root,
            Target::Store(store) => return Self::create_store(&store, md, rank),
        };
        let layout = Layout::new(&md, Path::new("metadata.json"))?;
        let dir = root.join(md.dir_name());
        fs::create_dir_all(&dir).at(&dir)?;
        let lock = WriteLock::dir_shared(&dir)?;
        let md_path = dir.join("metadata.json");
        let committed = fsutil::read_json_file(&md_path).is_ok_and(|b| b == md.file_bytes())
            && check_complete(&dir, &layout).is_ok();
        let mut w = PartWriter {
            shards: part_of(layout.n_shards, rank),
            location: dir.clone(),
            dir,
            md,
            layout,
            rank,
            pending: Vec::new(),
            next: None,
            shard: None,
            shard_errors: ErrorStats::default(),
            max_rel_error: None,
            uploads: Uploads::default(),
            labels: None,
            parts: None,
            store: None,
            _lock: Some(lock),
        };
        if committed {
            // Done before (a rank started again after the commit): nothing to write. What a
            // committer killed while cleaning up left is removed; nothing else is touched.
            if let Some(parts) = Parts::existing(&w.dir) {
                if let Some(_committing) = parts.commit_lock()? {
                    clean_after_commit(parts)?;
                }
            }
            return Ok(w);
        }
        let parts = Parts::open(&w.dir)?;
        // Ranks start together: one at a time checks (or writes) metadata.json.
        let setting_up = parts.setup_lock()?;
        let ours = w.md.file_bytes();
        match fsutil::read_json_file(&md_path) {
            Ok(theirs) if theirs == ours => {}
            Ok(theirs) => return Err(mismatch(md_path, w.md.raw(), &theirs)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::atomic_write(&w.dir.join(MARKER), b"")?;
                fsutil::atomic_write(&md_path, &ours)?;
            }
            Err(e) => return Err(Error::io(&md_path, e)),
        }
        drop(setting_up);
        let claim = parts.claim(w.shards.clone(), rank)?;
        w.parts = Some((parts, claim));
        w.plan()?;
        Ok(w)
    }

    /// [`PartWriter::create`] under the store prefix `root`.
    fn create_store(root: &Remote, md: Metadata, rank: Rank) -> Result<PartWriter> {
        let layout = Layout::new(&md, Path::new("metadata.json"))?;
        let target = root.join(&md.dir_name());
        let url = PathBuf::from(target.url());
        // Each rank stages its shards under the dataset's staging directory (shard names are
        // the ranks' own; the commit builds in its own directory).
        let staged = staging_dir(&url).join(PARTS_STAGING);
        fs::create_dir_all(&staged).at(&staged)?;
        let mut w = PartWriter {
            shards: part_of(layout.n_shards, rank),
            location: PathBuf::from(target.url()),
            dir: staged,
            md,
            layout,
            rank,
            pending: Vec::new(),
            next: None,
            shard: None,
            shard_errors: ErrorStats::default(),
            max_rel_error: None,
            uploads: Uploads::default(),
            labels: None,
            parts: None,
            store: Some(target.clone()),
            _lock: None,
        };
        if store_committed(&target, &w.md)? {
            if let Some(parts) = Parts::existing_store(&target)? {
                if let Some(_committing) = parts.commit_lock()? {
                    clean_after_commit(parts)?;
                }
            }
            return Ok(w);
        }
        let parts = Parts::open_store(&target)?;
        let Some(store) = parts.store() else {
            return Err(Error::Internal("internal: a store's parts state".into()));
        };
        // Refused before anything is written: a whole-dataset writer, another dataset.
        store.refuse_single_writer()?;
        if let Some(theirs) = store.create_setup("metadata.json", &w.md.file_bytes())? {
            return Err(mismatch(
                target.url_of("metadata.json"),
                w.md.raw(),
                &theirs,
            ));
        }
        let claim = parts.claim(w.shards.clone(), rank)?;
        // Looked at again once the claim is made: a whole-dataset writer takes its lock, then
        // looks for claims, so of a writer and a rank starting together one sees the other.
        store.refuse_single_writer()?;
        w.parts = Some((parts, claim));
        w.plan()?;
        Ok(w)
    }

    /// Finds this part's shards still to write from the records, and removes what a killed
    /// rank left of them (a temporary, a shard published without its record).
    fn plan(&mut self) -> Result<()> {
        let Some(parts) = self.parts.as_ref().map(|(p, _)| p.clone()) else {
            return Ok(());
        };
        let done = parts.done()?;
        // Any durable shard, this part's or another's, says whether the dataset has labels.
        for (name, files) in &done {
            if let Some(s) = shard_index(name) {
                self.note_labels(files.contains_key(&label_piece(s)))?;
            }
        }
        let eps = self.layout.examples_per_shard;
        let n = self.layout.n_examples;
        let intact = parts.intact_units(&done)?;
        for s in self.shards.clone() {
            let name = Layout::shard_name(s);
            if intact.contains(&name) {
                continue;
            }
            if done.contains_key(&name) {
                parts.forget(&name)?;
            }
            for p in [
                self.dir.join(&name),
                self.dir.join(label_piece(s)),
                self.dir.join(rounding::sidecar_name(s)),
            ] {
                match fs::remove_file(&p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(Error::io(&p, e))
                    }
                    _ => {}
                }
            }
            let r = s * eps..((s + 1) * eps).min(n);
            match self.pending.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => self.pending.push(r),
            }
        }
        self.next = self.pending.first().map(|r| r.start);
        Ok(())
    }

    fn note_labels(&mut self, has: bool) -> Result<()> {
        match self.labels {
            Some(l) if l != has => Err(Error::Invalid(format!(
                "{}: the dataset's shards disagree on whether it has labels; every rank must \
                 write labels, or none",
                self.location.display()
            ))),
            _ => {
                self.labels = Some(has);
                Ok(())
            }
        }
    }

    /// The dataset directory, or its `s3://` URL.
    pub fn path(&self) -> &Path {
        &self.location
    }

    /// This rank and world size.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The examples this rank's part covers (its shards'), durable or not.
    pub fn examples(&self) -> Range<u64> {
        let eps = self.layout.examples_per_shard;
        let n = self.layout.n_examples;
        (self.shards.start * eps).min(n)..(self.shards.end * eps).min(n)
    }

    /// The examples still to write, in order: feed [`PartWriter::write`] exactly these (the
    /// writer moves from one range to the next by itself).
    pub fn pending(&self) -> &[Range<u64>] {
        &self.pending
    }

    /// The example the next [`PartWriter::write`] begins at (`None` once the part is written).
    pub fn next_example(&self) -> Option<u64> {
        self.next
    }

    /// For a reduced-precision dataset: refuse a write holding a row whose relative L2 rounding
    /// error exceeds `bound` (or that overflows), naming the shard and the row (as
    /// [`WriterOptions::max_rel_error`](super::WriterOptions::max_rel_error)).
    pub fn set_max_rel_error(&mut self, bound: Option<f64>) {
        self.max_rel_error = bound;
    }

    /// The global example the `k`-th example of the next write goes to.
    fn example_at(&self, k: u64) -> u64 {
        // The first pending range starts at the next example (`advance` keeps it so).
        let mut k = k;
        for r in &self.pending {
            if k < r.end - r.start {
                return r.start + k;
            }
            k -= r.end - r.start;
        }
        self.layout.n_examples
    }

    /// Writes the next `b` examples of [`PartWriter::pending`]: `acts` holds `b·L·T·D`
    /// float32 values, C order, rounded to the dataset's dtype when it is a reduced one;
    /// `labels`, when the dataset has labels, `b·P` bytes. The ranks of one dataset must agree
    /// on whether it has labels. A write refused (bad sizes, `max_rel_error`) stores nothing.
    pub fn write(&mut self, acts: &[f32], labels: Option<&[u8]>) -> Result<()> {
        let b = examples_in(&self.layout, acts, labels)?;
        let p = self.layout.content_tokens;
        if labels.is_some() && self.md.major() == 1 {
            return Err(Error::Invalid(
                "protocol 1.0.0 has no labels.bin (labels arrived with 1.1)".into(),
            ));
        }
        if b == 0 {
            return Ok(());
        }
        if self.parts.is_none() {
            return Err(Error::Invalid(format!(
                "{}: the dataset is already committed; nothing is left to write",
                self.location.display()
            )));
        }
        let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
        if b > left {
            return Err(Error::Invalid(format!(
                "{b} more examples would pass the end of {}'s part ({left} left to write of \
                 examples {}..{})",
                self.rank,
                self.examples().start,
                self.examples().end
            )));
        }
        let stored =
            rounding::store_examples(&self.md, &self.layout, acts, self.max_rel_error, |k| {
                self.example_at(k)
            })?;
        let bytes = &stored.bytes[..];
        self.note_labels(labels.is_some())?;
        let eb = self.layout.example_bytes() as usize;
        let eps = self.layout.examples_per_shard;
        let mut done = 0u64;
        while done < b {
            let next = self.next.expect("examples are left, checked above");
            let s = next / eps;
            if self.shard.is_none() {
                let sink = if self.store.is_some() {
                    Sink::Memory(Vec::with_capacity(self.layout.shard_bytes() as usize))
                } else {
                    let tmp = fsutil::temp_sibling(&self.dir.join(Layout::shard_name(s)));
                    let file = fsutil::create_sized(&tmp, self.layout.shard_bytes())?;
                    Sink::File(file, tmp)
                };
                self.shard = Some((s, sink, 0, Vec::new()));
                self.shard_errors = ErrorStats::default();
            }
            let count = self.layout.shard_count(s);
            let (_, sink, rows, shard_labels) = self.shard.as_mut().expect("opened");
            let n = (count - *rows).min(b - done);
            let chunk = &bytes[done as usize * eb..(done + n) as usize * eb];
            match sink {
                Sink::File(file, tmp) => {
                    file.write_all(chunk).at(&*tmp)?;
                    fsutil::start_writeback(file, *rows * eb as u64, chunk.len() as u64);
                }
                Sink::Memory(buf) => buf.extend_from_slice(chunk),
            }
            self.shard_errors.merge(&stored.errors_of(done..done + n));
            if let Some(l) = labels {
                shard_labels.extend_from_slice(&l[(done * p) as usize..((done + n) * p) as usize]);
            }
            *rows += n;
            done += n;
            let full = *rows == count;
            self.advance(n);
            if full {
                self.publish_shard()?;
            }
        }
        Ok(())
    }

    /// Moves the next example `n` examples on, into the next pending range when one ends.
    fn advance(&mut self, n: u64) {
        let Some(next) = self.next else { return };
        let at = next + n;
        while self.pending.first().is_some_and(|r| r.end <= at) {
            self.pending.remove(0);
        }
        if let Some(r) = self.pending.first_mut() {
            r.start = r.start.max(at);
        }
        self.next = self.pending.first().map(|r| r.start);
    }

    /// Makes the full shard durable: its labels' piece, the shard under its final name, then
    /// its record (for a store, handed to the uploads behind the writer).
    fn publish_shard(&mut self) -> Result<()> {
        let Some((s, sink, _, labels)) = self.shard.take() else {
            return Ok(());
        };
        let Some((parts, claim)) = self.parts.as_ref() else {
            return Err(Error::Internal(
                "internal: a shard published by a writer of a committed dataset".into(),
            ));
        };
        // Nothing more from a rank whose claim another took over (it may be writing this
        // shard).
        claim.check()?;
        let name = Layout::shard_name(s);
        let with_labels = self.labels == Some(true);
        let dtype = self.layout.dtype;
        let sidecar = dtype.is_reduced().then(|| {
            (
                rounding::sidecar_name(s),
                rounding::sidecar_bytes(dtype, &self.shard_errors),
            )
        });
        let (file, tmp) = match sink {
            Sink::File(file, tmp) => (file, tmp),
            Sink::Memory(mut bytes) => {
                // Every shard file has the full shard's size, a short last one zero-padded,
                // as a file sized up front is.
                bytes.resize(self.layout.shard_bytes() as usize, 0);
                let (store, parts, claim) = (self.store.clone(), parts.clone(), claim.watch());
                // Uploaded under its final name (a PUT is atomic), its labels' piece first,
                // then recorded, while the writer fills the next shard.
                return self.uploads.push(Box::new(move || {
                    let store = store.ok_or_else(|| {
                        Error::Internal("internal: a shard in memory without a store".into())
                    })?;
                    let mut files = UnitFiles::new();
                    if with_labels {
                        let piece = label_piece(s);
                        files.insert(piece.clone(), FileSums::of_bytes(&labels));
                        store.put(&piece, labels)?;
                    }
                    if let Some((sidecar, body)) = sidecar {
                        files.insert(sidecar.clone(), FileSums::of_bytes(&body));
                        store.put(&sidecar, body)?;
                    }
                    files.insert(name.clone(), FileSums::of_bytes(&bytes));
                    store.put_owned(&name, bytes)?;
                    claim.check()?;
                    parts.record_done(&name, &files)
                }));
            }
        };
        let mut files = UnitFiles::new();
        if with_labels {
            let piece = label_piece(s);
            let path = self.dir.join(&piece);
            let dir = fsutil::parent_of(&path);
            fs::create_dir_all(dir).at(dir)?;
            fsutil::atomic_write(&path, &labels)?;
            files.insert(piece, FileSums::of_bytes(&labels));
        }
        // The error sidecar is durable before the shard it describes.
        if let Some((sidecar, body)) = sidecar {
            fsutil::atomic_write(&self.dir.join(&sidecar), &body)?;
            files.insert(sidecar, FileSums::of_bytes(&body));
        }
        fsutil::sync_data(&file, &tmp)?;
        drop(file);
        fsutil::publish(&tmp, &self.dir.join(&name))?;
        files.insert(name.clone(), FileSums::of_file(&self.dir.join(&name))?);
        parts.record_done(&name, &files)
    }

    /// Ends this rank's part, then commits the dataset if every shard is durable (waiting for a
    /// rank committing meanwhile). Refused, leaving the part resumable, when examples of the
    /// part are still pending. Returns where the dataset stands: committed, or the shards
    /// other ranks still owe.
    pub fn finish(mut self) -> Result<PartsStatus> {
        if let Some(next) = self.next {
            let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
            return Err(Error::Incomplete {
                path: self.location.clone(),
                present: self.examples().end - self.examples().start - left,
                total: self.examples().end - self.examples().start,
                detail: format!(
                    "{}'s part is not written whole (next example {next}, {left} left); the \
                     part is left resumable",
                    self.rank
                ),
            });
        }
        // Every shard of the part up and recorded before the commit looks for them.
        self.uploads.wait()?;
        let Some((parts, _)) = &self.parts else {
            return Ok(PartsStatus::committed(self.layout.n_shards));
        };
        let committed = match &self.store {
            Some(store) => commit_store(store, &self.md, &self.layout, parts)?,
            None => commit(&self.dir, &self.md, &self.layout, parts)?,
        };
        status_of(&self.layout, parts, committed)
    }
}

/// Where a rank writing to a store stages its shards, under the dataset's staging directory.
const PARTS_STAGING: &str = ".shardkit-parts";

/// The refusal of a rank whose metadata differs from the dataset's (`theirs`, at `path`).
fn mismatch(path: PathBuf, ours: &Value, theirs: &[u8]) -> Error {
    let key = differing_text(ours, theirs);
    Error::Exists {
        path,
        why: format!(
            "holds a different dataset: metadata key(s) {key} differ from this rank's; every \
             rank must write the same metadata (refusing to write)"
        ),
    }
}

/// Whether the store prefix `target` holds the committed dataset `md` (its metadata.json,
/// and shards.json with every shard: it opens).
fn store_committed(target: &Remote, md: &Metadata) -> Result<bool> {
    if target.get_opt("metadata.json")?.as_deref() != Some(&md.file_bytes()[..]) {
        return Ok(false);
    }
    Ok(target.get_opt("shards.json")?.is_some()
        && crate::saev::Dataset::open(PathBuf::from(target.url())).is_ok())
}

/// Lists shard `s`'s error sidecar (reduced-precision datasets), as its record has it, in the
/// dataset's checksums: one writer's sidecar lists it too.
fn insert_error_sidecar(files: &mut Files, s: u64, unit: &UnitFiles) {
    let name = rounding::sidecar_name(s);
    if let Some(sums) = unit.get(&name) {
        files.insert(&name, sums.clone());
    }
}

/// Whether every shard is recorded durable; then whether they carry labels (all, or none:
/// a mix is refused, naming the counts). `None` while shards are missing.
fn all_recorded(
    at: &Path,
    layout: &Layout,
    done: &std::collections::BTreeMap<String, UnitFiles>,
) -> Result<Option<bool>> {
    let n = layout.n_shards;
    if (0..n).any(|s| !done.contains_key(&Layout::shard_name(s))) {
        return Ok(None);
    }
    let with_labels = (0..n)
        .filter(|&s| done[&Layout::shard_name(s)].contains_key(&label_piece(s)))
        .count() as u64;
    if with_labels != 0 && with_labels != n {
        return Err(Error::format(
            at,
            format!(
                "{with_labels} of {n} shards were written with labels: every rank must write \
                 labels, or none (rewrite the shards of the ranks that differed)"
            ),
        ));
    }
    Ok(Some(with_labels == n))
}

/// Builds labels.bin at `path` from the pieces in shard order (`piece(s)` gives shard `s`'s
/// bytes), each checked against its record; built beside and published whole.
fn build_labels(
    path: &Path,
    layout: &Layout,
    done: &std::collections::BTreeMap<String, UnitFiles>,
    piece: impl Fn(u64) -> Result<(Vec<u8>, PathBuf)> + Sync,
) -> Result<()> {
    // Several pieces at a time (each a GET in a store), each written at its own offset.
    const FETCHERS: u64 = 8;
    let p = layout.content_tokens;
    let tmp = fsutil::temp_sibling(path);
    let f = fsutil::create_sized(&tmp, layout.n_examples * p)?;
    let n = layout.n_shards;
    let fetch = |first: u64| -> Result<()> {
        for s in (first..n).step_by(FETCHERS as usize) {
            let (bytes, at) = piece(s)?;
            if FileSums::of_bytes(&bytes) != done[&Layout::shard_name(s)][&label_piece(s)] {
                return Err(Error::format(
                    &at,
                    "does not match its record (the labels of a durable shard were changed)",
                ));
            }
            f.write_all_at(&bytes, s * layout.examples_per_shard * p)
                .at(&tmp)?;
        }
        Ok(())
    };
    std::thread::scope(|sc| {
        let workers: Vec<_> = (0..FETCHERS.min(n))
            .map(|t| {
                let fetch = &fetch;
                sc.spawn(move || fetch(t))
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join().unwrap_or_else(|_| {
                Err(Error::Internal(format!(
                    "{}: a thread fetching labels' pieces panicked",
                    tmp.display()
                )))
            })
        })
    })?;
    fsutil::sync_file(&f, &tmp)?;
    drop(f);
    fsutil::publish(&tmp, path)
}

/// Commits the dataset in `dir` if every shard is durable and nobody has; true when it is
/// committed (now or before).
fn commit(dir: &Path, md: &Metadata, layout: &Layout, parts: &Parts) -> Result<bool> {
    let (_committing, done) = match parts.begin_commit(
        (0..layout.n_shards).map(Layout::shard_name),
        || Ok(check_complete(dir, layout).is_ok()),
        || clean_after_commit(parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let Some(with_labels) = all_recorded(dir, layout, &done)? else {
        return Ok(false);
    };
    let n = layout.n_shards;
    let mut files = Files::default();
    for (s, unit) in (0..n).map(|s| (s, &done[&Layout::shard_name(s)])) {
        let name = Layout::shard_name(s);
        let sums = &unit[&name];
        if fsutil::regular_file_len(&dir.join(&name)) != Some(sums.bytes) {
            return Err(Error::format(
                dir.join(&name),
                "recorded durable but missing or of another size (delete its record under \
                 .shardkit-parts/done and write that shard again)",
            ));
        }
        files.insert(&name, sums.clone());
        insert_error_sidecar(&mut files, s, unit);
    }
    if with_labels {
        build_labels(&dir.join("labels.bin"), layout, &done, |s| {
            let piece = dir.join(label_piece(s));
            Ok((fs::read(&piece).at(&piece)?, piece))
        })?;
    }
    let counts: Vec<u64> = (0..n).map(|s| layout.shard_count(s)).collect();
    let shards_json = shards_json_bytes(&counts, md.count_key());
    files.record_bytes("shards.json", &shards_json);
    // The sidecar lists the dataset's files (private names, the pieces and records among
    // them, are not the dataset's), as a single writer's does.
    files.write_sidecar(dir)?;
    fsutil::atomic_write(&dir.join("shards.json"), &shards_json)?;
    // Committed: the rest is cleaning up, which a later open or status finishes if cut short.
    clean_after_commit(parts.clone())?;
    Ok(true)
}

/// [`commit`] in the store prefix `target`: labels.bin (from the pieces, fetched in order)
/// and the sidecar are built in a local directory of the committer's and uploaded, then,
/// the commit lock renewed, shards.json.
fn commit_store(target: &Remote, md: &Metadata, layout: &Layout, parts: &Parts) -> Result<bool> {
    commit_surviving_takeover(
        || commit_store_once(target, md, layout, parts),
        || store_committed(target, md),
    )
}

/// One attempt of [`commit_store`].
fn commit_store_once(
    target: &Remote,
    md: &Metadata,
    layout: &Layout,
    parts: &Parts,
) -> Result<bool> {
    if !every_unit_listed(parts, (0..layout.n_shards).map(Layout::shard_name))? {
        // Or committed by another rank (its records removed, or being removed: finished here).
        if store_committed(target, md)? {
            clean_after_commit(parts.clone())?;
            return Ok(true);
        }
        return Ok(false);
    }
    let (committing, done) = match parts.begin_commit(
        (0..layout.n_shards).map(Layout::shard_name),
        || store_committed(target, md),
        || clean_after_commit(parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let url = PathBuf::from(target.url());
    let Some(with_labels) = all_recorded(&url, layout, &done)? else {
        return Ok(false);
    };
    let n = layout.n_shards;
    let mut files = Files::default();
    let sizes: std::collections::BTreeMap<String, u64> = target.list()?.into_iter().collect();
    for s in 0..n {
        let name = Layout::shard_name(s);
        let sums = &done[&name][&name];
        if sizes.get(&name) != Some(&sums.bytes) {
            return Err(Error::format(
                target.url_of(&name),
                "recorded durable but missing or of another size (delete its record under \
                 .shardkit-parts/done/ and write that shard again)",
            ));
        }
        files.insert(&name, sums.clone());
        insert_error_sidecar(&mut files, s, &done[&name]);
    }
    // The committer's own directory (another rank of this machine may stage shards beside).
    let dir = staging_dir(&url).join(format!(".shardkit-commit-{}", std::process::id()));
    match fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&dir, e)),
        _ => {}
    }
    fs::create_dir_all(&dir).at(&dir)?;
    let built = (|| -> Result<()> {
        fsutil::atomic_write(&dir.join("metadata.json"), &md.file_bytes())?;
        if with_labels {
            build_labels(&dir.join("labels.bin"), layout, &done, |s| {
                let piece = label_piece(s);
                Ok((target.get(&piece)?, target.url_of(&piece)))
            })?;
        }
        let counts: Vec<u64> = (0..n).map(|s| layout.shard_count(s)).collect();
        let shards_json = shards_json_bytes(&counts, md.count_key());
        files.record_bytes("shards.json", &shards_json);
        let sidecar = files.write_sidecar(&dir)?;
        if with_labels {
            target.put_file("labels.bin", &dir.join("labels.bin"))?;
        }
        let sidecar_name = crate::checksum::SIDECAR;
        target.put_file(sidecar_name, &sidecar)?;
        // Still this rank's commit (a committer stalled past its lease has lost it).
        committing.confirm()?;
        target.put("shards.json", shards_json)
    })();
    let _ = fs::remove_dir_all(&dir);
    built?;
    clean_after_commit(parts.clone())?;
    Ok(true)
}

/// Removes what a write in parts keeps beside the committed dataset.
fn clean_after_commit(parts: Parts) -> Result<()> {
    // The marker exists only in a local directory; deleting an absent object is no error.
    let marker: &[&str] = if parts.store().is_some() {
        &[]
    } else {
        &[MARKER]
    };
    parts.clean_after_commit(&[LABEL_PIECES], marker)
}

fn status_of(layout: &Layout, parts: &Parts, committed: bool) -> Result<PartsStatus> {
    if committed {
        return Ok(PartsStatus::committed(layout.n_shards));
    }
    Ok(parts.status(layout.n_shards, shard_index)?.0)
}

/// Where the dataset at `dir` (a saev dataset directory, or its `s3://` URL) stands:
/// committed, or which shards are durable, which are claimed by live ranks, and what a
/// restart would write. A dataset whose every shard is durable but not committed (its last
/// rank killed mid-commit) is committed by [`commit_parts`].
pub fn status(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let (md, layout, place) = open_parts(dir.as_ref())?;
    match place {
        Opened::Local(dir) => {
            let committed = check_complete(&dir, &layout).is_ok();
            match Parts::existing(&dir) {
                Some(p) => status_of(&layout, &p, committed),
                None => Ok(if committed {
                    PartsStatus::committed(layout.n_shards)
                } else {
                    PartsStatus::new(false, layout.n_shards)
                }),
            }
        }
        Opened::Store(target) => {
            let committed = store_committed(&target, &md)?;
            match Parts::existing_store(&target)? {
                Some(p) => status_of(&layout, &p, committed),
                None => Ok(if committed {
                    PartsStatus::committed(layout.n_shards)
                } else {
                    PartsStatus::new(false, layout.n_shards)
                }),
            }
        }
    }
}

/// The status of the dataset at `dir` (a directory or an `s3://` URL) when a write in parts
/// of it is under way (its state exists), for `validate`.
pub(crate) fn unfinished_status(dir: &Path) -> Option<PartsStatus> {
    let exists = match Target::parse(dir).ok()? {
        Target::Local(d) => Parts::existing(&d).is_some(),
        Target::Store(target) => Parts::existing_store(&target).ok()?.is_some(),
    };
    exists.then(|| status(dir).ok()).flatten()
}

/// Where a dataset written in parts is.
enum Opened {
    Local(PathBuf),
    Store(Remote),
}

/// The metadata and layout of the dataset at `dir` (a directory or an `s3://` URL).
fn open_parts(dir: &Path) -> Result<(Metadata, Layout, Opened)> {
    let (bytes, md_path, place) = match Target::parse(dir)? {
        Target::Local(dir) => {
            let md_path = dir.join("metadata.json");
            let bytes = fsutil::read_json_file(&md_path).map_err(|e| Error::io(&md_path, e))?;
            (bytes, md_path, Opened::Local(dir))
        }
        Target::Store(target) => {
            let md_path = target.url_of("metadata.json");
            (target.get("metadata.json")?, md_path, Opened::Store(target))
        }
    };
    let (md, _) = Metadata::parse(&bytes, &md_path)?;
    let layout = Layout::new(&md, &md_path)?;
    Ok((md, layout, place))
}

/// Commits the dataset at `dir` (a directory, or an `s3://` URL) written in parts, when every
/// shard is durable (a restart of nothing: the ranks finished, the last was killed while
/// committing). Returns its status.
pub fn commit_parts(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let (md, layout, place) = open_parts(dir.as_ref())?;
    match place {
        Opened::Local(dir) => {
            let Some(parts) = Parts::existing(&dir) else {
                return status(&dir);
            };
            let _lock = WriteLock::dir_shared(&dir)?;
            let committed = commit(&dir, &md, &layout, &parts)?;
            status_of(&layout, &parts, committed)
        }
        Opened::Store(target) => {
            let Some(parts) = Parts::existing_store(&target)? else {
                return status(dir);
            };
            let committed = commit_store(&target, &md, &layout, &parts)?;
            status_of(&layout, &parts, committed)
        }
    }
}
