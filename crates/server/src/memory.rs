//! Following memory pressure while serving: the caches sized at load are shrunk when the memory
//! left falls (a cgroup limit lowered under the running server, other programs growing) and
//! grown back, up to their size at load, when it returns.
//!
//! The caches are each model's expert cache and its pool of cached sessions (their KV). Both
//! fill as requests come, so a server whose memory was fine a minute ago can still grow into a
//! limit lowered since. [`Fleet::fit_to_memory`](crate::Fleet::fit_to_memory) re-reads the
//! memory available with the function used at start ([`smoe_store::available_memory`]:
//! MemAvailable, or the headroom under a cgroup-v1 or v2 limit) and keeps
//!
//! > what the caches may still grow by + headroom <= memory available
//!
//! where the headroom ([`DEFAULT_HEADROOM`], `--memory-headroom`) is for what is not a cache:
//! the running requests' activations and KV, buffers. When that fails it first takes away room
//! the caches have not filled yet (nothing is lost), and only when that is not enough evicts
//! experts and drops cached sessions, in proportion to what each holds; a running request's
//! session is never dropped, and an evicted expert is read again when next needed, so answers
//! do not change. It grows them back only from the least memory available over the last
//! [`grow_window`]: a request's activations come and go, and growing into the room they left
//! would only evict again at the next request.
//!
//! It runs at three places, each for a reason. Before each request (after its model is loaded):
//! a limit lowered since the last check is met before the request grows anything. Before each
//! batched step of a running generation (at most every [`STEP_INTERVAL`]): a long prompt's
//! chunks and a long reply's KV grow within one request, so the headroom need only cover what
//! one step adds. And on a thread ([`spawn_watch`]) every few seconds, woken at once by the
//! cgroup's pressure events where the kernel offers them: an idle server would otherwise keep
//! memory that a lowered limit wants back, and grow nothing back when it is raised. A check
//! costs a few small file reads (about a tenth of a millisecond).
//!
//! What it cannot do: a cgroup-v1 limit written below what the server cannot give back (its
//! dense weights, the least expert cache, buffers) is refused by the kernel (EBUSY) without the
//! server hearing of it, and the server is not unloaded to make room; a cgroup-v2 `memory.max`
//! lowered that far kills it (lower `memory.high`, which the watch follows too, first).

use crate::fleet::Fleet;
use std::sync::Arc;
use std::time::Duration;

/// Memory kept free beyond what the caches may grow by: for the running requests' activations
/// and KV, and buffers.
pub const DEFAULT_HEADROOM: u64 = 128 << 20;

/// The least time between two checks before batched steps.
pub const STEP_INTERVAL: Duration = Duration::from_millis(50);

/// How often the watch thread re-reads the memory available when no pressure event wakes it.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(2);

/// How long memory must have stayed available before the caches grow into it: ten of the
/// watch's intervals, at most a minute (20 s by default).
pub fn grow_window(interval: Duration) -> Duration {
    (interval * 10).min(Duration::from_secs(60))
}

/// Changes smaller than this are not made (see [`plan`]).
const DEAD_BAND: u64 = 1 << 20;

/// One cache as the plan sees it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSize {
    /// Memory it takes now (at most `cap`).
    pub held: u64,
    /// What it may grow to now.
    pub cap: u64,
    /// What it may grow to at most (its size at load).
    pub max: u64,
    /// What it may shrink to at least.
    pub min: u64,
}

/// New capacities for `caches` such that what they may still grow by fits in `available` less
/// `headroom`, or `None` to leave them. A shrink first takes room not yet filled, in proportion
/// to each cache's room, then what they hold, in proportion to what each holds. A cache grows
/// back (towards its `max`, in proportion to what each lacks) by what `low` (the least
/// available lately) allows, and only once that is at least a sixteenth of the caches' full
/// size, or all of it, so that memory coming and going does not resize them back and forth.
pub fn plan(caches: &[CacheSize], available: u64, low: u64, headroom: u64) -> Option<Vec<u64>> {
    let caches: Vec<CacheSize> = caches.iter().map(|c| CacheSize { held: c.held.min(c.cap), ..*c }).collect();
    let sum = |f: fn(&CacheSize) -> u64| caches.iter().map(f).sum::<u64>();
    let (held, cap, max) = (sum(|c| c.held), sum(|c| c.cap), sum(|c| c.max));
    let allowed = (held + available).saturating_sub(headroom);
    let lasting = (held + low.min(available)).saturating_sub(headroom);
    let scaled = |x: u64, num: u64, den: u64| (x as u128 * num as u128 / den.max(1) as u128) as u64;
    let new: Vec<u64> = if allowed < cap {
        if held <= allowed {
            let room = cap - held;
            caches.iter().map(|c| c.held + scaled(c.cap - c.held, allowed - held, room)).collect()
        } else {
            caches.iter().map(|c| scaled(c.held, allowed, held)).collect()
        }
    } else if cap < max && lasting > cap && (lasting >= max || lasting - cap >= max / 16) {
        let lack = max - cap;
        caches.iter().map(|c| c.cap + scaled(c.max - c.cap, (lasting - cap).min(lack), lack)).collect()
    } else {
        return None;
    };
    // Less than a MiB either way is no change (a session budget creeping by kilobytes), unless
    // it reaches the floor or the size at load.
    let new: Vec<u64> = new
        .iter()
        .zip(&caches)
        .map(|(&n, c)| {
            let n = n.clamp(c.min.min(c.max), c.max);
            if n.abs_diff(c.cap) < DEAD_BAND && n != c.min && n != c.max {
                c.cap
            } else {
                n
            }
        })
        .collect();
    (new.iter().zip(&caches).any(|(&n, c)| n != c.cap)).then_some(new)
}

/// Starts the thread that fits the caches to the memory available every `interval`, and at
/// once on each pressure event of the process's cgroup (v1 `memory.pressure_level`) where the
/// kernel lets it register for them. Runs for the life of the process.
pub fn spawn_watch(fleet: Arc<Fleet>, interval: Duration) {
    let events = match smoe_store::PressureEvents::open() {
        Ok(e) => {
            tracing::info!("memory watch: every {:.1} s and on pressure events of {}", interval.as_secs_f64(), e.source);
            Some(e)
        }
        Err(why) => {
            tracing::info!("memory watch: every {:.1} s (no pressure events: {why})", interval.as_secs_f64());
            None
        }
    };
    let spawned = std::thread::Builder::new().name("memory-watch".into()).spawn(move || loop {
        match &events {
            Some(e) => {
                e.wait(interval);
            }
            None => std::thread::sleep(interval),
        }
        fleet.fit_to_memory();
        // Memory freed by finished requests goes back to the kernel, not only to the
        // allocator: what the caches shrink to should be what the process holds.
        smoe_store::release_free_heap();
    });
    if let Err(e) = spawned {
        tracing::warn!("no memory watch: cannot start its thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    fn c(held: u64, cap: u64, max: u64, min: u64) -> CacheSize {
        CacheSize { held: held * M, cap: cap * M, max: max * M, min: min * M }
    }

    #[test]
    fn room_goes_first_then_contents() {
        // Experts: 600 of 648 MiB filled; sessions: 1 of 320 MiB. 160 MiB available, 128 of
        // headroom: 32 MiB of growth allowed, taken from the room in proportion (48 : 319).
        let caches = [c(600, 648, 648, 20), c(1, 320, 320, 0)];
        let new = plan(&caches, 160 * M, 160 * M, 128 * M).unwrap();
        assert!(new[0] >= 600 * M && new[1] >= M, "nothing held is lost: {new:?}");
        let growth: u64 = new.iter().zip(&caches).map(|(n, c)| n - c.held).sum();
        assert!(growth <= 32 * M && growth > 31 * M, "{growth}");
        // 28 MiB available: 100 MiB must go, from what is held, in proportion.
        let new = plan(&caches, 28 * M, 28 * M, 128 * M).unwrap();
        assert!(new.iter().sum::<u64>() <= 501 * M, "{new:?}");
        assert!(new[0] < 600 * M && new[0] > 490 * M, "{new:?}");
        // Less available than the headroom plus all they hold: each goes to its floor.
        assert_eq!(plan(&caches, 0, 0, 1 << 40).unwrap(), vec![20 * M, 0]);
    }

    #[test]
    fn plenty_changes_nothing_and_growth_waits_for_enough_room() {
        let full = [c(10, 648, 648, 20), c(0, 320, 320, 0)];
        assert_eq!(plan(&full, 20 << 30, 20 << 30, 128 * M), None);
        // Shrunk to half; a little room back is not enough to grow, a sixteenth is.
        let half = [c(300, 324, 648, 20), c(0, 160, 320, 0)];
        let cap: u64 = 484 * M;
        let available = |grow: u64| cap - 300 * M + 128 * M + grow;
        assert_eq!(plan(&half, available(10 * M), available(10 * M), 128 * M), None);
        let new = plan(&half, available(70 * M), available(70 * M), 128 * M).unwrap();
        assert!(new[0] > 324 * M && new[1] > 160 * M && new.iter().sum::<u64>() <= cap + 70 * M, "{new:?}");
        // Room for everything: back to the full size exactly, once it has lasted.
        assert_eq!(plan(&half, 10 << 30, 10 << 30, 128 * M).unwrap(), vec![648 * M, 320 * M]);
        assert_eq!(plan(&half, 10 << 30, available(0), 128 * M), None, "not while it was short lately");
        let new = plan(&half, 10 << 30, available(70 * M), 128 * M).unwrap();
        assert!((553 * M..=554 * M).contains(&new.iter().sum::<u64>()), "as far as the least lately allows: {new:?}");
    }

    #[test]
    fn floors_hold_and_no_change_is_no_plan() {
        let at_floor = [c(20, 20, 648, 20), c(0, 0, 320, 0)];
        assert_eq!(plan(&at_floor, 0, 0, 128 * M), None, "already as small as it goes");
        // A cache that holds more than its cap (a pool not yet trimmed) counts as full.
        let over = [c(0, 100, 100, 0), c(50, 10, 320, 0)];
        assert_eq!(plan(&over, 10 * M, 10 * M, 0).unwrap(), vec![10 * M, 10 * M]);
        // Kilobytes either way are not worth a resize; the floor is.
        let kb = CacheSize { held: 0, cap: 600 << 10, max: 320 * M, min: 0 };
        assert_eq!(plan(&[kb], 128 * M + (300 << 10), 128 * M, 128 * M), None);
        assert_eq!(plan(&[kb], 127 * M, 127 * M, 128 * M).unwrap(), vec![0]);
    }
}
