//! A layer's expert misses copied host → VRAM in one driver call.
//!
//! One `cuMemcpyHtoDAsync` per matrix left the copy engine idle between copies: on the H200
//! machine, copies of 864 KiB (a 768 × 2048 Q4_K expert matrix) from page-locked memory ran at
//! 46.2 GB/s one call each, 51.5–52.0 GB/s as one `cuMemcpyBatchAsync` of 8 to 72 of them, and
//! 54.4–54.8 GB/s as a single copy of the same bytes (`examples/copy_gather.rs`). The batch call
//! exists from CUDA 13.0 drivers on (`_v2`); with an older driver, or
//! `SMOE_CUDA_BATCH_COPIES=off`, the copies go one call each as before.

use cudarc::driver::{sys, CudaStream, DriverError};

/// Whether the driver has the batched copy (looked up once: calling a symbol cudarc cannot
/// find would panic).
pub(crate) fn batch_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        if std::env::var("SMOE_CUDA_BATCH_COPIES").as_deref() == Ok("off") {
            return false;
        }
        // SAFETY: looking a symbol up in the already loaded driver library; the pointer is
        // not called here.
        unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2").is_ok() }
    })
}

/// Queues `copies` (device address, host bytes) on `stream`: one batched call where the
/// driver has it and there is more than one copy, else one call each.
///
/// # Safety
/// Each device address must hold at least its source's length, and each source must stay
/// valid and unchanged until the stream has run the copies.
pub(crate) unsafe fn host_to_device(stream: &CudaStream, copies: &[(u64, &[u8])]) -> Result<(), DriverError> {
    if copies.len() > 1 && batch_supported() {
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1.as_ptr() as sys::CUdeviceptr).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.1.len()).collect();
        // SAFETY: plain C data, for which all zeroes is valid; the fields the driver reads
        // are set next.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        // Sources are read in stream order (they are host slots the store keeps unchanged
        // until the caller has synchronized the stream).
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
        attr.dstLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let mut first = 0usize;
        // SAFETY: three arrays of `copies.len()` entries and one attribute applying from copy
        // 0 on; the addresses are valid as the caller promises.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                &mut attr,
                &mut first,
                1,
                stream.cu_stream(),
            )
        };
        return r.result();
    }
    for &(dst, src) in copies {
        // SAFETY: as the caller promises.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::DevicePtr;

    /// Several matrices from scattered host places, in one call (or one call each where the
    /// driver lacks the batch): each buffer holds its source's bytes.
    #[test]
    fn batched_copies_land_where_they_were_sent() {
        let Some(ctx) = crate::test_context() else { return };
        let stream = ctx.new_stream().unwrap();
        let host: Vec<u8> = (0..(3usize << 20)).map(|i| (i * 7 % 253) as u8).collect();
        let places = [(5usize, 1000usize), (1 << 20, 300_001), (2 << 20, 17), (123_457, 65_536)];
        let bufs: Vec<_> = places.iter().map(|&(_, n)| stream.alloc_zeros::<u8>(n).unwrap()).collect();
        let copies: Vec<(u64, &[u8])> =
            places.iter().zip(&bufs).map(|(&(at, n), b)| (b.device_ptr(&stream).0, &host[at..at + n])).collect();
        // SAFETY: each buffer holds its source's length; `host` outlives the synchronize.
        unsafe { host_to_device(&stream, &copies) }.unwrap();
        stream.synchronize().unwrap();
        for (&(at, n), b) in places.iter().zip(&bufs) {
            assert_eq!(stream.clone_dtoh(b).unwrap(), &host[at..at + n], "copy of {n} bytes from {at}");
        }
    }
}
