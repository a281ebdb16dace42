//! How much memory the expert cache may take: what the kernel says is available, capped by the
//! cgroup's limit (v1 or v2) on Linux, and by the kernel's own page statistics on macOS.

use std::path::{Path, PathBuf};

/// Available memory and where the figure came from.
#[derive(Clone, Debug)]
pub struct MemoryInfo {
    /// Bytes that can be used without swapping or hitting a limit.
    pub available: u64,
    /// Human-readable source (`MemAvailable`, `cgroup v1 limit`, ...).
    pub source: String,
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn stat_field(p: &Path, field: &str) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == field).then(|| v.trim().parse().ok()).flatten()
    })
}

/// `MemAvailable` from a meminfo file, in bytes.
pub(crate) fn meminfo_available(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Headroom under a cgroup memory limit: limit minus usage, not counting reclaimable page cache
/// (inactive file pages), as the kernel would reclaim them before failing an allocation.
fn cgroup_headroom(cgroup_file: &str, root: &Path) -> Option<(u64, String)> {
    let mut best: Option<(u64, String)> = None;
    for line in cgroup_file.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let (dir_candidates, limit_f, usage_f, stat_key, label): (Vec<PathBuf>, &str, &str, &str, &str) = if controllers.is_empty() {
            (vec![root.join(path), root.to_path_buf()], "memory.max", "memory.current", "inactive_file", "cgroup v2 limit")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                vec![root.join("memory").join(path), root.join("memory")],
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
                "cgroup v1 limit",
            )
        } else {
            continue;
        };
        let Some(dir) = dir_candidates.into_iter().find(|d| d.join(usage_f).exists()) else { continue };
        // Walk up: an ancestor's limit can be the binding one.
        let mut d = dir.as_path();
        loop {
            if let (Some(limit), Some(usage)) = (read_u64(&d.join(limit_f)), read_u64(&d.join(usage_f))) {
                // v1 reports "no limit" as a huge number; v2 as "max" (which fails to parse).
                if limit < (1u64 << 60) {
                    let inactive = stat_field(&d.join("memory.stat"), stat_key).unwrap_or(0);
                    let head = limit.saturating_sub(usage.saturating_sub(inactive));
                    if best.as_ref().is_none_or(|(b, _)| head < *b) {
                        best = Some((head, format!("{label} {} MiB at {}", limit >> 20, d.display())));
                    }
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

/// Memory available to this process now.
pub fn available_memory() -> MemoryInfo {
    #[cfg(target_os = "linux")]
    {
        let mut info = MemoryInfo { available: u64::MAX, source: "unknown".into() };
        if let Some(a) = std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(meminfo_available) {
            info = MemoryInfo { available: a, source: "MemAvailable".into() };
        }
        if let Ok(cg) = std::fs::read_to_string("/proc/self/cgroup") {
            if let Some((head, label)) = cgroup_headroom(&cg, Path::new("/sys/fs/cgroup")) {
                if head < info.available {
                    info = MemoryInfo { available: head, source: label };
                }
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(label.contains("cgroup v2"));
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
