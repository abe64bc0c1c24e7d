//! SDZ archives (samediff.md §7, §9.7): a ZIP whose entries are SDNB files named `model` or
//! `model.shard<i>-of-<N>.sdnb`, next to any other files (tokenizer.json, ...).
//!
//! Reading uses the `zip` crate for the central directory (ZIP64 included), then checks every
//! entry name and each local header against it, and enforces the entry-count, total-size and
//! compression-ratio limits before any entry's data is touched. STORED entries are served in
//! place from the archive's memory map; DEFLATE entries are inflated with their CRC-32 checked.
//!
//! Writing is done here rather than with the `zip` crate's writer, which copies local extra
//! fields into the central directory and aligns with a different record: shardkit writes
//! STORED entries whose data starts at a multiple of the alignment, padded by a zipalign-style
//! extra record (ID `0xD935`) in the local header only, with sizes and CRC-32 in the local
//! header (no data descriptor), ZIP64 records where a size or offset needs them, and a fixed
//! 1980-01-01 timestamp so that the same input gives the same bytes.

use std::fs::File;
use std::io::{Cursor, Read};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

/// Limits applied to an archive before its entries are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ZipLimits {
    /// Entries, directories included (DL4J: 1000).
    pub max_entries: usize,
    /// Uncompressed bytes over all entries, as declared and as produced.
    pub max_total_bytes: u64,
    /// Uncompressed / compressed size of any one entry (DL4J: 100).
    pub max_ratio: u64,
}

impl Default for ZipLimits {
    fn default() -> Self {
        ZipLimits {
            max_entries: 1000,
            max_total_bytes: 1 << 40,
            max_ratio: 100,
        }
    }
}

/// How an entry's bytes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    /// 0: as they are.
    Stored,
    /// 8: raw DEFLATE.
    Deflate,
}

/// One checked archive entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ZipEntry {
    /// The entry name (UTF-8; checked by `check_name`).
    pub name: String,
    /// Stored or deflated.
    pub method: Method,
    /// The stored (compressed) bytes' range in the archive file.
    pub data: Range<u64>,
    /// Uncompressed size.
    pub size: u64,
    /// CRC-32 of the uncompressed bytes.
    pub crc32: u32,
    /// A directory entry (name ends in `/`).
    pub is_dir: bool,
    /// Where the local header starts.
    pub local_header: u64,
    /// Where the central directory record starts.
    pub central_header: u64,
}

fn bad(path: &Path, rule: impl Into<String>) -> Error {
    Error::format(path, rule)
}

/// Rejects a name that could escape a directory or mean different things on different
/// systems: empty, absolute, with a drive letter, a `..` segment, a backslash or NUL.
pub(crate) fn check_name(name: &[u8], path: &Path) -> Result<()> {
    let shown = String::from_utf8_lossy(name);
    let reject = |why: &str| bad(path, format!("entry name {shown:?} {why}"));
    if name.is_empty() {
        return Err(reject("is empty"));
    }
    if name[0] == b'/' {
        return Err(reject("is absolute"));
    }
    if name.len() >= 2 && name[0].is_ascii_alphabetic() && name[1] == b':' {
        return Err(reject("starts with a drive letter"));
    }
    if name.contains(&b'\\') {
        return Err(reject("contains a backslash"));
    }
    if name.contains(&0) {
        return Err(reject("contains NUL"));
    }
    if name.split(|&b| b == b'/').any(|seg| seg == b"..") {
        return Err(reject("has a `..` segment"));
    }
    if std::str::from_utf8(name).is_err() {
        return Err(reject("is not UTF-8"));
    }
    Ok(())
}

/// The entry count an archive's end record declares, read without parsing the central
/// directory, so a hostile count is refused before any allocation.
fn declared_entries(bytes: &[u8]) -> Option<u64> {
    const EOCD: [u8; 4] = [0x50, 0x4b, 0x05, 0x06];
    let from = bytes.len().saturating_sub(22 + 0xFFFF);
    let at = (from..=bytes.len().checked_sub(22)?)
        .rev()
        .find(|&i| bytes[i..i + 4] == EOCD)?;
    let n = u16::from_le_bytes([bytes[at + 10], bytes[at + 11]]) as u64;
    if n != 0xFFFF || at < 20 {
        return Some(n);
    }
    // ZIP64: the locator sits right before the end record and points at the ZIP64 record.
    let loc = &bytes[at - 20..at];
    if loc[..4] != [0x50, 0x4b, 0x06, 0x07] {
        return Some(n);
    }
    let rec = u64::from_le_bytes(loc[8..16].try_into().ok()?) as usize;
    let total = bytes.get(rec.checked_add(32)?..rec.checked_add(40)?)?;
    Some(u64::from_le_bytes(total.try_into().ok()?))
}

/// Lists and checks the entries of the archive `bytes` (the whole file).
pub(crate) fn entries(bytes: &[u8], path: &Path, limits: &ZipLimits) -> Result<Vec<ZipEntry>> {
    if let Some(n) = declared_entries(bytes) {
        if n > limits.max_entries as u64 {
            return Err(bad(
                path,
                format!("{n} entries; the limit is {}", limits.max_entries),
            ));
        }
    }
    let zip_err = |e: zip::result::ZipError| {
        // A ZIP's end record is its last bytes: an archive cut short loses it first.
        let hint = if bytes.starts_with(b"PK\x03\x04") {
            format!(
                " (the archive starts as a ZIP but its {}-byte file has no readable end record: \
                 it was probably cut short by an interrupted copy or write; copy or write it \
                 again)",
                bytes.len()
            )
        } else {
            String::new()
        };
        bad(path, format!("not a readable ZIP archive: {e}{hint}"))
    };
    let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).map_err(zip_err)?;
    if archive.len() > limits.max_entries {
        return Err(bad(
            path,
            format!(
                "{} entries; the limit is {}",
                archive.len(),
                limits.max_entries
            ),
        ));
    }
    // Names first, before any entry's data is looked at.
    let mut names = Vec::with_capacity(archive.len());
    for i in 0..archive.len() {
        let raw = archive
            .by_index_raw(i)
            .map_err(zip_err)?
            .name_raw()
            .to_vec();
        check_name(&raw, path)?;
        names.push(String::from_utf8(raw).expect("checked UTF-8"));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = names.iter().find(|n| !seen.insert(n.as_str())) {
        return Err(bad(path, format!("entry {dup:?} appears twice")));
    }
    let mut out = Vec::with_capacity(names.len());
    let mut total: u64 = 0;
    for (i, name) in names.into_iter().enumerate() {
        let f = archive.by_index_raw(i).map_err(zip_err)?;
        let what = |rule: String| bad(path, format!("entry {name:?}: {rule}"));
        if f.encrypted() {
            return Err(what("encrypted entries are not supported".into()));
        }
        let method = match f.compression() {
            zip::CompressionMethod::Stored => Method::Stored,
            // Without the crate's own inflater (shardkit inflates with flate2), DEFLATE
            // appears under its constant.
            m if m == zip::CompressionMethod::DEFLATE => Method::Deflate,
            m => return Err(what(format!("compression {m:?}; only STORED and DEFLATE"))),
        };
        let (size, csize) = (f.size(), f.compressed_size());
        if method == Method::Stored && size != csize {
            return Err(what(format!(
                "STORED with {csize} stored bytes for {size} uncompressed"
            )));
        }
        if size > csize.max(1).saturating_mul(limits.max_ratio) {
            return Err(what(format!(
                "compression ratio {size}:{csize} exceeds {}:1",
                limits.max_ratio
            )));
        }
        total = total.saturating_add(size);
        if total > limits.max_total_bytes {
            return Err(bad(
                path,
                format!(
                    "entries hold more than {} uncompressed bytes (the limit)",
                    limits.max_total_bytes
                ),
            ));
        }
        let start = f.data_start();
        let end = start
            .checked_add(csize)
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| {
                what(format!(
                    "truncated: the archive has {} of the {} bytes its central directory needs \
                     ({csize} bytes at byte {start}); it was cut short (an interrupted copy or \
                     write): copy or write it again",
                    bytes.len(),
                    start.saturating_add(csize)
                ))
            })?;
        let e = ZipEntry {
            name,
            method,
            data: start..end,
            size,
            crc32: f.crc32(),
            is_dir: f.is_dir(),
            local_header: f.header_start(),
            central_header: f.central_header_start(),
        };
        check_local_header(bytes, &e, path)?;
        out.push(e);
    }
    Ok(out)
}

/// The local header must agree with the central directory: signature, name, method, and
/// (without a data descriptor) CRC-32 and sizes.
fn check_local_header(bytes: &[u8], e: &ZipEntry, path: &Path) -> Result<()> {
    let what = |rule: &str| bad(path, format!("entry {:?}: local header {rule}", e.name));
    let h = e.local_header as usize;
    let fixed = bytes.get(h..h + 30).ok_or_else(|| what("is truncated"))?;
    let u16_at = |o: usize| u16::from_le_bytes([fixed[o], fixed[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(fixed[o..o + 4].try_into().expect("4"));
    if u32_at(0) != 0x0403_4b50 {
        return Err(what("has no signature"));
    }
    let flags = u16_at(6);
    if flags & 1 != 0 {
        return Err(what("marks the entry encrypted"));
    }
    let method = match e.method {
        Method::Stored => 0,
        Method::Deflate => 8,
    };
    if u16_at(8) != method {
        return Err(what("names another compression method"));
    }
    let (name_len, extra_len) = (u16_at(26) as usize, u16_at(28) as usize);
    let name = bytes.get(h + 30..h + 30 + name_len);
    if name != Some(e.name.as_bytes()) {
        return Err(what("has another name"));
    }
    if (h + 30 + name_len + extra_len) as u64 != e.data.start {
        return Err(what("does not end where the data starts"));
    }
    if flags & 8 == 0 {
        let (crc, csize, size) = (u32_at(14), u32_at(18), u32_at(22));
        let size_ok = |local: u32, central: u64| local == 0xFFFF_FFFF || local as u64 == central;
        if crc != e.crc32 || !size_ok(csize, e.data.end - e.data.start) || !size_ok(size, e.size) {
            return Err(what(
                "disagrees with the central directory on CRC-32 or sizes",
            ));
        }
    }
    Ok(())
}

/// Inflates a DEFLATE entry, checking its size and CRC-32; at most `limit` bytes.
pub(crate) fn inflate(bytes: &[u8], e: &ZipEntry, path: &Path) -> Result<Vec<u8>> {
    let what = |rule: String| bad(path, format!("entry {:?}: {rule}", e.name));
    let data = &bytes[e.data.start as usize..e.data.end as usize];
    let cap = usize::try_from(e.size).map_err(|_| what("too large".into()))?;
    let mut out = Vec::new();
    out.try_reserve_exact(cap)
        .map_err(|_| what(format!("cannot allocate {cap} bytes")))?;
    let mut dec = flate2::read::DeflateDecoder::new(data).take(e.size + 1);
    dec.read_to_end(&mut out)
        .map_err(|err| what(format!("DEFLATE data is corrupt: {err}")))?;
    if out.len() as u64 != e.size {
        return Err(what(format!(
            "inflates to {}{} bytes, not the declared {}",
            out.len(),
            if out.len() as u64 > e.size { "+" } else { "" },
            e.size
        )));
    }
    let crc = crc32fast::hash(&out);
    if crc != e.crc32 {
        return Err(what(format!(
            "CRC-32 {crc:08x} of the inflated bytes, {:08x} recorded",
            e.crc32
        )));
    }
    Ok(out)
}

/// The first bytes of an entry (up to `n`), inflating only as much as needed.
pub(crate) fn peek(bytes: &[u8], e: &ZipEntry, n: usize) -> Vec<u8> {
    let data = &bytes[e.data.start as usize..e.data.end as usize];
    match e.method {
        Method::Stored => data[..n.min(data.len())].to_vec(),
        Method::Deflate => {
            let mut out = Vec::new();
            let _ = flate2::read::DeflateDecoder::new(data)
                .take(n as u64)
                .read_to_end(&mut out);
            out
        }
    }
}

/// A shard file name `<base>.shard<i>-of-<N>.sdnb` split into (base, i, N).
pub(crate) fn parse_shard_name(name: &str) -> Option<(&str, u32, u32)> {
    let stem = name.strip_suffix(".sdnb")?;
    let (head, n) = stem.rsplit_once("-of-")?;
    let (base, i) = head.rsplit_once(".shard")?;
    let num = |s: &str| -> Option<u32> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    Some((base, num(i)?, num(n)?))
}

/// What an archive holds as its model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ModelEntries {
    /// One SDNB entry (its index).
    Single(usize),
    /// A complete shard set, indices in shard order.
    Sharded(Vec<usize>),
}

/// Chooses the model among the entries (samediff.md §9.7): `model.sdnb`, `model`, the
/// complete `model.shard*` set, or the only SDNB entry that is not shard-named.
pub(crate) fn choose_model(
    bytes: &[u8],
    entries: &[ZipEntry],
    path: &Path,
) -> Result<ModelEntries> {
    let is_sdnb =
        |e: &ZipEntry| !e.is_dir && e.size >= 32 && peek(bytes, e, 4) == super::header::MAGIC;
    let named = |n: &str| entries.iter().position(|e| e.name == n && is_sdnb(e));
    if let Some(i) = named("model.sdnb").or_else(|| named("model")) {
        return Ok(ModelEntries::Single(i));
    }
    let sdnb: Vec<usize> = (0..entries.len())
        .filter(|&i| is_sdnb(&entries[i]))
        .collect();
    let shards: Vec<(usize, &str, u32, u32)> = sdnb
        .iter()
        .filter_map(|&i| parse_shard_name(&entries[i].name).map(|(base, s, n)| (i, base, s, n)))
        .collect();
    let model_shards: Vec<_> = shards.iter().filter(|s| s.1 == "model").collect();
    if !model_shards.is_empty() {
        let n = model_shards[0].3;
        if let Some(s) = model_shards.iter().find(|s| s.3 != n) {
            return Err(bad(
                path,
                format!(
                    "shard entries disagree on the count: {:?} and {:?}",
                    entries[model_shards[0].0].name, entries[s.0].name
                ),
            ));
        }
        // The count comes from a name: it cannot size anything before it is checked.
        if n as usize > entries.len() + 1024 {
            return Err(bad(
                path,
                format!(
                    "incomplete shard set: the names declare {n} shards, the archive holds {} \
                     entries; shardkit never loads a partial model",
                    entries.len()
                ),
            ));
        }
        let mut order = vec![None; n as usize];
        for s in &model_shards {
            let slot = order.get_mut(s.2 as usize).ok_or_else(|| {
                bad(
                    path,
                    format!("entry {:?}: shard index ≥ the count", entries[s.0].name),
                )
            })?;
            if slot.replace(s.0).is_some() {
                return Err(bad(path, format!("shard {} appears twice", s.2)));
            }
        }
        if let Some(missing) = order.iter().position(Option::is_none) {
            return Err(bad(
                path,
                format!(
                    "incomplete shard set: model.shard{missing}-of-{n}.sdnb is missing \
                     (a partial model is never loaded)"
                ),
            ));
        }
        return Ok(ModelEntries::Sharded(order.into_iter().flatten().collect()));
    }
    let plain: Vec<usize> = sdnb
        .iter()
        .copied()
        .filter(|&i| parse_shard_name(&entries[i].name).is_none())
        .collect();
    match (plain.as_slice(), shards.first()) {
        ([only], None) => Ok(ModelEntries::Single(*only)),
        (_, Some(s)) => Err(bad(
            path,
            format!(
                "shard entries with base {:?} (e.g. {:?}); an SDZ names its shards \
                 model.shard<i>-of-<N>.sdnb, and a foreign set is never loaded in part",
                s.1, entries[s.0].name
            ),
        )),
        ([], None) => Err(bad(
            path,
            format!(
                "no SDNB entry (entries: {})",
                entries
                    .iter()
                    .map(|e| e.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
        (many, None) => Err(bad(
            path,
            format!(
                "{} SDNB entries and none named model, model.sdnb or model.shard*: {}",
                many.len(),
                many.iter()
                    .map(|&i| entries[i].name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

// ---- Writing ----

/// The header ID of the alignment record (Android zipalign's).
pub(crate) const ALIGN_EXTRA_ID: u16 = 0xD935;
const ZIP64_LIMIT: u64 = 0xFFFF_FFFF;
/// 1980-01-01 00:00:00 in DOS date/time.
const DOS_DATE: u16 = (1 << 5) | 1;

struct CentralRecord {
    name: String,
    crc32: u32,
    size: u64,
    local_header: u64,
    method: u16,
    compressed: u64,
}

/// Writes a ZIP sequentially into `file`: entries are started with their exact size, their
/// bytes written by the caller at [`ZipWriter::position`], and finished with their CRC-32.
pub(crate) struct ZipWriter {
    file: File,
    path: PathBuf,
    pos: u64,
    align: u64,
    force_zip64: bool,
    records: Vec<CentralRecord>,
    open: Option<(u64, u64)>, // (local header, data end)
}

impl ZipWriter {
    /// A writer whose STORED entries start at multiples of `align` (a power of two ≤ 32768).
    pub(crate) fn new(file: File, path: &Path, align: u64) -> ZipWriter {
        ZipWriter {
            file,
            path: path.to_path_buf(),
            pos: 0,
            align: align.max(1),
            force_zip64: false,
            records: Vec::new(),
            open: None,
        }
    }

    /// Writes ZIP64 records even where sizes do not need them (tests of the ZIP64 path).
    #[cfg(test)]
    pub(crate) fn force_zip64(&mut self, yes: bool) {
        self.force_zip64 = yes;
    }

    /// The underlying file (for positioned writes by the caller).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Advances past `n` bytes the caller wrote at [`position`](Self::position).
    pub(crate) fn advance(&mut self, n: u64) {
        self.pos += n;
    }

    /// Starts a STORED entry of exactly `size` bytes; returns where its data starts (aligned).
    pub(crate) fn start_stored(&mut self, name: &str, size: u64) -> Result<u64> {
        check_name(name.as_bytes(), Path::new(name))?;
        if self.open.is_some() {
            return Err(Error::Invalid("zip: an entry is still open".into()));
        }
        if self.records.iter().any(|r| r.name == name) {
            return Err(Error::Invalid(format!("zip: entry {name:?} written twice")));
        }
        let zip64 = self.force_zip64 || size >= ZIP64_LIMIT;
        let local = self.pos;
        let mut extra = Vec::new();
        if zip64 {
            extra.extend(1u16.to_le_bytes());
            extra.extend(16u16.to_le_bytes());
            extra.extend(size.to_le_bytes());
            extra.extend(size.to_le_bytes());
        }
        // The alignment record: ID, data size, u16 alignment, then p zero bytes.
        let before = local + 30 + name.len() as u64 + extra.len() as u64 + 6;
        let pad = (self.align - before % self.align) % self.align;
        extra.extend(ALIGN_EXTRA_ID.to_le_bytes());
        extra.extend(((2 + pad) as u16).to_le_bytes());
        extra.extend((self.align as u16).to_le_bytes());
        extra.resize(extra.len() + pad as usize, 0);
        let small = |v: u64| if zip64 { u32::MAX } else { v as u32 };
        let mut h = Vec::with_capacity(30 + name.len() + extra.len());
        h.extend(0x0403_4b50u32.to_le_bytes());
        h.extend((if zip64 { 45u16 } else { 10 }).to_le_bytes());
        h.extend(name_flags(name).to_le_bytes());
        h.extend(0u16.to_le_bytes()); // STORED
        h.extend(0u16.to_le_bytes());
        h.extend(DOS_DATE.to_le_bytes());
        h.extend(0u32.to_le_bytes()); // CRC-32, patched by finish_entry
        h.extend(small(size).to_le_bytes());
        h.extend(small(size).to_le_bytes());
        h.extend((name.len() as u16).to_le_bytes());
        h.extend((extra.len() as u16).to_le_bytes());
        h.extend(name.as_bytes());
        h.extend(&extra);
        self.file.write_all_at(&h, local).at(&self.path)?;
        self.pos += h.len() as u64;
        debug_assert_eq!(self.pos % self.align, 0);
        self.records.push(CentralRecord {
            name: name.to_string(),
            crc32: 0,
            size,
            local_header: local,
            method: 0,
            compressed: size,
        });
        self.open = Some((local, self.pos + size));
        Ok(self.pos)
    }

    /// Ends the open entry, whose bytes must all have been written, recording its CRC-32.
    pub(crate) fn finish_entry(&mut self, crc32: u32) -> Result<()> {
        let (local, end) = self
            .open
            .take()
            .ok_or_else(|| Error::Invalid("zip: no entry is open".into()))?;
        if self.pos != end {
            return Err(Error::Invalid(format!(
                "zip: the entry ends at {}, its declared size ends it at {end}",
                self.pos
            )));
        }
        self.file
            .write_all_at(&crc32.to_le_bytes(), local + 14)
            .at(&self.path)?;
        self.records.last_mut().expect("open entry").crc32 = crc32;
        Ok(())
    }

    /// Adds a whole STORED entry from memory.
    pub(crate) fn add_stored(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let at = self.start_stored(name, data.len() as u64)?;
        self.file.write_all_at(data, at).at(&self.path)?;
        self.advance(data.len() as u64);
        self.finish_entry(crc32fast::hash(data))
    }

    /// Writes the central directory and end records; returns the file.
    pub(crate) fn finish(mut self) -> Result<File> {
        if self.open.is_some() {
            return Err(Error::Invalid("zip: an entry is still open".into()));
        }
        let cd_start = self.pos;
        let mut cd = Vec::new();
        for r in &self.records {
            let big_size = self.force_zip64 || r.size >= ZIP64_LIMIT;
            let big_offset = self.force_zip64 || r.local_header >= ZIP64_LIMIT;
            let mut extra = Vec::new();
            if big_size || big_offset {
                let mut data = Vec::new();
                if big_size {
                    data.extend(r.size.to_le_bytes());
                    data.extend(r.compressed.to_le_bytes());
                }
                if big_offset {
                    data.extend(r.local_header.to_le_bytes());
                }
                extra.extend(1u16.to_le_bytes());
                extra.extend((data.len() as u16).to_le_bytes());
                extra.extend(data);
            }
            let version: u16 = if extra.is_empty() { 10 } else { 45 };
            cd.extend(0x0201_4b50u32.to_le_bytes());
            cd.extend((0x0300 | version).to_le_bytes()); // made by: Unix
            cd.extend(version.to_le_bytes());
            cd.extend(name_flags(&r.name).to_le_bytes());
            cd.extend(r.method.to_le_bytes());
            cd.extend(0u16.to_le_bytes());
            cd.extend(DOS_DATE.to_le_bytes());
            cd.extend(r.crc32.to_le_bytes());
            let small = |v: u64, big: bool| if big { u32::MAX } else { v as u32 };
            cd.extend(small(r.compressed, big_size).to_le_bytes());
            cd.extend(small(r.size, big_size).to_le_bytes());
            cd.extend((r.name.len() as u16).to_le_bytes());
            cd.extend((extra.len() as u16).to_le_bytes());
            cd.extend(0u16.to_le_bytes()); // comment
            cd.extend(0u16.to_le_bytes()); // disk
            cd.extend(0u16.to_le_bytes()); // internal attributes
            cd.extend((0o100644u32 << 16).to_le_bytes());
            cd.extend(small(r.local_header, big_offset).to_le_bytes());
            cd.extend(r.name.as_bytes());
            cd.extend(extra);
        }
        let cd_len = cd.len() as u64;
        let n = self.records.len() as u64;
        let zip64 =
            self.force_zip64 || n >= 0xFFFF || cd_start >= ZIP64_LIMIT || cd_len >= ZIP64_LIMIT;
        if zip64 {
            let rec_at = cd_start + cd_len;
            cd.extend(0x0606_4b50u32.to_le_bytes());
            cd.extend(44u64.to_le_bytes());
            cd.extend((0x0300u16 | 45).to_le_bytes());
            cd.extend(45u16.to_le_bytes());
            cd.extend(0u32.to_le_bytes());
            cd.extend(0u32.to_le_bytes());
            cd.extend(n.to_le_bytes());
            cd.extend(n.to_le_bytes());
            cd.extend(cd_len.to_le_bytes());
            cd.extend(cd_start.to_le_bytes());
            cd.extend(0x0706_4b50u32.to_le_bytes());
            cd.extend(0u32.to_le_bytes());
            cd.extend(rec_at.to_le_bytes());
            cd.extend(1u32.to_le_bytes());
        }
        let count = if zip64 { 0xFFFF } else { n as u16 };
        cd.extend(0x0605_4b50u32.to_le_bytes());
        cd.extend(0u16.to_le_bytes());
        cd.extend(0u16.to_le_bytes());
        cd.extend(count.to_le_bytes());
        cd.extend(count.to_le_bytes());
        cd.extend((if zip64 { u32::MAX } else { cd_len as u32 }).to_le_bytes());
        cd.extend((if zip64 { u32::MAX } else { cd_start as u32 }).to_le_bytes());
        cd.extend(0u16.to_le_bytes());
        self.file.write_all_at(&cd, cd_start).at(&self.path)?;
        self.pos += cd.len() as u64;
        self.file.set_len(self.pos).at(&self.path)?;
        Ok(self.file)
    }
}

/// General-purpose flags: bit 11 (UTF-8 name) when the name is not ASCII.
fn name_flags(name: &str) -> u16 {
    if name.is_ascii() {
        0
    } else {
        1 << 11
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn archive(entries: &[(&str, &[u8])], align: u64, zip64: bool) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.zip");
        let mut w = ZipWriter::new(File::create(&p).unwrap(), &p, align);
        w.force_zip64(zip64);
        for (name, data) in entries {
            w.add_stored(name, data).unwrap();
        }
        w.finish().unwrap();
        std::fs::read(&p).unwrap()
    }

    #[test]
    fn aligned_stored_entries_read_back_with_the_zip_crate_and_ours() {
        for zip64 in [false, true] {
            for align in [64, 4096] {
                let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
                let bytes = archive(
                    &[("model", &big), ("tokenizer.json", b"{}"), ("é.txt", b"x")],
                    align,
                    zip64,
                );
                let es = entries(&bytes, Path::new("a.zip"), &ZipLimits::default()).unwrap();
                assert_eq!(es.len(), 3);
                for e in &es {
                    assert_eq!(e.data.start % align, 0, "{} aligned", e.name);
                    assert_eq!(e.method, Method::Stored);
                }
                assert_eq!(
                    &bytes[es[0].data.start as usize..es[0].data.end as usize],
                    &big[..]
                );
                assert_eq!(es[0].crc32, crc32fast::hash(&big));
                assert_eq!(es[2].name, "é.txt");
                let mut z = zip::ZipArchive::new(Cursor::new(&bytes)).unwrap();
                let mut got = Vec::new();
                z.by_name("model").unwrap().read_to_end(&mut got).unwrap();
                assert_eq!(got, big);
                // The alignment record is in the local header only.
                let cd = z.by_index_raw(0).unwrap().central_header_start() as usize;
                assert_eq!(
                    u16::from_le_bytes([bytes[cd + 30], bytes[cd + 31]]) as usize,
                    if zip64 { 28 } else { 0 }
                );
                let h = es[0].local_header as usize;
                let extra_at = h + 30 + 5 + if zip64 { 20 } else { 0 };
                assert_eq!(bytes[extra_at..extra_at + 2], ALIGN_EXTRA_ID.to_le_bytes());
            }
        }
    }

    #[test]
    fn deflate_entries_inflate_with_checks() {
        let p = PathBuf::from("d.zip");
        let data: Vec<u8> = b"SDNB"
            .iter()
            .copied()
            .chain((0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 29) as u8))
            .collect();
        let mut enc =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(&data).unwrap();
        let bytes = single_deflate_zip(&enc.finish().unwrap(), &data, "model");
        let es = entries(&bytes, &p, &ZipLimits::default()).unwrap();
        assert_eq!(es[0].method, Method::Deflate);
        assert_eq!(inflate(&bytes, &es[0], &p).unwrap(), data);
        assert_eq!(peek(&bytes, &es[0], 4), b"SDNB");
        assert_eq!(
            choose_model(&bytes, &es, &p).unwrap(),
            ModelEntries::Single(0)
        );
        let mut bad_crc = es[0].clone();
        bad_crc.crc32 ^= 1;
        assert!(inflate(&bytes, &bad_crc, &p)
            .unwrap_err()
            .to_string()
            .contains("CRC-32"));
        let mut short = es[0].clone();
        short.size -= 1;
        assert!(inflate(&bytes, &short, &p)
            .unwrap_err()
            .to_string()
            .contains("not the declared"));
        let strict = ZipLimits {
            max_ratio: 2,
            ..ZipLimits::default()
        };
        assert!(entries(&bytes, &p, &strict)
            .unwrap_err()
            .to_string()
            .contains("ratio"));
    }

    /// A one-entry DEFLATE archive, written field by field.
    fn single_deflate_zip(raw: &[u8], data: &[u8], name: &str) -> Vec<u8> {
        let crc = crc32fast::hash(data);
        let mut z = Vec::new();
        z.extend(0x0403_4b50u32.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(8u16.to_le_bytes());
        z.extend([0u8; 4]);
        z.extend(crc.to_le_bytes());
        z.extend((raw.len() as u32).to_le_bytes());
        z.extend((data.len() as u32).to_le_bytes());
        z.extend((name.len() as u16).to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(name.as_bytes());
        z.extend(raw);
        let cd = z.len();
        z.extend(0x0201_4b50u32.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(20u16.to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z.extend(8u16.to_le_bytes());
        z.extend([0u8; 4]);
        z.extend(crc.to_le_bytes());
        z.extend((raw.len() as u32).to_le_bytes());
        z.extend((data.len() as u32).to_le_bytes());
        z.extend((name.len() as u16).to_le_bytes());
        z.extend([0u8; 8]);
        z.extend(0u32.to_le_bytes());
        z.extend(0u32.to_le_bytes());
        z.extend(name.as_bytes());
        let cd_len = z.len() - cd;
        z.extend(0x0605_4b50u32.to_le_bytes());
        z.extend([0u8; 4]);
        z.extend(1u16.to_le_bytes());
        z.extend(1u16.to_le_bytes());
        z.extend((cd_len as u32).to_le_bytes());
        z.extend((cd as u32).to_le_bytes());
        z.extend(0u16.to_le_bytes());
        z
    }

    #[test]
    fn hostile_names_and_counts_are_refused() {
        for name in ["", "/etc/passwd", "C:x", "a/../b", "..", "a\\b", "a\0b"] {
            assert!(
                check_name(name.as_bytes(), Path::new("z")).is_err(),
                "{name:?}"
            );
        }
        for name in [
            "model",
            "a/b.json",
            "..a",
            "a..b/c",
            "model.shard0-of-2.sdnb",
        ] {
            check_name(name.as_bytes(), Path::new("z")).unwrap();
        }
        let many: Vec<(String, Vec<u8>)> = (0..12).map(|i| (format!("f{i}"), vec![i])).collect();
        let refs: Vec<(&str, &[u8])> = many.iter().map(|(n, d)| (n.as_str(), &d[..])).collect();
        let bytes = archive(&refs, 64, false);
        let few = ZipLimits {
            max_entries: 11,
            ..ZipLimits::default()
        };
        assert!(entries(&bytes, Path::new("z"), &few)
            .unwrap_err()
            .to_string()
            .contains("12 entries"));
        let small = ZipLimits {
            max_total_bytes: 11,
            ..ZipLimits::default()
        };
        assert!(entries(&bytes, Path::new("z"), &small).is_err());
    }

    #[test]
    fn model_choice() {
        let sdnb = |tag: u8| {
            let mut v = b"SDNB".to_vec();
            v.resize(40, tag);
            v
        };
        let (a, b, c) = (sdnb(1), sdnb(2), sdnb(3));
        let pick = |es: &[(&str, &[u8])]| {
            let bytes = archive(es, 64, false);
            let list = entries(&bytes, Path::new("z"), &ZipLimits::default()).unwrap();
            choose_model(&bytes, &list, Path::new("z")).map_err(|e| e.to_string())
        };
        assert_eq!(
            pick(&[("x.json", b"{}"), ("model", &a)]),
            Ok(ModelEntries::Single(1))
        );
        assert_eq!(
            pick(&[("model", &a), ("model.sdnb", &b)]),
            Ok(ModelEntries::Single(1))
        );
        assert_eq!(
            pick(&[
                ("model.shard1-of-2.sdnb", &a),
                ("model.shard0-of-2.sdnb", &b)
            ]),
            Ok(ModelEntries::Sharded(vec![1, 0]))
        );
        assert!(pick(&[
            ("model.shard1-of-3.sdnb", &a),
            ("model.shard0-of-3.sdnb", &b)
        ])
        .unwrap_err()
        .contains("shard2-of-3.sdnb is missing"));
        assert!(
            pick(&[("x.shard0-of-2.sdnb", &a), ("x.shard1-of-2.sdnb", &b)])
                .unwrap_err()
                .contains("base \"x\"")
        );
        assert_eq!(
            pick(&[("weights.bin", &c), ("t.json", b"{}")]),
            Ok(ModelEntries::Single(0))
        );
        assert!(pick(&[("w1", &a), ("w2", &b)])
            .unwrap_err()
            .contains("2 SDNB entries"));
        assert!(pick(&[("model", b"SDNB short")])
            .unwrap_err()
            .contains("no SDNB entry"));
        assert_eq!(
            parse_shard_name("a.b.shard10-of-12.sdnb"),
            Some(("a.b", 10, 12))
        );
        assert_eq!(parse_shard_name("a.shard-of-2.sdnb"), None);
        assert_eq!(parse_shard_name("a.shard1-of-N.sdnb"), None);
    }
}
