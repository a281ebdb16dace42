//! Text generation: a model with its tokenizer, chat template and generation defaults, and the
//! loop that prefills a prompt and samples until a stop condition.

use crate::backend::Backend;
use crate::forward::{Logits, NoObserver, Observer, State};
use crate::sampler::{SamplingParams, SamplingRequest};
use crate::stepwise::Stepwise;
use crate::{EngineError, Model};
use serde_json::Value as Json;
use smoe_text::{ChatTemplate, ConstraintVocab, OutputGrammar, Tokenizer};
use smoe_vault::{GenerationDefaults, Manifest, Vault};
use std::sync::{Arc, OnceLock};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The caller asked to stop (client gone, Ctrl-C).
    Cancelled,
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Extra stop strings.
    pub stop: Vec<String>,
    /// Token ids that end generation (defaults to the model's eos ids).
    pub stop_ids: Option<Vec<u32>>,
    /// Context limit in tokens (prompt + generated).
    pub ctx: usize,
    /// Return the logits after the prompt (those the first token is sampled from).
    pub keep_prompt_logits: bool,
    /// A grammar the reply is held to (structured output, required tool calls).
    pub grammar: Option<OutputGrammar>,
    /// Text after which the grammar applies (`</think>` for a reply that starts in reasoning).
    pub grammar_after: Option<String>,
}

impl GenOptions {
    /// Up to `max_tokens` with `sampling` in a context of `ctx`: the model's stop ids, no stop
    /// strings, no grammar. The other fields are set by struct update where needed.
    pub fn new(max_tokens: usize, sampling: SamplingParams, ctx: usize) -> GenOptions {
        GenOptions {
            max_tokens,
            sampling,
            stop: Vec::new(),
            stop_ids: None,
            ctx,
            keep_prompt_logits: false,
            grammar: None,
            grammar_after: None,
        }
    }
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenStats {
    /// Prompt tokens in total.
    pub prompt_tokens: usize,
    /// Prompt tokens actually computed (the rest came from the cache).
    pub prefilled_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Seconds from start to the first generated token.
    pub ttft_seconds: f64,
    /// Seconds spent in prefill.
    pub prefill_seconds: f64,
    /// Seconds spent generating after the first token.
    pub decode_seconds: f64,
    /// The sampler seed (reproduces the run).
    pub seed: u64,
}

impl GenStats {
    /// Prefill throughput.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prefilled_tokens as f64 / self.prefill_seconds.max(1e-9)
    }
    /// Decode throughput (tokens after the first).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids (the stop token excluded).
    pub tokens: Vec<u32>,
    /// Generated text (stop string excluded).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Timings.
    pub stats: GenStats,
    /// The logits after the prompt, when [`GenOptions::keep_prompt_logits`] asked for them.
    pub prompt_logits: Option<Vec<f32>>,
    /// The stop string that ended generation, if one did.
    pub stop_string: Option<String>,
}

/// A model ready to generate text.
pub struct Engine<B: Backend> {
    /// The model.
    pub model: Model<B>,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// generation_config.json defaults.
    pub defaults: GenerationDefaults,
    /// The context limit it was opened for (tokens).
    pub ctx: usize,
    /// Its vocabulary indexed for constrained output, built by the first request that needs it.
    constraint_vocab: OnceLock<Result<Arc<ConstraintVocab>, String>>,
}

impl<B: Backend> Engine<B> {
    /// Wraps `model` with the text assets of `vault`.
    pub fn new(vault: &Vault, model: Model<B>) -> Result<Engine<B>, EngineError> {
        Engine::from_manifest(vault.manifest(), model)
    }

    /// Wraps `model` with the text assets and generation defaults of `manifest`.
    pub fn from_manifest(manifest: &Manifest, model: Model<B>) -> Result<Engine<B>, EngineError> {
        let t = &manifest.text;
        let tokenizer = Tokenizer::from_json(&t.tokenizer_json).map_err(|e| EngineError::Text(e.to_string()))?;
        let template = match &t.chat_template {
            Some(src) => {
                Some(ChatTemplate::new(src, t.bos_token.as_deref(), t.eos_token.as_deref()).map_err(|e| EngineError::Text(e.to_string()))?)
            }
            None => None,
        };
        let ctx = manifest.architecture.max_position_embeddings;
        Ok(Engine { model, tokenizer, template, defaults: manifest.generation.clone(), ctx, constraint_vocab: OnceLock::new() })
    }

    /// Renders a conversation with the chat template (generation prompt added).
    pub fn render_chat(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        kwargs: &serde_json::Map<String, Json>,
    ) -> Result<String, EngineError> {
        let t = self.template.as_ref().ok_or_else(|| EngineError::Text("this model has no chat template; use a raw prompt".into()))?;
        t.render(messages, tools, true, kwargs).map_err(|e| EngineError::Text(e.to_string()))
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text).map_err(|e| EngineError::Text(e.to_string()))
    }

    /// Ids that end generation by default: generation_config's eos ids, else the eos token.
    /// A harmony model (gpt-oss) also stops at `<|return|>` and `<|call|>`, which end its
    /// answer and its tool calls, whatever its generation_config (or GGUF) lists.
    pub fn default_stop_ids(&self) -> Vec<u32> {
        let mut ids = self.defaults.eos_token_ids.clone();
        if ids.is_empty() {
            if let Some(id) = self.tokenizer.token_id("<|im_end|>").or_else(|| self.tokenizer.token_id("<|endoftext|>")) {
                ids.push(id);
            }
        }
        if self.harmony() {
            for id in ["<|return|>", "<|call|>"].iter().filter_map(|t| self.tokenizer.token_id(t)) {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// The vocabulary indexed for constrained output (built once, on first use: a trie of
    /// every token, 0.44 s for a 150K vocabulary on two cores). A constrained reply may end
    /// with any default stop id.
    pub fn constraint_vocab(&self) -> Result<Arc<ConstraintVocab>, EngineError> {
        self.constraint_vocab
            .get_or_init(|| {
                ConstraintVocab::new(&self.tokenizer, self.model.arch().vocab_size, &self.default_stop_ids())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| EngineError::Input(format!("constrained output is not available for this model: {e}")))
    }

    /// `grammar` compiled for this model's vocabulary, applying after `after` when given. The
    /// server calls it while preparing a request, off the generation thread, so that a schema
    /// that cannot be held is a 400 before anything streams and the first request's indexing
    /// of the vocabulary does not stall other generations; a generation compiles its own again
    /// (cheap once the vocabulary is indexed).
    pub fn constraint(&self, grammar: &OutputGrammar, after: Option<&str>) -> Result<smoe_text::Constraint, EngineError> {
        self.constraint_vocab()?.start(grammar, after).map_err(|e| EngineError::Input(e.to_string()))
    }

    /// The tool-call syntax the chat template teaches its model (the default without one).
    pub fn call_syntax(&self) -> smoe_text::CallSyntax {
        self.template.as_ref().map(|t| t.call_syntax()).unwrap_or_default()
    }

    /// Whether the chat template speaks harmony (gpt-oss): its replies are then detokenized
    /// with special tokens, which carry the channels the reply parser splits on.
    pub fn harmony(&self) -> bool {
        self.call_syntax() == smoe_text::CallSyntax::Harmony
    }

    /// Sampling defaults from generation_config.json (greedy if it does not ask for sampling).
    pub fn default_sampling(&self) -> SamplingParams {
        SamplingParams::from_defaults(&self.defaults)
    }

    /// The sampling settings for `request`: what it asks for over this model's defaults.
    pub fn sampling(&self, request: &SamplingRequest) -> SamplingParams {
        request.resolve(&self.defaults)
    }

    /// Generates after `prompt`. The state may already hold a prefix of `prompt` in its cache
    /// (prefix reuse): only the rest is computed. `on_token(id, text)` sees each token and the
    /// text it completes; returning `false` cancels.
    pub fn generate(
        &self,
        st: &mut State<B>,
        prompt: &[u32],
        opts: &GenOptions,
        obs: &mut dyn Observer,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Generation, EngineError> {
        let mut g = Stepwise::start(self, st, prompt, opts)?;
        while !g.finished() {
            let n = g.input().len();
            let logits = self.model.forward(st, g.input(), Logits::Last, obs)?;
            g.advance(n, logits, on_token);
            if let Some(ins) = st.instrument.as_mut().filter(|_| g.sampling_ms > 0.0) {
                ins.add_sampling(g.sampling_ms);
            }
        }
        Ok(g.finish(on_token))
    }

    /// [`generate`](Self::generate) from an empty state (prefilling the model's chunk of tokens at a
    /// time, [`Model::prefill_chunk`]), observing nothing.
    pub fn generate_fresh(
        &self,
        prompt: &[u32],
        opts: &GenOptions,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Generation, EngineError> {
        let mut st = self.model.new_state(self.model.prefill_chunk());
        self.generate(&mut st, prompt, opts, &mut NoObserver, on_token)
    }
}
