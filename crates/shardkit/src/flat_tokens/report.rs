//! Whole-dataset summaries and validation reports, as the CLI prints them with `--json`.

use std::path::Path;

use super::store::{Completion, ZarrFormat};
use super::Split;
use crate::error::{Error, Result};
use crate::json::Value;
pub use crate::report::Validation;

const SPLITS: [&str; 2] = ["train", "validation"];

/// The splits of the dataset at `root` (a directory, or an `s3://` prefix): those that are
/// zarr groups.
pub fn splits(root: impl AsRef<Path>) -> Result<Vec<&'static str>> {
    present(&crate::storage::local_path(root.as_ref()))
}

fn present(root: &Path) -> Result<Vec<&'static str>> {
    if crate::storage::is_remote(root) {
        let objects = crate::storage::Remote::parse(root)?.list()?;
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

/// The splits to open at `root`: in a store those that are zarr groups; locally every split
/// directory (one that is not a zarr group then fails to open, saying what is wrong with it).
pub(crate) fn split_dirs(root: &Path) -> Result<Vec<&'static str>> {
    if crate::storage::is_remote(root) {
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
    let root = &crate::storage::local_path(root.as_ref());
    if !crate::storage::is_remote(root) && !root.is_dir() {
        return Err(Error::NotFound {
            path: root.to_path_buf(),
            what: "not a directory; expected a flat-tokens dataset".into(),
        });
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
        return Err(Error::NotFound {
            path: root.to_path_buf(),
            what: "holds neither a train nor a validation split (a zarr group with either)".into(),
        });
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
            Value::String(s.completion().name().into()),
        ),
        ("sharded".into(), Value::Bool(s.is_sharded())),
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
    let root = &crate::storage::local_path(root.as_ref());
    let mut v = Validation::new(root);
    let splits = match present(root) {
        Ok(s) => s,
        Err(e) => {
            v.error_from(&e);
            return v;
        }
    };
    if splits.is_empty() {
        v.error(
            root,
            "holds neither a train nor a validation split (a zarr group with either)",
        );
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
                match s.completion() {
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
