//! Each library crate's README says how to depend on it, by path from a checkout and by git,
//! with the folder and the package names the workspace really has, and no made-up URL.

use std::path::Path;

#[test]
fn every_crate_readme_says_how_to_depend_on_it() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    let mut checked = 0;
    for entry in std::fs::read_dir(&crates).expect("crates/") {
        let dir = entry.expect("an entry").path();
        let Ok(readme) = std::fs::read_to_string(dir.join("README.md")) else {
            continue;
        };
        let name = dir.file_name().and_then(|n| n.to_str()).expect("a name");
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("a manifest");
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "crates/{name} holds another package"
        );
        let by_path = format!("{name} = {{ path = \"../CHECKOUT/crates/{name}\"");
        let by_git = format!("{name} = {{ git = \"ORIGIN-URL\", rev = \"COMMIT\" }}");
        assert!(
            readme.contains(&by_path) && readme.contains(&by_git),
            "crates/{name}/README.md: no path or git dependency on {name}:\n{readme}"
        );
        assert!(
            readme.contains("git remote get-url origin"),
            "crates/{name}/README.md does not say where ORIGIN-URL comes from"
        );
        assert!(!readme.contains("URL-of-this-repository"), "crates/{name}");
        checked += 1;
    }
    assert!(checked >= 4, "{checked} READMEs");
}
