//! A step's batch: every array of its rows in one buffer ([`TokenBatch`]), and their layout.

use safetensors::Dtype;

use crate::io::buffer::{lay_out, Buffer, Field};

/// One step's rows (this host's share): every array in one page-aligned buffer, each
/// `rows × seq_len`: `encoded` (uint32, as stored: padding is seqax's encoded 1), the decoded
/// `targets`, `inputs` and `segment_ids` (int32), and `is_seq_start` and `mask` (bool: one
/// byte, 0 or 1).
#[derive(Debug)]
pub struct TokenBatch {
    /// The step (counting across epochs when epochs are enabled).
    pub step: u64,
    /// Tokens per row.
    pub seq_len: usize,
    /// The sequence (packed row or document) index of each row.
    pub rows: Vec<u64>,
    data: Buffer,
    fields: Vec<Field>,
}

/// A batch's arrays (see [`TokenBatch::arrays`]), each `rows × seq_len`, row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TokenArrays<'a> {
    /// Encoded tokens as stored (`id*2+1` at a sequence start), padding included.
    pub encoded: &'a [u32],
    /// Token ids to predict (`encoded >> 1`).
    pub targets: &'a [u32],
    /// Ids fed to the model (0 at column 0 and at sequence starts).
    pub inputs: &'a [u32],
    /// Cumulative count of sequence starts along each row.
    pub segment_ids: &'a [u32],
    /// 1 where a position starts a sequence.
    pub is_seq_start: &'a [u8],
    /// 1 for real tokens, 0 for padding (always 1 when packed).
    pub mask: &'a [u8],
}

/// The arrays of a batch, in buffer order.
const FIELDS: [(&str, Dtype); 6] = [
    ("encoded", Dtype::U32),
    ("targets", Dtype::I32),
    ("inputs", Dtype::I32),
    ("segment_ids", Dtype::I32),
    ("is_seq_start", Dtype::BOOL),
    ("mask", Dtype::BOOL),
];

/// Equal when the steps, rows and every array's contents are.
impl PartialEq for TokenBatch {
    fn eq(&self, other: &Self) -> bool {
        self.step == other.step
            && self.seq_len == other.seq_len
            && self.rows == other.rows
            && self.fields.len() == other.fields.len()
            && self
                .fields()
                .zip(other.fields())
                .all(|((f, a), (g, b))| f.name == g.name && f.shape == g.shape && a == b)
    }
}

impl TokenBatch {
    /// The batch of `step`: `rows` (sequence indexes) laid out as `fields` in `data`.
    pub(crate) fn new(
        step: u64,
        seq_len: usize,
        rows: Vec<u64>,
        data: Buffer,
        fields: Vec<Field>,
    ) -> TokenBatch {
        TokenBatch {
            step,
            seq_len,
            rows,
            data,
            fields,
        }
    }
    fn array(&self, i: usize) -> &Field {
        &self.fields[i]
    }
    /// Every array, typed.
    pub fn arrays(&self) -> TokenArrays<'_> {
        let d = &self.data;
        TokenArrays {
            encoded: d.field_u32(self.array(0)),
            targets: d.field_u32(self.array(1)),
            inputs: d.field_u32(self.array(2)),
            segment_ids: d.field_u32(self.array(3)),
            is_seq_start: d.field(self.array(4)),
            mask: d.field(self.array(5)),
        }
    }
    /// Every array with its bytes.
    fn fields(&self) -> impl Iterator<Item = (&Field, &[u8])> {
        self.fields.iter().map(|f| (f, self.data.field(f)))
    }
    /// The buffer and its arrays (for zero-copy hand-off).
    pub fn into_parts(self) -> (Buffer, Vec<Field>) {
        (self.data, self.fields)
    }
}

/// The arrays of a batch of `rows` rows of `seq_len` and the bytes they need.
pub(crate) fn batch_layout(rows: u64, seq_len: u64) -> (Vec<Field>, usize) {
    let shape = vec![rows as usize, seq_len as usize];
    let arrays: Vec<(&'static str, Dtype, Vec<usize>)> =
        FIELDS.iter().map(|&(n, d)| (n, d, shape.clone())).collect();
    lay_out(&arrays)
}
