//! The recovery policy the detectors are installed with is the one the
//! recovery code then follows (a process of its own: the policy is set
//! once per process). The microreset policy is checked in
//! `recovery_threads.rs`.

use nl_vmm::recovery::{self, Policy};

#[test]
fn microreboot_is_the_policy_installed_and_keeps_no_undo_log() {
    nl_vmm::detect::install(Policy::Microreboot);
    assert_eq!(recovery::policy(), Policy::Microreboot);
    assert_eq!(recovery::policy().name(), "microreboot");
    // Only a microreset that retries exits keeps the undo log.
    assert!(!recovery::undo_logging());
}
