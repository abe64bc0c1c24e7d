//! Messages that say what to do (issue 32, class 5): a path that is not a dataset says what it is
//! instead (no such directory, a writer's root with the dataset inside it, a split directory),
//! a file cut short says "truncated: X of Y bytes" naming it, and an index out of range says so
//! in words rather than in Rust range syntax. Each test checks the error's kind and the key
//! words of its message.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use shardkit::Error;

mod common;
use common::*;

/// Copies a saev fixture directory (read-only files) to `dst`, writable.
fn copy_saev(fixture: &str, dst: &Path) {
    fs::create_dir_all(dst).unwrap();
    for e in fs::read_dir(fixtures().join(fixture)).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        fs::copy(e.path(), &to).unwrap();
        fs::set_permissions(&to, fs::Permissions::from_mode(0o644)).unwrap();
    }
}

/// The leaf name of a fixture (its `<hash>` directory).
fn leaf(fixture: &str) -> &str {
    fixture.rsplit('/').next().unwrap()
}

#[test]
fn saev_open_of_a_writers_root_names_the_dataset_inside_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("acts");
    let hash = leaf(A_100);
    copy_saev(A_100, &root.join(hash));
    let e = shardkit::saev::Dataset::open(&root).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    let msg = e.to_string();
    let inside = root.join(hash).display().to_string();
    assert!(
        msg.contains("is a writer's root, not a dataset")
            && msg.contains(&format!("the dataset is {inside}"))
            && msg.contains("metadata.json"),
        "{msg}"
    );
    // validate and inspect say the same.
    let v = shardkit::saev::validate(&root);
    let first = v.errors().next().unwrap();
    assert!(
        first.message.contains(&format!("the dataset is {inside}")),
        "{}",
        first.message
    );
    let e = shardkit::saev::inspect(&root).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { .. }) && e.to_string().contains(&inside),
        "{e}"
    );
    // The dataset itself opens.
    shardkit::saev::Dataset::open(root.join(hash)).unwrap();
}

#[test]
fn saev_open_of_a_root_with_several_datasets_lists_them() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("acts");
    copy_saev(A_100, &root.join(leaf(A_100)));
    copy_saev(B_100, &root.join(leaf(B_100)));
    let e = shardkit::saev::Dataset::open(&root).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("writer's root holding 2 datasets")
            && msg.contains(&root.join(leaf(A_100)).display().to_string())
            && msg.contains(&root.join(leaf(B_100)).display().to_string()),
        "{msg}"
    );
}

#[test]
fn saev_open_of_a_missing_or_empty_directory_says_so_plainly() {
    let tmp = tempfile::tempdir().unwrap();
    let nope = tmp.path().join("nope");
    let e = shardkit::saev::Dataset::open(&nope).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert_eq!(e.path(), Some(nope.as_path()));
    assert_eq!(e.message(), "no such directory");
    let v = shardkit::saev::validate(&nope);
    assert_eq!(v.errors().next().unwrap().message, "no such directory");
    let e = shardkit::saev::inspect(&nope).unwrap_err();
    assert_eq!(e.message(), "no such directory");

    let file = tmp.path().join("file");
    fs::write(&file, b"x").unwrap();
    let e = shardkit::saev::Dataset::open(&file).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert!(e.message().starts_with("not a directory"), "{e}");

    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let e = shardkit::saev::Dataset::open(&empty).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("is not a saev dataset directory (one holds metadata.json"),
        "{e}"
    );
}

#[test]
fn saev_out_of_range_reads_say_so_in_words() {
    let ds = shardkit::saev::Dataset::open(fixtures().join(A_100)).unwrap();
    let n = ds.layout().n_examples;
    let e = ds.get(n + 3, -1, 0).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "example {} is past the end: there are {n} examples (valid indices: 0 to {})",
            n + 3,
            n - 1
        )
    );
    assert!(!e.to_string().contains(".."), "{e}");
}

#[test]
fn out_of_range_words_for_every_count() {
    let e = |what, index, len| Error::OutOfRange { what, index, len }.to_string();
    assert_eq!(
        e("example", 70, 64),
        "example 70 is past the end: there are 64 examples (valid indices: 0 to 63)"
    );
    assert_eq!(
        e("sample", 1, 1),
        "sample 1 is past the end: there is 1 sample (valid index: 0)"
    );
    assert_eq!(
        e("token", 0, 0),
        "token 0 is past the end: there are no tokens"
    );
    assert_eq!(
        e("sample", -6, 5),
        "sample -6 is before the start: there are 5 samples (valid indices: 0 to 4), or -5 \
         to -1 counting from the end"
    );
    assert_eq!(
        e("index", 9, 3),
        "index 9 is past the end: there are 3 indices (valid indices: 0 to 2)"
    );
    assert_eq!(
        e(
            "step (enable epochs to continue past the end in a new order)",
            10,
            10
        ),
        "step 10 is past the end: there are 10 steps (valid indices: 0 to 9); enable epochs \
         to continue past the end in a new order"
    );
    let remote = Error::Remote {
        object: "s3://b/k".into(),
        range: Some(100..200),
        message: "boom".into(),
    };
    assert_eq!(remote.to_string(), "s3://b/k (bytes 100 to 199): boom");
}

/// A small SDNB file: one float32 variable.
fn small_sdnb(path: &Path) -> Vec<u8> {
    use shardkit::sdnb::{self, DType, Order, SaveOptions, TensorIn, VarType};
    let bytes: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    sdnb::save(
        path,
        &[TensorIn {
            name: "w".into(),
            var_type: VarType::Variable,
            dtype: DType::Float,
            shape: vec![8, 8],
            order: Order::C,
            bytes: &bytes,
        }],
        &SaveOptions::default(),
    )
    .unwrap();
    fs::read(path).unwrap()
}

#[test]
fn a_truncated_sdnb_file_says_truncated_x_of_y_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.sdnb");
    let good = small_sdnb(&path);
    let len = good.len();
    for (cut, want) in [
        (len - 1, format!("truncated: {} of {len} bytes", len - 1)),
        (20, "truncated: 20 of at least 32 bytes".to_string()),
    ] {
        fs::write(&path, &good[..cut]).unwrap();
        let e = shardkit::sdnb::open(&path).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        assert_eq!(e.path(), Some(path.as_path()));
        let msg = e.to_string();
        assert!(
            msg.contains(&want) && msg.contains("copy or write it again"),
            "{msg}"
        );
        let v = shardkit::sdnb::validate(&path, false);
        assert!(
            v.errors().any(|f| f.message.contains(&want)),
            "{:?}",
            v.errors().map(|f| &f.message).collect::<Vec<_>>()
        );
    }
}

#[cfg(feature = "zarr")]
mod flat_tokens {
    use super::*;
    use shardkit::flat_tokens::{self, Layout, Sharded, Split, Writer, WriterOptions};

    fn make(root: &Path, layout: Layout) {
        let mut w = Writer::create(
            root,
            "train",
            WriterOptions {
                layout: Some(layout),
                ..Default::default()
            },
        )
        .unwrap();
        let seqs: Vec<Vec<u32>> = (0..60u32)
            .map(|i| (0..i % 23).map(|j| (i * 7 + j) % 500 + 1).collect())
            .collect();
        w.append(&seqs).unwrap();
        w.finish().unwrap();
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(files(&p));
            } else {
                out.push(p);
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_missing_path_is_no_such_directory_not_a_missing_split() {
        let tmp = tempfile::tempdir().unwrap();
        let nope = tmp.path().join("nope");
        let v = flat_tokens::validate(&nope);
        let first = v.errors().next().unwrap();
        assert_eq!(first.file, nope);
        assert_eq!(first.message, "no such directory");
        let e = flat_tokens::inspect(&nope).unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        assert_eq!(e.message(), "no such directory");
        let e = Split::open(&nope, "train").unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        assert_eq!(e.message(), "no such directory");
    }

    #[test]
    fn a_split_directory_or_a_parent_names_the_dataset() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ds");
        make(&root, Layout::V2);
        // The split directory itself.
        let e = flat_tokens::inspect(root.join("train")).unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        assert!(
            e.to_string().contains(&format!(
                "it is itself the train split; the dataset is its parent, {}",
                root.display()
            )),
            "{e}"
        );
        // A directory holding the dataset one level down.
        let v = flat_tokens::validate(tmp.path());
        let first = v.errors().next().unwrap();
        assert!(
            first
                .message
                .contains("holds neither a train nor a validation split")
                && first.message.contains(&format!(
                    "the flat-tokens dataset is inside it: {}",
                    root.display()
                )),
            "{}",
            first.message
        );
    }

    #[test]
    fn a_truncated_chunk_or_shard_says_truncated_x_of_y_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        for (name, layout) in [
            ("v2", Layout::V2),
            (
                "v3",
                Layout::V3(Sharded {
                    tokens_per_shard: 64,
                    tokens_per_chunk: 16,
                    starts_per_shard: 32,
                    starts_per_chunk: 8,
                    zstd_level: 3,
                }),
            ),
        ] {
            let root = tmp.path().join(name);
            make(&root, layout);
            let tokens = root.join("train").join("encoded_tokens");
            // The first chunk (or shard) file of the tokens, cut to half its length.
            let file = files(&tokens)
                .into_iter()
                .find(|f| {
                    let n = f.file_name().unwrap().to_string_lossy().into_owned();
                    !n.starts_with('.') && n != "zarr.json" && fs::metadata(f).unwrap().len() > 16
                })
                .unwrap();
            let good = fs::read(&file).unwrap();
            let cut = good.len() / 2;
            fs::write(&file, &good[..cut]).unwrap();
            let want = format!("truncated: {cut} of {} bytes", good.len());
            let split = Split::open_unvalidated(&root, "train").unwrap();
            let e = split.encoded(0..split.info().token_count).unwrap_err();
            assert!(matches!(e, Error::Format { .. }), "{name}: {e:?}");
            assert_eq!(e.path(), Some(file.as_path()), "{name}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains(&want) && msg.contains("copy or write it again"),
                "{name}: {msg}"
            );
            assert!(!msg.contains("checksum is invalid ("), "{name}: {msg}");
            // validate lists it under the split, naming the file in the message.
            let v = flat_tokens::validate(&root);
            assert!(
                v.errors()
                    .any(|f| f.message.contains(&format!("{}: {want}", file.display()))),
                "{name}: {:?}",
                v.errors()
                    .map(|f| (&f.file, &f.message))
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn a_read_past_the_end_names_the_first_missing_token() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ds");
        make(&root, Layout::V2);
        let split = Split::open(&root, "train").unwrap();
        let n = split.info().token_count;
        let e = split.encoded(n - 2..n + 5).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "token {n} is past the end: there are {n} tokens (valid indices: 0 to {})",
                n - 1
            )
        );
        #[allow(clippy::reversed_empty_ranges)]
        let e = split.encoded(5..3).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains("the start is after the end"), "{e}");
    }
}
