//! The provenance sidecar `shardkit.provenance.json`: where a produced dataset came from, as a
//! producer records it (digests of the model's parameters, of its tokenizer or image
//! processor, of the input order; see the Python producers). The references' readers never
//! open the file.
//!
//! It is written once, by the first process of a write (created only if absent: a hard link
//! of a finished temporary locally, a conditional create in a store), and every later process
//! (another rank, a restart) must bring the same record: one that differs is refused naming
//! the keys that differ, so a changed model or tokenizer never silently extends an old
//! dataset. It is a JSON object of objects (`{"model": {...}, "inputs": {...}}`), compared
//! key by key.

use std::path::Path;

use super::Target;
use crate::error::{Error, Result};
use crate::fsutil;
use crate::json::{self, Value};

/// The sidecar's file name, in the dataset directory.
pub const FILE: &str = "shardkit.provenance.json";

/// Records `ours` as the provenance of the dataset at `dir` (a directory or an `s3://` URL),
/// or checks it against the one recorded: `Error::Exists` naming the differing keys when they
/// differ (nothing is written then).
pub fn record(dir: impl AsRef<Path>, ours: &Value) -> Result<()> {
    let dir = dir.as_ref();
    if !matches!(ours, Value::Object(_)) {
        return Err(Error::Invalid(format!(
            "{}: a provenance record is a JSON object, got {}",
            dir.join(FILE).display(),
            json::to_compact(ours, false, json::Escape::Utf8)
        )));
    }
    let bytes = json::to_pretty(ours, 1, json::Escape::Ascii).into_bytes();
    let (path, theirs) = match Target::parse(dir)? {
        Target::Local(dir) => {
            let path = dir.join(FILE);
            (path.clone(), create_local(&path, &bytes)?)
        }
        Target::Store(target) => {
            let theirs = match target.put_if(FILE, bytes.clone(), None)? {
                Some(_) => None,
                None => target.get_opt(FILE)?,
            };
            (target.url_of(FILE), theirs)
        }
    };
    match theirs {
        None => Ok(()),
        Some(theirs) => compare(&path, ours, &theirs),
    }
}

/// The provenance recorded for the dataset at `dir`, if any.
pub fn read(dir: impl AsRef<Path>) -> Result<Option<Value>> {
    let dir = dir.as_ref();
    let (path, bytes) = match Target::parse(dir)? {
        Target::Local(dir) => {
            let path = dir.join(FILE);
            match fsutil::read_json_file(&path) {
                Ok(b) => (path, b),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        Target::Store(target) => match target.get_opt(FILE)? {
            Some(b) => (target.url_of(FILE), b),
            None => return Ok(None),
        },
    };
    parse(&path, &bytes).map(Some)
}

/// Creates `path` holding `bytes` unless it exists: `None` when created, else what it holds.
fn create_local(path: &Path, bytes: &[u8]) -> Result<Option<Vec<u8>>> {
    // Ranks may create it at once: each writes a temporary of its own.
    let tmp = fsutil::unique_temp_sibling(path);
    if let Err(e) = fsutil::write_synced(&tmp, bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // A hard link fails if the name exists: of two ranks creating it at once, one wins.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            fsutil::fsync_dir(fsutil::parent_of(path))?;
            Ok(None)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => fsutil::read_json_file(path)
            .map(Some)
            .map_err(|e| Error::io(path, e)),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Value> {
    match json::parse(bytes) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(Error::format(path, "is not a JSON object")),
        Err(e) => Err(Error::format(path, format!("is not JSON: {e}"))),
    }
}

/// The refusal of `ours` against the record `theirs` at `path`, naming each differing key
/// (`model.sha256`), when they differ.
fn compare(path: &Path, ours: &Value, theirs: &[u8]) -> Result<()> {
    let theirs = parse(path, theirs)?;
    let keys = differing(ours, &theirs);
    if keys.is_empty() {
        return Ok(());
    }
    Err(Error::Exists {
        path: path.to_path_buf(),
        why: format!(
            "the dataset was produced from another source: provenance {} differ{} from this \
             run's; produce into another directory (or delete this one) instead of extending \
             it (nothing was written)",
            keys.join(", "),
            if keys.len() == 1 { "s" } else { "" }
        ),
    })
}

/// The dotted names of the keys of `a` and `b` whose values differ, one level into objects
/// (`model.sha256`).
fn differing(a: &Value, b: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for k in union(a, b) {
        match (a.get(&k), b.get(&k)) {
            (Some(x @ Value::Object(_)), Some(y @ Value::Object(_))) => {
                for sub in union(x, y) {
                    if x.get(&sub) != y.get(&sub) {
                        out.push(format!("{k}.{sub}"));
                    }
                }
            }
            (x, y) if x != y => out.push(k),
            _ => {}
        }
    }
    out
}

/// The keys of objects `a` and `b`, sorted, once each.
fn union(a: &Value, b: &Value) -> Vec<String> {
    let keys = |v: &Value| match v {
        Value::Object(m) => m.iter().map(|(k, _)| k.clone()).collect(),
        _ => Vec::new(),
    };
    let mut all: Vec<String> = keys(a);
    all.extend(keys(b));
    all.sort();
    all.dedup();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Value {
        json::parse(s.as_bytes()).unwrap()
    }

    #[test]
    fn the_first_record_is_kept_and_a_different_one_is_refused_naming_the_keys() {
        let tmp = tempfile::tempdir().unwrap();
        let ours =
            v(r#"{"model": {"sha256": "aa", "parameters": 10}, "inputs": {"sha256": "bb"}}"#);
        record(tmp.path(), &ours).unwrap();
        record(tmp.path(), &ours).unwrap(); // the same: accepted
        assert_eq!(read(tmp.path()).unwrap().unwrap(), ours);
        let before = std::fs::read(tmp.path().join(FILE)).unwrap();
        let other = v(
            r#"{"model": {"sha256": "ab", "parameters": 10}, "inputs": {"sha256": "bb"}, "x": 1}"#,
        );
        let e = record(tmp.path(), &other).unwrap_err();
        assert!(matches!(e, Error::Exists { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("provenance model.sha256, x differ"), "{msg}");
        assert!(msg.contains(FILE), "{msg}");
        assert_eq!(std::fs::read(tmp.path().join(FILE)).unwrap(), before);
        // No temporary left behind, and a non-object is refused.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
        assert!(record(tmp.path(), &Value::int(3)).is_err());
        assert!(read(tmp.path().join("none")).unwrap().is_none());
    }

    #[test]
    fn ranks_recording_at_once_agree_on_one_record() {
        let tmp = tempfile::tempdir().unwrap();
        let ours = v(r#"{"model": {"sha256": "aa"}}"#);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| record(tmp.path(), &ours).unwrap());
            }
        });
        assert_eq!(read(tmp.path()).unwrap().unwrap(), ours);
    }
}
