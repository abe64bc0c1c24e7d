//! Reduced-precision saev datasets in an object store (an in-memory one in place of the
//! bucket; threads as ranks): one writer and parallel writers upload the objects a local
//! writer writes, error sidecars included; inspect reads the sidecars back from the store; a
//! write killed before its commit resumes byte-identically. Each test is its own process under
//! nextest (the store is installed process-wide).

mod common;

use common::saev::{acts, labels, metadata, write_all};
use common::stores::{objects, store};
use common::{rank, tree};

use std::path::{Path, PathBuf};

use shardkit::precision::Dtype;
use shardkit::saev::{self, Dataset, PartWriter, Writer, WriterOptions};

const ROOT: &str = "s3://bucket/data";

fn md(n: u64) -> saev::Metadata {
    metadata(n).with_dtype(Dtype::BF16).unwrap()
}

/// The dataset one local writer writes: every file with its bytes.
fn local(root: &Path, n: u64) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut w = Writer::create(root, md(n), WriterOptions::default()).unwrap();
    w.write(&acts(0..n), Some(&labels(0..n))).unwrap();
    tree(&w.finish().unwrap())
}

/// Asserts two datasets' files are equal, naming those that differ (not dumping bytes).
fn assert_same(
    got: &std::collections::BTreeMap<String, Vec<u8>>,
    want: &std::collections::BTreeMap<String, Vec<u8>>,
) {
    let names: std::collections::BTreeSet<&String> = got.keys().chain(want.keys()).collect();
    let differ: Vec<&&String> = names
        .iter()
        .filter(|n| got.get(**n) != want.get(**n))
        .collect();
    assert!(differ.is_empty(), "files differ: {differ:?}");
}

fn url(dir: &str) -> PathBuf {
    PathBuf::from(format!("{ROOT}/{dir}"))
}

#[test]
fn writers_in_a_store_upload_what_a_local_writer_writes_sidecars_included() {
    let tmp = tempfile::tempdir().unwrap();
    let want = local(&tmp.path().join("local"), 11);
    assert!(
        want.contains_key("acts000005.error.json"),
        "{:?}",
        want.keys()
    );
    let dir = md(11).dir_name();

    // One writer, killed after two shards went up, then resumed.
    let mem = store(&tmp.path().join("staging-one"));
    let mut w = Writer::create(ROOT, md(11), WriterOptions::default()).unwrap();
    w.write(&acts(0..5), Some(&labels(0..5))).unwrap();
    drop(w); // as a kill, but the lock goes with it (this process lives on)
    let opts = WriterOptions::resuming();
    let mut w = Writer::create(ROOT, md(11), opts).unwrap();
    let from = w.next_example();
    assert!(from > 0 && from <= 4, "resumed from {from}");
    w.write(&acts(from..11), Some(&labels(from..11))).unwrap();
    w.finish().unwrap();
    assert_same(&objects(&mem, &format!("data/{dir}")), &want);

    let info = saev::inspect(url(&dir)).unwrap();
    let p = info.get("precision").unwrap();
    assert_eq!(p.get("shards_measured").unwrap().as_i64(), Some(6));
    assert_eq!(
        p.get("rows").unwrap().as_i64(),
        Some(11 * 2 * 4),
        "every row of every example, each counted once"
    );
    assert_eq!(
        Dataset::open(url(&dir)).unwrap().get(3, 7, 1).unwrap(),
        Dataset::open(tmp.path().join("local").join(&dir))
            .unwrap()
            .get(3, 7, 1)
            .unwrap()
    );

    // Three ranks.
    let mem = store(&tmp.path().join("staging-three"));
    let writers: Vec<PartWriter> = (0..3)
        .map(|r| PartWriter::create(ROOT, md(11), rank(r, 3)).unwrap())
        .collect();
    std::thread::scope(|s| {
        let ts: Vec<_> = writers
            .into_iter()
            .map(|w| s.spawn(move || write_all(w, true)))
            .collect();
        for t in ts {
            t.join().unwrap();
        }
    });
    assert_same(&objects(&mem, &format!("data/{dir}")), &want);
}
