//! The order of durability calls each writer makes, recorded through fsutil's trace hook and
//! checked against what crash safety after a power loss needs:
//!
//! 1. a file is fsynced under its temporary name before it is renamed to its final name (else
//!    a power loss can leave a final name over missing data);
//! 2. every rename is followed by an fsync of its directory before the writer returns (else
//!    the rename itself may be lost);
//! 3. a format's commit record comes after everything it vouches for (saev: shards.json after
//!    every shard, labels.bin and the checksums sidecar are renamed and their directory synced).
//!
//! The trace is global to the process: the tests here take turns (`ONE_AT_A_TIME`).

use std::path::{Path, PathBuf};

use shardkit::internals::trace::{self, Event};
use shardkit::json;
use shardkit::sdnb::{self, DType, Format, Order, SaveOptions, TensorIn, VarType};
use shardkit::{eagle3, saev};

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check_rules(events: &[Event], what: &str) {
    assert!(!events.is_empty(), "{what}: nothing recorded");
    for (i, e) in events.iter().enumerate() {
        let Event::Rename { from, to } = e else {
            continue;
        };
        // Rule 1 (renames of a final name back to a temporary, done by a resume, excepted).
        let to_name = to.file_name().unwrap().to_string_lossy();
        if !shardkit::fsutil::is_temp_name(&to_name) {
            assert!(
                events[..i]
                    .iter()
                    .any(|x| matches!(x, Event::SyncFile(p) if p == from)),
                "{what}: {} renamed to {} before it was fsynced\n{events:#?}",
                from.display(),
                to.display()
            );
        }
        // Rule 2.
        let dir = shardkit::fsutil::parent_of(to);
        assert!(
            events[i + 1..]
                .iter()
                .any(|x| matches!(x, Event::SyncDir(d) if d == dir)),
            "{what}: the rename to {} is never made durable (no fsync of {})",
            to.display(),
            dir.display()
        );
    }
}

fn position(events: &[Event], f: impl Fn(&Event) -> bool) -> Vec<usize> {
    events
        .iter()
        .enumerate()
        .filter(|(_, e)| f(e))
        .map(|(i, _)| i)
        .collect()
}

fn renamed_to(e: &Event, name: &str) -> bool {
    matches!(e, Event::Rename { to, .. } if to.file_name().is_some_and(|n| n == name))
}

fn below(events: Vec<Event>, root: &Path) -> Vec<Event> {
    let inside = |p: &PathBuf| p.starts_with(root);
    events
        .into_iter()
        .filter(|e| match e {
            Event::SyncFile(p) | Event::SyncDir(p) => inside(p),
            Event::Rename { to, .. } => inside(to),
        })
        .collect()
}

#[test]
fn saev_writer_order() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{"protocol": "2.1", "family": "clip", "ckpt": "c", "layers": [0],
        "content_tokens_per_example": 2, "cls_token": false, "d_model": 4, "n_examples": 7,
        "max_tokens_per_shard": 4, "data": {:?}, "dataset": "d"}}"#,
        saev::fake_dataset_data(7)
    );
    let md = saev::Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap();
    trace::start();
    let mut w = saev::Writer::create(tmp.path(), md, Default::default()).unwrap();
    for e in 0..7u8 {
        w.write(&[f32::from(e); 8], Some(&[e, e])).unwrap();
    }
    let dir = w.finish().unwrap();
    let events = below(trace::take(), tmp.path());
    check_rules(&events, "saev");
    // Rule 3: shards.json (the commit record) comes after every other file is durable.
    let commit = position(&events, |e| renamed_to(e, "shards.json"));
    assert_eq!(commit.len(), 1, "{events:#?}");
    let c = commit[0];
    for name in [
        "acts000000.bin",
        "acts000003.bin",
        "labels.bin",
        "shardkit.checksums.json",
        "metadata.json",
    ] {
        let at = position(&events, |e| renamed_to(e, name));
        assert!(
            !at.is_empty() && at.iter().all(|&i| i < c),
            "{name} is not before the commit\n{events:#?}"
        );
    }
    assert!(
        events[..c]
            .iter()
            .rposition(|e| matches!(e, Event::SyncDir(d) if d == &dir))
            > position(&events, |e| renamed_to(e, "acts000003.bin"))
                .last()
                .copied(),
        "the last shard's rename is not durable before the commit"
    );
}

#[test]
fn eagle3_writer_order() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let cfg = json::parse(
        br#"{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": 2,
        "seq_length": 2, "dtype": "fp32", "num_samples": 5, "shard_size": 2,
        "aux_hidden_dim": 3, "aux_layer_ids": [1, 2, 3], "selected_token_ids": [0, 1],
        "input_data": "x", "split": null, "shuffle_seed": 1}"#,
    )
    .unwrap();
    trace::start();
    let mut w = eagle3::Writer::create(&dir, &cfg, Default::default()).unwrap();
    let fields: Vec<(String, Vec<u8>)> = w
        .fields()
        .iter()
        .map(|f| {
            let row_bytes = f.row.iter().product::<usize>() * f.dtype.bitsize() / 8;
            // Zeros everywhere, except the target distribution: each position's row (two draft
            // columns, fp32) is [1, 0], so it sums to 1 as the writer requires.
            let bytes = if f.name == "target_probs" {
                [1.0f32, 0.0]
                    .repeat(row_bytes / 8)
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            } else {
                vec![0u8; row_bytes]
            };
            (f.name.to_string(), bytes)
        })
        .collect();
    let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (n.as_str(), &b[..])).collect();
    for _ in 0..5 {
        w.add(1, &refs).unwrap();
    }
    w.finish().unwrap();
    let events = below(trace::take(), tmp.path());
    check_rules(&events, "eagle3");
    // The manifest is durable before the first shard (a shard set without its configuration
    // could not be resumed), and the sidecar comes after the last shard.
    let manifest = position(&events, |e| renamed_to(e, "manifest.json"))[0];
    let first = position(&events, |e| renamed_to(e, "shard-000000.safetensors"))[0];
    let last = position(&events, |e| renamed_to(e, "shard-000002.safetensors"))[0];
    let sidecar = position(&events, |e| renamed_to(e, "shardkit.checksums.json"))[0];
    assert!(manifest < first && last < sidecar, "{events:#?}");
}

#[test]
fn sdnb_writer_order_for_every_format() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let bytes: Vec<u8> = (0..4096u32)
        .flat_map(|x| (x as f32).to_le_bytes())
        .collect();
    let t = [TensorIn {
        name: "w".into(),
        var_type: VarType::Variable,
        dtype: DType::Float,
        shape: vec![64, 64],
        order: Order::C,
        bytes: &bytes,
    }];
    for (format, name, shard) in [
        (Format::Sdnb, "a.sdnb", None),
        (Format::Sharded, "b.sdnb", Some(8192)),
        (Format::Sdz, "c.sdz", None),
    ] {
        trace::start();
        let opts = SaveOptions {
            format,
            shard_size: shard,
            ..SaveOptions::default()
        };
        let files = sdnb::save(&tmp.path().join(name), &t, &opts).unwrap();
        let events = below(trace::take(), tmp.path());
        check_rules(&events, name);
        // Every file of the container is in place and durable before its sidecar.
        let sidecar = position(
            &events,
            |e| matches!(e, Event::Rename { to, .. } if to.to_string_lossy().ends_with(".checksums.json")),
        );
        assert_eq!(sidecar.len(), 1, "{name}: {events:#?}");
        for f in &files {
            let n = f.file_name().unwrap().to_string_lossy().into_owned();
            let at = position(&events, |e| renamed_to(e, &n));
            assert!(
                !at.is_empty() && at.iter().all(|&i| i < sidecar[0]),
                "{name}: {n}\n{events:#?}"
            );
        }
        if format == Format::Sharded {
            check_shard_set_journal(&events, &files, name);
        }
    }
}

/// A shard set's journal (`.BASE.shard-set.pending`) is its commit point: every shard is
/// durable under its temporary name, and the directory synced, before the journal is renamed
/// into place; every shard rename comes after it.
fn check_shard_set_journal(events: &[Event], files: &[std::path::PathBuf], name: &str) {
    let journal = position(events, |e| renamed_to(e, ".b.shard-set.pending"));
    assert_eq!(journal.len(), 1, "{name}: {events:#?}");
    let j = journal[0];
    assert!(files.len() >= 2, "{name}: {files:?}");
    for f in files {
        let tmp = shardkit::fsutil::temp_sibling(f);
        let synced = position(events, |e| matches!(e, Event::SyncFile(p) if *p == tmp));
        assert!(
            synced.len() == 1 && synced[0] < j,
            "{name}: {} not durable before the journal\n{events:#?}",
            tmp.display()
        );
        let n = f.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            position(events, |e| renamed_to(e, &n))[0] > j,
            "{name}: {n} renamed before the journal was written\n{events:#?}"
        );
    }
    let temps: Vec<_> = files
        .iter()
        .map(|f| shardkit::fsutil::temp_sibling(f))
        .collect();
    let last_sync = position(
        events,
        |e| matches!(e, Event::SyncFile(p) if temps.contains(p)),
    )
    .into_iter()
    .max()
    .unwrap();
    assert!(
        events[last_sync..j]
            .iter()
            .filter(|e| matches!(e, Event::SyncDir(_)))
            .count()
            >= 1,
        "{name}: the temporaries' directory entries are not durable before the journal\n{events:#?}"
    );
}
