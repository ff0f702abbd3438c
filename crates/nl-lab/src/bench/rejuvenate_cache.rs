//! `bench rejuvenate`, the warm-VM reboot paper's Figure 8: the throughput
//! of a guest's file cache (the `filecache` workload) in the first seconds
//! after a warm, a cold and a save-restore rejuvenation, relative to before.
//!
//! For each mode: a host of its own, one filecache VM with a fresh disk
//! image; once the cache is warm (steady state), the VM's counters are
//! sampled every [`SAMPLE_MS`] ms for [`BEFORE_S`] s, the host is
//! rejuvenated, and sampling goes on for [`AFTER_S`] s; then again, on the
//! same host, until the mode has its repetitions (`--reps`), each against
//! the "before" measured just ahead of it. Throughput is the
//! growth of the guest's heartbeat (bytes served, written every 10 ms of
//! guest time) over host time; a cold reboot restarts the guest's counters,
//! which the series handles by counting from the restarted value.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::rejuvenate::HostProc;

/// Sampling period of the VM's counters.
pub const SAMPLE_MS: u64 = 100;
/// Seconds sampled before the rejuvenation (the "before" throughput).
pub const BEFORE_S: f64 = 3.0;
/// Seconds sampled after the rejuvenation returned.
pub const AFTER_S: f64 = 10.0;
/// Longest wait for the cache to reach steady state after the first boot.
const STEADY_TIMEOUT: Duration = Duration::from_secs(90);
/// Steady state: at least this hit rate over the last second. A miss costs
/// about 15 hits here (more on a loaded machine), so at 95% hits the
/// throughput is still well below the warm cache's; at 99.8% it is within a
/// few percent.
const STEADY_HIT_RATE: f64 = 0.998;
/// "Recovered": throughput over a [`RECOVERY_WINDOW_S`] window at least
/// this share of the throughput before.
const RECOVERED_SHARE: f64 = 0.9;
const RECOVERY_WINDOW_S: f64 = 0.5;

/// One reading of the VM's counters and of the host process's CPU time.
#[derive(Clone, Copy, Debug, Default)]
struct Reading {
    t_s: f64,
    /// Bytes served in the measured period (the heartbeat value).
    bytes: u64,
    hits: u64,
    misses: u64,
    /// The process serving the API and the CPU time all its threads have
    /// run (schedstat, ns): the VM's vCPU thread, which also does its I/O,
    /// is nearly all of it. None when the process changed around the reading.
    cpu: Option<(u32, u64)>,
}

/// Counters that keep growing across a restart of the guest's own (cold
/// reboot): after a drop of the byte counter the new values count from
/// zero. CPU time is only counted over intervals within one process, with
/// the bytes served in those intervals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Point {
    t_s: f64,
    bytes: f64,
    hits: f64,
    misses: f64,
    cpu_s: f64,
    /// Bytes, and wall seconds, of the intervals with a CPU time.
    cpu_bytes: f64,
    cpu_wall_s: f64,
}

/// The CPU seconds between two readings, if both come from one process.
fn cpu_between(p: &Reading, r: &Reading) -> Option<f64> {
    match (p.cpu, r.cpu) {
        (Some((a, x)), Some((b, y))) if a == b && y >= x => Some((y - x) as f64 / 1e9),
        _ => None,
    }
}

fn cumulative(readings: &[Reading]) -> Vec<Point> {
    let mut out: Vec<Point> = Vec::with_capacity(readings.len());
    let mut prev: Option<Reading> = None;
    let mut acc = Point::default();
    for r in readings {
        if let Some(p) = prev {
            let restarted = r.bytes < p.bytes;
            let d = |now: u64, before: u64| {
                if restarted || now < before {
                    now as f64
                } else {
                    (now - before) as f64
                }
            };
            let bytes = d(r.bytes, p.bytes);
            acc.bytes += bytes;
            acc.hits += d(r.hits, p.hits);
            acc.misses += d(r.misses, p.misses);
            if let Some(c) = cpu_between(&p, r) {
                acc.cpu_s += c;
                acc.cpu_bytes += bytes;
                acc.cpu_wall_s += r.t_s - p.t_s;
            }
        }
        acc.t_s = r.t_s;
        out.push(acc);
        prev = Some(*r);
    }
    out
}

/// What happened between two points.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Win {
    secs: f64,
    bytes: f64,
    hits: f64,
    misses: f64,
    cpu_s: f64,
    cpu_bytes: f64,
    cpu_wall_s: f64,
}

impl Win {
    fn between(p: &Point, q: &Point) -> Self {
        Win {
            secs: q.t_s - p.t_s,
            bytes: q.bytes - p.bytes,
            hits: q.hits - p.hits,
            misses: q.misses - p.misses,
            cpu_s: q.cpu_s - p.cpu_s,
            cpu_bytes: q.cpu_bytes - p.cpu_bytes,
            cpu_wall_s: q.cpu_wall_s - p.cpu_wall_s,
        }
    }

    /// Bytes served per second of wall time.
    fn rate(&self) -> f64 {
        self.bytes / self.secs
    }

    /// Bytes served per second of the host process's CPU time: what the
    /// throughput would be with a core of its own (the machines are shared).
    fn cpu_rate(&self) -> f64 {
        if self.cpu_s > 0.0 {
            self.cpu_bytes / self.cpu_s
        } else {
            f64::NAN
        }
    }

    fn hit_rate(&self) -> f64 {
        if self.hits + self.misses > 0.0 {
            self.hits / (self.hits + self.misses)
        } else {
            f64::NAN
        }
    }

    /// Share of one core the host process got.
    fn cpu_share(&self) -> f64 {
        self.cpu_s / self.cpu_wall_s
    }
}

/// The window between the first point at or after `a` and the last at or
/// before `b`; None without two such points.
fn window(pts: &[Point], a: f64, b: f64) -> Option<Win> {
    let i = pts.iter().position(|p| p.t_s >= a)?;
    let j = pts.iter().rposition(|p| p.t_s <= b)?;
    (j > i && pts[j].t_s > pts[i].t_s).then(|| Win::between(&pts[i], &pts[j]))
}

/// Seconds from `from` until `metric` over a window of
/// [`RECOVERY_WINDOW_S`] first reaches `share` of `before`.
fn recovery_s(
    pts: &[Point],
    from: f64,
    before: f64,
    share: f64,
    metric: fn(&Win) -> f64,
) -> Option<f64> {
    pts.iter().filter(|p| p.t_s >= from).find_map(|p| {
        let w = window(pts, p.t_s, p.t_s + RECOVERY_WINDOW_S)?;
        (w.secs >= RECOVERY_WINDOW_S * 0.8 && metric(&w) >= share * before).then_some(p.t_s - from)
    })
}

/// One request to the host API with short timeouts; None if it failed (the
/// host busy with a handover, a connection the old process accepted just
/// before it exited).
fn ask(sock: &Path, req: &Value) -> Option<Value> {
    let v = nl_vmm::api::request_timeout(sock, req, Duration::from_secs(5)).ok()?;
    (v["ok"] == true).then_some(v)
}

/// CPU time all threads of `pid` have run, in ns.
fn cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let s = std::fs::read_to_string(t.ok()?.path().join("schedstat")).unwrap_or_default();
        total += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Some(total)
}

/// A thread reading the VM's counters every [`SAMPLE_MS`] ms.
struct Sampler {
    readings: Arc<Mutex<Vec<Reading>>>,
    /// A failed state of the VM, if it was seen.
    bad_state: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    t0: Instant,
}

impl Sampler {
    fn start(sock: PathBuf, id: u64) -> Self {
        let readings = Arc::new(Mutex::new(Vec::new()));
        let bad_state = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let (r, b, s) = (readings.clone(), bad_state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let period = Duration::from_millis(SAMPLE_MS);
            let mut next = Instant::now();
            while !s.load(Relaxed) {
                // The process that answered before and after the stats (two
                // may answer during a handover): the CPU time is its.
                let pid = || {
                    ask(&sock, &json!({"op":"info"}))
                        .and_then(|i| u32::try_from(i["pid"].as_u64()?).ok())
                };
                let before = pid();
                let st = ask(&sock, &json!({"op":"stats","id":id})).map(|v| v["stats"].clone());
                let cpu = match (before, pid()) {
                    (Some(a), Some(b)) if a == b => cpu_ns(a).map(|ns| (a, ns)),
                    _ => None,
                };
                if let Some(st) = st {
                    let t_s = t0.elapsed().as_secs_f64();
                    let regs = &st["vcpus"][0]["regs"];
                    let g = |k: &str| regs[k].as_u64().unwrap_or(0);
                    let state = st["state"].as_str().unwrap_or("");
                    // Paused: during a handover (its counters stand still).
                    if state == "running" || state == "paused" {
                        if let Ok(mut v) = r.lock() {
                            v.push(Reading {
                                t_s,
                                bytes: g("heartbeat"),
                                hits: g("cache_hits"),
                                misses: g("cache_misses"),
                                cpu,
                            });
                        }
                    } else if state.starts_with("failed") {
                        if let Ok(mut v) = b.lock() {
                            *v = Some(state.to_string());
                        }
                    }
                }
                // A late reading (the host busy) is followed by a full
                // period, not by a burst of readings a few ms apart.
                next += period;
                let now = Instant::now();
                if next < now + period / 2 {
                    next = now + period;
                }
                std::thread::sleep(next - now);
            }
        });
        Sampler { readings, bad_state, stop, thread: Some(thread), t0 }
    }

    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn points(&self) -> Vec<Point> {
        cumulative(&self.readings.lock().map(|v| v.clone()).unwrap_or_default())
    }

    fn check(&self) -> Result<()> {
        if let Some(s) = self.bad_state.lock().ok().and_then(|s| s.clone()) {
            bail!("the filecache VM is {s}");
        }
        Ok(())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits until the cache is warm: at least [`STEADY_HIT_RATE`] hits over
/// the last second. Returns whether it got there in time.
fn wait_steady(s: &Sampler) -> Result<bool> {
    let t = Instant::now();
    while t.elapsed() < STEADY_TIMEOUT {
        std::thread::sleep(Duration::from_millis(250));
        s.check()?;
        let pts = s.points();
        let Some(last) = pts.last() else { continue };
        if window(&pts, last.t_s - 1.0, last.t_s)
            .is_some_and(|w| w.hit_rate() >= STEADY_HIT_RATE && w.bytes > 0.0)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// A window as JSON, relative to `before` when given.
fn win_json(w: Option<Win>, before: Option<&Win>) -> Value {
    let Some(w) = w else { return Value::Null };
    let mut v = json!({
        "secs": w.secs,
        "bytes_per_sec": w.rate(),
        "bytes_per_cpu_sec": w.cpu_rate(),
        "hits": w.hits,
        "misses": w.misses,
        "hit_rate": w.hit_rate(),
        "cpu_share": w.cpu_share(),
    });
    if let Some(b) = before {
        v["relative"] = json!(w.rate() / b.rate());
        v["relative_cpu"] = json!(w.cpu_rate() / b.cpu_rate());
    }
    v
}

/// The 1-minute load average (the machines are shared; throughput follows it).
fn load_avg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// One rejuvenation of a mode's host: when it was asked for and answered,
/// the load before it, and the host's report.
struct Rejuvenation {
    t_start: f64,
    t_done: f64,
    load_before: Option<f64>,
    steady: bool,
    report: Value,
}

/// One mode: a fresh host and VM; then `reps` times steady state (the
/// cache warm again), [`BEFORE_S`] s of "before", the rejuvenation, and
/// [`AFTER_S`] s after it. Each repetition is compared with its own
/// "before", measured just ahead of it. One result per repetition.
fn one_mode(mode: &str, image_dir: &Option<PathBuf>, dir: &Path, reps: u32) -> Result<Vec<Value>> {
    let sock = dir.join(format!("api-{mode}.sock"));
    let disk = dir.join(format!("disk-{mode}.img"));
    let data = nl_workloads::filecache::DEFAULT_DATA_BYTES;
    let ws = nl_workloads::filecache::ws_bytes_for(data);
    // The cache plus the guest's fixed areas (34 MiB) and some slack.
    let mem = ((ws + (40 << 20)).div_ceil(1 << 20) << 20).max(256 << 20);
    nl_launch::guest::ensure_disk(&disk, nl_workloads::filecache::disk_bytes(data))?;
    let h = HostProc::start(&sock, None)?;
    let r = h.req(json!({"op":"create","workload":"filecache","data":data,"mem":mem,
        "disk":disk,"duration":86_000,"seed":8}))?;
    let id = r["id"].as_u64().context("create gave no id")?;
    let sampler = Sampler::start(sock.clone(), id);
    let mut done = Vec::new();
    for rep in 0..reps {
        let steady = wait_steady(&sampler)?;
        std::thread::sleep(Duration::from_secs_f64(BEFORE_S));
        sampler.check()?;
        let load_before = load_avg();
        let t_start = sampler.now();
        let mut req = json!({"op":"rejuvenate","mode":mode,"timeout_secs":600});
        if let Some(d) = image_dir {
            req["image_dir"] = json!(d);
        }
        let report = h.req(req)?["report"].clone();
        let t_done = sampler.now();
        if report["ok"] != true {
            bail!("{mode} rejuvenation {} of {reps} failed: {}", rep + 1, report["error"]);
        }
        std::thread::sleep(Duration::from_secs_f64(AFTER_S));
        sampler.check()?;
        done.push(Rejuvenation { t_start, t_done, load_before, steady, report });
    }
    let pts = sampler.points();
    drop(sampler);
    let _ = h.req(json!({"op":"destroy","id":id}));
    drop(h);
    let _ = std::fs::remove_file(&disk);
    done.iter().enumerate().map(|(rep, r)| mode_result(mode, rep, &pts, r)).collect()
}

/// One repetition's result: its before window, the windows after it, the
/// recovery times and its series.
fn mode_result(mode: &str, rep: usize, pts: &[Point], r: &Rejuvenation) -> Result<Value> {
    let (t_start, t_done) = (r.t_start, r.t_done);
    // Not into the next repetition's readings.
    let pts: Vec<Point> = pts.iter().filter(|p| p.t_s <= t_done + AFTER_S).copied().collect();
    let pts = pts.as_slice();
    let Some(before) = window(pts, t_start - BEFORE_S, t_start) else {
        bail!("no readings of the filecache VM before the {mode} rejuvenation (repetition {rep})");
    };
    let after = |secs: f64| window(pts, t_done, t_done + secs);
    let series: Vec<Value> = pts
        .windows(2)
        .filter(|p| p[1].t_s >= t_start - BEFORE_S - 1.0 && p[1].t_s <= t_done + AFTER_S)
        .map(|p| {
            let w = Win::between(&p[0], &p[1]);
            json!({
                "t_ms": ((p[1].t_s - t_done) * 1e3).round(),
                "bytes_per_sec": w.rate(),
                "bytes_per_cpu_sec": (w.cpu_wall_s > 0.0).then(|| w.cpu_rate()),
                "hits": w.hits,
                "misses": w.misses,
            })
        })
        .collect();
    let ms = |s: Option<f64>| s.map(|s| s * 1e3);
    Ok(json!({
        "mode": mode,
        "rep": rep,
        "load_avg_1m": r.load_before,
        "steady_reached": r.steady,
        "rejuvenation_ms": (t_done - t_start) * 1e3,
        "vm_downtime_ms": r.report["vms"][0]["downtime_ms"],
        "before": win_json(Some(before), None),
        "after_1s": win_json(after(1.0), Some(&before)),
        "after_3s": win_json(after(3.0), Some(&before)),
        "after_all": win_json(after(AFTER_S), Some(&before)),
        "recovery_to_90pct_ms": ms(recovery_s(pts, t_done, before.rate(), RECOVERED_SHARE, Win::rate)),
        "recovery_to_90pct_cpu_ms":
            ms(recovery_s(pts, t_done, before.cpu_rate(), RECOVERED_SHARE, Win::cpu_rate)),
        "series": series,
    }))
}

/// Figure 8 for the three modes (see the module documentation), each
/// rejuvenated `reps` times; `modes` holds each mode's median repetition
/// (by throughput per CPU second in the first second) with the spread of
/// every repetition, `samples` every repetition. With `plot`, also
/// `figure8-filecache.svg` there (throughput relative to before over
/// time, one line per mode: its median repetition).
pub fn measure(
    image_dir: &Option<PathBuf>,
    plot: Option<&Path>,
    quiet: bool,
    reps: u32,
) -> Result<Value> {
    let dir =
        std::env::temp_dir().join(format!("ninelives-bench-filecache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut modes = Vec::new();
    let mut samples = Vec::new();
    for mode in ["warm", "cold", "save-restore"] {
        let runs = match one_mode(mode, image_dir, &dir, reps) {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.context(format!("filecache after a {mode} rejuvenation")));
            }
        };
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        if !quiet {
            let pct = |v: &Value| format!("{:>4.0}%", 100.0 * f(v));
            let ms = |v: &Value| v.as_f64().map_or("never".to_string(), |x| format!("{x:.0} ms"));
            for r in &runs {
                println!(
                    "filecache {mode:<12} rep {}: per CPU second: after 1 s {}, 3 s {} of before, 90% again after {}; per wall second: {} / {}, {}; hits after 1 s {:.3}",
                    r["rep"],
                    pct(&r["after_1s"]["relative_cpu"]),
                    pct(&r["after_3s"]["relative_cpu"]),
                    ms(&r["recovery_to_90pct_cpu_ms"]),
                    pct(&r["after_1s"]["relative"]),
                    pct(&r["after_3s"]["relative"]),
                    ms(&r["recovery_to_90pct_ms"]),
                    f(&r["after_1s"]["hit_rate"]),
                );
            }
        }
        let key = |r: &Value| f(&r["after_1s"]["relative_cpu"]);
        let mut order: Vec<usize> = (0..runs.len()).collect();
        order.sort_by(|&a, &b| key(&runs[a]).total_cmp(&key(&runs[b])));
        let values: Vec<f64> = runs.iter().map(key).collect();
        let mut m = runs[order[(order.len() - 1) / 2]].clone();
        let (lo, hi) = (key(&runs[order[0]]), key(&runs[order[order.len() - 1]]));
        m["reps"] = json!(runs.len());
        m["after_1s_relative_cpu_samples"] = json!(values);
        m["after_1s_relative_cpu_min"] = json!(lo);
        m["after_1s_relative_cpu_max"] = json!(hi);
        if !quiet {
            println!(
                "filecache {mode:<12}: after 1 s, per CPU second: median {:.0}% [{:.0}%, {:.0}%] of before over {} repetitions",
                100.0 * key(&m),
                100.0 * lo,
                100.0 * hi,
                runs.len()
            );
        }
        modes.push(m);
        samples.extend(runs.into_iter().map(|mut r| {
            r["series"] = Value::Null;
            r
        }));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let figure = match plot {
        Some(d) => Some(plot_modes(d, &modes)?),
        None => None,
    };
    if let (Some(p), false) = (&figure, quiet) {
        println!("filecache: figure written to {}", p.display());
    }
    let data = nl_workloads::filecache::DEFAULT_DATA_BYTES;
    Ok(json!({
        "figure": figure,
        "workload": {
            "data_bytes": data,
            "cache_bytes": nl_workloads::filecache::ws_bytes_for(data),
            "block_bytes": nl_workloads::filecache::BLOCK_BYTES,
            "hot": "90% of the requests to 10% of the blocks",
        },
        "sample_ms": SAMPLE_MS,
        "samples": samples,
        "definitions": {
            "before": "the last 3 s before the rejuvenation request",
            "after_Ns": "from the rejuvenation's reply to N s later (the downtime itself is not in it); relative = bytes/s over before's",
            "bytes_per_cpu_sec": "bytes served per second of CPU time of the host process (the vCPU thread, which also does the I/O, is nearly all of it): insensitive to the machine's other load; relative_cpu compares these",
            "cpu_share": "CPU seconds the host process got per second",
            "recovery_to_90pct_ms": "from the reply until a 0.5 s window first reaches 90% of before (_cpu: of bytes per CPU second)",
            "series": "t_ms from the reply (negative: before), bytes per second and per CPU second, hits and misses per sample interval",
        },
        "modes": modes,
    }))
}

/// The series of every mode relative to its own throughput before: per
/// second of CPU time (`figure8-filecache.svg`) and of wall time
/// (`figure8-filecache-wall.svg`). Returns the first.
fn plot_modes(dir: &Path, modes: &[Value]) -> Result<PathBuf> {
    let series = |key: &str| -> Vec<crate::figures::Series> {
        modes
            .iter()
            .map(|m| {
                let before = m["before"][key].as_f64().unwrap_or(f64::NAN);
                crate::figures::Series {
                    label: m["mode"].as_str().unwrap_or("?").to_string(),
                    points: m["series"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|p| {
                            let y = p[key].as_f64().unwrap_or(f64::NAN) / before;
                            (p["t_ms"].as_f64().unwrap_or(f64::NAN) / 1e3, y)
                        })
                        .collect(),
                }
            })
            .collect()
    };
    let x = "seconds after the rejuvenation returned";
    crate::figures::time_chart(
        dir,
        "figure8-filecache-wall",
        "filecache throughput around a rejuvenation (bytes per wall-clock second)",
        (x, "throughput / throughput before"),
        &series("bytes_per_sec"),
        Some(1.0),
    )?;
    crate::figures::time_chart(
        dir,
        "figure8-filecache",
        "filecache throughput around a rejuvenation (bytes per CPU second of the VMM)",
        (x, "throughput / throughput before"),
        &series("bytes_per_cpu_sec"),
        Some(1.0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(t_s: f64, bytes: u64, hits: u64, misses: u64) -> Reading {
        Reading { t_s, bytes, hits, misses, cpu: Some((1, (t_s * 5e8) as u64)) }
    }

    #[test]
    fn a_restart_of_the_counters_keeps_the_series_growing() {
        let mut v =
            vec![r(0.0, 100, 10, 0), r(1.0, 300, 30, 0), r(2.0, 50, 1, 4), r(3.0, 60, 2, 4)];
        // A new process from the third reading on, which has run 0.1 s.
        v[2].cpu = Some((2, 100_000_000));
        v[3].cpu = Some((2, 600_000_000));
        let pts = cumulative(&v);
        let p = |t_s, bytes, hits, misses, cpu_s, cpu_bytes, cpu_wall_s| Point {
            t_s,
            bytes,
            hits,
            misses,
            cpu_s,
            cpu_bytes,
            cpu_wall_s,
        };
        assert_eq!(pts[1], p(1.0, 200.0, 20.0, 0.0, 0.5, 200.0, 1.0));
        // Across the change of process the CPU time is unknown: not counted.
        assert_eq!(pts[2], p(2.0, 250.0, 21.0, 4.0, 0.5, 200.0, 1.0));
        assert_eq!(pts[3], p(3.0, 260.0, 22.0, 4.0, 1.0, 210.0, 2.0));
        let w = Win::between(&pts[0], &pts[3]);
        assert_eq!((w.cpu_rate(), w.cpu_share(), w.rate()), (210.0, 0.5, 260.0 / 3.0));
        // A reading without a process (two answered) breaks the CPU series too.
        v[3].cpu = None;
        assert_eq!(cumulative(&v)[3].cpu_s, 0.5);
    }

    #[test]
    fn windows_rates_and_recovery() {
        // 100 B/s until t = 10, nothing for 1 s, then 20 B/s for 2 s, then 100 B/s;
        // half a core throughout.
        let mut v = Vec::new();
        let mut b = 0;
        for i in 0..=200u64 {
            let t = i as f64 * 0.1;
            v.push(r(t, b, b, 0));
            b += match t {
                t if t < 10.0 => 10,
                t if t < 11.0 => 0,
                t if t < 13.0 => 2,
                _ => 10,
            };
        }
        let pts = cumulative(&v);
        let w = window(&pts, 5.0, 10.0).unwrap();
        assert!((w.rate() - 100.0).abs() < 1e-6);
        assert!((w.cpu_rate() - 200.0).abs() < 1e-3);
        assert!((w.cpu_share() - 0.5).abs() < 1e-6);
        assert!((window(&pts, 11.0, 13.0).unwrap().rate() - 20.0).abs() < 1e-6);
        let rec = recovery_s(&pts, 10.0, 100.0, 0.9, Win::rate).unwrap();
        assert!((rec - 3.0).abs() < 0.11, "{rec}");
        assert!(recovery_s(&pts, 10.0, 1000.0, 0.9, Win::rate).is_none());
        assert!(window(&pts, 30.0, 40.0).is_none());
        let w = Win { secs: 1.0, bytes: 1.0, hits: 3.0, misses: 1.0, ..Win::default() };
        assert_eq!(w.hit_rate(), 0.75);
        assert!(w.cpu_rate().is_nan());
        let j = win_json(Some(w), Some(&Win { bytes: 2.0, ..w }));
        assert_eq!(j["relative"], 0.5);
        assert_eq!(win_json(None, None), Value::Null);
    }
}
