//! Register-tiled attention for prefill: a block of query rows against many cached keys, and
//! the same rows' weighted sums over many cached values. [`crate::attn`]'s one-key helpers
//! load a query row per product (scores) and load and store an accumulator row per value
//! (sums); here four query rows meet three keys per load, and four rows' accumulators stay in
//! registers across every value. Each (row, key) score and each output element gets exactly
//! the arithmetic of the one-key helpers, in the same order, so prefill (many rows) and
//! decode (a few) agree bit for bit.

use std::arch::x86_64::*;

/// Query rows and keys per score tile; rows and 8-float columns per sum tile.
const QR: usize = 4;
const KS: usize = 3;
const VC: usize = 2;

/// Eight floats at `s[i..]`.
///
/// # Safety
/// `i + 8 <= s.len()`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load(s: &[f32], i: usize) -> __m256 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_loadu_ps(s.as_ptr().add(i)) }
}

/// A dot product's end, as [`crate::attn::avx2::multi_dot_with`] ends it: the lanes summed in
/// its order, then the scalar tail from `full`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn finish_dot(acc: __m256, q: &[f32], k: &[f32], full: usize) -> f32 {
    let mut t = super::avx2::hsum(acc);
    for j in full..q.len() {
        t += q[j] * k[j];
    }
    t
}

/// `R` query rows against `K` keys: `out[b][a] = q[a] · k[b]`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn tile<const R: usize, const K: usize>(q: [&[f32]; R], k: [&[f32]; K]) -> [[f32; R]; K] {
    let d = q[0].len();
    assert!(q.iter().all(|r| r.len() == d) && k.iter().all(|r| r.len() == d));
    let full = d / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); K]; R];
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= d, the length of every key row (asserted above).
        let kv: [__m256; K] = std::array::from_fn(|b| unsafe { load(k[b], i) });
        for a in 0..R {
            // SAFETY: i + 8 <= full <= d, the length of every query row (asserted above).
            let qv = unsafe { load(q[a], i) };
            for b in 0..K {
                acc[a][b] = _mm256_fmadd_ps(qv, kv[b], acc[a][b]);
            }
        }
    }
    std::array::from_fn(|b| std::array::from_fn(|a| finish_dot(acc[a][b], q[a], k[b], full)))
}

/// Scores of `q`'s rows (`d` long each) against `n` keys, key `j` at `keys[j * stride..]`:
/// `out[j * rows + r] = q[r, :] · key j`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores(q: &[f32], d: usize, keys: &[f32], stride: usize, n: usize, out: &mut [f32]) {
    assert!(d > 0 && q.len().is_multiple_of(d), "scores: query rows of {d}");
    let rows = q.len() / d;
    assert!(out.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= keys.len()), "scores: buffers too short");
    let key = |j: usize| &keys[j * stride..j * stride + d];
    let qrow = |r: usize| &q[r * d..(r + 1) * d];
    let mut j = 0;
    while j < n {
        let ks = KS.min(n - j);
        for r in (0..rows).step_by(QR) {
            let rs = QR.min(rows - r);
            // Whole tiles in the common case; a last partial block row by row and key by key.
            if rs == QR && ks == KS {
                let t = tile::<QR, KS>(std::array::from_fn(|a| qrow(r + a)), std::array::from_fn(|b| key(j + b)));
                for (b, t) in t.iter().enumerate() {
                    out[(j + b) * rows + r..][..QR].copy_from_slice(t);
                }
            } else {
                for a in 0..rs {
                    for b in 0..ks {
                        out[(j + b) * rows + r + a] = tile::<1, 1>([qrow(r + a)], [key(j + b)])[0][0];
                    }
                }
            }
        }
        j += ks;
    }
}

/// `R` rows' columns `c..c + 8C` of `acc` (rows `d` long, from row `r`) plus the weighted sum of
/// `n` values, in value order.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn sum_tile<const R: usize, const C: usize>(
    acc: &mut [f32],
    d: usize,
    r: usize,
    c: usize,
    p: &[f32],
    rows: usize,
    values: &[f32],
    stride: usize,
    n: usize,
) {
    assert!((r + R - 1) * d + c + 8 * C <= acc.len() && c + 8 * C <= d);
    assert!(n == 0 || ((n - 1) * rows + r + R <= p.len() && (n - 1) * stride + c + 8 * C <= values.len()));
    // SAFETY: for i < R and x < C the load ends at (r + i) * d + c + 8 * (x + 1)
    // <= (r + R - 1) * d + c + 8 * C <= acc.len() (first assert).
    let mut a: [[__m256; C]; R] = std::array::from_fn(|i| std::array::from_fn(|x| unsafe { load(acc, (r + i) * d + c + 8 * x) }));
    for j in 0..n {
        // SAFETY: j <= n - 1 and x < C, so the load ends at most at
        // (n - 1) * stride + c + 8 * C <= values.len() (second assert).
        let v: [__m256; C] = std::array::from_fn(|x| unsafe { load(values, j * stride + c + 8 * x) });
        for i in 0..R {
            let w = _mm256_set1_ps(p[j * rows + r + i]);
            for x in 0..C {
                a[i][x] = _mm256_fmadd_ps(w, v[x], a[i][x]);
            }
        }
    }
    for i in 0..R {
        for x in 0..C {
            // SAFETY: the same eight floats of `acc` that were loaded above, in bounds by the
            // first assert; `acc` is borrowed mutably, so nothing else aliases them.
            unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add((r + i) * d + c + 8 * x), a[i][x]) };
        }
    }
}

/// `acc[r, :] += Σ_j p[j * rows + r] · value j` over `n` values, value `j` at
/// `values[j * stride..]` (`d` long); `acc` holds `rows` rows of `d`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum(acc: &mut [f32], d: usize, p: &[f32], values: &[f32], stride: usize, n: usize) {
    assert!(d > 0 && acc.len().is_multiple_of(d), "weighted_sum: rows of {d}");
    let rows = acc.len() / d;
    assert!(p.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= values.len()), "weighted_sum: buffers too short");
    let full = d / 8 * 8;
    for r in (0..rows).step_by(QR) {
        let whole = rows - r >= QR;
        let mut c = 0;
        while c + 8 * VC <= full {
            if whole {
                sum_tile::<QR, VC>(acc, d, r, c, p, rows, values, stride, n);
            } else {
                (r..rows).for_each(|r| sum_tile::<1, VC>(acc, d, r, c, p, rows, values, stride, n));
            }
            c += 8 * VC;
        }
        for c in (c..full).step_by(8) {
            (r..rows.min(r + QR)).for_each(|r| sum_tile::<1, 1>(acc, d, r, c, p, rows, values, stride, n));
        }
        // The scalar tail, as the one-value helper computes it (a product, then a sum).
        for i in r..rows.min(r + QR) {
            for j in 0..n {
                let w = p[j * rows + i];
                for e in full..d {
                    acc[i * d + e] += w * values[j * stride + e];
                }
            }
        }
    }
}
