//! What the follow-mode loaders (saev's, EAGLE-3's) share: how they wait for parts, and their
//! rounds as the state key `follow_rounds` (see saev/follow.rs for the design: an epoch is a
//! sequence of rounds, each the planned order restricted to the units durable when it starts
//! and not served before).

use std::ops::Range;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::error::{Error, Result};

/// Refuses what a follow-mode loader cannot do on a `what` ("dataset", "cache") at `path` still
/// being written: read with several ranks (its rounds depend on when the loader looks, so ranks
/// reading apart would split different rows), drop each round's last partial batch, or verify
/// against a checksum sidecar that the commit writes.
pub(crate) fn refuse_while_written(
    path: &Path,
    what: &str,
    world: u64,
    drop_last: bool,
    verify: bool,
) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::Invalid(format!(
            "{}: follow mode on a {what} still being written {why}",
            path.display()
        )))
    };
    if world > 1 {
        return refuse(format!(
            "reads with world_size 1 only (got {world}): its rounds depend on when the loader \
             looks, so ranks reading apart would split different rows; read with one process, \
             or wait for the commit"
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
pub(crate) enum Waited {
    /// A new round: the units durable now and not served yet, as ranges.
    New(Vec<Range<u64>>),
    /// Given up (`why`, or the timeout passed), with the units durable at the last look.
    Stopped(Vec<bool>, Option<&'static str>),
}

/// Looks (`durable_now`, one flag a unit) until a unit not `served` is durable, polling every
/// `poll` up to `timeout` (and stopping when `interrupted` says so).
pub(crate) fn wait_new(
    fo: &FollowOptions,
    served: &[bool],
    mut durable_now: impl FnMut() -> Result<Vec<bool>>,
) -> Result<Waited> {
    let since = std::time::Instant::now();
    loop {
        let durable = durable_now()?;
        let new: Vec<bool> = durable.iter().zip(served).map(|(&d, &s)| d && !s).collect();
        if new.iter().any(|&n| n) {
            return Ok(Waited::New(ranges_of(&new)));
        }
        if since.elapsed() >= fo.timeout {
            return Ok(Waited::Stopped(durable, None));
        }
        if let Some(WaitCheck(interrupted)) = fo.interrupted {
            if interrupted() {
                return Ok(Waited::Stopped(durable, Some("it was interrupted")));
            }
        }
        std::thread::sleep(fo.poll.min(fo.timeout));
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
}
