//! `tinyvmm client`: one request to a running VMM's API socket per call, for every endpoint of
//! `docs/api.yaml` (what `ch-remote` is to Cloud Hypervisor). The answer is printed as a human
//! table, or with `--json` as its JSON body alone; the exit status is the HTTP class's
//! (`exit_status`).
//!
//! **How long it waits** (`ClientRequest::default_timeout`, `--timeout`): a request waits
//! for its answer `TIMEOUT` (60 s) at most, then fails with exit status `TIMED_OUT`
//! naming the socket and the wait. Every request is answered at once or within seconds, but
//! two: a paused snapshot answers once all guest memory is in the memory file, and a guest
//! `write` or `verify` once the guest has gone over its range, both as long as guest memory
//! is large: they wait `LONG_TIMEOUT` (600 s). A live snapshot and a migration answer as
//! they start (the status requests that follow them answer at once too), so the default fits
//! them whatever their size. `--timeout 0` waits for ever.
//!
//! **Runs that go on after their answer**: a migration and a live snapshot are then followed
//! to their end (`follow()`): their status is asked until its phase is final, with a progress
//! line on a terminal, and the exit status says how they ended; `--no-wait` returns at once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::api::client::{Client, ClientError};
pub use crate::control::guest::GuestOp;
pub use crate::control::memory::RegionBacking as Backing;
pub use crate::control::memory::RegionPageSize as PageSize;
pub use crate::control::migration::OnTimeout;
pub use crate::control::snapshot::SnapshotType as SnapshotKind;
use follow::Followed;
use render::render;

mod follow;
mod render;
mod run;

/// The environment variable the API socket comes from when `--api-sock` is not given.
pub const API_SOCK_ENV: &str = "TINYVMM_API_SOCK";

/// `tinyvmm client`'s options: the socket, the output, and the request.
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The VMM's API socket (`--api-sock` of serve, restore, receive or boot), before or after
    /// the request's name (`--api-socket` too).
    #[arg(long, alias = "api-socket", global = true, env = API_SOCK_ENV)]
    api_sock: Option<PathBuf>,
    /// Seconds to wait for the answer before giving up (exit status 124; the VMM may still
    /// carry the request out); 0 waits for ever. A paused snapshot and a guest write or
    /// verify answer once done, as long as guest memory is large; a live snapshot and a
    /// migration answer as they start, and each status request that follows them waits as
    /// long [default: 60; 600 for a paused snapshot and a guest write or verify]
    #[arg(long, global = true, value_name = "SECS")]
    timeout: Option<u64>,
    /// Print the answer's JSON body alone on stdout (`{}` when it has none) instead of a
    /// table; a refusal's `{"fault_message": ...}` too.
    #[arg(long, global = true)]
    json: bool,
    /// The log level: accepted here as on every subcommand, but the client says only its
    /// failures whatever the level, so its help does not list it.
    #[arg(long, global = true, value_enum, hide = true)]
    log_level: Option<crate::lifecycle::LogLevel>,
    /// The request.
    #[command(subcommand)]
    request: ClientRequest,
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Start.
    On,
    /// Stop.
    Off,
}

/// The guest commands over a range, which need `--start` and `--end`.
const RANGE_OPS: [(&str, &str); 3] = [("op", "write"), ("op", "verify"), ("op", "write-loop")];

/// One request, named after what it does; `docs/api.yaml` has the endpoint of each.
#[derive(Debug, Clone, PartialEq, clap::Subcommand)]
pub enum ClientRequest {
    /// GET /: the VMM's name, version and commit (a ping).
    Info,
    /// GET /metrics: counters and gauges in Prometheus' text format.
    Metrics,
    /// GET /memory: KVM slots, limits and every region.
    Memory,
    /// GET /memory/regions/{id}: one region.
    Region {
        /// The region's id (GET /memory).
        id: u64,
    },
    /// PUT /memory/regions: add (hotplug) a region, checked by the test guest.
    AddRegion {
        /// Bytes (a multiple of 4096; K, M, G and T suffixes are KiB, MiB, GiB and TiB).
        #[arg(long, value_parser = bytes)]
        size: u64,
        /// Its guest address (0x hex, or with a suffix) [default: the first free place from
        /// 1 GiB up]
        #[arg(long, value_parser = bytes)]
        guest_address: Option<u64>,
        /// Its memory.
        #[arg(long, value_enum, default_value = "anonymous")]
        backing: Backing,
        /// Its host pages: 4k, 2m (hugetlb: guest address and size multiples of 2 MiB) or thp.
        #[arg(long, value_enum, default_value = "4k")]
        page_size: PageSize,
        /// Split it into KVM slots of this many bytes (must divide --size) [default: one slot]
        #[arg(long, value_parser = bytes)]
        slot_size: Option<u64>,
        /// Map it read-only.
        #[arg(long)]
        read_only: bool,
        /// Log the guest's writes to it from the start.
        #[arg(long)]
        dirty_log: bool,
        /// Skip the test guest's check of the new slots.
        #[arg(long)]
        no_guest_check: bool,
    },
    /// DELETE /memory/regions/{id}: remove a region.
    RemoveRegion {
        /// The region's id (GET /memory).
        id: u64,
    },
    /// PATCH /memory/regions/{id}: move a region, make it read-only or writable.
    PatchRegion {
        /// The region's id (GET /memory).
        id: u64,
        /// Move it to this guest address [default: where it is]
        #[arg(long, value_parser = bytes)]
        guest_address: Option<u64>,
        /// Read-only (true) or writable (false) [default: as it is]
        #[arg(long)]
        read_only: Option<bool>,
    },
    /// GET /dirty-log: the mode, the logging regions and the dirty rate.
    DirtyLog,
    /// PATCH /dirty-log: start or stop logging the guest's writes.
    SetDirtyLog {
        /// on or off.
        #[arg(value_enum)]
        state: Switch,
        /// One region [default: all]
        #[arg(long)]
        region: Option<u64>,
    },
    /// POST /dirty-log/harvest: fetch and clear the dirty pages.
    Harvest {
        /// One region [default: all]
        #[arg(long)]
        region: Option<u64>,
    },
    /// GET /hotplug/memory: the hotplug area (or a Linux guest's virtio-mem device).
    Hotplug,
    /// PUT /hotplug/memory: set the test guest's hotplug area up.
    ConfigureHotplug {
        /// MiB of the whole area (a multiple of --block-mib, at most 1 TiB; not necessarily of
        /// --slot-mib: the last piece is then shorter).
        #[arg(long)]
        total_mib: u64,
        /// MiB of a block (a power of two, at least 2).
        #[arg(long)]
        block_mib: u64,
        /// MiB of the largest KVM slot, a piece of the area (a multiple of --block-mib)
        /// [default: --block-mib]
        #[arg(long)]
        slot_mib: Option<u64>,
        /// The host pages behind plugged blocks: 4k, 2m (hugetlb: a plug needs the pool to
        /// hold its piece) or thp.
        #[arg(long, value_enum, default_value = "4k")]
        page_size: PageSize,
    },
    /// PATCH /hotplug/memory: plug or unplug to this many MiB.
    ResizeHotplug {
        /// MiB the guest should have plugged.
        mib: u64,
    },
    /// PUT /guest/command: run a test-guest command.
    Guest {
        /// The command.
        #[arg(value_enum)]
        op: GuestOp,
        /// The range's start (a multiple of 8, from 2 MiB up; 0x hex or a suffix); for write,
        /// verify and write-loop
        #[arg(long, value_parser = bytes, required_if_eq_any = RANGE_OPS)]
        start: Option<u64>,
        /// The range's end; for write, verify and write-loop
        #[arg(long, value_parser = bytes, required_if_eq_any = RANGE_OPS)]
        end: Option<u64>,
        /// Bytes between the addresses (a non-zero multiple of 8)
        #[arg(long, value_parser = bytes, default_value = "8")]
        stride: u64,
        /// The pattern's seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The vCPU.
        #[arg(long, default_value_t = 0)]
        vcpu: u64,
    },
    /// PUT /snapshot/create: save the paused VM, or (--live) the running one.
    Snapshot {
        /// Full or Diff.
        #[arg(long = "type", value_enum, default_value = "full")]
        kind: SnapshotKind,
        /// Where the state file goes (it must not exist).
        #[arg(long)]
        snapshot: PathBuf,
        /// Where the memory file goes (it must not exist).
        #[arg(long)]
        mem_file: PathBuf,
        /// A live snapshot (Full or Diff) of the running VM (GET /snapshot follows it).
        #[arg(long)]
        live: bool,
        /// A live snapshot's longest pause, in ms [default: 10].
        #[arg(long, requires = "live")]
        downtime_ms: Option<u64>,
        /// Seconds a live snapshot's rounds may take [default: 60].
        #[arg(long, requires = "live")]
        timeout_s: Option<u64>,
        /// What a live snapshot does then [default: force].
        #[arg(long, value_enum, requires = "live")]
        on_timeout: Option<OnTimeout>,
        /// Return once a live snapshot has started, instead of waiting for its outcome
        /// (`snapshot-status` follows it then).
        #[arg(long, requires = "live")]
        no_wait: bool,
    },
    /// GET /snapshot: how the last live snapshot goes.
    SnapshotStatus,
    /// PUT /snapshot/cancel: cancel the live snapshot under way.
    CancelSnapshot,
    /// PUT /working-set/stop: end a uffd restore's working-set recording now.
    StopRecording,
    /// GET /vm: the VM's state.
    Vm,
    /// PATCH /vm: pause the VM.
    Pause,
    /// PATCH /vm: resume the VM.
    Resume,
    /// PUT /migrate: move the VM to a `tinyvmm receive`.
    Migrate {
        /// unix:PATH or tcp:HOST:PORT.
        destination: String,
        /// The pause the last round may take, in ms.
        #[arg(long, default_value_t = 300)]
        downtime_ms: u64,
        /// Seconds before --on-timeout applies.
        #[arg(long, default_value_t = 60)]
        timeout_s: u64,
        /// What to do then.
        #[arg(long, value_enum, default_value = "cancel")]
        on_timeout: OnTimeout,
        /// Hand memfd-backed memory over instead of copying it (Unix socket only).
        #[arg(long)]
        local: bool,
        /// Return once the migration has started, instead of waiting for its outcome
        /// (`migration` follows it then).
        #[arg(long)]
        no_wait: bool,
    },
    /// GET /migrate: how the last migration goes.
    Migration,
    /// PUT /migrate/cancel: cancel the migration under way.
    CancelMigration,
    /// PUT /actions: stop the VMM.
    Stop,
    /// Any request: METHOD PATH [JSON body].
    Raw {
        /// GET, PUT, PATCH, POST or DELETE.
        method: String,
        /// The path, e.g. /memory.
        path: String,
        /// A JSON body.
        #[arg(value_parser = json_body)]
        body: Option<Value>,
    },
}

/// A request body given on the command line: JSON (a usage error otherwise, before any
/// connection).
fn json_body(value: &str) -> Result<Value, String> {
    serde_json::from_str(value).map_err(|e| format!("the body is not JSON: {e}"))
}

/// A number of bytes or an address: decimal, `0x` hex, or a number with a binary suffix
/// (`K`, `M`, `G`, `T`, optionally followed by `iB` or `B`).
fn bytes(value: &str) -> Result<u64, String> {
    let text = value.trim();
    let invalid = || format!("{value} is not a number of bytes (4096, 0x1000, 2M, 1GiB)");
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16).map_err(|_| invalid());
    }
    let number_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(number_end);
    let shift = match unit.trim_end_matches("iB").trim_end_matches('B') {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        "T" | "t" => 40,
        _ => return Err(invalid()),
    };
    let number: u64 = digits.parse().map_err(|_| invalid())?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{value} is more than 2^64 - 1 bytes"))
}

/// What a request waits for its answer by default.
const TIMEOUT: Duration = Duration::from_secs(60);

/// What a request whose answer comes once a lot of guest memory was copied or gone over (a
/// paused snapshot, a guest write or verify) waits by default: 600 s, a paused Full of about
/// 500 GiB here (a paused Full of 4 GiB took 3–5 s in `docs/BENCHMARKS.md`'s live-snapshot
/// runs: about 1 GB/s).
const LONG_TIMEOUT: Duration = Duration::from_secs(600);

/// The exit status of a request that got no answer in time (as `timeout(1)`'s).
const TIMED_OUT: u8 = 124;

/// Whether the request `method path body` is answered only once it has copied or gone over
/// guest memory (as much as the VM has): a paused snapshot, a guest write or verify.
fn answered_when_done(method: &str, path: &str, body: Option<&Value>) -> bool {
    let field = |name: &str| body.and_then(|b| b.get(name));
    match (method, path.split('?').next().unwrap_or(path)) {
        ("PUT", "/snapshot/create") => field("live") != Some(&Value::Bool(true)),
        ("PUT", "/guest/command") => matches!(
            field("op").and_then(Value::as_str),
            Some("write" | "verify")
        ),
        _ => false,
    }
}

impl ClientRequest {
    /// How long the request waits for its answer unless `--timeout` says: [`LONG_TIMEOUT`]
    /// for a paused snapshot and a guest write or verify (`raw` ones too), [`TIMEOUT`] for
    /// every other.
    fn default_timeout(&self) -> Duration {
        match self.http() {
            Ok((method, path, body)) if answered_when_done(&method, &path, body.as_ref()) => {
                LONG_TIMEOUT
            }
            _ => TIMEOUT,
        }
    }

    /// The run this request starts and the client follows to its end: a migration, a live
    /// snapshot (unless `--no-wait`).
    fn followed(&self) -> Option<Followed> {
        match self {
            ClientRequest::Migrate { no_wait: false, .. } => Some(Followed::Migration),
            ClientRequest::Snapshot {
                live: true,
                no_wait: false,
                ..
            } => Some(Followed::LiveSnapshot),
            _ => None,
        }
    }

    /// Why a 2xx answer `body` to this request is a failure even so: a guest command whose
    /// verify found an address without its pattern (`raw` ones too).
    fn failed(&self, body: &Value) -> Option<String> {
        let (method, path, _) = self.http().ok()?;
        if method != "PUT" || path != "/guest/command" || body["result"] != "mismatch" {
            return None;
        }
        let hex = |key: &str| body[key].as_u64().map_or("?".into(), |v| format!("{v:#x}"));
        Some(format!(
            "the guest's verify failed: {} holds {}, not {}",
            hex("address"),
            hex("found"),
            hex("expected")
        ))
    }

    /// The request's method, path and JSON body.
    pub fn http(&self) -> Result<(String, String, Option<Value>), String> {
        let (method, path, body) = match self {
            ClientRequest::Info => ("GET", "/".to_owned(), None),
            ClientRequest::Metrics => ("GET", "/metrics".to_owned(), None),
            ClientRequest::Memory => ("GET", "/memory".to_owned(), None),
            ClientRequest::Region { id } => ("GET", format!("/memory/regions/{id}"), None),
            ClientRequest::AddRegion {
                size,
                guest_address,
                backing,
                page_size,
                slot_size,
                read_only,
                dirty_log,
                no_guest_check,
            } => {
                let mut body = json!({
                    "size": size,
                    "backing": backing,
                    "page_size": page_size,
                    "read_only": read_only,
                    "dirty_log": dirty_log,
                    "guest_check": !no_guest_check,
                });
                insert(&mut body, "guest_address", *guest_address);
                insert(&mut body, "slot_size", *slot_size);
                ("PUT", "/memory/regions".to_owned(), Some(body))
            }
            ClientRequest::RemoveRegion { id } => ("DELETE", format!("/memory/regions/{id}"), None),
            ClientRequest::PatchRegion {
                id,
                guest_address,
                read_only,
            } => {
                let mut body = json!({});
                insert(&mut body, "guest_address", *guest_address);
                insert(&mut body, "read_only", *read_only);
                ("PATCH", format!("/memory/regions/{id}"), Some(body))
            }
            ClientRequest::DirtyLog => ("GET", "/dirty-log".to_owned(), None),
            ClientRequest::SetDirtyLog { state, region } => {
                let mut body = json!({ "enabled": *state == Switch::On });
                insert(&mut body, "region", *region);
                ("PATCH", "/dirty-log".to_owned(), Some(body))
            }
            ClientRequest::Harvest { region } => {
                let body = region.map(|r| json!({ "region": r }));
                ("POST", "/dirty-log/harvest".to_owned(), body)
            }
            ClientRequest::Hotplug => ("GET", "/hotplug/memory".to_owned(), None),
            ClientRequest::ConfigureHotplug {
                total_mib,
                block_mib,
                slot_mib,
                page_size,
            } => {
                let mut body = json!({ "total_size_mib": total_mib, "block_size_mib": block_mib,
                                       "page_size": page_size });
                insert(&mut body, "slot_size_mib", *slot_mib);
                ("PUT", "/hotplug/memory".to_owned(), Some(body))
            }
            ClientRequest::ResizeHotplug { mib } => (
                "PATCH",
                "/hotplug/memory".to_owned(),
                Some(json!({ "requested_size_mib": mib })),
            ),
            ClientRequest::Guest {
                op,
                start,
                end,
                stride,
                seed,
                vcpu,
            } => {
                let body = match op {
                    GuestOp::StopLoop | GuestOp::Cancel => json!({"op": op, "vcpu": vcpu}),
                    GuestOp::Write
                    | GuestOp::Verify
                    | GuestOp::WriteLoop
                    | GuestOp::VexWrite
                    | GuestOp::VexVerify
                    | GuestOp::Exec
                    | GuestOp::Call => json!({
                        "op": op,
                        "start": start.unwrap_or(0), "end": end.unwrap_or(0),
                        "stride": stride, "seed": seed, "vcpu": vcpu,
                    }),
                };
                ("PUT", "/guest/command".to_owned(), Some(body))
            }
            ClientRequest::Snapshot {
                kind,
                snapshot,
                mem_file,
                live,
                downtime_ms,
                timeout_s,
                on_timeout,
                no_wait: _,
            } => {
                let mut body = json!({
                    "snapshot_type": kind,
                    "snapshot_path": snapshot,
                    "mem_file_path": mem_file,
                });
                if *live {
                    body["live"] = json!(true);
                    for (name, value) in [
                        ("downtime_ms", downtime_ms.map(|v| json!(v))),
                        ("timeout_s", timeout_s.map(|v| json!(v))),
                        ("on_timeout", on_timeout.map(|v| json!(v))),
                    ] {
                        if let Some(value) = value {
                            body[name] = value;
                        }
                    }
                }
                ("PUT", "/snapshot/create".to_owned(), Some(body))
            }
            ClientRequest::SnapshotStatus => ("GET", "/snapshot".to_owned(), None),
            ClientRequest::CancelSnapshot => ("PUT", "/snapshot/cancel".to_owned(), None),
            ClientRequest::StopRecording => ("PUT", "/working-set/stop".to_owned(), None),
            ClientRequest::Vm => ("GET", "/vm".to_owned(), None),
            ClientRequest::Pause => ("PATCH", "/vm".to_owned(), Some(json!({"state": "Paused"}))),
            ClientRequest::Resume => ("PATCH", "/vm".to_owned(), Some(json!({"state": "Resumed"}))),
            ClientRequest::Migrate {
                destination,
                downtime_ms,
                timeout_s,
                on_timeout,
                local,
                no_wait: _,
            } => (
                "PUT",
                "/migrate".to_owned(),
                Some(json!({
                    "destination": destination,
                    "downtime_ms": downtime_ms,
                    "timeout_s": timeout_s,
                    "on_timeout": on_timeout,
                    "local": local,
                })),
            ),
            ClientRequest::Migration => ("GET", "/migrate".to_owned(), None),
            ClientRequest::CancelMigration => ("PUT", "/migrate/cancel".to_owned(), None),
            ClientRequest::Stop => (
                "PUT",
                "/actions".to_owned(),
                Some(json!({"action_type": "Stop"})),
            ),
            ClientRequest::Raw { method, path, body } => {
                return Ok((method.to_ascii_uppercase(), path.clone(), body.clone()));
            }
        };
        Ok((method.to_owned(), path, body))
    }
}

/// Sets `body[key]` when there is a value.
fn insert<T: Into<Value>>(body: &mut Value, key: &str, value: Option<T>) {
    if let (Some(object), Some(value)) = (body.as_object_mut(), value) {
        object.insert(key.to_owned(), value.into());
    }
}

/// Sends `request` on the socket at `path`, waiting `timeout` at most for the answer (`None`:
/// for ever): the status and the JSON body (`Null` if none).
fn send(
    path: &Path,
    request: &ClientRequest,
    timeout: Option<Duration>,
) -> Result<(u16, Value), ClientError> {
    let (method, path_and_query, body) = request.http().map_err(ClientError::Answer)?;
    let mut client = Client::connect(path)?;
    client.set_timeout(timeout);
    client.call(&method, &path_and_query, body.as_ref())
}

/// The wait `--timeout` asks for `request` (its [default](ClientRequest::default_timeout)
/// without it; `None`, for ever, for 0).
fn timeout(request: &ClientRequest, secs: Option<u64>) -> Option<Duration> {
    match secs {
        None => Some(request.default_timeout()),
        Some(0) => None,
        Some(secs) => Some(Duration::from_secs(secs)),
    }
}

/// The exit status for an answer's status: 0 for 2xx, 4 for 4xx, 5 for 5xx, 1 otherwise.
fn exit_status(status: u16) -> u8 {
    match status {
        200..=299 => 0,
        400..=499 => 4,
        500..=599 => 5,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `client snapshot` (a Full), `--live` or not, waiting or not.
    fn snapshot(live: bool, no_wait: bool) -> ClientRequest {
        ClientRequest::Snapshot {
            kind: SnapshotKind::Full,
            snapshot: "s".into(),
            mem_file: "m".into(),
            live,
            downtime_ms: None,
            timeout_s: None,
            on_timeout: None,
            no_wait,
        }
    }

    /// `client migrate unix:/x`, waiting or not.
    fn migrate(no_wait: bool) -> ClientRequest {
        ClientRequest::Migrate {
            destination: "unix:/x".into(),
            downtime_ms: 300,
            timeout_s: 60,
            on_timeout: OnTimeout::Cancel,
            local: false,
            no_wait,
        }
    }

    #[test]
    fn sizes_and_addresses_take_units_and_hex() {
        assert_eq!(bytes("4096"), Ok(4096));
        assert_eq!(bytes("0x1000"), Ok(4096));
        assert_eq!(bytes("2M"), Ok(2 << 20));
        assert_eq!(bytes("2MiB"), Ok(2 << 20));
        assert_eq!(bytes("1G"), Ok(1 << 30));
        assert_eq!(bytes("64k"), Ok(64 << 10));
        assert!(bytes("2X").is_err());
        assert!(bytes("-1").is_err());
        assert!(bytes("99999999999T").is_err());
    }

    /// Only the requests answered once they have copied or gone over guest memory wait long
    /// by default; a live snapshot and a migration answer as they start.
    #[test]
    fn requests_that_copy_memory_before_answering_wait_longer() {
        let snapshot = |live| snapshot(live, false);
        let guest = |op| ClientRequest::Guest {
            op,
            start: Some(2 << 20),
            end: Some(4 << 20),
            stride: 8,
            seed: 0,
            vcpu: 0,
        };
        let raw = |method: &str, path: &str, body: Value| ClientRequest::Raw {
            method: method.into(),
            path: path.into(),
            body: Some(body),
        };
        for long in [
            snapshot(false),
            guest(GuestOp::Write),
            guest(GuestOp::Verify),
            raw("put", "/snapshot/create", json!({"snapshot_type": "Full"})),
            raw("PUT", "/guest/command", json!({"op": "verify"})),
        ] {
            assert_eq!(long.default_timeout(), LONG_TIMEOUT, "{long:?}");
        }
        let migrate = migrate(false);
        for short in [
            snapshot(true),
            migrate,
            guest(GuestOp::WriteLoop),
            guest(GuestOp::Cancel),
            ClientRequest::Info,
            ClientRequest::Stop,
            raw("PUT", "/snapshot/create", json!({"live": true})),
        ] {
            assert_eq!(short.default_timeout(), TIMEOUT, "{short:?}");
        }
        assert_eq!(timeout(&ClientRequest::Info, None), Some(TIMEOUT));
        assert_eq!(timeout(&ClientRequest::Info, Some(0)), None);
        assert_eq!(
            timeout(&snapshot(false), Some(5)),
            Some(Duration::from_secs(5))
        );
    }

    #[test]
    fn requests_become_their_endpoints() {
        let add = ClientRequest::AddRegion {
            size: 2 << 20,
            guest_address: None,
            backing: Backing::Memfd,
            page_size: PageSize::Huge2M,
            slot_size: Some(64 << 10),
            read_only: false,
            dirty_log: true,
            no_guest_check: false,
        };
        assert_eq!(
            add.http(),
            Ok((
                "PUT".into(),
                "/memory/regions".into(),
                Some(
                    json!({"size": 2 << 20, "backing": "memfd", "page_size": "2m", "slot_size": 65536,
                    "read_only": false, "dirty_log": true, "guest_check": true})
                )
            ))
        );
        let cancel = ClientRequest::Guest {
            op: GuestOp::Cancel,
            start: None,
            end: None,
            stride: 8,
            seed: 0,
            vcpu: 1,
        };
        assert_eq!(
            cancel.http().map(|r| r.2),
            Ok(Some(json!({"op": "cancel", "vcpu": 1})))
        );
        assert_eq!(
            ClientRequest::Harvest { region: None }.http(),
            Ok(("POST".into(), "/dirty-log/harvest".into(), None))
        );
        assert!(json_body("{nope").is_err_and(|e| e.starts_with("the body is not JSON")));
        let raw = ClientRequest::Raw {
            method: "patch".into(),
            path: "/vm".into(),
            body: Some(json_body(r#"{"state": "Paused"}"#).expect("JSON")),
        };
        assert_eq!(
            raw.http(),
            Ok((
                "PATCH".into(),
                "/vm".into(),
                Some(json!({"state": "Paused"}))
            ))
        );
    }

    #[test]
    fn migrations_and_live_snapshots_are_followed_and_a_mismatch_is_a_failure() {
        assert_eq!(migrate(false).followed(), Some(Followed::Migration));
        assert_eq!(migrate(true).followed(), None);
        assert_eq!(
            snapshot(true, false).followed(),
            Some(Followed::LiveSnapshot)
        );
        assert_eq!(snapshot(true, true).followed(), None);
        assert_eq!(
            snapshot(false, false).followed(),
            None,
            "answered once done"
        );
        assert_eq!(ClientRequest::Migration.followed(), None);

        let verify = ClientRequest::Guest {
            op: GuestOp::Verify,
            start: Some(256 << 20),
            end: Some(257 << 20),
            stride: 8,
            seed: 4,
            vcpu: 0,
        };
        let mismatch =
            json!({"result": "mismatch", "address": 0x1000_0000u64, "found": 3, "expected": 4});
        assert_eq!(
            verify.failed(&mismatch).as_deref(),
            Some("the guest's verify failed: 0x10000000 holds 0x3, not 0x4")
        );
        assert_eq!(verify.failed(&json!({"result": "ok"})), None);
        let raw = ClientRequest::Raw {
            method: "put".into(),
            path: "/guest/command".into(),
            body: None,
        };
        assert!(raw.failed(&mismatch).is_some(), "a raw request too");
        assert_eq!(ClientRequest::Vm.failed(&mismatch), None);
    }
}
