//! The saev loaders: exactly-once, deterministic, resumable, distributed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use shardkit::engine::Order;
use shardkit::saev::{Batch, LayerSel, Loader, LoaderOptions, TokenMode};
use shardkit::Error;
mod common;

/// 37 examples, layers [7, -3], 5 content tokens + CLS, d 4, 3 examples per shard, labels.
fn dataset(root: &Path) -> PathBuf {
    common::coded_saev(root, 37, [7, -3], 5, 36, 4)
}

fn opts(order: Order) -> LoaderOptions {
    let mut o = LoaderOptions::new(LayerSel::Value(-3));
    o.order = order;
    o.batch_size = 8;
    o.seed = 5;
    o.rank = Some(0);
    o.world_size = Some(1);
    o.memory_budget = Some(8192); // tiny windows (at most 21 blocks of 96 bytes): many of them
    o
}

fn collect(loader: &Loader) -> Vec<Batch> {
    loader.iter().unwrap().map(|b| b.unwrap()).collect()
}

fn keys(batches: &[Batch]) -> Vec<(i64, i64)> {
    batches
        .iter()
        .flat_map(|b| {
            b.example_idx
                .iter()
                .copied()
                .zip(b.token_idx.iter().copied())
        })
        .collect()
}

fn check_values(b: &Batch, slot: i64) {
    for (i, (&e, &c)) in b.example_idx.iter().zip(&b.token_idx).enumerate() {
        let t = c + 1;
        let slot = b
            .layer
            .as_ref()
            .map_or(slot, |l| if l[i] == 7 { 0 } else { 1 });
        let want = (1000 * e + 100 * slot + 10 * t) as f32;
        assert_eq!(b.act.as_f32()[i * 4], want, "row {i}: e={e} c={c}");
        assert_eq!(b.act.as_f32()[i * 4 + 3], want + 3.0);
        if let Some(labels) = &b.token_label {
            let want = if c < 0 { -1 } else { (e + c) % 4 };
            assert_eq!(labels[i], want);
        }
    }
}

#[test]
fn every_order_yields_every_row_once_with_correct_values() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        let loader = Loader::new(&dir, opts(order)).unwrap();
        assert_eq!(loader.rows(), 37 * 5);
        let batches = collect(&loader);
        assert_eq!(batches.len() as u64, loader.len());
        assert_eq!(loader.len(), (37 * 5u64).div_ceil(8));
        let mut k = keys(&batches);
        for b in &batches {
            check_values(b, 1);
        }
        if order == Order::Sequential {
            let want: Vec<(i64, i64)> = (0..37).flat_map(|e| (0..5).map(move |c| (e, c))).collect();
            assert_eq!(k, want);
        }
        k.sort();
        k.dedup();
        assert_eq!(k.len(), 185, "{order:?}");
    }
}

#[test]
fn ranks_partition_the_epoch_and_drop_last_is_uniform() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        for drop_last in [false, true] {
            let mut seen: HashMap<(i64, i64), u32> = HashMap::new();
            let mut lens = Vec::new();
            for rank in 0..3 {
                let mut o = opts(order);
                o.rank = Some(rank);
                o.world_size = Some(3);
                o.drop_last = drop_last;
                let loader = Loader::new(&dir, o).unwrap();
                let batches = collect(&loader);
                lens.push(batches.len());
                for b in &batches {
                    check_values(b, 1);
                    if drop_last {
                        assert_eq!(b.n, 8);
                    }
                }
                for k in keys(&batches) {
                    *seen.entry(k).or_default() += 1;
                }
            }
            assert!(seen.values().all(|&c| c == 1), "{order:?}");
            let want = if drop_last { 185 / 24 * 24 } else { 185 };
            assert_eq!(seen.len(), want, "{order:?} drop_last={drop_last}");
            if drop_last {
                assert!(lens.iter().all(|&l| l == lens[0]));
            }
        }
    }
}

#[test]
fn batches_do_not_depend_on_threads_and_differ_by_epoch_and_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for order in [Order::Block, Order::Exact] {
        let mut a = opts(order);
        a.io_threads = 1;
        let mut b = opts(order);
        b.io_threads = 13;
        b.memory_budget = Some(8192);
        let ka = keys(&collect(&Loader::new(&dir, a.clone()).unwrap()));
        let kb = keys(&collect(&Loader::new(&dir, b).unwrap()));
        assert_eq!(ka, kb, "{order:?}");
        let mut e1 = a.clone();
        e1.epoch = 1;
        assert_ne!(ka, keys(&collect(&Loader::new(&dir, e1).unwrap())));
        let mut s1 = a.clone();
        s1.seed = 6;
        assert_ne!(ka, keys(&collect(&Loader::new(&dir, s1).unwrap())));
        let mut l = Loader::new(&dir, a).unwrap();
        l.set_epoch(1).unwrap();
        let mut e1 = opts(order);
        e1.epoch = 1;
        e1.io_threads = 1;
        assert_eq!(
            keys(&collect(&l)),
            keys(&collect(&Loader::new(&dir, e1).unwrap()))
        );
    }
}

#[test]
fn a_restored_loader_continues_exactly_even_on_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    for order in [Order::Sequential, Order::Block, Order::Exact] {
        // Reference: world size 1, batch 12 (the global batch).
        let mut o = opts(order);
        o.batch_size = 12;
        let full = keys(&collect(&Loader::new(&dir, o.clone()).unwrap()));

        // Interrupted after 5 batches, restored into a fresh loader.
        let l = Loader::new(&dir, o.clone()).unwrap();
        let first: Vec<Batch> = l.iter().unwrap().take(5).map(|b| b.unwrap()).collect();
        let st = l.state();
        assert_eq!(st.uint("cursor").unwrap(), Some(60));
        let mut r = Loader::new(&dir, o.clone()).unwrap();
        r.load_state(st.clone()).unwrap();
        let mut k = keys(&first);
        k.extend(keys(&collect(&r)));
        assert_eq!(k, full, "{order:?}");

        // Restored on 3 ranks of batch 4: interleaving rank outputs per global batch gives the
        // same global order.
        let mut per_rank = Vec::new();
        for rank in 0..3 {
            let mut o3 = o.clone();
            o3.batch_size = 4;
            o3.rank = Some(rank);
            o3.world_size = Some(3);
            let mut lr = Loader::new(&dir, o3).unwrap();
            lr.load_state(st.clone()).unwrap();
            per_rank.push(collect(&lr));
        }
        let mut k3 = keys(&first);
        for g in 0..per_rank[0].len() {
            for r in &per_rank {
                if let Some(b) = r.get(g) {
                    k3.extend(keys(std::slice::from_ref(b)));
                }
            }
        }
        assert_eq!(k3, full, "{order:?} world 3");
    }
}

#[test]
fn all_layers_special_tokens_and_ignored_labels() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    let mut o = opts(Order::Block);
    o.layer = LayerSel::All;
    o.tokens = TokenMode::All;
    let batches = collect(&Loader::new(&dir, o).unwrap());
    assert_eq!(keys(&batches).len(), 37 * 2 * 6);
    for b in &batches {
        assert!(b.layer.is_some());
        check_values(b, 0);
    }

    let mut o = opts(Order::Exact);
    o.tokens = TokenMode::Special;
    let batches = collect(&Loader::new(&dir, o).unwrap());
    let k = keys(&batches);
    assert_eq!(k.len(), 37);
    assert!(k.iter().all(|&(_, c)| c == -1));
    for b in &batches {
        check_values(b, 1);
    }

    let mut o = opts(Order::Block);
    o.ignore_labels = vec![0, 2];
    let batches = collect(&Loader::new(&dir, o).unwrap());
    let k = keys(&batches);
    let want = (0..37i64)
        .flat_map(|e| (0..5i64).map(move |c| (e, c)))
        .filter(|&(e, c)| (e + c) % 4 == 1 || (e + c) % 4 == 3)
        .count();
    assert_eq!(k.len(), want);
    for b in &batches {
        check_values(b, 1);
        assert!(b
            .token_label
            .as_ref()
            .unwrap()
            .iter()
            .all(|&l| l == 1 || l == 3));
    }
}

#[test]
fn bad_options_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset(tmp.path());
    // Each refusal is the documented kind (an absent layer is Missing, a bad option Invalid)
    // and says what was wrong.
    let err = Loader::new(&dir, LoaderOptions::new(LayerSel::Value(5)))
        .expect_err("layer 5 is not recorded");
    assert!(
        matches!(&err, Error::Missing(m) if m.contains("5") && m.contains("[7, -3]")),
        "{err:?}"
    );
    let mut o = opts(Order::Block);
    o.memory_budget = Some(10);
    let err = Loader::new(&dir, o).expect_err("a 10-byte budget");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("too small")),
        "{err:?}"
    );
    let mut o = opts(Order::Block);
    o.rank = Some(3);
    o.world_size = Some(3);
    let err = Loader::new(&dir, o).expect_err("rank 3 of 3");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("rank") && m.contains('3')),
        "{err:?}"
    );
    let mut o = opts(Order::Block);
    o.batch_size = 0;
    let err = Loader::new(&dir, o).expect_err("batch_size 0");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("batch_size")),
        "{err:?}"
    );
    let mut l = Loader::new(&dir, opts(Order::Block)).unwrap();
    let mut st = l.state();
    st.set("global_batch_size", shardkit::engine::StateValue::UInt(9));
    let err = l.load_state(st).unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains('9') && m.contains('8')),
        "{err:?}"
    );
}
