//! GSI routes of the reference guest's interrupts that KVM injects from an
//! irqfd: the virtio-net receive interrupt ([`nl_abi::VIRTIO_NET_GSI`] to
//! [`nl_abi::NET_VECTOR`]) and the channel doorbells
//! ([`nl_abi::DOORBELL_GSI`] to [`nl_abi::DOORBELL_VECTOR`]), both on
//! vCPU 0.
//!
//! They are MSI routes, not IOAPIC pins. An irqfd whose GSI goes to an
//! IOAPIC pin is not injected where it is signalled: `irqfd_wakeup` asks
//! `kvm_arch_set_irq_inatomic`, which on x86 injects only MSI (and Hyper-V
//! and Xen) routes, and queues every other one to a kernel worker on the
//! signalling CPU's system workqueue (`irqfd_inject`). That CPU is busy
//! with the signaller, a vCPU thread or a device thread, so each doorbell
//! and each received frame waited for the worker to be scheduled: a
//! doorbell round trip took about 100 µs here against 14 µs for an
//! eventfd round trip between two host threads on the same cores. An MSI
//! route is injected in the wake-up itself (the target vCPU kicked at
//! once).
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, so the routes are KVM's
//! default table (GSIs 0..=15 to the 8259 PICs and the IOAPIC, 16..=23 to
//! the IOAPIC) with the given GSIs' entries replaced. Linux guests keep
//! the default table (they program their IOAPIC themselves).

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_irq_routing_entry__bindgen_ty_1, kvm_irq_routing_irqchip,
    kvm_irq_routing_msi, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::VmFd;

use crate::error::{kvm, VmmError};

/// IOAPIC pins of KVM's default routing.
const IOAPIC_PINS: u32 = 24;
/// An MSI to the local APIC with ID 0, physical destination mode.
const MSI_ADDRESS_APIC0: u32 = 0xfee0_0000;

/// One route of a GSI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// To a pin of an in-kernel interrupt controller (`KVM_IRQCHIP_*`).
    Irqchip { chip: u32, pin: u32 },
    /// Fixed delivery, edge-triggered, of a vector to vCPU 0.
    Msi { vector: u8 },
}

impl Route {
    fn entry(self, gsi: u32) -> kvm_irq_routing_entry {
        let (type_, u) = match self {
            Route::Irqchip { chip, pin } => (
                KVM_IRQ_ROUTING_IRQCHIP,
                kvm_irq_routing_entry__bindgen_ty_1 {
                    irqchip: kvm_irq_routing_irqchip { irqchip: chip, pin },
                },
            ),
            Route::Msi { vector } => (
                KVM_IRQ_ROUTING_MSI,
                kvm_irq_routing_entry__bindgen_ty_1 {
                    msi: kvm_irq_routing_msi {
                        address_lo: MSI_ADDRESS_APIC0,
                        data: u32::from(vector),
                        ..Default::default()
                    },
                },
            ),
        };
        kvm_irq_routing_entry { gsi, type_, u, ..Default::default() }
    }
}

/// KVM's default routing with each `(gsi, vector)` of `to_vcpu0` an MSI
/// route to vCPU 0 instead.
pub(crate) fn table(to_vcpu0: &[(u32, u8)]) -> Vec<(u32, Route)> {
    let mut t = Vec::new();
    for gsi in 0..IOAPIC_PINS {
        if let Some(&(_, vector)) = to_vcpu0.iter().find(|(g, _)| *g == gsi) {
            t.push((gsi, Route::Msi { vector }));
            continue;
        }
        if gsi < 16 {
            let chip = if gsi < 8 { KVM_IRQCHIP_PIC_MASTER } else { KVM_IRQCHIP_PIC_SLAVE };
            t.push((gsi, Route::Irqchip { chip, pin: gsi % 8 }));
        }
        t.push((gsi, Route::Irqchip { chip: KVM_IRQCHIP_IOAPIC, pin: gsi }));
    }
    t
}

/// Sets the VM's routing to [`table`]`(to_vcpu0)` (the in-kernel irqchip
/// exists).
pub(crate) fn route_to_vcpu0(vm: &VmFd, to_vcpu0: &[(u32, u8)]) -> Result<(), VmmError> {
    let entries: Vec<_> = table(to_vcpu0).into_iter().map(|(gsi, r)| r.entry(gsi)).collect();
    let mut routing = KvmIrqRouting::new(entries.len()).map_err(|e| {
        VmmError::Config(format!("cannot size a routing table of {} entries: {e:?}", entries.len()))
    })?;
    routing.as_mut_slice().copy_from_slice(&entries);
    vm.set_gsi_routing(&routing).map_err(kvm("KVM_SET_GSI_ROUTING"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_the_default_one_with_the_given_gsis_sent_to_vcpu0_by_msi() {
        let t = table(&[(nl_abi::DOORBELL_GSI, nl_abi::DOORBELL_VECTOR)]);
        let of = |gsi: u32| t.iter().filter(|e| e.0 == gsi).map(|e| e.1).collect::<Vec<_>>();
        // 16 GSIs with a PIC and an IOAPIC route, 8 with one route.
        assert_eq!(t.len(), 16 * 2 + 8);
        assert_eq!(of(nl_abi::DOORBELL_GSI), [Route::Msi { vector: nl_abi::DOORBELL_VECTOR }]);
        let pin = |chip, pin| Route::Irqchip { chip, pin };
        let net = nl_abi::VIRTIO_NET_GSI;
        assert_eq!(of(net), [pin(KVM_IRQCHIP_IOAPIC, net)]);
        assert_eq!(of(9), [pin(KVM_IRQCHIP_PIC_SLAVE, 1), pin(KVM_IRQCHIP_IOAPIC, 9)]);
        assert_eq!(of(3), [pin(KVM_IRQCHIP_PIC_MASTER, 3), pin(KVM_IRQCHIP_IOAPIC, 3)]);
    }
}
