//! The lab's network-namespace helper (rtnetlink, setns): namespaces,
//! veth pairs moved between them, addresses, links up and down, routes,
//! bridges and TAPs, checked by traffic between namespaces and by iproute2
//! as an independent reader; and errors that name the failed step.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use nl_lab::netns::Netns;

/// False (SKIPPED on stderr; a failure under NINELIVES_REQUIRE_NETNS=1)
/// where namespaces cannot be made.
fn available() -> bool {
    let Some(why) = nl_lab::netns::unavailable() else { return true };
    let test = std::thread::current().name().unwrap_or("?").to_string();
    if std::env::var("NINELIVES_REQUIRE_NETNS").is_ok_and(|v| v == "1") {
        panic!("NINELIVES_REQUIRE_NETNS=1 but {test} cannot run: {why}");
    }
    let line = format!("\n*** SKIPPED {test}: {why}; set NINELIVES_REQUIRE_NETNS=1 to fail ***\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    false
}

fn name(tag: &str) -> String {
    format!("nl-labt-{tag}-{}", std::process::id())
}

/// Connects (bounded: 2 s) from inside `ns` to `to` and reads one byte.
fn fetch_byte(ns: &Netns, to: SocketAddr) -> anyhow::Result<u8> {
    ns.run_in(|| {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        Ok(b[0])
    })
}

#[test]
fn veth_addresses_and_a_route_carry_traffic_between_namespaces() {
    if !available() {
        return;
    }
    let a = Netns::new(&name("a")).unwrap();
    let b = Netns::new(&name("b")).unwrap();
    a.veth(("nlta0", Some("10.9.0.1/24")), &b, ("nltb0", Some("10.9.0.2/24"))).unwrap();
    // A server in A on an address outside the veth's subnet: B reaches it
    // only through a route.
    a.addr("lo", "10.77.0.1/32").unwrap();
    let listener: TcpListener = a.run_in(|| Ok(TcpListener::bind("10.77.0.1:0")?)).unwrap();
    let to = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        if let Ok((mut c, _)) = listener.accept() {
            let _ = c.write_all(b"!");
        }
    });
    // On the veth's own subnet first (address, move and link up worked).
    let direct: TcpListener = a.run_in(|| Ok(TcpListener::bind("10.9.0.1:0")?)).unwrap();
    let dto = direct.local_addr().unwrap();
    let dserver = std::thread::spawn(move || {
        if let Ok((mut c, _)) = direct.accept() {
            let _ = c.write_all(b"?");
        }
    });
    assert_eq!(fetch_byte(&b, dto).expect("B reaches A over the veth"), b'?');
    let e = fetch_byte(&b, to).expect_err("no route yet");
    assert!(format!("{e:#}").contains("unreachable"), "without the route: {e:#}");
    b.route("10.77.0.0/24", Ipv4Addr::new(10, 9, 0, 1)).unwrap();
    assert_eq!(fetch_byte(&b, to).expect("B reaches A's 10.77.0.1 by the route"), b'!');
    // Link down cuts it.
    a.down("nlta0").unwrap();
    assert!(fetch_byte(&b, dto).is_err(), "the veth is down");
    drop((a, b));
    let _ = server.join();
    let _ = dserver.join();
}

#[test]
fn bridge_tap_and_names_are_seen_by_iproute2_and_deleted_on_drop() {
    if !available() {
        return;
    }
    let n = name("br");
    let ns = Netns::new(&n).unwrap();
    ns.bridge("nlbr0").unwrap();
    ns.up("nlbr0").unwrap();
    ns.add_tap("nltap9", "10.5.0.1/24").unwrap();
    ns.set_master("nltap9", "nlbr0").unwrap();
    // iproute2 finds the namespace by name (the bind mount under
    // /run/netns) and sees the TAP, its master and its address.
    let o = Command::new("ip").args(["-n", &n, "-o", "link", "show", "nltap9"]).output();
    match o {
        Ok(o) => {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "ip -n {n}: {}", String::from_utf8_lossy(&o.stderr));
            assert!(out.contains("master nlbr0"), "{out}");
            let a = Command::new("ip").args(["-n", &n, "-o", "addr", "show", "nltap9"]).output();
            let a = String::from_utf8_lossy(&a.unwrap().stdout).to_string();
            assert!(a.contains("10.5.0.1/24"), "{a}");
        }
        Err(e) => eprintln!("\n*** SKIPPED the iproute2 cross-check: cannot run ip ({e}) ***\n"),
    }
    let path = ns.path();
    assert!(path.exists());
    drop(ns);
    assert!(!path.exists(), "{} is left after drop", path.display());
}

#[test]
fn a_failed_step_names_the_namespace_the_step_and_the_netlink_error() {
    if !available() {
        return;
    }
    let n = name("err");
    let ns = Netns::new(&n).unwrap();
    let e = format!("{:#}", ns.addr("nosuch0", "10.1.1.1/24").unwrap_err());
    assert!(e.contains(&n) && e.contains("add address 10.1.1.1/24 to nosuch0"), "{e}");
    assert!(e.contains("nosuch0"), "{e}");
    ns.bridge("nlbr1").unwrap();
    let e = format!("{:#}", ns.bridge("nlbr1").unwrap_err());
    assert!(e.contains("add bridge nlbr1") && e.contains("File exists"), "{e}");
    let e = format!("{:#}", Netns::new(&n).unwrap_err());
    assert!(e.contains(&n) && e.contains("exist"), "a second namespace of the same name: {e}");
    let e = format!("{:#}", ns.addr("lo", "10.1.1.1").unwrap_err());
    assert!(e.contains("ADDRESS/PREFIX"), "{e}");
}
