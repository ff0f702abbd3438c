//! `ninelives bench hostile`: a reproducible attack campaign against real
//! `ninelives host` and `ninelives replicate backup` processes (children of
//! this one). Every attack is tried N times and every try is classified
//! into exactly one outcome, checked in this order:
//!
//! * **crash**: the target process exited or was killed;
//! * **hang**: the target did not answer a health probe within 10 s (the
//!   host: `GET /v1/info` on a new connection; the backup: a hello answered with a
//!   challenge or a refusal), or the attacker got no answer at all;
//! * **wrong success**: the attack got what it wanted (a VM created over
//!   the budget, another user served, a forged peer welcomed, the backup
//!   activated);
//! * **other VMs harmed**: a bystander VM on the attacked host stopped
//!   heartbeating or left `running` (replication: the real primary was not
//!   served to a verified digest);
//! * **unexpected**: refused, but not with the expected reason (an extra
//!   column, so that no odd answer is counted as clean);
//! * **clean refusal**: none of the above, and the attacker was told why.
//!
//! Every wait is bounded in count and time. Replication uses loopback only.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nl_replicate::auth::{nonce, primary_handshake, Deadline, Key};
use nl_replicate::protocol::{read_plain_frame, write_plain_frame, Hello, Kind, PROTOCOL_VERSION};
use nl_vmm::api::client;
use serde::Serialize;
use serde_json::{json, Value};

use crate::json_out::loadavg;
use crate::process::{exe, Proc};

#[derive(Args, Clone, Debug)]
pub struct BenchHostileArgs {
    /// Tries per attack.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub tries: u32,
    /// Tries of repl-slowloris, each with a backup and a replicated VM of its
    /// own (the backup stands down once its primary finished) [default: --tries].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub slow_tries: Option<u32>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// The bound on every wait for an answer: health probes, replies, starts.
const BOUND: Duration = Duration::from_secs(10);
/// The bound on a real replicated primary's whole run (1 s of workload).
const PRIMARY_BOUND: Duration = Duration::from_secs(60);
/// Concurrent clients per group of the API size and time attacks.
const GROUP: u32 = 5;
/// The lease (ms) of the backup and of the real primary. Longer than the
/// 1000 ms default: on a 2-core host at load average 16 to 19, a primary
/// went 1023 ms without a frame and its backup took over, which is the
/// lease working, not an attack succeeding. (A backup with a shorter lease
/// than its primary's can take over while a stalled primary still runs.)
const LEASE_MS: u64 = 3000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    Clean,
    Crash,
    Hang,
    WrongSuccess,
    Harmed,
    Unexpected,
}

/// What the attacker itself saw.
enum Seen {
    /// Refused, with the expected reason.
    Refused,
    /// The attack got what it wanted.
    Got(String),
    /// No answer within the bound.
    Silent(String),
    /// An answer, but not the expected refusal.
    Odd(String),
}

#[derive(Serialize)]
struct Row {
    attack: &'static str,
    tries: u32,
    clean_refusal: u32,
    crash: u32,
    hang: u32,
    wrong_success: u32,
    other_vms_harmed: u32,
    unexpected: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_run: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    /// What was seen in the first non-clean tries.
    failures: Vec<String>,
}

impl Row {
    fn new(attack: &'static str) -> Row {
        Row {
            attack,
            tries: 0,
            clean_refusal: 0,
            crash: 0,
            hang: 0,
            wrong_success: 0,
            other_vms_harmed: 0,
            unexpected: 0,
            not_run: None,
            note: None,
            failures: Vec::new(),
        }
    }

    fn add(&mut self, (o, why): (Outcome, String)) {
        self.tries += 1;
        let n = match o {
            Outcome::Clean => &mut self.clean_refusal,
            Outcome::Crash => &mut self.crash,
            Outcome::Hang => &mut self.hang,
            Outcome::WrongSuccess => &mut self.wrong_success,
            Outcome::Harmed => &mut self.other_vms_harmed,
            Outcome::Unexpected => &mut self.unexpected,
        };
        *n += 1;
        if o != Outcome::Clean && self.failures.len() < 5 {
            self.failures.push(format!("{o:?}: {why}"));
        }
    }

    fn bad(&self) -> u32 {
        self.tries - self.clean_refusal
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

/// Some(why) once the process has ended.
fn ended(p: &mut Proc) -> Option<String> {
    let st = p.exited()?;
    Some(format!("the target exited ({st}): {}", tail(&p.stderr.text())))
}

/// Polls `f` every 50 ms until it gives Some, for at most `limit`.
fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t = Instant::now();
    for _ in 0..limit.as_millis() / 50 + 1 {
        if let Some(v) = f() {
            return Some(v);
        }
        if t.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// The side that was attacked, as the judge sees it.
trait Target {
    /// Some(why) if the target process ended.
    fn exited(&mut self) -> Option<String>;
    /// The health probe, answered within [`BOUND`].
    fn probe(&mut self) -> Result<(), String>;
    /// Some(what) if the attack got what it wanted on the target's side.
    fn compromised(&mut self) -> Option<String>;
    /// Some(what) if a bystander was harmed.
    fn harmed(&mut self) -> Option<String>;
}

/// One try's outcome: the target's state first, then what the attacker saw.
fn judge(t: &mut dyn Target, seen: Seen) -> (Outcome, String) {
    // What the attacker got itself outranks what became of the target.
    if let Seen::Got(why) = seen {
        return (Outcome::WrongSuccess, why);
    }
    if let Some(why) = t.exited() {
        return (Outcome::Crash, why);
    }
    if let Err(why) = t.probe() {
        return (Outcome::Hang, format!("no answer to the health probe: {why}"));
    }
    if let Some(why) = t.compromised() {
        return (Outcome::WrongSuccess, why);
    }
    if let Some(why) = t.harmed() {
        return (Outcome::Harmed, why);
    }
    match seen {
        Seen::Silent(why) => (Outcome::Hang, why),
        Seen::Odd(why) => (Outcome::Unexpected, why),
        _ => (Outcome::Clean, String::new()),
    }
}

/// Runs `tries` attacks, `group` at a time on threads of their own, and
/// judges each try once its group is done.
fn campaign(
    row: &mut Row,
    tries: u32,
    group: u32,
    t: &mut dyn Target,
    attack: impl Fn(u32) -> Seen + Sync,
) {
    for start in (0..tries).step_by(group as usize) {
        let seen: Vec<Seen> = std::thread::scope(|s| {
            let hs: Vec<_> = (start..(start + group).min(tries))
                .map(|i| {
                    let attack = &attack;
                    s.spawn(move || attack(i))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Seen::Odd("the attacker panicked".into())))
                .collect()
        });
        for s in seen {
            row.add(judge(t, s));
        }
    }
}

// ---- The host and its API -------------------------------------------------
//
// The host serves HTTP only (its default): every attack speaks HTTP/1.1 on
// the API socket byte by byte, and a clean refusal is an HTTP error status
// with `{"error": ...}` naming the reason, then the end of the connection.

fn connect(sock: &Path) -> std::io::Result<UnixStream> {
    let s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(BOUND))?;
    s.set_write_timeout(Some(BOUND))?;
    Ok(s)
}

/// Reads one HTTP response on a kept-alive connection: the head up to its
/// blank line (at most 64 KiB), then `Content-Length` bytes of body.
fn read_response(s: &UnixStream) -> std::io::Result<Vec<u8>> {
    let mut r = BufReader::new(s);
    let mut all = Vec::new();
    let mut length = 0usize;
    loop {
        let mut line = Vec::new();
        if r.read_until(b'\n', &mut line)? == 0 || all.len() > 64 << 10 {
            return Err(std::io::Error::other("the response ended inside its head"));
        }
        let text = String::from_utf8_lossy(&line).to_ascii_lowercase();
        if let Some(v) = text.strip_prefix("content-length:") {
            length = v.trim().parse().map_err(std::io::Error::other)?;
        }
        all.extend_from_slice(&line);
        if line == b"\r\n" {
            break;
        }
    }
    let mut body = vec![0; length.min(16 << 20)];
    r.read_exact(&mut body)?;
    all.extend(body);
    Ok(all)
}

/// One operation (in the JSON-lines shape `nl_vmm::api::client` takes) as an
/// HTTP request on the kept-alive connection `s`, and its reply.
fn ask(s: &mut UnixStream, req: &Value) -> Result<Value, String> {
    let call = client::route_of(req)?;
    let body = call.body.as_ref().map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{} {} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        call.method,
        call.path,
        body.len()
    )
    .map_err(|e| format!("sending {req}: {e}"))?;
    let reply = read_response(s).map_err(|e| format!("no reply to {req}: {e}"))?;
    client::parse_reply(&reply).map_err(|e| format!("reply to {req}: {e}"))
}

/// What an attacker on connection `s` sees: an error `status` whose reason
/// contains `needle`, then the end of the connection, is a clean refusal.
fn expect_refusal(s: &UnixStream, status: u16, needle: &str) -> Seen {
    let mut reply = Vec::new();
    let end = s.take(1 << 20).read_to_end(&mut reply);
    if reply.is_empty() {
        return match end {
            Ok(_) => Seen::Odd("closed without a reason".into()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                Seen::Odd("reset without a reason".into())
            }
            Err(e) => Seen::Silent(format!("no answer: {e}")),
        };
    }
    let text = String::from_utf8_lossy(&reply).trim().to_string();
    let r = match client::parse_reply(&reply) {
        Ok(r) => r,
        Err(e) => return Seen::Odd(format!("not an HTTP reply ({e}): {text:?}")),
    };
    if r["ok"] == true {
        return Seen::Got(format!("served: {text}"));
    }
    if r["status"] != status || !r["error"].as_str().is_some_and(|e| e.contains(needle)) {
        return Seen::Odd(format!("expected status {status} about {needle:?}, got {text}"));
    }
    match end {
        Ok(_) => Seen::Refused,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Seen::Refused,
        Err(e) => Seen::Odd(format!("the connection stayed open after the error: {e}")),
    }
}

/// A `ninelives host` with one bystander VM.
struct Host {
    p: Proc,
    sock: PathBuf,
    /// Health probes and bystander checks go over this kept-alive
    /// connection if set (when new connections are refused on purpose).
    held: Option<UnixStream>,
    bystander: u64,
    beats: u64,
}

impl Host {
    fn start(dir: &Path, name: &str, extra: &[&str], bystander_mem: &str) -> Result<Host> {
        let sock = dir.join(format!("{name}.sock"));
        let mut args = vec!["host", "--api", sock.to_str().context("path")?];
        args.extend_from_slice(extra);
        let mut p = Proc::ninelives(None, &args)?;
        if poll(2 * BOUND, || connect(&sock).ok()).is_none() {
            bail!("the host did not start listening: {}", ended(&mut p).unwrap_or_default());
        }
        let mut h = Host { p, sock, held: None, bystander: 0, beats: 0 };
        let r =
            h.api(&json!({"op":"create","workload":"idle","mem":bystander_mem,"duration":3600}));
        h.bystander = r.ok().and_then(|r| r["id"].as_u64()).context("cannot create a bystander")?;
        if h.harmed().is_some() {
            bail!("the bystander VM does not heartbeat");
        }
        Ok(h)
    }

    fn api(&mut self, req: &Value) -> Result<Value, String> {
        match &mut self.held {
            Some(s) => ask(s, req),
            None => client::request_timeout(&self.sock, req, BOUND).map_err(|e| e.to_string()),
        }
    }

    /// A kept-alive connection that was served (retried while the host
    /// still counts connections closed a moment ago).
    fn hold(&self) -> Result<UnixStream> {
        poll(BOUND, || {
            let mut s = connect(&self.sock).ok()?;
            (ask(&mut s, &json!({"op":"info"})).ok()?["ok"] == true).then_some(s)
        })
        .context("no connection was served")
    }

    fn chmod_sock(&self, mode: u32) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        Ok(std::fs::set_permissions(&self.sock, std::fs::Permissions::from_mode(mode))?)
    }
}

impl Target for Host {
    fn exited(&mut self) -> Option<String> {
        ended(&mut self.p)
    }

    fn probe(&mut self) -> Result<(), String> {
        let r = self.api(&json!({"op":"info"}))?;
        if r["ok"] != true {
            return Err(format!("info: {r}"));
        }
        Ok(())
    }

    /// The bystander is the only VM.
    fn compromised(&mut self) -> Option<String> {
        match self.api(&json!({"op":"list"})) {
            Ok(l) if l["vms"].as_array().is_some_and(|v| v.len() == 1) => None,
            Ok(l) => Some(format!("VMs on the host besides the bystander: {l}")),
            Err(e) => Some(e),
        }
    }

    /// The bystander is still running and its heartbeat counter moved.
    fn harmed(&mut self) -> Option<String> {
        let (id, before) = (self.bystander, self.beats);
        let mut last = Err(String::new());
        let beats = poll(BOUND, || {
            last = self.api(&json!({"op":"stats","id":id}));
            let st = &last.as_ref().ok()?["stats"];
            let b = st["vcpus"][0]["regs"]["beats"].as_u64()?;
            (st["state"] == "running" && b != before).then_some(b)
        });
        match beats {
            Some(b) => {
                self.beats = b;
                None
            }
            None => Some(format!("bystander VM {id} stopped at {before} beats: {last:?}")),
        }
    }
}

fn api_oversized(dir: &Path, tries: u32) -> Result<Row> {
    let mut row = Row::new("api-oversized");
    row.note = Some(format!(
        "a request head of 70 KiB (one header line, no end), then a 1.5 s wait; \
         {GROUP} clients at once"
    ));
    let mut h = Host::start(dir, "oversized", &[], "64M")?;
    let sock = h.sock.clone();
    campaign(&mut row, tries, GROUP, &mut h, |_| {
        let Ok(mut s) = connect(&sock) else { return Seen::Silent("connect".into()) };
        let mut req = b"POST /v1/vms HTTP/1.1\r\nX-Junk: ".to_vec();
        req.resize(70 * 1024, b'x');
        // The host may answer and close before all of it is written.
        let _ = s.write_all(&req);
        std::thread::sleep(Duration::from_millis(1500));
        expect_refusal(&s, 413, "longer than 65536 bytes")
    });
    Ok(row)
}

fn api_slow(dir: &Path, tries: u32) -> Result<Row> {
    let mut row = Row::new("api-slow");
    row.note = Some(format!(
        "a request head at 1 byte per 100 ms, never ended; --request-timeout 1s; \
         {GROUP} clients at once"
    ));
    let mut h = Host::start(dir, "slow", &["--request-timeout", "1s"], "64M")?;
    let sock = h.sock.clone();
    campaign(&mut row, tries, GROUP, &mut h, |_| {
        let Ok(s) = connect(&sock) else { return Seen::Silent("connect".into()) };
        let stop = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let head = b"GET /v1/info HTTP/1.1\r\nX-Slow: ";
                for i in 0..100 {
                    let b = head.get(i).copied().unwrap_or(b'z');
                    if stop.load(Ordering::SeqCst) || (&s).write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
            let seen = expect_refusal(&s, 408, "within 1.0 s");
            stop.store(true, Ordering::SeqCst);
            seen
        })
    });
    Ok(row)
}

/// Requests that are not HTTP, or HTTP the host does not take, in turn:
/// (bytes sent, status expected, reason expected).
const MALFORMED: &[(&[u8], u16, &str)] = &[
    (b"\x00\xff\x13\x37 garbage\r\n\r\n", 0, "serves HTTP only"),
    (b"GET /v1/\x01info HTTP/9.9\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /v1/info HTTP/1.1\r\nContent-Length: lots\r\n\r\n", 400, "bad Content-Length"),
    (
        b"POST /v1/vms HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        411,
        "chunked bodies are not accepted",
    ),
    (b"POST /v1/vms HTTP/1.1\r\nContent-Length: 200000\r\n\r\n", 413, "longer than"),
    (b"POST /v1/vms HTTP/1.1\r\nConnection: close\r\nContent-Length: 5\r\n\r\n{\"a\":", 400, "malformed JSON body"),
    (
        b"POST /v1/vms HTTP/1.1\r\nConnection: close\r\nContent-Length: 18\r\n\r\n{\"mem\":\"1\",\"x\":[]}",
        400,
        "unknown field",
    ),
    (b"DELETE /v1/vms/18446744073709551616 HTTP/1.1\r\nConnection: close\r\n\r\n", 404, ""),
    (b"{\"op\":\"list\"}\n", 0, "--api-legacy"),
];

fn api_malformed(dir: &Path, tries: u32) -> Result<Row> {
    let mut row = Row::new("api-malformed");
    row.note = Some(format!(
        "{} kinds in turn, each tried --tries times: binary junk, a bad request line, a bad Content-Length, a chunked body, a body over \
         the limit, truncated and unknown JSON, a VM id out of range, a JSON-lines request; \
         {GROUP} clients at once",
        MALFORMED.len()
    ));
    let mut h = Host::start(dir, "malformed", &[], "64M")?;
    let sock = h.sock.clone();
    // Every kind is tried `tries` times.
    let all = tries * MALFORMED.len() as u32;
    campaign(&mut row, all, GROUP, &mut h, |i| {
        let (bytes, status, needle) = MALFORMED[i as usize % MALFORMED.len()];
        let Ok(mut s) = connect(&sock) else { return Seen::Silent("connect".into()) };
        let _ = s.write_all(bytes);
        if status == 0 {
            // What is not HTTP (a JSON-lines request, binary junk) gets one
            // error line, the refusal in the JSON-lines protocol's shape.
            let mut line = String::new();
            let _ = BufReader::new(&s).read_line(&mut line);
            let r: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            return match r["error"].as_str() {
                _ if r["ok"] == true => Seen::Got(line),
                Some(e) if e.contains(needle) => Seen::Refused,
                _ if line.is_empty() => {
                    Seen::Silent("no answer to a request that is not HTTP".into())
                }
                _ => Seen::Odd(format!("expected a refusal naming {needle}, got {line:?}")),
            };
        }
        expect_refusal(&s, status, needle)
    });
    Ok(row)
}

const MAX_CONN: usize = 8;

fn api_flood(dir: &Path, tries: u32) -> Result<[Row; 2]> {
    let mut row = Row::new("api-flood");
    row.note =
        Some(format!("--max-connections {MAX_CONN}, all {MAX_CONN} held; one more each try"));
    let mut h = Host::start(dir, "flood", &["--max-connections", &MAX_CONN.to_string()], "64M")?;
    let mut held = (0..MAX_CONN - 1).map(|_| h.hold()).collect::<Result<Vec<_>>>()?;
    h.held = Some(h.hold()?);
    let sock = h.sock.clone();
    campaign(&mut row, tries, 1, &mut h, |_| match connect(&sock) {
        Ok(mut s) => {
            // A served connection would answer this; a refused one was
            // told why before the host read anything.
            let _ = write!(s, "GET /v1/info HTTP/1.1\r\nHost: localhost\r\n\r\n");
            expect_refusal(&s, 503, "too many connections")
        }
        Err(e) => Seen::Odd(format!("connect: {e}")),
    });
    // All closed: a fresh connection is served again.
    let mut fresh = Row::new("api-flood-then-fresh");
    fresh.note = Some("all held connections closed: a new one is served within 10 s".into());
    held.clear();
    h.held = None;
    let seen = match h.hold() {
        Ok(_) => Seen::Refused,
        Err(e) => Seen::Silent(format!("{e:#}")),
    };
    fresh.add(judge(&mut h, seen));
    Ok([row, fresh])
}

fn api_overcommit(dir: &Path, tries: u32) -> Result<Row> {
    let mut row = Row::new("api-overcommit");
    row.note = Some(
        "--mem-budget 256M with a 128M bystander: POST /v1/vms of 256M, vcpus 0, vcpus 1000 \
         in turn"
            .into(),
    );
    let mut h = Host::start(dir, "overcommit", &["--mem-budget", "256M"], "128M")?;
    let sock = h.sock.clone();
    campaign(&mut row, tries, 1, &mut h, |i| {
        let (req, status, needle) = match i % 3 {
            0 => {
                (json!({"op":"create","workload":"idle","mem":"256M","duration":60}), 409, "budget")
            }
            1 => (
                json!({"op":"create","workload":"idle","mem":"64M","vcpus":0}),
                400,
                "out of range",
            ),
            _ => (
                json!({"op":"create","workload":"idle","mem":"64M","vcpus":1000}),
                400,
                "out of range",
            ),
        };
        let r = match client::request_timeout(&sock, &req, BOUND) {
            Ok(r) => r,
            Err(e) => return Seen::Silent(format!("no reply: {e}")),
        };
        match r["error"].as_str() {
            _ if r["ok"] == true => {
                let _ =
                    client::request_timeout(&sock, &json!({"op":"destroy","id":r["id"]}), BOUND);
                Seen::Got(format!("created over the limits: {r}"))
            }
            Some(e) if e.contains(needle) && r["status"] == status => Seen::Refused,
            _ => Seen::Odd(format!("expected status {status} about {needle:?}, got {r}")),
        }
    });
    Ok(row)
}

fn api_other_user(dir: &Path, tries: u32) -> Result<Row> {
    use std::os::unix::process::CommandExt;
    let mut row = Row::new("api-other-user");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        row.not_run = Some("needs root (acts as user 65534)".into());
        return Ok(row);
    }
    row.note = Some("as uid 65534, with the socket widened to mode 0666 (403 expected)".into());
    let mut h = Host::start(dir, "other", &[], "64M")?;
    h.chmod_sock(0o666)?;
    let sock = h.sock.clone();
    campaign(&mut row, tries, 1, &mut h, |_| {
        let Ok(exe) = exe() else { return Seen::Odd("no binary".into()) };
        let mut c = Command::new(exe);
        c.uid(65534).gid(65534).arg("api").arg("--api").arg(&sock).arg(r#"{"op":"list"}"#);
        let mut p = match Proc::spawn(c) {
            Ok(p) => p,
            Err(e) => return Seen::Odd(format!("{e:#}")),
        };
        let all = |p: &Proc| format!("{}{}", p.stdout.text(), p.stderr.text());
        match p.wait_for(BOUND) {
            None => Seen::Silent("the client got no answer".into()),
            Some(st) if st.success() => Seen::Got(format!("served: {}", all(&p))),
            Some(_) if all(&p).contains("may not use this host's API") => Seen::Refused,
            Some(st) => Seen::Odd(format!("{st}: {}", all(&p))),
        }
    });
    Ok(row)
}

// ---- The replication backup ------------------------------------------------

fn hello() -> Hello {
    Hello {
        protocol: PROTOCOL_VERSION,
        state_version: nl_vmm::state::STATE_VERSION,
        mem_bytes: 256 << 20,
        vcpus: 1,
        disk_bytes: 0,
        lease_ms: LEASE_MS,
        linux: None,
        colo: false,
    }
}

/// A hello frame's payload: a fresh nonce, then the hello.
fn hello_payload() -> Result<Vec<u8>, String> {
    Ok([&nonce()?[..], &serde_json::to_vec(&hello()).map_err(|e| e.to_string())?].concat())
}

/// A `ninelives replicate backup` on a free loopback port.
struct Backup {
    p: Proc,
    addr: SocketAddr,
    /// A real primary was started: a peer attached from now on is not an attacker.
    real: bool,
}

impl Backup {
    fn start(key: &Path, lease_ms: u64) -> Result<Backup> {
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let (a, lease) = (addr.to_string(), lease_ms.to_string());
        let key = key.to_str().context("path")?;
        let p = Proc::ninelives(
            None,
            &[
                "replicate",
                "backup",
                "--listen",
                &a,
                "--key-file",
                key,
                "--lease-ms",
                &lease,
                "--json",
            ],
        )?;
        let mut b = Backup { p, addr, real: false };
        if poll(2 * BOUND, || b.p.stderr.text().contains("listening").then_some(())).is_none() {
            bail!("the backup did not start listening: {}", ended(&mut b.p).unwrap_or_default());
        }
        Ok(b)
    }

    /// Runs a real primary (1 s of memwrite) against this backup to its end:
    /// clean if it finished with a verified digest and the backup stood down.
    fn serve_real_primary(&mut self, key: &Path) -> (Outcome, String) {
        self.real = true;
        let a = self.addr.to_string();
        let lease = LEASE_MS.to_string();
        let args = [
            "replicate",
            "primary",
            "--backup",
            &a,
            "--duration",
            "1",
            "--lease-ms",
            &lease,
            "--json",
        ];
        let key = ["--key-file", key.to_str().unwrap_or_default()];
        let mut p = match Proc::ninelives(None, &[&args[..], &key[..]].concat()) {
            Ok(p) => p,
            Err(e) => return (Outcome::Unexpected, format!("{e:#}")),
        };
        if p.wait_for(PRIMARY_BOUND).is_none() {
            return (
                Outcome::Hang,
                format!("the primary did not finish: {}", tail(&p.stderr.text())),
            );
        }
        self.p.wait_for(BOUND);
        if let Some(why) = self.compromised() {
            return (Outcome::WrongSuccess, why);
        }
        if p.last_json().unwrap_or_default()["digest_ok"] != true {
            return (
                Outcome::Harmed,
                format!("the real primary was not served: {}", tail(&p.stderr.text())),
            );
        }
        if self.p.last_json().unwrap_or_default()["primary_finished"] != true {
            return (
                Outcome::Crash,
                format!("the backup did not stand down: {}", tail(&self.p.stderr.text())),
            );
        }
        (Outcome::Clean, String::new())
    }
}

impl Target for Backup {
    fn exited(&mut self) -> Option<String> {
        ended(&mut self.p)
    }

    /// A hello is answered (challenge or refusal) within [`BOUND`].
    fn probe(&mut self) -> Result<(), String> {
        let s = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
        let mut d = Deadline::new(&s, BOUND);
        write_plain_frame(&mut d, Kind::Hello, &[&hello_payload()?]).map_err(|e| e.to_string())?;
        read_plain_frame(&mut d).map(|_| ()).map_err(|e| e.to_string())
    }

    fn compromised(&mut self) -> Option<String> {
        let err = self.p.stderr.text();
        if err.contains("taking over") {
            return Some(format!("the backup activated: {}", tail(&err)));
        }
        (!self.real && err.contains("authenticated and attached"))
            .then(|| format!("an attacker holds the backup's slot: {}", tail(&err)))
    }

    fn harmed(&mut self) -> Option<String> {
        None
    }
}

/// A peer with a wrong key runs the real handshake.
fn wrong_key(addr: SocketAddr) -> Seen {
    let (s, key) = match (TcpStream::connect(addr), Key::random()) {
        (Ok(s), Ok(k)) => (s, k),
        (s, k) => return Seen::Odd(format!("{:?} {:?}", s.err(), k.err())),
    };
    match primary_handshake(&mut Deadline::new(&s, BOUND), &key, &hello()) {
        Ok(_) => Seen::Got("a peer with a wrong key was welcomed".into()),
        Err(e) if e.contains("refused this primary: authentication failed") => Seen::Refused,
        // The backup welcomed us (its proof does not match our key).
        Err(e) if e.contains("the backup did not prove") => Seen::Got(format!("welcomed: {e}")),
        Err(e) if e.contains("time") => Seen::Silent(e),
        Err(e) => Seen::Odd(e),
    }
}

/// A hand-made hello, a random proof and random bytes, all at once; then
/// the answers are read up to the verdict.
fn forged_frames(addr: SocketAddr) -> Seen {
    let mut all = Vec::new();
    let made = (|| -> Result<TcpStream, String> {
        write_plain_frame(&mut all, Kind::Hello, &[&hello_payload()?])
            .map_err(|e| e.to_string())?;
        write_plain_frame(&mut all, Kind::Auth, &[&nonce()?]).map_err(|e| e.to_string())?;
        for _ in 0..64 {
            all.extend_from_slice(&nonce()?);
        }
        TcpStream::connect(addr).map_err(|e| e.to_string())
    })();
    let mut s = match made {
        Ok(s) => s,
        Err(e) => return Seen::Odd(e),
    };
    let _ = s.write_all(&all);
    let mut d = Deadline::new(&s, BOUND);
    for _ in 0..3 {
        match read_plain_frame(&mut d) {
            Ok(f) if f.kind == Kind::Challenge => continue,
            Ok(f) if f.kind == Kind::Refuse => return Seen::Refused,
            Ok(f) => return Seen::Got(format!("answered a forged proof with {:?}", f.kind)),
            Err(e) => return Seen::Odd(format!("no refusal: {e}")),
        }
    }
    Seen::Odd("more than one challenge".into())
}

fn repl_forged(key: &Path, tries: u32) -> Result<[Row; 2]> {
    let mut row = Row::new("repl-forged");
    row.note = Some(format!(
        "a wrong key (the real handshake), or a hand-made hello + random proof + random bytes, \
         in turn; then the backup's lease ({LEASE_MS} ms) waited out"
    ));
    let mut b = Backup::start(key, LEASE_MS)?;
    let addr = b.addr;
    campaign(&mut row, tries, 1, &mut b, |i| {
        let seen = if i % 2 == 0 { wrong_key(addr) } else { forged_frames(addr) };
        std::thread::sleep(Duration::from_millis(LEASE_MS + 300));
        seen
    });
    let mut real = Row::new("repl-real-primary-after-attacks");
    real.note = Some("the real primary (1 s of memwrite) then runs to a verified digest".into());
    real.add(b.serve_real_primary(key));
    Ok([row, real])
}

fn repl_slowloris(key: &Path, tries: u32) -> Result<Row> {
    let mut row = Row::new("repl-slowloris");
    row.note = Some(
        "3 clients at 1 byte per 300 ms while the real primary connects; a new backup per try \
         (a backup stands down once its primary finished)"
            .into(),
    );
    for _ in 0..tries {
        let mut b = Backup::start(key, LEASE_MS)?;
        let (stop, addr) = (AtomicBool::new(false), b.addr);
        let outcome = std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    let Ok(mut s) = TcpStream::connect(addr) else { return };
                    for k in 0..60 {
                        if stop.load(Ordering::SeqCst) || s.write_all(&[b"NLRP"[k % 4]]).is_err() {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(300));
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(500));
            let o = b.serve_real_primary(key);
            stop.store(true, Ordering::SeqCst);
            o
        });
        row.add(outcome);
    }
    Ok(row)
}

// ---- The report -------------------------------------------------------------

fn revision() -> Option<String> {
    let dir = exe().ok()?.parent()?.to_path_buf();
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["describe", "--always", "--dirty"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

pub fn bench(a: BenchHostileArgs) -> Result<ExitCode> {
    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = Dir(std::env::temp_dir().join(format!("ninelives-hostile-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    {
        use std::os::unix::fs::PermissionsExt;
        // The other user must reach the socket in it.
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755))?;
    }
    let d = dir.0.as_path();
    let key = d.join("repl.key");
    Key::generate(&key).map_err(anyhow::Error::msg)?;
    let n = a.tries;
    let loadavg_before = loadavg();
    let mut rows = Vec::new();
    let step = |name: &str| eprintln!("ninelives: bench hostile: {name}");
    step("api-oversized");
    rows.push(api_oversized(d, n)?);
    step("api-slow");
    rows.push(api_slow(d, n)?);
    step("api-malformed");
    rows.push(api_malformed(d, n)?);
    step("api-flood");
    rows.extend(api_flood(d, n)?);
    step("api-overcommit");
    rows.push(api_overcommit(d, n)?);
    step("api-other-user");
    rows.push(api_other_user(d, n)?);
    step("repl-forged");
    rows.extend(repl_forged(&key, n)?);
    step("repl-slowloris");
    rows.push(repl_slowloris(&key, a.slow_tries.unwrap_or(n))?);
    let loadavg_after = loadavg();

    println!(
        "{:<32} {:>5} {:>6} {:>5} {:>5} {:>13} {:>16} {:>10}",
        "attack",
        "tries",
        "clean",
        "crash",
        "hang",
        "wrong-success",
        "other-VMs-harmed",
        "unexpected"
    );
    for r in &rows {
        if let Some(why) = &r.not_run {
            println!("{:<32} NOT RUN: {why}", r.attack);
            eprintln!("\n*** bench hostile: {} NOT RUN: {why} ***\n", r.attack);
            continue;
        }
        println!(
            "{:<32} {:>5} {:>6} {:>5} {:>5} {:>13} {:>16} {:>10}",
            r.attack,
            r.tries,
            r.clean_refusal,
            r.crash,
            r.hang,
            r.wrong_success,
            r.other_vms_harmed,
            r.unexpected
        );
    }
    for r in &rows {
        if let Some(note) = &r.note {
            println!("  {}: {note}", r.attack);
        }
        for f in &r.failures {
            println!("  {} FAILED: {f}", r.attack);
        }
    }
    println!("loadavg before {loadavg_before}, after {loadavg_after}");
    let bad: u32 = rows.iter().map(Row::bad).sum();
    if a.json {
        println!(
            "{}",
            json!({
                "rows": rows,
                "loadavg_before": loadavg_before,
                "loadavg_after": loadavg_after,
                "version": env!("CARGO_PKG_VERSION"),
                "revision": revision(),
                "not_clean": bad,
            })
        );
    }
    Ok(if bad == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
