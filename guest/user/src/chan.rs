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

use crate::{ctl_write, exit, fail, print, rdtsc, syscall2};

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
                    "chanbench end={end} messages={} rejected={} resyncs={} crc={}\n",
                    s.messages,
                    st.rejected(),
                    st.resyncs,
                    if nl_workloads::channel::crc32c_in_hardware() { "sse4.2" } else { "portable" }
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

/// chanstream (`nl_workloads::chanstream`): on every channel, a message
/// every `stride` µs out and a drain every `data_bytes` µs in, for
/// `duration_ms` (0: until the VMM stops it). Each heartbeat (about every
/// 2 ms) writes HEARTBEAT = messages sent, OPS = messages received and
/// DIGEST = corrupt, lost or duplicated messages plus records the channel
/// code rejected, over all its channels (0 when healthy), so the host
/// watches the service while it runs. Each channel's own counters go to
/// the header of this end's region of it after every drain
/// (`chanstream::drain`), where the host reads them per channel.
pub fn chanstream(cpu: u64, boot: &BootInfo) -> ! {
    use nl_workloads::chanstream::{drain, send, Counters, Lane};
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let n = boot.num_channels.min(nl_abi::MAX_CHANNELS as u64) as usize;
    let gen = rdtsc() | 1;
    let mut eps: [Option<Endpoint<'static>>; nl_abi::MAX_CHANNELS] = Default::default();
    let mut lanes = [Lane::default(); nl_abi::MAX_CHANNELS];
    for i in 0..n {
        let (own, peer) = regions(cpu, boot, i);
        eps[i] = match Endpoint::rejoin(own, peer, gen) {
            Ok(e) => Some(e),
            Err(_) => fail(cpu, ERR_BAD_BOOT_INFO, own.len() as u64),
        };
        lanes[i] = Lane::new(boot.channels[i].peer);
    }
    let p = boot.workload;
    let khz = boot.tsc_khz.max(1);
    let send_every = p.stride.saturating_mul(khz) / 1000;
    let recv_every = p.data_bytes.saturating_mul(khz) / 1000;
    let beat_every = 2 * khz;
    let end = if p.duration_ms == 0 { u64::MAX } else { p.duration_ms.saturating_mul(khz) };
    let mut cs = [Counters::default(); nl_abi::MAX_CHANNELS];
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let (mut next_send, mut next_recv, mut next_beat) = (start, start, start);
    loop {
        let now = rdtsc();
        if now.wrapping_sub(start) >= end {
            break;
        }
        if now >= next_send {
            for (ep, c) in eps.iter_mut().zip(cs.iter_mut()) {
                if let Some(ep) = ep {
                    send(ep, boot.sandbox, c);
                }
            }
            next_send = if send_every == 0 {
                now
            } else {
                next_send.saturating_add(send_every).max(now.saturating_sub(send_every))
            };
        }
        if now >= next_recv {
            for ((ep, lane), c) in eps.iter_mut().zip(lanes.iter_mut()).zip(cs.iter_mut()) {
                if let Some(ep) = ep {
                    drain(ep, lane, c, 4096);
                }
            }
            next_recv = if recv_every == 0 {
                now
            } else {
                next_recv.saturating_add(recv_every).max(now.saturating_sub(recv_every))
            };
        }
        if now >= next_beat {
            let c = total(&cs);
            ctl_write(cpu, reg::OPS, c.received);
            ctl_write(cpu, reg::DIGEST, c.errors() + rejected(&eps));
            ctl_write(cpu, reg::HEARTBEAT, c.sent);
            next_beat = now + beat_every;
        }
        core::hint::spin_loop();
    }
    let cycles = rdtsc().wrapping_sub(start);
    let bad = rejected(&eps);
    let c = total(&cs);
    print(
        cpu,
        format_args!(
            "chanstream: sent={} received={} corrupt={} lost={} duplicate={} rejected={bad} full={} peer_restarts={}\n",
            c.sent, c.received, c.corrupt, c.lost, c.duplicate, c.full, c.peer_restarts
        ),
    );
    done(cpu, c.received, cycles, c.errors() + bad)
}

/// The counters of every channel summed.
fn total(cs: &[nl_workloads::chanstream::Counters]) -> nl_workloads::chanstream::Counters {
    let mut t = nl_workloads::chanstream::Counters::default();
    for c in cs {
        t.add(c);
    }
    t
}

/// Records the channel code rejected (bad header, length, sequence, CRC).
fn rejected(eps: &[Option<Endpoint<'static>>]) -> u64 {
    eps.iter().flatten().map(|e| e.stats().rejected()).sum()
}

struct GuestBell {
    cpu: u64,
    doorbell: u64,
    patience: u64,
    beats: u64,
    last_beat: u64,
}

impl nl_workloads::doorbell::Bell for GuestBell {
    fn now(&mut self) -> u64 {
        rdtsc()
    }
    fn ring(&mut self) {
        // SAFETY: the doorbell page is mapped user-writable with no memory
        // behind it: the write exits into KVM, which signals the peer's
        // irqfd (an ioeventfd of this VM) and drops it.
        unsafe { write_volatile(self.doorbell as *mut u64, 1) };
    }
    fn wait(&mut self, head: &AtomicU64, seen: u64) -> nl_workloads::doorbell::Wait {
        use nl_workloads::doorbell::Wait;
        let addr = head as *const AtomicU64 as u64;
        match syscall2(nl_abi::SYS_HALT_IF, addr, seen & 0xffff) {
            u64::MAX => Wait::NoHalt,
            0 => Wait::Woken,
            _ => Wait::Ticked,
        }
    }
    fn beat(&mut self) {
        let now = rdtsc();
        if now.wrapping_sub(self.last_beat) > 1 << 21 {
            self.beats += 1;
            ctl_write(self.cpu, reg::HEARTBEAT, self.beats);
            self.last_beat = now;
        }
    }
    fn patience(&self) -> u64 {
        self.patience
    }
}

/// doorbell (`nl_workloads::doorbell`) over channel 0, which must have a
/// doorbell: ping-pong that halts instead of polling. Prints the round
/// trips and the halts; fails its self-check when no halt was ended by the
/// doorbell (only the timer woke it: the doorbell was not delivered).
pub fn doorbell(cpu: u64, boot: &BootInfo) -> ! {
    use nl_workloads::doorbell::{run, ITERS, SIZE};
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let (own, peer) = regions(cpu, boot, 0);
    let c = boot.channels[0];
    if c.doorbell != nl_abi::channel_doorbell_gpa(0) {
        print(cpu, format_args!("doorbell: channel 0 has no doorbell\n"));
        fail(cpu, ERR_BAD_BOOT_INFO, c.doorbell);
    }
    let mut ep = match Endpoint::new(own, peer, rdtsc() | 1) {
        Ok(e) => e,
        Err(_) => fail(cpu, ERR_BAD_BOOT_INFO, own.len() as u64),
    };
    let need = 3 * SIZE as u64 + 8 * ITERS as u64;
    if boot.heap_start + need > boot.heap_end {
        fail(cpu, ERR_BAD_BOOT_INFO, boot.heap_end);
    }
    let base = boot.heap_start;
    let m = SIZE as u64;
    // SAFETY: four disjoint ranges inside the user heap, mapped user-writable
    // and used by nothing else (vCPU 0 runs alone in this workload).
    let (msg, reference, rx, rtts) = unsafe {
        (
            core::slice::from_raw_parts_mut(base as *mut u8, SIZE),
            core::slice::from_raw_parts_mut((base + m) as *mut u8, SIZE),
            core::slice::from_raw_parts_mut((base + 2 * m) as *mut u8, SIZE),
            core::slice::from_raw_parts_mut((base + 3 * m) as *mut u64, ITERS),
        )
    };
    let mut bell = GuestBell {
        cpu,
        doorbell: c.doorbell,
        patience: boot.tsc_khz.saturating_mul(60_000),
        beats: 0,
        last_beat: 0,
    };
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let r = run(&mut ep, &mut bell, c.end, boot.workload.seed, msg, reference, rx, rtts);
    let cycles = rdtsc().wrapping_sub(start);
    match r {
        Ok(s) => {
            print(
                cpu,
                format_args!(
                    "doorbell end={} rtt_median={} rtt_min={} rtt_p90={} halts={} woken={} messages={} tsc_khz={}\n",
                    c.end, s.rtt_median, s.rtt_min, s.rtt_p90, s.halts, s.woken, s.messages, boot.tsc_khz
                ),
            );
            if s.woken == 0 {
                print(
                    cpu,
                    format_args!(
                        "doorbell: none of {} halts ended before a timer tick: the doorbell was not delivered\n",
                        s.halts
                    ),
                );
                fail(cpu, ERR_SELF_CHECK, s.halts);
            }
            done(cpu, s.messages, cycles, s.digest)
        }
        Err(e) => {
            let (what, seq) = match e {
                ChanError::PeerSilent { seq, .. } => ("peer silent", seq),
                ChanError::BadPayload { seq, .. } => ("bad payload", seq),
                ChanError::TooLarge { .. } => ("message too large", 0),
            };
            print(cpu, format_args!("doorbell: {what} at message {seq}\n"));
            fail(cpu, ERR_SELF_CHECK, seq)
        }
    }
}

/// periodic (`nl_workloads::periodic`): greedy ring-3 work on vCPU 0 for
/// `duration_ms`, accounting with the TSC the CPU time it got in every
/// period of `stride` µs against its reservation of `data_bytes` µs. OPS =
/// work units, ROUNDS = complete periods, DIGEST = `periodic_digest`;
/// prints the summary and the CPU got in each period (µs), which the host
/// parses.
pub fn periodic(cpu: u64, boot: &BootInfo) -> ! {
    use nl_workloads::periodic::{finish, op, Accounting, GAP_US, MAX_PERIODS};
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let p = boot.workload;
    let khz = boot.tsc_khz.max(1);
    let us = |n: u64| n.saturating_mul(khz) / 1000;
    if boot.heap_start + 8 * MAX_PERIODS as u64 > boot.heap_end {
        fail(cpu, ERR_BAD_BOOT_INFO, boot.heap_end);
    }
    // SAFETY: a range at the start of the user heap, mapped user-writable
    // and used by nothing else (vCPU 0 runs alone in this workload).
    let log = unsafe { core::slice::from_raw_parts_mut(boot.heap_start as *mut u64, MAX_PERIODS) };
    let end = p.duration_ms.saturating_mul(khz);
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let mut acct = Accounting::new(start, us(p.stride), us(p.data_bytes), us(GAP_US), log);
    let (mut ops, mut sum, mut next_beat, mut beats) = (0u64, p.seed, start, 0u64);
    loop {
        let now = rdtsc();
        acct.observe(now);
        if now.wrapping_sub(start) >= end {
            break;
        }
        sum = sum.wrapping_add(op(p.seed, ops));
        ops += 1;
        if now >= next_beat {
            beats += 1;
            ctl_write(cpu, reg::HEARTBEAT, beats);
            ctl_write(cpu, reg::OPS, ops);
            next_beat = now + 2 * khz;
        }
    }
    let cycles = rdtsc().wrapping_sub(start);
    let s = acct.summary();
    let to_us = |c: u64| c.saturating_mul(1000) / khz;
    print(
        cpu,
        format_args!(
            "periodic periods={} met={} worst_us={} total_us={} reserve_us={} period_us={} ops={ops}\n",
            s.periods,
            s.met,
            to_us(s.worst),
            to_us(s.total),
            p.data_bytes,
            p.stride
        ),
    );
    // The CPU got per period, 16 to a line (the host joins them).
    for chunk in acct.log().chunks(16) {
        let mut line = [0u64; 16];
        for (d, c) in line.iter_mut().zip(chunk) {
            *d = to_us(*c);
        }
        print(cpu, format_args!("periodic got_us={:?}\n", &line[..chunk.len()]));
    }
    ctl_write(cpu, reg::ROUNDS, s.periods);
    ctl_write(cpu, reg::OPS, ops);
    ctl_write(cpu, reg::CYCLES, cycles);
    ctl_write(cpu, reg::DIGEST, finish(sum, ops));
    ctl_write(cpu, reg::PHASE, PHASE_DONE);
    exit()
}

/// storm: rings channel 0's doorbell as fast as it can for `duration_ms`.
/// OPS = rings, DIGEST = `storm_digest`.
pub fn storm(cpu: u64, boot: &BootInfo) -> ! {
    if cpu != 0 {
        done(cpu, 0, 0, 0);
    }
    let c = boot.channels[0];
    if boot.num_channels == 0 || c.doorbell != nl_abi::channel_doorbell_gpa(0) {
        print(cpu, format_args!("storm: channel 0 has no doorbell\n"));
        fail(cpu, ERR_BAD_BOOT_INFO, c.doorbell);
    }
    let p = boot.workload;
    let khz = boot.tsc_khz.max(1);
    let end = p.duration_ms.saturating_mul(khz);
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let (mut rings, mut next_beat) = (0u64, start);
    loop {
        let now = rdtsc();
        if now.wrapping_sub(start) >= end {
            break;
        }
        // SAFETY: as in `GuestBell::ring`: the doorbell page is mapped
        // user-writable with no memory behind it; KVM takes the write.
        unsafe { write_volatile(c.doorbell as *mut u64, 1) };
        rings += 1;
        if now >= next_beat {
            ctl_write(cpu, reg::HEARTBEAT, rings);
            next_beat = now + 2 * khz;
        }
    }
    let cycles = rdtsc().wrapping_sub(start);
    print(cpu, format_args!("storm rings={rings}\n"));
    done(cpu, rings, cycles, nl_workloads::periodic::storm_digest(p.seed, rings))
}
