//! Every path a crate's code outside tests writes — `use` trees flattened, paths in
//! expressions, types, patterns, bounds and impl headers, attributes, and `a::b` sequences in
//! macro bodies (which `syn` leaves as tokens) — and the module each names.
use super::source::{is_test, item_attrs, leaves, line, Place, RootNames, Tree, ROOT};
use super::Crate;
use proc_macro2::{TokenStream, TokenTree};
use std::collections::BTreeSet;
use syn::visit::{self, Visit};
use syn::{Attribute, ImplItem, Item, Meta, Stmt, TraitItem};

/// One path as written, flattened out of its `use` tree: its segments (`*` for a glob) and
/// the line of each.
#[derive(Debug, Clone)]
pub struct Written {
    pub segs: Vec<String>,
    pub lines: Vec<usize>,
    /// Written `::a::b` (an external crate, never one of ours).
    pub leading: bool,
    /// The module it is written in: the file's module and any inline `mod`s around it.
    pub scope: Vec<String>,
    pub how: How,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// A leaf of a `use` tree.
    Use,
    /// A path in code (expression, type, pattern, bound, impl header, attribute name).
    Path,
    /// An `a::b` sequence in a macro's tokens.
    Macro,
    /// A method's name (`x.unix_now()`): no path, but a pure module may not name it either.
    Method,
}

impl Written {
    pub fn joined(&self) -> String {
        self.segs.join("::")
    }
}

/// One reference from a file to a top-level module (or pseudo-module) of its crate.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Import {
    pub file: String,
    pub line: usize,
    pub from: String,
    pub to: String,
    pub path: String,
}

/// Collects the paths of one file's code outside tests.
struct Collect {
    scope: Vec<String>,
    out: Vec<Written>,
}

impl Collect {
    fn path(&mut self, p: &syn::Path, how: How) {
        self.out.push(Written {
            segs: p.segments.iter().map(|s| s.ident.to_string()).collect(),
            lines: p.segments.iter().map(|s| line(s.ident.span())).collect(),
            leading: p.leading_colon.is_some(),
            scope: self.scope.clone(),
            how,
        });
    }

    /// Every `a::b::c` sequence in a macro's tokens (groups included).
    fn tokens(&mut self, ts: TokenStream) {
        let toks: Vec<TokenTree> = ts.into_iter().collect();
        let sep = |j: usize| {
            matches!(toks.get(j), Some(TokenTree::Punct(p)) if p.as_char() == ':' && p.spacing() == proc_macro2::Spacing::Joint)
                && matches!(toks.get(j + 1), Some(TokenTree::Punct(p)) if p.as_char() == ':')
        };
        let mut i = 0;
        while i < toks.len() {
            match &toks[i] {
                TokenTree::Group(g) => {
                    self.tokens(g.stream());
                    i += 1;
                }
                TokenTree::Ident(id) => {
                    let leading = i >= 2 && sep(i - 2);
                    let mut segs = vec![id.to_string()];
                    let mut lines = vec![line(id.span())];
                    let mut j = i + 1;
                    while sep(j) {
                        let Some(TokenTree::Ident(next)) = toks.get(j + 2) else {
                            break;
                        };
                        segs.push(next.to_string());
                        lines.push(line(next.span()));
                        j += 3;
                    }
                    self.out.push(Written {
                        segs,
                        lines,
                        leading,
                        scope: self.scope.clone(),
                        how: How::Macro,
                    });
                    i = j;
                }
                _ => i += 1,
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collect {
    fn visit_item(&mut self, i: &'ast Item) {
        if !is_test(item_attrs(i)) {
            visit::visit_item(self, i);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if let Some((_, items)) = &m.content {
            self.scope.push(m.ident.to_string());
            for i in items {
                self.visit_item(i);
            }
            self.scope.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        for leaf in leaves(&u.tree) {
            self.out.push(Written {
                segs: leaf.segs,
                lines: leaf.lines,
                leading: u.leading_colon.is_some(),
                scope: self.scope.clone(),
                how: How::Use,
            });
        }
    }

    fn visit_impl_item(&mut self, i: &'ast ImplItem) {
        let attrs = match i {
            ImplItem::Const(x) => &x.attrs,
            ImplItem::Fn(x) => &x.attrs,
            ImplItem::Type(x) => &x.attrs,
            ImplItem::Macro(x) => &x.attrs,
            _ => return visit::visit_impl_item(self, i),
        };
        if !is_test(attrs) {
            visit::visit_impl_item(self, i);
        }
    }

    fn visit_trait_item(&mut self, i: &'ast TraitItem) {
        let attrs = match i {
            TraitItem::Const(x) => &x.attrs,
            TraitItem::Fn(x) => &x.attrs,
            TraitItem::Type(x) => &x.attrs,
            TraitItem::Macro(x) => &x.attrs,
            _ => return visit::visit_trait_item(self, i),
        };
        if !is_test(attrs) {
            visit::visit_trait_item(self, i);
        }
    }

    fn visit_stmt(&mut self, s: &'ast Stmt) {
        let attrs: &[Attribute] = match s {
            Stmt::Local(l) => &l.attrs,
            Stmt::Macro(m) => &m.attrs,
            _ => &[],
        };
        if !is_test(attrs) {
            visit::visit_stmt(self, s);
        }
    }

    fn visit_arm(&mut self, a: &'ast syn::Arm) {
        if !is_test(&a.attrs) {
            visit::visit_arm(self, a);
        }
    }

    fn visit_field(&mut self, f: &'ast syn::Field) {
        if !is_test(&f.attrs) {
            visit::visit_field(self, f);
        }
    }

    fn visit_variant(&mut self, v: &'ast syn::Variant) {
        if !is_test(&v.attrs) {
            visit::visit_variant(self, v);
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.path(p, How::Path);
        visit::visit_path(self, p);
    }

    /// `pub(crate)`, `pub(super)`: no reference to another module.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    /// An attribute's name (`#[tokio::main]`) and the paths in its arguments
    /// (`#[arg(value_parser = crate::duration::parse)]`), read as a macro's tokens.
    fn visit_attribute(&mut self, a: &'ast Attribute) {
        self.path(a.path(), How::Path);
        match &a.meta {
            Meta::Path(_) => {}
            Meta::List(l) => self.tokens(l.tokens.clone()),
            Meta::NameValue(nv) => self.visit_expr(&nv.value),
        }
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        self.out.push(Written {
            segs: vec![m.method.to_string()],
            lines: vec![line(m.method.span())],
            leading: false,
            scope: self.scope.clone(),
            how: How::Method,
        });
        visit::visit_expr_method_call(self, m);
    }
}

/// Every path written in a file's code outside tests.
pub fn written(file: &syn::File, module: Vec<String>) -> Vec<Written> {
    let mut c = Collect {
        scope: module,
        out: Vec::new(),
    };
    c.visit_file(file);
    c.out
}

/// Where a path starting `crate::`, `self::` or `super::` (chains too) begins: the module
/// and the index of its first segment after that prefix. None for any other path, or for a
/// `super` above the crate root.
fn start(segs: &[String], scope: &[String]) -> Option<(Vec<String>, usize)> {
    let (mut base, mut i) = match segs.first()?.as_str() {
        "crate" => (Vec::new(), 1),
        "self" => (scope.to_vec(), 1),
        "super" => (scope.to_vec(), 0),
        _ => return None,
    };
    while segs.get(i).is_some_and(|s| s == "super") {
        base.pop()?;
        i += 1;
    }
    Some((base, i))
}

/// The top-level module (or [`ROOT`]) a path names, and the index of the segment naming it.
/// `externs` maps other crates' names to the module standing for them; `own` is the crate's
/// own name (a program reaches the library by it); `root_scope` says the path is written
/// where the root's names are in scope without `crate::` (`lib.rs`, or a module that
/// glob-imports the root); `program` that it is written in a program, where `crate::`,
/// `self::` and `super::` stay inside the program.
pub fn resolve(
    w: &Written,
    root: &RootNames,
    externs: &[(&str, &str)],
    own: &str,
    root_scope: bool,
    program: bool,
) -> Option<(String, usize)> {
    let first = w.segs.first()?;
    if w.how == How::Method {
        return None;
    }
    if let Some((_, m)) = externs.iter().find(|(k, _)| k == first) {
        return Some((m.to_string(), w.segs.len().min(2) - 1));
    }
    let (base, i) = if !own.is_empty() && first == own {
        (Vec::new(), 1)
    } else if w.leading {
        return None;
    } else if let Some(s) = start(&w.segs, &w.scope) {
        if program {
            return None;
        }
        s
    } else if root_scope && root.bare(first, w.segs.len()) {
        (Vec::new(), 0)
    } else {
        return None;
    };
    if let Some(top) = base.first() {
        return Some((top.clone(), i.saturating_sub(1)));
    }
    match w.segs.get(i).map(String::as_str) {
        None | Some("*") | Some("self") => Some((ROOT.to_string(), i.min(w.segs.len() - 1))),
        Some(name) => Some((root.target(name), i)),
    }
}

/// The module scopes of a file that glob-import the crate root (`use super::*` in a child of
/// `lib.rs`, `use crate::*`), where the root's names are in scope as written.
fn root_globs(ws: &[Written]) -> BTreeSet<Vec<String>> {
    ws.iter()
        .filter(|w| w.how == How::Use && w.segs.last().is_some_and(|s| s == "*"))
        .filter(|w| {
            start(&w.segs, &w.scope).is_some_and(|(b, i)| b.is_empty() && i + 1 == w.segs.len())
        })
        .map(|w| w.scope.clone())
        .collect()
}

/// Every import between top-level modules of `krate` in `tree`: a file's top-level module
/// (or pseudo-module) to another. A pseudo-module (`lib`, `main`, `bin`) its table does not
/// place stands above everything: its imports are not judged.
pub fn imports(krate: &Crate, tree: &Tree) -> Vec<Import> {
    let mut out = Vec::new();
    for f in &tree.files {
        let from = f.place.top().to_string();
        let pseudo = !matches!(f.place, Place::Module(_));
        if pseudo && !krate.places(&from) {
            continue;
        }
        let program = matches!(f.place, Place::Program(_));
        let ws = written(&f.ast, f.place.module());
        let globs = root_globs(&ws);
        // One import per path and line: `use crate::a::{B, C}` imports `a` once.
        let mut seen = BTreeSet::new();
        for w in &ws {
            let root_scope =
                (f.place == Place::Root && w.scope.is_empty()) || globs.contains(&w.scope);
            let Some((to, k)) = resolve(
                w,
                &tree.root,
                krate.externs,
                krate.ident,
                root_scope,
                program,
            ) else {
                continue;
            };
            let path = w.segs[..=k].join("::");
            if to != from && seen.insert((w.lines[k], path.clone())) {
                out.push(Import {
                    file: f.rel.clone(),
                    line: w.lines[k],
                    from: from.clone(),
                    to,
                    path,
                });
            }
        }
    }
    out
}

/// Where the pure modules (`rules`) name what they must not, outside test code: one line each
/// per forbidden path.
pub fn impure_in(tree: &Tree, rules: &[(&str, &[&str])]) -> Vec<String> {
    let mut out = BTreeSet::new();
    for f in &tree.files {
        let Place::Module(module) = &f.place else {
            continue;
        };
        let Some((m, banned)) = rules
            .iter()
            .find(|(m, _)| module.first().map(String::as_str) == Some(*m))
        else {
            continue;
        };
        for w in written(&f.ast, module.clone()) {
            let joined = w.joined();
            for b in banned.iter().filter(|b| joined.contains(**b)) {
                out.insert((f.rel.clone(), w.lines[0], m.to_string(), b.to_string()));
            }
        }
    }
    out.into_iter()
        .map(|(file, line, m, b)| {
            format!("{file}:{line}: `{m}` must stay pure, but names `{b}` (pass the time or the reading in)")
        })
        .collect()
}
