//! `ninelives bench sandbox --parts interrupts,shared-driver`: Quest-V's
//! Table 3 (interrupt multicast) and Fig. 11 (shared driver) on shared
//! links (`nl_sandbox::shared_link`). Both need root for a network
//! namespace of their own.
//!
//! Table 3: pings (UDP echo to port 7) every 3 ms to netbench sandbox `a`
//! (with a receive thread, so every frame it gets raises its RX
//! interrupt) beside a second netbench sandbox `b`: `private`, each on a
//! TAP of its own, against `multicast`, both on one shared TAP whose
//! frames all go to both (b's guest drops a's frames, early
//! demultiplexing), and `demux`, both on one shared TAP that gives each
//! only its own frames (what the link costs without the multicast).
//! Reported per arm: the RTT median and p99 over the repetitions, and the
//! RX interrupts each sandbox took; the ratio is multicast / private of
//! the RTT medians (and demux / private beside it).
//!
//! Fig. 11: UDP echo throughput to 1..=4 netbench sandboxes (each with a
//! receive thread), one client thread per sandbox in the namespace
//! keeping a window of datagrams outstanding: `private` TAPs (one per
//! sandbox, a subnet each) against one `shared` TAP (demultiplexed by
//! MAC). Reported per client count: both throughputs and shared / private.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use nl_sandbox::{SandboxSet, SetConfig};
use serde::Serialize;

use super::sandbox::{loadavg, spread, BenchSandboxArgs, Spread};
use crate::netns::Netns;

/// Paper, Table 3: round-trip time of 30000 pings at 3 ms, Quest
/// (interrupts to one core) 5737 ms, Quest-V (multicast to all) 5742 ms.
pub const PAPER_TABLE3: (f64, f64) = (5737.0, 5742.0);
/// Issue 18's targets: multicast costs at most 1% in RTT; the shared TAP
/// reaches at least 90% of private TAPs.
pub const TABLE3_TARGET: f64 = 1.01;
pub const FIG11_TARGET: f64 = 0.9;
/// Ping interval of Table 3 (the paper's).
const PING_INTERVAL: Duration = Duration::from_millis(3);
/// UDP payload of the throughput clients (one frame, under the MTU).
const PAYLOAD: usize = 1400;
/// Datagrams each client keeps outstanding.
const WINDOW: usize = 8;

#[derive(Clone, Debug, Serialize)]
pub struct Table3Arm {
    pub what: String,
    pub rtt_median_ms: Spread,
    pub rtt_p99_ms: Spread,
    pub received: Spread,
    /// RX interrupts of the pinged sandbox and of its neighbour.
    pub interrupts_pinged: Spread,
    pub interrupts_neighbour: Spread,
    /// Frames the neighbour's device got (its guest dropped a's).
    pub neighbour_rx_frames: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct Table3 {
    pub reps: usize,
    pub pings: u64,
    pub interval_ms: f64,
    pub private: Table3Arm,
    /// Both on one shared TAP in `demux` mode: each gets only its own
    /// frames. Separates what the shared link costs from what the
    /// multicast (b taking every frame and its interrupt) costs.
    pub demux: Table3Arm,
    pub multicast: Table3Arm,
    /// multicast / private, of the medians of the RTT medians.
    pub rtt_ratio: f64,
    /// demux / private, of the same.
    pub demux_ratio: f64,
    pub paper_ratio: f64,
    pub target_at_most: f64,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Fig11Row {
    pub clients: usize,
    pub private_mbit_s: Spread,
    pub shared_mbit_s: Spread,
    /// shared / private of the medians.
    pub ratio: f64,
    /// The shared arm: frames its members' packet sockets dropped
    /// (buffer full) while the clients ran, all members together.
    pub shared_socket_drops: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct Fig11 {
    pub reps: usize,
    pub payload_bytes: usize,
    pub window: usize,
    pub window_ms: u64,
    pub rows: Vec<Fig11Row>,
    pub target_at_least: f64,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

fn ns_name(tag: &str) -> String {
    format!("nl-bench-{tag}-{}", std::process::id())
}

/// A netbench sandbox's entry; `net` is its net section's inside.
fn sandbox(name: &str, core: usize, net: &str) -> String {
    format!(
        r#"{{"name": "{name}", "cores": [{core}], "mem_mib": 48, "workload": {{"kind": "netbench", "duration_ms": 0}}, "net": {{{net}, "rx_irq": true}}}}"#
    )
}

fn mac(i: usize) -> String {
    format!("52:54:00:5b:00:{:02x}", i + 2)
}

/// `k` netbench sandboxes: on TAPs of their own (`nltapI`, 10.0.I.2) or
/// on one shared link over nltap0 (10.0.0.I+2) in `mode`. Returns the
/// config and each sandbox's address.
fn net_set(k: usize, shared: Option<&str>, cores: &[usize]) -> (String, Vec<String>) {
    let mut boxes = Vec::new();
    let mut ips = Vec::new();
    for i in 0..k {
        let name = format!("s{i}");
        let core = cores[i % cores.len()];
        let (net, ip) = match shared {
            Some(_) => (
                format!(r#""link": "lan", "mac": "{}", "ipv4": "10.0.0.{}/24""#, mac(i), i + 2),
                format!("10.0.0.{}", i + 2),
            ),
            None => (
                format!(r#""tap": "nltap{i}", "mac": "{}", "ipv4": "10.0.{i}.2/24""#, mac(i)),
                format!("10.0.{i}.2"),
            ),
        };
        boxes.push(sandbox(&name, core, &net));
        ips.push(ip);
    }
    let links = match shared {
        Some(mode) => {
            format!(r#""links": [{{"name": "lan", "tap": "nltap0", "mode": "{mode}"}}], "#)
        }
        None => String::new(),
    };
    (format!(r#"{{{links}"sandboxes": [{}]}}"#, boxes.join(", ")), ips)
}

/// A namespace with TAPs nltap0..nltap{k-1} at 10.0.I.1/24, up.
fn namespace(tag: &str, k: usize) -> Result<Netns> {
    let ns = Netns::with_tap(&ns_name(tag), "nltap0")?;
    for i in 1..k {
        ns.add_tap(&format!("nltap{i}"), &format!("10.0.{i}.1/24"))?;
    }
    Ok(ns)
}

/// Waits (at most 600 tries, 90 s) until the sandbox at `ip` answers.
fn wait_answering(ip: &str) -> Result<()> {
    if !crate::ping::answers_within(format!("{ip}:7").parse()?, Duration::from_secs(90)) {
        bail!("the sandbox at {ip} never answered");
    }
    Ok(())
}

/// Creates the set in `ns`, waits until every sandbox answers, runs
/// `body`, stops the set and returns `body`'s result and the report.
fn with_set<T: Send>(
    ns: &Netns,
    config: &str,
    ips: &[String],
    body: impl FnOnce(&SandboxSet) -> Result<T> + Send,
) -> Result<(T, nl_sandbox::SetReport)> {
    let kvm = nl_vmm::open_kvm()?;
    let config = SetConfig::parse(config)?;
    ns.run_in(|| {
        let s = SandboxSet::create(&kvm, config, &nl_launch::guest::sandbox_images())?;
        s.start_all()?;
        std::thread::scope(|scope| {
            let h = scope.spawn(|| s.supervise(Duration::from_secs(300)));
            let r = ips.iter().try_for_each(|ip| wait_answering(ip)).and_then(|()| body(&s));
            s.request_stop();
            let report = h.join().map_err(|_| anyhow!("supervision panicked"))?;
            Ok((r?, report))
        })
    })
}

/// One Table 3 run: (ping report, the two sandboxes' interrupts, the
/// neighbour's received frames).
fn table3_run(
    mode: Option<&str>,
    cores: &[usize],
    pings: u64,
) -> Result<(crate::ping::PingReport, u64, u64, u64)> {
    let ns = namespace(if mode.is_some() { "t3-shared" } else { "t3-private" }, 2)?;
    let (config, ips) = net_set(2, mode, cores);
    let target = format!("{}:7", ips[0]).parse()?;
    let duration = PING_INTERVAL * pings as u32;
    let (p, report) =
        with_set(&ns, &config, &ips, |_| crate::ping::ping(target, PING_INTERVAL, duration, None))?;
    let irq = |i: usize| report.sandboxes[i].net_interrupts.unwrap_or(0);
    let rx = report.sandboxes[1].net.map_or(0, |n| n.rx_frames);
    Ok((p, irq(0), irq(1), rx))
}

pub fn table3(a: &BenchSandboxArgs) -> Result<Table3> {
    let cores = nl_sandbox::affinity::host_cores()?;
    let cores = [cores[0], *cores.last().expect("a core")];
    let pings = a.pings;
    let loadavg_before = loadavg();
    let mut runs: [Vec<_>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..a.reps {
        for (k, mode) in [None, Some("demux"), Some("multicast")].into_iter().enumerate() {
            runs[k].push(table3_run(mode, &cores, pings)?);
        }
    }
    let arm = |what: &str, v: &[(crate::ping::PingReport, u64, u64, u64)]| Table3Arm {
        what: what.to_string(),
        rtt_median_ms: spread(v.iter().map(|r| r.0.rtt_median_ms.unwrap_or(f64::NAN)).collect()),
        rtt_p99_ms: spread(v.iter().map(|r| r.0.rtt_p99_ms.unwrap_or(f64::NAN)).collect()),
        received: spread(v.iter().map(|r| r.0.received as f64).collect()),
        interrupts_pinged: spread(v.iter().map(|r| r.1 as f64).collect()),
        interrupts_neighbour: spread(v.iter().map(|r| r.2 as f64).collect()),
        neighbour_rx_frames: spread(v.iter().map(|r| r.3 as f64).collect()),
    };
    let private = arm("private TAPs (a's frames and interrupts to a only)", &runs[0]);
    let demux = arm("one shared TAP, demux (each gets its own frames only)", &runs[1]);
    let multicast =
        arm("one shared TAP, multicast (every frame and interrupt to a and b)", &runs[2]);
    Ok(Table3 {
        reps: a.reps,
        pings,
        interval_ms: PING_INTERVAL.as_secs_f64() * 1e3,
        rtt_ratio: multicast.rtt_median_ms.median / private.rtt_median_ms.median,
        demux_ratio: demux.rtt_median_ms.median / private.rtt_median_ms.median,
        private,
        demux,
        multicast,
        paper_ratio: PAPER_TABLE3.1 / PAPER_TABLE3.0,
        target_at_most: TABLE3_TARGET,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

/// Echo throughput of one client for `window` (bytes received back).
fn client(ip: &str, window: Duration) -> Result<u64> {
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.connect(format!("{ip}:7"))?;
    sock.set_read_timeout(Some(Duration::from_millis(20)))?;
    let payload = vec![0x5a; PAYLOAD];
    let mut buf = vec![0u8; 2048];
    let (mut got, mut out) = (0u64, 0usize);
    let t0 = Instant::now();
    // Bounded: 50 M turns or the window.
    for _ in 0..50_000_000u64 {
        if t0.elapsed() >= window {
            break;
        }
        while out < WINDOW {
            if sock.send(&payload).is_err() {
                break;
            }
            out += 1;
        }
        match sock.recv(&mut buf) {
            Ok(n) => {
                out = out.saturating_sub(1);
                if n == PAYLOAD {
                    got += n as u64;
                }
            }
            // Nothing back for 20 ms: count the window lost, send anew.
            Err(_) => out = 0,
        }
    }
    Ok(got)
}

/// One Fig. 11 run: Mbit/s echoed by `k` sandboxes together, and the
/// frames the link's members' sockets dropped while the clients ran (their
/// buffers full; 0 without a link).
fn fig11_run(k: usize, shared: bool, cores: &[usize], window: Duration) -> Result<(f64, f64)> {
    let ns =
        namespace(if shared { "f11-shared" } else { "f11-private" }, if shared { 1 } else { k })?;
    let (config, ips) = net_set(k, shared.then_some("demux"), cores);
    let (res, _) = with_set(&ns, &config, &ips, |set| {
        let dropped =
            || set.links.first().map_or(0, |l| l.report().members.iter().map(|m| m.dropped).sum());
        let dropped0 = dropped();
        let bytes = std::thread::scope(|sc| {
            let hs: Vec<_> = ips.iter().map(|ip| sc.spawn(move || client(ip, window))).collect();
            hs.into_iter()
                .map(|h| h.join().map_err(|_| anyhow!("a client panicked"))?)
                .sum::<Result<u64>>()
        })?;
        Ok((bytes, (dropped() - dropped0) as f64))
    })?;
    let (bytes, cpu) = res;
    Ok((bytes as f64 * 8.0 / window.as_secs_f64() / 1e6, cpu))
}

pub fn fig11(a: &BenchSandboxArgs) -> Result<Fig11> {
    let cores = nl_sandbox::affinity::host_cores()?;
    let window = Duration::from_millis(a.net_ms);
    let loadavg_before = loadavg();
    let mut rows = Vec::new();
    for k in 1..=4 {
        let (mut private, mut shared, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.reps {
            private.push(fig11_run(k, false, &cores, window)?.0);
            let (mbit, c) = fig11_run(k, true, &cores, window)?;
            shared.push(mbit);
            cpu.push(c);
        }
        let (p, s) = (spread(private), spread(shared));
        rows.push(Fig11Row {
            clients: k,
            ratio: s.median / p.median,
            private_mbit_s: p,
            shared_mbit_s: s,
            shared_socket_drops: spread(cpu),
        });
    }
    Ok(Fig11 {
        reps: a.reps,
        payload_bytes: PAYLOAD,
        window: WINDOW,
        window_ms: a.net_ms,
        rows,
        target_at_least: FIG11_TARGET,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

pub fn print_table3(t: &Table3) {
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    println!(
        "Table 3, interrupt multicast: {} pings every {} ms to netbench sandbox a (receive thread) beside sandbox b, {} repetitions interleaved (median [min, max]):",
        t.pings, t.interval_ms, t.reps
    );
    for arm in [&t.private, &t.demux, &t.multicast] {
        println!(
            "  {}: RTT median {} ms, p99 {} ms, replies {}; RX interrupts a {}, b {}; frames to b {}",
            arm.what,
            s(arm.rtt_median_ms, 3),
            s(arm.rtt_p99_ms, 3),
            s(arm.received, 0),
            s(arm.interrupts_pinged, 0),
            s(arm.interrupts_neighbour, 0),
            s(arm.neighbour_rx_frames, 0)
        );
    }
    println!(
        "  multicast/private RTT {:.3} (paper: {:.0}/{:.0} ms = {:.3}; target at most {:.2})",
        t.rtt_ratio, PAPER_TABLE3.1, PAPER_TABLE3.0, t.paper_ratio, t.target_at_most
    );
    println!(
        "  demux/private RTT {:.3} (the shared link without the multicast; the rest of multicast/private is b's work on a's frames)",
        t.demux_ratio
    );
    println!("  load average before: {}; after: {}", t.loadavg_before, t.loadavg_after);
}

pub fn print_fig11(f: &Fig11) {
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    println!(
        "Fig. 11, shared driver: UDP echo of {}-byte datagrams ({} outstanding per client) for {} ms, one client per netbench sandbox, {} repetitions (median [min, max]):",
        f.payload_bytes, f.window, f.window_ms, f.reps
    );
    println!(
        "{:>8}  {:>28}  {:>28}  {:>14}  {:>24}",
        "clients",
        "private TAPs Mbit/s",
        "shared TAP Mbit/s",
        "shared/private",
        "shared socket drops"
    );
    for r in &f.rows {
        println!(
            "{:>8}  {:>28}  {:>28}  {:>14.3}  {:>24}",
            r.clients,
            s(r.private_mbit_s, 1),
            s(r.shared_mbit_s, 1),
            r.ratio,
            s(r.shared_socket_drops, 0)
        );
    }
    println!(
        "  paper (Fig. 11, plot): Quest-V's shared driver against Xen and Linux, 1 to 4 netperf clients; target shared/private at least {:.2}; load average before: {}; after: {}",
        f.target_at_least, f.loadavg_before, f.loadavg_after
    );
}
