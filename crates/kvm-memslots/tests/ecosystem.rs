//! The manager's memory works with the rest of rust-vmm through vm-memory's traits: linux-loader
//! loads an ELF image into it and virtio-queue walks a descriptor chain in it, both across
//! slot boundaries. Runs on the fake KVM: these are userspace accesses only.

use std::io::Cursor;

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{MemoryManager, RegionSpec};
use linux_loader::loader::{Elf, KernelLoader};
use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryBackend};

const SLOT: u64 = 16 * 1024;

/// 16 MiB of memory in 16 KiB slots: every structure below spans several slots.
fn manager() -> MemoryManager<FakeKvm> {
    let m = MemoryManager::new(FakeKvm::new(2048, true));
    m.add_region(RegionSpec::new(GuestAddress(0), 16 << 20).with_slot_size(SLOT))
        .expect("guest memory");
    m
}

/// A minimal ELF64 executable with one loadable segment of `payload` at `paddr`.
fn elf_image(paddr: u64, entry: u64, payload: &[u8]) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    let mut image = Vec::new();
    image.extend([0x7f, b'E', b'L', b'F', 2, 1, 1, 0]); // 64-bit, little-endian, version 1
    image.extend([0u8; 8]);
    image.extend(2u16.to_le_bytes()); // ET_EXEC
    image.extend(0x3eu16.to_le_bytes()); // x86-64
    image.extend(1u32.to_le_bytes());
    image.extend(entry.to_le_bytes());
    image.extend((EHDR as u64).to_le_bytes()); // program headers right after
    image.extend(0u64.to_le_bytes()); // no section headers
    image.extend(0u32.to_le_bytes());
    image.extend((EHDR as u16).to_le_bytes());
    image.extend((PHDR as u16).to_le_bytes());
    image.extend(1u16.to_le_bytes());
    image.extend([0u8; 6]);
    assert_eq!(image.len(), EHDR);
    let size = payload.len() as u64;
    image.extend(1u32.to_le_bytes()); // PT_LOAD
    image.extend(5u32.to_le_bytes()); // R+X
    image.extend(((EHDR + PHDR) as u64).to_le_bytes());
    image.extend(paddr.to_le_bytes()); // vaddr
    image.extend(paddr.to_le_bytes()); // paddr
    image.extend(size.to_le_bytes()); // file size
    image.extend((size + 4096).to_le_bytes()); // memory size (with bss)
    image.extend(4096u64.to_le_bytes());
    assert_eq!(image.len(), EHDR + PHDR);
    image.extend(payload);
    image
}

#[test]
fn linux_loader_loads_an_image_across_slots() {
    let m = manager();
    let payload: Vec<u8> = (0..5 * SLOT + 123).map(|i| (i * 13 % 256) as u8).collect();
    let paddr = 0x10_0000 + SLOT / 2;
    let image = elf_image(paddr, paddr + 0x40, &payload);
    let memory = m.handle().memory();
    let loaded = Elf::load(&*memory, None, &mut Cursor::new(image), None).expect("load the ELF");
    assert_eq!(loaded.kernel_load, GuestAddress(paddr + 0x40));
    assert_eq!(loaded.kernel_end, paddr + payload.len() as u64 + 4096);
    let mut back = vec![0u8; payload.len()];
    memory
        .read_slice(&mut back, GuestAddress(paddr))
        .expect("read back");
    assert_eq!(back, payload);
    // The loader's writes were tracked as the VMM's dirty pages.
    let dirty = m.harvest_dirty(kvm_memslots::Target::All).expect("harvest");
    let first = paddr & !0xfff;
    let last = (paddr + payload.len() as u64 - 1) & !0xfff;
    let expected: Vec<u64> = (first..=last).step_by(4096).collect();
    assert_eq!(
        dirty[0].addresses().map(|a| a.0).collect::<Vec<_>>(),
        expected
    );
    // An image that does not fit in guest memory is refused, not truncated.
    let too_high = elf_image((16 << 20) - 100, 0, &payload);
    assert!(Elf::load(&*memory, None, &mut Cursor::new(too_high), None).is_err());
}

#[test]
fn virtio_queue_reads_a_descriptor_chain_across_slots() {
    let m = manager();
    let memory = m.handle().memory();
    assert!(memory.num_regions() > 1000);
    // The queue's rings start just below a slot boundary; buffers straddle boundaries too.
    let vq = MockSplitQueue::create(&*memory, GuestAddress(3 * SLOT - 64), 16);
    let buffers = [
        (5 * SLOT - 100, 300u32),
        (9 * SLOT - 8, 24),
        (20 * SLOT + 4, SLOT as u32 + 10),
    ];
    let descs: Vec<RawDescriptor> = buffers
        .iter()
        .enumerate()
        .map(|(i, (addr, len))| {
            // Every descriptor but the last points at the next one.
            let (flags, next) = if i + 1 < buffers.len() {
                (VRING_DESC_F_NEXT as u16, i as u16 + 1)
            } else {
                (0, 0)
            };
            RawDescriptor::from(SplitDescriptor::new(*addr, *len, flags, next))
        })
        .collect();
    for (i, (addr, len)) in buffers.iter().enumerate() {
        let data = vec![i as u8 + 1; *len as usize];
        memory
            .write_slice(&data, GuestAddress(*addr))
            .expect("fill the buffer");
    }
    vq.add_desc_chains(&descs, 0).expect("build the chain");
    let mut queue: Queue = vq.create_queue().expect("queue");
    let chain = queue
        .iter(&*memory)
        .expect("avail ring")
        .next()
        .expect("one chain");
    let mut seen = Vec::new();
    for (i, desc) in chain.enumerate() {
        assert_eq!((desc.addr().0, desc.len()), buffers[i]);
        let mut data = vec![0u8; desc.len() as usize];
        memory
            .read_slice(&mut data, desc.addr())
            .expect("read the buffer");
        assert!(data.iter().all(|b| *b == i as u8 + 1));
        seen.push(desc.addr().0);
    }
    assert_eq!(seen.len(), buffers.len());
}
