//! A sandbox's own virtio-blk disk: an image file on the host, checked at
//! creation so that no two sandboxes can reach one image unless both only
//! read it.
//!
//! The disk belongs to the sandbox, not to one incarnation of its VM: a
//! `restart` or `replace` builds its new VM over the same image (the guest
//! finds what it wrote before the fault, as after a reboot), and a carried
//! set's new process opens the same image again (`nl_vmm::handover`).
//! Under `rollback` the image is part of the state a rollback restores:
//! the checkpoint supervisor holds the guest's writes until no rollback
//! can undo them (`nl_checkpoint::output_commit`).
//!
//! The isolation rule is the memory audit's ([`crate::audit`]) applied to
//! files: an image (by device and inode, so a second name, a hard link or
//! a symlink, is the same image) reachable from two sandboxes is refused
//! unless both have it read-only, and no image may be memory any sandbox
//! maps: its RAM (a fresh memfd or its `memory_file`), a channel region or
//! a state region, under whatever name (`/proc/self/fd/N` included).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nl_vmm::DiskConfig;

use crate::audit::{Backing, Mapping};
use crate::config::{SandboxConfig, SetConfig};
use crate::SandboxError;

/// Size of an image the set creates when its file is missing, unless the
/// sandbox's `disk.size_mib` says otherwise (blkbench needs 128 MiB).
pub const DEFAULT_SIZE_MIB: u64 = 256;

/// Largest image the set creates (1 TiB, sparse).
pub const MAX_SIZE_MIB: u64 = 1 << 20;

/// The least image size a sandbox's workloads (its own and a `replace`
/// alternative) need, in bytes (workloads that do not parse are refused by
/// the configuration's own checks).
pub fn needed_bytes(s: &SandboxConfig) -> Option<u64> {
    std::iter::once(&s.workload)
        .chain(s.recovery.replace_with.as_ref())
        .filter_map(|w| w.params().ok())
        .filter_map(|p| nl_workloads::disk_needed(&p))
        .max()
}

/// The static checks (nothing opened): a disk where the workload needs
/// one, a path that is absolute, a size in range, no blkbench on a
/// read-only disk, and no two sandboxes
/// naming one path unless both only read it.
pub fn validate(c: &SetConfig) -> Result<(), SandboxError> {
    let mut by_path: BTreeMap<&Path, (&str, bool)> = BTreeMap::new();
    for s in &c.sandboxes {
        let bad = |m: String| Err(SandboxError::Config(format!("sandbox '{}': {m}", s.name)));
        let Some(d) = &s.disk else {
            if needed_bytes(s).is_some() {
                return bad("blkbench needs a disk (\"disk\": {\"path\": \"/abs/image\"})".into());
            }
            continue;
        };
        if !d.path.is_absolute() {
            return bad(format!("disk.path {} must be an absolute path", d.path.display()));
        }
        if let Some(m) = d.size_mib {
            if m == 0 || m > MAX_SIZE_MIB {
                return bad(format!("disk.size_mib {m} is not in 1..={MAX_SIZE_MIB}"));
            }
            if let Some(need) = needed_bytes(s).filter(|&n| m << 20 < n) {
                return bad(format!(
                    "disk.size_mib {m} is less than the {} MiB blkbench needs",
                    need >> 20
                ));
            }
        }
        if d.readonly && needed_bytes(s).is_some() {
            return bad("blkbench writes its disk: a read-only disk would fail every write".into());
        }
        if s.memory_file.as_deref() == Some(d.path.as_path()) {
            return bad(format!("disk.path {} is also its memory_file", d.path.display()));
        }
        if let Some((other, other_ro)) = by_path.insert(&d.path, (&s.name, d.readonly)) {
            if !(other_ro && d.readonly) {
                return Err(shared(other, &s.name, &d.path));
            }
        }
    }
    Ok(())
}

fn shared(a: &str, b: &str, path: &Path) -> SandboxError {
    SandboxError::Config(format!(
        "sandboxes '{a}' and '{b}' both reach disk image {} and at least one may write it: \
         a disk image is shared only read-only",
        path.display()
    ))
}

/// One opened image: who has it, how, and which file it is (identified as
/// the memory audit identifies a memory file).
struct Opened {
    sandbox: usize,
    readonly: bool,
    backing: Backing,
    path: PathBuf,
}

/// Opens (creating sparse where missing) every sandbox's image, checks
/// each is a regular file large enough for its workload, and audits them
/// by device and inode: an image reachable from two sandboxes unless both
/// only read it, or that is the backing of any of the set's `memory`
/// mappings (the isolation audit's: RAM, channel and state regions), is
/// refused before anything is written to it. Returns each sandbox's disk
/// for its VM (the path as configured).
pub fn open_all(
    c: &SetConfig,
    memory: &[Mapping],
) -> Result<Vec<Option<DiskConfig>>, SandboxError> {
    validate(c)?;
    let mut opened: Vec<Opened> = Vec::new();
    let mut out = Vec::new();
    for (i, s) in c.sandboxes.iter().enumerate() {
        let Some(d) = &s.disk else {
            out.push(None);
            continue;
        };
        let cfg_err = |m: String| SandboxError::Config(format!("sandbox '{}': {m}", s.name));
        let size = d.size_mib.map_or_else(
            || (DEFAULT_SIZE_MIB << 20).max(needed_bytes(s).unwrap_or(0)),
            |m| m << 20,
        );
        if std::fs::metadata(&d.path).is_ok_and(|m| !m.is_file()) {
            return Err(cfg_err(format!("disk image {} is not a regular file", d.path.display())));
        }
        // Non-blocking: a FIFO put there since the check must not hang the
        // VMM in open (it is refused below, by the descriptor's own type).
        let file = OpenOptions::new()
            .read(true)
            .write(!d.readonly)
            .create(!d.readonly)
            .truncate(false)
            .custom_flags(libc::O_NONBLOCK)
            .open(&d.path)
            .map_err(|e| cfg_err(format!("cannot open disk image {}: {e}", d.path.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| cfg_err(format!("cannot stat disk image {}: {e}", d.path.display())))?;
        if !meta.is_file() {
            return Err(cfg_err(format!("disk image {} is not a regular file", d.path.display())));
        }
        // Before anything is sized or written: an image that is some
        // sandbox's memory (a memfd reached as /proc/self/fd/N is a regular
        // file too) would let a guest's disk writes land in that memory.
        let backing = Backing { dev: meta.dev(), ino: meta.ino() };
        if let Some(m) = memory.iter().find(|m| m.backing == backing) {
            let owner = c.sandboxes.get(m.sandbox).map_or("?", |o| o.name.as_str());
            return Err(SandboxError::Isolation(format!(
                "sandbox '{}': disk image {} is the {} of sandbox '{owner}': a disk image \
                 may not be memory any sandbox maps",
                s.name,
                d.path.display(),
                m.what
            )));
        }
        if meta.len() == 0 && !d.readonly {
            // Created just now (or empty): sized sparse, nothing written.
            file.set_len(size).map_err(|e| {
                cfg_err(format!("cannot size disk image {}: {e}", d.path.display()))
            })?;
        }
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if let Some(need) = needed_bytes(s).filter(|&n| len < n) {
            return Err(cfg_err(format!(
                "disk image {} holds {} MiB, blkbench needs {} MiB",
                d.path.display(),
                len >> 20,
                need >> 20
            )));
        }
        if len < 512 {
            return Err(cfg_err(format!(
                "disk image {} is smaller than one sector",
                d.path.display()
            )));
        }
        let me = Opened { sandbox: i, readonly: d.readonly, backing, path: d.path.clone() };
        for o in &opened {
            if o.backing == me.backing && !(o.readonly && me.readonly) {
                return Err(shared(&c.sandboxes[o.sandbox].name, &s.name, &me.path));
            }
        }
        opened.push(me);
        out.push(Some(DiskConfig { path: d.path.clone(), readonly: d.readonly }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::tempdir::TempDir;

    /// Two sandboxes; `a_disk`/`b_disk` are JSON `disk` sections or "".
    fn set(a_kind: &str, a_disk: &str, b_disk: &str, a_extra: &str) -> SetConfig {
        let d = |s: &str| if s.is_empty() { String::new() } else { format!(r#", "disk": {s}"#) };
        SetConfig::parse(&format!(
            r#"{{"sandboxes": [
                {{"name": "a", "cores": [0], "workload": {{"kind": "{a_kind}"}} {} {a_extra}}},
                {{"name": "b", "cores": [0], "workload": {{"kind": "idle"}} {}}}
            ]}}"#,
            d(a_disk),
            d(b_disk)
        ))
        .unwrap()
    }

    /// What the set maps as memory before it opens disks: here each
    /// sandbox's `memory_file` (a set's RAM memfds, channels and state
    /// regions are mappings too).
    fn memory(c: &SetConfig) -> Vec<Mapping> {
        c.sandboxes
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let f = std::fs::File::open(s.memory_file.as_ref()?).ok()?;
                Some(ram(i, Backing::of(&f).unwrap(), "RAM in its memory_file"))
            })
            .collect()
    }

    fn ram(sandbox: usize, backing: Backing, what: &str) -> Mapping {
        Mapping {
            sandbox,
            backing,
            offset: 0,
            len: 1 << 20,
            writable: true,
            channel: None,
            what: what.into(),
        }
    }

    fn err(c: &SetConfig) -> String {
        match c.validate(2).and_then(|()| open_all(c, &memory(c)).map(drop)) {
            Ok(()) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn disk(path: &Path, extra: &str) -> String {
        format!(r#"{{"path": "{}" {extra}}}"#, path.display())
    }

    #[test]
    fn static_checks_give_clear_errors() {
        assert!(err(&set("blkbench", "", "", "")).contains("sandbox 'a': blkbench needs a disk"));
        assert!(err(&set("idle", r#"{"path": "rel.img"}"#, "", ""))
            .contains("disk.path rel.img must be an absolute path"));
        assert!(err(&set("idle", &disk(Path::new("/x.img"), r#", "size_mib": 0"#), "", ""))
            .contains("disk.size_mib 0 is not in 1..="));
        assert!(err(&set("blkbench", &disk(Path::new("/x.img"), r#", "size_mib": 64"#), "", ""))
            .contains("less than the 128 MiB blkbench needs"));
        assert!(err(&set("blkbench", &disk(Path::new("/x.img"), r#", "readonly": true"#), "", ""))
            .contains("blkbench writes its disk"));
        let same = disk(Path::new("/x.img"), "");
        assert!(err(&set("idle", &same, &same, ""))
            .contains("sandboxes 'a' and 'b' both reach disk image /x.img"));
        assert!(err(&set("idle", &same, "", r#", "memory_file": "/x.img""#))
            .contains("disk.path /x.img is also its memory_file"));
        let typo = r#"{"sandboxes": [{"name": "a", "cores": [0], "workload": {"kind": "idle"},
            "disk": {"path": "/x.img", "typo": 1}}]}"#;
        assert!(SetConfig::parse(typo).unwrap_err().to_string().contains("unknown field `typo`"));
    }

    #[test]
    fn images_are_created_sparse_and_sized_for_the_workload() {
        let dir = TempDir::new().unwrap();
        let (a, b) = (dir.as_path().join("a.img"), dir.as_path().join("b.img"));
        let c = set("blkbench", &disk(&a, ""), &disk(&b, r#", "size_mib": 4"#), "");
        c.validate(2).unwrap();
        let disks = open_all(&c, &[]).unwrap();
        assert_eq!(disks[0], Some(DiskConfig { path: a.clone(), readonly: false }));
        assert_eq!(std::fs::metadata(&a).unwrap().len(), DEFAULT_SIZE_MIB << 20);
        assert_eq!(std::fs::metadata(&b).unwrap().len(), 4 << 20);
        // Sparse: nothing written.
        assert!(std::fs::metadata(&a).unwrap().blocks() < 64);
        // An existing image is kept as it is (a restart's data stays).
        std::fs::write(&b, vec![7u8; 8192]).unwrap();
        open_all(&c, &[]).unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), vec![7u8; 8192]);
    }

    /// The audit is by device and inode: a hard link or a symlink to
    /// another sandbox's image is the same image.
    #[test]
    fn one_image_under_two_names_is_refused_unless_both_only_read() {
        let dir = TempDir::new().unwrap();
        let a = dir.as_path().join("a.img");
        std::fs::write(&a, vec![0u8; 1 << 20]).unwrap();
        let hard = dir.as_path().join("hard.img");
        std::fs::hard_link(&a, &hard).unwrap();
        let sym = dir.as_path().join("sym.img");
        std::os::unix::fs::symlink(&a, &sym).unwrap();
        for other in [&hard, &sym] {
            let e = err(&set("idle", &disk(&a, ""), &disk(other, ""), ""));
            assert!(e.contains("sandboxes 'a' and 'b' both reach disk image"), "{e}");
            let e = err(&set("idle", &disk(&a, r#", "readonly": true"#), &disk(other, ""), ""));
            assert!(e.contains("at least one may write it"), "{e}");
            let ro = r#", "readonly": true"#;
            let c = set("idle", &disk(&a, ro), &disk(other, ro), "");
            c.validate(2).unwrap();
            assert_eq!(open_all(&c, &[]).unwrap().iter().flatten().count(), 2);
        }
        // Another sandbox's memory file, under another name.
        let mem = dir.as_path().join("mem");
        std::fs::write(&mem, b"").unwrap();
        let mem_link = dir.as_path().join("mem-link");
        std::os::unix::fs::symlink(&mem, &mem_link).unwrap();
        let c = set("idle", &disk(&mem_link, ""), "", "");
        let mut c = c;
        c.sandboxes[1].memory_file = Some(mem.clone());
        let e = err(&c);
        assert!(e.contains("is the RAM in its memory_file of sandbox 'b'"), "{e}");
        // Not a regular file; too small for blkbench.
        assert!(err(&set("idle", &disk(dir.as_path(), ""), "", "")).contains("not a regular file"));
        let small = dir.as_path().join("small.img");
        std::fs::write(&small, vec![0u8; 4096]).unwrap();
        assert!(err(&set("blkbench", &disk(&small, ""), "", ""))
            .contains("holds 0 MiB, blkbench needs 128 MiB"));
    }

    /// A memfd is a regular file, and `/proc/self/fd/N` names it: an image
    /// path that reaches any sandbox's memory (its RAM, a channel region)
    /// is refused by the memory's identity, whatever the path, and nothing
    /// is written to it (not even its size).
    #[test]
    fn an_image_that_is_some_sandboxs_memory_is_refused_whatever_its_name() {
        use std::os::fd::AsRawFd;
        let dir = TempDir::new().unwrap();
        let own = dir.as_path().join("own.img");
        let m = nl_memory::GuestMemory::new("disk-audit-test", 64 << 20).unwrap();
        let len = m.fd().metadata().unwrap().len();
        for what in ["RAM", "channel 'ab' region 0"] {
            let path = PathBuf::from(format!("/proc/self/fd/{}", m.fd().as_raw_fd()));
            let c = set("idle", &disk(&own, ""), &disk(&path, ""), "");
            c.validate(2).unwrap();
            let mapped = [ram(0, Backing::of(m.fd()).unwrap(), what)];
            let e = open_all(&c, &mapped).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "sandbox 'b': disk image {} is the {what} of sandbox 'a'",
                    path.display()
                )),
                "{e}"
            );
            assert_eq!(m.fd().metadata().unwrap().len(), len, "the memory was resized");
            assert!(m.allocated_ranges().unwrap().is_empty(), "the memory was written");
            // The same memfd is accepted once no sandbox maps it.
            assert_eq!(open_all(&c, &[]).unwrap().iter().flatten().count(), 2);
        }
    }
}
