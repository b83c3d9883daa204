//! A Linux guest's vCPUs: created and set up ([`LinuxVcpus`]), running on their threads
//! ([`RunningVcpus`]), and each as the controller and a migration pause, save and resume it
//! ([`LinuxVcpu`]).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use super::ports::{GuestStop, LinuxPorts};
use super::{BootEnding, BootError};
use crate::precopy::PreCopyVcpu;
use crate::vm::state::VcpuState;
use crate::vm::vcpu::{kick_until_finished, PauseError, Vcpu, VcpuShared};

/// How long a vCPU may take to pause (it leaves the guest at its next exit, which a kick
/// forces).
pub(super) const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A Linux guest's vCPUs, created and set up, not yet running.
#[derive(Debug)]
pub(crate) struct LinuxVcpus {
    vcpus: Vec<Vcpu<LinuxPorts>>,
    msrs: Arc<[u32]>,
}

/// A Linux vCPU as the host pauses, saves and resumes it.
#[derive(Debug, Clone)]
pub struct LinuxVcpu {
    /// What the host shares with its thread.
    pub(crate) shared: Arc<VcpuShared>,
    /// The MSRs it saves.
    pub(crate) msrs: Arc<[u32]>,
    /// A client paused the VM: a migration that ends without moving it leaves it paused
    /// (its [`resume`](PreCopyVcpu::resume) does nothing).
    pub(crate) keep_paused: bool,
}

impl PreCopyVcpu for LinuxVcpu {
    /// Pauses it at its next exit (a halted vCPU is kicked out of `KVM_RUN`).
    fn pause(&self) -> Result<(), PauseError> {
        self.shared.pause(PAUSE_TIMEOUT)
    }

    /// Its state, read by its own thread.
    fn save(&self) -> Result<VcpuState, PauseError> {
        self.shared.save_paused_with(&self.msrs)
    }

    /// Lifts the pause, unless a client had paused the VM (or a migration holds it).
    fn resume(&self) {
        if !self.keep_paused {
            self.shared.resume();
        }
    }

    fn hold(&self) {
        self.shared.hold();
    }

    /// Lifts the hold and the pause: only a client's resume releases a VM, and it resumes
    /// every vCPU.
    fn release(&self) {
        self.shared.release();
    }
}

impl LinuxVcpus {
    /// `vcpus`, which save the MSRs `msrs`.
    pub(super) fn new(vcpus: Vec<Vcpu<LinuxPorts>>, msrs: Arc<[u32]>) -> Self {
        LinuxVcpus { vcpus, msrs }
    }

    /// Starts a thread for each vCPU on the shared exit loop; each tells `stopped` when it
    /// stops. If one cannot start, those started are stopped again. vCPUs made paused
    /// (restored ones) park before they first enter the guest.
    pub(crate) fn start(self, stopped: &Arc<EventFd>) -> Result<RunningVcpus, BootError> {
        let mut running = RunningVcpus {
            threads: Vec::new(),
            msrs: self.msrs,
        };
        for vcpu in self.vcpus {
            let index = vcpu.index;
            let shared = Arc::clone(&vcpu.shared);
            match vcpu.spawn(Arc::clone(stopped), |outcome| outcome) {
                Ok(thread) => running.threads.push((thread, shared)),
                Err(source) => {
                    running.stop();
                    return Err(BootError::Thread {
                        vcpu: index,
                        source,
                    });
                }
            }
        }
        Ok(running)
    }
}

/// A Linux vCPU's thread and what it shares with the host.
type VcpuThread = (JoinHandle<Result<(), GuestStop>>, Arc<VcpuShared>);

/// A Linux guest's running vCPU threads.
#[derive(Debug)]
pub(crate) struct RunningVcpus {
    threads: Vec<VcpuThread>,
    msrs: Arc<[u32]>,
}

impl RunningVcpus {
    /// Each vCPU, to pause, save and resume.
    pub(crate) fn handles(&self) -> Vec<LinuxVcpu> {
        self.threads
            .iter()
            .map(|(_, shared)| LinuxVcpu {
                shared: Arc::clone(shared),
                msrs: Arc::clone(&self.msrs),
                keep_paused: false,
            })
            .collect()
    }

    /// How the run ended, if a vCPU's end decides it: a vCPU that stopped on its own
    /// ([`BootEnding::GuestStopped`]), or every vCPU gone ([`BootEnding::Timeout`]). Joins at
    /// most one finished thread a call; a vCPU that stopped without an error was asked to.
    pub(crate) fn ended(&mut self) -> Option<BootEnding> {
        let at = self.threads.iter().position(|(t, _)| t.is_finished())?;
        let (thread, _) = self.threads.swap_remove(at);
        match thread.join() {
            Ok(Err(stop)) => return Some(BootEnding::GuestStopped(stop)),
            // A vCPU that stopped without an error was asked to: keep going.
            Ok(Ok(())) => {}
            Err(panic) => std::panic::resume_unwind(panic),
        }
        self.threads.is_empty().then_some(BootEnding::Timeout)
    }

    /// Stops every vCPU thread (a flag, then kicks out of `KVM_RUN`; a paused one leaves its
    /// park) and joins them.
    pub(crate) fn stop(self) {
        for (_, shared) in &self.threads {
            shared.request_stop();
        }
        for (thread, _) in self.threads {
            // Its outcome no longer matters: the run's ending is decided. A vCPU that does not
            // leave the guest within 10 s is left behind rather than waited for forever.
            if kick_until_finished(&thread, Duration::from_secs(10)) {
                let _ = thread.join();
            }
        }
    }
}
