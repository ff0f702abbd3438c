//! Native throughput of every workload: a quick sanity check of round sizes.
//!
//! `cargo run --release -p nl-workloads --features std --example native_rates [ms]`

use std::time::Duration;

use nl_abi::{
    WorkloadParams, PATTERN_HOTCOLD, PATTERN_RANDOM, PATTERN_SEQUENTIAL, PATTERN_STRIDED,
    WORKLOAD_COMPUTE, WORKLOAD_EXITS, WORKLOAD_IDLE, WORKLOAD_MEMWRITE,
};
use nl_workloads::native::{run_for, NativePlatform};
use nl_workloads::Workload;

fn main() {
    let ms = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let dur = Duration::from_millis(ms);
    let timer_hz = 1000;
    let mut cases = Vec::new();
    for (name, pattern) in [
        ("sequential", PATTERN_SEQUENTIAL),
        ("strided", PATTERN_STRIDED),
        ("random", PATTERN_RANDOM),
        ("hotcold", PATTERN_HOTCOLD),
    ] {
        for ws_mib in [1u64, 64, 512] {
            for write_pct in [0u64, 37, 50, 100] {
                let p = WorkloadParams {
                    kind: WORKLOAD_MEMWRITE,
                    seed: 1,
                    ws_bytes: ws_mib << 20,
                    write_pct,
                    pattern,
                    stride: 4096 + 64,
                    hot_pct: 10,
                    duration_ms: ms,
                    data_bytes: 0,
                };
                cases.push((format!("memwrite {name} {ws_mib} MiB w{write_pct}%"), p));
            }
        }
    }
    for (name, kind) in
        [("compute", WORKLOAD_COMPUTE), ("exits", WORKLOAD_EXITS), ("idle", WORKLOAD_IDLE)]
    {
        cases.push((name.to_string(), WorkloadParams { kind, seed: 1, ..Default::default() }));
    }
    for (name, p) in cases {
        let r = run_for(&p, 0, dur, timer_hz).expect("valid params");
        let per_round_ms = r.measured_ns as f64 / 1e6 / (r.rounds - 1) as f64;
        println!(
            "{name:<36} {:>12.0} ops/s  {:>8.3} ms/round  warm-up {} ops",
            r.ops_per_sec(),
            per_round_ms,
            r.warmup_ops
        );
    }

    // The final sweep of memwrite reads the whole working set.
    let p = WorkloadParams {
        kind: WORKLOAD_MEMWRITE,
        seed: 1,
        ws_bytes: 512 << 20,
        write_pct: 100,
        ..Default::default()
    };
    let mut mem = vec![0u64; (p.ws_bytes / 8) as usize];
    let mut w = Workload::new(&p, 0, &mut mem).expect("valid params");
    w.round(&mut NativePlatform::new(0));
    let t = std::time::Instant::now();
    let d = w.finish();
    println!("finish() over 512 MiB: {:?} (digest {d:#x})", t.elapsed());
}
