//! The subcommands.

pub mod bench;
pub mod host;
pub mod rejuvenate;
pub mod run;
