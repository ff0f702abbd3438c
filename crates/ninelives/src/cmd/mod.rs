//! The subcommands.

pub mod bench;
pub mod checkpoint;
pub mod host;
pub mod run;
