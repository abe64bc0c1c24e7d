//! Every fault of the engine reaches the consumer as an error, for each of the three loaders:
//! a gather thread that panics, the prefetch thread panicking, a thread that cannot be started,
//! a read failing with EIO, and a file that shrinks. Never a silently short epoch: before the
//! error, batches are whole and exact; after it, the iterator ends.
//!
//! The faults are injected process-wide (`shardkit::internals::fault`), so this file is a process of its own
//! and its tests run one at a time.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use shardkit::eagle3::{self, Cache};
use shardkit::engine::Order;
use shardkit::flat_tokens::{self, Split, TokenLoader};
use shardkit::internals::fault::{self, Fault};
use shardkit::json::{self, Value};
use shardkit::saev::{self, LayerSel, Metadata};
use shardkit::Error;

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the process's fault switch for one test, and disarms it however the test ends.
struct Armed(#[allow(dead_code)] MutexGuard<'static, ()>);

impl Armed {
    fn take() -> Armed {
        let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        fault::clear();
        Armed(g)
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        fault::clear();
    }
}

// ---------------------------------------------------------------------------------------------
// Datasets

/// 48 examples of 1 layer x 16 tokens x 64 dims, 8 per shard; v = example.
fn saev_dataset(root: &Path) -> PathBuf {
    let md = Metadata::for_writing(
        &json::parse(
            br#"{"family": "clip", "ckpt": "x", "layers": [0], "content_tokens_per_example": 16,
            "cls_token": false, "d_model": 64, "n_examples": 48, "max_tokens_per_shard": 128,
            "data": "gASV", "dataset": "t", "protocol": "2.1"}"#,
        )
        .unwrap(),
    )
    .unwrap();
    let mut w = saev::Writer::create(root, md, saev::WriterOptions::default()).unwrap();
    for e in 0..48 {
        w.write(&vec![e as f32; 16 * 64], None).unwrap();
    }
    w.finish().unwrap()
}

fn saev_loader(dir: &Path, order: Order) -> saev::Loader {
    let mut o = saev::LoaderOptions::new(LayerSel::Value(0));
    o.order = order;
    o.batch_size = 32;
    o.memory_budget = Some(64 << 10);
    o.threads = 2;
    o.rank = Some(0);
    o.world_size = Some(1);
    saev::Loader::new(dir, o).unwrap()
}

/// 64 documents of 1..300 tokens.
fn tokens_dataset(root: &Path) -> PathBuf {
    let out = root.join("ds.zarr");
    let mut w =
        flat_tokens::Writer::create(&out, "train", flat_tokens::WriterOptions::default()).unwrap();
    let seqs: Vec<Vec<u32>> = (0..64u32)
        .map(|i| (0..(i * 37) % 300 + 1).map(|t| t + i + 1).collect())
        .collect();
    w.append(&seqs).unwrap();
    w.finish().unwrap();
    out
}

/// Rows read one by one, or each minipoch's shuffle buffers read whole into memory (the next
/// minipoch's read ahead on a thread of its own).
fn tokens_loader(ds: &Path, in_memory: bool) -> TokenLoader {
    let mut o = flat_tokens::LoaderOptions::new(16, 4);
    o.sequences_per_read_block = Some(4);
    o.read_blocks_per_shuffle_buffer = 2;
    o.threads = 2;
    o.buffer_in_memory = Some(in_memory);
    TokenLoader::new(Split::open(ds, "train").unwrap(), o).unwrap()
}

/// 24 samples in shards of 4, sequence 16, hidden 8, draft vocabulary 32.
fn eagle3_cache(root: &Path) -> Arc<Cache> {
    let dir = root.join("cache");
    let selected: Vec<Value> = (0..32).map(Value::int).collect();
    let config = Value::Object(vec![
        ("target_model".into(), Value::String("t".into())),
        ("target_vocab_size".into(), Value::int(32)),
        ("draft_vocab_size".into(), Value::int(32)),
        ("seq_length".into(), Value::int(16)),
        ("dtype".into(), Value::String("bf16".into())),
        ("num_samples".into(), Value::int(24)),
        ("shard_size".into(), Value::int(4)),
        ("aux_hidden_dim".into(), Value::int(24)),
        (
            "aux_layer_ids".into(),
            Value::Array(vec![Value::int(1), Value::int(2), Value::int(3)]),
        ),
        ("selected_token_ids".into(), Value::Array(selected)),
        ("input_data".into(), Value::String("d".into())),
        ("split".into(), Value::Null),
        ("shuffle_seed".into(), Value::int(1)),
    ]);
    let mut w = eagle3::Writer::create(&dir, &config, eagle3::WriterOptions::default()).unwrap();
    let m = w.manifest().clone();
    for i in 0..m.num_samples {
        let fields = eagle3::synthetic_sample(&m, i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
    w.finish().unwrap();
    Arc::new(Cache::open(&dir).unwrap())
}

fn eagle3_loader(cache: &Arc<Cache>) -> eagle3::Loader {
    let mut o = eagle3::LoaderOptions::new(3);
    o.threads = 2;
    o.rank = Some(0);
    o.world_size = Some(1);
    eagle3::Loader::new(cache.clone(), o).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Driving a loader to its first error

/// What one pass yielded: the batches before the error, and the error.
struct Outcome {
    ok: usize,
    err: Option<Error>,
    after_err: bool,
}

fn drain<T>(it: impl Iterator<Item = shardkit::Result<T>>) -> Outcome {
    let mut it = it;
    let mut out = Outcome {
        ok: 0,
        err: None,
        after_err: false,
    };
    while let Some(b) = it.next() {
        match b {
            Ok(_) => out.ok += 1,
            Err(e) => {
                out.err = Some(e);
                out.after_err = it.next().is_some();
                break;
            }
        }
    }
    out
}

/// The three loaders' passes over fresh datasets.
#[derive(Clone, Copy, Debug)]
enum Which {
    Saev(Order),
    /// flat-tokens, with shuffle buffers in memory or not.
    Tokens {
        in_memory: bool,
    },
    Eagle3,
}

const ALL: [Which; 6] = [
    Which::Saev(Order::Sequential),
    Which::Saev(Order::Block),
    Which::Saev(Order::Exact),
    Which::Tokens { in_memory: false },
    Which::Tokens { in_memory: true },
    Which::Eagle3,
];

/// A loader over a fresh dataset in `root`: a closure running one pass (from the start), the
/// number of batches of a full pass, and a data file to damage.
#[allow(clippy::type_complexity)]
fn setup(which: Which, root: &Path) -> (Box<dyn Fn() -> Outcome>, usize, PathBuf) {
    match which {
        Which::Saev(order) => {
            let dir = saev_dataset(root);
            let l = Mutex::new(saev_loader(&dir, order));
            let n = l.lock().unwrap().len() as usize;
            (
                // Each pass from the start of the epoch (a loader otherwise resumes where the
                // last pass stopped).
                Box::new(move || {
                    let mut l = l.lock().unwrap_or_else(|e| e.into_inner());
                    l.set_epoch(0).unwrap();
                    drain(l.iter().unwrap())
                }),
                n,
                dir.join("acts000003.bin"),
            )
        }
        Which::Tokens { in_memory } => {
            let ds = tokens_dataset(root);
            let l = tokens_loader(&ds, in_memory);
            let n = l.info().step_count as usize;
            let shard = std::fs::read_dir(ds.join("train/encoded_tokens/c"))
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .path();
            (Box::new(move || drain(l.iter(0))), n, shard)
        }
        Which::Eagle3 => {
            let cache = eagle3_cache(root);
            let l = eagle3_loader(&cache);
            let n = l.len() as usize;
            let shard = root.join("cache/shard-000003.safetensors");
            (Box::new(move || drain(l.iter())), n, shard)
        }
    }
}

#[track_caller]
fn assert_error(which: Which, o: &Outcome, full: usize, needles: &[&str]) {
    let e = o
        .err
        .as_ref()
        .unwrap_or_else(|| panic!("{which:?}: {} of {full} batches and no error", o.ok));
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "{which:?}: {n:?} not in {msg:?}");
    }
    assert!(o.ok < full, "{which:?}: the error came after a whole epoch");
    assert!(
        !o.after_err,
        "{which:?}: the iterator went on after its error"
    );
}

#[test]
fn a_full_pass_has_every_batch() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, _) = setup(which, tmp.path());
        let o = pass();
        assert!(o.err.is_none(), "{which:?}: {:?}", o.err);
        assert_eq!(o.ok, full, "{which:?}");
        assert!(
            full >= 4,
            "{which:?}: {full} batches are too few to inject faults into"
        );
    }
}

#[test]
fn a_panicking_gather_thread_is_an_error() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, _) = setup(which, tmp.path());
        fault::inject(Fault::PanicInGather, 3);
        let o = pass();
        assert_error(
            which,
            &o,
            full,
            &[
                "panicked while gathering",
                "injected fault: a gather thread panicked",
            ],
        );
        // The loader itself is unharmed: the next pass is whole.
        let o = pass();
        assert!(o.err.is_none() && o.ok == full, "{which:?}: {:?}", o.err);
    }
}

#[test]
fn a_panicking_prefetch_thread_is_an_error() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, _) = setup(which, tmp.path());
        fault::inject(Fault::PanicInPrepare, 2);
        let o = pass();
        assert_error(
            which,
            &o,
            full,
            &["panicked while preparing", "the prefetch thread panicked"],
        );
        assert_eq!(
            o.ok, 2,
            "{which:?}: the batches before the fault are delivered"
        );
    }
}

#[test]
fn a_thread_that_cannot_start_is_an_error() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, _) = setup(which, tmp.path());
        // The gather pool (started by the first pass) ...
        fault::inject(Fault::SpawnFails, 0);
        let o = pass();
        assert_error(which, &o, full, &["cannot start", "injected spawn failure"]);
        assert_eq!(o.ok, 0);
        // ... and the pass's own threads once the pool runs.
        assert_eq!(pass().ok, full, "{which:?}");
        fault::inject(Fault::SpawnFails, 1);
        let o = pass();
        assert_error(which, &o, full, &["cannot start the loader thread"]);
    }
}

#[test]
fn a_failing_read_is_an_error_naming_the_file() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, _) = setup(which, tmp.path());
        // Let the first batches through (their reads, or the size checks of mapped data).
        fault::inject(Fault::ReadFails, 2);
        let o = pass();
        let e = o
            .err
            .as_ref()
            .unwrap_or_else(|| panic!("{which:?}: no error"));
        match e {
            Error::Io { path, source } => {
                assert_eq!(source.raw_os_error(), Some(libc::EIO), "{which:?}");
                assert!(
                    path.starts_with(tmp.path()),
                    "{which:?}: {}",
                    path.display()
                );
            }
            other => panic!("{which:?}: expected an I/O error, got {other:?}"),
        }
        assert_error(which, &o, full, &["Input/output error"]);
    }
}

#[test]
fn a_file_that_shrinks_is_an_error_naming_it() {
    let _g = Armed::take();
    for which in ALL {
        let tmp = tempfile::tempdir().unwrap();
        let (pass, full, victim) = setup(which, tmp.path());
        let len = std::fs::metadata(&victim).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&victim)
            .unwrap()
            .set_len(len / 3)
            .unwrap();
        let o = pass();
        // The file, by the path under its dataset that names it (a zarr chunk is "c/0").
        let name = victim
            .strip_prefix(tmp.path())
            .unwrap()
            .iter()
            .rev()
            .take(2)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<PathBuf>();
        let name = name.to_str().unwrap();
        let e = o
            .err
            .as_ref()
            .unwrap_or_else(|| panic!("{which:?}: no error"));
        assert!(
            e.to_string().contains(name),
            "{which:?}: {name} not named in {e}"
        );
        assert!(o.ok < full && !o.after_err, "{which:?}");
    }
}
