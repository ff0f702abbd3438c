//! The command line documents itself: every option of every subcommand has
//! a help text, and completions and man pages are generated from it.

mod common;

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
    assert!(page.contains(".SH OPTIONS") && page.contains("hang\\-timeout"), "{page}");
    assert_clean_error(&run_cli(&["completions", "tcsh"]), "invalid value");
}
