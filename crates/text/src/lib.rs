/*!
Text in and out of the model.

- [`Tokenizer`]: a Hugging Face tokenizer.json through the `tokenizers` crate (pure-Rust regex,
  no C dependencies).
- [`ChatTemplate`]: the model's Jinja chat template rendered with minijinja, with the Python
  behaviours Hugging Face templates rely on (string methods, `raise_exception`, a `tojson` that
  prints like Python's `json.dumps`, `strftime_now`).
- [`Detokenizer`]: turns a stream of ids into a stream of text that never splits a UTF-8
  character and skips ids that have no token.
- [`StopStrings`]: finds stop strings in streamed text without emitting a partial match.
- [`SectionSplitter`]: separates the text between an open and a close tag from the rest, in
  streamed text.
- [`ReplyParser`] and [`parse_reply`]: a model's reply (streamed or whole) split into
  reasoning, content and tool calls, in the formats of the supported chat templates.
- [`ConstraintVocab`] and [`Constraint`]: the reply held to a JSON schema or to calls of the
  offered tools (structured output), token by token through llguidance.

This crate knows nothing about model weights or sampling (a constraint only masks logits).
*/
#![deny(missing_docs)]

mod constrain;
mod detok;
mod reply;
mod sections;
mod stop;
mod template;
mod tokenizer;

pub use constrain::{Constraint, ConstraintError, ConstraintVocab, OutputGrammar};
pub use detok::Detokenizer;
pub use reply::{grammar_starts_after, parse_reply, parse_tool_call, CallSyntax, Piece, Reply, ReplyParser, ToolCall};
pub use sections::{Section, SectionSplitter};
pub use stop::StopStrings;
pub use template::{ChatTemplate, TemplateError};
pub use tokenizer::{TokenBytes, Tokenizer, TokenizerError};
