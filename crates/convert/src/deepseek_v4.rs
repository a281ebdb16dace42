//! DeepSeek-V4's checkpoints as deepseek-ai publishes them: linear layers in float8 e4m3 with a
//! power-of-two (ue8m0, or f32) `.scale` per 128x128 block, routed experts in FP4 (e2m1 codes,
//! two per int8 byte, element `2j` in the low nibble of byte `j`) with a ue8m0 `.scale` per 32
//! columns of a row. Read as values for any vault format; the FP4 experts go into an MXFP4
//! vault block for block, unconverted (an e2m1 code times a power of two is what MXFP4 holds),
//! and float8 times a power of two is exact in bf16, so a bf16 dense vault loses nothing either.

use crate::gpt_oss::{repack_hub_block, BLOCK_BYTES};
use crate::shatter::TensorProvider;
use crate::ConvertError;
use smoe_formats::safetensors::{Checkpoint, DType, TensorInfo};
use smoe_formats::FormatError;
use smoe_quant::Format;

/// A DeepSeek-V4 checkpoint with its `.scale` companions applied (see the module
/// documentation). The scales themselves are not listed as tensors.
pub struct HubQuantized<'a> {
    inner: &'a Checkpoint,
}

/// How one weight is stored.
enum Stored<'a> {
    /// Values (bf16, f32, ...).
    Plain,
    /// float8 e4m3 with a scale per 128x128 block.
    Fp8 { scale: &'a TensorInfo },
    /// FP4 codes, two per byte, with a ue8m0 scale per 32 columns.
    Fp4 { scale: &'a TensorInfo },
}

impl<'a> HubQuantized<'a> {
    /// Whether `ckpt` holds any `.scale` companion: a quantized DeepSeek-V4 checkpoint.
    pub fn applies(ckpt: &Checkpoint) -> bool {
        ckpt.tensors.keys().any(|n| n.ends_with(".scale") && ckpt.tensors.contains_key(&format!("{}.weight", &n[..n.len() - 6])))
    }

    /// The provider over `ckpt`.
    pub fn new(ckpt: &'a Checkpoint) -> Self {
        HubQuantized { inner: ckpt }
    }

    fn info(&self, name: &str) -> Result<&'a TensorInfo, ConvertError> {
        self.inner.tensors.get(name).ok_or_else(|| ConvertError::Missing(vec![name.to_string()]))
    }

    /// The scale companion of a weight, if it has one.
    fn scale_of(&self, name: &str) -> Option<&'a TensorInfo> {
        self.inner.tensors.get(&format!("{}.scale", name.strip_suffix(".weight")?))
    }

    /// Whether `name` is a `.scale` companion of a weight.
    fn is_scale(&self, name: &str) -> bool {
        name.strip_suffix(".scale").is_some_and(|p| self.inner.tensors.contains_key(&format!("{p}.weight")))
    }

    fn stored(&self, name: &str) -> Result<Stored<'a>, ConvertError> {
        let t = self.info(name)?;
        let Some(scale) = self.scale_of(name) else {
            if matches!(t.dtype, DType::F8E4M3 | DType::I8) {
                return Err(FormatError::BadInput(format!("{name} is quantized ({:?}) but has no .scale", t.dtype)).into());
            }
            return Ok(Stored::Plain);
        };
        match t.dtype {
            DType::F8E4M3 => {
                if scale.rows() != t.rows().div_ceil(128) || scale.cols() != t.cols().div_ceil(128) {
                    return Err(bad_scale(name, scale, t, "128x128 blocks"));
                }
                Ok(Stored::Fp8 { scale })
            }
            DType::I8 => {
                if scale.rows() != t.rows() || scale.cols() * 16 != t.cols() {
                    return Err(bad_scale(name, scale, t, "one per 32 columns of a row"));
                }
                Ok(Stored::Fp4 { scale })
            }
            other => Err(FormatError::BadInput(format!("{name}: a .scale beside a {other:?} weight")).into()),
        }
    }
}

fn bad_scale(name: &str, scale: &TensorInfo, t: &TensorInfo, what: &str) -> ConvertError {
    FormatError::BadInput(format!("{name}.scale has shape {:?}, not {what} of {:?}", scale.shape, t.shape)).into()
}

impl HubQuantized<'_> {
    /// Rows `start..start + n` of a float8 layer as MXFP8 blocks: each 32 codes of a row as
    /// stored, with the e8m0 exponent of the 128x128 block they lie in (the same number:
    /// DeepSeek-V4's ue8m0 scale is `2^(byte − 127)`, as MXFP8's).
    fn fp8_blocks(&self, name: &str, scale: &TensorInfo, start: usize, n: usize, dst: &mut [u8]) -> Result<(), ConvertError> {
        let t = self.info(name)?;
        let cols = t.cols();
        let bytes = Format::MXFP8.block_bytes();
        if !cols.is_multiple_of(32) || dst.len() != n * cols / 32 * bytes {
            return Err(FormatError::Internal(format!("{name}: {} bytes for {n} MXFP8 rows of {cols}", dst.len())).into());
        }
        let mut codes = vec![0u8; n * cols];
        t.read_rows_raw(start, n, &mut codes)?;
        crate::shatter::refuse_nan_codes(name, &codes, start * cols)?;
        let first = start / 128;
        let srows = (start + n - 1) / 128 - first + 1;
        let mut exps = vec![0u8; srows * scale.cols()];
        scale.read_rows_raw(first, srows, &mut exps)?;
        for (r, (row, out)) in codes.chunks_exact(cols).zip(dst.chunks_exact_mut(cols / 32 * bytes)).enumerate() {
            let srow = &exps[((start + r) / 128 - first) * scale.cols()..];
            for (g, (src, blk)) in row.chunks_exact(32).zip(out.chunks_exact_mut(bytes)).enumerate() {
                blk[0] = srow[g * 32 / 128];
                blk[1..].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// Rows `start..start + n` of a scale tensor as f32 (ue8m0 or f32).
fn scale_rows(s: &TensorInfo, start: usize, n: usize) -> Result<Vec<f32>, ConvertError> {
    let mut out = vec![0f32; n * s.cols()];
    s.read_rows_f32(start, n, &mut Vec::new(), &mut out)?;
    if let Some(i) = out.iter().position(|v| !v.is_finite() || *v <= 0.0) {
        return Err(FormatError::BadInput(format!("{}: scale {} is not a positive number", s.name, out[i])).into());
    }
    Ok(out)
}

impl TensorProvider for HubQuantized<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if self.is_scale(name) {
            return None;
        }
        let t = self.inner.tensors.get(name)?;
        match self.stored(name) {
            // Two codes per byte: the matrix is twice as wide as stored.
            Ok(Stored::Fp4 { .. }) => Some(vec![t.rows(), 2 * t.cols()]),
            _ => Some(t.shape.clone()),
        }
    }
    fn names(&self) -> Vec<String> {
        self.inner.tensors.keys().filter(|n| !self.is_scale(n)).cloned().collect()
    }
    fn source_bytes(&self, name: &str) -> u64 {
        self.inner.source_bytes(name) + self.scale_of(name).map_or(0, |s| s.len)
    }
    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        let t = self.info(name)?;
        match self.stored(name)? {
            Stored::Plain => t.read_rows_f32(start, n, &mut Vec::new(), out).map_err(Into::into),
            Stored::Fp8 { scale } => {
                t.read_rows_f32(start, n, &mut Vec::new(), out)?;
                let (cols, first) = (t.cols(), start / 128);
                let scales = scale_rows(scale, first, (start + n - 1) / 128 - first + 1)?;
                for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                    let srow = &scales[((start + r) / 128 - first) * scale.cols()..];
                    for (c, v) in row.iter_mut().enumerate() {
                        *v *= srow[c / 128];
                    }
                }
                Ok(())
            }
            Stored::Fp4 { scale } => {
                let (packed, cols) = (t.cols(), 2 * t.cols());
                let mut codes = vec![0u8; n * packed];
                t.read_rows_raw(start, n, &mut codes)?;
                let scales = scale_rows(scale, start, n)?;
                for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                    for (c, v) in row.iter_mut().enumerate() {
                        let code = (codes[r * packed + c / 2] >> (4 * (c % 2))) & 0x0f;
                        // MXFP4's table holds the e2m1 values doubled (exact).
                        *v = smoe_quant::KVALUES_MXFP4[code as usize] as f32 * 0.5 * scales[r * scale.cols() + c / 32];
                    }
                }
                Ok(())
            }
        }
    }
    fn native_format(&self, name: &str) -> Option<Format> {
        match self.stored(name).ok()? {
            Stored::Fp8 { scale } if scale.dtype == DType::F8E8M0 => Some(Format::MXFP8),
            Stored::Fp4 { scale } if scale.dtype == DType::F8E8M0 => Some(Format::MXFP4),
            _ => None,
        }
    }
    fn read_quantized(&self, name: &str, format: Format, start: usize, n: usize, dst: &mut [u8]) -> Option<Result<(), ConvertError>> {
        if format == Format::MXFP8 {
            let Ok(Stored::Fp8 { scale }) = self.stored(name) else { return None };
            if scale.dtype != DType::F8E8M0 {
                return None;
            }
            return Some(self.fp8_blocks(name, scale, start, n, dst));
        }
        if format != Format::MXFP4 {
            return None;
        }
        let Ok(Stored::Fp4 { scale }) = self.stored(name) else { return None };
        let t = self.inner.tensors.get(name)?;
        let per_row = scale.cols();
        if dst.len() != n * per_row * BLOCK_BYTES {
            return Some(Err(FormatError::Internal(format!("{name}: {} bytes for {n} MXFP4 rows", dst.len())).into()));
        }
        let mut read = || -> Result<(), ConvertError> {
            let mut codes = vec![0u8; n * t.cols()];
            t.read_rows_raw(start, n, &mut codes)?;
            let mut exps = vec![0u8; n * per_row];
            scale.read_rows_raw(start, n, &mut exps)?;
            if scale.dtype != DType::F8E8M0 {
                return Err(FormatError::BadInput(format!("{name}: FP4 blocks need ue8m0 scales, not {:?}", scale.dtype)).into());
            }
            for ((out, hub), &e) in dst.chunks_exact_mut(BLOCK_BYTES).zip(codes.chunks_exact(16)).zip(&exps) {
                out[0] = e;
                repack_hub_block(hub.try_into().expect("16 bytes"), (&mut out[1..]).try_into().expect("16 bytes"));
            }
            Ok(())
        };
        Some(read())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Checkpoint {
        Checkpoint::open(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf/deepseek_v4_fp4")).unwrap()
    }

    /// An FP4 expert's MXFP4 blocks, taken over as they are, decode to the values its codes
    /// and scales stand for; its shape is the unpacked one and its scale is no tensor of its own.
    #[test]
    fn fp4_experts_become_mxfp4_blocks_unchanged() {
        let ckpt = fixture();
        let p = HubQuantized::new(&ckpt);
        assert!(HubQuantized::applies(&ckpt));
        let name = "layers.2.ffn.experts.5.w2.weight";
        let shape = p.shape(name).unwrap();
        assert_eq!(shape, vec![64, 32]);
        assert!(p.shape("layers.2.ffn.experts.5.w2.scale").is_none() && !p.names().iter().any(|n| n.ends_with(".scale")));
        let (rows, cols) = (shape[0], shape[1]);
        let mut values = vec![0f32; rows * cols];
        p.read_rows(name, 0, rows, &mut values).unwrap();
        let mut blocks = vec![0u8; rows * cols / 32 * BLOCK_BYTES];
        p.read_quantized(name, Format::MXFP4, 0, rows, &mut blocks).unwrap().unwrap();
        let mut decoded = vec![0f32; rows * cols];
        smoe_quant::dequantize(Format::MXFP4, &blocks, &mut decoded).unwrap();
        assert_eq!(decoded, values);
        assert!(values.iter().any(|&v| v != 0.0));
        // Other formats are made from the values.
        assert!(p.read_quantized(name, Format::Q8_0, 0, rows, &mut blocks).is_none());
    }

    /// A float8 layer goes into MXFP8 blocks code for code: decoded, they are the values the
    /// codes and scales stand for; a bf16 tensor has no native MXFP8 form.
    #[test]
    fn fp8_layers_become_mxfp8_blocks_unchanged() {
        let ckpt = fixture();
        let p = HubQuantized::new(&ckpt);
        let name = "layers.1.attn.wq_b.weight";
        assert_eq!(p.native_format(name), Some(Format::MXFP8));
        assert_eq!(p.native_format("layers.1.attn.compressor.wkv.weight"), None);
        let [rows, cols] = p.shape(name).unwrap()[..] else { panic!() };
        let mut values = vec![0f32; rows * cols];
        p.read_rows(name, 0, rows, &mut values).unwrap();
        let mut blocks = vec![0u8; Format::MXFP8.row_bytes(cols).unwrap() * rows];
        p.read_quantized(name, Format::MXFP8, 0, rows, &mut blocks).unwrap().unwrap();
        let mut decoded = vec![0f32; rows * cols];
        smoe_quant::dequantize(Format::MXFP8, &blocks, &mut decoded).unwrap();
        assert_eq!(decoded, values);
        // Rows from the middle (another 128-row block of scales where the layer has one).
        let mut tail = vec![0u8; Format::MXFP8.row_bytes(cols).unwrap() * (rows - 3)];
        p.read_quantized(name, Format::MXFP8, 3, rows - 3, &mut tail).unwrap().unwrap();
        assert_eq!(&blocks[Format::MXFP8.row_bytes(cols).unwrap() * 3..], &tail[..]);
    }

    /// A float8 layer's values are its codes times its block's power of two: rows read in two
    /// pieces equal rows read at once, and bf16 holds every one of them exactly.
    #[test]
    fn fp8_layers_read_scaled_and_bf16_exact() {
        let ckpt = fixture();
        let p = HubQuantized::new(&ckpt);
        let name = "layers.1.attn.wq_b.weight";
        let [rows, cols] = p.shape(name).unwrap()[..] else { panic!() };
        let mut all = vec![0f32; rows * cols];
        p.read_rows(name, 0, rows, &mut all).unwrap();
        let mut tail = vec![0f32; (rows - 5) * cols];
        p.read_rows(name, 5, rows - 5, &mut tail).unwrap();
        assert_eq!(&all[5 * cols..], &tail[..]);
        for &v in &all {
            assert_eq!(smoe_quant::half::bf16_bits_to_f32(smoe_quant::half::f32_to_bf16_bits(v)), v);
        }
    }
}
