//! Live migration of a VM between two tinyvmm processes, on kvm-memslots-persist's memory stream:
//! the pre-copy engine (`precopy`) copies memory in rounds while the guest runs, pauses it once
//! what is left fits the downtime budget, and stops only once the destination (`tinyvmm
//! receive`) says the VM runs there. Migration is one of its sinks: the stream to the
//! destination (`sink::StreamSink`), ending with the guest kind's State record
//! (`StateRecord`: its vCPUs' and devices' state); a controller's side of it, whatever the
//! guest kind (`slot`); and the connection between the two VMMs (`transport`).

pub(crate) mod sink;
pub(crate) mod slot;
pub(crate) mod transport;

pub(crate) use sink::StateRecord;
pub(crate) use transport::Connection;
pub use transport::Endpoint;
