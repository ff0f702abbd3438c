//! The client side of the host API: [`request`] takes an operation in the
//! JSON-lines shape (`{"op":"stats","id":0}`) that `ninelives api`, the lab
//! and the tests use, sends the HTTP request it stands for ([`route_of`]),
//! and gives the reply back in that shape: the response body with
//! `"ok": true`, or `{"ok": false, "error": ..., "status": N}` (and
//! `"interrupted": true` for a request a VMM recovery discarded).
//!
//! So callers speak the one protocol a host serves by default; the
//! JSON-lines protocol itself is served only by `ninelives host
//! --api-legacy`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::VmmError;

/// Replies larger than this are refused (a stats reply is a few KiB).
const MAX_REPLY: u64 = 16 << 20;

/// One HTTP request: method, path, JSON body (or none).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpCall {
    pub method: &'static str,
    pub path: String,
    pub body: Option<Value>,
}

/// The HTTP request an operation stands for, or why there is none.
pub fn route_of(req: &Value) -> Result<HttpCall, String> {
    let op = req.get("op").and_then(Value::as_str).ok_or("a request needs an \"op\"")?;
    // The rest of the request is the body (POST) or names the resource.
    let mut rest = req.clone();
    if let Some(m) = rest.as_object_mut() {
        m.remove("op");
    }
    let id = || match req.get("id") {
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(format!("\"{op}\" needs a numeric \"id\"")),
    };
    let name = || {
        req.get("name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("\"{op}\" needs a sandbox set \"name\""))
    };
    let call = |method, path: String, body| Ok(HttpCall { method, path, body });
    match op {
        "info" => call("GET", "/v1/info".into(), None),
        "list" => call("GET", "/v1/vms".into(), None),
        "create" => call("POST", "/v1/vms".into(), Some(rest)),
        "stats" => call("GET", format!("/v1/vms/{}", id()?), None),
        "pause" => call("PATCH", format!("/v1/vms/{}", id()?), Some(json!({"state": "paused"}))),
        "resume" => call("PATCH", format!("/v1/vms/{}", id()?), Some(json!({"state": "running"}))),
        "destroy" => call("DELETE", format!("/v1/vms/{}", id()?), None),
        "rejuvenate" => call("POST", "/v1/rejuvenate".into(), Some(rest)),
        "shutdown" => call("POST", "/v1/shutdown".into(), None),
        "sandbox_list" => call("GET", "/v1/sandboxes".into(), None),
        "sandbox_create" => call("POST", "/v1/sandboxes".into(), Some(rest)),
        "sandbox_stats" => call("GET", format!("/v1/sandboxes/{}", name()?), None),
        "sandbox_destroy" => call("DELETE", format!("/v1/sandboxes/{}", name()?), None),
        "sandbox_inject" => call("POST", format!("/v1/sandboxes/{}/inject", name()?), Some(rest)),
        other => Err(format!(
            "unknown op '{other}' (info, list, create, stats, pause, resume, destroy, \
             rejuvenate, shutdown, sandbox_list, sandbox_create, sandbox_stats, sandbox_destroy, \
             sandbox_inject)"
        )),
    }
}

/// Sends one operation to the host on `path` (60 s reply timeout).
pub fn request(path: &Path, req: &Value) -> Result<Value, VmmError> {
    request_timeout(path, req, Duration::from_secs(60))
}

/// [`request`] with a reply timeout of its own (rejuvenation can take long).
pub fn request_timeout(path: &Path, req: &Value, timeout: Duration) -> Result<Value, VmmError> {
    let call = match route_of(req) {
        Ok(c) => c,
        Err(e) => return Ok(json!({"ok": false, "error": e})),
    };
    let mut s = UnixStream::connect(path)
        .map_err(|e| VmmError::Config(format!("cannot connect to {}: {e}", path.display())))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let body = call.body.as_ref().map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{} {} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        call.method,
        call.path,
        body.len()
    );
    // A host that refuses this client (another user, too many connections)
    // writes its reason and closes without reading the request: the write
    // may then fail (EPIPE), and the reason is still there to read.
    let sent = s.write_all(format!("{head}{body}").as_bytes());
    let mut reply = Vec::new();
    let read = (&s).take(MAX_REPLY).read_to_end(&mut reply);
    // A refusal is followed by the host's close, which can reset the
    // connection (our request unread): what arrived before still counts.
    if !reply.is_empty() {
        return parse_reply(&reply);
    }
    match (read, sent) {
        (_, Err(e)) | (Err(e), Ok(())) => Err(e.into()),
        (Ok(_), Ok(())) => Err(VmmError::Config("the host closed without a reply".into())),
    }
}

/// The reply in the operation shape: an HTTP response, or the one JSON
/// line a host writes when it refuses a connection before reading it.
pub fn parse_reply(reply: &[u8]) -> Result<Value, VmmError> {
    let bad = |why: String| VmmError::Config(format!("bad reply from host: {why}"));
    if !reply.starts_with(b"HTTP/") {
        return serde_json::from_slice(reply.trim_ascii()).map_err(|e| bad(e.to_string()));
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head = match resp.parse(reply) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err(bad("incomplete response".into())),
        Err(e) => return Err(bad(e.to_string())),
    };
    let status = resp.code.unwrap_or(0);
    let body = &reply[head..];
    let mut v: Value = if body.trim_ascii().is_empty() {
        json!({})
    } else {
        serde_json::from_slice(body).map_err(|e| bad(format!("status {status}: {e}")))?
    };
    if !v.is_object() {
        return Err(bad(format!("status {status}: the body is not a JSON object")));
    }
    if (200..300).contains(&status) {
        v["ok"] = json!(true);
    } else {
        v["ok"] = json!(false);
        v["status"] = json!(status);
        if v.get("error").is_none() {
            v["error"] = json!(format!("HTTP status {status}"));
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_take_the_operation_shape() {
        let ok = b"HTTP/1.1 201 Created\r\nContent-Length: 9\r\n\r\n{\"id\":3}\n";
        assert_eq!(parse_reply(ok).unwrap(), json!({"ok": true, "id": 3}));
        let no = b"HTTP/1.1 409 Conflict\r\nContent-Length: 17\r\n\r\n{\"error\":\"full\"}\n";
        assert_eq!(parse_reply(no).unwrap(), json!({"ok": false, "error": "full", "status": 409}));
        let refused = b"{\"ok\":false,\"error\":\"too many connections\"}\n";
        assert_eq!(parse_reply(refused).unwrap()["error"], "too many connections");
        assert!(parse_reply(b"HTTP/1.1 200 OK\r\n\r\n[1]").is_err());
    }

    #[test]
    fn operations_without_a_route_are_refused_here() {
        assert!(route_of(&json!({"op": "stats"})).unwrap_err().contains("numeric \"id\""));
        assert!(route_of(&json!({"op": "reboot"})).unwrap_err().contains("unknown op 'reboot'"));
        assert!(route_of(&json!({})).unwrap_err().contains("needs an \"op\""));
    }
}
