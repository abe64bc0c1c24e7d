//! Where every float of a saev directory lives, and `shards.json`.
//!
//! Shard `s` is `acts{s:06}.bin`: raw little-endian values of the metadata's `dtype` (float32;
//! bfloat16 or float16 in shardkit's reduced-precision dialect) of shape `(eps, L, T, D)` with
//! `eps = max_tokens_per_shard // (T·L)`. Example `g` is row `g % eps` of shard `g // eps`;
//! every shard file, the last included, is `eps·L·T·D·size` bytes (saev.md §6). The budget
//! counts tokens, not bytes: a bfloat16 dataset has float32's shards at half the size.

use std::path::Path;

use crate::error::{Error, Result};
use crate::json::{self, Escape, Value};
use crate::saev::Metadata;

use crate::precision::Dtype;

/// The shape of a saev directory, derived from its metadata (plain data: read the fields).
/// All byte sizes are checked once, at construction, so the crate's index arithmetic on it
/// cannot overflow for in-range arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Layout {
    /// Examples (N).
    pub n_examples: u64,
    /// Layer slots (L).
    pub n_layers: u64,
    /// Stored tokens per example (T = P + cls).
    pub tokens: u64,
    /// Content tokens per example (P).
    pub content_tokens: u64,
    /// Whether slot 0 is CLS.
    pub cls: bool,
    /// Width (D).
    pub d_model: u64,
    /// Examples per shard (eps).
    pub examples_per_shard: u64,
    /// Number of shards holding data, `ceil(N / eps)`.
    pub n_shards: u64,
    /// The stored element type.
    pub dtype: Dtype,
}

impl Layout {
    /// The layout of `md`; `src` names the metadata file in errors.
    pub fn new(md: &Metadata, src: &Path) -> Result<Layout> {
        let l = md.layers().len() as u64;
        let t = md.tokens_per_example();
        let eps = md.max_tokens_per_shard() / (t * l); // t*l checked by Metadata
        let layout = Layout {
            n_examples: md.n_examples(),
            n_layers: l,
            tokens: t,
            content_tokens: md.content_tokens_per_example(),
            cls: md.cls_token(),
            d_model: md.d_model(),
            examples_per_shard: eps,
            n_shards: md.n_examples().div_ceil(eps),
            dtype: md.dtype(),
        };
        let value_bytes = layout.value_bytes();
        // Every byte offset must fit in i64 (file offsets) and usize (buffers).
        let shard = eps
            .checked_mul(l)
            .and_then(|x| x.checked_mul(t))
            .and_then(|x| x.checked_mul(md.d_model()))
            .and_then(|x| x.checked_mul(value_bytes))
            .filter(|&b| b <= i64::MAX as u64 && usize::try_from(b).is_ok());
        let rows = md
            .n_examples()
            .checked_mul(t.max(md.content_tokens_per_example()));
        let total = shard.and_then(|b| b.checked_mul(layout.n_shards));
        if shard.is_none() || rows.is_none() || total.is_none() {
            return Err(Error::format(
                src,
                format!(
                    "sizes overflow: {eps} examples per shard x {l} layers x {t} tokens x {} \
                     dims x {value_bytes} bytes per shard, {} shards in all (or {} examples x {t} tokens) \
                     does not fit in 63 bits",
                    md.d_model(),
                    layout.n_shards,
                    md.n_examples()
                ),
            ));
        }
        Ok(layout)
    }

    /// Bytes per stored value (4 for float32, 2 for bfloat16 and float16).
    pub fn value_bytes(&self) -> u64 {
        self.dtype.size() as u64
    }
    /// Bytes of one vector (`D·size`).
    pub(crate) fn vector_bytes(&self) -> u64 {
        self.d_model * self.value_bytes()
    }
    /// Bytes of one example's slab of one layer (`T·D·size`), contiguous on disk.
    pub(crate) fn slab_bytes(&self) -> u64 {
        self.tokens * self.vector_bytes()
    }
    /// Bytes of one whole example (`L·T·D·size`), contiguous on disk.
    pub(crate) fn example_bytes(&self) -> u64 {
        self.n_layers * self.slab_bytes()
    }
    /// Bytes of all shard files (`n_shards · shard_bytes`; checked at construction).
    pub(crate) fn total_bytes(&self) -> u64 {
        self.n_shards * self.shard_bytes()
    }
    /// Size of every shard file (`eps·L·T·D·size`).
    pub(crate) fn shard_bytes(&self) -> u64 {
        self.examples_per_shard * self.example_bytes()
    }
    /// Values in one example (`L·T·D`).
    pub(crate) fn example_values(&self) -> u64 {
        self.n_layers * self.tokens * self.d_model
    }
    /// Examples held by shard `s` (`eps` except for the last).
    pub(crate) fn shard_count(&self, s: u64) -> u64 {
        let start = s * self.examples_per_shard;
        self.n_examples
            .saturating_sub(start)
            .min(self.examples_per_shard)
    }
    /// (shard, row) of global example `g`.
    pub(crate) fn locate(&self, g: u64) -> (u64, u64) {
        (g / self.examples_per_shard, g % self.examples_per_shard)
    }
    /// Byte offset, within its shard, of `(example g, layer slot, token slot t)`.
    pub(crate) fn offset(&self, g: u64, slot: u64, t: u64) -> u64 {
        let row = g % self.examples_per_shard;
        ((row * self.n_layers + slot) * self.tokens + t) * self.vector_bytes()
    }
    /// The file name of shard `s`.
    pub(crate) fn shard_name(s: u64) -> String {
        format!("acts{s:06}.bin")
    }
}

/// One entry of shards.json.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardEntry {
    /// File name (`acts%06d.bin`).
    pub name: String,
    /// Valid leading examples in that file.
    pub count: u64,
}

/// Parses shards.json: an array of `{"name": ..., <count key>: k}` with the count key any of
/// `n_imgs`, `n_ex`, `n_examples`. Names must be plain file names (no path separators).
pub(crate) fn parse_shards_json(bytes: &[u8], src: &Path) -> Result<Vec<ShardEntry>> {
    let v = json::parse(bytes).map_err(|e| Error::format(src, e.to_string()))?;
    let Value::Array(items) = v else {
        return Err(Error::format(src, "shards.json must be a JSON array"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let name = item
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| Error::format(src, format!("entry {i} has no string `name`")))?;
            if name.is_empty() || name.contains(['/', '\\', '\0']) || name == "." || name == ".." {
                return Err(Error::format(
                    src,
                    format!("entry {i} names {name:?}, which is not a plain file name"),
                ));
            }
            let counts: Vec<&Value> = ["n_imgs", "n_ex", "n_examples"]
                .iter()
                .filter_map(|k| item.get(k))
                .collect();
            let count = match counts.as_slice() {
                [c] => c.as_i64().filter(|&c| c >= 0).ok_or_else(|| {
                    Error::format(
                        src,
                        format!("entry {i}: the example count must be a non-negative integer"),
                    )
                })?,
                [] => {
                    return Err(Error::format(
                        src,
                        format!("entry {i} has no count (n_imgs, n_ex or n_examples)"),
                    ))
                }
                _ => {
                    return Err(Error::format(
                        src,
                        format!("entry {i} has more than one count key"),
                    ))
                }
            };
            Ok(ShardEntry {
                name: name.to_string(),
                count: count as u64,
            })
        })
        .collect()
}

/// The bytes of shards.json as saev writes them: 2-space indent, no trailing newline.
pub(crate) fn shards_json_bytes(counts: &[u64], count_key: &str) -> Vec<u8> {
    let entries = counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            Value::Object(vec![
                ("name".into(), Value::String(Layout::shard_name(i as u64))),
                (count_key.into(), Value::int(c)),
            ])
        })
        .collect();
    json::to_pretty(&Value::Array(entries), 2, Escape::Utf8).into_bytes()
}
