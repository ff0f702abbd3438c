//! `ninelives bench hostile`: the attack campaign (hostile API clients and
//! replication peers against real host and backup processes), two tries per
//! attack: every try is a clean refusal, nothing crashes, hangs, succeeds
//! where it must not or harms a bystander VM.

use crate::common;

use common::*;

/// The rows the campaign reports, in order.
const ROWS: [&str; 10] = [
    "api-oversized",
    "api-slow",
    "api-malformed",
    "api-flood",
    "api-flood-then-fresh",
    "api-overcommit",
    "api-other-user",
    "repl-forged",
    "repl-real-primary-after-attacks",
    "repl-slowloris",
];

#[test]
fn every_attack_of_the_campaign_is_refused_cleanly() {
    if !kvm_available() {
        return;
    }
    let o = run_cli(&["bench", "hostile", "--tries", "2", "--json"]);
    let j = last_json(&o);
    let rows = j["rows"].as_array().unwrap_or_else(|| panic!("no rows: {j}"));
    let names: Vec<_> = rows.iter().map(|r| r["attack"].as_str().unwrap_or("?")).collect();
    assert_eq!(names, ROWS, "{j}");
    for r in rows {
        let a = &r["attack"];
        // api-other-user acts as another user: it needs root, and says so.
        assert!(r["not_run"].is_null(), "{a} was not run: {}", r["not_run"]);
        assert!(r["tries"].as_u64().is_some_and(|n| n >= 1), "{r}");
        for k in ["crash", "hang", "wrong_success", "other_vms_harmed", "unexpected"] {
            assert_eq!(r[k], 0, "{a}: {k} {}\n{}", r["failures"], stdout(&o));
        }
        assert_eq!(r["clean_refusal"], r["tries"], "{r}");
    }
    assert_eq!(j["not_clean"], 0, "{j}");
    assert!(o.status.success(), "{}", stderr(&o));
}
