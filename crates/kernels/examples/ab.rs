//! A/B of kernel variants on the decode shape: two threads, each streaming its half of a
//! matrix larger than the caches, rounds interleaved, median GB/s per variant.
//! `cargo run --release -p smoe-kernels --example ab`
#[cfg(target_arch = "x86_64")]
mod common;
#[cfg(target_arch = "x86_64")]
fn main() {
    use smoe_kernels::act::{Block256, Block32};
    use smoe_kernels::x86::{avx2, avx512};
    use smoe_quant::Format;
    let cols: usize = std::env::var("COLS").ok().and_then(|c| c.parse().ok()).unwrap_or(2048);
    let rounds = 15;
    type F256 = unsafe fn(&[u8], &[Block256]) -> f32;
    type F32b = unsafe fn(&[u8], &[Block32]) -> f32;
    enum V {
        K(F256),
        Q(F32b),
    }
    let sets: Vec<(Format, Vec<(&str, V)>)> = vec![
        (
            Format::Q8_0,
            vec![
                ("q8_0 pf1024", V::Q(avx512::dot_q8_0_ahead::<1024>)),
                ("q8_0 pf2048", V::Q(avx512::dot_q8_0_ahead::<2048>)),
                ("q8_0 pf4096", V::Q(avx512::dot_q8_0_ahead::<4096>)),
                ("q8_0 pf8192", V::Q(avx512::dot_q8_0_ahead::<8192>)),
            ],
        ),
        (
            Format::Q4_K,
            vec![
                ("q4_k pf2048", V::K(avx2::dot_q4_k_ahead::<2048>)),
                ("q4_k pf4096", V::K(avx2::dot_q4_k_ahead::<4096>)),
                ("q4_k pf1024", V::K(avx2::dot_q4_k_ahead::<1024>)),
            ],
        ),
    ];
    for (f, vars) in sets {
        let mb: usize = std::env::var("MB").ok().and_then(|c| c.parse().ok()).unwrap_or(512);
        let reps = (512 / mb).max(1);
        let (w, rows, rb, act) = common::repeated_matrix(f, cols, mb << 20);
        let mut times = vec![Vec::new(); vars.len()];
        for _ in 0..rounds {
            for (vi, (_, v)) in vars.iter().enumerate() {
                let t = std::time::Instant::now();
                std::thread::scope(|s| {
                    for half in 0..2 {
                        let (w, act, v) = (&w, &act, v);
                        s.spawn(move || {
                            for _ in 0..reps {
                                let mut acc = 0f32;
                                for r in half * rows / 2..(half + 1) * rows / 2 {
                                    let wr = &w[r * rb..(r + 1) * rb];
                                    // SAFETY: the example runs only where the table says the CPU has AVX-512 VNNI.
                                    acc += unsafe {
                                        match (v, act.row(0)) {
                                            (V::K(k), smoe_kernels::ActRow::Q256(a)) => k(wr, a),
                                            (V::Q(k), smoe_kernels::ActRow::Q32(a)) => k(wr, a),
                                            _ => unreachable!(),
                                        }
                                    };
                                }
                                std::hint::black_box(acc);
                            }
                        });
                    }
                });
                times[vi].push(t.elapsed().as_secs_f64());
            }
        }
        for (vi, (name, _)) in vars.iter().enumerate() {
            let t = &mut times[vi];
            t.sort_by(f64::total_cmp);
            println!(
                "{name:14} median {:5.1} GB/s  best {:5.1}",
                (reps * rows * rb) as f64 / t[t.len() / 2] / 1e9,
                (reps * rows * rb) as f64 / t[0] / 1e9
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {}
