//! The VMM's log: `--log-format json` writes one JSON object per line with
//! its level, target and message; `--log-level` filters; text lines keep
//! the `ninelives: ` prefix.

mod common;

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
