//! Which row goes to which batch slot, decided before any I/O.
//!
//! An epoch's *global stream* is a permutation of all selected rows; it depends only on
//! `(seed, epoch)` and the dataset's blocks, never on world size, thread count or timing. Global
//! batch `g` is stream positions `[g·G, (g+1)·G)` with `G = world_size · batch_size`, and rank `r`
//! takes its slice of it, so a run restored from `cursor` (stream positions consumed) on any world
//! size with the same `G` continues the same global order.
//!
//! * `Sequential`: blocks in order, rows in order (served in windows of consecutive blocks).
//! * `Block`: blocks in a seeded random order, grouped into windows of at most `window_blocks`
//!   blocks (the memory budget); inside each window the rows are a uniform random permutation.
//!   Only a window's blocks need to be resident at a time.
//! * `Exact`: a keyed pseudo-random permutation of all rows (a Feistel network with cycle
//!   walking: O(1) memory, any position computable directly).

use crate::error::{Error, Result};

/// SplitMix64: a tiny, well-mixed, fully specified PRNG, so orders are reproducible everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    /// A uniform integer in `[0, bound)` (Lemire's method, unbiased).
    pub fn below(&mut self, bound: u64) -> u64 {
        debug_assert!(bound > 0);
        loop {
            let m = (self.next_u64() as u128) * (bound as u128);
            let low = m as u64;
            if low >= bound.wrapping_neg() % bound {
                return (m >> 64) as u64;
            }
        }
    }
}

/// The SplitMix64 finaliser.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A key derived from the seed, epoch and a purpose tag, so different uses never correlate.
pub(crate) fn derive_key(seed: u64, epoch: u64, purpose: u64) -> u64 {
    mix64(mix64(mix64(seed ^ 0x5348_4152_444b_4954) ^ epoch) ^ purpose)
}

/// A uniform random permutation of `0..n` (Fisher–Yates driven by SplitMix64).
pub(crate) fn shuffled(n: usize, key: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut rng = SplitMix64(key);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// A keyed bijection of `[0, n)` evaluated pointwise: a balanced Feistel network over the
/// smallest even bit width covering `n`, with cycle walking back into range.
#[derive(Debug, Clone)]
pub(crate) struct Feistel {
    n: u64,
    half_bits: u32,
    keys: [u64; 6],
}

impl Feistel {
    /// The permutation of `[0, n)` for `key`.
    pub(crate) fn new(n: u64, key: u64) -> Feistel {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut rng = SplitMix64(key);
        let keys = std::array::from_fn(|_| rng.next_u64());
        Feistel { n, half_bits, keys }
    }

    fn round(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for k in self.keys {
            let f = mix64(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i < n`.
    pub(crate) fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.round(i);
        while x >= self.n {
            x = self.round(x);
        }
        x
    }
}

/// The three orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Order {
    /// Rows in storage order.
    Sequential,
    /// Seeded block order, uniform shuffle inside bounded windows.
    Block,
    /// A pseudo-random permutation of all rows.
    Exact,
}

impl std::str::FromStr for Order {
    type Err = Error;
    fn from_str(s: &str) -> Result<Order> {
        match s {
            "sequential" | "ordered" => Ok(Order::Sequential),
            "block" => Ok(Order::Block),
            "exact" => Ok(Order::Exact),
            _ => Err(Error::Invalid(format!(
                "unknown order {s:?}: expected sequential, block or exact"
            ))),
        }
    }
}

impl Order {
    /// The option's name.
    pub fn name(self) -> &'static str {
        match self {
            Order::Sequential => "sequential",
            Order::Block => "block",
            Order::Exact => "exact",
        }
    }
}

/// A window of the block order: consecutive stream positions served from a set of blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Window {
    /// First stream position of the window.
    pub start: u64,
    /// Blocks, in the order their rows are numbered inside the window.
    pub blocks: Vec<u32>,
    /// Prefix sums of the blocks' row counts (`blocks.len() + 1` entries).
    pub row_prefix: Vec<u64>,
}

impl Window {
    /// Rows in the window.
    pub(crate) fn rows(&self) -> u64 {
        *self.row_prefix.last().unwrap_or(&0)
    }
    /// (block, row within block) of window-local row `q`.
    #[cfg(test)]
    pub(crate) fn locate(&self, q: u64) -> (u32, u64) {
        let i = self.row_prefix.partition_point(|&p| p <= q) - 1;
        (self.blocks[i], q - self.row_prefix[i])
    }
}

/// The complete order of one epoch over blocks with the given row counts.
#[derive(Debug, Clone)]
pub(crate) struct EpochOrder {
    order: Order,
    key: u64,
    /// Prefix sums of rows per block in storage order.
    block_prefix: Vec<u64>,
    windows: Vec<Window>,
    exact: Option<Feistel>,
}

impl EpochOrder {
    /// Plans an epoch. `rows_per_block[b]` is the number of selected rows of block `b`;
    /// `window_blocks` bounds the blocks of one window (sequential and block orders).
    pub(crate) fn new(
        order: Order,
        seed: u64,
        epoch: u64,
        rows_per_block: &[u64],
        window_blocks: u64,
    ) -> Result<EpochOrder> {
        if rows_per_block.len() > u32::MAX as usize {
            return Err(Error::Invalid("more than 2^32 blocks".into()));
        }
        let mut block_prefix = Vec::with_capacity(rows_per_block.len() + 1);
        block_prefix.push(0u64);
        for &r in rows_per_block {
            block_prefix.push(block_prefix.last().unwrap() + r);
        }
        let total = *block_prefix.last().unwrap();
        let key = derive_key(seed, epoch, order as u64);
        let mut windows = Vec::new();
        if order != Order::Exact {
            let perm: Vec<u32> = if order == Order::Block {
                shuffled(rows_per_block.len(), key)
            } else {
                (0..rows_per_block.len() as u32).collect()
            };
            let mut current = Window {
                start: 0,
                blocks: Vec::new(),
                row_prefix: vec![0],
            };
            for b in perm {
                let r = rows_per_block[b as usize];
                if r == 0 {
                    continue;
                }
                if current.blocks.len() as u64 >= window_blocks.max(1) {
                    let next_start = current.start + current.rows();
                    windows.push(std::mem::replace(
                        &mut current,
                        Window {
                            start: next_start,
                            blocks: Vec::new(),
                            row_prefix: vec![0],
                        },
                    ));
                }
                current.blocks.push(b);
                let p = current.rows() + r;
                current.row_prefix.push(p);
            }
            if !current.blocks.is_empty() {
                windows.push(current);
            }
        }
        let exact = (order == Order::Exact && total > 0).then(|| Feistel::new(total, key));
        Ok(EpochOrder {
            order,
            key,
            block_prefix,
            windows,
            exact,
        })
    }

    /// Rows in the epoch.
    pub(crate) fn len(&self) -> u64 {
        *self.block_prefix.last().unwrap()
    }
    /// The order.
    pub(crate) fn order(&self) -> Order {
        self.order
    }
    /// The windows of the sequential and block orders (empty for exact).
    pub(crate) fn windows(&self) -> &[Window] {
        &self.windows
    }
    /// The index of the window holding stream position `pos`.
    pub(crate) fn window_of(&self, pos: u64) -> usize {
        self.windows.partition_point(|w| w.start + w.rows() <= pos)
    }
    /// The order of window `w`'s local rows: uniform (keyed by seed, epoch and window) for the
    /// block order, the identity for the sequential order.
    pub(crate) fn window_permutation(&self, w: usize) -> Vec<u32> {
        let n = self.windows[w].rows() as usize;
        match self.order {
            Order::Block => shuffled(n, mix64(self.key ^ w as u64)),
            _ => (0..n as u32).collect(),
        }
    }
    /// (block, row within block) of a storage-order row index.
    pub(crate) fn locate_storage(&self, row: u64) -> (u32, u64) {
        let b = self.block_prefix.partition_point(|&p| p <= row) - 1;
        (b as u32, row - self.block_prefix[b])
    }
    /// (block, row within block) at stream position `pos` for the sequential and exact orders.
    /// (Block order is served window by window; see [`EpochOrder::windows`].)
    pub(crate) fn locate(&self, pos: u64) -> (u32, u64) {
        match &self.exact {
            Some(f) => self.locate_storage(f.apply(pos)),
            None => self.locate_storage(pos),
        }
    }
}

/// Rows of the epoch that rank `rank` of `world` serves, as stream ranges, for global batches of
/// `world · batch` rows: full global batches are split evenly; the final partial global batch is
/// dropped (`drop_last`) or split into near-equal contiguous parts.
pub(crate) fn rank_batches(
    total: u64,
    batch: u64,
    rank: u64,
    world: u64,
    drop_last: bool,
) -> impl Iterator<Item = (u64, u64)> {
    let global = batch * world;
    let full = total / global;
    let tail = total % global;
    let fulls = (0..full).map(move |g| {
        let s = g * global + rank * batch;
        (s, s + batch)
    });
    let tail_part = if drop_last || tail == 0 {
        None
    } else {
        let base = full * global;
        let q = tail / world;
        let r = tail % world;
        let start = base + rank * q + rank.min(r);
        let len = q + u64::from(rank < r);
        (len > 0).then_some((start, start + len))
    };
    fulls.chain(tail_part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feistel_is_a_bijection() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let f = Feistel::new(n, 42);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = f.apply(i) as usize;
                assert!(!seen[j]);
                seen[j] = true;
            }
        }
    }

    #[test]
    fn block_windows_cover_every_row_once() {
        let rows: Vec<u64> = (0..50).map(|b| (b % 7) as u64).collect();
        let o = EpochOrder::new(Order::Block, 3, 1, &rows, 4).unwrap();
        let mut seen = std::collections::HashSet::new();
        let mut pos = 0;
        for (wi, w) in o.windows().iter().enumerate() {
            assert_eq!(w.start, pos);
            assert!(w.blocks.len() <= 4);
            for q in o.window_permutation(wi) {
                assert!(seen.insert(w.locate(q as u64)));
            }
            pos += w.rows();
        }
        assert_eq!(seen.len() as u64, o.len());
        assert_eq!(o.window_of(0), 0);
    }

    #[test]
    fn rank_batches_partition_the_stream() {
        for (total, batch, world, drop) in [
            (103u64, 4u64, 3u64, false),
            (103, 4, 3, true),
            (5, 4, 3, false),
        ] {
            let mut covered = vec![0u8; total as usize];
            for r in 0..world {
                for (s, e) in rank_batches(total, batch, r, world, drop) {
                    assert!(e - s <= batch);
                    for p in s..e {
                        covered[p as usize] += 1;
                    }
                }
            }
            let kept = if drop {
                total / (batch * world) * batch * world
            } else {
                total
            };
            assert!(covered[..kept as usize].iter().all(|&c| c == 1));
            assert!(covered[kept as usize..].iter().all(|&c| c == 0));
        }
    }
}
