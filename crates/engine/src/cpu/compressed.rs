//! DeepSeek-V4's compressed attention on the CPU: the compressor that turns closed windows of
//! raw rows into entries, and the attention of each query over its sliding window and the
//! entries it sees. The attention gathers each query's rows (window and entries, keys equal to
//! values) into a layer of its own and runs [`super::attention`]'s dense attention over it, as
//! [`super::sparse`] does for DeepSeek Sparse Attention.

use super::{kv_rows::KvRows, rms_scale, KvLayer};
use crate::backend::{AttnParams, CompressWindows, CompressedParams, KvShape};
use std::cell::RefCell;

thread_local! {
    /// One query's gathered rows.
    static GATHERED: RefCell<Option<KvLayer>> = const { RefCell::new(None) };
}

/// [`crate::Backend::compress_windows`] over the cache's layers.
pub(super) fn compress_windows(layers: &mut [KvLayer], c: CompressWindows<'_>) {
    let CompressWindows { raw_layer, entry_layer, first, count, rate, dim, overlap, bias, norm, eps, rope } = c;
    if count == 0 {
        return;
    }
    let cw = if overlap { 2 * dim } else { dim };
    assert_ne!(raw_layer, entry_layer, "compress_windows: raw rows and entries in one layer");
    // The raw rows are read while the entries are written, in place: two layers of the slice.
    let (raw, out) = if raw_layer < entry_layer {
        let (lo, hi) = layers.split_at_mut(entry_layer);
        (&lo[raw_layer], &mut hi[0])
    } else {
        let (lo, hi) = layers.split_at_mut(raw_layer);
        (&hi[0], &mut lo[entry_layer])
    };
    let row = 2 * cw;
    let earliest = if overlap { first.saturating_sub(1) * rate } else { first * rate };
    assert!(
        raw.base <= earliest && raw.base + raw.k.len() / row >= (first + count) * rate,
        "compress_windows: windows {first}..{} of a raw cache holding positions {}..{}",
        first + count,
        raw.base,
        raw.base + raw.k.len() / row
    );
    assert!(bias.len() >= rate * cw && norm.len() >= dim, "compress_windows: {} biases, {} norm weights", bias.len(), norm.len());
    assert_eq!(out.shape.heads * out.shape.k_dim, dim, "compress_windows: entries of {dim} into a layer of {}", out.shape.k_dim);
    let half = rope.cos.len() / count;
    let rot = 2 * half;
    assert!(rot <= dim, "compress_windows: {rot} rotated dimensions of {dim}");
    out.k.f32s_mut().resize((first + count) * dim, 0.0);
    // One slot of a channel: (gate + bias, kv) of position `pos`, the window's `i`-th, column `col`.
    let slot = |pos: usize, i: usize, col: usize| {
        let r = &raw.k.f32s()[(pos - raw.base) * row..][..row];
        (r[cw + col] + bias[i * cw + col], r[col])
    };
    for (wi, e) in out.k.f32s_mut()[first * dim..].chunks_exact_mut(dim).enumerate() {
        let w = first + wi;
        // With overlap, the previous window's first halves come first (window 0 has none).
        let prev = w.checked_sub(1).filter(|_| overlap).map(|p| p * rate);
        for (ch, o) in e.iter_mut().enumerate() {
            let col = if overlap { dim + ch } else { ch };
            let slots = || {
                (0..rate).filter_map(move |i| prev.map(|p0| slot(p0 + i, i, ch))).chain((0..rate).map(move |i| slot(w * rate + i, i, col)))
            };
            let max = slots().fold(f32::NEG_INFINITY, |m, s| m.max(s.0));
            let (mut num, mut den) = (0f32, 0f32);
            for (g, v) in slots() {
                let p = (g - max).exp();
                num += p * v;
                den += p;
            }
            *o = num / den;
        }
        let scale = rms_scale(e, eps);
        for (v, &g) in e.iter_mut().zip(norm) {
            *v *= scale * g;
        }
        // Interleaved pairs over the last `rot` dimensions, at the window's first position.
        super::rotate_pairs(&mut e[dim - rot..], &rope.cos[wi * half..][..half], &rope.sin[wi * half..][..half]);
    }
}

/// Dense attention of one query (its row of `q`) over a gathered layer into its output row.
pub(super) type AttendOne<'a> = &'a dyn Fn(&KvLayer, &[f32], AttnParams<'_>, &mut [f32]);

/// [`crate::Backend::attention_compressed`]: `attend(gathered, q row, params, out row)` runs one
/// query over its gathered rows (the backend's dense attention, at the query's precision).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_compressed(
    layers: &[KvLayer],
    layer: usize,
    q: &[f32],
    n: usize,
    pos0: usize,
    p: CompressedParams<'_>,
    out: &mut [f32],
    attend: AttendOne<'_>,
) {
    let window = &layers[layer];
    let d = window.shape.k_dim;
    let shape = KvShape { heads: 1, k_dim: d, v_dim: d, values_in_keys: true, keep: None, f16: false };
    let dense = AttnParams { q_heads: p.q_heads, scale: p.scale, window: None, sinks: Some(p.sinks), selected: None };
    let row = p.q_heads * d;
    GATHERED.with(|g| {
        let mut g = g.borrow_mut();
        let gl = g.get_or_insert_with(|| KvLayer { shape, k: KvRows::new(false), v: KvRows::new(false), base: 0 });
        gl.shape = shape;
        for t in 0..n {
            let pos = pos0 + t;
            gl.k.clear();
            let first = (pos + 1).saturating_sub(p.window);
            assert!(first >= window.base, "attention_compressed: position {first} was dropped (held from {})", window.base);
            gl.k.f32s_mut().extend_from_slice(&window.k.f32s()[(first - window.base) * d..(pos + 1 - window.base) * d]);
            if let Some((entry_layer, rate)) = p.entries {
                let (entries, seen) = (layers[entry_layer].k.f32s(), (pos + 1) / rate);
                match p.selected {
                    Some(sel) => {
                        for j in sel.of(t).filter(|&j| j < seen) {
                            gl.k.f32s_mut().extend_from_slice(&entries[j * d..][..d]);
                        }
                    }
                    None => gl.k.f32s_mut().extend_from_slice(&entries[..seen * d]),
                }
            }
            attend(gl, &q[t * row..][..row], dense, &mut out[t * row..][..row]);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeTables;

    #[test]
    fn compressed_entries_equal_the_plain_formula() {
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 2.0;
        for (overlap, rate, dim, first, count) in [(true, 4, 16, 0, 3), (true, 4, 16, 2, 2), (false, 8, 12, 1, 2)] {
            let cw = if overlap { 2 * dim } else { dim };
            let positions = (first + count) * rate;
            let raw: Vec<f32> = (0..positions * 2 * cw).map(val).collect();
            let bias: Vec<f32> = (0..rate * cw).map(|i| val(i + 77) * 0.5).collect();
            let norm: Vec<f32> = (0..dim).map(|i| 1.0 + val(i + 5) * 0.1).collect();
            let half = 2;
            let (cs, sn): (Vec<f32>, Vec<f32>) = (0..count * half).map(|i| ((i as f32 * 0.3).cos(), (i as f32 * 0.3).sin())).unzip();
            let shape = |w: usize| KvShape { heads: 1, k_dim: w, v_dim: 0, values_in_keys: true, keep: None, f16: false };
            let mut layers = vec![
                KvLayer { shape: shape(2 * cw), k: raw.clone().into(), v: KvRows::new(false), base: 0 },
                KvLayer { shape: shape(dim), k: vec![f32::NAN; first * dim].into(), v: KvRows::new(false), base: 0 },
            ];
            let c = CompressWindows {
                raw_layer: 0,
                entry_layer: 1,
                first,
                count,
                rate,
                dim,
                overlap,
                bias: &bias[..],
                norm: &norm[..],
                eps: 1e-6,
                rope: RopeTables { cos: &cs, sin: &sn, interleaved: true },
            };
            compress_windows(&mut layers, c);
            for wi in 0..count {
                let want = crate::conformance::compressed_entry(
                    &raw,
                    first + wi,
                    rate,
                    dim,
                    overlap,
                    &bias,
                    &norm,
                    &cs[wi * half..][..half],
                    &sn[wi * half..][..half],
                );
                let got = &layers[1].k.f32s()[(first + wi) * dim..][..dim];
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-5 * (1.0 + w.abs()), "overlap {overlap} window {}: {got:?} vs {want:?}", first + wi);
                }
            }
        }
    }
}
