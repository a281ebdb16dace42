//! Where each expert's bytes live on disk and where they land in a cache slot.
//!
//! A vault stores an expert as one aligned blob: one read per expert. A GGUF stores each of
//! gate, up and down as one stacked tensor of all experts: three reads per expert, each rounded
//! out to the O_DIRECT alignment, landing side by side in the slot. [`ExpertMap`] describes
//! both, so one store serves either.

use crate::{ExpertView, SlotHandle, StoreError};
use smoe_quant::{Format, Layout, QMatrix};
use smoe_vault::{PartEntry, StackedPart, Vault};
use std::path::PathBuf;

/// One read per expert: `len` bytes at `base + expert * stride` of file `file`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Index into [`ExpertMap::files`].
    pub file: usize,
    /// Offset of expert 0.
    pub base: u64,
    /// Bytes from one expert to the next.
    pub stride: u64,
    /// Bytes of one expert.
    pub len: u64,
}

/// One matrix of an expert: `len` bytes at `offset` from the start of extent `extent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Storage format.
    pub format: Format,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Which extent holds it.
    pub extent: usize,
    /// Offset within the extent.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Part {
    fn from_entry(p: &PartEntry) -> Part {
        Part { format: p.format, rows: p.shape[0], cols: p.shape[1], extent: 0, offset: p.offset, len: p.len }
    }
}

/// The experts of one MoE layer.
#[derive(Clone, Debug)]
pub struct LayerMap {
    /// The reads of one expert.
    pub extents: Vec<Extent>,
    /// Gate, up and down.
    pub parts: [Part; 3],
    /// xxh3-64 of each expert's single extent (vaults); `None` where the file has none (GGUF).
    pub checksums: Option<Vec<u64>>,
}

/// One read to issue: `len` bytes at `offset` of file `file` into the slot at `slot_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRead {
    /// File index.
    pub file: usize,
    /// Aligned file offset.
    pub offset: u64,
    /// Aligned length.
    pub len: usize,
    /// Bytes from `offset` that must be read (to the end of the expert's own data): the
    /// aligned length may run past the end of a file whose last tensor ends unaligned.
    pub need: usize,
    /// Aligned offset in the slot.
    pub slot_offset: usize,
}

/// Every MoE layer's expert layout, and the slot size that holds any expert.
#[derive(Clone, Debug)]
pub struct ExpertMap {
    /// The files experts are read from.
    pub files: Vec<PathBuf>,
    /// O_DIRECT alignment of offsets, lengths and buffers.
    pub align: usize,
    /// Decoder layer of each MoE ordinal.
    pub moe_layers: Vec<usize>,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Per MoE ordinal.
    pub layers: Vec<LayerMap>,
    /// Per MoE ordinal and extent: where in the slot its read lands.
    slot_offsets: Vec<Vec<usize>>,
    slot_size: usize,
    /// Formats whose matrices are interleaved by eight rows once loaded ([`ExpertMap::interleaved`]).
    interleave: Vec<Format>,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl ExpertMap {
    /// Checks the layout and places each extent in the slot. An extent whose experts start on
    /// aligned offsets takes its rounded-up length; one that does not takes one alignment unit
    /// more, because its reads start up to `align - 1` bytes early.
    pub fn new(
        files: Vec<PathBuf>,
        align: usize,
        moe_layers: Vec<usize>,
        num_experts: usize,
        layers: Vec<LayerMap>,
    ) -> Result<ExpertMap, StoreError> {
        let bad = |m: String| Err(StoreError::Config(m));
        if align == 0 || !align.is_power_of_two() {
            return bad(format!("alignment {align} is not a power of two"));
        }
        if layers.len() != moe_layers.len() {
            return bad("one layer map per MoE layer".into());
        }
        let a = align as u64;
        let (mut slot_offsets, mut slot_size) = (Vec::new(), 0usize);
        for (li, l) in layers.iter().enumerate() {
            let mut offs = Vec::new();
            let mut at = 0u64;
            for x in &l.extents {
                if x.file >= files.len() || x.len == 0 {
                    return bad(format!("MoE layer {li}: extent {x:?} is invalid"));
                }
                offs.push(at as usize);
                let aligned = x.base % a == 0 && x.stride % a == 0;
                at += align_up(x.len, a) + if aligned { 0 } else { a };
            }
            for p in &l.parts {
                let fits = l.extents.get(p.extent).is_some_and(|x| p.offset + p.len <= x.len);
                let row = p.format.row_bytes(p.cols).map_err(|e| StoreError::Config(format!("MoE layer {li}: {e}")))?;
                if !fits || (row * p.rows) as u64 != p.len {
                    return bad(format!("MoE layer {li}: part {p:?} does not fit its extent"));
                }
            }
            if l.checksums.as_ref().is_some_and(|c| c.len() != num_experts || l.extents.len() != 1) {
                return bad(format!("MoE layer {li}: checksums need one extent and one sum per expert"));
            }
            slot_size = slot_size.max(at as usize);
            slot_offsets.push(offs);
        }
        Ok(ExpertMap { files, align, moe_layers, num_experts, layers, slot_offsets, slot_size, interleave: Vec::new() })
    }

    /// The map of experts stored stacked (a GGUF read in place): three reads per expert,
    /// straight from the stacked tensors, each rounded out to the 4096-byte O_DIRECT alignment.
    pub fn stacked(
        files: Vec<PathBuf>,
        moe_layers: Vec<usize>,
        num_experts: usize,
        layers: &[[StackedPart; 3]],
    ) -> Result<ExpertMap, StoreError> {
        let layers = layers
            .iter()
            .map(|l| {
                let extents = l.iter().map(|p| Extent { file: p.file, base: p.offset, stride: p.bytes, len: p.bytes }).collect();
                let part = |i: usize| Part { format: l[i].format, rows: l[i].rows, cols: l[i].cols, extent: i, offset: 0, len: l[i].bytes };
                LayerMap { extents, parts: [part(0), part(1), part(2)], checksums: None }
            })
            .collect();
        ExpertMap::new(files, 4096, moe_layers, num_experts, layers)
    }

    /// The map of a vault: one blob per expert, checksummed.
    pub fn of_vault(vault: &Vault) -> Result<ExpertMap, StoreError> {
        let arch = vault.architecture();
        let x = &vault.manifest().experts;
        let moe = arch.moe_layers();
        let n = arch.moe.num_experts;
        let mut layers = Vec::with_capacity(moe.len());
        for &l in &moe {
            // Blobs lie back to back at the layer's own size (a mixed vault's layers differ).
            let first = vault.blob(l, 0).map_err(|source| StoreError::Read { layer: l, expert: 0, source })?;
            let entry = x.layers.iter().find(|e| e.layer == l);
            let parts = x.layer_parts(l);
            layers.push(LayerMap {
                extents: vec![Extent { file: 0, base: first.offset, stride: first.len, len: first.len }],
                parts: [Part::from_entry(&parts[0]), Part::from_entry(&parts[1]), Part::from_entry(&parts[2])],
                checksums: entry.map(|e| e.checksums.clone()),
            });
        }
        ExpertMap::new(vec![vault.path().to_path_buf()], vault.header().alignment as usize, moe, n, layers)
    }

    /// Bytes of a slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Experts in all MoE layers.
    pub fn total_experts(&self) -> usize {
        self.moe_layers.len() * self.num_experts
    }

    /// The aligned reads that bring expert `expert` of MoE ordinal `ord` into a slot.
    pub fn reads(&self, ord: usize, expert: usize, out: &mut Vec<SlotRead>) {
        let a = self.align as u64;
        for (x, &slot_offset) in self.layers[ord].extents.iter().zip(&self.slot_offsets[ord]) {
            let off = x.base + expert as u64 * x.stride;
            let start = off / a * a;
            let end = align_up(off + x.len, a);
            out.push(SlotRead {
                file: x.file,
                offset: start,
                len: (end - start) as usize,
                need: (off + x.len - start) as usize,
                slot_offset,
            });
        }
    }

    /// Bytes of one expert's matrices in MoE ordinal `ord` (what its products read; a mixed
    /// file's layers differ, Q4_K_M's Q6_K down projections in half of them).
    pub fn expert_bytes(&self, ord: usize) -> u64 {
        self.layers[ord].parts.iter().map(|p| p.len).sum()
    }

    /// Bytes read for one expert of MoE ordinal `ord`.
    pub fn read_bytes(&self, ord: usize, expert: usize) -> u64 {
        let a = self.align as u64;
        self.layers[ord]
            .extents
            .iter()
            .map(|x| {
                let off = x.base + expert as u64 * x.stride;
                align_up(off + x.len, a) - off / a * a
            })
            .sum()
    }

    /// Where extent `e` of an expert's data starts in the slot.
    fn data_offset(&self, ord: usize, expert: usize, e: usize) -> usize {
        let x = &self.layers[ord].extents[e];
        let off = x.base + expert as u64 * x.stride;
        self.slot_offsets[ord][e] + (off % self.align as u64) as usize
    }

    /// The expert in a filled slot, `handle` saying which slot and load it is.
    pub fn view<'a>(&self, ord: usize, expert: usize, slot: &'a [u8], handle: SlotHandle) -> ExpertView<'a> {
        let m = |p: &Part| {
            let at = self.data_offset(ord, expert, p.extent) + p.offset as usize;
            let layout = if self.interleaves(p) { Layout::Interleaved8 } else { Layout::Rows };
            QMatrix { format: p.format, rows: p.rows, cols: p.cols, data: &slot[at..at + p.len as usize], layout }
        };
        let p = &self.layers[ord].parts;
        ExpertView { slot: handle, gate: m(&p[0]), up: m(&p[1]), down: m(&p[2]) }
    }

    /// This map with every matrix of the `formats` whose rows come in whole groups of eight
    /// interleaved in memory once its bytes are loaded and checked ([`ExpertMap::interleave_slot`]),
    /// for CPU kernels that read eight rows at a time (the backend says which formats it reads
    /// so, [`smoe_quant::interleave::supported`] which can be); views say so in their layout.
    pub fn interleaved(mut self, formats: &[Format]) -> ExpertMap {
        self.interleave = formats.to_vec();
        self
    }

    fn interleaves(&self, p: &Part) -> bool {
        self.interleave.contains(&p.format) && smoe_quant::interleave::supported(p.format, p.rows, p.cols)
    }

    /// Interleaves the matrices of an expert just loaded into `slot` (after its checksum was
    /// verified: checksums are of the file's bytes). A no-op unless [`ExpertMap::interleaved`].
    pub fn interleave_slot(&self, ord: usize, expert: usize, slot: &mut [u8], scratch: &mut Vec<u8>) {
        for p in self.layers[ord].parts.iter().filter(|p| self.interleaves(p)) {
            let at = self.data_offset(ord, expert, p.extent) + p.offset as usize;
            smoe_quant::interleave::interleave_in_place(p.format, &mut slot[at..at + p.len as usize], p.rows, p.cols, scratch);
        }
    }

    /// The checksummed bytes of an expert in a filled slot and their expected xxh3-64, if the
    /// file has checksums.
    pub fn checksum<'a>(&self, ord: usize, expert: usize, slot: &'a [u8]) -> Option<(&'a [u8], u64)> {
        let l = &self.layers[ord];
        let sum = *l.checksums.as_ref()?.get(expert)?;
        let at = self.data_offset(ord, expert, 0);
        Some((&slot[at..at + l.extents[0].len as usize], sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_extents_get_room_and_views_find_their_bytes() {
        let q = |extent, len| Part { format: Format::F32, rows: 1, cols: len as usize / 4, extent, offset: 0, len };
        let layer = LayerMap {
            extents: vec![
                Extent { file: 0, base: 100, stride: 64, len: 64 },
                Extent { file: 1, base: 4096, stride: 4096, len: 4096 },
                Extent { file: 0, base: 5000, stride: 32, len: 32 },
            ],
            parts: [q(0, 64), q(1, 4096), q(2, 32)],
            checksums: None,
        };
        let m = ExpertMap::new(vec!["a".into(), "b".into()], 4096, vec![3], 4, vec![layer]).unwrap();
        assert_eq!(m.slot_size(), 8192 + 4096 + 8192);
        let mut reads = Vec::new();
        m.reads(0, 2, &mut reads);
        assert_eq!(reads[0], SlotRead { file: 0, offset: 0, len: 4096, need: 292, slot_offset: 0 });
        assert_eq!(reads[1], SlotRead { file: 1, offset: 3 * 4096, len: 4096, need: 4096, slot_offset: 8192 });
        assert_eq!(reads[2], SlotRead { file: 0, offset: 4096, len: 4096, need: 1000, slot_offset: 12288 });
        let mut slot = vec![0u8; m.slot_size()];
        slot[228..232].copy_from_slice(&1.5f32.to_le_bytes());
        slot[12288 + 5064 - 4096..][..4].copy_from_slice(&2.5f32.to_le_bytes());
        let v = m.view(0, 2, &slot, SlotHandle { slot: 0, load: 0 });
        assert_eq!(&v.gate.data[..4], &1.5f32.to_le_bytes());
        assert_eq!(&v.down.data[..4], &2.5f32.to_le_bytes());
        assert_eq!(m.read_bytes(0, 2), 3 * 4096);
        assert!(ExpertMap::new(vec!["a".into()], 4096, vec![0], 4, vec![]).is_err());
    }
}
