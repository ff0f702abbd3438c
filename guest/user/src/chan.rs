//! The sandbox channel workloads: `chanbench` and `wildwrite` (see
//! `nl_workloads::chanbench` and `nl_workloads::wildwrite`). Both run on
//! vCPU 0 over the channel windows the boot info lists.

use core::ptr::write_volatile;
use core::sync::atomic::AtomicU64;

use nl_abi::{
    reg, BootInfo, ChannelWindow, ERR_BAD_BOOT_INFO, ERR_SELF_CHECK, PHASE_DONE,
    PHASE_MEASURE_START,
};
use nl_workloads::chanbench::{self, ChanError, Env};
use nl_workloads::channel::Endpoint;
use nl_workloads::wildwrite::{Plan, Target, WRITES};

use crate::{ctl_write, exit, fail, print, rdtsc};

/// Channel `i`'s two regions, checked against the boot info's layout.
fn regions(cpu: u64, boot: &BootInfo, i: usize) -> (&'static [AtomicU64], &'static [AtomicU64]) {
    let c: &ChannelWindow = match boot.channels.get(i) {
        Some(c) if (i as u64) < boot.num_channels => c,
        _ => fail(cpu, ERR_BAD_BOOT_INFO, i as u64),
    };
    if c.own_gpa != nl_abi::channel_own_gpa(i as u64)
        || c.peer_gpa != nl_abi::channel_peer_gpa(i as u64)
        || c.bytes != nl_abi::CHANNEL_REGION_BYTES
    {
        fail(cpu, ERR_BAD_BOOT_INFO, c.own_gpa);
    }
    let words = (c.bytes / 8) as usize;
    // SAFETY: the VMM maps both regions (own read-write, peer read-only) at
    // these addresses with user-accessible page-table entries, for the
    // guest's lifetime; they are only accessed through atomics here.
    unsafe {
        (
            core::slice::from_raw_parts(c.own_gpa as *const AtomicU64, words),
            core::slice::from_raw_parts(c.peer_gpa as *const AtomicU64, words),
        )
    }
}

fn done(cpu: u64, ops: u64, cycles: u64, digest: u64) -> ! {
    ctl_write(cpu, reg::OPS, ops);
    ctl_write(cpu, reg::CYCLES, cycles);
    ctl_write(cpu, reg::ROUNDS, 1);
    ctl_write(cpu, reg::DIGEST, digest);
    ctl_write(cpu, reg::PHASE, PHASE_DONE);
    exit()
}

struct GuestEnv {
    cpu: u64,
    patience: u64,
    ops: u64,
}

impl Env for GuestEnv {
    fn now(&mut self) -> u64 {
        rdtsc()
    }
    fn beat(&mut self) {
        self.ops += 1;
        ctl_write(self.cpu, reg::HEARTBEAT, self.ops);
    }
    fn patience(&self) -> u64 {
        self.patience
    }
}

/// chanbench over channel 0; prints one line per size (the bench parses
/// them) and reports the digest of `chanbench::expected_digest`.
pub fn chanbench(cpu: u64, boot: &BootInfo) -> ! {
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let (own, peer) = regions(cpu, boot, 0);
    let end = boot.channels[0].end;
    let p = boot.workload;
    let max = if p.stride == 0 { chanbench::MAX_SIZE } else { p.stride as usize };
    let gen = rdtsc() | 1;
    let mut ep = match Endpoint::new(own, peer, gen) {
        Ok(e) => e,
        Err(_) => fail(cpu, ERR_BAD_BOOT_INFO, own.len() as u64),
    };
    // Scratch buffers in the heap: three messages and the round trips.
    let need = 3 * chanbench::MAX_SIZE as u64 + 8 * chanbench::PING_ITERS as u64;
    if boot.heap_start + need > boot.heap_end {
        fail(cpu, ERR_BAD_BOOT_INFO, boot.heap_end);
    }
    let base = boot.heap_start;
    let m = chanbench::MAX_SIZE;
    // SAFETY: four disjoint ranges inside the user heap, mapped user-writable
    // and used by nothing else (vCPU 0 runs alone in this workload).
    let (msg, reference, rx, rtts) = unsafe {
        (
            core::slice::from_raw_parts_mut(base as *mut u8, m),
            core::slice::from_raw_parts_mut((base + m as u64) as *mut u8, m),
            core::slice::from_raw_parts_mut((base + 2 * m as u64) as *mut u8, m),
            core::slice::from_raw_parts_mut(
                (base + 3 * m as u64) as *mut u64,
                chanbench::PING_ITERS,
            ),
        )
    };
    let mut env = GuestEnv { cpu, patience: boot.tsc_khz.saturating_mul(20_000), ops: 0 };
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let r = chanbench::run(&mut ep, &mut env, end, p.seed, max, msg, reference, rx, rtts);
    let cycles = rdtsc().wrapping_sub(start);
    match r {
        Ok(s) => {
            for r in &s.results[..s.count] {
                if end == 0 {
                    print(
                        cpu,
                        format_args!(
                            "chanbench size={} rtt_median={} rtt_min={} rtt_p90={} stream_bytes={} stream_cycles={} tsc_khz={}\n",
                            r.size, r.rtt_median, r.rtt_min, r.rtt_p90, r.stream_bytes, r.stream_cycles, boot.tsc_khz
                        ),
                    );
                }
            }
            let st = ep.stats();
            print(
                cpu,
                format_args!(
                    "chanbench end={end} messages={} rejected={} resyncs={}\n",
                    s.messages,
                    st.rejected(),
                    st.resyncs
                ),
            );
            done(cpu, s.messages, cycles, s.digest)
        }
        Err(e) => {
            let (what, size, seq) = match e {
                ChanError::PeerSilent { size, seq } => ("peer silent", size, seq),
                ChanError::BadPayload { size, seq } => ("bad payload", size, seq),
                ChanError::TooLarge { size } => ("message too large", size, 0),
            };
            print(cpu, format_args!("chanbench: {what} at size {size}, message {seq}\n"));
            fail(cpu, ERR_SELF_CHECK, size as u64)
        }
    }
}

/// wildwrite: `WRITES` random writes over the heap and every channel window.
/// Reports DIGEST = the writes aimed at read-only windows.
pub fn wildwrite(cpu: u64, boot: &BootInfo) -> ! {
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let channels = boot.num_channels.min(nl_abi::MAX_CHANNELS as u64) as usize;
    let heap = boot.heap_end.saturating_sub(boot.heap_start);
    let plan = Plan::new(boot.workload.seed, WRITES, heap, channels, nl_abi::CHANNEL_REGION_BYTES);
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let (mut heap_w, mut own_w, mut peer_w) = (0u64, 0u64, 0u64);
    for (i, (t, v)) in plan.enumerate() {
        let addr = match t {
            Target::Heap(o) => {
                heap_w += 1;
                boot.heap_start + o
            }
            Target::Own(c, o) => {
                own_w += 1;
                boot.channels[c].own_gpa + o
            }
            Target::Peer(c, o) => {
                peer_w += 1;
                boot.channels[c].peer_gpa + o
            }
        };
        // SAFETY: deliberately wild, within what this sandbox maps for ring
        // 3: the heap (no code, stack or boot data lives there) and the
        // channel windows; writes to the read-only windows exit to the VMM.
        unsafe { write_volatile(addr as *mut u64, v) };
        if i % 256 == 255 {
            ctl_write(cpu, reg::HEARTBEAT, i as u64);
        }
    }
    let cycles = rdtsc().wrapping_sub(start);
    print(
        cpu,
        format_args!(
            "wildwrite: {heap_w} heap, {own_w} own-window, {peer_w} read-only-window writes\n"
        ),
    );
    done(cpu, heap_w + own_w + peer_w, cycles, peer_w)
}
