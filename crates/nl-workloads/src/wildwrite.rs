//! `wildwrite`: random writes at random addresses over everything a sandbox
//! can reach from ring 3 (an isolation test, not a benchmark).
//!
//! The targets, in equal shares: the sandbox's user heap, its channels' own
//! windows (read-write) and its channels' peer windows (read-only: every
//! such write must exit to the VMM and be reported). The plan is a pure
//! function of the seed, so the host knows exactly how many writes went to
//! read-only windows ([`Plan::expected`]) and can check the VMM counted each.

use crate::mix64;

/// Writes in one run.
pub const WRITES: u64 = 6000;

/// Where one write goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Byte offset (8-aligned) into the user heap.
    Heap(u64),
    /// Channel index and byte offset (8-aligned) into its own window.
    Own(usize, u64),
    /// Channel index and byte offset (8-aligned) into its peer's window.
    Peer(usize, u64),
}

/// The writes of one run.
#[derive(Clone, Debug)]
pub struct Plan {
    rng: u64,
    left: u64,
    heap_bytes: u64,
    channels: usize,
    window_bytes: u64,
}

/// How many writes of a run go where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub heap: u64,
    pub own: u64,
    pub peer: u64,
}

impl Plan {
    /// `writes` writes over a heap of `heap_bytes` and `channels` channels
    /// whose windows are `window_bytes` each.
    pub fn new(
        seed: u64,
        writes: u64,
        heap_bytes: u64,
        channels: usize,
        window_bytes: u64,
    ) -> Self {
        Self { rng: mix64(seed ^ 0x3117_3117), left: writes, heap_bytes, channels, window_bytes }
    }

    /// What a run of this plan does, counted without doing it.
    pub fn expected(&self) -> Counts {
        let mut c = Counts::default();
        for (t, _) in self.clone() {
            match t {
                Target::Heap(_) => c.heap += 1,
                Target::Own(..) => c.own += 1,
                Target::Peer(..) => c.peer += 1,
            }
        }
        c
    }
}

impl Iterator for Plan {
    /// The target and the value written.
    type Item = (Target, u64);

    fn next(&mut self) -> Option<(Target, u64)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        self.rng = mix64(self.rng);
        let r = self.rng;
        let value = mix64(r ^ 0xdead_beef);
        let kinds = if self.channels == 0 || self.window_bytes < 8 { 1 } else { 3 };
        let words = |bytes: u64| (bytes / 8).max(1);
        let t = match r % kinds {
            0 => Target::Heap((r >> 8) % words(self.heap_bytes) * 8),
            k => {
                let ch = ((r >> 4) % self.channels as u64) as usize;
                let off = (r >> 16) % words(self.window_bytes) * 8;
                if k == 1 {
                    Target::Own(ch, off)
                } else {
                    Target::Peer(ch, off)
                }
            }
        };
        Some((t, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_is_deterministic_and_covers_every_kind_of_target() {
        let p = Plan::new(5, WRITES, 64 << 20, 1, 2 << 20);
        let c = p.expected();
        assert_eq!(c.heap + c.own + c.peer, WRITES);
        assert!(c.heap > WRITES / 4 && c.own > WRITES / 4 && c.peer > WRITES / 4, "{c:?}");
        assert_eq!(Plan::new(5, WRITES, 64 << 20, 1, 2 << 20).expected(), c);
        assert_ne!(Plan::new(6, WRITES, 64 << 20, 1, 2 << 20).expected(), c);
        for (t, _) in p {
            match t {
                Target::Heap(o) => assert!(o < 64 << 20 && o % 8 == 0),
                Target::Own(ch, o) | Target::Peer(ch, o) => {
                    assert!(ch == 0 && o < 2 << 20 && o % 8 == 0)
                }
            }
        }
    }

    #[test]
    fn without_channels_every_write_goes_to_the_heap() {
        let c = Plan::new(1, 100, 4096, 0, 2 << 20).expected();
        assert_eq!(c, Counts { heap: 100, own: 0, peer: 0 });
    }
}
