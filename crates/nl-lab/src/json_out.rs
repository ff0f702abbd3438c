//! The lab's JSON output, written once: every result carries its
//! provenance (the git revision of the binary, the load average before and
//! after the run), and a command prints its result as one JSON object on
//! the last line of stdout, which [`last_json`] reads back from a child.

use serde::Serialize;
use serde_json::Value;

/// The git revision the binary was built from (`git describe --always
/// --dirty` at build time; "unknown" outside a git checkout).
pub const GIT_REVISION: &str = match option_env!("NL_LAB_GIT_REVISION") {
    Some(r) => r,
    None => "unknown",
};

/// The host's load average as `/proc/loadavg` gives it (1, 5, 15 minutes,
/// runnable/total tasks, last pid), or "" where it cannot be read.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

/// Where and under what load a result was measured.
#[derive(Clone, Debug, Serialize)]
pub struct Provenance {
    pub git_revision: &'static str,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// Takes the "before" half of a [`Provenance`] when a run starts.
pub struct RunClock {
    loadavg_before: String,
}

impl RunClock {
    pub fn start() -> RunClock {
        RunClock { loadavg_before: loadavg() }
    }

    /// The provenance of the run that is ending now.
    pub fn finish(&self) -> Provenance {
        Provenance {
            git_revision: GIT_REVISION,
            loadavg_before: self.loadavg_before.clone(),
            loadavg_after: loadavg(),
        }
    }
}

/// `result` with `"provenance"` added (an object result only).
pub fn with_provenance(mut result: Value, p: &Provenance) -> Value {
    if let Some(o) = result.as_object_mut() {
        o.insert("provenance".into(), serde_json::to_value(p).unwrap_or(Value::Null));
    }
    result
}

/// Prints `result` as one line of JSON (the last line of stdout).
pub fn print_json(result: &impl Serialize) {
    match serde_json::to_string(result) {
        Ok(s) => println!("{s}"),
        Err(e) => println!("{{\"error\":\"cannot serialize the result: {e}\"}}"),
    }
}

/// The last line of `out` that is a JSON object (a child's result).
pub fn last_json(out: &str) -> Option<Value> {
    out.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok().filter(Value::is_object))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_json_skips_trailing_text_and_non_objects() {
        assert_eq!(last_json("a\n{\"x\":1}\nbye\n"), Some(serde_json::json!({"x":1})));
        assert_eq!(last_json("{\"x\":1}\n42\n"), Some(serde_json::json!({"x":1})));
        assert_eq!(last_json("nothing\n"), None);
    }

    #[test]
    fn provenance_is_added_to_objects() {
        let p = RunClock::start().finish();
        let v = with_provenance(serde_json::json!({"a":1}), &p);
        assert_eq!(v["provenance"]["git_revision"], GIT_REVISION);
        assert!(v["provenance"]["loadavg_before"].is_string());
    }
}
