//! Zarr plumbing shared by the reader and the writer: which zarr format a dataset is, the
//! completion marker on its root group, and metadata files in the exact text zarr-python 2
//! writes (flat_tokens.md §3.2), which zarrs does not produce.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::{ArrayCreateError, ArrayError, CodecError};
use zarrs::filesystem::{FilesystemStore, FilesystemStoreCreateError};
use zarrs::group::{Group, GroupCreateError};
use zarrs::storage::{ReadableStorageTraits, StorageError, StoreKey, WritableStorageTraits};

use crate::error::{Error, Result};
use crate::json::{self, Escape, Value};

/// The root-group attribute shardkit writers set to `true` after everything else (§9.3).
pub(crate) const MARKER: &str = "write_completed";

/// The zarr format of a dataset on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZarrFormat {
    /// Zarr v2 (`.zgroup`, `.zarray`, `.zattrs`): what seqax writes and reads.
    V2,
    /// Zarr v3 (`zarr.json`).
    V3,
}

impl ZarrFormat {
    /// The format of the group at `dir`, if it is one.
    pub(crate) fn of_group(dir: &Path) -> Option<ZarrFormat> {
        if dir.join("zarr.json").is_file() {
            Some(ZarrFormat::V3)
        } else if dir.join(".zgroup").is_file() {
            Some(ZarrFormat::V2)
        } else {
            None
        }
    }

    /// "v2" or "v3" (also its `Display`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            ZarrFormat::V2 => "v2",
            ZarrFormat::V3 => "v3",
        }
    }
}

/// What the root group says about how the dataset was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// `write_completed: true`: a shardkit writer finished it.
    Complete,
    /// `write_completed: false`: a shardkit writer started and did not finish (crashed, killed,
    /// or still running). Never served; `resume` continues it.
    Interrupted,
    /// No marker (seqax and other writers): served only after full validation.
    Unmarked,
}

impl Completion {
    /// The marker of the root group opened from `store`.
    pub(crate) fn read<S: ?Sized + ReadableStorageTraits + 'static>(store: Arc<S>) -> Completion {
        let marker = Group::open(store, "/")
            .ok()
            .and_then(|g| g.attributes().get(MARKER).cloned());
        match marker {
            Some(serde_json::Value::Bool(true)) => Completion::Complete,
            Some(_) => Completion::Interrupted,
            None => Completion::Unmarked,
        }
    }

    /// "complete", "interrupted" or "unmarked" (also its `Display`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Completion::Complete => "complete",
            Completion::Interrupted => "interrupted",
            Completion::Unmarked => "unmarked",
        }
    }
}

/// "v2" or "v3".
impl std::fmt::Display for ZarrFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// "complete", "interrupted" or "unmarked".
impl std::fmt::Display for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A JSON document as zarr-python 2 writes its metadata files: keys sorted at every level,
/// 4-space indentation, ASCII escapes, no trailing newline.
pub(crate) fn zarr2_json(v: &Value) -> Vec<u8> {
    json::to_pretty(&v.sorted(), 4, Escape::Ascii).into_bytes()
}

/// The operating-system error beneath a zarrs error (a store's failing read, write or list),
/// if that is what went wrong.
pub(crate) trait IoBeneath: std::fmt::Display {
    fn io_beneath(&self) -> Option<&std::io::Error>;
    /// A failed request of an object store beneath (`io`'s zarr store reports them
    /// as `StorageError::Other`), after its retries.
    fn remote_beneath(&self) -> Option<&str> {
        None
    }
}

impl IoBeneath for StorageError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            StorageError::IOError(io) => Some(io),
            _ => None,
        }
    }
    fn remote_beneath(&self) -> Option<&str> {
        match self {
            StorageError::Other(msg) => Some(msg),
            _ => None,
        }
    }
}

impl IoBeneath for FilesystemStoreCreateError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            FilesystemStoreCreateError::IOError(io) => Some(io),
            _ => None,
        }
    }
}

impl IoBeneath for CodecError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            CodecError::IOError(io) => Some(io),
            CodecError::StorageError(s) => s.io_beneath(),
            _ => None,
        }
    }
    fn remote_beneath(&self) -> Option<&str> {
        match self {
            CodecError::StorageError(s) => s.remote_beneath(),
            _ => None,
        }
    }
}

impl IoBeneath for ArrayError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            ArrayError::StorageError(s) => s.io_beneath(),
            ArrayError::CodecError(c) => c.io_beneath(),
            _ => None,
        }
    }
    fn remote_beneath(&self) -> Option<&str> {
        match self {
            ArrayError::StorageError(s) => s.remote_beneath(),
            ArrayError::CodecError(c) => c.remote_beneath(),
            _ => None,
        }
    }
}

impl IoBeneath for ArrayCreateError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            ArrayCreateError::StorageError(s) => s.io_beneath(),
            _ => None,
        }
    }
    fn remote_beneath(&self) -> Option<&str> {
        match self {
            ArrayCreateError::StorageError(s) => s.remote_beneath(),
            _ => None,
        }
    }
}

impl IoBeneath for GroupCreateError {
    fn io_beneath(&self) -> Option<&std::io::Error> {
        match self {
            GroupCreateError::StorageError(s) => s.io_beneath(),
            _ => None,
        }
    }
    fn remote_beneath(&self) -> Option<&str> {
        match self {
            GroupCreateError::StorageError(s) => s.remote_beneath(),
            _ => None,
        }
    }
}

/// A zarrs failure as shardkit's error. An operating-system error (EACCES, ENOSPC, EFBIG, EIO)
/// is [`Error::Io`] naming the file it concerns: the one of `files` (the chunk, shard or
/// metadata files the operation touched, in order) that fails to open and read the same way,
/// found by probing them on this cold path, else the first. Anything else is a format error
/// naming `array`, saying `what` was being done.
pub(crate) fn zarrs_error(
    e: &impl IoBeneath,
    array: &Path,
    files: &[PathBuf],
    what: impl FnOnce() -> String,
) -> Error {
    if let (Some(msg), true) = (e.remote_beneath(), !crate::io::is_local(array)) {
        return Error::Remote {
            object: array.display().to_string(),
            range: None,
            message: format!("{}: {msg}", what()),
        };
    }
    let Some(io) = e.io_beneath() else {
        return Error::format(array, format!("{}: {e}", what()));
    };
    let fails_alike = |p: &PathBuf| {
        let probe = std::fs::File::open(p).and_then(|mut f| {
            use std::io::Read;
            f.read(&mut [0u8; 1])
        });
        probe.is_err_and(|x| x.kind() == io.kind())
    };
    let file = match files {
        [one] => one,
        [] => array,
        many => many.iter().find(|p| fails_alike(p)).unwrap_or(&many[0]),
    };
    // zarrs keeps the error in an Arc: rebuild it, keeping the errno (Python picks the OSError
    // subclass by it).
    let owned = match io.raw_os_error() {
        Some(errno) => std::io::Error::from_raw_os_error(errno),
        None => std::io::Error::new(io.kind(), io.to_string()),
    };
    Error::io(file, owned)
}

/// A store key from a path we build ourselves (always valid).
pub(crate) fn key(path: &str) -> Result<StoreKey> {
    StoreKey::new(path).map_err(|e| Error::Invalid(format!("zarr key {path:?}: {e}")))
}

/// Writes `v` to `key` in zarr-python 2's text.
pub(crate) fn put_zarr2_json<S: ?Sized + WritableStorageTraits>(
    store: &S,
    root: &Path,
    k: &str,
    v: &Value,
) -> Result<()> {
    store
        .set(&key(k)?, zarr2_json(v).into())
        .map_err(|e| zarrs_error(&e, &root.join(k), &[], || "cannot write".into()))
}

/// Reads the JSON document at `key` (None when absent).
pub(crate) fn get_json(store: &FilesystemStore, root: &Path, k: &str) -> Result<Option<Value>> {
    if let Some(len) = crate::fsutil::regular_file_len(&root.join(k)) {
        if len > crate::fsutil::MAX_JSON_BYTES {
            return Err(Error::format(
                root.join(k),
                format!(
                    "{len} bytes: over the {} MiB cap on JSON files",
                    crate::fsutil::MAX_JSON_BYTES >> 20
                ),
            ));
        }
    }
    let bytes = store
        .get(&key(k)?)
        .map_err(|e| zarrs_error(&e, &root.join(k), &[], || "cannot read".into()))?;
    match bytes {
        None => Ok(None),
        Some(b) => json::parse(&b)
            .map(Some)
            .map_err(|e| Error::format(root.join(k), e.to_string())),
    }
}

/// Removes temporaries a killed writer left in `dir` and its subdirectories (zarrs' atomic
/// adapter names them `<key>.tmp`, and refuses to write while one exists).
pub(crate) fn remove_temporaries(dir: &Path) -> Result<u64> {
    let mut removed = 0;
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        let ft = entry.file_type().map_err(|e| Error::io(&path, e))?;
        if ft.is_dir() {
            removed += remove_temporaries(&path)?;
        } else if entry.file_name().to_string_lossy().ends_with(".tmp") {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zarr2_text_is_sorted_4_space_ascii_without_newline() {
        let v = json::parse(br#"{"zarr_format": 2, "a": {"z": 1, "b": [1, 2]}, "s": "\u00e9"}"#)
            .unwrap();
        let text = String::from_utf8(zarr2_json(&v)).unwrap();
        assert_eq!(
            text,
            "{\n    \"a\": {\n        \"b\": [\n            1,\n            2\n        ],\n        \
             \"z\": 1\n    },\n    \"s\": \"\\u00e9\",\n    \"zarr_format\": 2\n}"
        );
    }
}
