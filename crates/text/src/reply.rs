//! A model's reply split into reasoning, answer content and tool calls.
//!
//! The formats recognised are those of the supported chat templates: reasoning between
//! `<think>` and `</think>` (Qwen3, GLM-4.5, DeepSeek-R1 style; a prompt that ends with
//! `<think>` starts the reply inside it), and tool calls between `<tool_call>` and
//! `</tool_call>` whose body is either JSON `{"name": …, "arguments": {…}}` (Qwen, Hermes) or
//! GLM-4.5's `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…`.
//!
//! [`ReplyParser`] works on streamed text and returns each [`Piece`] as soon as it is certain;
//! [`parse_reply`] parses a whole text at once. However the text is cut into pieces, the
//! streamed pieces gathered into a [`Reply`] equal the whole-text parse.

use crate::{Section, SectionSplitter};
use serde_json::Value as Json;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// One parsed piece of a reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Reasoning text (the thinking tags dropped).
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// A tool call the model made. Front ends give it the id their API wants.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments as JSON text (an object).
    pub arguments: String,
    /// The call as the model wrote it, tags included.
    pub text: String,
}

/// A whole reply: the pieces of one kind joined.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reply {
    /// Reasoning text.
    pub reasoning: String,
    /// Answer text.
    pub content: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
}

impl Reply {
    /// Adds one piece.
    pub fn push(&mut self, piece: Piece) {
        match piece {
            Piece::Reasoning(s) => self.reasoning.push_str(&s),
            Piece::Content(s) => self.content.push_str(&s),
            Piece::ToolCall(c) => self.tool_calls.push(c),
        }
    }
}

impl Extend<Piece> for Reply {
    fn extend<I: IntoIterator<Item = Piece>>(&mut self, pieces: I) {
        for p in pieces {
            self.push(p);
        }
    }
}

impl FromIterator<Piece> for Reply {
    fn from_iter<I: IntoIterator<Item = Piece>>(pieces: I) -> Reply {
        let mut r = Reply::default();
        r.extend(pieces);
        r
    }
}

/// Splits streamed reply text into [`Piece`]s.
///
/// With tools, whitespace that ends the content so far is held back: it is dropped when a tool
/// call follows it or when the reply ends after a tool call, so that a reply of only tool calls
/// has no content. A tool call that does not parse, or is not closed, is content as written.
#[derive(Clone, Debug)]
pub struct ReplyParser {
    think: Option<SectionSplitter>,
    tools: Option<SectionSplitter>,
    /// The body of the tool call being read.
    call: String,
    /// Trailing whitespace of the content, held back.
    blank: String,
    /// Whether a tool call was returned.
    called: bool,
}

impl ReplyParser {
    /// A parser for a chat reply to `prompt` (a prompt ending in `<think>` starts in reasoning);
    /// tool calls are parsed only when the request offered `tools`.
    pub fn new(prompt: &str, tools: bool) -> ReplyParser {
        ReplyParser {
            think: Some(SectionSplitter::new(THINK_OPEN, THINK_CLOSE, prompt.trim_end().ends_with(THINK_OPEN))),
            tools: tools.then(|| SectionSplitter::new(CALL_OPEN, CALL_CLOSE, false)),
            call: String::new(),
            blank: String::new(),
            called: false,
        }
    }

    /// A parser that returns all text as content (raw completions).
    pub fn raw() -> ReplyParser {
        ReplyParser { think: None, tools: None, call: String::new(), blank: String::new(), called: false }
    }

    /// Whether the text seen so far ends inside reasoning.
    pub fn in_reasoning(&self) -> bool {
        self.think.as_ref().is_some_and(SectionSplitter::inside)
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
                let call = std::mem::take(&mut self.call);
                out.push(Piece::Content(format!("{}{CALL_OPEN}{call}", std::mem::take(&mut self.blank))));
            }
            let blank = std::mem::take(&mut self.blank);
            if !self.called && !blank.is_empty() {
                out.push(Piece::Content(blank));
            }
        }
        out
    }

    /// Parses a whole reply (the pieces of [`push`](Self::push) and [`finish`](Self::finish)
    /// gathered).
    pub fn parse(mut self, text: &str) -> Reply {
        let mut r: Reply = self.push(text).into_iter().collect();
        r.extend(self.finish());
        r
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
                Section::Outside => {
                    let end = s.trim_end().len();
                    if end > 0 {
                        out.push(Piece::Content(std::mem::take(&mut self.blank) + &s[..end]));
                    }
                    self.blank.push_str(&s[end..]);
                }
                Section::Inside => self.call.push_str(&s),
                Section::Closed => {
                    let body = std::mem::take(&mut self.call);
                    let blank = std::mem::take(&mut self.blank);
                    out.push(match parse_tool_call(&body) {
                        Some(c) => {
                            self.called = true;
                            Piece::ToolCall(c)
                        }
                        // Not a call after all: the text as written.
                        None => Piece::Content(format!("{blank}{CALL_OPEN}{body}{CALL_CLOSE}")),
                    });
                }
            }
        }
        out
    }
}

/// Parses a whole chat reply to `prompt` (see [`ReplyParser::new`]).
pub fn parse_reply(prompt: &str, tools: bool, text: &str) -> Reply {
    ReplyParser::new(prompt, tools).parse(text)
}

/// A tool-call body (the text between the tags): `{"name": …, "arguments": {…}}` (Qwen,
/// Hermes) or GLM-4.5's `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…`. `None` when
/// it is neither.
pub fn parse_tool_call(body: &str) -> Option<ToolCall> {
    let b = body.trim();
    let (name, arguments) = if b.starts_with('{') {
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
        const KEY: (&str, &str) = ("<arg_key>", "</arg_key>");
        const VALUE: (&str, &str) = ("<arg_value>", "</arg_value>");
        while let Some(k0) = rest.find(KEY.0) {
            let k1 = rest[k0..].find(KEY.1)? + k0;
            let key = rest[k0 + KEY.0.len()..k1].trim().to_string();
            let v0 = rest[k1..].find(VALUE.0)? + k1 + VALUE.0.len();
            let v1 = rest[v0..].find(VALUE.1)? + v0;
            let raw = &rest[v0..v1];
            map.insert(key, serde_json::from_str(raw).unwrap_or_else(|_| Json::String(raw.to_string())));
            rest = &rest[v1 + VALUE.1.len()..];
        }
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        (name.to_string(), Json::Object(map).to_string())
    };
    Some(ToolCall { name, arguments, text: format!("{CALL_OPEN}{body}{CALL_CLOSE}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `parts`, merging neighbouring pieces of the same kind.
    fn run(prompt: &str, tools: bool, parts: &[&str]) -> Vec<Piece> {
        let mut p = ReplyParser::new(prompt, tools);
        let mut out: Vec<Piece> = parts.iter().flat_map(|s| p.push(s)).collect();
        out.extend(p.finish());
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

    fn args(c: &ToolCall) -> Json {
        serde_json::from_str(&c.arguments).unwrap()
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
        assert_eq!(got[1], Piece::Content("\n\nLet me check.".into()));
        match &got[2] {
            Piece::ToolCall(c) => {
                assert_eq!(c.name, "get_weather");
                assert_eq!(args(c), serde_json::json!({"city": "Paris"}));
                assert!(c.text.starts_with("<tool_call>\n{") && c.text.ends_with("}\n</tool_call>"));
            }
            other => panic!("{other:?}"),
        }
        // Without tools, the tags are content; a broken call comes back as text.
        assert_eq!(run("", false, &["a<tool_call>{}</tool_call>"]), vec![Piece::Content("a<tool_call>{}</tool_call>".into())]);
        assert_eq!(run("", true, &["<tool_call>not json</tool_call>"]), vec![Piece::Content("<tool_call>not json</tool_call>".into())]);
        assert_eq!(run("", true, &["x <tool_call>{\"name\": \"f\""]), vec![Piece::Content("x <tool_call>{\"name\": \"f\"".into())]);
        // Raw text is all content.
        let mut raw = ReplyParser::raw();
        assert_eq!(raw.push("<think>a</think>"), vec![Piece::Content("<think>a</think>".into())]);
        assert_eq!(raw.finish(), vec![]);
    }

    #[test]
    fn whitespace_around_tool_calls() {
        let call = "<tool_call>{\"name\": \"f\"}</tool_call>";
        // Whitespace before and after calls only: no content at all.
        let r = parse_reply("", true, &format!("\n\n{call}\n{call}\n"));
        assert_eq!((r.content.as_str(), r.tool_calls.len()), ("", 2));
        assert_eq!(r.tool_calls[0].arguments, "{}");
        // Whitespace between text survives; trailing whitespace of a reply without calls too.
        let r = parse_reply("", true, &format!("a \n{call}\n b \n"));
        assert_eq!(r.content, "a\n b");
        assert_eq!(parse_reply("", true, "a \n b\n\n").content, "a \n b\n\n");
        assert_eq!(run("", true, &["hello", "\n\n"]), vec![Piece::Content("hello\n\n".into())]);
        // A call that does not parse is content as written, whitespace included.
        assert_eq!(parse_reply("", true, "a \n<tool_call>not a call</tool_call>\n").content, "a \n<tool_call>not a call</tool_call>\n");
        // Without tools nothing is held back.
        assert_eq!(parse_reply("", false, &format!("a \n{call}\n")).content, format!("a \n{call}\n"));
    }

    #[test]
    fn starts_in_reasoning_after_an_open_tag() {
        let p = ReplyParser::new("<|im_start|>assistant\n<think>\n", false);
        assert!(p.in_reasoning());
        let r = p.parse("plan</think>answer");
        assert_eq!((r.reasoning.as_str(), r.content.as_str()), ("plan", "answer"));
        assert!(!ReplyParser::new("<|im_start|>assistant\n", false).in_reasoning());
    }

    #[test]
    fn glm_style_arguments() {
        let c = parse_tool_call(
            "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>",
        )
        .unwrap();
        assert_eq!(c.name, "get_weather");
        assert_eq!(args(&c), serde_json::json!({"city": "Paris", "days": 3}));
        assert!(parse_tool_call("two words").is_none());
        assert!(parse_tool_call("f\n<arg_key>k</arg_key>no value").is_none());
        let c = parse_tool_call("{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}").unwrap();
        assert_eq!(args(&c), serde_json::json!({"a": 1}));
    }

    /// Every way to cut `text` at up to two char boundaries, and every fixed chunk size.
    fn cuttings(text: &str) -> Vec<Vec<&str>> {
        let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        let mut out = vec![vec![text]];
        for &a in &bounds {
            for &b in bounds.iter().filter(|&&b| b >= a) {
                out.push(vec![&text[..a], &text[a..b], &text[b..]]);
            }
        }
        for size in 1..8 {
            let mut parts = Vec::new();
            let mut rest = text;
            while !rest.is_empty() {
                let mut at = size.min(rest.len());
                while !rest.is_char_boundary(at) {
                    at += 1;
                }
                let (a, b) = rest.split_at(at);
                parts.push(a);
                rest = b;
            }
            out.push(parts);
        }
        out
    }

    #[test]
    fn streaming_at_any_boundary_equals_the_whole_text_parse() {
        let texts = [
            "<think>\nweather?</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
            "plan é</think>ok \n<tool_call>g\n<arg_key>k</arg_key>\n<arg_value>\"v\"</arg_value>\n</tool_call> \n done\n\n",
            "a<tool_call>not json</tool_call> b <think>x</think>\n",
            "x <tool_call>{\"name\": \"f\"",
            "  <thi</think",
            "trailing blanks \n\n",
            "<tool_call>{\"name\": \"f\"}</tool_call>\n\n<tool_call>{\"name\": \"g\"}</tool_call>",
        ];
        for text in texts {
            for prompt in ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"] {
                for tools in [false, true] {
                    let whole = parse_reply(prompt, tools, text);
                    for parts in cuttings(text) {
                        let mut p = ReplyParser::new(prompt, tools);
                        let mut streamed: Reply = parts.iter().flat_map(|s| p.push(s)).collect();
                        streamed.extend(p.finish());
                        assert_eq!(streamed, whole, "{text:?} as {parts:?}, tools {tools}, prompt {prompt:?}");
                    }
                }
            }
        }
    }
}
