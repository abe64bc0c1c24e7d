//! One flat-tokens split written by many processes ([`PartWriter`]): the caller knows how many
//! sequences (documents) the split gets, they are cut into units of
//! [`PartOptions::sequences_per_unit`], and rank `r` of `W` writes the units
//! [`part_of`]`(ceil(total / per_unit), r of W)`, i.e. sequences
//! `first·per_unit .. min(end·per_unit, total)`, in order.
//!
//! A split's token count is not known until every sequence is, and its chunks cut across
//! sequences, so the ranks cannot write the zarr arrays themselves. Each unit is instead
//! durable on its own as a private piece (`.shardkit-parts/<split>/pieces/UNIT.tokens`: the
//! unit's token ids and sequence lengths, written through a temporary, fsynced, renamed, then
//! recorded with `commit::parts`). The rank that completes the set commits: it replays the
//! pieces in unit order through the single [`Writer`] (one sequential read of the pieces, the
//! normal encode and write) and finishes it, so the committed split (every file, the checksum
//! sidecar included) is byte-identical by construction to what one `Writer` writes from the
//! same sequences with the same layout, and the commit is as crash-safe as that writer: a
//! commit killed midway is resumed (by [`commit_parts`] or any rank's finish) from the
//! writer's last checkpoint. Until it finishes, the root says `write_completed: false` (or the
//! split does not exist), so readers never see a partial split.
//!
//! ```text
//! DS.zarr/.shardkit-parts/commit.lock              one split's commit at a time (they share
//!                                                  the root group and its sidecar)
//! DS.zarr/.shardkit-parts/<split>/flat_tokens.json the configuration, written by the first rank
//! DS.zarr/.shardkit-parts/<split>/pieces/          one piece a durable unit
//! DS.zarr/.shardkit-parts/<split>/{claims,done}/   commit::parts' claims and unit records
//! ```
//!
//! A piece is little-endian: the 8 bytes `SKFTPART`, u32 version 1, u32 0, u64 sequences,
//! u64 tokens, the token ids (u32 each), then the sequence lengths (u64 each).
//!
//! The root may be an `s3://bucket/prefix` URL (a new prefix; its dataset holds the one split):
//! the same state is kept as objects under `.shardkit-parts/<split>/` (see [`store`]), each piece
//! staged locally then uploaded, and the commit fetches the pieces in unit order and replays
//! them through the [`Writer`] streaming to the store.

mod store;

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::Array;
use zarrs::filesystem::FilesystemStore;

use super::layout::{Layout, Sharded};
use super::store::{Completion, ZarrFormat};
use super::writer::{Writer, WriterOptions, MAX_TOKEN_ID};
use crate::checksum::{FileSums, SIDECAR};
use crate::commit::parts::CommitStart;
use crate::commit::parts::{part_of, Claim, Parts, PartsStatus, Rank, UnitFiles, PARTS_DIR};
use crate::commit::{Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::Remote;
use crate::json::{self, Value};

/// The configuration record of a split's write in parts.
const SETUP: &str = "flat_tokens.json";
const MAGIC: &[u8; 8] = b"SKFTPART";
const HEADER: u64 = 32;
/// Tokens the commit hands the writer per append.
const REPLAY_TOKENS: u64 = 1 << 22;

/// Options of [`PartWriter::create`]; every rank of one split must give the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartOptions {
    /// The split's layout, as [`WriterOptions::layout`]: `None` takes an existing dataset's
    /// format (a new one gets [`Layout::default`]).
    pub layout: Option<Layout>,
    /// Sequences per unit, the block a rank makes durable at once and a killed rank loses at
    /// most: 65,536 by default (the unit's token ids stream to its piece; only its lengths,
    /// 8 bytes a sequence, are held in memory).
    pub sequences_per_unit: u64,
}

impl Default for PartOptions {
    fn default() -> Self {
        PartOptions {
            layout: None,
            sequences_per_unit: 65_536,
        }
    }
}

/// What every rank must agree on, recorded by the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Setup {
    total: u64,
    per_unit: u64,
    layout: Layout,
}

impl Setup {
    fn units(&self) -> u64 {
        self.total.div_ceil(self.per_unit)
    }

    /// The sequences of unit `u`.
    fn unit_seqs(&self, u: u64) -> Range<u64> {
        (u * self.per_unit).min(self.total)..((u + 1) * self.per_unit).min(self.total)
    }

    fn to_json(self) -> Value {
        let mut v = vec![
            ("total_sequences".into(), Value::int(self.total)),
            ("sequences_per_unit".into(), Value::int(self.per_unit)),
        ];
        match self.layout {
            Layout::V2 => v.push(("layout".into(), Value::String("v2".into()))),
            Layout::V3(s) => {
                v.push(("layout".into(), Value::String("v3".into())));
                v.push(("tokens_per_shard".into(), Value::int(s.tokens_per_shard)));
                v.push(("tokens_per_chunk".into(), Value::int(s.tokens_per_chunk)));
                v.push(("starts_per_shard".into(), Value::int(s.starts_per_shard)));
                v.push(("starts_per_chunk".into(), Value::int(s.starts_per_chunk)));
                v.push(("zstd_level".into(), Value::int(s.zstd_level)));
            }
        }
        Value::Object(v)
    }

    fn parse(bytes: &[u8], path: &Path) -> Result<Setup> {
        let bad = |why: String| {
            Error::format(path, format!("the configuration of a write in parts {why} (written whole by the first rank: it was damaged)"))
        };
        let v = json::parse(bytes).map_err(|_| bad("is not JSON".into()))?;
        let num = |k: &str| -> Result<i64> {
            v.get(k)
                .and_then(Value::as_i64)
                .ok_or_else(|| bad(format!("has no integer {k:?}")))
        };
        let layout = match v.get("layout").and_then(Value::as_str) {
            Some("v2") => Layout::V2,
            Some("v3") => Layout::V3(Sharded {
                tokens_per_shard: num("tokens_per_shard")? as u64,
                tokens_per_chunk: num("tokens_per_chunk")? as u64,
                starts_per_shard: num("starts_per_shard")? as u64,
                starts_per_chunk: num("starts_per_chunk")? as u64,
                zstd_level: num("zstd_level")? as i32,
            }),
            _ => return Err(bad("has no layout \"v2\" or \"v3\"".into())),
        };
        Ok(Setup {
            total: num("total_sequences")? as u64,
            per_unit: num("sequences_per_unit")?.max(1) as u64,
            layout,
        })
    }
}

/// The first key whose value differs between two configurations.
fn differing_key(ours: &Value, theirs: &Value) -> Option<String> {
    let (Value::Object(a), Value::Object(b)) = (ours, theirs) else {
        return Some("(the whole document)".into());
    };
    a.iter()
        .find(|(k, v)| theirs.get(k) != Some(v))
        .or_else(|| b.iter().find(|(k, _)| ours.get(k).is_none()))
        .map(|(k, _)| k.clone())
}

fn unit_name(u: u64) -> String {
    format!("{u:09}")
}

fn piece_rel(u: u64) -> String {
    format!("pieces/{u:09}.tokens")
}

fn parse_unit(name: &str) -> Option<u64> {
    (name.len() == 9).then(|| name.parse().ok()).flatten()
}

/// The unit being written: its piece's temporary, the tokens streamed so far, its lengths.
struct OpenPiece {
    unit: u64,
    file: BufWriter<File>,
    tmp: PathBuf,
    tokens: u64,
    lengths: Vec<u64>,
}

/// Writes rank `rank`'s part of one flat-tokens split; see the module documentation.
///
/// ```no_run
/// use shardkit::flat_tokens::{PartOptions, PartWriter};
/// use shardkit::Rank;
/// let docs: Vec<Vec<u32>> = (0..1000u32).map(|d| vec![d + 1; 5]).collect();
/// let mut w = PartWriter::create("DS.zarr", "train", 1000, PartOptions::default(), Rank::from_env()?)?;
/// for r in w.pending().to_vec() {
///     w.append(&docs[r.start as usize..r.end as usize])?;
/// }
/// let status = w.finish()?; // committed when this rank completed the set
/// # Ok::<(), shardkit::Error>(())
/// ```
pub struct PartWriter {
    root: PathBuf,
    split: String,
    setup: Setup,
    rank: Rank,
    units: Range<u64>,
    pending: Vec<Range<u64>>,
    next: Option<u64>,
    piece: Option<OpenPiece>,
    /// `None` when the split was committed before this rank started (nothing is written).
    parts: Option<(Parts, Claim)>,
    /// The dataset's prefix when writing to a store (`root` is then its URL).
    store: Option<Remote>,
    /// Where pieces are made: the split's parts directory, or for a store a local staging one
    /// (both with `pieces/` under it).
    stage: PathBuf,
    /// Held shared by every part writer of a local dataset (a whole-dataset writer holds it
    /// exclusively); in a store the claims and the dataset lock exclude each other.
    _lock: Option<WriteLock>,
}

impl std::fmt::Debug for PartWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartWriter")
            .field("root", &self.root)
            .field("split", &self.split)
            .field("rank", &self.rank)
            .field("units", &self.units)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

fn parts_dir(root: &Path, split: &str) -> PathBuf {
    root.join(PARTS_DIR).join(split)
}

/// The sequences in `split` of the dataset at `root`; `None` when the split does not exist.
fn split_seqs(root: &Path, split: &str) -> Result<Option<u64>> {
    if ZarrFormat::of_group(&root.join(split)).is_none() {
        return Ok(None);
    }
    super::delta::register();
    let fs = FilesystemStore::new(root).map_err(|e| Error::Invalid(e.to_string()))?;
    let a = Array::open(Arc::new(fs), &format!("/{split}/seq_starts")).map_err(|e| {
        Error::format(
            root.join(split).join("seq_starts"),
            format!("cannot open: {e}"),
        )
    })?;
    Ok(Some(a.shape()[0].saturating_sub(1)))
}

/// Whether `split` is committed with `total` sequences: the root complete, its sidecar
/// written (a writer's finish writes it last), the split whole.
fn committed(root: &Path, split: &str, total: u64) -> Result<bool> {
    let Some(n) = split_seqs(root, split)? else {
        return Ok(false);
    };
    let fs = FilesystemStore::new(root).map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(n == total
        && Completion::read(Arc::new(fs)) == Completion::Complete
        && root.join(SIDECAR).is_file())
}

fn check_split(split: &str) -> Result<()> {
    if split != "train" && split != "validation" {
        return Err(Error::Invalid(format!(
            "split must be \"train\" or \"validation\", got {split:?}"
        )));
    }
    Ok(())
}

impl PartWriter {
    /// Opens rank `rank`'s part of `split` (of `total_sequences` sequences) of the dataset at
    /// `root` (a local directory, created by whichever rank comes first). Refused, before any
    /// byte is written, when the ranks' configurations differ (naming the first key that does),
    /// when the split exists and is not this write in parts, when a whole-dataset writer holds
    /// the dataset, or when a live rank has claimed units of this part. Units already durable
    /// (an earlier run, with any world size) are kept: [`PartWriter::pending`] says what is
    /// left. A rank started after the commit writes nothing.
    pub fn create(
        root: impl AsRef<Path>,
        split: &str,
        total_sequences: u64,
        options: PartOptions,
        rank: Rank,
    ) -> Result<PartWriter> {
        check_split(split)?;
        if options.sequences_per_unit == 0 {
            return Err(Error::Invalid(
                "sequences_per_unit must be at least 1".into(),
            ));
        }
        let root = match Target::parse(root.as_ref())? {
            Target::Local(root) => root,
            Target::Store(target) => {
                let setup = Setup {
                    total: total_sequences,
                    per_unit: options.sequences_per_unit,
                    // A new prefix: no existing format to continue.
                    layout: options.layout.unwrap_or_default(),
                };
                return store::create(target, split, setup, rank);
            }
        };
        let layout = resolve_layout(&root, options.layout)?;
        let setup = Setup {
            total: total_sequences,
            per_unit: options.sequences_per_unit,
            layout,
        };
        fs::create_dir_all(&root).at(&root)?;
        let lock = WriteLock::dir_shared(&root)?;
        let mut w = PartWriter {
            units: part_of(setup.units(), rank),
            stage: parts_dir(&root, split),
            root,
            split: split.to_string(),
            setup,
            rank,
            pending: Vec::new(),
            next: None,
            piece: None,
            parts: None,
            store: None,
            _lock: Some(lock),
        };
        let dir = parts_dir(&w.root, split);
        if !dir.is_dir() {
            if let Some(n) = split_seqs(&w.root, split)? {
                if committed(&w.root, split, total_sequences)? {
                    return Ok(w); // committed before this rank started: nothing to write
                }
                return Err(Error::Exists {
                    path: w.root.join(split),
                    why: format!(
                        "the split already holds {n} sequences and is not being written in \
                         parts; refusing to write parts of {total_sequences} sequences into it"
                    ),
                });
            }
        }
        let parts = Parts::open_in(&dir)?;
        // Ranks start together: one at a time checks (or writes) the configuration.
        let setting_up = parts.setup_lock()?;
        let path = dir.join(SETUP);
        let ours = setup.to_json();
        match fsutil::read_json_file(&path) {
            Ok(bytes) => {
                if let Some(e) = mismatch(path, &ours, &bytes) {
                    return Err(e);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fsutil::atomic_write(
                    &path,
                    json::to_compact(&ours, false, json::Escape::Ascii).as_bytes(),
                )?;
            }
            Err(e) => return Err(Error::io(&path, e)),
        }
        drop(setting_up);
        if committed(&w.root, split, total_sequences)? {
            // Committed while this rank started, or killed while cleaning up after.
            if let Some(_committing) = parts.commit_lock()? {
                clean_after_commit(&w.root, split, parts)?;
            }
            return Ok(w);
        }
        let claim = parts.claim(w.units.clone(), rank)?;
        w.parts = Some((parts, claim));
        w.plan()?;
        Ok(w)
    }

    /// Finds this part's units still to write from the records, and removes what a killed
    /// rank left of them (a temporary, a piece without its record).
    fn plan(&mut self) -> Result<()> {
        let Some(parts) = self.parts.as_ref().map(|(p, _)| p.clone()) else {
            return Ok(());
        };
        let done = parts.done()?;
        let dir = self.stage.clone();
        fs::create_dir_all(dir.join("pieces")).at(dir.join("pieces"))?;
        // In a store, the pieces there (one listing), by name relative to the state.
        let uploaded = match &self.store {
            Some(target) => Some(store::piece_sizes(target, &self.split)?),
            None => None,
        };
        for u in self.units.clone() {
            let rel = piece_rel(u);
            let path = dir.join(&rel);
            if let Some(files) = done.get(&unit_name(u)) {
                let len = match &uploaded {
                    Some(sizes) => sizes.get(&rel).copied(),
                    None => fsutil::regular_file_len(&path),
                };
                let intact = files.get(&rel).is_some_and(|s| len == Some(s.bytes));
                if intact {
                    continue;
                }
                parts.forget(&unit_name(u))?;
            }
            for p in [path.clone(), fsutil::temp_sibling(&path)] {
                match fs::remove_file(&p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(Error::io(&p, e))
                    }
                    _ => {}
                }
            }
            let r = self.setup.unit_seqs(u);
            match self.pending.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => self.pending.push(r),
            }
        }
        self.next = self.pending.first().map(|r| r.start);
        Ok(())
    }

    /// The dataset root.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// This rank and world size.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The sequences this rank's part covers (its units'), durable or not.
    pub fn sequences(&self) -> Range<u64> {
        let s = &self.setup;
        (self.units.start * s.per_unit).min(s.total)..(self.units.end * s.per_unit).min(s.total)
    }

    /// The sequences still to write, in order: feed [`PartWriter::append`] exactly these (the
    /// writer moves from one range to the next by itself).
    pub fn pending(&self) -> &[Range<u64>] {
        &self.pending
    }

    /// The sequence the next [`PartWriter::append`] begins at (`None` once the part is written).
    pub fn next_sequence(&self) -> Option<u64> {
        self.next
    }

    /// Appends the next sequences of [`PartWriter::pending`] (token ids, as
    /// [`Writer::append`]: ids above [`MAX_TOKEN_ID`] are refused before anything is written).
    /// Each unit completed is made durable.
    pub fn append<S: AsRef<[u32]>>(&mut self, sequences: &[S]) -> Result<()> {
        if sequences.is_empty() {
            return Ok(());
        }
        if self.parts.is_none() {
            return Err(Error::Invalid(format!(
                "{}: split {:?} is already committed; nothing is left to write",
                self.root.display(),
                self.split
            )));
        }
        let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
        let b = sequences.len() as u64;
        if b > left {
            let r = self.sequences();
            return Err(Error::Invalid(format!(
                "{b} more sequences would pass the end of {}'s part ({left} left to write of \
                 sequences {}..{})",
                self.rank, r.start, r.end
            )));
        }
        for (i, s) in sequences.iter().enumerate() {
            if let Some(j) = s.as_ref().iter().position(|&id| id > MAX_TOKEN_ID) {
                return Err(Error::Refused {
                    path: self.root.join(&self.split),
                    field: "token ids".into(),
                    at: format!("sequence {i} of this append, position {j}"),
                    value: s.as_ref()[j].to_string(),
                    allowed: format!(
                        "0 to {MAX_TOKEN_ID} (below 2^31, as 2*id+1 must fit the uint32 \
                         encoding)"
                    ),
                });
            }
        }
        let mut bytes = Vec::new();
        for s in sequences {
            let next = self.next.expect("sequences are left, checked above");
            let unit = next / self.setup.per_unit;
            if self.piece.is_none() {
                let tmp = fsutil::temp_sibling(&self.stage.join(piece_rel(unit)));
                let mut file = BufWriter::with_capacity(1 << 20, File::create(&tmp).at(&tmp)?);
                file.write_all(&[0u8; HEADER as usize]).at(&tmp)?;
                self.piece = Some(OpenPiece {
                    unit,
                    file,
                    tmp,
                    tokens: 0,
                    lengths: Vec::new(),
                });
            }
            let p = self.piece.as_mut().expect("opened above");
            let s = s.as_ref();
            bytes.clear();
            bytes.extend(s.iter().flat_map(|t| t.to_le_bytes()));
            p.file.write_all(&bytes).at(&p.tmp)?;
            p.tokens += s.len() as u64;
            p.lengths.push(s.len() as u64);
            let full = p.lengths.len() as u64
                == self.setup.unit_seqs(unit).end - unit * self.setup.per_unit;
            self.advance();
            if full {
                self.publish_piece()?;
            }
        }
        Ok(())
    }

    /// Moves the next sequence one on, into the next pending range when one ends.
    fn advance(&mut self) {
        let Some(next) = self.next else { return };
        let at = next + 1;
        while self.pending.first().is_some_and(|r| r.end <= at) {
            self.pending.remove(0);
        }
        if let Some(r) = self.pending.first_mut() {
            r.start = r.start.max(at);
        }
        self.next = self.pending.first().map(|r| r.start);
    }

    /// Makes the full unit durable: its piece under its final name, then its record.
    fn publish_piece(&mut self) -> Result<()> {
        let Some(p) = self.piece.take() else {
            return Ok(());
        };
        let OpenPiece {
            unit,
            mut file,
            tmp,
            tokens,
            lengths,
        } = p;
        let tail: Vec<u8> = lengths.iter().flat_map(|l| l.to_le_bytes()).collect();
        file.write_all(&tail).at(&tmp)?;
        let file = file
            .into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?;
        let mut header = Vec::with_capacity(HEADER as usize);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&1u32.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&(lengths.len() as u64).to_le_bytes());
        header.extend_from_slice(&tokens.to_le_bytes());
        file.write_all_at(&header, 0).at(&tmp)?;
        let rel = piece_rel(unit);
        let Some((parts, claim)) = self.parts.as_ref() else {
            return Err(Error::Internal(
                "internal: a piece made by a writer of a committed split".into(),
            ));
        };
        let mut files = UnitFiles::new();
        if let Some(target) = &self.store {
            // Uploaded under its final name (a PUT is atomic), not by a rank whose claim was
            // taken over (another may be writing this unit); the staged copy then goes (no
            // fsync: the store holds it).
            drop(file);
            claim.check()?;
            files.insert(rel.clone(), FileSums::of_file(&tmp)?);
            target.put_file(&store::object(&self.split, &rel), &tmp)?;
            fs::remove_file(&tmp).at(&tmp)?;
            claim.check()?;
        } else {
            fsutil::sync_data(&file, &tmp)?;
            drop(file);
            let path = self.stage.join(&rel);
            fsutil::publish(&tmp, &path)?;
            files.insert(rel.clone(), FileSums::of_file(&path)?);
        }
        parts.record_done(&unit_name(unit), &files)
    }

    /// Ends this rank's part, then commits the split if every unit is durable (waiting for a
    /// rank committing meanwhile). Refused, leaving the part resumable, when sequences of the
    /// part are still pending. Returns where the split stands: committed, or the units other
    /// ranks still owe.
    pub fn finish(self) -> Result<PartsStatus> {
        if let Some(next) = self.next {
            let left: u64 = self.pending.iter().map(|r| r.end - r.start).sum();
            let r = self.sequences();
            return Err(Error::Incomplete {
                path: self.root.join(&self.split),
                present: r.end - r.start - left,
                total: r.end - r.start,
                detail: format!(
                    "{}'s part is not written whole (next sequence {next}, {left} left); the \
                     part is left resumable",
                    self.rank
                ),
            });
        }
        let Some((parts, _claim)) = &self.parts else {
            return status_of(&self.setup, None, true);
        };
        let done = match &self.store {
            Some(target) => store::commit(target, &self.split, &self.setup, parts)?,
            None => commit(&self.root, &self.split, &self.setup, parts)?,
        };
        status_of(&self.setup, Some(parts), done)
    }
}

fn json_text(v: &Value) -> String {
    json::to_compact(v, false, json::Escape::Utf8)
}

/// The refusal of a rank whose configuration `ours` differs from the recorded one (`theirs`,
/// at `path`), naming the first key that does; `None` when they agree.
fn mismatch(path: PathBuf, ours: &Value, theirs: &[u8]) -> Option<Error> {
    let theirs = json::parse(theirs).unwrap_or(Value::Null);
    let key = differing_key(ours, &theirs)?;
    Some(Error::Exists {
        path,
        why: format!(
            "the split's other ranks were started with another {key:?} ({}; this rank: {}); \
             every rank must give the same total_sequences and options (nothing was written)",
            theirs.get(&key).map(json_text).unwrap_or("absent".into()),
            ours.get(&key).map(json_text).unwrap_or("absent".into()),
        ),
    })
}

/// The layout the split gets: as [`Writer::create`] decides it, checked against an existing
/// dataset's format up front (the commit would refuse it only at the end).
fn resolve_layout(root: &Path, asked: Option<Layout>) -> Result<Layout> {
    let fmt = |l: &Layout| match l {
        Layout::V2 => ZarrFormat::V2,
        Layout::V3(_) => ZarrFormat::V3,
    };
    match (ZarrFormat::of_group(root), asked) {
        (Some(f), Some(l)) if f != fmt(&l) => Err(Error::Invalid(format!(
            "{}: the dataset is zarr {}; it cannot take a {} split (leave the layout unset to \
             continue in its format)",
            root.display(),
            f.name(),
            fmt(&l).name()
        ))),
        (_, Some(l)) => Ok(l),
        (Some(ZarrFormat::V2), None) => Ok(Layout::V2),
        (_, None) => Ok(Layout::default()),
    }
}

/// Serialises the commits of a dataset's splits (they rewrite the root group and its sidecar):
/// `.shardkit-parts/commit.lock`, removed with the directory by the last split's cleanup.
fn root_commit_lock(root: &Path) -> Result<WriteLock> {
    let dir = root.join(PARTS_DIR);
    let path = dir.join("commit.lock");
    loop {
        fs::create_dir_all(&dir).at(&dir)?;
        let lock = match WriteLock::waiting(&path) {
            Ok(l) => l,
            Err(_) if !dir.is_dir() => continue, // removed meanwhile: make it again
            Err(e) => return Err(e),
        };
        // A cleanup that removed the file while this one waited on it: lock the one now there.
        let held = lock.file().metadata().at(&path)?;
        match fs::metadata(&path) {
            Ok(m) if m.ino() == held.ino() && m.dev() == held.dev() => return Ok(lock),
            _ => continue,
        }
    }
}

/// Test hook: the commit stops (as if killed) after replaying this many units, once.
#[cfg(feature = "fault-injection")]
pub(crate) static STOP_COMMIT_AFTER_UNITS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(u64::MAX);

/// With fault injection, stops a commit after unit `u` as a kill there would (the writer
/// checkpointed, the split at `at` left unfinished).
#[cfg(feature = "fault-injection")]
fn stop_after(w: &mut Writer, u: u64, at: &Path) -> Result<()> {
    use std::sync::atomic::Ordering;
    if STOP_COMMIT_AFTER_UNITS.load(Ordering::SeqCst) == u + 1 {
        STOP_COMMIT_AFTER_UNITS.store(u64::MAX, Ordering::SeqCst);
        w.flush()?;
        return Err(Error::Internal(format!(
            "injected fault: the commit of {} stopped after unit {u}",
            at.display()
        )));
    }
    Ok(())
}

/// Finishes the commit's writer once every unit is replayed, checking that the split at `at`
/// holds the `total` sequences the ranks were given.
fn finish_replayed(w: Writer, total: u64, at: &Path) -> Result<()> {
    if w.seq_count() != total {
        return Err(Error::format(
            at,
            format!(
                "holds {} sequences after the commit replayed every unit, not {total}; the \
                 split is not committed",
                w.seq_count()
            ),
        ));
    }
    w.finish().map(|_| ())
}

/// Commits `split` if every unit is durable and nobody has; true when it is committed (now or
/// before).
fn commit(root: &Path, split: &str, setup: &Setup, parts: &Parts) -> Result<bool> {
    let n = setup.units();
    let (_committing, done) = match parts.begin_commit(
        (0..n).map(unit_name),
        || committed(root, split, setup.total),
        || clean_after_commit(root, split, parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let splits = root_commit_lock(root)?;
    let options = WriterOptions {
        layout: Some(setup.layout),
        resume: true,
        ..WriterOptions::default()
    };
    let mut w = Writer::create_local(root, split, options, Some(WriteLock::dir_shared(root)?))?;
    // A commit killed midway left the split at the writer's last checkpoint: carry on there.
    let skip = w.seq_count();
    let dir = parts_dir(root, split);
    for u in 0..n {
        let seqs = setup.unit_seqs(u);
        if seqs.end <= skip {
            continue;
        }
        let rel = piece_rel(u);
        let sums = done[&unit_name(u)].get(&rel).ok_or_else(|| {
            Error::format(
                dir.join("done").join(format!("{}.json", unit_name(u))),
                format!("does not list {rel} (delete the record and write that unit again)"),
            )
        })?;
        replay(&mut w, &dir.join(&rel), seqs, skip, sums.bytes)?;
        #[cfg(feature = "fault-injection")]
        stop_after(&mut w, u, &root.join(split))?;
    }
    finish_replayed(w, setup.total, &root.join(split))?;
    // The cleanup takes the root's commit lock again.
    drop(splits);
    // Committed: the rest is cleaning up, which a later open, status or commit finishes.
    clean_after_commit(root, split, parts.clone())?;
    Ok(true)
}

/// The error for a damaged piece at `path`.
fn bad_piece(path: &Path, why: String) -> Error {
    Error::format(
        path,
        format!("a unit's piece that {why} (delete its record under .shardkit-parts/<split>/done and write that unit again)"),
    )
}

/// Checks the header `head` of the piece at `path` (`len` bytes, `bytes` as recorded) of a
/// unit of sequences `seqs`: its (sequences, tokens).
fn piece_header(
    head: &[u8; HEADER as usize],
    len: u64,
    path: &Path,
    seqs: &Range<u64>,
    bytes: u64,
) -> Result<(u64, u64)> {
    let word = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
    let (n_seqs, n_tokens) = (word(16), word(24));
    if &head[..8] != MAGIC || head[8..12] != 1u32.to_le_bytes() {
        return Err(bad_piece(path, "is not a version 1 piece".into()));
    }
    if n_seqs != seqs.end - seqs.start {
        return Err(bad_piece(
            path,
            format!(
                "holds {n_seqs} sequences, not its unit's {}",
                seqs.end - seqs.start
            ),
        ));
    }
    if len != bytes
        || Some(len)
            != n_tokens
                .checked_mul(4)
                .and_then(|t| (HEADER + t).checked_add(8 * n_seqs))
    {
        return Err(bad_piece(
            path,
            format!("is {len} bytes, its record says {bytes} and its header {n_seqs} sequences of {n_tokens} tokens"),
        ));
    }
    Ok((n_seqs, n_tokens))
}

/// The sequence lengths of a piece (its `tail`), checked to add up to its `n_tokens`.
fn piece_lengths(tail: &[u8], n_tokens: u64, path: &Path) -> Result<Vec<u64>> {
    let lengths: Vec<u64> = tail
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if lengths.iter().sum::<u64>() != n_tokens {
        return Err(bad_piece(
            path,
            "has sequence lengths that do not add up to its tokens".into(),
        ));
    }
    Ok(lengths)
}

/// Appends to `w` the sequences of `lengths` read from `r` (the piece at `path`), in batches
/// of about [`REPLAY_TOKENS`].
fn replay_from(w: &mut Writer, r: &mut impl Read, lengths: &[u64], path: &Path) -> Result<()> {
    let mut batch: Vec<Vec<u32>> = Vec::new();
    let mut in_batch = 0u64;
    let mut buf = Vec::new();
    for &l in lengths {
        buf.resize(4 * l as usize, 0);
        r.read_exact(&mut buf).at(path)?;
        batch.push(
            buf.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        );
        in_batch += l;
        if in_batch >= REPLAY_TOKENS {
            w.append(&batch)?;
            batch.clear();
            in_batch = 0;
        }
    }
    w.append(&batch)
}

/// Appends to `w` the sequences of the piece at `path` (unit sequences `seqs`, `bytes` long as
/// recorded) from sequence `skip` on: one sequential read.
fn replay(w: &mut Writer, path: &Path, seqs: Range<u64>, skip: u64, bytes: u64) -> Result<()> {
    let f = File::open(path).at(path)?;
    let len = f.metadata().at(path)?.len();
    let mut head = [0u8; HEADER as usize];
    f.read_exact_at(&mut head, 0).at(path)?;
    let (n_seqs, n_tokens) = piece_header(&head, len, path, &seqs, bytes)?;
    let mut tail = vec![0u8; 8 * n_seqs as usize];
    f.read_exact_at(&mut tail, HEADER + 4 * n_tokens).at(path)?;
    let lengths = piece_lengths(&tail, n_tokens, path)?;
    let first = skip.saturating_sub(seqs.start) as usize;
    let skipped: u64 = lengths[..first].iter().sum();
    let mut r = BufReader::with_capacity(1 << 20, f);
    r.seek(SeekFrom::Start(HEADER + 4 * skipped)).at(path)?;
    replay_from(w, &mut r, &lengths[first..], path)
}

fn clean_after_commit(root: &Path, split: &str, parts: Parts) -> Result<()> {
    // One piece a unit: removed several at a time, as the records are.
    fsutil::remove_dir_files_parallel(&parts_dir(root, split).join("pieces"))?;
    parts.remove()?;
    let dir = root.join(PARTS_DIR);
    // The last split's cleanup removes the shared directory; another split's state keeps it.
    if let Ok(_splits) = root_commit_lock(root) {
        let only_lock = fs::read_dir(&dir)
            .map(|es| es.flatten().all(|e| e.file_name() == "commit.lock"))
            .unwrap_or(false);
        if only_lock {
            let _ = fs::remove_file(dir.join("commit.lock"));
            let _ = fs::remove_dir(&dir);
        }
    }
    fsutil::fsync_dir(root)
}

fn status_of(setup: &Setup, parts: Option<&Parts>, committed: bool) -> Result<PartsStatus> {
    let units = setup.units();
    let mut st = PartsStatus::new(committed, units);
    match parts.filter(|_| !committed) {
        Some(p) => {
            st.done = p
                .done()?
                .keys()
                .filter_map(|n| parse_unit(n))
                .filter(|&u| u < units)
                .collect();
            st.claimed = p.live_claims()?;
        }
        None if committed => st.done = (0..units).collect(),
        None => {}
    }
    Ok(st)
}

/// The configuration of the write in parts of `split`, when there is one.
fn setup_of(root: &Path, split: &str) -> Result<Option<(Setup, Parts)>> {
    let dir = parts_dir(root, split);
    let Some(parts) = Parts::existing_in(&dir) else {
        return Ok(None);
    };
    let path = dir.join(SETUP);
    match fsutil::read_json_file(&path) {
        Ok(bytes) => Ok(Some((Setup::parse(&bytes, &path)?, parts))),
        // Its first rank was killed before the configuration: nothing was written.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// Where `split` of the dataset at `root` stands: committed, or which units are durable,
/// which are claimed by live ranks (and by whom), and what a restart would write. A split
/// whose every unit is durable but not committed (its last rank killed mid-commit) is
/// committed by [`commit_parts`]. A split committed earlier no longer records its unit size:
/// its status counts units of the default size ([`PartOptions::default`]).
pub fn status(root: impl AsRef<Path>, split: &str) -> Result<PartsStatus> {
    let root = root.as_ref();
    check_split(split)?;
    if let Target::Store(target) = Target::parse(root)? {
        return store::status(&target, split);
    }
    status_given(
        setup_of(root, split)?,
        || split_seqs(root, split),
        |total| committed(root, split, total),
        root.join(split),
        split,
    )
}

/// [`status`] of a split, local or in a store: from its write in parts (`found`, with
/// `committed(total)` saying whether the commit is done), else from the committed split's
/// sequence count (`seqs`), else not found (`at`).
fn status_given(
    found: Option<(Setup, Parts)>,
    seqs: impl FnOnce() -> Result<Option<u64>>,
    committed: impl Fn(u64) -> Result<bool>,
    at: PathBuf,
    split: &str,
) -> Result<PartsStatus> {
    if let Some((setup, parts)) = found {
        let done = committed(setup.total)?;
        return status_of(&setup, Some(&parts), done);
    }
    let Some(n) = seqs()? else {
        return Err(Error::NotFound {
            path: at,
            what: format!("split {split:?}: neither the split nor a write of it in parts"),
        });
    };
    let setup = Setup {
        total: n,
        per_unit: PartOptions::default().sequences_per_unit,
        layout: Layout::default(),
    };
    status_of(&setup, None, committed(n)?)
}

/// Commits `split` of the dataset at `root` written in parts, when every unit is durable (a
/// restart of nothing: the ranks finished, the last was killed while committing). Returns
/// its status.
pub fn commit_parts(root: impl AsRef<Path>, split: &str) -> Result<PartsStatus> {
    let root = root.as_ref();
    check_split(split)?;
    if let Target::Store(target) = Target::parse(root)? {
        return store::commit_parts(&target, split);
    }
    let Some((setup, parts)) = setup_of(root, split)? else {
        return status(root, split);
    };
    let _lock = WriteLock::dir_shared(root)?;
    let done = commit(root, split, &setup, &parts)?;
    status_of(&setup, Some(&parts), done)
}

/// The error for reading `split` of `root` while it is an unfinished write in parts, naming
/// the units missing; `None` when it is not one.
pub(crate) fn unfinished(root: &Path, split: &str) -> Option<Error> {
    let (setup, parts, done) = match Target::parse(root).ok()? {
        Target::Store(target) => {
            let (setup, parts) = store::setup_of(&target, split).ok()??;
            let done = store::committed(&target, split, setup.total);
            (setup, parts, done)
        }
        Target::Local(_) => {
            let (setup, parts) = setup_of(root, split).ok()??;
            let done = committed(root, split, setup.total);
            (setup, parts, done)
        }
    };
    if done.unwrap_or(false) {
        return None; // committed; what is left is its cleanup, which the next rank finishes
    }
    let st = status_of(&setup, Some(&parts), false).ok()?;
    let present: u64 = st
        .done
        .iter()
        .map(|&u| {
            let r = setup.unit_seqs(u);
            r.end - r.start
        })
        .sum();
    let missing: Vec<String> = st
        .missing()
        .iter()
        .map(|r| match r.end - r.start {
            1 => format!("unit {}", r.start),
            _ => format!("units {}..{}", r.start, r.end),
        })
        .collect();
    Some(Error::Incomplete {
        path: root.join(split),
        present,
        total: setup.total,
        detail: format!(
            "split {split:?} is being written in parts and is not committed (the commit writes \
             it once every unit is durable); missing: {}; `shardkit flat-tokens status` says \
             more",
            if missing.is_empty() {
                "nothing (its last rank was killed while committing: commit it with \
                 `shardkit flat-tokens status --commit`)"
                    .to_string()
            } else {
                missing.join(", ")
            }
        ),
    })
}
