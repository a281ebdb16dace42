//! A model's reply split into reasoning, answer content and tool calls.
//!
//! The formats recognised are those of the supported chat templates: reasoning between
//! `<think>` and `</think>` (Qwen3, GLM-4.5, DeepSeek-R1 style; a prompt that ends with
//! `<think>` starts the reply inside it), and tool calls between `<tool_call>` and
//! `</tool_call>` whose body is either JSON `{"name": …, "arguments": {…}}` (Qwen, Hermes) or
//! GLM-4.5's `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…`, or MiniMax-M2's
//! `<minimax:tool_call>` blocks of `<invoke name="f"><parameter name="k">v</parameter></invoke>`
//! ([`CallSyntax`], told by the chat template). gpt-oss's harmony format is parsed by channel:
//! `<|channel|>analysis<|message|>…<|end|>` is reasoning, the `final` channel content, and a
//! message to `functions.f` (`<|channel|>commentary to=functions.f <|constrain|>json<|message|>
//! {…}<|call|>`) a tool call with JSON arguments.
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
    /// gpt-oss's harmony format: messages in channels, calls addressed `to=functions.f`
    /// with JSON arguments. The markers (`<|channel|>`, `<|message|>`, `<|end|>`, …) must be
    /// in the text (special tokens rendered).
    Harmony,
}

impl CallSyntax {
    /// The syntax a chat template's source teaches its model.
    pub fn of_template(source: &str) -> CallSyntax {
        if source.contains(MINIMAX_OPEN) {
            CallSyntax::MiniMax
        } else if source.contains(H_CHANNEL) && source.contains(H_MESSAGE) {
            CallSyntax::Harmony
        } else {
            CallSyntax::ToolCallTags
        }
    }

    fn tags(self) -> (&'static str, &'static str) {
        match self {
            CallSyntax::ToolCallTags => (CALL_OPEN, CALL_CLOSE),
            CallSyntax::MiniMax => (MINIMAX_OPEN, MINIMAX_CLOSE),
            CallSyntax::Harmony => unreachable!("harmony calls are messages, not tagged blocks"),
        }
    }

    /// The calls in one block's body (the text between the tags); `None` when it is not one.
    fn parse(self, body: &str) -> Option<Vec<ToolCall>> {
        match self {
            CallSyntax::ToolCallTags => parse_tool_call(body).map(|c| vec![c]),
            CallSyntax::MiniMax => parse_minimax_calls(body),
            CallSyntax::Harmony => None,
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
    /// The harmony reader, for [`CallSyntax::Harmony`] (then `think` and `tools` are unused).
    harmony: Option<Harmony>,
}

/// Whether a reply to `prompt` starts inside reasoning: the template ended the prompt with
/// `<think>` (a thinking template, or `enable_thinking` left on where the template opens it).
fn opens_in_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

/// The text after which a constrained reply to `prompt` is held to its grammar, if the reply
/// opens with something else: `</think>` when the prompt opens the reasoning, and for a
/// harmony model (gpt-oss) the header of its final channel, unless the prompt already wrote it.
pub fn grammar_starts_after(prompt: &str, syntax: CallSyntax) -> Option<&'static str> {
    match syntax {
        CallSyntax::Harmony => (!prompt.trim_end().ends_with(H_FINAL)).then_some(H_FINAL),
        _ => opens_in_reasoning(prompt).then_some(THINK_CLOSE),
    }
}

impl ReplyParser {
    /// A parser for a chat reply to `prompt` (a prompt ending in `<think>` starts in reasoning);
    /// tool calls are parsed only when the request offered `tools`.
    pub fn new(prompt: &str, tools: bool) -> ReplyParser {
        ReplyParser::with_syntax(prompt, tools, CallSyntax::default())
    }

    /// [`new`](Self::new) for a model that writes tool calls in `syntax`.
    pub fn with_syntax(prompt: &str, tools: bool, syntax: CallSyntax) -> ReplyParser {
        if syntax == CallSyntax::Harmony {
            let mut p = ReplyParser::raw();
            p.syntax = syntax;
            p.harmony = Some(Harmony::new(prompt, tools));
            return p;
        }
        let (open, close) = syntax.tags();
        ReplyParser {
            think: Some(SectionSplitter::new(THINK_OPEN, THINK_CLOSE, opens_in_reasoning(prompt))),
            tools: tools.then(|| SectionSplitter::new(open, close, false)),
            call: String::new(),
            blank: String::new(),
            called: false,
            syntax,
            harmony: None,
        }
    }

    /// A parser that returns all text as content (raw completions).
    pub fn raw() -> ReplyParser {
        ReplyParser {
            think: None,
            tools: None,
            call: String::new(),
            blank: String::new(),
            called: false,
            syntax: CallSyntax::default(),
            harmony: None,
        }
    }

    /// Whether the text seen so far ends inside reasoning.
    pub fn in_reasoning(&self) -> bool {
        if let Some(h) = &self.harmony {
            return matches!(h.state, HState::Body(Channel::Reasoning));
        }
        self.think.as_ref().is_some_and(SectionSplitter::inside)
    }

    /// Feeds generated text; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(h) = self.harmony.as_mut() {
            return h.push(text);
        }
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
        if let Some(h) = self.harmony.as_mut() {
            return h.finish();
        }
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

const H_CHANNEL: &str = "<|channel|>";
const H_MESSAGE: &str = "<|message|>";
/// Where a harmony reply's answer starts (its analysis channel comes before it).
const H_FINAL: &str = "<|channel|>final<|message|>";
const H_START: &str = "<|start|>";
/// Markers that end a harmony message (consumed).
const H_ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];
/// Markers that begin a harmony header (and end a message left unterminated).
const H_HEADS: [&str; 2] = [H_START, H_CHANNEL];
/// What a reply's first message may begin with besides [`H_HEADS`]: a recipient after the
/// prompt's `<|start|>assistant`.
const H_RECIPIENT: &str = " to=";

/// Where a harmony message's body goes.
#[derive(Clone, Debug, PartialEq)]
enum Channel {
    /// `analysis`.
    Reasoning,
    /// `final`, a `commentary` preamble, or text outside any channel.
    Content,
    /// A message to `functions.NAME` (tools offered); `header` as written.
    Call { name: String, header: String },
}

#[derive(Clone, Debug, PartialEq)]
enum HState {
    /// Between messages: whether a header or bare text follows is not known yet.
    Start,
    /// Reading a header up to `<|message|>`.
    Header,
    /// In a message's body.
    Body(Channel),
}

/// Reads harmony messages from streamed text. Text that could begin a marker is held back
/// until it is known not to be one.
#[derive(Clone, Debug)]
struct Harmony {
    tools: bool,
    state: HState,
    /// Text not yet returned: a header being read, or the tail of a body that may begin a marker.
    buf: String,
    /// The body of the call being read.
    call: String,
}

impl Harmony {
    /// Starts between messages, or in the message whose header the prompt ends with.
    fn new(prompt: &str, tools: bool) -> Harmony {
        let mut h = Harmony { tools, state: HState::Start, buf: String::new(), call: String::new() };
        if let Some(head) = prompt.strip_suffix(H_MESSAGE) {
            let head = head.rfind(H_START).map_or(head, |i| &head[i..]);
            h.state = HState::Body(h.channel(head));
        }
        h
    }

    /// The channel a header sends its body to.
    fn channel(&self, header: &str) -> Channel {
        // A word after `key` in the header, up to whitespace or the next marker.
        fn word<'a>(header: &'a str, key: &str) -> Option<&'a str> {
            let rest = &header[header.rfind(key)? + key.len()..];
            let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
            Some(&rest[..end])
        }
        if let Some(name) = word(header, "to=").and_then(|r| r.strip_prefix("functions.")) {
            if self.tools && !name.is_empty() {
                return Channel::Call { name: name.to_string(), header: header.to_string() };
            }
        }
        match word(header, H_CHANNEL) {
            Some("analysis") => Channel::Reasoning,
            _ => Channel::Content,
        }
    }

    fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match &self.state {
                HState::Start => {
                    let heads = H_HEADS.iter().chain([&H_RECIPIENT]);
                    if heads.clone().any(|m| self.buf.starts_with(m)) {
                        self.state = HState::Header;
                    } else if heads.clone().any(|m| m.starts_with(self.buf.as_str())) {
                        return out; // empty, or could still begin one
                    } else {
                        self.state = HState::Body(Channel::Content);
                    }
                }
                HState::Header => {
                    let Some(at) = self.buf.find(H_MESSAGE) else { return out };
                    let header: String = self.buf.drain(..at + H_MESSAGE.len()).collect();
                    let header = &header[..at];
                    let channel = self.channel(header);
                    if channel == Channel::Content && header.contains("to=") {
                        // A message to a recipient that is not an offered function: as written.
                        out.push(Piece::Content(format!("{header}{H_MESSAGE}")));
                    }
                    self.state = HState::Body(channel);
                }
                HState::Body(_) => {
                    let found = H_ENDS.iter().map(|m| (m, true)).chain(H_HEADS.iter().map(|m| (m, false)));
                    let next = found.filter_map(|(m, end)| self.buf.find(m).map(|at| (at, m.len(), end))).min();
                    let Some((at, len, end)) = next else {
                        let keep = crate::sections::partial_suffix_len(&self.buf, H_ENDS.iter().chain(&H_HEADS).copied());
                        let body: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.body(body, &mut out);
                        return out;
                    };
                    let body: String = self.buf.drain(..at).collect();
                    if end {
                        self.buf.drain(..len);
                    }
                    self.body(body, &mut out);
                    self.close(&mut out);
                }
            }
        }
    }

    fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            // An unfinished header, or text that might have begun one: as written.
            HState::Start | HState::Header => {
                if !rest.is_empty() {
                    out.push(Piece::Content(rest));
                }
            }
            HState::Body(_) => {
                self.body(rest, &mut out);
                self.close(&mut out);
            }
        }
        self.state = HState::Start;
        out
    }

    fn body(&mut self, s: String, out: &mut Vec<Piece>) {
        if s.is_empty() {
            return;
        }
        match &self.state {
            HState::Body(Channel::Reasoning) => out.push(Piece::Reasoning(s)),
            HState::Body(Channel::Call { .. }) => self.call.push_str(&s),
            _ => out.push(Piece::Content(s)),
        }
    }

    /// Ends the message being read; a call's body becomes a call, or text as written when it
    /// is not JSON.
    fn close(&mut self, out: &mut Vec<Piece>) {
        if let HState::Body(Channel::Call { name, header }) = std::mem::replace(&mut self.state, HState::Start) {
            let body = std::mem::take(&mut self.call);
            let text = format!("{header}{H_MESSAGE}{body}");
            match serde_json::from_str::<Json>(body.trim()) {
                Ok(args) => out.push(Piece::ToolCall(ToolCall { name, arguments: args.to_string(), text: format!("{text}<|call|>") })),
                Err(_) => out.push(Piece::Content(text)),
            }
        }
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

    /// A constrained reply is held after what opens it: the reasoning a prompt opened, a
    /// harmony model's analysis before its final channel (unless the prompt wrote the header).
    #[test]
    fn grammars_start_after_the_reasoning() {
        let t = CallSyntax::ToolCallTags;
        assert_eq!(grammar_starts_after("<|im_start|>assistant\n<think>\n", t), Some("</think>"));
        assert_eq!(grammar_starts_after("<|im_start|>assistant\n", t), None);
        assert_eq!(grammar_starts_after("<|im_start|>assistant\n<think>\n\n</think>\n\n", t), None);
        let h = CallSyntax::Harmony;
        assert_eq!(grammar_starts_after(HARMONY_PROMPT, h), Some("<|channel|>final<|message|>"));
        assert_eq!(grammar_starts_after(&format!("{HARMONY_PROMPT}<|channel|>final<|message|>"), h), None);
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

    const HARMONY_PROMPT: &str = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant";
    const HARMONY_REPLY: &str = "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 3}<|call|>";

    fn harmony(prompt: &str, tools: bool, text: &str) -> Reply {
        ReplyParser::with_syntax(prompt, tools, CallSyntax::Harmony).parse(text)
    }

    #[test]
    fn harmony_channels_and_calls() {
        assert_eq!(CallSyntax::of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}"), CallSyntax::Harmony);
        // Reasoning and the final answer (stopped at <|return|>, or with it in the text).
        let text = "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello! How can I help?";
        for t in [text.to_string(), format!("{text}<|return|>")] {
            let r = harmony(HARMONY_PROMPT, false, &t);
            assert_eq!((r.reasoning.as_str(), r.content.as_str(), r.tool_calls.len()), ("User greets.", "Hello! How can I help?", 0));
        }
        // A tool call, with or without its <|call|> (a stop token), recipient before or after the channel.
        for t in [HARMONY_REPLY, HARMONY_REPLY.strip_suffix("<|call|>").unwrap()] {
            let r = harmony(HARMONY_PROMPT, true, t);
            assert_eq!((r.reasoning.as_str(), r.content.as_str()), ("Need the weather tool.", ""));
            assert_eq!(r.tool_calls.len(), 1, "{r:?}");
            assert_eq!(r.tool_calls[0].name, "get_weather");
            assert_eq!(args(&r.tool_calls[0]), serde_json::json!({"city": "Paris", "days": 3}));
            assert!(r.tool_calls[0].text.starts_with("<|start|>assistant<|channel|>commentary to=functions.get_weather"));
        }
        let r = harmony(HARMONY_PROMPT, true, " to=functions.f<|channel|>commentary json<|message|>{}<|call|>");
        assert_eq!((r.tool_calls[0].name.as_str(), r.tool_calls[0].arguments.as_str(), r.content.as_str()), ("f", "{}", ""));
        // A commentary preamble is content; a call whose arguments are not JSON is text as written.
        let r =
            harmony("", true, "<|channel|>commentary<|message|>Checking.<|end|><|channel|>commentary to=functions.f<|message|>not json");
        assert_eq!(r.content, "Checking.<|channel|>commentary to=functions.f<|message|>not json");
        assert!(r.tool_calls.is_empty());
        // Without tools, a message to a function is text as written.
        let r = harmony("", false, "<|channel|>commentary to=functions.f<|message|>{}");
        assert_eq!((r.content.as_str(), r.tool_calls.len()), ("<|channel|>commentary to=functions.f<|message|>{}", 0));
        // A reply without channels is content; so is an unfinished header.
        assert_eq!(harmony(HARMONY_PROMPT, true, "Just text <b>.").content, "Just text <b>.");
        assert_eq!(harmony("", true, "<|channel|>fin").content, "<|channel|>fin");
        // A prompt that ends in a message header starts in that channel.
        let p = ReplyParser::with_syntax("<|start|>assistant<|channel|>analysis<|message|>", false, CallSyntax::Harmony);
        assert!(p.in_reasoning());
        let r = p.parse("think<|end|><|start|>assistant<|channel|>final<|message|>ok");
        assert_eq!((r.reasoning.as_str(), r.content.as_str()), ("think", "ok"));
        // Other syntaxes' tags are text to harmony.
        assert_eq!(harmony("", true, "<think>a</think><tool_call>{}</tool_call>").content, "<think>a</think><tool_call>{}</tool_call>");
    }

    #[test]
    fn harmony_streamed_at_any_boundary() {
        let texts = [
            HARMONY_REPLY,
            "<|channel|>analysis<|message|>é plan <|<|end|><|start|>assistant<|channel|>final<|message|>answer <|x|><|return|>",
            "plain < text <|",
            " to=functions.f<|channel|>commentary json<|message|>{\"a\": [1]}",
            "<|channel|>commentary to=browser.search<|message|>q<|end|>",
        ];
        for text in texts {
            for tools in [false, true] {
                let whole = harmony(HARMONY_PROMPT, tools, text);
                for parts in cuttings(text) {
                    let mut p = ReplyParser::with_syntax(HARMONY_PROMPT, tools, CallSyntax::Harmony);
                    assert!(!p.in_reasoning());
                    let mut streamed: Reply = parts.iter().flat_map(|s| p.push(s)).collect();
                    streamed.extend(p.finish());
                    assert_eq!(streamed, whole, "{text:?} as {parts:?}, tools {tools}");
                }
            }
        }
    }
}
