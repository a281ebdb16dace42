//! Parallel matrix-vector throughput of the fast CPU path on matrices larger than the caches:
//! `cargo run --release -p smoe-engine --example mvspeed [THREADS...]` (default: 1 2), each
//! against the token counts of `MV_TOKENS` (`1,4,8`; default 1): a batch's or a short
//! prefill chunk's products.
use smoe_engine::backend::Backend;
use smoe_engine::{CpuBackend, Precision};
use smoe_quant::Format;
use std::sync::Arc;

fn main() {
    let mut counts: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("thread counts")).collect();
    if counts.is_empty() {
        counts = vec![1, 2];
    }
    let tokens: Vec<usize> =
        std::env::var("MV_TOKENS").map_or(vec![1], |v| v.split(',').map(|t| t.parse().expect("token counts")).collect());
    for threads in counts {
        let be = CpuBackend::with_threads(Precision::Fast, threads);
        for (f, rows, cols) in
            [(Format::Q8_0, 4096, 2048), (Format::Q8_0, 2048, 4096), (Format::Q4_K, 768, 2048), (Format::Q8_0, 151936, 2048)]
        {
            // Enough distinct matrices to defeat the caches.
            let rb = f.row_bytes(cols).unwrap();
            let copies = (512usize << 20) / (rb * rows) + 1;
            let row: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
            let mut one = vec![0u8; rb];
            smoe_quant::quantize(f, &row, &mut one).unwrap();
            let mut bytes: Vec<u8> = one.iter().copied().cycle().take(rb * rows * copies).collect();
            // Laid out as a model's dense weights are at load (Q8_0 interleaved where the CPU
            // has group kernels for it).
            let products: Vec<_> = (0..copies).map(|c| (c * rb * rows, f, rows, cols)).collect();
            be.prepare_dense(&mut bytes, &products);
            let region = Arc::new(bytes);
            let ms: Vec<_> = (0..copies).map(|c| be.matrix(&region, c * rb * rows, f, rows, cols)).collect();
            for &n in &tokens {
                let x = be.buf("x", n * cols);
                let mut out = be.buf("out", n * rows);
                let reps = (copies * 3).max(3);
                let t = std::time::Instant::now();
                for r in 0..reps {
                    be.matmul(&ms[r % copies], None, &x, n, &mut out);
                }
                let s = t.elapsed().as_secs_f64();
                println!(
                    "{threads} threads {f} {rows}x{cols}, {n} tokens: {:.1} GB/s, {:.0} us/call",
                    (rb * rows * reps) as f64 / s / 1e9,
                    s / reps as f64 * 1e6
                );
            }
        }
    }
}
