//! A prefix in an object store and the requests made of it.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use super::cache::Cached;
use super::coalesce::{coalesce, Request, COALESCE_GAP};
use super::local::ReadRange;
use super::location::Location;
use super::runtime::{block_on, block_on_stopped, runtime, PendingRead};
use super::slots::{request_slots, slot_quarters, RequestSlots};
use super::source::Source;
use super::stop::stopped_error;
use super::stop::Stop;
use super::{cache, cache_dir, GETS, GET_BYTES, PUTS, PUT_BYTES};
use crate::config::max_request;
use crate::error::{Error, IoContext, Result};

/// Objects larger than this are uploaded in parts of this size.
pub(crate) const PART_SIZE: usize = 16 << 20;

/// A prefix in an object store: `s3://bucket/prefix`.
#[derive(Clone)]
pub(crate) struct Remote {
    pub(crate) bucket: String,
    /// Without leading or trailing slashes; may be empty.
    pub(crate) prefix: String,
    /// The client, and the process it was made in (0: a client given by the caller,
    /// [`Remote::with_store`], used in every process).
    pub(crate) client: (u32, Arc<dyn ObjectStore>),
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Remote({})", self.url())
    }
}

/// Stores the tests put in place of buckets (`internals::use_store`).
#[cfg(feature = "fault-injection")]
static TEST_STORES: Mutex<Vec<(String, Arc<dyn ObjectStore>)>> = Mutex::new(Vec::new());

/// Makes every `s3://bucket/...` of this process go to `store` (an in-memory one in tests),
/// writes included.
#[cfg(feature = "fault-injection")]
pub fn use_store(bucket: &str, store: Arc<dyn ObjectStore>) {
    let mut stores = TEST_STORES.lock().unwrap_or_else(|e| e.into_inner());
    stores.retain(|(b, _)| b != bucket);
    stores.push((bucket.to_string(), store));
}

/// The process's client of `bucket` (see the `s3` module).
fn client_for(bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    #[cfg(feature = "fault-injection")]
    {
        let stores = TEST_STORES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = stores.iter().find(|(b, _)| b == bucket) {
            return Ok(s.clone());
        }
    }
    client_of(bucket)
}

#[cfg(feature = "s3")]
fn client_of(bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    Ok(super::s3::store_for(bucket)?)
}

#[cfg(not(feature = "s3"))]
fn client_of(bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    Err(Error::Invalid(format!(
        "s3://{bucket}: this build of shardkit has no S3 support (cargo feature `s3`)"
    )))
}

/// The endpoint `bucket`'s client uses, in words.
fn endpoint_words(bucket: &str) -> String {
    #[cfg(feature = "s3")]
    return super::s3::endpoint_words(bucket);
    #[cfg(not(feature = "s3"))]
    {
        let _ = bucket;
        "the configured endpoint".into()
    }
}

/// Whether `e` is a failure to reach the endpoint at all (connection refused or reset, no
/// such host, a connect or request timeout) rather than an answer from the store.
fn unreachable(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    let mut text = String::new();
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            if matches!(
                io.kind(),
                K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::TimedOut
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::AddrNotAvailable
            ) {
                return true;
            }
        }
        text.push_str(&err.to_string().to_ascii_lowercase());
        text.push('\n');
        cur = err.source();
    }
    [
        "connection refused",
        "tcp connect error",
        "dns error",
        "failed to lookup address",
        "name or service not known",
        "no such host",
        "timed out",
        "connection reset",
        "error sending request",
    ]
    .iter()
    .any(|w| text.contains(w))
}

/// The refusal of `url`, a local path where a store's `s3://` URL is needed.
pub(crate) fn not_a_store(url: &Path) -> Error {
    Error::Invalid(format!(
        "{}: not an s3:// URL",
        url.to_str().unwrap_or_default()
    ))
}

/// Counts a PUT of `len` bytes done (and, with fault injection, may end the process after
/// it, as a kill there would).
fn put_done(len: u64) {
    PUTS.fetch_add(1, Ordering::Relaxed);
    PUT_BYTES.fetch_add(len, Ordering::Relaxed);
    #[cfg(feature = "fault-injection")]
    crate::fsutil::trace::abort_after_put();
}

impl Remote {
    /// Parses `s3://bucket/prefix` (a trailing slash is ignored).
    pub(crate) fn parse(url: &Path) -> Result<Remote> {
        let (bucket, prefix) = Remote::split_url(url)?;
        Ok(Remote {
            client: (std::process::id(), client_for(&bucket)?),
            bucket,
            prefix,
        })
    }

    /// `s3://bucket/prefix` read and written through `store` (any object store: an in-memory
    /// or local-filesystem one in tests), in every process.
    pub(crate) fn with_store(url: &Path, store: Arc<dyn ObjectStore>) -> Result<Remote> {
        let (bucket, prefix) = Remote::split_url(url)?;
        Ok(Remote {
            bucket,
            prefix,
            client: (0, store),
        })
    }

    /// The store prefix `location` names, read and written through this process's client (a
    /// local path is refused: [`not_a_store`]).
    pub(crate) fn from_location(location: &Location) -> Result<Remote> {
        match location {
            Location::S3 { bucket, prefix } => Ok(Remote {
                client: (std::process::id(), client_for(bucket)?),
                bucket: bucket.clone(),
                prefix: prefix.clone(),
            }),
            Location::Local(p) => Err(not_a_store(p)),
        }
    }

    /// The bucket and the prefix of `s3://bucket/prefix`, checked ([`Location::parse`]).
    fn split_url(url: &Path) -> Result<(String, String)> {
        match Location::parse(url)? {
            Location::S3 { bucket, prefix } => Ok((bucket, prefix)),
            Location::Local(_) => Err(not_a_store(url)),
        }
    }

    /// This prefix, read through the bounded local cache when `SHARDKIT_CACHE_DIR` is set
    /// ([`cache_dir`]; a [`Cached`] source): the pages of an object a read touches are fetched
    /// into the cache the first time, and served from there after (see the `cache` module).
    /// The saev, EAGLE-3 and flat-tokens readers use it; checksum verification and transfers
    /// read the store itself.
    pub(crate) fn with_object_cache(self) -> Arc<dyn Source> {
        match cache_dir() {
            Some(dir) => Arc::new(Cached::new(self, dir)),
            None => Arc::new(self),
        }
    }

    /// `s3://bucket/prefix`.
    pub(crate) fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    /// The URL of object `name` under this prefix, as a path (for errors and for callers).
    pub(crate) fn url_of(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("{}/{name}", self.url()))
    }

    /// The parent prefix and the last segment (`s3://b/a/m.sdnb` → `s3://b/a`, `m.sdnb`).
    pub(crate) fn split_last(&self) -> Result<(Remote, String)> {
        let (parent, name) = match self.prefix.rsplit_once('/') {
            Some((p, n)) => (p.to_string(), n.to_string()),
            None => (String::new(), self.prefix.clone()),
        };
        if name.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: names a bucket, not an object",
                self.url()
            )));
        }
        let mut p = self.clone();
        p.prefix = parent;
        Ok((p, name))
    }

    /// The prefix `name` below this one.
    pub(crate) fn join(&self, name: &str) -> Remote {
        let mut r = self.clone();
        r.prefix = if r.prefix.is_empty() {
            name.trim_matches('/').to_string()
        } else {
            format!("{}/{}", r.prefix, name.trim_matches('/'))
        };
        r
    }

    /// The client of this process (a dataset opened before a fork gets a new one in the child).
    pub(crate) fn store(&self) -> Result<Arc<dyn ObjectStore>> {
        match &self.client {
            (pid, store) if *pid == 0 || *pid == std::process::id() => Ok(store.clone()),
            _ => client_for(&self.bucket),
        }
    }

    pub(crate) fn key(&self, name: &str) -> ObjectPath {
        if self.prefix.is_empty() {
            ObjectPath::from(name)
        } else {
            ObjectPath::from(format!("{}/{name}", self.prefix))
        }
    }

    pub(crate) fn error(
        &self,
        name: &str,
        range: Option<Range<u64>>,
        e: object_store::Error,
    ) -> Error {
        let object = self.url_of(name);
        if let object_store::Error::NotFound { .. } = e {
            return Error::NotFound {
                path: object,
                what: "no such object".into(),
            };
        }
        let mut message = e.to_string();
        let metadata_service =
            message.contains("/latest/api/token") || message.contains("/latest/meta-data/iam/");
        if !metadata_service && unreachable(&e) {
            message = format!(
                "cannot reach {}: {message}. Check that the server is running and reachable; \
                 for an S3-compatible server (MinIO, Ceph, R2, ...) set AWS_ENDPOINT_URL (or \
                 AWS_ENDPOINT_URL_S3) to its URL, e.g. http://127.0.0.1:9000",
                endpoint_words(&self.bucket)
            );
        }
        if metadata_service {
            // object_store's last resort, which a machine outside a cloud fails slowly and
            // cryptically.
            message.push_str(
                " (no credentials were set, so they were asked of the instance metadata \
                 service, which failed: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
                 AWS_PROFILE, or AWS_SKIP_SIGNATURE=true to read a public bucket unsigned)",
            );
        }
        Error::Remote {
            object: object.display().to_string(),
            range,
            message,
        }
    }

    /// The whole of object `name`, or `None` when it does not exist.
    pub(crate) fn get_opt(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let got = self.get_tagged(name)?.map(|(b, _)| b);
        if let Some(b) = &got {
            GETS.fetch_add(1, Ordering::Relaxed);
            GET_BYTES.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        Ok(got)
    }

    /// Object `name` with its ETag, or `None` when it does not exist (not counted among the
    /// dataset's GETs: the store lock's reads; [`Remote::get_opt`] counts its own).
    pub(crate) fn get_tagged(&self, name: &str) -> Result<Option<(Vec<u8>, Option<String>)>> {
        let key = self.key(name);
        let store = self.store()?;
        let got = block_on(async {
            let r = store.get(&key).await?;
            let etag = r.meta.e_tag.clone();
            Ok::<_, object_store::Error>((r.bytes().await?, etag))
        })?;
        match got {
            Ok((b, etag)) => Ok(Some((b.to_vec(), etag))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(name, None, e)),
        }
    }

    /// Writes `bytes` as object `name` only if it is absent (`expect` `None`) or its ETag is
    /// still `expect`: the new ETag, or `None` when the condition failed. The store lock's
    /// writes: not counted among the dataset's PUTs.
    pub(crate) fn put_if(
        &self,
        name: &str,
        bytes: Vec<u8>,
        expect: Option<&str>,
    ) -> Result<Option<String>> {
        use object_store::{PutMode, UpdateVersion};
        let key = self.key(name);
        let store = self.store()?;
        let mode = match expect {
            None => PutMode::Create,
            Some(e) => PutMode::Update(UpdateVersion {
                e_tag: Some(e.to_string()),
                version: None,
            }),
        };
        match block_on(store.put_opts(&key, PutPayload::from(bytes), mode.into()))? {
            Ok(r) => r.e_tag.map(Some).ok_or_else(|| Error::Remote {
                object: self.url_of(name).display().to_string(),
                range: None,
                message: "the store gave no ETag for a conditional write".into(),
            }),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Ok(None),
            Err(e) => Err(self.error(name, None, e)),
        }
    }

    /// The whole of object `name`.
    pub(crate) fn get(&self, name: &str) -> Result<Vec<u8>> {
        self.get_opt(name)?.ok_or_else(|| Error::NotFound {
            path: self.url_of(name),
            what: "no such object".into(),
        })
    }

    /// Every object under this prefix: (name relative to it, size), sorted by name.
    pub(crate) fn list(&self) -> Result<Vec<(String, u64)>> {
        Ok(self
            .list_etags()?
            .into_iter()
            .map(|(n, size, _)| (n, size))
            .collect())
    }

    /// [`Remote::list`] with each object's ETag (quotes removed), where the store gives one.
    pub(crate) fn list_etags(&self) -> Result<Vec<(String, u64, Option<String>)>> {
        let prefix = (!self.prefix.is_empty()).then(|| ObjectPath::from(self.prefix.as_str()));
        let store = self.store()?;
        let metas = block_on(store.list(prefix.as_ref()).try_collect::<Vec<_>>())?
            .map_err(|e| self.error("", None, e))?;
        let skip = if self.prefix.is_empty() {
            0
        } else {
            self.prefix.len() + 1
        };
        let mut out: Vec<(String, u64, Option<String>)> = metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.as_ref().get(skip..)?.to_string();
                let etag = m.e_tag.map(|e| e.trim_matches('"').to_string());
                Some((name, m.size, etag))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Reads `ranges` of the objects `names[r.file]` into `buf` at `r.dst`: coalesced into
    /// requests of at most [`max_request`] bytes, [`inflight`] at a time. Destinations must lie
    /// inside `buf` and not overlap (checked before any request). Nobody stops the read (see
    /// [`Remote::read_into_until`]).
    pub(crate) fn read_into(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
    ) -> Result<()> {
        self.read_into_until(names, ranges, buf, &Stop::never())
    }

    /// [`Remote::read_into`], giving up once `stop` is set.
    pub(crate) fn read_into_until(
        &self,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: &Stop,
    ) -> Result<()> {
        self.check_reads(names.len(), ranges, buf.len())?;
        let store = self.store()?;
        let flag = stop.flag();
        let fetch = self.fetch_into(&store, names, ranges, buf, flag.as_deref());
        block_on_stopped(fetch, stop)
    }

    /// The size of object `name` (one HEAD request).
    pub(crate) fn len(&self, name: &str) -> Result<u64> {
        let store = self.store()?;
        let meta = block_on(store.head(&self.key(name)))?.map_err(|e| self.error(name, None, e))?;
        Ok(meta.size)
    }

    /// [`Remote::read_into`] started on the runtime and left running: the caller gets `buf`
    /// back, filled, from [`PendingRead::wait`]. A loader starts the next batch's requests this
    /// way while the previous batches are still in flight. Once `stop` is set, the read sends
    /// no further request (it ends with `stopped_error`).
    pub(crate) fn start_read(
        &self,
        names: Arc<Vec<String>>,
        ranges: Vec<ReadRange>,
        buf: crate::io::buffer::Buffer,
        stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<PendingRead> {
        self.check_reads(names.len(), &ranges, buf.len())?;
        self.start_paged(names, cache::Paged::direct(ranges), buf, stop)
    }

    /// Starts fetching what `paged` leaves (checked by the caller) on the runtime.
    pub(crate) fn start_paged(
        &self,
        names: Arc<Vec<String>>,
        paged: cache::Paged,
        mut buf: crate::io::buffer::Buffer,
        stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<PendingRead> {
        let me = self.clone();
        let store = self.store()?;
        let task = runtime()?.spawn(async move {
            me.fetch_paged(&store, &names, paged, buf.as_mut_bytes(), stop.as_deref())
                .await
                .map(|()| buf)
        });
        Ok(PendingRead(Mutex::new(Some(task))))
    }

    pub(crate) fn check_reads(
        &self,
        objects: usize,
        ranges: &[ReadRange],
        len: usize,
    ) -> Result<()> {
        super::local::check_destinations(ranges, len)?;
        if let Some(r) = ranges.iter().find(|r| r.file as usize >= objects) {
            return Err(Error::Internal(format!(
                "internal: read of object {} of {objects}",
                r.file
            )));
        }
        Ok(())
    }

    /// The requests of `ranges` (checked by the caller), [`inflight`] at a time, each response
    /// copied to its pieces' places in `buf`. Once `stop` is set no further request is sent:
    /// a closed loader's reads end with the requests already on the wire, not after the next
    /// stop poll.
    pub(crate) async fn fetch_into(
        &self,
        store: &dyn ObjectStore,
        names: &[String],
        ranges: &[ReadRange],
        buf: &mut [u8],
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<()> {
        use futures::future::{select, Either};
        use futures::FutureExt;
        let max = max_request();
        let requests = coalesce(ranges, COALESCE_GAP, max);
        let RequestSlots { slots, turn } = request_slots();
        let closed = |_| Error::Internal("internal: the request limiter was closed".into());
        let copy = |(req, bytes): (Request, bytes::Bytes), buf: &mut [u8]| {
            for p in &req.pieces {
                let from = (p.offset - req.start) as usize;
                buf[p.dst as usize..(p.dst + p.len) as usize]
                    .copy_from_slice(&bytes[from..from + p.len as usize]);
            }
        };
        let mut running = futures::stream::FuturesUnordered::new();
        // Only the read holding the turn waits for slots; the others wait for the turn.
        let my_turn = turn.lock().await;
        for req in requests {
            // A slot frees when a request ends, this read's (driven here) or another's.
            let quarters = slot_quarters(req.end - req.start, max);
            let slot = loop {
                let free = slots.clone().acquire_many_owned(quarters);
                futures::pin_mut!(free);
                if running.is_empty() {
                    break free.await.map_err(closed)?;
                }
                match select(free, running.next()).await {
                    Either::Left((slot, _)) => break slot.map_err(closed)?,
                    Either::Right((Some(done), _)) => copy(done?, buf),
                    Either::Right((None, _)) => {}
                }
            };
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return Err(stopped_error());
            }
            running.push(async move {
                let _slot = slot;
                let name = &names[req.file as usize];
                let bytes = self.get_range(store, name, req.start..req.end).await?;
                Ok::<_, Error>((req, bytes))
            });
        }
        // Poll once before handing the turn on, so this read's last request is sent before
        // the next read's first (it took its slot first). A wake-up this noop-waker poll
        // swallows is not lost: the queue of ready requests is drained on the next poll.
        if let Some(Some(done)) = running.next().now_or_never() {
            copy(done?, buf);
        }
        drop(my_turn);
        while let Some(done) = running.next().await {
            copy(done?, buf);
        }
        Ok(())
    }

    /// Reads `(object, offset, len, dst)` ranges of the objects `names[object]` into `buf`
    /// (see [`COALESCE_GAP`], [`max_request`], [`inflight`]).
    pub(crate) fn read_ranges(
        &self,
        names: &[String],
        ranges: &[(u32, u64, u64, u64)],
        buf: &mut [u8],
    ) -> Result<()> {
        let ranges = ReadRange::from_tuples(ranges);
        self.read_into(names, &ranges, buf)
    }

    /// Bytes `range` of `name`, retried (with backoff) while a response comes back short.
    pub(crate) async fn get_range(
        &self,
        store: &dyn ObjectStore,
        name: &str,
        range: Range<u64>,
    ) -> Result<bytes::Bytes> {
        let key = self.key(name);
        let want = range.end - range.start;
        let mut short = 0u32;
        loop {
            let b = store
                .get_range(&key, range.clone())
                .await
                .map_err(|e| self.error(name, Some(range.clone()), e))?;
            GETS.fetch_add(1, Ordering::Relaxed);
            GET_BYTES.fetch_add(b.len() as u64, Ordering::Relaxed);
            if b.len() as u64 == want {
                return Ok(b);
            }
            short += 1;
            if short > 5 {
                return Err(Error::Remote {
                    object: self.url_of(name).display().to_string(),
                    range: Some(range),
                    message: format!(
                        "the server returned {} of {want} bytes, {short} times; the object is \
                         shorter than the dataset says, or the connection keeps breaking",
                        b.len()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100 << short)).await;
        }
    }

    /// Writes `bytes` as object `name` (one PUT: it appears whole or not at all).
    pub(crate) fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let key = self.key(name);
        let n = bytes.len() as u64;
        let store = self.store()?;
        block_on(store.put(&key, PutPayload::from(bytes)))?
            .map_err(|e| self.error(name, None, e))?;
        put_done(n);
        Ok(())
    }

    /// Uploads `bytes` as object `name`: one PUT when small, else a multipart upload of
    /// [`PART_SIZE`] parts cut from `bytes` without copying (as [`Remote::put_file`] does from a
    /// file), so an object of any size goes up, its parts several at once.
    pub(crate) fn put_owned(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        if bytes.len() <= PART_SIZE {
            return self.put(name, bytes);
        }
        let len = bytes.len() as u64;
        let bytes = bytes::Bytes::from(bytes);
        let key = self.key(name);
        let store = self.store()?;
        block_on(async {
            let upload = store
                .put_multipart(&key)
                .await
                .map_err(|e| self.error(name, None, e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            for at in (0..bytes.len()).step_by(PART_SIZE) {
                if let Err(e) = w.wait_for_capacity(8).await {
                    return Err(self.error(name, None, e));
                }
                w.put(bytes.slice(at..(at + PART_SIZE).min(bytes.len())));
            }
            w.finish().await.map_err(|e| self.error(name, None, e))?;
            Ok(())
        })??;
        put_done(len);
        Ok(())
    }

    /// Uploads local file `path` as object `name`: one PUT when small, else a multipart
    /// upload, whose parts are retried and which the store publishes only when complete (an
    /// interrupted upload is aborted, or expires, and leaves no object).
    pub(crate) fn put_file(&self, name: &str, path: &Path) -> Result<()> {
        let len = std::fs::metadata(path).at(path)?.len();
        if len <= PART_SIZE as u64 {
            return self.put(name, std::fs::read(path).at(path)?);
        }
        let key = self.key(name);
        let file = std::fs::File::open(path).at(path)?;
        let store = self.store()?;
        block_on(async {
            let upload = store
                .put_multipart(&key)
                .await
                .map_err(|e| self.error(name, None, e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            let mut chunk = vec![0u8; PART_SIZE];
            let mut done = 0u64;
            while done < len {
                let n = ((len - done) as usize).min(PART_SIZE);
                let read = {
                    use std::os::unix::fs::FileExt;
                    file.read_exact_at(&mut chunk[..n], done).at(path)
                };
                if let Err(e) = read {
                    w.abort().await.ok();
                    return Err(e);
                }
                if let Err(e) = w.wait_for_capacity(8).await {
                    return Err(self.error(name, None, e));
                }
                w.write(&chunk[..n]);
                done += n as u64;
            }
            w.finish().await.map_err(|e| self.error(name, None, e))?;
            Ok(())
        })??;
        put_done(len);
        Ok(())
    }

    /// Deletes object `name` (absent already is fine).
    pub(crate) fn delete(&self, name: &str) -> Result<()> {
        let key = self.key(name);
        let store = self.store()?;
        match block_on(store.delete(&key))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(name, None, e)),
        }
    }
}
