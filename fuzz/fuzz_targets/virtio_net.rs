#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nl_fuzz::virtio::net(data));
