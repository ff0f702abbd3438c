//! CPU budgets: a sandbox with a budget runs its vCPU threads in a cgroup
//! of its own whose CFS quota is the budget, the budget holds it back
//! (throttled periods counted), it still completes and verifies, and the
//! cgroup is gone after the set.

use crate::common;

use std::time::Duration;

use common::kvm_available;
use nl_sandbox::{SandboxSet, SetConfig};
use nl_vmm::VmOutcome;

#[test]
fn a_budget_caps_the_sandbox_and_is_removed_with_it() {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let cores = nl_sandbox::affinity::host_cores().expect("affinity");
    let (c0, c1) = (cores[0], *cores.last().unwrap());
    // 1 ms of every 100 ms: a compute loop wants far more under any load.
    let text = format!(
        r#"{{"sandboxes": [
        {{"name": "capped", "cores": [{c0}], "workload": {{"kind": "compute", "duration_ms": 1000}},
          "budget": {{"runtime_us": 1000, "period_us": 100000}}}},
        {{"name": "free", "cores": [{c1}], "workload": {{"kind": "compute", "duration_ms": 1000}}}}]}}"#
    );
    // A host killed before it removed its budget's cgroup left one behind
    // (its pid gone): the next budget removes it (a reserved one would
    // otherwise keep its real-time runtime and refuse every reservation).
    let dead = {
        let mut c = std::process::Command::new("true").spawn().expect("spawn true");
        c.wait().expect("wait");
        c.id()
    };
    let stale = format!("/sys/fs/cgroup/cpu/ninelives-{dead}-stale");
    std::fs::create_dir(&stale).expect("a stale cgroup");
    let kvm = nl_vmm::open_kvm().expect("kvm");
    let set = SandboxSet::create(&kvm, SetConfig::parse(&text).unwrap(), &common::sandbox_images())
        .expect("set");
    set.start_all().expect("start");
    let swept = !std::path::Path::new(&stale).exists();
    let _ = std::fs::remove_dir(&stale);
    assert!(swept, "the stale cgroup {stale} of a gone process was left");
    let dir = format!("/sys/fs/cgroup/cpu/ninelives-{}-capped", std::process::id());
    let tasks = std::fs::read_to_string(format!("{dir}/tasks")).expect("the budget's cgroup");
    let tids: Vec<i32> =
        set.get("capped").unwrap().vm().vcpu_threads().iter().flatten().map(|t| t.tid).collect();
    assert_eq!(tasks.lines().map(|l| l.parse::<i32>().unwrap()).collect::<Vec<_>>(), tids);
    let quota = std::fs::read_to_string(format!("{dir}/cpu.cfs_quota_us")).unwrap();
    assert_eq!(quota.trim(), "1000");
    let period = std::fs::read_to_string(format!("{dir}/cpu.cfs_period_us")).unwrap();
    assert_eq!(period.trim(), "100000");
    assert!(!std::path::Path::new(&format!(
        "/sys/fs/cgroup/cpu/ninelives-{}-free",
        std::process::id()
    ))
    .exists());

    let r = set.supervise(Duration::from_secs(300));
    for s in &r.sandboxes {
        assert_eq!(s.outcome, VmOutcome::Completed, "{}: {}", s.name, s.message);
        assert!(s.verified, "{}: {:?}", s.name, s.problem);
    }
    let t = r.sandboxes[0].throttling.expect("the capped sandbox reports its throttling");
    assert!(t.throttled_periods > 0, "the budget never held it back: {t:?}");
    assert!(r.sandboxes[1].throttling.is_none());
    drop(set);
    assert!(!std::path::Path::new(&dir).exists(), "the budget's cgroup outlived its set");
}

/// A `rollback` sandbox's budget: its checkpoint supervisor starts the VM,
/// and after each rollback fresh vCPU threads, and every time those
/// threads join the budget's cgroup (before, a `rollback` sandbox ran
/// without its budget). A spin written over its code is found by the
/// hang detector and rolled back; the relaunched threads are in the
/// cgroup, the budget held it back, and it completes, verified.
#[test]
fn a_rollback_sandbox_runs_under_its_budget_after_each_rollback_too() {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let c0 = nl_sandbox::affinity::host_cores().expect("affinity")[0];
    let text = format!(
        r#"{{"sandboxes": [
        {{"name": "rb", "cores": [{c0}], "workload": {{"kind": "compute", "duration_ms": 4000}},
          "recovery": {{"policy": "rollback", "checkpoint_interval_ms": 20}},
          "detect": {{"heartbeat_cpu_ms": 200}},
          "budget": {{"runtime_us": 10000, "period_us": 20000}}}}]}}"#
    );
    let kvm = nl_vmm::open_kvm().expect("kvm");
    let set = SandboxSet::create(&kvm, SetConfig::parse(&text).unwrap(), &common::sandbox_images())
        .expect("set");
    set.start_all().expect("start");
    let dir = format!("/sys/fs/cgroup/cpu/ninelives-{}-rb", std::process::id());
    let in_cgroup = || {
        let tasks = std::fs::read_to_string(format!("{dir}/tasks")).unwrap_or_default();
        let tasks: Vec<i32> = tasks.lines().filter_map(|l| l.parse().ok()).collect();
        let tids: Vec<i32> =
            set.get("rb").unwrap().vm().vcpu_threads().iter().flatten().map(|t| t.tid).collect();
        !tids.is_empty() && tids.iter().all(|t| tasks.contains(t))
    };
    let r = std::thread::scope(|scope| {
        let h = scope.spawn(|| set.supervise(Duration::from_secs(300)));
        let rb = set.get("rb").unwrap();
        common::wait_for(
            "the vCPU threads in the budget's cgroup",
            Duration::from_secs(30),
            &in_cgroup,
        );
        let first = rb.vm().vcpu_threads()[0].as_ref().map(|t| t.tid);
        common::wait_for("the spin written", Duration::from_secs(30), || {
            set.inject("rb", &nl_checkpoint::inject::GuestFault::Spin { cpu: 0 }).is_ok()
        });
        common::wait_or(
            "fresh vCPU threads (a rollback) in the cgroup",
            Duration::from_secs(30),
            || rb.vm().vcpu_threads()[0].as_ref().map(|t| t.tid) != first && in_cgroup(),
            || {
                format!(
                    "first {first:?}, now {:?}, cgroup {:?}, outcome {:?}, recoveries {:?}",
                    rb.vm().vcpu_threads(),
                    std::fs::read_to_string(format!("{dir}/tasks")),
                    rb.vm().poll_outcome(),
                    rb.monitor.recovery_count()
                )
            },
        );
        h.join().expect("supervision")
    });
    let s = &r.sandboxes[0];
    assert_eq!(s.outcome, VmOutcome::Completed, "{}: {}", s.name, s.message);
    assert!(s.verified, "{:?}", s.problem);
    assert!(!s.recoveries.is_empty(), "no rollback");
    assert!(s.recoveries.iter().all(|r| r.policy == "rollback" && r.ok), "{:?}", s.recoveries);
    let t = s.throttling.expect("the rollback sandbox reports its throttling");
    assert!(t.throttled_periods > 0, "the budget never held it back: {t:?}");
}
