//! In-memory object stores put in place of the bucket `s3://bucket`, for the tests that write
//! and read datasets through the store layer (threads as ranks).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

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

/// Puts at `key` a lock of another machine's process, renewed now with a lease of `lease_s`.
pub fn plant_held_lock(mem: &InMemory, key: &str, lease_s: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let held = format!(
        "{{\"shardkit_lock\": 1, \"host\": \"elsewhere\", \"boot_id\": \"b\", \"pid\": 7, \
         \"token\": \"t\", \"renewed_unix\": {now}, \"lease_s\": {lease_s}}}"
    );
    let key = ObjectPath::from(key);
    futures::executor::block_on(mem.put(&key, PutPayload::from(held.into_bytes()))).unwrap();
}

/// What a [`Hooked`] store does before each request: `op` ("put", "get", "head", "delete",
/// "list" or "copy") on `path` (the object, the prefix or the copy's target; none for a
/// delete). An error fails the request.
pub trait Hook: std::fmt::Debug + Send + Sync + 'static {
    /// Called before the request; its error is the request's.
    fn before(&self, op: &'static str, path: Option<&ObjectPath>) -> object_store::Result<()>;
}

/// An in-memory store that calls its hook before each request (to log them, or to fail some
/// as a store answering an error would).
#[derive(Debug, Default)]
pub struct Hooked<H> {
    pub inner: InMemory,
    pub hook: H,
}

impl<H: Hook> Hooked<H> {
    /// An empty store calling `hook`.
    pub fn new(hook: H) -> Hooked<H> {
        Hooked {
            inner: InMemory::new(),
            hook,
        }
    }
}

impl<H> std::fmt::Display for Hooked<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hooked({})", self.inner)
    }
}

#[async_trait::async_trait]
impl<H: Hook> ObjectStore for Hooked<H> {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.hook.before("put", Some(location))?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.hook.before("put", Some(location))?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        let op = if options.head { "head" } else { "get" };
        self.hook.before(op, Some(location))?;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        match self.hook.before("delete", None) {
            Ok(()) => self.inner.delete_stream(locations),
            Err(e) => futures::stream::once(async { Err(e) }).boxed(),
        }
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        match self.hook.before("list", prefix) {
            Ok(()) => self.inner.list(prefix),
            Err(e) => futures::stream::once(async { Err(e) }).boxed(),
        }
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<object_store::ListResult> {
        self.hook.before("list", prefix)?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.hook.before("copy", Some(to))?;
        self.inner.copy_opts(from, to, options).await
    }
}
