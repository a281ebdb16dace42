//! Request fields, read with validation: a wrong type or range is a 400 naming the parameter.

use crate::error::ApiError;
use serde_json::Value as Json;
use smoe_engine::{GenOptions, LoadedModel, SamplingRequest};

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

/// The sampling fields of a request, checked against the API's ranges (the first bad field,
/// in this order, is the one reported).
pub fn sampling_request(v: &Json) -> Result<SamplingRequest, ApiError> {
    let temperature = opt_f32(v, "temperature", 0.0, 2.0)?;
    let top_p = opt_f32(v, "top_p", 0.0, 1.0)?;
    if top_p.is_some_and(|p| p <= 0.0) {
        return Err(ApiError::bad_param("top_p", "'top_p' must be greater than 0"));
    }
    let top_k = match v.get("top_k").filter(|x| !x.is_null()) {
        None => None,
        // -1 means "off" for several clients.
        Some(k) => Some(match k.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(n) if n > 0 => n as usize,
            _ => return Err(ApiError::bad_param("top_k", format!("'top_k' must be a positive integer or -1, got {k}"))),
        }),
    };
    let min_p = opt_f32(v, "min_p", 0.0, 1.0)?;
    let repetition_penalty = opt_f32(v, "repetition_penalty", 0.01, 10.0)?;
    let presence_penalty = opt_f32(v, "presence_penalty", -2.0, 2.0)?;
    let frequency_penalty = opt_f32(v, "frequency_penalty", -2.0, 2.0)?;
    let seed = match v.get("seed").filter(|x| !x.is_null()) {
        None => None,
        Some(seed) => Some(
            seed.as_i64()
                .map(|n| n as u64)
                .or_else(|| seed.as_u64())
                .ok_or_else(|| ApiError::bad_param("seed", format!("'seed' must be an integer, got {seed}")))?,
        ),
    };
    Ok(SamplingRequest { temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed })
}

/// Generation options from a request over the model's defaults. `default_max` applies when no
/// max-token field is given (`None`: up to the context limit).
pub fn gen_options(v: &Json, names: &Names, engine: &dyn LoadedModel, default_max: Option<usize>) -> Result<GenOptions, ApiError> {
    let sampling = engine.sampling(&sampling_request(v)?);
    let mut max = None;
    for name in names.max_tokens {
        if let Some(n) = opt_u64(v, name, 1)? {
            max = Some(n as usize);
            break;
        }
    }
    let stop = stop_list(v, names.stop)?;
    Ok(GenOptions { stop, ..GenOptions::new(max.or(default_max).unwrap_or(usize::MAX), sampling, engine.context()) })
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sampling_fields_become_a_request() {
        assert_eq!(sampling_request(&json!({})).unwrap(), SamplingRequest::default());
        let r = sampling_request(&json!({"temperature": 0, "top_k": -1, "top_p": 0.5, "presence_penalty": null, "seed": -1})).unwrap();
        assert_eq!(
            r,
            SamplingRequest { temperature: Some(0.0), top_k: Some(0), top_p: Some(0.5), seed: Some(u64::MAX), ..Default::default() }
        );
        assert_eq!(sampling_request(&json!({"top_k": 40, "frequency_penalty": 1})).unwrap().top_k, Some(40));
        // The first bad field is the one named.
        let e = sampling_request(&json!({"temperature": 3, "top_p": 0})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = sampling_request(&json!({"top_p": 0})).unwrap_err();
        assert!(e.message.contains("greater than 0"), "{e:?}");
        assert!(sampling_request(&json!({"top_k": 1.5})).is_err());
        assert!(sampling_request(&json!({"seed": "x"})).is_err());
    }
}
