//! GGUF (v3), llama.cpp's file format: reading metadata and tensor directories (writing is
//! `smoe-convert`'s).
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, metadata key/value pairs, tensor
//! infos (name, dimensions innermost first, ggml type, offset), padding to `general.alignment`
//! (32 by default), then tensor data at those offsets.

mod model;
pub mod names;
pub mod vocab;

pub use model::{DenseSpec, GgufModel, StackedPart};

use crate::FormatError;
use smoe_quant::Format;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

/// The file's first four bytes.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment llama.cpp uses unless `general.alignment` says otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of one element type.
    Array(Vec<Value>),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

impl Value {
    /// The GGUF type id written before a value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    /// As an unsigned integer, if it is any integer type that fits.
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            Value::U8(v) => v as u64,
            Value::U16(v) => v as u64,
            Value::U32(v) => v as u64,
            Value::U64(v) => v,
            Value::I8(v) if v >= 0 => v as u64,
            Value::I16(v) if v >= 0 => v as u64,
            Value::I32(v) if v >= 0 => v as u64,
            Value::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }
    /// As a float, if it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's directory entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Name (`blk.3.ffn_gate_exps.weight`).
    pub name: String,
    /// Dimensions, innermost (row length) first.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub ggml_type: u32,
    /// Absolute offset of the data in its file.
    pub offset: u64,
    /// Which file of a split set holds it.
    pub file: usize,
}

impl TensorInfo {
    /// The storage format, or an error naming the tensor and its type.
    pub fn format(&self) -> Result<Format, FormatError> {
        Format::from_ggml_id(self.ggml_type).map_err(|_| {
            FormatError::Unsupported(format!(
                "tensor {} has ggml type {} ({}), which smoe does not support",
                self.name,
                self.ggml_type,
                ggml_type_name(self.ggml_type)
            ))
        })
    }
    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
    /// Rows (product of the outer dimensions).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
    /// Bytes of data.
    pub fn len(&self) -> Result<u64, FormatError> {
        let f = self.format()?;
        let row = f.row_bytes(self.cols()).map_err(|e| FormatError::BadInput(format!("{}: {e}", self.name)))?;
        Ok((row * self.rows()) as u64)
    }
    /// Whether the tensor holds no data.
    pub fn is_empty(&self) -> bool {
        self.rows() == 0 || self.cols() == 0
    }
}

/// Names of ggml types smoe does not support, for error messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        9 => "Q8_1",
        15 => "Q8_K",
        id => Format::from_ggml_id(id).map(|f| f.name()).unwrap_or("unknown"),
    }
}

/// A parsed GGUF file (or set of split files).
pub struct Gguf {
    /// The files (one, or the parts of a split set in order).
    pub paths: Vec<PathBuf>,
    /// Metadata of the first file.
    pub meta: BTreeMap<String, Value>,
    /// Tensors of all files, in file order.
    pub tensors: Vec<TensorInfo>,
}

/// Elements a tensor may claim: far above any real model (2^48), and low enough that rows ×
/// row bytes cannot overflow. A header claiming more is refused before anything is allocated.
const MAX_ELEMENTS: u64 = 1 << 48;

struct Reader<R: Read> {
    r: R,
    path: PathBuf,
    /// Bytes read so far, and the file's length: every count in the header is checked against
    /// what the rest of the file could hold before anything is allocated for it.
    pos: u64,
    len: u64,
}

impl<R: Read> Reader<R> {
    fn bad(&self, m: &str) -> FormatError {
        FormatError::BadInput(format!("{}: {m}", self.path.display()))
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|_| self.bad("truncated GGUF header"))?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    /// Bytes left in the file after the header read so far.
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }
    /// Refuses a count of `n` items of at least `each` bytes that the rest of the file cannot hold.
    fn fits(&self, n: u64, each: u64, what: &str) -> Result<(), FormatError> {
        if n.checked_mul(each).is_none_or(|b| b > self.left()) {
            return Err(self.bad(&format!("{what} claims {n} entries, more than the {} bytes left in the file hold", self.left())));
        }
        Ok(())
    }
    fn string(&mut self) -> Result<String, FormatError> {
        let n = self.u64()?;
        self.fits(n, 1, "a string")?;
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).map_err(|_| self.bad("truncated string"))?;
        self.pos += n;
        String::from_utf8(b).map_err(|_| self.bad("string is not UTF-8"))
    }
    fn value(&mut self, t: u32, depth: usize) -> Result<Value, FormatError> {
        Ok(match t {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 if depth == 0 => {
                let et = self.u32()?;
                let n = self.u64()?;
                // The smallest encoding of one element (a string: its 8-byte length).
                let each = match et {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                self.fits(n, each, "an array")?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            _ => return Err(self.bad(&format!("unknown metadata value type {t}"))),
        })
    }
}

/// Parses the header of one GGUF file: metadata, tensor infos with absolute offsets.
fn read_one(path: &Path, file_index: usize) -> Result<(BTreeMap<String, Value>, Vec<TensorInfo>), FormatError> {
    let f = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let len = f.metadata().map_err(|e| FormatError::io(path, e))?.len();
    let mut r = Reader { r: std::io::BufReader::with_capacity(1 << 20, f), path: path.to_path_buf(), pos: 0, len };
    if &r.bytes::<4>()? != MAGIC {
        return Err(r.bad("not a GGUF file (bad magic)"));
    }
    let version = r.u32()?;
    if version != 3 && version != 2 {
        return Err(r.bad(&format!("GGUF version {version} is not supported (2 and 3 are)")));
    }
    let n_tensors = r.u64()?;
    let n_kv = r.u64()?;
    // A tensor's info takes at least 32 bytes (name length, one dimension, type, offset), a
    // key/value pair 13 (key length, type, one byte).
    r.fits(n_tensors, 32, "the tensor count")?;
    r.fits(n_kv, 13, "the metadata count")?;
    let mut meta = BTreeMap::new();
    for _ in 0..n_kv {
        let k = r.string()?;
        let t = r.u32()?;
        let v = r.value(t, 0)?;
        meta.insert(k, v);
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = r.string()?;
        let nd = r.u32()?;
        if nd == 0 || nd > 4 {
            return Err(r.bad(&format!("tensor {name} has {nd} dimensions")));
        }
        let dims = (0..nd).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        if dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).is_none_or(|e| e > MAX_ELEMENTS) {
            return Err(r.bad(&format!("tensor {name} claims dimensions {dims:?}: more elements than any model has")));
        }
        let ggml_type = r.u32()?;
        let offset = r.u64()?;
        tensors.push(TensorInfo { name, dims, ggml_type, offset, file: file_index });
    }
    let align = meta.get("general.alignment").and_then(|v| v.as_u64()).unwrap_or(DEFAULT_ALIGNMENT);
    if align == 0 || !align.is_power_of_two() {
        return Err(r.bad(&format!("general.alignment {align} is not a power of two")));
    }
    let pos = r.r.stream_position().map_err(|e| FormatError::io(path, e))?;
    let data = pos.div_ceil(align) * align;
    for t in &mut tensors {
        // A type smoe does not read is refused, with the tensor's name, where it is used.
        let l = t.len().unwrap_or(0);
        match t.offset.checked_add(data).and_then(|o| o.checked_add(l)) {
            Some(end) if end <= len => t.offset += data,
            _ => return Err(r.bad(&format!("tensor {} lies past the end of the file (truncated download?)", t.name))),
        }
    }
    Ok((meta, tensors))
}

impl Gguf {
    /// Opens a GGUF file; a `NAME-00001-of-0000N.gguf` path opens the whole split set.
    pub fn open(path: &Path) -> Result<Gguf, FormatError> {
        let paths = split_paths(path)?;
        let (meta, mut tensors) = read_one(&paths[0], 0)?;
        for (i, p) in paths.iter().enumerate().skip(1) {
            let (_, t) = read_one(p, i)?;
            tensors.extend(t);
        }
        Ok(Gguf { paths, meta, tensors })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// The files of a split set (`-00001-of-00003.gguf`), or just `path`.
pub fn split_paths(path: &Path) -> Result<Vec<PathBuf>, FormatError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if let Some(stem) = name.strip_suffix(".gguf") {
        if let Some((base, rest)) = stem.rsplit_once("-of-") {
            if let (Some((prefix, idx)), Ok(total)) = (base.rsplit_once('-'), rest.parse::<usize>()) {
                if idx.parse::<usize>().is_ok() && total > 0 {
                    let width = rest.len();
                    let paths: Vec<PathBuf> =
                        (1..=total).map(|i| path.with_file_name(format!("{prefix}-{i:0width$}-of-{rest}.gguf"))).collect();
                    if let Some(missing) = paths.iter().find(|p| !p.exists()) {
                        return Err(FormatError::BadInput(format!("split GGUF part {} is missing", missing.display())));
                    }
                    return Ok(paths);
                }
            }
        }
    }
    Ok(vec![path.to_path_buf()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_llama_cpp_fixture() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf/qwen3_moe.bf16.gguf");
        let g = Gguf::open(&p).unwrap();
        assert_eq!(g.get("general.architecture").unwrap().as_str(), Some("qwen3moe"));
        assert_eq!(g.get("qwen3moe.expert_count").unwrap().as_u64(), Some(8));
        assert_eq!(g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().len(), 1024);
        let t = g.tensor("blk.0.ffn_gate_exps.weight").unwrap();
        assert_eq!(t.dims, vec![64, 32, 8]);
        assert_eq!(t.format().unwrap(), Format::BF16);
        assert_eq!(t.offset % 32, 0);
    }

    #[test]
    fn split_names_expand_and_missing_parts_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("M-00001-of-00002.gguf");
        std::fs::write(&a, b"x").unwrap();
        let e = split_paths(&a).unwrap_err().to_string();
        assert!(e.contains("M-00002-of-00002.gguf"), "{e}");
        std::fs::write(dir.path().join("M-00002-of-00002.gguf"), b"x").unwrap();
        assert_eq!(split_paths(&a).unwrap().len(), 2);
        assert_eq!(split_paths(&dir.path().join("plain.gguf")).unwrap().len(), 1);
    }

    #[test]
    fn bad_files_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.gguf");
        for content in [&b""[..], b"GGUF", b"XXXX\x03\0\0\0", b"GGUF\x09\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0"] {
            std::fs::write(&p, content).unwrap();
            assert!(Gguf::open(&p).is_err());
        }
        let good = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf/qwen3_moe.bf16.gguf")).unwrap();
        std::fs::write(&p, &good[..good.len() / 2]).unwrap();
        let e = Gguf::open(&p).err().unwrap().to_string();
        assert!(e.contains("past the end"), "{e}");
    }

    /// A GGUF header: version 3, `n_tensors` and the given metadata pairs, then `rest`.
    fn header(n_tensors: u64, kv: &[(&str, u32, Vec<u8>)], rest: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (k, t, v) in kv {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(t.to_le_bytes());
            b.extend(v);
        }
        b.extend(rest);
        b
    }

    /// Counts and sizes that the file cannot hold are refused before anything is allocated for
    /// them (a 10^9-entry vocabulary, a 2^60-element tensor, a 2^40-byte string, 2^40 tensors):
    /// each test file is a few dozen bytes.
    #[test]
    fn hostile_counts_are_refused_before_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("hostile.gguf");
        let array = |et: u32, n: u64| [et.to_le_bytes().to_vec(), n.to_le_bytes().to_vec()].concat();
        let tensor = |name: &str, dims: &[u64]| {
            let mut t = (name.len() as u64).to_le_bytes().to_vec();
            t.extend(name.as_bytes());
            t.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                t.extend(d.to_le_bytes());
            }
            t.extend(0u32.to_le_bytes()); // F32
            t.extend(0u64.to_le_bytes());
            t
        };
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            (
                "a 10^9-entry vocabulary",
                header(0, &[("tokenizer.ggml.tokens", 9, array(8, 1_000_000_000))], &[]),
                "an array claims 1000000000",
            ),
            ("a 2^40-element array of u8", header(0, &[("x", 9, array(0, 1 << 40))], &[]), "an array claims"),
            ("a 2^40-byte string", header(0, &[("x", 8, (1u64 << 40).to_le_bytes().to_vec())], &[]), "a string claims"),
            ("2^40 tensors", header(1 << 40, &[], &[]), "the tensor count claims"),
            ("a 2^60-element tensor", header(1, &[], &tensor("blk.0.attn_q.weight", &[1 << 30, 1 << 30])), "more elements than any model"),
            (
                "dimensions whose product overflows",
                header(1, &[], &tensor("t", &[1 << 40, 1 << 40, 1 << 40])),
                "more elements than any model",
            ),
            ("a tensor past the end", header(1, &[], &tensor("t", &[64, 64])), "past the end"),
        ];
        for (what, bytes, want) in cases {
            std::fs::write(&p, &bytes).unwrap();
            let e = Gguf::open(&p).err().unwrap_or_else(|| panic!("{what}: opened")).to_string();
            assert!(e.contains(want), "{what}: {e}");
        }
    }
}
