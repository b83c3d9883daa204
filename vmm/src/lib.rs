//! tinyvmm: a tiny VMM that runs a test guest on kvm-memslots at any slot count up to KVM's
//! maximum, to exercise and measure the manager, and boots Linux on RAM split into KVM slots.
//!
//! The parts, by folder:
//!
//! | module | what |
//! |---|---|
//! | `host` | the host OS's calls outside KVM and guest memory, each a small safe wrapper |
//! | [`vm`] | a KVM VM with its memory manager, vCPUs, and the one vCPU exit loop every guest uses |
//! | [`lifecycle`] | the event loop for everything that is not a vCPU, and the signal flag |
//! | `precopy` | the pre-copy engine: a running VM's memory copied in rounds, then a short pause, into a sink |
//! | [`control`] | the control vocabulary every guest kind shares: typed requests, replies and errors |
//! | [`devices`] | device models (the legacy serial console and i8042) |
//! | [`migration`] | live migration between two tinyvmm processes: the stream the pre-copy rounds fill, the transport |
//! | [`snapshot`] | snapshots of any guest kind: state files, the chain of Full and Diff snapshots, live snapshots |
//! | `controller` | the one controller: the services every guest kind shares, answered once, and the `Guest` trait for what differs |
//! | [`test_guest`] | the built-in ring-3 test guest: its layout, command protocol, ports and its side of the controller |
//! | [`linux`] | booting a Linux kernel: configuration, e820, loading, CPU set-up, its side of the controller |
//! | [`api`] | the API socket: HTTP/1.1 + JSON on a Unix socket, onto a controller |
//! | [`jobs`] | the product's subcommands: check, serve, restore, receive, boot, on one run loop, and client; each one's command-line arguments |
//!
//! Each module uses only modules listed before it (`vmm/tests/layers.rs` checks this against the
//! table in `docs/DESIGN.md`). The measurement harnesses (perf suite, stress, harvest and
//! snapshot benches) are a crate and binary of their own on this library, `tinyvmm-bench`
//! (`vmm/bench/`), so that neither this library nor the `tinyvmm` binary carries them.

pub mod api;
pub mod control;
mod controller;
pub mod devices;
mod host;
pub mod jobs;
pub mod lifecycle;
pub mod linux;
pub mod migration;
mod precopy;
pub mod snapshot;
pub mod test_guest;
pub mod vm;

/// This build's version (the crate's).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit this binary was built from (`git rev-parse --short=12 HEAD` at build time), or
/// `unknown` when it was not built from a git checkout.
const COMMIT: &str = env!("TINYVMM_COMMIT");

/// What `--version` says after the binary's name: the version and the commit
/// (`0.1.0 (commit 0123456789ab)`).
pub const VERSION_AND_COMMIT: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TINYVMM_COMMIT"),
    ")"
);
