//! `shardkit tokens build` survives SIGKILL at any point: the dataset is then not started,
//! refused as interrupted, or complete and exact, and `--resume` finishes it byte-identically
//! to an uninterrupted build.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shardkit::flat_tokens::Split;
use shardkit::Error;

const BIN: &str = env!("CARGO_BIN_EXE_shardkit");

/// SHA-256 of every file under `dir`, by relative path.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(base, &e.path(), out);
            } else {
                out.insert(
                    e.path().strip_prefix(base).unwrap().display().to_string(),
                    shardkit::json::sha256_hex(&std::fs::read(e.path()).unwrap()),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

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

fn build(a: &[String]) {
    let out = Command::new(BIN).args(a).output().unwrap();
    assert!(
        out.status.success(),
        "{a:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn build_and_kill(a: &[String], delay: Duration) {
    let mut child = Command::new(BIN)
        .args(a)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();
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

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    for layout in ["v2", "v3"] {
        let reference_dir = tmp.path().join(format!("ref-{layout}"));
        let t0 = Instant::now();
        build(&args(&src, &reference_dir, layout, false));
        let full = t0.elapsed();
        let reference = snapshot(&reference_dir);
        let span = full.as_micros() as u64 * 5 / 4 + 1;
        for trial in 0..10 {
            let out = tmp.path().join(format!("{layout}-{trial}"));
            build_and_kill(
                &args(&src, &out, layout, false),
                Duration::from_micros(rng.next() % span),
            );
            *outcomes.entry(check_state(&out, &reference)).or_default() += 1;
            if rng.next() % 2 == 0 {
                build_and_kill(
                    &args(&src, &out, layout, true),
                    Duration::from_micros(rng.next() % span),
                );
                check_state(&out, &reference);
            }
            build(&args(&src, &out, layout, true));
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
