//! Batches of a flat-tokens split in seqax's shuffled order (flat_tokens.md §5, §9.5–9.6).
//!
//! Step `t` is computed in closed form ([`Schedule`]) and only its own rows are read: a packed
//! row is one range of `len` tokens; an unpacked row is one document, truncated to `len` and
//! right-padded (seqax's pad value, encoded 1) with `mask` false on the padding. Offsets are
//! absolute, so every read block is correct (seqax's unpacked mode is not).

use crate::error::{Error, Result};
use crate::flat_tokens::decode::{decode, Decoded};
use crate::flat_tokens::seqax::{Schedule, ShuffleParams};
use crate::flat_tokens::Split;

/// How rows are cut from the token stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// Row i is tokens `[i·len, (i+1)·len)`; documents run across rows.
    Packed,
    /// Row i is document i (truncated to `len`, padded).
    Unpacked,
}

/// One step's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    /// The sequence (packed row or document) index of each row.
    pub rows: Vec<u64>,
    /// Encoded tokens, `rows × len`.
    pub encoded: Vec<u32>,
    /// True for real tokens, false for padding (always true when packed).
    pub mask: Vec<bool>,
    /// Model inputs decoded from `encoded`.
    pub decoded: Decoded,
}

/// seqax-compatible loader over one split.
#[derive(Debug)]
pub struct TokenLoader {
    split: Split,
    len: u64,
    packing: Packing,
    schedule: Schedule,
}

impl TokenLoader {
    /// A loader of rows of `len` tokens with seqax's shuffle parameters.
    pub fn new(split: Split, len: u64, packing: Packing, params: ShuffleParams) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("len must be at least 1".into()));
        }
        let n_seq = match packing {
            Packing::Packed => split.token_count() / len,
            Packing::Unpacked => split.seq_count(),
        };
        let schedule = Schedule::new(n_seq, params)?;
        Ok(TokenLoader {
            split,
            len,
            packing,
            schedule,
        })
    }
    /// Steps in an epoch.
    pub fn step_count(&self) -> u64 {
        self.schedule.step_count()
    }
    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
    /// The split.
    pub fn split(&self) -> &Split {
        &self.split
    }

    /// Rows `rows` (a host's share) of step `step`.
    pub fn load_rows(&self, step: u64, rows: std::ops::Range<u64>) -> Result<TokenBatch> {
        let len = self.len as usize;
        let mut out = TokenBatch {
            rows: Vec::with_capacity(rows.clone().count()),
            encoded: Vec::with_capacity(rows.clone().count() * len),
            mask: Vec::with_capacity(rows.clone().count() * len),
            decoded: Decoded::default(),
        };
        for b in rows {
            let seq = self.schedule.sequence(step, b)?;
            let (start, end) = match self.packing {
                Packing::Packed => (seq * self.len, (seq + 1) * self.len),
                Packing::Unpacked => {
                    let s = self.split.seq_starts();
                    let (a, z) = (s[seq as usize], s[seq as usize + 1]);
                    (a, z.min(a + self.len))
                }
            };
            let tokens = self.split.encoded(start..end)?;
            let real = tokens.len();
            out.encoded.extend_from_slice(&tokens);
            out.encoded.extend(std::iter::repeat_n(1u32, len - real));
            out.mask.extend(std::iter::repeat_n(true, real));
            out.mask.extend(std::iter::repeat_n(false, len - real));
            out.rows.push(seq);
        }
        out.decoded = decode(&out.encoded, len);
        Ok(out)
    }

    /// Every row of step `step`.
    pub fn load(&self, step: u64) -> Result<TokenBatch> {
        self.load_rows(step, 0..self.schedule.params().batch)
    }
}
