//! In-memory object stores put in place of the bucket `s3://bucket`, for the tests that write
//! and read datasets through the store layer (threads as ranks).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

/// Puts `store` in place of `s3://bucket`, staging under `staging`, and hands it back.
pub fn install<S: ObjectStore>(staging: &Path, store: S) -> Arc<S> {
    std::env::set_var("SHARDKIT_STAGING_DIR", staging);
    let store = Arc::new(store);
    shardkit::internals::stores::use_store("bucket", store.clone());
    store
}

/// A fresh in-memory store in place of `s3://bucket`, staging under `staging`.
pub fn store(staging: &Path) -> Arc<InMemory> {
    install(staging, InMemory::new())
}

/// Every object under `prefix/` with its bytes, names relative to it.
pub fn objects(mem: &InMemory, prefix: &str) -> BTreeMap<String, Vec<u8>> {
    futures::executor::block_on(async {
        let metas: Vec<_> = mem
            .list(Some(&ObjectPath::from(prefix)))
            .try_collect()
            .await
            .unwrap();
        let mut out = BTreeMap::new();
        for m in metas {
            let bytes = mem.get(&m.location).await.unwrap().bytes().await.unwrap();
            out.insert(
                m.location.as_ref()[prefix.len() + 1..].to_string(),
                bytes.to_vec(),
            );
        }
        out
    })
}
