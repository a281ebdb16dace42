//! Generation on the trained demo model: long sampled runs repeat exactly with a seed.

use smoe_engine::{open_cpu, FinishReason, GenOptions, OpenOptions, SamplingParams};
use std::path::Path;

#[test]
fn thousand_token_sampled_generation_repeats_with_the_same_seed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo.smoe");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stdlib-moe");
    smoe_convert::shatter(&model, &out, &Default::default(), &smoe_convert::Silent).unwrap();
    let engine = open_cpu(&out, &OpenOptions::default()).unwrap().0;
    let prompt = engine.encode("import os\n\ndef main(argv):\n").unwrap();
    let gen = |seed| {
        let opts = GenOptions {
            max_tokens: 1000,
            sampling: SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(seed), ..Default::default() },
            stop: vec![],
            stop_ids: Some(vec![]),
            ctx: 4096,
            keep_prompt_logits: false,
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
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo.smoe");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stdlib-moe");
    smoe_convert::shatter(&model, &out, &Default::default(), &smoe_convert::Silent).unwrap();
    let engine = open_cpu(&out, &OpenOptions::default()).unwrap().0;
    let shared = engine
        .encode("\"\"\"Helpers for lists, dicts and sets: the system prompt every conversation shares.\"\"\"\n\nimport os\n")
        .unwrap();
    let (a, b) = (engine.encode("def first(xs):\n").unwrap(), engine.encode("class Stack:\n").unwrap());
    let opts = GenOptions {
        max_tokens: 24,
        sampling: SamplingParams { temperature: 0.0, ..Default::default() },
        stop: vec![],
        stop_ids: Some(vec![]),
        ctx: 4096,
        keep_prompt_logits: false,
    };
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
