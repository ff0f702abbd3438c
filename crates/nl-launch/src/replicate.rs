//! `ninelives replicate primary|backup`: primary/backup replication.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use nl_replicate::auth::Key;
use nl_replicate::backup::{serve_colo, BackupConfig, BackupEnd, HANDSHAKE_TIME};
use nl_replicate::primary::{Options, Primary, PrimaryConfig, PrimaryReport};
use nl_vmm::linux::LinuxRecord;
use nl_vmm::state::VmState;
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::args::{parse_size, MachineArgs, WorkloadArgs};
use crate::guest;
use crate::verify::verify_vcpus;

#[derive(Subcommand, Debug, Clone)]
pub enum ReplicateCmd {
    /// Run a VM whose every epoch is acknowledged by a backup before its output leaves.
    Primary(Box<PrimaryArgs>),
    /// Receive a primary's epochs and take over its VM when the primary is gone.
    Backup(Box<BackupArgs>),
    /// Write a new replication key (32 random bytes, mode 0600) to PATH; never overwrites.
    Keygen {
        /// Where to write the key (must not exist yet).
        path: std::path::PathBuf,
    },
}

#[derive(Args, Clone, Debug)]
pub struct PrimaryArgs {
    /// The backup's address.
    #[arg(long)]
    pub backup: SocketAddr,
    /// Epoch length (a number of milliseconds, or e.g. 20ms, 1.5s).
    #[arg(long, default_value = "20", value_parser = crate::args::millis)]
    pub epoch: u64,
    /// Without a frame from the backup for this long, the primary fences itself (a number of milliseconds, or e.g. 20ms, 1.5s).
    #[arg(long, default_value = "1000", value_parser = crate::args::millis)]
    pub lease_ms: u64,
    /// The replication key (from `replicate keygen`; the same file on both ends, mode
    /// 0600): both ends prove they hold it, and every frame is sealed under a key
    /// derived from it. It never crosses the wire.
    #[arg(long)]
    pub key_file: std::path::PathBuf,
    /// Turn selective re-protection off (on by default: KVM_CLEAR_DIRTY_LOG with manual
    /// protect re-protects exactly the pages dirtied in the epoch). Needs --no-predict.
    #[arg(long, conflicts_with = "selective")]
    pub no_selective: bool,
    /// Turn write-fault prediction off (on by default: pages really written in an epoch
    /// stay writable for the next; unchanged ones are dropped as fake dirty and
    /// re-protected; prediction turns itself off while its precision is low and probes
    /// again later).
    #[arg(long, conflicts_with = "predict")]
    pub no_predict: bool,
    /// Accepted for old scripts: selective re-protection is the default.
    #[arg(long, hide = true)]
    pub selective: bool,
    /// Accepted for old scripts: write-fault prediction is the default.
    #[arg(long, hide = true)]
    pub predict: bool,
    /// Transfer path: send coalesced runs straight from guest memory during the pause
    /// (needs --pipeline 0, the default; turns write-fault prediction off, which compares
    /// the staging copy this skips).
    #[arg(long)]
    pub direct: bool,
    /// Pipelined epochs: the VM resumes right after copying the dirty pages into a
    /// staging buffer and a sender thread ships the epoch while the next one runs;
    /// at most this many epochs unacknowledged (0, the default: the epoch loop sends
    /// and waits for each ack itself).
    #[arg(long, default_value_t = Options::recommended().pipeline,
          value_parser = clap::value_parser!(u32).range(0..=4))]
    pub pipeline: u32,
    /// Output-triggered epochs: once the guest has sent frames (held until the epoch's
    /// ack), the epoch ends at once, except while the guest dirties pages faster than
    /// --output-spacing-rate: then not before this long has passed since the last
    /// boundary (a minimum spacing against storms of costly epochs). 0: always as soon
    /// as output waits (a number of milliseconds, or e.g. 2ms).
    #[arg(long, default_value_t = Options::RECOMMENDED_OUTPUT_EPOCH_MS,
          value_parser = crate::args::millis)]
    pub output_epoch_ms: u64,
    /// Output-triggered epochs: after an epoch that dirtied at most this many pages per
    /// millisecond, the next ends as soon as output waits, without --output-epoch-ms'
    /// spacing (0: every output-triggered epoch is spaced, the rule before).
    #[arg(long, default_value_t = Options::RECOMMENDED_OUTPUT_SPACING_RATE)]
    pub output_spacing_rate: u64,
    /// No output-triggered epochs: epochs always last --epoch, held output waits for
    /// the timer.
    #[arg(long)]
    pub no_output_epochs: bool,
    /// Histase, per write fault (the paper's algorithm): track writes with userfaultfd
    /// write-protection instead of KVM's dirty log; a fault also makes the pages up to
    /// his_stride ahead and his_stride/3 behind in its 2 MiB table writable (treated as
    /// dirty, dropped if unchanged). Replaces selective re-protection and prediction.
    #[arg(long, conflicts_with_all = ["selective", "predict"])]
    pub histase: bool,
    /// The fault-free compare capture: no write tracking (no dirty log, no write
    /// faults); at each boundary every allocated page is compared with a shadow of
    /// what the backup has, over the host's cores while the vCPUs are stopped, and
    /// the pages that differ are sent. For guests that write most of their working
    /// set every epoch. Replaces selective re-protection, prediction and --histase.
    #[arg(long, conflicts_with_all = ["histase"])]
    pub compare: bool,
    /// On by default: choose, epoch by epoch, between the dirty log (selective
    /// re-protection and prediction) and the compare capture. A model of the guest time
    /// each loses with this host's unit costs proposes each switch, and the guest's
    /// measured progress (its heartbeat's operations per second) keeps it or undoes it
    /// (15% slower after it), the model then held off that switch for 0.5 s, doubling.
    /// A guest without a heartbeat (Linux) stays on the dirty log. The log names each
    /// switch and judgement.
    #[arg(long, conflicts_with_all = ["histase", "compare", "direct", "no_auto_capture"])]
    pub auto_capture: bool,
    /// Stay on the dirty log (selective re-protection and prediction): the default
    /// before --auto-capture was.
    #[arg(long)]
    pub no_auto_capture: bool,
    /// COLO (experimental): the backup (started with --colo) runs a secondary VM on
    /// this VM's input, and each frame the guest sends leaves as soon as the secondary
    /// sent the same, without waiting for an epoch. An epoch is taken when the two
    /// differ, when a frame waited --colo-timeout-ms, or every --colo-period-ms (not
    /// --epoch). Reference guest with a network device, no disk, no --pipeline. On two
    /// cores the secondary competes with the primary for CPU: see docs/replication.md.
    #[arg(long, conflicts_with_all = ["pipeline"])]
    pub colo: bool,
    /// COLO: the longest a frame waits for the secondary's before an epoch releases it.
    #[arg(long, default_value_t = Options::COLO_TIMEOUT_MS, requires = "colo")]
    pub colo_timeout_ms: u64,
    /// COLO: an epoch at least this often (in place of --epoch).
    #[arg(long, default_value_t = Options::COLO_PERIOD_MS, requires = "colo")]
    pub colo_period_ms: u64,
    /// Spread the copy of each epoch's dirty pages into the staging buffer over the
    /// host's cores while the vCPUs are stopped (default: one thread). Experimental:
    /// the copy threads run briefly before their seccomp filter is installed.
    #[arg(long)]
    pub parallel_copy: bool,
    /// After losing the backup, attach a new one at the same address when it appears.
    #[arg(long)]
    pub reattach: bool,
    /// Test hook for kill campaigns: SIGKILL this primary half-way through
    /// sending the first epoch shipped this many milliseconds after the start.
    #[arg(long, hide = true)]
    pub test_die_mid_send_ms: Option<u64>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// How long the workload runs (a number of seconds, or e.g. 1.5s, 500ms, 2min).
    #[arg(long, default_value = "3", value_parser = crate::args::secs)]
    pub duration: f64,
    /// Write the guest's console output to this file.
    #[arg(long)]
    pub console: Option<std::path::PathBuf>,
    /// Print the run's report as one JSON object (last line of stdout).
    #[arg(long)]
    pub json: bool,
    /// Linux kernel command line, when --kernel is a Linux bzImage or vmlinux
    /// (as `run` takes it; --duration is then the VM's time limit, which the
    /// backup keeps after a takeover; see docs/linux-guests.md).
    #[arg(long, default_value = crate::run_linux::DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// An initrd (initramfs) for a Linux kernel.
    #[arg(long)]
    pub initrd: Option<std::path::PathBuf>,
    /// The Linux kernel's System.map: names the guest function where it stopped.
    #[arg(long)]
    pub system_map: Option<std::path::PathBuf>,
}

#[derive(Args, Clone, Debug)]
pub struct BackupArgs {
    /// Address to listen on for the primary.
    #[arg(long)]
    pub listen: SocketAddr,
    /// Accept only this primary address.
    #[arg(long)]
    pub allow_primary: Option<IpAddr>,
    /// The replication key (from `replicate keygen`; the same file as the primary's,
    /// mode 0600).
    #[arg(long)]
    pub key_file: std::path::PathBuf,
    /// Guest memory the primary's VM must have.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub mem: u64,
    /// vCPUs the primary's VM must have.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// The primary is declared gone after this long without a frame (a number of milliseconds, or e.g. 20ms, 1.5s).
    #[arg(long, default_value = "1000", value_parser = crate::args::millis)]
    pub lease_ms: u64,
    /// Where this backup keeps its copy of the primary's disk: created, or
    /// emptied and resized, when the primary attaches; the VM uses it after
    /// a takeover. Needed when the primary's VM has a disk.
    #[arg(long)]
    pub disk: Option<std::path::PathBuf>,
    /// The TAP to bring up for the guest on takeover (in this namespace).
    #[arg(long)]
    pub net_tap: Option<String>,
    /// The guest's IPv4 address and prefix after a takeover.
    #[arg(long, default_value = "10.0.0.2/24")]
    pub net_ip: String,
    /// Write the guest's console output (after a takeover) to this file
    /// (appended; a Linux VM's console goes on there from where the
    /// primary's last acknowledged epoch was).
    #[arg(long)]
    pub console: Option<std::path::PathBuf>,
    /// After a takeover, protect the VM again: become its primary towards a
    /// fresh backup at this address (same key; 20 ms epochs with selective
    /// re-protection). The VM runs at once, unprotected until that backup
    /// answers, and is never stopped for it.
    #[arg(long)]
    pub next_backup: Option<SocketAddr>,
    /// Print the backup's report as one JSON object (last line of stdout).
    #[arg(long)]
    pub json: bool,
    /// The primary runs its guest with --net-rx-irq (the guest halts while idle and
    /// takes network interrupts): the VM built here must too.
    #[arg(long)]
    pub net_rx_irq: bool,
    /// COLO: run a secondary VM for a primary started with --colo (over a private
    /// copy of this backup's memory; on the primary's loss it is what takes over).
    #[arg(long, conflicts_with_all = ["next_backup"])]
    pub colo: bool,
    /// A test of COLO's divergences: every Nth frame with TCP payload the secondary
    /// sends has its first payload byte flipped (0: never).
    #[arg(long, hide = true, default_value_t = 0, requires = "colo")]
    pub test_colo_perturb: u64,
    /// A test of a failed secondary: its Nth checkpoint (the Nth epoch it
    /// is to become after its start) fails (0: never).
    #[arg(long, hide = true, default_value_t = 0, requires = "colo")]
    pub test_colo_fail_at: u64,
    /// A test of a secondary whose guest fails: after its Nth checkpoint its
    /// vCPU 0's next instruction becomes `ud2` (0: never).
    #[arg(long, hide = true, default_value_t = 0, requires = "colo")]
    pub test_colo_crash_at: u64,
    /// Build the VM only in the takeover, not ahead of it once the full
    /// copy is in (for measuring the difference).
    #[arg(long, hide = true)]
    pub no_prebuild: bool,
}

pub fn replicate(c: ReplicateCmd) -> Result<ExitCode> {
    match c {
        ReplicateCmd::Primary(a) => primary(*a),
        ReplicateCmd::Backup(a) => backup(*a),
        ReplicateCmd::Keygen { path } => {
            Key::generate(&path).map_err(anyhow::Error::msg)?;
            println!("wrote a new replication key to {} (mode 0600)", path.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[derive(Serialize)]
pub struct PrimaryRun {
    /// The digest verified; a Linux VM (no digest): it ended by a reset of
    /// the guest or at its time limit.
    pub ok: bool,
    pub digest_ok: bool,
    /// The VM was a Linux VM (`--kernel` a Linux image).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub linux: bool,
    pub ops_per_sec: f64,
    #[serde(flatten)]
    pub report: PrimaryReport,
    pub error: Option<String>,
}

/// Runs one replicated VM to its end and verifies its digest.
pub fn run_primary(a: &PrimaryArgs, quiet: bool) -> Result<PrimaryRun> {
    if !(5..=10_000).contains(&a.epoch) {
        bail!("--epoch {} ms is out of range 5..=10000", a.epoch);
    }
    if a.lease_ms < 2 * a.epoch.max(100) {
        bail!("--lease-ms {} must be at least twice the epoch and 200 ms", a.lease_ms);
    }
    if a.direct && a.pipeline > 0 {
        bail!("--direct sends during the pause: it needs --pipeline 0");
    }
    let opts = a.options()?;
    let key = Key::load(&a.key_file).map_err(anyhow::Error::msg)?;
    let params = guest::workload_params(&a.workload, a.duration)?;
    if let Some(d) = &a.machine.disk {
        guest::ensure_disk(d, guest::disk_size_for(&params))?;
    }
    let kernel = guest::kernel_image(&a.machine)?;
    let linux = nl_arch::linux::image_kind(&kernel) != nl_arch::linux::ImageKind::Other;
    let config = guest::vm_config(&a.machine, params, kernel, a.console.clone())?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = if linux {
        // As `run --kernel`: --duration is the Linux VM's time limit; its
        // record (sent to the backup in the hello) carries it.
        let mut boot = crate::run_linux::linux_boot(
            a.machine.kernel.as_deref(),
            &a.cmdline,
            a.initrd.as_deref(),
            a.system_map.as_deref(),
        )?;
        boot.time_limit = Some(Duration::from_secs_f64(a.duration));
        Vm::create_linux(&kvm, 0, config, &boot).context("cannot create the Linux VM")?
    } else {
        Vm::create(&kvm, 0, config).context("cannot create the VM")?
    };
    // A Linux VM ends at its own time limit (its record's); this one is
    // only a backstop.
    let limit = if linux { a.duration + 60.0 } else { a.duration * 4.0 + 60.0 };
    let cfg = PrimaryConfig {
        backup: a.backup,
        epoch: Duration::from_millis(a.epoch),
        lease: Duration::from_millis(a.lease_ms),
        key,
        opts,
        time_limit: Duration::from_secs_f64(limit),
        reattach: a.reattach,
        die_mid_send_after: a.test_die_mid_send_ms.map(Duration::from_millis),
    };
    let (report, (ok, ops_per_sec, error)) = run_as_primary(&vm, cfg, quiet)?;
    Ok(PrimaryRun { ok, digest_ok: ok && !linux, linux, ops_per_sec, report, error })
}

impl PrimaryArgs {
    /// The optimizations in effect: [`Options::recommended`] with what the
    /// flags turn off or change.
    pub fn options(&self) -> Result<Options> {
        let d = Options::recommended();
        // Histase tracks writes with userfaultfd: it replaces both.
        let selective = d.selective && !self.no_selective && !self.histase && !self.compare;
        // Sending from guest memory in the pause skips the staging copy
        // that prediction compares with what the backup has.
        let predict =
            d.predict && !self.no_predict && !self.histase && !self.compare && !self.direct;
        if predict && !selective {
            bail!(
                "--no-selective: write-fault prediction works over selective re-protection; \
                 turn it off too with --no-predict"
            );
        }
        Ok(Options {
            selective,
            predict,
            direct: self.direct,
            pipeline: self.pipeline,
            output_epochs: d.output_epochs && !self.no_output_epochs,
            output_epoch_ms: self.output_epoch_ms,
            output_spacing_rate: self.output_spacing_rate,
            histase: self.histase,
            compare: self.compare,
            // The default gives way to the captures that replace the log;
            // asked for by name, it is checked against them.
            auto_capture: self.auto_capture
                || (d.auto_capture
                    && !self.no_auto_capture
                    && selective
                    && !self.histase
                    && !self.compare
                    && !self.direct),
            serial_copy: !self.parallel_copy,
            colo: self.colo,
            colo_timeout_ms: self.colo_timeout_ms,
            colo_period_ms: self.colo_period_ms,
        })
    }
}

/// Whether the guest's digest verified, its ops/s, and what went wrong.
type Verdict = (bool, f64, Option<String>);

/// Runs `vm` as a replicated primary (it starts the VM) to its end, and
/// verifies it. With `quiet`, only warnings, fencing, the moment the VM
/// becomes protected and `--auto-capture`'s switches are logged (--json
/// keeps stdout for the report).
fn run_as_primary(vm: &Vm, cfg: PrimaryConfig, quiet: bool) -> Result<(PrimaryReport, Verdict)> {
    let mut log = |m: String| {
        let alarm = m.contains("WARNING") || m.contains("FENCED");
        if alarm {
            tracing::warn!("{m}");
        } else if !quiet || m.contains("is protected") || m.starts_with("capture: ") {
            tracing::info!("{m}");
        }
    };
    let report = Primary::new(vm, cfg, &mut log).run().map_err(anyhow::Error::msg)?;
    let verdict = match &report.outcome {
        // A Linux VM has no digest: it ended well when the guest reset
        // (reboot or power-off through the i8042) or at its time limit.
        Some(o) if vm.linux_record().is_some() => linux_verdict(o),
        Some(VmOutcome::Completed) => verdict(vm)?,
        Some(o) => (false, 0.0, Some(o.message())),
        None => (false, 0.0, Some("fenced: the VM was stopped".into())),
    };
    Ok((report, verdict))
}

/// A Linux VM's end: `(ended well, 0, how it ended otherwise)`.
fn linux_verdict(o: &VmOutcome) -> Verdict {
    match o {
        VmOutcome::Completed | VmOutcome::TimedOut { .. } => (true, 0.0, None),
        o => (false, 0.0, Some(o.message())),
    }
}

fn verdict(vm: &Vm) -> Result<Verdict> {
    let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
    let tsc_khz = nl_arch::read_boot_info(vm.memory().mem())?.tsc_khz;
    let v = verify_vcpus(&vm.config().workload, &regs, tsc_khz);
    let ok = !v.is_empty() && v.iter().all(|v| v.digest_ok);
    Ok((ok, v.iter().map(|v| v.ops_per_sec).sum(), v.iter().find_map(|v| v.problem.clone())))
}

fn primary(a: PrimaryArgs) -> Result<ExitCode> {
    let r = run_primary(&a, a.json)?;
    let p = &r.report;
    println!(
        "replicated {} epochs of {} ms (every {:.1} ms, pipeline {}): {:.1} pages and {:.1} write faults per epoch, \
         pause {:.2} ms avg / {:.2} max (collect {:.2}, copy {:.2}, state {:.2}, send in pause {:.2}); \
         send {:.2} ms, ack wait {:.2} ms, boundary stalled {:.2} ms, output held {:.1} ms avg / {:.1} max; \
         full copy {} pages in {:.1} ms; {} frames released after acks",
        p.epochs, p.epoch_ms, p.interval_ms_avg, p.options.pipeline, p.pages_per_epoch, p.write_faults_per_epoch,
        p.pause_ms_avg, p.pause_ms_max, p.collect_ms_avg, p.copy_ms_avg, p.state_ms_avg, p.send_in_pause_ms_avg,
        p.send_after_ms_avg, p.ack_wait_ms_avg, p.stall_ms_avg, p.commit_ms_avg, p.commit_ms_max,
        p.full_copy_pages, p.full_copy_ms, p.frames_released
    );
    if p.fenced {
        println!("FENCED: {}", p.backup_lost.as_deref().unwrap_or("backup silent"));
    } else if p.unprotected {
        println!("ran UNPROTECTED after: {}", p.backup_lost.as_deref().unwrap_or("?"));
    }
    if r.linux {
        let end = p.outcome.as_ref().map_or_else(|| "fenced".into(), VmOutcome::message);
        println!("linux: the VM ended: {end}");
    } else {
        println!("{}", crate::verify::digest_line(r.digest_ok, r.error.as_deref(), r.ops_per_sec));
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(if r.ok {
        ExitCode::SUCCESS
    } else if p.fenced {
        ExitCode::from(4)
    } else {
        ExitCode::FAILURE
    })
}

/// The VM's shape as the primary's state gives it: a VM built ahead of
/// the takeover is used only if the last state has the same.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    mem_bytes: u64,
    vcpus: u32,
    timer_hz: u64,
    workload: nl_abi::WorkloadParams,
}

impl Shape {
    fn of(s: &VmState) -> Shape {
        Shape {
            mem_bytes: s.mem_bytes,
            vcpus: s.num_vcpus,
            timer_hz: s.timer_hz,
            workload: s.workload,
        }
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Where a VM's build went (ahead of the takeover, or in it on the
/// fallback path), in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct BuildPhases {
    /// Reading the kernel image (the embedded one: a copy).
    kernel_ms: f64,
    /// The VM's configuration (checks the disk, the TAP's name).
    config_ms: f64,
    /// Opening /dev/kvm.
    open_kvm_ms: f64,
    /// `Vm::prepare`: KVM_CREATE_VM, memory slots, irqchip, devices, vCPUs
    /// and their CPUID.
    prepare_ms: f64,
}

/// The takeover, step by step: `takeover_ms` is detection to the vCPU
/// threads started (with `--next-backup`: to the VM restored, the primary
/// starts it).
#[derive(Clone, Debug, Default, Serialize)]
struct TakeoverPhases {
    /// The VM was built ahead (after the primary's full copy) and the
    /// takeover only loaded the last state into it.
    prebuilt: bool,
    /// Why the VM was built in the takeover instead (None: prebuilt).
    fallback: Option<String>,
    /// The build, ahead of the takeover when `prebuilt` (not in
    /// `takeover_ms`), in it otherwise.
    build: BuildPhases,
    /// Detection to the backup's loop handing over memory and state.
    handoff_ms: f64,
    /// Waiting for the build ahead to finish (0 once it is done).
    wait_prebuild_ms: f64,
    /// The build in the takeover (fallback path only; 0 when prebuilt).
    build_ms: f64,
    /// Opening the TAP and putting it behind the prebuilt VM's device.
    tap_ms: f64,
    /// `Vm::restore_state`: devices, irqchip, vCPU registers and the
    /// gratuitous ARP.
    restore_state_ms: f64,
    /// `Vm::start`: the vCPU (and net receive) threads.
    start_ms: f64,
    /// From `Vm::start` to the first vCPU exit counted: the guest ran (an
    /// upper bound on the first KVM_RUN; None with `--next-backup` or if
    /// none within 500 ms).
    first_exit_ms: Option<f64>,
}

/// Builds the backup's VM over `memory` (not started, no state loaded):
/// a Linux VM booted as `linux` says (`Vm::prepare_linux`: its UART
/// interrupt, i8042 and PIT, the vCPUs' Linux CPUID), otherwise a
/// reference-guest VM. `spare_net`: the virtio-net device gets no TAP yet
/// (link down), so no frame queues for a guest that does not run and the
/// TAP is opened once, at the takeover.
fn build_backup_vm(
    a: &BackupArgs,
    shape: &Shape,
    memory: nl_memory::GuestMemory,
    spare_net: bool,
    linux: Option<&LinuxRecord>,
) -> Result<(Vm, BuildPhases)> {
    let mut ph = BuildPhases::default();
    let t = Instant::now();
    let m = MachineArgs {
        mem: shape.mem_bytes,
        vcpus: shape.vcpus,
        timer_hz: shape.timer_hz,
        net_tap: a.net_tap.clone(),
        net_ip: a.net_ip.clone(),
        net_rx_irq: a.net_rx_irq,
        disk: a.disk.clone(),
        ..Default::default()
    };
    let kernel = guest::kernel_image(&m)?;
    ph.kernel_ms = ms_since(t);
    let t = Instant::now();
    let mut config = guest::vm_config(&m, shape.workload, kernel, a.console.clone())?;
    if spare_net {
        if let Some(n) = config.net.as_mut() {
            n.spare = true;
        }
    }
    ph.config_ms = ms_since(t);
    let t = Instant::now();
    let kvm = nl_vmm::open_kvm()?;
    ph.open_kvm_ms = ms_since(t);
    let t = Instant::now();
    let vm = match linux {
        Some(r) => {
            Vm::prepare_linux(&kvm, 0, config, memory, r).context("cannot build the Linux VM")?
        }
        None => Vm::prepare(&kvm, 0, config, memory).context("cannot build the VM")?,
    };
    ph.prepare_ms = ms_since(t);
    Ok((vm, ph))
}

/// A VM being built ahead of the takeover, on a thread of its own.
type Prebuild = (Shape, std::thread::JoinHandle<Result<(Vm, BuildPhases)>>);

/// The prebuilt VM, if it is usable for a takeover from `state` over
/// `memory` (its TAP attached); otherwise why not (it is dropped, its
/// resources freed, before the fallback builds another).
fn take_prebuilt(
    a: &BackupArgs,
    prebuild: Option<Prebuild>,
    memory: &nl_memory::GuestMemory,
    state: &VmState,
    ph: &mut TakeoverPhases,
) -> Result<Vm, String> {
    let Some((shape, handle)) = prebuild else {
        return Err(if a.no_prebuild {
            "--no-prebuild".into()
        } else {
            "no VM was built ahead (the first epoch's state did not reach it)".into()
        });
    };
    let t = Instant::now();
    let built = handle.join();
    ph.wait_prebuild_ms = ms_since(t);
    let (vm, build) = match built {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return Err(format!("building the VM ahead failed: {e:#}")),
        Err(_) => return Err("the thread building the VM ahead panicked".into()),
    };
    ph.build = build;
    let now = Shape::of(state);
    if now != shape {
        return Err(format!("the VM's shape changed since the full copy: {shape:?} -> {now:?}"));
    }
    if vm.linux_record().is_some() != nl_vmm::linux::is_linux_state(state) {
        return Err("the VM built ahead is not of the kind of the last state (Linux or not)".into());
    }
    if !Arc::ptr_eq(vm.memory().fd(), memory.fd()) {
        return Err("the VM built ahead is not over the backup's memory".into());
    }
    let t = Instant::now();
    if let Some(n) = &vm.config().net {
        let tap = nl_devices::tap::Tap::open(&n.tap)
            .map_err(|e| format!("cannot open the TAP for the VM built ahead: {e}"))?;
        if !tap.host_up() {
            tracing::warn!("TAP {} is down on the host: the guest is unreachable", n.tap);
        }
        vm.attach_tap(tap).map_err(|_| "the VM built ahead has a TAP already".to_string())?;
    }
    ph.tap_ms = ms_since(t);
    Ok(vm)
}

/// Set by SIGTERM or SIGINT while a backup runs a Linux VM it took over.
static STOP_LINUX: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP_LINUX.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Runs a Linux VM the backup took over (started) until the guest resets,
/// it reaches its time limit (its record's, counted from its first
/// creation on the primary), it stops on what the VMM cannot complete, or
/// SIGTERM/SIGINT asks this process to stop it (a Linux VM has no natural
/// end on its own: this is how an operator, or a test, ends it and still
/// gets the report). Returns (ended well, ms run, how it ended).
fn run_linux_on(vm: &Vm) -> (bool, f64, String) {
    let handler = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, handler) };
    }
    let started = Instant::now();
    let (ok, end) = loop {
        if STOP_LINUX.load(std::sync::atomic::Ordering::SeqCst) {
            vm.stop();
            break (true, "stopped by a signal to the backup".to_string());
        }
        if let Some(o) = nl_vmm::linux::poll(vm) {
            let end = match &o {
                VmOutcome::Completed => {
                    "the guest reset (reboot or power-off through the i8042)".into()
                }
                o => o.message(),
            };
            break (matches!(o, VmOutcome::Completed | VmOutcome::TimedOut { .. }), end);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (ok, ms_since(started), end)
}

/// Waits (bounded: 500 ms) for the first vCPU exit after `started`.
fn first_exit_ms(vm: &Vm, started: Instant) -> Option<f64> {
    for _ in 0..5000 {
        let exits = vm.report().vcpus.iter().any(|v| {
            let e = v.exits;
            e.io_exits + e.mmio_exits + e.interrupted + e.other_exits > 0
        });
        if exits {
            return Some(ms_since(started));
        }
        if started.elapsed() > Duration::from_millis(500) {
            break;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    None
}

fn backup(a: BackupArgs) -> Result<ExitCode> {
    let cfg = BackupConfig {
        listen: a.listen,
        allow: a.allow_primary,
        key: Key::load(&a.key_file).map_err(anyhow::Error::msg)?,
        mem_bytes: a.mem,
        vcpus: a.vcpus,
        disk: a.disk.clone(),
        lease: Duration::from_millis(a.lease_ms.max(50)),
        heartbeat: Duration::from_millis((a.lease_ms / 10).clamp(10, 100)),
        handshake: HANDSHAKE_TIME,
        colo: a.colo,
        colo_test_perturb: a.test_colo_perturb,
        colo_test_fail_at: a.test_colo_fail_at,
        colo_test_crash_at: a.test_colo_crash_at,
    };
    nl_memory::GuestMemory::check_size(a.mem)?;
    let mut log = |m: String| tracing::info!("{m}");
    // Once the primary's full copy is in, the VM is built over the backup's
    // own memory on a thread (epochs keep arriving meanwhile): a takeover
    // then only loads the last state and starts it.
    let mut prebuild: Option<Prebuild> = None;
    let mut first_copy = |memory: &nl_memory::GuestMemory,
                          state: &VmState,
                          linux: Option<&LinuxRecord>| {
        if a.no_prebuild {
            return;
        }
        let (shape, memory, args) = (Shape::of(state), memory.clone(), a.clone());
        let linux = linux.cloned();
        let spawned = std::thread::Builder::new().name("repl-prebuild".into()).spawn(move || {
            // Said now, not only at a takeover: an operator learns
            // while the primary runs that a failover would build
            // the VM in the takeover (the fallback).
            let built = build_backup_vm(&args, &shape, memory, true, linux.as_ref());
            match &built {
                Ok((_, ph)) => tracing::info!(
                    "VM built ahead of a takeover ({:.1} ms to build it)",
                    ph.kernel_ms + ph.config_ms + ph.open_kvm_ms + ph.prepare_ms
                ),
                Err(e) => tracing::warn!(
                    "building the VM ahead failed (a takeover would build it then): {e:#}"
                ),
            }
            built
        });
        match spawned {
            Ok(h) => {
                tracing::info!("full copy received: building the VM ahead of a takeover");
                prebuild = Some((shape, h));
            }
            Err(e) => tracing::warn!("cannot start the thread building the VM ahead: {e}"),
        }
    };
    // COLO's secondary: the VM as a takeover would build it, but with a
    // spare network device (its input comes from the primary) and no disk.
    let mut build_secondary = |memory: nl_memory::GuestMemory, state: &VmState| {
        // Its device is a spare: the name is not opened, only needed for
        // the device to exist when the backup has no TAP of its own.
        let net_tap = a.net_tap.clone().or_else(|| Some("nl-colo".into()));
        let args = BackupArgs { disk: None, net_tap, ..a.clone() };
        build_backup_vm(&args, &Shape::of(state), memory, true, None)
            .map(|(vm, _)| vm)
            .map_err(|e| format!("cannot build the secondary VM: {e:#}"))
    };
    let build: Option<&mut nl_replicate::backup::BuildSecondary> =
        if a.colo { Some(&mut build_secondary) } else { None };
    let end = serve_colo(&cfg, &mut log, &mut first_copy, build).map_err(anyhow::Error::msg)?;
    let (epoch, memory, state, reason, detected, last_heard, linux) = match end {
        BackupEnd::ActivateSecondary { epoch, vm, reason, detected, last_heard, stats } => {
            return take_over_with_secondary(&a, *vm, epoch, &reason, detected, last_heard, stats);
        }
        BackupEnd::PrimaryFinished { message } => {
            println!("primary finished ({message}); backup stands down");
            if a.json {
                println!("{}", serde_json::json!({"activated": false, "primary_finished": true}));
            }
            return Ok(ExitCode::SUCCESS);
        }
        BackupEnd::Rejected { reason, kept_epoch } => {
            println!(
                "{reason}; keeping epoch {}; standing down (the primary runs unprotected)",
                kept_epoch.map_or("none".into(), |e| e.to_string())
            );
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"activated": false, "rejected": reason, "kept_epoch": kept_epoch})
                );
            }
            return Ok(ExitCode::from(3));
        }
        BackupEnd::NothingToActivate { reason } => {
            bail!("the backup has nothing to take over: {reason}")
        }
        BackupEnd::Activate { epoch, memory, state, reason, detected, last_heard, linux } => {
            (epoch, memory, state, reason, detected, last_heard, linux)
        }
    };
    let mut ph = TakeoverPhases { handoff_ms: ms_since(detected), ..Default::default() };
    let vm = match take_prebuilt(&a, prebuild, &memory, &state, &mut ph) {
        Ok(vm) => {
            ph.prebuilt = true;
            drop(memory);
            vm
        }
        Err(why) => {
            tracing::warn!("building the VM in the takeover: {why}");
            ph.fallback = Some(why);
            let t = Instant::now();
            let (vm, build) =
                build_backup_vm(&a, &Shape::of(&state), memory, false, linux.as_deref())?;
            ph.build = build;
            ph.build_ms = ms_since(t);
            vm
        }
    };
    tracing::info!("primary gone ({reason}); taking over from epoch {epoch}");
    let t = Instant::now();
    vm.restore_state(&state).context("cannot activate the VM")?;
    ph.restore_state_ms = ms_since(t);
    let limit = Duration::from_millis(state.workload.duration_ms * 4 + 120_000);
    if let Some(next) = a.next_backup {
        let takeover_ms = ms_since(detected);
        let since_last_frame_ms = ms_since(last_heard);
        // Re-paired: this process is now the VM's primary (it starts the VM).
        let cfg = PrimaryConfig {
            backup: next,
            epoch: Duration::from_millis(20),
            lease: Duration::from_millis(a.lease_ms.max(200)),
            key: Key::load(&a.key_file).map_err(anyhow::Error::msg)?,
            opts: Options::recommended(),
            time_limit: limit,
            reattach: true,
            die_mid_send_after: None,
        };
        tracing::info!(
            "VM restored {takeover_ms:.1} ms after detection; protecting it with the backup at {next}"
        );
        let (report, (digest_ok, ops_per_sec, error)) = run_as_primary(&vm, cfg, false)?;
        println!(
            "took over from epoch {epoch}, then replicated {} epochs to the backup at {next}: digest {}",
            report.epochs,
            if digest_ok { "verified" } else { "NOT verified" },
        );
        if a.json {
            println!(
                "{}",
                serde_json::json!({"activated": true, "epoch": epoch, "reason": reason, "ok": digest_ok,
                    "digest_ok": digest_ok, "ops_per_sec": ops_per_sec, "takeover_ms": takeover_ms,
                    "since_last_frame_ms": since_last_frame_ms, "error": error,
                    "prebuilt": ph.prebuilt, "takeover": ph,
                    "next_backup": {"address": next.to_string(), "epochs": report.epochs,
                        "reattached": report.reattached, "fenced": report.fenced,
                        "unprotected": report.unprotected}})
            );
        }
        return Ok(if digest_ok {
            ExitCode::SUCCESS
        } else if report.fenced {
            ExitCode::from(4)
        } else {
            ExitCode::FAILURE
        });
    }
    let t = Instant::now();
    vm.start()?;
    ph.start_ms = ms_since(t);
    let takeover_ms = ms_since(detected);
    let since_last_frame_ms = ms_since(last_heard);
    ph.first_exit_ms = first_exit_ms(&vm, t);
    tracing::info!(
        "VM running on the backup {takeover_ms:.1} ms after detection \
         ({since_last_frame_ms:.1} ms after the last frame from the primary; {}: {ph:?})",
        if ph.prebuilt { "built ahead" } else { "built in the takeover" }
    );
    if vm.linux_record().is_some() {
        let (ok, ran, end) = run_linux_on(&vm);
        println!(
            "took over the Linux VM from epoch {epoch}; it ran {ran:.0} ms on the backup and ended: {end}"
        );
        if a.json {
            println!(
                "{}",
                serde_json::json!({"activated": true, "epoch": epoch, "reason": reason, "ok": ok,
                    "linux": true, "end": end, "takeover_ms": takeover_ms,
                    "since_last_frame_ms": since_last_frame_ms,
                    "prebuilt": ph.prebuilt, "takeover": ph})
            );
        }
        return Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }
    let ((digest_ok, ops_per_sec, error), ran) = run_to_end(&vm, limit)?;
    println!(
        "took over from epoch {epoch}; ran to the end in {ran:.0} ms: digest {}",
        said(digest_ok, &error)
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"activated": true, "epoch": epoch, "reason": reason, "ok": digest_ok,
                "digest_ok": digest_ok, "ops_per_sec": ops_per_sec, "takeover_ms": takeover_ms,
                "since_last_frame_ms": since_last_frame_ms, "error": error,
                "prebuilt": ph.prebuilt, "takeover": ph})
        );
    }
    Ok(if digest_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Waits (up to `limit`) for a VM the backup runs to end, and verifies it:
/// the verdict, and the ms it ran.
fn run_to_end(vm: &Vm, limit: Duration) -> Result<(Verdict, f64)> {
    let started = Instant::now();
    let outcome = vm.wait(limit);
    let v = if outcome == VmOutcome::Completed {
        verdict(vm)?
    } else {
        (false, 0.0, Some(outcome.message()))
    };
    Ok((v, ms_since(started)))
}

/// "verified", or "NOT verified" and why.
fn said(digest_ok: bool, error: &Option<String>) -> String {
    let e = error.as_ref().map_or(String::new(), |e| format!(" ({e})"));
    format!("{}{e}", if digest_ok { "verified" } else { "NOT verified" })
}

/// COLO's failover: the secondary VM, which ran every input the primary's
/// guest took and sent every reply the primary released, goes on as the
/// VM, on the real TAP. What it sent since the primary's last comparison
/// went to the primary only; TCP sends it again.
fn take_over_with_secondary(
    a: &BackupArgs,
    vm: Vm,
    epoch: u64,
    reason: &str,
    detected: Instant,
    last_heard: Instant,
    stats: nl_replicate::secondary::SecondaryStats,
) -> Result<ExitCode> {
    // Handed over paused, its output hook removed.
    let t = Instant::now();
    if let Some(tap) = a.net_tap.as_deref() {
        let tap = nl_devices::tap::Tap::open(tap)
            .map_err(|e| anyhow::anyhow!("cannot open the TAP for the secondary: {e}"))?;
        if !tap.host_up() {
            tracing::warn!("TAP {} is down on the host: the guest is unreachable", tap.name());
        }
        vm.replace_tap(tap).context("cannot move the secondary to the TAP")?;
    } else {
        tracing::warn!("no --net-tap: the secondary takes over without a network");
    }
    vm.announce();
    vm.resume();
    let takeover_ms = ms_since(detected);
    let since_last_frame_ms = ms_since(last_heard);
    tracing::info!(
        "primary gone ({reason}); the COLO secondary (last checkpoint: epoch {epoch}) runs on \
         as the VM, {takeover_ms:.1} ms after detection ({:.1} ms to move it to the TAP)",
        ms_since(t)
    );
    let ((digest_ok, ops_per_sec, error), ran) = run_to_end(&vm, Duration::from_secs(600))?;
    println!(
        "the COLO secondary took over (last checkpoint: epoch {epoch}); ran to the end in \
         {ran:.0} ms: digest {}",
        said(digest_ok, &error)
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"activated": true, "colo_secondary": true, "epoch": epoch,
                "reason": reason, "ok": digest_ok, "digest_ok": digest_ok,
                "ops_per_sec": ops_per_sec, "takeover_ms": takeover_ms,
                "since_last_frame_ms": since_last_frame_ms, "error": error,
                "secondary": stats})
        );
    }
    Ok(if digest_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: PrimaryArgs,
    }

    fn parse(flags: &[&str]) -> Result<Options> {
        let mut argv = vec!["primary", "--backup", "10.9.0.2:7070", "--key-file", "k"];
        argv.extend(flags);
        Cli::try_parse_from(argv)?.a.options()
    }

    /// The set of optimizations as comparable values.
    #[allow(clippy::type_complexity)]
    fn on(o: &Options) -> (bool, bool, u32, (bool, u64, u64), bool, bool, bool, (bool, bool)) {
        let out = (o.output_epochs, o.output_epoch_ms, o.output_spacing_rate);
        let cap = (o.compare, o.auto_capture);
        (o.selective, o.predict, o.pipeline, out, o.direct, o.histase, o.serial_copy, cap)
    }

    #[test]
    fn the_cli_parser_is_consistent() {
        Cli::command().debug_assert();
    }

    /// No flag: the recommended optimizations, all on; every `--no-*` (and
    /// `--pipeline 0` / `--output-epoch-ms 0` / `--output-spacing-rate 0`) changes exactly its own.
    #[test]
    fn defaults_are_the_recommended_options_and_each_no_flag_turns_one_off() {
        let d = parse(&[]).unwrap();
        assert_eq!(on(&d), on(&Options::recommended()));
        assert!(d.selective && d.predict && d.output_epochs && d.output_spacing_rate > 0, "{d:?}");
        assert!(d.auto_capture);
        let p = parse(&["--no-predict"]).unwrap();
        assert_eq!(on(&p), on(&Options { predict: false, ..d }));
        let a = parse(&["--no-auto-capture"]).unwrap();
        assert_eq!(on(&a), on(&Options { auto_capture: false, ..d }));
        // The captures that replace the log turn the choice off.
        let s = parse(&["--no-selective", "--no-predict"]).unwrap();
        assert_eq!(
            on(&s),
            on(&Options { predict: false, selective: false, auto_capture: false, ..d })
        );
        let c = parse(&["--compare"]).unwrap();
        assert_eq!(
            on(&c),
            on(&Options {
                predict: false,
                selective: false,
                compare: true,
                auto_capture: false,
                ..d
            })
        );
        let o = parse(&["--output-epoch-ms", "0"]).unwrap();
        assert_eq!(on(&o), on(&Options { output_epoch_ms: 0, ..d }));
        let o = parse(&["--no-output-epochs"]).unwrap();
        assert_eq!(on(&o), on(&Options { output_epochs: false, ..d }));
        let o = parse(&["--output-spacing-rate", "0"]).unwrap();
        assert_eq!(on(&o), on(&Options { output_spacing_rate: 0, ..d }));
        let q = parse(&["--pipeline", "2"]).unwrap();
        assert_eq!(on(&q), on(&Options { pipeline: 2, ..d }));
        // Old scripts: the former opt-in flags are accepted and change nothing.
        let old = parse(&["--selective", "--predict"]).unwrap();
        assert_eq!(on(&old), on(&d));
        // --direct has no staging copy for prediction to compare.
        let dr = parse(&["--direct"]).unwrap();
        assert_eq!(
            on(&dr),
            on(&Options { predict: false, direct: true, auto_capture: false, ..d })
        );
        // Histase replaces both dirty-log optimizations.
        let h = parse(&["--histase"]).unwrap();
        assert_eq!(
            on(&h),
            on(&Options {
                selective: false,
                predict: false,
                histase: true,
                auto_capture: false,
                ..d
            })
        );
    }

    #[test]
    fn turning_selective_off_alone_says_prediction_needs_it() {
        let e = parse(&["--no-selective"]).unwrap_err().to_string();
        assert!(e.contains("--no-predict"), "{e}");
        assert!(parse(&["--selective", "--no-selective", "--no-predict"]).is_err());
    }
}
