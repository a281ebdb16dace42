//! Kernel throughput on one core over a matrix larger than the caches:
//! `cargo run --release -p smoe-kernels --example kspeed`. `KSPEED_KIB=N` sizes the matrix
//! instead (e.g. 512: in L2, the instructions' speed without memory's), passes repeated to
//! read 256 MiB in all.
use smoe_kernels::{available, QuantAct};

fn main() {
    let cols: usize = std::env::var("KSPEED_COLS").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
    // Optional arguments: the formats to measure (all by default).
    let only: Vec<String> = std::env::args().skip(1).collect();
    for f in smoe_quant::ALL_FORMATS.into_iter().filter(|f| only.is_empty() || only.contains(&f.to_string())) {
        let rb = f.row_bytes(cols).unwrap();
        let bytes = std::env::var("KSPEED_KIB").ok().and_then(|v| v.parse::<usize>().ok()).map_or(256 << 20, |k| k << 10);
        let (rows, passes) = (bytes / rb, (256 << 20) / bytes.max(1));
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
        let row: Vec<f32> = (0..cols).map(|i| ((i * 104729 % 997) as f32 - 498.0) / 400.0).collect();
        let mut one = vec![0u8; rb];
        smoe_quant::quantize(f, &row, &mut one).unwrap();
        // One row repeated: content does not change a kernel's speed.
        let w: Vec<u8> = one.iter().copied().cycle().take(rb * rows).collect();
        let mut act = QuantAct::default();
        act.quantize(f, &x, 1, cols);
        for k in available() {
            let t = std::time::Instant::now();
            let mut s = 0f32;
            for _ in 0..passes {
                for r in 0..rows {
                    s += k.dot(f, &w[r * rb..(r + 1) * rb], act.row(0));
                }
            }
            let secs = t.elapsed().as_secs_f64();
            let done = rows * passes;
            println!("{f} {:12}: {:6.1} GB/s  ({:.1} Mrows/s) [{s:.1}]", k.isa, (done * rb) as f64 / secs / 1e9, done as f64 / secs / 1e6);
            if k.has_group8(f) && smoe_quant::interleave::supported(f, rows / 8 * 8, cols) {
                // The same rows interleaved by eight, as the engine lays out dense and expert
                // matrices for these kernels.
                let rows = rows / 8 * 8;
                let mut inter = vec![0u8; rows * rb];
                smoe_quant::interleave::interleave(f, &w[..rows * rb], rows, cols, &mut inter);
                let t = std::time::Instant::now();
                let mut out = [0f32; 8];
                let mut s = 0f32;
                for _ in 0..passes {
                    for g in 0..rows / 8 {
                        k.dot_group8(f, &inter[g * 8 * rb..(g + 1) * 8 * rb], cols, act.row(0), &mut out);
                        s += out[0];
                    }
                }
                let secs = t.elapsed().as_secs_f64();
                println!(
                    "{f} {:12}: {:6.1} GB/s  ({:.1} Mrows/s) [{s:.1}] eight interleaved rows at a time",
                    k.isa,
                    (rows * passes * rb) as f64 / secs / 1e9,
                    (rows * passes) as f64 / secs / 1e6
                );
                // Four tokens a call where the format has that kernel (a batch's dense products):
                // the weights read once for the four, so GMAC/s is the figure to compare.
                let mut act4 = QuantAct::default();
                let x4: Vec<f32> = (0..4 * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
                act4.quantize(f, &x4, 4, cols);
                let mut o = [[0f32; 8]; 4];
                let t = std::time::Instant::now();
                let mut ran = true;
                for _ in 0..passes {
                    for g in 0..rows / 8 {
                        let [o0, o1, o2, o3] = &mut o;
                        let a = [act4.row(0), act4.row(1), act4.row(2), act4.row(3)];
                        ran &= k.dot_group8_x4(f, &inter[g * 8 * rb..(g + 1) * 8 * rb], cols, a, [o0, o1, o2, o3]);
                        s += o[3][0];
                    }
                }
                let secs = t.elapsed().as_secs_f64();
                if ran {
                    println!(
                        "{f} {:12}: {:6.1} GMAC/s [{s:.1}] eight interleaved rows, four tokens at a time",
                        k.isa,
                        (4 * rows * passes * cols) as f64 / secs / 1e9
                    );
                }
                // Two and three tokens a call where the format has those kernels (a batch's
                // experts chosen by a few of its tokens).
                if k.has_group8_few(f) {
                    for m in [2usize, 3] {
                        let t = std::time::Instant::now();
                        for _ in 0..passes {
                            for g in 0..rows / 8 {
                                let [o0, o1, o2, _] = &mut o;
                                let a = [act4.row(0), act4.row(1), act4.row(2)];
                                let group = &inter[g * 8 * rb..(g + 1) * 8 * rb];
                                match m {
                                    2 => k.dot_group8_few(f, group, cols, &a[..2], &mut [o0, o1]),
                                    _ => k.dot_group8_few(f, group, cols, &a, &mut [o0, o1, o2]),
                                };
                                s += o[1][0];
                            }
                        }
                        let secs = t.elapsed().as_secs_f64();
                        let gb = (rows * passes * rb) as f64 / secs / 1e9;
                        println!(
                            "{f} {:12}: {gb:6.1} GB/s  ({:6.1} GMAC/s) [{s:.1}] eight interleaved rows, {m} tokens at a time",
                            k.isa,
                            m as f64 * (rows * passes * cols) as f64 / secs / 1e9
                        );
                    }
                }
            }
        }
    }
}

/// Two threads running the Q8_0 kernel on separate matrices, no coordination: the hardware's
/// own scaling for this kernel.
#[allow(dead_code)]
pub fn two_free_threads() {}
