//! `GET /metrics`: the VMM's counters and gauges in Prometheus' text format (version 0.0.4),
//! read from the same replies `GET /memory`, `/dirty-log`, `/vm`, `/hotplug/memory`,
//! `/migrate` and `/snapshot` give, plus the API's own answers by status and the counters of
//! the process its job hands the server ([`Labelled`]: the vCPUs' exits by kind). A resource the guest kind
//! does not answer (a Linux guest has no `/dirty-log`), or that is not there (no hotplug area,
//! no migration or live snapshot yet), gives no metrics.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::control::Request as ControllerRequest;

/// The requests whose replies the metrics are read from.
pub(super) fn sources() -> [ControllerRequest; 6] {
    [
        ControllerRequest::GetMemory,
        ControllerRequest::GetDirtyLog,
        ControllerRequest::GetVm,
        ControllerRequest::GetHotplug,
        ControllerRequest::GetMigration,
        ControllerRequest::GetSnapshot,
    ]
}

/// A metric read from a reply: its name, type, help, where it is in the reply's JSON and
/// what to multiply it by.
struct Gauge {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    pointer: &'static str,
    scale: f64,
}

const fn gauge(name: &'static str, help: &'static str, pointer: &'static str) -> Gauge {
    Gauge {
        name,
        kind: "gauge",
        help,
        pointer,
        scale: 1.0,
    }
}

const MIB: f64 = 1048576.0;

/// The metrics of each source's reply, in [`sources`]'s order.
const GAUGES: [&[Gauge]; 6] = [
    &[
        gauge(
            "tinyvmm_slots_used",
            "KVM memory slots in use.",
            "/slots/used",
        ),
        gauge(
            "tinyvmm_slots_free",
            "KVM memory slots free.",
            "/slots/free",
        ),
        gauge(
            "tinyvmm_slots_max",
            "KVM's slot count (KVM_CAP_NR_MEMSLOTS).",
            "/slots/max",
        ),
        gauge(
            "tinyvmm_guest_memory_bytes",
            "Guest memory in all regions.",
            "/used/guest_memory",
        ),
        gauge(
            "tinyvmm_metadata_bytes",
            "Host memory estimated for guest-memory metadata.",
            "/used/metadata",
        ),
        gauge(
            "tinyvmm_guest_memory_limit_bytes",
            "The guest-memory limit new regions are admitted against.",
            "/limits/max_guest_memory",
        ),
    ],
    &[
        Gauge {
            name: "tinyvmm_dirty_log_harvests_total",
            kind: "counter",
            help: "Harvests of every region of the dirty log through the API.",
            pointer: "/harvests",
            scale: 1.0,
        },
        Gauge {
            name: "tinyvmm_dirty_log_harvest_requests_total",
            kind: "counter",
            help: "Harvests of the dirty log through the API, of one region or every one.",
            pointer: "/harvest_requests",
            scale: 1.0,
        },
        Gauge {
            name: "tinyvmm_dirty_log_harvest_seconds_total",
            kind: "counter",
            help: "Time the harvests through the API took, all together.",
            pointer: "/harvest_ms_total",
            scale: 1e-3,
        },
        gauge(
            "tinyvmm_dirty_pages_per_second",
            "Pages dirtied per second between the last two harvests of every region.",
            "/dirty_rate/pages_per_second",
        ),
    ],
    &[gauge("tinyvmm_vcpus", "The VM's vCPUs.", "/vcpus")],
    &[
        Gauge {
            name: "tinyvmm_hotplug_plugged_bytes",
            kind: "gauge",
            help: "Memory plugged in the hotplug area or virtio-mem device.",
            pointer: "/plugged_size_mib",
            scale: MIB,
        },
        Gauge {
            name: "tinyvmm_hotplug_requested_bytes",
            kind: "gauge",
            help: "Memory the hotplug area or virtio-mem device was asked to hold.",
            pointer: "/requested_size_mib",
            scale: MIB,
        },
    ],
    &[
        gauge(
            "tinyvmm_migration_round",
            "The last migration's round.",
            "/round",
        ),
        gauge(
            "tinyvmm_migration_sent_bytes",
            "Bytes the last migration sent.",
            "/bytes_sent",
        ),
        gauge(
            "tinyvmm_migration_guest_memory_bytes",
            "The guest memory the last migration moves.",
            "/guest_memory_bytes",
        ),
        gauge(
            "tinyvmm_migration_pages_left",
            "Dirty pages the last migration's last harvest found.",
            "/pages_left",
        ),
        gauge(
            "tinyvmm_migration_throughput_bytes_per_second",
            "The last migration's throughput.",
            "/throughput_bytes_per_second",
        ),
        Gauge {
            name: "tinyvmm_migration_estimated_downtime_seconds",
            kind: "gauge",
            help: "The pause the last migration estimates the rest would take.",
            pointer: "/estimated_downtime_ms",
            scale: 1e-3,
        },
    ],
    &[
        gauge(
            "tinyvmm_live_snapshot_round",
            "The last live snapshot's round.",
            "/round",
        ),
        gauge(
            "tinyvmm_live_snapshot_written_bytes",
            "Bytes of pages the last live snapshot wrote.",
            "/bytes_written",
        ),
        gauge(
            "tinyvmm_live_snapshot_pages_left",
            "Dirty pages the last live snapshot's last harvest found.",
            "/pages_left",
        ),
        Gauge {
            name: "tinyvmm_live_snapshot_pause_seconds",
            kind: "gauge",
            help: "The pause the last live snapshot took, once completed.",
            pointer: "/pause_ms",
            scale: 1e-3,
        },
    ],
];

/// State-like fields given as one series per value, 1 for the current one.
const STATES: [(usize, &str, &str, &str); 3] = [
    (2, "tinyvmm_vm_state", "The VM's state.", "/state"),
    (
        4,
        "tinyvmm_migration_phase",
        "The last migration's phase.",
        "/phase",
    ),
    (
        5,
        "tinyvmm_live_snapshot_phase",
        "The last live snapshot's phase.",
        "/phase",
    ),
];

/// Counters of the process that are no controller's reply, one series per label value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Labelled {
    /// The metric's name.
    pub(crate) name: &'static str,
    /// Its help line.
    pub(crate) help: &'static str,
    /// The label that tells the series apart.
    pub(crate) label: &'static str,
    /// Each label value and its count.
    pub(crate) values: Vec<(&'static str, u64)>,
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The metrics text: `replies` holds each source's reply body (`None` where it was refused),
/// in [`sources`]'s order; `answered` the API's answers by status; `connections` the clients
/// connected; `counters` the process's own counters.
pub(super) fn render(
    replies: &[Option<Value>],
    answered: &BTreeMap<u16, u64>,
    connections: usize,
    counters: &[Labelled],
) -> String {
    let mut out = String::new();
    for counter in counters {
        header(&mut out, counter.name, "counter", counter.help);
        for (value, count) in &counter.values {
            let _ = writeln!(
                out,
                "{}{{{}=\"{value}\"}} {count}",
                counter.name, counter.label
            );
        }
    }
    header(
        &mut out,
        "tinyvmm_api_responses_total",
        "counter",
        "Answers of the API socket, by status.",
    );
    for (status, count) in answered {
        let _ = writeln!(
            out,
            "tinyvmm_api_responses_total{{status=\"{status}\"}} {count}"
        );
    }
    header(
        &mut out,
        "tinyvmm_api_connections",
        "gauge",
        "Clients connected to the API socket.",
    );
    let _ = writeln!(out, "tinyvmm_api_connections {connections}");
    for (reply, gauges) in replies.iter().zip(GAUGES) {
        let Some(reply) = reply else { continue };
        for gauge in gauges {
            if let Some(value) = reply.pointer(gauge.pointer).and_then(Value::as_f64) {
                header(&mut out, gauge.name, gauge.kind, gauge.help);
                let _ = writeln!(out, "{} {}", gauge.name, value * gauge.scale);
            }
        }
    }
    if let Some(Some(memory)) = replies.first() {
        if let Some(regions) = memory["regions"].as_array() {
            header(
                &mut out,
                "tinyvmm_regions",
                "gauge",
                "Memory regions of the VM.",
            );
            let _ = writeln!(out, "tinyvmm_regions {}", regions.len());
        }
    }
    for (source, name, help, pointer) in STATES {
        let state = replies
            .get(source)
            .and_then(Option::as_ref)
            .and_then(|r| r.pointer(pointer))
            .and_then(Value::as_str);
        if let Some(state) = state {
            header(&mut out, name, "gauge", help);
            let _ = writeln!(out, "{name}{{state=\"{state}\"}} 1");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replies_become_prometheus_text_and_missing_ones_are_left_out() {
        let memory = json!({
            "slots": {"used": 2, "free": 32762, "max": 32764},
            "used": {"guest_memory": 270532608, "metadata": 562987},
            "limits": {"max_guest_memory": 1u64 << 36},
            "regions": [{}, {}],
        });
        let vm = json!({"state": "Paused", "vcpus": 2});
        let hotplug = json!({"plugged_size_mib": 4, "requested_size_mib": 8});
        let answered = BTreeMap::from([(200, 7), (404, 1)]);
        let exits = Labelled {
            name: "tinyvmm_vcpu_exits_total",
            help: "vCPU exits by kind.",
            label: "kind",
            values: vec![("io_out", 12), ("mmio_write", 3)],
        };
        let text = render(
            &[Some(memory), None, Some(vm), Some(hotplug), None],
            &answered,
            3,
            &[exits],
        );
        for line in [
            "# TYPE tinyvmm_api_responses_total counter",
            "tinyvmm_api_responses_total{status=\"200\"} 7",
            "tinyvmm_api_responses_total{status=\"404\"} 1",
            "tinyvmm_api_connections 3",
            "tinyvmm_slots_used 2",
            "tinyvmm_guest_memory_bytes 270532608",
            "tinyvmm_regions 2",
            "tinyvmm_vcpus 2",
            "tinyvmm_vm_state{state=\"Paused\"} 1",
            "tinyvmm_hotplug_plugged_bytes 4194304",
            "# TYPE tinyvmm_vcpu_exits_total counter",
            "tinyvmm_vcpu_exits_total{kind=\"io_out\"} 12",
            "tinyvmm_vcpu_exits_total{kind=\"mmio_write\"} 3",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
        assert!(
            !text.contains("migration") && !text.contains("dirty"),
            "{text}"
        );
        // Every series has its HELP and TYPE first.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().expect("a name");
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
        }
    }
}
