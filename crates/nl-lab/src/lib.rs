//! The lab: every measurement ninelives makes of itself, on one harness.
//!
//! - [`bench`]: `ninelives bench` and its mechanisms (checkpoint,
//!   rejuvenate, replicate, recovery, hostile), each a ratio against a
//!   baseline measured in the same run;
//! - [`campaign`]: `ninelives inject`, the ptrace fault-injection campaign
//!   (the injector itself is the `nl-inject` crate), and its sandbox mode
//!   [`sandbox_campaign`] (`--setup sandbox`);
//! - [`ping`], [`kvload`], [`echo_server`]: the external load generators
//!   and checkers the benches run as processes;
//! - [`report`]: `ninelives report`, every bench and campaign with the
//!   papers' numbers beside ours, as an HTML page with SVG figures;
//! - the harness: [`netns`] (network namespaces), [`figures`] (SVG plots).
//!
//! The `ninelives` binary dispatches its `bench`, `inject`, `ping`,
//! `kvload` and `echo-server` subcommands here; the lab never calls back
//! into the CLI crate (it starts the `ninelives` binary as a process when
//! it needs a VMM of its own).

pub mod args;
pub mod bench;
pub mod campaign;
pub mod echo_server;
pub mod figures;
pub mod json_out;
pub mod kvload;
pub mod netns;
pub mod ping;
pub mod process;
pub mod report;
pub mod sandbox_campaign;
pub mod shards;
pub mod stalls;
pub mod stats;
