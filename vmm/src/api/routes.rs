//! Between HTTP and the controller: turns a request (path, method, JSON body) into a
//! controller [`ControllerRequest`], and the controller's reply or error into a response. The
//! status of an error is decided here, from its kind, and nowhere else. Nothing here touches the
//! VM.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::http::{Request, Response};
use crate::control::dirty_log::Harvest;
use crate::control::{ControllerError, ErrorKind, Outcome, Reply, Request as ControllerRequest};

/// Parses a JSON body, naming the problem (unknown field, wrong type, negative or overflowing
/// number, bad syntax) in the error.
fn body<T: DeserializeOwned>(request: &Request) -> Result<T, Response> {
    if request.body.is_empty() {
        return Err(Response::fault(400, "a JSON body is required"));
    }
    // serde's derived structs also take their fields as an array (`["Paused"]`): every body
    // the API documents is an object, so anything else is refused here, once for all routes.
    if request.body.trim_ascii_start().first() != Some(&b'{') {
        return Err(Response::fault(
            400,
            "invalid request body: it must be a JSON object (see docs/api.yaml)",
        ));
    }
    serde_json::from_slice(&request.body)
        .map_err(|e| Response::fault(400, format!("invalid request body: {e}")))
}

fn id(segment: &str) -> Result<u64, Response> {
    segment
        .parse()
        .map_err(|_| Response::fault(400, format!("'{segment}' is not a region id")))
}

fn method_not_allowed(method: &str, path: &str, allowed: &str) -> Response {
    Response::fault(
        405,
        format!("{method} is not allowed on {path} (allowed: {allowed})"),
    )
}

/// The status for an error of `kind`.
fn status(kind: ErrorKind) -> u16 {
    match kind {
        ErrorKind::BadRequest => 400,
        ErrorKind::NotFound => 404,
        ErrorKind::Conflict => 409,
        ErrorKind::Internal => 500,
        ErrorKind::Unavailable => 503,
    }
}

fn json(status: u16, body: &impl Serialize) -> Response {
    Response::json(
        status,
        serde_json::to_value(body).expect("reply types serialise to JSON"),
    )
}

/// The response for what the controller did.
pub(super) fn respond(outcome: Outcome) -> Response {
    match outcome {
        Ok(Reply::Done) => Response::no_content(),
        Ok(Reply::Memory(info)) => json(200, &info),
        Ok(Reply::Region(region)) => json(200, &region),
        Ok(Reply::RegionAdded(added)) => json(201, &added),
        Ok(Reply::Harvest(dirty)) => json(200, &dirty),
        Ok(Reply::DirtyLog(info)) => json(200, &info),
        Ok(Reply::Hotplug(info)) => json(200, &info),
        Ok(Reply::Vm(info)) => json(200, &info),
        Ok(Reply::Guest(result)) => json(200, &result),
        Ok(Reply::Migration(info)) => json(200, &info),
        Ok(Reply::Snapshot(info)) => json(200, &info),
        // The server holds a deferred request's connection until its outcome comes (see
        // `ApiServer`); an outcome is never deferred twice.
        Ok(Reply::Deferred(_)) => Response::fault(
            500,
            "the controller deferred an answer that was already deferred",
        ),
        Err(ControllerError { kind, message }) => Response::fault(status(kind), message),
    }
}

/// `GET /`'s answer: what answers on the socket, with no VM involved (a ping).
fn about() -> Response {
    Response::json(
        200,
        serde_json::json!({
            "name": "tinyvmm",
            "version": crate::VERSION,
            "commit": crate::COMMIT,
        }),
    )
}

/// The controller request an HTTP request asks for, or the response the router gives itself:
/// a refusal, or `GET /`'s (which needs no VM).
pub fn route(request: &Request) -> Result<ControllerRequest, Response> {
    let method = request.method.as_str();
    let path = request.path.trim_end_matches('/');
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    match segments.as_slice() {
        [] => match method {
            "GET" => Err(about()),
            _ => Err(method_not_allowed(method, "/", "GET")),
        },
        // The server answers GET /metrics itself, from several requests' replies.
        ["metrics"] => Err(method_not_allowed(method, path, "GET")),
        ["memory"] => match method {
            "GET" => Ok(ControllerRequest::GetMemory),
            _ => Err(method_not_allowed(method, path, "GET")),
        },
        ["memory", "regions"] => match method {
            "PUT" | "POST" => Ok(ControllerRequest::AddRegion(body(request)?)),
            _ => Err(method_not_allowed(method, path, "PUT, POST")),
        },
        ["memory", "regions", region] => match method {
            "GET" => Ok(ControllerRequest::GetRegion(id(region)?)),
            "DELETE" => Ok(ControllerRequest::RemoveRegion(id(region)?)),
            "PATCH" => Ok(ControllerRequest::PatchRegion(id(region)?, body(request)?)),
            _ => Err(method_not_allowed(method, path, "GET, DELETE, PATCH")),
        },
        ["dirty-log"] => match method {
            "GET" => Ok(ControllerRequest::GetDirtyLog),
            "PATCH" => Ok(ControllerRequest::SwitchDirtyLog(body(request)?)),
            _ => Err(method_not_allowed(method, path, "GET, PATCH")),
        },
        ["dirty-log", "harvest"] => match method {
            "POST" => Ok(ControllerRequest::Harvest(if request.body.is_empty() {
                Harvest::default()
            } else {
                body(request)?
            })),
            _ => Err(method_not_allowed(method, path, "POST")),
        },
        ["hotplug", "memory"] => match method {
            "GET" => Ok(ControllerRequest::GetHotplug),
            "PUT" => Ok(ControllerRequest::ConfigureHotplug(body(request)?)),
            "PATCH" => Ok(ControllerRequest::RequestHotplug(body(request)?)),
            _ => Err(method_not_allowed(method, path, "GET, PUT, PATCH")),
        },
        ["guest", "command"] => match method {
            "PUT" => Ok(ControllerRequest::Guest(body(request)?)),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        ["snapshot", "create"] => match method {
            "PUT" => Ok(ControllerRequest::CreateSnapshot(body(request)?)),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        ["snapshot"] => match method {
            "GET" => Ok(ControllerRequest::GetSnapshot),
            _ => Err(method_not_allowed(method, path, "GET")),
        },
        ["snapshot", "cancel"] => match method {
            "PUT" => Ok(ControllerRequest::CancelSnapshot),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        ["working-set", "stop"] => match method {
            "PUT" => Ok(ControllerRequest::StopRecording),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        ["vm"] => match method {
            "GET" => Ok(ControllerRequest::GetVm),
            "PATCH" => Ok(ControllerRequest::PatchVm(body(request)?)),
            _ => Err(method_not_allowed(method, path, "GET, PATCH")),
        },
        ["migrate"] => match method {
            "GET" => Ok(ControllerRequest::GetMigration),
            "PUT" => Ok(ControllerRequest::Migrate(body(request)?)),
            _ => Err(method_not_allowed(method, path, "GET, PUT")),
        },
        ["migrate", "cancel"] => match method {
            "PUT" => Ok(ControllerRequest::CancelMigration),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        ["actions"] => match method {
            "PUT" => Ok(ControllerRequest::Act(body(request)?)),
            _ => Err(method_not_allowed(method, path, "PUT")),
        },
        _ => Err(Response::fault(
            404,
            format!("no resource at {}", request.path),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::guest::GuestCommandResult;
    use crate::control::memory::{AddRegion, RegionBacking};

    fn request(method: &str, path: &str, body: &str) -> Request {
        Request {
            method: method.into(),
            path: path.into(),
            query: None,
            body: body.as_bytes().to_vec(),
            keep_alive: true,
        }
    }

    fn refusal(method: &str, path: &str, body: &str) -> (u16, String) {
        let response = route(&request(method, path, body)).expect_err("refused");
        let message = response.body.expect("a fault message")["fault_message"]
            .as_str()
            .expect("a string")
            .to_owned();
        (response.status, message)
    }

    #[test]
    fn bodies_become_actions() {
        let action = route(&request(
            "PUT",
            "/memory/regions",
            r#"{"size": 4096, "guest_address": 1073741824, "backing": "memfd"}"#,
        ))
        .unwrap();
        assert_eq!(
            action,
            ControllerRequest::AddRegion(AddRegion {
                size: 4096,
                guest_address: Some(1 << 30),
                backing: RegionBacking::Memfd,
                page_size: Default::default(),
                slot_size: None,
                read_only: false,
                dirty_log: false,
                guest_check: true,
            })
        );
        assert_eq!(
            route(&request("DELETE", "/memory/regions/12/", "")).unwrap(),
            ControllerRequest::RemoveRegion(12)
        );
        assert_eq!(
            route(&request("POST", "/dirty-log/harvest", "")).unwrap(),
            ControllerRequest::Harvest(Harvest { region: None })
        );
    }

    #[test]
    fn migration_routes_take_their_defaults_and_refuse_the_rest() {
        let started = route(&request(
            "PUT",
            "/migrate",
            r#"{"destination": "unix:/tmp/m.sock"}"#,
        ))
        .expect("routed");
        let ControllerRequest::Migrate(m) = started else {
            panic!("{started:?}");
        };
        assert_eq!(
            (m.downtime_ms, m.timeout_s, m.on_timeout, m.local),
            (300, 60, crate::control::migration::OnTimeout::Cancel, false)
        );
        assert_eq!(
            route(&request("GET", "/migrate", "")).expect("routed"),
            ControllerRequest::GetMigration
        );
        assert_eq!(
            route(&request("PUT", "/migrate/cancel", "")).expect("routed"),
            ControllerRequest::CancelMigration
        );
        assert_eq!(refusal("DELETE", "/migrate", "").0, 405);
        let (status, message) = refusal(
            "PUT",
            "/migrate",
            r#"{"destination": "x", "on_timeout": "wait"}"#,
        );
        assert_eq!(status, 400);
        assert!(message.contains("unknown variant `wait`"), "{message}");
        let (_, message) = refusal("PUT", "/migrate", r#"{"downtime_ms": 5}"#);
        assert!(message.contains("missing field `destination`"), "{message}");
    }

    #[test]
    fn bad_bodies_and_paths_are_refused_with_the_reason() {
        let (status, message) = refusal(
            "PUT",
            "/memory/regions",
            r#"{"size": 4096, "colour": "red"}"#,
        );
        assert_eq!(status, 400);
        assert!(message.contains("unknown field `colour`"), "{message}");
        let (_, message) = refusal("PUT", "/memory/regions", r#"{"size": -4096}"#);
        assert!(
            message.contains("invalid value: integer `-4096`, expected u64"),
            "{message}"
        );
        let (_, message) = refusal(
            "PUT",
            "/memory/regions",
            r#"{"size": 18446744073709551616}"#,
        );
        assert!(message.contains("invalid request body"), "{message}");
        let (_, message) = refusal("PUT", "/memory/regions", r#"{"size": "big"}"#);
        assert!(
            message.contains("invalid type: string \"big\", expected u64"),
            "{message}"
        );
        let (_, message) = refusal("PUT", "/memory/regions", r#"{"size": 4096"#);
        assert!(message.contains("EOF while parsing"), "{message}");
        assert_eq!(
            refusal("PUT", "/memory/regions", "").1,
            "a JSON body is required"
        );
        assert_eq!(
            refusal("DELETE", "/memory/regions/x", "").1,
            "'x' is not a region id"
        );
        assert_eq!(
            refusal("GET", "/nowhere", ""),
            (404, "no resource at /nowhere".into())
        );
        assert_eq!(refusal("POST", "/memory", "").0, 405);
        assert_eq!(refusal("PUT", "/dirty-log/harvest", "").0, 405);
        let (status, body) = match route(&request("GET", "/", "")) {
            Err(response) => (response.status, response.body),
            Ok(other) => panic!("GET / went to the controller: {other:?}"),
        };
        assert_eq!(status, 200);
        let body = body.expect("a body");
        assert_eq!(
            (&body["name"], &body["version"]),
            (
                &serde_json::json!("tinyvmm"),
                &serde_json::json!(crate::VERSION)
            )
        );
        assert!(body["commit"].is_string(), "{body}");
        assert_eq!(refusal("DELETE", "/", "").0, 405);
    }

    #[test]
    fn replies_and_errors_become_statuses_and_bodies() {
        let mismatch = respond(Ok(Reply::Guest(GuestCommandResult::Mismatch {
            address: 0x1000_0000,
            found: 1,
            expected: 2,
        })));
        assert_eq!(mismatch.status, 200);
        assert_eq!(
            mismatch.body,
            Some(serde_json::json!({
                "result": "mismatch", "address": 0x1000_0000u64, "found": 1, "expected": 2
            }))
        );
        let ok = respond(Ok(Reply::Guest(GuestCommandResult::Ok)));
        assert_eq!(ok.body, Some(serde_json::json!({ "result": "ok" })));
        assert_eq!(respond(Ok(Reply::Done)).status, 204);
        for (kind, code) in [
            (ErrorKind::BadRequest, 400),
            (ErrorKind::NotFound, 404),
            (ErrorKind::Conflict, 409),
            (ErrorKind::Internal, 500),
            (ErrorKind::Unavailable, 503),
        ] {
            let response = respond(Err(ControllerError::new(kind, "why")));
            assert_eq!(response.status, code);
            assert_eq!(
                response.body,
                Some(serde_json::json!({ "fault_message": "why" }))
            );
        }
    }

    #[test]
    fn every_body_must_be_an_object_on_every_route() {
        let routes = [
            (
                "PUT",
                "/memory/regions",
                r#"[4096, 3221225472, "anonymous", 4096, false, false, false]"#,
            ),
            ("PATCH", "/memory/regions/2", r#"[1073741824, null]"#),
            ("PATCH", "/dirty-log", "[true, 1]"),
            ("POST", "/dirty-log/harvest", "[1]"),
            ("PUT", "/hotplug/memory", "[64, 2, null]"),
            ("PATCH", "/hotplug/memory", "[4]"),
            ("PUT", "/guest/command", r#"["write", 0, 8, 8, 1, 0]"#),
            ("PATCH", "/vm", r#"["Paused"]"#),
            ("PUT", "/actions", r#"["Stop"]"#),
        ];
        for (method, path, array) in routes {
            for body in [array, " \n\"text\"", "42", "null", "true"] {
                let (status, message) = refusal(method, path, body);
                assert_eq!(status, 400, "{method} {path} {body}");
                assert_eq!(
                    message, "invalid request body: it must be a JSON object (see docs/api.yaml)",
                    "{method} {path} {body}"
                );
            }
        }
        // The same requests as objects are taken.
        assert!(route(&request("PATCH", "/vm", r#" {"state": "Paused"}"#)).is_ok());
        assert!(route(&request("POST", "/dirty-log/harvest", r#"{"region": 1}"#)).is_ok());
    }
}
