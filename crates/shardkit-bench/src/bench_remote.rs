//! `shardkit bench remote`: loaders reading from an object store against the raw parallel-GET
//! ceiling of the same objects, measured in the same run.
//!
//! The datasets are synthetic (a ViT-L-shaped saev dataset, a flat-tokens dataset, an EAGLE-3
//! cache, an SDNB model), written locally once and uploaded under `--url` (skipped when already
//! there). The ceiling reads every object of a dataset whole, as ranged GETs of 1, 4 and 8 MiB
//! with as many in flight as the loader gets (the best of two rounds each; the best of all is
//! the ceiling); each loader then streams one epoch (or `--steps` steps). Figures per in-flight
//! setting and gather-thread count: GB/s, the ratio to the ceiling, and per batch the GETs
//! issued and the bytes they returned (the payload's bytes plus what coalescing read across
//! gaps). flat-tokens also gets a decode ceiling: its in-memory loader over the local copy in
//! page cache. saev also gets a layer ceiling: exactly the GETs its one-layer loaders issue
//! (each example's slab of that layer), raw; and a loader reading both layers. Each loader
//! entry also gives this process's CPU seconds per GB (per million tokens for flat-tokens)
//! and the cores it kept busy: on a shared machine the CPU cost holds still where rates move,
//! and against the thread count it shows whether added threads wait or get in each other's way.
//!
//! `saev-cache` reads the saev dataset through the local cache (`SHARDKIT_CACHE_DIR`): an
//! epoch without it and a cold one against the GET ceiling, warm ones against the same loader
//! over the local copy.
//!
//! `saev-write` times the saev writer streaming the same synthetic dataset to the store against
//! its two ceilings measured in the same run: writing it locally, and uploading the local copy
//! (`shardkit upload`: the same PUTs without the writing). Streaming overlaps the two, so the
//! ideal is the slower of them. Then `shardkit download` of the streamed dataset against the
//! GET ceiling of its objects.
//!
//! `--link-latency-ms` / `--link-conn-mbps` put a relay ([`crate::bench_link`]) between the
//! client and a loopback server, so that every response waits a round trip and each connection
//! streams at a bounded rate, as from a far store: the loaders are then measured where the
//! store, not the CPU they share with the server, sets the ceiling.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use shardkit::io::{self, counters, Location, Source, Stop};
use shardkit::json::{self, Escape, Value};
use shardkit::{download, upload};
use shardkit::{Error, Result};

use crate::bench::{num, ratio, same_bytes, thread_counts, tree_sha256};

/// `shardkit bench remote`.
#[derive(Args)]
pub struct RemoteBenchArgs {
    /// Where the benchmark datasets go: `s3://bucket/prefix` (endpoint and credentials from the
    /// AWS environment; `scripts/bench_remote` starts a loopback server and sets them).
    #[arg(long)]
    url: PathBuf,
    /// Local directory the datasets are written in before their upload.
    #[arg(long, default_value = "bench-data/remote")]
    dir: PathBuf,
    /// Size of each dataset, in MiB.
    #[arg(long, default_value_t = 512)]
    size_mib: u64,
    /// Requests in flight, comma-separated (each measured for the ceiling and every loader).
    #[arg(long, value_delimiter = ',', default_values_t = [8usize, 32, 64])]
    inflight: Vec<usize>,
    /// Gather threads of the loaders, comma-separated (default: 1, 2, 4, ... and the cores).
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Steps of the flat-tokens loader timed.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Only these datasets (saev, saev-cache, saev-write, tokens, tokens-write, eagle3, sdnb).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Memory budget of the saev loaders, in MiB (default: the loader's, 1 GiB): a window of
    /// blocks is a quarter of it, so a smaller budget means more, smaller windows per epoch.
    #[arg(long)]
    memory_budget_mib: Option<u64>,
    /// Reach the server through a relay (`bench link`, started here) that delays every response
    /// by this many milliseconds, as a far store does; the ceilings go through it too.
    #[arg(long)]
    link_latency_ms: Option<f64>,
    /// With the relay, pace each connection's responses to this many MB/s (a far store's rate
    /// per connection).
    #[arg(long)]
    link_conn_mbps: Option<f64>,
}

impl RemoteBenchArgs {
    /// `--memory-budget-mib` in bytes.
    fn memory_budget(&self) -> Option<u64> {
        self.memory_budget_mib.map(|m| m.saturating_mul(1 << 20))
    }
}

/// A store prefix, read without the local cache (the ceilings measure the store itself).
type Remote = std::sync::Arc<dyn Source>;

/// `url` checked to name a store prefix, as `s3://bucket/prefix`.
fn store_url(url: &std::path::Path) -> Result<String> {
    match Location::parse(url)? {
        l @ Location::S3 { .. } => Ok(l.to_string()),
        Location::Local(p) => Err(Error::Invalid(format!("{}: not an s3:// URL", p.display()))),
    }
}

/// The store prefix at `url`.
fn open_remote(url: &std::path::Path) -> Result<Remote> {
    io::open_uncached(&Location::parse(store_url(url)?)?)
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Every object under `remote`, read whole with ranged GETs: (GB/s, GETs, bytes).
fn get_ceiling(remote: &Remote, inflight: usize) -> Result<(f64, u64, u64)> {
    let objects = remote.list()?;
    let names: Vec<String> = objects.iter().map(|(n, _)| n.clone()).collect();
    let mut ranges = Vec::new();
    let mut dst = 0;
    for (i, (_, len)) in objects.iter().enumerate() {
        ranges.push((i as u32, 0u64, *len, dst));
        dst += len;
    }
    timed_read(remote, &names, &ranges, dst, inflight)
}

/// Reads `ranges` of `names` (`total` bytes) with `inflight` request slots, timed: the
/// rate in GB/s, and the GETs and bytes the store served.
fn timed_read(
    remote: &Remote,
    names: &[String],
    ranges: &[(u32, u64, u64, u64)],
    total: u64,
    inflight: usize,
) -> Result<(f64, u64, u64)> {
    let mut buf = vec![0u8; total as usize];
    io::set_inflight(inflight);
    let before = counters();
    let t0 = Instant::now();
    remote.read_ranges(names, ranges, &mut buf, &Stop::never())?;
    let secs = t0.elapsed().as_secs_f64();
    let after = counters();
    std::hint::black_box(&buf);
    Ok((
        gbps(total, secs),
        after.gets - before.gets,
        after.get_bytes - before.get_bytes,
    ))
}

/// Wall and CPU time of a run.
#[derive(Debug, Clone, Copy, Default)]
struct Took {
    secs: f64,
    /// This process's CPU seconds (every thread, user and system; a server's not counted).
    cpu_s: f64,
}

impl std::ops::Add for Took {
    type Output = Took;
    fn add(self, o: Took) -> Took {
        Took {
            secs: self.secs + o.secs,
            cpu_s: self.cpu_s + o.cpu_s,
        }
    }
}

/// Started before a run; [`Clock::took`] after it.
struct Clock(Instant, f64);

impl Clock {
    fn start() -> Clock {
        Clock(Instant::now(), crate::bench::cpu_seconds())
    }
    fn took(&self) -> Took {
        Took {
            secs: self.0.elapsed().as_secs_f64(),
            cpu_s: crate::bench::cpu_seconds() - self.1,
        }
    }
}

/// What a run cost this process's CPUs: seconds per GB of payload, which hold still on a busy
/// shared machine where the rate does not, and the cores kept busy on average. Against the
/// thread count, the two tell a loader that waits (fewer cores busy than threads) from one
/// whose threads get in each other's way (more CPU per byte as threads are added).
fn cpu_fields(took: Took, payload: u64) -> [(String, Value); 2] {
    [
        (
            "cpu_s_per_gb".into(),
            num(took.cpu_s / (payload.max(1) as f64 / 1e9)),
        ),
        ("cores_busy".into(), num(took.cpu_s / took.secs.max(1e-9))),
    ]
}

/// flat-tokens' CPU seconds per million tokens.
fn cpu_per_m_tokens(took: Took, tokens: u64) -> (String, Value) {
    (
        "cpu_s_per_m_tokens".into(),
        Value::float(took.cpu_s / (tokens.max(1) as f64 / 1e6), 5),
    )
}

/// One loader measurement's JSON: rate, ratio to the ceiling, per-batch requests, and CPU.
#[allow(clippy::too_many_arguments)]
fn loader_entry(
    what: &str,
    inflight: usize,
    threads: usize,
    payload: u64,
    took: Took,
    batches: u64,
    gets: u64,
    get_bytes: u64,
    ceiling: f64,
) -> Result<Value> {
    let rate = gbps(payload, took.secs);
    let per = |x: u64| num(x as f64 / batches.max(1) as f64);
    let mut fields = vec![
        ("loader".into(), Value::String(what.into())),
        (
            "inflight".into(),
            match inflight {
                0 => Value::String("one per thread".into()),
                n => Value::int(n as u64),
            },
        ),
        ("threads".into(), Value::int(threads as u64)),
        ("gbps".into(), num(rate)),
        (
            "ratio_to_ceiling".into(),
            num(ratio(&format!("{what} vs the GET ceiling"), rate, ceiling)?),
        ),
        ("batches".into(), Value::int(batches)),
        ("payload_bytes_per_batch".into(), per(payload)),
        ("gets_per_batch".into(), per(gets)),
        ("get_bytes_per_batch".into(), per(get_bytes)),
    ];
    fields.extend(cpu_fields(took, payload));
    Ok(Value::Object(fields))
}

/// A GET ceiling: (GB/s, GETs, bytes), per in-flight count and request size (MiB).
type Ceilings = Vec<(usize, u64, (f64, u64, u64))>;

/// Request sizes the GET ceiling is measured at: a store may serve smaller requests faster
/// (a loopback server on a few cores does), and the ceiling is the best the store gives.
const REQUEST_SWEEP_MIB: [u64; 3] = [1, 4, 8];

/// The GET ceiling of `remote`'s objects at each in-flight count and request size, each the
/// best of two rounds (the first pass over a store's objects can be slower than later ones).
fn ceilings(remote: &Remote, inflight: &[usize]) -> Result<Ceilings> {
    let mut out = Vec::new();
    for &n in inflight {
        for mib in REQUEST_SWEEP_MIB {
            io::set_max_request_mib(mib);
            let rounds = [get_ceiling(remote, n), get_ceiling(remote, n)];
            io::set_max_request_mib(0);
            let [a, b] = rounds;
            let (a, b) = (a?, b?);
            out.push((n, mib, if b.0 > a.0 { b } else { a }));
        }
    }
    Ok(out)
}

fn ceilings_json(c: &Ceilings) -> Value {
    Value::Array(
        c.iter()
            .map(|(n, mib, (rate, gets, bytes))| {
                Value::Object(vec![
                    ("inflight".into(), Value::int(*n as u64)),
                    ("request_mib".into(), Value::int(*mib)),
                    ("gbps".into(), num(*rate)),
                    ("gets".into(), Value::int(*gets)),
                    ("get_bytes".into(), Value::int(*bytes)),
                ])
            })
            .collect(),
    )
}

fn best(c: &Ceilings) -> f64 {
    c.iter().map(|(_, _, (r, _, _))| *r).fold(0.0, f64::max)
}

/// The synthetic saev dataset (two ViT-L layers), written locally and uploaded once: its local
/// path, its URL and its bytes.
fn saev_dataset(a: &RemoteBenchArgs) -> Result<(PathBuf, PathBuf, u64)> {
    let example = 2 * 257 * 1024 * 4u64;
    let examples = ((a.size_mib << 20) / example).max(8);
    let mut args = crate::bench::vit_l(a.dir.join("saev"), examples, true);
    // Shards of 8 examples (17 MiB): a loopback server that reads a whole object per ranged
    // GET (moto does) then costs per request about what a real store does.
    args.budget = Some(8 * 2 * 257);
    let local = crate::saev_cmd::synth(&args)?;
    let name = local
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let url = PathBuf::from(format!("{}/saev/{name}", store_url(&a.url)?));
    upload(&local, &url, |_, _| {})?;
    Ok((local, url, examples * example))
}

/// The saev loader timed here over `path`: batches of 4096 rows of layer -1 of 2, or both.
fn saev_loader(
    a: &RemoteBenchArgs,
    path: &std::path::Path,
    layer: shardkit::saev::LayerSel,
    order: shardkit::engine::Order,
    threads: usize,
) -> Result<shardkit::saev::Loader> {
    let mut o = shardkit::saev::LoaderOptions::new(layer);
    o.batch_size = 4096;
    o.order = order;
    o.seed = 1;
    o.threads = threads;
    o.memory_budget = a.memory_budget();
    shardkit::saev::Loader::new(path, o)
}

/// A timed epoch: (payload bytes, time, batches, GETs, GET bytes).
type Epoch = (u64, Took, u64, u64, u64);

/// Epoch `epoch` of `loader`, timed.
fn timed_epoch(loader: &mut shardkit::saev::Loader, epoch: u64) -> Result<Epoch> {
    loader.set_epoch(epoch)?;
    let before = counters();
    let clock = Clock::start();
    let (mut payload, mut batches) = (0u64, 0u64);
    for b in loader.iter()? {
        let b = b?;
        payload += (b.n * b.d_model * 4) as u64;
        batches += 1;
    }
    let took = clock.took();
    let after = counters();
    Ok((
        payload,
        took,
        batches,
        after.gets - before.gets,
        after.get_bytes - before.get_bytes,
    ))
}

/// Epochs 1 to [`WARM_EPOCHS`] of `loader`, timed and added up.
fn warm_epochs(loader: &mut shardkit::saev::Loader) -> Result<Epoch> {
    let mut t: Epoch = (0, Took::default(), 0, 0, 0);
    for epoch in 1..=WARM_EPOCHS {
        let e = timed_epoch(loader, epoch)?;
        t = (t.0 + e.0, t.1 + e.1, t.2 + e.2, t.3 + e.3, t.4 + e.4);
    }
    Ok(t)
}

fn saev(a: &RemoteBenchArgs, threads: &[usize]) -> Result<Value> {
    use shardkit::engine::Order;
    use shardkit::saev::LayerSel;
    let (_, url, dataset_bytes) = saev_dataset(a)?;
    let remote = open_remote(&url)?;
    let ceilings = ceilings(&remote, &a.inflight)?;
    let ceiling = best(&ceilings);
    // The same client issuing exactly the GETs a one-layer loader needs (each example's slab
    // of that layer, coalesced as the loader's reads are): what the store gives this layout.
    let layout = *shardkit::saev::Dataset::open(&url)?.layout();
    let layer_ceilings: Ceilings = a
        .inflight
        .iter()
        .map(|&n| {
            let mib = io::max_request() >> 20;
            Ok((n, mib, layer_get_ceiling(&remote, &layout, 1, n)?))
        })
        .collect::<Result<_>>()?;
    let layer_ceiling = best(&layer_ceilings);
    let mut loaders = Vec::new();
    for (what, order, layer) in [
        ("block", Order::Block, LayerSel::Value(-1)),
        ("sequential", Order::Sequential, LayerSel::Value(-1)),
        ("block", Order::Block, LayerSel::All),
    ] {
        for &n in &a.inflight {
            for &t in threads {
                io::set_inflight(n);
                let (payload, took, batches, gets, get_bytes) =
                    timed_epoch(&mut saev_loader(a, &url, layer, order, t)?, 0)?;
                let one_layer = layer != LayerSel::All;
                let mut e = loader_entry(
                    &if one_layer {
                        format!("saev {what}, layer -1 of 2")
                    } else {
                        format!("saev {what}, both layers")
                    },
                    n,
                    t,
                    payload,
                    took,
                    batches,
                    gets,
                    get_bytes,
                    ceiling,
                )?;
                if let (true, Value::Object(m)) = (one_layer, &mut e) {
                    let rate = gbps(payload, took.secs);
                    m.push((
                        "ratio_to_layer_ceiling".into(),
                        num(ratio("one layer vs its GET ceiling", rate, layer_ceiling)?),
                    ));
                }
                loaders.push(e);
            }
        }
    }
    let budget = a
        .memory_budget()
        .unwrap_or(shardkit::saev::DEFAULT_MEMORY_BUDGET);
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("dataset_bytes".into(), Value::int(dataset_bytes)),
        ("memory_budget_bytes".into(), Value::int(budget)),
        ("get_ceiling".into(), ceilings_json(&ceilings)),
        ("layer_get_ceiling".into(), ceilings_json(&layer_ceilings)),
        ("loaders".into(), Value::Array(loaders)),
        (
            "note".into(),
            Value::String(
                "a one-layer loader reads one of the two layers (half of each example), so its \
                 GETs are the 1 MiB slabs of that layer, each between two of the other's; \
                 get_ceiling reads every byte in 8 MiB requests, layer_get_ceiling issues \
                 exactly the one-layer GETs (ratio_to_layer_ceiling)"
                    .into(),
            ),
        ),
    ]))
}

/// saev through the local cache (`SHARDKIT_CACHE_DIR`), at each thread count: an epoch without
/// the cache; with a fresh cache, a cold epoch, which fetches and keeps the pages it touches,
/// against the GET ceiling; then [`WARM_EPOCHS`] served from the cache by the same loader,
/// against a loader over the local copy (its first epoch unmeasured), both from the OS page
/// cache.
fn saev_cache(a: &RemoteBenchArgs, threads: &[usize]) -> Result<Value> {
    use shardkit::engine::Order;
    use shardkit::saev::LayerSel;
    let (local, url, dataset_bytes) = saev_dataset(a)?;
    let inflight = io::inflight();
    let ceiling = best(&ceilings(&open_remote(&url)?, &[inflight])?);
    let layer = LayerSel::Value(-1);
    let mut loaders = Vec::new();
    for &t in threads {
        let mut on_disk = saev_loader(a, &local, layer, Order::Block, t)?;
        timed_epoch(&mut on_disk, 0)?;
        let warm_local = warm_epochs(&mut on_disk)?;
        let local_rate = gbps(warm_local.0, warm_local.1.secs);
        std::env::remove_var("SHARDKIT_CACHE_DIR");
        let uncached = timed_epoch(&mut saev_loader(a, &url, layer, Order::Block, t)?, 0)?;
        let dir = a.dir.join(format!("object-cache-{t}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::env::set_var("SHARDKIT_CACHE_DIR", &dir);
        let epochs = saev_loader(a, &url, layer, Order::Block, t).and_then(|mut l| {
            let cold = timed_epoch(&mut l, 0)?;
            io::wait_for_cache()?;
            Ok((cold, warm_epochs(&mut l)?))
        });
        std::env::remove_var("SHARDKIT_CACHE_DIR");
        let held = tree_bytes(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let (cold, warm) = epochs?;
        for (what, (payload, took, batches, gets, get_bytes), against) in [
            ("no cache", uncached, ceiling),
            ("cold cache", cold, ceiling),
            ("warm cache", warm, local_rate),
        ] {
            let mut e = loader_entry(
                &format!("saev block, layer -1 of 2, {what}"),
                inflight,
                t,
                payload,
                took,
                batches,
                gets,
                get_bytes,
                against,
            )?;
            if let (Value::Object(m), false) = (&mut e, what == "no cache") {
                m.push(("cache_bytes".into(), Value::int(held)));
            }
            loaders.push(e);
        }
        loaders.push(Value::Object(vec![
            (
                "loader".into(),
                Value::String("saev block, layer -1 of 2, local copy".into()),
            ),
            ("threads".into(), Value::int(t as u64)),
            ("gbps".into(), num(local_rate)),
        ]));
    }
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("dataset_bytes".into(), Value::int(dataset_bytes)),
        ("get_ceiling_gbps".into(), num(ceiling)),
        ("loaders".into(), Value::Array(loaders)),
        (
            "note".into(),
            Value::String(format!(
                "the no-cache epoch reads the store as without SHARDKIT_CACHE_DIR; each thread \
                 count then starts from an empty cache; the cold epoch fetches whole \
                 pages (both layers' bytes) and its ratio is to the GET ceiling; the warm figure \
                 is epochs 1 to {WARM_EPOCHS} of the same loader, its ratio to a loader over \
                 the local copy (epochs 1 to {WARM_EPOCHS}, after one unmeasured); cache_bytes \
                 is what the cache held after them"
            )),
        ),
    ]))
}

/// Epochs timed from a warm cache (and from the local copy).
const WARM_EPOCHS: u64 = 2;

/// Bytes of the files under `dir`.
fn tree_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => tree_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// The GETs of one layer's content tokens (`slot`) of every example, raw, at `inflight`:
/// (GB/s, GETs, bytes).
fn layer_get_ceiling(
    remote: &Remote,
    layout: &shardkit::saev::Layout,
    slot: u64,
    inflight: usize,
) -> Result<(f64, u64, u64)> {
    // The on-disk layout (docs/saev.md): shard `acts{s:06}.bin` holds examples
    // `s*eps..(s+1)*eps`, each `(L, T, D)` float32, C order.
    let names: Vec<String> = (0..layout.n_shards)
        .map(|s| format!("acts{s:06}.bin"))
        .collect();
    let l = layout;
    let first = u64::from(l.cls);
    let vector = l.d_model * 4;
    let len = l.content_tokens * vector;
    let mut ranges = Vec::new();
    let mut dst = 0;
    for g in 0..l.n_examples {
        let (shard, row) = (g / l.examples_per_shard, g % l.examples_per_shard);
        let offset = ((row * l.n_layers + slot) * l.tokens + first) * vector;
        ranges.push((shard as u32, offset, len, dst));
        dst += len;
    }
    timed_read(remote, &names, &ranges, dst, inflight)
}

fn tokens(a: &RemoteBenchArgs, threads: &[usize]) -> Result<Value> {
    use shardkit::flat_tokens::{Layout, LoaderOptions, Split, TokenLoader};
    let local = a.dir.join("tokens");
    crate::bench_tokens::ensure_dataset(&local, Layout::default(), (a.size_mib << 20) / 4)?;
    let url = PathBuf::from(format!("{}/tokens", store_url(&a.url)?));
    upload(&local, &url, |_, _| {})?;
    let remote = open_remote(&url)?;
    let ceilings = ceilings(&remote, &a.inflight)?;
    let ceiling = best(&ceilings);
    let stored: u64 = remote.list()?.iter().map(|(_, n)| n).sum();
    let total_tokens = Split::open(&url, "train")?.info().token_count.max(1);
    // The decode ceiling: the same in-memory loader over the local copy, warm in the page
    // cache (reading costs a copy; decoding the zstd inner chunks is the work), per thread count.
    let mut decode = Vec::new();
    for &t in threads {
        let mut o = LoaderOptions::new(2048, 16);
        o.threads = t;
        o.seed = 1;
        o.buffer_in_memory = Some(true);
        let loader = TokenLoader::new(Split::open(&local, "train")?, o.clone())?;
        for b in loader.iter(0).take(1) {
            b?;
        }
        let loader = TokenLoader::new(Split::open(&local, "train")?, o)?;
        let clock = Clock::start();
        let mut tokens = 0u64;
        for b in loader.iter(0) {
            tokens += b?.arrays().encoded.len() as u64;
        }
        let took = clock.took();
        let payload = (tokens as f64 * stored as f64 / total_tokens as f64) as u64;
        let mut entry = vec![
            ("threads".into(), Value::int(t as u64)),
            ("gbps".into(), num(gbps(payload, took.secs))),
            ("tokens_per_s".into(), num(tokens as f64 / took.secs)),
            cpu_per_m_tokens(took, tokens),
        ];
        entry.extend(cpu_fields(took, payload));
        decode.push(Value::Object(entry));
    }
    let mut loaders = Vec::new();
    // Row by row (one zarrs read per row), then with each shuffle buffer read whole into
    // memory; the latter over a whole epoch, since a buffer's read is spread over its steps:
    // with seqax's default buffers (one minipoch here), and with four minipochs, each
    // minipoch's buffer read while the one before is served.
    let blocks = TokenLoader::new(Split::open(&url, "train")?, LoaderOptions::new(2048, 16))?
        .info()
        .read_blocks;
    for (in_memory, minipochs) in [(false, 1), (true, 1), (true, 4)] {
        for &t in threads {
            let split = Split::open(&url, "train")?;
            let mut o = LoaderOptions::new(2048, 16);
            if minipochs > 1 {
                o.read_blocks_per_shuffle_buffer = blocks.div_ceil(minipochs).max(1);
            }
            // Row by row, gather threads are the requests in flight (zarrs reads block): the
            // sweep's thread counts times 16. In memory, the threads decode.
            o.threads = if in_memory { t } else { t * 16 };
            o.seed = 1;
            o.buffer_in_memory = Some(in_memory);
            let gather_threads = o.threads;
            let loader = TokenLoader::new(split, o)?;
            let steps = if in_memory {
                loader.info().step_count
            } else {
                a.steps.min(loader.info().step_count)
            };
            let before = counters();
            let clock = Clock::start();
            let mut tokens = 0u64;
            // In memory, the first batch waits for its whole shuffle buffer: that wait, and the
            // bytes fetched, give the buffer's read rate.
            let mut first = None;
            for b in loader.iter(0).take(steps as usize) {
                tokens += b?.arrays().encoded.len() as u64;
                first.get_or_insert_with(|| (clock.took().secs, counters()));
            }
            let took = clock.took();
            let after = counters();
            // Payload as stored bytes: tokens times the dataset's compressed bytes per token.
            let payload = (tokens as f64 * stored as f64 / total_tokens as f64) as u64;
            let name = match (in_memory, loader.info().minipochs) {
                (false, _) => "flat-tokens packed, 16 x 2048, row by row (stored bytes)".into(),
                (true, m) => format!(
                    "flat-tokens packed, 16 x 2048, shuffle buffers in memory, one epoch of {m} \
                     minipoch(s) (stored bytes)"
                ),
            };
            let mut e = loader_entry(
                &name,
                // In memory, each shard's request list runs `inflight` requests at a time.
                if in_memory { io::inflight() } else { 0 },
                gather_threads,
                payload,
                took,
                steps,
                after.gets - before.gets,
                after.get_bytes - before.get_bytes,
                ceiling,
            )?;
            if let Value::Object(m) = &mut e {
                m.push(("tokens_per_s".into(), num(tokens as f64 / took.secs)));
                m.push(cpu_per_m_tokens(took, tokens));
                if let (true, Some((s, c))) = (in_memory, first) {
                    let fetched = c.get_bytes - before.get_bytes;
                    m.push(("first_batch_s".into(), num(s)));
                    m.push(("first_batch_get_bytes".into(), Value::int(fetched)));
                    m.push(("first_batch_gbps".into(), num(gbps(fetched, s))));
                    m.push((
                        "first_batch_ratio_to_ceiling".into(),
                        num(ratio(
                            "first batch vs the GET ceiling",
                            gbps(fetched, s),
                            ceiling,
                        )?),
                    ));
                }
            }
            loaders.push(e);
        }
    }
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("stored_bytes".into(), Value::int(stored)),
        ("get_ceiling".into(), ceilings_json(&ceilings)),
        ("decode_ceiling".into(), Value::Array(decode)),
        ("loaders".into(), Value::Array(loaders)),
    ]))
}

fn eagle3(a: &RemoteBenchArgs, threads: &[usize]) -> Result<Value> {
    use shardkit::eagle3::{Cache, Loader, LoaderOptions};
    // 512 tokens, H = 1024, a draft vocabulary of 8192, bf16: about 11.6 MiB per sample.
    let sample_bytes = 512 * 25 + 512 * 3072 * 2 + 512 * 8192 * 2u64;
    let samples = ((a.size_mib << 20) / sample_bytes).max(4);
    let synth = crate::eagle3_cmd::SynthArgs {
        out: a.dir.join("eagle3"),
        samples,
        shard_size: 2,
        seq_length: 512,
        hidden: 1024,
        draft_vocab: 8192,
        dtype: "bf16".into(),
        topk: None,
        version: 2,
        resume: false,
    };
    let reuse = Cache::open(&synth.out).is_ok_and(|c| c.manifest().num_samples == samples);
    if !reuse {
        if synth.out.exists() {
            std::fs::remove_dir_all(&synth.out).map_err(|e| shardkit::Error::io(&synth.out, e))?;
        }
        crate::eagle3_cmd::synth_cache(&synth)?;
    }
    let url = PathBuf::from(format!("{}/eagle3", store_url(&a.url)?));
    upload(&synth.out, &url, |_, _| {})?;
    let remote = open_remote(&url)?;
    let ceilings = ceilings(&remote, &a.inflight)?;
    let ceiling = best(&ceilings);
    let mut loaders = Vec::new();
    for &n in &a.inflight {
        for &t in threads {
            io::set_inflight(n);
            let cache = std::sync::Arc::new(Cache::open(&url)?);
            let mut o = LoaderOptions::new(2);
            o.threads = t;
            let loader = Loader::new(cache, o)?;
            let before = counters();
            let clock = Clock::start();
            let (mut payload, mut batches) = (0u64, 0u64);
            for b in loader.iter() {
                let b = b?;
                payload += b.data.len() as u64;
                batches += 1;
            }
            let took = clock.took();
            let after = counters();
            loaders.push(loader_entry(
                "eagle3 shuffled, 2 samples per batch",
                n,
                t,
                payload,
                took,
                batches,
                after.gets - before.gets,
                after.get_bytes - before.get_bytes,
                ceiling,
            )?);
        }
    }
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("samples".into(), Value::int(samples)),
        ("get_ceiling".into(), ceilings_json(&ceilings)),
        ("loaders".into(), Value::Array(loaders)),
    ]))
}

/// An SDNB model of 16 MiB float tensors read by range: opening (bytes fetched), then every
/// tensor, one after another and from `threads` threads at once, against the GET ceiling.
fn sdnb(a: &RemoteBenchArgs, threads: &[usize]) -> Result<Value> {
    use shardkit::sdnb::{self, DType, Order, SaveOptions, TensorIn, VarType};
    const TENSOR: usize = 16 << 20;
    let count = ((a.size_mib << 20) as usize / TENSOR).max(2);
    let local = a.dir.join("model.sdnb");
    let want_size = (count * TENSOR) as u64;
    // Written again unless it holds `count` tensors (its header and alignment add far less
    // than a tensor): the figures are for the size asked for.
    let fits = |len: u64| (want_size..want_size + TENSOR as u64).contains(&len);
    if std::fs::metadata(&local).map_or(true, |m| !fits(m.len())) {
        std::fs::create_dir_all(&a.dir).map_err(|e| shardkit::Error::io(&a.dir, e))?;
        let data: Vec<Vec<u8>> = (0..count)
            .map(|i| (0..TENSOR).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let names: Vec<String> = (0..count).map(|i| format!("layer{i}.weight")).collect();
        let tensors: Vec<TensorIn> = (0..count)
            .map(|i| TensorIn {
                name: names[i].clone(),
                var_type: VarType::Variable,
                dtype: DType::Float,
                shape: vec![(TENSOR / 4) as i64],
                order: Order::C,
                bytes: &data[i],
            })
            .collect();
        sdnb::save(&local, &tensors, &SaveOptions::default())?;
    }
    let prefix = store_url(&a.url)?;
    let url = PathBuf::from(format!("{prefix}/sdnb/model.sdnb"));
    upload(&local, &url, |_, _| {})?;
    let remote = open_remote(&PathBuf::from(format!("{prefix}/sdnb")))?;
    let ceilings = ceilings(&remote, &a.inflight)?;
    let ceiling = best(&ceilings);
    let mut reads = Vec::new();
    for &n in &a.inflight {
        io::set_inflight(n);
        for &t in threads {
            let before = counters();
            let clock = Clock::start();
            let c = sdnb::open(&url)?;
            let opened = counters();
            let open_secs = clock.took().secs;
            let names: Vec<String> = c.variables().iter().map(|v| v.name.clone()).collect();
            // Thread k reads tensors k, k + t, k + 2t, ...
            let per_thread: Vec<Result<u64>> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..t.max(1))
                    .map(|k| {
                        let (c, names) = (&c, &names);
                        scope.spawn(move || {
                            let mut n = 0u64;
                            for name in names.iter().skip(k).step_by(t.max(1)) {
                                n += std::hint::black_box(c.tensor(name)?.bytes).len() as u64;
                            }
                            Ok(n)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(shardkit::Error::Internal("a reader thread panicked".into()))
                        })
                    })
                    .collect()
            });
            let bytes = per_thread.into_iter().sum::<Result<u64>>()?;
            let took = clock.took();
            let after = counters();
            let mut e = loader_entry(
                "sdnb: open, then every tensor (threads read tensors at once)",
                n,
                t,
                bytes,
                took,
                names.len() as u64,
                after.gets - before.gets,
                after.get_bytes - before.get_bytes,
                ceiling,
            )?;
            if let Value::Object(m) = &mut e {
                m.push(("open_s".into(), num(open_secs)));
                m.push((
                    "open_get_bytes".into(),
                    Value::int(opened.get_bytes - before.get_bytes),
                ));
            }
            reads.push(e);
        }
        // One reader that asks for every tensor at once first (`Container::prefetch`).
        let before = counters();
        let clock = Clock::start();
        let c = sdnb::open(&url)?;
        c.prefetch::<&str>(&[])?;
        let mut bytes = 0u64;
        for v in c.variables() {
            bytes += std::hint::black_box(c.tensor(&v.name)?.bytes).len() as u64;
        }
        let took = clock.took();
        let after = counters();
        reads.push(loader_entry(
            "sdnb: open, prefetch every tensor, then read them (one thread)",
            n,
            1,
            bytes,
            took,
            c.variables().len() as u64,
            after.gets - before.gets,
            after.get_bytes - before.get_bytes,
            ceiling,
        )?);
    }
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("tensors".into(), Value::int(count as u64)),
        ("tensor_bytes".into(), Value::int(TENSOR as u64)),
        ("get_ceiling".into(), ceilings_json(&ceilings)),
        ("reads".into(), Value::Array(reads)),
    ]))
}

/// `shardkit bench remote`.
/// The saev writer streaming to the store, against writing locally and uploading a local copy.
fn saev_write(a: &RemoteBenchArgs) -> Result<Value> {
    let example = 2 * 257 * 1024 * 4u64;
    let examples = ((a.size_mib << 20) / example).max(8);
    let bytes = examples * example;
    // Fresh names each run: every write below starts from nothing.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let base = store_url(&a.url)?;
    let synth_to = |out: PathBuf| -> Result<(PathBuf, f64)> {
        let mut args = crate::bench::vit_l(out, examples, true);
        args.budget = Some(8 * 2 * 257); // shards of 8 examples (17 MiB), as `saev` reads
        let t0 = Instant::now();
        let path = crate::saev_cmd::synth(&args)?;
        Ok((path, t0.elapsed().as_secs_f64()))
    };
    let local_root = a.dir.join(format!("saev-write-{run}"));
    let (local, local_s) = synth_to(local_root.clone())?;
    let before = counters();
    let t0 = Instant::now();
    upload(
        &local,
        &PathBuf::from(format!("{base}/saev-upload-{run}")),
        |_, _| {},
    )?;
    let upload_s = t0.elapsed().as_secs_f64();
    let upload_puts = counters().puts - before.puts;
    // What the streamed write must produce too (its download is compared below).
    let local_sha = tree_sha256(&local)?;
    let _ = std::fs::remove_dir_all(&local_root);
    let before = counters();
    let (url, streamed_s) = synth_to(PathBuf::from(format!("{base}/saev-streamed-{run}")))?;
    let after = counters();
    let ideal = gbps(bytes, local_s).min(gbps(bytes, upload_s));
    let rate = gbps(bytes, streamed_s);
    // And back: `shardkit download` against the GET ceiling of the same objects.
    let remote = open_remote(&url)?;
    let (get_ceiling, _, _) = get_ceiling(&remote, io::inflight())?;
    let t0 = Instant::now();
    download(&url, &local_root, |_, _| {})?;
    let download_s = t0.elapsed().as_secs_f64();
    // The streamed dataset, downloaded, is the locally written one, file for file.
    let streamed_sha = tree_sha256(&local_root);
    let _ = std::fs::remove_dir_all(&local_root);
    same_bytes(
        "the streamed saev write (downloaded)",
        "the dataset's files",
        &local_sha,
        Some(&streamed_sha?),
    )?;
    Ok(Value::Object(vec![
        ("url".into(), Value::String(url.display().to_string())),
        ("dataset_bytes".into(), Value::int(bytes)),
        ("local_write_gbps".into(), num(gbps(bytes, local_s))),
        ("upload_gbps".into(), num(gbps(bytes, upload_s))),
        ("upload_puts".into(), Value::int(upload_puts)),
        ("streamed_write_gbps".into(), num(rate)),
        ("streamed_puts".into(), Value::int(after.puts - before.puts)),
        (
            "streamed_put_bytes".into(),
            Value::int(after.put_bytes - before.put_bytes),
        ),
        (
            "ratio_to_ideal".into(),
            num(ratio("streamed write vs write-then-upload", rate, ideal)?),
        ),
        ("download_gbps".into(), num(gbps(bytes, download_s))),
        ("get_ceiling_gbps".into(), num(get_ceiling)),
        (
            "download_ratio_to_get_ceiling".into(),
            num(ratio(
                "download vs the GET ceiling",
                gbps(bytes, download_s),
                get_ceiling,
            )?),
        ),
        (
            "note".into(),
            Value::String(
                "ideal: the slower of writing locally and uploading the local copy; the \
                 streamed write does both, overlapped (multipart parts count as one PUT per \
                 object; the streamed write also PUTs the upload journal after each shard)"
                    .into(),
            ),
        ),
    ]))
}

/// The flat-tokens writer streaming to the store (a commit, and so an upload, every shard's
/// worth of tokens), against writing locally and uploading the local copy.
fn tokens_write(a: &RemoteBenchArgs) -> Result<Value> {
    use shardkit::flat_tokens::Layout;
    let tokens = (a.size_mib << 20) / 4;
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let base = store_url(&a.url)?;
    let checkpoint = 1 << 24;
    // Generating the sequences is left out of each rate (the writer reports its own).
    let write = |root: &std::path::Path| -> Result<f64> {
        crate::bench_tokens::ensure_dataset_with(root, Layout::default(), tokens, checkpoint)?
            .ok_or_else(|| shardkit::Error::Internal("the dataset was not written".into()))
    };
    let local = a.dir.join(format!("tokens-write-{run}"));
    let local_tps = write(&local)?;
    let before = counters();
    let t0 = Instant::now();
    let uploaded = PathBuf::from(format!("{base}/tokens-upload-{run}"));
    upload(&local, &uploaded, |_, _| {})?;
    let upload_s = t0.elapsed().as_secs_f64();
    let stored: u64 = open_remote(&uploaded)?.list()?.iter().map(|(_, n)| n).sum();
    let upload_puts = counters().puts - before.puts;
    let local_sha = tree_sha256(&local)?;
    let _ = std::fs::remove_dir_all(&local);
    let before = counters();
    let streamed = PathBuf::from(format!("{base}/tokens-streamed-{run}"));
    let streamed_tps = write(&streamed)?;
    let after = counters();
    // Outside the timing: the streamed dataset, downloaded, is the locally written one.
    download(&streamed, &local, |_, _| {})?;
    let streamed_sha = tree_sha256(&local);
    let _ = std::fs::remove_dir_all(&local);
    same_bytes(
        "the streamed flat-tokens write (downloaded)",
        "the dataset's files",
        &local_sha,
        Some(&streamed_sha?),
    )?;
    let written = tokens as f64;
    let local_s = written / local_tps;
    let streamed_s = written / streamed_tps;
    let ideal = gbps(stored, local_s).min(gbps(stored, upload_s));
    let rate = gbps(stored, streamed_s);
    Ok(Value::Object(vec![
        ("tokens".into(), Value::int(tokens)),
        ("stored_bytes".into(), Value::int(stored)),
        ("checkpoint_tokens".into(), Value::int(checkpoint)),
        ("local_write_gbps".into(), num(gbps(stored, local_s))),
        ("local_write_tokens_per_s".into(), num(local_tps)),
        ("upload_gbps".into(), num(gbps(stored, upload_s))),
        ("upload_puts".into(), Value::int(upload_puts)),
        ("streamed_write_gbps".into(), num(rate)),
        ("streamed_write_tokens_per_s".into(), num(streamed_tps)),
        ("streamed_puts".into(), Value::int(after.puts - before.puts)),
        (
            "streamed_put_bytes".into(),
            Value::int(after.put_bytes - before.put_bytes),
        ),
        (
            "ratio_to_ideal".into(),
            num(ratio("streamed write vs write-then-upload", rate, ideal)?),
        ),
        (
            "note".into(),
            Value::String(
                "stored bytes per second; ideal: the slower of writing locally and uploading \
                 the local copy. The streamed write commits every shard's worth of tokens and \
                 uploads that commit's shard in the background, then its checkpoint (the \
                 trailing chunks and the journal) on the writer's thread"
                    .into(),
            ),
        ),
    ]))
}

pub fn run(a: RemoteBenchArgs) -> Result<()> {
    // Started before anything reads the endpoint; stopped when the run ends.
    let link = match (a.link_latency_ms, a.link_conn_mbps) {
        (None, None) => None,
        (latency, rate) => Some(Link::start(latency.unwrap_or(0.0), rate.unwrap_or(0.0))?),
    };
    let threads = if a.threads.is_empty() {
        thread_counts()
    } else {
        a.threads.clone()
    };
    let want = |w: &str| a.only.is_empty() || a.only.iter().any(|o| o == w);
    let mut out = vec![
        ("bench".into(), Value::String("remote".into())),
        (
            "endpoint".into(),
            Value::String(std::env::var("AWS_ENDPOINT_URL").unwrap_or_default()),
        ),
        ("request_mib".into(), Value::int(io::max_request() >> 20)),
        (
            "cores".into(),
            Value::int(std::thread::available_parallelism().map_or(1, |n| n.get()) as u64),
        ),
    ];
    if let Some(l) = &link {
        out.push((
            "link".into(),
            Value::Object(vec![
                ("upstream".into(), Value::String(l.upstream.clone())),
                ("latency_ms".into(), num(l.latency_ms)),
                ("conn_mbps".into(), num(l.conn_mbps)),
            ]),
        ));
    }
    if want("saev") {
        out.push(("saev".into(), saev(&a, &threads)?));
    }
    if want("saev-cache") {
        out.push(("saev_cache".into(), saev_cache(&a, &threads)?));
    }
    if want("saev-write") {
        out.push(("saev_write".into(), saev_write(&a)?));
    }
    if want("tokens") {
        out.push(("tokens".into(), tokens(&a, &threads)?));
    }
    if want("tokens-write") {
        out.push(("tokens_write".into(), tokens_write(&a)?));
    }
    if want("eagle3") {
        out.push(("eagle3".into(), eagle3(&a, &threads)?));
    }
    if want("sdnb") {
        out.push(("sdnb".into(), sdnb(&a, &threads)?));
    }
    io::set_inflight(0);
    println!("{}", json::to_pretty(&Value::Object(out), 2, Escape::Utf8));
    Ok(())
}

/// A `bench link` relay in front of the endpoint, run as a child process (so that its CPU is
/// not counted as the loaders'); the process's endpoint points at it while it lives.
struct Link {
    child: std::process::Child,
    upstream: String,
    latency_ms: f64,
    conn_mbps: f64,
}

impl Link {
    fn start(latency_ms: f64, conn_mbps: f64) -> Result<Link> {
        use std::io::BufRead;
        let endpoint = ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"]
            .iter()
            .find_map(|k| std::env::var(k).ok())
            .unwrap_or_default();
        let upstream = endpoint
            .strip_prefix("http://")
            .map(|h| h.trim_end_matches('/'))
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "--link-latency-ms/--link-conn-mbps relay to a plain-HTTP server named by \
                     AWS_ENDPOINT_URL (http://host:port), which is {endpoint:?}"
                ))
            })?
            .to_string();
        let exe = std::env::current_exe().map_err(|e| Error::io("the shardkit-bench binary", e))?;
        let mut child = std::process::Command::new(&exe)
            .args(["link", "--upstream", &upstream])
            .args(["--latency-ms", &latency_ms.to_string()])
            .args(["--conn-mbps", &conn_mbps.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| Error::io(&exe, e))?;
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|o| std::io::BufReader::new(o).read_line(&mut line));
        let at = line.trim().to_string();
        if !matches!(read, Some(Ok(n)) if n > 0) || at.is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Invalid(format!(
                "the relay (`{} bench link`) did not start",
                exe.display()
            )));
        }
        std::env::remove_var("AWS_ENDPOINT_URL_S3");
        std::env::set_var("AWS_ENDPOINT_URL", format!("http://{at}"));
        Ok(Link {
            child,
            upstream,
            latency_ms,
            conn_mbps,
        })
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
