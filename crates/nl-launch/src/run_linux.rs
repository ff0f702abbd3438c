//! `ninelives run --kernel <Linux bzImage or vmlinux>`: boot one Linux VM
//! with its console on stdout (or `--console FILE`) until it resets, stops
//! or `--duration` seconds pass, and report when its first console byte and
//! its banner came.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nl_vmm::linux::{LinuxBoot, LinuxOutcome, WaitStats};
use nl_vmm::Vm;

use crate::args::RunArgs;
use crate::guest;

/// The command line when none is given: the console on the 8250 UART,
/// reboot through the i8042 (which ends the VM), no KASLR (so System.map
/// addresses hold).
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 earlyprintk=serial,ttyS0,115200 reboot=k panic=-1 nokaslr";

/// Largest initrd accepted.
const MAX_INITRD_BYTES: u64 = 512 << 20;

/// The kernel's first line.
pub const BANNER: &str = "Linux version ";

pub fn run(a: &RunArgs, kernel: Arc<Vec<u8>>) -> Result<ExitCode> {
    if a.vms != 1 {
        anyhow::bail!("--vms {}: a Linux kernel boots in one VM per run", a.vms);
    }
    if !(a.duration.is_finite() && a.duration > 0.0) {
        anyhow::bail!("--duration {} must be a positive number of seconds", a.duration);
    }
    let initrd = match &a.initrd {
        Some(p) => Some(Arc::new(
            nl_memory::file::read_limited(p, "initrd", MAX_INITRD_BYTES)
                .context("cannot read --initrd")?,
        )),
        None => None,
    };
    let map = match &a.system_map {
        Some(p) => {
            let bytes = nl_memory::file::read_limited(p, "System.map", 64 << 20)
                .context("cannot read --system-map")?;
            let text = String::from_utf8_lossy(&bytes);
            let m = nl_arch::linux::SystemMap::parse(&text);
            if m.is_empty() {
                // Debian ships a one-line placeholder that says where the real map is.
                let first = text.lines().next().unwrap_or("").trim();
                anyhow::bail!(
                    "--system-map {}: no code symbols in it (its first line: \"{}\")",
                    p.display(),
                    first.chars().take(120).collect::<String>()
                );
            }
            Some(m)
        }
        None => None,
    };
    let params = guest::workload_params(&a.workload, a.duration)?;
    let console = a.console.clone().unwrap_or_else(|| "/dev/stdout".into());
    let config = guest::vm_config(&a.machine, params, kernel, Some(console))?;
    let backend = nl_arch::backend::Backend::detect();
    let cmdline = nl_arch::linux::boot_cmdline(&a.cmdline, backend);
    if cmdline != a.cmdline {
        tracing::info!("on {backend} the kernel boots with: {cmdline}");
    }
    let boot = LinuxBoot {
        cmdline,
        initrd,
        // Absolute, for a successor process that boots the VM again.
        kernel_path: a.machine.kernel.as_deref().map(absolute),
        initrd_path: a.initrd.as_deref().map(absolute),
    };

    let kvm = nl_vmm::open_kvm()?;
    let t0 = Instant::now();
    let vm = Vm::create_linux(&kvm, 0, config, &boot).context("cannot create the Linux VM")?;
    vm.start()?;
    let started = Instant::now();
    let limit = Duration::from_secs_f64(a.duration);
    let mut stats = WaitStats::default();
    let (mut first_byte, mut banner) = (None, None);
    // Watches the console for its first byte and the banner; never
    // "reached", so the wait ends only when the VM does or time is up.
    let watch = |tail: &str| {
        if first_byte.is_none() && !tail.is_empty() {
            first_byte = Some(started.elapsed());
        }
        if banner.is_none() && tail.contains(BANNER) {
            banner = Some(started.elapsed());
        }
        false
    };
    let outcome = nl_vmm::linux::wait(&vm, limit, watch, &mut stats);
    let message = match &outcome {
        LinuxOutcome::Reset => "the guest reset (reboot or power-off through the i8042)".into(),
        LinuxOutcome::TimedOut => {
            vm.stop();
            format!("stopped after --duration {:.0} s", a.duration)
        }
        LinuxOutcome::Ended(o) => nl_vmm::linux::describe_crash(&vm, o, map.as_ref()),
        LinuxOutcome::Reached => unreachable!("the loop only ends otherwise"),
    };
    let secs = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1} s", d.as_secs_f64()));
    eprintln!(
        "linux: {message}; first console byte after {}, banner after {} (from the first KVM_RUN; \
         VM built in {:.0} ms); int3 completed by #BP: {}; fwait completed: {}; ldmxcsr/stmxcsr completed: {}; backend {backend}",
        secs(first_byte),
        secs(banner),
        (started - t0).as_secs_f64() * 1e3,
        stats.int3_completed,
        stats.fwait_completed,
        stats.mxcsr_completed,
    );
    let ok = matches!(outcome, LinuxOutcome::Reset | LinuxOutcome::TimedOut);
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn absolute(p: &std::path::Path) -> std::path::PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}
