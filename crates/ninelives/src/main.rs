//! `ninelives`: the command-line front end of the VMM.

use ninelives::{cli, cmd};
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Behave like other command-line tools when stdout is a closed pipe
    // (`ninelives bench | head -1`): end quietly instead of panicking in println.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = cli::Cli::parse();
    ninelives::logging::init(cli.log_level, cli.log_format);
    // A rejuvenated or microrebooted host logs as the one it replaces.
    nl_vmm::successor::inherit(ninelives::logging::successor_args(cli.log_level, cli.log_format));
    nl_vmm::seccomp::set_enabled(cli.seccomp == cli::OnOff::On);
    let result = match cli.command.unwrap_or_default() {
        cli::Command::Run(a) => nl_launch::run::run(a),
        cli::Command::Bench(a) => nl_lab::bench::bench(a),
        cli::Command::Host(a) => cmd::host::host(a),
        cli::Command::Api(a) => cmd::host::api_client(a),
        cli::Command::Checkpoint(a) => nl_launch::checkpoint::checkpoint(a),
        cli::Command::Restore(a) => nl_launch::checkpoint::restore(a),
        cli::Command::Ping(a) => nl_lab::ping::run(a),
        cli::Command::Rejuvenate(a) => cmd::rejuvenate::rejuvenate(a),
        cli::Command::Replicate(c) => nl_launch::replicate::replicate(c),
        cli::Command::Inject(a) => nl_lab::campaign::inject(a),
        cli::Command::Kvload(a) => nl_lab::kvload::run(a),
        cli::Command::Report(a) => nl_lab::report::report(a),
        cli::Command::EchoServer(a) => nl_lab::echo_server::run(a),
        cli::Command::Completions { shell } => cmd::manual::completions(shell),
        cli::Command::Man { dir } => cmd::manual::man_pages(&dir),
        cli::Command::Sandbox(a) => cmd::sandbox::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // One line, no backtrace: bad input is reported, never a panic.
            eprintln!("ninelives: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
