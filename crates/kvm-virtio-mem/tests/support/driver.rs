//! A guest-side virtio-mem driver model, written from the virtio specification (the
//! virtio-mmio register table, the split virtqueue layout, and the virtio-mem device section),
//! not from the device's code: every number below is the specification's, spelled out here.
//!
//! It owns the device as a VMM would (an `MmioTransport`) and reaches it only through
//! `read`/`write` at offsets in its window, as vCPU MMIO exits would; it reaches the rings and
//! buffers only as guest RAM, through the manager's memory.

#![allow(dead_code)]

use std::sync::Arc;

use kvm_memslots::{KvmMemory, MemoryManager};
use kvm_virtio_mem::{MmioTransport, VirtioMem};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

// virtio-mmio registers (virtio 1.2, 4.2.2).
pub const MAGIC_VALUE: u64 = 0x000;
pub const VERSION: u64 = 0x004;
pub const DEVICE_ID: u64 = 0x008;
pub const DEVICE_FEATURES: u64 = 0x010;
pub const DEVICE_FEATURES_SEL: u64 = 0x014;
pub const DRIVER_FEATURES: u64 = 0x020;
pub const DRIVER_FEATURES_SEL: u64 = 0x024;
pub const QUEUE_SEL: u64 = 0x030;
pub const QUEUE_NUM_MAX: u64 = 0x034;
pub const QUEUE_NUM: u64 = 0x038;
pub const QUEUE_READY: u64 = 0x044;
pub const QUEUE_NOTIFY: u64 = 0x050;
pub const INTERRUPT_STATUS: u64 = 0x060;
pub const INTERRUPT_ACK: u64 = 0x064;
pub const STATUS: u64 = 0x070;
pub const QUEUE_DESC_LOW: u64 = 0x080;
pub const QUEUE_DESC_HIGH: u64 = 0x084;
pub const QUEUE_DRIVER_LOW: u64 = 0x090;
pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
pub const CONFIG_GENERATION: u64 = 0x0fc;
pub const CONFIG: u64 = 0x100;

// Device status (2.1).
pub const S_ACKNOWLEDGE: u32 = 1;
pub const S_DRIVER: u32 = 2;
pub const S_DRIVER_OK: u32 = 4;
pub const S_FEATURES_OK: u32 = 8;
pub const S_DEVICE_NEEDS_RESET: u32 = 64;

// Interrupt status bits (4.2.2).
pub const INT_USED_BUFFER: u32 = 1;
pub const INT_CONFIG: u32 = 2;

// Feature bits: VIRTIO_F_VERSION_1 (6), VIRTIO_MEM_F_ACPI_PXM and
// VIRTIO_MEM_F_UNPLUGGED_INACCESSIBLE (5.15.3).
pub const F_VERSION_1: u64 = 1 << 32;
pub const F_ACPI_PXM: u64 = 1 << 0;
pub const F_UNPLUGGED_INACCESSIBLE: u64 = 1 << 1;

// Split virtqueue descriptor flags (2.7.5).
pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;

// virtio-mem configuration layout (5.15.4).
pub const CFG_BLOCK_SIZE: u64 = 0;
pub const CFG_NODE_ID: u64 = 8;
pub const CFG_ADDR: u64 = 16;
pub const CFG_REGION_SIZE: u64 = 24;
pub const CFG_USABLE_REGION_SIZE: u64 = 32;
pub const CFG_PLUGGED_SIZE: u64 = 40;
pub const CFG_REQUESTED_SIZE: u64 = 48;

// virtio-mem requests, responses, states (5.15.6).
pub const REQ_PLUG: u16 = 0;
pub const REQ_UNPLUG: u16 = 1;
pub const REQ_UNPLUG_ALL: u16 = 2;
pub const REQ_STATE: u16 = 3;
pub const RESP_ACK: u16 = 0;
pub const RESP_NACK: u16 = 1;
pub const RESP_BUSY: u16 = 2;
pub const RESP_ERROR: u16 = 3;
pub const STATE_PLUGGED: u16 = 0;
pub const STATE_UNPLUGGED: u16 = 1;
pub const STATE_MIXED: u16 = 2;

/// Where the driver keeps its queue and buffers in guest RAM (a region the test gives it).
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Base of the driver's RAM area (at least 64 KiB).
    pub base: u64,
    /// Queue size the driver asks for.
    pub size: u16,
}

impl Layout {
    pub fn desc(&self) -> u64 {
        self.base
    }
    /// The available ("driver") ring: flags, idx, ring[size], used_event.
    pub fn avail(&self) -> u64 {
        self.base + 0x1000
    }
    /// The used ("device") ring: flags, idx, ring[size] of (id: u32, len: u32), avail_event.
    pub fn used(&self) -> u64 {
        self.base + 0x2000
    }
    /// The request buffer (24 bytes).
    pub fn request(&self) -> u64 {
        self.base + 0x3000
    }
    /// The response buffer (10 bytes).
    pub fn response(&self) -> u64 {
        self.base + 0x3100
    }
    /// Spare RAM for tests that build odd chains.
    pub fn scratch(&self) -> u64 {
        self.base + 0x4000
    }
}

/// Why the driver's initialisation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitError {
    NotVirtio,
    WrongDevice(u32),
    FeaturesRefused,
    NoQueue,
}

/// One descriptor a test puts in a chain.
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// How the driver reaches the device's registers: as a vCPU's MMIO exits would, at offsets in
/// the device's window. The transport itself, or a VMM's exit path in front of it.
pub trait Registers {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

impl<K: KvmMemory> Registers for MmioTransport<VirtioMem<K>> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        MmioTransport::read(self, offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        MmioTransport::write(self, offset, data)
    }
}

pub struct Driver<K: KvmMemory, R = MmioTransport<VirtioMem<K>>> {
    pub device: R,
    pub memory: Arc<MemoryManager<K>>,
    pub layout: Layout,
    /// Our copy of the available ring's idx.
    avail_idx: u16,
    /// The used ring idx we have consumed up to.
    used_seen: u16,
}

impl<K: KvmMemory, R: Registers> Driver<K, R> {
    pub fn new(device: R, memory: Arc<MemoryManager<K>>, layout: Layout) -> Self {
        Driver {
            device,
            memory,
            layout,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    pub fn read32(&mut self, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        self.device.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write32(&mut self, offset: u64, value: u32) {
        self.device.write(offset, &value.to_le_bytes());
    }

    pub fn status(&mut self) -> u32 {
        self.read32(STATUS)
    }

    /// Reads a 64-bit configuration field with two 32-bit reads, retrying until the
    /// configuration generation is the same before and after (4.2.3.1.1 / 2.5.1).
    pub fn config64(&mut self, field: u64) -> u64 {
        loop {
            let before = self.read32(CONFIG_GENERATION);
            let lo = self.read32(CONFIG + field);
            let hi = self.read32(CONFIG + field + 4);
            if self.read32(CONFIG_GENERATION) == before {
                return u64::from(lo) | (u64::from(hi) << 32);
            }
        }
    }

    pub fn generation(&mut self) -> u32 {
        self.read32(CONFIG_GENERATION)
    }

    /// Reads and acknowledges the interrupt status.
    pub fn take_interrupt(&mut self) -> u32 {
        let bits = self.read32(INTERRUPT_STATUS);
        self.write32(INTERRUPT_ACK, bits);
        bits
    }

    /// The device initialisation of 3.1.1 and 4.2.3, accepting `accept` from the features
    /// offered (bits not offered are written as asked, to test refusals).
    pub fn init_with(&mut self, accept: u64) -> Result<u64, InitError> {
        let offered = self.init_until_driver_ok(accept)?;
        self.write32(
            STATUS,
            S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK,
        );
        Ok(offered)
    }

    /// Every initialisation step but the last (setting DRIVER_OK).
    pub fn init_until_driver_ok(&mut self, accept: u64) -> Result<u64, InitError> {
        if self.read32(MAGIC_VALUE) != 0x7472_6976 || self.read32(VERSION) != 2 {
            return Err(InitError::NotVirtio);
        }
        let id = self.read32(DEVICE_ID);
        if id != 24 {
            return Err(InitError::WrongDevice(id));
        }
        self.write32(STATUS, 0);
        self.write32(STATUS, S_ACKNOWLEDGE);
        self.write32(STATUS, S_ACKNOWLEDGE | S_DRIVER);
        self.write32(DEVICE_FEATURES_SEL, 0);
        let mut offered = u64::from(self.read32(DEVICE_FEATURES));
        self.write32(DEVICE_FEATURES_SEL, 1);
        offered |= u64::from(self.read32(DEVICE_FEATURES)) << 32;
        self.write32(DRIVER_FEATURES_SEL, 0);
        self.write32(DRIVER_FEATURES, accept as u32);
        self.write32(DRIVER_FEATURES_SEL, 1);
        self.write32(DRIVER_FEATURES, (accept >> 32) as u32);
        self.write32(STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
        if self.status() & S_FEATURES_OK == 0 {
            return Err(InitError::FeaturesRefused);
        }
        // Queue 0, the guest-request queue.
        self.write32(QUEUE_SEL, 0);
        if self.read32(QUEUE_READY) != 0 {
            return Err(InitError::NoQueue);
        }
        let max = self.read32(QUEUE_NUM_MAX);
        if max == 0 || max < u32::from(self.layout.size) {
            return Err(InitError::NoQueue);
        }
        self.clear_rings();
        self.write32(QUEUE_NUM, u32::from(self.layout.size));
        let l = self.layout;
        for (low, high, addr) in [
            (QUEUE_DESC_LOW, QUEUE_DESC_HIGH, l.desc()),
            (QUEUE_DRIVER_LOW, QUEUE_DRIVER_HIGH, l.avail()),
            (QUEUE_DEVICE_LOW, QUEUE_DEVICE_HIGH, l.used()),
        ] {
            self.write32(low, addr as u32);
            self.write32(high, (addr >> 32) as u32);
        }
        self.write32(QUEUE_READY, 1);
        Ok(offered)
    }

    /// Initialises accepting what a current Linux driver accepts.
    pub fn init(&mut self) {
        self.init_with(F_VERSION_1 | F_UNPLUGGED_INACCESSIBLE)
            .expect("the device accepts a standard driver");
        assert_eq!(self.status(), 0xf);
    }

    fn clear_rings(&mut self) {
        let zeros = vec![0u8; 0x3000];
        self.ram()
            .write_slice(&zeros, GuestAddress(self.layout.base))
            .expect("the queue area is RAM");
        self.avail_idx = 0;
        self.used_seen = 0;
    }

    fn ram(&self) -> kvm_memslots::GuestMemoryView {
        self.memory.handle().memory()
    }

    pub fn write_ram(&self, addr: u64, bytes: &[u8]) {
        self.ram()
            .write_slice(bytes, GuestAddress(addr))
            .expect("driver RAM");
    }

    pub fn read_ram(&self, addr: u64, bytes: &mut [u8]) {
        self.ram()
            .read_slice(bytes, GuestAddress(addr))
            .expect("driver RAM");
    }

    fn read16(&self, addr: u64) -> u16 {
        let mut b = [0u8; 2];
        self.read_ram(addr, &mut b);
        u16::from_le_bytes(b)
    }

    fn read_u32(&self, addr: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read_ram(addr, &mut b);
        u32::from_le_bytes(b)
    }

    /// Writes descriptors `descs` at table indices 0.., publishes index `head` in the
    /// available ring, and notifies queue 0. Returns the used element (id, len) if the device
    /// used one.
    pub fn submit(&mut self, descs: &[Desc], head: u16) -> Option<(u32, u32)> {
        for (i, d) in descs.iter().enumerate() {
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&d.addr.to_le_bytes());
            raw[8..12].copy_from_slice(&d.len.to_le_bytes());
            raw[12..14].copy_from_slice(&d.flags.to_le_bytes());
            raw[14..16].copy_from_slice(&d.next.to_le_bytes());
            self.write_ram(self.layout.desc() + 16 * i as u64, &raw);
        }
        let slot = u64::from(self.avail_idx % self.layout.size);
        self.write_ram(self.layout.avail() + 4 + 2 * slot, &head.to_le_bytes());
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.write_ram(self.layout.avail() + 2, &self.avail_idx.to_le_bytes());
        self.write32(QUEUE_NOTIFY, 0);
        self.take_used()
    }

    /// Sets the available ring's idx to an arbitrary value and notifies.
    pub fn publish_avail_idx(&mut self, idx: u16) {
        self.write_ram(self.layout.avail() + 2, &idx.to_le_bytes());
        self.write32(QUEUE_NOTIFY, 0);
    }

    /// The next used element, if the device has added one.
    pub fn take_used(&mut self) -> Option<(u32, u32)> {
        let idx = self.read16(self.layout.used() + 2);
        if idx == self.used_seen {
            return None;
        }
        let slot = u64::from(self.used_seen % self.layout.size);
        let elem = self.layout.used() + 4 + 8 * slot;
        self.used_seen = self.used_seen.wrapping_add(1);
        Some((self.read_u32(elem), self.read_u32(elem + 4)))
    }

    /// Sends one request (type, addr, nb_blocks) in a two-descriptor chain, as Linux does:
    /// the 24-byte request device-readable, the 10-byte response device-writable. Returns the
    /// response's type and state, or `None` if the device used no buffer.
    pub fn request(&mut self, kind: u16, addr: u64, blocks: u16) -> Option<(u16, u16)> {
        let mut req = [0u8; 24];
        req[0..2].copy_from_slice(&kind.to_le_bytes());
        req[8..16].copy_from_slice(&addr.to_le_bytes());
        req[16..18].copy_from_slice(&blocks.to_le_bytes());
        // Junk in the padding, which the device must ignore.
        req[2..8].copy_from_slice(&[0xa5; 6]);
        req[18..24].copy_from_slice(&[0x5a; 6]);
        self.write_ram(self.layout.request(), &req);
        self.write_ram(self.layout.response(), &[0xee; 10]);
        let l = self.layout;
        let used = self.submit(
            &[
                Desc {
                    addr: l.request(),
                    len: 24,
                    flags: DESC_F_NEXT,
                    next: 1,
                },
                Desc {
                    addr: l.response(),
                    len: 10,
                    flags: DESC_F_WRITE,
                    next: 0,
                },
            ],
            0,
        )?;
        assert_eq!(used.0, 0, "the used element names the chain's head");
        assert!(used.1 >= 2, "the device wrote at least the response type");
        let mut resp = [0u8; 10];
        self.read_ram(l.response(), &mut resp);
        let kind = u16::from_le_bytes([resp[0], resp[1]]);
        let state = u16::from_le_bytes([resp[8], resp[9]]);
        Some((kind, state))
    }

    pub fn plug(&mut self, addr: u64, blocks: u16) -> u16 {
        self.request(REQ_PLUG, addr, blocks).expect("answered").0
    }

    pub fn unplug(&mut self, addr: u64, blocks: u16) -> u16 {
        self.request(REQ_UNPLUG, addr, blocks).expect("answered").0
    }

    pub fn unplug_all(&mut self) -> u16 {
        self.request(REQ_UNPLUG_ALL, 0, 0).expect("answered").0
    }

    /// The STATE answer: (response type, state).
    pub fn state(&mut self, addr: u64, blocks: u16) -> (u16, u16) {
        self.request(REQ_STATE, addr, blocks).expect("answered")
    }
}
