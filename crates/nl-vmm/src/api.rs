//! The Unix-socket API of `ninelives host`.
//!
//! One JSON object per line in each direction. Requests name an operation
//! and, where it applies, a VM id:
//!
//! ```text
//! {"op":"create", ...VM parameters...}   -> {"ok":true,"id":0}
//! {"op":"list"}                          -> {"ok":true,"vms":[...]}
//! {"op":"pause","id":0}                  -> {"ok":true}
//! {"op":"resume","id":0}                 -> {"ok":true}
//! {"op":"stats","id":0}                  -> {"ok":true,"stats":{...}}
//! {"op":"destroy","id":0}                -> {"ok":true}
//! {"op":"shutdown"}                      -> {"ok":true}   (stops the host)
//! {"op":"info"}                          -> {"ok":true,"pid":N,"version":"...","generation":N}
//! {"op":"rejuvenate","mode":"warm"|"cold"|"save-restore",
//!  "binary":"/path", "image_dir":"/dir", "timeout_secs":N,
//!  "prespawn":true|false (all optional; prespawn: warm only, default true)}
//!                                        -> {"ok":true,"report":{...}}
//! ```
//!
//! After a successful `rejuvenate` the reply comes from the old process,
//! which then exits; the new process keeps serving on the same listening
//! socket (it never disappears). Connections opened before the handover are
//! closed and must reconnect.
//!
//! Every failure is `{"ok":false,"error":"..."}`; a bad request never
//! affects the other VMs or other connections.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::handover::Mode;
use crate::host::Host;
use crate::rejuvenate;
use crate::{VmConfig, VmmError};

/// Longest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Turns the parameters of a `create` request into a VM configuration.
pub type ConfigBuilder = dyn Fn(&Value) -> Result<VmConfig, String> + Send + Sync;

/// Serves the API on `path` until a `shutdown` request.
pub fn serve(host: Arc<Host>, path: &Path, build: Arc<ConfigBuilder>) -> Result<(), VmmError> {
    if path.exists() {
        // A live host on this socket would answer; refuse to steal it.
        if UnixStream::connect(path).is_ok() {
            return Err(VmmError::Config(format!("{} is in use by another host", path.display())));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| VmmError::Config(format!("cannot listen on {}: {e}", path.display())))?;
    serve_listener(host, listener, path, build)
}

/// State of one serving process shared by its connections.
pub struct ServeCtx {
    path: PathBuf,
    listener_fd: i32,
    /// Stop serving (after `shutdown`, or after a handover).
    done: AtomicBool,
    /// A rejuvenation is in progress: accept nothing, change nothing.
    hold: AtomicBool,
    /// The VMs now belong to a new process: exit without touching them or
    /// the socket file.
    handed_over: AtomicBool,
}

/// Serves the API on an already listening socket (one inherited from the
/// previous VMM process after a handover) until `shutdown` or a handover.
pub fn serve_listener(
    host: Arc<Host>,
    listener: UnixListener,
    path: &Path,
    build: Arc<ConfigBuilder>,
) -> Result<(), VmmError> {
    let ctx = Arc::new(ServeCtx {
        path: path.to_path_buf(),
        listener_fd: listener.as_raw_fd(),
        done: AtomicBool::new(false),
        hold: AtomicBool::new(false),
        handed_over: AtomicBool::new(false),
    });
    listener.set_nonblocking(true)?;
    crate::recovery::set_api(listener.as_raw_fd(), path);
    crate::seccomp::apply(crate::seccomp::Kind::Api);
    let _reg = crate::recovery::enter(false);
    let progress = crate::detect::track();
    while !ctx.done.load(Relaxed) {
        // A discarded accept loop starts over (a connection accepted but not
        // yet served is dropped; its client sees the connection close).
        let r = crate::recovery::protected(|| -> Result<(), VmmError> {
            while !ctx.done.load(Relaxed) {
                progress.beat();
                if ctx.hold.load(Relaxed) {
                    // Connections wait in the backlog for whichever process serves next.
                    crate::recovery::safe(|| std::thread::sleep(Duration::from_millis(1)));
                    continue;
                }
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (host, build, ctx) = (host.clone(), build.clone(), ctx.clone());
                        let _ = std::thread::Builder::new()
                            .name("api-conn".into())
                            .spawn(move || serve_connection(stream, &host, &*build, &ctx));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        crate::recovery::safe(|| std::thread::sleep(Duration::from_millis(2)));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        });
        if let crate::recovery::Outcome::Done(r) = r {
            r?;
        }
    }
    progress.wait();
    if ctx.handed_over.load(Relaxed) {
        return Ok(());
    }
    host.shutdown();
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// A self-test fault in the connections, armed by [`arm_fault_hook`].
static FAULT: nl_sync::FaultHook = nl_sync::FaultHook::new();

/// Arms the self-test fault (tests of VMM recovery): the connection that
/// reads the `after`-th request from now runs `hook` once it has read it,
/// outside the request's handling.
pub fn arm_fault_hook(after: u64, hook: fn()) {
    FAULT.arm(after, hook);
}

fn serve_connection(stream: UnixStream, host: &Host, build: &ConfigBuilder, ctx: &ServeCtx) {
    crate::seccomp::apply(crate::seccomp::Kind::Api);
    let _ = stream.set_nonblocking(false);
    let _reg = crate::recovery::enter(false);
    let progress = crate::detect::track();
    // The whole exchange runs under a recovery point: an error anywhere in
    // it (reading, parsing, answering; handling has a point of its own)
    // discards the connection, and the stream, owned out here, closes, so
    // the client sees the connection end without an answer.
    let _ = crate::recovery::protected(|| serve_requests(&stream, host, build, ctx, &progress));
}

fn serve_requests(
    stream: &UnixStream,
    host: &Host,
    build: &ConfigBuilder,
    ctx: &ServeCtx,
    progress: &crate::detect::Progress,
) {
    let mut out = stream;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = Vec::new();
        progress.wait();
        let got = crate::recovery::safe(|| {
            (&mut reader).take(MAX_REQUEST as u64 + 1).read_until(b'\n', &mut line)
        });
        progress.resume();
        match got {
            Ok(0) | Err(_) => return,
            Ok(_) => FAULT.pass(),
        }
        let reply = if line.len() > MAX_REQUEST {
            // Drop the rest of an oversized line, then answer it.
            let mut sink = Vec::new();
            let _ = (&mut reader).take(1 << 30).read_until(b'\n', &mut sink);
            json!({"ok": false, "error": format!("request longer than {MAX_REQUEST} bytes")})
        } else {
            match serde_json::from_slice::<Value>(&line) {
                Ok(req) => {
                    // These wait on other threads (vCPUs, a successor VMM), which are
                    // checked themselves, or on the kernel (creating a VM's memory
                    // slots can block in synchronize_srcu for long on a loaded host).
                    if matches!(
                        req.get("op").and_then(Value::as_str),
                        Some("create" | "pause" | "destroy" | "rejuvenate")
                    ) {
                        progress.wait();
                    }
                    // A request discarded by a microreset is answered as such:
                    // the client may retry it.
                    match crate::recovery::protected(|| handle_in(host, build, &req, ctx)) {
                        crate::recovery::Outcome::Done(v) => v,
                        crate::recovery::Outcome::Recovered { .. } => json!({
                            "ok": false, "interrupted": true,
                            "error": "the request was interrupted by a VMM recovery; retry it",
                        }),
                    }
                }
                Err(e) => json!({"ok": false, "error": format!("malformed request: {e}")}),
            }
        };
        let written = writeln!(out, "{reply}").is_ok();
        if ctx.handed_over.load(Relaxed) {
            // The reply to `rejuvenate` is out: this process is done.
            ctx.done.store(true, Relaxed);
            return;
        }
        if !written {
            return;
        }
    }
}

fn id_of(req: &Value) -> Result<u32, String> {
    req.get("id")
        .and_then(Value::as_u64)
        .and_then(|i| u32::try_from(i).ok())
        .ok_or_else(|| "this request needs a numeric \"id\"".to_string())
}

/// Handles one request outside of a serving loop (no rejuvenation).
pub fn handle(host: &Host, build: &ConfigBuilder, req: &Value, done: &AtomicBool) -> Value {
    let ctx = ServeCtx {
        path: PathBuf::new(),
        listener_fd: -1,
        done: AtomicBool::new(false),
        hold: AtomicBool::new(false),
        handed_over: AtomicBool::new(false),
    };
    let r = handle_in(host, build, req, &ctx);
    if ctx.done.load(Relaxed) {
        done.store(true, Relaxed);
    }
    r
}

fn rejuvenate_op(host: &Host, req: &Value, ctx: &ServeCtx) -> Result<Value, String> {
    let mode = Mode::parse(
        req.get("mode")
            .and_then(Value::as_str)
            .ok_or("rejuvenate needs a \"mode\": warm, cold or save-restore")?,
    )?;
    let binary = match req.get("binary") {
        None | Some(Value::Null) => rejuvenate::current_binary().map_err(|e| e.to_string())?,
        Some(Value::String(p)) => PathBuf::from(p),
        Some(_) => return Err("\"binary\" must be a path string".into()),
    };
    let image_dir = match req.get("image_dir") {
        None | Some(Value::Null) => rejuvenate::default_image_dir(),
        Some(Value::String(p)) => PathBuf::from(p),
        Some(_) => return Err("\"image_dir\" must be a path string".into()),
    };
    let timeout = match req.get("timeout_secs") {
        None | Some(Value::Null) => Duration::from_secs(60),
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t > 0.0 && *t <= 3600.0)
            .map(Duration::from_secs_f64)
            .ok_or("\"timeout_secs\" must be a number of seconds in (0, 3600]")?,
    };
    let prespawn = match req.get("prespawn") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("\"prespawn\" must be true or false".into()),
    };
    if ctx.listener_fd < 0 {
        return Err("rejuvenate needs a host serving on a socket".into());
    }
    if ctx.hold.swap(true, Relaxed) {
        return Err("a rejuvenation is already in progress".into());
    }
    let opts = rejuvenate::Options {
        mode,
        binary,
        api_path: ctx.path.clone(),
        image_dir,
        timeout,
        prespawn,
    };
    let report = rejuvenate::rejuvenate(host, Some(ctx.listener_fd), &opts);
    if report.ok {
        ctx.handed_over.store(true, Relaxed);
    } else {
        ctx.hold.store(false, Relaxed);
    }
    Ok(json!({ "report": report, "handed_over": report.ok }))
}

fn handle_in(host: &Host, build: &ConfigBuilder, req: &Value, ctx: &ServeCtx) -> Value {
    let r = (|| -> Result<Value, String> {
        let op = req.get("op").and_then(Value::as_str).ok_or("request needs an \"op\" string")?;
        let e = |e: VmmError| e.to_string();
        if ctx.hold.load(Relaxed) && matches!(op, "create" | "pause" | "resume" | "destroy") {
            return Err(format!("cannot {op} now: the host is being rejuvenated"));
        }
        Ok(match op {
            "rejuvenate" => rejuvenate_op(host, req, ctx)?,
            "info" => json!({
                "pid": std::process::id(),
                "version": env!("CARGO_PKG_VERSION"),
                "generation": host.generation(),
            }),
            "create" => json!({"id": host.create(build(req)?).map_err(e)?}),
            "list" => json!({"vms": host.list()}),
            "pause" => {
                host.pause(id_of(req)?).map_err(e)?;
                json!({})
            }
            "resume" => {
                host.resume(id_of(req)?).map_err(e)?;
                json!({})
            }
            "stats" => json!({"stats": host.stats_value(id_of(req)?).map_err(e)?}),
            "destroy" => {
                host.destroy(id_of(req)?).map_err(e)?;
                json!({})
            }
            "shutdown" => {
                ctx.done.store(true, Relaxed);
                json!({})
            }
            other => {
                return Err(format!(
                    "unknown op \"{other}\" (create, list, pause, resume, stats, destroy, \
                     info, rejuvenate, shutdown)"
                ))
            }
        })
    })();
    match r {
        Ok(mut v) => {
            v["ok"] = json!(true);
            v
        }
        Err(e) => json!({"ok": false, "error": e}),
    }
}

/// Sends one request to a host and returns its reply.
pub fn request(path: &Path, req: &Value) -> Result<Value, VmmError> {
    request_timeout(path, req, Duration::from_secs(60))
}

/// [`request`] with a reply timeout of its own (rejuvenation can take long).
pub fn request_timeout(path: &Path, req: &Value, timeout: Duration) -> Result<Value, VmmError> {
    let mut s = UnixStream::connect(path)
        .map_err(|e| VmmError::Config(format!("cannot connect to {}: {e}", path.display())))?;
    s.set_read_timeout(Some(timeout))?;
    writeln!(s, "{req}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| VmmError::Config(format!("bad reply from host: {e}")))
}
