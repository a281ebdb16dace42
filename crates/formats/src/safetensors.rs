//! Reading Hugging Face checkpoints: safetensors headers, sharded indexes, tensor rows as f32.
//!
//! Only headers are parsed up front; tensor data is read on demand with positioned reads, a
//! range of rows at a time, so converting a checkpoint never needs more memory than the rows
//! being quantized.

use crate::FormatError;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Element types found in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
    /// float8 e4m3 (DeepSeek-V3's published weights), with a `_scale_inv` companion.
    F8E4M3,
    /// Power-of-two scales (`float8_e8m0fnu`, DeepSeek-V4's ue8m0 `.scale`): byte `b` is
    /// `2^(b - 127)`, 255 NaN.
    F8E8M0,
    /// Signed bytes: DeepSeek-V4's FP4 experts, two e2m1 codes per byte, read as stored.
    I8,
    /// Integers (DeepSeek-V4's `tid2eid`), read as f32: exact below 2^24.
    I64,
    /// 32-bit integers, as [`DType::I64`].
    I32,
    /// Bytes: gpt-oss's packed MXFP4 `_blocks` and their e8m0 `_scales`, read as they are
    /// (as f32 each byte is its value, 0..=255).
    U8,
}

impl DType {
    fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "F8_E4M3" => DType::F8E4M3,
            "U8" => DType::U8,
            "I64" => DType::I64,
            "F8_E8M0" => DType::F8E8M0,
            "I8" => DType::I8,
            "I32" => DType::I32,
            _ => return None,
        })
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::F8E8M0 | DType::U8 | DType::I8 => 1,
        }
    }
}

/// One tensor in a checkpoint.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Name in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// Absolute offset of the data in `file`.
    pub offset: u64,
    /// Length of the data in bytes.
    pub len: u64,
    file: Arc<File>,
    path: Arc<PathBuf>,
}

impl TensorInfo {
    /// Number of rows (all dimensions but the last).
    pub fn rows(&self) -> usize {
        self.shape[..self.shape.len().saturating_sub(1)].iter().product::<usize>().max(1)
    }
    /// Row length (the last dimension).
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// Reads rows `[start, start + n)` as f32 into `out` (`n * cols` long).
    pub fn read_rows_f32(&self, start: usize, n: usize, raw: &mut Vec<u8>, out: &mut [f32]) -> Result<(), FormatError> {
        let cols = self.cols();
        let es = self.dtype.size();
        if start + n > self.rows() || out.len() != n * cols {
            return Err(FormatError::Internal(format!("{}: row range out of bounds", self.name)));
        }
        raw.resize(n * cols * es, 0);
        self.file
            .read_exact_at(raw, self.offset + (start * cols * es) as u64)
            .map_err(|e| FormatError::Io { path: self.path.display().to_string(), source: e })?;
        match self.dtype {
            DType::F32 => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            DType::BF16 => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = smoe_quant::half::bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            DType::F16 => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = smoe_quant::half::f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            DType::F8E4M3 => {
                for (o, &b) in out.iter_mut().zip(raw.iter()) {
                    *o = f8e4m3_to_f32(b);
                }
            }
            DType::F8E8M0 => {
                for (o, &b) in out.iter_mut().zip(raw.iter()) {
                    *o = if b == 255 { f32::NAN } else { smoe_quant::e8m0_to_f32_half(b) * 2.0 };
                }
            }
            DType::I8 => return Err(FormatError::BadInput(format!("{}: an I8 tensor holds packed codes, not weights", self.name))),
            DType::I64 => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(8)) {
                    *o = i64::from_le_bytes(c.try_into().unwrap()) as f32;
                }
            }
            DType::I32 => {
                for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = i32::from_le_bytes(c.try_into().unwrap()) as f32;
                }
            }
            // Bytes (MXFP4 blocks and scales), read as stored by read_rows_raw: not numbers.
            DType::U8 => return Err(FormatError::BadInput(format!("{}: a U8 tensor holds bytes, not weights", self.name))),
        }
        if let Some(bad) = out.iter().position(|v| !v.is_finite()) {
            return Err(FormatError::NonFinite { tensor: self.name.clone(), index: (start * cols + bad) as u64 });
        }
        Ok(())
    }

    /// Reads the bytes of rows `[start, start + n)` as stored into `out` (`n * cols * element
    /// size` long): blocks that are copied, not converted.
    pub fn read_rows_raw(&self, start: usize, n: usize, out: &mut [u8]) -> Result<(), FormatError> {
        let row = self.cols() * self.dtype.size();
        if start + n > self.rows() || out.len() != n * row {
            return Err(FormatError::Internal(format!("{}: row range out of bounds", self.name)));
        }
        self.file
            .read_exact_at(out, self.offset + (start * row) as u64)
            .map_err(|e| FormatError::Io { path: self.path.display().to_string(), source: e })
    }

    /// Reads the whole tensor as f32.
    pub fn read_f32(&self) -> Result<Vec<f32>, FormatError> {
        let mut out = vec![0f32; self.rows() * self.cols()];
        self.read_rows_f32(0, self.rows(), &mut Vec::new(), &mut out)?;
        Ok(out)
    }
}

/// float8 e4m3fn (no infinities; 0x7f/0xff are NaN).
fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// All tensors of a checkpoint directory, by name.
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` (sharded) or the single `*.safetensors` file(s) in `dir`.
    pub fn open(dir: &Path) -> Result<Checkpoint, FormatError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| FormatError::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| FormatError::BadInput(format!("{}: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| FormatError::BadInput(format!("{}: no weight_map", index.display())))?;
            let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| FormatError::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(FormatError::BadInput(format!("no *.safetensors files in {}", dir.display())));
        }
        let mut tensors = BTreeMap::new();
        for f in files {
            for t in read_header(&f)? {
                if let Some(prev) = tensors.insert(t.name.clone(), t) {
                    return Err(FormatError::BadInput(format!("tensor {} appears in more than one shard", prev.name)));
                }
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), tensors })
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.len).sum()
    }
}

/// Parses one safetensors file's header.
pub fn read_header(path: &Path) -> Result<Vec<TensorInfo>, FormatError> {
    let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let file_len = file.metadata().map_err(|e| FormatError::io(path, e))?.len();
    let bad = |m: String| FormatError::BadInput(format!("{}: {m}", path.display()));
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0).map_err(|_| bad("too short for a safetensors header".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > file_len {
        return Err(bad(format!("header length {n} is impossible")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8).map_err(|e| FormatError::io(path, e))?;
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header).map_err(|e| bad(format!("header JSON: {e}")))?;
    let file = Arc::new(file);
    let pathbuf = Arc::new(path.to_path_buf());
    let mut out = Vec::new();
    for (name, info) in v {
        if name == "__metadata__" {
            continue;
        }
        let dt = info.get("dtype").and_then(|d| d.as_str()).unwrap_or("?");
        let dtype = DType::parse(dt)
            .ok_or_else(|| bad(format!("tensor {name} has unsupported dtype {dt} (supported: F32, F16, BF16, F8_E4M3)")))?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
            .ok_or_else(|| bad(format!("tensor {name} has no shape")))?;
        let off = info.get("data_offsets").and_then(|o| o.as_array()).filter(|o| o.len() == 2);
        let (start, end) = match off.map(|o| (o[0].as_u64(), o[1].as_u64())) {
            Some((Some(s), Some(e))) if s <= e => (s, e),
            _ => return Err(bad(format!("tensor {name} has bad data_offsets"))),
        };
        let elems: usize = shape.iter().product();
        if (end - start) as usize != elems * dtype.size() || 8 + n + end > file_len {
            return Err(bad(format!("tensor {name}: data does not match shape {shape:?} or lies past the end of the file")));
        }
        out.push(TensorInfo { name, dtype, shape, offset: 8 + n + start, len: end - start, file: file.clone(), path: pathbuf.clone() });
    }
    Ok(out)
}
