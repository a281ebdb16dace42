//! Many-token kernel throughput (one core): `cargo run --release -p smoe-kernels --example gspeed
//! [TOKENS]` (32 by default: a prefill(512) expert's share). Rows one, four and eight
//! interleaved at a time, on every table this CPU has.
use smoe_kernels::{available, gemm::ROWS, QuantAct};
use smoe_quant::Format;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(32);
    let (rows, cols) = (768, 2048);
    for f in [Format::Q4_K, Format::Q8_0] {
        let rb = f.row_bytes(cols).unwrap();
        let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
        let mut w = vec![0u8; rows * rb];
        for (d, s) in w.chunks_mut(rb).zip(x.chunks(cols)) {
            smoe_quant::quantize(f, s, d).unwrap();
        }
        let mut inter = vec![0u8; w.len()];
        smoe_quant::interleave::interleave(f, &w, rows, cols, &mut inter);
        let a: Vec<f32> = (0..n * cols).map(|i| ((i * 104729 % 997) as f32 - 498.0) / 400.0).collect();
        let mut qa = QuantAct::default();
        qa.quantize(f, &a, n, cols);
        let tile = qa.tile();
        for k in available().into_iter().filter(|k| k.has_gemm(f)) {
            let mut out = vec![0f32; n];
            let reps = 20;
            let t = std::time::Instant::now();
            let mut s = 0f32;
            for _ in 0..reps {
                for r in 0..rows {
                    if k.gemm_row(f, &w[r * rb..(r + 1) * rb], &tile, &mut out) {
                        s += out[0];
                    } else {
                        for tk in 0..n {
                            s += k.dot(f, &w[r * rb..(r + 1) * rb], qa.row(tk));
                        }
                    }
                }
            }
            let secs = t.elapsed().as_secs_f64();
            let macs = (reps * rows * cols * n) as f64;
            println!("{f} {:12} gemm={}: {:6.1} GMAC/s [{s:.0}]", k.isa, k.has_gemm(f), macs / secs / 1e9);
            let t = std::time::Instant::now();
            for _ in 0..reps {
                for r in 0..rows {
                    for tk in 0..n {
                        s += k.dot(f, &w[r * rb..(r + 1) * rb], qa.row(tk));
                    }
                }
            }
            let secs = t.elapsed().as_secs_f64();
            println!("{f} {:12} dots:    {:6.1} GMAC/s [{s:.0}]", k.isa, macs / secs / 1e9);
            let mut many = vec![0f32; ROWS * n];
            let t = std::time::Instant::now();
            let mut has_rows = true;
            for _ in 0..reps {
                for r in (0..rows).step_by(ROWS) {
                    has_rows = k.gemm_rows(f, std::array::from_fn(|i| &w[(r + i) * rb..(r + i + 1) * rb]), &tile, &mut many);
                    if !has_rows {
                        break;
                    }
                    s += many[0];
                }
            }
            let secs = t.elapsed().as_secs_f64();
            // A table without the kernel returns at once: say so rather than print its "speed".
            match has_rows {
                true => println!("{f} {:12} {ROWS} rows: {:6.1} GMAC/s [{s:.0}]", k.isa, macs / secs / 1e9),
                false => println!("{f} {:12} {ROWS} rows: none in this table", k.isa),
            }
            let mut group = vec![0f32; 8 * n];
            let t = std::time::Instant::now();
            for _ in 0..reps {
                for g in (0..rows).step_by(8) {
                    k.gemm_group8(f, &inter[g * rb..(g + 8) * rb], &tile, &mut group);
                    s += group[0];
                }
            }
            let secs = t.elapsed().as_secs_f64();
            println!("{f} {:12} group:  {:6.1} GMAC/s [{s:.0}]", k.isa, macs / secs / 1e9);
            // The one-token group kernels as batched decode calls them: Q8_0 four tokens a
            // call, Q4_K two or three, the rest one at a time.
            let mut o8 = vec![[0f32; 8]; n];
            let t = std::time::Instant::now();
            for _ in 0..reps {
                for g in (0..rows).step_by(8) {
                    let grp = &inter[g * rb..(g + 8) * rb];
                    let mut tk = 0;
                    while f == Format::Q8_0 && tk + 4 <= n {
                        let [o0, o1, o2, o3, ..] = &mut o8[tk..] else { unreachable!() };
                        if !k.dot_group8_x4(f, grp, cols, std::array::from_fn(|i| qa.row(tk + i)), [o0, o1, o2, o3]) {
                            break;
                        }
                        tk += 4;
                    }
                    while f == Format::Q4_K && tk + 2 <= n {
                        // Arrays, not vectors: no allocation inside the timed loop.
                        let m = smoe_kernels::Kernels::group8_few_next(n - tk);
                        let a = [qa.row(tk), qa.row(tk + 1), qa.row(tk + m - 1)];
                        let done = match &mut o8[tk..] {
                            [o0, o1] => k.dot_group8_few(f, grp, cols, &a[..2], &mut [o0, o1]),
                            [o0, o1, o2, ..] if m == 3 => k.dot_group8_few(f, grp, cols, &a, &mut [o0, o1, o2]),
                            [o0, o1, ..] => k.dot_group8_few(f, grp, cols, &a[..2], &mut [o0, o1]),
                            _ => unreachable!(),
                        };
                        if !done {
                            break;
                        }
                        tk += m;
                    }
                    for tk in tk..n {
                        k.dot_group8(f, grp, cols, qa.row(tk), &mut o8[tk]);
                    }
                    s += o8[0][0];
                }
            }
            let secs = t.elapsed().as_secs_f64();
            println!("{f} {:12} decode-group: {:6.1} GMAC/s [{s:.0}]", k.isa, macs / secs / 1e9);
        }
    }
}
