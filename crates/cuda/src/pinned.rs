//! Host expert memory page-locked for the GPU (`cuMemHostRegister`): copies from it run at
//! the bus's DMA speed (55 GB/s on the H200 machine, against 7–9 GB/s from pageable memory,
//! which the driver first copies through its own staging buffer) and without the host thread.
//!
//! The ranges come from the expert source ([`smoe_engine::backend::Backend::use_host_memory`])
//! and stay allocated while the backend lives; they are unregistered when it drops.

use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;
use std::time::Instant;

/// Registered ranges, unregistered on drop.
pub(crate) struct PinnedHost {
    ctx: Arc<CudaContext>,
    ranges: Vec<(usize, usize)>,
    /// Bytes registered.
    pub(crate) bytes: u64,
    /// Seconds registering took (the driver touches and locks every page).
    pub(crate) secs: f64,
    /// Why a range could not be registered (copies from it then go through pageable memory).
    pub(crate) refused: Option<String>,
}

impl PinnedHost {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> PinnedHost {
        PinnedHost { ctx, ranges: Vec::new(), bytes: 0, secs: 0.0, refused: None }
    }

    /// Page-locks each `(address, bytes)` range not registered yet. A range the driver
    /// refuses (too much locked memory, say) is left pageable: slower copies, same results.
    pub(crate) fn register(&mut self, ranges: &[(usize, usize)]) {
        let t = Instant::now();
        for &(addr, len) in ranges {
            if len == 0 || self.ranges.iter().any(|&(a, _)| a == addr) {
                continue;
            }
            if let Err(e) = self.ctx.bind_to_thread() {
                self.refused = Some(e.to_string());
                return;
            }
            // SAFETY: the caller promises `addr..addr + len` is one live allocation that
            // outlives this object (the expert source outlives the backend); registering only
            // locks its pages, and `drop` unregisters it.
            let r = unsafe { sys::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
            if r == sys::CUresult::CUDA_SUCCESS {
                self.ranges.push((addr, len));
                self.bytes += len as u64;
            } else {
                self.refused = Some(format!("page-locking {} MiB of host expert memory: {r:?}", len >> 20));
            }
        }
        self.secs += t.elapsed().as_secs_f64();
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for &(addr, _) in &self.ranges {
            // SAFETY: registered by `register` and still allocated (see there).
            let _ = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registering, copying from and unregistering a range: the copy reads what the host wrote.
    #[test]
    fn a_registered_range_copies_its_bytes() {
        let Some(ctx) = crate::test_context() else { return };
        let host: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
        let mut p = PinnedHost::new(ctx.clone());
        p.register(&[(host.as_ptr() as usize, host.len())]);
        assert_eq!((p.bytes, &p.refused), (host.len() as u64, &None));
        let stream = ctx.new_stream().unwrap();
        let dev = stream.clone_htod(&host).unwrap();
        assert_eq!(stream.clone_dtoh(&dev).unwrap(), host);
        drop(p);
    }
}
