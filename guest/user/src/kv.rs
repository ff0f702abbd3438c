//! The kv workload's server: the key-value protocol of `nl_workloads::kv`
//! over smoltcp TCP sockets on [`nl_abi::KV_TCP_PORT`], on the polling
//! virtio-net driver of `net.rs`. [`CONNS`] sockets listen on the port, so
//! that many clients can be connected at once; a closed connection's
//! socket listens again. A PUT's `OK` is queued only after the table (in
//! the working set) holds the value. The server also answers UDP echo on
//! port 7 (netbench's [`Echo`]), for an external ping; the echo touches
//! neither the table nor the counts of requests.

use nl_workloads::kv::{serve, LineBuf, Served, Table, MAX_RESPONSE, TOO_LONG};
use smoltcp::iface::{Interface, SocketHandle, SocketSet, SocketStorage};
use smoltcp::socket::tcp::{self, State};
use smoltcp::time::Instant;

use crate::net::{interface, Echo, EchoBufs, NetDev, Phy};

/// Concurrent connections served.
pub const CONNS: usize = 16;
/// Sockets: the TCP connections and the UDP echo.
pub const SOCKETS: usize = CONNS + 1;
/// Receive and send buffer bytes per connection.
pub const SOCK_BUF: usize = 8192;

/// Requests served, by kind; UDP echoes answered.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub puts: u64,
    pub gets: u64,
    pub other: u64,
    pub errors: u64,
    pub connections: u64,
    /// UDP echo datagrams answered (not requests).
    pub echoes: u64,
}

pub struct Server<'s> {
    pub dev: NetDev,
    iface: Interface,
    sockets: SocketSet<'s>,
    handles: [SocketHandle; CONNS],
    lines: [LineBuf; CONNS],
    active: [bool; CONNS],
    echo: Echo,
    pub table: Table<'s>,
    pub counts: Counts,
}

impl<'s> Server<'s> {
    /// `bufs` holds the TCP sockets' buffers (at least 2 * CONNS * SOCK_BUF
    /// bytes), `echo` the UDP echo socket's.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mut dev: NetDev,
        addr: ([u8; 4], u8),
        seed: u64,
        now: Instant,
        storage: &'s mut [SocketStorage<'s>; SOCKETS],
        bufs: &'s mut [u8],
        echo: EchoBufs<'s>,
        table: Table<'s>,
    ) -> Option<Server<'s>> {
        let iface = interface(&mut dev, addr, seed, now);
        let mut sockets = SocketSet::new(&mut storage[..]);
        let mut chunks = bufs.chunks_exact_mut(SOCK_BUF);
        let mut handles = [SocketHandle::default(); CONNS];
        for h in handles.iter_mut() {
            let rx = chunks.next()?;
            let tx = chunks.next()?;
            let mut s = tcp::Socket::new(tcp::SocketBuffer::new(rx), tcp::SocketBuffer::new(tx));
            s.set_nagle_enabled(false);
            s.listen(nl_abi::KV_TCP_PORT).ok()?;
            *h = sockets.add(s);
        }
        let echo = Echo::add(&mut sockets, echo);
        Some(Server {
            dev,
            iface,
            sockets,
            handles,
            lines: [const { LineBuf::new() }; CONNS],
            active: [false; CONNS],
            echo,
            table,
            counts: Counts::default(),
        })
    }

    /// One service pass: moves frames, serves every complete request line
    /// whose response fits in its socket's send buffer, re-listens on closed
    /// sockets, answers UDP echo. Returns the requests served plus the
    /// echoes answered.
    pub fn poll(&mut self, now: Instant) -> u64 {
        let mut phy = Phy { dev: &mut self.dev, ask: true };
        self.iface.poll(now, &mut phy, &mut self.sockets);
        let echoes = self.echo.answer(&mut self.sockets);
        self.counts.echoes += echoes;
        let mut served = echoes;
        for i in 0..CONNS {
            let s = self.sockets.get_mut::<tcp::Socket>(self.handles[i]);
            if !s.is_open() {
                // Closed (by either side, or reset): listen for the next client.
                self.lines[i].clear();
                self.active[i] = false;
                let _ = s.listen(nl_abi::KV_TCP_PORT);
                continue;
            }
            if s.is_active() && !self.active[i] {
                self.active[i] = true;
                self.counts.connections += 1;
            }
            // Bounded: each pass takes at least one byte from the receive buffer.
            for _ in 0..SOCK_BUF {
                if !s.can_recv() || s.send_capacity() - s.send_queue() < MAX_RESPONSE {
                    break;
                }
                let line = &mut self.lines[i];
                let Ok((_, done)) = s.recv(|b| {
                    let r = line.feed(b);
                    (r.0, r)
                }) else {
                    break;
                };
                if !done {
                    continue;
                }
                let mut out = [0u8; MAX_RESPONSE];
                let (n, what) = match line.take_line() {
                    Some(l) => serve(&mut self.table, l, &mut out),
                    None => {
                        out[..TOO_LONG.len()].copy_from_slice(TOO_LONG);
                        (TOO_LONG.len(), Served::Error)
                    }
                };
                match what {
                    Served::Put => self.counts.puts += 1,
                    Served::Get => self.counts.gets += 1,
                    Served::Digest => self.counts.other += 1,
                    Served::Error => self.counts.errors += 1,
                }
                // Fits: the free space was checked above.
                let _ = s.send_slice(&out[..n]);
                served += 1;
            }
            if s.state() == State::CloseWait && !s.can_recv() {
                // The client is done sending: finish our side once the rest is out.
                s.close();
            }
        }
        if served > 0 {
            let mut phy = Phy { dev: &mut self.dev, ask: false };
            self.iface.poll(now, &mut phy, &mut self.sockets);
        }
        served
    }
}
