//! What each module's names are: items it defines, names it imports
//! (`use`, `pub use`) and globs, so that a path through a re-export resolves
//! to the file that defines the item, as the compiler resolves it.

use std::collections::{BTreeMap, BTreeSet};

use crate::tree::ModuleTree;

/// How many re-exports a path may pass through before resolution stops.
const MAX_HOPS: usize = 16;

#[derive(Default)]
struct Scope {
    defined: BTreeSet<String>,
    /// Name in scope -> the absolute path it stands for.
    aliases: BTreeMap<String, Vec<String>>,
    /// Absolute paths of `use path::*`.
    globs: Vec<Vec<String>>,
}

/// Every module's names, for one crate.
pub(crate) struct Scopes<'a> {
    tree: &'a ModuleTree,
    scopes: BTreeMap<(usize, Vec<String>), Scope>,
}

impl<'a> Scopes<'a> {
    pub(crate) fn read(tree: &'a ModuleTree) -> Self {
        let mut scopes = Self {
            tree,
            scopes: BTreeMap::new(),
        };
        for file in 0..tree.files().len() {
            let (root, module) = tree.file_module(file).clone();
            scopes.collect(root, module, &tree.parsed(file).items);
        }
        scopes
    }

    fn collect(&mut self, root: usize, module: Vec<String>, items: &[syn::Item]) {
        for item in items {
            let name = match item {
                syn::Item::Fn(i) => Some(&i.sig.ident),
                syn::Item::Struct(i) => Some(&i.ident),
                syn::Item::Enum(i) => Some(&i.ident),
                syn::Item::Union(i) => Some(&i.ident),
                syn::Item::Const(i) => Some(&i.ident),
                syn::Item::Static(i) => Some(&i.ident),
                syn::Item::Type(i) => Some(&i.ident),
                syn::Item::Trait(i) => Some(&i.ident),
                syn::Item::Macro(i) => i.ident.as_ref(),
                syn::Item::Use(u) => {
                    let mut leaves = Vec::new();
                    use_leaves(&mut Vec::new(), &u.tree, &mut leaves);
                    for (name, path) in leaves {
                        let Some(target) = self.absolute_in(root, &module, &path) else {
                            continue;
                        };
                        let scope = self.scopes.entry((root, module.clone())).or_default();
                        match name {
                            Some(name) => {
                                scope.aliases.insert(name, target);
                            }
                            None => scope.globs.push(target),
                        }
                    }
                    None
                }
                syn::Item::Mod(m) => {
                    if let Some((_, inner)) = &m.content {
                        let mut child = module.clone();
                        child.push(m.ident.to_string());
                        self.collect(root, child, inner);
                    }
                    None
                }
                _ => None,
            };
            if let Some(name) = name {
                let scope = self.scopes.entry((root, module.clone())).or_default();
                scope.defined.insert(name.to_string());
            }
        }
    }

    /// `segments`, written in `module`, as a path from the crate root, when
    /// it names something of this crate; `None` for other crates and local
    /// names.
    pub(crate) fn absolute_in(
        &self,
        root: usize,
        module: &[String],
        segments: &[String],
    ) -> Option<Vec<String>> {
        let first = segments.first()?;
        match first.as_str() {
            "crate" => Some(segments[1..].to_vec()),
            "self" => Some([module, &segments[1..]].concat()),
            "super" => {
                let mut base = module.to_vec();
                let mut rest = segments;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
                Some([base.as_slice(), rest].concat())
            }
            name => {
                let child = [module, &[name.to_string()]].concat();
                if self.tree.is_module(root, &child) {
                    return Some([module, segments].concat());
                }
                let alias = self
                    .scopes
                    .get(&(root, module.to_vec()))?
                    .aliases
                    .get(name)?;
                Some([alias.as_slice(), &segments[1..]].concat())
            }
        }
    }

    /// The module that defines what the absolute `path` names, following
    /// re-exports and globs.
    pub(crate) fn defining_module(&self, root: usize, path: &[String]) -> Vec<String> {
        self.resolve(root, path, 0)
    }

    fn resolve(&self, root: usize, path: &[String], hops: usize) -> Vec<String> {
        let mut module: Vec<String> = Vec::new();
        for (i, segment) in path.iter().enumerate() {
            let child = [module.as_slice(), std::slice::from_ref(segment)].concat();
            if self.tree.is_module(root, &child) {
                module = child;
                continue;
            }
            if hops >= MAX_HOPS {
                return module;
            }
            let Some(scope) = self.scopes.get(&(root, module.clone())) else {
                return module;
            };
            if scope.defined.contains(segment) {
                return module;
            }
            if let Some(target) = scope.aliases.get(segment) {
                return self.resolve(
                    root,
                    &[target.as_slice(), &path[i + 1..]].concat(),
                    hops + 1,
                );
            }
            for glob in &scope.globs {
                if self.has_name(root, glob, segment) {
                    let through = [glob.as_slice(), &path[i..]].concat();
                    return self.resolve(root, &through, hops + 1);
                }
            }
            return module;
        }
        module
    }

    fn has_name(&self, root: usize, module: &[String], name: &str) -> bool {
        let child = [module, &[name.to_string()]].concat();
        self.tree.is_module(root, &child)
            || self
                .scopes
                .get(&(root, module.to_vec()))
                .is_some_and(|s| s.defined.contains(name) || s.aliases.contains_key(name))
    }
}

/// A use tree's leaves: (the name it brings into scope, or `None` for a
/// glob; the path as written).
pub(crate) fn use_leaves(
    prefix: &mut Vec<String>,
    tree: &syn::UseTree,
    out: &mut Vec<(Option<String>, Vec<String>)>,
) {
    let leaf = |prefix: &[String], ident: &syn::Ident| {
        let mut path = prefix.to_vec();
        if ident != "self" {
            path.push(ident.to_string());
        }
        path
    };
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(prefix, &p.tree, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let path = leaf(prefix, &n.ident);
            let name = path.last().cloned();
            out.push((name, path));
        }
        syn::UseTree::Rename(r) => {
            let path = leaf(prefix, &r.ident);
            out.push((Some(r.rename.to_string()), path));
        }
        syn::UseTree::Glob(_) => out.push((None, prefix.clone())),
        syn::UseTree::Group(g) => {
            for item in &g.items {
                use_leaves(prefix, item, out);
            }
        }
    }
}
