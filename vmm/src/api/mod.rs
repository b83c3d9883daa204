//! The API socket: HTTP/1.1 with JSON bodies on a Unix socket, served from the VMM's event loop.
//! `http` frames requests, `routes` turns them into `control` requests and a controller's
//! replies and errors into responses, `server` runs the socket (and answers `GET /metrics`
//! from `metrics`); `client` is a small blocking client. The request and reply bodies are `control`'s; the endpoints are in `docs/api.yaml`.

pub mod client;
pub mod http;
pub(crate) mod metrics;
pub mod routes;
pub mod server;
