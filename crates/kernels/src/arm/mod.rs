//! aarch64 kernel table (NEON is always present).

pub mod neon;
pub mod neon_more;

use crate::{DotFn, Kernels};
use smoe_quant::Format;

/// The NEON table.
pub fn neon_table() -> Option<Kernels> {
    let mut k = Kernels::scalar_table();
    k.isa = "neon";
    k.f32_dot = neon::dot_f32_f32;
    k.multi_dot = crate::attn::neon::multi_dot;
    k.multi_axpy = crate::attn::neon::multi_axpy;
    k.set(Format::F32, DotFn::F32(neon::dot_f32));
    k.set(Format::BF16, DotFn::F32(neon::dot_bf16));
    k.set(Format::F16, DotFn::F32(neon::dot_f16));
    k.set(Format::Q8_0, DotFn::Q32(neon::dot_q8_0));
    k.set(Format::Q4_K, DotFn::Q256(neon::dot_q4_k));
    k.set(Format::Q6_K, DotFn::Q256(neon::dot_q6_k));
    k.set(Format::Q4_0, DotFn::Q32(neon_more::dot_q4_0));
    k.set(Format::MXFP4, DotFn::Q32(neon_more::dot_mxfp4));
    k.set(Format::MXFP8, DotFn::Q32(neon_more::dot_mxfp8));
    k.set(Format::FP8, DotFn::Q32(neon_more::dot_fp8));
    k.set(Format::Q4_1, DotFn::Q32(neon_more::dot_q4_1));
    k.set(Format::Q5_0, DotFn::Q32(neon_more::dot_q5_0));
    k.set(Format::Q5_1, DotFn::Q32(neon_more::dot_q5_1));
    k.set(Format::Q2_K, DotFn::Q256(neon_more::dot_q2_k));
    k.set(Format::Q3_K, DotFn::Q256(neon_more::dot_q3_k));
    k.set(Format::Q5_K, DotFn::Q256(neon_more::dot_q5_k));
    Some(k)
}
