//! The EAGLE-3 writer refuses values the format cannot store (issue 32, class 2): each rule
//! gives `Error::Refused` naming the field, where, the value and what is allowed; nothing of a
//! refused write is stored, and the write continues and completes afterwards. `validate --deep`
//! applies the same rules to what other tools wrote (here: [`Writer::add_unchecked`], the
//! writer without its checks, a crate-only hook).

use std::collections::BTreeMap;
use std::path::Path;

use crate::json::{self, Value};
use crate::offline::rules::sum_tolerance;
use crate::offline::shard::field_specs;
use crate::offline::{self as eagle3, Manifest, Writer, WriterOptions};
use crate::Error;

/// A manifest: `n` samples in shards of 2, S = 4, 3H = 6, Vd = 5, vocab 100.
fn config(n: u64, dtype: &str, topk: Option<u64>) -> Value {
    let mut text = format!(
        r#"{{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": 5,
        "seq_length": 4, "dtype": "{dtype}", "num_samples": {n}, "shard_size": 2,
        "aux_hidden_dim": 6, "aux_layer_ids": [1, 2, 3], "selected_token_ids": [3, 9, 20, 41, 77]"#
    );
    if let Some(k) = topk {
        text.push_str(&format!(r#", "target_probs_topk": {k}"#));
    }
    text.push('}');
    json::parse(text.as_bytes()).unwrap()
}

/// Valid rows of samples `first..first+n` (shardkit's synthetic samples), by field.
fn rows(m: &Manifest, first: u64, n: u64) -> BTreeMap<&'static str, Vec<u8>> {
    let mut out: BTreeMap<&'static str, Vec<u8>> = BTreeMap::new();
    for i in first..first + n {
        for (name, bytes) in eagle3::synthetic_sample(m, i) {
            out.entry(name).or_default().extend(bytes);
        }
    }
    out
}

fn add(w: &mut Writer, n: u64, fields: &BTreeMap<&'static str, Vec<u8>>) -> crate::Result<()> {
    let refs: Vec<(&str, &[u8])> = fields.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    w.add(n, &refs)
}

fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn put_i64(bytes: &mut [u8], index: usize, v: i64) {
    bytes[index * 8..index * 8 + 8].copy_from_slice(&v.to_le_bytes());
}
fn put_f32(bytes: &mut [u8], index: usize, v: f32) {
    bytes[index * 4..index * 4 + 4].copy_from_slice(&v.to_le_bytes());
}

/// One bad batch: which field, how it is spoiled, and the words the refusal must hold.
struct Case {
    what: &'static str,
    topk: Option<u64>,
    spoil: fn(&mut BTreeMap<&'static str, Vec<u8>>),
    field: &'static str,
    words: &'static [&'static str],
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            what: "an id past target_vocab_size",
            topk: None,
            // sample 1 (of the batch), position 2: element 4 + 2.
            spoil: |f| put_i64(f.get_mut("input_ids").unwrap(), 6, 100),
            field: "input_ids",
            words: &[
                "sample 3, position 2",
                ": 100",
                "0 to 99",
                "target_vocab_size",
            ],
        },
        Case {
            what: "a negative id",
            topk: None,
            spoil: |f| put_i64(f.get_mut("input_ids").unwrap(), 0, -1),
            field: "input_ids",
            words: &["sample 2, position 0", ": -1"],
        },
        Case {
            what: "an attention mask of 2",
            topk: None,
            spoil: |f| put_i64(f.get_mut("attention_mask").unwrap(), 1, 2),
            field: "attention_mask",
            words: &["sample 2, position 1", ": 2", "0 or 1"],
        },
        Case {
            what: "a loss mask of -1",
            topk: None,
            spoil: |f| {
                let lm = f.get_mut("loss_mask").unwrap();
                put_i64(lm, 3, -1);
            },
            field: "loss_mask",
            words: &[": -1", "0 or 1"],
        },
        Case {
            what: "a position mask byte of 2",
            topk: None,
            spoil: |f| f.get_mut("position_mask").unwrap()[5] = 2,
            field: "position_mask",
            words: &["sample 3, position 1", ": 2", "0 or 1"],
        },
        Case {
            what: "position_mask set where loss_mask is 0",
            topk: None,
            spoil: |f| {
                put_i64(f.get_mut("loss_mask").unwrap(), 0, 0);
                f.get_mut("position_mask").unwrap()[0] = 1;
            },
            field: "position_mask",
            words: &["sample 2, position 0", "loss_mask is 1"],
        },
        Case {
            what: "a NaN hidden state",
            topk: None,
            // sample 0, position 1: element 1 * 6 + 2.
            spoil: |f| put_f32(f.get_mut("aux_hidden_states").unwrap(), 8, f32::NAN),
            field: "aux_hidden_states",
            words: &["sample 2, position 1", ": NaN", "finite fp32"],
        },
        Case {
            what: "an infinite probability",
            topk: None,
            spoil: |f| put_f32(f.get_mut("target_probs").unwrap(), 0, f32::INFINITY),
            field: "target_probs",
            words: &["sample 2, position 0", ": inf", "finite"],
        },
        Case {
            what: "a negative probability",
            topk: None,
            spoil: |f| {
                let p = f.get_mut("target_probs").unwrap();
                // keep the row's sum: -0.1 here, +0.1 on the next column.
                let a = f32::from_le_bytes(p[0..4].try_into().unwrap());
                let b = f32::from_le_bytes(p[4..8].try_into().unwrap());
                put_f32(p, 0, -0.1);
                put_f32(p, 1, a + b + 0.1);
            },
            field: "target_probs",
            words: &[": -0.1", "probabilities from 0 to 1"],
        },
        Case {
            what: "a row summing to 1.25",
            topk: None,
            spoil: |f| {
                let p = f.get_mut("target_probs").unwrap();
                // sample 1, position 3: row 7 of 5 values.
                let v = f32::from_le_bytes(p[140..144].try_into().unwrap());
                put_f32(p, 35, v + 0.25);
            },
            field: "target_probs",
            words: &[
                "sample 3, position 3",
                "the row sums to 1.25",
                "within 0.0001",
                "fp32",
            ],
        },
        Case {
            what: "a top-k index past the draft vocabulary",
            topk: Some(2),
            spoil: |f| {
                let ix = f.get_mut("target_probs_indices").unwrap();
                // sample 0 of the batch, position 3, its first index: element 3 * 2.
                ix[24..28].copy_from_slice(&5i32.to_le_bytes());
            },
            field: "target_probs_indices",
            words: &["sample 2, position 3", ": 5", "0 to 4", "draft_vocab_size"],
        },
        Case {
            what: "a NaN top-k value",
            topk: Some(2),
            spoil: |f| put_f32(f.get_mut("target_probs_values").unwrap(), 9, f32::NAN),
            field: "target_probs_values",
            words: &["sample 3, position 0", "NaN"],
        },
    ]
}

#[test]
fn each_rule_refuses_the_batch_and_stores_nothing() {
    for case in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("c");
        let version = if case.topk.is_some() { 2 } else { 1 };
        let cfg = config(6, "fp32", case.topk);
        let mut w = Writer::create(
            &dir,
            &cfg,
            WriterOptions {
                version,
                resume: false,
            },
        )
        .unwrap();
        let m = w.manifest().clone();
        add(&mut w, 2, &rows(&m, 0, 2)).unwrap();
        let before = tree(&dir);
        // A batch of 3 samples (2..5) crossing a shard boundary, one value spoiled.
        let mut bad = rows(&m, 2, 3);
        (case.spoil)(&mut bad);
        let err = add(&mut w, 3, &bad).unwrap_err();
        let Error::Refused { field, .. } = &err else {
            panic!("{}: not Error::Refused: {err:?}", case.what);
        };
        assert_eq!(field, case.field, "{}", case.what);
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("{}: refused `{}` at ", dir.display(), case.field)),
            "{}: {text}",
            case.what
        );
        for words in case.words {
            assert!(text.contains(words), "{}: {words:?} in {text}", case.what);
        }
        assert!(text.contains("nothing of this write was stored"), "{text}");
        // Nothing of it was stored: the same files, the same next sample.
        assert_eq!(w.next_sample(), 2, "{}", case.what);
        assert_eq!(tree(&dir), before, "{}", case.what);
        // The write goes on and completes; the cache passes the deep checks.
        add(&mut w, 4, &rows(&m, 2, 4)).unwrap();
        w.finish().unwrap();
        let v = eagle3::validate(&dir, true);
        assert!(v.is_valid(), "{}: {v:?}", case.what);
    }
}

#[test]
fn deep_validation_applies_the_writers_rules() {
    // What another tool wrote (here: the writer without its checks) is reported by the same
    // rules, with the first offending value and where it is.
    for case in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("c");
        let version = if case.topk.is_some() { 2 } else { 1 };
        let mut w = Writer::create(
            &dir,
            &config(6, "fp32", case.topk),
            WriterOptions {
                version,
                resume: false,
            },
        )
        .unwrap();
        let m = w.manifest().clone();
        add(&mut w, 2, &rows(&m, 0, 2)).unwrap();
        let mut bad = rows(&m, 2, 4);
        (case.spoil)(&mut bad);
        let refs: Vec<(&str, &[u8])> = bad.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        w.add_unchecked(4, &refs).unwrap();
        w.finish().unwrap();
        let v = eagle3::validate(&dir, true);
        let errors: Vec<String> = v.errors().map(ToString::to_string).collect();
        assert!(!v.is_valid(), "{}", case.what);
        let found = errors
            .iter()
            .any(|e| e.contains(case.field) && case.words.iter().skip(1).all(|w| e.contains(w)));
        assert!(found, "{}: {errors:?}", case.what);
        // The deep findings name the sample in the cache, as the writer does.
        assert!(
            errors.iter().any(|e| e.contains("the first at sample")),
            "{errors:?}"
        );
    }
}

#[test]
fn the_sum_tolerance_is_the_dtypes() {
    assert_eq!(sum_tolerance(safetensors::Dtype::BF16), 1e-2);
    assert_eq!(sum_tolerance(safetensors::Dtype::F16), 2e-3);
    assert_eq!(sum_tolerance(safetensors::Dtype::F32), 1e-4);
    // bf16 rows that sum to 1 within bf16's rounding are accepted; past the tolerance refused.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c");
    let mut w = Writer::create(&dir, &config(2, "bf16", None), WriterOptions::default()).unwrap();
    let m = w.manifest().clone();
    let mut f = rows(&m, 0, 2);
    let spec = field_specs(&m)
        .into_iter()
        .find(|s| s.name == "target_probs")
        .unwrap();
    assert_eq!(spec.dtype, safetensors::Dtype::BF16);
    let p = f.get_mut("target_probs").unwrap();
    let bf = |x: f32| half::bf16::from_f32(x).to_le_bytes();
    // Row 0: 0.2 x 5 in bf16 (0.2 rounds to 0.2001953125: the sum is 1.0009766, within 1e-2).
    for j in 0..5 {
        p[j * 2..j * 2 + 2].copy_from_slice(&bf(0.2));
    }
    // Row 1: 0.203125 x 5 = 1.015625, off by more than 1e-2.
    for j in 5..10 {
        p[j * 2..j * 2 + 2].copy_from_slice(&bf(0.203125));
    }
    let err = add(&mut w, 2, &f).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("sample 0, position 1")
            && text.contains("within 0.01")
            && text.contains("bf16"),
        "{text}"
    );
    // Row 1 mended: accepted.
    let p = f.get_mut("target_probs").unwrap();
    for j in 5..10 {
        p[j * 2..j * 2 + 2].copy_from_slice(&bf(0.2));
    }
    add(&mut w, 2, &f).unwrap();
    w.finish().unwrap();
    assert!(eagle3::validate(&dir, true).is_valid());
}
