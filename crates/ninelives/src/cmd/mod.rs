//! The subcommands.

pub mod bench;
pub mod bench_rejuvenate;
pub mod host;
pub mod rejuvenate;
pub mod run;
