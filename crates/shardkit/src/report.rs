//! The outcome of validating a dataset, one type for every format: each finding names the file
//! it concerns, and is an error (the dataset cannot be served exactly) or a note (worth knowing;
//! reading still works).

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::json::Value;

/// How serious a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The dataset cannot be served exactly.
    Error,
    /// Worth knowing (an absent optional part, leftover temporaries); reading still works.
    Note,
}

/// One finding of a validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Error or note.
    pub severity: Severity,
    /// The file concerned (the dataset itself when the finding is about all of it).
    pub file: PathBuf,
    /// What is wrong, without the file's name.
    pub message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file.display(), self.message)
    }
}

/// Everything a format's `validate` found, in the order found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Validation {
    /// The dataset checked (a directory, or an SDNB/SDZ file).
    pub path: PathBuf,
    /// The findings.
    pub findings: Vec<Finding>,
}

impl Validation {
    /// An empty report on `path`.
    pub fn new(path: impl Into<PathBuf>) -> Validation {
        Validation {
            path: path.into(),
            findings: Vec::new(),
        }
    }

    /// Whether no finding is an error.
    pub fn is_valid(&self) -> bool {
        self.errors().next().is_none()
    }

    /// The errors.
    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
    }

    /// The notes.
    pub fn notes(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Note)
    }

    /// Records a finding about `file`.
    pub(crate) fn push(
        &mut self,
        severity: Severity,
        file: impl AsRef<Path>,
        message: impl Into<String>,
    ) {
        self.findings.push(Finding {
            severity,
            file: file.as_ref().to_path_buf(),
            message: message.into(),
        });
    }

    /// Records an error about `file`.
    pub(crate) fn error(&mut self, file: impl AsRef<Path>, message: impl Into<String>) {
        self.push(Severity::Error, file, message);
    }

    /// Records a note about `file`.
    pub(crate) fn note(&mut self, file: impl AsRef<Path>, message: impl Into<String>) {
        self.push(Severity::Note, file, message);
    }

    /// Records `e` as an error about the file it names (else the dataset).
    pub(crate) fn error_from(&mut self, e: &Error) {
        let file = e.path().unwrap_or(&self.path).to_path_buf();
        self.push(Severity::Error, file, e.message());
    }

    /// `{"path", "valid", "errors": [{"file", "message"}], "notes": [...]}`: what every
    /// `validate --json` prints and Python's `validate()` returns.
    pub fn to_json(&self) -> Value {
        let list = |it: &mut dyn Iterator<Item = &Finding>| {
            Value::Array(
                it.map(|f| {
                    Value::Object(vec![
                        ("file".into(), Value::String(f.file.display().to_string())),
                        ("message".into(), Value::String(f.message.clone())),
                    ])
                })
                .collect(),
            )
        };
        Value::Object(vec![
            (
                "path".into(),
                Value::String(self.path.display().to_string()),
            ),
            ("valid".into(), Value::Bool(self.is_valid())),
            ("errors".into(), list(&mut self.errors())),
            ("notes".into(), list(&mut self.notes())),
        ])
    }
}
