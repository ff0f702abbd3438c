//! `ninelives bench sandbox-recovery`: Quest-V's sandbox fault recovery
//! (`nl_sandbox::recovery`), measured on sandboxes of the reference guest.
//!
//! * **Service gap and Table 1**: for each local policy (`restart`,
//!   `replace`, `rollback`), `--reps` runs of three `chanstream` sandboxes
//!   (svc, p, q; channels svc-p and p-q, a message every 1 ms each way). A
//!   fault (an unmapped RIP: the guest's next instruction faults) is
//!   injected into svc. A host thread samples, every 200 µs, how far p has
//!   consumed svc's stream; the service gap is the longest interval without
//!   progress around the fault. The recovery's phases (detection, stop,
//!   notification of the peers, new image, re-entry, guest
//!   re-initialisation, first message) are timed by svc's monitor and shown
//!   beside the paper's cycles (Table 1). The healthy pair's errors and the
//!   progress it made during the recovery are reported.
//! * **Remote takeover** (row `remote`, `--reps` runs; needs root for its
//!   network namespace, else SKIPPED): a service `echo` (netbench on TAP
//!   `nltap0` in a namespace of the bench's own, 10.0.0.2) owned by
//!   sandbox `web` with standby `spare`, beside a healthy pair p, q on a
//!   channel. A client in the namespace pings the service every 1 ms; the
//!   fault (an unmapped RIP) goes into `web`, whose monitor hands the TAP
//!   to `spare` (`nl_sandbox::service`). The service gap is the client's
//!   gap around the fault: from the last reply before it to the first
//!   after. The takeover's phases (TAP handed over, attached, gratuitous
//!   ARP, first reply) are reported as `notified`, `reentry`,
//!   `guest_init` and `first_reply`.
//! * **Campaign**: `--injections` faults into svc of one long-lived set
//!   under `restart`: memory and register bit flips, violating writes and
//!   broken drivers (`nl_sandbox::faults`), each classified: recovered
//!   (detected, restarted, serving again), not manifested (no detection,
//!   serving, no bad message), contained (a broken driver's garbage was
//!   rejected by the peer's channel code, the service went on), service
//!   failed, another sandbox harmed, SDC (a wrong message accepted or a
//!   guest-detected error count without any detection). Wilson 95%
//!   intervals.
//! * **Fig. 10**: four sandboxes at the paper's rates (sandbox 0 sends every
//!   50 ms; the others drain every 100, 800 and 1,000 ms and answer every
//!   500 ms); sandbox 0 breaks its driver, makes a violating write and
//!   crashes; messages received per sandbox sampled every 10 ms
//!   (`--plot DIR`: fig10.svg; the series are in the JSON).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use clap::Args;
use nl_sandbox::faults::{self, GuestFault, Rng, SandboxFault};
use nl_sandbox::{SandboxSet, SetConfig};
use serde::Serialize;

use crate::figures::{time_chart, Series};
use crate::json_out::{print_json, with_provenance, RunClock};
use crate::stats::{wilson, Summary};

#[derive(Args, Clone, Debug)]
pub struct BenchSandboxRecoveryArgs {
    /// Runs per policy (at least 3).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// The service-gap rows to measure: local policies and `remote` (the
    /// takeover by a standby).
    #[arg(long, value_delimiter = ',', default_value = "restart,replace,rollback,remote")]
    pub policies: Vec<String>,
    /// Faults injected in the campaign (0: skip it).
    #[arg(long, default_value_t = 500)]
    pub injections: u64,
    /// Seed of the campaign's fault choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds of the Fig. 10 run (0: skip it).
    #[arg(long, default_value_t = 10.0)]
    pub fig10_secs: f64,
    /// Skip Fig. 6 (a kv service's ping and kv replies per 10 ms across a
    /// fault, `--reps` runs of each of `--policies`; needs root for its
    /// network namespace, else SKIPPED).
    #[arg(long)]
    pub no_fig6: bool,
    /// With Fig. 6 and `rollback`: faults, one after another, into a kv
    /// sandbox under rollback with output commit while kvload runs,
    /// counting acknowledged writes lost (0: skip it).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub kv_rollbacks: u64,
    /// With Fig. 6 and `remote`: faults, each into the current holder of a
    /// kv service with its state region while kvload runs, counting
    /// acknowledged writes lost across the takeovers (0: skip it).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub kv_takeovers: u64,
    /// The `rollback` row: svc's checkpoint interval (ms, 5..=10000).
    /// Its channel output is held until released (output commit), so the
    /// stream p sees advances at most once per interval.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(5..=10_000))]
    pub rollback_interval_ms: u64,
    /// The `rollback` row: svc's `recovery.release` (`next_checkpoint` or
    /// `detection_latency`, which holds its channel output about
    /// `detect.heartbeat_cpu_ms`, 1 s, of guest time).
    #[arg(long, default_value = "next_checkpoint", value_parser = ["next_checkpoint", "detection_latency"])]
    pub rollback_release: String,
    /// Run the host core stall probe (`nl_lab::stalls`: one real-time
    /// thread per core, waking every 1 ms) beside the policy rows, Fig. 6
    /// and the takeovers, and report the stalls over each long gap. Off by
    /// default: its wake-ups change what it measures.
    #[arg(long)]
    pub stall_probe: bool,
    /// Write fig6.svg and fig10.svg into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// An unmapped RIP: the guest's next instruction faults (#PF, ring 3).
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

pub(super) fn images() -> nl_sandbox::Images {
    nl_launch::guest::sandbox_images()
}

pub(super) fn cores() -> Result<[usize; 2]> {
    let c = nl_sandbox::affinity::host_cores()?;
    Ok([c[0], *c.last().ok_or_else(|| anyhow!("no host core"))?])
}

fn create(text: &str) -> Result<SandboxSet> {
    let kvm = nl_vmm::open_kvm()?;
    Ok(SandboxSet::create(&kvm, SetConfig::parse(text)?, &images())?)
}

/// svc, p, q: chanstream, channels sp (svc end 0) and pq.
fn trio(svc_extra: &str) -> Result<String> {
    let [c0, c1] = cores()?;
    let w = r#""workload": {"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}"#;
    Ok(format!(
        r#"{{"sandboxes": [
            {{"name": "svc", "cores": [{c0}], "mem_mib": 48, {svc_extra} {w}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, {w}}},
            {{"name": "q", "cores": [{c0}], "mem_mib": 48, {w}}}
        ], "channels": [{{"name": "sp", "between": ["svc", "p"]}}, {{"name": "pq", "between": ["p", "q"]}}]}}"#
    ))
}

/// How far p consumed svc's stream: (svc's generation as p acknowledged
/// it, words).
fn service_mark(s: &SandboxSet) -> (u64, u64) {
    let h = s.channels[0].header(1);
    (h.ack_generation, h.ack_words)
}

/// Words both ends of the healthy channel pq consumed.
fn healthy_mark(s: &SandboxSet) -> u64 {
    let h = s.channels[1].stats(&[]);
    h.regions[0].ack_words + h.regions[1].ack_words
}

pub(super) fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

fn regs(s: &SandboxSet, name: &str) -> nl_devices::control::VcpuRegsSnapshot {
    s.get(name).map(|sb| sb.vm().control().vcpus[0].snapshot()).unwrap_or_default()
}

/// Runs `body` while the set is supervised, then stops it.
pub(super) fn supervised<T>(s: &SandboxSet, body: impl FnOnce(&SandboxSet) -> T) -> Result<T> {
    supervised_for(s, Duration::from_secs(600), body)
}

/// [`supervised`] with the supervision's limit: past it the monitors stop
/// their sandboxes.
fn supervised_for<T>(
    s: &SandboxSet,
    limit: Duration,
    body: impl FnOnce(&SandboxSet) -> T,
) -> Result<T> {
    s.start_all()?;
    let r = std::thread::scope(|scope| {
        let h = scope.spawn(|| s.supervise(limit));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(s)));
        s.request_stop();
        let _ = h.join();
        r
    });
    r.map_err(|_| anyhow!("the measurement panicked"))
}

/// One policy run.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyRun {
    pub recovered: bool,
    /// Longest interval without progress of svc's service (p consuming its
    /// stream), from 100 ms before the fault to 300 ms after recovery.
    pub service_gap_ms: f64,
    /// When that interval began, in ms after the injection (negative:
    /// before it); `None` for the remote row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_gap_start_ms: Option<f64>,
    /// The longest interval without progress from 100 ms before the fault
    /// to 500 ms after it: the recovery's own gap, without later stalls of
    /// a noisy host; `None` for the remote row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap_around_fault_ms: Option<f64>,
    /// From the injection to the detection (rollback: the supervisor
    /// injects at its next step, within a few ms).
    pub detection_ms: f64,
    pub detector: String,
    pub phases: nl_sandbox::recovery::Phases,
    /// The healthy pair consumed this many words while svc recovered
    /// (detection to recovery).
    pub healthy_progress_words: u64,
    /// Corrupt, lost, duplicated or rejected messages counted by p and q
    /// (p's include what it rejected of svc's stream).
    pub p_errors: u64,
    pub q_errors: u64,
    /// How much of the longest gap host core stalls covered (`nl_lab::stalls`,
    /// summed over both cores), ms; `None` for the remote row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_gap_host_stalls_ms: Option<f64>,
}

/// What the sampler saw around one fault.
struct Window {
    samples: Vec<(f64, (u64, u64))>,
    inject_ms: f64,
    healthy_progress_words: u64,
    recovered: bool,
}

/// The longest interval between changes of the samples' mark.
fn longest_gap(samples: &[(f64, (u64, u64))]) -> f64 {
    longest_gap_at(samples).0
}

/// [`longest_gap`] and the time its interval began.
fn longest_gap_at(samples: &[(f64, (u64, u64))]) -> (f64, f64) {
    let mut gap: (f64, f64) = (0.0, 0.0);
    let mut last = samples.first().map_or(0.0, |x| x.0);
    for w in samples.windows(2) {
        if w[1].1 != w[0].1 {
            if w[1].0 - last > gap.0 {
                gap = (w[1].0 - last, last);
            }
            last = w[1].0;
        }
    }
    match samples.last() {
        Some(end) if end.0 - last > gap.0 => (end.0 - last, last),
        _ => gap,
    }
}

fn policy_run(policy: &str, a: &BenchSandboxRecoveryArgs) -> Result<PolicyRun> {
    let extra = match policy {
        "rollback" => format!(
            r#""recovery": {{"policy": "rollback", "checkpoint_interval_ms": {}, "release": "{}"}},"#,
            a.rollback_interval_ms, a.rollback_release
        ),
        "replace" => r#""recovery": {"policy": "replace", "replace_with": {"kind": "chanstream", "duration_ms": 0, "send_every_us": 500}},"#.to_string(),
        p => format!(r#""recovery": {{"policy": "{p}"}},"#),
    };
    let s = create(&trio(&extra)?)?;
    let probe = crate::stalls::StallProbe::start_if(a.stall_probe, &cores()?);
    let (w, p_errors, q_errors) = supervised(&s, |s| -> Result<(Window, u64, u64)> {
        let svc = s.get("svc").expect("svc");
        if !wait_for(Duration::from_secs(60), || service_mark(s).1 > 1000 && healthy_mark(s) > 1000)
        {
            bail!("the sandboxes did not start streaming within 60 s");
        }
        // Steady state: the VM of svc's restart built ahead (a long-lived
        // service has it; in the first seconds after a start a restart
        // builds its own, see nl_sandbox::prepare). Bounded: 120 s.
        if policy != "rollback" {
            wait_for(Duration::from_secs(120), || svc.monitor.next_vm_ready());
        }
        let stop = AtomicBool::new(false);
        let w = std::thread::scope(|scope| -> Result<Window> {
            let sampler = scope.spawn(|| {
                let mut v = Vec::new();
                while !stop.load(Ordering::Relaxed) && v.len() < 2_000_000 {
                    v.push((s.elapsed_ms(), service_mark(s)));
                    std::thread::sleep(Duration::from_micros(200));
                }
                v
            });
            // Once streaming (a rollback sandbox too: its supervisor takes
            // the fault at its next step; a fault scripted at a fixed time
            // could hit it while it still booted, and the window then
            // measured its boot).
            std::thread::sleep(Duration::from_millis(200));
            let t = s.elapsed_ms();
            let injected = s.inject("svc", &BAD_RIP).map(|_| t);
            // A rollback sandbox's detections are reported when its
            // supervised run ends: its rollback count shows it, then the
            // service is watched for 3 s.
            let rollback = policy == "rollback";
            let detected = injected.is_ok()
                && wait_for(Duration::from_secs(30), || {
                    if rollback {
                        svc.rollbacks() >= 1
                    } else {
                        !svc.monitor.detections().is_empty()
                    }
                });
            let h0 = healthy_mark(s);
            let recovered = detected
                && (rollback
                    || wait_for(Duration::from_secs(30), || svc.monitor.recovery_count() >= 1));
            if rollback {
                let until = t + 3000.0;
                wait_for(Duration::from_secs(30), || s.elapsed_ms() >= until);
            }
            let h1 = healthy_mark(s);
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::Relaxed);
            let samples = sampler.join().map_err(|_| anyhow!("the sampler panicked"))?;
            let inject_ms = injected?;
            let samples = samples.into_iter().filter(|(t, _)| *t >= inject_ms - 100.0).collect();
            Ok(Window {
                samples,
                inject_ms,
                healthy_progress_words: h1.saturating_sub(h0),
                recovered,
            })
        })?;
        Ok((w, regs(s, "p").digest, regs(s, "q").digest))
    })??;
    let stalls = probe.finish();
    // The set's clock on the Unix clock.
    let to_unix = unix_now_ms() - s.elapsed_ms();
    let (gap, gap_start) = longest_gap_at(&w.samples);
    // Read after supervision ended (a rollback sandbox reports then).
    let svc = s.get("svc").expect("svc");
    let det = svc.monitor.detections();
    let rec = svc.monitor.recoveries();
    Ok(PolicyRun {
        recovered: w.recovered && rec.first().is_some_and(|r| r.ok),
        service_gap_host_stalls_ms: stalls
            .ran()
            .then(|| stalls.covering(to_unix + gap_start, to_unix + gap_start + gap)),
        service_gap_ms: gap,
        service_gap_start_ms: Some(gap_start - w.inject_ms),
        gap_around_fault_ms: Some(longest_gap(
            &w.samples
                .iter()
                .filter(|(t, _)| *t <= w.inject_ms + 500.0)
                .copied()
                .collect::<Vec<_>>(),
        )),
        detection_ms: det.first().map_or(f64::NAN, |d| d.at_ms - w.inject_ms),
        detector: det.first().map_or(String::new(), |d| d.detector.name().to_string()),
        phases: rec.first().map(|r| r.phases.clone()).unwrap_or_default(),
        healthy_progress_words: w.healthy_progress_words,
        p_errors,
        q_errors,
    })
}

/// svc=web (owner of service echo), spare (its standby), p, q.
fn remote_config() -> Result<String> {
    let [c0, c1] = cores()?;
    let net = r#""net": {"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"}"#;
    let w = r#""workload": {"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}"#;
    Ok(format!(
        r#"{{"sandboxes": [
            {{"name": "web", "cores": [{c0}], "workload": {{"kind": "netbench", "duration_ms": 0}}, {net},
              "recovery": {{"policy": "restart"}}}},
            {{"name": "spare", "cores": [{c1}], "workload": {{"kind": "netbench", "duration_ms": 0}},
              "recovery": {{"policy": "restart"}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, {w}}},
            {{"name": "q", "cores": [{c0}], "mem_mib": 48, {w}}}
        ], "channels": [{{"name": "pq", "between": ["p", "q"]}}],
        "services": [{{"name": "echo", "owner": "web", "standby": "spare"}}]}}"#
    ))
}

/// Words both ends of the remote set's healthy channel pq (its only one)
/// consumed.
fn remote_healthy_mark(s: &SandboxSet) -> u64 {
    let h = s.channels[0].stats(&[]);
    h.regions[0].ack_words + h.regions[1].ack_words
}

/// A short ping of the service: whether it answered.
fn answers(to: std::net::SocketAddr) -> bool {
    crate::ping::ping(to, Duration::from_millis(10), Duration::from_millis(100), None)
        .is_ok_and(|p| p.received > 0)
}

/// One remote takeover (see the module documentation), in namespace `ns`.
fn remote_run(ns: &crate::netns::Netns) -> Result<PolicyRun> {
    let config = SetConfig::parse(&remote_config()?)?;
    let to: std::net::SocketAddr = "10.0.0.2:7".parse()?;
    ns.run_in(|| {
        let kvm = nl_vmm::open_kvm()?;
        let s = SandboxSet::create(&kvm, config, &images())?;
        supervised(&s, |s| -> Result<PolicyRun> {
            if !wait_for(Duration::from_secs(90), || answers(to)) {
                bail!("the service never answered its first ping");
            }
            if !wait_for(Duration::from_secs(60), || remote_healthy_mark(s) > 1000) {
                bail!("p and q did not start streaming within 60 s");
            }
            let stop = AtomicBool::new(false);
            let names: Vec<String> = s.sandboxes.iter().map(|b| b.config.name.clone()).collect();
            let takeover = || s.services.report(&names).remove(0).takeovers.into_iter().next();
            let (report, (inject_unix_ms, inject_set_ms), h) =
                std::thread::scope(|scope| -> Result<_> {
                    let client = scope.spawn(|| {
                        crate::ping::ping(
                            to,
                            Duration::from_millis(1),
                            Duration::from_secs(300),
                            Some(&stop),
                        )
                    });
                    std::thread::sleep(Duration::from_millis(500));
                    let at = (unix_now_ms(), s.elapsed_ms());
                    let injected = s.inject("web", &BAD_RIP);
                    let h0 = remote_healthy_mark(s);
                    let done = injected.is_ok()
                        && wait_for(Duration::from_secs(60), || {
                            takeover().is_some_and(|t| t.first_reply_ms.is_some())
                        });
                    let h1 = remote_healthy_mark(s);
                    std::thread::sleep(Duration::from_millis(500));
                    stop.store(true, Ordering::Relaxed);
                    let report = client.join().map_err(|_| anyhow!("the client panicked"))??;
                    injected?;
                    if !done {
                        bail!("no takeover with a first reply within 60 s");
                    }
                    Ok((report, at, h1.saturating_sub(h0)))
                })?;
            // The gap around the fault: from the last reply before it to
            // the first reply after it.
            let fault_ms = inject_unix_ms - report.start_unix_ms;
            let gap = report
                .long_gaps
                .iter()
                .find(|g| g.start_ms <= fault_ms + 1.0 && g.start_ms + g.ms >= fault_ms)
                .map_or(0.0, |g| g.ms);
            let t = takeover().ok_or_else(|| anyhow!("no takeover recorded"))?;
            let web = s.get("web").expect("web");
            let det = web.monitor.detections();
            Ok(PolicyRun {
                recovered: t.ok && report.last_reply_ms.is_some_and(|l| l > fault_ms + gap),
                service_gap_ms: gap,
                service_gap_start_ms: None,
                gap_around_fault_ms: None,
                service_gap_host_stalls_ms: None,
                detection_ms: det.first().map_or(f64::NAN, |d| d.at_ms - inject_set_ms),
                detector: t.detector.clone(),
                phases: nl_sandbox::recovery::Phases {
                    notified_ms: t.notified_ms,
                    reentry_ms: t.attached_ms,
                    guest_init_ms: t.announced_ms,
                    first_reply_ms: t.first_reply_ms,
                    ..Default::default()
                },
                healthy_progress_words: h,
                p_errors: regs(s, "p").digest,
                q_errors: regs(s, "q").digest,
            })
        })?
    })
}

pub(super) fn unix_now_ms() -> f64 {
    crate::ping::unix_ms(std::time::SystemTime::now())
}

/// The per-policy summaries of `runs`.
fn policy_result(policy: &'static str, runs: Vec<PolicyRun>) -> PolicyResult {
    let sum = |f: &dyn Fn(&PolicyRun) -> Option<f64>| {
        Summary::of(&runs.iter().map(|r| f(r).unwrap_or(f64::NAN)).collect::<Vec<_>>())
    };
    let phases_ms = vec![
        ("stopped".to_string(), sum(&|r| r.phases.stopped_ms)),
        ("notified".to_string(), sum(&|r| r.phases.notified_ms)),
        ("image".to_string(), sum(&|r| r.phases.image_ms)),
        ("reentry".to_string(), sum(&|r| r.phases.reentry_ms)),
        ("guest_init".to_string(), sum(&|r| r.phases.guest_init_ms)),
        ("first_reply".to_string(), sum(&|r| r.phases.first_reply_ms)),
    ];
    PolicyResult {
        policy,
        service_gap_ms: sum(&|r| Some(r.service_gap_ms)),
        gap_around_fault_ms: sum(&|r| r.gap_around_fault_ms),
        detection_ms: sum(&|r| Some(r.detection_ms)),
        phases_ms,
        runs,
    }
}

/// Per policy: the runs and their summaries.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub policy: &'static str,
    pub runs: Vec<PolicyRun>,
    pub service_gap_ms: Summary,
    /// [`PolicyRun::gap_around_fault_ms`] (NaN for the remote row).
    pub gap_around_fault_ms: Summary,
    pub detection_ms: Summary,
    /// Phase end times after the detection (ms), per phase.
    pub phases_ms: Vec<(String, Summary)>,
}

/// The paper's Table 1 (local recovery, CPU cycles), beside our phases.
pub const PAPER_TABLE1: [(&str, &str, Option<f64>); 6] = [
    ("detection", "VM-Exit", Some(885.0)),
    ("stop + new image", "Driver Replacement", Some(10503.0)),
    ("notification", "IPI Round Trip (remote only)", None),
    ("re-entry", "VM-Enter", Some(663.0)),
    ("guest re-initialisation", "Driver Re-initialization", Some(1.45e7)),
    ("first message", "Network I/F Restart", Some(78351.0)),
];

/// One injection of the campaign.
#[derive(Clone, Debug, Serialize)]
pub struct Injection {
    pub fault: SandboxFault,
    pub outcome: &'static str,
    pub detector: Option<String>,
    pub detail: Option<String>,
    /// The restart took the VM built ahead (`None`: no restart).
    pub image_prepared: Option<bool>,
    /// How long before this injection the campaign waited for svc's next
    /// restart VM to be built (steady state), ms.
    pub ready_wait_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Campaign {
    pub injections: u64,
    pub counts: Vec<(&'static str, u64)>,
    /// recovered + not manifested + contained, of all injections.
    pub service_ok: u64,
    pub service_ok_rate: f64,
    pub service_ok_ci95: (f64, f64),
    /// recovered of the detected faults.
    pub detected: u64,
    pub recovered: u64,
    pub recovered_rate: f64,
    pub recovered_ci95: (f64, f64),
    pub others_harmed: u64,
    pub others_harmed_ci95: (f64, f64),
    pub per_kind: Vec<(&'static str, u64, u64)>,
    /// Restarts that took the VM built ahead, of all restarts.
    pub restarts_prepared: (u64, u64),
    /// Injections made without svc's next restart VM ready (its builder
    /// did not finish within the bounded wait).
    pub injected_unready: u64,
    pub runs: Vec<Injection>,
}

/// `skipped`: the host did not run svc and p enough to tell whether svc
/// served (not counted in the rates).
const OUTCOMES: [&str; 7] = [
    "recovered",
    "not_manifested",
    "contained",
    "service_failed",
    "other_harmed",
    "sdc",
    "skipped",
];

/// What svc's VM is doing (a failed service's evidence): its outcome, its
/// phase, heartbeats and error report.
fn svc_state(s: &SandboxSet) -> String {
    let Some(sb) = s.get("svc") else { return "no svc".into() };
    let r = regs(s, "svc");
    format!(
        "svc: outcome {:?}, phase {}, beats {}, error {:#x} at {:#x}; monitor {:?}",
        sb.vm().poll_outcome(),
        r.phase,
        r.beats,
        r.error,
        r.error_info,
        sb.monitor.doing()
    )
}

/// Whether svc serves (p consumes its stream again), judged on the CPU
/// time svc and p got, not on wall time alone.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Serving {
    Yes,
    /// No new word while svc and p each ran at least the CPU bound.
    No,
    /// Neither: within the wall limit the host did not run svc and p
    /// enough to tell (a starved host, not a failed service).
    Starved,
}

/// Waits for svc to serve: `Yes` as soon as p's acknowledgement of svc's
/// stream moves; `No` once svc and p each ran `cpu` of guest time without
/// it moving; `Starved` when `wall` passes first.
fn serving_within(s: &SandboxSet, wall: Duration, cpu: Duration) -> Serving {
    use nl_vmm::progress::GuestClock;
    let m = service_mark(s);
    let vms = || ["svc", "p"].map(|n| s.get(n).expect("sandbox").vm());
    let mut clocks = vms().map(|vm| GuestClock::new(vm.vcpu_threads().len()));
    let start: Vec<u64> =
        vms().iter().zip(&mut clocks).map(|(vm, c)| c.update(&vm.vcpu_threads())[0]).collect();
    let t = Instant::now();
    loop {
        if service_mark(s) != m {
            return Serving::Yes;
        }
        let ran = vms()
            .iter()
            .zip(&mut clocks)
            .zip(&start)
            .map(|((vm, c), s0)| c.update(&vm.vcpu_threads())[0].saturating_sub(*s0))
            .min()
            .unwrap_or(0);
        if ran >= cpu.as_nanos() as u64 {
            return Serving::No;
        }
        if t.elapsed() > wall {
            return Serving::Starved;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn campaign(n: u64, seed: u64) -> Result<Campaign> {
    let extra = r#""recovery": {"policy": "restart", "max_recoveries": 50, "window_ms": 1000}, "detect": {"heartbeat_cpu_ms": 200, "output_stall_cpu_ms": 100},"#;
    let s = create(&trio(extra)?)?;
    // About 1.5 s per injection: the set's supervision must outlast them
    // all (past its limit the monitors stop svc, which would end the
    // campaign as if svc had failed for good).
    let limit = Duration::from_secs(600 + 10 * n);
    supervised_for(&s, limit, |s| -> Result<Campaign> {
        let svc = s.get("svc").expect("svc");
        if !wait_for(Duration::from_secs(60), || service_mark(s).1 > 1000 && healthy_mark(s) > 1000)
        {
            bail!("the sandboxes did not start streaming within 60 s");
        }
        let mut rng = Rng::new(seed);
        let mut runs = Vec::new();
        let mut unready = 0;
        let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        for i in 0..n {
            if progress && i % 50 == 0 {
                eprintln!("campaign: {i}/{n}");
            }
            // Steady state, as in the policy rows: svc's next restart VM is
            // built before the fault (bounded: a builder starved by the host
            // is counted, not waited for without end).
            let t_ready = Instant::now();
            let ready = wait_for(Duration::from_secs(60), || svc.monitor.next_vm_ready());
            let ready_wait_ms = t_ready.elapsed().as_secs_f64() * 1e3;
            let fault = faults::pick(s, "svc", &mut rng)?;
            let (d0, r0) = (svc.monitor.detections().len(), svc.monitor.recoveries().len());
            let (p0, q0) = (regs(s, "p").digest, regs(s, "q").digest);
            let svc_err0 = regs(s, "svc").digest;
            let pq0 = healthy_mark(s);
            let others_det0 = s.get("p").expect("p").monitor.detections().len()
                + s.get("q").expect("q").monitor.detections().len();
            let gen0 = s.channels[0].header(0).generation;
            faults::apply(s, "svc", &fault)?;
            let detected =
                wait_for(Duration::from_millis(800), || svc.monitor.detections().len() > d0);
            let mut detector = None;
            let mut detail = None;
            let outcome = if detected {
                let d = &svc.monitor.detections()[d0];
                detector = Some(d.detector.name().to_string());
                detail = Some(d.detail.clone());
                let back =
                    wait_for(Duration::from_secs(20), || svc.monitor.recoveries().len() > r0);
                let rec = svc.monitor.recoveries();
                let ok =
                    back && rec.get(r0).is_some_and(|r| r.ok && r.phases.first_reply_ms.is_some());
                let serving = if ok {
                    serving_within(s, Duration::from_secs(60), Duration::from_millis(500))
                } else {
                    Serving::No
                };
                if serving == Serving::Yes {
                    "recovered"
                } else if serving == Serving::Starved {
                    "skipped"
                } else {
                    let d = detail.take().unwrap_or_default();
                    detail = Some(format!("{d}; then {}", svc_state(s)));
                    "service_failed"
                }
            } else {
                let serving =
                    serving_within(s, Duration::from_secs(60), Duration::from_millis(500));
                if serving == Serving::Starved {
                    detail = Some(format!("host starved; {}", svc_state(s)));
                }
                let starved = serving == Serving::Starved;
                let serving = serving == Serving::Yes && s.channels[0].header(0).generation == gen0;
                let p_bad = regs(s, "p").digest > p0;
                let svc_bad = regs(s, "svc").digest > svc_err0;
                match (&fault, serving, p_bad || svc_bad) {
                    _ if starved => "skipped",
                    (_, false, _) => {
                        detail = Some(format!("undetected; {}", svc_state(s)));
                        "service_failed"
                    }
                    (SandboxFault::BrokenDriver { .. }, true, _) => "contained",
                    (_, true, true) => "sdc",
                    (_, true, false) => "not_manifested",
                }
            };
            // Harm to the others: a detection in p or q, an error between
            // them, or no progress on their channel.
            let moved = wait_for(Duration::from_secs(5), || healthy_mark(s) > pq0);
            let others_det = s.get("p").expect("p").monitor.detections().len()
                + s.get("q").expect("q").monitor.detections().len();
            let harmed = !moved || others_det > others_det0 || regs(s, "q").digest > q0;
            let outcome = if harmed { "other_harmed" } else { outcome };
            let image_prepared = svc.monitor.recoveries().get(r0).map(|r| r.phases.image_prepared);
            runs.push(Injection {
                fault,
                outcome,
                detector,
                detail,
                image_prepared,
                ready_wait_ms,
            });
            unready += u64::from(!ready);
            // The next fault goes into a serving sandbox; a service gone for
            // good ends the campaign (the rest cannot be measured), and so
            // does a host that does not run the set for minutes.
            if svc.monitor.gave_up_reason().is_some()
                || serving_within(s, Duration::from_secs(300), Duration::from_secs(2))
                    != Serving::Yes
            {
                break;
            }
        }
        let count = |o: &str| runs.iter().filter(|r| r.outcome == o).count() as u64;
        // Skipped runs (a starved host) are in `counts` and `runs` only.
        let total = runs.len() as u64 - count("skipped");
        let service_ok = count("recovered") + count("not_manifested") + count("contained");
        let detected =
            runs.iter().filter(|r| r.detector.is_some() && r.outcome != "skipped").count() as u64;
        let recovered = count("recovered");
        let kinds = ["memory-flip", "register-flip", "violating-write", "broken-driver"];
        let per_kind = kinds
            .iter()
            .map(|k| {
                let of: Vec<_> = runs
                    .iter()
                    .filter(|r| r.fault.name() == *k && r.outcome != "skipped")
                    .collect();
                let ok = of
                    .iter()
                    .filter(|r| matches!(r.outcome, "recovered" | "not_manifested" | "contained"))
                    .count() as u64;
                (*k, of.len() as u64, ok)
            })
            .collect();
        let harmed = count("other_harmed");
        Ok(Campaign {
            injections: total,
            counts: OUTCOMES.iter().map(|o| (*o, count(o))).collect(),
            service_ok,
            service_ok_rate: service_ok as f64 / total.max(1) as f64,
            service_ok_ci95: wilson(service_ok, total),
            detected,
            recovered,
            recovered_rate: recovered as f64 / detected.max(1) as f64,
            recovered_ci95: wilson(recovered, detected),
            others_harmed: harmed,
            others_harmed_ci95: wilson(harmed, total),
            per_kind,
            restarts_prepared: (
                runs.iter().filter(|r| r.image_prepared == Some(true)).count() as u64,
                runs.iter().filter(|r| r.image_prepared.is_some()).count() as u64,
            ),
            injected_unready: unready,
            runs,
        })
    })?
}

/// Fig. 10: messages received per sandbox over time.
#[derive(Clone, Debug, Serialize)]
pub struct Fig10 {
    /// (time s, messages received) per sandbox, every 10 ms.
    pub series: Vec<(String, Vec<(f64, u64)>)>,
    /// (time s, what) injected into sandbox 0.
    pub events: Vec<(f64, String)>,
    /// Errors counted by s1..s3 (corrupt, lost or duplicated messages, and
    /// records their channel code rejected: s0's broken driver's garbage
    /// lands here, rejected, not accepted) and their detections (none).
    pub healthy_errors: Vec<(String, u64)>,
    pub healthy_detections: usize,
    /// Stray writes sandbox 0 made to read-only pages, all trapped.
    pub violations_trapped: u64,
    pub s0_recoveries: usize,
    /// Sandbox 0 sent messages again after its last recovery.
    pub s0_serving_again: bool,
}

fn fig10(secs: f64) -> Result<Fig10> {
    let [c0, c1] = cores()?;
    let rx = |name: &str, core: usize, recv_us: u64| {
        format!(
            r#"{{"name": "{name}", "cores": [{core}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 500000, "recv_every_us": {recv_us}}}}}"#
        )
    };
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "s0", "cores": [{c0}], "mem_mib": 48, "recovery": {{"policy": "restart"}},
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 50000}}}},
            {}, {}, {}
        ], "channels": [{{"name": "c1", "between": ["s0", "s1"]}}, {{"name": "c2", "between": ["s0", "s2"]}}, {{"name": "c3", "between": ["s0", "s3"]}}]}}"#,
        rx("s1", c1, 100_000),
        rx("s2", c1, 800_000),
        rx("s3", c0, 1_000_000)
    );
    let s = create(&text)?;
    supervised(&s, |s| -> Result<Fig10> {
        let names = ["s0", "s1", "s2", "s3"];
        let mut series: Vec<(String, Vec<(f64, u64)>)> =
            names.iter().map(|n| (n.to_string(), Vec::new())).collect();
        let mut events = Vec::new();
        let plan: [(f64, SandboxFault); 3] = [
            (0.3, SandboxFault::BrokenDriver { channel: 0, offset: 0, bytes: 1 << 20, seed: 7 }),
            (0.5, SandboxFault::ViolatingWrite { channel: 1, offset: 4096 }),
            (0.75, SandboxFault::Guest { fault: BAD_RIP }),
        ];
        let t0 = Instant::now();
        let mut next = 0;
        let steps = (secs * 100.0) as usize;
        for step in 0..steps {
            let t = t0.elapsed().as_secs_f64();
            if next < plan.len() && t >= plan[next].0 * secs {
                faults::apply(s, "s0", &plan[next].1)?;
                events.push((t, plan[next].1.name().to_string()));
                next += 1;
            }
            for (i, n) in names.iter().enumerate() {
                series[i].1.push((t, regs(s, n).ops));
            }
            let due = t0 + Duration::from_millis(10 * (step as u64 + 1));
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let s0 = s.get("s0").expect("s0");
        let m = s.channels[0].header(0).head_words;
        let serving = wait_for(Duration::from_secs(5), || s.channels[0].header(0).head_words != m);
        let healthy_errors: Vec<_> =
            names[1..].iter().map(|n| (n.to_string(), regs(s, n).digest)).collect();
        let healthy_detections =
            names[1..].iter().map(|n| s.get(n).expect("sb").monitor.detections().len()).sum();
        Ok(Fig10 {
            series,
            events,
            healthy_errors,
            healthy_detections,
            violations_trapped: s0.monitor.violations(),
            s0_recoveries: s0.monitor.recovery_count(),
            s0_serving_again: serving,
        })
    })?
}

#[derive(Serialize)]
struct Out {
    /// restart, replace, rollback, and remote (the takeover by a standby).
    policies: Vec<PolicyResult>,
    /// Why the remote row is missing (no network namespace).
    remote_skipped: Option<String>,
    table1_paper: Vec<(String, String, Option<f64>)>,
    tsc_khz: u64,
    campaign: Option<Campaign>,
    /// Fig. 6: per policy, the service's replies per 10 ms across a fault.
    fig6: Option<Vec<crate::bench::sandbox_service_timeline::TimelinePolicy>>,
    fig6_skipped: Option<String>,
    /// A kv sandbox under rollback with output commit across
    /// `--kv-rollbacks` faults, per release rule (`rollback`: the default,
    /// `rollback-nextcheckpoint`).
    kv_rollbacks: Vec<crate::bench::sandbox_service_timeline::KvRollbacks>,
    kv_rollbacks_error: Option<String>,
    /// The `remote` service with its state region across `--kv-takeovers`
    /// faults.
    kv_takeovers: Option<crate::bench::sandbox_service_timeline::KvTakeovers>,
    kv_takeovers_error: Option<String>,
    fig10: Option<Fig10>,
}

fn tsc_khz() -> u64 {
    let kvm = match nl_vmm::open_kvm() {
        Ok(k) => k,
        Err(_) => return 0,
    };
    let cfg = nl_vmm::VmConfig {
        mem_bytes: 48 << 20,
        vcpus: 1,
        workload: nl_abi::WorkloadParams { kind: nl_abi::WORKLOAD_IDLE, ..Default::default() },
        kernel: images().kernel,
        user: images().user,
        console_path: None,
        timer_hz: 100,
        heartbeat_timeout: Duration::from_secs(5),
        disk: None,
        net: None,
    };
    nl_vmm::Vm::create(&kvm, 0, cfg)
        .ok()
        .and_then(|vm| nl_arch::read_boot_info(vm.memory().mem()).ok())
        .map_or(0, |b| b.tsc_khz)
}

/// The issue's bounds on the longest ping gap (ms): `rollback` 20, the
/// others 50 (the paper: back in under 0.5 s).
fn fig6_bound_ms(policy: &str) -> f64 {
    if policy.starts_with("rollback") {
        20.0
    } else {
        50.0
    }
}

/// Fig. 6 (see `sandbox_service_timeline`): measured, printed and plotted.
#[allow(clippy::type_complexity)]
fn fig6(
    a: &BenchSandboxRecoveryArgs,
) -> Result<(Option<Vec<crate::bench::sandbox_service_timeline::TimelinePolicy>>, Option<String>)> {
    use crate::bench::sandbox_service_timeline::{measure, BIN_MS};
    if a.no_fig6 {
        return Ok((None, None));
    }
    if let Some(why) = crate::netns::unavailable() {
        let why = format!("SKIPPED: no network namespace for the service's TAP ({why})");
        println!("Fig. 6  : {why}");
        return Ok((None, Some(why)));
    }
    // `rollback` (with output commit) comes with `rollback-nocommit` and
    // `rollback-nextcheckpoint` (output released at its checkpoint),
    // measured in the same run for comparison.
    let policies: Vec<&'static str> = [
        "restart",
        "replace",
        "rollback",
        "rollback-nocommit",
        "rollback-nextcheckpoint",
        "remote",
    ]
    .into_iter()
    .filter(|p| a.policies.iter().any(|x| p.split('-').next() == Some(x.as_str())))
    .collect();
    let f = measure(&policies, a.reps, a.stall_probe)?;
    println!(
        "Fig. 6 (kv service, ping every 1 ms + kvload; {} runs each; bound: rollback < 20 ms, others < 50 ms; paper < 500 ms):",
        a.reps
    );
    for p in &f {
        let met = p.runs.iter().filter(|r| r.ping_gap_ms < fig6_bound_ms(p.policy)).count();
        println!(
            "  {:8} ping gap {} ms (under the bound in {met}/{}), kv gap {} ms; serving again {}/{}; kv acknowledged writes lost {:?}",
            p.policy,
            p.ping_gap_ms.show(1),
            p.runs.len(),
            p.kv_gap_ms.show(1),
            p.runs.iter().filter(|r| r.serving_again).count(),
            p.runs.len(),
            p.runs.iter().map(|r| r.kv_lost).collect::<Vec<_>>(),
        );
        let oc: Vec<_> = p.runs.iter().filter_map(|r| r.output_commit.as_ref()).collect();
        if !oc.is_empty() {
            println!(
                "           output commit: replies held {:?} ms median, {:?} ms max; frames dropped {:?}; rollbacks past released output {}",
                oc.iter().map(|o| o.hold_ms_median.round()).collect::<Vec<_>>(),
                oc.iter().map(|o| o.hold_ms_max.round()).collect::<Vec<_>>(),
                oc.iter().map(|o| o.frames_dropped).collect::<Vec<_>>(),
                oc.iter().map(|o| o.rollbacks_past_released_output).sum::<u64>(),
            );
        }
    }
    if let Some(dir) = &a.plot {
        // The first run of each policy, its time axis from the fault.
        let mut series = Vec::new();
        for p in &f {
            let Some(r) = p.runs.first() else { continue };
            let axis = |i: usize| ((i as f64 + 0.5) * BIN_MS - r.fault_ms) / 1e3;
            for (what, bins) in [("ping", &r.ping_per_bin), ("kv", &r.kv_per_bin)] {
                series.push(Series {
                    label: format!("{}: {what} replies", p.policy),
                    points: bins.iter().enumerate().map(|(i, &c)| (axis(i), c as f64)).collect(),
                });
            }
        }
        let path = time_chart(
            dir,
            "fig6",
            "Fig. 6: replies per 10 ms of a kv service across a fault in its sandbox (paper: web server back in < 0.5 s)",
            ("time from the fault (s)", "replies per 10 ms"),
            &series,
            None,
        )?;
        println!("wrote {}", path.display());
    }
    Ok((Some(f), None))
}

pub fn bench(a: BenchSandboxRecoveryArgs) -> Result<ExitCode> {
    if a.reps < 3 {
        bail!("--reps must be at least 3");
    }
    if !(a.fig10_secs.is_finite() && (a.fig10_secs == 0.0 || (2.0..=600.0).contains(&a.fig10_secs)))
    {
        bail!("--fig10-secs must be 0 or in 2..=600");
    }
    let clock = RunClock::start();
    let khz = tsc_khz();
    let mut policies = Vec::new();
    for p in &a.policies {
        if !["restart", "replace", "rollback", "remote"].contains(&p.as_str()) {
            bail!("--policies: '{p}' is not one of restart, replace, rollback, remote");
        }
    }
    let wanted = |p: &str| a.policies.iter().any(|x| x == p);
    for policy in ["restart", "replace", "rollback"] {
        if !wanted(policy) {
            continue;
        }
        let mut runs = Vec::new();
        for _ in 0..a.reps {
            runs.push(policy_run(policy, &a)?);
        }
        let p = policy_result(policy, runs);
        println!(
            "{policy:8}: service gap {} ms (within 500 ms of the fault: {} ms); detection {} ms; recovered {}/{}; healthy pair errors {}; p's errors (svc's stream included) {}; new VM built ahead in {}/{}",
            p.service_gap_ms.show(1),
            p.gap_around_fault_ms.show(1),
            p.detection_ms.show(2),
            p.runs.iter().filter(|r| r.recovered).count(),
            p.runs.len(),
            p.runs.iter().map(|r| r.q_errors).sum::<u64>(),
            p.runs.iter().map(|r| r.p_errors).sum::<u64>(),
            p.runs.iter().filter(|r| r.phases.image_prepared).count(),
            p.runs.len(),
        );
        println!(
            "          per run: longest gap {:.1?} ms, beginning {:.1?} ms after the fault{}",
            p.runs.iter().map(|r| r.service_gap_ms).collect::<Vec<_>>(),
            p.runs.iter().map(|r| r.service_gap_start_ms.unwrap_or(f64::NAN)).collect::<Vec<_>>(),
            if a.stall_probe {
                format!(
                    ", host core stalls covering it {:.1?} ms (--stall-probe)",
                    p.runs
                        .iter()
                        .map(|r| r.service_gap_host_stalls_ms.unwrap_or(0.0))
                        .collect::<Vec<_>>()
                )
            } else {
                String::new()
            },
        );
        for (name, s) in &p.phases_ms {
            if s.median.is_finite() {
                println!("          {name:12} at {} ms after detection", s.show(2));
            }
        }
        policies.push(p);
    }
    // Remote takeover: the service moves to its standby.
    let mut remote_skipped = None;
    match crate::netns::unavailable().filter(|_| wanted("remote")) {
        Some(why) => {
            let why = format!("SKIPPED: no network namespace for the service's TAP ({why})");
            println!("remote  : {why}");
            remote_skipped = Some(why);
        }
        None if !wanted("remote") => {}
        None => {
            let ns = crate::netns::Netns::with_tap(
                &format!("nl-sbrec-{}", std::process::id()),
                "nltap0",
            )?;
            let mut runs = Vec::new();
            for _ in 0..a.reps {
                runs.push(remote_run(&ns)?);
            }
            let p = policy_result("remote", runs);
            println!(
                "remote  : service gap {} ms (client pinging every 1 ms; paper: < 500 ms); taken over {}/{}; healthy pair errors {}",
                p.service_gap_ms.show(1),
                p.runs.iter().filter(|r| r.recovered).count(),
                p.runs.len(),
                p.runs.iter().map(|r| r.p_errors + r.q_errors).sum::<u64>(),
            );
            for (name, s) in &p.phases_ms {
                if s.median.is_finite() {
                    println!("          {name:12} at {} ms after detection", s.show(2));
                }
            }
            policies.push(p);
        }
    }
    println!(
        "Table 1 (paper cycles; ours: restart, phase durations in ms and cycles at {khz} kHz):"
    );
    if let Some(r) = policies.iter().find(|p| p.policy == "restart") {
        let at = |i: usize| r.phases_ms[i].1.median;
        let ours = [
            r.detection_ms.median,
            at(2) - at(1) + at(0),
            at(1) - at(0),
            at(3) - at(2),
            at(4) - at(3),
            at(5) - at(4),
        ];
        for ((ours_name, paper, cycles), ms) in PAPER_TABLE1.iter().zip(ours) {
            println!(
                "  {ours_name:24} {ms:9.3} ms = {:>12.0} cycles | paper {paper}: {}",
                ms * khz as f64,
                cycles.map_or("N/A".into(), |c| format!("{c:.3e}"))
            );
        }
    }
    let (fig6, fig6_skipped) = fig6(&a)?;
    let mut kv_rollbacks_error = None;
    let mut kv_rollbacks = Vec::new();
    if fig6.is_some() && wanted("rollback") && a.kv_rollbacks > 0 {
        // Both release rules, the default first.
        for policy in ["rollback", "rollback-nextcheckpoint"] {
            match crate::bench::sandbox_service_timeline::kv_rollbacks(
                a.kv_rollbacks,
                cores()?,
                policy,
            ) {
                Ok(r) => kv_rollbacks.push(r),
                Err(e) => {
                    println!("kv across {} rollbacks ({policy}): FAILED: {e:#}", a.kv_rollbacks);
                    kv_rollbacks_error
                        .get_or_insert_with(String::new)
                        .push_str(&format!("{policy}: {e:#}; "));
                }
            }
        }
    }
    for r in &kv_rollbacks {
        println!(
            "kv across {} rollbacks ({}, kvload running): {} rollbacks in {:.1} s, {} kv ops ({} PUTs), acknowledged writes lost {}, unverified {}, digest {:?}; replies held {} ms median, {} ms max; rollbacks past released output {}",
            r.faults,
            r.policy,
            r.rollbacks,
            r.faults_secs,
            r.kv_ops,
            r.kv_puts,
            r.kv_lost,
            r.kv_unverified,
            r.kv_digest_ok,
            r.output_commit.as_ref().map_or(f64::NAN, |o| o.hold_ms_median.round()),
            r.output_commit.as_ref().map_or(f64::NAN, |o| o.hold_ms_max.round()),
            r.output_commit.as_ref().map_or(0, |o| o.rollbacks_past_released_output),
        );
    }
    let (mut kv_takeovers, mut kv_takeovers_error) = (None, None);
    if fig6.is_some() && wanted("remote") && a.kv_takeovers > 0 {
        match crate::bench::sandbox_service_timeline::kv_takeovers(
            a.kv_takeovers,
            cores()?,
            a.stall_probe,
        ) {
            Ok(r) => {
                let gaps = Summary::of(&r.ping_gap_ms).show(1);
                let first = Summary::of(&r.first_reply_ms).show(1);
                let stalls: Vec<f64> =
                    r.ping_gap_host_stall_ms.iter().map(|s| s.unwrap_or(0.0)).collect();
                // Of each silence over 50 ms, the value in `v`.
                let over_50 = |v: &[f64]| {
                    let v: Vec<f64> = r
                        .ping_gap_ms
                        .iter()
                        .zip(v)
                        .filter(|(&g, _)| g > 50.0)
                        .map(|(_, &x)| x)
                        .collect();
                    format!("{v:.1?}")
                };
                println!(
                    "kv across {} takeovers (state region, kvload running): {} takeovers ({} ok) in {:.1} s, {} kv ops ({} PUTs, {} unacknowledged), acknowledged writes lost {}, unverified {}, digest {:?}; table loads {}, corrupt entries dropped {}; ping gap per takeover {gaps} ms ({} over 50 ms, beginning {} ms after their faults{}); first reply {first} ms after detection",
                    r.faults,
                    r.takeovers,
                    r.takeovers_ok,
                    r.faults_secs,
                    r.kv_ops,
                    r.kv_puts,
                    r.kv_unacked_puts,
                    r.kv_lost,
                    r.kv_unverified,
                    r.kv_digest_ok,
                    r.table_loads,
                    r.table_dropped,
                    r.ping_gap_ms.iter().filter(|&&g| g > 50.0).count(),
                    over_50(&r.ping_gap_start_ms),
                    match r.host_stalls_over_50ms {
                        Some(n) => format!(
                            "; the host core stall each overlaps: {}; host core stalls over 50 ms in the run: {n} (--stall-probe)",
                            over_50(&stalls)
                        ),
                        None => String::new(),
                    },
                );
                kv_takeovers = Some(r);
            }
            Err(e) => {
                println!("kv across {} takeovers: FAILED: {e:#}", a.kv_takeovers);
                kv_takeovers_error = Some(format!("{e:#}"));
            }
        }
    }
    let campaign = if a.injections > 0 {
        let c = campaign(a.injections, a.seed)?;
        println!("campaign: {} injections into svc (restart): {:?}", c.injections, c.counts);
        println!(
            "  service ok {}/{} = {:.1}% [95% CI {:.1}, {:.1}]; recovered {}/{} detected = {:.1}% [{:.1}, {:.1}]; another sandbox harmed {} [{:.1}%, {:.1}%]",
            c.service_ok,
            c.injections,
            c.service_ok_rate * 100.0,
            c.service_ok_ci95.0 * 100.0,
            c.service_ok_ci95.1 * 100.0,
            c.recovered,
            c.detected,
            c.recovered_rate * 100.0,
            c.recovered_ci95.0 * 100.0,
            c.recovered_ci95.1 * 100.0,
            c.others_harmed,
            c.others_harmed_ci95.0 * 100.0,
            c.others_harmed_ci95.1 * 100.0
        );
        for (k, n, ok) in &c.per_kind {
            println!("  {k:16} {ok}/{n} service ok");
        }
        println!(
            "  restarts with the VM built ahead {}/{}; injections made before svc's next restart VM was ready {}",
            c.restarts_prepared.0, c.restarts_prepared.1, c.injected_unready
        );
        Some(c)
    } else {
        None
    };
    let fig10 = if a.fig10_secs > 0.0 {
        let f = fig10(a.fig10_secs)?;
        println!(
            "Fig. 10: events {:?}; s0 recoveries {}, serving again {}; violations trapped {}; healthy errors {:?}, detections {}",
            f.events.iter().map(|e| format!("{:.1}s {}", e.0, e.1)).collect::<Vec<_>>(),
            f.s0_recoveries,
            f.s0_serving_again,
            f.violations_trapped,
            f.healthy_errors,
            f.healthy_detections
        );
        if let Some(dir) = &a.plot {
            let series: Vec<Series> = f
                .series
                .iter()
                .map(|(n, v)| Series {
                    label: format!("{n} messages received"),
                    points: v.iter().map(|&(t, c)| (t, c as f64)).collect(),
                })
                .collect();
            let p = time_chart(
                dir,
                "fig10",
                "Fig. 10: messages per sandbox; s0 breaks its driver, writes a read-only page, crashes",
                ("time (s)", "messages received"),
                &series,
                None,
            )?;
            println!("wrote {}", p.display());
        }
        Some(f)
    } else {
        None
    };
    let prov = clock.finish();
    println!("load average: before {}, after {}", prov.loadavg_before, prov.loadavg_after);
    if a.json {
        let out = Out {
            policies,
            remote_skipped,
            table1_paper: PAPER_TABLE1
                .iter()
                .map(|(a, b, c)| (a.to_string(), b.to_string(), *c))
                .collect(),
            tsc_khz: khz,
            campaign,
            fig6,
            fig6_skipped,
            kv_rollbacks,
            kv_rollbacks_error,
            kv_takeovers,
            kv_takeovers_error,
            fig10,
        };
        print_json(&with_provenance(serde_json::to_value(&out)?, &prov));
    }
    Ok(ExitCode::SUCCESS)
}
