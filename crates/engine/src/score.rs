//! `smoe score`: logits and routing for a token sequence, in one prefill or step by step.

use crate::backend::Backend;
use crate::forward::{Logits, Observer};
use crate::{EngineError, Model};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// How the tokens are fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreMode {
    /// All tokens in one forward call (chunked as the state allows).
    Prefill,
    /// One token at a time through the KV cache.
    Decode,
}

/// Routing of one MoE layer over the sequence.
#[derive(Clone, Debug, Default)]
pub struct LayerRoutes {
    /// `[T, k]` chosen experts.
    pub experts: Vec<i32>,
    /// `[T, k]` mixing weights.
    pub weights: Vec<f32>,
    /// `[T, num_experts]` scores the choice was made on.
    pub choice: Vec<f32>,
}

/// What [`score`] computes.
#[derive(Clone, Debug)]
pub struct ScoreOutput {
    /// Tokens scored.
    pub tokens: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Experts per token.
    pub top_k: usize,
    /// `[T, vocab]`.
    pub logits: Vec<f32>,
    /// By decoder layer.
    pub routes: BTreeMap<usize, LayerRoutes>,
    /// The instrument summary, if asked for.
    pub instrument: Option<crate::instrument::Summary>,
    /// Tokens of a greedy continuation after the ids (see [`score_and_continue`]).
    pub greedy: Vec<u32>,
}

struct Recorder<'a>(&'a mut BTreeMap<usize, LayerRoutes>);

impl Observer for Recorder<'_> {
    fn route(&mut self, layer: usize, _pos: usize, experts: &[u32], weights: &[f32], choice: &[f32]) {
        let r = self.0.entry(layer).or_default();
        r.experts.extend(experts.iter().map(|&e| e as i32));
        r.weights.extend_from_slice(weights);
        r.choice.extend_from_slice(choice);
    }
}

/// Runs `ids` as one prompt and records logits and routing. [`ScoreMode::Prefill`] runs `chunk`
/// tokens per forward step (the CLI passes [`Model::prefill_chunk`] unless told otherwise).
pub fn score<B: Backend>(
    model: &Model<B>,
    ids: &[u32],
    mode: ScoreMode,
    chunk: usize,
    instrument: bool,
) -> Result<ScoreOutput, EngineError> {
    score_and_continue(model, ids, mode, chunk, instrument, 0)
}

/// As [`score`], then `greedy` tokens of greedy continuation (the argmax, the lowest id on a
/// tie), one step at a time through the cache: what a peer engine's greedy decode is compared
/// with. Logits and routing cover the ids only.
pub fn score_and_continue<B: Backend>(
    model: &Model<B>,
    ids: &[u32],
    mode: ScoreMode,
    chunk: usize,
    instrument: bool,
    greedy: usize,
) -> Result<ScoreOutput, EngineError> {
    let mut routes = BTreeMap::new();
    let mut rec = Recorder(&mut routes);
    let vocab = model.arch().vocab_size;
    let mut logits = Vec::with_capacity(ids.len() * vocab);
    let mut st = model.new_state(if mode == ScoreMode::Prefill { chunk } else { 1 });
    model.reserve(&mut st, ids.len() + greedy);
    if instrument {
        st.enable_instrument();
    }
    match mode {
        ScoreMode::Prefill => logits.extend_from_slice(model.forward(&mut st, ids, Logits::All, &mut rec)?),
        ScoreMode::Decode => {
            for &t in ids {
                logits.extend_from_slice(model.forward(&mut st, &[t], Logits::Last, &mut rec)?);
            }
        }
    }
    let instrument = st.instrument.as_ref().map(|i| i.summary(0));
    let mut continuation = Vec::with_capacity(greedy);
    if greedy > 0 {
        let mut next = crate::sampler::argmax(&logits[(ids.len() - 1) * vocab..]);
        for step in 0..greedy {
            continuation.push(next);
            if step + 1 < greedy {
                next = crate::sampler::argmax(model.forward(&mut st, &[next], Logits::Last, &mut crate::NoObserver)?);
            }
        }
    }
    Ok(ScoreOutput { tokens: ids.len(), vocab, top_k: model.arch().moe.top_k, logits, routes, instrument, greedy: continuation })
}

impl ScoreOutput {
    /// Writes `logits` `[T, vocab]` f32 and `route.L.experts` `[T, k]` i32 / `route.L.weights`
    /// `[T, k]` f32 for every MoE layer, and `greedy` `[N]` i32 if there is a continuation, as
    /// safetensors.
    pub fn write_safetensors(&self, path: &Path) -> std::io::Result<()> {
        let mut tensors: Vec<(String, &str, Vec<usize>, Vec<u8>)> = Vec::new();
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        tensors.push(("logits".into(), "F32", vec![self.tokens, self.vocab], f32_bytes(&self.logits)));
        for (l, r) in &self.routes {
            let shape = vec![self.tokens, self.top_k];
            tensors.push((format!("route.{l}.experts"), "I32", shape.clone(), r.experts.iter().flat_map(|x| x.to_le_bytes()).collect()));
            tensors.push((format!("route.{l}.weights"), "F32", shape, f32_bytes(&r.weights)));
        }
        if !self.greedy.is_empty() {
            let bytes = self.greedy.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
            tensors.push(("greedy".into(), "I32", vec![self.greedy.len()], bytes));
        }
        write_safetensors(path, &tensors)
    }
}

/// Writes named tensors `(name, dtype, shape, little-endian bytes)` as a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + bytes.len()]}));
        off += bytes.len();
    }
    let mut h = serde_json::to_vec(&header)?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for (_, _, _, bytes) in tensors {
        f.write_all(bytes)?;
    }
    f.flush()
}
