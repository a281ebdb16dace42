//! Byte-aligned half-precision fields.
//!
//! ggml stores scales as IEEE fp16 inside blocks. Keeping them as `[u8; 2]` (alignment 1) lets a
//! block slice be viewed straight out of any byte buffer — a vault blob, a GGUF file, an O_DIRECT
//! slot — without alignment checks or copies.

use bytemuck::{Pod, Zeroable};

/// An IEEE-754 binary16 value stored little-endian with byte alignment.
#[repr(transparent)]
#[derive(Clone, Copy, Default, Pod, Zeroable, PartialEq, Eq, Debug)]
pub struct F16Bytes(pub [u8; 2]);

impl F16Bytes {
    /// Round to nearest even, as ggml's `GGML_FP32_TO_FP16` does.
    #[inline]
    pub fn from_f32(v: f32) -> Self {
        Self(half::f16::from_f32(v).to_le_bytes())
    }
    /// Exact widening to f32.
    #[inline]
    pub fn to_f32(self) -> f32 {
        half::f16::from_le_bytes(self.0).to_f32()
    }
}

/// Converts f32 to bf16 bits with round-to-nearest-even, as ggml and PyTorch do (NaN kept quiet).
#[inline]
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// Exact widening of bf16 bits to f32.
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Converts f32 to fp16 bits with round-to-nearest-even (overflow to infinity, NaN kept a
/// NaN), as F16C's `vcvtps2ph` with rounding mode 0 does.
#[inline]
pub fn f32_to_f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Exact widening of fp16 bits to f32.
#[inline]
pub fn f16_bits_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}
