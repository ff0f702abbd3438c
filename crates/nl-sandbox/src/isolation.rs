//! The isolation check: one sandbox runs `wildwrite` beside another that is
//! paused, and everything the other owns is compared byte for byte.

use std::io::{Read, Seek};
use std::time::Duration;

use nl_vmm::VmOutcome;

use crate::set::{Images, SandboxSet};
use crate::{SandboxError, SetConfig};

/// What one wildwrite run did to its neighbour.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WildwriteResult {
    pub seed: u64,
    /// Bytes of the neighbour's RAM and of its channel region that differ
    /// after the run (must be 0).
    pub changed_bytes: u64,
    /// Writes the wild sandbox aimed at read-only pages (from its seed), the
    /// count its guest reported, and the count its monitor received.
    pub aimed_readonly: u64,
    pub guest_counted: u64,
    pub reported: u64,
    /// The wild sandbox completed and its counts agree.
    pub wild_verified: bool,
    /// The neighbour then completed with its digest verified.
    pub neighbour_verified: bool,
    pub problem: Option<String>,
}

impl WildwriteResult {
    pub fn clean(&self) -> bool {
        self.changed_bytes == 0
            && self.aimed_readonly == self.reported
            && self.wild_verified
            && self.neighbour_verified
    }
}

fn ram(set: &SandboxSet, name: &str) -> Result<Vec<u8>, SandboxError> {
    let sb = set.get(name).ok_or_else(|| SandboxError::Config(format!("no sandbox '{name}'")))?;
    let vm = sb.vm();
    let mut f = vm.memory().fd().as_ref();
    let mut v = Vec::new();
    f.rewind().and_then(|_| f.read_to_end(&mut v)).map_err(|e| {
        SandboxError::Resource(format!("cannot read sandbox '{name}''s memory: {e}"))
    })?;
    Ok(v)
}

fn differing(a: &[u8], b: &[u8]) -> u64 {
    let common = a.iter().zip(b).filter(|(x, y)| x != y).count();
    (common + a.len().abs_diff(b.len())) as u64
}

/// Sandbox "wild" (wildwrite, policy report) and "calm" (memwrite) joined by
/// a channel, on `cores`. Starts calm, pauses it, copies its RAM and its
/// channel region, runs wild to completion, compares, then lets calm finish.
pub fn wildwrite_beside(
    kvm: &kvm_ioctls::Kvm,
    images: &Images,
    seed: u64,
    cores: [usize; 2],
) -> Result<WildwriteResult, SandboxError> {
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "wild", "cores": [{}], "on_violation": "report", "workload": {{"kind": "wildwrite", "seed": {seed}}}}},
            {{"name": "calm", "cores": [{}], "workload": {{"kind": "memwrite", "seed": {seed}, "ws_mib": 4, "duration_ms": 200}}}}
        ], "channels": [{{"name": "wc", "between": ["wild", "calm"]}}]}}"#,
        cores[0], cores[1]
    );
    let set = SandboxSet::create(kvm, SetConfig::parse(&text)?, images)?;
    let (wild, calm) = (&set.sandboxes[0], &set.sandboxes[1]);
    set.start(calm)?;
    calm.vm().pause();
    let ram_before = ram(&set, "calm")?;
    let region_before = set.channels[0].read_region(1);
    set.start(wild)?;
    let wild_out = wild.vm().wait(Duration::from_secs(120));
    let changed = differing(&ram_before, &ram(&set, "calm")?)
        + differing(&region_before, &set.channels[0].read_region(1));
    calm.vm().resume();
    let calm_out = calm.vm().wait(Duration::from_secs(120));
    let report = set.report(&[wild_out.clone(), calm_out]);
    let (w, c) = (&report.sandboxes[0], &report.sandboxes[1]);
    let heap = nl_arch::read_boot_info(wild.vm().memory().mem())
        .map(|b| b.heap_end.saturating_sub(b.heap_start))
        .map_err(|e| SandboxError::Resource(format!("boot info: {e}")))?;
    let aimed = nl_workloads::wildwrite::Plan::new(
        seed,
        nl_workloads::wildwrite::WRITES,
        heap,
        1,
        nl_abi::CHANNEL_REGION_BYTES,
    )
    .expected()
    .peer;
    let problem = w.problem.clone().or_else(|| c.problem.clone());
    Ok(WildwriteResult {
        seed,
        changed_bytes: changed,
        aimed_readonly: aimed,
        guest_counted: w.digest,
        reported: w.violations,
        wild_verified: wild_out == VmOutcome::Completed && w.verified,
        neighbour_verified: c.outcome == VmOutcome::Completed && c.verified,
        problem,
    })
}
