//! How much memory the expert cache may take: what the kernel says is available, capped by the
//! cgroup's limit (v1 or v2) on Linux, and by the kernel's own page statistics on macOS. Read at
//! start to size caches, and again while serving ([`available_memory`] is cheap: a few small
//! files), with [`PressureEvents`] to hear of a cgroup's reclaim at once.

use std::path::{Path, PathBuf};

/// Available memory and where the figure came from.
#[derive(Clone, Debug)]
pub struct MemoryInfo {
    /// Bytes that can be used without swapping or hitting a limit.
    pub available: u64,
    /// Human-readable source (`MemAvailable`, `cgroup v1 limit`, ...).
    pub source: String,
}

// Linux reads /proc and the cgroup files; other systems only test these.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn stat_field(stat: &str, field: &str) -> u64 {
    stat.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == field).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

/// Page cache in a cgroup's `memory.stat` that the kernel reclaims before failing an
/// allocation: file pages, inactive or active (reclaim deactivates active ones), less those
/// mapped into a process, dirty or under writeback. `keys`: the inactive, active, mapped, dirty
/// and writeback fields of the cgroup version.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn reclaimable_cache(stat: &str, keys: [&str; 5]) -> u64 {
    let f = |i: usize| stat_field(stat, keys[i]);
    (f(0) + f(1)).saturating_sub(f(2) + f(3) + f(4))
}

/// `MemAvailable` from a meminfo file, in bytes.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) fn meminfo_available(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Headroom under a cgroup memory limit: limit minus usage, not counting the page cache the
/// kernel would reclaim before failing an allocation ([`reclaimable_cache`]). The limit is v1's
/// `memory.limit_in_bytes`, or the lower of v2's `memory.max` and `memory.high` (above `high`
/// the kernel throttles and reclaims: lowering it is how a v2 cgroup is asked to shrink).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn cgroup_headroom(cgroup_file: &str, root: &Path) -> Option<(u64, String)> {
    const V1_STAT: [&str; 5] = ["total_inactive_file", "total_active_file", "total_mapped_file", "total_dirty", "total_writeback"];
    const V2_STAT: [&str; 5] = ["inactive_file", "active_file", "file_mapped", "file_dirty", "file_writeback"];
    let mut best: Option<(u64, String)> = None;
    for line in cgroup_file.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let (dir_candidates, limit_files, usage_f, stat_keys, label): (Vec<PathBuf>, &[&str], &str, [&str; 5], &str) =
            if controllers.is_empty() {
                (vec![root.join(path), root.to_path_buf()], &["memory.max", "memory.high"], "memory.current", V2_STAT, "cgroup v2")
            } else if controllers.split(',').any(|c| c == "memory") {
                (
                    vec![root.join("memory").join(path), root.join("memory")],
                    &["memory.limit_in_bytes"],
                    "memory.usage_in_bytes",
                    V1_STAT,
                    "cgroup v1",
                )
            } else {
                continue;
            };
        let Some(dir) = dir_candidates.into_iter().find(|d| d.join(usage_f).exists()) else { continue };
        // Walk up: an ancestor's limit can be the binding one.
        let mut d = dir.as_path();
        loop {
            // v1 reports "no limit" as a huge number; v2 as "max" (which fails to parse).
            let limit = limit_files
                .iter()
                .filter_map(|f| read_u64(&d.join(f)).filter(|&l| l < (1u64 << 60)).map(|l| (l, *f)))
                .min_by_key(|&(l, _)| l);
            if let (Some((limit, file)), Some(usage)) = (limit, read_u64(&d.join(usage_f))) {
                let stat = std::fs::read_to_string(d.join("memory.stat")).unwrap_or_default();
                let head = limit.saturating_sub(usage.saturating_sub(reclaimable_cache(&stat, stat_keys)));
                if best.as_ref().is_none_or(|(b, _)| head < *b) {
                    best = Some((head, format!("{label} {file} {} MiB at {}", limit >> 20, d.display())));
                }
            }
            match d.parent() {
                Some(p) if p.starts_with(root) && p != root => d = p,
                _ => break,
            }
        }
    }
    best
}

/// Test hook: a directory whose `memory/` subdirectory stands for this process's cgroup-v1
/// memory controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`), so that
/// a test can lower a "limit" under a running server without root.
pub const TEST_CGROUP_ROOT_ENV: &str = "SMOE_TEST_CGROUP_ROOT";

/// Memory available to this process now: `MemAvailable`, or the headroom under the tightest
/// cgroup limit (v1 `memory.limit_in_bytes` or v2 `memory.max`, of its cgroup or an ancestor)
/// if that is less. A cgroup's headroom is its limit minus its usage, not counting inactive
/// page cache, which the kernel reclaims before failing an allocation.
/// [`TEST_CGROUP_ROOT_ENV`] replaces the cgroup with a directory of files (a test hook).
pub fn available_memory() -> MemoryInfo {
    #[cfg(target_os = "linux")]
    {
        let mut info = MemoryInfo { available: u64::MAX, source: "unknown".into() };
        if let Some(a) = std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(meminfo_available) {
            info = MemoryInfo { available: a, source: "MemAvailable".into() };
        }
        let cgroup = match std::env::var_os(TEST_CGROUP_ROOT_ENV) {
            Some(root) => cgroup_headroom("1:memory:/\n", Path::new(&root)),
            None => std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|cg| cgroup_headroom(&cg, Path::new("/sys/fs/cgroup"))),
        };
        if let Some((head, label)) = cgroup {
            if head < info.available {
                info = MemoryInfo { available: head, source: label };
            }
        }
        info
    }
    #[cfg(target_os = "macos")]
    {
        macos_available().unwrap_or(MemoryInfo { available: 8 << 30, source: "default (vm_stat unavailable)".into() })
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        MemoryInfo { available: 8 << 30, source: "default".into() }
    }
}

/// Notifications of memory pressure in this process's cgroup-v1 memory controller: an
/// eventfd registered on its `memory.pressure_level` at level `low`, which the kernel signals
/// whenever it reclaims memory in the cgroup (a limit lowered, usage reaching the limit).
/// Where that is unavailable (cgroup v2, no write access to `cgroup.event_control`, not
/// Linux) [`PressureEvents::open`] fails and callers poll instead.
pub struct PressureEvents {
    #[cfg(target_os = "linux")]
    efd: std::os::fd::OwnedFd,
    /// Open for as long as the registration should last: the kernel drops it on close.
    #[cfg(target_os = "linux")]
    _level: std::fs::File,
    /// Where the events come from, for the log.
    pub source: String,
}

impl PressureEvents {
    /// Registers for pressure events of this process's memory cgroup (v1).
    pub fn open() -> Result<PressureEvents, String> {
        #[cfg(target_os = "linux")]
        {
            use std::io::Write;
            use std::os::fd::{AsRawFd, FromRawFd};
            if std::env::var_os(TEST_CGROUP_ROOT_ENV).is_some() {
                return Err(format!("{TEST_CGROUP_ROOT_ENV} is set"));
            }
            let cg = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
            let dir = cg
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                    let memory = controllers.split(',').any(|c| c == "memory");
                    memory.then(|| Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')))
                })
                .ok_or("no cgroup-v1 memory controller")?;
            let level = std::fs::File::open(dir.join("memory.pressure_level"))
                .map_err(|e| format!("{}: {e}", dir.join("memory.pressure_level").display()))?;
            // SAFETY: eventfd takes no pointers; a negative result is an error, checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if fd < 0 {
                return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: `fd` is a new descriptor that nothing else owns.
            let efd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            let control = dir.join("cgroup.event_control");
            std::fs::OpenOptions::new()
                .write(true)
                .open(&control)
                .and_then(|mut f| f.write_all(format!("{} {} low", efd.as_raw_fd(), level.as_raw_fd()).as_bytes()))
                .map_err(|e| format!("{}: {e}", control.display()))?;
            Ok(PressureEvents { efd, _level: level, source: format!("{} (low)", dir.join("memory.pressure_level").display()) })
        }
        #[cfg(not(target_os = "linux"))]
        Err("memory pressure events need Linux".into())
    }

    /// Waits up to `timeout` for pressure; true if there was some since the last call.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let mut p = libc::pollfd { fd: self.efd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd, for the duration of the call.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n <= 0 {
                return false;
            }
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes (an eventfd's counter, which this resets) into an 8-byte buffer.
            let got = unsafe { libc::read(self.efd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
            got == 8
        }
        #[cfg(not(target_os = "linux"))]
        {
            std::thread::sleep(timeout);
            false
        }
    }
}

/// Free, inactive and speculative pages from the kernel's `vm_stat`: memory macOS hands out
/// without swapping.
#[cfg(target_os = "macos")]
fn macos_available() -> Option<MemoryInfo> {
    let out = std::process::Command::new("vm_stat").output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let page: u64 = text.lines().next()?.split("page size of ").nth(1)?.split(' ').next()?.parse().ok()?;
    let pages = |name: &str| -> u64 {
        text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().trim_end_matches('.').parse().ok()).unwrap_or(0)
    };
    let free = pages("Pages free:") + pages("Pages inactive:") + pages("Pages speculative:") + pages("Pages purgeable:");
    Some(MemoryInfo { available: free * page, source: "vm_stat free+inactive+speculative+purgeable".into() })
}

/// The automatic cache size: available memory minus the dense weights and KV cache still to be
/// allocated and a reserve of 1 GiB plus 5% for everything else (the OS, buffers, other
/// programs). Returns the bytes and an explanation for the start-up report.
pub fn auto_cache_bytes(dense_bytes: u64, kv_bytes: u64) -> (u64, String) {
    let m = available_memory();
    let reserve = (1u64 << 30) + m.available / 20;
    let cache = m.available.saturating_sub(dense_bytes + kv_bytes + reserve);
    let why = format!(
        "{} MiB available ({}) - {} MiB dense - {} MiB KV - {} MiB reserve",
        m.available >> 20,
        m.source,
        dense_bytes >> 20,
        kv_bytes >> 20,
        reserve >> 20
    );
    (cache, why)
}

/// Hands the allocator's free memory back to the kernel; true where it did (glibc only).
///
/// glibc keeps freed memory in its per-thread arenas, and a server whose requests come and go
/// on a dozen threads holds, a few minutes in, megabytes of it that no request uses: a soak
/// saw resident memory swing by 15% with nothing retained. The server's memory watch calls
/// this every few seconds (a walk over the arenas, well under a millisecond at that size).
pub fn release_free_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointers; it locks each arena while it walks it, so it is
        // safe beside allocations on other threads.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Freed memory between blocks still held stays resident until trimmed; trimming gives
    /// most of it back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn released_heap_leaves_resident_memory() {
        let anon = || {
            let s = std::fs::read_to_string("/proc/self/status").unwrap();
            s.lines().find_map(|l| l.strip_prefix("RssAnon:")).unwrap().trim().trim_end_matches(" kB").parse::<u64>().unwrap() << 10
        };
        // 64 MiB in 4 KiB blocks, every block written; keep one in 16, free the rest.
        let mut blocks: Vec<Vec<u8>> = (0..16384).map(|i| vec![i as u8 | 1; 4096]).collect();
        let kept: Vec<Vec<u8>> = blocks.iter_mut().step_by(16).map(std::mem::take).collect();
        drop(blocks);
        let before = anon();
        assert!(release_free_heap(), "malloc_trim released nothing");
        let after = anon();
        assert!(before.saturating_sub(after) > 16 << 20, "resident anonymous memory {before} -> {after} bytes");
        assert!(kept.iter().enumerate().all(|(i, b)| b.len() == 4096 && b[0] == (i * 16) as u8 | 1), "kept blocks unchanged");
    }

    #[test]
    fn meminfo_parses() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_available(t), Some(20_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_v1_and_v2_limits() {
        let root = tempfile::tempdir().unwrap();
        let v1 = root.path().join("memory/jobs/a");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "8589934592\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "3221225472\n").unwrap();
        std::fs::write(v1.join("memory.stat"), "cache 10\ntotal_inactive_file 1073741824\n").unwrap();
        let (head, label) = cgroup_headroom("4:memory:/jobs/a\n3:cpu:/\n", root.path()).unwrap();
        assert_eq!(head, (8 << 30) - (2 << 30));
        assert!(label.contains("cgroup v1"));
        let v2 = root.path().join("user.slice/app");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "4294967296\n").unwrap();
        std::fs::write(v2.join("memory.current"), "1073741824\n").unwrap();
        std::fs::write(v2.join("memory.stat"), "anon 1\ninactive_file 0\n").unwrap();
        // The parent's tighter limit binds.
        std::fs::write(root.path().join("user.slice/memory.max"), "2147483648\n").unwrap();
        std::fs::write(root.path().join("user.slice/memory.current"), "1610612736\n").unwrap();
        let (head, label) = cgroup_headroom("0::/user.slice/app\n", root.path()).unwrap();
        assert_eq!(head, 512 << 20);
        assert!(label.contains("cgroup v2 memory.max"), "{label}");
        // memory.high binds when lower; clean, unmapped page cache, active or not, counts as
        // free, mapped and dirty pages do not.
        std::fs::write(root.path().join("user.slice/memory.max"), "max\n").unwrap();
        std::fs::write(v2.join("memory.high"), "1610612736\n").unwrap();
        std::fs::write(
            v2.join("memory.stat"),
            "anon 1\ninactive_file 100\nactive_file 268435356\nfile_mapped 16777216\nfile_dirty 0\nfile_writeback 0\n",
        )
        .unwrap();
        let (head, label) = cgroup_headroom("0::/user.slice/app\n", root.path()).unwrap();
        assert_eq!(head, (1536 << 20) - (1 << 30) + (240 << 20));
        assert!(label.contains("memory.high"), "{label}");
        std::fs::write(v2.join("memory.high"), "max\n").unwrap();
        // "max" means no limit.
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.path().join("user.slice/memory.max"), "max\n").unwrap();
        assert!(cgroup_headroom("0::/user.slice/app\n", root.path()).is_none());
    }

    #[test]
    fn this_machine_reports_something_sane() {
        let m = available_memory();
        assert!(m.available > 64 << 20, "{m:?}");
    }
}
