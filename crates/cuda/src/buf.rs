//! [`CudaBuf`]: an f32 activation buffer in VRAM, and the int8 copy of its rows that the op
//! which wrote them may leave beside it.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError};
use smoe_engine::backend::Extent;
use std::sync::Arc;

/// An f32 activation buffer in VRAM.
pub struct CudaBuf {
    name: &'static str,
    mem: CudaSlice<f32>,
    quant: Quantized,
}

/// The int8 mat-vec's input form of a buffer's first rows (see `quantize_rows` in kernels.cu),
/// written by the fused op that wrote the rows (a norm, attention), so that the products
/// reading them next need not quantize them in a launch of their own. Any other write to the
/// buffer makes it stale: every write goes through [`CudaBuf::at_mut`].
#[derive(Default)]
struct Quantized {
    mem: Option<CudaSlice<u8>>,
    valid: Option<QuantRows>,
}

/// Where a buffer's rows `0..rows` (the first `cols` floats of rows `src_stride` floats apart)
/// lie quantized: `stride` bytes per row from `ptr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QuantRows {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
    pub src_stride: usize,
}

/// Bytes of one quantized row of `cols` values: the int8 values, a scale and a scaled sum per
/// group of 32, padded to 16 bytes.
pub(crate) fn quant_stride(cols: usize) -> usize {
    (cols + 8 * (cols / 32)).next_multiple_of(16)
}

pub(crate) fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // Event tracking is off for this context (one stream orders everything), so the guard
    // returned with the pointer records nothing.
    s.device_ptr(stream).0
}

impl CudaBuf {
    pub(crate) fn new(name: &'static str, mem: CudaSlice<f32>) -> CudaBuf {
        CudaBuf { name, mem, quant: Quantized::default() }
    }

    /// Its device address, to read.
    pub(crate) fn at(&self, stream: &CudaStream) -> u64 {
        dptr(&self.mem, stream)
    }

    /// Its device address, to write: its int8 copy goes stale.
    pub(crate) fn at_mut(&mut self, stream: &CudaStream) -> u64 {
        self.quant.valid = None;
        dptr(&self.mem, stream)
    }

    /// Its memory, to read.
    pub(crate) fn mem(&self) -> &CudaSlice<f32> {
        &self.mem
    }

    /// Its memory, to write: its int8 copy goes stale.
    pub(crate) fn mem_mut(&mut self) -> &mut CudaSlice<f32> {
        self.quant.valid = None;
        &mut self.mem
    }

    /// Its rows' int8 copy, where the op that last wrote them left one.
    pub(crate) fn quantized(&self) -> Option<QuantRows> {
        self.quant.valid
    }

    /// Whether [`Self::quantize_into`] would find room without allocating.
    pub(crate) fn quant_fits(&self, rows: usize, cols: usize) -> bool {
        self.quant.mem.as_ref().is_some_and(|m| m.len() >= rows * quant_stride(cols))
    }

    /// Room for the int8 copy of rows `0..rows` (the first `cols` floats of rows `src_stride`
    /// apart), which the op about to be queued writes with them (call it after [`Self::at_mut`]).
    pub(crate) fn quantize_into(
        &mut self,
        stream: &Arc<CudaStream>,
        rows: usize,
        cols: usize,
        src_stride: usize,
    ) -> Result<QuantRows, DriverError> {
        let stride = quant_stride(cols);
        if self.quant.mem.as_ref().is_none_or(|m| m.len() < rows * stride) {
            // The old copy's free is stream-ordered after the products that read it.
            self.quant.mem = Some(stream.alloc_zeros::<u8>((rows * stride).max(1 << 12))?);
        }
        let ptr = dptr(self.quant.mem.as_ref().expect("allocated above"), stream);
        let q = QuantRows { ptr, rows, cols, stride, src_stride };
        self.quant.valid = Some(q);
        Ok(q)
    }
}

impl Extent for CudaBuf {
    fn extent(&self) -> (&str, usize) {
        (self.name, self.mem.len())
    }
}
