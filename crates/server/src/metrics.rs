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
    last: Mutex<(f64, f64)>,
}

impl Metrics {
    /// Counts a finished request.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        *self.requests.lock().unwrap().entry((endpoint.to_string(), status)).or_default() += 1;
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

    /// Adds expert store activity.
    pub fn record_store(&self, s: &StoreStats) {
        self.expert_hits.fetch_add(s.hits, Ordering::Relaxed);
        self.expert_misses.fetch_add(s.misses, Ordering::Relaxed);
        self.bytes_read.fetch_add(s.bytes_read, Ordering::Relaxed);
    }

    /// The Prometheus exposition, with per-model gauges from `models`
    /// (`(name, queue depth, cache bytes, loaded)`).
    pub fn render(&self, models: &[(String, usize, u64, bool)]) -> String {
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
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let _ = writeln!(o, "# HELP smoe_queue_depth Requests waiting or running, per model.\n# TYPE smoe_queue_depth gauge");
        for (m, q, _, _) in models {
            let _ = writeln!(o, "smoe_queue_depth{{model=\"{m}\"}} {q}");
        }
        let _ = writeln!(o, "# HELP smoe_expert_cache_bytes Expert cache of each loaded model.\n# TYPE smoe_expert_cache_bytes gauge");
        for (m, _, c, loaded) in models {
            if *loaded {
                let _ = writeln!(o, "smoe_expert_cache_bytes{{model=\"{m}\"}} {c}");
            }
        }
        o
    }
}
