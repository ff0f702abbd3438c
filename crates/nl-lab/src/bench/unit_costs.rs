//! This host's unit costs, measured in the same run as a bench's workloads,
//! and the lower bounds they imply for checkpointing and replication.
//!
//! * a 4 KiB page copy (random pages of a 64 MiB buffer), a page compare
//!   (read into a buffer and compared, as the shadow scan does) and a page
//!   hash (64-bit multiply-xor over its words);
//! * a userfaultfd write-protect fault: a host thread writes to protected
//!   pages of a memfd mapping and a fault thread unprotects each (the path a
//!   CoW checkpoint's guest write takes, without KVM in it);
//! * a dirty-log first write: the reference guest sweeps 8 MiB sequentially
//!   (every page rewritten many times per interval) unprotected and under the
//!   dirty log at 20 ms; the running time (wall time less the pauses) it
//!   lost, over the pages logged;
//! * loopback TCP throughput.
//!
//! A lower bound is the least time any capture needs for the pages a row
//! wrote: the cheapest of the dirty log, the compare capture and
//! copy-on-write at these costs, with copies and compares spread over the
//! host's cores (see [`UnitCosts::checkpoint_bound`]).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::{bail, Result};
use nl_launch::args::{CkptMode, PatternName, WorkloadArgs};
use nl_memory::write_protect::{FaultHandler, Protector, Range, WriteProtect};
use nl_memory::GuestMemory;
use serde::Serialize;

const PAGE: usize = 4096;

/// Unit costs in microseconds (per page unless named otherwise).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct UnitCosts {
    pub copy_us: f64,
    pub compare_us: f64,
    pub hash_us: f64,
    pub uffd_fault_us: f64,
    pub log_fault_us: f64,
    pub loopback_gbps: f64,
    pub cores: usize,
}

impl UnitCosts {
    /// Measures everything (about 10 s, two short VM runs).
    pub fn measure() -> Result<Self> {
        let (copy_us, compare_us, hash_us) = memory_costs();
        Ok(Self {
            copy_us,
            compare_us,
            hash_us,
            uffd_fault_us: uffd_fault_us()?,
            log_fault_us: log_fault_us()?,
            loopback_gbps: loopback_gbps()?,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }

    /// The least normalized time (protected / unprotected) a checkpoint
    /// interval of `interval_ms` can have when the guest writes `dirty`
    /// pages per interval out of `allocated`: 1 plus the cheapest capture's
    /// guest time lost over the interval.
    pub fn checkpoint_bound(&self, dirty: f64, allocated: f64, interval_ms: f64) -> f64 {
        let c = self.cores as f64;
        let log = dirty * (self.log_fault_us + self.copy_us / c);
        let compare = (allocated * self.compare_us + dirty * self.copy_us) / c;
        let cow = dirty * (self.uffd_fault_us + self.copy_us);
        1.0 + log.min(compare).min(cow) / (interval_ms * 1e3)
    }

    /// The highest share of unreplicated throughput an epoch of
    /// `epoch_ms` can keep when `dirty` pages per epoch must be captured and
    /// sent (over loopback; the send overlaps the next epoch, the capture
    /// does not).
    pub fn replication_bound(&self, dirty: f64, allocated: f64, epoch_ms: f64) -> f64 {
        let capture_ms = (self.checkpoint_bound(dirty, allocated, epoch_ms) - 1.0) * epoch_ms;
        let send_ms = dirty * PAGE as f64 / (self.loopback_gbps * 1e9) * 1e3;
        // The epoch cannot be shorter than the send of the previous one.
        let cycle = (epoch_ms + capture_ms).max(send_ms + capture_ms);
        epoch_ms / cycle
    }
}

/// Best of three timings of `f`, in µs per page of `pages`.
fn best_us(pages: usize, mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6 / pages as f64
        })
        .fold(f64::MAX, f64::min)
}

/// Copy, compare and hash of random pages of a 64 MiB buffer.
fn memory_costs() -> (f64, f64, f64) {
    const BUF: usize = 64 << 20;
    const N: usize = 4096;
    let src: Vec<u8> = (0..BUF).map(|i| (i as u8) ^ (i >> 12) as u8).collect();
    let mut dst = vec![1u8; N * PAGE];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let order: Vec<usize> = (0..N)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as usize) % (BUF / PAGE)
        })
        .collect();
    let page = |p: usize| &src[p * PAGE..(p + 1) * PAGE];
    let copy = best_us(N, || {
        for (d, &p) in dst.chunks_exact_mut(PAGE).zip(&order) {
            d.copy_from_slice(std::hint::black_box(page(p)));
        }
        std::hint::black_box(&dst);
    });
    let mut buf = vec![0u8; PAGE];
    let compare = best_us(N, || {
        let mut same = 0;
        for (d, &p) in dst.chunks_exact(PAGE).zip(&order) {
            buf.copy_from_slice(page(p));
            same += usize::from(std::hint::black_box(&buf[..]) == d);
        }
        std::hint::black_box(same);
    });
    let hash = best_us(N, || {
        let mut h = 0u64;
        for &p in &order {
            for w in page(p).chunks_exact(8) {
                let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                h = (h ^ v).wrapping_mul(0x100_0000_01b3).rotate_left(29);
            }
        }
        std::hint::black_box(h);
    });
    (copy, compare, hash)
}

struct Unprotect;

impl FaultHandler for Unprotect {
    fn fault(&mut self, p: &Protector, gpa: u64, _r: Range) -> Result<(), String> {
        p.unprotect(gpa & !(PAGE as u64 - 1), PAGE as u64)
    }
}

/// One write to each of 2048 write-protected pages, each served by the
/// fault thread; best of three rounds.
fn uffd_fault_us() -> Result<f64> {
    use nl_memory::vm_memory::{Bytes, GuestAddress};
    const N: usize = 2048;
    let mem = GuestMemory::new("unit-costs", 64 << 20)?;
    let wp = WriteProtect::new(&mem, "unit-faults", Unprotect).map_err(anyhow::Error::msg)?;
    let base = mem.regions()[0].gpa;
    // Allocate the pages first: a write to a hole would also pay the allocation.
    for i in 0..N {
        mem.mem().write_obj(1u8, GuestAddress(base + (i * PAGE) as u64))?;
    }
    let mut best = f64::MAX;
    for round in 0..3u8 {
        wp.protector().protect_all().map_err(anyhow::Error::msg)?;
        let t = Instant::now();
        for i in 0..N {
            mem.mem().write_obj(round, GuestAddress(base + (i * PAGE) as u64))?;
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e6 / N as f64);
    }
    if let Some(e) = wp.error() {
        bail!("the fault thread failed: {e}");
    }
    Ok(best)
}

/// The guest sweeping 8 MiB unprotected and under the dirty log (20 ms).
fn log_fault_us() -> Result<f64> {
    let w = WorkloadArgs {
        pattern: PatternName::Sequential,
        ws: Some(8 << 20),
        write_pct: 100,
        ..WorkloadArgs::default()
    };
    let duration = 1.5;
    let base = super::checkpoint::baseline(&w, duration)?;
    let a = super::checkpoint::ckpt_args(&w, duration, 20.0, CkptMode::DirtyLog, 1, 0);
    let r = nl_launch::checkpoint::protected_run(&a, true)?;
    let rep = &r.report;
    if !r.digest_ok || rep.checkpoint_pages_avg < 1.0 || r.ops_per_sec <= 0.0 {
        bail!("the dirty-log calibration run failed: {:?}", r.error);
    }
    // Over the run (`duration` of wall time): the vCPUs ran for all of it
    // but the pauses; at the unprotected rate they would have done the ops
    // counted in a part of that; the rest went to first-write faults.
    let wall_ms = duration * 1e3;
    let running_ms = wall_ms - rep.checkpoints as f64 * rep.pause_ms_avg;
    let needed_ms = r.ops_per_sec * wall_ms / base;
    let faults = rep.checkpoints as f64 * rep.scanned_pages_avg.max(rep.checkpoint_pages_avg);
    Ok(((running_ms - needed_ms).max(0.0) * 1e3 / faults.max(1.0)).max(0.0))
}

/// 256 MiB over one loopback TCP connection.
fn loopback_gbps() -> Result<f64> {
    const TOTAL: usize = 256 << 20;
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(got);
            }
            got += n;
        }
    });
    let mut s = TcpStream::connect(addr)?;
    let buf = vec![7u8; 1 << 20];
    let t = Instant::now();
    for _ in 0..TOTAL / buf.len() {
        s.write_all(&buf)?;
    }
    drop(s);
    let got = rx.join().map_err(|_| anyhow::anyhow!("loopback reader panicked"))??;
    let secs = t.elapsed().as_secs_f64();
    if got != TOTAL {
        bail!("loopback: {got} of {TOTAL} bytes arrived");
    }
    Ok(TOTAL as f64 / secs / 1e9)
}

pub fn print(c: &UnitCosts) {
    println!(
        "unit costs: page copy {:.2} us, compare {:.2} us, hash {:.2} us, userfaultfd fault {:.1} us, \
         dirty-log first write {:.1} us, loopback {:.2} GB/s, {} cores",
        c.copy_us,
        c.compare_us,
        c.hash_us,
        c.uffd_fault_us,
        c.log_fault_us,
        c.loopback_gbps,
        c.cores
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> UnitCosts {
        UnitCosts {
            copy_us: 0.5,
            compare_us: 0.5,
            hash_us: 1.0,
            uffd_fault_us: 100.0,
            log_fault_us: 8.0,
            loopback_gbps: 4.0,
            cores: 2,
        }
    }

    #[test]
    fn the_bound_takes_the_cheapest_capture() {
        let c = costs();
        // 16384 dirty of 20000 allocated at 50 ms: compare (9.2 ms) beats
        // the log (135 ms) and CoW.
        let b = c.checkpoint_bound(16384.0, 20000.0, 50.0);
        assert!((b - (1.0 + (20000.0 * 0.5 + 16384.0 * 0.5) / 2.0 / 50_000.0)).abs() < 1e-9);
        // 10 dirty pages: the log (82.5 us).
        let b = c.checkpoint_bound(10.0, 20000.0, 50.0);
        assert!((b - (1.0 + 10.0 * 8.25 / 50_000.0)).abs() < 1e-9);
        // Nothing dirty: no cost.
        assert_eq!(c.checkpoint_bound(0.0, 0.0, 50.0), 1.0);
    }

    #[test]
    fn the_replication_bound_is_at_most_one_and_falls_with_dirty_pages() {
        let c = costs();
        let few = c.replication_bound(10.0, 20000.0, 20.0);
        let many = c.replication_bound(16384.0, 20000.0, 20.0);
        assert!(few <= 1.0 && few > 0.99, "{few}");
        assert!(many < few, "{many} {few}");
    }
}
