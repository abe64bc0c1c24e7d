//! One split (`train` or `validation`) of a flat-tokens dataset, read through zarrs and checked
//! against every invariant of the format (flat_tokens.md §2.3, §9.3).
//!
//! Opening reads metadata only (plus two `seq_starts` entries for a marked dataset), so it is
//! fast whatever the size; `seq_starts` is read on demand, like the tokens. Sharded arrays are
//! read by inner chunk (partial decoding, shard indexes cached); other arrays by whole chunk
//! through a small cache of decoded chunks (a seqax v2 chunk must be decoded whole anyway).
//! Bulk reads ([`Column::fetch`], then [`Column::decode`]) fetch the inner chunks they need as
//! one request list per shard, located through the shard's index, and decode zstd inner chunks
//! directly (one reused zstd context per thread) rather than through zarrs' codec pipeline.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::chunk_cache::{ChunkCache, ChunkCacheDecodedLruChunkLimit};
use zarrs::array::codec::api::CodecOptions;
use zarrs::array::{
    data_type, Array, ArrayShardedExt, ArrayShardedReadableExt, ArrayShardedReadableExtCache,
    ArraySubset, ElementOwned,
};
use zarrs::filesystem::FilesystemStore;
use zarrs::group::Group;
use zarrs::storage::{ReadableStorageTraits, StoreKey};

use super::store::{zarrs_error, Completion, IoBeneath, ZarrFormat};
use crate::error::{Error, Result};

/// Decoded whole chunks kept per array (unsharded arrays only): the rows of a step mostly fall
/// in few chunks.
const CACHED_CHUNKS: u64 = 4;
/// Shards whose index stays cached before the cache is reset (bounds its memory).
const CACHED_SHARD_INDEXES: usize = 1024;
/// Bytes of shard indexes [`Column::fetch`] keeps between calls: 512 default flat-tokens
/// token shards (128 KiB of index each, 8 Gi tokens).
const KEPT_INDEX_BYTES: usize = 64 << 20;
/// Ranges at least this long are read by whole shards rather than through the shard-index
/// cache (faster for bulk reads: validation, scans).
const BULK: u64 = 1 << 20;
/// Violations of one kind counted before a scan of damaged `seq_starts` stops.
const MAX_COUNTED: u64 = 1000;
/// Elements read at a time when scanning a whole array.
const SCAN_PIECE: u64 = 1 << 22;

type Storage = dyn ReadableStorageTraits;

/// One 1-D array with the access path that suits its layout.
struct Column {
    array: Arc<Array<Storage>>,
    path: PathBuf,
    access: Access,
    /// Where a shard keeps its index, and how its inner chunks are encoded (sharded arrays
    /// only).
    index: Option<ShardIndex>,
    /// Shard indexes [`Column::fetch`] has read, kept for its later calls: each group of a
    /// shuffle buffer is one call, and on a store a shard's index costs a request and a round
    /// trip before its inner chunks can be asked for.
    kept_indexes: std::sync::Mutex<KeptIndexes>,
}

/// Shard indexes by shard key, the oldest dropped first beyond [`KEPT_INDEX_BYTES`]. A
/// committed dataset's shards never change while it is open, so a kept index stays right.
/// Each key has a slot that its fetch holds locked: groups fetched at once that meet the same
/// shard wait for one request rather than each making its own.
#[derive(Default)]
struct KeptIndexes {
    slots: std::collections::HashMap<String, IndexSlot>,
    /// Filled slots, oldest first, with their sizes.
    filled: std::collections::VecDeque<(String, usize)>,
    bytes: usize,
}

type IndexSlot = Arc<std::sync::Mutex<Option<bytes::Bytes>>>;

impl KeptIndexes {
    /// The slot of `key` (empty until an index is kept in it).
    fn slot(&mut self, key: &str) -> IndexSlot {
        self.slots.entry(key.to_string()).or_default().clone()
    }

    /// Counts `len` bytes just kept in the slot of `key`, dropping the oldest indexes kept
    /// beyond the budget.
    fn filled(&mut self, key: &str, len: usize) {
        self.bytes += len;
        self.filled.push_back((key.to_string(), len));
        while self.bytes > KEPT_INDEX_BYTES {
            let Some((old, len)) = self.filled.pop_front() else {
                break;
            };
            self.slots.remove(&old);
            self.bytes -= len;
        }
    }
}

/// A shard's index of inner chunks, read by [`Column::fetch`] itself: zarrs 0.23's
/// `subchunk_byte_range` overflows on an inner chunk the shard does not store (a run of fill
/// values, such as 2,048 zero tokens), so the offsets are looked up here.
struct ShardIndex {
    codec: zarrs::array::codec::ShardingCodec,
    /// Inner chunks per shard.
    per_shard: std::num::NonZeroU64,
    /// The bytes holding the index: its exact extent for the usual index codecs (`bytes`,
    /// then maybe `crc32c`), else the whole shard.
    extent: zarrs::storage::byte_range::ByteRange,
    /// How inner chunks are encoded, and the element size, when [`Column::decode`] can decode
    /// them itself.
    direct: Option<(InnerCodec, usize)>,
}

impl ShardIndex {
    fn of(array: &Array<Storage>) -> Option<ShardIndex> {
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

/// Encodings of a sharded array's inner chunks that [`Column::decode`] decodes directly (one
/// reused zstd context per thread, straight into the output) instead of through zarrs' codec
/// pipeline, which sets up a decoder and its bookkeeping for every few-KiB inner chunk and
/// was most of the cost of a flat-tokens buffer read. Anything else goes through zarrs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum InnerCodec {
    /// `bytes` (little-endian) alone.
    Raw,
    /// `bytes` (little-endian), then `zstd`.
    Zstd,
}

impl InnerCodec {
    /// The direct decoding that suits an exclusively sharded array of metadata `meta`, with
    /// its element size: 32- or 64-bit unsigned integers stored little-endian, maybe
    /// zstd-compressed, whose fill value is 0.
    fn of(meta: &serde_json::Value) -> Option<(InnerCodec, usize)> {
        if cfg!(target_endian = "big") {
            return None;
        }
        let dtype = meta.get("data_type")?.as_str()?;
        let fill_is_zero = meta.get("fill_value")?.as_u64() == Some(0);
        let elem_size = match dtype {
            "uint32" => 4,
            "uint64" => 8,
            _ => return None,
        };
        if !fill_is_zero {
            return None;
        }
        let [sharding] = meta.get("codecs")?.as_array()?.as_slice() else {
            return None;
        };
        if sharding.get("name")?.as_str()? != "sharding_indexed" {
            return None;
        }
        let inner = sharding.get("configuration")?.get("codecs")?.as_array()?;
        let name = |c: &serde_json::Value| c.get("name").and_then(|n| n.as_str()).map(String::from);
        let little = |c: &serde_json::Value| {
            let endian = c.get("configuration").and_then(|c| c.get("endian"));
            endian.is_none_or(|e| e.as_str() == Some("little"))
        };
        match inner.as_slice() {
            [b] if name(b)? == "bytes" && little(b) => Some((InnerCodec::Raw, elem_size)),
            [b, z] if name(b)? == "bytes" && little(b) && name(z)? == "zstd" => {
                Some((InnerCodec::Zstd, elem_size))
            }
            _ => None,
        }
    }
}

enum Access {
    Sharded(ArrayShardedReadableExtCache),
    Chunked(ChunkCacheDecodedLruChunkLimit),
}

impl Column {
    fn new(array: Array<Storage>, path: PathBuf) -> Column {
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
            access,
            kept_indexes: Default::default(),
        }
    }

    fn len(&self) -> u64 {
        self.array.shape()[0]
    }

    fn read<T: ElementOwned>(&self, range: Range<u64>, what: &'static str) -> Result<Vec<T>> {
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
    fn read_error(&self, e: &impl IoBeneath, subset: &ArraySubset, what: &str) -> Error {
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
        if e.io_beneath().is_none() && !crate::storage::is_remote(&self.path) {
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
    fn damaged(&self, key: &str, detail: &str) -> Error {
        let root = self.store_root();
        let file = root.join(key);
        if !crate::storage::is_remote(&self.path) {
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

    /// Elements `ranges`, read together: [`Column::fetch`], then [`Column::decode`].
    fn read_many<T: ElementOwned + bytemuck::Pod + Send>(
        &self,
        ranges: &[Range<u64>],
        what: &'static str,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<Vec<T>>> {
        let fetched = self.fetch(ranges, what, None)?;
        self.decode(&fetched, what, pool)
    }

    /// Fetches every stored byte `ranges` need, without decoding: whole chunks, or for a
    /// sharded array only the inner chunks the ranges touch, as one request list per shard
    /// (which an object store coalesces into a few large GETs). Up to [`FETCH_LANES`] chunks
    /// or shards are fetched at once, on threads of their own: they mostly wait. Once `stop`
    /// is set, the store requests in flight are cut and the fetch fails.
    fn fetch(
        &self,
        ranges: &[Range<u64>],
        what: &'static str,
        stop: Option<&Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Fetched> {
        for r in ranges {
            check_range(r, self.len(), what)?;
        }
        let fetched = Arc::new(Prefetched::new(self.array.storage(), stop.cloned()));
        let array = self.array.with_storage(fetched.clone());
        let sharded = ArrayShardedReadableExtCache::new(&array);
        let wanted: Vec<&Range<u64>> = ranges.iter().filter(|r| !r.is_empty()).collect();
        // The chunks (or shards) the ranges lie in, each once, with the ranges in each (an
        // unpacked buffer asks for many short ranges: no shard scans them all).
        let mut in_chunk: std::collections::BTreeMap<u64, Vec<&Range<u64>>> = Default::default();
        for r in &wanted {
            let grid = array
                .chunks_in_array_subset(&subset_of(r))
                .map_err(|e| Error::format(&self.path, format!("chunk grid: {e}")))?;
            if let Some(grid) = grid {
                for c in grid.indices().iter() {
                    in_chunk.entry(c[0]).or_default().push(r);
                }
            }
        }
        let chunks: Vec<u64> = in_chunk.keys().copied().collect();
        let inner_len = array
            .effective_subchunk_shape()
            .map(|s| s[0].get())
            .filter(|_| self.index.is_some());
        let direct = self.index.as_ref().and_then(|i| i.direct);
        let located = std::sync::Mutex::new(std::collections::HashMap::new());
        let fetch_one = |c: u64| -> Result<()> {
            let key = array.chunk_key(&[c]);
            let bounds = array
                .chunk_subset(&[c])
                .map_err(|e| Error::format(&self.path, format!("chunk grid: {e}")))?;
            let (lo, hi) = (bounds.start()[0], bounds.end_exc()[0]);
            let byte_ranges = match inner_len {
                None => vec![zarrs::storage::byte_range::ByteRange::FromStart(0, None)],
                Some(n) => {
                    // The inner chunks of this shard that some range touches, in order.
                    let mut inner = std::collections::BTreeSet::new();
                    for r in in_chunk.get(&c).into_iter().flatten() {
                        let (a, b) = (r.start.max(lo), r.end.min(hi));
                        if a < b {
                            inner.extend(a / n..=(b - 1) / n);
                        }
                    }
                    let inner: Vec<u64> = inner.into_iter().collect();
                    let at = self.locate(&fetched, &key, c, &(lo..hi), &inner, what)?;
                    if direct.is_some() {
                        let key: Arc<str> = key.as_str().into();
                        let mut located = located.lock().unwrap_or_else(|e| e.into_inner());
                        located.extend(
                            inner
                                .iter()
                                .zip(&at)
                                .map(|(&i, &at)| (i, (key.clone(), at))),
                        );
                    }
                    at.into_iter().flatten().collect()
                }
            };
            fetched
                .fetch(&key, byte_ranges)
                .map(|_| ())
                .map_err(|e| self.read_error(&e, &subset_of(&(lo..hi)), what))
        };
        let next = std::sync::atomic::AtomicUsize::new(0);
        let lane = || -> Result<()> {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match chunks.get(i) {
                    Some(&c) => fetch_one(c)?,
                    None => return Ok(()),
                }
            }
        };
        std::thread::scope(|scope| {
            let lanes: Vec<_> = (1..FETCH_LANES.min(chunks.len()))
                .map(|_| scope.spawn(lane))
                .collect();
            let mut result = lane();
            for l in lanes {
                let r = l
                    .join()
                    .unwrap_or_else(|_| Err(Error::Internal("a fetch thread panicked".into())));
                result = result.and(r);
            }
            result
        })?;
        let direct = match (direct, inner_len) {
            (Some((codec, elem_size)), Some(inner_len)) => Some(Direct {
                codec,
                elem_size,
                inner_len,
                located: located.into_inner().unwrap_or_else(|e| e.into_inner()),
            }),
            _ => None,
        };
        Ok(Fetched {
            array,
            fetched,
            sharded,
            by_inner_chunk: inner_len.is_some(),
            direct,
            ranges: ranges.to_vec(),
        })
    }

    /// The byte ranges of inner chunks `inner` (indexes in the whole array) in shard `shard`
    /// (`None`: not stored, all fill value), from the shard's index, which is fetched into
    /// `fetched` (the decoding that may follow reads it there).
    fn locate(
        &self,
        fetched: &Prefetched,
        key: &StoreKey,
        shard: u64,
        span: &Range<u64>,
        inner: &[u64],
        what: &'static str,
    ) -> Result<Vec<Option<zarrs::storage::byte_range::ByteRange>>> {
        use zarrs::storage::byte_range::ByteRange;
        let file = || self.store_root().join(key.as_str());
        let Some(index) = &self.index else {
            return Err(Error::Internal("locate: not a sharded array".into()));
        };
        // An index of known length is kept; `FromStart(0, None)` (an index codec whose
        // length is not known ahead) is the whole shard, which is not.
        let keepable = !matches!(index.extent, ByteRange::FromStart(_, None));
        let slot = keepable.then(|| {
            let mut kept = self.kept_indexes.lock().unwrap_or_else(|e| e.into_inner());
            kept.slot(key.as_str())
        });
        // Held until the index is kept (or its fetch failed): see `KeptIndexes`.
        let mut slot = slot
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()));
        let kept = slot.as_ref().and_then(|s| s.as_ref().cloned());
        let bytes = match kept {
            Some(bytes) => {
                // Also where a decoding through zarrs looks for it.
                fetched.keep(key.as_str(), index.extent, bytes.clone());
                bytes
            }
            None => {
                let present = fetched
                    .fetch(key, vec![index.extent])
                    .map_err(|e| self.read_error(&e, &subset_of(span), what))?;
                if !present {
                    return Ok(vec![None; inner.len()]); // no shard: all fill value
                }
                fetched.lookup(key.as_str(), index.extent).ok_or_else(|| {
                    self.damaged(key.as_str(), "the shard is shorter than its index")
                })?
            }
        };
        let offsets = index
            .codec
            .decode_index(&bytes, &[index.per_shard], &CodecOptions::default())
            .map_err(|e| self.damaged(key.as_str(), &format!("shard index: {e}")))?;
        // Only an index that decodes is kept (with `crc32c`, one whose checksum holds).
        if let Some(mut slot) = slot.take().filter(|s| s.is_none()) {
            let len = bytes.len();
            *slot = Some(bytes);
            drop(slot);
            let mut kept = self.kept_indexes.lock().unwrap_or_else(|e| e.into_inner());
            kept.filled(key.as_str(), len);
        }
        let first = shard * index.per_shard.get();
        inner
            .iter()
            .map(|&i| {
                let j = usize::try_from(i.checked_sub(first)?).ok()?;
                match (*offsets.get(2 * j)?, *offsets.get(2 * j + 1)?) {
                    (u64::MAX, u64::MAX) => Some(None),
                    (at, len) => at
                        .checked_add(len)
                        .map(|_| Some(ByteRange::FromStart(at, Some(len)))),
                }
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                Error::format(
                    file(),
                    "shard index: an inner chunk's offset is out of range",
                )
            })
    }

    /// Decodes what [`Column::fetch`] fetched, range by range, in pieces of at most
    /// [`DECODE_PIECE`] elements spread over `pool` (on this thread without one: a few
    /// elements). Each range's output is allocated once and
    /// every piece decoded in place: no piece buffers, no copy to join them. (Buffers of
    /// pieces made every decode fault in fresh pages twice and grow the heap, whose `mprotect`
    /// calls stop every other thread's page faults: decoding scaled poorly with threads.)
    fn decode<T: ElementOwned + bytemuck::Pod + Send>(
        &self,
        f: &Fetched,
        what: &'static str,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<Vec<T>>> {
        use rayon::prelude::*;
        let opts = CodecOptions::default();
        let mut out: Vec<Vec<T>> = f
            .ranges
            .iter()
            .map(|r| big_zeroed((r.end - r.start) as usize))
            .collect();
        let mut pieces: Vec<(Range<u64>, &mut [T])> = Vec::new();
        for (r, o) in f.ranges.iter().zip(out.iter_mut()) {
            for (k, dst) in o.chunks_mut(DECODE_PIECE as usize).enumerate() {
                let a = r.start + k as u64 * DECODE_PIECE;
                pieces.push((a..a + dst.len() as u64, dst));
            }
        }
        let decode_piece = |(r, dst): (Range<u64>, &mut [T])| -> Result<()> {
            let direct = f.direct.as_ref();
            if direct.is_some_and(|d| d.decode_into(&f.fetched, &r, self.len(), dst).is_some()) {
                return Ok(());
            }
            let subset = subset_of(&r);
            let got = if f.by_inner_chunk {
                f.array
                    .retrieve_array_subset_sharded_opt::<Vec<T>>(&f.sharded, &subset, &opts)
            } else {
                f.array.retrieve_array_subset_opt::<Vec<T>>(&subset, &opts)
            };
            let got = got.map_err(|e| self.read_error(&e, &subset, what))?;
            if got.len() != dst.len() {
                return Err(Error::Internal(format!(
                    "internal: {what}s {}..{} decoded to {} elements",
                    r.start,
                    r.end,
                    got.len()
                )));
            }
            dst.copy_from_slice(&got);
            Ok(())
        };
        match pool {
            Some(pool) => pool.install(|| pieces.into_par_iter().try_for_each(decode_piece)),
            None => pieces.into_iter().try_for_each(decode_piece),
        }?;
        Ok(out)
    }
}

/// `n` zeroed elements. A large vector comes straight from the kernel (already zero, nothing
/// written) and is marked for transparent huge pages where the system allows them on request:
/// decoding into it then takes one page fault per 2 MiB instead of per 4 KiB.
fn big_zeroed<T: bytemuck::Pod>(n: usize) -> Vec<T> {
    let v = vec![T::zeroed(); n];
    let bytes = std::mem::size_of_val(v.as_slice());
    #[cfg(target_os = "linux")]
    if bytes >= 4 << 20 {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if lo < hi {
            // SAFETY: [lo, hi) lies within the vector's allocation, and the advice changes how
            // its pages are backed, never their contents. A refusal only costs the speed-up.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

/// Chunks (or shards) fetched at once by [`Column::fetch`].
const FETCH_LANES: usize = 16;
/// Elements decoded by one task of [`Column::decode`].
pub(crate) const DECODE_PIECE: u64 = 1 << 20;

/// A subset of a 1-D array.
fn subset_of(r: &Range<u64>) -> ArraySubset {
    ArraySubset::new_with_ranges(std::slice::from_ref(r))
}

/// Stored bytes of some ranges of an array, fetched and waiting to be decoded.
pub(crate) struct Fetched {
    array: Array<Prefetched>,
    fetched: Arc<Prefetched>,
    sharded: ArrayShardedReadableExtCache,
    by_inner_chunk: bool,
    /// Where each fetched inner chunk lies, when they can be decoded directly.
    direct: Option<Direct>,
    ranges: Vec<Range<u64>>,
}

/// The fetched inner chunks of a sharded array whose encoding [`InnerCodec`] decodes.
struct Direct {
    codec: InnerCodec,
    elem_size: usize,
    /// Elements per inner chunk.
    inner_len: u64,
    /// Inner chunk index → (shard key, byte range in the shard); `None` for an inner chunk the
    /// shard does not store (all fill value).
    located:
        std::collections::HashMap<u64, (Arc<str>, Option<zarrs::storage::byte_range::ByteRange>)>,
}

thread_local! {
    /// One zstd context per decoding thread, reused for every inner chunk.
    static ZSTD: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    /// An inner chunk decoded whole when only part of it is wanted.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Direct {
    /// Elements `r` of a column of length `len`, decoded straight from the fetched inner
    /// chunks into `out`; `None` when anything is amiss (a chunk not fetched, a size that does
    /// not match, a damaged frame), so that the caller decodes through zarrs, which names the
    /// fault (`None`).
    fn decode_into<T: bytemuck::Pod>(
        &self,
        f: &Prefetched,
        r: &Range<u64>,
        len: u64,
        out: &mut [T],
    ) -> Option<()> {
        if std::mem::size_of::<T>() != self.elem_size
            || r.end > len
            || out.len() as u64 != r.end - r.start
        {
            return None;
        }
        let n = self.inner_len;
        let chunk_bytes = usize::try_from(n).ok()?.checked_mul(self.elem_size)?;
        for c in r.start / n..r.end.div_ceil(n) {
            let (key, at) = self.located.get(&c)?;
            let (lo, hi) = (r.start.max(c * n), r.end.min((c + 1) * n));
            let dst = &mut out[(lo - r.start) as usize..(hi - r.start) as usize];
            let Some(at) = at else {
                // Not stored: the fill value, 0 (`out` may hold an earlier attempt's bytes).
                dst.fill(T::zeroed());
                continue;
            };
            let bytes = f.lookup(key, *at)?;
            let dst: &mut [u8] = bytemuck::cast_slice_mut(dst);
            if dst.len() == chunk_bytes {
                self.decode_chunk(&bytes, dst)?;
            } else {
                SCRATCH.with_borrow_mut(|scratch| {
                    scratch.resize(chunk_bytes, 0);
                    self.decode_chunk(&bytes, scratch)?;
                    let from = ((lo - c * n) as usize) * self.elem_size;
                    dst.copy_from_slice(&scratch[from..from + dst.len()]);
                    Some(())
                })?;
            }
        }
        Some(())
    }

    /// One inner chunk's stored bytes decoded into `dst`, which it must fill exactly.
    fn decode_chunk(&self, src: &[u8], dst: &mut [u8]) -> Option<()> {
        match self.codec {
            InnerCodec::Raw => (src.len() == dst.len()).then(|| dst.copy_from_slice(src)),
            InnerCodec::Zstd => ZSTD.with_borrow_mut(|z| {
                if z.is_none() {
                    *z = zstd::bulk::Decompressor::new().ok();
                }
                let got = z.as_mut()?.decompress_to_buffer(src, dst).ok()?;
                (got == dst.len()).then_some(())
            }),
        }
    }
}

/// `ranges` with each run of ranges that follow one another (a shard's inner chunks, written
/// in turn) joined into one, which [`Prefetched::lookup`] slices: a local shard is read in one
/// call instead of one per inner chunk (16 Mi tokens of a shuffle buffer were 8,192 reads and
/// as many allocations). An object store's requests are coalesced the same either way.
fn joined(
    ranges: Vec<zarrs::storage::byte_range::ByteRange>,
) -> Vec<zarrs::storage::byte_range::ByteRange> {
    use zarrs::storage::byte_range::ByteRange;
    let mut out: Vec<ByteRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let (Some(ByteRange::FromStart(at, Some(len))), ByteRange::FromStart(o, Some(n))) =
            (out.last_mut(), r)
        {
            if at.checked_add(*len) == Some(o) {
                *len += n;
                continue;
            }
        }
        out.push(r);
    }
    out
}

/// Byte ranges of a store's objects fetched ahead and served from memory; anything else is
/// read from the store beneath.
struct Prefetched {
    inner: Arc<Storage>,
    /// Once set, fetches from a store give up, their requests cut (a buffer read ahead for an
    /// iterator that was closed).
    stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Fetched bytes by key and first byte; a whole object sits at 0 and is in `whole`.
    spans: std::sync::RwLock<
        std::collections::HashMap<String, std::collections::BTreeMap<u64, bytes::Bytes>>,
    >,
    whole: std::sync::RwLock<std::collections::HashSet<String>>,
    /// Fetched ends of objects (shard indexes), by key.
    suffixes: std::sync::RwLock<std::collections::HashMap<String, bytes::Bytes>>,
}

impl Prefetched {
    fn new(inner: Arc<Storage>, stop: Option<Arc<std::sync::atomic::AtomicBool>>) -> Prefetched {
        Prefetched {
            inner,
            stop,
            spans: Default::default(),
            whole: Default::default(),
            suffixes: Default::default(),
        }
    }

    /// Fetches `ranges` of `key` in one request list and keeps them; false if there is no
    /// such object (left to the read, which gives the fill value or the error).
    fn fetch(
        &self,
        key: &StoreKey,
        ranges: Vec<zarrs::storage::byte_range::ByteRange>,
    ) -> std::result::Result<bool, zarrs::storage::StorageError> {
        use zarrs::storage::byte_range::ByteRange;
        if ranges.is_empty() {
            return Ok(true);
        }
        let ranges = joined(ranges);
        let starts: Vec<(u64, bool)> = ranges
            .iter()
            .map(|r| match *r {
                ByteRange::FromStart(o, len) => (o, len.is_none() && o == 0),
                ByteRange::Suffix(_) => (u64::MAX, false),
            })
            .collect();
        let parts = crate::storage::reads_stopped_by(self.stop.clone(), || {
            self.inner
                .get_partial_many(key, Box::new(ranges.into_iter()))
        })?;
        let Some(parts) = parts else {
            return Ok(false);
        };
        let mut got = std::collections::BTreeMap::new();
        let mut whole = false;
        let name = key.as_str().to_string();
        for (part, (at, all)) in parts.zip(starts) {
            let part = part?;
            if at != u64::MAX {
                whole |= all;
                got.insert(at, part);
            } else {
                self.keep_suffix(&name, part);
            }
        }
        if whole {
            self.whole
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone());
        }
        self.keep_spans(name, got);
        Ok(true)
    }

    /// Holds `bytes`, range `range` of `key` fetched earlier, as if [`Prefetched::fetch`] had
    /// fetched them (`range` has a known length).
    fn keep(&self, key: &str, range: zarrs::storage::byte_range::ByteRange, bytes: bytes::Bytes) {
        use zarrs::storage::byte_range::ByteRange;
        match range {
            ByteRange::Suffix(_) => self.keep_suffix(key, bytes),
            ByteRange::FromStart(at, Some(_)) => {
                self.keep_spans(key.to_string(), std::iter::once((at, bytes)).collect())
            }
            ByteRange::FromStart(_, None) => {}
        }
    }

    fn keep_suffix(&self, key: &str, bytes: bytes::Bytes) {
        self.suffixes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), bytes);
    }

    fn keep_spans(&self, key: String, spans: std::collections::BTreeMap<u64, bytes::Bytes>) {
        self.spans
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default()
            .extend(spans);
    }

    /// `range` of `key` if it was fetched.
    fn lookup(
        &self,
        key: &str,
        range: zarrs::storage::byte_range::ByteRange,
    ) -> Option<bytes::Bytes> {
        use zarrs::storage::byte_range::ByteRange;
        if let ByteRange::Suffix(n) = range {
            let suffixes = self.suffixes.read().unwrap_or_else(|e| e.into_inner());
            if let Some(b) = suffixes.get(key) {
                let n = usize::try_from(n).ok()?;
                if n <= b.len() {
                    return Some(b.slice(b.len() - n..));
                }
            }
        }
        let spans = self.spans.read().unwrap_or_else(|e| e.into_inner());
        let spans = spans.get(key)?;
        let whole = || {
            self.whole
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(key)
                .then(|| spans.get(&0).cloned())
                .flatten()
        };
        match range {
            ByteRange::FromStart(o, Some(len)) => {
                let (&at, b) = spans.range(..=o).next_back()?;
                let from = usize::try_from(o - at).ok()?;
                let to = from.checked_add(usize::try_from(len).ok()?)?;
                (to <= b.len()).then(|| b.slice(from..to))
            }
            ByteRange::FromStart(o, None) => {
                let b = whole()?;
                let from = usize::try_from(o).ok()?;
                (from <= b.len()).then(|| b.slice(from..))
            }
            ByteRange::Suffix(n) => {
                let b = whole()?;
                let n = usize::try_from(n).ok()?;
                (n <= b.len()).then(|| b.slice(b.len() - n..))
            }
        }
    }
}

impl ReadableStorageTraits for Prefetched {
    fn get_partial_many<'a>(
        &'a self,
        key: &StoreKey,
        byte_ranges: zarrs::storage::byte_range::ByteRangeIterator<'a>,
    ) -> std::result::Result<zarrs::storage::MaybeBytesIterator<'a>, zarrs::storage::StorageError>
    {
        let ranges: Vec<_> = byte_ranges.collect();
        let hits: Option<Vec<bytes::Bytes>> = ranges
            .iter()
            .map(|&r| self.lookup(key.as_str(), r))
            .collect();
        match hits {
            Some(hits) => Ok(Some(Box::new(hits.into_iter().map(Ok)))),
            None => self
                .inner
                .get_partial_many(key, Box::new(ranges.into_iter())),
        }
    }

    fn size_key(
        &self,
        key: &StoreKey,
    ) -> std::result::Result<Option<u64>, zarrs::storage::StorageError> {
        self.inner.size_key(key)
    }

    fn supports_get_partial(&self) -> bool {
        true
    }
}

impl Column {
    /// The directory the store's keys are relative to (`path` is `<root>/<split>/<array>`).
    fn store_root(&self) -> &Path {
        crate::fsutil::parent_of(crate::fsutil::parent_of(&self.path))
    }

    /// The chunk (or shard) files holding elements `range`, as paths below `root` (the store's
    /// root directory).
    fn files_of(&self, root: &Path, range: Range<u64>) -> Vec<PathBuf> {
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

/// Checks that `a` is 1-D uint32 (`tokens`) or uint64.
pub(crate) fn check_dtype<S: ?Sized>(a: &Array<S>, path: &Path, tokens: bool) -> Result<()> {
    let (dt, name) = if tokens {
        (data_type::uint32(), "uint32")
    } else {
        (data_type::uint64(), "uint64")
    };
    if a.shape().len() != 1 || *a.data_type() != dt {
        return Err(Error::format(
            path,
            format!(
                "must be a 1-D {name} array; found shape {:?} of {}",
                a.shape(),
                a.data_type()
                    .name_v3()
                    .map(|n| n.into_owned())
                    .unwrap_or_else(|| format!("{:?}", a.data_type()))
            ),
        ));
    }
    Ok(())
}

/// The split group's `max_token_id`: a non-negative integer.
pub(crate) fn max_token_id_attr<S: ?Sized>(g: &Group<S>, path: &Path) -> Result<u64> {
    match g.attributes().get("max_token_id") {
        None => Err(Error::format(
            path,
            "the split group has no `max_token_id` attribute",
        )),
        Some(v) => v.as_u64().ok_or_else(|| {
            Error::format(
                path,
                format!("`max_token_id` must be a non-negative integer, found {v}"),
            )
        }),
    }
}

/// An opened split: `encoded_tokens` (uint32) and `seq_starts` (uint64).
pub struct Split {
    path: PathBuf,
    format: ZarrFormat,
    completion: Completion,
    tokens: Column,
    starts: Column,
    max_token_id: u64,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("completion", &self.completion)
            .field("token_count", &self.token_count())
            .field("seq_count", &self.seq_count())
            .field("max_token_id", &self.max_token_id)
            .finish()
    }
}

fn check_split_name(split: &str) -> Result<()> {
    if split != "train" && split != "validation" {
        return Err(Error::Invalid(format!(
            "split must be \"train\" or \"validation\", got {split:?}"
        )));
    }
    Ok(())
}

/// A zarrs failure opening the node at `path` (a group or array of `format`): an I/O error
/// names its metadata file.
fn zerr(path: &Path, format: ZarrFormat, what: &str, e: &impl IoBeneath) -> Error {
    let meta: Vec<PathBuf> = match format {
        ZarrFormat::V3 => vec![path.join("zarr.json")],
        ZarrFormat::V2 => [".zarray", ".zgroup", ".zattrs"]
            .iter()
            .map(|n| path.join(n))
            .filter(|p| p.exists())
            .collect(),
    };
    zarrs_error(e, path, &meta, || what.to_string())
}

impl Split {
    /// Opens `split` of the dataset at `root` for reading.
    ///
    /// A dataset a shardkit writer finished (`write_completed: true`) opens after cheap checks;
    /// one it left unfinished is refused ([`Error::Interrupted`]); one without the marker
    /// (seqax's) opens only if it passes [`Split::validate`] in full, which reads every token —
    /// `shardkit tokens validate --mark` does that once and marks it.
    pub fn open(root: impl AsRef<Path>, split: &str) -> Result<Split> {
        let s = Self::open_unvalidated(root, split)?;
        s.check_servable()?;
        Ok(s)
    }

    /// Opens `split` from any zarrs store (`root` labels paths in messages); the same rules as
    /// [`Split::open`].
    pub fn open_in_store(store: Arc<Storage>, root: &Path, split: &str) -> Result<Split> {
        let s = Self::from_store(store, root, split)?;
        s.check_servable()?;
        Ok(s)
    }

    /// Opens without the completion and content checks (structure, names and dtypes are still
    /// checked): for validation and inspection.
    ///
    /// `root` may be an `s3://bucket/prefix` URL: the objects are listed once and every chunk
    /// or inner chunk zarrs reads is a ranged GET, retried like every request of
    /// [`crate::storage`].
    pub fn open_unvalidated(root: impl AsRef<Path>, split: &str) -> Result<Split> {
        let root = root.as_ref();
        check_split_name(split)?;
        if crate::storage::is_remote(root) {
            let remote = crate::storage::Remote::parse(root)?.with_object_cache();
            let url = PathBuf::from(remote.url());
            return Self::from_store(remote.zarr_store()?, &url, split);
        }
        let root = &crate::storage::local_path(root);
        if let Some(e) = super::report::not_a_directory(root) {
            return Err(e);
        }
        // zarrs opens chunk files with a blocking open: a FIFO among them would hang a read.
        let dir = root.join(split);
        if dir.is_dir() {
            crate::fsutil::check_regular_tree(&dir)?;
        }
        let store: Arc<Storage> = Arc::new(
            FilesystemStore::new(root)
                .map_err(|e| zarrs_error(&e, root, &[], || "store".into()))?,
        );
        Self::from_store(store, root, split)
    }

    fn from_store(store: Arc<Storage>, root: &Path, split: &str) -> Result<Split> {
        check_split_name(split)?;
        super::delta::register();
        let path = root.join(split);
        let has = |k: &str| {
            StoreKey::new(k)
                .ok()
                .and_then(|k| store.size_key(&k).ok().flatten())
                .is_some()
        };
        let format = if has("zarr.json") {
            ZarrFormat::V3
        } else if has(".zgroup") {
            ZarrFormat::V2
        } else {
            return Err(Error::format(
                root,
                "not a zarr group (no zarr.json or .zgroup); expected a flat-tokens dataset",
            ));
        };
        let completion = Completion::read(store.clone());
        let group = Group::open(store.clone(), &format!("/{split}")).map_err(|e| {
            zerr(
                &path,
                format,
                "the split is missing or not a zarr group",
                &e,
            )
        })?;
        let max_token_id = max_token_id_attr(&group, &path)?;
        let open = |name: &str, tokens: bool| -> Result<Column> {
            let p = path.join(name);
            let a = Array::open(store.clone(), &format!("/{split}/{name}"))
                .map_err(|e| zerr(&p, format, "cannot open the array", &e))?;
            check_dtype(&a, &p, tokens)?;
            Ok(Column::new(a, p))
        };
        let tokens = open("encoded_tokens", true)?;
        let starts = open("seq_starts", false)?;
        if starts.len() == 0 {
            return Err(Error::format(
                &starts.path,
                "is empty; it must hold at least the initial 0",
            ));
        }
        Ok(Split {
            path,
            format,
            completion,
            tokens,
            starts,
            max_token_id,
        })
    }

    fn check_servable(&self) -> Result<()> {
        match self.completion {
            Completion::Interrupted => Err(Error::Interrupted {
                path: self.path.clone(),
                detail: format!(
                    "the dataset's write_completed is false: a shardkit write did not finish \
                     (this split has {} sequences committed); resume it to complete the dataset",
                    self.seq_count()
                ),
            }),
            Completion::Complete => {
                // Through `fetch`, which keeps the shard indexes it reads: a loader's reads of
                // seq_starts from a store then do not fetch them again.
                let n = self.starts.len();
                let got: Vec<Vec<u64>> =
                    self.starts
                        .read_many(&[0..1, n - 1..n], "seq_starts entry", None)?;
                let (first, last) = (got[0][0], got[1][0]);
                if first != 0 || last != self.token_count() {
                    return Err(Error::format(
                        &self.path,
                        format!(
                            "seq_starts runs from {first} to {last}; it must run from 0 to \
                             token_count {}",
                            self.token_count()
                        ),
                    ));
                }
                Ok(())
            }
            Completion::Unmarked => {
                let problems = self.validate();
                if problems.is_empty() {
                    Ok(())
                } else {
                    Err(Error::format(
                        &self.path,
                        format!(
                            "not served: the dataset has no completion marker and fails \
                             validation: {}",
                            problems.join("; ")
                        ),
                    ))
                }
            }
        }
    }

    /// The split's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The files (chunks or shards, below the dataset root) that hold tokens `range`.
    pub(crate) fn token_files(&self, range: Range<u64>) -> Vec<PathBuf> {
        self.tokens
            .files_of(crate::fsutil::parent_of(&self.path), range)
    }
    /// The files that hold `seq_starts` entries `range`.
    pub(crate) fn start_files(&self, range: Range<u64>) -> Vec<PathBuf> {
        self.starts
            .files_of(crate::fsutil::parent_of(&self.path), range)
    }
    /// The dataset's zarr format.
    pub fn format(&self) -> ZarrFormat {
        self.format
    }
    /// What the root's completion marker says.
    pub fn completion(&self) -> Completion {
        self.completion
    }
    /// Whether the root carries `write_completed: true` (seqax data never does).
    pub fn is_marked_complete(&self) -> bool {
        self.completion == Completion::Complete
    }
    /// Tokens in the split.
    pub fn token_count(&self) -> u64 {
        self.tokens.len()
    }
    /// Sequences (documents) in the split.
    pub fn seq_count(&self) -> u64 {
        self.starts.len() - 1
    }
    /// The `max_token_id` attribute.
    pub fn max_token_id(&self) -> u64 {
        self.max_token_id
    }
    /// Whether `encoded_tokens` is sharded (read by inner chunk).
    pub fn is_sharded(&self) -> bool {
        matches!(self.tokens.access, Access::Sharded(_))
    }

    /// Entries `range` of `seq_starts` (`seq_count + 1` entries in all).
    pub fn seq_starts(&self, range: Range<u64>) -> Result<Vec<u64>> {
        self.starts.read(range, "seq_starts entry")
    }

    /// The token range of document `i`.
    pub fn document(&self, i: u64) -> Result<Range<u64>> {
        if i >= self.seq_count() {
            return Err(Error::OutOfRange {
                what: "sequence",
                index: i.min(i64::MAX as u64) as i64,
                len: self.seq_count(),
            });
        }
        let s = self.seq_starts(i..i + 2)?;
        if s[1] < s[0] || s[1] > self.token_count() {
            return Err(Error::format(
                &self.starts.path,
                format!(
                    "sequence {i} starts at token {} and ends before token {}, outside the {} \
                     tokens of the split (seq_starts must be non-decreasing and end at \
                     token_count)",
                    s[0],
                    s[1],
                    self.token_count()
                ),
            ));
        }
        Ok(s[0]..s[1])
    }

    /// Encoded tokens `range`.
    pub fn encoded(&self, range: Range<u64>) -> Result<Vec<u32>> {
        self.tokens.read(range, "token")
    }

    /// The stored bytes of encoded tokens `ranges`, fetched together (few large requests to
    /// an object store instead of one per inner chunk), for [`Split::decode_encoded`].
    pub(crate) fn fetch_encoded(
        &self,
        ranges: &[Range<u64>],
        stop: Option<&Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Fetched> {
        self.tokens.fetch(ranges, "token", stop)
    }

    /// The encoded tokens of each range [`Split::fetch_encoded`] fetched, decoded on `pool`.
    pub(crate) fn decode_encoded(
        &self,
        f: &Fetched,
        pool: &rayon::ThreadPool,
    ) -> Result<Vec<Vec<u32>>> {
        self.tokens.decode(f, "token", Some(pool))
    }

    /// Entries of `seq_starts` in each of `ranges`, fetched together like
    /// [`Split::encoded_many`].
    pub(crate) fn seq_starts_many(
        &self,
        ranges: &[Range<u64>],
        pool: &rayon::ThreadPool,
    ) -> Result<Vec<Vec<u64>>> {
        self.starts
            .read_many(ranges, "seq_starts entry", Some(pool))
    }

    /// The token ids of document `i` (decoded: `enc >> 1`).
    pub fn ids(&self, i: u64) -> Result<Vec<u32>> {
        let mut v = self.encoded(self.document(i)?)?;
        for x in &mut v {
            *x >>= 1;
        }
        Ok(v)
    }

    /// Every violation of the format's invariants (empty when valid): `seq_starts` starts at 0,
    /// never decreases and ends at `token_count`; start bits sit exactly at the distinct
    /// sequence starts below `token_count`; every id is at most `max_token_id`, itself below
    /// 2^31. Both arrays are streamed, so memory stays small whatever the size.
    pub fn validate(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(e) = self.scan(&mut problems) {
            problems.push(e.to_string());
        }
        problems
    }

    fn scan(&self, problems: &mut Vec<String>) -> Result<()> {
        let token_count = self.token_count();
        let m = self.starts.len();
        if self.max_token_id >= 1 << 31 {
            problems.push(format!(
                "max_token_id {} is not below 2^31",
                self.max_token_id
            ));
        }
        let mut starts = Scan::new(m);
        let first = starts.peek(self)?;
        if first != Some(0) {
            problems.push(format!("seq_starts[0] is {first:?}, must be 0"));
        }
        // Scan the tokens seq_starts accounts for: when the two disagree on the length, the
        // mismatch is reported below, and damaged metadata claiming billions of tokens does
        // not turn validation into a scan of fill values.
        let claimed = self.seq_starts(m - 1..m)?[0];
        let n = token_count.min(claimed);
        // Walk tokens and starts together. `next_start` is the smallest start not yet passed.
        let (mut bad_starts, mut bad_ids, mut max_seen) = (0u64, 0u64, 0u64);
        let (mut decreases, mut beyond) = (0u64, 0u64);
        let mut first_bad_start: Option<String> = None;
        let mut first_decrease: Option<String> = None;
        let mut prev: Option<u64> = None;
        let mut idx = 0u64; // index of the start `next_start` came from
        let mut next_start = starts.next(self)?;
        let mut at = 0u64;
        while at < n {
            let end = (at + SCAN_PIECE).min(n);
            let piece = self.encoded(at..end)?;
            for (k, &e) in piece.iter().enumerate() {
                let pos = at + k as u64;
                // Passing starts below pos (only possible when seq_starts decreases).
                let mut is_start = false;
                while let Some(s) = next_start {
                    if idx + 1 >= m || s > pos {
                        break;
                    }
                    if let Some(p) = prev {
                        if s < p {
                            decreases += 1;
                            first_decrease
                                .get_or_insert_with(|| format!("index {idx}: {p} then {s}"));
                        }
                    }
                    is_start |= s == pos;
                    prev = Some(s);
                    idx += 1;
                    next_start = starts.next(self)?;
                }
                if (e & 1 == 1) != is_start {
                    bad_starts += 1;
                    first_bad_start.get_or_insert_with(|| {
                        format!(
                            "token {pos}: start bit {} but {}a sequence start",
                            e & 1,
                            if is_start { "" } else { "not " }
                        )
                    });
                }
                let id = u64::from(e >> 1);
                max_seen = max_seen.max(id);
                if id > self.max_token_id {
                    bad_ids += 1;
                }
            }
            at = end;
        }
        // The remaining starts must all equal token_count (trailing empty sequences and the
        // end). Damaged metadata can claim billions of entries; counting stops at a limit.
        let mut last = prev;
        let mut misplaced = 0u64;
        let mut truncated = false;
        while let Some(s) = next_start {
            if let Some(p) = prev {
                if s < p {
                    decreases += 1;
                    first_decrease.get_or_insert_with(|| format!("index {idx}: {p} then {s}"));
                }
            }
            if s > token_count {
                beyond += 1;
            } else if s < token_count && idx + 1 < m {
                misplaced += 1;
            }
            prev = Some(s);
            last = Some(s);
            idx += 1;
            if decreases + beyond + misplaced >= MAX_COUNTED && idx + 1 < m {
                truncated = true;
                last = Some(self.seq_starts(m - 1..m)?[0]);
                break;
            }
            next_start = starts.next(self)?;
        }
        let at_least = if truncated { "at least " } else { "" };
        if misplaced > 0 {
            problems.push(format!(
                "{at_least}{misplaced} seq_starts entries after the last token are below \
                 token_count {token_count}"
            ));
        }
        if last != Some(token_count) {
            problems.push(format!(
                "seq_starts[-1] is {}, must equal token_count {token_count}",
                last.map_or("absent".into(), |v| v.to_string())
            ));
        }
        if decreases > 0 {
            let times = if decreases == 1 { "time" } else { "times" };
            problems.push(format!(
                "seq_starts decreases {at_least}{decreases} {times} (first at {})",
                first_decrease.unwrap_or_default()
            ));
        }
        if beyond > 0 {
            problems.push(format!(
                "{at_least}{beyond} seq_starts entries exceed token_count {token_count}"
            ));
        }
        if bad_starts > 0 {
            problems.push(format!(
                "{bad_starts} tokens whose start bit disagrees with seq_starts (first: {})",
                first_bad_start.unwrap_or_default()
            ));
        }
        if bad_ids > 0 {
            problems.push(format!(
                "{bad_ids} token ids exceed max_token_id {} (largest {max_seen})",
                self.max_token_id
            ));
        }
        Ok(())
    }
}

/// Streams a `seq_starts` column in pieces.
struct Scan {
    len: u64,
    next_piece: u64,
    buf: Vec<u64>,
    at: usize,
}

impl Scan {
    fn new(len: u64) -> Scan {
        Scan {
            len,
            next_piece: 0,
            buf: Vec::new(),
            at: 0,
        }
    }
    fn fill(&mut self, s: &Split) -> Result<()> {
        if self.at == self.buf.len() && self.next_piece < self.len {
            let end = (self.next_piece + SCAN_PIECE).min(self.len);
            self.buf = s.seq_starts(self.next_piece..end)?;
            self.next_piece = end;
            self.at = 0;
        }
        Ok(())
    }
    fn peek(&mut self, s: &Split) -> Result<Option<u64>> {
        self.fill(s)?;
        Ok(self.buf.get(self.at).copied())
    }
    fn next(&mut self, s: &Split) -> Result<Option<u64>> {
        let v = self.peek(s)?;
        self.at += usize::from(v.is_some());
        Ok(v)
    }
}

/// Refuses a read of `range` (half-open) from an array of `len` `what`s: a range whose start is
/// after its end is the caller's mistake ([`Error::Invalid`]); one reaching past the end is
/// [`Error::OutOfRange`] naming the first index past the end.
fn check_range(range: &Range<u64>, len: u64, what: &'static str) -> Result<()> {
    if range.start > range.end {
        return Err(Error::Invalid(format!(
            "{what} range from {} up to {}: the start is after the end",
            range.start, range.end
        )));
    }
    if range.end > len {
        return Err(Error::OutOfRange {
            what,
            index: range.start.max(len).min(i64::MAX as u64) as i64,
            len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat_tokens::{Layout, Sharded, Writer, WriterOptions};

    #[test]
    fn only_ranges_that_follow_one_another_are_joined() {
        use zarrs::storage::byte_range::ByteRange::{FromStart, Suffix};
        let got = joined(vec![
            FromStart(10, Some(5)),
            FromStart(15, Some(0)),
            FromStart(15, Some(7)),
            FromStart(23, Some(4)), // a byte apart
            FromStart(27, Some(3)),
            Suffix(8),
            FromStart(30, Some(2)), // after the suffix: not joined across it
            FromStart(32, None),    // to the end of the object: left alone
            FromStart(0, Some(10)), // before the previous range
        ]);
        assert_eq!(
            got,
            vec![
                FromStart(10, Some(12)),
                FromStart(23, Some(7)),
                Suffix(8),
                FromStart(30, Some(2)),
                FromStart(32, None),
                FromStart(0, Some(10)),
            ]
        );
    }

    /// A v3 split of 2,000 tokens in 16-token inner chunks, 256-token shards; the second
    /// sequence is 500 zero ids (encoded 0 after its first token), so some inner chunks, and
    /// all of shard 1, hold only the fill value and are not stored.
    fn v3(root: &Path) -> Split {
        let mut w = Writer::create(
            root,
            "train",
            WriterOptions {
                layout: Some(Layout::V3(Sharded {
                    tokens_per_shard: 256,
                    tokens_per_chunk: 16,
                    ..Default::default()
                })),
                ..Default::default()
            },
        )
        .unwrap();
        let mut seqs: Vec<Vec<u32>> = vec![(1..=37).collect(), vec![0; 500]];
        seqs.extend((0..20u32).map(|i| (0..(i * 13 % 120 + 1)).map(|j| i * 7 + j).collect()));
        let total: usize = seqs.iter().map(Vec::len).sum();
        seqs.push((0..2000 - total as u32).map(|j| j % 50_000).collect());
        w.append(&seqs).unwrap();
        w.finish().unwrap();
        Split::open(root, "train").unwrap()
    }

    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
    }

    #[test]
    fn inner_chunks_are_decoded_directly_and_agree_with_zarrs() {
        let tmp = tempfile::tempdir().unwrap();
        let split = v3(&tmp.path().join("ds.zarr"));
        let direct = |c: &Column| c.index.as_ref().and_then(|i| i.direct);
        assert_eq!(direct(&split.tokens), Some((InnerCodec::Zstd, 4)));
        assert_eq!(direct(&split.starts), Some((InnerCodec::Zstd, 8)));
        // Whole chunks, chunk parts, a range across shards, the array's partial last chunk.
        let ranges = [0..16, 3..29, 40..150, 250..700, 1990..2000, 0..2000, 5..5];
        let f = split.fetch_encoded(&ranges, None).unwrap();
        let direct = f
            .direct
            .as_ref()
            .expect("zstd inner chunks are decoded directly");
        let root = tmp.path().join("ds.zarr/train/encoded_tokens/c");
        assert!(root.join("0").exists() && !root.join("1").exists());
        assert!(direct.located[&15].1.is_none(), "stored with shard 0");
        assert!((16..32).all(|i| direct.located[&i].1.is_none()));
        let decoded = split.decode_encoded(&f, &pool()).unwrap();
        for (r, got) in ranges.iter().zip(&decoded) {
            let by_zarrs = split.encoded(r.clone()).unwrap();
            assert_eq!(got, &by_zarrs, "{r:?}");
            // Into a buffer holding an earlier attempt's bytes: every element is written.
            let mut directly = vec![u32::MAX; by_zarrs.len()];
            assert!(direct
                .decode_into(&f.fetched, r, split.tokens.len(), &mut directly[..])
                .is_some());
            assert_eq!(directly, by_zarrs, "{r:?} decoded directly");
        }
        // seq_starts (u64) too, through read_many.
        let m = split.starts.len();
        let starts = split.seq_starts_many(&[0..m, 1..3], &pool()).unwrap();
        assert_eq!(starts[0], split.starts.read::<u64>(0..m, "s").unwrap());
        assert_eq!(starts[1], split.starts.read::<u64>(1..3, "s").unwrap());
    }

    #[test]
    fn a_damaged_inner_chunk_is_left_to_zarrs_which_names_the_shard() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ds.zarr");
        let split = v3(&root);
        let f = split
            .fetch_encoded(std::slice::from_ref(&(768..1024)), None)
            .unwrap();
        let direct = f.direct.as_ref().unwrap();
        // Overwrite the middle of the first inner chunk of shard 3.
        let (_, at) = direct.located[&48].clone();
        let Some(zarrs::storage::byte_range::ByteRange::FromStart(at, Some(len))) = at else {
            panic!("inner chunk 48 is stored with a known length: {at:?}")
        };
        let shard = root.join("train/encoded_tokens/c/3");
        let mut bytes = std::fs::read(&shard).unwrap();
        for b in &mut bytes[(at + len / 2) as usize..(at + len / 2 + 4) as usize] {
            *b ^= 0x5a;
        }
        std::fs::write(&shard, bytes).unwrap();
        let f = split
            .fetch_encoded(std::slice::from_ref(&(768..1024)), None)
            .unwrap();
        let direct = f.direct.as_ref().unwrap();
        assert!(direct
            .decode_into(&f.fetched, &(768..784), 2000, &mut [0u32; 16])
            .is_none());
        let e = split.decode_encoded(&f, &pool()).unwrap_err().to_string();
        assert!(e.contains("encoded_tokens/c/3"), "{e}");
        // The chunks after it are still decoded directly.
        assert!(direct
            .decode_into(&f.fetched, &(784..1024), 2000, &mut [0u32; 240])
            .is_some());
        // An element type of another size is never decoded directly.
        assert!(direct
            .decode_into(&f.fetched, &(800..810), 2000, &mut [0u64; 10])
            .is_none());
        // A damaged shard index is refused, naming the shard (by a split opened anew: the
        // index this one read is kept, right, as a dataset never changes while open).
        let mut bytes = std::fs::read(&shard).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0xff;
        std::fs::write(&shard, bytes).unwrap();
        assert!(split
            .fetch_encoded(std::slice::from_ref(&(768..1024)), None)
            .is_ok());
        let split = Split::open(&root, "train").unwrap();
        let e = split
            .fetch_encoded(std::slice::from_ref(&(768..1024)), None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("encoded_tokens/c/3") && e.contains("shard index"),
            "{e}"
        );
    }

    #[test]
    fn shard_indexes_are_kept_across_fetches_within_their_budget() {
        let tmp = tempfile::tempdir().unwrap();
        let split = v3(&tmp.path().join("ds.zarr"));
        let kept = |c: &Column| {
            let k = c.kept_indexes.lock().unwrap();
            let mut keys: Vec<String> = k.filled.iter().map(|(key, _)| key.clone()).collect();
            keys.sort();
            (keys, k.bytes)
        };
        let first = split.fetch_encoded(&[0..300, 900..1000], None).unwrap();
        // Shards 0 and 3 (shard 1 holds only the fill value and has no object); 16 inner
        // chunks, 16 bytes each, and a crc32c.
        let index = 16 * 16 + 4;
        let (keys, bytes) = kept(&split.tokens);
        assert_eq!(
            keys,
            ["train/encoded_tokens/c/0", "train/encoded_tokens/c/3"]
        );
        assert_eq!(bytes, 2 * index);
        // A later fetch locates its chunks through the kept indexes: the same bytes.
        let again = split.fetch_encoded(&[0..300, 900..1000], None).unwrap();
        let (a, b) = (
            split.decode_encoded(&first, &pool()).unwrap(),
            split.decode_encoded(&again, &pool()).unwrap(),
        );
        assert_eq!(a, b);
        assert_eq!(a[1], split.encoded(900..1000).unwrap());
        assert_eq!(kept(&split.tokens).1, 2 * index);

        // Beyond the budget the oldest go first, and the count of bytes follows.
        let mut k = KeptIndexes::default();
        let big = KEPT_INDEX_BYTES / 3 + 1;
        for key in ["a", "b", "c", "d"] {
            *k.slot(key).lock().unwrap() = Some(bytes::Bytes::from(vec![0u8; big]));
            k.filled(key, big);
            assert!(k.bytes <= KEPT_INDEX_BYTES);
        }
        assert_eq!(k.bytes, 2 * big);
        let mut left: Vec<&str> = k.slots.keys().map(String::as_str).collect();
        left.sort();
        assert_eq!(left, ["c", "d"]);
        // A slot asked for again after it was dropped starts empty.
        assert!(k.slot("a").lock().unwrap().is_none());
    }

    #[test]
    fn only_known_inner_encodings_are_decoded_directly() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("v2.zarr");
        let mut w = Writer::create(
            &root,
            "train",
            WriterOptions {
                layout: Some(Layout::V2),
                ..Default::default()
            },
        )
        .unwrap();
        w.append(&[vec![1, 2, 3]]).unwrap();
        w.finish().unwrap();
        let split = Split::open(&root, "train").unwrap();
        assert!(
            split.tokens.index.is_none(),
            "seqax's blosc chunks go through zarrs"
        );
        // Sharded arrays built by hand: raw inner chunks, crc32c after zstd, big-endian.
        use zarrs::array::codec::{BytesCodec, Crc32cCodec, ZstdCodec};
        let store: Arc<Storage> = Arc::new(FilesystemStore::new(tmp.path()).unwrap());
        let build =
            |name: &str,
             bytes: BytesCodec,
             after: Vec<Arc<dyn zarrs::array::codec::api::BytesToBytesCodecTraits>>| {
                let a = zarrs::array::ArrayBuilder::new(
                    vec![100],
                    vec![std::num::NonZeroU64::new(50).unwrap()],
                    data_type::uint32(),
                    zarrs::array::FillValue::from(0u32),
                )
                .subchunk_shape(vec![10u64])
                .array_to_bytes_codec(Arc::new(bytes))
                .bytes_to_bytes_codecs(after)
                .build(store.clone(), &format!("/{name}"))
                .unwrap();
                ShardIndex::of(&a).and_then(|i| i.direct)
            };
        let little = || BytesCodec::little();
        assert_eq!(build("raw", little(), vec![]), Some((InnerCodec::Raw, 4)));
        let zstd = || Arc::new(ZstdCodec::new(3, true)) as Arc<_>;
        assert_eq!(
            build("z", little(), vec![zstd()]),
            Some((InnerCodec::Zstd, 4))
        );
        let crc = Arc::new(Crc32cCodec::new()) as Arc<_>;
        assert_eq!(build("crc", little(), vec![zstd(), crc]), None);
        assert_eq!(build("big", BytesCodec::big(), vec![]), None);
    }
}
