//! The `smoe` binary end to end: shatter, inspect, verify, score, run, and their errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn smoe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smoe")).args(args).output().unwrap()
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> String {
    root().join("testdata/hf").join(name).display().to_string()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn shatter(dir: &Path, name: &str, extra: &[&str]) -> String {
    let out = dir.join(format!("{name}.smoe")).display().to_string();
    let f = fixture(name);
    let mut args = vec!["shatter", &f, "-o", &out];
    args.extend_from_slice(extra);
    ok(&smoe(&args));
    out
}

/// A gpt-oss checkpoint as the hub ships it keeps its MXFP4 experts when no `--experts` is
/// given (its blocks copied), and `inspect` shows what makes gpt-oss different.
#[test]
fn gpt_oss_keeps_its_mxfp4_experts_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "gpt_oss_mxfp4", &[]);
    let j: serde_json::Value = serde_json::from_str(&ok(&smoe(&["inspect", &v, "--json"]))).unwrap();
    assert_eq!(j["architecture"]["family"], "gpt_oss");
    assert!(j["expert_parts"].as_array().unwrap().iter().all(|p| p["format"] == "MXFP4"), "{}", j["expert_parts"]);
    let text = ok(&smoe(&["inspect", &v]));
    assert!(text.contains("sinks true") && text.contains("windows per layer [8 full 8 full]") && text.contains("ClampedSwiglu"), "{text}");
    let run = ok(&smoe(&["run", &v, "-p", "Hello", "--max-tokens", "4", "--temperature", "0"]));
    assert!(!run.is_empty());
}

/// `inspect` shows Qwen3-Next's linear layers and gated attention, `run` generates from it, and
/// a CUDA request for it runs on the GPU (on a machine without one: is refused, saying there is
/// none), never a crash.
#[test]
fn qwen3_next_inspects_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_next", &[]);
    let text = ok(&smoe(&["inspect", &v]));
    assert!(text.contains("Gated DeltaNet in layers [0 2]: 2 key heads x 16, 4 value heads x 16, conv 4"), "{text}");
    assert!(text.contains("full attention output gated"), "{text}");
    let j: serde_json::Value = serde_json::from_str(&ok(&smoe(&["inspect", &v, "--json"]))).unwrap();
    assert_eq!(j["architecture"]["linear_attention"]["layers"], serde_json::json!([true, false, true, false]));
    let run = ok(&smoe(&["run", &v, "-p", "Hello", "--max-tokens", "8", "--temperature", "0"]));
    assert!(!run.is_empty());
    let cuda = smoe(&["run", &v, "-p", "Hello", "--max-tokens", "2", "--device", "cuda"]);
    let err = String::from_utf8_lossy(&cuda.stderr);
    if smoe_cuda::probe().is_ok() {
        assert!(cuda.status.success(), "{err}");
    } else {
        assert!(!cuda.status.success() && err.contains("--device cuda"), "{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn shatter_inspect_verify_and_a_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_moe_k", &["--experts", "q4_k", "--dense", "BF16"]);
    let j: serde_json::Value = serde_json::from_str(&ok(&smoe(&["inspect", &v, "--json"]))).unwrap();
    assert_eq!(j["architecture"]["family"], "qwen3_moe");
    assert_eq!(j["expert_parts"][0]["format"], "Q4_K");
    assert_eq!(j["expert_count"], 16);
    assert!(j["expert_blob_bytes"].as_u64().unwrap().is_multiple_of(4096));
    assert_eq!(j["total_bytes"].as_u64().unwrap(), std::fs::metadata(&v).unwrap().len());
    let text = ok(&smoe(&["inspect", &v]));
    assert!(text.contains("Q4_K") && text.contains("expert blobs"), "{text}");
    assert!(ok(&smoe(&["verify", &v])).starts_with("ok:"));
    // Flip a byte inside the last expert blob.
    let len = std::fs::metadata(&v).unwrap().len();
    let manifest_off = {
        let b = std::fs::read(&v).unwrap();
        u64::from_le_bytes(b[24..32].try_into().unwrap())
    };
    let mut b = std::fs::read(&v).unwrap();
    b[(manifest_off - 5000) as usize] ^= 0xff;
    std::fs::write(&v, &b).unwrap();
    assert_eq!(std::fs::metadata(&v).unwrap().len(), len);
    let o = smoe(&["verify", &v]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("checksum mismatch") && err.contains("layer 1 expert 7"), "{err}");
}

/// `--mix Q4_K_M` lays a checkpoint out as llama.cpp's Q4_K_M: `inspect` names the layers
/// whose expert formats and blob sizes differ (Q6_K down projections in layer 1 of qwen3_moe_k's
/// two; layer 0's blobs carry no padding to their size), and the vault verifies. A mix together with explicit formats, an unknown file type, or a mix for a
/// GGUF (whose blocks are copied as they are) is refused with a message saying why.
#[test]
fn shatter_with_a_llama_cpp_mix() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_moe_k", &["--mix", "q4_k_m"]);
    let j: serde_json::Value = serde_json::from_str(&ok(&smoe(&["inspect", &v, "--json"]))).unwrap();
    assert_eq!(j["expert_parts"][2]["format"], "Q4_K");
    assert_eq!(j["layer_expert_formats"], serde_json::json!({"1": {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}}));
    assert_eq!(j["dense_formats"]["Q8_0"]["tensors"], 4, "eight experts: llama.cpp's Q8_0 keys and values");
    // Layer 0's Q4_K blobs take their own size (108 KiB), not the Q6_K layer's 128 KiB.
    assert_eq!(j["layer_expert_blob_bytes"], serde_json::json!({"0": 108 << 10}));
    assert_eq!(j["expert_bytes"], (8 * (108 + 128)) << 10);
    let text = ok(&smoe(&["inspect", &v]));
    assert!(text.contains("layers [1]: gate Q4_K, up Q4_K, down Q6_K (128.00 KiB per blob)"), "{text}");
    assert!(text.contains("layers [0]: gate Q4_K, up Q4_K, down Q4_K (108.00 KiB per blob)"), "{text}");
    assert!(ok(&smoe(&["verify", &v])).starts_with("ok:"));
    let out = dir.path().join("x.smoe").display().to_string();
    let fx = fixture("qwen3_moe_k");
    let gguf = root().join("testdata/gguf-kquant/qwen3_moe_k.Q4_K_M.gguf").display().to_string();
    for (args, want) in [
        (vec!["shatter", &fx, "-o", &out, "--mix", "Q4_K_M", "--experts", "Q4_K"], "cannot be used with"),
        (vec!["shatter", &fx, "-o", &out, "--mix", "Q4_K_S"], "not a llama.cpp file type smoe reproduces"),
        (vec!["shatter", &gguf, "-o", &out, "--mix", "Q4_K_M"], "a GGUF's blocks are copied"),
    ] {
        let o = smoe(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
        assert!(!Path::new(&out).exists(), "{args:?} left {out}");
    }
}

#[test]
fn injected_failure_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.smoe");
    let o = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(["shatter", &fixture("qwen3_moe"), "-o", out.to_str().unwrap()])
        .env("SMOE_TEST_FAIL_AFTER_BLOBS", "3")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("injected"));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<u8>) {
    let raw = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&raw[8..8 + n]).unwrap();
    let t = &h[name];
    let (s, e) = (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
    let shape = t["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    (shape, raw[8 + n + s..8 + n + e].to_vec())
}

#[test]
fn score_writes_logits_and_routes_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen2_moe", &["--experts", "BF16", "--dense", "BF16"]);
    let ids = "1001,882,198,970,11,879,0,1002";
    let pre = dir.path().join("pre.safetensors");
    let dec = dir.path().join("dec.safetensors");
    ok(&smoe(&["score", &v, "--ids", ids, "--out", pre.to_str().unwrap()]));
    let idfile = dir.path().join("ids.txt");
    std::fs::write(&idfile, "1001 882 198\n970 11 879 0 1002\n").unwrap();
    ok(&smoe(&["score", &v, "--ids-file", idfile.to_str().unwrap(), "--decode", "--out", dec.to_str().unwrap()]));
    let (shape, a) = read_f32(&pre, "logits");
    assert_eq!(shape, vec![8, 1024]);
    let (_, b) = read_f32(&dec, "logits");
    let fa: Vec<f32> = a.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let fb: Vec<f32> = b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let max = fa.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(fa.iter().zip(&fb).all(|(x, y)| (x - y).abs() <= 1e-4 * max));
    for l in 0..3 {
        let (s, _) = read_f32(&pre, &format!("route.{l}.experts"));
        assert_eq!(s, vec![8, 2]);
        let (s, _) = read_f32(&pre, &format!("route.{l}.weights"));
        assert_eq!(s, vec![8, 2]);
    }
    // Streaming through the smallest cache at a fixed and a measured queue depth: the same
    // logits, bit for bit.
    for qd in ["1", "auto"] {
        let small = dir.path().join(format!("small-{qd}.safetensors"));
        let idf = idfile.to_str().unwrap();
        ok(&smoe(&[
            "score",
            &v,
            "--ids-file",
            idf,
            "--decode",
            "--cache-experts",
            "2",
            "--queue-depth",
            qd,
            "--out",
            small.to_str().unwrap(),
        ]));
        assert_eq!(read_f32(&small, "logits").1, b, "queue depth {qd}");
    }
    // A greedy continuation: its first token is the argmax of the last position's logits, and
    // each next one is what scoring the ids plus the continuation so far picks.
    let greedy = dir.path().join("greedy.safetensors");
    ok(&smoe(&["score", &v, "--ids", ids, "--greedy", "3", "--out", greedy.to_str().unwrap()]));
    let (shape, g) = read_f32(&greedy, "greedy");
    assert_eq!(shape, vec![3]);
    let g: Vec<u32> = g.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    use smoe_engine::sampler::argmax;
    assert_eq!(g[0], argmax(&fa[7 * 1024..]));
    let longer = format!("{ids},{},{}", g[0], g[1]);
    let more = dir.path().join("more.safetensors");
    ok(&smoe(&["score", &v, "--ids", &longer, "--out", more.to_str().unwrap()]));
    let fm: Vec<f32> = read_f32(&more, "logits").1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!((argmax(&fm[8 * 1024..9 * 1024]), argmax(&fm[9 * 1024..])), (g[1], g[2]));
    assert_eq!(read_f32(&greedy, "logits").1, a, "the continuation leaves the ids' logits as they were");
    let o = smoe(&["score", &v, "--ids", ids, "--queue-depth", "0", "--out", pre.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("queue depth must be `auto` or a whole number"));
    // Bad input is an error with a message, not a panic.
    let o = smoe(&["score", &v, "--ids", "1,2,99999", "--out", pre.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("outside the vocabulary"));
    let o = smoe(&["score", &v, "--ids", "1,x", "--out", pre.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("'x' is not a token id"));
    let o = smoe(&["score", "/nonexistent.smoe", "--ids", "1", "--out", pre.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("nonexistent"));
}

#[test]
fn run_is_reproducible_with_a_seed() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_moe", &[]);
    let run = |seed: &str| {
        let out =
            ok(&smoe(&["run", &v, "-p", "Tell me about the sea.", "--seed", seed, "--temperature", "0.9", "--max-tokens", "60", "--json"]));
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (a, b, c) = (run("42"), run("42"), run("43"));
    assert_eq!(a["tokens"], b["tokens"]);
    assert_eq!(a["text"], b["text"]);
    assert_ne!(a["tokens"], c["tokens"]);
    assert!(a["prompt_tokens"].as_u64().unwrap() > 10);
    // Streaming mode prints the text and a summary line on stderr.
    let o = smoe(&["run", &v, "-p", "hi", "--seed", "42", "--max-tokens", "5"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("prefill") && err.contains("decode") && err.contains("tok/s"), "{err}");
}

/// `run --json-schema`: a random-weight fixture writes JSON that matches the schema, inline or
/// from `@FILE`; a schema that is not an object is an argument error.
#[test]
fn run_holds_the_reply_to_a_json_schema() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_moe", &[]);
    let schema = r#"{"type": "object", "properties": {"sea": {"type": "string", "maxLength": 6},
        "deep": {"type": "boolean"}}, "required": ["sea", "deep"], "additionalProperties": false}"#;
    let file = dir.path().join("schema.json");
    std::fs::write(&file, schema).unwrap();
    for arg in [schema.to_string(), format!("@{}", file.display())] {
        let out = ok(&smoe(&[
            "run",
            &v,
            "-p",
            "Tell me about the sea.",
            "--seed",
            "3",
            "--temperature",
            "0.9",
            "--max-tokens",
            "120",
            "--json-schema",
            &arg,
        ]));
        let reply: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(reply["sea"].as_str().is_some_and(|s| s.chars().count() <= 6) && reply["deep"].is_boolean(), "{reply}");
    }
    // `{}`: any JSON value (random weights pick numbers like 0.098E+845514068252582924, valid
    // JSON that serde cannot hold in an f64, so only its start is checked).
    let out = ok(&smoe(&["run", &v, "-p", "x", "--seed", "1", "--temperature", "0.9", "--max-tokens", "200", "--json-schema", "{}"]));
    assert!(out.trim_start().starts_with(|c: char| "{[\"-0123456789tfn".contains(c)), "{out:?}");
    let o = smoe(&["run", &v, "-p", "x", "--json-schema", "[1]"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("a JSON schema is an object"));
}

/// `smoe bench --json`: the fields the harness reads, consistent with each other, and a cache
/// of top-k experts that streams (bytes read = misses × blob size, as the store counts them).
#[test]
fn bench_json_reports_throughput_and_streaming() {
    let dir = tempfile::tempdir().unwrap();
    let vault = shatter(dir.path(), "qwen3_moe", &[]);
    let out = ok(&smoe(&["bench", &vault, "--prompt-tokens", "40", "--gen-tokens", "12", "--cache-experts", "8", "--json"]));
    let j: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    for key in ["prefill_tok_s", "decode_tok_s", "ttft_ms", "bytes_read_per_token", "hit_rate"] {
        assert!(j[key].as_f64().is_some_and(|v| v.is_finite() && v >= 0.0), "{key}: {}", j[key]);
    }
    assert!(j["prefill_tok_s"].as_f64().unwrap() > 0.0 && j["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert_eq!(j["cache_experts"], 8);
    let d = &j["decode"];
    assert_eq!(d["tokens"], 11, "gen 12 = the prefill's token and 11 decode steps");
    let (hits, misses) = (d["hits"].as_u64().unwrap(), d["misses"].as_u64().unwrap());
    assert!(misses > 0, "8 slots cannot hold the experts of 11 random tokens");
    let blob = j["cache_bytes"].as_u64().unwrap() / 8;
    assert_eq!(d["bytes_read"].as_u64().unwrap(), misses * blob);
    assert!((j["hit_rate"].as_f64().unwrap() - hits as f64 / (hits + misses) as f64).abs() < 1e-9);
}

/// `SMOE_POOL_PROFILE=1 bench --batch 2 --threads 2`: the decode steps' pool line and their
/// busiest call sites, as single-sequence `bench` prints them, and the same in the JSON.
#[test]
fn bench_batch_profiles_the_pool_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let vault = shatter(dir.path(), "qwen3_moe", &[]);
    let args = ["bench", &vault, "--prompt-tokens", "6", "--gen-tokens", "4", "--batch", "2", "--threads", "2", "--device", "cpu"];
    let run = |json: bool| {
        let args: Vec<&str> = args.iter().copied().chain(json.then_some("--json")).collect();
        ok(&Command::new(env!("CARGO_BIN_EXE_smoe")).args(&args).env("SMOE_POOL_PROFILE", "1").output().unwrap())
    };
    let text = run(false);
    assert!(text.lines().any(|l| l.trim_start().starts_with("decode  pool:") && l.contains("jobs")), "{text}");
    assert!(text.lines().any(|l| l.contains("decode  site forward.rs:") && l.contains("serial before")), "{text}");
    let j: serde_json::Value = serde_json::from_str(run(true).trim()).unwrap();
    assert!(j["pool"]["jobs"].as_u64().unwrap() > 0 && !j["pool_sites"].as_array().unwrap().is_empty(), "{j}");
    // Without the variable, nothing is counted.
    let plain: serde_json::Value = serde_json::from_str(ok(&smoe(&[&args[..], &["--json"]].concat())).trim()).unwrap();
    assert!(plain["pool"].is_null() && plain["pool_sites"].is_null(), "{plain}");
}

/// `bench --batch 1,3`: one JSON line per batch size, aggregate and per-sequence rates that
/// agree with each other, one decode token per sequence and step, and the store's reads
/// shared by a step's tokens; a batch of 0 is refused with a message.
#[test]
fn bench_batch_reports_each_size() {
    let dir = tempfile::tempdir().unwrap();
    let vault = shatter(dir.path(), "qwen3_moe", &[]);
    let args = ["bench", &vault, "--prompt-tokens", "6", "--gen-tokens", "5", "--cache-experts", "8", "--batch", "1,3", "--json"];
    let out = ok(&smoe(&args));
    let lines: Vec<serde_json::Value> = out.trim().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{out}");
    for (j, n) in lines.iter().zip([1u64, 3]) {
        assert_eq!(j["sequences"], n);
        let (agg, per) = (j["decode_tok_s"].as_f64().unwrap(), j["per_sequence_tok_s"].as_f64().unwrap());
        assert!(agg > 0.0 && (agg - per * n as f64).abs() < 1e-6 * agg, "{j}");
        let d = &j["decode"];
        assert_eq!((d["steps"].as_u64(), d["tokens"].as_u64()), (Some(4), Some(4 * n)), "{j}");
        let blob = j["cache_bytes"].as_u64().unwrap() / 8;
        assert_eq!(d["bytes_read"].as_u64().unwrap(), d["misses"].as_u64().unwrap() * blob);
        let per_token = d["bytes_read"].as_f64().unwrap() / (4 * n) as f64;
        assert!((j["bytes_read_per_token"].as_f64().unwrap() - per_token).abs() < 1e-6 * per_token.max(1.0), "{j}");
    }
    let o = smoe(&["bench", &vault, "--batch", "0"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least 1"), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `bench --routing-trace`: the bundled trace (no value) or a trace file replaces the router's
/// choice, and every line bench prints says so (stdout and stderr alike), as does the JSON;
/// only bench takes the flag.
#[test]
fn bench_with_a_routing_trace_says_so_in_every_line() {
    let dir = tempfile::tempdir().unwrap();
    let vault = shatter(dir.path(), "qwen3_moe", &[]);
    let base = ["bench", vault.as_str(), "--prompt-tokens", "8", "--gen-tokens", "4", "--cache-experts", "8"];
    let o = smoe(&[&base[..], &["--routing-trace", "--reps", "2"]].concat());
    ok(&o);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(out.lines().count() >= 3, "{out}");
    for line in out.lines() {
        assert!(line.starts_with("[trace routing]"), "untagged line: {line}");
    }
    // Stderr also carries the startup lines of opening the model, before the trace is set.
    let tagged: Vec<&str> = err.lines().filter(|l| l.starts_with("[trace routing]")).collect();
    assert!(tagged.iter().any(|l| l.contains("trained_moe_48x6") && l.contains("meaningless")), "{err}");
    assert!(tagged.iter().filter(|l| l.contains("run ")).count() == 2, "{err}");
    let trace = root().join("testdata/traces/trained_moe_48x6.safetensors").display().to_string();
    let j: serde_json::Value =
        serde_json::from_str(ok(&smoe(&[&base[..], &["--routing-trace", &trace, "--json"]].concat())).trim().lines().last().unwrap())
            .unwrap();
    assert!(j["routing"].as_str().unwrap().starts_with("routing replayed from trace trained_moe_48x6"), "{j}");
    let j: serde_json::Value = serde_json::from_str(ok(&smoe(&[&base[..], &["--json"]].concat())).trim().lines().last().unwrap()).unwrap();
    assert_eq!(j["routing"], "router");
    let o = smoe(&["run", &vault, "-p", "hi", "--routing-trace"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--routing-trace"), "{o:?}");
    let o = smoe(&[&base[..], &["--routing-trace", &fixture("qwen3_moe")]].concat());
    assert!(!o.status.success(), "a directory is not a trace");
}

/// `smoe devices` names the CPU's kernel table in use and either lists GPUs or says in one line
/// why none is usable; a machine without the NVIDIA driver is not an error.
#[test]
fn devices_reports_the_cpu_and_the_gpus_or_why_not() {
    let out = ok(&smoe(&["devices"]));
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("cpu: ") && lines[0].contains("(using "), "{out}");
    assert!(lines.len() >= 2 && lines[1..].iter().all(|l| l.starts_with("cuda")), "{out}");
}

/// `--device`: `auto` says in the startup line where the model runs (here the CPU, with the
/// reason, where no GPU is usable) and gives the same tokens as `cpu`; an explicit `cuda` on a
/// machine without one is a one-line error, never a crash; a device name that means nothing is
/// refused by the parser.
#[test]
fn device_auto_falls_back_to_the_cpu_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let v = shatter(dir.path(), "qwen3_moe", &[]);
    let args = |device: &'static str| vec!["run", &v, "-p", "hi", "--temperature", "0", "--max-tokens", "6", "--json", "--device", device];
    let auto = smoe(&args("auto"));
    let err = String::from_utf8_lossy(&auto.stderr).to_string();
    let line = err.lines().find(|l| l.starts_with("device: ")).unwrap_or_else(|| panic!("no startup line: {err}"));
    let cpu = ok(&smoe(&args("cpu")));
    if smoe_cuda::probe().is_err() {
        assert!(line.starts_with("device: cpu (no usable GPU: "), "{line}");
        let (a, c): (serde_json::Value, serde_json::Value) =
            (serde_json::from_str(&ok(&auto)).unwrap(), serde_json::from_str(&cpu).unwrap());
        assert_eq!((&a["tokens"], &a["text"]), (&c["tokens"], &c["text"]), "auto on a machine without a GPU is the CPU");
        let cuda = smoe(&args("cuda"));
        let e = String::from_utf8_lossy(&cuda.stderr);
        assert!(!cuda.status.success() && e.contains("--device cuda:0: ") && !e.contains("panicked"), "{e}");
    } else {
        assert!(line.starts_with("device: cuda:0 "), "{line}");
    }
    let bad = smoe(&args("tpu"));
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("unknown device 'tpu'"));
}

/// `smoe replay` on the bundled trained-MoE trace: Belady's optimum at a quarter of the
/// experts is the trace README's 0.72, every policy lies below it, the default is named, and
/// a file that is not a trace or a cache of no slots is refused with a message.
#[test]
fn replay_prints_each_policy_against_belady() {
    let trace = root().join("testdata/traces/trained_moe_48x6.safetensors").display().to_string();
    let v: serde_json::Value = serde_json::from_str(&ok(&smoe(&["replay", &trace, "--cache", "25%", "--json"]))).unwrap();
    assert_eq!(v["cache_slots"], 72);
    let best = v["belady"].as_f64().unwrap();
    assert!((best - 0.72).abs() < 0.011, "{v}");
    let policies = v["policies"].as_object().unwrap();
    assert!(policies.contains_key(v["default"].as_str().unwrap()), "{v}");
    for (name, h) in policies {
        let h = h.as_f64().unwrap();
        assert!(h > 0.3 && h <= best + 1e-9, "{name}: {h} against belady {best}");
    }
    let text = ok(&smoe(&["replay", &trace, "--cache", "36"]));
    assert!(text.contains("36 slots") && text.contains("of optimal"), "{text}");
    let not_a_trace = fixture("qwen3_moe") + "/model-00001-of-00008.safetensors";
    let o = smoe(&["replay", &not_a_trace]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no tensor `experts`"), "{o:?}");
    let o = smoe(&["replay", &trace, "--cache", "0%"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("percentage"), "{o:?}");
}

/// `smoe replay --batch N --shape LxExK`: a batch's steps read each expert once, so no token
/// costs more reads than its own top-k per layer; Belady's optimum bounds every policy; a
/// malformed shape, no sequences or a cache narrower than one batched step are refused.
#[test]
fn replay_a_batch_on_a_model_shape() {
    let trace = root().join("testdata/traces/trained_moe_48x6.safetensors").display().to_string();
    let run = |batch: &str, cache: &str| -> serde_json::Value {
        serde_json::from_str(&ok(&smoe(&["replay", &trace, "--shape", "12x64x8", "--batch", batch, "--cache", cache, "--json"]))).unwrap()
    };
    let (alone, batch) = (run("1", "64"), run("16", "64"));
    assert_eq!((alone["batch"].as_u64(), batch["batch"].as_u64(), batch["cache_slots"].as_u64()), (Some(1), Some(16), Some(64)));
    let reads = |v: &serde_json::Value| v["reads_per_token"]["belady"].as_f64().unwrap();
    assert!(reads(&batch) > 0.0 && reads(&batch) <= 12.0 * 8.0, "{batch}");
    for v in [&alone, &batch] {
        let best = v["belady"].as_f64().unwrap();
        for (name, h) in v["policies"].as_object().unwrap() {
            assert!(h.as_f64().unwrap() <= best + 1e-9, "{name} above belady: {v}");
            assert!(v["reads_per_token"]["policies"][name].as_f64().unwrap() >= reads(v) - 1e-9, "{name}: {v}");
        }
    }
    let o = smoe(&["replay", &trace, "--shape", "12x64"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("LAYERSxEXPERTSxTOPK"), "{o:?}");
    let o = smoe(&["replay", &trace, "--shape", "12x64x8", "--batch", "16", "--cache", "8"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("fewer slots"), "{o:?}");
    let o = smoe(&["replay", &trace, "--batch", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("at least one"), "{o:?}");
}

/// A reader that closes the pipe before smoe prints (`smoe devices | head -0`) ends it quietly
/// and successfully, without a panic report.
#[test]
fn a_closed_stdout_ends_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(env!("CARGO_BIN_EXE_smoe")).arg("devices").stdout(writer).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{:?}: {err}", o.status);
    assert!(!err.contains("panicked"), "{err}");
}
