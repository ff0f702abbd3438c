//! `ninelives sandbox --config FILE`: starts a set of sandboxes (isolated
//! VMs joined by shared-memory channels) from a configuration file,
//! supervises them, and reports each one's outcome, result check and
//! isolation violations. The schema is in docs/sandboxes.md.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use nl_sandbox::{Images, SandboxSet, SetConfig};

#[derive(Args, Clone, Debug)]
pub struct SandboxArgs {
    /// The sandbox configuration (JSON).
    #[arg(long)]
    pub config: std::path::PathBuf,
    /// Seconds after which sandboxes still running are stopped.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// Only check the configuration and the isolation audit: create the
    /// sandboxes, print their layout, start nothing.
    #[arg(long)]
    pub check: bool,
    /// Print one JSON object (the report) as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// The embedded reference guest.
pub fn images() -> Images {
    nl_launch::guest::sandbox_images()
}

pub fn run(a: SandboxArgs) -> Result<ExitCode> {
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 86_400.0) {
        anyhow::bail!("--timeout must be a number of seconds in (0, 86400]");
    }
    let config = SetConfig::load(&a.config)?;
    let kvm = nl_vmm::open_kvm()?;
    let set = SandboxSet::create(&kvm, config, &images())
        .with_context(|| format!("sandbox configuration {}", a.config.display()))?;
    for sb in &set.sandboxes {
        println!(
            "sandbox {}: {} MiB, {} vCPU(s) on cores {:?}, workload {}, {} channel(s), on violation: {:?}, recovery: {}",
            sb.config.name,
            sb.config.mem_mib,
            sb.config.vcpus(),
            sb.config.cores,
            sb.config.workload.kind,
            set.config.channels_of(&sb.config.name).len(),
            sb.config.on_violation,
            sb.config.recovery.policy.name(),
        );
    }
    println!("isolation audit: {} memory slots checked, passed", set.mappings.len());
    if a.check {
        return Ok(ExitCode::SUCCESS);
    }
    set.start_all()?;
    let report = set.supervise(Duration::from_secs_f64(a.timeout));
    for s in &report.sandboxes {
        let check =
            if s.verified { "verified".to_string() } else { s.problem.clone().unwrap_or_default() };
        println!("sandbox {}: {}; {check}; {} violation(s)", s.name, s.message, s.violations);
        for v in &s.violation_log {
            println!(
                "  violation: sandbox {} vCPU {} wrote {} byte(s) at gpa {:#x} (rip {:#x})",
                v.sandbox, v.cpu, v.len, v.gpa, v.rip
            );
        }
        for r in &s.recoveries {
            let ph = &r.phases;
            let at = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
            println!(
                "  recovery ({}) after {} at {:.1} ms: {}; phases (ms after detection): stopped {}, peers notified {}, new image {}, re-entry {}, guest init {}, first message {}",
                r.policy,
                r.detection.detector.name(),
                r.detection.at_ms,
                if r.ok { "ok".to_string() } else { format!("FAILED: {}", r.error.clone().unwrap_or_default()) },
                at(ph.stopped_ms),
                at(ph.notified_ms),
                at(ph.image_ms),
                at(ph.reentry_ms),
                at(ph.guest_init_ms),
                at(ph.first_reply_ms)
            );
        }
        if let Some(why) = &s.gave_up {
            println!("  {why}");
        }
    }
    for c in &report.channels {
        println!(
            "channel {} ({} <-> {}): generations {:#x}/{:#x}, heads {}/{} words",
            c.name,
            c.between[0],
            c.between[1],
            c.regions[0].generation,
            c.regions[1].generation,
            c.regions[0].head_words,
            c.regions[1].head_words
        );
        for (end, r) in c.between.iter().zip(&c.regions) {
            println!(
                "  {end} received {}, rejected {}, corrupt {}, lost {}, duplicated {}",
                r.received, r.rejected, r.corrupt, r.lost, r.duplicated
            );
        }
    }
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(if report.all_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
