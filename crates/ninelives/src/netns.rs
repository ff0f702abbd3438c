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
