//! What keeps Deeplearning4j's native C runtime (ADR 0073, `sdxLoadBundle`) from loading a
//! container that shardkit opens: validate reports each reason as a note.
//!
//! The runtime dispatches on the file name: `.sdz` to libnd4j's `SdzReader`, `.sdnb` to
//! `SdnbReader`, anything else SDZ first, then SDNB. It loads one file; it has no shard-set
//! loader. `SdzReader` (samediff.md §7, docs/sdnb.md "Deeplearning4j's native runtime") finds the
//! end record by scanning backwards from the last 22 bytes, walks the central directory through
//! its 32-bit fields, reads each entry whose name ends in `.sdnb` at local header + 30 + the
//! *local* name and extra lengths, loads STORED entries (DEFLATE only when built with zlib),
//! merges the variables of every such entry in central-directory order (later ones win) and
//! takes the graph from the first. `SdnbReader` needs a `nodes` vector in the FlatGraph, reads
//! appended tensors through their stubs counted back from the manifest offset (so the last
//! blob must end where the manifest starts), treats every array as C order, and maps dtypes it
//! does not know to FLOAT32. Revisions differ (the newest also reads ZIP64, entries named
//! `model` and entries by their SDNB magic); these notes name what the older ones refuse, so
//! that an archive without notes loads in every revision.

use std::path::Path;

use super::read::{Container, Kind, Part};
use super::sdz::Method;
use super::types::{DType, Order};

/// The prefix of every note.
const PREFIX: &str = "native runtime:";
/// Who reads the archive or file.
const SDZ_READER: &str = "Deeplearning4j's native SdzReader";
const SDNB_READER: &str = "Deeplearning4j's native SdnbReader";

/// The notes for `c` as (file, message); one "nothing found" note when there is nothing.
pub(crate) fn notes(c: &Container) -> Vec<(std::path::PathBuf, String)> {
    let mut out = Vec::new();
    let mut note =
        |file: &Path, msg: String| out.push((file.to_path_buf(), format!("{PREFIX} {msg}")));
    match c.kind() {
        Kind::Sharded { shards } => note(
            c.path(),
            format!(
                "a shard set is {shards} files, and Deeplearning4j's native runtime loads one \
                 .sdnb or .sdz file (given a shard, that shard alone); write the set as an SDZ \
                 (`shardkit sdnb convert SET OUT.sdz --shard-size ...`)"
            ),
        ),
        Kind::Sdz { .. } => {
            if let Some(bytes) = c.archive_bytes() {
                archive_notes(c, bytes, &mut note);
            }
        }
        Kind::Sdnb => {}
    }
    for p in &c.parts {
        part_notes(p, &mut note);
    }
    if out.is_empty() {
        out.push((
            c.path().to_path_buf(),
            format!(
                "{PREFIX} nothing found that keeps Deeplearning4j's native runtime \
                 (sdxLoadBundle) from loading it"
            ),
        ));
    }
    out
}

/// An entry as the native reader's central-directory walk sees it.
struct Seen {
    name: String,
    zip64: bool,
}

/// The archive as the native reader's scan sees it: (any ZIP64 record, entries in
/// central-directory order). `None` when it finds no end record.
fn scan(bytes: &[u8]) -> Option<(bool, Vec<Seen>)> {
    let u16_at = |o: usize| -> Option<u16> {
        Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?))
    };
    let u32_at = |o: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?))
    };
    let last = bytes.len().checked_sub(22)?;
    let from = bytes.len().saturating_sub(22 + 0xFFFF);
    let at = (from..=last)
        .rev()
        .find(|&i| u32_at(i) == Some(0x0605_4b50))?;
    let (count, cd_size, cd_at) = (u16_at(at + 10)?, u32_at(at + 12)?, u32_at(at + 16)?);
    let mut zip64 = count == 0xFFFF
        || cd_size == u32::MAX
        || cd_at == u32::MAX
        || (at >= 20 && u32_at(at - 20) == Some(0x0706_4b50));
    let has_zip64_extra = |mut o: usize, end: usize| {
        while o + 4 <= end {
            let (Some(id), Some(len)) = (u16_at(o), u16_at(o + 2)) else {
                return false;
            };
            if id == 1 {
                return true;
            }
            o += 4 + len as usize;
        }
        false
    };
    let mut seen = Vec::new();
    let mut o = cd_at as usize;
    for _ in 0..count {
        if u32_at(o) != Some(0x0201_4b50) {
            break;
        }
        let (Some(csize), Some(size), Some(nlen), Some(elen), Some(clen), Some(local)) = (
            u32_at(o + 20),
            u32_at(o + 24),
            u16_at(o + 28),
            u16_at(o + 30),
            u16_at(o + 32),
            u32_at(o + 42),
        ) else {
            break;
        };
        let (nlen, elen) = (nlen as usize, elen as usize);
        let Some(name) = bytes.get(o + 46..o + 46 + nlen) else {
            break;
        };
        let mut big = [csize, size, local].contains(&u32::MAX)
            || has_zip64_extra(o + 46 + nlen, o + 46 + nlen + elen);
        let l = local as usize;
        if let (Some(ln), Some(le)) = (u16_at(l + 26), u16_at(l + 28)) {
            let start = l + 30 + ln as usize;
            big |= has_zip64_extra(start, (start + le as usize).min(bytes.len()));
        }
        zip64 |= big;
        seen.push(Seen {
            name: String::from_utf8_lossy(name).into_owned(),
            zip64: big,
        });
        o += 46 + nlen + elen + clen as usize;
    }
    Some((zip64, seen))
}

/// Whether the native reader takes an entry of this name as SDNB (its oldest revision
/// compares case-sensitively and needs a name longer than the suffix).
fn native_name(name: &str) -> bool {
    name.len() > 5 && name.ends_with(".sdnb")
}

fn archive_notes(c: &Container, bytes: &[u8], note: &mut impl FnMut(&Path, String)) {
    let path = c.path();
    // A comment holding the end record's signature misleads the zip crate as it does the
    // native scan, so such an archive does not open and gets no note here.
    let Some((zip64, seen)) = scan(bytes) else {
        note(
            path,
            format!("{SDZ_READER} finds no end-of-central-directory record"),
        );
        return;
    };
    if zip64 {
        let which: Vec<&str> = seen
            .iter()
            .filter(|s| s.zip64)
            .map(|s| s.name.as_str())
            .collect();
        note(
            path,
            format!(
                "the archive has ZIP64 records{}; {SDZ_READER} reads only the 32-bit ZIP fields \
                 (ZIP64 only in its newest revision). shardkit writes ZIP64 only past 4 GiB per \
                 entry or archive",
                if which.is_empty() {
                    " (the end record defers to a ZIP64 end record)".to_string()
                } else {
                    format!(" (entries {})", which.join(", "))
                }
            ),
        );
    }
    let model: Vec<(&str, Method)> = c
        .parts
        .iter()
        .filter_map(|p| p.origin.entry.as_ref().map(|e| (e.name.as_str(), e.method)))
        .collect();
    for (name, method) in &model {
        if !native_name(name) {
            note(
                path,
                format!(
                    "model entry {name:?} does not end in .sdnb; {SDZ_READER} skips it (only its \
                     newest revision reads \"model\"); shardkit names entries model.sdnb or \
                     model.shard<i>-of-<N>.sdnb"
                ),
            );
        }
        if *method == Method::Deflate {
            note(
                path,
                format!(
                    "model entry {name:?} is DEFLATE-compressed; {SDZ_READER} inflates only when \
                     built with zlib, and its strict (file-backed) mode refuses it; shardkit \
                     writes STORED entries"
                ),
            );
        }
    }
    let loaded: Vec<&str> = seen
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| native_name(n))
        .collect();
    if let (Some(&first), Some(&(graph, _))) = (loaded.first(), model.first()) {
        if native_name(graph) && first != graph {
            note(
                path,
                format!(
                    "the graph entry {graph:?} is not the archive's first .sdnb entry ({first:?} \
                     is); {SDZ_READER} takes the graph from the first entry"
                ),
            );
        }
    }
    for name in loaded {
        if !model.iter().any(|(n, _)| *n == name) {
            note(
                path,
                format!(
                    "entry {name:?} is not part of the model, but {SDZ_READER} merges the \
                     variables of every .sdnb entry into it"
                ),
            );
        }
    }
}

/// The dtypes the native reader maps; any other becomes FLOAT32.
fn native_dtype(d: DType) -> bool {
    use DType::*;
    matches!(
        d,
        Float
            | Double
            | Half
            | Bfloat16
            | Int8
            | Int16
            | Int32
            | Int64
            | Uint8
            | Uint16
            | Uint32
            | Uint64
            | Bool
    )
}

fn part_notes(p: &Part, note: &mut impl FnMut(&Path, String)) {
    let label = &p.label;
    if !p.graph.has_nodes {
        note(
            label,
            format!(
                "the FlatGraph has no nodes vector; {SDNB_READER} refuses such a graph (in an \
                 archive it drops the entry and its variables)"
            ),
        );
    }
    let mut rel_end: Option<u64> = None;
    for v in &p.graph.variables {
        let Some(a) = &v.array else { continue };
        let listed = p.manifest.iter().any(|e| e.name == v.name);
        let has_data = a.inline.is_some() || a.appended_length > 0 || listed;
        if !has_data {
            continue;
        }
        if !native_dtype(a.dtype) {
            note(
                label,
                format!(
                    "variable {:?} is {}, which {SDNB_READER} reads as FLOAT32",
                    v.name,
                    a.dtype.name()
                ),
            );
        }
        if a.order == Order::F {
            note(
                label,
                format!(
                    "variable {:?} is stored in 'f' order; {SDNB_READER} reads every array in \
                     'c' order",
                    v.name
                ),
            );
        }
        if listed && a.appended_length <= 0 {
            note(
                label,
                format!(
                    "variable {:?} has a manifest entry but its stub records no appended length; \
                     {SDNB_READER} finds appended data through stubs and would give it none",
                    v.name
                ),
            );
        }
        if a.appended_length > 0 {
            let end = (a.appended_offset as u64).saturating_add(a.appended_length as u64);
            rel_end = Some(rel_end.map_or(end, |r| r.max(end)));
        }
    }
    if let Some(end) = rel_end {
        let m = p.header.manifest_offset;
        if m.checked_sub(end) != Some(p.blob_start) {
            note(
                label,
                format!(
                    "the last blob ends at byte {}, not where the manifest starts (byte {m}); \
                     {SDNB_READER} counts the blob section back from the manifest and would read \
                     every appended tensor from the wrong offset",
                    p.blob_start.saturating_add(end)
                ),
            );
        }
    }
}
