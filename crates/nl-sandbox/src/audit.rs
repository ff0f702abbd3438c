//! The creation-time isolation audit.
//!
//! Every memory slot of every sandbox is described as a [`Mapping`]: which
//! host file (device and inode, so two names for one file are one backing)
//! and which byte range of it the sandbox reaches, and whether it can write
//! it. The audit refuses any set in which a host page is reachable from two
//! sandboxes, except a declared channel region mapped by exactly its two
//! ends with the same range and writable in at most one of them.

use std::os::unix::fs::MetadataExt;

use crate::SandboxError;

/// A host file as the kernel identifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Backing {
    pub dev: u64,
    pub ino: u64,
}

impl Backing {
    pub fn of(file: &std::fs::File) -> Result<Self, SandboxError> {
        let m = file
            .metadata()
            .map_err(|e| SandboxError::Config(format!("cannot stat a memory file: {e}")))?;
        Ok(Self { dev: m.dev(), ino: m.ino() })
    }
}

/// One memory slot of one sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Index of the sandbox in its set.
    pub sandbox: usize,
    pub backing: Backing,
    /// Byte range of the backing file.
    pub offset: u64,
    pub len: u64,
    pub writable: bool,
    /// A declared channel region: (channel index, region index 0 or 1).
    pub channel: Option<(usize, usize)>,
    /// For messages: "RAM", "channel 'ab' region 0", ...
    pub what: String,
}

fn overlap(a: &Mapping, b: &Mapping) -> Option<(u64, u64)> {
    let start = a.offset.max(b.offset);
    let end = (a.offset + a.len).min(b.offset + b.len);
    (a.backing == b.backing && start < end).then_some((start, end))
}

/// Checks a set's mappings; `names` are the sandboxes' names by index.
pub fn audit(mappings: &[Mapping], names: &[String]) -> Result<(), SandboxError> {
    let name = |i: usize| names.get(i).map_or("?", String::as_str);
    for (i, a) in mappings.iter().enumerate() {
        for b in &mappings[i + 1..] {
            if a.sandbox == b.sandbox {
                continue;
            }
            let Some((start, end)) = overlap(a, b) else { continue };
            let declared = a.channel.is_some()
                && a.channel == b.channel
                && (a.offset, a.len) == (b.offset, b.len);
            let why = if !declared {
                "which is not a declared channel region of both"
            } else if a.writable && b.writable {
                "writable in both"
            } else {
                continue;
            };
            return Err(SandboxError::Isolation(format!(
                "host pages {start:#x}..{end:#x} of one memory file are reachable from sandbox '{}' ({}{}) and sandbox '{}' ({}{}), {why}",
                name(a.sandbox),
                a.what,
                if a.writable { ", writable" } else { ", read-only" },
                name(b.sandbox),
                b.what,
                if b.writable { ", writable" } else { ", read-only" },
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: Backing = Backing { dev: 1, ino: 10 };
    const G: Backing = Backing { dev: 1, ino: 11 };

    fn m(
        sandbox: usize,
        backing: Backing,
        offset: u64,
        len: u64,
        writable: bool,
        channel: Option<(usize, usize)>,
    ) -> Mapping {
        Mapping { sandbox, backing, offset, len, writable, channel, what: "x".into() }
    }

    fn names() -> Vec<String> {
        vec!["a".into(), "b".into(), "c".into()]
    }

    #[test]
    fn disjoint_ram_and_a_declared_channel_pass() {
        let set = [
            m(0, F, 0, 64 << 20, true, None),
            m(1, G, 0, 64 << 20, true, None),
            m(0, Backing { dev: 1, ino: 12 }, 0, 2 << 20, true, Some((0, 0))),
            m(1, Backing { dev: 1, ino: 12 }, 0, 2 << 20, false, Some((0, 0))),
            m(1, Backing { dev: 1, ino: 12 }, 2 << 20, 2 << 20, true, Some((0, 1))),
            m(0, Backing { dev: 1, ino: 12 }, 2 << 20, 2 << 20, false, Some((0, 1))),
        ];
        audit(&set, &names()).unwrap();
    }

    #[test]
    fn shared_ram_is_refused() {
        let set = [m(0, F, 0, 64 << 20, true, None), m(2, F, 60 << 20, 64 << 20, true, None)];
        let e = audit(&set, &names()).unwrap_err().to_string();
        assert!(
            e.contains("sandbox 'a'")
                && e.contains("sandbox 'c'")
                && e.contains("0x3c00000..0x4000000"),
            "{e}"
        );
    }

    #[test]
    fn a_channel_region_writable_in_both_is_refused() {
        let set = [m(0, F, 0, 4096, true, Some((0, 0))), m(1, F, 0, 4096, true, Some((0, 0)))];
        assert!(audit(&set, &names()).unwrap_err().to_string().contains("writable in both"));
    }

    #[test]
    fn a_channel_region_overlapping_other_memory_is_refused() {
        // Read-only in b, but b reaches it as RAM, not as the declared region.
        let set = [m(0, F, 0, 8192, true, Some((0, 0))), m(1, F, 4096, 8192, false, None)];
        assert!(audit(&set, &names())
            .unwrap_err()
            .to_string()
            .contains("not a declared channel region"));
        // The same region declared as another channel's.
        let set = [m(0, F, 0, 8192, true, Some((0, 0))), m(1, F, 0, 8192, false, Some((1, 0)))];
        assert!(audit(&set, &names()).is_err());
    }
}
