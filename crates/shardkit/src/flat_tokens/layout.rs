//! How a writer lays out the two arrays of a new split (flat_tokens.md §9.2).
//!
//! * [`Layout::V2`] is seqax's own layout, so seqax (zarr-python 2.18) reads the result: zarr v2,
//!   blosc lz4 clevel 5 bit-shuffle, 4 Mi-token chunks, and numcodecs' `delta` filter on
//!   `seq_starts` in 64 Ki-entry chunks. Chunk bytes equal zarr-python 2.18's.
//! * [`Layout::V3`] (the default) is zarr v3 with zstd inside shards: a shard is one file, and a
//!   reader decodes only the small inner chunks a row touches, so any row is cheap to read.

use std::num::NonZeroU64;
use std::sync::Arc;

use zarrs::array::codec::ZstdCodec;
use zarrs::array::{data_type, ArrayBuilder, ArrayMetadataOptions};
use zarrs::storage::ReadableWritableStorageTraits;

use crate::error::{Error, Result};
use crate::json::Value;

/// The layout of a split a writer creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// seqax's codecs and chunking in zarr v2 (readable by seqax and zarr-python 2.18 and 3).
    V2,
    /// zarr v3, zstd inside shards, with dimension names (readable by zarr-python 3).
    V3(Sharded),
}

impl Default for Layout {
    fn default() -> Self {
        Layout::V3(Sharded::default())
    }
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Layout> {
        match s {
            "v2" => Ok(Layout::V2),
            "v3" => Ok(Layout::default()),
            _ => Err(Error::Invalid(format!(
                "layout must be \"v2\" (seqax's zarr v2 codecs) or \"v3\" (sharded zstd), got {s:?}"
            ))),
        }
    }
}

/// Shard and chunk sizes of the v3 layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharded {
    /// Tokens per shard file (also what a writer holds in memory): 2^24 (64 MiB) by default.
    pub tokens_per_shard: u64,
    /// Tokens per compressed inner chunk, the unit a reader decodes: 2^11 (8 KiB) by default.
    /// A random packed row decodes every inner chunk it touches, so chunks the size of a
    /// training row (a power of two, 2048 and up) mean each token is decoded once; 2^14-token
    /// chunks made 2048-token rows decode eight times what they use, for 5% less disk.
    pub tokens_per_chunk: u64,
    /// `seq_starts` entries per shard: 2^20 by default.
    pub starts_per_shard: u64,
    /// `seq_starts` entries per inner chunk: 2^13 by default.
    pub starts_per_chunk: u64,
    /// zstd compression level: 3 by default.
    pub zstd_level: i32,
}

impl Default for Sharded {
    fn default() -> Self {
        Sharded {
            tokens_per_shard: 1 << 24,
            tokens_per_chunk: 1 << 11,
            starts_per_shard: 1 << 20,
            starts_per_chunk: 1 << 13,
            zstd_level: 3,
        }
    }
}

impl Sharded {
    fn check(&self) -> Result<()> {
        for (shard, chunk, what) in [
            (self.tokens_per_shard, self.tokens_per_chunk, "tokens"),
            (self.starts_per_shard, self.starts_per_chunk, "starts"),
        ] {
            if chunk == 0 || shard == 0 || shard % chunk != 0 || shard > 1 << 28 {
                return Err(Error::Invalid(format!(
                    "v3 layout: {what}_per_shard ({shard}) must be a positive multiple of \
                     {what}_per_chunk ({chunk}) and at most 2^28"
                )));
            }
        }
        Ok(())
    }
}

/// seqax's chunk lengths (tools/configs/synthetic_dataset.yaml).
pub(crate) const V2_TOKENS_PER_CHUNK: u64 = 1 << 22;
pub(crate) const V2_STARTS_PER_CHUNK: u64 = 1 << 16;

/// The `.zarray` of a new v2 array, as seqax creates it (shape 0 for tokens, 1 for starts),
/// except `fill_value`, which is 0 on both arrays (seqax has `null` on `encoded_tokens`).
pub(crate) fn zarray_v2(tokens: bool) -> Value {
    let blosc = Value::Object(vec![
        ("blocksize".into(), Value::int(0)),
        ("clevel".into(), Value::int(5)),
        ("cname".into(), Value::String("lz4".into())),
        ("id".into(), Value::String("blosc".into())),
        ("shuffle".into(), Value::int(2)),
    ]);
    let (dtype, chunks, shape, filters) = if tokens {
        ("<u4", V2_TOKENS_PER_CHUNK, 0, Value::Null)
    } else {
        let delta = Value::Object(vec![
            ("astype".into(), Value::String("<i8".into())),
            ("dtype".into(), Value::String("<i8".into())),
            ("id".into(), Value::String("delta".into())),
        ]);
        ("<u8", V2_STARTS_PER_CHUNK, 1, Value::Array(vec![delta]))
    };
    Value::Object(vec![
        ("chunks".into(), Value::Array(vec![Value::int(chunks)])),
        ("compressor".into(), blosc),
        // zarr-python 2.18 writes the separator into new arrays.
        ("dimension_separator".into(), Value::String(".".into())),
        ("dtype".into(), Value::String(dtype.into())),
        ("fill_value".into(), Value::int(0)),
        ("filters".into(), filters),
        ("order".into(), Value::String("C".into())),
        ("shape".into(), Value::Array(vec![Value::int(shape)])),
        ("zarr_format".into(), Value::int(2)),
    ])
}

/// Metadata options for every v3 document shardkit writes: no `_zarrs` attribute.
pub(crate) fn metadata_options() -> ArrayMetadataOptions {
    ArrayMetadataOptions::default().with_include_zarrs_metadata(false)
}

/// Creates (stores the metadata of) both arrays of a new v3 split (`root` labels messages).
pub(crate) fn create_v3<S: ?Sized + ReadableWritableStorageTraits + 'static>(
    store: &Arc<S>,
    root: &std::path::Path,
    split: &str,
    l: &Sharded,
) -> Result<()> {
    l.check()?;
    let nz = |v: u64| NonZeroU64::new(v).expect("checked positive");
    for (name, shape, shard, chunk, dim, tokens) in [
        (
            "encoded_tokens",
            0u64,
            l.tokens_per_shard,
            l.tokens_per_chunk,
            "token",
            true,
        ),
        (
            "seq_starts",
            1,
            l.starts_per_shard,
            l.starts_per_chunk,
            "seq",
            false,
        ),
    ] {
        let path = format!("/{split}/{name}");
        let dt = if tokens {
            data_type::uint32()
        } else {
            data_type::uint64()
        };
        let fill = if tokens {
            zarrs::array::FillValue::from(0u32)
        } else {
            zarrs::array::FillValue::from(0u64)
        };
        let array = ArrayBuilder::new(vec![shape], vec![nz(shard)], dt, fill)
            .subchunk_shape(vec![chunk])
            .bytes_to_bytes_codecs(vec![Arc::new(ZstdCodec::new(l.zstd_level, false))])
            .dimension_names(Some([dim]))
            .build(store.clone(), &path)
            .map_err(|e| Error::Invalid(format!("{path}: cannot create the array: {e}")))?;
        array.store_metadata_opt(&metadata_options()).map_err(|e| {
            let meta = root.join(split).join(name).join("zarr.json");
            super::store::zarrs_error(&e, &meta, &[], || "cannot write".into())
        })?;
    }
    Ok(())
}
