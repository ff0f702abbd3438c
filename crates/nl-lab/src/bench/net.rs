//! The `netbench` entry of `ninelives bench`: 1 ms UDP ping round trips to
//! the netbench guest over its TAP, next to the same ping against a host UDP
//! echo responder (`ninelives echo-server`) without a guest.
//!
//! Everything happens in two network namespaces of the bench's own (needs
//! root): namespace A holds the VMM, its TAP (10.0.0.1/24, the
//! guest is 10.0.0.2) and the pinger; namespace B, reached from A over a
//! veth pair (10.0.1.1 - 10.0.1.2), holds the echo responder. Only those
//! addresses are ever used. The VMM, the pinger and the responder are this
//! binary, started inside their namespace (`setns`).

use std::process::{Command, Output};

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::process::Proc;

/// Round-trip times of one ping run (milliseconds).
#[derive(Clone, Debug, Serialize)]
pub struct Rtt {
    pub sent: u64,
    pub received: u64,
    pub median_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub longest_gap_ms: f64,
    pub bad_windows: usize,
}

/// The netbench entry.
#[derive(Clone, Debug, Serialize)]
pub struct NetEntry {
    pub workload: &'static str,
    pub unit: &'static str,
    pub interval_ms: f64,
    pub duration_s: f64,
    /// The reference guest polling (spinning) for frames.
    pub guest: Rtt,
    /// The guest halting when idle, woken by the net interrupt (`--net-rx-irq`).
    pub guest_rx_irq: Rtt,
    pub host_baseline: Rtt,
    /// Guest median RTT over the baseline's.
    pub ratio: f64,
    pub digest_ok: bool,
}

/// Two namespaces (A: TAP and pinger, B: echo responder), deleted on drop.
struct Netns {
    a: crate::netns::Netns,
    b: crate::netns::Netns,
}

impl Netns {
    /// The reason when namespaces cannot be made here.
    fn new() -> Result<Netns, String> {
        if let Some(why) = crate::netns::unavailable() {
            return Err(why);
        }
        let build = || -> Result<Netns> {
            let pid = std::process::id();
            let a = crate::netns::Netns::new(&format!("nlbench-{pid}-a"))?;
            let b = crate::netns::Netns::new(&format!("nlbench-{pid}-b"))?;
            a.add_tap("nlbtap0", "10.0.0.1/24")?;
            a.veth(("nlbv0", Some("10.0.1.1/24")), &b, ("nlbv1", Some("10.0.1.2/24")))?;
            Ok(Netns { a, b })
        };
        build().map_err(|e| format!("{e:#}"))
    }

    /// This binary with `args`, run inside namespace `ns`.
    fn exe(ns: &crate::netns::Netns, args: &[&str]) -> Result<Command> {
        let mut c = ns.ninelives()?;
        c.args(args);
        Ok(c)
    }
}

fn last_json(o: &Output) -> Option<serde_json::Value> {
    crate::json_out::last_json(&String::from_utf8_lossy(&o.stdout))
}

/// Pings `target` from namespace A until it answers (bounded: 10 s).
fn wait_for_echo(ns: &Netns, target: &str) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let o = Netns::exe(
            &ns.a,
            &["ping", "--target", target, "--interval", "10ms", "--duration", "0.1", "--json"],
        )?
        .output()?;
        if last_json(&o).is_some_and(|j| j["received"].as_u64().unwrap_or(0) > 0) {
            return Ok(());
        }
    }
    bail!("{target} never answered")
}

fn ping(ns: &Netns, target: &str, secs: f64) -> Result<Rtt> {
    let d = format!("{secs}");
    let o = Netns::exe(
        &ns.a,
        &["ping", "--target", target, "--interval", "1ms", "--duration", &d, "--json"],
    )?
    .output()?;
    let j = last_json(&o).with_context(|| format!("ping {target} printed no result"))?;
    let f = |k: &str| j[k].as_f64().unwrap_or(f64::NAN);
    Ok(Rtt {
        sent: j["sent"].as_u64().unwrap_or(0),
        received: j["received"].as_u64().unwrap_or(0),
        median_ms: f("rtt_median_ms"),
        p99_ms: f("rtt_p99_ms"),
        max_ms: f("rtt_max_ms"),
        longest_gap_ms: f("longest_gap_ms"),
        bad_windows: j["bad_windows"].as_array().map_or(0, Vec::len),
    })
}

/// Measures the entry, or says why it cannot be measured here.
pub fn measure(secs: f64) -> Result<Result<NetEntry, String>> {
    let ns = match Netns::new() {
        Ok(ns) => ns,
        Err(why) => return Ok(Err(why)),
    };
    let secs = secs.max(1.0);
    // The responder and the guest outlive the probe and the ping run.
    let life = format!("{}", secs + 3.0);
    // Baseline: the echo responder in B, pinged from A over the veth.
    let echo = Proc::spawn(Netns::exe(
        &ns.b,
        &["echo-server", "--bind", "10.0.1.2:7", "--duration", &life],
    )?)
    .context("cannot start the echo responder")?;
    wait_for_echo(&ns, "10.0.1.2:7")?;
    let host = ping(&ns, "10.0.1.2:7", secs)?;
    drop(echo);
    // The guest: netbench on the TAP in A, polling, then interrupt-driven.
    let guest = guest_run(&ns, &life, secs, &[])?;
    let guest_rx_irq = guest_run(&ns, &life, secs, &["--net-rx-irq"])?;
    // Both runs verified (guest_run fails otherwise).
    let digest_ok = true;
    let ratio = if host.median_ms > 0.0 { guest.median_ms / host.median_ms } else { 0.0 };
    Ok(Ok(NetEntry {
        workload: "netbench",
        unit: "rtt_ms",
        interval_ms: 1.0,
        duration_s: secs,
        guest,
        guest_rx_irq,
        host_baseline: host,
        ratio,
        digest_ok,
    }))
}

/// Boots a netbench VM in A (with `extra` machine flags), pings it, and
/// checks that it verified.
fn guest_run(ns: &Netns, life: &str, secs: f64, extra: &[&str]) -> Result<Rtt> {
    let mut args = vec![
        "run",
        "--workload",
        "netbench",
        "--net-tap",
        "nlbtap0",
        "--net-ip",
        "10.0.0.2/24",
        "--duration",
        life,
        "--json",
    ];
    args.extend_from_slice(extra);
    let mut vm = Proc::spawn(Netns::exe(&ns.a, &args)?).context("cannot start the netbench VM")?;
    wait_for_echo(ns, "10.0.0.2:7")?;
    let rtt = ping(ns, "10.0.0.2:7", secs)?;
    let limit = Duration::from_secs_f64(life.parse::<f64>().unwrap_or(secs) + 30.0);
    let status = vm.wait_for(limit);
    let ok = status.is_some_and(|s| s.success())
        && vm.last_json().is_some_and(|j| j["vms"][0]["digest_ok"] == serde_json::json!(true));
    if !ok {
        bail!("the netbench VM failed ({status:?}): {}", vm.stderr.text().trim());
    }
    Ok(rtt)
}
