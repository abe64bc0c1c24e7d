//! Reading a saev dataset while it is written (follow mode): a producer records activations
//! with [`super::PartWriter`] ranks while a consumer trains on the shards already durable.
//!
//! A dataset written in parts has its metadata.json (so its whole layout) from the start, and
//! each shard becomes durable on its own: the shard file is published, then its record
//! `.shardkit-parts/done/<shard>.json` (see `commit::parts`). A shard is *durable* when its
//! record exists, or when the dataset is committed (shards.json; the records are gone then).
//! The same holds in an object store (`s3://`): a shard object is uploaded whole before its
//! record, each look for records is one LIST (`commit::parts_read`), and the loader reads the
//! shards through the committed loader's store path and writes nothing.
//!
//! A follow-mode epoch is a sequence of *rounds*. Round `k` serves the epoch's planned order
//! (same seed, epoch and order as on the finished dataset) restricted to the shards durable
//! when it starts and not served by an earlier round of the epoch; the block and sequential
//! orders are exactly the full order with the other blocks left out, the exact order is a keyed
//! permutation of the round's rows. When a round is exhausted the loader looks again: new
//! durable shards start the next round; none, while shards are missing, means waiting (polling)
//! up to [`FollowOptions::timeout`] before an error naming the missing shards and who claims
//! them; the epoch ends once every shard was served. So every row is served exactly once per
//! epoch, and an epoch that starts with every shard durable is one round, the finished
//! dataset's epoch exactly.
//!
//! The state (`follow_rounds`: each round's shards as ranges; `cursor`: rows served this epoch,
//! rounds counted in order) resumes exactly: the recorded rounds are replayed, later ones are
//! formed from what is durable then.
//!
//! Rounds depend on timing (when the loader looked), so ranks reading apart could not agree on
//! them by themselves: with world size > 1 rank 0 alone looks and broadcasts each round (or why
//! it stopped) through [`FollowOptions::broadcast`], once per round on every rank
//! (`engine::follow::agree`); without a broadcast an unfinished dataset is refused for world
//! size > 1. Each round is split over the ranks as the plain loader splits its epoch
//! (`rank_batches`: global batches of `batch_size` rows per rank, the last one partial and
//! shared evenly; `cursor` counts global rows), so the ranks' rows are disjoint, their union is
//! every row once per epoch, each rank's state resumes that rank, and one round of every shard
//! is the plain loader's epoch on every rank. A round other than the epoch's last must give
//! every rank as many batches (so that every rank needs the next round, and calls the
//! broadcast, at the same batch): one whose last global batch has fewer rows than ranks waits
//! for more shards. Also refused on an unfinished dataset: `drop_last`, which would drop each
//! round's last partial batch, `ignore_labels` and `verify`, which need labels.bin and the
//! checksum sidecar that the commit writes. On a committed dataset follow mode changes nothing
//! (with a broadcast, the rounds are still broadcast: a rank that opened before the commit
//! needs the others).

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::loader::{Batch, Batches, Inner, Loader, PassParts};
use super::options::LoaderOptions;
use super::validate::shard_index;
use super::writer::label_piece;
use super::Dataset;
use crate::commit::parts_read::PartsReader;
use crate::engine::exec;
pub(super) use crate::engine::follow::decode;
use crate::engine::follow::{self, encode, locked, mark, wait_new, Stopped, Waited};
pub use crate::engine::follow::{FollowOptions, RoundBroadcast, WaitCheck};
use crate::engine::order::rank_batches;
use crate::engine::StateValue;
use crate::error::{Error, Result};
use crate::io::{self, Location};
use crate::saev::Layout;

/// The state key holding the rounds.
pub(super) const ROUNDS_KEY: &str = crate::engine::follow::ROUNDS_KEY;

/// A follow-mode loader's rounds of the current epoch, shared with its pass.
#[derive(Debug)]
pub(crate) struct Follow {
    opts: FollowOptions,
    /// The dataset (a directory, or a store prefix).
    dir: PartsReader,
    rounds: Arc<Mutex<Vec<Vec<Range<u64>>>>>,
}

/// Opens a follow-mode loader over `dir`, a directory or an `s3://` prefix (see the module
/// documentation).
pub(super) fn open(dir: &Path, opts: LoaderOptions) -> Result<Loader> {
    let Some(fo) = opts.follow.clone() else {
        return Loader::with_dataset(Dataset::open(dir)?, opts);
    };
    let location = Location::parse(dir)?;
    let (ds, finished) = match location.local_path() {
        Some(local) => {
            let ds = Dataset::open_unfinished(local)?;
            let finished = committed(local, ds.layout())?;
            (ds, finished)
        }
        // Read through the committed loader's store path: the same requests, the same local
        // cache of the objects (a durable shard's object is final, so caching it is safe).
        None => Dataset::open_unfinished_remote(io::open(&location)?)?,
    };
    let (_, world) = opts.rank_and_world()?;
    if !finished {
        let agree = fo.broadcast.is_some();
        let path = ds.path();
        follow::refuse_while_written(path, "dataset", world, agree, opts.drop_last, opts.verify)?;
        if !opts.ignore_labels.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: follow mode on a dataset still being written cannot ignore_labels: \
                 labels.bin is written by the commit",
                path.display()
            )));
        }
    }
    // On a committed dataset, drop_last, or a split over ranks that do not agree on rounds,
    // reads as without follow. Ranks with a broadcast use it whether or not the dataset was
    // committed when they opened: one that opened before the commit needs the others.
    let rounds = !opts.drop_last && (world == 1 || fo.broadcast.is_some());
    let mut loader = Loader::with_dataset(ds, opts)?;
    if rounds {
        loader.follow = Some(Follow {
            opts: fo,
            dir: PartsReader::new(&location)?,
            rounds: Arc::default(),
        });
    }
    Ok(loader)
}

/// Whether the dataset in `dir` is committed. shards.json is written last, whole: a dataset
/// that has it and is not complete is broken (the error names what), not unfinished.
fn committed(dir: &Path, layout: &Layout) -> Result<bool> {
    // shards.json first: checking completeness without it looks at every shard file.
    if !dir.join("shards.json").is_file() {
        return Ok(false);
    }
    super::dataset::check_complete(dir, layout).map(|()| true)
}

/// Whether the dataset is committed, in a directory ([`committed`]) or a store: there one GET
/// of shards.json, its entries checked against the layout. The shards' sizes are not listed
/// again (a second LIST each look): the commit checked every recorded shard's size before it
/// uploaded shards.json, and a shard read short is an error naming it.
fn committed_now(dir: &PartsReader, layout: &Layout) -> Result<bool> {
    if let Some(local) = dir.local() {
        return committed(local, layout);
    }
    let Some(bytes) = dir.get_opt("shards.json")? else {
        return Ok(false);
    };
    let sj = dir.path().join("shards.json");
    let entries = super::layout::parse_shards_json(&bytes, &sj)?;
    super::dataset::check_entries(&entries, &sj, layout).map(|()| true)
}

/// The shards durable now, one flag a shard (every one once committed): one look at the
/// records (one LIST in a store), and while shards are missing one at the commit record.
fn durable_now(dir: &PartsReader, layout: &Layout) -> Result<Vec<bool>> {
    dir.durable_now(layout.n_shards, shard_index, || committed_now(dir, layout))
}

impl Follow {
    /// A new epoch (or the same from its start): no round yet.
    pub(super) fn restart(&self) {
        locked(&self.rounds).clear();
    }

    /// The rounds of the epoch so far.
    pub(super) fn rounds(&self) -> Vec<Vec<Range<u64>>> {
        locked(&self.rounds).clone()
    }

    /// Replaces the rounds (a state loaded).
    pub(super) fn set_rounds(&self, rounds: Vec<Vec<Range<u64>>>) {
        *locked(&self.rounds) = rounds;
    }

    /// A pass over the rest of the epoch (see [`Loader::iter`]).
    pub(super) fn iter(&self, loader: &Loader) -> Result<Batches> {
        let total = loader.order.len();
        let resumed = loader.resumed.swap(false, Ordering::Relaxed);
        let mut at = loader.cursor.load(Ordering::Relaxed);
        if at >= total && !resumed {
            at = 0;
            loader.cursor.store(0, Ordering::Relaxed);
            self.restart();
        }
        let inner = match loader.pass_parts() {
            Err(e) => Inner::One(exec::Stream::failed(e)),
            Ok(parts) => Inner::Follow(Box::new(FollowPass {
                parts,
                opts: loader.opts.clone(),
                rank_world: loader.rank_and_world(),
                window_blocks: loader.window_blocks,
                follow: self.opts.clone(),
                dir: self.dir.clone(),
                rounds: self.rounds.clone(),
                at,
                round_end: at,
                cursor: loader.cursor.clone(),
                current: None,
                ended: false,
            })),
        };
        Ok(Batches {
            inner,
            cursor: loader.cursor.clone(),
        })
    }
}

/// A follow-mode pass: the rounds' batches one after the other, waiting for shards between.
pub(crate) struct FollowPass {
    parts: PassParts,
    opts: LoaderOptions,
    /// This rank and the world size: each round is split over the ranks as the plain
    /// loader splits its epoch.
    rank_world: (u64, u64),
    window_blocks: u64,
    follow: FollowOptions,
    dir: PartsReader,
    rounds: Arc<Mutex<Vec<Vec<Range<u64>>>>>,
    /// Rows of the epoch served (the cursor), rounds counted in order.
    at: u64,
    /// Where the current round ends (the cursor once its stream ends: with several ranks, a
    /// rank's last batch of the epoch's last round may end before it).
    round_end: u64,
    /// The loader's cursor, moved to the round's end with `at`.
    cursor: Arc<AtomicU64>,
    current: Option<exec::Stream<Batch>>,
    ended: bool,
}

impl Iterator for FollowPass {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        loop {
            if let Some(s) = &mut self.current {
                match s.next() {
                    Some(Ok(b)) => {
                        self.at = b.cursor;
                        return Some(Ok(b));
                    }
                    Some(Err(e)) => {
                        self.ended = true;
                        self.current = None;
                        return Some(Err(e));
                    }
                    None => {
                        self.current = None;
                        self.at = self.round_end;
                        self.cursor.store(self.at, Ordering::Relaxed);
                    }
                }
            }
            if self.ended {
                return None;
            }
            match self.next_round() {
                Ok(Some(s)) => self.current = Some(s),
                Ok(None) => {
                    self.ended = true;
                    return None;
                }
                Err(e) => {
                    self.ended = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

impl FollowPass {
    fn layout(&self) -> Layout {
        *self.parts.src.dataset().layout()
    }

    /// The stream of the round the cursor is in (a recorded round, or a new one of the shards
    /// durable since), waiting for shards when none is new; `None` once every shard is served.
    /// With several ranks, rank 0 alone looks and broadcasts the round (see
    /// [`follow::agree`]); a round other than the epoch's last must give every rank as many
    /// batches, so that they all need the next round at the same batch.
    fn next_round(&mut self) -> Result<Option<exec::Stream<Batch>>> {
        let layout = self.layout();
        let mut served = vec![false; layout.n_shards as usize];
        let mut offset = 0;
        let recorded = locked(&self.rounds).clone();
        for round in &recorded {
            let rows = self.parts.src.rows_in_shards(round);
            if self.at < offset + rows {
                return self.start(round, offset).map(Some);
            }
            offset += rows;
            mark(&mut served, round);
        }
        if self.at != offset {
            return Err(Error::Internal(format!(
                "internal: follow cursor {} is past the rounds' {offset} rows",
                self.at
            )));
        }
        if served.iter().all(|&s| s) {
            return Ok(None);
        }
        let dir = self.dir.clone();
        let (rank, world) = self.rank_world;
        let global = self.opts.batch_size * world;
        let src = self.parts.src.clone();
        // Every rank gets a batch of the round's last global batch when it holds a row for
        // each (see `rank_batches`).
        let even = |round: &[Range<u64>]| {
            let tail = src.rows_in_shards(round) % global;
            tail == 0 || tail >= world
        };
        let at = follow::RoundAt {
            rank,
            world,
            epoch: self.opts.epoch,
            round: recorded.len() as u64,
            units: layout.n_shards,
        };
        let look = || wait_new(&self.follow, &served, || durable_now(&dir, &layout), even);
        match follow::agree(&self.follow, at, look)? {
            Waited::New(round) => {
                locked(&self.rounds).push(round.clone());
                self.start(&round, offset).map(Some)
            }
            Waited::Stopped(durable, why) => Err(self.stopped(&durable, &layout, why)),
        }
    }

    /// Reads the labels of the shards of `round` (their pieces, or labels.bin once the
    /// dataset is committed) into the loader's, when the dataset has labels.
    fn load_labels(&self, round: &[Range<u64>]) -> Result<()> {
        let src = &self.parts.src;
        if src.dataset().has_labels() {
            return Ok(()); // labels.bin was there when the loader opened: every label is known
        }
        // Taken out while the round's pieces are added, so that they are written in place (no
        // batch holds the array between rounds), and put back whatever happens.
        let mut labels = src.take_labels();
        let added = self.add_labels(round, &mut labels);
        if let Some(l) = labels {
            src.set_labels(l);
        }
        added
    }

    /// Adds the labels of `round`'s shards to `labels` (see [`FollowPass::load_labels`]).
    fn add_labels(&self, round: &[Range<u64>], labels: &mut Option<Arc<Vec<u8>>>) -> Result<()> {
        let layout = self.layout();
        let p = layout.content_tokens;
        let all = (layout.n_examples * p) as usize;
        let from_file = |labels: &mut Option<Arc<Vec<u8>>>| -> Result<bool> {
            // The commit publishes labels.bin whole (a rename, or a PUT) before it removes
            // the pieces.
            match self.dir.get_opt("labels.bin")? {
                Some(b) if b.len() == all => {
                    *labels = Some(Arc::new(b));
                    Ok(true)
                }
                _ => Ok(false),
            }
        };
        let shards: Vec<u64> = round.iter().flat_map(|r| r.clone()).collect();
        for (s, bytes) in shards.iter().copied().zip(pieces(&self.dir, &shards)?) {
            let piece = self.dir.path().join(label_piece(s));
            let Some(bytes) = bytes else {
                if from_file(labels)? {
                    break;
                }
                if labels.is_some() {
                    return Err(Error::format(
                        &piece,
                        "missing: the dataset's other durable shards have labels, this one \
                         has none (every rank must write labels, or none)",
                    ));
                }
                continue; // no labels in this dataset
            };
            let at = (s * layout.examples_per_shard * p) as usize;
            let want = (layout.shard_count(s) * p) as usize;
            if bytes.len() != want {
                return Err(Error::format(
                    &piece,
                    format!("holds {} bytes of labels, expected {want}", bytes.len()),
                ));
            }
            let l = labels.get_or_insert_with(|| Arc::new(vec![0; all]));
            Arc::make_mut(l)[at..at + want].copy_from_slice(&bytes);
        }
        Ok(())
    }

    /// Starts round `round`, which begins at epoch row `offset`, from the cursor.
    fn start(&mut self, round: &[Range<u64>], offset: u64) -> Result<exec::Stream<Batch>> {
        self.load_labels(round)?;
        let mut keep = vec![false; self.layout().n_shards as usize];
        mark(&mut keep, round);
        let order =
            Loader::plan_over(&self.parts.src, &self.opts, self.window_blocks, Some(&keep))?;
        let total = order.len();
        self.round_end = offset + total;
        let local = self.at - offset;
        let (rank, world) = self.rank_world;
        let bs = self.opts.batch_size;
        let global = bs * world;
        // The round split over the ranks as the plain loader splits its epoch: global batches
        // of batch_size rows per rank, the last one partial and shared evenly; the cursor after
        // a batch is the end of its global batch.
        let plans = rank_batches(total, bs, rank, world, false)
            .filter(|&(s, _)| s >= local - local % global)
            .map(|(s, e)| (s, e, offset + ((s / global + 1) * global).min(total)))
            .collect();
        Ok(self.parts.stream(Arc::new(order), plans))
    }

    /// The error of a loader that stopped waiting for shards: `why`, or the timeout passed.
    fn stopped(&self, durable: &[bool], layout: &Layout, why: Option<&str>) -> Error {
        let claims = self.dir.live_claims();
        let eps = layout.examples_per_shard;
        follow::stopped_error(
            &self.dir.path(),
            durable,
            |s| layout.shard_count(s).min(eps),
            layout.n_examples,
            &claims,
            "shardkit saev status",
            why.map_or(Stopped::TimedOut(self.follow.timeout), Stopped::Because),
        )
    }
}

/// The label pieces of `shards` (`None` where absent), in order. From a store they are
/// fetched several at once: one after the other, a round of many shards would wait a round
/// trip for each.
fn pieces(dir: &PartsReader, shards: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
    let get = |s: &u64| dir.get_opt(&label_piece(*s));
    if dir.local().is_some() || shards.len() < 2 {
        return shards.iter().map(get).collect();
    }
    let width = crate::config::inflight().clamp(1, PIECE_READERS);
    let what = format!("reading the label pieces of {}", dir.path().display());
    crate::par::chunked(shards, width, &what, |c| c.iter().map(get).collect())
}

/// The most label pieces read at once from a store.
const PIECE_READERS: usize = 16;

/// The state keys of a follow-mode loader.
pub(super) fn state_value(f: &Follow) -> StateValue {
    StateValue::List(encode(&f.rounds()))
}
