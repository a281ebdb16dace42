//! Helpers shared by the engine's integration tests: fixture paths, shattering into a
//! temporary directory, and reading reference.safetensors.

#![allow(dead_code)]

use smoe_convert::{shatter, ShatterOptions, Silent};
use smoe_quant::Format;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf").join(name)
}

/// Shatters a fixture once per test process into a shared temporary directory.
pub fn vault(name: &str, experts: Format, dense: Format) -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let out = dir.path().join(format!("{name}-{experts}-{dense}.smoe"));
    let _g = LOCK.lock().unwrap();
    if !out.exists() {
        let opts = ShatterOptions { experts, dense, threads: Some(2), fail_after_blobs: None };
        shatter(&fixture(name), &out, &opts, &Silent).unwrap();
    }
    out
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
