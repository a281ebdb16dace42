//! The bare device: probing, and the Q8_0 bandwidth probe kernel against plain f32 on the CPU
//! (the backend's ops are checked by tests/backend.rs). Without a usable GPU (CI has none) each
//! test says why and passes without running; on the GPU machine: `cargo test --release -p smoe-cuda`.

use smoe_cuda::{probe, Gpu};

fn gpu() -> Option<Gpu> {
    match probe() {
        Err(why) => {
            eprintln!("skipped: no usable GPU ({why})");
            None
        }
        Ok(devices) => {
            eprintln!("{}", devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("\n"));
            Some(Gpu::open(0).expect("a GPU the driver reports opens and compiles its kernels"))
        }
    }
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0).collect()
}

#[test]
fn probing_never_panics_and_explains_itself() {
    match probe() {
        Ok(devices) => assert!(!devices.is_empty()),
        Err(why) => assert!(!why.is_empty() && !why.contains('\n'), "one line: {why:?}"),
    }
}

/// The Q8_0 decode mat-vec against the dot products of the dequantized rows.
#[test]
fn q8_0_matvec_matches_the_dequantized_rows() {
    let Some(g) = gpu() else { return };
    use smoe_quant::Format;
    for (rows, cols) in [(1usize, 32usize), (7, 96), (300, 2048), (33, 7168)] {
        let wf = values(rows * cols, 5);
        let rb = Format::Q8_0.row_bytes(cols).unwrap();
        let mut bytes = vec![0u8; rows * rb];
        for (d, s) in bytes.chunks_mut(rb).zip(wf.chunks(cols)) {
            smoe_quant::quantize(Format::Q8_0, s, d).unwrap();
        }
        let mut deq = vec![0f32; rows * cols];
        smoe_quant::dequantize(Format::Q8_0, &bytes, &mut deq).unwrap();
        let x = values(cols, 6);
        let m = g.upload_q8_0(&bytes, rows, cols).unwrap();
        let (got, _) = g.matvec_q8_0(&m, &x, 1).unwrap();
        for r in 0..rows {
            let row = &deq[r * cols..(r + 1) * cols];
            let want: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f32 = row.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!((got[r] as f64 - want).abs() <= 1e-5 * scale as f64 + 1e-6, "{rows}x{cols} row {r}: {} vs {want}", got[r]);
        }
    }
    assert!(g.upload_q8_0(&[0u8; 33], 1, 32).is_err(), "a short matrix is refused");
}
