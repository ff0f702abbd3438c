//! `ninelives inject`: fault-injection campaigns against `ninelives host`
//! processes, and `ninelives inject merge` of their JSON results.
//!
//! Each run is an independent `ninelives host` process with the detectors
//! on. The setup's VMs are created over its API, the injector
//! ([`nl_inject`]) puts one fault into one of its threads, and the run
//! is classified as in the NiLiHype paper: non-manifested, SDC (no detector
//! fired but a digest is wrong, a VM failed, or the ping lost more than 10%
//! in a 1-second window) or detected; a detected run is recovered (at most
//! one VM affected and the VMM still creates and runs a new VM; for `1vm`,
//! no VM affected), and among those no-VM-failure, or failed with a reason.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use serde_json::{json, Value};

use crate::netns::Netns;
use crate::process::{install_cancel_handler, Proc, RunDir, CANCEL};
use crate::sandbox_campaign::SandboxFaultArg;
use crate::stats::wilson;
use nl_inject::sentinel::Sentinel;
use nl_inject::{self as injector, Fault, Injection, Plan, Target};
use nl_launch::args::{RecoveryName, WorkloadArgs, WorkloadName};

#[derive(Args, Clone, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct InjectArgs {
    #[command(subcommand)]
    pub sub: Option<InjectSub>,
    /// The fault to inject (`none`: control runs without a fault). Required
    /// for a VMM campaign (not for `--setup sandbox` or `inject merge`).
    #[arg(long, value_enum)]
    pub fault: Option<Fault>,
    /// 1vm: one VM (exits); 3vm: exits + netbench with a 1 ms ping, then a
    /// new blkbench VM; sandbox: faults into one sandbox of a set of three
    /// (see docs/campaigns.md).
    #[arg(long, value_enum, default_value_t = Setup::OneVm)]
    pub setup: Setup,
    /// What the VMM does after a detected error (none, microreset,
    /// microreboot); for `--setup sandbox`, the target sandbox's policy
    /// (restart, replace, rollback; none: stop it).
    #[arg(long, value_enum, default_value_t = InjectRecovery::None)]
    pub recovery: InjectRecovery,
    /// `--setup sandbox`: the fault model injected into the target sandbox.
    #[arg(long, value_enum, default_value_t = SandboxFaultArg::Mixed)]
    pub sandbox_fault: SandboxFaultArg,
    /// The repairs of a microreset (all, none, or a list; see `host --repairs`):
    /// switched on one after another, they reproduce the paper's Table I.
    #[arg(long, default_value = "all", value_parser = nl_launch::args::parse_repairs)]
    pub repairs: nl_vmm::recovery::Repairs,
    /// Run only shard I of N of the campaign (0 ≤ I < N): its runs j with
    /// j mod N = I, each with the seed it has in the whole campaign; `inject
    /// merge` puts the shards' summaries together (see docs/campaigns.md).
    #[arg(long, value_parser = crate::shards::Shard::parse)]
    pub shard: Option<crate::shards::Shard>,
    /// Number of runs (of the whole campaign, over all its shards).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub runs: u32,
    /// Seed of the first run; run i uses seed S+i (replay a run with --runs 1 --seed its seed).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Runs in parallel.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub jobs: u32,
    /// Which VMM threads may be targeted.
    #[arg(long, value_enum, default_value_t = Target::Vcpu)]
    pub target: Target,
    /// Seconds the initial VMs run (default: 2 for 1vm, 6 for 3vm).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Stop starting runs after this many seconds (runs under way finish).
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Append one JSON line per run (the replayable injection log) to this file.
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Print one JSON line per run, and the summary as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Clone, Debug)]
pub enum InjectSub {
    /// (internal) Inject a code fault and repair it the moment it is detected.
    #[command(hide = true)]
    Sentinel(nl_inject::sentinel::SentinelArgs),
    /// Merge the summaries (last JSON line) of the shards of one campaign
    /// into one; refuses mismatched, duplicate, overlapping or missing shards.
    Merge {
        /// Files holding `ninelives inject --json` output.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Merge even if shards or runs are missing (they are listed).
        #[arg(long)]
        partial: bool,
        /// Print the merged summary as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Setup {
    #[value(name = "1vm")]
    OneVm,
    #[value(name = "3vm")]
    ThreeVm,
    /// A sandbox set (crate::sandbox_campaign).
    Sandbox,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::OneVm => "1vm",
            Setup::ThreeVm => "3vm",
            Setup::Sandbox => "sandbox",
        }
    }
}

/// `--recovery`: a VMM recovery (1vm, 3vm) or a sandbox's policy (sandbox).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InjectRecovery {
    None,
    Microreset,
    Microreboot,
    Restart,
    Replace,
    Rollback,
}

impl InjectRecovery {
    fn vmm(self) -> Option<RecoveryName> {
        match self {
            InjectRecovery::None => Some(RecoveryName::None),
            InjectRecovery::Microreset => Some(RecoveryName::Microreset),
            InjectRecovery::Microreboot => Some(RecoveryName::Microreboot),
            _ => None,
        }
    }

    fn sandbox(self) -> Option<nl_sandbox::config::RecoveryPolicy> {
        use nl_sandbox::config::RecoveryPolicy as P;
        match self {
            InjectRecovery::None => Some(P::Stop),
            InjectRecovery::Restart => Some(P::Restart),
            InjectRecovery::Replace => Some(P::Replace),
            InjectRecovery::Rollback => Some(P::Rollback),
            _ => None,
        }
    }
}

/// The most wall time the injector single-steps its target. A stepped vCPU
/// thread stalls its VM meanwhile; the 3vm ping tolerates a stall of about a
/// second (the TAP queues 1000 frames, answered late but not lost).
const STEP_BUDGET: Duration = Duration::from_millis(600);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Outcomes {
    pub non_manifested: u64,
    pub sdc: u64,
    pub detected: u64,
    /// Detected and recovered (includes no_vm_failure).
    pub recovered: u64,
    /// Detected, recovered, and no VM failed at all.
    pub no_vm_failure: u64,
    /// Detected and not recovered.
    pub failed: u64,
}

/// The class of one run.
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub run: u32,
    pub seed: u64,
    pub fault: &'static str,
    pub setup: &'static str,
    pub recovery: &'static str,
    pub plan: Plan,
    pub injection: Option<Injection>,
    /// non_manifested, sdc, detected, or skipped (the fault did not go in).
    pub outcome: &'static str,
    /// For detected runs: recovered, no_vm_failure or failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detector: Option<Value>,
    pub reason: String,
    /// 3vm: the ping's report (sent, received, longest gap, bad windows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ping: Option<Value>,
    /// A failed run: the VMM's last lines on stderr (detections, recoveries).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vmm_tail: Vec<String>,
    pub elapsed_ms: u64,
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn summary(
    fault: &str,
    setup: &str,
    recovery: &str,
    o: &Outcomes,
    skipped: u64,
    elapsed_s: f64,
    seed: u64,
) -> Value {
    let runs = o.non_manifested + o.sdc + o.detected;
    // With nothing detected there is no rate to give (not 0, not 1): the
    // JSON says null and the table says so in words.
    let (rate, ci) = if o.detected > 0 {
        let (lo, hi) = wilson(o.recovered, o.detected);
        (json!(round4(o.recovered as f64 / o.detected as f64)), json!([round4(lo), round4(hi)]))
    } else {
        (Value::Null, Value::Null)
    };
    json!({
        "runs": runs, "fault": fault, "setup": setup, "recovery": recovery,
        "outcomes": o,
        "success_rate": rate, "success_ci95": ci,
        "runs_per_min": round4(if elapsed_s > 0.0 { (runs + skipped) as f64 * 60.0 / elapsed_s } else { 0.0 }),
        "skipped": skipped, "elapsed_s": round4(elapsed_s), "seed": seed,
    })
}

/// What every campaign checks and opens before its first run: the
/// duration, time limit and seed range, KVM, the `--log` file (appended
/// to), and the Ctrl-C handler that ends the campaign after the runs under
/// way.
pub(crate) fn start_campaign(a: &InjectArgs, duration: f64) -> Result<Option<std::fs::File>> {
    if !(duration.is_finite() && (0.5..=600.0).contains(&duration)) {
        bail!("--duration {duration} must be between 0.5 and 600 seconds");
    }
    if let Some(t) = a.time_limit {
        if !(t.is_finite() && t > 0.0) {
            bail!("--time-limit must be a positive number of seconds");
        }
    }
    if a.seed.checked_add(u64::from(a.runs)).is_none() {
        bail!("--seed {} is too large for {} runs", a.seed, a.runs);
    }
    nl_vmm::open_kvm()?;
    let log = match &a.log {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open --log {}", p.display()))?,
        ),
        None => None,
    };
    install_cancel_handler();
    Ok(log)
}

/// The campaign's table: each outcome class indented under the class it
/// refines (detected: recovered or not; recovered: with no VM failing).
fn table(s: &Value) -> String {
    use std::fmt::Write;
    let o = &s["outcomes"];
    let n = |k: &str| o[k].as_u64().unwrap_or(0);
    let runs = s["runs"].as_u64().unwrap_or(0);
    let pct = |k: &str| 100.0 * n(k) as f64 / runs.max(1) as f64;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "campaign: fault {} setup {} recovery {}: {} runs ({} skipped), {:.1} runs/min",
        s["fault"].as_str().unwrap_or("?"),
        s["setup"].as_str().unwrap_or("?"),
        s["recovery"].as_str().unwrap_or("?"),
        runs,
        s["skipped"],
        s["runs_per_min"].as_f64().unwrap_or(0.0)
    );
    let _ = writeln!(t, "  {:<30} {:>6} {:>7}", "outcome", "runs", "share");
    let row = |t: &mut String, depth: usize, label: &str, k: &str| {
        let label = format!("{}{label}", "  ".repeat(depth));
        let _ = writeln!(t, "  {label:<30} {:>6} {:>6.1}%", n(k), pct(k));
    };
    row(&mut t, 0, "fault not manifested", "non_manifested");
    row(&mut t, 0, "silent data corruption", "sdc");
    row(&mut t, 0, "detected", "detected");
    row(&mut t, 1, "recovered", "recovered");
    row(&mut t, 2, "of which no VM failed", "no_vm_failure");
    row(&mut t, 1, "not recovered", "failed");
    match (s["success_rate"].as_f64(), s["success_ci95"][0].as_f64(), s["success_ci95"][1].as_f64())
    {
        (Some(r), Some(lo), Some(hi)) => {
            let _ = writeln!(
                t,
                "  recovered / detected: {r:.3}, 95% Wilson interval [{lo:.3}, {hi:.3}] over {} detected",
                n("detected")
            );
        }
        _ => {
            let _ = writeln!(t, "  no fault was detected, so there is no recovery rate");
        }
    }
    t
}

fn print_table(s: &Value) {
    print!("{}", table(s));
}

pub fn inject(a: InjectArgs) -> Result<ExitCode> {
    match a.sub {
        Some(InjectSub::Merge { files, json, partial }) => return merge(&files, json, partial),
        Some(InjectSub::Sentinel(s)) => return nl_inject::sentinel::run(s),
        None => {}
    }
    if a.setup == Setup::Sandbox {
        let Some(policy) = a.recovery.sandbox() else {
            bail!(
                "--setup sandbox takes --recovery restart|replace|rollback|none, not {:?}",
                a.recovery
            );
        };
        return crate::sandbox_campaign::inject(a, policy);
    }
    let Some(recovery) = a.recovery.vmm() else {
        bail!("--recovery {:?} is a sandbox policy: use it with --setup sandbox", a.recovery);
    };
    let Some(fault) = a.fault else {
        bail!("inject needs --fault failstop|register|code|none (or the merge subcommand)");
    };
    let duration = a.duration.unwrap_or(match a.setup {
        Setup::ThreeVm => 6.0,
        _ => 2.0,
    });
    if let (Setup::ThreeVm, Some(why)) = (a.setup, crate::netns::unavailable()) {
        bail!("the 3vm setup needs root for its network namespace: {why}");
    }
    let mut log = start_campaign(&a, duration)?;
    let cfg = Arc::new(Campaign {
        fault,
        setup: a.setup,
        recovery,
        repairs: a.repairs,
        target: a.target,
        duration,
        exe: std::env::current_exe().context("cannot find the ninelives binary")?,
    });
    let shard = a.shard.unwrap_or(crate::shards::Shard::ALL);
    let start = Instant::now();
    let limit = a.time_limit.map(Duration::from_secs_f64);
    let pb = if a.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(shard.runs(a.runs).len() as u64)
    };
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let indices = Arc::new(shard.runs(a.runs));
    let next = Arc::new(AtomicU32::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<RunRecord>();
    let mut workers = Vec::new();
    for slot in 0..a.jobs.min(indices.len() as u32) {
        let (cfg, next, tx, indices) = (cfg.clone(), next.clone(), tx.clone(), indices.clone());
        let seed0 = a.seed;
        workers.push(std::thread::spawn(move || -> Result<()> {
            let ns = match cfg.setup {
                Setup::ThreeVm => Some(Netns::with_tap(
                    &format!("nl-inj-{}-{slot}", std::process::id()),
                    "nltap0",
                )?),
                _ => None,
            };
            loop {
                let k = next.fetch_add(1, Relaxed) as usize;
                let Some(&i) = indices.get(k) else { return Ok(()) };
                if CANCEL.load(Relaxed) || limit.is_some_and(|l| start.elapsed() > l) {
                    return Ok(());
                }
                let rec = run_one(&cfg, i, seed0 + u64::from(i), slot, ns.as_ref());
                if CANCEL.load(Relaxed) {
                    return Ok(()); // an interrupted run is not classified
                }
                let _ = tx.send(rec);
            }
        }));
    }
    drop(tx);
    let mut o = Outcomes::default();
    let mut skipped = 0;
    let mut done = Vec::new();
    for rec in rx {
        done.push(rec.run);
        match (rec.outcome, rec.result) {
            ("non_manifested", _) => o.non_manifested += 1,
            ("sdc", _) => o.sdc += 1,
            ("detected", r) => {
                o.detected += 1;
                match r {
                    Some("no_vm_failure") => {
                        o.recovered += 1;
                        o.no_vm_failure += 1
                    }
                    Some("recovered") => o.recovered += 1,
                    _ => o.failed += 1,
                }
            }
            _ => skipped += 1,
        }
        let line = serde_json::to_string(&rec).unwrap_or_default();
        if let Some(f) = log.as_mut() {
            let _ = writeln!(f, "{line}");
        }
        if a.json {
            println!("{line}");
        }
        pb.inc(1);
        pb.set_message(format!(
            "nm {} sdc {} det {} skip {}",
            o.non_manifested, o.sdc, o.detected, skipped
        ));
    }
    let mut errors = Vec::new();
    for w in workers {
        match w.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(format!("{e:#}")),
            Err(_) => errors.push("a campaign worker panicked".into()),
        }
    }
    pb.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    let mut s =
        summary(fault.name(), a.setup.name(), recovery.name(), &o, skipped, elapsed, a.seed);
    if recovery == RecoveryName::Microreset {
        s["repairs"] = json!(a.repairs.describe());
    }
    done.sort_unstable();
    s["campaign"] = crate::shards::identity(
        fault.name(),
        a.setup.name(),
        recovery.name(),
        &a.repairs.describe(),
        &format!("{:?}", a.target).to_lowercase(),
        duration,
        a.seed,
        a.runs,
    );
    s["shard"] = json!(shard);
    s["run_indices"] = json!(done);
    s["loadavg"] = json!(crate::json_out::loadavg());
    let interrupted = CANCEL.load(Relaxed);
    if a.json {
        let mut s = s;
        if interrupted {
            s["interrupted"] = json!(true);
        }
        println!("{s}");
    } else {
        print_table(&s);
        if interrupted {
            println!("  interrupted: runs under way were detached, killed and not counted");
        }
    }
    if let Some(e) = errors.first() {
        bail!("{e}");
    }
    Ok(if interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

/// Largest campaign log `inject --merge` reads.
const MAX_CAMPAIGN_LOG_BYTES: u64 = 256 << 20;

fn merge(files: &[PathBuf], json_out: bool, partial: bool) -> Result<ExitCode> {
    let mut inputs = Vec::new();
    for f in files {
        let b = nl_memory::file::read_limited(f, "campaign log", MAX_CAMPAIGN_LOG_BYTES)
            .with_context(|| format!("cannot read {}", f.display()))?;
        let text = String::from_utf8_lossy(&b);
        let s: Value = text
            .lines()
            .rev()
            .find_map(|l| {
                serde_json::from_str::<Value>(l).ok().filter(|v| v.get("outcomes").is_some())
            })
            .with_context(|| format!("{}: no campaign summary line in it", f.display()))?;
        inputs.push(crate::shards::Input { name: f.display().to_string(), summary: s });
    }
    let (identity, missing) = crate::shards::check(&inputs, partial).map_err(anyhow::Error::msg)?;
    if inputs[0].summary["setup"] == "sandbox" {
        return crate::sandbox_campaign::merge(&inputs, identity, &missing, json_out);
    }
    let mut total = Outcomes::default();
    let (mut skipped, mut elapsed) = (0u64, 0f64);
    let mut seed = u64::MAX;
    for inp in &inputs {
        let s = &inp.summary;
        let o: Outcomes = serde_json::from_value(s["outcomes"].clone())
            .with_context(|| format!("{}: malformed outcomes", inp.name))?;
        total.non_manifested += o.non_manifested;
        total.sdc += o.sdc;
        total.detected += o.detected;
        total.recovered += o.recovered;
        total.no_vm_failure += o.no_vm_failure;
        total.failed += o.failed;
        skipped += s["skipped"].as_u64().unwrap_or(0);
        elapsed += s["elapsed_s"].as_f64().unwrap_or(0.0);
        seed = seed.min(s["seed"].as_u64().unwrap_or(0));
    }
    let get = |k: &str| inputs[0].summary[k].as_str().unwrap_or("").to_string();
    // runs_per_min of a merge: runs per minute of machine time, summed over the files.
    let mut s =
        summary(&get("fault"), &get("setup"), &get("recovery"), &total, skipped, elapsed, seed);
    if let Some(id) = identity {
        s["campaign"] = id;
    }
    s["merged"] = json!({"files": inputs.len(), "missing": missing});
    if json_out {
        println!("{s}");
    } else {
        print_table(&s);
        if !missing.shards.is_empty() || missing.runs > 0 {
            println!(
                "  partial: shard(s) not given: [{}]; runs not completed: {}",
                missing.shards.join(", "),
                missing.runs
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

struct Campaign {
    fault: Fault,
    setup: Setup,
    recovery: RecoveryName,
    repairs: nl_vmm::recovery::Repairs,
    target: Target,
    duration: f64,
    exe: PathBuf,
}

/// The errors a host reported on stderr (its detection lines), first first.
fn detections(host: &Proc) -> Vec<Value> {
    host.stderr.records(nl_vmm::detect::REPORT_PREFIX)
}

fn first_detection(host: &Proc) -> Option<Value> {
    detections(host).into_iter().next()
}

fn api(sock: &Path, req: Value) -> Result<Value> {
    let r = nl_vmm::api::request(sock, &req)?;
    if r.get("ok") != Some(&Value::Bool(true)) {
        bail!("host refused {req}: {}", r["error"]);
    }
    Ok(r)
}

/// [`api`] for a host that may be recovering: a microreboot closes the
/// connections the old process had accepted (the API contract: reconnect),
/// so a failed exchange is tried again, at most 20 times over about 2 s. A
/// refusal (`ok: false`) is an answer and is not retried.
fn api_patient(sock: &Path, req: Value) -> Result<Value> {
    let mut last = None;
    for _ in 0..20 {
        match nl_vmm::api::request(sock, &req) {
            Ok(r) if r.get("ok") == Some(&Value::Bool(true)) => return Ok(r),
            Ok(r) => bail!("host refused {req}: {}", r["error"]),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(last.map_or_else(|| anyhow::anyhow!("no answer"), anyhow::Error::from))
}

/// A VM the run created and how to verify it.
struct RunVm {
    id: u32,
    workload: WorkloadName,
    duration: f64,
}

/// The verdict on one VM: None if fine, else why it failed.
fn vm_problem(sock: &Path, vm: &RunVm) -> Option<String> {
    let r = match api_patient(sock, json!({"op":"stats","id":vm.id})) {
        Ok(r) => r,
        Err(e) => return Some(format!("vm{}: no stats: {e:#}", vm.id)),
    };
    let st = &r["stats"];
    let state = st["state"].as_str().unwrap_or("?");
    if state != "completed" {
        return Some(format!("vm{} ({}): {state}", vm.id, vm.workload.name()));
    }
    let regs: Vec<nl_devices::control::VcpuRegsSnapshot> = st["vcpus"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| serde_json::from_value(v["regs"].clone()).ok()).collect())
        .unwrap_or_default();
    let w = WorkloadArgs { workload: vm.workload, ..WorkloadArgs::default() };
    let params = match nl_launch::guest::workload_params(&w, vm.duration) {
        Ok(p) => p,
        Err(e) => return Some(format!("vm{}: {e:#}", vm.id)),
    };
    if vm.workload == WorkloadName::Netbench {
        // netbench's digest covers only its poll rounds; what it answered is checked by the ping.
        return None;
    }
    nl_launch::verify::verify_vcpus(&params, &regs, 0)
        .into_iter()
        .find_map(|v| v.problem)
        .map(|p| format!("vm{} ({}): {p}", vm.id, vm.workload.name()))
}

fn create_vm(sock: &Path, w: WorkloadName, extra: Value, dur: f64) -> Result<RunVm> {
    let mut req = json!({"op":"create","workload":w.name(),"duration":dur,"mem":"64M"});
    if let (Some(o), Some(e)) = (req.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    let id = api(sock, req)?["id"].as_u64().context("no VM id")? as u32;
    Ok(RunVm { id, workload: w, duration: dur })
}

/// Waits until none of `vms` is running (or the host ended, or `limit`).
fn wait_vms(host: &mut Proc, sock: &Path, vms: &[RunVm], limit: Duration) {
    let t = Instant::now();
    while t.elapsed() < limit && host.exited().is_none() && !CANCEL.load(Relaxed) {
        // A host that is recovering may drop the exchange: ask again.
        let Ok(r) = api_patient(sock, json!({"op":"list"})) else { return };
        let running = r["vms"].as_array().is_some_and(|a| {
            a.iter().any(|v| {
                vms.iter().any(|m| v["id"] == m.id)
                    && matches!(v["state"].as_str(), Some("running" | "paused"))
            })
        });
        if !running {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run_one(cfg: &Campaign, run: u32, seed: u64, slot: u32, ns: Option<&Netns>) -> RunRecord {
    let t0 = Instant::now();
    let d = cfg.duration;
    let window = match cfg.setup {
        // The paper: after the first 10% and before the last 10% of the run.
        Setup::OneVm | Setup::Sandbox => ((d * 100.0) as u64, (d * 900.0) as u64),
        // The paper: 0.5 s to 6 s of 24 s; here the first half of the run.
        Setup::ThreeVm => (500, (d * 500.0) as u64),
    };
    let plan = Plan::from_seed(seed, cfg.fault, window);
    let mut rec = RunRecord {
        run,
        seed,
        fault: cfg.fault.name(),
        setup: cfg.setup.name(),
        recovery: cfg.recovery.name(),
        plan: plan.clone(),
        injection: None,
        outcome: "skipped",
        result: None,
        detector: None,
        reason: String::new(),
        ping: None,
        vmm_tail: Vec::new(),
        elapsed_ms: 0,
    };
    if let Err(e) = run_body(cfg, &plan, slot, ns, &mut rec) {
        rec.outcome = "skipped";
        rec.reason = format!("run error: {e:#}");
    }
    rec.elapsed_ms = t0.elapsed().as_millis() as u64;
    rec
}

fn run_body(
    cfg: &Campaign,
    plan: &Plan,
    slot: u32,
    ns: Option<&Netns>,
    rec: &mut RunRecord,
) -> Result<()> {
    let dir = RunDir::new(&format!("inject-{slot}-{}", plan.seed))?;
    let sock = dir.0.join("api.sock");
    let mut cmd = match ns {
        Some(ns) => ns.command(&cfg.exe)?,
        None => Command::new(&cfg.exe),
    };
    cmd.arg("host").arg("--api").arg(&sock).args(["--recovery", cfg.recovery.name()]);
    cmd.arg("--repairs").arg(cfg.repairs.describe());
    // A code fault is repaired as soon as it is detected (it acts as a
    // transient fault): the recovering VMM waits for this flag file.
    let repair_flag = dir.0.join("repaired");
    if cfg.fault == Fault::Code && cfg.recovery != RecoveryName::None {
        cmd.env(nl_vmm::recovery::INJECTOR_REPAIR_ENV, &repair_flag);
    }
    // The injector (this process) is the host's parent; the sentinel is its
    // sibling, allowed under Yama ptrace_scope 1 by the host's declaration.
    injector::traceable_by_us(&mut cmd);
    let mut host = Proc::spawn(cmd)?;
    let t = Instant::now();
    while api(&sock, json!({"op":"list"})).is_err() {
        if host.exited().is_some() || t.elapsed() > Duration::from_secs(10) {
            bail!("the host did not come up");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let d = cfg.duration;
    let mut vms = Vec::new();
    vms.push(create_vm(&sock, WorkloadName::Exits, json!({}), d)?);
    let window_start = Instant::now();
    let mut ping = None;
    if let Some(ns) = ns {
        let extra = json!({"net_tap":"nltap0","net_ip":"10.0.0.2/24"});
        vms.push(create_vm(&sock, WorkloadName::Netbench, extra, d)?);
        // Wait (bounded) until the guest answers, then ping for the rest of its run.
        let t = Instant::now();
        loop {
            let mut c = ns.command(&cfg.exe)?;
            c.args(["ping", "--target", "10.0.0.2", "--interval", "10ms", "--duration", "0.05"]);
            let o = c.stderr(Stdio::null()).output()?;
            if o.status.success() {
                break;
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the netbench guest never answered");
            }
        }
        let left = d - window_start.elapsed().as_secs_f64() - 0.5;
        if left < 1.0 {
            bail!("--duration {d} leaves no time to ping");
        }
        let mut c = ns.command(&cfg.exe)?;
        c.args(["ping", "--target", "10.0.0.2", "--interval", "1ms", "--json", "--duration"])
            .arg(format!("{left:.2}"));
        ping = Some(Proc::spawn(c)?);
    }
    // First-level trigger.
    let at = window_start + Duration::from_millis(plan.trigger_ms);
    while Instant::now() < at {
        if CANCEL.load(Relaxed) {
            return Ok(());
        }
        std::thread::sleep(
            Duration::from_millis(5).min(at.saturating_duration_since(Instant::now())),
        );
    }
    let threads = injector::candidate_threads(host.pid(), cfg.target);
    // A code fault under recovery goes in through a sentinel, which repairs
    // it the moment it is detected (see injector::sentinel).
    let mut sentinel = None;
    let injection = if threads.is_empty() {
        None
    } else {
        let (name, tid) = &threads[(plan.thread_pick % threads.len() as u64) as usize];
        // Stepping stalls the target thread (and a vCPU thread's VM): bound it,
        // and end it well before the initial VMs do.
        let vm_end = window_start + Duration::from_secs_f64(d);
        let budget = STEP_BUDGET.min(
            vm_end
                .saturating_duration_since(Instant::now())
                .saturating_sub(Duration::from_millis(100)),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        if cfg.fault == Fault::Code && cfg.recovery != RecoveryName::None {
            let target = (name.as_str(), *tid);
            match Sentinel::start(
                &cfg.exe,
                plan,
                host.pid(),
                target,
                budget,
                &repair_flag,
                deadline,
            ) {
                Ok((s, inj)) => {
                    sentinel = Some(s);
                    Some(inj)
                }
                Err(e) => Some(Injection { skipped: Some(format!("{e:#}")), ..Default::default() }),
            }
        } else {
            Some(injector::inject_thread(plan, host.pid(), (name, *tid), budget, &CANCEL, deadline))
        }
    };
    let skipped = match &injection {
        None => Some("no target thread".to_string()),
        Some(i) if cfg.fault != Fault::None => i.skipped.clone(),
        Some(_) => None,
    };
    rec.injection = injection.clone();
    if CANCEL.load(Relaxed) {
        return Ok(());
    }
    if let Some(s) = skipped {
        rec.reason = s;
        return Ok(());
    }
    // Tell the sentinel when the VMM reports an error it did not see as a
    // fault signal (a panic, a hang): it repairs the code then.
    let watcher = sentinel.as_ref().map(|sen| {
        let (lines, pid) = (host.stderr.clone(), sen.pid());
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(Relaxed) {
                if lines.any_starts_with(nl_vmm::detect::REPORT_PREFIX) {
                    Sentinel::repair_now(pid);
                    return;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        (stop, t)
    });
    // Let the run play out: the VMs finish, fail, or the VMM ends.
    wait_vms(&mut host, &sock, &vms, Duration::from_secs_f64(d + 20.0));
    if let Some((stop, t)) = watcher {
        stop.store(true, Relaxed);
        let _ = t.join();
    }
    if api(&sock, json!({"op":"list"})).is_err() || first_detection(&host).is_some() {
        // A host that stopped answering or reported an error may be ending: let it.
        host.wait_for(Duration::from_secs(2));
    }
    if let Some(sen) = sentinel.take() {
        // A code fault that never showed is repaired now.
        if let Some(inj) = rec.injection.as_mut() {
            inj.repair = sen.finish(Duration::from_secs(10));
        }
    } else if let Some(inj) = &injection {
        if inj.repair_addr.is_some()
            && (first_detection(&host).is_some() || host.exited().is_none())
        {
            // Without recovery: repaired at the run's end.
            injector::repair(host.pid(), inj);
        }
    }
    let mut problems: Vec<String> = Vec::new();
    let mut affected = 0;
    let alive = host.exited().is_none();
    if alive {
        for vm in &vms {
            if let Some(p) = vm_problem(&sock, vm) {
                problems.push(p);
                affected += 1;
            }
        }
    }
    if let Some(mut p) = ping.take() {
        p.wait_for(Duration::from_secs_f64(d + 5.0));
        let j = p.last_json().unwrap_or(Value::Null);
        let bad = j["bad_windows"].as_array().is_none_or(|a| !a.is_empty());
        rec.ping = Some(json!({
            "sent": j["sent"], "received": j["received"],
            "longest_gap_ms": j["longest_gap_ms"], "bad_windows": j["bad_windows"],
        }));
        if j["received"].as_u64().unwrap_or(0) == 0 || bad {
            problems.push(format!(
                "ping: {} of {} received, {} window(s) below 90%",
                j["received"],
                j["sent"],
                j["bad_windows"].as_array().map_or(0, Vec::len)
            ));
            // The netbench VM counts once, whether its digest or its ping failed.
            if alive && !vms.iter().skip(1).any(|v| vm_problem(&sock, v).is_some()) {
                affected += 1;
            }
        }
    }
    // 3vm: the VMM must still create and run a new VM to completion.
    let mut new_vm_ok = true;
    if cfg.setup == Setup::ThreeVm && host.exited().is_none() {
        let disk = dir.0.join("blk.img");
        nl_launch::guest::ensure_disk(&disk, nl_launch::guest::DEFAULT_DISK_BYTES)?;
        match create_vm(&sock, WorkloadName::Blkbench, json!({"disk": disk}), 1.0) {
            Err(e) => {
                problems.push(format!("new VM: {e:#}"));
                new_vm_ok = false;
            }
            Ok(new) => {
                let new = [new];
                wait_vms(&mut host, &sock, &new, Duration::from_secs(30));
                if let Some(p) = vm_problem(&sock, &new[0]) {
                    problems.push(format!("new VM: {p}"));
                    new_vm_ok = false;
                }
            }
        }
    }
    let detection = first_detection(&host);
    // End the host: a clean shutdown if it is still there.
    if host.exited().is_none() {
        let _ = nl_vmm::api::request(&sock, &json!({"op":"shutdown"}));
        host.wait_for(Duration::from_secs(10));
    }
    let status = host.wait_for(Duration::from_millis(100));
    let detection = detection.or_else(|| first_detection(&host));
    if let Some(det) = detection {
        rec.outcome = "detected";
        rec.detector = Some(det.clone());
        let what = format!(
            "{} on {}",
            det["detector"].as_str().unwrap_or("?"),
            det["thread"].as_str().unwrap_or("?")
        );
        if !alive {
            rec.result = Some("failed");
            rec.reason =
                format!("{what}: the VMM ended with its VMs (recovery {})", cfg.recovery.name());
            if let Some(f) =
                detections(&host).into_iter().find(|d| d["detector"] == "recovery_failed")
            {
                rec.reason.push_str(&format!(": {}", f["message"].as_str().unwrap_or("?")));
            }
        } else {
            let ok = match cfg.setup {
                Setup::OneVm | Setup::Sandbox => affected == 0,
                Setup::ThreeVm => affected <= 1 && new_vm_ok,
            };
            rec.result = Some(match (ok, affected) {
                (true, 0) => "no_vm_failure",
                (true, _) => "recovered",
                _ => "failed",
            });
            rec.reason = format!("{what}; {}", problems.join("; "));
        }
    } else if !alive {
        // The VMM died without a report (e.g. a signal that cannot be caught):
        // the campaign agent sees it end, as the outside hypervisor would.
        rec.outcome = "detected";
        rec.result = Some("failed");
        rec.detector = Some(json!({"detector":"vmm_exit","status": format!("{status:?}")}));
        rec.reason = format!("the VMM ended without a report: {status:?}");
    } else if problems.is_empty() {
        rec.outcome = "non_manifested";
    } else {
        rec.outcome = "sdc";
        rec.reason = problems.join("; ");
    }
    if rec.result == Some("failed") {
        rec.vmm_tail = host.stderr.tail(6);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_detected_gives_no_rate() {
        let o = Outcomes { non_manifested: 7, sdc: 1, ..Default::default() };
        let s = summary("register", "1vm", "microreset", &o, 0, 10.0, 1);
        assert!(s["success_rate"].is_null() && s["success_ci95"].is_null(), "{s}");
        let t = table(&s);
        assert!(t.contains("no fault was detected, so there is no recovery rate"), "{t}");
        assert!(!t.contains("0.000"), "{t}");
    }

    #[test]
    fn refinements_are_indented_under_their_class() {
        let o = Outcomes {
            non_manifested: 5,
            detected: 10,
            recovered: 9,
            no_vm_failure: 6,
            failed: 1,
            ..Default::default()
        };
        let s = summary("code", "3vm", "microreset", &o, 0, 10.0, 1);
        assert_eq!(s["success_rate"], 0.9);
        let t = table(&s);
        let indent = |label: &str| {
            let line =
                t.lines().find(|l| l.contains(label)).unwrap_or_else(|| panic!("{label}: {t}"));
            line.len() - line.trim_start().len()
        };
        assert!(indent("recovered") > indent("detected"), "{t}");
        assert!(indent("of which no VM failed") > indent("recovered"), "{t}");
        assert_eq!(indent("not recovered"), indent("recovered"), "{t}");
        assert!(
            t.contains(
                "recovered / detected: 0.900, 95% Wilson interval [0.596, 0.982] over 10 detected"
            ),
            "{t}"
        );
    }
}
