/*!
An OpenAI- and Anthropic-compatible HTTP server over a directory of vaults.

- [`Fleet`]: every vault of a directory is a model named by its file stem; models load on first
  use and the least recently used are unloaded when the memory budget needs their room.
- [`worker`]: each loaded model runs its generations on one thread, from a bounded queue (429
  beyond it), with cached sessions for prefix reuse across requests.
- [`openai`] and [`anthropic`]: the request and response shapes, streamed as server-sent events.

The HTTP layer is axum on tokio; generation never runs on the async runtime.
*/
#![deny(missing_docs)]

pub mod anthropic;
pub mod error;
pub mod fleet;
pub mod memory;
pub mod metrics;
pub mod openai;
pub mod pace;
pub mod params;
pub mod run;
pub mod worker;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
pub use error::ApiError;
pub use fleet::{default_max_batch, CpuOpener, Fleet, FleetConfig, Opener};
use metrics::Metrics;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind (127.0.0.1 by default: the server is not exposed unless asked).
    pub addr: SocketAddr,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every API route.
    pub api_key: Option<String>,
    /// Origins allowed by CORS (`*` for any); none: no CORS headers.
    pub cors_origins: Vec<String>,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// The models.
    pub fleet: FleetConfig,
}

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The models.
    pub fleet: Arc<Fleet>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    api_key: Option<Arc<str>>,
    body_limit: usize,
}

/// Reads the body, turning an over-limit body into a 413 in the API's error shape.
async fn body(req: Request, state: &AppState) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.body_limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

async fn chat_completions(State(s): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = body(req, &s).await?;
    openai::chat(s, b).await
}

async fn completions(State(s): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let b = body(req, &s).await?;
    openai::completions(s, b).await
}

async fn messages(State(s): State<AppState>, req: Request) -> Response {
    let r = match body(req, &s).await {
        Ok(b) => anthropic::messages(s, b).await,
        Err(e) => Err(e),
    };
    r.unwrap_or_else(|e| e.anthropic().into_response())
}

fn model_json(m: &fleet::ModelInfo) -> serde_json::Value {
    json!({"id": m.id, "object": "model", "created": m.created, "owned_by": "smoe",
           "smoe": {"loaded": m.loaded, "size_bytes": m.size_bytes, "expert_cache_bytes": m.cache_bytes, "queue_depth": m.queue_depth}})
}

async fn list_models(State(s): State<AppState>) -> Response {
    let list: Vec<_> = s.fleet.list().iter().map(model_json).collect();
    axum::Json(json!({"object": "list", "data": list})).into_response()
}

async fn one_model(State(s): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let list = s.fleet.list();
    match list.iter().find(|m| m.id == id) {
        Some(m) => Ok(axum::Json(model_json(m)).into_response()),
        None => Err(ApiError::unknown_model(&id, &list.iter().map(|m| m.id.clone()).collect::<Vec<_>>())),
    }
}

async fn health(State(s): State<AppState>) -> Response {
    let loaded: Vec<String> = s.fleet.list().into_iter().filter(|m| m.loaded).map(|m| m.id).collect();
    axum::Json(json!({"status": "ok", "loaded_models": loaded})).into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    let mut r = s.metrics.render(&s.fleet.list()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

async fn stats(State(s): State<AppState>) -> Response {
    axum::Json(s.metrics.stats_json(&s.fleet.list())).into_response()
}

/// The chat page (`page.html`, in the binary: no network at run time). It is open without the
/// API key; it asks for one when the API answers 401.
async fn page() -> Response {
    let mut r = PAGE.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    r
}

const PAGE: &str = include_str!("page.html");

async fn fallback(req: Request) -> ApiError {
    ApiError::not_found(req.uri().path())
}

/// Checks the API key (except on /health) and counts every response.
async fn guard(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let anthropic = path == "/v1/messages";
    if let Some(key) = &s.api_key {
        let h = req.headers();
        let bearer = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let x = h.get("x-api-key").and_then(|v| v.to_str().ok());
        let open = path == "/health" || path == "/" || req.method() == Method::OPTIONS;
        if !open && bearer != Some(key) && x != Some(key) {
            s.metrics.record_request(&path, 401);
            let e = ApiError::unauthorized();
            return if anthropic { e.anthropic() } else { e }.into_response();
        }
    }
    let r = next.run(req).await;
    let endpoint = if path.starts_with("/v1/models/") { "/v1/models/{id}" } else { &path };
    let known = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/models",
        "/v1/models/{id}",
        "/v1/smoe/stats",
        "/health",
        "/metrics",
        "/",
    ];
    s.metrics.record_request(if known.contains(&endpoint) { endpoint } else { "other" }, r.status().as_u16());
    r
}

/// The router over `state` (for tests and embedding).
pub fn router(state: AppState, cors_origins: &[String]) -> Router {
    let mut app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(one_model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/smoe/stats", get(stats))
        .route("/", get(page))
        .fallback(fallback)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state);
    if !cors_origins.is_empty() {
        let origin = if cors_origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(cors_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
        };
        app = app.layer(CorsLayer::new().allow_origin(origin).allow_methods([Method::GET, Method::POST, Method::OPTIONS]).allow_headers([
            header::AUTHORIZATION,
            header::CONTENT_TYPE,
            "x-api-key".parse().expect("valid header name"),
        ]));
    }
    app
}

/// Serves until Ctrl-C. Prints `listening on ADDR` (the bound address: port 0 picks a free one)
/// on stderr once ready.
pub fn serve(cfg: ServerConfig) -> Result<(), String> {
    let metrics = Arc::new(Metrics::default());
    let fleet = Fleet::new(cfg.fleet.clone(), metrics.clone())?;
    let models = fleet.models();
    if models.is_empty() {
        return Err(format!("no models (*.smoe vaults or *.gguf files) in {}", cfg.fleet.dir.display()));
    }
    if let Some(interval) = fleet.memory_watch() {
        memory::spawn_watch(fleet.clone(), interval);
    }
    let state = AppState { fleet, metrics, api_key: cfg.api_key.as_deref().map(Arc::from), body_limit: cfg.body_limit };
    let app = router(state, &cfg.cors_origins);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.addr).await.map_err(|e| format!("bind {}: {e}", cfg.addr))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        eprintln!("models: {}", models.keys().cloned().collect::<Vec<_>>().join(", "));
        eprintln!("listening on {addr}");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| e.to_string())
    })
}
