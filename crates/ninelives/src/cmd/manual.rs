//! `ninelives completions SHELL` and `ninelives man DIR`: shell completion
//! scripts and man pages, generated from the command-line definition
//! (clap_complete, clap_mangen), so they never disagree with `--help`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::Cli;

pub fn completions(shell: clap_complete::Shell) -> Result<ExitCode> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "ninelives", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// Writes `ninelives.1` and `ninelives-SUB.1` for every visible subcommand.
pub fn man_pages(dir: &Path) -> Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cmd = Cli::command();
    let mut written = 0;
    let mut write = |name: String, page: clap::Command| -> Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(page).title(name.to_uppercase()).render(&mut out)?;
        std::fs::write(&path, out).with_context(|| format!("cannot write {}", path.display()))?;
        written += 1;
        Ok(())
    };
    write("ninelives".into(), cmd.clone())?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("ninelives-{}", sub.get_name());
        write(name, sub.clone())?;
    }
    println!("wrote {written} man pages to {}", dir.display());
    Ok(ExitCode::SUCCESS)
}
