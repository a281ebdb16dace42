//! Small host inputs of ops (row lists, mixing weights, RoPE tables) on their way to the GPU,
//! without stalling it.
//!
//! A copy from pageable memory makes the driver wait for the stream first (measured: 40 tok/s
//! of decode on the H200 with five such copies per layer). The values are instead written into
//! a ring of page-locked host memory and copied asynchronously into the same offsets of a device
//! ring, in stream order before the kernel that reads them. A region of the ring is written
//! again only after the stream has been synchronized since its copy was queued: at the wrap,
//! and whenever the backend synchronizes anyway (a download).

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::Arc;

pub(crate) struct Staging {
    /// Page-locked host memory of `cap` bytes (null until first use).
    host: *mut u8,
    dev: Option<CudaSlice<u8>>,
    cap: usize,
    /// Next free byte; everything before it may still be in flight.
    off: usize,
    /// Counts the times the ring was freed (reused from its start, or replaced): a staged
    /// address stays valid while the epoch it was staged in lasts.
    epoch: u64,
}

// SAFETY: `host` is a page-locked allocation owned by this value alone (freed in Drop), only
// touched through `&mut self`, so moving the value to another thread moves sole ownership.
unsafe impl Send for Staging {}

impl Staging {
    pub(crate) fn new() -> Staging {
        Staging { host: std::ptr::null_mut(), dev: None, cap: 0, off: 0, epoch: 0 }
    }

    /// Everything queued before is complete: the whole ring is free again.
    pub(crate) fn synchronized(&mut self) {
        self.off = 0;
        self.epoch += 1;
    }

    /// The current epoch (see the field).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether `len` bytes fit in the ring as it is, without waiting for the stream or growing.
    pub(crate) fn fits(&self, len: usize) -> bool {
        let need = len.max(1);
        need <= self.cap && self.off + need <= self.cap
    }

    /// Queues a copy of `len` bytes, written into the ring by `fill`, to the device and returns
    /// their device address, valid for kernels queued next on `stream`. Writing in place spares
    /// an op its own host buffer (ids widened to i32, RoPE's cosines and sines side by side).
    pub(crate) fn stage(&mut self, stream: &Arc<CudaStream>, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<u64, DriverError> {
        let need = len.max(1);
        if need > self.cap {
            stream.synchronize()?;
            self.release();
            let cap = (2 * need).next_power_of_two().max(1 << 20);
            stream.context().bind_to_thread()?;
            // SAFETY: a plain page-locked allocation of `cap` bytes; on success this value owns
            // it and frees it in `release`.
            self.host = unsafe { result::malloc_host(cap, 0) }? as *mut u8;
            self.cap = cap;
            self.dev = Some(stream.alloc_zeros::<u8>(cap)?);
            self.off = 0;
            self.epoch += 1;
        } else if self.off + need > self.cap {
            // Wrapping: the copies queued from the start of the ring must have finished.
            stream.synchronize()?;
            self.off = 0;
            self.epoch += 1;
        }
        let off = self.off;
        let dst = self.dev.as_ref().expect("allocated with the host ring").device_ptr(stream).0 + off as u64;
        // SAFETY: `off + len <= cap`, so the slice stays inside the host ring; no copy still in
        // flight reads these bytes (everything past `off` was synchronized or never used); and
        // the ring is page-locked, so the asynchronous copy reads it after this call returns, in
        // stream order, while it stays allocated (freed only after a synchronize).
        unsafe {
            let host = std::slice::from_raw_parts_mut(self.host.add(off), len);
            fill(host);
            if len > 0 {
                result::memcpy_htod_async(dst, &*host, stream.cu_stream())?;
            }
        }
        self.off = (off + need).next_multiple_of(16);
        Ok(dst)
    }

    fn release(&mut self) {
        if !self.host.is_null() {
            // SAFETY: allocated by `malloc_host` above and no longer read by any copy (callers
            // synchronize the stream first).
            let _ = unsafe { result::free_host(self.host as *mut std::ffi::c_void) };
            self.host = std::ptr::null_mut();
        }
        self.dev = None;
        self.cap = 0;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(d) = &self.dev {
            let _ = d.stream().synchronize();
        }
        self.release();
    }
}
