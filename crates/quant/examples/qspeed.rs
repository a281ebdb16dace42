//! Quantizer throughput on one core: `cargo run --release -p smoe-quant --example qspeed`.
fn main() {
    let n = 1 << 22;
    let x: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.618).sin() * 1000.0).fract()).collect();
    for f in [smoe_quant::Format::Q8_0, smoe_quant::Format::Q4_K, smoe_quant::Format::Q6_K, smoe_quant::Format::Q5_K] {
        let mut q = vec![0u8; f.row_bytes(n).unwrap()];
        let t = std::time::Instant::now();
        smoe_quant::quantize(f, &x, &mut q).unwrap();
        let s = t.elapsed().as_secs_f64();
        println!("{f}: {:.1} M values/s", n as f64 / s / 1e6);
    }
}
