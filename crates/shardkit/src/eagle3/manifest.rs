//! `manifest.json`: the run configuration of a cache (eagle3.md §4–5).
//!
//! The file is Python's `json.dump({"format_version": V, **manifest}, indent=2, sort_keys=True)`:
//! ASCII-escaped, keys sorted, one list element per line, no trailing newline. The manifest is
//! kept as JSON (so keys shardkit does not interpret survive a rewrite) next to the typed fields
//! every reader needs; `selected_token_ids` keeps its order.

use std::path::{Path, PathBuf};

use safetensors::Dtype;

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
    /// The object without `format_version` (written from [`Manifest::format_version`]).
    raw: Value,
    /// 1 or 2.
    pub format_version: u8,
    /// `num_samples` (N).
    pub num_samples: u64,
    /// `shard_size` (s ≥ 1).
    pub shard_size: u64,
    /// `seq_length` (S).
    pub seq_length: u64,
    /// `aux_hidden_dim` (3H).
    pub aux_hidden_dim: u64,
    /// `draft_vocab_size` (Vd), equal to the length of `selected_token_ids`.
    pub draft_vocab_size: u64,
    /// The float dtype of the float fields: BF16 (`"bf16"`, the reference's default), F16
    /// (`"fp16"`) or F32 (`"fp32"`).
    pub dtype: Dtype,
    /// `target_probs_topk`: `Some(k)` when shards hold top-k pairs (`0 < k < Vd`, v2 only).
    pub topk: Option<u64>,
    /// `target_vocab_size`, when recorded.
    pub target_vocab_size: Option<u64>,
    /// Draft column j is target token `selected_token_ids[j]` (order kept).
    pub selected_token_ids: Vec<u64>,
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

/// Keys the reference producer writes, all required when shardkit writes a manifest.
const PRODUCER_KEYS: [&str; 10] = [
    "target_model",
    "target_vocab_size",
    "draft_vocab_size",
    "seq_length",
    "dtype",
    "num_samples",
    "shard_size",
    "aux_hidden_dim",
    "aux_layer_ids",
    "selected_token_ids",
];

impl Manifest {
    /// Parses the manifest text of `path` (for messages); the version must be 1 or 2.
    pub(crate) fn parse(text: &[u8], path: &Path) -> Result<Manifest> {
        let v = json::parse(text).map_err(|e| Error::format(path, e.to_string()))?;
        let version = match v.get("format_version") {
            None => {
                return Err(Error::format(
                    path,
                    "no `format_version`; an EAGLE-3 cache manifest has format_version 1 or 2",
                ))
            }
            Some(fv) => match fv.as_i64() {
                Some(1) => 1,
                Some(2) => 2,
                _ => {
                    return Err(Error::format(
                        path,
                        format!(
                            "format_version {} is not supported (1 or 2)",
                            json::to_compact(fv, false, Escape::Utf8)
                        ),
                    ))
                }
            },
        };
        Self::from_object(v, version, path)
    }

    /// A manifest to write: `object` is the run configuration (`format_version` inside it is
    /// ignored; `version` decides). Every key the reference producer writes is required;
    /// `target_probs_topk` is added as 0 in version 2 and refused above 0 in version 1.
    pub(crate) fn for_writing(object: &Value, version: u8) -> Result<Manifest> {
        let path = Path::new(MANIFEST);
        if !matches!(object, Value::Object(_)) {
            return Err(Error::Invalid(format!(
                "the manifest must be a JSON object, found {}",
                object.type_name()
            )));
        }
        if version != 1 && version != 2 {
            return Err(Error::Invalid(format!(
                "format_version {version} is not supported (1 or 2)"
            )));
        }
        for key in PRODUCER_KEYS {
            if object.get(key).is_none() {
                return Err(Error::Invalid(format!("the manifest is missing `{key}`")));
            }
        }
        let mut obj = object.clone();
        if let Value::Object(m) = &mut obj {
            m.retain(|(k, _)| k != "format_version");
        }
        match version {
            1 => {
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
            _ => {
                if obj.get("target_probs_topk").is_none() {
                    obj.set("target_probs_topk", Value::int(0));
                }
            }
        }
        Self::from_object(obj, version, path).map_err(|e| match e {
            Error::Format { rule, .. } => Error::Invalid(format!("manifest: {rule}")),
            e => e,
        })
    }

    fn from_object(obj: Value, version: u8, path: &Path) -> Result<Manifest> {
        // Sorted once: the file is written sorted, and equal manifests compare equal.
        let mut obj = obj.sorted();
        if let Value::Object(m) = &mut obj {
            m.retain(|(k, _)| k != "format_version");
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
        let draft_vocab_size = uint(&obj, "draft_vocab_size", path)?;
        if draft_vocab_size != selected.len() as u64 {
            return Err(Error::format(
                path,
                format!(
                    "draft_vocab_size {draft_vocab_size} differs from the {} selected_token_ids",
                    selected.len()
                ),
            ));
        }
        let shard_size = uint(&obj, "shard_size", path)?;
        if shard_size == 0 {
            return Err(Error::format(path, "`shard_size` must be at least 1"));
        }
        let topk = match (version, obj.get("target_probs_topk")) {
            (2, Some(_)) => {
                let k = uint(&obj, "target_probs_topk", path)?;
                (k > 0 && k < draft_vocab_size).then_some(k)
            }
            _ => None,
        };
        let target_vocab_size = match obj.get("target_vocab_size") {
            None => None,
            Some(_) => Some(uint(&obj, "target_vocab_size", path)?),
        };
        let m = Manifest {
            format_version: version,
            num_samples: uint(&obj, "num_samples", path)?,
            shard_size,
            seq_length: uint(&obj, "seq_length", path)?,
            aux_hidden_dim: uint(&obj, "aux_hidden_dim", path)?,
            draft_vocab_size,
            dtype,
            topk,
            target_vocab_size,
            selected_token_ids: selected,
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

    /// The JSON object as written (with `format_version`).
    pub fn to_value(&self) -> Value {
        let mut v = self.raw.clone();
        v.set("format_version", Value::int(self.format_version));
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

    /// Bytes one sample takes in a shard (eagle3.md §2.3); None on overflow.
    pub fn sample_bytes(&self) -> Option<u64> {
        let s = self.seq_length;
        let e = self.dtype.bitsize() as u64 / 8;
        let probs = match self.topk {
            None => s.checked_mul(self.draft_vocab_size)?.checked_mul(e)?,
            Some(k) => s.checked_mul(k)?.checked_mul(e + 4)?,
        };
        s.checked_mul(25)?
            .checked_add(s.checked_mul(self.aux_hidden_dim)?.checked_mul(e)?)?
            .checked_add(probs)
    }

    /// The keys (other than `format_version`) whose values differ from `other`'s: what a
    /// resume refuses, listed. Numbers compare by value (`1` equals `1.0`), as in Python.
    pub(crate) fn differing_keys(&self, other: &Manifest) -> Vec<String> {
        json::differing_keys(&self.raw, &other.raw)
    }

    /// The run configuration as given (without `format_version`).
    pub(crate) fn raw(&self) -> &Value {
        &self.raw
    }

    /// This manifest switched to `version`: 2 adds `target_probs_topk: 0`, 1 removes it. Only
    /// a lossless cache can be version 1.
    pub(crate) fn with_version(&self, version: u8) -> Result<Manifest> {
        match version {
            1 if self.topk.is_some() => Err(Error::Invalid(
                "a top-k cache cannot be format_version 1 (version 1 has no top-k target_probs)"
                    .into(),
            )),
            1 | 2 => Manifest::for_writing_keep(&self.raw, version),
            v => Err(Error::Invalid(format!(
                "format_version {v} is not supported (1 or 2)"
            ))),
        }
    }

    fn for_writing_keep(raw: &Value, version: u8) -> Result<Manifest> {
        let mut obj = raw.clone();
        if let Value::Object(m) = &mut obj {
            if version == 1 {
                m.retain(|(k, _)| k != "target_probs_topk");
            } else if !m.iter().any(|(k, _)| k == "target_probs_topk") {
                m.push(("target_probs_topk".into(), Value::int(0)));
            }
        }
        Self::from_object(obj, version, Path::new(MANIFEST))
    }
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
            what: "not a directory; expected an EAGLE-3 cache directory holding manifest.json"
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
        [] => "no manifest.json: not an EAGLE-3 cache, or one not written yet".to_string(),
        [one] => format!("no manifest.json: not an EAGLE-3 cache; the cache is {one}"),
        many => format!(
            "no manifest.json: not an EAGLE-3 cache; it holds {} caches: {}",
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
        assert_eq!(back.selected_token_ids, [1, 2, 7, 0]);
        assert_eq!((back.num_shards(), back.rows_in_shard(2)), (3, 1));
        // Version 1 drops target_probs_topk; switching back adds it.
        let v1 = m.with_version(1).unwrap();
        assert!(v1.to_value().get("target_probs_topk").is_none());
        assert_eq!(v1.with_version(2).unwrap().to_bytes(), bytes);
    }

    #[test]
    fn versions_and_keys_are_checked() {
        for (text, words) in [
            (r#"{"format_version": 3}"#, "format_version 3"),
            (r#"{"format_version": "2"}"#, "format_version \"2\""),
            (r#"{"num_samples": 1}"#, "format_version"),
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
        assert_eq!(m.topk, None);
        // Resume equality: numbers by value, every differing key listed.
        let mut a = m.raw().clone();
        a.set("shuffle_seed", Value::Number("42".into()));
        let a = Manifest::from_object(a, 1, Path::new("m")).unwrap();
        let mut b = a.raw().clone();
        b.set("shuffle_seed", Value::Number("42.0".into()));
        b.set("dtype", Value::String("fp16".into()));
        b.set("extra", Value::Null);
        let b = Manifest::from_object(b, 1, Path::new("m")).unwrap();
        assert_eq!(a.differing_keys(&b), ["dtype", "extra"]);
    }
}
