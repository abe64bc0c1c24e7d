//! One 1-D array of a split (`encoded_tokens` or `seq_starts`) with the access path that suits
//! its layout: a sharded array is read by inner chunk through zarrs' shard-index cache (or by
//! whole shard for a long range), any other by whole chunk through a small cache of decoded
//! chunks. A shard holds its inner chunks and an index of (offset, length) u64 pairs, one per
//! inner chunk, `u64::MAX` for one not stored, at the shard's start or end. A read that fails
//! becomes an error naming the chunk or shard files it lies in, and for a local file cut
//! short, its size and the size it should have.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::chunk_cache::{ChunkCache, ChunkCacheDecodedLruChunkLimit};
use zarrs::array::codec::api::CodecOptions;
use zarrs::array::{
    Array, ArrayShardedExt, ArrayShardedReadableExt, ArrayShardedReadableExtCache, ArraySubset,
    ElementOwned,
};

use super::super::store::{zarrs_error, IoBeneath};
use super::bulk::{InnerCodec, KeptIndexes};
use super::{check_range, Storage};
use crate::error::{Error, Result};

/// Decoded whole chunks kept per array (unsharded arrays only): the rows of a step mostly fall
/// in few chunks.
const CACHED_CHUNKS: u64 = 4;
/// Shards whose index stays cached before the cache is reset (bounds its memory).
const CACHED_SHARD_INDEXES: usize = 1024;
/// Ranges at least this long are read by whole shards rather than through the shard-index
/// cache (faster for bulk reads: validation, scans).
const BULK: u64 = 1 << 20;

/// One 1-D array with the access path that suits its layout.
pub(super) struct Column {
    pub(super) array: Arc<Array<Storage>>,
    pub(super) path: PathBuf,
    /// Whether its chunk files are local files (a chunk cut short is measured and named).
    pub(super) local: bool,
    pub(super) access: Access,
    /// Where a shard keeps its index, and how its inner chunks are encoded (sharded arrays
    /// only).
    pub(super) index: Option<ShardIndex>,
    /// Shard indexes [`Column::fetch`] has read, kept for its later calls: each group of a
    /// shuffle buffer is one call, and on a store a shard's index costs a request and a round
    /// trip before its inner chunks can be asked for.
    pub(super) kept_indexes: std::sync::Mutex<KeptIndexes>,
}

/// A shard's index of inner chunks, read by [`Column::fetch`] itself: zarrs 0.23's
/// `subchunk_byte_range` overflows on an inner chunk the shard does not store (a run of fill
/// values, such as 2,048 zero tokens), so the offsets are looked up here.
pub(super) struct ShardIndex {
    pub(super) codec: zarrs::array::codec::ShardingCodec,
    /// Inner chunks per shard.
    pub(super) per_shard: std::num::NonZeroU64,
    /// The bytes holding the index: its exact extent for the usual index codecs (`bytes`,
    /// then maybe `crc32c`), else the whole shard.
    pub(super) extent: zarrs::storage::byte_range::ByteRange,
    /// How inner chunks are encoded, and the element size, when [`Column::decode`] can decode
    /// them itself.
    pub(super) direct: Option<(InnerCodec, usize)>,
}

impl ShardIndex {
    pub(super) fn of(array: &Array<Storage>) -> Option<ShardIndex> {
        use zarrs::storage::byte_range::ByteRange;
        if !array.is_exclusively_sharded() {
            return None;
        }
        let codecs = array.codecs();
        let codec = codecs
            .array_to_bytes_codec()
            .as_any()
            .downcast_ref::<zarrs::array::codec::ShardingCodec>()?
            .clone();
        let shard = array.chunk_shape(&[0]).ok()?[0].get();
        let inner = array.subchunk_shape()?[0].get();
        let per_shard = std::num::NonZeroU64::new(shard / inner)?;
        let meta = serde_json::to_value(array.metadata()).ok()?;
        let config = meta.get("codecs")?.get(0)?.get("configuration")?;
        let mut len = Some(16 * per_shard.get());
        for c in config.get("index_codecs")?.as_array()? {
            match c.get("name").and_then(|n| n.as_str()) {
                Some("bytes") => {}
                Some("crc32c") => len = len.map(|l| l + 4),
                _ => len = None,
            }
        }
        let at_start = config.get("index_location").and_then(|l| l.as_str()) == Some("start");
        let extent = match len {
            Some(len) if at_start => ByteRange::FromStart(0, Some(len)),
            Some(len) => ByteRange::Suffix(len),
            None => ByteRange::FromStart(0, None),
        };
        Some(ShardIndex {
            codec,
            per_shard,
            extent,
            direct: InnerCodec::of(&meta),
        })
    }
}

pub(super) enum Access {
    Sharded(ArrayShardedReadableExtCache),
    Chunked(ChunkCacheDecodedLruChunkLimit),
}

impl Column {
    pub(super) fn new(array: Array<Storage>, path: PathBuf, local: bool) -> Column {
        let array = Arc::new(array);
        let access = if array.is_sharded() {
            Access::Sharded(ArrayShardedReadableExtCache::new(&array))
        } else {
            Access::Chunked(ChunkCacheDecodedLruChunkLimit::new(
                array.clone(),
                CACHED_CHUNKS,
            ))
        };
        Column {
            index: ShardIndex::of(&array),
            array,
            path,
            local,
            access,
            kept_indexes: Default::default(),
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.array.shape()[0]
    }

    pub(super) fn read<T: ElementOwned>(
        &self,
        range: Range<u64>,
        what: &'static str,
    ) -> Result<Vec<T>> {
        check_range(&range, self.len(), what)?;
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let range_len = range.end - range.start;
        let subset = ArraySubset::new_with_ranges(&[range]);
        let opts = CodecOptions::default();
        let r = match &self.access {
            // A long range decodes whole shards: the plain path skips per-chunk bookkeeping.
            Access::Sharded(_) if range_len >= BULK => self
                .array
                .retrieve_array_subset_opt::<Vec<T>>(&subset, &opts),
            Access::Sharded(cache) => {
                if cache.len() > CACHED_SHARD_INDEXES {
                    cache.clear();
                }
                self.array
                    .retrieve_array_subset_sharded_opt::<Vec<T>>(cache, &subset, &opts)
            }
            Access::Chunked(cache) => cache.retrieve_array_subset::<Vec<T>>(&subset, &opts),
        };
        r.map_err(|e| self.read_error(&e, &subset, what))
    }

    /// A failed read of `subset`, naming the chunk (or shard) files it lies in: the one that
    /// failed is there.
    pub(super) fn read_error(&self, e: &impl IoBeneath, subset: &ArraySubset, what: &str) -> Error {
        let keys = self.chunk_keys(subset, 64);
        let root = self.store_root();
        let files: Vec<PathBuf> = keys.iter().map(|k| root.join(k)).collect();
        let words = || {
            format!(
                "cannot read {what}s {} to {} (in {})",
                subset.start()[0],
                subset.end_exc()[0].saturating_sub(1),
                keys[..keys.len().min(4)].join(", ")
            )
        };
        // A chunk that does not decode is most often one cut short: say so, naming the file
        // and both sizes, rather than with the codec's words ("the checksum is invalid").
        if e.io_beneath().is_none() && self.local {
            if let Some((file, size, want, from)) = self.truncated_file(root, &keys) {
                return Error::format(
                    file,
                    format!(
                        "truncated: {size} of {want} bytes ({from}); the file was cut short (an \
                         interrupted copy or write): copy or write it again ({}: {e})",
                        words()
                    ),
                );
            }
        }
        zarrs_error(e, &self.path, &files, words)
    }

    /// The error for chunk (or shard) `key`, which does not decode (`detail`): "truncated: X of
    /// Y bytes" where its expected length is known, else its size and what to do.
    pub(super) fn damaged(&self, key: &str, detail: &str) -> Error {
        let root = self.store_root();
        let file = root.join(key);
        if self.local {
            if let Some((f, size, want, from)) = self.truncated_file(root, &[key.to_string()]) {
                return Error::format(
                    f,
                    format!(
                        "truncated: {size} of {want} bytes ({from}); the file was cut short (an \
                         interrupted copy or write): copy or write it again ({detail})"
                    ),
                );
            }
        }
        let size = std::fs::metadata(&file)
            .map(|m| format!(" ({} bytes)", m.len()))
            .unwrap_or_default();
        Error::format(
            file,
            format!(
                "{detail}: the shard{size} is damaged or cut short; copy or write it again \
                 (`shardkit tokens validate` lists every damaged file)"
            ),
        )
    }

    /// The first of chunk (or shard) files `keys` below `root` that is shorter than it should
    /// be: (file, its size, the size it should have, where that size comes from). The size
    /// comes from the dataset's checksums sidecar, or for a shard whose index is at its start,
    /// from the index (the end of its last stored inner chunk).
    fn truncated_file(
        &self,
        root: &Path,
        keys: &[String],
    ) -> Option<(PathBuf, u64, u64, &'static str)> {
        let sums = crate::checksum::Checksums::read(&root.join(crate::checksum::SIDECAR))
            .ok()
            .flatten();
        keys.iter().find_map(|k| {
            let file = root.join(k);
            let size = std::fs::metadata(&file).ok()?.len();
            if let Some(want) = sums.as_ref().and_then(|s| s.files.get(k)).map(|f| f.bytes) {
                return (size < want).then_some((
                    file,
                    size,
                    want,
                    "the checksums sidecar records its length",
                ));
            }
            let want = self.shard_len_from_index(&file)?;
            (size < want).then_some((file, size, want, "its shard index says where its data ends"))
        })
    }

    /// The length a shard file with its index at the start should have: the end of the last
    /// inner chunk the index lists (`None` for an index at the end, which a cut removes).
    fn shard_len_from_index(&self, file: &Path) -> Option<u64> {
        use std::io::Read;
        use zarrs::storage::byte_range::ByteRange;
        let index = self.index.as_ref()?;
        let ByteRange::FromStart(0, Some(len)) = index.extent else {
            return None;
        };
        let mut bytes = vec![0u8; usize::try_from(len).ok()?];
        std::fs::File::open(file)
            .ok()?
            .read_exact(&mut bytes)
            .ok()?;
        let offsets = index
            .codec
            .decode_index(&bytes, &[index.per_shard], &CodecOptions::default())
            .ok()?;
        offsets
            .chunks_exact(2)
            .filter(|p| p[0] != u64::MAX)
            .map(|p| p[0].checked_add(p[1]))
            .try_fold(len, |m, end| end.map(|e| m.max(e)))
    }
}

impl Column {
    /// The directory the store's keys are relative to (`path` is `<root>/<split>/<array>`).
    pub(super) fn store_root(&self) -> &Path {
        crate::fsutil::parent_of(crate::fsutil::parent_of(&self.path))
    }

    /// The chunk (or shard) files holding elements `range`, as paths below `root` (the store's
    /// root directory).
    pub(super) fn files_of(&self, root: &Path, range: Range<u64>) -> Vec<PathBuf> {
        if range.is_empty() {
            return Vec::new();
        }
        let subset = ArraySubset::new_with_ranges(&[range]);
        self.chunk_keys(&subset, usize::MAX)
            .into_iter()
            .map(|k| root.join(k))
            .collect()
    }

    /// The store keys of the first `at_most` chunks (or shards) `subset` lies in.
    fn chunk_keys(&self, subset: &ArraySubset, at_most: usize) -> Vec<String> {
        self.array
            .chunks_in_array_subset(subset)
            .ok()
            .flatten()
            .map(|chunks| {
                chunks
                    .indices()
                    .iter()
                    .take(at_most)
                    .map(|c| self.array.chunk_key(&c).to_string())
                    .collect()
            })
            .unwrap_or_default()
    }
}
