//! The replication wire protocol: framed, versioned, checksummed messages.
//!
//! Every frame is a 28-byte header followed by its payload:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `NLRP` |
//! | 4..6 | protocol version |
//! | 6 | kind |
//! | 7 | reserved (0) |
//! | 8..16 | epoch |
//! | 16..20 | sequence number of the frame within its epoch |
//! | 20..24 | payload length |
//! | 24..28 | CRC-32 of bytes 0..24 and the payload |
//!
//! An epoch is `Pages` frames, then `Disk` frames (one sequence: seq 0, 1,
//! ...), closed by one `EpochEnd` holding the frame count, page count, a
//! CRC over all page and disk payloads and the VM state. Epoch 0 is the
//! full copy (all allocated memory and the whole disk).

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

pub const MAGIC: [u8; 4] = *b"NLRP";
/// 2: `Disk` frames (the guest's disk writes) and the disk size in the hello.
pub const PROTOCOL_VERSION: u16 = 2;
pub const HEADER_BYTES: usize = 28;
/// Largest payload accepted (a `Pages` frame is kept far below this).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Pages per `Pages` frame at most.
pub const PAGES_PER_FRAME: usize = 1024;
pub const PAGE: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Pages = 4,
    EpochEnd = 5,
    Ack = 6,
    Heartbeat = 7,
    /// The primary's VM finished; the backup stands down.
    Done = 8,
    /// The backup stopped acknowledging and takes the VM over.
    Takeover = 9,
    /// Disk writes of the epoch (runs of sectors).
    Disk = 10,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Refuse,
            4 => Kind::Pages,
            5 => Kind::EpochEnd,
            6 => Kind::Ack,
            7 => Kind::Heartbeat,
            8 => Kind::Done,
            9 => Kind::Takeover,
            10 => Kind::Disk,
            _ => return None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("no message from the peer in time")]
    Timeout,
    #[error("connection error: {0}")]
    Io(std::io::Error),
    #[error("bad frame: {0}")]
    Bad(String),
    #[error("truncated frame: the connection closed mid-frame")]
    Truncated,
    #[error("protocol version {got} is not supported (this side speaks {PROTOCOL_VERSION})")]
    Version { got: u16 },
}

impl From<std::io::Error> for ProtoError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof => ProtoError::Closed,
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ProtoError::Timeout,
            _ => ProtoError::Io(e),
        }
    }
}

/// One received frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub epoch: u64,
    pub seq: u32,
    pub payload: Vec<u8>,
}

fn header(kind: Kind, epoch: u64, seq: u32, len: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6] = kind as u8;
    h[8..16].copy_from_slice(&epoch.to_le_bytes());
    h[16..20].copy_from_slice(&seq.to_le_bytes());
    h[20..24].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

/// Writes one frame whose payload is the concatenation of `parts` (sent
/// without joining them: page data goes out from where it lies).
pub fn write_frame(
    w: &mut impl Write,
    kind: Kind,
    epoch: u64,
    seq: u32,
    parts: &[&[u8]],
) -> Result<(), ProtoError> {
    let mut pc = crc32fast::Hasher::new();
    for p in parts {
        pc.update(p);
    }
    write_frame_crc(w, kind, epoch, seq, parts, &pc)
}

/// [`write_frame`] with the CRC of the payload already computed (`payload`
/// hashed over exactly `parts`): the data is hashed once, not twice, when
/// the caller also needs its CRC.
pub fn write_frame_crc(
    w: &mut impl Write,
    kind: Kind,
    epoch: u64,
    seq: u32,
    parts: &[&[u8]],
    payload: &crc32fast::Hasher,
) -> Result<(), ProtoError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len > MAX_PAYLOAD {
        return Err(ProtoError::Bad(format!("payload of {len} bytes is too large")));
    }
    let mut h = header(kind, epoch, seq, len);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[..24]);
    crc.combine(payload);
    h[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
    w.write_all(&h)?;
    for p in parts {
        w.write_all(p)?;
    }
    Ok(())
}

/// Reads one frame, checking magic, version, kind, length and checksum.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, ProtoError> {
    let mut payload = Vec::new();
    let (kind, epoch, seq, _) = read_frame_into(r, &mut payload)?;
    Ok(Frame { kind, epoch, seq, payload })
}

/// [`read_frame`] into a caller's buffer (reused: no fresh allocation, so no
/// page faults, per frame). Returns kind, epoch, sequence number and the
/// CRC-32 of the payload alone.
pub fn read_frame_into(
    r: &mut impl Read,
    payload: &mut Vec<u8>,
) -> Result<(Kind, u64, u32, u32), ProtoError> {
    let mut h = [0u8; HEADER_BYTES];
    r.read_exact(&mut h)?;
    if h[0..4] != MAGIC {
        return Err(ProtoError::Bad("not a ninelives replication stream (bad magic)".into()));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(ProtoError::Version { got: version });
    }
    let kind =
        Kind::from_u8(h[6]).ok_or_else(|| ProtoError::Bad(format!("unknown kind {}", h[6])))?;
    let epoch = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let seq = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(h[20..24].try_into().expect("4 bytes")) as usize;
    let want = u32::from_le_bytes(h[24..28].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD {
        return Err(ProtoError::Bad(format!("payload of {len} bytes is too large")));
    }
    payload.clear();
    payload.resize(len, 0);
    r.read_exact(payload).map_err(|e| match ProtoError::from(e) {
        // The header arrived but the payload did not: a truncated frame.
        ProtoError::Closed => ProtoError::Truncated,
        other => other,
    })?;
    let mut pc = crc32fast::Hasher::new();
    pc.update(payload);
    let payload_crc = pc.clone().finalize();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[..24]);
    crc.combine(&pc);
    if crc.finalize() != want {
        return Err(ProtoError::Bad(format!(
            "checksum mismatch in a {kind:?} frame of epoch {epoch}"
        )));
    }
    Ok((kind, epoch, seq, payload_crc))
}

/// What the primary announces at connect.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub protocol: u16,
    pub state_version: u32,
    pub mem_bytes: u64,
    pub vcpus: u32,
    /// Size of the VM's disk in bytes (0: no disk).
    #[serde(default)]
    pub disk_bytes: u64,
    /// The shared secret (compared by the backup; sent in clear: use a
    /// private replication link).
    pub secret: String,
}

/// The close of an epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochEnd {
    pub frames: u32,
    pub pages: u64,
    /// CRC-32 over all `Pages` payloads of the epoch, in order.
    pub data_crc: u32,
    /// The VM's state (nl_vmm::state::VmState bytes).
    pub state: Vec<u8>,
}

impl EpochEnd {
    pub fn encode_head(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.frames.to_le_bytes());
        b[4..12].copy_from_slice(&self.pages.to_le_bytes());
        b[12..16].copy_from_slice(&self.data_crc.to_le_bytes());
        b
    }

    pub fn decode(p: &[u8]) -> Result<Self, ProtoError> {
        if p.len() < 16 {
            return Err(ProtoError::Bad("epoch end shorter than its header".into()));
        }
        Ok(EpochEnd {
            frames: u32::from_le_bytes(p[0..4].try_into().expect("4 bytes")),
            pages: u64::from_le_bytes(p[4..12].try_into().expect("8 bytes")),
            data_crc: u32::from_le_bytes(p[12..16].try_into().expect("4 bytes")),
            state: p[16..].to_vec(),
        })
    }
}

/// One run of contiguous pages in a `Pages` payload: gpa (8 bytes), page
/// count (4 bytes), reserved (4 bytes), then the data.
pub const RUN_HEADER: usize = 16;

pub fn run_header(gpa: u64, pages: u32) -> [u8; RUN_HEADER] {
    let mut b = [0u8; RUN_HEADER];
    b[0..8].copy_from_slice(&gpa.to_le_bytes());
    b[8..12].copy_from_slice(&pages.to_le_bytes());
    b
}

/// The 16-byte header of a page or disk run at `at`: u64, u32, u32.
fn read_run_header(p: &[u8], at: usize) -> Option<(u64, u32, u32)> {
    let h = p.get(at..at.checked_add(RUN_HEADER)?)?;
    Some((
        u64::from_le_bytes(h[0..8].try_into().ok()?),
        u32::from_le_bytes(h[8..12].try_into().ok()?),
        u32::from_le_bytes(h[12..16].try_into().ok()?),
    ))
}

/// Splits a `Pages` payload into its runs `(gpa, data)`, checking bounds.
pub fn parse_runs(p: &[u8]) -> Result<Vec<(u64, &[u8])>, ProtoError> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < p.len() {
        let (gpa, pages, _) = read_run_header(p, at)
            .ok_or_else(|| ProtoError::Bad("page run header cut short".into()))?;
        let pages = pages as usize;
        at += RUN_HEADER;
        let len = pages
            .checked_mul(PAGE)
            .filter(|&l| l > 0 && l <= p.len() - at)
            .ok_or_else(|| ProtoError::Bad(format!("page run at {gpa:#x} has a bad length")))?;
        if gpa % PAGE as u64 != 0 {
            return Err(ProtoError::Bad(format!("page run at {gpa:#x} is not page aligned")));
        }
        out.push((gpa, &p[at..at + len]));
        at += len;
    }
    Ok(out)
}

pub const SECTOR: u64 = 512;
/// One run of a `Disk` payload: first sector (8 bytes), length in bytes (4
/// bytes), flags (4 bytes: bit 0 a flush, with no data), then the data.
pub const DISK_RUN_HEADER: usize = 16;
pub const DISK_FLUSH: u32 = 1;
/// A `Disk` frame is closed once it holds this much data (one guest write
/// is at most 4 MiB, so a frame stays far below `MAX_PAYLOAD`).
pub const DISK_FRAME_BYTES: usize = 4 << 20;

pub fn disk_run_header(sector: u64, len: u32, flags: u32) -> [u8; DISK_RUN_HEADER] {
    let mut b = [0u8; DISK_RUN_HEADER];
    b[0..8].copy_from_slice(&sector.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..16].copy_from_slice(&flags.to_le_bytes());
    b
}

/// One disk write (or flush) of a `Disk` payload.
#[derive(Debug, PartialEq, Eq)]
pub struct DiskRun<'p> {
    pub sector: u64,
    pub flush: bool,
    pub data: &'p [u8],
}

/// Splits a `Disk` payload into its runs, checking that each lies within a
/// disk of `sectors` sectors and is a whole number of sectors.
pub fn parse_disk_runs(p: &[u8], sectors: u64) -> Result<Vec<DiskRun<'_>>, ProtoError> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < p.len() {
        let (sector, len, flags) = read_run_header(p, at)
            .ok_or_else(|| ProtoError::Bad("disk run header cut short".into()))?;
        let len = len as usize;
        at += DISK_RUN_HEADER;
        let flush = flags == DISK_FLUSH;
        if flags > DISK_FLUSH || (flush && len != 0) {
            return Err(ProtoError::Bad(format!("disk run at sector {sector}: bad flags {flags}")));
        }
        if len > p.len() - at || !(len as u64).is_multiple_of(SECTOR) || (!flush && len == 0) {
            return Err(ProtoError::Bad(format!("disk run at sector {sector} has a bad length")));
        }
        if sector.checked_add(len as u64 / SECTOR).is_none_or(|e| e > sectors) {
            return Err(ProtoError::Bad(format!(
                "disk run at sector {sector} (+{len} bytes) is outside the {sectors}-sector disk"
            )));
        }
        out.push(DiskRun { sector, flush, data: &p[at..at + len] });
        at += len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_corruption_is_caught() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Ack, 7, 0, &[b"ab", b"cd"]).unwrap();
        let f = read_frame(&mut &buf[..]).unwrap();
        assert_eq!((f.kind, f.epoch, f.payload.as_slice()), (Kind::Ack, 7, &b"abcd"[..]));
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(read_frame(&mut &bad[..]).is_err(), "flip at byte {i} not caught");
        }
        for cut in 0..buf.len() {
            assert!(read_frame(&mut &buf[..cut]).is_err());
        }
        let mut v2 = buf.clone();
        v2[4] = 9;
        assert!(matches!(read_frame(&mut &v2[..]), Err(ProtoError::Version { got: 9 })));
    }

    #[test]
    fn disk_runs_are_bounds_checked() {
        let mut p = disk_run_header(6, 1024, 0).to_vec();
        p.extend([3u8; 1024]);
        p.extend(disk_run_header(0, 0, DISK_FLUSH));
        let r = parse_disk_runs(&p, 8).unwrap();
        assert_eq!((r[0].sector, r[0].data.len(), r[0].flush), (6, 1024, false));
        assert!(r[1].flush && r[1].data.is_empty());
        assert!(parse_disk_runs(&p, 7).unwrap_err().to_string().contains("outside"));
        assert!(parse_disk_runs(&p[..p.len() - 1], 8).is_err());
        let mut odd = disk_run_header(0, 100, 0).to_vec();
        odd.extend([0u8; 100]);
        assert!(parse_disk_runs(&odd, 8).is_err());
        let mut wrap = disk_run_header(u64::MAX, 512, 0).to_vec();
        wrap.extend([0u8; 512]);
        assert!(parse_disk_runs(&wrap, 8).is_err());
        assert!(parse_disk_runs(&disk_run_header(0, 0, 0), 8).is_err());
        assert!(parse_disk_runs(&disk_run_header(0, 0, 7), 8).is_err());
    }

    #[test]
    fn runs_are_bounds_checked() {
        let mut p = run_header(0x2000, 1).to_vec();
        p.extend([5u8; PAGE]);
        let r = parse_runs(&p).unwrap();
        assert_eq!((r[0].0, r[0].1.len()), (0x2000, PAGE));
        let mut huge = run_header(0, u32::MAX).to_vec();
        huge.extend([0u8; 8]);
        assert!(parse_runs(&huge).is_err());
        assert!(parse_runs(&p[..p.len() - 1]).is_err());
        assert!(parse_runs(&run_header(0x10, 1)).is_err());
        let mut unaligned = run_header(0x10, 1).to_vec();
        unaligned.extend([0u8; PAGE]);
        assert!(parse_runs(&unaligned).is_err());
    }
}
