//! A loaded model as front ends see it, whatever its backend: one object-safe trait, so a
//! server can hold models on different backends side by side and only the code that runs
//! generations names the backend type.

use crate::{shared_chat_prefix, tokenize_chat, Backend, Engine, EngineError, SamplingParams, SamplingRequest};
use serde_json::{Map, Value as Json};
use smoe_vault::Architecture;

/// What request handling needs of a loaded model: tokenizing, templating, sampling defaults,
/// limits. Implemented by every [`Engine`].
pub trait LoadedModel: Send + Sync {
    /// The architecture (vocabulary size, family, context length).
    fn architecture(&self) -> &Architecture;
    /// The context limit in tokens.
    fn context(&self) -> usize;
    /// Which backend runs it, for logs and `/health`.
    fn backend(&self) -> String;
    /// Plain text to ids (no template).
    fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError>;
    /// A chat rendered by the model's template and tokenized, reusing `known` ids for replies
    /// this engine generated (see [`tokenize_chat`]).
    fn tokenize_chat(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        kwargs: &Map<String, Json>,
        known: &dyn Fn(&str) -> Option<Vec<u32>>,
    ) -> Result<(String, Vec<u32>), EngineError>;
    /// Where the part of a chat prompt that other conversations share ends (see
    /// [`shared_chat_prefix`]).
    fn shared_chat_prefix(&self, messages: &[Json], text: &str, ids: &[u32]) -> Option<usize>;
    /// A request's sampling settings over the model's generation defaults.
    fn sampling(&self, request: &SamplingRequest) -> SamplingParams;
    /// How the model writes tool calls (its chat template's syntax; the default without one).
    fn call_syntax(&self) -> smoe_text::CallSyntax;
    /// Compiles `grammar` for this model (applying after `after`), to refuse one that cannot
    /// be held before a request runs; the first call indexes the vocabulary
    /// ([`Engine::constraint`]).
    fn check_grammar(&self, grammar: &smoe_text::OutputGrammar, after: Option<&str>) -> Result<(), EngineError>;
}

impl<B: Backend> LoadedModel for Engine<B> {
    fn architecture(&self) -> &Architecture {
        self.model.arch()
    }
    fn context(&self) -> usize {
        self.ctx
    }
    fn backend(&self) -> String {
        self.model.backend().describe()
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Engine::encode(self, text)
    }
    fn tokenize_chat(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        kwargs: &Map<String, Json>,
        known: &dyn Fn(&str) -> Option<Vec<u32>>,
    ) -> Result<(String, Vec<u32>), EngineError> {
        tokenize_chat(self, messages, tools, kwargs, known)
    }
    fn shared_chat_prefix(&self, messages: &[Json], text: &str, ids: &[u32]) -> Option<usize> {
        shared_chat_prefix(self, messages, text, ids)
    }
    fn sampling(&self, request: &SamplingRequest) -> SamplingParams {
        Engine::sampling(self, request)
    }
    fn call_syntax(&self) -> smoe_text::CallSyntax {
        Engine::call_syntax(self)
    }
    fn check_grammar(&self, grammar: &smoe_text::OutputGrammar, after: Option<&str>) -> Result<(), EngineError> {
        self.constraint(grammar, after).map(drop)
    }
}
