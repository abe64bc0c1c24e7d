//! Shuffle quality, measured rather than asserted by feel.
//!
//! The entropy follows MosaicML streaming's simulator (`get_entropy`): for an ordering of sample
//! ids, the Shannon entropy in bits of the distribution of `|id[k+1] − id[k]|`; the reported
//! quality is that entropy over sample ids plus the same over their group (shard) ids. Here a
//! sample is a row in storage order and its group is its example, so a sequential stream scores
//! near 0 and a uniform permutation scores highest. The mean number of distinct examples per
//! batch says how well a batch mixes examples.

use std::collections::{HashMap, HashSet};

/// Shuffle-quality figures of one stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShuffleQuality {
    /// Rows measured.
    pub rows: u64,
    /// Batch size used for the per-batch figure.
    pub batch_size: u64,
    /// Entropy (bits) of |Δ row id|.
    pub row_entropy_bits: f64,
    /// Entropy (bits) of |Δ example id|.
    pub example_entropy_bits: f64,
    /// MosaicML's quality: the sum of the two entropies.
    pub entropy_bits: f64,
    /// Mean number of distinct examples in a batch.
    pub mean_distinct_examples_per_batch: f64,
}

/// Entropy in bits of the distribution of absolute differences between neighbours.
pub(crate) fn diff_entropy(ids: &[u64]) -> f64 {
    if ids.len() < 2 {
        return 0.0;
    }
    let mut counts: HashMap<u64, u64> = HashMap::new();
    for w in ids.windows(2) {
        *counts.entry(w[0].abs_diff(w[1])).or_default() += 1;
    }
    let n = (ids.len() - 1) as f64;
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum()
}

/// Quality of a stream of `(row id, example id)` pairs cut into batches of `batch_size`.
pub fn shuffle_quality(rows: &[u64], examples: &[u64], batch_size: u64) -> ShuffleQuality {
    let row_e = diff_entropy(rows);
    let ex_e = diff_entropy(examples);
    let bs = batch_size.max(1) as usize;
    let batches: Vec<usize> = examples
        .chunks(bs)
        .map(|c| c.iter().collect::<HashSet<_>>().len())
        .collect();
    let mean = if batches.is_empty() {
        0.0
    } else {
        batches.iter().sum::<usize>() as f64 / batches.len() as f64
    };
    ShuffleQuality {
        rows: rows.len() as u64,
        batch_size,
        row_entropy_bits: row_e,
        example_entropy_bits: ex_e,
        entropy_bits: row_e + ex_e,
        mean_distinct_examples_per_batch: mean,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_scores_zero_and_shuffled_scores_high() {
        let seq: Vec<u64> = (0..1000).collect();
        let ex: Vec<u64> = seq.iter().map(|r| r / 10).collect();
        let q = shuffle_quality(&seq, &ex, 100);
        assert_eq!(q.row_entropy_bits, 0.0);
        assert!(q.example_entropy_bits < 0.5);
        assert_eq!(q.mean_distinct_examples_per_batch, 10.0);
        let perm = crate::engine::order::shuffled(1000, 7);
        let rows: Vec<u64> = perm.iter().map(|&r| r as u64).collect();
        let ex: Vec<u64> = rows.iter().map(|r| r / 10).collect();
        let q = shuffle_quality(&rows, &ex, 100);
        assert!(q.entropy_bits > 12.0, "{q:?}");
        assert!(q.mean_distinct_examples_per_batch > 60.0);
    }
}
