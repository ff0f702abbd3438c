//! The subcommands.

pub mod bench;
pub mod bench_checkpoint;
pub mod bench_rejuvenate;
pub mod bench_replicate;
pub mod checkpoint;
pub mod host;
pub mod inject;
pub mod ping;
pub mod rejuvenate;
pub mod replicate;
pub mod run;
