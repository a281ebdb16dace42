//! smoe's reference encoders against bytes written by ggml's own quantizer (see
//! testdata/ggml-quant/README.md), and the RMS error table of docs/quantization.md.

use smoe_quant::{dequantize, quantize, Format};
use std::path::Path;

fn golden(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/ggml-quant").join(name)).unwrap()
}

const FORMATS: [(Format, &str); 11] = [
    (Format::Q8_0, "q8_0"),
    (Format::Q4_0, "q4_0"),
    (Format::Q4_1, "q4_1"),
    (Format::Q5_0, "q5_0"),
    (Format::Q5_1, "q5_1"),
    (Format::Q2_K, "q2_K"),
    (Format::Q3_K, "q3_K"),
    (Format::Q4_K, "q4_K"),
    (Format::Q5_K, "q5_K"),
    (Format::Q6_K, "q6_K"),
    (Format::MXFP4, "mxfp4"),
];

fn rms(x: &[f32], f: Format, q: &[u8]) -> f64 {
    let mut y = vec![0f32; x.len()];
    dequantize(f, q, &mut y).unwrap();
    let e: f64 = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (e / n).sqrt()
}

#[test]
fn encoders_match_ggml_byte_for_byte() {
    for dist in ["gauss", "student3"] {
        let x: Vec<f32> = golden(&format!("{dist}.f32")).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        for (f, name) in FORMATS {
            let theirs = golden(&format!("{dist}.{name}"));
            let mut ours = vec![0u8; theirs.len()];
            quantize(f, &x, &mut ours).unwrap();
            let blocks = theirs.len() / f.block_bytes();
            let differ = (0..blocks)
                .filter(|&b| ours[b * f.block_bytes()..(b + 1) * f.block_bytes()] != theirs[b * f.block_bytes()..(b + 1) * f.block_bytes()])
                .count();
            let (e_ours, e_theirs) = (rms(&x, f, &ours), rms(&x, f, &theirs));
            println!("RMS {dist} {f}: smoe {e_ours:.6} ggml {e_theirs:.6} ({differ}/{blocks} blocks differ)");
            // The same algorithms with the same float evaluation order: the same bytes.
            assert_eq!(differ, 0, "{dist} {f}: {differ} of {blocks} blocks differ from ggml");
            assert_eq!(e_ours, e_theirs);
        }
    }
}
