//! Prefill attention tiles' throughput (one core): `cargo run --release -p smoe-kernels
//! --example aspeed [ROWS]` (64 by default: a prefill task's eight tokens by eight query
//! heads). Scores and weighted sums of one block of 128 cached positions, 128-wide heads, as
//! `Call::block_terms` runs them, in multiply-adds per second, on every table this CPU has.
use smoe_kernels::available;

fn main() {
    let rows: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    let (d, n, stride) = (128, 128, 4 * 128);
    let v = |n: usize| (0..n).map(|i| ((i * 7919 % 1999) as f32 / 1999.0 - 0.5) * 3.0).collect::<Vec<f32>>();
    let (q, keys, p) = (v(rows * d), v(n * stride), v(n * rows));
    let macs = (rows * n * d) as f64;
    for k in available() {
        let mut out = vec![0f32; n * rows];
        let mut acc = vec![0f32; rows * d];
        let reps = 2000;
        let (mut best_s, mut best_w) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                k.attn_scores(&q, d, &keys, stride, n, &mut out);
            }
            best_s = best_s.min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            for _ in 0..reps {
                k.attn_weighted_sum(&mut acc, d, &p, &keys, stride, n);
            }
            best_w = best_w.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{:<12} {rows} rows: scores {:6.1} GMAC/s, weighted sum {:6.1} GMAC/s  [{}]",
            k.isa,
            macs * reps as f64 / best_s / 1e9,
            macs * reps as f64 / best_w / 1e9,
            out[7] + acc[9]
        );
    }
}
