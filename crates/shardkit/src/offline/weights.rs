//! The target weights beside a cache's shards, one safetensors file of 2-D tables `[V, H]`:
//!
//! * EAGLE-3: `target_embeddings.safetensors`, one tensor `weight`, float32;
//! * DSpark: `target_weights.safetensors`, `embed_tokens.weight` and `lm_head.weight` in the
//!   cache dtype (float32 before NeMo passed the dtype to `write_target_weights`, so a reader
//!   takes any float dtype).
//!
//! The file is written whole through a temporary and a rename, and read mapped (or fetched
//! whole from a store). Its header is checked once, when it is opened.

use std::path::Path;

use memmap2::Mmap;
use safetensors::Dtype;

use super::manifest::{Layout, Manifest};
use super::shard::{self, Tensor};
use crate::checksum::FileSums;
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::io::{self, Source};
use crate::json::Value;

/// One table of the weights file to write: `rows × cols` little-endian values of the file's
/// dtype ([`table_dtype`]).
#[derive(Debug, Clone, Copy)]
pub struct WeightTable<'a> {
    /// The tensor name (`weight`; `embed_tokens.weight`, `lm_head.weight`).
    pub name: &'a str,
    /// Vocabulary rows.
    pub rows: u64,
    /// Hidden size.
    pub cols: u64,
    /// The values' bytes.
    pub data: &'a [u8],
}

/// The dtype shardkit writes the tables of `m`'s cache in: float32 for EAGLE-3, the cache
/// dtype for DSpark (as NeMo's current `write_target_weights`).
pub(crate) fn table_dtype(m: &Manifest) -> Dtype {
    match m.layout {
        Layout::Eagle3(_) => Dtype::F32,
        Layout::DSpark(_) => m.dtype,
    }
}

/// Checks tables to write against the manifest `m`: exactly the member's tensor names, each of
/// `rows × cols` values, and a width matching the hidden size the manifest records.
pub(crate) fn check_tables(m: &Manifest, tables: &[WeightTable<'_>]) -> Result<()> {
    let schema = m.schema();
    let file = schema.weights_file();
    let mut names: Vec<&str> = tables.iter().map(|t| t.name).collect();
    names.sort_unstable();
    if names != schema.weight_tensors() {
        return Err(Error::Invalid(format!(
            "{file} holds {:?}; {} caches store exactly {:?}",
            names,
            schema.title(),
            schema.weight_tensors()
        )));
    }
    let dtype = table_dtype(m);
    for t in tables {
        let want = t
            .rows
            .checked_mul(t.cols)
            .and_then(|e| e.checked_mul(dtype.bitsize() as u64 / 8))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{file}: `{}` of {} x {} overflows",
                    t.name, t.rows, t.cols
                ))
            })?;
        if t.data.len() as u64 != want {
            return Err(Error::Invalid(format!(
                "{file}: `{}`: {} bytes given; {} x {} {} need {want}",
                t.name,
                t.data.len(),
                t.rows,
                t.cols,
                match dtype {
                    Dtype::BF16 => "bfloat16",
                    Dtype::F16 => "float16",
                    _ => "float32",
                }
            )));
        }
        check_width(m, t.name, t.cols).map_err(|rule| Error::Invalid(format!("{file}: {rule}")))?;
    }
    Ok(())
}

/// A table's width against the hidden size `m` records.
fn check_width(m: &Manifest, name: &str, cols: u64) -> std::result::Result<(), String> {
    match &m.layout {
        Layout::Eagle3(l) => {
            if let Some(Value::Array(layers)) = m.raw().get("aux_layer_ids") {
                if !layers.is_empty() && cols * layers.len() as u64 != l.aux_hidden_dim {
                    return Err(format!(
                        "`{name}` has {cols} columns; the hidden size is aux_hidden_dim {} / {} \
                         layers",
                        l.aux_hidden_dim,
                        layers.len()
                    ));
                }
            }
            Ok(())
        }
        Layout::DSpark(l) if cols != l.target_last_hidden_dim => Err(format!(
            "`{name}` has {cols} columns; the hidden size is target_last_hidden_dim {}",
            l.target_last_hidden_dim
        )),
        Layout::DSpark(_) => Ok(()),
    }
}

/// The tables as tensors for `save_file`.
pub(crate) fn tensors<'a>(m: &Manifest, tables: &[WeightTable<'a>]) -> Vec<(&'a str, Tensor<'a>)> {
    let dtype = table_dtype(m);
    tables
        .iter()
        .map(|t| {
            (
                t.name,
                Tensor {
                    dtype,
                    shape: vec![t.rows as usize, t.cols as usize],
                    data: t.data,
                },
            )
        })
        .collect()
}

/// Writes the weights file of the cache at `dir`, replacing any previous one by rename, and
/// keeps a finished cache's checksum sidecar true.
pub(crate) fn write(dir: &Path, m: &Manifest, tables: &[WeightTable<'_>]) -> Result<()> {
    check_tables(m, tables)?;
    std::fs::create_dir_all(dir).at(dir)?;
    let name = m.schema().weights_file();
    let path = dir.join(name);
    shard::write_safetensors_then(&path, tensors(m, tables), |tmp| {
        // The new file (hashed from its temporary, still in the page cache) is accepted beside
        // the old one (or its absence) before the rename, and alone after it (see
        // crate::checksum::Change).
        let sidecar = dir.join(crate::checksum::SIDECAR);
        let change = crate::checksum::Change::begin(&sidecar, dir, |_| {
            Ok(vec![(name.to_string(), FileSums::of_file(tmp)?)])
        })?;
        fsutil::publish(tmp, &path)?;
        change.map_or(Ok(()), crate::checksum::Change::commit)
    })
}

/// Whether the weights file at `path` holds exactly `tables` (which, written, give the same
/// bytes: serialisation is deterministic).
pub(crate) fn file_holds(path: &Path, m: &Manifest, tables: &[WeightTable<'_>]) -> Result<bool> {
    let Ok(file) = std::fs::File::open(path) else {
        return Ok(false);
    };
    // SAFETY: a finished file, replaced only by rename (never written in place).
    let map = unsafe { Mmap::map(&file) }.at(path)?;
    Ok(bytes_hold(&map, m, tables))
}

/// [`file_holds`] of a file's bytes.
pub(crate) fn bytes_hold(bytes: &[u8], m: &Manifest, tables: &[WeightTable<'_>]) -> bool {
    let Ok(st) = safetensors::SafeTensors::deserialize(bytes) else {
        return false;
    };
    let dtype = table_dtype(m);
    st.names().len() == tables.len()
        && tables.iter().all(|t| {
            st.tensor(t.name).is_ok_and(|x| {
                x.dtype() == dtype
                    && x.shape() == [t.rows as usize, t.cols as usize]
                    && x.data() == t.data
            })
        })
}

/// The weights file's bytes: mapped, or fetched from an object store.
enum WeightBytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl WeightBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            WeightBytes::Map(m) => m,
            WeightBytes::Owned(v) => v,
        }
    }
}

/// One table of an opened weights file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightInfo {
    /// The tensor name.
    pub name: String,
    /// Its dtype (F32 for EAGLE-3; BF16, F16 or F32 for DSpark).
    pub dtype: Dtype,
    /// Vocabulary rows.
    pub rows: usize,
    /// Hidden size.
    pub cols: usize,
    /// Where its bytes start in the file.
    start: usize,
}

/// The target weights of a cache (mapped, or fetched from an object store), checked.
pub struct Weights {
    map: WeightBytes,
    tables: Vec<WeightInfo>,
    /// The first table's rows (EAGLE-3: the embedding table's vocabulary rows).
    pub rows: usize,
    /// The first table's columns (the hidden size).
    pub cols: usize,
}

/// EAGLE-3's name for its one table.
pub type Embeddings = Weights;

impl Weights {
    /// The tables, in name order.
    pub fn tables(&self) -> &[WeightInfo] {
        &self.tables
    }

    /// The bytes of table `name` (little-endian, `rows × cols` of its dtype).
    pub fn table(&self, name: &str) -> Option<&[u8]> {
        let t = self.tables.iter().find(|t| t.name == name)?;
        let len = t.rows * t.cols * t.dtype.bitsize() / 8;
        self.map.as_slice().get(t.start..t.start + len)
    }

    /// The first table's bytes (EAGLE-3: `weight`, F32 little-endian, `rows × cols`).
    pub fn bytes(&self) -> &[u8] {
        self.tables
            .first()
            .and_then(|t| self.table(&t.name))
            .unwrap_or(&[])
    }
}

/// Maps and checks the weights file of the cache `m` at `dir`.
pub(crate) fn open(dir: &Path, m: &Manifest) -> Result<Weights> {
    let path = dir.join(m.schema().weights_file());
    let file = fsutil::open_regular(&path)?;
    // SAFETY: written only by rename (never in place), see `ShardFile::open`.
    let map = unsafe { Mmap::map(&file) }.at(&path)?;
    weights_in(WeightBytes::Map(map), m, &path)
}

/// Fetches (whole, with parallel ranged GETs) and checks the weights file of the cache `m` in
/// `remote`, whose objects' sizes are `sizes`.
pub(crate) fn fetch(
    remote: &dyn Source,
    sizes: &std::collections::HashMap<String, u64>,
    m: &Manifest,
) -> Result<Weights> {
    let name = m.schema().weights_file();
    let path = remote.path_of(name);
    let Some(&size) = sizes.get(name) else {
        return Err(Error::NotFound {
            path,
            what: "no such object".into(),
        });
    };
    let len = usize::try_from(size).map_err(|_| Error::format(&path, "too large"))?;
    let mut bytes = vec![0u8; len];
    remote.read_ranges(
        &[name.to_string()],
        &[(0, 0, size, 0)],
        &mut bytes,
        &io::Stop::never(),
    )?;
    weights_in(WeightBytes::Owned(bytes), m, &path)
}

/// The tables in `bytes` (a whole safetensors file), checked.
fn weights_in(bytes: WeightBytes, m: &Manifest, path: &Path) -> Result<Weights> {
    let (n, meta) = shard::read_header(bytes.as_slice(), path)?;
    let tables = check_header(&meta, m, path)?
        .into_iter()
        .map(|mut t| {
            t.start += 8 + n;
            t
        })
        .collect::<Vec<_>>();
    let (rows, cols) = tables.first().map_or((0, 0), |t| (t.rows, t.cols));
    Ok(Weights {
        map: bytes,
        tables,
        rows,
        cols,
    })
}

/// Checks the header of the weights file in `remote` (`size` bytes) without fetching the
/// tables (`validate`).
pub(crate) fn check_remote(remote: &dyn Source, m: &Manifest, size: u64) -> Result<()> {
    let name = m.schema().weights_file();
    let never = io::Stop::never();
    let head = shard::remote_head(remote, name, size, &never)?;
    let (_, meta) = shard::remote_header(remote, name, size, head, &never)?;
    check_header(&meta, m, &remote.path_of(name)).map(|_| ())
}

/// The member's tables in a weights file's header: exactly its names, each 2-D, of a float
/// dtype the member allows, as wide as the hidden size the manifest records (DSpark); offsets
/// relative to the data section.
fn check_header(
    meta: &safetensors::tensor::Metadata,
    m: &Manifest,
    path: &Path,
) -> Result<Vec<WeightInfo>> {
    let schema = m.schema();
    let tensors = meta.tensors();
    let mut names: Vec<&str> = tensors.keys().map(String::as_str).collect();
    names.sort_unstable();
    if names != schema.weight_tensors() {
        let want: Vec<String> = schema
            .weight_tensors()
            .iter()
            .map(|n| format!("`{n}`"))
            .collect();
        return Err(Error::format(
            path,
            format!("must hold exactly {}", want.join(" and ")),
        ));
    }
    let mut out = Vec::new();
    for name in schema.weight_tensors() {
        let info = tensors[*name];
        let float = match m.layout {
            Layout::Eagle3(_) => info.dtype == Dtype::F32,
            Layout::DSpark(_) => matches!(info.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32),
        };
        if !float || info.shape.len() != 2 {
            return Err(Error::format(
                path,
                format!(
                    "`{name}` is {} {:?}; expected {} [vocab_rows, hidden]",
                    info.dtype,
                    info.shape,
                    match m.layout {
                        Layout::Eagle3(_) => "F32",
                        Layout::DSpark(_) => "BF16, F16 or F32",
                    }
                ),
            ));
        }
        if let Layout::DSpark(_) = m.layout {
            check_width(m, name, info.shape[1] as u64).map_err(|rule| Error::format(path, rule))?;
        }
        out.push(WeightInfo {
            name: name.to_string(),
            dtype: info.dtype,
            rows: info.shape[0],
            cols: info.shape[1],
            start: info.data_offsets.0,
        });
    }
    Ok(out)
}
