//! ggml's block structs, byte for byte.
//!
//! Each struct is `#[repr(C)]` with only byte-aligned fields, so `bytemuck::cast_slice` works on
//! any `&[u8]` whose length is a multiple of the block size. The size assertions pin the layout
//! to `ggml-common.h`; a GGUF file written by llama.cpp can be read through these without
//! conversion.

use crate::half::F16Bytes;
use bytemuck::{Pod, Zeroable};

/// Elements per block of the simple formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
pub const QK: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// 4.5 bits per weight: `x = (q - 8) * d`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: F16Bytes,
    /// Element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// 4.25 bits per weight (OCP MXFP4): `x = KVALUES_MXFP4[q] · 2^(e − 128)`, that is an e2m1
/// value times the e8m0 scale `2^(e − 127)`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockMxfp4 {
    /// Shared exponent (e8m0).
    pub e: u8,
    /// Codes (sign in bit 3), laid out as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);

/// 8.25 bits per weight (OCP MXFP8 with e4m3 elements): `x = e4m3(q) · 2^(e − 127)`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockMxfp8 {
    /// Shared exponent (e8m0).
    pub e: u8,
    /// float8 e4m3 codes (sign in bit 7, exponent bits 6–3 with bias 7, mantissa bits 2–0), in
    /// element order.
    pub qs: [u8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp8>() == 33);

/// Values per [`BlockFp8`]: the 128 columns of one block of a 128×128 block-scaled float8
/// checkpoint.
pub const QK_FP8: usize = 128;

/// 8.25 bits per weight: 128 float8 e4m3 codes sharing an f32 scale, `x = e4m3(q) · d` — a row's
/// part of one 128×128 block of the FP8 checkpoints DeepSeek-V3, GLM-5-FP8 and Qwen3-FP8 ship
/// (e4m3 codes with a `weight_scale_inv` per block, an arbitrary f32 that no e8m0 exponent or
/// bf16 holds). Every row repeats its blocks' scales.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockFp8 {
    /// The scale, an f32 in little-endian bytes (bytes, so that blocks need no alignment).
    pub d: [u8; 4],
    /// float8 e4m3 codes, as in [`BlockMxfp8`].
    pub qs: [u8; QK_FP8],
}
const _: () = assert!(std::mem::size_of::<BlockFp8>() == 132);

impl BlockFp8 {
    /// The block's scale.
    pub fn scale(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
}

/// A float8 e4m3 code's value times 512, an integer (|v| ≤ 448 · 512): `m` for the subnormals
/// (exponent field 0), `(8 + m) << (E − 1)` above, signed. The dot products multiply these
/// with int8 activations and scale by `2^−9` once per block. The NaN codes (0x7f, 0xff) are
/// never written by the quantizer; they read as 480 · 512 here.
pub fn e4m3_times_512(q: u8) -> i32 {
    let (e, m) = (((q >> 3) & 15) as i32, (q & 7) as i32);
    let v = if e == 0 { m } else { (8 + m) << (e - 1) };
    if q & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The e2m1 values of MXFP4's codes, doubled so that they are integers (ggml's
/// `kvalues_mxfp4`); the scale is halved to match ([`e8m0_to_f32_half`]).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the e8m0 scale `2^(e − 127)`, as ggml's `GGML_E8M0_TO_FP32_HALF` (exact: a power of
/// two, subnormal for `e` 0 and 1).
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e - 1) as u32) << 23)
    }
}

/// 5 bits per weight: `x = q * d + m`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: F16Bytes,
    /// Minimum.
    pub m: F16Bytes,
    /// Nibbles, laid out as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// 5.5 bits per weight: `x = (q - 16) * d`, fifth bits in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: F16Bytes,
    /// Fifth bit of element `j` at bit `j` (little-endian u32).
    pub qh: [u8; 4],
    /// Low nibbles, laid out as in [`BlockQ4_0`].
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

/// 6 bits per weight: `x = q * d + m`, fifth bits in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: F16Bytes,
    /// Minimum.
    pub m: F16Bytes,
    /// Fifth bit of element `j` at bit `j` (little-endian u32).
    pub qh: [u8; 4],
    /// Low nibbles.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

/// 8.5 bits per weight: `x = q * d`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: F16Bytes,
    /// Signed quants.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// 2.625 bits per weight: 16 groups of 16 with 4-bit scales and mins.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Low nibble: scale of group `j`; high nibble: its min.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants, four per byte.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the scales.
    pub d: F16Bytes,
    /// Super-block scale of the mins.
    pub dmin: F16Bytes,
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

/// 3.4375 bits per weight: 16 groups of 16 with 6-bit signed scales.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bit of each quant.
    pub hmask: [u8; QK_K / 8],
    /// Low two bits of each quant.
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales, packed.
    pub scales: [u8; 12],
    /// Super-block scale.
    pub d: F16Bytes,
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

/// 4.5 bits per weight: 8 groups of 32 with 6-bit scales and mins.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale of the scales.
    pub d: F16Bytes,
    /// Super-block scale of the mins.
    pub dmin: F16Bytes,
    /// Eight 6-bit scales and eight 6-bit mins, packed (see `scale_min_k4`).
    pub scales: [u8; 12],
    /// 4-bit quants: 32 bytes per pair of groups, low nibbles first group.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

/// 5.5 bits per weight: as [`BlockQ4K`] plus a fifth bit per quant.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale of the scales.
    pub d: F16Bytes,
    /// Super-block scale of the mins.
    pub dmin: F16Bytes,
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Low nibbles.
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

/// 6.5625 bits per weight: 16 groups of 16 with 8-bit signed scales.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low four bits of each quant.
    pub ql: [u8; QK_K / 2],
    /// High two bits of each quant.
    pub qh: [u8; QK_K / 4],
    /// Group scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: F16Bytes,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// Activation block for K-quant dot products: `x = q * d`, with sums of each 16 quants.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale (f32, little-endian bytes).
    pub d: [u8; 4],
    /// Quants.
    pub qs: [i8; QK_K],
    /// Sum of each run of 16 quants (i16, little-endian bytes).
    pub bsums: [[u8; 2]; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
