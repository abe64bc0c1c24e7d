//! Loading a step reads only that step's rows: at most `rows × (ceil(len / chunk) + 1)` chunks
//! (inner chunks when sharded), and only chunks those rows overlap (flat_tokens.md §9.6, §10.5).
//! Reads are counted by a storage adapter between zarrs and the file system.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::flat_tokens::{Layout, LoaderOptions, Sharded, Split, TokenLoader, Writer};
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::byte_range::{ByteRange, ByteRangeIterator};
use zarrs::storage::{MaybeBytesIterator, ReadableStorageTraits, StorageError, StoreKey};

/// Records every read: (key, byte range).
struct Counting {
    inner: FilesystemStore,
    reads: Mutex<Vec<(String, ByteRange)>>,
    /// While set, a read made while a read-ahead thread is alive waits (see
    /// [`read_ahead_threads`]): that thread cannot finish, so it is seen.
    hold_read_ahead: std::sync::atomic::AtomicBool,
}

impl ReadableStorageTraits for Counting {
    fn get_partial_many<'a>(
        &'a self,
        key: &StoreKey,
        byte_ranges: ByteRangeIterator<'a>,
    ) -> Result<MaybeBytesIterator<'a>, StorageError> {
        let ranges: Vec<ByteRange> = byte_ranges.collect();
        while self.hold_read_ahead.load(Ordering::SeqCst) && read_ahead_threads() > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.reads
            .lock()
            .unwrap()
            .extend(ranges.iter().map(|r| (key.as_str().to_string(), *r)));
        self.inner
            .get_partial_many(key, Box::new(ranges.into_iter()))
    }
    fn size_key(&self, key: &StoreKey) -> Result<Option<u64>, StorageError> {
        self.inner.size_key(key)
    }
    fn supports_get_partial(&self) -> bool {
        self.inner.supports_get_partial()
    }
}

fn write(root: &Path, layout: Layout) {
    let mut w = Writer::create(
        root,
        "train",
        crate::flat_tokens::WriterOptions {
            layout: Some(layout),
            ..Default::default()
        },
    )
    .unwrap();
    // 40 sequences of 1..=1000 tokens, ids 1..=997: about 20 K tokens.
    let seqs: Vec<Vec<u32>> = (0..40u32)
        .map(|i| {
            (0..(i * 97 % 1000 + 1))
                .map(|j| (i * 31 + j) % 997 + 1)
                .collect()
        })
        .collect();
    w.append(&seqs).unwrap();
    w.finish().unwrap();
}

fn counted(root: &Path) -> (Arc<Counting>, Split) {
    let store = Arc::new(Counting {
        inner: FilesystemStore::new(root).unwrap(),
        reads: Mutex::default(),
        hold_read_ahead: Default::default(),
    });
    let split = Split::open_in_store(store.clone(), root, "train").unwrap();
    store.reads.lock().unwrap().clear();
    (store, split)
}

/// The dataset of [`write`] sharded in 256 tokens, 16-token inner chunks, in a temporary
/// directory (kept while the first value lives).
fn sharded_16_256() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    write(
        &root,
        Layout::V3(Sharded {
            tokens_per_shard: 256,
            tokens_per_chunk: 16,
            ..Default::default()
        }),
    );
    (tmp, root)
}

/// This process's threads: id and name.
fn threads() -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let t = t.ok()?;
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            Some((
                t.file_name().to_string_lossy().into_owned(),
                name.trim_end().to_string(),
            ))
        })
        .collect()
}

/// Live threads reading a shuffle buffer ahead (`shardkit-buffer`; a thread takes its name
/// when it starts, before it reads).
fn read_ahead_threads() -> usize {
    threads()
        .values()
        .filter(|name| *name == "shardkit-buffer")
        .count()
}

fn options() -> LoaderOptions {
    let mut o = LoaderOptions::new(40, 8);
    o.sequences_per_read_block = Some(4);
    o.read_blocks_per_shuffle_buffer = 4;
    o.seed = 9;
    o
}

#[test]
fn a_sharded_step_reads_only_the_inner_chunks_of_its_rows() {
    let (_tmp, root) = sharded_16_256();
    let chunk = 16u64;
    let (store, split) = counted(&root);
    let loader = TokenLoader::new(split, options()).unwrap();
    for step in [0, 5, loader.info().step_count - 1] {
        store.reads.lock().unwrap().clear();
        let batch = loader.load(step).unwrap();
        let reads = store.reads.lock().unwrap().clone();
        // Inner chunks are read as bounded ranges; shard indexes as suffixes (once per shard).
        let data: Vec<_> = reads
            .iter()
            .filter(|(k, r)| k.contains("encoded_tokens/c/") && !matches!(r, ByteRange::Suffix(_)))
            .collect();
        let rows = batch.rows.len() as u64;
        let bound = rows * (40u64.div_ceil(chunk) + 1);
        // Inner chunks the rows overlap, and the shards holding them.
        let mut needed = BTreeSet::new();
        for &r in &batch.rows {
            needed.extend((r * 40 / chunk)..=((r + 1) * 40 - 1) / chunk);
        }
        let shards: BTreeSet<String> = needed
            .iter()
            .map(|c| format!("train/encoded_tokens/c/{}", c * chunk / 256))
            .collect();
        assert!(
            data.len() as u64 <= bound && data.len() >= needed.len(),
            "step {step}: {} inner-chunk reads for {} needed, bound {bound}",
            data.len(),
            needed.len()
        );
        assert!(
            data.iter().all(|(k, _)| shards.contains(k)),
            "step {step}: a read outside the rows' shards: {data:?}"
        );
        assert!(
            reads
                .iter()
                .all(|(k, _)| k.starts_with("train/encoded_tokens/")),
            "step {step}: packed rows never read seq_starts: {reads:?}"
        );
    }
}

#[test]
fn a_v2_step_reads_only_the_chunks_its_rows_overlap() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    write(&root, Layout::V2);
    let (store, split) = counted(&root);
    let loader = TokenLoader::new(split, options()).unwrap();
    let batch = loader.load(2).unwrap();
    let reads = store.reads.lock().unwrap().clone();
    // One 4 Mi-token chunk holds everything: it is read once (decoded chunks are cached).
    assert_eq!(
        reads,
        [(
            "train/encoded_tokens/0".to_string(),
            ByteRange::FromStart(0, None)
        )]
    );
    assert_eq!(batch.rows.len(), 8);
}

/// Every step of `loader`'s first epoch and a few of its second.
fn all_steps(loader: &TokenLoader) -> Vec<crate::flat_tokens::TokenBatch> {
    let n = loader.info().step_count;
    (0..n + 3).map(|s| loader.load(s).unwrap()).collect()
}

#[test]
fn buffers_in_memory_serve_the_same_batches_as_rows_read_one_by_one() {
    let sharded = Layout::V3(Sharded {
        tokens_per_shard: 256,
        tokens_per_chunk: 16,
        starts_per_shard: 16,
        starts_per_chunk: 4,
        ..Default::default()
    });
    for (name, layout) in [("v3", sharded), ("v2", Layout::V2)] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ds.zarr");
        write(&root, layout);
        for packing in [
            crate::flat_tokens::Packing::Packed,
            crate::flat_tokens::Packing::Unpacked,
        ] {
            // Two streams, the second of two hosts: several minipochs, rows of both streams.
            for (streams, host) in [(1, 0), (2, 1)] {
                let mut o = options();
                o.packing = packing;
                o.streams = streams;
                (o.rank, o.world_size) = (Some(host), Some(2)); // seqax's host_index, host_count
                o.epochs = true;
                if packing == crate::flat_tokens::Packing::Unpacked {
                    o.sequences_per_read_block = Some(2);
                    o.read_blocks_per_shuffle_buffer = 3;
                }
                let load = |in_memory| {
                    let mut o = o.clone();
                    o.buffer_in_memory = Some(in_memory);
                    let loader = TokenLoader::new(Split::open(&root, "train").unwrap(), o).unwrap();
                    assert_eq!(loader.info().buffers_in_memory, in_memory);
                    all_steps(&loader)
                };
                let (rows, buffered) = (load(false), load(true));
                assert_eq!(rows.len(), buffered.len());
                for (a, b) in rows.iter().zip(&buffered) {
                    assert!(
                        a == b,
                        "{name} {packing:?} S={streams}: step {} differs",
                        a.step
                    );
                }
                // The iterator (steps prepared ahead, across minipochs) gives the same.
                let mut o2 = o.clone();
                o2.buffer_in_memory = Some(true);
                let loader = TokenLoader::new(Split::open(&root, "train").unwrap(), o2).unwrap();
                let n = loader.info().step_count as usize;
                let streamed: Vec<_> = loader.iter(0).take(n + 3).map(|b| b.unwrap()).collect();
                assert!(
                    streamed == buffered,
                    "{name} {packing:?}: iter differs from load"
                );
            }
        }
    }
}

#[test]
fn a_buffer_in_memory_fetches_each_inner_chunk_once_and_serves_its_steps() {
    let (_tmp, root) = sharded_16_256();
    let chunk = 16u64;
    let (store, split) = counted(&root);
    let mut o = options();
    o.buffer_in_memory = Some(true);
    let loader = TokenLoader::new(split, o).unwrap();
    // R·B = 16 rows a stream per minipoch, 8 a step: steps 0 and 1 share a buffer.
    let schedule = loader.schedule();
    let blocks = schedule.buffer_blocks(0, 0);
    assert_eq!(blocks.len(), 4);
    let first = loader.load(0).unwrap();
    let reads = store.reads.lock().unwrap().clone();
    // The buffer's blocks (4 rows of 40 tokens each) and the inner chunks they lie in.
    let mut needed = BTreeSet::new();
    for &k in &blocks {
        needed.extend((k * 4 * 40) / chunk..=((k + 1) * 4 * 40 - 1) / chunk);
    }
    // Where each needed inner chunk lies, from its shard's index (16 inner chunks of 16
    // tokens a shard; the index at the end: (offset, length) u64 pairs, then a crc32c).
    let mut wanted: Vec<(String, u64, u64)> = Vec::new();
    for c in &needed {
        let key = format!("train/encoded_tokens/c/{}", c / 16);
        let shard = std::fs::read(root.join(&key)).unwrap();
        let index = &shard[shard.len() - 16 * 16 - 4..];
        let word = |i: usize| u64::from_le_bytes(index[8 * i..8 * i + 8].try_into().unwrap());
        let local = (c % 16) as usize;
        wanted.push((key, word(2 * local), word(2 * local + 1)));
    }
    // What was fetched: data ranges (not the indexes at the ends), in order per shard.
    let mut fetched: Vec<(String, u64, u64)> = reads
        .iter()
        .filter_map(|(k, r)| match r {
            ByteRange::FromStart(o, Some(n)) if k.contains("encoded_tokens/c/") => {
                Some((k.clone(), *o, *n))
            }
            _ => None,
        })
        .collect();
    fetched.sort();
    wanted.sort();
    // The bytes of exactly the needed inner chunks, each once: the fetched ranges, which
    // join inner chunks that follow one another in a shard into one read, cover them.
    let bytes = |ranges: &[(String, u64, u64)]| -> BTreeSet<(String, u64)> {
        let mut all = BTreeSet::new();
        for (k, o, n) in ranges {
            for b in *o..o + n {
                assert!(
                    all.insert((k.clone(), b)),
                    "byte {b} of {k} fetched twice: {reads:?}"
                );
            }
        }
        all
    };
    assert_eq!(bytes(&fetched), bytes(&wanted), "{reads:?}");
    assert!(
        fetched.len() < wanted.len(),
        "inner chunks that follow one another are fetched in one read: {reads:?}"
    );
    assert!(first.rows.iter().all(|r| blocks.contains(&(r / 4))));
    // The next step draws from the same buffer: no reads at all.
    store.reads.lock().unwrap().clear();
    let second = loader.load(1).unwrap();
    assert!(store.reads.lock().unwrap().is_empty());
    assert!(second.rows.iter().all(|r| blocks.contains(&(r / 4))));
}

#[test]
fn buffers_in_memory_read_inner_chunks_and_shards_a_zero_run_left_unstored() {
    // 600 zero ids after a start: inner chunks, and shard 1 whole, hold only the fill value,
    // so the writer stores none of them (zarr's store_empty_chunks = false).
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    let mut w = Writer::create(
        &root,
        "train",
        crate::flat_tokens::WriterOptions {
            layout: Some(Layout::V3(Sharded {
                tokens_per_shard: 256,
                tokens_per_chunk: 16,
                ..Default::default()
            })),
            ..Default::default()
        },
    )
    .unwrap();
    let mut seqs = vec![(1..=90).collect::<Vec<u32>>(), vec![0; 600]];
    seqs.extend((0..30u32).map(|i| (0..i * 11 % 70 + 1).map(|j| i + j + 1).collect()));
    w.append(&seqs).unwrap();
    w.finish().unwrap();
    assert!(!root.join("train/encoded_tokens/c/1").exists());
    let mut o = LoaderOptions::new(32, 4);
    o.sequences_per_read_block = Some(4);
    o.read_blocks_per_shuffle_buffer = 8;
    o.epochs = true;
    let load = |in_memory| {
        let mut o = o.clone();
        o.buffer_in_memory = Some(in_memory);
        let loader = TokenLoader::new(Split::open(&root, "train").unwrap(), o).unwrap();
        all_steps(&loader)
    };
    let (rows, buffered) = (load(false), load(true));
    assert!(
        rows == buffered,
        "buffers in memory differ from rows read one by one"
    );
    let zeros = buffered
        .iter()
        .flat_map(|b| b.arrays().encoded)
        .filter(|&&e| e == 0);
    assert!(zeros.count() >= 500, "the zero run is served");
}

#[test]
fn streaming_reads_the_next_minipochs_buffer_ahead_and_load_does_not() {
    let (_tmp, root) = sharded_16_256();
    let mut o = options();
    o.buffer_in_memory = Some(true);
    // Minipoch 0 holds steps 0..20: more than the iterator prepares ahead (about 10 with
    // the batches in its channels), so reads past the first minipoch's come from the
    // read-ahead alone.
    o.read_blocks_per_shuffle_buffer = 40;
    let reads = |store: &Counting| store.reads.lock().unwrap().len();
    // A direct load reads its minipoch's buffer, and nothing more after it returns.
    let (store, split) = counted(&root);
    store.hold_read_ahead.store(true, Ordering::SeqCst);
    let loader = TokenLoader::new(split, o.clone()).unwrap();
    let schedule = loader.schedule();
    assert!(schedule.minipochs() >= 3);
    assert!(
        (0..8).all(|b| schedule.buffer_of(7, b).0 == 0),
        "steps 0..8 in minipoch 0"
    );
    // The last step first: it starts the loader's threads, and has no minipoch after it.
    loader.load(loader.info().step_count - 1).unwrap();
    let (before, warm) = (threads(), reads(&store));
    loader.load(0).unwrap();
    // A read ahead runs on a thread `load` would start, and the store holds its reads while it
    // is alive (`hold_read_ahead`), so it would still be listed after `load` returned. Only
    // `load`'s own fetch lanes may be, joined but not yet gone from /proc.
    let started: Vec<String> = threads()
        .into_iter()
        .filter(|(id, name)| !before.contains_key(id) && name != "shardkit-fetch")
        .map(|(id, name)| format!("{id} {name}"))
        .collect();
    assert!(
        started.is_empty(),
        "load started threads (a read ahead): {started:?}"
    );
    let first_minipoch = reads(&store) - warm;
    assert!(first_minipoch > 0);
    // Streaming: after the first batch, minipoch 1's buffer is read without being asked for.
    let (store, split) = counted(&root);
    let loader = TokenLoader::new(split, o).unwrap();
    let mut it = loader.iter(0);
    let first = it.next().unwrap().unwrap();
    // Waits for the read ahead's first request: it comes with no further step asked for. (The
    // deadline only turns a missing read ahead into a failure instead of a hang.)
    let t0 = std::time::Instant::now();
    while reads(&store) <= first_minipoch {
        assert!(
            t0.elapsed().as_secs() < 60,
            "minipoch 1's buffer was never read ahead"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Every batch of the epoch still comes, in order, equal to direct loads.
    let mut all = vec![first];
    all.extend(it.map(|b| b.unwrap()));
    assert_eq!(all.len() as u64, loader.info().step_count);
    let direct = TokenLoader::new(
        Split::open(&root, "train").unwrap(),
        loader.options().clone(),
    )
    .unwrap();
    for b in &all {
        assert!(b == &direct.load(b.step).unwrap(), "step {}", b.step);
    }
}
