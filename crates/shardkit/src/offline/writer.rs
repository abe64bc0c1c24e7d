//! Writing a cache: samples accumulate into shards of `shard_size`, each written atomically and
//! durably once full (eagle3.md §7.1, §11.4–11.5).
//!
//! The manifest is written before any shard. A crash therefore leaves the manifest and a
//! contiguous prefix of complete shards (plus temporaries, which are ignored and cleaned). A
//! resumed writer checks that the prefix is contiguous and that its configuration equals the
//! recorded one, then continues at sample `k·shard_size`; the finished directory equals that of
//! an uninterrupted run.
//!
//! To an object store: the same steps in a local staging directory, and each shard, once
//! written there, is uploaded in the background and its staged copy removed; an upload journal
//! ([`Journal`]) records the shards in the store with their checksums, and the manifest. A
//! resumed write, on this machine or another, keeps the journaled shards. `finish` uploads the
//! embeddings, the checksums sidecar and, last, manifest.json (the store's commit record).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::manifest::{self, Manifest};
use super::rules;
use super::schema::Schema;
use super::shard::{
    self, field_specs, shard_name, shard_set, shard_set_problem, FieldSpec, ShardFile,
};
use super::weights::{self, WeightTable};
use crate::checksum::Journal;
use crate::commit::parts::PARTS_DIR;
use crate::commit::{self, Files, StoreWrite, Streaming, Target, WriteLock};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::{self, Remote};
use crate::json::Value;

/// Options of [`Writer::create`].
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// The `format_version` to write: 1 (the default, as the module this was specified from) or
    /// 2 (what current NeMo accepts; needed for top-k caches).
    pub version: u8,
    /// Continue a cache that already has shards instead of refusing.
    pub resume: bool,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            version: 1,
            resume: false,
        }
    }
}

/// Writes one cache directory.
#[derive(Debug)]
pub struct Writer {
    dir: PathBuf,
    manifest: Manifest,
    specs: Vec<FieldSpec>,
    /// Rows of the shard being filled, per field.
    bufs: Vec<Vec<u8>>,
    rows_buffered: u64,
    /// The shard being filled.
    shard: u64,
    resumed_from: Option<u64>,
    /// Held for the writer's life: a second writer of this cache fails at once.
    /// `None` for a cache already complete in the store (nothing is staged).
    lock: Option<WriteLock>,
    /// The shards written so far, checksummed (see [`crate::checksum`]) and, writing to an
    /// object store (staged in `dir`), streamed there as they are written.
    files: Files,
}

/// The journal fact holding the manifest (as its text): the store gets manifest.json last.
const MANIFEST_FACT: &str = "manifest";

impl Writer {
    /// Starts (or, with `options.resume`, continues) the cache at `dir` for the run
    /// configuration `config` (a JSON object with every key the reference producer writes).
    ///
    /// `dir` may be an `s3://bucket/prefix` URL naming a prefix without a cache: the cache is
    /// then staged in a local directory (`$SHARDKIT_STAGING_DIR`, default the system's temporary
    /// directory's `shardkit-staging`, then the bucket and key), each shard uploaded as soon as it
    /// is written and its staged copy removed, and the rest uploaded by
    /// [`Writer::finish`], manifest.json last. The same rules apply to what the store holds: an
    /// interrupted write (shards named in its upload journal) is refused unless
    /// `options.resume`, then continued after the journaled shards, on any machine.
    pub fn create(dir: impl AsRef<Path>, config: &Value, options: WriterOptions) -> Result<Writer> {
        match Target::parse(dir.as_ref())? {
            Target::Store(remote) => Self::create_remote(remote, config, options),
            Target::Local(dir) => Self::create_local(&dir, config, options, &Journal::default()),
        }
    }

    fn create_remote(remote: Remote, config: &Value, options: WriterOptions) -> Result<Writer> {
        if let Some(bytes) = remote.get_opt(manifest::MANIFEST)? {
            // The store's commit record: the cache there is complete.
            let path = remote.url_of(manifest::MANIFEST);
            let theirs = Manifest::parse(&bytes, &path)?;
            let m = Manifest::for_writing(config, options.version)?;
            let differ = m.differing_keys(&theirs);
            if !differ.is_empty() {
                return Err(Error::Exists {
                    path,
                    why: format!(
                        "the prefix already holds {} cache of another configuration \
                         (these keys differ: {}); write to another prefix",
                        theirs.schema().a(),
                        differ.join(", ")
                    ),
                });
            }
            if !options.resume {
                return Err(Error::Exists {
                    path,
                    why: format!(
                        "the prefix already holds this {} cache, complete; resume finds nothing \
                         to write",
                        m.schema().title()
                    ),
                });
            }
            Streaming::clear_leftovers(&remote, &commit::staging_dir(Path::new(&remote.url())));
            let specs = field_specs(&m);
            return Ok(Writer {
                dir: PathBuf::from(remote.url()),
                bufs: specs.iter().map(|_| Vec::new()).collect(),
                specs,
                rows_buffered: 0,
                shard: m.num_shards(),
                resumed_from: Some(m.num_samples),
                manifest: m,
                lock: None,
                files: Files::default(),
            });
        }
        let store = StoreWrite::begin(remote)?;
        let mut uploaded = store.found().clone();
        // Shards upload several at a time: those after the first one missing are written again.
        let first_missing = (0u64..)
            .find(|&k| !uploaded.files.files.contains_key(&shard_name(k)))
            .unwrap_or(0);
        uploaded
            .files
            .files
            .retain(|n, _| shard::shard_index(n).is_some_and(|k| k < first_missing));
        if !uploaded.files.files.is_empty() && !options.resume {
            return Err(Error::Exists {
                path: store.url(),
                why: format!(
                    "holds an interrupted write of this cache ({} shard(s) uploaded); resume it \
                     or delete its objects",
                    uploaded.files.files.len()
                ),
            });
        }
        let mut w = Self::create_local(&store.staging(), config, options, &uploaded)?;
        let mut journal = Journal::default();
        let text = String::from_utf8_lossy(&w.manifest.to_bytes()).into_owned();
        journal.set_fact(MANIFEST_FACT, Value::String(text));
        for (name, sums) in &uploaded.files.files {
            if shard::shard_index(name).is_some_and(|k| k < w.shard) {
                journal.files.files.insert(name.clone(), sums.clone());
            }
        }
        let mut streaming = store.stream(journal)?;
        // Shards the interrupted run staged but did not upload go first.
        for k in 0..w.shard {
            let name = shard_name(k);
            if !streaming.has_sent(&name) {
                let sums = w.files.record(&w.dir, &name)?;
                streaming.send(&w.dir, &name, sums)?;
            }
        }
        w.files.stream(streaming);
        Ok(w)
    }

    /// [`Writer::create`] in a local directory; `uploaded` is what an interrupted write to a
    /// store left there (`dir` is then its staging directory).
    fn create_local(
        dir: &Path,
        config: &Value,
        options: WriterOptions,
        uploaded: &Journal,
    ) -> Result<Writer> {
        let dir = io::local_path(dir);
        // DSpark's manifest goes down marked incomplete; `finish` marks it complete.
        let m = Manifest::for_writing(config, options.version)?.with_complete(false);
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Exists {
                path: dir,
                why: "exists and is not a directory".into(),
            });
        }
        let specs = field_specs(&m);
        // An existing cache is locked before it is looked at; a new one once it is created.
        let early_lock = if dir.is_dir() {
            Some(WriteLock::dir(&dir)?)
        } else {
            None
        };
        if dir.join(PARTS_DIR).is_dir() {
            // Its configuration is in the parts' state; a whole-cache writer would find
            // shards without a manifest, or write a manifest the ranks' commit decides.
            return Err(Error::Exists {
                path: dir,
                why: format!(
                    "is being written in parts ({} PartWriter; .shardkit-parts holds its \
                     state): continue it with part writers (any world size), or write the cache \
                     elsewhere",
                    m.schema().name()
                ),
            });
        }
        if m.schema() == Schema::DSpark {
            refuse_other_run(&dir, &m)?;
        }
        let in_store: BTreeSet<u64> = uploaded
            .files
            .files
            .keys()
            .filter_map(|n| shard::shard_index(n))
            .collect();
        let mut present = shard_set(&dir)?;
        present.extend(&in_store);
        let mut resumed_from = None;
        let mut shard = 0;
        if !present.is_empty() {
            if !options.resume {
                return Err(Error::Exists {
                    path: dir,
                    why: format!(
                        "already has shards ({} of {}); resume to continue this cache, or write \
                         elsewhere",
                        present.len(),
                        m.num_shards()
                    ),
                });
            }
            let recorded = match (manifest::read(&dir), uploaded.fact(MANIFEST_FACT)) {
                (Ok(r), _) => r,
                // Resumed without the staging directory: the journal kept the manifest.
                (Err(Error::NotFound { .. }), Some(Value::String(text))) => {
                    Manifest::parse(text.as_bytes(), Path::new(Journal::NAME))?
                }
                (Err(Error::NotFound { .. }), _) => {
                    return Err(Error::Exists {
                        path: dir.join(manifest::MANIFEST),
                        why: "shards are present but no manifest records their configuration; \
                              refusing to resume"
                            .into(),
                    })
                }
                (Err(e), _) => return Err(e),
            };
            let differ = m.differing_keys(&recorded);
            if !differ.is_empty() {
                return Err(Error::Exists {
                    path: dir.join(manifest::MANIFEST),
                    why: format!(
                        "the cache was written with another configuration; these keys differ: {}",
                        differ.join(", ")
                    ),
                });
            }
            let k = present.len() as u64;
            if let Some(problem) = shard_set_problem(&present, k) {
                return Err(Error::format(
                    &dir,
                    format!(
                        "cannot resume: existing shards are not a contiguous prefix; {problem}"
                    ),
                ));
            }
            if k > m.num_shards() {
                return Err(Error::format(
                    &dir,
                    shard_set_problem(&present, m.num_shards()).unwrap_or_default(),
                ));
            }
            // Every kept shard must be whole and of this configuration (those in the store are
            // as their journal says).
            for i in (0..k).filter(|i| !in_store.contains(i)) {
                ShardFile::open(&dir.join(shard_name(i)), &specs, m.rows_in_shard(i))?;
            }
            shard = k;
            resumed_from = Some((k * m.shard_size).min(m.num_samples));
        }
        // Nothing on disk has changed before this point.
        std::fs::create_dir_all(&dir).at(&dir)?;
        let lock = match early_lock {
            Some(l) => l,
            None => {
                let l = WriteLock::dir(&dir)?;
                if !shard_set(&dir)?.is_empty() {
                    return Err(Error::Exists {
                        path: dir,
                        why: "another writer created this cache while this one was starting; \
                              resume it instead"
                            .into(),
                    });
                }
                l
            }
        };
        shard::remove_temporaries(&dir)?;
        manifest::write(&dir, &m)?;
        let bufs = specs.iter().map(|_| Vec::new()).collect();
        Ok(Writer {
            dir,
            manifest: m,
            specs,
            bufs,
            rows_buffered: 0,
            shard,
            resumed_from,
            lock: Some(lock),
            files: Files::keeping(uploaded),
        })
    }

    /// The manifest written.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The tensors each sample needs (name, dtype, row shape).
    pub fn fields(&self) -> &[FieldSpec] {
        &self.specs
    }
    /// The first sample still to be written (`k·shard_size` after a resume; `num_samples`
    /// once every shard is written).
    pub fn next_sample(&self) -> u64 {
        (self.shard * self.manifest.shard_size + self.rows_buffered).min(self.manifest.num_samples)
    }
    /// A resumed write of a cache the store already holds complete: nothing is written.
    fn complete_in_store(&self) -> bool {
        self.lock.is_none()
    }
    /// When the cache had shards before: the first sample this writer had to write.
    pub fn resumed_from(&self) -> Option<u64> {
        self.resumed_from
    }

    /// Adds `n` samples, in order: `fields` holds, for each stored tensor (see
    /// [`Writer::fields`]), its name and the bytes of `n` rows, C order, little-endian. Every
    /// stored tensor must be given with exactly `n` rows of its dtype and shape, and every value
    /// must follow the rules `validate --deep` checks (finite floats, probabilities not negative
    /// and, lossless, each row summing to 1 within the dtype's tolerance: 1e-2 bf16, 2e-3 fp16,
    /// 1e-4 fp32; masks 0 or 1, `position_mask` only where `loss_mask` is 1; `input_ids` in
    /// `0..target_vocab_size`; top-k indices in `0..draft_vocab_size`). Nothing is added when a tensor or a value breaks them
    /// ([`Error::Refused`] names the tensor, the sample, the position, the value and the rule),
    /// or when the samples would exceed `num_samples`. A shard is written as soon as it is full.
    pub fn add(&mut self, n: u64, fields: &[(&str, &[u8])]) -> Result<()> {
        self.add_rows(n, fields, true)
    }

    /// [`Writer::add`] without the checks of values (the shapes are still checked): for tests
    /// that reproduce a reference file byte for byte from filler values. Never for data.
    #[cfg(test)]
    pub(crate) fn add_unchecked(&mut self, n: u64, fields: &[(&str, &[u8])]) -> Result<()> {
        self.add_rows(n, fields, false)
    }

    fn add_rows(&mut self, n: u64, fields: &[(&str, &[u8])], check: bool) -> Result<()> {
        let left = self.manifest.num_samples - self.next_sample();
        if n > left {
            return Err(Error::Invalid(format!(
                "adding {n} samples would exceed num_samples {} ({left} left)",
                self.manifest.num_samples
            )));
        }
        let given = given_fields(&self.specs, n, fields)?;
        if check {
            if let Some(breach) = rules::check(&self.manifest, &self.specs, &given).first() {
                let at = self.files.destination(&self.dir);
                return Err(breach.refusal(&at, self.next_sample()));
            }
        }
        let mut done = 0u64;
        while done < n {
            let want = self.manifest.rows_in_shard(self.shard);
            let take = (want - self.rows_buffered).min(n - done);
            for (f, spec) in self.specs.iter().enumerate() {
                let rb = spec.row_bytes();
                let src = &given[f][done as usize * rb..(done + take) as usize * rb];
                self.bufs[f].extend_from_slice(src);
            }
            self.rows_buffered += take;
            done += take;
            if self.rows_buffered == want {
                self.write_shard()?;
            }
        }
        Ok(())
    }

    fn write_shard(&mut self) -> Result<()> {
        let rows = self.rows_buffered as usize;
        let name = shard_name(self.shard);
        shard::write_shard_rows(&self.dir.join(&name), &self.specs, &self.bufs, rows)?;
        self.files.send(&self.dir, &name)?;
        for b in &mut self.bufs {
            b.clear();
        }
        self.rows_buffered = 0;
        self.shard += 1;
        Ok(())
    }

    /// Writes the target weights beside the shards, replacing any previous file by rename:
    /// EAGLE-3's `target_embeddings.safetensors` (one F32 table, `weight`), DSpark's
    /// `target_weights.safetensors` (`embed_tokens.weight` and `lm_head.weight`, in the cache
    /// dtype). Each table's bytes are little-endian values of that dtype.
    pub fn write_target_weights(&self, tables: &[WeightTable<'_>]) -> Result<()> {
        if self.complete_in_store() {
            return Err(Error::Exists {
                path: self.dir.join(self.manifest.schema().weights_file()),
                why: "the cache is complete in the store; a writer resuming it writes nothing"
                    .into(),
            });
        }
        weights::write(&self.dir, &self.manifest, tables)
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

    /// Finishes the cache: every sample must have been added (the last shard is written when
    /// its last sample arrives). Otherwise the cache stays resumable and the error says where.
    pub fn finish(mut self) -> Result<PathBuf> {
        let written = self.shard * self.manifest.shard_size;
        let total = self.manifest.num_samples;
        if self.next_sample() < total {
            return Err(Error::Incomplete {
                path: self.dir.clone(),
                present: written.min(total),
                total,
                detail: format!(
                    "{} not added; a resumed writer continues at sample {written}",
                    super::cache::span_words(
                        "sample",
                        self.next_sample(),
                        total.saturating_sub(1),
                        "was",
                        "were"
                    ),
                ),
            });
        }
        if self.complete_in_store() {
            return Ok(self.dir);
        }
        // The sidecar covers the manifest, every shard and the target weights.
        self.files.write_sidecar(&self.dir)?;
        if self.manifest.complete == Some(false) {
            // DSpark's commit record: the manifest marked complete, once all else is durable
            // (rewriting it keeps the sidecar true).
            let done = self.manifest.with_complete(true);
            manifest::write(&self.dir, &done)?;
            self.manifest = done;
        }
        fsutil::fsync_dir(&self.dir)?;
        // Streaming, the embeddings, the sidecar and manifest.json last are what is left to
        // upload.
        std::mem::take(&mut self.files).finish(&self.dir, &[])
    }
}

/// NeMo's `_ensure_output_dir_compatible`: a directory whose manifest records another run
/// (any key but `format_version` and `complete` differs) is refused, naming the keys, whether
/// or not it has shards yet, so that supervision of two runs is never mixed.
pub(crate) fn refuse_other_run(dir: &Path, m: &Manifest) -> Result<()> {
    let recorded = match manifest::read(dir) {
        Ok(r) => r,
        Err(Error::NotFound { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    let differ = m.differing_keys(&recorded);
    if differ.is_empty() && recorded.schema() == m.schema() {
        return Ok(());
    }
    Err(Error::Exists {
        path: dir.join(manifest::MANIFEST),
        why: format!(
            "already holds {} cache of another configuration (mismatched fields: {}); write \
             to a fresh directory or delete it (nothing was written)",
            recorded.schema().a(),
            differ.join(", ")
        ),
    })
}

/// The bytes of each stored tensor in `fields` for `n` samples, in the order of `specs`:
/// every tensor given, each with exactly `n` rows, and no other.
pub(crate) fn given_fields<'a>(
    specs: &[FieldSpec],
    n: u64,
    fields: &[(&str, &'a [u8])],
) -> Result<Vec<&'a [u8]>> {
    let mut given: Vec<&[u8]> = Vec::with_capacity(specs.len());
    for spec in specs {
        let bytes = fields
            .iter()
            .find(|(name, _)| *name == spec.name)
            .map(|(_, b)| *b)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "missing `{}` ({} {:?} per sample)",
                    spec.name, spec.dtype, spec.row
                ))
            })?;
        let want = spec.row_bytes() as u64 * n;
        if bytes.len() as u64 != want {
            return Err(Error::Invalid(format!(
                "`{}` holds {} bytes; {n} samples of {} {:?} need {want}",
                spec.name,
                bytes.len(),
                spec.dtype,
                spec.row
            )));
        }
        given.push(bytes);
    }
    if let Some((name, _)) = fields
        .iter()
        .find(|(name, _)| !specs.iter().any(|s| s.name == *name))
    {
        return Err(Error::Invalid(format!(
            "`{name}` is not a tensor of this cache (it stores {})",
            specs.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(given)
}
