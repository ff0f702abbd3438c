//! seccomp-bpf filters for the VMM's threads, one per thread kind, built
//! with rust-vmm's `seccompiler` (pure Rust, no libseccomp).
//!
//! Like Firecracker, each VMM thread installs the filter of its kind at the
//! start of its body ([`apply`]); filters are per thread (no TSYNC). A
//! syscall outside the thread's allowlist is not executed: the kernel sends
//! SIGSYS (`SeccompAction::Trap`), which the detector ([`crate::detect`])
//! reports as
//!
//! ```text
//! NINELIVES-DETECTED {"detector":"seccomp","syscall":135,"name":"personality","thread":"vm0-vcpu0",...}
//! ```
//!
//! (`name` from [`syscall_name`]'s table, omitted for a syscall it does
//! not list) and the recovery policy handles like any other fatal signal (`none`
//! ends the process with status 86; `microreset` discards the thread's work
//! back to its recovery point). On by default; `ninelives --seccomp off`
//! (or [`set_enabled`]`(false)`) turns it off.
//!
//! # Thread kinds
//!
//! | kind | threads | allowlist |
//! | --- | --- | --- |
//! | [`Kind::Vcpu`] | `vmN-vcpuM` | runtime + recovery + device I/O + KVM ioctls |
//! | [`Kind::Device`] | `vmN-netrx` | runtime + recovery + device I/O + KVM ioctls + poll |
//! | [`Kind::Events`] | `events` (VM supervision) | runtime + recovery + KVM ioctls |
//! | [`Kind::Watchdog`] | `watchdog` (hang detector) | runtime + recovery (whose read-only `openat` it uses for `/proc`) |
//! | [`Kind::Api`] | the API accept loop and connections, `handover-report` | the process filter |
//! | [`Kind::Microreboot`] | `microreboot` | the process filter |
//! | [`Kind::Checkpoint`] | `ckpt-faults`, `repl-faults` (userfaultfd write tracking), `ckpt-disk` | runtime + recovery + write tracking + checkpoint files |
//! | [`Kind::Replication`] | `repl-accept`, `repl-hello`, `repl-rx`, `repl-send`, `repl-acks` | runtime + recovery + streams + device I/O + KVM ioctls |
//!
//! The groups:
//!
//! * **runtime** (every thread): memory (`mmap`, `munmap`, `mprotect`,
//!   `madvise`, `mremap`, `brk`), threads and locks (`futex`, `sched_yield`,
//!   `sched_getaffinity`, `set_robust_list`, `rseq`, `gettid`, `getpid`,
//!   `exit`, `exit_group`), time (`clock_gettime`, `clock_nanosleep`,
//!   `nanosleep`, and `restart_syscall`, which resumes a sleep after the
//!   thread was stopped, e.g. by the fault injector's ptrace), `getrandom`, stderr and descriptors already open
//!   (`write`, `read`, `lseek`, `close`, `statx`, `newfstatat`, `fstat`),
//!   and `prctl` restricted to `PR_SET_NAME`, `PR_GET_NAME`,
//!   `PR_GET_SECCOMP` and `PR_SET_NO_NEW_PRIVS`.
//! * **recovery** (every thread, since any thread can detect an error and
//!   coordinate a recovery on itself): signals (`rt_sigaction`,
//!   `rt_sigprocmask`, `rt_sigreturn`, `sigaltstack`, `tgkill`), the
//!   recovery deadline (`setitimer`), the injector's repair flag
//!   (`unlink`, `unlinkat`), and read-only `openat`: the watchdog reads
//!   threads' `stat`, `schedstat` and `wchan` under `/proc/self/task`, and
//!   glibc's malloc reads `/proc/sys/vm/overcommit_memory` once per
//!   process, on whichever thread first shrinks a heap arena.
//! * **device I/O** (vCPU and device threads, which emulate devices):
//!   `pread64`, `pwrite64`, `preadv`, `pwritev`, `readv`, `writev`,
//!   `fsync`, `fdatasync` (virtio-blk on its image, virtio-net on its TAP),
//!   and `ftruncate`: a vCPU thread re-executing an exit after a recovery
//!   first undoes the console bytes that exit had written, which cuts them
//!   off the console file.
//! * **KVM ioctls**: `ioctl` whose request is of KVM's type (0xAE), such as
//!   `KVM_RUN`, `KVM_IRQ_LINE`, `KVM_GET_REGS`; no other ioctl.
//! * **write tracking** (checkpoint kind): `poll`/`ppoll` on the
//!   userfaultfd and `ioctl` of userfaultfd's type (0xAA:
//!   `UFFDIO_WRITEPROTECT`, `UFFDIO_WAKE`) only.
//! * **checkpoint files** (checkpoint kind): `openat` write-only (with
//!   the recovery group's read-only, never read-write), `fsync`,
//!   `fdatasync`, `rename*`: the disk writer creates `FILE.tmp`, writes,
//!   syncs and renames it.
//! * **streams** (replication kind): `sendto`, `recvfrom`, `sendmsg`,
//!   `recvmsg`, `setsockopt`/`getsockopt` (timeouts, `TCP_NODELAY`),
//!   `getpeername`, `getsockname`, `shutdown`, `poll`, `fcntl`; the
//!   backup's accept loop `accept4`s and starts a thread per handshake
//!   (`clone`/`clone3`, and `seccomp`, with which that thread installs its
//!   own filter); a handshake creates or empties the backup's disk copy
//!   (`openat`, `ftruncate`). The primary's sender releases an
//!   acknowledged epoch's output (held disk writes, held frames, their
//!   interrupts): device I/O and KVM ioctls. No `socket`, `connect`,
//!   `bind`, `execve`.
//! * **process filter** (API and microreboot threads): everything the VMM
//!   process does, because a thread's filter is inherited by the threads
//!   and processes it creates and is kept across `execve`. An API
//!   connection creates VMs (`/dev/kvm`, any ioctl, memfds, files, threads)
//!   and starts a rejuvenation successor (`clone`/`clone3`/`vfork`,
//!   `execve`, fd passing with `sendmsg`/`recvmsg`, `dup*`, `fcntl`) whose
//!   threads install their own filters (`seccomp`, which only narrows); the
//!   microreboot thread saves the VMs' state into a memfd and `execve`s a
//!   fresh VMM with the memfds inherited. The successor process therefore
//!   starts under the process filter, so it also holds what a starting
//!   process needs (the loader's `openat`/`mmap`/`arch_prctl`/
//!   `set_tid_address`/`prlimit64`, sockets, `bind`/`listen`/`accept4`).
//!   It still refuses what the VMM never does: `ptrace`, `mount`,
//!   `personality`, `acct`, module loading, `bpf`, `perf_event_open`,
//!   namespaces (`unshare`, `setns`), `reboot`, `kexec_*`, keyrings,
//!   raw `AF_PACKET` is allowed only as far as `socket` is (any family:
//!   a shared link opens its packet sockets and attaches their classic
//!   filters with `setsockopt`, not `bpf`, on the thread that creates the
//!   set; its members' receive threads only `read` them).
//!
//! Not in any allowlist: `ptrace` (the fault injector ptraces the VMM from
//! its own process; a filtered thread can be traced).
//!
//! # Where filters are applied
//!
//! * The main thread of `run`, `checkpoint`, `restore` and `replicate` is
//!   not filtered: it loads images, creates the VMs, waits and verifies
//!   (and the backup's main thread creates the VM it activates). Every
//!   thread they start is: vCPU, device, events, watchdog, and the
//!   checkpoint and replication threads, whose crates (`nl-checkpoint`,
//!   `nl-replicate`) call [`apply`] at the start of each thread body; the
//!   userfaultfd fault thread of `nl-memory` (which does not depend on this
//!   crate) calls its handler's `FaultHandler::on_start`, where those
//!   crates apply [`Kind::Checkpoint`].
//! * In `host`, the main thread becomes the API accept loop and applies the
//!   process filter once the detectors are installed and the host is built.
//! * The microreboot thread is started when the detectors are installed
//!   (with policy `microreboot`), not when an error is detected: a thread
//!   spawned by a vCPU thread would inherit the vCPU filter, and so would
//!   the process it execs.
//! * A successor process (rejuvenation, microreboot) starts under its
//!   predecessor's process filter. The process filter is not stacked on a
//!   thread that already runs under a filter (the inherited one is the
//!   same or stricter), so generations of successors do not pile filters
//!   up; the leaf kinds always stack theirs.
//!
//! A thread that cannot install its filter (a kernel without seccomp)
//! ends the process with an error naming the thread and the cause; use
//! `--seccomp off` there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The kinds of VMM threads, each with its own filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A vCPU thread: runs the guest and emulates devices on its exits.
    Vcpu,
    /// A device thread (virtio-net receive).
    Device,
    /// The event loop (VM supervision).
    Events,
    /// The hang watchdog.
    Watchdog,
    /// The API: accept loop, connections, post-handover reporting.
    Api,
    /// The microreboot thread (saves state, execs a fresh VMM).
    Microreboot,
    /// Write tracking and checkpoint writing: the userfaultfd
    /// write-protect fault threads (`ckpt-faults`, `repl-faults`) and the
    /// checkpoint disk writer (`ckpt-disk`).
    Checkpoint,
    /// Replication's network threads: the backup's accept loop
    /// (`repl-accept`), handshakes (`repl-hello`) and receiver (`repl-rx`),
    /// the primary's sender (`repl-send`) and ack reader (`repl-acks`).
    Replication,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Vcpu,
        Kind::Device,
        Kind::Events,
        Kind::Watchdog,
        Kind::Api,
        Kind::Microreboot,
        Kind::Checkpoint,
        Kind::Replication,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Vcpu => "vcpu",
            Kind::Device => "device",
            Kind::Events => "events",
            Kind::Watchdog => "watchdog",
            Kind::Api => "api",
            Kind::Microreboot => "microreboot",
            Kind::Checkpoint => "checkpoint",
            Kind::Replication => "replication",
        }
    }

    /// Whether this kind gets the process filter.
    fn is_process(self) -> bool {
        matches!(self, Kind::Api | Kind::Microreboot)
    }

    fn index(self) -> usize {
        Kind::ALL.iter().position(|k| *k == self).expect("in ALL")
    }
}

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the filters on (the default) or off for threads started from now.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Relaxed);
}

/// Whether threads install their filters.
pub fn enabled() -> bool {
    ENABLED.load(Relaxed)
}

/// The command-line arguments that carry this process's setting to a
/// successor process (empty when on, the default).
pub fn successor_args() -> Vec<String> {
    if enabled() {
        Vec::new()
    } else {
        vec!["--seccomp".into(), "off".into()]
    }
}

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// `calls` allowed whatever their arguments (an empty rule list); this wins
/// over any conditional rule another group gave the same syscall.
fn allow(r: &mut Rules, calls: &[libc::c_long]) {
    for &c in calls {
        r.insert(c, Vec::new());
    }
}

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, v: u64) -> SeccompCondition {
    SeccompCondition::new(arg, len, op, v).expect("valid condition")
}

/// `syscall` allowed only when one of `rules` matches.
/// A syscall some group already allows unconditionally stays so.
fn allow_if(r: &mut Rules, syscall: libc::c_long, rules: Vec<Vec<SeccompCondition>>) {
    if r.get(&syscall).is_some_and(Vec::is_empty) {
        return;
    }
    let v = r.entry(syscall).or_default();
    for c in rules {
        v.push(SeccompRule::new(c).expect("valid rule"));
    }
}

/// The runtime group (every thread).
fn runtime(r: &mut Rules) {
    use libc::*;
    allow(
        r,
        &[
            // memory
            SYS_mmap,
            SYS_munmap,
            SYS_mprotect,
            SYS_madvise,
            SYS_mremap,
            SYS_brk,
            // threads and locks
            SYS_futex,
            SYS_sched_yield,
            SYS_sched_getaffinity,
            SYS_set_robust_list,
            SYS_rseq,
            SYS_gettid,
            SYS_getpid,
            SYS_exit,
            SYS_exit_group,
            // time
            SYS_clock_gettime,
            SYS_clock_nanosleep,
            SYS_nanosleep,
            // a sleep interrupted by a stop (ptrace, SIGSTOP) resumes with it
            SYS_restart_syscall,
            SYS_getrandom,
            // descriptors already open
            SYS_write,
            SYS_read,
            SYS_lseek,
            SYS_close,
            SYS_statx,
            SYS_newfstatat,
            SYS_fstat,
        ],
    );
    let prctl_ops = [PR_SET_NAME, PR_GET_NAME, PR_GET_SECCOMP, PR_SET_NO_NEW_PRIVS];
    allow_if(
        r,
        SYS_prctl,
        prctl_ops
            .iter()
            .map(|&op| vec![cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, op as u64)])
            .collect(),
    );
}

/// The recovery group (every thread).
fn recovery(r: &mut Rules) {
    use libc::*;
    allow(
        r,
        &[
            SYS_rt_sigaction,
            SYS_rt_sigprocmask,
            SYS_rt_sigreturn,
            SYS_sigaltstack,
            SYS_tgkill,
            SYS_setitimer,
            SYS_unlink,
            SYS_unlinkat,
        ],
    );
    // Read-only opens: the watchdog's /proc/self/task/N/{stat,schedstat,wchan},
    // and glibc's malloc reading /proc/sys/vm/overcommit_memory (once per
    // process, on whichever thread first shrinks a heap).
    allow_if(r, SYS_openat, vec![open_mode(O_RDONLY)]);
}

/// An `openat` whose access mode (flags & O_ACCMODE) is `mode`.
fn open_mode(mode: libc::c_int) -> Vec<SeccompCondition> {
    vec![cond(
        2,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(libc::O_ACCMODE as u64),
        mode as u64,
    )]
}

/// Device emulation on descriptors the VMM opened.
fn device_io(r: &mut Rules) {
    use libc::*;
    allow(
        r,
        &[
            SYS_pread64,
            SYS_pwrite64,
            SYS_preadv,
            SYS_pwritev,
            SYS_readv,
            SYS_writev,
            SYS_fsync,
            SYS_fdatasync,
            // the console's undo log (`Console::undo_to`) on a retried exit
            SYS_ftruncate,
        ],
    );
}

/// ioctls of KVM's type (0xAE) only.
fn kvm_ioctls(r: &mut Rules) {
    allow_if(
        r,
        libc::SYS_ioctl,
        vec![vec![cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(0xff00), 0xae00)]],
    );
}

/// Everything the VMM process does (see the module doc).
fn process(r: &mut Rules) {
    use libc::*;
    device_io(r);
    allow(
        r,
        &[
            // any ioctl: KVM system and VM fds, TUN, userfaultfd, terminals
            SYS_ioctl,
            // files
            SYS_open,
            SYS_openat,
            SYS_access,
            SYS_faccessat,
            SYS_faccessat2,
            SYS_readlink,
            SYS_readlinkat,
            SYS_getcwd,
            SYS_mkdir,
            SYS_mkdirat,
            // a sandbox set's budget cgroups, removed when the set goes
            // (`DELETE /v1/sandboxes/NAME` on an API thread)
            SYS_rmdir,
            SYS_rename,
            SYS_renameat,
            SYS_renameat2,
            SYS_getdents64,
            SYS_ftruncate,
            SYS_fallocate,
            SYS_fchmod,
            SYS_statfs,
            SYS_fstatfs,
            SYS_memfd_create,
            SYS_eventfd2,
            SYS_userfaultfd,
            SYS_pipe2,
            SYS_fcntl,
            SYS_dup,
            SYS_dup2,
            SYS_dup3,
            SYS_poll,
            SYS_ppoll,
            SYS_pselect6,
            SYS_epoll_create1,
            SYS_epoll_ctl,
            SYS_epoll_wait,
            SYS_epoll_pwait,
            SYS_timerfd_create,
            SYS_timerfd_settime,
            // sockets (API, replication, fd passing)
            SYS_socket,
            SYS_socketpair,
            SYS_bind,
            SYS_listen,
            SYS_accept4,
            SYS_accept,
            SYS_connect,
            SYS_getsockname,
            SYS_getpeername,
            SYS_setsockopt,
            SYS_getsockopt,
            SYS_sendto,
            SYS_recvfrom,
            SYS_sendmsg,
            SYS_recvmsg,
            SYS_shutdown,
            // threads and successor processes (rejuvenation, microreboot)
            SYS_clone,
            SYS_clone3,
            SYS_vfork,
            SYS_execve,
            SYS_wait4,
            SYS_waitid,
            SYS_kill,
            SYS_getitimer,
            SYS_sched_setaffinity,
            // a sandbox's reserved budget (`budget.reserve`): its reserve
            // thread switches vCPU threads between SCHED_FIFO and normal
            SYS_sched_setscheduler,
            // a thread it starts installs its own filter (only ever narrower)
            SYS_seccomp,
            // process start (loader, std runtime)
            SYS_arch_prctl,
            SYS_set_tid_address,
            SYS_prlimit64,
            SYS_getppid,
            SYS_getuid,
            SYS_geteuid,
            SYS_getgid,
            SYS_getegid,
            SYS_uname,
            SYS_sysinfo,
            SYS_getrusage,
            SYS_clock_getres,
            SYS_umask,
        ],
    );
}

fn rules(kind: Kind) -> Rules {
    let mut r = Rules::new();
    runtime(&mut r);
    recovery(&mut r);
    match kind {
        Kind::Vcpu => {
            device_io(&mut r);
            kvm_ioctls(&mut r);
        }
        Kind::Device => {
            device_io(&mut r);
            kvm_ioctls(&mut r);
            allow(&mut r, &[libc::SYS_poll, libc::SYS_ppoll]);
        }
        Kind::Events => kvm_ioctls(&mut r),
        // Read-only opens are in the recovery group (every kind).
        Kind::Watchdog => {}
        Kind::Api | Kind::Microreboot => process(&mut r),
        Kind::Checkpoint => checkpoint(&mut r),
        Kind::Replication => replication(&mut r),
    }
    r
}

/// Write tracking (userfaultfd) and the checkpoint disk writer.
fn checkpoint(r: &mut Rules) {
    use libc::*;
    // The fault thread waits on its userfaultfd and serves faults with
    // userfaultfd's ioctls (type 0xAA: UFFDIO_WRITEPROTECT, UFFDIO_WAKE).
    allow(r, &[SYS_poll, SYS_ppoll]);
    allow_if(
        r,
        SYS_ioctl,
        vec![vec![cond(1, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(0xff00), 0xaa00)]],
    );
    // The disk writer creates `FILE.tmp` write-only, writes, syncs and
    // renames it over `FILE` (read-only opens: the recovery group).
    allow_if(r, SYS_openat, vec![open_mode(O_WRONLY)]);
    allow(r, &[SYS_fsync, SYS_fdatasync, SYS_rename, SYS_renameat, SYS_renameat2]);
}

/// Replication's network threads.
fn replication(r: &mut Rules) {
    use libc::*;
    allow(
        r,
        &[
            // connected TCP streams: send, receive, timeouts, shutdown
            SYS_sendto,
            SYS_recvfrom,
            SYS_sendmsg,
            SYS_recvmsg,
            SYS_setsockopt,
            SYS_getsockopt,
            SYS_getpeername,
            SYS_getsockname,
            SYS_shutdown,
            SYS_poll,
            SYS_ppoll,
            SYS_fcntl,
            // the backup's accept loop: a connection, and a thread for
            // its handshake, which installs its own filter (only narrows)
            SYS_accept4,
            SYS_accept,
            SYS_clone,
            SYS_clone3,
            SYS_seccomp,
            // the backup's handshake creates or empties its disk copy
            // (`--disk`) when the primary attaches
            SYS_openat,
            SYS_ftruncate,
        ],
    );
    // The primary's sender releases an acknowledged epoch's output: held
    // disk writes to the image, held frames to the TAP, interrupts.
    device_io(r);
    kvm_ioctls(r);
}

/// Builds the BPF program of `kind`.
pub fn program(kind: Kind) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(
        rules(kind),
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| format!("seccomp filter {}: {e}", kind.name()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("seccomp filter {}: {e}", kind.name()))
}

fn cached(kind: Kind) -> &'static Result<BpfProgram, String> {
    static P: [OnceLock<Result<BpfProgram, String>>; Kind::ALL.len()] =
        [const { OnceLock::new() }; Kind::ALL.len()];
    P[kind.index()].get_or_init(|| program(kind))
}

/// `(number, name)` of the x86-64 syscalls [`syscall_name`] knows.
static NAMES: &[(libc::c_long, &str)] = &[
    (libc::SYS_read, "read"),
    (libc::SYS_write, "write"),
    (libc::SYS_open, "open"),
    (libc::SYS_close, "close"),
    (libc::SYS_stat, "stat"),
    (libc::SYS_fstat, "fstat"),
    (libc::SYS_lstat, "lstat"),
    (libc::SYS_poll, "poll"),
    (libc::SYS_lseek, "lseek"),
    (libc::SYS_mmap, "mmap"),
    (libc::SYS_mprotect, "mprotect"),
    (libc::SYS_munmap, "munmap"),
    (libc::SYS_brk, "brk"),
    (libc::SYS_rt_sigaction, "rt_sigaction"),
    (libc::SYS_rt_sigprocmask, "rt_sigprocmask"),
    (libc::SYS_rt_sigreturn, "rt_sigreturn"),
    (libc::SYS_ioctl, "ioctl"),
    (libc::SYS_pread64, "pread64"),
    (libc::SYS_pwrite64, "pwrite64"),
    (libc::SYS_readv, "readv"),
    (libc::SYS_writev, "writev"),
    (libc::SYS_access, "access"),
    (libc::SYS_pipe, "pipe"),
    (libc::SYS_select, "select"),
    (libc::SYS_sched_yield, "sched_yield"),
    (libc::SYS_mremap, "mremap"),
    (libc::SYS_msync, "msync"),
    (libc::SYS_mincore, "mincore"),
    (libc::SYS_madvise, "madvise"),
    (libc::SYS_shmget, "shmget"),
    (libc::SYS_shmat, "shmat"),
    (libc::SYS_shmctl, "shmctl"),
    (libc::SYS_dup, "dup"),
    (libc::SYS_dup2, "dup2"),
    (libc::SYS_pause, "pause"),
    (libc::SYS_nanosleep, "nanosleep"),
    (libc::SYS_getitimer, "getitimer"),
    (libc::SYS_alarm, "alarm"),
    (libc::SYS_setitimer, "setitimer"),
    (libc::SYS_getpid, "getpid"),
    (libc::SYS_sendfile, "sendfile"),
    (libc::SYS_socket, "socket"),
    (libc::SYS_connect, "connect"),
    (libc::SYS_accept, "accept"),
    (libc::SYS_sendto, "sendto"),
    (libc::SYS_recvfrom, "recvfrom"),
    (libc::SYS_sendmsg, "sendmsg"),
    (libc::SYS_recvmsg, "recvmsg"),
    (libc::SYS_shutdown, "shutdown"),
    (libc::SYS_bind, "bind"),
    (libc::SYS_listen, "listen"),
    (libc::SYS_getsockname, "getsockname"),
    (libc::SYS_getpeername, "getpeername"),
    (libc::SYS_socketpair, "socketpair"),
    (libc::SYS_setsockopt, "setsockopt"),
    (libc::SYS_getsockopt, "getsockopt"),
    (libc::SYS_clone, "clone"),
    (libc::SYS_fork, "fork"),
    (libc::SYS_vfork, "vfork"),
    (libc::SYS_execve, "execve"),
    (libc::SYS_exit, "exit"),
    (libc::SYS_wait4, "wait4"),
    (libc::SYS_kill, "kill"),
    (libc::SYS_uname, "uname"),
    (libc::SYS_fcntl, "fcntl"),
    (libc::SYS_flock, "flock"),
    (libc::SYS_fsync, "fsync"),
    (libc::SYS_fdatasync, "fdatasync"),
    (libc::SYS_truncate, "truncate"),
    (libc::SYS_ftruncate, "ftruncate"),
    (libc::SYS_getdents, "getdents"),
    (libc::SYS_getcwd, "getcwd"),
    (libc::SYS_chdir, "chdir"),
    (libc::SYS_fchdir, "fchdir"),
    (libc::SYS_rename, "rename"),
    (libc::SYS_mkdir, "mkdir"),
    (libc::SYS_rmdir, "rmdir"),
    (libc::SYS_creat, "creat"),
    (libc::SYS_link, "link"),
    (libc::SYS_unlink, "unlink"),
    (libc::SYS_symlink, "symlink"),
    (libc::SYS_readlink, "readlink"),
    (libc::SYS_chmod, "chmod"),
    (libc::SYS_fchmod, "fchmod"),
    (libc::SYS_chown, "chown"),
    (libc::SYS_fchown, "fchown"),
    (libc::SYS_umask, "umask"),
    (libc::SYS_gettimeofday, "gettimeofday"),
    (libc::SYS_getrlimit, "getrlimit"),
    (libc::SYS_getrusage, "getrusage"),
    (libc::SYS_sysinfo, "sysinfo"),
    (libc::SYS_times, "times"),
    (libc::SYS_ptrace, "ptrace"),
    (libc::SYS_getuid, "getuid"),
    (libc::SYS_syslog, "syslog"),
    (libc::SYS_getgid, "getgid"),
    (libc::SYS_setuid, "setuid"),
    (libc::SYS_setgid, "setgid"),
    (libc::SYS_geteuid, "geteuid"),
    (libc::SYS_getegid, "getegid"),
    (libc::SYS_setpgid, "setpgid"),
    (libc::SYS_getppid, "getppid"),
    (libc::SYS_setsid, "setsid"),
    (libc::SYS_setreuid, "setreuid"),
    (libc::SYS_setregid, "setregid"),
    (libc::SYS_getgroups, "getgroups"),
    (libc::SYS_setgroups, "setgroups"),
    (libc::SYS_getpgid, "getpgid"),
    (libc::SYS_capget, "capget"),
    (libc::SYS_capset, "capset"),
    (libc::SYS_sigaltstack, "sigaltstack"),
    (libc::SYS_mknod, "mknod"),
    (libc::SYS_personality, "personality"),
    (libc::SYS_statfs, "statfs"),
    (libc::SYS_fstatfs, "fstatfs"),
    (libc::SYS_getpriority, "getpriority"),
    (libc::SYS_setpriority, "setpriority"),
    (libc::SYS_sched_setparam, "sched_setparam"),
    (libc::SYS_sched_setscheduler, "sched_setscheduler"),
    (libc::SYS_mlock, "mlock"),
    (libc::SYS_munlock, "munlock"),
    (libc::SYS_mlockall, "mlockall"),
    (libc::SYS_munlockall, "munlockall"),
    (libc::SYS_prctl, "prctl"),
    (libc::SYS_arch_prctl, "arch_prctl"),
    (libc::SYS_setrlimit, "setrlimit"),
    (libc::SYS_chroot, "chroot"),
    (libc::SYS_sync, "sync"),
    (libc::SYS_acct, "acct"),
    (libc::SYS_settimeofday, "settimeofday"),
    (libc::SYS_mount, "mount"),
    (libc::SYS_umount2, "umount2"),
    (libc::SYS_swapon, "swapon"),
    (libc::SYS_swapoff, "swapoff"),
    (libc::SYS_reboot, "reboot"),
    (libc::SYS_sethostname, "sethostname"),
    (libc::SYS_setdomainname, "setdomainname"),
    (libc::SYS_iopl, "iopl"),
    (libc::SYS_ioperm, "ioperm"),
    (libc::SYS_init_module, "init_module"),
    (libc::SYS_delete_module, "delete_module"),
    (libc::SYS_quotactl, "quotactl"),
    (libc::SYS_gettid, "gettid"),
    (libc::SYS_readahead, "readahead"),
    (libc::SYS_setxattr, "setxattr"),
    (libc::SYS_getxattr, "getxattr"),
    (libc::SYS_tkill, "tkill"),
    (libc::SYS_time, "time"),
    (libc::SYS_futex, "futex"),
    (libc::SYS_sched_setaffinity, "sched_setaffinity"),
    (libc::SYS_sched_getaffinity, "sched_getaffinity"),
    (libc::SYS_io_setup, "io_setup"),
    (libc::SYS_io_submit, "io_submit"),
    (libc::SYS_getdents64, "getdents64"),
    (libc::SYS_set_tid_address, "set_tid_address"),
    (libc::SYS_restart_syscall, "restart_syscall"),
    (libc::SYS_fadvise64, "fadvise64"),
    (libc::SYS_timer_create, "timer_create"),
    (libc::SYS_clock_settime, "clock_settime"),
    (libc::SYS_clock_gettime, "clock_gettime"),
    (libc::SYS_clock_getres, "clock_getres"),
    (libc::SYS_clock_nanosleep, "clock_nanosleep"),
    (libc::SYS_exit_group, "exit_group"),
    (libc::SYS_epoll_wait, "epoll_wait"),
    (libc::SYS_epoll_ctl, "epoll_ctl"),
    (libc::SYS_tgkill, "tgkill"),
    (libc::SYS_waitid, "waitid"),
    (libc::SYS_add_key, "add_key"),
    (libc::SYS_request_key, "request_key"),
    (libc::SYS_keyctl, "keyctl"),
    (libc::SYS_inotify_init1, "inotify_init1"),
    (libc::SYS_openat, "openat"),
    (libc::SYS_mkdirat, "mkdirat"),
    (libc::SYS_fchownat, "fchownat"),
    (libc::SYS_newfstatat, "newfstatat"),
    (libc::SYS_unlinkat, "unlinkat"),
    (libc::SYS_renameat, "renameat"),
    (libc::SYS_linkat, "linkat"),
    (libc::SYS_symlinkat, "symlinkat"),
    (libc::SYS_readlinkat, "readlinkat"),
    (libc::SYS_fchmodat, "fchmodat"),
    (libc::SYS_faccessat, "faccessat"),
    (libc::SYS_pselect6, "pselect6"),
    (libc::SYS_ppoll, "ppoll"),
    (libc::SYS_unshare, "unshare"),
    (libc::SYS_set_robust_list, "set_robust_list"),
    (libc::SYS_splice, "splice"),
    (libc::SYS_tee, "tee"),
    (libc::SYS_vmsplice, "vmsplice"),
    (libc::SYS_move_pages, "move_pages"),
    (libc::SYS_utimensat, "utimensat"),
    (libc::SYS_epoll_pwait, "epoll_pwait"),
    (libc::SYS_timerfd_create, "timerfd_create"),
    (libc::SYS_eventfd, "eventfd"),
    (libc::SYS_fallocate, "fallocate"),
    (libc::SYS_timerfd_settime, "timerfd_settime"),
    (libc::SYS_accept4, "accept4"),
    (libc::SYS_eventfd2, "eventfd2"),
    (libc::SYS_epoll_create1, "epoll_create1"),
    (libc::SYS_dup3, "dup3"),
    (libc::SYS_pipe2, "pipe2"),
    (libc::SYS_preadv, "preadv"),
    (libc::SYS_pwritev, "pwritev"),
    (libc::SYS_rt_tgsigqueueinfo, "rt_tgsigqueueinfo"),
    (libc::SYS_perf_event_open, "perf_event_open"),
    (libc::SYS_recvmmsg, "recvmmsg"),
    (libc::SYS_prlimit64, "prlimit64"),
    (libc::SYS_sendmmsg, "sendmmsg"),
    (libc::SYS_setns, "setns"),
    (libc::SYS_process_vm_readv, "process_vm_readv"),
    (libc::SYS_process_vm_writev, "process_vm_writev"),
    (libc::SYS_kcmp, "kcmp"),
    (libc::SYS_finit_module, "finit_module"),
    (libc::SYS_sched_setattr, "sched_setattr"),
    (libc::SYS_renameat2, "renameat2"),
    (libc::SYS_seccomp, "seccomp"),
    (libc::SYS_getrandom, "getrandom"),
    (libc::SYS_memfd_create, "memfd_create"),
    (libc::SYS_kexec_load, "kexec_load"),
    (libc::SYS_kexec_file_load, "kexec_file_load"),
    (libc::SYS_bpf, "bpf"),
    (libc::SYS_execveat, "execveat"),
    (libc::SYS_userfaultfd, "userfaultfd"),
    (libc::SYS_membarrier, "membarrier"),
    (libc::SYS_mlock2, "mlock2"),
    (libc::SYS_copy_file_range, "copy_file_range"),
    (libc::SYS_preadv2, "preadv2"),
    (libc::SYS_pwritev2, "pwritev2"),
    (libc::SYS_pkey_mprotect, "pkey_mprotect"),
    (libc::SYS_statx, "statx"),
    (libc::SYS_io_uring_setup, "io_uring_setup"),
    (libc::SYS_io_uring_enter, "io_uring_enter"),
    (libc::SYS_rseq, "rseq"),
    (libc::SYS_pidfd_open, "pidfd_open"),
    (libc::SYS_clone3, "clone3"),
    (libc::SYS_open_tree, "open_tree"),
    (libc::SYS_move_mount, "move_mount"),
    (libc::SYS_fsopen, "fsopen"),
    (libc::SYS_fsmount, "fsmount"),
    (libc::SYS_pidfd_getfd, "pidfd_getfd"),
    (libc::SYS_faccessat2, "faccessat2"),
    (libc::SYS_process_madvise, "process_madvise"),
    (libc::SYS_epoll_pwait2, "epoll_pwait2"),
    (libc::SYS_mount_setattr, "mount_setattr"),
    (libc::SYS_landlock_create_ruleset, "landlock_create_ruleset"),
    (libc::SYS_memfd_secret, "memfd_secret"),
    (libc::SYS_process_mrelease, "process_mrelease"),
];

/// The name of x86-64 syscall `nr`: every syscall a filter allows, and
/// the ones a VMM thread might plausibly be driven to (process control,
/// namespaces, mounts, keys, tracing, module and kexec loading). `None`
/// for others. Async-signal-safe (a linear scan of a static table).
pub fn syscall_name(nr: i64) -> Option<&'static str> {
    NAMES.iter().find(|(n, _)| *n == nr).map(|(_, s)| *s)
}

/// The syscall a seccomp filter trapped, from the siginfo of its SIGSYS
/// (`None` for a SIGSYS of another origin).
///
/// # Safety
/// `info` must point to the siginfo the kernel passed to an SA_SIGINFO
/// handler. Async-signal-safe.
pub unsafe fn trapped_syscall(info: *const libc::siginfo_t) -> Option<i32> {
    /// si_code of a SIGSYS sent by a seccomp filter.
    const SYS_SECCOMP: i32 = 1;
    // SAFETY: the caller passes a valid siginfo (128 bytes).
    let i = unsafe { &*info };
    if i.si_signo != libc::SIGSYS || i.si_code != SYS_SECCOMP {
        return None;
    }
    // The x86-64 layout of `_sigsys` in the siginfo union: after si_signo,
    // si_errno, si_code and 4 bytes of padding (offset 16) come
    // `void *_call_addr`, then `int _syscall` at offset 24.
    // SAFETY: offset 24 + 4 lies inside the 128-byte siginfo.
    Some(unsafe { std::ptr::read_unaligned((info as *const u8).add(24) as *const i32) })
}

/// Whether the calling thread already runs under a seccomp filter.
fn filtered() -> bool {
    // SAFETY: PR_GET_SECCOMP takes no pointer arguments.
    unsafe { libc::prctl(libc::PR_GET_SECCOMP) == 2 }
}

/// Installs the filter of `kind` on the calling thread (when enabled). A
/// thread that cannot ends the process with an error naming the cause.
pub fn apply(kind: Kind) {
    if !enabled() {
        return;
    }
    if kind.is_process() && filtered() {
        return;
    }
    let r = match cached(kind) {
        Ok(p) => seccompiler::apply_filter(p).map_err(|e| e.to_string()),
        Err(e) => Err(e.clone()),
    };
    if let Err(e) = r {
        let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
        eprintln!(
            "ninelives: error: cannot install the seccomp filter of thread {thread} ({}): {e} \
             (run with --seccomp off on a kernel without seccomp)",
            kind.name()
        );
        // SAFETY: _exit ends the process at once; no other thread is relied on.
        unsafe { libc::_exit(2) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_filter_builds() {
        for k in Kind::ALL {
            let p = program(k).unwrap();
            assert!(!p.is_empty() && p.len() < 4096, "{k:?}: {}", p.len());
        }
    }

    #[test]
    fn leaf_filters_are_subsets_of_the_process_filter() {
        let p = rules(Kind::Api);
        for k in Kind::ALL.into_iter().filter(|k| !k.is_process()) {
            for call in rules(k).keys() {
                assert!(
                    p.contains_key(call),
                    "{k:?} allows {call} which the process filter does not"
                );
            }
        }
    }

    /// Groups merge: a syscall one group allows whatever its arguments
    /// stays so when another allows it only conditionally, in either order
    /// (the process filter must open files for writing; rejuvenation's
    /// successor starts under it).
    #[test]
    fn an_unconditional_allow_wins_over_a_conditional_one() {
        assert!(rules(Kind::Api)[&libc::SYS_openat].is_empty(), "process filter: any openat");
        assert!(!rules(Kind::Vcpu)[&libc::SYS_openat].is_empty(), "vCPU filter: read-only");
        let read_only = || vec![vec![cond(2, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, 0)]];
        let mut r = Rules::new();
        allow_if(&mut r, 1, read_only());
        allow(&mut r, &[1]);
        allow(&mut r, &[2]);
        allow_if(&mut r, 2, read_only());
        assert!(r[&1].is_empty() && r[&2].is_empty());
    }

    #[test]
    fn every_allowed_and_the_tested_forbidden_syscall_has_its_name() {
        assert_eq!(syscall_name(libc::SYS_personality), Some("personality"));
        assert_eq!(syscall_name(libc::SYS_ptrace), Some("ptrace"));
        assert_eq!(syscall_name(libc::SYS_openat), Some("openat"));
        assert_eq!(syscall_name(100_000), None);
        for k in Kind::ALL {
            for call in rules(k).keys() {
                assert!(syscall_name(*call).is_some(), "{k:?} allows {call}, which has no name");
            }
        }
        let mut nrs: Vec<_> = NAMES.iter().map(|(n, _)| n).collect();
        nrs.sort();
        nrs.dedup();
        assert_eq!(nrs.len(), NAMES.len(), "a syscall listed twice");
    }

    static TRAPPED: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

    extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
        let nr = unsafe { trapped_syscall(info) }.map_or(-1, i64::from);
        TRAPPED.store(nr, Relaxed);
    }

    #[test]
    fn forbidden_syscall_traps_on_a_filtered_thread() {
        // SAFETY: a zeroed sigaction is a valid start; the handler only
        // stores to an atomic.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut());
        }
        for kind in Kind::ALL {
            TRAPPED.store(0, Relaxed);
            // A thread of its own: the filter stays with it.
            let r = std::thread::spawn(move || {
                seccompiler::apply_filter(&program(kind).unwrap()).unwrap();
                // SAFETY: no memory arguments; the filter traps it before it runs.
                unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) };
                let allowed = TRAPPED.load(Relaxed);
                // SAFETY: gettid has no arguments; allowed by every filter.
                let tid = unsafe { libc::gettid() };
                (allowed, tid)
            });
            let (trapped, tid) = r.join().unwrap();
            assert!(tid > 0);
            assert_eq!(trapped, libc::SYS_personality, "{kind:?}: personality was not trapped");
        }
    }
}
