//! The `kv` workload's table and protocol, shared by the guest's server and
//! the host's load generator (`ninelives kvload`) and its tests.
//!
//! The table is a fixed-size open-addressing hash table (linear probing, no
//! deletes) in a slice of words, made to survive its owner: it may live in a
//! service's state region (`nl_sandbox::state`), where the sandbox taking
//! the service over loads it. Slot 0 is a header ([`Header`]: magic, entry
//! count, entries dropped as corrupt, loads, the journal's target), slot 1
//! the journal, every other slot is [`SLOT_WORDS`] words: a tag word (0 =
//! empty, [`DEAD`] = a dropped entry, else `TAG | key_len | val_len << 8 |
//! crc32 << 16`), the key ([`MAX_KEY`] bytes) and the value ([`MAX_VALUE`]
//! bytes). The CRC-32 (IEEE, `crc32fast`; not the channel records' CRC-32C:
//! not on a hot path, and a table keeps its format) covers the slot's index,
//! the lengths, the key and the value. It is filled to at most 7/8.
//!
//! A PUT first writes the entry to the journal (its tag last), then to its
//! slot (its tag last), then clears the journal; every word in that order
//! (a compiler fence after each store; x86 keeps stores in order). A table loaded after its writer stopped anywhere
//! ([`Table::load`]) replays a valid journal entry, so an update torn in its
//! slot is completed and one torn in the journal leaves the old value; then
//! every entry whose CRC does not match is dropped (its slot marked
//! [`DEAD`], still occupied for probing) and counted. A GET checks the CRC
//! again before it answers: a wrong value is never served.
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

const MAGIC: u64 = u64::from_le_bytes(*b"9LKVCRC1");
const TAG: u64 = 1 << 63;
/// A dropped (corrupt) entry's tag word: occupied for probing, never a match.
pub const DEAD: u64 = 1 << 62;
const KEY_WORDS: usize = MAX_KEY / 8;
/// Header words.
const H_MAGIC: usize = 0;
const H_COUNT: usize = 1;
const H_DROPPED: usize = 2;
const H_LOADS: usize = 3;
const H_JOURNAL_TARGET: usize = 4;
/// The journal slot's first word.
const JOURNAL: usize = SLOT_WORDS;
/// Slots before the first entry (header, journal).
const FIXED_SLOTS: usize = 2;

/// A table's header as stored (also read by the host from a state region).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Whether the magic is there (a formatted table).
    pub formatted: bool,
    pub entries: u64,
    /// Entries dropped as corrupt by every load so far.
    pub dropped: u64,
    /// Times the table was loaded by a new owner.
    pub loads: u64,
}

impl Header {
    /// Reads the header words of a table.
    pub fn of(words: &[u64]) -> Header {
        let w = |i: usize| words.get(i).copied().unwrap_or(0);
        Header {
            formatted: w(H_MAGIC) == MAGIC,
            entries: w(H_COUNT),
            dropped: w(H_DROPPED),
            loads: w(H_LOADS),
        }
    }
}

/// What [`Table::load`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The memory held no table: it was formatted.
    pub formatted: bool,
    /// Valid entries kept.
    pub kept: u64,
    /// Entries dropped as corrupt by this load.
    pub dropped: u64,
    /// A journal entry was replayed into its slot.
    pub replayed: bool,
}

/// The CRC-32 of an entry in slot `index`: its lengths and every byte of
/// its key and value words (the zero padding too).
fn entry_crc(
    index: u64,
    (kl, vl): (usize, usize),
    kb: &[u8; MAX_KEY],
    vb: &[u8; MAX_VALUE],
) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(&[kl as u8, vl as u8]);
    h.update(kb);
    h.update(vb);
    h.finalize()
}

/// The words of an entry for slot `index`.
fn encode(index: u64, key: &[u8], value: &[u8]) -> [u64; SLOT_WORDS] {
    let mut w = [0u64; SLOT_WORDS];
    let mut kb = [0u8; MAX_KEY];
    kb[..key.len()].copy_from_slice(key);
    let mut vb = [0u8; MAX_VALUE];
    vb[..value.len()].copy_from_slice(value);
    for (k, x) in w[1..1 + KEY_WORDS].iter_mut().enumerate() {
        *x = u64::from_le_bytes(kb[k * 8..k * 8 + 8].try_into().unwrap_or_default());
    }
    for (k, x) in w[1 + KEY_WORDS..].iter_mut().enumerate() {
        *x = u64::from_le_bytes(vb[k * 8..k * 8 + 8].try_into().unwrap_or_default());
    }
    let crc = entry_crc(index, (key.len(), value.len()), &kb, &vb);
    w[0] = TAG | key.len() as u64 | (value.len() as u64) << 8 | u64::from(crc) << 16;
    w
}

/// Whether the entry words `s` are a valid entry for slot `index`.
fn valid_entry(index: u64, s: &[u64]) -> bool {
    if s[0] & TAG == 0 || s[0] & DEAD != 0 {
        return false;
    }
    let (kl, vl) = ((s[0] & 0xff) as usize, ((s[0] >> 8) & 0xff) as usize);
    if kl == 0 || kl > MAX_KEY || vl == 0 || vl > MAX_VALUE {
        return false;
    }
    let (mut kb, mut vb) = ([0u8; MAX_KEY], [0u8; MAX_VALUE]);
    for (k, w) in s[1..1 + KEY_WORDS].iter().enumerate() {
        kb[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    for (k, w) in s[1 + KEY_WORDS..SLOT_WORDS].iter().enumerate() {
        vb[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    let crc = ((s[0] >> 16) & 0xffff_ffff) as u32;
    entry_crc(index, (kl, vl), &kb, &vb) == crc
}

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

/// A GET found its key's entry corrupt (its CRC does not match).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt;

/// A table over a word slice (which may start all zero: it is formatted on first use).
pub struct Table<'m> {
    mem: &'m mut [u64],
    /// Stores left before the table stops storing (tests: a writer
    /// stopped in the middle of a PUT); `u64::MAX` otherwise.
    budget: u64,
}

impl<'m> Table<'m> {
    /// The table in `mem` (at least three slots), loaded as by
    /// [`Table::load`].
    pub fn new(mem: &'m mut [u64]) -> Option<Self> {
        Self::load(mem).map(|(t, _)| t)
    }

    /// Loads the table in `mem` (at least three slots), written by an
    /// owner that may have stopped anywhere: formats memory that holds no
    /// table; otherwise replays a valid journal entry, drops (and counts)
    /// every entry whose CRC does not match and recounts the entries.
    pub fn load(mem: &'m mut [u64]) -> Option<(Self, Loaded)> {
        if mem.len() < (FIXED_SLOTS + 1) * SLOT_WORDS {
            return None;
        }
        let mut t = Table { mem, budget: u64::MAX };
        let mut report = Loaded::default();
        if t.mem[H_MAGIC] != MAGIC {
            t.mem.fill(0);
            t.mem[H_MAGIC] = MAGIC;
            report.formatted = true;
            return Some((t, report));
        }
        let n = t.slots();
        let target = t.mem[H_JOURNAL_TARGET];
        if (target as usize) < n && valid_entry(target, &t.mem[JOURNAL..JOURNAL + SLOT_WORDS]) {
            let at = t.at(target as usize);
            let mut j = [0u64; SLOT_WORDS];
            j.copy_from_slice(&t.mem[JOURNAL..JOURNAL + SLOT_WORDS]);
            t.store_entry(at, &j);
            report.replayed = true;
        }
        t.store(JOURNAL, 0);
        for i in 0..n {
            let at = t.at(i);
            let w0 = t.mem[at];
            if w0 == 0 || w0 == DEAD {
                continue;
            }
            if valid_entry(i as u64, &t.mem[at..at + SLOT_WORDS]) {
                report.kept += 1;
            } else {
                t.mem[at..at + SLOT_WORDS].fill(0);
                t.store(at, DEAD);
                report.dropped += 1;
            }
        }
        t.mem[H_COUNT] = report.kept;
        t.mem[H_DROPPED] = t.mem[H_DROPPED].wrapping_add(report.dropped);
        t.mem[H_LOADS] = t.mem[H_LOADS].wrapping_add(1);
        Some((t, report))
    }

    /// Tests: the table stops storing after `n` more word stores, as if
    /// its writer stopped there.
    #[doc(hidden)]
    pub fn stop_after_stores(&mut self, n: u64) {
        self.budget = n;
    }

    /// The header as stored now.
    pub fn header(&self) -> Header {
        Header::of(self.mem)
    }

    /// Entry slots.
    pub fn slots(&self) -> usize {
        self.mem.len() / SLOT_WORDS - FIXED_SLOTS
    }

    /// Entries stored.
    pub fn len(&self) -> usize {
        self.mem[H_COUNT] as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first word of entry slot `i`.
    fn at(&self, i: usize) -> usize {
        (i + FIXED_SLOTS) * SLOT_WORDS
    }

    fn slot(&self, i: usize) -> &[u64] {
        let at = self.at(i);
        &self.mem[at..at + SLOT_WORDS]
    }

    /// One word, in order: the order of a PUT's stores is what a loader
    /// after a stop anywhere relies on.
    fn store(&mut self, word: usize, v: u64) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        self.mem[word] = v;
        // Not moved across another store by the compiler; x86 keeps stores
        // in program order.
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
    }

    /// An entry's words into the slot at word `at`, its tag word last.
    fn store_entry(&mut self, at: usize, w: &[u64; SLOT_WORDS]) {
        for (k, &x) in w.iter().enumerate().skip(1) {
            self.store(at + k, x);
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        self.store(at, w[0]);
    }

    fn key_of(s: &[u64], out: &mut [u8; MAX_KEY]) -> usize {
        for (k, w) in s[1..1 + KEY_WORDS].iter().enumerate() {
            out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        ((s[0] & 0xff) as usize).min(MAX_KEY)
    }

    fn value_of(s: &[u64], out: &mut [u8; MAX_VALUE]) -> usize {
        for (k, w) in s[1 + KEY_WORDS..].iter().enumerate() {
            out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        (((s[0] >> 8) & 0xff) as usize).min(MAX_VALUE)
    }

    /// The slot holding `key`, or the empty slot where it would go.
    fn find(&self, key: &[u8]) -> (usize, bool) {
        let n = self.slots();
        let mut i = ((u128::from(hash_bytes(key)) * n as u128) >> 64) as usize;
        let mut kb = [0u8; MAX_KEY];
        // At most 7/8 of the slots are used, so an empty one is always found.
        for _ in 0..n {
            let s = self.slot(i);
            if s[0] == 0 {
                return (i, false);
            }
            if s[0] & TAG != 0 {
                let kl = Self::key_of(s, &mut kb);
                if kl == key.len() && &kb[..kl] == key {
                    return (i, true);
                }
            }
            i = if i + 1 == n { 0 } else { i + 1 };
        }
        (n, false)
    }

    /// Looks `key` up; copies the value into `out` and returns its length.
    /// An entry whose CRC does not match is never served: [`Corrupt`].
    pub fn get(&self, key: &[u8], out: &mut [u8; MAX_VALUE]) -> Result<Option<usize>, Corrupt> {
        if !valid_token(key, MAX_KEY) {
            return Ok(None);
        }
        match self.find(key) {
            (i, true) if valid_entry(i as u64, self.slot(i)) => {
                Ok(Some(Self::value_of(self.slot(i), out)))
            }
            (_, true) => Err(Corrupt),
            _ => Ok(None),
        }
    }

    /// Stores `value` under `key` (replacing an older value): through the
    /// journal, so a stop anywhere leaves the old or the new value.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), PutError> {
        if !valid_token(key, MAX_KEY) || !valid_token(value, MAX_VALUE) {
            return Err(PutError::Invalid);
        }
        let (i, found) = self.find(key);
        if !found && (i >= self.slots() || (self.len() + 1) * 8 > self.slots() * 7) {
            return Err(PutError::Full);
        }
        let w = encode(i as u64, key, value);
        // The journal: cleared, its target and words, its tag last.
        self.store(JOURNAL, 0);
        self.store(H_JOURNAL_TARGET, i as u64);
        self.store_entry(JOURNAL, &w);
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        // The slot, its tag last.
        let at = self.at(i);
        self.store_entry(at, &w);
        if !found {
            let n = self.mem[H_COUNT] + 1;
            self.store(H_COUNT, n);
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        self.store(JOURNAL, 0);
        Ok(())
    }

    /// Entries whose key starts with `prefix`, and the sum of their
    /// [`entry_hash`] (corrupt entries left out).
    pub fn digest(&self, prefix: &[u8]) -> (u64, u64) {
        let (mut count, mut sum) = (0u64, 0u64);
        let (mut kb, mut vb) = ([0u8; MAX_KEY], [0u8; MAX_VALUE]);
        for i in 0..self.slots() {
            let s = self.slot(i);
            if s[0] & TAG == 0 || !valid_entry(i as u64, s) {
                continue;
            }
            let kl = Self::key_of(s, &mut kb);
            if kb[..kl].starts_with(prefix) {
                let vl = Self::value_of(s, &mut vb);
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
                Ok(Some(n)) => {
                    o.put(b"VAL ");
                    o.put(&v[..n.min(MAX_VALUE)]);
                    Served::Get
                }
                Ok(None) => {
                    o.put(b"NONE");
                    Served::Get
                }
                Err(Corrupt) => {
                    o.put(b"ERR corrupt entry");
                    Served::Error
                }
            }
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
        let mut mem = vec![0u64; 18 * SLOT_WORDS];
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

    fn value(t: &Table, k: &str) -> Result<Option<std::string::String>, Corrupt> {
        let mut v = [0u8; MAX_VALUE];
        t.get(k.as_bytes(), &mut v)
            .map(|n| n.map(|n| std::string::String::from_utf8_lossy(&v[..n]).into_owned()))
    }

    #[test]
    fn a_put_stopped_at_any_store_leaves_the_old_or_the_new_value() {
        let mut base = vec![0u64; 64 * SLOT_WORDS];
        {
            let mut t = Table::new(&mut base).unwrap();
            for i in 0..20 {
                t.put(std::format!("k{i}").as_bytes(), std::format!("old{i}").as_bytes()).unwrap();
            }
        }
        // A PUT is at most 2 * SLOT_WORDS + 4 stores; stop it after each.
        let mut new_seen = 0;
        for stop in 0..=(2 * SLOT_WORDS as u64 + 6) {
            for (key, old) in [("k3", Some("old3")), ("fresh", None)] {
                let mut mem = base.clone();
                {
                    let mut t = Table::new(&mut mem).unwrap();
                    t.stop_after_stores(stop);
                    t.put(key.as_bytes(), b"new").unwrap();
                }
                let (t, loaded) = Table::load(&mut mem).unwrap();
                assert_eq!(loaded.dropped, 0, "stop {stop} {key}: {loaded:?}");
                let v = value(&t, key).unwrap();
                assert!(
                    v.as_deref() == old || v.as_deref() == Some("new"),
                    "stop {stop} {key}: {v:?}"
                );
                new_seen += usize::from(v.as_deref() == Some("new"));
                for i in (0..20).filter(|i| *i != 3) {
                    let k = std::format!("k{i}");
                    assert_eq!(value(&t, &k).unwrap(), Some(std::format!("old{i}")), "stop {stop}");
                }
                assert_eq!(t.len(), 20 + usize::from(key == "fresh" && v.is_some()));
            }
        }
        assert!(new_seen > 0);
    }

    #[test]
    fn corrupt_entries_are_dropped_counted_and_never_served() {
        let mut mem = vec![0u64; 64 * SLOT_WORDS];
        let mut t = Table::new(&mut mem).unwrap();
        for i in 0..10 {
            t.put(std::format!("k{i}").as_bytes(), std::format!("v{i}").as_bytes()).unwrap();
        }
        let (i, _) = t.find(b"k4");
        let at = t.at(i);
        // One bit of k4's value flipped: dropped at the next load.
        mem[at + 1 + KEY_WORDS] ^= 1 << 9;
        let (t, loaded) = Table::load(&mut mem).unwrap();
        assert_eq!((loaded.kept, loaded.dropped), (9, 1), "{loaded:?}");
        assert_eq!(value(&t, "k4"), Ok(None));
        assert_eq!(t.header().dropped, 1);
        assert_eq!(t.digest(b"").0, 9);
        let (j, _) = t.find(b"k7");
        let at7 = t.at(j);
        // Corrupted after the load: the GET refuses it.
        mem[at7 + 1] ^= 1 << 40;
        let mut t = Table::new(&mut mem).unwrap();
        assert_eq!(t.header().dropped, 2);
        assert_eq!(value(&t, "k7"), Ok(None));
        t.put(b"k8", b"fine").unwrap();
        let (k, _) = t.find(b"k8");
        let at8 = t.at(k);
        t.mem[at8 + 1 + KEY_WORDS] ^= 1;
        assert_eq!(value(&t, "k8"), Err(Corrupt));
        let mut out = [0u8; MAX_RESPONSE];
        let (n, _) = serve(&mut t, b"GET k8", &mut out);
        assert_eq!(&out[..n], b"ERR corrupt entry\n");
        // A new entry still goes past a dropped slot.
        t.put(b"k4", b"again").unwrap();
        assert_eq!(value(&t, "k4"), Ok(Some("again".into())));
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
