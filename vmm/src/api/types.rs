//! The API's request and reply bodies, as `docs/api.yaml` describes them. Requests refuse
//! unknown fields; replies serialise to exactly the documented JSON. The controller takes and
//! returns these types; only `api::routes` and `api::server` know they travel over HTTP.

use serde::{Deserialize, Serialize};

/// How a new region is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackingKind {
    /// Private anonymous memory.
    Anonymous,
    /// A new memfd, mapped shared.
    Memfd,
}

/// `PUT /memory/regions`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddRegion {
    /// Size in bytes (a multiple of 4 KiB).
    pub size: u64,
    /// Guest-physical base; by default the first free place from 1 GiB up.
    pub guest_address: Option<u64>,
    /// Backing; anonymous by default.
    #[serde(default = "default_backing")]
    pub backing: BackingKind,
    /// KVM slot size the region is split into (must divide `size`); one slot by default.
    pub slot_size: Option<u64>,
    /// Read-only for the guest.
    #[serde(default)]
    pub read_only: bool,
    /// Log the guest's writes from the start.
    #[serde(default)]
    pub dirty_log: bool,
    /// Have the test guest write and check both ends of every new slot (default true).
    #[serde(default = "yes")]
    pub guest_check: bool,
}

fn default_backing() -> BackingKind {
    BackingKind::Anonymous
}

fn yes() -> bool {
    true
}

/// `PATCH /memory/regions/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchRegion {
    /// Move the region here.
    pub guest_address: Option<u64>,
    /// Make it read-only, or writable again.
    pub read_only: Option<bool>,
}

/// `PATCH /dirty-log`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirtyLogSwitch {
    /// Start (true) or stop (false) logging.
    pub enabled: bool,
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Harvest {
    /// One region; all by default.
    pub region: Option<u64>,
}

/// `PUT /hotplug/memory`: the hotplug area, as Firecracker describes it (defined where the
/// snapshot state file saves it, below this module).
pub use crate::test_guest::snapshot::HotplugConfig;

/// `PATCH /hotplug/memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotplugRequest {
    /// How much of the area should be plugged, in MiB (a multiple of the block size).
    pub requested_size_mib: u64,
}

/// The test guest's operations, as the API names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestOp {
    /// Write the pattern.
    Write,
    /// Check the pattern.
    Verify,
    /// Start writing passes over the range (pass `k` with seed `seed + k`) and answer at once;
    /// the guest keeps writing until `stop_loop`.
    WriteLoop,
    /// End the vCPU's write loop after its current pass; answers the passes completed.
    StopLoop,
}

/// `PUT /guest/command`: run one command of the test guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestCommand {
    /// What to do.
    pub op: GuestOp,
    /// First guest address (a multiple of 8); not for `stop_loop`.
    #[serde(default)]
    pub start: u64,
    /// First address after the range; not for `stop_loop`.
    #[serde(default)]
    pub end: u64,
    /// Distance between touched addresses (a non-zero multiple of 8); not for `stop_loop`.
    #[serde(default)]
    pub stride: u64,
    /// Pattern seed: the value at address `a` is `a ^ seed`.
    #[serde(default)]
    pub seed: u64,
    /// The vCPU to run it on (0 by default).
    #[serde(default)]
    pub vcpu: usize,
}

/// The VM's run state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum RunState {
    /// The guest runs commands.
    Running,
    /// The guest runs no command until resumed.
    Paused,
}

/// `PATCH /vm` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatePatch {
    /// `Paused` or `Resumed`.
    pub state: VmStateRequest,
}

/// The states a client may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmStateRequest {
    /// Pause.
    Paused,
    /// Resume.
    Resumed,
}

/// `PUT /actions` (Firecracker's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmAction {
    /// Only `Stop`: shut the VMM down.
    pub action_type: VmActionType,
}

/// Actions on the whole VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum VmActionType {
    /// Stop the guest and the VMM.
    Stop,
}

/// `PUT /snapshot/create` (Firecracker's shape).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreate {
    /// `Full` or `Diff`.
    pub snapshot_type: SnapshotType,
    /// Where the state file goes (it must not exist).
    pub snapshot_path: std::path::PathBuf,
    /// Where the memory file goes (it must not exist).
    pub mem_file_path: std::path::PathBuf,
}

/// What a snapshot holds of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum SnapshotType {
    /// Every page that holds data.
    Full,
    /// The pages dirtied since the previous snapshot.
    Diff,
}

/// `GET /memory`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryInfo {
    /// KVM slot numbers in use and free.
    pub slots: SlotCounts,
    /// What new memory is admitted against (`--max-*` on the command line).
    pub limits: Limits,
    /// What the regions in place use of the limits.
    pub used: MemoryUse,
    /// The regions, by id.
    pub regions: Vec<RegionInfo>,
}

/// The admission limits, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Most guest memory in all regions.
    pub max_guest_memory: u64,
    /// Largest single region.
    pub max_region_size: u64,
    /// Most host memory for guest-memory metadata (KVM's and the VMM's), as estimated.
    pub max_metadata: u64,
}

/// What the regions use of the limits, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryUse {
    /// Guest memory in all regions.
    pub guest_memory: u64,
    /// The estimated host memory for its metadata.
    pub metadata: u64,
}

/// KVM slot numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SlotCounts {
    /// In use.
    pub used: usize,
    /// Free.
    pub free: usize,
    /// KVM's number of slots.
    pub max: usize,
}

/// One region in [`MemoryInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionInfo {
    /// Its id.
    pub id: u64,
    /// Guest-physical base.
    pub guest_address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Host address of its mapping.
    pub host_address: u64,
    /// KVM slots it takes.
    pub slots: usize,
    /// Read-only for the guest.
    pub read_only: bool,
    /// Its writes are logged.
    pub dirty_log: bool,
    /// `anonymous` or `memfd`.
    pub backing: &'static str,
}

/// `PUT /memory/regions` (201).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegionAdded {
    /// The new region's id.
    pub id: u64,
    /// Where it is.
    pub guest_address: u64,
    /// Its size.
    pub size: u64,
    /// KVM slots it takes.
    pub slots: u64,
    /// Whether the test guest checked every slot.
    pub guest_checked: bool,
}

/// `POST /dirty-log/harvest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HarvestInfo {
    /// Bytes per page.
    pub page_size: u64,
    /// Each region harvested.
    pub regions: Vec<DirtyRegion>,
}

/// One region in [`HarvestInfo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirtyRegion {
    /// The region.
    pub id: u64,
    /// Its guest base when harvested.
    pub guest_address: u64,
    /// Its pages.
    pub pages: u64,
    /// How many of them are dirty.
    pub dirty_pages: u64,
    /// The dirty pages as `[start, end)` guest-address ranges.
    pub ranges: Vec<[u64; 2]>,
}

/// `GET /dirty-log`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirtyLogInfo {
    /// `bitmap` (per-slot logs) or `ring` (per-vCPU dirty rings).
    pub mode: &'static str,
    /// Entries per vCPU ring, in ring mode.
    pub ring_entries: Option<u32>,
    /// Regions whose writes are logged.
    pub logging_regions: Vec<u64>,
    /// Harvests of every region so far.
    pub harvests: u64,
    /// The dirty rate between the last two harvests of every region, if there were two.
    pub dirty_rate: Option<DirtyRate>,
}

/// Pages dirtied per second over a window: the pages the later of two harvests of every region
/// reported, over the time between them (after QEMU's `calc-dirty-rate`, without consuming
/// dirty bits of its own).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DirtyRate {
    /// Pages reported by the later harvest.
    pub pages: u64,
    /// Milliseconds between the two harvests.
    pub window_ms: f64,
    /// Pages per second.
    pub pages_per_second: f64,
}

/// `GET /hotplug/memory`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HotplugInfo {
    /// Size of the whole area, in MiB.
    pub total_size_mib: u64,
    /// Plugging granularity, in MiB.
    pub block_size_mib: u64,
    /// KVM slot size, in MiB.
    pub slot_size_mib: u64,
    /// Plugged, in MiB.
    pub plugged_size_mib: u64,
    /// Requested, in MiB (the same as plugged: the test guest takes every request at once).
    pub requested_size_mib: u64,
    /// Where the area starts.
    pub guest_address: u64,
    /// KVM slots mapped in it.
    pub mapped_slots: usize,
}

/// `GET /vm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmInfo {
    /// Running or paused.
    pub state: RunState,
    /// vCPUs (0 once shutting down).
    pub vcpus: usize,
}

/// `PUT /guest/command`: what the guest found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum GuestCommandResult {
    /// The command ran; a verify found every address as expected.
    Ok,
    /// A verify found an address that does not hold its pattern.
    Mismatch {
        /// The address.
        address: u64,
        /// What it held.
        found: u64,
        /// What it should have held.
        expected: u64,
    },
    /// A write loop started.
    Started,
    /// A write loop ended.
    Stopped {
        /// Passes completed over the whole range.
        passes: u64,
        /// The seed of the last complete pass (`seed + passes - 1`): what the range holds.
        last_seed: Option<u64>,
    },
}

/// What a migration does when its timeout comes before it converged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Give up: the VM keeps running here.
    Cancel,
    /// Stop and copy what is left, however long the pause.
    Force,
}

/// `PUT /migrate`: move the running VM to a `tinyvmm receive` process.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// `unix:PATH` or `tcp:HOST:PORT`, where `tinyvmm receive` listens.
    pub destination: String,
    /// The longest pause the VM may see (its memory left over the measured throughput).
    #[serde(default = "default_downtime_ms")]
    pub downtime_ms: u64,
    /// Seconds before `on_timeout` applies.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: u64,
    /// What to do at the timeout.
    #[serde(default = "default_on_timeout")]
    pub on_timeout: OnTimeout,
    /// Hand memfd-backed memory over with `SCM_RIGHTS` instead of copying it (Unix only).
    #[serde(default)]
    pub local: bool,
}

fn default_downtime_ms() -> u64 {
    300
}

fn default_timeout_s() -> u64 {
    60
}

fn default_on_timeout() -> OnTimeout {
    OnTimeout::Cancel
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationPhase {
    /// Connecting and exchanging the memory layout.
    Setup,
    /// Copying memory while the guest runs.
    PreCopy,
    /// The guest is paused: the last pages and the state go over.
    StopAndCopy,
    /// The destination runs the VM; this VMM exits.
    Completed,
    /// It failed; the VM runs here as before.
    Failed,
    /// A client or the timeout cancelled it; the VM runs here as before.
    Cancelled,
    /// The destination got the whole VM but its answer did not come: it may run the VM, so
    /// the VM stays paused here (`PATCH /vm {"state": "Resumed"}` runs it here again).
    Unconfirmed,
}

/// `GET /migrate`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MigrationInfo {
    /// Where it is.
    pub phase: MigrationPhase,
    /// Where it goes.
    pub destination: String,
    /// The round of pages under way (1: every page that holds data).
    pub round: u32,
    /// Bytes of pages sent so far.
    pub bytes_sent: u64,
    /// Pages the last harvest found dirty: what the next round sends.
    pub pages_left: u64,
    /// Pages the guest dirtied per second over the last round.
    pub dirty_rate_pages_per_second: f64,
    /// Bytes per second the last round sent at.
    pub throughput_bytes_per_second: f64,
    /// The pause `pages_left` would take at that throughput.
    pub estimated_downtime_ms: f64,
    /// The pause began although the estimate did not fit the budget (`on_timeout: force`, at
    /// the timeout or once the harvest alone outlasted the budget): expect a longer pause.
    pub forced: bool,
    /// The pause the VM saw (from pausing here to the destination's word that it runs there),
    /// once completed.
    pub downtime_ms: Option<f64>,
    /// Milliseconds since the migration started.
    pub elapsed_ms: f64,
    /// Why it failed or was cancelled.
    pub error: Option<String>,
}
