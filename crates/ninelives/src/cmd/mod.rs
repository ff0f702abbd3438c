//! The subcommands.

pub mod bench;
pub mod host;
pub mod ping;
pub mod run;
