//! Request fields, read with validation: a wrong type or range is a 400 naming the parameter.

use crate::error::ApiError;
use serde_json::Value as Json;
use smoe_engine::{CpuBackend, Engine, GenOptions};

/// A JSON object's optional field as a number in `[lo, hi]`.
pub fn opt_f32(v: &Json, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match v.get(name) {
        None | Some(Json::Null) => Ok(None),
        Some(x) => match x.as_f64() {
            Some(f) if (lo..=hi).contains(&f) => Ok(Some(f as f32)),
            Some(f) => Err(ApiError::bad_param(name, format!("'{name}' must be between {lo} and {hi}, got {f}"))),
            None => Err(ApiError::bad_param(name, format!("'{name}' must be a number"))),
        },
    }
}

/// A JSON object's optional field as a non-negative integer of at least `min`.
pub fn opt_u64(v: &Json, name: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match v.get(name) {
        None | Some(Json::Null) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(ApiError::bad_param(name, format!("'{name}' must be an integer >= {min}, got {x}"))),
        },
    }
}

/// A JSON object's optional boolean field.
pub fn opt_bool(v: &Json, name: &str) -> Result<Option<bool>, ApiError> {
    match v.get(name) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(x) => Err(ApiError::bad_param(name, format!("'{name}' must be a boolean, got {x}"))),
    }
}

/// A required string field.
pub fn req_str<'a>(v: &'a Json, name: &str) -> Result<&'a str, ApiError> {
    match v.get(name) {
        Some(Json::String(s)) => Ok(s),
        None | Some(Json::Null) => Err(ApiError::bad_param(name, format!("'{name}' is required"))),
        Some(x) => Err(ApiError::bad_param(name, format!("'{name}' must be a string, got {x}"))),
    }
}

/// Stop strings: a string or an array of strings.
pub fn stop_list(v: &Json, name: &str) -> Result<Vec<String>, ApiError> {
    match v.get(name) {
        None | Some(Json::Null) => Ok(vec![]),
        Some(Json::String(s)) => Ok(vec![s.clone()]),
        Some(Json::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::bad_param(name, format!("'{name}' must hold strings"))))
            .collect(),
        Some(x) => Err(ApiError::bad_param(name, format!("'{name}' must be a string or an array of strings, got {x}"))),
    }
}

/// Parses a request body as a JSON object.
pub fn parse_body(body: &[u8]) -> Result<Json, ApiError> {
    let v: Json = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(v)
}

/// Names of the sampling fields, per dialect.
pub struct Names {
    /// Max-token fields, first found wins.
    pub max_tokens: &'static [&'static str],
    /// Stop strings field.
    pub stop: &'static str,
}

/// OpenAI's field names.
pub const OPENAI: Names = Names { max_tokens: &["max_completion_tokens", "max_tokens"], stop: "stop" };
/// Anthropic's field names.
pub const ANTHROPIC: Names = Names { max_tokens: &["max_tokens"], stop: "stop_sequences" };

/// Generation options from a request over the model's defaults. `default_max` applies when no
/// max-token field is given (`None`: up to the context limit).
pub fn gen_options(v: &Json, names: &Names, engine: &Engine<CpuBackend>, default_max: Option<usize>) -> Result<GenOptions, ApiError> {
    let mut s = engine.default_sampling();
    if let Some(t) = opt_f32(v, "temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = opt_f32(v, "top_p", 0.0, 1.0)? {
        if p <= 0.0 {
            return Err(ApiError::bad_param("top_p", "'top_p' must be greater than 0"));
        }
        s.top_p = p;
    }
    if let Some(k) = v.get("top_k").filter(|x| !x.is_null()) {
        // -1 means "off" for several clients.
        s.top_k = match k.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(n) if n > 0 => n as usize,
            _ => return Err(ApiError::bad_param("top_k", format!("'top_k' must be a positive integer or -1, got {k}"))),
        };
    }
    if let Some(m) = opt_f32(v, "min_p", 0.0, 1.0)? {
        s.min_p = m;
    }
    if let Some(r) = opt_f32(v, "repetition_penalty", 0.01, 10.0)? {
        s.repetition_penalty = r;
    }
    s.presence_penalty = opt_f32(v, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    s.frequency_penalty = opt_f32(v, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    if let Some(seed) = v.get("seed").filter(|x| !x.is_null()) {
        s.seed = Some(
            seed.as_i64()
                .map(|n| n as u64)
                .or_else(|| seed.as_u64())
                .ok_or_else(|| ApiError::bad_param("seed", format!("'seed' must be an integer, got {seed}")))?,
        );
    }
    let mut max = None;
    for name in names.max_tokens {
        if let Some(n) = opt_u64(v, name, 1)? {
            max = Some(n as usize);
            break;
        }
    }
    let stop = stop_list(v, names.stop)?;
    Ok(GenOptions {
        max_tokens: max.or(default_max).unwrap_or(usize::MAX),
        sampling: s,
        stop,
        stop_ids: None,
        ctx: engine.ctx,
        keep_prompt_logits: false,
    })
}

/// Refuses a prompt that leaves no room to generate.
pub fn check_length(prompt: usize, ctx: usize) -> Result<(), ApiError> {
    if prompt >= ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_param(
                "messages",
                format!("this model's context is {ctx} tokens; the prompt is {prompt} tokens, which leaves no room to generate"),
            )
        });
    }
    Ok(())
}
