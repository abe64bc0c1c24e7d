//! Reading a cache: `len == num_samples`, item `i` from shard `i // s`, row `i % s` (eagle3.md
//! §6, §7.2, §11.6).
//!
//! Opening reads the manifest and checks the shard set (exactly `0..ceil(N/s)-1`); shards are
//! memory-mapped on first use and kept in a small cache of open handles. An item borrows its
//! rows from the map; nothing is copied until a caller copies it. A top-k cache's item rebuilds
//! the full-width `target_probs` (zeros, with the stored values scattered at their indices).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use safetensors::Dtype;

use super::manifest::{self, Manifest};
use super::shard::{
    field_specs, shard_index, shard_name, shard_set, shard_set_problem, FieldSpec, ShardFile,
};
use super::weights::{self, Embeddings, Weights};
use crate::error::{Error, Result};
use crate::io::{self, Location, Source};

/// Shard handles kept open by default.
pub const DEFAULT_OPEN_SHARDS: usize = 64;

/// Shards of a cache in an object store kept open (their checked headers, a few hundred bytes
/// each), whatever `max_open` says: that bounds maps and descriptors, which these do not hold.
const REMOTE_SHARDS_KEPT: usize = 1 << 16;

/// An opened cache.
pub struct Cache {
    dir: PathBuf,
    manifest: Manifest,
    specs: Vec<FieldSpec>,
    open: Mutex<OpenShards>,
    max_open: usize,
    /// Set for a cache in an object store: its prefix and every object's size.
    remote: Option<(Arc<dyn Source>, HashMap<String, u64>)>,
}

#[derive(Default)]
struct OpenShards {
    by_index: HashMap<u64, Arc<ShardFile>>,
    /// Least recently used first.
    lru: VecDeque<u64>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("dir", &self.dir)
            .field("num_samples", &self.manifest.num_samples)
            .finish()
    }
}

/// One field of an item: dtype, shape and bytes (borrowed from the shard's map, or owned for
/// a rebuilt top-k `target_probs`).
#[derive(Debug, Clone)]
pub struct Field<'a> {
    /// The field name.
    pub name: &'static str,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape (one sample: `[S]`, `[S, 3H]`, `[S, 1]` or `[S, Vd]`).
    pub shape: Vec<usize>,
    /// C-order little-endian bytes.
    pub bytes: std::borrow::Cow<'a, [u8]>,
}

/// One sample: sample `index` is row `row` of shard `shard`. Its shard stays mapped while the
/// item lives (from an object store, its rows are fetched with the item, one ranged GET per
/// stored tensor, all in flight at once); [`Cache::fields`] gives its fields.
#[derive(Debug, Clone)]
pub struct Item {
    /// The sample's index in the cache.
    pub index: u64,
    /// The shard it comes from.
    pub shard: u64,
    /// Its row in the shard.
    pub row: u64,
    file: Arc<ShardFile>,
    /// The rows of every stored tensor (specs order), for a cache in an object store.
    fetched: Option<Arc<Vec<Vec<u8>>>>,
}

impl Item {
    /// Row bytes of stored field `f` (index into the specs).
    fn bytes(&self, f: usize, row_bytes: usize) -> Result<&[u8]> {
        match &self.fetched {
            Some(rows) => rows
                .get(f)
                .map(|r| &r[..])
                .ok_or_else(|| Error::Internal(format!("internal: no fetched field {f}"))),
            None => self.file.row(f, self.row, row_bytes),
        }
    }
}

impl Cache {
    /// Opens the cache at `dir`: the manifest (EAGLE-3 version 1 or 2, DSpark version 1) and
    /// the shard set, which must be exactly `0..ceil(num_samples / shard_size)`, keeping at
    /// most [`DEFAULT_OPEN_SHARDS`] shards mapped at once. A cache whose writer has not
    /// finished is reported as incomplete with the samples that are missing; so is a DSpark
    /// cache whose manifest says `"complete": false`.
    ///
    /// `dir` may be an `s3://bucket/prefix` URL: the manifest is fetched and the objects listed
    /// once; each shard's header is read when the shard is first used (usually one ranged GET;
    /// a batch's new shards together) and then kept, and items and batches read exactly their
    /// rows.
    pub fn open(dir: impl AsRef<Path>) -> Result<Cache> {
        let location = Location::parse(dir.as_ref())?;
        Self::open_source(io::open(&location)?, DEFAULT_OPEN_SHARDS)
    }

    /// Opens the cache `source` holds ([`io::open`] of a path or URL, or any [`Source`]: an
    /// in-memory object store, say), as [`Cache::open`] does, keeping at most `max_open` shards
    /// mapped at once (a cache in an object store keeps every shard's checked header, whatever
    /// `max_open`).
    pub fn open_source(source: Arc<dyn Source>, max_open: usize) -> Result<Cache> {
        match source.local_path() {
            Some(dir) => Self::open_local(dir.to_path_buf(), max_open),
            None => Self::open_remote(source, max_open),
        }
    }

    fn open_local(dir: PathBuf, max_open: usize) -> Result<Cache> {
        if !dir.is_dir() {
            return Err(manifest::missing(&dir));
        }
        // A write in parts has no manifest.json until its commit: say so, naming what is
        // missing, rather than "no manifest".
        if let Some(e) = super::parts::unfinished(&dir) {
            return Err(e);
        }
        let m = manifest::read(&dir)?;
        let present = shard_set(&dir)?;
        Self::checked(dir, m, &present, max_open, None)
    }

    /// The cache at `dir` while it is written in parts (follow mode): the manifest its part
    /// writers share, its shards mapped only when read (the follow loader reads durable shards
    /// only); `None` when `dir` holds no unfinished write in parts.
    pub(crate) fn open_unfinished(dir: &Path) -> Result<Option<Cache>> {
        let Some(m) = super::parts::setup_manifest(dir)? else {
            return Ok(None);
        };
        Ok(Some(Cache {
            specs: field_specs(&m),
            dir: dir.to_path_buf(),
            manifest: m,
            open: Mutex::default(),
            max_open: DEFAULT_OPEN_SHARDS,
            remote: None,
        }))
    }

    /// [`Cache::open_unfinished`] of the cache at the store prefix `location`, read through
    /// `source` (the committed reader's store path): the objects are listed once, for the
    /// sizes of the shards durable now; a shard durable since has its size asked for when it
    /// is first read.
    pub(crate) fn open_unfinished_store(
        location: &Location,
        source: Arc<dyn Source>,
    ) -> Result<Option<Cache>> {
        let target = io::Remote::from_location(location)?;
        let Some(m) = super::parts::setup_manifest_store(&target)? else {
            return Ok(None);
        };
        let sizes: HashMap<String, u64> = source.list()?.into_iter().collect();
        Ok(Some(Cache {
            specs: field_specs(&m),
            dir: source.location().to_path(),
            manifest: m,
            open: Mutex::default(),
            max_open: DEFAULT_OPEN_SHARDS,
            remote: Some((source, sizes)),
        }))
    }

    /// The cache once its shard set is checked against its manifest.
    fn checked(
        dir: PathBuf,
        m: Manifest,
        present: &BTreeSet<u64>,
        max_open: usize,
        remote: Option<(Arc<dyn Source>, HashMap<String, u64>)>,
    ) -> Result<Cache> {
        if !m.is_complete() {
            // NeMo's `ensure_manifest_complete`: the producer is still running, or was killed
            // (whatever shards it left, in any order: its ranks write blocks side by side).
            let k = m.num_shards();
            let have: u64 = present
                .iter()
                .filter(|&&s| s < k)
                .map(|&s| m.rows_in_shard(s))
                .sum();
            let shards = match shard_set_problem(present, k) {
                None => "every shard is there".to_string(),
                Some(_) => format!("{} of {k} shards are there", present.len()),
            };
            return Err(Error::Incomplete {
                path: dir.join(manifest::MANIFEST),
                present: have,
                total: m.num_samples,
                detail: format!(
                    "the manifest says \"complete\": false ({shards}): its producer was \
                     interrupted or is still running; rerun it with the same configuration \
                     (shardkit part writers, or a resumed writer) to finish it"
                ),
            });
        }
        check_shard_set(&dir, &m, present)?;
        Ok(Cache {
            specs: field_specs(&m),
            dir,
            manifest: m,
            open: Mutex::default(),
            max_open: max_open.max(1),
            remote,
        })
    }

    fn open_remote(remote: Arc<dyn Source>, max_open: usize) -> Result<Cache> {
        let dir = remote.location().to_path();
        let objects: HashMap<String, u64> = remote.list()?.into_iter().collect();
        // A write in parts has no manifest.json until its commit: say so, naming what is
        // missing, rather than "no manifest" (only where its state is there: no request more
        // for a prefix that holds no cache at all).
        let private = format!("{}/", crate::commit::parts::PARTS_DIR);
        if !objects.contains_key(manifest::MANIFEST)
            && objects.keys().any(|n| n.starts_with(&private))
        {
            if let Some(e) = super::parts::unfinished(&dir) {
                return Err(e);
            }
        }
        let m = remote_manifest(&*remote, &objects)?;
        let present: BTreeSet<u64> = objects.keys().filter_map(|n| shard_index(n)).collect();
        Self::checked(dir, m, &present, max_open, Some((remote, objects)))
    }

    /// The source holding the cache, when it is not local files.
    pub(crate) fn remote(&self) -> Option<&dyn Source> {
        self.remote.as_ref().map(|(r, _)| &**r)
    }

    /// The directory (or URL).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
    /// The manifest (`num_samples` is the number of samples).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// Samples (`num_samples`).
    pub(crate) fn len(&self) -> u64 {
        self.manifest.num_samples
    }
    /// The stored tensors of every shard.
    pub(crate) fn specs(&self) -> &[FieldSpec] {
        &self.specs
    }

    /// Shard `k`, mapped on first use (its header checked against the manifest).
    fn shard(&self, k: u64) -> Result<Arc<ShardFile>> {
        self.shards(&[k], &io::Stop::never())?
            .remove(&k)
            .ok_or_else(|| Error::Internal(format!("internal: shard {k} was not opened")))
    }

    /// Shards `ks` (in any order, repeats allowed), each opened on first use as by
    /// [`Cache::shard`]. From a store, the headers of those not yet open are fetched together,
    /// one batch of parallel GETs: a batch of samples in many shards waits for one round trip,
    /// not one per shard; those reads give up once `stop` is set.
    pub(crate) fn shards(
        &self,
        ks: &[u64],
        stop: &io::Stop,
    ) -> Result<HashMap<u64, Arc<ShardFile>>> {
        let mut got = HashMap::with_capacity(ks.len());
        let mut missing = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(ks.len());
        {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            for &k in ks {
                if !seen.insert(k) {
                    continue;
                }
                match open.by_index.get(&k).cloned() {
                    Some(s) => {
                        open.lru.retain(|&x| x != k);
                        open.lru.push_back(k);
                        got.insert(k, s);
                    }
                    None => missing.push(k),
                }
            }
        }
        if missing.is_empty() {
            return Ok(got);
        }
        // Mapped (or their headers read) outside the lock: other shards stay available.
        let opened: Vec<ShardFile> = match &self.remote {
            None => missing
                .iter()
                .map(|&k| {
                    let rows = self.manifest.rows_in_shard(k);
                    ShardFile::open(&self.dir.join(shard_name(k)), &self.specs, rows)
                })
                .collect::<Result<_>>()?,
            Some((remote, sizes)) => {
                let mut shards: Vec<_> = missing
                    .iter()
                    .map(|&k| remote_shard(&self.manifest, sizes, k))
                    .collect();
                // A cache followed while it is written listed only the shards durable when it
                // opened: those durable since have their sizes asked for (one HEAD each, all
                // at once, and once: the shard stays open).
                let unknown: Vec<usize> = (0..shards.len())
                    .filter(|&i| !sizes.contains_key(&shards[i].0))
                    .collect();
                for (i, size) in unknown.iter().zip(sizes_of(&**remote, &shards, &unknown)?) {
                    shards[*i].1 = size;
                }
                ShardFile::open_remote_many(&**remote, &shards, &self.specs, stop)?
            }
        };
        // A shard in a store holds no map or descriptor, only its checked header (offsets):
        // thousands are kept, so a later epoch fetches no header again.
        let limit = match self.remote {
            None => self.max_open,
            Some(_) => self.max_open.max(REMOTE_SHARDS_KEPT),
        };
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        for (k, s) in missing.into_iter().zip(opened) {
            let s = match open.by_index.get(&k) {
                Some(already) => already.clone(), // opened meanwhile by another thread
                None => {
                    while open.by_index.len() >= limit {
                        match open.lru.pop_front() {
                            // Items still holding an evicted shard keep its map alive.
                            Some(old) => {
                                open.by_index.remove(&old);
                            }
                            None => break,
                        }
                    }
                    let s = Arc::new(s);
                    open.by_index.insert(k, s.clone());
                    open.lru.push_back(k);
                    s
                }
            };
            got.insert(k, s);
        }
        Ok(got)
    }

    /// Sample `i`; a negative `i` counts from the end (wrapped once, as NeMo does).
    pub fn item(&self, i: i64) -> Result<Item> {
        let n = self.len();
        let j = if i < 0 { i + n as i64 } else { i };
        if j < 0 || j as u64 >= n {
            return Err(Error::OutOfRange {
                what: "sample",
                index: i,
                len: n,
            });
        }
        let j = j as u64;
        let s = self.manifest.shard_size;
        let shard = self.shard(j / s)?;
        let row = j % s;
        let fetched = match &self.remote {
            None => None,
            Some((remote, _)) => {
                // Every stored tensor's row, fetched at once (coalesced where adjacent).
                let mut ranges = Vec::with_capacity(self.specs.len());
                let mut at = 0;
                for (f, spec) in self.specs.iter().enumerate() {
                    let rb = spec.row_bytes() as u64;
                    ranges.push((0, shard.row_offset(f, row, rb as usize), rb, at));
                    at += rb;
                }
                let mut buf = vec![0u8; at as usize];
                remote.read_ranges(&[shard_name(j / s)], &ranges, &mut buf, &io::Stop::never())?;
                let rows = ranges
                    .iter()
                    .map(|&(_, _, len, at)| buf[at as usize..(at + len) as usize].to_vec())
                    .collect();
                Some(Arc::new(rows))
            }
        };
        Ok(Item {
            index: j,
            shard: j / s,
            row,
            file: shard,
            fetched,
        })
    }

    /// The fields of `item`, in the order NeMo's collate stacks them
    /// ([`Schema::item_fields`](super::Schema::item_fields)); EAGLE-3: input_ids,
    /// attention_mask, loss_mask, aux_hidden_states, position_mask, target_probs; DSpark:
    /// input_ids, loss_mask, target_hidden_states, target_last_hidden_states.
    pub fn fields<'a>(&self, item: &'a Item) -> Result<Vec<Field<'a>>> {
        let names = self.manifest.schema().item_fields();
        let mut out = Vec::with_capacity(names.len());
        for &name in names {
            if let (Some(vd), "target_probs") = (self.topk_width(), name) {
                out.push(Field {
                    name,
                    dtype: self.manifest.dtype,
                    shape: vec![self.manifest.seq_length as usize, vd],
                    bytes: std::borrow::Cow::Owned(self.scatter_topk(item)?),
                });
                continue;
            }
            let (f, spec) = self.spec(name);
            out.push(Field {
                name: spec.name,
                dtype: spec.dtype,
                shape: spec.row.clone(),
                bytes: std::borrow::Cow::Borrowed(item.bytes(f, spec.row_bytes())?),
            });
        }
        Ok(out)
    }

    fn spec(&self, name: &str) -> (usize, &FieldSpec) {
        self.specs
            .iter()
            .enumerate()
            .find(|(_, s)| s.name == name)
            .expect("every stored name has a spec")
    }

    /// The full-width `target_probs` of a top-k item: zeros with the stored values at their
    /// indices.
    fn scatter_topk(&self, item: &Item) -> Result<Vec<u8>> {
        let (fv, values) = self.spec("target_probs_values");
        let (fi, indices) = self.spec("target_probs_indices");
        let v = item.bytes(fv, values.row_bytes())?;
        let ix = item.bytes(fi, indices.row_bytes())?;
        let mut out = vec![0u8; self.full_probs_bytes()];
        scatter(
            v,
            ix,
            &mut out,
            self.manifest.dtype.bitsize() / 8,
            self.topk_width().unwrap_or(0),
            item.file.path(),
        )?;
        Ok(out)
    }

    /// Bytes of one sample's full-width `target_probs` (0 unless top-k).
    pub(crate) fn full_probs_bytes(&self) -> usize {
        self.manifest.seq_length as usize
            * self.topk_width().unwrap_or(0)
            * (self.manifest.dtype.bitsize() / 8)
    }

    /// The draft vocabulary's width that a top-k EAGLE-3 cache's `target_probs` is expanded
    /// to; `None` for every other cache.
    pub(crate) fn topk_width(&self) -> Option<usize> {
        let e = self.manifest.eagle3()?;
        e.topk.map(|_| e.draft_vocab_size as usize)
    }

    /// The target weights beside the shards ([`Weights`]): EAGLE-3's embedding table
    /// `weight` (F32 `[rows, H]`), DSpark's `embed_tokens.weight` and `lm_head.weight`; mapped,
    /// or fetched whole from a store.
    pub fn target_weights(&self) -> Result<Weights> {
        match &self.remote {
            None => weights::open(&self.dir, &self.manifest),
            Some((remote, sizes)) => weights::fetch(&**remote, sizes, &self.manifest),
        }
    }

    /// [`Cache::target_weights`] under EAGLE-3's name.
    pub fn target_embeddings(&self) -> Result<Embeddings> {
        self.target_weights()
    }
}

/// The manifest of the cache in `remote`, whose objects (and their sizes) are `objects`.
pub(crate) fn remote_manifest(
    remote: &dyn Source,
    objects: &HashMap<String, u64>,
) -> Result<Manifest> {
    let path = remote.path_of(manifest::MANIFEST);
    if !objects.contains_key(manifest::MANIFEST) {
        return Err(Error::NotFound {
            path,
            what: "no manifest.json: not an EAGLE-3 or DSpark cache, or one not uploaded yet"
                .into(),
        });
    }
    Manifest::parse(&remote.get(manifest::MANIFEST)?, &path)
}

/// The sizes of the objects `shards[i].0` for each `i` of `which`, asked for together (one HEAD
/// each, up to [`HEADS`] in flight).
fn sizes_of(
    remote: &dyn Source,
    shards: &[(String, u64, u64)],
    which: &[usize],
) -> Result<Vec<u64>> {
    let head = |i: &usize| remote.len(&shards[*i].0);
    crate::par::chunked(which, HEADS, "asking for shard sizes", |c| {
        c.iter().map(head).collect()
    })
}

/// The most HEADs [`sizes_of`] keeps in flight.
const HEADS: usize = 16;

/// Shard `k` of a cache in a store, as [`ShardFile::open_remote_many`] takes it: (object name,
/// size from the listing `sizes`, rows).
pub(crate) fn remote_shard(
    m: &Manifest,
    sizes: &HashMap<String, u64>,
    k: u64,
) -> (String, u64, u64) {
    let name = shard_name(k);
    let size = sizes.get(&name).copied().unwrap_or(0);
    (name, size, m.rows_in_shard(k))
}

/// Checks the shard set of a cache against its manifest: exactly `0..num_shards`, or a
/// contiguous prefix reported as an incomplete cache.
fn check_shard_set(dir: &Path, m: &Manifest, present: &BTreeSet<u64>) -> Result<()> {
    let k = m.num_shards();
    if let Some(problem) = shard_set_problem(present, k) {
        // A contiguous prefix is a writer that has not finished: say which samples.
        let prefix = present.len() as u64;
        if prefix < k && shard_set_problem(present, prefix).is_none() {
            let have = prefix * m.shard_size;
            return Err(Error::Incomplete {
                path: dir.to_path_buf(),
                present: have,
                total: m.num_samples,
                detail: format!(
                    "{} missing ({} absent); resume the writer to complete it",
                    span_words("sample", have, m.num_samples.saturating_sub(1), "is", "are"),
                    if prefix == k - 1 {
                        format!("shard {}", shard_name(prefix))
                    } else {
                        format!("shards {} to {}", shard_name(prefix), shard_name(k - 1))
                    },
                ),
            });
        }
        return Err(Error::format(dir, problem));
    }
    Ok(())
}

/// Scatters `values` (`[S, k]`, `elem` bytes each) at `indices` (`[S, k]` i32) into `out`
/// (`[S, vd]`, zeroed). An index outside `0..vd` is an error naming `path`.
pub(crate) fn scatter(
    values: &[u8],
    indices: &[u8],
    out: &mut [u8],
    elem: usize,
    vd: usize,
    path: &Path,
) -> Result<()> {
    let k = indices.len() / 4;
    let rows = out.len() / (vd * elem);
    let per_row = k / rows.max(1);
    for (j, ix) in indices.chunks_exact(4).enumerate() {
        let col = i32::from_le_bytes([ix[0], ix[1], ix[2], ix[3]]);
        if col < 0 || col as usize >= vd {
            return Err(Error::format(
                path,
                format!("target_probs_indices holds {col}, outside the draft vocabulary 0..{vd}"),
            ));
        }
        let r = j / per_row.max(1);
        let dst = (r * vd + col as usize) * elem;
        out[dst..dst + elem].copy_from_slice(&values[j * elem..(j + 1) * elem]);
    }
    Ok(())
}

/// "sample 4 is" or "samples 4 to 9 are": an inclusive span of `noun`s in words.
pub(crate) fn span_words(noun: &str, first: u64, last: u64, one: &str, many: &str) -> String {
    if first == last {
        format!("{noun} {first} {one}")
    } else {
        format!("{noun}s {first} to {last} {many}")
    }
}
