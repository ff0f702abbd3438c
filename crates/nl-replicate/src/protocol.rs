//! The replication wire protocol: framed, versioned, authenticated messages.
//!
//! Every frame starts with a 28-byte header, followed by its payload:
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
//! The handshake ([`crate::auth`]: `Hello`, `Challenge`, `Auth`, `Welcome`,
//! or a `Refuse`) is made of *plain* frames: header and payload only, at
//! most [`HANDSHAKE_MAX`] bytes of payload. Every frame after it is *sealed*:
//! the payload is followed by a 16-byte tag,
//!
//! ```text
//! tag = HMAC-SHA256(session key, direction || counter || header || payload)[..16]
//! ```
//!
//! where `direction` is one byte (1: primary to backup, 2: backup to
//! primary) and `counter` the frame's number in its direction (u64 little
//! endian, 0 for the first frame after the handshake). The counter is not on
//! the wire: each side counts the frames it sent and received, so a frame
//! replayed, dropped, reordered, reflected back to its sender, or taken from
//! another session (another session key) fails its tag, and the connection
//! is dropped ([`ProtoError::Auth`]). The tag is compared in constant time.
//! The CRC stays (it is cheap, and says "corrupted" rather than "forged"
//! for a plain frame); the tag supersedes it.
//!
//! An epoch is `Pages` frames, then `Disk` frames (one sequence: seq 0, 1,
//! ...), closed by one `EpochEnd` holding the frame count, page count, a
//! CRC over all page and disk payloads and the VM state. Epoch 0 is the
//! full copy (all allocated memory and the whole disk).

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub const MAGIC: [u8; 4] = *b"NLRP";
/// 2: `Disk` frames (the guest's disk writes) and the disk size in the hello.
/// 3: challenge-response handshake under a pre-shared key, sealed frames.
/// 4: the hello carries a Linux VM's boot record ([`Hello::linux`]); plain
///    frames up to 16 KiB (its command line and file names).
pub const PROTOCOL_VERSION: u16 = 4;
pub const HEADER_BYTES: usize = 28;
/// Bytes of the tag after a sealed frame's payload.
pub const TAG_BYTES: usize = 16;
/// Largest payload of a plain (handshake) frame: a hello with a Linux
/// record of the longest command line and file names
/// ([`nl_vmm::linux::LinuxRecord::validate`]) fits.
pub const HANDSHAKE_MAX: usize = 16 << 10;
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
    /// Handshake: the backup's nonce.
    Challenge = 11,
    /// Handshake: the primary's proof of the key.
    Auth = 12,
    /// COLO, primary to backup: a frame the primary's guest received, for
    /// the secondary VM. Its epoch field is the primary's epoch count when
    /// the guest received it (the secondary restored from epoch `e - 1`
    /// takes it).
    ColoIn = 13,
    /// COLO, backup to primary: a frame the secondary VM sent, for the
    /// primary's comparison. Its epoch field is the one the secondary
    /// runs from, plus one (as [`Kind::ColoIn`]).
    ColoOut = 14,
    /// COLO, backup to primary: the secondary VM stopped (it could not
    /// become an epoch, or its guest failed); the payload says why. The
    /// primary releases output by epochs alone from then on.
    ColoDown = 15,
}

impl Kind {
    /// The kind with this wire code.
    pub fn from_u8(b: u8) -> Option<Kind> {
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
            11 => Kind::Challenge,
            12 => Kind::Auth,
            13 => Kind::ColoIn,
            14 => Kind::ColoOut,
            15 => Kind::ColoDown,
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
    #[error(
        "{kind:?} frame {counter} failed authentication (modified, replayed, reordered or \
         from another session)"
    )]
    Auth { kind: Kind, counter: u64 },
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

type HmacSha256 = Hmac<Sha256>;

/// Which way a sealed frame goes (part of its tag: a frame reflected back
/// to its sender fails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Dir {
    ToBackup = 1,
    ToPrimary = 2,
}

/// The key of one session (both directions), derived in the handshake.
#[derive(Clone)]
pub struct SessionKey(pub(crate) [u8; 32]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    fn mac(&self, dir: Dir) -> Counted {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(&[dir as u8]);
        Counted { mac: m, next: 0 }
    }

    /// Seals the frames sent in `dir`.
    pub fn sealer(&self, dir: Dir) -> Sealer {
        Sealer(self.mac(dir))
    }

    /// Opens the frames received from `dir`.
    pub fn opener(&self, dir: Dir) -> Opener {
        Opener(self.mac(dir))
    }
}

/// The MAC keyed for one direction, and the number of the next frame.
struct Counted {
    mac: HmacSha256,
    next: u64,
}

impl Counted {
    /// The MAC of the next frame, its header and the counter in already.
    fn start(&mut self, h: &[u8; HEADER_BYTES]) -> (HmacSha256, u64) {
        let n = self.next;
        self.next += 1;
        let mut m = self.mac.clone();
        m.update(&n.to_le_bytes());
        m.update(h);
        (m, n)
    }
}

/// The sending half of a session: tags each frame with the next counter.
pub struct Sealer(Counted);

/// The receiving half of a session: checks each frame's tag against the
/// next counter.
pub struct Opener(Counted);

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

impl Sealer {
    /// Writes one sealed frame whose payload is the concatenation of `parts`
    /// (sent without joining them: page data goes out from where it lies).
    pub fn write_frame(
        &mut self,
        w: &mut impl Write,
        kind: Kind,
        epoch: u64,
        seq: u32,
        parts: &[&[u8]],
    ) -> Result<(), ProtoError> {
        self.write_frame_crc(w, kind, epoch, seq, parts, &crc_of(parts))
    }

    /// [`Sealer::write_frame`] with the CRC of the payload already computed
    /// (`payload` hashed over exactly `parts`).
    pub fn write_frame_crc(
        &mut self,
        w: &mut impl Write,
        kind: Kind,
        epoch: u64,
        seq: u32,
        parts: &[&[u8]],
        payload: &crc32fast::Hasher,
    ) -> Result<(), ProtoError> {
        let h = full_header(kind, epoch, seq, parts, payload, MAX_PAYLOAD)?;
        let (mut m, _) = self.0.start(&h);
        for p in parts {
            m.update(p);
        }
        let tag = m.finalize().into_bytes();
        w.write_all(&h)?;
        for p in parts {
            w.write_all(p)?;
        }
        w.write_all(&tag[..TAG_BYTES])?;
        Ok(())
    }
}

/// The CRC-32 state over a payload given as `parts`.
fn crc_of(parts: &[&[u8]]) -> crc32fast::Hasher {
    let mut pc = crc32fast::Hasher::new();
    for p in parts {
        pc.update(p);
    }
    pc
}

/// The header of a frame with its CRC, or an error for a payload over `max`.
fn full_header(
    kind: Kind,
    epoch: u64,
    seq: u32,
    parts: &[&[u8]],
    payload: &crc32fast::Hasher,
    max: usize,
) -> Result<[u8; HEADER_BYTES], ProtoError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len > max {
        return Err(ProtoError::Bad(format!("payload of {len} bytes is too large")));
    }
    let mut h = header(kind, epoch, seq, len);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[..24]);
    crc.combine(payload);
    h[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
    Ok(h)
}

/// Writes one plain frame (handshake only: no tag).
pub fn write_plain_frame(
    w: &mut impl Write,
    kind: Kind,
    parts: &[&[u8]],
) -> Result<(), ProtoError> {
    let h = full_header(kind, 0, 0, parts, &crc_of(parts), HANDSHAKE_MAX)?;
    w.write_all(&h)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()?;
    Ok(())
}

/// Reads one plain frame (handshake only) of at most [`HANDSHAKE_MAX`]
/// bytes of payload, checking magic, version, kind, length and checksum.
pub fn read_plain_frame(r: &mut impl Read) -> Result<Frame, ProtoError> {
    let mut payload = Vec::new();
    let (_, kind, epoch, seq, _) = read_unsealed(r, &mut payload, HANDSHAKE_MAX)?;
    Ok(Frame { kind, epoch, seq, payload })
}

impl Opener {
    /// Reads one sealed frame, checking magic, version, kind, length,
    /// checksum and tag.
    pub fn read_frame(&mut self, r: &mut impl Read) -> Result<Frame, ProtoError> {
        let mut payload = Vec::new();
        let (kind, epoch, seq, _) = self.read_frame_into(r, &mut payload)?;
        Ok(Frame { kind, epoch, seq, payload })
    }

    /// [`Opener::read_frame`] into a caller's buffer (reused: no fresh
    /// allocation, so no page faults, per frame). Returns kind, epoch,
    /// sequence number and the CRC-32 of the payload alone.
    pub fn read_frame_into(
        &mut self,
        r: &mut impl Read,
        payload: &mut Vec<u8>,
    ) -> Result<(Kind, u64, u32, u32), ProtoError> {
        let (h, kind, epoch, seq, crc) = read_unsealed(r, payload, MAX_PAYLOAD)?;
        let mut tag = [0u8; TAG_BYTES];
        r.read_exact(&mut tag).map_err(truncated)?;
        let (mut m, counter) = self.0.start(&h);
        m.update(payload);
        m.verify_truncated_left(&tag).map_err(|_| ProtoError::Auth { kind, counter })?;
        Ok((kind, epoch, seq, crc))
    }
}

/// The header arrived but the rest did not: a truncated frame.
fn truncated(e: std::io::Error) -> ProtoError {
    match ProtoError::from(e) {
        ProtoError::Closed => ProtoError::Truncated,
        other => other,
    }
}

/// Reads header and payload (at most `max` bytes), checking magic,
/// version, kind, length and checksum.
#[allow(clippy::type_complexity)]
fn read_unsealed(
    r: &mut impl Read,
    payload: &mut Vec<u8>,
    max: usize,
) -> Result<([u8; HEADER_BYTES], Kind, u64, u32, u32), ProtoError> {
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
    if len > max {
        return Err(ProtoError::Bad(format!(
            "{kind:?} frame with a payload of {len} bytes (at most {max} here)"
        )));
    }
    payload.clear();
    payload.resize(len, 0);
    r.read_exact(payload).map_err(truncated)?;
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
    Ok((h, kind, epoch, seq, payload_crc))
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
    /// The primary's lease in ms: it fences itself after this long without
    /// an ack. The backup refuses a primary whose lease is longer than its
    /// own, which would let it take over a primary that still runs.
    #[serde(default)]
    pub lease_ms: u64,
    /// A Linux VM: how it was booted (absent for the reference guest). The
    /// backup builds a Linux VM ahead of a takeover from it
    /// (`Vm::prepare_linux`), and refuses a record that does not validate
    /// or an epoch whose state is not of the VM kind the hello announced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linux: Option<LinuxHello>,
    /// COLO: the primary releases output once the backup's secondary VM
    /// sent the same; a backup without a secondary refuses it.
    #[serde(default)]
    pub colo: bool,
}

/// Version of [`LinuxHello`]'s record, checked on its own (the record may
/// grow fields without a new protocol version).
pub const LINUX_RECORD_VERSION: u32 = 1;

/// A Linux VM's boot record in the hello.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LinuxHello {
    /// [`LINUX_RECORD_VERSION`].
    pub version: u32,
    pub record: nl_vmm::linux::LinuxRecord,
}

impl LinuxHello {
    pub fn of(record: &nl_vmm::linux::LinuxRecord) -> Self {
        Self { version: LINUX_RECORD_VERSION, record: record.clone() }
    }

    /// The record, if its version is this side's and it validates; the
    /// error says what is wrong with it.
    pub fn check(&self) -> Result<&nl_vmm::linux::LinuxRecord, String> {
        if self.version != LINUX_RECORD_VERSION {
            return Err(format!(
                "the primary's Linux record has version {}; this backup reads version \
                 {LINUX_RECORD_VERSION}",
                self.version
            ));
        }
        self.record
            .validate()
            .map_err(|e| format!("the primary's Linux record is refused: {e}"))?;
        Ok(&self.record)
    }
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

    fn session(n: u8) -> SessionKey {
        SessionKey([n; 32])
    }

    /// Three sealed frames of one session, primary to backup.
    fn stream(key: &SessionKey) -> Vec<Vec<u8>> {
        let mut seal = key.sealer(Dir::ToBackup);
        (0..3u64)
            .map(|e| {
                let mut buf = Vec::new();
                seal.write_frame(&mut buf, Kind::Ack, e, 0, &[b"ab", b"cd"]).unwrap();
                buf
            })
            .collect()
    }

    fn open_all(key: &SessionKey, frames: &[&[u8]]) -> Result<Vec<u64>, ProtoError> {
        let mut open = key.opener(Dir::ToBackup);
        let all = frames.concat();
        let mut r = &all[..];
        let mut epochs = Vec::new();
        for _ in frames {
            epochs.push(open.read_frame(&mut r)?.epoch);
        }
        Ok(epochs)
    }

    #[test]
    fn sealed_frames_round_trip_and_every_change_is_caught() {
        let key = session(1);
        let f = stream(&key);
        assert_eq!(f[0].len(), HEADER_BYTES + 4 + TAG_BYTES);
        assert_eq!(open_all(&key, &[&f[0], &f[1], &f[2]]).unwrap(), vec![0, 1, 2]);
        let mut open = key.opener(Dir::ToBackup);
        let g = open.read_frame(&mut &f[0][..]).unwrap();
        assert_eq!((g.kind, g.epoch, g.payload.as_slice()), (Kind::Ack, 0, &b"abcd"[..]));
        // Every single-bit flip, anywhere (header, payload, tag), is refused.
        for i in 0..f[0].len() {
            let mut bad = f[0].clone();
            bad[i] ^= 0x40;
            let e = key.opener(Dir::ToBackup).read_frame(&mut &bad[..]);
            assert!(e.is_err(), "flip at byte {i} not caught");
        }
        // A flip past the CRC's reach (header and payload re-checksummed): the
        // tag still catches it.
        let mut forged = f[0].clone();
        forged[HEADER_BYTES] = b'x';
        let mut crc = crc32fast::Hasher::new();
        crc.update(&forged[..24]);
        crc.update(&forged[HEADER_BYTES..HEADER_BYTES + 4]);
        forged[24..28].copy_from_slice(&crc.finalize().to_le_bytes());
        let e = key.opener(Dir::ToBackup).read_frame(&mut &forged[..]).unwrap_err();
        assert!(matches!(e, ProtoError::Auth { kind: Kind::Ack, counter: 0 }), "{e}");
        assert!(e.to_string().contains("failed authentication"), "{e}");
        for cut in 0..f[0].len() {
            assert!(key.opener(Dir::ToBackup).read_frame(&mut &f[0][..cut]).is_err());
        }
        let mut v2 = f[0].clone();
        v2[4] = 2;
        let e = key.opener(Dir::ToBackup).read_frame(&mut &v2[..]);
        assert!(matches!(e, Err(ProtoError::Version { got: 2 })));
    }

    #[test]
    fn replayed_reordered_dropped_reflected_and_spliced_frames_are_refused() {
        let key = session(1);
        let f = stream(&key);
        let auth = |r: Result<Vec<u64>, ProtoError>| match r {
            Err(ProtoError::Auth { counter, .. }) => counter,
            other => panic!("not refused: {other:?}"),
        };
        // Replayed: frame 0 again in place of frame 1.
        assert_eq!(auth(open_all(&key, &[&f[0], &f[0]])), 1);
        // Reordered.
        assert_eq!(auth(open_all(&key, &[&f[1], &f[0]])), 0);
        // Dropped: frame 1 never arrives.
        assert_eq!(auth(open_all(&key, &[&f[0], &f[2]])), 1);
        // Spliced: frame 1 from another session (another session key).
        let other = stream(&session(2));
        assert_eq!(auth(open_all(&key, &[&f[0], &other[1]])), 1);
        // Reflected: a frame the backup sent, fed back to the backup.
        let mut back = Vec::new();
        key.sealer(Dir::ToPrimary).write_frame(&mut back, Kind::Ack, 0, 0, &[b"abcd"]).unwrap();
        assert_eq!(auth(open_all(&key, &[&back])), 0);
        // A plain (handshake) frame where a sealed one is due.
        let mut plain = Vec::new();
        write_plain_frame(&mut plain, Kind::Ack, &[b"abcd"]).unwrap();
        assert!(open_all(&key, &[&plain]).is_err());
    }

    #[test]
    fn plain_frames_are_small_and_checked() {
        let mut buf = Vec::new();
        write_plain_frame(&mut buf, Kind::Hello, &[b"ab", b"cd"]).unwrap();
        let f = read_plain_frame(&mut &buf[..]).unwrap();
        assert_eq!((f.kind, f.payload.as_slice()), (Kind::Hello, &b"abcd"[..]));
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x40;
            assert!(read_plain_frame(&mut &bad[..]).is_err(), "flip at byte {i} not caught");
        }
        let big = vec![0u8; HANDSHAKE_MAX + 1];
        assert!(write_plain_frame(&mut Vec::new(), Kind::Hello, &[&big]).is_err());
        // A header announcing a large payload is refused before any of it is read.
        let mut h = header(Kind::Hello, 0, 0, MAX_PAYLOAD);
        let crc = crc32fast::hash(&h[..24]);
        h[24..28].copy_from_slice(&crc.to_le_bytes());
        let e = read_plain_frame(&mut &h[..]).unwrap_err();
        assert!(e.to_string().contains("at most 16384"), "{e}");
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
