//! Model inputs from flat-tokens rows, as seqax's `train.py` builds them (flat_tokens.md §5.7).
//!
//! An encoded token is `id * 2 + 1` at a sequence start and `id * 2` otherwise. For a row:
//! `targets = enc >> 1`, `is_seq_start = enc & 1`, `inputs` = targets shifted right by one with 0
//! in column 0 and at every sequence start, and `segment_ids` = the running count of starts.

/// Decoded model inputs of `rows` rows of `len` tokens each, row-major.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decoded {
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
/// the one decoding loop behind [`decode`] and the token loaders' batches.
pub(crate) fn decode_into(
    enc: &[u32],
    targets: &mut [u32],
    inputs: &mut [u32],
    segments: &mut [u32],
    starts: &mut [u8],
) {
    let (mut prev, mut segment) = (0u32, 0u32);
    let outs = targets
        .iter_mut()
        .zip(inputs.iter_mut())
        .zip(segments.iter_mut())
        .zip(starts.iter_mut());
    for (i, (&e, (((target, input), seg), start))) in enc.iter().zip(outs).enumerate() {
        let (t, s) = (e >> 1, e & 1);
        segment += s;
        *input = if i == 0 || s == 1 { 0 } else { prev };
        *target = t;
        *seg = segment;
        *start = s as u8;
        prev = t;
    }
}

/// Decodes `enc` (`rows × len` encoded tokens).
pub fn decode(enc: &[u32], len: usize) -> Decoded {
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

    #[test]
    fn the_specs_worked_example() {
        let d = decode(&[3, 4, 7, 8, 10, 13, 14, 16], 8);
        assert_eq!(d.targets, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(d.inputs, [0, 1, 0, 3, 4, 0, 6, 7]);
        assert_eq!(d.segment_ids, [1, 1, 2, 2, 2, 3, 3, 3]);
    }
}
