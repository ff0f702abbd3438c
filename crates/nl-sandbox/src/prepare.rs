//! Restart VMs built ahead of the fault.
//!
//! Creating a KVM VM registers its memory slots and its interrupt chip,
//! and each of those waits for an SRCU grace period in the kernel
//! (`kvm_swap_active_memslots` → `synchronize_srcu`). With no vCPU running
//! in the process that takes well under a millisecond; while other
//! sandboxes' vCPUs run, it took from 0.1 s to 30 s on this host (seen in
//! `bench sandbox-recovery`: the `restart` row's `image` phase, with the
//! monitor's kernel stack in `__synchronize_srcu`). A restart that builds
//! its VM after the fault inherits that wait.
//!
//! So a `restart` or `replace` sandbox's monitor has a helper thread that
//! builds the VM of its next restart while the sandbox runs
//! (fresh memory with the images loaded,
//! the sandbox's windows, a spare net device) and leaves it with the
//! monitor. A restart takes it (its `image_prepared` phase flag says so)
//! and the helper builds the next one. The first one is built before the
//! set's vCPUs start ([`prebuild`], from [`SandboxSet::start_all`]), when
//! a build is quick. A restart that finds none (a second fault before the
//! helper finished) builds its VM itself, as before.
//!
//! Not for sandboxes on a `memory_file` (their memory is that file, which a
//! restart truncates: a VM built ahead would share it with the running
//! one), `stop` or `rollback` sandboxes. Each prepared VM holds the
//! sandbox's memory size once more (untouched pages cost nothing until
//! the guest writes them).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nl_memory::GuestMemory;
use nl_vmm::windows::VmWindows;
use nl_vmm::{Vm, VmConfig};

use crate::config::RecoveryPolicy;
use crate::monitor::Monitor;
use crate::set::{Sandbox, SandboxSet};
use crate::SandboxError;

/// How often the builder looks whether a VM is needed.
const POLL: Duration = Duration::from_millis(20);

/// What a restart VM of one sandbox is built from
/// ([`SandboxSet::restart_recipe`]), owned: the builder thread is detached,
/// so a build stuck in the kernel never holds up the end of the set's
/// supervision.
pub(crate) struct Recipe {
    pub(crate) index: u32,
    pub(crate) name: String,
    pub(crate) config: VmConfig,
    pub(crate) windows: VmWindows,
    pub(crate) mem_bytes: u64,
}

impl Recipe {
    /// The VM over `memory` (images loaded there), not started.
    pub(crate) fn create(
        &self,
        kvm: &kvm_ioctls::Kvm,
        memory: GuestMemory,
    ) -> Result<Vm, SandboxError> {
        Vm::create_with_windows(
            kvm,
            self.index,
            self.config.clone(),
            Some(memory),
            Some(self.windows.clone()),
        )
        .map_err(|e| SandboxError::Vm(self.name.clone(), format!("restart: {e}")))
    }
}

/// A running builder; [`Builder::finish`] ends it.
pub(crate) struct Builder {
    done: Arc<AtomicBool>,
    monitor: Arc<Monitor>,
}

impl Builder {
    /// Ends the builder and drops the VM it left (a build under way ends
    /// on its own thread, and its VM is dropped there).
    pub(crate) fn finish(self) {
        self.done.store(true, Ordering::SeqCst);
        drop(self.monitor.take_next_vm());
    }
}

/// Whether `sb`'s restarts use VMs built ahead: not for `stop` or
/// `rollback` sandboxes, nor those on a `memory_file`.
fn eligible(sb: &Sandbox) -> bool {
    matches!(sb.config.recovery.policy, RecoveryPolicy::Restart | RecoveryPolicy::Replace)
        && sb.config.memory_file.is_none()
}

/// `sb`'s restart recipe and a KVM handle to build it with.
fn recipe(sb: &Sandbox) -> Result<(Recipe, kvm_ioctls::Kvm), SandboxError> {
    SandboxSet::restart_recipe(sb, sb.config.recovery.policy).and_then(|r| {
        let kvm = nl_vmm::open_kvm()
            .map_err(|e| SandboxError::Vm(sb.config.name.clone(), e.to_string()))?;
        Ok((r, kvm))
    })
}

/// Builds `sb`'s first restart VM now, before the set's vCPUs run: then
/// the kernel's grace periods are not starved (see the module doc) and the
/// build takes milliseconds, so even a fault in the first seconds finds a
/// VM ready. A build that fails is reported; the builder thread tries
/// again once the set runs.
pub(crate) fn prebuild(sb: &Sandbox) {
    if !eligible(sb) || sb.monitor.next_vm_ready() {
        return;
    }
    let built = recipe(sb).and_then(|(r, kvm)| {
        crate::set::anonymous_ram(&r.name, r.mem_bytes).and_then(|memory| r.create(&kvm, memory))
    });
    match built {
        Ok(vm) => sb.monitor.stash_next_vm(vm),
        Err(e) => eprintln!("ninelives: {e}: its first restart VM is built once the set runs"),
    }
}

/// Starts `sb`'s builder if its restarts use VMs built ahead
/// ([`eligible`]).
pub(crate) fn start(sb: &Sandbox) -> Option<Builder> {
    if !eligible(sb) {
        return None;
    }
    let (recipe, kvm) = match recipe(sb) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("ninelives: {e}: its restarts build their own VMs");
            return None;
        }
    };
    let done = Arc::new(AtomicBool::new(false));
    let monitor = sb.monitor.clone();
    let (d, m) = (done.clone(), monitor.clone());
    std::thread::Builder::new()
        .name(format!("prepare-{}", sb.config.name))
        .spawn(move || run(&recipe, &kvm, &m, &d))
        .inspect_err(|e| eprintln!("ninelives: cannot start a VM builder thread: {e}"))
        .ok()?;
    Some(Builder { done, monitor })
}

/// Keeps one VM ready until `done`. A build that fails is reported once
/// and not retried (restarts then build their own VMs).
fn run(recipe: &Recipe, kvm: &kvm_ioctls::Kvm, monitor: &Monitor, done: &AtomicBool) {
    while !done.load(Ordering::SeqCst) {
        if !monitor.next_vm_ready() {
            crate::trace(format_args!("{}: build next VM: begin", recipe.name));
            let built = crate::set::anonymous_ram(&recipe.name, recipe.mem_bytes)
                .and_then(|memory| recipe.create(kvm, memory));
            match built {
                // Finished meanwhile: the VM is dropped here.
                Ok(_) if done.load(Ordering::SeqCst) => return,
                Ok(vm) => {
                    crate::trace(format_args!("{}: build next VM: end", recipe.name));
                    monitor.stash_next_vm(vm)
                }
                Err(e) => {
                    eprintln!("ninelives: {e}; its restarts build their own VMs");
                    return;
                }
            }
        }
        std::thread::sleep(POLL);
    }
}
