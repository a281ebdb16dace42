/*!
The smoe engine: one generic Mixture-of-Experts decoder.

[`Model`] holds a model's dense weights on a [`Backend`] and reaches routed experts through an
[`ExpertSource`](smoe_store::ExpertSource); [`Model::forward`] runs any supported family, any
number of tokens, through one layer loop whose family differences are enums chosen at load.
[`Sampler`] turns logits into tokens; [`Engine`] drives tokenizer, template, model and
sampler for text generation.

This crate owns the math and the generation loop. It does not parse files (`smoe-vault`,
`smoe-formats`: [`open`] only asks them for a model's parts), fetch experts (`smoe-store`) or
tokenize (`smoe-text`). [`LoadedModel`] is an engine as front ends see it, whatever its backend;
[`conformance`] checks a backend op by op.
*/
#![deny(missing_docs)]

pub mod backend;
mod batch;
pub mod bench;
pub mod conformance;
pub mod cpu;
mod delta;
mod forward;
mod generate;
mod hyper;
pub mod instrument;
mod loaded;
mod model;
mod open;
pub mod perplexity;
pub mod rope;
pub mod routing;
pub mod sampler;
pub mod score;
mod session;
mod stepwise;
pub mod trace_routing;
mod widths;

pub use backend::{Backend, DeviceTier};
pub use batch::{Batch, BatchItem};
pub use cpu::{default_threads, CpuBackend, Precision};
pub use forward::{Logits, NoObserver, Observer, State, PREFILL_CHUNK, STREAMING_PREFILL_CHUNK};
pub use generate::{Engine, FinishReason, GenOptions, GenStats, Generation};
pub use loaded::LoadedModel;
pub use model::{
    backend_lacks, kv_bytes, kv_fixed_values, kv_shapes, kv_shapes_rewinding, kv_values_per_token, naive_kv_values_per_token, KvType,
    Model, DEFAULT_KV_REWIND,
};
pub use open::{default_context, is_gguf, model_sizes, open, open_cpu, CacheSize, ModelSizes, OpenOptions, OpenReport};
pub use sampler::{Sampler, SamplingParams, SamplingRequest};
pub use score::{score, score_and_continue, ScoreMode, ScoreOutput};
pub use session::{shared_chat_prefix, tokenize_chat, Conversation, Overflow, Session, Turn, TOKEN_IDS_KEY};
pub use stepwise::Stepwise;

/// Engine errors.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The vault could not be read.
    #[error(transparent)]
    Vault(#[from] smoe_vault::VaultError),
    /// An expert could not be fetched.
    #[error(transparent)]
    Store(#[from] smoe_store::StoreError),
    /// The model is inconsistent.
    #[error("model: {0}")]
    Model(String),
    /// Bad input (token ids, lengths).
    #[error("{0}")]
    Input(String),
    /// Tokenizer or template failure.
    #[error("{0}")]
    Text(String),
    /// The backend's device failed (see [`Backend::fault`]).
    #[error("backend: {0}")]
    Backend(String),
}

#[cfg(test)]
mod send_sync {
    #[test]
    fn engine_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::Engine<crate::CpuBackend>>();
        check::<crate::Session<crate::CpuBackend>>();
    }
}
