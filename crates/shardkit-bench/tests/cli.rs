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
