//! An EAGLE-3 writer killed with SIGKILL at random points leaves a cache that either reads as
//! complete and exact or reports which samples are missing, with every shard file valid; a
//! resumed run completes it byte-identically (eagle3.md §13, "Resume and crash safety").

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shardkit::eagle3::{self, Cache};
use shardkit::Error;

const BIN: &str = env!("CARGO_BIN_EXE_shardkit");

fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                shardkit::json::sha256_hex(&std::fs::read(e.path()).unwrap()),
            )
        })
        .collect()
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

fn run_and_kill(a: &[String], delay: Duration) {
    let mut child = Command::new(BIN)
        .args(a)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    let _ = child.wait();
}

fn check_state(dir: &Path, reference: &BTreeMap<String, String>) -> &'static str {
    if !dir.join("manifest.json").exists() {
        return "not started";
    }
    // The manifest is always whole JSON, and every file named like a shard is valid.
    let v = eagle3::validate(dir, false);
    assert!(
        v.errors.iter().all(|e| e.contains("the shard set must be")),
        "{:?}",
        v.errors
    );
    match Cache::open(dir) {
        Ok(_) => {
            let mut files = snapshot(dir);
            files.retain(|name, _| !eagle3::is_temporary(name));
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
                present < total && detail.contains("are missing"),
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
    let out = Command::new(BIN)
        .args(args(&reference_dir, false))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let full = t0.elapsed();
    let reference = snapshot(&reference_dir);
    assert_eq!(reference.len(), 16, "manifest, embeddings and 14 shards");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    let span = full.as_micros() as u64 * 5 / 4 + 1;
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    for trial in 0..20 {
        let dir = tmp.path().join(format!("t{trial}"));
        run_and_kill(&args(&dir, false), Duration::from_micros(rng.next() % span));
        *outcomes.entry(check_state(&dir, &reference)).or_default() += 1;
        if rng.next() % 2 == 0 {
            run_and_kill(&args(&dir, true), Duration::from_micros(rng.next() % span));
            check_state(&dir, &reference);
        }
        let out = Command::new(BIN).args(args(&dir, true)).output().unwrap();
        assert!(
            out.status.success(),
            "trial {trial}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(snapshot(&dir), reference, "trial {trial} (seed {seed})");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?} (full write {full:?})");
    assert!(
        outcomes.get("incomplete").copied().unwrap_or(0) >= 1,
        "no kill landed mid-write: {outcomes:?}"
    );
}
