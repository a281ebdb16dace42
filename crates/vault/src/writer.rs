//! Writing a vault: sequential, streaming, atomic.
//!
//! The writer fills a temporary file next to the destination (`OUT.smoe.tmp-PID`): a zeroed
//! header page, the dense tensors, the expert blobs, then the manifest. Only `finish` writes the
//! real header, fsyncs and renames the file into place, so an interrupted conversion (an error,
//! a panic, a kill) never leaves a file under the destination name. Dropping an unfinished
//! writer deletes the temporary file; a killed one cannot, and the next writer of the same
//! destination removes what it left ([`remove_stale_temps`]). [`temp_path`] and
//! [`sync_parent`] are the same steps for other writers (`smoe export-gguf`).

use crate::header::{Header, DEFAULT_ALIGNMENT, FORMAT_MAJOR, FORMAT_MINOR};
use crate::manifest::{DenseEntry, ExpertIndex, ExpertLayer, Manifest, PartEntry};
use crate::VaultError;
use smoe_quant::Format;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::Xxh3;

/// Alignment of each dense tensor inside the dense region (enough for any SIMD load).
pub const DENSE_TENSOR_ALIGN: u64 = 64;
/// Alignment of each part inside an expert blob.
pub const PART_ALIGN: u64 = 64;

fn round_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// The temporary name under which a file bound for `path` is written: `NAME.tmp-PID` beside
/// it (same directory, so the final rename is atomic).
pub fn temp_path(path: &Path) -> Result<PathBuf, VaultError> {
    let file_name = path.file_name().ok_or_else(|| VaultError::Corrupt(format!("bad output path {}", path.display())))?;
    // Said up front: creating the temporary file would otherwise fail naming only itself.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        return Err(VaultError::Io {
            path: dir.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "the output directory does not exist (or is not a directory)"),
        });
    }
    Ok(path.with_file_name(format!("{}.tmp-{}", file_name.to_string_lossy(), std::process::id())))
}

/// Removes the temporary files ([`temp_path`]) beside `path` whose writing process no longer
/// exists: what a writer killed with SIGKILL, or cut off by a power failure, left behind.
/// Temporary files of live processes are left alone. Returns how many were removed.
///
/// A process is judged by its id in this machine's process table: a writer on another machine
/// sharing the directory is not seen, and its temporary file would be removed (its rename then
/// fails; nothing complete is lost).
pub fn remove_stale_temps(path: &Path) -> usize {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return 0 };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!("{}.tmp-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)).and_then(|p| p.parse::<i32>().ok()) else { continue };
        if pid <= 0 || pid as u32 == std::process::id() || process_exists(pid) {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn process_exists(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Fsyncs the directory holding `path`, so that a rename into it survives a power failure.
/// Best effort: some filesystems refuse to sync a directory, and the file itself is already
/// synced.
pub fn sync_parent(path: &Path) {
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
}

/// Lays out the parts of an expert blob; returns the parts with offsets and the blob size.
pub fn layout_blob(parts: &[(String, Format, [usize; 2])], alignment: u32) -> Result<(Vec<PartEntry>, u64), VaultError> {
    let mut off = 0u64;
    let mut out = Vec::with_capacity(parts.len());
    for (name, format, shape) in parts {
        let row = format.row_bytes(shape[1]).map_err(|e| VaultError::Corrupt(format!("expert {name}: {e}")))?;
        let len = (row * shape[0]) as u64;
        out.push(PartEntry { name: name.clone(), format: *format, shape: *shape, offset: off, len });
        off = round_up(off + len, PART_ALIGN);
    }
    Ok((out, round_up(off.max(1), alignment as u64)))
}

/// A vault being written. See the module documentation.
pub struct VaultWriter {
    final_path: PathBuf,
    tmp_path: PathBuf,
    out: Option<BufWriter<File>>,
    pos: u64,
    alignment: u32,
    dense_offset: u64,
    dense: Vec<DenseEntry>,
    open_tensor: Option<(DenseEntry, Xxh3, u64)>,
    experts_offset: u64,
    experts: Option<ExpertIndex>,
    next_blob: (usize, usize),
    num_experts: usize,
    blob_buf: Vec<u8>,
}

impl VaultWriter {
    /// Starts writing to a temporary file beside `path`.
    pub fn create(path: &Path) -> Result<VaultWriter, VaultError> {
        let tmp_path = temp_path(path)?;
        remove_stale_temps(path);
        let file = File::create(&tmp_path).map_err(|e| VaultError::io(&tmp_path, e))?;
        let mut w = VaultWriter {
            final_path: path.to_path_buf(),
            tmp_path,
            out: Some(BufWriter::with_capacity(8 << 20, file)),
            pos: 0,
            alignment: DEFAULT_ALIGNMENT,
            dense_offset: 0,
            dense: Vec::new(),
            open_tensor: None,
            experts_offset: 0,
            experts: None,
            next_blob: (0, 0),
            num_experts: 0,
            blob_buf: Vec::new(),
        };
        // The first page is the header, written last.
        w.write_all(&vec![0u8; w.alignment as usize])?;
        w.dense_offset = w.pos;
        Ok(w)
    }

    /// The temporary file being written.
    pub fn tmp_path(&self) -> &Path {
        &self.tmp_path
    }

    fn write_all(&mut self, b: &[u8]) -> Result<(), VaultError> {
        let out = self.out.as_mut().expect("writer used after finish");
        out.write_all(b).map_err(|e| VaultError::io(&self.tmp_path, e))?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> Result<(), VaultError> {
        let target = round_up(self.pos, align);
        const ZEROS: [u8; 4096] = [0; 4096];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.write_all(&ZEROS[..n])?;
        }
        Ok(())
    }

    /// Begins a dense tensor whose bytes follow through [`write_tensor_bytes`](Self::write_tensor_bytes).
    pub fn begin_tensor(&mut self, name: &str, format: Format, shape: &[usize], source: &str) -> Result<(), VaultError> {
        if self.open_tensor.is_some() || self.experts.is_some() {
            return Err(VaultError::Usage("begin_tensor while another tensor is open or after experts began"));
        }
        self.pad_to(DENSE_TENSOR_ALIGN)?;
        let cols = *shape.last().unwrap_or(&0);
        format.row_bytes(cols).map_err(|e| VaultError::Corrupt(format!("{name}: {e}")))?;
        let len = crate::manifest::dense_len(format, shape)
            .ok_or_else(|| VaultError::Corrupt(format!("{name}: shape {shape:?} is too large for any file")))?;
        let entry = DenseEntry {
            name: name.to_string(),
            format,
            shape: shape.to_vec(),
            offset: self.pos - self.dense_offset,
            len,
            checksum: 0,
            source: source.to_string(),
        };
        self.open_tensor = Some((entry, Xxh3::new(), 0));
        Ok(())
    }

    /// Appends bytes of the open tensor.
    pub fn write_tensor_bytes(&mut self, b: &[u8]) -> Result<(), VaultError> {
        let Some((entry, hasher, written)) = self.open_tensor.as_mut() else {
            return Err(VaultError::Usage("write_tensor_bytes without begin_tensor"));
        };
        if *written + b.len() as u64 > entry.len {
            return Err(VaultError::Corrupt(format!("{}: more bytes than its shape holds", entry.name)));
        }
        hasher.update(b);
        *written += b.len() as u64;
        self.write_all(b)
    }

    /// Closes the open tensor, checking its length.
    pub fn end_tensor(&mut self) -> Result<(), VaultError> {
        let Some((mut entry, hasher, written)) = self.open_tensor.take() else {
            return Err(VaultError::Usage("end_tensor without begin_tensor"));
        };
        if written != entry.len {
            return Err(VaultError::Corrupt(format!("{}: wrote {written} bytes, shape needs {}", entry.name, entry.len)));
        }
        entry.checksum = hasher.digest();
        self.dense.push(entry);
        Ok(())
    }

    /// Writes a whole dense tensor at once.
    pub fn add_tensor(&mut self, name: &str, format: Format, shape: &[usize], data: &[u8], source: &str) -> Result<(), VaultError> {
        self.begin_tensor(name, format, shape, source)?;
        self.write_tensor_bytes(data)?;
        self.end_tensor()
    }

    /// Ends the dense region and starts the expert region. Blobs must then be added layer by
    /// layer (in `moe_layers` order), expert by expert.
    pub fn begin_experts(
        &mut self,
        parts: Vec<PartEntry>,
        blob_size: u64,
        moe_layers: &[usize],
        num_experts: usize,
    ) -> Result<(), VaultError> {
        if self.open_tensor.is_some() {
            return Err(VaultError::Usage("begin_experts with a tensor open"));
        }
        if !blob_size.is_multiple_of(self.alignment as u64) {
            return Err(VaultError::Corrupt(format!("blob size {blob_size} is not aligned")));
        }
        self.pad_to(self.alignment as u64)?;
        self.experts_offset = self.pos;
        self.num_experts = num_experts;
        self.blob_buf = vec![0u8; blob_size as usize];
        let layers = moe_layers
            .iter()
            .map(|&layer| ExpertLayer { layer, checksums: Vec::with_capacity(num_experts), parts: None, blob_size: None })
            .collect();
        self.experts = Some(ExpertIndex { blob_size, parts, layers });
        Ok(())
    }

    /// [`begin_experts`](Self::begin_experts) for layers whose parts may differ (a mixed
    /// quantization: Q4_K_M keeps some layers' `down` in Q6_K). `layers[i]` lists the parts of
    /// MoE layer `moe_layers[i]` as (name, format, [rows, cols]) in blob order; a model without
    /// MoE layers passes one entry, the parts its manifest lists. Each layer's blobs take the
    /// size its own parts need, with no padding to the largest; layers unlike the first list
    /// their own parts, those smaller than the largest their own size, and
    /// [`finish`](Self::finish) then declares
    /// [`LAYER_EXPERT_PARTS`](crate::manifest::LAYER_EXPERT_PARTS) and
    /// [`LAYER_BLOB_SIZES`](crate::manifest::LAYER_BLOB_SIZES). Returns the largest blob size
    /// and the bytes of the whole expert region.
    pub fn begin_experts_by_layer(
        &mut self,
        layers: &[Vec<(String, Format, [usize; 2])>],
        moe_layers: &[usize],
        num_experts: usize,
    ) -> Result<(u64, u64), VaultError> {
        if layers.len() != moe_layers.len().max(1) {
            return Err(VaultError::Usage("one list of expert parts per MoE layer"));
        }
        let layouts = layers.iter().map(|specs| layout_blob(specs, self.alignment)).collect::<Result<Vec<_>, _>>()?;
        let blob_size = layouts.iter().map(|(_, size)| *size).max().unwrap_or(0);
        let first = layouts[0].0.clone();
        self.begin_experts(first.clone(), blob_size, moe_layers, num_experts)?;
        for (&l, (parts, size)) in moe_layers.iter().zip(layouts) {
            if parts != first {
                self.set_layer_parts(l, parts)?;
            }
            if size < blob_size {
                let idx = self.experts.as_mut().expect("begun above");
                idx.layers.iter_mut().find(|x| x.layer == l).expect("a MoE layer").blob_size = Some(size);
            }
        }
        let idx = self.experts.as_ref().expect("begun above");
        let region = (0..idx.layers.len()).map(|i| num_experts as u64 * idx.layer_blob_size(i)).sum();
        Ok((blob_size, region))
    }

    /// Gives decoder layer `layer` its own parts (a mixed quantization); they must fit the blob
    /// size. Call after [`begin_experts`](Self::begin_experts), before the layer's first blob;
    /// [`finish`](Self::finish) declares
    /// [`LAYER_EXPERT_PARTS`](crate::manifest::LAYER_EXPERT_PARTS).
    pub fn set_layer_parts(&mut self, layer: usize, parts: Vec<PartEntry>) -> Result<(), VaultError> {
        let idx = self.experts.as_mut().ok_or(VaultError::Usage("set_layer_parts before begin_experts"))?;
        if parts.iter().any(|p| p.offset + p.len > idx.blob_size) || parts.len() != idx.parts.len() {
            return Err(VaultError::Usage("layer parts do not fit the blob"));
        }
        let l = idx.layers.iter_mut().find(|l| l.layer == layer).ok_or(VaultError::Usage("set_layer_parts: not a MoE layer"))?;
        l.parts = Some(parts);
        Ok(())
    }

    /// Writes the next blob from its parts' bytes (in part order); padding is zero-filled.
    pub fn add_blob(&mut self, layer: usize, expert: usize, parts: &[&[u8]]) -> Result<(), VaultError> {
        let idx = self.experts.as_ref().ok_or(VaultError::Usage("add_blob before begin_experts"))?;
        let (li, e) = self.next_blob;
        if li >= idx.layers.len() || idx.layers[li].layer != layer || e != expert {
            return Err(VaultError::Usage("blobs must be added in layer and expert order"));
        }
        let layer_parts = idx.layers[li].parts.as_ref().unwrap_or(&idx.parts);
        if parts.len() != layer_parts.len() {
            return Err(VaultError::Usage("wrong number of blob parts"));
        }
        let size = idx.layer_blob_size(li) as usize;
        let mut whole = std::mem::take(&mut self.blob_buf);
        let buf = &mut whole[..size];
        buf.fill(0);
        for (p, data) in layer_parts.iter().zip(parts) {
            if data.len() as u64 != p.len {
                self.blob_buf = whole;
                return Err(VaultError::Corrupt(format!(
                    "layer {layer} expert {expert} {}: {} bytes, expected {}",
                    p.name,
                    data.len(),
                    p.len
                )));
            }
            buf[p.offset as usize..(p.offset + p.len) as usize].copy_from_slice(data);
        }
        let sum = xxhash_rust::xxh3::xxh3_64(buf);
        let res = self.write_all(&whole[..size]);
        self.blob_buf = whole;
        res?;
        let idx = self.experts.as_mut().unwrap();
        idx.layers[li].checksums.push(sum);
        self.next_blob = if e + 1 == self.num_experts { (li + 1, 0) } else { (li, e + 1) };
        Ok(())
    }

    /// Adds every remaining blob as zeros without writing them: the file gets a hole there (no
    /// disk used on filesystems with sparse files). For vaults whose experts are written
    /// elsewhere: `synth` straight into GGUF keeps only the dense part of its vault.
    pub fn add_zero_blobs(&mut self) -> Result<(), VaultError> {
        let idx = self.experts.as_mut().ok_or(VaultError::Usage("add_zero_blobs before begin_experts"))?;
        let zeros = vec![0u8; idx.blob_size as usize];
        let mut skip = 0u64;
        for i in self.next_blob.0..idx.layers.len() {
            let size = idx.layer_blob_size(i);
            let zero = xxhash_rust::xxh3::xxh3_64(&zeros[..size as usize]);
            let l = &mut idx.layers[i];
            while l.checksums.len() < self.num_experts {
                l.checksums.push(zero);
                skip += size;
            }
        }
        self.next_blob = (idx.layers.len(), 0);
        let out = self.out.as_mut().expect("writer used after finish");
        // BufWriter's seek flushes first; seeking past the end leaves a hole.
        out.seek(SeekFrom::Current(skip as i64)).map_err(|e| VaultError::io(&self.tmp_path, e))?;
        self.pos += skip;
        Ok(())
    }

    /// Writes the manifest and header, fsyncs and renames into place. `manifest.dense` and
    /// `manifest.experts` are filled in by the writer, and the features its expert index needs
    /// added to `manifest.required_features`.
    pub fn finish(mut self, mut manifest: Manifest) -> Result<u64, VaultError> {
        let idx = self.experts.take().ok_or(VaultError::Usage("finish before begin_experts"))?;
        if idx.layers.iter().any(|l| l.checksums.len() != self.num_experts) {
            return Err(VaultError::Usage("finish with blobs missing"));
        }
        let needs = [
            (crate::manifest::LAYER_EXPERT_PARTS, idx.layers.iter().any(|l| l.parts.is_some())),
            (crate::manifest::LAYER_BLOB_SIZES, idx.layers.iter().any(|l| l.blob_size.is_some())),
        ];
        for (feature, needed) in needs {
            if needed && !manifest.required_features.iter().any(|f| f == feature) {
                manifest.required_features.push(feature.to_string());
            }
        }
        let experts_len = self.pos - self.experts_offset;
        let dense_len = self.experts_offset - self.dense_offset;
        manifest.dense = std::mem::take(&mut self.dense);
        manifest.experts = idx;
        let json = serde_json::to_vec(&manifest).map_err(|e| VaultError::Corrupt(format!("manifest: {e}")))?;
        self.pad_to(self.alignment as u64)?;
        let manifest_offset = self.pos;
        self.write_all(&json)?;
        self.pad_to(self.alignment as u64)?;
        let header = Header {
            major: FORMAT_MAJOR,
            minor: FORMAT_MINOR,
            alignment: self.alignment,
            file_len: self.pos,
            manifest_offset,
            manifest_len: json.len() as u64,
            manifest_checksum: xxhash_rust::xxh3::xxh3_64(&json),
            dense_offset: self.dense_offset,
            dense_len,
            experts_offset: self.experts_offset,
            experts_len,
        };
        let out = self.out.take().unwrap();
        let commit = || -> Result<(), VaultError> {
            let mut file = out.into_inner().map_err(|e| VaultError::io(&self.tmp_path, e.into_error()))?;
            let io = |e| VaultError::io(&self.tmp_path, e);
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            file.write_all(&header.encode()).map_err(io)?;
            file.sync_all().map_err(io)?;
            drop(file);
            std::fs::rename(&self.tmp_path, &self.final_path).map_err(|e| VaultError::io(&self.final_path, e))
        };
        if let Err(e) = commit() {
            let _ = std::fs::remove_file(&self.tmp_path);
            return Err(e);
        }
        // Make the rename itself durable; failure here is not worth failing the conversion.
        sync_parent(&self.final_path);
        Ok(header.file_len)
    }
}

impl Drop for VaultWriter {
    fn drop(&mut self) {
        if self.out.is_some() {
            self.out = None;
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_directory_that_does_not_exist_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = temp_path(&dir.path().join("missing/m.smoe")).unwrap_err().to_string();
        assert!(e.contains("missing") && e.contains("output directory does not exist"), "{e}");
        let ok = temp_path(&dir.path().join("m.smoe")).unwrap();
        assert!(ok.to_string_lossy().contains("m.smoe.tmp-"));
        assert!(temp_path(Path::new("m.smoe")).is_ok(), "a bare name is in the current directory");
    }
}
