//! `ninelives host` (a long-running VMM driven over a Unix socket) and
//! `ninelives api` (send it one request).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::Value;

use super::host_sandboxes::HostFrontend;
use crate::cli::{ApiArgs, HostArgs};
use nl_launch::vm_spec::{ConfigFile, HOST_DEFAULT_DURATION};

/// The host's budgets and API limits: the options given, `base` for the
/// others (the machine's defaults, or what a previous process handed over).
fn limits(a: &HostArgs, base: nl_vmm::host::Limits) -> nl_vmm::host::Limits {
    nl_vmm::host::Limits {
        mem_budget: a.mem_budget.unwrap_or(base.mem_budget),
        vcpu_budget: a.vcpu_budget.unwrap_or(base.vcpu_budget),
        max_connections: a.max_connections.map_or(base.max_connections, |n| n as usize),
        request_timeout: a.request_timeout.unwrap_or(base.request_timeout),
        idle_timeout: a.idle_timeout.unwrap_or(base.idle_timeout),
        json_lines: a.api_legacy || base.json_lines,
    }
}

pub fn host(a: HostArgs) -> Result<ExitCode> {
    // A successor or microrebooted host was exec'd through /proc/self/exe:
    // keep the name users and pgrep know it by.
    nl_vmm::rejuvenate::restore_process_name("ninelives");
    // Fatal signals, panics and hangs anywhere in this VMM are detected and
    // reported; the recovery policy decides what follows.
    nl_vmm::detect::install(a.recovery.policy(a.repairs));
    // Sandbox sets: served by the front end and carried by it across a
    // rejuvenation or microreboot (registered before any take-over).
    let front = HostFrontend::shared();
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
            Some(l) => nl_vmm::api::serve_listener(t.host, l, &a.api, front.clone()),
            None => nl_vmm::api::serve(t.host, &a.api, front.clone()),
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
        tracing::info!(
            "host (pid {}): took over {n} VMs, serving the API on {}",
            std::process::id(),
            a.api.display()
        );
        t.host.set_limits(limits(&a, t.host.limits()));
        match t.listener {
            Some(l) => nl_vmm::api::serve_listener(t.host, l, &a.api, front.clone()),
            None => nl_vmm::api::serve(t.host, &a.api, front.clone()),
        }
        .with_context(|| format!("host on {}", a.api.display()))?;
        return Ok(ExitCode::SUCCESS);
    }
    // A configuration file is checked whole before anything starts.
    let config =
        a.config.as_deref().map(|p| ConfigFile::load(p, HOST_DEFAULT_DURATION)).transpose()?;
    let host = nl_vmm::host::Host::new()?;
    let limits = limits(&a, host.limits());
    host.set_limits(limits);
    nl_vmm::selftest::arm_from_env();
    if let (Some(c), Some(path)) = (&config, &a.config) {
        for (i, spec) in c.vms.iter().enumerate() {
            let vm = spec.vm(HOST_DEFAULT_DURATION).map_err(anyhow::Error::msg);
            let id = vm.and_then(|vm| {
                match vm {
                    (c, Some(boot)) => host.create_linux(c, &boot),
                    (c, None) => host.create(c),
                }
                .map_err(anyhow::Error::from)
            });
            let id = id.with_context(|| format!("cannot create vms[{i}] of {}", path.display()))?;
            tracing::info!(
                "host: created VM {id} ({}) from the configuration",
                if spec.kernel.is_some() { "linux" } else { spec.workload.name() }
            );
        }
    }
    tracing::info!(
        "host: serving the API on {} (guest memory budget {} MiB, {} vCPUs, \
         {} connections)",
        a.api.display(),
        limits.mem_budget >> 20,
        limits.vcpu_budget,
        limits.max_connections
    );
    nl_vmm::api::serve(host, &a.api, front.clone())
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
