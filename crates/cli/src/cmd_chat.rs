//! `smoe chat`: an interactive conversation that keeps its KV cache between turns.

use crate::cmd_run::{print_summaries, GenArgs, ModelArgs};
use crate::device::OnEngine;
use anyhow::{bail, Context, Result};
use serde_json::json;
use smoe_engine::instrument::Instrument;
use smoe_engine::{Backend, Conversation, Engine, FinishReason, NoObserver, OpenReport, Overflow, Precision, Turn};
use smoe_text::{Piece, ReplyParser};
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct ChatArgs {
    pub vault: PathBuf,
    pub system: Option<String>,
    pub no_think: bool,
    pub overflow: Overflow,
    pub reference: bool,
    pub trace: Option<PathBuf>,
    pub gen: GenArgs,
    pub model: ModelArgs,
}

const HELP: &str = "commands:
  /help            this list
  /reset           forget the conversation (the system prompt stays)
  /system TEXT     set the system prompt (empty TEXT removes it)
  /think on|off    let the model think (shown dimmed) or not (enable_thinking=false, hidden)
  /save FILE       write the conversation as JSON
  /load FILE       continue a conversation saved with /save
  /stats           timings, cache reuse and expert I/O of the last turn
Ctrl-C stops a reply; Ctrl-D (or /exit) quits.";

/// Lines typed at a terminal (with editing and history) or read from a pipe.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Lines(std::io::Lines<std::io::StdinLock<'static>>),
}

impl Input {
    /// The next line; `None` at end of input.
    fn next(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(ed) => loop {
                match ed.readline(">>> ") {
                    Ok(mut line) => {
                        // A trailing backslash continues the message on the next line.
                        while line.ends_with('\\') {
                            line.pop();
                            line.push('\n');
                            match ed.readline("... ") {
                                Ok(more) => line.push_str(&more),
                                Err(_) => break,
                            }
                        }
                        let _ = ed.add_history_entry(line.as_str());
                        return Ok(Some(line));
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) => continue,
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            },
            Input::Lines(lines) => Ok(lines.next().transpose()?),
        }
    }
}

/// The state of the REPL besides the conversation, for an engine on any backend.
struct Chat<'e, B: Backend> {
    engine: &'e Engine<B>,
    conv: Conversation<B>,
    gen: GenArgs,
    show_thinking: bool,
    color: bool,
    last: Option<(Turn, Instrument, smoe_store::StoreStats)>,
    cancel: Arc<AtomicBool>,
    trace: Option<std::fs::File>,
}

pub fn run_chat(a: ChatArgs) -> Result<()> {
    let precision = if a.reference { Precision::Reference } else { Precision::Fast };
    let (model, vault, ctx) = (a.model.clone(), a.vault.clone(), a.gen.ctx);
    model.open_on(&vault, precision, ctx, a)
}

impl OnEngine for ChatArgs {
    type Out = ();
    fn run<B: Backend + 'static>(self, engine: Engine<B>, _: OpenReport) -> Result<()> {
        chat_on(self, &engine)
    }
}

fn chat_on<B: Backend>(a: ChatArgs, engine: &Engine<B>) -> Result<()> {
    if engine.template.is_none() {
        bail!("{} has no chat template; use `smoe run --raw` for plain completion", a.vault.display());
    }
    let mut conv = Conversation::new(&engine.model, a.system.clone());
    conv.overflow = a.overflow;
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("install the Ctrl-C handler")?;
    let interactive = std::io::stdin().is_terminal();
    let mut input = if interactive {
        let mut ed = rustyline::DefaultEditor::new()?;
        if let Some(h) = history_path() {
            let _ = ed.load_history(&h);
        }
        Input::Editor(Box::new(ed))
    } else {
        Input::Lines(std::io::stdin().lock().lines())
    };
    let trace = match &a.trace {
        Some(p) => Some(std::fs::File::create(p).with_context(|| format!("create {}", p.display()))?),
        None => None,
    };
    let mut chat =
        Chat { engine, conv, gen: a.gen, show_thinking: true, color: std::io::stdout().is_terminal(), last: None, cancel, trace };
    if a.no_think {
        chat.set_think(false);
    }
    if interactive {
        eprintln!("context {} tokens; /help for commands, Ctrl-D to quit", chat.gen.ctx.unwrap_or(engine.ctx));
    }
    while let Some(line) = input.next()? {
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            continue;
        }
        let keep_going = if let Some(cmd) = line.strip_prefix('/') { chat.command(cmd) } else { chat.turn(line).map(|_| true) };
        match keep_going {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
    if let (Input::Editor(ed), Some(h)) = (&mut input, history_path()) {
        let _ = std::fs::create_dir_all(h.parent().unwrap_or(Path::new(".")));
        let _ = ed.save_history(&h);
    }
    Ok(())
}

fn history_path() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/smoe/chat_history"))
}

impl<B: Backend> Chat<'_, B> {
    fn set_think(&mut self, on: bool) {
        self.show_thinking = on;
        if on {
            self.conv.kwargs.remove("enable_thinking");
        } else {
            self.conv.kwargs.insert("enable_thinking".into(), false.into());
        }
    }

    /// Runs a slash command; `Ok(false)` quits.
    fn command(&mut self, cmd: &str) -> Result<bool> {
        let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(n, a)| (n, a.trim()));
        match name {
            "help" | "?" => eprintln!("{HELP}"),
            "exit" | "quit" => return Ok(false),
            "reset" => {
                self.conv.reset();
                eprintln!("[conversation cleared]");
            }
            "system" => {
                self.conv.system = (!arg.is_empty()).then(|| arg.to_string());
                eprintln!("[system prompt {}]", if arg.is_empty() { "removed" } else { "set" });
            }
            "think" => match arg {
                "on" => self.set_think(true),
                "off" => self.set_think(false),
                _ => bail!("usage: /think on|off"),
            },
            "save" => {
                if arg.is_empty() {
                    bail!("usage: /save FILE");
                }
                let v =
                    json!({"smoe_conversation": 1, "system": self.conv.system, "messages": self.conv.messages, "kwargs": self.conv.kwargs});
                std::fs::write(arg, serde_json::to_string_pretty(&v)?).with_context(|| format!("write {arg}"))?;
                eprintln!("[saved {} messages to {arg}]", self.conv.messages.len());
            }
            "load" => {
                if arg.is_empty() {
                    bail!("usage: /load FILE");
                }
                let text = std::fs::read_to_string(arg).with_context(|| format!("read {arg}"))?;
                let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{arg} is not JSON"))?;
                let messages = v["messages"].as_array().with_context(|| format!("{arg}: no \"messages\" array"))?;
                if let Some(bad) = messages.iter().find(|m| !m["role"].is_string() || !m["content"].is_string()) {
                    bail!("{arg}: every message needs string \"role\" and \"content\", found {bad}");
                }
                self.conv.messages = messages.clone();
                self.conv.system = v["system"].as_str().map(str::to_string);
                self.conv.kwargs = v["kwargs"].as_object().cloned().unwrap_or_default();
                self.show_thinking = self.conv.kwargs.get("enable_thinking") != Some(&false.into());
                eprintln!("[loaded {} messages from {arg}]", messages.len());
            }
            "stats" => match &self.last {
                None => eprintln!("[no turn yet]"),
                Some((t, ins, store)) => {
                    let s = &t.generation.stats;
                    eprintln!(
                        "last turn: prompt {} tokens ({} reused from the cache, {} prefilled), {} generated; ttft {:.0} ms, prefill {:.1} tok/s, decode {:.1} tok/s",
                        s.prompt_tokens,
                        s.prompt_tokens - s.prefilled_tokens,
                        s.prefilled_tokens,
                        s.generated_tokens,
                        s.ttft_seconds * 1e3,
                        s.prefill_tok_s(),
                        s.decode_tok_s()
                    );
                    eprintln!(
                        "experts: {} uses, hit rate {:.3}, {:.1} MiB read",
                        store.hits + store.misses,
                        store.hit_rate(),
                        store.bytes_read as f64 / (1u64 << 20) as f64
                    );
                    print_summaries(ins, s.prefilled_tokens.div_ceil(self.engine.model.prefill_chunk()));
                }
            },
            other => bail!("unknown command /{other}; /help lists them"),
        }
        Ok(true)
    }

    /// One user turn: generate, stream, report.
    fn turn(&mut self, text: &str) -> Result<()> {
        self.cancel.store(false, Ordering::SeqCst);
        let mut opts = self.gen.options(self.engine);
        opts.keep_prompt_logits = self.trace.is_some();
        // Whether the reply starts inside <think> depends on how the template ends the prompt.
        let mut transcript = self.conv.transcript();
        transcript.push(json!({"role": "user", "content": text}));
        let prompt = self.engine.render_chat(&transcript, None, &self.conv.kwargs)?;
        if opts.grammar.is_some() {
            opts.grammar_after = smoe_text::grammar_starts_after(&prompt, self.engine.call_syntax()).map(str::to_string);
        }
        let mut parser = ReplyParser::with_syntax(&prompt, false, self.engine.call_syntax());
        let (dim, plain) = if self.color { ("\x1b[2m", "\x1b[0m") } else { ("", "") };
        let mut printer = Printer { out: std::io::stdout().lock(), show_thinking: self.show_thinking, dim, plain, in_thinking: false };
        self.conv.session().state_mut().instrument = Some(Instrument::default());
        let engine = self.engine;
        let store0 = engine.model.experts().stats();
        let cancel = self.cancel.clone();
        let result = self.conv.turn(engine, text, &opts, &mut NoObserver, &mut |_, piece| {
            printer.emit(parser.push(piece));
            !cancel.load(Ordering::SeqCst)
        });
        printer.emit(parser.finish());
        printer.finish();
        let turn = result?;
        let store = engine.model.experts().stats().since(&store0);
        let g = &turn.generation;
        if turn.dropped_messages > 0 {
            eprintln!("[context: dropped the {} oldest messages to fit {} tokens]", turn.dropped_messages, opts.ctx);
        }
        let why = match g.finish {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "stopped by Ctrl-C",
        };
        let s = &g.stats;
        eprintln!(
            "[prompt {} tok, {} prefilled; generated {} tok ({why}); ttft {:.0} ms, decode {:.1} tok/s, expert hit rate {:.2}]",
            s.prompt_tokens,
            s.prefilled_tokens,
            s.generated_tokens,
            s.ttft_seconds * 1e3,
            s.decode_tok_s(),
            store.hit_rate()
        );
        if let Some(f) = &mut self.trace {
            let v = json!({
                "prompt_ids": turn.prompt,
                "prompt_tokens": s.prompt_tokens,
                "prefilled_tokens": s.prefilled_tokens,
                "tokens": g.tokens,
                "text": g.text,
                "prompt_logits": g.prompt_logits,
            });
            writeln!(f, "{v}")?;
        }
        let ins = self.conv.session().state_mut().instrument.take().unwrap_or_default();
        self.last = Some((turn, ins, store));
        Ok(())
    }
}

/// Streams reply pieces to stdout, thinking dimmed (or hidden).
struct Printer<'a> {
    out: std::io::StdoutLock<'a>,
    show_thinking: bool,
    dim: &'static str,
    plain: &'static str,
    in_thinking: bool,
}

impl Printer<'_> {
    fn emit(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(_) if !self.show_thinking => {}
                Piece::Reasoning(s) => {
                    if !self.in_thinking {
                        let _ = write!(self.out, "{}<think>", self.dim);
                        self.in_thinking = true;
                    }
                    let _ = write!(self.out, "{s}");
                }
                Piece::Content(s) => {
                    if self.in_thinking {
                        let _ = write!(self.out, "</think>{}", self.plain);
                        self.in_thinking = false;
                    }
                    let _ = write!(self.out, "{s}");
                }
                // The chat offers no tools: the parser returns none.
                Piece::ToolCall(c) => {
                    let _ = write!(self.out, "{}", c.text);
                }
            }
        }
        let _ = self.out.flush();
    }

    fn finish(&mut self) {
        if self.in_thinking {
            let _ = write!(self.out, "{}", self.plain);
        }
        let _ = writeln!(self.out);
        let _ = self.out.flush();
    }
}
