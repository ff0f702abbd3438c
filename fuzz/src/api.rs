//! A hostile client against the host API's request handling: the fuzzer's
//! bytes are split into request lines as the host splits them, parsed, and
//! handled by a real host (KVM), with `create` requests fully checked by the
//! same builder `ninelives host` uses, but never started.
//!
//! Properties checked for every input:
//! - no panic;
//! - every request gets exactly one reply, `{"ok":true,...}` or
//!   `{"ok":false,"error":"<non-empty>"}`;
//! - no VM comes to exist.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use nl_vmm::api::{handle, MAX_REQUEST};
use nl_vmm::host::Host;
use serde_json::Value;

fn host() -> &'static Arc<Host> {
    static HOST: OnceLock<Arc<Host>> = OnceLock::new();
    HOST.get_or_init(|| Host::new().expect("the API target needs /dev/kvm"))
}

pub fn request(data: &[u8]) {
    let host = host();
    // Validated exactly as `ninelives host` would, then not created.
    let build = |req: &Value| -> Result<nl_vmm::VmConfig, String> {
        ninelives::cmd::host::build_config(req)?;
        Err("fuzzing: a valid VM is not started".into())
    };
    let done = AtomicBool::new(false);
    for line in data.split(|&b| b == b'\n').take(64) {
        if line.len() >= MAX_REQUEST {
            continue; // refused by the reader before any parsing
        }
        let reply = match serde_json::from_slice::<Value>(line) {
            Ok(req) => handle(host, &build, &req, &done),
            Err(_) => continue, // answered "malformed request" by the server
        };
        match reply.get("ok") {
            Some(Value::Bool(true)) => {}
            Some(Value::Bool(false)) => {
                let e = reply.get("error").and_then(Value::as_str).unwrap_or("");
                assert!(!e.is_empty(), "an error reply without a reason: {reply}");
            }
            _ => panic!("a reply without ok: {reply}"),
        }
    }
    assert!(host.list().is_empty(), "a VM exists after fuzzed requests");
}
