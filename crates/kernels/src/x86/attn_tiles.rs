//! Register-tiled attention for prefill: a block of query rows against many cached keys, and
//! the same rows' weighted sums over many cached values. [`crate::attn`]'s one-key helpers
//! load a query row per product (scores) and load and store an accumulator row per value
//! (sums); here several query rows meet several keys per load, and several rows' accumulators
//! stay in registers across every value. Each (row, key) score and each output element gets
//! exactly the arithmetic of the one-key helpers, in the same order, so prefill (many rows)
//! and decode (a few) agree bit for bit.
//!
//! The tiles' sizes are what the registers allow: AVX2 has sixteen (a score tile of four rows
//! by three keys, a sum tile of four rows by two vectors); with AVX-512 VL the same 256-bit
//! arithmetic has thirty-two, and [`weighted_sum_vl`] takes eight rows by two vectors, so the
//! bits stay those of the one-key helpers while each load serves more multiply-adds. (Score
//! tiles of eight rows by two or three keys, or six by four, measured slower on Zen 4 than
//! four by three: the compiler spills.)

use std::arch::x86_64::*;

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

/// Cached keys or values as they are stored: f32 (`H = false`), or f16 bits (`H = true`)
/// widened exactly as they are loaded, so that the arithmetic after the load, and so every
/// bit, is that of f32 rows holding the widened values. The slice of the other kind is empty.
#[derive(Clone, Copy)]
struct Rows<'a, const H: bool> {
    f32: &'a [f32],
    f16: &'a [u16],
}

impl<'a> Rows<'a, false> {
    #[inline]
    fn of_f32(f32: &'a [f32]) -> Self {
        Rows { f32, f16: &[] }
    }
}

impl<'a> Rows<'a, true> {
    #[inline]
    fn of_f16(f16: &'a [u16]) -> Self {
        Rows { f32: &[], f16 }
    }
}

impl<'a, const H: bool> Rows<'a, H> {
    #[inline]
    fn len(self) -> usize {
        if H {
            self.f16.len()
        } else {
            self.f32.len()
        }
    }

    /// Values `at..at + len`.
    #[inline]
    fn slice(self, at: usize, len: usize) -> Self {
        if H {
            Rows { f32: &[], f16: &self.f16[at..at + len] }
        } else {
            Rows { f32: &self.f32[at..at + len], f16: &[] }
        }
    }

    /// Values from `at` on.
    #[inline]
    fn from(self, at: usize) -> Self {
        self.slice(at, self.len() - at)
    }

    /// Value `i` as f32.
    #[inline]
    fn get(self, i: usize) -> f32 {
        if H {
            smoe_quant::half::f16_bits_to_f32(self.f16[i])
        } else {
            self.f32[i]
        }
    }

    /// Eight values from `i`, as f32.
    ///
    /// # Safety
    /// `i + 8 <= self.len()`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8(self, i: usize) -> __m256 {
        // SAFETY: as the caller guarantees, eight values of the stored kind from `i`.
        unsafe {
            if H {
                _mm256_cvtph_ps(_mm_loadu_si128(self.f16.as_ptr().add(i) as *const __m128i))
            } else {
                _mm256_loadu_ps(self.f32.as_ptr().add(i))
            }
        }
    }

    /// Asks for the rows' cache lines ahead of use.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn prefetch(self) {
        let (ptr, bytes) =
            if H { (self.f16.as_ptr() as *const i8, self.f16.len() * 2) } else { (self.f32.as_ptr() as *const i8, self.f32.len() * 4) };
        for o in (0..bytes).step_by(64) {
            // SAFETY: a prefetch of an address inside the rows (it never faults in any case).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.add(o)) };
        }
    }
}

/// A dot product's end, as [`crate::attn::avx2::multi_dot_with`] ends it: the lanes summed in
/// its order, then the scalar tail from `full`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn finish_dot<const H: bool>(acc: __m256, q: &[f32], k: Rows<'_, H>, full: usize) -> f32 {
    let mut t = super::avx2::hsum(acc);
    for j in full..q.len() {
        t += q[j] * k.get(j);
    }
    t
}

/// `R` query rows against `K` keys: `out[b][a] = q[a] · k[b]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tile<const R: usize, const K: usize, const H: bool>(q: [&[f32]; R], k: [Rows<'_, H>; K]) -> [[f32; R]; K] {
    let d = q[0].len();
    assert!(q.iter().all(|r| r.len() == d) && k.iter().all(|r| r.len() == d));
    let full = d / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); K]; R];
    for i in (0..full).step_by(8) {
        // Plain loops here, not `array::from_fn`: its closure is not compiled with this
        // function's target features, so the loads would become calls.
        let mut kv = [_mm256_setzero_ps(); K];
        for b in 0..K {
            // SAFETY: i + 8 <= full <= d, the length of every key row (asserted above).
            kv[b] = unsafe { k[b].load8(i) };
        }
        for a in 0..R {
            // SAFETY: i + 8 <= full <= d, the length of every query row (asserted above).
            let qv = unsafe { load(q[a], i) };
            for b in 0..K {
                acc[a][b] = _mm256_fmadd_ps(qv, kv[b], acc[a][b]);
            }
        }
    }
    let mut out = [[0f32; R]; K];
    for b in 0..K {
        for a in 0..R {
            out[b][a] = finish_dot(acc[a][b], q[a], k[b], full);
        }
    }
    out
}

/// Rows `r..r + R` of `q` (`d` long each) against keys `keys[b]`, into `out[j * rows + r..]`
/// for `j = j0 + b`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn score_rows<const R: usize, const K: usize, const H: bool>(
    q: &[f32],
    d: usize,
    r: usize,
    keys: [Rows<'_, H>; K],
    j0: usize,
    rows: usize,
    out: &mut [f32],
) {
    let mut qs = [&q[..0]; R];
    for (a, qs) in qs.iter_mut().enumerate() {
        *qs = &q[(r + a) * d..(r + a + 1) * d];
    }
    let t = tile::<R, K, H>(qs, keys);
    for (b, t) in t.iter().enumerate() {
        out[(j0 + b) * rows + r..][..R].copy_from_slice(t);
    }
}

/// Scores in tiles of `QR` rows by `KS` keys: `out[j * rows + r] = q[r, :] · key j`. Keys
/// left over take tiles of one key, rows left over tiles of one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scores_tiled<const QR: usize, const KS: usize, const H: bool>(
    q: &[f32],
    d: usize,
    keys: Rows<'_, H>,
    stride: usize,
    n: usize,
    out: &mut [f32],
) {
    assert!(d > 0 && q.len().is_multiple_of(d), "scores: query rows of {d}");
    let rows = q.len() / d;
    assert!(out.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= keys.len()), "scores: buffers too short");
    let key = |j: usize| keys.slice(j * stride, d);
    // The first keys too: each decode task starts on a block of positions that nothing has
    // asked for yet, and waited on its first keys one miss at a time.
    for f in 0..(8 * KS).min(n) {
        key(f).prefetch();
    }
    let whole_rows = rows / QR * QR;
    let mut j = 0;
    while j < n {
        let ks = KS.min(n - j);
        // The keys a few steps ahead (see `weighted_sum` on why).
        for f in j + 8 * KS..(j + 9 * KS).min(n) {
            key(f).prefetch();
        }
        if ks == KS {
            let mut kk = [key(j); KS];
            for (b, kk) in kk.iter_mut().enumerate() {
                *kk = key(j + b);
            }
            for r in (0..whole_rows).step_by(QR) {
                score_rows::<QR, KS, H>(q, d, r, kk, j, rows, out);
            }
            for r in whole_rows..rows {
                score_rows::<1, KS, H>(q, d, r, kk, j, rows, out);
            }
        } else {
            for b in j..j + ks {
                for r in (0..whole_rows).step_by(QR) {
                    score_rows::<QR, 1, H>(q, d, r, [key(b)], b, rows, out);
                }
                for r in whole_rows..rows {
                    score_rows::<1, 1, H>(q, d, r, [key(b)], b, rows, out);
                }
            }
        }
        j += ks;
    }
}

/// Scores of `q`'s rows (`d` long each) against `n` keys, key `j` at `keys[j * stride..]`:
/// `out[j * rows + r] = q[r, :] · key j`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores(q: &[f32], d: usize, keys: &[f32], stride: usize, n: usize, out: &mut [f32]) {
    scores_tiled::<4, 3, false>(q, d, Rows::of_f32(keys), stride, n, out);
}

/// [`scores`] against f16 keys, widened as they are loaded: the bits of [`scores`] on the
/// widened keys.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores_f16(q: &[f32], d: usize, keys: &[u16], stride: usize, n: usize, out: &mut [f32]) {
    scores_tiled::<4, 3, true>(q, d, Rows::of_f16(keys), stride, n, out);
}

/// `R` rows' columns `c..c + 8C` of `acc` (rows `d` long, from row `r`) plus the weighted sum of
/// `n` values, in value order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn sum_tile<const R: usize, const C: usize, const H: bool>(
    acc: &mut [f32],
    d: usize,
    r: usize,
    c: usize,
    p: &[f32],
    rows: usize,
    values: Rows<'_, H>,
    stride: usize,
    n: usize,
) {
    assert!((r + R - 1) * d + c + 8 * C <= acc.len() && c + 8 * C <= d);
    assert!(n == 0 || ((n - 1) * rows + r + R <= p.len() && (n - 1) * stride + c + 8 * C <= values.len()));
    let mut a = [[_mm256_setzero_ps(); C]; R];
    for i in 0..R {
        for x in 0..C {
            // SAFETY: for i < R and x < C the load ends at (r + i) * d + c + 8 * (x + 1)
            // <= (r + R - 1) * d + c + 8 * C <= acc.len() (first assert).
            a[i][x] = unsafe { load(acc, (r + i) * d + c + 8 * x) };
        }
    }
    for j in 0..n {
        let mut v = [_mm256_setzero_ps(); C];
        for x in 0..C {
            // SAFETY: j <= n - 1 and x < C, so the load ends at most at
            // (n - 1) * stride + c + 8 * C <= values.len() (second assert).
            v[x] = unsafe { values.load8(j * stride + c + 8 * x) };
        }
        for i in 0..R {
            // SAFETY: j * rows + r + i <= (n - 1) * rows + r + R - 1 < p.len() (second
            // assert); unchecked, as a checked index here costs a compare and a branch per
            // broadcast in the innermost loop.
            let w = _mm256_set1_ps(unsafe { *p.get_unchecked(j * rows + r + i) });
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

/// [`weighted_sum`] in tiles of `R` rows by `C` vectors, over chunks of `CHUNK` positions.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn weighted_sum_tiled<const R: usize, const C: usize, const CHUNK: usize, const H: bool>(
    acc: &mut [f32],
    d: usize,
    p: &[f32],
    values: Rows<'_, H>,
    stride: usize,
    n: usize,
) {
    assert!(d > 0 && acc.len().is_multiple_of(d), "weighted_sum: rows of {d}");
    let rows = acc.len() / d;
    assert!(p.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= values.len()), "weighted_sum: buffers too short");
    // Positions go by in chunks small enough to stay in L1 while every row group and column
    // tile passes over them: each cached value is fetched from memory once, not once per pass
    // (decode reads one head's slice of each cached row, 2 KB apart, where the hardware
    // prefetchers help little); the next chunk is prefetched meanwhile. Each output element
    // still sums its terms in position order.
    // The first two chunks as well, for the same reason as the first keys in `scores`.
    for j in 0..(2 * CHUNK).min(n) {
        values.slice(j * stride, d).prefetch();
    }
    for j0 in (0..n).step_by(CHUNK) {
        let jn = CHUNK.min(n - j0);
        for j in j0 + 2 * CHUNK..(j0 + 3 * CHUNK).min(n) {
            values.slice(j * stride, d).prefetch();
        }
        weighted_sum_chunk::<R, C, H>(acc, d, rows, &p[j0 * rows..], values.from(j0 * stride), stride, jn);
    }
}

/// `acc[r, :] += Σ_j p[j * rows + r] · value j` over `n` values, value `j` at
/// `values[j * stride..]` (`d` long); `acc` holds `rows` rows of `d`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum(acc: &mut [f32], d: usize, p: &[f32], values: &[f32], stride: usize, n: usize) {
    weighted_sum_tiled::<4, 2, 16, false>(acc, d, p, Rows::of_f32(values), stride, n);
}

/// [`weighted_sum`] over f16 values, widened as they are loaded: the bits of
/// [`weighted_sum`] on the widened values.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum_f16(acc: &mut [f32], d: usize, p: &[f32], values: &[u16], stride: usize, n: usize) {
    weighted_sum_tiled::<4, 2, 16, true>(acc, d, p, Rows::of_f16(values), stride, n);
}

/// [`weighted_sum`] in tiles of eight rows by two vectors (sixteen accumulators) over chunks
/// of thirty-two positions, the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn weighted_sum_vl(acc: &mut [f32], d: usize, p: &[f32], values: &[f32], stride: usize, n: usize) {
    weighted_sum_tiled::<8, 2, 32, false>(acc, d, p, Rows::of_f32(values), stride, n);
}

/// [`weighted_sum_vl`] over f16 values (see [`weighted_sum_f16`]).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub unsafe fn weighted_sum_vl_f16(acc: &mut [f32], d: usize, p: &[f32], values: &[u16], stride: usize, n: usize) {
    weighted_sum_tiled::<8, 2, 32, true>(acc, d, p, Rows::of_f16(values), stride, n);
}

/// [`weighted_sum`] over `n` positions that stay in cache: tiles of `R` rows by `C` vectors,
/// then the columns left in tiles of one vector, the rows left one at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn weighted_sum_chunk<const R: usize, const C: usize, const H: bool>(
    acc: &mut [f32],
    d: usize,
    rows: usize,
    p: &[f32],
    values: Rows<'_, H>,
    stride: usize,
    n: usize,
) {
    let full = d / 8 * 8;
    let whole_cols = full / (8 * C) * (8 * C);
    for r in (0..rows).step_by(R) {
        let whole = rows - r >= R;
        for c in (0..whole_cols).step_by(8 * C) {
            if whole {
                sum_tile::<R, C, H>(acc, d, r, c, p, rows, values, stride, n);
            } else {
                (r..rows).for_each(|r| sum_tile::<1, C, H>(acc, d, r, c, p, rows, values, stride, n));
            }
        }
        for c in (whole_cols..full).step_by(8) {
            if whole {
                sum_tile::<R, 1, H>(acc, d, r, c, p, rows, values, stride, n);
            } else {
                (r..rows).for_each(|r| sum_tile::<1, 1, H>(acc, d, r, c, p, rows, values, stride, n));
            }
        }
        // The scalar tail, as the one-value helper computes it (a product, then a sum).
        for i in r..rows.min(r + R) {
            for j in 0..n {
                let w = p[j * rows + i];
                for e in full..d {
                    acc[i * d + e] += w * values.get(j * stride + e);
                }
            }
        }
    }
}

/// `exp(x)` for `x <= 0` (softmax terms): `x = k·ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6
/// polynomial for `exp(r)` (Cephes' `expf` coefficients), times `2^k` built in the exponent
/// bits. Below -87.3 the result is 0. Lane by lane the same operations as [`exp_one`].
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    let k =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // exp(r) = 1 + r + r²·p(r)
    let e = _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let two_k = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127))));
    let y = _mm256_mul_ps(e, two_k);
    // 2^k is not representable below k = -126: such terms are zero.
    _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(EXP_MIN)))
}

const EXP_MIN: f32 = -87.3;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1];

/// [`exp8`] for one value, with the same operations (FMA is exactly rounded either way).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp_one(x: f32) -> f32 {
    let mut a = [0f32; 8];
    a[0] = x;
    // SAFETY: eight floats in and out of a local array.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), exp8(_mm256_loadu_ps(a.as_ptr()))) };
    a[0]
}

/// `v[i] = exp(v[i] - m[i]); sum[i] += v[i]`, eight at a time, the rest through the same
/// arithmetic one by one.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_terms(v: &mut [f32], m: &[f32], sum: &mut [f32]) {
    let n = v.len().min(m.len()).min(sum.len());
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= the length of each slice.
        unsafe {
            let e = exp8(_mm256_sub_ps(load(v, i), load(m, i)));
            _mm256_storeu_ps(v.as_mut_ptr().add(i), e);
            _mm256_storeu_ps(sum.as_mut_ptr().add(i), _mm256_add_ps(load(sum, i), e));
        }
    }
    for i in full..n {
        v[i] = exp_one(v[i] - m[i]);
        sum[i] += v[i];
    }
}
