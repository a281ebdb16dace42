//! A persistent, low-latency thread pool for per-token work.
//!
//! Decode calls hundreds of small matrix-vector products per token; rayon's per-call overhead
//! (tens of microseconds when its workers sleep) would be a large share of each one. Here the
//! workers spin for a while after each job, so back-to-back jobs start within microseconds, and
//! park on a condition variable when idle. A job is a borrowed closure over task indices; the
//! caller works too and returns once every task has run and no worker is still inside the job,
//! so nothing is allocated per call and the closure may borrow the caller's stack.
//!
//! A job does not wait for workers that have not joined it: with as many threads as cores, a
//! worker that the OS (or a hypervisor) has descheduled, or one waking from its park, would
//! otherwise hold up every job until it ran, though the others had already taken its tasks. On
//! the 16-core Sapphire Rapids host one such run decoded at 34 tok/s where other runs there
//! managed 95-112 (#23). A late worker joins whatever job is current, or none.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking, unless `SMOE_POOL_SPIN_US` says otherwise.
const SPIN: Duration = Duration::from_micros(200);

/// [`SPIN`], or `SMOE_POOL_SPIN_US` microseconds (read once): on a VM a parked worker's wake-up
/// goes through the hypervisor, so the right spin depends on the host.
fn spin() -> Duration {
    static AT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *AT.get_or_init(|| std::env::var("SMOE_POOL_SPIN_US").ok().and_then(|v| v.parse().ok()).map_or(SPIN, Duration::from_micros))
}

/// `SMOE_POOL_PROFILE=1`: process-wide counters of where the pool's time goes, for finding
/// serial stretches and idle threads at high thread counts (#23): how long callers spent
/// inside jobs, and how much of that every thread spent running tasks. Off by default, so
/// that the clock is not read per task.
pub mod profile {
    use std::cell::Cell;
    use std::panic::Location;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, OnceLock};
    use std::time::Instant;

    pub(super) static JOBS: AtomicU64 = AtomicU64::new(0);
    pub(super) static JOB_NS: AtomicU64 = AtomicU64::new(0);
    pub(super) static BUSY_NS: AtomicU64 = AtomicU64::new(0);
    pub(super) static THREAD_NS: AtomicU64 = AtomicU64::new(0);

    /// The job counters again, per call site: the backend operation (its caller's file and
    /// line, see [`site`]) that ran each job, and the serial time just before it.
    static SITES: Mutex<Vec<Site>> = Mutex::new(Vec::new());
    /// When the last job ended, nanoseconds after [`origin`].
    static LAST_END: AtomicU64 = AtomicU64::new(0);

    thread_local! {
        /// The outermost backend operation under way on this thread, if any.
        static CURRENT: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
    }

    /// Nanoseconds from the profile's origin (its first use) to `t`.
    pub(super) fn since_origin(t: Instant) -> u64 {
        static AT: OnceLock<Instant> = OnceLock::new();
        t.saturating_duration_since(*AT.get_or_init(Instant::now)).as_nanos() as u64
    }

    /// Whether the counters run (read once from the environment).
    pub fn enabled() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| std::env::var_os("SMOE_POOL_PROFILE").is_some_and(|v| v != "0"))
    }

    /// The counters since the process started.
    #[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
    pub struct Counters {
        /// Jobs run across threads.
        pub jobs: u64,
        /// Caller wall time inside those jobs, nanoseconds.
        pub job_ns: u64,
        /// Time the pool's threads spent running tasks, summed over threads, nanoseconds.
        pub busy_ns: u64,
        /// Job wall time times the threads of its pool: what `busy_ns` would be with no idle
        /// thread.
        pub thread_ns: u64,
    }

    impl Counters {
        /// Now.
        pub fn read() -> Counters {
            let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
            Counters { jobs: r(&JOBS), job_ns: r(&JOB_NS), busy_ns: r(&BUSY_NS), thread_ns: r(&THREAD_NS) }
        }

        /// What happened between `earlier` and `self`.
        pub fn since(&self, earlier: &Counters) -> Counters {
            Counters {
                jobs: self.jobs - earlier.jobs,
                job_ns: self.job_ns - earlier.job_ns,
                busy_ns: self.busy_ns - earlier.busy_ns,
                thread_ns: self.thread_ns - earlier.thread_ns,
            }
        }

        /// One line: of `wall_ms`, the share outside jobs (serial), and inside jobs the share
        /// of thread time spent on tasks.
        pub fn describe(&self, wall_ms: f64) -> String {
            let job_ms = self.job_ns as f64 / 1e6;
            format!(
                "pool: {} jobs, {:.1} of {:.1} ms in jobs ({:.0}% serial outside them), threads busy {:.0}% of job time",
                self.jobs,
                job_ms,
                wall_ms,
                100.0 * (1.0 - job_ms / wall_ms.max(1e-9)).max(0.0),
                100.0 * self.busy_ns as f64 / (self.thread_ns as f64).max(1.0)
            )
        }
    }

    /// One call site's jobs: where a parallel operation was asked for, how often, how long its
    /// jobs took and how busy the threads were in them, and how long the calling thread ran
    /// alone (the other threads idle) just before each of them.
    #[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
    pub struct Site {
        /// `file:line` of the operation's caller (the decoder's line, for backend operations).
        pub at: String,
        #[serde(skip)]
        loc: Option<&'static Location<'static>>,
        /// Jobs run (one-task jobs, run on the caller alone, included).
        pub jobs: u64,
        /// Caller time since the previous job ended, summed over this site's jobs: the serial
        /// stretch that precedes the operation, nanoseconds.
        pub gap_ns: u64,
        /// Caller wall time inside the jobs, nanoseconds.
        pub job_ns: u64,
        /// Thread time spent running tasks, nanoseconds.
        pub busy_ns: u64,
        /// The workers' delays from each job's start until they joined it (waking from a park,
        /// or descheduled), summed, nanoseconds: the rest of the idle time inside jobs is
        /// threads that had no task left (or never joined).
        pub join_ns: u64,
        /// Job wall time times the pool's threads, nanoseconds.
        pub thread_ns: u64,
    }

    impl Site {
        /// Thread time this site's jobs and the serial stretches before them left idle, with
        /// `threads` threads: what a perfect split with no serial work would save.
        pub fn idle_ns(&self, threads: u64) -> u64 {
            self.gap_ns * threads.saturating_sub(1) + self.thread_ns.saturating_sub(self.busy_ns)
        }
    }

    /// Marks the backend operation called at `at` (the method's `Location::caller()`, with
    /// `#[track_caller]` on it) as the site of the pool jobs it runs, until the guard drops.
    /// The outermost mark wins; nothing is done unless profiling is on.
    #[inline]
    pub fn site(at: &'static Location<'static>) -> SiteGuard {
        if !enabled() {
            return SiteGuard(false);
        }
        SiteGuard(CURRENT.with(|c| c.get().is_none() && c.replace(Some(at)).is_none()))
    }

    /// Ends a [`site`] mark.
    pub struct SiteGuard(bool);

    impl Drop for SiteGuard {
        fn drop(&mut self) {
            if self.0 {
                CURRENT.with(|c| c.set(None));
            }
        }
    }

    /// Records one job that ran from `start` to `end` with `busy_ns` of task time over
    /// `threads` threads; `direct` is the pool call's own location, used when no operation
    /// is marked.
    pub(super) fn record(direct: &'static Location<'static>, start: Instant, end: Instant, busy_ns: u64, join_ns: u64, threads: u64) {
        let (s, e) = (since_origin(start), since_origin(end));
        let last = LAST_END.swap(e, Ordering::Relaxed);
        let gap = if last == 0 { 0 } else { s.saturating_sub(last) };
        let job = e - s;
        let at = CURRENT.with(|c| c.get()).unwrap_or(direct);
        let mut sites = SITES.lock().unwrap_or_else(|e| e.into_inner());
        let i = match sites.iter().position(|x| x.loc.is_some_and(|l| l.line() == at.line() && l.file() == at.file())) {
            Some(i) => i,
            None => {
                sites.push(Site { at: format!("{}:{}", at.file(), at.line()), loc: Some(at), ..Site::default() });
                sites.len() - 1
            }
        };
        let x = &mut sites[i];
        x.jobs += 1;
        x.gap_ns += gap;
        x.job_ns += job;
        x.busy_ns += busy_ns;
        x.join_ns += join_ns;
        x.thread_ns += job * threads;
    }

    /// Every site's counters since the process started.
    pub fn sites() -> Vec<Site> {
        SITES.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What each site did between `earlier` and `now` (both from [`sites`]), sites that ran
    /// no job left out.
    pub fn sites_since(now: &[Site], earlier: &[Site]) -> Vec<Site> {
        now.iter()
            .filter_map(|x| {
                let before = earlier.iter().find(|e| e.at == x.at).cloned().unwrap_or_default();
                (x.jobs > before.jobs).then(|| Site {
                    at: x.at.clone(),
                    loc: x.loc,
                    jobs: x.jobs - before.jobs,
                    gap_ns: x.gap_ns - before.gap_ns,
                    job_ns: x.job_ns - before.job_ns,
                    busy_ns: x.busy_ns - before.busy_ns,
                    join_ns: x.join_ns - before.join_ns,
                    thread_ns: x.thread_ns - before.thread_ns,
                })
            })
            .collect()
    }
}

/// The job of the current epoch: a type-erased `&(dyn Fn(usize) + Sync)`.
type JobRef = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Incremented for each job; workers run the job of each new epoch once.
    epoch: CachePadded<AtomicUsize>,
    /// Next task index to take.
    next: CachePadded<AtomicUsize>,
    /// Tasks of the current job that have run to the end.
    finished: CachePadded<AtomicUsize>,
    /// Workers between joining a job (before reading `job`) and leaving it: the caller returns
    /// only when this is zero after clearing `job`, so no worker still holds the closure.
    active: CachePadded<AtomicUsize>,
    tasks: AtomicUsize,
    /// Task time of the current job summed over threads, nanoseconds (profiling only).
    job_busy_ns: AtomicU64,
    /// When the current job started, nanoseconds after the profile's origin, and the workers'
    /// delays from then until they joined it, summed (profiling only).
    job_start_ns: AtomicU64,
    job_join_ns: AtomicU64,
    /// The current job: a pointer to the caller's [`JobRef`], published (after `tasks`, `next`
    /// and `finished` are set) before the epoch moves, and null between jobs. An atomic, not a
    /// mutex: sixteen workers taking a lock at every job's start queued behind each other for
    /// tens of microseconds, hundreds of times a token.
    job: AtomicPtr<JobRef>,
    sleepers: AtomicUsize,
    wake: Condvar,
    lock: Mutex<()>,
    shutdown: AtomicBool,
}

/// The pool. One per process is typical; the caller of [`Pool::run`] is one of its threads.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    /// Serialises callers: one job at a time.
    run_lock: Mutex<()>,
}

impl Pool {
    /// A pool of `threads` threads in total (the caller plus `threads - 1` workers).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: CachePadded::new(AtomicUsize::new(0)),
            next: CachePadded::new(AtomicUsize::new(0)),
            finished: CachePadded::new(AtomicUsize::new(0)),
            active: CachePadded::new(AtomicUsize::new(0)),
            tasks: AtomicUsize::new(0),
            job_busy_ns: AtomicU64::new(0),
            job_start_ns: AtomicU64::new(0),
            job_join_ns: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            sleepers: AtomicUsize::new(0),
            wake: Condvar::new(),
            lock: Mutex::new(()),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("smoe-compute-{i}")).spawn(move || worker(&s)).expect("spawn compute thread")
            })
            .collect();
        Pool { shared, workers, run_lock: Mutex::new(()) }
    }

    /// Threads in the pool, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every `i < tasks`, spread over the pool; returns when all are done.
    #[track_caller]
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let direct = std::panic::Location::caller();
        if self.workers.is_empty() || tasks == 1 {
            let started = profile::enabled().then(Instant::now);
            (0..tasks).for_each(f);
            if let Some(t) = started {
                let end = Instant::now();
                profile::record(direct, t, end, (end - t).as_nanos() as u64, 0, self.threads() as u64);
            }
            return;
        }
        // A panic in an earlier job poisons the lock but leaves nothing half-done (see
        // `ReleaseJob`).
        let _one_job = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: the erased lifetime is restored by clearing `job` and then waiting below for
        // every worker that may have read it to leave, so the closure outlives every call
        // through the pointer.
        let mut erased: JobRef = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), JobRef>(f) };
        s.tasks.store(tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        s.job_busy_ns.store(0, Ordering::Relaxed);
        s.job_join_ns.store(0, Ordering::Relaxed);
        // Released after the counters: a worker that reads this pointer sees this job's
        // counters, even one that slept through the epoch's increment. `erased` outlives every
        // reader, as `f` does.
        // Before the job is published: a worker may join it as soon as it is.
        let started = profile::enabled().then(Instant::now);
        if let Some(t) = started {
            s.job_start_ns.store(profile::since_origin(t), Ordering::Relaxed);
        }
        s.job.store(&mut erased, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            // Under the lock: a worker is either already waiting (and counted in `sleepers`), or
            // will re-check the epoch under this lock before waiting, so no wake-up is lost.
            let _g = s.lock.lock().unwrap();
            if s.sleepers.load(Ordering::SeqCst) > 0 {
                s.wake.notify_all();
            }
        }
        // Dropped at the end of the job, or while a panic in one of this thread's tasks unwinds
        // (then without waiting for the other tasks): either way `f` is out of reach first.
        let release = ReleaseJob(s);
        take_tasks(s, f);
        // Every task has run (a worker descheduled inside one is waited for: its results are
        // part of the job).
        spin_until(|| s.finished.load(Ordering::Acquire) >= tasks);
        drop(release);
        let workers = self.workers.len();
        if let Some(t) = started {
            let end = Instant::now();
            let ns = (end - t).as_nanos() as u64;
            // Every thread that ran tasks has added its time: none is inside the job now.
            let (busy, join) = (s.job_busy_ns.load(Ordering::Relaxed), s.job_join_ns.load(Ordering::Relaxed));
            profile::record(direct, t, end, busy, join, workers as u64 + 1);
            profile::JOBS.fetch_add(1, Ordering::Relaxed);
            profile::JOB_NS.fetch_add(ns, Ordering::Relaxed);
            profile::THREAD_NS.fetch_add(ns * (workers as u64 + 1), Ordering::Relaxed);
        }
    }
}

/// Ends a job's reach: clears its pointer and waits until no worker is inside it, so none
/// calls the closure after [`Pool::run`] returns or unwinds. A worker that joins after the
/// store reads null (or the next job's pointer); one that joined before is counted in `active`
/// (both SeqCst: the store comes before the load in their single order).
struct ReleaseJob<'a>(&'a Shared);

impl Drop for ReleaseJob<'_> {
    fn drop(&mut self) {
        self.0.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        spin_until(|| self.0.active.load(Ordering::SeqCst) == 0);
    }
}

/// Spins (yielding now and then) until `done()`.
fn spin_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        // With more runnable threads than cores, let a descheduled worker run.
        if spins.is_multiple_of(256) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Takes and runs the current job's tasks until none are left, then counts them as finished
/// (once, not per task: one shared write per thread and job).
fn take_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.tasks.load(Ordering::Relaxed);
    let started = profile::enabled().then(Instant::now);
    let mut ran = 0;
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
        ran += 1;
    }
    if ran > 0 {
        // Release: the caller's Acquire load of the count sees the tasks' writes.
        s.finished.fetch_add(ran, Ordering::Release);
    }
    if let Some(t) = started {
        let ns = t.elapsed().as_nanos() as u64;
        profile::BUSY_NS.fetch_add(ns, Ordering::Relaxed);
        s.job_busy_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

fn worker(s: &Shared) {
    // Epochs start at 0 and only `run` advances them: a worker that starts late must still run
    // the first job, so it does not read the current epoch here.
    let mut seen = 0;
    let spin = spin();
    loop {
        // Spin for a while, then park until the epoch moves.
        let t0 = Instant::now();
        while s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Relaxed) {
            if t0.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap();
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::Relaxed) {
                g = s.wake.wait(g).unwrap();
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        if s.shutdown.load(Ordering::Relaxed) {
            return;
        }
        seen = s.epoch.load(Ordering::Acquire);
        // Join: counted before reading the pointer, so the caller that cleared it cannot
        // return while this worker may still use what it read.
        s.active.fetch_add(1, Ordering::SeqCst);
        let job = s.job.load(Ordering::SeqCst);
        if !job.is_null() && profile::enabled() {
            let late = profile::since_origin(Instant::now()).saturating_sub(s.job_start_ns.load(Ordering::Relaxed));
            s.job_join_ns.fetch_add(late, Ordering::Relaxed);
        }
        if !job.is_null() {
            // SAFETY: a non-null pointer is the current job's (a late worker may find a later
            // job than the epoch it woke for: it runs that one's tasks); its caller clears it
            // only after every task has run and then waits for `active` to fall to zero, so the
            // closure outlives this use; the closure is `Sync`.
            let job = unsafe { &**job };
            // A task that panics on a worker would leave its job unfinished (and its caller
            // spinning) and this worker counted inside it: a bug in a kernel, so stop the process
            // with the panic's report rather than hang.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| take_tasks(s, job))).is_err() {
                std::process::abort();
            }
        }
        s.active.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.lock.lock().unwrap();
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = Pool::new(3);
        for round in 0..2000usize {
            let n = 1 + round % 37;
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
            if round % 500 == 0 {
                // Let the workers park, then wake them with the next job.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// More threads than cores, so workers are often descheduled and join jobs late (or a later
    /// job than the one they woke for), parked workers wake into jobs already under way, and
    /// jobs end without them: each task still runs exactly once, and only while its own job's
    /// `run` is in progress. (A stress test: the window in which a worker holds a job's pointer
    /// is a few instructions wide, and a stale pointer there would name the next job's closure
    /// in the same stack slot, so it cannot be caught deterministically.)
    #[test]
    fn late_workers_run_only_the_current_job() {
        // Three threads per CPU, whatever the machine.
        let pool = Pool::new(3 * std::thread::available_parallelism().map_or(2, |n| n.get()).max(2));
        let (rounds, most) = (1000usize, 97usize);
        let hits: Vec<AtomicU64> = (0..rounds * most).map(|_| AtomicU64::new(0)).collect();
        let current = AtomicUsize::new(usize::MAX);
        let stale = AtomicBool::new(false);
        for round in 0..rounds {
            let n = 1 + round % most;
            current.store(round, Ordering::SeqCst);
            // The closure borrows a value on this iteration's stack, gone once `run` returns.
            let mine = round;
            pool.run(n, &|i| {
                if current.load(Ordering::SeqCst) != mine {
                    stale.store(true, Ordering::SeqCst);
                }
                hits[mine * most + i].fetch_add(1, Ordering::Relaxed);
                // Tasks long enough that a job still has some left when a late worker wakes.
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(20) {
                    std::hint::spin_loop();
                }
            });
            current.store(usize::MAX, Ordering::SeqCst);
            if round % 300 == 0 {
                // Let the workers park: the next jobs start before some of them are awake.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        assert!(!stale.load(Ordering::SeqCst), "a task ran outside its job's run");
        for round in 0..rounds {
            for i in 0..most {
                let want = u64::from(i < 1 + round % most);
                assert_eq!(hits[round * most + i].load(Ordering::Relaxed), want, "round {round} task {i}");
            }
        }
    }

    /// A task that panics on the calling thread unwinds out of `run` with the job cleared: the
    /// pool keeps working for the next job, whose closure is a different one.
    #[test]
    fn a_panicking_task_on_the_caller_leaves_the_pool_usable() {
        let pool = Pool::new(4);
        let caller = std::thread::current().id();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(64, &|_| {
                if std::thread::current().id() == caller {
                    panic!("a task on the caller");
                }
                std::thread::sleep(Duration::from_micros(200));
            })
        }));
        assert!(r.is_err());
        let hits: Vec<AtomicU64> = (0..50).map(|_| AtomicU64::new(0)).collect();
        pool.run(50, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    /// The per-site counters: jobs, their time and the serial time before each, apart by site.
    #[test]
    fn sites_count_jobs_and_the_serial_time_before_them() {
        let (a, b) = (std::panic::Location::caller(), std::panic::Location::caller());
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        let before = profile::sites();
        profile::record(a, ms(10), ms(14), 6_000_000, 1_000_000, 2);
        profile::record(b, ms(15), ms(16), 2_000_000, 0, 2);
        profile::record(a, ms(20), ms(22), 4_000_000, 0, 2);
        let sites = profile::sites_since(&profile::sites(), &before);
        let (sa, sb) = (
            sites.iter().find(|s| s.at.ends_with(&format!(":{}", a.line()))).unwrap(),
            sites.iter().find(|s| s.at.ends_with(&format!(":{}", b.line()))),
        );
        // `a` and `b` are on one line (columns apart): one site, as a site is a line.
        assert!(sb.is_some_and(|sb| sb == sa) && sites.len() == 1);
        assert_eq!((sa.jobs, sa.job_ns, sa.busy_ns, sa.join_ns, sa.thread_ns), (3, 7_000_000, 12_000_000, 1_000_000, 14_000_000));
        // 1 ms before the second job and 4 ms before the third (the first has no job before it
        // in this test only if none ran earlier in the process: not counted here).
        assert!(sa.gap_ns >= 5_000_000, "{sa:?}");
        assert_eq!(sa.idle_ns(2), sa.gap_ns + 2_000_000);
    }

    #[test]
    fn borrowed_data_and_disjoint_writes() {
        let pool = Pool::new(2);
        let input: Vec<u64> = (0..1000).collect();
        let out: Vec<AtomicU64> = (0..10).map(|_| AtomicU64::new(0)).collect();
        pool.run(10, &|i| {
            out[i].store(input[i * 100..(i + 1) * 100].iter().sum(), Ordering::Relaxed);
        });
        let total: u64 = out.iter().map(|o| o.load(Ordering::Relaxed)).sum();
        assert_eq!(total, 999 * 1000 / 2);
    }
}
