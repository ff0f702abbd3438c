//! chanbench results: parsed from a sandbox's console, and the same
//! benchmark code between two pinned host threads (the baseline measured
//! in the same run).

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use nl_workloads::chanbench::{self, Env, PING_ITERS};
use nl_workloads::channel::Endpoint;
use serde::Serialize;

use crate::{affinity, SandboxError};

/// One message size's numbers, in nanoseconds and bytes per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SizeNumbers {
    pub size: usize,
    /// Half the median round trip.
    pub one_way_median_ns: f64,
    pub rtt_median_ns: f64,
    pub rtt_min_ns: f64,
    pub rtt_p90_ns: f64,
    /// Streaming throughput at the receiver.
    pub stream_bytes_per_sec: f64,
}

/// A `doorbell` run as its leader printed it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DoorbellNumbers {
    pub rtt_median_ns: f64,
    pub rtt_min_ns: f64,
    pub rtt_p90_ns: f64,
    /// Halts, and those the doorbell ended (no timer tick during them).
    pub halts: u64,
    pub woken: u64,
}

/// Parses the leader's `doorbell end=0 ...` console line.
pub fn parse_doorbell(console: &str) -> Option<DoorbellNumbers> {
    let line = console.lines().find(|l| l.starts_with("doorbell end=0 "))?;
    let field = |k: &str| -> Option<u64> {
        line.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
    };
    let khz = field("tsc_khz").filter(|&k| k > 0)? as f64;
    let ns = |c: u64| c as f64 * 1e6 / khz;
    Some(DoorbellNumbers {
        rtt_median_ns: ns(field("rtt_median")?),
        rtt_min_ns: ns(field("rtt_min")?),
        rtt_p90_ns: ns(field("rtt_p90")?),
        halts: field("halts")?,
        woken: field("woken")?,
    })
}

/// Parses the leader's `chanbench size=...` console lines.
pub fn parse_console(console: &str) -> Vec<SizeNumbers> {
    let mut out = Vec::new();
    for line in console.lines().filter(|l| l.starts_with("chanbench size=")) {
        let field = |k: &str| -> Option<f64> {
            line.split_whitespace().find_map(|w| w.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
        };
        let (Some(size), Some(med), Some(min), Some(p90), Some(bytes), Some(cyc), Some(khz)) = (
            field("size"),
            field("rtt_median"),
            field("rtt_min"),
            field("rtt_p90"),
            field("stream_bytes"),
            field("stream_cycles"),
            field("tsc_khz"),
        ) else {
            continue;
        };
        if khz <= 0.0 {
            continue;
        }
        let ns = |c: f64| c * 1e6 / khz;
        out.push(SizeNumbers {
            size: size as usize,
            one_way_median_ns: ns(med) / 2.0,
            rtt_median_ns: ns(med),
            rtt_min_ns: ns(min),
            rtt_p90_ns: ns(p90),
            stream_bytes_per_sec: if cyc > 0.0 { bytes / (ns(cyc) / 1e9) } else { 0.0 },
        });
    }
    out
}

struct HostEnv(Instant);

impl Env for HostEnv {
    fn now(&mut self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
    fn beat(&mut self) {}
    fn patience(&self) -> u64 {
        20_000_000_000
    }
}

/// Runs chanbench between two host threads pinned to `cores` over two
/// regions the size of a sandbox channel's, and returns the leader's numbers.
pub fn native(cores: [usize; 2], seed: u64, max: usize) -> Result<Vec<SizeNumbers>, SandboxError> {
    let words = (nl_abi::CHANNEL_REGION_BYTES / 8) as usize;
    let region = || (0..words).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
    let (x, y) = (region(), region());
    let side = |own: &[AtomicU64],
                peer: &[AtomicU64],
                end: u64|
     -> Result<chanbench::Summary, SandboxError> {
        affinity::pin(0, &[cores[end as usize]])?;
        let mut ep =
            Endpoint::new(own, peer, end + 1).map_err(|e| SandboxError::Resource(e.into()))?;
        let m = chanbench::MAX_SIZE;
        let (mut a, mut b, mut c) = (vec![0u8; m], vec![0u8; m], vec![0u8; m]);
        let mut rtts = vec![0u64; PING_ITERS];
        let mut env = HostEnv(Instant::now());
        chanbench::run(&mut ep, &mut env, end, seed, max, &mut a, &mut b, &mut c, &mut rtts)
            .map_err(|e| SandboxError::Resource(format!("native chanbench: {e:?}")))
    };
    let (lead, follow) = std::thread::scope(|s| {
        let f = s.spawn(|| side(&y, &x, 1));
        let l = s.spawn(|| side(&x, &y, 0));
        (
            l.join()
                .unwrap_or_else(|_| Err(SandboxError::Resource("native leader panicked".into()))),
            f.join()
                .unwrap_or_else(|_| Err(SandboxError::Resource("native follower panicked".into()))),
        )
    });
    let (lead, _) = (lead?, follow?);
    // The host clock counts nanoseconds: 1e6 "cycles" per ms.
    let console: String = lead.results[..lead.count]
        .iter()
        .map(|r| {
            format!(
                "chanbench size={} rtt_median={} rtt_min={} rtt_p90={} stream_bytes={} stream_cycles={} tsc_khz=1000000\n",
                r.size, r.rtt_median, r.rtt_min, r.rtt_p90, r.stream_bytes, r.stream_cycles
            )
        })
        .collect();
    Ok(parse_console(&console))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines_parse_into_nanoseconds() {
        let c = "noise\nchanbench size=64 rtt_median=2000 rtt_min=1000 rtt_p90=3000 stream_bytes=4000000 stream_cycles=2000000 tsc_khz=2000000\nchanbench end=0\n";
        let v = parse_console(c);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].size, 64);
        assert!((v[0].rtt_median_ns - 1000.0).abs() < 1e-9);
        assert!((v[0].one_way_median_ns - 500.0).abs() < 1e-9);
        assert!((v[0].stream_bytes_per_sec - 4e9).abs() < 1.0);
    }

    #[test]
    fn the_doorbell_line_parses_into_nanoseconds() {
        let c = "doorbell end=1 rtt_median=0\ndoorbell end=0 rtt_median=40000 rtt_min=20000 rtt_p90=80000 halts=9 woken=7 messages=400 tsc_khz=2000000\n";
        let d = parse_doorbell(c).unwrap();
        assert!((d.rtt_median_ns - 20_000.0).abs() < 1e-9);
        assert!((d.rtt_min_ns - 10_000.0).abs() < 1e-9);
        assert_eq!((d.halts, d.woken), (9, 7));
        assert!(parse_doorbell("doorbell end=1 rtt_median=1 tsc_khz=1").is_none());
    }

    #[test]
    fn the_native_run_measures_every_size() {
        let cores = affinity::host_cores().unwrap();
        let pair = [cores[0], *cores.last().unwrap()];
        let v = native(pair, 3, 256).unwrap();
        assert_eq!(v.iter().map(|s| s.size).collect::<Vec<_>>(), vec![8, 16, 32, 64, 128, 256]);
        assert!(v.iter().all(|s| s.rtt_median_ns > 0.0 && s.stream_bytes_per_sec > 0.0));
    }
}
