//! `validate` and `inspect`: every problem of a saev directory in one report, and a summary.

use std::fs::File;
use std::path::Path;

use crate::commit::provenance;
use crate::error::Error;
use crate::error::IoContext;
use crate::fsutil;
use crate::io::{self, Location, Source};
use crate::json::Value;
use crate::saev::dataset::{check_complete, check_complete_with, check_entries, leading_full_with};
use crate::saev::layout::{parse_shards_json, Layout};
use crate::saev::rounding;
use crate::saev::Metadata;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

pub use crate::report::Severity;
use crate::report::Validation;

/// What a dataset being written in parts still lacks, for `validate`.
fn parts_finding(st: &crate::PartsStatus) -> String {
    let ranges = |rs: &[std::ops::Range<u64>]| {
        rs.iter()
            .map(|r| format!("{}..{}", r.start, r.end))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut msg = format!(
        "written in parts and not committed: {} of {} shards durable",
        st.done.len(),
        st.units
    );
    match st.missing() {
        m if m.is_empty() => msg.push_str(
            "; every shard is durable, the commit is missing (`shardkit saev status --commit` \
             commits it)",
        ),
        m => msg.push_str(&format!("; missing shards {}", ranges(&m))),
    }
    for (r, who) in &st.claimed {
        msg.push_str(&format!(
            "; shards {}..{} being written by {who}",
            r.start, r.end
        ));
    }
    msg
}

/// Checks a saev directory and collects every problem: metadata, directory name, shards.json
/// against metadata, each shard file (missing, empty, not regular, unreadable, wrong size),
/// completeness, labels.bin, and leftovers of an interrupted write.
///
/// An `s3://` URL gets the same checks, from one listing of its objects and its two JSON
/// documents; like a local check, no shard's contents are read (`validate --deep` reads every
/// byte against the checksums sidecar).
pub fn validate(dir: impl AsRef<Path>) -> Validation {
    let dir = io::local_path(dir.as_ref());
    let mut r = Validation::new(&dir);
    let files = match Files::list(&dir) {
        Ok(f) => f,
        Err(e) => {
            let file = e.path().map_or_else(|| dir.clone(), Path::to_path_buf);
            r.push(Severity::Error, &file, strip_path(&e, &file));
            return r;
        }
    };
    let mut push = |sev, file: &Path, msg: String| r.push(sev, file, msg);
    let md_path = dir.join("metadata.json");
    let md = match files
        .read("metadata.json")
        .and_then(|b| Metadata::parse(&b, &md_path))
    {
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
    match files.entries.get("shards.json") {
        None => {
            let k = leading_full_with(&layout, |n| files.size(n));
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
            if let Some(st) = super::parts::unfinished_status(&dir) {
                push(Severity::Error, &dir, parts_finding(&st));
            }
        }
        Some(Err(why)) => push(Severity::Error, &sj, why.clone()),
        Some(Ok(_)) => match files
            .read("shards.json")
            .and_then(|bytes| parse_shards_json(&bytes, &sj))
        {
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
    // are found in the listing, so a metadata.json claiming absurdly many shards costs no more
    // than the files present; missing ones are reported as ranges.
    let expected = layout.n_shards.max(listed);
    let present: BTreeMap<u64, &std::result::Result<u64, String>> = files
        .entries
        .iter()
        .filter_map(|(n, e)| Some((shard_index(n)?, e)))
        .filter(|&(s, _)| s < expected)
        .collect();
    for (&s, entry) in &present {
        let p = dir.join(Layout::shard_name(s));
        let extra = s >= layout.n_shards;
        match entry {
            Err(why) => push(Severity::Error, &p, why.clone()),
            Ok(0) if !extra => push(Severity::Error, &p, "empty file".into()),
            Ok(len) if *len != layout.shard_bytes() && !extra => push(
                Severity::Error,
                &p,
                format!(
                    "{len} bytes; every shard must be {} ({} examples x {} bytes)",
                    layout.shard_bytes(),
                    layout.examples_per_shard,
                    layout.example_bytes()
                ),
            ),
            Ok(_) => {}
        }
    }
    let mut start = 0u64;
    for gap_end in present.keys().copied().chain(std::iter::once(expected)) {
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

    // A reduced-precision dataset's shards each carry their rounding error; a float32 one has
    // no such sidecar.
    let sidecars: Vec<u64> = files
        .entries
        .keys()
        .filter_map(|n| rounding::sidecar_index(n))
        .collect();
    if layout.dtype.is_reduced() {
        let have = |name: &str| match files.entries.get(name) {
            Some(_) => files.read(name).map(Some),
            None => Ok(None),
        };
        let durable = present.keys().filter(|&&s| s < layout.n_shards).count() as u64;
        match rounding::Sidecars::read(&dir, &layout, durable, have) {
            Ok(found) => {
                for s in found
                    .missing
                    .into_iter()
                    .filter(|s| present.contains_key(s))
                {
                    push(
                        Severity::Error,
                        &dir.join(rounding::sidecar_name(s)),
                        format!(
                            "missing: every shard of a {} dataset carries its rounding error \
                             (written before the shard; restore it, or rewrite the shard)",
                            layout.dtype
                        ),
                    );
                }
                for e in found.bad {
                    let file = e.path().map_or_else(|| dir.clone(), Path::to_path_buf);
                    push(Severity::Error, &file, strip_path(&e, &file));
                }
            }
            Err(e) => {
                let file = e.path().map_or_else(|| dir.clone(), Path::to_path_buf);
                push(Severity::Error, &file, strip_path(&e, &file));
            }
        }
    } else if let Some(&s) = sidecars.first() {
        push(
            Severity::Note,
            &dir.join(rounding::sidecar_name(s)),
            format!(
                "{} error sidecar(s) in a float32 dataset, which rounds nothing (ignored)",
                sidecars.len()
            ),
        );
    }

    let labels = dir.join("labels.bin");
    match files.entries.get("labels.bin") {
        None => {}
        Some(Err(why)) => push(Severity::Error, &labels, why.clone()),
        Some(&Ok(len)) => {
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
    }
    let leftovers: Vec<&str> = files
        .entries
        .keys()
        .map(String::as_str)
        .filter(|n| fsutil::is_temp_name(n) || *n == ".shardkit-writing")
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
    r
}

/// What [`validate`] looks at: the files of a directory, or the objects directly under a store
/// prefix, each with its size or why it cannot be read as a file.
struct Files {
    dir: PathBuf,
    remote: Option<Arc<dyn Source>>,
    entries: BTreeMap<String, std::result::Result<u64, String>>,
    /// The dataset directories one level below (a writer's root holds `<root>/<hash>/`), named
    /// when metadata.json is missing.
    candidates: Vec<String>,
}

impl Files {
    fn list(dir: &Path) -> crate::Result<Files> {
        let location = Location::parse(dir)?;
        if !location.is_local() {
            let remote = io::open_uncached(&location)?;
            let listing = remote.list()?;
            let candidates =
                crate::saev::metadata::remote_candidates(listing.iter().map(|(n, _)| n));
            let entries = listing
                .into_iter()
                .filter(|(n, _)| !n.contains('/'))
                .map(|(n, size)| (n, Ok(size)))
                .collect();
            return Ok(Files {
                dir: dir.to_path_buf(),
                remote: Some(remote),
                entries,
                candidates,
            });
        }
        if !dir.is_dir() {
            return Err(crate::saev::metadata::missing_metadata(dir, true, &[]));
        }
        let mut entries = BTreeMap::new();
        for e in std::fs::read_dir(dir).at(dir)?.flatten() {
            let p = e.path();
            let entry = match std::fs::metadata(&p) {
                Err(e) => Err(format!("unreadable: {e}")),
                Ok(m) if !m.is_file() => Err("not a regular file".to_string()),
                Ok(m) => match File::open(&p) {
                    Err(e) => Err(format!("unreadable: {e}")),
                    Ok(_) => Ok(m.len()),
                },
            };
            entries.insert(e.file_name().to_string_lossy().into_owned(), entry);
        }
        Ok(Files {
            dir: dir.to_path_buf(),
            remote: None,
            entries,
            candidates: crate::saev::metadata::local_candidates(dir),
        })
    }

    /// A file's size (why it is no shard, for [`leading_full_with`]).
    fn size(&self, name: &str) -> std::result::Result<u64, &'static str> {
        match self.entries.get(name) {
            Some(Ok(len)) => Ok(*len),
            Some(Err(_)) => Err("not a regular file"),
            None => Err("missing"),
        }
    }

    /// A small document's bytes (an error naming it when it is missing or unreadable).
    fn read(&self, name: &str) -> crate::Result<Vec<u8>> {
        let path = self.dir.join(name);
        match (&self.remote, self.entries.get(name)) {
            (_, None) if name == "metadata.json" => Err(crate::saev::metadata::missing_metadata(
                &self.dir,
                self.remote.is_none(),
                &self.candidates,
            )),
            (_, None) => Err(Error::NotFound {
                path,
                what: "missing; expected a saev dataset holding metadata.json and shards.json"
                    .into(),
            }),
            (_, Some(Err(why))) => Err(Error::format(&path, why.clone())),
            (Some(remote), Some(Ok(_))) => remote.get(name),
            (None, Some(Ok(_))) => fsutil::read_json_file(&path).map_err(|e| Error::io(&path, e)),
        }
    }
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
    let location = Location::parse(dir.as_ref())?;
    let dir = &location.to_path();
    let (md, warnings, layout, complete, labels, precision) = if !location.is_local() {
        let remote = io::open_uncached(&location)?;
        let objects: HashMap<String, u64> = remote.list()?.into_iter().collect();
        if !objects.contains_key("metadata.json") {
            let candidates = crate::saev::metadata::remote_candidates(objects.keys());
            return Err(crate::saev::metadata::missing_metadata(
                dir,
                false,
                &candidates,
            ));
        }
        let (md, warnings) = Metadata::parse(
            &remote.get("metadata.json")?,
            &remote.path_of("metadata.json"),
        )?;
        let layout = Layout::new(&md, &remote.path_of("metadata.json"))?;
        let sj = match objects.contains_key("shards.json") {
            true => Some(remote.get("shards.json")?),
            false => None,
        };
        let url = remote.location().to_path();
        let complete = check_complete_with(&url, &layout, sj, |n| {
            objects
                .get(n)
                .copied()
                .ok_or("listed in shards.json but missing")
        });
        let precision = precision_summary(dir, &layout, &complete, |n| match objects.get(n) {
            Some(_) => remote.get(n).map(Some),
            None => Ok(None),
        })?;
        (
            md,
            warnings,
            layout,
            complete,
            objects.get("labels.bin").copied(),
            precision,
        )
    } else {
        let (md, warnings) = Metadata::read(dir)?;
        let layout = Layout::new(&md, &dir.join("metadata.json"))?;
        let complete = check_complete(dir, &layout);
        let labels = fsutil::regular_file_len(&dir.join("labels.bin"));
        let precision = precision_summary(dir, &layout, &complete, |n| {
            let p = dir.join(n);
            match fsutil::read_json_file(&p) {
                Ok(b) => Ok(Some(b)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(&p, e)),
            }
        })?;
        (md, warnings, layout, complete, labels, precision)
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
        (
            "dialect".into(),
            md.dialect()
                .map_or(Value::Null, |d| Value::String(d.into())),
        ),
        ("ckpt".into(), Value::String(md.ckpt().into())),
        ("dataset".into(), opt_str(md.dataset())),
        ("pixel_agg".into(), opt_str(md.pixel_agg())),
        ("dtype".into(), Value::String(layout.dtype.name().into())),
        // The rounding error the shards' sidecars record (null for float32).
        ("precision".into(), precision),
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
            Value::Bool(md.saev_findings().saev_loads()),
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
        // What a producer recorded about the model and inputs (null when none did).
        (
            "provenance".into(),
            provenance::read(dir)?.unwrap_or(Value::Null),
        ),
    ]))
}

/// What the error sidecars of a reduced-precision dataset record, merged (`Null` for float32):
/// every shard of a complete dataset, the leading shards present of one being written.
fn precision_summary(
    dir: &Path,
    layout: &Layout,
    complete: &crate::Result<()>,
    fetch: impl Fn(&str) -> crate::Result<Option<Vec<u8>>> + Sync,
) -> crate::Result<Value> {
    if !layout.dtype.is_reduced() {
        return Ok(Value::Null);
    }
    let shards = match complete {
        Ok(()) => layout.n_shards,
        Err(Error::Incomplete { present, .. }) => present / layout.examples_per_shard,
        Err(_) => 0,
    };
    let found = rounding::Sidecars::read(dir, layout, shards, fetch)?;
    Ok(found.to_json(layout.dtype))
}

/// The index of a shard file name `acts%06d.bin` (any number of digits).
pub(crate) fn shard_index(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("acts")?.strip_suffix(".bin")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}
