//! The layers of `vmm/src` as `docs/DESIGN.md` draws them (section 3, the table of folders and
//! what each uses), checked against the code: every `crate::X` path a module of the crate
//! names (in `use crate::…`, `use crate::{…}`, a `crate::X::…` path in code, or a `super::`
//! path that leaves its module) is an edge, and the table must list exactly the edges the code
//! has. A new import of a module the table does not allow fails here (so `control` can never
//! start using `api`, say), and so does a row that promises an edge the code no longer makes:
//! the table cannot drift from the imports. Comments, doc comments and string literals do not
//! count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// An edge between two modules at the top of the crate, and the files that make it.
type Edges = BTreeMap<(String, String), BTreeSet<String>>;

/// The crate's source folder.
fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, by path relative to `root`, with its text.
fn sources(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path
                .strip_prefix(root)
                .expect("under the root")
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            out.push((relative, text));
        }
    }
}

/// The modules `lib.rs` declares at the top of the crate.
fn top_modules(lib: &str) -> BTreeSet<String> {
    strip(lib)
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or(line.strip_prefix("pub(crate) mod "))
                .or(line.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').trim().to_owned())
        })
        .collect()
}

/// `source` without comments, and with string and character literals emptied; lifetimes and
/// line breaks stay.
fn strip(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == 'r'
            && (i == 0 || !ident(chars[i - 1]) || chars[i - 1] == 'b')
            && matches!(next, Some('"' | '#'))
        {
            // A raw string, r"…" or r#"…"#, unless the `#` starts something else (`r#ident`).
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            if chars.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            i += 2 + hashes;
            while i < chars.len() {
                if chars[i] == '"' && chars[i + 1..].iter().take(hashes).all(|&h| h == '#') {
                    i += 1 + hashes;
                    break;
                }
                if chars[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            out.push_str("\"\"");
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if chars.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A character literal; a lifetime (`'a`) has no closing quote right after.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The identifier at the start of `text`, after whitespace.
fn leading_ident(text: &str) -> &str {
    let text = text.trim_start();
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The first names of a `{…}` group's items (`a, b::c, d as e` gives `a`, `b`, `d`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                item_start = true;
                continue;
            }
            _ => {}
        }
        if item_start && depth == 0 && !c.is_whitespace() {
            heads.push(leading_ident(&group[at..]).to_owned());
            item_start = false;
        }
    }
    heads
}

/// The text of the `{…}` group that starts at `text` (which begins with `{`), braces excluded.
fn group(text: &str) -> &str {
    let mut depth = 0;
    for (at, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[1..at];
                }
            }
            _ => {}
        }
    }
    &text[1..]
}

/// The module path of a file under `src` (`jobs/serve.rs` is `jobs::serve`, `jobs/mod.rs` is
/// `jobs`, `lib.rs` the crate itself).
fn module_path(file: &str) -> Vec<String> {
    let mut parts: Vec<String> = file
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The top-level modules that `source` (the file `file`) names, other than its own.
fn uses(file: &str, source: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let code = strip(source);
    let own = module_path(file);
    let mut found = BTreeSet::new();
    let boundary = |at: usize| {
        at == 0
            || !code[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$')
    };
    for (at, _) in code.match_indices("crate::") {
        if !boundary(at) {
            continue;
        }
        let rest = code[at + "crate::".len()..].trim_start();
        if rest.starts_with('{') {
            found.extend(group_heads(group(rest)));
        } else {
            found.insert(leading_ident(rest).to_owned());
        }
    }
    for (at, _) in code.match_indices("super::") {
        if !boundary(at) || code[..at].ends_with("super::") {
            continue;
        }
        let mut rest = &code[at..];
        let mut up = 0;
        while let Some(more) = rest.strip_prefix("super::") {
            up += 1;
            rest = more.trim_start();
        }
        // Only a path that climbs to the crate's root leaves its top-level module.
        if up >= own.len() {
            if rest.starts_with('{') {
                found.extend(group_heads(group(rest)));
            } else {
                found.insert(leading_ident(rest).to_owned());
            }
        }
    }
    let top = own.first().cloned().unwrap_or_default();
    found
        .into_iter()
        .filter(|m| modules.contains(m) && *m != top)
        .collect()
}

/// The edges of the crate whose files are `files` (path under `src`, text).
fn edges(files: &[(String, String)], modules: &BTreeSet<String>) -> Edges {
    let mut edges = Edges::new();
    for (file, text) in files {
        if file == "main.rs" || file == "lib.rs" {
            continue;
        }
        let from = module_path(file)[0].clone();
        for to in uses(file, text, modules) {
            edges
                .entry((from.clone(), to))
                .or_default()
                .insert(file.clone());
        }
    }
    edges
}

/// A module named in the table: `` `vm/` `` or `` `lifecycle.rs` ``.
fn table_module(cell: &str) -> Option<String> {
    let name = cell.strip_prefix('`')?.strip_suffix('`')?;
    let name = name.strip_suffix('/').or(name.strip_suffix(".rs"))?;
    (!name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_'))
        .then(|| name.to_owned())
}

/// The allowed edges, row by row: section 3's table of folders (its first column the module,
/// its last the modules it uses, in backticks; crates outside are plain words).
fn table(design: &str) -> Vec<(String, BTreeSet<String>)> {
    let section = design
        .split("\n## ")
        .find(|s| s.starts_with("3."))
        .expect("DESIGN.md has a section 3");
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in section.lines() {
        let line = line.trim();
        if line.starts_with("| folder |") {
            in_table = true;
            continue;
        }
        if !in_table {
            continue;
        }
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let Some(module) = cells.first().and_then(|c| table_module(c)) else {
            continue;
        };
        let allowed = cells
            .last()
            .expect("a row has cells")
            .split([',', ';', ' '])
            .filter_map(|word| table_module(word.trim()))
            .collect();
        rows.push((module, allowed));
    }
    assert!(
        !rows.is_empty(),
        "no table with a `| folder |` header in DESIGN.md section 3"
    );
    rows
}

/// What is wrong with `edges` against `rows`: an edge they do not list, a listed edge the code
/// does not make, a module they miss or have twice, a module using one in a row below its own.
fn check(
    edges: &Edges,
    rows: &[(String, BTreeSet<String>)],
    modules: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut table = BTreeMap::new();
    for (at, (module, allowed)) in rows.iter().enumerate() {
        if table.insert(module, allowed).is_some() {
            problems.push(format!("DESIGN.md's table has two rows for `{module}`"));
        }
        // Layers: a module uses only modules in rows above its own.
        for used in allowed {
            if !rows[..at].iter().any(|(above, _)| above == used) {
                problems.push(format!(
                    "DESIGN.md's table has `{module}` use `{used}`, which is not in a row above it"
                ));
            }
        }
    }
    for module in modules {
        if !table.contains_key(module) {
            problems.push(format!("module `{module}` has no row in DESIGN.md's table"));
        }
    }
    for module in table.keys() {
        if !modules.contains(*module) {
            problems.push(format!(
                "DESIGN.md's table has a row for `{module}`, which lib.rs does not declare"
            ));
        }
    }
    for ((from, to), files) in edges {
        if !table.get(from).is_some_and(|allowed| allowed.contains(to)) {
            let files: Vec<&str> = files.iter().map(String::as_str).collect();
            problems.push(format!(
                "`{from}` uses `{to}` ({}), which DESIGN.md's table does not allow",
                files.join(", ")
            ));
        }
    }
    for (from, allowed) in rows {
        for to in allowed {
            if !edges.contains_key(&(from.clone(), to.clone())) {
                problems.push(format!(
                    "DESIGN.md's table says `{from}` uses `{to}`, but no file of it does"
                ));
            }
        }
    }
    problems
}

fn crate_sources() -> Vec<(String, String)> {
    let root = src_dir();
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    files
}

fn design() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/DESIGN.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn every_import_between_modules_is_an_edge_of_the_design_table() {
    let files = crate_sources();
    let lib = &files.iter().find(|(f, _)| f == "lib.rs").expect("lib.rs").1;
    let modules = top_modules(lib);
    let edges = edges(&files, &modules);
    let problems = check(&edges, &table(&design()), &modules);
    assert!(
        problems.is_empty(),
        "the imports and DESIGN.md section 3 disagree:\n  {}\n(the edges the code has: {:?})",
        problems.join("\n  "),
        edges.keys().collect::<Vec<_>>()
    );
}

#[test]
fn an_import_the_table_does_not_allow_fails() {
    let modules: BTreeSet<String> = ["api", "control", "vm"].map(String::from).into();
    let rows = table(
        "# D\n\n## 3. The VMM\n\n| folder | what | uses |\n|---|---|---|\n\
         | `vm/` | a VM | kvm-ioctls |\n| `control/` | requests | `vm/` |\n\
         | `api/` | HTTP | `control/`, `vm/` |\n\n## 4. Next\n",
    );
    let files = |control: &str| {
        vec![
            ("vm/mod.rs".to_owned(), "pub fn f() {}".to_owned()),
            ("control/mod.rs".to_owned(), control.to_owned()),
            (
                "api/routes.rs".to_owned(),
                "use crate::{control::Request, vm::{self}};\nfn g() { crate::vm::f() }".to_owned(),
            ),
        ]
    };
    let fine =
        files("use crate::vm::f;\n// crate::api in a comment\nconst S: &str = \"crate::api\";");
    assert_eq!(
        check(&edges(&fine, &modules), &rows, &modules),
        Vec::<String>::new()
    );
    let backwards = files("use crate::vm::f;\nfn h() -> u16 { crate::api::routes::status() }");
    assert_eq!(
        check(&edges(&backwards, &modules), &rows, &modules),
        ["`control` uses `api` (control/mod.rs), which DESIGN.md's table does not allow"]
    );
    let unused = files("fn h() {}");
    assert_eq!(
        check(&edges(&unused, &modules), &rows, &modules),
        ["DESIGN.md's table says `control` uses `vm`, but no file of it does"]
    );
    // Rows out of order are no layers, even when the code keeps to them.
    let upside_down = table(
        "# D\n\n## 3. The VMM\n\n| folder | what | uses |\n|---|---|---|\n\
         | `control/` | requests | `vm/` |\n| `vm/` | a VM | kvm-ioctls |\n\
         | `api/` | HTTP | `control/`, `vm/` |\n",
    );
    assert_eq!(
        check(&edges(&fine, &modules), &upside_down, &modules),
        ["DESIGN.md's table has `control` use `vm`, which is not in a row above it"]
    );
    // A `super::` path that climbs out of its top-level module.
    let climbing = uses(
        "control/hotplug.rs",
        "use super::super::api::routes;\nuse super::Request;",
        &modules,
    );
    assert_eq!(climbing, BTreeSet::from(["api".to_owned()]));
}
