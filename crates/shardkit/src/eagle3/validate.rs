//! Checking a cache (cheap and deep), summarising it, and switching its format version.

use std::path::Path;

use safetensors::Dtype;

use super::manifest::{self, Manifest};
use super::shard::{
    self, field_specs, is_temporary, shard_name, shard_set, shard_set_problem, ShardFile,
};
use super::writer::EMBEDDINGS;
use crate::error::{Error, Result};
use crate::json::Value;
pub use crate::report::Validation;

/// Checks the cache at `dir`: the manifest, the shard set, and every present shard's header,
/// tensor names, dtypes and shapes against the manifest. With `deep`, also every value: no NaN
/// or Inf in float fields; masks and `position_mask` 0 or 1, `position_mask` set only where
/// `loss_mask` is; `input_ids` below `target_vocab_size`; top-k indices inside the draft
/// vocabulary; and each `target_probs` row of a lossless cache summing to 1 within the dtype's
/// tolerance.
pub fn validate(dir: impl AsRef<Path>, deep: bool) -> Validation {
    let dir = &crate::storage::local_path(dir.as_ref());
    if crate::storage::is_remote(dir) {
        return validate_remote(dir, deep);
    }
    let mut v = Validation::new(dir);
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
    let specs = field_specs(&m);
    for &k in &present {
        if k >= m.num_shards() {
            continue;
        }
        let path = dir.join(shard_name(k));
        match ShardFile::open(&path, &specs, m.rows_in_shard(k)) {
            Err(e) => v.error_from(&e),
            Ok(f) if deep => deep_check(&f, &m, &mut v),
            Ok(_) => {}
        }
    }
    match std::fs::metadata(dir.join(EMBEDDINGS)) {
        Err(_) => v.note(
            dir.join(EMBEDDINGS),
            format!("no {EMBEDDINGS} (NeMo's training recipe needs it)"),
        ),
        Ok(_) => {
            if let Err(e) = super::cache::open_embeddings(dir) {
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

/// Float values of `bytes` in `dtype` (BF16, F16, F32), widened to f32.
fn floats(bytes: &[u8], dtype: Dtype) -> impl Iterator<Item = f32> + '_ {
    let size = dtype.bitsize() / 8;
    bytes.chunks_exact(size).map(move |c| match dtype {
        Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        _ => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
    })
}

fn i64s(bytes: &[u8]) -> impl Iterator<Item = i64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
}

/// Tolerance on a probability row's sum, by dtype: each of Vd values carries a relative
/// rounding error of half an ulp (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), and the row sums to 1.
fn sum_tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::BF16 => 1e-2,
        Dtype::F16 => 2e-3,
        _ => 1e-4,
    }
}

/// A cache in an object store, checked as [`validate`] checks a local one from one listing of
/// its objects: the manifest, the shard set, every present shard's header (its tensors against
/// the manifest, its size; a batch of headers in flight at a time), the embedding table's
/// header, temporaries; with `deep`, every byte against the checksums sidecar. The checks of
/// values read every byte of the shards, so they are made on a local copy only.
fn validate_remote(url: &Path, deep: bool) -> Validation {
    let mut v = Validation::new(url);
    let listed = crate::storage::Remote::parse(url).and_then(|r| Ok((r.list()?, r)));
    let (objects, remote) = match listed {
        Ok((objects, remote)) => (objects, remote),
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    let objects: std::collections::HashMap<String, u64> = objects.into_iter().collect();
    let m = match super::cache::remote_manifest(&remote, &objects) {
        Ok(m) => m,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
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
        if ShardFile::open_remote_many(&remote, group, &specs).is_err() {
            // One at a time, so that every bad header is reported.
            for one in group {
                if let Err(e) =
                    ShardFile::open_remote_many(&remote, std::slice::from_ref(one), &specs)
                {
                    v.error_from(&e);
                }
            }
        }
    }
    match objects.get(EMBEDDINGS) {
        None => v.note(
            remote.url_of(EMBEDDINGS),
            format!("no {EMBEDDINGS} (NeMo's training recipe needs it)"),
        ),
        Some(&size) => {
            if let Err(e) = super::cache::check_remote_embeddings(&remote, size) {
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

fn deep_check(f: &ShardFile, m: &Manifest, v: &mut Validation) {
    let specs = field_specs(m);
    let tensor = |field: &str| {
        let (i, s) = specs
            .iter()
            .enumerate()
            .find(|(_, s)| s.name == field)
            .expect("spec");
        // Deep checks run on local shards, which are always mapped.
        (
            f.tensor(i, s.row_bytes()).unwrap_or_default(),
            s.dtype,
            s.row.clone(),
        )
    };
    // Float fields: NaN / Inf.
    for field in ["aux_hidden_states", "target_probs", "target_probs_values"] {
        if !specs.iter().any(|s| s.name == field) {
            continue;
        }
        let (bytes, dtype, _) = tensor(field);
        let bad = floats(bytes, dtype).filter(|x| !x.is_finite()).count();
        if bad > 0 {
            v.error(
                f.path(),
                format!("`{field}` holds {bad} NaN or infinite values"),
            );
        }
    }
    // Masks.
    let (am, _, _) = tensor("attention_mask");
    let (lm, _, _) = tensor("loss_mask");
    let (pm, _, _) = tensor("position_mask");
    for (field, bytes) in [("attention_mask", am), ("loss_mask", lm)] {
        let bad = i64s(bytes).filter(|&x| x != 0 && x != 1).count();
        if bad > 0 {
            v.error(
                f.path(),
                format!("`{field}` holds {bad} values other than 0 and 1"),
            );
        }
    }
    let not_bool = pm.iter().filter(|&&b| b > 1).count();
    if not_bool > 0 {
        v.error(
            f.path(),
            format!("`position_mask` holds {not_bool} bytes other than 0 and 1"),
        );
    }
    let outside = pm
        .iter()
        .zip(i64s(lm))
        .filter(|&(&p, l)| p == 1 && l == 0)
        .count();
    if outside > 0 {
        v.error(
            f.path(),
            format!("`position_mask` is set at {outside} positions where `loss_mask` is 0"),
        );
    }
    if let Some(vocab) = m.target_vocab_size {
        let (ids, _, _) = tensor("input_ids");
        let bad = i64s(ids).filter(|&x| x < 0 || x as u64 >= vocab).count();
        if bad > 0 {
            v.error(
                f.path(),
                format!("`input_ids` holds {bad} ids outside 0..{vocab} (target_vocab_size)"),
            );
        }
    }
    match m.topk {
        Some(_) => {
            let (ix, _, _) = tensor("target_probs_indices");
            let vd = m.draft_vocab_size as i64;
            let bad = ix
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .filter(|&x| x < 0 || x >= vd)
                .count();
            if bad > 0 {
                v.error(
                    f.path(),
                    format!("`target_probs_indices` holds {bad} indices outside 0..{vd}"),
                );
            }
        }
        None => {
            let (probs, dtype, row) = tensor("target_probs");
            let vd = row[1];
            let tol = sum_tolerance(dtype);
            let values: Vec<f32> = floats(probs, dtype).collect();
            let mut bad = 0u64;
            let mut worst = 0f64;
            for chunk in values.chunks(vd.max(1)) {
                let sum: f64 = chunk.iter().map(|&x| f64::from(x)).sum();
                let err = (sum - 1.0).abs();
                if err > tol || !err.is_finite() {
                    bad += 1;
                    worst = worst.max(err);
                }
            }
            if bad > 0 {
                v.error(
                    f.path(),
                    format!(
                        "{bad} `target_probs` rows do not sum to 1 within {tol} (worst off by \
                     {worst:.3e})"
                    ),
                );
            }
        }
    }
}

/// A summary: the configuration, sizes and completeness.
pub fn inspect(dir: impl AsRef<Path>) -> Result<Value> {
    let dir = &crate::storage::local_path(dir.as_ref());
    // (manifest, shards present, their bytes, whether the embeddings file exists)
    let (m, present, on_disk, embeddings) = if crate::storage::is_remote(dir) {
        let remote = crate::storage::Remote::parse(dir)?;
        let objects = remote.list()?;
        let m = Manifest::parse(
            &remote.get(manifest::MANIFEST)?,
            &remote.url_of(manifest::MANIFEST),
        )?;
        let shards: Vec<(u64, u64)> = objects
            .iter()
            .filter_map(|(n, size)| Some((super::shard::shard_index(n)?, *size)))
            .collect();
        let embeddings = objects.iter().any(|(n, _)| n == EMBEDDINGS);
        (
            m,
            shards.iter().map(|s| s.0).collect(),
            shards.iter().map(|s| s.1).sum(),
            embeddings,
        )
    } else {
        let m = manifest::read(dir)?;
        let present = shard_set(dir)?;
        let on_disk: u64 = present
            .iter()
            .filter_map(|&i| std::fs::metadata(dir.join(shard_name(i))).ok())
            .map(|md| md.len())
            .sum();
        (m, present, on_disk, dir.join(EMBEDDINGS).is_file())
    };
    let present: std::collections::BTreeSet<u64> = present;
    let k = m.num_shards();
    let prefix = (0..k).take_while(|i| present.contains(i)).count() as u64;
    let samples_present = (prefix * m.shard_size).min(m.num_samples);
    let sample_bytes = m.sample_bytes().unwrap_or(0);
    let get = |key: &str| m.raw().get(key).cloned().unwrap_or(Value::Null);
    Ok(Value::Object(vec![
        ("format_version".into(), Value::int(m.format_version)),
        ("target_model".into(), get("target_model")),
        ("dtype".into(), Value::String(m.dtype.name().into())),
        ("seq_length".into(), Value::int(m.seq_length)),
        ("aux_hidden_dim".into(), Value::int(m.aux_hidden_dim)),
        ("draft_vocab_size".into(), Value::int(m.draft_vocab_size)),
        ("target_vocab_size".into(), get("target_vocab_size")),
        (
            "target_probs".into(),
            Value::String(match m.topk {
                Some(k) => format!("top-{k}"),
                None => "lossless".into(),
            }),
        ),
        ("num_samples".into(), Value::int(m.num_samples)),
        ("shard_size".into(), Value::int(m.shard_size)),
        ("shards_expected".into(), Value::int(k)),
        ("shards_present".into(), Value::int(present.len() as u64)),
        ("samples_present".into(), Value::int(samples_present)),
        (
            "complete".into(),
            Value::Bool(shard_set_problem(&present, k).is_none()),
        ),
        ("bytes_per_sample".into(), Value::int(sample_bytes)),
        ("bytes_on_disk".into(), Value::int(on_disk)),
        ("target_embeddings".into(), Value::Bool(embeddings)),
    ]))
}

/// Switches the cache at `dir` to `format_version` `version` by rewriting only the manifest
/// (2 adds `target_probs_topk: 0`, 1 removes it). A top-k cache cannot become version 1.
pub fn set_version(dir: impl AsRef<Path>, version: u8) -> Result<Manifest> {
    let dir = &crate::storage::local_path(dir.as_ref());
    if crate::storage::is_remote(dir) {
        return Err(Error::Invalid(format!(
            "{}: the manifest is rewritten in place, in a local directory; download the cache, \
             switch it and upload it (only manifest.json changes, so only it is uploaded again)",
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
