//! Running one request's generation on its model's worker: prepare (load the model, render and
//! tokenize off the async runtime), submit, then collect or stream the events.

use crate::error::ApiError;
use crate::fleet::Fleet;
use crate::params::check_length;
use crate::worker::{Event, Finished, Job, Worker};
use rand::Rng;
use serde_json::{Map, Value as Json};
use smoe_engine::{GenOptions, LoadedModel};
use smoe_text::{OutputGrammar, Piece, Reply, ReplyParser};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What the prompt is.
pub enum PromptSpec {
    /// A conversation for the chat template.
    Chat {
        /// Messages (OpenAI-style objects).
        messages: Vec<Json>,
        /// Tools offered to the model, if any.
        tools: Option<Vec<Json>>,
        /// Template kwargs.
        kwargs: Map<String, Json>,
        /// What the reply must be.
        shape: Shape,
    },
    /// Raw text, no template.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// The parts of a chat request that need no model (what the fuzz targets parse).
pub struct ChatParts {
    /// Messages as the chat template takes them.
    pub messages: Vec<Json>,
    /// Tools offered, if any (none when `tool_choice` is none).
    pub tools: Option<Vec<Json>>,
    /// What the reply must be.
    pub shape: Shape,
}

/// What a chat reply must be, when the request says (structured output).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Shape {
    /// Whatever the model writes.
    #[default]
    Free,
    /// JSON matching this schema (`response_format`).
    Json(Json),
    /// A tool call: to any offered tool (`None`: OpenAI's `required`, Anthropic's `any`) or to
    /// the one named; several in a row unless `parallel` is false (OpenAI's
    /// `parallel_tool_calls`, Anthropic's `disable_parallel_tool_use`).
    Call {
        /// The tool that must be called, if one is named.
        name: Option<String>,
        /// Whether several calls may follow one another.
        parallel: bool,
    },
}

impl Shape {
    /// The grammar for a reply in `syntax`, given the tools the prompt kept (OpenAI-style
    /// `{"type": "function", "function": …}` objects).
    fn grammar(self, tools: Option<&[Json]>, syntax: smoe_text::CallSyntax) -> Result<Option<OutputGrammar>, ApiError> {
        Ok(match self {
            Shape::Free => None,
            Shape::Json(schema) => Some(OutputGrammar::Json(schema)),
            Shape::Call { name, parallel } => {
                let functions: Vec<Json> = tools
                    .unwrap_or_default()
                    .iter()
                    .map(|t| t["function"].clone())
                    .filter(|f| name.as_ref().is_none_or(|n| f["name"] == n.as_str()))
                    .collect();
                if functions.is_empty() {
                    return Err(ApiError::bad_param(
                        "tool_choice",
                        match name {
                            Some(n) => format!("tool_choice names {n:?}, which is not among the tools"),
                            None => "tool_choice requires a tool call but no tools were given".into(),
                        },
                    ));
                }
                Some(OutputGrammar::ToolCalls { tools: functions, syntax, parallel })
            }
        })
    }
}

/// A request ready to run.
pub struct Prepared {
    /// The model's worker.
    pub worker: Arc<Worker>,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Rendered prompt text (decides whether the reply starts in reasoning).
    pub prompt_text: String,
    /// Options.
    pub opts: GenOptions,
    /// Whether tools were offered (tool calls are parsed only then).
    pub tools: bool,
    /// Whether the reply is a chat reply (reasoning and tool calls are split out) or raw text.
    pub chat: bool,
    /// How the model writes tool calls.
    pub calls: smoe_text::CallSyntax,
    /// For a model with recurrent states: the prompt position where the part other chats share
    /// ends (system prompt and tools), where its states are kept for them.
    pub keep_at: Option<usize>,
}

/// Loads the model, builds the options with `options(engine)` and tokenizes the prompt.
pub async fn prepare(
    fleet: Arc<Fleet>,
    model: String,
    spec: PromptSpec,
    options: impl FnOnce(&dyn LoadedModel) -> Result<GenOptions, ApiError> + Send + 'static,
) -> Result<Prepared, ApiError> {
    tokio::task::spawn_blocking(move || {
        let worker = fleet.get(&model)?;
        // Before the request can grow a cache: a limit lowered since the last check is met
        // by shrinking first (see `crate::memory`).
        fleet.fit_to_memory();
        let engine = &*worker.engine;
        let mut opts = options(engine)?;
        let bad = |e: smoe_engine::EngineError| ApiError::bad_request(e.to_string());
        let chat = matches!(spec, PromptSpec::Chat { .. });
        let mut keep_at = None;
        let (prompt_text, prompt, tools) = match spec {
            PromptSpec::Chat { messages, tools, kwargs, shape } => {
                let known = |c: &str| worker.recent.get(c);
                let (t, ids) = engine.tokenize_chat(&messages, tools.as_deref(), &kwargs, &known).map_err(bad)?;
                // Tool schemas that crowd out the conversation (Open WebUI sends ~36 of them, 13K
                // tokens, with every chat by default) are dropped when the conversation alone
                // fits: a reply without tools rather than an error. Said in the log.
                let room = |n: usize| opts.ctx.saturating_sub(n);
                let enough = opts.ctx / 8;
                let kept = match &tools {
                    Some(list) if room(ids.len()) < enough => {
                        let (t2, ids2) = engine.tokenize_chat(&messages, None, &kwargs, &known).map_err(bad)?;
                        if room(ids2.len()) >= enough {
                            tracing::warn!(
                                "{model}: {} tool schemas dropped: with them the prompt is {} of the {}-token context, without them {}",
                                list.len(),
                                ids.len(),
                                opts.ctx,
                                ids2.len()
                            );
                            // A reply that must call a tool cannot do without them.
                            if matches!(shape, Shape::Call { .. }) {
                                return Err(ApiError::bad_param(
                                    "tool_choice",
                                    format!(
                                        "tool_choice requires a tool call, but with the {} tool schemas the prompt is {} tokens of this model's {}-token context",
                                        list.len(),
                                        ids.len(),
                                        opts.ctx
                                    ),
                                ));
                            }
                            (t2, ids2, false)
                        } else {
                            (t, ids, true)
                        }
                    }
                    _ => (t, ids, tools.is_some()),
                };
                if engine.architecture().linear_attention.is_some() {
                    keep_at = engine.shared_chat_prefix(&messages, &kept.0, &kept.1);
                }
                let param = if matches!(shape, Shape::Json(_)) { "response_format" } else { "tool_choice" };
                opts.grammar = shape.grammar(kept.2.then_some(tools.as_deref()).flatten(), engine.call_syntax())?;
                if let Some(g) = &opts.grammar {
                    opts.grammar_after = smoe_text::grammar_starts_after(&kept.0, engine.call_syntax()).map(str::to_string);
                    engine.check_grammar(g, opts.grammar_after.as_deref()).map_err(|e| ApiError::bad_param(param, e.to_string()))?;
                }
                kept
            }
            PromptSpec::Text(t) => {
                let ids = engine.encode(&t).map_err(bad)?;
                (t, ids, false)
            }
            PromptSpec::Ids(ids) => {
                let vocab = engine.architecture().vocab_size;
                if let Some(b) = ids.iter().find(|&&i| i as usize >= vocab) {
                    return Err(ApiError::bad_param("prompt", format!("token id {b} is outside the vocabulary of {vocab}")));
                }
                (String::new(), ids, false)
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::bad_param("prompt", "the prompt is empty"));
        }
        check_length(prompt.len(), opts.ctx)?;
        Ok(Prepared { worker: worker.clone(), prompt, prompt_text, opts, tools, chat, calls: engine.call_syntax(), keep_at })
    })
    .await
    .map_err(|e| ApiError::internal(format!("request task failed: {e}")))?
}

/// Sets a flag when dropped: the generation of a client that hung up stops at its next token.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A submitted generation.
pub struct Running {
    /// Its events.
    pub rx: UnboundedReceiver<Event>,
    /// Cancels it when dropped.
    pub guard: CancelOnDrop,
    /// Splits its text.
    pub parser: ReplyParser,
}

/// Queues the generation (429 when the model's queue is full).
/// `streamed`: someone watches the reply arrive (it goes before background requests).
pub fn submit(p: &Prepared, streamed: bool) -> Result<Running, ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt: p.prompt.clone(),
        opts: p.opts.clone(),
        events: tx,
        cancel: cancel.clone(),
        streamed,
        queued: Instant::now(),
        keep_at: p.keep_at,
    };
    p.worker.submit(job)?;
    let parser = if p.chat { ReplyParser::with_syntax(&p.prompt_text, p.tools, p.calls) } else { ReplyParser::raw() };
    Ok(Running { rx, guard: CancelOnDrop(cancel), parser })
}

/// The next step of a running generation, parsed.
pub enum Step {
    /// Pieces of the reply.
    Pieces(Vec<Piece>),
    /// The end: the last pieces and the result.
    Done(Vec<Piece>, Box<Finished>),
}

impl Running {
    /// Waits for the next event.
    pub async fn next(&mut self) -> Result<Step, ApiError> {
        match self.rx.recv().await {
            Some(Event::Text(t)) => Ok(Step::Pieces(self.parser.push(&t))),
            Some(Event::Done(f)) => Ok(Step::Done(self.parser.finish(), f)),
            Some(Event::Failed(e)) => Err(e),
            None => Err(ApiError::internal("the generation ended without a result")),
        }
    }

    /// Runs to the end: the whole reply and the result.
    pub async fn collect(mut self) -> Result<(Reply, Box<Finished>), ApiError> {
        let mut reply = Reply::default();
        loop {
            match self.next().await? {
                Step::Pieces(p) => reply.extend(p),
                Step::Done(p, f) => {
                    reply.extend(p);
                    return Ok((reply, f));
                }
            }
        }
    }
}

/// `n` random alphanumerics (ids of responses and tool calls).
pub fn random_id(n: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut r = rand::rng();
    (0..n).map(|_| A[r.random_range(0..A.len())] as char).collect()
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
