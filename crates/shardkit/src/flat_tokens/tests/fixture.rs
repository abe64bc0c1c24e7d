//! seqax's own sample dataset (tests/flat_tokens_fixture.rs reads it through the public API):
//! what only the crate reaches.

use std::path::{Path, PathBuf};

use crate::flat_tokens::decode::decode;
use crate::flat_tokens::Split;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/flat_tokens/seqax_synthetic_dataset.zarr")
}

#[test]
fn the_first_document_of_each_split_decodes_to_one_segment_starting_with_bos() {
    // The first two entries of each split's seq_starts.
    for (split, starts) in [("train", [0u64, 555]), ("validation", [0, 829])] {
        let s = Split::open(fixture(), split).unwrap();
        assert_eq!(s.seq_starts(0..2).unwrap(), starts, "{split}");
        // Decoding the first document: it starts a sequence, with input 0 (BOS) at column 0.
        let first_len = (starts[1] - starts[0]) as usize;
        let d = decode(&s.encoded(0..first_len as u64).unwrap(), first_len);
        assert_eq!(d.segment_ids.iter().max(), Some(&1));
        assert!(d.is_seq_start[0] && d.inputs[0] == 0);
    }
}
