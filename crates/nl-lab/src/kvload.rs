//! `ninelives kvload`: the load generator and checker of the kv workload's
//! server (protocol in `nl_workloads::kv`).
//!
//! Each connection owns a disjoint share of the keys (key i belongs to
//! connection i mod N), so for every key the client knows the last write
//! the server acknowledged. Every GET is checked against it, and at the end
//! every key is read back and the server's digest over this run's keys
//! (keys carry a per-run prefix) is compared with the one computed from what
//! was acknowledged. A PUT whose outcome is unknown (the connection failed
//! before its `OK`) makes either the old or the new value acceptable. Any
//! other answer is a lost or corrupted acknowledged write: counted,
//! reported, and the exit status is non-zero.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nl_workloads::kv::{entry_hash, MAX_RESPONSE};
use serde::Serialize;

#[derive(Args, Clone, Debug)]
pub struct KvloadArgs {
    /// The server, ADDR[:PORT] (port 7000 by default).
    #[arg(long)]
    pub target: String,
    /// Seconds of load (the read-back check comes after).
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Concurrent connections, each with its own share of the keys.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub connections: u32,
    /// Distinct keys written and read.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=20000))]
    pub keys: u64,
    /// Percentage of requests that are PUTs (the rest are GETs).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub put_pct: u64,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up on a request (and reconnect) after this long, e.g. 2s, 500ms.
    #[arg(long, default_value = "2s", value_parser = nl_launch::args::parse_duration)]
    pub timeout: Duration,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// One request/response exchange on a connection.
pub trait Link: Send {
    /// Sends `req` (one line, newline included) and reads one response line
    /// (without its newline) into `resp`.
    fn roundtrip(&mut self, req: &[u8], resp: &mut Vec<u8>) -> io::Result<()>;
}

/// A [`Link`] over a byte stream.
pub struct StreamLink<S: Read + Write + Send>(BufReader<S>);

impl<S: Read + Write + Send> StreamLink<S> {
    pub fn new(s: S) -> Self {
        StreamLink(BufReader::new(s))
    }
}

impl<S: Read + Write + Send> Link for StreamLink<S> {
    fn roundtrip(&mut self, req: &[u8], resp: &mut Vec<u8>) -> io::Result<()> {
        self.0.get_mut().write_all(req)?;
        resp.clear();
        let n = (&mut self.0).take(MAX_RESPONSE as u64 + 1).read_until(b'\n', resp)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        if resp.pop() != Some(b'\n') {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "overlong response line"));
        }
        Ok(())
    }
}

/// What the load run does.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    pub duration: Duration,
    pub connections: u32,
    pub keys: u64,
    pub put_pct: u64,
    pub seed: u64,
    /// Keys are `{prefix}{index}`.
    pub prefix: String,
    /// The read-back phase gives up after this long without an answer
    /// (and after five minutes in all).
    pub verify_stall: Duration,
    /// Keep when each answer arrived ([`KvReport::answered_ms`]).
    pub timeline: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct KvReport {
    pub target: String,
    pub prefix: String,
    pub duration_s: f64,
    pub connections: u32,
    pub keys: u64,
    pub put_pct: u64,
    /// Requests answered during the load phase.
    pub ops: u64,
    pub puts: u64,
    pub gets: u64,
    pub ops_per_sec: f64,
    /// Per-request latency in microseconds.
    pub latency_us: Latency,
    /// Failed exchanges (connect, send, receive, timeout).
    pub errors: u64,
    pub connects: u64,
    /// PUTs the server refused with `ERR` (e.g. a full table): not acknowledged.
    pub rejected: u64,
    /// Responses that were not the protocol's.
    pub protocol_errors: u64,
    /// GETs during the load whose answer was not the last acknowledged write.
    pub mismatches: u64,
    /// Keys read back after the load, and those whose value was wrong.
    pub readback_checked: u64,
    pub readback_mismatches: u64,
    /// Keys that could not be read back (the server stopped answering).
    pub unverified: u64,
    /// PUTs whose outcome is unknown (the connection failed before the ack).
    pub unacked_puts: u64,
    /// The server's digest over this run's keys equals the acknowledged
    /// writes' (None: could not be asked).
    pub digest_ok: Option<bool>,
    /// The first few wrong answers, for the report.
    pub examples: Vec<String>,
    pub ok: bool,
    /// When the load began, in milliseconds since the Unix epoch.
    pub start_unix_ms: f64,
    /// With [`LoadConfig::timeline`]: when each answer of the load phase
    /// arrived, in milliseconds since the load began, sorted (the first
    /// [`MAX_TIMELINE`] per connection; for time series
    /// such as `bench sandbox-recovery`'s Fig. 6; not in the JSON).
    #[serde(skip)]
    pub answered_ms: Vec<f64>,
}

/// At most this many answer times are kept per connection.
pub const MAX_TIMELINE: usize = 1 << 21;

/// splitmix64.
fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a key may hold on the server: one value (None = absent) once its
/// last PUT was acknowledged; more while PUTs of unknown outcome exist.
type Possible = Vec<Option<String>>;

#[derive(Default)]
struct Worker {
    ops: u64,
    puts: u64,
    gets: u64,
    lat_ns: Vec<u64>,
    errors: u64,
    connects: u64,
    rejected: u64,
    protocol_errors: u64,
    mismatches: u64,
    readback_checked: u64,
    readback_mismatches: u64,
    unverified: u64,
    unacked_puts: u64,
    examples: Vec<String>,
    /// When each answer arrived, since the load began.
    answered: Vec<Duration>,
    /// Per owned key (index j: key id + j * connections).
    state: Vec<Possible>,
}

enum Answer {
    Ok,
    Val(String),
    None,
    Err,
    Bad,
}

fn parse(resp: &[u8]) -> Answer {
    match resp {
        b"OK" => Answer::Ok,
        b"NONE" => Answer::None,
        r if r.starts_with(b"VAL ") => match std::str::from_utf8(&r[4..]) {
            Ok(v) if nl_workloads::kv::valid_token(v.as_bytes(), nl_workloads::kv::MAX_VALUE) => {
                Answer::Val(v.to_string())
            }
            _ => Answer::Bad,
        },
        r if r.starts_with(b"ERR") => Answer::Err,
        _ => Answer::Bad,
    }
}

type Connect<'a> = &'a (dyn Fn() -> io::Result<Box<dyn Link>> + Sync);

impl Worker {
    fn note(&mut self, what: String) {
        if self.examples.len() < 5 {
            self.examples.push(what);
        }
    }

    fn link<'l>(
        &mut self,
        link: &'l mut Option<Box<dyn Link>>,
        connect: Connect,
    ) -> Option<&'l mut Box<dyn Link>> {
        if link.is_none() {
            match connect() {
                Ok(l) => {
                    self.connects += 1;
                    *link = Some(l);
                }
                Err(_) => {
                    self.errors += 1;
                    std::thread::sleep(Duration::from_millis(50));
                    return None;
                }
            }
        }
        link.as_mut()
    }

    /// Checks a GET's answer against what key `j` may hold; returns whether it matched.
    fn check(&mut self, key: &str, j: usize, got: Option<String>) -> bool {
        if self.state[j].contains(&got) {
            return true;
        }
        let want = &self.state[j];
        self.note(format!("GET {key}: got {got:?}, acknowledged {want:?}"));
        false
    }

    fn run(
        &mut self,
        id: u32,
        cfg: &LoadConfig,
        stop: &std::sync::atomic::AtomicBool,
        connect: Connect,
        began: Instant,
    ) {
        let n = u64::from(cfg.connections);
        let owned = cfg.keys.saturating_sub(u64::from(id)).div_ceil(n) as usize;
        self.state = vec![vec![None]; owned];
        if owned == 0 {
            return;
        }
        let mut rng = cfg.seed ^ (u64::from(id) + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let mut link: Option<Box<dyn Link>> = None;
        let mut resp = Vec::with_capacity(MAX_RESPONSE + 1);
        let start = Instant::now();
        let mut seq = 0u64;
        // Load phase.
        while start.elapsed() < cfg.duration && !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let Some(l) = self.link(&mut link, connect) else { continue };
            let r = next(&mut rng);
            let j = (r % owned as u64) as usize;
            let key = format!("{}{}", cfg.prefix, u64::from(id) + j as u64 * n);
            let put = (r >> 32) % 100 < cfg.put_pct;
            seq += 1;
            let value = format!("{id}.{seq}.{:x}", next(&mut rng) >> 16);
            let req = if put { format!("PUT {key} {value}\n") } else { format!("GET {key}\n") };
            let t = Instant::now();
            let res = l.roundtrip(req.as_bytes(), &mut resp);
            let ns = t.elapsed().as_nanos() as u64;
            let answer = match res {
                Ok(()) => {
                    if cfg.timeline && self.answered.len() < MAX_TIMELINE {
                        self.answered.push(began.elapsed());
                    }
                    parse(&resp)
                }
                Err(_) => {
                    self.errors += 1;
                    link = None;
                    std::thread::sleep(Duration::from_millis(10));
                    if put {
                        self.unacked_puts += 1;
                        self.state[j].push(Some(value));
                    }
                    continue;
                }
            };
            match (put, answer) {
                (true, Answer::Ok) => self.state[j] = vec![Some(value)],
                (true, Answer::Err) => self.rejected += 1,
                (false, Answer::Val(v)) => {
                    if !self.check(&key, j, Some(v)) {
                        self.mismatches += 1;
                    }
                }
                (false, Answer::None) => {
                    if !self.check(&key, j, None) {
                        self.mismatches += 1;
                    }
                }
                (_, _) => {
                    self.protocol_errors += 1;
                    self.note(format!(
                        "{}: answered {:?}",
                        req.trim_end(),
                        String::from_utf8_lossy(&resp)
                    ));
                    if put {
                        self.unacked_puts += 1;
                        self.state[j].push(Some(value));
                    }
                    link = None;
                    continue;
                }
            }
            self.ops += 1;
            if put {
                self.puts += 1;
            } else {
                self.gets += 1;
            }
            if self.lat_ns.len() < 10_000_000 {
                self.lat_ns.push(ns);
            }
        }
        // Read-back phase: every owned key, bounded in time.
        let end = Instant::now() + Duration::from_secs(300);
        let mut progress = Instant::now();
        let mut j = 0;
        while j < owned && Instant::now() < end && progress.elapsed() < cfg.verify_stall {
            let Some(l) = self.link(&mut link, connect) else { continue };
            let key = format!("{}{}", cfg.prefix, u64::from(id) + j as u64 * n);
            let req = format!("GET {key}\n");
            let got = match l.roundtrip(req.as_bytes(), &mut resp).map(|()| parse(&resp)) {
                Ok(Answer::Val(v)) => Some(v),
                Ok(Answer::None) => None,
                Ok(_) => {
                    self.protocol_errors += 1;
                    self.note(format!(
                        "{}: answered {:?}",
                        req.trim_end(),
                        String::from_utf8_lossy(&resp)
                    ));
                    link = None;
                    continue;
                }
                Err(_) => {
                    self.errors += 1;
                    link = None;
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            self.readback_checked += 1;
            progress = Instant::now();
            if self.check(&key, j, got.clone()) {
                // The server's state is now known: resolve unknown outcomes.
                self.state[j] = vec![got];
            } else {
                self.readback_mismatches += 1;
            }
            j += 1;
        }
        self.unverified += (owned - j) as u64;
    }
}

/// The `q`-quantile of latencies in ns, in µs (0 without samples).
fn percentile_us(sorted_ns: &[u64], q: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let v: Vec<f64> = sorted_ns.iter().map(|&n| n as f64).collect();
    crate::stats::percentile_sorted(&v, q) / 1e3
}

/// Runs the load and the checks; `connect` opens a connection to the server.
pub fn load(cfg: &LoadConfig, connect: Connect) -> KvReport {
    load_until(cfg, &std::sync::atomic::AtomicBool::new(false), connect)
}

/// [`load`], whose load phase also ends once `stop` is set.
pub fn load_until(
    cfg: &LoadConfig,
    stop: &std::sync::atomic::AtomicBool,
    connect: Connect,
) -> KvReport {
    let began = Instant::now();
    let start_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3);
    let workers: Vec<Worker> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..cfg.connections)
            .map(|id| {
                s.spawn(move || {
                    let mut w = Worker::default();
                    w.run(id, cfg, stop, connect, began);
                    w
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let mut r = KvReport {
        prefix: cfg.prefix.clone(),
        duration_s: cfg.duration.as_secs_f64(),
        connections: cfg.connections,
        keys: cfg.keys,
        put_pct: cfg.put_pct,
        start_unix_ms,
        ..KvReport::default()
    };
    let mut lat = Vec::new();
    let (mut count, mut sum, mut certain) = (0u64, 0u64, true);
    for (id, w) in workers.iter().enumerate() {
        r.ops += w.ops;
        r.puts += w.puts;
        r.gets += w.gets;
        r.errors += w.errors;
        r.connects += w.connects;
        r.rejected += w.rejected;
        r.protocol_errors += w.protocol_errors;
        r.mismatches += w.mismatches;
        r.readback_checked += w.readback_checked;
        r.readback_mismatches += w.readback_mismatches;
        r.unverified += w.unverified;
        r.unacked_puts += w.unacked_puts;
        for e in &w.examples {
            if r.examples.len() < 10 {
                r.examples.push(e.clone());
            }
        }
        lat.extend_from_slice(&w.lat_ns);
        r.answered_ms.extend(w.answered.iter().map(|d| d.as_secs_f64() * 1e3));
        for (j, p) in w.state.iter().enumerate() {
            match p.as_slice() {
                [Some(v)] => {
                    let key = format!(
                        "{}{}",
                        cfg.prefix,
                        id as u64 + j as u64 * u64::from(cfg.connections)
                    );
                    count += 1;
                    sum = sum.wrapping_add(entry_hash(key.as_bytes(), v.as_bytes()));
                }
                [None] => {}
                _ => certain = false,
            }
        }
    }
    r.ops_per_sec =
        if cfg.duration.is_zero() { 0.0 } else { r.ops as f64 / cfg.duration.as_secs_f64() };
    lat.sort_unstable();
    r.answered_ms.sort_by(f64::total_cmp);
    r.latency_us = Latency {
        p50: percentile_us(&lat, 0.5),
        p99: percentile_us(&lat, 0.99),
        max: lat.last().map_or(0.0, |&m| m as f64 / 1e3),
    };
    // The server's digest over this run's keys.
    if certain {
        let want = format!("DIGEST {count} {sum:016x}");
        let mut resp = Vec::new();
        r.digest_ok = connect().ok().and_then(|mut l| {
            l.roundtrip(format!("DIGEST {}\n", cfg.prefix).as_bytes(), &mut resp).ok()?;
            let got = String::from_utf8_lossy(&resp).into_owned();
            if got != want {
                r.examples
                    .push(format!("server digest '{got}', acknowledged writes give '{want}'"));
            }
            Some(got == want)
        });
    }
    r.ok = r.ops > 0
        && r.mismatches == 0
        && r.readback_mismatches == 0
        && r.unverified == 0
        && r.digest_ok != Some(false);
    r
}

fn target_addr(t: &str) -> Result<SocketAddr> {
    let with_port =
        if t.contains(':') { t.to_string() } else { format!("{t}:{}", nl_abi::KV_TCP_PORT) };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("--target {t}: not an address"))?
        .next()
        .with_context(|| format!("--target {t}: not an address"))
}

/// A [`Link`] over a new TCP connection to `target`, every step bounded by
/// `timeout`.
pub fn tcp_link(target: SocketAddr, timeout: Duration) -> io::Result<Box<dyn Link>> {
    let s = TcpStream::connect_timeout(&target, timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(Box::new(StreamLink::new(s)))
}

pub fn run(a: KvloadArgs) -> Result<ExitCode> {
    if !(a.duration.is_finite() && a.duration > 0.0 && a.duration <= 86_400.0) {
        bail!("--duration {} must be between 0 and 86400 seconds", a.duration);
    }
    let target = target_addr(&a.target)?;
    let timeout = a.timeout;
    let connect = move || tcp_link(target, timeout);
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(32);
    let cfg = LoadConfig {
        duration: Duration::from_secs_f64(a.duration),
        connections: a.connections,
        keys: a.keys,
        put_pct: a.put_pct,
        seed: a.seed,
        prefix: format!("r{:08x}-", next(&mut nonce.clone()) as u32),
        verify_stall: timeout * 5,
        timeline: false,
    };
    let mut r = load(&cfg, &connect);
    r.target = target.to_string();
    println!(
        "kvload {}: {} ops in {:.1} s ({:.0} ops/s, {} PUT, {} GET), latency p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        r.target, r.ops, r.duration_s, r.ops_per_sec, r.puts, r.gets, r.latency_us.p50, r.latency_us.p99, r.latency_us.max
    );
    println!(
        "  {} errors, {} connects, {} rejected, {} protocol errors, {} unacknowledged PUTs",
        r.errors, r.connects, r.rejected, r.protocol_errors, r.unacked_puts
    );
    println!(
        "  check: {} wrong GETs during the load; read back {} keys: {} wrong, {} unverified; digest {}",
        r.mismatches,
        r.readback_checked,
        r.readback_mismatches,
        r.unverified,
        match r.digest_ok {
            Some(true) => "matches",
            Some(false) => "DIFFERS",
            None => "not checked",
        }
    );
    for e in &r.examples {
        println!("  {e}");
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(if r.ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::sync::{Arc, Mutex};

    /// What the fake server does wrong.
    #[derive(Clone, Copy)]
    enum Fault {
        None,
        /// Acknowledges every n-th PUT without storing it (a lost write).
        LoseEvery(u64),
        /// Stores every n-th PUT, then closes the connection before the ack
        /// (a failover: the outcome is unknown to the client, not wrong).
        CrashAfterStoreEvery(u64),
    }

    /// A server over a Unix socket pair (no network) around the real table
    /// and protocol, with `fault`.
    fn fake(table: Arc<Mutex<Vec<u64>>>, fault: Fault) -> io::Result<Box<dyn Link>> {
        let (a, b) = UnixStream::pair()?;
        std::thread::spawn(move || {
            let mut r = BufReader::new(b);
            let mut line = Vec::new();
            let mut puts = 0u64;
            // Bounded by the client: ends when it closes its end.
            while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let l = line.strip_suffix(b"\n").unwrap_or(&line).to_vec();
                line.clear();
                let mut out = [0u8; MAX_RESPONSE];
                puts += u64::from(l.starts_with(b"PUT"));
                let nth = |n: u64| l.starts_with(b"PUT") && puts.is_multiple_of(n);
                let n = match fault {
                    Fault::LoseEvery(n) if nth(n) => {
                        out[..3].copy_from_slice(b"OK\n");
                        3
                    }
                    _ => {
                        let mut mem = table.lock().unwrap();
                        let mut t = nl_workloads::kv::Table::new(&mut mem).unwrap();
                        nl_workloads::kv::serve(&mut t, &l, &mut out).0
                    }
                };
                if matches!(fault, Fault::CrashAfterStoreEvery(n) if nth(n)) {
                    break;
                }
                if r.get_mut().write_all(&out[..n]).is_err() {
                    break;
                }
            }
        });
        Ok(Box::new(StreamLink::new(a)))
    }

    fn cfg() -> LoadConfig {
        LoadConfig {
            duration: Duration::from_millis(200),
            connections: 3,
            keys: 50,
            put_pct: 50,
            seed: 7,
            prefix: "t-".into(),
            verify_stall: Duration::from_secs(5),
            timeline: false,
        }
    }

    #[test]
    fn a_correct_server_passes() {
        let table = Arc::new(Mutex::new(vec![0u64; 1024 * 16]));
        let r = load(&cfg(), &|| fake(table.clone(), Fault::None));
        assert!(r.ok, "{r:?}");
        assert!(r.ops > 0 && r.puts > 0 && r.gets > 0);
        assert_eq!(r.readback_checked, 50);
        assert_eq!(r.digest_ok, Some(true));
    }

    #[test]
    fn a_lost_acknowledged_write_is_caught() {
        let table = Arc::new(Mutex::new(vec![0u64; 1024 * 16]));
        let r = load(&cfg(), &|| fake(table.clone(), Fault::LoseEvery(5)));
        assert!(!r.ok, "{r:?}");
        assert!(r.mismatches + r.readback_mismatches > 0, "{r:?}");
        assert!(!r.examples.is_empty());
    }

    #[test]
    fn writes_cut_off_before_their_ack_are_not_false_alarms() {
        let table = Arc::new(Mutex::new(vec![0u64; 1024 * 16]));
        let r = load(&cfg(), &|| fake(table.clone(), Fault::CrashAfterStoreEvery(7)));
        assert!(r.ok, "{r:?}");
        assert!(r.unacked_puts > 0 && r.errors > 0 && r.connects > 3, "{r:?}");
        assert_eq!(r.readback_checked, 50);
        assert_eq!(r.digest_ok, Some(true), "resolved by the read-back: {r:?}");
    }

    #[test]
    fn a_garbage_server_is_an_error_not_a_panic() {
        let connect = || -> io::Result<Box<dyn Link>> {
            let (a, mut b) = UnixStream::pair()?;
            std::thread::spawn(move || {
                let _ = b.write_all(b"VAL \x01\x02\nWHAT\n");
                let _ = b.write_all(&[b'x'; 4096]);
            });
            Ok(Box::new(StreamLink::new(a)))
        };
        let c = LoadConfig { verify_stall: Duration::from_millis(300), ..cfg() };
        let r = load(&c, &connect);
        assert!(!r.ok);
        assert!(r.protocol_errors + r.errors > 0);
    }
}
