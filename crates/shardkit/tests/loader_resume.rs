//! Resuming the saev and EAGLE-3 loaders: the documented training loop (`set_epoch` at each
//! epoch's start, a state taken mid-epoch) stopped and resumed in a fresh loader gives exactly
//! the uninterrupted run's batches; a state taken by a loader that would serve other rows is
//! refused, naming each differing parameter with both values; a state with only the position
//! (as saved before the order's parameters were recorded) still loads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardkit::engine::{Order, StateValue};
use shardkit::json;
use shardkit::saev::{self, LayerSel, TokenMode};
use shardkit::Error;
mod common;

/// 29 examples, layers [3, 9], 4 content tokens + CLS, d 4, labels.
fn saev_dataset(root: &Path) -> PathBuf {
    common::coded_saev(root, 29, [3, 9], 4, 40, 3)
}

fn saev_opts(order: Order) -> saev::LoaderOptions {
    let mut o = saev::LoaderOptions::new(LayerSel::Value(9));
    o.order = order;
    o.batch_size = 7;
    o.seed = 11;
    o.rank = Some(0);
    o.world_size = Some(1);
    o.memory_budget = Some(4096); // windows of a few blocks
    o
}

/// One batch as (example, token, first value) per row.
type Rows = Vec<(i64, i64, u32)>;

fn saev_rows(b: &saev::Batch) -> Rows {
    (0..b.n)
        .map(|i| {
            (
                b.example_idx[i],
                b.token_idx[i],
                b.act.as_f32()[i * b.d_model].to_bits(),
            )
        })
        .collect()
}

/// The documented loop from `start_epoch` to `epochs`: every batch, by epoch. With `stop`
/// `(epoch, k)`, stops after `k` batches of that epoch and returns the state taken there.
fn saev_loop(
    l: &mut saev::Loader,
    start_epoch: u64,
    epochs: u64,
    stop: Option<(u64, usize)>,
) -> (Vec<Rows>, Option<saev::LoaderState>) {
    let mut out = Vec::new();
    for epoch in start_epoch..epochs {
        l.set_epoch(epoch).unwrap();
        for (k, b) in l.iter().unwrap().enumerate() {
            out.push(saev_rows(&b.unwrap()));
            if stop == Some((epoch, k + 1)) {
                return (out, Some(l.state()));
            }
        }
    }
    (out, None)
}

#[test]
fn the_saev_training_loop_resumes_exactly_mid_epoch_and_at_the_end_of_an_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dataset(tmp.path());
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        for drop_last in [false, true] {
            let mut o = saev_opts(order);
            o.drop_last = drop_last;
            o.ignore_labels = if order == Order::Exact {
                vec![1]
            } else {
                Vec::new()
            };
            let mut full_loader = saev::Loader::new(&dir, o.clone()).unwrap();
            let per_epoch = full_loader.len() as usize;
            let (full, _) = saev_loop(&mut full_loader, 0, 3, None);
            // Stopped mid-epoch 1, and right after the last batch of epoch 0.
            for stop in [(1, 2), (0, per_epoch)] {
                let mut a = saev::Loader::new(&dir, o.clone()).unwrap();
                let (head, st) = saev_loop(&mut a, 0, 3, Some(stop));
                let st = st.unwrap();
                assert_eq!(st.epoch, stop.0);
                let mut b = saev::Loader::new(&dir, o.clone()).unwrap();
                b.load_state(st.clone()).unwrap();
                let (tail, _) = saev_loop(&mut b, st.epoch, 3, None);
                let mut all = head;
                all.extend(tail);
                assert_eq!(all, full, "{order:?} drop_last={drop_last} stop={stop:?}");
            }
        }
    }
}

#[test]
fn set_epoch_of_another_epoch_after_a_load_starts_that_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dataset(tmp.path());
    let o = saev_opts(Order::Block);
    let mut a = saev::Loader::new(&dir, o.clone()).unwrap();
    let (_, st) = saev_loop(&mut a, 0, 1, Some((0, 3)));
    let mut b = saev::Loader::new(&dir, o.clone()).unwrap();
    b.load_state(st.unwrap()).unwrap();
    b.set_epoch(2).unwrap();
    let mut c = saev::Loader::new(&dir, o).unwrap();
    c.set_epoch(2).unwrap();
    let got: Vec<Rows> = b.iter().unwrap().map(|x| saev_rows(&x.unwrap())).collect();
    let want: Vec<Rows> = c.iter().unwrap().map(|x| saev_rows(&x.unwrap())).collect();
    assert_eq!(got, want);
    // Without a load, set_epoch of the current epoch still rewinds to its start.
    b.set_epoch(2).unwrap();
    let again: Vec<Rows> = b.iter().unwrap().map(|x| saev_rows(&x.unwrap())).collect();
    assert_eq!(again, want);
}

fn refusal(e: Error) -> String {
    match e {
        Error::Invalid(m) => m,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

#[test]
fn a_saev_state_of_another_order_is_refused_naming_each_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dataset(tmp.path());
    let base = saev_opts(Order::Block);
    let a = saev::Loader::new(&dir, base.clone()).unwrap();
    a.iter().unwrap().next().unwrap().unwrap();
    let st = a.state();
    type Edit = fn(&mut saev::LoaderOptions);
    let cases: [(&str, &str, Edit); 9] = [
        ("order", "state block, this loader exact", |o| {
            o.order = Order::Exact
        }),
        ("seed", "state 11, this loader 12", |o| o.seed = 12),
        ("layer", "state 9, this loader 3", |o| {
            o.layer = LayerSel::Value(3)
        }),
        ("layer", "state 9, this loader all", |o| {
            o.layer = LayerSel::All
        }),
        ("tokens", "state content, this loader all", |o| {
            o.tokens = TokenMode::All
        }),
        ("ignore_labels", "state [], this loader [2]", |o| {
            o.ignore_labels = vec![2]
        }),
        ("drop_last", "state false, this loader true", |o| {
            o.drop_last = true
        }),
        ("memory_budget", "state 4096 bytes", |o| {
            o.memory_budget = Some(8192)
        }),
        ("global_batch_size", "state 7, this loader 8", |o| {
            o.batch_size = 8
        }),
    ];
    for (key, values, edit) in cases {
        let mut o = base.clone();
        edit(&mut o);
        let mut l = saev::Loader::new(&dir, o).unwrap();
        let m = refusal(l.load_state(st.clone()).unwrap_err());
        assert!(m.contains(&format!("{key}: {values}")), "{key}: {m}");
        assert!(m.contains("serves other rows"), "{m}");
    }
    // Several at once: each one named.
    let mut o = base.clone();
    o.seed = 1;
    o.order = Order::Exact;
    let m = refusal(
        saev::Loader::new(&dir, o)
            .unwrap()
            .load_state(st.clone())
            .unwrap_err(),
    );
    assert!(
        m.contains("seed: state 11, this loader 1") && m.contains("order: state block"),
        "{m}"
    );
    // Another world size with the same global batch, and another budget where the order does
    // not depend on it (exact), are accepted.
    let mut o = base.clone();
    o.batch_size = 1;
    o.world_size = Some(7);
    o.rank = Some(3);
    saev::Loader::new(&dir, o)
        .unwrap()
        .load_state(st.clone())
        .unwrap();
    let mut ex = base.clone();
    ex.order = Order::Exact;
    let e = saev::Loader::new(&dir, ex.clone()).unwrap();
    let est = e.state();
    ex.memory_budget = Some(1 << 20);
    saev::Loader::new(&dir, ex)
        .unwrap()
        .load_state(est)
        .unwrap();
    // Another dataset (fewer rows): refused on `rows`.
    let mut st2 = st.clone();
    st2.set("rows", StateValue::UInt(5));
    let m = refusal(
        saev::Loader::new(&dir, base)
            .unwrap()
            .load_state(st2)
            .unwrap_err(),
    );
    assert!(m.contains("rows: state 5, this loader 116"), "{m}");
}

#[test]
fn a_saev_state_with_only_the_position_still_loads_and_is_checked_on_what_it_has() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dataset(tmp.path());
    let o = saev_opts(Order::Block);
    let mut a = saev::Loader::new(&dir, o.clone()).unwrap();
    let (_, st) = saev_loop(&mut a, 0, 2, Some((1, 4)));
    let st = st.unwrap();
    let cursor = st.uint("cursor").unwrap().unwrap();
    let global = st.uint("global_batch_size").unwrap().unwrap();
    let old = saev::state_at(st.seed, st.epoch, cursor, global);
    let mut b = saev::Loader::new(&dir, o.clone()).unwrap();
    b.load_state(old.clone()).unwrap();
    let mut c = saev::Loader::new(&dir, o.clone()).unwrap();
    c.load_state(st).unwrap();
    let rest = |l: &mut saev::Loader| -> Vec<Rows> {
        l.set_epoch(1).unwrap();
        l.iter().unwrap().map(|x| saev_rows(&x.unwrap())).collect()
    };
    assert_eq!(rest(&mut b), rest(&mut c));
    let mut other = o;
    other.seed = 99;
    let m = refusal(
        saev::Loader::new(&dir, other)
            .unwrap()
            .load_state(old)
            .unwrap_err(),
    );
    assert!(m.contains("seed: state 11, this loader 99"), "{m}");
}

// --- EAGLE-3 ----------------------------------------------------------------------------------

use shardkit::eagle3::{self, synthetic_sample, Cache};

fn eagle3_cache(dir: &Path, n: u64) -> Arc<Cache> {
    let config = json::parse(
        format!(
            r#"{{"target_model": "demo", "target_vocab_size": 8, "draft_vocab_size": 8,
            "seq_length": 4, "dtype": "fp32", "num_samples": {n}, "shard_size": 4,
            "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3],
            "selected_token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
            "input_data": "demo", "split": null, "shuffle_seed": 1}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let mut w = eagle3::Writer::create(dir, &config, eagle3::WriterOptions::default()).unwrap();
    for i in 0..n {
        let fields = synthetic_sample(w.manifest(), i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
    w.finish().unwrap();
    Arc::new(Cache::open(dir).unwrap())
}

fn e3_opts(shuffle: bool, drop_last: bool) -> eagle3::LoaderOptions {
    let mut o = eagle3::LoaderOptions::new(3);
    (o.rank, o.world_size, o.drop_last, o.seed) = (Some(0), Some(1), drop_last, 4);
    o.set_shuffle(shuffle);
    o
}

fn e3_loop(
    l: &mut eagle3::Loader,
    start_epoch: u64,
    epochs: u64,
    stop: Option<(u64, u64)>,
) -> (Vec<Vec<u64>>, Option<eagle3::LoaderState>) {
    let mut out = Vec::new();
    for epoch in start_epoch..epochs {
        l.set_epoch(epoch);
        let mut it = l.iter();
        while let Some(b) = it.next() {
            out.push(b.unwrap().indices);
            let at = it.cursor();
            if stop == Some((epoch, at)) {
                drop(it);
                l.advance_to(at);
                return (out, Some(l.state()));
            }
        }
        let at = it.cursor();
        drop(it);
        l.advance_to(at);
    }
    (out, None)
}

#[test]
fn the_eagle3_training_loop_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = eagle3_cache(&tmp.path().join("c"), 11);
    for (shuffle, drop_last) in [(true, false), (true, true), (false, false)] {
        let o = e3_opts(shuffle, drop_last);
        let mut full_loader = eagle3::Loader::new(cache.clone(), o.clone()).unwrap();
        let per_epoch = full_loader.len();
        let (full, _) = e3_loop(&mut full_loader, 0, 3, None);
        for stop in [(1, 2), (0, per_epoch)] {
            let mut a = eagle3::Loader::new(cache.clone(), o.clone()).unwrap();
            let (head, st) = e3_loop(&mut a, 0, 3, Some(stop));
            let st = st.unwrap();
            let mut b = eagle3::Loader::new(cache.clone(), o.clone()).unwrap();
            let epoch = st.epoch;
            b.load_state(st).unwrap();
            assert!(b.resumed());
            let (tail, _) = e3_loop(&mut b, epoch, 3, None);
            let mut all = head;
            all.extend(tail);
            assert_eq!(
                all, full,
                "shuffle={shuffle} drop_last={drop_last} stop={stop:?}"
            );
        }
    }
}

#[test]
fn an_eagle3_state_of_another_order_is_refused_naming_each_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = eagle3_cache(&tmp.path().join("c"), 11);
    let base = e3_opts(true, false);
    let mut a = eagle3::Loader::new(cache.clone(), base.clone()).unwrap();
    a.advance_to(1);
    let st = a.state();
    type Edit = fn(&mut eagle3::LoaderOptions);
    let cases: [(&str, &str, Edit); 5] = [
        ("seed", "state 4, this loader 5", |o| o.seed = 5),
        ("batch_size", "state 3, this loader 2", |o| o.batch_size = 2),
        ("world_size", "state 1, this loader 2", |o| {
            o.world_size = Some(2)
        }),
        ("shuffle", "state true, this loader false", |o| {
            o.set_shuffle(false)
        }),
        ("drop_last", "state false, this loader true", |o| {
            o.drop_last = true
        }),
    ];
    for (key, values, edit) in cases {
        let mut o = base.clone();
        edit(&mut o);
        let mut l = eagle3::Loader::new(cache.clone(), o).unwrap();
        let m = refusal(l.load_state(st.clone()).unwrap_err());
        assert!(m.contains(&format!("{key}: {values}")), "{key}: {m}");
    }
    // Another cache size.
    let other = eagle3_cache(&tmp.path().join("d"), 12);
    let m = refusal(
        eagle3::Loader::new(other, base.clone())
            .unwrap()
            .load_state(st.clone())
            .unwrap_err(),
    );
    assert!(m.contains("samples: state 11, this loader 12"), "{m}");
    // A state with only the position (saved before the order's parameters were recorded).
    let mut old = st.clone();
    for k in ["shuffle", "drop_last", "samples"] {
        old.remove(k).unwrap();
    }
    let mut b = eagle3::Loader::new(cache.clone(), base.clone()).unwrap();
    b.load_state(old.clone()).unwrap();
    assert_eq!(b.state(), st);
    let mut wrong_seed = base;
    wrong_seed.seed = 0;
    let m = refusal(
        eagle3::Loader::new(cache, wrong_seed)
            .unwrap()
            .load_state(old)
            .unwrap_err(),
    );
    assert!(m.contains("seed: state 4, this loader 0"), "{m}");
}
