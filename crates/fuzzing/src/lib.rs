//! The fuzz targets of smoe's parsers, as plain functions of the fuzzer's bytes.
//!
//! smoe reads files and requests that strangers write. Each function here feeds arbitrary
//! bytes to one parser the way smoe uses it and fails only by panicking: `fuzz/` runs them
//! under libFuzzer (`cargo +nightly fuzz run TARGET`), and `tests/corpus.rs` replays the seed
//! corpora (made from the fixtures) and their mutations on stable, so CI checks every target
//! in about a minute. A parser may refuse any input; it may not panic, hang, or allocate what
//! the input could not hold.

use serde_json::Value as Json;
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A target: the name its cargo-fuzz binary and corpus folder have, and its function.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: [Target; 10] = [
    ("gguf", gguf),
    ("vault", vault),
    ("safetensors", safetensors),
    ("config", config),
    ("tokenizer", tokenizer),
    ("detokenizer", detokenizer),
    ("chat_template", chat_template),
    ("openai_request", openai_request),
    ("anthropic_request", anthropic_request),
    ("output_grammar", output_grammar),
];

/// `data` as a file the file-reading parsers can open (one per thread and target, rewritten
/// for each input), removed when the input is done with.
fn as_file(target: &str, data: &[u8]) -> InputFile {
    let p = std::env::temp_dir().join(format!("smoe-fuzz-{}-{:?}-{target}", std::process::id(), std::thread::current().id()));
    let mut f = std::fs::File::create(&p).expect("the temporary directory is writable");
    f.write_all(data).expect("the temporary directory has room");
    InputFile(p)
}

/// A fuzz input written to the temporary directory; dropping it deletes the file, so a run
/// (or CI) leaves nothing behind.
struct InputFile(PathBuf);

impl Drop for InputFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A GGUF file: the header, then everything smoe derives from it (architecture, tokenizer,
/// chat template, tensor views) as `GgufModel::open` does.
pub fn gguf(data: &[u8]) {
    let input = as_file("gguf", data);
    let p = &input.0;
    if let Ok(g) = smoe_formats::gguf::Gguf::open(p) {
        for t in &g.tensors {
            let _ = (t.len(), t.rows(), t.cols());
        }
    }
    let _ = smoe_formats::gguf::GgufModel::open(p);
}

/// A vault: header, manifest and architecture description, then a checksum pass over it.
pub fn vault(data: &[u8]) {
    let input = as_file("vault", data);
    let p = &input.0;
    if let Ok(v) = smoe_vault::Vault::open(p) {
        let _ = v.verify(&mut |_| {});
    }
}

/// A safetensors file's header.
pub fn safetensors(data: &[u8]) {
    let input = as_file("safetensors", data);
    let p = &input.0;
    let _ = smoe_formats::safetensors::read_header(p);
}

/// A config.json into the architecture description.
pub fn config(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<Json>(data) {
        let _ = smoe_formats::hf::architecture_from_config(&v);
    }
}

/// A tokenizer.json, then a round trip of a fixed text through it.
pub fn tokenizer(data: &[u8]) {
    let Ok(json) = std::str::from_utf8(data) else { return };
    if let Ok(t) = smoe_text::Tokenizer::from_json(json) {
        if let Ok(ids) = t.encode("Hello, wörld! <|im_start|>user\n12345 😀") {
            let _ = t.decode(&ids, false);
        }
        let _ = (t.vocab_size(), t.token(0), t.token(u32::MAX));
    }
}

/// The fixtures' tokenizer, shared by the targets that need a working one.
fn fixture_tokenizer() -> &'static smoe_text::Tokenizer {
    static T: OnceLock<smoe_text::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        smoe_text::Tokenizer::from_json(include_str!("../../../testdata/hf/qwen3_moe/tokenizer.json")).expect("the fixture tokenizer loads")
    })
}

/// Arbitrary token ids (4 bytes each, any value) through the streaming detokenizer: what it
/// streams, flushed, is what decoding them all at once gives.
pub fn detokenizer(data: &[u8]) {
    let t = fixture_tokenizer();
    let ids: Vec<u32> = data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut d = smoe_text::Detokenizer::new(t.clone(), false);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&d.push(id));
    }
    streamed.push_str(&d.flush());
    let known: Vec<u32> = ids.iter().copied().filter(|&i| (i as usize) < t.vocab_size()).collect();
    if known.len() == ids.len() {
        assert_eq!(streamed, t.decode(&ids, false), "streamed text differs from the whole decode of {ids:?}");
    }
}

/// Hostile messages and tool schemas through a real chat template (Qwen3's, which the
/// fixtures and the demo model use): `{"messages": [...], "tools": [...]}` or a bare list.
pub fn chat_template(data: &[u8]) {
    static T: OnceLock<smoe_text::ChatTemplate> = OnceLock::new();
    let t = T.get_or_init(|| {
        smoe_text::ChatTemplate::new(include_str!("../../../testdata/qwen3_chat_template.jinja"), None, Some("<|im_end|>"))
            .expect("the Qwen3 template compiles")
    });
    let Ok(v) = serde_json::from_slice::<Json>(data) else { return };
    let (messages, tools) = match &v {
        Json::Array(m) => (m.clone(), None),
        _ => (v.get("messages").and_then(Json::as_array).cloned().unwrap_or_default(), v.get("tools").and_then(Json::as_array).cloned()),
    };
    let extra = v.get("kwargs").and_then(Json::as_object).cloned().unwrap_or_default();
    let _ = t.render(&messages, tools.as_deref(), true, &extra);
}

/// An OpenAI request body into what the server takes from it before it needs a model.
pub fn openai_request(data: &[u8]) {
    use smoe_server::params;
    let Ok(v) = params::parse_body(data) else { return };
    let _ = smoe_server::openai::chat_request(&v);
    let _ = params::sampling_request(&v);
    let _ = params::stop_list(&v, "stop");
}

/// An Anthropic messages body likewise.
pub fn anthropic_request(data: &[u8]) {
    use smoe_server::params;
    let Ok(v) = params::parse_body(data) else { return };
    let _ = smoe_server::anthropic::messages_request(&v);
    let _ = params::sampling_request(&v);
    let _ = params::stop_list(&v, "stop_sequences");
}

/// A client's JSON schema or tool list (`{"tools": [...]}`) compiled into the grammar that holds
/// a reply (llguidance, over the fixtures' vocabulary), then a few tokens masked and fed to it:
/// the lowest id it allows each time.
pub fn output_grammar(data: &[u8]) {
    use smoe_text::{CallSyntax, ConstraintVocab, OutputGrammar, Tokenizer};
    static V: OnceLock<(ConstraintVocab, usize)> = OnceLock::new();
    let (vocab, n) = V.get_or_init(|| {
        let t = Tokenizer::from_json(include_str!("../../../testdata/hf/qwen3_moe/tokenizer.json")).expect("the fixture tokenizer");
        let end = t.token_id("<|im_end|>").expect("an end token");
        (ConstraintVocab::new(&t, t.vocab_size(), &[end]).expect("the fixture vocabulary indexes"), t.vocab_size())
    });
    let Ok(v) = serde_json::from_slice::<Json>(data) else { return };
    let grammar = match v.get("tools").and_then(Json::as_array) {
        Some(tools) => {
            OutputGrammar::ToolCalls { tools: tools.clone(), syntax: CallSyntax::ToolCallTags, parallel: v["parallel"] != false }
        }
        None => OutputGrammar::Json(v),
    };
    let Ok(mut c) = vocab.start(&grammar, None) else { return };
    let mut logits = vec![0f32; *n];
    for _ in 0..16 {
        logits.fill(0.0);
        if c.mask(&mut logits).is_err() || c.complete() {
            return;
        }
        let Some(id) = logits.iter().position(|l| l.is_finite()) else { panic!("a mask that allows nothing was not an error") };
        if c.commit(id as u32, "").is_err() {
            return;
        }
    }
}
