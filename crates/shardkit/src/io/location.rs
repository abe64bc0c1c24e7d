//! Where a dataset lives, parsed once.

use std::path::{Path, PathBuf};

use crate::error::Error;

/// Whether `path` names an object-store location (`s3://` or `s3a://`).
pub fn is_remote(path: &Path) -> bool {
    path.to_str()
        .is_some_and(|s| s.starts_with("s3://") || s.starts_with("s3a://"))
}

/// `path` as a local path (`file://` stripped).
pub fn local_path(path: &Path) -> PathBuf {
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
        assert!(is_remote(Path::new("s3://b/p")));
        assert!(!is_remote(Path::new("/data/s3://x")));
        assert_eq!(local_path(Path::new("file:///a/b")), PathBuf::from("/a/b"));
        let e = Remote::parse(Path::new("s3:///x")).unwrap_err();
        assert!(e.to_string().contains("names no bucket"), "{e}");
        let e = Remote::parse(Path::new("s3://b/a/../c")).unwrap_err();
        assert!(e.to_string().contains("`..`"), "{e}");
        let ok = Remote::parse(Path::new("s3://bucket/a/b/")).unwrap();
        assert_eq!(ok.url(), "s3://bucket/a/b");
        assert_eq!(
            ok.join("c").url_of("x.bin"),
            PathBuf::from("s3://bucket/a/b/c/x.bin")
        );
    }
}
