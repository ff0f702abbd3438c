//! Shared links: one host TAP that several sandboxes are on, each with its
//! own virtio-net device, MAC and address (Quest-V's shared NIC driver,
//! its Fig. 11, and its interrupt multicast, Table 3).
//!
//! The set opens the TAP once and gives every sandbox on the link a
//! *port* ([`nl_devices::tap::Port`]), which stands behind the sandbox's
//! device as its TAP ([`nl_devices::tap::Tap::over_port`]). Its receive
//! side is a packet socket of the member's own on the TAP
//! ([`nl_devices::packet`]): the kernel copies each frame the host sends
//! out of the TAP to every member's socket whose filter accepts it, before
//! tun's transmit, so no thread of ours is on the way in. A member's
//! filter takes only frames the host sends (packet type
//! `PACKET_OUTGOING`: never a frame a member transmitted), of 14 to 1514
//! bytes, and in mode `demux` only those for the member's MAC or a group
//! (broadcast, multicast) address; in mode `multicast` every such frame,
//! and the member's device raises its RX interrupt for it (with
//! `net.rx_irq`) and its guest drops what is not for its MAC (smoltcp's
//! early demultiplexing), as Quest-V multicasts the NIC's interrupt to
//! every sandbox kernel. The TAP's own queue, which nobody reads, has a
//! drop-all filter ([`Tap::drop_host_frames`]). A member's device writes
//! its frames straight to the shared TAP (a second handle on it).
//!
//! Frames between two members of one link are not switched locally: they
//! go into the host through the TAP, as through one NIC. A member's
//! socket whose buffer is full (its guest does not take frames) drops the
//! frame and the kernel counts it, as a full receive ring does. The
//! counters come from the sockets' `PACKET_STATISTICS` (members'
//! deliveries and drops) and from count-only sockets (frames from the
//! host, frames for no member, a multicast member's foreign frames),
//! which hold a frame or two and count the rest as dropped. The link
//! lives as long as the set; a restarted sandbox keeps its port (the TAP
//! stand-in moves from the old VM to the new one, as a TAP of its own
//! does).
//!
//! A warm rejuvenation or a microreboot carries the link: the TAP's
//! descriptor and every socket of the link (members' and count-only) cross
//! exec as they are ([`SharedLink::carried`]), still bound and filtered, so
//! frames the host sends during the pause wait in the members' sockets
//! and the counters go on; the new process checks each inherited socket's
//! filter against the one its role needs ([`SharedLink::adopt`]) and
//! attaches the TAP's drop-all filter again before any member runs. A link
//! whose set is handed over never takes that filter off: only a link that
//! runs in its process (armed) does when it is dropped.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nl_devices::packet::{self, Cond, Filter, PacketSocket};
use nl_devices::tap::{Port, Tap};
use serde::{Deserialize, Serialize};

use crate::config::{LinkConfig, LinkMode, SetConfig};
use crate::SandboxError;

/// Largest frame delivered (Ethernet without offloads, as the device's).
const MAX_FRAME: u32 = 1514;
/// Smallest: an Ethernet header.
const MIN_FRAME: u32 = 14;

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

/// A frame the host sends, of a length a device takes.
fn outgoing() -> Filter {
    Filter::new()
        .len()
        .require(Cond::Ge(MIN_FRAME))
        .refuse(Cond::Gt(MAX_FRAME))
        .pkttype()
        .require(Cond::Eq(u32::from(packet::PACKET_OUTGOING)))
}

/// What member `mac`'s socket takes in `mode`: every outgoing frame
/// (`multicast`), or those for its MAC or a group address (`demux`).
pub fn member_filter(mode: LinkMode, mac: [u8; 6]) -> Filter {
    match mode {
        LinkMode::Multicast => outgoing().accept(),
        LinkMode::Demux => outgoing().byte(0).accept_if(Cond::Set(1)).require_dst(mac).accept(),
    }
}

/// The outgoing unicast frames for another MAC than `mac` (counted for
/// a `multicast` member: its foreign frames).
pub fn foreign_filter(mac: [u8; 6]) -> Filter {
    outgoing().byte(0).refuse(Cond::Set(1)).refuse_dst(mac).accept()
}

/// The outgoing frames no member takes: runts and oversized frames, and
/// in `demux` unicast frames for no member's MAC.
pub fn unknown_filter(mode: LinkMode, macs: &[[u8; 6]]) -> Filter {
    let f = Filter::new()
        .pkttype()
        .require(Cond::Eq(u32::from(packet::PACKET_OUTGOING)))
        .len()
        .accept_unless(Cond::Ge(MIN_FRAME))
        .accept_if(Cond::Gt(MAX_FRAME));
    match mode {
        LinkMode::Multicast => f.drop_all(),
        LinkMode::Demux => {
            macs.iter().fold(f.byte(0).refuse(Cond::Set(1)), |f, &m| f.refuse_dst(m)).accept()
        }
    }
}

/// Counters of one member of a link, summed over the sockets' readings
/// (the kernel resets them on each).
#[derive(Default)]
struct Totals {
    delivered: u64,
    foreign: u64,
    dropped: u64,
}

/// One member's share of a link's counters.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemberReport {
    pub sandbox: String,
    pub mac: String,
    /// Frames from the host the kernel put into the member's socket.
    pub delivered: u64,
    /// Unicast frames for another MAC the link offered the member (mode
    /// `multicast` only).
    pub foreign: u64,
    /// Frames for the member dropped: its socket's buffer was full.
    pub dropped: u64,
}

/// A link's counters (also what a handover record carries of a link
/// besides its descriptors).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LinkReport {
    pub name: String,
    pub tap: String,
    pub mode: LinkMode,
    /// Frames the host sent out of the TAP.
    pub from_tap: u64,
    /// Of those, frames no member took: runts and frames over 1514 bytes,
    /// and in mode `demux` unicast frames for no member's MAC.
    pub unknown: u64,
    pub members: Vec<MemberReport>,
}

struct Member {
    sandbox: String,
    mac: [u8; 6],
    port: Port,
    /// The port's receive side (for its statistics).
    rx: PacketSocket,
    /// Counts the member's foreign frames (mode `multicast`).
    foreign: Option<PacketSocket>,
}

/// An open shared link: its TAP, its members' sockets and the count-only
/// ones. Dropping it takes the TAP's drop-all filter off again.
pub struct SharedLink {
    config: LinkConfig,
    tap: Tap,
    members: Vec<Member>,
    from_tap: PacketSocket,
    unknown: PacketSocket,
    /// Link totals (from the host, unknown) and the members', in order.
    totals: Mutex<((u64, u64), Vec<Totals>)>,
    /// Whether dropping the link takes the TAP's drop-all filter off: only
    /// while the link runs in this process, never once its set was handed
    /// to a new process (which uses the same TAP) nor before a carried
    /// link has started here (the old process may still take it back).
    armed: AtomicBool,
}

impl Drop for SharedLink {
    fn drop(&mut self) {
        // Clears tun's record of the filter, which it may attach again to
        // the next descriptor of a persistent TAP (`keep_host_frames`).
        if self.armed.load(Ordering::SeqCst) {
            self.tap.keep_host_frames();
        }
    }
}

fn mac_text(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// A count-only socket holds at most about this much (the kernel raises
/// it to its minimum, about one frame).
const COUNT_ONLY_RCVBUF: usize = 1;

impl SharedLink {
    /// Opens link `l` of set `c` (its TAP, configured with the link's
    /// host address), a port per member and the count-only sockets, in
    /// the calling thread's network namespace.
    pub fn open(c: &SetConfig, l: &LinkConfig) -> Result<SharedLink, SandboxError> {
        let err = |e: String| SandboxError::Resource(format!("link '{}': {e}", l.name));
        let tap = Tap::open(&l.tap).map_err(err)?;
        if let Some(h) = &l.host_ip {
            let (ip, prefix) = crate::net::parse_cidr(h).map_err(err)?;
            tap.configure_host(ip, prefix).map_err(err)?;
        }
        tap.drop_host_frames().map_err(err)?;
        let ifindex = packet::ifindex(&l.tap)
            .map_err(|e| err(format!("no interface index for TAP {}: {e}", l.tap)))?;
        let sock = |what: &str, f: &Filter, rcvbuf| {
            PacketSocket::open(ifindex, f, rcvbuf)
                .map_err(|e| err(format!("cannot open a packet socket ({what}): {e}")))
        };
        let mut members = Vec::new();
        for s in &c.sandboxes {
            let Some(n) = s.net.as_ref().filter(|n| n.link.as_ref() == Some(&l.name)) else {
                continue;
            };
            let mac = crate::net::parse_mac(&n.mac).map_err(err)?;
            let rx = sock(&s.name, &member_filter(l.mode, mac), None)?;
            let port = Port::new(
                rx.try_clone_fd().map_err(|e| err(format!("cannot share a socket: {e}")))?,
                tap.try_clone_file().map_err(|e| err(format!("cannot share the TAP: {e}")))?,
            );
            let foreign = match l.mode {
                LinkMode::Multicast => {
                    Some(sock("foreign count", &foreign_filter(mac), Some(COUNT_ONLY_RCVBUF))?)
                }
                LinkMode::Demux => None,
            };
            members.push(Member { sandbox: s.name.clone(), mac, port, rx, foreign });
        }
        let host = Filter::new().pkttype().require(Cond::Eq(u32::from(packet::PACKET_OUTGOING)));
        let from_tap = sock("host count", &host.accept(), Some(COUNT_ONLY_RCVBUF))?;
        let macs: Vec<[u8; 6]> = members.iter().map(|m| m.mac).collect();
        let unknown =
            sock("unknown count", &unknown_filter(l.mode, &macs), Some(COUNT_ONLY_RCVBUF))?;
        let totals = Mutex::new(((0, 0), members.iter().map(|_| Totals::default()).collect()));
        Ok(SharedLink {
            config: l.clone(),
            tap,
            members,
            from_tap,
            unknown,
            totals,
            armed: AtomicBool::new(true),
        })
    }

    /// Every socket of the link in the order a handover record lists them:
    /// the members' (in configuration order), in `multicast` mode the
    /// members' foreign counters, then the host count and the unknown
    /// count.
    fn sockets(&self) -> Vec<&PacketSocket> {
        let rx = self.members.iter().map(|m| &m.rx);
        let foreign = self.members.iter().filter_map(|m| m.foreign.as_ref());
        rx.chain(foreign).chain([&self.from_tap, &self.unknown]).collect()
    }

    /// What a handover record holds of the link: the TAP's and every
    /// socket's descriptor (they stay open here), and its counters so far
    /// (read from the kernel now; what the sockets count from here on
    /// moves with them).
    pub fn carried(&self) -> (nl_vmm::carry::LinkRecord, LinkReport) {
        let rec = nl_vmm::carry::LinkRecord {
            tap: self.config.tap.clone(),
            tap_fd: self.tap.raw_fd(),
            sockets: self.sockets().iter().map(|s| s.raw_fd()).collect(),
        };
        (rec, self.report())
    }

    /// Whether dropping the link takes the TAP's drop-all filter off (see
    /// [`SharedLink::adopt`]): off while its set is suspended for a
    /// handover and after, on again if the handover fails or once a
    /// carried link runs.
    pub fn set_armed(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    /// Link `l` of set `c` over what a new process inherited: the TAP (its
    /// interface checked to be the link's), every socket in the order of
    /// [`SharedLink::carried`], each checked to carry exactly the filter
    /// its role needs (a socket of another member, a count-only one or one
    /// without a filter is refused), and the counters so far. The TAP's
    /// drop-all filter is attached again (the same program, replacing the
    /// one the kernel kept: no moment without one). Not armed: dropping it
    /// before [`SharedLink::set_armed`] leaves the TAP as it is, for the old
    /// process that may take the set back.
    pub fn adopt(
        c: &SetConfig,
        l: &LinkConfig,
        inherited: nl_vmm::carry::InheritedLink,
        carried: &LinkReport,
    ) -> Result<SharedLink, SandboxError> {
        let bad = |m: String| SandboxError::Config(format!("carried link '{}': {m}", l.name));
        let nl_vmm::carry::InheritedLink { tap, sockets } = inherited;
        if tap.name() != l.tap || carried.name != l.name || carried.tap != l.tap {
            return Err(bad(format!(
                "the record's link '{}' on TAP {} (descriptor on {}) is not the configured one \
                 on TAP {}",
                carried.name,
                carried.tap,
                tap.name(),
                l.tap
            )));
        }
        if carried.mode != l.mode {
            return Err(bad(format!(
                "mode {:?} in the record, {:?} configured",
                carried.mode, l.mode
            )));
        }
        let mut members = Vec::new();
        for s in &c.sandboxes {
            let Some(n) = s.net.as_ref().filter(|n| n.link.as_ref() == Some(&l.name)) else {
                continue;
            };
            members.push((s.name.clone(), crate::net::parse_mac(&n.mac).map_err(bad)?));
        }
        let named: Vec<&str> = carried.members.iter().map(|m| m.sandbox.as_str()).collect();
        if named != members.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>() {
            return Err(bad(format!(
                "members {named:?} in the record, {:?} configured",
                members.iter().map(|(n, _)| n).collect::<Vec<_>>()
            )));
        }
        // Each socket's role and the filter it must carry, in record order.
        let macs: Vec<[u8; 6]> = members.iter().map(|m| m.1).collect();
        let mut roles: Vec<(String, Filter)> = members
            .iter()
            .map(|(n, mac)| (format!("member '{n}'"), member_filter(l.mode, *mac)))
            .collect();
        if l.mode == LinkMode::Multicast {
            roles.extend(
                members
                    .iter()
                    .map(|(n, mac)| (format!("'{n}' foreign count"), foreign_filter(*mac))),
            );
        }
        let host = Filter::new().pkttype().require(Cond::Eq(u32::from(packet::PACKET_OUTGOING)));
        roles.push(("host count".into(), host.accept()));
        roles.push(("unknown count".into(), unknown_filter(l.mode, &macs)));
        if sockets.len() != roles.len() {
            return Err(bad(format!(
                "{} sockets in the record, the link has {}",
                sockets.len(),
                roles.len()
            )));
        }
        for (i, (sock, (role, filter))) in sockets.iter().zip(&roles).enumerate() {
            match sock.has_filter(filter) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(bad(format!(
                        "socket {i} (descriptor {}) does not carry the {role}'s filter",
                        sock.raw_fd()
                    )))
                }
                Err(e) => {
                    return Err(bad(format!(
                        "socket {i} (descriptor {}): cannot read its filter: {e}",
                        sock.raw_fd()
                    )))
                }
            }
        }
        // The frames nobody reads from the TAP's queue stay dropped (the
        // kernel kept the filter with the TAP; attached again all the same).
        tap.drop_host_frames().map_err(bad)?;
        let mut sockets = sockets.into_iter();
        let mut out = Vec::new();
        for (name, mac) in &members {
            let rx = sockets.next().expect("counted above");
            let port = Port::new(
                rx.try_clone_fd().map_err(|e| bad(format!("cannot share a socket: {e}")))?,
                tap.try_clone_file().map_err(|e| bad(format!("cannot share the TAP: {e}")))?,
            );
            out.push(Member { sandbox: name.clone(), mac: *mac, port, rx, foreign: None });
        }
        if l.mode == LinkMode::Multicast {
            for m in &mut out {
                m.foreign = sockets.next();
            }
        }
        let (Some(from_tap), Some(unknown)) = (sockets.next(), sockets.next()) else {
            unreachable!("counted above");
        };
        let totals = carried
            .members
            .iter()
            .map(|m| Totals { delivered: m.delivered, foreign: m.foreign, dropped: m.dropped })
            .collect();
        Ok(SharedLink {
            config: l.clone(),
            tap,
            members: out,
            from_tap,
            unknown,
            totals: Mutex::new(((carried.from_tap, carried.unknown), totals)),
            armed: AtomicBool::new(false),
        })
    }

    /// Sandbox `name`'s port on the link.
    pub fn port(&self, sandbox: &str) -> Option<Port> {
        self.members.iter().find(|m| m.sandbox == sandbox).map(|m| m.port.clone())
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The counters so far (read from the kernel; a socket that cannot be
    /// read adds nothing).
    pub fn report(&self) -> LinkReport {
        // Frames a socket accepted, including the ones it dropped.
        let seen = |s: &PacketSocket| s.take_stats().map_or(0, |(n, _)| n);
        let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        // Members first: a frame sent meanwhile is then in `from_tap` too,
        // so a member's delivered and dropped never exceed it.
        for (m, mt) in self.members.iter().zip(t.1.iter_mut()) {
            let (n, drops) = m.rx.take_stats().unwrap_or((0, 0));
            mt.delivered += n.saturating_sub(drops);
            mt.dropped += drops;
            mt.foreign += m.foreign.as_ref().map_or(0, seen);
        }
        t.0 .1 += seen(&self.unknown);
        t.0 .0 += seen(&self.from_tap);
        LinkReport {
            name: self.config.name.clone(),
            tap: self.config.tap.clone(),
            mode: self.config.mode,
            from_tap: t.0 .0,
            unknown: t.0 .1,
            members: self
                .members
                .iter()
                .zip(&t.1)
                .map(|(m, mt)| MemberReport {
                    sandbox: m.sandbox.clone(),
                    mac: mac_text(m.mac),
                    delivered: mt.delivered,
                    foreign: mt.foreign,
                    dropped: mt.dropped,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{foreign_filter, member_filter, unknown_filter};
    use crate::config::LinkMode::{Demux, Multicast};
    use crate::SetConfig;
    use nl_devices::packet::{PACKET_BROADCAST, PACKET_HOST, PACKET_OTHERHOST, PACKET_OUTGOING};

    const A: [u8; 6] = [0x52, 0x54, 0, 0, 0, 2];
    const B: [u8; 6] = [0x52, 0x54, 0, 0, 0, 3];
    const C: [u8; 6] = [0x52, 0x54, 0, 0, 0, 4];
    const ALL: [u8; 6] = [0xff; 6];
    const V6: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];

    fn frame(dst: [u8; 6], len: usize) -> Vec<u8> {
        let mut f = vec![0u8; len];
        let n = len.min(6);
        f[..n].copy_from_slice(&dst[..n]);
        f
    }

    /// Whether `f` takes a host-sent frame for `dst` of `len` bytes.
    fn out(f: &nl_devices::packet::Filter, dst: [u8; 6], len: usize) -> bool {
        f.accepts(&frame(dst, len), PACKET_OUTGOING)
    }

    #[test]
    fn demux_takes_its_mac_and_groups_and_multicast_takes_everything_the_host_sends() {
        let d = member_filter(Demux, A);
        assert!(out(&d, A, 60) && out(&d, ALL, 60) && out(&d, V6, 60));
        assert!(!out(&d, B, 60) && !out(&d, C, 60));
        let m = member_filter(Multicast, A);
        assert!(out(&m, A, 60) && out(&m, B, 60) && out(&m, ALL, 60) && out(&m, V6, 60));
        for f in [&d, &m] {
            // Sizes: an Ethernet header to 1514 bytes.
            assert!(out(f, A, 14) && out(f, A, 1514));
            assert!(!out(f, A, 13) && !out(f, A, 1515) && !out(f, A, 0) && !out(f, A, 65535));
            // Never a frame a member transmitted (the host receives it).
            for t in [PACKET_HOST, PACKET_BROADCAST, PACKET_OTHERHOST] {
                for dst in [A, B, ALL] {
                    assert!(!f.accepts(&frame(dst, 60), t));
                }
            }
        }
    }

    #[test]
    fn the_count_only_filters_take_foreign_and_unknown_frames() {
        let f = foreign_filter(A);
        assert!(out(&f, B, 60) && out(&f, C, 60));
        assert!(!out(&f, A, 60) && !out(&f, ALL, 60) && !out(&f, V6, 60));
        assert!(!f.accepts(&frame(B, 60), PACKET_OTHERHOST));
        let u = unknown_filter(Demux, &[A, B]);
        assert!(out(&u, C, 60) && out(&u, A, 13) && out(&u, A, 1515));
        assert!(!out(&u, A, 60) && !out(&u, B, 60) && !out(&u, ALL, 60) && !out(&u, V6, 60));
        assert!(!u.accepts(&frame(C, 60), PACKET_OTHERHOST));
        let u = unknown_filter(Multicast, &[A, B]);
        assert!(out(&u, A, 13) && out(&u, A, 1515));
        assert!(!out(&u, C, 60) && !out(&u, A, 60) && !out(&u, ALL, 60));
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

    /// Runs `f` on a thread of its own in a fresh network namespace (what
    /// it creates there goes with the namespace); None without the right
    /// to make one.
    fn in_own_netns<T: Send>(f: impl FnOnce() -> T + Send) -> Option<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).ok()?;
                Some(f())
            })
            .join()
            .expect("the namespace's thread")
        })
    }

    /// A link carried to a new process is taken over only with its own
    /// sockets in their places: each checked to be a packet socket bound
    /// to the link's TAP and to carry the filter of its role. Both modes,
    /// on a TAP in a namespace of the test's own.
    #[test]
    fn a_carried_link_is_adopted_only_with_each_socket_in_its_place() {
        use nl_devices::packet::{ifindex, PacketSocket};
        use nl_vmm::carry::{inherit, InheritedLink, LinkRecord, SetRecord};
        for mode in ["demux", "multicast"] {
            let ran = in_own_netns(|| {
                let lan = format!(r#"{{"name": "lan", "tap": "nlcarry0", "mode": "{mode}"}}"#);
                let c = SetConfig::parse(&set(&lan, A_NET, B_NET)).unwrap();
                let link = super::SharedLink::open(&c, &c.links[0]).expect("the link");
                let (rec, counts) = link.carried();
                let roles = if mode == "demux" { 4 } else { 6 };
                assert_eq!(rec.sockets.len(), roles, "{mode}: members, foreign, host, unknown");
                // What a new process inherits: the same sockets under other
                // descriptor numbers.
                let inherited = |r: &LinkRecord| -> Result<InheritedLink, String> {
                    let dup = |fd: i32| nix::unistd::dup(fd).expect("dup");
                    let r = LinkRecord {
                        tap: r.tap.clone(),
                        tap_fd: dup(r.tap_fd),
                        sockets: r.sockets.iter().map(|&f| dup(f)).collect(),
                    };
                    let mut set = SetRecord::new("s", serde_json::json!({}));
                    set.carry_shared(vec![r], Vec::new());
                    let v = serde_json::to_value(set).unwrap();
                    let mut taken = std::collections::BTreeSet::new();
                    inherit(&v, &mut taken)
                        .map(|mut s| s.links.remove(0))
                        .map_err(|e| e.to_string())
                };
                let adopt = |r: &LinkRecord| {
                    inherited(r).and_then(|i| {
                        super::SharedLink::adopt(&c, &c.links[0], i, &counts)
                            .map_err(|e| e.to_string())
                    })
                };
                let back = adopt(&rec).unwrap_or_else(|e| panic!("{mode}: {e}"));
                assert!(back.port("a").is_some() && back.port("b").is_some());
                assert_eq!(back.report().members.len(), 2);
                drop(back);
                let refused = |r: LinkRecord, want: &str| {
                    let e = adopt(&r).err().unwrap_or_else(|| panic!("{mode}: accepted {r:?}"));
                    assert!(e.contains(want), "{mode}: {e}");
                };
                // Two members' sockets swapped (in `multicast` mode their
                // filters are one program, every frame for every member:
                // interchangeable, so taken); a count-only socket in a
                // member's place; one missing.
                let mut r = rec.clone();
                r.sockets.swap(0, 1);
                if mode == "demux" {
                    refused(r, "socket 0 (descriptor");
                } else {
                    assert!(adopt(&r).is_ok(), "{mode}: swapped members refused");
                }
                let mut r = rec.clone();
                r.sockets.swap(1, roles - 1);
                refused(r, "does not carry the member 'b''s filter");
                let mut r = rec.clone();
                r.sockets.pop();
                refused(r, &format!("{} sockets in the record, the link has {roles}", roles - 1));
                // A packet socket with the right filter on another interface.
                let a = crate::net::parse_mac("52:54:00:00:00:02").unwrap();
                let lo = ifindex("lo").unwrap();
                let filter = super::member_filter(c.links[0].mode, a);
                let on_lo = PacketSocket::open(lo, &filter, Some(1)).unwrap();
                let mut r = rec.clone();
                r.sockets[0] = on_lo.raw_fd();
                refused(r, &format!("bound to interface {lo}"));
                // The TAP where a socket should be, and a socket for the TAP.
                let mut r = rec.clone();
                r.sockets[0] = rec.tap_fd;
                refused(r, "not a socket");
                let mut r = rec.clone();
                r.tap_fd = rec.sockets[0];
                refused(r, "not an attached TAP");
            });
            if ran.is_none() {
                return;
            }
        }
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
