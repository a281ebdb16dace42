//! Helpers shared by the engine's integration tests: fixture paths, shattering into a
//! temporary directory, and reading reference.safetensors.

#![allow(dead_code)]

use smoe_convert::{shatter, ExpertFormats, ShatterOptions, Silent};
use smoe_quant::Format;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Every fixture family's directory under testdata/hf (one per model type, plus the YaRN and
/// K-quant variants).
pub const ALL_FIXTURES: [&str; 15] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_moe_yarn",
    "qwen3_moe_k",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "minimax_m2",
    "gpt_oss",
    "glm_moe_dsa",
    "deepseek_v4",
    "qwen3_next",
    "qwen3_5_moe",
];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf").join(name)
}

/// Shatters a fixture once per test process into a shared temporary directory, under cargo's
/// per-target temporary folder (`target/tmp`). A static is never dropped, so the directory
/// outlives its process: in `/tmp` these vaults piled up by the hundred (14 GB after a few days
/// of test runs). Each directory is named after its process, and a new process removes those
/// of processes that have ended (where `/proc` says which).
pub fn vault(name: &str, experts: impl Into<ExpertFormats>, dense: Format) -> PathBuf {
    let experts: ExpertFormats = experts.into();
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let dir = DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
        remove_ended_processes_vaults(root);
        tempfile::Builder::new().prefix(&format!("fixture-vaults-{}-", std::process::id())).tempdir_in(root).unwrap()
    });
    let out = dir.path().join(format!("{name}-{experts}-{dense}.smoe"));
    let _g = LOCK.lock().unwrap();
    if !out.exists() {
        let opts = ShatterOptions { experts, dense, threads: Some(2), ..Default::default() };
        shatter(&fixture(name), &out, &opts, &Silent).unwrap();
    }
    out
}

/// Removes `fixture-vaults-PID-*` folders under `root` whose process no longer runs (Linux only:
/// elsewhere there is no `/proc` to ask, and they stay until `target/` goes).
fn remove_ended_processes_vaults(root: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix("fixture-vaults-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// A fixture's `{tag}.input_ids` (`chat` or `long`) from its reference.safetensors.
pub fn input_ids(name: &str, tag: &str) -> Vec<u32> {
    read_safetensors(&fixture(name).join("reference.safetensors"))[&format!("{tag}.input_ids")].i32().iter().map(|&x| x as u32).collect()
}

/// A tensor from a safetensors file, as f32 (F32) or i32 (I32) values.
pub enum Tensor {
    F32(Vec<usize>, Vec<f32>),
    I32(Vec<usize>, Vec<i32>),
}

impl Tensor {
    pub fn f32(&self) -> &[f32] {
        match self {
            Tensor::F32(_, v) => v,
            _ => panic!("not f32"),
        }
    }
    pub fn i32(&self) -> &[i32] {
        match self {
            Tensor::I32(_, v) => v,
            _ => panic!("not i32"),
        }
    }
    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::F32(s, _) | Tensor::I32(s, _) => s,
        }
    }
}

pub fn read_safetensors(path: &Path) -> HashMap<String, Tensor> {
    let raw = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&raw[8..8 + n]).unwrap();
    let data = &raw[8 + n..];
    let mut out = HashMap::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let shape: Vec<usize> = info["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        let (s, e) = (info["data_offsets"][0].as_u64().unwrap() as usize, info["data_offsets"][1].as_u64().unwrap() as usize);
        let bytes = &data[s..e];
        let t = match info["dtype"].as_str().unwrap() {
            "F32" => Tensor::F32(shape, bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
            "I32" => Tensor::I32(shape, bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()),
            "I64" => Tensor::I32(shape, bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i32).collect()),
            d => panic!("dtype {d}"),
        };
        out.insert(name, t);
    }
    out
}

/// max |a - b| / max |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let max_abs = b.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let max_err = a.iter().zip(b).fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    max_err / max_abs
}

/// A copy of `src` with every tensor and expert part decoded to F32: a reference run on the
/// dequantized weights (the engine on F32 weights is itself checked against transformers).
pub fn dequantized_copy(src: &Path) -> PathBuf {
    use smoe_vault::{layout_blob, names, Vault, VaultWriter};
    let out = src.with_extension("dequant.smoe");
    if out.exists() {
        return out;
    }
    let v = Vault::open(src).unwrap();
    let m = v.manifest().clone();
    let mut w = VaultWriter::create(&out).unwrap();
    for d in &m.dense {
        let n: usize = d.shape.iter().product();
        let mut f = vec![0f32; n];
        smoe_quant::dequantize(d.format, &v.read_dense(&d.name).unwrap(), &mut f).unwrap();
        let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.add_tensor(&d.name, Format::F32, &d.shape, &bytes, &d.source).unwrap();
    }
    let parts: Vec<_> = m.experts.parts.iter().map(|p| (p.name.clone(), Format::F32, p.shape)).collect();
    let (new_parts, blob) = layout_blob(&parts, 4096).unwrap();
    let arch = v.architecture().clone();
    w.begin_experts(new_parts, blob, &arch.moe_layers(), arch.moe.num_experts).unwrap();
    let mut buf = vec![0u8; m.experts.blob_size as usize];
    for l in arch.moe_layers() {
        for e in 0..arch.moe.num_experts {
            v.read_blob(l, e, &mut buf).unwrap();
            let decoded: Vec<Vec<u8>> = m
                .experts
                .parts
                .iter()
                .map(|p| {
                    let mut f = vec![0f32; p.shape[0] * p.shape[1]];
                    smoe_quant::dequantize(p.format, &buf[p.offset as usize..(p.offset + p.len) as usize], &mut f).unwrap();
                    f.iter().flat_map(|x| x.to_le_bytes()).collect()
                })
                .collect();
            w.add_blob(l, e, &decoded.iter().map(|d| d.as_slice()).collect::<Vec<_>>()).unwrap();
        }
    }
    let _ = names::EXPERT_PARTS;
    w.finish(m).unwrap();
    out
}

/// llama.cpp's own K-quant files of qwen3_moe_k (testdata/gguf-kquant, written by
/// `llama-quantize`): the directory, the `long` input ids llama.cpp scored, and bf16 logits of
/// those ids (smoe's reference CPU backend on the fixture's bf16 vault), with the vocabulary.
pub fn kquant_case() -> (PathBuf, Vec<u32>, Vec<f32>, usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf-kquant");
    let ids: Vec<u32> =
        std::fs::read_to_string(dir.join("qwen3_moe_k.long-ids.txt")).unwrap().split_whitespace().map(|s| s.parse().unwrap()).collect();
    let bf16 = load(&vault("qwen3_moe_k", Format::BF16, Format::BF16));
    let reference = smoe_engine::score(&bf16, &ids, smoe_engine::ScoreMode::Prefill, 64, false).unwrap().logits;
    (dir, ids, reference, bf16.arch().vocab_size)
}

/// llama.cpp's logits on its `f` file of [`kquant_case`] (`Q4_K_M`, `Q2_K`).
pub fn kquant_llama_logits(dir: &Path, f: &str) -> Vec<f32> {
    std::fs::read(dir.join(format!("qwen3_moe_k.{f}.llama-logits.f32")))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Loads a vault with every expert resident on the reference CPU backend.
pub fn load(path: &Path) -> smoe_engine::Model<smoe_engine::CpuBackend> {
    let v = smoe_vault::Vault::open(path).unwrap();
    let ex = std::sync::Arc::new(smoe_store::ResidentExperts::load(&v).unwrap());
    smoe_engine::Model::load(&v, smoe_engine::CpuBackend::new(smoe_engine::Precision::Reference), ex).unwrap()
}

/// Top-1 agreement, mean KL(reference ‖ ours) and max relative logit error over rows.
pub fn distance(ours: &[f32], reference: &[f32], vocab: usize) -> (f64, f64, f64) {
    let rows = reference.len() / vocab;
    let (mut agree, mut kl) = (0usize, 0f64);
    for r in 0..rows {
        let (a, b) = (&ours[r * vocab..(r + 1) * vocab], &reference[r * vocab..(r + 1) * vocab]);
        let argmax = |v: &[f32]| v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best });
        agree += (argmax(a) == argmax(b)) as usize;
        let lse = |v: &[f32]| {
            let m = v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let (la, lb) = (lse(a), lse(b));
        kl += b
            .iter()
            .zip(a)
            .map(|(&pb, &pa)| {
                let lpb = pb as f64 - lb;
                lpb.exp() * (lpb - (pa as f64 - la))
            })
            .sum::<f64>();
    }
    (agree as f64 / rows as f64, kl / rows as f64, rel_err(ours, reference))
}
