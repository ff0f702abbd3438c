//! Primary/backup replication of a running VM (HBFT; Remus and Taiji are
//! the same family; see `../shared/papers/hbft-primary-backup-optimizations.txt`).
//!
//! * [`protocol`]: framed, versioned messages, sealed with a MAC under a
//!   session key.
//! * [`auth`]: the pre-shared key file and the challenge-response handshake
//!   that authenticates both ends and derives the session key.
//! * [`primary`]: epochs: pause, collect dirty pages (KVM dirty log plus
//!   pages the VMM's devices wrote), save state, resume, send, wait for the
//!   ack, then release the epoch's network output (output commit).
//! * [`backup`]: stages each epoch and applies it only when complete and
//!   verified; heartbeats; decides when the primary is gone.
//! * [`colo`] and [`secondary`]: COLO (`--colo`): a secondary VM on the
//!   backup runs on the primary's input, and a reply leaves as soon as the
//!   secondary sent the same; a checkpoint only when they differ.
//!
//! Split brain: the primary releases output only for epochs the backup
//! acknowledged, and the backup stops acknowledging before it activates.
//! The primary goes on unprotected only when the backup's host reported the
//! backup gone (refused, reset or closed connection); after silence (a
//! partition looks the same as a dead host), or a frame from the backup
//! that fails authentication, it holds output and, once the lease has run
//! out, stops its VM (fenced). The backup activates only from an epoch it
//! acknowledged to an authenticated primary, and only once that primary's
//! lease has run out (see [`backup`]).

pub mod auth;
pub mod backup;
pub mod colo;
mod compare;
mod predict;
pub mod primary;
pub mod protocol;
mod ram;
pub mod secondary;
