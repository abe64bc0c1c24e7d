//! [`Split::validate`]: both arrays streamed in pieces and checked against every invariant of
//! the format (flat_tokens.md §2.3): `seq_starts` starts at 0, never decreases and ends at
//! `token_count`; start bits sit exactly at the distinct sequence starts; every id is at most
//! `max_token_id`, itself below 2^31.

use super::Split;
use crate::error::Result;

/// Violations of one kind counted before a scan of damaged `seq_starts` stops.
const MAX_COUNTED: u64 = 1000;
/// Elements read at a time when scanning a whole array.
const SCAN_PIECE: u64 = 1 << 22;

impl Split {
    /// Every violation of the format's invariants (empty when valid): `seq_starts` starts at 0,
    /// never decreases and ends at `token_count`; start bits sit exactly at the distinct
    /// sequence starts below `token_count`; every id is at most `max_token_id`, itself below
    /// 2^31. Both arrays are streamed, so memory stays small whatever the size.
    pub fn validate(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(e) = self.scan(&mut problems) {
            problems.push(e.to_string());
        }
        problems
    }

    fn scan(&self, problems: &mut Vec<String>) -> Result<()> {
        let token_count = self.token_count();
        let m = self.starts.len();
        if self.max_token_id >= 1 << 31 {
            problems.push(format!(
                "max_token_id {} is not below 2^31",
                self.max_token_id
            ));
        }
        let mut starts = Scan::new(m);
        let first = starts.peek(self)?;
        if first != Some(0) {
            problems.push(format!("seq_starts[0] is {first:?}, must be 0"));
        }
        // Scan the tokens seq_starts accounts for: when the two disagree on the length, the
        // mismatch is reported below, and damaged metadata claiming billions of tokens does
        // not turn validation into a scan of fill values.
        let claimed = self.seq_starts(m - 1..m)?[0];
        let n = token_count.min(claimed);
        // Walk tokens and starts together. `next_start` is the smallest start not yet passed.
        let (mut bad_starts, mut bad_ids, mut max_seen) = (0u64, 0u64, 0u64);
        let (mut decreases, mut beyond) = (0u64, 0u64);
        let mut first_bad_start: Option<String> = None;
        let mut first_decrease: Option<String> = None;
        let mut prev: Option<u64> = None;
        let mut idx = 0u64; // index of the start `next_start` came from
        let mut next_start = starts.next(self)?;
        let mut at = 0u64;
        while at < n {
            let end = (at + SCAN_PIECE).min(n);
            let piece = self.encoded(at..end)?;
            for (k, &e) in piece.iter().enumerate() {
                let pos = at + k as u64;
                // Passing starts below pos (only possible when seq_starts decreases).
                let mut is_start = false;
                while let Some(s) = next_start {
                    if idx + 1 >= m || s > pos {
                        break;
                    }
                    if let Some(p) = prev {
                        if s < p {
                            decreases += 1;
                            first_decrease
                                .get_or_insert_with(|| format!("index {idx}: {p} then {s}"));
                        }
                    }
                    is_start |= s == pos;
                    prev = Some(s);
                    idx += 1;
                    next_start = starts.next(self)?;
                }
                if (e & 1 == 1) != is_start {
                    bad_starts += 1;
                    first_bad_start.get_or_insert_with(|| {
                        format!(
                            "token {pos}: start bit {} but {}a sequence start",
                            e & 1,
                            if is_start { "" } else { "not " }
                        )
                    });
                }
                let id = u64::from(e >> 1);
                max_seen = max_seen.max(id);
                if id > self.max_token_id {
                    bad_ids += 1;
                }
            }
            at = end;
        }
        // The remaining starts must all equal token_count (trailing empty sequences and the
        // end). Damaged metadata can claim billions of entries; counting stops at a limit.
        let mut last = prev;
        let mut misplaced = 0u64;
        let mut truncated = false;
        while let Some(s) = next_start {
            if let Some(p) = prev {
                if s < p {
                    decreases += 1;
                    first_decrease.get_or_insert_with(|| format!("index {idx}: {p} then {s}"));
                }
            }
            if s > token_count {
                beyond += 1;
            } else if s < token_count && idx + 1 < m {
                misplaced += 1;
            }
            prev = Some(s);
            last = Some(s);
            idx += 1;
            if decreases + beyond + misplaced >= MAX_COUNTED && idx + 1 < m {
                truncated = true;
                last = Some(self.seq_starts(m - 1..m)?[0]);
                break;
            }
            next_start = starts.next(self)?;
        }
        let at_least = if truncated { "at least " } else { "" };
        if misplaced > 0 {
            problems.push(format!(
                "{at_least}{misplaced} seq_starts entries after the last token are below \
                 token_count {token_count}"
            ));
        }
        if last != Some(token_count) {
            problems.push(format!(
                "seq_starts[-1] is {}, must equal token_count {token_count}",
                last.map_or("absent".into(), |v| v.to_string())
            ));
        }
        if decreases > 0 {
            let times = if decreases == 1 { "time" } else { "times" };
            problems.push(format!(
                "seq_starts decreases {at_least}{decreases} {times} (first at {})",
                first_decrease.unwrap_or_default()
            ));
        }
        if beyond > 0 {
            problems.push(format!(
                "{at_least}{beyond} seq_starts entries exceed token_count {token_count}"
            ));
        }
        if bad_starts > 0 {
            problems.push(format!(
                "{bad_starts} tokens whose start bit disagrees with seq_starts (first: {})",
                first_bad_start.unwrap_or_default()
            ));
        }
        if bad_ids > 0 {
            problems.push(format!(
                "{bad_ids} token ids exceed max_token_id {} (largest {max_seen})",
                self.max_token_id
            ));
        }
        Ok(())
    }
}

/// Streams a `seq_starts` column in pieces.
struct Scan {
    len: u64,
    next_piece: u64,
    buf: Vec<u64>,
    at: usize,
}

impl Scan {
    fn new(len: u64) -> Scan {
        Scan {
            len,
            next_piece: 0,
            buf: Vec::new(),
            at: 0,
        }
    }
    fn fill(&mut self, s: &Split) -> Result<()> {
        if self.at == self.buf.len() && self.next_piece < self.len {
            let end = (self.next_piece + SCAN_PIECE).min(self.len);
            self.buf = s.seq_starts(self.next_piece..end)?;
            self.next_piece = end;
            self.at = 0;
        }
        Ok(())
    }
    fn peek(&mut self, s: &Split) -> Result<Option<u64>> {
        self.fill(s)?;
        Ok(self.buf.get(self.at).copied())
    }
    fn next(&mut self, s: &Split) -> Result<Option<u64>> {
        let v = self.peek(s)?;
        self.at += usize::from(v.is_some());
        Ok(v)
    }
}
