//! `metadata.json` of every saev protocol version, and the directory-name recipes.
//!
//! Versions differ only in key names, key order, JSON layout and hash recipe; the logical fields
//! are the same. Reading resolves each logical field from whichever of its key names is present,
//! so a file is understood by its keys, not only by its `protocol` string. Writing emits the
//! key set, order and bytes of the chosen version (1.0.0, 2.0 or 2.1) whatever order the caller
//! used. See `shared/formats/saev.md` §3–4 and §12.

use std::path::Path;

use crate::error::{Error, Result};
use crate::fsutil;
use crate::json::{self, Escape, Value};
use crate::precision::Dtype;

/// A logical metadata field and its key names in protocol 1.x and 2.x files.
struct Field {
    what: &'static str,
    v1: &'static [&'static str],
    v2: &'static [&'static str],
}

const FAMILY: Field = Field {
    what: "model family",
    v1: &["vit_family"],
    v2: &["family"],
};
const CKPT: Field = Field {
    what: "checkpoint",
    v1: &["vit_ckpt"],
    v2: &["ckpt"],
};
const CONTENT: Field = Field {
    what: "content tokens per example",
    v1: &["n_patches_per_img"],
    v2: &[
        "patches_per_ex",
        "n_content_tokens_per_example",
        "content_tokens_per_example",
    ],
};
const D_MODEL: Field = Field {
    what: "model width",
    v1: &["d_vit"],
    v2: &["d_model"],
};
const N_EXAMPLES: Field = Field {
    what: "number of examples",
    v1: &["n_imgs"],
    v2: &["n_ex", "n_examples"],
};
const BUDGET: Field = Field {
    what: "tokens per shard",
    v1: &["max_patches_per_shard"],
    v2: &["patches_per_shard", "max_tokens_per_shard"],
};
const RENAMED: [&Field; 6] = [&FAMILY, &CKPT, &CONTENT, &D_MODEL, &N_EXAMPLES, &BUDGET];
const SHARED_KEYS: [&str; 7] = [
    "layers",
    "cls_token",
    "data",
    "dataset",
    "pixel_agg",
    "dtype",
    "protocol",
];

/// The protocol versions shardkit writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum WriteVersion {
    /// `"1.0.0"`: 1.x key names, 4-space ASCII JSON, recipe R1, count key `n_imgs`.
    V1_0_0,
    /// `"2.0"`: the original 2.0 key set, 4-space ASCII JSON, recipe R1, count key `n_ex`.
    V2_0,
    /// `"2.1"` (default): current saev keys, 2-space UTF-8 JSON, recipe R2, count `n_examples`.
    V2_1,
}

impl WriteVersion {
    /// The `protocol` string.
    pub(crate) fn protocol(self) -> &'static str {
        match self {
            WriteVersion::V1_0_0 => "1.0.0",
            WriteVersion::V2_0 => "2.0",
            WriteVersion::V2_1 => "2.1",
        }
    }

    /// Parses a `protocol` string that shardkit can write.
    pub(crate) fn from_protocol(p: &str) -> Option<Self> {
        match p {
            "1.0.0" => Some(WriteVersion::V1_0_0),
            "2.0" => Some(WriteVersion::V2_0),
            "2.1" => Some(WriteVersion::V2_1),
            _ => None,
        }
    }

    /// Keys of metadata.json, in file order.
    fn keys(self) -> [&'static str; 13] {
        match self {
            WriteVersion::V1_0_0 => [
                "vit_family",
                "vit_ckpt",
                "layers",
                "n_patches_per_img",
                "cls_token",
                "d_vit",
                "n_imgs",
                "max_patches_per_shard",
                "data",
                "dtype",
                "protocol",
                "",
                "",
            ],
            WriteVersion::V2_0 => [
                "family",
                "ckpt",
                "layers",
                "patches_per_ex",
                "cls_token",
                "d_model",
                "n_ex",
                "patches_per_shard",
                "data",
                "dataset",
                "pixel_agg",
                "dtype",
                "protocol",
            ],
            WriteVersion::V2_1 => [
                "family",
                "ckpt",
                "layers",
                "content_tokens_per_example",
                "cls_token",
                "d_model",
                "n_examples",
                "max_tokens_per_shard",
                "data",
                "dataset",
                "pixel_agg",
                "dtype",
                "protocol",
            ],
        }
    }

    /// The per-shard count key in shards.json.
    pub(crate) fn count_key(self) -> &'static str {
        match self {
            WriteVersion::V1_0_0 => "n_imgs",
            WriteVersion::V2_0 => "n_ex",
            WriteVersion::V2_1 => "n_examples",
        }
    }

    /// The directory-name recipe saev uses for this version.
    pub(crate) fn recipe(self) -> Recipe {
        match self {
            WriteVersion::V2_1 => Recipe::R2,
            _ => Recipe::R1,
        }
    }
}

/// A directory-name recipe: how saev derives `<NAME>` from metadata.json (saev.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Recipe {
    /// v0: SHA-256 of `json.dumps(md, sort_keys=True)` with default separators.
    R0,
    /// 1.x and 2.0: SHA-256 of sorted compact ASCII-escaped JSON, 64 hex.
    R1,
    /// Early 2.1: SHA-256 of compact UTF-8 JSON in file key order, 64 hex.
    R2Full,
    /// 2.1: as R2Full, first 8 hex characters.
    R2,
}

impl Recipe {
    /// Every recipe, in the order validation tries them.
    pub(crate) const ALL: [Recipe; 4] = [Recipe::R2, Recipe::R1, Recipe::R2Full, Recipe::R0];

    /// The exact bytes this recipe hashes for the metadata object `md`.
    pub(crate) fn hashed_text(self, md: &Value) -> String {
        match self {
            Recipe::R0 => json::to_python_default(md),
            Recipe::R1 => json::to_compact(md, true, Escape::Ascii),
            Recipe::R2Full | Recipe::R2 => json::to_compact(md, false, Escape::Utf8),
        }
    }

    /// The directory name this recipe gives for `md`.
    pub(crate) fn name(self, md: &Value) -> String {
        let mut hex = json::sha256_hex(self.hashed_text(md).as_bytes());
        if self == Recipe::R2 {
            hex.truncate(8);
        }
        hex
    }

    /// A short label ("R1", ...).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Recipe::R0 => "R0",
            Recipe::R1 => "R1",
            Recipe::R2Full => "R2-full",
            Recipe::R2 => "R2",
        }
    }
}

/// Parsed and validated `metadata.json`.
///
/// Invariants checked at parse time: `layers` is non-empty; the token count, width, example
/// count and budget are positive; `dtype` is `float32` (or, in protocol 2.1, shardkit's
/// `bfloat16` / `float16` dialect); the budget holds at least one example
/// (`max_tokens_per_shard ≥ tokens_per_example · n_layers`).
#[derive(Debug, Clone, PartialEq)]
pub struct Metadata {
    raw: Value,
    protocol: String,
    major: u32,
    family: String,
    ckpt: String,
    layers: Vec<i64>,
    content_tokens_per_example: u64,
    cls_token: bool,
    d_model: u64,
    n_examples: u64,
    max_tokens_per_shard: u64,
    dataset: Option<String>,
    pixel_agg: Option<String>,
    dtype: Dtype,
}

/// Where metadata came from, for error messages.
/// The saev dataset directories one level below `dir` (those holding metadata.json), sorted.
pub(crate) fn local_candidates(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("metadata.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

/// The dataset prefixes one level below an object-store prefix, from its recursive listing
/// (names relative to the prefix): `<hash>` for each `<hash>/metadata.json`, sorted.
pub(crate) fn remote_candidates<'a>(names: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = names
        .into_iter()
        .filter_map(|n| n.strip_suffix("/metadata.json"))
        .filter(|d| !d.is_empty() && !d.contains('/'))
        .map(str::to_owned)
        .collect();
    out.sort();
    out
}

/// The error for a saev directory (or `s3://` prefix) `dir` that holds no metadata.json, given
/// the dataset directories found one level below it: says what `dir` is instead and what to open.
/// `local`: whether `dir` is a local directory (a store's prefix is never missing).
pub(crate) fn missing_metadata(dir: &Path, local: bool, candidates: &[String]) -> Error {
    let remote = !local;
    // The same words for a store's prefix as for a local directory: a report of a store's copy
    // reads as the report of the local one, the path aside.
    let (kind, entry) = ("directory", "file");
    if !remote && !dir.exists() {
        return Error::NotFound {
            path: dir.to_path_buf(),
            what: "no such directory".into(),
        };
    }
    if !remote && !dir.is_dir() {
        return Error::NotFound {
            path: dir.to_path_buf(),
            what: "not a directory; expected a saev dataset directory holding metadata.json".into(),
        };
    }
    let sep = if remote {
        "/"
    } else {
        std::path::MAIN_SEPARATOR_STR
    };
    let base = dir.display().to_string();
    let base = base.trim_end_matches(sep);
    let what = match candidates {
        [] => format!(
            "no such {entry}: {base} is not a saev dataset {kind} (one holds metadata.json and \
             acts000000.bin, ...) and has no dataset {kind} inside it"
        ),
        [one] => format!(
            "no such {entry}: {base} is a writer's root, not a dataset; the dataset is \
             {base}{sep}{one} (open that {kind})"
        ),
        many => format!(
            "no such {entry}: {base} is a writer's root holding {} datasets, not a dataset; open \
             one of: {}",
            many.len(),
            many.iter()
                .map(|c| format!("{base}{sep}{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    Error::NotFound {
        path: dir.join("metadata.json"),
        what,
    }
}

fn bad(src: &Path, rule: impl Into<String>) -> Error {
    Error::format(src, rule)
}

impl Metadata {
    /// Parses the bytes of a metadata.json file; `src` names the file in errors. Returns the
    /// metadata and the warnings a user should see (unknown minor version, foreign key names,
    /// unknown keys).
    pub fn parse(bytes: &[u8], src: &Path) -> Result<(Metadata, Vec<String>)> {
        let v = json::parse(bytes).map_err(|e| bad(src, e.to_string()))?;
        Self::from_value(v, src)
    }

    /// Reads and parses `dir/metadata.json`.
    ///
    /// A `dir` without metadata.json is refused with a message that says what `dir` is instead:
    /// no such directory, a writer's root (the dataset is the `<hash>` directory inside it,
    /// named), or a directory with no saev dataset in it.
    pub(crate) fn read(dir: &Path) -> Result<(Metadata, Vec<String>)> {
        let path = dir.join("metadata.json");
        let bytes = fsutil::read_json_file(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                missing_metadata(dir, true, &local_candidates(dir))
            } else {
                Error::io(&path, e)
            }
        })?;
        Self::parse(&bytes, &path)
    }

    /// Builds metadata from an already-parsed JSON object (key order kept as given).
    pub(crate) fn from_value(v: Value, src: &Path) -> Result<(Metadata, Vec<String>)> {
        let Value::Object(members) = &v else {
            return Err(bad(
                src,
                format!("metadata must be a JSON object, found {}", v.type_name()),
            ));
        };
        let mut warnings = Vec::new();
        let protocol = match v.get("protocol") {
            Some(Value::String(p)) => p.clone(),
            Some(other) => {
                return Err(bad(
                    src,
                    format!("`protocol` must be a string, found {}", other.type_name()),
                ))
            }
            None if v.get("vit_family").is_some()
                && (v.get("seed").is_some() || v.get("n_patches_per_shard").is_some()) =>
            {
                return Err(bad(
                    src,
                    "a pre-protocol (v0) saev directory: it has no `protocol` key; shardkit reads \
                     protocol 1.0.0 and later",
                ))
            }
            None => return Err(bad(src, "not saev metadata: there is no `protocol` key")),
        };
        let major_text = protocol.split('.').next().unwrap_or("");
        let major = match major_text {
            "1" => 1,
            "2" => 2,
            _ => {
                return Err(bad(
                    src,
                    format!(
                        "unsupported saev protocol version {protocol:?} (major version \
                         {major_text:?}); shardkit reads 1.0.0, 1.1, 2.0 and 2.1"
                    ),
                ))
            }
        };
        if !["1.0.0", "1.1", "2.0", "2.1"].contains(&protocol.as_str()) {
            warnings.push(format!(
                "unknown minor protocol version {protocol:?}; reading it by key names as \
                 protocol {major}.x"
            ));
        }

        // Every key must be known; unknown ones are reported, never silently dropped.
        for (k, _) in members {
            let known = SHARED_KEYS.contains(&k.as_str())
                || k == super::compat::DIALECT_KEY
                || RENAMED
                    .iter()
                    .any(|f| f.v1.contains(&k.as_str()) || f.v2.contains(&k.as_str()));
            if !known {
                warnings.push(format!("unknown key {k:?} (kept, not interpreted)"));
            }
        }

        let field = |f: &Field, warnings: &mut Vec<String>| -> Result<(&'static str, &Value)> {
            let present: Vec<&str> =
                f.v1.iter()
                    .chain(f.v2)
                    .copied()
                    .filter(|k| v.get(k).is_some())
                    .collect();
            match present.as_slice() {
                [] => {
                    let names = if major == 1 { f.v1 } else { f.v2 };
                    Err(bad(
                        src,
                        format!("missing the {} key ({})", f.what, names.join(" or ")),
                    ))
                }
                [k] => {
                    let foreign = if major == 1 { f.v2 } else { f.v1 };
                    if foreign.contains(k) {
                        warnings.push(format!(
                            "key {k:?} belongs to protocol {}.x, not {protocol}; read by its name",
                            3 - major
                        ));
                    }
                    Ok((*k, v.get(k).expect("present")))
                }
                many => Err(bad(
                    src,
                    format!(
                        "conflicting keys for the {}: {}",
                        f.what,
                        many.iter()
                            .map(|k| format!("{k:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )),
            }
        };
        let string = |key: &str, val: &Value| -> Result<String> {
            val.as_str().map(str::to_owned).ok_or_else(|| {
                bad(
                    src,
                    format!("`{key}` must be a string, found {}", val.type_name()),
                )
            })
        };
        let positive = |key: &str, val: &Value| -> Result<u64> {
            match val.as_i64() {
                Some(i) if i >= 1 => Ok(i as u64),
                Some(i) => Err(bad(src, format!("`{key}` must be at least 1, found {i}"))),
                None => Err(bad(
                    src,
                    format!(
                        "`{key}` must be an integer that fits in 64 bits, found {}",
                        json::to_compact(val, false, Escape::Utf8)
                    ),
                )),
            }
        };

        let (k, x) = field(&FAMILY, &mut warnings)?;
        let family = string(k, x)?;
        let (k, x) = field(&CKPT, &mut warnings)?;
        let ckpt = string(k, x)?;
        let (k, x) = field(&CONTENT, &mut warnings)?;
        let content = positive(k, x)?;
        let (k, x) = field(&D_MODEL, &mut warnings)?;
        let d_model = positive(k, x)?;
        let (k, x) = field(&N_EXAMPLES, &mut warnings)?;
        let n_examples = positive(k, x)?;
        let (k, x) = field(&BUDGET, &mut warnings)?;
        let budget = positive(k, x)?;

        let layers = match v.get("layers") {
            Some(Value::Array(items)) if !items.is_empty() => items
                .iter()
                .map(|x| {
                    x.as_i64()
                        .ok_or_else(|| bad(src, "`layers` must hold integers"))
                })
                .collect::<Result<Vec<i64>>>()?,
            Some(Value::Array(_)) => return Err(bad(src, "`layers` must not be empty")),
            Some(other) => {
                return Err(bad(
                    src,
                    format!("`layers` must be an array, found {}", other.type_name()),
                ))
            }
            None => return Err(bad(src, "missing the `layers` key")),
        };
        let cls_token = match v.get("cls_token") {
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(bad(
                    src,
                    format!("`cls_token` must be a boolean, found {}", other.type_name()),
                ))
            }
            None => return Err(bad(src, "missing the `cls_token` key")),
        };
        if v.get("data").is_none() {
            return Err(bad(src, "missing the `data` key"));
        }
        let dataset = match v.get("dataset") {
            None => None,
            Some(val) => Some(string("dataset", val)?),
        };
        let pixel_agg = match v.get("pixel_agg") {
            None | Some(Value::Null) => None,
            Some(val) => Some(string("pixel_agg", val)?),
        };
        let dtype = match v.get("dtype") {
            Some(Value::String(d)) if d == "float32" => Dtype::F32,
            Some(Value::String(d)) if Dtype::parse(d).is_some_and(|t| t.name() == d) => {
                let t = Dtype::parse(d).expect("parsed above");
                if protocol != "2.1" {
                    return Err(bad(
                        src,
                        format!(
                            "dtype {d:?} is shardkit's reduced-precision dialect of protocol \
                             2.1; this file says protocol {protocol:?}, whose activations are \
                             float32"
                        ),
                    ));
                }
                t
            }
            Some(other) => {
                return Err(bad(
                    src,
                    format!(
                        "unsupported dtype {}: saev activations are float32 (shardkit also \
                         reads \"bfloat16\" and \"float16\" in protocol 2.1)",
                        json::to_compact(other, false, Escape::Utf8)
                    ),
                ))
            }
            None => {
                warnings.push("no `dtype` key; assuming float32".into());
                Dtype::F32
            }
        };

        let tokens = content + u64::from(cls_token);
        let per_example = tokens
            .checked_mul(layers.len() as u64)
            .ok_or_else(|| bad(src, "tokens per example times layers overflows 64 bits"))?;
        if budget < per_example {
            return Err(bad(
                src,
                format!(
                    "the shard budget of {budget} tokens is too small for one example \
                     ({tokens} tokens x {} layers = {per_example})",
                    layers.len()
                ),
            ));
        }

        for w in &warnings {
            log::warn!("{}: {w}", src.display());
        }
        let md = Metadata {
            raw: v.clone(),
            protocol,
            major,
            family,
            ckpt,
            layers,
            content_tokens_per_example: content,
            cls_token,
            d_model,
            n_examples,
            max_tokens_per_shard: budget,
            dataset,
            pixel_agg,
            dtype,
        };
        Ok((md, warnings))
    }

    /// Canonical metadata for writing, from a caller's JSON object in any key order and with
    /// the key names of any version. Its `protocol` (1.0.0, 2.0 or 2.1) selects the version
    /// written. Optional keys: `dtype` (default "float32"; "bfloat16" or "float16" for shardkit's
    /// reduced-precision dialect, protocol 2.1 only); for 2.x `pixel_agg` (default null
    /// for 2.0, "majority" for 2.1). Unknown keys are refused, and so is anything the saev
    /// release of that protocol would refuse to load (its `family` list, the type of `data`:
    /// a JSON object for 1.0.0 and 2.0, a base64 pickle string for 2.1; a null `pixel_agg` in
    /// 2.1): nothing is created for such metadata.
    pub fn for_writing(user: &Value) -> Result<Metadata> {
        let src = Path::new("<metadata>");
        let version = match user.get("protocol") {
            None => WriteVersion::V2_1,
            Some(Value::String(p)) => WriteVersion::from_protocol(p).ok_or_else(|| {
                Error::Invalid(format!(
                    "cannot write saev protocol {p:?}: shardkit writes 1.0.0, 2.0 and 2.1"
                ))
            })?,
            Some(other) => {
                return Err(Error::Invalid(format!(
                    "`protocol` must be a string, found {}",
                    other.type_name()
                )))
            }
        };
        let Value::Object(members) = user else {
            return Err(Error::Invalid(format!(
                "metadata must be a JSON object, found {}",
                user.type_name()
            )));
        };
        let mut with_protocol = members.clone();
        if user.get("protocol").is_none() {
            with_protocol.push(("protocol".into(), Value::String("2.1".into())));
        }
        if user.get("dtype").is_none() {
            with_protocol.push(("dtype".into(), Value::String("float32".into())));
        }
        let (md, warnings) = Self::from_value(Value::Object(with_protocol), src)
            .map_err(|e| Error::Invalid(e.to_string().replacen("<metadata>: ", "metadata: ", 1)))?;
        if let Some(w) = warnings.iter().find(|w| w.starts_with("unknown key")) {
            return Err(Error::Invalid(format!(
                "metadata: {w}; refusing to write it"
            )));
        }
        match version {
            WriteVersion::V1_0_0 => {
                for k in ["dataset", "pixel_agg"] {
                    if user.get(k).is_some_and(|v| *v != Value::Null) {
                        return Err(Error::Invalid(format!(
                            "metadata: protocol 1.0.0 has no `{k}` key"
                        )));
                    }
                }
            }
            _ => {
                if md.dataset.is_none() {
                    return Err(Error::Invalid(format!(
                        "metadata: protocol {} requires a `dataset` string",
                        version.protocol()
                    )));
                }
            }
        }
        let data = user.get("data").cloned().unwrap_or(Value::Null);
        let mut md = md;
        // Only an absent key takes the default: saev 2.1 refuses an explicit null.
        if version == WriteVersion::V2_1 && user.get("pixel_agg").is_none() {
            md.pixel_agg = Some("majority".into());
        }
        let values: [Value; 13] = [
            Value::String(md.family.clone()),
            Value::String(md.ckpt.clone()),
            Value::Array(md.layers.iter().map(|&l| Value::int(l)).collect()),
            Value::int(md.content_tokens_per_example),
            Value::Bool(md.cls_token),
            Value::int(md.d_model),
            Value::int(md.n_examples),
            Value::int(md.max_tokens_per_shard),
            data,
            md.dataset.clone().map_or(Value::Null, Value::String),
            md.pixel_agg.clone().map_or(Value::Null, Value::String),
            Value::String(md.dtype.name().into()),
            Value::String(version.protocol().into()),
        ];
        let mut raw: Vec<(String, Value)> = match version {
            // 1.0.0 has neither dataset nor pixel_agg.
            WriteVersion::V1_0_0 => {
                let mut v: Vec<Value> = values.into();
                v.remove(10);
                v.remove(9);
                version.keys()[..11]
                    .iter()
                    .map(|k| k.to_string())
                    .zip(v)
                    .collect()
            }
            _ => version
                .keys()
                .iter()
                .map(|k| k.to_string())
                .zip(values)
                .collect(),
        };
        // A dialect goes last, as given (checked with the rest below).
        if let Some(d) = user.get(super::compat::DIALECT_KEY) {
            raw.push((super::compat::DIALECT_KEY.into(), d.clone()));
        }
        md.raw = Value::Object(raw);
        md.protocol = version.protocol().into();
        md.major = if version == WriteVersion::V1_0_0 {
            1
        } else {
            2
        };
        let findings = super::compat::check(&md.raw, &md.protocol, true);
        if !findings.errors.is_empty() {
            return Err(Error::Invalid(format!(
                "metadata: refusing to write protocol {} that saev cannot load: {}",
                version.protocol(),
                findings.errors.join("; ")
            )));
        }
        Ok(md)
    }

    /// The shardkit dialect of the file (`"text"`: token activations of a language model),
    /// if any.
    pub fn dialect(&self) -> Option<&str> {
        self.raw
            .get(super::compat::DIALECT_KEY)
            .and_then(Value::as_str)
    }

    /// What saev's own `Metadata` class for this protocol makes of the file: reasons it refuses
    /// it, and things it loads but cannot use (see [`compat`](super::compat)).
    pub(crate) fn saev_findings(&self) -> super::compat::Findings {
        super::compat::check(&self.raw, &self.protocol, false)
    }

    /// The metadata object exactly as found in (or written to) metadata.json, keys in file order.
    pub fn raw(&self) -> &Value {
        &self.raw
    }
    /// The `protocol` string.
    pub fn protocol(&self) -> &str {
        &self.protocol
    }
    /// The protocol major version (1 or 2).
    pub(crate) fn major(&self) -> u32 {
        self.major
    }
    /// The version shardkit would write this metadata as, when the protocol is one it writes.
    pub(crate) fn write_version(&self) -> Option<WriteVersion> {
        WriteVersion::from_protocol(&self.protocol)
    }
    /// Model family (`family` / `vit_family`).
    pub(crate) fn family(&self) -> &str {
        &self.family
    }
    /// Checkpoint identifier.
    pub(crate) fn ckpt(&self) -> &str {
        &self.ckpt
    }
    /// The stored element type (`dtype`): float32, or bfloat16 / float16 in shardkit's
    /// reduced-precision dialect of protocol 2.1.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// This metadata with another stored element type (protocol 2.1 only for reduced types):
    /// the dataset a conversion to `dtype` writes (a new directory name, as the hash covers
    /// `dtype`).
    pub fn with_dtype(&self, dtype: Dtype) -> Result<Metadata> {
        let mut raw = self.raw.clone();
        raw.set("dtype", Value::String(dtype.name().into()));
        let (md, _) = Self::from_value(raw, Path::new("<metadata>"))
            .map_err(|e| Error::Invalid(e.to_string().replacen("<metadata>: ", "metadata: ", 1)))?;
        Ok(md)
    }

    /// Recorded layer values, in slot order.
    pub fn layers(&self) -> &[i64] {
        &self.layers
    }
    /// Content tokens per example, CLS excluded (P).
    pub(crate) fn content_tokens_per_example(&self) -> u64 {
        self.content_tokens_per_example
    }
    /// Whether token slot 0 of every example is a CLS token.
    pub(crate) fn cls_token(&self) -> bool {
        self.cls_token
    }
    /// Stored tokens per example, T = P + cls.
    pub(crate) fn tokens_per_example(&self) -> u64 {
        self.content_tokens_per_example + u64::from(self.cls_token)
    }
    /// Hidden width (D).
    pub(crate) fn d_model(&self) -> u64 {
        self.d_model
    }
    /// Number of examples (N).
    pub(crate) fn n_examples(&self) -> u64 {
        self.n_examples
    }
    /// Shard budget in vectors over all layers (M).
    pub(crate) fn max_tokens_per_shard(&self) -> u64 {
        self.max_tokens_per_shard
    }
    /// The `dataset` string, when present.
    pub(crate) fn dataset(&self) -> Option<&str> {
        self.dataset.as_deref()
    }
    /// `pixel_agg`, when present and not null.
    pub(crate) fn pixel_agg(&self) -> Option<&str> {
        self.pixel_agg.as_deref()
    }

    /// The stored layer slot of the recorded layer value `value` (first occurrence, as saev's
    /// `layers.index`). Negative values are literal labels, not positions from the end.
    pub(crate) fn layer_slot(&self, value: i64) -> Result<usize> {
        self.layers.iter().position(|&l| l == value).ok_or_else(|| {
            Error::Missing(format!(
                "layer {value} is not recorded in this dataset; recorded layers: {:?}",
                self.layers
            ))
        })
    }

    /// The bytes of metadata.json as shardkit writes them for this metadata's version:
    /// 4-space ASCII-escaped for 1.x and 2.0, 2-space UTF-8 for 2.1; no trailing newline.
    pub fn file_bytes(&self) -> Vec<u8> {
        let (indent, esc) = if self.major == 1 || self.protocol == "2.0" {
            (4, Escape::Ascii)
        } else {
            (2, Escape::Utf8)
        };
        json::to_pretty(&self.raw, indent, esc).into_bytes()
    }

    /// The recipe this metadata's version names its directory with.
    pub(crate) fn recipe(&self) -> Recipe {
        match self.write_version() {
            Some(v) => v.recipe(),
            None if self.major == 1 => Recipe::R1,
            None => Recipe::R2,
        }
    }

    /// The directory name for this metadata under its version's recipe.
    pub fn dir_name(&self) -> String {
        self.recipe().name(&self.raw)
    }

    /// The recipe that produces `name` from this metadata, if any.
    pub(crate) fn matching_recipe(&self, name: &str) -> Option<Recipe> {
        Recipe::ALL.into_iter().find(|r| r.name(&self.raw) == name)
    }

    /// The shards.json count key for the version shardkit writes (`n_examples` otherwise).
    pub(crate) fn count_key(&self) -> &'static str {
        self.write_version().map_or(
            if self.major == 1 {
                "n_imgs"
            } else {
                "n_examples"
            },
            |v| v.count_key(),
        )
    }
}
