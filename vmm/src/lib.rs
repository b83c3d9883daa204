//! tinyvmm: a tiny VMM that runs a test guest on kvm-memslots at any slot count up to KVM's
//! maximum, to exercise and measure the manager, and boots Linux on RAM split into KVM slots.
//!
//! The parts, by folder:
//!
//! | module | what |
//! |---|---|
//! | [`vm`] | a KVM VM with its memory manager, vCPUs, and the one vCPU exit loop every guest uses |
//! | [`test_guest`] | the built-in ring-3 test guest: its layout, command protocol and ports |
//! | [`linux`] | booting a Linux kernel: configuration, e820, loading, CPU set-up |
//! | [`devices`] | device models (the legacy serial console and i8042) |
//! | [`control`] | the control vocabulary every guest kind shares: typed requests, replies, errors |
//! | [`api`] | the API socket: HTTP/1.1 + JSON on a Unix socket, onto a controller |
//! | [`migration`] | live migration between two tinyvmm processes: the source's rounds, the transport |
//! | [`jobs`] | what the binary runs: check, perf suite, stress, serve, receive |
//! | [`lifecycle`] | the event loop for everything that is not a vCPU |

pub mod api;
pub mod control;
pub mod devices;
pub mod jobs;
pub mod lifecycle;
pub mod linux;
pub mod migration;
pub mod test_guest;
pub mod vm;
