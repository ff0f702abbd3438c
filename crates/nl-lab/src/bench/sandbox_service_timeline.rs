//! Fig. 6 of Quest-V: a network service's replies over time while the
//! sandbox serving it fails and recovers, for each recovery policy
//! (`bench sandbox-recovery`, part `fig6`).
//!
//! The service is the reference guest's kv server (TCP 7000; it also
//! answers UDP echo on port 7) in sandbox `web` on TAP `nltap0`
//! (10.0.0.2) in a network namespace of the bench's own. Two clients run
//! at once from the namespace, as in the issue: a ping every 1 ms (UDP
//! echo) and `kvload` (2 connections, half PUTs, half GETs, each checked
//! against the last acknowledged write). One second into the clients'
//! run, `web` faults (an unmapped RIP: its next instruction faults):
//!
//! * `restart`, `replace`: `web` is re-created in place with fresh memory
//!   and keeps its TAP (`replace` with the workload of
//!   `recovery.replace_with`, here kv again);
//! * `rollback`: `web` runs under nl-checkpoint's supervisor (a checkpoint
//!   every 20 ms) and is rolled back in place; the fault is scripted at a
//!   fixed time of the supervised run, since the supervisor owns the VM.
//!   Its output is held until no rollback can undo it (output commit, the
//!   default); `rollback-nocommit` is the same without it, for comparison;
//!   `rollback-nextcheckpoint` holds it until the checkpoint after its
//!   own (`recovery.release: "next_checkpoint"`: errors assumed found
//!   within one interval; a first rollback goes back one checkpoint),
//!   with a checkpoint every 5 ms, since its gap is two to four intervals;
//! * `remote`: service `kv` with its state region (4 MiB) is taken over by
//!   the standby `spare`, which gets the TAP; `web` restarts as the new
//!   standby.
//!
//! Each run gives the replies per 10 ms of both clients, the longest ping
//! and kv gaps around the fault, and what kvload found wrong (acknowledged
//! writes lost: expected for `restart` and `replace`, which start from
//! fresh memory, and `rollback-nocommit`, whose replies leave before their
//! state is safe; measured for the others).
//!
//! [`kv_rollbacks`]: one kv sandbox under `rollback` with output commit,
//! kvload running, N faults one after another (each once the previous
//! rollback is done and the service answers again): acknowledged writes
//! lost across N rollbacks (issue 19). [`kv_takeovers`]: the same across
//! N takeovers of the `remote` service with its state region, each fault
//! into the current holder.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use nl_sandbox::faults::GuestFault;
use nl_sandbox::{SandboxSet, SetConfig};
use serde::Serialize;

use crate::kvload::{self, LoadConfig};
use crate::netns::Netns;
use crate::stats::Summary;

use super::sandbox_recovery::{unix_now_ms, wait_for};

/// An unmapped RIP: the guest's next instruction faults (#PF, ring 3).
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

/// The clients' run, and when in it the fault comes.
const CLIENT_RUN: Duration = Duration::from_secs(3);
const FAULT_AT: Duration = Duration::from_secs(1);
/// A `rollback` run's scripted fault, after its supervision began: late
/// enough for the service to answer first.
const ROLLBACK_FAULT_AT: Duration = Duration::from_secs(8);
/// Width of a bin of the series.
pub const BIN_MS: f64 = 10.0;

/// `rollback`'s heartbeat bound (`detect.heartbeat_cpu_ms`, guest CPU time):
/// the base detection latency L, so with output commit a reply waits about
/// L of guest time plus one checkpoint interval. The default (1000 ms) would
/// hold replies for seconds (an idle kv guest accrues guest time slowly:
/// tests/sandbox_rollback_commit.rs saw replies held 0.46 s median at 100
/// ms). 100 ms is ten of the guest's heartbeat periods (`HEARTBEAT_MS`,
/// 10 ms), so a working guest does not miss it, and it is what that test
/// ran 6 rollbacks with, no hang falsely detected.
pub const ROLLBACK_HEARTBEAT_CPU_MS: u64 = 100;

/// kvload's per-request timeout for the rollback rows: held replies come
/// late, and a request given up on (its connection dropped) may still be
/// applied after newer acknowledged writes, which the checker would count
/// as lost although no rollback undid anything.
const ROLLBACK_KV_TIMEOUT: Duration = Duration::from_secs(20);

const SERVICE: &str = "10.0.0.2";

/// One run of one policy.
#[derive(Clone, Debug, Serialize)]
pub struct TimelineRun {
    /// When the fault came, in ms since the clients began.
    pub fault_ms: f64,
    /// Longest interval without a ping reply from the fault on
    /// ([`gap_after`]), ms.
    pub ping_gap_ms: f64,
    /// The pinger's own longest hold-up (`PingReport::client_stall_ms`),
    /// and whether it ran real-time.
    pub ping_client_stall_ms: f64,
    pub ping_client_realtime: bool,
    /// The longest host core stall ([`crate::stalls`]) that overlaps the
    /// longest ping gap, ms: a core not even a real-time thread got.
    pub ping_gap_host_stall_ms: Option<f64>,
    /// The same for kv answers (any answer of any connection).
    pub kv_gap_ms: f64,
    /// Ping replies and kv answers per [`BIN_MS`] from the clients' start.
    pub ping_per_bin: Vec<u32>,
    pub kv_per_bin: Vec<u32>,
    pub pings_sent: u64,
    pub pings_received: u64,
    pub kv_ops: u64,
    /// Wrong GETs during the load and wrong values read back after it:
    /// acknowledged writes the service lost.
    pub kv_lost: u64,
    /// kv's read-back after the load could not be completed (keys).
    pub kv_unverified: u64,
    /// The service answered the ping client after the fault.
    pub serving_again: bool,
    /// `rollback`: what output commit did (frames, hold times).
    pub output_commit: Option<nl_sandbox::OutputCommitStats>,
}

/// A policy's runs and their summaries.
#[derive(Clone, Debug, Serialize)]
pub struct TimelinePolicy {
    pub policy: &'static str,
    pub ping_gap_ms: Summary,
    pub kv_gap_ms: Summary,
    pub runs: Vec<TimelineRun>,
}

fn web_config(policy: &str, cores: [usize; 2]) -> String {
    let [c0, c1] = cores;
    let net = format!(
        r#""net": {{"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "{SERVICE}/24"}}"#
    );
    let kv = r#"{"kind": "kv", "duration_ms": 0}"#;
    match policy {
        "remote" => format!(
            r#"{{"sandboxes": [
                {{"name": "web", "cores": [{c0}], "workload": {kv}, {net}, "recovery": {{"policy": "restart"}}}},
                {{"name": "spare", "cores": [{c1}], "workload": {kv}, "recovery": {{"policy": "restart"}}}}
            ], "services": [{{"name": "kv", "owner": "web", "standby": "spare", "state": {{"mib": 4}}}}]}}"#
        ),
        "replace" => format!(
            r#"{{"sandboxes": [{{"name": "web", "cores": [{c0}], "workload": {kv}, {net},
                "recovery": {{"policy": "replace", "replace_with": {kv}}}}}]}}"#
        ),
        "rollback" | "rollback-nocommit" | "rollback-nextcheckpoint" => format!(
            r#"{{"sandboxes": [{{"name": "web", "cores": [{c0}], "workload": {kv}, {net},
                "detect": {{"heartbeat_cpu_ms": {ROLLBACK_HEARTBEAT_CPU_MS}}},
                "recovery": {{"policy": "rollback", "checkpoint_interval_ms": {},
                              "output_commit": {}{}}}}}]}}"#,
            // A reply waits one to two intervals, and a rollback undoes one
            // to two: the gap is two to four intervals.
            if policy == "rollback-nextcheckpoint" { 5 } else { 20 },
            policy != "rollback-nocommit",
            if policy == "rollback-nextcheckpoint" {
                r#", "release": "next_checkpoint""#
            } else {
                ""
            }
        ),
        p => format!(
            r#"{{"sandboxes": [{{"name": "web", "cores": [{c0}], "workload": {kv}, {net},
                "recovery": {{"policy": "{p}"}}}}]}}"#
        ),
    }
}

/// Counts of `times_ms` per bin of [`BIN_MS`] over `[0, end_ms)`.
pub fn bins(times_ms: &[f64], end_ms: f64) -> Vec<u32> {
    let n = (end_ms / BIN_MS).ceil().max(0.0) as usize;
    let mut v = vec![0u32; n];
    for &t in times_ms {
        if t >= 0.0 {
            if let Some(b) = v.get_mut((t / BIN_MS) as usize) {
                *b += 1;
            }
        }
    }
    v
}

/// The longest interval without an event from the fault on: over
/// consecutive `times_ms` (sorted) whose later one comes after `at_ms`
/// (the outage begins when the fault is detected, a little after it), and
/// to `end_ms` when none comes after it. The run's start bounds it when no
/// event came before.
pub fn gap_after(times_ms: &[f64], at_ms: f64, end_ms: f64) -> f64 {
    silence_after(times_ms, at_ms, end_ms).0
}

/// [`gap_after`], and when that silence began (the event before it, or the
/// run's start), on the same clock.
pub fn silence_after(times_ms: &[f64], at_ms: f64, end_ms: f64) -> (f64, f64) {
    let mut prev = times_ms.iter().copied().filter(|&t| t <= at_ms).fold(0.0, f64::max);
    let (mut gap, mut start): (f64, f64) = (0.0, prev);
    let mut any = false;
    for &t in times_ms.iter().filter(|&&t| t > at_ms) {
        if t - prev > gap {
            (gap, start) = (t - prev, prev);
        }
        prev = t;
        any = true;
    }
    if any {
        (gap, start)
    } else {
        (end_ms - prev, prev)
    }
}

fn answers(to: SocketAddr) -> bool {
    crate::ping::ping(to, Duration::from_millis(10), Duration::from_millis(100), None)
        .is_ok_and(|p| p.received > 0)
}

/// One run of `policy` in `ns` (see the module documentation).
fn run_one(
    ns: &Netns,
    policy: &str,
    rep: usize,
    cores: [usize; 2],
    stall_probe: bool,
) -> Result<TimelineRun> {
    let config = SetConfig::parse(&web_config(policy, cores))?;
    let echo: SocketAddr = format!("{SERVICE}:7").parse()?;
    let kv_at: SocketAddr = format!("{SERVICE}:{}", nl_abi::KV_TCP_PORT).parse()?;
    ns.run_in(|| {
        let kvm = nl_vmm::open_kvm()?;
        let s = SandboxSet::create(&kvm, config, &super::sandbox_recovery::images())?;
        let rollback = policy.starts_with("rollback");
        if rollback {
            s.get("web").expect("web").set_script(vec![(ROLLBACK_FAULT_AT, BAD_RIP)]);
        }
        let kv_timeout = if rollback { ROLLBACK_KV_TIMEOUT } else { Duration::from_millis(500) };
        let run = super::sandbox_recovery::supervised(&s, |s| -> Result<TimelineRun> {
            let sup_start = s.elapsed_ms();
            if !wait_for(Duration::from_secs(90), || answers(echo)) {
                bail!("{policy}: the service never answered its first ping");
            }
            if !rollback {
                // Steady state: the restart VM built ahead (bounded: 120 s;
                // see nl_sandbox::prepare).
                let web = s.get("web").expect("web");
                wait_for(Duration::from_secs(120), || web.monitor.next_vm_ready());
            }
            if rollback {
                // The clients start FAULT_AT before the scripted fault.
                let start = sup_start + (ROLLBACK_FAULT_AT - FAULT_AT).as_secs_f64() * 1e3;
                if s.elapsed_ms() > start {
                    bail!(
                        "rollback: the service answered only {:.0} ms into its run, after the \
                         clients had to start",
                        s.elapsed_ms() - sup_start
                    );
                }
                std::thread::sleep(Duration::from_secs_f64((start - s.elapsed_ms()) / 1e3));
            }
            let cfg = LoadConfig {
                duration: CLIENT_RUN,
                connections: 2,
                // The rollback rows read back fewer keys: with output commit
                // each GET waits for its held reply (~0.4 s).
                keys: if rollback { 100 } else { 400 },
                put_pct: 50,
                seed: rep as u64 + 1,
                prefix: format!("f6{policy}{rep}-"),
                verify_stall: Duration::from_secs(5),
                timeline: true,
            };
            let probe = crate::stalls::StallProbe::start_if(
                stall_probe,
                &nl_sandbox::affinity::host_cores()?,
            );
            let (ping, kv, fault_unix_ms) = std::thread::scope(|scope| -> Result<_> {
                let pinger = scope
                    .spawn(|| crate::ping::ping(echo, Duration::from_millis(1), CLIENT_RUN, None));
                let loader =
                    scope.spawn(|| kvload::load(&cfg, &|| kvload::tcp_link(kv_at, kv_timeout)));
                let fault_unix_ms = if rollback {
                    let at = sup_start + ROLLBACK_FAULT_AT.as_secs_f64() * 1e3;
                    std::thread::sleep(Duration::from_secs_f64(
                        ((at - s.elapsed_ms()) / 1e3).max(0.0),
                    ));
                    unix_now_ms() - (s.elapsed_ms() - at)
                } else {
                    std::thread::sleep(FAULT_AT);
                    let t = unix_now_ms();
                    s.inject("web", &BAD_RIP)?;
                    t
                };
                let ping = pinger.join().map_err(|_| anyhow!("the pinger panicked"))??;
                let kv = loader.join().map_err(|_| anyhow!("the kv client panicked"))?;
                Ok((ping, kv, fault_unix_ms))
            })?;
            // Both clients on the pinger's clock.
            let fault_ms = fault_unix_ms - ping.start_unix_ms;
            let kv_times: Vec<f64> =
                kv.answered_ms.iter().map(|t| t + kv.start_unix_ms - ping.start_unix_ms).collect();
            let end_ms = CLIENT_RUN.as_secs_f64() * 1e3;
            let stalls = probe.finish();
            let (ping_gap_ms, gap_start) = silence_after(&ping.arrivals_ms, fault_ms, end_ms);
            let gap_unix = ping.start_unix_ms + gap_start;
            Ok(TimelineRun {
                fault_ms,
                ping_gap_ms,
                ping_gap_host_stall_ms: stalls
                    .overlapping(gap_unix, gap_unix + ping_gap_ms)
                    .map(|st| st.ms),
                ping_client_stall_ms: ping.client_stall_ms,
                ping_client_realtime: ping.client_realtime,
                kv_gap_ms: gap_after(&kv_times, fault_ms, end_ms),
                ping_per_bin: bins(&ping.arrivals_ms, end_ms),
                kv_per_bin: bins(&kv_times, end_ms),
                pings_sent: ping.sent,
                pings_received: ping.received,
                kv_ops: kv.ops,
                kv_lost: kv.mismatches + kv.readback_mismatches,
                kv_unverified: kv.unverified,
                serving_again: ping.arrivals_ms.iter().any(|&t| t > fault_ms),
                output_commit: None,
            })
        })?;
        // Set when the supervised run ended (stopped above).
        run.map(|r| TimelineRun {
            output_commit: s.get("web").and_then(|w| w.output_commit()),
            ..r
        })
    })
}

/// Acknowledged kv writes across many rollbacks with output commit.
#[derive(Clone, Debug, Serialize)]
pub struct KvRollbacks {
    /// `rollback` or `rollback-nextcheckpoint` (the release rule).
    pub policy: String,
    pub faults: u64,
    pub rollbacks: u64,
    pub kv_ops: u64,
    pub kv_puts: u64,
    /// Wrong GETs during the load and wrong values read back after it.
    pub kv_lost: u64,
    pub kv_unverified: u64,
    pub kv_digest_ok: Option<bool>,
    pub output_commit: Option<nl_sandbox::OutputCommitStats>,
    /// From the first fault to the rollback after the last, s.
    pub faults_secs: f64,
}

/// The set of `config` in a namespace of its own (`tag`), every sandbox
/// of policy `policy` allowed `faults` + 5 recoveries (the default gives up
/// after 5 within 10 s): runs `body` once the service answers a ping, then
/// `after` over its result once the supervision ended.
fn with_kv_set<T: Send>(
    tag: &str,
    config: &str,
    policy: &str,
    faults: u64,
    body: impl FnOnce(&SandboxSet) -> Result<T> + Send,
    after: impl FnOnce(&SandboxSet, T) -> T + Send,
) -> Result<T> {
    let ns = Netns::with_tap(&format!("nl-{tag}-{}", std::process::id()), "nltap0")?;
    let config = config.replace(
        &format!(r#""policy": "{policy}""#),
        &format!(r#""policy": "{policy}", "max_recoveries": {}"#, (faults + 5).min(1000)),
    );
    let config = SetConfig::parse(&config)?;
    let echo: SocketAddr = format!("{SERVICE}:7").parse()?;
    ns.run_in(|| {
        let kvm = nl_vmm::open_kvm()?;
        let s = SandboxSet::create(&kvm, config, &super::sandbox_recovery::images())?;
        let r = super::sandbox_recovery::supervised(&s, |s| -> Result<T> {
            if !wait_for(Duration::from_secs(90), || answers(echo)) {
                bail!("{tag}: the service never answered its first ping");
            }
            body(s)
        })?;
        r.map(|r| after(&s, r))
    })
}

/// kvload against the service (2 connections, `keys` keys, half PUTs,
/// requests timing out after `timeout`; `prefix` names its keys) while
/// `fault(i)` runs for each of `faults`, then half a second more. With
/// `ping`, a client pings the service every 1 ms beside it. Returns what
/// kvload found, the seconds the faults took, and the ping's report.
fn faults_under_load(
    faults: u64,
    keys: u64,
    prefix: &str,
    timeout: Duration,
    ping: bool,
    mut fault: impl FnMut(u64) -> Result<()>,
) -> Result<(kvload::KvReport, f64, Option<crate::ping::PingReport>)> {
    let echo: SocketAddr = format!("{SERVICE}:7").parse()?;
    let kv_at: SocketAddr = format!("{SERVICE}:{}", nl_abi::KV_TCP_PORT).parse()?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Long enough for every fault; the load stops after the last.
    let longest = Duration::from_secs(10 * faults + 60);
    let cfg = LoadConfig {
        duration: longest,
        connections: 2,
        keys,
        put_pct: 50,
        seed: 1,
        prefix: prefix.into(),
        verify_stall: Duration::from_secs(20),
        timeline: false,
    };
    std::thread::scope(|scope| {
        let loader =
            scope.spawn(|| kvload::load_until(&cfg, &stop, &|| kvload::tcp_link(kv_at, timeout)));
        let pinger = ping.then(|| {
            scope.spawn(|| crate::ping::ping(echo, Duration::from_millis(1), longest, Some(&stop)))
        });
        let t0 = std::time::Instant::now();
        let body = (0..faults).try_for_each(&mut fault);
        let secs = t0.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let kv = loader.join().map_err(|_| anyhow!("the kv client panicked"))?;
        let ping = match pinger {
            Some(h) => Some(h.join().map_err(|_| anyhow!("the pinger panicked"))??),
            None => None,
        };
        body?;
        Ok((kv, secs, ping))
    })
}

/// `faults` faults into one kv sandbox under `policy` (`rollback` or
/// `rollback-nextcheckpoint`: output commit either way) while kvload runs
/// (see the module doc); each fault once the previous rollback is done
/// and the service answers a ping again (bounded waits).
pub fn kv_rollbacks(faults: u64, cores: [usize; 2], policy: &str) -> Result<KvRollbacks> {
    let echo: SocketAddr = format!("{SERVICE}:7").parse()?;
    let body = |s: &SandboxSet| -> Result<KvRollbacks> {
        let web = s.get("web").expect("web");
        let (kv, faults_secs, _) =
            faults_under_load(faults, 100, "kvrb-", ROLLBACK_KV_TIMEOUT, false, |i| {
                // Writes acknowledged since the last rollback, and the guest
                // re-ran what it undid (else the fault is the same error
                // back and the look-back doubles).
                std::thread::sleep(Duration::from_millis(300));
                if !wait_for(Duration::from_secs(60), || web.rollback_settled()) {
                    bail!("kv-rollbacks: rollback {i} not settled within 60 s");
                }
                s.inject("web", &BAD_RIP)?;
                if !wait_for(Duration::from_secs(30), || web.rollbacks() > i) {
                    bail!("kv-rollbacks: fault {} not rolled back within 30 s", i + 1);
                }
                if !wait_for(Duration::from_secs(30), || answers(echo)) {
                    bail!("kv-rollbacks: no answer within 30 s after rollback {}", i + 1);
                }
                Ok(())
            })?;
        Ok(KvRollbacks {
            policy: policy.to_string(),
            faults,
            rollbacks: web.rollbacks(),
            kv_ops: kv.ops,
            kv_puts: kv.puts,
            kv_lost: kv.mismatches + kv.readback_mismatches,
            kv_unverified: kv.unverified,
            kv_digest_ok: kv.digest_ok,
            output_commit: None,
            faults_secs,
        })
    };
    with_kv_set("kvrb", &web_config(policy, cores), "rollback", faults, body, |s, r| KvRollbacks {
        output_commit: s.get("web").and_then(|w| w.output_commit()),
        ..r
    })
}

/// Acknowledged kv writes across many takeovers of a service with its
/// state region (issue 19: "zero acknowledged kv writes lost across 20
/// takeovers with the state region").
#[derive(Clone, Debug, Serialize)]
pub struct KvTakeovers {
    pub faults: u64,
    /// Takeovers recorded, and those that succeeded.
    pub takeovers: u64,
    pub takeovers_ok: u64,
    pub kv_ops: u64,
    pub kv_puts: u64,
    /// Wrong GETs during the load and wrong values read back after it.
    pub kv_lost: u64,
    pub kv_unverified: u64,
    /// PUTs whose connection broke before their ack (not acknowledged).
    pub kv_unacked_puts: u64,
    pub kv_digest_ok: Option<bool>,
    /// The state region's table: loads by a new holder, entries dropped as
    /// corrupt.
    pub table_loads: u64,
    pub table_dropped: u64,
    /// Per takeover, ms after its detection: the new holder's first reply.
    pub first_reply_ms: Vec<f64>,
    /// The ping client's longest silence around each fault, ms.
    pub ping_gap_ms: Vec<f64>,
    /// When each of those silences began, ms after its fault (the
    /// injection; negative: the last reply before it).
    pub ping_gap_start_ms: Vec<f64>,
    /// The pinger's own longest hold-up over the run, ms, and whether it
    /// ran real-time (`PingReport`).
    pub ping_client_stall_ms: f64,
    pub ping_client_realtime: bool,
    /// Per takeover, the longest host core stall ([`crate::stalls`])
    /// that overlaps its longest ping silence, ms.
    pub ping_gap_host_stall_ms: Vec<Option<f64>>,
    /// Host core stalls over 50 ms during the run (`None`: the probe did
    /// not run).
    pub host_stalls_over_50ms: Option<u64>,
    /// From the first fault to the takeover after the last, s.
    pub faults_secs: f64,
}

/// `faults` faults, each into the service's current holder, of the
/// `remote` set (kv with a 4 MiB state region, owner `web`, standby
/// `spare`) while kvload and a 1 ms ping run; each fault once the standby
/// is up again (its own restart after the last takeover recorded) and the
/// service answers a ping (bounded waits). Counts what kvload found lost.
pub fn kv_takeovers(faults: u64, cores: [usize; 2], stall_probe: bool) -> Result<KvTakeovers> {
    let echo: SocketAddr = format!("{SERVICE}:7").parse()?;
    let body = |s: &SandboxSet| -> Result<KvTakeovers> {
        let names: Vec<String> = s.sandboxes.iter().map(|b| b.config.name.clone()).collect();
        let service = || s.services.report(&names).remove(0);
        let mut faults_ms = Vec::new();
        let timeout = Duration::from_millis(500);
        let probe =
            crate::stalls::StallProbe::start_if(stall_probe, &nl_sandbox::affinity::host_cores()?);
        let (kv, faults_secs, ping) =
            faults_under_load(faults, 400, "kvto-", timeout, true, |i| {
                let r = service();
                let standby = s.get(&r.standby).expect("the standby");
                // The standby is up: its restart after the last takeover is
                // recorded, its new VM heartbeats and its next one is built.
                let ready = || {
                    standby.monitor.recovery_count() >= standby.monitor.detections().len()
                        && standby.vm().control().vcpus[0].snapshot().beats > 0
                        && standby.monitor.next_vm_ready()
                };
                if !wait_for(Duration::from_secs(120), ready) {
                    bail!("kv-takeovers: standby '{}' not ready within 120 s", r.standby);
                }
                // Writes acknowledged by this holder.
                std::thread::sleep(Duration::from_millis(300));
                if !wait_for(Duration::from_secs(30), || answers(echo)) {
                    bail!("kv-takeovers: no answer within 30 s before fault {}", i + 1);
                }
                faults_ms.push(unix_now_ms());
                nl_sandbox::trace(format_args!("bench: fault {} into {}", i + 1, r.holder));
                s.inject(&r.holder, &BAD_RIP)?;
                if !wait_for(Duration::from_secs(30), || service().takeovers.len() as u64 > i) {
                    bail!("kv-takeovers: fault {} not taken over within 30 s", i + 1);
                }
                Ok(())
            })?;
        let ping = ping.expect("the pinger ran");
        // The pinger stopped before this.
        let end_ms = unix_now_ms() - ping.start_unix_ms;
        let r = service();
        let header = s.services.services[0].state.as_ref().map(|st| st.header());
        let stalls = probe.finish();
        let silences = silences_per_fault(
            &ping.arrivals_ms,
            &faults_ms.iter().map(|f| f - ping.start_unix_ms).collect::<Vec<_>>(),
            end_ms,
        );
        Ok(KvTakeovers {
            faults,
            takeovers: r.takeovers.len() as u64,
            takeovers_ok: r.takeovers.iter().filter(|t| t.ok).count() as u64,
            kv_ops: kv.ops,
            kv_puts: kv.puts,
            kv_lost: kv.mismatches + kv.readback_mismatches,
            kv_unverified: kv.unverified,
            kv_unacked_puts: kv.unacked_puts,
            kv_digest_ok: kv.digest_ok,
            table_loads: header.as_ref().map_or(0, |h| h.loads),
            table_dropped: header.as_ref().map_or(0, |h| h.dropped),
            first_reply_ms: r.takeovers.iter().filter_map(|t| t.first_reply_ms).collect(),
            ping_gap_ms: silences.iter().map(|s| s.0).collect(),
            ping_gap_start_ms: silences.iter().map(|s| s.1).collect(),
            ping_client_stall_ms: ping.client_stall_ms,
            ping_client_realtime: ping.client_realtime,
            ping_gap_host_stall_ms: silences
                .iter()
                .zip(&faults_ms)
                .map(|(&(gap, start), &fault)| {
                    stalls.overlapping(fault + start, fault + start + gap).map(|st| st.ms)
                })
                .collect(),
            host_stalls_over_50ms: stalls
                .ran()
                .then(|| stalls.stalls().iter().filter(|st| st.ms > 50.0).count() as u64),
            faults_secs,
        })
    };
    with_kv_set("kvto", &web_config("remote", cores), "restart", faults, body, |_, r| r)
}

/// Per fault at `faults_ms` (sorted), the longest silence of `times_ms`
/// (sorted) from it on ([`gap_after`]) until the next fault (or `end_ms`).
pub fn gaps_per_fault(times_ms: &[f64], faults_ms: &[f64], end_ms: f64) -> Vec<f64> {
    silences_per_fault(times_ms, faults_ms, end_ms).into_iter().map(|(g, _)| g).collect()
}

/// [`gaps_per_fault`] with each silence's start (ms after its fault).
pub fn silences_per_fault(times_ms: &[f64], faults_ms: &[f64], end_ms: f64) -> Vec<(f64, f64)> {
    faults_ms
        .iter()
        .enumerate()
        .map(|(k, &at)| {
            let until = faults_ms.get(k + 1).copied().unwrap_or(end_ms);
            let upto = times_ms.partition_point(|&t| t < until);
            let (gap, start) = silence_after(&times_ms[..upto], at, until);
            (gap, start - at)
        })
        .collect()
}

/// `reps` runs of each of `policies`, in a namespace of their own, the
/// policies interleaved rep by rep (so the host's load falls on all alike).
pub fn measure(
    policies: &[&'static str],
    reps: usize,
    stall_probe: bool,
) -> Result<Vec<TimelinePolicy>> {
    let ns = Netns::with_tap(&format!("nl-fig6-{}", std::process::id()), "nltap0")?;
    let cores = super::sandbox_recovery::cores()?;
    let mut runs: Vec<Vec<TimelineRun>> = vec![Vec::new(); policies.len()];
    for rep in 0..reps {
        for (i, p) in policies.iter().enumerate() {
            let r = run_one(&ns, p, rep, cores, stall_probe)?;
            eprintln!(
                "fig6 {p:8} rep {}: ping gap {:.1} ms (pinger held up {:.1} ms at most{}), kv gap {:.1} ms, {} kv ops, {} lost",
                rep + 1,
                r.ping_gap_ms,
                r.ping_client_stall_ms,
                if stall_probe {
                    format!(
                        "; a host core stall over it: {:.1} ms",
                        r.ping_gap_host_stall_ms.unwrap_or(0.0)
                    )
                } else {
                    String::new()
                },
                r.kv_gap_ms,
                r.kv_ops,
                r.kv_lost
            );
            runs[i].push(r);
        }
    }
    Ok(policies
        .iter()
        .zip(runs)
        .map(|(policy, runs)| TimelinePolicy {
            policy,
            ping_gap_ms: Summary::of(&runs.iter().map(|r| r.ping_gap_ms).collect::<Vec<_>>()),
            kv_gap_ms: Summary::of(&runs.iter().map(|r| r.kv_gap_ms).collect::<Vec<_>>()),
            runs,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_count_events_per_ten_milliseconds() {
        assert_eq!(bins(&[0.0, 9.9, 10.0, 35.0, 40.0, -1.0, 99.0], 40.0), vec![2, 1, 0, 1]);
    }

    #[test]
    fn each_fault_gets_the_longest_silence_until_the_next_fault() {
        // Replies every 1 ms, but 5 ms of silence after the first fault
        // (at 10.2) and 20 ms after the second (at 40.2): the second's
        // longer silence is not the first's.
        let t: Vec<f64> = (0..100)
            .map(f64::from)
            .filter(|&x| !(11.0..16.0).contains(&x) && !(41.0..61.0).contains(&x))
            .collect();
        assert_eq!(gaps_per_fault(&t, &[10.2, 40.2], 100.0), vec![6.0, 21.0]);
        // No reply after the last fault: silent to the end.
        assert_eq!(gaps_per_fault(&t[..5], &[4.5], 10.0), vec![6.0]);
    }

    #[test]
    fn the_gap_is_the_longest_silence_from_the_fault_on() {
        // Replies go on for a while after the fault (detection), then stop.
        let t = [1.0, 2.0, 3.0, 11.0, 12.0, 60.0, 61.0];
        assert_eq!(gap_after(&t, 10.0, 100.0), 48.0);
        // No reply after the fault: the gap runs to the end.
        assert_eq!(gap_after(&t[..3], 10.0, 100.0), 97.0);
        // No reply before it: from the start.
        assert_eq!(gap_after(&t[5..], 10.0, 100.0), 60.0);
        // A silence before the fault does not count.
        assert_eq!(gap_after(&[0.0, 9.0, 10.5, 11.0], 10.0, 12.0), 1.5);
    }
}
