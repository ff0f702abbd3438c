//! Files ninelives reads back: a checkpoint file and a handover record, as
//! an attacker who can write them would make them.
//!
//! Properties checked for every input:
//! - no panic;
//! - a checkpoint body with a recomputed CRC (anyone can recompute it) is
//!   either refused or consistent: its pages ascend, lie in guest RAM and
//!   are as many as its header says, and its state has the header's vCPUs;
//! - an authenticated checkpoint with a made-up MAC is always refused;
//! - a handover record that parses survives its own round trip.

use nl_checkpoint::disk::{parse, Key};
use nl_vmm::handover::HandoverRecord;

const MAGIC: &[u8; 8] = b"NLCKPT01";
const MAGIC_AUTH: &[u8; 8] = b"NLCKPTA1";

/// `data` is a checkpoint body (what follows the magic, without the CRC).
pub fn checkpoint(data: &[u8]) {
    let mut file = MAGIC.to_vec();
    file.extend_from_slice(data);
    let crc = crc32fast::hash(&file);
    file.extend_from_slice(&crc.to_le_bytes());
    if let Ok(c) = parse(&file, "fuzz", None) {
        let layout = nl_memory::layout(c.header.mem_bytes);
        assert_eq!(c.pages.len() as u64, c.header.pages, "page count disagrees with the header");
        assert!(c.pages.windows(2).all(|w| w[0].0 < w[1].0), "pages not ascending");
        for (gpa, _) in &c.pages {
            assert!(
                layout.iter().any(|l| *gpa >= l.gpa && *gpa < l.gpa + l.size),
                "page {gpa:#x} outside guest RAM"
            );
        }
        assert_eq!(c.state.vcpus.len() as u64, u64::from(c.header.vcpus), "vCPU count");
    }
    // The same bytes as an authenticated file with a MAC the fuzzer made up.
    let key = Key::from_bytes(&[0x3c; 32]).expect("a 32-byte key");
    file[..8].copy_from_slice(MAGIC_AUTH);
    let crc = crc32fast::hash(&file[..file.len() - 4]);
    let n = file.len();
    file[n - 4..].copy_from_slice(&crc.to_le_bytes());
    let tag: Vec<u8> = data.iter().rev().take(32).copied().collect();
    file.extend_from_slice(&tag);
    file.resize(n + 32, 0);
    assert!(parse(&file, "fuzz", Some(&key)).is_err(), "a forged MAC was accepted");
}

pub fn handover(data: &[u8]) {
    if let Ok(r) = HandoverRecord::from_bytes(data) {
        let again = HandoverRecord::from_bytes(&r.to_bytes())
            .expect("a record that parsed parses again after its own round trip");
        assert_eq!(again.to_bytes(), r.to_bytes());
    }
}
