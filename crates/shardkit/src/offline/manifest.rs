//! `manifest.json`: the run configuration of a cache (eagle3.md §4–5, dspark.md §2).
//!
//! The file is Python's `json.dump({"format_version": V, **manifest}, indent=2, sort_keys=True)`:
//! ASCII-escaped, keys sorted, one list element per line, no trailing newline. The manifest is
//! kept as JSON (so keys shardkit does not interpret survive a rewrite) next to the typed fields
//! every reader needs; `selected_token_ids` keeps its order. Which member of the family it
//! describes follows from its keys ([`Schema::of_manifest`]).

use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::schema::Schema;
use crate::error::{Error, Result};
use crate::fsutil;
use crate::json::{self, Escape, Value};

/// The manifest's file name.
pub(crate) const MANIFEST: &str = "manifest.json";

/// The manifest's name of a float dtype (BF16, F16 or F32): "bf16", "fp16" or "fp32".
pub(crate) fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::BF16 => "bf16",
        Dtype::F16 => "fp16",
        _ => "fp32",
    }
}

/// The float dtype a manifest names.
fn parse_dtype(s: &str) -> Option<Dtype> {
    match s {
        "bf16" => Some(Dtype::BF16),
        "fp16" => Some(Dtype::F16),
        "fp32" => Some(Dtype::F32),
        _ => None,
    }
}

/// A parsed manifest: the JSON object as given, and the fields a reader interprets.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The object without `format_version` and `complete` (written from the fields below):
    /// the run configuration, which a resume compares key by key.
    raw: Value,
    /// 1 or 2 (EAGLE-3), 1 (DSpark).
    pub format_version: u8,
    /// `num_samples` (N).
    pub num_samples: u64,
    /// `shard_size` (s ≥ 1).
    pub shard_size: u64,
    /// `seq_length` (S).
    pub seq_length: u64,
    /// The float dtype of the float fields: BF16 (`"bf16"`, the reference's default), F16
    /// (`"fp16"`) or F32 (`"fp32"`).
    pub dtype: Dtype,
    /// `target_vocab_size`, when recorded.
    pub target_vocab_size: Option<u64>,
    /// DSpark's `complete` marker: `Some(false)` while its producer runs, `Some(true)` once
    /// every shard is down, `None` when absent (EAGLE-3, and DSpark caches older than the
    /// marker, which NeMo reads as complete).
    pub complete: Option<bool>,
    /// What the member's samples hold.
    pub layout: Layout,
}

/// The member-specific part of a manifest: the sizes of a sample's tensors.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    /// EAGLE-3: auxiliary hidden states and the draft vocabulary's probabilities.
    Eagle3(Eagle3Layout),
    /// DSpark: intermediate and final hidden states of the target.
    DSpark(DSparkLayout),
}

/// EAGLE-3's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Layout {
    /// `aux_hidden_dim` (3H).
    pub aux_hidden_dim: u64,
    /// `draft_vocab_size` (Vd), equal to the length of `selected_token_ids`.
    pub draft_vocab_size: u64,
    /// `target_probs_topk`: `Some(k)` when shards hold top-k pairs (`0 < k < Vd`, v2 only).
    pub topk: Option<u64>,
    /// Draft column j is target token `selected_token_ids[j]` (order kept).
    pub selected_token_ids: Vec<u64>,
}

/// DSpark's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct DSparkLayout {
    /// `target_hidden_dim`: the captured layers' hidden states side by side
    /// (`hidden_size · len(target_layer_ids)`).
    pub target_hidden_dim: u64,
    /// `target_last_hidden_dim`: the final hidden state (`hidden_size`).
    pub target_last_hidden_dim: u64,
}

fn uint(obj: &Value, key: &str, path: &Path) -> Result<u64> {
    match obj.get(key) {
        None => Err(Error::format(path, format!("missing key `{key}`"))),
        Some(v) => v
            .as_i64()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| {
                Error::format(
                    path,
                    format!(
                        "`{key}` must be a non-negative integer, found {}",
                        v.type_name()
                    ),
                )
            }),
    }
}

/// The member `obj` describes, or the error saying why none.
fn schema_of(obj: &Value, path: &Path) -> Result<Schema> {
    Schema::of_manifest(obj).ok_or_else(|| {
        let both = Schema::ALL
            .iter()
            .all(|s| obj.get(s.marker_key()).is_some());
        Error::format(
            path,
            if both {
                "has both `aux_hidden_dim` (EAGLE-3) and `target_hidden_dim` (DSpark); a cache \
                 manifest describes one of them"
            } else {
                "has neither `aux_hidden_dim` (an EAGLE-3 cache) nor `target_hidden_dim` (a \
                 DSpark cache)"
            },
        )
    })
}

impl Manifest {
    /// Parses the manifest text of `path` (for messages); the member follows from its keys,
    /// and its version must be one that member has.
    pub(crate) fn parse(text: &[u8], path: &Path) -> Result<Manifest> {
        let v = json::parse(text).map_err(|e| Error::format(path, e.to_string()))?;
        if !matches!(v, Value::Object(_)) {
            return Err(Error::format(path, "is not a JSON object"));
        }
        let schema = schema_of(&v, path)?;
        let version = match v.get("format_version") {
            None => {
                return Err(Error::format(
                    path,
                    format!(
                        "no `format_version`; {} cache manifest has format_version {}",
                        schema.a(),
                        schema.versions_text()
                    ),
                ))
            }
            Some(fv) => fv
                .as_i64()
                .and_then(|n| u8::try_from(n).ok())
                .filter(|n| schema.versions().contains(n))
                .ok_or_else(|| {
                    Error::format(
                        path,
                        format!(
                            "format_version {} is not supported ({} caches have {})",
                            json::to_compact(fv, false, Escape::Utf8),
                            schema.title(),
                            schema.versions_text()
                        ),
                    )
                })?,
        };
        let complete = match v.get("complete") {
            None => None,
            Some(Value::Bool(b)) if schema.has_complete_marker() => Some(*b),
            Some(other) if schema.has_complete_marker() => {
                return Err(Error::format(
                    path,
                    format!(
                        "`complete` must be true or false, found {}",
                        other.type_name()
                    ),
                ))
            }
            // EAGLE-3 has no marker: the key is kept as configuration.
            Some(_) => None,
        };
        let mut m = Self::from_object(v, schema, version, path)?;
        m.complete = complete;
        Ok(m)
    }

    /// A manifest to write: `object` is the run configuration (`format_version` and
    /// `complete` inside it are ignored; `version` decides, and the writer sets `complete`).
    /// Every key the reference producer writes is required. EAGLE-3: `target_probs_topk` is
    /// added as 0 in version 2 and refused above 0 in version 1. DSpark: the hidden sizes
    /// must be `build_cache_manifest`'s (`target_hidden_dim = hidden_size ·
    /// len(target_layer_ids)`, `target_last_hidden_dim = hidden_size`).
    pub(crate) fn for_writing(object: &Value, version: u8) -> Result<Manifest> {
        let path = Path::new(MANIFEST);
        if !matches!(object, Value::Object(_)) {
            return Err(Error::Invalid(format!(
                "the manifest must be a JSON object, found {}",
                object.type_name()
            )));
        }
        let schema = schema_of(object, path).map_err(|e| match e {
            Error::Format { rule, .. } => Error::Invalid(format!("the manifest {rule}")),
            e => e,
        })?;
        if !schema.versions().contains(&version) {
            return Err(Error::Invalid(format!(
                "format_version {version} is not supported ({} caches have {})",
                schema.title(),
                schema.versions_text()
            )));
        }
        for key in schema.producer_keys() {
            if object.get(key).is_none() {
                return Err(Error::Invalid(format!(
                    "the {} manifest is missing `{key}`",
                    schema.title()
                )));
            }
        }
        let mut obj = object.clone();
        if let Value::Object(m) = &mut obj {
            m.retain(|(k, _)| {
                k != "format_version" && !(schema.has_complete_marker() && k == "complete")
            });
        }
        match (schema, version) {
            (Schema::Eagle3, 1) => {
                let k = obj
                    .get("target_probs_topk")
                    .map(|v| v.as_i64().unwrap_or(-1));
                if k.is_some_and(|k| k != 0) {
                    return Err(Error::Invalid(
                        "format_version 1 has no top-k target_probs; write version 2".into(),
                    ));
                }
                if let Value::Object(m) = &mut obj {
                    m.retain(|(k, _)| k != "target_probs_topk");
                }
            }
            (Schema::Eagle3, _) => {
                if obj.get("target_probs_topk").is_none() {
                    obj.set("target_probs_topk", Value::int(0));
                }
            }
            (Schema::DSpark, _) => check_dspark_sizes(&obj)?,
        }
        Self::from_object(obj, schema, version, path).map_err(|e| match e {
            Error::Format { rule, .. } => Error::Invalid(format!("manifest: {rule}")),
            e => e,
        })
    }

    fn from_object(obj: Value, schema: Schema, version: u8, path: &Path) -> Result<Manifest> {
        // Sorted once: the file is written sorted, and equal manifests compare equal.
        let mut obj = obj.sorted();
        if let Value::Object(m) = &mut obj {
            m.retain(|(k, _)| {
                k != "format_version" && !(schema.has_complete_marker() && k == "complete")
            });
        } else {
            return Err(Error::format(path, "is not a JSON object"));
        }
        let dtype_text = obj
            .get("dtype")
            .ok_or_else(|| Error::format(path, "missing key `dtype`"))?;
        let dtype = dtype_text.as_str().and_then(parse_dtype).ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "`dtype` must be \"bf16\", \"fp16\" or \"fp32\", found {}",
                    json::to_compact(dtype_text, false, Escape::Utf8)
                ),
            )
        })?;
        let layout = match schema {
            Schema::Eagle3 => Layout::Eagle3(eagle3_layout(&obj, version, path)?),
            Schema::DSpark => Layout::DSpark(DSparkLayout {
                target_hidden_dim: uint(&obj, "target_hidden_dim", path)?,
                target_last_hidden_dim: uint(&obj, "target_last_hidden_dim", path)?,
            }),
        };
        let shard_size = uint(&obj, "shard_size", path)?;
        if shard_size == 0 {
            return Err(Error::format(path, "`shard_size` must be at least 1"));
        }
        let target_vocab_size = match obj.get("target_vocab_size") {
            None => None,
            Some(_) => Some(uint(&obj, "target_vocab_size", path)?),
        };
        let m = Manifest {
            format_version: version,
            num_samples: uint(&obj, "num_samples", path)?,
            shard_size,
            seq_length: uint(&obj, "seq_length", path)?,
            dtype,
            target_vocab_size,
            complete: None,
            layout,
            raw: obj,
        };
        // Guard the arithmetic every reader does with these numbers.
        m.sample_bytes()
            .and_then(|b| b.checked_mul(m.shard_size))
            .ok_or_else(|| Error::format(path, "the sizes it describes overflow 64 bits"))?;
        if m.num_shards() > 1_000_000 {
            return Err(Error::format(
                path,
                format!(
                    "{} samples in shards of {} need {} shards; 6-digit shard names allow at \
                     most 1,000,000",
                    m.num_samples,
                    m.shard_size,
                    m.num_shards()
                ),
            ));
        }
        Ok(m)
    }

    /// Which member of the family this manifest describes.
    pub fn schema(&self) -> Schema {
        match self.layout {
            Layout::Eagle3(_) => Schema::Eagle3,
            Layout::DSpark(_) => Schema::DSpark,
        }
    }

    /// EAGLE-3's sizes, for an EAGLE-3 manifest.
    pub fn eagle3(&self) -> Option<&Eagle3Layout> {
        match &self.layout {
            Layout::Eagle3(e) => Some(e),
            Layout::DSpark(_) => None,
        }
    }

    /// `target_probs_topk` of an EAGLE-3 top-k cache; `None` otherwise.
    pub fn topk(&self) -> Option<u64> {
        self.eagle3().and_then(|e| e.topk)
    }

    /// Whether readers may serve it: not a DSpark manifest its producer marked incomplete.
    pub fn is_complete(&self) -> bool {
        self.complete != Some(false)
    }

    /// This manifest with the `complete` marker set (members without one are unchanged).
    pub(crate) fn with_complete(&self, complete: bool) -> Manifest {
        let mut m = self.clone();
        if self.schema().has_complete_marker() {
            m.complete = Some(complete);
        }
        m
    }

    /// The JSON object as written (with `format_version`, and `complete` when set).
    pub fn to_value(&self) -> Value {
        let mut v = self.raw.clone();
        v.set("format_version", Value::int(self.format_version));
        if let Some(c) = self.complete {
            v.set("complete", Value::Bool(c));
        }
        v
    }

    /// The file's bytes, exactly as Python `json.dump(obj, f, indent=2, sort_keys=True)`.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        json::to_pretty(&self.to_value().sorted(), 2, Escape::Ascii).into_bytes()
    }

    /// Shards a complete cache has: `ceil(num_samples / shard_size)`.
    pub(crate) fn num_shards(&self) -> u64 {
        self.num_samples.div_ceil(self.shard_size)
    }

    /// Samples in shard `k` (the last one may be short).
    pub(crate) fn rows_in_shard(&self, k: u64) -> u64 {
        (self.num_samples - (k * self.shard_size).min(self.num_samples)).min(self.shard_size)
    }

    /// Bytes one sample takes in a shard (eagle3.md §2.3, dspark.md §3); None on overflow.
    pub fn sample_bytes(&self) -> Option<u64> {
        let s = self.seq_length;
        let e = self.dtype.bitsize() as u64 / 8;
        match &self.layout {
            Layout::Eagle3(l) => {
                let probs = match l.topk {
                    None => s.checked_mul(l.draft_vocab_size)?.checked_mul(e)?,
                    Some(k) => s.checked_mul(k)?.checked_mul(e + 4)?,
                };
                s.checked_mul(25)?
                    .checked_add(s.checked_mul(l.aux_hidden_dim)?.checked_mul(e)?)?
                    .checked_add(probs)
            }
            Layout::DSpark(l) => {
                let hidden = l.target_hidden_dim.checked_add(l.target_last_hidden_dim)?;
                s.checked_mul(16)?
                    .checked_add(s.checked_mul(hidden)?.checked_mul(e)?)
            }
        }
    }

    /// The keys (other than `format_version` and `complete`) whose values differ from
    /// `other`'s: what a resume refuses, listed, as NeMo's `manifest_mismatch_fields` lists
    /// them. Numbers compare by value (`1` equals `1.0`), as in Python.
    pub(crate) fn differing_keys(&self, other: &Manifest) -> Vec<String> {
        json::differing_keys(&self.raw, &other.raw)
    }

    /// The run configuration as given (without `format_version` and `complete`).
    pub(crate) fn raw(&self) -> &Value {
        &self.raw
    }

    /// This manifest switched to `version`. EAGLE-3: 2 adds `target_probs_topk: 0`, 1 removes
    /// it; only a lossless cache can be version 1.
    pub(crate) fn with_version(&self, version: u8) -> Result<Manifest> {
        let schema = self.schema();
        if !schema.versions().contains(&version) {
            return Err(Error::Invalid(format!(
                "format_version {version} is not supported ({} caches have {})",
                schema.title(),
                schema.versions_text()
            )));
        }
        if version == 1 && self.topk().is_some() {
            return Err(Error::Invalid(
                "a top-k cache cannot be format_version 1 (version 1 has no top-k target_probs)"
                    .into(),
            ));
        }
        let mut obj = self.raw.clone();
        if let (Value::Object(m), Schema::Eagle3) = (&mut obj, schema) {
            if version == 1 {
                m.retain(|(k, _)| k != "target_probs_topk");
            } else if !m.iter().any(|(k, _)| k == "target_probs_topk") {
                m.push(("target_probs_topk".into(), Value::int(0)));
            }
        }
        let mut m = Self::from_object(obj, schema, version, Path::new(MANIFEST))?;
        m.complete = self.complete;
        Ok(m)
    }
}

/// EAGLE-3's sizes from its manifest object.
fn eagle3_layout(obj: &Value, version: u8, path: &Path) -> Result<Eagle3Layout> {
    let selected = match obj.get("selected_token_ids") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_i64().and_then(|i| u64::try_from(i).ok()))
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| {
                Error::format(path, "`selected_token_ids` must hold non-negative integers")
            })?,
        Some(v) => {
            return Err(Error::format(
                path,
                format!(
                    "`selected_token_ids` must be a list, found {}",
                    v.type_name()
                ),
            ))
        }
        None => return Err(Error::format(path, "missing key `selected_token_ids`")),
    };
    let draft_vocab_size = uint(obj, "draft_vocab_size", path)?;
    if draft_vocab_size != selected.len() as u64 {
        return Err(Error::format(
            path,
            format!(
                "draft_vocab_size {draft_vocab_size} differs from the {} selected_token_ids",
                selected.len()
            ),
        ));
    }
    let topk = match (version, obj.get("target_probs_topk")) {
        (2, Some(_)) => {
            let k = uint(obj, "target_probs_topk", path)?;
            (k > 0 && k < draft_vocab_size).then_some(k)
        }
        _ => None,
    };
    Ok(Eagle3Layout {
        aux_hidden_dim: uint(obj, "aux_hidden_dim", path)?,
        draft_vocab_size,
        topk,
        selected_token_ids: selected,
    })
}

/// A DSpark manifest to write has `build_cache_manifest`'s sizes: a reader sizes tensors from
/// `target_hidden_dim` and `target_last_hidden_dim` alone, so a manifest whose sizes disagree
/// with the hidden size and layers it records would describe tensors of another shape.
fn check_dspark_sizes(obj: &Value) -> Result<()> {
    let path = Path::new(MANIFEST);
    let hidden = uint(obj, "hidden_size", path)?;
    let layers = match obj.get("target_layer_ids") {
        Some(Value::Array(ids)) if ids.iter().all(|x| x.as_i64().is_some_and(|i| i >= 0)) => {
            ids.len() as u64
        }
        _ => {
            return Err(Error::Invalid(
                "the DSpark manifest's `target_layer_ids` must be a list of layer indices".into(),
            ))
        }
    };
    let want = (hidden.saturating_mul(layers), hidden);
    let have = (
        uint(obj, "target_hidden_dim", path)?,
        uint(obj, "target_last_hidden_dim", path)?,
    );
    if have != want {
        return Err(Error::Invalid(format!(
            "the DSpark manifest's target_hidden_dim {} and target_last_hidden_dim {} must be \
             hidden_size × len(target_layer_ids) = {} and hidden_size = {}",
            have.0, have.1, want.0, want.1
        )));
    }
    Ok(())
}

/// The error for a `dir` without manifest.json: no such directory, not a directory, or a
/// directory that is no cache (naming the caches one level below it, if any).
pub(crate) fn missing(dir: &Path) -> Error {
    if !dir.exists() {
        return Error::NotFound {
            path: dir.to_path_buf(),
            what: "no such directory".into(),
        };
    }
    if !dir.is_dir() {
        return Error::NotFound {
            path: dir.to_path_buf(),
            what: "not a directory; expected an EAGLE-3 or DSpark cache directory holding manifest.json"
                .into(),
        };
    }
    let mut inside: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.join(MANIFEST).is_file())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    inside.sort();
    let what = match inside.as_slice() {
        [] => {
            "no manifest.json: not an EAGLE-3 or DSpark cache, or one not written yet".to_string()
        }
        [one] => format!("no manifest.json: not an EAGLE-3 or DSpark cache; the cache is {one}"),
        many => format!(
            "no manifest.json: not an EAGLE-3 or DSpark cache; it holds {} caches: {}",
            many.len(),
            many.join(", ")
        ),
    };
    Error::NotFound {
        path: dir.join(MANIFEST),
        what,
    }
}

/// Reads `dir/manifest.json`; a missing one is a not-found error.
pub(crate) fn read(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = match fsutil::read_json_file(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(missing(dir)),
        Err(e) => return Err(Error::io(&path, e)),
    };
    Manifest::parse(&text, &path)
}

/// Writes `dir/manifest.json` atomically (fsynced) unless it already holds exactly these bytes.
pub(crate) fn write(dir: &Path, m: &Manifest) -> Result<PathBuf> {
    let path = dir.join(MANIFEST);
    let bytes = m.to_bytes();
    if std::fs::read(&path).ok().as_deref() != Some(&bytes[..]) {
        // A finished cache's sidecar covers the manifest: it accepts the old and the new bytes
        // until the rename is durable, then the new alone (`set_version`, a resume that
        // rewrites the manifest).
        crate::checksum::replace_file(&dir.join(crate::checksum::SIDECAR), dir, MANIFEST, &bytes)?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// eagle3.md §4.1: 415 bytes, SHA-256 02f4ab73...
    #[test]
    fn the_reference_example_is_byte_exact() {
        let given = json::parse(
            r#"{"target_model": "org/Modèl-1B", "target_vocab_size": 10, "draft_vocab_size": 4,
            "seq_length": 3, "dtype": "fp32", "num_samples": 5, "shard_size": 2,
            "aux_hidden_dim": 6, "aux_layer_ids": [1, 3, 4], "selected_token_ids": [1, 2, 7, 0],
            "input_data": "data.jsonl", "split": null, "shuffle_seed": 42}"#
                .as_bytes(),
        )
        .unwrap();
        let m = Manifest::for_writing(&given, 2).unwrap();
        let bytes = m.to_bytes();
        assert_eq!(bytes.len(), 415);
        assert_eq!(
            json::sha256_hex(&bytes),
            "02f4ab7372489dd56b8be52afb8cf0a7357ebb2a586ba0ab743fa1e9fe78db05"
        );
        assert!(bytes.ends_with(b"0\n}"));
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains("\"org/Mod\\u00e8l-1B\""));
        // Parsed back: the same manifest, the draft order kept.
        let back = Manifest::parse(&bytes, Path::new("m")).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.eagle3().unwrap().selected_token_ids, [1, 2, 7, 0]);
        assert_eq!((back.num_shards(), back.rows_in_shard(2)), (3, 1));
        // Version 1 drops target_probs_topk; switching back adds it.
        let v1 = m.with_version(1).unwrap();
        assert!(v1.to_value().get("target_probs_topk").is_none());
        assert_eq!(v1.with_version(2).unwrap().to_bytes(), bytes);
    }

    #[test]
    fn versions_and_keys_are_checked() {
        for (text, words) in [
            (
                r#"{"format_version": 3, "aux_hidden_dim": 2}"#,
                "format_version 3",
            ),
            (
                r#"{"format_version": "2", "aux_hidden_dim": 2}"#,
                "format_version \"2\"",
            ),
            (
                r#"{"num_samples": 1, "aux_hidden_dim": 2}"#,
                "format_version",
            ),
            (
                r#"{"format_version": 2, "target_hidden_dim": 2}"#,
                "DSpark caches have 1",
            ),
            (r#"{"format_version": 1}"#, "neither `aux_hidden_dim`"),
            (
                r#"{"format_version": 1, "aux_hidden_dim": 2, "target_hidden_dim": 2}"#,
                "has both",
            ),
            (r#"[1]"#, "not a JSON object"),
        ] {
            let err = Manifest::parse(text.as_bytes(), Path::new("m")).unwrap_err();
            assert!(err.to_string().contains(words), "{err}");
        }
        let base = r#"{"format_version": 1, "num_samples": 4, "shard_size": 2, "seq_length": 3,
            "aux_hidden_dim": 6, "dtype": "bf16", "selected_token_ids": [5, 1]"#;
        let err = Manifest::parse(
            format!("{base}, \"draft_vocab_size\": 3}}").as_bytes(),
            Path::new("m"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("differs"), "{err}");
        let m = Manifest::parse(
            format!("{base}, \"draft_vocab_size\": 2}}").as_bytes(),
            Path::new("m"),
        )
        .unwrap();
        assert_eq!(m.topk(), None);
        // Resume equality: numbers by value, every differing key listed.
        let mut a = m.raw().clone();
        a.set("shuffle_seed", Value::Number("42".into()));
        let a = Manifest::from_object(a, Schema::Eagle3, 1, Path::new("m")).unwrap();
        let mut b = a.raw().clone();
        b.set("shuffle_seed", Value::Number("42.0".into()));
        b.set("dtype", Value::String("fp16".into()));
        b.set("extra", Value::Null);
        let b = Manifest::from_object(b, Schema::Eagle3, 1, Path::new("m")).unwrap();
        assert_eq!(a.differing_keys(&b), ["dtype", "extra"]);
    }
}
