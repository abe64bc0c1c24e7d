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

/// One decoded position of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    /// The token id to predict.
    pub target: u32,
    /// The id fed to the model.
    pub input: u32,
    /// Whether the position starts a sequence.
    pub start: bool,
    /// Starts so far along the row.
    pub segment: u32,
}

/// The positions of one row of encoded tokens.
pub(crate) fn decode_row(row: impl IntoIterator<Item = u32>) -> impl Iterator<Item = Position> {
    let (mut prev, mut segment) = (0u32, 0u32);
    row.into_iter().enumerate().map(move |(i, e)| {
        let (target, start) = (e >> 1, e & 1 == 1);
        segment += u32::from(start);
        let input = if i == 0 || start { 0 } else { prev };
        prev = target;
        Position {
            target,
            input,
            start,
            segment,
        }
    })
}

/// Decodes `enc` (`rows × len` encoded tokens).
pub fn decode(enc: &[u32], len: usize) -> Decoded {
    let mut d = Decoded {
        targets: Vec::with_capacity(enc.len()),
        inputs: Vec::with_capacity(enc.len()),
        is_seq_start: Vec::with_capacity(enc.len()),
        segment_ids: Vec::with_capacity(enc.len()),
    };
    for row in enc.chunks(len.max(1)) {
        for p in decode_row(row.iter().copied()) {
            d.inputs.push(p.input);
            d.targets.push(p.target);
            d.is_seq_start.push(p.start);
            d.segment_ids.push(p.segment);
        }
    }
    d
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
