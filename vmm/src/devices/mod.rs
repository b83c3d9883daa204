//! Device models the guests' ports and interrupts reach.

pub mod legacy;
