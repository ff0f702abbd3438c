//! The numbers of the papers ninelives reproduces, quoted from their text
//! (`/work/shared/papers/`), each with the table, figure or section it is
//! from. A number the papers give only as a bar or a curve (not in the
//! text) is not here: its row says so instead of guessing it off a plot.

/// Which way is better for a quantity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
    /// No better direction (a share of outcomes that is neither good nor
    /// bad, such as non-manifested faults): the row gives the ratio only.
    Neither,
}

/// One number quoted from a paper.
#[derive(Clone, Copy, Debug)]
pub struct Quoted {
    pub value: f64,
    /// How the paper states it (units, "over", "±").
    pub text: &'static str,
    /// Where: "Table I", "Fig. 2 (text, §VII-A)", ...
    pub cite: &'static str,
}

const fn q(value: f64, text: &'static str, cite: &'static str) -> Quoted {
    Quoted { value, text, cite }
}

pub const NILIHYPE: &str = "NiLiHype: microreset hypervisor recovery (Zhou and Tamir, DSN 2018)";
pub const WARM: &str = "Warm-VM reboot for VMM rejuvenation (Kourai and Chiba, DSN 2007)";
pub const UCKPT: &str =
    "VM-μCheckpoint: in-memory checkpointing (Wang, Kalbarczyk, Iyer, DSN 2010)";
pub const HBFT: &str =
    "HBFT: optimizing primary/backup memory tracking (Zhu et al., IEEE TPDS 2011)";
pub const QUESTV: &str = "Quest-V: a virtualized multikernel (Li, West, Missimer, 2011)";

// NiLiHype.
/// Table I, 1AppVM, 1000 fail-stop faults per row: recovery rate with no enhancement.
pub const NILI_T1_BASIC: Quoted = q(0.0, "0%", "Table I, \"Basic\"");
/// Table I with every enhancement.
pub const NILI_T1_ALL: Quoted = q(0.961, "96.1% ± 1.2%", "Table I, all enhancements");
/// The intermediate rows of Table I, each with the `--repairs` set of
/// ninelives that corresponds to it (cumulative, in the table's order:
/// the IRQ count is our device-access depth and held-lock counters,
/// ReHype's mechanisms are releasing locks and retrying the interrupted
/// exit, then scheduling metadata, then timers; "all" adds the memory check,
/// our page-frame check) and the report step that measures it.
pub const NILI_T1_STEPS: [(&str, &str, &str, Quoted); 4] = [
    (
        "+ Clear IRQ count",
        "counters",
        "inject-failstop-microreset-counters",
        q(0.160, "16.0% ± 2.3%", "Table I"),
    ),
    (
        "+ ReHype mechanisms",
        "counters,locks,retry",
        "inject-failstop-microreset-rehype",
        q(0.518, "51.8% ± 3.1%", "Table I"),
    ),
    (
        "+ scheduling metadata consistency",
        "counters,locks,retry,metadata",
        "inject-failstop-microreset-metadata",
        q(0.822, "82.2% ± 2.4%", "Table I"),
    ),
    (
        "+ reprogram hardware timer",
        "counters,locks,retry,metadata,timers",
        "inject-failstop-microreset-timers",
        q(0.950, "95.0% ± 1.4%", "Table I"),
    ),
];
/// Fig. 2, 3AppVM: NiLiHype's recovery rate ("over 88%", §I and §IX; the
/// per-fault-type bars are not in the text).
pub const NILI_F2_MICRORESET: Quoted =
    q(0.88, "over 88% (all fault types)", "Fig. 2 (text: §I, §IX)");
/// Fig. 2: ReHype's ("over 90%").
pub const NILI_F2_MICROREBOOT: Quoted = q(0.90, "over 90% (all fault types)", "Fig. 2 (text: §I)");
/// §VII-A with Fig. 2: outcome breakdown of register faults.
pub const NILI_REG_OUTCOMES: [Quoted; 3] = [
    q(0.748, "74.8% non-manifested", "§VII-A (with Fig. 2)"),
    q(0.056, "5.6% SDC", "§VII-A (with Fig. 2)"),
    q(0.196, "19.6% detected", "§VII-A (with Fig. 2)"),
];
/// The same for code faults.
pub const NILI_CODE_OUTCOMES: [Quoted; 3] = [
    q(0.350, "35.0% non-manifested", "§VII-A (with Fig. 2)"),
    q(0.121, "12.1% SDC", "§VII-A (with Fig. 2)"),
    q(0.529, "52.9% detected", "§VII-A (with Fig. 2)"),
];
/// Table II: ReHype (microreboot) recovery latency.
pub const NILI_T2_REHYPE_MS: Quoted = q(713.0, "713 ms", "Table II, §VII-B");
/// Table III: NiLiHype (microreset) recovery latency.
pub const NILI_T3_NILIHYPE_MS: Quoted = q(22.0, "22 ms", "Table III, §VII-B");
/// §VII-B: microreboot latency over microreset latency.
pub const NILI_FACTOR: Quoted = q(30.0, "over 30x", "§VII-B, abstract");
/// Fig. 3: normal-operation overhead; the bars (hypervisor cycles) are
/// not in the text, the text bounds the total-CPU overhead.
pub const NILI_F3_OVERHEAD: Quoted =
    q(1.01, "under 1% of total CPU cycles", "Fig. 3 (text: §VII-C, §IX)");

// Warm-VM reboot.
/// Fig. 8(a): file-read throughput just after a cold-VM reboot, relative
/// to just before ("degraded by 91%").
pub const WARM_F8_COLD: Quoted = q(0.09, "degraded by 91% (0.09 of before)", "Fig. 8(a), §5.5");
/// Fig. 8(a): warm-VM reboot "was not degraded".
pub const WARM_F8_WARM: Quoted = q(1.0, "not degraded (1.0 of before)", "Fig. 8(a), §5.5");
/// §5.6: resume(n) = 0.43n − 0.07 (seconds): the warm reboot's per-VM cost.
pub const WARM_56_RESUME_PER_VM_MS: Quoted = q(430.0, "resume(n) = 0.43n − 0.07 s", "§5.6");
/// §5.6: boot(n) = 3.4n + 2.8 (seconds): the cold reboot's per-VM boot cost.
pub const WARM_56_BOOT_PER_VM_MS: Quoted = q(3400.0, "boot(n) = 3.4n + 2.8 s", "§5.6");
/// §8: "reduced the downtime by 83% at maximum".
pub const WARM_REDUCTION: Quoted = q(0.83, "83% at maximum", "§8 (conclusion)");
/// §6: downtime with 11 VMs, warm and cold.
pub const WARM_11VM_WARM_MS: Quoted = q(42_000.0, "42 s (11 VMs)", "§6");
pub const WARM_11VM_COLD_MS: Quoted = q(241_000.0, "241 s (11 VMs, JBoss)", "§6");

// VM-μCheckpoint.
/// Fig. 3: SPEC CINT 2006 execution time with CoW-P at 50 ms (6.3% overhead).
pub const UCK_F3_50MS: Quoted = q(1.063, "6.3% average overhead (1.063)", "Fig. 3, §V.B, abstract");
/// Fig. 4: Apache throughput at 50 ms, CoW-P and CoW-B.
pub const UCK_F4_COWP: Quoted = q(0.825, "82.5% of baseline", "Fig. 4, §V.B b)");
pub const UCK_F4_COWB: Quoted = q(0.743, "74.3% of baseline", "Fig. 4, §V.B b)");
/// §IV and §V.B: CoW-P's page-fault reduction at 50 ms.
pub const UCK_FAULT_REDUCTION: Quoted = q(75.0, "75% fewer page faults", "§IV, §V.B b)");
/// §V.B c): average checkpoint size at 50 ms, CoW-P (share of system state).
pub const UCK_SIZE_50MS: Quoted = q(1.27, "654.5 pages, 2.6 MB of 206 MB (1.3%)", "§V.B c)");
/// §V.B c): at 1000 ms.
pub const UCK_SIZE_1000MS: Quoted = q(4.2, "2162.4 pages, 8.6 MB (4.2%)", "§V.B c)");
/// §V.C: rollback (recovery) time.
pub const UCK_ROLLBACK_MS: Quoted = q(639.4, "639.4 ms ± 193.1 ms (144–1017 ms)", "§V.C");

// HBFT.
/// Fig. 9: CINT under unoptimized HBFT, relative to the native VM.
pub const HBFT_F9_NONE: Quoted = q(0.30, "about 30% of native VM (CINT)", "Fig. 9, §5.2");
/// Fig. 9: all optimizations, "about 60 percent of that of the native VM".
pub const HBFT_F9_OPT: Quoted = q(0.60, "about 60% of native VM", "Fig. 9, §5.2");
/// Fig. 9: improvement factor of the optimizations.
pub const HBFT_F9_FACTOR: Quoted = q(1.4, "1.4x to 2.2x", "Fig. 9, §5.2");
/// Fig. 10: log-dirty mode alone, OriginXen: degradation 19.8% (CFP) to
/// 57.4% (SPECweb); WFPXen: SPECjbb "nearly 95%".
pub const HBFT_F10_WORST: Quoted =
    q(0.426, "57.4% degradation (SPECweb, OriginXen)", "Fig. 10, §5.3.2");
pub const HBFT_F10_BEST: Quoted = q(0.95, "nearly 95% (SPECjbb, WFPXen)", "Fig. 10, §5.3.2");
/// Fig. 12: Histase on CFP: recall 68.5%, false predictions 29.3%.
pub const HBFT_F12_RECALL: Quoted =
    q(0.685, "68.5% of write faults predicted (CFP)", "Fig. 12, §5.3.2");
pub const HBFT_F12_PRECISION: Quoted =
    q(0.707, "29.3% false predictions (CFP): precision 0.707", "Fig. 12, §5.3.2");
/// Table 2: software superpage mapping hit ratio ("over 97 percent").
pub const HBFT_T2_HIT: Quoted = q(0.97, "over 97% (most workloads)", "Table 2, §5.4");

// Quest-V.
/// Table 2: forkwait, Quest-V / Quest CPU cycles (9.20e9 / 9.03e9).
pub const QV_T2_RATIO: Quoted =
    q(9.20 / 9.03, "9.20E+09 / 9.03E+09 cycles (1.019)", "Table 2, §4.2");
/// Table 3: ping round trip, Quest-V / Quest (5742 / 5737 ms).
pub const QV_T3_RATIO: Quoted = q(5742.0 / 5737.0, "5742 / 5737 ms (1.001)", "Table 3, §4.4");
/// Fig. 6: the web server back to steady state after its NIC driver failed.
pub const QV_F6_RECOVERY: Quoted =
    q(0.5, "steady state in less than 0.5 s after the driver failure (web server)", "Fig. 6, §4.1");
/// Fig. 9: "Quest-V Hi", the message-passing VCPUs' budget.
pub const QV_F9_BUDGET: Quoted =
    q(0.5, "VCPUs of 50% utilization (100 ms period) for Quest-V Hi", "Fig. 9, §4.5");
/// Fig. 10: the other sandboxes unaffected by the faulty one.
pub const QV_F10_ISOLATION: Quoted = q(1.0, "all other sandboxes unaffected", "Fig. 10, §4.6");
