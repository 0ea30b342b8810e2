//! Every package of the workspace is named as `.ci/crate-names` lists it:
//! a name someone checked is free on crates.io, and none of the names known
//! to be taken (the block index was first called `kv-index`, which another
//! project publishes). Reads the manifests and the list only: no network.

use std::collections::BTreeSet;
use std::path::Path;

/// The `name` of a manifest's `[package]` table.
fn package_name(manifest: &Path) -> String {
    let text = std::fs::read_to_string(manifest)
        .unwrap_or_else(|e| panic!("reading {}: {e}", manifest.display()));
    let table: toml::Table = text
        .parse()
        .unwrap_or_else(|e| panic!("parsing {}: {e}", manifest.display()));
    table["package"]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("{} has no package name", manifest.display()))
        .to_owned()
}

/// (publishable, taken) names of `.ci/crate-names`.
fn listed(root: &Path) -> (BTreeSet<String>, BTreeSet<String>) {
    let text = std::fs::read_to_string(root.join(".ci/crate-names")).expect(".ci/crate-names");
    let (mut free, mut taken) = (BTreeSet::new(), BTreeSet::new());
    let mut in_taken = false;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line == "[taken]" {
            in_taken = true;
            continue;
        }
        let set = if in_taken { &mut taken } else { &mut free };
        set.insert(line.to_owned());
    }
    (free, taken)
}

#[test]
fn every_package_is_named_as_the_publishable_list_says() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut names = vec![package_name(&root.join("Cargo.toml"))];
    let mut crates: Vec<_> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .map(|entry| entry.expect("crates/ entry").path())
        .filter(|dir| dir.join("Cargo.toml").is_file())
        .collect();
    crates.sort();
    assert!(
        crates.len() >= 11,
        "expected the library crates under crates/"
    );
    names.extend(
        crates
            .iter()
            .map(|dir| package_name(&dir.join("Cargo.toml"))),
    );

    let (free, taken) = listed(root);
    assert!(
        free.is_disjoint(&taken),
        "a name is listed both free and taken"
    );
    for name in &names {
        assert!(
            !taken.contains(name),
            "package `{name}` has a name another project publishes on crates.io"
        );
        assert!(
            free.contains(name),
            "package `{name}` is not in .ci/crate-names: check the name is free on crates.io and list it"
        );
    }
}
