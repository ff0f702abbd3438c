//! ninelives' integration tests, one module per area (`tests/NAME.rs`).
//!
//! They are one test binary: one link instead of one per file, and one pool
//! of test threads, so a long test in one area overlaps the others instead
//! of leaving a core idle at the end of its own binary. Run one area with
//! `cargo test --release -p ninelives --test integration NAME::`.
//!
//! Tests whose checks need a guest to keep pace (CPU reservations, kv
//! services under load with fault after fault) take
//! [`common::pace_sensitive`]: each used to run alone in its own binary,
//! and at most one of them runs at a time here.

mod common;

mod api_limits;
mod bad_input;
mod bench_hostile;
mod blk;
mod boot;
mod checkpoint;
mod checkpoint_late_errors;
mod cli_docs;
mod config_file;
mod file_input;
mod filecache;
mod host_api;
mod host_sandboxes;
mod http_api;
mod inject;
mod linux;
mod logging;
mod net;
mod net_first_try;
mod process_name;
mod recovery;
mod rejuvenate;
mod replicate;
mod report;
mod sandbox;
mod sandbox_budget;
mod sandbox_campaign;
mod sandbox_disk;
mod sandbox_doorbell;
mod sandbox_recovery;
mod sandbox_remote;
mod sandbox_rollback_commit;
mod sandbox_shared_link;
mod sandbox_state;
mod sandbox_storm;
mod sandbox_tapflood;
mod sandbox_workloads;
mod seccomp;
mod state;
