//! `ninelives checkpoint`: run a VM under VM-μCheckpoint, with optional
//! injected guest faults, and verify it still produces the right digest.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nl_checkpoint::{CheckpointConfig, Mode, RunReport, Supervisor};
use nl_vmm::Vm;
use serde::Serialize;

use crate::args::{CheckpointArgs, CkptMode};
use crate::guest;
use crate::verify::verify_vm;

impl CkptMode {
    pub fn mode(self) -> Mode {
        match self {
            CkptMode::CowB => Mode::CowB,
            CkptMode::CowP => Mode::CowP,
            CkptMode::DirtyLog => Mode::DirtyLog,
            CkptMode::Compare => Mode::Compare,
            CkptMode::Auto => Mode::Auto,
        }
    }
}

/// Largest `--latency-file` read (about a million latencies).
pub const MAX_LATENCY_FILE_BYTES: u64 = 16 << 20;

/// The 95th percentile of the error latencies (ms, one per line) in `path`.
pub fn latency_p95(path: &Path) -> Result<f64> {
    let b = nl_memory::file::read_limited(path, "latency file", MAX_LATENCY_FILE_BYTES)?;
    let text = String::from_utf8(b)
        .map_err(|e| anyhow::anyhow!("latency file {} is not UTF-8 text ({e})", path.display()))?;
    let mut v = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let x: f64 = t.parse().with_context(|| {
            format!("{}:{}: '{t}' is not a latency in milliseconds", path.display(), i + 1)
        })?;
        if !(x.is_finite() && x >= 0.0) {
            bail!("{}:{}: latency {x} is not a non-negative number", path.display(), i + 1);
        }
        v.push(x);
    }
    if v.is_empty() {
        bail!("latency file {} holds no latencies", path.display());
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1;
    Ok(v[idx])
}

/// The checkpoint interval and the error-latency bound T_B from the
/// arguments. The paper (section III) requires the interval to exceed T_B;
/// here the supervisor instead keeps checkpoints spanning
/// max(T_B, hang timeout) of guest time and rolls back past it, so any
/// interval works and T_B only sets how far back rollbacks go.
pub fn choose_interval(a: &CheckpointArgs) -> Result<(Duration, Option<f64>)> {
    let bound = match (&a.latency_bound, &a.latency_file) {
        (Some(_), Some(_)) => bail!("give --latency-bound or --latency-file, not both"),
        (Some(b), None) => Some(*b),
        (None, Some(f)) => Some(latency_p95(f)?),
        (None, None) => None,
    };
    if let Some(b) = bound {
        if !(b.is_finite() && (0.0..=3_600_000.0).contains(&b)) {
            bail!("--latency-bound {b} ms is out of range 0..=3600000");
        }
    }
    if !(a.hang_timeout().is_finite() && (0.001..=3600.0).contains(&a.hang_timeout())) {
        bail!("--heartbeat-timeout {} s is out of range 0.001..=3600", a.hang_timeout());
    }
    // An interval below T_B (or the hang timeout) is fine: rollbacks go to
    // the newest kept checkpoint at least that much guest time older (see
    // nl_checkpoint::supervisor), so no rollback target can hold the fault.
    let interval = a.interval.unwrap_or(50.0);
    if !(interval.is_finite() && (5.0..=600_000.0).contains(&interval)) {
        bail!("--interval {interval} ms is out of range 5..=600000");
    }
    Ok((Duration::from_secs_f64(interval / 1000.0), bound))
}

/// The result of one protected run.
#[derive(Clone, Debug, Serialize)]
pub struct ProtectedRun {
    pub workload: &'static str,
    pub ok: bool,
    pub digest_ok: bool,
    pub recovered: bool,
    pub ops_per_sec: f64,
    pub latency_bound_ms: Option<f64>,
    pub rollback_ms: Option<f64>,
    #[serde(flatten)]
    pub report: RunReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Boots one VM, runs it under checkpointing, verifies its digest.
pub fn protected_run(a: &CheckpointArgs, quiet: bool) -> Result<ProtectedRun> {
    let (interval, bound) = choose_interval(a)?;
    // The key is checked before any VM exists.
    let disk_key = match (&a.key_file, a.disk_every) {
        (Some(_), 0) => bail!("--key-file authenticates disk checkpoints: give --disk-every too"),
        (Some(k), _) => Some(nl_checkpoint::disk::load_key(k)?),
        (None, _) => None,
    };
    let params = guest::workload_params(&a.workload, a.duration)?;
    let kernel = guest::kernel_image(&a.machine)?;
    let config = guest::vm_config(&a.machine, params, kernel, a.console.clone())?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = Vm::create(&kvm, 0, config).context("cannot create the VM")?;
    let cfg = CheckpointConfig {
        mode: a.mode.mode(),
        block_pages: a.block_pages,
        interval,
        inject: a.inject_guest_fault,
        script: Vec::new(),
        seed: a.workload.seed ^ 0xC4E0,
        hang_timeout: Duration::from_secs_f64(a.hang_timeout()),
        latency_bound: bound.map(|b| Duration::from_secs_f64(b / 1000.0)),
        max_rollbacks: 50,
        time_limit: Duration::from_secs_f64(a.duration * 4.0 + 60.0),
        disk_every: a.disk_every,
        disk_path: (a.disk_every > 0).then(|| a.disk_path.clone()),
        disk_key,
        output_commit: false,
        commit_rule: Default::default(),
        live: None,
    };
    if !quiet {
        tracing::info!(
            "checkpointing every {:.0} ms with {}{}",
            interval.as_secs_f64() * 1e3,
            cfg.mode.name(),
            bound.map_or(String::new(), |b| format!(" (error-latency bound {b:.1} ms)"))
        );
    }
    // The result check: the guest's digests replayed on the host. A wrong
    // result is a detected error, rolled back like any other.
    let check = |vm: &Vm| match verify_vm(vm, &nl_vmm::VmOutcome::Completed) {
        Ok(v) if v.digest_ok => Ok(()),
        Ok(v) => Err(v.error.unwrap_or_else(|| "digest mismatch".into())),
        Err(e) => Err(format!("cannot verify: {e:#}")),
    };
    let report = Supervisor::start(&vm, cfg)?.with_result_check(Box::new(check)).run()?;
    let v = verify_vm(&vm, &report.outcome)?;
    let (digest_ok, ops_per_sec, error) = (v.digest_ok, v.ops_per_sec, v.error);
    let rollback_ms = (!report.rollbacks.is_empty()).then(|| {
        report.rollbacks.iter().map(|r| r.rollback_ms).sum::<f64>() / report.rollbacks.len() as f64
    });
    let recovered = digest_ok && !report.rollbacks.is_empty();
    Ok(ProtectedRun {
        workload: a.workload.workload.name(),
        ok: digest_ok,
        digest_ok,
        recovered,
        ops_per_sec,
        latency_bound_ms: bound,
        rollback_ms,
        report,
        error,
    })
}

pub fn checkpoint(a: CheckpointArgs) -> Result<ExitCode> {
    let r = protected_run(&a, false)?;
    let rep = &r.report;
    println!(
        "{} under {} every {:.0} ms: {} checkpoints, {:.1} write faults and {:.1} pages ({:.3}% of memory) per interval, pause {:.2} ms avg / {:.2} max",
        r.workload, rep.mode, rep.interval_ms, rep.checkpoints, rep.faults_per_interval,
        rep.checkpoint_pages_avg, rep.checkpoint_pct_of_memory, rep.pause_ms_avg, rep.pause_ms_max
    );
    if rep.disk_writes > 0 {
        println!(
            "  {} disk checkpoints to {} ({} bytes; capture adds up to {:.1} ms of pause; {} skipped while a write was going)",
            rep.disk_writes,
            a.disk_path.display(),
            rep.disk_bytes_last,
            rep.disk_capture_ms_max,
            rep.disk_skipped
        );
    }
    for i in &rep.injections {
        println!("  injected at {:.0} ms: {:?}", i.at_ms, i.fault);
    }
    for rb in &rep.rollbacks {
        println!(
            "  rollback at {:.0} ms ({}): {:.2} ms, {} pages, {} level(s){}",
            rb.at_ms,
            rb.reason,
            rb.rollback_ms,
            rb.pages,
            rb.levels,
            if rb.checkpoint_after_fault {
                ", CHECKPOINT CORRUPTION: taken after the fault"
            } else {
                ""
            }
        );
    }
    println!("{}", crate::verify::digest_line(r.digest_ok, r.error.as_deref(), r.ops_per_sec));
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(if r.ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The machine a checkpoint file was saved from: memory, vCPUs, timer and
/// disk as its header names them.
fn saved_machine(h: &nl_checkpoint::disk::DiskHeader) -> crate::args::MachineArgs {
    crate::args::MachineArgs {
        mem: h.mem_bytes,
        vcpus: h.vcpus,
        timer_hz: h.timer_hz,
        disk: h.disk.as_ref().map(|d| d.path.clone()),
        disk_readonly: h.disk.as_ref().is_some_and(|d| d.readonly),
        ..Default::default()
    }
}

/// `ninelives restore FILE`: a VM from a disk checkpoint, run to completion.
pub fn restore(a: crate::args::RestoreArgs) -> Result<ExitCode> {
    // Everything is read and checked before a VM exists: a bad file never
    // leaves a half-restored VM.
    let key = a.key_file.as_deref().map(nl_checkpoint::disk::load_key).transpose()?;
    let ck = nl_checkpoint::disk::read(&a.file, key.as_ref())?;
    let h = &ck.header;
    if let Some(linux) = &h.linux {
        return restore_linux(&a, &ck, linux, key.is_some());
    }
    if let Some(d) = a.duration {
        bail!("--duration {d}: a reference-guest VM runs its workload to the end; --duration is for a Linux VM's file");
    }
    let m = saved_machine(h);
    let config = guest::vm_config(&m, h.workload, guest::kernel_image(&m)?, a.console.clone())?;
    let memory = ck.memory("restored")?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = Vm::restore(&kvm, 0, config, memory, &ck.state).context("cannot restore the VM")?;
    vm.start()?;
    // duration_ms is bounded by disk::read; saturate all the same.
    let limit_ms = h.workload.duration_ms.saturating_mul(4).saturating_add(120_000);
    let outcome = vm.wait(Duration::from_millis(limit_ms));
    let v = verify_vm(&vm, &outcome)?;
    let (digest_ok, error) = (v.digest_ok, v.error);
    println!(
        "restored {} pages from {}{} and ran to the end: digest {}{}",
        ck.pages.len(),
        a.file.display(),
        if key.is_some() { " (authenticated)" } else { "" },
        if digest_ok { "verified" } else { "NOT verified" },
        error.as_ref().map_or(String::new(), |e| format!(" ({e})"))
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"ok": digest_ok, "digest_ok": digest_ok, "pages": ck.pages.len(), "error": error})
        );
    }
    Ok(if digest_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `ninelives restore FILE` of a Linux VM's file (version 2): the VM is
/// rebuilt as a Linux VM (UART interrupt, i8042, PIT, its CPUID) over the
/// file's memory and state, and runs until the guest resets, it stops on
/// what the VMM cannot complete, or `--duration` passes. Its console goes on
/// from where it was saved; nothing is booted again.
fn restore_linux(
    a: &crate::args::RestoreArgs,
    ck: &nl_checkpoint::disk::DiskCheckpoint,
    linux: &nl_vmm::linux::LinuxRecord,
    authenticated: bool,
) -> Result<ExitCode> {
    use nl_vmm::linux::{LinuxOutcome, WaitStats};
    let secs = a.duration.unwrap_or(60.0);
    if !(secs.is_finite() && secs > 0.0 && secs <= 7.0 * 86400.0) {
        bail!("--duration {secs} is out of range (0 s, one week]");
    }
    let h = &ck.header;
    let m = saved_machine(h);
    // The kernel is in the saved memory: no image is loaded.
    let config = guest::vm_config(&m, h.workload, std::sync::Arc::default(), a.console.clone())?;
    let map = crate::run_linux::system_map(linux.system_map.as_deref()).unwrap_or_else(|e| {
        tracing::warn!("{e:#}; crashes are reported without guest symbols");
        None
    });
    let memory = ck.memory("restored")?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = Vm::restore_linux(&kvm, 0, config, memory, &ck.state, linux)
        .context("cannot restore the Linux VM")?;
    vm.start()?;
    let mut stats = WaitStats::default();
    let outcome = nl_vmm::linux::wait(&vm, Duration::from_secs_f64(secs), |_| false, &mut stats);
    let (ok, message) = match &outcome {
        LinuxOutcome::Reset => {
            (true, "the guest reset (reboot or power-off through the i8042)".to_string())
        }
        LinuxOutcome::TimedOut => {
            vm.stop();
            (true, format!("stopped after --duration {secs:.0} s"))
        }
        LinuxOutcome::Ended(o) => (false, nl_vmm::linux::describe_crash(&vm, o, map.as_ref())),
        LinuxOutcome::Reached => unreachable!("the wait only ends otherwise"),
    };
    println!(
        "restored a Linux VM ({} pages) from {}{}: {message}; int3 completed by #BP: {}; \
         fwait completed: {}; ldmxcsr/stmxcsr completed: {}",
        ck.pages.len(),
        a.file.display(),
        if authenticated { " (authenticated)" } else { "" },
        stats.int3_completed,
        stats.fwait_completed,
        stats.mxcsr_completed,
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"ok": ok, "linux": true, "pages": ck.pages.len(), "outcome": message})
        );
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
