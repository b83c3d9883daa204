//! The slot-less window on real `/dev/kvm`: while the manager deletes (or parks) a slot and
//! creates its successor, a guest access into that range has no slot, and KVM emulates the
//! instruction. Its emulator has no VEX (AVX) instructions and cannot fetch an instruction from
//! a page with no slot. Here two vCPUs store and load with 32-byte VEX instructions and run
//! code from memory whose slots change under them, a thousand times for each kind of change
//! the manager makes under a running guest: a move, a read-only toggle, a re-slot (merge and
//! split; a hole made and covered), the same re-slot parked (dirty logging on), and the test
//! guest's hotplug pieces (whose plugs and unplugs now change no slot, only which blocks are
//! reachable). No command may fault, no vCPU stop, no write be lost.
//!
//! Outside any window the same instructions where the guest has no memory are the guest's own
//! mistake: in guest user mode (the test guest's ring 3) they get `#UD`, as KVM gives them
//! without `KVM_CAP_EXIT_ON_EMULATION_FAILURE`, rather than stopping the VM.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvm_memslots::{RegionId, RegionSpec, Reslot, Target};
use tinyvmm::control::hotplug::HotplugConfig;
use tinyvmm::test_guest::hotplug::HotplugArea;
use tinyvmm::test_guest::vcpus::{expect_pattern, TestVm, Vcpus};
use tinyvmm::test_guest::{layout, Command, Op, STUB};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const MIB: u64 = 1 << 20;
/// Round trips (a change and its reverse) per kind of change.
const ROUNDS: u64 = 500;
/// How long the guest may go without finishing a command before the test calls it a hang.
const HANG: Duration = Duration::from_secs(120);
/// Changes between two waits for the guest to finish commands.
const PACE: u64 = 50;
/// Distance between two addresses a vCPU touches: every other page, so that the two vCPUs
/// share no page.
const STRIDE: u64 = 2 * 4096;
/// Where the test's memory lies: above the system region, well inside the identity map.
const BASE: u64 = 256 * MIB;

/// What each of the two vCPUs runs over and over while the host changes slots.
struct Load {
    /// vCPU 0: 32-byte VEX stores and loads over this range (one page in two).
    vex: Range<u64>,
    /// vCPU 0 stores with the same seed every time (the memory moves under it: both places
    /// then hold the same values), or a new seed each round, checked by the load after it.
    fixed_seed: bool,
    /// vCPU 0 only loads (its memory turns read-only under it).
    vex_reads_only: bool,
    /// vCPU 1: stores a stub in each page (the other page in two) and calls it.
    exec: Range<u64>,
    /// vCPU 1 only calls the stubs already there.
    exec_calls_only: bool,
}

/// What the changes did, for the report.
#[derive(Debug, Default)]
struct Tally {
    /// Slot changes made (each a change of the manager).
    changes: u64,
    /// 32-byte VEX loads checked by the guest.
    vex_verified: u64,
    /// Calls of stubs in memory whose slots changed.
    calls: u64,
    /// Instructions KVM could not emulate in a window, run again after the change.
    retried: u64,
    /// Plain accesses in a window, completed against the map after the change.
    completed: u64,
}

fn command(op: Op, range: &Range<u64>, offset: u64, seed: u64) -> Command {
    Command {
        op,
        start: range.start + offset,
        end: range.end,
        stride: STRIDE,
        seed,
    }
}

/// The commands vCPU `vcpu` runs in turn under `load`; round `k` of vCPU 0 uses seed `k`
/// unless the seed is fixed.
fn next_command(load: &Load, vcpu: usize, step: u64) -> Command {
    if vcpu == 0 {
        let seed = if load.fixed_seed { 1 } else { 1 + step / 2 };
        let op = if load.vex_reads_only || step % 2 == 1 {
            Op::VexVerify
        } else {
            Op::VexWrite
        };
        command(op, &load.vex, 0, if load.vex_reads_only { 1 } else { seed })
    } else {
        let op = if load.exec_calls_only || step % 2 == 1 {
            Op::Call
        } else {
            Op::Exec
        };
        command(op, &load.exec, 4096, 0)
    }
}

/// Runs `load` on the two vCPUs until `change` has been called `2 * ROUNDS` times (round `i`
/// gets `i`), on a thread of its own; every command must finish with no mismatch. Ends with
/// both vCPUs between commands, the last VEX command a verify; returns its seed.
fn under_changes(
    vcpus: &mut Vcpus,
    load: &Load,
    change: impl FnMut(u64) + Send,
    tally: &mut Tally,
) -> u64 {
    let started = std::time::Instant::now();
    let counted = |vcpus: &Vcpus| {
        (0..2).fold((0, 0), |(r, c), v| {
            let counters = &vcpus.shared(v).counters;
            (
                r + counters.retried_after_change.load(Ordering::Relaxed),
                c + counters.completed_after_change.load(Ordering::Relaxed),
            )
        })
    };
    let before = counted(vcpus);
    let finish = AtomicBool::new(false);
    let made = AtomicU64::new(0);
    let commands = AtomicU64::new(0);
    let mut last_seed = 0;
    std::thread::scope(|scope| {
        let changer = std::thread::Builder::new()
            .name("changes".into())
            .spawn_scoped(scope, || {
                let mut change = change;
                for i in 0..2 * ROUNDS {
                    if finish.load(Ordering::Acquire) {
                        return i;
                    }
                    if i % PACE == 0 {
                        // Let the guest finish two commands per stretch of changes first, so
                        // that it does some work through them however fast they go. (A
                        // target counted from the start: one counted from what the guest had
                        // done when this thread looked could lie past what the guest is let
                        // do, and both would wait.)
                        let target = 2 * (i / PACE + 1);
                        while commands.load(Ordering::Acquire) < target {
                            if finish.load(Ordering::Acquire) {
                                return i;
                            }
                            std::thread::sleep(Duration::from_micros(100));
                        }
                    }
                    change(i);
                    made.fetch_add(1, Ordering::Relaxed);
                }
                finish.store(true, Ordering::Release);
                2 * ROUNDS
            })
            .expect("spawning the change thread");
        let mut steps = [0u64; 2];
        for (vcpu, step) in steps.iter().enumerate() {
            vcpus.start(vcpu, next_command(load, vcpu, *step));
        }
        let mut failure = None;
        let mut running = [true, true];
        // A vCPU that finished a command and waits for the changes to catch up, with the op
        // of its last command.
        let mut waiting: [Option<Op>; 2] = [None, None];
        let mut progress = std::time::Instant::now();
        while running.iter().any(|r| *r) {
            // Only a guard against a hang: a command takes milliseconds on any host.
            if progress.elapsed() > HANG {
                finish.store(true, Ordering::Release);
                // Where each vCPU is, for whoever looks into it.
                let at: Vec<String> = (0..2)
                    .map(|v| {
                        let shared = vcpus.shared(v);
                        let exits = shared.counters.exits();
                        let state = shared
                            .pause(Duration::from_secs(5))
                            .map_err(|e| e.to_string())
                            .and_then(|()| shared.save_paused().map_err(|e| e.to_string()));
                        shared.resume();
                        match state {
                            Ok(s) => format!(
                                "vCPU {v}: rip {:#x} rcx {:#x}, {exits} exits",
                                s.regs.rip, s.regs.rcx
                            ),
                            Err(e) => format!("vCPU {v}: {e}, {exits} exits"),
                        }
                    })
                    .collect();
                panic!(
                    "no guest command finished for {HANG:?} after {} changes: {}",
                    made.load(Ordering::Relaxed),
                    at.join("; ")
                );
            }
            let mut idle = true;
            for vcpu in 0..2 {
                if !running[vcpu] {
                    continue;
                }
                if let Some(last) = waiting[vcpu] {
                    // Go on until the changes are done, then end vCPU 0 on a verify. Hold
                    // the guest back while it is more than a few commands ahead of the
                    // changes: its vCPUs would otherwise take every core from them.
                    let done = finish.load(Ordering::Acquire);
                    // (Twice what the changes wait for: neither waits for the other.)
                    let allowed = 4 * (made.load(Ordering::Acquire) / PACE + 1);
                    if done && (vcpu == 1 || last == Op::VexVerify) {
                        running[vcpu] = false;
                    } else if done || commands.load(Ordering::Acquire) < allowed {
                        waiting[vcpu] = None;
                        vcpus.start(vcpu, next_command(load, vcpu, steps[vcpu]));
                    }
                    continue;
                }
                let Some((command, outcome)) = vcpus.poll(vcpu) else {
                    continue;
                };
                idle = false;
                progress = std::time::Instant::now();
                if let Err(e) = outcome {
                    failure.get_or_insert(format!(
                        "vCPU {vcpu}, {:?} over [{:#x}, {:#x}) after {} changes: {e}",
                        command.op,
                        command.start,
                        command.end,
                        made.load(Ordering::Relaxed)
                    ));
                    finish.store(true, Ordering::Release);
                    running[vcpu] = false;
                    continue;
                }
                let addresses = (command.end - command.start).div_ceil(STRIDE);
                match command.op {
                    Op::VexVerify => {
                        tally.vex_verified += addresses;
                        last_seed = command.seed;
                    }
                    Op::Exec | Op::Call => tally.calls += addresses,
                    _ => {}
                }
                steps[vcpu] += 1;
                commands.fetch_add(1, Ordering::Release);
                waiting[vcpu] = Some(command.op);
            }
            if idle {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let changes = changer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        tally.changes += changes;
        let after = counted(vcpus);
        tally.retried += after.0 - before.0;
        tally.completed += after.1 - before.1;
        eprintln!(
            "  {changes} changes in {:?}: {} retried, {} completed after a change",
            started.elapsed(),
            after.0 - before.0,
            after.1 - before.1
        );
        if let Some(failure) = failure {
            panic!("{failure}");
        }
    });
    last_seed
}

/// Checks from the host that the last VEX write's values are all there (seed `seed`) and
/// every exec stub too.
fn check_memory(vm: &TestVm, load: &Load, seed: u64) {
    let memory = vm.memory().current();
    for a in load.vex.clone().step_by(STRIDE as usize) {
        for word in 0..4 {
            expect_pattern(&*memory, a + 8 * word, seed).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    for a in (load.exec.start + 4096..load.exec.end).step_by(STRIDE as usize) {
        let stub: u64 = memory.read_obj(GuestAddress(a)).expect("memory");
        assert_eq!(stub, STUB, "the stub at {a:#x}");
    }
}

fn start() -> Option<(TestVm, Vcpus)> {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_vex_accesses_and_code_in_changing_slots_never_fault",
    ) {
        return None;
    }
    if !layout::avx_available() {
        eprintln!(
            "SKIPPED tinyvmm::kvm_vex_accesses_and_code_in_changing_slots_never_fault: this \
             host's KVM offers no AVX, so the guest has no VEX instructions to run"
        );
        return None;
    }
    let vm = TestVm::new().expect("the test guest's VM");
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let vcpus = vm.start_vcpus(2, &stopped).expect("two vCPUs");
    Some((vm, vcpus))
}

/// A region of `size` at `gpa` in slots of `slot`.
fn region(vm: &TestVm, gpa: u64, size: u64, slot: u64) -> RegionId {
    vm.memory()
        .add_region(RegionSpec::new(GuestAddress(gpa), size).with_slot_size(slot))
        .expect("a region")
}

/// The two vCPUs' ranges in `range`: VEX over all of it, exec over all of it (on the other
/// pages).
fn load_over(range: Range<u64>) -> Load {
    Load {
        vex: range.clone(),
        fixed_seed: false,
        vex_reads_only: false,
        exec: range,
        exec_calls_only: false,
    }
}

/// Merges and splits a 4 MiB region (two slots ↔ one) under the load, then the same with
/// dirty logging on (every delete then parks its slot first), then makes a hole in its upper
/// half and covers it again (the load in the lower half).
// Slot layouts are lists of ranges, one range long as often as not.
#[allow(clippy::single_range_in_vec_init)]
fn reslots(vm: &TestVm, vcpus: &mut Vcpus, tally: &mut Tally, gpa: u64) {
    let memory = vm.memory();
    let id = region(vm, gpa, 4 * MIB, 2 * MIB);
    let load = load_over(gpa..gpa + 4 * MIB);
    // With no change under way, every command runs as any other.
    vcpus
        .run(0, command(Op::VexWrite, &load.vex, 0, 7))
        .expect("VEX stores with no change");
    vcpus
        .run(0, command(Op::VexVerify, &load.vex, 0, 7))
        .expect("VEX loads with no change");
    vcpus
        .run(1, command(Op::Exec, &load.exec, 4096, 0))
        .expect("calls with no change");
    check_memory(vm, &load, 7);
    let layouts = [vec![0..4 * MIB], vec![0..2 * MIB, 2 * MIB..4 * MIB]];
    let reslot = |i: u64, layouts: &[Vec<Range<u64>>]| {
        memory
            .reslot(Reslot {
                region: id,
                range: 0..4 * MIB,
                slots: layouts[i as usize % layouts.len()].clone(),
            })
            .expect("re-slot");
    };
    let seed = under_changes(vcpus, &load, |i| reslot(i, &layouts), tally);
    check_memory(vm, &load, seed);
    eprintln!("merges and splits: {tally:?}");
    memory
        .start_dirty_log(Target::Region(id))
        .expect("dirty logging");
    let seed = under_changes(vcpus, &load, |i| reslot(i, &layouts), tally);
    check_memory(vm, &load, seed);
    eprintln!("parked merges and splits: {tally:?}");
    memory
        .stop_dirty_log(Target::Region(id))
        .expect("dirty logging off");
    let holes = [vec![0..2 * MIB], vec![0..4 * MIB]];
    let lower = load_over(gpa..gpa + 2 * MIB);
    let seed = under_changes(vcpus, &lower, |i| reslot(i, &holes), tally);
    check_memory(vm, &lower, seed);
    eprintln!("holes: {tally:?}");
}

#[test]
fn kvm_vex_accesses_and_code_in_changing_slots_never_fault() {
    let Some((vm, mut vcpus)) = start() else {
        return;
    };
    let memory = Arc::clone(vm.memory());
    let mut tally = Tally::default();

    reslots(&vm, &mut vcpus, &mut tally, BASE);

    // Read-only toggles (delete and create): the guest only loads and calls there.
    let gpa = BASE + 16 * MIB;
    let id = region(&vm, gpa, 2 * MIB, 2 * MIB);
    let load = load_over(gpa..gpa + 2 * MIB);
    vcpus
        .run(0, command(Op::VexWrite, &load.vex, 0, 1))
        .expect("fill");
    vcpus
        .run(1, command(Op::Exec, &load.exec, 4096, 0))
        .expect("stubs");
    // vCPU 1 calls into 16 pages only: calls over the whole region, which never exit, slowed
    // each toggle to some 10 ms on this host (a few hundred µs elsewhere).
    let read_only = Load {
        vex_reads_only: true,
        exec_calls_only: true,
        exec: load.exec.start..load.exec.start + 32 * 4096,
        ..load
    };
    under_changes(
        &mut vcpus,
        &read_only,
        |i| memory.set_read_only(id, i % 2 == 0).expect("toggle"),
        &mut tally,
    );
    check_memory(&vm, &read_only, 1);
    eprintln!("read-only toggles: {tally:?}");

    // Moves by one slot and back: the guest touches the upper slot's range, memory in both
    // places. Both places first get the same values and stubs.
    let gpa = BASE + 32 * MIB;
    let id = region(&vm, gpa, 4 * MIB, 2 * MIB);
    let upper = gpa + 2 * MIB..gpa + 4 * MIB;
    let moving = Load {
        vex: upper.start..upper.start + MIB,
        fixed_seed: true,
        vex_reads_only: false,
        exec: upper.start + MIB..upper.end,
        exec_calls_only: false,
    };
    for place in [gpa + 2 * MIB, gpa] {
        vcpus
            .run(0, command(Op::VexWrite, &moving.vex, 0, 1))
            .expect("fill");
        vcpus
            .run(1, command(Op::Exec, &moving.exec, 4096, 0))
            .expect("stubs");
        memory.move_region(id, GuestAddress(place)).expect("move");
    }
    under_changes(
        &mut vcpus,
        &moving,
        |i| {
            let to = if i % 2 == 0 { gpa + 2 * MIB } else { gpa };
            memory.move_region(id, GuestAddress(to)).expect("move")
        },
        &mut tally,
    );
    check_memory(&vm, &moving, 1);
    eprintln!("moves: {tally:?}");

    // The hotplug area's pieces: one piece of four 2 MiB blocks, plugged from one block to
    // two and back: the piece keeps its one slot over the first block, in use, and each plug
    // or unplug only makes the second block reachable or not.
    let config = HotplugConfig {
        total_size_mib: 8,
        block_size_mib: 2,
        slot_size_mib: Some(8),
        page_size: Default::default(),
    };
    let gpa = BASE + 64 * MIB;
    let mut area = HotplugArea::new(config, gpa, layout::IDENTITY_MAPPED, 16).expect("area");
    let mut plug = |blocks: u64| {
        let plan = area.plan_blocks(blocks);
        let failures = area.carry_out(&memory, &plan).expect("plug");
        assert!(failures.is_empty(), "{failures:?}");
    };
    plug(1);
    let first_block = load_over(gpa..gpa + 2 * MIB);
    let seed = under_changes(
        &mut vcpus,
        &first_block,
        |i| plug(1 + (i + 1) % 2),
        &mut tally,
    );
    check_memory(&vm, &first_block, seed);
    eprintln!("hotplug pieces: {tally:?}");

    eprintln!(
        "{} slot changes under two vCPUs; {} 32-byte VEX loads checked; {} calls into \
         changing memory; {} instructions run again after a change, {} accesses completed",
        tally.changes, tally.vex_verified, tally.calls, tally.retried, tally.completed
    );
    // The window was met: the instructions KVM could not emulate in it were run again.
    assert!(tally.retried > 0, "{tally:?}");
    vcpus.shut_down().expect("clean shutdown");
}

/// Runs `command` on a fresh test guest's only vCPU, where the guest has no memory; returns
/// the exception the guest took.
fn fault_of(command: Command) -> tinyvmm::test_guest::Fault {
    use tinyvmm::test_guest::ports::GuestPortError;
    use tinyvmm::test_guest::vcpus::GuestError;
    use tinyvmm::vm::vcpu::VcpuError;
    let vm = TestVm::new().expect("the test guest's VM");
    let stopped = Arc::new(EventFd::new(0).expect("eventfd"));
    let mut vcpus = vm.start_vcpus(1, &stopped).expect("a vCPU");
    let outcome = vcpus.run(0, command);
    match outcome {
        Err(GuestError::Vcpu(VcpuError::Device {
            error: GuestPortError::Fault(fault),
            ..
        })) => fault,
        other => panic!(
            "{:?} over [{:#x}, {:#x}): {other:?}",
            command.op, command.start, command.end
        ),
    }
}

/// A 32-byte VEX store and a call where the guest has no memory, with no slot change: KVM's
/// emulator cannot run either, and the guest (in ring 3) gets `#UD` at the instruction, as
/// KVM gives it by default, where the VM used to stop on an emulation failure.
#[test]
fn kvm_an_instruction_kvm_cannot_emulate_outside_a_window_is_ud_in_user_mode() {
    const TEST: &str =
        "tinyvmm::kvm_an_instruction_kvm_cannot_emulate_outside_a_window_is_ud_in_user_mode";
    if !kvm_test_support::require_kvm(TEST) {
        return;
    }
    // No region there: no slot, no device.
    let nowhere = BASE..BASE + 2 * MIB;
    let code = layout::CODE_GPA..layout::CODE_GPA + 0x1_0000;
    let call = fault_of(command(Op::Call, &nowhere, 0, 0));
    assert_eq!(call.vector, 6, "{call}");
    assert_eq!(
        call.rip(),
        nowhere.start,
        "the fetch faults at the stub's address: {call}"
    );
    if !layout::avx_available() {
        eprintln!(
            "SKIPPED {TEST} (VEX part): this host's KVM offers no AVX, so the guest has no \
             VEX instructions to run"
        );
        return;
    }
    let store = fault_of(command(Op::VexWrite, &nowhere, 0, 1));
    assert_eq!(store.vector, 6, "{store}");
    assert!(
        code.contains(&store.rip()),
        "the store faults in the guest's code: {store}"
    );
    let load = fault_of(command(Op::VexVerify, &nowhere, 0, 1));
    assert_eq!(load.vector, 6, "{load}");
    assert!(
        code.contains(&load.rip()),
        "the load faults in the guest's code: {load}"
    );
    assert_ne!(store.rip(), load.rip(), "two instructions");
}
