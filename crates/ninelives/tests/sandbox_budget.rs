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
