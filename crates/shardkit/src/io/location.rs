//! Where a dataset lives, parsed once: a plain path or `file://` URL is a local directory,
//! `s3://bucket/prefix` (or `s3a://`) a prefix in an object store. The rest of the library
//! holds a [`Location`] (or the [`Source`](super::Source) opened from it) and never looks at
//! the URL's text again.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where a dataset lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local path (`file://` stripped).
    Local(PathBuf),
    /// A prefix in an S3-compatible object store.
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix, without leading or trailing slashes; may be empty.
        prefix: String,
    },
}

impl Location {
    /// Parses a path or URL: `s3://bucket/prefix` and `s3a://bucket/prefix` (a trailing slash
    /// ignored; empty, `.` and `..` key segments refused), `file:///path`, or a plain path.
    pub fn parse(path: impl AsRef<Path>) -> Result<Location> {
        let path = path.as_ref();
        let Some(s) = path.to_str() else {
            return Ok(Location::Local(path.to_path_buf()));
        };
        let Some(rest) = s.strip_prefix("s3://").or_else(|| s.strip_prefix("s3a://")) else {
            return Ok(Location::Local(local_path(path)));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(Error::Invalid(format!("{s}: the URL names no bucket")));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..") || prefix.contains("//") {
            return Err(Error::Invalid(format!(
                "{s}: object keys may not contain empty, `.` or `..` segments"
            )));
        }
        Ok(Location::S3 {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// Whether the bytes are local files (they can be mapped, read ahead, read with O_DIRECT).
    pub(crate) fn is_local(&self) -> bool {
        matches!(self, Location::Local(_))
    }

    /// The local directory or file, for a local location.
    pub fn local_path(&self) -> Option<&Path> {
        match self {
            Location::Local(p) => Some(p),
            Location::S3 { .. } => None,
        }
    }

    /// The parent prefix and the last segment (`s3://b/a/m.sdnb` → `s3://b/a`, `m.sdnb`; a
    /// local path's parent directory and file name).
    pub(crate) fn split_last(&self) -> Result<(Location, String)> {
        match self {
            Location::S3 { bucket, prefix } => {
                let (parent, name) = match prefix.rsplit_once('/') {
                    Some((p, n)) => (p.to_string(), n.to_string()),
                    None => (String::new(), prefix.clone()),
                };
                if name.is_empty() {
                    return Err(Error::Invalid(format!(
                        "{self}: names a bucket, not an object"
                    )));
                }
                let parent = Location::S3 {
                    bucket: bucket.clone(),
                    prefix: parent,
                };
                Ok((parent, name))
            }
            Location::Local(p) => {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .ok_or_else(|| Error::Invalid(format!("{}: names no file", p.display())))?;
                let parent = p.parent().map(Path::to_path_buf).unwrap_or_default();
                Ok((Location::Local(parent), name))
            }
        }
    }

    /// The location as a path for messages and callers: the local path, or `s3://bucket/prefix`.
    pub(crate) fn to_path(&self) -> PathBuf {
        match self {
            Location::Local(p) => p.clone(),
            Location::S3 { .. } => PathBuf::from(self.to_string()),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Location::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// Whether `path` names local files (a plain path or a `file://` URL): the capability question
/// a format asks of a path it holds (a store's reads are ranged requests, not maps).
pub(crate) fn is_local(path: &Path) -> bool {
    Location::parse(path).is_ok_and(|l| l.is_local())
}

/// `path` as a local path (`file://` stripped).
pub(crate) fn local_path(path: &Path) -> PathBuf {
    match path.to_str().and_then(|s| s.strip_prefix("file://")) {
        Some(rest) => PathBuf::from(rest),
        None => path.to_path_buf(),
    }
}

/// The refusal of a loader's `verify` for a dataset in an object store.
pub(crate) fn verify_needs_local(url: &Path) -> Error {
    Error::Invalid(format!(
        "{}: verify needs local files (checksums are checked as the page cache is read); reads \
         from an object store are checked by length; `validate --deep` and `shardkit.verify` \
         check a store's objects against their checksums in one pass",
        url.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::Remote;

    #[test]
    fn urls_parse_and_bad_ones_are_refused() {
        assert!(!is_local(Path::new("s3://b/p")));
        assert!(!is_local(Path::new("s3a://b/p")));
        assert!(is_local(Path::new("/data/s3://x")));
        assert_eq!(local_path(Path::new("file:///a/b")), PathBuf::from("/a/b"));
        let e = Remote::parse(Path::new("s3:///x")).unwrap_err();
        assert!(e.to_string().contains("names no bucket"), "{e}");
        let e = Remote::parse(Path::new("s3://b/a/../c")).unwrap_err();
        assert!(e.to_string().contains("`..`"), "{e}");
        assert_eq!(
            Location::parse("s3a://bucket/a/b/").unwrap(),
            Location::S3 {
                bucket: "bucket".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            Location::parse("file:///a/b").unwrap(),
            Location::Local("/a/b".into())
        );
        assert_eq!(
            Location::parse("s3://bucket/a/b/").unwrap().to_string(),
            "s3://bucket/a/b"
        );
        assert!(Location::parse("/data/s3://x").unwrap().is_local());
        for bad in ["s3:///x", "s3://b/a/../c", "s3://b/a//c"] {
            assert!(Location::parse(bad).is_err(), "{bad}");
        }
        let ok = Remote::parse(Path::new("s3://bucket/a/b/")).unwrap();
        assert_eq!(ok.url(), "s3://bucket/a/b");
        assert_eq!(
            ok.join("c").url_of("x.bin"),
            PathBuf::from("s3://bucket/a/b/c/x.bin")
        );
    }
}
