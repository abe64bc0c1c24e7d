//! One cache (EAGLE-3 or DSpark) written by many processes ([`PartWriter`]), as NeMo's
//! distributed producer does: the sample count is known up front, and rank `r` of `W` writes the shards
//! [`part_of`]`(ceil(N/s), r of W)`, i.e. samples `first·s .. min(end·s, N)`, into the one
//! cache directory. The rank that completes the set commits it exactly as a single
//! [`Writer`](super::Writer) finishes: the checksum sidecar, then manifest.json. The committed
//! directory is byte-identical to a single process's.
//!
//! Unlike the single writer (which writes manifest.json first, so that a resume finds the
//! configuration), a write in parts keeps its configuration in `.shardkit-parts/eagle3.json`
//! and writes manifest.json **last**, as the commit record: a directory without it is no
//! cache to any reader (NeMo's included), and shardkit's readers and `validate` name it an
//! unfinished write in parts, with the shards still missing ([`unfinished`]). DSpark's
//! manifest carries its own commit record, the `complete` marker: in a directory, the first
//! rank writes it marked `false` beside the setup record (as NeMo's rank 0 does), and the
//! commit marks it `true`; in a store it is uploaded at the commit only.
//!
//! A DSpark directory NeMo's distributed producer began (its manifest written first with
//! `"complete": false`, some shards, perhaps `.tmp` leftovers) is finished by part writers of
//! the same configuration (any other is refused, naming the keys): as NeMo's own rerun does,
//! they write every shard of their blocks again, then commit. The other way round, NeMo's
//! producer finishes a directory shardkit's ranks began by writing everything again.
//!
//! The target weights file (EAGLE-3 `target_embeddings.safetensors`, DSpark
//! `target_weights.safetensors`), when the ranks declare it ([`PartOptions::target_embeddings`]),
//! is one more thing the commit waits for: any rank may write it (NeMo's producer writes it on
//! every run, before any shard; typically rank 0 does, or every rank with the same tables), the
//! first one writes it, and a later one whose tables differ is refused.
//!
//! Each shard is durable on its own: written through a temporary, fsynced, renamed, then its
//! record (`commit::parts`). A killed rank loses at most the shard it was filling; a restart,
//! with any world size, writes only the shards not recorded.
//!
//! `dir` may be an `s3://` URL: each rank then writes its shards in a local staging directory
//! (`commit::staging_dir` of the URL), uploads each under its final name, then its record;
//! the ranks coordinate through the store alone (`commit::parts_store`), the setup record is
//! created there conditionally, and the commit uploads the sidecar, then manifest.json last.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::manifest::{self, Manifest, MANIFEST};
use super::rules;
use super::shard::{self, field_specs, shard_index, shard_name, FieldSpec};
use super::weights::{self, WeightTable};
use crate::checksum::FileSums;
use crate::commit::parts::every_unit_listed;
use crate::commit::parts::CommitStart;
use crate::commit::parts::{
    commit_surviving_takeover, part_of, Claim, Parts, PartsStatus, Rank, UnitFiles, PARTS_DIR,
};
use crate::commit::{staging_dir, Files, Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::{self, Value};

/// The configuration of a write in parts, written by the first rank, checked by the others.
/// (Named before DSpark joined the family; it holds either member's manifest.)
const SETUP: &str = "eagle3.json";

/// Options of [`PartWriter::create`]; every rank of one cache must give the same.
#[derive(Debug, Clone)]
pub struct PartOptions {
    /// The `format_version` to write: 1 (the default) or 2 (see [`super::WriterOptions`]).
    pub version: u8,
    /// Whether the cache gets `target_embeddings.safetensors`: the commit then waits until a
    /// rank has written it ([`PartWriter::write_target_embeddings`]). Declared up front because
    /// the rank completing the shards cannot know whether another rank still means to write it.
    pub target_embeddings: bool,
}

impl Default for PartOptions {
    fn default() -> Self {
        PartOptions {
            version: 1,
            target_embeddings: false,
        }
    }
}

/// Writes rank `rank`'s part of a cache; see the module documentation.
pub struct PartWriter {
    /// Where shards are written: the dataset directory, or for a store the local staging.
    dir: PathBuf,
    /// The dataset's location: its directory, or its `s3://` URL.
    location: PathBuf,
    manifest: Manifest,
    specs: Vec<FieldSpec>,
    options: PartOptions,
    rank: Rank,
    /// This rank's shards.
    shards: Range<u64>,
    /// Samples still to write, in order (the part's, less the shards already durable).
    pending: Vec<Range<u64>>,
    /// Rows of the shard being filled, per field.
    bufs: Vec<Vec<u8>>,
    rows_buffered: u64,
    /// The parts state and this rank's claim; `None` when the cache was already committed.
    parts: Option<(Parts, Claim)>,
    /// The cache's prefix when writing to a store (`dir` is then where shards are staged).
    store: Option<Remote>,
    /// Held shared by every part writer of a local cache (a whole-cache writer holds it
    /// exclusively); in a store the claims and the cache's lock exclude each other.
    _lock: Option<WriteLock>,
}

/// Where a rank writing to a store stages its shards, under the cache's staging directory.
const PARTS_STAGING: &str = ".shardkit-parts";

impl std::fmt::Debug for PartWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWriter")
            .field("location", &self.location)
            .field("rank", &self.rank)
            .field("shards", &self.shards)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

/// The setup record's bytes: the manifest (as manifest.json will hold it) and the options.
fn setup_bytes(m: &Manifest, o: &PartOptions) -> Vec<u8> {
    let v = Value::Object(vec![
        (
            "manifest".into(),
            Value::String(String::from_utf8_lossy(&m.to_bytes()).into_owned()),
        ),
        ("target_embeddings".into(), Value::Bool(o.target_embeddings)),
    ]);
    json::to_compact(&v, true, json::Escape::Ascii).into_bytes()
}

/// The manifest and whether embeddings are declared, from a setup record.
fn parse_setup(bytes: &[u8], path: &Path) -> Result<(Manifest, bool)> {
    let v = json::parse(bytes).map_err(|e| Error::format(path, e.to_string()))?;
    let (Some(Value::String(text)), Some(Value::Bool(emb))) =
        (v.get("manifest"), v.get("target_embeddings"))
    else {
        return Err(Error::format(
            path,
            "a write in parts' setup record without `manifest` (text) and `target_embeddings` \
             (bool); it was damaged: delete the cache directory and write it again",
        ));
    };
    Ok((Manifest::parse(text.as_bytes(), path)?, *emb))
}

/// The keys of `theirs` that differ from `ours` (with `format_version` among them), for a
/// refusal.
fn differing(ours: &Manifest, theirs: &Manifest) -> Vec<String> {
    let mut keys = ours.differing_keys(theirs);
    if ours.format_version != theirs.format_version {
        keys.insert(0, "format_version".into());
    }
    keys
}

/// The refusal of a rank whose configuration differs from the one on disk.
fn mismatch(path: PathBuf, keys: &[String]) -> Error {
    Error::Exists {
        path,
        why: format!(
            "holds a cache of another configuration: manifest key(s) {} differ from this \
             rank's; every rank must give the same configuration (nothing was written)",
            keys.join(", ")
        ),
    }
}

/// The manifest a part writer writes: `config` with `num_samples` = `total` (added when
/// absent; a differing one is refused, naming the key).
/// Whether `dir/manifest.json` is a commit record: there, and not DSpark's `"complete": false`,
/// which NeMo's producer writes before its first shard (a manifest that does not parse counts
/// as there: readers report it).
fn committed_local(dir: &Path) -> bool {
    fs::read(dir.join(MANIFEST)).is_ok_and(|b| is_commit_record(&b))
}

/// [`committed_local`] of the cache at the store prefix `target`.
fn committed_store(target: &Remote) -> Result<bool> {
    Ok(target
        .get_opt(MANIFEST)?
        .is_some_and(|b| is_commit_record(&b)))
}

fn is_commit_record(bytes: &[u8]) -> bool {
    Manifest::parse(bytes, Path::new(MANIFEST)).map_or(true, |m| m.is_complete())
}

fn manifest_for(config: &Value, version: u8, total: u64) -> Result<Manifest> {
    let mut config = config.clone();
    match config.get("num_samples").map(Value::as_i64) {
        None => config.set("num_samples", Value::int(total)),
        Some(Some(n)) if u64::try_from(n) == Ok(total) => {}
        Some(_) => {
            return Err(Error::Invalid(format!(
                "manifest key \"num_samples\" ({}) differs from total_samples {total}",
                json::to_compact(
                    &config.get("num_samples").cloned().unwrap_or(Value::Null),
                    false,
                    json::Escape::Utf8
                )
            )))
        }
    }
    // Written at the commit only, so DSpark's marker is already the committed one.
    Manifest::for_writing(&config, version).map(|m| m.with_complete(true))
}

impl PartWriter {
    /// Opens rank `rank`'s part of the cache at `dir` (created by whichever rank comes first)
    /// for the run configuration `config` (as [`super::Writer::create`] takes it) of
    /// `total_samples` samples. Refused before anything is written when the directory holds a
    /// cache of another configuration (naming the differing manifest keys), when a whole-cache
    /// writer holds it, or when a live rank has claimed shards of this part (naming it).
    /// Shards already durable (an earlier run, with any world size) are kept:
    /// [`PartWriter::pending`] says what is left. After the commit, a rank writes nothing.
    pub fn create(
        dir: impl AsRef<Path>,
        config: &Value,
        options: PartOptions,
        total_samples: u64,
        rank: Rank,
    ) -> Result<PartWriter> {
        let m = manifest_for(config, options.version, total_samples)?;
        let dir = match Target::parse(dir.as_ref())? {
            Target::Local(dir) => dir,
            Target::Store(store) => return Self::create_store(store, m, options, rank),
        };
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Exists {
                path: dir,
                why: "exists and is not a directory".into(),
            });
        }
        fs::create_dir_all(&dir).at(&dir)?;
        let lock = WriteLock::dir_shared(&dir)?;
        let shards = part_of(m.num_shards(), rank);
        let mut w = PartWriter {
            specs: field_specs(&m),
            bufs: Vec::new(),
            location: dir.clone(),
            dir,
            manifest: m,
            options,
            rank,
            shards,
            pending: Vec::new(),
            rows_buffered: 0,
            parts: None,
            store: None,
            _lock: Some(lock),
        };
        w.bufs = w.specs.iter().map(|_| Vec::new()).collect();
        if w.committed_before()? {
            return Ok(w);
        }
        match w.join() {
            Ok(()) => Ok(w),
            // The rank completing the set committed meanwhile, removing the parts' state this
            // rank was reading: as if started after the commit (its configuration checked).
            Err(_) if committed_local(&w.dir) => {
                w.parts = None;
                w.pending.clear();
                w.committed_before()?;
                Ok(w)
            }
            Err(e) => Err(e),
        }
    }

    /// [`PartWriter::create`] of the cache at the store prefix `target`.
    fn create_store(
        target: Remote,
        m: Manifest,
        options: PartOptions,
        rank: Rank,
    ) -> Result<PartWriter> {
        let staged = staging_dir(&PathBuf::from(target.url())).join(PARTS_STAGING);
        fs::create_dir_all(&staged).at(&staged)?;
        let shards = part_of(m.num_shards(), rank);
        let mut w = PartWriter {
            specs: field_specs(&m),
            bufs: Vec::new(),
            location: PathBuf::from(target.url()),
            dir: staged,
            manifest: m,
            options,
            rank,
            shards,
            pending: Vec::new(),
            rows_buffered: 0,
            parts: None,
            store: Some(target.clone()),
            _lock: None,
        };
        w.bufs = w.specs.iter().map(|_| Vec::new()).collect();
        if w.committed_before_store(&target)? {
            return Ok(w);
        }
        let parts = Parts::open_store(&target)?;
        let Some(store) = parts.store() else {
            return Err(Error::Internal("internal: a store's parts state".into()));
        };
        // Refused before anything is written: a whole-cache writer, another configuration.
        store.refuse_single_writer()?;
        let setup = format!("{PARTS_DIR}/{SETUP}");
        if let Some(bytes) = store.create_setup(&setup, &setup_bytes(&w.manifest, &w.options))? {
            w.check_setup(&bytes, target.url_of(&setup))?;
        }
        let claim = parts.claim(w.shards.clone(), rank)?;
        // Looked at again once the claim is made (see saev's part writer).
        store.refuse_single_writer()?;
        w.parts = Some((parts, claim));
        w.plan()?;
        Ok(w)
    }

    /// Whether the cache at `target` was committed before this rank started (checked against
    /// this rank's configuration); finishes the cleanup of a commit cut short.
    fn committed_before_store(&self, target: &Remote) -> Result<bool> {
        let Some(bytes) = target.get_opt(MANIFEST)? else {
            return Ok(false);
        };
        let path = target.url_of(MANIFEST);
        let theirs = Manifest::parse(&bytes, &path)?;
        let keys = differing(&self.manifest, &theirs);
        if !keys.is_empty() {
            return Err(mismatch(path, &keys));
        }
        if !theirs.is_complete() {
            return Ok(false);
        }
        if let Some(parts) = Parts::existing_store(target)? {
            if let Some(_committing) = parts.commit_lock()? {
                clean_after_commit(parts)?;
            }
            return Ok(true);
        }
        if target.get_opt(crate::checksum::SIDECAR)?.is_some() {
            return Ok(true);
        }
        Err(Error::Exists {
            path: PathBuf::from(target.url()),
            why: "holds a cache a single eagle3 Writer started and did not finish; resume it \
                  with that Writer (resume), or write the parts elsewhere"
                .into(),
        })
    }

    /// Refuses a setup record (at `path`) of another configuration than this rank's.
    fn check_setup(&self, bytes: &[u8], path: PathBuf) -> Result<()> {
        let (theirs, emb) = parse_setup(bytes, &path)?;
        let keys = differing(&self.manifest, &theirs);
        if !keys.is_empty() {
            return Err(mismatch(path, &keys));
        }
        if emb != self.options.target_embeddings {
            return Err(Error::Exists {
                path,
                why: format!(
                    "the cache's ranks were started with target_embeddings {emb}, this one \
                     with {}; every rank must give the same options (nothing was written)",
                    self.options.target_embeddings
                ),
            });
        }
        Ok(())
    }

    /// Joins the write in parts: the setup record written or checked, this rank's shards
    /// claimed, and the pending samples planned.
    fn join(&mut self) -> Result<()> {
        let parts = Parts::open(&self.dir)?;
        // Ranks start together: one at a time checks (or writes) the setup record.
        let setting_up = parts.setup_lock()?;
        let setup = self.dir.join(PARTS_DIR).join(SETUP);
        match fsutil::read_json_file(&setup) {
            Ok(bytes) => self.check_setup(&bytes, setup)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A DSpark manifest marked incomplete records the run (checked above).
                if !shard::shard_set(&self.dir)?.is_empty() && !self.dir.join(MANIFEST).is_file() {
                    return Err(Error::Exists {
                        path: self.dir.clone(),
                        why: "has shards but neither manifest.json nor the state of a write in \
                          parts; refusing to write among them"
                            .into(),
                    });
                }
                fsutil::atomic_write(&setup, &setup_bytes(&self.manifest, &self.options))?;
                if self.manifest.schema().has_complete_marker()
                    && !self.dir.join(MANIFEST).is_file()
                {
                    // As NeMo's rank 0 does: the run's manifest, marked incomplete, so that a
                    // rerun of NeMo's producer checks its configuration against it (and may
                    // finish the cache). Readers refuse it until the commit marks it complete.
                    manifest::write(&self.dir, &self.manifest.with_complete(false))?;
                }
            }
            Err(e) => return Err(Error::io(&setup, e)),
        }
        drop(setting_up);
        let claim = parts.claim(self.shards.clone(), self.rank)?;
        self.parts = Some((parts, claim));
        self.plan()
    }

    /// Whether the cache was committed before this rank started (checked against this rank's
    /// configuration); finishes the cleanup of a commit cut short.
    fn committed_before(&self) -> Result<bool> {
        let path = self.dir.join(MANIFEST);
        let theirs = match manifest::read(&self.dir) {
            Ok(t) => t,
            Err(Error::NotFound { .. }) if !path.exists() => return Ok(false),
            Err(e) => return Err(e),
        };
        let keys = differing(&self.manifest, &theirs);
        if !keys.is_empty() {
            return Err(mismatch(path, &keys));
        }
        if !theirs.is_complete() {
            // A DSpark cache its producer (NeMo's, or a single shardkit writer) began: the
            // parts write the shards (again, as NeMo's rerun does) and commit it.
            return Ok(false);
        }
        if let Some(parts) = Parts::existing(&self.dir) {
            // manifest.json is the last thing a commit in parts writes: committed, and killed
            // while cleaning up.
            if let Some(_committing) = parts.commit_lock()? {
                clean_after_commit(parts)?;
            }
            return Ok(true);
        }
        let present = shard::shard_set(&self.dir)?;
        if shard::shard_set_problem(&present, self.manifest.num_shards()).is_none()
            && self.dir.join(crate::checksum::SIDECAR).is_file()
        {
            return Ok(true);
        }
        Err(Error::Exists {
            path: self.dir.clone(),
            why: format!(
                "holds a cache a single Writer started and did not finish ({} of {} \
                 shards); resume it with that Writer (resume), or write the parts elsewhere",
                present.len(),
                self.manifest.num_shards()
            ),
        })
    }

    /// Finds this part's shards still to write from the records, and removes what a killed
    /// rank left of them (a shard published without its record).
    fn plan(&mut self) -> Result<()> {
        let Some((parts, _)) = &self.parts else {
            return Ok(());
        };
        let done = parts.done()?;
        let intact = parts.intact_units(&done)?;
        let (s_size, n) = (self.manifest.shard_size, self.manifest.num_samples);
        for s in self.shards.clone() {
            let name = shard_name(s);
            if intact.contains(&name) {
                continue;
            }
            if done.contains_key(&name) {
                parts.forget(&name)?;
            }
            let p = self.dir.join(&name);
            match fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&p, e)),
                _ => {}
            }
            let r = s * s_size..((s + 1) * s_size).min(n);
            match self.pending.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => self.pending.push(r),
            }
        }
        Ok(())
    }

    /// The cache directory, or its `s3://` URL.
    pub fn path(&self) -> &Path {
        &self.location
    }
    /// This rank and world size.
    pub fn rank(&self) -> Rank {
        self.rank
    }
    /// The manifest the commit writes.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The tensors each sample needs (name, dtype, row shape).
    pub fn fields(&self) -> &[FieldSpec] {
        &self.specs
    }
    /// The samples this rank's part covers (its shards'), durable or not.
    pub fn samples(&self) -> Range<u64> {
        let (s, n) = (self.manifest.shard_size, self.manifest.num_samples);
        (self.shards.start * s).min(n)..(self.shards.end * s).min(n)
    }
    /// The samples still to write, in order: feed [`PartWriter::add`] exactly these (the
    /// writer moves from one range to the next by itself).
    pub fn pending(&self) -> &[Range<u64>] {
        &self.pending
    }
    /// The sample the next [`PartWriter::add`] begins at (`None` once the part is written).
    pub fn next_sample(&self) -> Option<u64> {
        self.pending.first().map(|r| r.start + self.rows_buffered)
    }

    /// Adds the next `n` samples of [`PartWriter::pending`], as [`super::Writer::add`] takes
    /// them (every stored tensor, every value checked). A shard is made durable as soon as it
    /// is full.
    pub fn add(&mut self, n: u64, fields: &[(&str, &[u8])]) -> Result<()> {
        let given = super::writer::given_fields(&self.specs, n, fields)?;
        if n == 0 {
            return Ok(());
        }
        let Some(first) = self.next_sample() else {
            return Err(Error::Invalid(if self.parts.is_none() {
                format!(
                    "{}: the cache is already committed; nothing is left to write",
                    self.location.display()
                )
            } else {
                format!(
                    "{}'s part is written whole; nothing is left to add",
                    self.rank
                )
            }));
        };
        let left = self.pending.iter().map(|r| r.end - r.start).sum::<u64>() - self.rows_buffered;
        if n > left {
            return Err(Error::Invalid(format!(
                "{n} more samples would pass the end of {}'s part ({left} left to write of \
                 samples {}..{})",
                self.rank,
                self.samples().start,
                self.samples().end
            )));
        }
        if let Some(breach) = rules::check(&self.manifest, &self.specs, &given).first() {
            return Err(breach.refusal(&self.dir, first));
        }
        let mut done = 0u64;
        while done < n {
            let at = self.next_sample().expect("samples are left, checked above");
            let s = at / self.manifest.shard_size;
            let want = self.manifest.rows_in_shard(s);
            let take = (want - self.rows_buffered).min(n - done);
            for (f, spec) in self.specs.iter().enumerate() {
                let rb = spec.row_bytes();
                self.bufs[f]
                    .extend_from_slice(&given[f][done as usize * rb..(done + take) as usize * rb]);
            }
            self.rows_buffered += take;
            done += take;
            if self.rows_buffered == want {
                self.publish_shard(s)?;
            }
        }
        Ok(())
    }

    /// Makes the full shard `s` durable: the file under its final name, then its record; and
    /// moves on past its samples.
    fn publish_shard(&mut self, s: u64) -> Result<()> {
        let rows = self.rows_buffered as usize;
        let name = shard_name(s);
        let path = self.dir.join(&name);
        shard::write_shard_rows(&path, &self.specs, &self.bufs, rows)?;
        let mut files = UnitFiles::new();
        files.insert(name.clone(), FileSums::of_file(&path)?);
        if let Some(store) = &self.store {
            // Uploaded under its final name (a PUT is atomic); the staged copy then goes.
            if let Some((_, claim)) = &self.parts {
                claim.check()?;
            }
            store.put_file(&name, &path)?;
            fs::remove_file(&path).at(&path)?;
        }
        let Some((parts, claim)) = self.parts.as_ref() else {
            return Err(Error::Internal(
                "internal: a shard published by a writer of a committed dataset".into(),
            ));
        };
        // Not recorded by a rank whose claim another took over (it may be writing this shard).
        claim.check()?;
        parts.record_done(&name, &files)?;
        for b in &mut self.bufs {
            b.clear();
        }
        self.rows_buffered = 0;
        let end = self
            .manifest
            .num_samples
            .min((s + 1) * self.manifest.shard_size);
        while self.pending.first().is_some_and(|r| r.end <= end) {
            self.pending.remove(0);
        }
        if let Some(r) = self.pending.first_mut() {
            r.start = r.start.max(end);
        }
        Ok(())
    }

    /// Writes the target weights file (see [`super::Writer::write_target_weights`]), once for
    /// the cache: the first rank to call it writes the file and records it; a later call (any
    /// rank, any run) with the same tables writes nothing, and one with other tables is
    /// refused. Only for a cache whose ranks declared [`PartOptions::target_embeddings`].
    pub fn write_target_weights(&self, tables: &[WeightTable<'_>]) -> Result<()> {
        let name = self.manifest.schema().weights_file();
        let path = self.dir.join(name);
        if !self.options.target_embeddings {
            return Err(Error::Invalid(format!(
                "{}: this cache's ranks were started without target_embeddings \
                 (target_weights in shardkit.dspark); start every rank with it to write the \
                 target weights in parts",
                path.display()
            )));
        }
        weights::check_tables(&self.manifest, tables)?;
        let tensors = weights::tensors(&self.manifest, tables);
        let differs = || Error::Exists {
            path: path.clone(),
            why: "was written by another rank with another table; every rank must give the \
                  same target weights"
                .into(),
        };
        let same = || {
            let holds = match &self.store {
                Some(store) => store
                    .get_opt(name)?
                    .is_some_and(|b| weights::bytes_hold(&b, &self.manifest, tables)),
                None => weights::file_holds(&path, &self.manifest, tables)?,
            };
            match holds {
                true => Ok(()),
                false => Err(differs()),
            }
        };
        let Some((parts, _)) = &self.parts else {
            // Committed: the table the cache holds must be this one.
            return same();
        };
        let written = (|| {
            let _writing = parts.lock_named("embeddings.lock")?;
            if let Some(files) = parts.done()?.get(name) {
                if parts.intact(name, files)? {
                    return same();
                }
                parts.forget(name)?;
            }
            shard::write_safetensors(&path, tensors)?;
            let mut files = UnitFiles::new();
            files.insert(name.to_string(), FileSums::of_file(&path)?);
            if let Some(store) = &self.store {
                store.put_file(name, &path)?;
                fs::remove_file(&path).at(&path)?;
            }
            parts.record_done(name, &files)
        })();
        match written {
            // Committed meanwhile (the table was recorded, and the parts' state is gone).
            Err(_) if self.committed_now()? => same(),
            r => r,
        }
    }

    /// EAGLE-3's `target_embeddings.safetensors`: one F32 table `weight` of `rows × cols`.
    pub fn write_target_embeddings(&self, data: &[u8], rows: u64, cols: u64) -> Result<()> {
        self.write_target_weights(&[WeightTable {
            name: "weight",
            rows,
            cols,
            data,
        }])
    }

    /// Ends this rank's part, then commits the cache if every shard (and the embeddings, when
    /// declared) is durable, waiting for a rank committing meanwhile. Refused, leaving the
    /// part resumable, when samples of the part are still pending. Returns where the cache
    /// stands: committed, or what other ranks still owe.
    pub fn finish(self) -> Result<PartsStatus> {
        if let Some(next) = self.next_sample() {
            let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
            let part = self.samples();
            return Err(Error::Incomplete {
                path: self.location.clone(),
                present: part.end - part.start - left,
                total: part.end - part.start,
                detail: format!(
                    "{}'s part is not written whole (next sample {next}, {left} left to add \
                     to whole shards); the shards written are durable and a restart writes \
                     the rest",
                    self.rank
                ),
            });
        }
        let Some((parts, _)) = &self.parts else {
            return status_of(&self.manifest, false, None, true);
        };
        let emb = self.options.target_embeddings;
        let committed = match &self.store {
            Some(store) => commit_store(store, &self.manifest, emb, parts)?,
            None => commit(&self.dir, &self.manifest, emb, parts)?,
        };
        match status_of(&self.manifest, emb, Some(parts), committed) {
            // Committed by another rank since (the parts' state read is gone).
            Err(_) if self.committed_now()? => status_of(&self.manifest, emb, None, true),
            st => st,
        }
    }

    /// Whether manifest.json, the commit record, is there now.
    fn committed_now(&self) -> Result<bool> {
        match &self.store {
            Some(store) => Ok(committed_store(store)?),
            None => Ok(committed_local(&self.dir)),
        }
    }
}

/// Commits the cache in `dir` if every shard (and the embeddings when `emb`) is durable and
/// nobody has; true when it is committed (now or before).
fn commit(dir: &Path, m: &Manifest, emb: bool, parts: &Parts) -> Result<bool> {
    let mut names: Vec<String> = (0..m.num_shards()).map(shard_name).collect();
    if emb {
        names.push(m.schema().weights_file().to_string());
    }
    let (_committing, done) = match parts.begin_commit(
        names.iter().cloned(),
        || Ok(committed_local(dir)),
        || clean_after_commit(parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let mut files = Files::default();
    for name in &names {
        if !parts.intact(name, &done[name])? {
            return Err(Error::format(
                dir.join(name),
                "recorded durable but missing or of another size (delete its record under \
                 .shardkit-parts/done and write it again)",
            ));
        }
        files.insert(name, done[name][name].clone());
    }
    // What killed ranks left (temporaries of shards written again since) goes: no rank is
    // writing now, every shard being durable.
    shard::remove_temporaries(dir)?;
    // The single writer's finish: the sidecar (covering manifest.json, hashed from the bytes
    // about to be written) then manifest.json, the commit record, last.
    let bytes = m.to_bytes();
    files.record_bytes(MANIFEST, &bytes);
    files.write_sidecar(dir)?;
    if dir.join(MANIFEST).is_file() {
        // A DSpark manifest its producer wrote marked incomplete: replaced so that the
        // sidecar ends up covering the new bytes alone.
        manifest::write(dir, m)?;
    } else {
        fsutil::atomic_write(&dir.join(MANIFEST), &bytes)?;
    }
    // Committed: the rest is cleaning up, which a later open, status or commit finishes.
    clean_after_commit(parts.clone())?;
    Ok(true)
}

/// [`commit`] in the store prefix `target`: the sidecar is built in a local directory of the
/// committer's and uploaded, then, the commit lock renewed, manifest.json.
fn commit_store(target: &Remote, m: &Manifest, emb: bool, parts: &Parts) -> Result<bool> {
    commit_surviving_takeover(
        || commit_store_once(target, m, emb, parts),
        || committed_store(target),
    )
}

/// One attempt of [`commit_store`].
fn commit_store_once(target: &Remote, m: &Manifest, emb: bool, parts: &Parts) -> Result<bool> {
    if !every_unit_listed(parts, (0..m.num_shards()).map(shard_name))? {
        // Or committed by another rank (its records removed, or being removed: finished here).
        if committed_store(target)? {
            clean_after_commit(parts.clone())?;
            return Ok(true);
        }
        return Ok(false);
    }
    let mut names: Vec<String> = (0..m.num_shards()).map(shard_name).collect();
    if emb {
        names.push(m.schema().weights_file().to_string());
    }
    let (committing, done) = match parts.begin_commit(
        names.iter().cloned(),
        || committed_store(target),
        || clean_after_commit(parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let sizes: std::collections::BTreeMap<String, u64> = target.list()?.into_iter().collect();
    let mut files = Files::default();
    for name in &names {
        let sums = &done[name][name];
        if sizes.get(name) != Some(&sums.bytes) {
            return Err(Error::format(
                target.url_of(name),
                "recorded durable but missing or of another size (delete its record under \
                 .shardkit-parts/done/ and write it again)",
            ));
        }
        files.insert(name, sums.clone());
    }
    let url = PathBuf::from(target.url());
    // The committer's own directory (another rank of this machine may stage shards beside).
    let dir = staging_dir(&url).join(format!(".shardkit-commit-{}", std::process::id()));
    match fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&dir, e)),
        _ => {}
    }
    fs::create_dir_all(&dir).at(&dir)?;
    let uploaded = (|| -> Result<()> {
        let bytes = m.to_bytes();
        files.record_bytes(MANIFEST, &bytes);
        let sidecar = files.write_sidecar(&dir)?;
        target.put_file(crate::checksum::SIDECAR, &sidecar)?;
        // Still this rank's commit (a committer stalled past its lease has lost it).
        committing.confirm()?;
        target.put(MANIFEST, bytes)
    })();
    let _ = fs::remove_dir_all(&dir);
    uploaded?;
    clean_after_commit(parts.clone())?;
    Ok(true)
}

fn clean_after_commit(parts: Parts) -> Result<()> {
    parts.clean_after_commit(&[], &[])
}

fn status_of(
    m: &Manifest,
    emb: bool,
    parts: Option<&Parts>,
    committed: bool,
) -> Result<PartsStatus> {
    let units = m.num_shards();
    match parts.filter(|_| !committed) {
        Some(p) => {
            let (mut st, done) = p.status(units, shard_index)?;
            let weights = m.schema().weights_file();
            if emb && !done.contains_key(weights) {
                st.missing_files.push(weights.to_string());
            }
            Ok(st)
        }
        None if committed => Ok(PartsStatus::committed(units)),
        None => Ok(PartsStatus::new(false, units)),
    }
}

/// The configuration of the write in parts in `dir`, when there is one.
fn setup_of(dir: &Path) -> Result<Option<(Manifest, bool, Parts)>> {
    let Some(parts) = Parts::existing(dir) else {
        return Ok(None);
    };
    let path = dir.join(PARTS_DIR).join(SETUP);
    match fsutil::read_json_file(&path) {
        Ok(bytes) => {
            let (m, emb) = parse_setup(&bytes, &path)?;
            Ok(Some((m, emb, parts)))
        }
        // Its first rank was killed before the setup record: nothing was written.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// The manifest of the unfinished write in parts in `dir` (no manifest.json yet), as its part
/// writers share it; `None` when `dir` holds none (committed, or not written in parts).
pub(super) fn setup_manifest(dir: &Path) -> Result<Option<Manifest>> {
    if committed_local(dir) {
        return Ok(None);
    }
    Ok(setup_of(dir)?.map(|(m, _, _)| m))
}

/// [`setup_manifest`] of the cache at the store prefix `target`.
pub(super) fn setup_manifest_store(target: &Remote) -> Result<Option<Manifest>> {
    if committed_store(target)? {
        return Ok(None);
    }
    Ok(setup_of_store(target)?.map(|(m, _, _)| m))
}

/// Where the cache at `dir` stands: committed, or which shards are durable, which are claimed
/// by live ranks (and by whom), whether the declared embeddings are still owed, and what a
/// restart would write. A cache whose every part is durable but not committed (its last rank
/// killed mid-commit) is committed by [`commit_parts`]. `dir` may be an `s3://` URL.
pub fn status(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let dir = match Target::parse(dir.as_ref())? {
        Target::Local(dir) => dir,
        Target::Store(target) => return status_store(&target),
    };
    let dir = dir.as_path();
    if committed_local(dir) {
        let m = manifest::read(dir)?;
        let complete = shard::shard_set_problem(&shard::shard_set(dir)?, m.num_shards()).is_none();
        return status_of(&m, false, None, complete);
    }
    let st = match setup_of(dir) {
        Ok(Some((m, emb, parts))) => status_of(&m, emb, Some(&parts), false),
        // A DSpark cache its producer began and did not mark complete, not written in parts.
        Ok(None) if dir.join(MANIFEST).is_file() => {
            status_of(&manifest::read(dir)?, false, None, false)
        }
        Ok(None) => Err(manifest::missing(dir)),
        Err(e) => Err(e),
    };
    match st {
        // Committed while it was being read (the parts' state removed).
        Err(_) if committed_local(dir) => status(dir),
        st => st,
    }
}

/// The configuration of the write in parts at the store prefix `target`, when there is one.
fn setup_of_store(target: &Remote) -> Result<Option<(Manifest, bool, Parts)>> {
    let Some(parts) = Parts::existing_store(target)? else {
        return Ok(None);
    };
    let name = format!("{PARTS_DIR}/{SETUP}");
    match target.get_opt(&name)? {
        Some(bytes) => {
            let (m, emb) = parse_setup(&bytes, &target.url_of(&name))?;
            Ok(Some((m, emb, parts)))
        }
        None => Ok(None),
    }
}

/// [`status`] of the cache at the store prefix `target`.
fn status_store(target: &Remote) -> Result<PartsStatus> {
    if let Some(bytes) = target.get_opt(MANIFEST)?.filter(|b| is_commit_record(b)) {
        let m = Manifest::parse(&bytes, &target.url_of(MANIFEST))?;
        let present: std::collections::BTreeSet<u64> = target
            .list()?
            .iter()
            .filter_map(|(n, _)| shard_index(n))
            .collect();
        let complete = shard::shard_set_problem(&present, m.num_shards()).is_none();
        return status_of(&m, false, None, complete);
    }
    match setup_of_store(target)? {
        Some((m, emb, parts)) => status_of(&m, emb, Some(&parts), false),
        None => Err(Error::NotFound {
            path: target.url_of(MANIFEST),
            what: "no EAGLE-3 or DSpark cache (no manifest.json) nor a write of one in parts"
                .into(),
        }),
    }
}

/// Commits the cache at `dir` written in parts when every part is durable (the ranks
/// finished, the last was killed while committing). Returns its status. `dir` may be an
/// `s3://` URL.
pub fn commit_parts(dir: impl AsRef<Path>) -> Result<PartsStatus> {
    let dir = match Target::parse(dir.as_ref())? {
        Target::Local(dir) => dir,
        Target::Store(target) => {
            let Some((m, emb, parts)) = setup_of_store(&target)? else {
                if let Some(parts) = Parts::existing_store(&target)? {
                    if committed_store(&target)? {
                        if let Some(_committing) = parts.commit_lock()? {
                            clean_after_commit(parts)?;
                        }
                    }
                }
                return status_store(&target);
            };
            let committed = commit_store(&target, &m, emb, &parts)?;
            return status_of(&m, emb, Some(&parts), committed);
        }
    };
    let dir = dir.as_path();
    let Some((m, emb, parts)) = setup_of(dir)? else {
        if let Some(parts) = Parts::existing(dir).filter(|_| committed_local(dir)) {
            let _lock = WriteLock::dir_shared(dir)?;
            if let Some(_committing) = parts.commit_lock()? {
                clean_after_commit(parts)?;
            }
        }
        return status(dir);
    };
    let _lock = WriteLock::dir_shared(dir)?;
    let committed = commit(dir, &m, emb, &parts)?;
    status_of(&m, emb, Some(&parts), committed)
}

/// The error for reading `dir` while it is an unfinished write in parts (no manifest.json
/// yet), naming what is missing; `None` when it is not one.
pub(crate) fn unfinished(dir: &Path) -> Option<Error> {
    let (m, emb, parts) = match Target::parse(dir).ok()? {
        Target::Store(target) => {
            if committed_store(&target).ok()? {
                return None;
            }
            setup_of_store(&target).ok()??
        }
        Target::Local(_) => {
            if committed_local(dir) {
                return None;
            }
            setup_of(dir).ok()??
        }
    };
    let st = status_of(&m, emb, Some(&parts), false).ok()?;
    let present: u64 = st.done.iter().map(|&s| m.rows_in_shard(s)).sum();
    let mut missing: Vec<String> = st
        .missing()
        .iter()
        .map(|r| match r.end - r.start {
            1 => shard_name(r.start),
            _ => format!("{} to {}", shard_name(r.start), shard_name(r.end - 1)),
        })
        .collect();
    missing.extend(st.missing_files.iter().cloned());
    Some(Error::Incomplete {
        path: dir.to_path_buf(),
        present,
        total: m.num_samples,
        detail: format!(
            "{} cache being written in parts, not committed (manifest.json is written last, \
             once every part is durable); missing: {}; `shardkit {} status` says more",
            m.schema().a(),
            if missing.is_empty() {
                format!(
                    "nothing (its last rank was killed while committing: commit it with \
                     `shardkit {} status --commit`)",
                    m.schema().name()
                )
            } else {
                missing.join(", ")
            },
            m.schema().name()
        ),
    })
}
