//! Anthropic's `POST /v1/messages`, as coding tools speak it: content blocks (text, thinking,
//! tool_use, tool_result) and the streaming event sequence.

use crate::error::ApiError;
use crate::openai::text_parts;
use crate::params::{gen_options, opt_bool, opt_u64, req_str, ANTHROPIC};
use crate::run::{prepare, random_id, submit, ChatParts, PromptSpec, Running, Shape, Step};
use crate::worker::Finished;
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value as Json};
use smoe_engine::FinishReason;
use smoe_text::Piece;
use std::collections::VecDeque;
use std::convert::Infallible;

/// A block's text: a string or an array of text blocks.
fn block_text(v: &Json, what: &str) -> Result<String, ApiError> {
    match v {
        Json::String(s) => Ok(s.clone()),
        Json::Array(parts) => text_parts(parts).map_err(|e| ApiError::bad_param(what, e)),
        Json::Null => Ok(String::new()),
        _ => Err(ApiError::bad_param(what, format!("{what} must be a string or an array of text blocks"))),
    }
}

/// Anthropic messages (and system prompt) as the chat template's OpenAI-style messages.
fn to_template_messages(v: &Json) -> Result<Vec<Json>, ApiError> {
    let mut out = Vec::new();
    if let Some(sys) = v.get("system").filter(|s| !s.is_null()) {
        let text = block_text(sys, "system")?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    let Some(list) = v.get("messages").and_then(Json::as_array).filter(|l| !l.is_empty()) else {
        return Err(ApiError::bad_param("messages", "'messages' must be a non-empty array"));
    };
    for (i, m) in list.iter().enumerate() {
        let role = m["role"].as_str().filter(|r| *r == "user" || *r == "assistant");
        let Some(role) = role else { return Err(ApiError::bad_param("messages", format!("messages[{i}].role must be user or assistant"))) };
        let blocks = match &m["content"] {
            Json::String(s) => vec![json!({"type": "text", "text": s})],
            Json::Array(a) => a.clone(),
            _ => return Err(ApiError::bad_param("messages", format!("messages[{i}].content must be a string or an array of blocks"))),
        };
        let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
        for b in &blocks {
            match b["type"].as_str() {
                Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
                Some("thinking") if role == "assistant" => thinking.push_str(b["thinking"].as_str().unwrap_or_default()),
                Some("redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => calls.push(json!({
                    "id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                })),
                Some("tool_result") if role == "user" => {
                    let content = block_text(&b["content"], "tool_result.content")?;
                    out.push(json!({"role": "tool", "content": content, "tool_call_id": b["tool_use_id"]}));
                }
                t => return Err(ApiError::bad_param("messages", format!("messages[{i}]: content block type {t:?} is not supported here"))),
            }
        }
        if role == "user" && text.is_empty() && blocks.iter().all(|b| b["type"] == "tool_result") {
            continue;
        }
        let mut msg = json!({"role": role, "content": text});
        if !thinking.is_empty() {
            msg["reasoning_content"] = thinking.into();
        }
        if !calls.is_empty() {
            msg["tool_calls"] = calls.into();
        }
        out.push(msg);
    }
    Ok(out)
}

/// Anthropic tool definitions as OpenAI-style functions for the template.
fn tools(v: &Json) -> Result<Option<Vec<Json>>, ApiError> {
    let Some(list) = v.get("tools").filter(|t| !t.is_null()) else { return Ok(None) };
    let Some(list) = list.as_array() else { return Err(ApiError::bad_param("tools", "'tools' must be an array")) };
    if v["tool_choice"]["type"] == "none" || list.is_empty() {
        return Ok(None);
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t["name"].as_str().ok_or_else(|| ApiError::bad_param("tools", format!("tools[{i}].name is required")))?;
            Ok(json!({"type": "function", "function": {
                "name": name, "description": t.get("description").cloned().unwrap_or(Json::Null),
                "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
            }}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn stop_reason(f: &Finished, tool_use: bool) -> (&'static str, Json) {
    match f.generation.finish {
        _ if tool_use => ("tool_use", Json::Null),
        FinishReason::Length => ("max_tokens", Json::Null),
        _ => match &f.generation.stop_string {
            Some(s) => ("stop_sequence", s.clone().into()),
            None => ("end_turn", Json::Null),
        },
    }
}

fn usage(f: &Finished) -> Json {
    let s = &f.generation.stats;
    json!({"input_tokens": s.prompt_tokens, "output_tokens": s.generated_tokens, "cache_read_input_tokens": s.prompt_tokens - s.prefilled_tokens})
}

fn tool_input(arguments: &str) -> Json {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({}))
}

/// A messages request's messages (system prompt first) and tools, as the chat template takes
/// them: what needs no model (the fuzz target's entry).
pub fn messages_request(v: &Json) -> Result<ChatParts, ApiError> {
    Ok(ChatParts { messages: to_template_messages(v)?, tools: tools(v)?, shape: tool_choice(v)? })
}

/// `tool_choice` `any` (some tool) or `tool` (the one named) requires a call; one call only
/// with `disable_parallel_tool_use`.
fn tool_choice(v: &Json) -> Result<Shape, ApiError> {
    let c = &v["tool_choice"];
    let parallel = c["disable_parallel_tool_use"] != true;
    match c["type"].as_str() {
        None if c.is_null() => Ok(Shape::Free),
        Some("auto" | "none") => Ok(Shape::Free),
        Some("any") => Ok(Shape::Call { name: None, parallel }),
        Some("tool") => match c["name"].as_str() {
            Some(n) => Ok(Shape::Call { name: Some(n.to_string()), parallel }),
            None => Err(ApiError::bad_param("tool_choice", "tool_choice of type tool needs a name")),
        },
        _ => Err(ApiError::bad_param("tool_choice", format!("tool_choice type must be auto, any, tool or none, got {c}"))),
    }
}

/// `POST /v1/messages`.
pub async fn messages(state: AppState, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let v = crate::params::parse_body(&body)?;
    let model = req_str(&v, "model")?.to_string();
    if opt_u64(&v, "max_tokens", 1)?.is_none() {
        return Err(ApiError::bad_param("max_tokens", "'max_tokens' is required"));
    }
    let ChatParts { messages, tools, shape } = messages_request(&v)?;
    let mut kwargs = Map::new();
    match v["thinking"]["type"].as_str() {
        Some("enabled") => {
            kwargs.insert("enable_thinking".into(), true.into());
        }
        Some("disabled") => {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        _ => {}
    }
    let stream = opt_bool(&v, "stream")?.unwrap_or(false);
    let vv = v.clone();
    let p = prepare(state.fleet.clone(), model.clone(), PromptSpec::Chat { messages, tools, kwargs, shape }, move |e| {
        gen_options(&vv, &ANTHROPIC, e, None)
    })
    .await?;
    let run = submit(&p, stream)?;
    let id = format!("msg_{}", random_id(24));
    if stream {
        let s =
            MessageStream { run, id, model, queue: VecDeque::new(), block: None, index: 0, tool_use: false, started: false, done: false };
        let events = s.into_stream().map(|(name, data)| Ok::<_, Infallible>(SseEvent::default().event(name).data(data.to_string())));
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let (reply, fin) = run.collect().await?;
    let (reasoning, text, calls) = (reply.reasoning, reply.content, reply.tool_calls);
    let mut content = Vec::new();
    if !reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for c in &calls {
        content
            .push(json!({"type": "tool_use", "id": format!("toolu_{}", random_id(24)), "name": c.name, "input": tool_input(&c.arguments)}));
    }
    let (reason, seq) = stop_reason(&fin, !calls.is_empty());
    Ok(axum::Json(json!({
        "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": seq, "usage": usage(&fin),
    }))
    .into_response())
}

/// The streaming event sequence: message_start, then per block content_block_start /
/// content_block_delta… / content_block_stop, then message_delta and message_stop.
struct MessageStream {
    run: Running,
    id: String,
    model: String,
    queue: VecDeque<(&'static str, Json)>,
    /// The open block's type.
    block: Option<&'static str>,
    index: usize,
    tool_use: bool,
    started: bool,
    done: bool,
}

impl MessageStream {
    fn open(&mut self, kind: &'static str, block: Json) {
        if self.block == Some(kind) && kind != "tool_use" {
            return;
        }
        self.close();
        self.queue.push_back(("content_block_start", json!({"type": "content_block_start", "index": self.index, "content_block": block})));
        self.block = Some(kind);
    }

    fn close(&mut self) {
        if self.block.take().is_some() {
            self.queue.push_back(("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
        }
    }

    fn delta(&mut self, delta: Json) {
        self.queue.push_back(("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": delta})));
    }

    fn pieces(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(s) => {
                    self.open("thinking", json!({"type": "thinking", "thinking": ""}));
                    self.delta(json!({"type": "thinking_delta", "thinking": s}));
                }
                Piece::Content(s) => {
                    self.open("text", json!({"type": "text", "text": ""}));
                    self.delta(json!({"type": "text_delta", "text": s}));
                }
                Piece::ToolCall(c) => {
                    self.tool_use = true;
                    let id = format!("toolu_{}", random_id(24));
                    self.open("tool_use", json!({"type": "tool_use", "id": id, "name": c.name, "input": {}}));
                    self.delta(json!({"type": "input_json_delta", "partial_json": tool_input(&c.arguments).to_string()}));
                    self.close();
                }
            }
        }
    }

    fn into_stream(self) -> impl futures_util::Stream<Item = (&'static str, Json)> + Send {
        stream::unfold(self, |mut s| async move {
            loop {
                if let Some(e) = s.queue.pop_front() {
                    return Some((e, s));
                }
                if s.done {
                    return None;
                }
                if !s.started {
                    s.started = true;
                    let msg = json!({"type": "message_start", "message": {
                        "id": s.id, "type": "message", "role": "assistant", "model": s.model, "content": [],
                        "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}});
                    s.queue.push_back(("message_start", msg));
                    s.queue.push_back(("ping", json!({"type": "ping"})));
                    continue;
                }
                match s.run.next().await {
                    Ok(Step::Pieces(p)) => s.pieces(p),
                    Ok(Step::Done(p, fin)) => {
                        s.pieces(p);
                        if s.index == 0 && s.block.is_none() {
                            s.open("text", json!({"type": "text", "text": ""}));
                        }
                        s.close();
                        let (reason, seq) = stop_reason(&fin, s.tool_use);
                        s.queue.push_back((
                            "message_delta",
                            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(&fin)}),
                        ));
                        s.queue.push_back(("message_stop", json!({"type": "message_stop"})));
                        s.done = true;
                    }
                    Err(e) => {
                        s.queue.push_back(("error", e.anthropic().body()));
                        s.done = true;
                    }
                }
            }
        })
    }
}
