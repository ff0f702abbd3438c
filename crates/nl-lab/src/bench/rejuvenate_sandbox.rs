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
//!
//! The rollback rows do the same with that sandbox under `rollback`
//! recovery (output commit on, released at the next checkpoint, 20 ms
//! checkpoints): its supervisor ends its run at the handover's pause (its
//! held replies sent) and the new process supervises it with a fresh ring
//! (nl_sandbox::handover); the gap includes the replies' hold.
//!
//! The link rows do the same for a set on a shared link (two netbench
//! members on the bench's TAP, a `demux` link), pinging both members every
//! 1 ms across each warm rejuvenation: the new process takes the link's TAP
//! and packet sockets over.
//!
//! The microreboot rows do the same across a recovery instead: each
//! repetition starts a host with `--recovery microreboot` whose API
//! connection reading a given request crashes (`NINELIVES_API_FAULT`), so
//! that request makes the host exec itself afresh in place and take the
//! set over; the ping measures how long the sandbox went unanswered.

use std::path::Path;
use std::time::{Duration, Instant};

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

/// [`create_request`] with the sandbox under `rollback` (the rollback rows).
fn rollback_create_request() -> Result<Value> {
    let mut r = create_request()?;
    r["set"]["sandboxes"][0]["detect"] = json!({"heartbeat_cpu_ms": 100});
    r["set"]["sandboxes"][0]["recovery"] = json!({"policy": "rollback",
        "checkpoint_interval_ms": 20, "release": "next_checkpoint"});
    Ok(r)
}

/// `reps` warm rejuvenations of a host holding the set, each with a 1 ms
/// ping across it. Returns the rows (JSON) and prints one line each unless
/// `json`.
pub(crate) fn rows(h: &HostProc, net: Option<&PingNet>, reps: u32, json: bool) -> Result<Value> {
    warm_rows(h, net, reps, json, create_request()?, "with its own TAP")
}

/// [`rows`] with the sandbox under `rollback`, plus the load average
/// before and after.
pub(crate) fn rollback_rows(
    h: &HostProc,
    net: Option<&PingNet>,
    reps: u32,
    json: bool,
) -> Result<Value> {
    let before = crate::json_out::loadavg();
    let mut v = warm_rows(h, net, reps, json, rollback_create_request()?, "under rollback")?;
    v["loadavg_before"] = json!(before);
    v["loadavg_after"] = json!(crate::json_out::loadavg());
    Ok(v)
}

fn warm_rows(
    h: &HostProc,
    net: Option<&PingNet>,
    reps: u32,
    json: bool,
    create: Value,
    what: &str,
) -> Result<Value> {
    let Some(net) = net else {
        return Ok(json!({"skipped": "no ping namespace (needs root)"}));
    };
    let r = h.req(create)?;
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
                "warm, sandbox set {what}, rep {rep}: set downtime {} ms, {}",
                row["sets_downtime_ms"],
                ping::describe(&p)
            );
        }
        runs.push(row);
    }
    h.req(json!({"op": "sandbox_destroy", "name": SET}))?;
    let mut rows = summary(runs, &format!("warm ({what})"), "rejuvenations", json);
    rows["baseline"] = json!(baseline);
    Ok(rows)
}

/// The rows' JSON (`runs`, the longest gap's spread, pings lost) and,
/// unless `json`, one line for them.
fn summary(runs: Vec<Value>, what: &str, events: &str, json: bool) -> Value {
    // A gap under the probe's resolution has no `gap_ms`: counted as 0.
    let gaps: Vec<f64> = runs.iter().map(|r| r["ping"]["gap_ms"].as_f64().unwrap_or(0.0)).collect();
    let lost: u64 = runs.iter().filter_map(|r| r["ping"]["lost"].as_u64()).sum();
    let gap = crate::stats::Summary::of(&gaps);
    if !json {
        println!(
            "{what}, sandbox set: ping gap {} ms, {lost} pings lost in {} {events}",
            gap.show(1),
            runs.len()
        );
    }
    json!({"runs": runs, "gap_ms": gap, "lost": lost})
}

/// The link set's name on the host.
const LINK_SET: &str = "rjlan";
/// Its members' addresses (on the bench's TAP, 10.0.0.1/24).
const MEMBERS: [&str; 2] = ["10.0.0.2", "10.0.0.3"];

/// The `sandbox_create` request of the link rows: a `demux` link on the
/// bench's TAP with netbench sandboxes a (10.0.0.2, the host's first core)
/// and b (10.0.0.3, its last).
fn link_create_request() -> Result<Value> {
    let cores = nl_sandbox::affinity::host_cores()?;
    let member = |name: &str, core: usize, last: u8| {
        json!({"name": name, "cores": [core], "mem_mib": 48,
            "workload": {"kind": "netbench", "duration_ms": 0},
            "net": {"link": "lan", "mac": format!("52:54:00:5a:00:{last:02x}"),
                    "ipv4": format!("10.0.0.{last}/24")}})
    };
    let (first, last) = (cores[0], cores[cores.len() - 1]);
    Ok(json!({"op": "sandbox_create", "name": LINK_SET, "timeout_secs": 3600, "set": {
        "links": [{"name": "lan", "tap": ping::TAP, "mode": "demux"}],
        "sandboxes": [member("a", first, 2), member("b", last, 3)]
    }}))
}

/// `reps` warm rejuvenations of a host holding a set on a shared link
/// (two members), each with a 1 ms ping to both members across it: per
/// repetition each member's longest gap overlapping the rejuvenation and
/// the longer of the two (`gap_ms`: its median [min, max] over the
/// repetitions), the pings lost and the load average before and after.
pub(crate) fn link_rows(
    h: &HostProc,
    net: Option<&PingNet>,
    reps: u32,
    json: bool,
) -> Result<Value> {
    let Some(net) = net else {
        return Ok(json!({"skipped": "no ping namespace (needs root)"}));
    };
    let r = h.req(link_create_request()?)?;
    if r.get("error").is_some() {
        bail!("cannot create the link set: {r}");
    }
    let mut baseline = Vec::new();
    for ip in MEMBERS {
        if !net.wait_answering_at(ip, Duration::from_secs(60))? {
            bail!("link member {ip} never answered a ping");
        }
        baseline.push(net.baseline_at(ip, 1.0)?);
    }
    let loadavg_before = crate::json_out::loadavg();
    let mut runs = Vec::new();
    for rep in 0..reps {
        let (report, probes) = ping::across_each(net, &MEMBERS, || rejuvenate(h, "warm", &None))?;
        if report["sets"] != json!([LINK_SET]) {
            bail!("warm rejuvenation {rep} did not carry the link set: {report}");
        }
        // A gap under the probe's resolution has no `gap_ms`: counted as 0.
        let gaps: Vec<f64> = probes.iter().map(|p| p["gap_ms"].as_f64().unwrap_or(0.0)).collect();
        let row = json!({"rep": rep, "ping": {"a": probes[0], "b": probes[1]},
            "gap_ms": gaps.iter().copied().fold(0.0, f64::max),
            "gaps_ms": gaps, "loadavg": crate::json_out::loadavg(),
            "sets_downtime_ms": report["sets_downtime_ms"],
            "total_downtime_ms": report["total_downtime_ms"]});
        if !json {
            println!(
                "warm, sandbox set on a shared link, rep {rep}: set downtime {} ms; a: {}; b: {}",
                row["sets_downtime_ms"],
                ping::describe(&probes[0]),
                ping::describe(&probes[1])
            );
        }
        runs.push(row);
    }
    let loadavg_after = crate::json_out::loadavg();
    h.req(json!({"op": "sandbox_destroy", "name": LINK_SET}))?;
    let of = |f: &dyn Fn(&Value) -> f64| {
        crate::stats::Summary::of(&runs.iter().map(f).collect::<Vec<_>>())
    };
    let gap = of(&|r| r["gap_ms"].as_f64().unwrap_or(f64::NAN));
    let gap_a = of(&|r| r["gaps_ms"][0].as_f64().unwrap_or(f64::NAN));
    let gap_b = of(&|r| r["gaps_ms"][1].as_f64().unwrap_or(f64::NAN));
    let lost: u64 = runs
        .iter()
        .flat_map(|r| [&r["ping"]["a"]["lost"], &r["ping"]["b"]["lost"]])
        .filter_map(Value::as_u64)
        .sum();
    if !json {
        println!(
            "warm, sandbox set on a shared link: longest ping gap of either member {} ms (a {}, \
             b {}), {lost} pings lost in {} rejuvenations; loadavg {loadavg_before} before, \
             {loadavg_after} after",
            gap.show(1),
            gap_a.show(1),
            gap_b.show(1),
            runs.len()
        );
    }
    Ok(json!({"runs": runs, "gap_ms": gap, "gap_a_ms": gap_a, "gap_b_ms": gap_b,
        "lost": lost, "baseline": baseline,
        "loadavg_before": loadavg_before, "loadavg_after": loadavg_after}))
}

/// The request whose connection crashes the host of a microreboot row:
/// the host's first answer (its start), the set's creation and one more
/// come before it.
const FAULT_AT: u32 = 4;

/// `reps` microreboots, each of a fresh host holding the set, with a 1 ms
/// ping across it. Returns the rows (JSON) and prints one line each unless
/// `json`.
pub(crate) fn microreboot_rows(
    sock: &Path,
    net: Option<&PingNet>,
    reps: u32,
    json: bool,
) -> Result<Value> {
    let Some(net) = net else {
        return Ok(json!({"skipped": "no ping namespace (needs root)"}));
    };
    let fault = format!("segv:{FAULT_AT}");
    let mut runs = Vec::new();
    for rep in 0..reps {
        // Request 1: the start's `list`.
        let h = HostProc::start_with(
            sock,
            Some(net),
            &["--recovery", "microreboot"],
            &[(nl_vmm::selftest::API_FAULT_ENV, fault.as_str())],
        )?;
        // Request 2.
        let r = h.req(create_request()?)?;
        if r.get("error").is_some() {
            bail!("cannot create the sandbox set: {r}");
        }
        // The set answers before the fault.
        let baseline = ping::baseline(Some(net))?;
        // Request 3.
        h.req(json!({"op": "info"}))?;
        let (info, probe) = ping::across(Some(net), || {
            // Request FAULT_AT: its connection crashes the host.
            let t = Instant::now();
            let r =
                nl_vmm::api::request_timeout(sock, &json!({"op": "info"}), Duration::from_secs(30));
            if r.as_ref().is_ok_and(|v| v["ok"] == true && v["generation"] == 0) {
                bail!("request {FAULT_AT} was answered: the fault did not fire");
            }
            // The fresh process serves (its generation 1) with the set.
            loop {
                let info = nl_vmm::api::request_timeout(
                    sock,
                    &json!({"op": "info"}),
                    Duration::from_secs(30),
                );
                if let Ok(v) = info {
                    if v["generation"] == 1 {
                        return Ok((v, t.elapsed().as_secs_f64() * 1e3));
                    }
                }
                if t.elapsed() > Duration::from_secs(60) {
                    bail!("the host did not serve again within 60 s of its microreboot");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })?;
        let list = h.req(json!({"op": "sandbox_list"}))?;
        let carried = list["sets"]
            .as_array()
            .is_some_and(|s| s.iter().any(|x| x["name"] == SET && x["handovers"] == 1));
        if !carried {
            bail!("microreboot {rep} did not carry the sandbox set: {list}");
        }
        let recovered = h.recovered();
        let row = json!({"rep": rep, "ping": probe, "ping_baseline": baseline,
            "api_back_ms": info.1, "pid": info.0["pid"], "recovered": recovered});
        if !json {
            println!(
                "microreboot, sandbox set with its own TAP, rep {rep}: API back after {:.1} ms, {}",
                info.1,
                ping::describe(&row["ping"])
            );
        }
        runs.push(row);
        let _ = h.req(json!({"op": "sandbox_destroy", "name": SET}));
        drop(h);
    }
    Ok(summary(runs, "microreboot (with its own TAP)", "microreboots", json))
}
