//! The external ping probe of `ninelives bench rejuvenate`: the service
//! interruption a client sees while the VMM process is replaced.
//!
//! The bench builds a network namespace of its own with a TAP
//! ([`TAP`], 10.0.0.1/24), runs the host inside it (`setns`) so a
//! netbench VM (10.0.0.2, UDP echo on port 7) can attach the TAP, and for
//! each rejuvenation starts `ninelives ping --interval 1ms --until-stdin-eof`
//! in the namespace (see [`across`]): it sends for a short window before the
//! rejuvenation, across it, and until the guest answers again plus a short
//! window after; closing its stdin ends the run. Its report gives the gaps
//! between replies (the longest one overlapping the rejuvenation request is
//! the rejuvenation's) and the pings lost. Only addresses inside the
//! namespace are ever used.
//!
//! Cleanup: the namespace (and with it the TAP) is deleted when [`PingNet`]
//! is dropped, which covers normal ends, errors and panics; SIGINT and
//! SIGTERM are caught by [`cleanup_on_signals`], which kills the host and
//! deletes the namespace before exiting.

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::json_out::last_json;
use crate::netns::Netns;
use crate::ping::{gap_across, lost, PingRun};

/// The TAP the netbench VM attaches (inside the bench's namespace).
pub const TAP: &str = "nlrjtap0";
const GUEST: &str = "10.0.0.2";
pub const GUEST_CIDR: &str = "10.0.0.2/24";
/// Pinging before the rejuvenation request and after the guest answers again.
const WINDOW: Duration = Duration::from_millis(300);
/// How long the guest may take to answer again after a rejuvenation
/// (cold: it boots from scratch first).
const ANSWER_LIMIT: Duration = Duration::from_secs(30);
/// Upper bound of one probe's ping run (it normally ends at stdin EOF).
const PROBE_MAX_SECS: &str = "3600";

/// What to undo if the bench is interrupted by a signal.
#[derive(Default)]
struct OnSignal {
    /// Process groups of hosts (a host and its successors share one).
    hosts: Vec<i32>,
    namespaces: Vec<String>,
}

static ON_SIGNAL: Mutex<OnSignal> =
    Mutex::new(OnSignal { hosts: Vec::new(), namespaces: Vec::new() });

fn on_signal() -> std::sync::MutexGuard<'static, OnSignal> {
    ON_SIGNAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Catches SIGINT and SIGTERM (the handler of `inject`, which only sets a
/// flag) and starts a thread that watches the flag: once set, it kills the
/// registered host process groups, deletes the registered namespaces and
/// exits with status 130, whatever the bench is waiting for meanwhile.
pub fn cleanup_on_signals() {
    crate::process::install_cancel_handler();
    let _ = std::thread::Builder::new().name("bench-signals".into()).spawn(|| loop {
        if crate::process::cancelled() {
            let todo = std::mem::take(&mut *on_signal());
            for pgid in todo.hosts {
                kill_group(pgid);
            }
            for ns in &todo.namespaces {
                crate::netns::delete(ns);
            }
            eprintln!("bench rejuvenate: interrupted; host killed, namespaces deleted");
            std::process::exit(130);
        }
        std::thread::sleep(Duration::from_millis(20));
    });
}

/// Registers a host started in a process group of its own (`pgid`, its
/// pid): an interrupted bench kills the group, which holds the host's
/// successors after rejuvenations too.
pub fn kill_host_on_signal(pgid: u32) {
    if let Ok(p) = i32::try_from(pgid) {
        on_signal().hosts.push(p);
    }
}

/// Kills a host registered with [`kill_host_on_signal`] (its whole process
/// group) and forgets it. Call it before the host's first process is
/// reaped, so the group id cannot have been reused.
pub fn kill_host_group(pgid: u32) {
    let Ok(p) = i32::try_from(pgid) else { return };
    on_signal().hosts.retain(|&h| h != p);
    kill_group(p);
}

fn kill_group(pgid: i32) {
    if pgid > 1 {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// The bench's ping namespace, or `None` and why not; with a JSON
/// description for the bench's report (`{"skipped": why}` without one). The
/// reason is also printed (on stdout unless `json`, else on stderr).
pub fn setup(json: bool) -> (Option<PingNet>, Value) {
    match PingNet::new() {
        Ok(n) => {
            let info = json!({"tap": TAP, "guest": GUEST, "interval_ms": 1.0,
                "vm": "VM 0 of each row: netbench with the row's memory; the others memwrite"});
            (Some(n), info)
        }
        Err(why) => {
            let line = format!("external ping gap skipped: {why}");
            if json {
                eprintln!("bench rejuvenate: {line}");
            } else {
                println!("{line}");
            }
            (None, json!({"skipped": why}))
        }
    }
}

/// A row's ping baseline (none without a ping namespace): waits until the
/// netbench VM answers, then pings it for 1 s without a rejuvenation.
pub fn baseline(net: Option<&PingNet>) -> Result<Option<Value>> {
    let Some(net) = net else { return Ok(None) };
    if !net.wait_answering(ANSWER_LIMIT)? {
        bail!("the netbench VM never answered a ping");
    }
    net.baseline(1.0).map(Some)
}

/// The bench's network namespace with the TAP; deleted on drop.
pub struct PingNet {
    ns: Netns,
}

impl PingNet {
    /// Builds the namespace, or says why the ping part is skipped.
    pub fn new() -> std::result::Result<PingNet, String> {
        if let Some(why) = crate::netns::unavailable() {
            return Err(why);
        }
        let name = format!("nl-rejuv-{}", std::process::id());
        on_signal().namespaces.push(name.clone());
        let ns = Netns::with_tap(&name, TAP).map_err(|e| format!("{e:#}"))?;
        Ok(PingNet { ns })
    }

    /// The namespace.
    pub fn netns(&self) -> &Netns {
        &self.ns
    }

    /// This binary inside the namespace: add the subcommand and its arguments.
    pub fn command(&self) -> Result<Command> {
        self.ns.ninelives()
    }

    /// The `create` request of the netbench VM on the TAP.
    pub fn netbench_vm(mem: u64, duration: f64) -> Value {
        json!({"op":"create","workload":"netbench","mem":mem,"duration":duration,
            "net_tap":TAP,"net_ip":GUEST_CIDR})
    }

    fn ping(&self, target: &str, interval: &str, secs: &str) -> Result<std::process::Output> {
        let mut c = self.command()?;
        c.args(["ping", "--target", target, "--interval", interval, "--duration", secs, "--json"]);
        c.stdin(Stdio::null()).stderr(Stdio::null()).output().context("cannot run ninelives ping")
    }

    /// Waits (bounded in attempts and time) until the guest answers a short
    /// ping; false if it did not within `limit`.
    fn wait_answering(&self, limit: Duration) -> Result<bool> {
        self.wait_answering_at(GUEST, limit)
    }

    /// [`PingNet::wait_answering`] for the guest at `target`.
    pub fn wait_answering_at(&self, target: &str, limit: Duration) -> Result<bool> {
        let t = Instant::now();
        for _ in 0..1000 {
            if self.ping(target, "10ms", "0.05")?.status.success() {
                return Ok(true);
            }
            if t.elapsed() > limit {
                break;
            }
        }
        Ok(false)
    }

    /// A plain 1 ms ping for `secs` without a rejuvenation: the gaps this
    /// machine shows anyway.
    fn baseline(&self, secs: f64) -> Result<Value> {
        self.baseline_at(GUEST, secs)
    }

    /// [`PingNet::baseline`] of the guest at `target`.
    pub fn baseline_at(&self, target: &str, secs: f64) -> Result<Value> {
        let o = self.ping(target, "1ms", &format!("{secs}"))?;
        let j = last_json(&String::from_utf8_lossy(&o.stdout))
            .context("the baseline ping printed no result")?;
        Ok(json!({
            "secs": secs, "sent": j["sent"], "received": j["received"],
            "lost": lost(&j), "longest_gap_ms": j["longest_gap_ms"],
            "rtt_median_ms": j["rtt_median_ms"], "rtt_p99_ms": j["rtt_p99_ms"],
        }))
    }

    /// Starts a 1 ms ping and lets it run for a short window; the caller
    /// then rejuvenates between [`Probe::begin`] and [`Probe::end`].
    fn start_probe(&self) -> Result<Probe> {
        let p = self.start_probe_at(GUEST)?;
        std::thread::sleep(WINDOW);
        Ok(p)
    }

    /// A 1 ms ping of the guest at `target`, started now.
    fn start_probe_at(&self, target: &str) -> Result<Probe> {
        let mut c = self.command()?;
        c.args(["ping", "--target", target, "--interval", "1ms", "--duration", PROBE_MAX_SECS]);
        c.args(["--until-stdin-eof", "--json"]);
        let run = PingRun::start(c)?;
        Ok(Probe { run, target: target.to_string(), begin: None, end: None })
    }
}

impl Drop for PingNet {
    fn drop(&mut self) {
        // The namespace itself is deleted when `ns` drops.
        on_signal().namespaces.retain(|n| n != self.ns.name());
    }
}

/// Runs `rejuvenate` with a 1 ms ping across it (when there is a ping
/// namespace): the ping's report, or `None` without one.
pub fn across<T>(
    net: Option<&PingNet>,
    rejuvenate: impl FnOnce() -> Result<T>,
) -> Result<(T, Option<Value>)> {
    let Some(net) = net else { return Ok((rejuvenate()?, None)) };
    let mut probe = net.start_probe()?;
    probe.begin();
    let r = rejuvenate()?;
    probe.end();
    Ok((r, Some(probe.finish(net)?)))
}

/// [`across`] with a 1 ms ping of each guest in `targets` at once (e.g.
/// the members of a shared link): one report per target, in order.
pub fn across_each<T>(
    net: &PingNet,
    targets: &[&str],
    rejuvenate: impl FnOnce() -> Result<T>,
) -> Result<(T, Vec<Value>)> {
    let mut probes = targets.iter().map(|t| net.start_probe_at(t)).collect::<Result<Vec<_>>>()?;
    std::thread::sleep(WINDOW);
    probes.iter_mut().for_each(Probe::begin);
    let r = rejuvenate()?;
    probes.iter_mut().for_each(Probe::end);
    let reports = probes.into_iter().map(|p| p.finish(net)).collect::<Result<Vec<_>>>()?;
    Ok((r, reports))
}

/// A running 1 ms pinger across one rejuvenation; killed on drop.
struct Probe {
    run: PingRun,
    /// The guest it pings.
    target: String,
    begin: Option<Instant>,
    end: Option<Instant>,
}

impl Probe {
    /// The rejuvenation is requested now.
    fn begin(&mut self) {
        self.begin = Some(Instant::now());
    }

    /// The rejuvenation request returned.
    fn end(&mut self) {
        self.end = Some(Instant::now());
    }

    /// Waits until the guest answers again (bounded), pings a short window
    /// more, ends the run and reports:
    /// * `gap_ms`: the longest gap between replies that overlaps the
    ///   rejuvenation request (null, with `gap_under_ms`, if no gap of 3 ms
    ///   or more did), and when it began relative to the request;
    /// * `longest_gap_ms`: the longest gap of the whole run (from 300 ms
    ///   before the request to 300 ms after the guest answered again),
    ///   which includes the machine's own stalls;
    /// * the pings sent, received and lost, and whether the guest answered
    ///   again after the request returned.
    fn finish(self, net: &PingNet) -> Result<Value> {
        let answered = net.wait_answering_at(&self.target, ANSWER_LIMIT)?;
        std::thread::sleep(WINDOW);
        let r = self.run.finish()?;
        let (begin, end) = (self.begin.map(|t| r.ms_at(t)), self.end.map(|t| r.ms_at(t)));
        let j = r.report;
        let last = j["last_reply_ms"].as_f64();
        let b = begin.unwrap_or(0.0);
        let gap = gap_across(&j, b, end.unwrap_or(f64::INFINITY));
        let mut r = json!({
            "gap_ms": gap.map(|g| g.ms),
            "gap_start_after_request_ms": gap.map(|g| g.start_ms - b),
            "longest_gap_ms": j["longest_gap_ms"],
            "lost": lost(&j),
            "sent": j["sent"], "received": j["received"],
            "request_ms": end.zip(begin).map(|(e, b)| e - b),
            "answered_again": answered && last.zip(end).is_some_and(|(l, e)| l > e),
            "rtt_median_ms": j["rtt_median_ms"], "rtt_p99_ms": j["rtt_p99_ms"],
        });
        if gap.is_none() {
            r["gap_under_ms"] = json!(3.0);
        }
        Ok(r)
    }
}

/// One line of human output for a probe's (or a baseline's) result.
pub fn describe(p: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let gap = match (&p["gap_ms"], &p["gap_under_ms"]) {
        (Value::Null, Value::Null) => String::new(),
        (Value::Null, u) => format!("ping gap < {} ms, ", f(u)),
        (g, _) => format!("ping gap {:>8.2} ms, ", f(g)),
    };
    format!("{gap}longest ping gap {:>8.2} ms, lost {}", f(&p["longest_gap_ms"]), p["lost"])
}
