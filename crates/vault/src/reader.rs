//! Opening and validating a vault. Every check returns an error; nothing here panics on a bad
//! file.

use crate::header::{Header, HEADER_LEN};
use crate::manifest::{DenseEntry, Manifest, KNOWN_FEATURES};
use crate::names::{self, EXPERT_PARTS};
use crate::VaultError;
use smoe_quant::Format;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// An open, validated vault. Reading tensor data is explicit; opening reads only the header
/// and the manifest.
pub struct Vault {
    path: PathBuf,
    file: File,
    header: Header,
    manifest: Manifest,
    by_name: HashMap<String, usize>,
    moe_index: Vec<Option<usize>>,
    /// Where each listed MoE layer's blobs start, from the expert region's start (its blobs lie
    /// back to back, each layer at its own size).
    layer_start: Vec<u64>,
}

/// Where one expert blob lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobLocation {
    /// Absolute file offset (aligned).
    pub offset: u64,
    /// Length (the layer's blob size, aligned).
    pub len: u64,
    /// xxh3-64 of the blob.
    pub checksum: u64,
}

impl Vault {
    /// Opens `path`, validating the header, the manifest checksum and the manifest's
    /// consistency with its own architecture and the file's regions.
    pub fn open(path: impl AsRef<Path>) -> Result<Vault, VaultError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| VaultError::io(&path, e))?;
        let actual_len = file.metadata().map_err(|e| VaultError::io(&path, e))?.len();
        let mut hb = [0u8; HEADER_LEN];
        let got = read_up_to(&file, &mut hb, 0).map_err(|e| VaultError::io(&path, e))?;
        if got >= 8 && hb[..8] != crate::header::MAGIC {
            return Err(VaultError::BadMagic { found: hb[..8].try_into().unwrap() });
        }
        let header = Header::decode(&hb[..got])?;
        if actual_len < header.file_len {
            return Err(VaultError::Truncated { what: "vault file".into(), need: header.file_len, have: actual_len });
        }
        let len = usize::try_from(header.manifest_len).map_err(|_| VaultError::Corrupt("manifest too large".into()))?;
        let mut json = vec![0u8; len];
        file.read_exact_at(&mut json, header.manifest_offset).map_err(|e| VaultError::io(&path, e))?;
        if xxhash_rust::xxh3::xxh3_64(&json) != header.manifest_checksum {
            return Err(VaultError::Checksum { what: "manifest".into() });
        }
        let manifest: Manifest = serde_json::from_slice(&json).map_err(|e| VaultError::Corrupt(format!("manifest does not parse: {e}")))?;
        // Before anything is sized by it (the layer index below).
        manifest.architecture.validate().map_err(|e| VaultError::Corrupt(format!("architecture: {e}")))?;
        let by_name = manifest.dense.iter().enumerate().map(|(i, d)| (d.name.clone(), i)).collect();
        let mut moe_index = vec![None; manifest.architecture.num_layers];
        for (i, l) in manifest.experts.layers.iter().enumerate() {
            if let Some(slot) = moe_index.get_mut(l.layer) {
                *slot = Some(i);
            }
        }
        // Saturating: a hostile manifest's sizes must not wrap into a small region that matches
        // (a saturated sum cannot equal a region the header bounded); `validate` names the cause.
        let n = manifest.architecture.moe.num_experts as u64;
        let mut layer_start = Vec::with_capacity(manifest.experts.layers.len() + 1);
        let mut at = 0u64;
        for i in 0..manifest.experts.layers.len() {
            layer_start.push(at);
            at = at.saturating_add(n.saturating_mul(manifest.experts.layer_blob_size(i)));
        }
        layer_start.push(at);
        let v = Vault { path, file, header, manifest, by_name, moe_index, layer_start };
        v.validate()?;
        Ok(v)
    }

    fn validate(&self) -> Result<(), VaultError> {
        let bad = |m: String| Err(VaultError::Corrupt(m));
        let m = &self.manifest;
        if let Some(f) = m.required_features.iter().find(|f| !KNOWN_FEATURES.contains(&f.as_str())) {
            return Err(VaultError::UnsupportedFeature(f.clone()));
        }
        let arch = &m.architecture;
        // (The architecture itself was validated in `open`, before it sized anything.)
        // Dense tensors: exactly the expected set, shapes and sizes consistent, inside the region.
        let expected = names::dense_tensors(arch);
        if self.by_name.len() != m.dense.len() {
            return bad("duplicate dense tensor names".into());
        }
        for spec in &expected {
            let Some(d) = self.dense(&spec.name) else {
                return bad(format!("dense tensor {} is missing", spec.name));
            };
            if d.shape != spec.shape {
                return bad(format!("dense tensor {} has shape {:?}, architecture needs {:?}", d.name, d.shape, spec.shape));
            }
            if spec.keep_f32 && d.format != Format::F32 {
                return bad(format!("dense tensor {} must be F32, is {}", d.name, d.format));
            }
        }
        if expected.len() != m.dense.len() {
            let known: std::collections::HashSet<_> = expected.iter().map(|s| s.name.as_str()).collect();
            let extra: Vec<_> = m.dense.iter().filter(|d| !known.contains(d.name.as_str())).map(|d| d.name.as_str()).collect();
            return bad(format!("unexpected dense tensors: {}", extra.join(", ")));
        }
        for d in &m.dense {
            let cols = *d.shape.last().unwrap_or(&0);
            d.format.row_bytes(cols).map_err(|e| VaultError::Corrupt(format!("{}: {e}", d.name)))?;
            if crate::manifest::dense_len(d.format, &d.shape) != Some(d.len) {
                return bad(format!("dense tensor {} length {} does not match its shape", d.name, d.len));
            }
            if d.offset.checked_add(d.len).is_none_or(|end| end > self.header.dense_len) {
                return bad(format!("dense tensor {} lies outside the dense region", d.name));
            }
        }
        // Experts: three parts of the expected shapes inside each blob; one row of checksums
        // per MoE layer; the region exactly as large as the blobs.
        let x = &m.experts;
        let shapes = names::expert_part_shapes(arch);
        let check_parts = |parts: &[crate::manifest::PartEntry], what: &str, blob_size: u64| -> Result<(), VaultError> {
            if parts.len() != 3 {
                return bad(format!("{what}: {} expert parts, expected 3", parts.len()));
            }
            let mut end = 0;
            for ((p, name), shape) in parts.iter().zip(EXPERT_PARTS).zip(shapes) {
                if p.name != name || p.shape != shape {
                    return bad(format!("{what}: expert part {} {:?}, expected {name} {:?}", p.name, p.shape, shape));
                }
                let row = p.format.row_bytes(shape[1]).map_err(|e| VaultError::Corrupt(format!("expert {name}: {e}")))?;
                let part_end = p.offset.checked_add(p.len);
                if (row * shape[0]) as u64 != p.len || p.offset < end || part_end.is_none_or(|e| e > blob_size) {
                    return bad(format!("{what}: expert part {name} is misplaced in the blob"));
                }
                end = p.offset + p.len;
            }
            Ok(())
        };
        let declares = |f: &str| m.required_features.iter().any(|r| r == f);
        if x.blob_size == 0 || !x.blob_size.is_multiple_of(self.header.alignment as u64) {
            return bad(format!("blob size {} is not a multiple of the alignment", x.blob_size));
        }
        check_parts(&x.parts, "experts", x.blob_size)?;
        for (i, l) in x.layers.iter().enumerate() {
            let size = x.layer_blob_size(i);
            if let Some(s) = l.blob_size {
                if !declares(crate::manifest::LAYER_BLOB_SIZES) {
                    return bad(format!("layer {} gives its own blob size without declaring the feature", l.layer));
                }
                if s == 0 || s > x.blob_size || !s.is_multiple_of(self.header.alignment as u64) {
                    return bad(format!("layer {}: blob size {s} is not an aligned size up to {}", l.layer, x.blob_size));
                }
            }
            match &l.parts {
                Some(_) if !declares(crate::manifest::LAYER_EXPERT_PARTS) => {
                    return bad(format!("layer {} lists its own expert parts without declaring the feature", l.layer));
                }
                Some(p) => check_parts(p, &format!("layer {}", l.layer), size)?,
                None if l.blob_size.is_some() => check_parts(&x.parts, &format!("layer {}", l.layer), size)?,
                None => {}
            }
        }
        // The largest blob is what a reader's buffers take: it must be a layer's own size.
        if !x.layers.is_empty() && (0..x.layers.len()).map(|i| x.layer_blob_size(i)).max() != Some(x.blob_size) {
            return bad(format!("blob size {} is no layer's: it must be the largest layer's", x.blob_size));
        }
        let moe_layers = arch.moe_layers();
        if x.layers.iter().map(|l| l.layer).collect::<Vec<_>>() != moe_layers {
            return bad("expert layers do not match the architecture's MoE layers".into());
        }
        if let Some(l) = x.layers.iter().find(|l| l.checksums.len() != arch.moe.num_experts) {
            return bad(format!("layer {} lists {} expert checksums, expected {}", l.layer, l.checksums.len(), arch.moe.num_experts));
        }
        let need = *self.layer_start.last().unwrap_or(&0);
        if need != self.header.experts_len {
            return bad(format!("expert region is {} bytes, blobs need {need}", self.header.experts_len));
        }
        if m.text.tokenizer_json.is_empty() {
            return bad("the vault has no tokenizer".into());
        }
        Ok(())
    }

    /// The file this vault was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The architecture description.
    pub fn architecture(&self) -> &crate::Architecture {
        &self.manifest.architecture
    }
    /// The open file (for readers that manage their own I/O, such as the expert store).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The directory entry of a dense tensor.
    pub fn dense(&self, name: &str) -> Option<&DenseEntry> {
        self.by_name.get(name).map(|&i| &self.manifest.dense[i])
    }

    /// Reads one dense tensor, verifying its checksum.
    pub fn read_dense(&self, name: &str) -> Result<Vec<u8>, VaultError> {
        let d = self.dense(name).ok_or_else(|| VaultError::Corrupt(format!("no dense tensor {name}")))?;
        let mut buf = vec![0u8; d.len as usize];
        self.file.read_exact_at(&mut buf, self.header.dense_offset + d.offset).map_err(|e| VaultError::io(&self.path, e))?;
        if xxhash_rust::xxh3::xxh3_64(&buf) != d.checksum {
            return Err(VaultError::Checksum { what: format!("dense tensor {name}") });
        }
        Ok(buf)
    }

    /// Reads the whole dense region in one sequential pass and verifies every tensor in it.
    /// Tensors are then slices at their `offset`.
    pub fn read_dense_region(&self) -> Result<Vec<u8>, VaultError> {
        let mut buf = vec![0u8; self.header.dense_len as usize];
        crate::hugepages::advise(buf.as_ptr(), buf.len());
        self.file.read_exact_at(&mut buf, self.header.dense_offset).map_err(|e| VaultError::io(&self.path, e))?;
        for d in &self.manifest.dense {
            let bytes = &buf[d.offset as usize..(d.offset + d.len) as usize];
            if xxhash_rust::xxh3::xxh3_64(bytes) != d.checksum {
                return Err(VaultError::Checksum { what: format!("dense tensor {}", d.name) });
            }
        }
        Ok(buf)
    }

    /// Where the blob of `expert` in decoder layer `layer` lives.
    pub fn blob(&self, layer: usize, expert: usize) -> Result<BlobLocation, VaultError> {
        let x = &self.manifest.experts;
        let li = self.moe_index.get(layer).copied().flatten().ok_or(VaultError::NoSuchExpert { layer, expert })?;
        let checksum = *x.layers[li].checksums.get(expert).ok_or(VaultError::NoSuchExpert { layer, expert })?;
        let len = x.layer_blob_size(li);
        Ok(BlobLocation { offset: self.header.experts_offset + self.layer_start[li] + expert as u64 * len, len, checksum })
    }

    /// Reads one blob into the start of `buf` (which must hold the largest blob,
    /// [`ExpertIndex::blob_size`](crate::ExpertIndex::blob_size), bytes; a layer with its own
    /// smaller size fills only that much) and verifies its checksum.
    pub fn read_blob(&self, layer: usize, expert: usize, buf: &mut [u8]) -> Result<(), VaultError> {
        let loc = self.blob(layer, expert)?;
        if buf.len() as u64 != self.manifest.experts.blob_size {
            return Err(VaultError::Usage("read_blob buffer is not blob_size long"));
        }
        let buf = &mut buf[..loc.len as usize];
        self.file.read_exact_at(buf, loc.offset).map_err(|e| VaultError::io(&self.path, e))?;
        if xxhash_rust::xxh3::xxh3_64(buf) != loc.checksum {
            return Err(VaultError::Checksum { what: format!("expert blob layer {layer} expert {expert}") });
        }
        Ok(())
    }

    /// Checks every checksum in the file; the error names the first bad tensor or blob.
    /// `progress` is called with bytes checked so far.
    pub fn verify(&self, progress: &mut dyn FnMut(u64)) -> Result<(), VaultError> {
        let mut done = 0u64;
        for d in &self.manifest.dense {
            self.read_dense(&d.name)?;
            done += d.len;
            progress(done);
        }
        let mut buf = vec![0u8; self.manifest.experts.blob_size as usize];
        for (i, l) in self.manifest.experts.layers.iter().enumerate() {
            for e in 0..l.checksums.len() {
                self.read_blob(l.layer, e, &mut buf)?;
                done += self.manifest.experts.layer_blob_size(i);
                progress(done);
            }
        }
        Ok(())
    }
}

/// Reads as much as is there, up to `buf.len()`, so that a short file is reported as truncated
/// rather than as an I/O error.
fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
