//! The complementary disk checkpoint: the committed in-memory checkpoint
//! written to a file at a low rate, and read back to restore a VM.
//!
//! Layout (little endian):
//!
//! ```text
//! "NLCKPT01"                      magic
//! u64 header length, header       JSON DiskHeader
//! u64 state length, state         VmState bytes
//! repeated: u64 gpa, 4096 bytes   every page that is not all zero
//! u64::MAX                        end of pages
//! u32 CRC-32 of everything above
//! ```
//!
//! A file is written to `PATH.tmp` and renamed into place, so a crash never
//! leaves a half-written checkpoint under the real name; a reader checks the
//! whole file before anything is created from it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use nl_abi::WorkloadParams;
use nl_memory::GuestMemory;
use nl_vmm::state::VmState;
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use crate::{CheckpointError, PAGE};

const MAGIC: &[u8; 8] = b"NLCKPT01";
pub const DISK_VERSION: u32 = 1;

/// What a checkpoint file says about the VM it holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DiskHeader {
    pub version: u32,
    pub mem_bytes: u64,
    pub vcpus: u32,
    pub timer_hz: u64,
    pub workload: WorkloadParams,
    pub pages: u64,
}

fn bad(why: impl Into<String>) -> CheckpointError {
    CheckpointError::Config(format!("checkpoint file: {}", why.into()))
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

    /// Writes the image to `path` (via `PATH.tmp`, fsync, rename). Returns the bytes written.
    pub fn write(&self, path: &Path) -> Result<u64, CheckpointError> {
        let tmp = path.with_extension("tmp");
        let io = |e: std::io::Error| bad(format!("{}: {e}", tmp.display()));
        let mut crc = crc32fast::Hasher::new();
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(io)?);
        let mut put = |b: &[u8], out: &mut BufWriter<File>| -> Result<(), CheckpointError> {
            crc.update(b);
            out.write_all(b).map_err(io)
        };
        put(MAGIC, &mut out)?;
        let h = DiskHeader { pages: self.pages.len() as u64, ..self.header.clone() };
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
        let sum = crc.finalize();
        out.write_all(&sum.to_le_bytes()).map_err(io)?;
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

/// Reads and validates a checkpoint file: magic, checksum, version, header,
/// state, and that every page lies in guest RAM. Nothing is created here.
pub fn read(path: &Path) -> Result<DiskCheckpoint, CheckpointError> {
    let b = std::fs::read(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    if b.len() < MAGIC.len() + 4 || &b[..8] != MAGIC {
        return Err(bad(format!("{} is not a ninelives checkpoint", path.display())));
    }
    let (body, sum) = b.split_at(b.len() - 4);
    let want = u32::from_le_bytes(sum.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != want {
        return Err(bad(format!("{} is corrupt or truncated (checksum mismatch)", path.display())));
    }
    let mut r = Reader { b: body, at: 8 };
    let hl = r.u64()? as usize;
    let header: DiskHeader =
        serde_json::from_slice(r.take(hl)?).map_err(|e| bad(format!("bad header: {e}")))?;
    if header.version != DISK_VERSION {
        return Err(bad(format!(
            "version {} is not supported (this binary reads version {DISK_VERSION})",
            header.version
        )));
    }
    GuestMemory::check_size(header.mem_bytes).map_err(|e| bad(e.to_string()))?;
    let sl = r.u64()? as usize;
    let state = VmState::from_bytes(r.take(sl)?).map_err(|e| bad(e.to_string()))?;
    if state.mem_bytes != header.mem_bytes || state.num_vcpus != header.vcpus {
        return Err(bad("state and header disagree on the VM's shape"));
    }
    let layout = nl_memory::layout(header.mem_bytes);
    let mut pages = Vec::new();
    loop {
        let gpa = r.u64()?;
        if gpa == u64::MAX {
            break;
        }
        if gpa % PAGE as u64 != 0 || !layout.iter().any(|l| gpa >= l.gpa && gpa < l.gpa + l.size) {
            return Err(bad(format!("page at {gpa:#x} is not in guest RAM")));
        }
        let mut p = Box::new([0u8; PAGE]);
        p.copy_from_slice(r.take(PAGE)?);
        pages.push((gpa, p));
    }
    if r.at != body.len() || pages.len() as u64 != header.pages {
        return Err(bad("page count does not match the header"));
    }
    Ok(DiskCheckpoint { header, state, pages })
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
