//! The VMM's log: `--log-format json` writes one JSON object per line with
//! its level, target and message; `--log-level` filters; text lines keep
//! the `ninelives: ` prefix.

use crate::common;

use common::*;

fn checkpoint(extra: &[&str]) -> std::process::Output {
    let mut args: Vec<&str> = extra.to_vec();
    args.extend(["checkpoint", "--workload", "compute", "--duration", "0.3"]);
    run_cli(&args)
}

#[test]
fn log_format_and_level_apply_to_the_vmm_log() {
    if !kvm_available() {
        return;
    }
    let o = checkpoint(&["--log-format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let line = err
        .lines()
        .find(|l| l.contains("checkpointing every"))
        .unwrap_or_else(|| panic!("no checkpointing line: {err}"));
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(v["level"], "INFO", "{v}");
    assert!(v["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{v}");
    assert_eq!(v["target"], "nl_launch::checkpoint", "{v}");

    let o = checkpoint(&["--log-level", "warn"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("checkpointing every"), "{}", stderr(&o));

    let o = checkpoint(&[]);
    assert!(
        stderr(&o).lines().any(|l| l.starts_with("ninelives: checkpointing every")),
        "{}",
        stderr(&o)
    );

    let o = run_cli(&["--log-format", "xml", "run"]);
    assert_clean_error(&o, "invalid value 'xml'");
}

/// A host started with `--log-format json --log-level debug` still logs
/// JSON at debug level after a warm rejuvenation: the successor process is
/// started with the log options of the one it replaces.
#[test]
fn a_rejuvenated_host_keeps_its_log_options() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let log = dir.path().join("host.log");
    let mut child = ninelives()
        .args(["--log-format", "json", "--log-level", "debug", "host", "--api"])
        .arg(&sock)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t.elapsed().as_secs() < 20, "the host did not start listening");
        assert!(child.try_wait().unwrap().is_none(), "the host exited");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (st, v) = http_json(
        &sock,
        "POST",
        "/v1/vms",
        Some(r#"{"workload":"idle","duration":600,"mem":"64M"}"#),
    );
    assert_eq!(st, 201, "{v}");
    let (st, v) = http_json(&sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
    assert_eq!(st, 200, "{v}");
    // The successor's first lines: its takeover, then (debug) the event log.
    let t = std::time::Instant::now();
    let successor_line = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if let Some(l) = text.lines().find(|l| l.contains("took over")) {
            break l.to_string();
        }
        assert!(t.elapsed().as_secs() < 60, "no takeover line from the successor:\n{text}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let v: serde_json::Value = serde_json::from_str(&successor_line)
        .unwrap_or_else(|e| panic!("the successor logs text, not JSON ({e}): {successor_line}"));
    assert_eq!(v["level"], "INFO", "{v}");
    stop_host(&sock, &mut child);
    let text = std::fs::read_to_string(&log).unwrap();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            serde_json::from_str::<serde_json::Value>(l).is_ok(),
            "a log line of either process is not JSON: {l}\n{text}"
        );
    }
    assert!(
        text.lines().any(|l| l.contains("\"DEBUG\"")),
        "no debug event from either process: the level was lost\n{text}"
    );
}
