//! `ninelives run --kernel <Linux bzImage or vmlinux>`: boot one Linux VM
//! with its console on stdout (or `--console FILE`) until it resets, stops
//! or `--duration` seconds pass, and report when its first console byte and
//! its banner came.

use std::path::{Path, PathBuf};
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
    let map = system_map(a.system_map.as_deref())?;
    let params = guest::workload_params(&a.workload, a.duration)?;
    let console = a.console.clone().unwrap_or_else(|| "/dev/stdout".into());
    let config = guest::vm_config(&a.machine, params, kernel, Some(console))?;
    let backend = nl_arch::backend::Backend::detect();
    let mut boot = linux_boot(a.machine.kernel.as_deref(), &a.cmdline, a.initrd.as_deref(), None)?;
    // Parsed once above, for the report of a crash.
    boot.system_map_path = a.system_map.as_deref().map(absolute);
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
    // With several vCPUs: did the kernel start its application processors?
    let vcpus = if vm.config().vcpus > 1 {
        vm.stop();
        format!("; {}", nl_vmm::linux::vcpu_states(&vm))
    } else {
        String::new()
    };
    let secs = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1} s", d.as_secs_f64()));
    eprintln!(
        "linux: {message}; first console byte after {}, banner after {} (from the first KVM_RUN; \
         VM built in {:.0} ms); int3 completed by #BP: {}; fwait completed: {}; ldmxcsr/stmxcsr completed: {}; code patched under the emulator, run again: {}; backend {backend}{vcpus}",
        secs(first_byte),
        secs(banner),
        (started - t0).as_secs_f64() * 1e3,
        stats.int3_completed,
        stats.fwait_completed,
        stats.mxcsr_completed,
        stats.refetched,
    );
    let ok = matches!(outcome, LinuxOutcome::Reset | LinuxOutcome::TimedOut);
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// How a Linux kernel boots, from the files and command line given
/// (`run --kernel`, or a host's `create` with a `kernel`): the initrd read
/// (at most 512 MiB), the command line checked (printable ASCII, at most
/// 2048 bytes) and completed for the backend
/// ([`nl_arch::linux::boot_cmdline`]), the files' absolute paths kept for a
/// successor process that boots the VM again. A `system_map` is checked
/// ([`system_map`]) and its path kept.
pub fn linux_boot(
    kernel: Option<&Path>,
    cmdline: &str,
    initrd: Option<&Path>,
    system_map_path: Option<&Path>,
) -> Result<LinuxBoot> {
    nl_arch::linux::cmdline(cmdline).map_err(|e| anyhow::anyhow!("{e}"))?;
    let backend = nl_arch::backend::Backend::detect();
    let full = nl_arch::linux::boot_cmdline(cmdline, backend);
    if full != cmdline {
        tracing::info!("on {backend} the kernel boots with: {full}");
    }
    let initrd_bytes = match initrd {
        Some(p) => Some(Arc::new(
            nl_memory::file::read_limited(p, "initrd", MAX_INITRD_BYTES)
                .with_context(|| format!("cannot read the initrd {}", p.display()))?,
        )),
        None => None,
    };
    system_map(system_map_path)?;
    Ok(LinuxBoot {
        cmdline: full,
        initrd: initrd_bytes,
        kernel_path: kernel.map(absolute),
        initrd_path: initrd.map(absolute),
        system_map_path: system_map_path.map(absolute),
        time_limit: None,
        started_unix_ms: None,
    })
}

/// Reads and parses a System.map (at most 64 MiB); one without code
/// symbols (Debian ships a one-line placeholder) is refused, quoting its
/// first line.
pub fn system_map(path: Option<&Path>) -> Result<Option<nl_arch::linux::SystemMap>> {
    let Some(p) = path else { return Ok(None) };
    let bytes = nl_memory::file::read_limited(p, "System.map", nl_vmm::linux::MAX_SYSTEM_MAP)
        .with_context(|| format!("cannot read the System.map {}", p.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let m = nl_arch::linux::SystemMap::parse(&text);
    if m.is_empty() {
        let first = text.lines().next().unwrap_or("").trim();
        anyhow::bail!(
            "System.map {}: no code symbols in it (its first line: \"{}\")",
            p.display(),
            first.chars().take(120).collect::<String>()
        );
    }
    Ok(Some(m))
}
