//! Transparent huge pages for weight memory.
//!
//! Decode streams every active weight once per token (gigabytes); with 4 KiB pages that is a
//! TLB miss and page walk every 4 KiB. Linux backs a range advised `MADV_HUGEPAGE` with 2 MiB
//! pages when its THP mode is `madvise` (a common default) or `always`; the advice must come
//! before the pages are first touched.

/// Advises the kernel to back the whole 2 MiB pages inside the `len` bytes at `ptr` with huge
/// pages: a buffer, or all of a `Vec`'s capacity before it is filled. A no-op where
/// unsupported; failure only costs speed, so it is not reported. Safe for any range: the
/// advice changes how pages are backed, never their contents.
pub fn advise(ptr: *const u8, len: usize) {
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
        let v: Vec<u8> = (0..(5 << 20) + 123).map(|i| (i % 251) as u8).collect();
        super::advise(v[7..].as_ptr(), v.len() - 7);
        assert!(v.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        super::advise(v.as_ptr(), 0);
        let mut w: Vec<u8> = Vec::with_capacity(3 << 20);
        super::advise(w.as_ptr(), w.capacity());
        w.extend_from_slice(&v[..3 << 20]);
        assert_eq!(w[..], v[..3 << 20]);
    }
}
