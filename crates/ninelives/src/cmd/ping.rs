//! `ninelives ping`: the external UDP sender that measures a guest's service
//! interruptions (netbench answers on port 7).

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::cli::PingArgs;

/// A 1-second window (by send time) whose reception rate fell below 90%.
#[derive(Clone, Debug, Serialize)]
pub struct BadWindow {
    pub start_s: u64,
    pub sent: u64,
    pub received: u64,
    pub rate: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PingReport {
    pub target: String,
    pub interval_ms: f64,
    pub sent: u64,
    pub received: u64,
    /// Longest time without a reply, from the first send to the last reply
    /// (or to the end of the run when replies stopped), in milliseconds.
    pub longest_gap_ms: f64,
    pub rtt_median_ms: Option<f64>,
    pub rtt_p99_ms: Option<f64>,
    pub rtt_max_ms: Option<f64>,
    pub bad_windows: Vec<BadWindow>,
}

fn target_addr(t: &str) -> Result<SocketAddr> {
    let with_port = if t.contains(':') { t.to_string() } else { format!("{t}:7") };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("--target {t}: not an address"))?
        .next()
        .with_context(|| format!("--target {t}: not an address"))
}

/// Sends `count` pings `interval` apart and collects replies (bounded in
/// time: the send period plus one second for stragglers).
pub fn ping(target: SocketAddr, interval: Duration, duration: Duration) -> Result<PingReport> {
    let count = (duration.as_secs_f64() / interval.as_secs_f64()).round().max(1.0) as u64;
    if count > 10_000_000 {
        bail!("{count} pings is too many: raise --interval or lower --duration");
    }
    let bind = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let sock = UdpSocket::bind(bind).context("cannot open a UDP socket")?;
    grow_receive_buffer(&sock);
    sock.connect(target).with_context(|| format!("cannot reach {target}"))?;
    let mut replied = vec![None::<Duration>; count as usize];
    let mut arrivals: Vec<Duration> = Vec::new();
    let start = Instant::now();
    let end_send = interval * count as u32;
    let deadline = end_send + Duration::from_secs(1);
    let mut next = 0u64;
    let mut buf = [0u8; 64];
    loop {
        let now = start.elapsed();
        if now >= deadline || (next == count && replied.iter().all(Option::is_some)) {
            break;
        }
        if next < count && now >= interval * next as u32 {
            let mut p = [0u8; 16];
            p[..8].copy_from_slice(&next.to_le_bytes());
            p[8..].copy_from_slice(&(now.as_nanos() as u64).to_le_bytes());
            // A send error (e.g. no route yet) counts as a lost ping.
            let _ = sock.send(&p);
            next += 1;
            continue;
        }
        let wait = if next < count { interval * next as u32 } else { deadline }
            .saturating_sub(now)
            .max(Duration::from_micros(50));
        sock.set_read_timeout(Some(wait))?;
        match sock.recv(&mut buf) {
            Ok(16) => {
                let at = start.elapsed();
                let seq = u64::from_le_bytes(buf[..8].try_into().unwrap_or_default());
                let sent = Duration::from_nanos(u64::from_le_bytes(
                    buf[8..16].try_into().unwrap_or_default(),
                ));
                if let Some(slot) = replied.get_mut(seq as usize) {
                    if slot.is_none() && sent <= at {
                        *slot = Some(at - sent);
                        arrivals.push(at);
                    }
                }
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::ConnectionRefused
                ) => {}
            Err(e) => return Err(e).context("receiving replies"),
        }
    }
    let run_end = start.elapsed().min(end_send);
    let mut longest = Duration::ZERO;
    let mut prev = Duration::ZERO;
    for &a in &arrivals {
        longest = longest.max(a.saturating_sub(prev));
        prev = a;
    }
    longest = longest.max(run_end.saturating_sub(prev));
    let per_window = (1.0 / interval.as_secs_f64()).round().max(1.0) as u64;
    let mut bad_windows = Vec::new();
    for (w, chunk) in replied.chunks(per_window as usize).enumerate() {
        let received = chunk.iter().filter(|r| r.is_some()).count() as u64;
        let sent = chunk.len() as u64;
        let rate = received as f64 / sent as f64;
        // A partial last window counts only when it is at least half a second long.
        if rate < 0.9 && sent * 2 >= per_window {
            bad_windows.push(BadWindow { start_s: w as u64, sent, received, rate });
        }
    }
    let mut rtts: Vec<f64> = replied.iter().flatten().map(|d| d.as_secs_f64() * 1e3).collect();
    rtts.sort_by(f64::total_cmp);
    let pick = |q: f64| (!rtts.is_empty()).then(|| rtts[((rtts.len() - 1) as f64 * q) as usize]);
    Ok(PingReport {
        target: target.to_string(),
        interval_ms: interval.as_secs_f64() * 1e3,
        sent: count,
        received: rtts.len() as u64,
        longest_gap_ms: longest.as_secs_f64() * 1e3,
        rtt_median_ms: pick(0.5),
        rtt_p99_ms: pick(0.99),
        rtt_max_ms: rtts.last().copied(),
        bad_windows,
    })
}

pub fn run(a: PingArgs) -> Result<ExitCode> {
    if !(a.duration.is_finite() && a.duration > 0.0 && a.duration <= 86_400.0) {
        bail!("--duration {} must be between 0 and 86400 seconds", a.duration);
    }
    let target = target_addr(&a.target)?;
    let r = ping(target, a.interval, Duration::from_secs_f64(a.duration))?;
    println!(
        "{}: sent {}, received {}, longest gap {:.1} ms, rtt median {} ms, {} bad 1-s windows",
        r.target,
        r.sent,
        r.received,
        r.longest_gap_ms,
        r.rtt_median_ms.map_or("-".into(), |v| format!("{v:.3}")),
        r.bad_windows.len()
    );
    for w in &r.bad_windows {
        println!("  window {} s: {} of {} ({:.0}%)", w.start_s, w.received, w.sent, w.rate * 100.0);
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(if r.received > 0 && r.bad_windows.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A VM that stalls (a loaded host, a single-stepping injector) answers a
/// backlog of pings in one burst: give the socket room for it, so the burst
/// is counted rather than dropped by the kernel. SO_RCVBUFFORCE (root) goes
/// past net.core.rmem_max; without privilege the default buffer stays.
fn grow_receive_buffer(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let bytes: libc::c_int = 8 << 20;
    // SAFETY: setsockopt reads one c_int from a valid pointer; failure is harmless.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
