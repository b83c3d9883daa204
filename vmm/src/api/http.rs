//! HTTP/1.1 framing for the API socket: requests parsed with `httparse`, bodies framed by
//! `Content-Length`, with bounded header and body sizes; JSON responses.

use std::fmt;

/// Most bytes of request line and headers.
pub(super) const MAX_HEADER_BYTES: usize = 8 * 1024;
/// Most bytes of a request body.
pub(super) const MAX_BODY_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 32;

/// A complete request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `PUT`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query string after `?`, if any.
    pub query: Option<String>,
    /// The body (empty without `Content-Length`).
    pub body: Vec<u8>,
    /// Whether the client keeps the connection open after the response.
    pub keep_alive: bool,
}

/// A request the server cannot frame; each maps to a 4xx status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HttpError {
    /// Not HTTP/1.x.
    #[error("malformed HTTP request: {0}")]
    Malformed(httparse::Error),
    /// Request line and headers over [`MAX_HEADER_BYTES`] or more than 32 headers.
    #[error("request headers too large (at most {MAX_HEADER_BYTES} bytes and 32 headers)")]
    HeadersTooLarge,
    /// A body over [`MAX_BODY_BYTES`].
    #[error("request body of {0} bytes is too large (at most {MAX_BODY_BYTES})")]
    BodyTooLarge(usize),
    /// A `Content-Length` that is not a plain decimal number (RFC 9112 §6.3: a 400, and the
    /// connection is closed).
    #[error("invalid Content-Length header: {0:?} is not a decimal number of bytes")]
    BadContentLength(String),
    /// Several `Content-Length` headers that disagree: the body's end is ambiguous.
    #[error("conflicting Content-Length headers: {0} and {1}")]
    ConflictingContentLength(usize, usize),
    /// `Transfer-Encoding` (chunked bodies) is not supported.
    #[error("chunked or encoded bodies are not supported: send Content-Length")]
    TransferEncoding,
    /// The client closed the connection in the middle of a request.
    #[error("request truncated: the connection closed after {got} of {expected} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the headers announced (or at least expected).
        expected: usize,
    },
}

impl HttpError {
    /// The status code for this error.
    pub(super) fn status(&self) -> u16 {
        match self {
            HttpError::HeadersTooLarge => 431,
            HttpError::BodyTooLarge(_) => 413,
            HttpError::TransferEncoding => 411,
            _ => 400,
        }
    }
}

/// What the bytes received so far hold.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// Not a whole request yet.
    Incomplete,
    /// The headers of a request that asked for `Expect: 100-continue` are here, its body is
    /// not yet: the client waits for [`CONTINUE`] before it sends the body.
    ExpectsContinue,
    /// A request, and how many bytes of the buffer it took.
    Complete(Request, usize),
}

/// The interim answer to a request with `Expect: 100-continue` whose headers were accepted
/// (RFC 9110 §10.1.1): the client may send its body.
pub(super) const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Parses the first request in `buf`.
pub(crate) fn parse(buf: &[u8]) -> Result<Parsed, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let header_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEADER_BYTES => {
            return Err(HttpError::HeadersTooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Incomplete),
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::HeadersTooLarge),
        Err(e) => return Err(HttpError::Malformed(e)),
    };
    if header_len > MAX_HEADER_BYTES {
        return Err(HttpError::HeadersTooLarge);
    }
    let mut content_length: Option<usize> = None;
    let mut connection = None;
    let mut expects_continue = false;
    for header in request.headers.iter() {
        if header.name.eq_ignore_ascii_case("content-length") {
            let length = content_length_value(header.value)?;
            match content_length {
                Some(earlier) if earlier != length => {
                    return Err(HttpError::ConflictingContentLength(earlier, length))
                }
                _ => content_length = Some(length),
            }
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::TransferEncoding);
        } else if header.name.eq_ignore_ascii_case("expect") {
            expects_continue = header.value.eq_ignore_ascii_case(b"100-continue");
        } else if header.name.eq_ignore_ascii_case("connection") {
            connection = std::str::from_utf8(header.value)
                .ok()
                .map(str::to_ascii_lowercase);
        }
    }
    let content_length = content_length.unwrap_or(0);
    if content_length > MAX_BODY_BYTES {
        return Err(HttpError::BodyTooLarge(content_length));
    }
    let total = header_len + content_length;
    if buf.len() < total {
        // A framing error above is the final answer instead (RFC 9110 §10.1.1).
        return Ok(if expects_continue && buf.len() == header_len {
            Parsed::ExpectsContinue
        } else {
            Parsed::Incomplete
        });
    }
    let http_1_1 = request.version == Some(1);
    let keep_alive = match connection.as_deref() {
        Some("close") => false,
        Some("keep-alive") => true,
        _ => http_1_1,
    };
    let target = request.path.unwrap_or("/");
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q.to_owned())),
        None => (target, None),
    };
    Ok(Parsed::Complete(
        Request {
            method: request.method.unwrap_or("").to_owned(),
            path: path.to_owned(),
            query,
            body: buf[header_len..total].to_vec(),
            keep_alive,
        },
        total,
    ))
}

/// A `Content-Length` value: one or more ASCII digits and nothing else (no sign, no list), as
/// RFC 9112 §8.6 defines it; optional whitespace around it is the header's, not the value's.
fn content_length_value(value: &[u8]) -> Result<usize, HttpError> {
    let text = String::from_utf8_lossy(value);
    let digits = text.trim_matches(|c| c == ' ' || c == '\t');
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HttpError::BadContentLength(text.into_owned()));
    }
    // A number too large for usize is far over the body limit anyway.
    Ok(digits.parse().unwrap_or(usize::MAX))
}

/// What is left in a connection's buffer when the client closes it: an error if it is part of
/// a request.
pub(crate) fn at_close(buf: &[u8]) -> Result<(), HttpError> {
    if buf.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(());
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let expected = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let length = request
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| {
                    std::str::from_utf8(h.value)
                        .ok()?
                        .trim()
                        .parse::<usize>()
                        .ok()
                })
                .unwrap_or(0);
            n + length
        }
        _ => buf.len() + 1,
    };
    Err(HttpError::Truncated {
        got: buf.len(),
        expected,
    })
}

/// A response: a status and an optional JSON body (or, for `GET /metrics`, plain text).
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The body.
    pub(crate) body: Option<serde_json::Value>,
    /// A plain-text body instead (`text/plain`), when set.
    text: Option<String>,
}

impl Response {
    /// `204 No Content`.
    pub(super) fn no_content() -> Self {
        Response {
            status: 204,
            body: None,
            text: None,
        }
    }

    /// `200 OK` with a plain-text body in Prometheus' exposition format.
    pub(super) fn text(body: String) -> Self {
        Response {
            status: 200,
            body: None,
            text: Some(body),
        }
    }

    /// A status with a JSON body.
    pub(super) fn json(status: u16, body: serde_json::Value) -> Self {
        Response {
            status,
            body: Some(body),
            text: None,
        }
    }

    /// An error: `{"fault_message": "..."}`.
    pub(super) fn fault(status: u16, message: impl fmt::Display) -> Self {
        Response::json(
            status,
            serde_json::json!({ "fault_message": message.to_string() }),
        )
    }

    /// The bytes on the wire.
    pub(super) fn to_bytes(&self, keep_alive: bool) -> Vec<u8> {
        let (body, content_type) = match (&self.text, &self.body) {
            (Some(text), _) => (
                text.clone().into_bytes(),
                "text/plain; version=0.0.4; charset=utf-8",
            ),
            (None, Some(json)) => (
                serde_json::to_vec(json).expect("a JSON value serialises"),
                "application/json",
            ),
            (None, None) => (Vec::new(), ""),
        };
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nServer: tinyvmm\r\nContent-Length: {}\r\nConnection: {}\r\n",
            self.status,
            reason(self.status),
            body.len(),
            if keep_alive { "keep-alive" } else { "close" }
        );
        if !body.is_empty() {
            out.push_str(&format!("Content-Type: {content_type}\r\n"));
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        bytes.extend(body);
        bytes
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(bytes: &[u8]) -> (Request, usize) {
        match parse(bytes).unwrap() {
            Parsed::Complete(r, n) => (r, n),
            other => panic!("not complete: {other:?}"),
        }
    }

    #[test]
    fn a_request_is_framed_by_its_content_length() {
        let raw = b"PUT /memory/regions?x=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n\r\n{}  GET / HTTP/1.1\r\n\r\n";
        let (r, n) = complete(raw);
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.query.as_deref()),
            ("PUT", "/memory/regions", Some("x=1"))
        );
        assert_eq!(r.body, b"{}  ");
        assert!(r.keep_alive);
        let (next, _) = complete(&raw[n..]);
        assert_eq!(next.path, "/");
        for cut in [10, 40, raw.len() - 22] {
            assert_eq!(
                parse(&raw[..cut]).unwrap(),
                Parsed::Incomplete,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn expect_100_continue_is_told_apart_until_the_body_comes() {
        let head = b"PUT /vm HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n";
        assert_eq!(parse(head), Ok(Parsed::ExpectsContinue));
        assert_eq!(parse(&head[..head.len() - 1]), Ok(Parsed::Incomplete));
        let whole = [&head[..], b"{}"].concat();
        assert!(matches!(parse(&whole), Ok(Parsed::Complete(_, 63))));
        // Without the header, or with a body too large, no interim answer.
        let plain = b"PUT /vm HTTP/1.1\r\nContent-Length: 2\r\n\r\n";
        assert_eq!(parse(plain), Ok(Parsed::Incomplete));
        let big = format!(
            "PUT / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert_eq!(
            parse(big.as_bytes()),
            Err(HttpError::BodyTooLarge(MAX_BODY_BYTES + 1))
        );
    }

    #[test]
    fn oversized_malformed_and_truncated_requests_are_named() {
        let big = format!(
            "PUT / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert_eq!(
            parse(big.as_bytes()),
            Err(HttpError::BodyTooLarge(MAX_BODY_BYTES + 1))
        );
        let long_header = format!("GET / HTTP/1.1\r\nX: {}\r\n", "a".repeat(MAX_HEADER_BYTES));
        assert_eq!(
            parse(long_header.as_bytes()),
            Err(HttpError::HeadersTooLarge)
        );
        assert!(matches!(
            parse(b"\x01\x02 nonsense\r\n\r\n"),
            Err(HttpError::Malformed(_))
        ));
        assert_eq!(
            parse(b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Err(HttpError::BadContentLength("x".into()))
        );
        assert_eq!(
            parse(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap_err()
                .status(),
            411
        );
        assert_eq!(
            at_close(b"PUT / HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"a\""),
            Err(HttpError::Truncated {
                got: 42,
                expected: 48
            })
        );
        assert_eq!(at_close(b"\r\n"), Ok(()));
    }

    #[test]
    fn responses_carry_length_and_connection() {
        let bytes = Response::fault(404, "region 7 does not exist").to_bytes(false);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with("HTTP/1.1 404 Not Found\r\n"), "{text}");
        assert!(text.contains("Connection: close\r\n"));
        assert!(
            text.ends_with("\r\n\r\n{\"fault_message\":\"region 7 does not exist\"}"),
            "{text}"
        );
        let empty = String::from_utf8(Response::no_content().to_bytes(true)).unwrap();
        assert!(empty.contains("Content-Length: 0\r\n") && !empty.contains("Content-Type"));
    }

    #[test]
    fn content_length_is_digits_only_and_never_ambiguous() {
        let with = |headers: &str| format!("PUT / HTTP/1.1\r\n{headers}\r\n{}", "x".repeat(33));
        // RFC 9112 §6.3: an invalid or conflicting length is a 400, never a guess.
        for bad in ["+33", "-1", "33 33", "33,33", "0x21", "", "3 3"] {
            let request = with(&format!("Content-Length: {bad}\r\n"));
            let error = parse(request.as_bytes()).unwrap_err();
            assert_eq!(
                error,
                HttpError::BadContentLength(bad.trim().into()),
                "{bad:?}"
            );
            assert_eq!(error.status(), 400);
        }
        for (first, second) in [(10, 33), (33, 10)] {
            let request = with(&format!(
                "Content-Length: {first}\r\nContent-Length: {second}\r\n"
            ));
            assert_eq!(
                parse(request.as_bytes()),
                Err(HttpError::ConflictingContentLength(first, second))
            );
        }
        // The same length twice is one length; whitespace around it is the header's.
        let twice = with("Content-Length: 33\r\ncontent-length:  33 \r\n");
        let (request, used) = complete(twice.as_bytes());
        assert_eq!((request.body.len(), used), (33, twice.len()));
        let huge = with("Content-Length: 99999999999999999999999999\r\n");
        assert_eq!(
            parse(huge.as_bytes()),
            Err(HttpError::BodyTooLarge(usize::MAX))
        );
    }
}
