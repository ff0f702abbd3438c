//! `ninelives bench replicate`: memwrite under replication relative to the
//! unreplicated VM measured in the same run, per optimization and epoch
//! length, and the failover time of a killed primary.

use std::net::{SocketAddr, TcpListener};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use nl_replicate::backup::{serve, BackupConfig, BackupEnd};
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::cli::{MachineArgs, PatternName, WorkloadArgs};
use crate::cmd::replicate::{run_primary, PrimaryArgs};
use crate::guest;
use crate::verify::verify_vcpus;

#[derive(Args, Clone, Debug)]
pub struct BenchReplicateArgs {
    /// Seconds per run.
    #[arg(long, default_value_t = 1.5)]
    pub duration: f64,
    /// Epoch lengths (ms) for the sweep with all optimizations.
    #[arg(long, value_delimiter = ',', default_values_t = vec![20u64, 50, 100, 200])]
    pub epochs: Vec<u64>,
    /// Primary kills for the failover measurement (0: skip).
    #[arg(long, default_value_t = 3)]
    pub kills: u32,
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    pattern: &'static str,
    config: &'static str,
    epoch_ms: u64,
    ok: bool,
    ops_per_sec: f64,
    ratio: f64,
    epochs: u64,
    pages_per_epoch: f64,
    write_faults_per_epoch: f64,
    pause_ms_avg: f64,
    pause_ms_max: f64,
    copy_ms_avg: f64,
    send_in_pause_ms_avg: f64,
    send_after_ms_avg: f64,
    ack_wait_ms_avg: f64,
}

fn free_port() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

fn workload(pattern: PatternName) -> WorkloadArgs {
    WorkloadArgs { pattern, ..Default::default() }
}

fn unreplicated(w: &WorkloadArgs, duration: f64) -> Result<f64> {
    let m = MachineArgs::default();
    let config =
        guest::vm_config(&m, guest::workload_params(w, duration)?, guest::kernel_image(&m)?, None)?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = Vm::create(&kvm, 0, config)?;
    vm.start()?;
    let o = vm.wait(Duration::from_secs_f64(duration * 4.0 + 60.0));
    if o != VmOutcome::Completed {
        anyhow::bail!("unreplicated run: {}", o.message());
    }
    let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
    let tsc = nl_arch::read_boot_info(vm.memory().mem())?.tsc_khz;
    Ok(verify_vcpus(&vm.config().workload, &regs, tsc).iter().map(|v| v.ops_per_sec).sum())
}

fn replicated(
    w: &WorkloadArgs,
    duration: f64,
    epoch: u64,
    selective: bool,
    direct: bool,
) -> Result<crate::cmd::replicate::PrimaryRun> {
    let addr = free_port()?;
    let m = MachineArgs::default();
    let cfg = BackupConfig {
        listen: addr,
        allow: None,
        secret: "bench".into(),
        mem_bytes: m.mem,
        vcpus: m.vcpus,
        lease: Duration::from_secs(2),
        heartbeat: Duration::from_millis(100),
    };
    let backup = std::thread::spawn(move || serve(&cfg, &mut |_| {}));
    std::thread::sleep(Duration::from_millis(50));
    let a = PrimaryArgs {
        backup: addr,
        epoch,
        lease_ms: 2000,
        secret: "bench".into(),
        selective,
        direct,
        pipeline: 0,
        reattach: false,
        workload: w.clone(),
        machine: m,
        duration,
        console: None,
        json: true,
    };
    let r = run_primary(&a, true);
    match backup.join() {
        Ok(Ok(BackupEnd::PrimaryFinished { .. })) => {}
        Ok(Ok(_)) => anyhow::bail!("the bench backup did not end with the primary"),
        Ok(Err(e)) => anyhow::bail!("bench backup: {e}"),
        Err(_) => anyhow::bail!("bench backup thread panicked"),
    }
    r
}

/// Kills a primary process mid-run and reads the backup's takeover report.
fn failover_once(duration: f64) -> Result<serde_json::Value> {
    let exe = std::env::current_exe()?;
    let addr = free_port()?;
    let backup = Command::new(&exe)
        .args(["replicate", "backup", "--listen", &addr.to_string(), "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(200));
    let mut primary = Command::new(&exe)
        .args(["replicate", "primary", "--backup", &addr.to_string(), "--epoch", "20"])
        .args(["--duration", &duration.to_string(), "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_secs_f64(duration / 2.0 + 0.3));
    let _ = primary.kill();
    let _ = primary.wait();
    let out = backup.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("").to_string();
    serde_json::from_str(&last).with_context(|| format!("backup printed no report: {text}"))
}

pub fn bench(a: BenchReplicateArgs) -> Result<ExitCode> {
    let t = Instant::now();
    let mut rows = Vec::new();
    let mut all_ok = true;
    for (pname, pattern) in
        [("sequential", PatternName::Sequential), ("random", PatternName::Random)]
    {
        let w = workload(pattern);
        let base = unreplicated(&w, a.duration)?;
        eprintln!("{pname}: unreplicated {base:.3e} ops/s");
        let mut cases: Vec<(&'static str, u64, bool, bool)> = vec![
            ("none", 20, false, false),
            ("+selective", 20, true, false),
            ("+selective+transfer", 20, true, true),
        ];
        for &e in &a.epochs {
            if e != 20 {
                cases.push(("+selective+transfer", e, true, true));
            }
        }
        for (name, epoch, sel, direct) in cases {
            let r = replicated(&w, a.duration, epoch, sel, direct)?;
            let p = &r.report;
            all_ok &= r.ok;
            let row = Row {
                pattern: pname,
                config: name,
                epoch_ms: epoch,
                ok: r.ok,
                ops_per_sec: r.ops_per_sec,
                ratio: r.ops_per_sec / base,
                epochs: p.epochs,
                pages_per_epoch: p.pages_per_epoch,
                write_faults_per_epoch: p.write_faults_per_epoch,
                pause_ms_avg: p.pause_ms_avg,
                pause_ms_max: p.pause_ms_max,
                copy_ms_avg: p.copy_ms_avg,
                send_in_pause_ms_avg: p.send_in_pause_ms_avg,
                send_after_ms_avg: p.send_after_ms_avg,
                ack_wait_ms_avg: p.ack_wait_ms_avg,
            };
            eprintln!(
                "{pname} {name} @{epoch} ms: {:.2} of unreplicated, {:.0} faults/epoch, pause {:.2} ms (copy {:.2}, send in pause {:.2}), send after {:.2}, ack wait {:.2}{}",
                row.ratio, row.write_faults_per_epoch, row.pause_ms_avg, row.copy_ms_avg,
                row.send_in_pause_ms_avg, row.send_after_ms_avg, row.ack_wait_ms_avg,
                if r.ok { "" } else { " DIGEST NOT VERIFIED" }
            );
            rows.push(row);
        }
    }
    let mut failovers = Vec::new();
    for _ in 0..a.kills {
        let f = failover_once(a.duration.max(2.0))?;
        all_ok &= f["ok"].as_bool().unwrap_or(false);
        eprintln!(
            "failover: VM running {:.1} ms after detection, {:.1} ms after the last frame; digest ok: {}",
            f["takeover_ms"].as_f64().unwrap_or(f64::NAN),
            f["since_last_frame_ms"].as_f64().unwrap_or(f64::NAN),
            f["ok"]
        );
        failovers.push(f);
    }
    let out = serde_json::json!({
        "rows": rows,
        "failovers": failovers,
        "prediction": "not implemented",
        "kv": "not measured: the kv workload and kvload client do not exist yet",
        "ok": all_ok,
        "host_ms": t.elapsed().as_secs_f64() * 1e3,
    });
    if a.json {
        println!("{out}");
    }
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
