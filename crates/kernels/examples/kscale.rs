//! Hardware scaling of one kernel: N threads, each streaming its own matrices, no coordination.
use smoe_kernels::{best, QuantAct};
use smoe_quant::Format;

fn main() {
    let f = Format::Q8_0;
    let cols = 2048;
    let rb = f.row_bytes(cols).unwrap();
    let rows = (256 << 20) / rb;
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
    for threads in [1, 2] {
        let t = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let w: Vec<u8> = (0..rb * rows).map(|i| (i % 251) as u8 & 0x3f).collect();
                    let mut act = QuantAct::default();
                    act.quantize(f, &x, 1, cols);
                    let k = best();
                    let t0 = std::time::Instant::now();
                    let mut s = 0f32;
                    for _ in 0..3 {
                        for r in 0..rows {
                            s += k.dot(f, &w[r * rb..(r + 1) * rb], act.row(0));
                        }
                    }
                    let secs = t0.elapsed().as_secs_f64();
                    println!("  thread: {:.1} GB/s [{s}]", (3 * rows * rb) as f64 / secs / 1e9);
                });
            }
        });
        let _ = t;
    }
}
