//! Harnesses of ninelives' fuzz targets: each takes the fuzzer's bytes and
//! drives one parser of untrusted input, checking the properties that must
//! hold for every input (no panic, no hang, a clean refusal, recovery).
//! `fuzz_targets/*.rs` are one-line libFuzzer entry points over these.

pub mod virtio;
pub mod replicate;
pub mod api;
