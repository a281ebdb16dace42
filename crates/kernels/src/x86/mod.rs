//! x86-64 kernel tables, chosen by CPU feature detection.

pub mod avx2;
pub mod avx512;

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
    k.set(Format::F32, DotFn::F32(avx2::dot_f32));
    k.set(Format::BF16, DotFn::F32(avx2::dot_bf16));
    k.set(Format::F16, DotFn::F32(avx2::dot_f16));
    k.set(Format::Q8_0, DotFn::Q32(avx2::dot_q8_0));
    k.set(Format::Q4_K, DotFn::Q256(avx2::dot_q4_k));
    k.set(Format::Q6_K, DotFn::Q256(avx2::dot_q6_k));
    Some(k)
}

/// The AVX-512 + VNNI table (on top of AVX2), if this CPU has them.
pub fn avx512_table() -> Option<Kernels> {
    let mut k = avx2_table()?;
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")) {
        return None;
    }
    k.isa = "avx512-vnni";
    k.f32_dot = avx512::dot_f32_f32;
    k.set(Format::Q8_0, DotFn::Q32(avx512::dot_q8_0));
    k.set(Format::Q4_K, DotFn::Q256(avx512::dot_q4_k));
    k.set(Format::Q6_K, DotFn::Q256(avx512::dot_q6_k));
    Some(k)
}
