//! Gated DeltaNet (Qwen3-Next's linear attention) on the host, in transformers' two forms,
//! which give the same values up to rounding and leave states either form continues from:
//!
//! - the recurrence, token by token, as `torch_recurrent_gated_delta_rule`
//!   ([`run_head_recurrent`]): calls of fewer than [`CHUNKED_FROM`] tokens, decode above all;
//! - the chunked form of `torch_chunk_gated_delta_rule` ([`run_head_chunked`]): longer calls,
//!   prefill. Per chunk of 16 tokens it reads a head's state once, in matrix products over the
//!   chunk that vectorise, where the recurrence reads and writes it once per token.
//!
//! One layer at Qwen3-Next-80B's dims, one thread of the 2-core EPYC (AVX-512), best of five
//! (`delta::timing`; the VM's speed drifts by a third from run to run): 256 tokens in 30–31 ms
//! chunked (0.12 ms a token), 52–54 ms as the recurrence (0.21), 14 of which are the
//! convolution and norms both forms share; 8 tokens 0.16 ms a token chunked against 0.20–0.23;
//! 4 tokens 0.26–0.28 against 0.19–0.26; one (decode) 0.19–0.27 ms as the recurrence.
//!
//! See [`crate::backend::DeltaNetParams`] for the rows and the state.

use crate::backend::DeltaNetParams;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's `softplus` (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Scales `x` to unit L2 norm as transformers' `l2norm` (epsilon 1e-6 under the root), times
/// `scale`.
fn l2_normalise(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The causal convolution with SiLU over rows `0..n` of `x` (`p.stride()` apart, `[q | k | v]`
/// first), continuing from the inputs `conv_state` holds (`taps - 1` rows of `channels`, oldest
/// first; zeros where `fresh`), which it leaves holding the last inputs. Returns `[n, channels]`.
fn convolve(p: &DeltaNetParams<'_>, x: &[f32], n: usize, conv_state: &mut [f32], fresh: bool) -> Vec<f32> {
    let (c, taps, stride) = (p.channels(), p.taps, p.stride());
    let kept = taps - 1;
    if fresh {
        conv_state.fill(0.0);
    }
    // Input `i` of the window the call sees: the kept ones, then the call's rows.
    fn input<'a>(state: &'a [f32], x: &'a [f32], i: usize, kept: usize, c: usize, stride: usize) -> &'a [f32] {
        if i < kept {
            &state[i * c..][..c]
        } else {
            &x[(i - kept) * stride..][..c]
        }
    }
    let mut y = vec![0f32; n * c];
    for (t, row) in y.chunks_exact_mut(c).enumerate() {
        for (j, w) in (0..taps).map(|j| (j, input(conv_state, x, t + j, kept, c, stride))) {
            for (ch, acc) in row.iter_mut().enumerate() {
                *acc += p.conv[ch * taps + j] * w[ch];
            }
        }
        row.iter_mut().for_each(|a| *a = silu(*a));
    }
    // The last `kept` inputs of the window, oldest first.
    for i in 0..kept {
        let src = n + i;
        if src < kept {
            conv_state.copy_within(src * c..(src + 1) * c, i * c);
        } else {
            conv_state[i * c..(i + 1) * c].copy_from_slice(&x[(src - kept) * stride..][..c]);
        }
    }
    y
}

/// The convolution (see [`convolve`]) of rows `0..n` of `x`, with q and k heads
/// L2-normalised and q scaled by `1/sqrt(key_dim)`: `[n, channels]`, what every value head
/// reads. `state`'s first `(taps - 1) × channels` floats are the convolution's.
pub fn prepare(p: &DeltaNetParams<'_>, x: &[f32], n: usize, state: &mut [f32], fresh: bool) -> Vec<f32> {
    let (c, kh, kd) = (p.channels(), p.key_heads, p.key_dim);
    let mut y = convolve(p, x, n, &mut state[..(p.taps - 1) * c], fresh);
    let q_scale = 1.0 / (kd as f32).sqrt();
    for row in y.chunks_exact_mut(c) {
        for (i, head) in row[..2 * kh * kd].chunks_exact_mut(kd).enumerate() {
            l2_normalise(head, if i < kh { q_scale } else { 1.0 });
        }
    }
    y
}

/// Value head `j` over the `n` tokens [`prepare`] made `y` of (rows of `x` give its `z`, `b`
/// and `a`): its `key_dim × value_dim` state `s` decayed and updated by the delta rule token by
/// token, each token's output `Sᵀq` RMS-normed and gated by `silu(z)` into row `t` of `out`
/// (`[n, value_dim]`). `fresh`: the state starts from zeros. From [`CHUNKED_FROM`] tokens on it
/// runs the chunked form ([`run_head_chunked`]), below as the recurrence
/// ([`run_head_recurrent`]): the two give the same values up to rounding, and either leaves a
/// state the other continues from.
#[allow(clippy::too_many_arguments)]
pub fn run_head(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    if n >= CHUNKED_FROM {
        run_head_chunked(p, y, x, n, j, s, fresh, out)
    } else {
        run_head_recurrent(p, y, x, n, j, s, fresh, out)
    }
}

/// [`run_head`] as the recurrence, token by token, whatever `n` (transformers'
/// `torch_recurrent_gated_delta_rule`).
#[allow(clippy::too_many_arguments)]
pub fn run_head_recurrent(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above); the body is safe code.
            return unsafe { run_head_avx512(p, y, x, n, j, s, fresh, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above); the body is safe code.
            return unsafe { run_head_avx2(p, y, x, n, j, s, fresh, out) };
        }
    }
    run_head_body(p, y, x, n, j, s, fresh, out)
}

/// [`run_head_body`] compiled for AVX-512 (its loops over a state row vectorise 16 wide; the
/// same operations in the same order, so the same bits as the portable build).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_head_avx512(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    run_head_body(p, y, x, n, j, s, fresh, out)
}

/// [`run_head_body`] compiled for AVX2 (8 wide).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_head_avx2(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    run_head_body(p, y, x, n, j, s, fresh, out)
}

/// Columns of the state a block of [`run_head_body`] keeps in registers.
const COLUMNS: usize = 64;

/// The recurrence of [`run_head`]. Column `c` of the state only ever meets column `c` of
/// `Sᵀk`, `δ` and `Sᵀq`, so the state is walked in blocks of [`COLUMNS`] columns: per block,
/// one pass down the rows decays them while accumulating `Sᵀk`, then (with `δ = β(v − Sᵀk)`)
/// one pass adds `k ⊗ δ` while accumulating `Sᵀq`, the accumulators in registers and the block
/// (32 KiB at 128 rows) in L1 between the passes. One thread on the 2-core EPYC at Qwen3-Next's
/// dims: 0.51 ms a token and layer walking whole rows with the accumulators in memory, 0.33–0.35
/// with blocks of 64 or 128 columns, 0.36–0.38 with 32, 0.57–0.59 with 16 (one chain of
/// dependent adds per register: latency-bound); `delta::timing`. Each element sees the same operations in the
/// same order as a whole-row walk would give it, and no sum is reordered: every build gives
/// the same bits.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn run_head_body(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    let (kh, vh, kd, vd) = (p.key_heads, p.value_heads, p.key_dim, p.value_dim);
    let (c, vw) = (p.channels(), vh * vd);
    let kh_of = if p.tiled { j % kh } else { j / (vh / kh) };
    if fresh {
        s.fill(0.0);
    }
    for (t, o) in out.chunks_exact_mut(vd).take(n).enumerate() {
        let stride = p.stride();
        let (row, xin) = (&y[t * c..][..c], &x[t * stride..][..stride]);
        let q = &row[kh_of * kd..][..kd];
        let k = &row[(kh + kh_of) * kd..][..kd];
        let v = &row[2 * kh * kd + j * vd..][..vd];
        let beta = sigmoid(xin[c + vw + j]);
        let decay = (p.neg_a[j] * softplus(xin[c + vw + vh + j] + p.dt_bias[j])).exp();
        for c0 in (0..vd).step_by(COLUMNS) {
            let w = COLUMNS.min(vd - c0);
            // S ← exp(g)·S and m = Sᵀk over the block's columns.
            let mut m = [0f32; COLUMNS];
            for (i, &ki) in k.iter().enumerate() {
                for (e, a) in s[i * vd + c0..][..w].iter_mut().zip(m.iter_mut()) {
                    *e *= decay;
                    *a += *e * ki;
                }
            }
            // δ = β(v − m); S ← S + k ⊗ δ and o = Sᵀq.
            for (a, &vv) in m.iter_mut().zip(&v[c0..c0 + w]) {
                *a = (vv - *a) * beta;
            }
            let mut acc = [0f32; COLUMNS];
            for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
                for ((e, &d), a) in s[i * vd + c0..][..w].iter_mut().zip(m.iter()).zip(acc.iter_mut()) {
                    *e += ki * d;
                    *a += *e * qi;
                }
            }
            o[c0..c0 + w].copy_from_slice(&acc[..w]);
        }
        gate(p, o, &xin[c + j * vd..][..vd]);
    }
}

/// A head's output row `o` RMS-normed (with `p.norm`), times `silu(z)`.
#[inline(always)]
fn gate(p: &DeltaNetParams<'_>, o: &mut [f32], z: &[f32]) {
    let ms = o.iter().map(|a| a * a).sum::<f32>() / o.len() as f32;
    let inv = 1.0 / (ms + p.eps).sqrt();
    for ((a, &w), &zz) in o.iter_mut().zip(p.norm).zip(z) {
        *a = *a * inv * w * silu(zz);
    }
}

/// Calls of at least this many tokens run [`run_head_chunked`], shorter ones the recurrence:
/// measured (`delta::timing`), the chunked form is ahead from 8 tokens (0.16 ms a token and
/// layer against 0.20–0.23) and behind at 4 (0.26–0.28 against 0.19–0.26), where it pads a
/// chunk of 16 with 12 tokens that do nothing.
pub const CHUNKED_FROM: usize = 8;

/// Tokens per chunk of [`run_head_chunked`]. transformers' `chunk_size` is 64, but any length
/// gives the same values up to rounding, and shorter chunks shrink the products that grow with
/// the chunk's square while those with the state stay the same per token: side by side, 256
/// tokens took 32–44 ms a layer in chunks of 16, 33–47 in 32 and 35–50 in 64.
const CHUNK: usize = 16;

/// A chunk's rows are padded to a multiple of this many with tokens that change nothing, so
/// that the products over the chunk run in whole blocks of [`Gemm`] (16 floats: a 512-bit
/// register).
const PAD: usize = 16;

/// [`run_head`] in the chunked form (transformers' `torch_chunk_gated_delta_rule`), whatever
/// `n`: per chunk of up to 16 tokens, the state is read once for all of them (in matrix
/// products over the chunk) where the recurrence reads and writes it once per token. The
/// builds for AVX-512 and AVX2 fuse multiply-adds, the portable one does not: they differ
/// by rounding.
#[allow(clippy::too_many_arguments)]
pub fn run_head_chunked(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above); the body is safe code.
            return unsafe { run_head_chunked_avx512(p, y, x, n, j, s, fresh, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above); the body is safe code.
            return unsafe { run_head_chunked_avx2(p, y, x, n, j, s, fresh, out) };
        }
    }
    run_head_chunked_body::<16, false>(p, y, x, n, j, s, fresh, out)
}

/// [`run_head_chunked_body`] compiled for AVX-512 (which implies FMA): blocks of 4 rows by 64
/// columns, 16 accumulators of the 32 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_head_chunked_avx512(
    p: &DeltaNetParams<'_>,
    y: &[f32],
    x: &[f32],
    n: usize,
    j: usize,
    s: &mut [f32],
    fresh: bool,
    out: &mut [f32],
) {
    run_head_chunked_body::<64, true>(p, y, x, n, j, s, fresh, out)
}

/// [`run_head_chunked_body`] compiled for AVX2 and FMA: blocks of 4 rows by 16 columns, 8
/// accumulators of the 16 registers (by 32 columns they would take all 16, and spill: no
/// faster on the EPYC with this build forced).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_head_chunked_avx2(
    p: &DeltaNetParams<'_>,
    y: &[f32],
    x: &[f32],
    n: usize,
    j: usize,
    s: &mut [f32],
    fresh: bool,
    out: &mut [f32],
) {
    run_head_chunked_body::<16, true>(p, y, x, n, j, s, fresh, out)
}

/// The chunked form of [`run_head_chunked`], with blocks of `NR` columns in its products.
///
/// Per chunk of `C` tokens with log decays `g` (`G` their running sum within the chunk, `D[i,l]
/// = exp(G_i − G_l)` for `l ≤ i`), `β`-weighted keys and values `k_β`, `v_β`, and the state
/// `S` it starts from: `T = (I + strictly_lower(k_β kᵀ ∘ D))⁻¹` (forward substitution),
/// `U = T v_β`, `W = T (k_β ∘ exp G)`; the chunk's new values `V' = U − W S`; its outputs
/// `(q ∘ exp G) S + lower(q kᵀ ∘ D) V'`; and the state it leaves `exp(G_last) S + (k ∘
/// exp(G_last − G))ᵀ V'`. `V'` is `δ` of the recurrence with the chunk's earlier tokens folded
/// in, so the state after a chunk is the recurrence's up to rounding.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn run_head_chunked_body<const NR: usize, const FMA: bool>(
    p: &DeltaNetParams<'_>,
    y: &[f32],
    x: &[f32],
    n: usize,
    j: usize,
    s: &mut [f32],
    fresh: bool,
    out: &mut [f32],
) {
    let (kh, vh, kd, vd) = (p.key_heads, p.value_heads, p.key_dim, p.value_dim);
    let (ch, vw, stride) = (p.channels(), vh * vd, p.stride());
    let kh_of = if p.tiled { j % kh } else { j / (vh / kh) };
    if fresh {
        s.fill(0.0);
    }
    // Scratch for the longest chunk, `cp` rows: its padded length.
    let cp = CHUNK.min(n).next_multiple_of(PAD);
    let sizes = [2 * cp * kd, kd * cp, 2 * cp * cp, cp * (vd + kd), cp * (vd + kd), cp * kd, cp * vd, cp * vd, cp, cp];
    let mut scratch = vec![0f32; sizes.iter().sum()];
    let mut parts = scratch.as_mut_slice();
    let [a1, kt, sc, rhs, uw, qg, vn, o, beta, big_g] = sizes.map(|len| {
        let (part, rest) = std::mem::take(&mut parts).split_at_mut(len);
        parts = rest;
        part
    });
    // a1: [k_β; q]; kt: kᵀ; sc: [k_β kᵀ; q kᵀ], then [T; P]; rhs: [v_β | k_β ∘ exp G]; uw:
    // [U | W]; qg: q ∘ exp G; vn: V'; o: the outputs; big_g: G.
    for t0 in (0..n).step_by(CHUNK) {
        let c = CHUNK.min(n - t0);
        let cp = c.next_multiple_of(PAD);
        // β and G; the padding's g is zero, so G_last is the last real token's.
        let mut acc_g = 0f32;
        for i in 0..cp {
            if i < c {
                let xin = &x[(t0 + i) * stride..][..stride];
                beta[i] = sigmoid(xin[ch + vw + j]);
                acc_g += p.neg_a[j] * softplus(xin[ch + vw + vh + j] + p.dt_bias[j]);
            }
            big_g[i] = acc_g;
        }
        let g_last = acc_g;
        // The chunk's rows; the padding's k, q and v are zeros, so that it adds nothing to the
        // state or to the real rows.
        let (kb, q) = a1[..2 * cp * kd].split_at_mut(cp * kd);
        let kt = &mut kt[..kd * cp];
        for i in 0..cp {
            let (rv, rk) = rhs[i * (vd + kd)..][..vd + kd].split_at_mut(vd);
            let (kb, q, qg) = (&mut kb[i * kd..][..kd], &mut q[i * kd..][..kd], &mut qg[i * kd..][..kd]);
            if i >= c {
                for r in [&mut *kb, &mut *q, &mut *qg, &mut *rv, &mut *rk] {
                    r.fill(0.0);
                }
                (0..kd).for_each(|d| kt[d * cp + i] = 0.0);
                continue;
            }
            let row = &y[(t0 + i) * ch..][..ch];
            let (qs, ks, vs) = (&row[kh_of * kd..][..kd], &row[(kh + kh_of) * kd..][..kd], &row[2 * kh * kd + j * vd..][..vd]);
            let (b, eg) = (beta[i], big_g[i].exp());
            // Contiguous rows, one a loop so that each vectorises.
            kb.iter_mut().zip(ks).for_each(|(o, &k)| *o = k * b);
            rk.iter_mut().zip(kb.iter()).for_each(|(o, &k)| *o = k * eg);
            q.copy_from_slice(qs);
            qg.iter_mut().zip(qs).for_each(|(o, &q)| *o = q * eg);
            rv.iter_mut().zip(vs).for_each(|(o, &v)| *o = v * b);
            // Transposed, for the products with the keys as the right operand; on its own, as
            // its stores are strided.
            (0..kd).for_each(|d| kt[d * cp + i] = ks[d]);
        }
        // [k_β kᵀ; q kᵀ]: every row of both against every key of the chunk.
        let sc = &mut sc[..2 * cp * cp];
        Gemm { m: 2 * cp, n: cp, k: kd, lower: false, alpha: 1.0, beta: 0.0 }.run::<NR, FMA>(
            Left { v: &a1[..2 * cp * kd], rs: kd, cs: 1 },
            kt,
            cp,
            sc,
            cp,
        );
        // T = −(k_β kᵀ ∘ D) strictly below the diagonal and P = q kᵀ ∘ D on and below it,
        // zeros above: the products with them as lower triangles still read those within a
        // block of rows.
        let (t_m, p_m) = sc.split_at_mut(cp * cp);
        for i in 0..cp {
            for l in 0..cp {
                let d = if l <= i { (big_g[i] - big_g[l]).exp() } else { 0.0 };
                t_m[i * cp + l] = if l < i { -(t_m[i * cp + l] * d) } else { 0.0 };
                p_m[i * cp + l] *= d;
            }
        }
        // Forward substitution, as transformers': row i += Σ_m T[i,m] T[m,..i] over the rows
        // m < i already done. Row m is zero from column m on, and step m changes only columns
        // below m, so T[i,m] is still its first value when step m reads it.
        for i in 2..cp {
            let (done, rest) = t_m.split_at_mut(i * cp);
            let row = &mut rest[..i];
            for m in 1..i {
                let a = row[m];
                for (r, &u) in row[..m].iter_mut().zip(&done[m * cp..][..m]) {
                    *r += a * u;
                }
            }
        }
        (0..cp).for_each(|i| t_m[i * cp + i] = 1.0);
        // [U | W] = T [v_β | k_β ∘ exp G].
        let w_all = vd + kd;
        Gemm { m: cp, n: w_all, k: cp, lower: true, alpha: 1.0, beta: 0.0 }.run::<NR, FMA>(
            Left { v: t_m, rs: cp, cs: 1 },
            &rhs[..cp * w_all],
            w_all,
            &mut uw[..cp * w_all],
            w_all,
        );
        // V' = U − W S.
        let vn = &mut vn[..cp * vd];
        for (r, u) in vn.chunks_exact_mut(vd).zip(uw.chunks_exact(w_all)) {
            r.copy_from_slice(&u[..vd]);
        }
        Gemm { m: cp, n: vd, k: kd, lower: false, alpha: -1.0, beta: 1.0 }.run::<NR, FMA>(
            Left { v: &uw[vd..cp * w_all], rs: w_all, cs: 1 },
            s,
            vd,
            vn,
            vd,
        );
        // Outputs (q ∘ exp G) S + P V'.
        let o = &mut o[..cp * vd];
        Gemm { m: cp, n: vd, k: kd, lower: false, alpha: 1.0, beta: 0.0 }.run::<NR, FMA>(
            Left { v: &qg[..cp * kd], rs: kd, cs: 1 },
            s,
            vd,
            o,
            vd,
        );
        Gemm { m: cp, n: vd, k: cp, lower: true, alpha: 1.0, beta: 1.0 }.run::<NR, FMA>(Left { v: p_m, rs: cp, cs: 1 }, vn, vd, o, vd);
        // S ← exp(G_last) S + (k ∘ exp(G_last − G))ᵀ V' = exp(G_last) S + kᵀ (exp(G_last − G) ∘ V').
        for (i, r) in vn.chunks_exact_mut(vd).take(c).enumerate() {
            let e = (g_last - big_g[i]).exp();
            r.iter_mut().for_each(|v| *v *= e);
        }
        Gemm { m: kd, n: vd, k: cp, lower: false, alpha: 1.0, beta: g_last.exp() }.run::<NR, FMA>(
            Left { v: kt, rs: cp, cs: 1 },
            vn,
            vd,
            s,
            vd,
        );
        for (i, row) in o.chunks_exact_mut(vd).take(c).enumerate() {
            let t = t0 + i;
            gate(p, row, &x[t * stride + ch + j * vd..][..vd]);
            out[t * vd..][..vd].copy_from_slice(row);
        }
    }
}

/// `acc + a·b`, fused (one rounding) where `FMA`: only in builds for CPUs that have it, where
/// it is one instruction (elsewhere `mul_add` is a library call).
#[inline(always)]
fn madd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// Rows of the output a block of [`Gemm::panel`] computes at once (its four sums written out).
const MR: usize = 4;

/// The left operand of a [`Gemm`]: element `(i, p)` at `v[i * rs + p * cs]`, so that a
/// transposed matrix is read in place.
#[derive(Clone, Copy)]
struct Left<'a> {
    v: &'a [f32],
    rs: usize,
    cs: usize,
}

/// `C ← beta·C + alpha·A B` for `A` `m × k` (a [`Left`]), `B` `k × n` and `C` `m × n` (rows
/// contiguous, a row stride apart); `beta` 0 writes `C` without reading it. `lower`: `A` is
/// zero right of its diagonal (`A[i,p] = 0` for `p > i`), so a block of rows stops there.
struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    lower: bool,
    alpha: f32,
    beta: f32,
}

impl Gemm {
    /// Column blocks of `NR`, then 32 and 16 for what is left (so that a width of 48 runs in
    /// registers too), then single columns; see [`Self::panel`].
    #[inline(always)]
    fn run<const NR: usize, const FMA: bool>(&self, a: Left<'_>, b: &[f32], brs: usize, c: &mut [f32], crs: usize) {
        let mut j0 = 0;
        while j0 < self.n {
            let w = self.n - j0;
            j0 += if w >= NR {
                self.panel::<NR, FMA>(a, b, brs, c, crs, j0)
            } else if NR > 32 && w >= 32 {
                self.panel::<32, FMA>(a, b, brs, c, crs, j0)
            } else if NR > 16 && w >= 16 {
                self.panel::<16, FMA>(a, b, brs, c, crs, j0)
            } else {
                self.scalar::<FMA>(a, b, brs, c, crs, (0, self.m), (j0, w));
                w
            };
        }
    }

    /// Columns `j0..j0 + W` of `C`, [`MR`] rows at a time: the `MR × W` sums stay in registers
    /// while `p` runs over `k`, each step one row of `B` (`W / 16` loads) against `MR`
    /// broadcasts of `A`. Returns `W`.
    #[inline(always)]
    fn panel<const W: usize, const FMA: bool>(&self, a: Left<'_>, b: &[f32], brs: usize, c: &mut [f32], crs: usize, j0: usize) -> usize {
        let mut i0 = 0;
        while i0 + MR <= self.m {
            let kend = if self.lower { self.k.min(i0 + MR) } else { self.k };
            let (mut r0, mut r1, mut r2, mut r3) = ([0f32; W], [0f32; W], [0f32; W], [0f32; W]);
            let rows = [i0 * a.rs, (i0 + 1) * a.rs, (i0 + 2) * a.rs, (i0 + 3) * a.rs];
            for p in 0..kend {
                let brow: &[f32; W] = b[p * brs + j0..][..W].try_into().unwrap();
                let (a0, a1, a2, a3) = (a.v[rows[0] + p * a.cs], a.v[rows[1] + p * a.cs], a.v[rows[2] + p * a.cs], a.v[rows[3] + p * a.cs]);
                for jj in 0..W {
                    r0[jj] = madd::<FMA>(r0[jj], a0, brow[jj]);
                    r1[jj] = madd::<FMA>(r1[jj], a1, brow[jj]);
                    r2[jj] = madd::<FMA>(r2[jj], a2, brow[jj]);
                    r3[jj] = madd::<FMA>(r3[jj], a3, brow[jj]);
                }
            }
            for (ii, r) in [r0, r1, r2, r3].iter().enumerate() {
                self.store(&mut c[(i0 + ii) * crs + j0..][..W], r);
            }
            i0 += MR;
        }
        if i0 < self.m {
            self.scalar::<FMA>(a, b, brs, c, crs, (i0, self.m - i0), (j0, W));
        }
        W
    }

    /// Rows `i0..i0 + h` by columns `j0..j0 + w` of `C`, one element at a time (the same
    /// sums in the same order as [`Self::panel`]). Left to the compiler to inline or not: only
    /// sizes that are not multiples of 16 (none of the models') come here.
    fn scalar<const FMA: bool>(
        &self,
        a: Left<'_>,
        b: &[f32],
        brs: usize,
        c: &mut [f32],
        crs: usize,
        (i0, h): (usize, usize),
        (j0, w): (usize, usize),
    ) {
        for i in i0..i0 + h {
            let kend = if self.lower { self.k.min(i + 1) } else { self.k };
            let r: Vec<f32> =
                (j0..j0 + w).map(|jj| (0..kend).fold(0.0, |acc, p| madd::<FMA>(acc, a.v[i * a.rs + p * a.cs], b[p * brs + jj]))).collect();
            self.store(&mut c[i * crs + j0..][..w], &r);
        }
    }

    #[inline(always)]
    fn store(&self, c: &mut [f32], r: &[f32]) {
        if self.beta == 0.0 {
            c.iter_mut().zip(r).for_each(|(c, &r)| *c = self.alpha * r);
        } else {
            c.iter_mut().zip(r).for_each(|(c, &r)| *c = self.beta * *c + self.alpha * r);
        }
    }
}

/// Runs one Gated DeltaNet layer over rows `0..n` of `x` (one sequence's tokens, in order),
/// writing rows `0..n` of `out` (`value_heads × value_dim` wide), one head after another; see
/// [`crate::Backend::gated_delta_net`]. (The CPU backend runs the heads of [`run_head`] in
/// parallel.)
pub fn gated_delta_net(p: &DeltaNetParams<'_>, x: &[f32], n: usize, state: &mut [f32], fresh: bool, out: &mut [f32]) {
    let (vd, vw) = (p.value_dim, p.value_heads * p.value_dim);
    let y = prepare(p, x, n, state, fresh);
    let mats = &mut state[(p.taps - 1) * p.channels()..];
    let mut o = vec![0f32; n * vd];
    for (j, s) in mats.chunks_exact_mut(p.key_dim * vd).enumerate() {
        run_head(p, &y, x, n, j, s, fresh, &mut o);
        for (t, row) in o.chunks_exact(vd).enumerate() {
            out[t * vw + j * vd..][..vd].copy_from_slice(row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params<'a>(conv: &'a [f32], neg_a: &'a [f32], dt: &'a [f32], norm: &'a [f32]) -> DeltaNetParams<'a> {
        DeltaNetParams {
            key_heads: 2,
            value_heads: 4,
            tiled: false,
            key_dim: 4,
            value_dim: 3,
            taps: 4,
            conv,
            neg_a,
            dt_bias: dt,
            norm,
            eps: 1e-6,
        }
    }

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The CPU-specific builds of the recurrence give the portable build's bits.
    #[test]
    fn every_build_of_a_head_gives_the_same_bits() {
        let (conv, neg_a, dt, norm) = (noise(28 * 4, 11), noise(4, 12), noise(4, 13), noise(3, 14));
        let p = params(&conv, &neg_a, &dt, &norm);
        let stride = p.stride();
        let n = 9;
        let x = noise(n * stride, 15);
        let mut st = vec![0f32; p.state_floats()];
        let y = prepare(&p, &x, n, &mut st, true);
        for j in 0..p.value_heads {
            let (mut s1, mut s2) = (noise(12, 16), noise(12, 16));
            let (mut o1, mut o2) = (vec![0f32; n * 3], vec![0f32; n * 3]);
            run_head_recurrent(&p, &y, &x, n, j, &mut s1, false, &mut o1);
            run_head_body(&p, &y, &x, n, j, &mut s2, false, &mut o2);
            assert_eq!((o1, s1), (o2, s2), "head {j}");
        }
    }

    /// The chunked form's fused builds (AVX-512 in blocks of 64 columns, AVX2 in 16) give the
    /// bits of the same code built portably in blocks of 16 (the blocks change no sum); the
    /// portable build, unfused, differs from them by rounding.
    #[test]
    fn every_build_of_the_chunked_form_agrees() {
        #[cfg(target_arch = "x86_64")]
        let fused = std::arch::is_x86_feature_detected!("avx512f")
            || (std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"));
        #[cfg(not(target_arch = "x86_64"))]
        let fused = false;
        let (kh, vh, kd, vd, taps) = (2, 4, 32, 48, 4);
        let conv = noise((2 * kh * kd + vh * vd) * taps, 41);
        let (neg_a, dt, norm) = (vec![-0.1f32; vh], vec![0.0f32; vh], noise(vd, 42));
        let p: DeltaNetParams<'_> = DeltaNetParams {
            key_heads: kh,
            value_heads: vh,
            tiled: false,
            key_dim: kd,
            value_dim: vd,
            taps,
            conv: &conv,
            neg_a: &neg_a,
            dt_bias: &dt,
            norm: &norm,
            eps: 1e-6,
        };
        let n = 40;
        let x = noise(n * p.stride(), 43);
        let mut st = vec![0f32; p.state_floats()];
        let y = prepare(&p, &x, n, &mut st, true);
        for j in 0..vh {
            let start = noise(kd * vd, 44);
            let (mut s1, mut s2, mut s3) = (start.clone(), start.clone(), start);
            let (mut o1, mut o2, mut o3) = (vec![0f32; n * vd], vec![0f32; n * vd], vec![0f32; n * vd]);
            run_head_chunked(&p, &y, &x, n, j, &mut s1, false, &mut o1);
            run_head_chunked_body::<16, true>(&p, &y, &x, n, j, &mut s2, false, &mut o2);
            run_head_chunked_body::<16, false>(&p, &y, &x, n, j, &mut s3, false, &mut o3);
            let (o_same, s_same) = if fused { (&o2, &s2) } else { (&o3, &s3) };
            assert!(o1 == *o_same && s1 == *s_same, "head {j}: not the same bits");
            let (eo, es) = (rel_diff(&o3, &o2), rel_diff(&s3, &s2));
            assert!(eo <= 1e-5 && es <= 1e-5, "head {j}: unfused {eo:.1e}, {es:.1e}");
        }
    }

    /// A prompt run in one call equals the same tokens run one call each (the state carries
    /// the sequence), and `fresh` ignores whatever the state held.
    #[test]
    fn one_call_equals_token_by_token() {
        let (conv, neg_a, dt, norm) = (noise(28 * 4, 1), noise(4, 2), noise(4, 3), noise(3, 4));
        let p = params(&conv, &neg_a, &dt, &norm);
        let stride = p.stride();
        let n = 7;
        let x = noise(n * stride, 5);
        let mut whole = vec![0f32; n * 12];
        let mut st = noise(p.state_floats(), 6);
        gated_delta_net(&p, &x, n, &mut st, true, &mut whole);
        let mut step = vec![0f32; n * 12];
        let mut st2 = vec![0f32; p.state_floats()];
        for t in 0..n {
            gated_delta_net(&p, &x[t * stride..], 1, &mut st2, t == 0, &mut step[t * 12..]);
        }
        for (a, b) in whole.iter().zip(&step) {
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
        }
        assert_eq!(st, st2);
        assert!(whole.iter().all(|v| v.is_finite()) && whole.iter().any(|&v| v != 0.0));
    }

    /// Largest difference between `a` and `b` over the largest magnitude of `b`.
    fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale.max(f32::MIN_POSITIVE)
    }

    /// The chunked form gives the recurrence's outputs and states up to rounding: calls of
    /// fewer tokens than a chunk, of one chunk, of a chunk and a token, of several with a
    /// partial last; value heads numbered either way; from zeros or from a state; decays that
    /// keep the state across chunks and ones that forget it within a few tokens (exp G
    /// underflows); head sizes that run in whole register blocks, in 32 + 16 and in none.
    #[test]
    fn chunked_equals_the_recurrence() {
        for (kd, vd) in [(4, 3), (16, 16), (32, 48)] {
            for tiled in [false, true] {
                for (neg_a, dt_bias) in [(-0.02f32, -1.0f32), (-3.0, 2.0)] {
                    let (kh, vh, taps) = (2, 4, 4);
                    let c = 2 * kh * kd + vh * vd;
                    let conv = noise(c * taps, 21);
                    let (neg_a, dt, norm) = (vec![neg_a; vh], vec![dt_bias; vh], noise(vd, 22));
                    let p: DeltaNetParams<'_> = DeltaNetParams {
                        key_heads: kh,
                        value_heads: vh,
                        tiled,
                        key_dim: kd,
                        value_dim: vd,
                        taps,
                        conv: &conv,
                        neg_a: &neg_a,
                        dt_bias: &dt,
                        norm: &norm,
                        eps: 1e-6,
                    };
                    for n in [1, 5, 16, 17, 63, 64, 65, 200] {
                        let x = noise(n * p.stride(), 23 + n as u32);
                        let mut st = vec![0f32; p.state_floats()];
                        let y = prepare(&p, &x, n, &mut st, true);
                        for fresh in [true, false] {
                            for j in 0..vh {
                                let what = format!("kd {kd} vd {vd} tiled {tiled} neg_a {} n {n} fresh {fresh} head {j}", neg_a[0]);
                                let start = noise(kd * vd, 24 + j as u32);
                                let (mut s1, mut s2) = (start.clone(), start);
                                let (mut o1, mut o2) = (vec![0f32; n * vd], vec![0f32; n * vd]);
                                run_head_recurrent(&p, &y, &x, n, j, &mut s1, fresh, &mut o1);
                                run_head_chunked(&p, &y, &x, n, j, &mut s2, fresh, &mut o2);
                                let (eo, es) = (rel_diff(&o2, &o1), rel_diff(&s2, &s1));
                                assert!(eo <= 1e-5 && es <= 1e-5, "{what}: outputs {eo:.1e}, state {es:.1e}");
                                assert!(o1.iter().any(|&v| v != 0.0) && s1.iter().any(|&v| v != 0.0), "{what}: all zeros");
                            }
                        }
                    }
                }
            }
        }
    }

    /// A prompt long enough for the chunked form, then decode steps by the recurrence from
    /// the state it left, give what the recurrence gives all the way.
    #[test]
    fn decode_continues_a_chunked_prefill() {
        let (conv, neg_a, dt, norm) = (noise(28 * 4, 31), vec![-0.05f32; 4], vec![-1.0f32; 4], noise(3, 34));
        let p = params(&conv, &neg_a, &dt, &norm);
        let stride = p.stride();
        let (prompt, n) = (70, 74);
        assert!(prompt >= CHUNKED_FROM);
        let x = noise(n * stride, 35);
        let (mut chunked, mut recurrent) = (vec![0f32; n * 12], vec![0f32; n * 12]);
        let (mut st, mut st2) = (vec![0f32; p.state_floats()], vec![0f32; p.state_floats()]);
        gated_delta_net(&p, &x, prompt, &mut st, true, &mut chunked);
        for t in prompt..n {
            gated_delta_net(&p, &x[t * stride..], 1, &mut st, false, &mut chunked[t * 12..]);
        }
        for t in 0..n {
            gated_delta_net(&p, &x[t * stride..], 1, &mut st2, t == 0, &mut recurrent[t * 12..]);
        }
        let (eo, es) = (rel_diff(&chunked, &recurrent), rel_diff(&st, &st2));
        assert!(eo <= 1e-5 && es <= 1e-5, "outputs {eo:.1e}, state {es:.1e}");
    }
}

/// Timing of one Gated DeltaNet layer at Qwen3-Next-80B's dims on this machine, one thread,
/// the recurrence and the chunked form:
/// `cargo test --release -p smoe-engine --lib delta::timing -- --ignored --nocapture`.
#[cfg(test)]
mod timing {
    use super::*;

    type Head = fn(&DeltaNetParams<'_>, &[f32], &[f32], usize, usize, &mut [f32], bool, &mut [f32]);

    #[test]
    #[ignore]
    fn one_layer_at_80b_dims() {
        let (kh, vh, kd, vd, taps) = (16, 32, 128, 128, 4);
        let c = 2 * kh * kd + vh * vd;
        let (conv, neg_a, dt, norm) = (vec![0.1f32; c * taps], vec![-0.5f32; vh], vec![0.5f32; vh], vec![1.0f32; vd]);
        let p: DeltaNetParams<'_> = DeltaNetParams {
            key_heads: kh,
            value_heads: vh,
            tiled: false,
            key_dim: kd,
            value_dim: vd,
            taps,
            conv: &conv,
            neg_a: &neg_a,
            dt_bias: &dt,
            norm: &norm,
            eps: 1e-6,
        };
        let (stride, mut state) = (p.stride(), vec![0f32; p.state_floats()]);
        let forms: [(&str, Option<Head>); 3] =
            [("recurrence", Some(run_head_recurrent)), ("chunked", Some(run_head_chunked)), ("prepare", None)];
        for n in [1, 4, 8, 16, 64, 256] {
            let x: Vec<f32> = (0..n * stride).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let mut out = vec![0f32; n * vd];
            let reps = (512 / n).clamp(4, 200);
            for (name, head) in forms {
                // The best of five runs: this VM's speed drifts by a third from run to run.
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        // As `gated_delta_net`, with the head's form chosen here ("prepare": the
                        // convolution and norms alone, the same in both forms).
                        let y = prepare(&p, &x, n, &mut state, false);
                        let mats = &mut state[(taps - 1) * c..];
                        for (j, s) in mats.chunks_exact_mut(kd * vd).enumerate() {
                            if let Some(head) = head {
                                head(&p, &y, &x, n, j, s, false, &mut out);
                            }
                        }
                    }
                    best = best.min(t.elapsed().as_secs_f64() * 1e3 / reps as f64);
                }
                println!("{name:>10}, {n:>3} tokens: {best:8.3} ms per layer, {:.4} ms per token per layer (one thread)", best / n as f64);
            }
        }
    }
}
