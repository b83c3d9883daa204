//! The controller's errors: a kind that says whose fault it is, and a message that names the
//! problem. The API layer turns the kind into a status; nothing here knows HTTP.

use std::fmt;

/// What kind of failure an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed or impossible as asked (a bad size, an unreachable address).
    BadRequest,
    /// It names something that does not exist (a region, the hotplug area).
    NotFound,
    /// It collides with the VM's current state (an overlap, no free slot, the VM is paused).
    Conflict,
    /// The VMM cannot serve it now (it is shutting down).
    Unavailable,
    /// KVM or the host failed, or the guest did; not the caller's mistake.
    Internal,
}

/// Why the controller refused or failed a request. A refused or failed request changed nothing,
/// unless the message says that undoing part of it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerError {
    /// Whose fault, and what kind.
    pub kind: ErrorKind,
    /// What went wrong, naming the values at fault.
    pub message: String,
}

impl ControllerError {
    /// An error of `kind` saying `message`.
    pub(crate) fn new(kind: ErrorKind, message: impl fmt::Display) -> Self {
        ControllerError {
            kind,
            message: message.to_string(),
        }
    }

    /// The request is malformed or impossible.
    pub(crate) fn bad(message: impl fmt::Display) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }

    /// The request collides with the current state.
    pub(crate) fn conflict(message: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }

    /// The request names something that is not there.
    pub(crate) fn not_found(message: impl fmt::Display) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// KVM, the host or the guest failed.
    pub(crate) fn internal(message: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// The same kind, with `more` after the message (what undoing the request did).
    pub(crate) fn and(self, more: impl fmt::Display) -> Self {
        ControllerError {
            kind: self.kind,
            message: format!("{}; {more}", self.message),
        }
    }
}

impl fmt::Display for ControllerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ControllerError {}

impl From<kvm_memslots::Error> for ControllerError {
    /// The manager says whether an error is the caller's mistake; this is the one place where
    /// that becomes the controller's kind.
    fn from(e: kvm_memslots::Error) -> Self {
        use kvm_memslots::ErrorKind as Memory;
        let kind = match e.kind() {
            Memory::Invalid => ErrorKind::BadRequest,
            Memory::NotFound => ErrorKind::NotFound,
            Memory::Conflict => ErrorKind::Conflict,
            Memory::Broken | Memory::Host => ErrorKind::Internal,
        };
        ControllerError::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_memslots::{Error, RegionId};

    #[test]
    fn memory_errors_keep_their_message_and_say_whose_fault_they_are() {
        let unknown = ControllerError::from(Error::UnknownRegion(RegionId(7)));
        assert_eq!(unknown.kind, ErrorKind::NotFound);
        assert_eq!(unknown.message, "region 7 does not exist");
        assert_eq!(
            ControllerError::from(Error::ZeroSize).kind,
            ErrorKind::BadRequest
        );
        let full = Error::OutOfSlots {
            needed: 3,
            free: 1,
            limit: 8,
        };
        assert_eq!(ControllerError::from(full).kind, ErrorKind::Conflict);
        let broken = Error::Broken {
            slot: 2,
            errno: vmm_sys_util::errno::Error::new(libc::EINVAL),
        };
        assert_eq!(ControllerError::from(broken).kind, ErrorKind::Internal);
        let undone = ControllerError::bad("no").and("the move was undone");
        assert_eq!(undone.to_string(), "no; the move was undone");
        assert_eq!(undone.kind, ErrorKind::BadRequest);
    }
}
