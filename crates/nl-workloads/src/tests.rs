use std::vec;
use std::vec::Vec;

use nl_abi::{
    WorkloadParams, PATTERN_HOTCOLD, PATTERN_RANDOM, PATTERN_SEQUENTIAL, PATTERN_STRIDED,
    WORKLOAD_COMPUTE, WORKLOAD_EXITS, WORKLOAD_IDLE, WORKLOAD_MEMWRITE,
};

use crate::*;

/// A platform that echoes correctly (or, with `wrong`, corrupts one value
/// in `wrong` calls) and counts what it was asked to do.
#[derive(Default)]
struct TestPlatform {
    ports: u64,
    mmios: u64,
    halts: u64,
    /// Nonzero: every `wrong`-th call returns a wrong value.
    wrong: u64,
}

impl TestPlatform {
    fn corrupt(&self) -> bool {
        self.wrong != 0 && (self.ports + self.mmios).is_multiple_of(self.wrong)
    }
}

impl Platform for TestPlatform {
    fn port_echo(&mut self, v: u32) -> u32 {
        self.ports += 1;
        if self.corrupt() {
            !v ^ 4
        } else {
            !v
        }
    }
    fn mmio_echo(&mut self, v: u64) -> u64 {
        self.mmios += 1;
        if self.corrupt() {
            v ^ (1 << 40)
        } else {
            v
        }
    }
    fn halt(&mut self) {
        self.halts += 1;
    }
}

const KIB: u64 = 1024;

fn memwrite(pattern: u64, ws_bytes: u64, write_pct: u64) -> WorkloadParams {
    WorkloadParams {
        kind: WORKLOAD_MEMWRITE,
        seed: 0x1234_5678,
        ws_bytes,
        write_pct,
        pattern,
        stride: if pattern == PATTERN_STRIDED { 4096 + 8 } else { 0 },
        hot_pct: if pattern == PATTERN_HOTCOLD { 25 } else { 0 },
        duration_ms: 100,
        data_bytes: 0,
    }
}

fn kind(kind: u64) -> WorkloadParams {
    WorkloadParams { kind, seed: 42, ..Default::default() }
}

fn zeroed(p: &WorkloadParams) -> Vec<u64> {
    if p.kind == WORKLOAD_MEMWRITE {
        vec![0; (p.ws_bytes / 8) as usize]
    } else {
        Vec::new()
    }
}

/// Runs `rounds` rounds; `tamper(round_just_done, mem)` runs after each.
fn run_with(
    p: &WorkloadParams,
    cpu: u64,
    rounds: u64,
    plat: &mut TestPlatform,
    mut tamper: impl FnMut(u64, &mut [u64]),
) -> (u64, Vec<u64>) {
    let mut mem = zeroed(p);
    let mut wl = Workload::new(p, cpu, &mut mem).unwrap();
    let mut ops = Vec::new();
    for r in 0..rounds {
        ops.push(wl.round(plat));
        tamper(r, wl.mem);
    }
    assert_eq!(wl.rounds_done(), rounds);
    let d = wl.finish();
    assert_eq!(d, wl.finish(), "finish must be idempotent");
    (d, ops)
}

fn digest(p: &WorkloadParams, cpu: u64, rounds: u64) -> u64 {
    run_with(p, cpu, rounds, &mut TestPlatform::default(), |_, _| {}).0
}

const PATTERNS: [u64; 4] = [PATTERN_SEQUENTIAL, PATTERN_STRIDED, PATTERN_RANDOM, PATTERN_HOTCOLD];

fn all_params() -> Vec<WorkloadParams> {
    let mut v: Vec<_> = PATTERNS.iter().map(|&pat| memwrite(pat, 64 * KIB, 50)).collect();
    v.push(kind(WORKLOAD_COMPUTE));
    v.push(kind(WORKLOAD_EXITS));
    v.push(kind(WORKLOAD_IDLE));
    v
}

#[test]
fn deterministic() {
    for p in all_params() {
        let a = digest(&p, 3, 4);
        assert_eq!(a, digest(&p, 3, 4), "{p:?}");
    }
}

#[test]
fn seed_cpu_and_rounds_change_the_digest() {
    for p in all_params() {
        let base = digest(&p, 1, 3);
        let other_seed = WorkloadParams { seed: p.seed + 1, ..p };
        assert_ne!(base, digest(&other_seed, 1, 3), "seed: {p:?}");
        assert_ne!(base, digest(&p, 2, 3), "cpu: {p:?}");
        assert_ne!(base, digest(&p, 1, 2), "rounds: {p:?}");
        assert_ne!(base, digest(&p, 1, 4), "rounds: {p:?}");
    }
    // Different kinds and patterns with the same seed differ too.
    let mut all: Vec<u64> = all_params().iter().map(|p| digest(p, 0, 2)).collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), all_params().len());
}

#[test]
fn write_pct_changes_the_digest() {
    for pat in PATTERNS {
        let ds: Vec<u64> =
            [0, 1, 50, 100].iter().map(|&w| digest(&memwrite(pat, 64 * KIB, w), 0, 3)).collect();
        for i in 0..ds.len() {
            for j in 0..i {
                assert_ne!(ds[i], ds[j], "pattern {pat}");
            }
        }
    }
}

#[test]
fn the_final_self_check_finds_every_single_bit_flip() {
    for pat in PATTERNS {
        let p = memwrite(pat, 64 * KIB, 50);
        let mut mem = zeroed(&p);
        let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
        for _ in 0..3 {
            wl.round(&mut TestPlatform::default());
        }
        assert_eq!(wl.final_self_check(), 0, "clean run, pattern {pat}");
        let d = wl.finish();
        // Every bit of a sealed word and of a never-written (zero) word.
        let (sealed, zero) = {
            let m = &*wl.mem;
            (m.iter().position(|w| *w != 0).unwrap(), m.iter().position(|w| *w == 0).unwrap())
        };
        for word in [sealed, zero] {
            for bit in 0..64 {
                wl.mem[word] ^= 1 << bit;
                assert_eq!(wl.final_self_check(), 1, "pattern {pat} word {word} bit {bit}");
                wl.mem[word] ^= 1 << bit;
                wl.mismatches = 0;
            }
        }
        assert_eq!(wl.finish(), d, "the check does not change the digest");
    }
}

#[test]
fn a_flipped_bit_changes_the_digest() {
    for pat in PATTERNS {
        for (write_pct, when) in [(0, 1), (0, 2), (50, 3), (100, 3)] {
            let p = memwrite(pat, 64 * KIB, write_pct);
            let clean = digest(&p, 0, 4);
            for word in [0, 5000, 8191] {
                // Read-only rounds: a flip between rounds must show; with
                // writes, flip after the last round (a flipped word that is
                // overwritten before it is read is legitimately invisible).
                let (d, _) = run_with(&p, 0, 4, &mut TestPlatform::default(), |r, mem| {
                    if r == when {
                        mem[word] ^= 1 << 17;
                    }
                });
                assert_ne!(
                    clean, d,
                    "pattern {pat} write_pct {write_pct} word {word} after round {when}"
                );
            }
            // A lost page (reads back as zero) shows too.
            let (d, _) = run_with(&p, 0, 4, &mut TestPlatform::default(), |r, mem| {
                if r == 3 {
                    mem[512..1024].fill(0);
                }
            });
            assert_ne!(clean, d, "lost page, pattern {pat} write_pct {write_pct}");
        }
    }
}

#[test]
fn warm_up_writes_one_word_per_page() {
    for pat in PATTERNS {
        let p = memwrite(pat, 256 * KIB, 100);
        let mut mem = zeroed(&p);
        let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
        assert_eq!(wl.round(&mut TestPlatform::default()), 64);
        for page in wl.mem.chunks(512) {
            assert_eq!(page.iter().filter(|&&w| w != 0).count(), 1);
        }
    }
}

/// Runs the warm-up and then `rounds` measured rounds of `p` (write_pct 100)
/// and returns, per word, whether the measured rounds wrote it, plus the ops.
fn written(p: &WorkloadParams, rounds: u64) -> (Vec<bool>, u64) {
    let mut mem = zeroed(p);
    let mut wl = Workload::new(p, 0, &mut mem).unwrap();
    let mut plat = TestPlatform::default();
    wl.round(&mut plat);
    let before = wl.mem.to_vec();
    let mut ops = 0;
    for _ in 0..rounds {
        ops += wl.round(&mut plat);
    }
    let w = wl.mem.iter().zip(&before).map(|(a, b)| a != b).collect();
    (w, ops)
}

fn pages_hit(w: &[bool]) -> Vec<bool> {
    w.chunks(512).map(|c| c.iter().any(|&x| x)).collect()
}

#[test]
fn sequential_covers_the_working_set_in_order() {
    let p = memwrite(PATTERN_SEQUENTIAL, 256 * KIB, 100);
    let words = 256 * 1024 / 8;
    // A round of a small working set is one pass.
    let (w, ops) = written(&p, 1);
    assert_eq!(ops, words as u64);
    assert!(w.iter().all(|&x| x));
    // Rounds continue where the last one stopped: a large working set is
    // covered front to back.
    let p = memwrite(PATTERN_SEQUENTIAL, 16 << 20, 100);
    let (w, ops) = written(&p, 1);
    assert_eq!(ops, MEMWRITE_SEQUENTIAL_OPS_PER_ROUND);
    let n = ops as usize;
    assert!(w[..n].iter().all(|&x| x) && !w[n..].iter().any(|&x| x));
    let (w, _) = written(&p, 2);
    assert!(w[..2 * n].iter().all(|&x| x) && !w[2 * n..].iter().any(|&x| x));
}

#[test]
fn strided_hits_every_word_eventually() {
    for stride in [8, 4096, 4096 + 8, 3 * 4096 + 24, 200 * KIB] {
        let p = WorkloadParams { stride, ..memwrite(PATTERN_STRIDED, 256 * KIB, 100) };
        // One round (= words accesses) hits every word exactly once.
        let (w, _) = written(&p, 1);
        assert!(w.iter().all(|&x| x), "stride {stride}");
        // A larger working set: the first pass (offset 0) is `stride` apart
        // and a round hits `ops` distinct words.
        let p2 = WorkloadParams { ws_bytes: 16 << 20, ..p };
        let (w, ops) = written(&p2, 1);
        let s = (stride / 8) as usize;
        let first_pass = (ops as usize * s).min(w.len());
        assert!(w[..first_pass].iter().step_by(s).all(|&x| x), "stride {stride}");
        assert_eq!(w.iter().filter(|&&x| x).count() as u64, ops);
    }
}

#[test]
fn random_touches_every_page() {
    let p = memwrite(PATTERN_RANDOM, 256 * KIB, 100);
    let (w, _) = written(&p, 8);
    assert!(pages_hit(&w).iter().all(|&x| x));
}

#[test]
fn hotcold_prefers_the_hot_part() {
    // 1 MiB, hot_pct 25: the first 64 pages are hot.
    let p = memwrite(PATTERN_HOTCOLD, 1024 * KIB, 100);
    let (w, _) = written(&p, 2);
    let pages = pages_hit(&w);
    assert!(pages[..64].iter().all(|&x| x), "all hot pages written");
    assert!(pages[64..].iter().all(|&x| x), "cold pages written too");
    // Written words: 90% of the accesses go to 25% of the memory.
    let hot = w[..64 * 512].iter().filter(|&&x| x).count() as f64 / (64.0 * 512.0);
    let cold = w[64 * 512..].iter().filter(|&&x| x).count() as f64 / (192.0 * 512.0);
    assert!(hot > 0.9 && cold > 0.05 && cold < 0.2, "hot {hot} cold {cold}");
    // hot_pct 100: everything is hot, still every page.
    let p = WorkloadParams { hot_pct: 100, ..memwrite(PATTERN_HOTCOLD, 256 * KIB, 100) };
    let (w, _) = written(&p, 8);
    assert!(pages_hit(&w).iter().all(|&x| x));
    // hot_pct 1 of a small ws still has one hot page.
    let p = WorkloadParams { hot_pct: 1, ..p };
    let (w, _) = written(&p, 1);
    assert!(pages_hit(&w)[0]);
}

#[test]
fn write_pct_is_the_share_of_writes() {
    // A large working set, so few accesses hit the same word twice.
    for pct in [0u64, 10, 30, 70, 100] {
        let p = memwrite(PATTERN_RANDOM, 16 << 20, pct);
        let (w, ops) = written(&p, 1);
        let share = w.iter().filter(|&&x| x).count() as f64 / ops as f64 * 100.0;
        // Up to ~6% of the writes hit a word already written this round.
        let pct = pct as f64;
        assert!(share <= pct + 2.0 && share >= pct * 0.92 - 2.0, "write_pct {pct}: {share}");
    }
    // write_pct 0 never stores.
    let p = memwrite(PATTERN_SEQUENTIAL, 64 * KIB, 0);
    let (w, _) = written(&p, 3);
    assert!(!w.iter().any(|&x| x));
}

#[test]
fn validate_rejects_bad_params() {
    let ok = memwrite(PATTERN_STRIDED, 64 * KIB, 50);
    assert_eq!(validate(&ok), Ok(()));
    for p in all_params() {
        assert_eq!(validate(&p), Ok(()), "{p:?}");
    }
    let bad = [
        (WorkloadParams { kind: 0, ..ok }, "unknown workload kind"),
        (WorkloadParams { kind: 99, ..ok }, "unknown workload kind"),
        (WorkloadParams { ws_bytes: 0, ..ok }, "nonzero"),
        (WorkloadParams { ws_bytes: 4096 + 8, ..ok }, "multiple of 4096"),
        (WorkloadParams { ws_bytes: 128 << 30, ..ok }, "larger"),
        (WorkloadParams { write_pct: 101, ..ok }, "write_pct"),
        (WorkloadParams { pattern: 4, ..ok }, "unknown pattern"),
        (WorkloadParams { stride: 0, ..ok }, "nonzero"),
        (WorkloadParams { stride: 12, ..ok }, "multiple of 8"),
        (WorkloadParams { stride: 64 * KIB, ..ok }, "smaller than ws_bytes"),
        (WorkloadParams { pattern: PATTERN_HOTCOLD, hot_pct: 0, ..ok }, "hot_pct"),
        (WorkloadParams { pattern: PATTERN_HOTCOLD, hot_pct: 101, ..ok }, "hot_pct"),
    ];
    for (p, msg) in bad {
        let err = validate(&p).unwrap_err();
        assert!(err.contains(msg), "{p:?}: {err}");
        let mut mem = zeroed(&ok);
        assert_eq!(Workload::new(&p, 0, &mut mem).err(), Some(err));
    }
    // The fields of the other patterns and kinds are ignored.
    assert_eq!(
        validate(&WorkloadParams { stride: 3, hot_pct: 500, ..memwrite(PATTERN_RANDOM, 4096, 0) }),
        Ok(())
    );
    assert_eq!(
        validate(&WorkloadParams {
            ws_bytes: 5,
            write_pct: 500,
            pattern: 9,
            ..kind(WORKLOAD_COMPUTE)
        }),
        Ok(())
    );
    // The memory slice must match ws_bytes.
    let mut mem = vec![0u64; 64 * 1024 / 8 - 1];
    assert!(Workload::new(&ok, 0, &mut mem).err().unwrap().contains("exactly ws_bytes"));
    let mut mem = vec![0u64; 64 * 1024 / 8 + 512];
    assert!(Workload::new(&ok, 0, &mut mem).is_err());
    assert!(Workload::new(&ok, 0, &mut []).is_err());
    // Other kinds ignore the slice.
    assert!(Workload::new(&kind(WORKLOAD_EXITS), 0, &mut []).is_ok());
}

#[test]
fn exits_makes_the_calls_and_folds_the_echoes() {
    let p = kind(WORKLOAD_EXITS);
    let mut plat = TestPlatform::default();
    let (good, ops) = run_with(&p, 0, 16, &mut plat, |_, _| {});
    for (r, &o) in ops.iter().enumerate() {
        assert_eq!(o, if r % 8 == 7 { 65 } else { 64 }, "round {r}");
    }
    assert_eq!((plat.ports, plat.mmios, plat.halts), (16 * 32, 16 * 32, 2));
    assert_eq!(ops.iter().sum::<u64>(), plat.ports + plat.mmios + plat.halts);

    let mut mem = [];
    let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
    let mut plat = TestPlatform::default();
    for _ in 0..16 {
        wl.round(&mut plat);
    }
    assert_eq!(wl.echo_mismatches(), 0);
    assert_eq!(wl.finish(), good);

    // One wrong value in 1000 calls (port or MMIO) changes the digest.
    for wrong in [1, 7, 8, 1000, 1023] {
        let mut mem = [];
        let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
        let mut plat = TestPlatform { wrong, ..Default::default() };
        for _ in 0..16 {
            wl.round(&mut plat);
        }
        assert!(wl.echo_mismatches() > 0);
        assert_ne!(wl.finish(), good, "wrong every {wrong}");
    }
}

#[test]
fn idle_halts_once_per_round() {
    let p = kind(WORKLOAD_IDLE);
    let mut plat = TestPlatform::default();
    let (_, ops) = run_with(&p, 0, 10, &mut plat, |_, _| {});
    assert_eq!(ops, vec![1; 10]);
    assert_eq!((plat.halts, plat.ports, plat.mmios), (10, 0, 0));
}

#[test]
fn compute_ops_are_iterations() {
    let p = kind(WORKLOAD_COMPUTE);
    let mut plat = TestPlatform::default();
    let (_, ops) = run_with(&p, 0, 2, &mut plat, |_, _| {});
    assert_eq!(ops, vec![COMPUTE_ITERS_PER_ROUND; 2]);
    assert_eq!((plat.halts, plat.ports, plat.mmios), (0, 0, 0));
}

#[test]
fn round_sizes() {
    for pat in PATTERNS {
        let big = memwrite(pat, 16 << 20, 50);
        let small = memwrite(pat, 64 * KIB, 50);
        let want = match pat {
            PATTERN_SEQUENTIAL => MEMWRITE_SEQUENTIAL_OPS_PER_ROUND,
            PATTERN_STRIDED => MEMWRITE_STRIDED_OPS_PER_ROUND,
            _ => MEMWRITE_RANDOM_OPS_PER_ROUND,
        };
        assert_eq!(written(&big, 1).1, want);
        assert_eq!(written(&small, 1).1, 8192);
    }
}

#[cfg(feature = "std")]
mod native {
    use super::*;
    use crate::native::{replay, run_for, NativePlatform};
    use std::time::Duration;

    #[test]
    fn replay_matches_the_engine() {
        for p in all_params() {
            let rounds = 9;
            let (d, ops) = run_with(&p, 5, rounds, &mut TestPlatform::default(), |_, _| {});
            // timer_hz high so idle/exits halts are short.
            let r = replay(&p, 5, rounds, 100_000).unwrap();
            assert_eq!(r.digest, d, "{p:?}");
            assert_eq!(r.rounds, rounds);
            assert_eq!(r.warmup_ops, ops[0]);
            assert_eq!(r.ops, ops[1..].iter().sum::<u64>());
        }
    }

    #[test]
    fn replay_edge_cases() {
        let p = memwrite(PATTERN_RANDOM, 64 * KIB, 50);
        let r = replay(&p, 0, 1, 0).unwrap();
        assert_eq!((r.rounds, r.warmup_ops, r.ops), (1, 16, 0));
        let r0 = replay(&p, 0, 0, 0).unwrap();
        assert_eq!((r0.rounds, r0.warmup_ops, r0.ops), (0, 0, 0));
        assert_ne!(r0.digest, r.digest);
        assert!(replay(&WorkloadParams { write_pct: 101, ..p }, 0, 3, 0).is_err());
    }

    #[test]
    fn run_for_runs_at_least_one_measured_round() {
        let p = memwrite(PATTERN_SEQUENTIAL, 64 * KIB, 100);
        let r = run_for(&p, 0, Duration::ZERO, 0).unwrap();
        assert!(r.rounds >= 2);
        assert_eq!(r.warmup_ops, 16);
        assert_eq!(r.ops, (r.rounds - 1) * 8192);
        // Its digest is the one a replay of as many rounds gives.
        assert_eq!(replay(&p, 0, r.rounds, 0).unwrap().digest, r.digest);
        let r = run_for(&kind(WORKLOAD_IDLE), 0, Duration::from_millis(5), 10_000).unwrap();
        assert!(r.rounds >= 2);
        assert_eq!(r.ops, r.rounds - 1);
        assert!(r.measured_ns > 0);
    }

    #[test]
    fn native_platform_echoes() {
        let mut p = NativePlatform::new(0);
        assert_eq!(p.port_echo(0x1234_5678), !0x1234_5678);
        assert_eq!(p.mmio_echo(u64::MAX - 3), u64::MAX - 3);
        p.halt();
        let mut p = NativePlatform::new(1_000_000);
        p.halt();
    }
}

#[test]
fn a_flipped_bit_in_a_written_word_fails_the_self_check_when_read() {
    // Read-only sequential rounds read every word within one pass of the
    // working set, so a flip in a written word is caught by the next pass.
    let p = memwrite(PATTERN_SEQUENTIAL, 64 * KIB, 0);
    for bit in [0, 1, 13, 31, 32, 47, 63] {
        let mut mem = zeroed(&p);
        let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
        let mut plat = TestPlatform::default();
        wl.round(&mut plat);
        wl.round(&mut plat);
        assert_eq!(wl.self_check_failures(), 0, "a clean run has no failures");
        let word = wl.mem.iter().position(|&x| x != 0).expect("warm-up wrote words");
        wl.mem[word] ^= 1 << bit;
        for _ in 0..4 {
            wl.round(&mut plat);
        }
        assert!(wl.self_check_failures() > 0, "flip of bit {bit} not detected");
    }
}

#[cfg(feature = "std")]
mod blkbench {
    use super::*;
    use crate::blk::{BLKBENCH_DISK_BYTES, BLKBENCH_WS_BYTES};
    use crate::native::{replay, NativePlatform};
    use nl_abi::WORKLOAD_BLKBENCH;

    fn params(seed: u64) -> WorkloadParams {
        WorkloadParams {
            kind: WORKLOAD_BLKBENCH,
            seed,
            ws_bytes: BLKBENCH_WS_BYTES,
            ..WorkloadParams::default()
        }
    }

    /// Runs `rounds` rounds on `plat`; returns the workload's digest, errors and op counts.
    fn run(
        p: &WorkloadParams,
        plat: &mut NativePlatform,
        rounds: u64,
    ) -> (u64, (u64, u64), [u64; 5]) {
        let mut mem = vec![0u64; (p.ws_bytes / 8) as usize];
        let mut wl = Workload::new(p, 0, &mut mem).unwrap();
        for _ in 0..rounds {
            wl.round(plat);
        }
        (wl.finish(), wl.blk_errors(), wl.blk_counts())
    }

    #[test]
    fn every_op_runs_and_every_read_verifies() {
        let p = params(3);
        let mut plat = NativePlatform::with_disk(0, BLKBENCH_DISK_BYTES);
        let (d, errors, counts) = run(&p, &mut plat, 400);
        assert_eq!(errors, (0, 0));
        assert!(counts.iter().all(|&c| c > 10), "{counts:?}");
        assert_eq!(replay(&p, 0, 400, 0).unwrap().digest, d);
        assert_ne!(replay(&params(4), 0, 400, 0).unwrap().digest, d);
    }

    #[test]
    fn a_corrupted_disk_is_detected() {
        let p = params(5);
        let mut plat = NativePlatform::with_disk(0, BLKBENCH_DISK_BYTES);
        let (clean, _, _) = run(&p, &mut plat, 30);
        // A disk that fails every request: every request counts as an I/O error.
        let mut broken = NativePlatform::new(0);
        let (d, (_, io), _) = run(&p, &mut broken, 30);
        assert!(io > 0);
        assert_ne!(d, clean);
    }

    #[test]
    fn wrong_working_set_is_rejected() {
        assert!(validate(&WorkloadParams { ws_bytes: 4096, ..params(1) }).is_err());
        let mut mem = vec![0u64; 16];
        assert!(Workload::new(&params(1), 0, &mut mem).is_err());
    }
}

#[test]
fn a_warm_up_in_pieces_equals_round_zero() {
    for pat in PATTERNS {
        let p = memwrite(pat, 64 * KIB, 50);
        let mut whole = zeroed(&p);
        let mut pieces = zeroed(&p);
        let (d1, d2) = {
            let mut a = Workload::new(&p, 3, &mut whole).unwrap();
            let mut b = Workload::new(&p, 3, &mut pieces).unwrap();
            let mut plat = TestPlatform::default();
            let ops_a = a.round(&mut plat);
            let mut steps = 0;
            let ops_b = loop {
                steps += 1;
                if let Some(ops) = b.warm_up_step(&mut plat, 3) {
                    break ops;
                }
            };
            assert!(steps > 1, "the warm-up must really come in pieces");
            assert_eq!(ops_a, ops_b);
            assert_eq!(b.rounds_done(), 1);
            for _ in 0..3 {
                assert_eq!(a.round(&mut plat), b.round(&mut plat));
            }
            (a.finish(), b.finish())
        };
        assert_eq!(d1, d2, "pattern {pat}");
        assert_eq!(whole, pieces);
    }
}

#[cfg(feature = "std")]
mod filecache {
    use super::*;
    use crate::filecache::{disk_bytes, ws_bytes_for, BLOCK_BYTES, BLOCK_WORDS, DATA_OFFSET};
    use crate::native::{replay, NativePlatform};
    use nl_abi::WORKLOAD_FILECACHE;

    const BLOCKS: u64 = 64;

    fn params(seed: u64, ws_bytes: u64, hot_pct: u64) -> WorkloadParams {
        WorkloadParams {
            kind: WORKLOAD_FILECACHE,
            seed,
            ws_bytes,
            hot_pct,
            data_bytes: BLOCKS * BLOCK_BYTES,
            ..WorkloadParams::default()
        }
    }

    fn whole(seed: u64) -> WorkloadParams {
        params(seed, ws_bytes_for(BLOCKS * BLOCK_BYTES), 10)
    }

    struct Run {
        digest: u64,
        warmup_ops: u64,
        ops: u64,
        found: bool,
        hits: u64,
        misses: u64,
        errors: (u64, u64),
    }

    /// Runs `rounds` rounds on `plat`, calling `tamper(mem)` after round `at`.
    fn run_tamper(
        p: &WorkloadParams,
        plat: &mut NativePlatform,
        rounds: u64,
        at: u64,
        mut tamper: impl FnMut(&mut [u64], &mut NativePlatform),
    ) -> Run {
        let mut mem = vec![0u64; (p.ws_bytes / 8) as usize];
        let mut wl = Workload::new(p, 0, &mut mem).unwrap();
        let warmup_ops = wl.round(plat);
        let mut ops = 0;
        for r in 1..rounds {
            ops += wl.round(plat);
            if r == at {
                tamper(wl.mem, plat);
            }
        }
        let (hits, misses) = wl.cache_counts();
        let (found, errors) = (wl.cache_data_found(), wl.blk_errors());
        Run { digest: wl.finish(), warmup_ops, ops, found, hits, misses, errors }
    }

    fn run(p: &WorkloadParams, plat: &mut NativePlatform, rounds: u64) -> Run {
        run_tamper(p, plat, rounds, u64::MAX, |_, _| {})
    }

    fn disk() -> NativePlatform {
        NativePlatform::with_disk(0, disk_bytes(BLOCKS * BLOCK_BYTES))
    }

    #[test]
    fn every_request_is_served_verified_and_replays() {
        let p = whole(3);
        let r = run(&p, &mut disk(), 2000);
        assert_eq!(r.errors, (0, 0));
        assert_eq!(r.hits + r.misses, 1999);
        assert_eq!(r.ops, 1999 * BLOCK_BYTES);
        assert_eq!(r.warmup_ops, BLOCKS * BLOCK_BYTES);
        // The whole data set fits: every block misses at most once.
        assert!(r.misses <= BLOCKS, "{} misses", r.misses);
        assert!(r.hits > 1800);
        let rep = replay(&p, 0, 2000, 0).unwrap();
        assert_eq!(
            (rep.digest, rep.ops, rep.warmup_ops, rep.cache_hits, rep.cache_misses),
            (r.digest, r.ops, r.warmup_ops, r.hits, r.misses)
        );
        assert_ne!(replay(&whole(4), 0, 2000, 0).unwrap().digest, r.digest);
        assert_ne!(replay(&p, 0, 1999, 0).unwrap().digest, r.digest);
    }

    #[test]
    fn the_digest_does_not_depend_on_whether_the_disk_held_the_data_set() {
        let p = whole(5);
        let mut d = disk();
        let blank = run(&p, &mut d, 500);
        assert!(!blank.found);
        // The same disk again (a rebooted guest): nothing is written, same result.
        let again = run(&p, &mut d, 500);
        assert!(again.found);
        assert_eq!(
            (again.digest, again.ops, again.warmup_ops, again.hits, again.misses),
            (blank.digest, blank.ops, blank.warmup_ops, blank.hits, blank.misses)
        );
        // A disk holding another seed's data set is rewritten, same result.
        let mut other = disk();
        run(&whole(6), &mut other, 10);
        let rewritten = run(&p, &mut other, 500);
        assert!(!rewritten.found);
        assert_eq!(rewritten.digest, blank.digest);
        // A fresh in-memory disk (host replay) agrees as well.
        assert_eq!(replay(&p, 0, 500, 0).unwrap().digest, blank.digest);
    }

    #[test]
    fn a_warm_up_in_pieces_equals_round_zero() {
        let p = whole(7);
        let (mut a_mem, mut b_mem) =
            (vec![0u64; (p.ws_bytes / 8) as usize], vec![0u64; (p.ws_bytes / 8) as usize]);
        let mut a = Workload::new(&p, 0, &mut a_mem).unwrap();
        let mut b = Workload::new(&p, 0, &mut b_mem).unwrap();
        let (mut da, mut db) = (disk(), disk());
        let ops_a = a.round(&mut da);
        let mut steps = 0;
        let ops_b = loop {
            steps += 1;
            assert!(steps < 1000);
            if let Some(ops) = b.warm_up_step(&mut db, 5) {
                break ops;
            }
        };
        assert!(steps > 10, "the data set must be written in pieces ({steps})");
        assert_eq!((ops_a, b.rounds_done()), (ops_b, 1));
        for _ in 0..300 {
            assert_eq!(a.round(&mut da), b.round(&mut db));
        }
        assert_eq!(a.cache_counts(), b.cache_counts());
        assert_eq!(a.finish(), b.finish());
    }

    /// The cache's tags and map (as laid out in the working set) agree:
    /// every cached block's map entry names a slot whose tag names it.
    fn consistent(mem: &[u64], slots: usize) -> usize {
        let tags = &mem[slots * BLOCK_WORDS..slots * BLOCK_WORDS + slots];
        let map = &mem[slots * BLOCK_WORDS + slots..][..BLOCKS as usize];
        let mut cached = 0;
        for (b, &m) in map.iter().enumerate() {
            if m != 0 {
                cached += 1;
                assert_eq!(tags[m as usize - 1] & !(1 << 63), b as u64 + 1);
            }
        }
        for &t in tags {
            let t = t & !(1 << 63);
            if t != 0 {
                assert_eq!(
                    map[t as usize - 1] as usize,
                    tags.iter().position(|&x| x & !(1 << 63) == t).unwrap() + 1
                );
            }
        }
        cached
    }

    #[test]
    fn a_small_cache_evicts_and_stays_consistent() {
        // 8 slots for 64 blocks, hot set of 6 blocks (10%).
        let slots = 8u64;
        let ws = ((slots * (BLOCK_WORDS as u64 + 1) + BLOCKS) * 8).div_ceil(4096) * 4096;
        let p = params(9, ws, 10);
        let mut mem = vec![0u64; (p.ws_bytes / 8) as usize];
        let mut wl = Workload::new(&p, 0, &mut mem).unwrap();
        assert_eq!(wl.cache_slots(), slots as usize);
        let mut plat = disk();
        wl.round(&mut plat);
        for i in 0..3000 {
            wl.round(&mut plat);
            if i % 97 == 0 {
                assert!(consistent(wl.mem, slots as usize) <= slots as usize);
            }
        }
        let (hits, misses) = wl.cache_counts();
        assert_eq!(wl.blk_errors(), (0, 0));
        assert_eq!(hits + misses, 3000);
        assert!(misses > BLOCKS, "the cache must have evicted ({misses} misses)");
        // CLOCK keeps most of the hot set: far more hits than the 8/64 a
        // uniform cache would give.
        assert!(hits > 3000 / 2, "{hits} hits");
        assert_eq!(consistent(wl.mem, slots as usize), slots as usize);
        let d = wl.finish();
        let rep = replay(&p, 0, 3001, 0).unwrap();
        assert_eq!((rep.digest, rep.cache_hits, rep.cache_misses), (d, hits, misses));
    }

    #[test]
    fn corrupted_disk_or_cache_is_detected() {
        let p = whole(11);
        let clean = run(&p, &mut disk(), 400);
        // A block overwritten on the disk after the warm-up: read on its miss.
        let mut plat = disk();
        let bad = run_tamper(&p, &mut plat, 400, 1, |_, plat| {
            let junk = vec![0x5au64; BLOCK_WORDS];
            for b in 0..BLOCKS {
                assert!(plat.blk_write((DATA_OFFSET + b * BLOCK_BYTES) / 512, &junk));
            }
        });
        assert!(bad.errors.0 > 0);
        assert_ne!(bad.digest, clean.digest);
        // A bit flipped in a cached block: caught on its next hit.
        let bad = run_tamper(&p, &mut disk(), 400, 300, |mem, _| {
            for slot in 0..BLOCKS as usize {
                mem[slot * BLOCK_WORDS + 17] ^= 1 << 5;
            }
        });
        assert!(bad.errors.0 > 0);
        assert_ne!(bad.digest, clean.digest);
        // A disk that fails every request.
        let broken = run(&p, &mut NativePlatform::new(0), 50);
        assert!(broken.errors.1 > 0);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let ok = whole(1);
        assert!(validate(&ok).is_ok());
        for (p, what) in [
            (WorkloadParams { data_bytes: 0, ..ok }, "data_bytes"),
            (WorkloadParams { data_bytes: BLOCK_BYTES + 512, ..ok }, "data_bytes"),
            (WorkloadParams { data_bytes: 32 << 30, ..ok }, "16 GiB"),
            (WorkloadParams { ws_bytes: 4096, ..ok }, "too small"),
            (WorkloadParams { ws_bytes: 4097, ..ok }, "4096"),
            (WorkloadParams { hot_pct: 0, ..ok }, "hot_pct"),
            (WorkloadParams { hot_pct: 101, ..ok }, "hot_pct"),
        ] {
            let e = validate(&p).unwrap_err();
            assert!(e.contains(what), "{e} for {p:?}");
        }
        let mut mem = vec![0u64; 16];
        assert!(Workload::new(&ok, 0, &mut mem).is_err());
    }
}
