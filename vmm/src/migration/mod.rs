//! Live migration of a VM between two tinyvmm processes, on kvm-memslots-persist's memory stream: the
//! source ([`source`]) copies memory in rounds while the guest runs, harvesting what it dirtied
//! (bitmap or ring), pauses it once what is left fits the downtime budget, sends the last pages
//! and the guest kind's State record (its vCPUs' and devices' state), and stops only once the
//! destination (`tinyvmm receive`) says the VM runs there. The rounds know no guest kind: the
//! guest kind's controller hands over its vCPUs ([`MigratingVcpu`]) and its State record
//! ([`StateRecord`]). The rounds know no destination either ([`sink::Sink`]): the same rounds
//! write a live snapshot's files (`snapshot::live`), where the VM goes on once they end.

pub mod sink;
pub mod slot;
pub mod source;
pub mod transport;

pub use source::{MigratingVcpu, Migration, StateRecord};
pub use transport::{Connection, Endpoint, Listener};
