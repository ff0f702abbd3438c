//! The VMM's view of guest RAM for replication: regions, flat offsets,
//! slices read in place, and runs of contiguous pages.

use nl_memory::GuestMemory;

use crate::protocol::{PAGE, PAGES_PER_FRAME};

/// Host view of guest RAM for sending pages without copying them.
pub(crate) struct RamView {
    regions: Vec<(u64, u64, u64)>, // gpa, size, host address
}

impl RamView {
    pub(crate) fn new(m: &GuestMemory) -> Self {
        Self {
            regions: m
                .regions()
                .iter()
                .zip(m.host_addrs())
                .map(|(r, h)| (r.gpa, r.size, h))
                .collect(),
        }
    }

    /// The bytes of guest RAM `[gpa, gpa + len)`; call only with the vCPUs
    /// paused (devices run on vCPU threads, so nothing writes meanwhile).
    pub(crate) fn slice(&self, gpa: u64, len: usize) -> Result<&[u8], String> {
        let &(rg, _, host) = self
            .regions
            .iter()
            .find(|&&(g, sz, _)| gpa >= g && gpa + len as u64 <= g + sz)
            .ok_or_else(|| format!("{gpa:#x}+{len:#x} is not guest RAM"))?;
        // SAFETY: the range lies inside a live MAP_SHARED mapping owned by the VM (checked above); vCPUs are paused.
        Ok(unsafe { std::slice::from_raw_parts((host + gpa - rg) as *const u8, len) })
    }

    /// Offset of `gpa` in all RAM regions laid end to end.
    pub(crate) fn flat(&self, gpa: u64) -> Option<usize> {
        let mut base = 0u64;
        for &(g, sz, _) in &self.regions {
            if gpa >= g && gpa < g + sz {
                return Some((base + gpa - g) as usize);
            }
            base += sz;
        }
        None
    }

    pub(crate) fn total(&self) -> usize {
        self.regions.iter().map(|r| r.1 as usize).sum()
    }

    /// Per-region bitmaps (as KVM takes them) with the bits of `pages` set.
    pub(crate) fn bitmaps(&self, pages: &[u64]) -> Vec<Vec<u64>> {
        let mut b: Vec<Vec<u64>> =
            self.regions.iter().map(|r| vec![0u64; (r.1 as usize / PAGE).div_ceil(64)]).collect();
        for &g in pages {
            if let Some(i) = self.regions.iter().position(|&(rg, sz, _)| g >= rg && g < rg + sz) {
                let pg = ((g - self.regions[i].0) / PAGE as u64) as usize;
                b[i][pg / 64] |= 1 << (pg % 64);
            }
        }
        b
    }

    pub(crate) fn contains(&self, gpa: u64) -> bool {
        self.regions.iter().any(|&(g, sz, _)| gpa >= g && gpa < g + sz)
    }
}

/// Sorted page addresses coalesced into (gpa, pages) runs of at most `max`.
/// Coalesces sorted page addresses into runs `(gpa, pages)` of at most `max`.
pub(crate) fn runs(pages: &[u64], max: u32) -> Vec<(u64, u32)> {
    let mut out: Vec<(u64, u32)> = Vec::new();
    for &g in pages {
        match out.last_mut() {
            Some((s, n)) if *s + u64::from(*n) * PAGE as u64 == g && *n < max => *n += 1,
            _ => out.push((g, 1)),
        }
    }
    out
}

/// [`runs`] of at most a frame's worth of pages.
pub(crate) fn runs_of(pages: &[u64]) -> Vec<(u64, u32)> {
    runs(pages, PAGES_PER_FRAME as u32)
}
