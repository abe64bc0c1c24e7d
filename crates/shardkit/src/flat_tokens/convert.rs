//! Rewriting a dataset in another layout: seqax's v2 (4 Mi-token blosc chunks, decoded whole for
//! any row) into sharded v3 for fast random rows, or v3 into v2 for seqax. The sequences, and so
//! every batch the loader serves, stay the same.

use std::path::Path;

use super::{Layout, Split, WriteSummary, Writer, WriterOptions};
use crate::error::{Error, Result};

/// Tokens read per piece (documents longer than this are read alone).
const PIECE_TOKENS: u64 = 1 << 24;
/// `seq_starts` entries read per piece.
const PIECE_STARTS: u64 = 1 << 16;

/// Copies every split of the dataset at `src` into a new dataset at `dst` written in `layout`.
/// `src` must be servable (finished, or valid seqax data); `dst` must not exist (in a store:
/// hold no split). Either may be an `s3://` URL. `progress` is called with (tokens copied,
/// tokens in all splits) as the copy goes.
pub fn convert(
    src: impl AsRef<Path>,
    dst: impl AsRef<Path>,
    layout: Layout,
    mut progress: impl FnMut(u64, u64),
) -> Result<Vec<(String, WriteSummary)>> {
    let src = &crate::io::local_path(src.as_ref());
    let dst = &crate::io::local_path(dst.as_ref());
    let taken = match crate::io::is_local(dst) {
        false => !super::report::split_dirs(dst)?.is_empty(),
        true => dst.exists(),
    };
    if taken {
        return Err(Error::Exists {
            path: dst.to_path_buf(),
            why: "the destination of a conversion must not exist".into(),
        });
    }
    let mut splits = Vec::new();
    for name in super::report::split_dirs(src)? {
        splits.push((name, Split::open(src, name)?));
    }
    if splits.is_empty() {
        return Err(super::report::no_splits(src));
    }
    let total: u64 = splits.iter().map(|(_, s)| s.token_count()).sum();
    let mut done = 0u64;
    let mut out = Vec::new();
    for (name, s) in splits {
        let options = WriterOptions {
            layout: Some(layout),
            ..Default::default()
        };
        let mut w = Writer::create(dst, name, options)?;
        let n = s.seq_count();
        let mut i = 0u64;
        let mut ids: Vec<u32> = Vec::new();
        while i < n {
            let end = (i + PIECE_STARTS).min(n);
            let starts = s.seq_starts(i..end + 1)?;
            let mut a = 0usize;
            while a + 1 < starts.len() {
                // Documents a..b, read as one range of at most PIECE_TOKENS (or one document).
                let mut b = a + 1;
                while b + 1 < starts.len() && starts[b + 1] - starts[a] <= PIECE_TOKENS {
                    b += 1;
                }
                ids.clear();
                ids.extend(s.encoded(starts[a]..starts[b])?.into_iter().map(|e| e >> 1));
                let seqs: Vec<&[u32]> = (a..b)
                    .map(|k| {
                        let (x, y) = (starts[k] - starts[a], starts[k + 1] - starts[a]);
                        &ids[x as usize..y as usize]
                    })
                    .collect();
                w.append(&seqs)?;
                done += starts[b] - starts[a];
                progress(done, total);
                a = b;
            }
            i = end;
        }
        out.push((name.to_string(), w.finish()?));
    }
    Ok(out)
}
