//! Every fuzz target over its seeds (made from the fixtures), deterministic mutations of them,
//! and the inputs kept in `fuzz/corpus/<target>/` (what fuzzing found and was fixed, among
//! others): what CI can run of the fuzzing campaign, on stable, in about a minute. The
//! campaign itself: `cargo +nightly fuzz run TARGET` from the repository root (docs/fuzzing.md).

use smoe_fuzzing::TARGETS;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(p: &str) -> Vec<u8> {
    std::fs::read(root().join(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// Seeds of a target, from the fixtures.
fn seeds(target: &str, dir: &Path) -> Vec<Vec<u8>> {
    let fixtures: Vec<PathBuf> = std::fs::read_dir(root().join("testdata/hf")).unwrap().map(|e| e.unwrap().path()).collect();
    match target {
        // glm_moe_dsa's carries a bool array (glm-dsa.attention.indexer.types) and layers
        // without some tensors.
        "gguf" => vec![
            read("testdata/gguf/qwen3_moe.q8_0.gguf"),
            read("testdata/gguf/minimax_m2.bf16.gguf"),
            read("testdata/gguf/glm_moe_dsa.bf16.gguf"),
            read("testdata/gguf/gpt_oss_mxfp4.bf16.gguf"),
            read("testdata/gguf/deepseek_v4_fp4.bf16.gguf"),
        ],
        "vault" => {
            let out = dir.join("seed.smoe");
            let opts = smoe_convert::ShatterOptions {
                experts: smoe_quant::Format::Q8_0.into(),
                dense: smoe_quant::Format::Q8_0,
                threads: Some(1),
                ..Default::default()
            };
            smoe_convert::shatter(&root().join("testdata/hf/olmoe"), &out, &opts, &smoe_convert::Silent).unwrap();
            vec![std::fs::read(out).unwrap()]
        }
        "safetensors" => vec![read("testdata/hf/qwen3_moe/model-00001-of-00008.safetensors")],
        "config" => fixtures.iter().map(|d| std::fs::read(d.join("config.json")).unwrap()).collect(),
        "tokenizer" => vec![read("testdata/hf/qwen3_moe/tokenizer.json")],
        "detokenizer" => {
            let ids: [&[u32]; 4] = [&[9707, 11, 1879, 0], &[151644, 872, 198, 1000, 1001, 1002], &[195, 164, 226, 5, 255], &[u32::MAX, 1 << 31, 7]];
            ids.iter().map(|s| s.iter().flat_map(|i| i.to_le_bytes()).collect()).collect()
        }
        "chat_template" => fixtures
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join("reference.json")).ok())
            .flat_map(|s| {
                let v: serde_json::Value = serde_json::from_str(&s).unwrap();
                let t = v["chat_templates"].as_object().cloned().unwrap_or_default();
                t.values().map(|c| serde_json::to_vec(&serde_json::json!({"messages": c["messages"], "kwargs": c["kwargs"]})).unwrap()).collect::<Vec<_>>()
            })
            .take(10)
            .collect(),
        "openai_request" => [
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0.7,"top_p":0.9,"stop":["x","y"],"max_tokens":5,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}"#,
            r#"{"model":"m","messages":[{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c","content":"2"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        ]
        .map(|s| s.as_bytes().to_vec())
        .to_vec(),
        "anthropic_request" => [
            r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"tool_use","id":"u","name":"f","input":{"a":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"u","content":"2"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"stop_sequences":["z"],"temperature":1}"#,
        ]
        .map(|s| s.as_bytes().to_vec())
        .to_vec(),
        "output_grammar" => [
            r#"{"type":"object","properties":{"city":{"type":"string","maxLength":8},"days":{"type":"integer","minimum":1,"maximum":9}},"required":["city"],"additionalProperties":false}"#,
            r##"{"$defs":{"P":{"type":"object","properties":{"a":{"$ref":"#/$defs/P"}}}},"anyOf":[{"$ref":"#/$defs/P"},{"type":"array","items":{"enum":["x",1,null]}}]}"##,
            r#"{"tools":[{"name":"f","parameters":{"type":"object","properties":{"q":{"type":"string","pattern":"^[a-z]+$"}}}},{"name":"g"}],"parallel":false}"#,
        ]
        .map(|s| s.as_bytes().to_vec())
        .to_vec(),
        other => panic!("no seeds for {other}"),
    }
}

/// Deterministic mutations of a seed: truncations, and copies with a few bytes changed
/// (xorshift positions and values, more of them near the start, where headers are).
fn mutations(seed: &[u8], count: usize) -> Vec<Vec<u8>> {
    let mut out = vec![seed.to_vec(), Vec::new()];
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ seed.len() as u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for i in 1..=16 {
        out.push(seed[..seed.len() * i / 17].to_vec());
    }
    while out.len() < count {
        let mut m = seed.to_vec();
        if m.is_empty() {
            break;
        }
        for _ in 0..1 + next() % 4 {
            let span = if next() % 2 == 0 { m.len().min(4096) } else { m.len() };
            let at = (next() as usize) % span;
            m[at] = match next() % 4 {
                0 => 0xff,
                1 => 0,
                2 => m[at] ^ (1 << (next() % 8)),
                _ => next() as u8,
            };
        }
        out.push(m);
    }
    out
}

/// `SMOE_FUZZ_SEEDS=DIR cargo test --release -p smoe-fuzzing -- write_seeds` writes each
/// target's seeds to `DIR/<target>/`: the starting corpora of a libFuzzer campaign
/// (docs/fuzzing.md). Without the variable it only checks that every target has seeds.
#[test]
fn write_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::env::var_os("SMOE_FUZZ_SEEDS").map(PathBuf::from);
    for (target, _) in TARGETS {
        let seeds = seeds(target, dir.path());
        assert!(!seeds.is_empty(), "{target} has no seeds");
        if let Some(out) = &out {
            let d = out.join(target);
            std::fs::create_dir_all(&d).unwrap();
            for (i, s) in seeds.iter().enumerate() {
                std::fs::write(d.join(format!("seed-{i}")), s).unwrap();
            }
        }
    }
}

#[test]
fn every_fuzz_target_survives_its_corpus() {
    let dir = tempfile::tempdir().unwrap();
    // Inputs that panicked, kept where a developer can feed them to the target again.
    let failed_dir = root().join("target/fuzz-failures");
    let mut failed = Vec::new();
    for (target, run) in TARGETS {
        let mut inputs: Vec<Vec<u8>> = Vec::new();
        for seed in seeds(target, dir.path()) {
            // Big binary seeds get fewer mutations: each costs a parse of the whole file.
            let n = if seed.len() > 100_000 { 600 } else { 4000 };
            inputs.extend(mutations(&seed, n));
        }
        let kept = root().join("fuzz/corpus").join(target);
        if let Ok(entries) = std::fs::read_dir(&kept) {
            inputs.extend(entries.map(|e| std::fs::read(e.unwrap().path()).unwrap()));
        }
        let t = std::time::Instant::now();
        for (i, input) in inputs.iter().enumerate() {
            if std::panic::catch_unwind(|| run(input)).is_err() {
                std::fs::create_dir_all(&failed_dir).unwrap();
                let p = failed_dir.join(format!("{target}-{i}"));
                std::fs::write(&p, input).unwrap();
                failed.push(p.display().to_string());
            }
        }
        eprintln!("{target}: {} inputs in {:.1} s", inputs.len(), t.elapsed().as_secs_f64());
    }
    assert!(failed.is_empty(), "inputs that panicked (replay with `cargo +nightly fuzz run TARGET FILE`): {failed:?}");
    // Each input's temporary file goes with it (a CI machine's /tmp once kept one per target
    // and run).
    let ours = format!("smoe-fuzz-{}-", std::process::id());
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&ours))
        .collect();
    assert!(left.is_empty(), "fuzz inputs left in the temporary directory: {left:?}");
}
