//! One split (`train` or `validation`) of a flat-tokens dataset, read through zarrs and
//! validated against every invariant of the format (flat_tokens.md §2.3, §9.3).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zarrs::array::chunk_cache::{ChunkCache, ChunkCacheDecodedLruChunkLimit};
use zarrs::array::codec::api::CodecOptions;
use zarrs::array::{data_type, Array, ArraySubset};
use zarrs::filesystem::FilesystemStore;
use zarrs::group::Group;
use zarrs::storage::ReadableStorageTraits;

/// Decoded `encoded_tokens` chunks kept: rows of a step mostly fall in few chunks, and a v2
/// chunk (4 Mi tokens) must be decoded whole.
const CACHED_CHUNKS: u64 = 4;

use crate::error::{Error, Result};

/// An opened split: `encoded_tokens` (uint32) and `seq_starts` (uint64, held in memory).
pub struct Split {
    path: PathBuf,
    tokens: Arc<Array<dyn ReadableStorageTraits>>,
    cache: ChunkCacheDecodedLruChunkLimit,
    seq_starts: Vec<u64>,
    max_token_id: u64,
    completed: bool,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("path", &self.path)
            .field("token_count", &self.token_count())
            .field("seq_count", &self.seq_count())
            .field("max_token_id", &self.max_token_id)
            .finish()
    }
}

fn zerr(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::format(path, format!("{what}: {e}"))
}

impl Split {
    /// Opens `split` of the dataset at `root`, checking names, dtypes and shapes; seqax's
    /// numcodecs `delta` filter is supported.
    pub fn open(root: impl AsRef<Path>, split: &str) -> Result<Split> {
        let root = root.as_ref();
        if split != "train" && split != "validation" {
            return Err(Error::Invalid(format!(
                "split must be \"train\" or \"validation\", got {split:?}"
            )));
        }
        if !root.is_dir() {
            return Err(Error::NotFound {
                path: root.to_path_buf(),
                what: "not a directory; expected a flat-tokens zarr group".into(),
            });
        }
        super::delta::register();
        let path = root.join(split);
        let store: Arc<dyn ReadableStorageTraits> =
            Arc::new(FilesystemStore::new(root).map_err(|e| zerr(root, "store", e))?);
        let group = Group::open(store.clone(), &format!("/{split}"))
            .map_err(|e| zerr(&path, "not a zarr group (is the split missing?)", e))?;
        let max_token_id = group
            .attributes()
            .get("max_token_id")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| {
                Error::format(
                    &path,
                    "the split group has no integer `max_token_id` attribute",
                )
            })?;
        let completed = Group::open(store.clone(), "/")
            .ok()
            .and_then(|g| {
                g.attributes()
                    .get("write_completed")
                    .and_then(|v| v.as_bool())
            })
            .unwrap_or(false);
        let open = |name: &str, dt: zarrs::array::DataType, dt_name: &str| {
            let p = path.join(name);
            let a = Array::open(store.clone(), &format!("/{split}/{name}"))
                .map_err(|e| zerr(&p, "cannot open the array", e))?;
            if a.shape().len() != 1 || *a.data_type() != dt {
                return Err(Error::format(
                    &p,
                    format!(
                        "must be a 1-D {dt_name} array; found shape {:?} of {:?}",
                        a.shape(),
                        a.data_type()
                    ),
                ));
            }
            Ok(a)
        };
        let tokens = open("encoded_tokens", data_type::uint32(), "uint32")?;
        let starts = open("seq_starts", data_type::uint64(), "uint64")?;
        let seq_starts: Vec<u64> = starts
            .retrieve_array_subset(&starts.subset_all())
            .map_err(|e| zerr(&path.join("seq_starts"), "cannot read", e))?;
        let tokens = Arc::new(tokens);
        let cache = ChunkCacheDecodedLruChunkLimit::new(tokens.clone(), CACHED_CHUNKS);
        Ok(Split {
            path,
            tokens,
            cache,
            seq_starts,
            max_token_id,
            completed,
        })
    }

    /// The split's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Tokens in the split.
    pub fn token_count(&self) -> u64 {
        self.tokens.shape()[0]
    }
    /// Sequences (documents) in the split.
    pub fn seq_count(&self) -> u64 {
        self.seq_starts.len().saturating_sub(1) as u64
    }
    /// `seq_starts` (sequences + 1 entries).
    pub fn seq_starts(&self) -> &[u64] {
        &self.seq_starts
    }
    /// The `max_token_id` attribute.
    pub fn max_token_id(&self) -> u64 {
        self.max_token_id
    }
    /// Whether the root carries shardkit's `write_completed: true` (seqax data never does).
    pub fn is_marked_complete(&self) -> bool {
        self.completed
    }

    /// Encoded tokens `range`.
    pub fn encoded(&self, range: Range<u64>) -> Result<Vec<u32>> {
        if range.end > self.token_count() || range.start > range.end {
            return Err(Error::OutOfRange {
                what: "token",
                index: range.end.min(i64::MAX as u64) as i64,
                len: self.token_count(),
            });
        }
        let subset = ArraySubset::new_with_ranges(&[range]);
        self.cache
            .retrieve_array_subset::<Vec<u32>>(&subset, &CodecOptions::default())
            .map_err(|e| zerr(&self.path.join("encoded_tokens"), "cannot read", e))
    }

    /// Every violation of the format's invariants (empty when valid): `seq_starts` starts at 0,
    /// never decreases and ends at `token_count`; start bits sit exactly at sequence starts;
    /// every id is at most `max_token_id`, itself below 2^31.
    pub fn validate(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let s = &self.seq_starts;
        let n = self.token_count();
        if s.first() != Some(&0) {
            problems.push(format!("seq_starts[0] is {:?}, must be 0", s.first()));
        }
        if s.last() != Some(&n) {
            problems.push(format!(
                "seq_starts[-1] is {:?}, must equal token_count {n}",
                s.last()
            ));
        }
        if let Some(i) = s.windows(2).position(|w| w[1] < w[0]) {
            problems.push(format!(
                "seq_starts decreases at index {}: {} then {}",
                i + 1,
                s[i],
                s[i + 1]
            ));
        }
        if self.max_token_id >= 1 << 31 {
            problems.push(format!(
                "max_token_id {} is not below 2^31",
                self.max_token_id
            ));
        }
        // Stream the tokens in pieces: start bits and ids.
        let mut next_start = 0usize; // index into seq_starts of the next start position
        let (mut bad_starts, mut bad_ids, mut max_seen) = (0u64, 0u64, 0u64);
        let mut first_bad: Option<String> = None;
        const PIECE: u64 = 1 << 22;
        let mut at = 0u64;
        while at < n {
            let end = (at + PIECE).min(n);
            let piece = match self.encoded(at..end) {
                Ok(p) => p,
                Err(e) => {
                    problems.push(e.to_string());
                    return problems;
                }
            };
            for (k, &e) in piece.iter().enumerate() {
                let pos = at + k as u64;
                while next_start < s.len() && s[next_start] < pos {
                    next_start += 1;
                }
                let is_start = next_start < s.len().saturating_sub(1) && s[next_start] == pos;
                if (e & 1 == 1) != is_start {
                    bad_starts += 1;
                    first_bad.get_or_insert_with(|| {
                        format!(
                            "token {pos}: start bit {} but {}a sequence start",
                            e & 1,
                            if is_start { "" } else { "not " }
                        )
                    });
                }
                let id = u64::from(e >> 1);
                max_seen = max_seen.max(id);
                if id > self.max_token_id {
                    bad_ids += 1;
                }
            }
            at = end;
        }
        if bad_starts > 0 {
            problems.push(format!(
                "{bad_starts} tokens whose start bit disagrees with seq_starts (first: {})",
                first_bad.unwrap_or_default()
            ));
        }
        if bad_ids > 0 {
            problems.push(format!(
                "{bad_ids} token ids exceed max_token_id {} (largest {max_seen})",
                self.max_token_id
            ));
        }
        problems
    }
}
