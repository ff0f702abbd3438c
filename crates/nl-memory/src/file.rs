//! Reading a file that ninelives is given (a checkpoint, a kernel, a
//! handover record, a latency file, a key) without trusting it.
//!
//! Every such read goes through [`read_limited`] (by path) or
//! [`read_open_limited`] (an open descriptor): the file is opened without
//! blocking (a FIFO cannot stall the open), checked with `fstat` to be a
//! regular file (a character device such as `/dev/zero`, a FIFO, a socket
//! or a directory is refused) of at most the caller's limit, and read
//! through a `take(limit + 1)` guard, so a file that grows while it is read
//! cannot push more than the limit into memory. Errors name the file, what
//! it was for, its size and the limit.

use std::fs::File;
use std::io::{Read, Seek};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    // `io` is not marked as the source: the message already holds it, and
    // an error chain printed in full would repeat it.
    #[error("cannot open {what} {path}: {io}")]
    Open { what: String, path: String, io: std::io::Error },
    #[error("cannot read {what} {path}: {io}")]
    Read { what: String, path: String, io: std::io::Error },
    #[error("{what} {path} is {kind}, not a regular file")]
    NotRegular { what: String, path: String, kind: &'static str },
    #[error("{what} {path} is {size} bytes; the limit for a {what} is {limit} bytes")]
    TooLarge { what: String, path: String, size: u64, limit: u64 },
    #[error("{what} {path} grew past the limit of {limit} bytes while it was read")]
    Grew { what: String, path: String, limit: u64 },
    #[error(
        "{what} {path} has mode {mode:03o}: group or others may read or write it (chmod 600 it)"
    )]
    Exposed { what: String, path: String, mode: u32 },
    #[error("{what} {path} holds {size} bytes; a key needs at least {min} bytes")]
    TooShort { what: String, path: String, size: u64, min: u64 },
}

fn kind_of(ft: std::fs::FileType) -> &'static str {
    if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading without blocking on a FIFO, and checks it is a
/// regular file of at most `limit` bytes. Returns the file and its size.
pub fn open_limited(path: &Path, what: &str, limit: u64) -> Result<(File, u64), FileError> {
    let p = path.display().to_string();
    let file = std::fs::OpenOptions::new()
        .read(true)
        // O_NONBLOCK: opening a FIFO with no writer would otherwise block.
        // It has no effect on reads of a regular file, the only kind kept.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|io| FileError::Open { what: what.into(), path: p.clone(), io })?;
    let size = check_open(&file, &p, what, limit)?;
    Ok((file, size))
}

/// `fstat` checks of an open file: regular, at most `limit` bytes.
fn check_open(file: &File, path: &str, what: &str, limit: u64) -> Result<u64, FileError> {
    let meta = file.metadata().map_err(|io| FileError::Read {
        what: what.into(),
        path: path.into(),
        io,
    })?;
    if !meta.file_type().is_file() {
        return Err(FileError::NotRegular {
            what: what.into(),
            path: path.into(),
            kind: kind_of(meta.file_type()),
        });
    }
    if meta.len() > limit {
        return Err(FileError::TooLarge {
            what: what.into(),
            path: path.into(),
            size: meta.len(),
            limit,
        });
    }
    Ok(meta.len())
}

/// Reads a whole regular file of at most `limit` bytes (see the module docs).
/// `what` names the file's role in errors ("checkpoint file", "kernel image").
pub fn read_limited(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>, FileError> {
    let (file, size) = open_limited(path, what, limit)?;
    read_guarded(file, size, &path.display().to_string(), what, limit)
}

/// Reads a secret (a key file): [`read_limited`], and the file must be its
/// owner's alone (no permission bits for group or others) and hold at
/// least `min` bytes.
pub fn read_secret(path: &Path, what: &str, min: u64, limit: u64) -> Result<Vec<u8>, FileError> {
    use std::os::unix::fs::PermissionsExt;
    let p = path.display().to_string();
    let (file, size) = open_limited(path, what, limit)?;
    let mode = file
        .metadata()
        .map_err(|io| FileError::Read { what: what.into(), path: p.clone(), io })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(FileError::Exposed { what: what.into(), path: p, mode: mode & 0o777 });
    }
    let b = read_guarded(file, size, &p, what, limit)?;
    if (b.len() as u64) < min {
        return Err(FileError::TooShort { what: what.into(), path: p, size: b.len() as u64, min });
    }
    Ok(b)
}

/// [`read_limited`] for a file already open (an inherited memfd, say),
/// read from its start; `name` stands for its path in errors.
pub fn read_open_limited(
    file: &mut File,
    name: &str,
    what: &str,
    limit: u64,
) -> Result<Vec<u8>, FileError> {
    let size = check_open(file, name, what, limit)?;
    file.rewind().map_err(|io| FileError::Read { what: what.into(), path: name.into(), io })?;
    read_guarded(file, size, name, what, limit)
}

fn read_guarded(
    file: impl Read,
    size: u64,
    path: &str,
    what: &str,
    limit: u64,
) -> Result<Vec<u8>, FileError> {
    // The capacity is the size fstat saw (at most the limit), not what the file claims later.
    let mut b = Vec::with_capacity(size as usize);
    file.take(limit.saturating_add(1)).read_to_end(&mut b).map_err(|io| FileError::Read {
        what: what.into(),
        path: path.into(),
        io,
    })?;
    if b.len() as u64 > limit {
        return Err(FileError::Grew { what: what.into(), path: path.into(), limit });
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("nl-file-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn a_regular_file_within_the_limit_is_read() {
        let p = temp("ok", b"hello");
        assert_eq!(read_limited(&p, "test file", 5).unwrap(), b"hello");
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_file_over_the_limit_is_refused_with_its_size_and_the_limit() {
        let p = temp("big", &[7u8; 100]);
        let e = read_limited(&p, "test file", 99).unwrap_err().to_string();
        assert!(
            e.contains("100 bytes") && e.contains("99 bytes") && e.contains("test file"),
            "{e}"
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn devices_fifos_and_directories_are_refused() {
        let e = read_limited(Path::new("/dev/zero"), "kernel image", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("/dev/zero is a character device"), "{e}");
        let e = read_limited(Path::new("/tmp"), "kernel image", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let fifo = std::env::temp_dir().join(format!("nl-file-{}-fifo", std::process::id()));
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: c is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Without O_NONBLOCK this open would wait for a writer forever.
        let e = read_limited(&fifo, "latency file", 1 << 20).unwrap_err();
        assert!(e.to_string().contains("is a FIFO"), "{e}");
        std::fs::remove_file(fifo).unwrap();
    }

    #[test]
    fn an_open_file_that_grew_past_its_limit_is_refused() {
        // fstat sees 4 bytes; the take guard still stops at limit + 1.
        let p = temp("grow", b"abcd");
        let mut f = File::open(&p).unwrap();
        let mut w = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        let size = check_open(&f, "grow", "test file", 8).unwrap();
        w.write_all(&[1u8; 64]).unwrap();
        let e = read_guarded(&mut f, size, "grow", "test file", 8).unwrap_err();
        assert!(matches!(e, FileError::Grew { limit: 8, .. }), "{e}");
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_source_that_never_ends_stops_at_the_limit() {
        // What /dev/zero would be if fstat were fooled: the guard still ends the read.
        let e = read_guarded(std::io::repeat(0), 0, "endless", "test file", 1 << 20).unwrap_err();
        assert!(matches!(e, FileError::Grew { limit: 1048576, .. }), "{e}");
    }
}
