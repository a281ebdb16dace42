//! Conversations that keep their KV cache: a new turn computes only the tokens that differ from
//! what is cached.

use crate::backend::Backend;
use crate::forward::{Observer, State};
use crate::generate::{Engine, GenOptions, Generation};
use crate::stepwise::Stepwise;
use crate::{EngineError, Model};
use serde_json::{json, Map, Value as Json};

/// One sequence's tokens and the KV cache that holds them. [`Session::generate`] finds the
/// longest common prefix of a new prompt with the cached tokens and prefills only the rest.
pub struct Session<B: Backend> {
    state: State<B>,
    /// Tokens whose keys and values are in `state`: always `state.pos()` long.
    cached: Vec<u32>,
}

impl<B: Backend> Session<B> {
    /// An empty session for `model`, prefilling its chunk of tokens at a time
    /// ([`Model::prefill_chunk`]).
    pub fn new(model: &Model<B>) -> Session<B> {
        Session { state: model.new_state(model.prefill_chunk()), cached: Vec::new() }
    }

    /// An empty session that only ever runs in [`Batch`](crate::Batch)es (a server's, through
    /// [`Session::start`] and [`Session::state_mut`]): without buffers of its own for a
    /// prefill chunk (for a model of 152K tokens' vocabulary, [`Session::new`]'s logits buffer
    /// alone is 148 MiB of address space, touched wherever the allocator hands back reused
    /// memory: a server creating and dropping sessions under memory pressure paid for it).
    pub fn batched(model: &Model<B>) -> Session<B> {
        Session { state: model.new_state(1), cached: Vec::new() }
    }

    /// A session holding the first `positions` tokens of `other`'s cache (or fewer, for a model
    /// with recurrent states: see [`State::copy_prefix`]), copied, with buffers for `other`'s
    /// prefill chunk; `None` where the backend cannot copy a KV cache.
    pub fn fork(model: &Model<B>, other: &Session<B>, positions: usize) -> Option<Session<B>> {
        let positions = positions.min(other.cached.len());
        let mut s = Session { state: model.new_state(other.state.chunk()), cached: Vec::new() };
        // A model with recurrent states may start short of `positions` (see `copy_prefix`).
        s.state.copy_prefix(model, &other.state, positions).then(|| {
            s.cached.extend_from_slice(&other.cached[..s.state.pos()]);
            s
        })
    }

    /// The tokens in the cache.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Bytes of KV cache this session holds (with Gated DeltaNet layers' states, which are
    /// the same size at any length, and their saved copies).
    pub fn kv_bytes(&self, model: &Model<B>) -> usize {
        model.backend().kv_bytes(self.state.kv()) + self.state.recurrent_bytes(model.recurrent_floats())
    }

    /// Gives back the KV memory beyond the positions held (see [`Backend::kv_shrink`]): for a
    /// session kept for a later turn, whose last request reserved room for its whole reply.
    pub fn shrink(&mut self, model: &Model<B>) {
        let pos = self.state.pos();
        model.backend().kv_shrink(&mut self.state.kv, pos);
    }

    /// How many leading tokens of `prompt` are already cached.
    pub fn common_prefix(&self, prompt: &[u32]) -> usize {
        self.cached.iter().zip(prompt).take_while(|(a, b)| a == b).count()
    }

    /// How many leading tokens of `prompt` this session would continue from: its
    /// [`common_prefix`](Self::common_prefix), or less where its cache cannot be cut back that
    /// far (a model that drops old rows, or keeps recurrent states: see [`State::truncate`]).
    pub fn resumable_prefix(&self, prompt: &[u32]) -> usize {
        self.state.truncate_point(self.common_prefix(prompt))
    }

    /// Forgets everything.
    pub fn reset(&mut self) {
        self.state.truncate(0);
        self.cached.clear();
    }

    /// The state (for instrumentation).
    pub fn state_mut(&mut self) -> &mut State<B> {
        &mut self.state
    }

    /// Starts a generation of `prompt` to be run step by step (a batch scheduler runs the
    /// forward steps on [`state_mut`](Self::state_mut)), reusing the cached prefix it shares
    /// with earlier turns. [`record`](Self::record) afterwards, whatever happened.
    pub fn start(&mut self, engine: &Engine<B>, prompt: &[u32], opts: &GenOptions) -> Result<Stepwise, EngineError> {
        let keep = self.common_prefix(prompt);
        self.state.truncate(keep);
        // A model that drops old rows may have started over.
        self.cached.truncate(self.state.pos());
        Stepwise::start(engine, &mut self.state, prompt, opts)
    }

    /// After a generation from [`start`](Self::start), finished or failed: the cache holds
    /// the first `pos` tokens of `context` (its prompt, then the tokens generated), the keys and
    /// values of every forward step that completed.
    pub fn record(&mut self, context: &[u32]) {
        let pos = self.state.pos().min(context.len());
        self.state.truncate(pos);
        self.cached.clear();
        self.cached.extend_from_slice(&context[..self.state.pos()]);
    }

    /// Generates after `prompt`, reusing the cached prefix it shares with earlier turns.
    pub fn generate(
        &mut self,
        engine: &Engine<B>,
        prompt: &[u32],
        opts: &GenOptions,
        obs: &mut dyn Observer,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Generation, EngineError> {
        let keep = self.common_prefix(prompt);
        self.state.truncate(keep);
        // A model that drops old rows may have started over.
        self.cached.truncate(self.state.pos());
        let keep = self.state.pos();
        let result = engine.generate(&mut self.state, prompt, opts, obs, on_token);
        // Whatever happened, the cache holds the first `pos` tokens of prompt + generated.
        let pos = self.state.pos();
        match &result {
            Ok(g) => {
                self.cached = prompt.iter().chain(&g.tokens).copied().take(pos).collect();
            }
            Err(_) => {
                // A failed forward leaves the cache in an unknown state past the reused prefix.
                self.state.truncate(keep);
                self.cached.truncate(self.state.pos());
            }
        }
        result
    }
}

/// The field of an assistant message that holds the token ids the model generated for it.
/// Chat templates ignore it; `/save` keeps it, so a loaded conversation continues on the same
/// tokens.
pub const TOKEN_IDS_KEY: &str = "smoe_token_ids";

/// Renders `messages` with the chat template (generation prompt added) and tokenizes the text.
///
/// Assistant messages whose exact generated ids are known — in their [`TOKEN_IDS_KEY`] field, or
/// from `known(content)` (a server's memory of its recent replies) — keep those ids rather
/// than a re-tokenization of their text, which can differ (BPE splits, bytes of broken UTF-8):
/// the prompt then extends a cached conversation token for token, and only the new turn is
/// prefilled. Ids are used only where they decode to the content and the template printed the
/// content verbatim; anything else is tokenized as text.
pub fn tokenize_chat<B: Backend>(
    engine: &Engine<B>,
    messages: &[Json],
    tools: Option<&[Json]>,
    kwargs: &Map<String, Json>,
    known: &dyn Fn(&str) -> Option<Vec<u32>>,
) -> Result<(String, Vec<u32>), EngineError> {
    let text = engine.render_chat(messages, tools, kwargs)?;
    // `pos`: text tokenized so far; `seen`: where the previous message's content ended.
    let (mut ids, mut pos, mut seen) = (Vec::new(), 0, 0);
    for m in messages {
        let Some(content) = m["content"].as_str().filter(|c| !c.is_empty()) else { continue };
        // Messages appear in order; a template that rewrites one (stripping reasoning, say) just
        // leaves it to ordinary tokenization.
        let Some(at) = text[seen..].find(content).map(|a| a + seen) else { continue };
        seen = at + content.len();
        if m["role"] != "assistant" {
            continue;
        }
        let generated = m.get(TOKEN_IDS_KEY).and_then(|v| serde_json::from_value::<Vec<u32>>(v.clone()).ok()).or_else(|| known(content));
        match generated {
            Some(g) if engine.tokenizer.decode(&g, true) == content => {
                ids.extend(engine.encode(&text[pos..at])?);
                ids.extend(g);
                pos = at + content.len();
            }
            _ => {}
        }
    }
    ids.extend(engine.encode(&text[pos..])?);
    Ok((text, ids))
}

/// Where the part of a chat prompt that other conversations share ends: the tokens before the
/// first message that is not the system's (or developer's) content — the system prompt, the
/// tool schemas and the next turn's header — as a count of leading `ids` (the prompt
/// [`tokenize_chat`] made of `text`). `None` when the chat opens with no such message. A
/// model with recurrent states keeps its states there ([`Stepwise::keep_state_at`]), so that a
/// new conversation with the same system prompt starts from them.
pub fn shared_chat_prefix<B: Backend>(engine: &Engine<B>, messages: &[Json], text: &str, ids: &[u32]) -> Option<usize> {
    let mut seen = 0;
    for m in messages {
        let content = m["content"].as_str().filter(|c| !c.is_empty());
        let at = content.and_then(|c| text[seen..].find(c).map(|a| a + seen));
        if !matches!(m["role"].as_str(), Some("system" | "developer")) {
            // Tokenized alone, the text before it may end in another token than inside the
            // whole prompt: only the tokens both agree on count.
            let head = engine.encode(&text[..at?]).ok()?;
            let n = head.iter().zip(ids).take_while(|(a, b)| a == b).count();
            return (n > 0).then_some(n);
        }
        if let (Some(a), Some(c)) = (at, content) {
            seen = a + c.len();
        }
    }
    None
}

/// What a conversation does when its next prompt would not fit the context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// Drop the oldest user/assistant messages (never the system prompt) until it fits.
    DropOldest,
    /// Refuse the turn.
    Refuse,
}

/// A chat: system prompt, messages, template options, and a [`Session`] with their KV cache.
pub struct Conversation<B: Backend> {
    /// The system prompt, if any.
    pub system: Option<String>,
    /// User and assistant messages, oldest first (OpenAI-style objects).
    pub messages: Vec<Json>,
    /// Chat template kwargs (such as `enable_thinking`).
    pub kwargs: Map<String, Json>,
    /// What to do when a prompt would not fit the context.
    pub overflow: Overflow,
    session: Session<B>,
}

/// One turn's outcome.
pub struct Turn {
    /// The generation.
    pub generation: Generation,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The rendered prompt text.
    pub prompt_text: String,
    /// Messages dropped from the front to fit the context.
    pub dropped_messages: usize,
}

impl<B: Backend> Conversation<B> {
    /// An empty conversation.
    pub fn new(model: &Model<B>, system: Option<String>) -> Conversation<B> {
        Conversation { system, messages: vec![], kwargs: Map::new(), overflow: Overflow::DropOldest, session: Session::new(model) }
    }

    /// The session under the conversation.
    pub fn session(&mut self) -> &mut Session<B> {
        &mut self.session
    }

    /// Forgets the messages (the system prompt stays).
    pub fn reset(&mut self) {
        self.messages.clear();
    }

    /// All messages the template sees, the system prompt first.
    pub fn transcript(&self) -> Vec<Json> {
        let sys = self.system.iter().map(|s| json!({"role": "system", "content": s}));
        sys.chain(self.messages.iter().cloned()).collect()
    }

    /// Renders and tokenizes the transcript with a generation prompt (see [`tokenize_chat`]).
    pub fn render(&self, engine: &Engine<B>) -> Result<(String, Vec<u32>), EngineError> {
        tokenize_chat(engine, &self.transcript(), None, &self.kwargs, &|_| None)
    }

    /// Adds the user message `text`, fits the transcript to the context (see [`Overflow`]),
    /// generates the reply and records it. The context must leave room for
    /// `min(max_tokens, ctx / 4)` generated tokens. On error the conversation is unchanged.
    pub fn turn(
        &mut self,
        engine: &Engine<B>,
        text: &str,
        opts: &GenOptions,
        obs: &mut dyn Observer,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Turn, EngineError> {
        let saved = self.messages.clone();
        self.messages.push(json!({"role": "user", "content": text}));
        let room = opts.max_tokens.min(opts.ctx / 4).max(1);
        let mut dropped = 0;
        let (prompt_text, prompt) = loop {
            let (t, ids) = match self.render(engine) {
                Ok(r) => r,
                Err(e) => {
                    self.messages = saved;
                    return Err(e);
                }
            };
            if ids.len() + room <= opts.ctx {
                break (t, ids);
            }
            // Drop whole exchanges from the front, keeping the new user message.
            if self.overflow == Overflow::Refuse || self.messages.len() <= 1 {
                let n = ids.len();
                self.messages = saved;
                return Err(EngineError::Input(format!(
                    "the conversation is {n} tokens and the context is {} (with room for {room} new tokens){}",
                    opts.ctx,
                    if self.overflow == Overflow::Refuse { "" } else { ": even the new message alone does not fit" }
                )));
            }
            let cut = self.messages.iter().skip(1).position(|m| m["role"] == "user").map_or(1, |i| i + 1);
            let cut = cut.min(self.messages.len() - 1);
            self.messages.drain(..cut);
            dropped += cut;
        };
        match self.session.generate(engine, &prompt, opts, obs, on_token) {
            Ok(g) => {
                if engine.harmony() {
                    // The raw text holds harmony's channel markers; the template writes them
                    // itself around the answer (and drops past reasoning).
                    let reply = smoe_text::ReplyParser::with_syntax(&prompt_text, false, smoe_text::CallSyntax::Harmony).parse(&g.text);
                    self.messages.push(json!({"role": "assistant", "content": reply.content}));
                } else {
                    self.messages.push(json!({"role": "assistant", "content": g.text, TOKEN_IDS_KEY: g.tokens}));
                }
                Ok(Turn { generation: g, prompt, prompt_text, dropped_messages: dropped })
            }
            Err(e) => {
                self.messages = saved;
                Err(e)
            }
        }
    }
}
