//! OpenAI's `POST /v1/chat/completions` and `POST /v1/completions`.

use crate::error::ApiError;
use crate::params::{gen_options, opt_bool, opt_u64, req_str, OPENAI};
use crate::run::{now, prepare, random_id, submit, ChatParts, PromptSpec, Running, Shape, Step};
use crate::worker::Finished;
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde_json::{json, Map, Value as Json};
use smoe_engine::FinishReason;
use smoe_text::{Piece, ToolCall};
use std::collections::VecDeque;
use std::convert::Infallible;

/// Messages as the chat template wants them: roles checked, `developer` as `system`, content
/// parts joined into one string.
pub fn normalize_messages(v: &Json) -> Result<Vec<Json>, ApiError> {
    let Some(list) = v.get("messages").and_then(Json::as_array) else {
        return Err(ApiError::bad_param("messages", "'messages' must be an array of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::bad_param("messages", "'messages' must not be empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let Some(obj) = m.as_object() else { return Err(ApiError::bad_param("messages", format!("messages[{i}] is not an object"))) };
            let role = match obj.get("role").and_then(Json::as_str) {
                Some("developer") => "system",
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
                other => {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!("messages[{i}].role must be system, developer, user, assistant or tool (got {other:?})"),
                    ))
                }
            };
            let mut out = obj.clone();
            out.insert("role".into(), role.into());
            let content = match obj.get("content") {
                Some(Json::String(s)) => s.clone(),
                None | Some(Json::Null) if role == "assistant" => String::new(),
                Some(Json::Array(parts)) => {
                    text_parts(parts).map_err(|e| ApiError::bad_param("messages", format!("messages[{i}]: {e}")))?
                }
                _ => {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!("messages[{i}].content must be a string or an array of text parts"),
                    ))
                }
            };
            out.insert("content".into(), content.into());
            Ok(Json::Object(out))
        })
        .collect()
}

/// Joins `[{"type": "text", "text": …}, …]`.
pub fn text_parts(parts: &[Json]) -> Result<String, String> {
    let mut s = String::new();
    for p in parts {
        match (p["type"].as_str(), p["text"].as_str()) {
            (Some("text" | "input_text"), Some(t)) => s.push_str(t),
            (t, _) => return Err(format!("only text content parts are supported (got type {t:?})")),
        }
    }
    Ok(s)
}

/// `tools` and `tool_choice`: the tools to show the template (none when `tool_choice` is "none").
fn tools(v: &Json) -> Result<Option<Vec<Json>>, ApiError> {
    let Some(list) = v.get("tools").filter(|t| !t.is_null()) else { return Ok(None) };
    let Some(list) = list.as_array() else { return Err(ApiError::bad_param("tools", "'tools' must be an array")) };
    for (i, t) in list.iter().enumerate() {
        if t["type"] != "function" || !t["function"]["name"].is_string() {
            return Err(ApiError::bad_param(
                "tools",
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"),
            ));
        }
    }
    match v.get("tool_choice") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) if s == "none" => return Ok(None),
        Some(Json::String(s)) if s == "auto" || s == "required" => {}
        Some(Json::Object(o)) if o.get("function").and_then(|f| f.get("name")).is_some_and(Json::is_string) => {}
        Some(x) => {
            return Err(ApiError::bad_param("tool_choice", format!("'tool_choice' must be none, auto, required or a function, got {x}")))
        }
    }
    Ok((!list.is_empty()).then(|| list.clone()))
}

/// Fields smoe does not implement, refused rather than ignored.
fn refuse_unsupported(v: &Json) -> Result<(), ApiError> {
    if let Some(n) = opt_u64(v, "n", 1)? {
        if n > 1 {
            return Err(ApiError::bad_param("n", "only n = 1 is supported"));
        }
    }
    if opt_bool(v, "logprobs")? == Some(true) {
        return Err(ApiError::bad_param("logprobs", "logprobs are not supported"));
    }
    Ok(())
}

/// What the reply must be: `response_format` (`json_object`, `json_schema`) or a `tool_choice`
/// that requires a call (`required`, or a named function). Both at once are refused.
fn shape(v: &Json) -> Result<Shape, ApiError> {
    let format = match v.get("response_format").filter(|r| !r.is_null()) {
        None => Shape::Free,
        Some(r) => match r["type"].as_str() {
            Some("text") => Shape::Free,
            Some("json_object") => Shape::Json(json!({"type": "object"})),
            Some("json_schema") => match &r["json_schema"]["schema"] {
                s @ (Json::Object(_) | Json::Bool(true)) => Shape::Json(s.clone()),
                _ => return Err(ApiError::bad_param("response_format", "response_format json_schema needs json_schema.schema, an object")),
            },
            _ => {
                return Err(ApiError::bad_param(
                    "response_format",
                    format!("response_format type must be text, json_object or json_schema, got {}", r["type"]),
                ))
            }
        },
    };
    let parallel = opt_bool(v, "parallel_tool_calls")?.unwrap_or(true);
    let call = match v.get("tool_choice") {
        Some(Json::String(s)) if s == "required" => Shape::Call { name: None, parallel },
        Some(Json::Object(o)) => Shape::Call { name: o.get("function").and_then(|f| f["name"].as_str()).map(str::to_string), parallel },
        _ => Shape::Free,
    };
    match (format, call) {
        (f, Shape::Free) => Ok(f),
        (Shape::Free, c) => Ok(c),
        _ => Err(ApiError::bad_param("response_format", "a JSON response_format and a tool_choice that requires a call cannot both hold")),
    }
}

fn include_usage(v: &Json) -> Result<bool, ApiError> {
    match v.get("stream_options") {
        None | Some(Json::Null) => Ok(false),
        Some(o) => Ok(opt_bool(o, "include_usage")?.unwrap_or(false)),
    }
}

/// The finish reason OpenAI reports.
fn finish_reason(f: FinishReason, tool_calls: bool) -> &'static str {
    match f {
        _ if tool_calls => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(f: &Finished) -> Json {
    let s = &f.generation.stats;
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": s.prompt_tokens - s.prefilled_tokens},
    })
}

/// A tool call with a new `call_…` id.
fn tool_call_json(index: usize, c: &ToolCall) -> Json {
    let id = format!("call_{}", random_id(24));
    json!({"index": index, "id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// The parts of a chat request that need no model: its messages as the chat template takes
/// them, its tools, and the refusal of what smoe does not do (the fuzz target's entry).
pub fn chat_request(v: &Json) -> Result<ChatParts, ApiError> {
    let messages = normalize_messages(v)?;
    let tools = tools(v)?;
    refuse_unsupported(v)?;
    Ok(ChatParts { messages, tools, shape: shape(v)? })
}

/// `POST /v1/chat/completions`.
pub async fn chat(state: AppState, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let v = crate::params::parse_body(&body)?;
    let model = req_str(&v, "model")?.to_string();
    let ChatParts { messages, tools, shape } = chat_request(&v)?;
    let stream = opt_bool(&v, "stream")?.unwrap_or(false);
    let usage_chunk = include_usage(&v)?;
    let kwargs: Map<String, Json> = match v.get("chat_template_kwargs") {
        None | Some(Json::Null) => Map::new(),
        Some(Json::Object(o)) => o.clone(),
        Some(_) => return Err(ApiError::bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object")),
    };
    let spec = PromptSpec::Chat { messages, tools, kwargs, shape };
    let vv = v.clone();
    let default_max = state.fleet.default_max_tokens();
    let p = prepare(state.fleet.clone(), model.clone(), spec, move |e| gen_options(&vv, &OPENAI, e, default_max)).await?;
    let run = submit(&p, stream)?;
    let id = format!("chatcmpl-{}", random_id(24));
    let created = now();
    if stream {
        return Ok(sse(ChatStream { run, id, model, created, usage_chunk, queue: VecDeque::new(), calls: 0, state: 0 }.into_stream()));
    }
    let (reply, fin) = run.collect().await?;
    let (reasoning, content, calls) = (reply.reasoning, reply.content, reply.tool_calls);
    let mut message =
        json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Json::Null } else { content.into() }});
    if !reasoning.is_empty() {
        message["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        message["tool_calls"] = calls.iter().enumerate().map(|(i, c)| tool_call_json(i, c)).collect();
    }
    Ok(axum::Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason(fin.generation.finish, !calls.is_empty())}],
        "usage": usage(&fin),
    }))
    .into_response())
}

/// Server-sent events of a stream of JSON chunks, ending with `data: [DONE]`.
pub fn sse(s: impl Stream<Item = Json> + Send + 'static) -> Response {
    use futures_util::StreamExt;
    let events = s
        .map(|j| if j.is_null() { SseEvent::default().data("[DONE]") } else { SseEvent::default().data(j.to_string()) })
        .map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// The chunks of a streamed chat completion (`Json::Null` stands for `[DONE]`).
struct ChatStream {
    run: Running,
    id: String,
    model: String,
    created: u64,
    usage_chunk: bool,
    queue: VecDeque<Json>,
    calls: usize,
    /// 0: role chunk not sent; 1: streaming; 2: finished.
    state: u8,
}

impl ChatStream {
    fn chunk(&self, delta: Json, finish: Option<&str>) -> Json {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    }

    fn pieces(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            let delta = match p {
                Piece::Reasoning(s) => json!({"reasoning_content": s}),
                Piece::Content(s) => json!({"content": s}),
                Piece::ToolCall(c) => {
                    self.calls += 1;
                    json!({"tool_calls": [tool_call_json(self.calls - 1, &c)]})
                }
            };
            let c = self.chunk(delta, None);
            self.queue.push_back(c);
        }
    }

    fn into_stream(self) -> impl Stream<Item = Json> + Send {
        stream::unfold(self, |mut s| async move {
            loop {
                if let Some(j) = s.queue.pop_front() {
                    return Some((j, s));
                }
                match s.state {
                    0 => {
                        s.state = 1;
                        let c = s.chunk(json!({"role": "assistant", "content": ""}), None);
                        return Some((c, s));
                    }
                    2 => return None,
                    _ => {}
                }
                match s.run.next().await {
                    Ok(Step::Pieces(p)) => s.pieces(p),
                    Ok(Step::Done(p, fin)) => {
                        s.pieces(p);
                        let c = s.chunk(json!({}), Some(finish_reason(fin.generation.finish, s.calls > 0)));
                        s.queue.push_back(c);
                        if s.usage_chunk {
                            let u = json!({"id": s.id, "object": "chat.completion.chunk", "created": s.created, "model": s.model, "choices": [], "usage": usage(&fin)});
                            s.queue.push_back(u);
                        }
                        s.queue.push_back(Json::Null);
                        s.state = 2;
                    }
                    Err(e) => {
                        s.queue.push_back(e.body());
                        s.queue.push_back(Json::Null);
                        s.state = 2;
                    }
                }
            }
        })
    }
}

/// The prompt of a completion request: a string, one string in an array, or token ids.
fn completion_prompt(v: &Json) -> Result<PromptSpec, ApiError> {
    let bad = || ApiError::bad_param("prompt", "'prompt' must be a string or an array of token ids (one prompt per request)");
    let ids = |a: &[Json]| a.iter().map(|x| x.as_u64().filter(|&n| n <= u32::MAX as u64).map(|n| n as u32)).collect::<Option<Vec<u32>>>();
    match v.get("prompt") {
        Some(Json::String(s)) => Ok(PromptSpec::Text(s.clone())),
        Some(Json::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(PromptSpec::Text(a[0].as_str().unwrap_or_default().to_string())),
        Some(Json::Array(a)) if a.len() == 1 && a[0].is_array() => {
            ids(a[0].as_array().map_or(&[][..], |v| v)).map(PromptSpec::Ids).ok_or_else(bad)
        }
        Some(Json::Array(a)) if !a.is_empty() && a.iter().all(Json::is_number) => ids(a).map(PromptSpec::Ids).ok_or_else(bad),
        None | Some(Json::Null) => Err(ApiError::bad_param("prompt", "'prompt' is required")),
        _ => Err(bad()),
    }
}

/// `POST /v1/completions` (raw text, no chat template).
pub async fn completions(state: AppState, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let v = crate::params::parse_body(&body)?;
    let model = req_str(&v, "model")?.to_string();
    let spec = completion_prompt(&v)?;
    refuse_unsupported(&v)?;
    if let Shape::Json(_) = shape(&v)? {
        return Err(ApiError::bad_param("response_format", "a JSON response_format is supported on /v1/chat/completions, not here"));
    }
    if opt_u64(&v, "best_of", 1)?.is_some_and(|b| b > 1) {
        return Err(ApiError::bad_param("best_of", "only best_of = 1 is supported"));
    }
    if opt_bool(&v, "echo")? == Some(true) {
        return Err(ApiError::bad_param("echo", "echo is not supported"));
    }
    let stream = opt_bool(&v, "stream")?.unwrap_or(false);
    let usage_chunk = include_usage(&v)?;
    let vv = v.clone();
    // OpenAI's default for completions is 16 tokens.
    let p = prepare(state.fleet.clone(), model.clone(), spec, move |e| gen_options(&vv, &OPENAI, e, Some(16))).await?;
    let run = submit(&p, stream)?;
    let id = format!("cmpl-{}", random_id(24));
    let created = now();
    let chunk = move |text: &str, finish: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}]})
    };
    if !stream {
        let (reply, fin) = run.collect().await?;
        let mut out = chunk(&reply.content, Some(finish_reason(fin.generation.finish, false)));
        out["usage"] = usage(&fin);
        return Ok(axum::Json(out).into_response());
    }
    let st = stream::unfold((run, chunk, VecDeque::<Json>::new(), false), move |(mut run, chunk, mut q, mut done)| async move {
        loop {
            if let Some(j) = q.pop_front() {
                return Some((j, (run, chunk, q, done)));
            }
            if done {
                return None;
            }
            match run.next().await {
                Ok(Step::Pieces(p)) => q.extend(p.into_iter().map(|p| chunk(&piece_text(p), None))),
                Ok(Step::Done(p, fin)) => {
                    q.extend(p.into_iter().map(|p| chunk(&piece_text(p), None)));
                    q.push_back(chunk("", Some(finish_reason(fin.generation.finish, false))));
                    if usage_chunk {
                        let mut u = chunk("", None);
                        u["choices"] = json!([]);
                        u["usage"] = usage(&fin);
                        q.push_back(u);
                    }
                    q.push_back(Json::Null);
                    done = true;
                }
                Err(e) => {
                    q.push_back(e.body());
                    q.push_back(Json::Null);
                    done = true;
                }
            }
        }
    });
    Ok(sse(st))
}

/// A piece of a raw completion as text (a raw reply is all content).
fn piece_text(p: Piece) -> String {
    match p {
        Piece::Reasoning(s) | Piece::Content(s) => s,
        Piece::ToolCall(c) => c.text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_get_call_ids() {
        let reply = smoe_text::parse_reply("", true, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>");
        let j = tool_call_json(2, &reply.tool_calls[0]);
        assert!(j["id"].as_str().unwrap().starts_with("call_"), "{j}");
        assert_eq!(j["id"].as_str().unwrap().len(), 5 + 24);
        assert_eq!((j["index"].clone(), j["function"]["name"].clone()), (json!(2), json!("f")));
        assert_eq!(serde_json::from_str::<Json>(j["function"]["arguments"].as_str().unwrap()).unwrap(), json!({"a": 1}));
    }
}
