//! Checking the writers' parts for lost writes: while the writers run (the host's scans) and
//! after they stopped (the final check).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvm_memslots::{KvmVm, MemoryManager};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::config::{StressError, STALL_TIMEOUT};
use tinyvmm::test_guest::area::TestArea;
use tinyvmm::test_guest::{pattern, CommandBlock};

/// One writer's part of the test area.
#[derive(Debug, Clone)]
pub(super) struct Part {
    pub(super) range: Range<u64>,
    pub(super) seed: u64,
}

/// What the writers do, as the host checks it.
#[derive(Debug, Clone)]
pub(super) struct Writers {
    pub(super) area: TestArea,
    pub(super) parts: Vec<Part>,
    pub(super) stride: u64,
}

impl Writers {
    pub(super) fn addresses(&self, vcpu: usize) -> impl Iterator<Item = u64> {
        self.parts[vcpu].range.clone().step_by(self.stride as usize)
    }

    pub(super) fn passes(&self, memory: &MemoryManager<KvmVm>, vcpu: usize) -> u64 {
        CommandBlock::new(vcpu).passes(&*memory.current())
    }
}

/// The pass index `k` whose pattern `found` is at `gpa` for writer seed `seed`.
fn pass_of(gpa: u64, found: u64, seed: u64) -> u64 {
    (found ^ gpa).wrapping_sub(seed)
}

pub(super) fn read(memory: &impl GuestMemory, gpa: u64) -> Result<u64, StressError> {
    memory
        .read_obj(GuestAddress(gpa))
        .map_err(|source| StressError::Access { gpa, source })
}

/// Checks that every `stride`-th address of `part` holds what pass `passes - 1` of a write loop
/// with `seed` wrote there: the final check of writer `vcpu` once its loop has stopped after
/// `passes` passes (with none, there is nothing to check).
pub fn check_part(
    memory: &impl GuestMemory,
    vcpu: usize,
    part: Range<u64>,
    stride: u64,
    seed: u64,
    passes: u64,
) -> Result<(), StressError> {
    if stride == 0 || !stride.is_multiple_of(8) {
        return Err(StressError::Stride {
            stride,
            part_size: part.end.saturating_sub(part.start),
        });
    }
    if passes == 0 {
        return Ok(());
    }
    let last = passes - 1;
    for gpa in part.step_by(stride as usize) {
        let found = read(memory, gpa)?;
        let expected = pattern(gpa, seed.wrapping_add(last));
        if found != expected {
            let k = pass_of(gpa, found, seed);
            return Err(if k > last {
                StressError::WrongData {
                    vcpu,
                    gpa,
                    found,
                    passes,
                }
            } else {
                StressError::LostWrite {
                    vcpu,
                    gpa,
                    found,
                    pass: last,
                    expected,
                }
            });
        }
    }
    Ok(())
}

impl Writers {
    /// Reads writer `vcpu`'s part, checking that no address holds a pass older than the one
    /// before the last pass completed before the read (a lost write) or newer than the one in
    /// progress after it. Returns the values and the passes completed after the read.
    fn scan(
        &self,
        memory: &MemoryManager<KvmVm>,
        vcpu: usize,
    ) -> Result<(Vec<u64>, u64), StressError> {
        let seed = self.parts[vcpu].seed;
        let before = self.passes(memory, vcpu);
        let snapshot = memory.current();
        let values = self
            .addresses(vcpu)
            .map(|gpa| read(&*snapshot, gpa))
            .collect::<Result<Vec<u64>, _>>()?;
        let after = self.passes(memory, vcpu);
        let oldest = before.saturating_sub(1);
        for (gpa, &found) in self.addresses(vcpu).zip(&values) {
            // A value no pass wrote decodes to a huge "pass" (wrapping below 0, or garbage).
            let k = pass_of(gpa, found, seed);
            if k > after {
                return Err(StressError::WrongData {
                    vcpu,
                    gpa,
                    found,
                    passes: after + 1,
                });
            }
            if k < oldest {
                return Err(StressError::LostWrite {
                    vcpu,
                    gpa,
                    found,
                    pass: oldest,
                    expected: pattern(gpa, seed.wrapping_add(oldest)),
                });
            }
        }
        Ok((values, after))
    }

    /// [`scan`](Self::scan)s every writer's part, counting each scan in `scans`: the values,
    /// writer by writer, and each one's passes completed after its read.
    pub(super) fn scan_all(
        &self,
        memory: &MemoryManager<KvmVm>,
        scans: &mut u64,
    ) -> Result<(Vec<Vec<u64>>, Vec<u64>), StressError> {
        let mut values = Vec::new();
        let mut passes = Vec::new();
        for vcpu in 0..self.parts.len() {
            let (v, p) = self.scan(memory, vcpu)?;
            *scans += 1;
            values.push(v);
            passes.push(p);
        }
        Ok((values, passes))
    }

    /// Waits until every writer completed more passes than `passes` says, or `finish` is set.
    pub(super) fn wait_for_passes(
        &self,
        memory: &MemoryManager<KvmVm>,
        passes: &[u64],
        finish: &AtomicBool,
    ) -> Result<(), StressError> {
        for (vcpu, &since) in passes.iter().enumerate() {
            let start = Instant::now();
            loop {
                let now = self.passes(memory, vcpu);
                if now > since || finish.load(Ordering::Acquire) {
                    break;
                }
                if start.elapsed() > STALL_TIMEOUT {
                    return Err(StressError::Stalled {
                        vcpu,
                        passes: now,
                        waited: STALL_TIMEOUT,
                    });
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stress::config::WRITE_SEED;
    use kvm_memslots::testing::FakeKvm;
    use kvm_memslots::{RegionSpec, PAGE_SIZE};

    const BASE: u64 = 0x10_0000;
    const SEED: u64 = WRITE_SEED + (3 << 32);

    fn memory_after_passes(passes: u64) -> MemoryManager<FakeKvm> {
        let m = MemoryManager::new(FakeKvm::new(8, false));
        m.add_region(RegionSpec::new(GuestAddress(BASE), 4 * PAGE_SIZE))
            .unwrap();
        let snapshot = m.current();
        for k in 0..passes {
            for gpa in (BASE..BASE + 4 * PAGE_SIZE).step_by(PAGE_SIZE as usize) {
                snapshot
                    .write_obj(pattern(gpa, SEED + k), GuestAddress(gpa))
                    .unwrap();
            }
        }
        m
    }

    fn check(m: &MemoryManager<FakeKvm>, passes: u64) -> Result<(), StressError> {
        let part = BASE..BASE + 4 * PAGE_SIZE;
        check_part(&*m.current(), 3, part, PAGE_SIZE, SEED, passes)
    }

    #[test]
    fn the_final_check_accepts_the_last_pass_everywhere() {
        let m = memory_after_passes(5);
        check(&m, 5).unwrap();
        assert_eq!(pass_of(BASE + 8, pattern(BASE + 8, SEED + 4), SEED), 4);
    }

    #[test]
    fn the_final_check_names_a_lost_write_and_wrong_data() {
        let m = memory_after_passes(5);
        let lost = BASE + 2 * PAGE_SIZE;
        m.current()
            .write_obj(pattern(lost, SEED + 3), GuestAddress(lost))
            .unwrap();
        let err = check(&m, 5).unwrap_err();
        assert!(
            matches!(err, StressError::LostWrite { vcpu: 3, gpa, pass: 4, .. } if gpa == lost),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("lost write at 0x102000 (vCPU 3)"),
            "{err}"
        );
        m.current()
            .write_obj(0xdead_beef_u64, GuestAddress(lost))
            .unwrap();
        let err = check(&m, 5).unwrap_err();
        assert!(
            matches!(err, StressError::WrongData { gpa, passes: 5, .. } if gpa == lost),
            "{err:?}"
        );
        // A pass the writer never got to is wrong too, not "lost".
        let m = memory_after_passes(5);
        let err = check(&m, 4).unwrap_err();
        assert!(
            matches!(err, StressError::WrongData { gpa: BASE, .. }),
            "{err:?}"
        );
    }
}
