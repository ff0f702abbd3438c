//! Golden digests: one pinned digest (and op count) per workload kind, for
//! a fixed seed and round count, replayed natively. The guest runs the same
//! code, and every digest check compares the guest against this replay, so
//! a deterministic change in the shared workload code would pass those
//! checks unnoticed; here it changes a pinned value. If a change is
//! intended, update the table (and say why in the commit).

use nl_abi::*;
use nl_workloads::native::replay;

/// Parameters as the CLI defaults give them, seed 7, small working sets.
fn params(kind: u64) -> WorkloadParams {
    WorkloadParams {
        kind,
        seed: 7,
        ws_bytes: match kind {
            WORKLOAD_MEMWRITE => 1 << 20,
            WORKLOAD_BLKBENCH => nl_workloads::blk::BLKBENCH_WS_BYTES,
            WORKLOAD_FILECACHE => nl_workloads::filecache::ws_bytes_for(1 << 20),
            WORKLOAD_KV => nl_workloads::kv::KV_WS_BYTES,
            WORKLOAD_TLBWALK => nl_workloads::tlbwalk_ws_bytes(64),
            _ => 0,
        },
        write_pct: 50,
        pattern: if kind == WORKLOAD_TLBWALK { TLBWALK_LOADS } else { PATTERN_RANDOM },
        // tlbwalk: the pages.
        stride: if kind == WORKLOAD_TLBWALK { 64 } else { 4096 },
        hot_pct: 10,
        duration_ms: 100,
        data_bytes: if kind == WORKLOAD_FILECACHE { 1 << 20 } else { 0 },
    }
}

/// (kind, name, vCPU, rounds, digest, ops).
const GOLDEN: &[(u64, &str, u64, u64, u64, u64)] = &[
    (WORKLOAD_MEMWRITE, "memwrite", 1, 3, 0x04a0_3edf_b0e9_2393, 131_072),
    (WORKLOAD_COMPUTE, "compute", 1, 3, 0x2b6e_c683_fbd4_7f0b, 1_048_576),
    (WORKLOAD_EXITS, "exits", 1, 3, 0xb014_0c10_36a3_e46a, 128),
    (WORKLOAD_IDLE, "idle", 1, 3, 0xdb86_cca8_cdca_9218, 2),
    (WORKLOAD_BLKBENCH, "blkbench", 0, 3, 0x64d7_a073_c9ee_4b29, 2_105_344),
    (WORKLOAD_NETBENCH, "netbench", 0, 3, 0x7f72_0413_9120_09bd, 2),
    (WORKLOAD_KV, "kv", 0, 3, 0x3674_382f_c7e4_4c42, 2),
    (WORKLOAD_FILECACHE, "filecache", 0, 3, 0x4fc9_87f3_0cd4_1744, 32_768),
    (WORKLOAD_SYSCALL, "syscall", 1, 3, 0x5bb6_a22f_ddbe_ea3a, 128),
    (WORKLOAD_TLBWALK, "tlbwalk", 1, 3, 0xfc85_a615_d150_0f53, 131_072),
];

#[test]
fn every_workload_kind_has_its_pinned_digest() {
    let mut wrong = Vec::new();
    for &(kind, name, cpu, rounds, digest, ops) in GOLDEN {
        let got = replay(&params(kind), cpu, rounds, 0)
            .unwrap_or_else(|e| panic!("{name}: replay refused: {e}"));
        if (got.digest, got.ops) != (digest, ops) {
            wrong.push(format!(
                "{name}: digest {:#018x} ops {} (pinned {digest:#018x} ops {ops})",
                got.digest, got.ops
            ));
        }
    }
    assert!(wrong.is_empty(), "changed:\n{}", wrong.join("\n"));
}

/// The table covers every kind, and the seed and vCPU enter the digest (a
/// replay that ignored them would pin one value for all).
#[test]
fn the_digest_depends_on_seed_and_vcpu() {
    let kinds: Vec<u64> = GOLDEN.iter().map(|g| g.0).collect();
    // The round-engine kinds; chanbench, wildwrite, chanstream and doorbell
    // (9..=12) run in the guest's channel code and have their own digests.
    let want: Vec<u64> = (1..=8).chain([WORKLOAD_SYSCALL, WORKLOAD_TLBWALK]).collect();
    assert_eq!(kinds, want, "one row per workload kind");
    let p = params(WORKLOAD_MEMWRITE);
    let base = replay(&p, 0, 3, 0).unwrap().digest;
    assert_ne!(replay(&WorkloadParams { seed: 8, ..p }, 0, 3, 0).unwrap().digest, base);
    assert_ne!(replay(&p, 1, 3, 0).unwrap().digest, base);
    assert_ne!(replay(&p, 0, 4, 0).unwrap().digest, base);
}

/// tlbwalk's instruction fetches (`TLBWALK_FETCHES`): the chain runs
/// natively from an executable working set, every call's sum checks out,
/// and its digest is pinned and differs from the loads'.
#[test]
fn tlbwalk_fetches_run_their_chain_with_a_pinned_digest() {
    let p = WorkloadParams { pattern: TLBWALK_FETCHES, ..params(WORKLOAD_TLBWALK) };
    let got = replay(&p, 1, 3, 0).expect("the fetch chain runs natively");
    assert_eq!((got.digest, got.ops), (0xe7a7_1930_b861_7192, 131_072), "{:#018x}", got.digest);
    let loads = replay(&params(WORKLOAD_TLBWALK), 1, 3, 0).unwrap();
    assert_ne!(got.digest, loads.digest);
}
