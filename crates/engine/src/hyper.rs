//! DeepSeek-V4's manifold-constrained hyper-connections on the host: the per-token mixing
//! weights from the projected streams (sigmoids, a softmax and Sinkhorn-Knopp), and the plain
//! collapse and expansion the backends' default ops run (see
//! [`Backend::hc_collapse`](crate::Backend::hc_collapse)). The clipped SwiGLU of V4's experts
//! is here too, as the one scalar both its ops share.

/// `sigmoid(x)`.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// DeepSeek-V4's clipped SwiGLU of one gate and up value: `silu(min(g, limit)) · clamp(u,
/// -limit, limit)`.
pub fn clamped_silu(g: f32, u: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    g * sigmoid(g) * u.clamp(-limit, limit)
}

/// One block's mixing weights for `n` tokens, as transformers' `DeepseekV4HyperConnection`
/// computes them from the projection `mixes` (`[n, (2 + mult) × mult]`: pre, post, comb) with
/// `base` and the three `scale`s: `pre` `[n, mult]` = sigmoid + eps, `post` `[n, mult]` = 2 ·
/// sigmoid, `comb` `[n, mult, mult]` = softmax over each row + eps, then made doubly
/// stochastic: columns, then `iters - 1` times rows and columns, each divided by its sum + eps.
#[allow(clippy::too_many_arguments)]
pub fn block_weights(
    mixes: &[f32],
    n: usize,
    mult: usize,
    base: &[f32],
    scale: &[f32],
    iters: usize,
    eps: f32,
    pre: &mut Vec<f32>,
    post: &mut Vec<f32>,
    comb: &mut Vec<f32>,
) {
    let m = mult;
    let width = (2 + m) * m;
    pre.resize(n * m, 0.0);
    post.resize(n * m, 0.0);
    comb.resize(n * m * m, 0.0);
    for t in 0..n {
        let row = &mixes[t * width..][..width];
        for j in 0..m {
            pre[t * m + j] = sigmoid(row[j] * scale[0] + base[j]) + eps;
            post[t * m + j] = 2.0 * sigmoid(row[m + j] * scale[1] + base[m + j]);
        }
        let c = &mut comb[t * m * m..][..m * m];
        for (i, r) in c.chunks_exact_mut(m).enumerate() {
            for (k, v) in r.iter_mut().enumerate() {
                *v = row[2 * m + i * m + k] * scale[2] + base[2 * m + i * m + k];
            }
            let max = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0;
            for v in r.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            for v in r.iter_mut() {
                *v = *v / sum + eps;
            }
        }
        normalise_columns(c, m, eps);
        for _ in 1..iters {
            for r in c.chunks_exact_mut(m) {
                let s: f32 = r.iter().sum::<f32>() + eps;
                for v in r.iter_mut() {
                    *v /= s;
                }
            }
            normalise_columns(c, m, eps);
        }
    }
}

/// Divides each column of the `m × m` matrix `c` by its sum + eps.
fn normalise_columns(c: &mut [f32], m: usize, eps: f32) {
    for k in 0..m {
        let s: f32 = (0..m).map(|i| c[i * m + k]).sum::<f32>() + eps;
        for i in 0..m {
            c[i * m + k] /= s;
        }
    }
}

/// The final collapse's weights (`DeepseekV4HyperHead`): `pre` `[n, mult]` = sigmoid(mixes ·
/// scale + base) + eps.
pub fn head_weights(mixes: &[f32], n: usize, mult: usize, base: &[f32], scale: f32, eps: f32, pre: &mut Vec<f32>) {
    pre.resize(n * mult, 0.0);
    for (p, (i, &x)) in pre.iter_mut().zip(mixes[..n * mult].iter().enumerate()) {
        *p = sigmoid(x * scale + base[i % mult]) + eps;
    }
}

/// `out[t] = Σ_j pre[t × mult + j] · x[t, j]` (rows of `mult × dim`, `out` rows of `dim`).
pub fn collapse(x: &[f32], n: usize, mult: usize, dim: usize, pre: &[f32], out: &mut [f32]) {
    for t in 0..n {
        let o = &mut out[t * dim..][..dim];
        o.fill(0.0);
        for j in 0..mult {
            let p = pre[t * mult + j];
            for (a, &b) in o.iter_mut().zip(&x[(t * mult + j) * dim..][..dim]) {
                *a += p * b;
            }
        }
    }
}

/// Most streams [`expand`] mixes (DeepSeek-V4 has 4; the architecture check refuses more).
const MAX_STREAMS: usize = smoe_vault::HyperConnections::MAX_STREAMS;

/// `x[t, k] = post[t × mult + k] · y[t] + Σ_j comb[t, j, k] · x[t, j]`, in place: each
/// position's `mult` old values are read before any is written, so nothing is allocated.
pub fn expand(x: &mut [f32], y: &[f32], n: usize, mult: usize, dim: usize, post: &[f32], comb: &[f32]) {
    assert!(mult <= MAX_STREAMS, "{mult} hyper-connection streams (at most {MAX_STREAMS})");
    let mut old = [0f32; MAX_STREAMS];
    for t in 0..n {
        let row = &mut x[t * mult * dim..][..mult * dim];
        let c = &comb[t * mult * mult..][..mult * mult];
        let p = &post[t * mult..][..mult];
        for (d, &yd) in y[t * dim..][..dim].iter().enumerate() {
            for (j, o) in old[..mult].iter_mut().enumerate() {
                *o = row[j * dim + d];
            }
            for k in 0..mult {
                row[k * dim + d] = (0..mult).fold(p[k] * yd, |v, j| v + c[j * mult + k] * old[j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sinkhorn's result is doubly stochastic to within its epsilon: every row and column of
    /// `comb` sums to one.
    #[test]
    fn comb_is_doubly_stochastic() {
        let m = 4;
        let mixes: Vec<f32> = (0..(2 + m) * m).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let base = vec![0.1; (2 + m) * m];
        let (mut pre, mut post, mut comb) = (vec![], vec![], vec![]);
        block_weights(&mixes, 1, m, &base, &[1.0, 1.0, 1.0], 20, 1e-6, &mut pre, &mut post, &mut comb);
        for i in 0..m {
            let row: f32 = comb[i * m..][..m].iter().sum();
            let col: f32 = (0..m).map(|j| comb[j * m + i]).sum();
            assert!((row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5, "row {row}, column {col}");
        }
        assert!(pre.iter().all(|&p| p > 0.0 && p < 1.0 + 1e-5) && post.iter().all(|&p| p > 0.0 && p < 2.0));
    }

    /// Collapsing with weights one-hot on stream `j` gives stream `j`; expanding with `comb`
    /// the identity and `post` zero leaves the streams as they were.
    #[test]
    fn collapse_and_expand_by_hand() {
        let (n, m, d) = (2, 3, 4);
        let x: Vec<f32> = (0..n * m * d).map(|i| i as f32).collect();
        let mut out = vec![0f32; n * d];
        let pre = [0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        collapse(&x, n, m, d, &pre, &mut out);
        assert_eq!(&out[..d], &x[d..2 * d]);
        assert_eq!(&out[d..], &x[(m + 2) * d..(m + 3) * d]);
        let mut y = x.clone();
        let eye: Vec<f32> = (0..n).flat_map(|_| (0..m * m).map(|i| if i / m == i % m { 1.0 } else { 0.0 })).collect();
        expand(&mut y, &vec![9.0; n * d], n, m, d, &[0.0; 6], &eye);
        assert_eq!(y, x);
        assert_eq!(clamped_silu(100.0, 100.0, 10.0), clamped_silu(10.0, 10.0, 10.0));
    }
}
