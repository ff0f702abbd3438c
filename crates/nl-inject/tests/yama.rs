//! Tracing under Yama `ptrace_scope` = 1: a process started with
//! [`nl_inject::traceable_by_us`] can be traced by a *sibling* (a process
//! this test starts next, as the campaign starts its sentinel), without
//! CAP_SYS_PTRACE; one started without it cannot (the control).
//!
//! Needs Yama (/proc/sys/kernel/yama), root (to set the scope to 1 for the
//! test and to drop to an unprivileged uid) and strace (the sibling
//! tracer). Without them the test says SKIPPED on stderr, and fails under
//! NINELIVES_REQUIRE_YAMA=1.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// An unprivileged uid and gid (nobody).
const NOBODY: u32 = 65534;

fn skip(why: &str) {
    if std::env::var("NINELIVES_REQUIRE_YAMA").is_ok_and(|v| v == "1") {
        panic!("NINELIVES_REQUIRE_YAMA=1 but the Yama test cannot run: {why}");
    }
    let line = format!(
        "\n*** SKIPPED tracing_under_yama_scope_1: {why}; set NINELIVES_REQUIRE_YAMA=1 to fail instead ***\n"
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Whether a sibling `strace -p` (as nobody, no capabilities) can attach
/// to a `sleep` started as nobody, with or without the declaration.
fn sibling_can_trace(declared: bool) -> bool {
    let mut target = Command::new("sleep");
    target.arg("20").uid(NOBODY).gid(NOBODY).stdout(Stdio::null());
    if declared {
        nl_inject::traceable_by_us(&mut target);
    }
    let mut t = target.spawn().expect("sleep starts");
    let o = Command::new("timeout")
        .args(["5", "strace", "-e", "trace=none", "-p", &t.id().to_string()])
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("strace runs");
    let _ = t.kill();
    let _ = t.wait();
    let err = String::from_utf8_lossy(&o.stderr);
    // strace attaches, then `timeout` stops it (exit 124); EPERM otherwise.
    !err.contains("Operation not permitted") && err.contains("attached")
}

#[test]
fn tracing_under_yama_scope_1() {
    let Some(scope) = nl_inject::yama_ptrace_scope() else {
        skip("this kernel has no Yama (/proc/sys/kernel/yama is absent), so ptrace_scope = 1 cannot be tested here");
        return;
    };
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip("needs root to set ptrace_scope and to run the tracer unprivileged");
        return;
    }
    if Command::new("strace").arg("-V").output().is_err() {
        skip("strace is not installed");
        return;
    }
    if scope > 1 {
        skip(&format!("ptrace_scope is {scope}; only 0 or 1 can be set back"));
        return;
    }
    let path = "/proc/sys/kernel/yama/ptrace_scope";
    std::fs::write(path, "1").expect("set ptrace_scope to 1");
    let declared = sibling_can_trace(true);
    let control = sibling_can_trace(false);
    std::fs::write(path, scope.to_string()).expect("restore ptrace_scope");
    assert!(!control, "the control: a sibling traced an undeclared process under scope 1");
    assert!(declared, "a sibling could not trace a process started with traceable_by_us");
}
