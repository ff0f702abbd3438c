//! Linux guests: a stock Debian kernel booted under ninelives.
//!
//! The kernel is the vmlinuz of Debian's `linux-image-6.1.0-*-amd64`, which
//! `.ci/run` downloads and caches under `~/.cache/ninelives/kernel`
//! (`NINELIVES_LINUX_KERNEL` names another). Without it these tests print a
//! loud SKIPPED, and fail in CI (`CI` set) or with `NINELIVES_REQUIRE_LINUX=1`.
//!
//! On PVM the kernel's ring 0 is emulated: it reaches its banner after tens
//! of seconds, so the waits are generous (bounded, never asserted on).

use crate::common;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_vmm::linux::{LinuxBoot, LinuxOutcome, WaitStats};
use nl_vmm::Vm;

/// How long a boot may take to show what a test waits for.
const BOOT_LIMIT: Duration = Duration::from_secs(600);

/// The cached Debian kernel, or None after saying SKIPPED (a failure in CI).
fn debian_kernel(test: &str) -> Option<PathBuf> {
    if !common::kvm_available() {
        return None;
    }
    if let Some(p) = std::env::var_os("NINELIVES_LINUX_KERNEL") {
        return Some(PathBuf::from(p));
    }
    let dir = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/ninelives/kernel"))
        .unwrap_or_default();
    let mut found: Vec<PathBuf> = walk(&dir, 4)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .collect();
    found.sort();
    if let Some(k) = found.pop() {
        return Some(k);
    }
    let why = format!(
        "no Debian kernel under {} (run .ci/run, or set NINELIVES_LINUX_KERNEL)",
        dir.display()
    );
    if std::env::var_os("CI").is_some() || std::env::var_os("NINELIVES_REQUIRE_LINUX").is_some() {
        panic!("{test}: {why}");
    }
    eprintln!("\n*** SKIPPED: {test}: {why}; this Linux test did not run ***\n");
    None
}

/// Files under `dir`, at most `depth` levels down.
fn walk(dir: &std::path::Path, depth: u32) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() && depth > 0 {
            out.extend(walk(&p, depth - 1));
        } else if p.is_file() {
            out.push(p);
        }
    }
    out
}

fn linux_config(kernel: &std::path::Path, console: Option<PathBuf>) -> nl_vmm::VmConfig {
    let mut c = common::config(common::params(nl_abi::WORKLOAD_MEMWRITE, 1000), 1);
    c.mem_bytes = 256 << 20;
    c.kernel = Arc::new(std::fs::read(kernel).expect("read the kernel"));
    c.console_path = console;
    c
}

/// The exact command line the tests pass, with a marker of this run.
fn test_cmdline(tag: &str) -> String {
    format!(
        "console=ttyS0 earlyprintk=serial,ttyS0,115200 reboot=k panic=-1 nokaslr \
         ninelives.test={tag}-{}",
        std::process::id()
    )
}

/// A Linux VM on `ninelives host`, created over the HTTP API, on one boot
/// (on PVM a boot to the command line takes a minute or more):
///
/// 1. `POST /v1/vms` with `kernel`, `cmdline`, `console` and a `disk`;
///    bad Linux specs are refused with 400 naming the problem. The VM is
///    listed as `linux`.
/// 2. The console shows the kernel's banner and, on its "Command line:"
///    line, exactly what was passed, followed by the disk's
///    `virtio_mmio.device=` announcement.
/// 3. `POST /v1/rejuvenate` (warm): a new VMM process takes the VM over
///    (the handover record carries its Linux boot); its console goes on
///    (more timestamped lines, time never back, one banner), and the
///    successor lists it, running, as `linux`.
/// 4. Save-restore rejuvenation (`image_dir`): the memory goes through an
///    image file into new memory in a new process; the console goes on in
///    the same way, and the image is removed.
#[test]
fn a_linux_vm_on_a_host_boots_to_its_command_line_and_survives_warm_and_save_restore_rejuvenation()
{
    let Some(kernel) = debian_kernel("a_linux_vm_on_a_host") else { return };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let console = dir.path().join("console.txt");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(16 << 20).unwrap();
    let host_log = std::fs::File::create(dir.path().join("host.log")).unwrap();
    let mut host = common::ninelives()
        .args(["host", "--api", sock.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(host_log)
        .spawn()
        .expect("spawn ninelives host");
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        if t.elapsed() > Duration::from_secs(20) || host.try_wait().unwrap().is_some() {
            common::stop_host(&sock, &mut host);
            panic!("the host did not start listening");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let guard = HostGuard { sock: sock.clone(), child: host, dir: dir.path().to_path_buf() };
    let k = kernel.to_str().unwrap();

    // 1. Bad Linux specs: 400, naming what is wrong; nothing is created.
    let text_file = common::write_file(dir.path(), "not-a-kernel", b"hello\n");
    let long = "x".repeat(4096);
    for (body, needle) in [
        (serde_json::json!({"kernel": "/nonexistent/vmlinuz"}), "/nonexistent/vmlinuz"),
        (serde_json::json!({"kernel": text_file}), "not a Linux bzImage or vmlinux"),
        (serde_json::json!({"kernel": k, "vcpus": 33}), "vcpus 33 is out of range"),
        (serde_json::json!({"kernel": k, "cmdline": long}), "kernel command line"),
        (serde_json::json!({"kernel": k, "ws": "8M"}), "\"ws\" is a field of the reference"),
        (serde_json::json!({"cmdline": "quiet"}), "give its \"kernel\" too"),
        (serde_json::json!({"kernel": k, "initrd": "/nonexistent/initrd"}), "/nonexistent/initrd"),
    ] {
        let (status, v) = common::http_json(&sock, "POST", "/v1/vms", Some(&body.to_string()));
        assert_eq!(status, 400, "{body} -> {v}");
        let e = v["error"].as_str().unwrap_or_default();
        assert!(e.contains(needle), "{body}: error {e:?} does not name {needle:?}");
    }
    let (_, v) = common::http_json(&sock, "GET", "/v1/vms", None);
    assert_eq!(v["vms"], serde_json::json!([]), "a refused spec created a VM: {v}");

    let cmdline = test_cmdline("host");
    let body = serde_json::json!({"kernel": k, "cmdline": cmdline, "console": console,
                                  "mem": "256M", "disk": disk});
    let (status, v) = common::http_json(&sock, "POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(status, 201, "create the Linux VM: {v}");
    let id = v["id"].as_u64().unwrap();
    let listed = |what: &str| {
        let (_, v) = common::http_json(&sock, "GET", "/v1/vms", None);
        let vm = v["vms"].as_array().and_then(|a| a.iter().find(|x| x["id"] == id)).cloned();
        let vm = vm.unwrap_or_else(|| panic!("{what}: VM {id} not listed: {v}"));
        assert_eq!(vm["workload"], "linux", "{what}: {vm}");
        assert_eq!(vm["state"], "running", "{what}: {vm}; console:\n{}", guard.console_tail());
    };
    listed("created");

    // 2. The banner and the exact command line. On PVM the VMM adds the
    //    parameters its emulator needs (PVM_CMDLINE).
    let booted = nl_arch::linux::boot_cmdline(&cmdline, nl_arch::backend::Backend::detect());
    assert!(booted.starts_with(&cmdline));
    let want = format!("Command line: {booted} virtio_mmio.device=4K@0xd0004000:5");
    let start = Instant::now();
    let text = wait_console(&console, BOOT_LIMIT, |text| {
        // Printed one byte at a time (emulated ring 0): the whole line.
        text.split_inclusive('\n').any(|l| l.contains("Command line:") && l.ends_with('\n'))
            && stamped(text).last().is_some_and(|l| l.0 > 0.0)
    });
    let head: String = text.chars().take(3000).collect();
    assert!(text.contains("Linux version 6."), "no banner; console:\n{head}");
    let echoed = text
        .lines()
        .any(|l| l.trim_end_matches('\r').split_once("] ").is_some_and(|(_, rest)| rest == want));
    assert!(echoed, "command line not echoed exactly (want {want:?}); console:\n{head}");
    assert!(
        stamped(&text).last().is_some_and(|l| l.0 > 0.0),
        "the kernel's clock never ran within {BOOT_LIMIT:?}; console:\n{}",
        tail(&text)
    );
    eprintln!("host: banner and command line after {:.1} s", start.elapsed().as_secs_f64());
    listed("booting");

    // 3. Warm rejuvenation of the host: a new process takes the VM over.
    let last = rejuvenate_host_and_continue(&sock, &console, id, "warm", &serde_json::json!({}));
    listed("after the warm rejuvenation");
    eprintln!("host: warm rejuvenation at kernel time {last} s");
    // 4. Save-restore rejuvenation: the memory goes to an image file and
    //    comes back in new memory in a new process.
    let images = tempfile::tempdir().unwrap();
    let last = rejuvenate_host_and_continue(
        &sock,
        &console,
        id,
        "save-restore",
        &serde_json::json!({"image_dir": images.path()}),
    );
    listed("after the save-restore rejuvenation");
    assert_eq!(std::fs::read_dir(images.path()).unwrap().count(), 0, "images are removed");
    eprintln!("host: save-restore rejuvenation at kernel time {last} s");
    drop(guard);
}

/// Rejuvenates the host holding Linux VM `id` (`mode`, with the request's
/// `extra` fields): a new process serves the socket, and the VM's console
/// goes on where it was (three more timestamped lines, time never back,
/// one banner). Returns the kernel time of the last line before.
fn rejuvenate_host_and_continue(
    sock: &std::path::Path,
    console: &std::path::Path,
    id: u64,
    mode: &str,
    extra: &serde_json::Value,
) -> f64 {
    let info = || {
        nl_vmm::api::request_timeout(
            sock,
            &serde_json::json!({"op": "info"}),
            Duration::from_secs(60),
        )
        .expect("the host answers")["pid"]
            .as_u64()
            .unwrap()
    };
    let old_pid = info();
    let mut req = serde_json::json!({"op": "rejuvenate", "mode": mode, "timeout_secs": 240});
    for (k, v) in extra.as_object().unwrap() {
        req[k] = v.clone();
    }
    let r = nl_vmm::api::request_timeout(sock, &req, Duration::from_secs(300))
        .expect("a reply to rejuvenate");
    assert_eq!(r["ok"], true, "{mode}: {r}");
    assert_eq!(r["handed_over"], true, "{mode}: {r}");
    assert_eq!(
        r["report"]["vms"].as_array().map(Vec::len),
        Some(1),
        "{mode}: the VM was carried: {r}"
    );
    let mark = read_console(console).len();
    let before = String::from_utf8_lossy(&read_console(console)).into_owned();
    let last_before = *timestamps(&before).last().unwrap();
    assert_ne!(info(), old_pid, "{mode}: the same process still serves");
    // Or until the VM has ended in the successor.
    let ended = || {
        let (_, v) = common::http_json(sock, "GET", "/v1/vms", None);
        v["vms"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["id"] == id))
            .is_none_or(|x| x["state"].as_str().is_some_and(|s| s != "running" && s != "paused"))
    };
    let text =
        wait_console(console, BOOT_LIMIT, |text| stamped(&text[mark..]).len() >= 3 || ended());
    assert!(
        stamped(&text[mark..]).len() >= 3,
        "{mode}: the kernel did not go on after the rejuvenation; console tail:\n{}\nVM: {}",
        tail(&text),
        common::http(sock, "GET", &format!("/v1/vms/{id}"), None).1
    );
    assert_continues(&format!("{mode} rejuvenation"), console, mark, last_before);
    last_before
}

/// Ends a test's host (and its successor) and prints its log.
struct HostGuard {
    sock: PathBuf,
    child: std::process::Child,
    dir: PathBuf,
}

impl HostGuard {
    fn console_tail(&self) -> String {
        tail(&String::from_utf8_lossy(&read_console(&self.dir.join("console.txt"))))
    }
}

impl Drop for HostGuard {
    fn drop(&mut self) {
        common::stop_host(&self.sock, &mut self.child);
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("host.log")).unwrap_or_default();
            eprintln!("host log:\n{}", tail(&log));
        }
    }
}

/// Reads the console file until `done` holds for its text, or `limit`
/// passes; returns the last text read.
fn wait_console(
    console: &std::path::Path,
    limit: Duration,
    mut done: impl FnMut(&str) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        let text = String::from_utf8_lossy(&read_console(console)).into_owned();
        if done(&text) || start.elapsed() > limit {
            return text;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Lines of the console that carry a kernel timestamp, in order.
fn timestamps(text: &str) -> Vec<f64> {
    stamped(text).into_iter().map(|(t, _)| t).collect()
}

/// The complete lines of `text` that carry a kernel timestamp: (time, message).
fn stamped(text: &str) -> Vec<(f64, String)> {
    text.split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .filter_map(|l| {
            let (ts, msg) = l.strip_prefix('[')?.split_once("] ")?;
            Some((ts.trim().parse().ok()?, msg.trim_end().to_string()))
        })
        .collect()
}

fn read_console(p: &std::path::Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_default()
}

/// The timestamped lines the console got after byte `mark`.
fn stamped_after(console: &std::path::Path, mark: usize) -> Vec<(f64, String)> {
    let now = read_console(console);
    stamped(&String::from_utf8_lossy(&now[mark.min(now.len())..]))
}

/// Runs `vm` (completing what PVM's emulator stops on) until the lines
/// after `mark` satisfy `enough`; fails the test otherwise.
fn run_until(
    vm: &Vm,
    console: &std::path::Path,
    mark: usize,
    stage: &str,
    stats: &mut WaitStats,
    enough: impl Fn(&[(f64, String)]) -> bool,
) -> Vec<(f64, String)> {
    let o = nl_vmm::linux::wait(vm, BOOT_LIMIT, |_| enough(&stamped_after(console, mark)), stats);
    let text = String::from_utf8_lossy(&read_console(console)).into_owned();
    assert_eq!(
        o,
        LinuxOutcome::Reached,
        "{stage}: the kernel did not go on; console tail:\n{}",
        tail(&text)
    );
    stamped_after(console, mark)
}

/// After a move to a new VM: the console goes on where it was (more
/// lines, timestamps from `last_before` on and in order, no second boot).
fn assert_continues(stage: &str, console: &std::path::Path, mark: usize, last_before: f64) {
    let text = String::from_utf8_lossy(&read_console(console)).into_owned();
    assert_eq!(
        text.matches("Linux version").count(),
        1,
        "{stage}: the kernel started again:\n{text}"
    );
    let after = timestamps(&text[mark..]);
    assert!(after[0] >= last_before, "{stage}: time went back: {last_before} then {after:?}");
    assert!(after.windows(2).all(|w| w[0] <= w[1]), "{stage}: timestamps out of order: {after:?}");
}

/// A Linux VM's mechanisms mid-boot, on one boot (each stage boots nothing
/// again; on PVM a boot to the command line takes a minute or more):
///
/// 1. virtio-mmio: the VM has a virtio-blk disk, and the kernel's command
///    line announces it (`virtio_mmio.device=4K@0xd0004000:5`).
/// 2. pause: the console stands still while paused; the saved state holds
///    the serial and i8042 devices.
/// 3. warm rejuvenation in process: a new KVM VM over the same memfd from
///    the saved state (`Vm::restore_linux`), the old one dropped; the
///    console goes on (more lines, time never back, one banner).
/// 4. μCheckpoint rollback: a checkpoint (dirty-log engine and the VM
///    state), a run of at least a second of kernel time, a rollback. The
///    kernel's clock goes back to the checkpoint's and it prints again what
///    it printed after the checkpoint.
/// 5. a warm handover record (what `ninelives host` hands a successor
///    process): it carries the Linux boot (kernel file, command line) and
///    the state; written and read back, it alone rebuilds the VM over the
///    same memfd (`handover::build_vm`), and the console goes on.
/// 6. save to a file and restore from it: the VM is saved (state and
///    memory) to a checkpoint file whose header names the Linux boot
///    (version 2), stopped and dropped; `ninelives restore FILE` builds a
///    Linux VM from the file alone, and the console goes on.
#[test]
fn linux_vm_mid_boot_mechanisms_continue_its_console() {
    let Some(kernel) = debian_kernel("linux_vm_mid_boot_mechanisms") else { return };
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.txt");
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk).unwrap().set_len(16 << 20).unwrap();
    let mut config = linux_config(&kernel, Some(console.clone()));
    config.disk = Some(nl_vmm::config::DiskConfig { path: disk, readonly: false });
    let boot = LinuxBoot {
        cmdline: test_cmdline("mechanisms"),
        kernel_path: Some(kernel.clone()),
        ..Default::default()
    };
    let kvm = nl_vmm::open_kvm().unwrap();
    let old = Vm::create_linux(&kvm, 0, config.clone(), &boot).expect("create the Linux VM");
    old.start().unwrap();
    let mut stats = WaitStats::default();
    let o = nl_vmm::linux::wait(
        &old,
        BOOT_LIMIT,
        |t| t.split_inclusive('\n').any(|l| l.contains("Command line:") && l.ends_with('\n')),
        &mut stats,
    );
    assert_eq!(o, LinuxOutcome::Reached, "console: {}", old.console().tail());

    // 1. The disk is announced on the command line.
    let text = String::from_utf8_lossy(&read_console(&console)).into_owned();
    let line = text.lines().find(|l| l.contains("Command line:")).unwrap();
    assert!(
        line.trim_end().ends_with(" virtio_mmio.device=4K@0xd0004000:5"),
        "virtio-blk not announced: {line}"
    );

    // 2. Pause: the console stands still while paused.
    old.pause();
    let before = read_console(&console);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(read_console(&console).len(), before.len(), "output while paused");
    let state = old.save_state().unwrap();
    let names: Vec<&str> = state.io_devices.iter().map(|d| d.name.as_str()).collect();
    assert!(names.contains(&"serial") && names.contains(&"i8042"), "saved devices: {names:?}");
    let last_before = *timestamps(&String::from_utf8_lossy(&before)).last().unwrap();

    // 3. The successor: a new KVM VM over the same memfd, from the saved state.
    let memory = nl_memory::GuestMemory::from_fd(old.memory().fd().clone(), config.mem_bytes)
        .expect("map the guest memory again");
    let record = old.linux_record().cloned().expect("a Linux VM");
    old.stop();
    drop(old);
    let vm = Vm::restore_linux(&kvm, 0, config.clone(), memory, &state, &record).expect("restore");
    vm.start().unwrap();
    let mark = before.len();
    // Until the kernel's clock runs (the earliest lines all say 0.000000),
    // so that the checkpoint below has a time of its own.
    run_until(&vm, &console, mark, "after rejuvenation", &mut stats, |l| {
        l.len() >= 3 && l.last().is_some_and(|x| x.0 > 0.0)
    });
    assert_continues("rejuvenation", &console, mark, last_before);

    // 4. μCheckpoint, a second or more of kernel time, rollback.
    vm.pause();
    let at_checkpoint = vm.save_state().unwrap();
    let mut engine =
        nl_checkpoint::engine::Engine::start(nl_checkpoint::Mode::DirtyLog, &vm, 1).unwrap();
    let mark_c = read_console(&console).len();
    let t_c = *timestamps(&String::from_utf8_lossy(&read_console(&console))).last().unwrap();
    vm.resume();
    let ran = run_until(&vm, &console, mark_c, "after the checkpoint", &mut stats, |l| {
        l.len() >= 3 && l.last().is_some_and(|x| x.0 >= t_c + 1.0)
    });
    vm.halt_vcpus();
    let r = engine.rollback(&vm, 0).expect("roll memory back");
    vm.restore_state(&at_checkpoint).expect("restore the checkpoint's state");
    let mark_r = read_console(&console).len();
    vm.relaunch().unwrap();
    let again =
        run_until(&vm, &console, mark_r, "after the rollback", &mut stats, |l| l.len() >= 2);
    drop(engine);
    let t_max = ran.last().unwrap().0;
    assert!(t_c > 0.0, "the checkpoint came before the kernel's clock ran");
    assert!(
        again[0].0 >= t_c && again[0].0 < t_max,
        "the kernel's clock did not go back to the checkpoint's ({t_c} s; it had reached \
         {t_max} s): after the rollback {:?}",
        again
    );
    assert_eq!(
        again[0].1, ran[0].1,
        "not the same kernel path after the rollback ({} pages)",
        r.pages
    );
    assert!(again.windows(2).all(|w| w[0].0 <= w[1].0), "timestamps out of order: {again:?}");
    eprintln!(
        "rollback: checkpoint at kernel time {t_c} s, ran to {t_max} s, {} pages rolled back; \
         then {} s: {}",
        r.pages, again[0].0, again[0].1
    );

    // 5. A warm handover record: the VM described as a successor process
    //    reads it (its Linux boot, its state), written and read back; the
    //    VM is rebuilt from the record alone over the same memfd.
    vm.pause();
    let state = vm.save_state().unwrap();
    let mut rec = nl_vmm::handover::VmRecord::describe_vm(&vm, false);
    let linux = rec.linux.clone().expect("the record says how the Linux VM was booted");
    assert_eq!(
        (linux.cmdline.as_str(), linux.kernel.as_deref()),
        (boot.cmdline.as_str(), Some(kernel.as_path()))
    );
    rec.state = Some(String::from_utf8(state.to_bytes()).unwrap());
    let mut record =
        nl_vmm::handover::HandoverRecord::new(nl_vmm::handover::Mode::Warm, 1, None, 1);
    record.vms.push(rec);
    let record = nl_vmm::handover::HandoverRecord::from_bytes(&record.to_bytes()).unwrap();
    let memory = nl_memory::GuestMemory::from_fd(vm.memory().fd().clone(), config.mem_bytes)
        .expect("map the guest memory again");
    let mark = read_console(&console).len();
    let last_before =
        *timestamps(&String::from_utf8_lossy(&read_console(&console))).last().unwrap();
    vm.stop();
    drop(vm);
    // What a successor binary supplies: its own reference-guest images.
    let images = nl_vmm::handover::Images {
        kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
    };
    let vm = nl_vmm::handover::build_vm(&kvm, &record.vms[0], &images, Some(memory))
        .expect("rebuild the Linux VM from its handover record");
    vm.start().unwrap();
    run_until(&vm, &console, mark, "after the handover record", &mut stats, |l| l.len() >= 3);
    assert_continues("handover record", &console, mark, last_before);

    // 6. Save to a file, drop the VM, restore from the file alone with
    //    `ninelives restore FILE`: its header says the VM is Linux.
    vm.pause();
    let state = vm.save_state().unwrap();
    let header = nl_checkpoint::disk::DiskHeader {
        version: nl_checkpoint::disk::DISK_VERSION,
        mem_bytes: config.mem_bytes,
        vcpus: config.vcpus,
        timer_hz: config.timer_hz,
        workload: config.workload,
        pages: 0,
        linux: vm.linux_record().cloned(),
        disk: config.disk.clone(),
    };
    let file = dir.path().join("linux.ckpt");
    nl_checkpoint::disk::capture(&header, &state, vm.memory(), &|_| None)
        .and_then(|img| img.write(&file, None))
        .expect("save to a file");
    let mark = read_console(&console).len();
    let last_before =
        *timestamps(&String::from_utf8_lossy(&read_console(&console))).last().unwrap();
    vm.stop();
    drop(vm);
    let ck = nl_checkpoint::disk::read(&file, None).expect("read the file back");
    assert_eq!(ck.header.version, nl_checkpoint::disk::DISK_VERSION_LINUX);
    assert_eq!(ck.header.linux.as_ref(), Some(&linux), "the file names the Linux boot");
    drop(ck);
    let mut restore = common::ninelives()
        .arg("restore")
        .arg(&file)
        .arg("--console")
        .arg(&console)
        .args(["--duration", "900"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ninelives restore");
    let text = wait_console(&console, BOOT_LIMIT, |t| {
        // Or until the restore ends (it should not, before its duration).
        stamped(&t[mark.min(t.len())..]).len() >= 3 || restore.try_wait().unwrap().is_some()
    });
    let exited = restore.try_wait().unwrap();
    let _ = restore.kill();
    let out = restore.wait_with_output().unwrap();
    assert!(
        stamped(&text[mark..]).len() >= 3,
        "restore FILE: the kernel did not go on (exited: {exited:?}); console tail:\n{}\n\
         stdout: {}\nstderr: {}",
        tail(&text),
        String::from_utf8_lossy(&out.stdout),
        tail(&String::from_utf8_lossy(&out.stderr))
    );
    assert_continues("restore FILE", &console, mark, last_before);
}

fn tail(s: &str) -> String {
    let n = s.len().saturating_sub(2000);
    s[s.floor_char_boundary_compat(n)..].to_string()
}

trait FloorBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorBoundary for str {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        while i > 0 && !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// A static x86-64 executable that writes `msg` to stdout and reboots
/// (`reboot(LINUX_REBOOT_CMD_RESTART)`: with `reboot=k` the i8042 reset).
fn init_elf(msg: &[u8]) -> Vec<u8> {
    let mut code: Vec<u8> = Vec::new();
    code.extend_from_slice(&[0xb8, 1, 0, 0, 0]); // mov eax, 1 (write)
    code.extend_from_slice(&[0xbf, 1, 0, 0, 0]); // mov edi, 1
    code.extend_from_slice(&[0x48, 0x8d, 0x35]); // lea rsi, [rip + msg]
    code.extend_from_slice(&31u32.to_le_bytes());
    code.push(0xba); // mov edx, len
    code.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    code.extend_from_slice(&[0x0f, 0x05]); // syscall
    code.extend_from_slice(&[0xb8, 169, 0, 0, 0]); // mov eax, 169 (reboot)
    code.extend_from_slice(&[0xbf, 0xad, 0xde, 0xe1, 0xfe]); // magic 1
    code.extend_from_slice(&[0xbe, 0x69, 0x19, 0x12, 0x28]); // magic 2
    code.extend_from_slice(&[0xba, 0x67, 0x45, 0x23, 0x01]); // LINUX_REBOOT_CMD_RESTART
    code.extend_from_slice(&[0x0f, 0x05]); // syscall
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    assert_eq!(code.len(), 48);
    code.extend_from_slice(msg);
    // One PT_LOAD whose file offset and address agree modulo the page size.
    let vaddr = 0x40_0000u64 + 120;
    let mut e = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&vaddr.to_le_bytes());
    e.extend_from_slice(&64u64.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&5u32.to_le_bytes()); // R+X
    e.extend_from_slice(&120u64.to_le_bytes());
    e.extend_from_slice(&vaddr.to_le_bytes());
    e.extend_from_slice(&vaddr.to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(&code);
    e
}

/// A newc cpio archive: `/dev/console`, and `/init` running `init`.
fn initramfs(init: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut entry = |ino: u32, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]| {
        let hdr = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        out.extend_from_slice(hdr.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    entry(1, "dev", 0o040755, (0, 0), &[]);
    entry(2, "dev/console", 0o020600, (5, 1), &[]);
    entry(3, "init", 0o100755, (0, 0), init);
    entry(0, "TRAILER!!!", 0, (0, 0), &[]);
    out
}

/// On VMX/SVM: the stock kernel boots to an initramfs `/init` that prints a
/// line and reboots; the i8042 reset ends the VM. On PVM the kernel stops
/// long before user space (see docs/linux-guests.md): SKIPPED, loudly.
#[test]
fn stock_kernel_runs_an_initramfs_init_to_power_off_on_vmx_or_svm() {
    let Some(kernel) = debian_kernel("stock_kernel_runs_an_initramfs_init") else { return };
    let backend = nl_arch::backend::Backend::detect();
    if backend == nl_arch::backend::Backend::Pvm {
        eprintln!(
            "\n*** SKIPPED: stock_kernel_runs_an_initramfs_init: the backend is PVM, where a \
             stock kernel's ring 0 is emulated and stops before user space; this test needs \
             VMX or SVM ***\n"
        );
        return;
    }
    let line = format!("ninelives-init: hello from pid 1 ({})\n", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let initrd = dir.path().join("initramfs.cpio");
    std::fs::File::create(&initrd)
        .unwrap()
        .write_all(&initramfs(&init_elf(line.as_bytes())))
        .unwrap();
    let console = dir.path().join("console.txt");
    let out = common::ninelives()
        .args(["run", "--kernel"])
        .arg(&kernel)
        .args(["--cmdline", "console=ttyS0 reboot=k panic=-1 quiet", "--duration", "120"])
        .arg("--initrd")
        .arg(&initrd)
        .arg("--console")
        .arg(&console)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&std::fs::read(&console).unwrap_or_default()).into_owned();
    let err = common::stderr(&out);
    assert!(text.contains(line.trim_end()), "init's line missing; console:\n{text}\n{err}");
    assert!(err.contains("the guest reset"), "the VM did not end by the i8042 reset: {err}");
    assert!(out.status.success(), "{err}");
}

/// The CPIO and init builders above produce what the kernel expects.
#[test]
fn initramfs_builder_writes_newc_entries() {
    let a = initramfs(&init_elf(b"x\n"));
    assert!(a.starts_with(b"070701"));
    assert_eq!(a.len() % 4, 0);
    let s = String::from_utf8_lossy(&a);
    for name in ["dev/console", "init", "TRAILER!!!"] {
        assert!(s.contains(name), "{name} missing");
    }
}

/// A Linux VM with 2 vCPUs: its MP table is in guest memory at 0x9fc00,
/// its AP waits for SIPI (`KVM_MP_STATE_INIT_RECEIVED`) with its own APIC
/// id in CPUID, and pause, save and a rebuild over the same memory from
/// the saved state (what warm rejuvenation and `restore` do:
/// `Vm::restore_linux`) keep both vCPUs, the AP still waiting. A few
/// seconds of boot: the kernel has not started its AP yet (on PVM that
/// takes minutes; see docs/linux-guests.md).
#[test]
fn a_linux_vm_with_two_vcpus_keeps_its_waiting_ap_across_save_and_restore() {
    use nl_memory::vm_memory::{Bytes, GuestAddress};
    // KVM's ABI values (linux/kvm.h).
    const KVM_MP_STATE_RUNNABLE: u32 = 0;
    const KVM_MP_STATE_INIT_RECEIVED: u32 = 2;
    const KVM_MAX_CPUID_ENTRIES: usize = 80;
    let Some(kernel) = debian_kernel("a_linux_vm_with_two_vcpus") else { return };
    let mut config = linux_config(&kernel, None);
    config.vcpus = 2;
    let boot = LinuxBoot { cmdline: test_cmdline("two-vcpus"), ..Default::default() };
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create_linux(&kvm, 0, config.clone(), &boot).expect("create the Linux VM");
    let mut sig = [0u8; 4];
    vm.memory().mem().read_slice(&mut sig, GuestAddress(0x9fc00)).unwrap();
    assert_eq!(&sig, b"_MP_", "the MP floating pointer");
    vm.start().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    vm.pause();
    let state = vm.save_state().unwrap();
    assert_eq!(state.vcpus.len(), 2);
    assert_eq!(state.vcpus[0].mp_state.mp_state, KVM_MP_STATE_RUNNABLE);
    assert_eq!(state.vcpus[1].mp_state.mp_state, KVM_MP_STATE_INIT_RECEIVED);
    let record = vm.linux_record().cloned().unwrap();
    let memory = nl_memory::GuestMemory::from_fd(vm.memory().fd().clone(), config.mem_bytes)
        .expect("map the guest memory again");
    vm.stop();
    drop(vm);
    let new = Vm::restore_linux(&kvm, 1, config, memory, &state, &record)
        .expect("rebuild the 2-vCPU Linux VM from its state");
    let (mp, apic_id) = new
        .with_vcpu(1, |fd| {
            let mp = fd.get_mp_state().unwrap().mp_state;
            let cpuid = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
            let leaf1 = cpuid.as_slice().iter().find(|e| e.function == 1).copied().unwrap();
            (mp, leaf1.ebx >> 24)
        })
        .unwrap();
    assert_eq!(mp, KVM_MP_STATE_INIT_RECEIVED, "the AP still waits for SIPI");
    assert_eq!(apic_id, 1, "vCPU 1's CPUID names APIC id 1");
}

/// A bad kernel image or command line is refused with a clear error, not a
/// crash: a bzImage whose payload points outside the file, a command line
/// longer than Linux accepts, and more vCPUs than an MP table describes.
/// A VM with 2 vCPUs builds and runs: its application processor waits for
/// the kernel's INIT/SIPI (`KVM_MP_STATE_INIT_RECEIVED`, 2).
#[test]
fn bad_linux_input_is_refused_with_a_clear_error() {
    if !common::kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut bz = vec![0u8; 0x2000];
    bz[0x1fe] = 0x55;
    bz[0x1ff] = 0xaa;
    bz[0x202..0x206].copy_from_slice(b"HdrS");
    bz[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes());
    bz[0x1f1] = 1;
    bz[0x24c..0x250].copy_from_slice(&0x10_0000u32.to_le_bytes());
    let k = common::write_file(dir.path(), "bzImage", &bz);
    let o = common::run_cli(&["run", "--kernel", &k, "--duration", "5"]);
    common::assert_clean_error(&o, "outside the bzImage");

    let Some(kernel) = debian_kernel("bad_linux_input_is_refused") else { return };
    let kernel = kernel.to_string_lossy().into_owned();
    let long = "x".repeat(4096);
    let o = common::run_cli(&["run", "--kernel", &kernel, "--cmdline", &long, "--duration", "5"]);
    common::assert_clean_error(&o, "kernel command line");
    let o = common::run_cli(&["run", "--kernel", &kernel, "--vcpus", "33", "--duration", "5"]);
    common::assert_clean_error(&o, "--vcpus 33 is out of range");
    // The same kernel through `run` (its boot to the banner is checked on
    // a host, above), with 2 vCPUs: it builds, runs and stops at
    // --duration; in 3 s the kernel (clearing its BSS) has not started its
    // AP, which still waits for SIPI.
    let con = dir.path().join("run-console.txt");
    let o = common::run_cli(&[
        "run",
        "--kernel",
        &kernel,
        "--vcpus",
        "2",
        "--duration",
        "3",
        "--console",
        con.to_str().unwrap(),
    ]);
    let err = common::stderr(&o);
    assert!(o.status.success(), "run --kernel: {err}");
    assert!(err.contains("linux: stopped after --duration 3 s"), "run --kernel: {err}");
    assert!(err.contains("vcpu0 mp_state 0 "), "the BSP runs: {err}");
    assert!(err.contains("vcpu1 mp_state 2 "), "the AP waits for SIPI: {err}");
}

/// A Linux VM's time limit on a host (`duration`, in `host --config` and
/// in the create body): the host stops the VM at the limit and lists it as
/// stopped at its time limit, not failed; its vCPU no longer runs. (A VM
/// without a `duration` has no limit: `LinuxRecord::past_time_limit`'s unit
/// test.) The limits are past the kernel's BSS clear, one emulated
/// `rep stosb` that a stop cannot interrupt on PVM.
#[test]
fn a_linux_vm_on_a_host_is_stopped_at_its_time_limit() {
    let Some(kernel) = debian_kernel("a_linux_vm_on_a_host_is_stopped_at_its_time_limit") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let k = kernel.to_str().unwrap();
    // VM 0 from the configuration file, VM 1 over the API.
    let config = serde_json::json!({"vms": [{"kernel": k, "mem": "256M", "duration": 20,
        "console": dir.path().join("console0.txt")}]});
    let config_file = common::write_file(dir.path(), "host.json", config.to_string().as_bytes());
    let (host, _s) = common::spawn_host_with(&sock, &["--config", &config_file]);
    let guard = HostGuard { sock: sock.clone(), child: host, dir: dir.path().to_path_buf() };
    let body = serde_json::json!({"kernel": k, "mem": "256M", "duration": 25.5,
        "console": dir.path().join("console1.txt")});
    let (status, v) = common::http_json(&sock, "POST", "/v1/vms", Some(&body.to_string()));
    assert_eq!(status, 201, "create VM 1: {v}");
    assert_eq!(v["id"], 1, "{v}");
    let state = |id: u64| {
        let (_, v) = common::http_json(&sock, "GET", "/v1/vms", None);
        v["vms"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["id"] == id))
            .map(|x| x["state"].as_str().unwrap_or_default().to_string())
            .unwrap_or_else(|| panic!("VM {id} not listed: {v}"))
    };
    assert_eq!(state(0), "running");
    for (id, secs) in [(0, 20.0), (1, 25.5)] {
        let want = format!("stopped: its time limit (duration {secs:.1} s) was reached");
        let t = Instant::now();
        let mut s = state(id);
        while s != want && t.elapsed() < Duration::from_secs(400) {
            std::thread::sleep(Duration::from_millis(500));
            s = state(id);
        }
        assert_eq!(s, want, "VM {id} was not stopped at its limit of {secs} s");
        let (_, st) = common::http_json(&sock, "GET", &format!("/v1/vms/{id}"), None);
        let st = &st["stats"];
        assert_eq!(st["outcome"]["kind"], "timed_out", "{st}");
        assert_eq!(st["outcome"]["limit_ms"], (secs * 1000.0) as u64, "{st}");
        assert!(!st["vcpus"][0]["stop"].is_null(), "its vCPU still runs: {st}");
    }
    drop(guard);
}

/// The channels of a PIT state a restore must carry (the load time is
/// KVM's clock at the restore, so it is not compared).
fn pit_of(vm: &Vm) -> Vec<(u32, u8, u8, u8, u8)> {
    let p = vm.vm_fd().get_pit2().expect("KVM_GET_PIT2");
    p.channels.iter().map(|c| (c.count, c.mode, c.rw_mode, c.gate, c.bcd)).collect()
}

/// A Linux VM's in-kernel PIT (`KVM_GET_PIT2`) is part of its saved state:
/// a VM rebuilt from a checkpoint file (`nl_checkpoint::disk`) and one
/// rebuilt from a warm handover record (`handover::build_vm`) have the
/// PIT channels as saved (a fresh PIT's channel 0 counts 0x10000 in mode
/// 0). A state written by an older process, without the PIT, still reads
/// and restores (the PIT keeps its fresh state). The kernel is not run.
#[test]
fn a_linux_vm_pit_state_survives_its_checkpoint_file_and_handover_record() {
    let Some(kernel) = debian_kernel("a_linux_vm_pit_state_survives") else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = linux_config(&kernel, None);
    let boot = LinuxBoot {
        cmdline: test_cmdline("pit"),
        kernel_path: Some(kernel.clone()),
        ..Default::default()
    };
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create_linux(&kvm, 0, config.clone(), &boot).expect("create the Linux VM");
    // What a kernel programs: channel 0 periodic (mode 2) at 100 Hz, and
    // channel 2 (the speaker's) one-shot.
    let fresh = pit_of(&vm);
    let mut pit = vm.vm_fd().get_pit2().unwrap();
    pit.channels[0].count = 11932;
    pit.channels[0].mode = 2;
    pit.channels[0].rw_mode = 3;
    pit.channels[2].count = 0x1234;
    pit.channels[2].mode = 1;
    vm.vm_fd().set_pit2(&pit).unwrap();
    let want = pit_of(&vm);
    assert_ne!(want, fresh, "the test's PIT state is not distinguishable from a fresh one");
    let state = vm.save_state().unwrap();
    let memory = || {
        nl_memory::GuestMemory::from_fd(vm.memory().fd().clone(), config.mem_bytes)
            .expect("map the guest memory again")
    };
    let linux = vm.linux_record().cloned().unwrap();

    // A checkpoint file.
    let header = nl_checkpoint::disk::DiskHeader {
        version: nl_checkpoint::disk::DISK_VERSION,
        mem_bytes: config.mem_bytes,
        vcpus: config.vcpus,
        timer_hz: config.timer_hz,
        workload: config.workload,
        pages: 0,
        linux: Some(linux.clone()),
        disk: None,
    };
    let file = dir.path().join("pit.ckpt");
    nl_checkpoint::disk::capture(&header, &state, vm.memory(), &|_| None)
        .and_then(|img| img.write(&file, None))
        .expect("save to a file");
    let ck = nl_checkpoint::disk::read(&file, None).expect("read the file back");
    let from_file = Vm::restore_linux(&kvm, 1, config.clone(), memory(), &ck.state, &linux)
        .expect("restore from the file");
    assert_eq!(pit_of(&from_file), want, "checkpoint file: the PIT was not restored");
    drop(from_file);

    // A warm handover record.
    let mut rec = nl_vmm::handover::VmRecord::describe_vm(&vm, false);
    rec.state = Some(String::from_utf8(state.to_bytes()).unwrap());
    rec.id = 2;
    let mut record =
        nl_vmm::handover::HandoverRecord::new(nl_vmm::handover::Mode::Warm, 1, None, 3);
    record.vms.push(rec);
    let record = nl_vmm::handover::HandoverRecord::from_bytes(&record.to_bytes()).unwrap();
    let images = nl_vmm::handover::Images {
        kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
    };
    let handed = nl_vmm::handover::build_vm(&kvm, &record.vms[0], &images, Some(memory()))
        .expect("rebuild from the handover record");
    assert_eq!(pit_of(&handed), want, "handover record: the PIT was not restored");
    drop(handed);

    // An older process's state: no "pit" in it.
    let mut json: serde_json::Value = serde_json::from_slice(&state.to_bytes()).unwrap();
    assert!(!json["irqchip"]["pit"].is_null(), "the saved state has no PIT: {}", json["irqchip"]);
    json["irqchip"].as_object_mut().unwrap().remove("pit");
    let old = nl_vmm::state::VmState::from_bytes(&serde_json::to_vec(&json).unwrap())
        .expect("a state without the PIT still reads");
    assert!(old.irqchip.pit.is_none());
    let from_old = Vm::restore_linux(&kvm, 3, config.clone(), memory(), &old, &linux)
        .expect("a state without the PIT still restores");
    assert_eq!(pit_of(&from_old), fresh);
}

/// A fault inside a device of a host holding a Linux VM (the self-test
/// fault point `NINELIVES_DEVICE_FAULT=segv:N`: the N-th device access,
/// here one of the kernel's serial console writes, crashes with the
/// device's lock held), recovered by `policy`: the host keeps serving, and
/// the Linux VM keeps running and printing: after the recovery its console
/// goes on (more timestamped lines, the kernel's time never back, no
/// second boot) and the host still lists it running.
fn a_linux_vm_keeps_running_across(policy: &str, test: &str) {
    let Some(kernel) = debian_kernel(test) else { return };
    let h = common::selftest_host::SelftestHost::start_env(
        &["--recovery", policy],
        &[("NINELIVES_DEVICE_FAULT", "segv:3000")],
    );
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.txt");
    let r = h
        .req(serde_json::json!({"op": "create", "kernel": kernel, "mem": "256M",
                                "console": console}))
        .expect("create answered");
    assert_eq!(r["ok"], true, "{r}");
    let id = r["id"].as_u64().unwrap();
    let state = || {
        let v = h.req(serde_json::json!({"op": "list"})).expect("list answered");
        v["vms"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["id"] == id))
            .map(|x| x["state"].as_str().unwrap_or_default().to_string())
            .unwrap_or_else(|| panic!("VM {id} not listed: {v}"))
    };
    let t = Instant::now();
    while h.lines("NINELIVES-RECOVERED ").is_empty() && t.elapsed() < BOOT_LIMIT {
        std::thread::sleep(Duration::from_millis(250));
    }
    let rec = h.lines("NINELIVES-RECOVERED ");
    assert_eq!(rec.len(), 1, "{policy}: one recovery expected:\n{}", tail(&h.stderr()));
    assert_eq!(rec[0]["policy"], policy);
    let text = String::from_utf8_lossy(&read_console(&console)).into_owned();
    let mark = text.len();
    let last_before = *timestamps(&text)
        .last()
        .unwrap_or_else(|| panic!("{policy}: the fault came before any console line:\n{text}"));
    let text = wait_console(&console, BOOT_LIMIT, |t| {
        stamped(&t[mark.min(t.len())..]).len() >= 3 || state() != "running"
    });
    assert!(
        stamped(&text[mark..]).len() >= 3,
        "{policy}: the Linux VM did not go on printing after the recovery (state {}); \
         console tail:\n{}\nhost:\n{}",
        state(),
        tail(&text),
        tail(&h.stderr())
    );
    assert_continues(policy, &console, mark, last_before);
    assert_eq!(state(), "running");
    eprintln!(
        "{policy}: recovered at kernel time {last_before} s or later; then {:?}",
        stamped(&text[mark..]).first()
    );
}

#[test]
fn a_linux_vm_keeps_running_across_a_microreset_of_its_host() {
    a_linux_vm_keeps_running_across("microreset", "a_linux_vm_keeps_running_across_a_microreset");
}

#[test]
fn a_linux_vm_keeps_running_across_a_microreboot_of_its_host() {
    a_linux_vm_keeps_running_across("microreboot", "a_linux_vm_keeps_running_across_a_microreboot");
}

/// Kills the child on drop (a failed assertion must not leave a primary or
/// a backup running).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Replication of a Linux VM (`replicate primary --kernel`): a backup
/// (loopback, one process each) receives the primary's epochs, whose hello
/// carries the VM's Linux boot record, and builds a Linux VM ahead of a
/// takeover (`Vm::prepare_linux` over its copy of the memory). The primary
/// boots the Debian kernel past its banner and is killed with SIGKILL; the
/// backup takes over from its last acknowledged epoch: its JSON says the
/// VM was built ahead (no fallback) and ran as a Linux VM, and its console
/// goes on where the primary's stopped: new timestamped lines past the
/// primary's last one, the kernel's time never going back (from what the
/// primary had printed before the kill on, and in order), no second boot.
/// SIGTERM ends the backup's Linux VM and its report.
#[test]
fn a_replicated_linux_vm_goes_on_printing_on_the_backup_after_the_primary_is_killed() {
    let Some(kernel) = debian_kernel("a_replicated_linux_vm") else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("repl.key");
    let o = common::run_cli(&["replicate", "keygen", key.to_str().unwrap()]);
    assert!(o.status.success(), "keygen: {}", common::stderr(&o));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let (pcon, bcon) = (dir.path().join("primary.txt"), dir.path().join("backup.txt"));
    let (blog, plog) = (dir.path().join("backup.log"), dir.path().join("primary.log"));
    let backup = common::ninelives()
        .args(["replicate", "backup", "--listen", &addr, "--key-file", key.to_str().unwrap()])
        .args(["--mem", "256M", "--lease-ms", "1000", "--json"])
        .args(["--console", bcon.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&blog).unwrap())
        .spawn()
        .expect("spawn the backup");
    let mut backup = Killed(backup);
    let log = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let t = Instant::now();
    while !log(&blog).contains("backup listening") {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the backup did not listen:\n{}",
            log(&blog)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let cmdline = test_cmdline("replicate");
    let primary = common::ninelives()
        .args(["replicate", "primary", "--backup", &addr, "--key-file", key.to_str().unwrap()])
        .args(["--kernel", kernel.to_str().unwrap(), "--cmdline", &cmdline])
        .args(["--mem", "256M", "--lease-ms", "1000", "--duration", "900", "--json"])
        .args(["--console", pcon.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&plog).unwrap())
        .spawn()
        .expect("spawn the primary");
    let mut primary = Killed(primary);

    // Past the banner, with the kernel's clock running: then a snapshot,
    // and one more line (epochs went on meanwhile) before the kill.
    let start = Instant::now();
    let text = wait_console(&pcon, BOOT_LIMIT, |t| {
        t.contains("Linux version") && stamped(t).last().is_some_and(|l| l.0 > 0.0)
    });
    assert!(
        text.contains("Linux version") && stamped(&text).last().is_some_and(|l| l.0 > 0.0),
        "the primary's kernel did not get past its banner within {BOOT_LIMIT:?}; console:\n{}\n\
         primary:\n{}\nbackup:\n{}",
        tail(&text),
        tail(&log(&plog)),
        tail(&log(&blog))
    );
    assert!(log(&plog).contains("the VM is protected"), "not protected:\n{}", log(&plog));
    let snapshot = *timestamps(&text).last().unwrap();
    let mark = text.len();
    let text = wait_console(&pcon, BOOT_LIMIT, |t| !stamped(&t[mark.min(t.len())..]).is_empty());
    assert!(!stamped(&text[mark..]).is_empty(), "the primary stopped printing:\n{}", tail(&text));
    std::thread::sleep(Duration::from_secs(1));
    primary.0.kill().expect("SIGKILL the primary");
    primary.0.wait().unwrap();
    let killed_at = start.elapsed();
    let before = String::from_utf8_lossy(&read_console(&pcon)).into_owned();
    let last_primary = *timestamps(&before).last().unwrap();
    eprintln!(
        "replicate: primary killed {:.1} s after its start, at kernel time {last_primary} s \
         (snapshot at {snapshot} s)",
        killed_at.as_secs_f64()
    );

    // The backup takes over and the kernel goes on there.
    let new_lines = |t: &str| stamped(t).iter().filter(|l| l.0 > last_primary).count();
    let after = wait_console(&bcon, BOOT_LIMIT, |t| {
        new_lines(t) >= 3 || backup.0.try_wait().ok().flatten().is_some()
    });
    assert!(
        new_lines(&after) >= 3,
        "the kernel did not go on on the backup (3 lines past kernel time {last_primary} s); \
         backup console:\n{}\nbackup:\n{}",
        tail(&after),
        tail(&log(&blog))
    );
    let stamps = timestamps(&after);
    assert!(
        stamps[0] >= snapshot,
        "time went back: the primary printed kernel time {snapshot} s well before the kill, \
         the backup then {stamps:?}"
    );
    assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "timestamps out of order: {stamps:?}");
    assert_eq!(before.matches("Linux version").count(), 1, "primary console:\n{before}");
    assert_eq!(after.matches("Linux version").count(), 0, "the kernel booted again:\n{after}");
    eprintln!(
        "replicate: the backup's first line at kernel time {} s, {} lines past {last_primary} s",
        stamps[0],
        new_lines(&after)
    );

    // SIGTERM ends the backup's Linux VM; its report says how it took over.
    // SAFETY: kill() on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(backup.0.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while backup.0.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(60), "SIGTERM did not end the backup");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = String::new();
    std::io::Read::read_to_string(backup.0.stdout.as_mut().unwrap(), &mut out).unwrap();
    let last = out.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("backup JSON ({e}): {out}\n{}", tail(&log(&blog))));
    assert_eq!(v["activated"], true, "{v}");
    assert_eq!(v["linux"], true, "{v}");
    assert_eq!(v["prebuilt"], true, "the VM was not built ahead: {v}");
    assert!(v["takeover"]["fallback"].is_null(), "{v}");
    assert_eq!(v["ok"], true, "{v}");
    assert!(v["end"].as_str().is_some_and(|e| e.contains("signal")), "{v}");
    assert!(backup.0.wait().unwrap().success(), "{out}");
    eprintln!("replicate: takeover_ms {} ({})", v["takeover_ms"], v["takeover"]);
}
