//! Bulk reads of a column: [`Column::fetch`] gathers every stored byte a list of ranges
//! needs (whole chunks, or a shard's inner chunks as one request list per shard, located
//! through the shard's index, which is kept between calls), then [`Column::decode`] decodes
//! them in pieces over a thread pool, decoding `bytes` and `bytes`+`zstd` inner chunks
//! directly rather than through zarrs' codec pipeline.

use std::ops::Range;
use std::sync::Arc;

use zarrs::array::codec::api::CodecOptions;
use zarrs::array::{
    Array, ArrayShardedExt, ArrayShardedReadableExt, ArrayShardedReadableExtCache, ArraySubset,
    ElementOwned,
};
use zarrs::storage::StoreKey;

use super::prefetch::Prefetched;
use super::{check_range, Column};
use crate::error::{Error, Result};

/// Bytes of shard indexes [`Column::fetch`] keeps between calls: 512 default flat-tokens
/// token shards (128 KiB of index each, 8 Gi tokens).
const KEPT_INDEX_BYTES: usize = 64 << 20;

/// Shard indexes by shard key, the oldest dropped first beyond [`KEPT_INDEX_BYTES`]. A
/// committed dataset's shards never change while it is open, so a kept index stays right.
/// Each key has a slot that its fetch holds locked: groups fetched at once that meet the same
/// shard wait for one request rather than each making its own.
#[derive(Default)]
pub(super) struct KeptIndexes {
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

/// Encodings of a sharded array's inner chunks that [`Column::decode`] decodes directly (one
/// reused zstd context per thread, straight into the output) instead of through zarrs' codec
/// pipeline, which sets up a decoder and its bookkeeping for every few-KiB inner chunk and
/// was most of the cost of a flat-tokens buffer read. Anything else goes through zarrs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum InnerCodec {
    /// `bytes` (little-endian) alone.
    Raw,
    /// `bytes` (little-endian), then `zstd`.
    Zstd,
}

impl InnerCodec {
    /// The direct decoding that suits an exclusively sharded array of metadata `meta`, with
    /// its element size: 32- or 64-bit unsigned integers stored little-endian, maybe
    /// zstd-compressed, whose fill value is 0.
    pub(super) fn of(meta: &serde_json::Value) -> Option<(InnerCodec, usize)> {
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

impl Column {
    /// Elements `ranges`, read together: [`Column::fetch`], then [`Column::decode`].
    pub(super) fn read_many<T: ElementOwned + bytemuck::Pod + Send>(
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
    pub(super) fn fetch(
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
    pub(super) fn decode<T: ElementOwned + bytemuck::Pod + Send>(
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use zarrs::array::data_type;
    use zarrs::filesystem::FilesystemStore;

    use super::super::column::ShardIndex;
    use super::super::{Split, Storage};
    use super::*;
    use crate::flat_tokens::{Layout, Sharded, Writer, WriterOptions};

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
