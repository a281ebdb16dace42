//! The cache's memory: one allocation of equal, aligned slots that the kernel reads into
//! directly (O_DIRECT needs aligned buffers, offsets and lengths).

use crate::StoreError;
use std::alloc::{alloc, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// `slots` slots of `slot_size` bytes, each aligned to `align`.
pub struct Arena {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_size: usize,
    slots: usize,
    /// The background thread that faults the pages in ahead of use, and what it shares.
    prefault: Mutex<Option<(Arc<Prefault>, JoinHandle<()>)>>,
    /// Bytes from the start below the lowest range [`Arena::release`] gave back: a prefaulting
    /// thread started later stops there.
    released_from: AtomicUsize,
}

/// What the prefaulting thread shares with the arena.
struct Prefault {
    /// Bytes from the arena's start that the thread may still fault in; held while it faults
    /// a piece, so that [`Arena::release`] can lower it and know no piece above is in progress.
    limit: Mutex<usize>,
    /// Bytes from the arena's start faulted in (whole pieces, lowered with the limit), read
    /// without the lock by [`Arena::prefaulted_slots`].
    done: AtomicUsize,
    stop: AtomicBool,
}

// SAFETY: the arena owns its allocation (freed only in `Drop`) and holds no thread-bound state,
// so moving it to another thread is sound.
unsafe impl Send for Arena {}
// SAFETY: `&Arena` gives out only raw pointers and, through the `unsafe` `slot`/`slot_mut`, slices
// whose callers promise no concurrent writer; the store keeps that promise with its pin counts
// and read completions, so shared access from several threads does not race.
unsafe impl Sync for Arena {}

impl Arena {
    /// Allocates the arena. Pages are touched only when read into, so an unused arena costs
    /// address space, not memory (see [`Arena::prefault`]).
    pub fn new(slots: usize, slot_size: usize, align: usize) -> Result<Arena, StoreError> {
        if slots == 0 || slot_size == 0 || !slot_size.is_multiple_of(align) {
            return Err(StoreError::Config(format!("bad arena: {slots} slots of {slot_size} bytes, alignment {align}")));
        }
        let size = slots.checked_mul(slot_size).ok_or_else(|| StoreError::Config("arena size overflows".into()))?;
        let layout = Layout::from_size_align(size, align).map_err(|e| StoreError::Config(format!("arena layout: {e}")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| StoreError::Config(format!("cannot allocate a {size}-byte expert cache")))?;
        // Before any read touches the pages, so that they are huge from the start.
        smoe_vault::hugepages::advise(ptr.as_ptr(), size);
        Ok(Arena { ptr, layout, slot_size, slots, prefault: Mutex::new(None), released_from: AtomicUsize::new(size) })
    }

    /// Starts faulting the arena's pages in on a background thread at the lowest CPU priority,
    /// from slot 0 up (the order the store fills slots), in pieces of 8 MiB through
    /// `MADV_POPULATE_WRITE` (Linux 5.14; elsewhere, or where the kernel refuses it, nothing
    /// happens). A page the kernel hands out must be zeroed first, and where that happens
    /// inside a read's submission it stalls the read and the thread that issued it: a cold
    /// 235B-shape decode on the 2-core VM spent 62% of its CPU time zeroing the cache's huge
    /// pages as reads landed in them (`perf`, docs/benchmarks.md). Faulting them in while the
    /// engine loads its dense weights (waiting on the disk) or waits for reads moves that work
    /// off the reads' path. It never changes a byte a read has written: pages already present
    /// are left as they are. The thread stops at the arena's drop and below [`Arena::release`]'s
    /// range, so a shrunk cache's memory stays given back (but for a huge page that straddles
    /// the range's start). [`Arena::prefaulted_slots`] says how far it got, for the memory
    /// accounting: those pages are held whether or not a read has landed in them yet.
    pub fn prefault(&self) {
        let mut slot = self.prefault.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() || !cfg!(target_os = "linux") {
            return;
        }
        let limit = self.released_from.load(Ordering::Relaxed);
        let shared = Arc::new(Prefault { limit: Mutex::new(limit), done: AtomicUsize::new(0), stop: AtomicBool::new(false) });
        let (base, theirs) = (self.ptr.as_ptr() as usize, shared.clone());
        let spawned = std::thread::Builder::new().name("smoe-prefault".into()).spawn(move || prefault_pages(base, &theirs));
        if let Ok(handle) = spawned {
            *slot = Some((shared, handle));
        }
    }

    /// Slots from 0 whose pages the prefaulting thread has faulted in (0 without one). Takes
    /// no lock the thread holds while it works, so the store may ask under its own.
    pub fn prefaulted_slots(&self) -> usize {
        let p = self.prefault.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|(p, _)| p.clone());
        p.map_or(0, |p| p.done.load(Ordering::Relaxed) / self.slot_size)
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The whole allocation as `(address, bytes)`.
    pub fn extent(&self) -> (usize, usize) {
        (self.ptr.as_ptr() as usize, self.layout.size())
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Where slot `i` starts, for the kernel to read into.
    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.slots, "slot {i} out of range");
        // SAFETY: `i < slots`, so the offset stays inside the allocation.
        unsafe { self.ptr.as_ptr().add(i * self.slot_size) }
    }

    /// The bytes of slot `i`.
    ///
    /// # Safety
    /// No read may be in flight into slot `i`, and nobody may write it while the slice lives
    /// (the store guarantees both by pinning).
    pub unsafe fn slot(&self, i: usize) -> &[u8] {
        // SAFETY: in bounds (slot_ptr checks); the caller guarantees no concurrent writes.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i), self.slot_size) }
    }

    /// Gives the memory of slots `first..last` back to the kernel (Linux; elsewhere a no-op):
    /// the whole pages inside the range are unmapped (`MADV_DONTNEED`) and read back as zeros
    /// when next touched. This is how a shrunk cache stops counting against a memory limit:
    /// freeing the allocation would move every slot, and the arena's address must stay fixed
    /// (views and a backend's page-locked ranges point into it).
    ///
    /// # Safety
    /// No read may be in flight into these slots and no reference to their bytes may exist;
    /// the range must not be page-locked by a device driver (a locked page, unmapped and faulted
    /// in anew, would no longer be the page the device copies from).
    pub unsafe fn release(&self, first: usize, last: usize) {
        let last = last.min(self.slots);
        if first >= last {
            return;
        }
        // The prefaulting thread stops below the released range (waiting for a piece it may be
        // faulting in), so it cannot fault the range in again after the madvise below.
        let prefault = self.prefault.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|(p, _)| p.clone());
        self.released_from.fetch_min(first * self.slot_size, Ordering::Relaxed);
        let _limit = prefault.as_ref().map(|p| {
            let mut limit = p.limit.lock().unwrap_or_else(|e| e.into_inner());
            *limit = (*limit).min(first * self.slot_size);
            p.done.fetch_min(*limit, Ordering::Relaxed);
            limit
        });
        #[cfg(target_os = "linux")]
        {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
            let start = (self.slot_ptr(first) as usize).next_multiple_of(page);
            let end = (self.ptr.as_ptr() as usize + last * self.slot_size) / page * page;
            if end > start {
                // SAFETY: [start, end) lies inside this arena's allocation (rounded inwards to
                // whole pages), and the caller guarantees nothing reads, writes or refers to
                // it; MADV_DONTNEED on private anonymous memory only drops the pages' contents.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
            }
        }
    }

    /// Slot `i` for rewriting in place (interleaving a landed expert).
    ///
    /// # Safety
    /// No read may be in flight into slot `i` and no other reference to it may exist while the
    /// returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, i: usize) -> &mut [u8] {
        // SAFETY: in bounds (slot_ptr checks); exclusive by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(i), self.slot_size) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // The prefaulting thread must be done with the memory before it is freed.
        if let Some((p, handle)) = self.prefault.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            p.stop.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The prefaulting thread's body ([`Arena::prefault`]): the arena at `base`, up to the
/// shared limit, 64 MiB at a time.
fn prefault_pages(base: usize, p: &Prefault) {
    #[cfg(target_os = "linux")]
    {
        // The lowest priority for this thread only (on Linux a thread id names one thread):
        // it should run where the engine's threads wait, not take their time.
        // SAFETY: gettid and setpriority read and write no memory of ours.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        }
        #[cfg(test)]
        while tests::HOLD.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        // Small, so that a `release` waiting for the piece under way (the store's lock held)
        // waits briefly.
        const PIECE: usize = 8 << 20;
        let mut at = 0;
        while !p.stop.load(Ordering::Relaxed) {
            let limit = p.limit.lock().unwrap_or_else(|e| e.into_inner());
            if at >= *limit {
                break;
            }
            let end = (at + PIECE).min(*limit);
            // SAFETY: [base + at, base + end) lies inside the arena, which outlives this thread
            // (its drop joins it first); MADV_POPULATE_WRITE only maps pages that are not
            // present yet (zeroed, as any first touch would) and writes no byte of a present
            // one, so a read landing in the range concurrently keeps its bytes; the range is
            // below the released slots (the limit, held while faulting).
            let rc = unsafe { libc::madvise((base + at) as *mut libc::c_void, end - at, libc::MADV_POPULATE_WRITE) };
            if rc != 0 {
                break; // an older kernel (EINVAL), or no memory for it (the reads will fault)
            }
            p.done.store(end, Ordering::Relaxed);
            drop(limit);
            at = end;
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (base, p);
}

#[cfg(all(test, target_os = "linux"))]
impl Arena {
    /// Waits for the prefaulting thread to finish (tests); what it shares stays in place.
    fn wait_prefault(&self) {
        let mut slot = self.prefault.lock().unwrap();
        if let Some((p, handle)) = slot.take() {
            handle.join().unwrap();
            *slot = Some((p, std::thread::spawn(|| {})));
        }
    }

    /// How many of the 4 KiB pages of slots `first..last` are resident (Linux's `mincore`).
    fn resident_pages(&self, first: usize, last: usize) -> usize {
        let (start, len) = (self.slot_ptr(first), (last - first) * self.slot_size);
        let mut v = vec![0u8; len.div_ceil(4096)];
        // SAFETY: [start, start + len) lies in the arena's mapping and start is page-aligned
        // (the tests use 4 KiB alignment); `v` has a byte per page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(rc, 0);
        v.iter().filter(|&&b| b & 1 == 1).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds a prefaulting thread before its first piece (one test at a time uses it).
    #[cfg(target_os = "linux")]
    pub(super) static HOLD: AtomicBool = AtomicBool::new(false);

    /// Prefaulting makes every page resident without changing a byte written before or while
    /// it runs, and a released range stays given back (the thread stops below it).
    #[cfg(target_os = "linux")]
    #[test]
    fn prefault_keeps_bytes_and_released_slots_stay_released() {
        const SLOT: usize = 1 << 20;
        let a = Arena::new(96, SLOT, 4096).unwrap();
        // SAFETY: nothing else touches slot 5 yet.
        unsafe { std::ptr::write_bytes(a.slot_ptr(5), 0xa5, SLOT) };
        // The thread waits until the range is released, as a cache shrunk early would be.
        HOLD.store(true, Ordering::Relaxed);
        a.prefault();
        // SAFETY: as above, for slot 60.
        unsafe { std::ptr::write_bytes(a.slot_ptr(60), 0x5a, SLOT) };
        // SAFETY: no reads in flight and no references into slots 64..96.
        unsafe { a.release(64, 96) };
        HOLD.store(false, Ordering::Relaxed);
        a.wait_prefault();
        assert_eq!(a.prefaulted_slots(), 64, "counted as held: the kept slots");
        let pages = 64 * SLOT / 4096;
        assert_eq!(a.resident_pages(0, 64), pages, "the kept slots are faulted in");
        // At most the huge page that straddles slot 64's start (faulted in for slot 63).
        let back = a.resident_pages(64, 96);
        assert!(back <= 512, "the released slots stay given back: {back} of {} pages resident", 32 * SLOT / 4096);
        // SAFETY: no reads in flight.
        let (s5, s60, s7) = unsafe { (a.slot(5), a.slot(60), a.slot(7)) };
        assert!(s5.iter().all(|&b| b == 0xa5) && s60.iter().all(|&b| b == 0x5a) && s7.iter().all(|&b| b == 0));
        // A second arena dropped while its thread runs frees nothing under it (the drop joins).
        let b = Arena::new(256, SLOT, 4096).unwrap();
        b.prefault();
        drop(b);
    }

    #[test]
    fn slots_are_aligned_and_disjoint() {
        let a = Arena::new(5, 8192, 4096).unwrap();
        for i in 0..5 {
            assert_eq!(a.slot_ptr(i) as usize % 4096, 0);
            // SAFETY: nothing else touches the arena in this test.
            unsafe { std::ptr::write_bytes(a.slot_ptr(i), i as u8, 8192) };
        }
        for i in 0..5 {
            // SAFETY: no reads in flight.
            let s = unsafe { a.slot(i) };
            assert!(s.iter().all(|&b| b == i as u8));
        }
        assert!(Arena::new(0, 4096, 4096).is_err());
        // Released slots come back as zeros (their pages were given back); the others keep
        // their bytes.
        // SAFETY: no reads in flight and no references to slots 3 and 4.
        unsafe { a.release(3, 5) };
        for i in 0..5 {
            // SAFETY: as above.
            let s = unsafe { a.slot(i) };
            let want = if cfg!(target_os = "linux") && i >= 3 { 0 } else { i as u8 };
            assert!(s.iter().all(|&b| b == want), "slot {i}");
        }
        assert!(Arena::new(2, 100, 4096).is_err());
    }
}
