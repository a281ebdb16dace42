//! Writing GGUF files: the header (metadata and tensor directory) first, then tensor data at
//! positioned offsets.
//!
//! Like a vault, the file is written under a temporary name beside the destination
//! (`OUT.gguf.tmp-PID`, [`smoe_vault::temp_path`]) and only `finish` syncs it and renames it
//! into place: an error, a full disk or a kill never leaves a half-written file under the
//! destination's name. Dropping an unfinished writer deletes the temporary file; one left by a
//! killed process is removed by the next writer of the same destination.

use crate::ConvertError;
use smoe_formats::gguf::{Value, DEFAULT_ALIGNMENT, MAGIC};
use smoe_formats::FormatError;
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

/// Writes a GGUF file: the header (metadata and tensor directory) at creation, then tensor data
/// at positioned offsets, in any order (so stacked expert tensors can be filled one expert at a
/// time).
pub struct Writer {
    file: File,
    /// The destination, which exists only once `finish` has renamed the file.
    path: PathBuf,
    /// The file being written.
    tmp: PathBuf,
    /// Renamed into place: nothing to clean up.
    done: bool,
    /// Absolute offset and length of each tensor's data.
    spans: Vec<(u64, u64)>,
    end: u64,
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn put_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&[*x as u8]),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[*x as u8]),
        Value::Str(s) => put_str(w, s),
        Value::Array(a) => {
            let et = a.first().map_or(4, |e| e.type_id());
            w.write_all(&et.to_le_bytes())?;
            w.write_all(&(a.len() as u64).to_le_bytes())?;
            a.iter().try_for_each(|e| put_value(w, e))
        }
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// One tensor of a file being written: name, dimensions (innermost first), ggml type, bytes.
pub type TensorDecl = (String, Vec<u64>, u32, u64);

impl Writer {
    /// Writes the header of the file bound for `path` (under its temporary name): `meta` and
    /// the tensor directory.
    pub fn create(path: &Path, meta: &[(String, Value)], tensors: &[TensorDecl]) -> Result<Writer, ConvertError> {
        let tmp = smoe_vault::temp_path(path)?;
        smoe_vault::remove_stale_temps(path);
        let file = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        // From here on the temporary file is removed on any error.
        let mut w = Writer { file, path: path.to_path_buf(), tmp, done: false, spans: Vec::new(), end: 0 };
        let (spans, end) = w.write_header(meta, tensors)?;
        (w.spans, w.end) = (spans, end);
        Ok(w)
    }

    /// Writes the header; returns each tensor's data span and the file's length.
    fn write_header(&self, meta: &[(String, Value)], tensors: &[TensorDecl]) -> Result<(Vec<(u64, u64)>, u64), ConvertError> {
        let path = self.tmp.as_path();
        let io = |e| FormatError::io(path, e);
        let mut out = BufWriter::with_capacity(8 << 20, &self.file);
        out.write_all(MAGIC).map_err(io)?;
        out.write_all(&3u32.to_le_bytes()).map_err(io)?;
        out.write_all(&(tensors.len() as u64).to_le_bytes()).map_err(io)?;
        out.write_all(&(meta.len() as u64).to_le_bytes()).map_err(io)?;
        for (k, v) in meta {
            put_str(&mut out, k).map_err(io)?;
            out.write_all(&v.type_id().to_le_bytes()).map_err(io)?;
            put_value(&mut out, v).map_err(io)?;
        }
        let mut rel = Vec::with_capacity(tensors.len());
        let mut off = 0u64;
        for (name, dims, ty, len) in tensors {
            put_str(&mut out, name).map_err(io)?;
            out.write_all(&(dims.len() as u32).to_le_bytes()).map_err(io)?;
            for d in dims {
                out.write_all(&d.to_le_bytes()).map_err(io)?;
            }
            out.write_all(&ty.to_le_bytes()).map_err(io)?;
            out.write_all(&off.to_le_bytes()).map_err(io)?;
            rel.push((off, *len));
            off = (off + len).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        }
        let pos = out.stream_position().map_err(io)?;
        let data_start = pos.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        out.write_all(&vec![0u8; (data_start - pos) as usize]).map_err(io)?;
        out.flush().map_err(io)?;
        Ok((rel.iter().map(|&(o, l)| (data_start + o, l)).collect(), data_start + off))
    }

    /// Writes `bytes` at `within` bytes into tensor `i`.
    pub fn write_at(&self, i: usize, within: u64, bytes: &[u8]) -> Result<(), ConvertError> {
        use std::os::unix::fs::FileExt;
        let (off, len) = self.spans[i];
        if within + bytes.len() as u64 > len {
            return Err(FormatError::Internal(format!("write past the end of GGUF tensor {i}")).into());
        }
        Ok(self.file.write_all_at(bytes, off + within).map_err(|e| FormatError::io(&self.tmp, e))?)
    }

    /// Sets the final length, syncs, and renames the file into place.
    pub fn finish(mut self) -> Result<(), ConvertError> {
        let io = |e| FormatError::io(&self.tmp, e);
        self.file.set_len(self.end).map_err(io)?;
        self.file.sync_all().map_err(io)?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| FormatError::io(&self.path, e))?;
        self.done = true;
        smoe_vault::sync_parent(&self.path);
        Ok(())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoe_formats::gguf::Gguf;

    /// A llama.cpp file's metadata written back with no tensors reads back the same.
    #[test]
    fn metadata_round_trips_through_the_writer() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf/qwen3_moe.bf16.gguf");
        let g = Gguf::open(&p).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let q = dir.path().join("m.gguf");
        let meta: Vec<(String, Value)> = g.meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Writer::create(&q, &meta, &[]).unwrap().finish().unwrap();
        let g2 = Gguf::open(&q).unwrap();
        assert_eq!(g2.meta, g.meta);
    }

    /// The file exists under its name only once finished: an unfinished writer (an error on
    /// the way) leaves nothing; a temporary file left by a killed process is removed by the next
    /// writer, one of a live process is not.
    #[test]
    fn only_a_finished_file_appears_under_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let q = dir.path().join("m.gguf");
        let t = [("t".to_string(), vec![4u64], 0u32, 16u64)];
        let w = Writer::create(&q, &[], &t).unwrap();
        w.write_at(0, 0, &[1u8; 16]).unwrap();
        assert!(!q.exists() && smoe_vault::temp_path(&q).unwrap().exists());
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "an unfinished writer leaves nothing");
        // A process that has exited, and this one's parent (alive), each left a temporary file.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let live = std::os::unix::process::parent_id();
        for pid in [dead, live] {
            std::fs::write(dir.path().join(format!("m.gguf.tmp-{pid}")), b"partial").unwrap();
        }
        let w = Writer::create(&q, &[], &t).unwrap();
        w.write_at(0, 0, &[1u8; 16]).unwrap();
        w.finish().unwrap();
        let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, vec!["m.gguf".to_string(), format!("m.gguf.tmp-{live}")]);
        assert_eq!(Gguf::open(&q).unwrap().tensors.len(), 1);
    }
}
