//! A crate's sources as `syn` reads them: where each file sits, which files and items are
//! test code, and what the names at the crate root stand for.
use super::extract::{resolve, How, Written};
use anyhow::{Context, Result};
use proc_macro2::Span;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::{Attribute, Item, Meta, UseTree};

/// The pseudo-module standing for the crate root's own items (`lib.rs`): a child's
/// `use super::*`, a `crate::f` naming a function defined in `lib.rs`.
pub const ROOT: &str = "lib";

/// Where a file sits in its crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// `src/lib.rs`: its own items are the pseudo-module [`ROOT`].
    Root,
    /// A program's file (`src/main.rs`: "main"; anything under `src/bin/`: "bin"). A program is
    /// a crate of its own: it reaches the library by the library's name, never by `crate::`.
    Program(&'static str),
    /// A module's file, by its path from the crate root (`a/mod.rs` → [a], `a/b.rs` → [a, b]).
    Module(Vec<String>),
}

impl Place {
    /// The top-level module (or pseudo-module) the file belongs to.
    pub fn top(&self) -> &str {
        match self {
            Place::Root => ROOT,
            Place::Program(p) => p,
            Place::Module(m) => m.first().map(String::as_str).unwrap_or(ROOT),
        }
    }

    /// The module path `self` and `super` start from.
    pub fn module(&self) -> Vec<String> {
        match self {
            Place::Module(m) => m.clone(),
            Place::Root | Place::Program(_) => Vec::new(),
        }
    }
}

pub struct SourceFile {
    /// The path from the crate's `src`, for messages.
    pub rel: String,
    pub place: Place,
    pub ast: syn::File,
}

/// A crate's sources outside test code, and what its root's names stand for.
pub struct Tree {
    pub files: Vec<SourceFile>,
    pub root: RootNames,
}

/// The names at the crate root: a declared module stands for itself, a re-export (`pub use
/// maps::Profile`, `pub use restart::*`, `pub use stepguard_kernel as kernel`) for the module
/// it comes from, an item of `lib.rs` itself for [`ROOT`]. A name it does not know (or a tree
/// without `lib.rs`) is taken for a module of that name.
#[derive(Default)]
pub struct RootNames {
    names: BTreeMap<String, String>,
    /// Modules `lib.rs` declares (outside tests).
    pub declared: BTreeSet<String>,
    /// Top-level modules found on disk.
    on_disk: BTreeSet<String>,
}

impl RootNames {
    /// What `crate::name` stands for.
    pub fn target(&self, name: &str) -> String {
        self.names
            .get(name)
            .cloned()
            .unwrap_or_else(|| name.to_string())
    }

    /// Whether the root binds `name` to a module (declared, or re-exported from elsewhere).
    pub fn is_module(&self, name: &str) -> bool {
        self.names.get(name).is_some_and(|t| t != ROOT)
    }

    /// Whether a path written without `crate::` (`sys::f()` in `lib.rs`, or in a module that
    /// glob-imports the root) starts at the crate root. A module's name alone is no value or
    /// type, so a path of one segment counts only if it names a re-exported item.
    pub fn bare(&self, first: &str, len: usize) -> bool {
        match self.names.get(first) {
            Some(t) if t == ROOT => false,
            Some(t) => len >= 2 || t != first,
            None => len >= 2 && self.on_disk.contains(first),
        }
    }
}

pub fn line(span: Span) -> usize {
    span.start().line
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

fn place(rel: &Path) -> Place {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    match parts.first().map(String::as_str) {
        Some("lib") if parts.len() == 1 => return Place::Root,
        Some("main") if parts.len() == 1 => return Place::Program("main"),
        Some("bin") if parts.len() > 1 => return Place::Program("bin"),
        _ => {}
    }
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Place::Module(parts)
}

pub fn parse(file: &Path) -> Result<syn::File> {
    let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    syn::parse_file(&text).map_err(|e| {
        anyhow::anyhow!(
            "{}:{}: not Rust that syn reads: {e}",
            file.display(),
            line(e.span())
        )
    })
}

/// Whether attributes mark test code: `#[cfg(test)]` (or `cfg(all(test, ..))`), `#[test]`,
/// or a runtime's test attribute (`#[tokio::test]`).
pub fn is_test(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        let p = a.path();
        if p.is_ident("cfg") {
            return match a.parse_args::<Meta>() {
                Ok(Meta::Path(p)) => p.is_ident("test"),
                Ok(Meta::List(l)) if l.path.is_ident("all") => l
                    .parse_args_with(
                        syn::punctuated::Punctuated::<Meta, syn::Token![,]>::parse_terminated,
                    )
                    .is_ok_and(|ms| ms.iter().any(|m| m.path().is_ident("test"))),
                _ => false,
            };
        }
        p.segments.last().is_some_and(|s| s.ident == "test")
    })
}

pub fn item_attrs(i: &Item) -> &[Attribute] {
    match i {
        Item::Const(x) => &x.attrs,
        Item::Enum(x) => &x.attrs,
        Item::ExternCrate(x) => &x.attrs,
        Item::Fn(x) => &x.attrs,
        Item::ForeignMod(x) => &x.attrs,
        Item::Impl(x) => &x.attrs,
        Item::Macro(x) => &x.attrs,
        Item::Mod(x) => &x.attrs,
        Item::Static(x) => &x.attrs,
        Item::Struct(x) => &x.attrs,
        Item::Trait(x) => &x.attrs,
        Item::TraitAlias(x) => &x.attrs,
        Item::Type(x) => &x.attrs,
        Item::Union(x) => &x.attrs,
        Item::Use(x) => &x.attrs,
        _ => &[],
    }
}

/// The name an item other than a `use` defines in its module, if any.
fn item_name(i: &Item) -> Option<String> {
    let id = match i {
        Item::Const(x) => &x.ident,
        Item::Enum(x) => &x.ident,
        Item::Fn(x) => &x.sig.ident,
        Item::Mod(x) => &x.ident,
        Item::Static(x) => &x.ident,
        Item::Struct(x) => &x.ident,
        Item::Trait(x) => &x.ident,
        Item::TraitAlias(x) => &x.ident,
        Item::Type(x) => &x.ident,
        Item::Union(x) => &x.ident,
        Item::Macro(x) => x.ident.as_ref()?,
        _ => return None,
    };
    Some(id.to_string())
}

fn is_pub(i: &Item) -> bool {
    let vis = match i {
        Item::Const(x) => &x.vis,
        Item::Enum(x) => &x.vis,
        Item::Fn(x) => &x.vis,
        Item::Mod(x) => &x.vis,
        Item::Static(x) => &x.vis,
        Item::Struct(x) => &x.vis,
        Item::Trait(x) => &x.vis,
        Item::TraitAlias(x) => &x.vis,
        Item::Type(x) => &x.vis,
        Item::Union(x) => &x.vis,
        Item::Use(x) => &x.vis,
        _ => return false,
    };
    !matches!(vis, syn::Visibility::Inherited)
}

/// A leaf of a `use` tree: the path to it and the name it binds (its rename, if any).
pub struct Leaf {
    pub segs: Vec<String>,
    pub lines: Vec<usize>,
    pub rename: Option<String>,
}

impl Leaf {
    /// The name the leaf binds in its module (`a::b` → b, `a::{self}` → a, `a as c` → c).
    fn binds(&self) -> Option<String> {
        if let Some(r) = &self.rename {
            return Some(r.clone());
        }
        match self.segs.as_slice() {
            [.., s] if s == "*" => None,
            [.., a, s] if s == "self" => Some(a.clone()),
            [.., s] => Some(s.clone()),
            [] => None,
        }
    }
}

pub fn leaves(tree: &UseTree) -> Vec<Leaf> {
    fn walk(t: &UseTree, prefix: &mut Vec<(String, usize)>, out: &mut Vec<Leaf>) {
        let mut leaf = |last: (String, usize), rename: Option<String>| {
            let all = prefix.iter().cloned().chain([last]);
            let (segs, lines) = all.unzip();
            out.push(Leaf {
                segs,
                lines,
                rename,
            });
        };
        match t {
            UseTree::Path(p) => {
                prefix.push((p.ident.to_string(), line(p.ident.span())));
                walk(&p.tree, prefix, out);
                prefix.pop();
            }
            UseTree::Name(n) => leaf((n.ident.to_string(), line(n.ident.span())), None),
            UseTree::Rename(r) => leaf(
                (r.ident.to_string(), line(r.ident.span())),
                Some(r.rename.to_string()),
            ),
            UseTree::Glob(g) => leaf(("*".to_string(), line(g.star_token.spans[0])), None),
            UseTree::Group(g) => {
                for t in &g.items {
                    walk(t, prefix, out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(tree, &mut Vec::new(), &mut out);
    out
}

/// The modules declared `#[cfg(test)] mod x` (inline or in a file of their own), as module
/// paths: every file under one is test code.
fn test_modules(scope: &mut Vec<String>, items: &[Item], out: &mut BTreeSet<Vec<String>>) {
    for it in items {
        let Item::Mod(m) = it else { continue };
        scope.push(m.ident.to_string());
        if is_test(&m.attrs) {
            out.insert(scope.clone());
        } else if let Some((_, inner)) = &m.content {
            test_modules(scope, inner, out);
        }
        scope.pop();
    }
}

impl Tree {
    /// Reads every `.rs` file under `src` and drops the test files.
    pub fn read(src: &Path, externs: &[(&str, &str)]) -> Result<Tree> {
        let mut paths = Vec::new();
        rust_files(src, &mut paths)?;
        paths.sort();
        let mut all = Vec::new();
        for p in paths {
            let rel = p.strip_prefix(src).unwrap_or(&p);
            all.push(SourceFile {
                rel: rel.display().to_string(),
                place: place(rel),
                ast: parse(&p)?,
            });
        }
        let mut tests = BTreeSet::new();
        for f in &all {
            test_modules(&mut f.place.module(), &f.ast.items, &mut tests);
        }
        let files: Vec<SourceFile> = all
            .into_iter()
            .filter(|f| match &f.place {
                Place::Module(m) => !tests.iter().any(|t| m.starts_with(t)),
                _ => true,
            })
            .collect();
        let root = root_names(&files, externs);
        Ok(Tree { files, root })
    }
}

fn root_names(files: &[SourceFile], externs: &[(&str, &str)]) -> RootNames {
    let mut r = RootNames::default();
    for f in files {
        if let Place::Module(m) = &f.place {
            r.on_disk.extend(m.first().cloned());
        }
    }
    let Some(lib) = files.iter().find(|f| f.place == Place::Root) else {
        return r;
    };
    let items: Vec<&Item> = lib
        .ast
        .items
        .iter()
        .filter(|i| !is_test(item_attrs(i)))
        .collect();
    for i in &items {
        if let Item::Mod(m) = i {
            r.declared.insert(m.ident.to_string());
            r.names.insert(m.ident.to_string(), m.ident.to_string());
        }
    }
    // What `lib.rs`'s own `use`s bind, resolved against the modules alone.
    let mut globs = Vec::new();
    let mut bound = Vec::new();
    for i in &items {
        let Item::Use(u) = i else { continue };
        for leaf in leaves(&u.tree) {
            let w = Written {
                segs: leaf.segs.clone(),
                lines: leaf.lines.clone(),
                leading: u.leading_colon.is_some(),
                scope: Vec::new(),
                how: How::Use,
            };
            match leaf.binds() {
                None => globs.push(w),
                Some(name) => bound.push((name, w)),
            }
        }
    }
    let target_of =
        |r: &RootNames, w: &Written| resolve(w, r, externs, "", true, false).map(|(t, _)| t);
    // Items of lib.rs itself, then explicit re-exports; glob re-exports fill in the rest.
    let mut names = BTreeMap::new();
    for i in &items {
        if let Some(n) = item_name(i).filter(|_| !matches!(i, Item::Mod(_))) {
            names.insert(n, ROOT.to_string());
        }
    }
    for (name, w) in &bound {
        let t = target_of(&r, w).unwrap_or_else(|| ROOT.to_string());
        names.insert(name.clone(), t);
    }
    for w in &globs {
        let Some(m) = target_of(&r, w).filter(|m| m != ROOT) else {
            continue;
        };
        let Some(file) = files
            .iter()
            .find(|f| f.place == Place::Module(vec![m.clone()]))
        else {
            continue;
        };
        for i in file
            .ast
            .items
            .iter()
            .filter(|i| is_pub(i) && !is_test(item_attrs(i)))
        {
            let mut bound: Vec<String> = item_name(i).into_iter().collect();
            if let Item::Use(u) = i {
                bound.extend(leaves(&u.tree).iter().filter_map(Leaf::binds));
            }
            for n in bound {
                r.names.entry(n).or_insert_with(|| m.clone());
            }
        }
    }
    for (n, t) in names {
        r.names.insert(n, t);
    }
    r
}
