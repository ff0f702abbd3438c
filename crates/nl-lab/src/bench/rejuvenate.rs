//! `ninelives bench rejuvenate`: downtime of warm, cold and save-restore
//! rejuvenation of a host running n VMs of a given memory size, for several
//! n and sizes, and the paper's section 5.6 downtime model fitted to
//! measured terms for n = 1..N.
//!
//! In each grid row VM 0 is a netbench VM (UDP echo) on a TAP in a network
//! namespace the bench creates, pinged every 1 ms from inside it across each
//! rejuvenation (`bench_rejuvenate_ping`): the longest gap between replies
//! and the pings lost are the externally visible downtime, next to a ping
//! baseline without a rejuvenation. The other n-1 VMs run memwrite over all
//! but 64 MiB of their memory. Without root the ping part is
//! skipped (said in the output) and all n VMs run memwrite. Per VM, the
//! pause, downtime and guest heartbeat gap come from the host's report.
//!
//! Then the paper's Figure 8, `filecache` throughput after each kind of
//! reboot (`bench_rejuvenate_cache`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::bench::rejuvenate_ping::{self as ping, PingNet};
use nl_launch::args::parse_size;

#[derive(Args, Clone, Debug)]
pub struct BenchRejuvenateArgs {
    /// VM counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub vms: Vec<u32>,
    /// Guest memory sizes to measure (memwrite touches all but 64 MiB of each).
    #[arg(long, value_delimiter = ',', default_value = "256M,2G", value_parser = parse_size)]
    pub mem: Vec<u64>,
    /// Largest n for the downtime model (256 MiB VMs, n = 1..N).
    #[arg(long, default_value_t = 6)]
    pub model_max: u32,
    /// Directory for save-restore images.
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Skip the filecache throughput measurement (Figure 8).
    #[arg(long)]
    pub no_filecache: bool,
    /// Draw the filecache throughput over time (Figure 8) as SVG here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Repetitions of every (VMs, memory) cell (at least 3); each
    /// repetition runs warm, save-restore and cold (the baseline) in turn,
    /// so the modes interleave. Every run is kept (`runs`, with `rep`);
    /// `summary` gives the median and spread per cell and mode.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..))]
    pub reps: u32,
    /// Skip the sandbox-set rows (`--reps` warm rejuvenations of a host
    /// holding a sandbox set with its own TAP, the same under `rollback`,
    /// then a set on a shared link with two members, pinged every 1 ms;
    /// and the microreboot rows).
    #[arg(long)]
    pub no_sandbox_set: bool,
}

/// A host of this bench: a [`crate::process::HostProc`] whose process
/// group (the host and the successors of its rejuvenations) an interrupted
/// bench kills.
pub(crate) struct HostProc(crate::process::HostProc);

impl HostProc {
    /// Starts a host, inside the ping namespace if there is one (its VMs
    /// attach the namespace's TAP).
    pub(crate) fn start(sock: &Path, net: Option<&PingNet>) -> Result<Self> {
        Self::start_with(sock, net, &[], &[])
    }

    /// [`HostProc::start`] with extra arguments and environment.
    pub(crate) fn start_with(
        sock: &Path,
        net: Option<&PingNet>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let h = crate::process::HostProc::start(sock, net.map(PingNet::netns), extra, env)
            .context("cannot start a host")?;
        ping::kill_host_on_signal(h.pid() as u32);
        Ok(Self(h))
    }

    pub(crate) fn req(&self, v: Value) -> Result<Value> {
        self.0.req_within(v, Duration::from_secs(3600))
    }

    /// The host's last `NINELIVES-RECOVERED` record (its recovery's steps).
    pub(crate) fn recovered(&self) -> Option<Value> {
        self.0.proc.stderr.records("NINELIVES-RECOVERED ").pop()
    }
}

impl Drop for HostProc {
    fn drop(&mut self) {
        let _ = self.0.req(json!({"op":"shutdown"}));
        // Forgotten by the signal handler before the process is reaped.
        ping::kill_host_group(self.0.pid() as u32);
    }
}

/// Waits until every vCPU of every VM heartbeats after its warm-up round
/// (which touches the whole working set).
fn wait_running(h: &HostProc, ids: &[u64]) -> Result<()> {
    let t = Instant::now();
    for &id in ids {
        loop {
            let s = &h.req(json!({"op":"stats","id":id}))?["stats"];
            if s["state"] != "running" {
                bail!("VM {id} is {}", s["state"]);
            }
            let v = s["vcpus"].as_array().cloned().unwrap_or_default();
            if !v.is_empty() && v.iter().all(|c| c["regs"]["beats"].as_u64().unwrap_or(0) > 0) {
                break;
            }
            if t.elapsed() > Duration::from_secs(900) {
                bail!("VM {id} did not reach its measured phase");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Creates n VMs of `mem` bytes: memwrite, except VM 0 which is the pinged
/// netbench VM when `netbench` is set.
fn create_vms(h: &HostProc, n: u32, mem: u64, netbench: bool) -> Result<Vec<u64>> {
    let ws = mem.saturating_sub(64 << 20).max(1 << 20);
    (0..n)
        .map(|i| {
            let req = if i == 0 && netbench {
                PingNet::netbench_vm(mem, 86_000.0)
            } else {
                json!({"op":"create","workload":"memwrite","mem":mem,"ws":ws,
                    "duration":86_000,"seed":i + 1,"pattern":"sequential"})
            };
            let r = h.req(req)?;
            Ok(r["id"].as_u64().unwrap_or(0))
        })
        .collect()
}

pub(super) fn rejuvenate(h: &HostProc, mode: &str, image_dir: &Option<PathBuf>) -> Result<Value> {
    let mut req = json!({"op":"rejuvenate","mode":mode,"timeout_secs":600});
    if let Some(d) = image_dir {
        req["image_dir"] = json!(d);
    }
    let r = h.req(req)?;
    let rep = r["report"].clone();
    if rep["ok"] != true {
        bail!("{mode} rejuvenation failed: {}", rep["error"]);
    }
    Ok(rep)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn max_of(rep: &Value, key: &str) -> f64 {
    rep["vms"].as_array().into_iter().flatten().map(|v| f(&v[key])).fold(f64::NAN, f64::max)
}

/// Least-squares line y = a·n + b and its r².
fn fit(points: &[(f64, f64)]) -> Value {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let syy: f64 = points.iter().map(|(_, y)| (y - my).powi(2)).sum();
    let a = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let b = my - a * mx;
    let r2 = if sxx > 0.0 && syy > 0.0 { sxy * sxy / (sxx * syy) } else { 1.0 };
    json!({"per_vm_ms": a, "constant_ms": b, "r2": r2,
        "points": points.iter().map(|(x, y)| json!([x, y])).collect::<Vec<_>>()})
}

pub fn bench(a: BenchRejuvenateArgs) -> Result<ExitCode> {
    if a.vms.iter().any(|&n| n == 0 || n > 64) || a.model_max == 0 || a.model_max > 64 {
        bail!("VM counts must be between 1 and 64");
    }
    let clock = crate::json_out::RunClock::start();
    // Before any thread starts: an interrupted bench still deletes its
    // namespace and stops its host.
    ping::cleanup_on_signals();
    // Declared before the host: dropped (namespace deleted) after it.
    let (net, ping_info) = ping::setup(a.json);
    let dir = tempfile_dir()?;
    let sock = dir.join("api.sock");
    let h = HostProc::start(&sock, net.as_ref())?;
    let mut runs = Vec::new();
    for &mem in &a.mem {
        for &n in &a.vms {
            let ids = create_vms(&h, n, mem, net.is_some())?;
            wait_running(&h, &ids)?;
            let baseline = ping::baseline(net.as_ref())?;
            if let (Some(b), false) = (&baseline, a.json) {
                println!("{n} x {:>5} MiB, no rejuvenation: {}", mem >> 20, ping::describe(b));
            }
            for (r, mode) in
                (0..a.reps).flat_map(|r| ["warm", "save-restore", "cold"].map(|m| (r, m)))
            {
                let (rep, ping_row) =
                    ping::across(net.as_ref(), || rejuvenate(&h, mode, &a.image_dir))?;
                let row = json!({
                    "mode": mode, "vms": n, "mem_bytes": mem, "rep": r,
                    "total_downtime_ms": rep["total_downtime_ms"],
                    "max_pause_ms": max_of(&rep, "pause_ms"),
                    "max_vm_downtime_ms": max_of(&rep, "downtime_ms"),
                    "max_heartbeat_gap_ms": rep["max_heartbeat_gap_ms"],
                    "max_boot_done_ms": max_of(&rep, "boot_done_ms"),
                    "per_vm": rep["vms"], "phases": rep["phases"],
                    "ping": ping_row, "ping_baseline": baseline,
                });
                if !a.json {
                    println!(
                        "{mode:<12} {n} x {:>5} MiB: total downtime {:>9.2} ms, per-VM pause max {:>6.2} ms, per-VM downtime max {:>9.2} ms, heartbeat gap max {:>9.2} ms{}",
                        mem >> 20,
                        f(&row["total_downtime_ms"]),
                        f(&row["max_pause_ms"]),
                        f(&row["max_vm_downtime_ms"]),
                        f(&row["max_heartbeat_gap_ms"]),
                        if row["ping"].is_object() {
                            format!(", {}", ping::describe(&row["ping"]))
                        } else {
                            String::new()
                        },
                    );
                    if row["ping"]["answered_again"] == false {
                        println!("  the netbench VM did not answer pings again after {mode}");
                    }
                }
                runs.push(row);
                wait_running(&h, &ids)?;
            }
            for id in ids {
                h.req(json!({"op":"destroy","id":id}))?;
            }
        }
    }
    let (sandbox_set, sandbox_rollback, sandbox_link) = if a.no_sandbox_set {
        (Value::Null, Value::Null, Value::Null)
    } else {
        (
            crate::bench::rejuvenate_sandbox::rows(&h, net.as_ref(), a.reps, a.json)?,
            crate::bench::rejuvenate_sandbox::rollback_rows(&h, net.as_ref(), a.reps, a.json)?,
            crate::bench::rejuvenate_sandbox::link_rows(&h, net.as_ref(), a.reps, a.json)?,
        )
    };
    let model = model(&h, a.model_max, &a.image_dir, a.json)?;
    drop(h);
    let sandbox_microreboot = if a.no_sandbox_set {
        Value::Null
    } else {
        crate::bench::rejuvenate_sandbox::microreboot_rows(
            &dir.join("mr.sock"),
            net.as_ref(),
            a.reps,
            a.json,
        )?
    };
    drop(net);
    let _ = std::fs::remove_dir_all(&dir);
    let mut not_measured = Vec::new();
    if let Some(why) = ping_info["skipped"].as_str() {
        not_measured.push(format!(
            "external ping gap: skipped ({why}); per-VM pause, downtime and guest heartbeat gap reported instead"
        ));
    }
    let filecache = if a.no_filecache {
        Value::Null
    } else {
        crate::bench::rejuvenate_cache::measure(&a.image_dir, a.plot.as_deref(), a.json, a.reps)?
    };
    if a.json {
        let v = json!({
            "reps": a.reps, "runs": runs, "summary": summary(&runs), "model": model, "ping": ping_info, "filecache": filecache,
            "sandbox_set": sandbox_set, "sandbox_rollback": sandbox_rollback,
            "sandbox_link": sandbox_link,
            "sandbox_microreboot": sandbox_microreboot,
            "not_measured": not_measured,
        });
        println!("{}", crate::json_out::with_provenance(v, &clock.finish()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Median, min and max of the downtimes per (mode, VMs, memory) over the
/// repetitions in `runs`.
fn summary(runs: &[Value]) -> Vec<Value> {
    let mut keys: Vec<(Value, Value, Value)> = Vec::new();
    for r in runs {
        let k = (r["mode"].clone(), r["vms"].clone(), r["mem_bytes"].clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(mode, vms, mem)| {
            let cell: Vec<&Value> = runs
                .iter()
                .filter(|r| r["mode"] == mode && r["vms"] == vms && r["mem_bytes"] == mem)
                .collect();
            let s = |k: &str| {
                let v: Vec<f64> = cell.iter().map(|r| f(&r[k])).collect();
                serde_json::to_value(crate::stats::Summary::of(&v)).unwrap_or(Value::Null)
            };
            json!({
                "mode": mode, "vms": vms, "mem_bytes": mem, "reps": cell.len(),
                "total_downtime_ms": s("total_downtime_ms"),
                "max_vm_downtime_ms": s("max_vm_downtime_ms"),
                "max_pause_ms": s("max_pause_ms"),
            })
        })
        .collect()
}

/// The section 5.6 model on our VMM, from warm and cold rejuvenations of
/// n = 1..N 256 MiB VMs:
/// D_warm(n) = suspend(n) + reboot_vmm(n) + resume(n),
/// D_cold(n) = shutdown_os(n) + reset_hw + reboot_vmm(n) + boot(n),
/// with reset_hw = 0 (a process restart resets no hardware) and
/// r(n) = D_cold(n) − D_warm(n).
fn model(h: &HostProc, max: u32, image_dir: &Option<PathBuf>, quiet: bool) -> Result<Value> {
    let mut t: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
    for n in 1..=max {
        let ids = create_vms(h, n, 256 << 20, false)?;
        wait_running(h, &ids)?;
        let x = f64::from(n);
        let w = rejuvenate(h, "warm", image_dir)?;
        let p = &w["phases"];
        t.entry("suspend").or_default().push((x, f(&p["suspend_ms"])));
        // With a standby successor (the default) the VMM restart happens
        // before the pause and is not part of D_warm.
        t.entry("reboot_vmm").or_default().push((x, f(&p["exec_ms"]) + f(&p["standby_ms"])));
        let resume = f(&p["restore_ms"]) + f(&p["start_ms"]);
        t.entry("resume").or_default().push((x, resume));
        let dw = f(&w["total_downtime_ms"]);
        t.entry("d_warm").or_default().push((x, dw));
        wait_running(h, &ids)?;
        let c = rejuvenate(h, "cold", image_dir)?;
        let p = &c["phases"];
        t.entry("shutdown_os").or_default().push((x, f(&p["shutdown_ms"])));
        t.entry("reboot_vmm_cold").or_default().push((x, f(&p["exec_ms"])));
        // Boot: create the VMs, start them, until the last guest reached its workload.
        let boot_done = max_of(&c, "boot_done_ms");
        let started = max_of(&c, "downtime_ms");
        let boot = f(&p["restore_ms"]) + f(&p["start_ms"]) + (boot_done - started);
        t.entry("boot").or_default().push((x, boot));
        let dc = boot_done;
        t.entry("d_cold").or_default().push((x, dc));
        t.entry("r").or_default().push((x, dc - dw));
        if !quiet {
            println!("model n={n}: D_warm {dw:.2} ms, D_cold {dc:.2} ms, r(n) {:.2} ms", dc - dw);
        }
        wait_running(h, &ids)?;
        for id in ids {
            h.req(json!({"op":"destroy","id":id}))?;
        }
    }
    let fits: serde_json::Map<String, Value> =
        t.iter().map(|(k, v)| (k.to_string(), fit(v))).collect();
    if !quiet {
        for (k, v) in &fits {
            println!(
                "  {k}(n) = {:.3} n + {:.3} ms (r2 {:.3})",
                f(&v["per_vm_ms"]),
                f(&v["constant_ms"]),
                f(&v["r2"])
            );
        }
    }
    Ok(json!({
        "vm_mem_bytes": 256u64 << 20,
        "reset_hw_ms": 0.0,
        "definitions": {
            "d_warm": "suspend + reboot_vmm + resume: first pause to last VM running again; with a standby successor (default) reboot_vmm happens before the pause and d_warm = suspend + resume",
            "reboot_vmm": "start of the new VMM process to every VM built in it (exec + standby), whether or not inside the pause",
            "resume": "states loaded (restore) + vCPUs started; tearing the old VMs down happens after the commit, outside the downtime",
            "d_cold": "shutdown_os + reset_hw + reboot_vmm + boot: first pause to last rebooted guest back in its workload",
            "reset_hw": "0: a VMM process restart resets no hardware",
            "r": "d_cold - d_warm, the downtime warm-VM reboot saves"
        },
        "fits": fits,
    }))
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("ninelives-bench-rejuvenate-{}", std::process::id()));
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    Ok(d)
}
