//! The Unix-socket API of `ninelives host`.
//!
//! The socket speaks HTTP/1.1 ([`http`]: REST resources under `/v1`, an
//! event stream, Prometheus metrics; documented in `docs/api.md` and
//! `docs/api.yaml`). A host started with `--api-legacy` also speaks the
//! original JSON-lines protocol below, told apart by a connection's first
//! byte (`{`), for one more release; without it such a connection gets one
//! error line saying so. The clients of this repository (`ninelives api`,
//! the lab, the injector, the tests) send operations in the JSON-lines
//! shape through [`client::request`], which speaks HTTP.
//!
//! JSON lines: one JSON object per line in each direction. Requests name an
//! operation and, where it applies, a VM id:
//!
//! ```text
//! {"op":"create", ...VM parameters...}   -> {"ok":true,"id":0}
//! {"op":"list"}                          -> {"ok":true,"vms":[...]}
//! {"op":"pause","id":0}                  -> {"ok":true}
//! {"op":"resume","id":0}                 -> {"ok":true}
//! {"op":"stats","id":0}                  -> {"ok":true,"stats":{...}}
//! {"op":"destroy","id":0}                -> {"ok":true}
//! {"op":"shutdown"}                      -> {"ok":true}   (stops the host)
//! {"op":"info"}                          -> {"ok":true,"pid":N,"version":"...","generation":N,
//!                                            "limits":{...},"committed":{"mem_bytes":N,"vcpus":N}}
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
//!
//! ## Who may connect
//!
//! The socket file is created with mode 0600, and every connection is
//! authenticated by the credentials the kernel records for its peer
//! (SO_PEERCRED): only the host's own user and root are served; anyone else
//! gets one error line and the connection is closed.
//!
//! ## Limits
//!
//! No client can make the host buffer, wait or commit without bound
//! ([`crate::host::Limits`], set by `ninelives host` options):
//!
//! - A request line holds at most [`MAX_REQUEST`] (64 KiB) bytes, newline
//!   included, and must be complete within the request time limit
//!   (`--request-timeout`, default 10 s) of its first byte. Otherwise the
//!   client gets one error line and the connection is closed; nothing past
//!   the limit is read or kept. A reply the client does not read within the
//!   same time is dropped with the connection.
//! - A connection with no request for the idle time limit (`--idle-timeout`,
//!   default 600 s) gets an error line and is closed.
//! - Waiting on a client (reading its request, sending the reply) is never
//!   counted as a hang by the watchdog: only the time limits end it.
//! - At most `--max-connections` (default 64) connections are served at
//!   once; one more gets an error line saying so and is closed.
//! - `create` is refused when the guest memory of the hosted VMs plus the
//!   new one would exceed the memory budget (`--mem-budget`; default the
//!   host's MemAvailable at start minus 1 GiB or a tenth, whichever is
//!   more), or their vCPUs the vCPU budget (`--vcpu-budget`; default 16 per
//!   online CPU, at least 32). A VM counts until it is destroyed. A VM has 1
//!   to [`nl_abi::MAX_VCPUS`] vCPUs.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{
    AtomicBool, AtomicUsize,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::handover::Mode;
use crate::host::{Host, Limits};
use crate::linux::LinuxBoot;
use crate::rejuvenate;
use crate::{VmConfig, VmmError};

pub mod client;
pub mod http;

pub use client::{request, request_timeout};

/// Longest request line accepted, newline included.
pub const MAX_REQUEST: usize = 64 * 1024;

/// What the front end (the `ninelives` binary) adds to the host's API:
/// turning `create` parameters into a VM configuration, and resources the
/// VMM layer does not know itself (sandbox sets). A plain closure is a
/// front end that only builds VM configurations.
pub trait Frontend: Send + Sync {
    /// The VM configuration a `create` request asks for.
    fn build_config(&self, req: &Value) -> Result<VmConfig, String>;
    /// The VM a `create` request asks for: its configuration and, for a
    /// Linux VM, how its kernel boots (by default a reference-guest VM,
    /// [`Frontend::build_config`]).
    fn build_vm(&self, req: &Value) -> Result<(VmConfig, Option<LinuxBoot>), String> {
        Ok((self.build_config(req)?, None))
    }
    /// Handles an operation the host does not know (`None`: not the front
    /// end's either).
    fn op(&self, _host: &Host, _op: &str, _req: &Value) -> Option<Result<Value, ApiError>> {
        None
    }
    /// The front end's operations, for the unknown-op error.
    fn op_names(&self) -> &'static str {
        ""
    }
    /// Why the host cannot hand over to a new process now (resources that
    /// would not follow), if it cannot.
    fn handover_blocker(&self) -> Option<String> {
        None
    }
    /// Stops what the front end runs (the host is shutting down).
    fn shutdown(&self) {}
}

impl<F> Frontend for F
where
    F: Fn(&Value) -> Result<VmConfig, String> + Send + Sync,
{
    fn build_config(&self, req: &Value) -> Result<VmConfig, String> {
        self(req)
    }
}

/// The front end a host serves with.
pub type ConfigBuilder = dyn Frontend;

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
    // Only this user may connect (the peer check below holds either way).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    serve_listener(host, listener, path, build)
}

/// The user id of the process at the other end of `stream` (SO_PEERCRED,
/// recorded by the kernel when the peer connected).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes, one `struct ucred`,
    // into `cred`, which outlives the call; the fd is the stream's own.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Authenticates a client by its kernel-reported credentials: the host's
/// own user and root may use the API, nobody else.
fn authenticate(stream: &UnixStream) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    match peer_uid(stream) {
        Ok(uid) if uid == me || uid == 0 => Ok(()),
        Ok(uid) => Err(format!(
            "permission denied: user {uid} may not use this host's API (only user {me} and root)"
        )),
        Err(e) => Err(format!("permission denied: cannot read the peer's credentials: {e}")),
    }
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
    /// Connections being served now.
    conns: AtomicUsize,
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
        conns: AtomicUsize::new(0),
    });
    listener.set_nonblocking(true)?;
    crate::recovery::set_api(listener.as_raw_fd(), path);
    crate::event_log::publish(
        "host_started",
        json!({"pid": std::process::id(), "generation": host.generation(), "vms": host.list().len()}),
    );
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
                        let limits = host.limits();
                        if let Err(why) = authenticate(&stream) {
                            refuse(stream, 403, &why, limits.json_lines);
                            continue;
                        }
                        let slot = match take_slot(&ctx, limits.max_connections) {
                            Ok(slot) => slot,
                            Err(why) => {
                                refuse(stream, 503, &why, limits.json_lines);
                                continue;
                            }
                        };
                        let (host, build, ctx) = (host.clone(), build.clone(), ctx.clone());
                        // The slot is freed when the thread ends (or if it cannot start).
                        let _ =
                            std::thread::Builder::new().name("api-conn".into()).spawn(move || {
                                let _slot = slot;
                                serve_connection(stream, &host, &*build, &ctx)
                            });
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

/// One connection's slot under [`Limits::max_connections`], freed when the
/// connection's thread ends.
struct Slot(Arc<ServeCtx>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, SeqCst);
    }
}

/// Takes a connection slot, or says why not.
fn take_slot(ctx: &Arc<ServeCtx>, max: usize) -> Result<Slot, String> {
    if ctx.conns.fetch_add(1, SeqCst) >= max {
        ctx.conns.fetch_sub(1, SeqCst);
        return Err(format!(
            "too many connections: this host serves at most {max} at once \
             (host --max-connections); close one or try again later"
        ));
    }
    Ok(Slot(ctx.clone()))
}

/// Answers a connection that is not served, without ever blocking (a
/// fresh socket has room for one reply), and closes it: an HTTP response
/// with `status` (403 another user, 503 too many connections) on a host
/// that serves HTTP only, or one JSON error line on a `--api-legacy` host,
/// whose client may speak either protocol (the line is what that protocol
/// answered, and what `nl_vmm::api::client` reads as well).
fn refuse(stream: UnixStream, status: u16, error: &str, json_lines: bool) {
    let _ = stream.set_nonblocking(true);
    let reply = if json_lines {
        let mut line = json!({"ok": false, "error": error}).to_string();
        line.push('\n');
        line.into_bytes()
    } else {
        http::refusal(status, error)
    };
    let _ = (&stream).write(&reply);
}

fn serve_connection(stream: UnixStream, host: &Host, build: &ConfigBuilder, ctx: &ServeCtx) {
    crate::seccomp::apply(crate::seccomp::Kind::Api);
    let _ = stream.set_nonblocking(false);
    let _reg = crate::recovery::enter(false);
    let progress = crate::detect::track();
    let limits = host.limits();
    // The whole exchange runs under a recovery point: an error anywhere in
    // it (reading, parsing, answering; handling has a point of its own)
    // discards the connection, and the stream, owned out here, closes, so
    // the client sees the connection end without an answer.
    let _ = crate::recovery::protected(|| {
        serve_requests(&stream, host, build, ctx, &progress, &limits)
    });
}

/// What reading one request from a client gave.
enum Got {
    /// A request line, with its newline.
    Line(Vec<u8>),
    /// The client closed the connection (or it failed).
    Closed,
    /// [`MAX_REQUEST`] bytes without a newline.
    TooLong,
    /// No newline within the request time limit after the first byte.
    TooSlow,
    /// No byte of a new request within the idle time limit.
    Idle,
}

/// Reads request lines into a buffer of [`MAX_REQUEST`] bytes, never more:
/// a request that does not fit is refused, not accumulated.
struct Requests {
    buf: Vec<u8>,
    /// Bytes of `buf` read but not yet returned (the start of the next request).
    len: usize,
}

impl Requests {
    fn new() -> Self {
        Self { buf: vec![0; MAX_REQUEST], len: 0 }
    }

    /// The next request line. Blocks on the client: call it only while the
    /// thread is waiting for the hang watchdog ([`crate::detect::Progress::wait`]).
    fn next(&mut self, stream: &UnixStream, limits: &Limits) -> Got {
        let mut deadline = self.deadline(limits);
        let mut scanned = 0;
        loop {
            if let Some(i) = self.buf[scanned..self.len].iter().position(|&b| b == b'\n') {
                let end = scanned + i + 1;
                let line = self.buf[..end].to_vec();
                self.consume(end);
                return Got::Line(line);
            }
            scanned = self.len;
            if let Err(got) = self.read_more(stream, limits, &mut deadline) {
                return got;
            }
        }
    }

    /// The time limit of a request that starts now: set if its first bytes
    /// came with the previous request, else set by [`Self::read_more`] when
    /// they arrive.
    fn deadline(&self, limits: &Limits) -> Option<Instant> {
        (self.len > 0).then(|| Instant::now() + limits.request_timeout)
    }

    /// Bytes read and not yet consumed.
    fn filled(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// Drops the first `n` bytes read (a request that was handled).
    fn consume(&mut self, n: usize) {
        self.buf.copy_within(n..self.len, 0);
        self.len -= n;
    }

    /// Reads once more from the client, waiting at most until `deadline`
    /// (set at the request's first byte), or the idle time limit before it.
    /// `Err` says why the request cannot be completed.
    fn read_more(
        &mut self,
        stream: &UnixStream,
        limits: &Limits,
        deadline: &mut Option<Instant>,
    ) -> Result<(), Got> {
        if self.len == self.buf.len() {
            return Err(Got::TooLong);
        }
        let wait = match *deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(w) if !w.is_zero() => w,
                _ => return Err(Got::TooSlow),
            },
            None => limits.idle_timeout,
        };
        if stream.set_read_timeout(Some(wait)).is_err() {
            return Err(Got::Closed);
        }
        let free = &mut self.buf[self.len..];
        match crate::recovery::safe(|| (&*stream).read(free)) {
            Ok(0) => Err(Got::Closed),
            Ok(n) => {
                deadline.get_or_insert_with(|| Instant::now() + limits.request_timeout);
                self.len += n;
                Ok(())
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(if deadline.is_some() { Got::TooSlow } else { Got::Idle })
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(()),
            Err(_) => Err(Got::Closed),
        }
    }
}

impl Got {
    /// Why a request was refused, for the client.
    fn refusal(&self, limits: &Limits) -> String {
        match self {
            Got::TooLong => format!("request longer than {MAX_REQUEST} bytes"),
            Got::TooSlow => format!(
                "request not complete within {:.1} s of its first byte",
                limits.request_timeout.as_secs_f64()
            ),
            _ => format!("connection idle for {:.0} s; closed", limits.idle_timeout.as_secs_f64()),
        }
    }
}

/// Writes one reply line within `timeout` (a client that does not read its
/// replies is cut off). Blocks on the client, so the thread waits for the
/// hang watchdog meanwhile. False if the line did not go out.
fn send_line(
    stream: &UnixStream,
    reply: &Value,
    timeout: Duration,
    progress: &crate::detect::Progress,
) -> bool {
    let mut line = reply.to_string();
    line.push('\n');
    http::write_all(stream, line.as_bytes(), timeout, progress)
}

fn error_reply(error: String) -> Value {
    json!({"ok": false, "error": error})
}

fn serve_requests(
    stream: &UnixStream,
    host: &Host,
    build: &ConfigBuilder,
    ctx: &ServeCtx,
    progress: &crate::detect::Progress,
    limits: &Limits,
) {
    let mut requests = Requests::new();
    // The first byte says which protocol the client speaks.
    progress.wait();
    let first = loop {
        match requests.read_more(stream, limits, &mut None) {
            // Interrupted by a signal before any byte came (the recovery
            // signal of a microreset reaches every thread, this one
            // waiting here included): wait again.
            Ok(()) if requests.filled().is_empty() => continue,
            Ok(()) => break requests.filled()[0],
            Err(Got::Closed) => return,
            Err(refused) => {
                progress.resume();
                send_line(
                    stream,
                    &error_reply(refused.refusal(limits)),
                    limits.request_timeout,
                    progress,
                );
                return;
            }
        }
    };
    progress.resume();
    if first.is_ascii_uppercase() {
        return http::serve(stream, host, build, ctx, progress, limits, &mut requests);
    }
    if !limits.json_lines {
        let why = "this host serves HTTP only (docs/api.md); the JSON-lines protocol of \
                   earlier releases needs `ninelives host --api-legacy`";
        send_line(stream, &error_reply(why.into()), limits.request_timeout, progress);
        return;
    }
    loop {
        // Waiting on the client is never a hang of this thread: each wait
        // is bounded by the request or idle time limit instead.
        progress.wait();
        let got = requests.next(stream, limits);
        progress.resume();
        let line = match got {
            Got::Line(line) => line,
            Got::Closed => return,
            refused => {
                // Answer, then close: nothing more is read from this client.
                let error = match refused {
                    Got::TooSlow => format!(
                        "request not complete (no newline) within {:.1} s of its first byte",
                        limits.request_timeout.as_secs_f64()
                    ),
                    other => other.refusal(limits),
                };
                send_line(stream, &error_reply(error), limits.request_timeout, progress);
                return;
            }
        };
        FAULT.pass();
        let reply = match serde_json::from_slice::<Value>(&line) {
            Ok(req) => match run_op(host, build, &req, ctx, progress) {
                Ok(mut v) => {
                    v["ok"] = json!(true);
                    v
                }
                Err(e) if e.status == 503 => {
                    json!({"ok": false, "interrupted": true, "error": e.message})
                }
                Err(e) => error_reply(e.message),
            },
            Err(e) => error_reply(format!("malformed request: {e}")),
        };
        let written = send_line(stream, &reply, limits.request_timeout, progress);
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

/// A refused request: an HTTP status and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    /// A 400 with this message.
    pub fn bad(message: impl Into<String>) -> Self {
        Self { status: 400, message: message.into() }
    }
}

impl From<String> for ApiError {
    fn from(message: String) -> Self {
        Self::bad(message)
    }
}

impl From<&str> for ApiError {
    fn from(message: &str) -> Self {
        Self::bad(message)
    }
}

impl From<VmmError> for ApiError {
    fn from(e: VmmError) -> Self {
        let status = match &e {
            VmmError::NoSuchVm(_) => 404,
            VmmError::Refused(_) => 409,
            VmmError::Config(_) | VmmError::Vm(..) | VmmError::State(_) => 400,
            _ => 500,
        };
        Self { status, message: e.to_string() }
    }
}

/// Runs one operation (a JSON-lines request, or an HTTP request turned into
/// one) under a recovery point of its own. Operations that wait on other
/// threads or the kernel are not counted as hangs of this thread.
fn run_op(
    host: &Host,
    build: &ConfigBuilder,
    req: &Value,
    ctx: &ServeCtx,
    progress: &crate::detect::Progress,
) -> Result<Value, ApiError> {
    // These wait on other threads (vCPUs, a successor VMM), which are
    // checked themselves, or on the kernel (creating a VM's memory
    // slots can block in synchronize_srcu for long on a loaded host).
    if matches!(
        req.get("op").and_then(Value::as_str),
        Some("create" | "pause" | "destroy" | "rejuvenate" | "sandbox_create" | "sandbox_destroy")
    ) {
        progress.wait();
    }
    // A request discarded by a microreset is answered as such: the client
    // may retry it.
    let r = match crate::recovery::protected(|| handle_op(host, build, req, ctx)) {
        crate::recovery::Outcome::Done(r) => r,
        crate::recovery::Outcome::Recovered { .. } => Err(ApiError {
            status: 503,
            message: "the request was interrupted by a VMM recovery; retry it".into(),
        }),
    };
    progress.resume();
    r
}

/// Handles one request outside of a serving loop (no rejuvenation).
pub fn handle(host: &Host, build: &ConfigBuilder, req: &Value, done: &AtomicBool) -> Value {
    let ctx = ServeCtx {
        path: PathBuf::new(),
        listener_fd: -1,
        done: AtomicBool::new(false),
        hold: AtomicBool::new(false),
        handed_over: AtomicBool::new(false),
        conns: AtomicUsize::new(0),
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
    crate::event_log::publish("rejuvenation", json!({ "report": &report }));
    if report.ok {
        ctx.handed_over.store(true, Relaxed);
    } else {
        ctx.hold.store(false, Relaxed);
    }
    Ok(json!({ "report": report, "handed_over": report.ok }))
}

fn handle_in(host: &Host, build: &ConfigBuilder, req: &Value, ctx: &ServeCtx) -> Value {
    match handle_op(host, build, req, ctx) {
        Ok(mut v) => {
            v["ok"] = json!(true);
            v
        }
        Err(e) => error_reply(e.message),
    }
}

fn handle_op(
    host: &Host,
    build: &ConfigBuilder,
    req: &Value,
    ctx: &ServeCtx,
) -> Result<Value, ApiError> {
    let op = req.get("op").and_then(Value::as_str).ok_or("request needs an \"op\" string")?;
    let e = ApiError::from;
    if ctx.hold.load(Relaxed)
        && matches!(
            op,
            "create"
                | "pause"
                | "resume"
                | "destroy"
                | "sandbox_create"
                | "sandbox_destroy"
                | "sandbox_inject"
        )
    {
        return Err(ApiError {
            status: 409,
            message: format!("cannot {op} now: the host is being rejuvenated"),
        });
    }
    Ok(match op {
        "rejuvenate" => {
            if let Some(why) = build.handover_blocker() {
                return Err(ApiError { status: 409, message: format!("cannot rejuvenate: {why}") });
            }
            rejuvenate_op(host, req, ctx)?
        }
        "info" => {
            let (mem, vcpus) = host.committed();
            json!({
                "pid": std::process::id(),
                "version": env!("CARGO_PKG_VERSION"),
                "generation": host.generation(),
                "limits": host.limits(),
                "committed": {"mem_bytes": mem, "vcpus": vcpus},
            })
        }
        "create" => {
            let id = match build.build_vm(req)? {
                (config, Some(boot)) => host.create_linux(config, &boot),
                (config, None) => host.create(config),
            };
            json!({"id": id.map_err(e)?})
        }
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
            build.shutdown();
            ctx.done.store(true, Relaxed);
            json!({})
        }
        other => match build.op(host, other, req) {
            Some(r) => r?,
            None => {
                return Err(ApiError::bad(format!(
                    "unknown op \"{other}\" (create, list, pause, resume, stats, destroy, \
                     info, rejuvenate, shutdown{})",
                    build.op_names()
                )))
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A refusal written before the host closes reaches the client even
    /// when the client's request cannot be sent any more: a request larger
    /// than the socket's buffer blocks until the close and then fails.
    #[test]
    fn the_reason_of_a_refusal_is_read_even_if_the_request_could_not_be_sent() {
        let dir = std::env::temp_dir().join(format!("nl-api-refuse-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let l = UnixListener::bind(&path).unwrap();
        let host = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            writeln!(c, r#"{{"ok":false,"error":"too many connections"}}"#).unwrap();
        });
        let big = serde_json::json!({"op":"create","pad":"x".repeat(8 << 20)});
        let r = request_timeout(&path, &big, Duration::from_secs(30));
        host.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let r = r.expect("the refusal's reason, not the failed write");
        assert_eq!(r["error"], "too many connections", "{r}");
    }
}
