//! Metadata edits (samediff.md §9.3): in place when the new graph fits before the first blob,
//! otherwise only as a full atomic rewrite the caller asked for.
//!
//! In place, each part's graph region [32, B) is overwritten with a graph that keeps every
//! variable descriptor, stub, inline buffer and opaque part and carries the new metadata; the
//! rest of the region is zero-filled. Header, blobs and manifest are not touched. Inside a
//! STORED archive entry the entry's CRC-32 is updated from the old and new region alone (CRC is
//! affine, so the unchanged tail need not be read). Every part is rebuilt and checked against
//! its manifest before the first byte is written.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::graph::{build, ArrayOut, Graph, GraphOut, VarOut};
use super::header::HEADER_LEN;
use super::read::{self, locate, Container, Kind, Part};
use super::sdz::Method;
use super::write::{convert_with_metadata, Format, SaveOptions, DEFAULT_SHARD_SIZE};
use crate::error::{Error, IoContext, Result};

/// What an edit did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EditOutcome {
    /// True when only graph regions were overwritten; false after a full rewrite.
    pub in_place: bool,
    /// The files changed.
    pub files: Vec<PathBuf>,
}

/// Applies `changes` (key → new value, or `None` to remove the key) to a container's metadata.
/// Without `rewrite`, an edit that does not fit the slack is refused and nothing is written.
pub fn set_metadata(
    path: &Path,
    changes: &[(String, Option<String>)],
    rewrite: bool,
) -> Result<EditOutcome> {
    for (k, _) in changes {
        if k.is_empty() {
            return Err(Error::Invalid("metadata keys cannot be empty".into()));
        }
        if k.starts_with("nd4j.format.") || k.starts_with("shard.") {
            return Err(Error::Invalid(format!(
                "metadata key {k:?} is set by the writer and cannot be edited"
            )));
        }
    }
    if !crate::io::is_local(path) {
        return Err(Error::Invalid(format!(
            "{}: metadata is edited in place, in a local file; download the container, edit it \
             and upload it",
            path.display()
        )));
    }
    let c = read::open(path)?;
    let apply = |m: &[(String, String)]| -> Vec<(String, String)> {
        let mut m = m.to_vec();
        for (k, v) in changes {
            m.retain(|(mk, _)| mk != k);
            if let Some(v) = v {
                m.push((k.clone(), v.clone()));
            }
        }
        m
    };
    let mut planned = Vec::with_capacity(c.parts.len());
    let mut refusal = None;
    for part in &c.parts {
        match plan_in_place(part, apply(&part.graph.metadata))? {
            Ok(region) => planned.push(region),
            Err(why) => {
                refusal = Some(why);
                break;
            }
        }
    }
    if let Some(why) = refusal {
        if !rewrite {
            return Err(Error::format(
                path,
                format!("cannot edit metadata in place: {why}; ask for a full rewrite"),
            ));
        }
        return rewrite_all(&c, apply(c.metadata()));
    }
    // Every write, grouped by file: (offset, bytes).
    let mut writes: Vec<(PathBuf, Vec<Write>)> = Vec::new();
    for (part, region) in c.parts.iter().zip(&planned) {
        let w = region_writes(part, region);
        match writes.iter_mut().find(|(f, _)| *f == part.origin.file) {
            Some((_, all)) => all.extend(w),
            None => writes.push((part.origin.file.clone(), w)),
        }
    }
    // The container's sidecar accepts both the old and the new bytes of every block written
    // before the first byte changes, and the new ones alone once every file is fsynced (see
    // crate::checksum::Change): a kill at any point leaves a container that verifies.
    let located = crate::checksum::locate_container(&c)?;
    let change = crate::checksum::Change::begin(&located.sidecar, &located.base, |sums| {
        let mut new = Vec::new();
        for (file, w) in &writes {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // A file the sidecar does not cover stays uncovered (`validate --deep` says so).
            if let Some(recorded) = sums.files.get(&name) {
                let patches: Vec<(u64, &[u8])> =
                    w.iter().map(|(at, b)| (*at, b.as_slice())).collect();
                new.push((name, recorded.patched(file, &patches)?));
            }
        }
        Ok(new)
    })?;
    let mut files = Vec::new();
    for (file, w) in &writes {
        let f = OpenOptions::new().write(true).open(file).at(file)?;
        for (at, bytes) in w {
            f.write_all_at(bytes, *at).at(file)?;
        }
        crate::fsutil::sync_file(&f, file)?;
        files.push(file.clone());
    }
    if let Some(change) = change {
        change.commit()?;
    }
    Ok(EditOutcome {
        in_place: true,
        files,
    })
}

/// The new region [32, B) of a part, or why it cannot be written in place.
fn plan_in_place(
    part: &Part,
    metadata: Vec<(String, String)>,
) -> Result<std::result::Result<Vec<u8>, String>> {
    if let Some(e) = &part.origin.entry {
        if e.method != Method::Stored {
            return Ok(Err(format!(
                "{} is a compressed archive entry",
                part.label.display()
            )));
        }
    }
    let region = part.region();
    let g = &part.graph;
    let carried = g.carried(region);
    let variables = g
        .variables
        .iter()
        .map(|v| {
            let array = match &v.array {
                None => ArrayOut::None,
                Some(a) => {
                    let shape = a
                        .shape
                        .clone()
                        .or_else(|| v.shape.clone())
                        .unwrap_or_default();
                    if a.appended_length != 0 {
                        ArrayOut::Stub {
                            dtype: a.dtype,
                            shape,
                            order: a.order,
                            rel: a.appended_offset as u64,
                            len: a.appended_length as u64,
                        }
                    } else {
                        ArrayOut::Inline {
                            dtype: a.dtype,
                            shape,
                            order: a.order,
                            bytes: a.inline.clone().map_or(&[][..], |r| &region[r]),
                        }
                    }
                }
            };
            VarOut { desc: v, array }
        })
        .collect();
    let out = GraphOut {
        variables,
        metadata,
        outputs: g.outputs.clone(),
        placeholders: g.placeholders.clone(),
        loss_variables: g.loss_variables.clone(),
        training_config: g.training_config.clone(),
        nodes: carried.nodes,
        configuration: carried.configuration,
        updater_state: carried
            .updater_state
            .map(|u| u.into_iter().map(|(_, c)| c).collect()),
        sub_instances: carried.sub_instances,
    };
    let graph = build(&out, &part.label)?;
    if graph.len() > region.len() {
        return Ok(Err(format!(
            "{}: the new graph needs {} bytes, the region before the first blob holds {}",
            part.label.display(),
            graph.len(),
            region.len()
        )));
    }
    let mut new_region = graph;
    new_region.resize(region.len(), 0);
    // The part must pass every reader check with the new region before anything is written.
    let parsed = Graph::parse(&new_region, &part.label)?;
    locate(&parsed, &part.manifest, part.blob_start, &part.label)?;
    Ok(Ok(new_region))
}

/// Bytes to write at an offset of a file.
type Write = (u64, Vec<u8>);

/// The writes (offset in the part's file, bytes) that put a part's new graph region in place
/// (and, inside an archive, its entry's new CRC-32 in the local and central headers).
fn region_writes(part: &Part, region: &[u8]) -> Vec<Write> {
    let at = part.origin.offset + HEADER_LEN;
    let mut out = vec![(at, region.to_vec())];
    if let Some(e) = &part.origin.entry {
        let old = part.bytes();
        let b = part.blob_start as usize;
        let mut new_prefix = old[..b].to_vec();
        new_prefix[HEADER_LEN as usize..].copy_from_slice(region);
        let tail = old.len() as u64 - part.blob_start;
        let crc = updated_crc(e.crc32, &old[..b], &new_prefix, tail);
        out.push((e.local_header + 14, crc.to_le_bytes().to_vec()));
        out.push((e.central_header + 16, crc.to_le_bytes().to_vec()));
    }
    out
}

/// The CRC-32 of a message whose first bytes change from `old` to `new` (same length) and
/// whose last `tail` bytes stay: crc(m') = crc(m) ⊕ shift(crc(new) ⊕ crc(old), tail), because
/// CRC-32 is affine over GF(2) and the constant terms of equal-length messages cancel.
fn updated_crc(crc: u32, old: &[u8], new: &[u8], tail: u64) -> u32 {
    let delta = crc32fast::hash(old) ^ crc32fast::hash(new);
    let mut h = crc32fast::Hasher::new_with_initial(delta);
    h.combine(&crc32fast::Hasher::new_with_initial_len(0, tail));
    crc ^ h.finalize()
}

/// A full atomic rewrite in the container's own layout, with new metadata.
fn rewrite_all(c: &Container, metadata: Vec<(String, String)>) -> Result<EditOutcome> {
    let (format, shard_size) = match c.kind() {
        Kind::Sdnb => (Format::Sdnb, None),
        Kind::Sharded { .. } => (Format::Sharded, Some(DEFAULT_SHARD_SIZE)),
        Kind::Sdz { shards: 1 } => (Format::Sdz, None),
        Kind::Sdz { .. } => (Format::Sdz, Some(DEFAULT_SHARD_SIZE)),
    };
    let opts = SaveOptions {
        format,
        shard_size,
        ..SaveOptions::default()
    };
    let files = convert_with_metadata(c, c.path(), &opts, metadata)?;
    Ok(EditOutcome {
        in_place: false,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_update_matches_a_full_recompute() {
        let mut m: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        let before = crc32fast::hash(&m);
        let old = m[..300].to_vec();
        for b in &mut m[40..300] {
            *b ^= 0x5a;
        }
        let got = updated_crc(before, &old, &m[..300], 4700);
        assert_eq!(got, crc32fast::hash(&m));
    }
}
