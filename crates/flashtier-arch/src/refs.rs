//! The file-to-file edges of a crate: every path (in a `use` or in code)
//! that names something another file of the same crate defines.

use std::collections::BTreeSet;

use syn::visit::Visit;

use crate::scope::{Scopes, use_leaves};
use crate::tree::ModuleTree;

/// The edges (from file, to file) of `tree`, each once.
pub(crate) fn file_edges(tree: &ModuleTree) -> Vec<(usize, usize)> {
    let scopes = Scopes::read(tree);
    let mut edges = BTreeSet::new();
    for file in 0..tree.files().len() {
        let (root, module) = tree.file_module(file).clone();
        let mut walker = Walker {
            tree,
            scopes: &scopes,
            root,
            file,
            module,
            edges: &mut edges,
        };
        walker.visit_file(tree.parsed(file));
    }
    edges.into_iter().collect()
}

struct Walker<'a> {
    tree: &'a ModuleTree,
    scopes: &'a Scopes<'a>,
    root: usize,
    file: usize,
    /// The module the walker is in (inline modules push onto it).
    module: Vec<String>,
    edges: &'a mut BTreeSet<(usize, usize)>,
}

impl Walker<'_> {
    /// Records the edge for a path written in the current module.
    fn reference(&mut self, segments: &[String]) {
        let Some(absolute) = self.scopes.absolute_in(self.root, &self.module, segments) else {
            return;
        };
        let defining = self.scopes.defining_module(self.root, &absolute);
        if let Some(target) = self.tree.file_of(self.root, &defining)
            && target != self.file
            && !self.within_one_module(target)
        {
            self.edges.insert((self.file, target));
        }
    }
}

impl Walker<'_> {
    /// Whether `target` is this file's ancestor or descendant module: a
    /// module split over its folder (`mod.rs` defining a type, a child file
    /// implementing part of it) is one unit, not a cycle.
    fn within_one_module(&self, target: usize) -> bool {
        let (_, mine) = self.tree.file_module(self.file);
        let (_, theirs) = self.tree.file_module(target);
        mine.starts_with(theirs) || theirs.starts_with(mine)
    }
}

impl<'ast> Visit<'ast> for Walker<'_> {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        // A `mod name;` is structure, not an edge; an inline module's items
        // are walked as that module's. Test modules may reach anywhere.
        if cfg_test(&item.attrs) {
            return;
        }
        if let Some((_, items)) = &item.content {
            self.module.push(item.ident.to_string());
            for inner in items {
                self.visit_item(inner);
            }
            self.module.pop();
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if !cfg_test(&item.attrs) {
            syn::visit::visit_item_fn(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if cfg_test(&item.attrs) {
            return;
        }
        // A re-export (`pub use`, `pub(crate) use`) shapes the module's
        // interface, as `mod` does; what it names is resolved through it.
        if !matches!(item.vis, syn::Visibility::Inherited) {
            return;
        }
        let mut leaves = Vec::new();
        use_leaves(&mut Vec::new(), &item.tree, &mut leaves);
        for (_, path) in leaves {
            self.reference(&path);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.reference(&segments);
        }
        syn::visit::visit_path(self, path);
    }
}

/// Whether `attrs` hold `#[cfg(test)]`.
fn cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr
                .parse_args::<syn::Ident>()
                .is_ok_and(|ident| ident == "test")
    })
}
