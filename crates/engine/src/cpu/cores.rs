//! How many compute threads to run by default: one per physical core this process may use.
//!
//! `available_parallelism` counts logical CPUs, so on a desktop with SMT (a 16-core Ryzen shows
//! 32) it would put two spinning pool threads on each core. Decode streams weights from memory
//! and prefill keeps the vector units busy; a second thread on the same core adds neither
//! bandwidth nor execution units, and the pool's spinning workers take issue slots from their
//! busy siblings. llama.cpp defaults to the physical cores for the same reason. Neither
//! machine this project measures on has SMT (one thread per core on both), so the choice is
//! recorded here, not measured.

use std::collections::HashSet;
use std::path::Path;

/// Threads to use when none are asked for: the physical cores among the CPUs this process may
/// run on (Linux: its affinity list and sysfs topology), never more than
/// `available_parallelism` (which also honours a cgroup's CPU quota); elsewhere, or when the
/// topology cannot be read, `available_parallelism`.
pub fn default_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(count_default_threads)
}

fn count_default_threads() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let allowed = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).and_then(|list| parse_cpu_list(list.trim())));
    match allowed.and_then(|cpus| physical_cores(Path::new("/sys/devices/system/cpu"), &cpus)) {
        Some(cores) => cores.clamp(1, logical),
        None => logical,
    }
}

/// A kernel CPU list (`0-3,8,10-11`) as CPU numbers; `None` if it does not parse.
pub fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Cores among `cpus`: distinct sets of hardware threads sharing a core
/// (`root/cpuN/topology/thread_siblings_list`, as llama.cpp counts them; `core_id` alone can
/// repeat across the dies of one package); `None` if any CPU's topology is missing.
pub fn physical_cores(root: &Path, cpus: &[usize]) -> Option<usize> {
    let mut cores = HashSet::new();
    for cpu in cpus {
        let siblings = std::fs::read_to_string(root.join(format!("cpu{cpu}/topology/thread_siblings_list"))).ok()?;
        cores.insert(siblings.trim().to_string());
    }
    (!cores.is_empty()).then_some(cores.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        for bad in ["", "a", "3-1", "1-", "0-99999999"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad:?}");
        }
    }

    /// A topology tree written to disk the way sysfs lays it out: 4 cores × 2 SMT threads
    /// (CPUs 0-7, siblings n and n + 4).
    #[test]
    fn smt_siblings_count_once_and_the_affinity_list_is_honoured() {
        let root = std::env::temp_dir().join(format!("smoe-topology-{}", std::process::id()));
        for cpu in 0..8usize {
            let dir = root.join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("thread_siblings_list"), format!("{},{}\n", cpu % 4, cpu % 4 + 4)).unwrap();
        }
        assert_eq!(physical_cores(&root, &(0..8).collect::<Vec<_>>()), Some(4));
        assert_eq!(physical_cores(&root, &[0, 4]), Some(1), "two siblings are one core");
        assert_eq!(physical_cores(&root, &[0, 1, 2]), Some(3));
        assert_eq!(physical_cores(&root, &[0, 9]), None, "a CPU without topology");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_default_is_between_one_and_the_logical_count() {
        let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
        let t = default_threads();
        assert!((1..=logical).contains(&t), "{t} of {logical}");
        // Where the kernel says SMT is off (both of this project's machines), every logical
        // CPU is a core.
        if std::fs::read_to_string("/sys/devices/system/cpu/smt/active").is_ok_and(|s| s.trim() == "0") {
            assert_eq!(t, logical);
        }
    }
}
