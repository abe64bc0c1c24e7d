//! The saev datasets of the parts and follow tests (tests/saev_parts.rs, saev_parts_s3.rs,
//! saev_follow.rs and follow_s3.rs): 2 layers (3 and 7), CLS + 3 content tokens, d_model 4,
//! 2 examples per shard, every value and label coded from where it lies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::rank;
use shardkit::engine::Order;
use shardkit::saev::{
    Batch, Batches, FollowOptions, LayerSel, Loader, LoaderOptions, LoaderState, Metadata,
    PartWriter, Writer, WriterOptions,
};

/// The examples of the follow tests' dataset (20 shards).
pub const FOLLOW_N: u64 = 40;
/// Examples per shard.
pub const EPS: u64 = 2;
pub const EV: usize = 2 * 4 * 4; // values of one example: L x T x D

/// `n_examples` examples, 2 layers, CLS + 3 content tokens, d_model 4; 2 examples per shard.
pub fn metadata(n_examples: u64) -> Metadata {
    let md = format!(
        r#"{{"family": "clip", "ckpt": "x", "layers": [3, 7], "content_tokens_per_example": 3,
        "cls_token": true, "d_model": 4, "n_examples": {n_examples}, "max_tokens_per_shard": 16,
        "data": "d", "dataset": "t", "protocol": "2.1"}}"#
    );
    Metadata::for_writing(&shardkit::json::parse(md.as_bytes()).unwrap()).unwrap()
}

/// The activations of `examples`: value `v` of example `e` is `1000 e + v`.
pub fn acts(examples: std::ops::Range<u64>) -> Vec<f32> {
    examples
        .flat_map(|e| (0..EV).map(move |v| (e * 1000 + v as u64) as f32))
        .collect()
}

/// [`acts`] with every kind of value a rounding to bfloat16 / float16 must handle (`n` >= 2):
/// ties, a float32 subnormal, NaN, ±inf, a value beyond float16's range, zeros.
#[allow(dead_code)] // used by the reduced-precision tests only
pub fn hard_acts(n: u64) -> Vec<f32> {
    let mut a: Vec<f32> = acts(0..n)
        .iter()
        .enumerate()
        .map(|(i, v)| (v + 0.1) * (1.0 + i as f32 * 1e-3) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    a[1] = 1.0 + f32::powi(2.0, -8); // a bfloat16 tie
    a[2] = 1e-40; // a float32 subnormal
    a[5] = f32::NAN;
    a[6] = f32::INFINITY;
    a[7] = f32::NEG_INFINITY;
    a[9] = 0.0;
    a[40] = 1e5; // beyond float16's largest value
    a
}

/// The label of example `e`'s content token `c`, as written.
pub fn label(e: u64, c: u64) -> u8 {
    (e * 7 + c) as u8
}

/// The labels of `examples`' content tokens.
pub fn labels(examples: std::ops::Range<u64>) -> Vec<u8> {
    examples
        .flat_map(|e| (0..3).map(move |c| label(e, c)))
        .collect()
}

/// One `Writer` writes `n` examples (with labels or not) under `root`; the dataset's path.
pub fn single(root: &Path, n: u64, with_labels: bool) -> PathBuf {
    let mut w = Writer::create(root, metadata(n), WriterOptions::default()).unwrap();
    let l = labels(0..n);
    w.write(&acts(0..n), with_labels.then_some(&l[..])).unwrap();
    w.finish().unwrap()
}

/// Writes `w`'s pending examples in batches of 3, finishing it.
pub fn write_all(mut w: PartWriter, with_labels: bool) -> shardkit::PartsStatus {
    for r in w.pending().to_vec() {
        let mut at = r.start;
        while at < r.end {
            let end = (at + 3).min(r.end);
            let l = labels(at..end);
            w.write(&acts(at..end), with_labels.then_some(&l[..]))
                .unwrap();
            at = end;
        }
    }
    w.finish().unwrap()
}

/// Writes shard `s` (its examples, with labels) through `w`, whose next example it must be.
pub fn write_shard(w: &mut PartWriter, s: u64) {
    assert_eq!(w.next_example(), Some(s * EPS));
    w.write(
        &acts(s * EPS..(s + 1) * EPS),
        Some(&labels(s * EPS..(s + 1) * EPS)),
    )
    .unwrap();
}

/// Ranks 0 and 1 of 2 under `root`, after round 1 (shards 0, 1, 2 and 10, 11); the dataset.
pub fn two_ranks_after_round_1(root: impl AsRef<Path>) -> (PartWriter, PartWriter, PathBuf) {
    let root = root.as_ref();
    let mut a = PartWriter::create(root, metadata(FOLLOW_N), rank(0, 2)).unwrap();
    let mut b = PartWriter::create(root, metadata(FOLLOW_N), rank(1, 2)).unwrap();
    let dir = a.path().to_path_buf();
    for s in [0, 1, 2] {
        write_shard(&mut a, s);
    }
    for s in [10, 11] {
        write_shard(&mut b, s);
    }
    (a, b, dir)
}

/// Each writer writing its shards every few milliseconds on a thread, then finishing.
pub fn write_meanwhile(
    writers: Vec<PartWriter>,
) -> Vec<std::thread::JoinHandle<shardkit::PartsStatus>> {
    writers
        .into_iter()
        .map(|mut w| {
            std::thread::spawn(move || {
                let shards = w.examples().start / EPS..w.examples().end / EPS;
                for s in shards {
                    std::thread::sleep(Duration::from_millis(10));
                    write_shard(&mut w, s);
                }
                w.finish().unwrap()
            })
        })
        .collect()
}

/// Loader options: layer 3, batches of 4, seed 7, one thread; follow mode if `follow`.
pub fn options(follow: bool, order: Order) -> LoaderOptions {
    let mut o = LoaderOptions::new(LayerSel::Value(3));
    o.batch_size = 4;
    o.order = order;
    o.seed = 7;
    // Windows of 4 blocks (a block: 4 tokens x 4 values x 4 bytes).
    o.memory_budget = Some(1024);
    o.threads = 1;
    if follow {
        o.follow = Some(FollowOptions {
            timeout: Duration::from_secs(20),
            poll: Duration::from_millis(5),
            interrupted: None,
            broadcast: None,
        });
    }
    o
}

/// One batch as compared: its rows' examples and tokens, values and labels.
pub type Rows = (Vec<i64>, Vec<i64>, Vec<f32>, Option<Vec<i64>>);

/// The [`Rows`] of a batch.
pub fn rows_of(b: Batch) -> Rows {
    (
        b.example_idx.clone(),
        b.token_idx.clone(),
        b.act.as_f32()[..b.n * b.d_model].to_vec(),
        b.token_label.clone(),
    )
}

/// The next `n` batches of `it`.
pub fn take(it: &mut Batches, n: usize) -> Vec<Rows> {
    (0..n)
        .map(|_| rows_of(it.next().expect("a batch").unwrap()))
        .collect()
}

/// Every batch of a pass of `loader`.
pub fn drain(loader: &Loader) -> Vec<Rows> {
    loader
        .iter()
        .unwrap()
        .map(|b| rows_of(b.unwrap()))
        .collect()
}

/// Row of example `e`, layer 3 (slot 0), content token `c` (slot c + 1), as written.
pub fn expected_row(e: i64, c: i64) -> Vec<f32> {
    (0..4)
        .map(|d| (e * 1000 + (c + 1) * 4 + d) as f32)
        .collect()
}

/// Checks every row against the data written and counts each (example, token).
pub fn count_rows(batches: &[Rows]) -> BTreeMap<(i64, i64), u32> {
    let mut seen = BTreeMap::new();
    for (ex, tok, act, labels) in batches {
        let labels = labels.as_ref().expect("every batch has the labels written");
        for (i, (&e, &c)) in ex.iter().zip(tok).enumerate() {
            assert_eq!(
                labels[i],
                i64::from(label(e as u64, c as u64)),
                "label of e={e} c={c}"
            );
            assert_eq!(
                act[i * 4..i * 4 + 4],
                expected_row(e, c)[..],
                "row e={e} c={c} is torn"
            );
            *seen.entry((e, c)).or_insert(0) += 1;
        }
    }
    seen
}

/// Checks every row of the follow tests' dataset is in `batches` once, as written.
pub fn assert_each_row_once(batches: &[Rows]) {
    let seen = count_rows(batches);
    let want: BTreeMap<(i64, i64), u32> = (0..FOLLOW_N as i64)
        .flat_map(|e| (0..3).map(move |c| ((e, c), 1)))
        .collect();
    assert_eq!(seen, want);
}

/// How many follow rounds state `st` records.
pub fn rounds_of(st: &LoaderState) -> usize {
    let Some(shardkit::engine::StateValue::List(flat)) = st.get("follow_rounds") else {
        panic!("no follow_rounds in {st:?}");
    };
    let (mut i, mut n) = (0, 0);
    while i < flat.len() {
        i += 1 + 2 * flat[i] as usize;
        n += 1;
    }
    n
}

/// Checks committed epochs 1 and 0, and a late follow loader, read as the plain loader.
pub fn assert_committed_epochs_as_plain(loader: &mut Loader, dir: &Path, order: Order) -> Loader {
    // Batch for batch; the late loader (opened on the committed dataset) is handed back.
    for epoch in [1, 0] {
        loader.set_epoch(epoch).unwrap();
        let mut plain_opts = options(false, order);
        plain_opts.epoch = epoch;
        let plain = Loader::new(dir, plain_opts).unwrap();
        assert_eq!(drain(loader), drain(&plain), "{order:?} epoch {epoch}");
    }
    let late = Loader::new(dir, options(true, order)).unwrap();
    let plain = Loader::new(dir, options(false, order)).unwrap();
    assert_eq!(drain(&late), drain(&plain));
    late
}

/// Checks the states `across` and `mid_round` of the resume tests' pass resume exactly.
pub fn assert_states_resume_exactly(
    dir: &Path,
    across: &LoaderState,
    mid_round: &LoaderState,
    seen: &[Rows],
) {
    // `seen`: that pass (round 1: 8 batches; `mid_round` after 3, `across` after round 2's 2).
    // From `across` the rounds are replayed, then the rest as it was; from `mid_round` the
    // round's remaining batches, then the rest, each row once.
    let mut resumed = Loader::new(dir, options(true, Order::Block)).unwrap();
    resumed.load_state(across.clone()).unwrap();
    resumed.set_epoch(0).unwrap(); // the training loop's call keeps the loaded position
    assert_eq!(drain(&resumed), seen[10..]);
    let mut resumed = Loader::new(dir, options(true, Order::Block)).unwrap();
    resumed.load_state(mid_round.clone()).unwrap();
    let rest = drain(&resumed);
    assert_eq!(rest[..5], seen[3..8]);
    let mut all = seen[..3].to_vec();
    all.extend(rest);
    assert_each_row_once(&all);
}
