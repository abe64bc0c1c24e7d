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

fn args(src: &[String], out: &Path, layout: &str, resume: bool) -> Vec<String> {
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
    a.push("--from".into());
    a.extend(src.iter().cloned());
    a.extend(["--out".into(), out.display().to_string()]);
    if resume {
        a.push("--resume".into());
    }
    a
}

/// Never served unless complete, and then exact.
fn check_state(out: &Path, reference: &BTreeMap<String, String>) -> &'static str {
    match Split::open(out, "train") {
        Ok(s) => {
            assert!(s.info().completion == shardkit::flat_tokens::Completion::Complete);
            // A kill between the commit (write_completed) and the checksums sidecar, written
            // right after it, leaves a complete dataset without one (README, Guarantees); the
            // resumed run adds it. Everything else must be exact.
            let mut got = snapshot(out);
            let mut want = reference.clone();
            if !got.contains_key("shardkit.checksums.json") {
                want.remove("shardkit.checksums.json");
                // Killed while the sidecar was being written: its temporary may be left too
                // (readers ignore it; the resumed run replaces it).
                got.remove(".shardkit.checksums.json.tmp");
            }
            assert_eq!(got, want, "a served dataset must be exact");
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

/// 6,000 ragged sequences (empty ones included), about 1.2 M tokens.
fn corpus() -> Vec<Vec<u64>> {
    let mut rng = Rng(0x5eed);
    (0..6_000)
        .map(|i| {
            let len = if i % 50 == 7 { 0 } else { rng.next() % 400 + 1 };
            (0..len).map(|_| rng.next() % 50_000 + 1).collect()
        })
        .collect()
}

fn jsonl(seqs: &[Vec<u64>]) -> String {
    seqs.iter()
        .map(|s| {
            let ids: Vec<String> = s.iter().map(u64::to_string).collect();
            format!("[{}]\n", ids.join(","))
        })
        .collect()
}

/// The corpus as 3 Parquet files of `input_ids` lists (row groups of 500).
fn parquet_parts(dir: &Path, seqs: &[Vec<u64>]) -> Vec<String> {
    use arrow_array::builder::{ListBuilder, UInt64Builder};
    use arrow_array::{ArrayRef, RecordBatch};
    let mut out = Vec::new();
    for (i, part) in seqs.chunks(2_000).enumerate() {
        let mut b = ListBuilder::new(UInt64Builder::new());
        for s in part {
            b.values().append_slice(s);
            b.append(true);
        }
        let batch = RecordBatch::try_from_iter([(
            "input_ids",
            std::sync::Arc::new(b.finish()) as ArrayRef,
        )])
        .unwrap();
        let path = dir.join(format!("part-{i}.parquet"));
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(500))
            .build();
        let mut w = parquet::arrow::ArrowWriter::try_new(
            std::fs::File::create(&path).unwrap(),
            batch.schema(),
            Some(props),
        )
        .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        out.push(path.display().to_string());
    }
    out
}

#[test]
fn sigkill_during_tokens_build_then_resume_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = corpus();
    let plain = tmp.path().join("tokens.jsonl");
    std::fs::write(&plain, jsonl(&seqs)).unwrap();
    // The same documents as zstd JSONL in two files (a glob) and as Parquet files.
    let zdir = tmp.path().join("zst");
    std::fs::create_dir(&zdir).unwrap();
    for (i, part) in seqs.chunks(3_000).enumerate() {
        let z = zstd::encode_all(jsonl(part).as_bytes(), 3).unwrap();
        std::fs::write(zdir.join(format!("{i}.jsonl.zst")), z).unwrap();
    }
    let pdir = tmp.path().join("pq");
    std::fs::create_dir(&pdir).unwrap();
    let inputs: [(&str, Vec<String>); 3] = [
        ("jsonl", vec![plain.display().to_string()]),
        ("zst glob", vec![format!("{}/*.jsonl.zst", zdir.display())]),
        ("parquet", parquet_parts(&pdir, &seqs)),
    ];

    let (mut rng, seed) = Rng::seeded();
    let mut outcomes: BTreeMap<&str, u32> = BTreeMap::new();
    let mut references: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
    for (what, src) in &inputs {
        // JSONL in both layouts; the other inputs in v3 (the same writer below).
        let layouts: &[&str] = if *what == "jsonl" {
            &["v2", "v3"]
        } else {
            &["v3"]
        };
        for &layout in layouts {
            let reference_dir = tmp.path().join(format!("ref-{layout}-{}", what.len()));
            let t0 = Instant::now();
            run(&args(src, &reference_dir, layout, false));
            let full = t0.elapsed();
            let reference = snapshot(&reference_dir);
            // Every input form builds the same bytes.
            if let Some(r) = references.get(layout) {
                assert_eq!(&reference, r, "{what} {layout} differs from plain JSONL");
            }
            references
                .entry(layout)
                .or_insert_with(|| reference.clone());
            let span = full.as_micros() as u64 * 5 / 4 + 1;
            let trials = if *what == "jsonl" { 10 } else { 6 };
            for trial in 0..trials {
                let out = tmp.path().join(format!("{layout}-{trial}"));
                run_and_kill(
                    &args(src, &out, layout, false),
                    Duration::from_micros(rng.next() % span),
                );
                *outcomes.entry(check_state(&out, &reference)).or_default() += 1;
                if rng.next().is_multiple_of(2) {
                    run_and_kill(
                        &args(src, &out, layout, true),
                        Duration::from_micros(rng.next() % span),
                    );
                    check_state(&out, &reference);
                }
                run(&args(src, &out, layout, true));
                assert_eq!(
                    snapshot(&out),
                    reference,
                    "{what} {layout} trial {trial} (seed {seed})"
                );
                std::fs::remove_dir_all(&out).unwrap();
            }
        }
    }
    eprintln!("seed {seed}: first-kill outcomes {outcomes:?}");
    assert!(
        outcomes.get("interrupted").copied().unwrap_or(0) >= 1,
        "no kill landed mid-build (seed {seed}): {outcomes:?}"
    );
}
