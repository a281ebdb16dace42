//! Exact expert routing from router logits, as transformers computes it.
//!
//! Softmax routers (Qwen, Mixtral, OLMoE) take the top-k of softmax probabilities, optionally
//! renormalised. Sigmoid-grouped routers (DeepSeek-V3, GLM-4.5) choose on sigmoid scores plus
//! the correction bias, restricted to the best groups (a group scores the sum of its two best),
//! with masked experts set to 0 (not -inf, as transformers does); mixing weights are the
//! uncorrected scores, optionally renormalised, times the routed scaling factor.

use smoe_vault::{Moe, Router};

/// A layer's routing rule.
#[derive(Clone, Debug)]
pub struct RouterRule {
    kind: Router,
    top_k: usize,
    norm_topk_prob: bool,
    scaling: f32,
    num_experts: usize,
}

/// Reusable buffers for [`RouterRule::route`].
#[derive(Default)]
pub struct RouteScratch {
    /// `[experts]`: the scores the latest token's experts were chosen on (softmax
    /// probabilities, or corrected and group-masked sigmoid scores), for inspecting near-ties.
    pub choice: Vec<f32>,
    weights_src: Vec<f32>,
    group_scores: Vec<f32>,
    group_keep: Vec<bool>,
    best_groups: Vec<u32>,
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k_indices(v: &[f32], k: usize, out: &mut [u32]) {
    debug_assert!(out.len() >= k);
    let mut n = 0;
    for (i, &x) in v.iter().enumerate() {
        // Insertion into a short sorted list: k is small (2..10).
        let mut j = n.min(k);
        while j > 0 && x > v[out[j - 1] as usize] {
            if j < k {
                out[j] = out[j - 1];
            }
            j -= 1;
        }
        if j < k {
            out[j] = i as u32;
            n = (n + 1).min(k);
        }
    }
}

impl RouterRule {
    /// The rule of a model's MoE block.
    pub fn new(moe: &Moe) -> RouterRule {
        RouterRule {
            kind: moe.router.clone(),
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            scaling: moe.routed_scaling_factor as f32,
            num_experts: moe.num_experts,
        }
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The router's kind (softmax, or sigmoid with groups).
    pub fn kind(&self) -> &Router {
        &self.kind
    }

    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub fn norm_topk_prob(&self) -> bool {
        self.norm_topk_prob
    }

    /// The factor the mixing weights are scaled by.
    pub fn scaling(&self) -> f32 {
        self.scaling
    }

    /// Experts to choose from.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Routes `n` tokens of `logits` (`[n, experts]`) into `routes` (`[n, 2k]`: each token's
    /// expert ids as f32 values, then their weights): the layout of
    /// [`crate::Backend::route`].
    pub fn route_rows(&self, logits: &[f32], bias: Option<&[f32]>, n: usize, routes: &mut [f32], s: &mut RouteScratch) {
        let (e, k) = (self.num_experts, self.top_k);
        let (mut ids, mut w) = (vec![0u32; k], vec![0f32; k]);
        for t in 0..n {
            self.route(&logits[t * e..(t + 1) * e], bias, &mut ids, &mut w, s);
            let row = &mut routes[t * 2 * k..(t + 1) * 2 * k];
            for (dst, &i) in row[..k].iter_mut().zip(&ids) {
                *dst = i as f32;
            }
            row[k..].copy_from_slice(&w);
        }
    }

    /// Routes one token: `ids` and `weights` (each `top_k` long) from its router `logits`.
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>, ids: &mut [u32], weights: &mut [f32], s: &mut RouteScratch) {
        let e = self.num_experts;
        s.choice.resize(e, 0.0);
        s.weights_src.resize(e, 0.0);
        match self.kind {
            Router::Softmax => {
                let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0f32;
                for (p, &l) in s.choice.iter_mut().zip(logits) {
                    *p = (l - max).exp();
                    sum += *p;
                }
                for p in s.choice.iter_mut() {
                    *p /= sum;
                }
                s.weights_src.copy_from_slice(&s.choice);
            }
            Router::SqrtSoftplus { .. } => self.scores(logits, bias, s),
            Router::SigmoidGrouped { n_group, topk_group, .. } => {
                for i in 0..e {
                    let score = 1.0 / (1.0 + (-logits[i]).exp());
                    s.weights_src[i] = score;
                    s.choice[i] = score + bias.map_or(0.0, |b| b[i]);
                }
                let per = e / n_group;
                s.group_scores.resize(n_group, 0.0);
                for g in 0..n_group {
                    let grp = &s.choice[g * per..(g + 1) * per];
                    let mut top2 = [0u32; 2];
                    let k = per.min(2);
                    top_k_indices(grp, k, &mut top2);
                    s.group_scores[g] = top2[..k].iter().map(|&i| grp[i as usize]).sum();
                }
                s.best_groups.resize(topk_group, 0);
                top_k_indices(&s.group_scores, topk_group, &mut s.best_groups);
                s.group_keep.clear();
                s.group_keep.resize(n_group, false);
                for &g in &s.best_groups {
                    s.group_keep[g as usize] = true;
                }
                for i in 0..e {
                    if !s.group_keep[i / per] {
                        s.choice[i] = 0.0;
                    }
                }
            }
        }
        top_k_indices(&s.choice, self.top_k, ids);
        self.mix(ids, weights, s);
    }

    /// DeepSeek-V4's hash-routed layers: the experts are `ids` (the token's row of `tid2eid`),
    /// weighted by their scores as [`route`](Self::route) weighs the experts it chooses.
    /// `s.choice` holds the scores.
    pub fn route_given(&self, logits: &[f32], ids: &[u32], weights: &mut [f32], s: &mut RouteScratch) {
        self.scores(logits, None, s);
        self.mix(ids, weights, s);
    }

    /// Each expert's score into `s.weights_src` and what the choice is made on into `s.choice`
    /// (for the sqrt-softplus router; the other rules fill both in [`route`](Self::route)).
    fn scores(&self, logits: &[f32], bias: Option<&[f32]>, s: &mut RouteScratch) {
        let e = self.num_experts;
        s.choice.resize(e, 0.0);
        s.weights_src.resize(e, 0.0);
        for i in 0..e {
            // softplus as torch computes it: linear above 20, where exp would lose nothing.
            let l = logits[i];
            let sp = if l > 20.0 { l } else { l.exp().ln_1p() };
            let score = sp.sqrt();
            s.weights_src[i] = score;
            s.choice[i] = score + bias.map_or(0.0, |b| b[i]);
        }
    }

    /// The mixing weights of experts `ids` from `s.weights_src`: renormalised and scaled as
    /// the rule says.
    fn mix(&self, ids: &[u32], weights: &mut [f32], s: &RouteScratch) {
        for (w, &i) in weights.iter_mut().zip(ids.iter()) {
            *w = s.weights_src[i as usize];
        }
        if self.norm_topk_prob {
            let eps = if matches!(self.kind, Router::Softmax) { 0.0 } else { 1e-20 };
            let sum: f32 = weights.iter().sum::<f32>() + eps;
            for w in weights.iter_mut() {
                *w /= sum;
            }
        }
        if self.scaling != 1.0 {
            for w in weights.iter_mut() {
                *w *= self.scaling;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_low() {
        let mut out = [0u32; 3];
        top_k_indices(&[0.1, 0.5, 0.5, 0.9, -1.0], 3, &mut out);
        assert_eq!(out, [3, 1, 2]);
        let mut out = [0u32; 1];
        top_k_indices(&[2.0, 2.0], 1, &mut out);
        assert_eq!(out, [0]);
    }

    #[test]
    fn grouped_sigmoid_masks_to_zero_and_mixes_uncorrected_scores() {
        let moe = Moe {
            num_experts: 4,
            top_k: 2,
            intermediate_size: 1,
            router: Router::SigmoidGrouped { n_group: 2, topk_group: 1, correction_bias: true },
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
            shared_experts: None,
            router_logit_bias: false,
            expert_bias: false,
            expert_act: Default::default(),
            hash_layers: vec![],
        };
        let r = RouterRule::new(&moe);
        // Group 1 (experts 2, 3) wins on corrected scores; expert 0 is masked to 0 even though
        // expert 3's corrected score is negative, so 0 is picked second, as transformers does.
        let logits = [3.0, 3.0, 0.0, -5.0];
        let bias = [0.0, 0.0, 10.0, -1.0];
        let (mut ids, mut w) = ([0u32; 2], [0f32; 2]);
        r.route(&logits, Some(&bias), &mut ids, &mut w, &mut RouteScratch::default());
        assert_eq!(ids, [2, 0]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let total = s(0.0) + s(3.0);
        assert!((w[0] - 2.0 * s(0.0) / total).abs() < 1e-6);
        assert!((w[1] - 2.0 * s(3.0) / total).abs() < 1e-6);
    }
}
