//! A container opens from any object store (in memory, local filesystem) with the same tensors
//! as from disk (moved from tests/io_stores.rs, whose helpers it copies).

use std::path::Path;
use std::sync::Arc;

use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::io::{self, Location};
use crate::sdnb::{self, DType, Format, Order, SaveOptions, TensorIn, VarType};

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

#[test]
fn an_sdnb_container_opens_from_any_store_with_the_same_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    // One small tensor, one past the inline limit (appended, fetched on first use), in each
    // container kind.
    let small: Vec<u8> = (0..24u8).collect();
    let big: Vec<u8> = (0..(3 << 20) / 4)
        .flat_map(|x: u32| x.to_le_bytes())
        .collect();
    let tensors = [
        TensorIn {
            name: "small".into(),
            var_type: VarType::Variable,
            dtype: DType::Float,
            shape: vec![2, 3],
            order: Order::C,
            bytes: &small,
        },
        TensorIn {
            name: "big".into(),
            var_type: VarType::Constant,
            dtype: DType::Int32,
            shape: vec![(3 << 20) / 4],
            order: Order::C,
            bytes: &big,
        },
    ];
    for (format, name) in [(Format::Sdnb, "m.sdnb"), (Format::Sdz, "m.sdz")] {
        let dir = tmp.path().join(name.replace('.', "_"));
        std::fs::create_dir_all(&dir).unwrap();
        let opts = SaveOptions {
            format,
            ..SaveOptions::default()
        };
        sdnb::save(&dir.join(name), &tensors, &opts).unwrap();
        let local = sdnb::open(dir.join(name)).unwrap();
        for (what, store, _keep) in stores(&dir) {
            let parent = io::open_store(URL, store, None).unwrap();
            let remote = sdnb::read::open_source(parent, name).unwrap();
            assert_eq!(remote.kind(), local.kind(), "{what} {name}");
            for t in ["small", "big"] {
                assert_eq!(
                    remote.tensor(t).unwrap().bytes,
                    local.tensor(t).unwrap().bytes,
                    "{what} {name} {t}"
                );
            }
        }
    }
}
