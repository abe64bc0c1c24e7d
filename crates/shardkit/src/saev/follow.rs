//! Reading a saev dataset while it is written (follow mode): a producer records activations
//! with [`super::PartWriter`] ranks while a consumer trains on the shards already durable.
//!
//! A dataset written in parts has its metadata.json (so its whole layout) from the start, and
//! each shard becomes durable on its own: the shard file is published, then its record
//! `.shardkit-parts/done/<shard>.json` (see `commit::parts`). A shard is *durable* when its
//! record exists, or when the dataset is committed (shards.json; the records are gone then).
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
//! them: on an unfinished dataset follow mode reads with world size 1 only (and without
//! `drop_last`, which would drop each round's last partial batch, `ignore_labels` and `verify`,
//! which need labels.bin and the checksum sidecar that the commit writes). On a committed
//! dataset follow mode changes nothing.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::loader::{Batch, Batches, Inner, Loader, PassParts};
use super::options::LoaderOptions;
use super::validate::shard_index;
use super::writer::label_piece;
use super::Dataset;
use crate::commit::parts::Parts;
use crate::engine::exec;
use crate::engine::order::rank_batches;
use crate::engine::StateValue;
use crate::error::{Error, Result};
use crate::io::Location;
use crate::saev::Layout;

/// How a follow-mode loader waits for shards (the `follow` field of
/// [`super::SaevOptions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowOptions {
    /// How long a loader that has served every durable shard waits for another before failing
    /// (naming the missing shards and who holds their claims). Default one hour.
    pub timeout: Duration,
    /// How often it looks for new shards meanwhile. Default 100 ms.
    pub poll: Duration,
    /// Called at every poll while waiting: `true` stops the wait with an error (Python's
    /// binding checks for Ctrl-C here, so a loader waiting for shards can be interrupted).
    pub interrupted: Option<WaitCheck>,
}

/// A function a waiting follow-mode loader calls at every poll (see
/// [`FollowOptions::interrupted`]).
#[derive(Clone, Copy)]
pub struct WaitCheck(pub fn() -> bool);

impl PartialEq for WaitCheck {
    fn eq(&self, other: &WaitCheck) -> bool {
        std::ptr::fn_addr_eq(self.0, other.0)
    }
}

impl Eq for WaitCheck {}

impl std::fmt::Debug for WaitCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WaitCheck")
    }
}

impl Default for FollowOptions {
    fn default() -> FollowOptions {
        FollowOptions {
            timeout: Duration::from_secs(3600),
            poll: Duration::from_millis(100),
            interrupted: None,
        }
    }
}

/// The state key holding the rounds.
pub(super) const ROUNDS_KEY: &str = "follow_rounds";

/// A follow-mode loader's rounds of the current epoch, shared with its pass.
#[derive(Debug)]
pub(crate) struct Follow {
    opts: FollowOptions,
    dir: PathBuf,
    rounds: Arc<Mutex<Vec<Vec<Range<u64>>>>>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens a follow-mode loader over `dir` (see the module documentation).
pub(super) fn open(dir: &Path, opts: LoaderOptions) -> Result<Loader> {
    let Some(fo) = opts.follow else {
        return Loader::with_dataset(Dataset::open(dir)?, opts);
    };
    let location = Location::parse(dir)?;
    let Some(local) = location.local_path() else {
        // Follow mode reads local (shared) file systems only for now: a store's dataset
        // (written in parts or not) is read when committed, as without follow.
        return Loader::with_dataset(Dataset::open(dir)?, opts);
    };
    let ds = Dataset::open_unfinished(local)?;
    let layout = *ds.layout();
    let finished = committed(local, &layout)?;
    let (_, world) = opts.rank_and_world()?;
    if !finished {
        let refuse = |what: &str| {
            Err(Error::Invalid(format!(
                "{}: follow mode on a dataset still being written {what}",
                local.display()
            )))
        };
        if world > 1 {
            return refuse(&format!(
                "reads with world_size 1 only (got {world}): its rounds depend on when the \
                 loader looks, so ranks reading apart would split different rows; read with one \
                 process, or wait for the commit"
            ));
        }
        if opts.drop_last {
            return refuse(
                "cannot drop_last: every round ends with a partial batch, which would be dropped",
            );
        }
        if !opts.ignore_labels.is_empty() {
            return refuse("cannot ignore_labels: labels.bin is written by the commit");
        }
        if opts.verify {
            return refuse("cannot verify: the checksum sidecar is written by the commit");
        }
    }
    // On a committed dataset, a split over ranks or drop_last reads as without follow.
    let rounds = world == 1 && !opts.drop_last;
    let mut loader = Loader::with_dataset(ds, opts)?;
    if rounds {
        loader.follow = Some(Follow {
            opts: fo,
            dir: local.to_path_buf(),
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

/// The shards durable now, one flag a shard.
fn durable_now(dir: &Path, layout: &Layout) -> Result<Vec<bool>> {
    let n = layout.n_shards as usize;
    if committed(dir, layout)? {
        return Ok(vec![true; n]);
    }
    let mut out = vec![false; n];
    let Some(parts) = Parts::existing(dir) else {
        // Not written in parts, or committed since the look above (its records removed).
        return Ok(vec![committed(dir, layout)?; n]);
    };
    match parts.durable_units() {
        Ok(names) => {
            for s in names.iter().filter_map(|u| shard_index(u)) {
                if let Some(d) = out.get_mut(s as usize) {
                    *d = true;
                }
            }
            Ok(out)
        }
        // The commit removes the records: committed meanwhile.
        Err(_) if committed(dir, layout)? => Ok(vec![true; n]),
        Err(e) => Err(e),
    }
}

/// The shards `flags` marks, as ranges.
fn ranges_of(flags: &[bool]) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for (s, _) in flags.iter().enumerate().filter(|(_, &f)| f) {
        let s = s as u64;
        match out.last_mut() {
            Some(r) if r.end == s => r.end = s + 1,
            _ => out.push(s..s + 1),
        }
    }
    out
}

fn mark(flags: &mut [bool], shards: &[Range<u64>]) {
    for s in shards.iter().flat_map(|r| r.clone()) {
        if let Some(f) = flags.get_mut(s as usize) {
            *f = true;
        }
    }
}

/// Rounds as a flat list: each round's range count, then its ranges' ends.
pub(super) fn encode(rounds: &[Vec<Range<u64>>]) -> Vec<u64> {
    let mut out = Vec::new();
    for r in rounds {
        out.push(r.len() as u64);
        for x in r {
            out.extend([x.start, x.end]);
        }
    }
    out
}

/// [`encode`]'s rounds back, checked against `n_shards` (disjoint, in range).
pub(super) fn decode(flat: &[u64], n_shards: u64) -> Result<Vec<Vec<Range<u64>>>> {
    let bad = |why: &str| {
        Err(Error::Invalid(format!(
            "state key {ROUNDS_KEY:?} {why} (it lists each round's range count, then the \
             ranges' first and end shards)"
        )))
    };
    let mut rounds = Vec::new();
    let mut seen = vec![false; n_shards as usize];
    let mut i = 0;
    while i < flat.len() {
        let k = flat[i] as usize;
        let Some(pairs) = flat.get(i + 1..i + 1 + 2 * k) else {
            return bad("ends inside a round");
        };
        let mut round = Vec::with_capacity(k);
        for p in pairs.chunks_exact(2) {
            if p[0] >= p[1] || p[1] > n_shards {
                return bad(&format!(
                    "has shards {}..{}, not a range of this dataset's {n_shards} shards",
                    p[0], p[1]
                ));
            }
            for s in p[0]..p[1] {
                if std::mem::replace(&mut seen[s as usize], true) {
                    return bad(&format!("serves shard {s} twice"));
                }
            }
            round.push(p[0]..p[1]);
        }
        rounds.push(round);
        i += 1 + 2 * k;
    }
    Ok(rounds)
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
                window_blocks: loader.window_blocks,
                follow: self.opts,
                dir: self.dir.clone(),
                rounds: self.rounds.clone(),
                at,
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
    window_blocks: u64,
    follow: FollowOptions,
    dir: PathBuf,
    rounds: Arc<Mutex<Vec<Vec<Range<u64>>>>>,
    /// Rows of the epoch served (the cursor), rounds counted in order.
    at: u64,
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
                    None => self.current = None,
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
    fn next_round(&mut self) -> Result<Option<exec::Stream<Batch>>> {
        let layout = self.layout();
        let mut served = vec![false; layout.n_shards as usize];
        let mut offset = 0;
        for round in locked(&self.rounds).clone() {
            let rows = self.parts.src.rows_in_shards(&round);
            if self.at < offset + rows {
                return self.start(&round, offset).map(Some);
            }
            offset += rows;
            mark(&mut served, &round);
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
        let since = Instant::now();
        loop {
            let durable = durable_now(&self.dir, &layout)?;
            let new: Vec<bool> = durable
                .iter()
                .zip(&served)
                .map(|(&d, &s)| d && !s)
                .collect();
            if new.iter().any(|&n| n) {
                let round = ranges_of(&new);
                locked(&self.rounds).push(round.clone());
                return self.start(&round, offset).map(Some);
            }
            if since.elapsed() >= self.follow.timeout {
                return Err(self.stopped(&durable, &layout, None));
            }
            if let Some(WaitCheck(interrupted)) = self.follow.interrupted {
                if interrupted() {
                    return Err(self.stopped(&durable, &layout, Some("it was interrupted")));
                }
            }
            std::thread::sleep(self.follow.poll.min(self.follow.timeout));
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
            // The commit publishes labels.bin whole before it removes the pieces.
            let path = self.dir.join("labels.bin");
            match std::fs::read(&path) {
                Ok(b) if b.len() == all => {
                    *labels = Some(Arc::new(b));
                    Ok(true)
                }
                Ok(_) => Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(Error::io(&path, e)),
            }
        };
        for s in round.iter().flat_map(|r| r.clone()) {
            let piece = self.dir.join(label_piece(s));
            let bytes = match std::fs::read(&piece) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
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
                }
                Err(e) => return Err(Error::io(&piece, e)),
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
    fn start(&self, round: &[Range<u64>], offset: u64) -> Result<exec::Stream<Batch>> {
        self.load_labels(round)?;
        let mut keep = vec![false; self.layout().n_shards as usize];
        mark(&mut keep, round);
        let order =
            Loader::plan_over(&self.parts.src, &self.opts, self.window_blocks, Some(&keep))?;
        let total = order.len();
        let local = self.at - offset;
        let bs = self.opts.batch_size;
        // World size 1: the round's batches from its start, the last one partial.
        let plans = rank_batches(total, bs, 0, 1, false)
            .filter(|&(s, _)| s >= local - local % bs)
            .map(|(s, e)| (s, e, offset + e))
            .collect();
        Ok(self.parts.stream(Arc::new(order), plans))
    }

    /// The error of a loader that stopped waiting for shards: `why`, or the timeout passed.
    fn stopped(&self, durable: &[bool], layout: &Layout, why: Option<&str>) -> Error {
        let missing: Vec<bool> = durable.iter().map(|&d| !d).collect();
        let missing = ranges_of(&missing);
        let claims = Parts::existing(&self.dir)
            .and_then(|p| p.live_claims().ok())
            .unwrap_or_default();
        // Each missing range cut where a claim starts or ends, so each piece has one story.
        let mut pieces = Vec::new();
        for r in &missing {
            let mut cuts: Vec<u64> = claims
                .iter()
                .flat_map(|(c, _)| [c.start, c.end])
                .filter(|&x| r.start < x && x < r.end)
                .collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut at = r.start;
            for x in cuts.into_iter().chain([r.end]) {
                pieces.push(at..x);
                at = x;
            }
        }
        let words = pieces
            .iter()
            .map(|r| {
                let by: Vec<&str> = claims
                    .iter()
                    .filter(|(c, _)| c.start < r.end && r.start < c.end)
                    .map(|(_, who)| who.as_str())
                    .collect();
                let who = if by.is_empty() {
                    "claimed by no live writer".to_string()
                } else {
                    format!("claimed by {}", by.join("; "))
                };
                format!("shards {}..{} ({who})", r.start, r.end)
            })
            .collect::<Vec<_>>()
            .join(", ");
        let eps = layout.examples_per_shard;
        let present = durable
            .iter()
            .enumerate()
            .filter(|(_, &d)| d)
            .map(|(s, _)| layout.shard_count(s as u64).min(eps))
            .sum();
        Error::Incomplete {
            path: self.dir.clone(),
            present,
            total: layout.n_examples,
            detail: match why {
                None => format!(
                    "follow mode waited {:.1} s for a shard to become durable and none did; \
                     missing: {words} (see `shardkit saev status`; raise follow_timeout for a \
                     slower writer)",
                    self.follow.timeout.as_secs_f64()
                ),
                Some(why) => {
                    format!("follow mode stopped waiting for shards: {why}; missing: {words}")
                }
            },
        }
    }
}

/// The state keys of a follow-mode loader.
pub(super) fn state_value(f: &Follow) -> StateValue {
    StateValue::List(encode(&f.rounds()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // rounds of one range
    fn rounds_round_trip_and_a_bad_list_is_refused_naming_the_key() {
        let rounds = vec![vec![0..2, 5..6], vec![2..5], vec![6..9]];
        let flat = encode(&rounds);
        assert_eq!(flat, [2, 0, 2, 5, 6, 1, 2, 5, 1, 6, 9]);
        assert_eq!(decode(&flat, 9).unwrap(), rounds);
        assert!(decode(&[], 9).unwrap().is_empty());
        for (flat, why) in [
            (vec![2, 0, 2], "ends inside a round"),
            (vec![1, 0, 10], "not a range of this dataset's 9 shards"),
            (vec![1, 3, 3], "shards 3..3"),
            (vec![1, 0, 2, 1, 1, 3], "serves shard 1 twice"),
        ] {
            let e = decode(&flat, 9).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("follow_rounds"), "{e}");
        }
        assert_eq!(ranges_of(&[true, true, false, true]), [0..2, 3..4]);
    }
}
