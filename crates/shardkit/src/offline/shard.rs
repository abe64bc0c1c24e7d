//! Shard files: names, the shard set of a directory, the tensors a shard holds, and reading and
//! writing them through the `safetensors` crate (eagle3.md §1–2, §8).
//!
//! A shard `shard-NNNNNN.safetensors` holds rows `[k·s, k·s + n)` of every field, stacked on
//! dim 0 and stored tensor after tensor, so a sample is one row of each tensor: one byte range
//! per tensor (EAGLE-3: six, seven for top-k; DSpark: four).

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

use super::manifest::{Layout, Manifest};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::{Source, Stop};

/// The file name of shard `k`.
pub(crate) fn shard_name(k: u64) -> String {
    format!("shard-{k:06}.safetensors")
}

/// Bytes read from the start of a shard in a store when it is opened: its header, in one GET.
const HEADER_PROBE: u64 = 64 << 10;

/// The shard index a file name carries, if it is exactly `shard-` + 6 digits + `.safetensors`.
pub(crate) fn shard_index(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    (digits.len() == 6 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Whether `name` is a temporary a writer leaves when killed: `<name>.tmp`, or `.tmp` followed
/// by 6 characters (the safetensors crate's own temporary file).
pub(crate) fn is_temporary(name: &str) -> bool {
    name.ends_with(".tmp")
        || (name.len() == 10
            && name.starts_with(".tmp")
            && name[4..].bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// The shard indices present in `dir` (an absent directory has none).
pub(crate) fn shard_set(dir: &Path) -> Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(dir, e)),
    };
    for e in entries {
        let e = e.at(dir)?;
        if let Some(k) = e.file_name().to_str().and_then(shard_index) {
            out.insert(k);
        }
    }
    Ok(out)
}

/// Describes `set` against the complete set `0..expected` (None when equal): what is missing
/// and what is extra.
pub(crate) fn shard_set_problem(set: &BTreeSet<u64>, expected: u64) -> Option<String> {
    let missing: Vec<u64> = (0..expected).filter(|k| !set.contains(k)).collect();
    let extra: Vec<u64> = set.iter().copied().filter(|&k| k >= expected).collect();
    if missing.is_empty() && extra.is_empty() {
        return None;
    }
    let list = |v: &[u64]| {
        let shown: Vec<String> = v.iter().take(8).map(|&k| shard_name(k)).collect();
        let more = if v.len() > 8 {
            format!(" and {} more", v.len() - 8)
        } else {
            String::new()
        };
        format!("{}{more}", shown.join(", "))
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing {}", list(&missing)));
    }
    if !extra.is_empty() {
        parts.push(format!("unexpected {}", list(&extra)));
    }
    Some(format!(
        "the shard set must be exactly shard-000000 to shard-{:06} ({expected} shards): {}",
        expected.saturating_sub(1),
        parts.join("; ")
    ))
}

/// Removes temporaries killed writers left in `dir`; returns how many.
pub(crate) fn remove_temporaries(dir: &Path) -> Result<usize> {
    let mut n = 0;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_str().is_some_and(is_temporary) && e.path().is_file() {
                std::fs::remove_file(e.path()).at(e.path())?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// One stored tensor of a shard: its name, dtype and the shape of one sample's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldSpec {
    /// The tensor name.
    pub name: &'static str,
    /// Its dtype.
    pub dtype: Dtype,
    /// The shape of one row (the tensor is `[n, ...row]`).
    pub row: Vec<usize>,
}

impl FieldSpec {
    /// Bytes in one row.
    pub(crate) fn row_bytes(&self) -> usize {
        self.row.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// The tensors every shard of `m` holds, in name order (the order `save_file` stores them).
pub(crate) fn field_specs(m: &Manifest) -> Vec<FieldSpec> {
    let s = m.seq_length as usize;
    let d = m.dtype;
    let ints = |name| FieldSpec {
        name,
        dtype: Dtype::I64,
        row: vec![s],
    };
    let floats = |name, width: u64| FieldSpec {
        name,
        dtype: d,
        row: vec![s, width as usize],
    };
    match &m.layout {
        Layout::DSpark(l) => vec![
            ints("input_ids"),
            ints("loss_mask"),
            floats("target_hidden_states", l.target_hidden_dim),
            floats("target_last_hidden_states", l.target_last_hidden_dim),
        ],
        Layout::Eagle3(l) => {
            let mut v = vec![
                ints("attention_mask"),
                floats("aux_hidden_states", l.aux_hidden_dim),
                ints("input_ids"),
                ints("loss_mask"),
                FieldSpec {
                    name: "position_mask",
                    dtype: Dtype::BOOL,
                    row: vec![s, 1],
                },
            ];
            match l.topk {
                None => v.push(floats("target_probs", l.draft_vocab_size)),
                Some(k) => {
                    v.push(FieldSpec {
                        name: "target_probs_indices",
                        dtype: Dtype::I32,
                        row: vec![s, k as usize],
                    });
                    v.push(floats("target_probs_values", k));
                }
            }
            v
        }
    }
}

fn st_err(path: &Path, source: safetensors::SafeTensorError) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        source,
    }
}

/// A shard opened for reading: its memory map (or its object in a store) and parsed header,
/// checked against the manifest.
pub(crate) struct ShardFile {
    path: PathBuf,
    /// None for a shard in an object store, whose rows are read with ranged GETs.
    map: Option<Mmap>,
    /// Byte offset of the data section.
    data_start: usize,
    /// Per field spec (same order as [`field_specs`]): the tensor's offset in the file.
    offsets: Vec<usize>,
    rows: u64,
}

impl std::fmt::Debug for ShardFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardFile")
            .field("path", &self.path)
            .field("rows", &self.rows)
            .finish()
    }
}

/// Parses a safetensors header with the crate (every check of eagle3.md §8.5). A file shorter
/// than its header declares is refused as "truncated: X of Y bytes" (a [`Error::Format`])
/// rather than with the crate's words for it.
pub fn read_header(bytes: &[u8], path: &Path) -> Result<(usize, Metadata)> {
    SafeTensors::read_metadata(bytes).map_err(|e| {
        check_length(bytes, bytes.len() as u64, path)
            .err()
            .unwrap_or_else(|| st_err(path, e))
    })
}

/// The error for a safetensors file of `size` bytes that should hold `want` (`why` says where
/// that length comes from).
fn truncated(path: &Path, size: u64, want: &str, why: &str) -> Error {
    Error::format(
        path,
        format!(
            "truncated: {size} of {want} bytes ({why}); the file was cut short (an interrupted \
             copy or write): copy or write it again"
        ),
    )
}

/// Compares the size of a safetensors file (`size` bytes, starting with `head`) with the length
/// its header declares (8 + header + tensor data) and refuses a shorter file as truncated,
/// naming both sizes. A header that cannot be read (too large, not JSON, bad offsets, or not
/// all in `head`) is left to the crate's checks.
pub(crate) fn check_length(head: &[u8], size: u64, path: &Path) -> Result<()> {
    if size < 8 {
        return Err(truncated(
            path,
            size,
            "at least 8",
            "a safetensors file starts with the 8-byte length of its header",
        ));
    }
    let Some(len) = head.get(..8) else {
        return Ok(());
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(len);
    let n = u64::from_le_bytes(n);
    // The crate's own limit on headers (100 MB): a larger length is garbage, not truncation.
    if n > 100_000_000 {
        return Ok(());
    }
    if 8 + n > size {
        return Err(truncated(
            path,
            size,
            &format!("at least {}", 8 + n),
            &format!("the file ends inside its {n}-byte header"),
        ));
    }
    let Some(Ok(text)) = head.get(8..8 + n as usize).map(std::str::from_utf8) else {
        return Ok(());
    };
    let Ok(meta) = serde_json::from_str::<Metadata>(text) else {
        return Ok(());
    };
    let data = meta.data_len() as u64;
    let want = 8 + n + data;
    if size < want {
        return Err(truncated(
            path,
            size,
            &want.to_string(),
            &format!("its {n}-byte header declares {data} bytes of tensor data after it"),
        ));
    }
    Ok(())
}

/// The safetensors header of object `name` (`size` bytes) under `remote`, whose first bytes
/// `head` (at least 8) were fetched: its length and metadata, checked as `read_metadata` checks
/// a whole file (offsets, dtypes, shapes, the data ending exactly at the object's end). A header
/// longer than `head` costs one more GET, given up once `stop` is set.
pub(crate) fn remote_header(
    remote: &dyn Source,
    name: &str,
    size: u64,
    mut head: Vec<u8>,
    stop: &Stop,
) -> Result<(u64, Metadata)> {
    let path = remote.path_of(name);
    check_length(&head, size, &path)?;
    if head.len() < 8 {
        return Err(st_err(&path, SafeTensorError::HeaderTooSmall));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[..8]);
    let n = u64::from_le_bytes(len);
    // The crate's own limit on headers (100 MB).
    if n > 100_000_000 {
        return Err(st_err(&path, SafeTensorError::HeaderTooLarge));
    }
    if 8 + n > size {
        return Err(st_err(&path, SafeTensorError::InvalidHeaderLength));
    }
    let header = if 8 + n <= head.len() as u64 {
        head.truncate(8 + n as usize);
        head.split_off(8)
    } else {
        let mut rest = vec![0u8; n as usize];
        remote.read_ranges(&[name.to_string()], &[(0, 8, n, 0)], &mut rest, stop)?;
        rest
    };
    let text = std::str::from_utf8(&header)
        .map_err(|e| st_err(&path, SafeTensorError::InvalidHeader(e)))?;
    // Deserializing validates offsets, dtypes and shapes as `read_metadata` does; the data
    // section must then end exactly at the object's end.
    let meta: Metadata = serde_json::from_str(text)
        .map_err(|e| st_err(&path, SafeTensorError::InvalidHeaderDeserialization(e)))?;
    if meta.data_len() as u64 + 8 + n != size {
        let mut whole = len.to_vec();
        whole.extend_from_slice(&header);
        check_length(&whole, size, &path)?;
        return Err(st_err(&path, SafeTensorError::MetadataIncompleteBuffer));
    }
    Ok((n, meta))
}

/// The first [`HEADER_PROBE`] bytes of object `name` (`size` bytes): usually its whole
/// safetensors header, for [`remote_header`]; given up once `stop` is set.
pub(crate) fn remote_head(
    remote: &dyn Source,
    name: &str,
    size: u64,
    stop: &Stop,
) -> Result<Vec<u8>> {
    let mut head = vec![0u8; HEADER_PROBE.min(size) as usize];
    remote.read_ranges(
        &[name.to_string()],
        &[(0, 0, head.len() as u64, 0)],
        &mut head,
        stop,
    )?;
    Ok(head)
}

impl ShardFile {
    /// Maps `path` and checks that it holds exactly `specs` with `rows` rows each.
    pub(crate) fn open(path: &Path, specs: &[FieldSpec], rows: u64) -> Result<ShardFile> {
        let file = fsutil::open_regular(path)?;
        // SAFETY: shards are only ever replaced by rename, never rewritten in place, so the
        // mapped bytes do not change under us (eagle3.md §9.1).
        let map = unsafe { Mmap::map(&file) }.at(path)?;
        let (n, meta) = read_header(&map, path)?;
        let offsets = check_tensors(&meta, specs, rows, path)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            data_start: 8 + n,
            offsets,
            rows,
            map: Some(map),
        })
    }

    /// Reads the headers of objects `shards` (name, size, rows) under `remote`, checking each
    /// as [`ShardFile::open`] does. The first [`HEADER_PROBE`] bytes of every object are
    /// fetched together, one batch of parallel GETs, which usually brings the whole header (a
    /// few hundred bytes for a cache's tensors); a longer header costs its shard one more GET.
    /// Shards are opened while their batch is prepared, so every round trip here is one the
    /// loader waits for; the reads give up once `stop` (the loader's stream's) is set.
    pub(crate) fn open_remote_many(
        remote: &dyn Source,
        shards: &[(String, u64, u64)],
        specs: &[FieldSpec],
        stop: &Stop,
    ) -> Result<Vec<ShardFile>> {
        if let Some((name, size, _)) = shards.iter().find(|(_, size, _)| *size < 8) {
            check_length(&[], *size, &remote.path_of(name))?;
        }
        let names: Vec<String> = shards.iter().map(|(n, _, _)| n.clone()).collect();
        let mut ranges = Vec::with_capacity(shards.len());
        let mut at = 0;
        for (i, (_, size, _)) in shards.iter().enumerate() {
            let len = HEADER_PROBE.min(*size);
            ranges.push((i as u32, 0, len, at));
            at += len;
        }
        let mut heads = vec![0u8; at as usize];
        remote.read_ranges(&names, &ranges, &mut heads, stop)?;
        shards
            .iter()
            .zip(&ranges)
            .map(|((name, size, rows), &(_, _, len, at))| {
                let head = heads[at as usize..(at + len) as usize].to_vec();
                Self::from_head(remote, name, *size, head, specs, *rows, stop)
            })
            .collect()
    }

    /// The shard whose first bytes `head` (at least 8) are those of object `name`.
    fn from_head(
        remote: &dyn Source,
        name: &str,
        size: u64,
        head: Vec<u8>,
        specs: &[FieldSpec],
        rows: u64,
        stop: &Stop,
    ) -> Result<ShardFile> {
        let path = remote.path_of(name);
        let (n, meta) = remote_header(remote, name, size, head, stop)?;
        let offsets = check_tensors(&meta, specs, rows, &path)?;
        Ok(ShardFile {
            path,
            data_start: 8 + n as usize,
            offsets,
            rows,
            map: None,
        })
    }

    fn mapped(&self) -> Result<&Mmap> {
        self.map.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: a shard in an object store has no map; its rows come with the item \
                 (Cache::item)",
                self.path.display()
            ))
        })
    }
    /// The file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
    /// The bytes of row `r` of field `f` (index into the specs), borrowed from the map (an
    /// error for a shard in an object store).
    pub(crate) fn row(&self, f: usize, r: u64, row_bytes: usize) -> Result<&[u8]> {
        let start = self.data_start + self.offsets[f] + r as usize * row_bytes;
        Ok(&self.mapped()?[start..start + row_bytes])
    }
    /// The file offset of row `r` of field `f`.
    pub(crate) fn row_offset(&self, f: usize, r: u64, row_bytes: usize) -> u64 {
        (self.data_start + self.offsets[f] + r as usize * row_bytes) as u64
    }
    /// The whole tensor of field `f` (an error for a shard in an object store).
    pub(crate) fn tensor(&self, f: usize, row_bytes: usize) -> Result<&[u8]> {
        let start = self.data_start + self.offsets[f];
        Ok(&self.mapped()?[start..start + self.rows as usize * row_bytes])
    }
}

/// The offsets of `specs` in a parsed header, after checking the tensor set, dtypes and shapes.
pub(crate) fn check_tensors(
    meta: &Metadata,
    specs: &[FieldSpec],
    rows: u64,
    path: &Path,
) -> Result<Vec<usize>> {
    let tensors = meta.tensors();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let want: Vec<&str> = specs.iter().map(|s| s.name).collect();
    if names.iter().map(|s| s.as_str()).ne(want.iter().copied()) {
        return Err(Error::format(
            path,
            format!(
                "holds tensors [{}]; this cache's shards hold [{}]",
                names
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                want.join(", ")
            ),
        ));
    }
    let mut offsets = Vec::with_capacity(specs.len());
    for s in specs {
        let info: &TensorInfo = tensors[s.name];
        let mut shape = vec![rows as usize];
        shape.extend(&s.row);
        if info.dtype != s.dtype || info.shape != shape {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{}` is {} {:?}; expected {} {:?}",
                    s.name, info.dtype, info.shape, s.dtype, shape
                ),
            ));
        }
        offsets.push(info.data_offsets.0);
    }
    Ok(offsets)
}

/// One tensor handed to the safetensors writer: borrowed bytes with a dtype and shape.
pub(crate) struct Tensor<'a> {
    /// The dtype.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// C-order little-endian bytes.
    pub data: &'a [u8],
}

impl View for Tensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` (no metadata) to `path` atomically and durably: the crate writes its
/// bytes into a temporary sibling, which is fsynced, renamed over `path`, and the directory
/// fsynced. The bytes equal Python `safetensors.numpy.save_file` of the same arrays.
pub(crate) fn write_safetensors(path: &Path, tensors: Vec<(&str, Tensor<'_>)>) -> Result<()> {
    write_safetensors_then(path, tensors, |tmp| fsutil::publish(tmp, path))
}

/// Writes a shard of `rows` samples at `path`: one tensor a field of `specs`, its rows' bytes
/// in `bufs` (same order), shaped `[rows, ..spec.row]` (the single and the part writers').
pub(crate) fn write_shard_rows(
    path: &Path,
    specs: &[FieldSpec],
    bufs: &[Vec<u8>],
    rows: usize,
) -> Result<()> {
    let tensors = specs
        .iter()
        .zip(bufs)
        .map(|(spec, buf)| {
            let mut shape = vec![rows];
            shape.extend(&spec.row);
            let data = buf.as_slice();
            (
                spec.name,
                Tensor {
                    dtype: spec.dtype,
                    shape,
                    data,
                },
            )
        })
        .collect();
    write_safetensors(path, tensors)
}

/// [`write_safetensors`] with `publish(tmp)` renaming the finished, fsynced temporary into
/// place (and doing what must come just before or after that rename).
pub(crate) fn write_safetensors_then(
    path: &Path,
    tensors: Vec<(&str, Tensor<'_>)>,
    publish: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let result = (|| {
        safetensors::serialize_to_file(tensors, None, &tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(io) => Error::io(&tmp, io),
            e => st_err(&tmp, e),
        })?;
        let f = File::open(&tmp).at(&tmp)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // The crate's temporary file is 0600; a cache is meant to be shared.
            f.set_permissions(std::fs::Permissions::from_mode(0o644))
                .at(&tmp)?;
        }
        fsutil::sync_file(&f, &tmp)?;
        drop(f);
        publish(&tmp)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_temporaries() {
        assert_eq!(shard_name(7), "shard-000007.safetensors");
        assert_eq!(shard_name(999_999), "shard-999999.safetensors");
        assert_eq!(shard_index("shard-000007.safetensors"), Some(7));
        assert_eq!(shard_index(&shard_name(1_000_000)), None, "7 digits");
        for name in [
            "shard-000001.safetensors.tmp",
            ".tmpAbC123",
            "shard-00001.safetensors",
            "shard-0000001.safetensors",
            "shard-00000a.safetensors",
        ] {
            assert_eq!(shard_index(name), None, "{name}");
        }
        assert!(is_temporary("shard-000001.safetensors.tmp"));
        assert!(is_temporary(".tmpAbC123"));
        assert!(!is_temporary(".tmpAbC12"));
        assert!(!is_temporary("shard-000001.safetensors"));
    }

    #[test]
    fn shard_set_problems_name_the_files() {
        let set: BTreeSet<u64> = [0, 2].into();
        let p = shard_set_problem(&set, 3).unwrap();
        assert!(p.contains("missing shard-000001.safetensors"), "{p}");
        let set: BTreeSet<u64> = [0, 1, 2, 3].into();
        let p = shard_set_problem(&set, 3).unwrap();
        assert!(p.contains("unexpected shard-000003.safetensors"), "{p}");
        assert!(shard_set_problem(&[0, 1].into(), 2).is_none());
        assert!(shard_set_problem(&BTreeSet::new(), 0).is_none());
    }
}
