//! What the follow-mode loaders (saev's, EAGLE-3's) share: how they wait for parts, their
//! rounds as the state key `follow_rounds` (see saev/follow.rs for the design: an epoch is a
//! sequence of rounds, each the planned order restricted to the units durable when it starts
//! and not served before), and how several ranks agree on the rounds: rank 0 alone looks
//! ([`wait_new`]) and a [`RoundBroadcast`] carries its outcome to the others ([`agree`]), as a
//! flat list of numbers: a kind (0 a new round, 1 stopped, 2 failed), the epoch, the round's
//! index and the dataset's units (checked by the receivers: ranks out of step fail rather than
//! split different rows), then the round ([`encode`]d), or why it stopped (0 the timeout, else
//! 1 + an index in the reasons) and the durable flags, or its error's text, a byte a number.

use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};

/// Refuses what a follow-mode loader cannot do on a `what` ("dataset", "cache") at `path` still
/// being written: read with several ranks that do not agree on the rounds (a round depends on
/// when the loader looks, so ranks looking apart would split different rows: `broadcast` says
/// whether a [`RoundBroadcast`] makes them agree), drop each round's last partial batch, or
/// verify against a checksum sidecar that the commit writes.
pub(crate) fn refuse_while_written(
    path: &Path,
    what: &str,
    world: u64,
    broadcast: bool,
    drop_last: bool,
    verify: bool,
) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::Invalid(format!(
            "{}: follow mode on a {what} still being written {why}",
            path.display()
        )))
    };
    if world > 1 && !broadcast {
        return refuse(format!(
            "reads with world_size {world} only when the ranks agree on its rounds: a round \
             depends on when the loader looks, so ranks looking apart would split different \
             rows. Give a round broadcast (Rust: FollowOptions::broadcast; Python: \
             follow_broadcast=, which shardkit.torch's loaders build themselves when \
             torch.distributed is initialised), read with one process, or wait for the commit"
        ));
    }
    if drop_last {
        return refuse(
            "cannot drop_last: every round ends with a partial batch, which would be dropped"
                .into(),
        );
    }
    if verify {
        return refuse("cannot verify: the checksum sidecar is written by the commit".into());
    }
    Ok(())
}

/// Why a follow-mode loader stopped waiting.
pub(crate) enum Stopped<'a> {
    /// Its timeout passed with no new shard.
    TimedOut(Duration),
    /// Something else (an interrupt).
    Because(&'a str),
}

/// The error of a loader over the dataset at `dir` that stopped waiting for shards (`why`). `durable` flags the shards durable, `rows_in(s)` counts shard `s`'s
/// rows of the `total`, `claims` are the live claims (units, holder) and `status` the command
/// that shows where the write stands.
pub(crate) fn stopped_error(
    dir: &Path,
    durable: &[bool],
    rows_in: impl Fn(u64) -> u64,
    total: u64,
    claims: &[(Range<u64>, String)],
    status: &str,
    why: Stopped<'_>,
) -> Error {
    let words = missing_words(durable, claims);
    let present = durable
        .iter()
        .enumerate()
        .filter(|(_, &d)| d)
        .map(|(s, _)| rows_in(s as u64))
        .sum();
    Error::Incomplete {
        path: dir.to_path_buf(),
        present,
        total,
        detail: match why {
            Stopped::TimedOut(timeout) => format!(
                "follow mode waited {:.1} s for a shard to become durable and none did; \
                 missing: {words} (see `{status}`; raise follow_timeout for a slower writer)",
                timeout.as_secs_f64()
            ),
            Stopped::Because(why) => {
                format!("follow mode stopped waiting for shards: {why}; missing: {words}")
            }
        },
    }
}

/// The rounds' lock, taken whether or not a panicking holder poisoned it (they are plain data).
pub(crate) fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The state key holding the rounds.
pub(crate) const ROUNDS_KEY: &str = "follow_rounds";

/// How a follow-mode loader waits for shards (the `follow` field of
/// `saev::SaevOptions` and `eagle3::Eagle3Options`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowOptions {
    /// How long a loader that has served every durable shard waits for another before failing
    /// (naming the missing shards and who holds their claims). Default one hour.
    pub timeout: Duration,
    /// How often it looks for new shards meanwhile. Default 100 ms.
    pub poll: Duration,
    /// Called at every poll while waiting: `true` stops the wait with an error (Python's
    /// binding checks for Ctrl-C here, so a loader waiting for shards can be interrupted).
    pub interrupted: Option<WaitCheck>,
    /// How ranks reading one unfinished dataset together (world_size > 1) agree on its rounds:
    /// rank 0 alone looks for new shards and this broadcasts what it found to the others (see
    /// [`RoundBroadcast`]). Needed, on every rank, for world_size > 1 on an unfinished
    /// dataset; not used with world_size 1. Default none.
    pub broadcast: Option<RoundBroadcast>,
}

/// The function behind a [`RoundBroadcast`].
pub type BroadcastFn = dyn Fn(Option<Vec<u64>>) -> Result<Vec<u64>> + Send + Sync;

/// A broadcast from rank 0 to every rank, by which the ranks of a follow-mode loader agree on
/// each round (see [`FollowOptions::broadcast`]). Every rank calls it once per round, in the
/// same order: rank 0 with `Some(what it found)`, which it gets back, the others with `None`,
/// and they get rank 0's value. It blocks until every rank has called it; rank 0 calls it
/// after its wait for shards (up to [`FollowOptions::timeout`]), so the others may wait that
/// long in it. An error it returns is the loader's error on that rank. With torch:
/// `dist.broadcast_object_list([value], src=0)` over a gloo group of its own.
#[derive(Clone)]
pub struct RoundBroadcast(pub Arc<BroadcastFn>);

impl RoundBroadcast {
    /// A broadcast calling `f`.
    pub fn new(
        f: impl Fn(Option<Vec<u64>>) -> Result<Vec<u64>> + Send + Sync + 'static,
    ) -> RoundBroadcast {
        RoundBroadcast(Arc::new(f))
    }
}

/// The same function (not merely an equal one).
impl PartialEq for RoundBroadcast {
    fn eq(&self, other: &RoundBroadcast) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for RoundBroadcast {}

impl std::fmt::Debug for RoundBroadcast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoundBroadcast")
    }
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
            broadcast: None,
        }
    }
}

/// The shards `flags` marks, as ranges.
pub(crate) fn ranges_of(flags: &[bool]) -> Vec<Range<u64>> {
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

pub(crate) fn mark(flags: &mut [bool], shards: &[Range<u64>]) {
    for s in shards.iter().flat_map(|r| r.clone()) {
        if let Some(f) = flags.get_mut(s as usize) {
            *f = true;
        }
    }
}

/// Rounds as a flat list: each round's range count, then its ranges' ends.
pub(crate) fn encode(rounds: &[Vec<Range<u64>>]) -> Vec<u64> {
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
pub(crate) fn decode(flat: &[u64], n_shards: u64) -> Result<Vec<Vec<Range<u64>>>> {
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

/// The units `durable` does not mark, as ranges, each with who claims it (`claims`: the live
/// claims, unit ranges and their holders): "shards 3..5 (claimed by rank 1 ...)".
pub(crate) fn missing_words(durable: &[bool], claims: &[(Range<u64>, String)]) -> String {
    let missing: Vec<bool> = durable.iter().map(|&d| !d).collect();
    let missing = ranges_of(&missing);
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
    pieces
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
        .join(", ")
}

/// How a wait for new durable units ended (see [`wait_new`]).
#[derive(Debug)]
pub(crate) enum Waited {
    /// A new round: the units durable now and not served yet, as ranges.
    New(Vec<Range<u64>>),
    /// Given up (`why`, or the timeout passed), with the units durable at the last look.
    Stopped(Vec<bool>, Option<&'static str>),
}

/// Why a wait was interrupted.
const INTERRUPTED: &str = "it was interrupted";

/// Why a wait for an even round gave up.
const UNEVEN: &str = "its timeout passed while the shards durable and not served yet would \
     give the ranks different numbers of batches (every round but the epoch's last must give \
     each rank as many, so that the ranks look for the next round together)";

/// The reasons besides the timeout, as a round broadcast numbers them (1 + the index).
const WHYS: [&str; 2] = [INTERRUPTED, UNEVEN];

/// Looks (`durable_now`, one flag a unit) until a unit not `served` is durable, polling every
/// `poll` up to `timeout` (and stopping when `interrupted` says so). With several ranks, a
/// round must be `even` (give every rank as many batches, so that all of them need the next
/// round at the same batch and call the broadcast together) unless it is the epoch's last:
/// an uneven one waits for more units.
pub(crate) fn wait_new(
    fo: &FollowOptions,
    served: &[bool],
    mut durable_now: impl FnMut() -> Result<Vec<bool>>,
    even: impl Fn(&[Range<u64>]) -> bool,
) -> Result<Waited> {
    let since = std::time::Instant::now();
    loop {
        let durable = durable_now()?;
        let new: Vec<bool> = durable.iter().zip(served).map(|(&d, &s)| d && !s).collect();
        let mut uneven = false;
        if new.iter().any(|&n| n) {
            let round = ranges_of(&new);
            let last = durable.iter().zip(served).all(|(&d, &s)| d || s);
            if last || even(&round) {
                return Ok(Waited::New(round));
            }
            uneven = true;
        }
        if since.elapsed() >= fo.timeout {
            return Ok(Waited::Stopped(durable, uneven.then_some(UNEVEN)));
        }
        if let Some(WaitCheck(interrupted)) = fo.interrupted {
            if interrupted() {
                return Ok(Waited::Stopped(durable, Some(INTERRUPTED)));
            }
        }
        std::thread::sleep(fo.poll.min(fo.timeout));
    }
}

/// Where a rank stands when it needs a new round (checked against rank 0's, so ranks out of
/// step fail instead of splitting different rows).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoundAt {
    /// This rank.
    pub rank: u64,
    /// Ranks reading together.
    pub world: u64,
    /// The epoch.
    pub epoch: u64,
    /// The round's index in the epoch.
    pub round: u64,
    /// Units (shards) of the dataset.
    pub units: u64,
}

/// The outcome of the look for round `at`: `look()` itself with one rank (or no broadcast);
/// with several, rank 0's look, broadcast to every rank (see [`RoundBroadcast`]): rank 0 looks
/// and sends what it found (a new round, a stop and why, or its error's text), the others
/// adopt it.
pub(crate) fn agree(
    fo: &FollowOptions,
    at: RoundAt,
    look: impl FnOnce() -> Result<Waited>,
) -> Result<Waited> {
    let Some(RoundBroadcast(send)) = fo.broadcast.as_ref().filter(|_| at.world > 1) else {
        return look();
    };
    let head = [at.epoch, at.round, at.units];
    if at.rank == 0 {
        let found = look();
        let mut msg = Vec::new();
        match &found {
            Ok(Waited::New(round)) => {
                msg.push(0);
                msg.extend(head);
                msg.extend(encode(std::slice::from_ref(round)));
            }
            Ok(Waited::Stopped(durable, why)) => {
                msg.push(1);
                msg.extend(head);
                let code = why.map_or(0, |w| 1 + WHYS.iter().position(|&x| x == w).unwrap_or(0));
                msg.push(code as u64);
                msg.extend(durable.iter().map(|&d| u64::from(d)));
            }
            // The others fail too, with its text, rather than wait in the broadcast for a
            // round that never comes.
            Err(e) => {
                msg.push(2);
                msg.extend(head);
                msg.extend(e.to_string().bytes().map(u64::from));
            }
        }
        let sent = send(Some(msg));
        let found = found?;
        sent?;
        return Ok(found);
    }
    let msg = send(None)?;
    read_message(&msg, at)
}

/// Rank 0's outcome from its broadcast `msg` (see [`agree`]), checked against `at`.
fn read_message(msg: &[u64], at: RoundAt) -> Result<Waited> {
    let bad = |why: String| {
        Err(Error::Invalid(format!(
            "follow mode: rank {} of {} received a round broadcast that {why} (it must carry \
             what rank 0 found, as rank 0's loader sent it)",
            at.rank, at.world
        )))
    };
    let (Some(&kind), Some(head), Some(body)) = (msg.first(), msg.get(1..4), msg.get(4..)) else {
        return bad(format!("holds {} numbers, fewer than 4", msg.len()));
    };
    if head != [at.epoch, at.round, at.units] {
        return Err(Error::Invalid(format!(
            "follow mode: the ranks are out of step: rank 0 formed round {} of epoch {} (of {} \
             shards), rank {} of {} needs round {} of epoch {} (of {} shards); every rank must \
             read the same epochs, and resume states saved at the same batch",
            head[1], head[0], head[2], at.rank, at.world, at.round, at.epoch, at.units
        )));
    }
    match kind {
        0 => match decode(body, at.units) {
            Ok(rounds) if rounds.len() == 1 => Ok(Waited::New(rounds.concat())),
            Ok(rounds) => bad(format!("lists {} rounds, not one", rounds.len())),
            Err(e) => bad(format!("lists no round ({e})")),
        },
        1 => {
            let why = match body.first() {
                Some(0) => None,
                Some(&c) => match WHYS.get(c as usize - 1) {
                    Some(&w) => Some(w),
                    None => return bad(format!("stops for reason {c}, which it does not know")),
                },
                None => return bad("stops without a reason".into()),
            };
            let flags = &body[1..];
            if flags.len() as u64 != at.units || flags.iter().any(|&f| f > 1) {
                return bad(format!(
                    "stops with {} flags, not {}",
                    flags.len(),
                    at.units
                ));
            }
            Ok(Waited::Stopped(
                flags.iter().map(|&f| f == 1).collect(),
                why,
            ))
        }
        2 => {
            let text: Vec<u8> = body.iter().map(|&b| b.min(255) as u8).collect();
            Err(Error::Invalid(format!(
                "follow mode: rank 0 failed to look for new shards, so rank {} of {} stops too: \
                 {}",
                at.rank,
                at.world,
                String::from_utf8_lossy(&text)
            )))
        }
        k => bad(format!(
            "is of kind {k}, not 0 (a round), 1 (stopped) or 2 (failed)"
        )),
    }
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

    /// Rank 0's outcomes as the other ranks read them: a round, a stop and why, its error's
    /// text; a rank out of step (another round or epoch) fails instead of serving other rows.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a round of one range
    fn a_round_broadcast_carries_rank_0s_outcome_and_catches_ranks_out_of_step() {
        let sent: Arc<Mutex<Vec<u64>>> = Arc::default();
        let keep = sent.clone();
        let fo = FollowOptions {
            broadcast: Some(RoundBroadcast::new(move |v| match v {
                Some(v) => {
                    *locked(&keep) = v.clone();
                    Ok(v)
                }
                None => Ok(locked(&keep).clone()),
            })),
            ..FollowOptions::default()
        };
        let at = |rank, round| RoundAt {
            rank,
            world: 2,
            epoch: 3,
            round,
            units: 4,
        };
        let outcomes: [Result<Waited>; 3] = [
            Ok(Waited::New(vec![1..3])),
            Ok(Waited::Stopped(
                vec![true, false, true, false],
                Some(UNEVEN),
            )),
            Err(Error::Invalid("disk gone".into())),
        ];
        for found in outcomes {
            let want = format!("{found:?}");
            let mine = agree(&fo, at(0, 1), || found);
            assert_eq!(format!("{mine:?}"), want);
            let theirs = agree(&fo, at(1, 1), || unreachable!("only rank 0 looks"));
            match theirs {
                Err(e) => assert!(
                    e.to_string()
                        .contains("rank 0 failed to look for new shards")
                        && e.to_string().contains("disk gone"),
                    "{e}"
                ),
                Ok(w) => assert_eq!(format!("{:?}", Ok::<_, Error>(w)), want),
            }
        }
        agree(&fo, at(0, 1), || Ok(Waited::New(vec![0..1]))).unwrap();
        let e = agree(&fo, at(1, 2), || unreachable!())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("out of step: rank 0 formed round 1 of epoch 3")
                && e.contains("rank 1 of 2 needs round 2 of epoch 3"),
            "{e}"
        );
    }
}
