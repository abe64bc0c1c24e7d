//! `shardkit saev synth` writes what saev's own fake-data pipeline writes: given the fixtures'
//! shapes and checkpoint, the directory equals the saev-written fixture byte for byte in every
//! protocol (without saev's spurious empty shard), so saev loads it; and `saev write` refuses,
//! before creating anything, metadata that saev would not load.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{run, snapshot, BIN};
use shardkit::json::{self, Escape};

const CKPT: &str = "hf-hub:hf-internal-testing/tiny-open-clip-model";

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/saev")
        .join(rel)
}

/// Runs `saev synth` with the fixture shapes of case A (or C) and returns the directory.
fn synth(out: &Path, protocol: &str, case_c: bool) -> PathBuf {
    let mut args: Vec<String> = ["saev", "synth", "--ckpt", CKPT, "--family", "clip"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let shape: &[&str] = if case_c {
        &[
            "--examples",
            "5",
            "--layers",
            "3",
            "--content-tokens",
            "4",
            "--no-cls",
            "--d-model",
            "8",
            "--budget",
            "8",
            "--labels",
        ]
    } else {
        &[
            "--examples",
            "7",
            "--layers=-2,-1",
            "--content-tokens",
            "4",
            "--d-model",
            "8",
            "--budget",
            "30",
        ]
    };
    args.extend(shape.iter().map(|s| s.to_string()));
    args.extend([
        "--protocol".into(),
        protocol.into(),
        "--out".into(),
        out.display().to_string(),
    ]);
    PathBuf::from(run(&args).trim())
}

#[test]
fn synth_with_the_fixture_shapes_equals_the_saev_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    for (protocol, rel, case_c) in [
        (
            "1.0.0",
            "v1.0.0/bc87c00f08bd7bd69b6e64ca1b636ebf86e1ad452a520fa6032818b728a53b47",
            false,
        ),
        (
            "2.0",
            "v2.0/eec1d7ba782d48ff23cf8e88b9a79fe637f800b9d56a9b16f2bd03bfcb7a8401",
            false,
        ),
        ("2.1", "v2.1/aa57b80c", false),
        ("2.1", "v2.1/e64e5d2c", true),
    ] {
        let out = tmp.path().join(format!("{protocol}-{case_c}"));
        let dir = synth(&out, protocol, case_c);
        let want = fixture(rel);
        assert_eq!(
            dir.file_name(),
            want.file_name(),
            "{protocol}: directory name"
        );
        // Every file of the fixture, byte for byte; plus shardkit's checksums sidecar, which
        // saev never opens.
        let mut got = snapshot(&dir);
        assert!(
            got.remove("shardkit.checksums.json").is_some(),
            "{protocol}: no sidecar"
        );
        assert_eq!(got, snapshot(&want), "{protocol} {rel}");
        let v = run(&["saev", "validate", dir.to_str().unwrap()]);
        assert!(!v.contains("error") && !v.contains("warning"), "{v}");
    }
}

#[test]
fn write_refuses_metadata_saev_cannot_load_before_creating_anything() {
    let tmp = tempfile::tempdir().unwrap();
    // Inputs from synth --npy (metadata.json, acts.npy), then broken one key at a time.
    let npy = tmp.path().join("npy");
    run(&[
        "saev",
        "synth",
        "--npy",
        "--examples",
        "3",
        "--content-tokens",
        "2",
        "--d-model",
        "4",
        "--out",
        npy.to_str().unwrap(),
    ]);
    let good = json::parse(&std::fs::read(npy.join("metadata.json")).unwrap()).unwrap();
    let cases: &[(&str, &str, &str)] = &[
        (
            "data",
            r#"{"n_examples": 3, "__class__": "Fake"}"#,
            "`data` must be a string, base64 of a pickled saev dataset config",
        ),
        ("family", r#""vit""#, "`family` must be one of \"bird-mae\""),
        (
            "pixel_agg",
            "null",
            "`pixel_agg` must be \"majority\" or \"prefer-fg\"",
        ),
    ];
    for (i, (key, value, needle)) in cases.iter().enumerate() {
        let mut bad = good.clone();
        bad.set(key, json::parse(value.as_bytes()).unwrap());
        let md = tmp.path().join(format!("bad{i}.json"));
        std::fs::write(&md, json::to_pretty(&bad, 2, Escape::Utf8)).unwrap();
        let root = tmp.path().join(format!("root{i}"));
        let out = Command::new(BIN)
            .args(["saev", "write", "--metadata"])
            .arg(&md)
            .arg("--acts")
            .arg(npy.join("acts.npy"))
            .arg("--out")
            .arg(&root)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{key}: {err}");
        assert!(err.contains(needle), "{needle} in {err}");
        assert!(
            err.contains("protocol 2.1") && err.contains(&format!("bad{i}.json")),
            "{err}"
        );
        assert!(!root.exists(), "nothing may be created: {err}");
    }
}
