//! A crate's module tree, read from its files as rustc finds them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{ArchError, read};

/// One crate root (`lib.rs`, `main.rs`) and everything it declares.
pub struct ModuleTree {
    files: Vec<PathBuf>,
    parsed: Vec<syn::File>,
    /// For each file, the crate root it belongs to and its module path.
    file_module: Vec<(usize, Vec<String>)>,
    /// (root, module path) -> the file holding the module's items (an
    /// inline module shares its parent's file).
    modules: BTreeMap<(usize, Vec<String>), usize>,
}

impl ModuleTree {
    /// Reads every module file reachable from the crate's roots.
    pub fn read(crate_dir: &Path) -> Result<Self, ArchError> {
        let src = crate_dir.join("src");
        let roots: Vec<PathBuf> = ["lib.rs", "main.rs"]
            .iter()
            .map(|name| src.join(name))
            .filter(|path| path.is_file())
            .collect();
        if roots.is_empty() {
            return Err(ArchError::NoRoot(crate_dir.to_path_buf()));
        }
        let mut tree = Self {
            files: Vec::new(),
            parsed: Vec::new(),
            file_module: Vec::new(),
            modules: BTreeMap::new(),
        };
        for (root, path) in roots.into_iter().enumerate() {
            tree.add_file(root, Vec::new(), path, src.clone())?;
        }
        Ok(tree)
    }

    /// The module files, in the order they were found.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    pub(crate) fn parsed(&self, file: usize) -> &syn::File {
        &self.parsed[file]
    }

    /// The crate root and module path of a file's top level.
    pub(crate) fn file_module(&self, file: usize) -> &(usize, Vec<String>) {
        &self.file_module[file]
    }

    /// The file that holds the longest module prefix of `path` (absolute,
    /// within `root`).
    pub(crate) fn file_of(&self, root: usize, path: &[String]) -> Option<usize> {
        (0..=path.len())
            .rev()
            .find_map(|len| self.modules.get(&(root, path[..len].to_vec())))
            .copied()
    }

    /// Whether `path` (absolute, within `root`) is a module.
    pub(crate) fn is_module(&self, root: usize, path: &[String]) -> bool {
        self.modules.contains_key(&(root, path.to_vec()))
    }

    fn add_file(
        &mut self,
        root: usize,
        module: Vec<String>,
        path: PathBuf,
        child_dir: PathBuf,
    ) -> Result<(), ArchError> {
        let text = read(&path)?;
        let parsed = syn::parse_file(&text).map_err(|e| ArchError::Parse {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let file = self.files.len();
        self.files.push(path.clone());
        self.file_module.push((root, module.clone()));
        self.parsed.push(parsed.clone());
        self.add_module(root, module, file, &path, child_dir, &parsed.items)
    }

    fn add_module(
        &mut self,
        root: usize,
        module: Vec<String>,
        file: usize,
        file_path: &Path,
        child_dir: PathBuf,
        items: &[syn::Item],
    ) -> Result<(), ArchError> {
        self.modules.insert((root, module.clone()), file);
        for item in items {
            let syn::Item::Mod(decl) = item else { continue };
            let name = decl.ident.to_string();
            let mut child = module.clone();
            child.push(name.clone());
            if let Some((_, inline)) = &decl.content {
                let dir = child_dir.join(&name);
                self.add_module(root, child, file, file_path, dir, inline)?;
                continue;
            }
            let (path, dir) = child_file(file_path, &child_dir, &name, &decl.attrs)?;
            self.add_file(root, child, path, dir)?;
        }
        Ok(())
    }
}

/// Where `mod name;` (declared in `file`, whose children live in
/// `child_dir`) is written, and where its own children go.
fn child_file(
    file: &Path,
    child_dir: &Path,
    name: &str,
    attrs: &[syn::Attribute],
) -> Result<(PathBuf, PathBuf), ArchError> {
    if let Some(custom) = path_attr(attrs) {
        let base = file.parent().unwrap_or(Path::new("."));
        let path = base.join(custom);
        let dir = children_of(&path);
        return Ok((path, dir));
    }
    let flat = child_dir.join(format!("{name}.rs"));
    let folder = child_dir.join(name).join("mod.rs");
    if flat.is_file() {
        Ok((flat.clone(), children_of(&flat)))
    } else if folder.is_file() {
        Ok((folder.clone(), children_of(&folder)))
    } else {
        Err(ArchError::MissingModule {
            path: file.to_path_buf(),
            name: name.to_string(),
            tried: vec![flat, folder],
        })
    }
}

/// The folder a file module's children are in: beside a `mod.rs`, in a
/// folder named for any other file.
fn children_of(path: &Path) -> PathBuf {
    let parent = path.parent().unwrap_or(Path::new("."));
    match path.file_stem().and_then(|s| s.to_str()) {
        Some("mod") | None => parent.to_path_buf(),
        Some(stem) => parent.join(stem),
    }
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|attr| {
        let syn::Meta::NameValue(nv) = &attr.meta else {
            return None;
        };
        if !nv.path.is_ident("path") {
            return None;
        }
        match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        }
    })
}
