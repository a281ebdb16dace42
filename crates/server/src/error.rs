//! API errors, rendered as OpenAI's (or Anthropic's) error JSON with the right status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// Human-readable message.
    pub message: String,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429).
    pub retry_after: Option<u64>,
    /// Render in Anthropic's shape instead of OpenAI's.
    pub anthropic: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None, code: None, retry_after: None, anthropic: false }
    }

    /// 400: the request is malformed or its parameters are invalid.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the parameter at fault.
    pub fn bad_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::bad_request(message) }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "missing or invalid API key")
        }
    }

    /// 404: no such model.
    pub fn unknown_model(name: &str, known: &[String]) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{name}' does not exist; available: {}", known.join(", ")),
            )
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {path}"))
    }

    /// 413: body over the limit.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("request body is over the limit of {limit} bytes"))
    }

    /// 429: the model's queue is full.
    pub fn busy(model: &str, queue: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            code: Some("rate_limit_exceeded"),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("the queue for '{model}' is full ({queue} requests); retry shortly"),
            )
        }
    }

    /// 500: the engine failed (a disk read error, say); the server keeps serving.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 503: the model could not be loaded.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// The same error in Anthropic's shape.
    pub fn anthropic(mut self) -> ApiError {
        self.anthropic = true;
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        if self.anthropic {
            let kind = match self.status.as_u16() {
                400 | 413 => "invalid_request_error",
                401 => "authentication_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                503 => "overloaded_error",
                _ => "api_error",
            };
            return json!({"type": "error", "error": {"type": kind, "message": self.message}});
        }
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}
