//! `ninelives host` (a long-running VMM driven over a Unix socket) and
//! `ninelives api` (send it one request).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::cli::{
    parse_size, ApiArgs, HostArgs, MachineArgs, PatternName, WorkloadArgs, WorkloadName,
};
use nl_launch::guest;

/// A size given as a number of bytes or a string such as "256M".
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub(crate) enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes(&self) -> Result<u64, String> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => parse_size(t),
        }
    }
}

/// A VM to create (`POST /v1/vms`, or the JSON-lines `create`); every
/// field is optional. Sizes are bytes or strings such as "256M".
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CreateVm")]
pub(crate) struct CreateRequest {
    /// The JSON-lines operation ("create"); set by the path over HTTP.
    #[allow(dead_code)]
    #[schemars(skip)]
    op: String,
    /// The reference guest's workload (default memwrite).
    #[serde(default)]
    workload: WorkloadName,
    /// Guest memory (default 256M).
    mem: Option<Size>,
    /// vCPUs, 1 to 32 (default 1). Checked here (a negative or huge count
    /// gets the range in its error).
    vcpus: Option<i64>,
    /// Seconds the workload runs (default 3600).
    #[serde(default = "default_duration")]
    duration: f64,
    /// Seed of the workload's PRNG.
    seed: Option<u64>,
    /// memwrite/filecache: the working set's size.
    ws: Option<Size>,
    /// memwrite: percent of accesses that are writes.
    write_pct: Option<u64>,
    /// memwrite: access pattern.
    pattern: Option<PatternName>,
    /// memwrite strided: stride in bytes.
    stride: Option<u64>,
    /// memwrite hotcold / filecache: percent of pages (blocks) that are hot.
    hot_pct: Option<u64>,
    /// filecache: the data set's size.
    data: Option<Size>,
    /// Guest timer interrupts per second.
    timer_hz: Option<u64>,
    /// File the guest's console goes to.
    console: Option<std::path::PathBuf>,
    /// TAP device for a virtio-net device (created if missing).
    net_tap: Option<String>,
    /// The guest's IPv4 address on the TAP.
    net_ip: Option<String>,
    /// Bring the host end of the TAP up with this address (e.g. 10.0.0.1/24).
    net_host_ip: Option<String>,
    /// Raw disk image for a virtio-blk device.
    disk: Option<std::path::PathBuf>,
}

fn default_duration() -> f64 {
    3600.0
}

/// The VM configuration a `create` request asks for, every field checked.
pub fn build_config(req: &Value) -> Result<nl_vmm::VmConfig, String> {
    let r: CreateRequest =
        serde_json::from_value(req.clone()).map_err(|e| format!("bad create request: {e}"))?;
    let d = WorkloadArgs::default();
    let w = WorkloadArgs {
        workload: r.workload,
        seed: r.seed.unwrap_or(d.seed),
        ws: r.ws.map(|s| s.bytes()).transpose()?.or(d.ws),
        write_pct: r.write_pct.unwrap_or(d.write_pct),
        pattern: r.pattern.unwrap_or(d.pattern),
        stride: r.stride.unwrap_or(d.stride),
        hot_pct: r.hot_pct.unwrap_or(d.hot_pct),
        data: r.data.map(|s| s.bytes()).transpose()?.unwrap_or(d.data),
    };
    let dm = MachineArgs::default();
    let m = MachineArgs {
        mem: r.mem.map(|s| s.bytes()).transpose()?.unwrap_or(dm.mem),
        vcpus: match r.vcpus {
            None => dm.vcpus,
            Some(v) => u32::try_from(v)
                .ok()
                .filter(|v| (1..=nl_abi::MAX_VCPUS).contains(v))
                .ok_or_else(|| {
                    format!("vcpus {v} is out of range: a VM has 1 to {} vCPUs", nl_abi::MAX_VCPUS)
                })?,
        },
        timer_hz: r.timer_hz.unwrap_or(dm.timer_hz),
        net_ip: r.net_ip.unwrap_or(dm.net_ip.clone()),
        net_tap: r.net_tap,
        net_host_ip: r.net_host_ip,
        disk: r.disk,
        ..dm
    };
    let params = guest::workload_params(&w, r.duration).map_err(|e| e.to_string())?;
    let kernel = guest::kernel_image(&m).map_err(|e| e.to_string())?;
    guest::vm_config(&m, params, kernel, r.console).map_err(|e| e.to_string())
}

/// The host's budgets and API limits: the options given, `base` for the
/// others (the machine's defaults, or what a previous process handed over).
fn limits(a: &HostArgs, base: nl_vmm::host::Limits) -> nl_vmm::host::Limits {
    nl_vmm::host::Limits {
        mem_budget: a.mem_budget.unwrap_or(base.mem_budget),
        vcpu_budget: a.vcpu_budget.unwrap_or(base.vcpu_budget),
        max_connections: a.max_connections.map_or(base.max_connections, |n| n as usize),
        request_timeout: a.request_timeout.unwrap_or(base.request_timeout),
        idle_timeout: a.idle_timeout.unwrap_or(base.idle_timeout),
    }
}

pub fn host(a: HostArgs) -> Result<ExitCode> {
    // A successor or microrebooted host was exec'd through /proc/self/exe:
    // keep the name users and pgrep know it by.
    nl_vmm::rejuvenate::restore_process_name("ninelives");
    // Fatal signals, panics and hangs anywhere in this VMM are detected and
    // reported; the recovery policy decides what follows.
    nl_vmm::detect::install(a.recovery.policy(a.repairs));
    let main_ns = nl_vmm::handover::mono_ns();
    if let (Some(record), Some(sum)) = (a.reboot_record, a.reboot_checksum) {
        // The fresh process of a microreboot: same pid, the VMs' memory and
        // state inherited from the process it replaced.
        let images = nl_vmm::handover::Images {
            kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
            user: Arc::new(nl_guest::USER_ELF.to_vec()),
        };
        let t = match nl_vmm::handover::take_over_in_place(record, sum, &images, main_ns) {
            Ok(t) => t,
            Err(e) => {
                // Nothing to recover the VMs with: a clean, reported failure.
                eprintln!(
                    "{}{}",
                    nl_vmm::detect::REPORT_PREFIX,
                    serde_json::json!({"detector":"recovery_failed","policy":"microreboot","message": e.to_string()})
                );
                std::process::exit(nl_vmm::detect::DETECTED_EXIT);
            }
        };
        t.host.set_limits(limits(&a, t.host.limits()));
        match t.listener {
            Some(l) => nl_vmm::api::serve_listener(t.host, l, &a.api, Arc::new(build_config)),
            None => nl_vmm::api::serve(t.host, &a.api, Arc::new(build_config)),
        }
        .with_context(|| format!("host on {}", a.api.display()))?;
        return Ok(ExitCode::SUCCESS);
    }
    if let (Some(record), Some(ctl)) = (a.handover_fd, a.handover_ctl) {
        // A successor after a handover: take the VMs and the socket over.
        let images = nl_vmm::handover::Images {
            kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
            user: Arc::new(nl_guest::USER_ELF.to_vec()),
        };
        let t = nl_vmm::handover::take_over(record, ctl, &images, main_ns)
            .context("cannot take over from the previous VMM")?;
        let n = t.host.list().len();
        eprintln!(
            "ninelives host (pid {}): took over {n} VMs, serving the API on {}",
            std::process::id(),
            a.api.display()
        );
        t.host.set_limits(limits(&a, t.host.limits()));
        match t.listener {
            Some(l) => nl_vmm::api::serve_listener(t.host, l, &a.api, Arc::new(build_config)),
            None => nl_vmm::api::serve(t.host, &a.api, Arc::new(build_config)),
        }
        .with_context(|| format!("host on {}", a.api.display()))?;
        return Ok(ExitCode::SUCCESS);
    }
    let host = nl_vmm::host::Host::new()?;
    let limits = limits(&a, host.limits());
    host.set_limits(limits);
    nl_vmm::selftest::arm_from_env();
    eprintln!(
        "ninelives host: serving the API on {} (guest memory budget {} MiB, {} vCPUs, \
         {} connections)",
        a.api.display(),
        limits.mem_budget >> 20,
        limits.vcpu_budget,
        limits.max_connections
    );
    nl_vmm::api::serve(host, &a.api, Arc::new(build_config))
        .with_context(|| format!("host on {}", a.api.display()))?;
    Ok(ExitCode::SUCCESS)
}

pub fn api_client(a: ApiArgs) -> Result<ExitCode> {
    if a.openapi {
        println!("{}", serde_json::to_string_pretty(&crate::openapi::document())?);
        return Ok(ExitCode::SUCCESS);
    }
    let (Some(api), Some(request)) = (&a.api, &a.request) else {
        anyhow::bail!("give --api SOCKET and a request (or --openapi)");
    };
    let req: Value = serde_json::from_str(request).context("the request is not valid JSON")?;
    let reply = nl_vmm::api::request(api, &req)?;
    println!("{reply}");
    Ok(if reply.get("ok") == Some(&Value::Bool(true)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
