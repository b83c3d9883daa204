//! Which requests each guest kind answers: the one table, and the one place where a request
//! is refused for its guest kind (404, naming what that kind's API has), so that no controller
//! needs a catch-all arm. The test guest's controller answers every [`Request`]; a Linux
//! guest's answers the requests of [`LinuxRequest`], to which [`LinuxRequest::try_from`]
//! narrows a [`Request`] or refuses it. A new request must be given a row here.

use super::hotplug::{HotplugConfig, HotplugRequest};
use super::vm::VmAction;
use super::{ControllerError, Request};

/// The requests a Linux guest's controller answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinuxRequest {
    /// [`Request::GetMemory`].
    GetMemory,
    /// [`Request::GetHotplug`].
    GetHotplug,
    /// [`Request::ConfigureHotplug`] (refused: the device is configured at boot).
    ConfigureHotplug(HotplugConfig),
    /// [`Request::RequestHotplug`].
    RequestHotplug(HotplugRequest),
    /// [`Request::Act`].
    Act(VmAction),
}

impl TryFrom<Request> for LinuxRequest {
    type Error = ControllerError;

    /// `request` if a Linux guest answers it; otherwise the refusal.
    fn try_from(request: Request) -> Result<Self, ControllerError> {
        Ok(match request {
            Request::GetMemory => LinuxRequest::GetMemory,
            Request::GetHotplug => LinuxRequest::GetHotplug,
            Request::ConfigureHotplug(config) => LinuxRequest::ConfigureHotplug(config),
            Request::RequestHotplug(request) => LinuxRequest::RequestHotplug(request),
            Request::Act(action) => LinuxRequest::Act(action),
            test_guest_only @ (Request::AddRegion(_)
            | Request::RemoveRegion(_)
            | Request::PatchRegion(..)
            | Request::SwitchDirtyLog(_)
            | Request::Harvest(_)
            | Request::GetDirtyLog
            | Request::Guest(_)
            | Request::GetVm
            | Request::PatchVm(_)
            | Request::CreateSnapshot(_)
            | Request::Migrate(_)
            | Request::GetMigration
            | Request::CancelMigration) => {
                return Err(ControllerError::not_found(format!(
                    "{} is for the test guest (tinyvmm serve); a Linux guest's API has /memory, /hotplug/memory and /actions",
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
        let refused = LinuxRequest::try_from(Request::GetDirtyLog).expect_err("test guest only");
        assert_eq!(refused.kind, ErrorKind::NotFound);
        assert_eq!(
            refused.message,
            "GET /dirty-log is for the test guest (tinyvmm serve); a Linux guest's API has \
             /memory, /hotplug/memory and /actions"
        );
        assert_eq!(
            LinuxRequest::try_from(Request::GetMemory),
            Ok(LinuxRequest::GetMemory)
        );
    }
}
