//! Which requests each guest kind answers: the one table, and the one place where a request
//! is refused for its guest kind (404, naming what that kind's API has), so that no controller
//! needs a catch-all arm. The test guest's controller answers every [`Request`]; a Linux
//! guest's answers the requests of [`LinuxRequest`], to which [`LinuxRequest::try_from`]
//! narrows a [`Request`] or refuses it. A new request must be given a row here.

use super::dirty_log::{DirtyLogSwitch, Harvest};
use super::hotplug::{HotplugConfig, HotplugRequest};
use super::migration::MigrateRequest;
use super::snapshot::SnapshotCreate;
use super::vm::{VmAction, VmStatePatch};
use super::{ControllerError, Request};

/// The requests a Linux guest's controller answers: all but those that change the test
/// guest's own memory map or run its commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinuxRequest {
    /// [`Request::GetMemory`].
    GetMemory,
    /// [`Request::GetRegion`].
    GetRegion(u64),
    /// [`Request::GetHotplug`].
    GetHotplug,
    /// [`Request::ConfigureHotplug`] (refused: the device is configured at boot).
    ConfigureHotplug(HotplugConfig),
    /// [`Request::RequestHotplug`].
    RequestHotplug(HotplugRequest),
    /// [`Request::Act`].
    Act(VmAction),
    /// [`Request::GetVm`].
    GetVm,
    /// [`Request::PatchVm`].
    PatchVm(VmStatePatch),
    /// [`Request::CreateSnapshot`].
    CreateSnapshot(SnapshotCreate),
    /// [`Request::GetSnapshot`].
    GetSnapshot,
    /// [`Request::CancelSnapshot`].
    CancelSnapshot,
    /// [`Request::StopRecording`].
    StopRecording,
    /// [`Request::SwitchDirtyLog`].
    SwitchDirtyLog(DirtyLogSwitch),
    /// [`Request::Harvest`].
    Harvest(Harvest),
    /// [`Request::GetDirtyLog`].
    GetDirtyLog,
    /// [`Request::Migrate`].
    Migrate(MigrateRequest),
    /// [`Request::GetMigration`].
    GetMigration,
    /// [`Request::CancelMigration`].
    CancelMigration,
}

impl TryFrom<Request> for LinuxRequest {
    type Error = ControllerError;

    /// `request` if a Linux guest answers it; otherwise the refusal.
    fn try_from(request: Request) -> Result<Self, ControllerError> {
        Ok(match request {
            Request::GetMemory => LinuxRequest::GetMemory,
            Request::GetRegion(id) => LinuxRequest::GetRegion(id),
            Request::GetHotplug => LinuxRequest::GetHotplug,
            Request::ConfigureHotplug(config) => LinuxRequest::ConfigureHotplug(config),
            Request::RequestHotplug(request) => LinuxRequest::RequestHotplug(request),
            Request::Act(action) => LinuxRequest::Act(action),
            Request::GetVm => LinuxRequest::GetVm,
            Request::PatchVm(patch) => LinuxRequest::PatchVm(patch),
            Request::CreateSnapshot(create) => LinuxRequest::CreateSnapshot(create),
            Request::GetSnapshot => LinuxRequest::GetSnapshot,
            Request::CancelSnapshot => LinuxRequest::CancelSnapshot,
            Request::StopRecording => LinuxRequest::StopRecording,
            Request::SwitchDirtyLog(switch) => LinuxRequest::SwitchDirtyLog(switch),
            Request::Harvest(harvest) => LinuxRequest::Harvest(harvest),
            Request::GetDirtyLog => LinuxRequest::GetDirtyLog,
            Request::Migrate(migrate) => LinuxRequest::Migrate(migrate),
            Request::GetMigration => LinuxRequest::GetMigration,
            Request::CancelMigration => LinuxRequest::CancelMigration,
            test_guest_only @ (Request::AddRegion(_)
            | Request::RemoveRegion(_)
            | Request::PatchRegion(..)
            | Request::Guest(_)) => {
                return Err(ControllerError::not_found(format!(
                    "{} is for the test guest (tinyvmm serve); a Linux guest's memory changes \
                     through /hotplug/memory, and it runs no guest commands",
                    test_guest_only.name()
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ErrorKind;

    #[test]
    fn a_linux_guest_refuses_what_only_the_test_guest_answers_with_the_route_named() {
        let refused =
            LinuxRequest::try_from(Request::RemoveRegion(1)).expect_err("test guest only");
        assert_eq!(refused.kind, ErrorKind::NotFound);
        assert!(
            refused.message.ends_with(
                "is for the test guest (tinyvmm serve); a Linux guest's memory changes \
                            through /hotplug/memory, and it runs no guest commands"
            ),
            "{}",
            refused.message
        );
        assert_eq!(
            LinuxRequest::try_from(Request::GetMemory),
            Ok(LinuxRequest::GetMemory)
        );
    }
}
