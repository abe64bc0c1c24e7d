//! A flat-tokens split written in parts to an object store (see the parent module): the parts
//! state as objects under `.shardkit-parts/<split>/` (`commit::parts_store`: claims and the
//! commit lock as lease lock objects, unit records as PUTs, the configuration created
//! conditionally), each piece staged locally then uploaded, and the commit replaying the
//! pieces, fetched in unit order a few ahead, through the [`Writer`] streaming to the store.
//!
//! A store's flat-tokens dataset is written whole to a new prefix ([`Writer::create`]), so it
//! holds the one split written in parts. The commit runs under the split's commit lock, which
//! the writer holds in place of the dataset's lock (`.shardkit-lock.json`): the ranks' claims
//! and records keep whole-dataset writers out, and ranks restarting meanwhile are not turned
//! away. A commit killed midway is resumed from the writer's last checkpoint (its staging
//! directory on the same machine, the store's upload journal on any other).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use super::{
    finish_replayed, mismatch, piece_header, piece_lengths, piece_rel, replay_from, status_of,
    unit_name, PartWriter, Setup, HEADER, SETUP,
};
use crate::checksum::SIDECAR;
use crate::commit::parts::{commit_surviving_takeover, every_unit_listed, CommitStart};
use crate::commit::parts::{part_of, Held, Parts, PartsStatus, Rank, PARTS_DIR};
use crate::commit::{is_private, staging_dir};
use crate::error::{Error, Result};
use crate::flat_tokens::store::MARKER;
use crate::flat_tokens::writer::{Writer, WriterOptions};
use crate::io::Remote;
use crate::json::{self, Value};

/// Pieces the commit fetches ahead of the one it replays (each a GET of up to one unit's
/// tokens, held in memory until replayed).
const AHEAD: usize = 4;

/// The split's parts state, relative to the dataset's prefix.
fn state_rel(split: &str) -> String {
    format!("{PARTS_DIR}/{split}")
}

/// Object `rel` of the split's parts state, relative to the dataset's prefix.
pub(super) fn object(split: &str, rel: &str) -> String {
    format!("{}/{rel}", state_rel(split))
}

/// Where a rank stages its pieces of `split` before uploading them: beside the dataset's
/// staging directory, which the commit's writer uses (and whose presence says a write of it
/// is staged on this machine).
fn pieces_staging(target: &Remote, split: &str) -> PathBuf {
    let staged = staging_dir(Path::new(&target.url()));
    let name = staged
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    staged
        .with_file_name(format!("{name}.shardkit-parts"))
        .join(split)
}

/// The pieces of `split` in the store: name relative to the state (`pieces/UNIT.tokens`) to
/// size.
pub(super) fn piece_sizes(target: &Remote, split: &str) -> Result<BTreeMap<String, u64>> {
    Ok(target
        .join(&object(split, "pieces"))
        .list()?
        .into_iter()
        .map(|(n, len)| (format!("pieces/{n}"), len))
        .collect())
}

/// A JSON object of the dataset, when it is there.
fn get_json(target: &Remote, name: &str) -> Result<Option<Value>> {
    let Some(bytes) = target.get_opt(name)? else {
        return Ok(None);
    };
    json::parse(&bytes).map(Some).map_err(|_| {
        Error::format(
            target.url_of(name),
            "is not JSON (a zarr metadata document)",
        )
    })
}

/// The sequences in `split` of the dataset at `target`: `None` until its documents are
/// uploaded (a writer's finish uploads them, the root's last).
fn split_seqs(target: &Remote, split: &str) -> Result<Option<u64>> {
    for doc in ["zarr.json", ".zarray"] {
        let name = format!("{split}/seq_starts/{doc}");
        if let Some(v) = get_json(target, &name)? {
            let n = match v.get("shape") {
                Some(Value::Array(s)) => s.first().and_then(Value::as_u64),
                _ => None,
            };
            let n = n.ok_or_else(|| {
                Error::format(target.url_of(&name), "has no integer \"shape\"[0]")
            })?;
            return Ok(Some(n.saturating_sub(1)));
        }
    }
    Ok(None)
}

/// Whether the root group of `target` says `write_completed: true`.
fn root_complete(target: &Remote) -> Result<bool> {
    let marker = match get_json(target, "zarr.json")? {
        Some(v) => v.get("attributes").and_then(|a| a.get(MARKER)).cloned(),
        None => get_json(target, ".zattrs")?.and_then(|a| a.get(MARKER).cloned()),
    };
    Ok(marker == Some(Value::Bool(true)))
}

/// Whether `split` is committed in `target` with `total` sequences: the root complete (the
/// writer's finish uploads it last), the split whole, the sidecar there.
pub(super) fn committed(target: &Remote, split: &str, total: u64) -> Result<bool> {
    Ok(root_complete(target)?
        && split_seqs(target, split)? == Some(total)
        && target.len(SIDECAR).is_ok())
}

/// Refuses a prefix holding what this write would mix with: another split's write in parts,
/// or a dataset not written by this one.
fn refuse_others(target: &Remote, split: &str) -> Result<()> {
    let names = target.list()?;
    let ours = format!("{}/", state_rel(split));
    if let Some((other, _)) = names
        .iter()
        .find(|(n, _)| n.starts_with(&format!("{PARTS_DIR}/")) && !n.starts_with(&ours))
    {
        return Err(Error::Exists {
            path: target.url_of(other),
            why: format!(
                "another split is being written in parts here; a flat-tokens dataset in a store \
                 holds one split (write split {split:?} to another prefix)"
            ),
        });
    }
    let in_parts = names.iter().any(|(n, _)| n.starts_with(&ours));
    if !in_parts {
        if let Some((n, _)) = names.iter().find(|(n, _)| !is_private(n)) {
            return Err(Error::Exists {
                path: target.url_of(n),
                why: "the prefix already holds a dataset's objects; a flat-tokens dataset is \
                      written in parts to an empty prefix"
                    .into(),
            });
        }
    }
    Ok(())
}

/// [`PartWriter::create`] under the store prefix `target`.
pub(super) fn create(target: Remote, split: &str, setup: Setup, rank: Rank) -> Result<PartWriter> {
    let mut w = PartWriter {
        root: PathBuf::from(target.url()),
        split: split.to_string(),
        units: part_of(setup.units(), rank),
        setup,
        rank,
        pending: Vec::new(),
        next: None,
        piece: None,
        parts: None,
        stage: pieces_staging(&target, split),
        store: Some(target.clone()),
        _lock: None,
    };
    if committed(&target, split, setup.total)? {
        // Committed before this rank started, or its committer killed while cleaning up.
        if let Some(parts) = Parts::existing_store_in(&target, &state_rel(split))? {
            if let Some(_committing) = parts.commit_lock()? {
                clean_after_commit(&target, split, parts)?;
            }
        }
        return Ok(w);
    }
    refuse_others(&target, split)?;
    let parts = Parts::open_store_in(&target, &state_rel(split))?;
    let Some(store) = parts.store() else {
        return Err(Error::Internal("internal: a store's parts state".into()));
    };
    // Refused before anything is written: a whole-dataset writer, another configuration.
    store.refuse_single_writer()?;
    let ours = setup.to_json();
    let bytes = json::to_compact(&ours, false, json::Escape::Ascii).into_bytes();
    let name = object(split, SETUP);
    if let Some(theirs) = store.create_setup(&name, &bytes)? {
        return Err(
            mismatch(target.url_of(&name), &ours, &theirs).unwrap_or_else(|| Error::Exists {
                path: target.url_of(&name),
                why: "the split's other ranks were started with another configuration; every \
                      rank must give the same total_sequences and options (nothing was \
                      written)"
                    .into(),
            }),
        );
    }
    let claim = parts.claim(w.units.clone(), rank)?;
    // Looked at again once the claim is made: a whole-dataset writer takes its lock, then
    // looks for a write in parts, so of a writer and a rank starting together one sees the
    // other.
    store.refuse_single_writer()?;
    w.parts = Some((parts, claim));
    w.plan()?;
    Ok(w)
}

/// Commits `split` in `target` if every unit is durable and nobody has; true when it is
/// committed (now or before). A committer whose commit lock was taken over meanwhile tries
/// again, and finds the split committed by the other (`commit_surviving_takeover`).
pub(super) fn commit(target: &Remote, split: &str, setup: &Setup, parts: &Parts) -> Result<bool> {
    commit_surviving_takeover(
        || commit_once(target, split, setup, parts),
        || committed(target, split, setup.total),
    )
}

/// One attempt of [`commit`].
fn commit_once(target: &Remote, split: &str, setup: &Setup, parts: &Parts) -> Result<bool> {
    let n = setup.units();
    // Without the commit lock first: a rank that finds a unit missing leaves the commit to the
    // rank that records it, rather than queueing on the lock to find the same.
    if !every_unit_listed(parts, (0..n).map(unit_name))? {
        // Or committed by another rank (its records removed, or being removed: finished here).
        if committed(target, split, setup.total)? {
            clean_after_commit(target, split, parts.clone())?;
            return Ok(true);
        }
        return Ok(false);
    }
    let (committing, done) = match parts.begin_commit(
        (0..n).map(unit_name),
        || committed(target, split, setup.total),
        || clean_after_commit(target, split, parts.clone()),
    )? {
        CommitStart::Committed => return Ok(true),
        CommitStart::Missing => return Ok(false),
        CommitStart::Ready(lock, done) => (lock, done),
    };
    let Held::Store(lock) = committing else {
        return Err(Error::Internal(
            "internal: a store's commit lock is a lock object".into(),
        ));
    };
    let state = target.join(&state_rel(split));
    // Every record names its piece: checked before the writer starts.
    let mut sums = Vec::with_capacity(n as usize);
    for u in 0..n {
        let rel = piece_rel(u);
        let s = done[&unit_name(u)].get(&rel).ok_or_else(|| {
            Error::format(
                state.url_of(&format!("done/{}.json", unit_name(u))),
                format!("does not list {rel} (delete the record and write that unit again)"),
            )
        })?;
        sums.push(s.bytes);
    }
    let options = WriterOptions {
        layout: Some(setup.layout),
        resume: true,
        ..WriterOptions::default()
    };
    // The commit lock goes with the writer: renewed while it streams, confirmed before the
    // dataset's commit record is uploaded, deleted when it ends.
    let mut w = Writer::create_store_held(target.clone(), split, options, lock)?;
    // A commit killed midway left the split at the writer's last checkpoint: carry on there.
    let skip = w.seq_count();
    let first = (0..n).find(|&u| setup.unit_seqs(u).end > skip).unwrap_or(n);
    std::thread::scope(|s| -> Result<()> {
        let mut ahead = VecDeque::new();
        let mut next = first;
        for u in first..n {
            while next < n && ahead.len() <= AHEAD {
                let (state, rel) = (&state, piece_rel(next));
                ahead.push_back(s.spawn(move || state.get(&rel)));
                next += 1;
            }
            let Some(fetch) = ahead.pop_front() else {
                break;
            };
            let bytes = fetch.join().unwrap_or_else(|_| {
                Err(Error::Internal(format!(
                    "{}: a thread fetching a piece panicked",
                    state.url()
                )))
            })?;
            let path = state.url_of(&piece_rel(u));
            replay_bytes(
                &mut w,
                &bytes,
                &path,
                setup.unit_seqs(u),
                skip,
                sums[u as usize],
            )?;
            #[cfg(feature = "fault-injection")]
            super::stop_after(&mut w, u, &target.url_of(split))?;
        }
        Ok(())
    })?;
    finish_replayed(w, setup.total, &target.url_of(split))?;
    // Committed: the rest is cleaning up, which a later open, status or commit finishes.
    clean_after_commit(target, split, parts.clone())?;
    Ok(true)
}

/// [`super::replay`] of a piece fetched whole (`bytes`, from `path`).
fn replay_bytes(
    w: &mut Writer,
    bytes: &[u8],
    path: &Path,
    seqs: std::ops::Range<u64>,
    skip: u64,
    recorded: u64,
) -> Result<()> {
    let mut head = [0u8; HEADER as usize];
    let Some(h) = bytes.get(..HEADER as usize) else {
        return Err(super::bad_piece(
            path,
            format!("is {} bytes, shorter than its header", bytes.len()),
        ));
    };
    head.copy_from_slice(h);
    let (_, n_tokens) = piece_header(&head, bytes.len() as u64, path, &seqs, recorded)?;
    let ids_end = (HEADER + 4 * n_tokens) as usize;
    let lengths = piece_lengths(&bytes[ids_end..], n_tokens, path)?;
    let first = skip.saturating_sub(seqs.start) as usize;
    let skipped: u64 = lengths[..first].iter().sum();
    let mut r = &bytes[(HEADER + 4 * skipped) as usize..ids_end];
    replay_from(w, &mut r, &lengths[first..], path)
}

/// Removes the parts state after the commit: the pieces, then the rest of the state.
fn clean_after_commit(target: &Remote, split: &str, parts: Parts) -> Result<()> {
    if let Some(store) = parts.store() {
        store.delete_under(&object(split, "pieces"), &[])?;
    }
    parts.remove()?;
    let staged = pieces_staging(target, split);
    // Pieces a killed rank staged on this machine (a finished one removes each as it goes).
    let _ = std::fs::remove_dir_all(&staged);
    Ok(())
}

/// The configuration of the write in parts of `split` in `target`, when there is one.
pub(super) fn setup_of(target: &Remote, split: &str) -> Result<Option<(Setup, Parts)>> {
    let Some(parts) = Parts::existing_store_in(target, &state_rel(split))? else {
        return Ok(None);
    };
    let name = object(split, SETUP);
    match target.get_opt(&name)? {
        Some(bytes) => Ok(Some((Setup::parse(&bytes, &target.url_of(&name))?, parts))),
        // Its first rank was stopped before the configuration: nothing was written.
        None => Ok(None),
    }
}

/// [`super::status`] of a store's split.
pub(super) fn status(target: &Remote, split: &str) -> Result<PartsStatus> {
    super::status_given(
        setup_of(target, split)?,
        || split_seqs(target, split),
        |total| committed(target, split, total),
        target.url_of(split),
        split,
    )
}

/// [`super::commit_parts`] of a store's split.
pub(super) fn commit_parts(target: &Remote, split: &str) -> Result<PartsStatus> {
    let Some((setup, parts)) = setup_of(target, split)? else {
        return status(target, split);
    };
    let done = commit(target, split, &setup, &parts)?;
    status_of(&setup, Some(&parts), done)
}
