//! The state of a write in parts kept in an object store, beside the dataset's objects: what
//! [`super::parts`] keeps in files locally, as objects, coordinated through the store itself
//! (conditional creates, leases), with no collective between the ranks.
//!
//! ```text
//! .shardkit-parts/claims/FIRST-END   a rank's claim: a lock object (conditional create, a lease
//!                                    renewed in the background, as the dataset lock's), naming
//!                                    its holder (host, pid, rank)
//! .shardkit-parts/claims.lock        held while a claim is checked and made
//! .shardkit-parts/done/UNIT.json     one unit durable: a plain PUT after the unit's objects (a
//!                                    PUT is atomic: the record present is whole)
//! .shardkit-parts/commit.lock        held by the process committing (renewed before the commit
//!                                    record is uploaded)
//! ```
//!
//! The configuration (the format's own record, e.g. saev's metadata.json) is created with a
//! conditional create by the first rank and compared by the others.

use std::collections::BTreeMap;
use std::ops::Range;

use super::parts::PARTS_DIR;
use super::parts::{claim_name, parse_claim_name, parse_record, record_bytes, Rank, UnitFiles};
use super::store_lock::{self, StoreLock};
use crate::error::{Error, Result};
use crate::io::Remote;

/// Objects deleted (or records read) at once.
const DELETERS: usize = 8;

/// The parts state of the dataset at a store prefix.
#[derive(Debug, Clone)]
pub(crate) struct StoreParts {
    /// The dataset's prefix.
    dataset: Remote,
    /// The state's prefix under it: `.shardkit-parts`, or one of its own under it (a format
    /// writing several things in parts, e.g. flat-tokens' splits).
    state: String,
}

impl StoreParts {
    pub(crate) fn new(dataset: Remote) -> StoreParts {
        StoreParts::new_in(dataset, PARTS_DIR)
    }

    /// The state kept under `state` (relative to the dataset's prefix).
    pub(crate) fn new_in(dataset: Remote, state: &str) -> StoreParts {
        StoreParts {
            dataset,
            state: state.to_string(),
        }
    }

    /// The dataset's prefix.
    pub(crate) fn dataset(&self) -> &Remote {
        &self.dataset
    }

    fn state(&self) -> Remote {
        self.dataset.join(&self.state)
    }

    /// Whether any object of a write in parts is there.
    pub(crate) fn exists(&self) -> Result<bool> {
        Ok(!self.state().list()?.is_empty())
    }

    /// Creates object `name` of the dataset holding `bytes` unless it exists: `None` when it
    /// was created or holds `bytes` already, else what it holds (the caller names the
    /// difference; nothing was written).
    pub(crate) fn create_setup(&self, name: &str, bytes: &[u8]) -> Result<Option<Vec<u8>>> {
        let created = self
            .dataset
            .put_if(name, bytes.to_vec(), None)
            .map_err(|e| unsupported(e, &self.dataset))?;
        if created.is_some() {
            return Ok(None);
        }
        match self.dataset.get_opt(name)? {
            Some(theirs) if theirs == bytes => Ok(None),
            Some(theirs) => Ok(Some(theirs)),
            // Deleted meanwhile (by hand): created again.
            None => self.create_setup(name, bytes),
        }
    }

    /// Refuses while a whole-dataset writer holds the dataset's lock (naming it).
    pub(crate) fn refuse_single_writer(&self) -> Result<()> {
        match StoreLock::live_holder(&self.dataset, store_lock::NAME)? {
            None => Ok(()),
            Some(who) => Err(Error::LockedRemote {
                path: self.dataset.url_of(store_lock::NAME),
                why: format!(
                    "a whole-dataset writer ({who}) is writing this dataset; a write in parts \
                     does not start beside it (wait for it to finish, or stop it)"
                ),
            }),
        }
    }

    /// Claims `units` for `rank`; see [`super::parts::Parts::claim`].
    pub(crate) fn claim(&self, units: Range<u64>, rank: Rank) -> Result<StoreLock> {
        let state = self.state();
        // One claimer at a time checks the others and makes its own (two overlapping claims
        // of different names could otherwise both be made).
        let _claiming = StoreLock::acquire_waiting(&state, "claims.lock", None)?;
        for (other, name) in self.claim_objects()? {
            if other.start >= units.end || units.start >= other.end || other.is_empty() {
                continue;
            }
            match StoreLock::live_holder(&state, &name)? {
                // Its holder is gone: its lease ran out, or its process here exited.
                None => state.delete(&name)?,
                Some(who) => {
                    return Err(Error::LockedRemote {
                        path: state.url_of(&name),
                        why: format!(
                            "units {}..{} are claimed by a live writer ({who}); units {}..{} \
                             overlap them: two processes were given the same part (check the \
                             rank and world size each was started with)",
                            other.start, other.end, units.start, units.end
                        ),
                    })
                }
            }
        }
        StoreLock::acquire_named(
            &state,
            &format!("claims/{}", claim_name(&units)),
            // The lock object names the host and pid itself.
            Some(rank.to_string()),
        )
    }

    /// Every claim object: (its units, its name under the state's prefix).
    fn claim_objects(&self) -> Result<Vec<(Range<u64>, String)>> {
        let mut out: Vec<(Range<u64>, String)> = self
            .state()
            .join("claims")
            .list()?
            .into_iter()
            .filter_map(|(n, _)| Some((parse_claim_name(&n)?, format!("claims/{n}"))))
            .collect();
        out.sort_by_key(|(r, _)| (r.start, r.end));
        Ok(out)
    }

    /// The live claims: (units, who holds them).
    pub(crate) fn live_claims(&self) -> Result<Vec<(Range<u64>, String)>> {
        let state = self.state();
        let mut out = Vec::new();
        for (units, name) in self.claim_objects()? {
            if let Some(who) = StoreLock::live_holder(&state, &name)? {
                out.push((units, who));
            }
        }
        Ok(out)
    }

    /// Records `unit` durable (its objects already uploaded): one PUT.
    pub(crate) fn record_done(&self, unit: &str, files: &UnitFiles) -> Result<()> {
        self.state()
            .put(&format!("done/{unit}.json"), record_bytes(files))
    }

    /// The units recorded durable.
    pub(crate) fn done(&self) -> Result<BTreeMap<String, UnitFiles>> {
        let done = self.state().join("done");
        let names: Vec<String> = done
            .list()?
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.ends_with(".json"))
            .collect();
        if names.is_empty() {
            return Ok(BTreeMap::new());
        }
        // The records read several at once: a commit reads one per unit.
        let what = format!("reading the unit records of {}", done.url());
        let read = crate::par::chunked(&names, DELETERS, &what, |chunk| {
            let mut out = Vec::new();
            for name in chunk {
                // Removed meanwhile (a commit cleaning up): not durable any more, the
                // dataset is.
                let Some(bytes) = done.get_opt(name)? else {
                    continue;
                };
                let unit = name.trim_end_matches(".json").to_string();
                out.push((unit, parse_record(&bytes, &done.url_of(name))?));
            }
            Ok(out)
        })?;
        let out: BTreeMap<String, UnitFiles> = read.into_iter().collect();
        Ok(out)
    }

    /// The names of the units recorded durable, from one listing (no record is read).
    pub(crate) fn durable_units(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = self
            .state()
            .join("done")
            .list()?
            .into_iter()
            .filter_map(|(name, _)| name.strip_suffix(".json").map(str::to_string))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Forgets `unit`.
    pub(crate) fn forget(&self, unit: &str) -> Result<()> {
        self.state().delete(&format!("done/{unit}.json"))
    }

    /// Whether `files` are in the store at their recorded sizes.
    pub(crate) fn intact(&self, files: &UnitFiles) -> Result<bool> {
        let sizes: BTreeMap<String, u64> = self.dataset.list()?.into_iter().collect();
        Ok(files
            .iter()
            .all(|(name, sums)| sizes.get(name) == Some(&sums.bytes)))
    }

    /// Waits for and takes the commit lock.
    pub(crate) fn commit_lock(&self) -> Result<StoreLock> {
        self.lock_named("commit.lock")
    }

    /// Waits for and takes the lock object `name` of the state.
    pub(crate) fn lock_named(&self, name: &str) -> Result<StoreLock> {
        StoreLock::acquire_waiting(&self.state(), name, None)
    }

    /// Deletes the objects under `prefix` of the dataset, [`DELETERS`] at a time; those named
    /// `keep` (relative to `prefix`) stay.
    pub(crate) fn delete_under(&self, prefix: &str, keep: &[&str]) -> Result<()> {
        let under = self.dataset.join(prefix);
        let names: Vec<String> = under
            .list()?
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !keep.contains(&n.as_str()))
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        let what = format!("deleting the objects under {}", under.url());
        crate::par::chunked(&names, DELETERS, &what, |chunk| {
            chunk.iter().try_for_each(|n| under.delete(n))?;
            Ok(Vec::<()>::new())
        })
        .map(|_| ())
    }

    /// Removes the state (after the commit record is uploaded): every object under
    /// `.shardkit-parts/` but the commit lock, which its holder deletes as it lets go.
    pub(crate) fn remove(&self) -> Result<()> {
        self.delete_under(&self.state, &["commit.lock"])
    }
}

/// Refuses a whole-dataset writer (holding the dataset's lock already) while a write in
/// parts is under way at `dataset`: live claims (naming them) or durable units of it.
pub(crate) fn refuse_whole_writer(dataset: &Remote) -> Result<()> {
    let parts = StoreParts::new(dataset.clone());
    let state = parts.state();
    let claims = parts.live_claims()?;
    let done = state.join("done").list()?.len();
    if claims.is_empty() && done == 0 {
        return Ok(());
    }
    let who: Vec<String> = claims
        .iter()
        .map(|(r, w)| format!("units {}..{} by {w}", r.start, r.end))
        .collect();
    Err(Error::LockedRemote {
        path: state.url().into(),
        why: format!(
            "a write in parts is under way here ({} live claim(s){}{}, {done} unit(s) durable); \
             a whole-dataset writer does not start beside it: finish it (its ranks, or \
             `status --commit`), or delete {} to start over",
            claims.len(),
            if who.is_empty() { "" } else { ": " },
            who.join("; "),
            state.url()
        ),
    })
}

/// A refused conditional create, with the hint for stores that have none.
fn unsupported(e: Error, dataset: &Remote) -> Error {
    match e {
        Error::Remote {
            object,
            range,
            message,
        } if message.contains("501") || message.contains("NotImplemented") => Error::Remote {
            object,
            range,
            message: format!(
                "{message} ({}: a write in parts needs conditional writes, which this store \
                 does not support; write the dataset with one process instead, with \
                 SHARDKIT_S3_LOCK=0)",
                dataset.url()
            ),
        },
        e => e,
    }
}
