//! `validate` and `inspect`: every problem of a saev directory in one report, and a summary.

use std::fs::File;
use std::path::Path;

use crate::error::Error;
use crate::fsutil;
use crate::json::Value;
use crate::saev::dataset::{
    check_complete, check_complete_with, check_entries, leading_full_files,
};
use crate::saev::layout::{parse_shards_json, Layout};
use crate::saev::Metadata;
use crate::storage::{self, Remote};
use std::collections::HashMap;
use std::path::PathBuf;

pub use crate::report::{Finding, Severity, Validation};

/// The old name of [`Validation`] (saev's report is the one every format returns).
pub type Report = Validation;

/// The old name of [`Finding`].
pub type Problem = Finding;

/// Checks a saev directory and collects every problem: metadata, directory name, shards.json
/// against metadata, each shard file (missing, empty, not regular, unreadable, wrong size),
/// completeness, labels.bin, and leftovers of an interrupted write.
///
/// An `s3://` URL is checked as [`crate::saev::Dataset::open`] checks it (metadata, shards.json,
/// every object's size); the contents are not read.
pub fn validate(dir: impl AsRef<Path>) -> Validation {
    if storage::is_remote(dir.as_ref()) {
        return validate_remote(dir.as_ref());
    }
    let dir = storage::local_path(dir.as_ref());
    let mut r = Validation::new(&dir);
    let mut push = |sev, file: &Path, msg: String| r.push(sev, file, msg);
    if !dir.is_dir() {
        push(Severity::Error, &dir, "not a directory".into());
        return r;
    }
    let md_path = dir.join("metadata.json");
    let md = match Metadata::read(&dir) {
        Ok((md, warnings)) => {
            for w in warnings {
                push(Severity::Note, &md_path, w);
            }
            md
        }
        Err(e) => {
            push(Severity::Error, &md_path, strip_path(&e, &md_path));
            return r;
        }
    };
    let findings = md.saev_findings();
    for e in findings.errors {
        push(
            Severity::Error,
            &md_path,
            format!("saev {} will not load this directory: {e}", md.protocol()),
        );
    }
    for w in findings.warnings {
        push(Severity::Note, &md_path, w);
    }
    let layout = match Layout::new(&md, &md_path) {
        Ok(l) => l,
        Err(e) => {
            push(Severity::Error, &md_path, strip_path(&e, &md_path));
            return r;
        }
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match md.matching_recipe(&name) {
        Some(rc) if rc != md.recipe() => push(
            Severity::Note,
            &dir,
            format!(
                "directory name matches recipe {} although protocol {} uses {}",
                rc.label(),
                md.protocol(),
                md.recipe().label()
            ),
        ),
        Some(_) => {}
        None => push(
            Severity::Note,
            &dir,
            format!(
                "directory name {name:?} matches no saev hash recipe of this metadata \
                 (expected {:?} by {})",
                md.dir_name(),
                md.recipe().label()
            ),
        ),
    }

    let sj = dir.join("shards.json");
    let mut listed = 0u64;
    match fsutil::read_json_file(&sj) {
        Err(_) if !sj.exists() => {
            let k = leading_full_files(&dir, &layout);
            push(
                Severity::Error,
                &sj,
                format!(
                    "missing: the dataset is incomplete ({} of {} examples in {k} leading \
                     full-size shard files)",
                    (k * layout.examples_per_shard).min(layout.n_examples),
                    layout.n_examples
                ),
            );
        }
        Err(e) => push(Severity::Error, &sj, format!("unreadable: {e}")),
        Ok(bytes) => match parse_shards_json(&bytes, &sj) {
            Err(e) => push(Severity::Error, &sj, strip_path(&e, &sj)),
            Ok(entries) => {
                listed = entries.len() as u64;
                if entries.len() as u64 == layout.n_shards + 1
                    && entries.last().is_some_and(|e| e.count == 0)
                {
                    push(
                        Severity::Note,
                        &sj,
                        "a trailing entry with 0 examples (saev's spurious empty shard); ignored"
                            .into(),
                    );
                }
                if let Err(e) = check_entries(&entries, &sj, &layout) {
                    let file = match &e {
                        Error::Incomplete { .. } => dir.clone(),
                        _ => sj.clone(),
                    };
                    push(Severity::Error, &file, strip_path(&e, &file));
                }
            }
        },
    }

    // Every shard the metadata implies (and any extra listed one) is checked. Files that exist
    // are found by listing the directory, so a metadata.json claiming absurdly many shards costs
    // no more than the files present; missing ones are reported as ranges.
    let expected = layout.n_shards.max(listed);
    let present: std::collections::BTreeSet<u64> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| shard_index(&e.file_name().to_string_lossy()))
                .filter(|&s| s < expected)
                .collect()
        })
        .unwrap_or_default();
    for &s in &present {
        let p = dir.join(Layout::shard_name(s));
        let extra = s >= layout.n_shards;
        match std::fs::metadata(&p) {
            Err(e) => push(Severity::Error, &p, format!("unreadable: {e}")),
            Ok(m) if !m.is_file() => push(Severity::Error, &p, "not a regular file".into()),
            Ok(m) if m.len() == 0 && !extra => push(Severity::Error, &p, "empty file".into()),
            Ok(m) if m.len() != layout.shard_bytes() && !extra => push(
                Severity::Error,
                &p,
                format!(
                    "{} bytes; every shard must be {} ({} examples x {} bytes)",
                    m.len(),
                    layout.shard_bytes(),
                    layout.examples_per_shard,
                    layout.example_bytes()
                ),
            ),
            Ok(_) => {
                if let Err(e) = File::open(&p) {
                    push(Severity::Error, &p, format!("unreadable: {e}"));
                }
            }
        }
    }
    let mut start = 0u64;
    for gap_end in present.iter().copied().chain(std::iter::once(expected)) {
        if gap_end > start {
            let (first, last) = (start, gap_end - 1);
            // A missing spurious trailing shard (beyond the metadata's count) is only a warning.
            let sev = if first >= layout.n_shards {
                Severity::Note
            } else {
                Severity::Error
            };
            let p = dir.join(Layout::shard_name(first));
            let msg = if first == last {
                "missing".to_string()
            } else {
                format!(
                    "missing, with every shard through {} ({} files)",
                    Layout::shard_name(last),
                    last - first + 1
                )
            };
            push(sev, &p, msg);
        }
        start = gap_end + 1;
    }

    let labels = dir.join("labels.bin");
    if labels.symlink_metadata().is_ok() && fsutil::regular_file_len(&labels).is_none() {
        push(
            Severity::Error,
            &labels,
            "not a regular file (or unreadable)".into(),
        );
    }
    if let Some(len) = fsutil::regular_file_len(&labels) {
        let want = layout.n_examples * layout.content_tokens;
        if len != want {
            let hint = if len == layout.n_examples * layout.tokens && layout.cls {
                " (N x (P+1): saev's 1.1/2.0 CLS-column bug)"
            } else {
                ""
            };
            push(
                Severity::Error,
                &labels,
                format!("{len} bytes; labels.bin must be N x P = {want} bytes{hint}"),
            );
        }
    }
    if let Ok(rd) = std::fs::read_dir(&dir) {
        let leftovers: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| fsutil::is_temp_name(n) || n == ".shardkit-writing")
            .collect();
        if !leftovers.is_empty() {
            push(
                Severity::Note,
                &dir,
                format!(
                    "leftovers of an interrupted shardkit write: {}",
                    leftovers.join(", ")
                ),
            );
        }
    }
    r
}

/// A message without the leading "path: " that the report already shows separately.
fn strip_path(e: &Error, path: &Path) -> String {
    if e.path() == Some(path) {
        e.message()
    } else {
        e.to_string()
    }
}

/// A summary of a saev directory (what `shardkit saev inspect --json` prints): version, shapes,
/// layers, counts, sizes, completeness and hash recipe.
pub fn inspect(dir: impl AsRef<Path>) -> crate::Result<Value> {
    let dir = &storage::local_path(dir.as_ref());
    let (md, warnings, layout, complete, labels) = if storage::is_remote(dir) {
        let remote = Remote::parse(dir)?;
        let objects: HashMap<String, u64> = remote.list()?.into_iter().collect();
        let (md, warnings) = Metadata::parse(
            &remote.get("metadata.json")?,
            &remote.url_of("metadata.json"),
        )?;
        let layout = Layout::new(&md, &remote.url_of("metadata.json"))?;
        let sj = match objects.contains_key("shards.json") {
            true => Some(remote.get("shards.json")?),
            false => None,
        };
        let url = PathBuf::from(remote.url());
        let complete = check_complete_with(&url, &layout, sj, |n| {
            objects
                .get(n)
                .copied()
                .ok_or("listed in shards.json but missing")
        });
        (
            md,
            warnings,
            layout,
            complete,
            objects.get("labels.bin").copied(),
        )
    } else {
        let (md, warnings) = Metadata::read(dir)?;
        let layout = Layout::new(&md, &dir.join("metadata.json"))?;
        let complete = check_complete(dir, &layout);
        let labels = fsutil::regular_file_len(&dir.join("labels.bin"));
        (md, warnings, layout, complete, labels)
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let present = match &complete {
        Ok(()) => Some(layout.n_examples),
        Err(Error::Incomplete { present, .. }) => Some(*present),
        Err(_) => None,
    };
    let int = |v: u64| Value::int(v);
    let opt_str = |s: Option<&str>| s.map_or(Value::Null, |s| Value::String(s.into()));
    Ok(Value::Object(vec![
        ("path".into(), Value::String(dir.display().to_string())),
        ("protocol".into(), Value::String(md.protocol().into())),
        ("family".into(), Value::String(md.family().into())),
        ("ckpt".into(), Value::String(md.ckpt().into())),
        ("dataset".into(), opt_str(md.dataset())),
        ("pixel_agg".into(), opt_str(md.pixel_agg())),
        (
            "layers".into(),
            Value::Array(md.layers().iter().map(|&l| Value::int(l)).collect()),
        ),
        ("n_examples".into(), int(layout.n_examples)),
        (
            "content_tokens_per_example".into(),
            int(layout.content_tokens),
        ),
        ("cls_token".into(), Value::Bool(layout.cls)),
        ("tokens_per_example".into(), int(layout.tokens)),
        ("d_model".into(), int(layout.d_model)),
        (
            "max_tokens_per_shard".into(),
            int(md.max_tokens_per_shard()),
        ),
        ("examples_per_shard".into(), int(layout.examples_per_shard)),
        ("n_shards".into(), int(layout.n_shards)),
        ("shard_bytes".into(), int(layout.shard_bytes())),
        ("total_bytes".into(), int(layout.total_bytes())),
        (
            "shape".into(),
            Value::Array(
                [
                    layout.n_examples,
                    layout.n_layers,
                    layout.tokens,
                    layout.d_model,
                ]
                .into_iter()
                .map(int)
                .collect(),
            ),
        ),
        ("labels".into(), Value::Bool(labels.is_some())),
        ("complete".into(), Value::Bool(complete.is_ok())),
        ("examples_present".into(), present.map_or(Value::Null, int)),
        (
            "problem".into(),
            complete
                .err()
                .map_or(Value::Null, |e| Value::String(e.to_string())),
        ),
        (
            "saev_loads".into(),
            Value::Bool(md.saev_findings().errors.is_empty()),
        ),
        (
            "hash_recipe".into(),
            Value::String(md.recipe().label().into()),
        ),
        (
            "name_matches".into(),
            md.matching_recipe(&name)
                .map_or(Value::Null, |r| Value::String(r.label().into())),
        ),
        (
            "warnings".into(),
            Value::Array(warnings.into_iter().map(Value::String).collect()),
        ),
    ]))
}

fn validate_remote(url: &Path) -> Validation {
    let mut r = Validation::new(url);
    match crate::saev::Dataset::open(url) {
        Ok(ds) => {
            let md_path = url.join("metadata.json");
            for w in ds.warnings() {
                r.push(Severity::Note, &md_path, w.clone());
            }
            r.push(
                Severity::Note,
                url,
                "checked in the object store: metadata.json, shards.json and every object's \
                 size (download the dataset for a check of its contents)",
            );
        }
        Err(e) => {
            let file = e
                .path()
                .map_or_else(|| url.to_path_buf(), Path::to_path_buf);
            r.push(Severity::Error, &file, e.message());
        }
    }
    r
}

/// The index of a shard file name `acts%06d.bin` (any number of digits).
pub(crate) fn shard_index(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("acts")?.strip_suffix(".bin")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}
