use super::*;
use rand::{Rng, SeedableRng};

fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box-Muller: enough for test data, no extra dependency.
            let u1: f32 = rng.random::<f32>().max(1e-12);
            let u2: f32 = rng.random();
            (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

fn rms_rel_error(format: Format, x: &[f32]) -> f64 {
    let mut q = vec![0u8; format.row_bytes(x.len()).unwrap()];
    quantize(format, x, &mut q).unwrap();
    let mut y = vec![0f32; x.len()];
    dequantize(format, &q, &mut y).unwrap();
    let err: f64 = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / norm).sqrt()
}

#[test]
fn names_parse_case_insensitively() {
    for f in ALL_FORMATS {
        assert_eq!(f.name().to_lowercase().parse::<Format>().unwrap(), f);
        assert_eq!(f.name().parse::<Format>().unwrap(), f);
        assert_eq!(Format::from_ggml_id(f.ggml_id()).unwrap(), f);
    }
    assert_eq!("q4_K".parse::<Format>().unwrap(), Format::Q4_K);
    assert!(matches!("IQ4_XS".parse::<Format>(), Err(QuantError::UnknownName(_))));
}

#[test]
fn block_sizes_match_ggml() {
    let expect = [
        (Format::Q4_0, 18),
        (Format::Q4_1, 20),
        (Format::Q5_0, 22),
        (Format::Q5_1, 24),
        (Format::Q8_0, 34),
        (Format::Q2_K, 84),
        (Format::Q3_K, 110),
        (Format::Q4_K, 144),
        (Format::Q5_K, 176),
        (Format::Q6_K, 210),
        (Format::MXFP4, 17),
    ];
    for (f, b) in expect {
        assert_eq!(f.block_bytes(), b, "{f}");
    }
    assert_eq!(Format::Q4_K.row_bytes(2048).unwrap(), 8 * 144);
    assert!(Format::Q4_K.row_bytes(64).is_err());
}

#[test]
fn fallback_follows_llama_cpp() {
    assert_eq!(Format::Q4_K.resolve(64), Format::Q5_0);
    assert_eq!(Format::Q6_K.resolve(96), Format::Q8_0);
    assert_eq!(Format::Q4_K.resolve(48), Format::BF16);
    assert_eq!(Format::Q4_K.resolve(512), Format::Q4_K);
    assert_eq!(Format::Q2_K.resolve(32), Format::Q4_0);
    assert_eq!(Format::Q8_0.resolve(33), Format::BF16);
}

#[test]
fn round_trip_error_within_documented_bounds() {
    // Bounds are the documented RMS error relative to the signal, with head room (docs/quantization.md).
    let bounds = [
        (Format::F32, 0.0),
        (Format::F16, 5e-4),
        (Format::BF16, 4e-3),
        (Format::Q8_0, 0.01),
        (Format::Q6_K, 0.03),
        (Format::Q5_K, 0.05),
        (Format::Q5_1, 0.06),
        (Format::Q5_0, 0.07),
        (Format::Q4_K, 0.10),
        (Format::Q4_1, 0.12),
        (Format::Q4_0, 0.14),
        (Format::Q3_K, 0.22),
        (Format::Q2_K, 0.45),
        (Format::MXFP4, 0.20),
    ];
    let x = gaussian(256 * 64, 7);
    for (f, bound) in bounds {
        let e = rms_rel_error(f, &x);
        assert!(e <= bound, "{f}: relative RMS error {e} above {bound}");
    }
}

/// MXFP4 holds e2m1 values times a power of two exactly (what the hub's blocks decode to), and
/// its scale is ggml's `GGML_E8M0_TO_FP32_HALF` for every byte.
#[test]
fn mxfp4_keeps_e2m1_values_and_scales() {
    for e in 0..=254u8 {
        assert_eq!(crate::e8m0_to_f32_half(e), 2f64.powi(e as i32 - 128) as f32, "e {e}");
    }
    let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for scale in [2f32.powi(-9), 1.0, 2f32.powi(5)] {
        let x: Vec<f32> = (0..64).map(|i| e2m1[i % 8] * scale * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
        let mut q = vec![0u8; Format::MXFP4.row_bytes(64).unwrap()];
        quantize(Format::MXFP4, &x, &mut q).unwrap();
        let mut y = vec![0f32; 64];
        dequantize(Format::MXFP4, &q, &mut y).unwrap();
        assert_eq!(y, x, "scale {scale}");
    }
}

#[test]
fn exact_values_decode_exactly() {
    // Q8_0 with amax 127 has d = 1: every integer in [-127, 127] survives.
    let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 7.0 + if i == 0 { 15.0 } else { 0.0 }).collect();
    let mut x = x;
    x[31] = 127.0;
    let mut q = vec![0u8; 34];
    quantize(Format::Q8_0, &x, &mut q).unwrap();
    let mut y = vec![0f32; 32];
    dequantize(Format::Q8_0, &q, &mut y).unwrap();
    assert_eq!(x, y);
    // BF16 of a bf16-representable value is exact.
    let x = [1.5f32, -0.0078125, 2.0f32.powi(120), 0.0];
    let mut q = [0u8; 8];
    quantize(Format::BF16, &x, &mut q).unwrap();
    let mut y = [0f32; 4];
    dequantize(Format::BF16, &q, &mut y).unwrap();
    assert_eq!(x, y);
}

#[test]
fn zero_and_constant_blocks_do_not_break() {
    for f in ALL_FORMATS {
        let n = f.block_elems().max(32) * 2;
        for fill in [0.0f32, 1.0, -3.5] {
            let x = vec![fill; n];
            let mut q = vec![0u8; f.row_bytes(n).unwrap()];
            quantize(f, &x, &mut q).unwrap();
            let mut y = vec![0f32; n];
            dequantize(f, &q, &mut y).unwrap();
            for v in &y {
                assert!(v.is_finite(), "{f}");
                assert!((v - fill).abs() <= 0.15 * fill.abs() + 1e-6, "{f}: {fill} -> {v}");
            }
        }
    }
}

#[test]
fn size_mismatch_is_an_error_not_a_panic() {
    let x = vec![0f32; 256];
    let mut q = vec![0u8; 10];
    assert!(matches!(quantize(Format::Q4_K, &x, &mut q), Err(QuantError::BufferSize { .. })));
    let mut y = vec![0f32; 100];
    assert!(matches!(dequantize(Format::Q4_K, &q, &mut y), Err(QuantError::RowLength { .. })));
}

/// Every finite float8 e4m3 code survives the trip to f32 and back, its value is its
/// "times 512" integer over 512, and the quantizer rounds to the nearest code (ties to even),
/// saturating at 448. MXFP8 blocks of codes times a power of two (DeepSeek-V4's float8 layers)
/// quantize back to themselves.
#[test]
fn e4m3_codes_round_trip_and_mxfp8_holds_float8_exactly() {
    use crate::{e4m3_times_512, e4m3_to_f32, f32_to_e4m3};
    for q in 0..=255u8 {
        if q & 0x7f == 0x7f {
            assert!(e4m3_to_f32(q).is_nan());
            continue;
        }
        let v = e4m3_to_f32(q);
        assert_eq!(v, e4m3_times_512(q) as f32 / 512.0, "code {q:#x}");
        let back = f32_to_e4m3(v);
        assert!(back == q || (v == 0.0 && back & 0x7f == 0), "code {q:#x} ({v}) came back as {back:#x}");
    }
    assert_eq!(e4m3_to_f32(f32_to_e4m3(1000.0)), 448.0);
    assert_eq!(e4m3_to_f32(f32_to_e4m3(-1e9)), -448.0);
    // Halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1): to the even mantissa.
    assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
    assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
    assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1)), 1.125);
    // A block of float8 values scaled by 2^-5 is held exactly.
    let codes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) & 0x7e).collect();
    let x: Vec<f32> = codes.iter().map(|&q| e4m3_to_f32(q) / 32.0).collect();
    let mut b = vec![0u8; Format::MXFP8.row_bytes(64).unwrap()];
    crate::quantize(Format::MXFP8, &x, &mut b).unwrap();
    let mut y = vec![0f32; 64];
    crate::dequantize(Format::MXFP8, &b, &mut y).unwrap();
    assert_eq!(x, y);
}

/// FP8 blocks hold float8 codes times an arbitrary f32 scale (a `weight_scale_inv` of a
/// 128×128 block-scaled checkpoint) exactly: built from codes and scale, they decode to the
/// products; quantized from those values they decode to them again when a code of the block
/// is ±448 (the quantizer's scale is then the original one).
#[test]
fn fp8_holds_block_scaled_float8_exactly() {
    use crate::blocks::{BlockFp8, QK_FP8};
    use crate::{e4m3_to_f32, f32_to_e4m3};
    let scale = 0.000_713_7_f32;
    let codes: Vec<u8> =
        (0..2 * QK_FP8).map(|i| if i % QK_FP8 == 5 { f32_to_e4m3(-448.0) } else { (i as u8).wrapping_mul(37) & 0xfe }).collect();
    let codes: Vec<u8> = codes.into_iter().map(|q| if q & 0x7f == 0x7e && q != f32_to_e4m3(-448.0) { q & 0xf0 } else { q }).collect();
    let want: Vec<f32> = codes.iter().map(|&q| e4m3_to_f32(q) * scale).collect();
    let blocks: Vec<BlockFp8> = codes.chunks(QK_FP8).map(|c| BlockFp8 { d: scale.to_le_bytes(), qs: c.try_into().unwrap() }).collect();
    let mut y = vec![0f32; 2 * QK_FP8];
    crate::dequantize(Format::FP8, bytemuck::cast_slice(&blocks), &mut y).unwrap();
    assert_eq!(y, want);
    let mut b = vec![0u8; Format::FP8.row_bytes(2 * QK_FP8).unwrap()];
    crate::quantize(Format::FP8, &want, &mut b).unwrap();
    crate::dequantize(Format::FP8, &b, &mut y).unwrap();
    let worst = y.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= scale * 1e-3, "requantized FP8 moved a value by {worst}");
    assert_eq!(Format::FP8.row_bytes(256).unwrap(), 264);
    // A block of values near the bottom of f32 (and zeros) quantizes to finite codes.
    let tiny: Vec<f32> = (0..QK_FP8).map(|i| if i % 3 == 0 { 0.0 } else { 1e-38 * (i % 7) as f32 }).collect();
    let mut b = vec![0u8; Format::FP8.row_bytes(QK_FP8).unwrap()];
    crate::quantize(Format::FP8, &tiny, &mut b).unwrap();
    let mut y = vec![0f32; QK_FP8];
    crate::dequantize(Format::FP8, &b, &mut y).unwrap();
    assert!(y.iter().zip(&tiny).all(|(a, b)| a.is_finite() && (a - b).abs() <= 1e-38), "{y:?}");
    assert!(!Format::FP8.fits(192));
}
