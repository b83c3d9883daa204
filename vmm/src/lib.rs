//! tinyvmm: a tiny VMM that runs a test guest on kvm-memslots at any slot count up to KVM's
//! maximum, to exercise and measure the manager.

pub mod area;
pub mod check;
pub mod exit;
pub mod guest;
pub mod lifecycle;
pub mod vcpu;
pub mod vm;
