//! `docs/api.yaml` is the API's contract: a test-guest VMM on real `/dev/kvm` is driven
//! through every operation the spec documents, with good and bad inputs, and every answer's
//! status and body is checked against the spec (a status the operation does not list, a body
//! of another shape, or a field the spec does not name fails). The requests sent are checked
//! against the spec's request schemas too: the good ones must pass them, the malformed ones
//! must fail them as they fail at the server.
//!
//! The spec is read as JSON converted once from the YAML by Python's PyYAML (`$TINYVMM_PYTHON`,
//! else `python3`; `resources/setup-host.sh` installs it with the spec's validator).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;
use tinyvmm::jobs::serve::ServeConfig;
use tinyvmm::lifecycle::Ending;

mod support;
use support::vmm::InProcess;

/// The spec as JSON, with the operations the test has called.
struct Spec {
    doc: Value,
    called: Mutex<BTreeSet<(String, String)>>,
}

impl Spec {
    /// Reads `docs/api.yaml` through Python's YAML parser.
    fn load() -> Spec {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/api.yaml");
        let python = std::env::var("TINYVMM_PYTHON").unwrap_or_else(|_| "python3".into());
        let output = std::process::Command::new(&python)
            .arg("-c")
            .arg("import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)")
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {python} to read the API spec: {e}"));
        assert!(
            output.status.success(),
            "{python} could not convert {} to JSON (it needs PyYAML: `bash \
             resources/setup-host.sh` installs it and sets nothing else up): {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        Spec {
            doc: serde_json::from_slice(&output.stdout).expect("the spec as JSON"),
            called: Mutex::new(BTreeSet::new()),
        }
    }

    /// `value` with its `$ref` (if any) followed.
    fn resolve<'a>(&'a self, mut value: &'a Value) -> &'a Value {
        while let Some(reference) = value.get("$ref").and_then(Value::as_str) {
            let pointer = reference
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("only local $refs: {reference}"));
            value = self
                .doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("the spec has no {reference}"));
        }
        value
    }

    /// The spec's path template for a concrete path (`/memory/regions/7` →
    /// `/memory/regions/{id}`).
    fn template(&self, path: &str) -> Option<String> {
        let segments: Vec<&str> = path.split('/').collect();
        self.doc["paths"]
            .as_object()
            .expect("paths")
            .keys()
            .find(|template| {
                let parts: Vec<&str> = template.split('/').collect();
                parts.len() == segments.len()
                    && parts
                        .iter()
                        .zip(&segments)
                        .all(|(p, s)| p == s || (p.starts_with('{') && p.ends_with('}')))
            })
            .cloned()
    }

    fn operation(&self, method: &str, path: &str) -> Result<(String, &Value), String> {
        let template = self
            .template(path)
            .ok_or_else(|| format!("the spec has no path {path}"))?;
        let operation = self.doc["paths"][&template]
            .get(method.to_ascii_lowercase())
            .ok_or_else(|| format!("the spec has no {method} {template}"))?;
        Ok((template, operation))
    }

    /// Whether an answer is one the spec lists for the operation.
    fn check_answer(
        &self,
        method: &str,
        path: &str,
        status: u16,
        body: &Value,
    ) -> Result<(), String> {
        let (template, operation) = self.operation(method, path)?;
        self.called
            .lock()
            .expect("not poisoned")
            .insert((method.to_owned(), template.clone()));
        let response = operation["responses"]
            .get(status.to_string())
            .map(|r| self.resolve(r))
            .ok_or_else(|| format!("{method} {template} does not list status {status}"))?;
        if response.pointer("/content/text~1plain").is_some() {
            return match body {
                Value::String(_) => Ok(()),
                other => Err(format!("{method} {template} answered {other}, not text")),
            };
        }
        match response.pointer("/content/application~1json/schema") {
            None if body.is_null() => Ok(()),
            None => Err(format!(
                "{status} of {method} {template} has no body in the spec: {body}"
            )),
            Some(schema) => self.validate(schema, body, "body", true),
        }
    }

    /// Whether a request body is one the spec's request schema takes.
    fn check_request(&self, method: &str, path: &str, body: &Value) -> Result<(), String> {
        let (template, operation) = self.operation(method, path)?;
        let schema = self
            .resolve(&operation["requestBody"])
            .pointer("/content/application~1json/schema")
            .ok_or_else(|| format!("{method} {template} takes no body"))?;
        self.validate(schema, body, "request", false)
    }

    /// Checks `value` against `schema` (the parts of OpenAPI 3.0's schemas the spec uses).
    /// `strict`: an object may hold no property its schema does not name, unless the schema
    /// says otherwise (an answer must not carry undocumented fields).
    fn validate(
        &self,
        schema: &Value,
        value: &Value,
        at: &str,
        strict: bool,
    ) -> Result<(), String> {
        let schema = self.resolve(schema);
        if value.is_null() && schema["nullable"] == json!(true) {
            return Ok(());
        }
        if let Some(choices) = schema["oneOf"].as_array() {
            let matching = choices
                .iter()
                .filter(|c| self.validate(c, value, at, strict).is_ok())
                .count();
            return match matching {
                1 => Ok(()),
                n => Err(format!(
                    "{at}: {value} matches {n} of oneOf's schemas, not 1"
                )),
            };
        }
        let fail = |why: &str| Err(format!("{at}: {value} {why}"));
        if let Some(allowed) = schema["enum"].as_array() {
            if !allowed.contains(value) {
                return fail(&format!("is not one of {allowed:?}"));
            }
        }
        if let (Some(minimum), Some(number)) = (schema["minimum"].as_f64(), value.as_f64()) {
            if number < minimum {
                return fail(&format!("is below the minimum {minimum}"));
            }
        }
        match schema["type"].as_str() {
            None => Ok(()),
            Some("integer") if value.is_u64() || value.is_i64() => Ok(()),
            Some("number") if value.is_number() => Ok(()),
            Some("string") if value.is_string() => Ok(()),
            Some("boolean") if value.is_boolean() => Ok(()),
            Some("array") => {
                let Some(items) = value.as_array() else {
                    return fail("is not an array");
                };
                let count = items.len() as u64;
                if schema["minItems"].as_u64().is_some_and(|n| count < n)
                    || schema["maxItems"].as_u64().is_some_and(|n| count > n)
                {
                    return fail("has the wrong number of items");
                }
                items.iter().enumerate().try_for_each(|(i, item)| {
                    self.validate(&schema["items"], item, &format!("{at}[{i}]"), strict)
                })
            }
            Some("object") => self.validate_object(schema, value, at, strict),
            Some(other) => fail(&format!("is not of type {other}")),
        }
    }

    fn validate_object(
        &self,
        schema: &Value,
        value: &Value,
        at: &str,
        strict: bool,
    ) -> Result<(), String> {
        let Some(object) = value.as_object() else {
            return Err(format!("{at}: {value} is not an object"));
        };
        let empty = serde_json::Map::new();
        let properties = schema["properties"].as_object().unwrap_or(&empty);
        for required in schema["required"].as_array().into_iter().flatten() {
            let name = required.as_str().expect("a field name");
            if !object.contains_key(name) {
                return Err(format!("{at}: {value} lacks the required `{name}`"));
            }
        }
        for (name, field) in object {
            let here = format!("{at}.{name}");
            match (properties.get(name), &schema["additionalProperties"]) {
                (Some(property), _) => self.validate(property, field, &here, strict)?,
                (None, Value::Bool(false)) => {
                    return Err(format!("{at}: `{name}` is not a field the spec names"))
                }
                (None, Value::Object(_)) => {
                    self.validate(&schema["additionalProperties"], field, &here, strict)?
                }
                (None, Value::Null) if strict => {
                    return Err(format!(
                        "{here} is not in the spec (it names {:?})",
                        properties.keys()
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Every operation the spec documents that the test never called.
    fn uncalled(&self) -> Vec<String> {
        let called = self.called.lock().expect("not poisoned");
        let mut missing = Vec::new();
        for (template, item) in self.doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("a path item").keys() {
                let method = method.to_ascii_uppercase();
                if method != "PARAMETERS" && !called.contains(&(method.clone(), template.clone())) {
                    missing.push(format!("{method} {template}"));
                }
            }
        }
        missing
    }
}

/// A test-guest VMM serving its API, every answer checked against the spec.
struct Vmm<'a> {
    spec: &'a Spec,
    socket: PathBuf,
    /// The VMM, when the test started one here (not for a destination's socket).
    served: Option<InProcess>,
}

impl<'a> Vmm<'a> {
    fn start(spec: &'a Spec) -> Vmm<'a> {
        let socket = temp(&format!("conformance-{}.sock", std::process::id()));
        let served = InProcess::start(ServeConfig::new(socket.clone()));
        Vmm {
            spec,
            socket,
            served: Some(served),
        }
    }

    /// Sends a request with a raw body; checks the answer against the spec and returns it.
    fn send(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, answer) = Client::connect(&self.socket)
            .expect("connect")
            .raw(request.as_bytes())
            .expect("an answer");
        if let Err(e) = self.spec.check_answer(method, path, status, &answer) {
            panic!("{method} {path} {body} answered {status} {answer}, which the spec does not allow: {e}");
        }
        (status, answer)
    }

    /// Sends a request the spec's request schema takes and expects `status`.
    fn expect(&self, status: u16, method: &str, path: &str, body: Option<Value>) -> Value {
        if let Some(body) = &body {
            if let Err(e) = self.spec.check_request(method, path, body) {
                panic!("the test sends {method} {path} a body the spec refuses: {e}");
            }
        }
        let text = body.map(|b| b.to_string()).unwrap_or_default();
        let (got, answer) = self.send(method, path, &text);
        assert_eq!(got, status, "{method} {path} {text}: {answer}");
        answer
    }

    /// Sends each request the spec's request schema takes and expects its status.
    fn steps(&self, steps: Vec<(u16, &str, &str, Option<Value>)>) {
        for (status, method, path, body) in steps {
            self.expect(status, method, path, body);
        }
    }

    /// Sends a body the spec's request schema refuses: the server must refuse it with a 400.
    fn malformed(&self, method: &str, path: &str, body: Value) {
        assert!(
            self.spec.check_request(method, path, &body).is_err(),
            "the spec takes {body} for {method} {path}, which the test expects refused"
        );
        let (status, answer) = self.send(method, path, &body.to_string());
        assert_eq!(status, 400, "{method} {path} {body}: {answer}");
    }
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tinyvmm-{name}"))
}

const MIB: u64 = 1 << 20;
/// The initial memory of `ServeConfig::new`: 256 MiB at 256 MiB.
const RAM: u64 = 256 * MIB;

#[test]
fn the_spec_is_valid_json_once_read_and_names_every_route_the_server_has() {
    let spec = Spec::load();
    assert_eq!(spec.doc["openapi"].as_str().map(|v| &v[..2]), Some("3."));
    for (method, path) in [
        ("GET", "/"),
        ("GET", "/memory"),
        ("PUT", "/memory/regions"),
        ("POST", "/memory/regions"),
        ("GET", "/memory/regions/1"),
        ("DELETE", "/memory/regions/1"),
        ("PATCH", "/memory/regions/1"),
        ("GET", "/dirty-log"),
        ("PATCH", "/dirty-log"),
        ("POST", "/dirty-log/harvest"),
        ("GET", "/hotplug/memory"),
        ("PUT", "/hotplug/memory"),
        ("PATCH", "/hotplug/memory"),
        ("PUT", "/guest/command"),
        ("PUT", "/snapshot/create"),
        ("GET", "/snapshot"),
        ("PUT", "/snapshot/cancel"),
        ("PUT", "/working-set/stop"),
        ("GET", "/vm"),
        ("PATCH", "/vm"),
        ("GET", "/migrate"),
        ("PUT", "/migrate"),
        ("PUT", "/migrate/cancel"),
        ("PUT", "/actions"),
    ] {
        let request = tinyvmm::api::http::Request {
            method: method.into(),
            path: path.into(),
            query: None,
            body: b"{}".to_vec(),
            keep_alive: true,
        };
        let routed = tinyvmm::api::routes::route(&request);
        assert!(
            !matches!(&routed, Err(r) if r.status == 404 || r.status == 405),
            "the server has no {method} {path}"
        );
        spec.operation(method, path).expect("documented");
    }
    // GET /metrics is answered by the server itself, from several requests' replies; the
    // router refuses other methods on it.
    spec.operation("GET", "/metrics").expect("documented");
}

#[test]
fn kvm_every_documented_operation_answers_as_the_spec_says() {
    if !kvm_test_support::require_kvm(
        "tinyvmm::kvm_every_documented_operation_answers_as_the_spec_says",
    ) {
        return;
    }
    let spec = Spec::load();
    let vmm = Vmm::start(&spec);

    let about = vmm.expect(200, "GET", "/", None);
    assert_eq!(about["version"], json!(env!("CARGO_PKG_VERSION")));
    let metrics = vmm.expect(200, "GET", "/metrics", None);
    let metrics = metrics.as_str().expect("text");
    for series in [
        "tinyvmm_slots_used 2",
        "tinyvmm_vcpus 1",
        "tinyvmm_vm_state{state=\"Running\"} 1",
        "tinyvmm_dirty_log_harvest_requests_total 0",
        "tinyvmm_dirty_log_harvest_seconds_total 0",
    ] {
        assert!(
            metrics.lines().any(|l| l == series),
            "{series} in:\n{metrics}"
        );
    }
    for kind in tinyvmm::vm::exit::EXIT_KINDS {
        let series = format!("tinyvmm_vcpu_exits_total{{kind=\"{kind}\"}} ");
        assert!(
            metrics.lines().any(|l| l.starts_with(&series)),
            "{series} in:\n{metrics}"
        );
    }
    vmm.expect(200, "GET", "/memory", None);
    vmm.expect(200, "GET", "/vm", None);

    // Regions: added both ways, changed, removed, and refused.
    let added = vmm.expect(
        201,
        "PUT",
        "/memory/regions",
        Some(json!({"size": 2 * MIB, "slot_size": 64 << 10})),
    );
    let id = added["id"].as_u64().expect("an id");
    let small = vmm.expect(
        201,
        "POST",
        "/memory/regions",
        Some(json!({"size": 4096, "guest_check": false})),
    );
    let small = small["id"].as_u64().expect("an id");
    let region = format!("/memory/regions/{id}");
    let described = vmm.expect(200, "GET", &region, None);
    assert_eq!(
        (described["id"].as_u64(), described["size"].as_u64()),
        (Some(id), Some(2 * MIB)),
        "{described}"
    );
    vmm.expect(404, "GET", "/memory/regions/999", None);
    vmm.expect(400, "GET", "/memory/regions/abc", None);
    vmm.expect(204, "PATCH", &region, Some(json!({"read_only": true})));
    // The guest writes nothing into a read-only region (its writes would be dropped); it
    // reads it.
    let at = described["guest_address"].as_u64().expect("an address");
    let over = |op: &str| json!({"op": op, "start": at, "end": at + MIB, "stride": 4096});
    vmm.expect(409, "PUT", "/guest/command", Some(over("write")));
    vmm.expect(200, "PUT", "/guest/command", Some(over("verify")));
    vmm.expect(
        204,
        "PATCH",
        &region,
        Some(json!({"read_only": false, "guest_address": 8u64 << 30})),
    );
    vmm.expect(
        404,
        "PATCH",
        "/memory/regions/999",
        Some(json!({"read_only": true})),
    );
    vmm.malformed("PATCH", &region, json!({"read_only": "yes"}));
    vmm.malformed("PATCH", &region, json!({"guest_address": -1}));
    vmm.expect(409, "PATCH", &region, Some(json!({"guest_address": RAM})));
    vmm.malformed(
        "PUT",
        "/memory/regions",
        json!({"size": 4096, "colour": "red"}),
    );
    vmm.malformed("PUT", "/memory/regions", json!({"size": -4096}));
    vmm.malformed("POST", "/memory/regions", json!({"guest_address": 1 << 30}));
    vmm.expect(400, "PUT", "/memory/regions", Some(json!({"size": 4097})));
    vmm.expect(
        409,
        "PUT",
        "/memory/regions",
        Some(json!({"size": 4096, "guest_address": RAM})),
    );
    assert_eq!(vmm.send("PUT", "/memory/regions", "[4096]").0, 400);
    assert_eq!(vmm.send("PUT", "/memory/regions", "{\"size\": 4096").0, 400);
    vmm.expect(400, "DELETE", "/memory/regions/abc", None);
    vmm.expect(409, "DELETE", "/memory/regions/0", None);
    vmm.expect(204, "DELETE", &format!("/memory/regions/{small}"), None);
    vmm.expect(404, "DELETE", &format!("/memory/regions/{small}"), None);

    // Dirty logging.
    vmm.expect(204, "PATCH", "/dirty-log", Some(json!({"enabled": true})));
    vmm.expect(
        204,
        "PATCH",
        "/dirty-log",
        Some(json!({"enabled": false, "region": id})),
    );
    vmm.expect(
        404,
        "PATCH",
        "/dirty-log",
        Some(json!({"enabled": true, "region": 999})),
    );
    vmm.malformed("PATCH", "/dirty-log", json!({"enabled": 1}));
    vmm.malformed("PATCH", "/dirty-log", json!({"region": 1}));
    vmm.expect(200, "GET", "/dirty-log", None);
    vmm.expect(200, "POST", "/dirty-log/harvest", None);
    vmm.expect(
        200,
        "POST",
        "/dirty-log/harvest",
        Some(json!({"region": id})),
    );
    vmm.expect(
        404,
        "POST",
        "/dirty-log/harvest",
        Some(json!({"region": 999})),
    );
    vmm.malformed("POST", "/dirty-log/harvest", json!({"region": -1}));
    vmm.malformed("POST", "/dirty-log/harvest", json!({"vcpu": 0}));
    // Both harvests that were answered are counted and timed; the refused one is not.
    let log = vmm.expect(200, "GET", "/dirty-log", None);
    assert_eq!(
        (&log["harvests"], &log["harvest_requests"]),
        (&json!(1), &json!(2)),
        "{log}"
    );
    assert!(
        log["harvest_ms_total"].as_f64().is_some_and(|ms| ms > 0.0),
        "{log}"
    );

    // The hotplug area: absent, configured, plugged.
    let area = json!({"total_size_mib": 64, "block_size_mib": 2});
    let plug = |mib: i64| Some(json!({ "requested_size_mib": mib }));
    vmm.steps(vec![
        (404, "GET", "/hotplug/memory", None),
        (404, "PATCH", "/hotplug/memory", plug(2)),
        (
            400,
            "PUT",
            "/hotplug/memory",
            Some(json!({"total_size_mib": 64, "block_size_mib": 3})),
        ),
        (204, "PUT", "/hotplug/memory", Some(area.clone())),
        (204, "PATCH", "/hotplug/memory", plug(4)),
        // Plugged memory cannot be reconfigured.
        (409, "PUT", "/hotplug/memory", Some(area)),
        (400, "PATCH", "/hotplug/memory", plug(1024)),
    ]);
    vmm.malformed("PUT", "/hotplug/memory", json!({"total_size_mib": 64}));
    vmm.malformed(
        "PATCH",
        "/hotplug/memory",
        json!({"requested_size_mib": -2}),
    );
    let hotplug = vmm.expect(200, "GET", "/hotplug/memory", None);
    assert_eq!(hotplug["plugged_size_mib"], json!(4), "{hotplug}");

    // Guest commands: each op, a mismatch, a busy vCPU, and refusals.
    let range = |op: &str, seed: u64| json!({"op": op, "start": RAM, "end": RAM + MIB, "stride": 8, "seed": seed});
    assert_eq!(
        vmm.expect(200, "PUT", "/guest/command", Some(range("write", 5)))["result"],
        json!("ok")
    );
    assert_eq!(
        vmm.expect(200, "PUT", "/guest/command", Some(range("verify", 5)))["result"],
        json!("ok")
    );
    assert_eq!(
        vmm.expect(200, "PUT", "/guest/command", Some(range("verify", 6)))["result"],
        json!("mismatch")
    );
    vmm.expect(409, "PUT", "/guest/command", Some(json!({"op": "cancel"})));
    vmm.expect(
        409,
        "PUT",
        "/guest/command",
        Some(json!({"op": "stop_loop"})),
    );
    assert_eq!(
        vmm.expect(200, "PUT", "/guest/command", Some(range("write_loop", 7)))["result"],
        json!("started")
    );
    vmm.expect(409, "PUT", "/guest/command", Some(range("write", 1)));
    assert_eq!(
        vmm.expect(
            200,
            "PUT",
            "/guest/command",
            Some(json!({"op": "stop_loop"}))
        )["result"],
        json!("stopped")
    );
    assert_eq!(
        vmm.expect(200, "PUT", "/guest/command", Some(range("write_loop", 9)))["result"],
        json!("started")
    );
    assert_eq!(
        vmm.expect(
            200,
            "PUT",
            "/guest/command",
            Some(json!({"op": "cancel", "vcpu": 0}))
        )["result"],
        json!("cancelled")
    );
    vmm.expect(
        400,
        "PUT",
        "/guest/command",
        Some(json!({"op": "write", "start": 0, "end": MIB, "stride": 8})),
    );
    vmm.expect(
        400,
        "PUT",
        "/guest/command",
        Some(json!({"op": "write", "start": RAM, "end": RAM + MIB, "stride": 12})),
    );
    vmm.malformed(
        "PUT",
        "/guest/command",
        json!({"op": "write", "start": RAM, "end": RAM + MIB}),
    );
    vmm.malformed("PUT", "/guest/command", json!({"op": "erase"}));
    vmm.malformed(
        "PUT",
        "/guest/command",
        json!({"op": "verify", "start": RAM, "end": RAM + 8, "stride": 8, "seed": -1}),
    );

    // Pause, snapshot, resume.
    let (state, mem) = (
        temp(&format!("conformance-{}.state", std::process::id())),
        temp(&format!("conformance-{}.mem", std::process::id())),
    );
    let _ = (std::fs::remove_file(&state), std::fs::remove_file(&mem));
    let snapshot =
        |kind: &str| json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem});
    vmm.expect(400, "PUT", "/snapshot/create", Some(snapshot("Full")));
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Paused"})));
    assert_eq!(
        vmm.expect(200, "GET", "/vm", None)["state"],
        json!("Paused")
    );
    vmm.expect(409, "PUT", "/guest/command", Some(range("verify", 5)));
    vmm.expect(204, "PUT", "/snapshot/create", Some(snapshot("Full")));
    vmm.expect(400, "PUT", "/snapshot/create", Some(snapshot("Diff")));
    vmm.malformed(
        "PUT",
        "/snapshot/create",
        json!({"snapshot_type": "Half", "snapshot_path": "a", "mem_file_path": "b"}),
    );
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Resumed"})));
    vmm.malformed("PATCH", "/vm", json!({"state": "Frozen"}));
    let _ = (std::fs::remove_file(&state), std::fs::remove_file(&mem));

    // A live snapshot of the running VM: none yet, one that completes, and bad requests.
    vmm.expect(404, "GET", "/snapshot", None);
    // A VM that was not restored lazily records no working set.
    vmm.expect(409, "PUT", "/working-set/stop", None);
    vmm.expect(409, "PUT", "/snapshot/cancel", None);
    // A live Full, then a live Diff following it.
    for kind in ["Full", "Diff"] {
        let mut live = snapshot(kind);
        live["live"] = json!(true);
        vmm.expect(204, "PUT", "/snapshot/create", Some(live));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let info = vmm.expect(200, "GET", "/snapshot", None);
            if info["phase"] == json!("completed") {
                assert!(info["snapshot_id"].is_string(), "{info}");
                break;
            }
            assert!(
                ["setup", "pre_copy", "stop_and_copy"]
                    .contains(&info["phase"].as_str().unwrap_or("")),
                "{info}"
            );
            assert!(Instant::now() < deadline, "{info}");
            std::thread::sleep(Duration::from_millis(10));
        }
        vmm.expect(409, "PUT", "/snapshot/cancel", None);
        let _ = (std::fs::remove_file(&state), std::fs::remove_file(&mem));
    }
    let mut not_live = snapshot("Full");
    not_live["downtime_ms"] = json!(5);
    vmm.expect(400, "PUT", "/snapshot/create", Some(not_live));
    let mut no_time = snapshot("Diff");
    no_time["live"] = json!(true);
    no_time["timeout_s"] = json!(0);
    vmm.malformed("PUT", "/snapshot/create", no_time);
    vmm.malformed(
        "PUT",
        "/snapshot/create",
        json!({"snapshot_type": "Full", "snapshot_path": "a", "mem_file_path": "b", "live": "yes"}),
    );

    // Migrations: none yet, one that fails, and one held by a destination that never answers,
    // during which what would change the VM is a 409.
    vmm.expect(404, "GET", "/migrate", None);
    vmm.expect(409, "PUT", "/migrate/cancel", None);
    vmm.malformed("PUT", "/migrate", json!({"downtime_ms": 5}));
    vmm.malformed(
        "PUT",
        "/migrate",
        json!({"destination": "unix:/x", "on_timeout": "wait"}),
    );
    vmm.expect(
        400,
        "PUT",
        "/migrate",
        Some(json!({"destination": "ftp:somewhere"})),
    );
    let nowhere = temp(&format!("conformance-{}-nowhere.sock", std::process::id()));
    vmm.expect(
        204,
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", nowhere.display())})),
    );
    wait_for_phase(&vmm, &["failed"]);
    let held = temp(&format!("conformance-{}-held.sock", std::process::id()));
    let _ = std::fs::remove_file(&held);
    let listener = UnixListener::bind(&held).expect("a destination that never answers");
    vmm.expect(
        204,
        "PUT",
        "/migrate",
        Some(json!({"destination": format!("unix:{}", held.display()), "timeout_s": 30})),
    );
    let (_destination, _) = listener.accept().expect("the source connects");
    let again = json!({"destination": format!("unix:{}", held.display())});
    vmm.steps(vec![
        (409, "PUT", "/migrate", Some(again)),
        (409, "PUT", "/memory/regions", Some(json!({"size": 4096}))),
        (409, "PATCH", &region, Some(json!({"read_only": true}))),
        (409, "DELETE", &region, None),
        (409, "PATCH", "/dirty-log", Some(json!({"enabled": true}))),
        (409, "POST", "/dirty-log/harvest", None),
        (409, "PATCH", "/hotplug/memory", plug(2)),
        (409, "PUT", "/guest/command", Some(range("verify", 5))),
        (409, "PATCH", "/vm", Some(json!({"state": "Paused"}))),
        (409, "PUT", "/snapshot/create", Some(snapshot("Full"))),
    ]);
    vmm.expect(200, "GET", "/migrate", None);
    vmm.expect(204, "PUT", "/migrate/cancel", None);
    wait_for_phase(&vmm, &["cancelled"]);
    let _ = std::fs::remove_file(&held);

    // Paths and methods the spec does not list, and framing: the documented generic statuses.
    for (method, path, status) in [
        ("GET", "/nowhere", 404),
        ("DELETE", "/memory", 405),
        ("POST", "/", 405),
        ("PUT", "/dirty-log/harvest", 405),
    ] {
        let (got, body) = Client::connect(&vmm.socket)
            .expect("connect")
            .call(method, path, None)
            .expect("an answer");
        assert_eq!(got, status, "{method} {path}: {body}");
        spec.validate(
            &json!({"$ref": "#/components/schemas/FaultBody"}),
            &body,
            "body",
            true,
        )
        .expect("a fault");
    }
    expect_100_continue(&vmm);

    vmm.malformed("PUT", "/actions", json!({"action_type": "Reboot"}));
    assert_eq!(
        spec.uncalled(),
        Vec::<String>::new(),
        "operations the test never drove"
    );
    let mut vmm = vmm;
    vmm.expect(204, "PUT", "/actions", Some(json!({"action_type": "Stop"})));
    let ending = vmm.served.take().expect("running").ended();
    assert_eq!(ending.expect("a clean stop"), Ending::Finished);
}

/// Waits until `GET /migrate` says one of `phases`.
fn wait_for_phase(vmm: &Vmm, phases: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let migration = vmm.expect(200, "GET", "/migrate", None);
        if phases.iter().any(|p| migration["phase"] == json!(p)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still {migration}, not {phases:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client that sends `Expect: 100-continue` gets `100 Continue` before it sends the body,
/// then the answer.
fn expect_100_continue(vmm: &Vmm) {
    let body = r#"{"state": "Paused"}"#;
    let mut stream = UnixStream::connect(&vmm.socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a timeout");
    write!(
        stream,
        "PATCH /vm HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .expect("headers sent");
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    let mut got = vec![0; interim.len()];
    stream.read_exact(&mut got).expect("an interim answer");
    assert_eq!(got, interim, "{}", String::from_utf8_lossy(&got));
    stream.write_all(body.as_bytes()).expect("body sent");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("the answer");
    assert!(answer.starts_with("HTTP/1.1 204 "), "{answer}");
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Resumed"})));
}

#[test]
fn a_destination_before_its_vm_answers_as_the_spec_says() {
    use tinyvmm::jobs::receive::{receive_in_background, ReceiveConfig, ReceiveError};
    let spec = Spec::load();
    let name = |what: &str| temp(&format!("conformance-{}-dst.{what}", std::process::id()));
    let (listen, socket) = (name("mig"), name("sock"));
    let _ = std::fs::remove_file(&listen);
    let config = ReceiveConfig::new(
        tinyvmm::migration::Endpoint::Unix(listen.clone()),
        socket.clone(),
    );
    let receiving = receive_in_background(config).expect("receive listens");
    let destination = Vmm {
        spec: &spec,
        socket: socket.clone(),
        served: None,
    };

    // No source yet: the socket says so, and refuses the rest naming where it listens.
    assert_eq!(
        destination.expect(200, "GET", "/vm", None),
        json!({"state": "Waiting", "vcpus": 0})
    );
    destination.expect(200, "GET", "/", None);
    let metrics = destination.expect(200, "GET", "/metrics", None);
    let metrics = metrics.as_str().expect("text");
    assert!(
        metrics
            .lines()
            .any(|l| l == "tinyvmm_vm_state{state=\"Waiting\"} 1"),
        "{metrics}"
    );
    let waits_for = format!(
        "no VM here yet: this VMM waits for a migration on unix:{}",
        listen.display()
    );
    let refused = [
        ("GET", "/memory", None),
        ("GET", "/memory/regions/1", None),
        ("DELETE", "/memory/regions/1", None),
        ("GET", "/dirty-log", None),
        ("POST", "/dirty-log/harvest", None),
        ("GET", "/hotplug/memory", None),
        ("GET", "/migrate", None),
        ("PUT", "/migrate/cancel", None),
        ("GET", "/snapshot", None),
        ("PUT", "/snapshot/cancel", None),
        ("PUT", "/working-set/stop", None),
        ("PATCH", "/vm", Some(json!({"state": "Paused"}))),
        ("PUT", "/actions", Some(json!({"action_type": "Stop"}))),
        (
            "PUT",
            "/guest/command",
            Some(json!({"op": "verify", "start": RAM, "end": RAM + MIB, "stride": 8})),
        ),
    ];
    for (method, path, body) in refused.clone() {
        let answer = destination.expect(409, method, path, body);
        let message = answer["fault_message"].as_str().unwrap_or_default();
        assert!(message.starts_with(&waits_for), "{method} {path}: {answer}");
    }

    // A source connected: receiving, and the same refusals say so.
    let source = UnixStream::connect(&listen).expect("the destination listens");
    let deadline = Instant::now() + Duration::from_secs(30);
    while destination.expect(200, "GET", "/vm", None)["state"] != json!("Receiving") {
        assert!(Instant::now() < deadline, "GET /vm never said Receiving");
        std::thread::sleep(Duration::from_millis(10));
    }
    for (method, path, body) in refused {
        let answer = destination.expect(409, method, path, body);
        let message = answer["fault_message"].as_str().unwrap_or_default();
        assert!(
            message.contains("a migration is arriving from its source"),
            "{method} {path}: {answer}"
        );
    }
    // What it sends is no migration: nothing runs, and the socket goes.
    (&source)
        .write_all(b"not a migration stream")
        .expect("send");
    drop(source);
    let ended = receiving.join().expect("no panic");
    assert!(
        matches!(&ended, Err(ReceiveError::Migration(_))),
        "{ended:?}"
    );
    assert!(!socket.exists(), "the API socket is removed at the end");
}

#[test]
fn the_client_command_has_every_operation_and_sends_what_the_spec_takes() {
    use tinyvmm::jobs::client::{Backing, ClientRequest, GuestOp, OnTimeout, SnapshotKind, Switch};
    let spec = Spec::load();
    let requests = [
        ClientRequest::Info,
        ClientRequest::Metrics,
        ClientRequest::Memory,
        ClientRequest::AddRegion {
            size: 2 * MIB,
            guest_address: Some(1 << 30),
            backing: Backing::Memfd,
            page_size: tinyvmm::jobs::client::PageSize::Huge2M,
            slot_size: Some(64 << 10),
            read_only: true,
            dirty_log: true,
            no_guest_check: true,
        },
        ClientRequest::Region { id: 3 },
        ClientRequest::RemoveRegion { id: 3 },
        ClientRequest::PatchRegion {
            id: 3,
            guest_address: Some(2 << 30),
            read_only: Some(false),
        },
        ClientRequest::DirtyLog,
        ClientRequest::SetDirtyLog {
            state: Switch::Off,
            region: Some(3),
        },
        ClientRequest::Harvest { region: Some(1) },
        ClientRequest::Harvest { region: None },
        ClientRequest::Hotplug,
        ClientRequest::ConfigureHotplug {
            total_mib: 64,
            block_mib: 2,
            slot_mib: Some(4),
            page_size: tinyvmm::jobs::client::PageSize::Huge2M,
        },
        ClientRequest::ResizeHotplug { mib: 8 },
        ClientRequest::Guest {
            op: GuestOp::WriteLoop,
            start: Some(RAM),
            end: Some(RAM + MIB),
            stride: 8,
            seed: 1,
            vcpu: 0,
        },
        ClientRequest::Guest {
            op: GuestOp::StopLoop,
            start: None,
            end: None,
            stride: 8,
            seed: 0,
            vcpu: 0,
        },
        ClientRequest::Snapshot {
            kind: SnapshotKind::Diff,
            snapshot: "s".into(),
            mem_file: "m".into(),
            live: false,
            downtime_ms: None,
            timeout_s: None,
            on_timeout: None,
            no_wait: false,
        },
        ClientRequest::Snapshot {
            kind: SnapshotKind::Full,
            snapshot: "s".into(),
            mem_file: "m".into(),
            live: true,
            downtime_ms: Some(5),
            timeout_s: Some(30),
            on_timeout: Some(OnTimeout::Cancel),
            no_wait: false,
        },
        ClientRequest::SnapshotStatus,
        ClientRequest::CancelSnapshot,
        ClientRequest::StopRecording,
        ClientRequest::Vm,
        ClientRequest::Pause,
        ClientRequest::Resume,
        ClientRequest::Migrate {
            destination: "tcp:host:4444".into(),
            downtime_ms: 100,
            timeout_s: 10,
            on_timeout: OnTimeout::Force,
            local: false,
            no_wait: false,
        },
        ClientRequest::Migration,
        ClientRequest::CancelMigration,
        ClientRequest::Stop,
    ];
    for request in &requests {
        let (method, path, body) = request.http().expect("a request");
        if let Some(body) = body {
            spec.check_request(&method, &path, &body)
                .unwrap_or_else(|e| panic!("client {request:?}: {e}"));
        }
        let (template, _) = spec.operation(&method, &path).expect("documented");
        spec.called
            .lock()
            .expect("not poisoned")
            .insert((method, template));
    }
    // POST /memory/regions is PUT's operation under another method.
    spec.called
        .lock()
        .expect("not poisoned")
        .insert(("POST".into(), "/memory/regions".into()));
    assert_eq!(
        spec.uncalled(),
        Vec::<String>::new(),
        "endpoints the client has no command for"
    );
}
