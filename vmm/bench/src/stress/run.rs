//! The run proper: the write loops, the changes beside them with the verifier, the final check
//! and the verifier's phase.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_memslots::PAGE_SIZE;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::changer::{Changer, Kinds};
use super::check::check_part;
use super::config::{
    StressConfig, StressError, VERIFY_GPA, VERIFY_SEED, VERIFY_SIZE, VERIFY_STRIDE,
};
use tinyvmm::test_guest::vcpus::Vcpus;
use tinyvmm::test_guest::{pattern, Command, Op};

/// What the job watches while the vCPUs run.
pub(super) struct Watch<'a> {
    pub(super) stop: &'a AtomicBool,
    pub(super) stopped: &'a Arc<EventFd>,
    pub(super) down: &'a EventFd,
}

impl Watch<'_> {
    fn interrupted(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Whether a vCPU stopped since the last call; wakes the VMM's loop if so.
    fn vcpu_down(&self) -> bool {
        if self.down.read().is_ok() {
            let _ = self.stopped.write(1);
            true
        } else {
            false
        }
    }
}

fn verify_command() -> Command {
    Command {
        op: Op::Verify,
        start: VERIFY_GPA,
        end: VERIFY_GPA + VERIFY_SIZE,
        stride: VERIFY_STRIDE,
        seed: VERIFY_SEED,
    }
}

/// Runs the changer on its own thread while this one keeps `verifier` (if any) verifying and
/// watches for a signal or a vCPU that stops; returns the verify commands completed.
fn with_changes(
    vcpus: &mut Vcpus,
    changer: &mut Changer<'_>,
    kinds: Kinds,
    iterations: u64,
    deadline: Instant,
    verifier: Option<usize>,
    watch: &Watch<'_>,
) -> Result<u64, StressError> {
    let finish = changer.finish;
    let mut verifies = 0;
    let mut verifier_error = None;
    let mut down = false;
    let changed = std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("changes".into())
            .spawn_scoped(scope, || changer.run(kinds, iterations, deadline))
            .expect("spawning the host's change thread");
        while !thread.is_finished() {
            if watch.interrupted() {
                finish.store(true, Ordering::Release);
            }
            if !down && watch.vcpu_down() {
                down = true;
                finish.store(true, Ordering::Release);
            }
            match verifier {
                Some(v) if verifier_error.is_none() && !finish.load(Ordering::Acquire) => {
                    match vcpus.run(v, verify_command()) {
                        Ok(_) => verifies += 1,
                        Err(e) => {
                            verifier_error = Some(e);
                            finish.store(true, Ordering::Release);
                        }
                    }
                }
                _ => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    if let Some(e) = verifier_error {
        return Err(e.into());
    }
    changed?;
    if down {
        return Err(StressError::VcpuStopped);
    }
    if let Some(v) = verifier {
        // Once more with every toggle done: the region still holds what the host wrote.
        vcpus.run(v, verify_command())?;
        verifies += 1;
    }
    Ok(verifies)
}

/// The run proper: write loops, changes beside them, the final check, and the verifier's phase
/// if it did not run beside the writers. Returns the passes, the verifies and the duration.
pub(super) fn stress(
    config: &StressConfig,
    vcpus: &mut Vcpus,
    changer: &mut Changer<'_>,
    watch: &Watch<'_>,
) -> Result<(Vec<u64>, u64, Duration), StressError> {
    let writers = changer.writers;
    let alongside = config.vcpus < vcpus.count();
    let started = Instant::now();
    for (vcpu, part) in writers.parts.iter().enumerate() {
        vcpus.start(
            vcpu,
            Command {
                op: Op::WriteLoop,
                start: part.range.start,
                end: part.range.end,
                stride: writers.stride,
                seed: part.seed,
            },
        );
    }
    let kinds = Kinds {
        neighbours: true,
        read_only: alongside,
        dirty: true,
    };
    // Without a verifier alongside, the writers get half the time and the verifier the rest.
    let first_deadline = if alongside {
        started + config.duration
    } else {
        started + config.duration / 2
    };
    let verifier = alongside.then_some(config.vcpus);
    let changed = with_changes(
        vcpus,
        changer,
        kinds,
        config.iterations,
        first_deadline,
        verifier,
        watch,
    );
    // Stop the loops whatever happened: a writer that stopped on an error says why here.
    for vcpu in 0..writers.parts.len() {
        vcpus.stop_loop(vcpu);
    }
    let mut passes = Vec::new();
    let mut writer_error = None;
    for vcpu in 0..writers.parts.len() {
        match vcpus.wait(vcpu) {
            Ok(outcome) => passes.push(outcome.passes),
            Err(e) => {
                writer_error.get_or_insert(e);
                passes.push(0);
            }
        }
    }
    if let Some(e) = writer_error {
        return Err(e.into());
    }
    let mut verifies = changed?;
    if watch.interrupted() {
        return Err(StressError::Interrupted);
    }
    let snapshot = changer.memory.current();
    if let Some(page) = config.corrupt_page {
        // Undo the last pass's write there, as if it had been lost.
        let gpa = writers.area.gpa + page * PAGE_SIZE;
        if let Some(vcpu) = writers.parts.iter().position(|p| p.range.contains(&gpa)) {
            let seed = writers.parts[vcpu].seed;
            let older = match passes[vcpu] {
                0 | 1 => 0,
                n => pattern(gpa, seed.wrapping_add(n - 2)),
            };
            snapshot
                .write_obj(older, GuestAddress(gpa))
                .map_err(|source| StressError::Access { gpa, source })?;
        }
    }
    for (vcpu, part) in writers.parts.iter().enumerate() {
        check_part(
            &*snapshot,
            vcpu,
            part.range.clone(),
            writers.stride,
            part.seed,
            passes[vcpu],
        )?;
    }
    if !alongside {
        // No vCPU was free for the verifier: vCPU 0 verifies while the host toggles.
        let kinds = Kinds {
            neighbours: false,
            read_only: true,
            dirty: false,
        };
        verifies += with_changes(
            vcpus,
            changer,
            kinds,
            config.iterations,
            Instant::now() + config.duration / 2,
            Some(0),
            watch,
        )?;
        if watch.interrupted() {
            return Err(StressError::Interrupted);
        }
    }
    Ok((passes, verifies, started.elapsed()))
}
