//! A reader's view of a dataset written in parts (a follow-mode loader reading while the ranks
//! write it), in a directory or a store prefix: its files or objects, the units durable now,
//! and who holds the claims on the others. Read only: a reader creates no parts state, takes
//! no lock and removes no stale claim (that is the writers' business), so a loader following a
//! store needs no write permission there.
//!
//! A unit is durable when its record `.shardkit-parts/done/UNIT.json` exists (see
//! [`super::parts`]): the record is written after the unit's files are published whole (a
//! rename locally; in a store a PUT, which is atomic), so a record seen is a unit whose files
//! are whole and final. One look at the records is one directory read locally, one LIST of
//! `.shardkit-parts/done/` in a store (the records' names only; none is fetched).

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::parts::Parts;
use super::parts_store::StoreParts;
use crate::error::{Error, Result};
use crate::io::{Location, Remote};

/// Where a dataset followed while it is written lies: a directory, or a store prefix.
#[derive(Debug, Clone)]
pub(crate) enum PartsReader {
    /// A local (or shared) directory.
    Dir(PathBuf),
    /// A prefix in an object store.
    Store(Remote),
}

impl PartsReader {
    /// The reader of the dataset at `location`.
    pub(crate) fn new(location: &Location) -> Result<PartsReader> {
        Ok(match location.local_path() {
            Some(dir) => PartsReader::Dir(dir.to_path_buf()),
            None => PartsReader::Store(Remote::from_location(location)?),
        })
    }

    /// The dataset's directory, or its URL as a path (for messages).
    pub(crate) fn path(&self) -> PathBuf {
        match self {
            PartsReader::Dir(d) => d.clone(),
            PartsReader::Store(r) => PathBuf::from(r.url()),
        }
    }

    /// The dataset's directory, when it is local.
    pub(crate) fn local(&self) -> Option<&Path> {
        match self {
            PartsReader::Dir(d) => Some(d),
            PartsReader::Store(_) => None,
        }
    }

    /// The bytes of the dataset's file or object `name`; `None` when it does not exist.
    pub(crate) fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self {
            PartsReader::Dir(d) => {
                let path = d.join(name);
                match std::fs::read(&path) {
                    Ok(b) => Ok(Some(b)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io(&path, e)),
                }
            }
            PartsReader::Store(r) => r.get_opt(name),
        }
    }

    /// The units (of `n`; `index` gives a record's unit) durable now, one flag a unit: those
    /// recorded, or every one when `committed()` says the dataset is committed. `committed`
    /// is asked only when the records do not show every unit durable (the commit removes
    /// them; a dataset never written in parts has none): a look costs one LIST in a store,
    /// plus the caller's check of its commit record while units are missing.
    pub(crate) fn durable_now(
        &self,
        n: u64,
        index: impl Fn(&str) -> Option<u64>,
        committed: impl Fn() -> Result<bool>,
    ) -> Result<Vec<bool>> {
        let listed = match self {
            PartsReader::Dir(d) => Parts::existing(d).map(|p| p.durable_units()),
            // An empty listing when no write in parts is (or was) there: no extra request to
            // tell the two apart.
            PartsReader::Store(r) => Some(StoreParts::new(r.clone()).durable_units()),
        };
        match listed {
            Some(Ok(names)) => {
                let mut out = vec![false; n as usize];
                for u in names.iter().filter_map(|u| index(u)) {
                    if let Some(d) = out.get_mut(u as usize) {
                        *d = true;
                    }
                }
                if out.iter().all(|&d| d) || !committed()? {
                    return Ok(out);
                }
                // Committed: its records are being (or were) removed.
                Ok(vec![true; n as usize])
            }
            // Not written in parts, or committed (its records gone).
            None => Ok(vec![committed()?; n as usize]),
            // The commit removes the records: committed meanwhile.
            Some(Err(_)) if committed()? => Ok(vec![true; n as usize]),
            Some(Err(e)) => Err(e),
        }
    }

    /// The live claims: (units, who holds them); none when they cannot be read (this is for
    /// an error message, which should not fail in turn).
    pub(crate) fn live_claims(&self) -> Vec<(Range<u64>, String)> {
        match self {
            PartsReader::Dir(d) => Parts::existing(d).and_then(|p| p.live_claims().ok()),
            PartsReader::Store(r) => StoreParts::new(r.clone()).live_claims().ok(),
        }
        .unwrap_or_default()
    }
}
