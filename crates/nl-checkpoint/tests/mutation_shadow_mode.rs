//! Tests written against surviving cargo-mutants mutants of nl-checkpoint
//! (docs/testing.md, mutation section), kept apart from the engine and
//! shadow sources that change for performance.

use nl_checkpoint::shadow::Shadow;
use nl_checkpoint::Mode;
use nl_memory::GuestMemory;

const PAGE: usize = 4096;

/// Each mode's name is the one its CLI option takes, and they differ.
#[test]
fn every_mode_has_its_own_name() {
    let names: Vec<&str> = [Mode::CowB, Mode::CowP, Mode::DirtyLog, Mode::Compare, Mode::Auto]
        .map(Mode::name)
        .to_vec();
    assert_eq!(names, ["cow-b", "cow-p", "dirty-log", "compare", "auto"]);
}

/// `set_page` overwrites exactly the page it names in the shadow copy,
/// the first page of RAM and one further in alike.
#[test]
fn set_page_overwrites_that_page_of_the_shadow_only() {
    let m = GuestMemory::new("shadow-mutation-test", 64 << 20).unwrap();
    let mut s = Shadow::capture(&m).unwrap();
    for (gpa, byte) in [(0u64, 0xa5u8), (0x3000, 0x5a)] {
        s.set_page(gpa, &[byte; PAGE]).unwrap();
        assert!(s.page(gpa).unwrap().iter().all(|&b| b == byte), "page {gpa:#x}");
    }
    assert!(s.page(0x1000).unwrap().iter().all(|&b| b == 0), "a neighbour changed");
    let e = s.set_page(1 << 40, &[1; PAGE]).unwrap_err().to_string();
    assert!(e.contains("not guest RAM"), "{e}");
}
