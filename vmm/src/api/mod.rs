//! The API socket: HTTP/1.1 with JSON bodies on a Unix socket, served from the VMM's event loop.
//! `http` frames requests, `routes` turns them into controller requests and the controller's
//! replies and errors into responses, `types` holds the request and reply bodies, `server` runs
//! the socket; `client` is a small blocking client. The endpoints are in `docs/api.yaml`.

pub mod client;
pub mod http;
pub mod routes;
pub mod server;
pub mod types;
