//! aarch64 kernel table (NEON is always present).

pub mod neon;

use crate::{DotFn, Kernels};
use smoe_quant::Format;

/// The NEON table.
pub fn neon_table() -> Option<Kernels> {
    let mut k = Kernels::scalar_table();
    k.isa = "neon";
    k.f32_dot = neon::dot_f32_f32;
    k.multi_dot = crate::attn::neon::multi_dot;
    k.multi_axpy = crate::attn::neon::multi_axpy;
    k.set(Format::Q8_0, DotFn::Q32(neon::dot_q8_0));
    k.set(Format::Q4_K, DotFn::Q256(neon::dot_q4_k));
    k.set(Format::Q6_K, DotFn::Q256(neon::dot_q6_k));
    Some(k)
}
