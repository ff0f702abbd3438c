//! Primary/backup replication of a running VM (HBFT; Remus and Taiji are
//! the same family; see `../shared/papers/hbft-primary-backup-optimizations.txt`).
//!
//! * [`protocol`]: framed, versioned, checksummed messages.
//! * [`primary`]: epochs: pause, collect dirty pages (KVM dirty log plus
//!   pages the VMM's devices wrote), save state, resume, send, wait for the
//!   ack, then release the epoch's network output (output commit).
//! * [`backup`]: stages each epoch and applies it only when complete and
//!   verified; heartbeats; decides when the primary is gone.
//!
//! Split brain: the primary releases output only for epochs the backup
//! acknowledged, and the backup stops acknowledging before it activates.
//! The primary goes on unprotected only when the backup's host reported the
//! backup gone (refused, reset or closed connection); after silence (a
//! partition looks the same as a dead host) it holds output and, once the
//! lease has run out, stops its VM (fenced). The backup activates at once
//! when the primary's connection closes (its process died) and otherwise
//! only after a full lease without frames.

pub mod backup;
mod predict;
pub mod primary;
pub mod protocol;
mod ram;
