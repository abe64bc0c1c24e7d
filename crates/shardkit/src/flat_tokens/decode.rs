//! Model inputs from flat-tokens rows, as seqax's `train.py` builds them (flat_tokens.md §5.7).
//!
//! An encoded token is `id * 2 + 1` at a sequence start and `id * 2` otherwise. For a row:
//! `targets = enc >> 1`, `is_seq_start = enc & 1`, `inputs` = targets shifted right by one with 0
//! in column 0 and at every sequence start, and `segment_ids` = the running count of starts.

/// Decoded model inputs of `rows` rows of `len` tokens each, row-major.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Decoded {
    /// Token ids to predict.
    pub targets: Vec<u32>,
    /// Ids fed to the model (0 at column 0 and at sequence starts: the BOS convention).
    pub inputs: Vec<u32>,
    /// Whether a position starts a sequence.
    pub is_seq_start: Vec<bool>,
    /// Cumulative count of starts along the row (attention stays within a segment).
    pub segment_ids: Vec<u32>,
}

/// Writes the model inputs of one row of encoded tokens, `enc`, into slices of its length:
/// the one decoding routine behind `decode` (the tests') and the token loaders' batches. Each output is its
/// own pass with no state carried from one token to the next, except the running count of
/// segments: those passes vectorize (a fused loop carrying the previous target did not).
pub(crate) fn decode_into(
    enc: &[u32],
    targets: &mut [u32],
    inputs: &mut [u32],
    segments: &mut [u32],
    starts: &mut [u8],
) {
    let n = (enc.len())
        .min(targets.len())
        .min(inputs.len())
        .min(segments.len())
        .min(starts.len());
    let (enc, targets, inputs, segments, starts) = (
        &enc[..n],
        &mut targets[..n],
        &mut inputs[..n],
        &mut segments[..n],
        &mut starts[..n],
    );
    for ((t, s), &e) in targets.iter_mut().zip(starts.iter_mut()).zip(enc) {
        *t = e >> 1;
        *s = (e & 1) as u8;
    }
    // The previous token's id, 0 in column 0 and at a sequence start.
    if let Some((first, rest)) = inputs.split_first_mut() {
        *first = 0;
        for ((i, &e), &prev) in rest.iter_mut().zip(&enc[1..]).zip(enc) {
            // All ones unless `e` starts a sequence: no branch, so the loop vectorizes.
            let keep = (e & 1).wrapping_sub(1);
            *i = (prev >> 1) & keep;
        }
    }
    let mut segment = 0u32;
    for (s, &e) in segments.iter_mut().zip(enc) {
        segment += e & 1;
        *s = segment;
    }
}

/// Decodes `enc` (`rows × len` encoded tokens).
#[cfg(test)]
pub(crate) fn decode(enc: &[u32], len: usize) -> Decoded {
    let n = enc.len();
    let (mut targets, mut inputs, mut segment_ids) = (vec![0; n], vec![0; n], vec![0; n]);
    let mut starts = vec![0u8; n];
    let len = len.max(1);
    for (k, row) in enc.chunks(len).enumerate() {
        let at = k * len..k * len + row.len();
        decode_into(
            row,
            &mut targets[at.clone()],
            &mut inputs[at.clone()],
            &mut segment_ids[at.clone()],
            &mut starts[at],
        );
    }
    Decoded {
        targets,
        inputs,
        is_seq_start: starts.into_iter().map(|s| s == 1).collect(),
        segment_ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of the module docs, token by token.
    fn by_the_rules(enc: &[u32]) -> Decoded {
        let mut d = Decoded::default();
        let (mut prev, mut segment) = (0, 0);
        for (i, &e) in enc.iter().enumerate() {
            let (t, s) = (e >> 1, e & 1 == 1);
            segment += u32::from(s);
            d.inputs.push(if i == 0 || s { 0 } else { prev });
            d.targets.push(t);
            d.segment_ids.push(segment);
            d.is_seq_start.push(s);
            prev = t;
        }
        d
    }

    #[test]
    fn every_row_decodes_by_the_rules() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for len in [0, 1, 2, 3, 7, 8, 31, 64, 1000] {
            for starts_per_16 in [0, 1, 8, 16] {
                let enc: Vec<u32> = (0..len)
                    .map(|_| {
                        let r = next();
                        let id = (r >> 8) as u32 & 0x7fff_ffff;
                        id << 1 | u32::from((r & 15) < starts_per_16)
                    })
                    .collect();
                assert_eq!(
                    decode(&enc, len.max(1)),
                    by_the_rules(&enc),
                    "{len} {starts_per_16}"
                );
            }
        }
        // Rows decode one by one: each row's column 0 is an input of 0, and its segments
        // count from its own first start.
        let enc: Vec<u32> = (0..12).map(|i| i * 2 + u32::from(i % 5 == 1)).collect();
        let d = decode(&enc, 4);
        for (k, row) in enc.chunks(4).enumerate() {
            let r = by_the_rules(row);
            assert_eq!(d.inputs[k * 4..k * 4 + 4], r.inputs[..]);
            assert_eq!(d.segment_ids[k * 4..k * 4 + 4], r.segment_ids[..]);
        }
    }

    #[test]
    fn the_specs_worked_example() {
        let d = decode(&[3, 4, 7, 8, 10, 13, 14, 16], 8);
        assert_eq!(d.targets, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(d.inputs, [0, 1, 0, 3, 4, 0, 6, 7]);
        assert_eq!(d.segment_ids, [1, 1, 2, 2, 2, 3, 3, 3]);
    }
}
