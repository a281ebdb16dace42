//! `smoe serve` on a loopback port over fixture vaults: the official `openai` and `anthropic`
//! Python packages against it, raw HTTP for every error status, cancellation on hang-up, and a
//! short load test.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Fixture vaults `qwen3.smoe` and `mixtral.smoe` in a new directory.
fn vault_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (fixture, name, fmt) in [("qwen3_moe", "qwen3", "BF16"), ("mixtral", "mixtral", "Q8_0")] {
        let out = dir.path().join(format!("{name}.smoe"));
        let src = root().join("testdata/hf").join(fixture);
        let o = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(["shatter", src.to_str().unwrap(), "-o", out.to_str().unwrap(), "--experts", fmt])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    dir
}

/// A running server, killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(dir: &Path, extra: &[&str]) -> Server {
        Server::start_with_env(dir, extra, &[])
    }

    fn start_with_env(dir: &Path, extra: &[&str], env: &[(&str, &Path)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_smoe"))
            .args(["serve", "--models", dir.to_str().unwrap(), "--port", "0"])
            .args(extra)
            .envs(env.iter().copied())
            .env("SMOE_LOG", "warn")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("server exited before listening").unwrap();
            if let Some(a) = line.strip_prefix("listening on ") {
                break a.trim().parse().unwrap();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange: `(status, head, body)`.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // The server may answer (413) before reading a large body; a write error then is fine.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

const KEY: &str = "test-key";

fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String, String) {
    let auth = format!("Bearer {KEY}");
    http(addr, "POST", path, &[("Authorization", &auth), ("Content-Type", "application/json")], body.as_bytes())
}

/// A GET with the test key.
fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    http(addr, "GET", path, &[("Authorization", &format!("Bearer {KEY}"))], b"")
}

/// A streaming request (with the test key) left open once its response has begun: the
/// connection, after checking the response starts `200`.
fn open_stream(addr: SocketAddr, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("HTTP/1.1 200"), "{path}: {}", String::from_utf8_lossy(&first));
    s
}

fn error_json(body: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert!(v["error"]["message"].is_string(), "OpenAI error shape: {v}");
    v
}

/// A Python with the official client packages, in a virtual environment under target/ (created
/// and filled from PyPI on first use). Made once per test binary: two tests creating it at the
/// same time on a fresh clone raced (one ran `pip` while the other was recreating the venv).
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(make_python).clone()
}

fn make_python() -> PathBuf {
    let env = root().join("target/pyenv");
    let py = env.join("bin/python");
    let ok = |py: &Path| Command::new(py).args(["-c", "import openai, anthropic, selenium"]).output().is_ok_and(|o| o.status.success());
    if !ok(&py) {
        let st =
            Command::new("python3").args(["-m", "venv", env.to_str().unwrap()]).status().expect("python3 is needed for the client tests");
        assert!(st.success(), "python3 -m venv failed");
        let st = Command::new(env.join("bin/pip"))
            .args(["install", "--quiet", "openai==3.57.0", "anthropic==2.14.0", "selenium==4.38.0"])
            .status()
            .expect("pip");
        assert!(st.success(), "pip install openai anthropic selenium failed");
    }
    py
}

fn run_python(script: &str, args: &[&str]) -> String {
    let o = Command::new(python()).arg(root().join("crates/cli/tests").join(script)).args(args).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{script} failed:\n{out}\n{err}");
    out.into_owned()
}

#[test]
fn official_clients() {
    let dir = vault_dir();
    let server = Server::start(dir.path(), &["--api-key", KEY]);
    let out = run_python("openai_client.py", &[&server.base(), KEY]);
    assert!(out.starts_with("ok:"), "{out}");
    let out = run_python("anthropic_client.py", &[&server.base(), KEY]);
    assert!(out.starts_with("ok:"), "{out}");
}

#[test]
fn error_statuses_and_recovery() {
    let dir = vault_dir();
    let server = Server::start(
        dir.path(),
        &[
            "--api-key",
            KEY,
            "--max-queue",
            "1",
            "--body-limit-mib",
            "1",
            "--cache-experts",
            "8",
            "--ctx",
            "65536",
            "--cors-origin",
            "http://app.example",
        ],
    );
    let a = server.addr;
    let chat = |model: &str, extra: &str| {
        format!(r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "hello"}}], "max_tokens": 4, "temperature": 0{extra}}}"#)
    };
    let (st, _, body) = post(a, "/v1/chat/completions", &chat("qwen3", ""));
    assert_eq!(st, 200, "{body}");
    let reply = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap()["choices"][0]["message"]["content"].clone();
    let answer = reply(&body);
    // CORS preflight from an allowed origin (no key needed for the preflight).
    let (st, head, _) = http(
        a,
        "OPTIONS",
        "/v1/chat/completions",
        &[("Origin", "http://app.example"), ("Access-Control-Request-Method", "POST"), ("Access-Control-Request-Headers", "authorization")],
        b"",
    );
    assert!(st == 200 && head.to_ascii_lowercase().contains("access-control-allow-origin: http://app.example"), "{head}");

    // 400: bad JSON, bad parameters, a missing field, an over-long prompt.
    let (st, _, body) = post(a, "/v1/chat/completions", "{not json");
    assert_eq!(st, 400, "{body}");
    error_json(&body);
    let (st, _, body) = post(a, "/v1/chat/completions", &chat("qwen3", r#", "temperature": "hot""#));
    assert_eq!(st, 400, "{body}");
    assert_eq!(error_json(&body)["error"]["param"], "temperature");
    let (st, _, body) = post(a, "/v1/chat/completions", r#"{"model": "qwen3"}"#);
    assert_eq!((st, error_json(&body)["error"]["param"].as_str()), (400, Some("messages")), "{body}");
    let long = "word ".repeat(70_000);
    let (st, _, body) = post(a, "/v1/completions", &format!(r#"{{"model": "qwen3", "prompt": "{long}"}}"#));
    assert_eq!(st, 400, "{body}");
    assert_eq!(error_json(&body)["error"]["code"], "context_length_exceeded");
    // 401 without the key (but /health stays open).
    let (st, _, body) = http(a, "POST", "/v1/chat/completions", &[], chat("qwen3", "").as_bytes());
    assert_eq!(st, 401, "{body}");
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
    // 404: unknown model, unknown route.
    let (st, _, body) = post(a, "/v1/chat/completions", &chat("nope", ""));
    assert_eq!((st, error_json(&body)["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");
    assert_eq!(post(a, "/v1/nothing", "{}").0, 404);
    // 413: a body over the limit.
    let big = format!(r#"{{"model": "qwen3", "prompt": "{}"}}"#, "x".repeat(2 << 20));
    let (st, _, body) = post(a, "/v1/completions", &big);
    assert_eq!(st, 413, "{body}");
    // Anthropic's error shape on its endpoint.
    let (st, _, body) = post(a, "/v1/messages", r#"{"model": "qwen3", "messages": []}"#);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((st, v["type"].as_str()), (400, Some("error")), "{body}");

    // 429: a long streaming generation fills the queue of one...
    let long_req = chat("qwen3", r#", "max_tokens": 60000, "stream": true"#).replace(r#""max_tokens": 4, "#, "");
    let hog = open_stream(a, "/v1/chat/completions", &long_req);
    let (st, head, body) = post(a, "/v1/chat/completions", &chat("qwen3", ""));
    assert_eq!(st, 429, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    // ...and hanging up cancels it promptly: the next request does not wait for 60000 tokens.
    drop(hog);
    let t0 = Instant::now();
    let mut st = 429;
    while st == 429 && t0.elapsed() < Duration::from_secs(30) {
        st = post(a, "/v1/chat/completions", &chat("qwen3", "")).0;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(st, 200);
    assert!(t0.elapsed() < Duration::from_secs(5), "cancellation took {:?}", t0.elapsed());

    // 500: the vault is truncated under the server; the request fails, the server goes on.
    let path = dir.path().join("qwen3.smoe");
    let original = std::fs::read(&path).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    // New prompts until one reads a damaged blob: its 500's message (every other answer a 200).
    let first_failure = |tag: &str| {
        (0..20).find_map(|i| {
            let prompt = format!(r#"{{"model": "qwen3", "prompt": "{i} {tag} prompt {i}", "max_tokens": 8}}"#);
            let (st, _, body) = post(a, "/v1/completions", &prompt);
            assert!(st == 200 || st == 500, "{st} {body}");
            (st == 500).then(|| error_json(&body)["error"]["message"].as_str().unwrap().to_string())
        })
    };
    let message = first_failure("different").expect("a truncated vault must fail a request");
    assert!(message.contains("expert"), "{message}");
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
    assert_eq!(post(a, "/v1/chat/completions", &chat("mixtral", "")).0, 200, "other models keep serving");
    let (st, _, metrics) = get(a, "/metrics");
    assert_eq!(st, 200);
    for name in [
        "smoe_requests_total{endpoint=\"/v1/chat/completions\",status=\"429\"}",
        "smoe_cache_hit_rate",
        "smoe_queue_depth",
        "smoe_read_bytes_total",
        "smoe_engine_errors_total 1",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }

    // The vault restored in place: the same model serves again, and answers as before.
    std::fs::write(&path, &original).unwrap();
    let (st, _, body) = post(a, "/v1/chat/completions", &chat("qwen3", ""));
    assert_eq!((st, reply(&body)), (200, answer.clone()), "{body}");
    // One bit flipped in every expert blob: the first blob read fails its checksum, named by
    // layer and expert; nothing is computed on it. Restored, the model answers as before.
    let v = smoe_vault::Vault::open(&path).unwrap();
    let mut flipped = original.clone();
    for &l in &v.architecture().moe_layers() {
        for e in 0..v.architecture().moe.num_experts {
            flipped[v.blob(l, e).unwrap().offset as usize + 7] ^= 0x10;
        }
    }
    std::fs::write(&path, &flipped).unwrap();
    let named = first_failure("another").expect("a flipped bit in every blob must fail a request");
    let expert_named = named.split("expert ").nth(1).and_then(|r| r.split(" of layer ").nth(1)).is_some();
    assert!(named.contains("failed its checksum") && expert_named, "{named}");
    assert_eq!(post(a, "/v1/chat/completions", &chat("mixtral", "")).0, 200, "other models keep serving");
    std::fs::write(&path, &original).unwrap();
    let (st, _, body) = post(a, "/v1/chat/completions", &chat("qwen3", ""));
    assert_eq!((st, reply(&body)), (200, answer.clone()), "{body}");
    eprintln!("a flipped bit under the server: {named}");
    // Replaced by a rename (how a new model is put in place), the running server keeps reading
    // the file it opened: the same answers, never the new file's bytes under the old index.
    let aside = tempfile::tempdir_in(dir.path().parent().unwrap()).unwrap();
    let new = aside.path().join("new.smoe");
    std::fs::copy(dir.path().join("mixtral.smoe"), &new).unwrap();
    std::fs::rename(&new, &path).unwrap();
    for i in 0..5 {
        let (st, _, body) = post(a, "/v1/chat/completions", &chat("qwen3", ""));
        assert_eq!((st, reply(&body)), (200, answer.clone()), "request {i} after the replacement: {body}");
        let (st, _, body) =
            post(a, "/v1/completions", &format!(r#"{{"model": "qwen3", "prompt": "{i} a third prompt {i}", "max_tokens": 8}}"#));
        assert_eq!(st, 200, "{body}");
    }
    let (_, _, metrics) = get(a, "/metrics");
    assert!(metrics.contains("smoe_engine_errors_total 2"), "{metrics}");
}

#[test]
fn models_are_swapped_within_the_memory_budget() {
    let dir = vault_dir();
    // Room for one fixture model at a time.
    let server = Server::start(dir.path(), &["--memory", "1MiB"]);
    let a = server.addr;
    let loaded = || -> Vec<String> {
        let (_, _, body) = http(a, "GET", "/v1/models", &[], b"");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["smoe"]["loaded"] == true)
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    let ask = |m: &str| {
        let body = format!(r#"{{"model": "{m}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 3}}"#);
        http(a, "POST", "/v1/chat/completions", &[], body.as_bytes()).0
    };
    assert_eq!(ask("qwen3"), 200);
    assert_eq!(loaded(), ["qwen3"]);
    assert_eq!(ask("mixtral"), 200);
    assert_eq!(loaded(), ["mixtral"], "qwen3 was unloaded to make room");
    assert_eq!(ask("qwen3"), 200);
    assert!(loaded().contains(&"qwen3".to_string()), "{:?}", loaded());
}

#[test]
fn ggufs_in_the_directory_are_served_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let src = root().join("testdata/gguf/qwen2_moe.q8_0.gguf");
    std::fs::copy(&src, dir.path().join("qwen2-q8.gguf")).unwrap();
    let server = Server::start(dir.path(), &[]);
    let (_, _, body) = http(server.addr, "GET", "/v1/models", &[], b"");
    assert!(body.contains("\"qwen2-q8\""), "{body}");
    let req = r#"{"model": "qwen2-q8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#;
    let (st, _, body) = http(server.addr, "POST", "/v1/chat/completions", &[], req.as_bytes());
    assert_eq!(st, 200, "{body}");
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

#[test]
fn short_load_test() {
    let dir = vault_dir();
    let server = Server::start(dir.path(), &["--api-key", KEY, "--max-queue", "8"]);
    let out = run_python("load_test.py", &[&server.base(), KEY, "--clients", "16", "--seconds", "8", "--warmup", "2"]);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["failures"], 0, "{v}");
    assert!(v["ok"].as_u64().unwrap() > 0, "{v}");
    let rss = rss_kib(server.pid());
    assert!(rss > 0 && rss < 1 << 20, "server RSS {rss} KiB");
    assert_eq!(http(server.addr, "GET", "/health", &[], b"").0, 200);
}

/// The chat page at `/` in a real browser: headless Chromium and its WebDriver from Debian's
/// `chromium` and `chromium-driver` packages, driven by `selenium` (page_test.py), against the
/// demo vault and a fixture: the model picker, a reply streamed in several steps, Stop mid-stream,
/// Regenerate, the live panel, the conversation after a reload, and the API-key prompt of a
/// keyed server. Skips with a message where there is no browser, unless
/// `SMOE_REQUIRE_BROWSER=1` (as `.ci/run` sets, after installing them). Leaves a screenshot in
/// `target/page.png`.
#[test]
fn the_chat_page_works_in_a_real_browser() {
    if !Path::new("/usr/bin/chromedriver").exists() || !Path::new("/usr/bin/chromium").exists() {
        let why = "no /usr/bin/chromium and /usr/bin/chromedriver (Debian: chromium chromium-driver)";
        assert!(std::env::var_os("SMOE_REQUIRE_BROWSER").is_none(), "SMOE_REQUIRE_BROWSER is set but there is {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let dir = vault_dir();
    let demo = dir.path().join("demo.smoe");
    let o = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(["shatter", root().join("models/stdlib-moe").to_str().unwrap(), "-o", demo.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let open = Server::start(dir.path(), &[]);
    let keyed = Server::start(dir.path(), &["--api-key", KEY]);
    let shot = root().join("target/page.png");
    let out = run_python("page_test.py", &[&open.base(), &keyed.base(), KEY, shot.to_str().unwrap()]);
    eprintln!("{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

/// The page is served without the key (it asks for one); the live panel's JSON needs the key,
/// has the finished generation's figures, and no prompt or reply text.
#[test]
fn the_page_and_its_stats_endpoint() {
    let dir = vault_dir();
    let server = Server::start(dir.path(), &["--api-key", KEY]);
    let (status, head, body) = http(server.addr, "GET", "/", &[], b"");
    assert_eq!(status, 200, "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: text/html"), "{head}");
    assert!(body.contains("<title>smoe</title>") && body.contains("/v1/smoe/stats"));
    let (status, _, _) = http(server.addr, "GET", "/v1/smoe/stats", &[], b"");
    assert_eq!(status, 401, "the stats need the key");
    let secret = "a prompt the stats must not echo";
    let req = format!(r#"{{"model": "qwen3", "max_tokens": 8, "messages": [{{"role": "user", "content": "{secret}"}}]}}"#);
    let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = get(server.addr, "/v1/smoe/stats");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let last = &v["recent"][0];
    assert_eq!(last["model"], "qwen3", "{v}");
    assert!(last["generated_tokens"].as_u64().unwrap() >= 1 && last["ttft_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["models"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "qwen3" && m["loaded"] == true && m["size_bytes"].as_u64() > Some(0)));
    assert!(!body.contains(secret), "the stats leak the prompt");
}

/// A greedy chat completion of `model` with `system` then `messages` (JSON objects, comma
/// separated): `(prompt tokens, of them cached, reply)`.
fn chat_usage(server: &Server, model: &str, max_tokens: usize, system: &str, messages: &str) -> (u64, u64, String) {
    let req = format!(
        r#"{{"model": "{model}", "max_tokens": {max_tokens}, "temperature": 0, "messages": [{{"role": "system", "content": "{system}"}}, {messages}]}}"#
    );
    let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let u = &v["usage"];
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    (u["prompt_tokens"].as_u64().unwrap(), u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), reply)
}

/// Two new conversations with the same long system prompt (as Open WebUI sends its tool
/// schemas with every chat): the second computes only its own message, and the first, asked a
/// follow-up afterwards, still finds its whole history cached.
#[test]
fn new_conversations_share_a_cached_system_prompt() {
    let dir = vault_dir();
    let server = Server::start(dir.path(), &["--api-key", KEY]);
    let system = "You are a careful assistant. ".repeat(40);
    let chat = |messages: &str| chat_usage(&server, "qwen3", 4, &system, messages);
    let (p1, c1, r1) = chat(r#"{"role": "user", "content": "first conversation"}"#);
    assert_eq!(c1, 0, "nothing cached yet");
    let (p2, c2, _) = chat(r#"{"role": "user", "content": "a second, different conversation"}"#);
    assert!(c2 >= 200 && p2 - c2 < 40, "the second conversation computed {} of {p2} prompt tokens", p2 - c2);
    let follow = format!(
        r#"{{"role": "user", "content": "first conversation"}}, {{"role": "assistant", "content": {}}}, {{"role": "user", "content": "and a follow-up"}}"#,
        serde_json::Value::String(r1)
    );
    let (p3, c3, _) = chat(&follow);
    assert!(c3 >= p1, "the first conversation's follow-up found {c3} cached of {p3}, its first prompt was {p1}");
}

/// A model with recurrent states (Qwen3-Next) behind the server: a conversation's next turn
/// resumes where its previous prompt's prefill ended (the state's checkpoint), so only the
/// reply and the new message are computed; a different conversation sharing the system prompt
/// starts from the states the first kept where that shared part ends (a recurrent state exists
/// only where a step ended, and the server stops the prefill there to keep one); each answers as
/// a fresh request does (the engine's `a_recurrent_model_keeps_its_states_at_a_shared_prefix`).
#[test]
fn a_recurrent_model_resumes_a_conversation_after_its_last_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("next.smoe");
    let src = root().join("testdata/hf/qwen3_next");
    let o =
        Command::new(env!("CARGO_BIN_EXE_smoe")).args(["shatter", src.to_str().unwrap(), "-o", out.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let server = Server::start(dir.path(), &["--api-key", KEY]);
    let system = "You are a careful assistant. ".repeat(20);
    let chat = |messages: &str| chat_usage(&server, "next", 6, &system, messages);
    let first = r#"{"role": "user", "content": "first conversation"}"#;
    let (p1, c1, r1) = chat(first);
    assert_eq!(c1, 0, "nothing cached yet");
    // Another conversation with the same system prompt starts where the first kept its states:
    // the end of the shared part (system prompt, then the user turn's header).
    let (p2, c2, _) = chat(r#"{"role": "user", "content": "a second, different conversation"}"#);
    let system_tokens = (system.len() / 6) as u64;
    assert!(c2 > system_tokens && c2 + 3 < p2, "the second conversation found {c2} of {p2} cached");
    let follow = format!(
        r#"{first}, {{"role": "assistant", "content": {}}}, {{"role": "user", "content": "and a follow-up"}}"#,
        serde_json::Value::String(r1.clone())
    );
    let (p3, c3, r3) = chat(&follow);
    // The checkpoint lies where the first prompt's last multi-token step ended: its end, or one
    // short of it where that prompt's last chunk was a single token.
    assert!(c3 + 1 >= p1 && c3 < p3, "the follow-up found {c3} cached of {p3}, its first prompt was {p1}");
    // Asked again, the first conversation answers as it did (from scratch or not).
    assert_eq!(chat(first).2, r1);
    let again = chat(&follow);
    assert_eq!(again.2, r3, "a follow-up answers the same however much was cached");
}

/// Tool schemas that would crowd the conversation out of the context (Open WebUI's defaults on
/// the 4096-token demo) are dropped and the chat is answered; a conversation that does not fit
/// by itself is still refused with the context error.
#[test]
fn tool_schemas_that_do_not_fit_are_dropped() {
    let dir = vault_dir();
    let server = Server::start(dir.path(), &["--api-key", KEY, "--ctx", "2048"]);
    let tool = |i: usize| {
        format!(
            r#"{{"type": "function", "function": {{"name": "tool_{i}", "description": "{}", "parameters": {{"type": "object", "properties": {{"q": {{"type": "string"}}}}}}}}}}"#,
            "Looks something up in a knowledge base of notes and memories. ".repeat(8)
        )
    };
    let tools = (0..36).map(tool).collect::<Vec<_>>().join(", ");
    let req = format!(r#"{{"model": "qwen3", "max_tokens": 4, "messages": [{{"role": "user", "content": "hello"}}], "tools": [{tools}]}}"#);
    let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() < 100, "answered without the schemas: {v}");
    let long = "hello ".repeat(3000);
    let req =
        format!(r#"{{"model": "qwen3", "max_tokens": 4, "messages": [{{"role": "user", "content": "{long}"}}], "tools": [{tools}]}}"#);
    let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("context_length_exceeded"), "{body}");
    // A reply that must call a tool cannot do without the schemas: said, not dropped.
    let req = format!(
        r#"{{"model": "qwen3", "max_tokens": 4, "messages": [{{"role": "user", "content": "hello"}}], "tools": [{tools}], "tool_choice": "required"}}"#
    );
    let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
    assert_eq!(status, 400, "{body}");
    assert_eq!(error_json(&body)["error"]["param"], "tool_choice", "{body}");
    assert!(body.contains("36 tool schemas"), "{body}");
}

/// `--chat-template FILE` replaces every served model's template: a thinking variant opens
/// each reply in reasoning, which comes back as `reasoning_content`; a JSON response_format
/// then waits for the reasoning to end. A template that does not parse stops the server
/// before it listens, with the file named.
#[test]
fn a_chat_template_file_replaces_the_models_own() {
    let dir = vault_dir();
    let thinking = root().join("bench/templates/qwen3-thinking.jinja");
    let server = Server::start(dir.path(), &["--api-key", KEY, "--chat-template", thinking.to_str().unwrap()]);
    let req = r#"{"model": "qwen3", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]}"#;
    let (status, _, body) = post(server.addr, "/v1/chat/completions", req);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let reasoning = v["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or_default();
    assert!(!reasoning.is_empty(), "the reply opens in reasoning: {v}");
    let req = r#"{"model": "qwen3", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hello"}],
        "response_format": {"type": "json_object"}}"#;
    let (status, _, body) = post(server.addr, "/v1/chat/completions", req);
    assert_eq!(status, 200, "{body}");
    let v2: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v2["choices"][0]["message"]["reasoning_content"], reasoning, "held only after </think>: {v2}");
    drop(server);

    let bad = dir.path().join("broken.jinja");
    std::fs::write(&bad, "{% if %}").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_smoe"))
        .args(["serve", "--models", dir.path().to_str().unwrap(), "--port", "0", "--chat-template", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("broken.jinja") && err.contains("not a usable chat template"), "{err}");
}

/// Continuous batching: concurrent requests are advanced together in batched steps (the
/// metrics count steps of several generations), each answers as it does alone, and a stream
/// whose client hangs up leaves the batch at the next step while the others finish.
#[test]
fn concurrent_requests_are_batched_and_answer_as_alone() {
    let dir = vault_dir();
    let server = Server::start(
        dir.path(),
        &["--api-key", KEY, "--max-batch", "4", "--max-queue", "8", "--batch-tokens", "48", "--max-stall-ms", "1", "--ctx", "65536"],
    );
    let a = server.addr;
    // The second prompt is several steps' worth of tokens: it is prefilled in chunks between
    // the others' decode tokens (beside them, a stall limit of 1 ms leaves it the least chunk
    // a step, 32 tokens, of --batch-tokens 48).
    let long = "a longer prompt, of several more words than the first one has, ".repeat(8);
    let prompts = ["one two three", long.as_str(), "x", "the fourth prompt"];
    let body = |p: &str| format!(r#"{{"model": "qwen3", "prompt": "{p}", "max_tokens": 40, "temperature": 0}}"#);
    let text = |b: &str| serde_json::from_str::<serde_json::Value>(b).unwrap()["choices"][0]["text"].as_str().unwrap().to_string();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (st, _, b) = post(a, "/v1/completions", &body(p));
            assert_eq!(st, 200, "{b}");
            text(&b)
        })
        .collect();
    // A stream that will hang up holds one place of the batch meanwhile.
    let hog = open_stream(a, "/v1/completions", r#"{"model": "qwen3", "prompt": "hog", "max_tokens": 60000, "stream": true}"#);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(prompts.len() + 1));
    let together: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (b, barrier) = (body(p), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                post(a, "/v1/completions", &b)
            })
        })
        .collect();
    barrier.wait();
    std::thread::sleep(Duration::from_millis(200));
    drop(hog);
    for (i, h) in together.into_iter().enumerate() {
        let (st, _, b) = h.join().unwrap();
        assert_eq!(st, 200, "{b}");
        assert_eq!(text(&b), alone[i], "prompt {i} in a batch answers as alone");
    }
    let (_, _, metrics) = get(a, "/metrics");
    let value = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name} missing"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert!(value("smoe_batch_max") >= 3.0, "no step ran three generations together:\n{metrics}");
    assert!(value("smoe_batch_sequences_total") > value("smoe_batch_steps_total"), "{metrics}");
    eprintln!("batch: at most {}, {} steps", value("smoe_batch_max"), value("smoe_batch_steps_total"));
    // The hog left at a step after its client hung up: the queue empties.
    let t0 = Instant::now();
    loop {
        let (_, _, m) = get(a, "/metrics");
        if m.contains("smoe_queue_depth{model=\"qwen3\"} 0") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the stream that hung up is still queued:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (st, _, b) = post(a, "/v1/completions", &body(prompts[0]));
    assert_eq!((st, text(&b)), (200, alone[0].clone()));
}

/// A memory limit lowered under the running server and raised again: a cgroup-v1 memory
/// controller faked in a directory (`SMOE_TEST_CGROUP_ROOT`, read by the same function that
/// sizes the budget at start), whose limit is written down to its usage. The expert cache and
/// the session budget shrink to their least, before the next request (the check every request
/// makes) or within a tick of the watch thread when idle; requests answer exactly as before;
/// raised again, both grow back to their size at load once the memory has stayed free for the
/// watch's window, not at once.
#[test]
fn caches_follow_a_memory_limit_lowered_and_raised() {
    let dir = vault_dir();
    let cg = tempfile::tempdir().unwrap();
    let mem = cg.path().join("memory");
    std::fs::create_dir(&mem).unwrap();
    std::fs::write(mem.join("memory.usage_in_bytes"), "1073741824\n").unwrap();
    std::fs::write(mem.join("memory.stat"), "total_inactive_file 0\n").unwrap();
    let limit = |bytes: u64| std::fs::write(mem.join("memory.limit_in_bytes"), format!("{bytes}\n")).unwrap();
    limit(1 << 40);
    let env = [("SMOE_TEST_CGROUP_ROOT", cg.path())];
    let ask = |server: &Server, content: &str| {
        let req =
            format!(r#"{{"model": "qwen3", "max_tokens": 6, "temperature": 0, "messages": [{{"role": "user", "content": "{content}"}}]}}"#);
        let (status, _, body) = post(server.addr, "/v1/chat/completions", &req);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let model = |server: &Server| {
        let (_, _, body) = get(server.addr, "/v1/smoe/stats");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let m = v["models"].as_array().unwrap().iter().find(|m| m["id"] == "qwen3").unwrap().clone();
        let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
        (
            n("expert_cache_bytes"),
            n("expert_cache_max_bytes"),
            n("expert_cache_resident_bytes"),
            n("session_kv_budget_bytes"),
            n("session_kv_bytes"),
        )
    };
    let vault = smoe_vault::Vault::open(dir.path().join("qwen3.smoe")).unwrap();
    let least = vault.architecture().moe.top_k as u64 * vault.manifest().experts.blob_size;

    // Checked before each request only (the thread's tick is an hour away).
    let server = Server::start_with_env(dir.path(), &["--memory-watch", "3600"], &env);
    let first = ask(&server, "a conversation under pressure");
    let (cache, max, resident, full_budget, held) = model(&server);
    assert!(cache == max && max > least && resident > 0 && full_budget > 0 && held > 0, "{:?}", model(&server));
    limit(1 << 30);
    assert_eq!(ask(&server, "a conversation under pressure"), first, "the same answer from the shrunk caches");
    let (cache, _, resident, budget, held) = model(&server);
    assert_eq!((cache, budget, held), (least, 0, 0), "shrunk to the least before the request ran");
    assert!(resident <= least, "{resident}");
    assert_ne!(ask(&server, "another conversation"), "");
    // Raised again: not grown back at once (memory must stay free for the watch's window, a
    // minute here), but the answer is the same.
    limit(1 << 40);
    assert_eq!(ask(&server, "a conversation under pressure"), first);
    assert_eq!(model(&server).0, least, "grown back before the memory had lasted");
    let (_, _, metrics) = get(server.addr, "/metrics");
    assert!(metrics.contains("smoe_cache_resizes_total 1"), "{metrics}");
    assert!(metrics.contains(&format!("smoe_expert_cache_bytes{{model=\"qwen3\"}} {least}")), "{metrics}");
    assert!(metrics.contains(&format!("smoe_expert_cache_max_bytes{{model=\"qwen3\"}} {max}")), "{metrics}");
    drop(server);

    // Lowered while a long generation runs, and nothing else: the check before its batched
    // steps shrinks the caches (the thread's tick is an hour away, and no request starts).
    // The context is raised past the fixture's 4,096 so that the generation outlasts the test's
    // wait: 4,094 tokens take a quarter of a second here, and on a busy CI runner the whole
    // reply once ended before the limit was lowered — at a 16,384 context too, once in a
    // fresh-clone run on 2026-12-05 (with a browser test beside it), so 65,536, where the
    // attention over the growing context makes the tail far slower. It is cancelled when the
    // server drops.
    let server = Server::start_with_env(dir.path(), &["--memory-watch", "3600", "--ctx", "65536"], &env);
    assert_eq!(ask(&server, "a conversation under pressure"), first);
    let hog = open_stream(server.addr, "/v1/completions", r#"{"model": "qwen3", "prompt": "hog", "max_tokens": 60000, "stream": true}"#);
    limit(1 << 30);
    let t = Instant::now();
    while model(&server).0 != least {
        assert!(t.elapsed() < Duration::from_secs(10), "not shrunk during a generation: {:?}", model(&server));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, _, stats) = get(server.addr, "/v1/smoe/stats");
    assert!(stats.contains("\"queue_depth\":1"), "the generation still runs: {stats}");
    drop(hog);
    drop(server);
    limit(1 << 40);

    // Idle: the watch thread shrinks within a tick, dropping the cached sessions too.
    let server = Server::start_with_env(dir.path(), &["--memory-watch", "0.1"], &env);
    assert_eq!(ask(&server, "a conversation under pressure"), first);
    assert!(model(&server).4 > 0, "a session is cached");
    limit(1 << 30);
    let t = Instant::now();
    loop {
        let (cache, _, resident, budget, held) = model(&server);
        if (cache, budget, held) == (least, 0, 0) {
            assert!(resident <= least, "{resident}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "not shrunk while idle: {:?}", model(&server));
        std::thread::sleep(Duration::from_millis(50));
    }
    // Raised again: grown back to the size at load once the memory has stayed free for the
    // watch's window (ten ticks here).
    limit(1 << 40);
    while model(&server).0 != max || model(&server).3 != full_budget {
        assert!(t.elapsed() < Duration::from_secs(20), "not grown back while idle: {:?}", model(&server));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(ask(&server, "a conversation under pressure"), first);
}
