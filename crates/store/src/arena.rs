//! The cache's memory: one allocation of equal, aligned slots that the kernel reads into
//! directly (O_DIRECT needs aligned buffers, offsets and lengths).

use crate::StoreError;
use std::alloc::{alloc, dealloc, Layout};
use std::ptr::NonNull;

/// `slots` slots of `slot_size` bytes, each aligned to `align`.
pub struct Arena {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_size: usize,
    slots: usize,
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
    /// address space, not memory.
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
        Ok(Arena { ptr, layout, slot_size, slots })
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
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
