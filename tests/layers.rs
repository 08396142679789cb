//! The library's layers (docs/DESIGN.md, "Layers"), checked from its source:
//! no file imports a layer it may not use, and no files import each other in
//! a circle. Test code (`#[cfg(test)] mod tests`, `*tests.rs`) may reach
//! anywhere: a unit test of the processor may run it over the test kit.
//!
//! Module privacy is what the compiler enforces (the layers are private
//! modules; the public API is what `lib.rs` re-exports); this test holds the
//! direction of the arrows, which one crate cannot express.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each layer (a folder, or a file, under `src/`) and the layers it may use.
/// `lib.rs` is the crate's front, re-exporting from every layer.
const LAYERS: &[(&str, &[&str])] = &[
    ("protocol", &[]),
    ("aws", &["protocol"]),
    ("testkit", &["protocol"]),
    ("runtime", &["protocol"]),
    ("app", &["protocol", "aws", "runtime"]),
    ("settings", &["protocol", "aws", "runtime", "app"]),
    ("env", &["protocol", "aws", "runtime", "app", "settings"]),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, as paths relative to `src/`.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(src()).expect("under src").to_path_buf());
        }
    }
}

/// The file's code without comments and without its test module.
fn production_code(text: &str) -> String {
    let mut code = String::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .get(i + 1)
                .is_some_and(|n| n.trim_start().starts_with("mod tests"))
        {
            break;
        }
        let line = line.split("//").next().unwrap_or("");
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// The module paths a piece of code names under `crate::`, with use-trees
/// (`use crate::{a::b, c::{d, e}}`) expanded.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        let (tree, used) = use_tree(after);
        for p in tree {
            paths.push(p);
        }
        rest = &after[used..];
    }
    paths
}

/// Parses one use-tree (`a::b`, `a::{b, c::d}`, `{a, b}`) into its paths,
/// and how many bytes it took.
fn use_tree(text: &str) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    let mut i = 0;
    let bytes = text.as_bytes();
    loop {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        if i > start {
            prefix.push(text[start..i].to_owned());
        }
        if text[i..].starts_with("::{") || text[i..].starts_with('{') {
            i += if text[i..].starts_with('{') { 1 } else { 3 };
            let mut out = Vec::new();
            loop {
                let skip = text[i..].len() - text[i..].trim_start().len();
                i += skip;
                if text[i..].starts_with('}') {
                    return (out, i + 1);
                }
                let (inner, used) = use_tree(&text[i..]);
                out.extend(inner.into_iter().map(|p| [prefix.clone(), p].concat()));
                i += used;
                let skip = text[i..].len() - text[i..].trim_start().len();
                i += skip;
                if text[i..].starts_with(',') {
                    i += 1;
                }
            }
        }
        if text[i..].starts_with("::") {
            i += 2;
            continue;
        }
        return (vec![prefix], i);
    }
}

/// The file (relative to `src/`) that a module path names, by its longest
/// prefix that is a module file; names re-exported by `lib.rs` resolve to
/// where they come from.
fn file_of(path: &[String], reexports: &BTreeMap<String, Vec<String>>) -> Option<PathBuf> {
    let path: Vec<String> = match path.first().and_then(|first| reexports.get(first)) {
        Some(real) => [real.clone(), path[1..].to_vec()].concat(),
        None => path.to_vec(),
    };
    (1..=path.len()).rev().find_map(|n| {
        let dir: PathBuf = path[..n].iter().collect();
        let file = dir.with_extension("rs");
        let module = dir.join("mod.rs");
        [file, module].into_iter().find(|f| src().join(f).is_file())
    })
}

/// What `lib.rs` re-exports: the name, and the path it comes from.
fn reexports() -> BTreeMap<String, Vec<String>> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).expect("lib.rs");
    let code = production_code(&lib);
    let mut out = BTreeMap::new();
    for statement in code.split(';') {
        let Some(at) = statement.find("pub use ") else {
            continue;
        };
        let (paths, _) = use_tree(&statement[at + "pub use ".len()..]);
        for p in paths {
            if let Some(name) = p.last() {
                out.insert(name.clone(), p.clone());
            }
        }
    }
    out
}

/// The layer a file (relative to `src/`) belongs to.
fn layer_of(file: &Path) -> Option<&'static str> {
    let first = file.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    LAYERS.iter().map(|(l, _)| *l).find(|l| *l == name)
}

/// Each file's production imports, as files.
fn imports() -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let reexports = reexports();
    let mut all = Vec::new();
    files(&src(), &mut all);
    let mut graph = BTreeMap::new();
    for file in all {
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with("tests.rs") || name == "lib.rs" {
            continue;
        }
        let text = std::fs::read_to_string(src().join(&file)).expect("readable");
        let targets = crate_paths(&production_code(&text))
            .iter()
            .filter_map(|p| file_of(p, &reexports))
            .filter(|t| *t != file && t.as_os_str() != "lib.rs")
            .collect();
        graph.insert(file, targets);
    }
    graph
}

#[test]
fn no_file_imports_a_layer_above_its_own() {
    let mut wrong = Vec::new();
    for (file, targets) in imports() {
        let Some(layer) = layer_of(&file) else {
            wrong.push(format!("{}: in no layer", file.display()));
            continue;
        };
        let allowed = LAYERS.iter().find(|(l, _)| *l == layer).map(|(_, a)| *a);
        for target in targets {
            let Some(to) = layer_of(&target) else {
                continue;
            };
            if to != layer && !allowed.is_some_and(|a| a.contains(&to)) {
                wrong.push(format!(
                    "{} ({layer}) imports {} ({to})",
                    file.display(),
                    target.display()
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_files_import_each_other_in_a_circle() {
    let graph = imports();
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for start in graph.keys() {
        let mut stack = vec![start.clone()];
        circle_from(&graph, &mut stack, &mut done, &mut circles);
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// Depth-first from the last file on `stack`; a file met again on the stack
/// closes a circle.
fn circle_from(
    graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    stack: &mut Vec<PathBuf>,
    done: &mut BTreeSet<PathBuf>,
    circles: &mut Vec<String>,
) {
    let here = stack.last().expect("non-empty").clone();
    if done.contains(&here) {
        return;
    }
    for next in graph.get(&here).into_iter().flatten() {
        if let Some(at) = stack.iter().position(|f| f == next) {
            let names: Vec<String> = stack[at..]
                .iter()
                .map(|f| f.display().to_string())
                .collect();
            circles.push(format!("{} -> {}", names.join(" -> "), next.display()));
            continue;
        }
        stack.push(next.clone());
        circle_from(graph, stack, done, circles);
        stack.pop();
    }
    done.insert(here);
}

#[test]
fn the_checker_sees_an_import_and_a_circle() {
    let code = production_code(
        "use crate::protocol::{store::Record, key::{a, b}};\n// crate::aws::x\nfn f() { crate::runtime::lanes::split(); }\n#[cfg(test)]\nmod tests { use crate::testkit::X; }\n",
    );
    let paths: Vec<String> = crate_paths(&code).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "protocol::store::Record",
            "protocol::key::a",
            "protocol::key::b",
            "runtime::lanes::split"
        ]
    );
    let mut graph = BTreeMap::new();
    graph.insert(
        PathBuf::from("a.rs"),
        BTreeSet::from([PathBuf::from("b.rs")]),
    );
    graph.insert(
        PathBuf::from("b.rs"),
        BTreeSet::from([PathBuf::from("a.rs")]),
    );
    let (mut done, mut circles) = (BTreeSet::new(), Vec::new());
    circle_from(
        &graph,
        &mut vec![PathBuf::from("a.rs")],
        &mut done,
        &mut circles,
    );
    assert_eq!(circles, ["a.rs -> b.rs -> a.rs"]);
}
