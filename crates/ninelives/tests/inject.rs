//! The VMM's error detectors and the fault-injection campaign runner.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

/// Each detector ends `ninelives host` (recovery none) with status 86 and
/// one machine-readable line naming the thread.
#[test]
fn detectors_report_and_end_the_vmm() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (what, detector) in [("segv", "signal"), ("panic", "panic"), ("hang", "hang")] {
        let sock = dir.path().join(format!("{what}.sock"));
        let mut c = ninelives();
        c.args(["host", "--api"]).arg(&sock).env("NINELIVES_DETECT_SELFTEST", what);
        let mut child = c.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            // Bounded, with room for a loaded host (the hang detector's
            // watchdog runs on a starved CPU there).
            if t.elapsed() > Duration::from_secs(20) * LOADED {
                let _ = child.kill();
                panic!("{what}: the host did not end");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(86), "{what}: {}", stderr(&o));
        let line = stderr(&o)
            .lines()
            .find_map(|l| l.strip_prefix("NINELIVES-DETECTED ").map(str::to_string))
            .unwrap_or_else(|| panic!("{what}: no report: {}", stderr(&o)));
        let j: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(j["detector"], detector, "{j}");
        assert_eq!(j["thread"], "selftest", "{j}");
    }
}

/// A failstop fault in a vCPU thread is caught by the signal detector and,
/// with recovery none, classified as detected and failed.
#[test]
fn failstop_in_a_vcpu_thread_is_detected() {
    if !kvm_available() {
        return;
    }
    let o = run_cli(&[
        "inject",
        "--fault",
        "failstop",
        "--setup",
        "1vm",
        "--runs",
        "1",
        "--seed",
        "2",
        "--duration",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let run: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(run["outcome"], "detected", "{run}");
    assert_eq!(run["result"], "failed", "{run}");
    assert_eq!(run["detector"]["detector"], "signal", "{run}");
    assert_eq!(run["detector"]["signal"], "SIGSEGV", "{run}");
    assert_eq!(run["detector"]["rip"], "0x0", "{run}");
    let thread = run["injection"]["thread"].as_str().unwrap();
    assert!(thread.starts_with("vm0-vcpu"), "{run}");
    assert_eq!(run["detector"]["thread"], thread, "{run}");
    let s = last_json(&o);
    assert_eq!(s["runs"], 1);
    assert_eq!(s["outcomes"]["detected"], 1);
    assert_eq!(s["outcomes"]["failed"], 1);
    assert_eq!(s["success_rate"], 0.0);
    assert_eq!(s["success_ci95"][0], 0.0, "{s}");
}

fn status_field(pid: i32, field: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_string()))
}

fn children(ppid: u32) -> Vec<i32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if status_field(pid, "PPid:").is_some_and(|p| p == ppid.to_string()) {
            v.push(pid);
        }
    }
    v
}

fn traced_threads(pid: i32) -> usize {
    let Ok(d) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    d.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("status")).is_ok_and(|s| {
                s.lines().any(|l| l.starts_with("TracerPid:") && l.trim_end() != "TracerPid:\t0")
            })
        })
        .count()
}

/// SIGINT to a campaign while it single-steps a VMM thread: the injector
/// detaches, kills its hosts, and leaves nothing traced or stopped.
#[test]
fn interrupted_campaign_leaves_no_traced_process() {
    if !kvm_available() {
        return;
    }
    let mut campaign = ninelives()
        .args(["inject", "--fault", "register", "--runs", "20", "--duration", "2", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (bounded) until a host thread is being traced, then interrupt.
    let mut hosts = Vec::new();
    let t = Instant::now();
    let mut saw_tracing = false;
    while t.elapsed() < Duration::from_secs(30) && !saw_tracing {
        for pid in children(campaign.id()) {
            if !hosts.contains(&pid) {
                hosts.push(pid);
            }
            saw_tracing |= traced_threads(pid) > 0;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill(2) on the pid of our own child process.
    unsafe { libc::kill(campaign.id() as i32, libc::SIGINT) };
    let t = Instant::now();
    while campaign.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = campaign.kill();
            panic!("the campaign did not end after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = campaign.wait_with_output().unwrap();
    let mut leftovers = Vec::new();
    for &pid in &hosts {
        let Some(state) = status_field(pid, "State:") else { continue };
        if state.starts_with('Z') {
            continue;
        }
        leftovers.push(format!("{pid}: {state}, {} traced threads", traced_threads(pid)));
        // SAFETY: kill(2) on a leftover host this test's campaign started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(saw_tracing, "never saw a traced host thread; stderr: {}", stderr(&o));
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert_eq!(last_json(&o)["interrupted"], true);
}

#[test]
fn merge_sums_campaigns() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    let b = dir.path().join("b.json");
    std::fs::write(&a, "{\"run\":0}\n{\"runs\":3,\"fault\":\"register\",\"setup\":\"1vm\",\"recovery\":\"none\",\"outcomes\":{\"non_manifested\":2,\"sdc\":0,\"detected\":1,\"recovered\":0,\"no_vm_failure\":0,\"failed\":1},\"skipped\":0,\"elapsed_s\":6.0,\"seed\":1}\n").unwrap();
    std::fs::write(&b, "{\"runs\":2,\"fault\":\"register\",\"setup\":\"1vm\",\"recovery\":\"none\",\"outcomes\":{\"non_manifested\":0,\"sdc\":1,\"detected\":1,\"recovered\":1,\"no_vm_failure\":1,\"failed\":0},\"skipped\":1,\"elapsed_s\":6.0,\"seed\":4}\n").unwrap();
    let o = run_cli(&["inject", "merge", a.to_str().unwrap(), b.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j = last_json(&o);
    assert_eq!(j["runs"], 5);
    assert_eq!(j["outcomes"]["non_manifested"], 2);
    assert_eq!(j["outcomes"]["sdc"], 1);
    assert_eq!(j["outcomes"]["detected"], 2);
    assert_eq!(j["outcomes"]["recovered"], 1);
    assert_eq!(j["success_rate"], 0.5);
    assert_eq!(j["runs_per_min"], 30.0);
    assert_eq!(j["seed"], 1);
    // Mismatched campaigns, missing files and files without a summary are clean errors.
    let c = dir.path().join("c.json");
    std::fs::write(&c, std::fs::read_to_string(&b).unwrap().replace("register", "code")).unwrap();
    assert_clean_error(
        &run_cli(&["inject", "merge", a.to_str().unwrap(), c.to_str().unwrap()]),
        "differ",
    );
    assert_clean_error(&run_cli(&["inject", "merge", "/nonexistent.json"]), "cannot read");
    let d = dir.path().join("d.json");
    std::fs::write(&d, "not json\n").unwrap();
    assert_clean_error(&run_cli(&["inject", "merge", d.to_str().unwrap()]), "no campaign summary");
}

#[test]
fn inject_bad_input_is_a_clean_error() {
    assert_clean_error(&run_cli(&["inject", "--runs", "2"]), "inject needs --fault");
    assert_clean_error(&run_cli(&["inject", "--fault", "bogus"]), "invalid value");
    assert_clean_error(&run_cli(&["inject", "--fault", "code", "--setup", "2vm"]), "invalid value");
    assert_clean_error(&run_cli(&["inject", "--fault", "code", "--runs", "0"]), "runs");
    assert_clean_error(
        &run_cli(&["inject", "--fault", "code", "--recovery", "reboot"]),
        "invalid value",
    );
    assert_clean_error(&run_cli(&["inject", "--fault", "code", "--duration", "0.1"]), "--duration");
    assert_clean_error(&run_cli(&["inject", "merge"]), "required");
}

/// Runs a `--fault none` campaign and checks every run is non-manifested:
/// the injector still seizes and single-steps a thread, so anything else
/// (a hang detected while stepping, a ping window lost to the stall, a
/// target thread that ended) is the injector's own doing. Returns false if
/// the setup is not available here.
fn control_campaign(args: &[&str]) -> bool {
    let mut all = vec!["inject", "--fault", "none", "--jobs", "1", "--json"];
    all.extend_from_slice(args);
    let o = run_cli(&all);
    if !o.status.success() && stderr(&o).contains("needs root for its network namespace") {
        common::skip(common::Prereq::Netns, &format!("{args:?}: {}", stderr(&o).trim()));
        return false;
    }
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    for l in &lines[..lines.len() - 1] {
        let run: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(run["outcome"], "non_manifested", "{args:?}: {run}");
        assert_eq!(run["injection"]["skipped"], "control run: no fault", "{args:?}: {run}");
    }
    let s = last_json(&o);
    assert_eq!(s["skipped"], 0, "{args:?}: {s}");
    assert_eq!(s["outcomes"]["non_manifested"], s["runs"], "{args:?}: {s}");
    true
}

/// Control campaigns find no errors: 1vm with any long-lived VMM thread as
/// the target (vCPU, VM monitor, watchdog, accept loop; never a short-lived
/// API connection thread or a KVM kernel worker), and 3vm, whose ping must
/// not fail while the netbench VM's vCPU thread is stepped (seed 202's
/// target is that thread).
#[test]
fn control_campaigns_are_non_manifested() {
    if !kvm_available() {
        return;
    }
    control_campaign(&["--setup", "1vm", "--target", "any", "--runs", "4", "--duration", "1"]);
    // 6 s: on a loaded host the netbench guest took over 1.5 s to answer
    // its first ping, and 3 s left less than the campaign's 1 s of pinging
    // (the run was skipped, not classified).
    control_campaign(&["--setup", "3vm", "--runs", "3", "--seed", "200", "--duration", "6"]);
}

/// A code fault under microreset goes in through the sentinel, which puts
/// the code back when the VMM is stopped by the fault's signal, before the
/// VMM's handler runs. Every run reports its repair, some are repaired at
/// their signal, and such a run recovers (the corrupted instruction is gone
/// when the VMM runs again). Not every one: which instructions the seeds
/// flip depends on the binary's layout, and about 1 in 12 detected code
/// faults fails for causes of its own (see the README's code campaigns), so
/// the recovery rate is the campaigns' to measure, not this test's.
#[test]
fn code_faults_are_repaired_at_their_signal() {
    if !kvm_available() {
        return;
    }
    // Each run has a ~40% chance of a detection by a signal: 12 runs (bounded).
    let o = run_cli(&[
        "inject",
        "--fault",
        "code",
        "--setup",
        "1vm",
        "--recovery",
        "microreset",
        "--runs",
        "12",
        "--seed",
        "31000",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    let mut at_signal = 0;
    let mut recovered_at_signal = 0;
    let mut failed = Vec::new();
    for l in &lines[..lines.len() - 1] {
        let run: serde_json::Value = serde_json::from_str(l).unwrap();
        let inj = &run["injection"];
        if inj["skipped"].is_string() {
            continue;
        }
        let repair = &inj["repair"];
        assert!(
            repair["repaired"] == true || repair["by"] == "gone",
            "a code fault left in place: {run}"
        );
        if repair["by"] == "signal" && run["detector"]["detector"] == "signal" {
            at_signal += 1;
            let result = run["result"].as_str().unwrap_or_default();
            if ["recovered", "no_vm_failure"].contains(&result) {
                recovered_at_signal += 1;
            } else {
                failed.push(run.to_string());
            }
        }
    }
    assert!(at_signal > 0, "no run was repaired at its fault signal: {out}");
    // At least half the runs repaired at their signal recover. Not all: a
    // flipped instruction can corrupt state before it faults (a guest that
    // stops heartbeating, a wild store), which no repair at the signal
    // undoes; the campaigns measure about 1 in 12 such runs, and on a
    // loaded host a few more (3 of 4 failed the suite twice at load 12-20:
    // 2 of 3 and 4 of 6). With recovery or the repair broken, none does.
    assert!(
        recovered_at_signal * 2 >= at_signal,
        "only {recovered_at_signal} of {at_signal} runs repaired at their signal recovered: {failed:#?}"
    );
}
