//! Output commit for a VM under rollback (Remus-style, without a backup):
//! the frames the guest transmits, and the writes it makes to a writable
//! virtio-blk disk, are held until no rollback can undo the state that
//! produced them.
//!
//! A disk is part of the VM's state, not only output: a rollback that
//! restored memory but left later writes on the image would have the
//! guest's file system metadata (in memory) describe data the undone
//! execution overwrote. So the device holds every write (later reads of
//! its sectors see it) and the image only ever takes the writes of
//! checkpoints no rollback can go behind; a rollback writes its target's
//! and drops the rest, as for frames. Holding disk writes is always on for
//! a writable disk (it is what makes rollback correct); holding frames is
//! `CheckpointConfig::output_commit`.
//!
//! The supervisor holds the network device's output from the start. At each
//! checkpoint `k` it takes the frames transmitted since checkpoint `k - 1`
//! (the VM paused, so the batch ends exactly at the checkpoint) and queues
//! them tagged with checkpoint `k`: they are part of `k`'s state.
//!
//! * Release: a batch goes out once its checkpoint qualifies as a rollback
//!   target for every working vCPU with the base detection latency `L`
//!   (its guest clock + `L` < now, [`crate::supervisor::qualifies`]). Guest
//!   clocks only grow, so from then on every rollback without recurrence
//!   lands at or after that checkpoint and never undoes the batch. The
//!   supervisor checks this at every checkpoint and every few ms between.
//! * Rollback to target `T`: batches of checkpoints up to `T` are released
//!   (they are part of `T`'s state); later batches and the frames the
//!   device still holds are dropped and counted.
//! * A rollback to a target older than the newest released batch (a
//!   recurrence's doubled look-back, a ring merge, the run's first
//!   checkpoint) undoes output already sent: counted, never hidden.
//! * End of the run: a completed guest's output is released, any other
//!   outcome's dropped.
//!
//! Pure bookkeeping: no VM here (the supervisor moves the frames).

use std::collections::VecDeque;
use std::time::Instant;

use nl_devices::virtio::held_writes::DiskWrite;
use serde::Serialize;

/// What may leave now: frames to send and disk writes to put on the image,
/// each in guest order.
#[derive(Debug, Default, PartialEq)]
pub struct Released {
    pub frames: Vec<Vec<u8>>,
    pub disk: Vec<DiskWrite>,
}

/// Frames and disk writes held for one checkpoint interval.
#[derive(Debug)]
struct Batch {
    /// The checkpoint that ends the batch (its sequence number).
    id: u64,
    clock: Vec<u64>,
    /// The run's first checkpoint: every rollback lands at or after it.
    first: bool,
    frames: Vec<Vec<u8>>,
    disk: Vec<DiskWrite>,
    /// When its oldest frame was transmitted (held).
    since: Instant,
}

/// What output commit did over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct OutputCommitStats {
    pub frames_released: u64,
    /// Frames never sent: transmitted by a state a rollback undid, or held
    /// when the run ended other than by completion.
    pub frames_dropped: u64,
    /// Non-empty batches queued (one per checkpoint interval with output).
    pub batches: u64,
    /// Per released batch, from its oldest frame's transmission to its
    /// release (the batch's other frames waited less), ms.
    pub hold_ms_median: f64,
    pub hold_ms_max: f64,
    /// Rollbacks to a target older than output already released: output
    /// the guest sent was undone (recurrence doubling, ring merge).
    pub rollbacks_past_released_output: u64,
    /// Disk writes (and flushes) put on the image once their checkpoint
    /// could no longer be undone, and those a rollback (or an erroneous
    /// end) undid before they reached it.
    pub disk_writes_released: u64,
    pub disk_writes_dropped: u64,
    /// The most bytes of disk writes held at once, and the times the disk
    /// left the guest's requests in its ring because that reached the
    /// device's cap (`nl_devices::virtio::blk::DEFAULT_HOLD_CAP`): the
    /// guest then waits for releases, memory stays bounded.
    pub disk_held_bytes_max: u64,
    pub disk_hold_cap_waits: u64,
}

/// The held output of one run (see the module doc).
#[derive(Debug, Default)]
pub struct OutputCommit {
    queue: VecDeque<Batch>,
    /// The checkpoint of the newest released batch.
    released_through: Option<u64>,
    frames_released: u64,
    frames_dropped: u64,
    batches: u64,
    holds_ms: Vec<f64>,
    past_released: u64,
    disk_released: u64,
    disk_dropped: u64,
}

impl OutputCommit {
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues the frames transmitted and the disk writes made before
    /// checkpoint `id` (taken at the checkpoint, `since` when the oldest
    /// frame was held). Empty batches are not kept.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        id: u64,
        clock: &[u64],
        first: bool,
        frames: Vec<Vec<u8>>,
        disk: Vec<DiskWrite>,
        since: Option<Instant>,
        at: Instant,
    ) {
        if frames.is_empty() && disk.is_empty() {
            return;
        }
        debug_assert!(self.queue.back().is_none_or(|b| b.id < id), "batches in checkpoint order");
        if !frames.is_empty() {
            self.batches += 1;
        }
        self.queue.push_back(Batch {
            id,
            clock: clock.to_vec(),
            first,
            frames,
            disk,
            since: since.unwrap_or(at).min(at),
        });
    }

    /// Frames held in batches now.
    pub fn held_frames(&self) -> usize {
        self.queue.iter().map(|b| b.frames.len()).sum()
    }

    /// Whether nothing (frames or disk writes) is held in batches.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Counts batch `b`'s frames as released at `at` (with their hold).
    fn frames_out(&mut self, b: &Batch, at: Instant) {
        if !b.frames.is_empty() {
            self.holds_ms.push(at.saturating_duration_since(b.since).as_secs_f64() * 1e3);
        }
        self.frames_released += b.frames.len() as u64;
    }

    fn release_front(&mut self, at: Instant, out: &mut Released) {
        let b = self.queue.pop_front().expect("checked by the caller");
        self.frames_out(&b, at);
        self.disk_released += b.disk.len() as u64;
        self.released_through = Some(b.id);
        out.frames.extend(b.frames);
        out.disk.extend(b.disk);
    }

    /// Drops every queued batch (counted).
    fn drop_queued(&mut self) -> usize {
        let mut frames = 0;
        for b in self.queue.drain(..) {
            frames += b.frames.len();
            self.disk_dropped += b.disk.len() as u64;
        }
        frames
    }

    /// The frames and disk writes whose checkpoint now qualifies as a
    /// rollback target for every working vCPU (guest clock `now`, base
    /// latency `latency_ns`), in guest order; to leave now.
    pub fn releasable(
        &mut self,
        now: &[u64],
        working: &[bool],
        latency_ns: u64,
        at: Instant,
    ) -> Released {
        let mut out = Released::default();
        while self.queue.front().is_some_and(|b| {
            b.first || crate::supervisor::qualifies(&b.clock, now, working, latency_ns)
        }) {
            self.release_front(at, &mut out);
        }
        out
    }

    /// The batches of checkpoints up to `id`, in guest order, to leave now
    /// ([`crate::supervisor::CommitRule::NextCheckpoint`]: `id` is the
    /// checkpoint before the newest).
    pub fn release_through(&mut self, id: u64, at: Instant) -> Released {
        let mut out = Released::default();
        while self.queue.front().is_some_and(|b| b.id <= id) {
            self.release_front(at, &mut out);
        }
        out
    }

    /// A rollback to checkpoint `target`: returns what leaves now (batches
    /// up to `target`, part of its state) and whether the rollback undoes
    /// output already released. Later batches, `device_held` frames
    /// (transmitted since the newest checkpoint) and `device_disk` disk
    /// writes (made since) are dropped.
    pub fn rollback(
        &mut self,
        target: u64,
        device_held: usize,
        device_disk: usize,
        at: Instant,
    ) -> (Released, bool) {
        let mut out = Released::default();
        while self.queue.front().is_some_and(|b| b.id <= target) {
            self.release_front(at, &mut out);
        }
        let dropped = self.drop_queued();
        self.frames_dropped += (dropped + device_held) as u64;
        self.disk_dropped += device_disk as u64;
        let past = self.released_through.is_some_and(|r| r > target);
        if past {
            self.past_released += 1;
            // The undone output is out; what is released from here on
            // follows the target.
            self.released_through = Some(target);
        }
        (out, past)
    }

    /// Counts a rollback that undid released output other than frames
    /// (a held channel's records, `crate::supervisor::HeldRegion`).
    pub fn note_past_released(&mut self) {
        self.past_released += 1;
    }

    /// The end of the run: with `completed`, every queued frame and
    /// `device_held` are returned to be sent; otherwise all are dropped.
    /// With `keep_disk`, the queued disk writes are returned to go to the
    /// image; otherwise they are dropped (the caller does the same with
    /// the device's own held writes).
    pub fn finish(
        &mut self,
        completed: bool,
        keep_disk: bool,
        device_held: Vec<Vec<u8>>,
        at: Instant,
    ) -> Released {
        let mut out = Released::default();
        for b in std::mem::take(&mut self.queue) {
            if completed {
                self.frames_out(&b, at);
                out.frames.extend(b.frames);
            } else {
                self.frames_dropped += b.frames.len() as u64;
            }
            if keep_disk {
                self.disk_released += b.disk.len() as u64;
                out.disk.extend(b.disk);
            } else {
                self.disk_dropped += b.disk.len() as u64;
            }
        }
        if completed {
            self.frames_released += device_held.len() as u64;
            out.frames.extend(device_held);
        } else {
            self.frames_dropped += device_held.len() as u64;
        }
        out
    }

    pub fn stats(&self) -> OutputCommitStats {
        let mut h = self.holds_ms.clone();
        h.sort_by(f64::total_cmp);
        let median = match h.len() {
            0 => 0.0,
            n if n % 2 == 1 => h[n / 2],
            n => (h[n / 2 - 1] + h[n / 2]) / 2.0,
        };
        OutputCommitStats {
            frames_released: self.frames_released,
            frames_dropped: self.frames_dropped,
            batches: self.batches,
            hold_ms_median: median,
            hold_ms_max: h.last().copied().unwrap_or(0.0),
            rollbacks_past_released_output: self.past_released,
            disk_writes_released: self.disk_released,
            disk_writes_dropped: self.disk_dropped,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = 1_000_000;
    const L: u64 = 100 * MS;

    fn frames(tag: u8, n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| vec![tag, i as u8]).collect()
    }

    /// Checkpoints every 20 ms of guest time (one vCPU), each with two frames.
    fn run(n: u64, t0: Instant) -> OutputCommit {
        let mut oc = OutputCommit::new();
        for k in 1..=n {
            oc.push(k, &[k * 20 * MS], false, frames(k as u8, 2), Vec::new(), Some(t0), t0);
        }
        oc
    }

    #[test]
    fn a_batch_is_released_only_once_its_checkpoint_is_a_rollback_target() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        // Now 150 ms: checkpoints at 20, 40 qualify (strictly older than L).
        let out = oc.releasable_frames(&[150 * MS], &[true], L, t0);
        assert_eq!(out, [frames(1, 2), frames(2, 2)].concat());
        // Exactly L old (checkpoint 3 at 60 ms, now 160 ms) does not qualify.
        assert!(oc.releasable_frames(&[160 * MS], &[true], L, t0).is_empty());
        assert_eq!(oc.releasable_frames(&[161 * MS], &[true], L, t0), frames(3, 2));
        // Nothing is released twice.
        assert!(oc.releasable_frames(&[161 * MS], &[true], L, t0).is_empty());
        assert_eq!(oc.stats().frames_released, 6);
        assert_eq!(oc.held_frames(), 14);
    }

    #[test]
    fn next_checkpoint_releases_through_the_one_before_the_newest_and_a_rollback_there_undoes_none()
    {
        let t0 = Instant::now();
        let mut oc = run(3, t0);
        // Checkpoint 3 is the newest: batches 1 and 2 leave.
        let out = oc.release_through(2, t0);
        assert_eq!(out.frames, [frames(1, 2), frames(2, 2)].concat());
        assert!(oc.release_through(2, t0).frames.is_empty(), "nothing leaves twice");
        assert_eq!(oc.held_frames(), 2);
        // A first rollback goes to checkpoint 2: batch 3 dropped, nothing
        // that left undone.
        let (out, past) = oc.rollback(2, 1, 0, t0);
        assert!(out.frames.is_empty());
        assert!(!past);
        assert_eq!(oc.stats().frames_dropped, 3);
        // One further back would have.
        let (_, past) = oc.rollback(1, 0, 0, t0);
        assert!(past);
        assert_eq!(oc.stats().rollbacks_past_released_output, 1);
    }

    #[test]
    fn a_vcpu_that_did_not_run_holds_the_output_back_unless_it_is_done() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        oc.push(1, &[20 * MS, 20 * MS], false, frames(1, 1), Vec::new(), None, t0);
        // vCPU 1 ran only 50 ms since: the batch waits.
        assert!(oc.releasable_frames(&[500 * MS, 70 * MS], &[true, true], L, t0).is_empty());
        // Done vCPUs do not count.
        assert_eq!(oc.releasable_frames(&[500 * MS, 70 * MS], &[true, false], L, t0).len(), 1);
    }

    #[test]
    fn the_first_checkpoints_output_goes_out_at_once() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        oc.push(0, &[0], true, frames(0, 3), Vec::new(), None, t0);
        assert_eq!(oc.releasable_frames(&[0], &[true], L, t0).len(), 3);
    }

    #[test]
    fn a_rollback_releases_its_targets_output_and_drops_the_rest() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        let (out, past) = oc.rollback(4, 5, 0, t0);
        let out = out.frames;
        assert_eq!(out.len(), 8, "batches 1..=4 are part of the target's state");
        assert!(!past);
        let s = oc.stats();
        assert_eq!((s.frames_released, s.frames_dropped), (8, 6 * 2 + 5));
        assert_eq!(oc.held_frames(), 0);
        // Later output continues normally.
        oc.push(11, &[300 * MS], false, frames(11, 1), Vec::new(), None, t0);
        assert_eq!(oc.releasable_frames(&[401 * MS], &[true], L, t0).len(), 1);
    }

    #[test]
    fn a_rollback_past_released_output_is_counted() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        assert_eq!(oc.releasable_frames(&[200 * MS], &[true], L, t0).len(), 8); // 1..=4
                                                                                // A recurrence goes back to checkpoint 2: batches 3 and 4 were sent.
        let (out, past) = oc.rollback(2, 0, 0, t0);
        let out = out.frames;
        assert!(out.is_empty() && past);
        assert_eq!(oc.stats().rollbacks_past_released_output, 1);
        // A rollback at or after the newest released batch is not.
        oc.push(11, &[400 * MS], false, frames(11, 1), Vec::new(), None, t0);
        assert_eq!(oc.releasable_frames(&[501 * MS], &[true], L, t0).len(), 1);
        let (_, past) = oc.rollback(11, 0, 0, t0);
        assert!(!past);
        assert_eq!(oc.stats().rollbacks_past_released_output, 1);
    }

    #[test]
    fn the_end_releases_a_completed_guests_output_and_drops_any_other() {
        let t0 = Instant::now();
        let mut oc = run(3, t0);
        assert_eq!(oc.finish(true, true, frames(9, 1), t0).frames.len(), 7);
        assert_eq!(oc.stats().frames_released, 7);
        let mut oc = run(3, t0);
        assert!(oc.finish(false, false, frames(9, 1), t0).frames.is_empty());
        assert_eq!(oc.stats().frames_dropped, 7);
    }

    #[test]
    fn hold_times_run_from_the_oldest_frame_to_the_release() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        for (k, held) in [(1u64, 30u64), (2, 10), (3, 20)] {
            oc.push(k, &[k], false, frames(1, 1), Vec::new(), Some(t0), t0);
            oc.releasable_frames(&[k + L + 1], &[true], L, t0 + Duration::from_millis(held));
        }
        let s = oc.stats();
        assert_eq!((s.batches, s.hold_ms_median, s.hold_ms_max), (3, 20.0, 30.0));
        assert!(oc.push_empty_is_ignored());
    }

    fn write(seq: u64) -> DiskWrite {
        DiskWrite { seq, sector: seq * 8, data: vec![seq as u8; 512].into() }
    }

    #[test]
    fn disk_writes_follow_their_checkpoint_like_frames() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        // Checkpoints 1..=4 every 20 ms: 1 and 3 with a disk write only.
        for k in 1..=4u64 {
            let disk = if k % 2 == 1 { vec![write(k)] } else { Vec::new() };
            oc.push(
                k,
                &[k * 20 * MS],
                false,
                frames(k as u8, (k % 2 == 0) as usize),
                disk,
                None,
                t0,
            );
        }
        // Disk-only batches are not counted as frame batches.
        assert_eq!(oc.stats().batches, 2);
        // Now 150 ms: checkpoints 1 and 2 qualify.
        let r = oc.releasable(&[150 * MS], &[true], L, t0);
        assert_eq!((r.frames, r.disk), (frames(2, 1), vec![write(1)]));
        // A rollback to 3 releases 3's write, drops 4's frame and 2 writes
        // made since the newest checkpoint.
        let (r, past) = oc.rollback(3, 0, 2, t0);
        assert_eq!((r.disk, past), (vec![write(3)], false));
        let s = oc.stats();
        assert_eq!((s.disk_writes_released, s.disk_writes_dropped), (2, 2));
        assert!(oc.is_empty());
        // The end: kept, or dropped after an erroneous run.
        oc.push(5, &[200 * MS], false, Vec::new(), vec![write(5)], None, t0);
        assert_eq!(oc.finish(false, true, Vec::new(), t0).disk, vec![write(5)]);
        oc.push(6, &[220 * MS], false, Vec::new(), vec![write(6)], None, t0);
        assert!(oc.finish(true, false, Vec::new(), t0).disk.is_empty());
        assert_eq!(oc.stats().disk_writes_dropped, 3);
    }

    impl OutputCommit {
        fn releasable_frames(
            &mut self,
            now: &[u64],
            working: &[bool],
            latency_ns: u64,
            at: Instant,
        ) -> Vec<Vec<u8>> {
            self.releasable(now, working, latency_ns, at).frames
        }

        fn push_empty_is_ignored(&mut self) -> bool {
            let before = self.batches;
            self.push(99, &[0], false, Vec::new(), Vec::new(), None, Instant::now());
            self.batches == before
        }
    }
}
