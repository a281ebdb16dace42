//! Decode attention over an f32 vs an f16 KV cache at Qwen3-30B-A3B's shape (32 query heads,
//! 4 KV heads of 128), one layer, one core: time per token and error against f64 math on the
//! f32 cache. `cargo run --release -p smoe-kernels --example kv_precision`.
use smoe_kernels::{attn::f16, best};
use smoe_quant::half::F16Bytes;

const HEADS: usize = 32;
const KV_HEADS: usize = 4;
const D: usize = 128;

fn half(x: f32) -> u16 {
    u16::from_le_bytes(F16Bytes::from_f32(x).0)
}

/// One token's attention for every KV head; `dot`/`axpy` read position `p` of the cache.
fn attend(
    q: &[f32],
    ctx: usize,
    out: &mut [f32],
    dot: impl Fn(usize, usize, &[f32], &mut [f32]),
    axpy: impl Fn(usize, usize, &mut [f32], &[f32]),
) {
    let g = HEADS / KV_HEADS;
    let scale = 1.0 / (D as f32).sqrt();
    let mut scores = vec![0f32; g * ctx];
    let mut s = vec![0f32; g];
    let mut w = vec![0f32; g];
    for kvh in 0..KV_HEADS {
        let qg = &q[kvh * g * D..(kvh + 1) * g * D];
        for p in 0..ctx {
            dot(kvh, p, qg, &mut s);
            for h in 0..g {
                scores[h * ctx + p] = s[h] * scale;
            }
        }
        for h in 0..g {
            let row = &mut scores[h * ctx..(h + 1) * ctx];
            let m = row.iter().fold(f32::MIN, |a, &b| a.max(b));
            let z: f32 = row
                .iter_mut()
                .map(|x| {
                    *x = (*x - m).exp();
                    *x
                })
                .sum();
            row.iter_mut().for_each(|x| *x /= z);
        }
        let acc = &mut out[kvh * g * D..(kvh + 1) * g * D];
        acc.fill(0.0);
        for p in 0..ctx {
            for h in 0..g {
                w[h] = scores[h * ctx + p];
            }
            axpy(kvh, p, acc, &w);
        }
    }
}

fn main() {
    let k = best();
    let val = |i: usize| ((i.wrapping_mul(2_654_435_761) % 2001) as f32 - 1000.0) / 700.0;
    for ctx in [512usize, 4096, 16384] {
        let n = ctx * KV_HEADS * D;
        let (keys, values): (Vec<f32>, Vec<f32>) = ((0..n).map(val).collect(), (0..n).map(|i| val(i + 7)).collect());
        let (k16, v16): (Vec<u16>, Vec<u16>) = (keys.iter().map(|&x| half(x)).collect(), values.iter().map(|&x| half(x)).collect());
        let q: Vec<f32> = (0..HEADS * D).map(|i| val(i + 13)).collect();
        let at = |kvh: usize, p: usize| (p * KV_HEADS + kvh) * D;
        let mut exact = vec![0f32; HEADS * D];
        attend(
            &q,
            ctx,
            &mut exact,
            |kvh, p, qg, s| {
                for (h, o) in s.iter_mut().enumerate() {
                    *o = (0..D).map(|i| qg[h * D + i] as f64 * keys[at(kvh, p) + i] as f64).sum::<f64>() as f32;
                }
            },
            |kvh, p, acc, w| {
                for (h, &wh) in w.iter().enumerate() {
                    for i in 0..D {
                        acc[h * D + i] = (acc[h * D + i] as f64 + wh as f64 * values[at(kvh, p) + i] as f64) as f32;
                    }
                }
            },
        );
        let err = |o: &[f32]| {
            let m = exact.iter().fold(0f32, |a, &b| a.max(b.abs()));
            o.iter().zip(&exact).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m
        };
        let mut o32 = vec![0f32; HEADS * D];
        let mut o16 = vec![0f32; HEADS * D];
        let (mut best32, mut best16) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            let t = std::time::Instant::now();
            attend(
                &q,
                ctx,
                &mut o32,
                |kvh, p, qg, s| k.multi_dot(qg, &keys[at(kvh, p)..at(kvh, p) + D], s),
                |kvh, p, acc, w| k.multi_axpy(acc, w, &values[at(kvh, p)..at(kvh, p) + D]),
            );
            best32 = best32.min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            attend(
                &q,
                ctx,
                &mut o16,
                |kvh, p, qg, s| f16::multi_dot(qg, &k16[at(kvh, p)..at(kvh, p) + D], s),
                |kvh, p, acc, w| f16::multi_axpy(acc, w, &v16[at(kvh, p)..at(kvh, p) + D]),
            );
            best16 = best16.min(t.elapsed().as_secs_f64());
        }
        println!(
            "ctx {ctx:6}: f32 KV {:7.3} ms ({:5.1} MiB read)  f16 KV {:7.3} ms ({:5.1} MiB)  f16/f32 time {:.2}  max rel err f32 {:.1e}  f16 {:.1e}",
            best32 * 1e3,
            (2 * n * 4) as f64 / (1 << 20) as f64,
            best16 * 1e3,
            (2 * n * 2) as f64 / (1 << 20) as f64,
            best16 / best32,
            err(&o32),
            err(&o16)
        );
    }
}
