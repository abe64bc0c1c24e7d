//! Faults and memory, each in this process of its own: a shard that shrinks or disappears
//! mid-epoch is an error naming it (never wrong data, never a hang), and peak memory stays
//! within the budget plus 256 MiB.

use std::path::{Path, PathBuf};

use shardkit::engine::Order;
use shardkit::json;
use shardkit::saev::{LayerSel, Loader, LoaderOptions, Metadata, Writer, WriterOptions};
use shardkit::Error;

/// `n` examples of 1 layer x 64 tokens x 256 dims (64 KiB each), `eps` per shard.
fn dataset(root: &Path, n: u64, eps: u64) -> PathBuf {
    let md = Metadata::for_writing(
        &json::parse(
            format!(
                r#"{{"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 64,
                "cls_token": false, "d_model": 256, "n_examples": {n}, "max_tokens_per_shard": {},
                "data": "d", "dataset": "t", "protocol": "2.1"}}"#,
                eps * 64
            )
            .as_bytes(),
        )
        .unwrap(),
    )
    .unwrap();
    let mut w = Writer::create(root, md, WriterOptions::default()).unwrap();
    let example: Vec<f32> = (0..64 * 256).map(|i| i as f32).collect();
    for _ in 0..n {
        w.write(&example, None).unwrap();
    }
    w.finish().unwrap()
}

fn opts(order: Order, budget: u64) -> LoaderOptions {
    let mut o = LoaderOptions::new(LayerSel::Value(0));
    o.order = order;
    o.batch_size = 256;
    o.memory_budget = Some(budget);
    o.rank = Some(0);
    o.world_size = Some(1);
    o
}

#[test]
fn a_shard_that_shrinks_or_vanishes_is_an_error_naming_it() {
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = dataset(tmp.path(), 64, 16);
        let loader = Loader::new(&dir, opts(order, 1 << 20)).unwrap();
        let victim = dir.join("acts000002.bin");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&victim)
            .unwrap();
        f.set_len(1000).unwrap();
        let err = loader
            .iter()
            .unwrap()
            .find_map(|b| b.err())
            .expect("reading a truncated shard must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("acts000002.bin") && msg.contains("shrank"),
            "{order:?}: {msg}"
        );

        let err = Loader::new(&dir, opts(order, 1 << 20))
            .expect_err("a truncated dataset is refused at open");
        assert!(
            matches!(&err, Error::Format { path, .. } if path.ends_with("acts000002.bin")),
            "{order:?}: {err:?}"
        );

        let tmp = tempfile::tempdir().unwrap();
        let dir = dataset(tmp.path(), 64, 16);
        let loader = Loader::new(&dir, opts(order, 1 << 20)).unwrap();
        std::fs::remove_file(dir.join("acts000003.bin")).unwrap();
        let err = loader
            .iter()
            .unwrap()
            .find_map(|b| b.err())
            .expect("must fail");
        assert!(
            err.to_string().contains("acts000003.bin"),
            "{order:?}: {err}"
        );
    }
}

/// A field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The loader's own memory stays within its budget: anonymous memory (what it allocates) in
/// the default mode, where data in the page cache is mapped rather than copied (mapped file
/// pages count as RssFile, not RssAnon); and all memory with `direct_io`, which maps nothing.
#[test]
fn memory_stays_within_the_budget() {
    // 512 MiB of data streamed with a 32 MiB budget, three times over.
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path(), 8192, 1024);
    let budget = 32u64 << 20;
    let slack = 256u64 << 20;
    // direct_io first: the peak RSS (VmHWM) it checks must not include the mapped run.
    for direct in [true, false] {
        let before_anon = status_bytes("RssAnon:");
        let before_hwm = status_bytes("VmHWM:");
        let mut peak_anon = before_anon;
        for order in [Order::Sequential, Order::Block, Order::Exact] {
            let mut o = opts(order, budget);
            o.direct_io = direct;
            let loader = Loader::new(&dir, o).unwrap();
            let mut rows = 0;
            for b in loader.iter().unwrap() {
                rows += b.unwrap().n;
                peak_anon = peak_anon.max(status_bytes("RssAnon:"));
            }
            assert_eq!(rows, 8192 * 64);
        }
        let grown = peak_anon.saturating_sub(before_anon);
        assert!(
            grown <= budget + slack,
            "direct_io {direct}: peak anonymous memory grew by {} MiB with a {} MiB budget",
            grown >> 20,
            budget >> 20
        );
        if direct {
            let grown = status_bytes("VmHWM:").saturating_sub(before_hwm);
            assert!(
                grown <= budget + slack,
                "direct_io: peak RSS grew by {} MiB with a {} MiB budget",
                grown >> 20,
                budget >> 20
            );
        }
    }
}
