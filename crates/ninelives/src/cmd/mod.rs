//! The subcommands.

pub mod bench;
pub mod bench_checkpoint;
pub mod checkpoint;
pub mod host;
pub mod inject;
pub mod ping;
pub mod run;
