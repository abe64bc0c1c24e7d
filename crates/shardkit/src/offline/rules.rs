//! The rules a cache's values follow (eagle3.md §5, dspark.md), in one place for the two that check them:
//! the writer, which refuses a batch breaking one before any of it is stored, and
//! `validate --deep`, which reports every shard breaking one.
//!
//! * float fields (EAGLE-3's `aux_hidden_states`, `target_probs`, `target_probs_values`;
//!   DSpark's `target_hidden_states`, `target_last_hidden_states`): finite;
//! * probabilities (`target_probs`, `target_probs_values`): not negative, and each lossless
//!   `target_probs` row sums to 1 within [`sum_tolerance`] of the cache dtype;
//! * `attention_mask`, `loss_mask`: 0 or 1; `position_mask`: 0 or 1, and set only where
//!   `loss_mask` is 1;
//! * `input_ids`: in `0..target_vocab_size` (not negative when the size is not recorded);
//! * `target_probs_indices`: in `0..draft_vocab_size`.

use std::path::Path;

use safetensors::Dtype;

use super::manifest::Manifest;
use super::shard::FieldSpec;
use crate::error::Error;

/// Tolerance on a probability row's sum, by dtype: each of Vd values carries a relative
/// rounding error of half an ulp (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), and the row sums to 1.
pub(crate) fn sum_tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::BF16 => 1e-2,
        Dtype::F16 => 2e-3,
        _ => 1e-4,
    }
}

/// The cache dtype's name in a manifest ("bf16", "fp16", "fp32").
fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bf16",
        Dtype::F16 => "fp16",
        _ => "fp32",
    }
}

/// One rule broken by the rows checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Breach {
    /// The tensor.
    pub field: &'static str,
    /// What is wrong, counted, in the validator's words ("`loss_mask` holds 3 values other
    /// than 0 and 1").
    pub summary: String,
    /// The first offending value's sample (counted from the first row checked) and position
    /// in the sequence.
    pub sample: u64,
    /// See `sample`.
    pub position: u64,
    /// The first offending value (or what is wrong with its row).
    pub value: String,
    /// What the rule allows.
    pub allowed: String,
}

impl Breach {
    /// The validator's finding, for rows starting at sample `first`.
    pub(super) fn finding(&self, first: u64) -> String {
        format!(
            "{} (the first at sample {}, position {}: {}; allowed: {})",
            self.summary,
            first + self.sample,
            self.position,
            self.value,
            self.allowed
        )
    }

    /// The writer's refusal of a batch starting at sample `first` of the cache at `dir`.
    pub(super) fn refusal(&self, dir: &Path, first: u64) -> Error {
        Error::Refused {
            path: dir.to_path_buf(),
            field: self.field.to_string(),
            at: format!("sample {}, position {}", first + self.sample, self.position),
            value: self.value.clone(),
            allowed: self.allowed.clone(),
        }
    }
}

/// Whether the little-endian float at `c` (2 or 4 bytes of `dtype`) is NaN or infinite, from
/// its exponent bits alone.
fn non_finite(c: &[u8], dtype: Dtype) -> bool {
    match dtype {
        Dtype::F32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 == 0x7f80_0000,
        Dtype::BF16 => u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80,
        _ => u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00,
    }
}

/// Float values of `bytes` in `dtype` (BF16, F16, F32), widened to f32.
pub(crate) fn floats(bytes: &[u8], dtype: Dtype) -> impl Iterator<Item = f32> + '_ {
    let size = dtype.bitsize() / 8;
    bytes.chunks_exact(size).map(move |c| match dtype {
        Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        _ => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
    })
}

fn i64s(bytes: &[u8]) -> impl Iterator<Item = i64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
}

fn i32s(bytes: &[u8]) -> impl Iterator<Item = i32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// The number of items of `it` that are bad, and the first one with its index.
fn tally<T>(it: impl Iterator<Item = T>, bad: impl Fn(&T) -> bool) -> (u64, Option<(u64, T)>) {
    let mut count = 0u64;
    let mut first = None;
    for (i, x) in it.enumerate() {
        if bad(&x) {
            count += 1;
            if first.is_none() {
                first = Some((i as u64, x));
            }
        }
    }
    (count, first)
}

/// Checks rows of every stored tensor against the rules: `data[i]` holds rows of `specs[i]`
/// (the same number of rows each; little-endian, C order). Returns every rule broken, each
/// with its first offending value.
pub(crate) fn check(m: &Manifest, specs: &[FieldSpec], data: &[&[u8]]) -> Vec<Breach> {
    let seq = (m.seq_length as usize).max(1);
    let get = |name: &str| {
        specs
            .iter()
            .zip(data)
            .find(|(s, _)| s.name == name)
            .map(|(s, d)| (s, *d))
    };
    let mut out = Vec::new();
    // Where element `i` of a field with rows of `spec.row` is: (sample, position).
    let place = |spec: &FieldSpec, i: u64| {
        let row: u64 = spec.row.iter().product::<usize>().max(1) as u64;
        let per_pos = (row / seq as u64).max(1);
        (i / row, (i % row) / per_pos)
    };
    let mut push = |spec: &FieldSpec, i: u64, summary: String, value: String, allowed: String| {
        let (sample, position) = place(spec, i);
        out.push(Breach {
            field: spec.name,
            summary,
            sample,
            position,
            value,
            allowed,
        });
    };

    let float_fields = specs
        .iter()
        .zip(data)
        .filter(|(s, _)| matches!(s.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32));
    for (spec, &bytes) in float_fields {
        let name = spec.name;
        let size = spec.dtype.bitsize() / 8;
        let (n, first) = tally(bytes.chunks_exact(size), |c| non_finite(c, spec.dtype));
        if let Some((i, c)) = first {
            let x = floats(c, spec.dtype).next().unwrap_or(f32::NAN);
            push(
                spec,
                i,
                format!("`{name}` holds {n} NaN or infinite values"),
                format!("{x}"),
                format!("finite {} values", dtype_name(spec.dtype)),
            );
        }
        if name.starts_with("target_probs") {
            let (n, first) = tally(floats(bytes, spec.dtype), |&x| x < 0.0);
            if let Some((i, x)) = first {
                push(
                    spec,
                    i,
                    format!("`{name}` holds {n} negative probabilities"),
                    format!("{x}"),
                    "probabilities from 0 to 1".into(),
                );
            }
        }
    }

    for name in ["attention_mask", "loss_mask"] {
        let Some((spec, bytes)) = get(name) else {
            continue;
        };
        let (n, first) = tally(i64s(bytes), |&x| x != 0 && x != 1);
        if let Some((i, x)) = first {
            push(
                spec,
                i,
                format!("`{name}` holds {n} values other than 0 and 1"),
                x.to_string(),
                "0 or 1".into(),
            );
        }
    }
    if let Some((spec, pm)) = get("position_mask") {
        let (n, first) = tally(pm.iter(), |&&b| b > 1);
        if let Some((i, b)) = first {
            push(
                spec,
                i,
                format!("`position_mask` holds {n} bytes other than 0 and 1"),
                b.to_string(),
                "0 or 1 (bool)".into(),
            );
        }
        if let Some((_, lm)) = get("loss_mask") {
            let (n, first) = tally(pm.iter().zip(i64s(lm)), |&(&p, l)| p == 1 && l == 0);
            if let Some((i, _)) = first {
                push(
                    spec,
                    i,
                    format!("`position_mask` is set at {n} positions where `loss_mask` is 0"),
                    "set where `loss_mask` is 0".into(),
                    "position_mask set only where loss_mask is 1".into(),
                );
            }
        }
    }
    if let Some((spec, ids)) = get("input_ids") {
        let (n, first, allowed) = match m.target_vocab_size {
            Some(vocab) => {
                let (n, first) = tally(i64s(ids), |&x| x < 0 || x as u64 >= vocab);
                (
                    n,
                    first,
                    format!("0 to {}, ids below target_vocab_size {vocab}", vocab - 1),
                )
            }
            None => {
                let (n, first) = tally(i64s(ids), |&x| x < 0);
                (n, first, "ids from 0".to_string())
            }
        };
        if let Some((i, x)) = first {
            push(
                spec,
                i,
                format!("`input_ids` holds {n} ids outside {allowed}"),
                x.to_string(),
                allowed,
            );
        }
    }
    if let (Some((spec, ix)), Some(e)) = (get("target_probs_indices"), m.eagle3()) {
        let vd = e.draft_vocab_size as i64;
        let (n, first) = tally(i32s(ix), |&x| x < 0 || i64::from(x) >= vd);
        if let Some((i, x)) = first {
            push(
                spec,
                i,
                format!(
                    "`target_probs_indices` holds {n} indices outside 0 to {}",
                    vd - 1
                ),
                x.to_string(),
                format!(
                    "0 to {}, columns of the draft vocabulary (draft_vocab_size {vd})",
                    vd - 1
                ),
            );
        }
    }
    if m.topk().is_none() {
        if let Some((spec, probs)) = get("target_probs") {
            let vd = spec.row.get(1).copied().unwrap_or(1).max(1);
            let tol = sum_tolerance(spec.dtype);
            let size = spec.dtype.bitsize() / 8;
            let mut bad = 0u64;
            let mut worst = 0f64;
            let mut first: Option<(u64, f64)> = None;
            for (r, row) in probs.chunks(vd * size).enumerate() {
                let sum: f64 = floats(row, spec.dtype).map(f64::from).sum();
                let err = (sum - 1.0).abs();
                if err > tol || !err.is_finite() {
                    bad += 1;
                    if err.is_finite() {
                        worst = worst.max(err);
                    }
                    first.get_or_insert((r as u64, sum));
                }
            }
            if let Some((r, sum)) = first {
                push(
                    spec,
                    r * vd as u64,
                    format!(
                        "{bad} `target_probs` rows do not sum to 1 within {tol} (worst off by \
                         {worst:.3e})"
                    ),
                    format!("the row sums to {}", sum as f32),
                    format!(
                        "rows summing to 1 within {tol} (the {} tolerance)",
                        dtype_name(spec.dtype)
                    ),
                );
            }
        }
    }
    out
}
