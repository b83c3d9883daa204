//! tinyvmm: a tiny VMM that runs a test guest on kvm-memslots at any slot count up to KVM's
//! maximum, to exercise and measure the manager.

pub mod api;
pub mod area;
pub mod boot;
pub mod check;
pub mod controller;
pub mod exit;
pub mod guest;
pub mod lifecycle;
pub mod perf;
pub mod stress;
pub mod vcpu;
pub mod vm;
