//! The checksummed frame of the layout file (and of any file a VMM frames the same way, such
//! as its own state file): an 8-byte magic, the format version, the payload's length, the
//! payload and its CRC-32, all little-endian. A reader refuses a foreign, truncated, padded or
//! corrupted file before it parses anything.
//!
//! The stream's records ([`crate::stream`]) are checksummed with the same CRC-32 ([`crc32`])
//! but framed differently: a record's header comes before its payload (a reader must know the
//! length before it reads), and its checksum covers the header's kind and length too.

use std::ops::RangeInclusive;

/// The bytes a frame adds to its payload: magic (8), version (4), length (8), CRC-32 (4).
const OVERHEAD: usize = 24;

/// The CRC-32 (IEEE) of `parts` one after the other.
pub(crate) fn crc32<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    for part in parts {
        crc.update(part);
    }
    crc.finalize()
}

/// The little-endian `u32` at `at` of `bytes` (which the caller checked is long enough).
pub(crate) fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut field = [0u8; 4];
    field.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(field)
}

/// The little-endian `u64` at `at` of `bytes` (which the caller checked is long enough).
pub(crate) fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut field = [0u8; 8];
    field.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(field)
}

/// Frames `payload` for a file: the 8-byte `magic`, the format `version` (u32), the payload's
/// length (u64), the payload, and its CRC-32 (all little-endian), so that a reader can refuse a
/// foreign, truncated or corrupted file before it parses anything ([`unframe`]).
pub fn frame(magic: &[u8; 8], version: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + OVERHEAD);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc32([payload]).to_le_bytes());
    out
}

/// The bytes of a frame's header: magic (8), version (4), length (8).
pub const FRAME_HEADER: usize = 20;

/// The whole length of the frame whose first bytes are `header` (at least [`FRAME_HEADER`]
/// of them), or why it is not a frame made with `magic` and `version`: no such magic, or
/// another version. A reader checks a file's header this way before it reads the file whole
/// (and compares the length with the file's size).
pub fn framed_len(magic: &[u8; 8], version: u32, header: &[u8]) -> Result<u64, String> {
    framed_len_versions(magic, version..=version, header).map(|(_, len)| len)
}

/// As [`framed_len`], for a reader of every version in `versions` (a format that changed and
/// whose reader still takes the older files): the version found and the frame's length.
pub fn framed_len_versions(
    magic: &[u8; 8],
    versions: RangeInclusive<u32>,
    header: &[u8],
) -> Result<(u32, u64), String> {
    let name = String::from_utf8_lossy(magic.split(|b| *b == 0).next().unwrap_or(magic));
    if header.len() < FRAME_HEADER || &header[..8] != magic {
        return Err(format!("not a file of this kind (no {name} magic)"));
    }
    let found = le_u32(header, 8);
    if !versions.contains(&found) {
        let (oldest, newest) = (versions.start(), versions.end());
        return Err(if oldest == newest {
            format!("format version {found}; this build reads version {newest}")
        } else {
            format!("format version {found}; this build reads versions {oldest} to {newest}")
        });
    }
    let len = le_u64(header, 12);
    let len = len.checked_add(OVERHEAD as u64).ok_or_else(|| {
        format!("its header announces {len} bytes of content, more than a file holds")
    })?;
    Ok((found, len))
}

/// The payload of a file [`frame`] made with `magic` and `version`, or why it is not one: no
/// such magic, another version, a length that does not match the file's (truncated or
/// padded), or a checksum that does not match (corrupted).
pub fn unframe<'a>(magic: &[u8; 8], version: u32, bytes: &'a [u8]) -> Result<&'a [u8], String> {
    unframe_versions(magic, version..=version, bytes).map(|(_, payload)| payload)
}

/// As [`unframe`], for a reader of every version in `versions`: the version found and the
/// payload.
pub fn unframe_versions<'a>(
    magic: &[u8; 8],
    versions: RangeInclusive<u32>,
    bytes: &'a [u8],
) -> Result<(u32, &'a [u8]), String> {
    let (version, total) = framed_len_versions(magic, versions, bytes)?;
    let end = usize::try_from(total)
        .ok()
        .filter(|total| *total == bytes.len())
        .ok_or_else(|| {
            format!(
                "{} bytes, but its header announces {} bytes of content (truncated or padded)",
                bytes.len(),
                total - OVERHEAD as u64
            )
        })?;
    let payload = &bytes[20..end - 4];
    let stored = le_u32(bytes, end - 4);
    let computed = crc32([payload]);
    if stored != computed {
        return Err(format!(
            "checksum {computed:#010x} does not match the stored {stored:#010x} (corrupted)"
        ));
    }
    Ok((version, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_round_trips_and_names_what_is_wrong() {
        let framed = frame(b"TESTMAG\0", 3, b"payload");
        assert_eq!(framed.len(), 7 + OVERHEAD);
        assert_eq!(unframe(b"TESTMAG\0", 3, &framed), Ok(&b"payload"[..]));
        let refuse = |bytes: &[u8]| unframe(b"TESTMAG\0", 3, bytes).unwrap_err();
        assert!(refuse(&framed[..10]).contains("no TESTMAG magic"));
        assert!(unframe(b"OTHERMG\0", 3, &framed)
            .unwrap_err()
            .contains("no OTHERMG magic"));
        assert!(unframe(b"TESTMAG\0", 4, &framed)
            .unwrap_err()
            .contains("format version 3; this build reads version 4"));
        assert!(refuse(&framed[..framed.len() - 1]).contains("truncated or padded"));
        let mut corrupted = framed.clone();
        corrupted[21] ^= 1;
        assert!(refuse(&corrupted).contains("checksum"));
        // The header alone says how long the frame is, or what is wrong with it.
        assert_eq!(
            framed_len(b"TESTMAG\0", 3, &framed[..FRAME_HEADER]),
            Ok(framed.len() as u64)
        );
        assert!(framed_len(b"TESTMAG\0", 4, &framed[..FRAME_HEADER])
            .unwrap_err()
            .contains("format version 3; this build reads version 4"));
        // A reader of several versions takes each and says which it found.
        assert_eq!(
            unframe_versions(b"TESTMAG\0", 2..=3, &framed),
            Ok((3, &b"payload"[..]))
        );
        assert_eq!(
            framed_len_versions(b"TESTMAG\0", 3..=5, &framed[..FRAME_HEADER]),
            Ok((3, framed.len() as u64))
        );
        assert!(unframe_versions(b"TESTMAG\0", 4..=5, &framed)
            .unwrap_err()
            .contains("format version 3; this build reads versions 4 to 5"));
        assert!(framed_len(b"TESTMAG\0", 3, &framed[..FRAME_HEADER - 1])
            .unwrap_err()
            .contains("no TESTMAG magic"));
        let mut huge = framed[..FRAME_HEADER].to_vec();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(framed_len(b"TESTMAG\0", 3, &huge)
            .unwrap_err()
            .contains("more than a file holds"));
        // An empty payload is a frame too.
        assert_eq!(
            unframe(b"TESTMAG\0", 1, &frame(b"TESTMAG\0", 1, b"")),
            Ok(&b""[..])
        );
    }

    #[test]
    fn crc32_of_parts_is_the_crc32_of_their_concatenation() {
        assert_eq!(crc32([&b"ab"[..], b"", b"cd"]), crc32fast::hash(b"abcd"));
        assert_eq!(le_u32(&[0, 1, 0, 0, 0], 1), 1);
        assert_eq!(le_u64(&[2, 0, 0, 0, 0, 0, 0, 0], 0), 2);
    }
}
