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

pub use command::{pattern, Command, CommandBlock, Fault, Op, Outcome, STUB};
pub use layout::{
    boot_regs, boot_sregs, command_block, write_system_memory, CODE, CODE_GPA, COMMANDS_GPA,
    COMMAND_BLOCK_SIZE, FAULT_GPA, HOTPLUG_GPA, IDENTITY_MAPPED, MAX_VCPUS, SYSTEM_SIZE,
};
