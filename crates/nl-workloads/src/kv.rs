//! The `kv` workload's table and protocol, shared by the guest's server and
//! the host's load generator (`ninelives kvload`) and its tests.
//!
//! The table is a fixed-size open-addressing hash table (linear probing, no
//! deletes) in a slice of words: slot 0 is a header (magic, entry count),
//! every other slot is [`SLOT_WORDS`] words: a tag word (0 = empty, else
//! `TAG | key_len | val_len << 8`), the key ([`MAX_KEY`] bytes) and the
//! value ([`MAX_VALUE`] bytes). It is filled to at most 7/8.
//!
//! The protocol is one request per line (`\n`, an optional `\r` before it
//! is ignored), one response line per request, in order:
//!
//! * `PUT key value` -> `OK` once stored, or `ERR full`
//! * `GET key` -> `VAL value` or `NONE`
//! * `DIGEST [prefix]` -> `DIGEST count hex`: the entries whose key starts
//!   with `prefix`, and the wrapping sum of [`entry_hash`] over them (order
//!   independent, so a client that knows what it stored can check it)
//! * anything else -> `ERR reason`
//!
//! Keys are 1..=[`MAX_KEY`] and values 1..=[`MAX_VALUE`] bytes of printable
//! ASCII without spaces.

/// Words per slot (128 bytes).
pub const SLOT_WORDS: usize = 16;
/// Longest key in bytes.
pub const MAX_KEY: usize = 24;
/// Longest value in bytes.
pub const MAX_VALUE: usize = 96;
/// Longest request line (without the newline) the server accepts.
pub const MAX_LINE: usize = 4 + MAX_KEY + 1 + MAX_VALUE;
/// Longest response line, newline included.
pub const MAX_RESPONSE: usize = 4 + MAX_VALUE + 1;
/// Table bytes of the kv workload's working set.
pub const KV_TABLE_BYTES: u64 = 4 << 20;
/// Socket buffer bytes after the table in the working set.
pub const KV_BUF_BYTES: u64 = 256 << 10;
/// The kv workload's working set: table, then the server's socket buffers.
pub const KV_WS_BYTES: u64 = KV_TABLE_BYTES + KV_BUF_BYTES;

const MAGIC: u64 = u64::from_le_bytes(*b"9LIVESKV");
const TAG: u64 = 1 << 63;
const KEY_WORDS: usize = MAX_KEY / 8;

/// FNV-1a, then the splitmix64 finalizer.
fn hash_bytes(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    crate::mix64(h ^ b.len() as u64)
}

/// The hash of one entry; a table's digest is the wrapping sum over its entries.
pub fn entry_hash(key: &[u8], value: &[u8]) -> u64 {
    crate::mix64(
        hash_bytes(key).rotate_left(17) ^ hash_bytes(value).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    )
}

/// Whether `b` is a valid key or value of at most `max` bytes.
pub fn valid_token(b: &[u8], max: usize) -> bool {
    !b.is_empty() && b.len() <= max && b.iter().all(|c| (0x21..=0x7e).contains(c))
}

/// Why a PUT failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutError {
    /// The key or value is empty, too long or not printable.
    Invalid,
    /// The table is full (7/8 of its slots used).
    Full,
}

/// A table over a word slice (which may start all zero: it is formatted on first use).
pub struct Table<'m> {
    mem: &'m mut [u64],
}

impl<'m> Table<'m> {
    /// The table in `mem` (at least two slots); formats it if it is not one yet.
    pub fn new(mem: &'m mut [u64]) -> Option<Self> {
        if mem.len() < 2 * SLOT_WORDS {
            return None;
        }
        if mem[0] != MAGIC {
            mem.fill(0);
            mem[0] = MAGIC;
        }
        Some(Table { mem })
    }

    /// Entry slots.
    pub fn slots(&self) -> usize {
        self.mem.len() / SLOT_WORDS - 1
    }

    /// Entries stored.
    pub fn len(&self) -> usize {
        self.mem[1] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slot(&self, i: usize) -> &[u64] {
        let at = (i + 1) * SLOT_WORDS;
        &self.mem[at..at + SLOT_WORDS]
    }

    fn key_of(s: &[u64], out: &mut [u8; MAX_KEY]) -> usize {
        for (k, w) in s[1..1 + KEY_WORDS].iter().enumerate() {
            out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        (s[0] & 0xff) as usize
    }

    fn value_of(s: &[u64], out: &mut [u8; MAX_VALUE]) -> usize {
        for (k, w) in s[1 + KEY_WORDS..].iter().enumerate() {
            out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        ((s[0] >> 8) & 0xff) as usize
    }

    /// The slot holding `key`, or the empty slot where it would go.
    fn find(&self, key: &[u8]) -> (usize, bool) {
        let n = self.slots();
        let mut i = ((u128::from(hash_bytes(key)) * n as u128) >> 64) as usize;
        let mut kb = [0u8; MAX_KEY];
        // At most 7/8 of the slots are used, so an empty one is always found.
        for _ in 0..n {
            let s = self.slot(i);
            if s[0] & TAG == 0 {
                return (i, false);
            }
            let kl = Self::key_of(s, &mut kb);
            if kl == key.len() && &kb[..kl] == key {
                return (i, true);
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        (n, false)
    }

    /// Looks `key` up; copies the value into `out` and returns its length.
    pub fn get(&self, key: &[u8], out: &mut [u8; MAX_VALUE]) -> Option<usize> {
        if !valid_token(key, MAX_KEY) {
            return None;
        }
        match self.find(key) {
            (i, true) => Some(Self::value_of(self.slot(i), out)),
            _ => None,
        }
    }

    /// Stores `value` under `key` (replacing an older value).
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), PutError> {
        if !valid_token(key, MAX_KEY) || !valid_token(value, MAX_VALUE) {
            return Err(PutError::Invalid);
        }
        let (i, found) = self.find(key);
        if !found {
            if i >= self.slots() || (self.len() + 1) * 8 > self.slots() * 7 {
                return Err(PutError::Full);
            }
            self.mem[1] += 1;
        }
        let at = (i + 1) * SLOT_WORDS;
        let s = &mut self.mem[at..at + SLOT_WORDS];
        let mut kb = [0u8; MAX_KEY];
        kb[..key.len()].copy_from_slice(key);
        let mut vb = [0u8; MAX_VALUE];
        vb[..value.len()].copy_from_slice(value);
        for (k, w) in s[1..1 + KEY_WORDS].iter_mut().enumerate() {
            *w = u64::from_le_bytes(kb[k * 8..k * 8 + 8].try_into().unwrap_or_default());
        }
        for (k, w) in s[1 + KEY_WORDS..].iter_mut().enumerate() {
            *w = u64::from_le_bytes(vb[k * 8..k * 8 + 8].try_into().unwrap_or_default());
        }
        s[0] = TAG | key.len() as u64 | (value.len() as u64) << 8;
        Ok(())
    }

    /// Entries whose key starts with `prefix`, and the sum of their [`entry_hash`].
    pub fn digest(&self, prefix: &[u8]) -> (u64, u64) {
        let (mut count, mut sum) = (0u64, 0u64);
        let (mut kb, mut vb) = ([0u8; MAX_KEY], [0u8; MAX_VALUE]);
        for i in 0..self.slots() {
            let s = self.slot(i);
            if s[0] & TAG == 0 {
                continue;
            }
            let kl = Self::key_of(s, &mut kb).min(MAX_KEY);
            if kb[..kl].starts_with(prefix) {
                let vl = Self::value_of(s, &mut vb).min(MAX_VALUE);
                count += 1;
                sum = sum.wrapping_add(entry_hash(&kb[..kl], &vb[..vl]));
            }
        }
        (count, sum)
    }
}

/// A response being built in a fixed buffer.
struct Out<'a> {
    buf: &'a mut [u8; MAX_RESPONSE],
    len: usize,
}

impl Out<'_> {
    fn put(&mut self, b: &[u8]) {
        let n = b.len().min(MAX_RESPONSE - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
    }

    fn dec(&mut self, mut v: u64) {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.put(&d[i..]);
    }

    fn hex(&mut self, v: u64) {
        let mut d = [0u8; 16];
        for (i, c) in d.iter_mut().enumerate() {
            let n = (v >> (60 - 4 * i)) & 0xf;
            *c = if n < 10 { b'0' + n as u8 } else { b'a' + (n - 10) as u8 };
        }
        self.put(&d);
    }
}

/// What a request did (for the server's counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    Put,
    Get,
    Digest,
    Error,
}

/// Serves one request line (without its newline) against `table`; writes
/// the response line (newline included) to `out` and returns its length.
pub fn serve(table: &mut Table, line: &[u8], out: &mut [u8; MAX_RESPONSE]) -> (usize, Served) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut o = Out { buf: out, len: 0 };
    let mut parts = line.split(|&c| c == b' ').filter(|p| !p.is_empty());
    let cmd = parts.next().unwrap_or(b"");
    let (a, b, extra) = (parts.next(), parts.next(), parts.next().is_some());
    let served = match (cmd, a, b, extra) {
        (b"PUT", Some(k), Some(v), false) => match table.put(k, v) {
            Ok(()) => {
                o.put(b"OK");
                Served::Put
            }
            Err(PutError::Full) => {
                o.put(b"ERR full");
                Served::Error
            }
            Err(PutError::Invalid) => {
                o.put(b"ERR bad key or value");
                Served::Error
            }
        },
        (b"GET", Some(k), None, false) if valid_token(k, MAX_KEY) => {
            let mut v = [0u8; MAX_VALUE];
            match table.get(k, &mut v) {
                Some(n) => {
                    o.put(b"VAL ");
                    o.put(&v[..n.min(MAX_VALUE)]);
                }
                None => o.put(b"NONE"),
            }
            Served::Get
        }
        (b"DIGEST", p, None, false) => {
            let (count, sum) = table.digest(p.unwrap_or(b""));
            o.put(b"DIGEST ");
            o.dec(count);
            o.put(b" ");
            o.hex(sum);
            Served::Digest
        }
        _ => {
            o.put(b"ERR bad request");
            Served::Error
        }
    };
    o.buf[o.len.min(MAX_RESPONSE - 1)] = b'\n';
    (o.len.min(MAX_RESPONSE - 1) + 1, served)
}

/// Accumulates a byte stream into request lines of at most [`MAX_LINE`]
/// bytes; longer lines are answered with an error, never buffered.
pub struct LineBuf {
    buf: [u8; MAX_LINE + 2],
    len: usize,
    overflow: bool,
}

impl Default for LineBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl LineBuf {
    pub const fn new() -> Self {
        LineBuf { buf: [0; MAX_LINE + 2], len: 0, overflow: false }
    }

    pub fn clear(&mut self) {
        self.len = 0;
        self.overflow = false;
    }

    /// Takes bytes from `data` up to and including the first newline.
    /// Returns the bytes consumed and whether a line is complete (then
    /// [`LineBuf::line`] gives it, `None` for an overlong one).
    pub fn feed(&mut self, data: &[u8]) -> (usize, bool) {
        let (take, done) = match data.iter().position(|&c| c == b'\n') {
            Some(p) => (p + 1, true),
            None => (data.len(), false),
        };
        let body = if done { &data[..take - 1] } else { data };
        if self.len + body.len() > self.buf.len() {
            self.overflow = true;
        } else {
            self.buf[self.len..self.len + body.len()].copy_from_slice(body);
            self.len += body.len();
        }
        (take, done)
    }

    /// The completed line (`None` if it was too long); resets the buffer.
    pub fn take_line(&mut self) -> Option<&[u8]> {
        let (len, overflow) = (self.len, self.overflow);
        self.clear();
        let line = &self.buf[..len];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        (!overflow && line.len() <= MAX_LINE).then_some(line)
    }
}

/// The response to an overlong line.
pub const TOO_LONG: &[u8] = b"ERR line too long\n";

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;

    fn req(t: &mut Table, line: &str) -> std::string::String {
        let mut out = [0u8; MAX_RESPONSE];
        let (n, _) = serve(t, line.as_bytes(), &mut out);
        std::string::String::from_utf8_lossy(&out[..n]).into_owned()
    }

    #[test]
    fn put_get_digest() {
        let mut mem = vec![0u64; 64 * SLOT_WORDS];
        let mut t = Table::new(&mut mem).unwrap();
        assert_eq!(req(&mut t, "GET a"), "NONE\n");
        assert_eq!(req(&mut t, "PUT a 1"), "OK\n");
        assert_eq!(req(&mut t, "PUT b 22\r"), "OK\n");
        assert_eq!(req(&mut t, "PUT a 333"), "OK\n");
        assert_eq!(req(&mut t, "GET a"), "VAL 333\n");
        assert_eq!(req(&mut t, "GET b"), "VAL 22\n");
        let sum = entry_hash(b"a", b"333").wrapping_add(entry_hash(b"b", b"22"));
        assert_eq!(req(&mut t, "DIGEST"), std::format!("DIGEST 2 {sum:016x}\n"));
        assert_eq!(
            req(&mut t, "DIGEST b"),
            std::format!("DIGEST 1 {:016x}\n", entry_hash(b"b", b"22"))
        );
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn bad_requests_are_errors() {
        let mut mem = vec![0u64; 64 * SLOT_WORDS];
        let mut t = Table::new(&mut mem).unwrap();
        for bad in [
            "",
            "PUT",
            "PUT a",
            "PUT a b c",
            "GET",
            "GET a b",
            "FOO a",
            "PUT aaaaaaaaaaaaaaaaaaaaaaaaa v",
            "PUT k \x01",
        ] {
            assert!(req(&mut t, bad).starts_with("ERR"), "{bad:?}");
        }
        let long = "v".repeat(MAX_VALUE + 1);
        assert!(req(&mut t, &std::format!("PUT k {long}")).starts_with("ERR"));
        let max = "v".repeat(MAX_VALUE);
        assert_eq!(req(&mut t, &std::format!("PUT {} {max}", "k".repeat(MAX_KEY))), "OK\n");
        assert_eq!(
            req(&mut t, &std::format!("GET {}", "k".repeat(MAX_KEY))),
            std::format!("VAL {max}\n")
        );
    }

    #[test]
    fn fills_to_seven_eighths() {
        let mut mem = vec![0u64; 17 * SLOT_WORDS];
        let mut t = Table::new(&mut mem).unwrap();
        let mut ok = 0;
        for i in 0..100 {
            if t.put(std::format!("k{i}").as_bytes(), b"v").is_ok() {
                ok += 1;
            }
        }
        assert_eq!(ok, 14);
        assert_eq!(t.put(b"k0", b"w"), Ok(()), "an existing key can still be updated");
        assert_eq!(t.digest(b"").0, 14);
    }

    #[test]
    fn lines() {
        let mut l = LineBuf::new();
        assert_eq!(l.feed(b"GET a\nPUT"), (6, true));
        assert_eq!(l.take_line(), Some(&b"GET a"[..]));
        assert_eq!(l.feed(b"PUT"), (3, false));
        assert_eq!(l.feed(b" b c\r\n"), (6, true));
        assert_eq!(l.take_line(), Some(&b"PUT b c"[..]));
        let long = vec![b'x'; 1000];
        assert_eq!(l.feed(&long), (1000, false));
        assert_eq!(l.feed(b"\n"), (1, true));
        assert_eq!(l.take_line(), None);
        assert_eq!(l.feed(b"GET z\n"), (6, true));
        assert_eq!(l.take_line(), Some(&b"GET z"[..]));
    }
}
