//! Authentication of the two ends: a pre-shared key (a file of at least 32
//! random bytes, readable by its owner only, never sent), a
//! challenge-response handshake with a fresh nonce from each side, and the
//! session key every later frame is sealed under (see [`crate::protocol`]).
//!
//! The handshake, in plain frames of at most
//! [`HANDSHAKE_MAX`](crate::protocol::HANDSHAKE_MAX) bytes:
//!
//! 1. primary → backup `Hello`: `nonce_p` (32 random bytes) then the
//!    [`Hello`] as JSON;
//! 2. backup → primary `Challenge`: `nonce_b` (32 random bytes), or a
//!    `Refuse` with the reason;
//! 3. primary → backup `Auth`:
//!    `HMAC-SHA256(key, "nl-replicate primary" || nonce_p || nonce_b || hello)`,
//!    where `hello` is the whole payload of step 1;
//! 4. backup → primary `Welcome`:
//!    `HMAC-SHA256(key, "nl-replicate backup" || nonce_p || nonce_b || hello)`,
//!    or a `Refuse` (wrong proof, or a VM this backup is not set up for).
//!
//! Each side checks the other's proof in constant time (`verify_slice`).
//! The session key is `HMAC-SHA256(key, "nl-session" || nonce_p || nonce_b)`:
//! fresh for every connection, so no frame of one session verifies in
//! another. The backup sends nothing keyed before the primary proved the
//! key, and a primary talking to a peer without the key learns nothing
//! from it that would help against a real backup (whose nonce is fresh).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::protocol::*;

type HmacSha256 = Hmac<Sha256>;

/// Shortest key accepted, in bytes.
pub const KEY_MIN: usize = 32;
/// Longest key file read, in bytes.
pub const KEY_MAX: u64 = 4096;
/// Bytes of each side's nonce.
pub const NONCE: usize = 32;

const PRIMARY_LABEL: &[u8] = b"nl-replicate primary";
const BACKUP_LABEL: &[u8] = b"nl-replicate backup";
const SESSION_LABEL: &[u8] = b"nl-session";

/// The pre-shared replication key.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// A key from bytes (at least [`KEY_MIN`]).
    pub fn from_bytes(b: &[u8]) -> Result<Key, String> {
        if b.len() < KEY_MIN {
            return Err(format!(
                "a replication key needs at least {KEY_MIN} bytes, not {}",
                b.len()
            ));
        }
        Ok(Key(b.to_vec()))
    }

    /// A fresh random key of [`KEY_MIN`] bytes.
    pub fn random() -> Result<Key, String> {
        let mut k = vec![0u8; KEY_MIN];
        getrandom::fill(&mut k).map_err(|e| format!("no random bytes from the OS: {e}"))?;
        Ok(Key(k))
    }

    /// Reads a key file: a regular file of [`KEY_MIN`] to [`KEY_MAX`] bytes
    /// that neither its group nor others may read or write.
    pub fn load(path: &Path) -> Result<Key, String> {
        nl_memory::file::read_secret(path, "key file", KEY_MIN as u64, KEY_MAX).map(Key).map_err(
            |e| format!("{e} (make one with `ninelives replicate keygen {}`)", path.display()),
        )
    }

    /// Writes a new key of [`KEY_MIN`] random bytes to `path`, mode 0600;
    /// an existing file is never overwritten.
    pub fn generate(path: &Path) -> Result<(), String> {
        let key = Key::random()?;
        let shown = path.display();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => {
                    format!("{shown} exists: a key file is never overwritten")
                }
                _ => format!("cannot create the key file {shown}: {e}"),
            })?;
        f.write_all(&key.0)
            .and_then(|()| f.sync_all())
            .map_err(|e| format!("cannot write the key file {shown}: {e}"))
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length")
    }

    /// The MAC over a label and both nonces.
    fn over(&self, label: &[u8], np: &[u8; NONCE], nb: &[u8; NONCE]) -> HmacSha256 {
        let mut m = self.mac();
        m.update(label);
        m.update(np);
        m.update(nb);
        m
    }

    fn proof(&self, label: &[u8], np: &[u8; NONCE], nb: &[u8; NONCE], hello: &[u8]) -> Vec<u8> {
        let mut m = self.over(label, np, nb);
        m.update(hello);
        m.finalize().into_bytes().to_vec()
    }

    fn verify(
        &self,
        label: &[u8],
        np: &[u8; NONCE],
        nb: &[u8; NONCE],
        hello: &[u8],
        proof: &[u8],
    ) -> bool {
        let mut m = self.over(label, np, nb);
        m.update(hello);
        m.verify_slice(proof).is_ok()
    }

    /// The session key of the connection with these nonces.
    pub fn session(&self, np: &[u8; NONCE], nb: &[u8; NONCE]) -> SessionKey {
        SessionKey(self.over(SESSION_LABEL, np, nb).finalize().into_bytes().into())
    }
}

/// A fresh random nonce.
pub fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| format!("no random bytes from the OS: {e}"))?;
    Ok(n)
}

fn refused(f: &Frame) -> String {
    format!("the backup refused this primary: {}", String::from_utf8_lossy(&f.payload))
}

/// The primary's side of the handshake. Returns the session key.
pub fn primary_handshake<S: Read + Write>(
    s: &mut S,
    key: &Key,
    hello: &Hello,
) -> Result<SessionKey, String> {
    let np = nonce()?;
    let body = serde_json::to_vec(hello).map_err(|e| e.to_string())?;
    let payload = [&np[..], &body].concat();
    if payload.len() > HANDSHAKE_MAX {
        return Err(format!(
            "the hello takes {} bytes, more than the {HANDSHAKE_MAX} a handshake frame holds \
             (a Linux VM's command line and file names are in it: shorten them)",
            payload.len()
        ));
    }
    let sent = write_plain_frame(s, Kind::Hello, &[&payload]);
    // A backup that refuses this peer may answer before reading the hello:
    // its reason is worth more than our broken pipe.
    let f = match (read_plain_frame(s), sent) {
        (Ok(f), _) => f,
        (Err(_), Err(e)) => return Err(format!("hello: {e}")),
        (Err(e), Ok(())) => return Err(format!("no answer from the backup: {e}")),
    };
    let nb: [u8; NONCE] = match f.kind {
        Kind::Challenge => f.payload.as_slice().try_into().map_err(|_| {
            format!("the backup's challenge is {} bytes, not {NONCE}", f.payload.len())
        })?,
        Kind::Refuse => return Err(refused(&f)),
        k => return Err(format!("unexpected {k:?} from the backup (a challenge was due)")),
    };
    write_plain_frame(s, Kind::Auth, &[&key.proof(PRIMARY_LABEL, &np, &nb, &payload)])
        .map_err(|e| format!("sending the proof of the key: {e}"))?;
    let f = read_plain_frame(s).map_err(|e| format!("no answer to the proof of the key: {e}"))?;
    match f.kind {
        Kind::Welcome if key.verify(BACKUP_LABEL, &np, &nb, &payload, &f.payload) => {
            Ok(key.session(&np, &nb))
        }
        Kind::Welcome => Err("the backup did not prove that it holds the replication key \
                              (a different --key-file, or not a ninelives backup)"
            .into()),
        Kind::Refuse => Err(refused(&f)),
        k => Err(format!("unexpected {k:?} from the backup (a welcome was due)")),
    }
}

/// A primary that proved the key, before the backup welcomes it.
pub struct Proven {
    pub hello: Hello,
    payload: Vec<u8>,
    np: [u8; NONCE],
    nb: [u8; NONCE],
}

/// The backup's side of the handshake up to the primary's proof: reads the
/// hello, challenges, checks the proof. An error is the reason to refuse
/// the peer with.
pub fn backup_challenge<S: Read + Write>(s: &mut S, key: &Key) -> Result<Proven, String> {
    let f = read_plain_frame(s).map_err(|e| format!("no valid hello: {e}"))?;
    if f.kind != Kind::Hello {
        return Err(format!("expected a hello, got {:?}", f.kind));
    }
    let np: [u8; NONCE] = f
        .payload
        .get(..NONCE)
        .and_then(|n| n.try_into().ok())
        .ok_or("malformed hello: shorter than its nonce")?;
    let hello: Hello =
        serde_json::from_slice(&f.payload[NONCE..]).map_err(|e| format!("malformed hello: {e}"))?;
    let nb = nonce()?;
    write_plain_frame(s, Kind::Challenge, &[&nb])
        .map_err(|e| format!("cannot send the challenge: {e}"))?;
    let a = read_plain_frame(s).map_err(|e| format!("no proof of the key: {e}"))?;
    if a.kind != Kind::Auth {
        return Err(format!("no proof of the key: a {:?} frame came instead", a.kind));
    }
    if !key.verify(PRIMARY_LABEL, &np, &nb, &f.payload, &a.payload) {
        return Err("authentication failed: the peer did not prove that it holds this \
                    backup's replication key"
            .into());
    }
    Ok(Proven { hello, payload: f.payload, np, nb })
}

impl Proven {
    /// Completes the handshake: sends the backup's proof. Returns the
    /// session key.
    pub fn welcome(&self, s: &mut impl Write, key: &Key) -> Result<SessionKey, String> {
        let proof = key.proof(BACKUP_LABEL, &self.np, &self.nb, &self.payload);
        write_plain_frame(s, Kind::Welcome, &[&proof])
            .map_err(|e| format!("cannot answer the primary: {e}"))?;
        Ok(key.session(&self.np, &self.nb))
    }
}

/// A socket whose reads and writes all end by one deadline (a peer that
/// sends one byte at a time gains nothing: the time is for the whole
/// exchange, not per byte).
pub struct Deadline<'s> {
    s: &'s TcpStream,
    until: Instant,
}

impl<'s> Deadline<'s> {
    pub fn new(s: &'s TcpStream, within: Duration) -> Self {
        Deadline { s, until: Instant::now() + within }
    }

    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the handshake's time is up",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.s).read(b)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.s).write(b)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::UnixStream;

    fn hello() -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            state_version: 1,
            mem_bytes: 1,
            vcpus: 1,
            disk_bytes: 0,
            lease_ms: 1000,
            linux: None,
            colo: false,
        }
    }

    /// One handshake over a socket pair: the primary holding `pk`, the backup `bk`.
    fn handshake(pk: &Key, bk: &Key) -> (Result<SessionKey, String>, Result<SessionKey, String>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let bk = bk.clone();
        let backup = std::thread::spawn(move || {
            let r = backup_challenge(&mut b, &bk).and_then(|p| p.welcome(&mut b, &bk));
            if let Err(why) = &r {
                let _ = write_plain_frame(&mut b, Kind::Refuse, &[why.as_bytes()]);
            }
            r
        });
        let p = primary_handshake(&mut a, pk, &hello());
        (p, backup.join().unwrap())
    }

    /// A Linux record that does not decode, and a hello too large for a
    /// handshake frame, end the handshake with a clear error (on the
    /// backup: before anything past the frame's header is read).
    #[test]
    fn a_corrupt_or_oversized_linux_record_is_refused_clearly() {
        let key = Key::from_bytes(&[7; 32]).unwrap();
        let corrupt = [
            serde_json::json!({"version": 1, "record": {"cmdline": 7}}),
            serde_json::json!({"version": 1}),
            serde_json::json!({"version": "1", "record": {"cmdline": ""}}),
            serde_json::json!([1, 2]),
        ];
        for linux in corrupt {
            let (mut a, mut b) = UnixStream::pair().unwrap();
            let mut v = serde_json::to_value(hello()).unwrap();
            v["linux"] = linux.clone();
            let body = [&nonce().unwrap()[..], &serde_json::to_vec(&v).unwrap()].concat();
            write_plain_frame(&mut a, Kind::Hello, &[&body]).unwrap();
            let e = backup_challenge(&mut b, &key).err().expect("refused");
            assert!(e.starts_with("malformed hello:"), "{linux}: {e}");
        }
        // The primary does not send a hello that a backup could not read.
        let (mut a, _b) = UnixStream::pair().unwrap();
        let record = nl_vmm::linux::LinuxRecord {
            kernel: Some(format!("/{}", "k".repeat(HANDSHAKE_MAX)).into()),
            cmdline: String::new(),
            initrd: None,
            system_map: None,
            time_limit_ms: None,
            started_unix_ms: None,
        };
        let big = Hello { linux: Some(LinuxHello::of(&record)), ..hello() };
        let e = primary_handshake(&mut a, &key, &big).expect_err("refused");
        assert!(e.contains(&format!("more than the {HANDSHAKE_MAX}")), "{e}");
        // A backup refuses a hello frame announcing more, unread.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[6] = Kind::Hello as u8;
        h[20..24].copy_from_slice(&(HANDSHAKE_MAX as u32 + 1).to_le_bytes());
        a.write_all(&h).unwrap();
        let e = backup_challenge(&mut b, &key).err().expect("refused");
        assert!(e.contains(&format!("at most {HANDSHAKE_MAX}")), "{e}");
    }

    #[test]
    fn both_ends_prove_the_key_and_agree_on_a_fresh_session_key() {
        let key = Key::from_bytes(&[7; 32]).unwrap();
        let (p, b) = handshake(&key, &key);
        let (p, b) = (p.unwrap(), b.unwrap());
        assert_eq!(p.0, b.0);
        // Fresh nonces: another connection, another session key.
        let (p2, _) = handshake(&key, &key);
        assert_ne!(p.0, p2.unwrap().0);
        // A frame sealed by one end opens at the other.
        let mut buf = Vec::new();
        p.sealer(Dir::ToBackup).write_frame(&mut buf, Kind::Heartbeat, 0, 0, &[]).unwrap();
        b.opener(Dir::ToBackup).read_frame(&mut &buf[..]).unwrap();
    }

    #[test]
    fn a_wrong_key_is_refused_on_both_sides() {
        let (k1, k2) = (Key::from_bytes(&[1; 32]).unwrap(), Key::from_bytes(&[2; 32]).unwrap());
        let (p, b) = handshake(&k1, &k2);
        assert!(b.unwrap_err().contains("authentication failed"));
        assert!(p.unwrap_err().contains("authentication failed"));
    }

    /// A fake backup without the key cannot pass the primary's check.
    #[test]
    fn a_backup_without_the_key_is_not_trusted() {
        let key = Key::from_bytes(&[1; 32]).unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let _ = read_plain_frame(&mut b).unwrap();
            write_plain_frame(&mut b, Kind::Challenge, &[&[0u8; NONCE]]).unwrap();
            let _ = read_plain_frame(&mut b).unwrap();
            write_plain_frame(&mut b, Kind::Welcome, &[&[0u8; 32]]).unwrap();
        });
        let e = primary_handshake(&mut a, &key, &hello()).unwrap_err();
        assert!(e.contains("did not prove"), "{e}");
        fake.join().unwrap();
    }

    /// The key never crosses the wire: not in any handshake byte.
    #[test]
    fn the_key_is_not_sent() {
        let key = Key::from_bytes(b"0123456789abcdef0123456789abcdef").unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let k = key.clone();
        let backup = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let p = backup_challenge(&mut Tee(&mut b, &mut seen), &k).unwrap();
            p.welcome(&mut b, &k).unwrap();
            seen
        });
        primary_handshake(&mut a, &key, &hello()).unwrap();
        let seen = backup.join().unwrap();
        assert!(seen.len() > 2 * NONCE);
        assert!(!seen.windows(16).any(|w| key.0.windows(16).any(|k| k == w)));
    }

    /// Reads through, keeping a copy of what was read.
    struct Tee<'a>(&'a mut UnixStream, &'a mut Vec<u8>);
    impl Read for Tee<'_> {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(b)?;
            self.1.extend_from_slice(&b[..n]);
            Ok(n)
        }
    }
    impl Write for Tee<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    #[test]
    fn key_files_are_checked() {
        let dir = std::env::temp_dir().join(format!("nl-key-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("k");
        Key::generate(&path).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!((m.len(), m.mode() & 0o777), (KEY_MIN as u64, 0o600));
        let k = Key::load(&path).unwrap();
        assert_ne!(k.0, vec![0u8; KEY_MIN]);
        // Never overwritten.
        assert!(Key::generate(&path).unwrap_err().contains("never overwritten"));
        assert_eq!(Key::load(&path).unwrap().0, k.0);
        // Group or world readable: refused, naming the fix.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Key::load(&path).unwrap_err();
        assert!(e.contains("mode 640") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o604)).unwrap();
        assert!(Key::load(&path).is_err());
        // Too short.
        let short = dir.join("short");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&short)
            .unwrap()
            .write_all(&[1; 31])
            .unwrap();
        let e = Key::load(&short).unwrap_err();
        assert!(e.contains("31 bytes") && e.contains("keygen"), "{e}");
        assert!(Key::load(&dir).unwrap_err().contains("not a regular file"));
        assert!(Key::load(&dir.join("none")).unwrap_err().contains("cannot open"));
        assert!(Key::from_bytes(&[0; 31]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
