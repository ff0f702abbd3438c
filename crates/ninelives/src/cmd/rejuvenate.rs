//! `ninelives rejuvenate`: replace a running host's VMM process while its
//! VMs survive (warm), are rebooted (cold), or go through disk (save-restore).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// On-memory suspend, exec the new VMM with the memfds, on-memory resume.
    Warm,
    /// Shut the VMs down, restart the VMM, boot them again (their state is lost).
    Cold,
    /// Write each VM's memory and state to disk, restart, restore from disk.
    SaveRestore,
}

impl ModeArg {
    fn name(self) -> &'static str {
        match self {
            ModeArg::Warm => "warm",
            ModeArg::Cold => "cold",
            ModeArg::SaveRestore => "save-restore",
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct RejuvenateArgs {
    /// Unix socket of the running host.
    #[arg(long)]
    pub api: PathBuf,
    /// How the VMs get to the new VMM process.
    #[arg(long, value_enum, default_value_t = ModeArg::Warm)]
    pub mode: ModeArg,
    /// Start this binary instead of the running one (an upgrade).
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// save-restore: directory for the memory images (default /var/tmp).
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// How long the new VMM may take to become ready before the handover is
    /// rolled back (a number of seconds, or e.g. 90s, 2min).
    #[arg(long, default_value = "60", value_parser = nl_launch::args::secs)]
    pub timeout: f64,
    /// Warm: start the new VMM during the pause instead of before it (by
    /// default it starts first and builds the VMs while they still run, so
    /// only their state crosses the pause).
    #[arg(long)]
    pub no_prespawn: bool,
    /// Print the report as one JSON object on the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

fn abs(p: &std::path::Path) -> Result<String> {
    Ok(std::path::absolute(p)
        .with_context(|| format!("bad path {}", p.display()))?
        .display()
        .to_string())
}

pub fn rejuvenate(a: RejuvenateArgs) -> Result<ExitCode> {
    if !(a.timeout.is_finite() && a.timeout > 0.0 && a.timeout <= 3600.0) {
        anyhow::bail!("--timeout must be between 0 and 3600 seconds");
    }
    let mut req = json!({"op": "rejuvenate", "mode": a.mode.name(), "timeout_secs": a.timeout,
        "prespawn": !a.no_prespawn});
    if let Some(b) = &a.binary {
        req["binary"] = json!(abs(b)?);
    }
    if let Some(d) = &a.image_dir {
        req["image_dir"] = json!(abs(d)?);
    }
    let reply = nl_vmm::api::request_timeout(&a.api, &req, Duration::from_secs(3600))?;
    if reply.get("ok") != Some(&Value::Bool(true)) {
        let e = reply.get("error").and_then(Value::as_str).unwrap_or("no reason given");
        anyhow::bail!("the host refused to rejuvenate: {e}");
    }
    let r = &reply["report"];
    let ok = r["ok"] == Value::Bool(true);
    if a.json {
        println!("{r}");
    } else {
        print_human(r);
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn ms(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.2} ms"))
}

fn print_human(r: &Value) {
    let mode = r["mode"].as_str().unwrap_or("?");
    if r["ok"] == Value::Bool(true) {
        println!(
            "{mode} rejuvenation done: pid {} -> {}, total downtime {}, longest heartbeat gap {}",
            r["old_pid"],
            r["new_pid"],
            ms(&r["total_downtime_ms"]),
            ms(&r["max_heartbeat_gap_ms"])
        );
    } else {
        println!(
            "{mode} rejuvenation FAILED{}: {}",
            if r["rolled_back"] == Value::Bool(true) {
                ", rolled back: the VMs run in the old VMM"
            } else {
                ""
            },
            r["error"].as_str().unwrap_or("unknown error")
        );
    }
    for v in r["vms"].as_array().into_iter().flatten() {
        println!(
            "  VM {}: pause {}, save {}, downtime {}, heartbeat gap {}",
            v["id"],
            ms(&v["pause_ms"]),
            ms(&v["save_ms"]),
            ms(&v["downtime_ms"]),
            ms(&v["heartbeat_gap_ms"])
        );
    }
    if let Some(e) = r["error"].as_str().filter(|_| r["ok"] == Value::Bool(true)) {
        println!("  note: {e}");
    }
}
