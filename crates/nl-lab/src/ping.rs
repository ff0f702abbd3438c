//! `ninelives ping`: the external UDP sender that measures a guest's service
//! interruptions (netbench answers on port 7).

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

use crate::args::PingArgs;

/// A 1-second window (by send time) whose reception rate fell below 90%.
#[derive(Clone, Debug, Serialize)]
pub struct BadWindow {
    pub start_s: u64,
    pub sent: u64,
    pub received: u64,
    pub rate: f64,
}

/// One gap between replies: when it began (the reply before it, or the
/// first send) and how long it lasted, in milliseconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Gap {
    pub start_ms: f64,
    pub ms: f64,
}

/// Gaps of at least this many intervals are listed in [`PingReport::long_gaps`].
const LONG_GAP_INTERVALS: u32 = 3;
/// At most this many (the longest) are listed.
const MAX_LONG_GAPS: usize = 256;

#[derive(Clone, Debug, Serialize)]
pub struct PingReport {
    pub target: String,
    pub interval_ms: f64,
    /// When the clock of the run's times started (the first send), in
    /// milliseconds since the Unix epoch: lets a caller in another process
    /// place its own events on that clock.
    pub start_unix_ms: f64,
    pub sent: u64,
    pub received: u64,
    /// Longest time without a reply, from the first send to the last reply
    /// (or to the end of the run when replies stopped), in milliseconds.
    /// Replies are timed by the kernel when they arrive (`SO_TIMESTAMPNS`),
    /// not when this thread reads them. A pause of the pinger itself (see
    /// [`PingReport::client_stall_ms`]) still counts: a silence is never
    /// under-reported.
    pub longest_gap_ms: f64,
    /// When that gap began (the reply before it, or the first send), in
    /// milliseconds since the first send.
    pub longest_gap_start_ms: f64,
    /// When the last reply arrived, in milliseconds since the first send.
    pub last_reply_ms: Option<f64>,
    /// Every gap of at least 3 intervals (the 256 longest), by start time:
    /// tells a gap at a known moment (e.g. a rejuvenation) from others.
    pub long_gaps: Vec<Gap>,
    /// The longest a ping left after its scheduled send time, in
    /// milliseconds: how long this pinger itself was held up (descheduled).
    pub client_stall_ms: f64,
    /// Whether the pinger ran as a real-time thread (`SCHED_FIFO`, priority
    /// 1: it preempts every ordinary thread, vCPU threads included, on the
    /// few moments it runs). It tries when it may (root); otherwise on a
    /// busy host its own waits for a core show up as gaps.
    pub client_realtime: bool,
    pub rtt_median_ms: Option<f64>,
    pub rtt_p99_ms: Option<f64>,
    pub rtt_max_ms: Option<f64>,
    pub bad_windows: Vec<BadWindow>,
    /// When each reply arrived, in milliseconds since the first send, in
    /// order (for time series such as `bench sandbox-recovery`'s Fig. 6;
    /// not in the JSON).
    #[serde(skip)]
    pub arrivals_ms: Vec<f64>,
}

fn target_addr(t: &str) -> Result<SocketAddr> {
    let with_port = if t.contains(':') { t.to_string() } else { format!("{t}:7") };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("--target {t}: not an address"))?
        .next()
        .with_context(|| format!("--target {t}: not an address"))
}

/// Whether the UDP echo at `target` starts answering: short pings (10 ms
/// apart for 100 ms) until one is answered, bounded by 600 tries and
/// `limit`. What the benches wait for before they measure a guest.
pub fn answers_within(target: SocketAddr, limit: Duration) -> bool {
    let t = Instant::now();
    for _ in 0..600 {
        let p = ping(target, Duration::from_millis(10), Duration::from_millis(100), None);
        if p.is_ok_and(|p| p.received > 0) {
            return true;
        }
        if t.elapsed() > limit {
            break;
        }
    }
    false
}

/// Sends `count` pings `interval` apart and collects replies (bounded in
/// time: the send period plus one second for stragglers). Sending stops
/// early once `stop` is set (the wait for stragglers follows as usual).
pub fn ping(
    target: SocketAddr,
    interval: Duration,
    duration: Duration,
    stop: Option<&AtomicBool>,
) -> Result<PingReport> {
    let mut count = (duration.as_secs_f64() / interval.as_secs_f64()).round().max(1.0) as u64;
    if count > 10_000_000 {
        bail!("{count} pings is too many: raise --interval or lower --duration");
    }
    let bind = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let sock = UdpSocket::bind(bind).context("cannot open a UDP socket")?;
    grow_receive_buffer(&sock);
    sock.connect(target).with_context(|| format!("cannot reach {target}"))?;
    // Kernel receive times: a reply that waited in the socket while this
    // thread did not run is timed when it came.
    let kernel_times =
        nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::ReceiveTimestampns, &true)
            .is_ok();
    // The measuring thread keeps pace with its schedule on a busy host.
    let client_realtime = nl_sandbox::affinity::set_fifo(0, 1).is_ok();
    let _ordinary_again = RestorePolicy(client_realtime);
    let mut client_stall = Duration::ZERO;
    // One slot per ping sent (grown as they go out: a run stopped early
    // never holds memory for the pings it did not send).
    let mut replied: Vec<Option<Duration>> = Vec::new();
    let mut arrivals: Vec<Duration> = Vec::new();
    let start = Instant::now();
    let start_unix_ms = unix_ms(std::time::SystemTime::now());
    let mut end_send = interval * count as u32;
    let mut deadline = end_send + Duration::from_secs(1);
    let mut next = 0u64;
    let mut buf = [0u8; 64];
    loop {
        let now = start.elapsed();
        if next < count && stop.is_some_and(|s| s.load(Relaxed)) {
            count = next;
            end_send = end_send.min(now);
            deadline = end_send + Duration::from_secs(1);
        }
        if now >= deadline || (next == count && arrivals.len() as u64 == count) {
            break;
        }
        if next < count && now >= interval * next as u32 {
            let mut p = [0u8; 16];
            p[..8].copy_from_slice(&next.to_le_bytes());
            p[8..].copy_from_slice(&(now.as_nanos() as u64).to_le_bytes());
            // A send error (e.g. no route yet) counts as a lost ping.
            let _ = sock.send(&p);
            // When it left (this thread may be descheduled before the send).
            let left = start.elapsed();
            client_stall = client_stall.max(left.saturating_sub(interval * next as u32));
            replied.push(None);
            next += 1;
            continue;
        }
        let wait = if next < count { interval * next as u32 } else { deadline }
            .saturating_sub(now)
            .max(Duration::from_micros(50));
        sock.set_read_timeout(Some(wait))?;
        match receive(&sock, &mut buf, kernel_times) {
            Ok((16, kernel_at)) => {
                let at = kernel_at
                    .map(|t| Duration::from_secs_f64(((t - start_unix_ms) / 1e3).max(0.0)))
                    .unwrap_or_else(|| start.elapsed());
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
    // Kernel times of replies read in a burst may be a hair out of order.
    arrivals.sort();
    let mut gaps = Vec::with_capacity(arrivals.len() + 1);
    let mut prev = Duration::ZERO;
    for &a in &arrivals {
        gaps.push((prev, a.saturating_sub(prev)));
        prev = a;
    }
    gaps.push((prev, run_end.saturating_sub(prev)));
    let (longest_start, longest) = gaps.iter().copied().fold(
        (Duration::ZERO, Duration::ZERO),
        |m, g| {
            if g.1 > m.1 {
                g
            } else {
                m
            }
        },
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    gaps.retain(|g| g.1 >= interval * LONG_GAP_INTERVALS);
    gaps.sort_by_key(|g| std::cmp::Reverse(g.1));
    gaps.truncate(MAX_LONG_GAPS);
    gaps.sort_by_key(|g| g.0);
    let long_gaps = gaps.iter().map(|&(s, d)| Gap { start_ms: ms(s), ms: ms(d) }).collect();
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
    let pick = |q: f64| (!rtts.is_empty()).then(|| crate::stats::percentile_sorted(&rtts, q));
    Ok(PingReport {
        target: target.to_string(),
        interval_ms: interval.as_secs_f64() * 1e3,
        start_unix_ms,
        sent: count,
        received: rtts.len() as u64,
        longest_gap_ms: longest.as_secs_f64() * 1e3,
        longest_gap_start_ms: longest_start.as_secs_f64() * 1e3,
        last_reply_ms: arrivals.last().map(|a| a.as_secs_f64() * 1e3),
        long_gaps,
        rtt_median_ms: pick(0.5),
        rtt_p99_ms: pick(0.99),
        rtt_max_ms: rtts.last().copied(),
        bad_windows,
        client_stall_ms: ms(client_stall),
        client_realtime,
        arrivals_ms: arrivals.iter().map(|&a| ms(a)).collect(),
    })
}

/// Makes the calling thread an ordinary thread again when dropped, if it
/// was made real-time (the pinger may run on a caller's thread).
struct RestorePolicy(bool);

impl Drop for RestorePolicy {
    fn drop(&mut self) {
        if self.0 {
            let _ = nl_sandbox::affinity::set_other(0);
        }
    }
}

/// One datagram into `buf`: its length and, with `kernel_times`, when the
/// kernel received it (ms since the Unix epoch).
fn receive(
    sock: &UdpSocket,
    buf: &mut [u8],
    kernel_times: bool,
) -> std::io::Result<(usize, Option<f64>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::AsRawFd;
    if !kernel_times {
        return sock.recv(buf).map(|n| (n, None));
    }
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty())
        .map_err(std::io::Error::from)?;
    let at = msg.cmsgs().find_map(|c| match c {
        ControlMessageOwned::ScmTimestampns(t) => {
            Some(t.tv_sec() as f64 * 1e3 + t.tv_nsec() as f64 / 1e6)
        }
        _ => None,
    });
    Ok((msg.bytes, at))
}

pub fn run(a: PingArgs) -> Result<ExitCode> {
    if !(a.duration.is_finite() && a.duration > 0.0 && a.duration <= 86_400.0) {
        bail!("--duration {} must be between 0 and 86400 seconds", a.duration);
    }
    if a.interval.as_secs_f64() > a.duration {
        bail!(
            "--interval {:?} is longer than --duration {} s: no ping would be answered in time",
            a.interval,
            a.duration
        );
    }
    let target = target_addr(&a.target)?;
    let stop = Arc::new(AtomicBool::new(false));
    if a.until_stdin_eof {
        let s = stop.clone();
        std::thread::Builder::new().name("stdin-eof".into()).spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            s.store(true, Relaxed);
        })?;
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "sending")?;
        out.flush()?;
    }
    let stop = a.until_stdin_eof.then_some(&*stop);
    let r = ping(target, a.interval, Duration::from_secs_f64(a.duration), stop)?;
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

pub(crate) fn unix_ms(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// A `ninelives ping ... --until-stdin-eof --json` child run across an event
/// by a bench (rejuvenation, primary kill): the bench notes its events as
/// [`Instant`]s and places them on the report's clock afterwards
/// ([`PingResult::ms_at`]); closing the pinger's stdin ends the run. Killed
/// on drop.
pub struct PingRun {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Option<BufReader<ChildStdout>>,
    /// When the pinger said `sending`, as an Instant and on the wall clock.
    t0: Instant,
    t0_unix_ms: f64,
}

impl PingRun {
    /// Starts `cmd` (a `ninelives ping` with `--until-stdin-eof --json`,
    /// perhaps under `ip netns exec`) and waits until it says `sending`.
    pub fn start(mut cmd: Command) -> Result<PingRun> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start ninelives ping")?;
        let stdin = child.stdin.take();
        let out = child.stdout.take().map(BufReader::new);
        let mut p = PingRun { child, stdin, out, t0: Instant::now(), t0_unix_ms: 0.0 };
        let mut line = String::new();
        let n = p.out.as_mut().map_or(Ok(0), |o| o.read_line(&mut line))?;
        if n == 0 || line.trim() != "sending" {
            bail!("ninelives ping did not start (said {line:?})");
        }
        p.t0 = Instant::now();
        p.t0_unix_ms = unix_ms(std::time::SystemTime::now());
        Ok(p)
    }

    /// Ends the run (EOF on its stdin: the pinger stops sending, waits at
    /// most 1 s for stragglers) and returns its JSON report.
    pub fn finish(mut self) -> Result<PingResult> {
        drop(self.stdin.take());
        let mut rest = String::new();
        if let Some(o) = self.out.as_mut() {
            o.read_to_string(&mut rest).context("reading the ping report")?;
        }
        let _ = self.child.wait();
        let report =
            crate::json_out::last_json(&rest).context("ninelives ping printed no result")?;
        // How long before `t0` the report's clock started: the pinger starts
        // it right after saying `sending`, and this process may read that
        // late on a loaded machine. Both read the same wall clock; a result
        // that is not plausible (a clock step) is ignored.
        let lead = report["start_unix_ms"].as_f64().map_or(0.0, |s| self.t0_unix_ms - s);
        let lead_ms = if lead.abs() < 1000.0 { lead } else { 0.0 };
        Ok(PingResult { report, t0: self.t0, lead_ms })
    }
}

impl Drop for PingRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A [`PingRun`]'s report, and its clock.
pub struct PingResult {
    pub report: Value,
    t0: Instant,
    lead_ms: f64,
}

impl PingResult {
    /// `t` on the report's clock (ms since the first send; negative before).
    pub fn ms_at(&self, t: Instant) -> f64 {
        let since_t0 = match t.checked_duration_since(self.t0) {
            Some(d) => d.as_secs_f64() * 1e3,
            None => -(self.t0.duration_since(t).as_secs_f64() * 1e3),
        };
        since_t0 + self.lead_ms
    }
}

/// The longest gap in a ping report's `long_gaps` that overlaps the event
/// from `begin_ms` to `end_ms` (times on the report's clock; for an
/// instant, begin = end), if any gap of 3 intervals or more does.
pub fn gap_across(report: &Value, begin_ms: f64, end_ms: f64) -> Option<Gap> {
    report["long_gaps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| Some(Gap { start_ms: g["start_ms"].as_f64()?, ms: g["ms"].as_f64()? }))
        .filter(|g| g.start_ms < end_ms && g.start_ms + g.ms > begin_ms)
        .max_by(|x, y| x.ms.total_cmp(&y.ms))
}

/// Pings sent and not answered, from a ping report (null if it lacks them).
pub fn lost(report: &Value) -> Value {
    match (report["sent"].as_u64(), report["received"].as_u64()) {
        (Some(s), Some(r)) => json!(s.saturating_sub(r)),
        _ => Value::Null,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A loopback UDP echo that drops the pings with sequence numbers in
    /// `drop` and counts the pings it saw; ends when `done` is set (or after
    /// 20 s).
    fn echo(drop: std::ops::Range<u64>, seen: Arc<AtomicU64>, done: Arc<AtomicBool>) -> SocketAddr {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
        let addr = s.local_addr().unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            let mut b = [0u8; 64];
            while !done.load(Relaxed) && t.elapsed() < Duration::from_secs(20) {
                if let Ok((n, from)) = s.recv_from(&mut b) {
                    seen.fetch_add(1, Relaxed);
                    let seq = u64::from_le_bytes(b[..8].try_into().unwrap());
                    if !drop.contains(&seq) {
                        let _ = s.send_to(&b[..n], from);
                    }
                }
            }
        });
        addr
    }

    #[test]
    fn stop_ends_the_run_early_and_unanswered_pings_count_as_lost() {
        let seen = Arc::new(AtomicU64::new(0));
        let (done, stop) = (Arc::new(AtomicBool::new(false)), AtomicBool::new(false));
        let addr = echo(100..160, seen.clone(), done.clone());
        let r = std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                ping(addr, Duration::from_millis(1), Duration::from_secs(30), Some(&stop))
            });
            let t = Instant::now();
            while seen.load(Relaxed) < 200 && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(5));
            }
            stop.store(true, Relaxed);
            h.join().unwrap().unwrap()
        });
        done.store(true, Relaxed);
        // Stopped long before the 30 s (30,000 pings) it was given.
        assert!(r.sent >= 200 && r.sent < 30_000, "{r:?}");
        assert_eq!(r.received, r.sent - 60, "exactly the dropped ones are lost: {r:?}");
        // The listed gaps are long ones, in time order, none past the longest.
        assert!(r.long_gaps.iter().all(|g| g.ms >= 3.0 && g.ms <= r.longest_gap_ms), "{r:?}");
        assert!(r.long_gaps.windows(2).all(|w| w[0].start_ms <= w[1].start_ms), "{r:?}");
        assert!(r.last_reply_ms.is_some_and(|l| l >= r.longest_gap_start_ms), "{r:?}");
    }

    #[test]
    fn the_gap_across_an_event_is_the_longest_one_overlapping_it() {
        let r = serde_json::json!({"sent": 10, "received": 7, "long_gaps": [
            {"start_ms": 0.0, "ms": 50.0},
            {"start_ms": 100.0, "ms": 5.0},
            {"start_ms": 104.0, "ms": 30.0},
            {"start_ms": 200.0, "ms": 90.0},
        ]});
        // An instant inside one gap.
        let g = gap_across(&r, 110.0, 110.0).unwrap();
        assert_eq!((g.start_ms, g.ms), (104.0, 30.0));
        // A span overlapping two: the longer.
        let g = gap_across(&r, 101.0, 103.0).unwrap();
        assert_eq!((g.start_ms, g.ms), (100.0, 5.0));
        let g = gap_across(&r, 101.0, 250.0).unwrap();
        assert_eq!((g.start_ms, g.ms), (200.0, 90.0));
        assert!(gap_across(&r, 60.0, 90.0).is_none());
        assert_eq!(lost(&r), 3);
        assert_eq!(crate::json_out::last_json("x\n{\"a\": 1}\nreport\n").unwrap()["a"], 1);
    }
}
