//! HTTP/1.1 on the host's API socket, in the style of Firecracker and
//! cloud-hypervisor: REST resources under `/v1`, JSON bodies with named
//! fields, an event stream and Prometheus metrics. Driven with curl:
//!
//! ```text
//! curl --unix-socket /tmp/nl.sock http://localhost/v1/vms
//! ```
//!
//! [`ROUTES`] lists every endpoint; `docs/api.yaml` (OpenAPI 3, generated
//! by `ninelives api --openapi` and checked against the code by a test)
//! gives their bodies. Every request runs under the same limits as a
//! JSON-lines request (64 KiB for head and body together, the request time
//! limit from its first byte, the idle limit between requests) and each
//! operation under a recovery point of its own. A refused request gets a
//! status and `{"error": "..."}`:
//! 400 bad request, 404 no such VM or route, 405 wrong method, 409 refused
//! by a budget or a rejuvenation in progress, 411/413 body length missing
//! or too long, 503 interrupted by a VMM recovery (retry it), 500 other.
//! Responses carry `Ninelives-Api-Version: 1`.
//!
//! `GET /v1/events` streams the host's [`crate::event_log`] as server-sent
//! events (`id:`, `event:`, `data:` lines), from `?after=SEQ` or the
//! `Last-Event-ID` header (default: only new events), with a comment line
//! every [`KEEPALIVE`] so a dead client is noticed. `GET /metrics` is the
//! Prometheus text format.

use std::io::{ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{run_op, ApiError, ConfigBuilder, Got, Requests, ServeCtx, MAX_REQUEST};
use crate::detect::Progress;
use crate::host::{Host, Limits};

/// API version, in the paths (`/v1`) and the `Ninelives-Api-Version` header.
pub const VERSION: u32 = 1;

/// One endpoint: method, path (`{id}` is a VM id), what it does.
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: &'static str,
    /// The JSON-lines operation it maps to (`None`: HTTP only).
    pub op: Option<&'static str>,
}

/// Every endpoint the host serves.
pub const ROUTES: &[Route] = &[
    Route {
        method: "GET",
        path: "/v1/info",
        summary: "The host: pid, version, generation, limits, committed resources",
        op: Some("info"),
    },
    Route { method: "GET", path: "/v1/vms", summary: "List the VMs", op: Some("list") },
    Route { method: "POST", path: "/v1/vms", summary: "Create and start a VM", op: Some("create") },
    Route { method: "GET", path: "/v1/vms/{id}", summary: "A VM's statistics", op: Some("stats") },
    Route {
        method: "PATCH",
        path: "/v1/vms/{id}",
        summary: "Pause or resume a VM: {\"state\":\"paused\"|\"running\"}",
        op: None,
    },
    Route {
        method: "DELETE",
        path: "/v1/vms/{id}",
        summary: "Stop and forget a VM",
        op: Some("destroy"),
    },
    Route {
        method: "POST",
        path: "/v1/rejuvenate",
        summary: "Replace the VMM process while the VMs keep running",
        op: Some("rejuvenate"),
    },
    Route {
        method: "POST",
        path: "/v1/shutdown",
        summary: "Stop every VM and the host",
        op: Some("shutdown"),
    },
    Route {
        method: "GET",
        path: "/v1/sandboxes",
        summary: "List the sandbox sets with each sandbox's state and violations",
        op: Some("sandbox_list"),
    },
    Route {
        method: "POST",
        path: "/v1/sandboxes",
        summary:
            "Create and start a sandbox set: {\"name\": ..., \"set\": <sandbox configuration>}",
        op: Some("sandbox_create"),
    },
    Route {
        method: "GET",
        path: "/v1/sandboxes/{name}",
        summary: "A sandbox set's statistics: per sandbox and per channel",
        op: None,
    },
    Route {
        method: "DELETE",
        path: "/v1/sandboxes/{name}",
        summary: "Stop and forget a sandbox set",
        op: None,
    },
    Route {
        method: "POST",
        path: "/v1/sandboxes/{name}/inject",
        summary: "Inject a fault into one sandbox of a running set: {\"sandbox\": ..., \"fault\": {\"kind\": \"register\", \"cpu\", \"reg\", \"bit\"} or {\"kind\": \"spin\", \"cpu\"}}",
        op: None,
    },
    Route {
        method: "GET",
        path: "/v1/events",
        summary: "Server-sent events: detections, recoveries, VM lifecycle, rejuvenations",
        op: None,
    },
    Route { method: "GET", path: "/metrics", summary: "Prometheus metrics", op: None },
];

/// Comment line sent on an idle event stream.
pub const KEEPALIVE: Duration = Duration::from_secs(10);
/// How often an event stream looks for new events.
const EVENT_POLL: Duration = Duration::from_millis(50);

/// A parsed request: what the router needs.
struct Request {
    method: String,
    path: String,
    query: String,
    body: Vec<u8>,
    close: bool,
    last_event_id: Option<u64>,
}

/// What parsing the bytes read so far gave.
enum Parse {
    /// A whole request, `usize` bytes long.
    Done(Request, usize),
    Partial,
    Bad(u16, String),
}

fn parse(buf: &[u8]) -> Parse {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parse::Partial,
        Err(e) => return Parse::Bad(400, format!("malformed HTTP request: {e}")),
    };
    let (mut length, mut close, mut last_event_id) = (None, req.version == Some(0), None);
    for h in req.headers.iter() {
        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            match v.parse::<usize>() {
                Ok(n) => length = Some(n),
                Err(_) => return Parse::Bad(400, format!("bad Content-Length '{v}'")),
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Parse::Bad(411, "chunked bodies are not accepted: send Content-Length".into());
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        } else if h.name.eq_ignore_ascii_case("last-event-id") {
            last_event_id = v.parse().ok();
        }
    }
    let length = length.unwrap_or(0);
    if head.saturating_add(length) > MAX_REQUEST {
        return Parse::Bad(413, format!("request longer than {MAX_REQUEST} bytes"));
    }
    if buf.len() < head + length {
        return Parse::Partial;
    }
    let target = req.path.unwrap_or("/");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    Parse::Done(
        Request {
            method: req.method.unwrap_or("").to_string(),
            path: path.to_string(),
            query: query.to_string(),
            body: buf[head..head + length].to_vec(),
            close,
            last_event_id,
        },
        head + length,
    )
}

/// Serves HTTP requests on a connection until the client closes it, a
/// limit is hit, or the host stops. `requests` holds the bytes read so far.
pub(super) fn serve(
    stream: &UnixStream,
    host: &Host,
    build: &ConfigBuilder,
    ctx: &ServeCtx,
    progress: &Progress,
    limits: &Limits,
    requests: &mut Requests,
) {
    loop {
        progress.wait();
        let mut deadline = requests.deadline(limits);
        let parsed = loop {
            match parse(requests.filled()) {
                Parse::Partial => {}
                done => break Ok(done),
            }
            if let Err(got) = requests.read_more(stream, limits, &mut deadline) {
                break Err(got);
            }
        };
        progress.resume();
        let (req, len) = match parsed {
            Ok(Parse::Done(req, len)) => (req, len),
            Ok(Parse::Bad(status, why)) => {
                respond(stream, status, &json!({ "error": why }), true, limits, progress);
                return;
            }
            Ok(Parse::Partial) => unreachable!("the loop only ends on a whole request"),
            Err(Got::Closed) => return,
            Err(Got::TooLong) => {
                let why = json!({ "error": Got::TooLong.refusal(limits) });
                respond(stream, 413, &why, true, limits, progress);
                return;
            }
            Err(got) => {
                respond(
                    stream,
                    408,
                    &json!({ "error": got.refusal(limits) }),
                    true,
                    limits,
                    progress,
                );
                return;
            }
        };
        requests.consume(len);
        super::FAULT.pass();
        if req.method == "GET" && req.path == "/v1/events" {
            stream_events(stream, ctx, progress, limits, &req);
            return;
        }
        let (status, body, text) = route(host, build, ctx, progress, &req);
        let sent = match text {
            Some(t) => send(
                stream,
                status,
                "text/plain; version=0.0.4",
                t.as_bytes(),
                req.close,
                limits,
                progress,
            ),
            None => respond(stream, status, &body, req.close, limits, progress),
        };
        if ctx.handed_over.load(Relaxed) {
            // The reply to the rejuvenation is out: this process is done.
            ctx.done.store(true, Relaxed);
            return;
        }
        if !sent || req.close || ctx.done.load(Relaxed) {
            return;
        }
    }
}

/// The VM id in `/v1/vms/{id}`.
fn vm_id(path: &str) -> Option<Result<u32, ApiError>> {
    let rest = path.strip_prefix("/v1/vms/")?;
    Some(rest.parse::<u32>().map_err(|_| ApiError {
        status: 404,
        message: format!("no such VM '{rest}': VM ids are numbers"),
    }))
}

fn body_json(req: &Request) -> Result<Value, ApiError> {
    if req.body.is_empty() {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(&req.body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::bad("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad(format!("malformed JSON body: {e}"))),
    }
}

/// The JSON-lines request an HTTP request stands for.
fn to_op(req: &Request) -> Result<Value, ApiError> {
    let not_allowed = |allowed: &str| ApiError {
        status: 405,
        message: format!("{} {} is not served (allowed: {allowed})", req.method, req.path),
    };
    if let Some(name) =
        req.path.strip_prefix("/v1/sandboxes/").and_then(|p| p.strip_suffix("/inject"))
    {
        if req.method != "POST" {
            return Err(not_allowed("POST"));
        }
        let mut body = body_json(req)?;
        body["op"] = json!("sandbox_inject");
        body["name"] = json!(name);
        return Ok(body);
    }
    if let Some(name) = req.path.strip_prefix("/v1/sandboxes/") {
        return match req.method.as_str() {
            "GET" => Ok(json!({"op": "sandbox_stats", "name": name})),
            "DELETE" => Ok(json!({"op": "sandbox_destroy", "name": name})),
            _ => Err(not_allowed("GET, DELETE")),
        };
    }
    if let Some(id) = vm_id(&req.path) {
        let id = id?;
        return match req.method.as_str() {
            "GET" => Ok(json!({"op": "stats", "id": id})),
            "DELETE" => Ok(json!({"op": "destroy", "id": id})),
            "PATCH" => {
                let b = body_json(req)?;
                match b.get("state").and_then(Value::as_str) {
                    Some("paused") => Ok(json!({"op": "pause", "id": id})),
                    Some("running") => Ok(json!({"op": "resume", "id": id})),
                    _ => Err(ApiError::bad(
                        "PATCH /v1/vms/{id} takes {\"state\": \"paused\"} or {\"state\": \"running\"}",
                    )),
                }
            }
            _ => Err(not_allowed("GET, PATCH, DELETE")),
        };
    }
    let candidates: Vec<&Route> = ROUTES.iter().filter(|r| r.path == req.path).collect();
    let Some(r) = candidates.iter().find(|r| r.method == req.method) else {
        if candidates.is_empty() {
            return Err(ApiError {
                status: 404,
                message: format!("no such resource {} (see GET /v1/info, docs/api.md)", req.path),
            });
        }
        let allowed: Vec<&str> = candidates.iter().map(|r| r.method).collect();
        return Err(not_allowed(&allowed.join(", ")));
    };
    let op = r.op.ok_or_else(|| ApiError::bad("not an operation"))?;
    let mut v = if req.method == "POST" { body_json(req)? } else { json!({}) };
    if v.get("op").is_some() || v.get("id").is_some() {
        return Err(ApiError::bad("the body names no \"op\" or \"id\": the path does"));
    }
    v["op"] = json!(op);
    Ok(v)
}

/// Status, JSON body, or a text body (metrics).
fn route(
    host: &Host,
    build: &ConfigBuilder,
    ctx: &ServeCtx,
    progress: &Progress,
    req: &Request,
) -> (u16, Value, Option<String>) {
    if req.path == "/metrics" {
        return if req.method == "GET" {
            (200, Value::Null, Some(metrics(host)))
        } else {
            (405, json!({"error": "GET /metrics only"}), None)
        };
    }
    let op = match to_op(req) {
        Ok(op) => op,
        Err(e) => return (e.status, json!({ "error": e.message }), None),
    };
    match run_op(host, build, &op, ctx, progress) {
        Ok(v) if op["op"] == "create" || op["op"] == "sandbox_create" => (201, v, None),
        Ok(v) => (200, v, None),
        Err(e) if e.status == 503 => (503, json!({"error": e.message, "interrupted": true}), None),
        Err(e) => (e.status, json!({ "error": e.message }), None),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

fn respond(
    stream: &UnixStream,
    status: u16,
    body: &Value,
    close: bool,
    limits: &Limits,
    progress: &Progress,
) -> bool {
    let mut b = body.to_string();
    b.push('\n');
    send(stream, status, "application/json", b.as_bytes(), close, limits, progress)
}

fn send(
    stream: &UnixStream,
    status: u16,
    content_type: &str,
    body: &[u8],
    close: bool,
    limits: &Limits,
    progress: &Progress,
) -> bool {
    write_all(
        stream,
        &response(status, content_type, body, close),
        limits.request_timeout,
        progress,
    )
}

/// One whole HTTP response.
fn response(status: u16, content_type: &str, body: &[u8], close: bool) -> Vec<u8> {
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Ninelives-Api-Version: {VERSION}\r\n{}\r\n",
        reason(status),
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    let mut all = head.into_bytes();
    all.extend_from_slice(body);
    all
}

/// The response to a connection refused before anything was read from it
/// (another user, too many connections): `status`, `{"error": why}`, and
/// `Connection: close`.
pub(super) fn refusal(status: u16, why: &str) -> Vec<u8> {
    let mut body = json!({ "error": why }).to_string();
    body.push('\n');
    response(status, "application/json", body.as_bytes(), true)
}

/// Writes within `timeout` (a client that does not read is cut off); the
/// thread waits for the hang watchdog meanwhile. Both protocols reply
/// through it. False if the bytes did not all go out.
pub(super) fn write_all(
    stream: &UnixStream,
    mut rest: &[u8],
    timeout: Duration,
    progress: &Progress,
) -> bool {
    let deadline = Instant::now() + timeout;
    progress.wait();
    let sent = crate::recovery::safe(|| {
        while !rest.is_empty() {
            let Some(wait) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            if wait.is_zero() || stream.set_write_timeout(Some(wait)).is_err() {
                return false;
            }
            match (&*stream).write(rest) {
                Ok(0) => return false,
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        true
    });
    progress.resume();
    sent
}

/// `GET /v1/events`: the event log as server-sent events, until the client
/// goes away or the host stops serving.
fn stream_events(
    stream: &UnixStream,
    ctx: &ServeCtx,
    progress: &Progress,
    limits: &Limits,
    req: &Request,
) {
    let after = req
        .query
        .split('&')
        .find_map(|kv| kv.strip_prefix("after="))
        .and_then(|v| v.parse::<u64>().ok())
        .or(req.last_event_id)
        .unwrap_or_else(crate::event_log::last_seq);
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         Ninelives-Api-Version: {VERSION}\r\nConnection: close\r\n\r\n: ninelives events after {after}\n\n"
    );
    if !write_all(stream, head.as_bytes(), limits.request_timeout, progress) {
        return;
    }
    let mut last = after;
    let mut quiet_since = Instant::now();
    while !ctx.done.load(Relaxed) && !ctx.handed_over.load(Relaxed) {
        let (events, missed) = crate::event_log::since(last);
        let mut out = String::new();
        if missed > 0 {
            out.push_str(&format!("event: missed\ndata: {{\"missed\":{missed}}}\n\n"));
        }
        for e in &events {
            let data = json!({"seq": e.seq, "ts_ms": e.ts_ms, "kind": e.kind, "data": e.data});
            out.push_str(&format!("id: {}\nevent: {}\ndata: {data}\n\n", e.seq, e.kind));
            last = e.seq;
        }
        if out.is_empty() && quiet_since.elapsed() >= KEEPALIVE {
            out.push_str(": keepalive\n\n");
        }
        if !out.is_empty() {
            if !write_all(stream, out.as_bytes(), limits.request_timeout, progress) {
                return;
            }
            quiet_since = Instant::now();
        }
        progress.wait();
        crate::recovery::safe(|| std::thread::sleep(EVENT_POLL));
        progress.resume();
    }
}

/// The Prometheus text exposition of the host and its VMs.
pub fn metrics(host: &Host) -> String {
    use std::fmt::Write as _;
    let mut m = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(m, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(m, "{name}{labels} {v}");
        }
    };
    let vms = host.hosted();
    let (mem, vcpus) = host.committed();
    let limits = host.limits();
    metric("ninelives_vms", "gauge", "VMs hosted now.", &[(String::new(), vms.len() as f64)]);
    metric(
        "ninelives_committed_mem_bytes",
        "gauge",
        "Guest memory committed to VMs.",
        &[(String::new(), mem as f64)],
    );
    metric(
        "ninelives_mem_budget_bytes",
        "gauge",
        "Guest memory budget (host --mem-budget).",
        &[(String::new(), limits.mem_budget as f64)],
    );
    metric(
        "ninelives_committed_vcpus",
        "gauge",
        "vCPUs committed to VMs.",
        &[(String::new(), f64::from(vcpus))],
    );
    metric(
        "ninelives_generation",
        "gauge",
        "VMM processes this host has been served by (rejuvenations and microreboots).",
        &[(String::new(), host.generation() as f64)],
    );
    metric(
        "ninelives_recoveries_total",
        "counter",
        "Microresets and microreboots completed by this process.",
        &[(String::new(), crate::recovery::threads::COMPLETED.load(Relaxed) as f64)],
    );
    let (events, dropped) = crate::event_log::counts();
    metric(
        "ninelives_events_total",
        "counter",
        "Events published to the event log.",
        &[(String::new(), events as f64)],
    );
    metric(
        "ninelives_events_dropped_total",
        "counter",
        "Events dropped because the log was busy.",
        &[(String::new(), dropped as f64)],
    );
    let mut exits = Vec::new();
    let (mut paused, mut age, mut ops) = (Vec::new(), Vec::new(), Vec::new());
    for h in &vms {
        let id = h.vm.id();
        let r = h.vm.report();
        paused.push((format!("{{vm=\"{id}\"}}"), f64::from(u8::from(r.paused))));
        age.push((format!("{{vm=\"{id}\"}}"), h.heartbeat_age().as_secs_f64()));
        for v in &r.vcpus {
            let c = v.cpu;
            for (kind, n) in [
                ("io", v.exits.io_exits),
                ("mmio", v.exits.mmio_exits),
                ("interrupted", v.exits.interrupted),
                ("other", v.exits.other_exits),
            ] {
                exits.push((format!("{{vm=\"{id}\",vcpu=\"{c}\",kind=\"{kind}\"}}"), n as f64));
            }
            ops.push((format!("{{vm=\"{id}\",vcpu=\"{c}\"}}"), v.regs.ops as f64));
        }
    }
    metric("ninelives_vm_paused", "gauge", "1 if the VM is paused.", &paused);
    metric(
        "ninelives_vm_heartbeat_age_seconds",
        "gauge",
        "Time since the guest last showed progress (heartbeat or phase change).",
        &age,
    );
    metric("ninelives_vcpu_exits_total", "counter", "vCPU exits to the VMM by kind.", &exits);
    metric(
        "ninelives_vcpu_ops",
        "gauge",
        "Workload operations the guest reported (reference guest).",
        &ops,
    );
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, path: &str, body: &str) -> Request {
        Request {
            method: method.into(),
            path: path.into(),
            query: String::new(),
            body: body.as_bytes().to_vec(),
            close: false,
            last_event_id: None,
        }
    }

    /// The client's HTTP request for every operation is the one the server
    /// maps back to that same operation: the two tables agree.
    #[test]
    fn every_operation_round_trips_through_its_route() {
        let ops = [
            json!({"op": "info"}),
            json!({"op": "list"}),
            json!({"op": "create", "workload": "idle", "mem": "64M"}),
            json!({"op": "stats", "id": 3}),
            json!({"op": "pause", "id": 3}),
            json!({"op": "resume", "id": 3}),
            json!({"op": "destroy", "id": 3}),
            json!({"op": "rejuvenate", "mode": "warm"}),
            json!({"op": "shutdown"}),
            json!({"op": "sandbox_list"}),
            json!({"op": "sandbox_create", "name": "a", "set": {}}),
            json!({"op": "sandbox_stats", "name": "a"}),
            json!({"op": "sandbox_destroy", "name": "a"}),
        ];
        for op in ops {
            let c = super::super::client::route_of(&op).unwrap();
            let body = c.body.as_ref().map(Value::to_string).unwrap_or_default();
            assert_eq!(to_op(&req(c.method, &c.path, &body)).unwrap(), op, "{c:?}");
        }
        let served: Vec<&str> = ROUTES.iter().filter_map(|r| r.op).collect();
        for op in served {
            let e = super::super::client::route_of(&json!({"op": op, "id": 1, "name": "a"}));
            assert!(e.is_ok(), "the client has no route for {op}");
        }
    }

    #[test]
    fn requests_parse_whole_partial_and_bad() {
        let r = b"POST /v1/vms HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}GET";
        match parse(r) {
            Parse::Done(q, n) => {
                assert_eq!(
                    (q.method.as_str(), q.path.as_str(), &q.body[..]),
                    ("POST", "/v1/vms", &b"{}"[..])
                );
                assert_eq!(n, r.len() - 3);
            }
            _ => panic!("a whole request"),
        }
        assert!(matches!(
            parse(b"POST /v1/vms HTTP/1.1\r\nContent-Length: 5\r\n\r\n{}"),
            Parse::Partial
        ));
        assert!(matches!(parse(b"GET /v1/vms HTTP/1.1\r\n"), Parse::Partial));
        assert!(matches!(
            parse(b"GET /v1/vms HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Parse::Bad(400, _)
        ));
        assert!(matches!(parse(b"GET\x01 / HTTP/1.1\r\n\r\n"), Parse::Bad(400, _)));
        let big = format!("POST /v1/vms HTTP/1.1\r\nContent-Length: {}\r\n\r\n", MAX_REQUEST);
        assert!(matches!(parse(big.as_bytes()), Parse::Bad(413, _)));
        let chunked = b"POST /v1/vms HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(parse(chunked), Parse::Bad(411, _)));
        match parse(b"GET /v1/events?after=7 HTTP/1.0\r\n\r\n") {
            Parse::Done(q, _) => assert!(q.close && q.query == "after=7"),
            _ => panic!(),
        }
    }

    #[test]
    fn routes_map_to_operations_with_named_errors() {
        assert_eq!(to_op(&req("GET", "/v1/vms", "")).unwrap(), json!({"op": "list"}));
        assert_eq!(to_op(&req("GET", "/v1/vms/3", "")).unwrap(), json!({"op": "stats", "id": 3}));
        assert_eq!(
            to_op(&req("DELETE", "/v1/vms/3", "")).unwrap(),
            json!({"op": "destroy", "id": 3})
        );
        assert_eq!(
            to_op(&req("PATCH", "/v1/vms/3", r#"{"state":"paused"}"#)).unwrap(),
            json!({"op": "pause", "id": 3})
        );
        assert_eq!(
            to_op(&req("PATCH", "/v1/vms/3", r#"{"state":"running"}"#)).unwrap(),
            json!({"op": "resume", "id": 3})
        );
        let create = to_op(&req("POST", "/v1/vms", r#"{"workload":"compute","vcpus":2}"#)).unwrap();
        assert_eq!(create, json!({"op": "create", "workload": "compute", "vcpus": 2}));
        let status = |m: &str, p: &str, b: &str| to_op(&req(m, p, b)).unwrap_err().status;
        assert_eq!(status("GET", "/v1/nothing", ""), 404);
        assert_eq!(status("GET", "/v1/vms/x", ""), 404);
        assert_eq!(status("PUT", "/v1/vms", ""), 405);
        assert_eq!(status("POST", "/v1/vms/1", ""), 405);
        assert_eq!(status("PATCH", "/v1/vms/1", r#"{"state":"gone"}"#), 400);
        assert_eq!(status("POST", "/v1/vms", "[1]"), 400);
        assert_eq!(status("POST", "/v1/vms", "{"), 400);
        assert_eq!(status("POST", "/v1/vms", r#"{"op":"shutdown"}"#), 400);
    }
}
