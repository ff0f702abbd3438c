//! The Unix-socket API of `ninelives host`.
//!
//! One JSON object per line in each direction. Requests name an operation
//! and, where it applies, a VM id:
//!
//! ```text
//! {"op":"create", ...VM parameters...}   -> {"ok":true,"id":0}
//! {"op":"list"}                          -> {"ok":true,"vms":[...]}
//! {"op":"pause","id":0}                  -> {"ok":true}
//! {"op":"resume","id":0}                 -> {"ok":true}
//! {"op":"stats","id":0}                  -> {"ok":true,"stats":{...}}
//! {"op":"destroy","id":0}                -> {"ok":true}
//! {"op":"shutdown"}                      -> {"ok":true}   (stops the host)
//! ```
//!
//! Every failure is `{"ok":false,"error":"..."}`; a bad request never
//! affects the other VMs or other connections.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::host::Host;
use crate::{VmConfig, VmmError};

/// Longest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Turns the parameters of a `create` request into a VM configuration.
pub type ConfigBuilder = dyn Fn(&Value) -> Result<VmConfig, String> + Send + Sync;

/// Serves the API on `path` until a `shutdown` request.
pub fn serve(host: Arc<Host>, path: &Path, build: Arc<ConfigBuilder>) -> Result<(), VmmError> {
    if path.exists() {
        // A live host on this socket would answer; refuse to steal it.
        if UnixStream::connect(path).is_ok() {
            return Err(VmmError::Config(format!("{} is in use by another host", path.display())));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| VmmError::Config(format!("cannot listen on {}: {e}", path.display())))?;
    let done = Arc::new(AtomicBool::new(false));
    listener.set_nonblocking(true)?;
    let progress = crate::detect::track();
    while !done.load(Relaxed) {
        progress.beat();
        match listener.accept() {
            Ok((stream, _)) => {
                let (host, build, done) = (host.clone(), build.clone(), done.clone());
                let _ = std::thread::Builder::new()
                    .name("api-conn".into())
                    .spawn(move || serve_connection(stream, &host, &*build, &done));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    }
    progress.wait();
    host.shutdown();
    let _ = std::fs::remove_file(path);
    Ok(())
}

fn serve_connection(stream: UnixStream, host: &Host, build: &ConfigBuilder, done: &AtomicBool) {
    let _ = stream.set_nonblocking(false);
    let Ok(mut out) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    let progress = crate::detect::track();
    loop {
        let mut line = Vec::new();
        progress.wait();
        let got = (&mut reader).take(MAX_REQUEST as u64 + 1).read_until(b'\n', &mut line);
        progress.resume();
        match got {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = if line.len() > MAX_REQUEST {
            // Drop the rest of an oversized line, then answer it.
            let mut sink = Vec::new();
            let _ = (&mut reader).take(1 << 30).read_until(b'\n', &mut sink);
            json!({"ok": false, "error": format!("request longer than {MAX_REQUEST} bytes")})
        } else {
            match serde_json::from_slice::<Value>(&line) {
                Ok(req) => {
                    // Pause and destroy wait on vCPU threads, which are checked themselves.
                    if matches!(req.get("op").and_then(Value::as_str), Some("pause" | "destroy")) {
                        progress.wait();
                    }
                    handle(host, build, &req, done)
                }
                Err(e) => json!({"ok": false, "error": format!("malformed request: {e}")}),
            }
        };
        if writeln!(out, "{reply}").is_err() {
            return;
        }
    }
}

fn id_of(req: &Value) -> Result<u32, String> {
    req.get("id")
        .and_then(Value::as_u64)
        .and_then(|i| u32::try_from(i).ok())
        .ok_or_else(|| "this request needs a numeric \"id\"".to_string())
}

/// Handles one request.
pub fn handle(host: &Host, build: &ConfigBuilder, req: &Value, done: &AtomicBool) -> Value {
    let r = (|| -> Result<Value, String> {
        let op = req.get("op").and_then(Value::as_str).ok_or("request needs an \"op\" string")?;
        let e = |e: VmmError| e.to_string();
        Ok(match op {
            "create" => json!({"id": host.create(build(req)?).map_err(e)?}),
            "list" => json!({"vms": host.list()}),
            "pause" => {
                host.pause(id_of(req)?).map_err(e)?;
                json!({})
            }
            "resume" => {
                host.resume(id_of(req)?).map_err(e)?;
                json!({})
            }
            "stats" => json!({"stats": host.stats(id_of(req)?).map_err(e)?}),
            "destroy" => {
                host.destroy(id_of(req)?).map_err(e)?;
                json!({})
            }
            "shutdown" => {
                done.store(true, Relaxed);
                json!({})
            }
            other => {
                return Err(format!(
                "unknown op \"{other}\" (create, list, pause, resume, stats, destroy, shutdown)"
            ))
            }
        })
    })();
    match r {
        Ok(mut v) => {
            v["ok"] = json!(true);
            v
        }
        Err(e) => json!({"ok": false, "error": e}),
    }
}

/// Sends one request to a host and returns its reply.
pub fn request(path: &Path, req: &Value) -> Result<Value, VmmError> {
    let mut s = UnixStream::connect(path)
        .map_err(|e| VmmError::Config(format!("cannot connect to {}: {e}", path.display())))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    writeln!(s, "{req}")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| VmmError::Config(format!("bad reply from host: {e}")))
}
