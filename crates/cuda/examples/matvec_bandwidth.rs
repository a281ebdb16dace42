//! Decode mat-vec bandwidth on the GPU: a Q8_0 matrix the size of a large model's projection,
//! read once per token. `cargo run --release -p smoe-cuda --example matvec_bandwidth`.

fn main() {
    let gpu = match smoe_cuda::Gpu::open(0) {
        Ok(g) => g,
        Err(why) => {
            eprintln!("no usable GPU: {why}");
            std::process::exit(1);
        }
    };
    println!("{}", gpu.info);
    for (rows, cols) in [(4096usize, 4096usize), (16384, 7168), (65536, 7168)] {
        let bytes: Vec<u8> = (0..rows * cols / 32 * 34)
            .map(|i| {
                if i % 34 == 1 {
                    0x3c
                } else if i % 34 == 0 {
                    0
                } else {
                    (i * 7 % 251) as u8
                }
            })
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
        let m = gpu.upload_q8_0(&bytes, rows, cols).expect("upload");
        gpu.matvec_q8_0(&m, &x, 10).expect("warm-up");
        let reps = 200;
        let (_, secs) = gpu.matvec_q8_0(&m, &x, reps).expect("matvec");
        let gbs = (bytes.len() * reps) as f64 / secs / 1e9;
        println!(
            "Q8_0 {rows} x {cols} ({:.0} MiB): {:.1} us per mat-vec, {gbs:.0} GB/s",
            bytes.len() as f64 / (1 << 20) as f64,
            secs / reps as f64 * 1e6
        );
    }
}
