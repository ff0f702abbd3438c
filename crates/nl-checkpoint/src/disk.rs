//! The complementary disk checkpoint: the committed in-memory checkpoint
//! written to a file at a low rate, and read back to restore a VM.
//!
//! Layout (little endian):
//!
//! ```text
//! "NLCKPT01" or "NLCKPTA1"        magic (A: authenticated, see below)
//! u64 header length, header       JSON DiskHeader
//! u64 state length, state         VmState bytes
//! repeated: u64 gpa, 4096 bytes   every page that is not all zero, ascending
//! u64::MAX                        end of pages
//! u32 CRC-32 of everything above
//! [32 bytes HMAC-SHA256]          "NLCKPTA1" only: over everything above
//! ```
//!
//! A file is written to `PATH.tmp` and renamed into place, so a crash never
//! leaves a half-written checkpoint under the real name; a reader checks the
//! whole file before anything is created from it.
//!
//! **Nothing in a file is trusted.** The CRC only catches accidents: anyone
//! who can write the file can recompute it. So [`read`]
//!
//! * reads at most [`MAX_FILE_BYTES`] from a regular file (a device such as
//!   `/dev/zero`, a FIFO, or a larger file is refused before it is read;
//!   see [`nl_memory::file`]);
//! * checks every header field against the VM state it describes and
//!   refuses a mismatch by name, with both values: `version`, `mem_bytes`,
//!   `vcpus`, `timer_hz`, every `workload` field (and the workload must be
//!   valid, with `duration_ms` at most [`MAX_DURATION_MS`]) and `pages`
//!   (the page records present, ascending, in guest RAM, at most the RAM's
//!   page count). Device states are checked against the restored VM's
//!   devices when it is built: every device must have exactly one state.
//!
//! **Authenticated files.** For checkpoints kept where others can write
//! (shared storage), a key file ([`load_key`]: at least
//! [`MIN_KEY_BYTES`] bytes, not readable or writable by group or others)
//! makes the writer append an HMAC-SHA256 of the whole file under magic
//! `NLCKPTA1`. With a key, [`read`] refuses a file whose MAC does not
//! verify (checked in constant time) and a file without one. Without a
//! key, an authenticated file is refused too ("needs its key"): a user who
//! asked for authentication never gets an unauthenticated restore by
//! forgetting the flag.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use hmac::{Hmac, Mac};
use nl_abi::WorkloadParams;
use nl_memory::GuestMemory;
use nl_vmm::state::VmState;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use vm_memory::{Bytes, GuestAddress};

use crate::{CheckpointError, PAGE};

const MAGIC: &[u8; 8] = b"NLCKPT01";
/// Magic of a file that ends in an HMAC-SHA256 trailer.
const MAGIC_AUTH: &[u8; 8] = b"NLCKPTA1";
const MAC_BYTES: usize = 32;
/// The version of a file of a reference-guest VM (what older binaries read).
pub const DISK_VERSION: u32 = 1;
/// The version of a file whose header names how a Linux VM was booted
/// (`linux`) or the VM's virtio-blk disk (`disk`). Written only then, so
/// any other file stays readable by binaries that know version 1 alone.
pub const DISK_VERSION_LINUX: u32 = 2;

/// Largest header accepted (it is a few hundred bytes of JSON).
pub const MAX_HEADER_BYTES: u64 = 64 << 10;
/// Largest VM state accepted (a few tens of KiB per vCPU as JSON).
pub const MAX_STATE_BYTES: u64 = 64 << 20;
/// Largest checkpoint file read: every page of the largest guest memory,
/// with its address, plus the largest header and state and the framing.
pub const MAX_FILE_BYTES: u64 = nl_abi::MAX_MEM_BYTES / PAGE as u64 * (PAGE as u64 + 8)
    + MAX_HEADER_BYTES
    + MAX_STATE_BYTES
    + 8 * 5
    + 4
    + MAC_BYTES as u64;
/// Longest workload duration a checkpoint may name: one week.
pub const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;
/// Shortest key accepted (the HMAC-SHA256 block is 64 bytes; 32 random
/// bytes are the usual strength).
pub const MIN_KEY_BYTES: usize = 32;
/// Largest key file read.
pub const MAX_KEY_BYTES: u64 = 4096;

type HmacSha256 = Hmac<Sha256>;

/// What a checkpoint file says about the VM it holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskHeader {
    pub version: u32,
    pub mem_bytes: u64,
    pub vcpus: u32,
    pub timer_hz: u64,
    pub workload: WorkloadParams,
    pub pages: u64,
    /// Version 2: the VM is a Linux VM booted this way (its kernel file,
    /// command line, initrd): restored with `Vm::restore_linux`. Absent
    /// from version 1 files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linux: Option<nl_vmm::linux::LinuxRecord>,
    /// Version 2: the VM's virtio-blk disk (its saved state holds the
    /// device's, so the restored VM needs the same device). Absent from
    /// version 1 files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<nl_vmm::config::DiskConfig>,
}

impl DiskHeader {
    /// The file version this header is written with: [`DISK_VERSION_LINUX`]
    /// for a Linux VM or a VM with a disk, [`DISK_VERSION`] otherwise.
    pub fn file_version(&self) -> u32 {
        if self.linux.is_some() || self.disk.is_some() {
            DISK_VERSION_LINUX
        } else {
            DISK_VERSION
        }
    }
}

fn bad(why: impl Into<String>) -> CheckpointError {
    CheckpointError::Config(format!("checkpoint file: {}", why.into()))
}

/// A key for authenticated checkpoint files (see the module docs).
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({} bytes)", self.0.len())
    }
}

impl Key {
    /// A key from bytes (at least [`MIN_KEY_BYTES`]).
    pub fn from_bytes(b: &[u8]) -> Result<Self, CheckpointError> {
        if b.len() < MIN_KEY_BYTES {
            return Err(CheckpointError::Config(format!(
                "a checkpoint key must be at least {MIN_KEY_BYTES} bytes (got {})",
                b.len()
            )));
        }
        Ok(Self(b.to_vec()))
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length")
    }
}

/// Loads a key file: a regular file of [`MIN_KEY_BYTES`] to
/// [`MAX_KEY_BYTES`] bytes (all of them are the key), not readable or
/// writable by group or others.
pub fn load_key(path: &Path) -> Result<Key, CheckpointError> {
    let b = nl_memory::file::read_secret(path, "key file", MIN_KEY_BYTES as u64, MAX_KEY_BYTES)
        .map_err(|e| CheckpointError::Config(e.to_string()))?;
    Key::from_bytes(&b)
        .map_err(|e| CheckpointError::Config(format!("key file {}: {e}", path.display())))
}

/// A checkpoint captured in memory, ready to be written out.
pub struct DiskImage {
    header: DiskHeader,
    state: Vec<u8>,
    pages: Vec<(u64, Box<[u8; PAGE]>)>,
}

/// Captures a checkpoint: `state`, and memory as `mem` with `overlay` pages
/// (gpa -> content) substituted. Only allocated, non-zero pages are kept.
/// Done with the VM paused; the write itself can then run in the background.
pub fn capture(
    header: &DiskHeader,
    state: &VmState,
    mem: &GuestMemory,
    overlay: &dyn Fn(u64) -> Option<[u8; PAGE]>,
) -> Result<DiskImage, CheckpointError> {
    let mut pages = Vec::new();
    let mut buf = [0u8; PAGE];
    for (start, end) in mem.allocated_ranges()? {
        for gpa in (start & !(PAGE as u64 - 1)..end).step_by(PAGE) {
            let page = match overlay(gpa) {
                Some(p) => p,
                None => {
                    mem.mem()
                        .read_slice(&mut buf, GuestAddress(gpa))
                        .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })?;
                    buf
                }
            };
            if page.iter().any(|&b| b != 0) {
                pages.push((gpa, Box::new(page)));
            }
        }
    }
    Ok(DiskImage { header: header.clone(), state: state.to_bytes(), pages })
}

impl DiskImage {
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Writes the image to `path` (via `PATH.tmp`, fsync, rename), with an
    /// HMAC-SHA256 trailer when a `key` is given. Returns the bytes written.
    pub fn write(&self, path: &Path, key: Option<&Key>) -> Result<u64, CheckpointError> {
        let tmp = path.with_extension("tmp");
        let io = |e: std::io::Error| bad(format!("{}: {e}", tmp.display()));
        let mut crc = crc32fast::Hasher::new();
        let mut mac = key.map(Key::mac);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(io)?);
        let mut put = |b: &[u8], out: &mut BufWriter<File>| -> Result<(), CheckpointError> {
            crc.update(b);
            if let Some(m) = mac.as_mut() {
                m.update(b);
            }
            out.write_all(b).map_err(io)
        };
        put(if key.is_some() { MAGIC_AUTH } else { MAGIC }, &mut out)?;
        let h = DiskHeader {
            pages: self.pages.len() as u64,
            version: self.header.file_version(),
            ..self.header.clone()
        };
        let hj = serde_json::to_vec(&h).map_err(|e| bad(e.to_string()))?;
        put(&(hj.len() as u64).to_le_bytes(), &mut out)?;
        put(&hj, &mut out)?;
        put(&(self.state.len() as u64).to_le_bytes(), &mut out)?;
        put(&self.state, &mut out)?;
        for (gpa, page) in &self.pages {
            put(&gpa.to_le_bytes(), &mut out)?;
            put(&page[..], &mut out)?;
        }
        put(&u64::MAX.to_le_bytes(), &mut out)?;
        let sum = crc.finalize().to_le_bytes();
        out.write_all(&sum).map_err(io)?;
        if let Some(mut m) = mac {
            m.update(&sum);
            out.write_all(&m.finalize().into_bytes()).map_err(io)?;
        }
        let f = out.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        std::fs::rename(&tmp, path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        Ok(len)
    }
}

/// A checkpoint file read and checked in full.
pub struct DiskCheckpoint {
    pub header: DiskHeader,
    pub state: VmState,
    pub pages: Vec<(u64, Box<[u8; PAGE]>)>,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| bad("truncated"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

/// Reads and validates a checkpoint file: size and kind, magic, MAC (with a
/// `key`), checksum, version, every header field against the state, and that
/// every page lies in guest RAM. Nothing is created here.
pub fn read(path: &Path, key: Option<&Key>) -> Result<DiskCheckpoint, CheckpointError> {
    let b = nl_memory::file::read_limited(path, "checkpoint file", MAX_FILE_BYTES)
        .map_err(|e| CheckpointError::Config(e.to_string()))?;
    parse(&b, &path.display().to_string(), key)
}

/// [`read`] for a checkpoint file's bytes already in memory (at most
/// [`MAX_FILE_BYTES`]; a fuzzer's input, say); `name` stands for its path
/// in errors.
pub fn parse(b: &[u8], name: &str, key: Option<&Key>) -> Result<DiskCheckpoint, CheckpointError> {
    if b.len() < MAGIC.len() + 4 || (&b[..8] != MAGIC && &b[..8] != MAGIC_AUTH) {
        return Err(bad(format!("{name} is not a ninelives checkpoint")));
    }
    let b = match (&b[..8] == MAGIC_AUTH, key) {
        (true, None) => {
            return Err(bad(format!(
                "{name} is authenticated (HMAC-SHA256) and needs its key: give --key-file"
            )))
        }
        (false, Some(_)) => {
            return Err(bad(format!(
                "{name} is not authenticated, but a key was given: refusing an unauthenticated file"
            )))
        }
        (false, None) => b,
        (true, Some(k)) => {
            if b.len() < MAGIC.len() + 4 + MAC_BYTES {
                return Err(bad(format!("{name} is truncated (no room for its MAC)")));
            }
            let (signed, tag) = b.split_at(b.len() - MAC_BYTES);
            let mut m = k.mac();
            m.update(signed);
            // verify_slice compares in constant time.
            m.verify_slice(tag).map_err(|_| {
                bad(format!(
                    "{name} failed authentication (HMAC-SHA256): it was changed, or the key is wrong"
                ))
            })?;
            signed
        }
    };
    let (body, sum) = b.split_at(b.len() - 4);
    let want = u32::from_le_bytes(sum.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != want {
        return Err(bad(format!("{name} is corrupt or truncated (checksum mismatch)")));
    }
    let mut r = Reader { b: body, at: 8 };
    let hl = r.u64()?;
    if hl > MAX_HEADER_BYTES {
        return Err(bad(format!("header of {hl} bytes is over the limit of {MAX_HEADER_BYTES}")));
    }
    let header: DiskHeader = serde_json::from_slice(r.take(hl as usize)?)
        .map_err(|e| bad(format!("bad header: {e}")))?;
    if header.version != DISK_VERSION && header.version != DISK_VERSION_LINUX {
        return Err(bad(format!(
            "version {} is not supported (this binary reads versions {DISK_VERSION} and \
             {DISK_VERSION_LINUX})",
            header.version
        )));
    }
    if header.version != header.file_version() {
        return Err(bad(format!(
            "version {} with{} a \"linux\" or \"disk\" field: such a file is version \
             {DISK_VERSION_LINUX}, any other version {DISK_VERSION}",
            header.version,
            if header.version == DISK_VERSION { "" } else { "out" }
        )));
    }
    let sl = r.u64()?;
    if sl > MAX_STATE_BYTES {
        return Err(bad(format!("VM state of {sl} bytes is over the limit of {MAX_STATE_BYTES}")));
    }
    let state = VmState::from_bytes(r.take(sl as usize)?).map_err(|e| bad(e.to_string()))?;
    check_header(&header, &state)?;
    let layout = nl_memory::layout(header.mem_bytes);
    let mut pages = Vec::new();
    let mut last: Option<u64> = None;
    loop {
        let gpa = r.u64()?;
        if gpa == u64::MAX {
            break;
        }
        if gpa % PAGE as u64 != 0 || !layout.iter().any(|l| gpa >= l.gpa && gpa < l.gpa + l.size) {
            return Err(bad(format!("page at {gpa:#x} is not in guest RAM")));
        }
        if last.is_some_and(|l| gpa <= l) {
            return Err(bad(format!("page at {gpa:#x} repeats or is out of order")));
        }
        if pages.len() as u64 >= header.pages {
            return Err(bad(format!(
                "header field pages is {} but the file holds more page records",
                header.pages
            )));
        }
        last = Some(gpa);
        let mut p = Box::new([0u8; PAGE]);
        p.copy_from_slice(r.take(PAGE)?);
        pages.push((gpa, p));
    }
    if pages.len() as u64 != header.pages {
        return Err(bad(format!(
            "header field pages is {} but the file holds {} page records",
            header.pages,
            pages.len()
        )));
    }
    if r.at != body.len() {
        return Err(bad(format!("{} bytes follow the end of the pages", body.len() - r.at)));
    }
    Ok(DiskCheckpoint { header, state, pages })
}

/// Every header field against the state it describes (and its own bounds).
/// A mismatch is refused by the field's name, with both values.
pub fn check_header(h: &DiskHeader, s: &VmState) -> Result<(), CheckpointError> {
    let field = |f: &str, hv: &dyn std::fmt::Display, sv: &dyn std::fmt::Display| {
        Err(bad(format!("header field {f} is {hv} but the VM state says {sv}")))
    };
    if h.mem_bytes != s.mem_bytes {
        return field("mem_bytes", &h.mem_bytes, &s.mem_bytes);
    }
    GuestMemory::check_size(h.mem_bytes)
        .map_err(|e| bad(format!("header field mem_bytes: {e}")))?;
    if h.vcpus != s.num_vcpus {
        return field("vcpus", &h.vcpus, &s.num_vcpus);
    }
    if h.vcpus as usize != s.vcpus.len() {
        return field("vcpus", &h.vcpus, &format!("{} vCPU states", s.vcpus.len()));
    }
    if h.vcpus == 0 || h.vcpus > nl_abi::MAX_VCPUS {
        return Err(bad(format!(
            "header field vcpus is {}: between 1 and {} are supported",
            h.vcpus,
            nl_abi::MAX_VCPUS
        )));
    }
    if h.timer_hz != s.timer_hz {
        return field("timer_hz", &h.timer_hz, &s.timer_hz);
    }
    if !(10..=10_000).contains(&h.timer_hz) {
        return Err(bad(format!(
            "header field timer_hz is {}: out of range 10..=10000",
            h.timer_hz
        )));
    }
    if h.workload != s.workload {
        // Name the first workload field that differs.
        let (a, b) = (serde_json::to_value(h.workload), serde_json::to_value(s.workload));
        let diff = match (a, b) {
            (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) => {
                a.iter().find(|(k, v)| b.get(*k) != Some(*v)).map(|(k, v)| {
                    (k.clone(), v.to_string(), b.get(k).map_or("none".into(), |x| x.to_string()))
                })
            }
            _ => None,
        };
        let (k, hv, sv) = diff.unwrap_or_else(|| ("?".into(), "?".into(), "?".into()));
        return field(&format!("workload.{k}"), &hv, &sv);
    }
    if h.workload.duration_ms > MAX_DURATION_MS {
        return Err(bad(format!(
            "header field workload.duration_ms is {}: the limit is {MAX_DURATION_MS} (one week)",
            h.workload.duration_ms
        )));
    }
    nl_workloads::validate(&h.workload)
        .map_err(|e| bad(format!("header field workload is invalid: {e}")))?;
    let ram_pages = h.mem_bytes / PAGE as u64;
    if h.pages > ram_pages {
        return Err(bad(format!(
            "header field pages is {} but {} bytes of memory hold only {ram_pages} pages",
            h.pages, h.mem_bytes
        )));
    }
    for (bus, devs) in [("I/O", &s.io_devices), ("MMIO", &s.mmio_devices)] {
        let mut seen = std::collections::BTreeSet::new();
        for d in devs.iter() {
            if !seen.insert(d.base) {
                return Err(bad(format!(
                    "the VM state holds two {bus} device states at {:#x} ({})",
                    d.base, d.name
                )));
            }
        }
    }
    Ok(())
}

impl DiskCheckpoint {
    /// Fresh guest memory holding the checkpoint's pages.
    pub fn memory(&self, name: &str) -> Result<GuestMemory, CheckpointError> {
        let m = GuestMemory::new(name, self.header.mem_bytes)?;
        for (gpa, p) in &self.pages {
            m.mem()
                .write_slice(&p[..], GuestAddress(*gpa))
                .map_err(|e| CheckpointError::GuestMemory { gpa: *gpa, why: e.to_string() })?;
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nl_vmm::state::{IrqchipState, VcpuState};

    fn state() -> VmState {
        let vcpu = || VcpuState {
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            msrs: Vec::new(),
            lapic: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
        };
        VmState {
            version: nl_vmm::state::STATE_VERSION,
            mem_bytes: 256 << 20,
            num_vcpus: 1,
            timer_hz: 100,
            workload: WorkloadParams {
                kind: nl_abi::WORKLOAD_COMPUTE,
                duration_ms: 1000,
                ..Default::default()
            },
            vcpus: vec![vcpu()],
            irqchip: IrqchipState { chips: Vec::new(), clock: None, pit: None },
            io_devices: Vec::new(),
            mmio_devices: Vec::new(),
        }
    }

    fn header(s: &VmState) -> DiskHeader {
        DiskHeader {
            version: DISK_VERSION,
            mem_bytes: s.mem_bytes,
            vcpus: s.num_vcpus,
            timer_hz: s.timer_hz,
            workload: s.workload,
            pages: 10,
            linux: None,
            disk: None,
        }
    }

    #[test]
    fn every_header_field_is_checked_against_the_state_by_name() {
        let s = state();
        check_header(&header(&s), &s).unwrap();
        type Edit = fn(&mut DiskHeader, &mut VmState);
        let cases: [(Edit, &str); 9] = [
            (
                |h, _| h.mem_bytes = 512 << 20,
                "header field mem_bytes is 536870912 but the VM state says 268435456",
            ),
            (|h, _| h.vcpus = 2, "header field vcpus is 2 but the VM state says 1"),
            (|_, s| s.vcpus.clear(), "header field vcpus is 1 but the VM state says 0 vCPU states"),
            (|h, _| h.timer_hz = 250, "header field timer_hz is 250 but the VM state says 100"),
            (|h, s| (h.timer_hz, s.timer_hz) = (5, 5), "header field timer_hz is 5: out of range"),
            (|h, _| h.workload.seed = 9, "header field workload.seed is 9 but the VM state says 0"),
            (
                |h, s| (h.workload.duration_ms, s.workload.duration_ms) = (u64::MAX, u64::MAX),
                "header field workload.duration_ms is 18446744073709551615: the limit is",
            ),
            (
                |h, s| (h.workload.kind, s.workload.kind) = (99, 99),
                "header field workload is invalid",
            ),
            (|h, _| h.pages = (256 << 20) / 4096 + 1, "header field pages is 65537 but"),
        ];
        for (edit, want) in cases {
            let mut s = state();
            let mut h = header(&s);
            edit(&mut h, &mut s);
            let e = check_header(&h, &s).unwrap_err().to_string();
            assert!(e.contains(want), "expected '{want}' in: {e}");
        }
    }

    #[test]
    fn the_bounds_of_vcpus_and_duration_are_inclusive() {
        let mut s = state();
        s.vcpus.clear();
        s.num_vcpus = 0;
        let h = DiskHeader { vcpus: 0, ..header(&s) };
        let e = check_header(&h, &s).unwrap_err().to_string();
        assert!(e.contains("header field vcpus is 0: between 1 and"), "{e}");
        let mut s = state();
        s.vcpus = (0..nl_abi::MAX_VCPUS).map(|_| state().vcpus.remove(0)).collect();
        s.num_vcpus = nl_abi::MAX_VCPUS;
        s.workload.duration_ms = MAX_DURATION_MS;
        check_header(&header(&s), &s).unwrap();
        s.workload.duration_ms = MAX_DURATION_MS + 1;
        let e = check_header(&header(&s), &s).unwrap_err().to_string();
        assert!(e.contains("workload.duration_ms is 604800001: the limit is"), "{e}");
    }

    #[test]
    fn short_keys_are_refused() {
        let e = Key::from_bytes(&[1; 31]).unwrap_err().to_string();
        assert!(e.contains("at least 32 bytes (got 31)"), "{e}");
        assert!(Key::from_bytes(&[1; 32]).is_ok());
        assert_eq!(format!("{:?}", Key::from_bytes(&[7; 40]).unwrap()), "Key(40 bytes)");
    }

    // ---- The file format: round trip, and every refusal by its message ----

    fn page(fill: u8) -> [u8; PAGE] {
        let mut p = [fill; PAGE];
        p[0] = 0x5a; // never all zero, and not uniform
        p[PAGE - 1] = fill.wrapping_add(1);
        p
    }

    /// A 256 MiB guest memory with two written pages and one written with
    /// zeros (allocated, but all zero: not kept).
    fn memory() -> GuestMemory {
        let m = GuestMemory::new("disk-test", 256 << 20).unwrap();
        m.mem().write_slice(&page(1), GuestAddress(0x1000)).unwrap();
        m.mem().write_slice(&[0u8; PAGE], GuestAddress(0x2000)).unwrap();
        m.mem().write_slice(&page(3), GuestAddress(0x30_0000)).unwrap();
        m
    }

    fn written(key: Option<&Key>) -> (tempfile::TempDir, std::path::PathBuf, DiskImage) {
        let s = state();
        let m = memory();
        // The overlay stands in for the page at 0x30_0000 (the committed
        // checkpoint's copy of a page written since).
        let overlay = |gpa: u64| (gpa == 0x30_0000).then(|| page(9));
        let img = capture(&header(&s), &s, &m, &overlay).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt");
        let len = img.write(&path, key).unwrap();
        assert_eq!(len, std::fs::metadata(&path).unwrap().len());
        assert!(!path.with_extension("tmp").exists(), "the temporary file was renamed");
        (dir, path, img)
    }

    fn check_contents(c: &DiskCheckpoint) {
        let s = state();
        assert_eq!(c.header.version, DISK_VERSION);
        assert_eq!(c.header.mem_bytes, s.mem_bytes);
        assert_eq!(c.header.vcpus, s.num_vcpus);
        assert_eq!(c.header.timer_hz, s.timer_hz);
        assert_eq!(c.header.workload, s.workload);
        assert_eq!(c.header.pages, 2, "the zero page is not kept, the others are");
        assert_eq!(c.state.to_bytes(), s.to_bytes());
        let got: Vec<(u64, [u8; PAGE])> = c.pages.iter().map(|(g, p)| (*g, **p)).collect();
        assert_eq!(got, vec![(0x1000, page(1)), (0x30_0000, page(9))], "pages, overlay applied");
        let m = c.memory("disk-test-restored").unwrap();
        let mut buf = [0u8; PAGE];
        for (gpa, want) in [(0x1000, page(1)), (0x2000, [0; PAGE]), (0x30_0000, page(9))] {
            m.mem().read_slice(&mut buf, GuestAddress(gpa)).unwrap();
            assert!(buf == want, "restored memory at {gpa:#x}");
        }
    }

    /// A Linux VM's file (version 2) says how the kernel was booted; a
    /// reference-guest file stays version 1 (readable by older binaries),
    /// and a version 1 header (no `linux`) still reads.
    #[test]
    fn a_linux_vm_file_is_version_2_and_names_its_boot() {
        let s = state();
        let linux = nl_vmm::linux::LinuxRecord {
            kernel: Some("/boot/vmlinuz".into()),
            cmdline: "console=ttyS0 quiet".into(),
            initrd: None,
            system_map: None,
            time_limit_ms: None,
            started_unix_ms: None,
        };
        let disk = nl_vmm::config::DiskConfig { path: "/d/root.img".into(), readonly: false };
        let h = DiskHeader { linux: Some(linux.clone()), disk: Some(disk.clone()), ..header(&s) };
        let img = capture(&h, &s, &memory(), &|_| None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("linux.ckpt");
        img.write(&path, None).unwrap();
        let c = read(&path, None).unwrap();
        assert_eq!(c.header.version, DISK_VERSION_LINUX);
        assert_eq!(c.header.linux, Some(linux));
        assert_eq!(c.header.disk, Some(disk));
        let (_dir, path, _) = written(None);
        let c = read(&path, None).unwrap();
        assert_eq!((c.header.version, c.header.linux), (DISK_VERSION, None));
        // A version 1 header as older binaries wrote it: no "linux" key.
        let text = serde_json::to_string(&header(&s)).unwrap();
        assert!(!text.contains("linux"), "{text}");
    }

    #[test]
    fn a_written_checkpoint_reads_back_page_for_page() {
        let (_dir, path, img) = written(None);
        assert_eq!(img.pages(), 2);
        let b = std::fs::read(&path).unwrap();
        assert_eq!(&b[..8], MAGIC);
        check_contents(&read(&path, None).unwrap());
    }

    #[test]
    fn an_authenticated_checkpoint_reads_back_only_with_its_key() {
        let key = Key::from_bytes(&[7; 32]).unwrap();
        let (_dir, path, _) = written(Some(&key));
        let b = std::fs::read(&path).unwrap();
        assert_eq!(&b[..8], MAGIC_AUTH);
        check_contents(&read(&path, Some(&key)).unwrap());
        let err = |k: Option<&Key>, b: &[u8]| parse(b, "f", k).err().unwrap().to_string();
        let other = Key::from_bytes(&[8; 32]).unwrap();
        assert!(err(Some(&other), &b).contains("f failed authentication (HMAC-SHA256)"));
        assert!(err(None, &b).contains("f is authenticated (HMAC-SHA256) and needs its key"));
        let mut changed = b.clone();
        changed[100] ^= 1;
        assert!(err(Some(&key), &changed).contains("failed authentication"));
        assert!(err(Some(&key), &b[..20]).contains("f is truncated (no room for its MAC)"));
        assert!(err(Some(&key), &b[..43]).contains("f is truncated (no room for its MAC)"));
        // Room for magic, CRC and MAC (44 bytes) is enough to be checked.
        assert!(err(Some(&key), &b[..44]).contains("f failed authentication"));
        // An unauthenticated file is refused when a key is given.
        let (_d2, plain, _) = written(None);
        let e = read(&plain, Some(&key)).err().unwrap().to_string();
        assert!(e.contains("is not authenticated, but a key was given"), "{e}");
    }

    #[test]
    fn truncated_or_corrupt_files_are_refused() {
        let (_dir, path, _) = written(None);
        let b = std::fs::read(&path).unwrap();
        let err = |b: &[u8]| parse(b, "f", None).err().unwrap().to_string();
        for cut in [1, 4, PAGE, b.len() - 12] {
            let e = err(&b[..b.len() - cut]);
            assert!(e.contains("f is corrupt or truncated (checksum mismatch)"), "cut {cut}: {e}");
        }
        for at in [9, 40, b.len() / 2, b.len() - 5] {
            let mut c = b.clone();
            c[at] ^= 0x10;
            let e = err(&c);
            assert!(e.contains("f is corrupt or truncated (checksum mismatch)"), "at {at}: {e}");
        }
        assert!(err(&b[..11]).contains("f is not a ninelives checkpoint"));
        let mut c = b.clone();
        c[..8].copy_from_slice(b"NLCKPT02");
        assert!(err(&c).contains("f is not a ninelives checkpoint"));
        assert!(err(&[]).contains("not a ninelives checkpoint"));
    }

    /// A file built by hand from its parts, with a correct checksum: what
    /// someone who can write the file (and recompute the CRC) can make.
    fn assemble(header: &[u8], state: &[u8], records: &[(u64, &[u8])], tail: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend((header.len() as u64).to_le_bytes());
        b.extend(header);
        b.extend((state.len() as u64).to_le_bytes());
        b.extend(state);
        for (gpa, p) in records {
            b.extend(gpa.to_le_bytes());
            b.extend(*p);
        }
        b.extend(tail);
        let sum = crc32fast::hash(&b);
        b.extend(sum.to_le_bytes());
        b
    }

    #[test]
    fn files_with_a_good_checksum_but_bad_contents_are_refused_by_name() {
        let s = state();
        let sb = s.to_bytes();
        let hj = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut h = serde_json::to_value(DiskHeader { pages: 2, ..header(&s) }).unwrap();
            edit(&mut h);
            serde_json::to_vec(&h).unwrap()
        };
        let good = hj(&|_| {});
        let linux = serde_json::json!({"kernel": "/k/vmlinuz", "cmdline": "quiet", "initrd": null});
        let (p1, p2) = (page(1), page(2));
        let end = u64::MAX.to_le_bytes();
        let two: [(u64, &[u8]); 2] = [(0x1000, &p1), (0x3000, &p2)];
        // The assembled good file is accepted: the cases below fail for
        // the reason they name.
        let c = parse(&assemble(&good, &sb, &two, &end), "f", None).unwrap();
        assert_eq!(c.pages.len(), 2);
        let huge_header = {
            let mut b = MAGIC.to_vec();
            b.extend((MAX_HEADER_BYTES + 1).to_le_bytes());
            b.extend([0u8; 64]);
            let sum = crc32fast::hash(&b);
            b.extend(sum.to_le_bytes());
            b
        };
        let huge_state = {
            let mut b = MAGIC.to_vec();
            b.extend((good.len() as u64).to_le_bytes());
            b.extend(&good);
            b.extend((MAX_STATE_BYTES + 1).to_le_bytes());
            let sum = crc32fast::hash(&b);
            b.extend(sum.to_le_bytes());
            b
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                assemble(&hj(&|h| h["version"] = 3.into()), &sb, &two, &end),
                "checkpoint file: version 3 is not supported (this binary reads versions 1 and 2)",
            ),
            (
                assemble(&hj(&|h| h["version"] = 2.into()), &sb, &two, &end),
                "checkpoint file: version 2 without a \"linux\" or \"disk\" field",
            ),
            (
                assemble(&hj(&|h| h["linux"] = linux.clone()), &sb, &two, &end),
                "checkpoint file: version 1 with a \"linux\" or \"disk\" field",
            ),
            (
                assemble(&hj(&|h| h["extra"] = 1.into()), &sb, &two, &end),
                "checkpoint file: bad header: unknown field `extra`",
            ),
            (assemble(b"{", &sb, &two, &end), "checkpoint file: bad header"),
            (huge_header, "header of 65537 bytes is over the limit of 65536"),
            (huge_state, "VM state of 67108865 bytes is over the limit of 67108864"),
            (
                assemble(&good, b"{}", &two, &end),
                "checkpoint file: ", // the state's own parse error
            ),
            (
                assemble(&hj(&|h| h["vcpus"] = 2.into()), &sb, &two, &end),
                "header field vcpus is 2 but the VM state says 1",
            ),
            (
                assemble(&good, &sb, &[(0x1001, &p1), (0x3000, &p2)], &end),
                "page at 0x1001 is not in guest RAM",
            ),
            (
                assemble(&good, &sb, &[(0x1000, &p1), (256 << 20, &p2)], &end),
                "page at 0x10000000 is not in guest RAM",
            ),
            (
                assemble(&good, &sb, &[(0x3000, &p1), (0x1000, &p2)], &end),
                "page at 0x1000 repeats or is out of order",
            ),
            (
                assemble(&good, &sb, &[(0x1000, &p1), (0x1000, &p2)], &end),
                "page at 0x1000 repeats or is out of order",
            ),
            (
                assemble(&hj(&|h| h["pages"] = 1.into()), &sb, &two, &end),
                "header field pages is 1 but the file holds more page records",
            ),
            (
                assemble(&hj(&|h| h["pages"] = 3.into()), &sb, &two, &end),
                "header field pages is 3 but the file holds 2 page records",
            ),
            (assemble(&good, &sb, &two, &[]), "checkpoint file: truncated"),
            (assemble(&good, &sb, &[(0x1000, &p1[..100])], &[]), "checkpoint file: truncated"),
            (
                assemble(&good, &sb, &two, &[end.as_slice(), &[0; 8]].concat()),
                "checkpoint file: 8 bytes follow the end of the pages",
            ),
        ];
        for (i, (b, want)) in cases.iter().enumerate() {
            match parse(b, "f", None) {
                Ok(_) => panic!("case {i} ({want}) was accepted"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains(want), "case {i}: expected '{want}' in: {e}");
                }
            }
        }
    }

    #[test]
    fn devices_and_files_that_are_not_checkpoints_are_refused_before_reading() {
        let e = read(Path::new("/dev/zero"), None).err().unwrap().to_string();
        assert!(e.contains("/dev/zero"), "{e}");
        let e = read(Path::new("/nonexistent/ckpt"), None).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/ckpt"), "{e}");
    }
}
