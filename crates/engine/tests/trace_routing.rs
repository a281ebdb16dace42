//! A routing trace set on a model replaces the router's choice in the forward pass itself: the
//! experts every MoE layer runs (as an observer sees them) are the trace's, token by token, and
//! clearing the trace restores the router's exact routing.

mod common;

use common::*;
use smoe_engine::trace_routing::TraceRouting;
use smoe_engine::{score, ScoreMode};
use smoe_quant::Format;

#[test]
fn the_forward_pass_runs_the_trace_experts() {
    let name = "qwen3_moe";
    let mut model = load(&vault(name, Format::BF16, Format::BF16));
    let input = input_ids(name, "chat");
    let own = score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
    let arch = model.arch().clone();
    model.set_routing_trace(Some(TraceRouting::new(smoe_formats::trace::bundled(), "bundled", &arch).unwrap()));
    let traced = score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
    // The expected experts: a fresh mapping of the same trace, asked token by token per layer.
    let expect = TraceRouting::new(smoe_formats::trace::bundled(), "bundled", &arch).unwrap();
    let k = arch.moe.top_k;
    let mut differs = false;
    for (&layer, routes) in &traced.routes {
        for t in 0..input.len() {
            let mut want = vec![0u32; k];
            expect.replace(layer, &mut want);
            let got: Vec<u32> = routes.experts[t * k..(t + 1) * k].iter().map(|&e| e as u32).collect();
            assert_eq!(got, want, "layer {layer} token {t}");
            differs |= own.routes[&layer].experts[t * k..(t + 1) * k] != routes.experts[t * k..(t + 1) * k];
        }
    }
    assert_eq!(traced.routes.len(), arch.moe_layers().len());
    assert!(differs, "the trace chose what the router chose everywhere");
    model.set_routing_trace(None);
    let again = score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
    assert_eq!(again.logits, own.logits, "without the trace, routing is the router's again");
}
