//! The writer survives SIGKILL at any point: the directory is then either reported incomplete or
//! complete and correct, and `--resume` finishes it byte-identically to an uninterrupted write.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{check_saev_state, run, run_and_kill, snapshot, Rng};

fn write_args<'a>(src: &'a str, root: &'a str, resume: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "saev",
        "write",
        "--out",
        root,
        "--metadata",
        &format!("{src}/metadata.json"),
        "--acts",
        &format!("{src}/acts.npy"),
        "--labels",
        &format!("{src}/labels.npy"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if resume {
        a.push("--resume".into());
    }
    a
}

/// Starts a write and kills it with SIGKILL after `delay`.
fn write_and_kill(src: &str, root: &str, resume: bool, delay: Duration) {
    run_and_kill(&write_args(src, root, resume), delay);
}

#[test]
fn sigkill_at_random_points_then_resume_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let src_s = src.to_str().unwrap();
    // 47 examples of 2 x 65 x 256 floats (133 KiB), 3 per shard: 16 shards, the last one
    // partial (the case where resume must keep a complete short shard), labels included.
    run(&[
        "saev",
        "synth",
        "--npy",
        "--out",
        src_s,
        "--examples",
        "47",
        "--content-tokens",
        "64",
        "--d-model",
        "256",
        "--budget",
        "390",
        "--labels",
    ]);
    let ref_root = tmp.path().join("ref");
    let t0 = Instant::now();
    let ref_dir = PathBuf::from(
        run(&write_args(src_s, ref_root.to_str().unwrap(), false)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>())
        .trim(),
    );
    let full = t0.elapsed();
    let reference = snapshot(&ref_dir);
    // 16 shards, metadata.json, shards.json, labels.bin and the checksums sidecar.
    assert!(reference.contains_key("labels.bin") && reference.len() == 20);

    let (mut rng, seed) = Rng::seeded();
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    let span = full.as_micros() as u64 * 5 / 4 + 1;
    for trial in 0..24 {
        let root = tmp.path().join(format!("t{trial}"));
        let root_s = root.to_str().unwrap();
        let dir = root.join(ref_dir.file_name().unwrap());
        write_and_kill(
            src_s,
            root_s,
            false,
            Duration::from_micros(rng.next() % span),
        );
        *outcomes
            .entry(check_saev_state(&dir, &reference))
            .or_default() += 1;
        // Sometimes kill the resumed run too.
        if rng.next().is_multiple_of(2) {
            write_and_kill(
                src_s,
                root_s,
                true,
                Duration::from_micros(rng.next() % span),
            );
            check_saev_state(&dir, &reference);
        }
        let printed = run(&write_args(src_s, root_s, true)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>());
        assert_eq!(PathBuf::from(printed.trim()), dir);
        assert_eq!(snapshot(&dir), reference, "trial {trial} (seed {seed})");
        std::fs::remove_dir_all(&root).unwrap();
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?} (full write {full:?})");
    assert!(
        outcomes.get("incomplete").copied().unwrap_or(0) >= 1,
        "no kill landed mid-write (seed {seed}): {outcomes:?}"
    );
}
