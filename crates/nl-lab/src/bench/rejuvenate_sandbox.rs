//! The sandbox-set rows of `ninelives bench rejuvenate`: a warm
//! rejuvenation carries a sandbox set that holds a TAP of its own (the new
//! process takes the set over with the TAP descriptor it inherited), and a
//! client pinging the sandbox every 1 ms sees how long it went unanswered.
//!
//! The set is one `netbench` sandbox (10.0.0.2, UDP echo) on the bench's
//! namespace TAP ([`super::rejuvenate_ping::TAP`]), created through the
//! host's API like any operator's set; each repetition is one warm
//! rejuvenation with the probe of [`super::rejuvenate_ping::across`]
//! around it. Without a ping namespace (not root) the rows are skipped and
//! say so.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::rejuvenate::{rejuvenate, HostProc};
use super::rejuvenate_ping::{self as ping, PingNet};

/// The set's name on the host.
const SET: &str = "rjweb";

/// The `sandbox_create` request: one netbench sandbox on the TAP, pinned
/// to the host's first core.
fn create_request() -> Result<Value> {
    let core = nl_sandbox::affinity::host_cores()?[0];
    Ok(json!({"op": "sandbox_create", "name": SET, "timeout_secs": 3600, "set": {
        "sandboxes": [{"name": "web", "cores": [core], "mem_mib": 48,
            "workload": {"kind": "netbench", "duration_ms": 0},
            "net": {"tap": ping::TAP, "mac": "52:54:00:5a:00:02", "ipv4": ping::GUEST_CIDR}}]
    }}))
}

/// `reps` warm rejuvenations of a host holding the set, each with a 1 ms
/// ping across it. Returns the rows (JSON) and prints one line each unless
/// `json`.
pub(crate) fn rows(h: &HostProc, net: Option<&PingNet>, reps: u32, json: bool) -> Result<Value> {
    let Some(net) = net else {
        return Ok(json!({"skipped": "no ping namespace (needs root)"}));
    };
    let r = h.req(create_request()?)?;
    if r.get("error").is_some() {
        bail!("cannot create the sandbox set: {r}");
    }
    let baseline = ping::baseline(Some(net))?;
    let mut runs = Vec::new();
    for rep in 0..reps {
        let (report, probe) = ping::across(Some(net), || rejuvenate(h, "warm", &None))?;
        if report["sets"] != json!([SET]) {
            bail!("warm rejuvenation {rep} did not carry the sandbox set: {report}");
        }
        let row = json!({"rep": rep, "ping": probe,
            "sets_downtime_ms": report["sets_downtime_ms"],
            "total_downtime_ms": report["total_downtime_ms"]});
        if !json {
            let p = row["ping"].clone();
            println!(
                "warm, sandbox set with its own TAP, rep {rep}: set downtime {} ms, {}",
                row["sets_downtime_ms"],
                ping::describe(&p)
            );
        }
        runs.push(row);
    }
    h.req(json!({"op": "sandbox_destroy", "name": SET}))?;
    // A gap under the probe's resolution has no `gap_ms`: counted as 0.
    let gaps: Vec<f64> = runs.iter().map(|r| r["ping"]["gap_ms"].as_f64().unwrap_or(0.0)).collect();
    let lost: u64 = runs.iter().filter_map(|r| r["ping"]["lost"].as_u64()).sum();
    let gap = crate::stats::Summary::of(&gaps);
    if !json {
        println!(
            "warm, sandbox set with its own TAP: ping gap {} ms, {lost} pings lost in {reps} rejuvenations",
            gap.show(1)
        );
    }
    Ok(json!({"runs": runs, "baseline": baseline, "gap_ms": gap, "lost": lost}))
}
