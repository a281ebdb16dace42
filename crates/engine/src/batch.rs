//! Batched forward steps: the new tokens of several sequences — one decode token each, or a
//! chunk of a prompt — through the layers at once.
//!
//! Every sequence keeps its own [`State`] (KV cache and position); the step's rows are the
//! sequences' tokens one after another. Everything but attention treats the rows alike: the
//! dense products run once over all of them, and the MoE block groups every (token, slot) pair
//! of the step by expert, so each routed expert is fetched from the store and multiplied once
//! for all the tokens, of whichever sequence, that chose it. Attention runs per sequence, over
//! its own cache at its own positions.
//!
//! Exactness: a sequence's rows go through the same ops on the same values as when it runs
//! alone (attention on its rows alone; every other op computes each row from that row), so
//! its logits are those it gets alone wherever a product's result for one row does not depend
//! on how many rows share the call. That holds bit for bit for the CPU backend's f32
//! [`Precision::Reference`](crate::Precision::Reference) products. The int8 path
//! ([`Precision::Fast`](crate::Precision::Fast)) takes its many-token kernels from four rows a
//! product (the same int8 sums, the block scales applied in another order), so there a batch
//! agrees with the sequence alone within float rounding, not bit for bit; the tests measure it.

use crate::backend::Backend;
use crate::forward::{Seg, State, Step, Work};
use crate::instrument::Instrument;
use crate::{EngineError, Model, Observer};
use std::time::Instant;

/// Working memory for batched steps of up to a number of tokens in all (see the module
/// documentation): activation buffers that rows of every sequence share, and the logits of the
/// latest step.
pub struct Batch<B: Backend> {
    work: Work<B>,
    /// The step's token ids, sequence after sequence.
    ids: Vec<u32>,
    /// `[sequences, vocab]`: each sequence's logits at its last new token.
    logits: Vec<f32>,
    /// Per-step measurements, when enabled (one record per step, all sequences together).
    pub instrument: Option<Instrument>,
}

impl<B: Backend> Batch<B> {
    /// Most tokens (all sequences together) one step runs.
    pub fn tokens(&self) -> usize {
        self.work.chunk
    }
    /// Starts recording per-step measurements.
    pub fn enable_instrument(&mut self) {
        self.instrument.get_or_insert_with(Instrument::default);
    }
}

/// One sequence's part of a batched step: its state and the tokens to run after its position
/// (one to decode, or a chunk of its prompt).
pub struct BatchItem<'a, B: Backend> {
    /// The sequence (KV cache and position). Its own buffers are not used: a sequence that
    /// only runs in batches can be made with [`Model::new_state`]`(1)`.
    pub state: &'a mut State<B>,
    /// Its new tokens.
    pub tokens: &'a [u32],
}

impl<B: Backend> Model<B> {
    /// Working memory for batched steps of up to `tokens` tokens in all.
    pub fn new_batch(&self, tokens: usize) -> Batch<B> {
        Batch { work: self.work(tokens, true), ids: Vec::new(), logits: Vec::new(), instrument: None }
    }

    /// Runs each item's tokens after its sequence's position, all in one step, and returns
    /// each sequence's logits at its last new token, `[items, vocab]` in item order. Every
    /// sequence's position advances by its token count. `obs` sees each token's routing with
    /// its position in its own sequence.
    pub fn forward_batch<'b>(
        &self,
        batch: &'b mut Batch<B>,
        items: &mut [BatchItem<'_, B>],
        obs: &mut dyn Observer,
    ) -> Result<&'b [f32], EngineError> {
        let vocab = self.arch.vocab_size;
        if items.is_empty() {
            return Err(EngineError::Input("a batched step needs at least one sequence".into()));
        }
        if let Some(i) = items.iter().position(|it| it.tokens.is_empty()) {
            return Err(EngineError::Input(format!("sequence {i} of the batch has no tokens to run")));
        }
        let total: usize = items.iter().map(|it| it.tokens.len()).sum();
        if total > batch.tokens() {
            return Err(EngineError::Input(format!("the step has {total} tokens; the batch was made for at most {}", batch.tokens())));
        }
        batch.ids.clear();
        for it in items.iter() {
            if let Some(&bad) = it.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
            }
            batch.ids.extend_from_slice(it.tokens);
        }
        let t0 = Instant::now();
        if let Some(ins) = batch.instrument.as_mut() {
            ins.begin(total, self.experts.stats());
        }
        // One small list per step: the sequences' caches, borrowed for the step.
        for it in items.iter_mut() {
            it.state.before_step(&self.backend, self.recurrent_floats());
        }
        let mut row = 0;
        let mut segs: Vec<Seg<'_, B>> = items
            .iter_mut()
            .map(|it| {
                let n = it.tokens.len();
                let st = &mut *it.state;
                let seg = Seg { kv: &mut st.kv, rec: &mut st.recurrent, pos: st.pos, stream: st.stream, row, n };
                row += n;
                seg
            })
            .collect();
        let Batch { work, ids, logits, instrument } = batch;
        let (buf, host) = work.parts();
        let mut step = Step::new(buf, host, instrument, &mut segs);
        self.layers_of_step(&mut step, ids, obs)?;
        self.last_logits(&mut step, logits);
        drop(segs);
        // A failed step leaves every sequence where it was: its keys are not kept.
        if let Some(fault) = self.backend.fault() {
            return Err(EngineError::Backend(fault));
        }
        for it in items.iter_mut() {
            it.state.pos += it.tokens.len();
            it.state.after_step(&self.backend, self.recurrent_floats(), it.tokens.len());
        }
        if let Some(ins) = instrument.as_mut() {
            ins.end(t0.elapsed().as_secs_f64() * 1e3, self.experts.stats());
        }
        Ok(logits)
    }
}
