//! Containers in an object store (any [`Source`] that is not local files), read by range: what
//! opening checks is fetched into an anonymous map of the object's size (a [`Skeleton`]), and
//! each blob into a buffer of its own when its tensor is first asked for.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use memmap2::Mmap;

use super::*;
use crate::io::{self, Location, Source};

/// An SDNB object in a store. `skeleton` is an anonymous map of the object's size (no swap
/// reserved, so any size opens) holding only what opening checks: header, graph region and
/// manifest; the pages between are never touched. Each blob is fetched with ranged GETs the
/// first time its tensor is asked for, into a buffer of its own, and kept.
pub(crate) struct RemotePart {
    remote: Arc<dyn Source>,
    name: String,
    pub(super) skeleton: Mmap,
    /// The blob section's ranges by first byte, each filled on first use.
    blobs: std::sync::OnceLock<HashMap<usize, Blob>>,
}

/// A blob's end and, once fetched, its bytes (a buffer of its own, or its slice of the buffer
/// a prefetch read many blobs into).
type Blob = (usize, std::sync::OnceLock<bytes::Bytes>);

impl RemotePart {
    /// `len` bytes at `offset` of the object, read now.
    pub(super) fn fetch(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len as usize];
        self.remote.read_ranges(
            std::slice::from_ref(&self.name),
            &[(0, offset, len, 0)],
            &mut buf,
            &io::Stop::never(),
        )?;
        Ok(buf)
    }

    /// Bytes `r` of the object: from the skeleton below the blob section, else the blob's own
    /// buffer, fetched now if it is not yet.
    pub(super) fn range(&self, r: Range<usize>) -> Result<&[u8]> {
        let blob = self
            .blobs
            .get()
            .and_then(|b| b.get(&r.start))
            .filter(|(end, _)| *end == r.end);
        let Some((_, cell)) = blob else {
            return Ok(&self.skeleton[r]);
        };
        if let Some(v) = cell.get() {
            return Ok(v);
        }
        let buf = self.fetch(r.start as u64, r.len() as u64)?;
        // Two threads may fetch the same blob at once; the first kept wins, both are equal.
        let _ = cell.set(buf.into());
        cell.get()
            .map(|v| &v[..])
            .ok_or_else(|| Error::Internal("internal: a fetched blob vanished".into()))
    }

    /// Fetches the blobs among `ranges` not yet held, many per request list (at most
    /// [`PREFETCH_GROUP_BYTES`] each), so their GETs run in parallel and coalesce.
    pub(super) fn prefetch(&self, ranges: &[Range<usize>]) -> Result<()> {
        let Some(blobs) = self.blobs.get() else {
            return Ok(());
        };
        let mut want: Vec<(Range<usize>, &std::sync::OnceLock<bytes::Bytes>)> = ranges
            .iter()
            .filter_map(|r| {
                let (end, cell) = blobs.get(&r.start)?;
                (*end == r.end && cell.get().is_none()).then(|| (r.clone(), cell))
            })
            .collect();
        want.sort_by_key(|(r, _)| r.start);
        want.dedup_by_key(|(r, _)| r.start);
        for group in group_by_bytes(&want, PREFETCH_GROUP_BYTES) {
            // Each blob lands at a 64-byte boundary of one buffer, which its tensor then
            // views in place: no copy after the GETs.
            let mut reqs = Vec::with_capacity(group.len());
            let mut dst = 0u64;
            for (r, _) in group {
                reqs.push((0u32, r.start as u64, r.len() as u64, dst));
                dst = (dst + r.len() as u64).next_multiple_of(64);
            }
            let mut buf = vec![0u8; dst as usize];
            self.remote.read_ranges(
                std::slice::from_ref(&self.name),
                &reqs,
                &mut buf,
                &io::Stop::never(),
            )?;
            let buf = bytes::Bytes::from(buf);
            for ((_, cell), &(_, _, len, at)) in group.iter().zip(&reqs) {
                let _ = cell.set(buf.slice(at as usize..(at + len) as usize));
            }
        }
        Ok(())
    }
}

/// Bytes of blobs fetched by one request list of [`RemotePart::prefetch`]: the size of each
/// buffer a list fills (its blobs are then served as views of it, without a copy).
const PREFETCH_GROUP_BYTES: usize = 1 << 30;

/// `items` cut into consecutive groups of at most `cap` bytes of ranges (a larger range is a
/// group of its own).
fn group_by_bytes<T>(items: &[(Range<usize>, T)], cap: usize) -> Vec<&[(Range<usize>, T)]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (r, _)) in items.iter().enumerate() {
        if i > start && bytes + r.len() > cap {
            out.push(&items[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += r.len();
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Objects of at most this size are fetched whole: one GET costs less than three round trips.
const REMOTE_WHOLE_BYTES: u64 = 8 << 20;

/// Opens the container at `url` (see [`Container::open_with`]).
/// With `SHARDKIT_CACHE_DIR` set, the container's objects are copied whole into the cache and
/// opened from there.
pub(super) fn open_remote(location: &Location, limits: &Limits) -> Result<Container> {
    if let Some(cache) = io::cache_dir() {
        let shards = io::ShardNames {
            base: base_name,
            is_shard: |n, base| sdz::parse_shard_name(n).is_some_and(|(b, _, _)| b == base),
        };
        let local = io::fetch_container(&location.to_path(), &cache, &shards)?;
        return Container::open_with(&local, limits);
    }
    let (parent, name) = location.split_last()?;
    open_in(
        io::open_uncached(&parent)?,
        &name,
        location.to_path(),
        limits,
    )
}

/// Opens the container `name` of `parent`, any source (a test hook: an in-memory store, say).
#[cfg(test)]
pub(crate) fn open_source(parent: Arc<dyn Source>, name: &str) -> Result<Container> {
    let url = parent.path_of(name);
    open_in(parent, name, url, &Limits::default())
}

/// Opens the container `name` of `parent` (any source), `url` in messages.
pub(super) fn open_in(
    parent: Arc<dyn Source>,
    name: &str,
    url: PathBuf,
    limits: &Limits,
) -> Result<Container> {
    let name = name.to_string();
    let objects: Vec<(String, u64)> = parent
        .list()?
        .into_iter()
        .filter(|(n, _)| !n.contains('/'))
        .collect();
    // A shard's name stands for its whole set.
    let base = sdz::parse_shard_name(&name).map_or_else(|| base_name(&name), |(b, _, _)| b);
    let shards: Vec<(u32, u32, String, u64)> = objects
        .iter()
        .filter_map(|(n, size)| {
            sdz::parse_shard_name(n)
                .filter(|(b, _, _)| *b == base)
                .map(|(_, i, count)| (i, count, n.clone(), *size))
        })
        .collect();
    let single = objects.iter().find(|(n, _)| *n == name).map(|(_, s)| *s);
    let is_shard = sdz::parse_shard_name(&name).is_some();
    match single {
        Some(size) if !is_shard => {
            // The first bytes tell SDZ from SDNB; they are an SDNB's header, or the whole of a
            // small object, so opening an SDNB reads them once.
            let probe = if size <= REMOTE_WHOLE_BYTES {
                size
            } else {
                HEADER_LEN
            };
            let mut head = vec![0u8; probe.min(size) as usize];
            parent.read_ranges(
                std::slice::from_ref(&name),
                &[(0, 0, head.len() as u64, 0)],
                &mut head,
                &io::Stop::never(),
            )?;
            let n = head.len().min(4);
            if &head[..n] == b"PK\x03\x04" {
                return open_sdz_remote(&parent, &name, size, limits);
            }
            if head[..n] != MAGIC {
                return Err(Error::format(
                    &url,
                    format!(
                        "not a SameDiff container: starts {:02x?}, neither a ZIP (50 4b 03 04, \
                         SDZ) nor \"SDNB\"",
                        &head[..n]
                    ),
                ));
            }
            if !shards.is_empty() {
                return Err(Error::format(
                    &url,
                    format!(
                        "ambiguous: an SDNB object and shard objects {base}.shard*.sdnb sit \
                         side by side (DL4J would silently load the shards); remove one of them"
                    ),
                ));
            }
            let part = remote_part(&parent, &name, size, limits, head)?;
            assemble(&url, Kind::Sdnb, vec![part], None)
        }
        _ if !shards.is_empty() => {
            let what = parent.path_of(&format!("{base}.shard*.sdnb"));
            let set = complete_set(
                shards.iter().map(|(i, n, name, _)| (*i, *n, name.clone())),
                &what,
            )?;
            let parts = set
                .into_iter()
                .map(|k| remote_part(&parent, &shards[k].2, shards[k].3, limits, Vec::new()))
                .collect::<Result<Vec<_>>>()?;
            let n = parts.len();
            assemble(&url, Kind::Sharded { shards: n }, parts, None)
        }
        _ => Err(Error::NotFound {
            path: url,
            what: format!(
                "no such object, and no shard objects {base}.shard<i>-of-<N>.sdnb beside it"
            ),
        }),
    }
}

/// One SDNB object of `parent`, checked like a local part. Small objects are fetched whole;
/// larger ones as header, then graph region and manifest, with blobs left for first use.
/// `head` is the object's first bytes, already fetched (maybe none).
fn remote_part(
    parent: &Arc<dyn Source>,
    name: &str,
    size: u64,
    limits: &Limits,
    head: Vec<u8>,
) -> Result<Part> {
    let url = parent.path_of(name);
    let origin = Origin {
        file: url.clone(),
        offset: 0,
        entry: None,
    };
    if size <= REMOTE_WHOLE_BYTES {
        let all = if head.len() as u64 == size {
            head
        } else {
            let mut all = vec![0u8; size as usize];
            parent.read_ranges(
                &[name.to_string()],
                &[(0, 0, size, 0)],
                &mut all,
                &io::Stop::never(),
            )?;
            all
        };
        let n = all.len();
        return Part::parse(Arc::new(Backing::Owned(all)), 0..n, url, origin, limits);
    }
    let mut skeleton = Skeleton::new(parent, name, size)?;
    skeleton.have_prefix(&head);
    skeleton.fetch_sdnb(0, size, limits)?;
    let backing = Arc::new(Backing::Remote(skeleton.freeze()?));
    let part = Part::parse(backing.clone(), 0..size as usize, url, origin, limits)?;
    register_blobs(&backing, std::slice::from_ref(&part));
    Ok(part)
}

/// An object of a store being read into an anonymous map of its size, range by range, before
/// it is parsed (see [`RemotePart`]).
struct Skeleton {
    parent: Arc<dyn Source>,
    name: String,
    url: PathBuf,
    map: memmap2::MmapMut,
    /// Bytes at the start already in place (never fetched again).
    have: u64,
}

impl Skeleton {
    fn new(parent: &Arc<dyn Source>, name: &str, size: u64) -> Result<Skeleton> {
        let url = parent.path_of(name);
        let len = usize::try_from(size)
            .map_err(|_| Error::format(&url, format!("{size} bytes do not fit in memory here")))?;
        let map = memmap2::MmapOptions::new()
            .len(len.max(1))
            .no_reserve_swap()
            .map_anon()
            .map_err(|e| Error::io(&url, e))?;
        Ok(Skeleton {
            parent: parent.clone(),
            name: name.to_string(),
            url,
            map,
            have: 0,
        })
    }

    /// Puts the object's first bytes, fetched already, in place.
    fn have_prefix(&mut self, head: &[u8]) {
        let n = head.len().min(self.map.len());
        self.map[..n].copy_from_slice(&head[..n]);
        self.have = n as u64;
    }

    fn size(&self) -> u64 {
        self.map.len() as u64
    }

    /// Fetches `(offset, len)` ranges (cut at the object's end, less what is in place already)
    /// into place, in one request list.
    fn fetch(&mut self, ranges: &[(u64, u64)]) -> Result<()> {
        let size = self.size();
        // Cut at the end, sorted, overlapping ranges merged (each byte lands once).
        let mut cut: Vec<(u64, u64)> = ranges
            .iter()
            .filter(|(o, n)| *o < size && *n > 0)
            .map(|&(o, n)| (o.max(self.have), o + n.min(size - o)))
            .filter(|(a, b)| a < b)
            .collect();
        cut.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(cut.len());
        for (a, b) in cut {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let ranges: Vec<(u32, u64, u64, u64)> =
            merged.into_iter().map(|(a, b)| (0, a, b - a, a)).collect();
        if ranges.is_empty() {
            return Ok(());
        }
        self.parent.read_ranges(
            std::slice::from_ref(&self.name),
            &ranges,
            &mut self.map,
            &io::Stop::never(),
        )
    }

    /// Fetches what opening the SDNB at `[base, base + len)` checks: its header, then its
    /// manifest and graph region (each only within its cap: past one, opening refuses the part
    /// without reading it).
    fn fetch_sdnb(&mut self, base: u64, len: u64, limits: &Limits) -> Result<()> {
        self.fetch(&[(base, HEADER_LEN.min(len))])?;
        let at = |o: u64| (base + o) as usize;
        let header = Header::parse(&self.map[at(0)..at(len)], len, &self.url)?;
        let (m, mlen) = (header.manifest_offset, header.manifest_len);
        if mlen > limits.max_manifest_bytes {
            return Ok(());
        }
        self.fetch(&[(base + m, mlen)])?;
        let manifest = manifest::decode(
            &self.map[at(m)..at(m + mlen)],
            &self.url,
            limits.max_manifest_entries,
        )?;
        let blob_start = manifest
            .iter()
            .map(|e| e.offset)
            .min()
            .unwrap_or(m)
            .clamp(HEADER_LEN, m);
        if blob_start - HEADER_LEN <= limits.max_graph_bytes {
            self.fetch(&[(base + HEADER_LEN, blob_start - HEADER_LEN)])?;
        }
        Ok(())
    }

    fn freeze(self) -> Result<RemotePart> {
        Ok(RemotePart {
            remote: self.parent,
            name: self.name,
            skeleton: self
                .map
                .make_read_only()
                .map_err(|e| Error::io(&self.url, e))?,
            blobs: std::sync::OnceLock::new(),
        })
    }
}

/// Marks every data range of `parts` at or past its part's blob section as a blob of
/// `backing`, fetched on first use.
pub(super) fn register_blobs(backing: &Arc<Backing>, parts: &[Part]) {
    let Backing::Remote(r) = &**backing else {
        return;
    };
    let blobs = parts
        .iter()
        .filter(|p| Arc::ptr_eq(&p.backing, backing))
        .flat_map(|p| {
            let at = p.range.start;
            p.located
                .iter()
                .filter_map(|(_, _, range)| range.clone())
                .filter(move |r| r.start as u64 >= p.blob_start && !r.is_empty())
                .map(move |r| (at + r.start, (at + r.end, std::sync::OnceLock::new())))
        })
        .collect();
    let _ = r.blobs.set(blobs);
}

/// An SDZ archive in a store, read by range: its end records and central directory, each
/// entry's local header, then each model entry as [`remote_part`] reads an SDNB (STORED) or
/// whole (DEFLATE, inflated here). Extra entries are fetched when asked for.
fn open_sdz_remote(
    parent: &Arc<dyn Source>,
    name: &str,
    size: u64,
    limits: &Limits,
) -> Result<Container> {
    let mut sk = Skeleton::new(parent, name, size)?;
    let url = sk.url.clone();
    let bad = |rule: &str| Error::format(&url, format!("not a readable ZIP archive: {rule}"));
    // The end record (with its comment, at most 64 KiB) and the ZIP64 locator before it.
    let tail = size.min(22 + 0xFFFF + 20);
    sk.fetch(&[(size - tail, tail)])?;
    let (cd_start, cd_len) = {
        let bytes = &sk.map[..];
        let eocd = (size - tail..=size.saturating_sub(22))
            .rev()
            .find(|&i| bytes[i as usize..i as usize + 4] == [0x50, 0x4b, 0x05, 0x06])
            .ok_or_else(|| {
                bad(&format!(
                    "no end of central directory record in the last {tail} of its {size} bytes; \
                     an archive cut short (an interrupted upload) loses it first: upload it again"
                ))
            })? as usize;
        let u32_at =
            |o: usize| u64::from(u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4")));
        let (len, start) = (u32_at(eocd + 12), u32_at(eocd + 16));
        if (len == 0xFFFF_FFFF || start == 0xFFFF_FFFF) && eocd >= 20 {
            // ZIP64: the locator names the ZIP64 end record, which holds the real values.
            let loc = eocd - 20;
            if u32_at(loc) != 0x0706_4b50 {
                return Err(bad("a ZIP64 end record without its locator"));
            }
            let rec = u64::from_le_bytes(bytes[loc + 8..loc + 16].try_into().expect("8"));
            if rec.checked_add(56).is_none_or(|e| e > size) {
                return Err(bad("the ZIP64 end record lies past the archive's end"));
            }
            sk.fetch(&[(rec, 56)])?;
            let r = rec as usize;
            let u64_at = |o: usize| u64::from_le_bytes(sk.map[o..o + 8].try_into().expect("8"));
            (u64_at(r + 48), u64_at(r + 40))
        } else {
            (start, len)
        }
    };
    if cd_start.checked_add(cd_len).is_none_or(|e| e > size) {
        return Err(bad("the central directory lies past the archive's end"));
    }
    sk.fetch(&[(cd_start, cd_len)])?;
    // Each central record names its local header; fetch the fixed part, then the name and
    // extra field with the first bytes of the data (enough to tell an SDNB entry).
    let locals = local_headers(
        &sk.map[cd_start as usize..(cd_start + cd_len) as usize],
        limits,
    );
    sk.fetch(&locals.iter().map(|&o| (o, 30)).collect::<Vec<_>>())?;
    let rest: Vec<(u64, u64)> = locals
        .iter()
        .filter(|&&o| o + 30 <= size)
        .map(|&o| {
            let h = o as usize;
            let u16_at =
                |i: usize| u64::from(u16::from_le_bytes([sk.map[h + i], sk.map[h + i + 1]]));
            (o + 30, u16_at(26) + u16_at(28) + PEEK_BYTES)
        })
        .collect();
    sk.fetch(&rest)?;
    let entries = sdz::entries(&sk.map, &url, &limits.zip)?;
    let chosen = sdz::choose_model(&sk.map, &entries, &url)?;
    let order: Vec<usize> = match &chosen {
        ModelEntries::Single(i) => vec![*i],
        ModelEntries::Sharded(v) => v.clone(),
    };
    for &i in &order {
        let e = &entries[i];
        match e.method {
            Method::Stored => sk.fetch_sdnb(e.data.start, e.data.end - e.data.start, limits)?,
            Method::Deflate => sk.fetch(&[(e.data.start, e.data.end - e.data.start)])?,
        }
    }
    let backing = Arc::new(Backing::Remote(sk.freeze()?));
    sdz_container(&url, backing, entries, &order, limits)
}

/// Bytes of each entry's data fetched with its local header: an SDNB's magic, or enough
/// DEFLATE input to inflate it.
const PEEK_BYTES: u64 = 4096;

/// The local header offsets the central directory records in `cd` name (at most the archive
/// limit's count; records past a malformed one are left to the full parse, which refuses it).
fn local_headers(cd: &[u8], limits: &Limits) -> Vec<u64> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while out.len() < limits.zip.max_entries && at + 46 <= cd.len() {
        let u16_at = |o: usize| u16::from_le_bytes([cd[at + o], cd[at + o + 1]]) as usize;
        let u32_at = |o: usize| u32::from_le_bytes(cd[at + o..at + o + 4].try_into().expect("4"));
        if u32_at(0) != 0x0201_4b50 {
            break;
        }
        let (name, extra, comment) = (u16_at(28), u16_at(30), u16_at(32));
        let mut offset = u64::from(u32_at(42));
        if offset == 0xFFFF_FFFF {
            // ZIP64 extra field: the 64-bit values present are those whose 32-bit field is full.
            let ex = cd
                .get(at + 46 + name..at + 46 + name + extra)
                .unwrap_or(&[]);
            let mut i = 0;
            while i + 4 <= ex.len() {
                let (id, n) = (
                    u16::from_le_bytes([ex[i], ex[i + 1]]),
                    u16::from_le_bytes([ex[i + 2], ex[i + 3]]) as usize,
                );
                if id == 1 {
                    let full = |o: usize| u32_at(o) == 0xFFFF_FFFF;
                    let skip = 8 * (usize::from(full(24)) + usize::from(full(20)));
                    if let Some(v) = ex.get(i + 4 + skip..i + 4 + skip + 8) {
                        offset = u64::from_le_bytes(v.try_into().expect("8"));
                    }
                    break;
                }
                i += 4 + n;
            }
        }
        out.push(offset);
        at += 46 + name + extra + comment;
    }
    out
}
