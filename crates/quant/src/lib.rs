/*!
Block formats for smoe, bit-compatible with ggml.

This crate owns the *format* side of quantization: which formats exist, how many bytes a row
takes, and the reference (scalar, deterministic) encoders and decoders. It does not own fast
kernels: SIMD dot products live with the compute backend, and are tested against the reference
decoders here.

The block layouts are ggml's (`ggml-common.h`), so tensors can move between a vault and a GGUF
file without re-quantizing, and smoe and llama.cpp can be compared on identical numbers. The
reference quantizers follow ggml's `quantize_row_*_ref` algorithms (the ones `llama-quantize`
uses without an importance matrix), including their scale searches.
*/
#![deny(missing_docs)]

pub mod blocks;
pub mod half;
pub mod interleave;
mod kquants;
mod matrix;
mod simple;
pub use simple::{e4m3_to_f32, f32_to_e4m3};

use std::fmt;
use std::str::FromStr;

pub use blocks::{e4m3_times_512, e8m0_to_f32_half, KVALUES_MXFP4, QK, QK_K};
pub use kquants::{scale_min_k4, unpack_q3_scales};
pub use matrix::{Layout, QMatrix};

/// A tensor storage format. Discriminants are ggml's `ggml_type` ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
#[allow(non_camel_case_types)]
pub enum Format {
    /// IEEE f32.
    F32 = 0,
    /// IEEE f16.
    F16 = 1,
    /// 4-bit, 32 per block, symmetric.
    Q4_0 = 2,
    /// 4-bit, 32 per block, with minimum.
    Q4_1 = 3,
    /// 5-bit, 32 per block, symmetric.
    Q5_0 = 6,
    /// 5-bit, 32 per block, with minimum.
    Q5_1 = 7,
    /// 8-bit, 32 per block.
    Q8_0 = 8,
    /// 2-bit K-quant.
    Q2_K = 10,
    /// 3-bit K-quant.
    Q3_K = 11,
    /// 4-bit K-quant.
    Q4_K = 12,
    /// 5-bit K-quant.
    Q5_K = 13,
    /// 6-bit K-quant.
    Q6_K = 14,
    /// bfloat16.
    BF16 = 30,
    /// OCP MXFP4: 32 e2m1 values sharing an e8m0 scale (gpt-oss's experts).
    MXFP4 = 39,
    /// OCP MXFP8: 32 float8 e4m3 values sharing an e8m0 scale (DeepSeek-V4's FP8 layers held as
    /// published: e4m3 codes times a power of two). Not a ggml type: the id is smoe's own, and
    /// GGUF export refuses it.
    MXFP8 = 200,
    /// float8 e4m3 values sharing an f32 scale per 128 ([`blocks::BlockFp8`]): the 128×128
    /// block-scaled FP8 of DeepSeek-V3, GLM-5-FP8 and Qwen3-FP8 checkpoints, held as published.
    /// smoe's own id; GGUF export refuses it.
    FP8 = 201,
}

/// Every format this crate can encode and decode.
pub const ALL_FORMATS: [Format; 16] = [
    Format::F32,
    Format::F16,
    Format::BF16,
    Format::Q8_0,
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q2_K,
    Format::Q3_K,
    Format::Q4_K,
    Format::Q5_K,
    Format::Q6_K,
    Format::MXFP4,
    Format::MXFP8,
    Format::FP8,
];

/// Errors from format parsing and row coding.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    /// A format name that is not known.
    #[error(
        "unknown tensor format '{0}' (known: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, MXFP8, FP8)"
    )]
    UnknownName(String),
    /// A ggml type id that is not supported.
    #[error("unsupported ggml type id {0}")]
    UnknownId(u32),
    /// A row length the format cannot hold.
    #[error("{format} needs rows that are a multiple of {block} elements, got {cols}")]
    RowLength {
        /// The format.
        format: Format,
        /// Its block size.
        block: usize,
        /// The offending row length.
        cols: usize,
    },
    /// Source or destination buffer of the wrong size.
    #[error("buffer size mismatch: expected {expected} bytes, got {got}")]
    BufferSize {
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
}

impl Format {
    /// Canonical name, as ggml and the command line spell it.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "F32",
            Format::F16 => "F16",
            Format::BF16 => "BF16",
            Format::Q8_0 => "Q8_0",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
            Format::Q5_0 => "Q5_0",
            Format::Q5_1 => "Q5_1",
            Format::Q2_K => "Q2_K",
            Format::Q3_K => "Q3_K",
            Format::Q4_K => "Q4_K",
            Format::Q5_K => "Q5_K",
            Format::Q6_K => "Q6_K",
            Format::MXFP4 => "MXFP4",
            Format::MXFP8 => "MXFP8",
            Format::FP8 => "FP8",
        }
    }

    /// The ggml type id.
    pub fn ggml_id(self) -> u32 {
        self as u32
    }

    /// The format with this ggml type id.
    pub fn from_ggml_id(id: u32) -> Result<Format, QuantError> {
        ALL_FORMATS.iter().copied().find(|f| f.ggml_id() == id).ok_or(QuantError::UnknownId(id))
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Format::F32 | Format::F16 | Format::BF16 => 1,
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 | Format::MXFP4 | Format::MXFP8 => QK,
            Format::Q2_K | Format::Q3_K | Format::Q4_K | Format::Q5_K | Format::Q6_K => QK_K,
            Format::FP8 => blocks::QK_FP8,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use std::mem::size_of;
        match self {
            Format::F32 => 4,
            Format::F16 | Format::BF16 => 2,
            Format::Q8_0 => size_of::<blocks::BlockQ8_0>(),
            Format::Q4_0 => size_of::<blocks::BlockQ4_0>(),
            Format::Q4_1 => size_of::<blocks::BlockQ4_1>(),
            Format::Q5_0 => size_of::<blocks::BlockQ5_0>(),
            Format::Q5_1 => size_of::<blocks::BlockQ5_1>(),
            Format::Q2_K => size_of::<blocks::BlockQ2K>(),
            Format::Q3_K => size_of::<blocks::BlockQ3K>(),
            Format::Q4_K => size_of::<blocks::BlockQ4K>(),
            Format::Q5_K => size_of::<blocks::BlockQ5K>(),
            Format::Q6_K => size_of::<blocks::BlockQ6K>(),
            Format::MXFP4 => size_of::<blocks::BlockMxfp4>(),
            Format::MXFP8 => size_of::<blocks::BlockMxfp8>(),
            Format::FP8 => size_of::<blocks::BlockFp8>(),
        }
    }

    /// Storage cost in bits per weight.
    pub fn bits_per_weight(self) -> f64 {
        self.block_bytes() as f64 * 8.0 / self.block_elems() as f64
    }

    /// True for formats that store weights in blocks with scales.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Whether rows of `cols` elements can be stored in this format.
    pub fn fits(self, cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(self.block_elems())
    }

    /// Bytes of one row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        if !self.fits(cols) {
            return Err(QuantError::RowLength { format: self, block: self.block_elems(), cols });
        }
        Ok(cols / self.block_elems() * self.block_bytes())
    }

    /// The next format to try when rows do not fit, following llama.cpp's fallbacks
    /// (K-quants to the 32-block format of similar size, 32-block formats to 16-bit).
    /// 16-bit fallbacks use BF16, which holds bf16 checkpoints exactly.
    pub fn fallback(self) -> Format {
        match self {
            Format::Q2_K | Format::Q3_K => Format::Q4_0,
            Format::Q4_K => Format::Q5_0,
            Format::Q5_K => Format::Q5_1,
            Format::Q6_K => Format::Q8_0,
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 | Format::MXFP4 | Format::MXFP8 | Format::FP8 => {
                Format::BF16
            }
            f => f,
        }
    }

    /// The format actually used for rows of `cols` elements when `self` was requested.
    pub fn resolve(self, cols: usize) -> Format {
        let mut f = self;
        while !f.fits(cols) && f.fallback() != f {
            f = f.fallback();
        }
        f
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = QuantError;
    /// Case-insensitive: `q4_k`, `Q4_K` and `q4_K` all name [`Format::Q4_K`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ALL_FORMATS.iter().copied().find(|f| f.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| QuantError::UnknownName(s.to_string()))
    }
}

fn check_sizes(format: Format, n: usize, bytes: usize) -> Result<(), QuantError> {
    let expected = format.row_bytes(n)?;
    if bytes != expected {
        return Err(QuantError::BufferSize { expected, got: bytes });
    }
    Ok(())
}

/// Encodes `src` (any whole number of blocks) into `dst` with the reference quantizer.
pub fn quantize(format: Format, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_sizes(format, src.len(), dst.len())?;
    match format {
        Format::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        Format::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::F16Bytes::from_f32(*s).0);
            }
        }
        Format::BF16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::f32_to_bf16_bits(*s).to_le_bytes());
            }
        }
        Format::Q8_0 => simple::quantize_q8_0(src, bytemuck::cast_slice_mut(dst)),
        Format::Q4_0 => simple::quantize_q4_0(src, bytemuck::cast_slice_mut(dst)),
        Format::Q4_1 => simple::quantize_q4_1(src, bytemuck::cast_slice_mut(dst)),
        Format::Q5_0 => simple::quantize_q5_0(src, bytemuck::cast_slice_mut(dst)),
        Format::Q5_1 => simple::quantize_q5_1(src, bytemuck::cast_slice_mut(dst)),
        Format::Q2_K => kquants::quantize_q2_k(src, bytemuck::cast_slice_mut(dst)),
        Format::Q3_K => kquants::quantize_q3_k(src, bytemuck::cast_slice_mut(dst)),
        Format::Q4_K => kquants::quantize_q4_k(src, bytemuck::cast_slice_mut(dst)),
        Format::Q5_K => kquants::quantize_q5_k(src, bytemuck::cast_slice_mut(dst)),
        Format::Q6_K => kquants::quantize_q6_k(src, bytemuck::cast_slice_mut(dst)),
        Format::MXFP4 => simple::quantize_mxfp4(src, bytemuck::cast_slice_mut(dst)),
        Format::MXFP8 => simple::quantize_mxfp8(src, bytemuck::cast_slice_mut(dst)),
        Format::FP8 => simple::quantize_fp8(src, bytemuck::cast_slice_mut(dst)),
    }
    Ok(())
}

/// Decodes `src` (any whole number of blocks) into `dst`, exactly as ggml's `dequantize_row_*`.
pub fn dequantize(format: Format, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_sizes(format, dst.len(), src.len())?;
    match format {
        Format::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        Format::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]));
            }
        }
        Format::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]));
            }
        }
        Format::Q8_0 => simple::dequantize_q8_0(bytemuck::cast_slice(src), dst),
        Format::Q4_0 => simple::dequantize_q4_0(bytemuck::cast_slice(src), dst),
        Format::Q4_1 => simple::dequantize_q4_1(bytemuck::cast_slice(src), dst),
        Format::Q5_0 => simple::dequantize_q5_0(bytemuck::cast_slice(src), dst),
        Format::Q5_1 => simple::dequantize_q5_1(bytemuck::cast_slice(src), dst),
        Format::Q2_K => kquants::dequantize_q2_k(bytemuck::cast_slice(src), dst),
        Format::Q3_K => kquants::dequantize_q3_k(bytemuck::cast_slice(src), dst),
        Format::Q4_K => kquants::dequantize_q4_k(bytemuck::cast_slice(src), dst),
        Format::Q5_K => kquants::dequantize_q5_k(bytemuck::cast_slice(src), dst),
        Format::Q6_K => kquants::dequantize_q6_k(bytemuck::cast_slice(src), dst),
        Format::MXFP4 => simple::dequantize_mxfp4(bytemuck::cast_slice(src), dst),
        Format::MXFP8 => simple::dequantize_mxfp8(bytemuck::cast_slice(src), dst),
        Format::FP8 => simple::dequantize_fp8(bytemuck::cast_slice(src), dst),
    }
    Ok(())
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2²³ trick. The quantizers
/// use it (rather than `f32::round`) so that they make the same choices as llama.cpp.
#[inline]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

#[cfg(test)]
mod tests;
