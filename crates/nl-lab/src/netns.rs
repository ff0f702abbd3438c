//! Network namespaces for the lab's runs, one helper for every bench,
//! campaign and test: [`Netns`] creates a named namespace (deleted when
//! dropped), configures its links, addresses and routes over rtnetlink,
//! and starts processes inside it by `setns(2)`.
//!
//! How each step is done, without iproute2:
//! - **create**: a helper thread `unshare`s into a new network namespace
//!   and bind-mounts its `/proc/thread-self/ns/net` on `/run/netns/NAME`
//!   (what `ip netns add` does), so the namespace outlives the thread and
//!   `ip netns exec NAME` still finds it; **delete** unmounts and removes
//!   that file, and the kernel then destroys the namespace with its links.
//! - **configure**: each step runs in a helper thread that has `setns`-ed
//!   into the namespace and opens its rtnetlink socket there (a netlink
//!   socket belongs to the namespace it was opened in). The `rtnetlink`
//!   crate is async: the thread drives it on a current-thread tokio
//!   runtime of its own, so tokio stays inside this module (the VMM and
//!   the rest of the lab are synchronous).
//! - **TAP devices** cannot be created over rtnetlink (the kernel refuses
//!   `tun` link creation); they are made persistent through `/dev/net/tun`
//!   in the namespace, as `ip tuntap add` does.
//!
//! A failed step is an error naming the namespace, the step and the
//! kernel's netlink error (e.g. "network namespace nl-x: add veth a/b:
//! Received a netlink error message File exists (os error 17)").

use std::ffi::CString;
use std::fs::File;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use futures_util::TryStreamExt;
use rtnetlink::{Handle, LinkBridge, LinkUnspec, LinkVeth, RouteMessageBuilder};

/// Where named namespaces are bound (iproute2's convention).
const NETNS_DIR: &str = "/run/netns";
/// `TUNSETPERSIST`: keep a TAP after its creator closes it.
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;

/// Why network namespaces cannot be made here (not root), or None if
/// they can.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root".into());
    }
    None
}

/// An IPv4 address with prefix, "10.0.0.1/24".
fn parse_cidr(cidr: &str) -> Result<(Ipv4Addr, u8)> {
    let (a, p) = cidr.split_once('/').ok_or_else(|| anyhow!("'{cidr}' is not ADDRESS/PREFIX"))?;
    let a: Ipv4Addr = a.parse().with_context(|| format!("'{cidr}': bad IPv4 address"))?;
    let p: u8 =
        p.parse().ok().filter(|p| *p <= 32).ok_or_else(|| anyhow!("'{cidr}': bad prefix"))?;
    Ok((a, p))
}

/// Runs `f` in a helper thread that has first entered the network
/// namespace `ns` (`setns`); the calling thread stays where it is.
fn in_namespace<T: Send>(ns: &File, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on a namespace descriptor we hold open; it only
            // changes this helper thread's network namespace.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!("setns: {}", std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .map_err(|_| anyhow!("the namespace helper thread panicked"))?
    })
}

/// Runs one rtnetlink conversation inside namespace `ns`.
fn netlink<T, F, Fut>(ns: &File, f: F) -> Result<T>
where
    T: Send,
    F: FnOnce(Handle) -> Fut + Send,
    Fut: Future<Output = Result<T>>,
{
    in_namespace(ns, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .context("cannot start the netlink runtime")?;
        rt.block_on(async {
            let (conn, handle, _) =
                rtnetlink::new_connection().context("cannot open an rtnetlink socket")?;
            tokio::spawn(conn);
            f(handle).await
        })
    })
}

/// The index of link `name` (netlink error if there is none).
async fn index_of(h: &Handle, name: &str) -> Result<u32> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(l.header.index),
        Ok(None) => bail!("no link {name}"),
        Err(e) => bail!("find link {name}: {e}"),
    }
}

/// A named network namespace, deleted (with the interfaces in it) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    file: File,
}

impl Netns {
    /// Creates namespace `name` with `lo` up.
    pub fn new(name: &str) -> Result<Netns> {
        let ns = Netns::create(name)
            .with_context(|| format!("cannot create network namespace {name} (needs root)"))?;
        ns.up("lo")?;
        Ok(ns)
    }

    /// Creates namespace `name` holding TAP `tap` at 10.0.0.1/24 (the
    /// guest is 10.0.0.2), up.
    pub fn with_tap(name: &str, tap: &str) -> Result<Netns> {
        let ns = Netns::new(name)?;
        ns.add_tap(tap, "10.0.0.1/24")?;
        Ok(ns)
    }

    /// Unshares a namespace in a helper thread and binds it on
    /// /run/netns/NAME.
    fn create(name: &str) -> Result<Netns> {
        if name.is_empty() || name.contains(['/', '\0']) || name == "." || name == ".." {
            bail!("'{name}' is not a valid namespace name");
        }
        std::fs::create_dir_all(NETNS_DIR).with_context(|| format!("cannot create {NETNS_DIR}"))?;
        let path = Path::new(NETNS_DIR).join(name);
        std::fs::OpenOptions::new().write(true).create_new(true).open(&path).with_context(
            || format!("cannot create {} (does the namespace exist?)", path.display()),
        )?;
        let bound = std::thread::scope(|s| {
            s.spawn(|| -> Result<()> {
                // SAFETY: unshare with a constant flag; it moves only this
                // helper thread into a new network namespace.
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    bail!("unshare: {}", std::io::Error::last_os_error());
                }
                let src = c"/proc/thread-self/ns/net";
                let dst = CString::new(path.as_os_str().as_encoded_bytes())?;
                // SAFETY: a bind mount between two valid C strings; no data.
                let r = unsafe {
                    libc::mount(
                        src.as_ptr(),
                        dst.as_ptr(),
                        c"none".as_ptr(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    )
                };
                if r != 0 {
                    bail!("bind mount on {}: {}", path.display(), std::io::Error::last_os_error());
                }
                Ok(())
            })
            .join()
            .map_err(|_| anyhow!("the namespace helper thread panicked"))?
        });
        if let Err(e) = bound {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()));
        match file {
            Ok(file) => Ok(Netns { name: name.to_string(), file }),
            Err(e) => {
                delete(name);
                Err(e)
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` in a helper thread inside this namespace (sockets it
    /// opens belong to the namespace).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        in_namespace(&self.file, f)
    }

    /// One configuration step over rtnetlink; an error names the
    /// namespace and `step`.
    fn step<T, F, Fut>(&self, step: &str, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce(Handle) -> Fut + Send,
        Fut: Future<Output = Result<T>>,
    {
        netlink(&self.file, f).with_context(|| format!("network namespace {}: {step}", self.name))
    }

    /// Brings link `dev` up.
    pub fn up(&self, dev: &str) -> Result<()> {
        self.set_link(dev, true)
    }

    /// Takes link `dev` down.
    pub fn down(&self, dev: &str) -> Result<()> {
        self.set_link(dev, false)
    }

    fn set_link(&self, dev: &str, up: bool) -> Result<()> {
        let what = if up { "up" } else { "down" };
        self.step(&format!("set {dev} {what}"), |h| async move {
            let b = LinkUnspec::new_with_name(dev);
            let m = if up { b.up() } else { b.down() }.build();
            h.link().set(m).execute().await.map_err(|e| anyhow!("{e}"))
        })
    }

    /// Adds address `cidr` ("10.0.0.1/24") to link `dev`.
    pub fn addr(&self, dev: &str, cidr: &str) -> Result<()> {
        let (a, p) = parse_cidr(cidr)?;
        self.step(&format!("add address {cidr} to {dev}"), |h| async move {
            let i = index_of(&h, dev).await?;
            h.address().add(i, IpAddr::V4(a), p).execute().await.map_err(|e| anyhow!("{e}"))
        })
    }

    /// Adds a route to `dest` ("10.8.0.0/24") via gateway `via`.
    pub fn route(&self, dest: &str, via: Ipv4Addr) -> Result<()> {
        let (d, p) = parse_cidr(dest)?;
        self.step(&format!("add route {dest} via {via}"), |h| async move {
            let r = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(d, p)
                .gateway(via)
                .build();
            h.route().add(r).execute().await.map_err(|e| anyhow!("{e}"))
        })
    }

    /// Creates a persistent TAP `tap` (down, no address).
    pub fn tap(&self, tap: &str) -> Result<()> {
        self.run_in(|| {
            let t = nl_devices::tap::Tap::open(tap).map_err(|e| anyhow!("{e}"))?;
            // SAFETY: TUNSETPERSIST takes an integer argument on the TAP's
            // descriptor, which `t` holds open.
            if unsafe { libc::ioctl(t.raw_fd(), TUNSETPERSIST as _, 1 as libc::c_ulong) } != 0 {
                bail!("TUNSETPERSIST: {}", std::io::Error::last_os_error());
            }
            Ok(())
        })
        .with_context(|| format!("network namespace {}: create TAP {tap}", self.name))
    }

    /// Adds TAP `tap` with address `cidr`, up.
    pub fn add_tap(&self, tap: &str, cidr: &str) -> Result<()> {
        self.tap(tap)?;
        self.addr(tap, cidr)?;
        self.up(tap)
    }

    /// Creates bridge `name` that forwards without learning delay
    /// (ageing time 0: every frame is flooded), down.
    pub fn bridge(&self, name: &str) -> Result<()> {
        self.step(&format!("add bridge {name}"), |h| async move {
            let m = LinkBridge::new(name).ageing_time(0).build();
            h.link().add(m).execute().await.map_err(|e| anyhow!("{e}"))
        })
    }

    /// Makes link `dev` a port of bridge `bridge`.
    pub fn set_master(&self, dev: &str, bridge: &str) -> Result<()> {
        self.step(&format!("set {dev} master {bridge}"), |h| async move {
            let b = index_of(&h, bridge).await?;
            let m = LinkUnspec::new_with_name(dev).controller(b).build();
            h.link().set(m).execute().await.map_err(|e| anyhow!("{e}"))
        })
    }

    /// A veth pair: `here` in this namespace, `there` moved into `peer`,
    /// both up, with the addresses given (None: no address, e.g. for a
    /// bridge port).
    pub fn veth(
        &self,
        here: (&str, Option<&str>),
        peer: &Netns,
        there: (&str, Option<&str>),
    ) -> Result<()> {
        let (a, b) = (here.0, there.0);
        self.step(&format!("add veth {a}/{b}"), |h| async move {
            h.link().add(LinkVeth::new(a, b).build()).execute().await.map_err(|e| anyhow!("{e}"))
        })?;
        let fd = peer.file.as_raw_fd();
        self.step(&format!("move {b} to namespace {}", peer.name), |h| async move {
            let m = LinkUnspec::new_with_name(b).setns_by_fd(fd).build();
            h.link().set(m).execute().await.map_err(|e| anyhow!("{e}"))
        })?;
        for (ns, (dev, cidr)) in [(self, here), (peer, there)] {
            if let Some(c) = cidr {
                ns.addr(dev, c)?;
            }
            ns.up(dev)?;
        }
        Ok(())
    }

    /// The namespace's file under /run/netns.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// `program` to be started inside this namespace (moved into it with
    /// `setns` before it executes).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let f: OwnedFd = self
            .file
            .try_clone()
            .with_context(|| format!("cannot open network namespace {}", self.name))?
            .into();
        let mut c = Command::new(program);
        // SAFETY: between fork and exec the closure only calls setns(2), an
        // async-signal-safe system call, on a descriptor it keeps open (it
        // owns the fd); it allocates nothing and takes no locks.
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

/// Deletes the named namespace /run/netns/NAME (unmount and remove; the
/// kernel destroys it with its links once no process is left in it).
/// Used on drop and by signal handlers that only know the name.
pub fn delete(name: &str) {
    let path = Path::new(NETNS_DIR).join(name);
    if let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) {
        // SAFETY: umount2 on a valid C string; failure is ignored (the
        // file may not be a mount point if creation failed half-way).
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_file(&path);
}

impl Drop for Netns {
    fn drop(&mut self) {
        delete(&self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::parse_cidr;

    #[test]
    fn cidr_is_address_and_prefix() {
        assert_eq!(parse_cidr("10.0.0.1/24").unwrap(), ("10.0.0.1".parse().unwrap(), 24));
        for bad in ["10.0.0.1", "10.0.0/24", "10.0.0.1/33", "x/1", "10.0.0.1/"] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }
}
