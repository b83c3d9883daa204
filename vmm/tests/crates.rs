//! The workspace's crates as the table at the top of `docs/DESIGN.md` draws them, checked
//! against their `Cargo.toml`s: each row's "depends on" column must name exactly the workspace
//! crates that crate depends on (normal dependencies), so the table cannot promise a layering
//! the manifests do not have, nor miss an edge they add.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("vmm/ is inside the workspace")
        .to_path_buf()
}

/// Crate folder (as the table writes it, `crates/x`, `vmm/` or `vmm/bench/`) → the workspace
/// crates its row names in "depends on".
fn table(design: &str, crates: &BTreeSet<String>) -> BTreeMap<String, BTreeSet<String>> {
    design
        .lines()
        .take_while(|line| !line.starts_with("## "))
        .filter(|line| line.starts_with('|'))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            // | layer | crate | job | depends on |
            let folder = cells.get(2)?.split('`').nth(1)?.trim_end_matches('/');
            if !(folder.starts_with("crates/") || folder == "vmm" || folder.starts_with("vmm/")) {
                return None;
            }
            let named = cells
                .get(4)?
                .split(',')
                .map(|dep| dep.split_whitespace().next().unwrap_or_default().to_owned())
                .filter(|dep| crates.contains(dep))
                .collect();
            Some((folder.to_owned(), named))
        })
        .collect()
}

/// The workspace crates `manifest` depends on in `[dependencies]` (by path).
fn path_dependencies(manifest: &str) -> BTreeSet<String> {
    let mut in_dependencies = false;
    let mut found = BTreeSet::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if in_dependencies && line.contains("path =") {
            if let Some((name, _)) = line.split_once('=') {
                found.insert(name.trim().to_owned());
            }
        }
    }
    found
}

/// The package name a manifest declares.
fn package_name(manifest: &str) -> String {
    manifest
        .lines()
        .find_map(|line| {
            let value = line.trim().strip_prefix("name")?.trim().strip_prefix('=')?;
            Some(value.trim().trim_matches('"').to_owned())
        })
        .expect("a package name")
}

#[test]
fn the_crate_table_matches_the_manifests() {
    let root = workspace();
    let mut folders: Vec<String> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .map(|e| {
            format!(
                "crates/{}",
                e.expect("an entry").file_name().to_string_lossy()
            )
        })
        .collect();
    folders.push("vmm".to_owned());
    folders.push("vmm/bench".to_owned());
    folders.sort();
    let manifests: BTreeMap<String, String> = folders
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(root.join(f).join("Cargo.toml"))
                .unwrap_or_else(|e| panic!("{f}/Cargo.toml: {e}"));
            (f.clone(), text)
        })
        .collect();
    let crates: BTreeSet<String> = manifests.values().map(|m| package_name(m)).collect();
    let design = std::fs::read_to_string(root.join("docs/DESIGN.md")).expect("docs/DESIGN.md");
    let drawn = table(&design, &crates);
    let mut wrong = Vec::new();
    for (folder, manifest) in &manifests {
        let actual = path_dependencies(manifest);
        match drawn.get(folder) {
            None => wrong.push(format!("{folder} has no row in DESIGN.md's crate table")),
            Some(named) if *named != actual => wrong.push(format!(
                "{folder}: the table says it depends on {named:?}, its Cargo.toml on {actual:?}"
            )),
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_check_fails_on_a_row_that_misses_an_edge() {
    let crates = BTreeSet::from(["kvm-memslots".to_owned(), "memslot-map".to_owned()]);
    let design = "| layer | crate | job | depends on |\n|---|---|---|---|\n\
                  | manager | `crates/kvm-memslots` | x | kvm-ioctls, vm-memory |\n";
    let drawn = table(design, &crates);
    let manifest = "[package]\nname = \"kvm-memslots\"\n[dependencies]\n\
                    memslot-map = { path = \"../memslot-map\" }\n[dev-dependencies]\n\
                    kvm-test-support = { path = \"../kvm-test-support\" }\n";
    assert_eq!(
        path_dependencies(manifest),
        BTreeSet::from(["memslot-map".to_owned()])
    );
    assert_ne!(drawn["crates/kvm-memslots"], path_dependencies(manifest));
}
