//! `flat_tokens::build` from corpora: Parquet (written here with the `parquet` crate's Arrow
//! writer: several row groups, nulls, list columns), zstd and gzip JSONL, globs and
//! directories all give the dataset plain JSONL gives; damaged inputs (every truncation,
//! garbage bytes) end in an error that names the file, never a panic and never a short split
//! passed off as finished; thread counts never change the result.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, UInt32Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use shardkit::flat_tokens::{build, BuildOptions, BuildProgress, Split};
use shardkit::Error;

/// Ragged sequences (empty ones included) from a fixed seed.
fn sequences(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| {
            let len = if i % 37 == 3 { 0 } else { next() % 300 + 1 };
            (0..len).map(|_| (next() % 60_000) as u32 + 1).collect()
        })
        .collect()
}

fn jsonl(seqs: &[Vec<u32>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let ids: Vec<String> = s.iter().map(u32::to_string).collect();
        writeln!(out, r#"{{"id": {i}, "input_ids": [{}]}}"#, ids.join(", ")).unwrap();
    }
    out
}

/// A Parquet file of `seqs` in an `input_ids` list column beside an `id` and a nullable `url`
/// column; every `null_every`-th row has a null `input_ids` (not a document).
fn parquet(path: &Path, seqs: &[Vec<u32>], row_group: usize, null_every: Option<usize>) -> usize {
    let mut ids = ListBuilder::new(UInt32Builder::new());
    let mut nulls = 0;
    let mut k = 0;
    let mut urls = Vec::new();
    let mut row_ids = Vec::new();
    let mut row = 0i64;
    while k < seqs.len() {
        if null_every.is_some_and(|n| row as usize % n == n - 1) {
            ids.append_null();
            nulls += 1;
        } else {
            for &v in &seqs[k] {
                ids.values().append_value(v);
            }
            ids.append(true);
            k += 1;
        }
        urls.push((row % 3 != 0).then(|| format!("https://example.org/{row}")));
        row_ids.push(row);
        row += 1;
    }
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from(row_ids)) as ArrayRef),
        ("input_ids", Arc::new(ids.finish()) as ArrayRef),
        ("url", Arc::new(StringArray::from(urls)) as ArrayRef),
    ])
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(row_group))
        .set_compression(Compression::SNAPPY)
        .build();
    let mut w =
        ArrowWriter::try_new(fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    nulls
}

fn zstd_frames(parts: &[&[u8]]) -> Vec<u8> {
    parts
        .iter()
        .flat_map(|p| zstd::encode_all(*p, 3).unwrap())
        .collect()
}

fn gzip_members(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(p).unwrap();
        out.extend(e.finish().unwrap());
    }
    out
}

fn opts(threads: usize) -> BuildOptions {
    BuildOptions {
        threads,
        ..BuildOptions::default()
    }
}

fn run(out: &Path, inputs: &[String], o: &BuildOptions) -> shardkit::Result<()> {
    build(out, "train", inputs, o, &mut |_| Ok(())).map(drop)
}

fn contents(out: &Path) -> (Vec<u32>, Vec<u64>) {
    let s = Split::open(out, "train").unwrap();
    (
        s.encoded(0..s.info().token_count).unwrap(),
        s.seq_starts(0..s.info().seq_count + 1).unwrap(),
    )
}

fn p(path: impl AsRef<Path>) -> String {
    path.as_ref().display().to_string()
}

#[test]
fn every_input_form_builds_the_plain_jsonl_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = sequences(900, 11);
    let plain = tmp.path().join("all.jsonl");
    fs::write(&plain, jsonl(&seqs)).unwrap();
    let reference = tmp.path().join("ref.zarr");
    run(&reference, &[p(&plain)], &opts(1)).unwrap();
    let want = contents(&reference);
    assert_eq!(want.1.len(), seqs.len() + 1);

    let (a, b) = seqs.split_at(400);
    let zst = tmp.path().join("all.jsonl.zst");
    fs::write(&zst, zstd_frames(&[&jsonl(a), &jsonl(b)])).unwrap();
    let gz = tmp.path().join("all.json.gz");
    fs::write(&gz, gzip_members(&[&jsonl(a), &jsonl(b)])).unwrap();
    let pq = tmp.path().join("all.parquet");
    let nulls = parquet(&pq, &seqs, 64, Some(17));
    assert!(nulls > 10);
    let parts = tmp.path().join("parts");
    fs::create_dir(&parts).unwrap();
    for (i, chunk) in seqs.chunks(250).enumerate() {
        parquet(
            &parts.join(format!("part-{i:03}.parquet")),
            chunk,
            100,
            None,
        );
    }
    fs::write(parts.join("notes.txt"), "ignored by a directory scan").unwrap();
    let mixed_head = tmp.path().join("head.parquet");
    parquet(&mixed_head, a, 50, None);
    let mixed_tail = tmp.path().join("tail.jsonl.gz");
    fs::write(&mixed_tail, gzip_members(&[&jsonl(b)])).unwrap();

    let cases: Vec<(&str, Vec<String>)> = vec![
        ("zstd", vec![p(&zst)]),
        ("gzip", vec![p(&gz)]),
        ("parquet with nulls", vec![p(&pq)]),
        ("glob", vec![format!("{}/part-*.parquet", parts.display())]),
        ("directory", vec![p(&parts)]),
        ("mixed list", vec![p(&mixed_head), p(&mixed_tail)]),
    ];
    for (i, (what, inputs)) in cases.iter().enumerate() {
        for threads in [1, 3] {
            let out = tmp.path().join(format!("out-{i}-{threads}.zarr"));
            let summary = build(&out, "train", inputs, &opts(threads), &mut |_| Ok(())).unwrap();
            assert_eq!(contents(&out), want, "{what}, {threads} threads");
            assert_eq!(summary.appended_sequences, seqs.len() as u64);
            if *what == "parquet with nulls" {
                assert_eq!(summary.null_values, nulls as u64);
            }
        }
    }
}

#[test]
fn progress_reports_bytes_and_counts_and_can_stop_the_build() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = sequences(1200, 5);
    let mut inputs = Vec::new();
    for (i, chunk) in seqs.chunks(200).enumerate() {
        let f = tmp.path().join(format!("{i}.jsonl.zst"));
        fs::write(&f, zstd_frames(&[&jsonl(chunk)])).unwrap();
        inputs.push(p(&f));
    }
    let total: u64 = inputs.iter().map(|f| fs::metadata(f).unwrap().len()).sum();
    let out = tmp.path().join("out.zarr");
    let mut seen: Vec<BuildProgress> = Vec::new();
    let err = build(
        &out,
        "train",
        &inputs,
        &BuildOptions {
            checkpoint_tokens: 1,
            ..opts(2)
        },
        &mut |pr| {
            seen.push(*pr);
            if seen.len() == 3 {
                return Err(Error::Invalid("stop here".into()));
            }
            Ok(())
        },
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "stop here");
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.bytes_total == Some(total)));
    assert!(seen.windows(2).all(|w| w[0].bytes_read < w[1].bytes_read));
    assert_eq!(seen[2].sequences, 600);
    // Interrupted with 600 sequences committed; resume finishes it exactly.
    assert!(matches!(
        Split::open(&out, "train").unwrap_err(),
        Error::Interrupted { .. }
    ));
    let s = build(
        &out,
        "train",
        &inputs,
        &BuildOptions {
            resume: true,
            ..opts(2)
        },
        &mut |_| Ok(()),
    )
    .unwrap();
    assert_eq!(s.skipped_documents, 600);
    let reference = tmp.path().join("ref.zarr");
    run(&reference, &inputs, &opts(1)).unwrap();
    assert_eq!(contents(&out), contents(&reference));
}

/// A damaged input at any point: an error naming the file; what was committed before stays.
#[test]
fn damaged_inputs_give_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = sequences(300, 3);
    let body = jsonl(&seqs);
    let good_pq = tmp.path().join("good.parquet");
    parquet(&good_pq, &seqs, 40, None);
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("x.jsonl.zst", zstd_frames(&[&body])),
        ("x.json.gz", gzip_members(&[&body])),
        ("x.parquet", fs::read(&good_pq).unwrap()),
    ];
    let mut outcomes = std::collections::BTreeMap::new();
    for (name, bytes) in &files {
        let mut damaged: Vec<(String, Vec<u8>)> = Vec::new();
        let step = (bytes.len() / 60).max(1);
        for cut in (1..bytes.len()).step_by(step) {
            damaged.push((format!("cut at {cut}"), bytes[..cut].to_vec()));
        }
        for at in (0..bytes.len()).step_by(step) {
            let mut b = bytes.clone();
            for x in &mut b[at..(at + 16).min(bytes.len())] {
                *x ^= 0x5a;
            }
            damaged.push((format!("garbage at {at}"), b));
        }
        for (i, (what, b)) in damaged.into_iter().enumerate() {
            let dir = tmp.path().join(format!("{name}-{i}"));
            fs::create_dir(&dir).unwrap();
            let f = dir.join(name);
            fs::write(&f, &b).unwrap();
            let out = dir.join("out.zarr");
            match run(&out, &[p(&f)], &opts(2)) {
                Err(e) => {
                    assert!(
                        e.to_string().contains(&p(&f)),
                        "{name} {what}: the error does not name the file: {e}"
                    );
                    *outcomes.entry((*name, "error")).or_insert(0) += 1;
                }
                // Damage the format cannot detect (inside a JSON number, say) may build; the
                // result is then a finished, valid split.
                Ok(()) => {
                    assert!(
                        shardkit::flat_tokens::validate(&out).is_valid(),
                        "{name} {what}"
                    );
                    *outcomes.entry((*name, "built")).or_insert(0) += 1;
                }
            }
            fs::remove_dir_all(&dir).unwrap();
        }
    }
    eprintln!("{outcomes:?}");
    for (name, _) in &files {
        assert!(
            outcomes.get(&(*name, "error")).copied().unwrap_or(0) > 50,
            "{name}"
        );
    }
}

#[test]
fn refusals_name_the_file_and_the_place_and_create_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.zarr");
    let pq = tmp.path().join("d.parquet");
    parquet(&pq, &sequences(10, 1), 4, None);
    // JSONL whose documents lack the member asked for, plain and compressed, after a blank
    // line and a null: found at the start of the file, before the split is created.
    let sub = tmp.path().join("sub");
    fs::create_dir(&sub).unwrap();
    let ids = sub.join("ids.jsonl");
    fs::write(&ids, "\n{\"ids\": null}\n{\"ids\": [1, 2]}\n").unwrap();
    let ids_zst = sub.join("ids.jsonl.zst");
    fs::write(&ids_zst, zstd_frames(&[b"{\"ids\": [1, 2]}\n"])).unwrap();
    let cases: Vec<(Vec<String>, BuildOptions, Vec<String>)> = vec![
        (
            vec![p(&ids)],
            opts(1),
            vec![p(&ids), "line 2".into(), r#"no member "input_ids""#.into()],
        ),
        (
            vec![p(&pq), p(&ids_zst)],
            opts(1),
            vec![p(&ids_zst), "line 1".into(), "--field".into()],
        ),
        (
            vec![p(&pq)],
            BuildOptions {
                field: Some("tokens_v2".into()),
                ..opts(1)
            },
            vec![
                p(&pq),
                r#"no column "tokens_v2""#.into(),
                r#""id", "input_ids", "url""#.into(),
            ],
        ),
        (
            vec![p(&pq)],
            BuildOptions {
                field: Some("url".into()),
                ..opts(1)
            },
            vec![
                p(&pq),
                "column \"url\" is Utf8, not a list of integer token ids".into(),
                "give a tokenizer".into(),
            ],
        ),
        (
            vec![format!("{}/*.jsonl", tmp.path().display())],
            opts(1),
            vec!["matches no file".into()],
        ),
        (vec![p(&pq), p(&pq)], opts(1), vec!["given twice".into()]),
        (
            vec![p(tmp.path().join("missing.parquet"))],
            opts(1),
            vec!["missing.parquet".into()],
        ),
    ];
    for (inputs, o, needles) in cases {
        let e = run(&out, &inputs, &o).unwrap_err().to_string();
        for n in &needles {
            assert!(e.contains(n.as_str()), "{n:?} not in {e}");
        }
        assert!(!out.exists(), "{e}");
    }
    // Line-level faults name the line; nothing earlier is lost.
    let jl = tmp.path().join("bad.jsonl");
    fs::write(&jl, "[1, 2]\n\n[3]\n{\"input_ids\": \"x\"}\n").unwrap();
    let e = run(&out, &[p(&jl)], &opts(1)).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "{}: line 4: expected an array of token ids",
            p(&jl)
        )),
        "{e}"
    );
    let over = tmp.path().join("over.jsonl");
    fs::write(&over, "[2147483648]\n").unwrap();
    let e = run(&tmp.path().join("o2.zarr"), &[p(&over)], &opts(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1") && e.contains("2^31"), "{e}");
}

#[test]
fn threads_never_change_the_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let seqs = sequences(3000, 99);
    let f: PathBuf = tmp.path().join("d.jsonl");
    fs::write(&f, jsonl(&seqs)).unwrap();
    let mut first = None;
    for threads in [1, 2, 5, 16] {
        let out = tmp.path().join(format!("{threads}.zarr"));
        run(&out, &[p(&f)], &opts(threads)).unwrap();
        let c = contents(&out);
        match &first {
            None => first = Some(c),
            Some(f) => assert_eq!(&c, f, "{threads} threads"),
        }
    }
}
