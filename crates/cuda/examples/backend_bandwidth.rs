//! The CUDA backend's decode products against HBM bandwidth, per weight format, and host →
//! device copy bandwidth (pageable and page-locked): what a decode step and an expert upload
//! can reach. `cargo run --release -p smoe-cuda --example backend_bandwidth`.

use smoe_cuda::{CudaBackend, CudaOptions};
use smoe_engine::backend::Backend;
use smoe_quant::Format;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let b = match CudaBackend::open(0, &CudaOptions::default()) {
        Ok(b) => b,
        Err(why) => {
            eprintln!("no usable GPU: {why}");
            std::process::exit(1);
        }
    };
    println!("{}", b.describe());
    // An LM head, a dense projection and an expert's projection of Qwen3-30B-A3B's shape.
    for (rows, cols) in [(151936usize, 2048usize), (5120, 2048), (768, 2048)] {
        for format in [Format::Q8_0, Format::Q4_K, Format::Q6_K, Format::BF16] {
            let rb = format.row_bytes(cols).unwrap();
            let src: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0).collect();
            let mut row = vec![0u8; rb];
            smoe_quant::quantize(format, &src, &mut row).unwrap();
            let region = Arc::new(row.repeat(rows));
            let m = b.matrix(&region, 0, format, rows, cols);
            let mut x = b.buf("x", cols);
            b.upload(&mut x, &src);
            let mut out = b.buf("out", rows);
            let mut one = [0f32];
            b.matmul(&m, None, &x, 1, &mut out);
            b.download(&out, 0, &mut one);
            let reps = if rows > 100_000 { 50 } else { 500 };
            let t = Instant::now();
            for _ in 0..reps {
                b.matmul(&m, None, &x, 1, &mut out);
            }
            b.download(&out, 0, &mut one);
            let secs = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{format:?} {rows} x {cols} ({:.1} MiB): {:.1} us per mat-vec, {:.0} GB/s",
                region.len() as f64 / (1 << 20) as f64,
                secs * 1e6,
                region.len() as f64 / secs / 1e9
            );
        }
    }
    if let Some(f) = b.fault() {
        eprintln!("fault: {f}");
    }
    let (pageable, pinned) = smoe_cuda::copy_bandwidth(0, 256 << 20).expect("copies");
    println!("host -> device, 256 MiB: pageable {:.1} GB/s, page-locked {:.1} GB/s", pageable / 1e9, pinned / 1e9);
}
