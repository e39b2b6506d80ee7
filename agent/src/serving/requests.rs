//! Request bodies: read under a size limit and a deadline, once the request is authenticated.
use super::*;

/// Largest request body either server reads.
pub const BODY_LIMIT: usize = 16 * 1024;
/// How long a client has to send a request body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads a request body under [`BODY_LIMIT`] and [`BODY_TIMEOUT`]; call it only once the
/// request is authenticated (a client without the token cannot hold a slot by trickling).
pub async fn read_body(body: axum::body::Body) -> Result<axum::body::Bytes, (StatusCode, String)> {
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {} KiB", BODY_LIMIT / 1024),
        )),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!("request body not sent within {}s", BODY_TIMEOUT.as_secs()),
        )),
    }
}

/// A request body as one JSON value of `T` (an empty body: `T::default()`), read by
/// [`read_body`]; anything after the value but whitespace, a wrong field or type is a 400
/// naming where (`invalid {what}: {path}: {why}`).
pub async fn read_json<T: serde::de::DeserializeOwned + Default>(
    body: axum::body::Body,
    what: &str,
) -> Result<T, axum::response::Response> {
    let body = read_body(body).await.map_err(|(s, why)| error(s, why))?;
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(T::default());
    }
    let bad = |why: String| error(StatusCode::BAD_REQUEST, format!("invalid {what}: {why}"));
    let de = &mut serde_json::Deserializer::from_slice(&body);
    match serde_path_to_error::deserialize(&mut *de) {
        Ok(r) => match de.end() {
            Ok(()) => Ok(r),
            Err(e) => Err(bad(format!("more after the JSON body ({e})"))),
        },
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Err(bad(if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            }))
        }
    }
}
