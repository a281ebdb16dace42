//! Transparent huge pages for weight memory.
//!
//! Decode streams every active weight once per token (gigabytes); with 4 KiB pages that is a
//! TLB miss and page walk every 4 KiB. Linux backs a range advised `MADV_HUGEPAGE` with 2 MiB
//! pages when its THP mode is `madvise` (a common default) or `always`; the advice must come
//! before the pages are first touched.

/// Advises the kernel to back the whole 2 MiB pages inside `buf` with huge pages. A no-op
/// where unsupported; failure only costs speed, so it is not reported.
pub fn advise(buf: &mut [u8]) {
    advise_range(buf.as_mut_ptr(), buf.len());
}

/// As [`advise`] for all of `v`'s allocation, including capacity not yet filled (so that a
/// buffer built by appending gets huge pages from its first byte).
pub fn advise_capacity(v: &mut Vec<u8>) {
    advise_range(v.as_mut_ptr(), v.capacity());
}

/// As [`advise`] for the `len` bytes at `ptr`, for memory not yet initialised (no slice of it
/// may exist yet). Only how the kernel backs the pages changes, never their contents.
pub fn advise_raw(ptr: *mut u8, len: usize) {
    advise_range(ptr, len)
}

fn advise_range(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: MADV_HUGEPAGE changes how the kernel backs pages, never their contents
            // or mappings; on a range that is not mapped it fails with ENOMEM, ignored.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

#[cfg(test)]
mod tests {
    /// Advising a buffer keeps its contents and leaves it usable, aligned or not.
    #[test]
    fn advice_keeps_contents() {
        let mut v: Vec<u8> = (0..(5 << 20) + 123).map(|i| (i % 251) as u8).collect();
        super::advise(&mut v[7..]);
        assert!(v.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        super::advise(&mut []);
        let mut w: Vec<u8> = Vec::with_capacity(3 << 20);
        super::advise_capacity(&mut w);
        w.extend_from_slice(&v[..3 << 20]);
        assert_eq!(w[..], v[..3 << 20]);
    }
}
