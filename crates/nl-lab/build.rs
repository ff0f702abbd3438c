//! Records the git revision the lab is built from (`NL_LAB_GIT_REVISION`),
//! so every result it writes names the code that measured it.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    if let Some(rev) = git(&["describe", "--always", "--dirty", "--abbrev=12"]) {
        println!("cargo:rustc-env=NL_LAB_GIT_REVISION={rev}");
    }
    // Rebuilt when HEAD moves (a commit, a checkout) or the index changes.
    for p in ["HEAD", "index", "logs/HEAD"] {
        if let Some(path) = git(&["rev-parse", "--git-path", p]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
