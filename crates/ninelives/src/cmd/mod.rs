//! The subcommands.

pub mod bench;
pub mod bench_checkpoint;
pub mod bench_net;
pub mod bench_recovery;
pub mod bench_rejuvenate;
pub mod bench_rejuvenate_cache;
pub mod bench_replicate;
pub mod checkpoint;
pub mod echo_server;
pub mod host;
pub mod inject;
pub mod kvload;
pub mod ping;
pub mod rejuvenate;
pub mod replicate;
pub mod run;
