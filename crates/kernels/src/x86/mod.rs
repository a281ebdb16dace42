//! x86-64 kernel tables, chosen by CPU feature detection.

pub mod act_avx2;
pub mod amx;
mod attn_tiles;
pub mod avx2;
pub mod avx2_more;
pub mod avx512;
pub mod gemm;
mod gemm512;
pub mod gemm_k23;
pub mod k23x8;
pub mod q4kx8;
pub mod q8x8;

use std::arch::x86_64::*;

/// Eight fp16 values (gathered into a buffer) to f32, in one instruction. Loading a whole
/// register avoids the partial-register merges that single-value conversions compile to.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(crate) fn f16x8(h: &[u16; 8]) -> __m256 {
    // SAFETY: 16 bytes from a 16-byte array.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr() as *const __m128i) })
}

/// How the one-token kernels (the row and interleaved-group kernels decode uses) prefetch the
/// weights ahead of the ones being read: read once per kernel call, so the loops only test it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prefetch {
    /// How many bytes ahead; 0 = none.
    pub bytes: usize,
    /// Into which cache: 0 = L1 (`T0`), 1 = `T1`, 2 = `T2`, 3 = `NTA`.
    pub hint: u8,
}

/// This CPU's [`Prefetch`]. On Intel these cores fetch from DRAM with too few misses in flight
/// for the hardware prefetchers to keep up: on the 16-core Sapphire Rapids host one core's Q4_K
/// group kernel streamed 6.1 GB/s against 9.3 GB/s that a plain summing loop reads, and 2,304
/// bytes ahead (two Q4_K group blocks) into L1 took decode from 19.1 to 26.6 tok/s at 2 threads
/// and from 36.8 to 48.6 at 4 (means of two rounds; docs/benchmarks.md, #23). On the AMD EPYC
/// (Zen 4) the same prefetches cost decode (13% on average over four noisy pairs; 11-13% when
/// earlier ones were removed on 2026-11-30), so other vendors get none. `SMOE_PREFETCH_BYTES`
/// overrides the distance and `SMOE_PREFETCH_HINT` (`t0`, `t1`, `t2`, `nta`) the cache level,
/// to measure them (held in L2, one core's group kernels streamed faster, decode did not).
pub fn prefetch() -> Prefetch {
    static P: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let bytes = std::env::var("SMOE_PREFETCH_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(if is_intel() { 2304 } else { 0 });
        let v = std::env::var("SMOE_PREFETCH_HINT").unwrap_or_default().to_ascii_lowercase();
        let hint = match v.as_str() {
            "" | "t0" => 0,
            "t1" => 1,
            "t2" => 2,
            "nta" => 3,
            _ => {
                // A measurement of the wrong setting would go unnoticed otherwise.
                eprintln!("warning: SMOE_PREFETCH_HINT={v:?} is none of t0, t1, t2, nta; using t0");
                0
            }
        };
        Prefetch { bytes, hint }
    })
}

/// The [`Prefetch`] of the Q8_0 four-token group kernel (a batch's dense products). Four tokens
/// take four times the arithmetic per byte, so one core no longer waits for memory as the
/// one-token kernels do, and on the EPYC (Zen 4), where those run best without prefetches, this
/// one ran from DRAM at 26-44 GMAC/s without and 43-65 with 4,352 bytes ahead (16 blocks; `kspeed
/// Q8_0`, three noisy rounds each; 118 GMAC/s held in L2). On Intel it takes [`prefetch`]'s.
/// `SMOE_PREFETCH_MANY_BYTES` overrides the distance (0: none).
pub fn prefetch_many() -> Prefetch {
    static P: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let one = prefetch();
        let default = if is_intel() { one.bytes } else { 4352 };
        let bytes = std::env::var("SMOE_PREFETCH_MANY_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        Prefetch { bytes, ..one }
    })
}

/// Whether the CPU's vendor string is Intel's.
pub fn is_intel() -> bool {
    let id = __cpuid(0);
    let word = |s: &[u8; 4]| u32::from_le_bytes(*s);
    (id.ebx, id.edx, id.ecx) == (word(b"Genu"), word(b"ineI"), word(b"ntel"))
}

/// Prefetches the lines of `len` bytes from `p + pf.bytes` (none when that is 0). A prefetch
/// never faults, so the address may lie past the slice being read.
#[inline(always)]
pub fn prefetch_ahead(p: *const u8, pf: Prefetch, len: usize) {
    if pf.bytes == 0 {
        return;
    }
    let mut o = 0;
    while o < len {
        let a = p.wrapping_add(pf.bytes.wrapping_add(o)) as *const i8;
        // SAFETY: a prefetch is a hint: it never faults and changes no memory.
        unsafe {
            match pf.hint {
                1 => _mm_prefetch::<_MM_HINT_T1>(a),
                2 => _mm_prefetch::<_MM_HINT_T2>(a),
                3 => _mm_prefetch::<_MM_HINT_NTA>(a),
                _ => _mm_prefetch::<_MM_HINT_T0>(a),
            }
        }
        o += 64;
    }
}

/// Q4_K/Q5_K's twelve scale bytes as eight 6-bit scales then eight 6-bit mins (ggml's
/// mask-and-shift unpacking, branch-free).
#[inline]
pub(crate) fn k4_scales(s: &[u8; 12]) -> [u8; 16] {
    const M1: u32 = 0x3f3f_3f3f;
    const M2: u32 = 0x0f0f_0f0f;
    const M3: u32 = 0x0303_0303;
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_lo = u0 & M1;
    let sc_hi = (u2 & M2) | (((u0 >> 6) & M3) << 4);
    let m_lo = u1 & M1;
    let m_hi = ((u2 >> 4) & M2) | (((u1 >> 6) & M3) << 4);
    let mut out = [0u8; 16];
    for (i, v) in [sc_lo, sc_hi, m_lo, m_hi].iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    out
}

use crate::{DotFn, Kernels};
use smoe_quant::Format;

/// The AVX2 + FMA table (F16C for f16 weights), if this CPU has them.
pub fn avx2_table() -> Option<Kernels> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
        return None;
    }
    let mut k = Kernels::scalar_table();
    k.isa = "avx2";
    k.f32_dot = avx2::dot_f32_f32;
    k.multi_dot = crate::attn::avx2::multi_dot;
    k.multi_axpy = crate::attn::avx2::multi_axpy;
    k.attn_scores = Some(attn_tiles::scores);
    k.attn_sum = Some(attn_tiles::weighted_sum);
    k.attn_scores_f16 = Some(attn_tiles::scores_f16);
    k.attn_sum_f16 = Some(attn_tiles::weighted_sum_f16);
    k.softmax_terms = attn_tiles::softmax_terms;
    k.silu_mul = act_avx2::silu_mul;
    k.widen_f16 = avx2::widen_f16;
    k.narrow_f16 = avx2::narrow_f16;

    k.transpose8 = Some(gemm::transpose8);
    k.set(Format::F32, DotFn::F32(avx2::dot_f32));
    k.set(Format::BF16, DotFn::F32(avx2::dot_bf16));
    k.set(Format::F16, DotFn::F32(avx2::dot_f16));
    k.set(Format::Q8_0, DotFn::Q32(avx2::dot_q8_0));
    k.set(Format::Q4_K, DotFn::Q256(avx2::dot_q4_k));
    k.set(Format::Q6_K, DotFn::Q256(avx2::dot_q6_k));
    k.set(Format::Q4_0, DotFn::Q32(avx2_more::dot_q4_0));
    k.set(Format::MXFP4, DotFn::Q32(avx2_more::dot_mxfp4));
    k.set(Format::MXFP8, DotFn::Q32(avx2_more::dot_mxfp8));
    k.set(Format::FP8, DotFn::Q32(avx2_more::dot_fp8));
    k.set(Format::Q4_1, DotFn::Q32(avx2_more::dot_q4_1));
    k.set(Format::Q5_0, DotFn::Q32(avx2_more::dot_q5_0));
    k.set(Format::Q5_1, DotFn::Q32(avx2_more::dot_q5_1));
    k.set(Format::Q2_K, DotFn::Q256(avx2_more::dot_q2_k));
    k.set(Format::Q3_K, DotFn::Q256(avx2_more::dot_q3_k));
    k.set(Format::Q5_K, DotFn::Q256(avx2_more::dot_q5_k));
    k.set_gemm(Format::Q8_0, gemm::q8_0_avx2);
    k.set_gemm(Format::Q4_K, gemm::q4_k_avx2);
    // Q8_0 with AVX2 measured slower four rows at a time (44 vs 52 GMAC/s: `sign`/`maddubs`
    // for four rows exhaust the registers), so it keeps the one-row kernel.
    k.set_gemm4(Format::Q4_K, gemm::q4_k_avx2_rows);
    k.set_gemm(Format::Q2_K, gemm_k23::q2_k_avx2);
    k.set_gemm4(Format::Q2_K, gemm_k23::q2_k_avx2_rows);
    k.set_gemm(Format::Q3_K, gemm_k23::q3_k_avx2);
    k.set_gemm4(Format::Q3_K, gemm_k23::q3_k_avx2_rows);
    // Few-token kernels up to 7 tokens (one Zen 4 core, `gspeed N`, GMAC/s: 4 tokens 69 vs the
    // tiles' 39, 8 tokens 71 vs 80).
    k.set_group8(q4kx8::dot8_avx2, q4kx8::dot8x2_avx2, q4kx8::dot8x3_avx2, 8);
    k.set_group8_one(Format::Q2_K, k23x8::q2_k_avx2);
    k.set_group8_one(Format::Q3_K, k23x8::q3_k_avx2);
    k.set_gemm_group8(Format::Q4_K, gemm::q4_k_avx2_group);
    // Q8_0 interleaved, one and four tokens a call: a token gets the same bits alone and in a
    // batch (as with VNNI), and four tokens read each group's weights once.
    k.set_q8_0_group8(q8x8::dot8_avx2, q8x8::dot8x4_avx2);
    k.set_gemm_group8(Format::Q2_K, gemm_k23::q2_k_avx2_group);
    k.set_gemm_group8(Format::Q3_K, gemm_k23::q3_k_avx2_group);
    Some(k)
}

/// The AVX-512 + VNNI table (on top of AVX2), if this CPU has them.
pub fn avx512_table() -> Option<Kernels> {
    let mut k = avx2_table()?;
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni"))
    {
        return None;
    }
    k.isa = "avx512-vnni";
    k.widen_f16 = avx2::widen_f16_512;
    k.f32_dot = avx512::dot_f32_f32;
    // Attention's weighted sums in tiles of sixteen accumulators, which thirty-two registers
    // allow (the same bits; one Zen 4 core, `aspeed`: 40 against 33 GMAC/s). The score tiles
    // stay AVX2's: larger ones spilled and measured slower (36-42 against 44).
    k.attn_sum = Some(attn_tiles::weighted_sum_vl);
    k.attn_sum_f16 = Some(attn_tiles::weighted_sum_vl_f16);
    k.set(Format::Q8_0, DotFn::Q32(avx512::dot_q8_0));
    // Q4_K stays on the 256-bit kernel: measured faster than 512-bit variants on Zen 4
    // (18-19 vs 16 GB/s per core), where 512-bit shuffles and 32-bit multiplies are costly.
    k.set(Format::Q6_K, DotFn::Q256(avx512::dot_q6_k));
    k.set_gemm(Format::Q8_0, gemm::q8_0_vnni);
    k.set_gemm(Format::Q4_K, gemm::q4_k_vnni);
    k.set_gemm4(Format::Q8_0, gemm::q8_0_vnni_rows);
    k.set_gemm4(Format::Q4_K, gemm::q4_k_vnni_rows);
    k.set_gemm(Format::Q2_K, gemm_k23::q2_k_vnni);
    k.set_gemm4(Format::Q2_K, gemm_k23::q2_k_vnni_rows);
    k.set_gemm(Format::Q3_K, gemm_k23::q3_k_vnni);
    k.set_gemm4(Format::Q3_K, gemm_k23::q3_k_vnni_rows);
    // Few-token kernels up to 15 tokens (one Zen 4 core, `gspeed N`, GMAC/s: 100-115 from 4
    // to 14 tokens against the tiles' 40-106, even at 15, the tiles ahead from 16).
    k.set_group8(q4kx8::dot8_vnni, q4kx8::dot8x2_vnni, q4kx8::dot8x3_vnni, 16);
    k.set_group8_one(Format::Q2_K, k23x8::q2_k_vnni);
    k.set_group8_one(Format::Q3_K, k23x8::q3_k_vnni);
    k.set_q8_0_group8(q8x8::dot8_vnni, q8x8::dot8x4_vnni);
    k.set_gemm_group8(Format::Q4_K, gemm::q4_k_vnni_group);
    k.set_gemm_group8(Format::Q2_K, gemm_k23::q2_k_vnni_group);
    k.set_gemm_group8(Format::Q3_K, gemm_k23::q3_k_vnni_group);
    Some(k)
}

/// The AMX table (on top of AVX-512 VNNI), if this CPU has AMX-INT8 and the OS lets this
/// process use it: the same kernels, with Q4_K and Q8_0 groups against many tokens on the
/// tiles ([`amx::q4_k_group`], [`amx::q8_0_group`]).
pub fn amx_table() -> Option<Kernels> {
    let mut k = avx512_table()?;
    if !(is_x86_feature_detected!("avx512dq") && amx::usable()) {
        return None;
    }
    k.isa = "avx512-amx";
    k.set_gemm_group8(Format::Q4_K, amx::q4_k_group);
    k.set_gemm_group8(Format::Q8_0, amx::q8_0_group);
    Some(k)
}
