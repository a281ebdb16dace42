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
use std::time::Instant;

/// Counters of the VRAM expert tier.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Expert matrices found in VRAM.
    pub hits: u64,
    /// Expert matrices copied up from host memory.
    pub misses: u64,
    /// Bytes copied host → device.
    pub uploaded_bytes: u64,
    /// Seconds the copies took (they are synchronous from pageable memory).
    pub upload_secs: f64,
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
            "VRAM experts {:.0} of {:.0} MiB, {} hits, {} copies ({:.1} MiB in {:.3} s, {:.1} GB/s)",
            mib(self.resident_bytes),
            mib(self.capacity_bytes),
            self.hits,
            self.misses,
            mib(self.uploaded_bytes),
            self.upload_secs,
            if self.upload_secs > 0.0 { self.uploaded_bytes as f64 / self.upload_secs / 1e9 } else { 0.0 }
        )
    }
}

struct Entry {
    load: u64,
    data: CudaSlice<u8>,
    used: u64,
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
const HEADROOM: u64 = 1536 << 20;

impl ExpertCache {
    pub(crate) fn new(cap: Option<u64>) -> ExpertCache {
        ExpertCache { map: HashMap::new(), lru: BTreeMap::new(), clock: 0, call: 0, bytes: 0, cap, stats: ExpertStats::default() }
    }

    pub(crate) fn stats(&self) -> ExpertStats {
        ExpertStats { resident_bytes: self.bytes, capacity_bytes: self.cap.unwrap_or(0), ..self.stats }
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

    /// The device address of `bytes` (the matrix of `handle`'s slot at that host address),
    /// copying them up on a miss.
    pub(crate) fn device_copy(&mut self, stream: &Arc<CudaStream>, handle: SlotHandle, bytes: &[u8]) -> Result<u64, String> {
        let key = (handle.slot, bytes.as_ptr() as usize);
        if let Some(e) = self.map.get(&key) {
            if e.load == handle.load && e.data.len() == bytes.len() {
                self.stats.hits += 1;
                self.touch(key);
                let e = &self.map[&key];
                return Ok(e.data.device_ptr(stream).0);
            }
        }
        let cap = match self.cap {
            Some(c) => c,
            None => {
                let (free, _) = stream.context().mem_get_info().map_err(|e| e.to_string())?;
                let c = (free as u64 + self.bytes).saturating_sub(HEADROOM);
                self.cap = Some(c);
                c
            }
        };
        let t = Instant::now();
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
                stream.alloc_zeros::<u8>(bytes.len().max(1)).map_err(|e| format!("{e} with {} MiB of experts in VRAM", self.bytes >> 20))?
            }
        };
        let mut data = data;
        stream.memcpy_htod(bytes, &mut data.slice_mut(..bytes.len())).map_err(|e| e.to_string())?;
        self.stats.misses += 1;
        self.stats.uploaded_bytes += bytes.len() as u64;
        self.stats.upload_secs += t.elapsed().as_secs_f64();
        self.bytes += data.len() as u64;
        let ptr = data.device_ptr(stream).0;
        self.clock += 1;
        self.lru.insert(self.clock, key);
        self.map.insert(key, Entry { load: handle.load, data, used: self.clock });
        Ok(ptr)
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
