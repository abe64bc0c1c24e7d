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
    /// Another writer holds the dataset's lock (see the `lock` module).
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
    /// A value given to a writer that the format cannot store as it is: a label past 255, an
    /// id past the vocabulary, a mask other than 0 or 1, a NaN, a probability row that does not
    /// sum to 1, ... The write is refused before any of it is stored, so the dataset is as it
    /// was (still resumable). The rules are the ones `validate --deep` checks.
    #[error(
        "{}: refused `{field}` at {at}: {value} (allowed: {allowed}); nothing of this write \
         was stored",
        path.display()
    )]
    Refused {
        /// The dataset (or file) being written.
        path: PathBuf,
        /// The field (tensor, array) holding the value.
        field: String,
        /// Where in the write the first offending value is ("sample 3, position 5").
        at: String,
        /// The value, or what is wrong with it ("300", "NaN", "the row sums to 1.25").
        value: String,
        /// What the format allows ("0 to 255 (labels.bin is uint8)").
        allowed: String,
    },
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
    /// An index is outside the valid range. Shown in plain words: "example 70 is past the end:
    /// there are 64 examples (valid indices: 0 to 63)".
    #[error("{}", out_of_range_message(what, *index, *len))]
    OutOfRange {
        /// What was indexed ("example", "token", ...), optionally followed by a parenthesised
        /// hint on what to do instead ("step (enable epochs to ...)"), shown after the counts.
        what: &'static str,
        /// The index given.
        index: i64,
        /// The number of valid indices.
        len: u64,
    },
    /// An object-store request failed after its retries (or could not be retried): names the
    /// object and the byte range asked for.
    #[error("{object}{}: {message}", range.as_ref().map(byte_range_words).unwrap_or_default())]
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

/// " (bytes 100 to 199)" for the half-open range `100..200`: the bytes asked for, in words.
fn byte_range_words(r: &std::ops::Range<u64>) -> String {
    match r.end.checked_sub(1) {
        Some(last) if r.end > r.start => format!(" (bytes {} to {last})", r.start),
        _ => format!(" (no bytes, at offset {})", r.start),
    }
}

/// The plural of a noun phrase ("example" -> "examples", "index" -> "indices").
fn plural(noun: &str) -> String {
    if let Some(stem) = noun.strip_suffix("index") {
        format!("{stem}indices")
    } else if noun.ends_with('s') || noun.ends_with('x') || noun.ends_with("ch") {
        format!("{noun}es")
    } else {
        format!("{noun}s")
    }
}

/// The message of [`Error::OutOfRange`]: which index, why it is out (past the end, negative),
/// how many there are and the valid indices, in words rather than Rust range syntax.
fn out_of_range_message(what: &str, index: i64, len: u64) -> String {
    let (noun, hint) = match what.split_once(" (") {
        Some((noun, rest)) => (noun, Some(rest.trim_end_matches(')'))),
        None => (what, None),
    };
    let count = match len {
        0 => format!("there are no {}", plural(noun)),
        1 => format!("there is 1 {noun} (valid index: 0)"),
        n => format!(
            "there are {n} {} (valid indices: 0 to {})",
            plural(noun),
            n - 1
        ),
    };
    let mut s = if index < 0 {
        let from_end = match len {
            0 => String::new(),
            n => format!(", or -{n} to -1 counting from the end"),
        };
        format!("{noun} {index} is before the start: {count}{from_end}")
    } else {
        format!("{noun} {index} is past the end: {count}")
    };
    if let Some(h) = hint {
        s.push_str("; ");
        s.push_str(h);
    }
    s
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
            | Error::LockedRemote { path, .. }
            | Error::Refused { path, .. } => Some(path),
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

/// The message of a caught panic.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
