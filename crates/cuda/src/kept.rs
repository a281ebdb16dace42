//! Experts kept in VRAM by layer: when every routed expert of the model fits, the engine hands
//! them all over at load ([`smoe_engine::Backend::keep_experts`]) and the GPU routes and runs
//! them itself, so decode never waits for the host between layers.
//!
//! Each layer holds its experts' gate, up and down matrices as three arrays, expert `e`'s
//! matrix at `e × bytes` in its array: a kernel finds an expert's weights from the id the
//! routing kernel wrote, with no table on the host. Unlike the slot-keyed tier
//! ([`crate::experts`]), nothing here is evicted or copied again.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use smoe_engine::backend::ExpertPart;
use smoe_quant::{Format, Layout, QMatrix};
use smoe_store::ExpertView;
use std::sync::Arc;

/// One matrix of every expert of a layer, back to back.
pub(crate) struct KeptPart {
    pub data: CudaSlice<u8>,
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    /// Bytes of one expert's matrix: expert `e`'s starts at `e × bytes`.
    pub bytes: usize,
}

impl KeptPart {
    /// The device address of expert `e`'s matrix.
    pub fn at(&self, stream: &CudaStream, e: u32) -> u64 {
        self.data.device_ptr(stream).0 + (e as usize * self.bytes) as u64
    }
}

/// The kept experts of one layer: gate, up, down.
pub(crate) struct KeptLayer {
    pub parts: [KeptPart; 3],
    pub experts: usize,
    filled: Vec<bool>,
}

impl KeptLayer {
    /// Whether every expert has been copied in.
    pub fn complete(&self) -> bool {
        self.filled.iter().all(|&f| f)
    }

    /// The matrix `part`.
    pub fn part(&self, part: ExpertPart) -> &KeptPart {
        &self.parts[match part {
            ExpertPart::Gate => 0,
            ExpertPart::Up => 1,
            ExpertPart::Down => 2,
        }]
    }
}

/// Every kept layer, by decoder layer index.
#[derive(Default)]
pub(crate) struct KeptExperts {
    pub layers: Vec<Option<KeptLayer>>,
    /// Bytes of VRAM they take.
    pub bytes: u64,
}

fn shape(q: &QMatrix<'_>) -> Result<(Format, usize, usize, usize), String> {
    if q.layout != Layout::Rows {
        return Err("an expert arrived interleaved; the CUDA backend reads rows as stored".into());
    }
    let row_bytes = q.format.row_bytes(q.cols).map_err(|e| e.to_string())?;
    if q.data.len() != row_bytes * q.rows {
        return Err(format!("an expert matrix of {} bytes for {} rows of {row_bytes}", q.data.len(), q.rows));
    }
    Ok((q.format, q.rows, q.cols, row_bytes))
}

impl KeptExperts {
    /// Copies `batch`'s experts of `layer` (of `experts` in all) into their places, allocating
    /// the layer's arrays at its first batch. The copies are queued on `stream`; the caller
    /// synchronizes before the host views go.
    pub fn keep(&mut self, stream: &Arc<CudaStream>, layer: usize, experts: usize, batch: &[(u32, ExpertView<'_>)]) -> Result<(), String> {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        if self.layers[layer].is_none() {
            let Some((_, first)) = batch.first() else { return Ok(()) };
            let mut parts = Vec::with_capacity(3);
            for q in [&first.gate, &first.up, &first.down] {
                let (format, rows, cols, row_bytes) = shape(q)?;
                let bytes = rows * row_bytes;
                let data = stream.alloc_zeros::<u8>(bytes * experts).map_err(|e| e.to_string())?;
                self.bytes += (bytes * experts) as u64;
                parts.push(KeptPart { data, format, rows, cols, row_bytes, bytes });
            }
            let parts: [KeptPart; 3] = parts.try_into().map_err(|_| "three parts".to_string())?;
            self.layers[layer] = Some(KeptLayer { parts, experts, filled: vec![false; experts] });
        }
        let l = self.layers[layer].as_mut().expect("made above");
        for (id, view) in batch {
            let e = *id as usize;
            if e >= l.experts {
                return Err(format!("expert {e} of a layer of {}", l.experts));
            }
            for (part, q) in l.parts.iter_mut().zip([&view.gate, &view.up, &view.down]) {
                let s = shape(q)?;
                if s != (part.format, part.rows, part.cols, part.row_bytes) {
                    return Err(format!("expert {e} of layer {layer} is shaped unlike the layer's first"));
                }
                let mut dst = part.data.slice_mut(e * part.bytes..(e + 1) * part.bytes);
                stream.memcpy_htod(q.data, &mut dst).map_err(|e| e.to_string())?;
            }
            l.filled[e] = true;
        }
        Ok(())
    }

    /// Layer `layer`, when all its experts are in.
    pub fn layer(&self, layer: usize) -> Option<&KeptLayer> {
        self.layers.get(layer).and_then(|l| l.as_ref()).filter(|l| l.complete())
    }
}
