//! State files as files, whatever their format: opened without blocking, refused unless
//! regular, their frame's header checked before they are read whole ([`read_framed`]), and the
//! vCPUs' register blocks checked for their exact sizes ([`check_register_blocks`]).

use std::fs::File;
use std::io::Read;
use std::ops::RangeInclusive;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use kvm_bindings::{
    kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave,
};
use kvm_memslots_persist::{framed_len_versions, FRAME_HEADER};
use serde_json::Value;

/// The largest state file read: a layout of every KVM slot as its own region and the most
/// vCPUs take a few MiB.
const MAX_STATE_FILE: u64 = 64 << 20;

/// Why a state file was refused.
#[derive(Debug, thiserror::Error)]
#[error("invalid snapshot state file: {0}")]
pub struct StateFileError(pub String);

/// Opens `path` to read without blocking (a FIFO with no writer, or a device, cannot hang the
/// caller) and refuses anything but a regular file, saying what it is (the caller names the
/// path).
pub(crate) fn open_input(path: &Path) -> Result<File, String> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let kind = file
        .metadata()
        .map_err(|e| format!("reading its type: {e}"))?
        .file_type();
    let what = if kind.is_file() {
        return Ok(file);
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Err(format!("{what}, not a regular file"))
}

/// Reads the framed state file at `path` whole, its header first: a file that is not a regular
/// file, is empty, has another magic than the one `format` picks from its first bytes or a
/// version outside the versions it gives with it, is over [`MAX_STATE_FILE`] or another size
/// than its header says is refused before it is read whole. The error does not name the
/// path: the caller does.
pub(super) fn read_framed(
    path: &Path,
    format: impl Fn(&[u8]) -> (&'static [u8; 8], RangeInclusive<u32>),
) -> Result<Vec<u8>, StateFileError> {
    let bad = StateFileError;
    let mut file = open_input(path).map_err(bad)?;
    let size = file
        .metadata()
        .map_err(|e| bad(format!("reading its size: {e}")))?
        .len();
    if size == 0 {
        return Err(bad("the file is empty".into()));
    }
    let mut header = [0u8; FRAME_HEADER];
    let got = size.min(FRAME_HEADER as u64) as usize;
    file.read_exact(&mut header[..got])
        .map_err(|e| bad(format!("reading its header: {e}")))?;
    let (magic, versions) = format(&header[..got]);
    let (_, total) = framed_len_versions(magic, versions, &header[..got]).map_err(bad)?;
    if total > MAX_STATE_FILE {
        return Err(bad(format!(
            "its header announces {total} bytes, over the {} MiB a state file may have",
            MAX_STATE_FILE >> 20
        )));
    }
    if total != size {
        return Err(bad(format!(
            "{size} bytes, but its header announces {total} (truncated or padded)"
        )));
    }
    let mut bytes = header[..got].to_vec();
    bytes.resize(total as usize, 0);
    file.read_exact(&mut bytes[got..])
        .map_err(|e| bad(format!("reading it: {e}")))?;
    Ok(bytes)
}

/// Checks that every vCPU's register blocks in `vcpus` (the JSON of `VcpuState`s) have
/// exactly their structure's size: kvm-bindings' deserialiser fills a short one with zeros.
pub(crate) fn check_register_blocks(vcpus: &Value) -> Result<(), String> {
    use std::mem::size_of;
    let Some(vcpus) = vcpus.as_array() else {
        return Ok(()); // Not a list: the typed parse names it.
    };
    let blocks = [
        ("regs", size_of::<kvm_regs>()),
        ("sregs", size_of::<kvm_sregs>()),
        ("xsave", size_of::<kvm_xsave>()),
        ("xcrs", size_of::<kvm_xcrs>()),
        ("events", size_of::<kvm_vcpu_events>()),
        ("lapic", size_of::<kvm_lapic_state>()),
        ("debugregs", size_of::<kvm_debugregs>()),
        ("mp_state", size_of::<kvm_mp_state>()),
    ];
    for (i, vcpu) in vcpus.iter().enumerate() {
        for (name, size) in blocks {
            match vcpu.get(name) {
                Some(Value::Array(bytes)) if bytes.len() != size => {
                    return Err(format!(
                        "vCPU {i}'s {name} has {} bytes; a {name} block has {size}",
                        bytes.len()
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(())
}
