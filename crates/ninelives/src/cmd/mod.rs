//! The subcommands that are the VMM front end itself; `run`, `checkpoint`,
//! `restore` and `replicate` are in `nl-launch`, the lab's (`bench`,
//! `inject`, `ping`, `kvload`) in `nl-lab`.

pub mod host;
pub mod host_sandboxes;
pub mod manual;
pub mod rejuvenate;
pub mod sandbox;
