//! `ninelives bench recovery`: VMM recovery latency and normal-operation
//! overhead (the NiLiHype paper's section VII-B and C).
//!
//! * Latency: a netbench VM pinged every 1 ms from inside a network
//!   namespace of the bench's own (TAP 10.0.0.1/24, guest 10.0.0.2); a
//!   crash is injected inside a device of the VMM mid-run
//!   (`NINELIVES_DEVICE_FAULT=segv@MS`). The service interruption is the
//!   ping's longest gap; the VMM's own per-step times come from its
//!   `NINELIVES-RECOVERED` line. A run without a fault gives the gap the
//!   ping sees anyway on this machine.
//! * Overhead: VMM CPU time (user + system of the VMM process, minus the
//!   time its vCPUs spent in the guest) per workload, with recovery support
//!   on (microreset with and without the exit undo log, microreboot) over
//!   the same with `--recovery none`, measured in the same run.

use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::json_out::last_json;
use crate::netns::Netns;
use crate::process::{HostProc, RunDir};
use crate::stats::{median, ratio_interval};

#[derive(Args, Clone, Debug)]
pub struct BenchRecoveryArgs {
    /// Latency runs per mechanism.
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Overhead rounds per workload and configuration (interleaved).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..=100))]
    pub rounds: u32,
    /// Guest run time of each overhead measurement (seconds).
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// Skip the latency part (it needs root and a TAP).
    #[arg(long)]
    pub no_latency: bool,
    /// Skip the overhead part.
    #[arg(long)]
    pub no_overhead: bool,
    /// Print the results as one JSON line.
    #[arg(long)]
    pub json: bool,
}

/// A host with `args` (and the device fault `fault` armed), in `ns` if given.
fn start_host(
    dir: &Path,
    ns: Option<&Netns>,
    args: &[&str],
    fault: Option<&str>,
) -> Result<HostProc> {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!("h{}", N.fetch_add(1, Relaxed));
    let env: Vec<(&str, &str)> =
        fault.map(|f| (nl_vmm::selftest::DEVICE_FAULT_ENV, f)).into_iter().collect();
    HostProc::start(&dir.join(format!("{name}.sock")), ns, args, &env)
}

/// user+system ticks minus guest ticks of process `pid` (clock ticks).
fn vmm_ticks(pid: i32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rsplit_once(") ").map(|(_, r)| r).context("bad /proc stat")?;
    let f: Vec<u64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    // Fields from 3 (state) on: utime 14, stime 15, guest_time 43.
    let get = |n: usize| f.get(n - 3).copied().unwrap_or(0);
    Ok((get(14) + get(15)).saturating_sub(get(43)))
}

fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no memory effects.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

const CONFIGS: [(&str, &[&str]); 4] = [
    ("none", &["--recovery", "none"]),
    ("microreset", &["--recovery", "microreset"]),
    (
        "microreset_no_undo_log",
        &["--recovery", "microreset", "--repairs", "counters,locks,metadata,timers,memory"],
    ),
    ("microreboot", &["--recovery", "microreboot"]),
];

fn overhead(a: &BenchRecoveryArgs, dir: &Path) -> Result<Value> {
    let mut rows = Vec::new();
    let disk = dir.join("blk.img");
    nl_launch::guest::ensure_disk(&disk, nl_launch::guest::DEFAULT_DISK_BYTES)?;
    // The VMM's own CPU time is in clock ticks (10 ms): only exit-heavy
    // workloads give it enough to compare; compute shows the floor.
    for w in ["exits", "blkbench", "compute"] {
        // ms of VMM CPU per configuration, rounds interleaved.
        let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); CONFIGS.len()];
        for _ in 0..a.rounds {
            for (i, (_, args)) in CONFIGS.iter().enumerate() {
                let h = start_host(dir, None, args, None)?;
                let pid = h.pid();
                let mut req =
                    json!({"op":"create","workload":w,"mem":"64M","ws":"8M","duration":a.duration});
                if w == "blkbench" {
                    req["disk"] = json!(disk);
                }
                let r = h.api(req)?;
                let id = r["id"].as_u64().with_context(|| format!("create failed: {r}"))?;
                let t0 = vmm_ticks(pid)?;
                let st = h.wait_done(id, Duration::from_secs_f64(a.duration + 30.0))?;
                let t1 = vmm_ticks(pid)?;
                if st["state"] != "completed" {
                    bail!("{w} did not complete: {st}");
                }
                cpu[i].push((t1 - t0) as f64 / ticks_per_sec() * 1e3);
            }
        }
        let mut row = json!({"workload": w, "vmm_cpu_ms": {}, "ratio": {}, "ratio_ci95": {},
            "vmm_cpu_ms_samples": {}});
        for (i, (name, _)) in CONFIGS.iter().enumerate() {
            let r = ratio_interval(&cpu[i], &cpu[0]);
            row["vmm_cpu_ms"][*name] = json!(median(&cpu[i]));
            row["vmm_cpu_ms_samples"][*name] = json!(cpu[i]);
            row["ratio"][*name] = json!(r.ratio);
            row["ratio_ci95"][*name] = json!([r.lo, r.hi]);
        }
        rows.push(row);
    }
    Ok(json!(rows))
}

/// `ninelives ping` of the guest (10.0.0.2) from namespace `ns`, its JSON on stdout.
fn ping(ns: &Netns, interval: &str, secs: &str) -> Result<std::process::Output> {
    let mut c = ns.ninelives()?;
    c.args(["ping", "--target", "10.0.0.2", "--interval", interval, "--duration", secs, "--json"]);
    Ok(c.stderr(Stdio::null()).output()?)
}

fn latency(a: &BenchRecoveryArgs, dir: &Path) -> Result<Value> {
    let ns = Netns::with_tap(&format!("nlrec-{}", std::process::id()), "nlrtap0")?;
    let mut out = json!({});
    let fault_ms = 2500;
    for (name, args, fault) in [
        ("no_fault", &["--recovery", "none"][..], None),
        ("microreset", &["--recovery", "microreset"][..], Some(format!("segv@{fault_ms}"))),
        ("microreboot", &["--recovery", "microreboot"][..], Some(format!("segv@{fault_ms}"))),
    ] {
        let (mut gaps, mut internal, mut runs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.runs {
            let h = start_host(dir, Some(&ns), args, fault.as_deref())?;
            let r = h
                .api(json!({"op":"create","workload":"netbench","mem":"64M","duration":5.0,
                "net_tap":"nlrtap0","net_ip":"10.0.0.2/24"}))?;
            r["id"].as_u64().with_context(|| format!("create failed: {r}"))?;
            let t = Instant::now();
            while !ping(&ns, "10ms", "0.05")?.status.success() {
                if t.elapsed() > Duration::from_secs(10) {
                    bail!("the netbench guest never answered");
                }
            }
            let o = ping(&ns, "1ms", "3")?;
            let j = last_json(&String::from_utf8_lossy(&o.stdout)).unwrap_or(Value::Null);
            let gap = j["longest_gap_ms"].as_f64().unwrap_or(f64::NAN);
            let rec = h.proc.stderr.records(nl_vmm::recovery::RECOVERED_PREFIX);
            let total_ms = rec.first().and_then(|r| r["total_us"].as_f64()).map(|u| u / 1e3);
            if fault.is_some() && rec.is_empty() {
                runs.push(json!({"gap_ms": gap, "recovered": false}));
                continue;
            }
            gaps.push(gap);
            if let Some(t) = total_ms {
                internal.push(t);
            }
            runs.push(json!({"gap_ms": gap, "received": j["received"], "sent": j["sent"],
                "vmm_recovery_ms": total_ms, "record": rec.first()}));
        }
        out[name] = json!({
            "runs": runs, "recovered_runs": gaps.len(),
            "median_gap_ms": median(&gaps),
            "median_vmm_recovery_ms": median(&internal),
        });
    }
    let r = out["microreboot"]["median_gap_ms"].as_f64().unwrap_or(f64::NAN)
        / out["microreset"]["median_gap_ms"].as_f64().unwrap_or(f64::NAN);
    let ri = out["microreboot"]["median_vmm_recovery_ms"].as_f64().unwrap_or(f64::NAN)
        / out["microreset"]["median_vmm_recovery_ms"].as_f64().unwrap_or(f64::NAN);
    out["factor_gap_microreboot_over_microreset"] = json!(r);
    out["factor_internal_microreboot_over_microreset"] = json!(ri);
    Ok(out)
}

pub fn bench_recovery(a: BenchRecoveryArgs) -> Result<ExitCode> {
    let dir = RunDir::new("bench-recovery")?;
    let clock = crate::json_out::RunClock::start();
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_message("recovery: normal-operation overhead");
    pb.enable_steady_tick(Duration::from_millis(200));
    let over = if a.no_overhead { json!([]) } else { overhead(&a, &dir.0)? };
    let lat = if a.no_latency {
        json!({"skipped": "--no-latency"})
    } else {
        pb.set_message("recovery: latency (1 ms ping to a netbench VM)");
        latency(&a, &dir.0).unwrap_or_else(|e| json!({"skipped": format!("{e:#}")}))
    };
    pb.finish_and_clear();
    let v = json!({"bench": "recovery", "overhead": over, "latency": lat});
    let p = clock.finish();
    if a.json {
        println!("{}", crate::json_out::with_provenance(v, &p));
    } else {
        println!(
            "VMM CPU time with recovery support, relative to --recovery none (median of {} interleaved rounds [95% bootstrap interval]):",
            a.rounds
        );
        for r in over.as_array().into_iter().flatten() {
            let show = |k: &str| {
                let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
                format!(
                    "{:.3} [{:.3}, {:.3}]",
                    f(&r["ratio"][k]),
                    f(&r["ratio_ci95"][k][0]),
                    f(&r["ratio_ci95"][k][1])
                )
            };
            println!(
                "  {:9} microreset {}  (no undo log {})  microreboot {}   [none: {:.1} ms]",
                r["workload"].as_str().unwrap_or("?"),
                show("microreset"),
                show("microreset_no_undo_log"),
                show("microreboot"),
                r["vmm_cpu_ms"]["none"].as_f64().unwrap_or(f64::NAN),
            );
        }
        for m in ["no_fault", "microreset", "microreboot"] {
            let l = &lat[m];
            println!(
                "{m:12} longest ping gap {:.2} ms (median of {} runs), VMM recovery {:.3} ms",
                l["median_gap_ms"].as_f64().unwrap_or(f64::NAN),
                l["recovered_runs"],
                l["median_vmm_recovery_ms"].as_f64().unwrap_or(f64::NAN)
            );
        }
        for m in ["microreset", "microreboot"] {
            let Some(rec) =
                lat[m]["runs"].as_array().and_then(|r| r.iter().find_map(|r| r.get("record")))
            else {
                continue;
            };
            let steps: Vec<String> = rec["steps"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(rec["new_process_steps"].as_array().into_iter().flatten())
                .map(|s| {
                    format!(
                        "{} {:.0} us",
                        s["step"].as_str().unwrap_or("?"),
                        s["us"].as_f64().unwrap_or(0.0)
                    )
                })
                .collect();
            println!("  {m} steps (first run): {}", steps.join(", "));
        }
        println!(
            "microreboot / microreset: {:.1}x (ping gap), {:.1}x (VMM time); loadavg {} → {}; revision {}",
            lat["factor_gap_microreboot_over_microreset"].as_f64().unwrap_or(f64::NAN),
            lat["factor_internal_microreboot_over_microreset"].as_f64().unwrap_or(f64::NAN),
            p.loadavg_before,
            p.loadavg_after,
            p.git_revision
        );
    }
    Ok(ExitCode::SUCCESS)
}
