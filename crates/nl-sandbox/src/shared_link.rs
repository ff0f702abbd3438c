//! Shared links: one host TAP that several sandboxes are on, each with its
//! own virtio-net device, MAC and address (Quest-V's shared NIC driver,
//! its Fig. 11, and its interrupt multicast, Table 3).
//!
//! The set opens the TAP once and gives every sandbox on the link a
//! *port*: a connected pair of datagram sockets (one frame per datagram),
//! whose guest end stands behind the sandbox's device as its TAP
//! ([`nl_devices::tap::Tap::over_port`]). One host thread per link
//! (`link-NAME`) moves the frames from the TAP to the ports: in mode
//! `demux` by destination MAC (a frame for no member's MAC is dropped and
//! counted; a broadcast or multicast frame goes to every member); in mode
//! `multicast` every frame to every member, whose device then raises its
//! RX interrupt (with `net.rx_irq`) and whose guest drops what is not for
//! its MAC (smoltcp's early demultiplexing), as Quest-V multicasts the
//! NIC's interrupt to every sandbox kernel. A member's device writes its
//! frames straight to the shared TAP (a second handle on it), so sending
//! costs no hop through the thread.
//!
//! Frames between two members of one link are not switched locally: they
//! go out on the TAP, as through one NIC. A port whose socket is full
//! (its guest does not take frames) drops the frame and counts it, as a
//! full receive ring does. The link and its thread live as long as the
//! set; a restarted sandbox keeps its port (the TAP stand-in moves from
//! the old VM to the new one, as a TAP of its own does). A set with a link
//! is not carried across a rejuvenation or a microreboot.

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;

use nl_devices::tap::{Port, Tap};
use serde::Serialize;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::config::{LinkConfig, LinkMode, SetConfig};
use crate::SandboxError;

/// Largest frame moved (Ethernet without offloads, as the device's).
const MAX_FRAME: usize = 1514;
/// Frames moved per wake-up (then `quit` is checked again).
const BATCH: usize = 64;
/// The epoll token of the TAP.
const TAP_TOKEN: u64 = 0;

/// Checks the set's `links`: names and TAPs unique and valid, a host
/// address that parses, at least one sandbox on each, and each member's
/// address on the host address's subnet.
pub fn validate(c: &SetConfig) -> Result<(), SandboxError> {
    let bad = |m: String| Err(SandboxError::Config(m));
    let mut names = BTreeMap::new();
    let mut taps = BTreeMap::new();
    for l in &c.links {
        if l.name.is_empty()
            || l.name.len() > 32
            || !l.name.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
        {
            return bad(format!(
                "link '{}': a name is 1 to 32 letters, digits, '-' or '_'",
                l.name
            ));
        }
        crate::net::check_tap_name(&l.tap)
            .map_err(|e| SandboxError::Config(format!("link '{}': tap: {e}", l.name)))?;
        if names.insert(l.name.clone(), ()).is_some() {
            return bad(format!("two links are named '{}'", l.name));
        }
        if let Some(other) = taps.insert(l.tap.clone(), l.name.clone()) {
            return bad(format!("links '{other}' and '{}' both name TAP {}", l.name, l.tap));
        }
        let host =
            match &l.host_ip {
                Some(h) => Some(crate::net::parse_cidr(h).map_err(|e| {
                    SandboxError::Config(format!("link '{}': host_ip: {e}", l.name))
                })?),
                None => None,
            };
        let members: Vec<_> = c
            .sandboxes
            .iter()
            .filter_map(|s| s.net.as_ref().map(|n| (s, n)))
            .filter(|(_, n)| n.link.as_ref() == Some(&l.name))
            .collect();
        if members.is_empty() {
            return bad(format!("link '{}' has no sandbox on it (net.link)", l.name));
        }
        for (s, n) in members {
            // The member's own section is checked in `net::validate`.
            let Ok((ip, prefix)) = crate::net::parse_cidr(&n.ipv4) else { continue };
            if let Some((h, hp)) = host {
                let net = |a: [u8; 4], p: u8| u32::from_be_bytes(a) >> (32 - u32::from(p));
                if hp != prefix || net(h, hp) != net(ip, prefix) || h == ip {
                    return bad(format!(
                        "sandbox '{}': net.ipv4 {} must be another address on link '{}''s subnet {}",
                        s.name,
                        n.ipv4,
                        l.name,
                        l.host_ip.as_deref().unwrap_or("")
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Counters of one member of a link.
#[derive(Default)]
struct MemberCounters {
    /// Frames from the TAP put into the member's port.
    delivered: AtomicU64,
    /// Of those, unicast frames for another MAC (mode `multicast` only).
    foreign: AtomicU64,
    /// Frames for the member dropped: its port was full.
    dropped: AtomicU64,
}

#[derive(Default)]
struct LinkCounters {
    from_tap: AtomicU64,
    /// Unicast frames from the TAP for no member's MAC (mode `demux`),
    /// and runt or oversized frames.
    unknown: AtomicU64,
}

/// One member's share of a link's counters.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct MemberReport {
    pub sandbox: String,
    pub mac: String,
    pub delivered: u64,
    pub foreign: u64,
    pub dropped: u64,
}

/// A link's counters.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LinkReport {
    pub name: String,
    pub tap: String,
    pub mode: LinkMode,
    pub from_tap: u64,
    pub unknown: u64,
    /// CPU time of the link's thread so far (ms).
    pub thread_cpu_ms: f64,
    pub members: Vec<MemberReport>,
}

struct Member {
    sandbox: String,
    mac: [u8; 6],
    port: Port,
    counters: Arc<MemberCounters>,
}

/// An open shared link and its thread (ended and joined on drop).
pub struct SharedLink {
    config: LinkConfig,
    members: Vec<Member>,
    counters: Arc<LinkCounters>,
    quit: Arc<AtomicBool>,
    /// The thread's id once it runs (0 before).
    tid: Arc<std::sync::atomic::AtomicI32>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for SharedLink {
    fn drop(&mut self) {
        self.quit.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn mac_text(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

impl SharedLink {
    /// Opens link `l` of set `c` (its TAP, configured with the link's
    /// host address), a port per member, and starts its thread.
    pub fn open(c: &SetConfig, l: &LinkConfig) -> Result<SharedLink, SandboxError> {
        let err = |e: String| SandboxError::Resource(format!("link '{}': {e}", l.name));
        let tap = Tap::open(&l.tap).map_err(err)?;
        if let Some(h) = &l.host_ip {
            let (ip, prefix) = crate::net::parse_cidr(h).map_err(err)?;
            tap.configure_host(ip, prefix).map_err(err)?;
        }
        let mut members = Vec::new();
        let mut host_ends = Vec::new();
        for s in &c.sandboxes {
            let Some(n) = s.net.as_ref().filter(|n| n.link.as_ref() == Some(&l.name)) else {
                continue;
            };
            let mac = crate::net::parse_mac(&n.mac).map_err(err)?;
            let (guest, host) =
                UnixDatagram::pair().map_err(|e| err(format!("cannot create a port: {e}")))?;
            host.set_nonblocking(true).map_err(|e| err(e.to_string()))?;
            host_ends.push(host);
            members.push(Member {
                sandbox: s.name.clone(),
                mac,
                port: Port::new(
                    guest,
                    tap.try_clone_file().map_err(|e| err(format!("cannot share the TAP: {e}")))?,
                ),
                counters: Arc::default(),
            });
        }
        let epoll = Epoll::new().map_err(|e| err(format!("epoll: {e}")))?;
        let add = |fd, token| {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token))
                .map_err(|e| err(format!("epoll: {e}")))
        };
        add(tap.raw_fd(), TAP_TOKEN)?;
        let quit = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(LinkCounters::default());
        let mut name = format!("link-{}", l.name);
        name.truncate(15);
        let ctx = Mover {
            mode: l.mode,
            tap,
            ports: host_ends,
            macs: members.iter().map(|m| m.mac).collect(),
            member: members.iter().map(|m| m.counters.clone()).collect(),
            link: counters.clone(),
            buf: vec![0; MAX_FRAME + 1],
        };
        let q = quit.clone();
        let tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let t = tid.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                t.store(nl_sync::tid(), Relaxed);
                ctx.run(&epoll, &q)
            })
            .map_err(|e| err(format!("cannot start its thread: {e}")))?;
        Ok(SharedLink { config: l.clone(), members, counters, quit, tid, thread: Some(thread) })
    }

    /// Sandbox `name`'s port on the link.
    pub fn port(&self, sandbox: &str) -> Option<Port> {
        self.members.iter().find(|m| m.sandbox == sandbox).map(|m| m.port.clone())
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn report(&self) -> LinkReport {
        LinkReport {
            name: self.config.name.clone(),
            tap: self.config.tap.clone(),
            mode: self.config.mode,
            from_tap: self.counters.from_tap.load(Relaxed),
            unknown: self.counters.unknown.load(Relaxed),
            thread_cpu_ms: crate::periodic::thread_cpu_ns(self.tid.load(Relaxed))
                .map_or(0.0, |ns| ns as f64 / 1e6),
            members: self
                .members
                .iter()
                .map(|m| MemberReport {
                    sandbox: m.sandbox.clone(),
                    mac: mac_text(m.mac),
                    delivered: m.counters.delivered.load(Relaxed),
                    foreign: m.counters.foreign.load(Relaxed),
                    dropped: m.counters.dropped.load(Relaxed),
                })
                .collect(),
        }
    }
}

/// The link thread's state.
struct Mover {
    mode: LinkMode,
    tap: Tap,
    ports: Vec<UnixDatagram>,
    macs: Vec<[u8; 6]>,
    member: Vec<Arc<MemberCounters>>,
    link: Arc<LinkCounters>,
    buf: Vec<u8>,
}

/// Whether a frame for `dst` goes to member `mac` in `mode` (and whether
/// it is foreign to it: unicast for another MAC).
pub fn route(mode: LinkMode, dst: [u8; 6], mac: [u8; 6]) -> (bool, bool) {
    let group = dst[0] & 1 != 0;
    let foreign = !group && dst != mac;
    match mode {
        LinkMode::Demux => (!foreign, false),
        LinkMode::Multicast => (true, foreign),
    }
}

impl Mover {
    fn run(mut self, epoll: &Epoll, quit: &AtomicBool) {
        let mut events = [EpollEvent::default(); 1];
        while !quit.load(Relaxed) {
            // Bounded waits, so `quit` is seen within 10 ms.
            let n = match epoll.wait(10, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
            };
            if events[..n].iter().any(|e| e.data() == TAP_TOKEN) {
                self.move_arrivals();
            }
        }
    }

    fn move_arrivals(&mut self) {
        for _ in 0..BATCH {
            let len = match self.tap.recv(&mut self.buf) {
                Ok(Some(n)) => n,
                _ => return,
            };
            self.link.from_tap.fetch_add(1, Relaxed);
            if !(14..=MAX_FRAME).contains(&len) {
                self.link.unknown.fetch_add(1, Relaxed);
                continue;
            }
            let mut dst = [0u8; 6];
            dst.copy_from_slice(&self.buf[..6]);
            let mut taken = false;
            for (i, port) in self.ports.iter().enumerate() {
                let (to, foreign) = route(self.mode, dst, self.macs[i]);
                if !to {
                    continue;
                }
                taken = true;
                let c = &self.member[i];
                if port.send(&self.buf[..len]).is_ok() {
                    c.delivered.fetch_add(1, Relaxed);
                    if foreign {
                        c.foreign.fetch_add(1, Relaxed);
                    }
                } else {
                    c.dropped.fetch_add(1, Relaxed);
                }
            }
            if !taken {
                self.link.unknown.fetch_add(1, Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::route;
    use crate::config::LinkMode::{Demux, Multicast};
    use crate::SetConfig;

    const A: [u8; 6] = [0x52, 0x54, 0, 0, 0, 2];
    const B: [u8; 6] = [0x52, 0x54, 0, 0, 0, 3];

    #[test]
    fn demux_routes_by_mac_and_multicast_to_everyone() {
        assert_eq!(route(Demux, A, A), (true, false));
        assert_eq!(route(Demux, B, A), (false, false));
        assert_eq!(route(Demux, [0xff; 6], A), (true, false));
        assert_eq!(route(Demux, [0x33, 0x33, 0, 0, 0, 1], A), (true, false));
        assert_eq!(route(Multicast, A, A), (true, false));
        assert_eq!(route(Multicast, B, A), (true, true));
        assert_eq!(route(Multicast, [0xff; 6], A), (true, false));
    }

    fn set(links: &str, a_net: &str, b_net: &str) -> String {
        format!(
            r#"{{"links": [{links}], "sandboxes": [
                {{"name": "a", "cores": [0], "workload": {{"kind": "netbench"}}, "net": {a_net}}},
                {{"name": "b", "cores": [1], "workload": {{"kind": "netbench"}}, "net": {b_net}}}
            ]}}"#
        )
    }

    fn err(text: &str) -> String {
        match SetConfig::parse(text).and_then(|c| c.validate(2)) {
            Ok(()) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        }
    }

    const LAN: &str =
        r#"{"name": "lan", "tap": "nltap0", "mode": "multicast", "host_ip": "10.0.0.1/24"}"#;
    const A_NET: &str = r#"{"link": "lan", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#;
    const B_NET: &str = r#"{"link": "lan", "mac": "52:54:00:00:00:03", "ipv4": "10.0.0.3/24"}"#;

    #[test]
    fn two_sandboxes_on_one_link_are_accepted_with_the_links_tap() {
        let c = SetConfig::parse(&set(LAN, A_NET, B_NET)).unwrap();
        c.validate(2).unwrap();
        assert_eq!(c.links[0].mode, Multicast);
        let a = crate::net::first_vm_net(&c, "a").unwrap().unwrap();
        assert_eq!((a.tap.as_str(), a.host_ip, a.spare), ("nltap0", None, false));
        let demux = set(r#"{"name": "lan", "tap": "nltap0"}"#, A_NET, B_NET);
        assert_eq!(SetConfig::parse(&demux).unwrap().links[0].mode, Demux);
    }

    #[test]
    fn bad_links_get_clear_errors() {
        assert!(err(&set(LAN, A_NET, &B_NET.replace("lan", "wan")))
            .contains("sandbox 'b': net.link names unknown link 'wan'"));
        assert!(err(&set(LAN, A_NET, &B_NET.replace(":03", ":02")))
            .contains("both name MAC 52:54:00:00:00:02"));
        assert!(err(&set(LAN, A_NET, &B_NET.replace("10.0.0.3", "10.0.0.2")))
            .contains("both name address 10.0.0.2/24"));
        assert!(err(&set(LAN, A_NET, &B_NET.replace("10.0.0.3", "10.0.1.3")))
            .contains("must be another address on link 'lan''s subnet"));
        assert!(
            err(&set(&format!("{LAN}, {LAN}"), A_NET, B_NET)).contains("two links are named 'lan'")
        );
        let other = r#"{"name": "wan", "tap": "nltap0"}"#;
        assert!(err(&set(&format!("{LAN}, {other}"), A_NET, B_NET))
            .contains("links 'lan' and 'wan' both name TAP nltap0"));
        // A sandbox with a TAP of its own on the link's TAP.
        let own = r#"{"tap": "nltap0", "mac": "52:54:00:00:00:03", "ipv4": "10.0.0.3/24"}"#;
        assert!(err(&set(LAN, A_NET, own)).contains("TAP nltap0"));
        let both = B_NET.replace(r#""link""#, r#""tap": "t1", "link""#);
        assert!(err(&set(LAN, A_NET, &both)).contains("either tap"));
        let host = B_NET.replace(r#""link""#, r#""host_ip": "10.0.0.1/24", "link""#);
        assert!(err(&set(LAN, A_NET, &host)).contains("the link's host_ip"));
        let a_own = r#"{"tap": "t1", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#;
        let b_own = r#"{"tap": "t2", "mac": "52:54:00:00:00:03", "ipv4": "10.0.0.3/24"}"#;
        assert!(err(&set(LAN, a_own, b_own)).contains("link 'lan' has no sandbox on it"));
        assert!(err(&set(&LAN.replace("multicast", "broadcast"), A_NET, B_NET))
            .contains("unknown variant"));
    }
}
