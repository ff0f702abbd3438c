//! `ninelives run`: boot VMs, run a workload in each, verify every digest.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use nl_vmm::{Vm, VmConfig, VmOutcome};
use serde::Serialize;

use crate::args::RunArgs;
use crate::guest;
use crate::verify::verify_vm;

/// The result of one VM's run, as printed.
#[derive(Clone, Debug, Serialize)]
pub struct VmResult {
    pub id: u32,
    pub workload: &'static str,
    pub ok: bool,
    pub digest_ok: bool,
    pub ops: u64,
    pub ops_per_sec: f64,
    pub boot_ms: Option<f64>,
    /// filecache: requests served from the cache and read from the disk
    /// (measured period, all vCPUs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_misses: Option<u64>,
    /// virtio-net: interrupts the device raised and frames it moved (the
    /// tests show `--net-rx-irq` delivers interrupts and the guest answered).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_interrupts: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net: Option<nl_devices::virtio::net::NetStats>,
    /// virtio-net: what the guest reported taking (the net interrupts, and
    /// with `--net-rx-irq` which of its idle halts one of them ended).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest_net: Option<GuestNet>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The guest's own count of its net interrupts (all vCPUs; written by the
/// guest at the end of its run, `nl_abi::reg::NET_IRQS` and after).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct GuestNet {
    /// Net interrupts (`NET_VECTOR`) the guest took.
    pub irqs: u64,
    /// Idle halts a net interrupt ended.
    pub irq_wakes: u64,
    /// Idle halts that ended without one (the timer tick).
    pub other_wakes: u64,
}

/// Creates, starts and waits for `configs.len()` VMs in this process, then
/// verifies their digests.
pub fn run_vms(configs: &[VmConfig], quiet: bool) -> Result<Vec<VmResult>> {
    let kvm = nl_vmm::open_kvm()?;
    let mut vms = Vec::new();
    for (id, c) in configs.iter().enumerate() {
        let vm = Vm::create(&kvm, id as u32, c.clone())
            .with_context(|| format!("cannot create VM {id}"))?;
        vms.push(Arc::new(vm));
    }
    for vm in &vms {
        vm.start()?;
    }
    let longest = configs.iter().map(|c| c.workload.duration_ms).max().unwrap_or(0);
    let bar = progress(longest, quiet);
    let limit = Duration::from_millis(longest * 2 + 120_000);
    let outcomes: Vec<VmOutcome> = std::thread::scope(|s| {
        let waiters: Vec<_> = vms.iter().map(|vm| s.spawn(move || vm.wait(limit))).collect();
        while waiters.iter().any(|w| !w.is_finished()) {
            bar.tick();
            std::thread::sleep(Duration::from_millis(100));
        }
        waiters.into_iter().map(|w| w.join().unwrap_or(VmOutcome::Stopped)).collect()
    });
    bar.finish_and_clear();

    let mut results = Vec::new();
    for (vm, outcome) in vms.iter().zip(outcomes) {
        let report = vm.report();
        let filecache = vm.config().workload.kind == nl_abi::WORKLOAD_FILECACHE;
        let v = verify_vm(vm, &outcome)?;
        let (digest_ok, ops, ops_per_sec, error) = (v.digest_ok, v.ops, v.ops_per_sec, v.error);
        let mut tail = vm.console().tail();
        if error.is_some() && !tail.trim().is_empty() {
            tail.truncate(2000);
            eprintln!("--- console of VM {} ---\n{}", vm.id(), tail.trim_end());
        }
        results.push(VmResult {
            id: vm.id(),
            workload: nl_abi::workload_name(vm.config().workload.kind),
            ok: outcome == VmOutcome::Completed && digest_ok,
            digest_ok,
            ops,
            ops_per_sec,
            boot_ms: report.boot_ms,
            cache_hits: filecache.then(|| report.vcpus.iter().map(|v| v.regs.cache_hits).sum()),
            cache_misses: filecache.then(|| report.vcpus.iter().map(|v| v.regs.cache_misses).sum()),
            net_interrupts: vm.virtio_interrupts().1,
            net: vm.net_stats().map(|(s, _, _)| s),
            guest_net: vm.net_stats().is_some().then(|| {
                let sum = |f: fn(&nl_devices::control::VcpuRegsSnapshot) -> u64| {
                    report.vcpus.iter().map(|v| f(&v.regs)).sum()
                };
                GuestNet {
                    irqs: sum(|r| r.net_irqs),
                    irq_wakes: sum(|r| r.net_irq_wakes),
                    other_wakes: sum(|r| r.net_other_wakes),
                }
            }),
            error,
        });
    }
    Ok(results)
}

fn progress(duration_ms: u64, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} running guests for {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(format!("{:.1} s", duration_ms as f64 / 1000.0));
    bar
}

/// The VM configurations of `run --config FILE`, with the temporary disks
/// their workloads need.
fn configs_from_file(path: &std::path::Path) -> Result<(Vec<VmConfig>, Vec<guest::TempDisk>)> {
    let file = crate::vm_spec::ConfigFile::load(path, RUN_DEFAULT_DURATION)?;
    let mut temp_disks = Vec::new();
    let mut configs = Vec::new();
    for (i, spec) in file.vms.iter().enumerate() {
        let what = || format!("{}: vms[{i}]", path.display());
        if spec.kernel.is_some() {
            anyhow::bail!(
                "{}: a Linux VM (\"kernel\") is for `host --config`; boot one with \
                 `run --kernel FILE`",
                what()
            );
        }
        let mut s =
            spec.args(RUN_DEFAULT_DURATION).map_err(anyhow::Error::msg).with_context(what)?;
        let params = guest::workload_params(&s.workload, s.duration).with_context(what)?;
        match &s.machine.disk {
            Some(d) => guest::ensure_disk(d, guest::disk_size_for(&params)).with_context(what)?,
            None => {
                temp_disk_if_needed(&mut s.machine, &params, s.workload.workload, &mut temp_disks)?
            }
        }
        let kernel = guest::kernel_image(&s.machine).with_context(what)?;
        configs.push(guest::vm_config(&s.machine, params, kernel, s.console).with_context(what)?);
    }
    let disks: Vec<_> = configs.iter().filter_map(|c| c.disk.as_ref()).map(|d| &d.path).collect();
    for (i, d) in disks.iter().enumerate() {
        if disks[..i].contains(d) {
            anyhow::bail!(
                "{}: two VMs use the disk {}; VMs cannot share a disk image",
                path.display(),
                d.display()
            );
        }
    }
    Ok((configs, temp_disks))
}

/// blkbench and filecache without a disk: a temporary image for this VM,
/// kept in `temp_disks` (removed when they are dropped, at the end).
fn temp_disk_if_needed(
    m: &mut crate::args::MachineArgs,
    params: &nl_abi::WorkloadParams,
    workload: crate::args::WorkloadName,
    temp_disks: &mut Vec<guest::TempDisk>,
) -> Result<()> {
    if guest::disk_needed(params).is_some() && m.disk.is_none() {
        let t = guest::TempDisk::with_size(workload.name(), guest::disk_size_for(params))?;
        m.disk = Some(t.0.clone());
        temp_disks.push(t);
    }
    Ok(())
}

/// A configuration file's VM that names no duration runs this long (s).
pub const RUN_DEFAULT_DURATION: f64 = 3.0;

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let t0 = Instant::now();
    if let Some(path) = &a.config {
        let (configs, _temp_disks) = configs_from_file(path)?;
        return report(&a, run_vms(&configs, a.json)?, t0);
    }
    if a.vms == 0 || a.vms > 64 {
        anyhow::bail!("--vms {} is out of range 1..=64", a.vms);
    }
    let params = guest::workload_params(&a.workload, a.duration)?;
    let kernel = guest::kernel_image(&a.machine)?;
    if nl_arch::linux::image_kind(&kernel) != nl_arch::linux::ImageKind::Other {
        return crate::run_linux::run(&a, kernel);
    }
    if let Some(d) = &a.machine.disk {
        if a.vms > 1 && !a.machine.disk_readonly {
            anyhow::bail!("--disk with --vms {}: VMs cannot share a writable disk image", a.vms);
        }
        guest::ensure_disk(d, guest::disk_size_for(&params))?;
    }
    // blkbench, filecache without --disk: a temporary image per VM, removed at the end.
    let mut temp_disks = Vec::new();
    let mut configs = Vec::new();
    for _ in 0..a.vms {
        let mut m = a.machine.clone();
        temp_disk_if_needed(&mut m, &params, a.workload.workload, &mut temp_disks)?;
        configs.push(guest::vm_config(&m, params, kernel.clone(), a.console.clone())?);
    }
    let results = run_vms(&configs, a.json)?;
    report(&a, results, t0)
}

/// Prints the results (and the JSON line with --json); the exit status.
fn report(a: &RunArgs, results: Vec<VmResult>, t0: Instant) -> Result<ExitCode> {
    let host_ms = t0.elapsed().as_secs_f64() * 1e3;
    let all_ok = results.iter().all(|r| r.ok);

    for r in &results {
        let boot = r.boot_ms.map_or("-".to_string(), |b| format!("{b:.1} ms"));
        let status = if r.ok { "ok" } else { "FAILED" };
        let cache = match (r.cache_hits, r.cache_misses) {
            (Some(h), Some(m)) => format!(
                ", {h} cache hits, {m} misses ({:.1}% hits)",
                100.0 * h as f64 / (h + m).max(1) as f64
            ),
            _ => String::new(),
        };
        println!(
            "VM {}: {} {status}: digest {}, {} ops, {:.3e} ops/s{cache}, boot {boot}",
            r.id,
            r.workload,
            if r.digest_ok { "verified" } else { "NOT verified" },
            r.ops,
            r.ops_per_sec,
        );
        if let Some(e) = &r.error {
            println!("VM {}: {e}", r.id);
        }
    }
    println!(
        "{} of {} VMs verified in {:.0} ms ({})",
        results.iter().filter(|r| r.ok).count(),
        results.len(),
        host_ms,
        nl_arch::backend::Backend::detect()
    );
    if a.json {
        println!("{}", serde_json::json!({ "vms": results, "host_ms": host_ms }));
    }
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
