//! f32 helpers for attention: several query heads against one key row, and several outputs
//! accumulating one value row. Grouped-query attention reads each cached key and value once
//! for all the query heads that share it.

/// `out[h] = q[h, :] · k` for `heads` rows of `q` (each `k.len()` long).
pub type MultiDot = unsafe fn(q: &[f32], k: &[f32], out: &mut [f32]);
/// `acc[h, :] += w[h] · v` for `w.len()` rows of `acc` (each `v.len()` long).
pub type MultiAxpy = unsafe fn(acc: &mut [f32], w: &[f32], v: &[f32]);
/// `out[j * rows + r] = q[r, :] · keys[j * stride..][..d]` for the `rows` rows of `q` and `n`
/// keys ([`crate::Kernels::attn_scores`]).
pub type Scores = unsafe fn(q: &[f32], d: usize, keys: &[f32], stride: usize, n: usize, out: &mut [f32]);
/// `acc[r, :] += Σ_j p[j * rows + r] · values[j * stride..][..d]` over `n` values, for the
/// `rows` rows of `acc` ([`crate::Kernels::attn_weighted_sum`]).
pub type WeightedSum = unsafe fn(acc: &mut [f32], d: usize, p: &[f32], values: &[f32], stride: usize, n: usize);
/// [`Scores`] against f16 keys ([`crate::Kernels::attn_scores_f16`]).
pub type ScoresF16 = unsafe fn(q: &[f32], d: usize, keys: &[u16], stride: usize, n: usize, out: &mut [f32]);
/// [`WeightedSum`] over f16 values ([`crate::Kernels::attn_weighted_sum_f16`]).
pub type WeightedSumF16 = unsafe fn(acc: &mut [f32], d: usize, p: &[f32], values: &[u16], stride: usize, n: usize);
/// `v[i] = exp(v[i] - m[i]); sum[i] += v[i]` (see [`crate::Kernels::softmax_terms`]).
pub type SoftmaxTerms = unsafe fn(v: &mut [f32], m: &[f32], sum: &mut [f32]);

/// The plain softmax terms: `exp` from the standard library, one value at a time.
pub fn softmax_terms(v: &mut [f32], m: &[f32], sum: &mut [f32]) {
    for ((v, m), s) in v.iter_mut().zip(m).zip(sum) {
        *v = (*v - m).exp();
        *s += *v;
    }
}

/// Scalar [`MultiDot`].
pub fn multi_dot(q: &[f32], k: &[f32], out: &mut [f32]) {
    multi_dot_as(q, k, out, |x| x)
}

/// Scalar [`MultiAxpy`].
pub fn multi_axpy(acc: &mut [f32], w: &[f32], v: &[f32]) {
    multi_axpy_as(acc, w, v, |x| x)
}

/// [`multi_dot`] over keys stored as `T`, widened by `f`.
#[inline(always)]
fn multi_dot_as<T: Copy>(q: &[f32], k: &[T], out: &mut [f32], f: impl Fn(T) -> f32) {
    let d = k.len();
    for (o, qr) in out.iter_mut().zip(q.chunks_exact(d)) {
        *o = qr.iter().zip(k).map(|(a, &b)| a * f(b)).sum();
    }
}

/// [`multi_axpy`] over values stored as `T`, widened by `f`.
#[inline(always)]
fn multi_axpy_as<T: Copy>(acc: &mut [f32], w: &[f32], v: &[T], f: impl Fn(T) -> f32) {
    let d = v.len();
    for (row, &wh) in acc.chunks_exact_mut(d).zip(w) {
        for (a, &b) in row.iter_mut().zip(v) {
            *a += wh * f(b);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// AVX2 [`super::MultiDot`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn multi_dot(q: &[f32], k: &[f32], out: &mut [f32]) {
        // SAFETY: `multi_dot_with` calls `load8(i)` only with i + 8 <= d = k.len(), so the eight
        // floats are inside `k`; AVX is part of what this function's caller guarantees.
        multi_dot_with(q, k.len(), |i| unsafe { _mm256_loadu_ps(k.as_ptr().add(i)) }, |j| k[j], out)
    }

    /// [`super::MultiDot`] over a key of `d` elements that `load8(i)` widens eight at a time
    /// (called only with `i + 8 <= d`) and `at(j)` one at a time.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn multi_dot_with(q: &[f32], d: usize, load8: impl Fn(usize) -> __m256, at: impl Fn(usize) -> f32, out: &mut [f32]) {
        let full = d / 8 * 8;
        for (o, qr) in out.iter_mut().zip(q.chunks_exact(d)) {
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i < full {
                // SAFETY: i + 8 <= full <= d = the query row's length.
                acc = _mm256_fmadd_ps(unsafe { _mm256_loadu_ps(qr.as_ptr().add(i)) }, load8(i), acc);
                i += 8;
            }
            let mut t = crate::x86::avx2::hsum(acc);
            for j in full..d {
                t += qr[j] * at(j);
            }
            *o = t;
        }
    }

    /// AVX2 [`super::MultiAxpy`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn multi_axpy(acc: &mut [f32], w: &[f32], v: &[f32]) {
        // SAFETY: `multi_axpy_with` calls `load8(i)` only with i + 8 <= d = v.len(), so the
        // eight floats are inside `v`; AVX is part of what this function's caller guarantees.
        multi_axpy_with(acc, w, v.len(), |i| unsafe { _mm256_loadu_ps(v.as_ptr().add(i)) }, |j| v[j])
    }

    /// [`super::MultiAxpy`] over a value of `d` elements read as in [`multi_dot_with`].
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) fn multi_axpy_with(acc: &mut [f32], w: &[f32], d: usize, load8: impl Fn(usize) -> __m256, at: impl Fn(usize) -> f32) {
        let full = d / 8 * 8;
        for (row, &wh) in acc.chunks_exact_mut(d).zip(w) {
            let wv = _mm256_set1_ps(wh);
            let mut i = 0;
            while i < full {
                // SAFETY: i + 8 <= full <= d = the accumulator row's length.
                unsafe {
                    let p = row.as_mut_ptr().add(i);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, load8(i), _mm256_loadu_ps(p)));
                }
                i += 8;
            }
            for j in full..d {
                row[j] += wh * at(j);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use std::arch::aarch64::*;

    /// NEON [`super::MultiDot`].
    pub fn multi_dot(q: &[f32], k: &[f32], out: &mut [f32]) {
        let d = k.len();
        let full = d / 4 * 4;
        for (o, qr) in out.iter_mut().zip(q.chunks_exact(d)) {
            let mut i = 0;
            // SAFETY: i + 4 <= full <= d for both rows; NEON is baseline on aarch64.
            let mut t = unsafe {
                let mut acc = vdupq_n_f32(0.0);
                while i < full {
                    acc = vfmaq_f32(acc, vld1q_f32(qr.as_ptr().add(i)), vld1q_f32(k.as_ptr().add(i)));
                    i += 4;
                }
                vaddvq_f32(acc)
            };
            for j in full..d {
                t += qr[j] * k[j];
            }
            *o = t;
        }
    }

    /// NEON [`super::MultiAxpy`].
    pub fn multi_axpy(acc: &mut [f32], w: &[f32], v: &[f32]) {
        let d = v.len();
        let full = d / 4 * 4;
        for (row, &wh) in acc.chunks_exact_mut(d).zip(w) {
            let mut i = 0;
            // SAFETY: i + 4 <= full <= d for both rows.
            unsafe {
                let wv = vdupq_n_f32(wh);
                while i < full {
                    let p = row.as_mut_ptr().add(i);
                    vst1q_f32(p, vfmaq_f32(vld1q_f32(p), wv, vld1q_f32(v.as_ptr().add(i))));
                    i += 4;
                }
            }
            for j in full..d {
                row[j] += wh * v[j];
            }
        }
    }
}
