//! seqax's shuffled batches reproduced from the golden vectors seqax itself produced on its
//! synthetic dataset's train split (264,992 tokens, 512 documents).

use std::path::Path;

use crate::flat_tokens::seqax::{perm, seed_sequence_key, Philox, Schedule, ShuffleParams};
use crate::json::{self, Value};
use crate::Error;

const TRAIN_TOKENS: u64 = 264_992;
const TRAIN_DOCS: u64 = 512;

fn golden() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/flat_tokens/seqax_golden.json");
    json::parse(&std::fs::read(p).unwrap()).unwrap()
}

fn ints(v: &Value) -> Vec<u64> {
    let Value::Array(items) = v else {
        panic!("{v:?}")
    };
    items
        .iter()
        .map(|x| match x {
            Value::Number(n) => n.parse().unwrap(),
            _ => panic!(),
        })
        .collect()
}

fn num(v: &Value, k: &str) -> u64 {
    ints(&Value::Array(vec![v.get(k).unwrap().clone()]))[0]
}

#[test]
fn random_primitives_match_numpy() {
    let g = golden();
    let ss = g.get("seedsequence_generate_state_2_uint64").unwrap();
    for (seed, want) in [(0u128, "0"), (1, "1")] {
        assert_eq!(
            seed_sequence_key(seed).to_vec(),
            ints(ss.get(want).unwrap())
        );
    }
    let raw = g.get("philox_random_raw_5").unwrap();
    for (label, mut gen) in [
        ("seed 0", Philox::from_seed(0)),
        ("seed 7", Philox::from_seed(7)),
        ("seed 42", Philox::from_seed(42)),
        ("key [0,0]", Philox::from_key([0, 0])),
    ] {
        let got: Vec<u64> = (0..5).map(|_| gen.next_u64()).collect();
        assert_eq!(got, ints(raw.get(label).unwrap()), "{label}");
    }
    let p = g.get("perm").unwrap();
    for (label, seed, n) in [
        ("perm(0,10)", 0, 10),
        ("perm(1,16)", 1, 16),
        ("perm(7,1)", 7, 1),
    ] {
        let got: Vec<u64> = perm(seed, n).into_iter().map(u64::from).collect();
        assert_eq!(got, ints(p.get(label).unwrap()), "{label}");
    }
}

fn params(cfg: &Value) -> ShuffleParams {
    ShuffleParams {
        batch: num(cfg, "batch"),
        streams: num(cfg, "S"),
        read_blocks_per_shuffle_buffer: num(cfg, "R"),
        sequences_per_read_block: num(cfg, "B"),
        seed: num(cfg, "seed"),
    }
}

#[test]
fn packed_batches_equal_seqaxs() {
    let g = golden();
    let packed = g.get("packed_batches_train_split").unwrap();
    for name in ["A", "B", "C"] {
        let cfg = packed.get(name).unwrap();
        let n_seq = TRAIN_TOKENS / num(cfg, "len");
        let sched = Schedule::new(n_seq, params(cfg)).unwrap();
        assert_eq!(sched.step_count(), num(cfg, "step_count"), "{name}");
        assert_eq!(sched.minipochs(), num(cfg, "minipochs"), "{name}");
        let step = sched.step(num(cfg, "step")).unwrap();
        let want = ints(
            cfg.get("first_8_rows")
                .or_else(|| cfg.get("rows"))
                .expect("rows"),
        );
        assert_eq!(step[..want.len()], want[..], "config {name}");
    }
    // Config A by the spec's table: rbc 258.
    let a = Schedule::new(TRAIN_TOKENS / 64, params(packed.get("A").unwrap())).unwrap();
    assert_eq!(a.read_blocks(), 258);
}

#[test]
fn unpacked_documents_equal_seqaxs() {
    let cfg = golden().get("unpacked_single_read_block").unwrap().clone();
    let sched = Schedule::new(TRAIN_DOCS, params(&cfg)).unwrap();
    assert_eq!(
        sched.step(num(&cfg, "step")).unwrap(),
        ints(cfg.get("documents").unwrap())
    );
}

#[test]
fn every_sequence_of_an_epoch_is_used_once_and_steps_are_pure() {
    let p = ShuffleParams {
        batch: 12,
        streams: 3,
        read_blocks_per_shuffle_buffer: 4,
        sequences_per_read_block: 7,
        seed: 42,
    };
    // Every sequence of the epoch's read blocks exactly once: with batch 6 the 294 read blocks
    // of 7 (2058 of the 2070 sequences: whole blocks on each of 3 streams) fill 343 steps
    // exactly, the last minipoch's buffers being short (2 blocks a stream, not 4).
    let exact = Schedule::new(2070, ShuffleParams { batch: 6, ..p }).unwrap();
    assert_eq!((exact.read_blocks(), exact.step_count()), (294, 343));
    let mut all: Vec<u64> = (0..exact.step_count())
        .flat_map(|t| exact.step(t).unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..294 * 7).collect::<Vec<u64>>(),
        "each sequence once"
    );
    // With batch 12, 171 steps use 2052 of the 2058: distinct, all from the read blocks.
    let sched = Schedule::new(2070, p).unwrap();
    assert_eq!((sched.read_blocks(), sched.step_count()), (294, 171));
    let mut all: Vec<u64> = (0..sched.step_count())
        .flat_map(|t| sched.step(t).unwrap())
        .collect();
    assert_eq!(all.len(), 171 * 12);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 171 * 12, "no sequence twice");
    assert!(all.iter().all(|&s| s < 294 * 7));
    // A fresh schedule's step k equals step k after walking 0..k (resume needs only k).
    let fresh = Schedule::new(2070, p).unwrap();
    assert_eq!(fresh.step(170).unwrap(), sched.step(170).unwrap());
    let err = sched.step(171).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                what: "step",
                index: 171,
                len: 171
            }
        ),
        "{err:?}"
    );
    let err = Schedule::new(2070, ShuffleParams { batch: 13, ..p }).unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("batch 13 must be a multiple of streams 3")),
        "{err:?}"
    );
    let err = Schedule::new(5, p).unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("5 sequences make no full read block of 7")),
        "{err:?}"
    );
}
