//! Campaign shards: how `ninelives inject --shard I/N` splits a campaign
//! into disjoint parts that a batch scheduler runs as separate jobs, and how
//! `ninelives inject merge` puts their summaries back together.
//!
//! Shard I of N runs the campaign's runs j (0 ≤ j < total) with j mod N = I,
//! each with seed base + j, exactly as the unsharded campaign would: the
//! union of all N shards *is* that campaign. Every summary names its
//! campaign (fault model, setup, recovery policy, repairs, target, duration,
//! base seed, total runs, and the git revision of the binary), its shard,
//! and the runs it completed.
//!
//! A merge refuses, each with its reason:
//! - **mismatched** inputs: two summaries of different campaigns (any field
//!   of the identity differs, or a different shard count);
//! - a **duplicate**: the same shard given twice;
//! - **overlapping** inputs: one run (seed) counted in two files;
//! - **missing** shards or runs (a shard not given, or one stopped by a time
//!   limit or an interruption), unless `--partial`, which merges what there
//!   is and says what is missing.
//!
//! Summaries of older binaries (no identity: only fault, setup and recovery)
//! merge among themselves by those three, with the overlap check on their
//! seed ranges.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};

/// Shard `index` of `count` (0 ≤ index < count).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// The whole campaign.
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    /// Parses `I/N` (0 ≤ I < N ≤ 100000), e.g. a Slurm array task id or a
    /// Kubernetes completion index over the job's size.
    pub fn parse(s: &str) -> Result<Shard, String> {
        let (i, n) =
            s.split_once('/').ok_or_else(|| format!("--shard {s}: expected I/N, e.g. 0/4"))?;
        let index: u32 =
            i.trim().parse().map_err(|_| format!("--shard {s}: {i:?} is not a number"))?;
        let count: u32 =
            n.trim().parse().map_err(|_| format!("--shard {s}: {n:?} is not a number"))?;
        if !(1..=100_000).contains(&count) {
            return Err(format!("--shard {s}: N must be 1..=100000"));
        }
        if index >= count {
            return Err(format!("--shard {s}: I must be below N (shards are numbered 0..N-1)"));
        }
        Ok(Shard { index, count })
    }

    /// The run indices of this shard in a campaign of `total` runs.
    pub fn runs(self, total: u32) -> Vec<u32> {
        (self.index..total).step_by(self.count as usize).collect()
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// The fields of a campaign's identity that every shard must agree on
/// (base seed, total runs and the shard count are checked separately).
const IDENTITY: [&str; 7] =
    ["fault", "setup", "recovery", "repairs", "target", "duration_s", "git_revision"];

/// One input of a merge: its name (a file) and its summary line.
pub struct Input {
    pub name: String,
    pub summary: Value,
}

/// The runs one input covers, as seeds.
fn seeds(s: &Value) -> Result<BTreeSet<u64>, String> {
    if let Some(c) = s.get("campaign") {
        let base = c["base_seed"].as_u64().ok_or("campaign.base_seed is missing")?;
        let idx = s["run_indices"].as_array().ok_or("run_indices is missing")?;
        idx.iter()
            .map(|i| i.as_u64().map(|i| base + i).ok_or_else(|| "bad run index".to_string()))
            .collect()
    } else {
        // An older summary: runs seed, seed+1, ... (skipped runs included).
        let base = s["seed"].as_u64().unwrap_or(0);
        let n = s["runs"].as_u64().unwrap_or(0) + s["skipped"].as_u64().unwrap_or(0);
        Ok((base..base + n).collect())
    }
}

fn shard_of(s: &Value) -> Option<Shard> {
    let sh = s.get("shard")?;
    Some(Shard { index: sh["index"].as_u64()? as u32, count: sh["count"].as_u64()? as u32 })
}

/// What a merge found missing.
#[derive(Debug, Default, Serialize, PartialEq)]
pub struct Missing {
    /// Shards not given ("I/N").
    pub shards: Vec<String>,
    /// Runs of the given shards that did not complete.
    pub runs: u64,
}

/// Checks that `inputs` are disjoint parts of one campaign (see the module
/// documentation) and returns the campaign identity of the first (None for
/// older summaries) and what is missing. An error names the inputs and the
/// reason: mismatched, duplicate, overlapping or missing.
pub fn check(inputs: &[Input], partial: bool) -> Result<(Option<Value>, Missing), String> {
    let first = inputs.first().ok_or("nothing to merge")?;
    let id0 = first.summary.get("campaign").cloned();
    for inp in &inputs[1..] {
        let id = inp.summary.get("campaign");
        match (&id0, id) {
            (Some(a), Some(b)) => {
                for k in IDENTITY.iter().chain(&["base_seed", "total_runs"]) {
                    if a[k] != b[k] {
                        return Err(format!(
                            "mismatched shards: {} has {k} {} but {} has {}",
                            inp.name, b[k], first.name, a[k]
                        ));
                    }
                }
            }
            (None, None) => {
                for k in ["fault", "setup", "recovery"] {
                    if first.summary[k] != inp.summary[k] {
                        return Err(format!(
                            "mismatched campaigns: fault/setup/recovery of {} differ from {} ({k} {} vs {})",
                            inp.name, first.name, inp.summary[k], first.summary[k]
                        ));
                    }
                }
            }
            _ => {
                return Err(format!(
                    "mismatched shards: {} and {} are not both from a binary that records the campaign identity",
                    inp.name, first.name
                ))
            }
        }
    }
    let mut missing = Missing::default();
    if let Some(id) = &id0 {
        // Shards: one count, each index once, all present.
        let total = id["total_runs"].as_u64().unwrap_or(0) as u32;
        let mut by_index: BTreeMap<u32, &str> = BTreeMap::new();
        let mut count = None;
        for inp in inputs {
            let sh = shard_of(&inp.summary).unwrap_or(Shard::ALL);
            match count {
                None => count = Some(sh.count),
                Some(c) if c != sh.count => {
                    return Err(format!(
                        "mismatched shards: {} is shard {sh} but {} was split into {c}",
                        inp.name, first.name
                    ))
                }
                _ => {}
            }
            if let Some(other) = by_index.insert(sh.index, &inp.name) {
                return Err(format!(
                    "duplicate shard {sh}: given as both {other} and {}",
                    inp.name
                ));
            }
            let done = inp.summary["run_indices"].as_array().map_or(0, Vec::len) as u64;
            let expected = sh.runs(total).len() as u64;
            missing.runs += expected.saturating_sub(done);
        }
        let count = count.unwrap_or(1);
        missing.shards = (0..count)
            .filter(|i| !by_index.contains_key(i))
            .map(|i| Shard { index: i, count }.to_string())
            .collect();
    }
    // No run counted twice.
    let mut seen: BTreeMap<u64, &str> = BTreeMap::new();
    for inp in inputs {
        for s in seeds(&inp.summary).map_err(|e| format!("{}: {e}", inp.name))? {
            if let Some(other) = seen.insert(s, &inp.name) {
                return Err(format!(
                    "overlapping shards: the run with seed {s} is in both {other} and {}",
                    inp.name
                ));
            }
        }
    }
    if !partial && (!missing.shards.is_empty() || missing.runs > 0) {
        let mut why = Vec::new();
        if !missing.shards.is_empty() {
            why.push(format!("shard(s) {} not given", missing.shards.join(", ")));
        }
        if missing.runs > 0 {
            why.push(format!(
                "{} run(s) of the given shards did not complete (time limit or interruption)",
                missing.runs
            ));
        }
        return Err(format!("missing shards: {} (--partial merges what there is)", why.join("; ")));
    }
    Ok((id0, missing))
}

/// The identity object a shard's summary carries.
#[allow(clippy::too_many_arguments)]
pub fn identity(
    fault: &str,
    setup: &str,
    recovery: &str,
    repairs: &str,
    target: &str,
    duration_s: f64,
    base_seed: u64,
    total_runs: u32,
) -> Value {
    json!({
        "fault": fault, "setup": setup, "recovery": recovery, "repairs": repairs,
        "target": target, "duration_s": duration_s, "base_seed": base_seed,
        "total_runs": total_runs, "git_revision": crate::json_out::GIT_REVISION,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary of shard `i`/`n` of a 10-run campaign that completed
    /// `done` (default: all its runs).
    fn shard(i: u32, n: u32, done: Option<Vec<u32>>) -> Input {
        let sh = Shard { index: i, count: n };
        let idx = done.unwrap_or_else(|| sh.runs(10));
        let id = identity("register", "1vm", "microreset", "all", "vcpu", 2.0, 1, 10);
        Input {
            name: format!("s{i}.json"),
            summary: json!({"campaign": id, "shard": sh, "run_indices": idx,
                "fault": "register", "setup": "1vm", "recovery": "microreset", "seed": 1}),
        }
    }

    #[test]
    fn shards_split_a_campaign_disjointly_and_completely() {
        let mut all: Vec<u32> =
            (0..4).flat_map(|i| Shard { index: i, count: 4 }.runs(10)).collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(Shard { index: 3, count: 4 }.runs(10), vec![3, 7]);
        assert_eq!(Shard::parse("2/5"), Ok(Shard { index: 2, count: 5 }));
        assert!(Shard::parse("5/5").unwrap_err().contains("below N"));
        assert!(Shard::parse("1/0").is_err());
        assert!(Shard::parse("3").is_err());
        assert!(Shard::parse("a/2").is_err());
    }

    #[test]
    fn complete_shards_merge() {
        let (id, missing) =
            check(&[shard(0, 3, None), shard(2, 3, None), shard(1, 3, None)], false)
                .expect("a complete set merges");
        assert_eq!(id.unwrap()["total_runs"], 10);
        assert_eq!(missing, Missing::default());
    }

    #[test]
    fn duplicate_shard_is_refused() {
        let e =
            check(&[shard(0, 2, None), shard(1, 2, None), shard(1, 2, None)], false).unwrap_err();
        assert!(e.starts_with("duplicate shard 1/2"), "{e}");
    }

    #[test]
    fn overlapping_shards_are_refused() {
        // Shard 1/2 claims run 4, which belongs to shard 0/2.
        let e = check(&[shard(0, 2, None), shard(1, 2, Some(vec![1, 3, 4, 5, 7, 9]))], false)
            .unwrap_err();
        assert!(e.starts_with("overlapping shards: the run with seed 5"), "{e}");
        // Older summaries overlap by their seed ranges.
        let old = |name: &str, seed: u64| Input {
            name: name.into(),
            summary: json!({"fault":"code","setup":"1vm","recovery":"none","seed":seed,"runs":5,"skipped":0}),
        };
        assert!(check(&[old("a", 1), old("b", 6)], false).is_ok());
        let e = check(&[old("a", 1), old("b", 4)], false).unwrap_err();
        assert!(e.starts_with("overlapping shards: the run with seed 4 is in both a and b"), "{e}");
    }

    #[test]
    fn missing_shards_and_runs_are_refused_unless_partial() {
        let e = check(&[shard(0, 3, None), shard(2, 3, None)], false).unwrap_err();
        assert!(e.starts_with("missing shards: shard(s) 1/3 not given"), "{e}");
        let (_, m) = check(&[shard(0, 3, None), shard(2, 3, None)], true).unwrap();
        assert_eq!(m.shards, vec!["1/3"]);
        // Shard 1/2 stopped after 3 of its 5 runs.
        let e = check(&[shard(0, 2, None), shard(1, 2, Some(vec![1, 3, 5]))], false).unwrap_err();
        assert!(e.contains("2 run(s) of the given shards did not complete"), "{e}");
    }

    #[test]
    fn mismatched_shards_are_refused() {
        let mut other = shard(1, 2, None);
        other.summary["campaign"]["recovery"] = json!("microreboot");
        let e = check(&[shard(0, 2, None), other], false).unwrap_err();
        assert!(e.starts_with("mismatched shards: s1.json has recovery"), "{e}");
        let mut other = shard(1, 2, None);
        other.summary["campaign"]["git_revision"] = json!("0123abc");
        let e = check(&[shard(0, 2, None), other], false).unwrap_err();
        assert!(e.contains("has git_revision"), "{e}");
        let e = check(&[shard(0, 2, None), shard(1, 3, None)], false).unwrap_err();
        assert!(e.starts_with("mismatched shards: s1.json is shard 1/3"), "{e}");
        let old = Input {
            name: "old.json".into(),
            summary: json!({"fault":"register","setup":"1vm","recovery":"microreset","seed":1,"runs":1}),
        };
        let e = check(&[shard(0, 1, None), old], false).unwrap_err();
        assert!(e.contains("not both from a binary that records the campaign identity"), "{e}");
    }
}
