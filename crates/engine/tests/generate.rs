//! Generation on the trained demo model: long sampled runs repeat exactly with a seed.

use smoe_engine::{open_cpu, CpuBackend, Engine, FinishReason, GenOptions, OpenOptions, SamplingParams};
use std::path::Path;

/// The checkpoint at `rel` (from the repository root) shattered into a temporary vault, opened
/// on the CPU; the directory lives as long as the returned guard.
fn shattered(rel: &str) -> (tempfile::TempDir, Engine<CpuBackend>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.smoe");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel);
    smoe_convert::shatter(&src, &out, &Default::default(), &smoe_convert::Silent).unwrap();
    (dir, open_cpu(&out, &OpenOptions::default()).unwrap().0)
}

#[test]
fn thousand_token_sampled_generation_repeats_with_the_same_seed() {
    let (_dir, engine) = shattered("models/stdlib-moe");
    let prompt = engine.encode("import os\n\ndef main(argv):\n").unwrap();
    let gen = |seed| {
        let opts = GenOptions {
            stop_ids: Some(vec![]),
            ..GenOptions::new(1000, SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(seed), ..Default::default() }, 4096)
        };
        let mut pieces = String::new();
        let g = engine
            .generate_fresh(&prompt, &opts, &mut |_, t| {
                pieces.push_str(t);
                true
            })
            .unwrap();
        assert_eq!(pieces, g.text, "streamed pieces reassemble to the text");
        g
    };
    let (a, b, c) = (gen(1), gen(1), gen(2));
    assert_eq!(a.tokens.len(), 1000);
    assert_eq!(a.finish, FinishReason::Length);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.text, b.text);
    assert_ne!(a.tokens, c.tokens);
    assert!(!a.text.contains('\u{FFFD}'));
}

/// A session forked from another's prefix (the server's prefix cache shared across
/// conversations) computes only the tokens after it and generates what a fresh session
/// generates; the session it came from is left whole.
#[test]
fn a_forked_session_reuses_the_shared_prefix() {
    use smoe_engine::{NoObserver, Session};
    let (_dir, engine) = shattered("models/stdlib-moe");
    let shared = engine
        .encode("\"\"\"Helpers for lists, dicts and sets: the system prompt every conversation shares.\"\"\"\n\nimport os\n")
        .unwrap();
    let (a, b) = (engine.encode("def first(xs):\n").unwrap(), engine.encode("class Stack:\n").unwrap());
    let opts =
        GenOptions { stop_ids: Some(vec![]), ..GenOptions::new(24, SamplingParams { temperature: 0.0, ..Default::default() }, 4096) };
    let cat = |x: &[u32]| shared.iter().chain(x).copied().collect::<Vec<u32>>();
    let mut one = Session::new(&engine.model);
    one.generate(&engine, &cat(&a), &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    let before = one.cached_tokens().to_vec();
    let mut two = Session::fork(&engine.model, &one, shared.len()).expect("the CPU backend copies KV caches");
    assert_eq!(two.cached_tokens(), &shared[..]);
    let forked = two.generate(&engine, &cat(&b), &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    let fresh = Session::new(&engine.model).generate(&engine, &cat(&b), &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(forked.stats.prefilled_tokens, b.len(), "only the new tokens are computed");
    assert_eq!(fresh.stats.prefilled_tokens, shared.len() + b.len());
    assert_eq!(forked.tokens, fresh.tokens, "the fork generates what a fresh session does");
    assert_eq!(one.cached_tokens(), &before[..], "the first conversation is left whole");
}

/// A harmony model (gpt-oss's template): its reply keeps the channel markers, which are special
/// tokens, so the reply parser can split it; `<|return|>` and `<|call|>` end it. The gpt_oss
/// fixture is given harmony's markers as special tokens and a harmony template; the steps are
/// fed logits that pick the reply's tokens, so the path from ids to parsed reply is the one
/// the server runs.
#[test]
fn harmony_replies_keep_their_markers_and_stop_at_return_and_call() {
    use smoe_engine::Stepwise;
    use smoe_text::{ChatTemplate, ReplyParser, Tokenizer};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf/gpt_oss");
    let (_dir, mut engine) = shattered("testdata/hf/gpt_oss");
    let vocab = engine.model.arch().vocab_size as u32;
    let mut tok: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap()).unwrap();
    let markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"];
    let first = tok["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap() as u32).max().unwrap() + 1;
    for (i, m) in markers.iter().enumerate() {
        tok["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": first + i as u32, "content": m, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true
        }));
    }
    assert!(first + (markers.len() as u32) <= vocab);
    engine.tokenizer = Tokenizer::from_json(&tok.to_string()).unwrap();
    let template = "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}";
    engine.template = Some(ChatTemplate::new(template, None, None).unwrap());
    assert!(engine.harmony());
    let id = |t: &str| engine.tokenizer.token_id(t).unwrap();
    let stops = engine.default_stop_ids();
    assert!(stops.contains(&id("<|return|>")) && stops.contains(&id("<|call|>")), "{stops:?}");

    let prompt_text =
        engine.render_chat(&[serde_json::json!({"role": "user", "content": "Weather in Paris?"})], None, &Default::default()).unwrap();
    assert_eq!(prompt_text, "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant");
    let prompt = engine.encode(&prompt_text).unwrap();
    let opts = GenOptions::new(100, SamplingParams { temperature: 0.0, ..Default::default() }, 256);
    // Runs the reply `text` (then `end`) through Stepwise, each step's logits picking the next id.
    let run = |text: &str, end: &str, tools: bool| {
        let mut ids = engine.encode(text).unwrap();
        ids.push(id(end));
        ids.extend(engine.encode("never reached").unwrap());
        let mut st = engine.model.new_state(1);
        let mut g = Stepwise::start(&engine, &mut st, &prompt, &opts).unwrap();
        let mut parser = ReplyParser::with_syntax(&prompt_text, tools, engine.call_syntax());
        let mut reply = smoe_text::Reply::default();
        let mut next = ids.iter();
        let mut ran = prompt.len();
        loop {
            let mut logits = vec![0.0f32; vocab as usize];
            logits[*next.next().unwrap() as usize] = 1.0;
            let done = g.advance(ran, &logits, &mut |_, piece| {
                reply.extend(parser.push(piece));
                true
            });
            ran = 1;
            if done {
                break;
            }
        }
        let gen = g.finish(&mut |_, piece| {
            reply.extend(parser.push(piece));
            true
        });
        reply.extend(parser.finish());
        assert_eq!(gen.finish, FinishReason::Stop);
        assert_eq!(gen.tokens.len(), ids.len() - 1 - engine.encode("never reached").unwrap().len(), "stopped at {end}");
        (gen.text, reply)
    };
    let answer = "<|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.";
    let (text, r) = run(answer, "<|return|>", false);
    assert_eq!(text, answer, "the markers are in the text");
    assert_eq!((r.reasoning.as_str(), r.content.as_str(), r.tool_calls.len()), ("User asks weather.", "Sunny.", 0));
    let call = "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
    let (_, r) = run(call, "<|call|>", true);
    assert_eq!((r.reasoning.as_str(), r.content.as_str(), r.tool_calls.len()), ("Use the tool.", "", 1));
    assert_eq!((r.tool_calls[0].name.as_str(), r.tool_calls[0].arguments.as_str()), ("get_weather", "{\"city\":\"Paris\"}"));
}

/// A model with recurrent states (Qwen3-Next's Gated DeltaNet) cannot cut its state back, so a
/// session resumes where its latest prefill ended: a next turn that keeps the previous prompt
/// but not the reply (as chat templates that drop reasoning do) computes only what follows that
/// prompt; one that keeps everything computes only its new tokens; a prefix shorter than the
/// checkpoint starts over. Each generates what a fresh session generates, and a fork is taken
/// only at the other session's end.
#[test]
fn a_recurrent_model_resumes_from_its_last_prompt() {
    use smoe_engine::{NoObserver, Session};
    let (_dir, engine) = shattered("testdata/hf/qwen3_next");
    let opts = GenOptions { stop_ids: Some(vec![]), ..GenOptions::new(8, SamplingParams { temperature: 0.0, ..Default::default() }, 4096) };
    let enc = |s: &str| engine.encode(s).unwrap();
    let fresh = |prompt: &[u32]| Session::new(&engine.model).generate(&engine, prompt, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    let cat = |a: &[u32], b: &[u32]| a.iter().chain(b).copied().collect::<Vec<u32>>();
    let p1 = enc("The quick brown fox jumps over the lazy dog, and then the dog");
    let mut s = Session::new(&engine.model);
    let first = s.generate(&engine, &p1, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(first.tokens, fresh(&p1).tokens);
    // The previous prompt, then other text than the reply.
    let p2 = cat(&p1, &enc(" sleeps. Hello, world! Then"));
    let second = s.generate(&engine, &p2, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(second.stats.prefilled_tokens, p2.len() - p1.len(), "resumed after the previous prompt");
    assert_eq!(second.tokens, fresh(&p2).tokens);
    // Everything so far, then more: nothing to go back to.
    let p3 = cat(&cat(&p2, &second.tokens[..7]), &enc(" and so"));
    let third = s.generate(&engine, &p3, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(third.stats.prefilled_tokens, p3.len() - (p2.len() + 7));
    assert_eq!(third.tokens, fresh(&p3).tokens);
    // A prefix that ends before the checkpoint: the sequence starts over.
    let p4 = cat(&p1[..5], &enc(" cat"));
    let fourth = s.generate(&engine, &p4, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(fourth.stats.prefilled_tokens, p4.len());
    assert_eq!(fourth.tokens, fresh(&p4).tokens);
    // The same prompt again: its last token must run again for its logits, which lies before
    // the checkpoint at its end, so the whole prompt runs (it once ran only that last token, at
    // position 0, and answered something else).
    let again = s.generate(&engine, &p4, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(again.stats.prefilled_tokens, p4.len());
    assert_eq!(again.tokens, fourth.tokens);
    // Forks: where the states are kept (the end of the cached tokens, the end of the latest
    // prefill), not anywhere else inside them.
    let at = s.cached_tokens().len();
    let inside = Session::fork(&engine.model, &s, at - 1).expect("a fork back at the prefill's end");
    assert_eq!(inside.cached_tokens(), &s.cached_tokens()[..p4.len()], "the nearest kept point");
    assert!(Session::fork(&engine.model, &s, p4.len() - 1).is_none(), "no recurrent state before it");
    let mut forked = Session::fork(&engine.model, &s, at).expect("a fork at the end copies the states");
    let p5 = cat(s.cached_tokens(), &enc(" more"));
    let fifth = forked.generate(&engine, &p5, &opts, &mut NoObserver, &mut |_, _| true).unwrap();
    assert_eq!(fifth.stats.prefilled_tokens, p5.len() - at);
    assert_eq!(fifth.tokens, fresh(&p5).tokens);
}

/// A Qwen3-Next sequence keeps its states where a shared prefix ends (a system prompt:
/// `Stepwise::keep_state_at`, as the server asks): its prefill stops there, and a prompt with
/// the same prefix then starts from them, in the same session (more than once) or in a fork,
/// and replies as it does run from nothing.
#[test]
fn a_recurrent_model_keeps_its_states_at_a_shared_prefix() {
    use smoe_engine::{BatchItem, NoObserver, Session};
    let (_dir, engine) = shattered("testdata/hf/qwen3_next");
    let model = &engine.model;
    let opts = GenOptions { stop_ids: Some(vec![]), ..GenOptions::new(6, SamplingParams { temperature: 0.0, ..Default::default() }, 4096) };
    let enc = |s: &str| engine.encode(s).unwrap();
    let cat = |a: &[u32], b: &[u32]| a.iter().chain(b).copied().collect::<Vec<u32>>();
    // As the server runs a generation: batched steps of what `input` asks for. Returns the
    // reply, where the sequence started and where each step ended.
    let run = |session: &mut Session<CpuBackend>, prompt: &[u32], keep: Option<usize>| {
        let mut gen = session.start(&engine, prompt, &opts).unwrap();
        let start = session.state_mut().pos();
        if let Some(k) = keep {
            gen.keep_state_at(&engine, session.state_mut(), k);
        }
        let mut batch = model.new_batch(256);
        let (mut reply, mut ends) = (Vec::new(), Vec::new());
        while !gen.finished() {
            let input = gen.input().to_vec();
            let logits = model
                .forward_batch(&mut batch, &mut [BatchItem { state: session.state_mut(), tokens: &input }], &mut NoObserver)
                .unwrap()
                .to_vec();
            ends.push(session.state_mut().pos());
            gen.advance(input.len(), &logits, &mut |t, _| {
                reply.push(t);
                true
            });
        }
        session.record(gen.context());
        (reply, start, ends)
    };
    let fresh = |prompt: &[u32]| run(&mut Session::batched(model), prompt, None).0;
    let sys = enc("You are a careful assistant. Answer in one short sentence, and never guess.");
    let (p1, p2) = (cat(&sys, &enc(" What is the capital of France?")), cat(&sys, &enc(" Name three colours, please.")));
    let n = sys.len();
    let mut s = Session::batched(model);
    let (r1, start, ends) = run(&mut s, &p1, Some(n));
    assert_eq!((start, ends[0], ends[1]), (0, n, p1.len()), "the prefill stops where the states are kept");
    assert_eq!(r1, fresh(&p1));
    // Another conversation with the same system prompt, from a fork of this one.
    let mut f = Session::fork(model, &s, p2.len() - 1).expect("a fork at the kept states");
    assert_eq!(f.cached_tokens(), &sys[..]);
    let (r2, start, _) = run(&mut f, &p2, Some(n));
    assert_eq!((start, &r2), (n, &fresh(&p2)));
    // And in the same session, twice: going back to the kept states keeps them.
    for (p, r) in [(&p2, &r2), (&p1, &r1)] {
        let (got, start, _) = run(&mut s, p, Some(n));
        assert_eq!((start, &got), (n, r));
    }
    // Without them, a session goes back to its start.
    let mut plain = Session::batched(model);
    run(&mut plain, &p1, None);
    assert_eq!(run(&mut plain, &p2, None).1, 0);
    // Kept states count in the session's memory.
    assert!(s.kv_bytes(model) > plain.kv_bytes(model));
}
