//! Running iproute2 for the network namespaces the CLI builds for itself
//! (benchmarks, fault-injection setups).

use std::process::{Command, Stdio};

/// Runs `ip ARGS...` quietly; true if it ran and succeeded.
pub fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Creates network namespace `name` holding TAP `tap` at 10.0.0.1/24 (the
/// guest is 10.0.0.2), both it and `lo` up. If the TAP cannot be set up the
/// namespace is deleted again.
pub fn add_with_tap(name: &str, tap: &str) -> Result<(), String> {
    if !ip(&["netns", "add", name]) {
        return Err(format!("cannot create network namespace {name} (needs root and iproute2)"));
    }
    for args in [
        &["-n", name, "tuntap", "add", "dev", tap, "mode", "tap"][..],
        &["-n", name, "addr", "add", "10.0.0.1/24", "dev", tap],
        &["-n", name, "link", "set", tap, "up"],
        &["-n", name, "link", "set", "lo", "up"],
    ] {
        if !ip(args) {
            let _ = ip(&["netns", "del", name]);
            return Err(format!("ip {} failed", args.join(" ")));
        }
    }
    Ok(())
}
