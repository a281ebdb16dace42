//! The VRAM tier of the expert cache: copies of the expert store's host slots, keyed by slot
//! handle.
//!
//! Routed experts reach the backend as host views of the store's cache slots, each with a
//! [`SlotHandle`] (`slot`, and `load`: a new number whenever the store refills the slot). A
//! matrix already in VRAM under the same slot, host address and load is used as it is (a hit);
//! otherwise its bytes are copied up (a miss). The tier holds at most its capacity, evicting the
//! least recently used matrices, never one that the product being prepared uses. The chain is
//! VRAM ← host expert cache ← vault on disk: the store decides what is in host memory exactly
//! as on the CPU backend, and this tier only mirrors it.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use smoe_store::SlotHandle;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Counters of the VRAM expert tier.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Expert matrices found in VRAM.
    pub hits: u64,
    /// Expert matrices copied up from host memory.
    pub misses: u64,
    /// Bytes copied host → device.
    pub uploaded_bytes: u64,
    /// Seconds the copies took on the GPU's copy engine (between events on the copy stream).
    pub upload_secs: f64,
    /// Seconds the host waited for copies after queueing the products that did not need them.
    pub upload_wait_secs: f64,
    /// Bytes of host expert memory page-locked for copies (0: copies from pageable memory).
    pub pinned_host_bytes: u64,
    /// Expert products computed by the CPU on the host copy instead (VRAM misses not copied).
    pub cpu_products: u64,
    /// Bytes of weights those products read.
    pub cpu_bytes: u64,
    /// Seconds of those CPU batches, from reading the inputs back to queueing the results.
    pub cpu_secs: f64,
    /// Bytes of experts in VRAM now.
    pub resident_bytes: u64,
    /// The tier's capacity in bytes (0 until sized at the first expert product).
    pub capacity_bytes: u64,
}

impl std::fmt::Display for ExpertStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "VRAM experts {:.0} of {:.0} MiB, {} hits, {} copies ({:.1} MiB in {:.3} s, {:.1} GB/s, from {}; host waited {:.3} s), {} products of misses on the CPU ({:.1} MiB in {:.3} s)",
            mib(self.resident_bytes),
            mib(self.capacity_bytes),
            self.hits,
            self.misses,
            mib(self.uploaded_bytes),
            self.upload_secs,
            if self.upload_secs > 0.0 { self.uploaded_bytes as f64 / self.upload_secs / 1e9 } else { 0.0 },
            if self.pinned_host_bytes > 0 { "page-locked memory" } else { "pageable memory" },
            self.upload_wait_secs,
            self.cpu_products,
            mib(self.cpu_bytes),
            self.cpu_secs,
        )
    }
}

struct Entry {
    load: u64,
    data: CudaSlice<u8>,
    used: u64,
    /// The call (`ExpertCache::call`) whose copy filled it: until that call's copies are done,
    /// a second use in the same call must wait for them too.
    filled: u64,
}

/// Matrices in VRAM by (slot, host address), least recently used first in `lru`.
pub(crate) struct ExpertCache {
    map: HashMap<(u32, usize), Entry>,
    lru: BTreeMap<u64, (u32, usize)>,
    clock: u64,
    /// Clock value at the start of the current product call: entries used since are pinned.
    call: u64,
    bytes: u64,
    cap: Option<u64>,
    stats: ExpertStats,
}

/// VRAM left for everything else when the tier sizes itself from free memory: work buffers
/// and KV growth.
pub(crate) const HEADROOM: u64 = 1536 << 20;

impl ExpertCache {
    pub(crate) fn new(cap: Option<u64>) -> ExpertCache {
        ExpertCache { map: HashMap::new(), lru: BTreeMap::new(), clock: 0, call: 0, bytes: 0, cap, stats: ExpertStats::default() }
    }

    pub(crate) fn stats(&self) -> ExpertStats {
        ExpertStats { resident_bytes: self.bytes, capacity_bytes: self.cap.unwrap_or(0), ..self.stats }
    }

    /// Adds the times of one batch of copies.
    pub(crate) fn copied(&mut self, gpu_secs: f64, wait_secs: f64) {
        self.stats.upload_secs += gpu_secs;
        self.stats.upload_wait_secs += wait_secs;
    }

    /// Adds one batch of misses computed on the CPU.
    pub(crate) fn computed_on_cpu(&mut self, products: u64, bytes: u64, secs: f64) {
        self.stats.cpu_products += products;
        self.stats.cpu_bytes += bytes;
        self.stats.cpu_secs += secs;
    }

    /// The device address of `bytes` of `handle`'s slot if they are in VRAM, copied by an
    /// earlier call (a hit, counted).
    pub(crate) fn lookup(&mut self, stream: &Arc<CudaStream>, handle: SlotHandle, bytes: &[u8]) -> Option<u64> {
        let key = (handle.slot, bytes.as_ptr() as usize);
        let e = self.map.get(&key)?;
        if e.load != handle.load || e.data.len() != bytes.len() || e.filled >= self.call {
            return None;
        }
        self.stats.hits += 1;
        self.touch(key);
        Some(self.map[&key].data.device_ptr(stream).0)
    }

    /// Whether `need` more bytes fit without evicting anything.
    pub(crate) fn room(&mut self, stream: &Arc<CudaStream>, need: u64) -> Result<bool, String> {
        Ok(self.bytes + need <= self.capacity(stream)?)
    }

    /// The tier's capacity, sized from free VRAM at first use unless given.
    fn capacity(&mut self, stream: &Arc<CudaStream>) -> Result<u64, String> {
        if let Some(c) = self.cap {
            return Ok(c);
        }
        let (free, _) = stream.context().mem_get_info().map_err(|e| e.to_string())?;
        let c = (free as u64 + self.bytes).saturating_sub(HEADROOM);
        self.cap = Some(c);
        Ok(c)
    }

    /// Notes how much host expert memory is page-locked.
    pub(crate) fn set_pinned(&mut self, bytes: u64) {
        self.stats.pinned_host_bytes = bytes;
    }

    /// Starts a batch of products: what it uses from here on is not evicted until the next.
    pub(crate) fn begin_call(&mut self) {
        self.clock += 1;
        self.call = self.clock;
    }

    fn touch(&mut self, key: (u32, usize)) {
        self.clock += 1;
        let e = self.map.get_mut(&key).expect("touched entries exist");
        self.lru.remove(&e.used);
        e.used = self.clock;
        self.lru.insert(self.clock, key);
    }

    /// For a matrix [`Self::lookup`] missed: the device address for `bytes` (the matrix of
    /// `handle`'s slot at that host address) and whether the caller must queue their copy. A
    /// new buffer is allocated (in `stream`'s order) but not filled: the caller copies `bytes`
    /// to it (see `CudaBackend::matmul_many`) before any kernel reads it. A matrix a second job
    /// of the same call already asked for is a hit whose copy is queued once.
    pub(crate) fn device_copy(&mut self, stream: &Arc<CudaStream>, handle: SlotHandle, bytes: &[u8]) -> Result<(u64, bool), String> {
        let key = (handle.slot, bytes.as_ptr() as usize);
        if let Some(e) = self.map.get(&key) {
            if e.load == handle.load && e.data.len() == bytes.len() {
                debug_assert_eq!(e.filled, self.call, "lookup returns matrices filled by earlier calls");
                self.stats.hits += 1;
                self.touch(key);
                return Ok((self.map[&key].data.device_ptr(stream).0, false));
            }
        }
        let cap = self.capacity(stream)?;
        let data = match self.map.remove(&key) {
            // Refilled slot, same size: reuse the buffer.
            Some(e) if e.data.len() == bytes.len() => {
                self.lru.remove(&e.used);
                self.bytes -= e.data.len() as u64;
                e.data
            }
            old => {
                if let Some(e) = old {
                    self.lru.remove(&e.used);
                    self.bytes -= e.data.len() as u64;
                }
                self.evict_for(bytes.len() as u64, cap);
                // SAFETY: an uninitialised device buffer of u8; the caller fills all of it
                // (the copy of `bytes`) in stream order before any kernel reads it.
                unsafe { stream.alloc::<u8>(bytes.len().max(1)) }
                    .map_err(|e| format!("{e} with {} MiB of experts in VRAM", self.bytes >> 20))?
            }
        };
        self.stats.misses += 1;
        self.stats.uploaded_bytes += bytes.len() as u64;
        self.bytes += data.len() as u64;
        let ptr = data.device_ptr(stream).0;
        self.clock += 1;
        self.lru.insert(self.clock, key);
        self.map.insert(key, Entry { load: handle.load, data, used: self.clock, filled: self.call });
        Ok((ptr, true))
    }

    /// Evicts least recently used entries not pinned by the current call until `need` more
    /// bytes fit under `cap` (or nothing evictable is left: the tier then runs over its cap
    /// for this call rather than fail).
    fn evict_for(&mut self, need: u64, cap: u64) {
        while self.bytes + need > cap {
            let Some((&used, &key)) = self.lru.iter().next() else { break };
            if used >= self.call {
                break;
            }
            self.lru.remove(&used);
            if let Some(e) = self.map.remove(&key) {
                // Freed in stream order: kernels queued before still read it safely.
                self.bytes -= e.data.len() as u64;
            }
        }
    }
}
