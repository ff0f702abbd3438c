//! Which KVM backend serves /dev/kvm.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Pagetable-based Virtual Machine: guest ring 0 emulated, ring 3 native.
    Pvm,
    /// Intel VMX.
    Vmx,
    /// AMD SVM.
    Svm,
    Unknown,
}

impl Backend {
    /// Detects the backend from the loaded kernel modules.
    pub fn detect() -> Self {
        let loaded = |m: &str| std::path::Path::new(&format!("/sys/module/{m}")).exists();
        if loaded("kvm_pvm") {
            Backend::Pvm
        } else if loaded("kvm_intel") {
            Backend::Vmx
        } else if loaded("kvm_amd") {
            Backend::Svm
        } else {
            Backend::Unknown
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Pvm => "pvm",
            Backend::Vmx => "vmx",
            Backend::Svm => "svm",
            Backend::Unknown => "unknown",
        })
    }
}
