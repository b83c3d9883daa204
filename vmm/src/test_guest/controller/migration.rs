//! The test guest's side of a migration: its State record for the generic migration
//! (`migration::slot`).

use super::TestGuest;
use crate::migration::sink::StateRecord;
use crate::test_guest::hotplug::HotplugArea;
use crate::test_guest::snapshot::MigrationRecord;

impl TestGuest {
    /// The State record a migration sends last.
    pub(super) fn record(&self, paused: bool) -> Box<dyn StateRecord> {
        Box::new(MigrationRecord {
            hotplug: self.hotplug.as_ref().map(HotplugArea::state),
            paused,
        })
    }
}
