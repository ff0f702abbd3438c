//! Host side: the workloads run natively, to verify a guest's digest
//! ([`replay`]) and to measure the native baseline ([`run_for`]).

use std::time::{Duration, Instant};
use std::vec::Vec;

use nl_abi::{WorkloadParams, WORKLOAD_BLKBENCH, WORKLOAD_FILECACHE, WORKLOAD_MEMWRITE};

use crate::{validate, Platform, Workload};

/// The native stand-in for the VM's devices: correct echoes, each with one
/// cheap real syscall (`getppid`) as the analog of a VM exit; `halt()` sleeps
/// one timer tick.
#[derive(Clone, Debug)]
pub struct NativePlatform {
    /// Sleep of one `halt()`; `None` (timer_hz 0) returns at once.
    tick: Option<Duration>,
    /// The block device: an in-memory disk (empty unless blkbench or filecache).
    disk: Vec<u64>,
}

impl NativePlatform {
    /// `timer_hz` is the guest timer rate: `halt()` sleeps `1 / timer_hz`
    /// seconds. 0 makes `halt()` return at once.
    pub fn new(timer_hz: u64) -> Self {
        let tick = (timer_hz > 0).then(|| Duration::from_nanos(1_000_000_000 / timer_hz));
        NativePlatform { tick, disk: Vec::new() }
    }

    /// With an all-zero in-memory disk of `bytes` (lazily allocated).
    pub fn with_disk(timer_hz: u64, bytes: u64) -> Self {
        NativePlatform { disk: std::vec![0u64; (bytes / 8) as usize], ..Self::new(timer_hz) }
    }
}

/// The word range of a request of `words` words at `sector` on a disk of
/// `disk_words` words, if inside it.
fn disk_range(sector: u64, words: usize, disk_words: usize) -> Option<core::ops::Range<usize>> {
    let start = usize::try_from(sector.checked_mul(64)?).ok()?;
    let end = start.checked_add(words)?;
    (end <= disk_words).then_some(start..end)
}

#[allow(unsafe_code)]
#[inline]
fn exit_analog() {
    // SAFETY: getppid takes no arguments, touches no memory of ours and
    // cannot fail.
    let ppid = unsafe { libc::getppid() };
    core::hint::black_box(ppid);
}

impl Platform for NativePlatform {
    fn port_echo(&mut self, v: u32) -> u32 {
        exit_analog();
        !v
    }

    fn mmio_echo(&mut self, v: u64) -> u64 {
        exit_analog();
        v
    }

    fn null_syscall(&mut self) -> u64 {
        exit_analog();
        nl_abi::SYS_ENOSYS
    }

    fn halt(&mut self) {
        if let Some(tick) = self.tick {
            std::thread::sleep(tick);
        }
    }

    fn run_code(&mut self, code: &[u64], arg: u64) -> Option<u64> {
        run_code_in_exec_map(code, arg)
    }

    fn blk_read(&mut self, sector: u64, buf: &mut [u64]) -> bool {
        match disk_range(sector, buf.len(), self.disk.len()) {
            Some(r) => {
                buf.copy_from_slice(&self.disk[r]);
                true
            }
            None => false,
        }
    }

    fn blk_write(&mut self, sector: u64, buf: &[u64]) -> bool {
        match disk_range(sector, buf.len(), self.disk.len()) {
            Some(r) => {
                self.disk[r].copy_from_slice(buf);
                true
            }
            None => false,
        }
    }
}

/// The host-side baseline of blkbench: the same block requests as
/// `pread`/`pwrite` on a host file (what the VMM does for the guest, minus
/// the VM).
#[derive(Debug)]
pub struct FileDiskPlatform {
    file: std::fs::File,
}

impl FileDiskPlatform {
    pub fn new(file: std::fs::File) -> Self {
        FileDiskPlatform { file }
    }
}

#[allow(unsafe_code)]
fn as_bytes(buf: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and any byte pattern is valid; same memory, 8x the length.
    unsafe { core::slice::from_raw_parts(buf.as_ptr().cast(), buf.len() * 8) }
}

#[allow(unsafe_code)]
fn as_bytes_mut(buf: &mut [u64]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; every byte pattern is a valid u64.
    unsafe { core::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), buf.len() * 8) }
}

impl Platform for FileDiskPlatform {
    fn port_echo(&mut self, v: u32) -> u32 {
        !v
    }
    fn mmio_echo(&mut self, v: u64) -> u64 {
        v
    }
    fn halt(&mut self) {}
    fn blk_read(&mut self, sector: u64, buf: &mut [u64]) -> bool {
        use std::os::unix::fs::FileExt;
        sector
            .checked_mul(512)
            .is_some_and(|off| self.file.read_exact_at(as_bytes_mut(buf), off).is_ok())
    }
    fn blk_write(&mut self, sector: u64, buf: &[u64]) -> bool {
        use std::os::unix::fs::FileExt;
        sector
            .checked_mul(512)
            .is_some_and(|off| self.file.write_all_at(as_bytes(buf), off).is_ok())
    }
}

/// Result of a native run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replay {
    /// `Workload::finish()` after the last round.
    pub digest: u64,
    /// Ops of round 0 (the warm-up).
    pub warmup_ops: u64,
    /// Ops of rounds 1.. (the measured period).
    pub ops: u64,
    /// Wall time of rounds 1.. only, in nanoseconds.
    pub measured_ns: u64,
    /// Rounds run, warm-up included.
    pub rounds: u64,
    /// filecache: requests served from the cache and read from the disk
    /// (0 for the other workloads).
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl Replay {
    /// Ops per second over the measured period (0 if nothing was measured).
    pub fn ops_per_sec(&self) -> f64 {
        if self.measured_ns == 0 {
            0.0
        } else {
            self.ops as f64 * 1e9 / self.measured_ns as f64
        }
    }
}

std::thread_local! {
    /// The words of the [`ExecMap`] alive on this thread, if one is: the
    /// only memory [`run_code_in_exec_map`] runs code from.
    static EXEC_RANGE: core::cell::Cell<Option<(usize, usize)>> =
        const { core::cell::Cell::new(None) };
}

/// Zeroed anonymous memory the host can run code from: tlbwalk's fetch
/// chain ([`nl_abi::TLBWALK_FETCHES`]), as the guest runs it from its
/// working set. One per thread at a time.
struct ExecMap {
    ptr: *mut u64,
    words: usize,
}

impl ExecMap {
    #[allow(unsafe_code)]
    fn new(bytes: u64) -> Result<Self, &'static str> {
        let len = usize::try_from(bytes).map_err(|_| "tlbwalk: working set too large")?;
        if len == 0 || EXEC_RANGE.with(|r| r.get().is_some()) {
            return Err("tlbwalk: no executable working set for the fetch chain");
        }
        // SAFETY: a fresh private anonymous mapping; the kernel chooses
        // the address, nothing else refers to it, and it is checked below.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err("tlbwalk: cannot map an executable working set");
        }
        let words = len / 8;
        EXEC_RANGE.with(|r| r.set(Some((p as usize, p as usize + words * 8))));
        Ok(ExecMap { ptr: p.cast(), words })
    }

    #[allow(unsafe_code)]
    fn words(&mut self) -> &mut [u64] {
        // SAFETY: `ptr` is a live mapping of `words` zero-filled, aligned
        // u64s owned by this value, borrowed mutably through it.
        unsafe { core::slice::from_raw_parts_mut(self.ptr, self.words) }
    }
}

impl Drop for ExecMap {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        EXEC_RANGE.with(|r| r.set(None));
        // SAFETY: the mapping made in `new`, with its length; no slice of it
        // outlives `self` (`words` borrows `self`).
        unsafe { libc::munmap(self.ptr.cast(), self.words * 8) };
    }
}

/// Calls the code at the start of `code` with `arg` in RDI and returns RAX,
/// if `code` lies in this thread's [`ExecMap`] (else `None`: heap memory
/// cannot run code).
#[allow(unsafe_code)]
fn run_code_in_exec_map(code: &[u64], arg: u64) -> Option<u64> {
    let (lo, hi) = EXEC_RANGE.with(|r| r.get())?;
    let at = code.as_ptr() as usize;
    if at < lo || at + code.len() * 8 > hi || code.is_empty() {
        return None;
    }
    // The chain was written through ordinary stores: they are done before
    // the call reads them as instructions (x86 keeps the instruction
    // stream coherent with stores on the same core).
    core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
    // SAFETY: `code` lies in this thread's executable mapping, where only
    // tlbwalk's warm-up wrote: a chain of `add rax, imm32; jmp rel32` that
    // stays inside the working set and ends in `ret`, touching no memory
    // and no register but RAX and the flags (`fetch_chain_point`).
    let f: extern "sysv64" fn(u64) -> u64 = unsafe { core::mem::transmute(code.as_ptr()) };
    Some(f(arg))
}

/// A zeroed working set for `params` (empty unless memwrite). Zeroed
/// allocation maps pages lazily, so the warm-up round faults them in just as
/// in the guest.
fn working_set(params: &WorkloadParams) -> Vec<u64> {
    if [WORKLOAD_MEMWRITE, WORKLOAD_BLKBENCH, WORKLOAD_FILECACHE, nl_abi::WORKLOAD_TLBWALK]
        .contains(&params.kind)
    {
        std::vec![0u64; (params.ws_bytes / 8) as usize]
    } else {
        Vec::new()
    }
}

/// Runs exactly `rounds` rounds (round 0, the warm-up, included) of vCPU
/// `cpu`'s workload natively and returns its digest, which must equal the
/// guest's after the same number of rounds.
pub fn replay(
    params: &WorkloadParams,
    cpu: u64,
    rounds: u64,
    timer_hz: u64,
) -> Result<Replay, &'static str> {
    run(params, cpu, default_platform(params, timer_hz), |_, done| done < rounds)
}

/// The platform of a native run: blkbench and filecache get an all-zero
/// in-memory disk.
fn default_platform(params: &WorkloadParams, timer_hz: u64) -> NativePlatform {
    match params.kind {
        WORKLOAD_BLKBENCH => NativePlatform::with_disk(timer_hz, crate::blk::BLKBENCH_DISK_BYTES),
        WORKLOAD_FILECACHE => {
            NativePlatform::with_disk(timer_hz, crate::filecache::disk_bytes(params.data_bytes))
        }
        _ => NativePlatform::new(timer_hz),
    }
}

/// Runs the warm-up round, then measured rounds until `duration` has
/// elapsed (at least one): the native throughput baseline.
pub fn run_for(
    params: &WorkloadParams,
    cpu: u64,
    duration: Duration,
    timer_hz: u64,
) -> Result<Replay, &'static str> {
    run(params, cpu, default_platform(params, timer_hz), |elapsed, done| {
        done < 2 || elapsed < duration
    })
}

/// As [`run_for`] on a given platform (e.g. [`FileDiskPlatform`]).
pub fn run_for_on<P: Platform>(
    params: &WorkloadParams,
    cpu: u64,
    duration: Duration,
    plat: P,
) -> Result<Replay, &'static str> {
    run(params, cpu, plat, |elapsed, done| done < 2 || elapsed < duration)
}

/// Runs rounds while `more(time since the measured period started, rounds
/// done)` says so.
fn run<P: Platform>(
    params: &WorkloadParams,
    cpu: u64,
    mut plat: P,
    mut more: impl FnMut(Duration, u64) -> bool,
) -> Result<Replay, &'static str> {
    validate(params)?;
    let fetch =
        params.kind == nl_abi::WORKLOAD_TLBWALK && params.pattern == nl_abi::TLBWALK_FETCHES;
    let mut heap = match fetch {
        true => Vec::new(),
        false => working_set(params),
    };
    let mut exec = None;
    let mem: &mut [u64] = match fetch {
        true => exec.insert(ExecMap::new(params.ws_bytes)?).words(),
        false => &mut heap,
    };
    let mut wl = Workload::new(params, cpu, mem)?;
    let mut warmup_ops = 0;
    if more(Duration::ZERO, 0) {
        warmup_ops = wl.round(&mut plat);
    }
    let mut ops = 0;
    let start = Instant::now();
    let mut elapsed = Duration::ZERO;
    while more(elapsed, wl.rounds_done()) {
        ops += wl.round(&mut plat);
        elapsed = start.elapsed();
    }
    let measured_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
    let rounds = wl.rounds_done();
    let (cache_hits, cache_misses) = wl.cache_counts();
    let digest = wl.finish();
    Ok(Replay { digest, warmup_ops, ops, measured_ns, rounds, cache_hits, cache_misses })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A platform that runs the chain and then lies about its sum by
    /// `skew` (as a fetch chain with a wrong instruction in it would).
    struct Skewed {
        skew: u64,
    }

    impl Platform for Skewed {
        fn port_echo(&mut self, v: u32) -> u32 {
            !v
        }
        fn mmio_echo(&mut self, v: u64) -> u64 {
            v
        }
        fn halt(&mut self) {}
        fn run_code(&mut self, code: &[u64], arg: u64) -> Option<u64> {
            run_code_in_exec_map(code, arg).map(|r| r.wrapping_add(self.skew))
        }
    }

    fn fetch_params(pages: u64) -> WorkloadParams {
        WorkloadParams {
            kind: nl_abi::WORKLOAD_TLBWALK,
            seed: 3,
            ws_bytes: crate::tlbwalk_ws_bytes(pages),
            pattern: nl_abi::TLBWALK_FETCHES,
            stride: pages,
            ..Default::default()
        }
    }

    /// Every call of the fetch chain is checked: a sum off by one is a
    /// self-check failure in every pass, the right sum none; code outside
    /// the executable map is never run.
    #[test]
    fn the_fetch_chain_is_checked_call_by_call() {
        for (skew, bad) in [(0, false), (1, true)] {
            let p = fetch_params(300);
            let mut map = ExecMap::new(p.ws_bytes).unwrap();
            let mut wl = Workload::new(&p, 0, map.words()).unwrap();
            let mut plat = Skewed { skew };
            assert_eq!(wl.round(&mut plat), 300, "the warm-up writes one point per page");
            let ops = wl.round(&mut plat);
            let passes = ops / 300;
            assert!(passes >= 1);
            let want = if bad { passes } else { 0 };
            assert_eq!(wl.self_check_failures(), want, "skew {skew}");
        }
        assert_eq!(run_code_in_exec_map(&[0xc3], 5), None, "heap memory is not run");
    }
}
