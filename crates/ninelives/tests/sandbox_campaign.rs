//! `ninelives inject --setup sandbox`: a tiny campaign of each fault model
//! into one sandbox of a set of three, and its classification; shards of it
//! merged as the VMM campaigns' are.
//!
//! Every run is bounded by the campaign itself (each run's wait is bounded);
//! nothing asserts on timing.

use crate::common;

use common::{kvm_available, last_json, ninelives, stderr, stdout};
use serde_json::Value;

/// Runs a sandbox campaign; returns its run records and its summary.
fn campaign(args: &[&str]) -> (Vec<Value>, Value) {
    let o = ninelives()
        .args(["inject", "--setup", "sandbox", "--json", "--duration", "10"])
        .args(args)
        .output()
        .expect("ninelives runs");
    assert!(o.status.success(), "{args:?}: {}\n{}", stdout(&o), stderr(&o));
    let summary = last_json(&o);
    let runs: Vec<Value> = stdout(&o)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("run").is_some())
        .collect();
    (runs, summary)
}

fn one(args: &[&str]) -> Value {
    let (runs, s) = campaign(args);
    assert_eq!(runs.len(), 1, "{s}");
    assert_eq!(s["skipped"], 0, "{:#}", runs[0]);
    runs.into_iter().next().unwrap()
}

#[test]
fn each_fault_model_is_injected_and_classified() {
    if !kvm_available() {
        return;
    }
    // A violating write traps; svc restarts and completes verified; the
    // healthy pair is untouched.
    let r = one(&["--recovery", "restart", "--sandbox-fault", "violating-write", "--runs", "1"]);
    assert_eq!(r["outcome"], "recovered", "{r:#}");
    assert_eq!(r["evidence"]["target"]["detections"][0], "channel-violation", "{r:#}");
    // A broken driver's MMIO storm never beats again: lost heartbeat.
    let r = one(&["--recovery", "restart", "--sandbox-fault", "broken-driver", "--runs", "1"]);
    assert_eq!(r["fault"]["kind"], "mmio_storm", "{r:#}");
    assert_eq!(r["outcome"], "recovered", "{r:#}");
    assert_eq!(r["evidence"]["target"]["detections"][0], "lost-heartbeat", "{r:#}");
    // Bit flips: whatever they do to svc (a flipped register may even leave
    // svc's own result wrong, which its self-check reports as SDC), nobody
    // else is harmed: the healthy pair's channel stays clean.
    for model in ["memory-flip", "register-flip"] {
        let r = one(&["--recovery", "restart", "--sandbox-fault", model, "--runs", "1"]);
        assert_eq!(r["model"], model);
        let o = r["outcome"].as_str().unwrap();
        assert!(["recovered", "not_manifested", "service_failed", "sdc"].contains(&o), "{r:#}");
        for h in 0..2 {
            let pq = &r["evidence"]["healthy"][h]["pq"];
            for bad in ["rejected", "corrupt", "lost", "duplicated"] {
                assert_eq!(pq[bad], 0, "{bad}: {r:#}");
            }
            assert_eq!(r["evidence"]["healthy"][h]["paused"], false, "{r:#}");
        }
    }
}

#[test]
fn shards_of_a_sandbox_campaign_merge_into_the_whole() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    for i in 0..2 {
        let shard = format!("{i}/2");
        let a = ["--recovery", "restart", "--sandbox-fault", "violating-write"];
        let o = ninelives()
            .args(["inject", "--setup", "sandbox", "--json", "--duration", "3", "--runs", "2"])
            .args(a)
            .args(["--seed", "7", "--shard", &shard])
            .output()
            .expect("ninelives runs");
        assert!(o.status.success(), "{}", stderr(&o));
        let s = last_json(&o);
        assert_eq!(s["run_indices"], serde_json::json!([i]), "{s}");
        assert_eq!(s["campaign"]["setup"], "sandbox");
        let f = dir.path().join(format!("shard-{i}.json"));
        std::fs::write(&f, &o.stdout).expect("write");
        files.push(f);
    }
    let o =
        ninelives().args(["inject", "merge", "--json"]).args(&files).output().expect("merge runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let m = last_json(&o);
    assert_eq!(m["runs"].as_u64().unwrap() + m["skipped"].as_u64().unwrap(), 2, "{m}");
    assert_eq!(m["setup"], "sandbox");
    assert_eq!(m["outcomes"]["other_harmed"], 0, "{m}");
    assert!(m["harmed_ci95"].is_array(), "{m}");
    // One shard alone is a partial campaign: refused without --partial.
    let o = ninelives().args(["inject", "merge"]).arg(&files[0]).output().expect("merge runs");
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing shards"), "{}", stderr(&o));
}

#[test]
fn bad_records_from_the_faulty_sandbox_are_evidence_but_on_the_healthy_channel_harm() {
    if !kvm_available() {
        return;
    }
    // svc's region of sp announces records svc never wrote: p rejects them
    // on sp. That is the isolation working: p's own channel pq is clean.
    let r = one(&["--recovery", "restart", "--sandbox-fault", "bad-records", "--runs", "1"]);
    let e = &r["evidence"];
    assert!(e["from_faulty"]["rejected"].as_u64().unwrap() > 0, "{r:#}");
    for h in 0..2 {
        assert_eq!(e["healthy"][h]["pq"]["rejected"], 0, "{r:#}");
        assert!(e["healthy"][h]["pq"]["received"].as_u64().unwrap() > 0, "{r:#}");
    }
    assert_eq!(r["outcome"], "not_manifested", "{r:#}");
    // The same on q's region of pq: p rejects it on its own channel, which
    // is harm to the healthy pair.
    let r = one(&["--recovery", "restart", "--sandbox-fault", "harm-control", "--runs", "1"]);
    assert_eq!(r["outcome"], "other_harmed", "{r:#}");
    assert!(r["evidence"]["healthy"][0]["pq"]["rejected"].as_u64().unwrap() > 0, "{r:#}");
    assert!(r["reason"].as_str().unwrap().contains("on pq"), "{r:#}");
}
