//! Files ninelives is given are not trusted (issue 16, defect 5): every file
//! is size- and kind-checked before it is read, every checkpoint header
//! field is checked against the state it describes (an attacker recomputes
//! the CRC after an edit), and checkpoint files can be authenticated with an
//! HMAC-SHA256 under a key file.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Runs the CLI, killing it (and failing the test) if it has not ended
/// within `limit`: a file that is read without bound would never end.
fn run_bounded(args: &[&str], limit: Duration) -> Output {
    let mut child = ninelives()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the ninelives binary runs");
    let start = Instant::now();
    // Bounded: at most limit / 20 ms polls.
    for _ in 0..=(limit.as_millis() / 20) {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let o = child.wait_with_output().expect("output");
    panic!(
        "ninelives {args:?} still ran after {limit:?} (killed); stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

const FAST: Duration = Duration::from_secs(20);

fn require_kvm() {
    // These tests need a real checkpoint file, written by a real run: no KVM
    // is a failure here, not a skip.
    if let Err(e) = nl_vmm::open_kvm() {
        panic!("KVM is required by this test and is not available: {e}");
    }
}

/// A directory that lives as long as the test process.
fn dir() -> &'static Path {
    static D: OnceLock<tempfile::TempDir> = OnceLock::new();
    D.get_or_init(|| tempfile::tempdir().unwrap()).path()
}

/// A key file of `len` random-looking bytes with `mode`.
fn key_file(name: &str, len: usize, mode: u32) -> PathBuf {
    let p = dir().join(name);
    let seed = name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |a, b| a.rotate_left(7) ^ b as u64);
    let bytes: Vec<u8> =
        (0..len as u64).map(|i| (seed.wrapping_mul(i + 1) >> 17) as u8 ^ i as u8).collect();
    std::fs::write(&p, bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

fn good_key() -> PathBuf {
    static K: OnceLock<PathBuf> = OnceLock::new();
    K.get_or_init(|| key_file("good.key", 32, 0o600)).clone()
}

/// Writes a disk checkpoint with a short real run (with `key`, authenticated).
fn make_checkpoint(name: &str, key: Option<&Path>) -> PathBuf {
    require_kvm();
    let ck = dir().join(name);
    let mut args = vec![
        "checkpoint",
        "--duration",
        "2",
        "--ws",
        "4M",
        "--interval",
        "400",
        "--hang-timeout",
        "0.3",
        "--disk-every",
        "2",
        "--disk-path",
        ck.to_str().unwrap(),
    ];
    if let Some(k) = key {
        args.extend(["--key-file", k.to_str().unwrap()]);
    }
    let o = run_cli(&args);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(ck.exists(), "no checkpoint written: {}", stdout(&o));
    ck
}

fn plain_checkpoint() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| make_checkpoint("plain.ckpt", None))
}

fn keyed_checkpoint() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| make_checkpoint("keyed.ckpt", Some(&good_key())))
}

/// A plain checkpoint file taken apart: header and state as JSON, the page
/// records as they are.
struct Parts {
    header: Value,
    state: Value,
    pages: Vec<u8>,
}

fn parse(b: &[u8]) -> Parts {
    assert_eq!(&b[..8], b"NLCKPT01");
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let hl = u64_at(8);
    let header = serde_json::from_slice(&b[16..16 + hl]).unwrap();
    let sl = u64_at(16 + hl);
    let s0 = 24 + hl;
    let state = serde_json::from_slice(&b[s0..s0 + sl]).unwrap();
    Parts { header, state, pages: b[s0 + sl..b.len() - 4].to_vec() }
}

/// Puts the parts back together with a correct CRC, as an attacker would.
fn assemble(p: &Parts) -> Vec<u8> {
    let h = serde_json::to_vec(&p.header).unwrap();
    let s = serde_json::to_vec(&p.state).unwrap();
    let mut b = b"NLCKPT01".to_vec();
    b.extend_from_slice(&(h.len() as u64).to_le_bytes());
    b.extend_from_slice(&h);
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(&s);
    b.extend_from_slice(&p.pages);
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Why `restore FILE EXTRA...` was not the clean refusal containing `needle`
/// that it should be (None: it was).
fn restore_problem(file: &str, extra: &[&str], needle: &str) -> Option<String> {
    let mut args = vec!["restore", file];
    args.extend_from_slice(extra);
    let o = run_bounded(&args, Duration::from_secs(60));
    let (out, err) = (stdout(&o), stderr(&o));
    if o.status.success() || out.contains("verified") {
        return Some(format!("{file}: restored: {out}"));
    }
    if err.contains("panicked") || !format!("{out}{err}").contains(needle) {
        return Some(format!("{file}: expected '{needle}' in: {out}{err}"));
    }
    None
}

#[test]
fn tampered_headers_with_a_recomputed_crc_are_refused_by_field() {
    let orig = std::fs::read(plain_checkpoint()).unwrap();
    // The untouched file, taken apart and put back, is the same file.
    assert_eq!(assemble(&parse(&orig)), orig);
    let hz = parse(&orig).header["timer_hz"].as_u64().unwrap();
    type Edit = fn(&mut Parts);
    let cases: Vec<(&str, Edit, String)> = vec![
        (
            "duration",
            |p| p.header["workload"]["duration_ms"] = u64::MAX.into(),
            "header field workload.duration_ms is 18446744073709551615 but the VM state says"
                .into(),
        ),
        (
            "duration-both",
            |p| {
                p.header["workload"]["duration_ms"] = u64::MAX.into();
                p.state["workload"]["duration_ms"] = u64::MAX.into();
            },
            "header field workload.duration_ms is 18446744073709551615: the limit is".into(),
        ),
        (
            "timer",
            |p| p.header["timer_hz"] = 250.into(),
            format!("header field timer_hz is 250 but the VM state says {hz}"),
        ),
        (
            "seed",
            |p| p.header["workload"]["seed"] = 12345.into(),
            "header field workload.seed is 12345".into(),
        ),
        (
            "vcpus",
            |p| p.header["vcpus"] = 2.into(),
            "header field vcpus is 2 but the VM state says 1".into(),
        ),
        (
            "mem",
            |p| p.header["mem_bytes"] = (512u64 << 20).into(),
            "header field mem_bytes is 536870912 but the VM state says".into(),
        ),
        (
            "pages",
            |p| {
                let n = p.header["pages"].as_u64().unwrap();
                p.header["pages"] = (n - 1).into();
            },
            "header field pages is".into(),
        ),
        ("version", |p| p.header["version"] = 3.into(), "version 3 is not supported".into()),
        (
            // Version 2 is a Linux VM's file or one with a disk: a reference
            // guest's file relabelled as version 2 is refused.
            "version-2-without-its-fields",
            |p| p.header["version"] = 2.into(),
            "version 2 without a \"linux\" or \"disk\" field".into(),
        ),
        ("extra-field", |p| p.header["trusted"] = true.into(), "unknown field `trusted`".into()),
        (
            // Drops the guest's control block: the VM would run with a fresh one.
            "device-missing",
            |p| {
                p.state["mmio_devices"].as_array_mut().unwrap().clear();
            },
            "no state for device".into(),
        ),
        (
            "device-twice",
            |p| {
                let d = p.state["io_devices"][0].clone();
                p.state["io_devices"].as_array_mut().unwrap().push(d);
            },
            "device states at".into(),
        ),
    ];
    // Every case is tried; the failures are reported together.
    let mut problems = Vec::new();
    for (name, edit, needle) in cases {
        let mut p = parse(&orig);
        edit(&mut p);
        let f = write_file(dir(), &format!("tampered-{name}.ckpt"), &assemble(&p));
        problems.extend(restore_problem(&f, &[], &needle).map(|e| format!("{name}: {e}")));
    }
    assert!(
        problems.is_empty(),
        "{} case(s) not refused:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn devices_fifos_and_oversized_files_are_refused_before_they_are_read() {
    // /dev/zero never ends: each reader must refuse it, not read it.
    let o = run_bounded(&["restore", "/dev/zero"], FAST);
    assert_clean_error(&o, "checkpoint file /dev/zero is a character device");
    let o = run_bounded(&["run", "--kernel", "/dev/zero"], FAST);
    assert_clean_error(&o, "kernel image /dev/zero is a character device");
    let o = run_bounded(&["checkpoint", "--latency-file", "/dev/zero"], FAST);
    assert_clean_error(&o, "latency file /dev/zero is a character device");
    let o = run_bounded(&["restore", "x.ckpt", "--key-file", "/dev/zero"], FAST);
    assert_clean_error(&o, "key file /dev/zero is a character device");
    // A FIFO with no writer: even opening it must not wait.
    let fifo = dir().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: c is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let f = fifo.to_str().unwrap();
    assert_clean_error(&run_bounded(&["restore", f], FAST), "is a FIFO");
    assert_clean_error(&run_bounded(&["run", "--kernel", f], FAST), "is a FIFO");
    // A directory.
    let d = dir().to_str().unwrap();
    assert_clean_error(&run_bounded(&["restore", d], FAST), "is a directory");

    // Oversized (sparse) files: refused by size, with the size and the limit.
    let sparse = |name: &str, len: u64| {
        let p = dir().join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p.to_str().unwrap().to_string()
    };
    let kmax = 64u64 << 20;
    let k = sparse("big-kernel", kmax + 1);
    assert_clean_error(
        &run_bounded(&["run", "--kernel", &k], FAST),
        &format!("is {} bytes; the limit for a kernel image is {kmax} bytes", kmax + 1),
    );
    let lmax = 16u64 << 20;
    let l = sparse("big-latency", lmax + 1);
    assert_clean_error(
        &run_bounded(&["checkpoint", "--latency-file", &l], FAST),
        &format!("the limit for a latency file is {lmax} bytes"),
    );
    let cmax = nl_checkpoint::disk::MAX_FILE_BYTES;
    let c = sparse("big.ckpt", cmax + 1);
    assert_clean_error(
        &run_bounded(&["restore", &c], FAST),
        &format!("is {} bytes; the limit for a checkpoint file is {cmax} bytes", cmax + 1),
    );
    let kf = sparse("big.key", 4097);
    std::fs::set_permissions(&kf, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_clean_error(
        &run_bounded(&["restore", "x.ckpt", "--key-file", &kf], FAST),
        "the limit for a key file is 4096 bytes",
    );
}

#[test]
fn an_authenticated_checkpoint_restores_only_with_its_key_and_unchanged() {
    let ck = keyed_checkpoint();
    let ck_s = ck.to_str().unwrap();
    let key = good_key();
    let key_s = key.to_str().unwrap();
    // With its key it restores and runs to the right digest.
    let o =
        run_bounded(&["restore", ck_s, "--key-file", key_s, "--json"], Duration::from_secs(120));
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("(authenticated)"), "{}", stdout(&o));
    assert_eq!(last_json(&o)["digest_ok"], true);

    // Every refusal below is tried; the failures are reported together.
    let mut problems = Vec::new();
    // Without a key: refused, saying a key is needed.
    problems.extend(restore_problem(ck_s, &[], "needs its key"));
    // With another key of the right form: refused.
    let other = key_file("other.key", 32, 0o600);
    problems.extend(restore_problem(
        ck_s,
        &["--key-file", other.to_str().unwrap()],
        "failed authentication",
    ));
    // A plain file read with a key: refused (no downgrade).
    problems.extend(restore_problem(
        plain_checkpoint().to_str().unwrap(),
        &["--key-file", key_s],
        "is not authenticated, but a key was given",
    ));

    // One byte changed anywhere (magic, header, state, pages, CRC, MAC): refused.
    let orig = std::fs::read(ck).unwrap();
    let n = orig.len();
    let mut at: Vec<usize> = vec![0, 7, 8, 16, 40, n / 2, n - 40, n - 33, n - 32, n - 1];
    at.extend((1..16).map(|i| i * n / 16));
    for (i, &pos) in at.iter().enumerate() {
        let mut b = orig.clone();
        b[pos] ^= 0x01;
        let f = write_file(dir(), &format!("flip-{i}.ckpt"), &b);
        // A changed magic is no longer this kind of file; any other byte fails the MAC.
        let needle = if pos < 8 { "checkpoint" } else { "failed authentication" };
        let p = restore_problem(&f, &["--key-file", key_s], needle);
        problems.extend(p.map(|e| format!("byte {pos} of {n}: {e}")));
    }
    // An edit with a recomputed CRC (the MAC trailer kept): refused by the MAC.
    let body = &orig[..n - 32];
    let mut edited = body[..body.len() - 4].to_vec();
    let hl = u64::from_le_bytes(edited[8..16].try_into().unwrap()) as usize;
    let h = String::from_utf8(edited[16..16 + hl].to_vec()).unwrap();
    let h2 = h.replacen("\"seed\":", "\"seed\":1", 1);
    assert_eq!(h2.len(), h.len() + 1);
    edited.splice(16..16 + hl, h2.bytes());
    edited[8..16].copy_from_slice(&((hl + 1) as u64).to_le_bytes());
    let crc = crc32fast::hash(&edited);
    edited.extend_from_slice(&crc.to_le_bytes());
    edited.extend_from_slice(&orig[n - 32..]);
    let f = write_file(dir(), "edited-keyed.ckpt", &edited);
    problems.extend(restore_problem(&f, &["--key-file", key_s], "failed authentication"));
    assert!(
        problems.is_empty(),
        "{} case(s) not refused:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn key_files_must_be_private_and_long_enough() {
    let short = key_file("short.key", 31, 0o600);
    let o = run_bounded(&["restore", "x.ckpt", "--key-file", short.to_str().unwrap()], FAST);
    assert_clean_error(&o, "holds 31 bytes; a key needs at least 32 bytes");
    for mode in [0o640, 0o604, 0o620, 0o644] {
        let k = key_file(&format!("open-{mode:o}.key"), 32, mode);
        let o = run_bounded(&["restore", "x.ckpt", "--key-file", k.to_str().unwrap()], FAST);
        assert_clean_error(&o, &format!("has mode {mode:03o}: group or others may read or write"));
    }
    // Writing needs a valid key too, checked before any VM runs.
    let k = key_file("open-writer.key", 32, 0o644);
    let o =
        run_bounded(&["checkpoint", "--disk-every", "2", "--key-file", k.to_str().unwrap()], FAST);
    assert_clean_error(&o, "group or others may read or write");
    let o = run_bounded(&["checkpoint", "--key-file", good_key().to_str().unwrap()], FAST);
    assert_clean_error(&o, "give --disk-every too");
}
