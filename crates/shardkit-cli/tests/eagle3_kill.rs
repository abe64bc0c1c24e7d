//! An EAGLE-3 writer killed with SIGKILL at random points leaves a cache that either reads as
//! complete and exact or reports which samples are missing, with every shard file valid; a
//! resumed run completes it byte-identically (eagle3.md §13, "Resume and crash safety").

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{run, run_and_kill, snapshot, Rng};

use shardkit::eagle3::{self, Cache};
use shardkit::Error;

/// Whether `name` is a temporary a killed writer leaves: `<name>.tmp`, or `.tmp` followed by 6
/// characters (the safetensors crate's own temporary file).
fn is_temporary(name: &str) -> bool {
    name.ends_with(".tmp")
        || (name.len() == 10
            && name.starts_with(".tmp")
            && name[4..].bytes().all(|b| b.is_ascii_alphanumeric()))
}

fn args(out: &Path, resume: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "eagle3",
        "synth",
        "--samples",
        "40",
        "--shard-size",
        "3",
        "--seq-length",
        "64",
        "--hidden",
        "64",
        "--draft-vocab",
        "1024",
        "--version",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["--out".into(), out.display().to_string()]);
    if resume {
        a.push("--resume".into());
    }
    a
}

fn check_state(dir: &Path, reference: &BTreeMap<String, String>) -> &'static str {
    if !dir.join("manifest.json").exists() {
        return "not started";
    }
    // The manifest is always whole JSON, and every file named like a shard is valid.
    let v = eagle3::validate(dir, false);
    assert!(
        v.errors()
            .all(|e| e.message.contains("the shard set must be")),
        "{v:?}"
    );
    match Cache::open(dir) {
        Ok(_) => {
            let mut files = snapshot(dir);
            files.retain(|name, _| !is_temporary(name));
            // A kill after the last shard but before the writer finished leaves the embeddings
            // or the checksums sidecar to come; the resumed run writes them.
            let mut reference = reference.clone();
            for late in ["shardkit.checksums.json", "target_embeddings.safetensors"] {
                if !files.contains_key(late) {
                    reference.remove(late);
                }
            }
            let reference = &reference;
            assert_eq!(
                &files, reference,
                "a cache that reads as complete must be exact"
            );
            "complete"
        }
        Err(Error::Incomplete {
            present,
            total,
            detail,
            ..
        }) => {
            assert!(
                present < total
                    && (detail.contains(" are missing") || detail.contains(" is missing")),
                "{detail}"
            );
            "incomplete"
        }
        Err(e) => panic!("neither complete nor reporting the missing samples: {e}"),
    }
}

#[test]
fn sigkill_at_random_points_then_resume_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let reference_dir = tmp.path().join("ref");
    let t0 = Instant::now();
    run(&args(&reference_dir, false));
    let full = t0.elapsed();
    let reference = snapshot(&reference_dir);
    assert_eq!(
        reference.len(),
        17,
        "manifest, embeddings, 14 shards and the checksums sidecar"
    );
    let (mut rng, seed) = Rng::seeded();
    let span = full.as_micros() as u64 * 5 / 4 + 1;
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    for trial in 0..20 {
        let dir = tmp.path().join(format!("t{trial}"));
        run_and_kill(&args(&dir, false), Duration::from_micros(rng.next() % span));
        *outcomes.entry(check_state(&dir, &reference)).or_default() += 1;
        if rng.next().is_multiple_of(2) {
            run_and_kill(&args(&dir, true), Duration::from_micros(rng.next() % span));
            check_state(&dir, &reference);
        }
        run(&args(&dir, true));
        assert_eq!(snapshot(&dir), reference, "trial {trial} (seed {seed})");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?} (full write {full:?})");
    assert!(
        outcomes.get("incomplete").copied().unwrap_or(0) >= 1,
        "no kill landed mid-write (seed {seed}): {outcomes:?}"
    );
}
