//! The VMM's self-test fault points, in one place: environment variables
//! that make a `ninelives host` fail on purpose, so the tests and the
//! benches can check each detector and recovery end to end. Unset, none of
//! them does anything. [`arm_from_env`] arms the ones the host process
//! itself runs; the others are read where their fault is raised (named in
//! the table).
//!
//! | variable | value | effect | read in |
//! | --- | --- | --- | --- |
//! | `NINELIVES_DETECT_SELFTEST` | `segv`, `panic`, `hang` | a thread of the host fails that way 200 ms after start (each detector end to end) | [`arm_from_env`] |
//! | `NINELIVES_DEVICE_FAULT` | `KIND[:N]`, `KIND@MS` (KIND: `segv`, `panic`, `hang`, `syscall`) | the N-th device access (default 1000) fails inside the device with its lock held; `@MS`: the first access after MS ms (`bench recovery`) | [`arm_from_env`] |
//! | `NINELIVES_API_FAULT` | `segv[:N]`, `panic[:N]` | the API connection that reads the N-th request (default 1) fails once it has read it | [`arm_from_env`] |
//! | `NINELIVES_FAULT_IN_RECOVERY` | any; `other` | every recovery crashes while it holds the VMM; `other`: the API's accept loop crashes as a recovery starts | `recovery` |
//! | `NINELIVES_HANDOVER_SELFTEST` | `refuse-state` | the new process of a rejuvenation refuses the VM states it is handed | `handover` |
//! | `NINELIVES_HANDOVER_SELFTEST` | `corrupt-sets` | the new process of a rejuvenation or microreboot reads every sandbox set record corrupted (its `vms` replaced) | `carry` |
//!
//! `syscall` is a system call no VMM thread's seccomp filter allows (a
//! harmless `personality` query), so it exercises the seccomp detector.
//!
//! Not fault points, but the other `NINELIVES_*` variables the VMM reads:
//! `NINELIVES_KVM_DEVICE` ([`crate::KVM_DEVICE_ENV`], another path for
//! /dev/kvm), `NINELIVES_INJECTOR_REPAIR_FLAG`
//! ([`crate::recovery::INJECTOR_REPAIR_ENV`], set by the fault injector)
//! and `NINELIVES_IMAGE_DIR` (where save-restore rejuvenation writes its
//! images).

use std::time::Duration;

pub const DETECT_SELFTEST_ENV: &str = "NINELIVES_DETECT_SELFTEST";
pub const DEVICE_FAULT_ENV: &str = "NINELIVES_DEVICE_FAULT";
pub const API_FAULT_ENV: &str = "NINELIVES_API_FAULT";
/// Set, every recovery crashes while it holds the VMM; set to `other`, the
/// API's accept loop crashes as a recovery starts.
pub const FAULT_IN_RECOVERY_ENV: &str = "NINELIVES_FAULT_IN_RECOVERY";
pub const HANDOVER_SELFTEST_ENV: &str = "NINELIVES_HANDOVER_SELFTEST";

/// Arms the fault points the host process runs itself (see the table).
pub fn arm_from_env() {
    detect_selftest();
    device_fault();
    api_fault();
}

/// True when the handover self-test asks the new process to refuse the
/// VM states.
pub fn handover_refuses_state() -> bool {
    std::env::var_os(HANDOVER_SELFTEST_ENV).is_some_and(|v| v == "refuse-state")
}

/// True when the handover self-test corrupts the sandbox set records the
/// new process reads.
pub fn handover_corrupts_sets() -> bool {
    std::env::var_os(HANDOVER_SELFTEST_ENV).is_some_and(|v| v == "corrupt-sets")
}

/// The failure a fault point runs: `segv`, `panic`, `hang` or `syscall`.
fn fault_hook(kind: &str) -> Option<fn()> {
    match kind {
        // SAFETY: raising a signal on the calling thread has no memory effects.
        "segv" => Some(|| unsafe {
            libc::raise(libc::SIGSEGV);
        }),
        "panic" => Some(|| panic!("fault self-test")),
        // SAFETY: personality(0xffffffff) only reads the process's persona.
        "syscall" => Some(|| unsafe {
            libc::personality(0xffff_ffff);
        }),
        "hang" => Some(|| loop {
            std::hint::spin_loop();
        }),
        _ => None,
    }
}

/// When a device fault fires.
#[derive(Debug, PartialEq, Eq)]
enum Trigger {
    /// On the N-th access.
    Count(u64),
    /// On the first access after this long.
    After(Duration),
}

/// `KIND[:N]` or `KIND@MS` → (kind, trigger); `default` is N when absent.
fn parse_fault(v: &str, default: u64) -> (&str, Trigger) {
    if let Some((kind, ms)) = v.split_once('@') {
        return (kind, Trigger::After(Duration::from_millis(ms.parse().unwrap_or(1000))));
    }
    match v.split_once(':') {
        Some((kind, n)) => (kind, Trigger::Count(n.parse().unwrap_or(default))),
        None => (v, Trigger::Count(default)),
    }
}

fn api_fault() {
    let Ok(v) = std::env::var(API_FAULT_ENV) else { return };
    let (kind, trigger) = parse_fault(&v, 1);
    let Some(hook) = fault_hook(kind).filter(|_| kind != "hang") else { return };
    if let Trigger::Count(n) = trigger {
        crate::api::arm_fault_hook(n, hook);
    }
}

fn device_fault() {
    let Ok(v) = std::env::var(DEVICE_FAULT_ENV) else { return };
    let (kind, trigger) = parse_fault(&v, 1000);
    let Some(hook) = fault_hook(kind) else { return };
    match trigger {
        Trigger::After(d) => {
            let _ = std::thread::Builder::new().name("fault-timer".into()).spawn(move || {
                std::thread::sleep(d);
                nl_devices::bus::arm_fault_hook(1, hook);
            });
        }
        Trigger::Count(n) => nl_devices::bus::arm_fault_hook(n, hook),
    }
}

fn detect_selftest() {
    let Ok(what) = std::env::var(DETECT_SELFTEST_ENV) else { return };
    let _ = std::thread::Builder::new().name("selftest".into()).spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        match what.as_str() {
            // SAFETY: raising a signal on the calling thread has no memory effects.
            "segv" => unsafe {
                libc::raise(libc::SIGSEGV);
            },
            "panic" => panic!("detector self-test"),
            "hang" => {
                let _p = crate::detect::track();
                loop {
                    std::hint::spin_loop();
                }
            }
            _ => {}
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_values_parse() {
        assert_eq!(parse_fault("segv", 1000), ("segv", Trigger::Count(1000)));
        assert_eq!(parse_fault("panic:3", 1), ("panic", Trigger::Count(3)));
        assert_eq!(
            parse_fault("segv@2500", 1),
            ("segv", Trigger::After(Duration::from_millis(2500)))
        );
        assert_eq!(parse_fault("hang:x", 7), ("hang", Trigger::Count(7)));
        assert!(fault_hook("segv").is_some() && fault_hook("syscall").is_some());
        assert!(fault_hook("bogus").is_none());
    }
}
