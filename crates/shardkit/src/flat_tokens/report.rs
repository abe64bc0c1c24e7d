//! Whole-dataset summaries and validation reports, as the CLI prints them with `--json`.

use std::path::Path;

use super::store::{Completion, ZarrFormat};
use super::Split;
use crate::error::{Error, Result};
use crate::io::{self, Location};
use crate::json::Value;
pub use crate::report::Validation;

const SPLITS: [&str; 2] = ["train", "validation"];

/// The splits of the dataset at `root` (a directory, or an `s3://` prefix): those that are
/// zarr groups.
pub fn splits(root: impl AsRef<Path>) -> Result<Vec<&'static str>> {
    present(&crate::io::local_path(root.as_ref()))
}

fn present(root: &Path) -> Result<Vec<&'static str>> {
    let location = Location::parse(root)?;
    if !location.is_local() {
        let objects = io::open_uncached(&location)?.list()?;
        let has = |k: String| objects.iter().any(|(n, _)| *n == k);
        return Ok(SPLITS
            .into_iter()
            .filter(|s| has(format!("{s}/zarr.json")) || has(format!("{s}/.zgroup")))
            .collect());
    }
    Ok(SPLITS
        .into_iter()
        .filter(|s| ZarrFormat::of_group(&root.join(s)).is_some())
        .collect())
}

/// The error for a local `root` that is not a directory: "no such directory" when nothing is
/// there, "not a directory" when a file is. `None` for a directory (or an `s3://` URL).
pub(crate) fn not_a_directory(root: &Path) -> Option<Error> {
    if !io::is_local(root) || root.is_dir() {
        return None;
    }
    let what = if root.exists() {
        "not a directory; expected a flat-tokens dataset (a directory holding train/ and/or \
         validation/ zarr groups)"
    } else {
        "no such directory"
    };
    Some(Error::NotFound {
        path: root.to_path_buf(),
        what: what.into(),
    })
}

/// The error for a `root` with neither split: what it is instead (missing, a file, a split
/// directory, a directory holding datasets one level down) and what to open.
pub(crate) fn no_splits(root: &Path) -> Error {
    if let Some(e) = not_a_directory(root) {
        return e;
    }
    let base = "holds neither a train nor a validation split (a zarr group with either)";
    let mut what = base.to_string();
    if io::is_local(root) {
        let name = root.file_name().map(|n| n.to_string_lossy().into_owned());
        let parent = root.parent().filter(|p| !p.as_os_str().is_empty());
        let inside: Vec<String> = std::fs::read_dir(root)
            .map(|d| {
                let mut v: Vec<String> = d
                    .filter_map(|e| e.ok())
                    .filter(|e| {
                        SPLITS
                            .iter()
                            .any(|s| ZarrFormat::of_group(&e.path().join(s)).is_some())
                    })
                    .map(|e| e.path().display().to_string())
                    .collect();
                v.sort();
                v
            })
            .unwrap_or_default();
        if ZarrFormat::of_group(root).is_some()
            && name.as_deref().is_some_and(|n| SPLITS.contains(&n))
        {
            let parent = parent.map_or_else(|| ".".into(), |p| p.display().to_string());
            what = format!(
                "{base}: it is itself the {} split; the dataset is its parent, {parent}",
                name.unwrap_or_default()
            );
        } else if !inside.is_empty() {
            what = format!(
                "{base}; the flat-tokens dataset{} inside it: {}",
                if inside.len() == 1 { " is" } else { "s are" },
                inside.join(", ")
            );
        }
    }
    Error::NotFound {
        path: root.to_path_buf(),
        what,
    }
}

/// The splits to open at `root`: in a store those that are zarr groups; locally every split
/// directory (one that is not a zarr group then fails to open, saying what is wrong with it).
pub(crate) fn split_dirs(root: &Path) -> Result<Vec<&'static str>> {
    if !io::is_local(root) {
        return present(root);
    }
    Ok(SPLITS
        .into_iter()
        .filter(|s| root.join(s).exists())
        .collect())
}

/// Every split summarised: format, completion, sharding, counts, `max_token_id` and sequence
/// length statistics (`null` for an absent split, `{"error": ...}` for one that cannot be
/// opened; an error when neither is there). Reads `seq_starts` in full, not the tokens.
pub fn inspect(root: impl AsRef<Path>) -> Result<Value> {
    let root = &io::local_path(root.as_ref());
    if let Some(e) = not_a_directory(root) {
        return Err(e);
    }
    let splits = split_dirs(root)?;
    let mut out = Vec::new();
    for name in SPLITS {
        let v = if !splits.contains(&name) {
            Value::Null
        } else {
            match Split::open_unvalidated(root, name).and_then(|s| summary(&s)) {
                Ok(v) => v,
                Err(e) => Value::Object(vec![("error".into(), Value::String(e.to_string()))]),
            }
        };
        out.push((name.to_string(), v));
    }
    if out.iter().all(|(_, v)| matches!(v, Value::Null)) {
        return Err(no_splits(root));
    }
    Ok(Value::Object(out))
}

fn summary(s: &Split) -> Result<Value> {
    let (mut min, mut max, mut empty) = (u64::MAX, 0u64, 0u64);
    let n = s.seq_count() + 1;
    let mut at = 0;
    let mut prev: Option<u64> = None;
    while at < n {
        let end = (at + (1 << 22)).min(n);
        for v in s.seq_starts(at..end)? {
            if let Some(p) = prev {
                if v < p {
                    return Err(Error::format(
                        s.path().join("seq_starts"),
                        "decreases, so sequence lengths are undefined (shardkit tokens validate \
                         lists every problem)",
                    ));
                }
                let l = v - p;
                min = min.min(l);
                max = max.max(l);
                empty += u64::from(l == 0);
            }
            prev = Some(v);
        }
        at = end;
    }
    let seqs = s.seq_count();
    let mean = if seqs == 0 {
        "0".to_string()
    } else {
        format!("{:.2}", s.token_count() as f64 / seqs as f64)
    };
    Ok(Value::Object(vec![
        ("format".into(), Value::String(s.format().name().into())),
        (
            "completion".into(),
            Value::String(s.info().completion.name().into()),
        ),
        ("sharded".into(), Value::Bool(s.info().sharded)),
        ("token_count".into(), Value::int(s.token_count())),
        ("seq_count".into(), Value::int(seqs)),
        ("max_token_id".into(), Value::int(s.max_token_id())),
        (
            "min_seq_len".into(),
            Value::int(if seqs == 0 { 0 } else { min }),
        ),
        ("max_seq_len".into(), Value::int(max)),
        ("mean_seq_len".into(), Value::Number(mean)),
        ("empty_sequences".into(), Value::int(empty)),
    ]))
}

/// Checks every invariant of every split present (reading all of both arrays) and lists every
/// violation: structure and dtypes, `max_token_id`, `seq_starts` bounds and order, start bits,
/// ids, and an interrupted shardkit write. A dataset needs at least one split.
pub fn validate(root: impl AsRef<Path>) -> Validation {
    let root = &io::local_path(root.as_ref());
    let mut v = Validation::new(root);
    // A split being written in parts is not a split yet: named, with the units it lacks.
    let in_parts: Vec<Error> = SPLITS
        .iter()
        .filter_map(|s| super::parts::unfinished(root, s))
        .collect();
    for e in &in_parts {
        v.error_from(e);
    }
    let splits = match present(root) {
        Ok(s) => s,
        // A dataset whose first split is still in parts has no root group yet.
        Err(_) if !in_parts.is_empty() => return v,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    if splits.is_empty() {
        if in_parts.is_empty() {
            v.error_from(&no_splits(root));
        }
        return v;
    }
    for name in SPLITS {
        if !splits.contains(&name) {
            v.note(root, format!("no {name} split"));
        }
    }
    let mut unmarked = false;
    for name in splits {
        match Split::open_unvalidated(root, name) {
            Err(e) => v.error_from(&e),
            Ok(s) => {
                match s.info().completion {
                    Completion::Interrupted => v.error(
                        root,
                        "write_completed is false: a shardkit write did not finish; resume it \
                         (shardkit tokens build --resume)",
                    ),
                    Completion::Unmarked => unmarked = true,
                    Completion::Complete => {}
                }
                for e in s.validate() {
                    v.error(s.path(), e);
                }
            }
        }
    }
    if unmarked {
        v.note(
            root,
            "no completion marker (seqax data); every open validates it in full until it is \
             marked (shardkit tokens validate --mark)",
        );
    }
    v.findings.dedup();
    v
}
