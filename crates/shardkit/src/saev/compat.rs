//! What saev itself loads: the rules each protocol's `Metadata` class enforces beyond the
//! structure every version shares (saev.md §3.2).
//!
//! saev builds its `Metadata` dataclass from the file's keys (`Metadata(**json.load(fd))`) under
//! a runtime type checker, so a file it did not write itself can fail to load in ways the
//! protocol documents never mention: a key the dataclass does not declare, a `family` outside
//! its literal set, `data` of the wrong type, or (2.1 on `main`) a null `pixel_agg`. shardkit
//! reads such files (the layout is what matters for reading), but its writers refuse to produce
//! them and validation reports them as errors.
//!
//! | protocol | reference | `family` literal | `data` | `pixel_agg` |
//! |---|---|---|---|---|
//! | 1.0.0 | `writers.py` at `8c389b4` | clip, siglip, dinov2, dinov3 | JSON object | (no key) |
//! | 2.0 | `shards.py` at `e43e7dd` | as 1.0.0 and fake-clip | JSON object | null, majority, prefer-fg |
//! | 2.1 | `shards.py` on `main` | bird-mae, clip, dinov2, dinov3, fake-clip, pe-core, pe-spatial, siglip | string: base64 of a pickled dataset config | majority, prefer-fg |

use crate::json::Value;
use crate::precision::Dtype;

/// The metadata key naming a shardkit dialect of protocol 2.1: `"text"` marks token
/// activations of a language model (docs/record.md "Language models"). saev's `Metadata`
/// refuses such a file (its `family` list is of vision models, and it declares no such key);
/// shardkit reads and writes it, and validation says so in a note instead of an error.
pub(crate) const DIALECT_KEY: &str = "shardkit_dialect";
/// The one dialect: token activations of a language model.
pub(crate) const TEXT_DIALECT: &str = "text";

/// The rules of one protocol version's `Metadata` class.
struct Rules {
    /// The key holding the model family.
    family_key: &'static str,
    /// The values the `family` literal allows (None: not checked).
    families: Option<&'static [&'static str]>,
    /// Whether `data` must be a string (2.1) rather than a JSON object.
    data_is_string: bool,
    /// Whether `dataset` is a required key.
    requires_dataset: bool,
    /// The values `pixel_agg` may take (`None` = JSON null); `None` when the key does not exist.
    pixel_agg: Option<&'static [Option<&'static str>]>,
    /// Every key the dataclass declares.
    keys: &'static [&'static str],
}

const FAMILIES_1_0: &[&str] = &["clip", "siglip", "dinov2", "dinov3"];
const FAMILIES_2_0: &[&str] = &["clip", "siglip", "dinov2", "dinov3", "fake-clip"];
/// saev `main`'s `family` literal.
pub(crate) const FAMILIES_2_1: &[&str] = &[
    "bird-mae",
    "clip",
    "dinov2",
    "dinov3",
    "fake-clip",
    "pe-core",
    "pe-spatial",
    "siglip",
];

const KEYS_1: &[&str] = &[
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
];
const KEYS_1_1: &[&str] = &[
    "vit_family",
    "vit_ckpt",
    "layers",
    "n_patches_per_img",
    "cls_token",
    "d_vit",
    "n_imgs",
    "max_patches_per_shard",
    "data",
    "pixel_agg",
    "dtype",
    "protocol",
];
/// The 2.0 key sets A, B and C together (saev wrote all three under `"2.0"`, §3.1).
const KEYS_2_0: &[&str] = &[
    "family",
    "ckpt",
    "layers",
    "patches_per_ex",
    "n_content_tokens_per_example",
    "content_tokens_per_example",
    "cls_token",
    "d_model",
    "n_ex",
    "n_examples",
    "patches_per_shard",
    "max_tokens_per_shard",
    "data",
    "dataset",
    "pixel_agg",
    "dtype",
    "protocol",
];
const KEYS_2_1: &[&str] = &[
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
];

const PIXEL_AGG_NULLABLE: &[Option<&str>] = &[None, Some("majority"), Some("prefer-fg")];
const PIXEL_AGG_2_1: &[Option<&str>] = &[Some("majority"), Some("prefer-fg")];

fn rules(protocol: &str) -> Option<Rules> {
    Some(match protocol {
        "1.0.0" => Rules {
            family_key: "vit_family",
            families: Some(FAMILIES_1_0),
            data_is_string: false,
            requires_dataset: false,
            pixel_agg: None,
            keys: KEYS_1,
        },
        // The 1.1 writers' family literal is not pinned down by the reference; only the shape
        // of the file is checked.
        "1.1" => Rules {
            family_key: "vit_family",
            families: None,
            data_is_string: false,
            requires_dataset: false,
            pixel_agg: Some(PIXEL_AGG_NULLABLE),
            keys: KEYS_1_1,
        },
        "2.0" => Rules {
            family_key: "family",
            families: Some(FAMILIES_2_0),
            data_is_string: false,
            requires_dataset: false,
            pixel_agg: Some(PIXEL_AGG_NULLABLE),
            keys: KEYS_2_0,
        },
        "2.1" => Rules {
            family_key: "family",
            families: Some(FAMILIES_2_1),
            data_is_string: true,
            requires_dataset: true,
            pixel_agg: Some(PIXEL_AGG_2_1),
            keys: KEYS_2_1,
        },
        _ => return None,
    })
}

/// What saev would make of a metadata object.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Findings {
    /// Reasons saev's `Metadata` for this protocol refuses the file.
    pub errors: Vec<String>,
    /// Things saev loads but cannot use fully.
    pub warnings: Vec<String>,
    /// A shardkit dialect (`text`): saev does not load it, by design.
    pub dialect: Option<&'static str>,
    /// A reduced-precision `dtype` (shardkit's dialect of 2.1): saev loads float32 only.
    pub reduced: Option<Dtype>,
}

impl Findings {
    /// Whether saev's own code loads the file.
    pub(crate) fn saev_loads(&self) -> bool {
        self.errors.is_empty() && self.dialect.is_none() && self.reduced.is_none()
    }
}

fn quoted(items: &[&str]) -> String {
    items
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Null => "null".into(),
        other => other.type_name().into(),
    }
}

/// Checks the metadata object `md` (already structurally valid) against the `Metadata` class
/// of saev's `protocol`; `writing` applies the rules of what shardkit writes, which leave out
/// historical forms readers only tolerate. Unknown protocol versions are not checked.
pub(crate) fn check(md: &Value, protocol: &str, writing: bool) -> Findings {
    let mut f = Findings::default();
    let Some(r) = rules(protocol) else {
        return f;
    };
    let Value::Object(members) = md else {
        return f;
    };
    let who = format!("saev's protocol {protocol} Metadata");
    match md.get(DIALECT_KEY) {
        None => {}
        Some(Value::String(d)) if d == TEXT_DIALECT && protocol == "2.1" => {
            f.dialect = Some(TEXT_DIALECT);
            f.warnings.push(format!(
                "shardkit's text dialect ({DIALECT_KEY}: \"text\", token activations of a \
                 language model): saev does not load it ({who} knows vision families only); \
                 shardkit's readers do"
            ));
        }
        Some(v) => f.errors.push(format!(
            "`{DIALECT_KEY}` must be \"text\" (shardkit's dialect of protocol 2.1 for language \
             models), found {} in protocol {protocol}",
            shown(v)
        )),
    }
    if let Some(Value::String(d)) = md.get("dtype") {
        match Dtype::parse(d) {
            Some(t) if t.is_reduced() && protocol == "2.1" && d == t.name() => {
                f.reduced = Some(t);
                f.warnings.push(format!(
                    "dtype {d}: shardkit's reduced-precision dialect of protocol 2.1; saev does \
                     not load it ({who} declares `dtype: Literal[\"float32\"]`); `shardkit saev \
                     convert DIR --dtype float32 --out ROOT` writes a copy saev loads"
                ));
            }
            Some(Dtype::F32) if d == "float32" => {}
            _ => f.errors.push(format!(
                "`dtype` must be \"float32\" ({who}), or \"bfloat16\" / \"float16\" in \
                 shardkit's reduced-precision dialect of protocol 2.1; found {d:?}"
            )),
        }
    }
    for (k, _) in members {
        if f.dialect.is_some() && k == DIALECT_KEY {
            continue;
        }
        if !r.keys.contains(&k.as_str()) {
            f.errors.push(format!(
                "{who} has no `{k}` field and refuses a file that holds one"
            ));
        }
    }
    if let (Some(families), Some(v)) = (r.families, md.get(r.family_key)) {
        // The text dialect names a language model's family.
        let free = f.dialect.is_some() && v.as_str().is_some_and(|s| !s.is_empty());
        if !free && !v.as_str().is_some_and(|s| families.contains(&s)) {
            f.errors.push(format!(
                "`{}` must be one of {} ({who} checks it against that list), found {}",
                r.family_key,
                quoted(families),
                shown(v)
            ));
        }
    }
    match md.get("data") {
        Some(Value::String(s)) if r.data_is_string => {
            if !is_base64_pickle(s) {
                f.warnings.push(
                    "`data` is not base64 of a pickle: saev loads the activations, but its \
                     Metadata.make_data_cfg cannot rebuild the dataset config from it"
                        .into(),
                );
            }
        }
        Some(v) if r.data_is_string => f.errors.push(format!(
            "`data` must be a string, base64 of a pickled saev dataset config ({who} declares \
             `data: str`), found {}",
            v.type_name()
        )),
        Some(Value::Object(_)) | None => {}
        // Early 1.0.0 files (saev before 2025-06-19) hold a Python repr here: they exist, so
        // reading only warns, but shardkit writes 1.0.0 as the later writers did.
        Some(Value::String(_)) if protocol == "1.0.0" && !writing => f.warnings.push(
            "`data` is a string (the Python repr saev 1.0.0 wrote before 2025-06-19); later 1.0.0 \
             readers expect a JSON object"
                .into(),
        ),
        Some(v) => f.errors.push(format!(
            "`data` must be a JSON object describing the dataset config ({who} declares \
             `data: dict`), found {}",
            v.type_name()
        )),
    }
    if r.requires_dataset && md.get("dataset").is_none() {
        f.errors.push(format!(
            "`dataset` is missing ({who} requires the source dataset's path)"
        ));
    }
    if let Some(allowed) = r.pixel_agg {
        match md.get("pixel_agg") {
            None if !allowed.contains(&None) => f.errors.push(format!(
                "`pixel_agg` is missing; {who} requires one of {}",
                quoted(&allowed.iter().flatten().copied().collect::<Vec<_>>())
            )),
            None => {}
            Some(v) => {
                let ok = match v {
                    Value::Null => allowed.contains(&None),
                    Value::String(s) => allowed.contains(&Some(s.as_str())),
                    _ => false,
                };
                if !ok {
                    let mut choices: Vec<String> = allowed
                        .iter()
                        .map(|c| c.map_or("null".into(), |s| format!("{s:?}")))
                        .collect();
                    let last = choices.pop().unwrap_or_default();
                    f.errors.push(format!(
                        "`pixel_agg` must be {} or {last} ({who}), found {}",
                        choices.join(", "),
                        shown(v)
                    ));
                }
            }
        }
    }
    f
}

/// Whether `s` is standard base64 (with padding) of something that starts like a pickle
/// (PROTO opcode, protocol 2 to 5) and ends with its STOP opcode.
fn is_base64_pickle(s: &str) -> bool {
    match base64_decode(s) {
        Some(b) => {
            b.len() >= 3 && b[0] == 0x80 && (2..=5).contains(&b[1]) && b.last() == Some(&b'.')
        }
        None => false,
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as Python's `base64.b64encode`.
fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                out.push(B64[(n >> shift & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 with padding; None when `s` is anything else.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if s.is_empty() || !s.len().is_multiple_of(4) {
        return None;
    }
    let val = |c: u8| B64.iter().position(|&b| b == c).map(|p| p as u32);
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let quads = s.len() / 4;
    for (qi, q) in s.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && qi + 1 != quads) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = n << 6 | val(c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}

/// The `data` string saev 2.1 writes for its synthetic dataset: standard base64 of
/// `pickle.dumps(saev.data.datasets.FakeImg(n_examples=n))` (pickle protocol 4, Python's
/// default), byte-identical to what saev stores (the 2.1 fixtures hold it for n = 5, 6, 7).
pub fn fake_dataset_data(n_examples: u64) -> String {
    // The integer opcode Python's pickler picks for a non-negative int.
    let mut int = Vec::new();
    if n_examples < 1 << 8 {
        int.extend([b'K', n_examples as u8]);
    } else if n_examples < 1 << 16 {
        int.push(b'M');
        int.extend((n_examples as u16).to_le_bytes());
    } else if n_examples < 1 << 31 {
        int.push(b'J');
        int.extend((n_examples as u32).to_le_bytes());
    } else {
        // LONG1: little-endian two's complement, as short as possible with a clear sign bit.
        let mut digits = n_examples.to_le_bytes().to_vec();
        while digits.len() > 1 && digits[digits.len() - 1] == 0 && digits[digits.len() - 2] < 0x80 {
            digits.pop();
        }
        int.extend([0x8a, digits.len() as u8]);
        int.extend(digits);
    }
    let short_str = |s: &str| {
        let mut v = vec![0x8c, s.len() as u8];
        v.extend(s.as_bytes());
        v.push(0x94); // MEMOIZE
        v
    };
    let mut body = Vec::new();
    body.extend(short_str("saev.data.datasets"));
    body.extend(short_str("FakeImg"));
    body.extend([0x93, 0x94, b')', 0x81, 0x94, b'}', 0x94]); // STACK_GLOBAL .. EMPTY_DICT
    body.extend(short_str("n_examples"));
    body.extend(int);
    body.extend([b's', b'b', b'.']); // SETITEM BUILD STOP
    let mut pickle = vec![0x80, 4, 0x95];
    pickle.extend((body.len() as u64).to_le_bytes());
    pickle.extend(body);
    base64_encode(&pickle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json;

    #[test]
    fn fake_dataset_data_equals_saevs_pickles() {
        let head =
            "gASVOAAAAAAAAACMEnNhZXYuZGF0YS5kYXRhc2V0c5SMB0Zha2VJbWeUk5QpgZR9lIwKbl9leGFtcGxlc5RL";
        assert_eq!(fake_dataset_data(7), format!("{head}B3NiLg=="));
        assert_eq!(fake_dataset_data(6), format!("{head}BnNiLg=="));
        assert_eq!(fake_dataset_data(5), format!("{head}BXNiLg=="));
        for n in [0, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, u64::MAX] {
            assert!(is_base64_pickle(&fake_dataset_data(n)), "{n}");
        }
    }

    #[test]
    fn base64_round_trips() {
        for len in 0..20 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let text = base64_encode(&bytes);
            if len > 0 {
                assert_eq!(base64_decode(&text), Some(bytes));
            }
        }
        for bad in ["", "abc", "ab=c", "a===", "ab==ab==", "ab!c"] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn v21_rules() {
        let ok = json::parse(
            br#"{"family": "clip", "data": "gASVAAAAAAAAAAAu", "dataset": "d", "pixel_agg": "majority", "protocol": "2.1"}"#,
        )
        .unwrap();
        assert_eq!(check(&ok, "2.1", false), Findings::default());
        let bad = json::parse(
            br#"{"family": "vit", "data": {"a": 1}, "pixel_agg": null, "extra": 1, "protocol": "2.1"}"#,
        )
        .unwrap();
        let f = check(&bad, "2.1", false);
        let all = f.errors.join("\n");
        for needle in [
            "`extra`",
            "`family`",
            "`data` must be a string",
            "`dataset`",
            "`pixel_agg`",
        ] {
            assert!(all.contains(needle), "{needle} in {all}");
        }
        assert_eq!(f.errors.len(), 5);
        let not_pickle = json::parse(
            br#"{"family": "clip", "data": "hello", "dataset": "d", "pixel_agg": "prefer-fg"}"#,
        )
        .unwrap();
        let f = check(&not_pickle, "2.1", false);
        assert!(f.errors.is_empty());
        assert!(f.warnings[0].contains("make_data_cfg"));
    }

    #[test]
    fn v1_and_v20_rules() {
        let v1 = json::parse(br#"{"vit_family": "fake-clip", "data": "Imagenet()"}"#).unwrap();
        let f = check(&v1, "1.0.0", false);
        assert_eq!(f.errors.len(), 1, "{f:?}");
        assert!(f.errors[0].contains("`vit_family`"));
        assert_eq!(f.warnings.len(), 1);
        assert_eq!(check(&v1, "1.0.0", true).errors.len(), 2);
        let v20 =
            json::parse(br#"{"family": "fake-clip", "data": "x", "pixel_agg": null}"#).unwrap();
        let f = check(&v20, "2.0", false);
        assert_eq!(f.errors.len(), 1, "{f:?}");
        assert!(f.errors[0].contains("JSON object"));
        assert_eq!(check(&v20, "3.0", false), Findings::default());
    }
}
