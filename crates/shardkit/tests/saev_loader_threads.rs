//! In a process of its own (other tests would add threads): dropping a stream joins its threads
//! (prefetch and lanes); the loader's gather pool, kept across epochs, goes with the loader.

use shardkit::engine::Order;
use shardkit::json;
use shardkit::saev::{LayerSel, Loader, LoaderOptions, Metadata, Writer, WriterOptions};

/// Threads whose name starts with `prefix`.
fn threads(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

/// The threads of a running stream (the gather pool belongs to the loader).
fn stream_threads() -> usize {
    threads("shardkit-lane") + threads("shardkit-prefetch")
}

/// shardkit threads still listed once those just joined have left /proc: `join` returns when
/// the kernel clears the thread's id during its exit, a moment before its /proc/self/task entry
/// goes (seen under load in CI). A thread that had not stopped would stay listed.
fn threads_after_exit(count: impl Fn() -> usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let n = count();
        if n == 0 || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn dropping_a_stream_mid_epoch_stops_its_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let md = Metadata::for_writing(
        &json::parse(
            br#"{"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 8,
            "cls_token": false, "d_model": 4, "n_examples": 64, "max_tokens_per_shard": 64,
            "data": "d", "dataset": "t", "protocol": "2.1"}"#,
        )
        .unwrap(),
    )
    .unwrap();
    let mut w = Writer::create(tmp.path(), md, WriterOptions::default()).unwrap();
    w.write(&vec![1.0f32; 64 * 8 * 4], None).unwrap();
    let dir = w.finish().unwrap();
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        let mut o = LoaderOptions::new(LayerSel::Value(0));
        o.order = order;
        o.batch_size = 4;
        o.memory_budget = Some(4096);
        o.rank = Some(0);
        o.world_size = Some(1);
        let loader = Loader::new(&dir, o).unwrap();
        for _ in 0..20 {
            let mut it = loader.iter().unwrap();
            it.next().unwrap().unwrap();
            assert!(stream_threads() > 0);
            drop(it); // stops and joins the prefetch and lane threads
            assert_eq!(threads_after_exit(stream_threads), 0, "{order:?}");
        }
        assert!(threads("shardkit-gather") > 0);
        drop(loader);
        assert_eq!(threads_after_exit(|| threads("shardkit-")), 0, "{order:?}");
    }
}
