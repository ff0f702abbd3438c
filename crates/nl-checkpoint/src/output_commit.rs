//! Output commit for a VM under rollback (Remus-style, without a backup):
//! the frames the guest transmits are held until no rollback can undo the
//! state that produced them.
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

use serde::Serialize;

/// Frames held for one checkpoint interval.
#[derive(Debug)]
struct Batch {
    /// The checkpoint that ends the batch (its sequence number).
    id: u64,
    clock: Vec<u64>,
    /// The run's first checkpoint: every rollback lands at or after it.
    first: bool,
    frames: Vec<Vec<u8>>,
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
}

impl OutputCommit {
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues the frames transmitted before checkpoint `id` (taken at the
    /// checkpoint, `since` when the oldest was held). Empty batches are not
    /// kept.
    pub fn push(
        &mut self,
        id: u64,
        clock: &[u64],
        first: bool,
        frames: Vec<Vec<u8>>,
        since: Option<Instant>,
        at: Instant,
    ) {
        if frames.is_empty() {
            return;
        }
        debug_assert!(self.queue.back().is_none_or(|b| b.id < id), "batches in checkpoint order");
        self.batches += 1;
        self.queue.push_back(Batch {
            id,
            clock: clock.to_vec(),
            first,
            frames,
            since: since.unwrap_or(at).min(at),
        });
    }

    /// Frames held in batches now.
    pub fn held_frames(&self) -> usize {
        self.queue.iter().map(|b| b.frames.len()).sum()
    }

    fn release_front(&mut self, at: Instant, out: &mut Vec<Vec<u8>>) {
        let b = self.queue.pop_front().expect("checked by the caller");
        self.holds_ms.push(at.saturating_duration_since(b.since).as_secs_f64() * 1e3);
        self.frames_released += b.frames.len() as u64;
        self.released_through = Some(b.id);
        out.extend(b.frames);
    }

    /// The frames whose checkpoint now qualifies as a rollback target for
    /// every working vCPU (guest clock `now`, base latency `latency_ns`), in
    /// transmission order; to be sent now.
    pub fn releasable(
        &mut self,
        now: &[u64],
        working: &[bool],
        latency_ns: u64,
        at: Instant,
    ) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|b| {
            b.first || crate::supervisor::qualifies(&b.clock, now, working, latency_ns)
        }) {
            self.release_front(at, &mut out);
        }
        out
    }

    /// A rollback to checkpoint `target`: returns the frames to send now
    /// (batches up to `target`, part of its state) and whether the rollback
    /// undoes output already released. Later batches and `device_held`
    /// (frames transmitted since the newest checkpoint) are dropped.
    pub fn rollback(
        &mut self,
        target: u64,
        device_held: usize,
        at: Instant,
    ) -> (Vec<Vec<u8>>, bool) {
        let mut out = Vec::new();
        while self.queue.front().is_some_and(|b| b.id <= target) {
            self.release_front(at, &mut out);
        }
        let dropped: usize = self.queue.drain(..).map(|b| b.frames.len()).sum();
        self.frames_dropped += (dropped + device_held) as u64;
        let past = self.released_through.is_some_and(|r| r > target);
        if past {
            self.past_released += 1;
            // The undone output is out; what is released from here on
            // follows the target.
            self.released_through = Some(target);
        }
        (out, past)
    }

    /// The end of the run: with `completed`, every queued frame and
    /// `device_held` are returned to be sent; otherwise all are dropped.
    pub fn finish(
        &mut self,
        completed: bool,
        device_held: Vec<Vec<u8>>,
        at: Instant,
    ) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if completed {
            while !self.queue.is_empty() {
                self.release_front(at, &mut out);
            }
            self.frames_released += device_held.len() as u64;
            out.extend(device_held);
        } else {
            let dropped: usize = self.queue.drain(..).map(|b| b.frames.len()).sum();
            self.frames_dropped += (dropped + device_held.len()) as u64;
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
            oc.push(k, &[k * 20 * MS], false, frames(k as u8, 2), Some(t0), t0);
        }
        oc
    }

    #[test]
    fn a_batch_is_released_only_once_its_checkpoint_is_a_rollback_target() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        // Now 150 ms: checkpoints at 20, 40 qualify (strictly older than L).
        let out = oc.releasable(&[150 * MS], &[true], L, t0);
        assert_eq!(out, [frames(1, 2), frames(2, 2)].concat());
        // Exactly L old (checkpoint 3 at 60 ms, now 160 ms) does not qualify.
        assert!(oc.releasable(&[160 * MS], &[true], L, t0).is_empty());
        assert_eq!(oc.releasable(&[161 * MS], &[true], L, t0), frames(3, 2));
        // Nothing is released twice.
        assert!(oc.releasable(&[161 * MS], &[true], L, t0).is_empty());
        assert_eq!(oc.stats().frames_released, 6);
        assert_eq!(oc.held_frames(), 14);
    }

    #[test]
    fn a_vcpu_that_did_not_run_holds_the_output_back_unless_it_is_done() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        oc.push(1, &[20 * MS, 20 * MS], false, frames(1, 1), None, t0);
        // vCPU 1 ran only 50 ms since: the batch waits.
        assert!(oc.releasable(&[500 * MS, 70 * MS], &[true, true], L, t0).is_empty());
        // Done vCPUs do not count.
        assert_eq!(oc.releasable(&[500 * MS, 70 * MS], &[true, false], L, t0).len(), 1);
    }

    #[test]
    fn the_first_checkpoints_output_goes_out_at_once() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        oc.push(0, &[0], true, frames(0, 3), None, t0);
        assert_eq!(oc.releasable(&[0], &[true], L, t0).len(), 3);
    }

    #[test]
    fn a_rollback_releases_its_targets_output_and_drops_the_rest() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        let (out, past) = oc.rollback(4, 5, t0);
        assert_eq!(out.len(), 8, "batches 1..=4 are part of the target's state");
        assert!(!past);
        let s = oc.stats();
        assert_eq!((s.frames_released, s.frames_dropped), (8, 6 * 2 + 5));
        assert_eq!(oc.held_frames(), 0);
        // Later output continues normally.
        oc.push(11, &[300 * MS], false, frames(11, 1), None, t0);
        assert_eq!(oc.releasable(&[401 * MS], &[true], L, t0).len(), 1);
    }

    #[test]
    fn a_rollback_past_released_output_is_counted() {
        let t0 = Instant::now();
        let mut oc = run(10, t0);
        assert_eq!(oc.releasable(&[200 * MS], &[true], L, t0).len(), 8); // 1..=4
                                                                         // A recurrence goes back to checkpoint 2: batches 3 and 4 were sent.
        let (out, past) = oc.rollback(2, 0, t0);
        assert!(out.is_empty() && past);
        assert_eq!(oc.stats().rollbacks_past_released_output, 1);
        // A rollback at or after the newest released batch is not.
        oc.push(11, &[400 * MS], false, frames(11, 1), None, t0);
        assert_eq!(oc.releasable(&[501 * MS], &[true], L, t0).len(), 1);
        let (_, past) = oc.rollback(11, 0, t0);
        assert!(!past);
        assert_eq!(oc.stats().rollbacks_past_released_output, 1);
    }

    #[test]
    fn the_end_releases_a_completed_guests_output_and_drops_any_other() {
        let t0 = Instant::now();
        let mut oc = run(3, t0);
        assert_eq!(oc.finish(true, frames(9, 1), t0).len(), 7);
        assert_eq!(oc.stats().frames_released, 7);
        let mut oc = run(3, t0);
        assert!(oc.finish(false, frames(9, 1), t0).is_empty());
        assert_eq!(oc.stats().frames_dropped, 7);
    }

    #[test]
    fn hold_times_run_from_the_oldest_frame_to_the_release() {
        let t0 = Instant::now();
        let mut oc = OutputCommit::new();
        for (k, held) in [(1u64, 30u64), (2, 10), (3, 20)] {
            oc.push(k, &[k], false, frames(1, 1), Some(t0), t0);
            oc.releasable(&[k + L + 1], &[true], L, t0 + Duration::from_millis(held));
        }
        let s = oc.stats();
        assert_eq!((s.batches, s.hold_ms_median, s.hold_ms_max), (3, 20.0, 30.0));
        assert!(oc.push_empty_is_ignored());
    }

    impl OutputCommit {
        fn push_empty_is_ignored(&mut self) -> bool {
            let before = self.batches;
            self.push(99, &[0], false, Vec::new(), None, Instant::now());
            self.batches == before
        }
    }
}
