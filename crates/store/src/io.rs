//! Reading blobs into slots: io_uring with a deep queue where the kernel allows it, otherwise a
//! pool of threads doing `pread`. Files are opened with O_DIRECT (Linux) or F_NOCACHE (macOS)
//! so expert reads neither pollute nor depend on the page cache; where the filesystem refuses
//! O_DIRECT, reads fall back to buffered I/O (logged once).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// One read: `len` bytes at `offset` of file `file` into `buf`, identified by `tag`.
#[derive(Clone, Copy, Debug)]
pub struct ReadReq {
    /// Caller's identifier, returned with the completion (unique among reads in flight).
    pub tag: usize,
    /// Index of the file among the engine's files.
    pub file: usize,
    /// File offset (aligned for O_DIRECT).
    pub offset: u64,
    /// Bytes to read (aligned for O_DIRECT).
    pub len: usize,
    /// Bytes that must be read; the file may end between `need` and `len`.
    pub need: usize,
    /// Destination (aligned for O_DIRECT); must stay valid until the completion is reaped.
    pub buf: *mut u8,
    /// A fault a test injected into this read (`None` in normal operation).
    pub fault: Option<Fault>,
}

/// A fault injected into one read by a test ([`crate::ExpertStore::inject_fault`]). The read
/// runs for real, but each of its system calls reports what [`Fault::apply`] makes of the
/// result, so both engines' own error and retry paths handle it as they would a failing disk
/// or a file that shrank. `bytes` should be a multiple of the file's alignment: under O_DIRECT
/// the kernel returns short reads only in whole blocks, and a read resumed mid-block is refused.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with EIO.
    Eio,
    /// The first call returns at most `bytes` bytes, later ones run normally: a short read the
    /// engine must resume, with the right bytes in the end.
    Short {
        /// Bytes the first call returns at most (more than 0).
        bytes: usize,
    },
    /// The first call returns at most `bytes` bytes, later ones report the end of the file.
    Truncated {
        /// Bytes the first call returns at most.
        bytes: usize,
    },
}

impl Fault {
    /// What one read call of a faulted read reports: `res` is what the kernel returned, `done`
    /// the bytes the read already had before the call.
    pub fn apply(self, done: usize, res: io::Result<usize>) -> io::Result<usize> {
        match (self, res) {
            (Fault::Eio, _) => Err(io::Error::from_raw_os_error(libc::EIO)),
            (_, Err(e)) => Err(e),
            (Fault::Short { bytes } | Fault::Truncated { bytes }, Ok(n)) if done == 0 => Ok(n.min(bytes)),
            (Fault::Short { .. }, Ok(n)) => Ok(n),
            (Fault::Truncated { .. }, Ok(_)) => Ok(0),
        }
    }
}

// SAFETY: a ReadReq is a description of a read; the buffer it points to is owned by the store,
// which keeps it alive and untouched until the read's completion has been reaped.
unsafe impl Send for ReadReq {}

/// A completed read.
pub type Completion = (usize, io::Result<()>);

/// An asynchronous reader of a set of files.
pub trait ReadEngine: Send {
    /// `io_uring` or `pread pool`, and whether O_DIRECT is on.
    fn describe(&self) -> String;
    /// Reads the engine keeps in flight at most.
    fn depth(&self) -> usize;
    /// Queues reads (beyond `depth`, they wait their turn).
    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()>;
    /// Blocks until at least one queued read completes (returns at once if none is queued),
    /// appending completions to `out`.
    fn reap(&mut self, out: &mut Vec<Completion>) -> io::Result<()>;
    /// Reads queued or in flight.
    fn pending(&self) -> usize;
    /// Reads in flight (at most the limit; the rest of [`ReadEngine::pending`] is queued).
    fn in_flight(&self) -> usize;
    /// Keeps at most `n` reads in flight (clamped to `1..=depth`); the rest wait queued, in
    /// the order they were submitted.
    fn set_limit(&mut self, n: usize);
}

/// How the file ended up being opened.
pub struct OpenedFile {
    /// The file.
    pub file: File,
    /// Whether the page cache is bypassed.
    pub direct: bool,
}

/// Opens `path` for direct reads when the platform and filesystem allow, buffered otherwise.
pub fn open_direct(path: &Path, align: usize) -> io::Result<OpenedFile> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        if let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            // Some filesystems accept the flag at open and refuse the first read: probe one.
            if probe_read(&file, align) {
                return Ok(OpenedFile { file, direct: true });
            }
        }
        tracing::warn!("{}: the filesystem refuses O_DIRECT; expert reads go through the page cache", path.display());
        Ok(OpenedFile { file: File::open(path)?, direct: false })
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::unix::io::AsRawFd;
        let file = File::open(path)?;
        let _ = align;
        // SAFETY: fcntl on a valid, owned descriptor; F_NOCACHE takes an int argument.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
        Ok(OpenedFile { file, direct: rc == 0 })
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = align;
        Ok(OpenedFile { file: File::open(path)?, direct: false })
    }
}

#[cfg(target_os = "linux")]
fn probe_read(file: &File, align: usize) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(arena) = crate::arena::Arena::new(1, align, align) else { return false };
    // SAFETY: the arena slot is ours alone for the duration of this probe.
    let buf = unsafe { std::slice::from_raw_parts_mut(arena.slot_ptr(0), align) };
    file.read_at(buf, 0).is_ok()
}

/// Reads `len` bytes at `offset` into `buf`, retrying short reads; the end of the file may
/// come after `need` bytes, before that it is an `UnexpectedEof` error.
fn pread_exact(files: &[File], req: &ReadReq) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let file = files.get(req.file).ok_or_else(|| io::Error::other("read of an unknown file"))?;
    // SAFETY: the store guarantees `buf` is valid for `len` bytes and untouched until this
    // read's completion is reaped.
    let buf = unsafe { std::slice::from_raw_parts_mut(req.buf, req.len) };
    let mut got = 0;
    while got < req.need {
        let res = file.read_at(&mut buf[got..], req.offset + got as u64);
        let res = match req.fault {
            Some(f) => f.apply(got, res),
            None => res,
        };
        match res {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the file")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A pool of threads doing blocking `pread`s.
pub struct PreadPool {
    tx: Option<std::sync::mpsc::Sender<ReadReq>>,
    rx: std::sync::mpsc::Receiver<Completion>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Reads handed to the threads and not yet reaped.
    sent: usize,
    /// Reads waiting for the limit.
    queued: std::collections::VecDeque<ReadReq>,
    limit: usize,
    direct: bool,
}

impl PreadPool {
    /// `threads` readers of `files`.
    pub fn new(files: Vec<File>, direct: bool, threads: usize) -> io::Result<PreadPool> {
        let file = std::sync::Arc::new(files);
        let (tx, req_rx) = std::sync::mpsc::channel::<ReadReq>();
        let req_rx = std::sync::Arc::new(std::sync::Mutex::new(req_rx));
        let (done_tx, rx) = std::sync::mpsc::channel();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (file, req_rx, done_tx) = (file.clone(), req_rx.clone(), done_tx.clone());
            handles.push(std::thread::Builder::new().name(format!("smoe-read-{i}")).spawn(move || loop {
                let next = req_rx.lock().unwrap().recv();
                let Ok(req) = next else { break };
                if done_tx.send((req.tag, pread_exact(&file, &req))).is_err() {
                    break;
                }
            })?);
        }
        let limit = handles.len();
        Ok(PreadPool { tx: Some(tx), rx, threads: handles, sent: 0, queued: Default::default(), limit, direct })
    }

    /// Hands queued reads to the threads while fewer than `limit` are with them.
    fn dispatch(&mut self) -> io::Result<()> {
        while self.sent < self.limit {
            let Some(r) = self.queued.pop_front() else { break };
            self.tx.as_ref().unwrap().send(r).map_err(|_| io::Error::other("reader threads are gone"))?;
            self.sent += 1;
        }
        Ok(())
    }
}

impl ReadEngine for PreadPool {
    fn describe(&self) -> String {
        format!("pread pool ({} threads{})", self.threads.len(), if self.direct { ", direct" } else { ", buffered" })
    }
    fn depth(&self) -> usize {
        self.threads.len()
    }
    fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
        self.queued.extend(reqs.iter().copied());
        self.dispatch()
    }
    fn reap(&mut self, out: &mut Vec<Completion>) -> io::Result<()> {
        self.dispatch()?;
        if self.sent == 0 {
            return Ok(());
        }
        let first = self.rx.recv().map_err(|_| io::Error::other("reader threads are gone"))?;
        out.push(first);
        self.sent -= 1;
        while let Ok(c) = self.rx.try_recv() {
            out.push(c);
            self.sent -= 1;
        }
        self.dispatch()
    }
    fn pending(&self) -> usize {
        self.sent + self.queued.len()
    }
    fn in_flight(&self) -> usize {
        self.sent
    }
    fn set_limit(&mut self, n: usize) {
        self.limit = n.clamp(1, self.threads.len());
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        // Let in-flight reads finish before their buffers can go away.
        while self.sent > 0 {
            if self.rx.recv().is_err() {
                break;
            }
            self.sent -= 1;
        }
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(target_os = "linux")]
pub use uring::Uring;

#[cfg(target_os = "linux")]
mod uring {
    use super::{Completion, ReadEngine, ReadReq};
    use io_uring::{opcode, types, IoUring};
    use std::collections::{HashMap, VecDeque};
    use std::fs::File;
    use std::io;
    use std::os::unix::io::AsRawFd;

    /// io_uring reads with up to `depth` in flight.
    pub struct Uring {
        ring: IoUring,
        files: Vec<File>,
        depth: usize,
        queued: VecDeque<ReadReq>,
        /// In flight, by tag: the request and bytes already read (short reads resume).
        inflight: HashMap<usize, (ReadReq, usize)>,
        /// In flight at most (`set_limit`), up to `depth`.
        limit: usize,
        direct: bool,
    }

    impl Uring {
        /// A ring of `depth` entries over `files`; fails where io_uring is unavailable.
        pub fn new(files: Vec<File>, direct: bool, depth: usize) -> io::Result<Uring> {
            let ring = IoUring::new(depth.next_power_of_two() as u32)?;
            Ok(Uring { ring, files, depth, queued: VecDeque::new(), inflight: HashMap::new(), limit: depth, direct })
        }

        fn push(&mut self, r: ReadReq, done: usize) -> io::Result<()> {
            let fd = self.files.get(r.file).ok_or_else(|| io::Error::other("read of an unknown file"))?.as_raw_fd();
            let e = opcode::Read::new(types::Fd(fd), r.buf.wrapping_add(done), (r.len - done) as u32)
                .offset(r.offset + done as u64)
                .build()
                .user_data(r.tag as u64);
            // SAFETY: the buffer stays valid and untouched until the completion is reaped (the
            // store's contract for ReadReq), and the fd lives as long as the ring.
            unsafe { self.ring.submission().push(&e).map_err(|_| io::Error::other("submission queue full"))? };
            self.inflight.insert(r.tag, (r, done));
            Ok(())
        }

        fn fill(&mut self) -> io::Result<()> {
            while self.inflight.len() < self.limit {
                let Some(r) = self.queued.pop_front() else { break };
                self.push(r, 0)?;
            }
            self.ring.submit()?;
            Ok(())
        }
    }

    impl ReadEngine for Uring {
        fn describe(&self) -> String {
            format!("io_uring (depth {}{})", self.depth, if self.direct { ", direct" } else { ", buffered" })
        }
        fn depth(&self) -> usize {
            self.depth
        }
        fn submit(&mut self, reqs: &[ReadReq]) -> io::Result<()> {
            self.queued.extend(reqs.iter().copied());
            self.fill()
        }
        fn reap(&mut self, out: &mut Vec<Completion>) -> io::Result<()> {
            if self.inflight.is_empty() && self.queued.is_empty() {
                return Ok(());
            }
            let before = out.len();
            while out.len() == before {
                if self.inflight.is_empty() {
                    self.fill()?;
                }
                self.ring.submit_and_wait(1)?;
                let done: Vec<(usize, i32)> = self.ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
                for (tag, res) in done {
                    let Some((req, already)) = self.inflight.remove(&tag) else { continue };
                    let res = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
                    let res = match req.fault {
                        Some(f) => f.apply(already, res),
                        None => res,
                    };
                    match res {
                        Err(e) => out.push((tag, Err(e))),
                        Ok(0) => out.push((tag, Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the file")))),
                        // Everything needed is in (the file may end inside the aligned tail).
                        Ok(n) if already + n >= req.need => out.push((tag, Ok(()))),
                        Ok(n) => self.push(req, already + n)?,
                    }
                }
                self.fill()?;
            }
            Ok(())
        }
        fn pending(&self) -> usize {
            self.inflight.len() + self.queued.len()
        }
        fn in_flight(&self) -> usize {
            self.inflight.len()
        }
        fn set_limit(&mut self, n: usize) {
            self.limit = n.clamp(1, self.depth);
        }
    }

    impl Drop for Uring {
        fn drop(&mut self) {
            // In-flight reads target slots that may be freed after us: wait them out.
            while !self.inflight.is_empty() {
                if self.ring.submit_and_wait(1).is_err() {
                    break;
                }
                let done: Vec<usize> = self.ring.completion().map(|c| c.user_data() as usize).collect();
                for t in done {
                    self.inflight.remove(&t);
                }
            }
        }
    }
}

/// Which engine to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// io_uring where available, else the pread pool.
    Auto,
    /// Always the pread pool.
    Pool,
}

/// Opens the best available engine over `paths` with `depth` reads in flight. Direct I/O is
/// reported only if every file got it.
pub fn engine(paths: &[PathBuf], align: usize, depth: usize, kind: IoKind) -> io::Result<Box<dyn ReadEngine>> {
    let mut files = Vec::with_capacity(paths.len());
    let mut direct = true;
    for p in paths {
        let o = open_direct(p, align).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
        direct &= o.direct;
        files.push(o.file);
    }
    #[cfg(target_os = "linux")]
    if kind == IoKind::Auto {
        let clones = files.iter().map(File::try_clone).collect::<io::Result<Vec<_>>>()?;
        match Uring::new(clones, direct, depth) {
            Ok(u) => return Ok(Box::new(u)),
            Err(e) => tracing::warn!("io_uring unavailable ({e}); using a pread thread pool"),
        }
    }
    let _ = kind;
    Ok(Box::new(PreadPool::new(files, direct, depth.min(16))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::Arena;

    fn check_engine(mut e: Box<dyn ReadEngine>, path: &Path) {
        let data = std::fs::read(path).unwrap();
        let a = Arena::new(8, 8192, 4096).unwrap();
        let reqs: Vec<ReadReq> = (0..8)
            .map(|i| ReadReq { tag: i, file: 0, offset: ((7 - i) * 8192) as u64, len: 8192, need: 8192, buf: a.slot_ptr(i), fault: None })
            .collect();
        // With at most `limit` in flight, no reap can return more than `limit` completions,
        // and every read still lands.
        for limit in [32, 1, 3] {
            e.set_limit(limit);
            e.submit(&reqs).unwrap();
            assert!(e.in_flight() <= limit && e.pending() == 8, "{}: {} in flight at limit {limit}", e.describe(), e.in_flight());
            let mut done = Vec::new();
            while done.len() < 8 {
                let before = done.len();
                e.reap(&mut done).unwrap();
                assert!(done.len() - before <= limit, "{}: {} completions at limit {limit}", e.describe(), done.len() - before);
            }
            assert_eq!(e.pending(), 0);
            for (tag, r) in &done {
                r.as_ref().unwrap();
                // SAFETY: the read into this slot has completed.
                let s = unsafe { a.slot(*tag) };
                assert_eq!(s, &data[(7 - tag) * 8192..(8 - tag) * 8192], "{}", e.describe());
            }
        }
        // The file ends 1000 bytes into its last aligned block: a read that needs only those
        // bytes completes; one that needs more, or starts past the end, is an error, not a
        // hang or a panic.
        let tail = 8 * 8192;
        for (need, ok) in [(1000, true), (1001, false)] {
            e.submit(&[ReadReq { tag: 98, file: 0, offset: tail as u64, len: 4096, need, buf: a.slot_ptr(0), fault: None }]).unwrap();
            let mut done = Vec::new();
            e.reap(&mut done).unwrap();
            assert_eq!(done[0].1.is_ok(), ok, "need {need}: {}", e.describe());
            if ok {
                // SAFETY: the read into slot 0 has completed.
                assert_eq!(&unsafe { a.slot(0) }[..1000], &data[tail..], "{}", e.describe());
            }
        }
        e.submit(&[ReadReq { tag: 99, file: 0, offset: tail as u64 + 4096, len: 4096, need: 4096, buf: a.slot_ptr(0), fault: None }])
            .unwrap();
        let mut done = Vec::new();
        e.reap(&mut done).unwrap();
        assert!(done[0].1.is_err(), "{}", e.describe());
    }

    /// Each injected fault goes through the engine's own paths: EIO is an error, a short read
    /// is resumed and lands the right bytes, a read whose file ends early is an error; the
    /// engine then serves a healthy read as usual.
    fn check_faults(mut e: Box<dyn ReadEngine>, data: &[u8]) {
        eprintln!("faults through {}", e.describe());
        let a = Arena::new(1, 8192, 4096).unwrap();
        for (fault, ok) in [
            (Fault::Eio, false),
            (Fault::Short { bytes: 4096 }, true),
            (Fault::Truncated { bytes: 4096 }, false),
            (Fault::Truncated { bytes: 0 }, false),
        ] {
            for f in [Some(fault), None] {
                // SAFETY: no read into the slot is in flight.
                unsafe { a.slot_mut(0) }.fill(0);
                e.submit(&[ReadReq { tag: 7, file: 0, offset: 8192, len: 8192, need: 8192, buf: a.slot_ptr(0), fault: f }]).unwrap();
                let mut done = Vec::new();
                e.reap(&mut done).unwrap();
                let (tag, r) = done.pop().unwrap();
                assert_eq!(tag, 7);
                assert_eq!(r.is_ok(), ok || f.is_none(), "{f:?} {r:?}: {}", e.describe());
                if let Err(err) = r {
                    let eio = err.raw_os_error() == Some(libc::EIO);
                    assert!(eio == (fault == Fault::Eio), "{fault:?}: {err}");
                    assert!(eio || err.kind() == io::ErrorKind::UnexpectedEof, "{fault:?}: {err}");
                } else {
                    // SAFETY: the read into slot 0 has completed.
                    assert_eq!(unsafe { a.slot(0) }, &data[8192..16384], "{f:?}: {}", e.describe());
                }
            }
        }
    }

    #[test]
    fn injected_faults_take_the_engines_error_and_retry_paths() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..4 * 8192u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let paths = [path.clone()];
        check_faults(engine(&paths, 4096, 16, IoKind::Auto).unwrap(), &data);
        check_faults(engine(&paths, 4096, 4, IoKind::Pool).unwrap(), &data);
    }

    #[test]
    fn engines_read_what_the_file_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..8 * 8192u32 + 1000).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let paths = [path.clone()];
        check_engine(engine(&paths, 4096, 16, IoKind::Auto).unwrap(), &path);
        check_engine(engine(&paths, 4096, 4, IoKind::Pool).unwrap(), &path);
    }
}
