/*!
The expert store: how the engine gets a routed expert's weights.

The engine asks for the experts one layer needs ([`ExpertSource::with_experts`]) and computes
with each as it becomes available. [`ResidentExperts`] holds every blob in memory; the streaming
store reads them from the vault into a bounded cache. Both hand out the same [`ExpertView`], so
the engine's math does not depend on where the bytes came from.

This crate owns fetching, caching and the I/O; it does not dequantize or compute.
*/
#![deny(missing_docs)]

pub mod arena;
pub mod depth;
pub mod io;
pub mod map;
pub mod policy;
pub mod replay;
mod resident;
mod sizing;
mod streaming;

pub use map::ExpertMap;
pub use resident::ResidentExperts;
pub use sizing::{auto_cache_bytes, available_memory, release_free_heap, MemoryInfo, PressureEvents, TEST_CGROUP_ROOT_ENV};
pub use streaming::{ExpertStore, StoreOptions};

use smoe_quant::QMatrix;

/// Errors while fetching experts. Messages name the layer and expert.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading a blob failed.
    #[error("reading expert {expert} of layer {layer}: {source}")]
    Read {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
        /// The cause.
        source: smoe_vault::VaultError,
    },
    /// A blob's checksum did not match; it was not used.
    #[error("expert {expert} of layer {layer} failed its checksum; not computed on")]
    Checksum {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
    /// Asking for an expert that does not exist.
    #[error("no expert {expert} in layer {layer}")]
    NoSuchExpert {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
    /// Configuration problems (cache too small, bad sizes).
    #[error("{0}")]
    Config(String),
}

/// Which cache slot holds an expert, and which load of it. A backend that keeps experts in its
/// own memory (a GPU's VRAM) keys its copies by `slot` and copies again only when `load`
/// changes: the store owns the bytes, the backend may own a mirror of its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotHandle {
    /// The slot (for a store holding every expert, the expert's index over all MoE layers).
    pub slot: u32,
    /// Which load of the slot this is: a new number each time the slot is filled.
    pub load: u64,
}

/// The three matrices of one routed expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// The slot the matrices lie in.
    pub slot: SlotHandle,
    /// `[intermediate, hidden]`.
    pub gate: QMatrix<'a>,
    /// `[intermediate, hidden]`.
    pub up: QMatrix<'a>,
    /// `[hidden, intermediate]`.
    pub down: QMatrix<'a>,
}

/// Counters every store keeps. `hits + misses` is the number of expert uses; with prefetch off,
/// `bytes_read` is the sum of the missed experts' reads (a vault's blob of their layer, a GGUF's
/// three aligned reads).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// Uses served from memory.
    pub hits: u64,
    /// Uses that needed a read.
    pub misses: u64,
    /// Bytes read from the vault.
    pub bytes_read: u64,
    /// Reads issued (demand and prefetch).
    pub reads: u64,
    /// Seconds the caller waited for reads.
    pub wait_seconds: f64,
    /// Seconds from issuing a layer's reads until the last of them landed, summed: the time the
    /// device was busy for this store (achieved bandwidth = bytes_read / busy_seconds).
    pub busy_seconds: f64,
    /// Sum of the reads in flight, sampled at each wait (mean depth = sum / samples).
    pub inflight_sum: u64,
    /// Number of samples in `inflight_sum`.
    pub inflight_samples: u64,
    /// Prefetch reads issued.
    pub prefetch_issued: u64,
    /// Prefetched experts that a request then used.
    pub prefetch_used: u64,
    /// Prefetched experts evicted unused.
    pub prefetch_wasted: u64,
    /// Prefetched experts demanded while their read was still in flight (counted as misses).
    pub prefetch_late: u64,
    /// Prefetch reads that failed before any request asked for the expert (read again on
    /// demand; only a demanded read's error fails a request).
    pub prefetch_failed: u64,
    /// Reads allowed in flight when the counters were taken (a gauge, not a counter: the
    /// measured choice under `--queue-depth auto`).
    pub queue_depth: u32,
}

impl StoreStats {
    /// Counter differences `self - before` (for one token or one request).
    pub fn since(&self, before: &StoreStats) -> StoreStats {
        StoreStats {
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            bytes_read: self.bytes_read - before.bytes_read,
            reads: self.reads - before.reads,
            wait_seconds: self.wait_seconds - before.wait_seconds,
            busy_seconds: self.busy_seconds - before.busy_seconds,
            inflight_sum: self.inflight_sum - before.inflight_sum,
            inflight_samples: self.inflight_samples - before.inflight_samples,
            prefetch_issued: self.prefetch_issued - before.prefetch_issued,
            prefetch_used: self.prefetch_used - before.prefetch_used,
            prefetch_wasted: self.prefetch_wasted - before.prefetch_wasted,
            prefetch_late: self.prefetch_late - before.prefetch_late,
            prefetch_failed: self.prefetch_failed - before.prefetch_failed,
            queue_depth: self.queue_depth,
        }
    }
    /// hits / uses.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
    /// Share of the uses that would have missed without prefetch that a prefetch served.
    pub fn prefetch_coverage(&self) -> f64 {
        let would_miss = self.misses - self.prefetch_late + self.prefetch_used;
        self.prefetch_used as f64 / would_miss.max(1) as f64
    }
    /// Achieved read bandwidth while reads were outstanding, in bytes per second.
    pub fn read_bandwidth(&self) -> f64 {
        self.bytes_read as f64 / self.busy_seconds.max(1e-9)
    }
    /// Mean reads in flight while waiting.
    pub fn mean_inflight(&self) -> f64 {
        self.inflight_sum as f64 / self.inflight_samples.max(1) as f64
    }
}

/// The size of a cache that can be resized at run time ([`ExpertSource::resize_cache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheCapacity {
    /// Experts it may hold now.
    pub slots: usize,
    /// The most it may be given: its size at opening (the arena allocated then).
    pub max_slots: usize,
    /// The fewest it accepts (the experts one token needs in one layer).
    pub min_slots: usize,
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Slots whose memory is in use: filled since the cache was last shrunk over them. Pages
    /// are touched only when read into, so this, not `slots`, is what the cache costs now.
    pub resident_slots: usize,
    /// A backend page-locked the cache's memory ([`ExpertSource::host_memory_locked`]): it is
    /// all resident, and shrinking the cache gives none of it back.
    pub locked: bool,
}

impl CacheCapacity {
    /// Bytes it may hold now.
    pub fn bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
    /// Bytes of memory it takes now.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_slots as u64 * self.slot_bytes
    }
    /// Bytes at its largest.
    pub fn max_bytes(&self) -> u64 {
        self.max_slots as u64 * self.slot_bytes
    }
}

/// A batch of landed experts: `(index into the requested list, weights)`.
pub type ExpertBatch<'a> = [(usize, ExpertView<'a>)];

/// A source of expert weights.
pub trait ExpertSource: Send + Sync {
    /// Calls `f` with batches `[(i, view)]` covering each `experts[i]` of decoder layer `layer`
    /// exactly once, as soon as their weights are in memory: every resident expert in the
    /// first batch, then the missing ones as they land (in completion order, several at once
    /// when several landed together). Views are valid during the call only: their slots are
    /// pinned for exactly that long.
    fn with_experts(&self, layer: usize, experts: &[u32], f: &mut dyn FnMut(&ExpertBatch<'_>)) -> Result<(), StoreError>;

    /// Counters since creation.
    fn stats(&self) -> StoreStats;

    /// Hint: these experts of decoder layer `layer` will probably be needed soon. Stores that
    /// read from disk may start reading them; the default ignores the hint.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Hint, given once the model has loaded: fault the cache's memory in ahead of use, in the
    /// background, so that reads do not wait for fresh pages to be zeroed. The default does
    /// nothing.
    fn prefault_cache(&self) {}

    /// The host memory every view this source hands out lies in, as `(address, bytes)`
    /// ranges that stay allocated for the source's lifetime: a backend that copies experts to
    /// a device page-locks them, so that its copies run at the bus's speed and asynchronously.
    /// The default names none.
    fn host_memory(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// Told by a backend that page-locked the ranges of [`ExpertSource::host_memory`]: the
    /// source must never give their pages back to the kernel from now on (a locked page,
    /// unmapped and faulted in anew, would no longer be the page the device copies from). A
    /// resized cache then keeps its memory. The default does nothing.
    fn host_memory_locked(&self) {}

    /// The cache's size, for a source whose cache can be resized at run time; `None` (the
    /// default) for one that cannot (every expert resident).
    fn cache_capacity(&self) -> Option<CacheCapacity> {
        None
    }

    /// Resizes the cache to `slots` experts (clamped to its fewest and to its size at opening),
    /// at any time, from any thread: a shrink waits for the layer being computed, evicts the
    /// experts least worth keeping and gives their memory back; a later read of an evicted
    /// expert reads it again, so results do not change. Returns the new size; `None` (the
    /// default) where the cache cannot be resized.
    fn resize_cache(&self, _slots: usize) -> Option<CacheCapacity> {
        None
    }
}
