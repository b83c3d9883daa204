//! A vCPU's architectural state, saved and restored with KVM's ioctls: general and special
//! registers, the XSAVE area (x87, SSE, AVX), XCR0, and pending events (exceptions,
//! interrupts, NMIs). Serialisable with serde (kvm-bindings' `serde` feature), for snapshots.
//!
//! Not saved: MSRs other than EFER (in the special registers) and the local APIC, which the
//! test guest does not use (it runs without an in-kernel irqchip); a Linux guest's state would
//! need them.

use kvm_bindings::{kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

/// One vCPU's state.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    /// General registers.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, EFER.
    pub sregs: kvm_sregs,
    /// The XSAVE area.
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Pending exceptions, interrupts and NMIs.
    pub events: kvm_vcpu_events,
}

/// Which ioctl failed.
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {source}")]
pub struct StateError {
    /// The ioctl.
    pub what: &'static str,
    /// KVM's error.
    pub source: kvm_ioctls::Error,
}

fn failed(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> StateError {
    move |source| StateError { what, source }
}

impl VcpuState {
    /// Reads `vcpu`'s state. The vCPU must not be running (call from its own thread between
    /// runs, or before it starts).
    pub fn save(vcpu: &VcpuFd) -> Result<Self, StateError> {
        Ok(VcpuState {
            regs: vcpu.get_regs().map_err(failed("KVM_GET_REGS"))?,
            sregs: vcpu.get_sregs().map_err(failed("KVM_GET_SREGS"))?,
            xsave: vcpu.get_xsave().map_err(failed("KVM_GET_XSAVE"))?,
            xcrs: vcpu.get_xcrs().map_err(failed("KVM_GET_XCRS"))?,
            events: vcpu
                .get_vcpu_events()
                .map_err(failed("KVM_GET_VCPU_EVENTS"))?,
        })
    }

    /// Gives `vcpu` (not running) this state: special registers first (paging and modes), then
    /// XCR0 before the XSAVE area it governs, then the rest.
    pub fn restore(&self, vcpu: &VcpuFd) -> Result<(), StateError> {
        vcpu.set_sregs(&self.sregs)
            .map_err(failed("KVM_SET_SREGS"))?;
        vcpu.set_xcrs(&self.xcrs).map_err(failed("KVM_SET_XCRS"))?;
        // SAFETY: `kvm_xsave` is the fixed 4096-byte area of KVM_GET_XSAVE; this VM never
        // enables the dynamic XSAVE features (AMX) that need a larger buffer, so KVM reads no
        // more than the struct holds.
        unsafe { vcpu.set_xsave(&self.xsave) }.map_err(failed("KVM_SET_XSAVE"))?;
        vcpu.set_regs(&self.regs).map_err(failed("KVM_SET_REGS"))?;
        vcpu.set_vcpu_events(&self.events)
            .map_err(failed("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}
