//! The EAGLE-3 caches of the parts and follow tests (tests/eagle3_parts.rs, eagle3_parts_s3.rs,
//! eagle3_follow.rs and follow_s3.rs): seq 4, hidden 2 (aux 6), shards of 2, every sample
//! `synthetic_sample`'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shardkit::eagle3::{
    synthetic_sample, Batch, Batches, Cache, FollowOptions, Loader, LoaderOptions, LoaderState,
    Manifest, PartOptions, PartWriter, Writer, WriterOptions,
};
use shardkit::json::Value;

use super::rank;

/// The samples of the parts tests' cache: 6 shards, the last one short.
pub const PARTS_N: u64 = 11;

/// The samples of the follow tests' cache: 12 shards, the last one short.
pub const FOLLOW_N: u64 = 23;

/// The configuration (seq 4, shards of 2, 8 tokens), `num_samples` declared when given.
pub fn config(num_samples: Option<u64>) -> Value {
    let n = num_samples.map_or(String::new(), |n| format!(r#""num_samples": {n},"#));
    shardkit::json::parse(
        format!(
            r#"{{"target_model": "demo", "target_vocab_size": 8, "draft_vocab_size": 8,
            "seq_length": 4, "dtype": "bf16", {n} "shard_size": 2, "aux_hidden_dim": 6,
            "aux_layer_ids": [1, 2, 3], "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
            "input_data": "demo", "split": null, "shuffle_seed": 1}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

/// Samples `first..end`, each field's rows concatenated.
pub fn batch(m: &Manifest, first: u64, end: u64) -> Vec<(&'static str, Vec<u8>)> {
    let mut out: Vec<(&'static str, Vec<u8>)> = Vec::new();
    for i in first..end {
        for (f, (name, bytes)) in synthetic_sample(m, i).into_iter().enumerate() {
            match out.get_mut(f) {
                Some((_, b)) => b.extend(bytes),
                None => out.push((name, bytes)),
            }
        }
    }
    out
}

/// The fields of a [`batch`] as `add` takes them.
pub fn refs<'a>(b: &'a [(&'static str, Vec<u8>)]) -> Vec<(&'static str, &'a [u8])> {
    b.iter().map(|(n, v)| (*n, v.as_slice())).collect()
}

/// The embedding table: 8 rows of hidden 2.
pub fn table(seed: u8) -> Vec<u8> {
    (0..16u8)
        .flat_map(|i| f32::from(i.wrapping_mul(seed)).to_le_bytes())
        .collect()
}

/// One `Writer` writes the parts tests' cache at `dir`, the table `table(3)` if `embeddings`.
pub fn single(dir: &Path, version: u8, embeddings: bool) -> PathBuf {
    let mut w = Writer::create(
        dir,
        &config(Some(PARTS_N)),
        WriterOptions {
            version,
            resume: false,
        },
    )
    .unwrap();
    if embeddings {
        w.write_target_embeddings(&table(3), 8, 2).unwrap();
    }
    let b = batch(w.manifest(), 0, PARTS_N);
    w.add(PARTS_N, &refs(&b)).unwrap();
    w.finish().unwrap()
}

/// Part options of cache `version`, with or without the embedding table.
pub fn options(version: u8, embeddings: bool) -> PartOptions {
    PartOptions {
        version,
        target_embeddings: embeddings,
    }
}

/// Adds `w`'s pending samples `per` at a time, `pause` after each add, then finishes it.
pub fn write_paced(mut w: PartWriter, per: u64, pause: Duration) -> shardkit::PartsStatus {
    for r in w.pending().to_vec() {
        let mut at = r.start;
        while at < r.end {
            let end = (at + per).min(r.end);
            let b = batch(w.manifest(), at, end);
            w.add(end - at, &refs(&b)).unwrap();
            at = end;
            std::thread::sleep(pause);
        }
    }
    w.finish().unwrap()
}

/// Adds `w`'s pending samples in batches of 3, then finishes it.
pub fn write_all(w: PartWriter) -> shardkit::PartsStatus {
    write_paced(w, 3, Duration::ZERO)
}

/// Writes `w`'s samples one shard at a time, `pause` between, then finishes it.
pub fn write_shards(w: PartWriter, pause: Duration) {
    write_paced(w, 2, pause);
}

/// Each writer on a thread writing its samples a shard every 30 ms, then finishing.
pub fn write_meanwhile(ws: Vec<PartWriter>) -> Vec<std::thread::JoinHandle<()>> {
    ws.into_iter()
        .map(|w| std::thread::spawn(move || write_shards(w, Duration::from_millis(30))))
        .collect()
}

/// Rank `r` of `w` writing the follow tests' cache (version 2, no embeddings) at `dir`.
pub fn writer(dir: &Path, r: u64, w: u64) -> PartWriter {
    let o = PartOptions {
        version: 2,
        target_embeddings: false,
    };
    PartWriter::create(dir, &config(None), o, FOLLOW_N, rank(r, w)).unwrap()
}

/// Follow-mode loader options: rank 0 of 1, batches of 3, seed 7, polls of 5 ms.
pub fn follow_opts(timeout_ms: u64) -> LoaderOptions {
    let mut o = LoaderOptions::new(3);
    (o.rank, o.world_size, o.seed) = (Some(0), Some(1), 7);
    o.follow = Some(FollowOptions {
        timeout: Duration::from_millis(timeout_ms),
        poll: Duration::from_millis(5),
        interrupted: None,
        broadcast: None,
    });
    o
}

/// Checks every row of `b` against what was written for its sample.
pub fn check_whole(m: &Manifest, b: &Batch) {
    for (row, &i) in b.indices.iter().enumerate() {
        for (name, want) in synthetic_sample(m, i) {
            let Some(f) = b.layout.iter().find(|f| f.name == name) else {
                continue;
            };
            let bytes = b.data.field(f);
            let rb = bytes.len() / b.indices.len();
            assert_eq!(&bytes[row * rb..(row + 1) * rb], &want[..], "{name} of {i}");
        }
    }
}

/// The samples of a pass until it ends or fails (with the error's text), each batch whole.
pub fn drain(it: &mut Batches, m: &Manifest) -> (Vec<Vec<u64>>, Option<String>) {
    let mut out = Vec::new();
    for b in it {
        match b {
            Ok(b) => {
                check_whole(m, &b);
                out.push(b.indices.clone());
            }
            Err(e) => return (out, Some(e.to_string())),
        }
    }
    (out, None)
}

/// Checks `loader`'s pass, read while the ranks write, serves every sample once in rounds.
pub fn assert_every_sample_once_in_rounds(loader: &Loader, m: &Manifest) {
    // Several rounds: the state holds more than one (each a range count, then its ranges).
    let (batches, err) = drain(&mut loader.iter(), m);
    assert_eq!(err, None);
    let mut seen: Vec<u64> = batches.concat();
    seen.sort_unstable();
    assert_eq!(seen, (0..FOLLOW_N).collect::<Vec<_>>(), "every sample once");
    let Some(shardkit::engine::StateValue::List(flat)) =
        loader.state().get("follow_rounds").cloned()
    else {
        panic!("no follow_rounds in {:?}", loader.state())
    };
    assert!(flat.len() > 3, "one round only: {flat:?}");
}

/// Checks that epoch 1 of `loader`, on the committed cache at `dir`, is the plain loader's.
pub fn assert_epoch_1_as_committed(loader: &mut Loader, dir: &Path, m: &Manifest) {
    loader.set_epoch(1);
    let (follow1, err) = drain(&mut loader.iter(), m);
    assert_eq!(err, None);
    let mut o = follow_opts(0);
    o.follow = None;
    o.epoch = 1;
    let plain = Loader::new(Arc::new(Cache::open(dir).unwrap()), o).unwrap();
    let (plain1, _) = drain(&mut plain.iter(), m);
    assert_eq!(follow1, plain1);
}

/// Checks a loader resumed from `saved` reads as `a` did, then both the rest, once `w1` writes.
pub fn assert_resumed_alike(
    dir: &Path,
    a: &mut Loader,
    saved: LoaderState,
    first: &[u64],
    rest_a: Vec<Vec<u64>>,
    w1: PartWriter,
    m: &Manifest,
) {
    // `saved` was taken after the batch `first` of `a`'s pass, which then served `rest_a` and
    // stopped waiting for shards 6..12 (`w1`'s); over the epoch, every sample once.
    let mut b = Loader::open(dir, follow_opts(300)).unwrap();
    b.load_state(saved).unwrap();
    let mut it_b = b.iter();
    let (rest_b, err_b) = drain(&mut it_b, m);
    assert_eq!(rest_b, rest_a);
    assert!(err_b.unwrap().contains("shards 6..12"));
    let at_b = it_b.cursor();
    drop(it_b);
    b.advance_to(at_b);
    write_shards(w1, Duration::ZERO); // the last rank commits
    let (last_a, err) = drain(&mut a.iter(), m);
    let (last_b, err_b) = drain(&mut b.iter(), m);
    assert_eq!((err, err_b), (None, None));
    assert_eq!(last_a, last_b);
    let mut seen: Vec<u64> = [vec![first.to_vec()], rest_a, last_a].concat().concat();
    seen.sort_unstable();
    assert_eq!(seen, (0..FOLLOW_N).collect::<Vec<_>>(), "every sample once");
}
