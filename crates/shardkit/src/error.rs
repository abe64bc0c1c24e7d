//! One error type for the whole library. Every variant names the file (or the argument) and the
//! rule that was broken, so a message can be shown to a user as it is.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in shardkit.
///
/// The enum is `#[non_exhaustive]`: new kinds of failure may be added without a breaking
/// release, so a `match` on it needs a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O error while touching `path`.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory being accessed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file or directory that should exist does not.
    #[error("{}: {what}", path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
        /// What was expected there.
        what: String,
    },
    /// A file's content breaks a rule of its format.
    #[error("{}: {rule}", path.display())]
    Format {
        /// The offending file.
        path: PathBuf,
        /// The violated rule, in words.
        rule: String,
    },
    /// A dataset that is not completely written; reading it would serve missing data.
    #[error(
        "{}: incomplete dataset: {present} of {total} examples are present ({detail})",
        path.display()
    )]
    Incomplete {
        /// The dataset directory.
        path: PathBuf,
        /// Examples durably present.
        present: u64,
        /// Examples the metadata promises.
        total: u64,
        /// Why it is incomplete.
        detail: String,
    },
    /// A dataset whose writer started and did not finish (crashed, killed, or still running);
    /// resuming the write completes it.
    #[error("{}: interrupted write: {detail}", path.display())]
    Interrupted {
        /// The dataset (or split) directory.
        path: PathBuf,
        /// What is present and how to continue.
        detail: String,
    },
    /// A safetensors file breaks the format (the parser's typed error: `HeaderTooLarge`,
    /// `InvalidOffset`, `MetadataIncompleteBuffer`, ...).
    #[error("{}: not a valid safetensors file: {source}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the safetensors parser found.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The destination already holds something that must not be overwritten.
    #[error("{}: {why}", path.display())]
    Exists {
        /// The existing path.
        path: PathBuf,
        /// What is there and why it is kept.
        why: String,
    },
    /// Another writer holds the dataset's lock (see [`crate::lock`]).
    #[error(
        "{}: another writer{} is writing this dataset; wait for it to finish or stop it (the lock \
         goes away with its process)",
        path.display(),
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked {
        /// The dataset (or container file) being written.
        path: PathBuf,
        /// The process holding the lock, where the system tells.
        pid: Option<u32>,
    },
    /// Another writer holds the lock of a dataset being written to an object store, or this
    /// writer's lock there was taken over (see `store_lock`).
    #[error("{}: {why}", path.display())]
    LockedRemote {
        /// The lock object.
        path: PathBuf,
        /// Who holds it, and what to do.
        why: String,
    },
    /// A caller-supplied argument is invalid (shape, range, option): the caller's mistake,
    /// fixed by calling differently.
    #[error("{0}")]
    Invalid(String),
    /// The operating system refused to start a thread (or a pool of threads) shardkit needs.
    #[error("cannot start {what}: {source}")]
    Thread {
        /// The thread or pool that could not start ("the loader thread shardkit-prefetch", ...).
        what: String,
        /// Why the system refused.
        #[source]
        source: std::io::Error,
    },
    /// A failure that is shardkit's own bug, not the caller's nor the data's: a worker thread
    /// panicked, or an invariant that should always hold did not. Worth reporting.
    #[error("{0}")]
    Internal(String),
    /// An index is outside the valid range.
    #[error("{what} {index} is out of range (valid: 0..{len})")]
    OutOfRange {
        /// What was indexed ("example", "token", ...).
        what: &'static str,
        /// The index given.
        index: i64,
        /// The number of valid indices.
        len: u64,
    },
    /// An object-store request failed after its retries (or could not be retried): names the
    /// object and the byte range asked for.
    #[error("{object}{}: {message}", range.as_ref().map(|r| format!(" (bytes {}..{})", r.start, r.end)).unwrap_or_default())]
    Remote {
        /// The object's URL (`s3://bucket/key`).
        object: String,
        /// The bytes asked for, for a ranged read.
        range: Option<std::ops::Range<u64>>,
        /// What the store (or the connection) said.
        message: String,
    },
    /// A recorded key (layer value, tensor name) is absent.
    #[error("{0}")]
    Missing(String),
}

/// Shorthand for results in shardkit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The file or directory the error concerns, when it concerns one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::Io { path, .. }
            | Error::NotFound { path, .. }
            | Error::Format { path, .. }
            | Error::Incomplete { path, .. }
            | Error::Interrupted { path, .. }
            | Error::Safetensors { path, .. }
            | Error::Exists { path, .. }
            | Error::Locked { path, .. }
            | Error::LockedRemote { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The message without the leading `PATH: ` that [`Error::path`] gives separately.
    pub fn message(&self) -> String {
        let s = self.to_string();
        match self.path() {
            Some(p) => {
                let prefix = format!("{}: ", p.display());
                s.strip_prefix(&prefix).map(str::to_owned).unwrap_or(s)
            }
            None => s,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        let path = path.as_ref().to_path_buf();
        if source.kind() == std::io::ErrorKind::NotFound {
            return Error::NotFound {
                path,
                what: "no such file or directory".into(),
            };
        }
        Error::Io { path, source }
    }

    /// A format violation in `path`.
    pub fn format(path: impl AsRef<Path>, rule: impl Into<String>) -> Self {
        Error::Format {
            path: path.as_ref().to_path_buf(),
            rule: rule.into(),
        }
    }
}

/// Attaches a path to `std::io::Result`s.
pub(crate) trait IoContext<T> {
    fn at(self, path: impl AsRef<Path>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl AsRef<Path>) -> Result<T> {
        self.map_err(|e| Error::io(path, e))
    }
}
