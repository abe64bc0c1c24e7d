//! seqax's shuffling, bit for bit: numpy's `SeedSequence` and Philox4x64-10, seqax's
//! `_random_permutation`, and the closed-form (step, row) → sequence mapping of its
//! `ShufflingLoader` (flat_tokens.md §5.4–5.6, §6). Any step is computed directly; only the
//! read-block permutation and one buffer permutation per (minipoch, stream) are cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// numpy `SeedSequence(seed).generate_state(2, uint64)`: the Philox key of an integer seed.
pub(crate) fn seed_sequence_key(seed: u128) -> [u64; 2] {
    const INIT_A: u32 = 0x43b0_d7e5;
    const MULT_A: u32 = 0x931e_8875;
    const INIT_B: u32 = 0x8b51_f9dd;
    const MULT_B: u32 = 0x58f3_8ded;
    const MIX_MULT_L: u32 = 0xca01_f9dd;
    const MIX_MULT_R: u32 = 0x4973_f715;
    // Entropy: 32-bit words, least significant first; 0 is one word.
    let mut entropy = Vec::new();
    let mut s = seed;
    loop {
        entropy.push(s as u32);
        s >>= 32;
        if s == 0 {
            break;
        }
    }
    let mut h = INIT_A;
    let mut hashmix = |mut v: u32| {
        v ^= h;
        h = h.wrapping_mul(MULT_A);
        v = v.wrapping_mul(h);
        v ^ (v >> 16)
    };
    let mix = |x: u32, y: u32| {
        let r = MIX_MULT_L
            .wrapping_mul(x)
            .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
        r ^ (r >> 16)
    };
    let mut pool = [0u32; 4];
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(entropy.get(i).copied().unwrap_or(0));
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let hm = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], hm);
            }
        }
    }
    for &e in entropy.iter().skip(4) {
        for p in pool.iter_mut() {
            let hm = hashmix(e);
            *p = mix(*p, hm);
        }
    }
    let mut h = INIT_B;
    let mut w = [0u64; 4];
    for (i, out) in w.iter_mut().enumerate() {
        let mut v = pool[i] ^ h;
        h = h.wrapping_mul(MULT_B);
        v = v.wrapping_mul(h);
        *out = u64::from(v ^ (v >> 16));
    }
    [w[0] | w[1] << 32, w[2] | w[3] << 32]
}

/// numpy's Philox4x64-10 bit generator, for `random_raw` (the tests check [`philox_block`]
/// against numpy's stream through it).
#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct Philox {
    counter: [u64; 4],
    key: [u64; 2],
    buffer: [u64; 4],
    used: usize,
}

#[cfg(test)]
impl Philox {
    /// numpy `Philox(seed)`.
    pub(crate) fn from_seed(seed: u128) -> Philox {
        Philox::from_key(seed_sequence_key(seed))
    }
    /// numpy `Philox(key=key)`.
    pub(crate) fn from_key(key: [u64; 2]) -> Philox {
        Philox {
            counter: [0; 4],
            key,
            buffer: [0; 4],
            used: 4,
        }
    }
    /// The next raw 64-bit output (`random_raw()`).
    pub(crate) fn next_u64(&mut self) -> u64 {
        if self.used == 4 {
            // numpy increments the counter before computing each block.
            for c in self.counter.iter_mut() {
                *c = c.wrapping_add(1);
                if *c != 0 {
                    break;
                }
            }
            self.buffer = philox_block(self.counter, self.key);
            self.used = 0;
        }
        self.used += 1;
        self.buffer[self.used - 1]
    }
}

/// One Philox4x64-10 block: the four outputs at `counter` under `key`.
fn philox_block(counter: [u64; 4], key: [u64; 2]) -> [u64; 4] {
    const M0: u64 = 0xD2E7_470E_E14C_6C93;
    const M1: u64 = 0xCA5A_8263_9512_1157;
    const W0: u64 = 0x9E37_79B9_7F4A_7C15;
    const W1: u64 = 0xBB67_AE85_84CA_A73B;
    let mut x = counter;
    for i in 0..10u64 {
        let k0 = key[0].wrapping_add(i.wrapping_mul(W0));
        let k1 = key[1].wrapping_add(i.wrapping_mul(W1));
        let p0 = u128::from(M0) * u128::from(x[0]);
        let p1 = u128::from(M1) * u128::from(x[2]);
        x = [
            (p1 >> 64) as u64 ^ x[1] ^ k0,
            p1 as u64,
            (p0 >> 64) as u64 ^ x[3] ^ k1,
            p0 as u64,
        ];
    }
    x
}

/// seqax's `_random_permutation(seed, n)`: Fisher–Yates over `0..n` driven by Philox outputs
/// consumed in reverse (`j_i = u[i] mod (i + 1)`, no rejection), as seqax promises never to
/// change. Output `i` is word `i mod 4` of the block at counter `i / 4 + 1`, so the outputs are
/// computed in reverse as they are needed instead of being stored (4 bytes per element).
pub(crate) fn perm(seed: u128, n: usize) -> Vec<u32> {
    let key = seed_sequence_key(seed);
    let mut a: Vec<u32> = (0..n as u32).collect();
    let mut block = [0u64; 4];
    for i in (0..n).rev() {
        if i == n - 1 || i % 4 == 3 {
            block = philox_block([(i / 4) as u64 + 1, 0, 0, 0], key);
        }
        let j = (block[i % 4] % (i as u64 + 1)) as usize;
        a.swap(i, j);
    }
    a
}

/// The largest permutation computed (read blocks, or sequences in a shuffle buffer).
const MAX_PERM: u64 = 1 << 28;

/// The shuffle parameters of seqax's `FlatTokensParams` plus the batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShuffleParams {
    /// Rows per step (`batch`).
    pub batch: u64,
    /// Streams (S; the maximum number of hosts).
    pub streams: u64,
    /// Read blocks per shuffle buffer (R).
    pub read_blocks_per_shuffle_buffer: u64,
    /// Sequences per read block (B).
    pub sequences_per_read_block: u64,
    /// Seed.
    pub seed: u64,
}

/// Which sequence every (step, row) of an epoch is, computed in closed form (§5.5).
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    p: ShuffleParams,
    /// The seed of this epoch's permutations: `seed + epoch * 2^64` (epoch 0 is seqax's).
    base_seed: u128,
    epoch: u64,
    rbc: u64,
    step_count: u64,
    minipochs: u64,
    bips: u64,
    p0: Arc<Vec<u32>>,
    buffers: Arc<Mutex<BufferPerms>>,
}

/// Cached buffer permutations by (minipoch, stream).
type BufferPerms = HashMap<(u64, u64), Arc<Vec<u32>>>;

impl Schedule {
    /// seqax's schedule over `n_seq` sequences (packed rows or documents).
    pub(crate) fn new(n_seq: u64, p: ShuffleParams) -> Result<Schedule> {
        Schedule::for_epoch(n_seq, p, 0)
    }

    /// The schedule of epoch `epoch`: seqax's with the seed `seed + epoch * 2^64`. Epoch 0 is
    /// exactly seqax's order; later epochs are new orders that seqax itself reproduces when
    /// given that (arbitrary-precision) seed. Within epoch 0 the derived seeds
    /// `seed + 1 + m*S + s` stay below 2^64 + 2^33, so epochs never share a permutation seed.
    pub(crate) fn for_epoch(n_seq: u64, p: ShuffleParams, epoch: u64) -> Result<Schedule> {
        let (s, r, b) = (
            p.streams,
            p.read_blocks_per_shuffle_buffer,
            p.sequences_per_read_block,
        );
        if s == 0 || r == 0 || b == 0 || p.batch == 0 {
            return Err(Error::Invalid(
                "batch, streams, read_blocks_per_shuffle_buffer and sequences_per_read_block \
                 must be positive"
                    .into(),
            ));
        }
        if !p.batch.is_multiple_of(s) {
            return Err(Error::Invalid(format!(
                "batch {} must be a multiple of streams {s} (rows per stream per step)",
                p.batch
            )));
        }
        let rbc = ((n_seq / b) / s) * s;
        if rbc == 0 {
            return Err(Error::Invalid(format!(
                "{n_seq} sequences make no full read block of {b} on each of {s} streams (use \
                 smaller read blocks or fewer streams)"
            )));
        }
        // seqax allows up to 2^32 - 1; the permutation is held in memory (4 bytes a block), and
        // 2^28 read blocks already cover 2^48 tokens at seqax's recommended block size.
        if rbc > MAX_PERM {
            return Err(Error::Invalid(format!(
                "{n_seq} sequences make {rbc} read blocks of {b}; at most 2^28 are supported \
                 (use larger read blocks)"
            )));
        }
        let step_count = (rbc * b) / p.batch;
        if step_count == 0 {
            return Err(Error::Invalid(format!(
                "{} usable sequences cannot fill one batch of {}",
                rbc * b,
                p.batch
            )));
        }
        let buffer = r.min(rbc / s).saturating_mul(b);
        if buffer > MAX_PERM {
            return Err(Error::Invalid(format!(
                "a shuffle buffer of {r} read blocks of {b} sequences ({buffer}) exceeds 2^28 \
                 sequences (its permutation is held in memory); lower \
                 read_blocks_per_shuffle_buffer or sequences_per_read_block"
            )));
        }
        if epoch >= 1 << 62 {
            return Err(Error::Invalid(format!(
                "epoch {epoch} is too large (at most 2^62 - 1)"
            )));
        }
        let base_seed = u128::from(p.seed) + (u128::from(epoch) << 64);
        Ok(Schedule {
            p,
            base_seed,
            epoch,
            rbc,
            step_count,
            minipochs: rbc.div_ceil(s * r),
            bips: p.batch / s,
            p0: Arc::new(perm(base_seed, rbc as usize)),
            buffers: Arc::default(),
        })
    }
    /// Read blocks used (`rbc`).
    pub(crate) fn read_blocks(&self) -> u64 {
        self.rbc
    }
    /// Steps in the epoch.
    pub(crate) fn step_count(&self) -> u64 {
        self.step_count
    }
    /// Minipochs (shuffle buffers per stream).
    pub(crate) fn minipochs(&self) -> u64 {
        self.minipochs
    }
    /// Rows each stream contributes to a step.
    pub(crate) fn rows_per_stream(&self) -> u64 {
        self.bips
    }
    /// The parameters.
    pub(crate) fn params(&self) -> &ShuffleParams {
        &self.p
    }
    /// The epoch this schedule orders.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Read blocks in each stream's buffer of minipoch `m` (R, fewer in the last).
    pub(crate) fn blocks_in(&self, m: u64) -> u64 {
        let (sn, r) = (self.p.streams, self.p.read_blocks_per_shuffle_buffer);
        if m < self.minipochs - 1 {
            r
        } else {
            self.rbc / sn - r * m
        }
    }

    fn buffer_perm(&self, m: u64, s: u64) -> Arc<Vec<u32>> {
        let mut cache = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&(m, s)) {
            return p.clone();
        }
        let (sn, b) = (self.p.streams, self.p.sequences_per_read_block);
        let blocks_m = self.blocks_in(m);
        let seed = self.base_seed + 1 + u128::from(m) * u128::from(sn) + u128::from(s);
        let p = Arc::new(perm(seed, (blocks_m * b) as usize));
        // Keep the cache small: a stream moves through minipochs in order.
        if cache.len() > 4 * sn as usize {
            cache.clear();
        }
        cache.insert((m, s), p.clone());
        p
    }

    /// The sequence at row `b` of step `t`.
    pub(crate) fn sequence(&self, t: u64, b: u64) -> Result<u64> {
        if t >= self.step_count || b >= self.p.batch {
            return Err(Error::OutOfRange {
                what: if t >= self.step_count {
                    "step"
                } else {
                    "batch row"
                },
                index: if t >= self.step_count {
                    t as i64
                } else {
                    b as i64
                },
                len: if t >= self.step_count {
                    self.step_count
                } else {
                    self.p.batch
                },
            });
        }
        let (sn, r, bb) = (
            self.p.streams,
            self.p.read_blocks_per_shuffle_buffer,
            self.p.sequences_per_read_block,
        );
        let (m, s, row) = self.position(t, b);
        let p = u64::from(self.buffer_perm(m, s)[row as usize]);
        let block = u64::from(self.p0[((m * r + p / bb) * sn + s) as usize]);
        Ok(block * bb + p % bb)
    }

    /// Where row `b` of step `t` is drawn from (§5.4): (minipoch, stream, row of that
    /// stream's shuffled buffer).
    fn position(&self, t: u64, b: u64) -> (u64, u64, u64) {
        let per_buffer = self.p.read_blocks_per_shuffle_buffer * self.p.sequences_per_read_block;
        let q = t * self.bips + b % self.bips;
        (q / per_buffer, b / self.bips, q % per_buffer)
    }

    /// The shuffle buffer (minipoch, stream) that row `b` of step `t` is drawn from.
    pub(crate) fn buffer_of(&self, t: u64, b: u64) -> (u64, u64) {
        let (m, s, _) = self.position(t, b);
        (m, s)
    }

    /// The read blocks making up stream `s`'s buffer in minipoch `m` (block `k` holds sequences
    /// `[k·B, (k+1)·B)`), in buffer order.
    pub(crate) fn buffer_blocks(&self, m: u64, s: u64) -> Vec<u64> {
        let (sn, r) = (self.p.streams, self.p.read_blocks_per_shuffle_buffer);
        if m >= self.minipochs || s >= sn {
            return Vec::new();
        }
        (0..self.blocks_in(m))
            .map(|k| u64::from(self.p0[((m * r + k) * sn + s) as usize]))
            .collect()
    }

    /// Every row of step `t`.
    #[cfg(test)]
    pub(crate) fn step(&self, t: u64) -> Result<Vec<u64>> {
        (0..self.p.batch).map(|b| self.sequence(t, b)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_sequence_matches_numpy() {
        assert_eq!(
            seed_sequence_key(0),
            [15793235383387715774, 12390638538380655177]
        );
        assert_eq!(
            seed_sequence_key(1 << 32),
            [5836529245451711556, 8811601478698894690]
        );
    }

    #[test]
    fn philox_and_perm_match_numpy_and_seqax() {
        let mut g = Philox::from_key([0, 0]);
        let raw: Vec<u64> = (0..5).map(|_| g.next_u64()).collect();
        assert_eq!(
            raw,
            [
                213000021201967259,
                4455796210202625458,
                2055444239878205049,
                10411612076246414556,
                9267267987884836803
            ]
        );
        assert_eq!(perm(0, 10), [0, 4, 6, 5, 2, 1, 9, 3, 7, 8]);
        assert_eq!(perm(7, 1), [0]);
    }
}
