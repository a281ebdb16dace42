//! `smoe shatter`: a Hugging Face checkpoint directory into one vault.
//!
//! Streaming: dense tensors are converted a bounded run of rows at a time, experts a bounded
//! batch at a time, so peak memory is a small multiple of one expert (or of one row chunk)
//! whatever the checkpoint size. Quantization runs in parallel on a rayon pool; writes are
//! sequential into a temporary file that is renamed into place only when complete.

use crate::{ConvertError, ExpertFormats, Progress};
use rayon::prelude::*;
use smoe_formats::hf::{self, hf_expert_names, hf_name};
use smoe_formats::safetensors::{Checkpoint, DType};
use smoe_formats::FormatError;
use smoe_quant::Format;
use smoe_vault::{names, Architecture, Manifest, VaultWriter};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of a conversion.
#[derive(Clone, Debug)]
pub struct ShatterOptions {
    /// Formats requested for the routed experts' matrices.
    pub experts: ExpertFormats,
    /// Format requested for dense matrices (norms, biases and routers always stay F32).
    pub dense: Format,
    /// Quantization threads (default: all cores).
    pub threads: Option<usize>,
    /// Leave the expert region zero and unwritten (a hole in the file, no disk used): for
    /// vaults whose experts are written elsewhere (`synth` straight into GGUF).
    pub zero_experts: bool,
    /// Test hook: fail after this many expert blobs, as a crash mid-conversion would.
    #[doc(hidden)]
    pub fail_after_blobs: Option<usize>,
    /// A llama.cpp file type (`Q4_K_M`): each matrix in the format llama.cpp's quantizer gives
    /// it, in place of `experts` and `dense` (see [`crate::LlamaFileType`]).
    pub mix: Option<crate::LlamaFileType>,
}

impl Default for ShatterOptions {
    fn default() -> Self {
        ShatterOptions {
            experts: ExpertFormats::all(Format::Q4_K),
            dense: Format::Q8_0,
            threads: None,
            zero_experts: false,
            fail_after_blobs: None,
            mix: None,
        }
    }
}

/// What a conversion produced.
#[derive(Clone, Debug)]
pub struct ShatterReport {
    /// The vault written.
    pub path: PathBuf,
    /// Its size.
    pub file_len: u64,
    /// Bytes of dense tensors.
    pub dense_bytes: u64,
    /// Bytes of the expert region.
    pub expert_bytes: u64,
    /// Bytes of the largest expert blob (a mixed quantization's smaller layers take less).
    pub blob_size: u64,
    /// Bytes of checkpoint data read.
    pub source_bytes: u64,
    /// Format fallbacks and other notes (also stored in the manifest).
    pub notes: Vec<String>,
    /// Wall time.
    pub seconds: f64,
}

/// Source rows per dense chunk: bounds memory on huge embeddings and LM heads.
const CHUNK_ELEMS: usize = 8 << 20;

/// Where the values of a conversion come from: a checkpoint on disk, or a generator.
pub trait TensorProvider: Sync {
    /// Shape of a tensor, if the source has it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Every tensor name.
    fn names(&self) -> Vec<String>;
    /// Rows `[start, start + n)` as f32 into `out` (`n * cols` long).
    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError>;
    /// Bytes of source data (for progress).
    fn source_bytes(&self, name: &str) -> u64;
    /// Rows `[start, start + n)` already in `format`, written into `dst` (whole rows), for a
    /// source that makes blocks directly (`synth --random-blocks`); `None`: read the values and
    /// quantize them (the default).
    fn read_quantized(&self, _name: &str, _format: Format, _start: usize, _n: usize, _dst: &mut [u8]) -> Option<Result<(), ConvertError>> {
        None
    }
    /// The vault format that holds a tensor exactly as the source stores it, where the source
    /// says (DeepSeek-V4's float8 layers: [`Format::MXFP8`]); `None`: not known.
    fn native_format(&self, _name: &str) -> Option<Format> {
        None
    }
}

thread_local! {
    static RAW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl TensorProvider for Checkpoint {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|t| t.shape.clone())
    }
    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
    fn source_bytes(&self, name: &str) -> u64 {
        self.tensors.get(name).map_or(0, |t| t.len)
    }
    /// float8 tensors (DeepSeek-V3's published weights) are scaled by their 128x128 block
    /// `_scale_inv` companion.
    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        let info = self.tensors.get(name).ok_or_else(|| ConvertError::Missing(vec![name.to_string()]))?;
        RAW.with(|raw| info.read_rows_f32(start, n, &mut raw.borrow_mut(), out))?;
        if info.dtype == DType::F8E4M3 {
            let (scales, bpr) = block_scales(self, name)?;
            let cols = info.cols();
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                let srow = &scales[((start + r) / 128) * bpr..];
                for (c, v) in row.iter_mut().enumerate() {
                    *v *= srow[c / 128];
                }
            }
        }
        Ok(())
    }
    /// A float8 tensor with its 128x128 block scales is [`Format::FP8`] as published.
    fn native_format(&self, name: &str) -> Option<Format> {
        let info = self.tensors.get(name)?;
        let scaled = info.dtype == DType::F8E4M3 && self.tensors.contains_key(&format!("{name}_scale_inv"));
        (scaled && Format::FP8.fits(info.cols())).then_some(Format::FP8)
    }
    /// FP8 blocks straight from the codes and their block's scale: each row's 128 codes of a
    /// block beside the f32 scale of the 128 rows it belongs to, nothing decoded.
    fn read_quantized(&self, name: &str, format: Format, start: usize, n: usize, dst: &mut [u8]) -> Option<Result<(), ConvertError>> {
        if format != Format::FP8 || self.native_format(name) != Some(Format::FP8) {
            return None;
        }
        let mut read = || -> Result<(), ConvertError> {
            let info = &self.tensors[name];
            let (scales, bpr) = block_scales(self, name)?;
            let cols = info.cols();
            let row_bytes = Format::FP8.row_bytes(cols).map_err(|e| FormatError::Internal(e.to_string()))?;
            if dst.len() != n * row_bytes {
                return Err(FormatError::Internal(format!("{name}: {} bytes for {n} FP8 rows of {cols}", dst.len())).into());
            }
            RAW.with(|raw| -> Result<(), ConvertError> {
                let raw = &mut *raw.borrow_mut();
                raw.resize(n * cols, 0);
                info.read_rows_raw(start, n, raw)?;
                refuse_nan_codes(name, raw, start * cols)?;
                for (r, (row, codes)) in dst.chunks_exact_mut(row_bytes).zip(raw.chunks_exact(cols)).enumerate() {
                    let srow = &scales[((start + r) / 128) * bpr..];
                    for ((block, codes), &d) in row.chunks_exact_mut(Format::FP8.block_bytes()).zip(codes.chunks_exact(128)).zip(srow) {
                        block[..4].copy_from_slice(&d.to_le_bytes());
                        block[4..].copy_from_slice(codes);
                    }
                }
                Ok(())
            })
        };
        Some(read())
    }
}

/// The `_scale_inv` companion of float8 tensor `name`: one f32 per 128x128 block, and blocks
/// per row.
fn block_scales(ckpt: &Checkpoint, name: &str) -> Result<(Vec<f32>, usize), ConvertError> {
    let info = &ckpt.tensors[name];
    let sname = format!("{name}_scale_inv");
    let s = ckpt.tensors.get(&sname).ok_or_else(|| FormatError::BadInput(format!("{name} is float8 but {sname} is missing")))?;
    let bpr = info.cols().div_ceil(128);
    if s.rows() != info.rows().div_ceil(128) || s.cols() != bpr {
        return Err(FormatError::BadInput(format!("{sname} has shape {:?}, not 128x128 blocks of {:?}", s.shape, info.shape)).into());
    }
    Ok((s.read_f32()?, bpr))
}

/// float8 e4m3 codes copied into blocks (FP8, MXFP8) are refused where they are NaN (`S.1111.111`),
/// as the f32 path refuses a non-finite weight: a backend would otherwise read one as a number.
/// `first` is the flat index of `codes[0]` in its tensor.
pub(crate) fn refuse_nan_codes(name: &str, codes: &[u8], first: usize) -> Result<(), ConvertError> {
    match codes.iter().position(|&q| q & 0x7f == 0x7f) {
        Some(bad) => Err(FormatError::NonFinite { tensor: name.to_string(), index: (first + bad) as u64 }.into()),
        None => Ok(()),
    }
}

fn read_all(src: &dyn TensorProvider, name: &str) -> Result<Vec<f32>, ConvertError> {
    let shape = src.shape(name).ok_or_else(|| ConvertError::Missing(vec![name.to_string()]))?;
    let cols = *shape.last().unwrap_or(&1);
    let rows = shape[..shape.len().saturating_sub(1)].iter().product::<usize>().max(1);
    let mut out = vec![0f32; rows * cols];
    src.read_rows(name, 0, rows, &mut out)?;
    Ok(out)
}

/// Quantizes whole rows in parallel.
pub fn quantize_rows(format: Format, src: &[f32], cols: usize, dst: &mut [u8]) -> Result<(), ConvertError> {
    let row_bytes = format.row_bytes(cols).map_err(|e| FormatError::Internal(e.to_string()))?;
    dst.par_chunks_mut(row_bytes)
        .zip(src.par_chunks(cols))
        .try_for_each(|(d, s)| smoe_quant::quantize(format, s, d))
        .map_err(|e| FormatError::Internal(e.to_string()).into())
}

/// The format a matrix gets, recording a note when the requested one does not fit its rows.
fn choose_format(requested: Format, cols: usize, what: &str, notes: &mut BTreeMap<String, BTreeSet<String>>) -> Format {
    let f = requested.resolve(cols);
    if f != requested {
        let key = format!("{requested} does not fit rows of {cols} elements: {f} used");
        notes.entry(key).or_default().insert(what.to_string());
    }
    f
}

/// One expert matrix `name` of `shape` from `ckpt`, in `format`: the provider's own quantized
/// blocks where it has them, else its values quantized.
pub(crate) fn expert_part(ckpt: &dyn TensorProvider, name: &str, format: Format, shape: [usize; 2]) -> Result<Vec<u8>, ConvertError> {
    let row_bytes = format.row_bytes(shape[1]).map_err(|e| FormatError::Internal(e.to_string()))?;
    let mut q = vec![0u8; row_bytes * shape[0]];
    if let Some(done) = ckpt.read_quantized(name, format, 0, shape[0], &mut q) {
        return done.map(|()| q);
    }
    let data = read_all(ckpt, name)?;
    for (d, s) in q.chunks_exact_mut(row_bytes).zip(data.chunks_exact(shape[1])) {
        smoe_quant::quantize(format, s, d).map_err(|e| FormatError::Internal(e.to_string()))?;
    }
    Ok(q)
}

/// Checks that the checkpoint holds exactly the tensors the architecture needs, with the right
/// shapes; lists everything missing, unexpected or misshapen.
fn check_tensors(src: &dyn TensorProvider, arch: &Architecture) -> Result<(), ConvertError> {
    let mut expected: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for spec in names::dense_tensors(arch) {
        expected.insert(hf_name(arch.family, &spec.name), spec.shape.clone());
    }
    let shapes = names::expert_part_shapes(arch);
    for l in arch.moe_layers() {
        for e in 0..arch.moe.num_experts {
            for (n, s) in hf_expert_names(arch.family, l, e).into_iter().zip(shapes) {
                expected.insert(n, s.to_vec());
            }
        }
    }
    let missing: Vec<String> = expected.keys().filter(|n| src.shape(n).is_none()).cloned().collect();
    if !missing.is_empty() {
        return Err(ConvertError::Missing(missing));
    }
    let unexpected: Vec<String> = src.names().into_iter().filter(|n| !expected.contains_key(n) && !hf::is_ignored(n, arch)).collect();
    if !unexpected.is_empty() {
        return Err(ConvertError::Unexpected(unexpected));
    }
    for (n, shape) in &expected {
        let found = src.shape(n).unwrap();
        // Qwen2-MoE's shared_expert_gate is [1, H]; a [H] vector is the same thing.
        let same = &found == shape || (shape.len() == 2 && shape[0] == 1 && found == [shape[1]]);
        if !same {
            return Err(ConvertError::Shape { tensor: n.clone(), found, expected: shape.clone() });
        }
    }
    Ok(())
}

/// Converts the checkpoint in `hf_dir` into the vault `out`.
pub fn shatter(hf_dir: &Path, out: &Path, opts: &ShatterOptions, progress: &dyn Progress) -> Result<ShatterReport, ConvertError> {
    let pool =
        rayon::ThreadPoolBuilder::new().num_threads(opts.threads.unwrap_or(0)).build().map_err(|e| FormatError::Internal(e.to_string()))?;
    pool.install(|| shatter_in_pool(hf_dir, out, opts, progress))
}

fn shatter_in_pool(hf_dir: &Path, out: &Path, opts: &ShatterOptions, progress: &dyn Progress) -> Result<ShatterReport, ConvertError> {
    let config = hf::read_json(&hf_dir.join("config.json"))?;
    let assets = SourceAssets { text: hf::text_assets(hf_dir)?, generation: hf::generation_defaults(hf_dir, &config)?, config };
    let ckpt = Checkpoint::open(hf_dir)?;
    let arch = hf::architecture_from_config(&assets.config)?;
    if arch.family == smoe_vault::Family::GptOss && crate::gpt_oss::FusedExperts::applies(&ckpt) {
        // Fused (and maybe MXFP4) experts, read as per-expert tensors.
        return convert(&crate::gpt_oss::FusedExperts::new(&ckpt, &arch)?, assets, out, opts, progress);
    }
    if arch.family == smoe_vault::Family::DeepseekV4 && crate::deepseek_v4::HubQuantized::applies(&ckpt) {
        // FP8 linear layers and FP4 experts with their `.scale`s.
        return convert(&crate::deepseek_v4::HubQuantized::new(&ckpt), assets, out, opts, progress);
    }
    if matches!(arch.family, smoe_vault::Family::Qwen3Next | smoe_vault::Family::Qwen35Moe) {
        // Fused projections taken apart, norms as plain weights.
        return convert(&crate::qwen3_next::Qwen3NextParts::new(&ckpt, &arch)?, assets, out, opts, progress);
    }
    convert(&ckpt, assets, out, opts, progress)
}

/// Everything but the tensors: config.json, tokenizer and template, generation defaults.
pub struct SourceAssets {
    /// config.json.
    pub config: serde_json::Value,
    /// Tokenizer files.
    pub text: smoe_vault::TextAssets,
    /// generation_config.json.
    pub generation: smoe_vault::GenerationDefaults,
}

/// Converts tensors from any provider into the vault `out` (the shatter pipeline).
pub fn shatter_from(
    src: &dyn TensorProvider,
    assets: SourceAssets,
    out: &Path,
    opts: &ShatterOptions,
    progress: &dyn Progress,
) -> Result<ShatterReport, ConvertError> {
    let pool =
        rayon::ThreadPoolBuilder::new().num_threads(opts.threads.unwrap_or(0)).build().map_err(|e| FormatError::Internal(e.to_string()))?;
    pool.install(|| convert(src, assets, out, opts, progress))
}

fn convert(
    ckpt: &dyn TensorProvider,
    assets: SourceAssets,
    out: &Path,
    opts: &ShatterOptions,
    progress: &dyn Progress,
) -> Result<ShatterReport, ConvertError> {
    let t0 = Instant::now();
    let SourceAssets { config, text, generation } = assets;
    let arch = hf::architecture_from_config(&config)?;
    check_tensors(ckpt, &arch)?;
    let total: u64 = ckpt.names().iter().filter(|n| !hf::is_ignored(n, &arch)).map(|n| ckpt.source_bytes(n)).sum();
    progress.start(total);
    let mut notes: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mix = opts.mix.map(|m| m.plan(&arch));
    let mut w = VaultWriter::create(out)?;

    // Dense tensors, a chunk of rows at a time.
    let mut f32buf = Vec::new();
    let mut qbuf = Vec::new();
    let mut dense_bytes = 0u64;
    for spec in names::dense_tensors(&arch) {
        let src_name = hf_name(arch.family, &spec.name);
        let cols = *spec.shape.last().unwrap();
        let rows: usize = spec.shape[..spec.shape.len() - 1].iter().product::<usize>().max(1);
        // MXFP8 and FP8 hold float8 layers as published; they do not requantize the others,
        // which keep 16 bits (a bf16 checkpoint's exactly).
        let float8 = matches!(opts.dense, Format::MXFP8 | Format::FP8);
        let requested = match &mix {
            Some(plan) => plan.dense(&spec.name).unwrap_or(opts.dense),
            None if float8 && ckpt.native_format(&src_name) != Some(opts.dense) => Format::BF16,
            None => opts.dense,
        };
        let format = if spec.keep_f32 { Format::F32 } else { choose_format(requested, cols, &spec.name, &mut notes) };
        w.begin_tensor(&spec.name, format, &spec.shape, &src_name)?;
        let chunk_rows = (CHUNK_ELEMS / cols).max(1);
        let row_bytes = format.row_bytes(cols).map_err(|e| FormatError::Internal(e.to_string()))?;
        let mut r = 0;
        while r < rows {
            let n = chunk_rows.min(rows - r);
            f32buf.resize(n * cols, 0.0);
            qbuf.resize(n * row_bytes, 0);
            if let Some(done) = ckpt.read_quantized(&src_name, format, r, n, &mut qbuf) {
                done?;
            } else {
                ckpt.read_rows(&src_name, r, n, &mut f32buf)?;
                quantize_rows(format, &f32buf, cols, &mut qbuf)?;
            }
            w.write_tensor_bytes(&qbuf)?;
            progress.advance(ckpt.source_bytes(&src_name) * n as u64 / rows as u64);
            r += n;
        }
        w.end_tensor()?;
        dense_bytes += (rows * row_bytes) as u64;
    }
    drop((f32buf, qbuf));

    // Experts: one blob per (layer, expert), a bounded parallel batch at a time.
    // A mix may give layers their own formats (Q4_K_M's Q6_K down projections in half the
    // layers): the writer then pads every blob to the largest layer's size.
    let shapes = names::expert_part_shapes(&arch);
    let moe_layers = arch.moe_layers();
    let mut specs_for = |formats: ExpertFormats| -> Vec<(String, Format, [usize; 2])> {
        names::EXPERT_PARTS
            .iter()
            .zip(shapes)
            .map(|(n, s)| (n.to_string(), choose_format(formats.of(n), s[1], &format!("expert {n}"), &mut notes), s))
            .collect()
    };
    let layer_specs: Vec<_> = if moe_layers.is_empty() {
        vec![specs_for(opts.experts)]
    } else {
        moe_layers.iter().map(|&l| specs_for(mix.as_ref().and_then(|p| p.experts(l)).unwrap_or(opts.experts))).collect()
    };
    let (blob_size, expert_bytes) = w.begin_experts_by_layer(&layer_specs, &moe_layers, arch.moe.num_experts)?;
    let batch = rayon::current_num_threads().max(1) * 2;
    let mut blobs_done = 0usize;
    let layers: &[usize] = if opts.zero_experts {
        w.add_zero_blobs()?;
        &[]
    } else {
        &moe_layers
    };
    for (&l, part_specs) in layers.iter().zip(&layer_specs) {
        for first in (0..arch.moe.num_experts).step_by(batch) {
            let last = (first + batch).min(arch.moe.num_experts);
            let quantized: Vec<Result<Vec<Vec<u8>>, ConvertError>> = (first..last)
                .into_par_iter()
                .map(|e| {
                    let names = hf_expert_names(arch.family, l, e);
                    names.iter().zip(part_specs).map(|(n, (_, format, shape))| expert_part(ckpt, n, *format, *shape)).collect()
                })
                .collect();
            for (e, q) in (first..last).zip(quantized) {
                let q = q?;
                let refs: Vec<&[u8]> = q.iter().map(|p| p.as_slice()).collect();
                w.add_blob(l, e, &refs)?;
                let src_bytes: u64 = hf_expert_names(arch.family, l, e).iter().map(|n| ckpt.source_bytes(n)).sum();
                progress.advance(src_bytes);
                blobs_done += 1;
                if opts.fail_after_blobs == Some(blobs_done) {
                    return Err(ConvertError::Injected);
                }
            }
        }
    }

    let notes: Vec<String> = notes
        .into_iter()
        .map(|(k, v)| {
            let list: Vec<_> = v.into_iter().collect();
            let shown = if list.len() > 4 { format!("{} and {} more", list[..4].join(", "), list.len() - 4) } else { list.join(", ") };
            format!("{k} ({shown})")
        })
        .collect();
    for n in &notes {
        progress.note(n);
    }
    let manifest = Manifest {
        created_by: format!("smoe {}", env!("CARGO_PKG_VERSION")),
        required_features: vec![],
        architecture: arch.clone(),
        source_config: config,
        text,
        generation,
        dense: vec![],
        experts: smoe_vault::ExpertIndex { blob_size: 0, parts: vec![], layers: vec![] },
        notes: notes.clone(),
    };
    let file_len = w.finish(manifest)?;
    progress.finish();
    Ok(ShatterReport {
        path: out.to_path_buf(),
        file_len,
        dense_bytes,
        expert_bytes,
        blob_size,
        source_bytes: total,
        notes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A float8 tensor with its 128x128 block scales (rows past one block, a partial last block
    /// of rows) goes into FP8 blocks code for code: decoded, any range of rows is exactly what
    /// the f32 path makes of the checkpoint (float8 times its block's arbitrary f32 scale,
    /// checked against transformers on the GLM-5-FP8 fixture); a bf16 tensor, or float8 rows
    /// no 128-wide block fits, has no native FP8 form.
    #[test]
    fn block_scaled_float8_becomes_fp8_blocks_unchanged() {
        let (rows, cols) = (200usize, 256usize);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 251) as u8 & 0xf7).collect();
        let scales: Vec<f32> = vec![0.0123, -0.000_456, 3.25e-5, 7.0];
        let narrow: Vec<u8> = vec![0x38; 4 * 64];
        let narrow_scale = 0.5f32;
        let bf16: Vec<u8> = vec![0x3f; 4 * 256 * 2];
        let mut data = Vec::new();
        let mut header = serde_json::Map::new();
        for (name, dtype, shape, bytes) in [
            ("w.weight", "F8_E4M3", vec![rows, cols], codes.clone()),
            ("w.weight_scale_inv", "F32", vec![2, 2], scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
            ("n.weight", "F8_E4M3", vec![4, 64], narrow),
            ("n.weight_scale_inv", "F32", vec![1, 1], narrow_scale.to_le_bytes().to_vec()),
            ("b.weight", "BF16", vec![4, 256], bf16),
            ("x.weight", "F8_E4M3", vec![1, 128], (0..128u8).map(|i| if i == 5 { 0xff } else { i & 0x70 }).collect()),
            ("x.weight_scale_inv", "F32", vec![1, 1], 1f32.to_le_bytes().to_vec()),
        ] {
            header.insert(
                name.into(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend(bytes);
        }
        let head = serde_json::to_vec(&header).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut file = (head.len() as u64).to_le_bytes().to_vec();
        file.extend(&head);
        file.extend(&data);
        std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.native_format("w.weight"), Some(Format::FP8));
        assert_eq!(ckpt.native_format("n.weight"), None, "64 columns: no 128-wide block");
        assert_eq!(ckpt.native_format("b.weight"), None);
        assert!(ckpt.read_quantized("b.weight", Format::FP8, 0, 4, &mut vec![0u8; 4 * 264]).is_none());
        assert!(ckpt.read_quantized("w.weight", Format::MXFP8, 0, 1, &mut vec![0u8; 264]).is_none());
        let rb = Format::FP8.row_bytes(cols).unwrap();
        for (start, n) in [(0, rows), (120, 17), (199, 1)] {
            let mut values = vec![0f32; n * cols];
            ckpt.read_rows("w.weight", start, n, &mut values).unwrap();
            let mut blocks = vec![0u8; n * rb];
            ckpt.read_quantized("w.weight", Format::FP8, start, n, &mut blocks).unwrap().unwrap();
            let mut decoded = vec![0f32; n * cols];
            smoe_quant::dequantize(Format::FP8, &blocks, &mut decoded).unwrap();
            assert!(decoded == values, "rows {start}..{}: FP8 blocks decode to the f32 path's values", start + n);
            let want = smoe_quant::e4m3_to_f32(codes[start * cols + 130]) * scales[if start < 128 { 1 } else { 3 }];
            assert_eq!(decoded[130], want, "rows from {start}: column 130 takes its block's scale");
        }
        assert!(ckpt.read_quantized("w.weight", Format::FP8, 0, 2, &mut vec![0u8; rb]).unwrap().is_err(), "a short buffer");
        // A NaN code is refused in blocks as in values, at the same element.
        let nan = |e: ConvertError| matches!(e, ConvertError::Format(FormatError::NonFinite { index: 5, .. }));
        assert!(nan(ckpt.read_quantized("x.weight", Format::FP8, 0, 1, &mut [0u8; 132]).unwrap().unwrap_err()));
        assert!(nan(ckpt.read_rows("x.weight", 0, 1, &mut [0f32; 128]).unwrap_err()));
    }
}
