//! The command-line options a successor process inherits from this one.
//!
//! A warm rejuvenation starts a new `ninelives host` and a microreboot execs
//! one. Each builds that process's command line itself (the API socket, the
//! handover record), and the process-wide settings the user chose when the
//! host started must come along: otherwise a host started with
//! `--log-format json` would log text after its first rejuvenation, and one
//! started with `--seccomp off` would come back filtered. The front end
//! registers those settings once, at start ([`inherit`]); [`args`] is what
//! both successors append.

use std::sync::OnceLock;

static INHERITED: OnceLock<Vec<String>> = OnceLock::new();

/// Registers the global options (as command-line arguments, e.g.
/// `["--log-format", "json"]`) every successor of this process is started
/// with. Only the first call counts: the settings are the process's own.
pub fn inherit(args: Vec<String>) {
    let _ = INHERITED.set(args);
}

/// The arguments a successor process is started with besides its command:
/// the seccomp setting and whatever the front end registered.
pub fn args() -> Vec<String> {
    let mut a = crate::seccomp::successor_args();
    a.extend(INHERITED.get().into_iter().flatten().cloned());
    a
}

#[cfg(test)]
mod tests {
    #[test]
    fn registered_options_follow_the_seccomp_setting() {
        super::inherit(vec!["--log-format".into(), "json".into()]);
        super::inherit(vec!["--log-format".into(), "text".into()]);
        let a = super::args();
        assert!(a.ends_with(&["--log-format".to_string(), "json".to_string()]), "{a:?}");
    }
}
