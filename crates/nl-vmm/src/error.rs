use thiserror::Error;

#[derive(Debug, Error)]
pub enum VmmError {
    #[error("cannot open the KVM device ({0}): ninelives needs KVM; check that a kvm module is loaded and /dev/kvm is accessible")]
    NoKvm(String),
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Memory(#[from] nl_memory::MemoryError),
    #[error(transparent)]
    Arch(#[from] nl_arch::ArchError),
    #[error(transparent)]
    Bus(#[from] nl_devices::BusError),
    #[error("KVM {what} failed: {err}")]
    Kvm { what: &'static str, err: kvm_ioctls::Error },
    #[error("VM state: {0}")]
    State(String),
    #[error("VM {0}: {1}")]
    Vm(u32, String),
    /// No VM has this id (the API answers 404).
    #[error("VM {0}: no such VM")]
    NoSuchVm(u32),
    /// Refused by the host's budgets or state (the API answers 409).
    #[error("{0}")]
    Refused(String),
    #[error("disk: {0}")]
    Disk(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Shorthand for mapping a KVM ioctl error.
pub fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
    move |err| VmmError::Kvm { what, err }
}
