//! The flat-tokens split of the parts tests (tests/flat_tokens_parts.rs and its object-store
//! twin tests/flat_tokens_parts_s3.rs): 1000 sequences in units of 37, written whole or in
//! parts.

use std::collections::BTreeMap;
use std::path::Path;

use super::rank;
use shardkit::flat_tokens::{Layout, PartOptions, PartWriter, Sharded, Writer, WriterOptions};
use shardkit::Error;

pub const TOTAL: u64 = 1000;
pub const PER_UNIT: u64 = 37; // 28 units, the last one short

/// Sequence `i`: 0 to 40 tokens (some empty), ids from `i`.
pub fn seq(i: u64) -> Vec<u32> {
    let len = (i * 7919 % 41) as u32;
    (0..len)
        .map(|t| (i as u32 * 31 + t * 17) % 50_000 + 1)
        .collect()
}

/// Sequences `r`, as [`seq`] makes them.
pub fn seqs(r: std::ops::Range<u64>) -> Vec<Vec<u32>> {
    r.map(seq).collect()
}

/// A v3 layout small enough that the split spans several shards and chunks.
pub fn small_v3() -> Layout {
    Layout::V3(Sharded {
        tokens_per_shard: 4096,
        tokens_per_chunk: 512,
        starts_per_shard: 256,
        starts_per_chunk: 64,
        zstd_level: 3,
    })
}

/// Part options of `layout`, in units of [`PER_UNIT`] sequences.
pub fn options(layout: Layout) -> PartOptions {
    PartOptions {
        layout: Some(layout),
        sequences_per_unit: PER_UNIT,
    }
}

/// One `Writer` writes the split `train` at `root` (a directory or a URL), 100 at a time.
pub fn single(root: impl AsRef<Path>, layout: Layout) {
    let opts = WriterOptions {
        layout: Some(layout),
        ..WriterOptions::default()
    };
    let mut w = Writer::create(root, "train", opts).unwrap();
    for c in (0..TOTAL).step_by(100) {
        w.append(&seqs(c..(c + 100).min(TOTAL))).unwrap();
    }
    w.finish().unwrap();
}

/// Writes `w`'s pending sequences in batches of 7, finishing it.
pub fn write_all(mut w: PartWriter) -> shardkit::Result<shardkit::PartsStatus> {
    for r in w.pending().to_vec() {
        let mut at = r.start;
        while at < r.end {
            let end = (at + 7).min(r.end);
            w.append(&seqs(at..end))?;
            at = end;
        }
    }
    w.finish()
}

/// Ranks `0..world` write the split at `root` on threads, together; their statuses.
pub fn write_ranks(root: &Path, layout: Layout, world: u64) -> Vec<shardkit::PartsStatus> {
    // Each its own locks and claims, as processes would have.
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    let w =
                        PartWriter::create(root, "train", TOTAL, options(layout), rank(r, world))
                            .unwrap();
                    write_all(w).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Checks rank 1 of 2 with another configuration is refused at `root`, nothing written.
pub fn assert_other_configurations_refused<T: PartialEq>(root: &Path, written: impl Fn() -> T) {
    // Rank 0 of 2 with `options(small_v3())` holds the split; each case differs in one key,
    // which the refusal names with flat_tokens.json; `written` reads what is there.
    let before = written();
    let cases: [(u64, PartOptions, &str); 4] = [
        (TOTAL + 1, options(small_v3()), "total_sequences"),
        (
            TOTAL,
            PartOptions {
                sequences_per_unit: 40,
                ..options(small_v3())
            },
            "sequences_per_unit",
        ),
        (TOTAL, options(Layout::default()), "tokens_per_shard"),
        (TOTAL, options(Layout::V2), "layout"),
    ];
    for (total, opts, key) in cases {
        let e = PartWriter::create(root, "train", total, opts, rank(1, 2)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Exists { .. }), "{e:?}");
        assert!(
            msg.contains(&format!("{key:?}")) && msg.contains("flat_tokens.json"),
            "{key}: {msg}"
        );
        assert!(written() == before, "{key}: something was written");
    }
}

/// The names of a tree of files or objects.
pub fn names(t: &BTreeMap<String, Vec<u8>>) -> Vec<&String> {
    t.keys().collect()
}
