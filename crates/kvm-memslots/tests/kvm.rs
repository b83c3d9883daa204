//! The manager on real `/dev/kvm`: the slot limit, dirty logging seen by a running vCPU,
//! moves, flag changes and re-slots under a guest, and KVM's side checked after injected and real
//! failures.
//!
//! A test that finds no `/dev/kvm` prints a loud SKIPPED line and passes; one that runs appends
//! its name to the file named by `$KVM_TEST_LOG` (the test runner counts them).

use std::sync::Arc;
use std::time::Instant;

use kvm_ioctls::{Kvm, VcpuExit, VmFd};
use kvm_memslots::testing::{Faulty, KvmCall};
use kvm_memslots::{Error, KvmVm, MemoryManager, PageSize, RegionId, RegionSpec, Reslot, Target};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

/// Opens KVM and a VM, or says loudly why the test is skipped.
fn kvm_or_skip(test: &str) -> Option<(Kvm, Arc<VmFd>)> {
    if !kvm_test_support::require_kvm(&format!("kvm-memslots::{test}")) {
        return None;
    }
    let kvm = Kvm::new().expect("open /dev/kvm");
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    Some((kvm, vm))
}

fn manager(kvm: &Kvm, vm: &Arc<VmFd>) -> MemoryManager<KvmVm> {
    MemoryManager::new(KvmVm::new(kvm, Arc::clone(vm)).expect("set up KVM's dirty logging"))
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// Where the test guest's code lives.
const CODE: u64 = 0x1000;
/// The port the guest reports bytes on.
const PORT: u16 = 0x10;

/// A real-mode program (guest ring 0 runs in this host's instruction emulator, which handles
/// these few instructions).
#[derive(Default)]
struct Program(Vec<u8>);

impl Program {
    /// Points DS at the 64 KiB segment holding `gpa` (below 1 MiB); returns the offset.
    fn segment(&mut self, gpa: u64) -> u16 {
        assert!(gpa < 0x10_0000, "real mode reaches the first MiB only");
        let seg = ((gpa & !0xffff) >> 4) as u16;
        self.0.push(0xb8); // mov ax, imm16
        self.0.extend(seg.to_le_bytes());
        self.0.extend([0x8e, 0xd8]); // mov ds, ax
        (gpa & 0xffff) as u16
    }

    fn write_byte(mut self, gpa: u64, value: u8) -> Self {
        let offset = self.segment(gpa);
        self.0.extend([0xc6, 0x06]); // mov byte [imm16], imm8
        self.0.extend(offset.to_le_bytes());
        self.0.push(value);
        self
    }

    fn report_byte(mut self, gpa: u64) -> Self {
        let offset = self.segment(gpa);
        self.0.push(0xa0); // mov al, [imm16]
        self.0.extend(offset.to_le_bytes());
        self.0.extend([0xe6, PORT as u8]); // out PORT, al
        self
    }

    fn halt(mut self) -> Vec<u8> {
        self.0.push(0xf4);
        self.0
    }
}

/// What the guest did: bytes it reported, and the MMIO writes and reads it exited on.
#[derive(Debug, Default, PartialEq)]
struct Run {
    reported: Vec<u8>,
    mmio_writes: Vec<u64>,
    mmio_reads: Vec<u64>,
}

/// Loads `code` at `CODE` through the manager's memory and runs it to `hlt`.
fn run_guest(
    vm: &VmFd,
    memory: &impl GuestAddressSpace<M = kvm_memslots::GuestMemorySlots>,
    code: &[u8],
) -> Run {
    memory
        .memory()
        .write_slice(code, GuestAddress(CODE))
        .expect("load the guest code");
    run_vcpu(vm.create_vcpu(next_vcpu_id()).expect("KVM_CREATE_VCPU"))
}

/// A vCPU id not used before in this process: KVM keeps a vCPU until the VM goes, so every
/// run gets a new one.
fn next_vcpu_id() -> u64 {
    static NEXT_VCPU: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT_VCPU.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Runs the code loaded at `CODE` on `vcpu` to `hlt`.
fn run_vcpu(mut vcpu: kvm_ioctls::VcpuFd) -> Run {
    kvm_test_support::start_in_real_mode(&vcpu, CODE);
    let mut run = Run::default();
    loop {
        match vcpu.run().expect("KVM_RUN") {
            VcpuExit::IoOut(PORT, data) => run.reported.push(data[0]),
            VcpuExit::MmioWrite(addr, _) => run.mmio_writes.push(addr),
            VcpuExit::MmioRead(addr, data) => {
                data.fill(0xff);
                run.mmio_reads.push(addr);
            }
            VcpuExit::Hlt => return run,
            other => panic!("unexpected vCPU exit: {other:?}"),
        }
    }
}

/// Whether KVM has a slot covering `gpa` (probed in slot 32000, which these tests leave free).
fn kvm_has_slot_at(vm: &VmFd, gpa: u64) -> bool {
    kvm_test_support::kvm_has_slot_at(vm, 32000, gpa)
}

/// Checks that KVM has a slot at the start of every slot of the map, and none at `free`.
fn assert_kvm_matches(vm: &VmFd, m: &MemoryManager<impl kvm_memslots::KvmMemory>, free: &[u64]) {
    for slot in m.current().map().iter() {
        assert!(
            kvm_has_slot_at(vm, slot.gpa().0),
            "KVM lost slot {} at {:#x}",
            slot.id(),
            slot.gpa().0
        );
        let last = slot.gpa().0 + slot.size() - 4096;
        assert!(
            kvm_has_slot_at(vm, last),
            "KVM slot {} shorter than the map's",
            slot.id()
        );
    }
    for gpa in free {
        assert!(m.current().map().find_by_gpa(GuestAddress(*gpa)).is_none());
        assert!(
            !kvm_has_slot_at(vm, *gpa),
            "KVM has a slot at {gpa:#x} the map has not"
        );
    }
}

#[test]
fn kvm_fills_every_slot_then_refuses_one_more() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_fills_every_slot_then_refuses_one_more") else {
        return;
    };
    let m = manager(&kvm, &vm);
    let max = kvm.get_nr_memslots();
    let base = 1 << 30;
    let start = Instant::now();
    let region = m
        .add_region(
            RegionSpec::new(GuestAddress(base), max as u64 * 4 * KIB).with_slot_size(4 * KIB),
        )
        .expect("fill every KVM slot");
    let created = start.elapsed();
    let usage = m.slot_usage();
    assert_eq!((usage.used, usage.free, usage.max), (max, 0, max));
    eprintln!(
        "created {max} slots in {created:?}; manager memory {:.0} bytes/slot",
        m.bytes_per_slot()
    );

    let before = m.regions();
    let err = m
        .add_region(RegionSpec::new(GuestAddress(0), 4 * KIB))
        .expect_err("one slot more than KVM has");
    assert_eq!(
        err.to_string(),
        format!("out of KVM memory slots: 1 needed, 0 of {max} free")
    );
    assert_eq!(m.regions(), before);
    assert_eq!(m.slot_usage(), usage);
    assert_eq!(m.current().map().len(), max);

    let start = Instant::now();
    m.remove_region(region).expect("delete every slot");
    eprintln!("deleted {max} slots in {:?}", start.elapsed());
    assert_eq!(m.slot_usage().used, 0);
    assert_kvm_matches(&vm, &m, &[base, base + (max as u64 - 1) * 4 * KIB]);
}

/// A code region at 0 and a data region of 16 slots of 16 KiB at 128 KiB.
fn guest_layout(
    m: &MemoryManager<impl kvm_memslots::KvmMemory>,
    log_dirty: bool,
) -> (RegionId, RegionId) {
    let code = m
        .add_region(RegionSpec::new(GuestAddress(0), 64 * KIB))
        .expect("code region");
    let mut data = RegionSpec::new(GuestAddress(DATA), 256 * KIB).with_slot_size(16 * KIB);
    data.log_dirty = log_dirty;
    (code, m.add_region(data).expect("data region"))
}

const DATA: u64 = 128 * KIB;

#[test]
fn kvm_harvest_reports_exactly_the_pages_written() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_harvest_reports_exactly_the_pages_written") else {
        return;
    };
    let m = manager(&kvm, &vm);
    let (_, data) = guest_layout(&m, true);
    let guest_pages = [
        DATA,
        DATA + 5 * 4 * KIB + 12,
        DATA + 130 * KIB,
        DATA + 255 * KIB,
    ];
    let mut program = Program::default();
    for (i, gpa) in guest_pages.iter().enumerate() {
        program = program.write_byte(*gpa, i as u8 + 1);
    }
    let code = program.halt();
    // Logging starts with every page counted dirty (initially set): take that first.
    let first = m
        .harvest_dirty(Target::Region(data))
        .expect("first harvest");
    assert_eq!(first[0].count(), 64, "every page of a newly logging region");
    // The VMM writes one page through vm-memory; the guest writes four.
    let vmm_page = DATA + 200 * KIB;
    m.current()
        .write_obj(7u8, GuestAddress(vmm_page))
        .expect("VMM write");
    let run = run_guest(&vm, &m.handle(), &code);
    assert_eq!(run, Run::default(), "the guest only writes memory");
    let dirty = m.harvest_dirty(Target::Region(data)).expect("harvest");
    let mut expected: Vec<u64> = guest_pages.iter().map(|a| a & !0xfff).collect();
    expected.push(vmm_page);
    expected.sort();
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    assert_eq!(got, expected);
    for (i, gpa) in guest_pages.iter().enumerate() {
        assert_eq!(
            m.current()
                .read_obj::<u8>(GuestAddress(*gpa))
                .expect("read"),
            i as u8 + 1
        );
    }
    let again = m
        .harvest_dirty(Target::Region(data))
        .expect("second harvest");
    assert_eq!(again[0].count(), 0, "a second harvest reports nothing new");
}

#[test]
fn kvm_a_region_of_2m_pages_logs_and_discards_at_its_page_size() {
    let test = "kvm_a_region_of_2m_pages_logs_and_discards_at_its_page_size";
    let available = kvm_memslots::hugetlb_pages_available();
    if available < 2 {
        eprintln!(
            "SKIPPED kvm-memslots::{test}: the hugetlb pool has {available} free 2 MiB pages, \
             the test needs 2 (resources/setup-host.sh reserves a pool)"
        );
        return;
    }
    let Some((kvm, vm)) = kvm_or_skip(test) else {
        return;
    };
    let m = manager(&kvm, &vm);
    // The guest's code and data in two 2 MiB pages, logged from the start.
    let id = m
        .add_region(
            RegionSpec::new(GuestAddress(0), 4 * MIB)
                .with_page_size(PageSize::Huge2M)
                .with_flags(kvm_memslots::SlotFlags {
                    log_dirty: true,
                    read_only: false,
                }),
        )
        .expect("a region of 2 MiB pages");
    let first = m.harvest_dirty(Target::Region(id)).expect("first harvest");
    assert_eq!(
        first[0].count(),
        1024,
        "every 4 KiB page of a newly logging region"
    );
    let guest_pages = [0x2_0000, 0x5_0123, 0x9_ffff];
    let mut program = Program::default();
    for (i, gpa) in guest_pages.iter().enumerate() {
        program = program.write_byte(*gpa, i as u8 + 1);
    }
    let run = run_guest(&vm, &m.handle(), &program.halt());
    assert_eq!(run, Run::default(), "the guest only writes memory");
    // KVM logs a huge page's writes at 4 KiB: exactly the pages written (and the code page
    // the VMM loaded), not their 2 MiB pages.
    let dirty = m.harvest_dirty(Target::Region(id)).expect("harvest");
    let got: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
    let mut expected: Vec<u64> = guest_pages.iter().map(|a| a & !0xfff).collect();
    expected.push(CODE);
    expected.sort();
    assert_eq!(got, expected);
    // A partial page is refused and frees nothing; the second page whole reads back as zeros
    // and its neighbour, where the guest runs, keeps its data.
    let mem = m.handle();
    mem.memory()
        .write_obj(0x5au8, GuestAddress(3 * MIB))
        .expect("the VMM writes the second page");
    let err = m
        .discard(GuestAddress(2 * MIB), MIB)
        .expect_err("half a 2 MiB page");
    assert!(matches!(err, Error::Unaligned { .. }), "{err:?}");
    let byte: u8 = mem.memory().read_obj(GuestAddress(3 * MIB)).expect("read");
    assert_eq!(byte, 0x5a, "a refused discard frees nothing");
    m.discard(GuestAddress(2 * MIB), 2 * MIB)
        .expect("a whole page");
    let byte: u8 = mem.memory().read_obj(GuestAddress(3 * MIB)).expect("read");
    assert_eq!(byte, 0, "a discarded page reads back as zeros");
    let code = Program::default()
        .report_byte(0x5_0123)
        .report_byte(0x9_ffff)
        .halt();
    assert_eq!(run_guest(&vm, &mem, &code).reported, vec![2, 3]);
}

#[test]
fn kvm_data_survives_moves_and_flag_changes() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_data_survives_moves_and_flag_changes") else {
        return;
    };
    let m = manager(&kvm, &vm);
    let (_, data) = guest_layout(&m, false);
    let pattern: Vec<u8> = (0..256 * KIB).map(|i| (i * 7 % 253) as u8).collect();
    m.current()
        .write_slice(&pattern, GuestAddress(DATA))
        .expect("fill");
    let moved_to = 512 * KIB;
    m.start_dirty_log(Target::All).expect("start logging");
    m.move_region(data, GuestAddress(moved_to)).expect("move");
    m.stop_dirty_log(Target::All).expect("stop logging");
    m.set_read_only(data, true).expect("read-only");
    assert_kvm_matches(&vm, &m, &[DATA, DATA + 255 * KIB]);
    // The guest sees the data at the new place, nothing at the old one, and cannot write it.
    let probe = [moved_to, moved_to + 100 * KIB + 3, moved_to + 256 * KIB - 1];
    let mut program = Program::default();
    for gpa in probe {
        program = program.report_byte(gpa);
    }
    let code = program
        .write_byte(moved_to + 16, 0x55)
        .report_byte(DATA)
        .halt();
    let run = run_guest(&vm, &m.handle(), &code);
    let mut expected: Vec<u8> = probe
        .iter()
        .map(|a| pattern[(a - moved_to) as usize])
        .collect();
    expected.push(0xff); // the old place is MMIO now
    assert_eq!(run.reported, expected);
    assert_eq!(
        run.mmio_writes,
        vec![moved_to + 16],
        "a write to a read-only slot exits"
    );
    assert_eq!(run.mmio_reads, vec![DATA]);
    let mut back = vec![0u8; pattern.len()];
    m.current()
        .read_slice(&mut back, GuestAddress(moved_to))
        .expect("read back");
    assert_eq!(
        back, pattern,
        "data changed across move, logging and read-only"
    );
    // Writable again: the guest's write lands.
    m.set_read_only(data, false).expect("read-write");
    let run = run_guest(
        &vm,
        &m.handle(),
        &Program::default().write_byte(moved_to + 16, 0x55).halt(),
    );
    assert_eq!(run, Run::default());
    assert_eq!(
        m.current()
            .read_obj::<u8>(GuestAddress(moved_to + 16))
            .expect("read"),
        0x55
    );
}

/// A manager whose KVM calls can be made to fail, with the guest layout, and its data region
/// filled with a pattern (returned).
fn faulty_filled(kvm: &Kvm, vm: &Arc<VmFd>) -> (MemoryManager<Faulty<KvmVm>>, RegionId, Vec<u8>) {
    let m = MemoryManager::new(Faulty::new(KvmVm::new(kvm, Arc::clone(vm)).expect("KVM")));
    let (_, data) = guest_layout(&m, false);
    let pattern: Vec<u8> = (0..256 * KIB).map(|i| (i % 241) as u8).collect();
    m.current()
        .write_slice(&pattern, GuestAddress(DATA))
        .expect("fill");
    (m, data, pattern)
}

#[test]
fn kvm_injected_failures_leave_kvm_as_the_map_says() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_injected_failures_leave_kvm_as_the_map_says") else {
        return;
    };
    let (m, data, pattern) = faulty_filled(&kvm, &vm);
    let moved_to = 512 * KIB;
    type Op = fn(&MemoryManager<Faulty<KvmVm>>, RegionId) -> Result<(), Error>;
    let operations: [(&str, Op, usize); 5] = [
        ("move", |m, r| m.move_region(r, GuestAddress(512 * KIB)), 16),
        ("read-only", |m, r| m.set_read_only(r, true), 32),
        (
            "start logging",
            |m, r| m.start_dirty_log(Target::Region(r)),
            16,
        ),
        (
            "add",
            |m, _| {
                m.add_region(
                    RegionSpec::new(GuestAddress(768 * KIB), 64 * KIB).with_slot_size(8 * KIB),
                )
                .map(drop)
            },
            8,
        ),
        ("remove", |m, r| m.remove_region(r), 16),
    ];
    for (name, op, steps) in operations {
        for k in [0, 1, steps as u64 / 2, steps as u64 - 1] {
            m.kvm().fail(KvmCall::SetRegion, k, libc::EIO);
            let before = m.regions();
            let err = op(&m, data).expect_err(name);
            assert!(
                err.to_string().contains("Input/output error"),
                "{name} at {k}: {err}"
            );
            assert_eq!(m.regions(), before);
            assert_kvm_matches(&vm, &m, &[moved_to, 768 * KIB]);
        }
        assert!(!m.kvm().failure_pending());
    }
    // After all that, the guest still reads the data where the map says it is.
    let probe = [DATA, DATA + 77 * KIB, DATA + 256 * KIB - 1];
    let mut program = Program::default();
    for gpa in probe {
        program = program.report_byte(gpa);
    }
    let run = run_guest(&vm, &m.handle(), &program.halt());
    let expected: Vec<u8> = probe.iter().map(|a| pattern[(a - DATA) as usize]).collect();
    assert_eq!(run.reported, expected);
}

#[test]
fn kvm_refusing_an_overlap_undoes_the_slots_created_before() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_refusing_an_overlap_undoes_the_slots_created_before")
    else {
        return;
    };
    let m = manager(&kvm, &vm);
    // A slot the manager does not know about, in the middle of where the region will go.
    let foreign = kvm_test_support::ProbePage([0; 4096]);
    let slot = kvm_bindings::kvm_userspace_memory_region {
        slot: 32001,
        flags: 0,
        guest_phys_addr: DATA + 40 * KIB,
        memory_size: 4096,
        userspace_addr: foreign.0.as_ptr() as u64,
    };
    // SAFETY: `foreign` outlives the slot, which is deleted at the end of the test.
    unsafe { vm.set_user_memory_region(slot) }.expect("foreign slot");
    let err = m
        .add_region(RegionSpec::new(GuestAddress(DATA), 64 * KIB).with_slot_size(16 * KIB))
        .expect_err("KVM refuses the overlap");
    assert_eq!(
        err.to_string(),
        "region 0: KVM refused to create slot 2 (guest 0x28000, size 0x4000): File exists (os error 17)"
    );
    assert!(m.regions().is_empty());
    assert_eq!(m.slot_usage().used, 0);
    // The two slots created before the refusal were deleted again.
    assert!(!kvm_has_slot_at(&vm, DATA));
    assert!(!kvm_has_slot_at(&vm, DATA + 16 * KIB));
    // SAFETY: deleting needs no memory.
    unsafe {
        vm.set_user_memory_region(kvm_bindings::kvm_userspace_memory_region {
            memory_size: 0,
            ..slot
        })
    }
    .expect("delete the foreign slot");
}

#[test]
fn kvm_a_dirty_ring_is_refused_with_the_reason_when_its_size_or_timing_is_wrong() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_a_dirty_ring_is_refused_with_the_reason") else {
        return;
    };
    // Not a power of two, too small, too large: refused before KVM is asked.
    for entries in [1000, 128, 1 << 20] {
        let e = KvmVm::with_dirty_ring(&kvm, Arc::clone(&vm), entries).unwrap_err();
        assert!(
            e.to_string().contains("must be a power of two from 256 to"),
            "{e}"
        );
    }
    // KVM takes a ring only before the VM has a vCPU: afterwards the error says so.
    let _vcpu = vm.create_vcpu(0).expect("a vCPU");
    let e = KvmVm::with_dirty_ring(&kvm, Arc::clone(&vm), 4096).unwrap_err();
    assert!(
        e.to_string()
            .contains("must be enabled before any vCPU is created"),
        "{e}"
    );
    // On a VM without vCPUs it is taken, and vCPUs made through it get their rings.
    let fresh = Arc::new(kvm.create_vm().expect("a VM"));
    let ring = KvmVm::with_dirty_ring(&kvm, fresh, 4096).expect("ring mode");
    assert_eq!(ring.ring_entries(), Some(4096));
    ring.create_vcpu(0).expect("a vCPU with its ring");
}

/// Two readers of the dirty log on real KVM, in both harvest modes: a client's harvest and its
/// stop of logging hide no page from the other consumer (a snapshot chain, say).
#[test]
fn kvm_each_dirty_log_consumer_sees_every_page() {
    let name = "kvm_each_dirty_log_consumer_sees_every_page";
    let Some((kvm, _)) = kvm_or_skip(name) else {
        return;
    };
    for ring in [false, true] {
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        let kvm_vm = if ring {
            KvmVm::with_dirty_ring(&kvm, Arc::clone(&vm), 4096).expect("ring mode")
        } else {
            KvmVm::new(&kvm, Arc::clone(&vm)).expect("bitmap mode")
        };
        let m = MemoryManager::new(kvm_vm);
        let (_, data) = guest_layout(&m, false);
        let chain = m.add_dirty_consumer().expect("a second consumer");
        m.start_dirty_log_for(chain, Target::Region(data))
            .expect("the chain logs");
        m.harvest_dirty_for(chain, Target::All)
            .expect("the chain's first harvest");
        m.start_dirty_log(Target::All).expect("the client logs");
        let run = |gpa: u64| {
            let code = Program::default().write_byte(gpa, 0x5a).halt();
            m.handle()
                .memory()
                .write_slice(&code, GuestAddress(CODE))
                .expect("load the guest code");
            let vcpu = if ring {
                m.kvm()
                    .create_vcpu(next_vcpu_id())
                    .expect("a vCPU with a ring")
            } else {
                vm.create_vcpu(next_vcpu_id()).expect("KVM_CREATE_VCPU")
            };
            assert_eq!(run_vcpu(vcpu), Run::default());
        };
        let pages = |d: Vec<kvm_memslots::DirtyPages>| -> Vec<u64> {
            d.iter()
                .filter(|d| d.region == data)
                .flat_map(|d| d.addresses().map(|a| a.0))
                .collect()
        };
        m.harvest_dirty(Target::All)
            .expect("the client's first harvest");
        run(DATA + 3 * 4 * KIB);
        // The client reads the page, then stops logging...
        assert_eq!(
            pages(m.harvest_dirty(Target::All).expect("harvest")),
            vec![DATA + 3 * 4 * KIB],
            "ring {ring}"
        );
        m.stop_dirty_log(Target::All).expect("the client stops");
        assert!(m
            .regions()
            .iter()
            .any(|r| r.id == data && r.flags.log_dirty));
        run(DATA + 40 * 4 * KIB);
        // ... and the chain still gets both pages.
        assert_eq!(
            pages(m.harvest_dirty_for(chain, Target::All).expect("harvest")),
            vec![DATA + 3 * 4 * KIB, DATA + 40 * 4 * KIB],
            "ring {ring}"
        );
        // A consumer also gets what was logged for others in regions it does not log (the
        // manager does not know whose logging caught a write).
        assert_eq!(
            pages(m.harvest_dirty(Target::All).expect("harvest")),
            vec![DATA + 40 * 4 * KIB]
        );
    }
}

/// Where KVM can drop only a deleted or moved slot's mappings, `KvmVm` asks it to; moves and
/// deletes under a guest then behave as before (the other tests here run with it too).
#[test]
fn kvm_slot_changes_zap_only_that_slot_where_kvm_can() {
    let name = "kvm_slot_changes_zap_only_that_slot_where_kvm_can";
    let Some((kvm, vm)) = kvm_or_skip(name) else {
        return;
    };
    let offered =
        vm.check_extension_raw(libc::c_ulong::from(kvm_bindings::KVM_CAP_DISABLE_QUIRKS2));
    let can = u64::try_from(offered)
        .is_ok_and(|o| o & u64::from(kvm_bindings::KVM_X86_QUIRK_SLOT_ZAP_ALL) != 0);
    let m = manager(&kvm, &vm);
    assert_eq!(
        m.kvm().zaps_all_on_slot_change(),
        !can,
        "offered {offered:#x}"
    );
    eprintln!("{name}: KVM offers turning KVM_X86_QUIRK_SLOT_ZAP_ALL off: {can}");
    let fresh = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let kept = KvmVm::keeping_slot_zap_all(&kvm, fresh).expect("a VM");
    assert!(kept.zaps_all_on_slot_change());
    // A guest reads memory across a move with the quirk off.
    let (_, data) = guest_layout(&m, false);
    m.current()
        .write_obj(0x77u8, GuestAddress(DATA + 4 * KIB))
        .expect("write");
    let code = Program::default().report_byte(DATA + 4 * KIB).halt();
    assert_eq!(run_guest(&vm, &m.handle(), &code).reported, vec![0x77]);
    m.move_region(data, GuestAddress(DATA + 512 * KIB))
        .expect("moved");
    let code = Program::default()
        .report_byte(DATA + 512 * KIB + 4 * KIB)
        .halt();
    assert_eq!(run_guest(&vm, &m.handle(), &code).reported, vec![0x77]);
}

/// Re-slots of the data region under test: merges, splits, a hole made and filled, in 16 KiB
/// units of its 256 KiB.
fn reslots(data: RegionId) -> Vec<Reslot> {
    let unit = 16 * KIB;
    let layout = |slots: &[(u64, u64)]| Reslot {
        region: data,
        range: 0..16 * unit,
        slots: slots.iter().map(|&(a, b)| a * unit..b * unit).collect(),
    };
    vec![
        layout(&[(0, 16)]),
        layout(&[(0, 4), (4, 8), (8, 12), (12, 16)]),
        layout(&[(0, 1), (1, 2), (2, 3), (3, 8), (8, 16)]),
        layout(&[(0, 8), (8, 9), (9, 10), (10, 16)]),
        layout(&(0..16).map(|i| (i, i + 1)).collect::<Vec<_>>()),
    ]
}

/// The guest writes an iteration count into every 16 KiB block of the data region, over and
/// over, until the host sets the stop byte; then it reports the count and halts.
fn counting_guest() -> Vec<u8> {
    let blocks: Vec<u16> = (0..16)
        .map(|i| ((DATA + i * 16 * KIB) >> 4) as u16)
        .collect();
    kvm_test_support::counting_guest(&blocks, STOP, PORT as u8)
}

/// The byte the counting guest polls: not zero tells it to stop.
const STOP: u16 = 0x800;

/// What the vCPU thread saw: writes completed after a re-slot, and accesses to no memory.
#[derive(Debug, Default)]
struct Exits {
    completed: u64,
    absent: Vec<u64>,
    reported: Vec<u8>,
}

/// Runs the guest at `CODE` to `hlt`, handling an MMIO exit as a VMM does: where a change is
/// in flight (or ran since the vCPU entered), it waits for it and completes the access against
/// the memory the map has then; only an access no version has memory for is absent.
fn run_vcpu_through_changes(
    mut vcpu: kvm_ioctls::VcpuFd,
    m: &MemoryManager<impl kvm_memslots::KvmMemory>,
) -> Exits {
    kvm_test_support::start_in_real_mode(&vcpu, CODE);
    let mut exits = Exits::default();
    loop {
        let entered = m.change_sequence();
        match vcpu.run().expect("KVM_RUN") {
            VcpuExit::IoOut(PORT, data) => exits.reported.push(data[0]),
            VcpuExit::MmioWrite(addr, data) => {
                let data = data.to_vec();
                let sequence = m.wait_settled(|| false).expect("never gives up");
                let memory = m.current();
                if memory.map().find_by_gpa(GuestAddress(addr)).is_some() {
                    assert!(sequence != entered, "an exit on memory with no change");
                    memory
                        .write_slice(&data, GuestAddress(addr))
                        .expect("complete the write");
                    exits.completed += 1;
                } else {
                    exits.absent.push(addr);
                }
            }
            VcpuExit::Hlt => return exits,
            other => panic!("unexpected vCPU exit: {other:?}"),
        }
    }
}

/// A vCPU writes every block of a region over and over while the region's slots are merged and
/// split under it: no write is lost (every block holds the guest's last count) and none is
/// taken for absent memory (an exit on a slot away for a moment is completed after the change).
#[test]
fn kvm_merges_and_splits_under_a_writing_vcpu_lose_no_write() {
    let name = "kvm_merges_and_splits_under_a_writing_vcpu_lose_no_write";
    let Some((kvm, vm)) = kvm_or_skip(name) else {
        return;
    };
    let m = manager(&kvm, &vm);
    let (_, data) = guest_layout(&m, false);
    m.current()
        .write_slice(&counting_guest(), GuestAddress(CODE))
        .expect("load the guest");
    let vcpu = vm.create_vcpu(next_vcpu_id()).expect("KVM_CREATE_VCPU");
    let layouts = reslots(data);
    let (exits, changes) = std::thread::scope(|scope| {
        let guest = scope.spawn(|| run_vcpu_through_changes(vcpu, &m));
        let started = Instant::now();
        let mut changes = 0;
        // Until the guest has been through enough changes, and at least a second.
        while changes < 200 || started.elapsed().as_secs() < 1 {
            m.reslot(layouts[changes % layouts.len()].clone())
                .expect("re-slot");
            changes += 1;
        }
        m.current()
            .write_obj(1u8, GuestAddress(u64::from(STOP)))
            .expect("stop the guest");
        (guest.join().expect("the vCPU thread"), changes)
    });
    assert!(
        exits.absent.is_empty(),
        "reported absent: {:x?}",
        exits.absent
    );
    let count = u16::from_le_bytes([exits.reported[0], exits.reported[1]]);
    assert!(count > 1, "the guest ran through the changes");
    for block in 0..16 {
        let gpa = DATA + block * 16 * KIB + 0x10;
        let got: u16 = m.current().read_obj(GuestAddress(gpa)).expect("read");
        assert_eq!(got, count, "block {block}: a write was lost");
    }
    eprintln!(
        "{name}: {changes} re-slots, guest count {count}, {} writes completed after a change",
        exits.completed
    );
    assert_kvm_matches(&vm, &m, &[]);
}

/// KVM refusing any step of a merge or a split leaves KVM's slots as they were (probed in
/// KVM, holes included), and the guest reads the data where it was.
#[test]
fn kvm_a_refused_reslot_leaves_kvms_slots_as_they_were() {
    let Some((kvm, vm)) = kvm_or_skip("kvm_a_refused_reslot_leaves_kvms_slots_as_they_were") else {
        return;
    };
    let (m, data, pattern) = faulty_filled(&kvm, &vm);
    let layouts = reslots(data);
    for (i, layout) in layouts.iter().enumerate() {
        // Fail each step in turn until the re-slot goes through.
        let layout_of = |m: &MemoryManager<Faulty<KvmVm>>| m.slot_ranges(data).expect("region");
        let before = layout_of(&m);
        let mut steps = 0;
        loop {
            m.kvm().fail(KvmCall::SetRegion, steps, libc::EIO);
            let Err(err) = m.reslot(layout.clone()) else {
                m.kvm().heal();
                break;
            };
            assert_eq!(err.errno(), Some(libc::EIO), "{err}");
            assert_eq!(layout_of(&m), before, "layout {i}, step {steps}");
            assert_kvm_matches(&vm, &m, &[]);
            steps += 1;
        }
        assert!(steps >= 2, "layout {i}: {steps} steps");
    }
    // A hole: no slot in KVM either.
    let holed = Reslot {
        region: data,
        range: 0..256 * KIB,
        slots: vec![0..64 * KIB, 128 * KIB..256 * KIB],
    };
    m.kvm().fail(KvmCall::SetRegion, 1, libc::EIO);
    assert!(m.reslot(holed.clone()).is_err());
    assert_kvm_matches(&vm, &m, &[]);
    m.reslot(holed).expect("the hole");
    assert_kvm_matches(&vm, &m, &[DATA + 64 * KIB, DATA + 127 * KIB]);
    let probe = [DATA, DATA + 33 * KIB, DATA + 255 * KIB];
    let mut program = Program::default();
    for gpa in probe {
        program = program.report_byte(gpa);
    }
    let run = run_guest(
        &vm,
        &m.handle(),
        &program.report_byte(DATA + 100 * KIB).halt(),
    );
    let mut expected: Vec<u8> = probe.iter().map(|a| pattern[(a - DATA) as usize]).collect();
    expected.push(0xff);
    assert_eq!(run.reported, expected);
    assert_eq!(
        run.mmio_reads,
        vec![DATA + 100 * KIB],
        "the hole is no memory"
    );
}

/// A hook on real KVM that, once armed, lets `at` calls of `KVM_SET_USER_MEMORY_REGION`
/// through, then runs the guest loaded at `CODE` to `hlt` (a vCPU running in the middle of a
/// change) and refuses the next call with `EIO`, as KVM refusing a later step would.
struct GuestRunsThenRefused {
    vm: Arc<VmFd>,
    armed: std::sync::atomic::AtomicBool,
    at: u64,
    calls: std::sync::atomic::AtomicU64,
    run: std::sync::Mutex<Option<Run>>,
}

impl kvm_memslots::testing::Hook for GuestRunsThenRefused {
    fn around<T>(
        &self,
        request: kvm_memslots::testing::KvmRequest<'_>,
        proceed: impl FnOnce() -> Result<T, vmm_sys_util::errno::Error>,
    ) -> Result<T, vmm_sys_util::errno::Error> {
        use std::sync::atomic::Ordering::SeqCst;
        if matches!(request, kvm_memslots::testing::KvmRequest::SetRegion(_))
            && self.armed.load(SeqCst)
            && self.calls.fetch_add(1, SeqCst) == self.at
        {
            self.armed.store(false, SeqCst);
            let vcpu = self
                .vm
                .create_vcpu(next_vcpu_id())
                .expect("KVM_CREATE_VCPU");
            *self.run.lock().expect("not poisoned") = Some(run_vcpu(vcpu));
            return Err(vmm_sys_util::errno::Error::new(libc::EIO));
        }
        proceed()
    }
}

/// The guest writes into a slot a change created (a read-only toggle's re-created slot, a
/// re-slot's new one), then KVM refuses a later step of that change and the undo deletes the
/// slot again: the write landed in the slot's log, and the next harvest reports it (the undo
/// reads a logging slot's log before deleting it, as the change itself does).
#[test]
fn kvm_a_write_into_a_slot_an_undo_deletes_is_harvested() {
    let name = "kvm_a_write_into_a_slot_an_undo_deletes_is_harvested";
    let Some((kvm, _)) = kvm_or_skip(name) else {
        return;
    };
    type Change = fn(
        &MemoryManager<kvm_memslots::testing::Hooked<KvmVm, GuestRunsThenRefused>>,
        RegionId,
    ) -> Result<(), Error>;
    // Each change, the calls it makes before the refused one, and whether the data region
    // starts read-only. The data region has two slots of 32 KiB.
    let changes: [(&str, Change, u64, bool); 2] = [
        // Slot 0: park, delete, create writable; slot 1: park (refused).
        (
            "read-only toggle",
            |m, r| m.set_read_only(r, false),
            3,
            true,
        ),
        // Slot 0: park, delete; create its first half; create its second half (refused).
        (
            "re-slot",
            |m, r| {
                m.reslot(Reslot {
                    region: r,
                    range: 0..32 * KIB,
                    slots: vec![0..16 * KIB, 16 * KIB..32 * KIB],
                })
            },
            3,
            false,
        ),
    ];
    let written = DATA + 4 * KIB;
    for (change_name, change, at, read_only) in changes {
        // A VM of its own for each: the vCPUs one makes stay until its VM goes.
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        let hook = GuestRunsThenRefused {
            vm: Arc::clone(&vm),
            armed: Default::default(),
            at,
            calls: Default::default(),
            run: Default::default(),
        };
        let m = MemoryManager::new(kvm_memslots::testing::Hooked::with_hook(
            KvmVm::new(&kvm, Arc::clone(&vm)).expect("KVM"),
            hook,
        ));
        let hook = m.kvm().hook();
        m.add_region(RegionSpec::new(GuestAddress(0), 64 * KIB))
            .expect("code region");
        let spec = RegionSpec::new(GuestAddress(DATA), 64 * KIB)
            .with_slot_ranges(vec![0..32 * KIB, 32 * KIB..64 * KIB])
            .with_flags(kvm_memslots::SlotFlags {
                log_dirty: true,
                read_only,
            });
        let data = m.add_region(spec).expect("data region");
        m.current()
            .write_slice(
                &Program::default().write_byte(written, 0x5a).halt(),
                GuestAddress(CODE),
            )
            .expect("load the guest code");
        // Logging starts with every page counted dirty: take that first.
        assert_eq!(
            m.harvest_dirty(Target::Region(data)).expect("harvest")[0].count(),
            16
        );
        let before = m.regions();
        hook.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let err = change(&m, data).expect_err(change_name);
        assert_eq!(err.errno(), Some(libc::EIO), "{change_name}: {err}");
        let run = hook.run.lock().expect("not poisoned").take();
        assert_eq!(
            run,
            Some(Run::default()),
            "{change_name}: the write landed in a slot"
        );
        assert_eq!(m.regions(), before, "{change_name}: undone");
        assert_kvm_matches(&vm, &m, &[]);
        assert_eq!(
            m.current()
                .read_obj::<u8>(GuestAddress(written))
                .expect("read"),
            0x5a
        );
        let dirty = m.harvest_dirty(Target::Region(data)).expect("harvest");
        let pages: Vec<u64> = dirty[0].addresses().map(|a| a.0).collect();
        assert_eq!(
            pages,
            vec![written],
            "{change_name}: the guest's write is harvested"
        );
    }
}

/// The pages of the data region the checking guest writes, one 16-bit count at offset 0x10
/// of each.
const PAGES: u64 = 64;

/// The guest writes an iteration count into each page of the data region in turn, over and
/// over; after each write it halts if the stop byte is set (and goes on with the next page when
/// resumed). So the host stops it within one write of asking.
fn halting_guest() -> Vec<u8> {
    let mut code = vec![0x31, 0xd2]; // xor dx, dx
    let top = code.len();
    code.push(0x42); // inc dx
    for page in 0..PAGES {
        let segment = ((DATA + page * 4 * KIB) >> 4) as u16;
        code.push(0xb8); // mov ax, segment
        code.extend(segment.to_le_bytes());
        code.extend([0x8e, 0xd8]); // mov ds, ax
        code.extend([0x89, 0x16, 0x10, 0x00]); // mov [0x10], dx
        code.extend([0x31, 0xc0, 0x8e, 0xd8]); // xor ax, ax; mov ds, ax
        code.extend([0x80, 0x3e]); // cmp byte [STOP], 0
        code.extend(STOP.to_le_bytes());
        code.push(0x00);
        code.extend([0x74, 0x01]); // je past the hlt
        code.push(0xf4); // hlt
    }
    let back = top as i64 - (code.len() as i64 + 3);
    code.push(0xe9); // jmp top
    code.extend((back as i16).to_le_bytes());
    code
}

/// What a round of the dirty-log check changes under the writing guest.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// Re-slots through the layouts of `reslots`.
    Reslot,
    /// Read-only and back.
    ReadOnly,
    /// Logging stopped and started again.
    StopLogging,
}

/// Runs the halting guest on `vcpu` until `done`: at each `hlt` it says so on `halted` and
/// waits for a word on `resume`. A write that exits because its slot was away (or read-only)
/// for a moment is completed through vm-memory once the region is writable again, as a VMM
/// completes it.
fn run_halting_vcpu(
    mut vcpu: kvm_ioctls::VcpuFd,
    m: &MemoryManager<impl kvm_memslots::KvmMemory>,
    halted: &std::sync::mpsc::Sender<()>,
    resume: &std::sync::mpsc::Receiver<bool>,
) -> Exits {
    kvm_test_support::start_in_real_mode(&vcpu, CODE);
    let mut exits = Exits::default();
    loop {
        match vcpu.run().expect("KVM_RUN") {
            VcpuExit::MmioWrite(addr, data) => {
                let data = data.to_vec();
                loop {
                    m.wait_settled(|| false).expect("never gives up");
                    let memory = m.current();
                    match memory.map().find_by_gpa(GuestAddress(addr)) {
                        Some(slot) if slot.flags().read_only => std::thread::yield_now(),
                        Some(_) => {
                            memory
                                .write_slice(&data, GuestAddress(addr))
                                .expect("complete the write");
                            exits.completed += 1;
                            break;
                        }
                        None => {
                            exits.absent.push(addr);
                            break;
                        }
                    }
                }
            }
            VcpuExit::Hlt => {
                halted.send(()).expect("the host waits");
                if !resume.recv().expect("the host's word") {
                    return exits;
                }
            }
            other => panic!("unexpected vCPU exit: {other:?}"),
        }
    }
}

/// Runs rounds of `path` under the halting guest for `seconds` with the data region logging
/// dirty pages: each round makes one change (or a pair) while the guest writes, stops the
/// guest, harvests, and copies the reported pages into a shadow as a migration would; every
/// page whose memory then differs from the shadow had a write no harvest reported. Returns
/// (rounds, pages found unreported, writes completed after a change).
fn dirty_log_rounds(path: Path, seconds: u64) -> Option<(u64, u64, u64)> {
    let name = format!("kvm_writes_during_changes_are_all_harvested ({path:?})");
    let (kvm, vm) = kvm_or_skip(&name)?;
    let m = manager(&kvm, &vm);
    let (_, data) = guest_layout(&m, true);
    m.current()
        .write_slice(&halting_guest(), GuestAddress(CODE))
        .expect("load the guest");
    let value = |page: u64| -> u16 {
        m.current()
            .read_obj(GuestAddress(DATA + page * 4 * KIB + 0x10))
            .expect("read")
    };
    let mut shadow = vec![0u16; PAGES as usize];
    let take = |shadow: &mut Vec<u16>| {
        let dirty = m.harvest_dirty(Target::Region(data)).expect("harvest");
        for page in 0..PAGES {
            if dirty[0].is_dirty(page) {
                shadow[page as usize] = value(page);
            }
        }
    };
    take(&mut shadow);
    let layouts = reslots(data);
    // With no guest running, a re-slot or a toggle reports nothing: the logs of the slots it
    // deletes are read exactly (parked out of the guest's way first), not marked wholesale.
    for (i, layout) in layouts.iter().enumerate() {
        m.reslot(layout.clone()).expect("re-slot");
        let dirty = m.harvest_dirty(Target::Region(data)).expect("harvest");
        assert_eq!(dirty[0].count(), 0, "{path:?}: re-slot {i} reported pages");
    }
    m.set_read_only(data, true).expect("read-only");
    m.set_read_only(data, false).expect("writable");
    let dirty = m.harvest_dirty(Target::Region(data)).expect("harvest");
    assert_eq!(dirty[0].count(), 0, "{path:?}: a toggle reported pages");
    let vcpu = vm.create_vcpu(next_vcpu_id()).expect("KVM_CREATE_VCPU");
    let (halted_tx, halted) = std::sync::mpsc::channel();
    let (resume, resume_rx) = std::sync::mpsc::channel();
    let stop = |on: u8| {
        m.current()
            .write_obj(on, GuestAddress(u64::from(STOP)))
            .expect("the stop byte");
    };
    let (exits, rounds, lost) = std::thread::scope(|scope| {
        let manager = &m;
        let guest = scope.spawn(move || run_halting_vcpu(vcpu, manager, &halted_tx, &resume_rx));
        let started = Instant::now();
        let (mut rounds, mut lost) = (0u64, 0u64);
        // At least `seconds`, and at least 100 rounds on a loaded host.
        while rounds < 100 || started.elapsed().as_secs() < seconds {
            match path {
                Path::Reslot => m
                    .reslot(layouts[rounds as usize % layouts.len()].clone())
                    .expect("re-slot"),
                Path::ReadOnly => {
                    m.set_read_only(data, true).expect("read-only");
                    m.set_read_only(data, false).expect("writable");
                }
                Path::StopLogging => {
                    m.stop_dirty_log(Target::Region(data)).expect("stop");
                    m.start_dirty_log(Target::Region(data)).expect("start");
                }
            }
            stop(1);
            halted.recv().expect("the guest halts");
            take(&mut shadow);
            for page in 0..PAGES {
                let now = value(page);
                if shadow[page as usize] != now {
                    lost += 1;
                    shadow[page as usize] = now;
                }
            }
            stop(0);
            resume.send(true).expect("the guest waits");
            rounds += 1;
        }
        stop(1);
        halted.recv().expect("the guest halts");
        resume.send(false).expect("the guest waits");
        (guest.join().expect("the vCPU thread"), rounds, lost)
    });
    assert!(exits.absent.is_empty(), "absent: {:x?}", exits.absent);
    assert!(value(PAGES - 1) > 1, "the guest went round more than once");
    eprintln!(
        "{name}: {rounds} rounds, {lost} pages written and not harvested, {} writes completed \
         after a change",
        exits.completed
    );
    Some((rounds, lost, exits.completed))
}

/// Bitmap mode: a vCPU writes page after page of a logging region while its slots are
/// re-slotted, made read-only and back, or its logging stopped and started again; after each
/// change the guest is stopped and a harvest taken, and every page the guest wrote must have
/// been reported (a write between the change's read of a slot's log and KVM freeing that log
/// would be lost).
#[test]
fn kvm_writes_during_changes_are_all_harvested() {
    let mut outcomes = Vec::new();
    for path in [Path::Reslot, Path::ReadOnly, Path::StopLogging] {
        let Some((rounds, lost, _)) =
            dirty_log_rounds(path, if matches!(path, Path::ReadOnly) { 6 } else { 2 })
        else {
            return;
        };
        outcomes.push((path, rounds, lost));
    }
    for (path, _, lost) in outcomes {
        assert_eq!(lost, 0, "{path:?}: writes no harvest reported");
    }
}
