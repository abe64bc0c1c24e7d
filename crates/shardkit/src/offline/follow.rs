//! Reading an EAGLE-3 cache while it is written in parts (follow mode): the semantics of
//! saev's (saev/follow.rs, docs/saev.md "Reading while it is written"), on shards.
//!
//! Until the commit a cache written in parts has no manifest.json; its manifest is the one
//! its part writers share (`.shardkit-parts/eagle3.json`, see `parts::setup_manifest`), so the
//! whole layout (samples, shards, fields) is known from the start. A shard is durable once its
//! record `.shardkit-parts/done/<shard>.json` exists (the record is written after the shard
//! file is published whole, so a durable shard is never torn), or once the cache is committed.
//! In an object store (`s3://`) likewise: the setup record is an object, a shard object is
//! uploaded whole before its record, each look for records is one LIST
//! (`commit::parts_read`), and the loader writes nothing.
//!
//! An epoch is a sequence of rounds: round `k` serves the epoch's planned order (the plain
//! loader's, same seed, epoch and shuffle) restricted to the samples of the shards durable when
//! it starts and not served by an earlier round, in batches of `batch_size`, the last one
//! partial. The state's `follow_rounds` records each round's shards and `batch` counts batches
//! over the rounds in order, so a state resumes exactly. An epoch that starts with every shard
//! durable is one round: the plain loader's epoch. Rounds depend on when the loader looked:
//! with world size > 1, rank 0 alone looks and broadcasts them (saev's design, see
//! saev/follow.rs; refused without a broadcast on an unfinished cache). Each round is split as
//! the plain loader splits its epoch: rank `r` takes every `world`-th sample of the round's
//! order from the `r`-th; the epoch's last round is padded first to a multiple of `world` by
//! wrapping around (the plain loader's DistributedSampler padding, so one round of every shard
//! is the plain epoch on every rank); the others are not padded (each sample once) and must
//! give every rank as many batches, else they wait for more shards. `batch` counts this rank's
//! batches, as many on every rank. Also refused on an unfinished cache: `drop_last` (it would
//! drop each round's last partial batch) and `verify` (the checksum sidecar is written by the
//! commit).

use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::cache::{Cache, DEFAULT_OPEN_SHARDS};
use super::loader::{Loader, LoaderOptions};

use super::shard::shard_index;
use crate::commit::parts_read::PartsReader;
use crate::engine::follow::{
    agree, decode, encode, locked, mark, refuse_while_written, stopped_error, wait_new,
    FollowOptions, RoundAt, Stopped, Waited, ROUNDS_KEY,
};
use crate::engine::{LoaderState, StateValue};
use crate::error::{Error, Result};
use crate::io::{self, Location};

/// A follow-mode loader's rounds of the current epoch, shared with its passes.
#[derive(Debug, Clone)]
pub(super) struct Follow {
    pub(super) opts: FollowOptions,
    /// This rank and the world size: each round is split over the ranks as the plain loader
    /// splits its epoch.
    rank_world: (u64, u64),
    /// The cache (a directory, or a store prefix).
    dir: PartsReader,
    rounds: Arc<Mutex<Vec<Vec<Range<u64>>>>>,
}

/// Opens a loader over the cache at `dir` (a directory or an `s3://` prefix), following it
/// while it is written when `opts.follow` is set (see the module documentation).
pub(super) fn open(dir: &Path, opts: LoaderOptions) -> Result<Loader> {
    let Some(fo) = opts.follow.clone() else {
        return Loader::new(Arc::new(Cache::open(dir)?), opts);
    };
    let location = Location::parse(dir)?;
    let (cache, finished) = match location.local_path() {
        Some(local) => match Cache::open_unfinished(local)? {
            Some(c) => (c, false),
            None => (Cache::open(local)?, true),
        },
        None => {
            // Read through the committed reader's store path (a durable shard's object is
            // final, so the local cache of objects may keep it).
            let source = io::open(&location)?;
            match Cache::open_unfinished_store(&location, source.clone())? {
                Some(c) => (c, false),
                None => (Cache::open_source(source, DEFAULT_OPEN_SHARDS)?, true),
            }
        }
    };
    let rank_world = opts.rank_and_world()?;
    let world = rank_world.1;
    if !finished {
        let agree = fo.broadcast.is_some();
        refuse_while_written(
            cache.dir(),
            "cache",
            world,
            agree,
            opts.drop_last,
            opts.verify,
        )?;
    }
    // On a committed cache, drop_last, or a split over ranks that do not agree on rounds,
    // reads as without follow. Ranks with a broadcast use it whether or not the cache was
    // committed when they opened: one that opened before the commit needs the others.
    let rounds = !opts.drop_last && (world == 1 || fo.broadcast.is_some());
    let mut loader = Loader::new(Arc::new(cache), opts)?;
    if rounds {
        loader.follow = Some(Follow {
            opts: fo,
            rank_world,
            dir: PartsReader::new(&location)?,
            rounds: Arc::default(),
        });
    }
    Ok(loader)
}

/// The shards durable now in the cache, one flag a shard (every one once committed): one
/// look at the records (one LIST in a store), and while shards are missing one at
/// manifest.json, the commit record (a file check locally, a GET in a store).
fn durable_now(dir: &PartsReader, n: u64) -> Result<Vec<bool>> {
    let committed = || match dir.local() {
        Some(local) => Ok(local.join(super::manifest::MANIFEST).is_file()),
        None => Ok(dir.get_opt(super::manifest::MANIFEST)?.is_some()),
    };
    dir.durable_now(n, shard_index, committed)
}

impl Follow {
    /// A new epoch (or the same from its start): no round yet.
    pub(super) fn restart(&self) {
        locked(&self.rounds).clear();
    }

    /// `st` with the rounds.
    pub(super) fn save(&self, st: LoaderState) -> LoaderState {
        st.with(ROUNDS_KEY, StateValue::List(encode(&locked(&self.rounds))))
    }

    /// The rounds of `st`, checked against the cache, and the batches they hold on this rank.
    /// A state without them (a plain loader's) read as one round of the whole cache when it
    /// is past the epoch's start.
    pub(super) fn rounds_of(
        &self,
        st: &LoaderState,
        m: &super::Manifest,
        bs: u64,
    ) -> Result<(Vec<Vec<Range<u64>>>, u64)> {
        let rounds = match st.get(ROUNDS_KEY) {
            None if st.batch == 0 => Vec::new(),
            None => vec![vec![0..m.num_shards()]],
            Some(StateValue::List(flat)) => decode(flat, m.num_shards())?,
            Some(_) => {
                return Err(Error::Invalid(format!(
                    "state key {ROUNDS_KEY:?} is not a list of numbers"
                )))
            }
        };
        let batches = self.batches_in(m, &rounds, bs);
        Ok((rounds, batches))
    }

    /// Batches of `rounds` on each rank (as many on every rank: see [`Follow::next_round`]).
    fn batches_in(&self, m: &super::Manifest, rounds: &[Vec<Range<u64>>], bs: u64) -> u64 {
        let world = self.rank_world.1;
        rounds
            .iter()
            .map(|r| samples_in(m, r).div_ceil(world).div_ceil(bs))
            .sum()
    }

    /// Whether batch `at` is the end of an epoch whose rounds served every shard.
    pub(super) fn finished(&self, m: &super::Manifest, bs: u64, at: u64) -> bool {
        let rounds = locked(&self.rounds).clone();
        let mut served = vec![false; m.num_shards() as usize];
        for r in &rounds {
            mark(&mut served, r);
        }
        served.iter().all(|&s| s) && at >= self.batches_in(m, &rounds, bs)
    }

    /// Replaces the rounds (a state loaded).
    pub(super) fn set_rounds(&self, rounds: Vec<Vec<Range<u64>>>) {
        *locked(&self.rounds) = rounds;
    }

    /// This rank's batches (sample indices) of the round holding epoch batch `at`: a recorded
    /// round, or a new one of the shards durable since, waiting for shards when none is new;
    /// `None` once every shard was served. `order` is the epoch's planned order (all ranks').
    /// With several ranks, rank 0 alone looks and broadcasts the round (see
    /// [`crate::engine::follow::agree`]); a round other than the epoch's last must give every
    /// rank as many batches, so that they all need the next round at the same batch.
    pub(super) fn next_round(
        &self,
        cache: &Cache,
        order: &[u64],
        bs: u64,
        epoch: u64,
        at: u64,
    ) -> Result<Option<Vec<Vec<u64>>>> {
        let m = cache.manifest();
        let n = m.num_shards();
        let mut served = vec![false; n as usize];
        let mut offset = 0;
        let recorded = locked(&self.rounds).clone();
        for round in &recorded {
            let batches = self.batches_in(m, std::slice::from_ref(round), bs);
            mark(&mut served, round);
            if at < offset + batches {
                let last = served.iter().all(|&s| s);
                return Ok(Some(self.batches_of(
                    cache,
                    order,
                    round,
                    last,
                    bs,
                    at - offset,
                )));
            }
            offset += batches;
        }
        if at != offset {
            return Err(Error::Internal(format!(
                "internal: follow cursor {at} is past the rounds' {offset} batches"
            )));
        }
        if served.iter().all(|&s| s) {
            return Ok(None);
        }
        let (rank, world) = self.rank_world;
        // Unpadded, a rank gets floor or ceil(samples / world) of them: as many batches either
        // way, or the round waits for more shards.
        let even = |round: &[Range<u64>]| {
            let k = samples_in(m, round);
            (k / world).div_ceil(bs) == k.div_ceil(world).div_ceil(bs)
        };
        let at = RoundAt {
            rank,
            world,
            epoch,
            round: recorded.len() as u64,
            units: n,
        };
        let look = || wait_new(&self.opts, &served, || durable_now(&self.dir, n), even);
        match agree(&self.opts, at, look)? {
            Waited::New(round) => {
                locked(&self.rounds).push(round.clone());
                mark(&mut served, &round);
                let last = served.iter().all(|&s| s);
                Ok(Some(self.batches_of(cache, order, &round, last, bs, 0)))
            }
            Waited::Stopped(durable, why) => Err(self.stopped(cache, &durable, why)),
        }
    }

    /// `order` restricted to the samples of `round`'s shards, this rank's share of them (every
    /// `world`-th from `rank`; the epoch's `last` round padded first, by wrapping around to
    /// its start, to a multiple of `world` as the plain loader pads its epoch), in batches of
    /// `bs` from batch `from`.
    fn batches_of(
        &self,
        cache: &Cache,
        order: &[u64],
        round: &[Range<u64>],
        last: bool,
        bs: u64,
        from: u64,
    ) -> Vec<Vec<u64>> {
        let (rank, world) = self.rank_world;
        let m = cache.manifest();
        let mut keep = vec![false; m.num_shards() as usize];
        mark(&mut keep, round);
        let s = m.shard_size;
        let mut mine: Vec<u64> = order
            .iter()
            .copied()
            .filter(|&i| keep.get((i / s) as usize).copied().unwrap_or(false))
            .collect();
        if last && !mine.is_empty() {
            let padded = mine.len().div_ceil(world as usize) * world as usize;
            let mut i = 0;
            while mine.len() < padded {
                mine.push(mine[i]);
                i += 1;
            }
        }
        let mine: Vec<u64> = mine
            .into_iter()
            .skip(rank as usize)
            .step_by(world as usize)
            .collect();
        mine.chunks(bs as usize)
            .skip(from as usize)
            .map(<[u64]>::to_vec)
            .collect()
    }

    /// The error of a loader that stopped waiting for shards: `why`, or the timeout passed.
    fn stopped(&self, cache: &Cache, durable: &[bool], why: Option<&str>) -> Error {
        let m = cache.manifest();
        let claims = self.dir.live_claims();
        stopped_error(
            &self.dir.path(),
            durable,
            |s| m.rows_in_shard(s),
            m.num_samples,
            &claims,
            &format!("shardkit {} status", m.schema().name()),
            why.map_or(Stopped::TimedOut(self.opts.timeout), Stopped::Because),
        )
    }
}

/// Samples in the shards `round` lists.
fn samples_in(m: &super::Manifest, round: &[Range<u64>]) -> u64 {
    round
        .iter()
        .flat_map(|r| r.clone())
        .map(|s| m.rows_in_shard(s))
        .sum()
}
