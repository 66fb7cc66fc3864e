//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param",
//! "code"}}` with the HTTP status that says what went wrong.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type.
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<&'static str>,
    /// A machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400: a request the server cannot take as it is.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(Some(param))
    }

    /// With the field at fault.
    #[must_use]
    pub fn with_param(mut self, param: Option<&'static str>) -> Self {
        self.param = param;
        self
    }

    /// 401: no or a wrong API key.
    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "a valid API key is needed: send `Authorization: Bearer <key>`",
        );
        e.code = Some("invalid_api_key");
        e
    }

    /// 404: an unknown model.
    pub fn no_model(asked: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{asked}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model");
        e.code = Some("model_not_found");
        e
    }

    /// 404: an unknown path.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "no route {path}; see GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
            ),
        )
    }

    /// 405.
    pub fn method(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is over this server's limit of {limit} bytes"),
        )
    }

    /// 415.
    pub fn media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "the request body must be JSON (Content-Type: application/json)",
        )
    }

    /// 429: the queue is full.
    pub fn busy(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
        e.code = Some("queue_full");
        e
    }

    /// 503: shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The body.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}
