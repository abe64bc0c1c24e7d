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

use std::fs::{self, File};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::checksum::FileSums;
use crate::commit::parts::{part_of, Claim, Parts, PartsStatus, Rank, UnitFiles};
use crate::commit::{Files, Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::json::Value;
use crate::saev::dataset::check_complete;
use crate::saev::layout::{shards_json_bytes, Layout};
use crate::saev::validate::shard_index;
use crate::saev::writer::{examples_in, label_piece, write_le, LABEL_PIECES, MARKER};
use crate::saev::Metadata;

/// Writes rank `rank`'s part of a saev dataset; see the module documentation.
pub struct PartWriter {
    dir: PathBuf,
    md: Metadata,
    layout: Layout,
    rank: Rank,
    /// This rank's shards.
    shards: Range<u64>,
    /// Examples still to write, in order (the part's, less the shards already durable).
    pending: Vec<Range<u64>>,
    /// The next example a write goes to (`None` once the part is written).
    next: Option<u64>,
    /// The shard being filled: (index, file, temporary path, rows written, its labels).
    shard: Option<(u64, File, PathBuf, u64, Vec<u8>)>,
    /// Whether the dataset has labels, once the first write (or a durable shard) says.
    labels: Option<bool>,
    /// The parts state and this rank's claim on its shards; `None` when the dataset was
    /// already committed (nothing is written then).
    parts: Option<(Parts, Claim)>,
    /// Held shared by every part writer of the dataset (a whole-dataset writer holds it
    /// exclusively).
    _lock: WriteLock,
}

impl std::fmt::Debug for PartWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWriter")
            .field("dir", &self.dir)
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
            Target::Store(store) => {
                return Err(Error::Invalid(format!(
                    "{}: writing a dataset in parts to an object store is not supported yet; \
                     write the parts to a shared file system (or one process with \
                     saev.Writer to the store)",
                    store.url()
                )))
            }
        };
        let layout = Layout::new(&md, Path::new("metadata.json"))?;
        let dir = root.join(md.dir_name());
        fs::create_dir_all(&dir).at(&dir)?;
        let lock = WriteLock::dir_shared(&dir)?;
        let md_path = dir.join("metadata.json");
        let committed = fsutil::read_json_file(&md_path).is_ok_and(|b| b == md.file_bytes())
            && check_complete(&dir, &layout).is_ok();
        if committed {
            // Done before (a rank started again after the commit): nothing to write. What a
            // committer killed while cleaning up left is removed; nothing else is touched.
            if let Some(parts) = Parts::existing(&dir) {
                if let Some(_committing) = parts.commit_lock()? {
                    clean_after_commit(&dir, &dir.join(LABEL_PIECES), parts)?;
                }
            }
            return Ok(PartWriter {
                shards: part_of(layout.n_shards, rank),
                dir,
                md,
                layout,
                rank,
                pending: Vec::new(),
                next: None,
                shard: None,
                labels: None,
                parts: None,
                _lock: lock,
            });
        }
        let parts = Parts::open(&dir)?;
        // Ranks start together: one at a time checks (or writes) metadata.json.
        let setting_up = parts.setup_lock()?;
        let ours = md.file_bytes();
        match fsutil::read_json_file(&md_path) {
            Ok(theirs) if theirs == ours => {}
            Ok(theirs) => {
                let key = differing_text(md.raw(), &theirs);
                return Err(Error::Exists {
                    path: md_path,
                    why: format!(
                        "holds a different dataset: metadata key(s) {key} differ from this \
                         rank's; every rank must write the same metadata (refusing to write)"
                    ),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::atomic_write(&dir.join(MARKER), b"")?;
                fsutil::atomic_write(&md_path, &ours)?;
            }
            Err(e) => return Err(Error::io(&md_path, e)),
        }
        drop(setting_up);
        let shards = part_of(layout.n_shards, rank);
        let claim = parts.claim(shards.clone(), rank)?;
        let mut w = PartWriter {
            dir,
            md,
            layout,
            rank,
            shards,
            pending: Vec::new(),
            next: None,
            shard: None,
            labels: None,
            parts: Some((parts, claim)),
            _lock: lock,
        };
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
        for s in self.shards.clone() {
            let name = Layout::shard_name(s);
            if let Some(files) = done.get(&name) {
                if self.intact(s, files) {
                    continue;
                }
                parts.forget(&name)?;
            }
            for p in [self.dir.join(&name), self.dir.join(label_piece(s))] {
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

    /// Whether shard `s`, recorded with `files`, is on disk as recorded (sizes checked; the
    /// checksums are the sidecar's to check).
    fn intact(&self, s: u64, files: &UnitFiles) -> bool {
        files
            .iter()
            .all(|(name, sums)| fsutil::regular_file_len(&self.dir.join(name)) == Some(sums.bytes))
            && files.contains_key(&Layout::shard_name(s))
    }

    fn note_labels(&mut self, has: bool) -> Result<()> {
        match self.labels {
            Some(l) if l != has => Err(Error::Invalid(format!(
                "{}: the dataset's shards disagree on whether it has labels; every rank must \
                 write labels, or none",
                self.dir.display()
            ))),
            _ => {
                self.labels = Some(has);
                Ok(())
            }
        }
    }

    /// The dataset directory.
    pub fn path(&self) -> &Path {
        &self.dir
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

    /// Writes the next `b` examples of [`PartWriter::pending`]: `acts` holds `b·L·T·D`
    /// float32 values, C order; `labels`, when the dataset has labels, `b·P` bytes. The ranks
    /// of one dataset must agree on whether it has labels.
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
                self.dir.display()
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
        self.note_labels(labels.is_some())?;
        // SAFETY: f32 has no padding; the byte view covers exactly `acts`.
        let bytes: &[u8] = unsafe {
            std::slice::from_raw_parts(acts.as_ptr().cast::<u8>(), std::mem::size_of_val(acts))
        };
        let eb = self.layout.example_bytes() as usize;
        let eps = self.layout.examples_per_shard;
        let mut done = 0u64;
        while done < b {
            let next = self.next.expect("examples are left, checked above");
            let s = next / eps;
            if self.shard.is_none() {
                let tmp = fsutil::temp_sibling(&self.dir.join(Layout::shard_name(s)));
                let file = fsutil::create_sized(&tmp, self.layout.shard_bytes())?;
                self.shard = Some((s, file, tmp, 0, Vec::new()));
            }
            let count = self.layout.shard_count(s);
            let (_, file, tmp, rows, shard_labels) = self.shard.as_mut().expect("opened");
            let n = (count - *rows).min(b - done);
            let chunk = &bytes[done as usize * eb..(done + n) as usize * eb];
            write_le(file, chunk).at(&*tmp)?;
            fsutil::start_writeback(file, *rows * eb as u64, chunk.len() as u64);
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
    /// its record.
    fn publish_shard(&mut self) -> Result<()> {
        let Some((s, file, tmp, _, labels)) = self.shard.take() else {
            return Ok(());
        };
        let name = Layout::shard_name(s);
        let mut files = UnitFiles::new();
        if self.labels == Some(true) {
            let piece = label_piece(s);
            let path = self.dir.join(&piece);
            let dir = fsutil::parent_of(&path);
            fs::create_dir_all(dir).at(dir)?;
            fsutil::atomic_write(&path, &labels)?;
            files.insert(piece, FileSums::of_bytes(&labels));
        }
        fsutil::sync_data(&file, &tmp)?;
        drop(file);
        fsutil::publish(&tmp, &self.dir.join(&name))?;
        files.insert(name.clone(), FileSums::of_file(&self.dir.join(&name))?);
        let (parts, _) = self
            .parts
            .as_ref()
            .expect("a shard is written only when unfinished");
        parts.record_done(&name, &files)
    }

    /// Ends this rank's part, then commits the dataset if every shard is durable (waiting for a
    /// rank committing meanwhile). Refused, leaving the part resumable, when examples of the
    /// part are still pending. Returns where the dataset stands: committed, or the shards
    /// other ranks still owe.
    pub fn finish(self) -> Result<PartsStatus> {
        if let Some(next) = self.next {
            let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
            return Err(Error::Incomplete {
                path: self.dir.clone(),
                present: self.examples().end - self.examples().start - left,
                total: self.examples().end - self.examples().start,
                detail: format!(
                    "{}'s part is not written whole (next example {next}, {left} left); the \
                     part is left resumable",
                    self.rank
                ),
            });
        }
        let Some((parts, _)) = &self.parts else {
            return status_of(&self.layout, None, true);
        };
        let committed = commit(&self.dir, &self.md, &self.layout, parts)?;
        status_of(&self.layout, Some(parts), committed)
    }
}

/// Commits the dataset in `dir` if every shard is durable and nobody has; true when it is
/// committed (now or before).
fn commit(dir: &Path, md: &Metadata, layout: &Layout, parts: &Parts) -> Result<bool> {
    let Some(_committing) = parts.commit_lock()? else {
        // Another rank committed and cleaned up while this one waited.
        return Ok(check_complete(dir, layout).is_ok());
    };
    if check_complete(dir, layout).is_ok() {
        // Committed by another rank (or by a run killed while cleaning up after it).
        clean_after_commit(dir, &dir.join(LABEL_PIECES), parts.clone())?;
        return Ok(true);
    }
    let done = parts.done()?;
    let n = layout.n_shards;
    if (0..n).any(|s| !done.contains_key(&Layout::shard_name(s))) {
        return Ok(false);
    }
    let with_labels = (0..n)
        .filter(|&s| done[&Layout::shard_name(s)].contains_key(&label_piece(s)))
        .count() as u64;
    if with_labels != 0 && with_labels != n {
        return Err(Error::format(
            dir,
            format!(
                "{with_labels} of {n} shards were written with labels: every rank must write \
                 labels, or none (rewrite the shards of the ranks that differed)"
            ),
        ));
    }
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
    }
    if with_labels == n {
        // labels.bin is the pieces in shard order, built beside and published whole.
        let p = layout.content_tokens;
        let labels = dir.join("labels.bin");
        let tmp = fsutil::temp_sibling(&labels);
        let f = fsutil::create_sized(&tmp, layout.n_examples * p)?;
        for s in 0..n {
            let piece = dir.join(label_piece(s));
            let bytes = fs::read(&piece).at(&piece)?;
            if FileSums::of_bytes(&bytes) != done[&Layout::shard_name(s)][&label_piece(s)] {
                return Err(Error::format(
                    &piece,
                    "does not match its record (the labels of a durable shard were changed)",
                ));
            }
            f.write_all_at(&bytes, s * layout.examples_per_shard * p)
                .at(&tmp)?;
        }
        fsutil::sync_file(&f, &tmp)?;
        drop(f);
        fsutil::publish(&tmp, &labels)?;
    }
    let counts: Vec<u64> = (0..n).map(|s| layout.shard_count(s)).collect();
    let shards_json = shards_json_bytes(&counts, md.count_key());
    files.record_bytes("shards.json", &shards_json);
    // The sidecar lists the dataset's files (private names, the pieces and records among
    // them, are not the dataset's), as a single writer's does.
    let pieces = dir.join(LABEL_PIECES);
    files.write_sidecar(dir)?;
    fsutil::atomic_write(&dir.join("shards.json"), &shards_json)?;
    // Committed: the rest is cleaning up, which a later open or status finishes if cut short.
    clean_after_commit(dir, &pieces, parts.clone())?;
    Ok(true)
}

fn clean_after_commit(dir: &Path, pieces: &Path, parts: Parts) -> Result<()> {
    // One labels piece a shard: removed several at a time, as the records are.
    fsutil::remove_dir_files_parallel(pieces)?;
    match fs::remove_file(dir.join(MARKER)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(Error::io(dir.join(MARKER), e))
        }
        _ => {}
    }
    parts.remove()?;
    fsutil::fsync_dir(dir)
}

fn status_of(layout: &Layout, parts: Option<&Parts>, committed: bool) -> Result<PartsStatus> {
    let (done, claimed) = match parts.filter(|_| !committed) {
        Some(p) => (
            p.done()?
                .keys()
                .filter_map(|n| shard_index(n))
                .filter(|&s| s < layout.n_shards)
                .collect(),
            p.live_claims()?,
        ),
        None if committed => ((0..layout.n_shards).collect(), Vec::new()),
        None => (Vec::new(), Vec::new()),
    };
    let mut st = PartsStatus::new(committed, layout.n_shards);
    (st.done, st.claimed) = (done, claimed);
    Ok(st)
}

/// Where the dataset at `dir` (a saev dataset directory) stands: committed, or which shards
/// are durable, which are claimed by live ranks, and what a restart would write. A dataset
/// whose every shard is durable but not committed (its last rank killed mid-commit) is
/// committed by [`commit_parts`].
pub fn status(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let dir = dir.as_ref();
    let (md, _) = Metadata::parse(
        &fsutil::read_json_file(&dir.join("metadata.json"))
            .map_err(|e| Error::io(dir.join("metadata.json"), e))?,
        &dir.join("metadata.json"),
    )?;
    let layout = Layout::new(&md, &dir.join("metadata.json"))?;
    let committed = check_complete(dir, &layout).is_ok();
    status_of(&layout, Parts::existing(dir).as_ref(), committed)
}

/// Commits the dataset at `dir` written in parts, when every shard is durable (a restart of
/// nothing: the ranks finished, the last was killed while committing). Returns its status.
pub fn commit_parts(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let dir = dir.as_ref();
    let md_path = dir.join("metadata.json");
    let (md, _) = Metadata::parse(
        &fsutil::read_json_file(&md_path).map_err(|e| Error::io(&md_path, e))?,
        &md_path,
    )?;
    let layout = Layout::new(&md, &md_path)?;
    let Some(parts) = Parts::existing(dir) else {
        return status(dir);
    };
    let _lock = WriteLock::dir_shared(dir)?;
    let committed = commit(dir, &md, &layout, &parts)?;
    status_of(&layout, Some(&parts), committed)
}
