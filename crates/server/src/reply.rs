//! A model's streamed reply split into reasoning (`<think>`), content and tool calls
//! (`<tool_call>`), as both API dialects return them.

use rand::Rng;
use serde_json::Value as Json;
use smoe_text::{Section, SectionSplitter};

/// One parsed piece of a reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Reasoning text (inside `<think>`).
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// A tool call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// `call_…`, unique per call.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as JSON text.
    pub arguments: String,
}

/// Splits streamed reply text into [`Piece`]s.
pub struct ReplyParser {
    think: Option<SectionSplitter>,
    tools: Option<SectionSplitter>,
    call: String,
    /// Whitespace-only content held back: dropped if only tool calls follow.
    blank: String,
}

impl ReplyParser {
    /// A parser for a reply to `prompt` (a prompt ending in `<think>` starts in reasoning); tool
    /// calls are parsed only when the request offered tools.
    pub fn new(prompt: &str, tools: bool) -> ReplyParser {
        ReplyParser {
            think: Some(SectionSplitter::thinking(prompt)),
            tools: tools.then(|| SectionSplitter::new("<tool_call>", "</tool_call>", false)),
            call: String::new(),
            blank: String::new(),
        }
    }

    /// A parser that returns all text as content (raw completions).
    pub fn raw() -> ReplyParser {
        ReplyParser { think: None, tools: None, call: String::new(), blank: String::new() }
    }

    /// Feeds generated text; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self.think.as_mut() {
            Some(t) => {
                let pieces = t.push(text);
                self.route(pieces)
            }
            None => vec![Piece::Content(text.to_string())],
        }
    }

    /// The rest, at the end of the reply. An unterminated tool call is returned as content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let pieces = self.think.as_mut().map(|t| t.flush()).unwrap_or_default();
        let mut out = self.route(pieces);
        if let Some((rest, open)) = self.tools.as_mut().map(|t| (t.flush(), t.inside())) {
            out.extend(self.content_or_call(rest));
            if open || !self.call.is_empty() {
                out.push(Piece::Content(format!("<tool_call>{}", std::mem::take(&mut self.call))));
            }
        }
        out
    }

    fn route(&mut self, pieces: Vec<(Section, String)>) -> Vec<Piece> {
        let mut out = Vec::new();
        for (sec, s) in pieces {
            match sec {
                Section::Inside => out.push(Piece::Reasoning(s)),
                Section::Closed => {}
                Section::Outside => match self.tools.as_mut() {
                    None => out.push(Piece::Content(s)),
                    Some(t) => {
                        let split = t.push(&s);
                        out.extend(self.content_or_call(split));
                    }
                },
            }
        }
        out
    }

    fn content_or_call(&mut self, pieces: Vec<(Section, String)>) -> Vec<Piece> {
        let mut out = Vec::new();
        for (sec, s) in pieces {
            match sec {
                Section::Outside if s.trim().is_empty() => self.blank.push_str(&s),
                Section::Outside => out.push(Piece::Content(std::mem::take(&mut self.blank) + &s)),
                Section::Inside => self.call.push_str(&s),
                Section::Closed => {
                    let body = std::mem::take(&mut self.call);
                    self.blank.clear();
                    out.push(match parse_call(&body) {
                        Some(c) => Piece::ToolCall(c),
                        None => Piece::Content(format!("<tool_call>{body}</tool_call>")),
                    });
                }
            }
        }
        out
    }
}

/// A tool-call body: `{"name": …, "arguments": {…}}` (Qwen, Hermes) or GLM-4.5's
/// `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…`.
pub fn parse_call(body: &str) -> Option<ToolCall> {
    let b = body.trim();
    let (name, args) = if b.starts_with('{') {
        let v: Json = serde_json::from_str(b).ok()?;
        let name = v["name"].as_str()?.to_string();
        let args = match &v["arguments"] {
            Json::String(s) => s.clone(),
            Json::Null => "{}".to_string(),
            other => other.to_string(),
        };
        (name, args)
    } else {
        let (name, mut rest) = b.split_once('\n').map_or((b, ""), |(n, r)| (n.trim(), r));
        let mut map = serde_json::Map::new();
        while let Some(k0) = rest.find("<arg_key>") {
            let k1 = rest[k0..].find("</arg_key>")? + k0;
            let key = rest[k0 + 9..k1].trim().to_string();
            let v0 = rest[k1..].find("<arg_value>")? + k1 + 11;
            let v1 = rest[v0..].find("</arg_value>")? + v0;
            let raw = &rest[v0..v1];
            map.insert(key, serde_json::from_str(raw).unwrap_or_else(|_| Json::String(raw.to_string())));
            rest = &rest[v1 + 12..];
        }
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        (name.to_string(), Json::Object(map).to_string())
    };
    Some(ToolCall { id: call_id(), name, arguments: args })
}

/// A random `call_…` id.
pub fn call_id() -> String {
    format!("call_{}", random_id(24))
}

/// `n` random alphanumerics.
pub fn random_id(n: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut r = rand::rng();
    (0..n).map(|_| A[r.random_range(0..A.len())] as char).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(prompt: &str, tools: bool, parts: &[&str]) -> Vec<Piece> {
        let mut p = ReplyParser::new(prompt, tools);
        let mut out: Vec<Piece> = parts.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish());
        // Merge neighbours of the same kind for comparison.
        let mut merged: Vec<Piece> = Vec::new();
        for x in out {
            match (merged.last_mut(), x) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (_, x) => merged.push(x),
            }
        }
        merged
    }

    #[test]
    fn reasoning_content_and_tool_calls() {
        let got = run(
            "<|im_start|>assistant\n",
            true,
            &[
                "<think>\nweather?",
                "</think>\n\nLet me check.\n<tool",
                "_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
            ],
        );
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], Piece::Reasoning("\nweather?".into()));
        assert_eq!(got[1], Piece::Content("\n\nLet me check.\n".into()));
        match &got[2] {
            Piece::ToolCall(c) => {
                assert_eq!(c.name, "get_weather");
                assert_eq!(serde_json::from_str::<Json>(&c.arguments).unwrap(), serde_json::json!({"city": "Paris"}));
                assert!(c.id.starts_with("call_"));
            }
            other => panic!("{other:?}"),
        }
        // Without tools, the tags are content; a broken call comes back as text.
        assert_eq!(run("", false, &["a<tool_call>{}</tool_call>"]), vec![Piece::Content("a<tool_call>{}</tool_call>".into())]);
        assert_eq!(run("", true, &["<tool_call>not json</tool_call>"]), vec![Piece::Content("<tool_call>not json</tool_call>".into())]);
        assert_eq!(run("", true, &["x <tool_call>{\"name\": \"f\""]), vec![Piece::Content("x <tool_call>{\"name\": \"f\"".into())]);
    }

    #[test]
    fn glm_style_arguments() {
        let c = parse_call(
            "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>",
        )
        .unwrap();
        assert_eq!(c.name, "get_weather");
        assert_eq!(serde_json::from_str::<Json>(&c.arguments).unwrap(), serde_json::json!({"city": "Paris", "days": 3}));
    }
}
