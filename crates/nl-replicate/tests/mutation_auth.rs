//! Tests written against surviving cargo-mutants mutants of nl-replicate
//! (docs/testing.md, mutation section), kept apart from the sources.

use nl_replicate::auth::Key;

/// A key printed with `{:?}` (in a log line or an error) shows no key
/// material, only that it is a key.
#[test]
fn a_key_debug_prints_without_its_bytes() {
    let k = Key::from_bytes(&[0x41; 64]).unwrap();
    let s = format!("{k:?}");
    assert_eq!(s, "Key(..)");
    assert!(!s.contains("65") && !s.contains('A'), "{s}");
}
