//! netbench's network: a ring-3 virtio-net driver (polling, like the block
//! driver) under smoltcp, answering UDP packets to port 7 with their payload.
//! The kv workload's TCP server (`kv.rs`) uses the same driver and the same
//! UDP echo ([`Echo`]).

use core::sync::atomic::{fence, Ordering};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet, SocketStorage};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::socket::udp;
use smoltcp::time::Instant;
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpCidr, Ipv4Address};

use crate::virtio::{get, init_device, notify, put, InitError, F_WRITE, QSIZE};

const HDR: usize = 12;
const BUF: u64 = 2048;
const RXQ: u32 = 0;
const TXQ: u32 = 1;

/// The virtio-net device: receive buffers 0..QSIZE, one transmit buffer.
pub struct NetDev {
    base: u64,
    rxq: u64,
    txq: u64,
    bufs: u64,
    rx_avail: u16,
    rx_used: u16,
    tx_avail: u16,
    pub mac: [u8; 6],
}

fn desc(q: u64, i: u64, addr: u64, len: u32, flags: u16) {
    let d = q + i * 16;
    put(d, addr);
    put(d + 8, len);
    put(d + 12, flags);
    put(d + 14, 0u16);
}

impl NetDev {
    pub fn init(base: u64, rxq: u64, txq: u64, bufs: u64) -> Result<NetDev, InitError> {
        init_device(base, 1, &[rxq, txq])?;
        let mut mac = [0u8; 6];
        for (i, m) in mac.iter_mut().enumerate() {
            // SAFETY: the device's config space is in the user-mapped device page.
            *m = unsafe { core::ptr::read_volatile((base + 0x100 + i as u64) as *const u8) };
        }
        let mut d = NetDev { base, rxq, txq, bufs, rx_avail: 0, rx_used: 0, tx_avail: 0, mac };
        for i in 0..u64::from(QSIZE) {
            desc(rxq, i, bufs + i * BUF, BUF as u32, F_WRITE);
            d.post_rx(i as u16);
        }
        Ok(d)
    }

    fn post_rx(&mut self, id: u16) {
        put(self.rxq + 0x1000 + 4 + 2 * u64::from(self.rx_avail % QSIZE), id);
        self.rx_avail = self.rx_avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        put(self.rxq + 0x1000 + 2, self.rx_avail);
    }

    /// The next received frame: (buffer id, frame length), if any.
    fn next_rx(&mut self, ask: bool) -> Option<(u16, usize)> {
        fence(Ordering::SeqCst);
        if get::<u16>(self.rxq + 0x2000 + 2) == self.rx_used && ask {
            notify(self.base, RXQ);
            fence(Ordering::SeqCst);
        }
        if get::<u16>(self.rxq + 0x2000 + 2) == self.rx_used {
            return None;
        }
        let e = self.rxq + 0x2000 + 4 + 8 * u64::from(self.rx_used % QSIZE);
        let id = get::<u32>(e) as u16 % QSIZE;
        let len = get::<u32>(e + 4) as usize;
        self.rx_used = self.rx_used.wrapping_add(1);
        Some((id, len.saturating_sub(HDR).min(BUF as usize - HDR)))
    }

    /// No received frame waits in the used ring.
    pub fn rx_empty(&self) -> bool {
        fence(Ordering::SeqCst);
        get::<u16>(self.rxq + 0x2000 + 2) == self.rx_used
    }

    /// The used ring's index and the value it has while no frame waits
    /// (for SYS_HALT_IF).
    pub fn rx_watch(&self) -> (u64, u16) {
        (self.rxq + 0x2000 + 2, self.rx_used)
    }

    /// Sends a gratuitous ARP (RFC 5227 2.3) for `ip` from this device's
    /// MAC: neighbours and switches learn that the address is here now.
    pub fn announce(&mut self, ip: [u8; 4]) {
        let mac = self.mac;
        let b = self.tx_buf();
        b[..HDR].fill(0);
        let f = &mut b[HDR..HDR + 42];
        f.fill(0);
        f[0..6].fill(0xff);
        f[6..12].copy_from_slice(&mac);
        f[12..14].copy_from_slice(&[0x08, 0x06]);
        f[14..16].copy_from_slice(&[0, 1]);
        f[16..18].copy_from_slice(&[0x08, 0x00]);
        f[18] = 6;
        f[19] = 4;
        f[20..22].copy_from_slice(&[0, 1]);
        f[22..28].copy_from_slice(&mac);
        f[28..32].copy_from_slice(&ip);
        f[38..42].copy_from_slice(&ip);
        self.send(42);
    }

    fn send(&mut self, len: usize) {
        let buf = self.bufs + u64::from(QSIZE) * BUF;
        desc(self.txq, 0, buf, (HDR + len) as u32, 0);
        put(self.txq + 0x1000 + 4 + 2 * u64::from(self.tx_avail % QSIZE), 0u16);
        self.tx_avail = self.tx_avail.wrapping_add(1);
        fence(Ordering::SeqCst);
        put(self.txq + 0x1000 + 2, self.tx_avail);
        fence(Ordering::SeqCst);
        notify(self.base, TXQ);
    }

    fn tx_buf(&mut self) -> &'static mut [u8] {
        let buf = self.bufs + u64::from(QSIZE) * BUF;
        // SAFETY: the transmit buffer is in the DMA area, used by this driver only,
        // and the device is done with it (transmits complete during the notify).
        unsafe { core::slice::from_raw_parts_mut(buf as *mut u8, BUF as usize) }
    }

    fn rx_buf(&self, id: u16) -> &'static [u8] {
        // SAFETY: receive buffer `id` is in the DMA area and the device has
        // handed it back (it is in the used ring) until it is posted again.
        unsafe {
            core::slice::from_raw_parts(
                (self.bufs + u64::from(id) * BUF) as *const u8,
                BUF as usize,
            )
        }
    }
}

pub struct RxTok<'a> {
    dev: &'a mut NetDev,
    id: u16,
    len: usize,
}
pub struct TxTok<'a> {
    dev: &'a mut NetDev,
}

impl phy::RxToken for RxTok<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        let b = self.dev.rx_buf(self.id);
        let r = f(&b[HDR..HDR + self.len]);
        self.dev.post_rx(self.id);
        r
    }
}

impl phy::TxToken for TxTok<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let len = len.min(BUF as usize - HDR);
        let b = self.dev.tx_buf();
        b[..HDR].fill(0);
        let r = f(&mut b[HDR..HDR + len]);
        self.dev.send(len);
        r
    }
}

/// Whether the virtio-net device at `base` reports its link up (config
/// status, `VIRTIO_NET_S_LINK_UP`): a spare device's link is down until the
/// VMM attaches a TAP.
pub fn link_up(base: u64) -> bool {
    // SAFETY: the device's config space is in the user-mapped device page.
    let status = unsafe { core::ptr::read_volatile((base + 0x100 + 6) as *const u16) };
    status & 1 != 0
}

/// The device as smoltcp sees it; `ask` says whether to ask the VMM for
/// new frames (an exit) when the used ring has none.
pub struct Phy<'a> {
    pub dev: &'a mut NetDev,
    pub ask: bool,
}

impl phy::Device for Phy<'_> {
    type RxToken<'a>
        = RxTok<'a>
    where
        Self: 'a;
    type TxToken<'a>
        = TxTok<'a>
    where
        Self: 'a;

    fn receive(&mut self, _t: Instant) -> Option<(RxTok<'_>, TxTok<'_>)> {
        let (id, len) = self.dev.next_rx(self.ask)?;
        self.ask = false;
        // Two tokens borrowing the one device: split through a raw pointer.
        let p: *mut NetDev = self.dev;
        // SAFETY: smoltcp consumes at most one token at a time and each
        // only touches its own buffer (rx buffer `id`, or the tx buffer).
        unsafe { Some((RxTok { dev: &mut *p, id, len }, TxTok { dev: &mut *p })) }
    }

    fn transmit(&mut self, _t: Instant) -> Option<TxTok<'_>> {
        Some(TxTok { dev: self.dev })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = 1514;
        c.max_burst_size = Some(1);
        c
    }
}

/// The smoltcp interface over `dev` with address `ip/prefix`.
pub fn interface(
    dev: &mut NetDev,
    (ip, prefix): ([u8; 4], u8),
    seed: u64,
    now: Instant,
) -> Interface {
    let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(dev.mac)));
    config.random_seed = seed;
    let mut iface = Interface::new(config, &mut Phy { dev, ask: false }, now);
    iface.update_ip_addrs(|a| {
        let _ = a.push(IpCidr::new(Ipv4Address::from_octets(ip).into(), prefix));
    });
    iface
}

/// The buffers of an [`Echo`] socket: (metadata, payload) for receive and
/// for transmit.
pub type EchoBufs<'s> =
    ((&'s mut [udp::PacketMetadata], &'s mut [u8]), (&'s mut [udp::PacketMetadata], &'s mut [u8]));

/// UDP echo on [`nl_abi::NETBENCH_UDP_PORT`]: netbench's service, and the kv
/// server's too (what an external 1 ms ping probes). Outside any workload
/// digest.
pub struct Echo {
    handle: SocketHandle,
    buf: [u8; 1500],
}

impl Echo {
    /// Adds the echo socket to `sockets`.
    pub fn add<'s>(sockets: &mut SocketSet<'s>, (rx, tx): EchoBufs<'s>) -> Echo {
        let mut s = udp::Socket::new(
            udp::PacketBuffer::new(rx.0, rx.1),
            udp::PacketBuffer::new(tx.0, tx.1),
        );
        let _ = s.bind(nl_abi::NETBENCH_UDP_PORT);
        Echo { handle: sockets.add(s), buf: [0; 1500] }
    }

    /// Queues an answer to every datagram received (after an interface
    /// poll); returns how many. The caller polls again to send them.
    pub fn answer(&mut self, sockets: &mut SocketSet<'_>) -> u64 {
        let s = sockets.get_mut::<udp::Socket>(self.handle);
        let mut n = 0;
        while let Ok((len, meta)) = s.recv_slice(&mut self.buf) {
            if s.send_slice(&self.buf[..len], meta.endpoint).is_ok() {
                n += 1;
            }
        }
        n
    }
}

/// netbench's network service: UDP echo only.
pub struct Stack<'s> {
    pub dev: NetDev,
    iface: Interface,
    sockets: SocketSet<'s>,
    echo: Echo,
}

impl<'s> Stack<'s> {
    pub fn new(
        mut dev: NetDev,
        (ip, prefix): ([u8; 4], u8),
        seed: u64,
        now: Instant,
        storage: &'s mut [SocketStorage<'s>],
        bufs: EchoBufs<'s>,
    ) -> Stack<'s> {
        let iface = interface(&mut dev, (ip, prefix), seed, now);
        let mut sockets = SocketSet::new(storage);
        let echo = Echo::add(&mut sockets, bufs);
        Stack { dev, iface, sockets, echo }
    }

    /// One service pass; returns the packets answered.
    pub fn poll(&mut self, now: Instant) -> u64 {
        let mut phy = Phy { dev: &mut self.dev, ask: true };
        self.iface.poll(now, &mut phy, &mut self.sockets);
        let n = self.echo.answer(&mut self.sockets);
        if n > 0 {
            let mut phy = Phy { dev: &mut self.dev, ask: false };
            self.iface.poll(now, &mut phy, &mut self.sockets);
        }
        n
    }
}
