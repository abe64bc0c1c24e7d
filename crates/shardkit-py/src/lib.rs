//! Python bindings of shardkit. This crate builds today so the workspace layout is final;
//! the PyO3 module arrives with the Python-package issue.

/// The version of the shardkit library these bindings wrap.
pub fn shardkit_version() -> &'static str {
    shardkit::VERSION
}
