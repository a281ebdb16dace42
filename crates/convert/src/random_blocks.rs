//! Random but valid quantized blocks, written straight into a format's bytes: `smoe synth
//! --random-blocks` makes a model of any published shape at the speed of the disk, with no f32
//! values and no quantization pass (a Q4_K quantizer ran at ~120 MiB/s of bf16 input on 16
//! cores, eight minutes for the 48-layer Qwen3-30B-A3B shape; the largest shapes took hours).
//!
//! Every byte of a block is random except its f16 scales, which set the spread: in each of these
//! formats any quant bits and sub-block scales decode to finite values, so random bytes are a
//! valid block. The block scale `d` is chosen so that the dequantized values have the requested
//! standard deviation (calibrated once per format by decoding blocks of unit scale), jittered by
//! ±10% from block to block; where a format has a minimum (`dmin`, `m`) it is set to cancel the
//! mean of the unsigned quants, so values centre on zero as trained weights do. MXFP4's scale is
//! a power of two (an e8m0 exponent): each block takes one of the two exponents around the
//! wanted scale, the larger with the probability that makes the mean square the asked one.

use smoe_quant::half::F16Bytes;
use smoe_quant::Format;
use std::sync::OnceLock;

/// Where a format keeps its scale and minimum, and the minimum that centres its values.
struct Layout {
    /// The block's scale `d`.
    d: Scale,
    /// Byte offset of the minimum (an f16) and its ratio to `d` (`None`: a signed format).
    min: Option<(usize, f32)>,
}

/// Where and how a block keeps its scale.
#[derive(Clone, Copy)]
enum Scale {
    /// An f16 at this byte offset.
    F16(usize),
    /// The first byte, an e8m0 exponent: the scale is a power of two (MXFP4).
    E8M0,
}

/// The e8m0 exponent whose MXFP4 scale is 1 (`e8m0_to_f32_half`).
const E8M0_ONE: i32 = 128;

fn layout(format: Format) -> Option<Layout> {
    Some(match format {
        Format::Q8_0 | Format::Q4_0 | Format::Q5_0 => Layout { d: Scale::F16(0), min: None },
        // value = d·q + m: centred by m = -d·mean(q).
        Format::Q4_1 => Layout { d: Scale::F16(0), min: Some((2, -7.5)) },
        Format::Q5_1 => Layout { d: Scale::F16(0), min: Some((2, -15.5)) },
        // value = d·sc·q − dmin·mn with sc, mn of the same range: centred by dmin = d·mean(q).
        Format::Q2_K => Layout { d: Scale::F16(80), min: Some((82, 1.5)) },
        Format::Q4_K => Layout { d: Scale::F16(0), min: Some((2, 7.5)) },
        Format::Q5_K => Layout { d: Scale::F16(0), min: Some((2, 15.5)) },
        Format::Q3_K => Layout { d: Scale::F16(108), min: None },
        Format::Q6_K => Layout { d: Scale::F16(208), min: None },
        // Signed e2m1 codes, symmetric: random nibbles centre on zero.
        Format::MXFP4 => Layout { d: Scale::E8M0, min: None },
        _ => return None,
    })
}

/// Whether `format` can be written as random blocks (the float formats cannot: they are
/// generated as values).
pub fn supported(format: Format) -> bool {
    layout(format).is_some()
}

/// Random bytes and a jitter from synth's generator, seeded per (seed, tensor, row) and apart
/// from the values `synth` generates for the same tensor.
struct Rng(crate::synth::Rng);
impl Rng {
    fn new(seed: u64, tensor: u64, row: u64) -> Rng {
        Rng(crate::synth::Rng::new(seed ^ 0x5151_5151_5151_5151, tensor, row))
    }
    fn next(&mut self) -> u64 {
        self.0.next()
    }
    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn set_f16(block: &mut [u8], at: usize, v: f32) {
    block[at..at + 2].copy_from_slice(&F16Bytes::from_f32(v).0);
}

/// K-quants with a minimum per sub-block get it equal to the sub-block's scale (both from
/// [32, 63], or [8, 15] for Q2_K's 4-bit fields), as a quantizer sets them for values centred on
/// zero: each sub-block then spans −d·sc·mean(q) .. d·sc·(max − mean(q)), not a random offset.
fn centre_sub_blocks(format: Format, block: &mut [u8], rng: &mut Rng) {
    match format {
        Format::Q2_K => {
            for b in &mut block[..16] {
                let s = 8 + (rng.next() & 7) as u8;
                *b = s | (s << 4);
            }
        }
        Format::Q4_K | Format::Q5_K => {
            let s: [u8; 8] = std::array::from_fn(|_| 32 + (rng.next() & 31) as u8);
            let q = &mut block[4..16];
            for k in 0..4 {
                q[k] = s[k] | ((s[k + 4] >> 4) << 6);
                q[k + 4] = q[k];
                q[k + 8] = (s[k + 4] & 0xF) | ((s[k + 4] & 0xF) << 4);
            }
        }
        _ => {}
    }
}

/// Standard deviation of the values of random blocks of `format` with `d` = 1.
fn unit_spread(format: Format) -> f32 {
    static CACHE: OnceLock<std::sync::Mutex<Vec<(Format, f32)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(&(_, s)) = cache.lock().unwrap().iter().find(|(f, _)| *f == format) {
        return s;
    }
    let l = layout(format).expect("a supported format");
    let (bb, be) = (format.block_bytes(), format.block_elems());
    let blocks = 256;
    let mut bytes = vec![0u8; bb * blocks];
    let mut rng = Rng::new(0x00C0_FFEE, 0, 0);
    for b in bytes.chunks_exact_mut(bb) {
        rng.fill(b);
        centre_sub_blocks(format, b, &mut rng);
        match l.d {
            Scale::F16(at) => set_f16(b, at, 1.0),
            Scale::E8M0 => b[0] = E8M0_ONE as u8,
        }
        if let Some((at, ratio)) = l.min {
            set_f16(b, at, ratio);
        }
    }
    let mut v = vec![0f32; be * blocks];
    smoe_quant::dequantize(format, &bytes, &mut v).expect("valid blocks");
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
    let s = var.sqrt() as f32;
    cache.lock().unwrap().push((format, s));
    s
}

/// Writes rows `row0..` of tensor `tensor` (whose rows are `cols` long) as random blocks of
/// `format` with values of standard deviation `sigma` into `dst` (whole rows).
pub fn fill_rows(format: Format, cols: usize, sigma: f32, seed: u64, tensor: u64, row0: usize, dst: &mut [u8]) {
    use rayon::prelude::*;
    let l = layout(format).expect("a supported format");
    let row_bytes = format.row_bytes(cols).expect("rows of whole blocks");
    let d0 = sigma / unit_spread(format);
    // A power-of-two scale: 2^lo or 2^(lo + 1), the larger with probability `up`, so that the
    // mean of d² is d0² ((1 - up)·4^lo + up·4^(lo + 1) = 4^log2(d0)).
    let lo = d0.log2().floor();
    let up = (4f32.powf(d0.log2() - lo) - 1.0) / 3.0;
    dst.par_chunks_mut(row_bytes).enumerate().for_each(|(i, row)| {
        let mut rng = Rng::new(seed, tensor, (row0 + i) as u64);
        rng.fill(row);
        for b in row.chunks_exact_mut(format.block_bytes()) {
            centre_sub_blocks(format, b, &mut rng);
            let Scale::F16(d_at) = l.d else {
                let e = E8M0_ONE + lo as i32 + i32::from(rng.signed_unit() * 0.5 + 0.5 < up);
                b[0] = e.clamp(1, 254) as u8;
                continue;
            };
            let d = d0 * (1.0 + 0.1 * rng.signed_unit());
            set_f16(b, d_at, d);
            if let Some((at, ratio)) = l.min {
                set_f16(b, at, ratio * d);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every supported format: the blocks decode to finite values of the asked spread, centred
    /// near zero, the same for the same seed and different for another.
    #[test]
    fn random_blocks_decode_to_the_requested_spread() {
        let formats: Vec<Format> = smoe_quant::ALL_FORMATS.into_iter().filter(|&f| supported(f)).collect();
        assert_eq!(formats.len(), 11, "every block format but the float ones, MXFP8 and FP8");
        for f in formats {
            let (rows, cols, sigma) = (64, 512, 0.03f32);
            let mut a = vec![0u8; rows * f.row_bytes(cols).unwrap()];
            fill_rows(f, cols, sigma, 7, 3, 10, &mut a);
            let mut v = vec![0f32; rows * cols];
            smoe_quant::dequantize(f, &a, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{f:?}");
            let mean = v.iter().sum::<f32>() / v.len() as f32;
            let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt();
            assert!((sd / sigma - 1.0).abs() < 0.15, "{f:?}: spread {sd} for {sigma}");
            assert!(mean.abs() < 0.2 * sigma, "{f:?}: mean {mean}");
            let mut b = vec![0u8; a.len()];
            fill_rows(f, cols, sigma, 7, 3, 10, &mut b);
            assert_eq!(a, b, "{f:?}: deterministic");
            fill_rows(f, cols, sigma, 8, 3, 10, &mut b);
            assert_ne!(a, b, "{f:?}: the seed matters");
        }
        assert!(!supported(Format::BF16));
    }
}
