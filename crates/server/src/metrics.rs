//! Counters for `GET /metrics`, in Prometheus' text format.

use smoe_engine::GenStats;
use smoe_store::StoreStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Server-wide counters. Throughputs are kept as totals (tokens and seconds) so that rates
/// over any window can be computed by the scraper; the last request's rates are gauges.
#[derive(Default)]
pub struct Metrics {
    /// Requests by endpoint and status.
    requests: Mutex<std::collections::BTreeMap<(String, u16), u64>>,
    /// Prompt tokens of finished generations.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens actually computed (the rest came from cached sessions).
    pub prefilled_tokens: AtomicU64,
    /// Generated tokens.
    pub completion_tokens: AtomicU64,
    /// Microseconds in prefill.
    pub prefill_us: AtomicU64,
    /// Microseconds in decode.
    pub decode_us: AtomicU64,
    /// Expert uses served from the cache.
    pub expert_hits: AtomicU64,
    /// Expert uses that read the disk.
    pub expert_misses: AtomicU64,
    /// Bytes read from vaults.
    pub bytes_read: AtomicU64,
    /// Generations that failed in the engine.
    pub engine_errors: AtomicU64,
    /// Batched forward steps run.
    pub batch_steps: AtomicU64,
    /// Generations in those steps, summed (over `batch_steps`: the mean batch).
    pub batch_sequences: AtomicU64,
    /// The most generations one step has run.
    pub batch_max: AtomicU64,
    /// Memory available when last read (at start, then by the memory watch).
    pub memory_available: AtomicU64,
    /// Times the memory watch resized caches.
    pub cache_resizes: AtomicU64,
    last: Mutex<(f64, f64)>,
    /// The latest generations, for the page's live panel (`GET /v1/smoe/stats`).
    recent: Mutex<std::collections::VecDeque<Sample>>,
}

/// One finished generation as the live panel plots it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    /// Unix time in milliseconds when it finished.
    pub t_ms: u64,
    /// The model.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, the ones computed (the rest came from a cached session).
    pub prefilled_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Time to first token.
    pub ttft_ms: f64,
    /// Prefill throughput (0 when the whole prompt came from a cached session).
    pub prefill_tok_s: f64,
    /// Decode throughput (0 for fewer than two tokens).
    pub decode_tok_s: f64,
    /// Expert uses served from the cache, of all uses.
    pub hit_rate: f64,
    /// Bytes read from the vault per generated token.
    pub bytes_per_token: f64,
    /// Requests waiting or running for the model when it finished (itself included).
    pub queue: usize,
}

/// Samples kept: at most this many, and none older than [`RECENT_SECONDS`].
const RECENT_MAX: usize = 1000;
/// The panel's window.
const RECENT_SECONDS: u64 = 600;

impl Metrics {
    /// Counts a finished request.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        *self.requests.lock().unwrap().entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// Counts a batched step of `sequences` generations.
    pub fn record_step(&self, sequences: usize) {
        self.batch_steps.fetch_add(1, Ordering::Relaxed);
        self.batch_sequences.fetch_add(sequences as u64, Ordering::Relaxed);
        self.batch_max.fetch_max(sequences as u64, Ordering::Relaxed);
    }

    /// Adds a generation's counts and timings.
    pub fn record_generation(&self, s: &GenStats) {
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.prefilled_tokens.fetch_add(s.prefilled_tokens as u64, Ordering::Relaxed);
        self.completion_tokens.fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        self.prefill_us.fetch_add((s.prefill_seconds * 1e6) as u64, Ordering::Relaxed);
        self.decode_us.fetch_add((s.decode_seconds * 1e6) as u64, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap();
        if s.prefilled_tokens > 0 {
            last.0 = s.prefill_tok_s();
        }
        if s.generated_tokens > 1 {
            last.1 = s.decode_tok_s();
        }
    }

    /// Keeps a finished generation of `model` for the live panel.
    pub fn record_sample(&self, model: &str, s: &GenStats, store: &StoreStats, queue: usize) {
        let t_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let sample = Sample {
            t_ms,
            model: model.to_string(),
            prompt_tokens: s.prompt_tokens,
            prefilled_tokens: s.prefilled_tokens,
            generated_tokens: s.generated_tokens,
            ttft_ms: s.ttft_seconds * 1e3,
            prefill_tok_s: if s.prefilled_tokens > 0 { s.prefill_tok_s() } else { 0.0 },
            decode_tok_s: if s.generated_tokens > 1 { s.decode_tok_s() } else { 0.0 },
            hit_rate: store.hit_rate(),
            bytes_per_token: store.bytes_read as f64 / s.generated_tokens.max(1) as f64,
            queue,
        };
        let mut r = self.recent.lock().unwrap();
        r.push_back(sample);
        while r.len() > RECENT_MAX || r.front().is_some_and(|f| f.t_ms + RECENT_SECONDS * 1000 < t_ms) {
            r.pop_front();
        }
    }

    /// What the page's live panel shows: totals since start, the models, and the generations of
    /// the last ten minutes. Never any prompt or reply text.
    pub fn stats_json(&self, models: &[crate::fleet::ModelInfo]) -> serde_json::Value {
        let g = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let (hits, misses) = (g(&self.expert_hits), g(&self.expert_misses));
        let recent: Vec<Sample> = self.recent.lock().unwrap().iter().cloned().collect();
        serde_json::json!({
            "totals": {
                "prompt_tokens": g(&self.prompt_tokens),
                "prefilled_tokens": g(&self.prefilled_tokens),
                "completion_tokens": g(&self.completion_tokens),
                "prefill_seconds": g(&self.prefill_us) as f64 / 1e6,
                "decode_seconds": g(&self.decode_us) as f64 / 1e6,
                "expert_hit_rate": hits as f64 / (hits + misses).max(1) as f64,
                "bytes_read": g(&self.bytes_read),
                "engine_errors": g(&self.engine_errors),
                "cache_resizes": g(&self.cache_resizes),
            },
            "memory_available_bytes": g(&self.memory_available),
            "models": models.iter().map(|m| serde_json::json!({
                "id": m.id, "loaded": m.loaded, "size_bytes": m.size_bytes,
                "expert_cache_bytes": m.cache_bytes, "expert_cache_max_bytes": m.cache_max_bytes,
                "expert_cache_resident_bytes": m.cache_resident_bytes,
                "session_kv_budget_bytes": m.session_budget_bytes, "session_kv_bytes": m.session_kv_bytes,
                "queue_depth": m.queue_depth,
            })).collect::<Vec<_>>(),
            "window_seconds": RECENT_SECONDS,
            "recent": recent,
        })
    }

    /// Adds expert store activity.
    pub fn record_store(&self, s: &StoreStats) {
        self.expert_hits.fetch_add(s.hits, Ordering::Relaxed);
        self.expert_misses.fetch_add(s.misses, Ordering::Relaxed);
        self.bytes_read.fetch_add(s.bytes_read, Ordering::Relaxed);
    }

    /// The Prometheus exposition, with per-model gauges from `models`.
    pub fn render(&self, models: &[crate::fleet::ModelInfo]) -> String {
        let mut o = String::new();
        let g = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let _ = writeln!(o, "# HELP smoe_requests_total HTTP requests by endpoint and status.\n# TYPE smoe_requests_total counter");
        for ((ep, st), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(o, "smoe_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
        }
        let counters = [
            ("smoe_prompt_tokens_total", "Prompt tokens of finished generations.", g(&self.prompt_tokens) as f64),
            ("smoe_prefilled_tokens_total", "Prompt tokens computed (not reused from a cached session).", g(&self.prefilled_tokens) as f64),
            ("smoe_completion_tokens_total", "Generated tokens.", g(&self.completion_tokens) as f64),
            ("smoe_prefill_seconds_total", "Seconds spent in prefill.", g(&self.prefill_us) as f64 / 1e6),
            ("smoe_decode_seconds_total", "Seconds spent decoding.", g(&self.decode_us) as f64 / 1e6),
            ("smoe_expert_hits_total", "Expert uses served from the cache.", g(&self.expert_hits) as f64),
            ("smoe_expert_misses_total", "Expert uses read from disk.", g(&self.expert_misses) as f64),
            ("smoe_read_bytes_total", "Bytes read from vaults.", g(&self.bytes_read) as f64),
            ("smoe_engine_errors_total", "Generations that failed in the engine.", g(&self.engine_errors) as f64),
            ("smoe_cache_resizes_total", "Times the memory watch resized caches.", g(&self.cache_resizes) as f64),
            ("smoe_batch_steps_total", "Batched forward steps run.", g(&self.batch_steps) as f64),
            (
                "smoe_batch_sequences_total",
                "Generations in batched steps, summed (over steps: the mean batch).",
                g(&self.batch_sequences) as f64,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let (hits, misses) = (g(&self.expert_hits), g(&self.expert_misses));
        let (pf, dc) = *self.last.lock().unwrap();
        let gauges = [
            ("smoe_cache_hit_rate", "Expert cache hit rate since start.", hits as f64 / (hits + misses).max(1) as f64),
            ("smoe_last_prefill_tokens_per_second", "Prefill throughput of the last generation.", pf),
            ("smoe_last_decode_tokens_per_second", "Decode throughput of the last generation.", dc),
            ("smoe_batch_max", "The most generations one batched step has run.", g(&self.batch_max) as f64),
            (
                "smoe_memory_available_bytes",
                "Memory available when last read (MemAvailable or under a cgroup limit).",
                g(&self.memory_available) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let _ = writeln!(o, "# HELP smoe_queue_depth Requests waiting or running, per model.\n# TYPE smoe_queue_depth gauge");
        for m in models {
            let _ = writeln!(o, "smoe_queue_depth{{model=\"{}\"}} {}", m.id, m.queue_depth);
        }
        type Gauge = fn(&crate::fleet::ModelInfo) -> u64;
        let per_model: [(&str, &str, Gauge); 5] = [
            ("smoe_expert_cache_bytes", "Expert cache of each loaded model: what it may hold now.", |m| m.cache_bytes),
            ("smoe_expert_cache_max_bytes", "Expert cache of each loaded model at load.", |m| m.cache_max_bytes),
            ("smoe_expert_cache_resident_bytes", "Memory the expert cache of each loaded model takes now.", |m| m.cache_resident_bytes),
            ("smoe_session_kv_budget_bytes", "KV the cached sessions of each loaded model may hold now.", |m| m.session_budget_bytes),
            ("smoe_session_kv_bytes", "KV the cached sessions of each loaded model hold.", |m| m.session_kv_bytes),
        ];
        for (name, help, f) in per_model {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge");
            for m in models.iter().filter(|m| m.loaded) {
                let _ = writeln!(o, "{name}{{model=\"{}\"}} {}", m.id, f(m));
            }
        }
        o
    }
}
