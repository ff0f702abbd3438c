//! Network namespaces for the lab's runs, one helper for every bench,
//! campaign and test: [`Netns`] creates a named namespace (deleted when
//! dropped), configures it with iproute2, and starts processes inside it
//! by `setns(2)`.
//!
//! Configuration runs `ip` (iproute2) rather than speaking rtnetlink
//! itself: the async `rtnetlink` stack (tokio, futures) would be the lab's
//! heaviest dependency for a dozen one-shot commands, and `ip netns add`
//! also sets up the bind mount under /run/netns that makes a namespace
//! visible to `ip netns exec` and to the tests. What the helper does not do
//! is discard `ip`'s error: a failed step is an error naming the command
//! and quoting its stderr. Entering a namespace needs no `ip`: a child is
//! moved into it with `setns` between fork and exec.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Runs `ip ARGS...`; an error names the command and quotes `ip`'s stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let o = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("cannot run ip (iproute2 is needed for network namespaces)")?;
    if !o.status.success() {
        bail!(
            "ip {} failed ({}): {}",
            args.join(" "),
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// Why network namespaces cannot be made here (not root, no iproute2), or
/// None if they can.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("network namespaces need iproute2 (ip)".into()),
    }
}

/// A named network namespace, deleted (with the interfaces in it) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates namespace `name` with `lo` up.
    pub fn new(name: &str) -> Result<Netns> {
        ip(&["netns", "add", name])
            .with_context(|| format!("cannot create network namespace {name} (needs root)"))?;
        let ns = Netns { name: name.to_string() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Creates namespace `name` holding TAP `tap` at 10.0.0.1/24 (the
    /// guest is 10.0.0.2), up.
    pub fn with_tap(name: &str, tap: &str) -> Result<Netns> {
        let ns = Netns::new(name)?;
        ns.add_tap(tap, "10.0.0.1/24")?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS...`.
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut a = vec!["-n", self.name.as_str()];
        a.extend_from_slice(args);
        ip(&a)
    }

    /// Adds TAP `tap` with address `cidr`, up.
    pub fn add_tap(&self, tap: &str, cidr: &str) -> Result<()> {
        self.ip(&["tuntap", "add", "dev", tap, "mode", "tap"])?;
        self.ip(&["addr", "add", cidr, "dev", tap])?;
        self.ip(&["link", "set", tap, "up"])
    }

    /// A veth pair: `here` in this namespace, `there` in `peer`, both up,
    /// with the addresses given (None: no address, e.g. for a bridge port).
    pub fn veth(
        &self,
        here: (&str, Option<&str>),
        peer: &Netns,
        there: (&str, Option<&str>),
    ) -> Result<()> {
        self.ip(&["link", "add", here.0, "type", "veth", "peer", "name", there.0])?;
        self.ip(&["link", "set", there.0, "netns", &peer.name])?;
        for (ns, (dev, cidr)) in [(self, here), (peer, there)] {
            if let Some(c) = cidr {
                ns.ip(&["addr", "add", c, "dev", dev])?;
            }
            ns.ip(&["link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// The namespace's file under /run/netns.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// `program` to be started inside this namespace (moved into it with
    /// `setns` before it executes).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let f = File::open(self.path())
            .with_context(|| format!("cannot open network namespace {}", self.name))?;
        let mut c = Command::new(program);
        // SAFETY: between fork and exec the closure only calls setns(2), an
        // async-signal-safe system call, on a descriptor it keeps open (it
        // owns the File); it allocates nothing and takes no locks.
        unsafe {
            c.pre_exec(move || {
                if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(c)
    }

    /// This binary (`ninelives`) to be started inside the namespace.
    pub fn ninelives(&self) -> Result<Command> {
        self.command(crate::process::exe()?)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}
