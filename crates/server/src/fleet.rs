//! The models of a directory: every vault (and every GGUF, run in place) is a model named by
//! its file stem, loaded on first use and unloaded (least recently used first) when the memory
//! budget needs its room.

use crate::error::ApiError;
use crate::memory;
use crate::metrics::Metrics;
use crate::worker::{StepHook, Worker, WorkerLimits};
use smoe_engine::{open_cpu, CacheSize, EngineError, OpenOptions, OpenReport, Precision};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Opens a model on the backend the front end chose and starts its generation thread. The
/// server names no backend: [`CpuOpener`] is the default, and the command line supplies one for
/// a GPU.
pub trait Opener: Send + Sync {
    /// The backend in words, for the log.
    fn describe(&self) -> String;
    /// Opens `path` with `opts` and spawns its worker.
    fn open(
        &self,
        name: &str,
        path: &Path,
        opts: &OpenOptions,
        limits: WorkerLimits,
        metrics: Arc<Metrics>,
    ) -> Result<(Worker, OpenReport), EngineError>;
}

/// Opens models on the CPU backend.
pub struct CpuOpener;

impl Opener for CpuOpener {
    fn describe(&self) -> String {
        "cpu".into()
    }
    fn open(
        &self,
        name: &str,
        path: &Path,
        opts: &OpenOptions,
        limits: WorkerLimits,
        metrics: Arc<Metrics>,
    ) -> Result<(Worker, OpenReport), EngineError> {
        let (engine, report) = open_cpu(path, opts)?;
        Ok((Worker::spawn(name.to_string(), engine, limits, metrics), report))
    }
}

/// How the fleet loads models.
#[derive(Clone)]
pub struct FleetConfig {
    /// Directory of vaults.
    pub dir: PathBuf,
    /// Expert cache per model (`Auto` shares the memory budget, see [`Fleet`]).
    pub cache: CacheSize,
    /// Context limit (default: each model's, capped by memory).
    pub ctx: Option<usize>,
    /// Requests waiting or running per model.
    pub max_queue: usize,
    /// Cached sessions per model.
    pub max_sessions: usize,
    /// Generations a model advances together (see [`default_max_batch`]).
    pub max_batch: usize,
    /// Tokens of one batched step; `None`: the model's prefill chunk (`Model::prefill_chunk`).
    pub step_tokens: Option<usize>,
    /// How long a step may take with prompt tokens beside streaming generations; `None`: no
    /// limit ([`crate::pace`]).
    pub max_stall: Option<std::time::Duration>,
    /// Tokens generated for a chat request that does not say (`--max-tokens`); `None`: until
    /// the context or a stop.
    pub default_max_tokens: Option<usize>,
    /// Open options (precision, policy, I/O).
    pub open: OpenOptions,
    /// Memory the models may use together (default: available at start, less a reserve).
    pub memory: Option<u64>,
    /// How often the memory watch re-reads the memory available and fits the caches to it
    /// (see [`crate::memory`]); `None`: never, the caches keep their size at load.
    pub memory_watch: Option<Duration>,
    /// Memory the watch keeps free beyond what the caches may grow by.
    pub memory_headroom: u64,
    /// The backend models open on.
    pub opener: Arc<dyn Opener>,
}

impl std::fmt::Debug for FleetConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetConfig")
            .field("dir", &self.dir)
            .field("cache", &self.cache)
            .field("ctx", &self.ctx)
            .field("max_queue", &self.max_queue)
            .field("max_sessions", &self.max_sessions)
            .field("max_batch", &self.max_batch)
            .field("step_tokens", &self.step_tokens)
            .field("max_stall", &self.max_stall)
            .field("open", &self.open)
            .field("memory", &self.memory)
            .field("memory_watch", &self.memory_watch)
            .field("memory_headroom", &self.memory_headroom)
            .field("opener", &self.opener.describe())
            .finish()
    }
}

/// A loaded model.
struct Loaded {
    worker: Arc<Worker>,
    /// Dense weights (and, for a model with every expert resident, those): what the memory
    /// watch cannot shrink.
    fixed: u64,
    cache_bytes: u64,
    used: Instant,
}

impl Loaded {
    /// Dense + expert cache + session KV budget, now (the memory watch may have shrunk them).
    fn bytes_now(&self) -> u64 {
        self.fixed + self.worker.cache_capacity().map_or(0, |c| c.bytes()) + self.worker.session_budget() as u64
    }
}

/// What `/v1/models` reports of a model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelInfo {
    /// Name (the vault's file stem).
    pub id: String,
    /// The vault's modification time (Unix seconds).
    pub created: u64,
    /// The vault's (or GGUF's) size in bytes.
    pub size_bytes: u64,
    /// Loaded now.
    pub loaded: bool,
    /// Its expert cache when loaded: what it may hold now.
    pub cache_bytes: u64,
    /// Its expert cache at load, the most the memory watch grows it back to.
    pub cache_max_bytes: u64,
    /// Memory its expert cache takes now (slots filled).
    pub cache_resident_bytes: u64,
    /// KV its cached sessions may hold together now.
    pub session_budget_bytes: u64,
    /// KV its cached sessions hold.
    pub session_kv_bytes: u64,
    /// Requests waiting or running.
    pub queue_depth: usize,
}

/// The models of a directory and the memory they share.
///
/// Memory budget: `--memory`, or what was available at start (MemAvailable or the cgroup
/// limit) minus a reserve of 1 GiB + 5%. A model needs its dense weights, a KV budget for its cached sessions
/// (an eighth of the budget at most) and an expert cache. With `--cache auto` a model's cache is
/// what the budget has left after the models already loaded, up to all its experts; when that
/// would be less than half of what it would get alone, least recently used models are unloaded
/// first. With an explicit size, models are unloaded until that size fits.
pub struct Fleet {
    cfg: FleetConfig,
    budget: u64,
    /// The budget as the memory watch last found it ([`Fleet::fit_to_memory`]): what models
    /// loaded from now on are sized by, if less than `budget`.
    ceiling: AtomicU64,
    loaded: Mutex<BTreeMap<String, Loaded>>,
    metrics: Arc<Metrics>,
    /// The least memory available in each second of the last [`memory::grow_window`], oldest
    /// first; held while a check runs (one at a time).
    lows: Mutex<std::collections::VecDeque<(Instant, u64)>>,
    /// This fleet, for the workers' step hook.
    me: Weak<Fleet>,
    /// When a step hook last checked, in milliseconds since `started`.
    stepped: AtomicU64,
    started: Instant,
}

impl Fleet {
    /// Tokens generated for a request that does not set `max_tokens`.
    pub fn default_max_tokens(&self) -> Option<usize> {
        self.cfg.default_max_tokens
    }

    /// A fleet over `cfg.dir`; nothing is loaded yet.
    pub fn new(cfg: FleetConfig, metrics: Arc<Metrics>) -> Result<Arc<Fleet>, String> {
        if !cfg.dir.is_dir() {
            return Err(format!("{} is not a directory", cfg.dir.display()));
        }
        let m = smoe_store::available_memory();
        let budget = match cfg.memory {
            Some(b) => b,
            None => m.available.saturating_sub((1u64 << 30) + m.available / 20),
        };
        tracing::info!("memory budget for models: {} MiB ({} MiB available, {})", budget >> 20, m.available >> 20, m.source);
        metrics.memory_available.store(m.available, Ordering::Relaxed);
        Ok(Arc::new_cyclic(|me| Fleet {
            cfg,
            budget,
            ceiling: AtomicU64::new(budget),
            loaded: Mutex::new(BTreeMap::new()),
            metrics,
            lows: Mutex::default(),
            me: me.clone(),
            stepped: AtomicU64::new(0),
            started: Instant::now(),
        }))
    }

    /// The memory budget in bytes (at start).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// How often the memory watch runs, if it does.
    pub fn memory_watch(&self) -> Option<Duration> {
        self.cfg.memory_watch
    }

    /// [`Fleet::fit_to_memory`] before a batched step, at most every [`memory::STEP_INTERVAL`]:
    /// a long request's KV and a prompt's chunks grow between two requests' checks, and steps
    /// of small models are far shorter than the check is worth.
    fn fit_before_step(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.stepped.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= memory::STEP_INTERVAL.as_millis() as u64
            && self.stepped.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            self.fit_to_memory();
        }
    }

    /// Fits the loaded models' caches to the memory available now (see [`crate::memory`]):
    /// re-reads it ([`smoe_store::available_memory`]), shrinks the expert caches and session
    /// budgets when what they may still grow by does not fit in it less the headroom, and grows
    /// them back towards their size at load when it does again. Logs one line when it changes
    /// anything and returns it. Does nothing when the watch is off, while another check runs
    /// (it reads the same memory), or while a model is being loaded (that request checks once
    /// it is). Costs a few small file reads: cheap enough for every request.
    pub fn fit_to_memory(&self) -> Option<String> {
        let interval = self.cfg.memory_watch?;
        let Ok(mut lows) = self.lows.try_lock() else { return None };
        let m = smoe_store::available_memory();
        self.metrics.memory_available.store(m.available, Ordering::Relaxed);
        let now = Instant::now();
        match lows.back_mut() {
            Some((t, low)) if now.duration_since(*t) < Duration::from_secs(1) => *low = (*low).min(m.available),
            _ => lows.push_back((now, m.available)),
        }
        while lows.front().is_some_and(|(t, _)| now.duration_since(*t) > memory::grow_window(interval)) {
            lows.pop_front();
        }
        let low = lows.iter().map(|&(_, a)| a).min().unwrap_or(m.available);
        let models: Vec<(String, Arc<Worker>, u64)> = match self.loaded.try_lock() {
            Ok(l) => l.iter().map(|(n, l)| (n.clone(), l.worker.clone(), l.fixed)).collect(),
            Err(_) => return None,
        };
        // Two caches a model: its experts (fixed where they cannot be resized or their memory
        // is locked) and its sessions.
        let mut caches = Vec::new();
        for (_, w, _) in &models {
            caches.push(match w.cache_capacity() {
                Some(c) => {
                    let min = if c.locked { c.bytes() } else { c.min_slots as u64 * c.slot_bytes };
                    memory::CacheSize { held: c.resident_bytes(), cap: c.bytes(), max: c.max_bytes(), min }
                }
                None => memory::CacheSize { held: 0, cap: 0, max: 0, min: 0 },
            });
            let (held, cap, max) = (w.session_kv_bytes() as u64, w.session_budget() as u64, w.max_session_budget() as u64);
            caches.push(memory::CacheSize { held, cap, max, min: 0 });
        }
        let held: u64 = caches.iter().map(|c| c.held.min(c.cap)).sum();
        let fixed: u64 = models.iter().map(|(_, _, f)| f).sum();
        let allowed = (held + m.available).saturating_sub(self.cfg.memory_headroom);
        self.ceiling.store(self.budget.min(fixed + allowed), Ordering::Relaxed);
        let new = memory::plan(&caches, m.available, low, self.cfg.memory_headroom)?;
        // Whole MiB, with a decimal below 10 (session budgets are often that small).
        let mib = |b: u64| if b < 10 << 20 { format!("{:.1}", b as f64 / (1 << 20) as f64) } else { (b >> 20).to_string() };
        let (mut parts, mut shrunk) = (Vec::new(), false);
        for (((name, w, _), c), n) in models.iter().zip(caches.chunks(2)).zip(new.chunks(2)) {
            let mut said = Vec::new();
            if n[0] != c[0].cap {
                if let Some(old) = w.cache_capacity() {
                    let now = w.resize_cache((n[0] / old.slot_bytes.max(1)) as usize).unwrap_or(old);
                    if now.slots != old.slots {
                        shrunk |= now.slots < old.slots;
                        said.push(format!(
                            "expert cache {} -> {} MiB ({} -> {} experts, {} MiB held)",
                            mib(old.bytes()),
                            mib(now.bytes()),
                            old.slots,
                            now.slots,
                            mib(now.resident_bytes())
                        ));
                    }
                }
            }
            if n[1] != c[1].cap {
                shrunk |= n[1] < c[1].cap;
                w.set_session_budget(n[1] as usize);
                said.push(format!("session KV budget {} -> {} MiB ({} MiB held)", mib(c[1].cap), mib(n[1]), mib(c[1].held)));
            }
            if !said.is_empty() {
                parts.push(format!("'{name}' {}", said.join(", ")));
            }
        }
        if parts.is_empty() {
            return None;
        }
        self.metrics.cache_resizes.fetch_add(1, Ordering::Relaxed);
        let line = format!(
            "memory: {} MiB available ({}), {} MiB kept free: {}",
            mib(m.available),
            m.source,
            mib(self.cfg.memory_headroom),
            parts.join("; ")
        );
        if shrunk {
            tracing::warn!("{line}");
        } else {
            tracing::info!("{line}");
        }
        Some(line)
    }

    /// Model names and vault paths, read from the directory now (new files appear without a
    /// restart).
    pub fn models(&self) -> BTreeMap<String, PathBuf> {
        scan(&self.cfg.dir)
    }

    /// Every model with its state.
    pub fn list(&self) -> Vec<ModelInfo> {
        // The directory is read before the lock is taken, and the lock is held only to copy the
        // workers out: the memory check before a generation's batched steps only tries this
        // lock, and a client polling the stats kept it from its turn while files were read.
        let files: Vec<(String, u64, u64)> = self
            .models()
            .into_iter()
            .map(|(id, path)| {
                let meta = std::fs::metadata(&path).ok();
                let size_bytes = meta.as_ref().map_or(0, |m| m.len());
                let created = meta
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                (id, size_bytes, created)
            })
            .collect();
        let loaded: BTreeMap<String, (Arc<Worker>, u64)> =
            self.loaded.lock().unwrap().iter().map(|(n, l)| (n.clone(), (l.worker.clone(), l.cache_bytes))).collect();
        files
            .into_iter()
            .map(|(id, size_bytes, created)| {
                let l = loaded.get(&id);
                let cap = l.and_then(|(w, _)| w.cache_capacity());
                let at_load = l.map_or(0, |&(_, bytes)| bytes);
                ModelInfo {
                    created,
                    size_bytes,
                    loaded: l.is_some(),
                    cache_bytes: cap.map_or(at_load, |c| c.bytes()),
                    cache_max_bytes: cap.map_or(at_load, |c| c.max_bytes()),
                    cache_resident_bytes: cap.map_or(at_load, |c| c.resident_bytes()),
                    session_budget_bytes: l.map_or(0, |(w, _)| w.session_budget() as u64),
                    session_kv_bytes: l.map_or(0, |(w, _)| w.session_kv_bytes() as u64),
                    queue_depth: l.map_or(0, |(w, _)| w.queue_depth()),
                    id,
                }
            })
            .collect()
    }

    /// The worker of `name`, loading the model if needed (blocking: call off the async runtime).
    pub fn get(&self, name: &str) -> Result<Arc<Worker>, ApiError> {
        let mut loaded = self.loaded.lock().unwrap();
        if let Some(l) = loaded.get_mut(name) {
            l.used = Instant::now();
            return Ok(l.worker.clone());
        }
        let models = self.models();
        let Some(path) = models.get(name) else {
            return Err(ApiError::unknown_model(name, &models.keys().cloned().collect::<Vec<_>>()));
        };
        let (worker, bytes, cache_bytes) = self.load(name, path, &mut loaded)?;
        let fixed = bytes - cache_bytes - worker.max_session_budget() as u64;
        let fixed = if worker.cache_capacity().is_none() { fixed + cache_bytes } else { fixed };
        loaded.insert(name.to_string(), Loaded { worker: worker.clone(), fixed, cache_bytes, used: Instant::now() });
        Ok(worker)
    }

    fn load(&self, name: &str, path: &Path, loaded: &mut BTreeMap<String, Loaded>) -> Result<(Arc<Worker>, u64, u64), ApiError> {
        let unavailable = |e: String| ApiError::unavailable(format!("cannot load '{name}': {e}"));
        let sizes = smoe_engine::model_sizes(path).map_err(|e| unavailable(e.to_string()))?;
        let (arch, dense, blob) = (sizes.arch, sizes.dense_bytes, sizes.slot_bytes);
        let experts_total = blob * sizes.total_experts as u64;
        let ctx = self.cfg.ctx.unwrap_or_else(|| smoe_engine::default_context(&arch, self.cfg.open.kv_type));
        // The budget as the memory watch last found it, if it has fallen since the start.
        let budget = self.budget.min(self.ceiling.load(Ordering::Relaxed));
        let (per_token, fixed) = smoe_engine::kv_bytes(&arch, self.cfg.open.kv_type);
        let kv = ((per_token * ctx + fixed) as u64).min(budget / 8);
        let base = dense + kv;
        let used = |l: &BTreeMap<String, Loaded>| l.values().map(|m| m.bytes_now()).sum::<u64>();
        // The cache this model should get, and the least it accepts before others are unloaded.
        let (want, accept) = match self.cfg.cache {
            CacheSize::Auto => {
                let alone = experts_total.min(budget.saturating_sub(base));
                (alone, alone / 2)
            }
            CacheSize::Bytes(b) => (b.min(experts_total), b.min(experts_total)),
            CacheSize::Experts(n) => ((n as u64 * blob).min(experts_total), (n as u64 * blob).min(experts_total)),
            CacheSize::Resident => (experts_total, experts_total),
        };
        let mut unloaded = Vec::new();
        while !loaded.is_empty() && budget.saturating_sub(used(loaded)) < base + accept {
            let victim = loaded.iter().min_by_key(|(_, l)| l.used).map(|(k, _)| k.clone()).expect("not empty");
            loaded.remove(&victim);
            unloaded.push(victim);
        }
        let cache = match self.cfg.cache {
            CacheSize::Auto => want.min(budget.saturating_sub(used(loaded) + base)),
            _ => want,
        };
        let mut opts = self.cfg.open.clone();
        opts.cache = if self.cfg.cache == CacheSize::Resident { CacheSize::Resident } else { CacheSize::Bytes(cache) };
        opts.ctx = Some(ctx);
        let limits = WorkerLimits {
            max_queue: self.cfg.max_queue,
            max_sessions: self.cfg.max_sessions,
            session_bytes: kv as usize,
            max_batch: self.cfg.max_batch,
            step_tokens: self.cfg.step_tokens,
            max_stall: self.cfg.max_stall,
            before_step: self.cfg.memory_watch.map(|_| {
                let fleet = self.me.clone();
                StepHook(Arc::new(move || {
                    if let Some(f) = fleet.upgrade() {
                        f.fit_before_step();
                    }
                }))
            }),
        };
        let (worker, report) =
            self.cfg.opener.open(name, path, &opts, limits, self.metrics.clone()).map_err(|e| unavailable(e.to_string()))?;
        tracing::info!(
            "loaded '{name}' on {}: {report}; dense {} MiB, session KV budget {} MiB{}",
            worker.backend,
            dense >> 20,
            kv >> 20,
            if unloaded.is_empty() { String::new() } else { format!("; unloaded {} to make room", unloaded.join(", ")) }
        );
        let worker = Arc::new(worker);
        Ok((worker, base + report.cache_bytes, report.cache_bytes))
    }
}

/// Models in `dir` by name: vaults (`NAME.smoe`) and GGUFs run in place (`NAME.gguf`, or the
/// first file of a split set, `NAME-00001-of-00003.gguf`, as `NAME`). A vault wins over a GGUF
/// of the same name.
fn scan(dir: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return out };
    let mut files: Vec<PathBuf> = rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
    // Vaults last, so they replace a GGUF of the same name.
    files.sort_by_key(|p| p.extension().is_some_and(|x| x == "smoe"));
    for p in files {
        let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else { continue };
        let name = match p.extension().and_then(|x| x.to_str()) {
            Some("smoe") => stem.to_string(),
            Some("gguf") => match split_part(stem) {
                Some((base, 1)) => base.to_string(),
                Some(_) => continue,
                None => stem.to_string(),
            },
            _ => continue,
        };
        out.insert(name, p);
    }
    out
}

/// `NAME-00002-of-00003` → `(NAME, 2)`.
fn split_part(stem: &str) -> Option<(&str, usize)> {
    let (rest, total) = stem.rsplit_once("-of-")?;
    let (base, part) = rest.rsplit_once('-')?;
    if part.len() == 5 && total.len() == 5 && total.chars().all(|c| c.is_ascii_digit()) {
        return Some((base, part.parse().ok()?));
    }
    None
}

/// Generations a model advances together by default: every request the queue admits, at most
/// 256 (on an H100 a step of 256 sequences of the 30B shape decoded 3,792–3,996 tok/s against
/// 64's 2,286–2,348; on a CPU the queue's default, 16, is the bound). A request admitted but left out of the batch waits for a whole generation to end: on the
/// 2-core machine, with four per core (8), 16 streaming clients of 128 tokens each waited 41 s
/// (p50) for their first token and got 25.8 tok/s together; with all 16 in the batch, 3.9 s
/// and 31.0 tok/s, at an inter-token p99 of 1.04 and 1.05 s (docs/benchmarks.md, issue #25).
/// A step's cost grows with its rows, but more slowly than its tokens: batching pays on any
/// core count, and `--max-batch` trades the streams' pace for it where wanted.
pub fn default_max_batch(max_queue: usize) -> usize {
    max_queue.clamp(1, 256)
}

impl FleetConfig {
    /// Defaults for `dir`: automatic cache, queue of 16, 8 sessions, fast kernels.
    pub fn new(dir: PathBuf) -> FleetConfig {
        FleetConfig {
            dir,
            cache: CacheSize::Auto,
            ctx: None,
            max_queue: 16,
            max_sessions: 8,
            max_batch: default_max_batch(16),
            step_tokens: None,
            max_stall: Some(crate::pace::DEFAULT_STALL),
            default_max_tokens: None,
            open: OpenOptions { precision: Precision::Fast, ..Default::default() },
            memory: None,
            memory_watch: Some(memory::DEFAULT_INTERVAL),
            memory_headroom: memory::DEFAULT_HEADROOM,
            opener: Arc::new(CpuOpener),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::default_max_batch;

    #[test]
    fn every_admitted_request_joins_the_batch_by_default() {
        assert_eq!(default_max_batch(16), 16);
        assert_eq!(default_max_batch(1), 1);
        assert_eq!(default_max_batch(0), 1);
        assert_eq!(default_max_batch(200), 200);
        assert_eq!(default_max_batch(1000), 256);
    }
}
