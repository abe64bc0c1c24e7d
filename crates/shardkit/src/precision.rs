//! Reduced-precision storage: the element types a cache stores, float32 rounded to them (to
//! nearest, ties to even), and the error that rounding made.
//!
//! An activation cache written in bfloat16 or float16 moves half the bytes of float32 per row.
//! The rounding is the one numpy (`ml_dtypes`) and torch do: round to nearest, ties to even;
//! NaN stays NaN, ±inf stays ±inf, a finite value beyond the type's range becomes ±inf
//! (*overflow*), and a non-zero value below its smallest subnormal becomes ±0 (*flushed to
//! zero*).
//!
//! [`ErrorStats`] is what a writer records of each shard it rounds: the largest absolute error
//! of any value, the largest and mean relative L2 error of a row (`‖x − q‖ / ‖x‖` over the
//! row's finite values; 0 for an all-zero row), and how many values overflowed or flushed to
//! zero. Overflowed values are counted, not measured (their error is unbounded), and a row
//! holding one exceeds every `max_rel_error` bound.

use crate::error::{Error, Result};
use crate::json::Value;
use std::path::Path;

/// The element type of stored values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Dtype {
    /// IEEE float32 (what saev and every reference store).
    #[default]
    F32,
    /// bfloat16: float32's range, 8 significant bits.
    BF16,
    /// IEEE float16: 11 significant bits, largest finite value 65504.
    F16,
}

impl Dtype {
    /// Every type, float32 first.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::BF16, Dtype::F16];

    /// The name metadata records and numpy / torch use (`float32`, `bfloat16`, `float16`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::BF16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }

    /// The type a user names: the canonical names and the usual short ones (`f32`, `fp32`,
    /// `bf16`, `f16`, `fp16`, `half`).
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.to_ascii_lowercase().as_str() {
            "float32" | "f32" | "fp32" => Some(Dtype::F32),
            "bfloat16" | "bf16" => Some(Dtype::BF16),
            "float16" | "f16" | "fp16" | "half" => Some(Dtype::F16),
            _ => None,
        }
    }

    /// [`Dtype::parse`], or an error that lists the accepted names.
    pub fn from_name(s: &str) -> Result<Dtype> {
        Dtype::parse(s).ok_or_else(|| {
            Error::Invalid(format!(
                "unknown dtype {s:?}: expected float32, bfloat16 (bf16) or float16 (fp16)"
            ))
        })
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }

    /// Whether values are rounded on the way in (anything but float32).
    pub fn is_reduced(self) -> bool {
        self != Dtype::F32
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One value rounded to a 16-bit type (bits).
#[inline]
fn round16(dtype: Dtype, x: f32) -> u16 {
    match dtype {
        Dtype::BF16 => half::bf16::from_f32(x).to_bits(),
        _ => half::f16::from_f32(x).to_bits(),
    }
}

/// One 16-bit value (bits) widened to float32 (exact).
#[inline]
fn widen16(dtype: Dtype, bits: u16) -> f32 {
    match dtype {
        Dtype::BF16 => half::bf16::from_bits(bits).to_f32(),
        _ => half::f16::from_bits(bits).to_f32(),
    }
}

/// The float32 bits of a bfloat16 value: `half`'s widening (a NaN keeps its payload, made
/// quiet), written without a branch so that loops over rows vectorize.
#[inline]
fn widen_bf16(bits: u16) -> u32 {
    let quiet = u32::from(bits & 0x7fff > 0x7f80) << 22;
    (u32::from(bits) << 16) | quiet
}

/// Writes `src` as `dtype` little-endian values into `dst` (`src.len() · size` bytes).
///
/// # Panics
/// If `dst` is not exactly `src.len() · dtype.size()` bytes (a caller's sizing bug).
pub fn encode(dtype: Dtype, src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * dtype.size(), "encode: buffer size");
    match dtype {
        Dtype::F32 => {
            for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        _ => {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&round16(dtype, x).to_le_bytes());
            }
        }
    }
}

/// Reads `dtype` little-endian values from `src` as float32 into `dst` (exact: every bfloat16
/// and float16 value is a float32 value).
///
/// # Panics
/// If `src` is not exactly `dst.len() · dtype.size()` bytes.
pub fn decode(dtype: Dtype, src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * dtype.size(), "decode: buffer size");
    match dtype {
        Dtype::F32 => {
            for (x, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        // One loop per type, the type decided outside it: the loops then vectorize (a loader
        // widening every batch it serves runs this over all of them).
        Dtype::BF16 => {
            for (x, s) in dst.iter_mut().zip(src.as_chunks::<2>().0) {
                *x = f32::from_bits(widen_bf16(u16::from_le_bytes(*s)));
            }
        }
        Dtype::F16 => {
            for (x, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *x = widen16(Dtype::F16, u16::from_le_bytes([s[0], s[1]]));
            }
        }
    }
}

/// [`decode`] into bytes: `dtype` little-endian values of `src` as float32 little-endian
/// values in `dst` (a loader widens each row straight into its batch, wherever in the batch's
/// bytes the row lies).
///
/// # Panics
/// If `dst` is not exactly `src.len() / dtype.size() · 4` bytes.
pub fn decode_bytes(dtype: Dtype, src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        src.len() / dtype.size() * 4,
        dst.len(),
        "decode_bytes: buffer size"
    );
    match dtype {
        Dtype::F32 => dst.copy_from_slice(src),
        Dtype::BF16 => {
            // Fixed-size chunks: the loop vectorizes (chunks_exact with copy_from_slice did not).
            let (d4, s2) = (dst.as_chunks_mut::<4>().0, src.as_chunks::<2>().0);
            for (d, s) in d4.iter_mut().zip(s2) {
                *d = widen_bf16(u16::from_le_bytes(*s)).to_le_bytes();
            }
        }
        Dtype::F16 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                let x = widen16(Dtype::F16, u16::from_le_bytes([s[0], s[1]]));
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
    }
}

/// `src` as `dtype` values, little-endian bytes.
pub fn encoded(dtype: Dtype, src: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; src.len() * dtype.size()];
    encode(dtype, src, &mut out);
    out
}

/// `src` (`dtype` little-endian values) as float32.
pub fn decoded(dtype: Dtype, src: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; src.len() / dtype.size()];
    // A trailing partial value is not a value.
    decode(dtype, &src[..out.len() * dtype.size()], &mut out);
    out
}

/// The rounding error of a set of rows (see the module documentation). Plain data: merge
/// shards' with [`ErrorStats::merge`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ErrorStats {
    /// Rows measured.
    pub rows: u64,
    /// Values measured (rows × width).
    pub values: u64,
    /// Largest `|x − q|` over finite values that stayed finite.
    pub max_abs_error: f64,
    /// Largest relative L2 error of a row.
    pub max_rel_l2_error: f64,
    /// Sum of the rows' relative L2 errors (the mean is this over `rows`).
    pub sum_rel_l2_error: f64,
    /// Finite values that became ±inf.
    pub overflow: u64,
    /// Non-zero values that became ±0.
    pub flushed_to_zero: u64,
}

/// Why a row broke a writer's `max_rel_error` bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverBound {
    /// The row, counted from the start of the rows given.
    pub row: u64,
    /// Its relative L2 error (infinite when a value overflowed).
    pub rel_l2_error: f64,
    /// Values of the row that overflowed.
    pub overflow: u64,
}

impl std::fmt::Display for OverBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.overflow > 0 {
            write!(
                f,
                "{} value(s) of the row overflow to infinity",
                self.overflow
            )
        } else {
            write!(f, "its relative L2 error is {:.3e}", self.rel_l2_error)
        }
    }
}

impl ErrorStats {
    /// The mean relative L2 error of a row (0 with no rows).
    pub fn mean_rel_l2_error(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.sum_rel_l2_error / self.rows as f64
        }
    }

    /// Adds `other`'s rows.
    pub fn merge(&mut self, other: &ErrorStats) {
        self.rows += other.rows;
        self.values += other.values;
        self.max_abs_error = self.max_abs_error.max(other.max_abs_error);
        self.max_rel_l2_error = self.max_rel_l2_error.max(other.max_rel_l2_error);
        self.sum_rel_l2_error += other.sum_rel_l2_error;
        self.overflow += other.overflow;
        self.flushed_to_zero += other.flushed_to_zero;
    }

    /// Rounds `src` (rows of `width` values) to `dtype` into `dst` and measures the error.
    /// With `bound`, fails at the first row whose relative L2 error exceeds it (or that
    /// overflows) and returns the statistics of nothing: the caller discards `dst`.
    pub fn encode_rows(
        dtype: Dtype,
        src: &[f32],
        width: usize,
        dst: &mut [u8],
        bound: Option<f64>,
    ) -> std::result::Result<ErrorStats, OverBound> {
        encode(dtype, src, dst);
        let mut stats = ErrorStats::default();
        if !dtype.is_reduced() || width == 0 {
            return Ok(stats);
        }
        for (row, (x, q)) in src
            .chunks_exact(width)
            .zip(dst.chunks_exact(width * 2))
            .enumerate()
        {
            let (mut err2, mut norm2, mut overflow) = (0f64, 0f64, 0u64);
            for (&x, q) in x.iter().zip(q.chunks_exact(2)) {
                if !x.is_finite() {
                    continue;
                }
                let q = widen16(dtype, u16::from_le_bytes([q[0], q[1]]));
                if q.is_infinite() {
                    overflow += 1;
                    continue;
                }
                if x != 0.0 && q == 0.0 {
                    stats.flushed_to_zero += 1;
                }
                let (x, q) = (f64::from(x), f64::from(q));
                let e = (x - q).abs();
                stats.max_abs_error = stats.max_abs_error.max(e);
                err2 += e * e;
                norm2 += x * x;
            }
            let rel = if norm2 > 0.0 {
                (err2 / norm2).sqrt()
            } else {
                0.0
            };
            if let Some(b) = bound {
                if overflow > 0 || rel > b {
                    return Err(OverBound {
                        row: row as u64,
                        rel_l2_error: if overflow > 0 { f64::INFINITY } else { rel },
                        overflow,
                    });
                }
            }
            stats.rows += 1;
            stats.values += width as u64;
            stats.overflow += overflow;
            stats.max_rel_l2_error = stats.max_rel_l2_error.max(rel);
            stats.sum_rel_l2_error += rel;
        }
        Ok(stats)
    }

    /// The sidecar object of a shard written in `dtype`: `{"format", "dtype", "rows",
    /// "values", "max_abs_error", "max_rel_l2_error", "mean_rel_l2_error", "overflow",
    /// "flushed_to_zero"}`.
    pub fn to_json(&self, dtype: Dtype) -> Value {
        Value::Object(vec![
            ("format".into(), Value::String(SIDECAR_FORMAT.into())),
            ("dtype".into(), Value::String(dtype.name().into())),
            ("rows".into(), Value::int(self.rows)),
            ("values".into(), Value::int(self.values)),
            ("max_abs_error".into(), real(self.max_abs_error)),
            ("max_rel_l2_error".into(), real(self.max_rel_l2_error)),
            ("mean_rel_l2_error".into(), real(self.mean_rel_l2_error())),
            // The exact sum, so that shards' statistics merge without loss.
            ("sum_rel_l2_error".into(), real(self.sum_rel_l2_error)),
            ("overflow".into(), Value::int(self.overflow)),
            ("flushed_to_zero".into(), Value::int(self.flushed_to_zero)),
        ])
    }

    /// Parses a sidecar written by [`ErrorStats::to_json`]; `src` names it in errors. Returns
    /// the statistics and the dtype it records.
    pub fn from_json(v: &Value, src: &Path) -> Result<(ErrorStats, Dtype)> {
        let bad = |rule: String| Error::format(src, rule);
        if v.get("format").and_then(Value::as_str) != Some(SIDECAR_FORMAT) {
            return Err(bad(format!(
                "not a precision sidecar: `format` must be {SIDECAR_FORMAT:?}"
            )));
        }
        let dtype = v
            .get("dtype")
            .and_then(Value::as_str)
            .and_then(Dtype::parse)
            .ok_or_else(|| bad("`dtype` must be float32, bfloat16 or float16".into()))?;
        let count = |k: &str| -> Result<u64> {
            v.get(k)
                .and_then(Value::as_i64)
                .filter(|&i| i >= 0)
                .map(|i| i as u64)
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative integer")))
        };
        let real = |k: &str| -> Result<f64> {
            v.get(k)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative number")))
        };
        Ok((
            ErrorStats {
                rows: count("rows")?,
                values: count("values")?,
                max_abs_error: real("max_abs_error")?,
                max_rel_l2_error: real("max_rel_l2_error")?,
                sum_rel_l2_error: real("sum_rel_l2_error")?,
                overflow: count("overflow")?,
                flushed_to_zero: count("flushed_to_zero")?,
            },
            dtype,
        ))
    }
}

/// A float as JSON: the shortest text that reads back as the same f64 (never NaN or inf here:
/// those are counted, not measured).
fn real(x: f64) -> Value {
    Value::Number(if x.is_finite() {
        format!("{x:e}")
    } else {
        "0".into()
    })
}

/// The `format` string of a precision sidecar.
pub const SIDECAR_FORMAT: &str = "shardkit.precision/1";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_matches_half_for_every_16_bit_value_and_both_outputs_agree() {
        for dtype in [Dtype::BF16, Dtype::F16] {
            let src: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
            let mut wide = vec![0f32; 1 << 16];
            decode(dtype, &src, &mut wide);
            let mut bytes = vec![0u8; 4 << 16];
            decode_bytes(dtype, &src, &mut bytes);
            for b in 0..=u16::MAX {
                let want = widen16(dtype, b).to_bits();
                assert_eq!(wide[b as usize].to_bits(), want, "{dtype} {b:#06x}");
                let at = 4 * b as usize;
                let got = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
                assert_eq!(got, want, "{dtype} {b:#06x} as bytes");
            }
        }
        // A signalling bfloat16 NaN comes out quiet, its payload kept (as `half` does).
        assert_eq!(widen_bf16(0x7f81), 0x7fc1_0000);
        assert_eq!(widen_bf16(0xff80), 0xff80_0000, "-inf stays -inf");
        let mut same = [0u8; 8];
        decode_bytes(Dtype::F32, &[1, 2, 3, 4, 5, 6, 7, 8], &mut same);
        assert_eq!(same, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn rounds_to_nearest_even_and_keeps_specials() {
        // 1 + 2^-8 is halfway between two bfloat16 values: ties go to the even one (1.0).
        let halfway = 1.0 + f32::powi(2.0, -8);
        let q = decoded(Dtype::BF16, &encoded(Dtype::BF16, &[halfway]));
        assert_eq!(q, [1.0]);
        let above = f32::from_bits(halfway.to_bits() + 1);
        assert_eq!(
            decoded(Dtype::BF16, &encoded(Dtype::BF16, &[above])),
            [1.0 + f32::powi(2.0, -7)]
        );
        let specials = [f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e6];
        let q = decoded(Dtype::F16, &encoded(Dtype::F16, &specials));
        assert_eq!(q[..2], [f32::INFINITY, f32::NEG_INFINITY]);
        assert!(q[3].is_sign_negative() && q[3] == 0.0);
        assert_eq!(q[4], f32::INFINITY, "65504 is float16's largest value");
        assert!(decoded(Dtype::BF16, &encoded(Dtype::BF16, &[f32::NAN]))[0].is_nan());
    }

    #[test]
    fn stats_count_overflow_and_flush_and_enforce_the_bound() {
        let rows = [1.0f32, 1e5, 3.0, 1e-9, 0.0, 0.0, 0.0, 0.0];
        let mut dst = vec![0u8; rows.len() * 2];
        let s = ErrorStats::encode_rows(Dtype::F16, &rows, 4, &mut dst, None).unwrap();
        assert_eq!(
            (s.rows, s.values, s.overflow, s.flushed_to_zero),
            (2, 8, 1, 1)
        );
        assert_eq!(
            s.max_rel_l2_error, s.sum_rel_l2_error,
            "the zero row adds 0"
        );
        let e = ErrorStats::encode_rows(Dtype::F16, &rows, 4, &mut dst, Some(1.0)).unwrap_err();
        assert_eq!((e.row, e.overflow), (0, 1));
        let json = s.to_json(Dtype::F16);
        let (back, dtype) = ErrorStats::from_json(&json, Path::new("x")).unwrap();
        assert_eq!(dtype, Dtype::F16);
        assert_eq!(back.rows, 2);
        assert!((back.sum_rel_l2_error - s.sum_rel_l2_error).abs() <= 1e-15);
    }
}
