//! AVX2 + FMA kernels for the formats that come from imported GGUF files: Q4_0, Q4_1, Q5_0,
//! Q5_1 (32-element blocks) and Q2_K, Q3_K, Q5_K (256-element super-blocks). The same integer
//! tricks as the main kernels (`avx2.rs`): unsigned × signed `maddubs`, the sign trick for
//! signed × signed, group minimums through the activation sums.

use super::avx2::{hsum, hsum_i32, mul_sum_i8};
use super::{f16x8, k4_scales};
use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockMxfp4, BlockMxfp8, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1};
use std::arch::x86_64::*;

fn f16(b: [u8; 2]) -> f32 {
    smoe_quant::half::f16_bits_to_f32(u16::from_le_bytes(b))
}

/// 16 bytes of nibbles as 32 bytes: low nibbles (elements 0..15) then high (16..31).
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes from a 16-byte array.
    let x = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(x), x), _mm256_set1_epi8(0x0f))
}

/// 32 bits as 32 bytes, 0xff where the bit is set (ggml's expansion).
#[target_feature(enable = "avx2")]
fn bits(qh: [u8; 4]) -> __m256i {
    let x = i32::from_le_bytes(qh);
    let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Unsigned quants × signed activations → 8 i32.
#[target_feature(enable = "avx2")]
fn mul_sum_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2")]
fn load(a: &Block32) -> __m256i {
    // SAFETY: 32 bytes from a 32-byte array.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i) }
}

/// Runs `$prod` (a block's integer products as 8 i32) over the blocks eight at a time, with
/// the eight weight scales (and minimums, for Q4_1/Q5_1) converted from f16 in one instruction
/// off the accumulation chain; returns Σ d_w · d_a · Σ products (+ Σ m_w · s_a).
macro_rules! blocks8 {
    ($wb:expr, $a:expr, |$b:ident, $y:ident| $prod:expr $(, min: $m:ident)?) => {{
        let (wb, a) = ($wb, $a);
        let n = wb.len().min(a.len());
        let mut acc = [_mm256_setzero_ps(); 2];
        #[allow(unused_mut)]
        let mut mins = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            let k = (n - i).min(8);
            let (mut hd, mut ad) = ([0u16; 8], [0f32; 8]);
            #[allow(unused_mut, unused_variables)]
            let (mut hm, mut asum) = ([0u16; 8], [0f32; 8]);
            for j in 0..k {
                hd[j] = u16::from_le_bytes(wb[i + j].d.0);
                ad[j] = a[i + j].d;
                $( hm[j] = u16::from_le_bytes(wb[i + j].$m.0); asum[j] = a[i + j].s; )?
            }
            let mut d = [0f32; 8];
            // SAFETY: 8-element arrays.
            unsafe {
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(f16x8(&hd), _mm256_loadu_ps(ad.as_ptr())));
                $( let _ = stringify!($m); mins = _mm256_fmadd_ps(f16x8(&hm), _mm256_loadu_ps(asum.as_ptr()), mins); )?
            }
            for j in 0..k {
                let ($b, $y) = (&wb[i + j], load(&a[i + j]));
                let p = _mm256_cvtepi32_ps($prod);
                acc[j % 2] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), p, acc[j % 2]);
            }
            i += k;
        }
        hsum(_mm256_add_ps(acc[0], acc[1])) + hsum(mins)
    }};
}

/// Q4_0 weights: `d · (q − 8)`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ4_0] = bytemuck::cast_slice(w);
    blocks8!(wb, a, |b, y| mul_sum_i8(_mm256_sub_epi8(nibbles(&b.qs), _mm256_set1_epi8(8)), y))
}

/// MXFP4 weights: each code looked up as its doubled e2m1 value (a signed byte, by one
/// shuffle), times half the block's e8m0 scale.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_mxfp4(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockMxfp4] = bytemuck::cast_slice(w);
    let kv = smoe_quant::KVALUES_MXFP4;
    // SAFETY: 16 bytes from a 16-byte array, in both lanes (the shuffle looks up per lane).
    let table = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(kv.as_ptr() as *const __m128i)) };
    let mut acc = [_mm256_setzero_ps(); 2];
    for (i, (b, a)) in wb.iter().zip(a).enumerate() {
        let q = _mm256_shuffle_epi8(table, nibbles(&b.qs));
        let p = _mm256_cvtepi32_ps(mul_sum_i8(q, load(a)));
        let d = smoe_quant::e8m0_to_f32_half(b.e) * a.d;
        acc[i % 2] = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc[i % 2]);
    }
    hsum(_mm256_add_ps(acc[0], acc[1]))
}

/// MXFP8 weights: eight e4m3 codes at a time widened to 32-bit lanes and turned into their
/// values times 512 (`m` below the normal range, `(8 + m) << (E − 1)` above, by a variable
/// shift), signed, multiplied with the widened int8 activations and summed per block in i32
/// (as the scalar kernel: |v| < 2^18); then the block's e8m0 scale times 2^−9.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_mxfp8(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockMxfp8] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        s += smoe_quant::e8m0_to_f32_half(b.e) * (1.0 / 256.0) * a.d * e4m3_isum(&b.qs, a) as f32;
    }
    s
}

/// FP8 weights: each 32 codes against their activation block summed exactly as in
/// [`dot_mxfp8`], the four sums weighted by their activation scales, times the block's f32
/// scale and 2^−9 (as the scalar kernel, in the same order).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_fp8(w: &[u8], a: &[Block32]) -> f32 {
    // The closure inherits this function's AVX2 and FMA, all `e4m3_isum` needs.
    crate::scalar::fp8_blocks(w, a, |q, a| e4m3_isum(q, a))
}

/// 32 e4m3 codes times 512 against one int8 activation block, summed exactly in i32: the
/// codes widened to 32-bit lanes eight at a time and turned into their values times 512 (`m`
/// below the normal range, `(8 + m) << (E − 1)` above, by a variable shift), signed,
/// multiplied with the widened activations (|v| < 2^18, so 32 products stay within i32).
#[target_feature(enable = "avx2,fma")]
fn e4m3_isum(qs: &[u8; 32], a: &Block32) -> i32 {
    let (seven, eight, fifteen, one) = (_mm256_set1_epi32(7), _mm256_set1_epi32(8), _mm256_set1_epi32(15), _mm256_set1_epi32(1));
    let mut sum = _mm256_setzero_si256();
    for c in 0..4 {
        // SAFETY: 8 bytes at offset 8c of two 32-byte arrays.
        let (q, x) = unsafe {
            (
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.as_ptr().add(8 * c) as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(a.qs.as_ptr().add(8 * c) as *const __m128i)),
            )
        };
        let e = _mm256_and_si256(_mm256_srli_epi32(q, 3), fifteen);
        let m = _mm256_and_si256(q, seven);
        // A shift count of −1 (e = 0) gives 0 here; those lanes take `m` below.
        let normal = _mm256_sllv_epi32(_mm256_add_epi32(m, eight), _mm256_sub_epi32(e, one));
        let mag = _mm256_blendv_epi8(normal, m, _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        let neg = _mm256_srai_epi32(_mm256_slli_epi32(q, 24), 31);
        let v = _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);
        sum = _mm256_add_epi32(sum, _mm256_mullo_epi32(v, x));
    }
    hsum_i32(sum)
}

/// Q4_1 weights: `d · q + m`; the minimum meets the activation block sum.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ4_1] = bytemuck::cast_slice(w);
    blocks8!(wb, a, |b, y| mul_sum_u8_i8(nibbles(&b.qs), y), min: m)
}

/// Q5_0 weights: `d · (q − 16)` with the fifth bits in `qh`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ5_0] = bytemuck::cast_slice(w);
    // q − 16 in two's complement: q itself where the fifth bit is set, q | 0xf0 where not.
    blocks8!(wb, a, |b, y| mul_sum_i8(_mm256_or_si256(nibbles(&b.qs), _mm256_andnot_si256(bits(b.qh), _mm256_set1_epi8(0xf0u8 as i8))), y))
}

/// Q5_1 weights: `d · q + m` with the fifth bits in `qh`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_1(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ5_1] = bytemuck::cast_slice(w);
    blocks8!(wb, a, |b, y| mul_sum_u8_i8(_mm256_or_si256(nibbles(&b.qs), _mm256_and_si256(bits(b.qh), _mm256_set1_epi8(0x10))), y), min: m)
}

#[target_feature(enable = "avx2")]
fn load256(a: &Block256, at: usize) -> __m256i {
    // SAFETY: callers pass at <= 224, so 32 bytes fit in the 256 quants.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr().add(at) as *const __m256i) }
}

/// Shifts each 16-bit lane right by a run-time count.
#[target_feature(enable = "avx2")]
pub(super) fn srl(x: __m256i, n: i32) -> __m256i {
    _mm256_srl_epi16(x, _mm_cvtsi32_si128(n))
}

/// Q2_K weights: 2-bit quants in 16 groups, each with a 4-bit scale and a 4-bit minimum.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q2_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ2K] = bytemuck::cast_slice(w);
    let (m3, m4) = (_mm256_set1_epi8(3), _mm_set1_epi8(15));
    let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (b, a) in wb.iter().zip(a) {
        // SAFETY: scales holds 16 bytes.
        let sm = unsafe { _mm_loadu_si128(b.scales.as_ptr() as *const __m128i) };
        // SAFETY: bsums holds 16 i16, 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i) };
        let s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sm, m4));
        let mins = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), m4)), bsums);
        let mut sumi = _mm256_setzero_si256();
        for h in 0..2 {
            // SAFETY: qs holds 64 bytes, 32 per half.
            let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * h) as *const __m256i) };
            let sh = if h == 0 { _mm256_permute2x128_si256::<0x00>(s16, s16) } else { _mm256_permute2x128_si256::<0x11>(s16, s16) };
            for j in 0..4 {
                let x = _mm256_and_si256(srl(q, 2 * j as i32), m3);
                let p = _mm256_maddubs_epi16(x, load256(a, 128 * h + 32 * j));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sh, PAIR_SCALES[j])));
            }
        }
        // d and dmin are adjacent f16s: both converted in one instruction.
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([b.d.0[0], b.d.0[1], b.dmin.0[0], b.dmin.0[1]])));
        let ad = _mm_mul_ps(dd, _mm_set1_ps(a.d));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_broadcastss_ps(ad), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_broadcastss_ps(_mm_movehdup_ps(ad)), accm);
    }
    hsum(acc) - hsum(accm)
}

/// Q3_K weights: 2 low bits plus a high bit (clear means −4), sixteen signed 6-bit scales.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q3_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ3K] = bytemuck::cast_slice(w);
    let (m3, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    let mut acc = _mm256_setzero_ps();
    for (b, a) in wb.iter().zip(a) {
        // A quant is low + 4·high − 4 (high: its hmask bit). The products take the unsigned
        // low + 4·high (0..7) in one maddubs; the −4 comes off once per block through the
        // activation sums of each 16-element group: Σ_g s_g·(Σ (low + 4 high)·y − 4·bsum_g).
        let s16 = q3_scales(&b.scales);
        // SAFETY: bsums holds 16 i16, 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i) };
        // SAFETY: hmask holds 32 bytes.
        let hm = unsafe { _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i) };
        let mut sumi = _mm256_slli_epi32::<2>(_mm256_madd_epi16(s16, bsums));
        sumi = _mm256_sub_epi32(_mm256_setzero_si256(), sumi);
        for h in 0..2 {
            // SAFETY: qs holds 64 bytes, 32 per half.
            let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * h) as *const __m256i) };
            // This half's eight scales in both 128-bit lanes, for the per-group shuffles.
            let sh = if h == 0 { _mm256_permute2x128_si256::<0x00>(s16, s16) } else { _mm256_permute2x128_si256::<0x11>(s16, s16) };
            for j in 0..4 {
                let low = _mm256_and_si256(srl(q, 2 * j as i32), m3);
                // Bit 4h + j of each hmask byte, moved to bit 2 (shifts of at most 5 keep a
                // byte's own bits in place).
                let bit = 4 * h as i32 + j as i32;
                let hb = if bit >= 2 { srl(hm, bit - 2) } else { _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - bit)) };
                let x = _mm256_or_si256(low, _mm256_and_si256(hb, four));
                let p = _mm256_maddubs_epi16(x, load256(a, 128 * h + 32 * j));
                // Groups 2j and 2j + 1 of this half: the low lane's 16 elements, the high lane's.
                let sc = _mm256_shuffle_epi8(sh, PAIR_SCALES[j]);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(a.d * f16(b.d.0)), acc);
    }
    hsum(acc)
}

/// Shuffle controls broadcasting, for pair `j` of a half's eight 16-element groups (Q2_K,
/// Q3_K), scale `2j` (i16) over the low lane and `2j + 1` over the high lane: the scales of the
/// two groups a 32-byte product covers, built once per block instead of per product.
const PAIR_SCALES: [__m256i; 4] = {
    const fn ctl(j: usize) -> __m256i {
        let mut b = [0u8; 32];
        let mut i = 0;
        while i < 16 {
            b[i] = (4 * j + i % 2) as u8;
            b[16 + i] = (4 * j + 2 + i % 2) as u8;
            i += 1;
        }
        // SAFETY: 32 bytes reinterpreted as a 256-bit vector.
        unsafe { std::mem::transmute::<[u8; 32], __m256i>(b) }
    }
    [ctl(0), ctl(1), ctl(2), ctl(3)]
};

/// Q3_K's sixteen 6-bit scales (minus 32) as 16 i16, in group order: four words of 4-bit lows
/// and 2-bit highs assembled at once instead of one scale at a time.
#[target_feature(enable = "avx2")]
fn q3_scales(s: &[u8; 12]) -> __m256i {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, hi) = (w(0), w(1), w(2));
    let (lo4, hi2) = (0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let words = [
        (a0 & lo4) | ((hi & hi2) << 4),
        (a1 & lo4) | (((hi >> 2) & hi2) << 4),
        ((a0 >> 4) & lo4) | (((hi >> 4) & hi2) << 4),
        ((a1 >> 4) & lo4) | (((hi >> 6) & hi2) << 4),
    ];
    let v = _mm_sub_epi8(_mm_setr_epi32(words[0] as i32, words[1] as i32, words[2] as i32, words[3] as i32), _mm_set1_epi8(32));
    _mm256_cvtepi8_epi16(v)
}

/// Q5_K weights: Q4_K's layout plus a fifth bit per quant in `qh`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q5_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ5K] = bytemuck::cast_slice(w);
    let m4 = _mm256_set1_epi8(0x0f);
    let m1 = _mm256_set1_epi8(1);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let sm = k4_scales(&b.scales);
        let mut summ = 0i32;
        for g in 0..8 {
            summ += sm[8 + g] as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
        }
        // SAFETY: qh holds 32 bytes.
        let hb = unsafe { _mm256_loadu_si256(b.qh.as_ptr() as *const __m256i) };
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            // SAFETY: qs holds 128 bytes, 32 per chunk.
            let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i) };
            let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(srl(hb, 2 * c as i32), m1));
            let h1 = _mm256_slli_epi16::<4>(_mm256_and_si256(srl(hb, 2 * c as i32 + 1), m1));
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h0);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h1);
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(a, 64 * c)), _mm256_set1_epi16(sm[2 * c] as i16));
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(a, 64 * c + 32)), _mm256_set1_epi16(sm[2 * c + 1] as i16));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        total += a.d * (f16(b.d.0) * hsum(_mm256_cvtepi32_ps(sumi)) - f16(b.dmin.0) * summ as f32);
    }
    total
}
