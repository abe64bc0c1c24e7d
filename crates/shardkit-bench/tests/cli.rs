//! The `shardkit-bench` binary runs (a quick bench at a small size, its JSON parsed), and the
//! build of it that the tests make is the one `shardkit bench` (the CLI's forwarder) finds next to
//! the `shardkit` binary.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_shardkit-bench");

#[test]
fn help_lists_every_bench() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    // The writer processes `bench parts` spawns are internal.
    assert!(!help.contains("parts-rank"), "{help}");
    assert!(
        help.contains("Measurements that print JSON with the ceiling measured in the same run"),
        "{help}"
    );
    for bench in [
        "saev-write",
        "saev-read",
        "tokens",
        "remote",
        "eagle3",
        "sdnb",
        "link",
        "parts",
    ] {
        assert!(
            help.contains(&format!("  {bench} ")),
            "{bench} missing:\n{help}"
        );
    }
}

#[test]
fn an_unknown_bench_is_a_usage_error() {
    let out = Command::new(BIN).arg("nonesuch").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("unrecognized subcommand 'nonesuch'"), "{err}");
}

#[test]
fn a_small_saev_write_bench_prints_its_figures() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "saev-write",
            "--size-mib",
            "8",
            "--rounds",
            "1",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v = shardkit::json::parse(&out.stdout).unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains(r#""bench": "saev-write""#), "{text}");
    assert!(matches!(v, shardkit::json::Value::Object(_)), "{text}");
}

#[test]
fn a_small_parts_bench_writes_identical_datasets_and_times_the_commit() {
    use shardkit::json::Value;
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "parts",
            "--size-mib",
            "12",
            "--shard-mib",
            "2",
            "--writers",
            "2,3",
            "--rounds",
            "1",
            "--commit-shards",
            "12",
            "--commit-writers",
            "3",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v = shardkit::json::parse(&out.stdout).unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        v.get("bench").and_then(Value::as_str),
        Some("parts"),
        "{text}"
    );
    assert_eq!(v.get("byte_identical"), Some(&Value::Bool(true)), "{text}");
    let Some(Value::Array(runs)) = v.get("runs") else {
        panic!("no runs: {text}");
    };
    // 1 writer is always run, first: the dataset the others are compared with.
    let writers: Vec<i64> = runs
        .iter()
        .map(|r| r.get("writers").and_then(Value::as_i64).unwrap())
        .collect();
    assert_eq!(writers, [1, 2, 3], "{text}");
    let sha = runs[0].get("sha256").and_then(Value::as_str).unwrap();
    assert_eq!(sha.len(), 64, "{text}");
    let positive = |r: &Value, k: &str| {
        let Some(Value::Number(n)) = r.get(k) else {
            panic!("{k} missing: {text}");
        };
        assert!(n.parse::<f64>().unwrap() > 0.0, "{k} = {n}: {text}");
    };
    for r in runs {
        assert_eq!(
            r.get("byte_identical_to_1_writer"),
            Some(&Value::Bool(true)),
            "{text}"
        );
        assert_eq!(r.get("sha256").and_then(Value::as_str), Some(sha), "{text}");
        // 12 MiB holds 5 examples of 2 x 257 x 1024 float32 (one a shard: 5 shards).
        assert_eq!(r.get("bytes").and_then(Value::as_i64), Some(5 * 2_105_344));
        for k in [
            "seconds",
            "gb_per_s",
            "ceiling_1_writer_gb_per_s",
            "ceiling_same_writers_gb_per_s",
            "ceiling_gb_per_s",
            "ratio",
            "commit_s",
        ] {
            positive(r, k);
        }
    }
    let commit = v.get("commit").unwrap();
    assert_eq!(
        commit.get("shards").and_then(Value::as_i64),
        Some(12),
        "{text}"
    );
    assert_eq!(
        commit.get("writers").and_then(Value::as_i64),
        Some(3),
        "{text}"
    );
    assert_eq!(commit.get("committed"), Some(&Value::Bool(true)), "{text}");
    positive(commit, "commit_s");
    positive(commit, "remove_files_serial_s");
    // Every run's data is removed.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
}
