//! Checking a cache (cheap and deep), summarising it, and switching its format version.

use std::path::Path;

use super::manifest::{self, Layout, Manifest};
use super::rules;
use super::schema::Schema;
use super::shard::{
    self, field_specs, is_temporary, shard_name, shard_set, shard_set_problem, ShardFile,
};
use crate::commit::provenance;
use crate::error::{Error, Result};
use crate::io::{self, Location};
use crate::json::Value;
pub use crate::report::Validation;

/// Checks the cache at `dir`: the manifest, the shard set, and every present shard's header,
/// tensor names, dtypes and shapes against the manifest. With `deep`, also every value: no NaN
/// or Inf in float fields, no negative probability; masks and `position_mask` 0 or 1, `position_mask` set only where
/// `loss_mask` is; `input_ids` in `0..target_vocab_size`; top-k indices inside the draft
/// vocabulary; and each `target_probs` row of a lossless cache summing to 1 within the dtype's
/// tolerance (1e-2 bf16, 2e-3 fp16, 1e-4 fp32). These are the rules the writer refuses a
/// batch for, so a cache shardkit wrote passes them.
pub fn validate(dir: impl AsRef<Path>, deep: bool) -> Validation {
    let location = Location::parse(dir.as_ref());
    let dir = &match &location {
        Ok(l) => l.to_path(),
        Err(_) => dir.as_ref().to_path_buf(),
    };
    if !location.as_ref().is_ok_and(Location::is_local) {
        return validate_remote(dir, location, deep);
    }
    let mut v = Validation::new(dir);
    if let Some(e) = super::parts::unfinished(dir) {
        v.error_from(&e);
        return v;
    }
    let m = match manifest::read(dir) {
        Ok(m) => m,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    let present = match shard_set(dir) {
        Ok(p) => p,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    if let Some(problem) = shard_set_problem(&present, m.num_shards()) {
        v.error(dir, problem);
    }
    if !m.is_complete() {
        v.error(dir.join(manifest::MANIFEST), INCOMPLETE_MARKER);
    }
    let specs = field_specs(&m);
    for &k in &present {
        if k >= m.num_shards() {
            continue;
        }
        let path = dir.join(shard_name(k));
        match ShardFile::open(&path, &specs, m.rows_in_shard(k)) {
            Err(e) => v.error_from(&e),
            Ok(f) if deep => deep_check(&f, k, &m, &mut v),
            Ok(_) => {}
        }
    }
    let weights_file = m.schema().weights_file();
    match std::fs::metadata(dir.join(weights_file)) {
        Err(_) => v.note(
            dir.join(weights_file),
            format!("no {weights_file} (NeMo's training recipe needs it)"),
        ),
        Ok(_) => {
            if let Err(e) = super::weights::open(dir, &m) {
                v.error_from(&e);
            }
        }
    }
    if deep {
        // Beyond the values: every byte against the checksums sidecar, when there is one.
        crate::checksum::verify_into(dir, &mut v);
    }
    let names = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    note_temporaries(&mut v, dir, names);
    v
}

/// A cache in an object store, checked as [`validate`] checks a local one from one listing of
/// its objects: the manifest, the shard set, every present shard's header (its tensors against
/// the manifest, its size; a batch of headers in flight at a time), the embedding table's
/// header, temporaries; with `deep`, every byte against the checksums sidecar. The checks of
/// values read every byte of the shards, so they are made on a local copy only.
fn validate_remote(url: &Path, location: Result<Location>, deep: bool) -> Validation {
    let mut v = Validation::new(url);
    // A cache being written in parts has no manifest.json until its commit: say so.
    if let Some(e) = super::parts::unfinished(url) {
        v.error_from(&e);
        return v;
    }
    let listed = location
        .and_then(|l| io::open_uncached(&l))
        .and_then(|r| Ok((r.list()?, r)));
    let (objects, remote) = match listed {
        Ok((objects, remote)) => (objects, remote),
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    let objects: std::collections::HashMap<String, u64> = objects.into_iter().collect();
    let m = match super::cache::remote_manifest(&*remote, &objects) {
        Ok(m) => m,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    if !m.is_complete() {
        v.error(remote.path_of(manifest::MANIFEST), INCOMPLETE_MARKER);
    }
    let present: std::collections::BTreeSet<u64> = objects
        .keys()
        .filter_map(|n| shard::shard_index(n))
        .collect();
    if let Some(problem) = shard_set_problem(&present, m.num_shards()) {
        v.error(url, problem);
    }
    let specs = field_specs(&m);
    let shards: Vec<_> = present
        .iter()
        .filter(|&&k| k < m.num_shards())
        .map(|&k| super::cache::remote_shard(&m, &objects, k))
        .collect();
    for group in shards.chunks(HEADERS_AT_ONCE) {
        if ShardFile::open_remote_many(&*remote, group, &specs, &io::Stop::never()).is_err() {
            // One at a time, so that every bad header is reported.
            for one in group {
                if let Err(e) = ShardFile::open_remote_many(
                    &*remote,
                    std::slice::from_ref(one),
                    &specs,
                    &io::Stop::never(),
                ) {
                    v.error_from(&e);
                }
            }
        }
    }
    let weights_file = m.schema().weights_file();
    match objects.get(weights_file) {
        None => v.note(
            remote.path_of(weights_file),
            format!("no {weights_file} (NeMo's training recipe needs it)"),
        ),
        Some(&size) => {
            if let Err(e) = super::weights::check_remote(&*remote, &m, size) {
                v.error_from(&e);
            }
        }
    }
    if deep {
        v.note(
            url,
            "the values (finite floats, masks, ids, probabilities summing to 1) are checked on \
             a local copy only (shardkit download): here every shard's header, and every byte \
             against the checksums sidecar",
        );
        crate::checksum::verify_into(url, &mut v);
    }
    note_temporaries(
        &mut v,
        url,
        objects
            .keys()
            .filter(|n| !n.contains('/'))
            .cloned()
            .collect(),
    );
    v
}

/// Shard headers fetched together by a remote [`validate`].
const HEADERS_AT_ONCE: usize = 256;

/// A note naming the temporary files of an interrupted write among `names`.
fn note_temporaries(v: &mut Validation, dir: &Path, mut names: Vec<String>) {
    names.retain(|n| is_temporary(n));
    names.sort();
    if !names.is_empty() {
        v.note(
            dir,
            format!(
                "{} temporary files of an interrupted write (ignored; a resumed writer removes \
                 them): {}",
                names.len(),
                names.join(", ")
            ),
        );
    }
}

/// The finding for a DSpark manifest marked `"complete": false`, which NeMo's reader refuses.
const INCOMPLETE_MARKER: &str = "says \"complete\": false: the producer that began this cache \
     was interrupted or is still running, and NeMo's reader refuses it; rerun it with the same \
     configuration (or shardkit part writers / a resumed writer) to finish it";

/// Checks every value of shard `k` against the cache's rules (the writer's, [`rules::check`]):
/// one finding per rule broken, with how many values break it and the first one.
fn deep_check(f: &ShardFile, k: u64, m: &Manifest, v: &mut Validation) {
    let specs = field_specs(m);
    // Deep checks run on local shards, which are always mapped.
    let data: Vec<&[u8]> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| f.tensor(i, s.row_bytes()).unwrap_or_default())
        .collect();
    for breach in rules::check(m, &specs, &data) {
        v.error(f.path(), breach.finding(k * m.shard_size));
    }
}

/// A summary: the configuration, sizes and completeness.
pub fn inspect(dir: impl AsRef<Path>) -> Result<Value> {
    let location = Location::parse(dir.as_ref())?;
    let dir = &location.to_path();
    // (manifest, shards present, their bytes, whether the embeddings file exists)
    let (m, present, on_disk, embeddings) = if !location.is_local() {
        let remote = io::open_uncached(&location)?;
        let objects = remote.list()?;
        let m = Manifest::parse(
            &remote.get(manifest::MANIFEST)?,
            &remote.path_of(manifest::MANIFEST),
        )?;
        let shards: Vec<(u64, u64)> = objects
            .iter()
            .filter_map(|(n, size)| Some((super::shard::shard_index(n)?, *size)))
            .collect();
        let embeddings = objects.iter().any(|(n, _)| n == m.schema().weights_file());
        (
            m,
            shards.iter().map(|s| s.0).collect(),
            shards.iter().map(|s| s.1).sum(),
            embeddings,
        )
    } else {
        if let Some(e) = super::parts::unfinished(dir) {
            return Err(e);
        }
        let m = manifest::read(dir)?;
        let present = shard_set(dir)?;
        let on_disk: u64 = present
            .iter()
            .filter_map(|&i| std::fs::metadata(dir.join(shard_name(i))).ok())
            .map(|md| md.len())
            .sum();
        let weights = dir.join(m.schema().weights_file()).is_file();
        (m, present, on_disk, weights)
    };
    let present: std::collections::BTreeSet<u64> = present;
    let k = m.num_shards();
    let prefix = (0..k).take_while(|i| present.contains(i)).count() as u64;
    let samples_present = (prefix * m.shard_size).min(m.num_samples);
    let sample_bytes = m.sample_bytes().unwrap_or(0);
    let get = |key: &str| m.raw().get(key).cloned().unwrap_or(Value::Null);
    let dtype = Value::String(super::manifest::dtype_name(m.dtype).into());
    let mut out = vec![
        ("schema".into(), Value::String(m.schema().name().into())),
        ("format_version".into(), Value::int(m.format_version)),
        (
            "manifest_variant".into(),
            Value::String(manifest_variant(&m)),
        ),
        ("input_identity".into(), input_identity(&m)),
        ("target_model".into(), get("target_model")),
        ("dtype".into(), dtype),
        ("seq_length".into(), Value::int(m.seq_length)),
        ("target_vocab_size".into(), get("target_vocab_size")),
    ];
    match &m.layout {
        Layout::Eagle3(l) => out.extend([
            ("aux_hidden_dim".into(), Value::int(l.aux_hidden_dim)),
            ("draft_vocab_size".into(), Value::int(l.draft_vocab_size)),
            (
                "target_probs".into(),
                Value::String(match l.topk {
                    Some(k) => format!("top-{k}"),
                    None => "lossless".into(),
                }),
            ),
        ]),
        Layout::DSpark(l) => out.extend([
            ("target_model_type".into(), get("target_model_type")),
            ("target_layer_ids".into(), get("target_layer_ids")),
            ("target_hidden_dim".into(), Value::int(l.target_hidden_dim)),
            (
                "target_last_hidden_dim".into(),
                Value::int(l.target_last_hidden_dim),
            ),
        ]),
    }
    let marker = m.complete.map_or(Value::Null, Value::Bool);
    out.extend([
        ("num_samples".into(), Value::int(m.num_samples)),
        ("shard_size".into(), Value::int(m.shard_size)),
        ("shards_expected".into(), Value::int(k)),
        ("shards_present".into(), Value::int(present.len() as u64)),
        ("samples_present".into(), Value::int(samples_present)),
        // Every shard there, and (DSpark) not marked incomplete by its producer.
        (
            "complete".into(),
            Value::Bool(shard_set_problem(&present, k).is_none() && m.is_complete()),
        ),
        // DSpark's `complete` marker as the manifest records it (null: absent).
        ("complete_marker".into(), marker),
        ("bytes_per_sample".into(), Value::int(sample_bytes)),
        ("bytes_on_disk".into(), Value::int(on_disk)),
        (
            "target_weights_file".into(),
            Value::String(m.schema().weights_file().into()),
        ),
        ("target_weights".into(), Value::Bool(embeddings)),
    ]);
    if m.schema() == Schema::Eagle3 {
        // The key EAGLE-3's summary always had.
        out.push(("target_embeddings".into(), Value::Bool(embeddings)));
        // What a top-k producer recorded of the truncation, merged over its shards' notes
        // (null when none did).
        out.push(("topk_retained".into(), retained_summary(dir)?));
    }
    // What a producer recorded about the model and inputs (null when none did).
    out.push((
        "provenance".into(),
        provenance::read(dir)?.unwrap_or(Value::Null),
    ));
    Ok(Value::Object(out))
}

/// The keys that record a run's input identity: EAGLE-3's arrived inside version 2 without a
/// version bump (NeMo PR #3396), DSpark's came with its manifest.
fn identity_keys(schema: Schema) -> &'static [&'static str] {
    match schema {
        Schema::Eagle3 => &["input_data", "split", "shuffle_seed"],
        Schema::DSpark => &[
            "train_data_path",
            "train_split",
            "shuffle_seed",
            "mask_reasoning_content",
            "chat_template_sha256",
        ],
    }
}

/// The input-identity keys the manifest has, with their values; null when it has none.
fn input_identity(m: &Manifest) -> Value {
    let found: Vec<(String, Value)> = identity_keys(m.schema())
        .iter()
        .filter_map(|k| Some((k.to_string(), m.raw().get(k)?.clone())))
        .collect();
    if found.is_empty() {
        Value::Null
    } else {
        Value::Object(found)
    }
}

/// Which variant of its member's manifest `m` is, in words: the version, and the keys that
/// came and went inside it (EAGLE-3 v2 with or without the input identity, DSpark with or
/// without the `complete` marker).
fn manifest_variant(m: &Manifest) -> String {
    let keys = identity_keys(m.schema());
    let have: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| m.raw().get(k).is_some())
        .collect();
    match m.schema() {
        Schema::Eagle3 => {
            let identity = if have.len() == keys.len() {
                "with the input identity (input_data, split, shuffle_seed)".to_string()
            } else if have.is_empty() {
                "without the input identity (as NeMo wrote it before PR #3396)".to_string()
            } else {
                format!("with part of the input identity ({})", have.join(", "))
            };
            format!("v{} {identity}", m.format_version)
        }
        Schema::DSpark => format!(
            "v{} {}",
            m.format_version,
            match m.complete {
                Some(_) => "with the complete marker",
                None => "without the complete marker (as NeMo wrote it before the marker)",
            }
        ),
    }
}

/// The note prefix of a top-k shard's retained probability mass (`shardkit.precompute_eagle3`
/// writes `topk-retained-SHARD.json`: `{"shard", "topk", "positions", "mean", "min", "kl_mean",
/// ...}` over the shard's supervised positions).
const RETAINED_NOTE: &str = "topk-retained-";

/// The retained-mass notes of the cache at `dir` merged: shards noted, positions, the smallest
/// retained mass, and the position-weighted mean mass and mean KL (full ‖ truncated).
fn retained_summary(dir: &Path) -> Result<Value> {
    let notes = crate::commit::notes::list(dir, RETAINED_NOTE)?;
    if notes.is_empty() {
        return Ok(Value::Null);
    }
    let (mut positions, mut mass, mut kl, mut min) = (0u64, 0f64, 0f64, f64::INFINITY);
    for (name, bytes) in &notes {
        let src = dir.join(crate::commit::notes::DIR).join(name);
        let v = crate::json::parse(bytes).map_err(|e| Error::format(&src, e.to_string()))?;
        let n = v
            .get("positions")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            .max(0) as u64;
        if n == 0 {
            continue;
        }
        let num = |k: &str| {
            v.get(k).and_then(Value::as_f64).ok_or_else(|| {
                Error::format(&src, format!("a retained-mass note needs a number `{k}`"))
            })
        };
        positions += n;
        mass += num("mean")? * n as f64;
        kl += num("kl_mean")? * n as f64;
        min = min.min(num("min")?);
    }
    let real = |x: f64| Value::Number(format!("{x:e}"));
    let per = |x: f64| {
        if positions == 0 {
            0.0
        } else {
            x / positions as f64
        }
    };
    Ok(Value::Object(vec![
        ("shards".into(), Value::int(notes.len() as u64)),
        ("positions".into(), Value::int(positions)),
        ("min".into(), real(if positions == 0 { 0.0 } else { min })),
        ("mean".into(), real(per(mass))),
        ("kl_mean".into(), real(per(kl))),
    ]))
}

/// Switches the cache at `dir` to `format_version` `version` by rewriting only the manifest
/// (2 adds `target_probs_topk: 0`, 1 removes it). A top-k cache cannot become version 1.
pub fn set_version(dir: impl AsRef<Path>, version: u8) -> Result<Manifest> {
    let local = Location::parse(dir.as_ref()).is_ok_and(|l| l.is_local());
    let dir = &io::local_path(dir.as_ref());
    if !local {
        return Err(Error::Invalid(format!(
            "{}: the manifest is rewritten in place, in a local directory; download the cache, \
             switch it and upload it (only manifest.json changes, so only it is uploaded again)",
            dir.display()
        )));
    }
    // The requested version is an argument, not the cache's content: refused as such.
    if !(1..=2).contains(&version) {
        return Err(Error::Invalid(format!(
            "{}: format_version {version} is not supported (1 or 2)",
            dir.display()
        )));
    }
    let m = manifest::read(dir)?;
    let new = m.with_version(version).map_err(|e| match e {
        Error::Invalid(why) => Error::format(dir.join(manifest::MANIFEST), why),
        e => e,
    })?;
    shard::remove_temporaries(dir)?;
    manifest::write(dir, &new)?;
    Ok(new)
}
