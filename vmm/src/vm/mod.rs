//! A KVM VM and what every guest kind shares: its vCPU threads and their exit loop.

pub mod exit;
pub mod vcpu;
