//! A Linux guest's controller: what its API socket (`tinyvmm boot --api-sock`) answers. Its
//! memory, its virtio-mem device's requested size, and a stop; the table in
//! `control::support` refuses every other request before it gets here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_memslots::{KvmVm, MemoryManager};

use super::hotplug::{hotplug_info, lock, VirtioMemDevice};
use crate::control::memory::memory_info;
use crate::control::support::LinuxRequest;
use crate::control::{Apply, ControllerError, Outcome, Reply, Request};

const MIB: u64 = 1 << 20;

/// What a Linux guest's API socket offers: its memory, its hotplug device, and a stop.
#[derive(Debug)]
pub struct LinuxController {
    memory: Arc<MemoryManager<KvmVm>>,
    hotplug: Option<VirtioMemDevice>,
    stop: Arc<AtomicBool>,
}

impl LinuxController {
    /// A controller over `memory` and `hotplug`; a client's stop sets `stop`.
    pub fn new(
        memory: Arc<MemoryManager<KvmVm>>,
        hotplug: Option<VirtioMemDevice>,
        stop: Arc<AtomicBool>,
    ) -> Self {
        LinuxController {
            memory,
            hotplug,
            stop,
        }
    }

    fn device(&self) -> Result<&VirtioMemDevice, ControllerError> {
        self.hotplug.as_ref().ok_or_else(|| {
            ControllerError::not_found(
                "no hotplug device: boot with --hotplug-mib to give the guest a virtio-mem device",
            )
        })
    }
}

impl Apply for LinuxController {
    fn apply(&mut self, request: Request) -> Outcome {
        match LinuxRequest::try_from(request)? {
            LinuxRequest::GetMemory => Ok(Reply::Memory(memory_info(&self.memory))),
            LinuxRequest::GetHotplug => Ok(Reply::Hotplug(hotplug_info(self.device()?))),
            LinuxRequest::RequestHotplug(request) => {
                let device = self.device()?;
                let bytes = request.requested_size_mib.checked_mul(MIB).ok_or_else(|| {
                    ControllerError::bad(format!(
                        "requested_size_mib {} is too large",
                        request.requested_size_mib
                    ))
                })?;
                // The guest plugs or unplugs on its own time; GET shows how far it got.
                lock(device)
                    .set_requested_size(bytes)
                    .map_err(ControllerError::bad)?;
                Ok(Reply::Done)
            }
            LinuxRequest::ConfigureHotplug(_) => Err(ControllerError::conflict(
                "a Linux guest's hotplug device is configured at boot (--hotplug-mib, --hotplug-block-mib)",
            )),
            LinuxRequest::Act(_) => {
                self.stop.store(true, Ordering::Release);
                Ok(Reply::Done)
            }
        }
    }
}
