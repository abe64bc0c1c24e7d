//! Robustness of the saev module: every bad input is a clear `shardkit::Error` that names the
//! file and the rule (never a panic); the writer never overwrites what it does not own; and a
//! write interrupted after any number of examples resumes to a directory byte-identical to an
//! uninterrupted one. Property tests check that no input makes the parsers panic and that the
//! index arithmetic is consistent.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use shardkit::json::{self, Escape, Value};
use shardkit::report::Validation;
use shardkit::saev::{
    inspect, validate, Dataset, Layout, Metadata, Severity, TokenMode, WriteStart, Writer,
    WriterOptions,
};
use shardkit::Error;

// ---------------------------------------------------------------------------------------------
// Fixtures and helpers
// ---------------------------------------------------------------------------------------------

mod common;
use common::*;

/// Reads and parses `dir/metadata.json`.
fn read_md(dir: &Path) -> shardkit::Result<(Metadata, Vec<String>)> {
    let path = dir.join("metadata.json");
    Metadata::parse(&std::fs::read(&path).unwrap(), &path)
}
const ALL_FIXTURES: [&str; 7] = [A_100, B_100, A_20, CRASHED_20, A_21, B_21, C_21];

/// Copies a fixture directory (read-only files) into `root`, writable, under its own name.
fn copy_fixture(dir: &str, root: &Path) -> PathBuf {
    let src = fixtures().join(dir);
    let dst = root.join(src.file_name().unwrap());
    fs::create_dir_all(&dst).unwrap();
    for e in fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        fs::copy(e.path(), &to).unwrap();
        fs::set_permissions(&to, fs::Permissions::from_mode(0o644)).unwrap();
    }
    dst
}

/// Where `Metadata::parse` is told its bytes came from.
const SRC: &str = "/data/saev/shards/x/metadata.json";

/// The keys of the 2.1 case-A fixture, values as JSON text.
const BASE_21: [(&str, &str); 13] = [
    ("family", r#""clip""#),
    (
        "ckpt",
        r#""hf-hub:hf-internal-testing/tiny-open-clip-model""#,
    ),
    ("layers", "[-2, -1]"),
    ("content_tokens_per_example", "4"),
    ("cls_token", "true"),
    ("d_model", "8"),
    ("n_examples", "7"),
    ("max_tokens_per_shard", "30"),
    ("data", r#""gASV""#),
    ("dataset", r#""fake""#),
    ("pixel_agg", r#""majority""#),
    ("dtype", r#""float32""#),
    ("protocol", r#""2.1""#),
];

/// The 2.1 case-A metadata with `set` replacing (or appending) keys and `remove` dropping keys.
fn md21(set: &[(&str, &str)], remove: &[&str]) -> String {
    let mut members: Vec<(String, String)> = BASE_21
        .iter()
        .filter(|(k, _)| !remove.contains(k))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (k, v) in set {
        match members.iter_mut().find(|m| m.0 == *k) {
            Some(m) => m.1 = v.to_string(),
            None => members.push((k.to_string(), v.to_string())),
        }
    }
    let body: Vec<String> = members
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!("{{{}}}", body.join(", "))
}

/// The file name of shard `s` (saev.md §6).
fn shard_name(s: u64) -> String {
    format!("acts{s:06}.bin")
}

/// The examples of `md` (from its layout).
fn n_examples(md: &Metadata) -> u64 {
    Layout::new(md, Path::new(SRC)).unwrap().n_examples
}

fn parse_md(text: &str) -> shardkit::Result<(Metadata, Vec<String>)> {
    Metadata::parse(text.as_bytes(), Path::new(SRC))
}

/// Asserts that `err` is `Error::Format` about exactly `file`, that its rule contains every
/// needle, and that the displayed message names the file and the rule.
#[track_caller]
fn assert_format(err: &Error, file: &Path, needles: &[&str]) {
    match err {
        Error::Format { path, rule } => {
            assert_eq!(path, file, "wrong file in {err}");
            for n in needles {
                assert!(rule.contains(n), "rule {rule:?} does not mention {n:?}");
            }
        }
        other => panic!(
            "expected Error::Format about {}, got {other:?}",
            file.display()
        ),
    }
    let shown = err.to_string();
    assert!(
        shown.starts_with(&format!("{}: ", file.display())),
        "message does not name the file: {shown}"
    );
}

/// Asserts that `err` is `Error::Invalid` mentioning every needle.
#[track_caller]
fn assert_invalid(err: &Error, needles: &[&str]) {
    let Error::Invalid(msg) = err else {
        panic!("expected Error::Invalid, got {err:?}");
    };
    for n in needles {
        assert!(msg.contains(n), "{msg:?} does not mention {n:?}");
    }
}

/// Asserts that `err` is `Error::Exists` about `file` and its reason mentions every needle.
#[track_caller]
fn assert_exists(err: &Error, file: &Path, needles: &[&str]) {
    let Error::Exists { path, why } = err else {
        panic!("expected Error::Exists, got {err:?}");
    };
    assert_eq!(path, file, "{err}");
    for n in needles {
        assert!(why.contains(n), "{why:?} does not mention {n:?}");
    }
    assert!(err.to_string().contains(&file.display().to_string()));
}

/// Asserts that `r` holds a finding of `sev` about `file` whose message contains every needle.
#[track_caller]
fn assert_problem(r: &Validation, sev: Severity, file: &Path, needles: &[&str]) {
    let found = r.findings.iter().any(|p| {
        p.severity == sev && p.file == file && needles.iter().all(|n| p.message.contains(n))
    });
    assert!(
        found,
        "no {sev:?} about {} mentioning {needles:?} in {:#?}",
        file.display(),
        r.findings
    );
}

/// Every entry of `dir` (hidden ones included): name -> bytes (directories as `None`).
fn snapshot(dir: &Path) -> BTreeMap<String, Option<Vec<u8>>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let bytes = e
                .file_type()
                .unwrap()
                .is_file()
                .then(|| fs::read(e.path()).unwrap());
            (name, bytes)
        })
        .collect()
}

/// Every file of `dir` with its bytes, inode and modification time: anything rewritten (even
/// atomically, with the same bytes) changes the inode or the mtime.
fn identity(dir: &Path) -> BTreeMap<String, (Vec<u8>, u64, i64, i64)> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                (
                    fs::read(e.path()).unwrap(),
                    m.ino(),
                    m.mtime(),
                    m.mtime_nsec(),
                ),
            )
        })
        .collect()
}

/// `replace_all` on byte vectors, for editing fixture bytes.
trait ReplaceAll {
    fn replace_all(&self, from: &[u8], to: &[u8]) -> Vec<u8>;
}
impl ReplaceAll for Vec<u8> {
    fn replace_all(&self, from: &[u8], to: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.len() {
            if self[i..].starts_with(from) {
                out.extend_from_slice(to);
                i += from.len();
            } else {
                out.push(self[i]);
                i += 1;
            }
        }
        out
    }
}

// A small dataset for the writer tests: layers [5, -1] (L = 2), P = 3 with CLS (T = 4), D = 4,
// budget 26 tokens, so eps = 26 // 8 = 3.
const L: u64 = 2;
const T: u64 = 4;
const P: u64 = 3;
const D: u64 = 4;
const EPS: u64 = 3;

/// Writer metadata of the small dataset with `n` examples, as protocol `protocol`. The 2.x
/// variants carry non-ASCII strings so that both escaping rules are exercised.
fn small_md(protocol: &str, n: u64) -> Metadata {
    let text = if protocol == "1.0.0" {
        format!(
            r#"{{"vit_family": "clip", "vit_ckpt": "ckpt/ü", "layers": [5, -1],
            "n_patches_per_img": 3, "cls_token": true, "d_vit": 4, "n_imgs": {n},
            "max_patches_per_shard": 26, "data": {{"n_imgs": {n}, "__class__": "Fake"}},
            "protocol": "1.0.0"}}"#
        )
    } else {
        // saev 2.0 keeps the dataset config as an object, 2.1 as a base64 pickle.
        let data = if protocol == "2.0" {
            format!(r#"{{"n_ex": {n}, "root": "/data/imágenes", "__class__": "Fake"}}"#)
        } else {
            format!("{:?}", shardkit::saev::fake_dataset_data(n))
        };
        // Keys deliberately out of order: the writer restores its version's order.
        format!(
            r#"{{"protocol": "{protocol}", "family": "clip", "ckpt": "ckpt/ü", "layers": [5, -1],
            "content_tokens_per_example": 3, "cls_token": true, "d_model": 4, "n_examples": {n},
            "max_tokens_per_shard": 26, "data": {data}, "dataset": "/data/imágenes"}}"#
        )
    };
    Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap()
}

/// v[e, l, t, d] = 1000e + 100l + t + d/16 for examples `first..first + n`.
fn acts(first: u64, n: u64) -> Vec<f32> {
    let mut v = Vec::new();
    for e in first..first + n {
        for l in 0..L {
            for t in 0..T {
                for d in 0..D {
                    v.push((1000 * e + 100 * l + t) as f32 + d as f32 / 16.0);
                }
            }
        }
    }
    v
}

/// labels[e, c] = (10e + c) % 7 for examples `first..first + n`.
fn labels(first: u64, n: u64) -> Vec<u8> {
    (first..first + n)
        .flat_map(|e| (0..P).map(move |c| ((10 * e + c) % 7) as u8))
        .collect()
}

/// Writes examples `from..to` in batches of `batch`.
fn write_range(w: &mut Writer, from: u64, to: u64, batch: u64, with_labels: bool) {
    let mut e = from;
    while e < to {
        let b = batch.min(to - e);
        let l = with_labels.then(|| labels(e, b));
        w.write(&acts(e, b), l.as_deref()).unwrap();
        e += b;
    }
}

/// An uninterrupted write of the small dataset into `root`; returns the dataset directory.
fn write_uninterrupted(root: &Path, md: &Metadata, with_labels: bool) -> PathBuf {
    let mut w = Writer::create(root, md.clone(), WriterOptions::default()).unwrap();
    assert_eq!(w.start(), WriteStart::Fresh);
    write_range(&mut w, 0, n_examples(md), 5, with_labels);
    w.finish().unwrap()
}

/// Asserts that `out` holds exactly the files of `reference`, byte for byte, and nothing
/// temporary, and that it opens and validates cleanly.
#[track_caller]
fn assert_identical(out: &Path, reference: &Path, what: &str) {
    let mut got = snapshot(out);
    let mut want = snapshot(reference);
    // shardkit's own checksums sidecar: present in what shardkit finished, and matching it.
    // (A reference written by saev has none.)
    assert!(
        got.remove(shardkit::checksum::SIDECAR).is_some(),
        "{what}: no checksums sidecar"
    );
    want.remove(shardkit::checksum::SIDECAR);
    assert!(
        matches!(
            shardkit::checksum::verify(out).unwrap(),
            shardkit::checksum::Verdict::Intact { .. }
        ),
        "{what}: the sidecar does not match"
    );
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: file names differ"
    );
    for (name, bytes) in &want {
        assert!(got[name] == *bytes, "{what}: {name} differs");
    }
    assert!(
        got.keys().all(|n| !n.starts_with('.')),
        "{what}: temporary or marker files remain: {:?}",
        got.keys()
    );
    Dataset::open(out).unwrap();
    let r = validate(out);
    assert!(r.findings.is_empty(), "{what}: {r:#?}");
}

// ---------------------------------------------------------------------------------------------
// 1. Bad inputs
// ---------------------------------------------------------------------------------------------

/// Writer options resuming or not.
fn opts(resume: bool) -> WriterOptions {
    WriterOptions {
        resume,
        ..Default::default()
    }
}

#[test]
fn truncated_shard_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let shard = dir.join("acts000001.bin");
    fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(500)
        .unwrap();
    let err = Dataset::open(&dir).unwrap_err();
    assert_format(&err, &shard, &["500 bytes", "expected 960", "truncated"]);
    let r = validate(&dir);
    assert!(!r.is_valid());
    assert_problem(&r, Severity::Error, &shard, &["500 bytes", "960"]);

    // A last shard cut to its valid rows (what saev's documentation describes) is refused too.
    let dir = copy_fixture(A_100, tmp.path());
    let last = dir.join("acts000002.bin");
    fs::OpenOptions::new()
        .write(true)
        .open(&last)
        .unwrap()
        .set_len(320)
        .unwrap();
    assert_format(
        &Dataset::open(&dir).unwrap_err(),
        &last,
        &["320 bytes", "expected 960"],
    );
}

#[test]
fn corrupt_metadata_json_is_a_format_error() {
    let dup = md21(&[], &[]).replacen('{', r#"{"d_model": 16, "#, 1);
    let cases: [(&[u8], &[&str]); 7] = [
        (b"", &["invalid JSON at byte 0", "end of input"]),
        (br#"{"family": "clip","#, &["invalid JSON at byte 18"]),
        (b"[1, 2]", &["must be a JSON object", "found an array"]),
        (br#""2.1""#, &["must be a JSON object", "found a string"]),
        (b"null", &["must be a JSON object", "found null"]),
        (
            dup.as_bytes(),
            &["invalid JSON", "duplicate key \"d_model\""],
        ),
        (
            b"{\"family\": \"clip\"} trailing",
            &["after the JSON value"],
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (bytes, needles) in cases {
        let err = Metadata::parse(bytes, Path::new(SRC)).unwrap_err();
        assert_format(&err, Path::new(SRC), needles);

        let dir = copy_fixture(A_21, tmp.path());
        let md_path = dir.join("metadata.json");
        fs::write(&md_path, bytes).unwrap();
        assert_format(&Dataset::open(&dir).unwrap_err(), &md_path, needles);
        let r = validate(&dir);
        assert_eq!(r.findings.len(), 1, "{r:#?}");
        assert_problem(&r, Severity::Error, &md_path, needles);
        assert_format(&inspect(&dir).unwrap_err(), &md_path, needles);
    }
    // Wrong types of individual fields name the field.
    for (set, needle) in [
        (("layers", "[1, 2.5]"), "`layers` must hold integers"),
        (("layers", "[]"), "`layers` must not be empty"),
        (("layers", "3"), "`layers` must be an array, found a number"),
        (("cls_token", "1"), "`cls_token` must be a boolean"),
        (
            ("protocol", "2.1"),
            "`protocol` must be a string, found a number",
        ),
        (("dataset", "7"), "`dataset` must be a string"),
    ] {
        let err = parse_md(&md21(&[set], &[])).unwrap_err();
        assert_format(&err, Path::new(SRC), &[needle]);
    }
    let err = parse_md(&md21(&[], &["cls_token"])).unwrap_err();
    assert_format(&err, Path::new(SRC), &["missing the `cls_token` key"]);
    let err = parse_md(&md21(&[], &["n_examples"])).unwrap_err();
    assert_format(&err, Path::new(SRC), &["missing", "n_ex or n_examples"]);
}

#[test]
fn dtype_other_than_float32_is_refused() {
    for dtype in [r#""float64""#, r#""bf16""#, "null", "32"] {
        let err = parse_md(&md21(&[("dtype", dtype)], &[])).unwrap_err();
        assert_format(
            &err,
            Path::new(SRC),
            &["unsupported dtype", dtype, "float32"],
        );
    }
    // bfloat16 and float16 are shardkit's reduced-precision dialect of 2.1 (saev itself
    // refuses them: validate says so), and of no other version.
    for dtype in ["float16", "bfloat16"] {
        let (md, _) = parse_md(&md21(&[("dtype", &format!("{dtype:?}"))], &[])).unwrap();
        assert_eq!(md.dtype().name(), dtype);
        let text = md21(
            &[("dtype", &format!("{dtype:?}")), ("protocol", r#""2.0""#)],
            &[],
        );
        assert_format(
            &parse_md(&text).unwrap_err(),
            Path::new(SRC),
            &["reduced-precision dialect of protocol 2.1", "\"2.0\""],
        );
    }
    // A float32 dataset whose metadata is made to say float16: its shards are twice the size
    // the metadata implies, and it is refused as such.
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let md_path = dir.join("metadata.json");
    fs::write(&md_path, md21(&[("dtype", r#""float16""#)], &[])).unwrap();
    let err = Dataset::open(&dir).unwrap_err().to_string();
    assert!(err.contains("acts000000.bin"), "{err}");
    // An absent dtype is read as float32, with a warning.
    let (_, warnings) = parse_md(&md21(&[], &["dtype"])).unwrap();
    assert!(
        warnings.iter().any(|w| w.contains("no `dtype`")),
        "{warnings:?}"
    );
}

#[test]
fn negative_zero_and_huge_counts_are_refused() {
    for (key, value, needles) in [
        ("n_examples", "-1", &["must be at least 1", "found -1"][..]),
        ("n_examples", "0", &["must be at least 1", "found 0"]),
        (
            "n_examples",
            "9223372036854775808",
            &["fits in 64 bits", "9223372036854775808"],
        ),
        (
            "n_examples",
            "18446744073709551616",
            &["fits in 64 bits", "18446744073709551616"],
        ),
        ("n_examples", "7.0", &["integer", "7.0"]),
        ("n_examples", "7e0", &["integer", "7e0"]),
        ("n_examples", r#""7""#, &["integer", "\"7\""]),
        ("d_model", "-8", &["must be at least 1", "found -8"]),
        ("d_model", "0", &["must be at least 1"]),
        ("content_tokens_per_example", "-4", &["found -4"]),
        ("max_tokens_per_shard", "0", &["found 0"]),
        (
            "max_tokens_per_shard",
            "99999999999999999999",
            &["fits in 64 bits"],
        ),
    ] {
        let err = parse_md(&md21(&[(key, value)], &[])).unwrap_err();
        assert_format(&err, Path::new(SRC), needles);
    }
    // Tokens x layers overflowing 64 bits is caught while parsing.
    let err = parse_md(&md21(
        &[("content_tokens_per_example", "9223372036854775807")],
        &[],
    ))
    .unwrap_err();
    assert_format(&err, Path::new(SRC), &["overflows 64 bits"]);

    // Sizes that overflow (shard bytes, or N x T) parse but have no layout: a Format error
    // naming metadata.json from every entry point, never a panic.
    let tmp = tempfile::tempdir().unwrap();
    for set in [
        &[("d_model", "4611686018427387904")][..],
        &[("d_model", "9223372036854775807")],
        &[
            ("max_tokens_per_shard", "9223372036854775807"),
            ("n_examples", "9223372036854775807"),
        ],
        &[("n_examples", "9223372036854775807")],
    ] {
        let text = md21(set, &[]);
        let (md, _) = parse_md(&text).unwrap();
        let err = Layout::new(&md, Path::new(SRC)).unwrap_err();
        assert_format(&err, Path::new(SRC), &["sizes overflow", "63 bits"]);

        let dir = copy_fixture(A_21, tmp.path());
        let md_path = dir.join("metadata.json");
        fs::write(&md_path, &text).unwrap();
        assert_format(
            &Dataset::open(&dir).unwrap_err(),
            &md_path,
            &["sizes overflow"],
        );
        assert_problem(
            &validate(&dir),
            Severity::Error,
            &md_path,
            &["sizes overflow"],
        );
        assert_format(&inspect(&dir).unwrap_err(), &md_path, &["sizes overflow"]);

        let md = Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap();
        let root = tmp.path().join("out");
        let err = Writer::create(&root, md, WriterOptions::default()).unwrap_err();
        assert!(
            matches!(&err, Error::Format { rule, .. } if rule.contains("sizes overflow")),
            "{err:?}"
        );
        assert!(!root.exists() || fs::read_dir(&root).unwrap().count() == 0);
    }
}

#[test]
fn budget_smaller_than_one_example_is_refused() {
    // T = 5 tokens x 2 layers = 10 tokens per example.
    let err = parse_md(&md21(&[("max_tokens_per_shard", "9")], &[])).unwrap_err();
    assert_format(
        &err,
        Path::new(SRC),
        &["budget of 9 tokens is too small for one example", "= 10"],
    );
    assert!(parse_md(&md21(&[("max_tokens_per_shard", "10")], &[])).is_ok());
    let v = json::parse(md21(&[("max_tokens_per_shard", "9")], &[]).as_bytes()).unwrap();
    assert_invalid(
        &Metadata::for_writing(&v).unwrap_err(),
        &["metadata:", "too small for one example"],
    );
}

#[test]
fn unknown_major_protocol_is_refused_naming_it() {
    for p in ["3.0", "0.9", "10.1", "", "two"] {
        let err = parse_md(&md21(&[("protocol", &format!("\"{p}\""))], &[])).unwrap_err();
        assert_format(
            &err,
            Path::new(SRC),
            &["unsupported saev protocol version", &format!("{p:?}")],
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let md_path = dir.join("metadata.json");
    fs::write(&md_path, md21(&[("protocol", r#""3.0""#)], &[])).unwrap();
    assert_format(&Dataset::open(&dir).unwrap_err(), &md_path, &["\"3.0\""]);
    assert_problem(&validate(&dir), Severity::Error, &md_path, &["\"3.0\""]);
    let v = json::parse(md21(&[("protocol", r#""3.0""#)], &[]).as_bytes()).unwrap();
    assert_invalid(&Metadata::for_writing(&v).unwrap_err(), &["\"3.0\""]);
}

#[test]
fn unknown_minor_protocol_is_read_with_a_warning() {
    let text = md21(&[("protocol", r#""2.2""#)], &[]);
    let (md, warnings) = parse_md(&text).unwrap();
    assert_eq!(md.protocol(), "2.2"); // major 2: src/saev/tests/metadata.rs
    assert_eq!(n_examples(&md), 7);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("unknown minor") && warnings[0].contains("\"2.2\""),
        "{warnings:?}"
    );
    // A whole directory reads, with the warning, and validates (the name then matches no
    // recipe, which is a warning too).
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    fs::write(dir.join("metadata.json"), &text).unwrap();
    let ds = Dataset::open(&dir).unwrap();
    assert!(ds.warnings().iter().any(|w| w.contains("\"2.2\"")));
    assert_eq!(ds.get(4, -1, 3).unwrap()[..2], [4103.0, 4103.0625]);
    let r = validate(&dir);
    assert!(r.is_valid(), "{r:#?}");
    assert_problem(&r, Severity::Note, &dir.join("metadata.json"), &["\"2.2\""]);
    // 1.x likewise.
    let (_, w) = Metadata::parse(
        &fs::read(fixtures().join(A_100).join("metadata.json"))
            .unwrap()
            .replace_all(b"\"1.0.0\"", b"\"1.7\""),
        Path::new(SRC),
    )
    .unwrap();
    assert!(w.iter().any(|w| w.contains("\"1.7\"")), "{w:?}");
}

const V0: &str = r#"{"vit_family": "clip", "vit_ckpt": "ViT-B-16/openai", "layers": [-2],
    "n_patches_per_img": 196, "cls_token": true, "d_vit": 768, "seed": 42, "n_imgs": 1000,
    "n_patches_per_shard": 2400000, "data": "Imagenet(split='train')"}"#;

#[test]
fn v0_metadata_is_refused_as_pre_protocol() {
    let err = parse_md(V0).unwrap_err();
    assert_format(&err, Path::new(SRC), &["pre-protocol (v0)", "protocol"]);
    // Either v0-only key identifies it.
    let no_seed = V0.replace(r#""seed": 42, "#, "");
    assert_format(&parse_md(&no_seed).unwrap_err(), Path::new(SRC), &["v0"]);
    // A v0 directory (no shards.json either) is refused as v0, not reported as incomplete.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("v0dir");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("metadata.json"), V0).unwrap();
    fs::write(dir.join("acts000000.bin"), [0u8; 16]).unwrap();
    let md_path = dir.join("metadata.json");
    assert_format(&Dataset::open(&dir).unwrap_err(), &md_path, &["v0"]);
    let r = validate(&dir);
    assert_eq!(r.findings.len(), 1, "{r:#?}");
    assert_problem(&r, Severity::Error, &md_path, &["pre-protocol"]);
}

#[test]
fn metadata_without_protocol_or_v0_keys_is_not_saev() {
    for text in [
        md21(&[], &["protocol"]),
        "{}".to_string(),
        r#"{"seed": 1, "n_patches_per_shard": 5}"#.to_string(),
        r#"{"name": "resnet", "epochs": 90}"#.to_string(),
    ] {
        let err = parse_md(&text).unwrap_err();
        assert_format(&err, Path::new(SRC), &["not saev metadata", "protocol"]);
    }
}

#[test]
fn key_of_the_other_major_is_read_with_a_warning() {
    let text = md21(&[("vit_family", r#""siglip""#)], &["family"]);
    let (_, warnings) = parse_md(&text).unwrap();
    // The value read: src/saev/tests/metadata.rs (`family` is internal).
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("\"vit_family\"") && w.contains("1.x") && w.contains("2.1")),
        "{warnings:?}"
    );
    // Under 1.x, a 2.x name likewise.
    let text = fs::read_to_string(fixtures().join(A_100).join("metadata.json"))
        .unwrap()
        .replace("\"d_vit\"", "\"d_model\"");
    let (md, warnings) = parse_md(&text).unwrap();
    assert_eq!(Layout::new(&md, Path::new(SRC)).unwrap().d_model, 8);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("\"d_model\"") && w.contains("2.x")),
        "{warnings:?}"
    );
    // Both names at once is a conflict, not a guess.
    let text = md21(&[("vit_family", r#""siglip""#)], &[]);
    assert_format(
        &parse_md(&text).unwrap_err(),
        Path::new(SRC),
        &["conflicting keys", "\"vit_family\"", "\"family\""],
    );
    // Unknown keys are kept and reported.
    let (_, warnings) = parse_md(&md21(&[("colour", r#""blue""#)], &[])).unwrap();
    assert!(warnings
        .iter()
        .any(|w| w.contains("unknown key \"colour\"")));
}

/// shards.json text with `entries` as (name, count).
fn shards_json(entries: &[(&str, u64)]) -> String {
    let body: Vec<String> = entries
        .iter()
        .map(|(n, c)| format!(r#"{{"name": "{n}", "n_examples": {c}}}"#))
        .collect();
    format!("[{}]", body.join(", "))
}

#[test]
fn shards_json_with_a_path_traversing_name_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let sj = dir.join("shards.json");
    for name in [
        "../x.bin",
        "../acts000000.bin",
        "sub/acts000000.bin",
        "/etc/passwd",
        "..",
        ".",
        "",
        r"..\\x.bin",
    ] {
        let text = shards_json(&[(name, 3), ("acts000001.bin", 3), ("acts000002.bin", 1)]);
        fs::write(&sj, text).unwrap();
        let err = Dataset::open(&dir).unwrap_err();
        assert_format(&err, &sj, &["entry 0", "not a plain file name"]);
    }
    fs::write(
        &sj,
        shards_json(&[
            ("acts000000.bin", 3),
            ("../x.bin", 3),
            ("acts000002.bin", 1),
        ]),
    )
    .unwrap();
    assert_format(
        &Dataset::open(&dir).unwrap_err(),
        &sj,
        &["entry 1", "\"../x.bin\"", "not a plain file name"],
    );
    assert_problem(&validate(&dir), Severity::Error, &sj, &["\"../x.bin\""]);
    // Other malformed shards.json files are Format errors naming the file too.
    for (text, needle) in [
        ("{}", "must be a JSON array"),
        ("[1]", "entry 0 has no string `name`"),
        (r#"[{"name": "acts000000.bin"}]"#, "entry 0 has no count"),
        (
            r#"[{"name": "acts000000.bin", "n_ex": 3, "n_examples": 3}]"#,
            "more than one count key",
        ),
        (
            r#"[{"name": "acts000000.bin", "n_examples": -3}]"#,
            "non-negative integer",
        ),
        (
            r#"[{"name": "acts000000.bin", "n_examples": 3.0}]"#,
            "non-negative integer",
        ),
        ("[", "invalid JSON"),
    ] {
        fs::write(&sj, text).unwrap();
        assert_format(&Dataset::open(&dir).unwrap_err(), &sj, &[needle]);
        assert_problem(&validate(&dir), Severity::Error, &sj, &[needle]);
    }
}

#[test]
fn shards_json_counts_that_disagree_with_metadata_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let sj = dir.join("shards.json");
    let names = ["acts000000.bin", "acts000001.bin", "acts000002.bin"];
    // Right total, wrong split.
    fs::write(
        &sj,
        shards_json(&[(names[0], 3), (names[1], 2), (names[2], 2)]),
    )
    .unwrap();
    assert_format(
        &Dataset::open(&dir).unwrap_err(),
        &sj,
        &["entry 1 (acts000001.bin) holds 2 examples; expected 3"],
    );
    assert_problem(&validate(&dir), Severity::Error, &sj, &["entry 1"]);
    // Too many in all.
    fs::write(
        &sj,
        shards_json(&[(names[0], 3), (names[1], 3), (names[2], 2)]),
    )
    .unwrap();
    assert_format(
        &Dataset::open(&dir).unwrap_err(),
        &sj,
        &["entry 2", "holds 2 examples; expected 1"],
    );
    // Too few: incomplete, with the count present.
    fs::write(&sj, shards_json(&[(names[0], 3), (names[1], 3)])).unwrap();
    match Dataset::open(&dir).unwrap_err() {
        Error::Incomplete {
            path,
            present,
            total,
            ..
        } => assert_eq!((path, present, total), (dir.clone(), 6, 7)),
        other => panic!("{other:?}"),
    }
    let r = validate(&dir);
    assert_problem(&r, Severity::Error, &dir, &["6 of 7 examples"]);
    // An entry naming the wrong file.
    fs::write(
        &sj,
        shards_json(&[(names[0], 3), ("acts000005.bin", 3), (names[2], 1)]),
    )
    .unwrap();
    assert_format(
        &Dataset::open(&dir).unwrap_err(),
        &sj,
        &[
            "entry 1 names \"acts000005.bin\"",
            "expected \"acts000001.bin\"",
        ],
    );
}

#[test]
fn extra_shards_json_entries_are_refused_except_one_empty_trailing_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let sj = dir.join("shards.json");
    let e = |i: u64, c: u64| (format!("acts{i:06}.bin"), c);
    for (counts, n) in [
        (&[3, 3, 1, 1][..], 4),
        (&[3, 3, 1, 0, 0], 5),
        (&[3, 3, 1, 3], 4),
    ] {
        let entries: Vec<(String, u64)> = counts
            .iter()
            .enumerate()
            .map(|(i, &c)| e(i as u64, c))
            .collect();
        let refs: Vec<(&str, u64)> = entries.iter().map(|(n, c)| (n.as_str(), *c)).collect();
        fs::write(&sj, shards_json(&refs)).unwrap();
        assert_format(
            &Dataset::open(&dir).unwrap_err(),
            &sj,
            &[&format!("lists {n} shards"), "metadata implies 3"],
        );
        assert_problem(&validate(&dir), Severity::Error, &sj, &["lists"]);
    }
    // saev's spurious empty trailing shard is accepted (with a warning), even without its file.
    fs::write(
        &sj,
        shards_json(&[
            ("acts000000.bin", 3),
            ("acts000001.bin", 3),
            ("acts000002.bin", 1),
            ("acts000003.bin", 0),
        ]),
    )
    .unwrap();
    let ds = Dataset::open(&dir).unwrap();
    assert_eq!(ds.layout().n_shards, 3);
    let r = validate(&dir);
    assert!(r.is_valid(), "{r:#?}");
    assert_problem(&r, Severity::Note, &sj, &["spurious"]);
}

#[test]
fn labels_of_the_wrong_size_are_reported_and_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    // Case A: N = 7, P = 4, CLS.
    let dir = copy_fixture(A_21, tmp.path());
    let lb = dir.join("labels.bin");
    // N x (P+1): saev's CLS-column bug.
    fs::write(&lb, [1u8; 35]).unwrap();
    let r = validate(&dir);
    assert!(!r.is_valid());
    assert_problem(
        &r,
        Severity::Error,
        &lb,
        &["35 bytes", "N x P = 28", "N x (P+1)"],
    );
    let ds = Dataset::open(&dir).unwrap();
    assert!(!ds.has_labels());
    let row = ds.indexed(-2, TokenMode::Content).unwrap().get(5).unwrap();
    assert_eq!(row.token_label, None);
    let mut buf = [0u8; 4];
    assert!(!ds.read_labels_into(0, &mut buf).unwrap());
    // Any other wrong size: no hint.
    fs::write(&lb, [1u8; 13]).unwrap();
    let r = validate(&dir);
    assert_problem(&r, Severity::Error, &lb, &["13 bytes", "N x P = 28"]);
    assert!(
        r.findings.iter().all(|p| !p.message.contains("P+1")),
        "{r:#?}"
    );
    assert!(!Dataset::open(&dir).unwrap().has_labels());
    // The right size is used.
    fs::write(&lb, [6u8; 28]).unwrap();
    assert!(validate(&dir).is_valid());
    let ds = Dataset::open(&dir).unwrap();
    assert!(ds.has_labels());
    let row = ds.indexed(-2, TokenMode::Content).unwrap().get(5).unwrap();
    assert_eq!(row.token_label, Some(6));

    // Case C (no CLS): N x T equals N x P, so a wrong size never gets the CLS hint.
    let dir = copy_fixture(C_21, tmp.path());
    let lb = dir.join("labels.bin");
    fs::write(&lb, [0u8; 25]).unwrap();
    let r = validate(&dir);
    assert_problem(&r, Severity::Error, &lb, &["25 bytes", "N x P = 20"]);
    assert!(
        r.findings.iter().all(|p| !p.message.contains("P+1")),
        "{r:#?}"
    );
    assert!(!Dataset::open(&dir).unwrap().has_labels());
}

#[test]
fn validate_collects_every_problem_in_one_report() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let s0 = dir.join("acts000000.bin");
    let s1 = dir.join("acts000001.bin");
    let s2 = dir.join("acts000002.bin");
    let lb = dir.join("labels.bin");
    fs::remove_file(&s0).unwrap();
    fs::write(&s1, b"").unwrap();
    fs::remove_file(&s2).unwrap();
    fs::create_dir(&s2).unwrap();
    fs::write(&lb, [0u8; 35]).unwrap();
    fs::write(dir.join(".acts000003.bin.tmp"), b"x").unwrap();
    let r = validate(&dir);
    assert!(!r.is_valid());
    assert_problem(&r, Severity::Error, &s0, &["missing"]);
    assert_problem(&r, Severity::Error, &s1, &["empty file"]);
    assert_problem(&r, Severity::Error, &s2, &["not a regular file"]);
    assert_problem(&r, Severity::Error, &lb, &["N x (P+1)"]);
    assert_problem(&r, Severity::Note, &dir, &[".acts000003.bin.tmp"]);
    let errors = r
        .findings
        .iter()
        .filter(|p| p.severity == Severity::Error)
        .count();
    assert_eq!(errors, 4, "{r:#?}");
    let j = r.to_json();
    assert_eq!(j.get("valid"), Some(&Value::Bool(false)));
    // Reading stops at the first problem, naming its file.
    assert_format(&Dataset::open(&dir).unwrap_err(), &s0, &["missing"]);

    // A shards.json problem and a shard problem together.
    let dir = copy_fixture(A_100, tmp.path());
    let sj = dir.join("shards.json");
    fs::write(
        &sj,
        r#"[{"name": "acts000000.bin", "n_imgs": 3}, {"name": "acts000001.bin", "n_imgs": 1},
            {"name": "acts000002.bin", "n_imgs": 3}]"#,
    )
    .unwrap();
    fs::remove_file(dir.join("acts000001.bin")).unwrap();
    let r = validate(&dir);
    assert_problem(&r, Severity::Error, &sj, &["entry 1", "expected 3"]);
    assert_problem(
        &r,
        Severity::Error,
        &dir.join("acts000001.bin"),
        &["missing"],
    );

    // Nothing there at all.
    let nowhere = tmp.path().join("nowhere");
    let r = validate(&nowhere);
    assert_problem(&r, Severity::Error, &nowhere, &["no such directory"]);
    assert!(matches!(
        Dataset::open(&nowhere).unwrap_err(),
        Error::NotFound { path, .. } if path == nowhere
    ));
    // metadata.json missing.
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let err = Dataset::open(&empty).unwrap_err();
    assert!(
        matches!(&err, Error::NotFound { path, .. } if *path == empty.join("metadata.json")),
        "{err:?}"
    );
}

/// Formerly a bug: `inspect` multiplied `shard_bytes * n_shards` unchecked, and `Layout::new`
/// only checked that one shard and `N x T` fit, so a metadata.json with a huge `n_examples`
/// (here 2^60, one example per shard) overflowed: a panic in debug builds, a wrapped
/// `total_bytes` in release. The total is now refused at parse time ("sizes overflow").
#[test]
fn inspect_of_a_huge_dataset_does_not_overflow() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("huge");
    fs::create_dir(&dir).unwrap();
    let text = md21(
        &[
            ("n_examples", "1152921504606846976"),
            ("layers", "[0]"),
            ("content_tokens_per_example", "1"),
            ("cls_token", "false"),
            ("max_tokens_per_shard", "1"),
        ],
        &[],
    );
    fs::write(dir.join("metadata.json"), &text).unwrap();
    let (md, _) = read_md(&dir).unwrap();
    // 2^60 shards of 32 bytes: the dataset's total size overflows, refused at parse time.
    let err = Layout::new(&md, Path::new(SRC)).unwrap_err();
    assert!(err.to_string().contains("sizes overflow"), "{err}");
    assert!(matches!(
        Dataset::open(&dir).unwrap_err(),
        Error::Format { .. }
    ));
    let result = std::panic::catch_unwind(|| inspect(&dir));
    let Ok(result) = result else {
        panic!("inspect panicked");
    };
    assert!(result.unwrap_err().to_string().contains("sizes overflow"));
}

/// Formerly a bug: `validate` statted every shard that metadata.json implies, one at a time,
/// and recorded one "missing" finding per absent shard, however many there were: a 400-byte
/// metadata.json claiming `n_examples = 2^60` (one example per shard) with no shard files made
/// it loop ~2^60 times. Missing shards are now reported as ranges, in a bounded report: 2^20
/// and 2^40 implied shards (none present) give at most 64 findings.
#[test]
fn validate_of_a_huge_claimed_dataset_is_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("huge");
    fs::create_dir(&dir).unwrap();
    let text = md21(
        &[
            ("n_examples", "1048576"),
            ("layers", "[0]"),
            ("content_tokens_per_example", "1"),
            ("cls_token", "false"),
            ("max_tokens_per_shard", "1"),
        ],
        &[],
    );
    fs::write(dir.join("metadata.json"), &text).unwrap();
    let r = validate(&dir);
    assert!(!r.is_valid());
    assert!(
        r.findings.len() <= 64,
        "{} findings for a directory holding one file",
        r.findings.len()
    );
    assert!(r.findings.iter().any(|p| p
        .message
        .contains("through acts1048575.bin (1048576 files)")));
    // 2^40 implied shards (the largest claim whose total size still fits in 63 bits here)
    // costs no more than the files present.
    fs::write(
        dir.join("metadata.json"),
        md21(
            &[
                ("n_examples", "1099511627776"),
                ("layers", "[0]"),
                ("content_tokens_per_example", "1"),
                ("cls_token", "false"),
                ("max_tokens_per_shard", "1"),
            ],
            &[],
        ),
    )
    .unwrap();
    let r = validate(&dir);
    assert!(!r.is_valid() && r.findings.len() <= 64, "{:?}", r.findings);
}

// ---------------------------------------------------------------------------------------------
// 2. Writer refusals and argument checks
// ---------------------------------------------------------------------------------------------

#[test]
fn writer_refuses_a_directory_holding_different_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let md = small_md("2.1", 11);
    let dir = tmp.path().join(md.dir_name());
    fs::create_dir(&dir).unwrap();
    let md_path = dir.join("metadata.json");
    let other = fs::read(fixtures().join(A_21).join("metadata.json")).unwrap();
    fs::write(&md_path, &other).unwrap();
    let before = snapshot(&dir);
    for resume in [false, true] {
        let err = Writer::create(tmp.path(), md.clone(), opts(resume)).unwrap_err();
        assert_exists(
            &err,
            &md_path,
            &["different dataset", "refusing to overwrite"],
        );
        assert_eq!(snapshot(&dir), before);
    }
    // Even a semantically equal metadata.json with other bytes (whitespace) is not ours.
    let ours = md.file_bytes();
    let mut reformatted = ours.clone();
    reformatted.push(b'\n');
    fs::write(&md_path, &reformatted).unwrap();
    let err = Writer::create(tmp.path(), md.clone(), WriterOptions::resuming()).unwrap_err();
    assert_exists(&err, &md_path, &["different dataset"]);
    assert_eq!(fs::read(&md_path).unwrap(), reformatted);
}

#[test]
fn writer_refuses_a_directory_with_foreign_files() {
    let tmp = tempfile::tempdir().unwrap();
    let md = small_md("2.1", 11);
    let dir = tmp.path().join(md.dir_name());
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("notes.txt"), b"mine").unwrap();
    fs::write(dir.join("acts000000.bin"), [7u8; 384]).unwrap();
    let before = snapshot(&dir);
    for resume in [false, true] {
        let err = Writer::create(tmp.path(), md.clone(), opts(resume)).unwrap_err();
        assert_exists(
            &err,
            &dir,
            &[
                "without metadata.json",
                "2 other file(s)",
                "notes.txt",
                "acts000000.bin",
            ],
        );
        assert_eq!(snapshot(&dir), before);
    }
    // A directory holding only leftovers of a shardkit write that died before metadata.json
    // (marker and temporaries) is taken over as fresh.
    fs::remove_file(dir.join("notes.txt")).unwrap();
    fs::remove_file(dir.join("acts000000.bin")).unwrap();
    fs::write(dir.join(".shardkit-writing"), b"").unwrap();
    fs::write(dir.join(".metadata.json.tmp"), b"{").unwrap();
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap();
    assert_eq!(w.start(), WriteStart::Fresh);
    write_range(&mut w, 0, 11, 4, true);
    let out = w.finish().unwrap();
    let ref_tmp = tempfile::tempdir().unwrap();
    let reference = write_uninterrupted(ref_tmp.path(), &md, true);
    assert_identical(&out, &reference, "taken-over directory");
}

#[test]
fn writer_leaves_a_complete_dataset_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let md = small_md("2.1", 11);
    let dir = write_uninterrupted(tmp.path(), &md, true);
    let before = identity(&dir);
    for resume in [false, true] {
        let mut w = Writer::create(tmp.path(), md.clone(), opts(resume)).unwrap();
        assert_eq!(w.start(), WriteStart::AlreadyComplete);
        assert_eq!(w.next_example(), 11);
        assert_eq!(w.path(), dir);
        // Writes are accepted and discarded, even more than N.
        w.write(&acts(0, 11), Some(&labels(0, 11))).unwrap();
        w.write(&acts(0, 11), Some(&labels(0, 11))).unwrap();
        // Shape errors are still errors.
        assert_invalid(&w.write(&[0.0; 3], None).unwrap_err(), &["not a multiple"]);
        assert_eq!(w.finish().unwrap(), dir);
        assert_eq!(identity(&dir), before);
    }
    // The saev-written fixtures, too.
    for fixture in [A_100, B_100, A_20, A_21, B_21, C_21] {
        let dir = copy_fixture(fixture, tmp.path());
        let before = identity(&dir);
        let (md, _) = read_md(&dir).unwrap();
        let md = Metadata::for_writing(md.raw()).unwrap();
        let w = Writer::create(tmp.path(), md, WriterOptions::default()).unwrap();
        assert_eq!(w.start(), WriteStart::AlreadyComplete, "{fixture}");
        w.finish().unwrap();
        assert_eq!(identity(&dir), before, "{fixture}");
    }
}

#[test]
fn writer_rejects_bad_batches_and_stays_usable() {
    let ref_tmp = tempfile::tempdir().unwrap();
    let md = small_md("2.1", 11);
    let reference = write_uninterrupted(ref_tmp.path(), &md, true);
    let ev = (L * T * D) as usize;

    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap();
    // acts not a whole number of examples.
    for len in [1, ev - 1, ev + 1, 2 * ev + 3] {
        let err = w.write(&vec![0.0; len], None).unwrap_err();
        assert_invalid(
            &err,
            &[
                &format!("acts holds {len} values"),
                &format!("L*T*D = {ev}"),
            ],
        );
    }
    // labels of the wrong length.
    let err = w.write(&acts(0, 2), Some(&labels(0, 1))).unwrap_err();
    assert_invalid(&err, &["labels hold 3 values", "2 examples need 6"]);
    let err = w.write(&acts(0, 2), Some(&[0u8; 7])).unwrap_err();
    assert_invalid(&err, &["labels hold 7 values"]);
    // More than N examples at once.
    let err = w.write(&acts(0, 12), Some(&labels(0, 12))).unwrap_err();
    assert_invalid(&err, &["12 more examples would exceed n_examples = 11"]);
    assert_eq!(w.next_example(), 0);
    // None of that wrote anything; now a valid start with labels.
    write_range(&mut w, 0, 4, 4, true);
    // Labels must then come with every batch.
    let err = w.write(&acts(4, 1), None).unwrap_err();
    assert_invalid(&err, &["has labels", "every batch"]);
    let err = w.write(&acts(4, 8), Some(&labels(4, 8))).unwrap_err();
    assert_invalid(
        &err,
        &["8 more examples would exceed n_examples = 11", "4 already"],
    );
    assert_eq!(w.next_example(), 4);
    write_range(&mut w, 4, 11, 3, true);
    let err = w.write(&acts(11, 1), Some(&labels(11, 1))).unwrap_err();
    assert_invalid(&err, &["exceed n_examples = 11"]);
    let out = w.finish().unwrap();
    assert_identical(&out, &reference, "after rejected batches");

    // A label-less first batch: labels cannot be added later.
    let ref_tmp2 = tempfile::tempdir().unwrap();
    let reference = write_uninterrupted(ref_tmp2.path(), &md, false);
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap();
    write_range(&mut w, 0, 2, 2, false);
    let err = w.write(&acts(2, 1), Some(&labels(2, 1))).unwrap_err();
    assert_invalid(&err, &["started without labels", "cannot be added later"]);
    write_range(&mut w, 2, 11, 9, false);
    let out = w.finish().unwrap();
    assert!(!out.join("labels.bin").exists());
    assert_identical(&out, &reference, "label-less");
    assert!(!Dataset::open(&out).unwrap().has_labels());
}

/// saev.md §12: labels.bin is written for 2.0 and 2.1 only ("it postdates 1.0.0"). The writer
/// once accepted labels for a 1.0.0 dataset and wrote labels.bin into it; it now refuses them.
#[test]
fn writer_refuses_labels_for_protocol_1_0_0() {
    let tmp = tempfile::tempdir().unwrap();
    let md = small_md("1.0.0", 11);
    let mut w = Writer::create(tmp.path(), md, WriterOptions::default()).unwrap();
    let result = w.write(&acts(0, 11), Some(&labels(0, 11)));
    let dir = w.path().to_path_buf();
    if result.is_ok() {
        let _ = w.finish();
    }
    assert!(
        !dir.join("labels.bin").exists(),
        "a 1.0.0 directory got a labels.bin"
    );
    assert!(
        matches!(&result, Err(Error::Invalid(m)) if m.contains("1.0.0")),
        "{result:?}"
    );
}

#[test]
fn finish_early_is_incomplete_and_leaves_the_directory_resumable() {
    let ref_tmp = tempfile::tempdir().unwrap();
    let md = small_md("2.1", 11);
    let reference = write_uninterrupted(ref_tmp.path(), &md, true);
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap();
    let dir = w.path().to_path_buf();
    write_range(&mut w, 0, 5, 5, true);
    let err = w.finish().unwrap_err();
    match &err {
        Error::Incomplete {
            path,
            present,
            total,
            detail,
        } => {
            assert_eq!((path, *present, *total), (&dir, 5, 11));
            assert!(detail.contains("finish() called early") && detail.contains("resumable"));
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("5 of 11 examples"), "{err}");
    assert!(!dir.join("shards.json").exists());
    // Durable: one full shard.
    assert!(matches!(
        Dataset::open(&dir).unwrap_err(),
        Error::Incomplete {
            present: 3,
            total: 11,
            ..
        }
    ));
    let err = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap_err();
    assert_exists(&err, &dir, &["interrupted write", "3 of 11"]);
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::resuming()).unwrap();
    assert_eq!(w.start(), WriteStart::Resumed { from: 3 });
    write_range(&mut w, 3, 11, 2, true);
    let out = w.finish().unwrap();
    assert_identical(&out, &reference, "resumed after early finish");
}

// ---------------------------------------------------------------------------------------------
// 3. Crash and resume at every interruption point
// ---------------------------------------------------------------------------------------------

/// Simulates a crash after `k` examples of `md`, plus stale leftovers, checks how readers and
/// writers see the directory, resumes, and compares with `reference`.
fn crash_and_resume(md: &Metadata, with_labels: bool, k: u64, reference: &Path) {
    let n = n_examples(md);
    let what = format!("protocol {} k={k}", md.protocol());
    let tmp = tempfile::tempdir().unwrap();
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap();
    let dir = w.path().to_path_buf();
    write_range(&mut w, 0, k, 2, with_labels);
    if k.is_multiple_of(2) {
        drop(w);
    } else {
        // Like a kill: nothing at all runs on the way out (but the kernel drops the lock).
        w.abandon();
    }
    // Leftovers: a stale temporary, and a partial final-named shard beyond the resume point.
    fs::write(dir.join(".acts000009.bin.tmp"), [0xABu8; 100]).unwrap();
    let partial = (k / EPS..)
        .map(|s| dir.join(shard_name(s)))
        .find(|p| !p.exists())
        .unwrap();
    fs::write(&partial, [0xCDu8; 100]).unwrap();

    let expected = if k == n { n } else { k / EPS * EPS };

    // Readers refuse it, saying how much is durably there.
    let err = Dataset::open(&dir).unwrap_err();
    match &err {
        Error::Incomplete {
            path,
            present,
            total,
            detail,
        } => {
            assert_eq!(path, &dir, "{what}");
            assert_eq!((*present, *total), (expected, n), "{what}");
            assert!(*present <= k, "{what}");
            assert!(
                detail.contains("shards.json is missing"),
                "{what}: {detail}"
            );
        }
        other => panic!("{what}: {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "{}: incomplete dataset: {expected} of {n} examples are present (shards.json is \
             missing (it is written last); {} leading shard files are full size)",
            dir.display(),
            expected.div_ceil(EPS)
        ),
        "{what}"
    );
    let r = validate(&dir);
    assert!(!r.is_valid(), "{what}");
    assert_problem(
        &r,
        Severity::Error,
        &dir.join("shards.json"),
        &["incomplete", &format!("{expected} of {n} examples")],
    );
    assert_problem(
        &r,
        Severity::Note,
        &dir,
        &[".acts000009.bin.tmp", ".shardkit-writing"],
    );

    // A writer without resume refuses and touches nothing.
    let before = snapshot(&dir);
    let err = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap_err();
    assert_exists(
        &err,
        &dir,
        &["interrupted write", &format!("{expected} of {n}")],
    );
    assert!(snapshot(&dir) == before, "{what}: refusal changed files");

    // Resume: from a shard boundary (or N), at most k, with the leftovers gone.
    let mut w = Writer::create(tmp.path(), md.clone(), WriterOptions::resuming()).unwrap();
    let WriteStart::Resumed { from } = w.start() else {
        panic!("{what}: {:?}", w.start());
    };
    assert_eq!(from, expected, "{what}");
    assert!(from <= k && (from % EPS == 0 || from == n), "{what}");
    assert_eq!(w.next_example(), from, "{what}");
    assert!(!dir.join(".acts000009.bin.tmp").exists(), "{what}");
    for (name, _) in snapshot(&dir) {
        if let Some(s) = name
            .strip_prefix("acts")
            .and_then(|x| x.strip_suffix(".bin"))
        {
            let s: u64 = s.parse().unwrap();
            assert!(
                s * EPS < from,
                "{what}: {name} kept beyond the resume point"
            );
            assert_eq!(
                fs::metadata(dir.join(&name)).unwrap().len(),
                EPS * L * T * D * 4,
                "{what}: {name}"
            );
        }
    }

    // Crash once more in the middle of the rest, then resume again.
    // (Not when that would write the last example: k = N has tests of its own,
    // `resume_after_a_crash_after_the_last_example` and `resume_after_a_crash_inside_finish`.)
    if from + 2 < n {
        write_range(&mut w, from, from + 2, 1, with_labels);
        drop(w);
        w = Writer::create(tmp.path(), md.clone(), WriterOptions::resuming()).unwrap();
        let again = (from + 2) / EPS * EPS;
        assert_eq!(w.start(), WriteStart::Resumed { from: again }, "{what}");
    }
    let from = w.next_example();
    write_range(&mut w, from, n, 4, with_labels);
    let out = w.finish().unwrap();
    assert_eq!(out, dir);
    assert_identical(&out, reference, &what);
}

fn crash_everywhere(protocol: &str, n: u64, with_labels: bool, ks: impl Iterator<Item = u64>) {
    let md = small_md(protocol, n);
    let ref_tmp = tempfile::tempdir().unwrap();
    let reference = write_uninterrupted(ref_tmp.path(), &md, with_labels);
    assert_eq!(
        fs::read_dir(&reference).unwrap().count(),
        // metadata.json, shards.json, shardkit.checksums.json, shards, labels.bin
        3 + n.div_ceil(EPS) as usize + usize::from(with_labels)
    );
    for k in ks {
        crash_and_resume(&md, with_labels, k, &reference);
    }
}

#[test]
fn resume_after_a_crash_at_every_example_2_1_with_labels() {
    crash_everywhere("2.1", 11, true, 0..11);
}

#[test]
fn resume_after_a_crash_at_every_example_1_0_0() {
    crash_everywhere("1.0.0", 11, false, 0..11);
}

#[test]
fn resume_after_a_crash_at_every_example_2_0_with_labels() {
    crash_everywhere("2.0", 11, true, 0..11);
}

#[test]
fn resume_after_a_crash_at_every_example_when_eps_divides_n() {
    // N = 12 = 4 x eps: the last shard is full, so k = N resumes cleanly.
    crash_everywhere("2.1", 12, true, 0..=12);
    crash_everywhere("1.0.0", 12, false, [0, 5, 11, 12].into_iter());
}

/// Formerly a bug: when every shard was published but `finish()` did not run (a kill between
/// the last `write` and `finish`, or during `finish` before shards.json), `Writer::prepare_resume`
/// computed `from = N` but kept only shards `< from / eps` (integer division). With
/// `N % eps != 0` that deleted the last, complete shard (`acts000003.bin` for N = 11, eps = 3),
/// and `finish()` then committed a shards.json listing a file that no longer existed. The
/// resumed directory is now byte-identical to an uninterrupted write, which this test asserts.
#[test]
fn resume_after_a_crash_after_the_last_example() {
    crash_everywhere("2.1", 11, true, [11].into_iter());
    crash_everywhere("1.0.0", 11, false, [11].into_iter());
}

/// Simulates a crash inside `finish()`: labels.bin published, shards.json not yet written.
fn crash_inside_finish(n: u64) {
    let md = small_md("2.1", n);
    let ref_tmp = tempfile::tempdir().unwrap();
    let reference = write_uninterrupted(ref_tmp.path(), &md, true);
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_uninterrupted(tmp.path(), &md, true);
    fs::remove_file(dir.join("shards.json")).unwrap();
    fs::write(dir.join(".shardkit-writing"), b"").unwrap();
    assert!(matches!(
        Dataset::open(&dir).unwrap_err(),
        Error::Incomplete { present, total, .. } if present == n && total == n
    ));
    let w = Writer::create(tmp.path(), md.clone(), WriterOptions::resuming()).unwrap();
    assert_eq!(w.start(), WriteStart::Resumed { from: n });
    let out = w.finish().unwrap();
    assert_identical(&out, &reference, &format!("finish crash, N={n}"));
}

#[test]
fn resume_after_a_crash_inside_finish_when_eps_divides_n() {
    crash_inside_finish(12);
}

#[test]
fn resume_after_a_crash_inside_finish() {
    crash_inside_finish(11);
}

#[test]
fn crash_after_shards_json_is_already_complete() {
    // Killed between shards.json and the marker's removal: complete; only the marker goes.
    let md = small_md("2.1", 11);
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_uninterrupted(tmp.path(), &md, true);
    let before = identity(&dir);
    fs::write(dir.join(".shardkit-writing"), b"").unwrap();
    Dataset::open(&dir).unwrap();
    assert_problem(
        &validate(&dir),
        Severity::Note,
        &dir,
        &[".shardkit-writing"],
    );
    let w = Writer::create(tmp.path(), md, WriterOptions::default()).unwrap();
    assert_eq!(w.start(), WriteStart::AlreadyComplete);
    assert_eq!(identity(&dir), before);
}

/// A saev-written directory killed after `entries` full shards: saev rewrites shards.json after
/// each shard and creates every shard (and labels.bin) full-size up front, so the shard after
/// the last listed one exists at full size holding a partial, unlisted write.
fn saev_crash(fixture: &str, root: &Path, entries: u64) -> PathBuf {
    let dir = copy_fixture(fixture, root);
    let (md, _) = read_md(&dir).unwrap();
    let layout = Layout::new(&md, Path::new(SRC)).unwrap();
    let counts: Vec<u64> = (0..entries).map(|_| layout.examples_per_shard).collect();
    // shards.json as saev writes it: 2-space indent, the protocol's count key.
    let key = if md.protocol().starts_with('1') {
        "n_imgs"
    } else {
        "n_examples"
    };
    let items = counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            Value::Object(vec![
                ("name".into(), Value::String(shard_name(i as u64))),
                (key.into(), Value::int(c)),
            ])
        })
        .collect();
    fs::write(
        dir.join("shards.json"),
        json::to_pretty(&Value::Array(items), 2, Escape::Utf8),
    )
    .unwrap();
    // The shard being written: full size, half garbage.
    let open = dir.join(shard_name(entries));
    let mut bytes = fs::read(&open).unwrap();
    bytes[..8].copy_from_slice(&[0xEE; 8]);
    fs::write(&open, &bytes).unwrap();
    for s in entries + 1..layout.n_shards {
        fs::remove_file(dir.join(shard_name(s))).unwrap();
    }
    dir
}

#[test]
fn resume_of_a_saev_written_crash_trusts_only_shards_json() {
    for (fixture, entries, labelled) in [(A_21, 1, false), (A_100, 2, false), (C_21, 2, true)] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = saev_crash(fixture, tmp.path(), entries);
        let (md, _) = read_md(&dir).unwrap();
        let layout = Layout::new(&md, Path::new(SRC)).unwrap();
        let eps = layout.examples_per_shard;
        let n = layout.n_examples;
        match Dataset::open(&dir).unwrap_err() {
            Error::Incomplete { present, total, .. } => {
                assert_eq!((present, total), (entries * eps, n), "{fixture}")
            }
            other => panic!("{fixture}: {other:?}"),
        }
        let md = Metadata::for_writing(md.raw()).unwrap();
        let err = Writer::create(tmp.path(), md.clone(), WriterOptions::default()).unwrap_err();
        assert_exists(
            &err,
            &dir,
            &[&format!("{} of {n}", entries * eps), "interrupted write"],
        );
        let mut w = Writer::create(tmp.path(), md, WriterOptions::resuming()).unwrap();
        let from = entries * eps;
        assert_eq!(w.start(), WriteStart::Resumed { from }, "{fixture}");
        let (l, t, d) = (layout.n_layers, layout.tokens, layout.d_model);
        let mut coded = Vec::new();
        for e in from..n {
            for li in 0..l {
                for ti in 0..t {
                    for di in 0..d {
                        coded.push((1000 * e + 100 * li + ti) as f32 + di as f32 / 16.0);
                    }
                }
            }
        }
        let labels: Vec<u8> = (from..n)
            .flat_map(|e| (0..4).map(move |c| ((10 * e + c) % 7) as u8))
            .collect();
        w.write(&coded, labelled.then_some(&labels[..])).unwrap();
        let out = w.finish().unwrap();
        assert_identical(&out, &fixtures().join(fixture), fixture);
    }
}

/// validate reports a labels.bin that is not a regular file (here a directory), as it does
/// one of the wrong size (it once ignored it, although validate promises every problem).
#[test]
fn validate_reports_a_labels_bin_that_is_not_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    fs::create_dir(dir.join("labels.bin")).unwrap();
    assert!(!Dataset::open(&dir).unwrap().has_labels());
    let r = validate(&dir);
    assert!(
        r.findings.iter().any(|p| p.file == dir.join("labels.bin")),
        "{r:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Properties
// ---------------------------------------------------------------------------------------------

/// The metadata.json and shards.json files of every fixture.
fn fixture_jsons() -> &'static [Vec<u8>] {
    static FILES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    FILES.get_or_init(|| {
        let mut v = Vec::new();
        for d in ALL_FIXTURES {
            for f in ["metadata.json", "shards.json"] {
                v.push(fs::read(fixtures().join(d).join(f)).unwrap());
            }
        }
        v
    })
}

#[path = "common/mutation.rs"]
mod mutation;
use mutation::{json_byte, mutate, mutation};

/// A mutated fixture JSON file.
fn mutated_fixture() -> impl Strategy<Value = Vec<u8>> {
    (
        0..fixture_jsons().len(),
        proptest::collection::vec(mutation(), 1..4),
    )
        .prop_map(|(f, muts)| mutate(fixture_jsons()[f].clone(), &muts))
}

/// parse never panics; what parses re-emits (compact or pretty, either escaping) to text that
/// parses to the same value.
fn check_json_round_trip(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(v) = json::parse(bytes) {
        for esc in [Escape::Utf8, Escape::Ascii] {
            let compact = json::to_compact(&v, false, esc);
            prop_assert_eq!(json::parse(compact.as_bytes()), Ok(v.clone()));
            let pretty = json::to_pretty(&v, 4, esc);
            prop_assert_eq!(json::parse(pretty.as_bytes()), Ok(v.clone()));
            if esc == Escape::Ascii {
                prop_assert!(compact.is_ascii());
            }
        }
        let py = json::to_python_default(&v);
        prop_assert!(json::parse(py.as_bytes()).is_ok());
    }
    Ok(())
}

/// Arbitrary JSON values: any Unicode in strings and keys, numbers of every syntactic shape.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::int),
        "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,6})?([eE][+-]?[0-9]{1,3})?".prop_map(Value::Number),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((any::<String>(), inner), 0..6).prop_map(|members| {
                let mut seen = std::collections::HashSet::new();
                Value::Object(
                    members
                        .into_iter()
                        .filter(|(k, _)| seen.insert(k.clone()))
                        .collect(),
                )
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn json_parse_never_panics_on_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        check_json_round_trip(&bytes)?;
    }

    #[test]
    fn json_parse_never_panics_on_json_like_bytes(
        bytes in proptest::collection::vec(json_byte(), 0..128)
    ) {
        check_json_round_trip(&bytes)?;
    }

    #[test]
    fn json_parse_never_panics_on_mutated_fixtures(bytes in mutated_fixture()) {
        check_json_round_trip(&bytes)?;
    }

    #[test]
    fn json_emitters_round_trip_generated_values(
        v in arb_json(),
        muts in proptest::collection::vec(mutation(), 0..3),
    ) {
        for (indent, esc) in [(2, Escape::Utf8), (4, Escape::Ascii)] {
            let text = json::to_pretty(&v, indent, esc);
            prop_assert_eq!(json::parse(text.as_bytes()), Ok(v.clone()));
            let text = json::to_compact(&v, false, esc);
            prop_assert_eq!(json::parse(text.as_bytes()), Ok(v.clone()));
            check_json_round_trip(&mutate(text.into_bytes(), &muts))?;
        }
    }
}

/// Formerly a bug: `\u` escapes went through `u32::from_str_radix`, which accepts a leading
/// `+`, so `"\u+041"` parsed as `"A"`; the strict RFC 8259 parser now refuses it.
#[test]
fn json_rejects_a_sign_in_unicode_escapes() {
    for bad in [&br#""\u+041""#[..], br#""\u+0e9""#, br#"{"\u+06b": 1}"#] {
        assert!(
            json::parse(bad).is_err(),
            "{:?} parsed as {:?}",
            String::from_utf8_lossy(bad),
            json::parse(bad)
        );
    }
}

#[test]
fn json_rejects_malformed_unicode_escapes() {
    for bad in [
        &br#""\u12""#[..],
        br#""\u12g4""#,
        br#""\ud800""#,
        br#""\udc00""#,
        br#""\ud800\u0041""#,
        br#""\u""#,
        b"\"\xff\"",
        b"\"\xed\xa0\x80\"",
    ] {
        assert!(
            json::parse(bad).is_err(),
            "{:?} parsed",
            String::from_utf8_lossy(bad)
        );
    }
    assert_eq!(
        json::parse(br#""\ud83d\ude00\u00e9""#).unwrap(),
        Value::String("😀é".into())
    );
}

// ---------------------------------------------------------------------------------------------
// What saev itself would load (saev.md §3.2)
// ---------------------------------------------------------------------------------------------

/// A directory whose metadata saev's own `Metadata` class refuses is read by shardkit, but
/// validation reports it as an error on metadata.json that says saev will not load it.
#[test]
fn validation_reports_what_saev_would_refuse_and_reading_still_works() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(A_21, tmp.path());
    let md_path = dir.join("metadata.json");
    // (keys set, keys removed, what the error says)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);
    let cases: &[Case] = &[
        (
            &[("data", r#"{"n_examples": 7, "__class__": "FakeImg"}"#)],
            &[],
            "`data` must be a string, base64 of a pickled saev dataset config",
        ),
        (&[("family", r#""vit-l""#)], &[], "`family` must be one of"),
        (
            &[("pixel_agg", "null")],
            &[],
            "`pixel_agg` must be \"majority\" or \"prefer-fg\"",
        ),
        (&[("pixel_agg", r#""mode""#)], &[], "found \"mode\""),
        (&[("source", r#""x""#)], &[], "has no `source` field"),
        (&[], &["dataset"], "`dataset` is missing"),
        (&[], &["pixel_agg"], "`pixel_agg` is missing"),
    ];
    for (set, remove, needle) in cases {
        fs::write(&md_path, md21(set, remove)).unwrap();
        let report = validate(&dir);
        assert!(!report.is_valid(), "{needle}: {report:?}");
        let p = report
            .findings
            .iter()
            .find(|p| p.severity == Severity::Error && p.message.contains(needle))
            .unwrap_or_else(|| panic!("no error with {needle:?}: {report:#?}"));
        assert_eq!(p.file, md_path);
        assert!(
            p.message
                .starts_with("saev 2.1 will not load this directory: "),
            "{}",
            p.message
        );
        // shardkit still serves the activations exactly.
        let ds = Dataset::open(&dir).unwrap();
        assert_eq!(ds.get(4, -1, 3).unwrap()[0], 4103.0);
        let summary = inspect(&dir).unwrap();
        assert_eq!(summary.get("saev_loads"), Some(&Value::Bool(false)));
    }
    // A string that is not a base64 pickle loads in saev: a warning, not an error.
    fs::write(&md_path, md21(&[("data", r#""not a pickle""#)], &[])).unwrap();
    let report = validate(&dir);
    assert!(report.is_valid(), "{report:?}");
    assert!(report
        .findings
        .iter()
        .any(|p| p.severity == Severity::Note && p.message.contains("make_data_cfg")));
    fs::copy(fixtures().join(A_21).join("metadata.json"), &md_path).unwrap();
    assert!(validate(&dir).findings.is_empty());
    assert_eq!(
        inspect(&dir).unwrap().get("saev_loads"),
        Some(&Value::Bool(true))
    );
}

/// The 1.0.0 and 2.0 rules: their writers' `family` lists and a JSON-object `data`.
#[test]
fn validation_applies_the_rules_of_each_protocol() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, edit, severity, needle) in [
        (
            A_100,
            ("\"vit_family\": \"clip\"", "\"vit_family\": \"fake-clip\""),
            Severity::Error,
            "saev 1.0.0 will not load this directory: `vit_family` must be one of",
        ),
        (
            A_100,
            (
                "\"data\": {\n        \"n_imgs\": 7,\n        \"__class__\": \"Fake\"\n    }",
                "\"data\": \"Fake(n_imgs=7)\"",
            ),
            Severity::Note,
            "the Python repr saev 1.0.0 wrote before",
        ),
        (
            A_20,
            (
                "\"data\": {\n        \"n_ex\": 7,\n        \"__class__\": \"Fake\"\n    }",
                "\"data\": \"gASV\"",
            ),
            Severity::Error,
            "`data` must be a JSON object",
        ),
        (
            A_20,
            ("\"family\": \"clip\"", "\"family\": \"pe-core\""),
            Severity::Error,
            "saev 2.0 will not load this directory: `family` must be one of",
        ),
    ] {
        let dir = copy_fixture(fixture, tmp.path());
        let md_path = dir.join("metadata.json");
        let text = fs::read_to_string(&md_path).unwrap();
        assert!(text.contains(edit.0), "{fixture}: {}", edit.0);
        fs::write(&md_path, text.replacen(edit.0, edit.1, 1)).unwrap();
        let report = validate(&dir);
        assert!(
            report
                .findings
                .iter()
                .any(|p| p.severity == severity && p.file == md_path && p.message.contains(needle)),
            "{needle}: {report:#?}"
        );
        Dataset::open(&dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }
}

/// The writer refuses, for the version it writes, what saev would not load; the message names
/// the key, the version and what saev expects.
#[test]
fn writer_metadata_follows_each_protocols_rules() {
    let refuse = |text: &str, needles: &[&str]| {
        let e = Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap_err();
        let msg = e.to_string();
        for n in needles {
            assert!(msg.contains(n), "{n:?} not in {msg}");
        }
    };
    let base21 = md21(&[], &[]);
    refuse(
        &base21.replace(r#""data": "gASV""#, r#""data": {"a": 1}"#),
        &["protocol 2.1", "`data` must be a string", "found an object"],
    );
    refuse(
        &base21.replace(r#""family": "clip""#, r#""family": "ViT""#),
        &[
            "protocol 2.1",
            "`family` must be one of",
            "\"siglip\"",
            "found \"ViT\"",
        ],
    );
    refuse(
        &base21.replace(r#""pixel_agg": "majority""#, r#""pixel_agg": null"#),
        &["protocol 2.1", "`pixel_agg`", "found null"],
    );
    // Absent pixel_agg takes saev's default.
    let md =
        Metadata::for_writing(&json::parse(md21(&[], &["pixel_agg"]).as_bytes()).unwrap()).unwrap();
    assert_eq!(
        md.raw().get("pixel_agg"),
        Some(&Value::String("majority".into()))
    );
    let v1 = r#"{"vit_family": "clip", "vit_ckpt": "c", "layers": [1], "n_patches_per_img": 2,
        "cls_token": false, "d_vit": 4, "n_imgs": 3, "max_patches_per_shard": 10,
        "data": "Imagenet()", "protocol": "1.0.0"}"#;
    refuse(v1, &["protocol 1.0.0", "`data` must be a JSON object"]);
    refuse(
        &v1.replace(r#""Imagenet()""#, "{}")
            .replace("\"clip\"", "\"fake-clip\""),
        &[
            "protocol 1.0.0",
            "`vit_family` must be one of \"clip\", \"siglip\"",
        ],
    );
    let v20 = r#"{"family": "dinov3", "ckpt": "c", "layers": [1], "patches_per_ex": 2,
        "cls_token": false, "d_model": 4, "n_ex": 3, "patches_per_shard": 10,
        "data": "x", "dataset": "d", "pixel_agg": null, "protocol": "2.0"}"#;
    refuse(v20, &["protocol 2.0", "`data` must be a JSON object"]);
    Metadata::for_writing(&json::parse(v20.replace(r#""x""#, "{}").as_bytes()).unwrap()).unwrap();
}
