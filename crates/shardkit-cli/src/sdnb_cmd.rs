//! `shardkit sdnb ...`: SameDiff containers (Deeplearning4j SDNB, shard sets, SDZ).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use memmap2::Mmap;
use shardkit::json::{self, Escape, Value};
use shardkit::sdnb::{self, DType, Format, Kind, Order, SaveOptions, Storage, TensorIn, VarType};
use shardkit::{fsutil, Error, Result};

use crate::npy::{self, RawNpy};

/// The safetensors `__metadata__` key holding each variable's type (unpack → pack keeps them).
const VAR_TYPES_KEY: &str = "shardkit.sdnb.var_types";
/// The index `unpack --npy` writes beside the arrays.
const INDEX_FILE: &str = "sdnb-index.json";

/// Subcommands of `shardkit sdnb`.
#[derive(Subcommand)]
pub enum SdnbCmd {
    /// Open a container, checking its structure; with --deep also every byte against its
    /// checksums sidecar (NAME.checksums.json; a shard set's: BASE.shard-set.checksums.json).
    Validate {
        /// An .sdnb file, an .sdz archive, a shard file, a shard set's base name, or a native
        /// runtime bundle (a directory with manifest.json, or the manifest). Notes say what
        /// would keep Deeplearning4j's native runtime from loading it.
        file: PathBuf,
        /// Check every byte against the checksums sidecar.
        #[arg(long)]
        deep: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Hash the container's files into its sidecar beside it (NAME.checksums.json, or
    /// BASE.shard-set.checksums.json for a shard set).
    Checksum {
        /// An .sdnb file, an .sdz archive, a shard file or a shard set's base name.
        path: PathBuf,
    },
    /// List metadata, ops and variables (type, dtype, shape, storage, bytes); text, or JSON
    /// with --json.
    Inspect {
        /// An .sdnb file, an .sdz archive, a shard file or a shard set's base name.
        file: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a container from a .safetensors file or a directory of .npy/.safetensors files.
    Pack(PackArgs),
    /// Write every array of a container to a .safetensors file (or .npy files with --npy).
    Unpack {
        /// The container.
        file: PathBuf,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// One .npy per array (kept in its stored order, dtype recorded in sdnb-index.json).
        #[arg(long)]
        npy: bool,
        /// Replace files already in the output directory.
        #[arg(long)]
        force: bool,
    },
    /// Read or edit the key/value metadata.
    #[command(subcommand)]
    Meta(MetaCmd),
    /// Rewrite a container as single SDNB, shard set or SDZ, keeping ops and every byte.
    Convert {
        /// The source container.
        input: PathBuf,
        /// The destination (.sdz for an archive; with --shard-size, the shard set's base).
        output: PathBuf,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Replace an existing destination.
        #[arg(long)]
        force: bool,
    },
    /// Decode a manifest (raw Java-serialized bytes, or an SDNB file's) and check that
    /// shardkit re-encodes it byte for byte; prints JSON (interop checks).
    #[command(hide = true)]
    Manifest {
        /// A raw manifest or an SDNB file.
        file: PathBuf,
        /// Write shardkit's encoding of the entries here.
        #[arg(long)]
        encode_to: Option<PathBuf>,
    },
}

/// `shardkit sdnb meta ...`.
#[derive(Subcommand)]
pub enum MetaCmd {
    /// Print all metadata as JSON, or one value.
    Get {
        /// The container.
        file: PathBuf,
        /// Print only this key's value (exit status 1 when absent).
        key: Option<String>,
    },
    /// Set (k=v) or remove (--unset k) keys, in place inside the reserved slack.
    Set {
        /// The container.
        file: PathBuf,
        /// key=value pairs.
        pairs: Vec<String>,
        /// Keys to remove.
        #[arg(long)]
        unset: Vec<String>,
        /// When the edit does not fit, rewrite the whole container atomically instead of
        /// refusing.
        #[arg(long)]
        rewrite: bool,
    },
}

/// Layout options shared by pack and convert.
#[derive(Args)]
pub struct LayoutArgs {
    /// sdnb, sharded or sdz (default: sdz for .sdz, sharded with --shard-size, else sdnb).
    #[arg(long)]
    format: Option<Format>,
    /// Shard size cap in bytes (suffixes K, M, G, KiB, MiB, GiB); writes a shard set.
    #[arg(long, value_parser = parse_bytes)]
    shard_size: Option<u64>,
    /// Blob alignment in bytes (power of two, 8 to 32768).
    #[arg(long, default_value_t = SaveOptions::default().align)]
    align: u64,
    /// Zero slack after the graph for in-place metadata edits, in bytes.
    #[arg(long, value_parser = parse_bytes, default_value = "65536")]
    slack: u64,
    /// Metadata key=value (repeatable); overrides the source's.
    #[arg(long = "meta")]
    meta: Vec<String>,
    /// Also write manifest.json beside the output (one .sdz or .sdnb file), making its
    /// directory a bundle of Deeplearning4j's native runtime (sdxLoadBundle).
    #[arg(long)]
    bundle: bool,
}

/// `shardkit sdnb pack`.
#[derive(Args)]
pub struct PackArgs {
    /// A .safetensors file, or a directory of .npy and .safetensors files (an `unpack`
    /// output directory restores names, dtypes and variable types from its index).
    #[arg(long)]
    from: PathBuf,
    /// The container to write (.sdnb, .sdz, or a shard set's base with --shard-size).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    layout: LayoutArgs,
    /// Store these variables as CONSTANT instead of VARIABLE (repeatable).
    #[arg(long)]
    constant: Vec<String>,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
}

pub fn run(cmd: SdnbCmd) -> Result<bool> {
    match cmd {
        SdnbCmd::Checksum { path } => crate::checksum_cmd::checksum(&path),
        SdnbCmd::Validate { file, deep, json } => Ok(crate::checksum_cmd::print_report(
            &shardkit::sdnb::validate(&file, deep),
            json,
            deep,
        )),
        SdnbCmd::Inspect { file, json } => inspect(&file, json),
        SdnbCmd::Pack(a) => pack(a),
        SdnbCmd::Unpack {
            file,
            out,
            npy,
            force,
        } => unpack(&file, &out, npy, force),
        SdnbCmd::Meta(MetaCmd::Get { file, key }) => {
            let c = sdnb::open(&file)?;
            match key {
                Some(k) => match c
                    .metadata()
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v)
                {
                    Some(v) => {
                        println!("{v}");
                        Ok(true)
                    }
                    None => {
                        eprintln!("{}: no metadata key {k:?}", file.display());
                        Ok(false)
                    }
                },
                None => {
                    println!(
                        "{}",
                        json::to_pretty(&meta_json(c.metadata()), 2, Escape::Utf8)
                    );
                    Ok(true)
                }
            }
        }
        SdnbCmd::Meta(MetaCmd::Set {
            file,
            pairs,
            unset,
            rewrite,
        }) => {
            let mut changes: Vec<(String, Option<String>)> = parse_pairs(&pairs)?
                .into_iter()
                .map(|(k, v)| (k, Some(v)))
                .collect();
            changes.extend(unset.into_iter().map(|k| (k, None)));
            if changes.is_empty() {
                return Err(Error::Invalid(
                    "nothing to change: give key=value or --unset".into(),
                ));
            }
            let out = sdnb::set_metadata(&file, &changes, rewrite)?;
            let how = if out.in_place {
                "in place (graph region only)"
            } else {
                "by a full atomic rewrite"
            };
            eprintln!("updated {} file(s) {how}", out.files.len());
            Ok(true)
        }
        SdnbCmd::Convert {
            input,
            output,
            layout,
            force,
        } => {
            let c = sdnb::open(&input)?;
            let mut opts = save_options(&layout, &output)?;
            refuse_existing(&output, force, &opts)?;
            if matches!(c.kind(), Kind::Sdz { .. })
                && opts.format != Format::Sdz
                && !c.extra_entries().is_empty()
            {
                eprintln!(
                    "note: the archive's other entries ({}) have no place outside an SDZ and \
                     are not copied",
                    c.extra_entries().join(", ")
                );
            }
            let bar = with_bar(&mut opts);
            let files = sdnb::convert(&c, &output, &opts);
            bar.finish_and_clear();
            let files = files?;
            report_written(&files);
            Ok(true)
        }
        SdnbCmd::Manifest { file, encode_to } => manifest_check(&file, encode_to.as_deref()),
    }
}

/// "1GiB", "512M", "4096" → bytes.
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a byte count: {s:?}"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("{s:?} overflows"))
}

fn parse_pairs(pairs: &[String]) -> Result<Vec<(String, String)>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| Error::Invalid(format!("expected key=value, got {p:?}")))
        })
        .collect()
}

fn save_options(l: &LayoutArgs, out: &Path) -> Result<SaveOptions> {
    Ok(SaveOptions {
        format: l.format.unwrap_or_else(|| Format::infer(out, l.shard_size)),
        shard_size: l.shard_size,
        align: l.align,
        slack: l.slack,
        metadata: parse_pairs(&l.meta)?,
        extra_entries: Vec::new(),
        bundle: l.bundle,
        progress: None,
    })
}

/// A byte progress bar on a terminal (hidden otherwise), fed by the writer.
fn with_bar(opts: &mut SaveOptions) -> indicatif::ProgressBar {
    let bar = crate::progress::bar(Some(0), "writing", crate::progress::Unit::Bytes);
    let feed = bar.clone();
    opts.progress = Some(std::sync::Arc::new(move |done, total| {
        feed.set_length(total);
        feed.set_position(done);
    }));
    bar
}

/// Output paths are replaced only with --force (the write itself is atomic either way).
fn refuse_existing(out: &Path, force: bool, opts: &SaveOptions) -> Result<()> {
    if force {
        return Ok(());
    }
    match opts.existing(out)? {
        Some(p) => Err(Error::Exists {
            path: p,
            why: "already exists; pass --force to replace it".into(),
        }),
        None => Ok(()),
    }
}

fn report_written(files: &[PathBuf]) {
    for f in files {
        let n = fsutil::regular_file_len(f).unwrap_or(0);
        eprintln!("wrote {} ({n} bytes)", f.display());
    }
}

fn meta_json(m: &[(String, String)]) -> Value {
    Value::Object(
        m.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect(),
    )
}

fn shape_json(s: &Option<Vec<i64>>) -> Value {
    match s {
        None => Value::Null,
        Some(d) => Value::Array(d.iter().map(|&x| Value::int(x)).collect()),
    }
}

fn inspect(file: &Path, as_json: bool) -> Result<bool> {
    let c = sdnb::open(file)?;
    let kind = c.kind().to_string();
    let shards = match c.kind() {
        Kind::Sdnb => 1,
        Kind::Sharded { shards } | Kind::Sdz { shards } => shards,
    };
    if as_json {
        let vars = c
            .variables()
            .iter()
            .map(|v| {
                Value::Object(vec![
                    ("name".into(), Value::String(v.name.clone())),
                    ("var_type".into(), Value::String(v.var_type.to_string())),
                    ("dtype".into(), Value::String(v.dtype.to_string())),
                    ("shape".into(), shape_json(&v.shape)),
                    ("storage".into(), Value::String(v.storage.to_string())),
                    ("bytes".into(), Value::int(v.byte_len)),
                    (
                        "order".into(),
                        Value::String(if v.order == Order::F { "f" } else { "c" }.into()),
                    ),
                ])
            })
            .collect();
        let parts = c
            .layout()
            .iter()
            .map(|p| {
                Value::Object(vec![
                    ("name".into(), Value::String(p.name.display().to_string())),
                    ("bytes".into(), Value::int(p.bytes)),
                    ("graph_bytes".into(), Value::int(p.graph_bytes)),
                    ("blob_start".into(), Value::int(p.blob_start)),
                    ("manifest_offset".into(), Value::int(p.manifest_offset)),
                    ("manifest_bytes".into(), Value::int(p.manifest_bytes)),
                    (
                        "manifest_entries".into(),
                        Value::int(p.manifest_entries as u64),
                    ),
                ])
            })
            .collect();
        let v = Value::Object(vec![
            ("path".into(), Value::String(c.path().display().to_string())),
            ("kind".into(), Value::String(kind)),
            ("shards".into(), Value::int(shards as u64)),
            ("ops".into(), Value::int(c.op_count() as u64)),
            ("metadata".into(), meta_json(c.metadata())),
            ("variables".into(), Value::Array(vars)),
            (
                "updater_state".into(),
                Value::Array(c.updater_params().into_iter().map(Value::String).collect()),
            ),
            (
                "extra_entries".into(),
                Value::Array(
                    c.extra_entries()
                        .iter()
                        .map(|e| Value::String(e.to_string()))
                        .collect(),
                ),
            ),
            ("parts".into(), Value::Array(parts)),
        ]);
        println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
        return Ok(true);
    }
    let total: u64 = c.variables().iter().map(|v| v.byte_len).sum();
    println!(
        "{}: {kind}{}, {} variables, {} ops, {total} bytes of arrays",
        c.path().display(),
        if shards > 1 {
            format!(" ({shards} shards)")
        } else {
            String::new()
        },
        c.variables().len(),
        c.op_count()
    );
    if !c.extra_entries().is_empty() {
        println!("other entries: {}", c.extra_entries().join(", "));
    }
    println!("metadata:");
    for (k, v) in c.metadata() {
        println!("  {k} = {v}");
    }
    println!(
        "{:<40} {:<11} {:<9} {:<20} {:<8} {:>12}",
        "name", "type", "dtype", "shape", "storage", "bytes"
    );
    for v in c.variables() {
        let shape = match &v.shape {
            None => "unknown".to_string(),
            Some(s) => format!("{s:?}"),
        };
        let order = if v.order == Order::F { " (f)" } else { "" };
        println!(
            "{:<40} {:<11} {:<9} {:<20} {:<8} {:>12}",
            v.name,
            v.var_type,
            v.dtype,
            shape + order,
            v.storage,
            v.byte_len
        );
    }
    Ok(true)
}

/// One array read for packing: its bytes stay in the map they came from.
struct Input {
    name: String,
    dtype: DType,
    shape: Vec<i64>,
    order: Order,
    var_type: Option<VarType>,
    /// (map index, byte range)
    source: (usize, std::ops::Range<usize>),
}

fn map_file(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only map of an input file we do not modify.
    unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

/// Reads a safetensors file's tensors and `__metadata__`.
fn read_safetensors(
    path: &Path,
    maps: &mut Vec<Mmap>,
    inputs: &mut Vec<Input>,
    meta: &mut Vec<(String, String)>,
) -> Result<()> {
    let map = map_file(path)?;
    // The library's reader: a short file is "truncated: X of Y bytes", not the crate's words.
    let (hlen, header) = shardkit::eagle3::read_header(&map, path)?;
    let data_start = 8 + hlen;
    let mut var_types: HashMap<String, VarType> = HashMap::new();
    if let Some(m) = header.metadata() {
        let mut keys: Vec<&String> = m.keys().collect();
        keys.sort();
        for k in keys {
            let v = &m[k];
            if k == VAR_TYPES_KEY {
                let parsed = json::parse(v.as_bytes())
                    .map_err(|e| Error::format(path, format!("{VAR_TYPES_KEY}: {e}")))?;
                if let Value::Object(items) = parsed {
                    for (name, t) in items {
                        if let Some(t) = t.as_str() {
                            var_types.insert(name, t.parse()?);
                        }
                    }
                }
            } else {
                meta.push((k.clone(), v.clone()));
            }
        }
    }
    let mut tensors: Vec<(String, &safetensors::tensor::TensorInfo)> =
        header.tensors().into_iter().collect();
    // File order, as stored.
    // Zero-length tensors share their offset with the next one: the name breaks the tie, so
    // the same file always packs to the same bytes.
    tensors.sort_by(|(a, x), (b, y)| {
        (x.data_offsets.0, x.data_offsets.1, a).cmp(&(y.data_offsets.0, y.data_offsets.1, b))
    });
    let k = maps.len();
    for (name, info) in tensors {
        inputs.push(Input {
            dtype: dtype_of_safetensors(info.dtype)
                .map_err(|e| Error::format(path, format!("tensor {name:?}: {e}")))?,
            shape: info.shape.iter().map(|&d| d as i64).collect(),
            order: Order::C,
            var_type: var_types.get(&name).copied(),
            source: (
                k,
                data_start + info.data_offsets.0..data_start + info.data_offsets.1,
            ),
            name,
        });
    }
    maps.push(map);
    Ok(())
}

/// The numpy dtype string of `d`'s bytes ("<f4", "|b1", ...), when numpy has one.
fn numpy_descr(d: DType) -> Option<&'static str> {
    use DType::*;
    Some(match d {
        Bool => "|b1",
        Float8 | Uint8 => "|u1",
        Int8 => "|i1",
        Half => "<f2",
        Float => "<f4",
        Double => "<f8",
        Int16 => "<i2",
        Int32 => "<i4",
        Int64 => "<i8",
        Uint16 | Bfloat16 => "<u2",
        Uint32 => "<u4",
        Uint64 => "<u8",
        _ => return None,
    })
}

/// The safetensors dtype holding the same bytes as `d`, if there is one.
fn safetensors_dtype(d: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    use DType::*;
    Some(match d {
        Bool => S::BOOL,
        Float8 => S::F8_E4M3,
        Half => S::F16,
        Float => S::F32,
        Double => S::F64,
        Int8 => S::I8,
        Int16 => S::I16,
        Int32 => S::I32,
        Int64 => S::I64,
        Uint8 => S::U8,
        Uint16 => S::U16,
        Uint32 => S::U32,
        Uint64 => S::U64,
        Bfloat16 => S::BF16,
        _ => return None,
    })
}

/// The SameDiff type holding the same bytes as a safetensors dtype.
fn dtype_of_safetensors(d: safetensors::Dtype) -> Result<DType> {
    use safetensors::Dtype as S;
    use DType::*;
    Ok(match d {
        S::BOOL => Bool,
        S::F8_E4M3 => Float8,
        S::F16 => Half,
        S::F32 => Float,
        S::F64 => Double,
        S::I8 => Int8,
        S::I16 => Int16,
        S::I32 => Int32,
        S::I64 => Int64,
        S::U8 => Uint8,
        S::U16 => Uint16,
        S::U32 => Uint32,
        S::U64 => Uint64,
        S::BF16 => Bfloat16,
        other => {
            return Err(Error::Invalid(format!(
                "safetensors dtype {other} has no SameDiff DType"
            )))
        }
    })
}

fn dtype_of_descr(descr: &str) -> Option<DType> {
    let d = descr.replace('=', "<");
    Some(match d.as_str() {
        "|b1" => DType::Bool,
        "|u1" | "<u1" | "u1" => DType::Uint8,
        "|i1" | "<i1" | "i1" => DType::Int8,
        "<f2" => DType::Half,
        "<f4" => DType::Float,
        "<f8" => DType::Double,
        "<i2" => DType::Int16,
        "<i4" => DType::Int32,
        "<i8" => DType::Int64,
        "<u2" => DType::Uint16,
        "<u4" => DType::Uint32,
        "<u8" => DType::Uint64,
        _ => return None,
    })
}

fn read_npy(
    path: &Path,
    name: String,
    dtype: Option<DType>,
    var_type: Option<VarType>,
    maps: &mut Vec<Mmap>,
    inputs: &mut Vec<Input>,
) -> Result<()> {
    let raw = RawNpy::open(path)?;
    let natural = dtype_of_descr(&raw.descr).ok_or_else(|| {
        Error::format(
            path,
            format!("numpy dtype {} has no SameDiff DType", raw.descr),
        )
    })?;
    // bf16 and fp8 travel as uint16/uint8 bytes, their type named by the index; any other
    // disagreement (FLOAT for an int32 array) would reinterpret the bits, and is refused.
    let dtype = match dtype {
        Some(d)
            if d == natural
                || (natural == DType::Uint16 && d == DType::Bfloat16)
                || (natural == DType::Uint8 && d == DType::Float8) =>
        {
            d
        }
        Some(d) => {
            return Err(Error::format(
                path,
                format!("holds {} but the index says {}", raw.descr, d),
            ))
        }
        None => natural,
    };
    let shape = raw.shape.iter().map(|&d| d as i64).collect();
    let order = if raw.fortran { Order::F } else { Order::C };
    let (map, range) = raw.into_parts();
    inputs.push(Input {
        name,
        dtype,
        shape,
        order,
        var_type,
        source: (maps.len(), range),
    });
    maps.push(map);
    Ok(())
}

fn pack(a: PackArgs) -> Result<bool> {
    let mut opts = save_options(&a.layout, &a.out)?;
    refuse_existing(&a.out, a.force, &opts)?;
    let mut maps = Vec::new();
    let mut inputs = Vec::new();
    let mut meta = Vec::new();
    if a.from.is_dir() {
        let index = a.from.join(INDEX_FILE);
        if index.exists() {
            let text = std::fs::read(&index).map_err(|e| Error::io(&index, e))?;
            let v = json::parse(&text).map_err(|e| Error::format(&index, e.to_string()))?;
            if let Some(Value::Object(m)) = v.get("metadata") {
                for (k, val) in m {
                    let text = val.as_str().ok_or_else(|| {
                        Error::format(
                            &index,
                            format!(
                                "metadata {k:?} is not a string (SameDiff metadata maps \
                                 strings to strings)"
                            ),
                        )
                    })?;
                    meta.push((k.clone(), text.to_string()));
                }
            }
            let Some(Value::Array(arrays)) = v.get("arrays") else {
                return Err(Error::format(&index, "no \"arrays\" list"));
            };
            for item in arrays {
                let field = |k: &str| {
                    item.get(k)
                        .and_then(Value::as_str)
                        .ok_or_else(|| Error::format(&index, format!("an array lacks {k:?}")))
                };
                let file = field("file")?;
                if file.contains('/') || file.starts_with('.') {
                    return Err(Error::format(
                        &index,
                        format!("file name {file:?} leaves the directory"),
                    ));
                }
                read_npy(
                    &a.from.join(file),
                    field("name")?.to_string(),
                    Some(field("dtype")?.parse()?),
                    Some(field("var_type")?.parse()?),
                    &mut maps,
                    &mut inputs,
                )?;
            }
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&a.from)
                .map_err(|e| Error::io(&a.from, e))?
                .flatten()
                .map(|e| e.path())
                .collect();
            files.sort();
            for f in files {
                match f.extension().and_then(|e| e.to_str()) {
                    Some("npy") => {
                        let name = f
                            .file_stem()
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_default();
                        read_npy(&f, name, None, None, &mut maps, &mut inputs)?;
                    }
                    Some("safetensors") => read_safetensors(&f, &mut maps, &mut inputs, &mut meta)?,
                    _ => {}
                }
            }
            if inputs.is_empty() {
                return Err(Error::format(
                    &a.from,
                    "holds no .npy or .safetensors files",
                ));
            }
        }
    } else {
        read_safetensors(&a.from, &mut maps, &mut inputs, &mut meta)?;
    }
    for c in &a.constant {
        if !inputs.iter().any(|i| &i.name == c) {
            let mut names: Vec<&str> = inputs.iter().map(|i| i.name.as_str()).collect();
            names.sort_unstable();
            let more = names.len().saturating_sub(20);
            names.truncate(20);
            return Err(Error::Invalid(format!(
                "--constant {c:?}: no such tensor in {}; its tensors are {}{}",
                a.from.display(),
                names
                    .iter()
                    .map(|n| format!("{n:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )));
        }
    }
    // Command-line metadata overrides the input's.
    for (k, v) in std::mem::take(&mut opts.metadata) {
        meta.retain(|(mk, _)| mk != &k);
        meta.push((k, v));
    }
    opts.metadata = meta;
    let tensors: Vec<TensorIn> = inputs
        .iter()
        .map(|i| TensorIn {
            name: i.name.clone(),
            var_type: if a.constant.contains(&i.name) {
                VarType::Constant
            } else {
                i.var_type.unwrap_or(VarType::Variable)
            },
            dtype: i.dtype,
            shape: i.shape.clone(),
            order: i.order,
            bytes: &maps[i.source.0][i.source.1.clone()],
        })
        .collect();
    let bar = with_bar(&mut opts);
    let files = sdnb::save(&a.out, &tensors, &opts);
    bar.finish_and_clear();
    let files = files?;
    report_written(&files);
    Ok(true)
}

/// A file name for a variable: its name with `/`, `\`, `%` and a leading `.` escaped.
fn file_stem_for(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for (i, c) in name.chars().enumerate() {
        match c {
            '/' | '\\' | '%' | '\0' => out.push_str(&format!("%{:02X}", c as u32)),
            '.' if i == 0 => out.push_str("%2E"),
            c => out.push(c),
        }
    }
    out
}

/// A tensor on its way to safetensors: name, dtype, shape, C-order bytes.
type Unpacked<'a> = (
    String,
    safetensors::Dtype,
    Vec<usize>,
    std::borrow::Cow<'a, [u8]>,
);

fn unpack(file: &Path, out: &Path, as_npy: bool, force: bool) -> Result<bool> {
    let c = sdnb::open(file)?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let with_data: Vec<&sdnb::Variable> = c
        .variables()
        .iter()
        .filter(|v| v.storage != Storage::None)
        .collect();
    let skipped = c.variables().len() - with_data.len();
    let mut var_types = Vec::new();
    if as_npy {
        let index_path = out.join(INDEX_FILE);
        if index_path.exists() && !force {
            return Err(Error::Exists {
                path: index_path,
                why: "already exists; pass --force to replace the unpacked arrays".into(),
            });
        }
        let mut arrays = Vec::new();
        let mut used = std::collections::HashSet::new();
        for v in &with_data {
            let t = c.tensor(&v.name)?;
            let mut stem = file_stem_for(&v.name);
            while !used.insert(stem.to_lowercase()) {
                stem.push('_');
            }
            let fname = format!("{stem}.npy");
            let descr = numpy_descr(v.dtype).ok_or_else(|| {
                Error::Invalid(format!(
                    "variable {:?} cannot be unpacked: {} has no numpy dtype (only fixed-width \
                     numbers and booleans unpack); keep the container for it",
                    v.name, v.dtype
                ))
            })?;
            let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
            let mut bytes = npy::header_with(descr, t.order == Order::F, &shape);
            bytes.extend_from_slice(t.bytes);
            fsutil::atomic_write(&out.join(&fname), &bytes)?;
            arrays.push(Value::Object(vec![
                ("name".into(), Value::String(v.name.clone())),
                ("file".into(), Value::String(fname)),
                ("dtype".into(), Value::String(v.dtype.to_string())),
                ("var_type".into(), Value::String(v.var_type.to_string())),
            ]));
        }
        let index = Value::Object(vec![
            (
                "source".into(),
                Value::String(c.path().display().to_string()),
            ),
            ("metadata".into(), meta_json(c.metadata())),
            ("arrays".into(), Value::Array(arrays)),
        ]);
        fsutil::atomic_write(
            &index_path,
            json::to_pretty(&index, 2, Escape::Utf8).as_bytes(),
        )?;
        eprintln!(
            "wrote {} .npy files and {INDEX_FILE} to {}",
            with_data.len(),
            out.display()
        );
    } else {
        let target = out.join("model.safetensors");
        if target.exists() && !force {
            return Err(Error::Exists {
                path: target,
                why: "already exists; pass --force to replace it".into(),
            });
        }
        let mut owned: Vec<Unpacked> = Vec::new();
        for v in &with_data {
            let t = c.tensor(&v.name)?;
            let dt = safetensors_dtype(v.dtype).ok_or_else(|| {
                Error::Invalid(format!(
                    "variable {:?} cannot be unpacked: {} has no safetensors dtype (only \
                     fixed-width numbers and booleans unpack); keep the container for it",
                    v.name, v.dtype
                ))
            })?;
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            owned.push((v.name.clone(), dt, shape, t.c_order_bytes()));
            var_types.push((v.name.clone(), Value::String(v.var_type.to_string())));
        }
        let views = owned
            .iter()
            .map(|(n, dt, shape, bytes)| {
                safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)
                    .map(|view| (n.clone(), view))
                    .map_err(|source| Error::Safetensors {
                        path: target.clone(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta: HashMap<String, String> = c.metadata().iter().cloned().collect();
        meta.insert(
            VAR_TYPES_KEY.into(),
            json::to_compact(&Value::Object(var_types), false, Escape::Utf8),
        );
        let tmp = fsutil::temp_sibling(&target);
        safetensors::tensor::serialize_to_file(views, Some(meta), &tmp).map_err(|source| {
            Error::Safetensors {
                path: tmp.clone(),
                source,
            }
        })?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(&tmp, e))?;
        fsutil::publish(&tmp, &target)?;
        eprintln!(
            "wrote {} arrays to {} (metadata in __metadata__)",
            with_data.len(),
            target.display()
        );
    }
    if skipped > 0 {
        eprintln!(
            "note: {skipped} variables without arrays (placeholders, op outputs) and the ops \
             are not part of an unpacked copy; use `shardkit sdnb convert` to keep the graph"
        );
    }
    Ok(true)
}

fn manifest_check(file: &Path, encode_to: Option<&Path>) -> Result<bool> {
    let bytes = std::fs::read(file).map_err(|e| Error::io(file, e))?;
    let (entries, again, same) = sdnb::manifest_round_trip(&bytes, file)?;
    if let Some(p) = encode_to {
        fsutil::atomic_write(p, &again)?;
    }
    let v = Value::Object(vec![
        (
            "entries".into(),
            Value::Array(
                entries
                    .iter()
                    .map(|(name, offset, length)| {
                        Value::Object(vec![
                            ("name".into(), Value::String(name.clone())),
                            ("offset".into(), Value::int(*offset)),
                            ("length".into(), Value::int(*length)),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("reencodes_identically".into(), Value::Bool(same)),
    ]);
    println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
    Ok(same)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("3M").unwrap(), 3 << 20);
        assert_eq!(
            parse_bytes("1XB").unwrap_err(),
            r#"unknown size unit "xb" in "1XB""#
        );
        assert_eq!(file_stem_for("layer0/W"), "layer0%2FW");
        assert_eq!(file_stem_for(".hidden"), "%2Ehidden");
    }
}
