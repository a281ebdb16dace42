//! `--instrument`: where each token's time and bytes go.
//!
//! Per forward call (one decode token, or one prefill chunk) the decoder records milliseconds in
//! attention, routing, expert compute and I/O wait, plus the store's counters; generation adds
//! sampling time. Adjacent-token reuse is the share of a token's experts that the previous
//! token also used, averaged over MoE layers.

use smoe_store::StoreStats;

/// One forward call's measurements.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StepRecord {
    /// Tokens in the call (1 for decode).
    pub tokens: usize,
    /// Milliseconds in attention (projections, RoPE, cache, attention, output).
    pub attention_ms: f64,
    /// Milliseconds computing router logits and choosing experts.
    pub routing_ms: f64,
    /// Milliseconds computing experts (routed and shared), not counting I/O wait.
    pub expert_ms: f64,
    /// Milliseconds waiting for expert reads.
    pub io_wait_ms: f64,
    /// Milliseconds sampling (generation only).
    pub sampling_ms: f64,
    /// Everything else (embedding, norms, LM head, lookahead).
    pub other_ms: f64,
    /// Wall time of the call.
    pub total_ms: f64,
    /// Expert bytes read.
    pub bytes_read: u64,
    /// Expert uses served from the cache.
    pub hits: u64,
    /// Expert uses that needed a read.
    pub misses: u64,
    /// Mean share of each token's experts the previous token also used (None for the first).
    pub adjacent_reuse: Option<f64>,
    /// Mean reads in flight while waiting.
    pub inflight: f64,
    /// Prefetch reads issued.
    pub prefetch_issued: u64,
    /// Prefetched experts used.
    pub prefetch_used: u64,
    /// Seconds reads were outstanding (see `StoreStats::busy_seconds`).
    pub busy_seconds: f64,
    /// Reads allowed in flight at the end of the step.
    pub queue_depth: u32,
}

/// Accumulates [`StepRecord`]s.
#[derive(Default)]
pub struct Instrument {
    /// One record per forward call.
    pub records: Vec<StepRecord>,
    pub(crate) current: StepRecord,
    pub(crate) store_before: StoreStats,
    /// Previous token's experts per layer (sorted), for adjacent reuse.
    prev: Vec<Vec<u32>>,
    reuse_sum: f64,
    reuse_n: usize,
}

impl Instrument {
    pub(crate) fn begin(&mut self, tokens: usize, store: StoreStats) {
        self.current = StepRecord { tokens, ..Default::default() };
        self.store_before = store;
        self.reuse_sum = 0.0;
        self.reuse_n = 0;
    }

    /// Records the experts of one token at one MoE layer.
    pub(crate) fn route(&mut self, layer: usize, experts: &[u32]) {
        if self.prev.len() <= layer {
            self.prev.resize(layer + 1, Vec::new());
        }
        let prev = &mut self.prev[layer];
        if !prev.is_empty() {
            let shared = experts.iter().filter(|e| prev.contains(e)).count();
            self.reuse_sum += shared as f64 / experts.len() as f64;
            self.reuse_n += 1;
        }
        prev.clear();
        prev.extend_from_slice(experts);
    }

    pub(crate) fn end(&mut self, total_ms: f64, store: StoreStats) {
        let d = store.since(&self.store_before);
        let c = &mut self.current;
        c.total_ms = total_ms;
        c.io_wait_ms = d.wait_seconds * 1e3;
        c.expert_ms = (c.expert_ms - c.io_wait_ms).max(0.0);
        c.other_ms = (total_ms - c.attention_ms - c.routing_ms - c.expert_ms - c.io_wait_ms).max(0.0);
        c.bytes_read = d.bytes_read;
        c.hits = d.hits;
        c.misses = d.misses;
        c.inflight = d.mean_inflight();
        c.prefetch_issued = d.prefetch_issued;
        c.prefetch_used = d.prefetch_used;
        c.busy_seconds = d.busy_seconds;
        c.queue_depth = d.queue_depth;
        c.adjacent_reuse = (self.reuse_n > 0).then(|| self.reuse_sum / self.reuse_n as f64);
        self.records.push(std::mem::take(&mut self.current));
    }

    /// Adds sampling time to the latest record.
    pub fn add_sampling(&mut self, ms: f64) {
        if let Some(r) = self.records.last_mut() {
            r.sampling_ms += ms;
            r.total_ms += ms;
        }
    }

    /// Totals over `records[from..]` (decode-only summaries skip the prefill records).
    pub fn summary(&self, from: usize) -> Summary {
        Self::sum(&self.records[from.min(self.records.len())..])
    }

    /// Totals over `records[from..to]`.
    pub fn summary_range(&self, from: usize, to: usize) -> Summary {
        let to = to.min(self.records.len());
        Self::sum(&self.records[from.min(to)..to])
    }

    fn sum(rs: &[StepRecord]) -> Summary {
        let mut s = Summary { steps: rs.len(), ..Default::default() };
        let mut reuse = (0.0, 0);
        let mut inflight = (0.0, 0);
        for r in rs {
            if r.misses > 0 {
                inflight.0 += r.inflight;
                inflight.1 += 1;
            }
            s.tokens += r.tokens;
            s.attention_ms += r.attention_ms;
            s.routing_ms += r.routing_ms;
            s.expert_ms += r.expert_ms;
            s.io_wait_ms += r.io_wait_ms;
            s.sampling_ms += r.sampling_ms;
            s.other_ms += r.other_ms;
            s.total_ms += r.total_ms;
            s.bytes_read += r.bytes_read;
            s.hits += r.hits;
            s.misses += r.misses;
            s.prefetch_issued += r.prefetch_issued;
            s.prefetch_used += r.prefetch_used;
            s.busy_seconds += r.busy_seconds;
            s.queue_depth = r.queue_depth;
            if let Some(a) = r.adjacent_reuse {
                reuse.0 += a;
                reuse.1 += 1;
            }
        }
        s.adjacent_reuse = if reuse.1 > 0 { reuse.0 / reuse.1 as f64 } else { 0.0 };
        s.inflight = if inflight.1 > 0 { inflight.0 / inflight.1 as f64 } else { 0.0 };
        s.read_gb_s = s.bytes_read as f64 / (s.io_wait_ms.max(1e-9) * 1e6);
        s
    }
}

/// Totals over several steps.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Summary {
    /// Forward calls.
    pub steps: usize,
    /// Tokens.
    pub tokens: usize,
    /// See [`StepRecord`].
    pub attention_ms: f64,
    /// See [`StepRecord`].
    pub routing_ms: f64,
    /// See [`StepRecord`].
    pub expert_ms: f64,
    /// See [`StepRecord`].
    pub io_wait_ms: f64,
    /// See [`StepRecord`].
    pub sampling_ms: f64,
    /// See [`StepRecord`].
    pub other_ms: f64,
    /// See [`StepRecord`].
    pub total_ms: f64,
    /// Expert bytes read.
    pub bytes_read: u64,
    /// Cache hits.
    pub hits: u64,
    /// Cache misses.
    pub misses: u64,
    /// Mean adjacent-token expert reuse.
    pub adjacent_reuse: f64,
    /// Bytes read per millisecond of I/O wait, in GB/s (a lower bound on device bandwidth:
    /// reads that finish while computing are not counted as waiting).
    pub read_gb_s: f64,
    /// Prefetch reads issued.
    pub prefetch_issued: u64,
    /// Prefetched experts used.
    pub prefetch_used: u64,
    /// Seconds reads were outstanding.
    pub busy_seconds: f64,
    /// Mean reads in flight, over the steps that read.
    pub inflight: f64,
    /// Reads allowed in flight at the end (the measured choice under `auto`).
    pub queue_depth: u32,
    /// The backend's own expert tier over the same steps, where it has one (set by the
    /// caller that knows the backend: see `bench`).
    pub device: Option<crate::backend::DeviceTier>,
}

impl Summary {
    /// Cache hit rate.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
    /// Bytes read per second while reads were outstanding.
    pub fn read_bytes_per_s(&self) -> f64 {
        self.bytes_read as f64 / self.busy_seconds.max(1e-9)
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = |v: f64| v / self.tokens.max(1) as f64;
        writeln!(f, "{} tokens in {} steps, {:.2} ms/token", self.tokens, self.steps, per(self.total_ms))?;
        writeln!(
            f,
            "  per token: attention {:.2} ms, routing {:.2} ms, experts {:.2} ms, io wait {:.2} ms, sampling {:.2} ms, other {:.2} ms",
            per(self.attention_ms),
            per(self.routing_ms),
            per(self.expert_ms),
            per(self.io_wait_ms),
            per(self.sampling_ms),
            per(self.other_ms)
        )?;
        writeln!(
            f,
            "  experts: hit rate {:.3} ({} hits, {} misses), {:.1} MiB read per token, adjacent-token reuse {:.3}",
            self.hit_rate(),
            self.hits,
            self.misses,
            per(self.bytes_read as f64) / (1 << 20) as f64,
            self.adjacent_reuse
        )?;
        write!(
            f,
            "  reads: {:.2} GB/s while outstanding, {:.1} in flight on average (limit {}), {:.2} GB/s per ms waited",
            self.read_bytes_per_s() / 1e9,
            self.inflight,
            self.queue_depth,
            self.read_gb_s
        )?;
        if self.prefetch_issued > 0 {
            write!(
                f,
                "; prefetch issued {}, used {} ({:.0}%)",
                self.prefetch_issued,
                self.prefetch_used,
                100.0 * self.prefetch_used as f64 / self.prefetch_issued as f64
            )?;
        }
        if let Some(d) = &self.device {
            let mib = |b: f64| b / (1 << 20) as f64;
            write!(
                f,
                "\n  device tier: {} hits, {} copies, {:.1} MiB over the bus per token ({:.1} GB/s while copying), copies {:.2} ms per token on the copy engine (host waited {:.2} ms) of {:.2} ms; {} products of misses on the CPU ({:.1} MiB per token); experts in device memory {:.0} of {:.0} MiB, device memory in use {:.0} MiB",
                d.hits,
                d.copies,
                mib(per(d.copied_bytes as f64)),
                d.copied_bytes as f64 / d.copy_secs.max(1e-9) / 1e9,
                per(d.copy_secs * 1e3),
                per(d.wait_secs * 1e3),
                per(self.total_ms),
                d.cpu_products,
                mib(per(d.cpu_bytes as f64)),
                mib(d.resident_bytes as f64),
                mib(d.capacity_bytes as f64),
                mib(d.device_used_bytes as f64)
            )?;
        }
        Ok(())
    }
}
