//! What the kernel examples stream: one quantized row repeated to a matrix larger than the
//! caches, and one activation row quantized for it.
use smoe_kernels::QuantAct;
use smoe_quant::Format;

/// `bytes` of `f` rows of `cols` (the same row repeated: content does not change a kernel's
/// speed), their row count and row size, and a matching activation row.
pub fn repeated_matrix(f: Format, cols: usize, bytes: usize) -> (Vec<u8>, usize, usize, QuantAct) {
    let rb = f.row_bytes(cols).unwrap();
    let rows = bytes / rb;
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
    let row: Vec<f32> = (0..cols).map(|i| ((i * 104729 % 997) as f32 - 498.0) / 400.0).collect();
    let mut one = vec![0u8; rb];
    smoe_quant::quantize(f, &row, &mut one).unwrap();
    let w: Vec<u8> = one.iter().copied().cycle().take(rb * rows).collect();
    let mut act = QuantAct::default();
    act.quantize(f, &x, 1, cols);
    (w, rows, rb, act)
}
