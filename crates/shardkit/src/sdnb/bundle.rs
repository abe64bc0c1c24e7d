//! Bundle directories of Deeplearning4j's native C runtime (ADR 0073, `sdxLoadBundle`): a
//! directory holding the model file and a `manifest.json` whose `modelPath` names it.
//!
//! The runtime's own parser (`parseBundleManifest` in libnd4j's `DspRuntimeC.cpp`) is a text
//! search, not a JSON parser: it takes the first string after the first `"modelPath"` (then
//! `"graphPath"`, then `"modelFile"`) anywhere in the file, resolves a relative path against the
//! manifest's directory, and follows absolute paths and `..` wherever they lead. shardkit reads
//! the same keys with a strict JSON parser and stricter rules, so that every manifest it accepts
//! means the same thing to both readers: a top-level object, each key at most once in the text,
//! string values, and paths that stay inside the bundle (relative, no `..`, no backslash).
//! What shardkit writes is `{"modelPath": "<file name>"}` and nothing else.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::json::{self, Value};

/// The manifest's file name inside a bundle directory.
pub(crate) const MANIFEST: &str = "manifest.json";

/// The keys the runtime reads for the model, in the order it tries them.
const MODEL_KEYS: [&str; 3] = ["modelPath", "graphPath", "modelFile"];

/// GPU targets the runtime accepts (case-insensitive); older revisions know only the first five.
const GPU_TARGETS: [&str; 8] = [
    "AUTO",
    "CUDA",
    "NVIDIA",
    "AMD",
    "ZLUDA_AMD",
    "VULKAN",
    "METAL",
    "MPS",
];

/// For a bundle directory or a manifest `.json` file: (the manifest, the model file it names).
/// `None` for anything else (a model file, a shard set's base name).
pub(crate) fn resolve(path: &Path) -> Result<Option<(PathBuf, PathBuf)>> {
    let manifest = if path.is_dir() {
        let m = path.join(MANIFEST);
        if !m.is_file() {
            return Err(Error::format(
                path,
                "is a directory without manifest.json; pass an .sdnb or .sdz file, a shard file, \
                 a shard set's base name, or a bundle directory (model file + manifest.json)",
            ));
        }
        m
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        && path.is_file()
    {
        path.to_path_buf()
    } else {
        return Ok(None);
    };
    let model = read_manifest(&manifest)?;
    Ok(Some((manifest, model)))
}

/// Parses a bundle manifest and returns the model file it names (checked to exist inside the
/// bundle directory).
pub(crate) fn read_manifest(manifest: &Path) -> Result<PathBuf> {
    let bad = |rule: String| Error::format(manifest, format!("bundle manifest: {rule}"));
    let text = std::fs::read(manifest).map_err(|e| Error::io(manifest, e))?;
    if text.len() > 1 << 20 {
        return Err(bad(format!(
            "{} bytes; a manifest is at most 1 MiB",
            text.len()
        )));
    }
    let v = json::parse(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let Value::Object(_) = v else {
        return Err(bad("the top level must be a JSON object".into()));
    };
    // The runtime finds a key by its first occurrence anywhere in the text, nested objects
    // included; a key that occurs twice could mean different things to it and to a parser.
    let occurs = |key: &str| {
        let quoted = format!("\"{key}\"");
        text.windows(quoted.len())
            .filter(|w| *w == quoted.as_bytes())
            .count()
    };
    let mut model = None;
    for key in MODEL_KEYS
        .iter()
        .chain(&["gpuTarget", "tokenizerPath", "configPath", "compileKey"])
    {
        if occurs(key) > 1 {
            return Err(bad(format!(
                "\"{key}\" occurs more than once in the text (the runtime takes the first \
                 occurrence anywhere, nested objects included); give it once, at the top level"
            )));
        }
        match v.get(key) {
            None if occurs(key) == 1 => {
                return Err(bad(format!(
                    "\"{key}\" appears below the top level; the runtime would take it, a JSON \
                     reader would not: put it at the top level"
                )))
            }
            None => {}
            Some(_) if occurs(key) == 0 => {
                return Err(bad(format!(
                    "\"{key}\" is written with escapes; the runtime matches the key's literal \
                     text: write it plainly"
                )))
            }
            Some(Value::String(s)) if MODEL_KEYS.contains(key) && model.is_none() => {
                model = Some((*key, s.clone()));
            }
            Some(Value::String(_)) => {}
            Some(_) => return Err(bad(format!("\"{key}\" must be a string"))),
        }
    }
    let Some((key, rel)) = model else {
        return Err(bad(
            "no \"modelPath\" (nor \"graphPath\" or \"modelFile\"): the runtime needs one".into(),
        ));
    };
    if let Some(t) = v.get("gpuTarget").and_then(Value::as_str) {
        if !GPU_TARGETS.iter().any(|g| g.eq_ignore_ascii_case(t)) {
            return Err(bad(format!(
                "\"gpuTarget\" {t:?} is not one the runtime accepts ({})",
                GPU_TARGETS.join(", ")
            )));
        }
    }
    let dir = crate::fsutil::parent_of(manifest);
    let model = inside(dir, &rel).map_err(|why| bad(format!("\"{key}\" {rel:?} {why}")))?;
    for key in ["tokenizerPath", "configPath"] {
        if let Some(p) = v.get(key).and_then(Value::as_str) {
            if !p.is_empty() {
                inside(dir, p).map_err(|why| bad(format!("\"{key}\" {p:?} {why}")))?;
            }
        }
    }
    Ok(model)
}

/// `rel` resolved in `dir`: a relative path without `..` or backslashes naming a regular file
/// that is inside `dir` after symbolic links are followed.
fn inside(dir: &Path, rel: &str) -> std::result::Result<PathBuf, String> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return Err("is empty".into());
    }
    if p.is_absolute() || rel.starts_with('/') {
        return Err("is absolute; shardkit reads only paths inside the bundle directory".into());
    }
    if rel.contains('\\') || rel.contains('\0') || rel.as_bytes().get(1) == Some(&b':') {
        return Err("has a backslash, NUL or drive letter".into());
    }
    if p.components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(
            "has a `..` segment; shardkit reads only paths inside the bundle directory".into(),
        );
    }
    let full = dir.join(p);
    if !full.is_file() {
        return Err(format!("names no file ({} does not exist)", full.display()));
    }
    let root = std::fs::canonicalize(dir).map_err(|e| e.to_string())?;
    let real = std::fs::canonicalize(&full).map_err(|e| e.to_string())?;
    if !real.starts_with(&root) {
        return Err(format!(
            "leaves the bundle directory through a symbolic link (to {})",
            real.display()
        ));
    }
    Ok(full)
}

/// The manifest shardkit writes for a model file named `model` in the same directory.
pub(crate) fn manifest_text(model: &str) -> String {
    let mut v = Value::Object(Vec::new());
    v.set("modelPath", Value::String(model.to_string()));
    json::to_pretty(&v, 2, json::Escape::Utf8) + "\n"
}
