//! The virtio-mem requests and responses as they travel in the queue (`struct virtio_mem_req`,
//! `struct virtio_mem_resp`): their types and sizes, decoding a request from a descriptor
//! chain, and writing a response back into it.

use kvm_memslots::GuestMemorySlots;
use kvm_memslots::GuestMemoryView;
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::mmio::DriverError;

/// Request type: plug consecutive blocks.
pub const VIRTIO_MEM_REQ_PLUG: u16 = 0;
/// Request type: unplug consecutive blocks.
pub const VIRTIO_MEM_REQ_UNPLUG: u16 = 1;
/// Request type: unplug every block and shrink the usable region.
pub const VIRTIO_MEM_REQ_UNPLUG_ALL: u16 = 2;
/// Request type: the state of consecutive blocks.
pub const VIRTIO_MEM_REQ_STATE: u16 = 3;

/// Response type: done.
pub const VIRTIO_MEM_RESP_ACK: u16 = 0;
/// Response type: refused (a plug beyond the requested size).
pub const VIRTIO_MEM_RESP_NACK: u16 = 1;
/// Response type: cannot be done now, try again later.
pub const VIRTIO_MEM_RESP_BUSY: u16 = 2;
/// Response type: the request is wrong (range, alignment, block states).
pub const VIRTIO_MEM_RESP_ERROR: u16 = 3;

/// STATE answer: every block plugged.
pub const VIRTIO_MEM_STATE_PLUGGED: u16 = 0;
/// STATE answer: every block unplugged.
pub const VIRTIO_MEM_STATE_UNPLUGGED: u16 = 1;
/// STATE answer: some of each.
pub const VIRTIO_MEM_STATE_MIXED: u16 = 2;

/// Bytes of a request (`struct virtio_mem_req`).
pub const REQUEST_SIZE: usize = 24;
/// Bytes of a response (`struct virtio_mem_resp`).
pub const RESPONSE_SIZE: usize = 10;

/// A request from the driver, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Request {
    Plug { addr: u64, blocks: u16 },
    Unplug { addr: u64, blocks: u16 },
    UnplugAll,
    State { addr: u64, blocks: u16 },
    Unknown(u16),
}

impl Request {
    fn decode(bytes: &[u8; REQUEST_SIZE]) -> Self {
        let le16 = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let mut addr = [0u8; 8];
        addr.copy_from_slice(&bytes[8..16]);
        let addr = u64::from_le_bytes(addr);
        let blocks = le16(16);
        match le16(0) {
            VIRTIO_MEM_REQ_PLUG => Request::Plug { addr, blocks },
            VIRTIO_MEM_REQ_UNPLUG => Request::Unplug { addr, blocks },
            VIRTIO_MEM_REQ_UNPLUG_ALL => Request::UnplugAll,
            VIRTIO_MEM_REQ_STATE => Request::State { addr, blocks },
            other => Request::Unknown(other),
        }
    }
}

/// A response: its type and, for an acknowledged STATE request, the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Response {
    pub(super) kind: u16,
    pub(super) state: u16,
}

impl Response {
    pub(super) const ACK: Response = Response::of(VIRTIO_MEM_RESP_ACK);
    pub(super) const NACK: Response = Response::of(VIRTIO_MEM_RESP_NACK);
    pub(super) const BUSY: Response = Response::of(VIRTIO_MEM_RESP_BUSY);
    pub(super) const ERROR: Response = Response::of(VIRTIO_MEM_RESP_ERROR);

    const fn of(kind: u16) -> Self {
        Response { kind, state: 0 }
    }

    fn encode(self) -> [u8; RESPONSE_SIZE] {
        let mut out = [0u8; RESPONSE_SIZE];
        out[0..2].copy_from_slice(&self.kind.to_le_bytes());
        out[8..10].copy_from_slice(&self.state.to_le_bytes());
        out
    }
}

/// A device-writable buffer of a chain.
#[derive(Debug, Clone, Copy)]
pub(super) struct Buffer {
    addr: GuestAddress,
    len: u32,
}

/// Takes one descriptor chain apart: reads the request, and returns it with the
/// device-writable buffers the response goes to.
pub(super) fn read_request(
    chain: DescriptorChain<GuestMemoryView>,
    mem: &GuestMemorySlots,
) -> Result<(Request, Vec<Buffer>), DriverError> {
    let head = chain.head_index();
    let mut request = [0u8; REQUEST_SIZE];
    let mut have = 0usize;
    let mut readable = 0u64;
    let mut writable = Vec::new();
    let mut written_to = 0u64;
    // `chain` stops after the queue size's worth of descriptors, so a loop ends too.
    let descriptors: Vec<_> = chain.collect();
    for desc in descriptors {
        let (addr, len) = (desc.addr(), desc.len());
        if !GuestMemoryBackend::check_range(mem, addr, len as usize) {
            return Err(DriverError(format!(
                "chain {head}: buffer at {:#x} of {len} bytes is outside guest memory",
                addr.0
            )));
        }
        if desc.is_write_only() {
            writable.push(Buffer { addr, len });
            written_to += u64::from(len);
            continue;
        }
        if !writable.is_empty() {
            return Err(DriverError(format!(
                "chain {head}: a device-readable buffer follows a device-writable one"
            )));
        }
        readable += u64::from(len);
        let take = (REQUEST_SIZE - have).min(len as usize);
        if take > 0 {
            mem.read_slice(&mut request[have..have + take], addr)
                .map_err(|e| DriverError(format!("chain {head}: reading the request: {e}")))?;
            have += take;
        }
    }
    if readable < REQUEST_SIZE as u64 {
        return Err(DriverError(format!(
            "chain {head}: {readable} device-readable bytes, a request needs {REQUEST_SIZE}"
        )));
    }
    if written_to < RESPONSE_SIZE as u64 {
        return Err(DriverError(format!(
            "chain {head}: {written_to} device-writable bytes, a response needs {RESPONSE_SIZE}"
        )));
    }
    Ok((Request::decode(&request), writable))
}

/// Writes `response` across `buffers` (the device-writable buffers of chain `head`, which
/// [`read_request`] checked hold at least a response), in order.
pub(super) fn write_response(
    mem: &GuestMemorySlots,
    head: u16,
    buffers: Vec<Buffer>,
    response: Response,
) -> Result<(), DriverError> {
    let bytes = response.encode();
    let mut at = 0;
    for buffer in buffers {
        if at == bytes.len() {
            break;
        }
        let take = (bytes.len() - at).min(buffer.len as usize);
        mem.write_slice(&bytes[at..at + take], buffer.addr)
            .map_err(|e| DriverError(format!("chain {head}: writing the response: {e}")))?;
        at += take;
    }
    Ok(())
}
