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
