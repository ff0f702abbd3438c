//! Links the binary with this crate's linker script (fixed load address).
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    println!("cargo:rustc-link-arg-bins=-T{dir}/link.ld");
    println!("cargo:rerun-if-changed={dir}/link.ld");
    println!("cargo:rerun-if-changed=build.rs");
}
