//! Files of the tests: a new scratch file, and the memfds a process maps (its
//! `/proc/PID/maps`).

use std::fs::File;
use std::path::Path;

/// A new, empty file at `path`, open for reading and writing (a file a run left there is
/// removed first).
pub fn new_file_at(path: &Path) -> File {
    let _ = std::fs::remove_file(path);
    File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .expect("a new file")
}

/// The memfd (device and inode, as `/proc/PID/maps` names it) mapped at host address `hva`
/// in process `pid` (`self`: this one), if a memfd is mapped there.
pub fn memfd_at(pid: &str, hva: u64) -> Option<String> {
    maps(pid).lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (from, to) = fields[0].split_once('-').expect("from-to");
        let from = u64::from_str_radix(from, 16).expect("hex");
        let to = u64::from_str_radix(to, 16).expect("hex");
        let memfd = fields
            .get(5)
            .is_some_and(|name| name.starts_with("/memfd:"));
        (memfd && from <= hva && hva < to).then(|| format!("{} {}", fields[3], fields[4]))
    })
}

/// Whether process `pid` (`self`: this one) maps the memfd `memfd` (as [`memfd_at`] names it)
/// anywhere.
pub fn maps_memfd(pid: &str, memfd: &str) -> bool {
    maps(pid).lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() > 5 && format!("{} {}", fields[3], fields[4]) == memfd
    })
}

fn maps(pid: &str) -> String {
    let path = format!("/proc/{pid}/maps");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}
