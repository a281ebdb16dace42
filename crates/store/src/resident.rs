//! Every expert in memory: the simplest [`ExpertSource`], and the reference the streaming store
//! is checked against.

use crate::map::{ExpertMap, SlotRead};
use crate::{ExpertBatch, ExpertSource, SlotHandle, StoreError, StoreStats};
use smoe_vault::Vault;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Every expert, read once (and verified where the file has checksums).
pub struct ResidentExperts {
    map: ExpertMap,
    data: Vec<u8>,
    /// MoE ordinal of each decoder layer.
    moe_index: Vec<Option<usize>>,
    stats: Mutex<StoreStats>,
}

impl ResidentExperts {
    /// Reads and verifies every blob of `vault`.
    pub fn load(vault: &Vault) -> Result<ResidentExperts, StoreError> {
        ResidentExperts::load_map(ExpertMap::of_vault(vault)?)
    }

    /// Reads every expert `map` describes.
    pub fn load_map(map: ExpertMap) -> Result<ResidentExperts, StoreError> {
        let files = map
            .files
            .iter()
            .map(|p| File::open(p).map_err(|e| StoreError::Config(format!("{}: {e}", p.display()))))
            .collect::<Result<Vec<_>, _>>()?;
        let size = map.slot_size();
        let mut data = vec![0u8; map.total_experts() * size];
        smoe_vault::hugepages::advise(data.as_ptr(), data.len());
        let mut moe_index = vec![None; map.moe_layers.iter().max().map_or(0, |m| m + 1)];
        for (ord, &layer) in map.moe_layers.iter().enumerate() {
            moe_index[layer] = Some(ord);
        }
        // Slots are independent: workers take them in order, each reading, verifying and
        // interleaving its own. Several reads in flight keep a disk busy, and from the page
        // cache the copy, checksum and first-touch page faults spread over the cores (one thread
        // read 16 GB at about 0.7 GB/s, bound by them).
        let workers = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(4, 32);
        let slots = Mutex::new(data.chunks_mut(size.max(1)).enumerate());
        let failed = AtomicBool::new(false);
        let bytes_read = std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers).map(|_| s.spawn(|| load_slots(&map, &files, &slots, &failed))).collect();
            handles.into_iter().map(|h| h.join().expect("a resident-load worker panicked")).sum::<Result<u64, StoreError>>()
        })?;
        Ok(ResidentExperts { map, data, moe_index, stats: Mutex::new(StoreStats { bytes_read, ..Default::default() }) })
    }
}

/// One worker of [`ResidentExperts::load_map`]: takes slots (numbered MoE ordinal × experts +
/// expert) until none is left or a worker has failed; returns the bytes it read.
fn load_slots<'a>(
    map: &ExpertMap,
    files: &[File],
    slots: &Mutex<impl Iterator<Item = (usize, &'a mut [u8])>>,
    failed: &AtomicBool,
) -> Result<u64, StoreError> {
    let (mut reads, mut scratch, mut bytes_read) = (Vec::new(), Vec::new(), 0);
    while !failed.load(Ordering::Relaxed) {
        let Some((i, slot)) = slots.lock().unwrap().next() else { break };
        let got = load_slot(map, files, i / map.num_experts, i % map.num_experts, slot, &mut reads, &mut scratch);
        bytes_read += got.inspect_err(|_| failed.store(true, Ordering::Relaxed))?;
    }
    Ok(bytes_read)
}

/// Reads expert `e` of MoE ordinal `ord` into its slot, verifies its checksum and interleaves
/// it for the kernels; returns the bytes read.
fn load_slot(
    map: &ExpertMap,
    files: &[File],
    ord: usize,
    e: usize,
    slot: &mut [u8],
    reads: &mut Vec<SlotRead>,
    scratch: &mut Vec<u8>,
) -> Result<u64, StoreError> {
    let layer = map.moe_layers[ord];
    let mut bytes_read = 0;
    reads.clear();
    map.reads(ord, e, reads);
    for r in reads.iter() {
        let dst = &mut slot[r.slot_offset..r.slot_offset + r.len];
        // The last read of a file may be rounded past its end: read what is there.
        let got = read_up_to(&files[r.file], dst, r.offset).map_err(|source| StoreError::Read {
            layer,
            expert: e,
            source: smoe_vault::VaultError::Io { path: map.files[r.file].display().to_string(), source },
        })?;
        bytes_read += got as u64;
    }
    if let Some((bytes, sum)) = map.checksum(ord, e, slot) {
        if xxhash_rust::xxh3::xxh3_64(bytes) != sum {
            return Err(StoreError::Checksum { layer, expert: e });
        }
    }
    map.interleave_slot(ord, e, slot, scratch);
    Ok(bytes_read)
}

/// Reads into `buf` at `offset` until it is full or the file ends; an expert's own bytes must
/// all be there, so a short read that cuts into them is an error.
fn read_up_to(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = f.metadata()?.len();
    if offset + (got as u64) < len.min(offset + buf.len() as u64) {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short read"));
    }
    Ok(got)
}

impl ExpertSource for ResidentExperts {
    fn with_experts(&self, layer: usize, experts: &[u32], f: &mut dyn FnMut(&ExpertBatch<'_>)) -> Result<(), StoreError> {
        let li = self.moe_index.get(layer).copied().flatten();
        let (n, size) = (self.map.num_experts, self.map.slot_size());
        let mut batch = Vec::with_capacity(experts.len());
        for (i, &e) in experts.iter().enumerate() {
            let e = e as usize;
            let li = li.filter(|_| e < n).ok_or(StoreError::NoSuchExpert { layer, expert: e })?;
            let off = (li * n + e) * size;
            let handle = SlotHandle { slot: (li * self.map.num_experts + e) as u32, load: 0 };
            batch.push((i, self.map.view(li, e, &self.data[off..off + size], handle)));
        }
        f(&batch);
        self.stats.lock().unwrap().hits += experts.len() as u64;
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        *self.stats.lock().unwrap()
    }

    fn host_memory(&self) -> Vec<(usize, usize)> {
        vec![(self.data.as_ptr() as usize, self.data.len())]
    }
}
