//! Notes: small files a producer keeps beside a dataset under `shardkit.notes/` (for example,
//! an EAGLE-3 top-k shard's retained probability mass), which the references' readers never
//! open. A note is replaced whole (a renamed temporary locally, one PUT in a store), so a
//! reader sees the old note or the new one, never a torn one; a producer writes a unit's note
//! before the unit becomes durable, so a durable unit has its note.

use std::path::Path;

use super::Target;
use crate::error::{Error, IoContext, Result};
use crate::fsutil;

/// The directory (or prefix) of the notes, in the dataset.
pub const DIR: &str = "shardkit.notes";

/// Checks a note's name: one plain file name (letters, digits, `.`, `-`, `_`), not hidden.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "note name {name:?}: a plain file name of letters, digits, '.', '-' and '_', not \
         starting with '.'"
    )))
}

/// Writes note `name` of the dataset at `dir` (a directory or an `s3://` URL), replacing it.
pub fn put(dir: impl AsRef<Path>, name: &str, bytes: &[u8]) -> Result<()> {
    check_name(name)?;
    match Target::parse(dir.as_ref())? {
        Target::Local(dir) => {
            let notes = dir.join(DIR);
            std::fs::create_dir_all(&notes).at(&notes)?;
            // Ranks may write the same note at once.
            fsutil::atomic_write_shared(&notes.join(name), bytes)
        }
        Target::Store(target) => target.put(&format!("{DIR}/{name}"), bytes.to_vec()),
    }
}

/// Every note of the dataset at `dir` whose name starts with `prefix`, sorted by name.
pub fn list(dir: impl AsRef<Path>, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    match Target::parse(dir.as_ref())? {
        Target::Local(dir) => {
            let notes = dir.join(DIR);
            let entries = match std::fs::read_dir(&notes) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
                Err(e) => return Err(Error::io(&notes, e)),
            };
            for e in entries {
                let e = e.at(&notes)?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(prefix) && !fsutil::is_temp_name(&name) {
                    let path = notes.join(&name);
                    out.push((name, std::fs::read(&path).at(&path)?));
                }
            }
        }
        Target::Store(target) => {
            let notes = target.join(DIR);
            for (name, _) in notes.list()? {
                if name.starts_with(prefix) {
                    let bytes = notes.get(&name)?;
                    out.push((name, bytes));
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_replaced_whole_listed_by_prefix_and_their_names_checked() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(list(tmp.path(), "").unwrap().is_empty());
        put(tmp.path(), "topk-shard-000001.json", b"{\"a\": 1}").unwrap();
        put(tmp.path(), "topk-shard-000000.json", b"{\"a\": 0}").unwrap();
        put(tmp.path(), "topk-shard-000001.json", b"{\"a\": 2}").unwrap();
        put(tmp.path(), "other.json", b"{}").unwrap();
        let got = list(tmp.path(), "topk-").unwrap();
        assert_eq!(
            got,
            [
                ("topk-shard-000000.json".to_string(), b"{\"a\": 0}".to_vec()),
                ("topk-shard-000001.json".to_string(), b"{\"a\": 2}".to_vec()),
            ]
        );
        // Ranks writing one note at once: each write lands whole.
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| put(tmp.path(), "same.json", b"[1, 2, 3]").unwrap());
            }
        });
        assert_eq!(list(tmp.path(), "same").unwrap()[0].1, b"[1, 2, 3]");
        for bad in ["", ".hidden", "a/b", "../x", "sp ace"] {
            let e = put(tmp.path(), bad, b"x").unwrap_err();
            assert!(e.to_string().contains("a plain file name"), "{bad}: {e}");
        }
    }
}
