//! The command line documents itself: every option of every subcommand has
//! a help text, and completions and man pages are generated from it.

use crate::common;

use clap::CommandFactory;
use common::*;

fn missing_help(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
    for a in cmd.get_arguments() {
        if a.is_hide_set() || ["help", "version"].contains(&a.get_id().as_str()) {
            continue;
        }
        if a.get_help().is_none() && a.get_long_help().is_none() {
            out.push(format!("{path} --{}", a.get_long().unwrap_or(a.get_id().as_str())));
        }
    }
    for s in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        missing_help(s, &format!("{path} {}", s.get_name()), out);
    }
}

#[test]
fn every_option_has_a_help_text() {
    let mut missing = Vec::new();
    missing_help(&ninelives::cli::Cli::command(), "ninelives", &mut missing);
    assert!(missing.is_empty(), "options without help:\n{}", missing.join("\n"));
}

#[test]
fn completions_and_man_pages_are_generated() {
    let o = run_cli(&["completions", "bash"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("_ninelives()"), "{}", stdout(&o));
    let dir = tempfile::tempdir().unwrap();
    let o = run_cli(&["man", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let page = std::fs::read_to_string(dir.path().join("ninelives-checkpoint.1")).unwrap();
    assert!(page.contains(".SH OPTIONS") && page.contains("heartbeat\\-timeout"), "{page}");
    assert_clean_error(&run_cli(&["completions", "tcsh"]), "invalid value");
}

#[test]
fn durations_take_bare_numbers_in_the_flags_unit_or_human_units() {
    use nl_launch::args::{millis, millis_f64, secs};
    assert_eq!(secs("2").unwrap(), 2.0);
    assert_eq!(secs("1.5s").unwrap(), 1.5);
    assert_eq!(secs("500ms").unwrap(), 0.5);
    assert_eq!(secs("1m 30s").unwrap(), 90.0);
    assert_eq!(secs("2min").unwrap(), 120.0);
    assert_eq!(millis("20").unwrap(), 20);
    assert_eq!(millis("1.5s").unwrap(), 1500);
    assert_eq!(millis_f64("0.5").unwrap(), 0.5);
    assert_eq!(millis_f64("250us").unwrap(), 0.25);
    for bad in ["abc", "-1", "1 parsec", "", "8d", "1.5x"] {
        assert!(secs(bad).is_err(), "{bad}");
    }
    assert!(millis("0.5").unwrap_err().contains("whole number of milliseconds"));
    // Through the command line, a bad duration is one clean error.
    assert_clean_error(&run_cli(&["run", "--duration", "soon"]), "not a duration");
}

/// Options once duplicated are one option: `checkpoint` had both
/// `--heartbeat-timeout` and `--hang-timeout`. No subcommand offers both
/// names as separate options, and the checkpoint supervisor takes its hang
/// timeout from the merged one under either name.
#[test]
fn merged_options_are_one_option_under_every_name() {
    fn longs(cmd: &clap::Command, path: &str, out: &mut Vec<(String, Vec<String>)>) {
        out.push((
            path.to_string(),
            cmd.get_arguments().filter_map(|a| a.get_long().map(str::to_string)).collect(),
        ));
        for s in cmd.get_subcommands() {
            longs(s, &format!("{path} {}", s.get_name()), out);
        }
    }
    let mut all = Vec::new();
    longs(&ninelives::cli::Cli::command(), "ninelives", &mut all);
    for (path, names) in &all {
        assert!(
            !(names.iter().any(|n| n == "heartbeat-timeout")
                && names.iter().any(|n| n == "hang-timeout")),
            "{path} has both --heartbeat-timeout and --hang-timeout"
        );
    }
    for flag in ["--heartbeat-timeout", "--hang-timeout"] {
        let o = run_cli(&["checkpoint", flag, "2h", "--duration", "0.1"]);
        assert_clean_error(&o, "--heartbeat-timeout 7200 s is out of range");
    }
}
