//! Every writer holds an exclusive lock on its output for its whole life: a second writer of
//! the same dataset fails at once with `Error::Locked` naming the path and the holder's pid,
//! touching nothing; readers are not blocked; the lock ends with the writer.

use std::path::Path;
use std::sync::{Arc, Mutex};

use shardkit::json::{self, Value};
use shardkit::sdnb::{self, DType, Format, Order, SaveOptions, TensorIn, VarType};
use shardkit::Error;
use shardkit::{eagle3, flat_tokens, saev};

#[track_caller]
fn assert_locked(e: Error, path: &Path) {
    match &e {
        Error::Locked { path: p, pid } => {
            assert_eq!(p, path, "{e}");
            assert_eq!(*pid, Some(std::process::id()), "{e}");
        }
        other => panic!(
            "expected Error::Locked for {}, got {other:?}",
            path.display()
        ),
    }
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(
        msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
}

/// Every file under `dir` with its bytes.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn saev_metadata() -> saev::Metadata {
    let text = format!(
        r#"{{"protocol": "2.1", "family": "clip", "ckpt": "c", "layers": [0],
        "content_tokens_per_example": 2, "cls_token": false, "d_model": 4, "n_examples": 6,
        "max_tokens_per_shard": 4, "data": {:?}, "dataset": "d"}}"#,
        saev::fake_dataset_data(6)
    );
    saev::Metadata::for_writing(&json::parse(text.as_bytes()).unwrap()).unwrap()
}

#[test]
fn saev_writers_exclude_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let md = saev_metadata();
    let mut w = saev::Writer::create(tmp.path(), md.clone(), Default::default()).unwrap();
    w.write(&[1.0; 2 * 2 * 4], None).unwrap();
    let dir = tmp.path().join(md.dir_name());
    let before = tree(&dir);
    for resume in [false, true] {
        let e = saev::Writer::create(
            tmp.path(),
            md.clone(),
            saev::WriterOptions {
                resume,
                ..Default::default()
            },
        );
        assert_locked(e.unwrap_err(), &dir);
    }
    assert_eq!(
        tree(&dir),
        before,
        "the refused writer touched the directory"
    );
    // Readers are not blocked (the dataset is incomplete, and says so).
    assert!(!saev::validate(&dir).is_valid());
    w.write(&[2.0; 4 * 2 * 4], None).unwrap();
    w.finish().unwrap();
    // The lock ended with the writer.
    let again = saev::Writer::create(tmp.path(), md, Default::default()).unwrap();
    assert_eq!(again.start(), saev::WriteStart::AlreadyComplete);
}

fn eagle3_config() -> Value {
    json::parse(
        br#"{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": 4,
        "seq_length": 2, "dtype": "fp32", "num_samples": 4, "shard_size": 2,
        "aux_hidden_dim": 3, "aux_layer_ids": [1, 2, 3], "selected_token_ids": [0, 1, 2, 3],
        "input_data": "x", "split": null, "shuffle_seed": 1}"#,
    )
    .unwrap()
}

#[test]
fn eagle3_writers_exclude_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cfg = eagle3_config();
    let w = eagle3::Writer::create(&dir, &cfg, Default::default()).unwrap();
    let before = tree(&dir);
    for resume in [false, true] {
        let opts = eagle3::WriterOptions {
            resume,
            ..Default::default()
        };
        assert_locked(eagle3::Writer::create(&dir, &cfg, opts).unwrap_err(), &dir);
    }
    assert_eq!(tree(&dir), before);
    // Readers are not blocked.
    let _ = eagle3::validate(&dir, false);
    drop(w);
    let opts = eagle3::WriterOptions {
        resume: true,
        ..Default::default()
    };
    eagle3::Writer::create(&dir, &cfg, opts).unwrap();
}

#[test]
fn flat_tokens_writers_exclude_each_other() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ds.zarr");
    let w = flat_tokens::Writer::create(&root, "train", Default::default()).unwrap();
    let e = flat_tokens::Writer::create(&root, "validation", Default::default()).unwrap_err();
    assert_locked(e, &root);
    drop(w);
    flat_tokens::Writer::create(&root, "validation", Default::default()).unwrap();
}

type SaveResult = Result<Vec<std::path::PathBuf>, Error>;

#[test]
fn sdnb_writers_exclude_each_other_for_every_format() {
    let tmp = tempfile::tempdir().unwrap();
    // 'static: the second save runs inside the first one's progress callback.
    let bytes: &'static [u8] =
        Vec::leak((0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect());
    let tensors = vec![TensorIn {
        name: "w".into(),
        var_type: VarType::Variable,
        dtype: DType::Float,
        shape: vec![8, 8],
        order: Order::C,
        bytes,
    }];
    for (format, name) in [
        (Format::Sdnb, "model.sdnb"),
        (Format::Sharded, "model.sdnb"),
        (Format::Sdz, "model.sdz"),
    ] {
        let path = tmp.path().join(format!("{format:?}")).join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        // A second save of the same container, started while the first is writing (from its
        // progress callback), is refused; the first completes.
        let inner: Arc<Mutex<Option<SaveResult>>> = Arc::default();
        let (inner2, path2, tensors2) = (inner.clone(), path.clone(), tensors.clone());
        let opts = SaveOptions {
            format,
            progress: Some(Arc::new(move |_, _| {
                let mut slot = inner2.lock().unwrap();
                if slot.is_none() {
                    let o = SaveOptions {
                        format,
                        ..SaveOptions::default()
                    };
                    *slot = Some(sdnb::save(&path2, &tensors2, &o));
                }
            })),
            ..SaveOptions::default()
        };
        let files = sdnb::save(&path, &tensors, &opts).unwrap();
        let second = inner.lock().unwrap().take().expect("progress was reported");
        assert_locked(second.unwrap_err(), &path);
        assert!(!files.is_empty());
        sdnb::open(&files[0]).unwrap();
        // The lock file is gone with the writer, and nothing temporary is left.
        let names: Vec<String> = tree(path.parent().unwrap())
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with('.')),
            "{format:?}: {names:?}"
        );
    }
}
