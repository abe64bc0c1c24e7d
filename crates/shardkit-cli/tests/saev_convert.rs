//! `shardkit saev convert` and the CLI's reduced-precision datasets: `synth --dtype` and
//! `write --dtype` write what `convert` makes of the float32 dataset, byte for byte; a
//! conversion killed with SIGKILL at random points and run again ends byte-identical to an
//! uninterrupted one; `get` prints widened values, `export` widens or keeps the stored type,
//! `inspect` says what the rounding cost and why saev refuses the dataset; and what cannot be
//! converted is refused with a message that says why.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{check_saev_state, run, run_and_kill, snapshot, Rng, BIN};
use shardkit::precision::{self, Dtype};
use shardkit::saev::Dataset;

/// Runs the CLI, expecting failure; its stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8(out.stderr).unwrap()
}

/// `saev synth` of a small dataset (7 examples, 3 per shard, labels) under `root`, storing
/// `dtype` when given.
fn synth(root: &Path, dtype: Option<&str>, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        "saev",
        "synth",
        "--out",
        root.to_str().unwrap(),
        "--examples",
        "7",
        "--content-tokens",
        "3",
        "--d-model",
        "8",
        "--budget",
        "24",
        "--labels",
    ];
    if let Some(d) = dtype {
        args.extend(["--dtype", d]);
    }
    args.extend(extra);
    PathBuf::from(run(&args).trim())
}

fn convert(src: &Path, dtype: &str, root: &Path) -> PathBuf {
    let printed = run(&[
        "saev",
        "convert",
        src.to_str().unwrap(),
        "--dtype",
        dtype,
        "--out",
        root.to_str().unwrap(),
    ]);
    PathBuf::from(printed.trim())
}

#[test]
fn synth_and_write_in_a_dtype_equal_converting_the_float32_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let f32_dir = synth(&tmp.path().join("f32"), None, &[]);
    for (name, canonical) in [
        ("bf16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
    ] {
        let direct = synth(&tmp.path().join(format!("synth-{name}")), Some(name), &[]);
        let converted = convert(&f32_dir, name, &tmp.path().join(format!("conv-{name}")));
        assert_eq!(direct.file_name(), converted.file_name());
        assert_eq!(snapshot(&direct), snapshot(&converted), "--dtype {name}");
        let md = std::fs::read_to_string(converted.join("metadata.json")).unwrap();
        assert!(md.contains(&format!("\"dtype\": \"{canonical}\"")), "{md}");
        assert!(converted.join("acts000002.error.json").is_file());
    }
    // `write --dtype` from the float32 inputs `synth --npy` makes: the same dataset again.
    let npy = tmp.path().join("npy");
    synth(&npy, None, &["--npy"]);
    let root = tmp.path().join("written");
    let npy_s = npy.to_str().unwrap();
    let written = run(&[
        "saev",
        "write",
        "--out",
        root.to_str().unwrap(),
        "--metadata",
        &format!("{npy_s}/metadata.json"),
        "--acts",
        &format!("{npy_s}/acts.npy"),
        "--labels",
        &format!("{npy_s}/labels.npy"),
        "--dtype",
        "bfloat16",
    ]);
    let direct = tmp.path().join("synth-bf16").join(
        PathBuf::from(written.trim())
            .file_name()
            .expect("a directory"),
    );
    assert_eq!(snapshot(Path::new(written.trim())), snapshot(&direct));
    // --dtype replaces the "float32" every metadata.json records, not another reduced type.
    let md = std::fs::read_to_string(npy.join("metadata.json")).unwrap();
    let f16_md = tmp.path().join("f16.json");
    std::fs::write(&f16_md, md.replace("\"float32\"", "\"float16\"")).unwrap();
    let e = fails(&[
        "saev",
        "write",
        "--out",
        root.to_str().unwrap(),
        "--metadata",
        f16_md.to_str().unwrap(),
        "--acts",
        &format!("{npy_s}/acts.npy"),
        "--dtype",
        "bf16",
    ]);
    assert_eq!(
        e,
        format!(
            "error: {}: records \"dtype\": \"float16\", but --dtype asks for bfloat16; drop one\n",
            f16_md.display()
        )
    );

    // Back to float32: every value widened exactly from the stored bfloat16.
    let back = convert(&direct, "float32", &tmp.path().join("back"));
    assert_eq!(
        back.file_name(),
        f32_dir.file_name(),
        "the float32 name again"
    );
    let (orig, got) = (
        Dataset::open(&f32_dir).unwrap(),
        Dataset::open(&back).unwrap(),
    );
    let v = orig.get(6, -1, 3).unwrap();
    let want = precision::decoded(Dtype::BF16, &precision::encoded(Dtype::BF16, &v));
    assert_eq!(got.get(6, -1, 3).unwrap(), want);
    assert_ne!(want, v, "the coded values are not all bfloat16 values");
}

#[test]
fn a_second_run_resumes_or_reports_completion() {
    let tmp = tempfile::tempdir().unwrap();
    let src = synth(&tmp.path().join("f32"), None, &[]);
    let root = tmp.path().join("bf");
    let dir = convert(&src, "bf16", &root);
    let before = snapshot(&dir);
    let out = Command::new(BIN)
        .args([
            "saev",
            "convert",
            src.to_str().unwrap(),
            "--dtype",
            "bf16",
            "--out",
        ])
        .arg(&root)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        dir.to_str().unwrap()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "already complete: the destination holds this dataset; nothing written\n"
    );
    assert_eq!(snapshot(&dir), before);
}

#[test]
fn get_export_and_inspect_of_a_reduced_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let f32_dir = synth(&tmp.path().join("f32"), None, &[]);
    let orig = Dataset::open(&f32_dir).unwrap();
    for (dtype, array, descr) in [
        (Dtype::F16, "act", "'<f2'"),
        (Dtype::BF16, "act_bf16_bits", "'<u2'"),
    ] {
        let dir = synth(&tmp.path().join(dtype.name()), Some(dtype.name()), &[]);
        let d = dir.to_str().unwrap();
        // get: float32 values, widened exactly.
        let v = orig.get(4, -2, 1).unwrap();
        let q = precision::decoded(dtype, &precision::encoded(dtype, &v));
        let shown: Vec<String> = q.iter().map(|x| format!("{x:?}")).collect();
        let printed = run(&[
            "saev",
            "get",
            d,
            "--example",
            "4",
            "--layer=-2",
            "--token",
            "1",
        ]);
        assert_eq!(printed, format!("[{}]\n", shown.join(", ")));

        // export: float32 by default; as stored on request.
        let npz = tmp.path().join(format!("{dtype}.npz"));
        let n = npz.to_str().unwrap();
        run(&["saev", "export", d, "--layer=-1", "--out", n]);
        let arrays = read_npz(&npz);
        let (hdr, data) = &arrays["act.npy"];
        assert!(
            hdr.contains("'descr': '<f4'") && hdr.contains("(21, 8)"),
            "{hdr}"
        );
        let all = Dataset::open(&dir).unwrap();
        let row0: Vec<u8> = all
            .get(0, -1, 1)
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            data[..32],
            row0[..],
            "content token 0 of example 0, float32"
        );
        run(&[
            "saev",
            "export",
            d,
            "--layer=-1",
            "--out",
            n,
            "--dtype",
            "stored",
        ]);
        let arrays = read_npz(&npz);
        assert!(
            !(array != "act" && arrays.contains_key("act.npy")),
            "{:?}",
            arrays.keys()
        );
        let (hdr, data) = &arrays[&format!("{array}.npy")];
        assert!(
            hdr.contains(&format!("'descr': {descr}")) && hdr.contains("(21, 8)"),
            "{hdr}"
        );
        assert_eq!(data.len(), 21 * 8 * 2);
        assert_eq!(
            data[..16],
            precision::encoded(dtype, &all.get(0, -1, 1).unwrap())[..]
        );

        // inspect: the stored type, what rounding cost, and why saev will not load it.
        let text = run(&["saev", "inspect", d]);
        let line = |key: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("{key} ")))
                .unwrap_or_else(|| panic!("no {key} in {text}"))
                .to_string()
        };
        assert!(line("dtype").ends_with(&format!(" {dtype}")));
        let p = line("precision");
        assert!(
            p.contains(&format!("{dtype}, 3 shard(s) measured: max abs error "))
                && p.contains(", 0 overflowed to inf, 0 flushed to zero"),
            "{p}"
        );
        assert!(line("saev_loads").ends_with(&format!(
            "no: saev's own loaders read float32 only (this dataset stores {dtype}); `shardkit \
             saev convert {d} --dtype float32 --out ROOT` writes a copy they load"
        )));
        let out = Command::new(BIN)
            .args(["saev", "validate", d])
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{report}");
        assert!(report.contains("saev does not load it"), "{report}");
    }
    let text = run(&["saev", "inspect", f32_dir.to_str().unwrap()]);
    assert!(
        text.contains("exact (float32: nothing rounded)\n"),
        "{text}"
    );
    assert!(text
        .lines()
        .any(|l| l.starts_with("saev_loads ") && l.ends_with(" true")));
}

/// The members of an .npz: name → (npy header text, data bytes).
fn read_npz(path: &Path) -> BTreeMap<String, (String, Vec<u8>)> {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut out = BTreeMap::new();
    for i in 0..zip.len() {
        let mut f = zip.by_index(i).unwrap();
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).unwrap();
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = String::from_utf8_lossy(&bytes[10..10 + hlen]).into_owned();
        out.insert(f.name().to_string(), (header, bytes[10 + hlen..].to_vec()));
    }
    out
}

#[test]
fn refusals_say_why() {
    let tmp = tempfile::tempdir().unwrap();
    let src = synth(&tmp.path().join("f32"), None, &[]);
    let s = src.to_str().unwrap();
    let out = tmp.path().join("out");
    let o = out.to_str().unwrap();
    assert_eq!(
        fails(&["saev", "convert", s, "--dtype", "int8", "--out", o]),
        "error: unknown dtype \"int8\": expected float32, bfloat16 (bf16) or float16 (fp16)\n"
    );
    assert_eq!(
        fails(&["saev", "convert", s, "--dtype", "fp32", "--out", o]),
        format!(
            "error: {s}: already float32; nothing to convert (the result would be this dataset \
             under its own name; to copy it use `shardkit upload` / `shardkit download` or cp \
             -r)\n"
        )
    );
    let v20 = synth(&tmp.path().join("v20"), None, &["--protocol", "2.0"]);
    let e = fails(&[
        "saev",
        "convert",
        v20.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--out",
        o,
    ]);
    assert!(
        e.contains(
            "cannot convert protocol 2.0 to bfloat16: bfloat16 and float16 are shardkit's \
                    dialect of protocol 2.1 only"
        ),
        "{e}"
    );
    let e = fails(&[
        "saev",
        "synth",
        "--out",
        o,
        "--protocol",
        "2.0",
        "--dtype",
        "bf16",
    ]);
    assert!(e.contains("protocol 2.1"), "{e}");
    let e = fails(&["saev", "synth", "--out", o, "--dtype", "e4m3"]);
    assert!(
        e.contains("unknown dtype \"e4m3\": expected float32, bfloat16 (bf16)"),
        "{e}"
    );
    let e = fails(&[
        "saev",
        "export",
        s,
        "--layer=-1",
        "--out",
        "/dev/null",
        "--dtype",
        "fp16",
    ]);
    assert!(
        e.contains("expected float32 (the default: values widened exactly) or stored"),
        "{e}"
    );
    assert!(!out.exists(), "nothing was created");
    // A source that is not complete: refused with what is present.
    std::fs::remove_file(src.join("shards.json")).unwrap();
    std::fs::remove_file(src.join("acts000002.bin")).unwrap();
    let e = fails(&["saev", "convert", s, "--dtype", "bf16", "--out", o]);
    assert!(
        e.contains("incomplete dataset: 6 of 7 examples are present"),
        "{e}"
    );
    assert!(!out.exists());
}

#[test]
fn sigkill_at_random_points_then_rerun_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    // 47 examples of 2 x 65 x 256 floats (133 KiB), 3 per shard: 16 shards, the last partial.
    let src = PathBuf::from(
        run(&[
            "saev",
            "synth",
            "--out",
            tmp.path().join("src").to_str().unwrap(),
            "--examples",
            "47",
            "--content-tokens",
            "64",
            "--d-model",
            "256",
            "--budget",
            "390",
            "--labels",
        ])
        .trim(),
    );
    let args = |root: &Path| -> Vec<String> {
        [
            "saev",
            "convert",
            src.to_str().unwrap(),
            "--dtype",
            "bf16",
            "--out",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([root.display().to_string()])
        .collect()
    };
    let t0 = Instant::now();
    let ref_dir = PathBuf::from(run(&args(&tmp.path().join("ref"))).trim());
    let full = t0.elapsed();
    let reference = snapshot(&ref_dir);
    // 16 shards and their error sidecars, metadata, shards.json, labels, checksums.
    assert_eq!(reference.len(), 36, "{:?}", reference.keys());

    let (mut rng, seed) = Rng::seeded();
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    let span = full.as_micros() as u64 * 5 / 4 + 1;
    for trial in 0..16 {
        let root = tmp.path().join(format!("t{trial}"));
        let dir = root.join(ref_dir.file_name().unwrap());
        run_and_kill(&args(&root), Duration::from_micros(rng.next() % span));
        *outcomes
            .entry(check_saev_state(&dir, &reference))
            .or_default() += 1;
        if rng.next().is_multiple_of(2) {
            run_and_kill(&args(&root), Duration::from_micros(rng.next() % span));
            check_saev_state(&dir, &reference);
        }
        assert_eq!(PathBuf::from(run(&args(&root)).trim()), dir);
        assert_eq!(snapshot(&dir), reference, "trial {trial} (seed {seed})");
        std::fs::remove_dir_all(&root).unwrap();
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?} (full conversion {full:?})");
    assert!(
        outcomes.get("incomplete").copied().unwrap_or(0) >= 1,
        "no kill landed mid-conversion (seed {seed}): {outcomes:?}"
    );
}
