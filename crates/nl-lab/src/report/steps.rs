//! What a report measures: each step is one `ninelives` command run as a
//! child process of this binary with `--json`; its last JSON line is the
//! step's result, kept as `data/<step>.json`.

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::{Data, Machine, Size, StepRun};
use crate::json_out::{last_json, loadavg};

/// One measurement of the report.
pub struct Step {
    /// File stem of its result (`data/<name>.json`).
    pub name: &'static str,
    /// The arguments of `ninelives` (without `--json`) for `--quick`.
    pub quick: &'static [&'static str],
    /// The same for `--full`.
    pub full: &'static [&'static str],
}

macro_rules! inject {
    ($name:literal, $fault:literal, $recovery:literal, $repairs:literal, $q:literal, $f:literal) => {
        Step {
            name: $name,
            quick: &[
                "inject",
                "--fault",
                $fault,
                "--setup",
                "1vm",
                "--recovery",
                $recovery,
                "--repairs",
                $repairs,
                "--runs",
                $q,
                "--duration",
                "2",
            ],
            full: &[
                "inject",
                "--fault",
                $fault,
                "--setup",
                "3vm",
                "--recovery",
                $recovery,
                "--repairs",
                $repairs,
                "--runs",
                $f,
                "--duration",
                "3",
            ],
        }
    };
}

/// The most one step may run with `--quick` (a hung step is stopped and
/// shown as not measured; the whole quick run stays bounded).
pub const QUICK_STEP_LIMIT: Duration = Duration::from_secs(8 * 60);
/// The same with `--full`.
pub const FULL_STEP_LIMIT: Duration = Duration::from_secs(4 * 3600);

/// Waits for `child` up to `limit`; past it, SIGTERM (the benches stop
/// their hosts and delete their namespaces on it), then SIGKILL 10 s later.
/// None when it was stopped. The child stays in the report's process
/// group, so a Ctrl-C on the report stops the step too.
fn wait_or_stop(child: &mut Child, limit: Duration) -> Result<Option<ExitStatus>> {
    let t = Instant::now();
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if t.elapsed() > limit {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let grace = Instant::now();
            while child.try_wait()?.is_none() && grace.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every step, in the order they run.
pub const STEPS: &[Step] = &[
    Step {
        name: "bench",
        quick: &[
            "bench",
            "--duration",
            "0.5",
            "--reps",
            "3",
            "--boots",
            "3",
            "--workloads",
            "memwrite,compute,exits,blkbench",
        ],
        full: &["bench", "--reps", "5", "--boots", "10"],
    },
    Step {
        name: "checkpoint",
        quick: &[
            "bench",
            "checkpoint",
            "--duration",
            "0.5",
            "--intervals",
            "200,50",
            "--reps",
            "3",
            "--faults",
            "8",
        ],
        full: &["bench", "checkpoint"],
    },
    Step {
        name: "sandbox",
        quick: &[
            "bench",
            "sandbox",
            "--reps",
            "3",
            "--max-msg",
            "4096",
            "--seeds",
            "5",
            "--storm-ms",
            "2000",
        ],
        full: &["bench", "sandbox", "--reps", "5", "--seeds", "20"],
    },
    Step {
        name: "sandbox-recovery",
        quick: &[
            "bench",
            "sandbox-recovery",
            "--reps",
            "3",
            "--injections",
            "0",
            "--fig10-secs",
            "0",
        ],
        full: &["bench", "sandbox-recovery", "--reps", "5", "--injections", "500"],
    },
    Step {
        name: "recovery",
        quick: &["bench", "recovery", "--runs", "3", "--rounds", "3", "--duration", "1"],
        full: &["bench", "recovery", "--runs", "5", "--rounds", "5"],
    },
    inject!("inject-register-none", "register", "none", "all", "16", "200"),
    inject!("inject-code-none", "code", "none", "all", "16", "200"),
    inject!("inject-failstop-microreset-norepairs", "failstop", "microreset", "none", "4", "100"),
    inject!(
        "inject-failstop-microreset-counters",
        "failstop",
        "microreset",
        "counters",
        "4",
        "100"
    ),
    inject!(
        "inject-failstop-microreset-rehype",
        "failstop",
        "microreset",
        "counters,locks,retry",
        "4",
        "100"
    ),
    inject!(
        "inject-failstop-microreset-metadata",
        "failstop",
        "microreset",
        "counters,locks,retry,metadata",
        "4",
        "100"
    ),
    inject!(
        "inject-failstop-microreset-timers",
        "failstop",
        "microreset",
        "counters,locks,retry,metadata,timers",
        "4",
        "100"
    ),
    inject!("inject-failstop-microreset", "failstop", "microreset", "all", "6", "100"),
    inject!("inject-failstop-microreboot", "failstop", "microreboot", "all", "6", "100"),
    inject!("inject-register-microreset", "register", "microreset", "all", "6", "200"),
    inject!("inject-register-microreboot", "register", "microreboot", "all", "6", "200"),
    inject!("inject-code-microreset", "code", "microreset", "all", "6", "200"),
    inject!("inject-code-microreboot", "code", "microreboot", "all", "6", "200"),
    Step {
        name: "replicate",
        quick: &[
            "bench",
            "replicate",
            "--duration",
            "0.5",
            "--reps",
            "3",
            "--only",
            "memwrite-random,memwrite-sequential",
            "--core",
            "--epochs",
            "20,100",
            "--kills",
            "4",
            "--kill-load",
            "2",
        ],
        full: &["bench", "replicate"],
    },
    Step {
        name: "rejuvenate",
        quick: &["bench", "rejuvenate", "--vms", "1,2", "--mem", "256M", "--model-max", "3"],
        full: &["bench", "rejuvenate"],
    },
];

/// Runs every step (or those in `only`) of `size`, one after the other,
/// with one progress line per step on stderr; a child's stderr goes to
/// `logs/<step>.log` beside `data_dir`'s parent's temporary log directory.
pub fn run_all(size: Size, only: &[String], data_dir: &Path) -> Result<(Data, Machine)> {
    let exe = std::env::current_exe().context("cannot find this binary")?;
    let logs = std::env::temp_dir().join(format!("ninelives-report-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let mut machine = Machine::here(size);
    let mut data = Data::new();
    let start = Instant::now();
    let chosen: Vec<&Step> =
        STEPS.iter().filter(|s| only.is_empty() || only.iter().any(|o| o == s.name)).collect();
    eprintln!(
        "report: {} step(s), {:?}, on {} ({} cores, KVM {}), loadavg {}; child logs in {}",
        chosen.len(),
        size,
        machine.cpu,
        machine.cores,
        machine.kvm_backend,
        machine.loadavg_before,
        logs.display()
    );
    for (i, s) in chosen.iter().enumerate() {
        let args = match size {
            Size::Quick => s.quick,
            Size::Full => s.full,
        };
        let command = format!("ninelives {} --json", args.join(" "));
        eprintln!(
            "report: [{}/{}] {}  (at {:.0} s)",
            i + 1,
            chosen.len(),
            command,
            start.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let load0 = loadavg();
        let log = std::fs::File::create(logs.join(format!("{}.log", s.name)))?;
        // stdout to a file, not a pipe: a grandchild still holding it open
        // after a time-out cannot keep the report waiting.
        let out_path = logs.join(format!("{}.out", s.name));
        let stdout = std::fs::File::create(&out_path)?;
        let mut child = Command::new(&exe)
            .args(args)
            .arg("--json")
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("cannot start {command}"))?;
        let limit = match size {
            Size::Quick => QUICK_STEP_LIMIT,
            Size::Full => FULL_STEP_LIMIT,
        };
        let status = wait_or_stop(&mut child, limit)?;
        let run = StepRun {
            command,
            elapsed_s: t.elapsed().as_secs_f64(),
            exit_ok: status.is_some_and(|s| s.success()),
            loadavg_before: load0,
            loadavg_after: loadavg(),
        };
        let stdout = std::fs::read(&out_path).unwrap_or_default();
        let status = match status {
            Some(s) => s.to_string(),
            None => format!("stopped at its time limit ({} s)", limit.as_secs()),
        };
        let result = last_json(&String::from_utf8_lossy(&stdout));
        eprintln!(
            "report: [{}/{}] {} {} in {:.0} s, loadavg {}",
            i + 1,
            chosen.len(),
            s.name,
            match (&result, run.exit_ok) {
                (Some(_), true) => "done".to_string(),
                (Some(_), false) => format!("ended with {status} (result kept)"),
                (None, _) => format!("ended with {status} and no JSON result (see its log)"),
            },
            run.elapsed_s,
            run.loadavg_after
        );
        if let Some(v) = result {
            std::fs::write(data_dir.join(format!("{}.json", s.name)), serde_json::to_string(&v)?)?;
            data.insert(s.name.to_string(), v);
        }
        machine.steps.insert(s.name.to_string(), run);
    }
    machine.elapsed_s = start.elapsed().as_secs_f64();
    machine.loadavg_after = loadavg();
    Ok((data, machine))
}
