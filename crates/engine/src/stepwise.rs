//! A generation advanced one forward step at a time by its caller: what
//! [`Engine::generate`] does between forward calls (sampling, stop ids and strings,
//! detokenizing, limits, timings), apart from the calls themselves, so that a scheduler can
//! run the forward steps of many generations as batches ([`Model::forward_batch`]).
//!
//! [`Model::forward_batch`]: crate::Model::forward_batch

use crate::backend::Backend;
use crate::forward::State;
use crate::generate::{Engine, FinishReason, GenOptions, GenStats, Generation};
use crate::sampler::Sampler;
use crate::EngineError;
use smoe_text::{Constraint, Detokenizer, StopStrings};
use std::time::Instant;

/// One generation between forward steps: [`input`](Self::input) says which tokens the next
/// step must run for it, [`advance`](Self::advance) takes that step's logits.
pub struct Stepwise {
    opts: GenOptions,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    detok: Detokenizer,
    stops: StopStrings,
    /// The grammar the reply is held to.
    constraint: Option<Constraint>,
    /// Prompt, then the generated tokens.
    context: Vec<u32>,
    prompt_len: usize,
    /// Tokens of `context` whose keys and values are in the sequence's state.
    fed: usize,
    /// Prompt tokens that were already cached when it started.
    cached: usize,
    tokens: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    logits: Vec<f32>,
    prompt_logits: Option<Vec<f32>>,
    t0: Instant,
    prefill_seconds: Option<f64>,
    ttft: Option<f64>,
    t_decode: Option<Instant>,
    /// Milliseconds the latest [`advance`](Self::advance) spent sampling.
    pub sampling_ms: f64,
    /// A prompt position a prefill step must stop at ([`keep_state_at`](Self::keep_state_at)).
    stop_at: Option<usize>,
}

impl Stepwise {
    /// Starts generating after `prompt` on `st`, which may already hold a prefix of it
    /// (prefix reuse): only the rest is run, but always at least the last prompt token, whose
    /// logits start the generation. Makes room in the state's cache for the whole generation.
    pub fn start<B: Backend>(engine: &Engine<B>, st: &mut State<B>, prompt: &[u32], opts: &GenOptions) -> Result<Stepwise, EngineError> {
        opts.sampling.validate().map_err(EngineError::Input)?;
        if prompt.is_empty() {
            return Err(EngineError::Input("the prompt is empty".into()));
        }
        if prompt.len() >= opts.ctx {
            return Err(EngineError::Input(format!("prompt is {} tokens; the context limit is {}", prompt.len(), opts.ctx)));
        }
        let vocab = engine.model.arch().vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        // From here: the time to first token includes compiling the grammar (and, where the
        // server has not done it while preparing, indexing the vocabulary).
        let t0 = Instant::now();
        let constraint = opts.grammar.as_ref().map(|g| engine.constraint(g, opts.grammar_after.as_deref())).transpose()?;
        // Where the state resumes: a model that cannot cut its cache back that far (recurrent
        // states, dropped rows) starts earlier, and the rest of the prompt runs from there.
        st.truncate(st.pos().min(prompt.len() - 1));
        let cached = st.pos();
        engine.model.reserve(st, prompt.len().saturating_add(opts.max_tokens).min(opts.ctx));
        Ok(Stepwise {
            sampler: Sampler::new(opts.sampling.clone()),
            stop_ids: opts.stop_ids.clone().unwrap_or_else(|| engine.default_stop_ids()),
            detok: Detokenizer::new(engine.tokenizer.clone(), !engine.harmony()),
            stops: StopStrings::new(&opts.stop),
            constraint,
            opts: opts.clone(),
            context: prompt.to_vec(),
            prompt_len: prompt.len(),
            fed: cached,
            cached,
            tokens: Vec::new(),
            text: String::new(),
            finish: None,
            logits: Vec::new(),
            prompt_logits: None,
            t0,
            prefill_seconds: None,
            ttft: None,
            t_decode: None,
            sampling_ms: 0.0,
            stop_at: None,
        })
    }

    /// The tokens the next forward step must run for this generation: the rest of the prompt
    /// (a step may run only its first part: chunked prefill), or the latest sampled token.
    /// Empty once finished.
    pub fn input(&self) -> &[u32] {
        if self.finish.is_some() {
            &[]
        } else {
            let end = self.stop_at.filter(|&p| p > self.fed).unwrap_or(self.context.len());
            &self.context[self.fed..end]
        }
    }

    /// Keeps the sequence's recurrent states at prompt position `pos` (a model with Gated
    /// DeltaNet layers; nothing for others): a prefill step stops there, and the states are
    /// copied as it ends ([`Model::keep_state_at`](crate::Model::keep_state_at)), so that
    /// other prompts sharing the first `pos` tokens (the same system prompt and tools) can start
    /// from them instead of from nothing. A position outside what is left of the prompt is
    /// ignored (one already run is kept only if the sequence stands there now).
    pub fn keep_state_at<B: Backend>(&mut self, engine: &Engine<B>, st: &mut State<B>, pos: usize) {
        if st.recurrent.is_empty() || pos < self.fed || pos >= self.prompt_len {
            return;
        }
        engine.model.keep_state_at(st, pos);
        if pos > self.fed {
            self.stop_at = Some(pos);
        }
    }

    /// Whether the prompt is still being run.
    pub fn prefilling(&self) -> bool {
        self.fed < self.prompt_len
    }

    /// Tokens of the prompt and of the reply so far.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// Whether it has finished.
    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Ends it now (the client went away, say); [`finish`](Self::finish) then reports `reason`.
    pub fn stop(&mut self, reason: FinishReason) {
        self.finish.get_or_insert(reason);
    }

    /// Takes a forward step that ran the first `ran` tokens of [`input`](Self::input) and
    /// gave `logits` (`[vocab]`, at the last of them). Once the prompt is in, samples the next
    /// token and hands its text to `on_token(id, text)` (returning `false` cancels). Returns
    /// whether the generation has finished.
    pub fn advance(&mut self, ran: usize, logits: &[f32], on_token: &mut dyn FnMut(u32, &str) -> bool) -> bool {
        self.sampling_ms = 0.0;
        self.fed = (self.fed + ran).min(self.context.len());
        if self.finish.is_some() || self.fed < self.context.len() {
            return self.finish.is_some();
        }
        if self.prefill_seconds.is_none() {
            self.prefill_seconds = Some(self.t0.elapsed().as_secs_f64());
            self.t_decode = Some(Instant::now());
            if self.opts.keep_prompt_logits {
                self.prompt_logits = Some(logits.to_vec());
            }
        }
        if self.at_limit() {
            self.finish = Some(FinishReason::Length);
            return true;
        }
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        let ts = Instant::now();
        // A constrained reply ends at any of its end ids, which the grammar allows only once
        // it is complete. A grammar that fails (it allows no token: llguidance gave up) ends
        // it too, said in the log: the reply is returned as far as it got.
        if let Some(Err(e)) = self.constraint.as_mut().map(|c| c.mask(&mut self.logits)) {
            tracing::warn!("constrained reply ended after {} tokens: {e}", self.tokens.len());
            self.finish = Some(FinishReason::Stop);
            return true;
        }
        let id = self.sampler.sample(&mut self.logits, &self.context, self.tokens.len());
        self.sampling_ms = ts.elapsed().as_secs_f64() * 1e3;
        self.ttft.get_or_insert_with(|| self.t0.elapsed().as_secs_f64());
        if self.stop_ids.contains(&id) || self.constraint.as_ref().is_some_and(|c| c.ends_with(id)) {
            self.finish = Some(FinishReason::Stop);
            return true;
        }
        self.tokens.push(id);
        self.context.push(id);
        let piece = self.detok.push(id);
        if let Some(c) = &mut self.constraint {
            if let Err(e) = c.commit(id, &piece) {
                tracing::warn!("constrained reply ended after {} tokens: {e}", self.tokens.len());
                self.finish = Some(FinishReason::Stop);
            }
        }
        let (out, stopped) = self.stops.push(&piece);
        self.text.push_str(&out);
        if !on_token(id, &out) {
            self.finish = Some(FinishReason::Cancelled);
        } else if stopped {
            self.finish = Some(FinishReason::Stop);
        } else if self.at_limit() {
            self.finish = Some(FinishReason::Length);
        }
        self.finish.is_some()
    }

    fn at_limit(&self) -> bool {
        self.tokens.len() >= self.opts.max_tokens || self.context.len() >= self.opts.ctx
    }

    /// The result: text held back by the detokenizer or a possible stop string is flushed
    /// to `on_token(u32::MAX, text)` unless a stop ended it.
    pub fn finish(mut self, on_token: &mut dyn FnMut(u32, &str) -> bool) -> Generation {
        let finish = self.finish.unwrap_or(FinishReason::Length);
        if finish != FinishReason::Stop {
            let (tail, _) = self.stops.push(&self.detok.flush());
            let tail = tail + &self.stops.flush();
            if !tail.is_empty() {
                self.text.push_str(&tail);
                on_token(u32::MAX, &tail);
            }
        }
        let total = self.t0.elapsed().as_secs_f64();
        let prefill_seconds = self.prefill_seconds.unwrap_or(total);
        let ttft = self.ttft.unwrap_or(prefill_seconds);
        let stats = GenStats {
            prompt_tokens: self.prompt_len,
            prefilled_tokens: self.prompt_len - self.cached,
            generated_tokens: self.tokens.len(),
            ttft_seconds: ttft,
            prefill_seconds,
            decode_seconds: self.t_decode.map_or(0.0, |t| t.elapsed().as_secs_f64()) - (ttft - prefill_seconds),
            seed: self.sampler.seed(),
        };
        let stop_string = self.stops.matched().map(str::to_string);
        Generation { tokens: self.tokens, text: self.text, finish, stats, prompt_logits: self.prompt_logits, stop_string }
    }
}
