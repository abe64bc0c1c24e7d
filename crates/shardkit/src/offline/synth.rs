//! Deterministic synthetic samples, for tests, benchmarks and demos: every field holds valid
//! values (masks 0/1 with `position_mask` inside `loss_mask`, probability rows summing to 1 in
//! the cache dtype, top-k indices distinct and in range), and sample `i` is always the same
//! bytes, so an interrupted synthetic write resumes byte-identically.

use safetensors::Dtype;

use super::manifest::Manifest;
use super::shard::field_specs;
use crate::engine::order::SplitMix64;

/// Rounds to the nearest IEEE half (ties to even), as numpy's `astype(float16)` does; every NaN
/// becomes the quiet NaN of its sign (`0x7e00`/`0xfe00`), whatever its payload.
fn f32_to_f16(x: f32) -> u16 {
    if x.is_nan() {
        return ((x.to_bits() >> 16) as u16 & 0x8000) | 0x7e00;
    }
    half::f16::from_f32(x).to_bits()
}

/// `values` encoded in `dtype` (F32, BF16 or F16), little-endian.
pub(crate) fn encode_floats(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => values
            .iter()
            // Ties to even, as `torch.Tensor.to(torch.bfloat16)` rounds; a NaN stays quiet.
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        _ => values
            .iter()
            .flat_map(|&v| f32_to_f16(v).to_le_bytes())
            .collect(),
    }
}

fn unit(rng: &mut SplitMix64) -> f32 {
    (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32
}

/// Every stored tensor's bytes for sample `i` of a cache described by `m`.
pub fn synthetic_sample(m: &Manifest, i: u64) -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = SplitMix64(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xea61e3);
    let s = m.seq_length as usize;
    let vocab = m.target_vocab_size.unwrap_or(32_000).max(1);
    let len = s / 2 + rng.below(s as u64 / 2 + 1) as usize;
    let first_loss = len / 4;
    let mut out = Vec::new();
    for spec in field_specs(m) {
        let bytes = match spec.name {
            "input_ids" => (0..s)
                .flat_map(|_| (rng.below(vocab) as i64).to_le_bytes())
                .collect(),
            "attention_mask" => (0..s)
                .flat_map(|p| i64::from(p < len).to_le_bytes())
                .collect(),
            "loss_mask" => (0..s)
                .flat_map(|p| i64::from(p >= first_loss && p < len).to_le_bytes())
                .collect(),
            "position_mask" => (0..s)
                .map(|p| {
                    u8::from(p >= first_loss && p < len && !(p * 7 + i as usize).is_multiple_of(3))
                })
                .collect(),
            "aux_hidden_states" | "target_hidden_states" | "target_last_hidden_states" => {
                let v: Vec<f32> = (0..s * spec.row[1])
                    .map(|_| (unit(&mut rng) - 0.5) * 4.0)
                    .collect();
                encode_floats(spec.dtype, &v)
            }
            "target_probs" => {
                let vd = spec.row[1];
                let mut v = Vec::with_capacity(s * vd);
                for _ in 0..s {
                    let w: Vec<f32> = (0..vd)
                        .map(|_| {
                            let u = unit(&mut rng);
                            u * u * u + 1e-4
                        })
                        .collect();
                    let total: f32 = w.iter().sum();
                    v.extend(w.iter().map(|x| x / total));
                }
                encode_floats(spec.dtype, &v)
            }
            "target_probs_indices" => {
                let k = spec.row[1] as u64;
                let vd = m.eagle3().map_or(1, |e| e.draft_vocab_size);
                (0..s)
                    .flat_map(|_| {
                        let start = rng.below(vd);
                        (0..k).map(move |t| ((start + t * 7919) % vd) as i32)
                    })
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            }
            "target_probs_values" => {
                let k = spec.row[1];
                let v: Vec<f32> = (0..s)
                    .flat_map(|_| (0..k).map(|t| 0.9 / 2f32.powi(t as i32 + 1)))
                    .collect();
                encode_floats(spec.dtype, &v)
            }
            _ => vec![0u8; spec.row_bytes()],
        };
        out.push((spec.name, bytes));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    fn f16_to_f32(h: u16) -> f32 {
        half::f16::from_bits(h).to_f32()
    }

    #[test]
    fn conversions_round_to_nearest_even() {
        assert_eq!(bf16(1.0), 0x3f80);
        assert_eq!(bf16(f32::from_bits(0x3f80_8000)), 0x3f80, "tie to even");
        assert_eq!(bf16(f32::from_bits(0x3f81_8000)), 0x3f82, "tie to even");
        assert_eq!(bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16(f32::NAN), 0x7fc0);
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00, "rounds up to infinity");
        assert_eq!(f32_to_f16(5.960_464_5e-8), 0x0001, "smallest subnormal");
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00, "tie to even");
        assert_eq!(
            f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)),
            0x3c02,
            "tie to even"
        );
        assert_eq!(f32_to_f16(f32::from_bits(0x7f80_0001)), 0x7e00, "NaN");
        assert_eq!(f32_to_f16(-f32::NAN), 0xfe00, "NaN");
        for h in [0u16, 1, 0x3ff, 0x400, 0x3c00, 0x7bff, 0xc000, 0x8001] {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#06x} round-trips");
        }
        assert!(f16_to_f32(0x7c00).is_infinite() && f16_to_f32(0x7e00).is_nan());
    }
}
