//! A channel's host side: one memfd holding the two output regions, mapped
//! once in the VMM, and the windows each end's VM gets over it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nl_abi::{
    channel_doorbell_gpa, channel_own_gpa, channel_peer_gpa, ChannelWindow, CHANNEL_REGION_BYTES,
};
use nl_vmm::windows::{Doorbell, Window};
use serde::Serialize;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestRegionMmap, MemoryRegionAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use nl_workloads::channel_audit::{Audit, Finding, FramingOnly, Step, Words};
use nl_workloads::chanstream::StreamCheck;

use crate::audit::{Backing, Mapping};
use crate::SandboxError;

/// One channel's memory.
pub struct HostChannel {
    pub name: String,
    /// The channel's index in its set.
    pub index: usize,
    /// Sandbox indices of end 0 and end 1; region `e` is written by end `e`.
    pub ends: [usize; 2],
    pub backing: Backing,
    map: Arc<GuestRegionMmap>,
    /// With a doorbell: `bells[e]` is rung by end `e` and raises the
    /// interrupt in the other end.
    bells: Option<[Arc<EventFd>; 2]>,
    /// Whether the receivers register their irqfds (the diagnostic
    /// `doorbell_irqfd: false` leaves them out).
    irqfd: bool,
    /// The host's check of each region's records (the `channel-check`
    /// detector, [`HostChannel::check_region`]).
    checks: [Mutex<RegionCheck>; 2],
}

/// The host's running check of one region
/// (`nl_workloads::channel_audit`).
#[derive(Default)]
struct RegionCheck {
    audit: Audit,
    /// Its writer runs `chanstream`: every message is checked byte for byte.
    stream: bool,
    /// The first finding not yet taken by the writer's monitor (whichever
    /// monitor's check read it).
    finding: Option<Finding>,
}

/// A region of the host's mapping, as the check reads it.
struct Mapped<'a> {
    map: &'a GuestRegionMmap,
    base: u64,
}

impl Words for Mapped<'_> {
    fn words(&self) -> usize {
        (CHANNEL_REGION_BYTES / 8) as usize
    }
    fn load(&self, word: usize, order: Ordering) -> u64 {
        let at = MemoryRegionAddress(self.base + word as u64 * 8);
        self.map.load::<u64>(at, order).unwrap_or(0)
    }
}

/// One region's header words over the host's mapping, as the checkpoint
/// supervisor of its owner holds its output with
/// (`nl_workloads::channel::HeaderWords`; `nl_checkpoint::HeldRegion`).
struct RegionHeader {
    map: Arc<GuestRegionMmap>,
    base: u64,
}

impl nl_workloads::channel::HeaderWords for RegionHeader {
    fn load(&self, word: usize) -> u64 {
        if word >= nl_workloads::channel::HEADER_WORDS {
            return 0;
        }
        let at = MemoryRegionAddress(self.base + word as u64 * 8);
        self.map.load::<u64>(at, Ordering::Acquire).unwrap_or(0)
    }
    fn store(&self, word: usize, value: u64) {
        if word < nl_workloads::channel::HEADER_WORDS {
            let at = MemoryRegionAddress(self.base + word as u64 * 8);
            // The header lies inside the mapping: this cannot fail.
            let _ = self.map.store(value, at, Ordering::Release);
        }
    }
}

/// Records one check reads at most (a bound on one monitor round's work).
const CHECK_RECORDS: usize = 4096;

/// The windows, boot-info entry, audited mappings and doorbells of one end.
pub struct EndWindows {
    pub windows: Vec<Window>,
    pub info: ChannelWindow,
    pub mappings: Vec<Mapping>,
    pub doorbells: Vec<Doorbell>,
}

/// A region's header as the host reads it (see `nl_workloads::channel`).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct RegionStats {
    /// The writer's generation (0: never initialised).
    pub generation: u64,
    /// Words published by the writer.
    pub head_words: u64,
    /// The peer generation `ack_words` refers to.
    pub ack_generation: u64,
    /// Words of the peer's stream this end has consumed.
    pub ack_words: u64,
    /// This end's receive report on this channel, from its own header (so
    /// only this end, never its peer, can write it; zero again at each of
    /// its starts): records delivered from the peer and records rejected
    /// (bad header, length, sequence or CRC).
    pub received: u64,
    pub rejected: u64,
    /// Of the delivered messages, those its workload found corrupt, the
    /// sequence numbers it found skipped (lost) and the messages that went
    /// back (duplicated), per `nl_workloads::chanstream::pack`, each
    /// saturating at 2^21 - 1; 0 for workloads that do not check.
    pub corrupt: u64,
    pub lost: u64,
    pub duplicated: u64,
}

impl RegionStats {
    /// Messages this end rejected, or found corrupt, lost or duplicated
    /// on this channel.
    pub fn errors(&self) -> u64 {
        self.rejected + self.corrupt + self.lost + self.duplicated
    }
}

/// A channel's state for `stats`.
#[derive(Clone, Debug, Serialize)]
pub struct ChannelStats {
    pub name: String,
    pub between: [String; 2],
    pub regions: [RegionStats; 2],
}

impl HostChannel {
    /// Creates the channel's memfd (two zeroed regions) and maps it, and
    /// with `doorbell` one eventfd per direction.
    pub fn create(
        name: &str,
        index: usize,
        ends: [usize; 2],
        doorbell: bool,
        irqfd: bool,
    ) -> Result<Self, SandboxError> {
        let cname = std::ffi::CString::new(format!("chan-{name}")).map_err(|_| {
            SandboxError::Config(format!("channel name '{name}' contains a NUL byte"))
        })?;
        let fd = memfd_create(&cname, MemFdCreateFlag::MFD_CLOEXEC)
            .map(std::fs::File::from)
            .map_err(|e| {
                SandboxError::Resource(format!("channel '{name}': cannot create its memfd: {e}"))
            })?;
        fd.set_len(2 * CHANNEL_REGION_BYTES).map_err(|e| {
            SandboxError::Resource(format!("channel '{name}': cannot size its memfd: {e}"))
        })?;
        Self::over_file(name, index, ends, fd, doorbell, irqfd)
    }

    /// The channel over an existing memfd of its two regions (created here,
    /// or inherited by a new VMM process taking the set over), with new
    /// doorbell eventfds.
    pub(crate) fn over_file(
        name: &str,
        index: usize,
        ends: [usize; 2],
        fd: std::fs::File,
        doorbell: bool,
        irqfd: bool,
    ) -> Result<Self, SandboxError> {
        let len = fd.metadata().map(|m| m.len()).map_err(|e| {
            SandboxError::Resource(format!("channel '{name}': cannot stat its memfd: {e}"))
        })?;
        if len != 2 * CHANNEL_REGION_BYTES {
            return Err(SandboxError::Resource(format!(
                "channel '{name}': its memfd holds {len} bytes, not the {} of two regions",
                2 * CHANNEL_REGION_BYTES
            )));
        }
        let backing = Backing::of(&fd)?;
        let map = GuestRegionMmap::from_range(
            GuestAddress(0),
            (2 * CHANNEL_REGION_BYTES) as usize,
            Some(FileOffset::new(fd, 0)),
        )
        .map_err(|e| {
            SandboxError::Resource(format!("channel '{name}': cannot map its memfd: {e}"))
        })?;
        let bells = if doorbell {
            let bell = || {
                EventFd::new(EFD_NONBLOCK).map(Arc::new).map_err(|e| {
                    SandboxError::Resource(format!(
                        "channel '{name}': cannot create its doorbell eventfd: {e}"
                    ))
                })
            };
            Some([bell()?, bell()?])
        } else {
            None
        };
        Ok(Self {
            name: name.into(),
            index,
            ends,
            backing,
            map: Arc::new(map),
            bells,
            irqfd,
            checks: Default::default(),
        })
    }

    fn host_addr(&self, region: usize) -> u64 {
        self.map.as_ptr() as u64 + region as u64 * CHANNEL_REGION_BYTES
    }

    /// The two windows end `end` maps as its channel number `index`
    /// (own region read-write, the peer's read-only), what its boot info
    /// says, the mappings the audit checks, and its doorbells (it rings
    /// its own eventfd at `channel_doorbell_gpa(index)`; the peer's rings
    /// its irqfd).
    pub fn windows_for(&self, end: usize, index: u64) -> EndWindows {
        let peer = 1 - end;
        let windows = vec![
            Window {
                gpa: channel_own_gpa(index),
                size: CHANNEL_REGION_BYTES,
                host_addr: self.host_addr(end),
                readonly: false,
            },
            Window {
                gpa: channel_peer_gpa(index),
                size: CHANNEL_REGION_BYTES,
                host_addr: self.host_addr(peer),
                readonly: true,
            },
        ];
        let info = ChannelWindow {
            own_gpa: channel_own_gpa(index),
            peer_gpa: channel_peer_gpa(index),
            bytes: CHANNEL_REGION_BYTES,
            end: end as u64,
            peer: self.ends[peer] as u64,
            doorbell: if self.bells.is_some() { channel_doorbell_gpa(index) } else { 0 },
        };
        let mut doorbells = Vec::new();
        if let Some(b) = &self.bells {
            doorbells.push(Doorbell::Ring { gpa: channel_doorbell_gpa(index), fd: b[end].clone() });
            if self.irqfd {
                doorbells.push(Doorbell::Irq { fd: b[peer].clone() });
            }
        }
        let mapping = |region: usize, writable: bool| Mapping {
            sandbox: self.ends[end],
            backing: self.backing,
            offset: region as u64 * CHANNEL_REGION_BYTES,
            len: CHANNEL_REGION_BYTES,
            writable,
            channel: Some((self.index, region)),
            what: format!("channel '{}' region {region}", self.name),
        };
        EndWindows {
            windows,
            info,
            mappings: vec![mapping(end, true), mapping(peer, false)],
            doorbells,
        }
    }

    /// The memfd holding both regions.
    pub fn file(&self) -> Option<&std::fs::File> {
        self.map.file_offset().map(|f| f.file())
    }

    /// Region `region`'s header, for the checkpoint supervisor of its
    /// owner (a sandbox under `rollback` with output commit) to hold its
    /// output (`nl_workloads::channel`, "Held output").
    pub fn held_region(&self, region: usize) -> nl_checkpoint::HeldRegion {
        Arc::new(RegionHeader {
            map: self.map.clone(),
            base: region.min(1) as u64 * CHANNEL_REGION_BYTES,
        })
    }

    /// Keeps the host mapping alive as long as a VM uses it.
    pub fn keepalive(&self) -> Arc<dyn Send + Sync> {
        self.map.clone()
    }

    /// A copy of region `region`'s bytes.
    pub fn read_region(&self, region: usize) -> Vec<u8> {
        let mut v = vec![0u8; CHANNEL_REGION_BYTES as usize];
        let at = MemoryRegionAddress(region as u64 * CHANNEL_REGION_BYTES);
        // Both regions lie inside the mapping: the read cannot fail.
        let _ = self.map.read_slice(&mut v, at);
        v
    }

    fn word(&self, region: usize, w: u64) -> u64 {
        let at = MemoryRegionAddress(region as u64 * CHANNEL_REGION_BYTES + w * 8);
        self.map.load::<u64>(at, Ordering::Acquire).unwrap_or(0)
    }

    /// Region `region`'s header (see `nl_workloads::channel`).
    pub fn header(&self, region: usize) -> RegionStats {
        use nl_workloads::channel::{W_DELIVERED, W_REJECTED, W_VERDICT};
        let (corrupt, lost, duplicated) =
            nl_workloads::chanstream::unpack(self.word(region, W_VERDICT as u64));
        RegionStats {
            generation: self.word(region, 1),
            head_words: self.word(region, 2),
            ack_generation: self.word(region, 3),
            ack_words: self.word(region, 4),
            received: self.word(region, W_DELIVERED as u64),
            rejected: self.word(region, W_REJECTED as u64),
            corrupt,
            lost,
            duplicated,
        }
    }

    /// Withdraws region `region` (its writer was stopped for a restart), as
    /// `nl_workloads::channel::withdraw` does: generation 0 first (the
    /// peer stops reading it), head 0, the ring zeroed; the
    /// acknowledgement words stay so the restarted writer rejoins the
    /// peer's stream where it left it.
    pub fn withdraw(&self, region: usize) {
        let base = region as u64 * CHANNEL_REGION_BYTES;
        // Both words and the ring lie inside the mapping: these cannot fail.
        let _ = self.map.store(0u64, MemoryRegionAddress(base + 8), Ordering::Release);
        let _ = self.map.store(0u64, MemoryRegionAddress(base + 16), Ordering::Release);
        let header = (nl_workloads::channel::HEADER_WORDS * 8) as u64;
        let zeros = vec![0u8; (CHANNEL_REGION_BYTES - header) as usize];
        let _ = self.map.write_slice(&zeros, MemoryRegionAddress(base + header));
    }

    /// Overwrites `bytes` of region `region`'s ring at `offset` with
    /// `value` (fault injection: a broken driver scribbling over its own
    /// output region).
    pub fn scribble(&self, region: usize, offset: u64, value: &[u8]) {
        let header = (nl_workloads::channel::HEADER_WORDS * 8) as u64;
        let room = CHANNEL_REGION_BYTES - header;
        let at = region as u64 * CHANNEL_REGION_BYTES + header + offset % room;
        let n = (value.len() as u64).min(room - offset % room) as usize;
        let _ = self.map.write_slice(&value[..n], MemoryRegionAddress(at));
    }

    /// Sets region `region`'s published head to `words` (fault injection:
    /// a writer announcing records it never wrote, which the reader must
    /// reject).
    pub fn set_head(&self, region: usize, words: u64) {
        let at = region as u64 * CHANNEL_REGION_BYTES + 16;
        // The word lies inside the mapping: this cannot fail.
        let _ = self.map.store(words, MemoryRegionAddress(at), Ordering::Release);
    }

    /// Has the host check region `region`'s messages byte for byte as
    /// `chanstream`'s (its writer runs `chanstream`); otherwise only their
    /// framing is checked.
    pub fn check_as_stream(&self, region: usize, stream: bool) {
        if let Some(c) = self.checks.get(region) {
            c.lock().unwrap_or_else(|e| e.into_inner()).stream = stream;
        }
    }

    /// Reads on in region `region` and checks what its writer published
    /// since the last call (`nl_workloads::channel_audit`; bounded work).
    pub fn check_region(&self, region: usize) -> Step {
        let Some(c) = self.checks.get(region) else { return Step::default() };
        let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
        let words = Mapped { map: &self.map, base: region as u64 * CHANNEL_REGION_BYTES };
        let mut buf = [0u8; 2 * nl_workloads::chanstream::MSG_BYTES];
        let RegionCheck { audit, stream, finding } = &mut *c;
        let step = if *stream {
            let mut check = StreamCheck { sender: self.ends[region] as u64 };
            audit.step(&words, &mut buf, CHECK_RECORDS, &mut check)
        } else {
            audit.step(&words, &mut buf, CHECK_RECORDS, &mut FramingOnly)
        };
        if finding.is_none() {
            *finding = step.first;
        }
        step
    }

    /// The first bad record the host's check found in region `region`'s
    /// current generation and nobody took yet (the writer's monitor takes
    /// it; findings of an earlier generation are dropped).
    pub fn take_finding(&self, region: usize) -> Option<Finding> {
        let c = self.checks.get(region)?;
        let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
        let current = c.audit.position().0;
        c.finding.take().filter(|f| f.generation == current)
    }

    /// Whether the host's check of region `region` read generation
    /// `generation` from its start to word `pos` and found it all good
    /// (`nl_workloads::channel_audit::Audit::clean_through`).
    pub fn region_clean_through(&self, region: usize, generation: u64, pos: u64) -> Option<bool> {
        let c = self.checks.get(region)?;
        c.lock().unwrap_or_else(|e| e.into_inner()).audit.clean_through(generation, pos)
    }

    /// Overwrites region `region`'s receive verdict (header word 7; fault
    /// injection: a receiver whose own state is corrupt reporting messages
    /// wrong that were not).
    pub fn set_verdict(&self, region: usize, verdict: u64) {
        let at = region as u64 * CHANNEL_REGION_BYTES + nl_workloads::channel::W_VERDICT as u64 * 8;
        // The word lies inside the mapping: this cannot fail.
        let _ = self.map.store(verdict, MemoryRegionAddress(at), Ordering::Release);
    }

    /// The regions' headers.
    pub fn stats(&self, names: &[String]) -> ChannelStats {
        let region = |r: usize| self.header(r);
        let name = |i: usize| names.get(i).cloned().unwrap_or_default();
        ChannelStats {
            name: self.name.clone(),
            between: [name(self.ends[0]), name(self.ends[1])],
            regions: [region(0), region(1)],
        }
    }
}
