//! Per-sandbox networking: a sandbox's `net` section (TAP, MAC, IPv4)
//! checked and turned into its VM's virtio-net device
//! ([`nl_vmm::NetConfig`]).
//!
//! A sandbox with a `net` section gets a virtio-net device on its own host
//! TAP; the standby of a service ([`crate::service`]) gets a *spare* device
//! under the owner's identity (same MAC and address) with no TAP behind it,
//! until a takeover attaches the owner's TAP. Every VM a sandbox builds
//! after its first has a spare device too: a restart moves the TAP from
//! the old VM to the new one (the same open TAP, never re-opened by name),
//! and a takeover moves it to the standby.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use nl_vmm::NetConfig;

use crate::config::{NetSection, SetConfig};
use crate::SandboxError;

/// A `net` section, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub mac: [u8; 6],
    pub ipv4: [u8; 4],
    pub prefix: u8,
    pub host_ip: Option<([u8; 4], u8)>,
}

/// "52:54:00:12:34:56": six hex octets, unicast (the group bit of the first
/// octet clear) and not all zero.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("'{s}' is not a MAC address like 52:54:00:12:34:56");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(&parts) {
        if p.len() != 2 {
            return Err(bad());
        }
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if mac[0] & 1 != 0 {
        return Err(format!("MAC {s} is a multicast address; a guest needs a unicast one"));
    }
    if mac == [0; 6] {
        return Err(format!("MAC {s} is all zero"));
    }
    Ok(mac)
}

/// "10.0.0.2/24" with a prefix in 1..=30.
pub fn parse_cidr(s: &str) -> Result<([u8; 4], u8), String> {
    let bad = || format!("'{s}' is not an IPv4 address with prefix like 10.0.0.2/24");
    let (a, p) = s.split_once('/').ok_or_else(bad)?;
    let a: Ipv4Addr = a.parse().map_err(|_| bad())?;
    let p: u8 = p.parse().map_err(|_| bad())?;
    if !(1..=30).contains(&p) {
        return Err(format!("'{s}': the prefix must be in 1..=30"));
    }
    Ok((a.octets(), p))
}

/// A TAP interface name the kernel accepts (1..=15 bytes, no '/', blank or
/// NUL).
pub fn check_tap_name(s: &str) -> Result<(), String> {
    if s.is_empty()
        || s.len() >= IFNAMSIZ
        || s.contains(['/', ' ', '\0', '\t', '\n'])
        || s == "."
        || s == ".."
    {
        return Err(format!(
            "'{s}' is not a valid interface name (1 to 15 bytes, no '/' or blanks)"
        ));
    }
    Ok(())
}

/// Linux's interface name buffer, the terminating NUL included.
const IFNAMSIZ: usize = 16;

impl NetSection {
    /// Parses and checks the section.
    pub fn identity(&self) -> Result<Identity, String> {
        match &self.link {
            None => check_tap_name(&self.tap).map_err(|e| format!("net.tap: {e}"))?,
            Some(_) if !self.tap.is_empty() => {
                return Err(
                    "net: give either tap (a TAP of its own) or link (a shared link), not both"
                        .into(),
                )
            }
            Some(_) if self.host_ip.is_some() => {
                return Err(
                    "net.host_ip: a sandbox on a shared link has none; give the link's host_ip"
                        .into(),
                )
            }
            Some(_) => {}
        }
        let mac = parse_mac(&self.mac).map_err(|e| format!("net.mac: {e}"))?;
        let (ipv4, prefix) = parse_cidr(&self.ipv4).map_err(|e| format!("net.ipv4: {e}"))?;
        let host_ip = match &self.host_ip {
            None => None,
            Some(h) => {
                let (h, hp) = parse_cidr(h).map_err(|e| format!("net.host_ip: {e}"))?;
                let net = |a: [u8; 4], p: u8| u32::from_be_bytes(a) >> (32 - u32::from(p));
                if hp != prefix || net(h, hp) != net(ipv4, prefix) || h == ipv4 {
                    return Err(format!(
                        "net.host_ip {} must be another address on net.ipv4 {}'s subnet",
                        self.host_ip.as_deref().unwrap_or(""),
                        self.ipv4
                    ));
                }
                Some((h, hp))
            }
        };
        Ok(Identity { mac, ipv4, prefix, host_ip })
    }

    /// The VM's virtio-net device: on the TAP, or `spare` (no TAP until
    /// one is attached). On a shared link, `tap` is the link's TAP and
    /// the set fills in the port ([`crate::shared_link`]).
    pub fn vm_config(&self, spare: bool) -> Result<NetConfig, String> {
        let id = self.identity()?;
        Ok(NetConfig {
            tap: self.tap.clone(),
            port: None,
            ipv4: id.ipv4,
            prefix: id.prefix,
            rx_irq: self.rx_irq,
            host_ip: if spare { None } else { id.host_ip },
            mac: Some(id.mac),
            spare,
        })
    }
}

/// Checks every `net` section: each parses, no two sandboxes name one TAP,
/// MAC or address, and only netbench or kv sandboxes have one (the guest's
/// services on virtio-net); a netbench or kv sandbox needs one, of its own
/// or as a service's standby.
pub fn validate(c: &SetConfig) -> Result<(), SandboxError> {
    let bad = |m: String| Err(SandboxError::Config(m));
    let mut taps = BTreeMap::new();
    let mut macs = BTreeMap::new();
    let mut ips = BTreeMap::new();
    crate::shared_link::validate(c)?;
    for l in &c.links {
        taps.insert(l.tap.clone(), format!("link {}", l.name));
    }
    for s in &c.sandboxes {
        let kind = s.workload.kind.as_str();
        let served = matches!(kind, "netbench" | "kv");
        let Some(n) = &s.net else {
            if served && !c.services.iter().any(|v| v.standby == s.name) {
                return bad(format!(
                    "sandbox '{}' runs {kind} but has no net section (and is no service's standby)",
                    s.name
                ));
            }
            continue;
        };
        if !served {
            return bad(format!(
                "sandbox '{}': a net section needs the workload netbench or kv, not {kind}",
                s.name
            ));
        }
        let id =
            n.identity().map_err(|e| SandboxError::Config(format!("sandbox '{}': {e}", s.name)))?;
        if n.rx_irq && c.services.iter().any(|v| v.owner == s.name) {
            return bad(format!(
                "sandbox '{}': net.rx_irq is not for a service's owner (its standby's spare device has no TAP to start a receive thread on)",
                s.name
            ));
        }
        if n.rx_irq && s.recovery.policy == crate::config::RecoveryPolicy::Rollback {
            return bad(format!(
                "sandbox '{}': net.rx_irq is not supported with recovery 'rollback'",
                s.name
            ));
        }
        if let Some(l) = &n.link {
            if !c.links.iter().any(|k| &k.name == l) {
                return bad(format!("sandbox '{}': net.link names unknown link '{l}'", s.name));
            }
            if c.services.iter().any(|v| v.owner == s.name) {
                return bad(format!(
                    "sandbox '{}': a service's owner needs a TAP of its own (a takeover moves it), not link '{l}'",
                    s.name
                ));
            }
            if s.recovery.policy == crate::config::RecoveryPolicy::Rollback {
                return bad(format!(
                    "sandbox '{}': a shared link is not supported with recovery 'rollback'",
                    s.name
                ));
            }
        }
        if n.link.is_none() {
            if let Some(other) = taps.insert(n.tap.clone(), s.name.clone()) {
                let who = match other.strip_prefix("link ") {
                    Some(l) => {
                        format!("sandbox '{}' names TAP {}, the TAP of link '{l}'", s.name, n.tap)
                    }
                    None => format!("sandboxes '{other}' and '{}' both name TAP {}", s.name, n.tap),
                };
                return bad(who);
            }
        }
        for (map, key, what) in [
            (&mut macs, n.mac.to_ascii_lowercase(), "MAC"),
            (&mut ips, format!("{:?}", id.ipv4), "address"),
        ] {
            if let Some(other) = map.insert(key, s.name.clone()) {
                return bad(format!(
                    "sandboxes '{other}' and '{}' both name {what} {}",
                    s.name,
                    if what == "MAC" { &n.mac } else { &n.ipv4 }
                ));
            }
        }
    }
    Ok(())
}

/// The virtio-net device of sandbox `name`'s first VM: its own TAP, a
/// spare under its service owner's identity if it is a standby, or none.
pub fn first_vm_net(c: &SetConfig, name: &str) -> Result<Option<NetConfig>, SandboxError> {
    let err = |e: String| SandboxError::Config(format!("sandbox '{name}': {e}"));
    let sb = c.sandboxes.iter().find(|s| s.name == name);
    if let Some(n) = sb.and_then(|s| s.net.as_ref()) {
        let mut v = n.vm_config(false).map_err(err)?;
        if let Some(l) = n.link.as_ref().and_then(|l| c.links.iter().find(|k| &k.name == l)) {
            v.tap = l.tap.clone();
        }
        return Ok(Some(v));
    }
    let Some(v) = c.services.iter().find(|v| v.standby == name) else { return Ok(None) };
    let owner = c.sandboxes.iter().find(|s| s.name == v.owner).and_then(|s| s.net.as_ref());
    match owner {
        Some(n) => n.vm_config(true).map(Some).map_err(err),
        None => Err(err(format!("service '{}': its owner has no net section", v.name))),
    }
}

#[cfg(test)]
mod tests {
    use crate::SetConfig;

    fn set(web_net: &str, spare_extra: &str, services: &str) -> String {
        format!(
            r#"{{"sandboxes": [
                {{"name": "web", "cores": [0], "workload": {{"kind": "netbench"}}, "recovery": {{"policy": "restart"}} {web_net}}},
                {{"name": "spare", "cores": [1], "workload": {{"kind": "netbench"}} {spare_extra}}}
            ], "services": [{services}]}}"#
        )
    }

    const NET: &str =
        r#", "net": {"tap": "t0", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#;
    const SVC: &str = r#"{"name": "echo", "owner": "web", "standby": "spare"}"#;

    fn err(text: &str) -> String {
        match SetConfig::parse(text).and_then(|c| c.validate(2)) {
            Ok(()) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_service_with_its_owners_net_and_a_standby_is_accepted() {
        let c = SetConfig::parse(&set(NET, "", SVC)).unwrap();
        c.validate(2).unwrap();
        let web = super::first_vm_net(&c, "web").unwrap().unwrap();
        let spare = super::first_vm_net(&c, "spare").unwrap().unwrap();
        assert!(!web.spare && spare.spare);
        assert_eq!((web.mac, web.ipv4, web.tap.as_str()), (spare.mac, spare.ipv4, "t0"));
        assert_eq!(web.mac, Some([0x52, 0x54, 0, 0, 0, 2]));
    }

    #[test]
    fn bad_net_sections_and_services_get_clear_errors() {
        let with = |n: &str| set(&format!(r#", "net": {n}"#), "", SVC);
        assert!(err(&with(r#"{"tap": "t0", "mac": "52:54:00:00:00", "ipv4": "10.0.0.2/24"}"#))
            .contains("net.mac: '52:54:00:00:00' is not a MAC address"));
        assert!(err(&with(r#"{"tap": "t0", "mac": "53:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#))
            .contains("multicast"));
        assert!(err(&with(r#"{"tap": "t0", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2"}"#))
            .contains("net.ipv4"));
        assert!(err(&with(r#"{"tap": "t0", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/31"}"#))
            .contains("prefix must be in 1..=30"));
        assert!(err(&with(r#"{"tap": "a/b", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#))
            .contains("not a valid interface name"));
        assert!(err(&with(
            r#"{"tap": "this-name-is-too-long", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24"}"#
        ))
        .contains("not a valid interface name"));
        // Two sandboxes on one TAP.
        let other = r#", "net": {"tap": "t0", "mac": "52:54:00:00:00:03", "ipv4": "10.0.0.3/24"}"#;
        assert!(err(&set(NET, other, "")).contains("sandboxes 'web' and 'spare' both name TAP t0"));
        // Services.
        assert!(err(&set(NET, "", r#"{"name": "e", "owner": "web", "standby": "zz"}"#))
            .contains("unknown sandbox 'zz'"));
        assert!(err(&set(NET, "", r#"{"name": "e", "owner": "web", "standby": "web"}"#))
            .contains("owner and standby are one sandbox"));
        assert!(err(&set("", "", SVC)).contains("no net section"));
        let own = r#", "net": {"tap": "t1", "mac": "52:54:00:00:00:03", "ipv4": "10.0.0.3/24"}"#;
        assert!(err(&set(NET, own, SVC)).contains("has a net section of its own"));
        assert!(err(&set(NET, r#", "recovery": {"policy": "rollback"}"#, SVC))
            .contains("'rollback' cannot hand a service over"));
        let rx = r#", "net": {"tap": "t0", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24", "rx_irq": true}"#;
        assert!(err(&set(rx, "", SVC)).contains("net.rx_irq is not for a service's owner"));
        assert!(err(&set(NET, "", "")).contains("sandbox 'spare' runs netbench but has no net"));
        let compute = set(NET, "", SVC).replace(
            r#""name": "spare", "cores": [1], "workload": {"kind": "netbench"}"#,
            r#""name": "spare", "cores": [1], "workload": {"kind": "kv"}"#,
        );
        assert!(err(&compute).contains("standby 'spare' runs kv, the owner runs netbench"));
    }
}
