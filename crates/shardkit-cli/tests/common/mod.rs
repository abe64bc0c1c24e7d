//! Helpers shared by the SIGKILL tests: a seeded xorshift, file snapshots, and killing a run
//! of the CLI after a delay.
// Each test binary uses a different part of these helpers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_shardkit");

/// xorshift64*: a reproducible stream of kill delays from the seed a test prints.
pub struct Rng(pub u64);

/// The variable that replays a run's kill points: `SHARDKIT_TEST_SEED=<seed>`.
pub const SEED_VAR: &str = "SHARDKIT_TEST_SEED";

impl Rng {
    /// Seeded from `SHARDKIT_TEST_SEED` (decimal, or hex with `0x`) when set, otherwise from the
    /// clock. Returns the seed too, and prints it first thing on standard error (shown with a
    /// failing test), so a failure reruns with the same kill points: the same delays, as the
    /// same fractions of the uninterrupted run's time measured in that run.
    pub fn seeded() -> (Rng, u64) {
        let seed = match std::env::var(SEED_VAR) {
            Ok(v) => {
                let v = v.trim();
                let parsed = match v.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => v.parse(),
                };
                parsed.unwrap_or_else(|e| panic!("{SEED_VAR}={v:?}: not a u64 ({e})"))
            }
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
        };
        eprintln!("kill points from seed {seed}: rerun with {SEED_VAR}={seed}");
        // xorshift's state must not be 0.
        (
            Rng(if seed == 0 {
                0x9e37_79b9_7f4a_7c15
            } else {
                seed
            }),
            seed,
        )
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// SHA-256 of every file under `dir`, by path relative to it.
pub fn snapshot(dir: &Path) -> BTreeMap<String, String> {
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

/// Runs the CLI with `args` to completion; its stdout.
pub fn run<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        args.iter()
            .map(|a| a.as_ref().to_owned())
            .collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Starts the CLI with `args` and kills it with SIGKILL after `delay`.
pub fn run_and_kill<S: AsRef<std::ffi::OsStr>>(args: &[S], delay: Duration) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    let _ = child.wait();
}

/// What a killed saev write or conversion left at `dir`: not started, incomplete (refused as
/// such by readers), or complete and identical to `reference`. A kill between shards.json (the
/// commit record) and the removal of the in-progress marker leaves the marker behind: harmless,
/// ignored by readers, removed by the next run.
#[allow(dead_code)] // not every test binary kills a saev writer
pub fn check_saev_state(dir: &Path, reference: &BTreeMap<String, String>) -> &'static str {
    if !dir.join("metadata.json").exists() {
        return "not started";
    }
    match shardkit::saev::Dataset::open(dir) {
        Ok(_) => {
            let mut files = snapshot(dir);
            files.remove(".shardkit-writing");
            assert_eq!(&files, reference, "a complete dataset must be exact");
            "complete"
        }
        Err(shardkit::Error::Incomplete { present, total, .. }) => {
            assert!(present <= total);
            "incomplete"
        }
        Err(e) => panic!("a killed run left neither an incomplete nor a valid dataset: {e}"),
    }
}
