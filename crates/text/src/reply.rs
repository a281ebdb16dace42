//! A model's reply split into reasoning, answer content and tool calls.
//!
//! The formats recognised are those of the supported chat templates: reasoning between
//! `<think>` and `</think>` (Qwen3, GLM-4.5, DeepSeek-R1 style; a prompt that ends with
//! `<think>` starts the reply inside it), and tool calls between `<tool_call>` and
//! `</tool_call>` whose body is either JSON `{"name": …, "arguments": {…}}` (Qwen, Hermes) or
//! GLM-4.5's `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…`, or MiniMax-M2's
//! `<minimax:tool_call>` blocks of `<invoke name="f"><parameter name="k">v</parameter></invoke>`
//! ([`CallSyntax`], told by the chat template).
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
const MINIMAX_OPEN: &str = "<minimax:tool_call>";
const MINIMAX_CLOSE: &str = "</minimax:tool_call>";

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CallSyntax {
    /// One call between `<tool_call>` and `</tool_call>`: JSON (Qwen, Hermes) or GLM-4.5's
    /// `<arg_key>`/`<arg_value>` pairs.
    #[default]
    ToolCallTags,
    /// MiniMax-M2: one or more `<invoke name="f">` with `<parameter name="k">v</parameter>`
    /// between `<minimax:tool_call>` and `</minimax:tool_call>`.
    MiniMax,
}

impl CallSyntax {
    /// The syntax a chat template's source teaches its model.
    pub fn of_template(source: &str) -> CallSyntax {
        if source.contains(MINIMAX_OPEN) {
            CallSyntax::MiniMax
        } else {
            CallSyntax::ToolCallTags
        }
    }

    fn tags(self) -> (&'static str, &'static str) {
        match self {
            CallSyntax::ToolCallTags => (CALL_OPEN, CALL_CLOSE),
            CallSyntax::MiniMax => (MINIMAX_OPEN, MINIMAX_CLOSE),
        }
    }

    /// The calls in one block's body (the text between the tags); `None` when it is not one.
    fn parse(self, body: &str) -> Option<Vec<ToolCall>> {
        match self {
            CallSyntax::ToolCallTags => parse_tool_call(body).map(|c| vec![c]),
            CallSyntax::MiniMax => parse_minimax_calls(body),
        }
    }
}

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
    syntax: CallSyntax,
}

impl ReplyParser {
    /// A parser for a chat reply to `prompt` (a prompt ending in `<think>` starts in reasoning);
    /// tool calls are parsed only when the request offered `tools`.
    pub fn new(prompt: &str, tools: bool) -> ReplyParser {
        ReplyParser::with_syntax(prompt, tools, CallSyntax::default())
    }

    /// [`new`](Self::new) for a model that writes tool calls in `syntax`.
    pub fn with_syntax(prompt: &str, tools: bool, syntax: CallSyntax) -> ReplyParser {
        let (open, close) = syntax.tags();
        ReplyParser {
            think: Some(SectionSplitter::new(THINK_OPEN, THINK_CLOSE, prompt.trim_end().ends_with(THINK_OPEN))),
            tools: tools.then(|| SectionSplitter::new(open, close, false)),
            call: String::new(),
            blank: String::new(),
            called: false,
            syntax,
        }
    }

    /// A parser that returns all text as content (raw completions).
    pub fn raw() -> ReplyParser {
        ReplyParser { think: None, tools: None, call: String::new(), blank: String::new(), called: false, syntax: CallSyntax::default() }
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
                let open = self.syntax.tags().0;
                out.push(Piece::Content(format!("{}{open}{call}", std::mem::take(&mut self.blank))));
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
                    match self.syntax.parse(&body) {
                        Some(calls) => {
                            self.called = true;
                            out.extend(calls.into_iter().map(Piece::ToolCall));
                        }
                        // Not a call after all: the text as written.
                        None => {
                            let (open, close) = self.syntax.tags();
                            out.push(Piece::Content(format!("{blank}{open}{body}{close}")));
                        }
                    }
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

/// The calls of a MiniMax-M2 block body: `<invoke name="f">` … `</invoke>`, each with
/// `<parameter name="k">v</parameter>` children. A value is JSON where it parses as JSON (numbers,
/// booleans, objects, arrays, as the model writes non-string arguments), else the text itself
/// without the line breaks that wrap it. `None` when the body holds no invoke, or holds
/// anything but invokes and whitespace, or one is not closed.
fn parse_minimax_calls(body: &str) -> Option<Vec<ToolCall>> {
    const INVOKE: (&str, &str) = ("<invoke name=", "</invoke>");
    const PARAM: (&str, &str) = ("<parameter name=", "</parameter>");
    // `name="x">` (quotes optional) at the start of `s`: the name and the rest after `>`.
    fn named(s: &str) -> Option<(String, &str)> {
        let end = s.find('>')?;
        let name = s[..end].trim().trim_matches('"').to_string();
        (!name.is_empty()).then_some((name, &s[end + 1..]))
    }
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let inner = rest.strip_prefix(INVOKE.0)?;
        let close = inner.find(INVOKE.1)?;
        let (name, mut params) = named(&inner[..close])?;
        let mut map = serde_json::Map::new();
        params = params.trim_start();
        while !params.is_empty() {
            let p = params.strip_prefix(PARAM.0)?;
            let (key, after) = named(p)?;
            let v1 = after.find(PARAM.1)?;
            let raw = after[..v1].trim_matches('\n');
            map.insert(key, serde_json::from_str(raw).unwrap_or_else(|_| Json::String(raw.to_string())));
            params = after[v1 + PARAM.1.len()..].trim_start();
        }
        let text = format!("{MINIMAX_OPEN}\n{}{}\n{MINIMAX_CLOSE}", INVOKE.0, &inner[..close + INVOKE.1.len()]);
        calls.push(ToolCall { name, arguments: Json::Object(map).to_string(), text });
        rest = inner[close + INVOKE.1.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
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

    const MINIMAX_REPLY: &str = "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">San Francisco</parameter>\n<parameter name=\"days\">3</parameter>\n<parameter name=\"opts\">{\"unit\": \"celsius\"}</parameter>\n</invoke>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>";

    #[test]
    fn minimax_tool_calls() {
        assert_eq!(CallSyntax::of_template("{{ '<minimax:tool_call>' }}"), CallSyntax::MiniMax);
        assert_eq!(CallSyntax::of_template("{{ '<tool_call>' }}"), CallSyntax::ToolCallTags);
        let r = ReplyParser::with_syntax("<|im_start|>assistant\n", true, CallSyntax::MiniMax).parse(MINIMAX_REPLY);
        assert_eq!(r.reasoning, "\nThe user wants weather.\n");
        assert_eq!(r.content, "\n\nChecking.");
        assert_eq!(r.tool_calls.len(), 2, "{r:?}");
        assert_eq!(r.tool_calls[0].name, "get_weather");
        assert_eq!(args(&r.tool_calls[0]), serde_json::json!({"city": "San Francisco", "days": 3, "opts": {"unit": "celsius"}}));
        assert!(r.tool_calls[0].text.starts_with("<minimax:tool_call>\n<invoke name=\"get_weather\">"));
        assert!(r.tool_calls[0].text.ends_with("</invoke>\n</minimax:tool_call>"));
        assert_eq!((r.tool_calls[1].name.as_str(), args(&r.tool_calls[1])), ("get_time", serde_json::json!({})));
        // The other syntax's tags are text to this model, and this model's are text to others.
        let other = "a <tool_call>{\"name\": \"f\"}</tool_call>";
        assert_eq!(ReplyParser::with_syntax("", true, CallSyntax::MiniMax).parse(other).content, other);
        assert!(parse_reply("", true, MINIMAX_REPLY).tool_calls.is_empty());
        // Anything but invokes in a block, or an unclosed one, is content as written.
        for bad in [
            "<minimax:tool_call>text</minimax:tool_call>",
            "<minimax:tool_call><invoke name=\"f\"></minimax:tool_call>",
            "<minimax:tool_call><invoke name=\"f\"><parameter name=\"k\">v</invoke></minimax:tool_call>",
            "<minimax:tool_call><invoke name=\"f\"></invoke>",
        ] {
            let r = ReplyParser::with_syntax("", true, CallSyntax::MiniMax).parse(bad);
            assert_eq!((r.content.as_str(), r.tool_calls.len()), (bad, 0));
        }
        // Streamed in any cutting, the same reply.
        let whole = ReplyParser::with_syntax("", true, CallSyntax::MiniMax).parse(MINIMAX_REPLY);
        for parts in cuttings(MINIMAX_REPLY) {
            let mut p = ReplyParser::with_syntax("", true, CallSyntax::MiniMax);
            let mut streamed: Reply = parts.iter().flat_map(|s| p.push(s)).collect();
            streamed.extend(p.finish());
            assert_eq!(streamed, whole, "as {parts:?}");
        }
    }
}
