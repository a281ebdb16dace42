//! `smoe chat` driven through stdin: prefix reuse between turns, and /save + /load.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smoe(args: &[&str], stdin: &str) -> (String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "smoe {args:?} failed: {err}");
    (out, err)
}

fn trace(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// The `logits` tensor of a safetensors file written by `smoe score`: `(rows, vocab, values)`.
fn read_logits(path: &Path) -> (usize, usize, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header["logits"];
    let shape = ids(&t["shape"]);
    let off = ids(&t["data_offsets"]);
    let data = &bytes[8 + n + off[0] as usize..8 + n + off[1] as usize];
    let vals = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    (shape[0] as usize, shape[1] as usize, vals)
}

#[test]
fn three_turns_reuse_the_cache_and_save_load_continues() {
    three_turns("qwen3_moe", 1e-6);
}

/// The same with recurrent states (Qwen3-Next's Gated DeltaNet layers): a turn resumes from the
/// states where the previous one stopped, and /load rebuilds them from the saved transcript.
/// Against a from-scratch prefill only the chunked form's summation order differs (the turns run
/// the recurrence for their decode steps): 6e-7 measured, hence the looser bound.
#[test]
fn a_recurrent_model_chats_over_three_turns_and_save_load_continues() {
    three_turns("qwen3_next", 1e-5);
}

/// Three turns of `smoe chat` on `fixture` (bf16): prefix reuse between turns, the last turn's
/// logits within `tol` (relative to the largest) of a from-scratch prefill, and /save + /load.
fn three_turns(fixture: &str, tol: f32) {
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("q.smoe").display().to_string();
    let fixture = root().join("testdata/hf").join(fixture).display().to_string();
    smoe(&["shatter", &fixture, "-o", &vault, "--experts", "BF16", "--dense", "BF16"], "");
    let (t1, saved) = (dir.path().join("t1.jsonl"), dir.path().join("conv.json"));
    let common = ["--reference", "--temperature", "0", "--max-tokens", "10", "--cache-experts", "8"];
    let mut args = vec!["chat", &vault];
    args.extend(common);
    let t1s = t1.display().to_string();
    args.extend(["--trace", &t1s]);
    let script = format!("Hello there\nWhat is two plus two?\n/save {}\nAnd three?\n/stats\n", saved.display());
    let (_, err) = smoe(&args, &script);
    assert!(err.contains("last turn: prompt"), "/stats answers: {err}");
    let turns = trace(&t1);
    assert_eq!(turns.len(), 3);

    // Each turn's prompt extends the previous prompt and reply token for token, and only the new
    // tokens (plus the previous reply's last token, sampled but not yet run) are prefilled.
    assert_eq!(turns[0]["prefilled_tokens"], turns[0]["prompt_tokens"]);
    for w in turns.windows(2) {
        let (prev, next) = (&w[0], &w[1]);
        let cached: Vec<u64> = ids(&prev["prompt_ids"]).into_iter().chain(ids(&prev["tokens"])).collect();
        let prompt = ids(&next["prompt_ids"]);
        assert_eq!(&prompt[..cached.len()], &cached[..], "the new prompt starts with the cached conversation");
        let new = (prompt.len() - cached.len()) as u64;
        let prefilled = next["prefilled_tokens"].as_u64().unwrap();
        assert!(prefilled == new || prefilled == new + 1, "prefilled {prefilled}, new tokens {new}");
    }

    // The last turn's logits equal a from-scratch prefill of the whole transcript.
    let last = &turns[2];
    let prompt: Vec<String> = ids(&last["prompt_ids"]).iter().map(|i| i.to_string()).collect();
    let scored = dir.path().join("scored.safetensors");
    let ids_arg = prompt.join(",");
    let s = scored.display().to_string();
    smoe(&["score", &vault, "--ids", &ids_arg, "--out", &s, "--cache-experts", "8"], "");
    let (rows, vocab, logits) = read_logits(&scored);
    let want = &logits[(rows - 1) * vocab..];
    let got: Vec<f32> = last["prompt_logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
    eprintln!("turn 3 vs from-scratch: relative error {err:e}");
    assert!(err <= tol, "turn 3 vs from-scratch: relative error {err}");

    // A new process loads the conversation saved after turn 2 and answers turn 3 identically.
    let t2 = dir.path().join("t2.jsonl");
    let t2s = t2.display().to_string();
    let mut args = vec!["chat", &vault];
    args.extend(common);
    args.extend(["--trace", &t2s]);
    smoe(&args, &format!("/load {}\nAnd three?\n", saved.display()));
    let resumed = trace(&t2);
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0]["prompt_ids"], last["prompt_ids"]);
    assert_eq!(resumed[0]["tokens"], last["tokens"]);
    assert_eq!(resumed[0]["prefilled_tokens"], resumed[0]["prompt_tokens"], "a fresh process prefills everything");
}

#[test]
fn context_overflow_drops_oldest_turns_or_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("q.smoe").display().to_string();
    let fixture = root().join("testdata/hf/qwen3_moe").display().to_string();
    smoe(&["shatter", &fixture, "-o", &vault, "--experts", "BF16", "--dense", "BF16"], "");
    let base = ["chat", &vault, "--temperature", "0", "--max-tokens", "8", "--ctx", "80", "--system", "Be brief."];
    let script = "one two three four five\nsix seven eight nine ten\neleven twelve thirteen\n";
    let (_, err) = smoe(&base, script);
    assert!(err.contains("[context: dropped the") && err.contains("oldest messages to fit 80 tokens"), "{err}");
    let mut refuse = base.to_vec();
    refuse.extend(["--overflow", "refuse"]);
    let (_, err) = smoe(&refuse, script);
    assert!(err.contains("error: the conversation is"), "{err}");
    // A refused turn is not recorded: the conversation goes on.
    assert!(err.matches("[prompt").count() >= 2, "{err}");
}
