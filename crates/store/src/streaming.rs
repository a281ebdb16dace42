//! The streaming expert store: a fixed arena of slots holding the most useful experts, filled
//! from the vault on demand. See [`ExpertStore::with_experts`] for the order of work.

use crate::arena::Arena;
use crate::depth::{DepthTuner, QueueDepth};
use crate::io::{self, Completion, Fault, IoKind, ReadEngine, ReadReq};
use crate::map::{ExpertMap, SlotRead};
use crate::policy::{EvictionPolicy, Key, PolicyKind};
use crate::{CacheCapacity, ExpertBatch, ExpertSource, ExpertView, SlotHandle, StoreError, StoreStats};
use smoe_vault::Vault;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// How to build a store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Slots in the cache (clamped to `[top_k, all experts]`).
    pub slots: usize,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Reads in flight at most: fixed, or measured (see [`crate::depth`]).
    pub queue_depth: QueueDepth,
    /// io_uring or the pread pool.
    pub io: IoKind,
    /// Verify each blob's checksum when it is read (where the file has checksums).
    pub verify: bool,
    /// Fewest slots (the experts one token needs in one layer: top-k).
    pub min_slots: usize,
}

impl StoreOptions {
    /// Defaults for a cache of `slots` experts.
    pub fn with_slots(slots: usize) -> StoreOptions {
        StoreOptions {
            slots,
            policy: PolicyKind::ReuseDistance,
            queue_depth: QueueDepth::AUTO,
            io: IoKind::Auto,
            verify: true,
            min_slots: 1,
        }
    }
}

const NONE: u32 = u32::MAX;

/// Which read an injected fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FaultAt {
    /// The expert read with this number (counting from 0 at the store's opening).
    Nth(u64),
    /// The next read of this expert.
    Key(Key),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SlotState {
    Empty,
    /// A read is in flight; `prefetch` if it was issued as one (a request may since have
    /// joined it).
    Loading {
        prefetch: bool,
    },
    Ready,
}

struct Slot {
    key: Option<Key>,
    state: SlotState,
    pins: u32,
    /// Loaded by a prefetch and not used since.
    prefetched: bool,
    /// Reads of this slot still in flight (one per extent of the expert).
    reads: u8,
    /// The first error among this slot's reads.
    error: Option<std::io::Error>,
    /// Which fill of the store this slot holds ([`SlotHandle::load`]).
    load: u64,
}

impl Slot {
    fn empty() -> Slot {
        Slot { key: None, state: SlotState::Empty, pins: 0, prefetched: false, reads: 0, error: None, load: 0 }
    }
}

/// Reads of one slot are tagged `slot * TAGS + extent`.
const TAGS: usize = 4;

struct Inner {
    /// Chooses the reads in flight (fixed, or by measurement).
    tuner: DepthTuner,
    /// Room to interleave an expert's matrices in.
    scratch: Vec<u8>,
    engine: Box<dyn ReadEngine>,
    slots: Vec<Slot>,
    /// Key index (`layer * experts + expert`) to slot.
    map: Vec<u32>,
    free: Vec<usize>,
    policy: Box<dyn EvictionPolicy>,
    stats: StoreStats,
    /// Test hook: faults for reads still to come ([`ExpertStore::inject_fault`]).
    faults: Vec<(FaultAt, Fault)>,
    /// Expert reads started so far (demand and prefetch): numbers them for `faults`.
    expert_reads: u64,
    // Scratch, reused across calls.
    candidates: Vec<(usize, Key)>,
    victims: Vec<usize>,
    completions: Vec<Completion>,
    reqs: Vec<ReadReq>,
    slot_reads: Vec<SlotRead>,
    /// Slots filled so far: the next fill's [`SlotHandle::load`].
    loads: u64,
    /// Slots in use now (`..capacity`; the arena's others are empty, their memory given back):
    /// the cache's size, lowered and raised by [`ExpertStore::resize`].
    capacity: usize,
    /// Slots read into since their memory was last given back.
    touched: Vec<bool>,
    /// The MoE layer ordinal computed last (for the eviction policy when shrinking).
    last_layer: u32,
}

/// The streaming store.
pub struct ExpertStore {
    inner: Mutex<Inner>,
    arena: Arena,
    map: ExpertMap,
    /// Decoder layer to MoE ordinal.
    ordinal: Vec<u32>,
    experts: usize,
    verify: bool,
    io_desc: String,
    /// Fewest slots ([`StoreOptions::min_slots`], clamped as at opening).
    min_slots: usize,
    /// A backend page-locked the arena: its pages must never be given back.
    locked: AtomicBool,
}

impl ExpertStore {
    /// Opens a store over `vault` without reading any expert.
    pub fn open(vault: &Vault, opts: &StoreOptions) -> Result<ExpertStore, StoreError> {
        let opts = StoreOptions { min_slots: opts.min_slots.max(vault.architecture().moe.top_k), ..opts.clone() };
        ExpertStore::open_map(ExpertMap::of_vault(vault)?, &opts)
    }

    /// Opens a store over the experts `map` describes (a vault's blobs, or a GGUF's stacked
    /// tensors read in place).
    pub fn open_map(map: ExpertMap, opts: &StoreOptions) -> Result<ExpertStore, StoreError> {
        let experts = map.num_experts;
        let total = map.total_experts();
        let top_k = opts.min_slots.max(1);
        let slots = opts.slots.clamp(top_k.min(total).max(1), total.max(1));
        let max_layer = map.moe_layers.iter().copied().max().unwrap_or(0);
        let mut ordinal = vec![NONE; max_layer + 1];
        for (i, &l) in map.moe_layers.iter().enumerate() {
            ordinal[l] = i as u32;
        }
        if map.layers.iter().any(|l| l.extents.len() > TAGS) {
            return Err(StoreError::Config(format!("an expert may be read in at most {TAGS} pieces")));
        }
        let arena = Arena::new(slots, map.slot_size(), map.align)?;
        let mut engine = io::engine(&map.files, map.align, opts.queue_depth.max(), opts.io)
            .map_err(|e| StoreError::Config(format!("opening the expert files: {e}")))?;
        let tuner = DepthTuner::new(opts.queue_depth);
        engine.set_limit(tuner.depth());
        let io_desc = format!("{}, queue depth {}", engine.describe(), opts.queue_depth);
        let inner = Inner {
            engine,
            slots: (0..slots).map(|_| Slot::empty()).collect(),
            map: vec![NONE; total],
            free: (0..slots).rev().collect(),
            policy: opts.policy.build(map.moe_layers.len(), experts),
            stats: StoreStats::default(),
            faults: Vec::new(),
            expert_reads: 0,
            candidates: Vec::new(),
            victims: Vec::new(),
            completions: Vec::new(),
            reqs: Vec::new(),
            slot_reads: Vec::new(),
            loads: 0,
            tuner,
            scratch: Vec::new(),
            capacity: slots,
            touched: vec![false; slots],
            last_layer: 0,
        };
        let min_slots = top_k.min(slots);
        Ok(ExpertStore {
            inner: Mutex::new(inner),
            arena,
            map,
            ordinal,
            experts,
            verify: opts.verify,
            io_desc,
            min_slots,
            locked: AtomicBool::new(false),
        })
    }

    /// Slots in the cache now (its size at opening unless [`ExpertStore::resize`]d).
    pub fn slots(&self) -> usize {
        self.inner.lock().unwrap().capacity
    }

    /// Bytes of the cache now.
    pub fn cache_bytes(&self) -> u64 {
        (self.slots() * self.arena.slot_size()) as u64
    }

    /// The cache's size and what it holds.
    pub fn capacity(&self) -> CacheCapacity {
        let inner = self.inner.lock().unwrap();
        self.capacity_of(&inner)
    }

    fn capacity_of(&self, inner: &Inner) -> CacheCapacity {
        let locked = self.locked.load(Ordering::Relaxed);
        CacheCapacity {
            slots: inner.capacity,
            max_slots: self.arena.slots(),
            min_slots: self.min_slots,
            slot_bytes: self.arena.slot_size() as u64,
            // A locked arena is resident whole: the driver touched every page when locking. The
            // prefaulting thread's slots are held too, read into or not (without them the
            // server's memory watch saw memory gone and the cache not grown, and shrank it).
            resident_slots: if locked {
                self.arena.slots()
            } else {
                let pre = self.arena.prefaulted_slots().min(inner.capacity);
                pre + inner.touched[pre..].iter().filter(|&&t| t).count()
            },
            locked,
        }
    }

    /// Resizes the cache to `slots` experts, clamped to `[top-k, the size at opening]`. Safe at
    /// any time and from any thread: it takes the store's lock, which a request holds while a
    /// layer computes on the cache's slots, so it runs between layers.
    ///
    /// Growing makes the slots up to the new size free again. Shrinking waits for the reads in
    /// flight (prefetches; nothing computes meanwhile), evicts the experts the policy ranks
    /// least worth keeping until the rest fit, moves those still above the new size into free
    /// slots below it (with a new [`SlotHandle::load`], so a backend's copies are refreshed),
    /// and gives the memory of every slot above it back to the kernel, unless a backend locked
    /// it ([`ExpertSource::host_memory_locked`]). An evicted expert is read again when next
    /// used: results never change, only what is read.
    pub fn resize(&self, slots: usize) -> CacheCapacity {
        let target = slots.clamp(self.min_slots.max(1), self.arena.slots());
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        if target >= inner.capacity {
            inner.free.extend((inner.capacity..target).rev());
            inner.capacity = target;
            return self.capacity_of(inner);
        }
        // 1. Let the prefetches in flight land (their errors only cost the expert its slot:
        // nobody waits for it). Not a spin: each reap blocks until a read completes.
        let mut landed = Vec::new();
        while inner.engine.pending() > 0 {
            let before = inner.engine.pending();
            landed.clear();
            if let Err(e) = self.reap(inner, &mut landed) {
                if inner.engine.pending() == before {
                    tracing::warn!("not shrinking the expert cache: waiting for its reads failed: {e}");
                    return self.capacity_of(inner);
                }
            }
        }
        // 2. Evict until what is left fits the new size.
        let held = inner.slots.iter().filter(|s| s.key.is_some()).count();
        if held > target {
            let Inner { slots, candidates, victims, policy, .. } = inner;
            candidates.clear();
            candidates.extend(
                slots.iter().enumerate().filter(|(_, s)| s.pins == 0 && s.state == SlotState::Ready).map(|(i, s)| (i, s.key.unwrap())),
            );
            policy.victims(inner.last_layer, candidates, held - target, victims);
            for v in std::mem::take(&mut inner.victims) {
                self.forget(inner, v);
            }
        }
        // 3. Move the experts above the new size down into its empty slots.
        let mut empty: Vec<usize> = (0..target).filter(|&s| inner.slots[s].key.is_none()).collect();
        for s in target..inner.capacity {
            let Some(key) = inner.slots[s].key else { continue };
            let Some(d) = empty.pop() else {
                // Only a slot the eviction could not take (none, with nothing in flight and no
                // request computing) would get here; forgetting it keeps the bound.
                self.forget(inner, s);
                continue;
            };
            // SAFETY: `s` and `d` are distinct slots; no read is in flight (drained above) and
            // no view exists (views live only inside `with_experts`, which holds this lock).
            unsafe { self.arena.slot_mut(d).copy_from_slice(self.arena.slot(s)) };
            let prefetched = inner.slots[s].prefetched;
            inner.slots[d] =
                Slot { key: Some(key), state: SlotState::Ready, pins: 0, prefetched, reads: 0, error: None, load: inner.loads };
            inner.loads += 1;
            inner.touched[d] = true;
            let ki = self.key_index(key);
            inner.map[ki] = d as u32;
            inner.slots[s] = Slot::empty();
        }
        // 4. Give the memory above the new size back.
        if !self.locked.load(Ordering::Relaxed) {
            // SAFETY: the slots from `target` on are empty, with no read in flight and no view.
            unsafe { self.arena.release(target, self.arena.slots()) };
            inner.touched[target..].iter_mut().for_each(|t| *t = false);
        }
        inner.free = (0..target).rev().filter(|&s| inner.slots[s].key.is_none()).collect();
        inner.capacity = target;
        self.capacity_of(inner)
    }

    /// Empties a ready slot, keeping it out of the free list (the caller rebuilds it).
    fn forget(&self, inner: &mut Inner, s: usize) {
        if let Some(key) = inner.slots[s].key.take() {
            if inner.slots[s].prefetched {
                inner.stats.prefetch_wasted += 1;
            }
            let ki = self.key_index(key);
            inner.map[ki] = NONE;
        }
        inner.slots[s] = Slot::empty();
    }

    /// The I/O engine in use.
    pub fn io_description(&self) -> &str {
        &self.io_desc
    }

    /// Test hook: the next read of this (decoder layer, expert) fails with EIO.
    #[doc(hidden)]
    pub fn inject_read_error(&self, layer: usize, expert: usize) {
        let key = Key { layer: self.ordinal[layer], expert: expert as u32 };
        self.inner.lock().unwrap().faults.push((FaultAt::Key(key), Fault::Eio));
    }

    /// Test hook: the `nth` expert read from now (0: the next one; demand reads and prefetches
    /// count alike, one per expert however many pieces it is read in) meets `fault` in the I/O
    /// engine. Costs nothing when no fault is pending.
    #[doc(hidden)]
    pub fn inject_fault(&self, nth: u64, fault: Fault) {
        let mut inner = self.inner.lock().unwrap();
        let at = FaultAt::Nth(inner.expert_reads + nth);
        inner.faults.push((at, fault));
    }

    fn key_index(&self, k: Key) -> usize {
        k.layer as usize * self.experts + k.expert as usize
    }

    fn decoder_layer(&self, ordinal: u32) -> usize {
        self.map.moe_layers[ordinal as usize]
    }

    /// Frees up to `n` slots for layer ordinal `now`, never touching pinned or loading slots.
    fn make_room(&self, inner: &mut Inner, now: u32, n: usize) {
        if inner.free.len() >= n {
            return;
        }
        let need = n - inner.free.len();
        let Inner { slots, candidates, victims, policy, .. } = inner;
        candidates.clear();
        candidates
            .extend(slots.iter().enumerate().filter(|(_, s)| s.pins == 0 && s.state == SlotState::Ready).map(|(i, s)| (i, s.key.unwrap())));
        policy.victims(now, candidates, need, victims);
        let victims = std::mem::take(&mut inner.victims);
        for &s in &victims {
            let key = inner.slots[s].key.take().unwrap();
            if inner.slots[s].prefetched {
                inner.stats.prefetch_wasted += 1;
            }
            let ki = self.key_index(key);
            inner.map[ki] = NONE;
            inner.slots[s] = Slot::empty();
            inner.free.push(s);
        }
        inner.victims = victims;
    }

    /// Starts reading `key` into a free slot (the caller made room). Returns the slot.
    fn start_read(&self, inner: &mut Inner, key: Key, demand: bool) -> usize {
        let s = inner.free.pop().expect("make_room left a free slot");
        inner.touched[s] = true;
        let ki = self.key_index(key);
        inner.map[ki] = s as u32;
        let mut reads = std::mem::take(&mut inner.slot_reads);
        reads.clear();
        self.map.reads(key.layer as usize, key.expert as usize, &mut reads);
        let nth = inner.expert_reads;
        inner.expert_reads += 1;
        let hit = inner.faults.iter().position(|&(at, _)| at == FaultAt::Nth(nth) || at == FaultAt::Key(key));
        let fault = hit.map(|i| inner.faults.swap_remove(i).1);
        for (k, r) in reads.iter().enumerate() {
            let buf = self.arena.slot_ptr(s).wrapping_add(r.slot_offset);
            inner.reqs.push(ReadReq { tag: s * TAGS + k, file: r.file, offset: r.offset, len: r.len, need: r.need, buf, fault });
        }
        inner.slots[s] = Slot {
            key: Some(key),
            state: SlotState::Loading { prefetch: !demand },
            pins: 0,
            prefetched: !demand,
            reads: reads.len() as u8,
            error: None,
            load: inner.loads,
        };
        inner.loads += 1;
        inner.slot_reads = reads;
        s
    }

    fn flush_reads(&self, inner: &mut Inner) -> Result<(), StoreError> {
        if inner.reqs.is_empty() {
            return Ok(());
        }
        let reqs = std::mem::take(&mut inner.reqs);
        inner.stats.reads += reqs.len() as u64;
        let r = inner.engine.submit(&reqs);
        inner.reqs = reqs;
        inner.reqs.clear();
        r.map_err(|e| StoreError::Config(format!("submitting reads: {e}")))
    }

    /// Waits for at least one completion; marks slots ready, or forgets them on error (nothing
    /// is ever computed on a failed or corrupt blob). Appends `(slot, ok)` to `done`.
    fn reap(&self, inner: &mut Inner, done: &mut Vec<(usize, bool)>) -> Result<(), StoreError> {
        let t0 = Instant::now();
        inner.stats.inflight_samples += 1;
        inner.stats.inflight_sum += inner.engine.in_flight() as u64;
        let mut comps = std::mem::take(&mut inner.completions);
        comps.clear();
        let r = inner.engine.reap(&mut comps);
        inner.stats.wait_seconds += t0.elapsed().as_secs_f64();
        r.map_err(|e| StoreError::Config(format!("waiting for reads: {e}")))?;
        let mut first_err = None;
        for (tag, res) in comps.drain(..) {
            let s = tag / TAGS;
            let Some(key) = inner.slots[s].key else { continue };
            // An expert read in several pieces is done when its last piece lands.
            let slot = &mut inner.slots[s];
            slot.reads = slot.reads.saturating_sub(1);
            if let Err(e) = res {
                slot.error.get_or_insert(e);
            }
            if slot.reads > 0 {
                continue;
            }
            let res = slot.error.take().map_or(Ok(()), Err);
            let (ord, expert) = (key.layer as usize, key.expert as usize);
            let layer = self.decoder_layer(key.layer);
            let io_err = |e: std::io::Error| StoreError::Read {
                layer,
                expert,
                source: smoe_vault::VaultError::Io { path: "expert data".into(), source: e },
            };
            let outcome = match res {
                Err(e) => Err(io_err(e)),
                Ok(()) => {
                    inner.stats.bytes_read += self.map.read_bytes(ord, expert);
                    // SAFETY: every read into slot `s` has completed and nothing writes it now.
                    let data = unsafe { self.arena.slot(s) };
                    match self.map.checksum(ord, expert, data) {
                        Some((bytes, sum)) if self.verify && xxhash_rust::xxh3::xxh3_64(bytes) != sum => {
                            Err(StoreError::Checksum { layer, expert })
                        }
                        _ => Ok(()),
                    }
                }
            };
            match outcome {
                Ok(()) => {
                    // SAFETY: as above: the reads into slot `s` are complete, and it is not yet
                    // Ready, so no view of it exists.
                    self.map.interleave_slot(ord, expert, unsafe { self.arena.slot_mut(s) }, &mut inner.scratch);
                    inner.slots[s].state = SlotState::Ready;
                    done.push((s, true));
                }
                Err(e) => {
                    // A failed prefetch fails nobody: a request that joined it reads the
                    // expert again itself (`with_experts`), and only a demand read's error is
                    // reported. Reporting it here would fail whichever request reaped it,
                    // whether or not it needed that expert.
                    let prefetch = matches!(inner.slots[s].state, SlotState::Loading { prefetch: true });
                    let ki = self.key_index(key);
                    inner.map[ki] = NONE;
                    inner.slots[s] = Slot::empty();
                    inner.free.push(s);
                    done.push((s, false));
                    if !prefetch {
                        first_err.get_or_insert(e);
                    } else {
                        inner.stats.prefetch_failed += 1;
                        tracing::warn!("a prefetch failed; the expert is read again when a request needs it: {e}");
                    }
                }
            }
        }
        inner.completions = comps;
        first_err.map_or(Ok(()), Err)
    }

    /// Starts low-priority reads of experts predicted for decoder layer `layer`: only into free
    /// or evictable slots, and only while the queue has spare depth, so demand reads are never
    /// delayed by more than the prefetches already in flight.
    fn prefetch_reads(&self, layer: usize, experts: &[u32]) {
        let Some(&ord) = self.ordinal.get(layer).filter(|&&o| o != NONE) else { return };
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let budget = inner.tuner.depth().saturating_sub(inner.engine.pending()) / 2;
        let mut issued = 0;
        for &e in experts {
            if issued >= budget || e as usize >= self.experts {
                break;
            }
            let key = Key { layer: ord, expert: e };
            if inner.map[self.key_index(key)] != NONE {
                continue;
            }
            self.make_room(inner, ord, 1);
            if inner.free.is_empty() {
                break;
            }
            self.start_read(inner, key, false);
            inner.stats.prefetch_issued += 1;
            issued += 1;
        }
        let _ = self.flush_reads(inner);
    }
}

impl ExpertSource for ExpertStore {
    /// For one layer: pins the resident experts, issues reads for every missing one at once
    /// (as many as fit; a request larger than the cache runs in waves), computes the resident
    /// ones while the reads are in flight, then computes each missing expert as it lands.
    fn with_experts(&self, layer: usize, experts: &[u32], f: &mut dyn FnMut(&ExpertBatch<'_>)) -> Result<(), StoreError> {
        let ord = *self.ordinal.get(layer).filter(|&&o| o != NONE).ok_or(StoreError::NoSuchExpert { layer, expert: 0 })?;
        if let Some(&e) = experts.iter().find(|&&e| e as usize >= self.experts) {
            return Err(StoreError::NoSuchExpert { layer, expert: e as usize });
        }
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.policy.touch(ord, experts);
        inner.last_layer = ord;
        let mut todo: Vec<usize> = (0..experts.len()).collect();
        let mut first_err: Option<StoreError> = None;
        let (mut ready, mut wait, mut landed) = (Vec::new(), Vec::new(), Vec::new());
        // Waves: a request larger than the cache (a long prefill chunk on a small cache) is
        // served as many at a time as there are slots.
        while !todo.is_empty() && first_err.is_none() {
            ready.clear();
            wait.clear();
            let issued = Instant::now();
            let (reads0, bytes0) = (inner.stats.reads, inner.stats.bytes_read);
            // 1. Pin what is resident (or already being prefetched).
            todo.retain(|&i| {
                let key = Key { layer: ord, expert: experts[i] };
                let s = inner.map[self.key_index(key)];
                if s == NONE {
                    return true;
                }
                let slot = &mut inner.slots[s as usize];
                slot.pins += 1;
                if std::mem::take(&mut slot.prefetched) {
                    inner.stats.prefetch_used += 1;
                }
                if slot.state == SlotState::Ready {
                    inner.stats.hits += 1;
                    ready.push((i, s as usize));
                } else {
                    // A prefetch still in flight: a miss whose read started early.
                    inner.stats.misses += 1;
                    inner.stats.prefetch_late += 1;
                    wait.push((s as usize, i));
                }
                false
            });
            // 2. Issue every missing read at once, as many as slots allow.
            if !todo.is_empty() {
                self.make_room(inner, ord, todo.len());
                let n = todo.len().min(inner.free.len());
                for i in todo.drain(..n) {
                    let s = self.start_read(inner, Key { layer: ord, expert: experts[i] }, true);
                    inner.slots[s].pins += 1;
                    inner.stats.misses += 1;
                    wait.push((s, i));
                }
                if let Err(e) = self.flush_reads(inner) {
                    first_err.get_or_insert(e);
                }
                if ready.is_empty() && wait.is_empty() {
                    // Every slot is busy with prefetches: let one finish.
                    if let Err(e) = self.reap(inner, &mut landed) {
                        first_err.get_or_insert(e);
                    }
                    landed.clear();
                    continue;
                }
            }
            // 3. Compute the resident experts, as one batch, while the reads are in flight.
            if first_err.is_none() && !ready.is_empty() {
                let batch: Vec<(usize, ExpertView<'_>)> = ready
                    .iter()
                    .map(|&(i, s)| {
                        let handle = SlotHandle { slot: s as u32, load: inner.slots[s].load };
                        // SAFETY: these slots are ready and pinned; no read targets them until unpinned.
                        let bytes = unsafe { self.arena.slot(s) };
                        (i, self.map.view(ord as usize, experts[i] as usize, bytes, handle))
                    })
                    .collect();
                f(&batch);
            }
            for &(_, s) in &ready {
                inner.slots[s].pins -= 1;
            }
            // 4. Compute each missing expert as it lands, in completion order. Every read this
            // wave waits on is drained, even after an error, before the slots are let go.
            let waited_for = !wait.is_empty();
            let mut retry = Vec::new();
            while !wait.is_empty() {
                landed.clear();
                if let Err(e) = self.reap(inner, &mut landed) {
                    first_err.get_or_insert(e);
                }
                let mut arrived: Vec<(usize, usize)> = Vec::new();
                for &(s, ok) in &landed {
                    let Some(pos) = wait.iter().position(|&(ws, _)| ws == s) else { continue };
                    let (_, i) = wait.swap_remove(pos);
                    if ok {
                        arrived.push((i, s));
                    } else {
                        // A demand read's failure is in `first_err`; a joined prefetch's is
                        // not, and the expert is read again in the next wave. Either way it
                        // is never computed on.
                        retry.push(i);
                    }
                }
                if first_err.is_none() && !arrived.is_empty() {
                    let batch: Vec<(usize, ExpertView<'_>)> = arrived
                        .iter()
                        .map(|&(i, s)| {
                            let handle = SlotHandle { slot: s as u32, load: inner.slots[s].load };
                            // SAFETY: the reads into these slots completed and the slots are pinned.
                            let bytes = unsafe { self.arena.slot(s) };
                            (i, self.map.view(ord as usize, experts[i] as usize, bytes, handle))
                        })
                        .collect();
                    f(&batch);
                }
                for &(_, s) in &arrived {
                    inner.slots[s].pins -= 1;
                }
            }
            todo.extend(retry);
            if waited_for {
                let busy = issued.elapsed().as_secs_f64();
                inner.stats.busy_seconds += busy;
                let depth = inner.tuner.record(inner.stats.reads - reads0, inner.stats.bytes_read - bytes0, busy);
                inner.engine.set_limit(depth);
                if let Some(line) = inner.tuner.announcement() {
                    tracing::info!("{line}");
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn stats(&self) -> StoreStats {
        let inner = self.inner.lock().unwrap();
        StoreStats { queue_depth: inner.tuner.depth() as u32, ..inner.stats }
    }

    /// The arena: every view is one of its slots.
    fn host_memory(&self) -> Vec<(usize, usize)> {
        vec![self.arena.extent()]
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        self.prefetch_reads(layer, experts)
    }

    /// The arena's pages, faulted in on a background thread ([`Arena::prefault`]);
    /// `SMOE_PREFAULT=off` leaves them to the reads (to measure the difference).
    fn prefault_cache(&self) {
        if !std::env::var("SMOE_PREFAULT").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "no")) {
            self.arena.prefault();
        }
    }

    fn host_memory_locked(&self) {
        self.locked.store(true, Ordering::Relaxed);
    }

    fn cache_capacity(&self) -> Option<CacheCapacity> {
        Some(self.capacity())
    }

    fn resize_cache(&self, slots: usize) -> Option<CacheCapacity> {
        Some(self.resize(slots))
    }
}
