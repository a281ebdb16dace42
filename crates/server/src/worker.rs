//! One loaded model: a thread that runs its generations from a bounded queue, several at a
//! time (continuous batching), with a pool of cached sessions for prefix reuse.
//!
//! Requests reach the thread as [`Job`]s and answer through a channel of [`Event`]s. Each step
//! the thread admits waiting jobs up to the batch's limit, then runs one batched forward step
//! ([`smoe_engine::Model::forward_batch`]) over every active generation: a decode token of each
//! one past its prompt, then chunks of prompts in the step's token budget left (chunked prefill,
//! so a long prompt neither waits for the streams nor stalls them). A job whose client has gone
//! (its channel closed, or its cancel flag set) leaves the batch at the next step.
//!
//! Under memory pressure the server shrinks a worker's caches while it runs (see
//! [`crate::memory`]): the expert cache through the store, which is safe from any thread, and
//! the session pool's budget, which the thread applies between steps (dropping the least
//! recently used cached sessions, never one that is running).

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::pace::Pace;
use smoe_engine::{
    Backend, Batch, BatchItem, Engine, EngineError, FinishReason, GenOptions, Generation, LoadedModel, NoObserver, Session, Stepwise,
};
use smoe_store::{CacheCapacity, ExpertSource, StoreStats};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a generation streams back.
#[derive(Debug)]
pub enum Event {
    /// Text of the next token(s).
    Text(String),
    /// The generation ended.
    Done(Box<Finished>),
    /// The engine failed.
    Failed(ApiError),
}

/// A finished generation with the store's counters over it.
#[derive(Debug)]
pub struct Finished {
    /// The generation.
    pub generation: Generation,
    /// Expert store activity during it.
    pub store: StoreStats,
}

/// A generation to run.
pub struct Job {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Generation options.
    pub opts: GenOptions,
    /// Where events go.
    pub events: UnboundedSender<Event>,
    /// Set when the client no longer wants the result.
    pub cancel: Arc<AtomicBool>,
    /// Streamed to a client (someone watching), as opposed to a background request such as
    /// Open WebUI's title and tag generation, which are not streamed.
    pub streamed: bool,
    /// When it was queued.
    pub queued: Instant,
    /// Where the prompt's part other chats share ends, for a model with recurrent states
    /// ([`crate::run::Prepared::keep_at`]).
    pub keep_at: Option<usize>,
}

/// Limits of a worker.
#[derive(Clone, Debug)]
pub struct WorkerLimits {
    /// Jobs waiting or running at most; beyond, requests get 429.
    pub max_queue: usize,
    /// Sessions kept for prefix reuse.
    pub max_sessions: usize,
    /// KV-cache bytes all sessions may hold together (at most: the memory watch may lower it
    /// for a while, [`Worker::set_session_budget`]).
    pub session_bytes: usize,
    /// Generations advanced together, at most (`--max-batch`).
    pub max_batch: usize,
    /// Tokens one step runs, at most, all generations together (`--batch-tokens`): each
    /// decoding generation's token, then prompt chunks in what is left. `None`: the model's
    /// prefill chunk (256 tokens on the CPU; 1,024 when the expert cache is smaller than the
    /// experts, see `STREAMING_PREFILL_CHUNK`), which bounds the step's buffers as a lone
    /// sequence's chunk does.
    pub step_tokens: Option<usize>,
    /// How long a step that reads prompt tokens may take while generations are streaming
    /// (`--max-stall-ms`; see [`crate::pace`]). `None`: prompts always take what is left of
    /// the step's tokens, however long the streams then pause.
    pub max_stall: Option<Duration>,
    /// Called on the generation thread before each batched step (the memory watch's check, so
    /// that what a long request adds between two requests' checks is seen step by step).
    pub before_step: Option<StepHook>,
}

/// A function the generation thread calls before each batched step ([`WorkerLimits::before_step`]).
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

/// Replies generated recently, by text: lets a client's next request, which sends the reply
/// back as text, reuse the exact generated ids (see `smoe_engine::tokenize_chat`).
#[derive(Default)]
pub struct RecentReplies(Mutex<VecDeque<(String, Vec<u32>)>>);

impl RecentReplies {
    const KEEP: usize = 64;

    /// The ids that produced `text`, if generated recently.
    pub fn get(&self, text: &str) -> Option<Vec<u32>> {
        self.0.lock().unwrap().iter().rev().find(|(t, _)| t == text).map(|(_, ids)| ids.clone())
    }

    fn add(&self, text: String, ids: Vec<u32>) {
        let mut q = self.0.lock().unwrap();
        if q.len() == Self::KEEP {
            q.pop_front();
        }
        q.push_back((text, ids));
    }
}

/// A model with its generation thread.
pub struct Worker {
    /// The model name.
    pub name: String,
    /// The backend it runs on, in words (a GPU server's `--device auto` opens some models on
    /// the CPU).
    pub backend: String,
    /// The model as request threads use it (tokenizer, template, defaults), whatever its
    /// backend: only the generation thread names the backend type.
    pub engine: Arc<dyn LoadedModel>,
    /// Recent replies, for prefix reuse.
    pub recent: Arc<RecentReplies>,
    tx: Option<mpsc::Sender<Msg>>,
    pending: Arc<AtomicUsize>,
    limits: WorkerLimits,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The model's expert source (its cache resized from outside the thread).
    experts: Arc<dyn ExpertSource>,
    pool: Arc<PoolMemory>,
}

/// What reaches the generation thread.
enum Msg {
    /// A generation to run (boxed: a job is hundreds of bytes, a trim none).
    Job(Box<Job>),
    /// The session budget changed: apply it now, even when idle.
    Trim,
}

/// The session pool's budget now and the KV its cached sessions hold, shared by a worker and
/// its thread.
struct PoolMemory {
    budget: AtomicUsize,
    held: AtomicUsize,
}

impl Worker {
    /// Starts the generation thread for an engine on any backend.
    pub fn spawn<B: Backend + 'static>(name: String, engine: Engine<B>, limits: WorkerLimits, metrics: Arc<Metrics>) -> Worker {
        let engine = Arc::new(engine);
        let backend = engine.model.backend().describe();
        let experts = engine.model.experts().clone();
        let recent = Arc::new(RecentReplies::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let pool = Arc::new(PoolMemory { budget: AtomicUsize::new(limits.session_bytes), held: AtomicUsize::new(0) });
        let (tx, rx) = mpsc::channel::<Msg>();
        let ctx = Loop {
            name: name.clone(),
            engine: engine.clone(),
            recent: recent.clone(),
            pending: pending.clone(),
            limits: limits.clone(),
            metrics,
            pool: pool.clone(),
        };
        let thread = std::thread::Builder::new().name(format!("gen-{name}")).spawn(move || ctx.run(rx)).expect("spawn a thread");
        Worker {
            name,
            backend,
            engine: engine as Arc<dyn LoadedModel>,
            recent,
            tx: Some(tx),
            pending,
            limits,
            thread: Some(thread),
            experts,
            pool,
        }
    }

    /// Queues a job, or refuses with 429 when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let n = self.pending.fetch_add(1, Ordering::SeqCst);
        if n >= self.limits.max_queue {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::busy(&self.name, self.limits.max_queue));
        }
        if self.tx.as_ref().expect("set until drop").send(Msg::Job(Box::new(job))).is_err() {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::internal(format!("the worker of '{}' has stopped", self.name)));
        }
        Ok(())
    }

    /// Jobs waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// The expert cache's size and what it holds; `None` where it cannot be resized (every
    /// expert resident).
    pub fn cache_capacity(&self) -> Option<CacheCapacity> {
        self.experts.cache_capacity()
    }

    /// Resizes the expert cache to `slots` experts (see [`ExpertSource::resize_cache`]): safe
    /// while generations run, as the store's lock keeps a resize between two layers.
    pub fn resize_cache(&self, slots: usize) -> Option<CacheCapacity> {
        self.experts.resize_cache(slots)
    }

    /// KV bytes the cached sessions may hold together now.
    pub fn session_budget(&self) -> usize {
        self.pool.budget.load(Ordering::Relaxed)
    }

    /// The session budget at load, the most [`Worker::set_session_budget`] gives.
    pub fn max_session_budget(&self) -> usize {
        self.limits.session_bytes
    }

    /// KV bytes the cached sessions hold (not counting those running).
    pub fn session_kv_bytes(&self) -> usize {
        self.pool.held.load(Ordering::Relaxed)
    }

    /// Sets the session budget (at most the one at load). A lower one takes effect between
    /// two steps, at once if the thread is idle: the least recently used cached sessions are
    /// dropped until the rest fit.
    pub fn set_session_budget(&self, bytes: usize) {
        self.pool.budget.store(bytes.min(self.limits.session_bytes), Ordering::Relaxed);
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Trim);
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the loop once queued jobs are done.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A background request that has waited this long goes next, streamed ones or not.
const BACKGROUND_PATIENCE: Duration = Duration::from_secs(10);

/// The next job of a non-empty queue: streamed requests before background ones (a user watching
/// a reply should not wait behind a title or tag request), each kind in arrival order, unless
/// the oldest job has waited [`BACKGROUND_PATIENCE`].
fn next_job(waiting: &mut VecDeque<Job>, now: Instant) -> Job {
    let oldest_waited = waiting.front().is_some_and(|j| now.duration_since(j.queued) >= BACKGROUND_PATIENCE);
    let i = if oldest_waited { 0 } else { waiting.iter().position(|j| j.streamed).unwrap_or(0) };
    waiting.remove(i).expect("a non-empty queue")
}

/// Fewest tokens of a cached conversation's prefix worth copying into a new one (see `pick`).
const SHARED_PREFIX_MIN: usize = 64;

struct Loop<B: Backend> {
    name: String,
    engine: Arc<Engine<B>>,
    recent: Arc<RecentReplies>,
    pending: Arc<AtomicUsize>,
    limits: WorkerLimits,
    metrics: Arc<Metrics>,
    pool: Arc<PoolMemory>,
}

struct Cached<B: Backend> {
    session: Session<B>,
    used: Instant,
}

/// A generation in the batch, with the session it runs on (out of the pool meanwhile).
struct Active<B: Backend> {
    job: Job,
    session: Session<B>,
    gen: Stepwise,
    /// The store's counters when it started (the generations of a batch share their reads).
    store0: StoreStats,
    /// The step that failed under it, if one did.
    failed: Option<ApiError>,
}

impl<B: Backend> Loop<B> {
    fn run(self, rx: mpsc::Receiver<Msg>) {
        let mut sessions: Vec<Cached<B>> = Vec::new();
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut active: Vec<Active<B>> = Vec::new();
        let max_batch = self.limits.max_batch.max(1);
        let step_tokens = self.limits.step_tokens.unwrap_or_else(|| self.engine.model.prefill_chunk());
        let mut batch = self.engine.model.new_batch(step_tokens.max(max_batch));
        let mut pace = Pace::default();
        let mut budget = self.pool.budget.load(Ordering::Relaxed);
        loop {
            if active.is_empty() && waiting.is_empty() {
                // Closing the channel ends the loop once queued jobs are done.
                match rx.recv() {
                    Ok(Msg::Job(job)) => waiting.push_back(*job),
                    Ok(Msg::Trim) => {}
                    Err(_) => return,
                }
            }
            waiting.extend(rx.try_iter().filter_map(|m| match m {
                Msg::Job(job) => Some(*job),
                Msg::Trim => None,
            }));
            // A budget lowered by the memory watch: drop cached sessions now (the running
            // ones are out of the pool, so never theirs). Their KV goes back to the allocator:
            // a large one (above glibc's mmap threshold, 32 MiB at most) to the kernel at once,
            // a smaller one to the heap, where the next requests take it. The heap is not
            // trimmed: that would hand back the requests' working memory as well, for the next
            // one to fault in again.
            let now = self.pool.budget.load(Ordering::Relaxed);
            if now != budget {
                if now < budget {
                    self.trim(&mut sessions, None);
                }
                budget = now;
            }
            while active.len() < max_batch && !waiting.is_empty() {
                let job = next_job(&mut waiting, Instant::now());
                self.admit(&mut sessions, &mut active, job);
            }
            for a in active.iter_mut().filter(|a| a.job.cancel.load(Ordering::SeqCst) || a.job.events.is_closed()) {
                a.gen.stop(FinishReason::Cancelled);
            }
            if let (Some(hook), false) = (&self.limits.before_step, active.is_empty()) {
                (hook.0)();
            }
            self.step(&mut batch, &mut active, &mut pace);
            let mut i = 0;
            while i < active.len() {
                if active[i].gen.finished() || active[i].failed.is_some() {
                    let a = active.remove(i);
                    self.finish(&mut sessions, a);
                } else {
                    i += 1;
                }
            }
            self.record_held(&sessions);
        }
    }

    /// Publishes the KV the pool holds (for the memory watch and the stats).
    fn record_held(&self, sessions: &[Cached<B>]) {
        let held = sessions.iter().map(|c| c.session.kv_bytes(&self.engine.model)).sum();
        self.pool.held.store(held, Ordering::Relaxed);
    }

    /// Starts `job` on a session from the pool, or answers it at once (a client already gone,
    /// a prompt the engine refuses).
    fn admit(&self, sessions: &mut Vec<Cached<B>>, active: &mut Vec<Active<B>>, job: Job) {
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        // A model with recurrent states can resume only where a sequence kept them: keep them
        // where this prompt's shared part ends (its system prompt), or else where it leaves a
        // cached conversation it shares a long prefix with (a regenerated reply, an edit).
        let branch = sessions
            .iter()
            .map(|c| (c.session.common_prefix(&job.prompt), c.session.cached_tokens().len()))
            .filter(|&(common, len)| common < len && common >= SHARED_PREFIX_MIN)
            .map(|(common, _)| common)
            .max();
        let keep_at = job.keep_at.or(branch);
        let i = self.pick(sessions, &job.prompt);
        let mut cached = sessions.remove(i);
        let store0 = self.engine.model.experts().stats();
        match cached.session.start(&self.engine, &job.prompt, &job.opts) {
            Ok(mut gen) => {
                if let Some(p) = keep_at {
                    gen.keep_state_at(&self.engine, cached.session.state_mut(), p);
                }
                active.push(Active { job, session: cached.session, gen, store0, failed: None })
            }
            Err(e) => {
                // Refused before any step: the session still holds the prefix it shares.
                sessions.push(cached);
                self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
                self.pending.fetch_sub(1, Ordering::SeqCst);
                let _ = job.events.send(Event::Failed(api_error(e)));
            }
        }
    }

    /// One batched forward step over the active generations: one token of each that is past
    /// its prompt, then prompt chunks in admission order while the step's token budget lasts
    /// (beside streaming generations, only what fits in the stall limit: [`crate::pace`]).
    /// Each generation then samples from its own logits and streams its text.
    fn step(&self, batch: &mut Batch<B>, active: &mut [Active<B>], pace: &mut Pace) {
        let mut left = batch.tokens();
        let mut take = vec![0usize; active.len()];
        let mut decoding = 0;
        for (t, a) in take.iter_mut().zip(active.iter()) {
            if !a.gen.finished() && !a.gen.prefilling() {
                *t = a.gen.input().len().min(left);
                left -= *t;
                decoding += *t;
            }
        }
        if let Some(stall) = self.limits.max_stall {
            left = pace.prompt_budget(decoding, left, stall);
        }
        let mut prompt = 0;
        for (t, a) in take.iter_mut().zip(active.iter()) {
            if !a.gen.finished() && a.gen.prefilling() {
                *t = a.gen.input().len().min(left);
                left -= *t;
                prompt += *t;
            }
        }
        if take.iter().all(|&t| t == 0) {
            return;
        }
        let model = &self.engine.model;
        let store0 = model.experts().stats();
        let mut items: Vec<BatchItem<'_, B>> = active
            .iter_mut()
            .zip(&take)
            .filter(|(_, &t)| t > 0)
            .map(|(a, &t)| BatchItem { state: a.session.state_mut(), tokens: &a.gen.input()[..t] })
            .collect();
        let started = Instant::now();
        let result = model.forward_batch(batch, &mut items, &mut NoObserver);
        pace.observe(decoding, prompt, started.elapsed().as_secs_f64());
        drop(items);
        self.metrics.record_store(&model.experts().stats().since(&store0));
        self.metrics.record_step(take.iter().filter(|&&t| t > 0).count());
        let vocab = model.arch().vocab_size;
        let running = active.iter_mut().zip(&take).filter(|(_, &t)| t > 0);
        match result {
            Ok(logits) => {
                for ((a, &t), row) in running.zip(logits.chunks_exact(vocab)) {
                    let (events, cancel) = (&a.job.events, &a.job.cancel);
                    a.gen.advance(t, row, &mut |_, text| stream(events, cancel, text));
                }
            }
            Err(e) => {
                tracing::error!("batched step failed: {e}");
                let err = api_error(e);
                for (a, _) in running {
                    a.failed = Some(err.clone());
                }
            }
        }
    }

    /// Answers a generation that left the batch and returns its session to the pool. The
    /// queue's place is given back before the answer goes out: a client that sends its next
    /// request on the answer finds the place free (with `--max-queue 1` it got a 429).
    fn finish(&self, sessions: &mut Vec<Cached<B>>, a: Active<B>) {
        let Active { job, mut session, gen, store0, failed } = a;
        session.record(gen.context());
        let answer = if let Some(err) = failed {
            self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
            Event::Failed(err)
        } else {
            let g = gen.finish(&mut |_, text| stream(&job.events, &job.cancel, text));
            let store = self.engine.model.experts().stats().since(&store0);
            self.metrics.record_generation(&g.stats);
            self.metrics.record_sample(&self.name, &g.stats, &store, self.pending.load(Ordering::Relaxed));
            if !g.tokens.is_empty() {
                self.recent.add(g.text.clone(), g.tokens.clone());
            }
            Event::Done(Box::new(Finished { generation: g, store }))
        };
        // Parked, it keeps the positions it holds (what the budget counts), not the room its
        // request reserved for a whole reply.
        session.shrink(&self.engine.model);
        sessions.push(Cached { session, used: Instant::now() });
        // The session just finished is kept for a follow-up even over the budget, unless the
        // memory watch has lowered the budget: then the budget holds.
        let lowered = self.pool.budget.load(Ordering::Relaxed) < self.limits.session_bytes;
        self.trim(sessions, (!lowered).then(|| sessions.len() - 1));
        self.record_held(sessions);
        self.pending.fetch_sub(1, Ordering::SeqCst);
        let _ = job.events.send(answer);
    }

    /// The session for `prompt`: the cached one it extends; else a copy of the longest shared
    /// prefix (see below); else the one sharing at least half of itself; else a fresh one, so
    /// that a different conversation does not wipe a cached one.
    fn pick(&self, sessions: &mut Vec<Cached<B>>, prompt: &[u32]) -> usize {
        let best = (0..sessions.len()).max_by_key(|&i| (sessions[i].session.common_prefix(prompt), sessions[i].used));
        let common = best.map_or(0, |i| sessions[i].session.common_prefix(prompt));
        // The prompt extends a cached conversation: continue it.
        if let Some(i) = best.filter(|&i| common > 0 && common == sessions[i].session.cached_tokens().len()) {
            return i;
        }
        let room = sessions.len() < self.limits.max_sessions.max(1);
        // A prompt that shares a long prefix with a cached conversation but goes elsewhere (a new
        // conversation with the same system prompt and tool schemas, as Open WebUI sends with
        // every chat; a regenerated reply) starts from a copy of that prefix's keys and values
        // and leaves the other conversation whole.
        let shared = common.min(prompt.len().saturating_sub(1));
        if let (Some(i), true) = (best, room && shared >= SHARED_PREFIX_MIN) {
            if let Some(session) = Session::fork(&self.engine.model, &sessions[i].session, shared) {
                sessions.push(Cached { session, used: Instant::now() });
                return sessions.len() - 1;
            }
        }
        if let Some(i) = best {
            // No copy (no room, or a backend that cannot copy): continue when the prompt shares
            // most of it, truncating a little rather than recomputing everything. What counts is
            // where the session can resume: a model with recurrent states goes back only to
            // where its last prefill ended, and taking over a conversation it cannot resume
            // would only wipe it.
            let resume = sessions[i].session.resumable_prefix(prompt);
            if resume > 0 && 2 * resume >= sessions[i].session.cached_tokens().len() {
                return i;
            }
        }
        if room {
            sessions.push(Cached { session: Session::batched(&self.engine.model), used: Instant::now() });
            return sessions.len() - 1;
        }
        match best {
            Some(i) if common > 0 => i,
            _ => (0..sessions.len()).min_by_key(|&i| sessions[i].used).expect("the pool is not empty"),
        }
    }

    /// Drops least recently used sessions (never `keep`, the one just finished) while their KV
    /// caches exceed the budget; with no `keep`, down to none.
    fn trim(&self, sessions: &mut Vec<Cached<B>>, mut keep: Option<usize>) {
        let model = &self.engine.model;
        let budget = self.pool.budget.load(Ordering::Relaxed);
        while sessions.len() > usize::from(keep.is_some()) && sessions.iter().map(|c| c.session.kv_bytes(model)).sum::<usize>() > budget {
            let victim =
                (0..sessions.len()).filter(|&i| Some(i) != keep).min_by_key(|&i| sessions[i].used).expect("a session other than keep");
            sessions.remove(victim);
            if let Some(k) = keep.as_mut().filter(|k| victim < **k) {
                *k -= 1;
            }
        }
    }
}

/// Streams a generation's text to its client; false (stop) once the client has gone.
fn stream(events: &UnboundedSender<Event>, cancel: &AtomicBool, text: &str) -> bool {
    if !text.is_empty() && events.send(Event::Text(text.to_string())).is_err() {
        return false;
    }
    !cancel.load(Ordering::SeqCst)
}

/// The client's view of an engine error: its input refused, or a failure of ours.
fn api_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Input(m) => ApiError::bad_request(m),
        other => ApiError::internal(format!("engine error: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(streamed: bool, waited: Duration, now: Instant, tag: usize) -> Job {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let opts = GenOptions::new(tag, Default::default(), 16);
        Job { prompt: vec![], opts, events, cancel: Arc::default(), streamed, queued: now - waited, keep_at: None }
    }

    #[test]
    fn streamed_requests_go_before_background_ones_until_those_waited_too_long() {
        let now = Instant::now();
        let s = Duration::from_secs(1);
        let mut q: VecDeque<Job> =
            [job(false, 3 * s, now, 1), job(false, 2 * s, now, 2), job(true, s, now, 3), job(true, s, now, 4)].into();
        let order: Vec<usize> = (0..4).map(|_| next_job(&mut q, now).opts.max_tokens).collect();
        assert_eq!(order, [3, 4, 1, 2], "streamed first, each kind in arrival order");
        let mut q: VecDeque<Job> = [job(false, BACKGROUND_PATIENCE, now, 1), job(true, s, now, 2)].into();
        assert_eq!(next_job(&mut q, now).opts.max_tokens, 1, "a background request that waited its patience goes next");
    }
}
