//! Launching VMs of the reference guest: the layer below both the
//! command-line front end (`ninelives`) and the lab (`nl-lab`).
//!
//! - [`args`]: the arguments that describe a workload and a machine, and the
//!   `run`, `checkpoint` and `restore` commands' arguments;
//! - [`guest`]: from those arguments to [`nl_vmm::VmConfig`]s;
//! - [`vm_spec`]: a VM described declaratively (the API's `create` and
//!   configuration files);
//! - [`verify`]: checking the guests' digests against the host's own run of
//!   the same workload;
//! - [`run`], [`checkpoint`], [`replicate`]: running VMs plainly, under
//!   VM-μCheckpoint, or replicated to a backup (each as a library call the
//!   benches use, and as the command the CLI dispatches to).

pub mod args;
pub mod checkpoint;
pub mod guest;
pub mod replicate;
pub mod run;
pub mod run_linux;
pub mod verify;
pub mod vm_spec;
