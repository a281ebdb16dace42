//! Constrained output: the reply held to a grammar, token by token, through llguidance (the
//! structured-output engine llama.cpp, vLLM and mistral.rs use). Two grammars:
//! - JSON matching a schema (`response_format` of type `json_object` or `json_schema`);
//! - one or more tool calls in the model's `<tool_call>` syntax, each naming one of the offered
//!   tools with arguments matching its parameter schema (`tool_choice` `required` or a named
//!   function, Anthropic's `any` or `tool`).
//!
//! Before each token [`Constraint::mask`] sets the logits of every token the grammar does not
//! allow to minus infinity; [`Constraint::commit`] feeds it the token sampled. Once the grammar
//! is complete only the end-of-sequence token is allowed. A reply that begins inside reasoning
//! (`<think>`) is left free until `</think>`, then held to the grammar.

use crate::{CallSyntax, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};
use std::sync::Arc;

/// A constraint could not be built or followed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// What the reply must be.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputGrammar {
    /// A JSON value matching this JSON schema (`{"type": "object"}` for `json_object`).
    Json(Json),
    /// One or more calls, each to one of these tools (OpenAI `function` objects: `name`,
    /// `parameters`), in `syntax`.
    ToolCalls {
        /// The tools that may be called.
        tools: Vec<Json>,
        /// How the model writes a call.
        syntax: CallSyntax,
        /// Whether several calls may follow one another (OpenAI's `parallel_tool_calls`,
        /// true by default); false: exactly one.
        parallel: bool,
    },
}

/// JSON written the way Python's `json.dumps` writes it (what chat templates render and
/// models are trained on), with no room for runs of whitespace: an undertrained or random
/// model could otherwise pad forever.
fn compact(schema: Json) -> Json {
    // `true` (any JSON value) as the empty schema, so that it takes the options too.
    let mut schema = if schema == Json::Bool(true) { json!({}) } else { schema };
    if let Json::Object(o) = &mut schema {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}),
        );
    }
    schema
}

impl OutputGrammar {
    /// The llguidance grammar, for a vocabulary in which `special(text)` is the id of `text`
    /// when it is a special token (referenced by id, since a grammar's text never matches one).
    fn top_level(&self, special: &dyn Fn(&str) -> Option<u32>) -> Result<TopLevelGrammar, ConstraintError> {
        match self {
            OutputGrammar::Json(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(ConstraintError(format!("a JSON schema must be an object, got {schema}")));
                }
                Ok(TopLevelGrammar::from_json_schema(compact(schema.clone())))
            }
            OutputGrammar::ToolCalls { tools, syntax, parallel } => {
                if *syntax != CallSyntax::ToolCallTags {
                    return Err(ConstraintError(format!(
                        "calls in this model's {syntax:?} syntax cannot be enforced (only <tool_call> JSON calls can)"
                    )));
                }
                if tools.is_empty() {
                    return Err(ConstraintError("a tool call was required but no tools were given".into()));
                }
                let mut defs = serde_json::Map::new();
                let calls: Vec<Json> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let params =
                            t.get("parameters").filter(|p| p.is_object()).cloned().unwrap_or(json!({"type": "object", "properties": {}}));
                        let mut params = hoist_definitions(params, &format!("tool{i}"), &mut defs);
                        // The arguments hold the declared parameters only (as OpenAI's strict
                        // mode requires): an invented name would fail at the tool anyway.
                        if params.get("properties").is_some() && params.get("additionalProperties").is_none() {
                            params["additionalProperties"] = json!(false);
                        }
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": t["name"]}, "arguments": params},
                            "required": ["name", "arguments"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let call = compact(json!({"anyOf": calls, "$defs": defs}));
                let tag = |t: &str| special(t).map_or_else(|| lark_string(t), |id| format!("<[{id}]>"));
                let lark = format!(
                    "start: {}\ncall: {} \"\\n\" %json {} \"\\n\" {}\n",
                    if *parallel { "call (\"\\n\" call)*" } else { "call" },
                    tag("<tool_call>"),
                    call,
                    tag("</tool_call>")
                );
                Ok(TopLevelGrammar::from_lark(lark))
            }
        }
    }
}

/// A tool's parameter schema made to live inside the call grammar's schema: the `$ref`s it
/// makes to its own root or definitions (`#`, `#/$defs/X`, `#/definitions/X`: what pydantic and
/// zod write) would otherwise resolve against the wrapper around every tool. Its definitions
/// move to `defs` under `PREFIX.X` (its root, when referenced, under `PREFIX`) and its `$ref`s
/// follow them.
fn hoist_definitions(mut schema: Json, prefix: &str, defs: &mut serde_json::Map<String, Json>) -> Json {
    fn rewrite(v: &mut Json, prefix: &str, root_used: &mut bool) {
        match v {
            Json::Object(o) => {
                if let Some(Json::String(r)) = o.get_mut("$ref") {
                    if r == "#" {
                        *root_used = true;
                        *r = format!("#/$defs/{prefix}");
                    } else if let Some(name) = r.strip_prefix("#/$defs/").or_else(|| r.strip_prefix("#/definitions/")) {
                        *r = format!("#/$defs/{prefix}.{name}");
                    }
                }
                o.values_mut().for_each(|x| rewrite(x, prefix, root_used));
            }
            Json::Array(a) => a.iter_mut().for_each(|x| rewrite(x, prefix, root_used)),
            _ => {}
        }
    }
    let mut root_used = false;
    rewrite(&mut schema, prefix, &mut root_used);
    if let Json::Object(o) = &mut schema {
        for key in ["$defs", "definitions"] {
            if let Some(Json::Object(d)) = o.remove(key) {
                for (name, def) in d {
                    defs.insert(format!("{prefix}.{name}"), def);
                }
            }
        }
    }
    if root_used {
        defs.insert(prefix.to_string(), schema.clone());
    }
    schema
}

/// `text` as a Lark string literal.
fn lark_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// A model's vocabulary indexed for constrained output: built once per model (a trie of every
/// token's bytes), shared by its constrained requests.
pub struct ConstraintVocab {
    factory: Arc<ParserFactory>,
    specials: std::collections::HashMap<String, u32>,
    eos: Vec<u32>,
}

impl ConstraintVocab {
    /// Indexes `tokenizer` for a model whose logits have `vocab_size` entries (ids beyond the
    /// tokenizer's are never allowed) and that ends a reply with any of `eos` (at least one).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<ConstraintVocab, ConstraintError> {
        let crate::TokenBytes { mut words, specials } = tokenizer.token_bytes().map_err(|e| ConstraintError(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(ConstraintError(format!("the tokenizer has {} tokens but the model only {vocab_size} logits", words.len())));
        }
        // Ids with no token (padding rows) become unnamed special tokens: never text, so never
        // allowed unless a grammar names them.
        let unused = |id: usize| [&[TokTrie::SPECIAL_TOKEN_MARKER][..], format!("<[unused {id}]>").as_bytes()].concat();
        words.resize(vocab_size, Vec::new());
        for (id, w) in words.iter_mut().enumerate().filter(|(_, w)| w.is_empty()) {
            *w = unused(id);
        }
        let Some(&first) = eos.first() else { return Err(ConstraintError("no end-of-sequence token to end a reply".into())) };
        if let Some(bad) = eos.iter().find(|&&e| e as usize >= vocab_size) {
            return Err(ConstraintError(format!("end-of-sequence id {bad} is outside the vocabulary of {vocab_size}")));
        }
        let info = TokRxInfo::new(vocab_size as u32, first);
        let env = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words).with_eos_tokens(eos)));
        let mut factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv)).map_err(|e| ConstraintError(e.to_string()))?;
        factory.quiet();
        Ok(ConstraintVocab { factory: Arc::new(factory), specials, eos: eos.to_vec() })
    }

    /// A constraint holding a reply to `grammar`. With `after` set (`</think>` for a reply
    /// that starts in reasoning) the reply is free until that text has been generated.
    pub fn start(&self, grammar: &OutputGrammar, after: Option<&str>) -> Result<Constraint, ConstraintError> {
        let top = grammar.top_level(&|t| self.specials.get(t).copied())?;
        // Schemas come from clients: a panic while compiling one is this request's error, not
        // the generation thread's end.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| ConstraintError("the grammar could not be compiled".into()))?
            .map_err(|e| ConstraintError(format!("the grammar was refused: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(format!("the grammar was refused: {e}")));
        }
        Ok(Constraint { matcher, eos: self.eos.clone(), waiting_for: after.map(str::to_string), seen: String::new() })
    }
}

/// One reply held to a grammar.
pub struct Constraint {
    matcher: Matcher,
    /// The ids that end the reply (allowed once the grammar is complete).
    eos: Vec<u32>,
    /// Text that must be generated before the grammar applies.
    waiting_for: Option<String>,
    /// Text generated while waiting.
    seen: String,
}

impl Constraint {
    /// Whether the grammar applies to the next token (not while waiting for the end of
    /// reasoning).
    pub fn active(&self) -> bool {
        self.waiting_for.is_none()
    }

    /// Forbids (minus infinity) every token the grammar does not allow next. Fails when the
    /// grammar allows none.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if !self.active() {
            return Ok(());
        }
        let allowed: SimpleVob = self.matcher.compute_mask_or_eos().map_err(|e| ConstraintError(e.to_string()))?;
        if allowed.is_zero() {
            return Err(ConstraintError("the grammar allows no token".into()));
        }
        for (id, l) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Feeds the grammar the token sampled (and its text, for the wait for `after`).
    pub fn commit(&mut self, token: u32, text: &str) -> Result<(), ConstraintError> {
        if let Some(after) = &self.waiting_for {
            self.seen.push_str(text);
            if self.seen.contains(after.as_str()) {
                self.waiting_for = None;
                self.seen = String::new();
            } else {
                // Only a tail that could still begin `after` is kept (the reasoning may be long).
                let keep = self.seen.len().saturating_sub(after.len());
                let cut = (keep..=self.seen.len()).find(|&i| self.seen.is_char_boundary(i)).unwrap_or(self.seen.len());
                self.seen.drain(..cut);
            }
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| ConstraintError(e.to_string()))
    }

    /// Whether `id` ends a reply held to the grammar (the mask allows it only once the grammar
    /// is complete).
    pub fn ends_with(&self, id: u32) -> bool {
        self.active() && self.eos.contains(&id)
    }

    /// Whether the grammar is complete (only the end of the reply may follow).
    pub fn complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_tokenizer() -> Tokenizer {
        Tokenizer::from_json(include_str!("../../../testdata/hf/qwen3_moe/tokenizer.json")).unwrap()
    }

    /// Drives a constraint with a "model" that prefers the tokens of `wanted` in order, then
    /// the end, but takes whatever the grammar allows (lowest id) when that is refused.
    fn drive(vocab: &ConstraintVocab, tok: &Tokenizer, grammar: &OutputGrammar, wanted: &str, n: usize, eos: u32) -> String {
        let mut c = vocab.start(grammar, None).unwrap();
        let mut prefer = tok.encode(wanted).unwrap().into_iter();
        let mut out = Vec::new();
        for _ in 0..400 {
            let mut logits = vec![0.0f32; n];
            match prefer.next() {
                Some(p) => logits[p as usize] = 10.0,
                None => logits[eos as usize] = 10.0,
            }
            c.mask(&mut logits).unwrap();
            let best = (0..n).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap() as u32;
            if best == eos {
                assert!(c.complete() || c.matcher.is_accepting().unwrap());
                return tok.decode(&out, false);
            }
            c.commit(best, "").unwrap();
            out.push(best);
        }
        panic!("no end: {}", tok.decode(&out, false))
    }

    #[test]
    fn json_schema_output_follows_the_schema() {
        let tok = fixture_tokenizer();
        let eos = tok.token_id("<|im_end|>").unwrap();
        let n = tok.vocab_size() + 5;
        let vocab = ConstraintVocab::new(&tok, n, &[eos]).unwrap();
        let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 30}},
                            "required": ["city", "days"], "additionalProperties": false});
        // A model that wants to write prose gets a JSON object anyway.
        let text = drive(&vocab, &tok, &OutputGrammar::Json(schema.clone()), "Sure! Here it is", n, eos);
        let v: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["city"].is_string() && v["days"].is_i64(), "{v}");
        // One that writes the right object writes exactly it.
        let text = drive(&vocab, &tok, &OutputGrammar::Json(schema), r#"{"city": "Paris", "days": 3}"#, n, eos);
        assert_eq!(text, r#"{"city": "Paris", "days": 3}"#);
    }

    #[test]
    fn tool_calls_name_an_offered_tool_with_its_arguments() {
        let tok = fixture_tokenizer();
        let eos = tok.token_id("<|im_end|>").unwrap();
        let n = tok.vocab_size();
        let vocab = ConstraintVocab::new(&tok, n, &[eos]).unwrap();
        let tools = vec![
            json!({"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}),
            json!({"name": "get_time", "parameters": {"type": "object", "properties": {}}}),
        ];
        let g = OutputGrammar::ToolCalls { tools: tools.clone(), syntax: CallSyntax::ToolCallTags, parallel: true };
        let text = drive(&vocab, &tok, &g, "I think the answer is 42.", n, eos);
        let reply = crate::parse_reply("", true, &text);
        assert_eq!(reply.tool_calls.len(), 1, "{text:?}");
        let call = &reply.tool_calls[0];
        assert!(call.name == "get_weather" || call.name == "get_time", "{text:?}");
        let args: Json = serde_json::from_str(&call.arguments).unwrap();
        if call.name == "get_weather" {
            assert!(args["city"].is_string(), "{text:?}");
        }
        let wanted = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert_eq!(drive(&vocab, &tok, &g, wanted, n, eos), wanted);
        // Several calls when parallel calls are allowed; exactly one when not.
        let two = format!("{wanted}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>");
        assert_eq!(drive(&vocab, &tok, &g, &two, n, eos), two);
        let single = OutputGrammar::ToolCalls { tools, syntax: CallSyntax::ToolCallTags, parallel: false };
        assert_eq!(drive(&vocab, &tok, &single, &two, n, eos), wanted);
    }

    /// Tool parameters that refer to their own definitions (as pydantic writes nested models)
    /// still compile and are followed inside the call grammar; control tokens such as
    /// `<tool_call>` (an added, non-special token in Qwen's vocabulary) never appear inside a
    /// string; and a reply may end with any of the model's end ids.
    #[test]
    fn tool_definitions_control_tokens_and_end_ids() {
        let tok = fixture_tokenizer();
        let (eos, endoftext) = (tok.token_id("<|im_end|>").unwrap(), tok.token_id("<|endoftext|>").unwrap());
        let n = tok.vocab_size();
        let vocab = ConstraintVocab::new(&tok, n, &[eos, endoftext]).unwrap();
        let pydantic = json!({
            "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                "required": ["city"], "additionalProperties": false}},
            "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
        });
        let tools = vec![
            json!({"name": "weather", "parameters": pydantic}),
            json!({"name": "other", "parameters": {"$ref": "#/definitions/X", "definitions": {"X": {"type": "object", "properties": {}}}}}),
        ];
        let g = OutputGrammar::ToolCalls { tools, syntax: CallSyntax::ToolCallTags, parallel: false };
        let wanted = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"place\": {\"city\": \"Oslo\"}}}\n</tool_call>";
        assert_eq!(drive(&vocab, &tok, &g, wanted, n, eos), wanted);

        let mut c = vocab.start(&OutputGrammar::Json(json!({"type": "object", "properties": {"a": {"type": "string"}}})), None).unwrap();
        for id in tok.encode("{\"a\": \"x").unwrap() {
            let mut logits = vec![0.0f32; n];
            c.mask(&mut logits).unwrap();
            assert!(logits[id as usize].is_finite());
            c.commit(id, "").unwrap();
        }
        let mut logits = vec![0.0f32; n];
        c.mask(&mut logits).unwrap();
        for control in ["<tool_call>", "</think>", "<|im_end|>"] {
            assert_eq!(logits[tok.token_id(control).unwrap() as usize], f32::NEG_INFINITY, "{control} inside a string");
        }
        let mut done = vocab.start(&OutputGrammar::Json(json!({"const": 1})), None).unwrap();
        let one = tok.encode("1").unwrap();
        done.commit(one[0], "").unwrap();
        let mut logits = vec![0.0f32; n];
        done.mask(&mut logits).unwrap();
        let allowed: Vec<usize> = (0..n).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(allowed, vec![endoftext as usize, eos as usize], "either end id, nothing else");
    }

    #[test]
    fn a_reply_in_reasoning_is_free_until_it_ends() {
        let tok = fixture_tokenizer();
        let eos = tok.token_id("<|im_end|>").unwrap();
        let vocab = ConstraintVocab::new(&tok, tok.vocab_size(), &[eos]).unwrap();
        let mut c = vocab.start(&OutputGrammar::Json(json!({"type": "object"})), Some("</think>")).unwrap();
        let mut logits = vec![1.0f32; tok.vocab_size()];
        c.mask(&mut logits).unwrap();
        assert!(logits.iter().all(|&l| l == 1.0), "nothing is masked while reasoning");
        c.commit(0, "because </thi").unwrap();
        assert!(!c.active());
        c.commit(0, "nk>\n\n").unwrap();
        assert!(c.active());
        c.mask(&mut logits).unwrap();
        let open = tok.encode("{").unwrap()[0] as usize;
        assert!(logits[open].is_finite());
        assert!(logits.iter().filter(|l| l.is_finite()).count() < tok.vocab_size() / 4);
    }

    #[test]
    fn bad_grammars_are_refused_with_a_reason() {
        let tok = fixture_tokenizer();
        let eos = tok.token_id("<|im_end|>").unwrap();
        let vocab = ConstraintVocab::new(&tok, tok.vocab_size(), &[eos]).unwrap();
        let e = |g: OutputGrammar| vocab.start(&g, None).err().expect("refused").to_string();
        assert!(e(OutputGrammar::Json(json!([1, 2]))).contains("must be an object"));
        assert!(e(OutputGrammar::ToolCalls { tools: vec![], syntax: CallSyntax::ToolCallTags, parallel: true }).contains("no tools"));
        assert!(e(OutputGrammar::ToolCalls { tools: vec![json!({"name": "f"})], syntax: CallSyntax::MiniMax, parallel: true })
            .contains("MiniMax"));
        assert!(e(OutputGrammar::Json(json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))).contains("refused"));
        assert!(ConstraintVocab::new(&tok, 10, &[eos]).is_err(), "a tokenizer larger than the logits");
    }

    /// Schemas a hostile client might send compile or are refused, quickly, and a constraint
    /// from one that compiles still masks (llguidance bounds its work per token).
    #[test]
    fn hostile_schemas_are_bounded() {
        let tok = fixture_tokenizer();
        let eos = tok.token_id("<|im_end|>").unwrap();
        let vocab = ConstraintVocab::new(&tok, tok.vocab_size(), &[eos]).unwrap();
        let mut deep = json!({"type": "integer"});
        for _ in 0..100 {
            deep = json!({"type": "array", "items": deep});
        }
        let many: Vec<String> = (0..5000).map(|i| format!("value-{i}")).collect();
        let schemas = [
            json!({"$ref": "#"}),
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            deep,
            json!({"type": "string", "pattern": "^(a+)+$"}),
            json!({"enum": many}),
            json!({"type": "string", "minLength": 1000000}),
            json!({"allOf": [{"type": "string"}, {"type": "integer"}]}),
        ];
        for schema in schemas {
            let t = std::time::Instant::now();
            if let Ok(mut c) = vocab.start(&OutputGrammar::Json(schema.clone()), None) {
                let mut logits = vec![0.0f32; tok.vocab_size()];
                let _ = c.mask(&mut logits);
            }
            assert!(t.elapsed().as_secs() < 20, "{schema}: {:?}", t.elapsed());
        }
    }
}
