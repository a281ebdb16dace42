//! Scalar reference dot products of one weight row with one activation row. Every SIMD path is
//! tested against these; they in turn follow the block definitions of `smoe-quant` (whose
//! decoders are ggml's).

use crate::act::{Block256, Block32};
use smoe_quant::blocks::*;
use smoe_quant::half::{bf16_bits_to_f32, f16_bits_to_f32, f32_to_f16_bits};
use smoe_quant::{scale_min_k4, unpack_q3_scales};

fn blocks<T: bytemuck::Pod>(w: &[u8]) -> &[T] {
    bytemuck::cast_slice(w)
}

/// f32 weights.
pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(4).zip(x).map(|(c, &v)| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * v).sum()
}

/// f16 weights.
pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2).zip(x).map(|(c, &v)| f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])) * v).sum()
}

/// `n` rows of `len` fp16 values, `stride` apart in `src`, to f32 rows of `len` in `dst`,
/// exactly.
pub fn widen_f16(src: &[u16], n: usize, len: usize, stride: usize, dst: &mut [f32]) {
    assert!(n == 0 || ((n - 1) * stride + len <= src.len() && n * len <= dst.len()), "widen_f16: buffers too short");
    for r in 0..n {
        let row = &src[r * stride..][..len];
        dst[r * len..][..len].iter_mut().zip(row).for_each(|(d, &h)| *d = f16_bits_to_f32(h));
    }
}

/// f32 to fp16 bits, rounding to nearest even (`dst` and `src` of one length).
pub fn narrow_f16(src: &[f32], dst: &mut [u16]) {
    dst.iter_mut().zip(src).for_each(|(d, &v)| *d = f32_to_f16_bits(v));
}

/// bf16 weights.
pub fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2).zip(x).map(|(c, &v)| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])) * v).sum()
}

fn isum(a: impl Iterator<Item = i32>) -> i32 {
    a.sum()
}

/// Q8_0 weights.
pub fn dot_q8_0(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockQ8_0>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| b.d.to_f32() * a.d * isum(b.qs.iter().zip(&a.qs).map(|(&q, &p)| q as i32 * p as i32)) as f32)
        .sum()
}

/// Q4_0 weights.
pub fn dot_q4_0(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockQ4_0>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s = isum((0..16).map(|j| ((b.qs[j] & 15) as i32 - 8) * a.qs[j] as i32 + ((b.qs[j] >> 4) as i32 - 8) * a.qs[j + 16] as i32));
            b.d.to_f32() * a.d * s as f32
        })
        .sum()
}

/// MXFP4 weights: integer e2m1 values (doubled, [`smoe_quant::KVALUES_MXFP4`]) times half the
/// e8m0 scale.
pub fn dot_mxfp4(w: &[u8], a: &[Block32]) -> f32 {
    let kv = &smoe_quant::KVALUES_MXFP4;
    blocks::<BlockMxfp4>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s =
                isum((0..16).map(|j| {
                    kv[(b.qs[j] & 15) as usize] as i32 * a.qs[j] as i32 + kv[(b.qs[j] >> 4) as usize] as i32 * a.qs[j + 16] as i32
                }));
            smoe_quant::e8m0_to_f32_half(b.e) * a.d * s as f32
        })
        .sum()
}

/// MXFP8 weights: each e4m3 code as its value times 512, an integer
/// ([`smoe_quant::e4m3_times_512`], |v| < 2^18, so 32 products with int8 activations stay within
/// i32), times the block's e8m0 scale and 2^−9 (half the scale times 2^−8).
pub fn dot_mxfp8(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockMxfp8>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s = isum(b.qs.iter().zip(&a.qs).map(|(&q, &p)| smoe_quant::e4m3_times_512(q) * p as i32));
            smoe_quant::e8m0_to_f32_half(b.e) * (1.0 / 256.0) * a.d * s as f32
        })
        .sum()
}

/// FP8 weights: each 32 codes against their activation block as in [`dot_mxfp8`] (values
/// times 512, summed exactly in i32), the four sums weighted by their activation scales, times
/// the block's f32 scale and 2^−9.
pub fn dot_fp8(w: &[u8], a: &[Block32]) -> f32 {
    fp8_blocks(w, a, |q, a| isum(q.iter().zip(&a.qs).map(|(&q, &p)| smoe_quant::e4m3_times_512(q) * p as i32)))
}

/// FP8's arithmetic around a table's own exact sum `isum` of 32 codes times 512 against one
/// activation block: the four sums of a block weighted by their activation scales, in order,
/// times the block's f32 scale and 2^−9 — one order of operations for every table.
#[inline(always)]
pub(crate) fn fp8_blocks(w: &[u8], a: &[Block32], isum: impl Fn(&[u8; 32], &Block32) -> i32) -> f32 {
    let mut s = 0f32;
    for (b, a) in blocks::<BlockFp8>(w).iter().zip(a.chunks_exact(4)) {
        let mut part = 0f32;
        for (j, a) in a.iter().enumerate() {
            let q: &[u8; 32] = b.qs[32 * j..32 * (j + 1)].try_into().expect("32 codes");
            part += a.d * isum(q, a) as f32;
        }
        s += b.scale() * (1.0 / 512.0) * part;
    }
    s
}

/// Q4_1 weights (value = q·d + m).
pub fn dot_q4_1(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockQ4_1>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s = isum((0..16).map(|j| (b.qs[j] & 15) as i32 * a.qs[j] as i32 + (b.qs[j] >> 4) as i32 * a.qs[j + 16] as i32));
            b.d.to_f32() * a.d * s as f32 + b.m.to_f32() * a.s
        })
        .sum()
}

fn q5(qs: &[u8; 16], qh: [u8; 4], j: usize) -> (i32, i32) {
    let h = u32::from_le_bytes(qh);
    let lo = (qs[j] & 15) as i32 | (((h >> j) & 1) << 4) as i32;
    let hi = (qs[j] >> 4) as i32 | (((h >> (j + 16)) & 1) << 4) as i32;
    (lo, hi)
}

/// Q5_0 weights.
pub fn dot_q5_0(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockQ5_0>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s = isum((0..16).map(|j| {
                let (lo, hi) = q5(&b.qs, b.qh, j);
                (lo - 16) * a.qs[j] as i32 + (hi - 16) * a.qs[j + 16] as i32
            }));
            b.d.to_f32() * a.d * s as f32
        })
        .sum()
}

/// Q5_1 weights.
pub fn dot_q5_1(w: &[u8], a: &[Block32]) -> f32 {
    blocks::<BlockQ5_1>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let s = isum((0..16).map(|j| {
                let (lo, hi) = q5(&b.qs, b.qh, j);
                lo * a.qs[j] as i32 + hi * a.qs[j + 16] as i32
            }));
            b.d.to_f32() * a.d * s as f32 + b.m.to_f32() * a.s
        })
        .sum()
}

/// Q4_K quants of one super-block in element order.
pub fn q4k_quants(b: &BlockQ4K) -> [u8; 256] {
    let mut q = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = b.qs[32 * c + l] & 15;
            q[64 * c + 32 + l] = b.qs[32 * c + l] >> 4;
        }
    }
    q
}

/// Q4_K weights: `d·sc·q - dmin·m` per group of 32.
pub fn dot_q4_k(w: &[u8], a: &[Block256]) -> f32 {
    blocks::<BlockQ4K>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let q = q4k_quants(b);
            let (mut sumi, mut summ) = (0i32, 0i32);
            for g in 0..8 {
                let (sc, m) = scale_min_k4(g, &b.scales);
                sumi += sc as i32 * isum((32 * g..32 * g + 32).map(|i| q[i] as i32 * a.qs[i] as i32));
                summ += m as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
            }
            a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * summ as f32)
        })
        .sum()
}

/// Q5_K weights.
pub fn dot_q5_k(w: &[u8], a: &[Block256]) -> f32 {
    blocks::<BlockQ5K>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let mut q = [0i32; 256];
            for c in 0..4 {
                for l in 0..32 {
                    q[64 * c + l] = (b.qs[32 * c + l] & 15) as i32 + if b.qh[l] & (1 << (2 * c)) != 0 { 16 } else { 0 };
                    q[64 * c + 32 + l] = (b.qs[32 * c + l] >> 4) as i32 + if b.qh[l] & (2 << (2 * c)) != 0 { 16 } else { 0 };
                }
            }
            let (mut sumi, mut summ) = (0i32, 0i32);
            for g in 0..8 {
                let (sc, m) = scale_min_k4(g, &b.scales);
                sumi += sc as i32 * isum((32 * g..32 * g + 32).map(|i| q[i] * a.qs[i] as i32));
                summ += m as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
            }
            a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * summ as f32)
        })
        .sum()
}

/// Q6_K quants of one super-block in element order, offset removed (−32..31).
pub fn q6k_quants(b: &BlockQ6K) -> [i8; 256] {
    let mut q = [0i8; 256];
    for h in 0..2 {
        let (ql, qh) = (&b.ql[64 * h..], &b.qh[32 * h..]);
        for l in 0..32 {
            q[128 * h + l] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i8 - 32;
            q[128 * h + 32 + l] = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            q[128 * h + 64 + l] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            q[128 * h + 96 + l] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

/// Q6_K weights.
pub fn dot_q6_k(w: &[u8], a: &[Block256]) -> f32 {
    blocks::<BlockQ6K>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let q = q6k_quants(b);
            let s = isum((0..16).map(|g| b.scales[g] as i32 * isum((16 * g..16 * g + 16).map(|i| q[i] as i32 * a.qs[i] as i32))));
            a.d * b.d.to_f32() * s as f32
        })
        .sum()
}

/// Q3_K weights.
pub fn dot_q3_k(w: &[u8], a: &[Block256]) -> f32 {
    blocks::<BlockQ3K>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let sc = unpack_q3_scales(&b.scales);
            let mut q = [0i32; 256];
            let mut m = 1u8;
            for half in 0..2 {
                for (j, shift) in [0u32, 2, 4, 6].into_iter().enumerate() {
                    for l in 0..32 {
                        let low = ((b.qs[32 * half + l] >> shift) & 3) as i32;
                        q[128 * half + 32 * j + l] = low - if b.hmask[l] & m != 0 { 0 } else { 4 };
                    }
                    m <<= 1;
                }
            }
            let s = isum((0..16).map(|g| sc[g] as i32 * isum((16 * g..16 * g + 16).map(|i| q[i] * a.qs[i] as i32))));
            a.d * b.d.to_f32() * s as f32
        })
        .sum()
}

/// Q2_K weights.
pub fn dot_q2_k(w: &[u8], a: &[Block256]) -> f32 {
    blocks::<BlockQ2K>(w)
        .iter()
        .zip(a)
        .map(|(b, a)| {
            let mut q = [0i32; 256];
            for half in 0..2 {
                for (j, shift) in [0u32, 2, 4, 6].into_iter().enumerate() {
                    for l in 0..32 {
                        q[128 * half + 32 * j + l] = ((b.qs[32 * half + l] >> shift) & 3) as i32;
                    }
                }
            }
            let (mut sumi, mut summ) = (0i32, 0i32);
            for g in 0..16 {
                let sc = b.scales[g];
                sumi += (sc & 15) as i32 * isum((16 * g..16 * g + 16).map(|i| q[i] * a.qs[i] as i32));
                summ += (sc >> 4) as i32 * a.bsums[g] as i32;
            }
            a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * summ as f32)
        })
        .sum()
}
