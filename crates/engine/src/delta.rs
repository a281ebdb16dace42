//! Gated DeltaNet (Qwen3-Next's linear attention) on the host: the recurrence, token by token,
//! as transformers' `torch_recurrent_gated_delta_rule` runs it, which its chunked form
//! (`torch_chunk_gated_delta_rule`, used for prefill) computes the same values as up to
//! rounding. See [`crate::backend::DeltaNetParams`] for the rows and the state.

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
/// (`[n, value_dim]`). `fresh`: the state starts from zeros.
#[allow(clippy::too_many_arguments)]
pub fn run_head(p: &DeltaNetParams<'_>, y: &[f32], x: &[f32], n: usize, j: usize, s: &mut [f32], fresh: bool, out: &mut [f32]) {
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
        // RMS-normed per head, times silu(z).
        let ms = o.iter().map(|a| a * a).sum::<f32>() / vd as f32;
        let inv = 1.0 / (ms + p.eps).sqrt();
        let z = &xin[c + j * vd..][..vd];
        for ((a, &w), &zz) in o.iter_mut().zip(p.norm).zip(z) {
            *a = *a * inv * w * silu(zz);
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

    /// The CPU-specific builds of a head give the portable build's bits.
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
            run_head(&p, &y, &x, n, j, &mut s1, false, &mut o1);
            run_head_body(&p, &y, &x, n, j, &mut s2, false, &mut o2);
            assert_eq!((o1, s1), (o2, s2), "head {j}");
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
}

/// Timing of one Gated DeltaNet layer at Qwen3-Next-80B's dims on this machine, one thread:
/// `cargo test --release -p smoe-engine --lib delta::timing -- --ignored --nocapture`.
#[cfg(test)]
mod timing {
    use super::*;

    #[test]
    #[ignore]
    fn one_layer_at_80b_dims() {
        let (kh, vh, kd, vd, taps) = (16, 32, 128, 128, 4);
        let c = 2 * kh * kd + vh * vd;
        let (conv, neg_a, dt, norm) = (vec![0.1f32; c * taps], vec![-0.5f32; vh], vec![0.5f32; vh], vec![1.0f32; vd]);
        let p = DeltaNetParams {
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
        for n in [1, 256] {
            let x: Vec<f32> = (0..n * stride).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let mut out = vec![0f32; n * vh * vd];
            let reps = if n == 1 { 200 } else { 4 };
            let t = std::time::Instant::now();
            for _ in 0..reps {
                gated_delta_net(&p, &x, n, &mut state, false, &mut out);
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            println!("gated_delta_net, {n} tokens: {ms:.3} ms per layer, {:.4} ms per token per layer (one thread)", ms / n as f64);
        }
    }
}
