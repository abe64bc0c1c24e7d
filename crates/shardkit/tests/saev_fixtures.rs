//! The saev reference fixtures (written by saev's own writers) read and rewritten exactly.

use std::path::{Path, PathBuf};

use shardkit::json::{self, Value};
use shardkit::saev::{
    validate, Dataset, Layout, Metadata, Severity, TokenMode, WriteStart, Writer, WriterOptions,
};
use shardkit::Error;

mod common;
use common::*;

/// Reads and parses `dir/metadata.json`.
fn read_md(dir: &Path) -> shardkit::Result<(Metadata, Vec<String>)> {
    let path = dir.join("metadata.json");
    Metadata::parse(&std::fs::read(&path).unwrap(), &path)
}
const COMPLETE: [&str; 6] = [A_100, B_100, A_20, A_21, B_21, C_21];

/// The coded value of every fixture: v[e, l, t, d] = 1000e + 100l + t + d/16.
fn coded(e: u64, l: u64, t: u64, d: u64) -> f32 {
    (1000 * e + 100 * l + t) as f32 + d as f32 / 16.0
}

fn coded_acts(first: u64, n: u64, l: u64, t: u64, d: u64) -> Vec<f32> {
    let mut v = Vec::new();
    for e in first..first + n {
        for li in 0..l {
            for ti in 0..t {
                for di in 0..d {
                    v.push(coded(e, li, ti, di));
                }
            }
        }
    }
    v
}

fn case_c_labels(first: u64, n: u64) -> Vec<u8> {
    (first..first + n)
        .flat_map(|e| (0..4).map(move |c| ((10 * e + c) % 7) as u8))
        .collect()
}

fn sha(path: &Path) -> String {
    json::sha256_hex(&std::fs::read(path).unwrap())
}

#[test]
fn directory_names_follow_each_versions_recipe() {
    for dir in COMPLETE.iter().chain([&CRASHED_20]) {
        let path = fixtures().join(dir);
        let (md, warnings) = read_md(&path).unwrap();
        assert!(warnings.is_empty(), "{dir}: {warnings:?}");
        let name = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(md.dir_name(), name, "{dir}");
    }
    // Each recipe's hashed text and name: src/saev/tests/recipes.rs (`Recipe` is internal).
}

#[test]
fn canonical_metadata_bytes_equal_the_fixtures() {
    for dir in COMPLETE.iter().chain([&CRASHED_20]) {
        let path = fixtures().join(dir).join("metadata.json");
        let bytes = std::fs::read(&path).unwrap();
        // Shuffle the caller's key order: the writer must restore the canonical one.
        let Value::Object(mut members) = json::parse(&bytes).unwrap() else {
            panic!()
        };
        members.reverse();
        let md = Metadata::for_writing(&Value::Object(members)).unwrap();
        assert_eq!(
            String::from_utf8(md.file_bytes()).unwrap(),
            String::from_utf8(bytes).unwrap(),
            "{dir}"
        );
    }
}

#[test]
fn every_value_matches_the_coded_formula() {
    for dir in COMPLETE {
        let ds = Dataset::open(fixtures().join(dir)).unwrap();
        let l = *ds.layout();
        let layers = ds.metadata().layers();
        for e in 0..l.n_examples {
            for slot in 0..l.n_layers {
                for t in 0..l.tokens {
                    let buf = ds.get(e, layers[slot as usize], t).unwrap();
                    let want: Vec<f32> = (0..l.d_model).map(|d| coded(e, slot, t, d)).collect();
                    assert_eq!(buf, want, "{dir} e={e} l={slot} t={t}");
                }
            }
        }
    }
}

#[test]
fn spurious_empty_shard_is_read_and_ignored() {
    for dir in [B_100, B_21] {
        let ds = Dataset::open(fixtures().join(dir)).unwrap();
        assert_eq!(ds.layout().n_examples, 6);
        assert_eq!(ds.layout().n_shards, 2);
        let r = validate(fixtures().join(dir));
        assert!(r.is_valid(), "{r:?}");
        assert!(r
            .findings
            .iter()
            .any(|p| p.severity == Severity::Note && p.message.contains("spurious")));
    }
}

#[test]
fn crashed_fixture_is_refused_as_incomplete() {
    let err = Dataset::open(fixtures().join(CRASHED_20)).unwrap_err();
    match &err {
        Error::Incomplete { present, total, .. } => assert_eq!((*present, *total), (2, 7)),
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().contains("2 of 7 examples are present"),
        "{err}"
    );
    let r = validate(fixtures().join(CRASHED_20));
    assert!(!r.is_valid());
    assert!(
        r.findings.iter().any(|p| p.message.contains("2 of 7")),
        "{r:?}"
    );
}

#[test]
fn complete_fixtures_validate_cleanly() {
    for dir in [A_100, A_20, A_21, C_21] {
        let r = validate(fixtures().join(dir));
        assert!(r.findings.is_empty(), "{dir}: {r:?}");
    }
}

#[test]
fn layer_lookup_uses_recorded_values() {
    let ds = Dataset::open(fixtures().join(A_21)).unwrap();
    // -2 is stored slot 0 and -1 slot 1: values are labels, not positions from the end.
    assert_eq!(ds.get(4, -2, 3).unwrap()[0], coded(4, 0, 3, 0));
    assert_eq!(ds.get(4, -1, 3).unwrap()[0], coded(4, 1, 3, 0));
    let err = ds.get(0, 3, 0).unwrap_err().to_string();
    assert!(err.contains("layer 3") && err.contains("[-2, -1]"), "{err}");
    // Example 4, layer -1, content token 2 (slot 3): acts000001.bin at byte 576.
    assert_eq!(ds.get(4, -1, 3).unwrap()[..2], [4103.0, 4103.0625]);
}

#[test]
fn token_modes_enumerate_like_saev_with_the_special_fix() {
    let ds = Dataset::open(fixtures().join(A_21)).unwrap();
    let content = ds.indexed(-2, TokenMode::Content).unwrap();
    assert_eq!(content.len(), 28);
    let row = content.get(9).unwrap(); // example 2, content token 1 (slot 2)
    assert_eq!((row.example_idx, row.token_idx), (2, 1));
    assert_eq!(row.act[0], coded(2, 0, 2, 0));
    let err = content.get(28).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                index: 28,
                len: 28,
                ..
            }
        ),
        "{err:?}"
    );

    let special = ds.indexed(-1, TokenMode::Special).unwrap();
    assert_eq!(special.len(), 7);
    for i in 0..7 {
        let row = special.get(i).unwrap();
        assert_eq!((row.example_idx, row.token_idx), (i, -1));
        assert_eq!(row.act[0], coded(i, 1, 0, 0)); // saev's `//` bug would differ from i = 1
    }
    assert_eq!(special.get(3).unwrap().act[0], 3100.0);

    let all = ds.indexed(-2, TokenMode::All).unwrap();
    assert_eq!(all.len(), 35);
    let row = all.get(5).unwrap();
    assert_eq!((row.example_idx, row.token_idx), (1, -1));

    let c = Dataset::open(fixtures().join(C_21)).unwrap();
    let err = c
        .indexed(3, TokenMode::Special)
        .expect_err("no special token");
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("special")),
        "{err:?}"
    );
    let content = c.indexed(3, TokenMode::Content).unwrap();
    assert_eq!(content.len(), 20);
    let labels: Vec<u8> = (0..20)
        .map(|i| content.get(i).unwrap().token_label.unwrap())
        .collect();
    assert_eq!(labels, case_c_labels(0, 5));
}

#[test]
fn take_returns_rows_in_request_order() {
    let ds = Dataset::open(fixtures().join(A_100)).unwrap();
    let coords = [(6, -1, 4), (0, -2, 0), (3, -2, 2), (6, -1, 4)];
    let out = ds.take(&coords).unwrap();
    for (i, &(e, layer, t)) in coords.iter().enumerate() {
        let slot = if layer == -2 { 0 } else { 1 };
        assert_eq!(out[i * 8 + 3], coded(e, slot, t, 3));
    }
    let err = ds.take(&[(7, -1, 0)]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                what: "example",
                index: 7,
                len: 7
            }
        ),
        "{err:?}"
    );
}

/// Writes a fixture's case with shardkit and returns the new directory.
fn write_case(dir: &str, root: &Path, batch: u64) -> PathBuf {
    let (md, _) = read_md(&fixtures().join(dir)).unwrap();
    let md = Metadata::for_writing(md.raw()).unwrap();
    let layout = Layout::new(&md, Path::new("metadata.json")).unwrap();
    let (n, l, t, d) = (
        layout.n_examples,
        layout.n_layers,
        layout.tokens,
        layout.d_model,
    );
    let labelled = dir == C_21;
    let mut w = Writer::create(root, md, WriterOptions::default()).unwrap();
    assert_eq!(w.start(), WriteStart::Fresh);
    let mut e = 0;
    while e < n {
        let b = batch.min(n - e);
        let labels = labelled.then(|| case_c_labels(e, b));
        w.write(&coded_acts(e, b, l, t, d), labels.as_deref())
            .unwrap();
        e += b;
    }
    w.finish().unwrap()
}

#[test]
fn writing_the_fixture_cases_reproduces_their_bytes() {
    for (dir, batch) in [
        (A_100, 2),
        (A_20, 7),
        (A_21, 1),
        (C_21, 3),
        (B_100, 4),
        (B_21, 5),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = write_case(dir, tmp.path(), batch);
        let fixture = fixtures().join(dir);
        assert_eq!(out.file_name(), fixture.file_name(), "{dir}");
        assert_eq!(
            sha(&out.join("metadata.json")),
            sha(&fixture.join("metadata.json"))
        );
        let is_b = dir == B_100 || dir == B_21;
        let n_files = if is_b { 2 } else { 3 };
        for s in 0..n_files {
            let name = format!("acts{s:06}.bin");
            assert_eq!(
                sha(&out.join(&name)),
                sha(&fixture.join(&name)),
                "{dir} {name}"
            );
        }
        assert!(!out.join("acts000002.bin").exists() || !is_b);
        if is_b {
            let want = if dir == B_100 {
                "d1c41f60332966ce3fc4fba58d22b1c0a944174c05ca478c42c47629a0fbb632"
            } else {
                "951fe9e00c5bb48b3132bda41fe69c7ad77628ece23c337ec18d049b6a56ed44"
            };
            assert_eq!(sha(&out.join("shards.json")), want, "{dir}");
        } else {
            assert_eq!(
                sha(&out.join("shards.json")),
                sha(&fixture.join("shards.json"))
            );
        }
        if dir == C_21 {
            assert_eq!(
                sha(&out.join("labels.bin")),
                sha(&fixture.join("labels.bin"))
            );
        }
        let names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        assert!(validate(&out).findings.is_empty());
    }
}

#[test]
fn case_b_as_2_0_has_the_documented_shards_json() {
    let (md, _) = read_md(&fixtures().join(B_100)).unwrap();
    let Value::Object(mut members) = md.raw().clone() else {
        panic!()
    };
    for (k, v) in members.iter_mut() {
        if k == "protocol" {
            *v = Value::String("2.0".into());
        }
    }
    members.push(("dataset".into(), Value::String("fake".into())));
    let md = Metadata::for_writing(&Value::Object(members)).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), md, WriterOptions::default()).unwrap();
    w.write(&coded_acts(0, 6, 2, 5, 8), None).unwrap();
    let out = w.finish().unwrap();
    let sj = std::fs::read(out.join("shards.json")).unwrap();
    assert_eq!(sj.len(), 108);
    assert_eq!(
        json::sha256_hex(&sj),
        "4c70574c59efae83ca48ed44bc456c13fac77dc8bfb7d876ff70d9e3eadf13e6"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn resuming_the_crashed_fixture_completes_it_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join(CRASHED_20);
    let name = src.file_name().unwrap();
    copy_dir(&src, &tmp.path().join(name));
    let (md, _) = read_md(&src).unwrap();
    let md = Metadata::for_writing(md.raw()).unwrap();
    // Without resume the interrupted dataset is kept and the call refused.
    let err = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("2 of 7"), "{err}");
    let mut w = Writer::create(tmp.path(), md, WriterOptions::resuming()).unwrap();
    assert_eq!(w.start(), WriteStart::Resumed { from: 0 });
    let from = w.next_example();
    w.write(&coded_acts(from, 7 - from, 2, 5, 8), None).unwrap();
    let out = w.finish().unwrap();
    let a20 = fixtures().join(A_20);
    for f in [
        "acts000000.bin",
        "acts000001.bin",
        "acts000002.bin",
        "shards.json",
    ] {
        assert_eq!(sha(&out.join(f)), sha(&a20.join(f)), "{f}");
    }
    assert_eq!(
        sha(&out.join("metadata.json")),
        sha(&src.join("metadata.json"))
    );
    assert_eq!(
        sha(&out.join("shards.json")),
        "cffb35eba40eb56aa77a12e355d9a7682cbb48144a0292b844a079643839e85a"
    );
}
