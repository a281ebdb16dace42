//! `smoe shatter FILE.gguf`: a GGUF opened by `smoe_formats::gguf::GgufModel`, copied into a
//! vault.

use crate::{ConvertError, Progress, ShatterReport};
use smoe_formats::gguf::{DenseSpec, GgufModel};
use smoe_formats::FormatError;
use smoe_quant::Format;
use smoe_vault::names;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// `smoe shatter FILE.gguf`: the GGUF's tensors into a vault, quantized blocks copied bit for
/// bit (never re-quantized), experts split out of the stacked tensors one blob at a time, so
/// memory stays bounded by one expert.
pub fn shatter_gguf(path: &Path, out: &Path, progress: &dyn Progress) -> Result<ShatterReport, ConvertError> {
    let t0 = std::time::Instant::now();
    let m = GgufModel::open(path)?;
    let arch = &m.arch;
    let n = arch.moe.num_experts;
    let dense_total: u64 = m.dense.iter().map(DenseSpec::bytes).sum();
    let expert_total: u64 = m.experts.iter().map(|l| l.iter().map(|p| p.bytes).sum::<u64>()).sum::<u64>() * n as u64;
    progress.start(dense_total + expert_total);
    let mut w = smoe_vault::VaultWriter::create(out)?;
    let mut dense_bytes = 0;
    for d in &m.dense {
        let b = m.read_dense(d)?;
        w.add_tensor(&d.name, d.format, &d.shape, &b, "gguf")?;
        progress.advance(b.len() as u64);
        dense_bytes += b.len() as u64;
    }
    // Per layer parts: layers whose formats differ (Q4_K_M keeps some `down` in Q6_K) list
    // their own.
    let specs: Vec<Vec<(String, Format, [usize; 2])>> = m
        .experts
        .iter()
        .map(|l| names::EXPERT_PARTS.iter().zip(l).map(|(name, p)| (name.to_string(), p.format, [p.rows, p.cols])).collect())
        .collect();
    let moe_layers = arch.moe_layers();
    let (blob_size, expert_bytes) = w.begin_experts_by_layer(&specs, &moe_layers, n)?;
    let files = m.gguf.paths.iter().map(|p| File::open(p).map_err(|e| FormatError::io(p, e))).collect::<Result<Vec<_>, _>>()?;
    let mut bufs: [Vec<u8>; 3] = Default::default();
    for (li, &l) in moe_layers.iter().enumerate() {
        for e in 0..n {
            for (buf, p) in bufs.iter_mut().zip(&m.experts[li]) {
                buf.resize(p.bytes as usize, 0);
                files[p.file]
                    .read_exact_at(buf, p.offset + e as u64 * p.bytes)
                    .map_err(|err| FormatError::io(&m.gguf.paths[p.file], err))?;
            }
            w.add_blob(l, e, &[&bufs[0], &bufs[1], &bufs[2]])?;
            progress.advance(bufs.iter().map(|b| b.len() as u64).sum());
        }
    }
    let mut manifest = m.manifest();
    if specs.iter().any(|l| *l != specs[0]) {
        manifest.notes.push("expert formats differ between layers (a mixed quantization)".into());
    }
    for n in &manifest.notes {
        progress.note(n);
    }
    let notes = manifest.notes.clone();
    let file_len = w.finish(manifest)?;
    progress.finish();
    Ok(ShatterReport {
        path: out.to_path_buf(),
        file_len,
        dense_bytes,
        expert_bytes,
        blob_size,
        source_bytes: dense_total + expert_total,
        notes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
