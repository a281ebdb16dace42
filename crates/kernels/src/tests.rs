//! Every SIMD table against the scalar reference, and every kernel against exact (f64) math on
//! the dequantized weights and the unquantized activations, within the bound that activation
//! quantization allows.

use super::*;
use rand::{Rng, SeedableRng};

fn data(n: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let g: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 1.7;
            // A few outliers, as real activations have.
            if rng.random::<f32>() < 0.01 {
                g * 12.0
            } else {
                g
            }
        })
        .collect()
}

/// The bound on |quantized dot − exact dot|: each activation is off by at most half its block's
/// step (`d / 2`), so the error is at most Σ_blocks d/2 · Σ|w| in the block, plus f32 rounding
/// of the accumulation (relative 1e-5 of Σ|w·x|, generous for rows up to 8k).
fn bound(w: &[f32], x: &[f32], block: usize) -> f64 {
    let mut b = 0f64;
    for (wb, xb) in w.chunks(block).zip(x.chunks(block)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
        b += amax / 127.0 / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
    }
    let mag: f64 = w.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    b + 1e-5 * mag + 1e-6
}

#[test]
fn every_table_matches_scalar_and_the_exact_bound() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let tables = available();
    eprintln!("tables on this CPU: {:?}", tables.iter().map(|k| k.isa).collect::<Vec<_>>());
    let scalar = Kernels::scalar_table();
    for f in smoe_quant::ALL_FORMATS {
        // 352 columns are 11 blocks of 32: the eight-block kernels' tail (K-quants skip it).
        for cols in [256usize, 352, 512, 768, 2304, 4096 + 256] {
            if !f.fits(cols) {
                continue;
            }
            let rows = 3;
            let wf = data(rows * cols, &mut rng);
            let mut wq = vec![0u8; f.row_bytes(cols).unwrap() * rows];
            for (d, s) in wq.chunks_mut(f.row_bytes(cols).unwrap()).zip(wf.chunks(cols)) {
                smoe_quant::quantize(f, s, d).unwrap();
            }
            let mut wd = vec![0f32; rows * cols];
            smoe_quant::dequantize(f, &wq, &mut wd).unwrap();
            let x = data(2 * cols, &mut rng);
            let mut qa = QuantAct::default();
            qa.quantize(f, &x, 2, cols);
            let rb = f.row_bytes(cols).unwrap();
            for r in 0..rows {
                for t in 0..2 {
                    let (w, xr) = (&wd[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let exact: f64 = w.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let want = scalar.dot(f, &wq[r * rb..(r + 1) * rb], qa.row(t));
                    let block = match act_kind(f) {
                        ActKind::F32 => 1,
                        ActKind::Q8x32 => 32,
                        ActKind::Q8x256 => 256,
                    };
                    let b = if block == 1 {
                        1e-5 * w.iter().zip(xr).map(|(a, b)| (a * b).abs() as f64).sum::<f64>() + 1e-6
                    } else {
                        bound(w, xr, block)
                    };
                    assert!((want as f64 - exact).abs() <= b, "{f} cols {cols}: scalar {want} vs exact {exact} (bound {b})");
                    for k in &tables {
                        let got = k.dot(f, &wq[r * rb..(r + 1) * rb], qa.row(t));
                        // Same integer sums; only the float accumulation order differs.
                        let tol = 1e-5 * (want.abs() as f64 + w.iter().zip(xr).map(|(a, b)| (a * b).abs() as f64).sum::<f64>()) + 1e-6;
                        assert!((got as f64 - want as f64).abs() <= tol, "{} {f} cols {cols}: {got} vs scalar {want}", k.isa);
                    }
                }
            }
        }
    }
    for k in &tables {
        for n in [1usize, 7, 16, 33, 100, 1000] {
            let (a, b) = (data(n, &mut rng), data(n, &mut rng));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((k.dot_f32(&a, &b) as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "{} f32 dot n={n}", k.isa);
        }
    }
}

#[test]
fn attention_helpers_match_scalar() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for k in available() {
        for (heads, d) in [(1usize, 5usize), (8, 128), (3, 77), (16, 576)] {
            let q = data(heads * d, &mut rng);
            let key = data(d, &mut rng);
            let (mut a, mut b) = (vec![0f32; heads], vec![0f32; heads]);
            k.multi_dot(&q, &key, &mut a);
            attn::multi_dot(&q, &key, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-4 * (1.0 + y.abs()), "{} multi_dot {heads}x{d}", k.isa);
            }
            let w = data(heads, &mut rng);
            let (mut acc1, mut acc2) = (q.clone(), q.clone());
            k.multi_axpy(&mut acc1, &w, &key);
            attn::multi_axpy(&mut acc2, &w, &key);
            for (x, y) in acc1.iter().zip(&acc2) {
                assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "{} multi_axpy", k.isa);
            }
        }
    }
}

#[test]
fn many_token_kernels_match_single_dots() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let scalar = Kernels::scalar_table();
    for k in available() {
        for f in smoe_quant::ALL_FORMATS {
            if !k.has_gemm(f) {
                continue;
            }
            // Token counts with and without whole pairs of tiles (the 512-bit bodies) and odd tails.
            for (cols, n) in [(768usize, 19usize), (256, 8), (2048, 3), (512, 16), (768, 35)] {
                let rb = f.row_bytes(cols).unwrap();
                let x = data(cols, &mut rng);
                let mut w = vec![0u8; rb];
                smoe_quant::quantize(f, &x, &mut w).unwrap();
                let acts = data(n * cols, &mut rng);
                let mut qa = QuantAct::default();
                qa.quantize(f, &acts, n, cols);
                let tile = qa.tile();
                let mut out = vec![0f32; n];
                assert!(k.gemm_row(f, &w, &tile, &mut out));
                for t in 0..n {
                    let want = scalar.dot(f, &w, qa.row(t));
                    assert!((out[t] - want).abs() < 1e-4 * (1.0 + want.abs()), "{} {f} cols {cols} token {t}: {} vs {want}", k.isa, out[t]);
                }
                // Several rows at once, where the table has such a kernel: each row as alone.
                let rows: Vec<Vec<u8>> = (0..gemm::ROWS)
                    .map(|_| {
                        let mut w = vec![0u8; rb];
                        smoe_quant::quantize(f, &data(cols, &mut rng), &mut w).unwrap();
                        w
                    })
                    .collect();
                let mut many = vec![0f32; gemm::ROWS * n];
                let has_rows = k.gemm_rows(f, std::array::from_fn(|r| rows[r].as_slice()), &tile, &mut many);
                // Every x86 table has four-row Q4_K, Q2_K and Q3_K kernels (prefill's expert
                // products).
                let expert = matches!(f, Format::Q4_K | Format::Q2_K | Format::Q3_K);
                assert!(has_rows || !cfg!(target_arch = "x86_64") || !expert, "{} has no four-row {f} kernel", k.isa);
                if has_rows {
                    for (r, w) in rows.iter().enumerate() {
                        for t in 0..n {
                            let want = scalar.dot(f, w, qa.row(t));
                            let got = many[r * n + t];
                            assert!(
                                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                "{} {f} rows: row {r} token {t}: {got} vs {want}",
                                k.isa
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The low-bit and Q8_0 many-token and group kernels at the ends of their ranges, where a
/// narrower sum would overflow: every Q2_K quant 3 with scale and min 15, every Q3_K quant −4
/// with scale −32, every Q8_0 quant −128 (which ggml's quantizer never writes but a file may
/// hold: AVX2's sign trick takes its magnitude as 128) or 127 (and the opposite corners),
/// against activations of ±127 agreeing in sign with the weights or not.
#[test]
fn low_bit_many_token_kernels_hold_extreme_blocks() {
    use smoe_quant::blocks::{BlockQ2K, BlockQ3K, BlockQ8_0};
    let scalar = Kernels::scalar_table();
    let (cols, n) = (512usize, 19usize);
    let half = smoe_quant::half::F16Bytes::from_f32;
    let q2 = |qs: u8, scales: u8| BlockQ2K { scales: [scales; 16], qs: [qs; 64], d: half(0.01), dmin: half(0.02) };
    let q3 = |qs: u8, hmask: u8, scales: u8| BlockQ3K { hmask: [hmask; 32], qs: [qs; 64], scales: [scales; 12], d: half(0.01) };
    let rows: Vec<(Format, Vec<u8>)> = vec![
        (Format::Q2_K, bytemuck::cast_slice(&[q2(0xff, 0xff); 2]).to_vec()),
        (Format::Q2_K, bytemuck::cast_slice(&[q2(0x00, 0xf0); 2]).to_vec()),
        // Stored scale bits 0 are −32; all bits set is +31.
        (Format::Q3_K, bytemuck::cast_slice(&[q3(0x00, 0x00, 0x00); 2]).to_vec()),
        (Format::Q3_K, bytemuck::cast_slice(&[q3(0xff, 0xff, 0xff); 2]).to_vec()),
        (Format::Q8_0, bytemuck::cast_slice(&[BlockQ8_0 { d: half(0.01), qs: [-128; 32] }; 16]).to_vec()),
        (Format::Q8_0, bytemuck::cast_slice(&[BlockQ8_0 { d: half(0.01), qs: [127; 32] }; 16]).to_vec()),
    ];
    let mut checked = 0;
    for sign in [1.0f32, -1.0] {
        // Every token's activations are one magnitude: each quantizes to ±127.
        let acts: Vec<f32> = (0..n * cols).map(|i| sign * (1.0 + (i / cols) as f32)).collect();
        for k in available() {
            for (f, w) in &rows {
                if !k.has_gemm(*f) {
                    // Every x86 table has them (the caller below checks some ran).
                    assert!(!cfg!(target_arch = "x86_64") || k.isa == "scalar", "{} has no many-token {f} kernel", k.isa);
                    continue;
                }
                checked += 1;
                let mut qa = QuantAct::default();
                qa.quantize(*f, &acts, n, cols);
                let mut out = vec![0f32; n];
                assert!(k.gemm_row(*f, w, &qa.tile(), &mut out));
                let mut many = vec![0f32; gemm::ROWS * n];
                let has_rows = k.gemm_rows(*f, [w.as_slice(); gemm::ROWS], &qa.tile(), &mut many);
                // The one-token group kernel on eight rows alternating this corner and the
                // other of the same format.
                let other = &rows.iter().find(|(g, v)| g == f && v != w).expect("two corners per format").1;
                let eight: Vec<u8> = (0..8).flat_map(|r| if r % 2 == 0 { w.clone() } else { other.clone() }).collect();
                let mut inter = vec![0u8; eight.len()];
                smoe_quant::interleave::interleave(*f, &eight, 8, cols, &mut inter);
                assert!(k.has_group8(*f) || !cfg!(target_arch = "x86_64") || k.isa == "scalar", "{} has no {f} group kernel", k.isa);
                for t in 0..n {
                    let want = scalar.dot(*f, w, qa.row(t));
                    assert!((out[t] - want).abs() <= 1e-5 * want.abs().max(1.0), "{} {f} token {t}: {} vs {want}", k.isa, out[t]);
                    for r in 0..gemm::ROWS {
                        assert!(!has_rows || many[r * n + t] == out[t], "{} {f} rows: row {r} token {t}", k.isa);
                    }
                    let mut group = [0f32; 8];
                    k.dot_group8(*f, &inter, cols, qa.row(t), &mut group);
                    for (r, &got) in group.iter().enumerate() {
                        let want = scalar.dot(*f, if r % 2 == 0 { w } else { other }, qa.row(t));
                        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{} {f} group row {r} token {t}: {got} vs {want}", k.isa);
                    }
                }
            }
        }
    }
    assert!(checked > 0 || !cfg!(target_arch = "x86_64"), "no table ran the low-bit many-token kernels");
}

/// Many keys and values at once give, bit for bit, what one key or value at a time gives on
/// the same table (so prefill and decode attention agree exactly): row counts around the
/// tiles' four and eight, key counts around their three, value counts around the sums'
/// chunks of sixteen and thirty-two, widths with and without a tail or a last narrow tile.
#[test]
fn attention_tiles_match_one_key_at_a_time() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let shapes = [(1usize, 128usize, 1usize), (4, 64, 3), (8, 128, 17), (13, 100, 5), (64, 128, 40), (3, 7, 4), (6, 24, 2)];
    let more = [(9usize, 40usize, 70usize), (16, 128, 33), (17, 48, 31), (7, 136, 65)];
    for k in available() {
        for (rows, d, n) in shapes.into_iter().chain(more) {
            let stride = d + 5;
            let q = data(rows * d, &mut rng);
            let keys = data((n - 1) * stride + d, &mut rng);
            let (mut got, mut want) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            k.attn_scores(&q, d, &keys, stride, n, &mut got);
            for j in 0..n {
                k.multi_dot(&q, &keys[j * stride..j * stride + d], &mut want[j * rows..(j + 1) * rows]);
            }
            assert_eq!(got, want, "{} scores {rows}x{d}, {n} keys", k.isa);
            let p = data(n * rows, &mut rng);
            let acc0 = data(rows * d, &mut rng);
            let (mut got, mut want) = (acc0.clone(), acc0);
            k.attn_weighted_sum(&mut got, d, &p, &keys, stride, n);
            for j in 0..n {
                k.multi_axpy(&mut want, &p[j * rows..(j + 1) * rows], &keys[j * stride..j * stride + d]);
            }
            assert_eq!(got, want, "{} weighted sum {rows}x{d}, {n} values", k.isa);
            // f16 keys and values (an f16 KV cache): the bits of the f32 kernels on the values
            // widened.
            let half: Vec<u16> = keys.iter().map(|&x| smoe_quant::half::f32_to_f16_bits(x)).collect();
            let wide: Vec<f32> = half.iter().map(|&h| smoe_quant::half::f16_bits_to_f32(h)).collect();
            let (mut got, mut want) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            k.attn_scores_f16(&q, d, &half, stride, n, &mut got);
            k.attn_scores(&q, d, &wide, stride, n, &mut want);
            assert_eq!(got, want, "{} f16 scores {rows}x{d}, {n} keys", k.isa);
            let acc0 = data(rows * d, &mut rng);
            let (mut got, mut want) = (acc0.clone(), acc0);
            k.attn_weighted_sum_f16(&mut got, d, &p, &half, stride, n);
            k.attn_weighted_sum(&mut want, d, &p, &wide, stride, n);
            assert_eq!(got, want, "{} f16 weighted sum {rows}x{d}, {n} values", k.isa);
        }
    }
}

/// Products leave for their token rows unchanged, whatever the block sizes.
#[test]
fn scatter_tokens_transposes() {
    for k in available() {
        for (m, n) in [(3usize, 5usize), (8, 8), (13, 16), (24, 19), (64, 9), (1, 1)] {
            let src: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
            let mut out = vec![-1f32; n * m];
            let base = out.as_mut_ptr();
            // SAFETY: token t's row is out[t * m..(t + 1) * m], in bounds and disjoint from
            // every other token's; `out` is not otherwise touched while the call runs.
            k.scatter_tokens(&src, m, n, |t| unsafe { std::slice::from_raw_parts_mut(base.add(t * m), m) });
            for (t, row) in out.chunks_exact(m).enumerate() {
                let want: Vec<f32> = (0..m).map(|i| (i * n + t) as f32).collect();
                assert_eq!(row, want, "{} {m}x{n} token {t}", k.isa);
            }
        }
    }
}

/// Sixteen random rows of `f` and `cols`: as rows, interleaved (two groups), and bytes per row.
fn interleaved(f: Format, cols: usize, rng: &mut rand::rngs::StdRng) -> (Vec<u8>, Vec<u8>, usize) {
    let rb = f.row_bytes(cols).unwrap();
    let mut rows = vec![0u8; 16 * rb];
    for r in rows.chunks_mut(rb) {
        smoe_quant::quantize(f, &data(cols, rng), r).unwrap();
    }
    let mut inter = vec![0u8; rows.len()];
    smoe_quant::interleave::interleave(f, &rows, 16, cols, &mut inter);
    (rows, inter, rb)
}

/// Eight interleaved Q4_K, Q8_0, Q2_K or Q3_K rows at once give each row's own dot product, on every
/// table (x86 tables through their group kernels, the others through the de-interleaving
/// fallback).
#[test]
fn interleaved_group_kernels_match_row_dots() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let scalar = Kernels::scalar_table();
    let formats = [Format::Q4_K, Format::Q8_0, Format::Q2_K, Format::Q3_K];
    for (f, k) in formats.into_iter().flat_map(|f| available().into_iter().map(move |k| (f, k))) {
        assert!(k.has_group8(f) || k.isa == "scalar" || !cfg!(target_arch = "x86_64"), "{} has no {f} group kernel", k.isa);
        for cols in [256usize, 768, 2048] {
            let (rows, inter, rb) = interleaved(f, cols, &mut rng);
            let mut qa = QuantAct::default();
            qa.quantize(f, &data(cols, &mut rng), 1, cols);
            // Four tokens at once, where a table can: each token's bits as alone.
            let mut q4 = QuantAct::default();
            q4.quantize(f, &data(4 * cols, &mut rng), 4, cols);
            let mut four = [[0f32; 8]; 4];
            let [o0, o1, o2, o3] = &mut four;
            if k.dot_group8_x4(f, &inter[..8 * rb], cols, [q4.row(0), q4.row(1), q4.row(2), q4.row(3)], [o0, o1, o2, o3]) {
                for (t, got) in four.iter().enumerate() {
                    let mut alone = [0f32; 8];
                    k.dot_group8(f, &inter[..8 * rb], cols, q4.row(t), &mut alone);
                    assert_eq!(*got, alone, "{} {f} cols {cols}: token {t} of four", k.isa);
                }
            }
            // Two and three tokens at once (Q4_K): each token's bits as alone.
            for n in [2usize, 3] {
                let acts: Vec<_> = (0..n).map(|t| q4.row(t)).collect();
                let mut few = [[0f32; 8]; 3];
                let mut outs: Vec<&mut [f32; 8]> = few.iter_mut().take(n).collect();
                if k.dot_group8_few(f, &inter[..8 * rb], cols, &acts, &mut outs) {
                    for (t, got) in few.iter().take(n).enumerate() {
                        let mut alone = [0f32; 8];
                        k.dot_group8(f, &inter[..8 * rb], cols, q4.row(t), &mut alone);
                        assert_eq!(*got, alone, "{} {f} cols {cols}: token {t} of {n}", k.isa);
                    }
                } else {
                    assert!(f != Format::Q4_K || !k.has_group8(f), "{} has a Q4_K group kernel but none for {n} tokens", k.isa);
                }
            }
            for g in 0..2 {
                let mut out = [0f32; 8];
                k.dot_group8(f, &inter[g * 8 * rb..(g + 1) * 8 * rb], cols, qa.row(0), &mut out);
                for (r, &got) in out.iter().enumerate() {
                    let want = scalar.dot(f, &rows[(8 * g + r) * rb..(8 * g + r + 1) * rb], qa.row(0));
                    assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "{} cols {cols} row {}: {got} vs {want}", k.isa, 8 * g + r);
                }
            }
        }
    }
}

/// An interleaved group against many tokens, read as it lies (or taken apart, without a group
/// kernel), gives what the four-row kernel gives on the same rows taken apart (the same
/// arithmetic in the same order, so the same bits), and each row's own dot product; token
/// counts with and without pairs of tiles.
#[test]
fn interleaved_group_gemm_matches_rows_taken_apart() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let scalar = Kernels::scalar_table();
    // Every table as it is (each x86 table with its group kernel), and again without its group
    // kernel: the rows are then taken apart and go through the plain many-token kernels.
    let tables = available().into_iter().flat_map(|k| {
        assert!(
            [Format::Q4_K, Format::Q2_K, Format::Q3_K].iter().all(|&f| k.gemm_group8[crate::slot(f)].is_some())
                || k.isa == "scalar"
                || !cfg!(target_arch = "x86_64"),
            "{} has no many-token group kernel",
            k.isa
        );
        let mut plain = k.clone();
        plain.gemm_group8 = Default::default();
        [k, plain]
    });
    for (f, k) in tables.flat_map(|k| [Format::Q4_K, Format::Q8_0, Format::Q2_K, Format::Q3_K].map(|f| (f, k.clone()))) {
        for (cols, n) in [(256usize, 3usize), (768, 19), (2048, 16), (512, 35), (768, 8)] {
            let (rows, inter, rb) = interleaved(f, cols, &mut rng);
            let mut qa = QuantAct::default();
            qa.quantize(f, &data(n * cols, &mut rng), n, cols);
            let tile = qa.tile();
            for g in 0..2 {
                let mut got = vec![0f32; 8 * n];
                if !k.gemm_group8(f, &inter[g * 8 * rb..(g + 1) * 8 * rb], &tile, &mut got) {
                    assert!(!k.has_gemm(f), "{} has a many-token {f} kernel but no group product", k.isa);
                    continue;
                }
                let row = |r: usize| &rows[(8 * g + r) * rb..(8 * g + r + 1) * rb];
                let mut want = vec![0f32; 8 * n];
                assert!(k.gemm_block(f, &rows[8 * g * rb..(8 * g + 8) * rb], rb, &tile, &mut want));
                assert_eq!(got, want, "{} cols {cols} n {n} group {g}", k.isa);
                for r in 0..8 {
                    for t in 0..n {
                        let dot = scalar.dot(f, row(r), qa.row(t));
                        assert!((got[r * n + t] - dot).abs() < 1e-4 * (1.0 + dot.abs()), "{} row {r} token {t}", k.isa);
                    }
                }
            }
        }
    }
}

/// The AMX kernels' layouts, offsets and float order on any CPU with AVX-512: run on scalar
/// tile operations, the Q4_K and Q8_0 group products give the bits of the VNNI kernels on the
/// rows taken apart (where AMX is, `interleaved_group_gemm_matches_rows_taken_apart` checks
/// the instructions themselves through the `avx512-amx` table). Token counts with partial and
/// whole tiles; Q8_0 widths whose blocks are and are not a multiple of the four in flight.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_kernels_on_emulated_tiles_match_vnni() {
    let Some(vnni) = crate::x86::avx512_table() else {
        eprintln!("no AVX-512 VNNI here: the AMX kernels' emulation is not run");
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let mut ran = 0;
    for f in [Format::Q4_K, Format::Q8_0] {
        for (cols, n) in [(256usize, 3usize), (768, 19), (2048, 16), (512, 35), (352, 9)] {
            let Ok(rb) = f.row_bytes(cols) else { continue };
            if f == Format::Q4_K && cols % 256 != 0 {
                continue;
            }
            let (rows, inter, _) = interleaved(f, cols, &mut rng);
            let mut qa = QuantAct::default();
            qa.quantize(f, &data(n * cols, &mut rng), n, cols);
            let tile = qa.tile();
            for g in 0..2 {
                let mut got = vec![0f32; 8 * n];
                if !crate::x86::amx::emulated(f, &inter[g * 8 * rb..(g + 1) * 8 * rb], &tile, &mut got) {
                    continue;
                }
                let mut want = vec![0f32; 8 * n];
                assert!(vnni.gemm_block(f, &rows[8 * g * rb..(8 * g + 8) * rb], rb, &tile, &mut want));
                assert_eq!(got, want, "{f} cols {cols} n {n} group {g}");
                ran += 1;
            }
        }
    }
    assert!(ran > 0, "AVX-512 VNNI without the features the AMX kernels use");
}

/// `dot_rows` gives each row's own dot product, whatever kernel it runs (the four-row Q8_0
/// kernel where a table has one): row counts that are and are not multiples of four, and
/// widths with a tail of fewer than eight blocks.
#[test]
fn dot_rows_match_row_dots() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let scalar = Kernels::scalar_table();
    for f in [Format::Q8_0, Format::Q4_0, Format::Q4_K, Format::Q2_K, Format::Q3_K] {
        for k in available() {
            for cols in [256usize, 352, 2048] {
                let Ok(rb) = f.row_bytes(cols) else { continue };
                for n in [1usize, 4, 7, 8, 13] {
                    let mut w = vec![0u8; n * rb];
                    for r in w.chunks_mut(rb) {
                        smoe_quant::quantize(f, &data(cols, &mut rng), r).unwrap();
                    }
                    let mut qa = QuantAct::default();
                    qa.quantize(f, &data(cols, &mut rng), 1, cols);
                    let mut out = vec![0f32; n];
                    k.dot_rows(f, &w, rb, qa.row(0), &mut out);
                    for (r, &got) in out.iter().enumerate() {
                        let want = scalar.dot(f, &w[r * rb..(r + 1) * rb], qa.row(0));
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{} {f} cols {cols} rows {n} row {r}: {got} vs {want}",
                            k.isa
                        );
                    }
                }
            }
        }
    }
}

/// Every table's softmax terms: `exp(v - m)` within 2 ulp of the standard library's over the
/// range softmax sees (0 below -87.3), sums accumulated, and a value's result independent of
/// where it sits in the slice (vector lanes and the one-by-one tail agree).
#[test]
fn softmax_terms_are_exp_to_two_ulp_wherever_a_value_sits() {
    let xs: Vec<f32> = (0..4001).map(|i| -90.0 * i as f32 / 4000.0).chain([0.0, -1e-8, -0.5, -87.0, -87.4, -200.0]).collect();
    for k in available() {
        for len in [1usize, 3, 8, 13] {
            for start in 0..=xs.len().saturating_sub(len) {
                let x = &xs[start..start + len];
                let mut v: Vec<f32> = x.iter().map(|x| x + 2.5).collect();
                let m = vec![2.5f32; len];
                let mut sum = vec![1.0f32; len];
                k.softmax_terms(&mut v, &m, &mut sum);
                for i in 0..len {
                    let want = ((x[i] + 2.5) - 2.5).exp();
                    let tol = if x[i] < -87.0 { 1.3e-38 } else { want * 2.4e-7 };
                    assert!((v[i] - want).abs() <= tol, "{} exp({}) = {} want {want}", k.isa, x[i], v[i]);
                    assert_eq!(sum[i], 1.0 + v[i]);
                }
                // The same value alone gives the same bits.
                let mut one = [x[0] + 2.5];
                k.softmax_terms(&mut one, &m[..1], &mut [0.0]);
                assert_eq!(one[0], v[0], "{}: lane and tail differ at {}", k.isa, x[0]);
            }
        }
    }
}

/// The AVX2 quantizers give exactly the scalar ones' blocks: scales, quants, sums, on ordinary
/// activations and on the edges (all zero, ties at .5 steps, a block's largest value, ±inf,
/// NaN, denormals).
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_quantizers_give_the_scalar_bits() {
    if !std::arch::is_x86_feature_detected!("avx2") {
        eprintln!("no AVX2 on this CPU: nothing to compare");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut inputs: Vec<Vec<f32>> = (0..40).map(|_| data(1024, &mut rng)).collect();
    inputs.push(vec![0.0; 1024]);
    // Values on exact half steps in blocks (of 32, hence of 256 too) whose largest value is 127:
    // the scale is 1, and every other value is a tie.
    inputs.push((0..1024).map(|i| if i % 32 == 0 { 127.0 } else { ((i % 254) as f32 - 127.0) + 0.5 }).collect());
    let mut edge = data(1024, &mut rng);
    for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -0.0, f32::MAX].into_iter().enumerate() {
        edge[300 * i % 1024] = v;
    }
    inputs.push(edge);
    inputs.push((0..1024).map(|i| if i % 3 == 0 { f32::NAN } else { 1e-39 * i as f32 }).collect());
    // The same with negative values: an infinite scale saturates them to -128.
    inputs.push((0..1024).map(|i| -1e-39 * i as f32).collect());
    let bits32 = |b: &[act::Block32]| b.iter().map(|b| (b.d.to_bits(), b.s.to_bits(), b.isum, b.qs)).collect::<Vec<_>>();
    let bits256 = |b: &[act::Block256]| b.iter().map(|b| (b.d.to_bits(), b.qs, b.bsums)).collect::<Vec<_>>();
    for x in &inputs {
        let (mut a, mut b) = (vec![act::Block32::ZERO; 32], vec![act::Block32::ZERO; 32]);
        act::quantize_32_scalar(x, &mut a);
        // SAFETY: AVX2 checked above.
        unsafe { x86::act_avx2::quantize_32(x, &mut b) };
        assert_eq!(bits32(&a), bits32(&b));
        let (mut a, mut b) = (vec![act::Block256::ZERO; 4], vec![act::Block256::ZERO; 4]);
        act::quantize_256_scalar(x, &mut a);
        // SAFETY: AVX2 checked above.
        unsafe { x86::act_avx2::quantize_256(x, &mut b) };
        assert_eq!(bits256(&a), bits256(&b));
    }
}

/// Every table's `silu(g) · u` is within a few ulp of the libm formula, NaN stays NaN, the
/// limits hold far out, and a value gives the same bits in a SIMD lane and in the tail.
#[test]
fn silu_mul_matches_the_formula_wherever_a_value_sits() {
    let mut gs: Vec<f32> = (0..4001).map(|i| -100.0 + 200.0 * i as f32 / 4000.0).collect();
    gs.extend([0.0, -0.0, 1e-30, -1e-30, 87.5, 88.5, 88.8, -88.0, -88.9, -150.0, 150.0, f32::INFINITY, f32::NEG_INFINITY]);
    for k in available() {
        for len in [1usize, 7, 8, 13] {
            for start in 0..=gs.len() - len {
                let g0 = &gs[start..start + len];
                let u: Vec<f32> = (0..len).map(|i| 0.75 - 0.1 * i as f32).collect();
                let mut g = g0.to_vec();
                k.silu_mul(&mut g, &u);
                for i in 0..len {
                    let want = (g0[i] as f64 / (1.0 + (-g0[i] as f64).exp()) * u[i] as f64) as f32;
                    // Below g ≈ -76 the outputs are under 1e-36, where only the absolute floor applies.
                    let tol = (want.abs() * 6e-7).max(1e-36);
                    let same = g[i] == want || (g[i].is_nan() && want.is_nan());
                    assert!(same || (g[i] - want).abs() <= tol, "{} silu({})·{} = {} want {want}", k.isa, g0[i], u[i], g[i]);
                }
                let mut one = [g0[0]];
                k.silu_mul(&mut one, &u[..1]);
                assert_eq!(one[0].to_bits(), g[0].to_bits(), "{}: lane and tail differ at {}", k.isa, g0[0]);
            }
        }
        let mut nan = [f32::NAN; 9];
        k.silu_mul(&mut nan, &[1.0; 9]);
        assert!(nan.iter().all(|v| v.is_nan()), "{}: NaN in, NaN out", k.isa);
    }
}

/// A prefetch past the end of a buffer (the kernels prefetch a fixed distance ahead of the
/// block they read, beyond the matrix at its end) neither faults nor changes memory; Intel
/// CPUs get a distance, others none unless `SMOE_PREFETCH_BYTES` says.
#[cfg(target_arch = "x86_64")]
#[test]
fn prefetches_past_a_buffer_are_harmless() {
    let buf = [7u8; 100];
    for (dist, hint) in [0, 64, 2304, 1 << 20, 1 << 40].into_iter().flat_map(|d| (0..4).map(move |h| (d, h))) {
        x86::prefetch_ahead(buf.as_ptr(), x86::Prefetch { bytes: dist, hint }, 1152);
    }
    x86::prefetch_ahead(std::ptr::null(), x86::Prefetch { bytes: 2304, hint: 3 }, 1152);
    assert!(buf.iter().all(|&b| b == 7));
    if std::env::var_os("SMOE_PREFETCH_BYTES").is_none() {
        assert_eq!(x86::prefetch().bytes > 0, x86::is_intel());
    }
}

/// Asking for rows of a buffer ahead of use reads nothing that is not there: rows past its
/// end or longer than it are cut, and the buffer is unchanged.
#[test]
fn prefetch_rows_stays_inside_its_buffer() {
    let buf = vec![1.5f32; 1000];
    prefetch_rows(&buf, 512, 8, 128);
    prefetch_rows(&buf, 100, 3, 5000);
    prefetch_rows(&[], 4, 4, 4);
    assert!(buf.iter().all(|&v| v == 1.5));
}

/// fp16 conversions give the scalar (the `half` crate's) bits on every table: every fp16 value
/// widened, and f32 values around every rounding case narrowed (halfway points, subnormals,
/// overflow, infinities; NaN stays NaN).
#[test]
fn f16_conversions_match_scalar() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut vals: Vec<f32> = data(4099, &mut rng).iter().map(|v| v * 1000.0).collect();
    for h in (0..=u16::MAX).step_by(7) {
        let v = smoe_quant::half::f16_bits_to_f32(h);
        // The value itself, the halfway point to its neighbour, and just either side of it.
        let half_up = f32::from_bits(v.to_bits() + (1 << 12));
        vals.extend([v, half_up, f32::from_bits(half_up.to_bits() + 1), f32::from_bits(half_up.to_bits() - 1)]);
    }
    vals.extend([65504.0, 65520.0, 65519.99, 1e9, -1e9, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-8, -6e-8, 0.0, -0.0]);
    let (mut want_w, mut want_n) = (vec![0f32; all.len()], vec![0u16; vals.len()]);
    crate::scalar::widen_f16(&all, 1, all.len(), 0, &mut want_w);
    crate::scalar::narrow_f16(&vals, &mut want_n);
    for k in available() {
        let mut got = vec![0f32; all.len()];
        k.f16_rows_to_f32(&all, 1, all.len(), 0, &mut got);
        for (i, (g, w)) in got.iter().zip(&want_w).enumerate() {
            assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{} widen {i:#x}: {g} vs {w}", k.isa);
        }
        // Rows of every width around the vector lengths, strided.
        for (n, len, stride) in [(3usize, 128usize, 517usize), (5, 7, 9), (4, 17, 40), (2, 33, 33), (1, 1, 1)] {
            let mut got = vec![0f32; n * len];
            k.f16_rows_to_f32(&all[1000..], n, len, stride, &mut got);
            for (r, row) in got.chunks(len).enumerate() {
                let want = &want_w[1000 + r * stride..][..len];
                assert!(
                    row.iter().zip(want).all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())),
                    "{} rows {n}x{len}",
                    k.isa
                );
            }
        }
        let mut got = vec![0u16; vals.len()];
        k.f32_to_f16(&vals, &mut got);
        for ((g, w), v) in got.iter().zip(&want_n).zip(&vals) {
            let nan = |h: u16| h & 0x7c00 == 0x7c00 && h & 0x3ff != 0;
            assert!(g == w || (nan(*g) && nan(*w)), "{} narrow {v:e}: {g:#x} vs {w:#x}", k.isa);
        }
    }
}
