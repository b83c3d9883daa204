//! The built-in test guest: 64-bit code in ring 3 (`resources/guest/test_guest.S`) that writes
//! and checks memory on the host's command, so that every slot can be verified from both sides.

pub mod area;
mod command;
pub(crate) mod controller;
pub mod hotplug;
pub mod layout;
pub mod ports;
pub mod snapshot;
mod test_vm;
pub mod vcpus;

use command::Outcome;
pub use command::{pattern, Command, CommandBlock, Fault, Op, STUB};
use layout::{write_system_memory, HOTPLUG_GPA, SYSTEM_SIZE};
pub use layout::{IDENTITY_MAPPED, MAX_VCPUS};
