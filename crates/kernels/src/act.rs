//! Activations quantized to int8 blocks, once per row, so that every weight row's dot product
//! with them is integer arithmetic.
//!
//! Two layouts: 32-element blocks (for Q8_0, Q4_0/1, Q5_0/1 weights) and 256-element super-blocks
//! with sums of each 16 quants (for the K-quants, whose group minimums need them). Scales are
//! f32 (ggml uses f16 for 32-blocks; f32 loses nothing and costs nothing here).

/// How a weight format wants its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    /// f32 activations (F32/F16/BF16 weights).
    F32,
    /// [`Block32`]s.
    Q8x32,
    /// [`Block256`]s.
    Q8x256,
}

/// 32 int8 quants with their scale and sums (for formats with a minimum, and for the unsigned
/// offset trick of VNNI kernels).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug)]
pub struct Block32 {
    /// Scale.
    pub d: f32,
    /// `d * Σ qs`.
    pub s: f32,
    /// `Σ qs`.
    pub isum: i32,
    /// Padding.
    pub pad: i32,
    /// Quants.
    pub qs: [i8; 32],
}
const _: () = assert!(std::mem::size_of::<Block32>() == 48);

/// 256 int8 quants with their scale and the sum of each run of 16.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug)]
pub struct Block256 {
    /// Scale.
    pub d: f32,
    /// Padding to keep `qs` 16-aligned.
    pub pad: [u8; 12],
    /// Quants.
    pub qs: [i8; 256],
    /// Sum of `qs[16 j..16 j + 16]`.
    pub bsums: [i16; 16],
}
const _: () = assert!(std::mem::size_of::<Block256>() == 320);

/// `x` (|x| ≤ 127) rounded to the nearest integer, ties to even. Adding and removing 1.5·2²³
/// leaves no fraction bits, so the FPU's own round-to-nearest-even does the rounding: plain
/// adds that vectorize, where `f32::round` is a libm call per element on baseline x86-64.
#[inline]
fn round_i8(x: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    ((x + MAGIC) - MAGIC) as i8
}

/// Quantizes `x` to [`Block32`]s: per block, scale `amax / 127`, round to nearest. With AVX2
/// where the CPU has it (the same bits).
pub fn quantize_32(x: &[f32], out: &mut [Block32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above; the check is a cached flag).
        return unsafe { crate::x86::act_avx2::quantize_32(x, out) };
    }
    quantize_32_scalar(x, out)
}

/// [`quantize_32`] in plain Rust.
pub fn quantize_32_scalar(x: &[f32], out: &mut [Block32]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = round_i8(v * id);
            sum += *q as i32;
        }
        b.d = d;
        b.s = d * sum as f32;
        b.isum = sum;
    }
}

/// Quantizes `x` to [`Block256`]s: per super-block, scale `amax / 127`. With AVX2 where the
/// CPU has it (the same bits).
pub fn quantize_256(x: &[f32], out: &mut [Block256]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above; the check is a cached flag).
        return unsafe { crate::x86::act_avx2::quantize_256(x, out) };
    }
    quantize_256_scalar(x, out)
}

/// [`quantize_256`] in plain Rust.
pub fn quantize_256_scalar(x: &[f32], out: &mut [Block256]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(256)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = round_i8(v * id);
        }
        for j in 0..16 {
            b.bsums[j] = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
        }
        b.d = d;
    }
}

impl Block32 {
    /// A zeroed block.
    pub const ZERO: Block32 = Block32 { d: 0.0, s: 0.0, isum: 0, pad: 0, qs: [0; 32] };
}

impl Block256 {
    /// A zeroed block.
    pub const ZERO: Block256 = Block256 { d: 0.0, pad: [0; 12], qs: [0; 256], bsums: [0; 16] };
}

#[cfg(test)]
mod tests {
    /// Every f32 in [-127.5, 127.5] (by bit pattern): the same as `round_ties_even`.
    #[test]
    fn round_i8_is_round_ties_even() {
        for bits in 0..=127.5f32.to_bits() {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                assert_eq!(super::round_i8(x), x.round_ties_even() as i8, "{x}");
            }
        }
    }
}
