//! Writing float32 input into a reduced-precision dataset, and the per-shard error sidecar.
//!
//! A dataset whose `dtype` is bfloat16 or float16 (shardkit's dialect of protocol 2.1) stores
//! each value rounded to nearest, ties to even ([`crate::precision`]). Beside each shard
//! `acts{s:06}.bin` lies `acts{s:06}.error.json`: the rounding error of the shard's rows
//! against the float32 values it was made from ([`ErrorStats::to_json`]). A writer makes the
//! sidecar durable before the shard it describes, so every published shard has one; a float32
//! dataset has none.

use std::borrow::Cow;

use rayon::prelude::*;
use std::path::Path;

use crate::error::{Error, Result};
use crate::fsutil;
use crate::json;
use crate::precision::{Dtype, ErrorStats};
use crate::saev::layout::Layout;
use crate::saev::Metadata;

/// Sidecars read at once by [`Sidecars::read`].
const FETCHERS: usize = 16;

/// Writes of at least this many values are rounded on every core.
const PARALLEL_VALUES: usize = 1 << 20;

/// The error sidecar of shard `s`.
pub(crate) fn sidecar_name(s: u64) -> String {
    format!("acts{s:06}.error.json")
}

/// The shard whose error sidecar is `name`.
pub(crate) fn sidecar_index(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("acts")?.strip_suffix(".error.json")?;
    if digits.len() < 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The examples of one write, in the stored type.
pub(crate) struct Stored<'a> {
    /// Little-endian values of the dataset's dtype, `L·T·D` per example.
    pub bytes: Cow<'a, [u8]>,
    /// Each example's rounding error (empty for a float32 dataset).
    pub errors: Vec<ErrorStats>,
}

impl Stored<'_> {
    /// The rounding error of examples `range` of the write (nothing for float32).
    pub(crate) fn errors_of(&self, range: std::ops::Range<u64>) -> ErrorStats {
        let mut out = ErrorStats::default();
        if let Some(e) = self.errors.get(range.start as usize..range.end as usize) {
            e.iter().for_each(|e| out.merge(e));
        }
        out
    }
}

/// Rounds the float32 examples `acts` (whole examples of `layout`) to the dataset's dtype,
/// measuring each example's error. With `bound` (`max_rel_error`), the first row whose
/// relative L2 error exceeds it, or that overflows, refuses the whole write with an error that
/// names the shard and the row; `example_of(k)` is the global index of the write's `k`-th
/// example. Nothing is written by this function.
pub(crate) fn store_examples<'a>(
    md: &Metadata,
    layout: &Layout,
    acts: &'a [f32],
    bound: Option<f64>,
    example_of: impl Fn(u64) -> u64,
) -> Result<Stored<'a>> {
    if layout.dtype == Dtype::F32 {
        let bytes = if cfg!(target_endian = "little") {
            // SAFETY: f32 has no padding; the byte view covers exactly `acts`.
            Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(acts.as_ptr().cast::<u8>(), std::mem::size_of_val(acts))
            })
        } else {
            Cow::Owned(crate::precision::encoded(Dtype::F32, acts))
        };
        return Ok(Stored {
            bytes,
            errors: Vec::new(),
        });
    }
    let ev = layout.example_values() as usize;
    let eb = layout.example_bytes() as usize;
    let d = layout.d_model as usize;
    let mut bytes = vec![0u8; acts.len() * layout.value_bytes() as usize];
    let round = |(k, (src, dst)): (usize, (&[f32], &mut [u8]))| {
        ErrorStats::encode_rows(layout.dtype, src, d, dst, bound).map_err(|over| (k, over))
    };
    // Rounding and measuring cost a few ns a value: a large write (a producer's batch of many
    // examples) is spread over the cores so that it keeps up with the disk.
    let rounded: Vec<std::result::Result<ErrorStats, _>> =
        if acts.len() >= PARALLEL_VALUES && acts.len() > ev {
            acts.par_chunks_exact(ev)
                .zip(bytes.par_chunks_exact_mut(eb))
                .enumerate()
                .map(round)
                .collect()
        } else {
            acts.chunks_exact(ev)
                .zip(bytes.chunks_exact_mut(eb))
                .enumerate()
                .map(round)
                .collect()
        };
    // The first refused example in order, whichever thread found it.
    let errors = rounded
        .into_iter()
        .collect::<std::result::Result<Vec<_>, _>>();
    let errors = errors.map_err(|(k, over)| {
        let g = example_of(k as u64);
        let (slot, t) = (over.row / layout.tokens, over.row % layout.tokens);
        let layer = md.layers().get(slot as usize).copied().unwrap_or_default();
        Error::Invalid(format!(
            "{}: example {g} (row {} of the shard), layer {layer}, token slot {t}: {over}, \
             above max_rel_error = {} for {}; nothing of this write was stored",
            Layout::shard_name(g / layout.examples_per_shard),
            g % layout.examples_per_shard,
            bound.unwrap_or_default(),
            layout.dtype
        ))
    })?;
    Ok(Stored {
        bytes: Cow::Owned(bytes),
        errors,
    })
}

/// The bytes of shard `s`'s error sidecar.
pub(crate) fn sidecar_bytes(dtype: Dtype, stats: &ErrorStats) -> Vec<u8> {
    let mut text = json::to_pretty(&stats.to_json(dtype), 2, json::Escape::Utf8);
    text.push('\n');
    text.into_bytes()
}

/// Makes shard `s`'s error sidecar durable in `dir` (before the shard itself is published).
pub(crate) fn write_sidecar(dir: &Path, s: u64, dtype: Dtype, stats: &ErrorStats) -> Result<()> {
    fsutil::atomic_write(&dir.join(sidecar_name(s)), &sidecar_bytes(dtype, stats))
}

/// Parses shard `s`'s error sidecar (`bytes`, read from `src`), checking it against the
/// dataset: its dtype and its row count (`L·T` rows per example the shard holds).
pub(crate) fn parse_sidecar(
    bytes: &[u8],
    src: &Path,
    layout: &Layout,
    s: u64,
) -> Result<ErrorStats> {
    let v = json::parse(bytes).map_err(|e| Error::format(src, e.to_string()))?;
    let (stats, dtype) = ErrorStats::from_json(&v, src)?;
    if dtype != layout.dtype {
        return Err(Error::format(
            src,
            format!("records dtype {dtype}, but the dataset is {}", layout.dtype),
        ));
    }
    let rows = layout.shard_count(s) * layout.n_layers * layout.tokens;
    if stats.rows != rows || stats.values != rows * layout.d_model {
        return Err(Error::format(
            src,
            format!(
                "measures {} rows ({} values); {} holds {rows} rows of {} values",
                stats.rows,
                stats.values,
                Layout::shard_name(s),
                layout.d_model
            ),
        ));
    }
    Ok(stats)
}

/// The error sidecars of a reduced-precision dataset's shards, read through `fetch` (a
/// sidecar's bytes by name, `None` when it is absent).
pub(crate) struct Sidecars {
    /// Every sidecar read and valid, merged.
    pub total: ErrorStats,
    /// Shards measured.
    pub shards: u64,
    /// Shards without a sidecar.
    pub missing: Vec<u64>,
    /// Sidecars that do not parse or do not fit the dataset.
    pub bad: Vec<Error>,
}

impl Sidecars {
    /// Reads the sidecars of shards `0..n` (`n` the shards present).
    pub(crate) fn read(
        dir: &Path,
        layout: &Layout,
        n: u64,
        fetch: impl Fn(&str) -> Result<Option<Vec<u8>>> + Sync,
    ) -> Result<Sidecars> {
        let mut out = Sidecars {
            total: ErrorStats::default(),
            shards: 0,
            missing: Vec::new(),
            bad: Vec::new(),
        };
        // From a store each sidecar is a GET: many in flight, not one round trip a shard.
        let shards: Vec<u64> = (0..n.min(layout.n_shards)).collect();
        let fetched = crate::par::chunked(&shards, FETCHERS, "reading error sidecars", |c| {
            c.iter()
                .map(|&s| Ok((s, fetch(&sidecar_name(s))?)))
                .collect()
        })?;
        for (s, got) in fetched {
            match got {
                None => out.missing.push(s),
                Some(bytes) => {
                    let src = dir.join(sidecar_name(s));
                    match parse_sidecar(&bytes, &src, layout, s) {
                        Ok(stats) => {
                            out.total.merge(&stats);
                            out.shards += 1;
                        }
                        Err(e) => out.bad.push(e),
                    }
                }
            }
        }
        Ok(out)
    }

    /// The summary `inspect` shows.
    pub(crate) fn to_json(&self, dtype: Dtype) -> json::Value {
        use json::Value;
        let mut v = self.total.to_json(dtype);
        if let Value::Object(members) = &mut v {
            members.retain(|(k, _)| k != "format" && k != "sum_rel_l2_error");
            members.insert(1, ("shards_measured".into(), Value::int(self.shards)));
            members.push((
                "shards_without_sidecar".into(),
                Value::Array(self.missing.iter().map(|&s| Value::int(s)).collect()),
            ));
            members.push((
                "bad_sidecars".into(),
                Value::Array(
                    self.bad
                        .iter()
                        .map(|e| Value::String(e.to_string()))
                        .collect(),
                ),
            ));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_names_round_trip() {
        assert_eq!(sidecar_index(&sidecar_name(12)), Some(12));
        assert_eq!(sidecar_index("acts000012.bin"), None);
        assert_eq!(sidecar_index("acts.error.json"), None);
    }
}
