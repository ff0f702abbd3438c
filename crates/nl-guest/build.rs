//! Builds the reference guest (the separate cargo workspace in `guest/`) with
//! a nested `cargo build --release` and copies its two ELF images to OUT_DIR,
//! where `src/lib.rs` embeds them.
//!
//! The nested build runs in `guest/` so that `guest/.cargo/config.toml` (the
//! freestanding, static, non-PIE flags) applies, with its own target dir under
//! OUT_DIR, and with the environment of this outer build removed so that none
//! of it (RUSTFLAGS, a clippy wrapper, target or profile overrides, the
//! jobserver) leaks into the guest build.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The target the guest is built for (set in guest/.cargo/config.toml).
const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir.join("../..");
    let guest = root.join("guest");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = out_dir.join("guest-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));

    println!("cargo:rerun-if-changed=build.rs");
    for path in [
        "guest/Cargo.toml",
        "guest/Cargo.lock",
        "guest/.cargo/config.toml",
        "guest/kernel",
        "guest/user",
        "crates/nl-abi/Cargo.toml",
        "crates/nl-abi/src",
        "crates/nl-workloads/Cargo.toml",
        "crates/nl-workloads/src",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }

    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&guest)
        .args(["build", "--release", "--locked", "--target-dir"])
        .arg(&target_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, _) in env::vars_os() {
        if scrub(&key) {
            cmd.env_remove(&key);
        }
    }
    let output = match cmd.output() {
        Ok(output) => output,
        Err(e) => fail(&format!("cannot run {}: {e}", Path::new(&cargo).display())),
    };
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stdout));
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        fail(&format!(
            "the nested `cargo build --release` of the guest in {} failed ({}); its output is above",
            guest.display(),
            output.status
        ));
    }

    let built = target_dir.join(GUEST_TARGET).join("release");
    for (bin, name) in [("kernel", "kernel.elf"), ("user", "user.elf")] {
        let from = built.join(bin);
        let to = out_dir.join(name);
        if let Err(e) = fs::copy(&from, &to) {
            fail(&format!("cannot copy {} to {}: {e}", from.display(), to.display()));
        }
    }
}

/// Whether an inherited environment variable must not reach the nested
/// cargo: everything cargo sets or reads for this build (CARGO_*, except the
/// user's CARGO_HOME), the flags and wrappers, and the jobserver.
fn scrub(key: &OsString) -> bool {
    let Some(key) = key.to_str() else {
        return false;
    };
    if key == "CARGO_HOME" {
        return false;
    }
    key.starts_with("CARGO_")
        || key.starts_with("DEP_")
        || matches!(
            key,
            "RUSTFLAGS"
                | "RUSTDOCFLAGS"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTC_LINKER"
                | "MAKEFLAGS"
                | "MFLAGS"
                | "OUT_DIR"
                | "TARGET"
                | "HOST"
                | "PROFILE"
                | "OPT_LEVEL"
                | "DEBUG"
                | "NUM_JOBS"
        )
}

fn fail(msg: &str) -> ! {
    eprintln!("error: nl-guest: {msg}");
    std::process::exit(1);
}
