//! `shardkit tokens build` survives SIGKILL at any point: the dataset is then not started,
//! refused as interrupted, or complete and exact, and `--resume` finishes it byte-identically
//! to an uninterrupted build.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{run, run_and_kill, snapshot, Rng};

use shardkit::flat_tokens::Split;
use shardkit::Error;

fn args(src: &Path, out: &Path, layout: &str, resume: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "tokens",
        "build",
        "--split",
        "train",
        "--layout",
        layout,
        // Many commits, so kills land before, inside and between them.
        "--checkpoint-tokens",
        "40000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend([
        "--from".into(),
        src.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    if resume {
        a.push("--resume".into());
    }
    a
}

/// Never served unless complete, and then exact.
fn check_state(out: &Path, reference: &BTreeMap<String, String>) -> &'static str {
    match Split::open(out, "train") {
        Ok(s) => {
            assert!(s.is_marked_complete());
            assert_eq!(&snapshot(out), reference, "a served dataset must be exact");
            "complete"
        }
        Err(Error::Interrupted { .. }) => "interrupted",
        Err(e) => {
            // Killed before the split existed: nothing of it may be readable.
            let split_exists =
                out.join("train/.zgroup").exists() || out.join("train/zarr.json").exists();
            assert!(!split_exists, "neither interrupted nor complete: {e}");
            "not started"
        }
    }
}

#[test]
fn sigkill_during_tokens_build_then_resume_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    // 6,000 ragged sequences (empty ones included), about 1.2 M tokens.
    let src = tmp.path().join("tokens.jsonl");
    let mut rng = Rng(0x5eed);
    let mut text = String::new();
    for i in 0..6_000 {
        let len = if i % 50 == 7 { 0 } else { rng.next() % 400 + 1 };
        let ids: Vec<String> = (0..len)
            .map(|_| (rng.next() % 50_000 + 1).to_string())
            .collect();
        text.push_str(&format!("[{}]\n", ids.join(",")));
    }
    std::fs::write(&src, text).unwrap();

    let mut rng = Rng::from_clock();
    let seed = rng.0;
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    for layout in ["v2", "v3"] {
        let reference_dir = tmp.path().join(format!("ref-{layout}"));
        let t0 = Instant::now();
        run(&args(&src, &reference_dir, layout, false));
        let full = t0.elapsed();
        let reference = snapshot(&reference_dir);
        let span = full.as_micros() as u64 * 5 / 4 + 1;
        for trial in 0..10 {
            let out = tmp.path().join(format!("{layout}-{trial}"));
            run_and_kill(
                &args(&src, &out, layout, false),
                Duration::from_micros(rng.next() % span),
            );
            *outcomes.entry(check_state(&out, &reference)).or_default() += 1;
            if rng.next() % 2 == 0 {
                run_and_kill(
                    &args(&src, &out, layout, true),
                    Duration::from_micros(rng.next() % span),
                );
                check_state(&out, &reference);
            }
            run(&args(&src, &out, layout, true));
            assert_eq!(
                snapshot(&out),
                reference,
                "{layout} trial {trial} (seed {seed})"
            );
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?}");
    assert!(
        outcomes.get("interrupted").copied().unwrap_or(0) >= 1,
        "no kill landed mid-build: {outcomes:?}"
    );
}
