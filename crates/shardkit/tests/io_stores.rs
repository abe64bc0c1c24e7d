//! Every format's remote read path against in-memory and local-filesystem object stores
//! (byte-exact against the local read), and a fault-injecting wrapper store: short bodies are
//! retried, and a failure names the object and the byte range.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use shardkit::engine::Order;
use shardkit::io::{self, Location, Stop};
use shardkit::saev::{Dataset, LayerSel, Loader, LoaderOptions};

const URL: &str = "s3://bucket/data";

/// Every file under `dir`, uploaded to `store` under `data/`.
fn upload(dir: &Path, store: &dyn ObjectStore) {
    let local = io::open(&Location::parse(dir).unwrap()).unwrap();
    for (name, _) in local.list().unwrap() {
        let bytes = local.get(&name).unwrap();
        let key = ObjectPath::from(format!("data/{name}"));
        futures::executor::block_on(store.put(&key, PutPayload::from(bytes))).unwrap();
    }
}

/// The stores every remote read is checked against, each holding `dir`'s files.
fn stores(dir: &Path) -> Vec<(&'static str, Arc<dyn ObjectStore>, tempfile::TempDir)> {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(root.path()).unwrap());
    let out = vec![
        ("memory", mem, tempfile::tempdir().unwrap()),
        ("filesystem", fs, root),
    ];
    for (_, s, _) in &out {
        upload(dir, &**s);
    }
    out
}

fn saev_dir(root: &Path) -> std::path::PathBuf {
    common::coded_saev(root, 12, [-3, 7], 4, 10, 5)
}

#[test]
fn a_source_lists_gets_and_reads_ranges_the_same_wherever_the_bytes_live() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dir(tmp.path());
    let local = io::open(&Location::parse(&dir).unwrap()).unwrap();
    assert!(local.is_local());
    let listed = local.list().unwrap();
    for (what, store, _keep) in stores(&dir) {
        let remote = io::open_store(URL, store, None).unwrap();
        assert!(!remote.is_local(), "{what}");
        assert_eq!(remote.location().to_string(), URL);
        assert_eq!(remote.list().unwrap(), listed, "{what}");
        let names: Vec<String> = listed.iter().map(|(n, _)| n.clone()).collect();
        for (i, (name, size)) in listed.iter().enumerate() {
            assert_eq!(remote.len(name).unwrap(), *size, "{what} {name}");
            assert_eq!(remote.get(name).unwrap(), local.get(name).unwrap());
            // Two ranges of each object, into one buffer, byte-exact.
            let half = size / 2;
            let ranges = [
                io::ReadRange {
                    file: i as u32,
                    offset: half,
                    len: size - half,
                    dst: 0,
                },
                io::ReadRange {
                    file: i as u32,
                    offset: 0,
                    len: half,
                    dst: size - half,
                },
            ];
            let mut a = vec![0u8; *size as usize];
            let mut b = vec![0u8; *size as usize];
            local
                .read_into(&names, &ranges, &mut a, &Stop::never())
                .unwrap();
            remote
                .read_into(&names, &ranges, &mut b, &Stop::never())
                .unwrap();
            assert_eq!(a, b, "{what} {name}");
        }
        assert!(remote.get_opt("missing").unwrap().is_none());
        let e = remote.get("missing").unwrap_err();
        assert!(e.to_string().contains("s3://bucket/data/missing"), "{e}");
        // A stopped read gives up.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let r = [io::ReadRange {
            file: 0,
            offset: 0,
            len: 1,
            dst: 0,
        }];
        let e = remote
            .read_into(&names, &r, &mut [0u8], &Stop::new(stop))
            .unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
    }
}

#[test]
fn a_saev_dataset_and_its_loader_read_the_same_bytes_from_any_store() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dir(tmp.path());
    let local = Dataset::open(&dir).unwrap();
    let layout = *local.layout();
    let opts = |order| {
        let mut o = LoaderOptions::new(LayerSel::Value(-3));
        o.order = order;
        o.batch_size = 8;
        o.seed = 5;
        o.rank = Some(0);
        o.world_size = Some(1);
        o
    };
    let batches = |l: Loader| -> Vec<(Vec<f32>, Vec<i64>)> {
        l.iter()
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                (b.act.as_f32().to_vec(), b.example_idx.clone())
            })
            .collect()
    };
    let want: Vec<_> = [Order::Block, Order::Exact]
        .into_iter()
        .map(|order| batches(Loader::new(&dir, opts(order)).unwrap()))
        .collect();
    for (what, store, _keep) in stores(&dir) {
        let remote =
            Dataset::open_source(io::open_store(URL, store.clone(), None).unwrap()).unwrap();
        assert_eq!(remote.path(), Path::new(URL));
        assert_eq!(*remote.layout(), layout, "{what}");
        assert!(remote.has_labels());
        for e in 0..layout.n_examples {
            for layer in [-3, 7] {
                for t in 0..layout.content_tokens {
                    assert_eq!(
                        remote.get(e, layer, t).unwrap(),
                        local.get(e, layer, t).unwrap(),
                        "{what} {e} {layer} {t}"
                    );
                }
            }
        }
        for e in 0..layout.n_examples {
            let (mut a, mut b) = (vec![0u8; 4], vec![0u8; 4]);
            assert!(remote.read_labels_into(e, &mut a).unwrap());
            local.read_labels_into(e, &mut b).unwrap();
            assert_eq!(a, b, "{what} labels of {e}");
        }
        let remote_store = remote;
        let mut remote = Some(remote_store);
        for (order, want) in [Order::Block, Order::Exact].into_iter().zip(&want) {
            let ds = match remote.take() {
                Some(ds) => ds,
                None => {
                    Dataset::open_source(io::open_store(URL, store.clone(), None).unwrap()).unwrap()
                }
            };
            let got = batches(Loader::with_dataset(ds, opts(order)).unwrap());
            assert_eq!(&got, want, "{what} {order:?}");
        }
    }
}

/// A sample's or a batch's fields: (name, bytes).
type Fields = Vec<(String, Vec<u8>)>;

fn eagle3_dir(root: &Path) -> std::path::PathBuf {
    use shardkit::eagle3::{Writer, WriterOptions};
    let cfg = shardkit::json::parse(
        br#"{"target_model": "m", "target_vocab_size": 100, "draft_vocab_size": 8,
        "seq_length": 6, "dtype": "bf16", "num_samples": 11, "shard_size": 4,
        "aux_hidden_dim": 12, "aux_layer_ids": [1, 3, 4], "selected_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "input_data": "data.jsonl", "split": null, "shuffle_seed": 42}"#,
    )
    .unwrap();
    let dir = root.join("eagle3");
    let mut w = Writer::create(&dir, &cfg, WriterOptions::default()).unwrap();
    let m = w.manifest().clone();
    for i in 0..m.num_samples {
        let fields = shardkit::eagle3::synthetic_sample(&m, i);
        let refs: Vec<(&str, &[u8])> = fields.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        w.add(1, &refs).unwrap();
    }
    let table: Vec<u8> = (0..10 * 4).flat_map(|x| (x as f32).to_le_bytes()).collect();
    w.write_target_embeddings(&table, 10, 4).unwrap();
    w.finish().unwrap();
    dir
}

#[test]
fn an_eagle3_cache_and_its_loader_read_the_same_bytes_from_any_store() {
    use shardkit::eagle3::{Cache, Loader, LoaderOptions};
    let tmp = tempfile::tempdir().unwrap();
    let dir = eagle3_dir(tmp.path());
    let local = Arc::new(Cache::open(&dir).unwrap());
    let fields = |c: &Cache, i: i64| -> Fields {
        let item = c.item(i).unwrap();
        c.fields(&item)
            .unwrap()
            .into_iter()
            .map(|f| (f.name.to_string(), f.bytes.to_vec()))
            .collect()
    };
    let batches = |c: Arc<Cache>| -> Vec<(Vec<u64>, Fields)> {
        let mut o = LoaderOptions::new(3);
        o.set_shuffle(true);
        o.seed = 9;
        Loader::new(c, o)
            .unwrap()
            .iter()
            .map(|b| {
                let b = b.unwrap();
                let f = b
                    .layout
                    .iter()
                    .map(|f| (format!("{f:?}"), b.data.field(f).to_vec()))
                    .collect();
                (b.indices.clone(), f)
            })
            .collect()
    };
    let want = batches(local.clone());
    for (what, store, _keep) in stores(&dir) {
        let remote = Cache::open_source(io::open_store(URL, store, None).unwrap(), 4).unwrap();
        assert_eq!(remote.manifest(), local.manifest(), "{what}");
        for i in 0..local.manifest().num_samples as i64 {
            assert_eq!(fields(&remote, i), fields(&local, i), "{what} sample {i}");
        }
        assert_eq!(
            remote.target_embeddings().unwrap().bytes(),
            local.target_embeddings().unwrap().bytes()
        );
        assert_eq!(batches(Arc::new(remote)), want, "{what}");
    }
}

#[test]
fn the_cache_wraps_a_store_and_serves_a_second_read_from_its_pages() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dir(tmp.path());
    let local = Dataset::open(&dir).unwrap();
    let mem = Arc::new(InMemory::new());
    upload(&dir, &*mem);
    let cached = io::open_store(URL, mem, Some(tmp.path().join("cache"))).unwrap();
    let ds = Dataset::open_source(cached).unwrap();
    let layout = *local.layout();
    let read_all = |ds: &Dataset| {
        for e in 0..layout.n_examples {
            for t in 0..layout.content_tokens {
                assert_eq!(ds.get(e, 7, t).unwrap(), local.get(e, 7, t).unwrap());
            }
        }
    };
    read_all(&ds);
    io::wait_for_cache().unwrap();
    let before = io::counters();
    read_all(&ds);
    let after = io::counters();
    assert_eq!(after.gets, before.gets, "every page was held");
    assert!(after.cache_read_bytes > before.cache_read_bytes);
}

/// What the wrapper store does to ranged reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// The body is one byte short.
    Cut,
    /// A server error (500, or 503 SlowDown once the client's own retries are spent).
    ServerError,
    /// No answer, ever (a read's timeout is the client's; its stop is the caller's).
    Hang,
}

/// A store that injects `fault` into its next `left` ranged reads.
#[derive(Debug)]
struct Faulty {
    inner: InMemory,
    fault: Fault,
    left: AtomicU64,
}

impl std::fmt::Display for Faulty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Faulty {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let ranged = options.range.is_some();
        let armed = ranged
            && self
                .left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if !armed {
            return self.inner.get_opts(location, options).await;
        }
        match self.fault {
            Fault::Hang => futures::future::pending().await,
            Fault::ServerError => Err(object_store::Error::Generic {
                store: "Faulty",
                source: "Server returned non-2xx status code: 500 Internal Server Error".into(),
            }),
            Fault::Cut => {
                let got = self.inner.get_opts(location, options).await?;
                let (meta, range, attributes) =
                    (got.meta.clone(), got.range.clone(), got.attributes.clone());
                let bytes = got.bytes().await?;
                let short = bytes.slice(..bytes.len().saturating_sub(1));
                Ok(GetResult {
                    payload: GetResultPayload::Stream(Box::pin(futures::stream::once(
                        async move { Ok(short) },
                    ))),
                    meta,
                    range: range.start..range.end - 1,
                    attributes,
                    extensions: Default::default(),
                })
            }
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn faulty(dir: &Path, fault: Fault, left: u64) -> Arc<Faulty> {
    let store = Arc::new(Faulty {
        inner: InMemory::new(),
        fault,
        left: AtomicU64::new(0),
    });
    upload(dir, &store.inner);
    store.left.store(left, Ordering::SeqCst);
    store
}

#[test]
fn short_bodies_are_retried_and_failures_name_the_object_and_the_range() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dir(tmp.path());
    let local = Dataset::open(&dir).unwrap();
    let want = local.get(3, 7, 2).unwrap();

    // A body cut short twice: retried, then served whole.
    let store = faulty(&dir, Fault::Cut, 2);
    let ds = Dataset::open_source(io::open_store(URL, store.clone(), None).unwrap()).unwrap();
    store.left.store(2, Ordering::SeqCst);
    assert_eq!(ds.get(3, 7, 2).unwrap(), want);
    assert_eq!(store.left.load(Ordering::SeqCst), 0);

    // Cut every time: the read fails, naming the object and the byte range.
    store.left.store(u64::MAX, Ordering::SeqCst);
    let e = ds.get(3, 7, 2).unwrap_err().to_string();
    assert!(e.contains("s3://bucket/data/acts"), "{e}");
    assert!(e.contains("bytes"), "{e}");
    assert!(e.contains("the server returned"), "{e}");

    // A server error the client gave up on: the error names the object and the range.
    let store = faulty(&dir, Fault::ServerError, 0);
    let ds = Dataset::open_source(io::open_store(URL, store.clone(), None).unwrap()).unwrap();
    store.left.store(1, Ordering::SeqCst);
    let e = ds.get(3, 7, 2).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("s3://bucket/data/acts"), "{text}");
    assert!(text.contains("500"), "{text}");
    assert!(
        matches!(e, shardkit::Error::Remote { range: Some(_), .. }),
        "{e:?}"
    );
    // The next read is served.
    assert_eq!(ds.get(3, 7, 2).unwrap(), want);
}

#[test]
fn a_read_of_a_store_that_never_answers_stops_when_its_stop_is_set() {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let dir = saev_dir(tmp.path());
    let store = faulty(&dir, Fault::Hang, u64::MAX);
    let source = io::open_store(URL, store, None).unwrap();
    let names: Vec<String> = vec!["acts000000.bin".into()];
    let ranges = vec![io::ReadRange {
        file: 0,
        offset: 0,
        len: 64,
        dst: 0,
    }];
    // A blocking read, stopped from another thread.
    let flag = Arc::new(AtomicBool::new(false));
    let setter = {
        let flag = flag.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            flag.store(true, Ordering::SeqCst);
        })
    };
    let t = Instant::now();
    let e = source
        .read_into(&names, &ranges, &mut [0u8; 64], &Stop::new(flag))
        .unwrap_err();
    setter.join().unwrap();
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // A read started and left running: its waiter gives up when told to.
    let flag = Arc::new(AtomicBool::new(false));
    let pending = source
        .start_read(
            Arc::new(names),
            ranges,
            shardkit::engine::Buffer::zeroed(64),
            &Stop::new(flag.clone()),
        )
        .unwrap();
    let t = Instant::now();
    let e = pending
        .wait(|| t.elapsed() > Duration::from_millis(200))
        .unwrap_err();
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
}
