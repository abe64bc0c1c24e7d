//! The upload journal a writer streaming to a store keeps there.

use std::path::Path;

use super::{document_bytes, Checksums};
use crate::error::{Error, Result};
use crate::json::{self, Value};

/// What a writer streaming a dataset to an object store has put there: the checksums of the
/// files uploaded so far (in the sidecar's format) and the facts a resumed write cannot tell
/// from the store (saev: `labels`, whether the dataset has labels; EAGLE-3: `manifest`, the
/// cache's configuration). The writer rewrites it after each upload, so it never names a file
/// the store does not hold; a resumed write keeps the files it names that are present at their
/// size, and their checksums go into the finished dataset's sidecar.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Journal {
    pub files: Checksums,
    pub facts: Vec<(String, Value)>,
}

impl Journal {
    /// The journal's object name, beside the dataset's files.
    pub(crate) const NAME: &'static str = ".shardkit-upload.json";

    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut fields = self.files.to_json();
        fields.extend(self.facts.iter().cloned());
        document_bytes(fields)
    }

    /// Parses a journal (`path` names it in errors).
    pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Journal> {
        let files = Checksums::parse(bytes, path)?;
        let Ok(Value::Object(fields)) = json::parse(bytes) else {
            return Err(Error::format(path, "not a JSON object"));
        };
        let facts = fields
            .into_iter()
            .filter(|(k, _)| !matches!(k.as_str(), "shardkit_checksums" | "algorithm" | "files"))
            .collect();
        Ok(Journal { files, facts })
    }

    /// The fact recorded under `key`.
    pub(crate) fn fact(&self, key: &str) -> Option<&Value> {
        self.facts.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Records `value` under `key`, replacing what was there.
    pub(crate) fn set_fact(&mut self, key: &str, value: Value) {
        self.facts.retain(|(k, _)| k != key);
        self.facts.push((key.into(), value));
    }
}
